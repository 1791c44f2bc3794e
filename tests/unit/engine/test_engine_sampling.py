"""Sampling math against hand-worked numbers."""

import math

import torch

from clawrl.engine.cpu.sampling import filter_logits, sample_next_tokens, token_logprobs
from clawrl.engine.generation import SamplingRow

# probabilities 0.5, 0.25, 0.125, 0.125 at temperature 1
LOGITS = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]]))


def kept(logits: torch.Tensor) -> list[int]:
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


def f(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, logits=LOGITS):
    return filter_logits(
        logits,
        torch.tensor([temperature]),
        torch.tensor([top_k]),
        torch.tensor([top_p]),
        torch.tensor([min_p]),
    )


def test_no_filter_keeps_everything():
    assert kept(f()) == [0, 1, 2, 3]


def test_top_k_keeps_the_k_most_likely():
    assert kept(f(top_k=2)) == [0, 1]
    assert kept(f(top_k=1)) == [0]


def test_top_p_is_the_smallest_prefix_reaching_p():
    # cumulative mass before each token: 0, .5, .75, .875
    assert kept(f(top_p=0.4)) == [0]
    assert kept(f(top_p=0.6)) == [0, 1]
    assert kept(f(top_p=0.7)) == [0, 1]
    assert kept(f(top_p=0.8)) == [0, 1, 2]


def test_top_p_always_keeps_the_most_likely_token():
    assert kept(f(top_p=1e-6)) == [0]


def test_min_p_is_relative_to_the_top_probability():
    assert kept(f(min_p=0.5)) == [0, 1]  # 0.25 >= 0.5 * 0.5
    assert kept(f(min_p=0.6)) == [0]


def test_temperature_scales_before_filtering():
    # at temperature 0.5 the probabilities become 16:4:1:1 / 22
    out = f(temperature=0.5, top_p=0.9)
    assert kept(out) == [0, 1]
    assert torch.allclose(out[0, 0] - out[0, 1], torch.tensor(2 * math.log(2)))


def test_filters_apply_per_row():
    logits = LOGITS.repeat(2, 1)
    out = filter_logits(
        logits,
        torch.tensor([1.0, 1.0]),
        torch.tensor([1, -1]),
        torch.tensor([1.0, 1.0]),
        torch.tensor([0.0, 0.0]),
    )
    assert torch.isfinite(out[0]).sum() == 1
    assert torch.isfinite(out[1]).sum() == 4


def test_greedy_rows_take_the_argmax():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0]])
    rows = [SamplingRow(temperature=0.0), SamplingRow(temperature=0.0)]
    assert sample_next_tokens(logits, rows, [None, None]).tolist() == [1, 0]


def test_top_k_1_is_greedy():
    assert SamplingRow(temperature=1.0, top_k=1).greedy


def test_seeded_sampling_is_reproducible_and_independent_of_batch_mates():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    rows = [SamplingRow(temperature=1.0, top_p=0.9)] * 3

    def draws(seed_row0: int, other_rows: list[int]):
        out = []
        g = torch.Generator().manual_seed(seed_row0)
        others = [torch.Generator().manual_seed(s) for s in other_rows]
        for _ in range(20):
            out.append(int(sample_next_tokens(logits, rows, [g, *others])[0]))
        return out

    assert draws(7, [1, 2]) == draws(7, [3, 4])
    assert draws(7, [1, 2]) != draws(8, [1, 2])


def test_sampling_never_leaves_the_filtered_set():
    logits = LOGITS.repeat(1, 1)
    g = torch.Generator().manual_seed(0)
    for _ in range(50):
        token = sample_next_tokens(logits, [SamplingRow(temperature=1.0, top_k=2)], [g])
        assert int(token[0]) in (0, 1)


def test_token_logprobs_are_of_the_raw_distribution():
    logp, top_vals, top_ids = token_logprobs(LOGITS, torch.tensor([1]), top_n=2)
    assert torch.allclose(logp, torch.log(torch.tensor([0.25])))
    assert top_ids.tolist() == [[0, 1]]
    assert torch.allclose(top_vals, torch.log(torch.tensor([[0.5, 0.25]])))
