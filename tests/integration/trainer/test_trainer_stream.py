"""The trainer on a real Redis with the tiny model: batches of trainable samples only, staleness
drop, dedupe of redelivered samples, bad samples and samples of another judging mode
dead-lettered, nothing left over lost."""

from __future__ import annotations

import asyncio
import logging
import shutil

import pytest
from redis.asyncio import Redis

from clawrl.common.proto.records_pb2 import SampleMode

from .helpers import counter, make_sample, pending, publish_all, settings_for, start_trainer

pytestmark = pytest.mark.integration

NO_STOP = asyncio.Event()


@pytest.fixture
async def redis(redis_url: str):
    client = Redis.from_url(redis_url)
    yield client
    await client.aclose()


async def one_step(trainer):
    collected = await trainer.intake.next_batch(
        trainer.state.policy_version, trainer.trained.__contains__, trainer.uncommitted, NO_STOP,
        block_ms=100,
    )  # fmt: skip
    return await trainer.step(collected)


async def test_masked_samples_do_not_fill_a_batch(redis, redis_url, tmp_path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="clawrl.trainer.training")
    settings = settings_for(redis_url, tmp_path)
    trainer = await start_trainer(settings, redis)
    samples = [
        make_sample("a:0", [10, 11]),
        make_sample("m:0", [12], mask_reason=2, loss_mask=[0.0]),
        make_sample("b:0", [13, 14, 15], reward=-1.0),
        make_sample("m:1", [16], loss_mask=[0.0]),  # all-zero mask, no reason given
        make_sample("c:0", [17]),
        make_sample("d:0", [18, 19]),
        make_sample("e:0", [20]),  # left over: must stay for the next step
    ]
    await publish_all(redis, settings, samples)
    report = await one_step(trainer)
    assert report.sample_ids == ("a:0", "b:0", "c:0", "d:0")
    assert "step 1: 4 samples, 36 tokens, staleness 0.00 (max 0), loss" in caplog.text  # one line
    assert report.figures["reward_mean"] == 0.5 and report.figures["tokens_per_second"] > 0
    assert counter(trainer, "clawrl_trainer_samples_consumed_total", kind="masked") == 2
    assert counter(trainer, "clawrl_trainer_samples_consumed_total", kind="trained") == 4
    assert await pending(redis, settings) == 0  # step committed: all acknowledged
    state, _ = trainer.store.latest_state()
    assert state.step == 1 and state.samples_trained == 4
    assert set(state.trained_ids) == {"a:0", "b:0", "c:0", "d:0"}

    # The left-over sample is not lost: it opens the next batch.
    await publish_all(redis, settings, [make_sample(f"f:{i}", [21]) for i in range(3)])
    report = await one_step(trainer)
    assert report.sample_ids == ("e:0", "f:0", "f:1", "f:2")


async def test_stale_samples_are_dropped(redis, redis_url, tmp_path) -> None:
    settings = settings_for(redis_url, tmp_path, rollout={"rollout_batch_size": 1,
                                                          "max_staleness": 1})  # fmt: skip
    trainer = await start_trainer(settings, redis)
    await publish_all(redis, settings, [make_sample(f"warm:{i}", [30]) for i in range(2)])
    await one_step(trainer)
    await one_step(trainer)
    assert trainer.state.policy_version == 2  # sync_interval 1: a version per step
    await publish_all(redis, settings, [
        make_sample("old:0", [31], policy_version=0),  # 2 versions behind: dropped
        make_sample("ok:0", [32], policy_version=1),
    ])  # fmt: skip
    report = await one_step(trainer)
    assert report.sample_ids == ("ok:0",)
    assert counter(trainer, "clawrl_trainer_samples_dropped_total", reason="stale") == 1
    assert await pending(redis, settings) == 0


async def test_a_redelivered_sample_is_not_trained_twice(redis, redis_url, tmp_path) -> None:
    settings = settings_for(redis_url, tmp_path, rollout={"rollout_batch_size": 2})
    trainer = await start_trainer(settings, redis)
    await publish_all(redis, settings, [make_sample("x:0", [40]), make_sample("x:1", [41])])
    await one_step(trainer)
    # The judge publishes x:0 again (its own at-least-once), and twice in one batch y:0.
    await publish_all(redis, settings, [
        make_sample("x:0", [40]), make_sample("y:0", [42]), make_sample("y:0", [42]),
        make_sample("z:0", [43]),
    ])  # fmt: skip
    report = await one_step(trainer)
    assert report.sample_ids == ("y:0", "z:0")
    assert counter(trainer, "clawrl_trainer_samples_dropped_total", reason="duplicate") == 2
    assert await pending(redis, settings) == 0
    assert trainer.store.latest_state()[0].samples_trained == 4


async def test_bad_samples_are_dead_lettered_with_the_reason(redis, redis_url, tmp_path) -> None:
    settings = settings_for(redis_url, tmp_path, rollout={"rollout_batch_size": 1})
    trainer = await start_trainer(settings, redis)
    await publish_all(redis, settings, [
        make_sample("bad:0", [40, 99999]),
        make_sample("bad:1", [40, 41], old_logprobs=[-1.0]),
        make_sample("bad:2", [40], loss_mask=[0.5]),
    ])  # fmt: skip
    await redis.xadd(settings.redis.samples_stream, {"id": "bad:3", "type": "x", "data": "?"})
    await publish_all(redis, settings, [make_sample("good:0", [41])])
    report = await one_step(trainer)
    assert report.sample_ids == ("good:0",)
    dead = await redis.xrange(settings.redis.deadletter_stream)
    reasons = {f[b"id"].decode(): f[b"reason"].decode() for _, f in dead}
    assert "response id 99999 is outside the vocabulary" in reasons["bad:0"]
    assert "old_logprobs has 1 entries for 2 response ids" in reasons["bad:1"]
    assert "loss_mask holds values other than 0 and 1" in reasons["bad:2"]
    assert "expected a clawrl.v1.Sample entry" in reasons["bad:3"]
    assert counter(trainer, "clawrl_trainer_samples_dropped_total", reason="invalid") == 3
    assert counter(trainer, "clawrl_trainer_samples_dropped_total", reason="undecodable") == 1
    assert await pending(redis, settings) == 0


async def test_a_stopped_batch_stays_pending_and_comes_back(redis, redis_url, tmp_path) -> None:
    settings = settings_for(redis_url, tmp_path)
    trainer = await start_trainer(settings, redis)
    await publish_all(redis, settings, [make_sample(f"p:{i}", [50 + i]) for i in range(3)])
    stop = asyncio.Event()
    run = asyncio.create_task(trainer.run(stop))
    for _ in range(100):  # the 3 samples are read (pending), the batch waits for a 4th
        if await pending(redis, settings) == 3:
            break
        await asyncio.sleep(0.05)
    stop.set()
    await run
    assert await pending(redis, settings) == 3
    # A new trainer process under the same consumer name takes them back first.
    again = await start_trainer(settings, redis)
    await publish_all(redis, settings, [make_sample("p:3", [53])])
    report = await one_step(again)
    assert report.sample_ids == ("p:0", "p:1", "p:2", "p:3")
    assert await pending(redis, settings) == 0


async def test_a_batch_the_backend_fails_on_is_dead_lettered(redis, redis_url, tmp_path) -> None:
    settings = settings_for(redis_url, tmp_path, rollout={"rollout_batch_size": 2})
    trainer = await start_trainer(settings, redis)  # kl_coef 0: no reference model loaded
    # Switched to a KL penalty without the reference model: the backend refuses the batch.
    trainer.settings = settings.model_copy(
        update={"ppo": settings.ppo.model_copy(update={"kl_coef": 0.1})}
    )
    await publish_all(redis, settings, [make_sample(f"k:{i}", [70 + i]) for i in range(4)])
    assert await one_step(trainer) is None
    dead = await redis.xrange(settings.redis.deadletter_stream)
    assert [f[b"id"] for _, f in dead] == [b"k:0", b"k:1"]
    assert all(b"reference model is not loaded" in f[b"reason"] for _, f in dead)
    assert counter(trainer, "clawrl_trainer_samples_dropped_total", reason="step_failed") == 2
    assert counter(trainer, "clawrl_trainer_step_failures_total") == 1
    # The stream goes on: the next batch trains once the configuration is whole again.
    trainer.settings = settings
    report = await one_step(trainer)
    assert report.sample_ids == ("k:2", "k:3") and trainer.state.step == 1
    assert await pending(redis, settings) == 0


async def test_a_checkpoint_that_cannot_be_written_stops_the_trainer(
    redis, redis_url, tmp_path
) -> None:
    settings = settings_for(redis_url, tmp_path, rollout={"rollout_batch_size": 2})
    trainer = await start_trainer(settings, redis)
    shutil.rmtree(tmp_path / "policy")
    (tmp_path / "policy").write_text("not a directory")  # the export cannot be renamed there
    await publish_all(redis, settings, [make_sample(f"w:{i}", [80 + i]) for i in range(2)])
    with pytest.raises(NotADirectoryError):
        await one_step(trainer)
    assert counter(trainer, "clawrl_trainer_checkpoint_failures_total") == 1
    assert await pending(redis, settings) == 2  # nothing acknowledged: trained again on restart
    assert trainer.store.latest_state() is None


async def test_samples_of_another_mode_are_dead_lettered(redis, redis_url, tmp_path) -> None:
    # An opd judge beside a grpo trainer trained all-zero advantages before.
    settings = settings_for(redis_url, tmp_path, rollout={"rollout_batch_size": 2})
    assert settings.advantage.estimator == "grpo"
    trainer = await start_trainer(settings, redis)
    opd = SampleMode.SAMPLE_MODE_OPD
    await publish_all(redis, settings, [
        make_sample("o:0", [10], reward=0.0, mode=opd, has_teacher=True, teacher_logprobs=[-1.0]),
        make_sample("r:0", [11]),
        make_sample("u:0", [12], mode=SampleMode.SAMPLE_MODE_UNSPECIFIED),
        make_sample("r:1", [13], reward=-1.0),
    ])  # fmt: skip
    collected = await trainer.intake.next_batch(
        0, trainer.trained.__contains__, trainer.uncommitted, asyncio.Event(), block_ms=100
    )
    report = await trainer.step(collected)
    assert report.sample_ids == ("r:0", "r:1")
    assert counter(trainer, "clawrl_trainer_samples_dropped_total", reason="mode") == 2
    dead = await redis.xrange(settings.redis.deadletter_stream)
    reasons = {f[b"id"].decode(): f[b"reason"].decode() for _, f in dead}
    assert reasons["o:0"].startswith(
        "sample judged in mode 'opd' cannot feed the trainer's estimator 'grpo', which trains "
        "samples of judging.mode = 'rl'"
    )
    assert reasons["u:0"].startswith(
        "sample judged in mode 'unspecified (SAMPLE_MODE_UNSPECIFIED)'"
    )
    assert await pending(redis, settings) == 0


async def test_a_batch_without_signal_takes_no_step_and_makes_no_version(
    redis, redis_url, tmp_path, caplog
) -> None:
    """Every turn neutral (reward 0, e.g. promoted by the at-least-one rule) or every reward
    alike under the batch baseline: advantages all 0, so no step, no version, and the samples
    are acknowledged and counted; the next batch with a signal steps as usual."""
    caplog.set_level(logging.WARNING, logger="clawrl.trainer.training")
    settings = settings_for(redis_url, tmp_path, advantage={"normalize_groups": True,
                                                            "group_by": "batch"})  # fmt: skip
    trainer = await start_trainer(settings, redis)
    neutral = [make_sample(f"n:{i}", [40 + i], reward=0.0, promoted=True) for i in range(4)]
    alike = [make_sample(f"a:{i}", [50 + i], reward=1.0) for i in range(4)]
    await publish_all(redis, settings, neutral + alike)
    assert await one_step(trainer) is None
    assert await one_step(trainer) is None
    assert trainer.state.step == 0 and trainer.state.policy_version == 0
    assert trainer.store.latest_state() is None or trainer.store.latest_state()[0].step == 0
    assert await redis.xlen(settings.redis.versions_stream) == 0
    assert await pending(redis, settings) == 0  # acknowledged: nothing waits to be redelivered
    assert counter(trainer, "clawrl_trainer_batches_skipped_total", reason="no_signal") == 2
    assert counter(trainer, "clawrl_trainer_samples_dropped_total", reason="no_signal") == 8
    assert "no step on 4 samples: every advantage is 0" in caplog.text
    mixed = [make_sample(f"m:{i}", [60 + i], reward=1.0 if i % 2 else -1.0) for i in range(4)]
    await publish_all(redis, settings, mixed)
    report = await one_step(trainer)
    assert report.step == 1 and trainer.state.policy_version == 1
