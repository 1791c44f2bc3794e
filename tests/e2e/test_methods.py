"""`make run --method combine` end to end (tiny model): the reward plug-in scores each turn, the
hint plug-in reads the corrective sentences of the user's next message as hint candidates, the
policy engine's base weights teach (no judge engine is started), one candidate is selected by
top-K agreement, and the trainer steps on the combined samples."""

from __future__ import annotations

import os
from collections.abc import Iterator

import httpx
import pytest
import redis
from openai import OpenAI

from clawrl.common.proto.records_pb2 import MaskReason, Sample
from clawrl.common.records import decode_entry
from tests.conftest import REPO, wait_until
from tests.e2e.local_stack import MODEL, local_stack

pytestmark = [pytest.mark.e2e, pytest.mark.integration]

HINT_FN = "clawrl.judge.hint_examples:corrective_sentences"
CORRECTION = "No, that is too long. Keep it to one line next time. Next: what is Redis?"


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[dict[str, int]]:
    run_dir = tmp_path_factory.mktemp("methods")
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    args = ("--method", "combine", "--reward-fn", "tests.e2e.learning_reward:preferred_half",
            "--hint-candidates", "3", "--hint-select", "sequence_optimal",
            "--batch-size", "2")  # fmt: skip
    with local_stack(run_dir, ("sync-metrics", "/metrics"), *args, env=env) as ports:
        yield ports


def trainer_steps(port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    lines = [ln for ln in text.splitlines() if ln.startswith("clawrl_trainer_steps_total ")]
    return float(lines[0].split()[1]) if lines else 0.0


def test_combine_trains_on_rewards_and_hints_taught_by_the_policy_engine(stack) -> None:
    with pytest.raises(httpx.ConnectError):  # no judge engine: nothing asks it
        httpx.get(f"http://127.0.0.1:{stack['judge']}/health", timeout=2)
    client = OpenAI(base_url=f"http://127.0.0.1:{stack['gateway']}/v1", api_key="local")
    for i in range(4):
        messages = [{"role": "user", "content": f"Tell me about queue number {i}."}]
        first = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, extra_headers={"X-Session-Id": f"m{i}"}
        )
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": CORRECTION}]  # fmt: skip
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8,
            extra_headers={"X-Session-Id": f"m{i}", "X-Session-Done": "true"},
        )  # fmt: skip
    r = redis.Redis(port=stack["redis"])

    def first_turns() -> list[Sample]:
        found = [decode_entry(f, Sample) for _, f in r.xrange("clawrl:samples")]
        return [s for s in found if s.turn_index == 0]

    wait_until(lambda: len(first_turns()) == 4, 300, "the first turns' samples")
    for sample in first_turns():
        assert sample.mask_reason == MaskReason.MASK_REASON_UNSPECIFIED
        assert sample.hint_source == f"hint_fn:{HINT_FN}"
        # "No, that is too long.", "Keep it to one line next time.", and both together.
        assert sample.hint_candidates == 3
        assert sample.hint in ("No, that is too long.", "Keep it to one line next time.",
                               "No, that is too long. Keep it to one line next time.")  # fmt: skip
        assert sample.has_teacher and len(sample.teacher_logprobs) == len(sample.response_ids)
        assert sample.reward_source == "reward_fn:tests.e2e.learning_reward:preferred_half"
    wait_until(lambda: trainer_steps(stack["trainer-metrics"]) >= 1, 300, "a trainer step")
