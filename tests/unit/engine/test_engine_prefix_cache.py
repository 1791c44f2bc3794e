"""The radix tree of cached prefixes: longest-prefix match, splits, LRU eviction, flush."""

import torch

from clawrl.engine.cpu.prefix_cache import PrefixCache

LAYERS, HEADS, DIM = 2, 1, 2


def kv_of(ids: list[int]):
    """Fake KV whose values record the token ids, so slices can be checked."""
    t = torch.tensor(ids, dtype=torch.float32).view(1, -1, 1).expand(HEADS, len(ids), DIM)
    return [(t.clone(), -t.clone()) for _ in range(LAYERS)]


def ids_in(kv) -> list[int]:
    return [int(x) for x in kv[0][0][0, :, 0]]


def test_longest_prefix_match_and_split():
    cache = PrefixCache(budget_tokens=100)
    assert cache.insert([1, 2, 3, 4, 5], kv_of([1, 2, 3, 4, 5])) == 5
    assert cache.insert([1, 2, 3, 9], kv_of([1, 2, 3, 9])) == 1  # splits after [1, 2, 3]
    assert cache.tokens == 6
    n, kv = cache.match([1, 2, 3, 4, 7], limit=5)
    assert n == 4 and ids_in(kv) == [1, 2, 3, 4]
    assert torch.equal(kv[1][1], -kv[1][0])
    n, kv = cache.match([1, 2, 3, 9, 9], limit=5)
    assert n == 4 and ids_in(kv) == [1, 2, 3, 9]
    n, kv = cache.match([1, 2, 3, 4, 5], limit=2)  # never beyond the limit
    assert n == 2 and ids_in(kv) == [1, 2]
    assert cache.match([7, 1], limit=2) == (0, None)


def test_matched_kv_is_a_copy():
    cache = PrefixCache(budget_tokens=100)
    cache.insert([1, 2, 3], kv_of([1, 2, 3]))
    _, kv = cache.match([1, 2, 3], limit=3)
    kv[0][0].zero_()
    assert ids_in(cache.match([1, 2, 3], limit=3)[1]) == [1, 2, 3]


def test_least_recently_used_leaves_go_first_under_the_budget():
    cache = PrefixCache(budget_tokens=8)
    cache.insert([1, 2, 3, 4], kv_of([1, 2, 3, 4]))
    cache.insert([5, 6, 7, 8], kv_of([5, 6, 7, 8]))
    cache.match([1, 2, 3, 4], limit=4)  # [1..4] is now more recent than [5..8]
    cache.insert([9, 10, 11], kv_of([9, 10, 11]))
    assert cache.tokens == 7
    assert cache.match([5, 6, 7, 8], limit=4) == (0, None)
    assert cache.match([1, 2, 3, 4], limit=4)[0] == 4
    assert cache.match([9, 10, 11], limit=3)[0] == 3
    # a run larger than the whole budget is not kept
    cache.insert(list(range(20, 40)), kv_of(list(range(20, 40))))
    assert cache.tokens <= 8


def test_flush_empties_the_tree():
    cache = PrefixCache(budget_tokens=100)
    cache.insert([1, 2, 3], kv_of([1, 2, 3]))
    assert cache.flush() == 3
    assert cache.tokens == 0 and cache.match([1, 2, 3], limit=3) == (0, None)
