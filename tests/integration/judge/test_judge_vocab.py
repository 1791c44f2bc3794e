"""opd/combine refuse to start when the judge engine's tokenizer is not the policy's: a judge
model whose tokenizer swaps two special tokens (a copy of smollm2-tiny with <|im_start|> and
<|im_end|> exchanged) is refused with the ids named; the policy's own model is accepted."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from clawrl.common.models import SMOLLM2_TINY, resolve_model_dir
from clawrl.common.settings import ModelSettings
from clawrl.judge.service import running
from clawrl.judge.vocab import TokenizerMismatch

from .helpers import judge_settings

pytestmark = pytest.mark.integration


def swapped_tokenizer_model(root: Path) -> Path:
    """smollm2-tiny with ids 1 and 2 (<|im_start|>, <|im_end|>) exchanged in its tokenizer."""
    source = resolve_model_dir(ModelSettings(path=SMOLLM2_TINY))
    target = root / "tiny-swapped"
    shutil.copytree(source, target)
    spec = json.loads((target / "tokenizer.json").read_text())
    swap = {1: 2, 2: 1}
    for token in spec["added_tokens"]:
        token["id"] = swap.get(token["id"], token["id"])
    vocab = spec["model"]["vocab"]
    vocab["<|im_start|>"], vocab["<|im_end|>"] = vocab["<|im_end|>"], vocab["<|im_start|>"]
    (target / "tokenizer.json").write_text(json.dumps(spec))
    return target


@pytest.fixture(scope="module")
def swapped_engine(engine_factory, tmp_path_factory) -> str:
    return engine_factory(str(swapped_tokenizer_model(tmp_path_factory.mktemp("judge-model"))))


@pytest.mark.parametrize("mode", ["opd", "combine"])
async def test_a_judge_engine_with_another_tokenizer_is_refused(
    redis_url: str, swapped_engine: str, mode: str
) -> None:
    settings = judge_settings(
        redis_url, judging={"mode": mode}, backend={"engine_url": swapped_engine},
        model={"path": SMOLLM2_TINY},
    )  # fmt: skip
    with pytest.raises(TokenizerMismatch) as refused:
        async with running(settings, serve=False):
            pytest.fail("the judge started")
    message = str(refused.value)
    assert message.startswith(
        f"judging.mode={mode} scores the policy's token ids with the judge engine at "
        f"{swapped_engine}, but its tokenizer differs from the policy's: 2 of "
    )
    assert "id 1: policy '<|im_start|>', engine '<|im_end|>'" in message
    assert "id 2: policy '<|im_end|>', engine '<|im_start|>'" in message


async def test_the_policys_own_tokenizer_is_accepted(redis_url: str, engine_factory) -> None:
    settings = judge_settings(
        redis_url, judging={"mode": "opd"}, backend={"engine_url": engine_factory(SMOLLM2_TINY)},
        model={"path": SMOLLM2_TINY},
    )  # fmt: skip
    async with running(settings, serve=False) as service:
        assert service.judge.teacher is not None
