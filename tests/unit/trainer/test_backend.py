"""The batch layout shared by every backend: micro-batches by token budget, sub-batches, and the
logit rows that predict each response token."""

import torch

from clawrl.trainer.backend import TrainBatch, micro_batches, response_rows, response_targets


def batch() -> TrainBatch:
    # sample 0: prompt [5, 6], response [7, 8, 9]; sample 1: prompt [1], response [2]
    return TrainBatch(
        sample_ids=("s:0", "s:1"),
        input_ids=torch.tensor([[5, 6, 7, 8, 9], [1, 2, 0, 0, 0]]),
        prompt_lengths=torch.tensor([2, 1]),
        response_lengths=torch.tensor([3, 1]),
        loss_mask=torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]),
        rollout_logp=torch.tensor([[-1.0, -2.0, -3.0], [-4.0, 0.0, 0.0]]),
        teacher_logp=torch.zeros(2, 3),
        reward=torch.tensor([1.0, -1.0]),
        has_teacher=torch.tensor([False, False]),
        policy_versions=torch.tensor([0, 0]),
        teacher_topk_ids=torch.zeros(2, 3, 2, dtype=torch.long),
        teacher_topk_logp=torch.zeros(2, 3, 2),
    )


def test_micro_batches_respect_the_token_budget() -> None:
    assert micro_batches([10, 10, 10, 10], max_tokens=20) == [[0, 1], [2, 3]]
    # padded size counts: 5 and 30 together would be 60 > 40
    assert micro_batches([5, 30, 8], max_tokens=40) == [[0], [1], [2]]
    assert micro_batches([100, 3], max_tokens=50) == [[0], [1]]  # too long alone: own group
    assert micro_batches([], max_tokens=8) == []


def test_response_targets_and_rows_align() -> None:
    b = batch()
    assert response_targets(b).tolist() == [[7, 8, 9], [2, 0, 0]]
    # a "logit" that is the position index: row j of sample i must be prompt_len - 1 + j
    positions = torch.arange(5).expand(2, 5)[..., None].float()
    rows = response_rows(positions, b.prompt_lengths, 3)[..., 0]
    assert rows.tolist() == [[1.0, 2.0, 3.0], [0.0, 1.0, 2.0]]


def test_select_trims_to_the_sub_batch() -> None:
    sub = batch().select([1])
    assert sub.sample_ids == ("s:1",)
    assert sub.input_ids.tolist() == [[1, 2]]
    assert sub.loss_mask.tolist() == [[1.0]]
    assert sub.rollout_logp.tolist() == [[-4.0]]
    assert sub.teacher_topk_ids.shape == (1, 1, 2)
    assert sub.reward.tolist() == [-1.0]
    targets = batch().with_targets(torch.ones(2, 3), torch.full((2, 3), 2.0))
    assert targets.select([0]).advantages.tolist() == [[2.0, 2.0, 2.0]]
