"""The judge process: `running(settings)` builds every client from the settings (Redis, the
judge engine, the vote backend, the policy's chat template, the reward plug-in), the Judge core,
the stream workers and both servers, and tears them down in reverse order."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

from redis.asyncio import Redis
from redis.asyncio.retry import Retry  # the asyncio one: redis-py awaits its calls
from redis.backoff import ExponentialBackoff

from clawrl.common import redis_client
from clawrl.common.chat import ChatRenderer
from clawrl.common.models import context_length, resolve_model_dir
from clawrl.common.sglang_client import SGLangClient
from clawrl.judge.backends import OpenAIVotes, SGLangVotes, VoteBackend
from clawrl.judge.core import Judge
from clawrl.judge.episodes import OutcomeWaiter
from clawrl.judge.hint_fns import load_hint_fn
from clawrl.judge.metrics import JudgeMetrics
from clawrl.judge.prompts import Budget
from clawrl.judge.rewards import load_reward_fn
from clawrl.judge.server import start_grpc, start_http
from clawrl.judge.settings import JudgeSettings
from clawrl.judge.store import JudgeStore, StoreConfig
from clawrl.judge.teacher import Teacher
from clawrl.judge.verdicts import LogprobPRM, tokenizer_yes_no_ids
from clawrl.judge.vocab import TokenizerMismatch, wait_and_check_tokenizer
from clawrl.judge.worker import JudgeConsumer, Worker, housekeeping

log = logging.getLogger(__name__)


@dataclass
class JudgeService:
    """What `running` built; the worker tasks run until `stop` is set."""

    settings: JudgeSettings
    judge: Judge
    metrics: JudgeMetrics
    redis: Redis
    store: JudgeStore
    engine: SGLangClient | None
    workers: list[Worker]
    grpc_port: int = 0
    metrics_port: int = 0
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    # Why a worker or the housekeeping ended before `stop` (then set): the process exits 1.
    failed: BaseException | None = None

    def supervise(self, task: asyncio.Task) -> None:
        """A done-callback for the long-running tasks: one that ends before `stop` (an error
        its loop does not handle) stops the whole judge, counted and logged, rather than leave
        its shard unread while the rest looks healthy."""
        if task.cancelled() or self.stop.is_set():
            return
        error = task.exception() or RuntimeError(f"{task.get_name()} returned")
        log.error("%s stopped: %r; the judge stops so that it is restarted", task.get_name(),
                  error, exc_info=error)  # fmt: skip
        self.metrics.errors.labels("worker").inc()
        self.failed = error
        self.stop.set()

    async def ready(self) -> dict[str, bool]:
        checks = {}
        try:
            checks["redis"] = bool(await asyncio.wait_for(self.redis.ping(), 2))
        except Exception:
            checks["redis"] = False
        if self.engine is not None:
            checks["engine"] = await self.engine.health()
        return checks


def create_redis(settings: JudgeSettings) -> Redis:
    # A blocking XREADGROUP must not outlast the socket timeout.
    timeout = max(settings.redis.socket_timeout_s, settings.workers.block_ms / 1000 + 2)
    return redis_client.connect(
        settings.redis,
        socket_timeout=timeout,
        socket_connect_timeout=settings.redis.socket_timeout_s,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), 2),
        health_check_interval=30,
    )


def build_backend(
    settings: JudgeSettings, engine: SGLangClient | None, policy: ChatRenderer | None
) -> VoteBackend | None:
    b = settings.backend
    if not settings.needs_votes:
        return None
    if b.kind == "openai":
        assert b.openai_base_url and b.openai_model  # checked by the settings
        return OpenAIVotes(
            base_url=b.openai_base_url,
            model=b.openai_model,
            api_key=b.openai_key(),
            temperature=b.temperature,
            max_new_tokens=b.max_new_tokens,
            timeout_s=b.timeout_s,
        )
    assert engine is not None
    model = settings.vote_model
    renderer = policy if settings.judge_model is None and policy else None
    renderer = renderer or ChatRenderer.from_settings(model)
    window = b.context_tokens or context_length(model, resolve_model_dir(model))
    return SGLangVotes(
        engine,
        renderer,
        context_tokens=window,
        temperature=b.temperature,
        max_new_tokens=b.max_new_tokens,
    )


def build_judge(
    settings: JudgeSettings,
    metrics: JudgeMetrics,
    engine: SGLangClient | None,
    policy_engine: SGLangClient | None = None,
) -> Judge:
    """The core with its backend, teacher and plug-ins (loads tokenizers: call it in a thread
    from async code). `engine`: the judge engine; `policy_engine`: the policy engine, for the
    teacher.engine=policy teacher and the student's top-K of the hint selection."""
    policy = ChatRenderer.from_settings(settings.model) if settings.needs_teacher else None
    teacher = None
    if settings.needs_teacher:
        t = settings.teacher
        teaching = policy_engine if t.engine == "policy" else engine
        student = policy_engine if settings.student_reference else None
        assert teaching is not None and policy is not None
        teacher = Teacher(teaching, policy, t.top_k, student=student)
    j, p = settings.judging, settings.prompt
    backend = build_backend(settings, engine, policy)
    return Judge(
        mode=j.mode,
        metrics=metrics,
        votes=j.votes,
        backend=backend,
        teacher=teacher,
        reward_fn=load_reward_fn(j.reward_fn, j.reward_fn_args) if j.reward_fn else None,
        budget=Budget(p.context_messages, p.max_message_chars, p.max_response_chars),
        min_hint_chars=j.min_hint_chars,
        keep_vote_text=settings.audit.keep_vote_text,
        promote_first_in_session=j.promote_first_in_session,
        feedback=settings.feedback,
        logprob_prm=build_logprob_prm(settings, engine, backend),
        hint_fn=load_hint_fn(j.hint_fn, j.hint_fn_args) if j.hint_fn else None,
        hint_votes=j.hint_votes,
        hint_candidates=j.hint_candidates,
        hint_select=j.hint_select,
        select_top_k=settings.teacher.select_top_k,
        prm_step_coef=settings.episodes.prm_step_coef,
    )


def build_logprob_prm(
    settings: JudgeSettings, engine: SGLangClient | None, backend: VoteBackend | None
) -> LogprobPRM | None:
    """judging.prm=logprob: the yes/no verdict on the judge engine, with the yes/no ids of the
    judge model's tokenizer (the backend's renderer, which renders its prompts)."""
    j = settings.judging
    if j.prm != "logprob" or not settings.uses_prm:
        return None
    assert engine is not None and isinstance(backend, SGLangVotes)  # checked by the settings
    ids = tokenizer_yes_no_ids(backend.renderer.tokenizer)
    return LogprobPRM(engine, ids, top_k=j.prm_top_logprobs, margin=j.prm_margin)


def build_store(
    settings: JudgeSettings, redis: Redis, metrics: JudgeMetrics | None = None, shard: int = 0
) -> JudgeStore:
    """The store of one shard (common/shards.py): its turn, sample and audit streams, and the
    done markers, session states and feedback of its turns, all in its hash slot."""
    w, r = settings.workers, settings.redis
    shards = r.shards()
    feedback = settings.feedback
    return JudgeStore(
        redis,
        StoreConfig(
            prefix=shards.name(w.key_prefix, shard),
            turns_stream=shards.name(r.turns_stream, shard),
            samples_stream=shards.name(r.samples_stream, shard),
            audit_stream=shards.name(settings.audit.stream, shard),
            group=w.group,
            samples_maxlen=r.stream_maxlen,
            audit_maxlen=settings.retention.audit_maxlen,
            done_ttl_s=w.done_ttl_s,
            session_ttl_s=w.session_ttl_s,
            feedback_prefix=shards.name(feedback.key_prefix, shard) if feedback.enabled else None,
        ),
        metrics,
    )


def build_workers(
    settings: JudgeSettings,
    redis: Redis,
    stores: list[JudgeStore],
    judge: Judge,
    metrics: JudgeMetrics,
) -> list[Worker]:
    """`workers.workers` workers per shard (`stores[k]` is shard k's), each reading its shard's
    turn stream; consumer names carry the shard when there are several."""
    w, shards = settings.workers, settings.redis.shards()
    workers = []
    for shard, i in itertools.product(range(shards.count), range(w.workers)):
        name = w.consumer if w.workers == 1 else f"{w.consumer}-{i}"
        store = stores[shard]
        consumer = JudgeConsumer(
            redis,
            stream=store.config.turns_stream,
            group=w.group,
            consumer=name if shards.count == 1 else f"{name}-s{shard}",
            deadletter_stream=shards.name(settings.redis.deadletter_stream, shard),
            max_deliveries=w.max_deliveries,
            claim_idle_ms=w.claim_idle_ms,
            metrics=metrics,
            store=store,
        )
        outcomes = None
        if settings.waits_for_outcomes:
            prefix = shards.name(settings.episodes.key_prefix, shard)
            outcomes = OutcomeWaiter(redis, prefix, settings.episodes, metrics)
        workers.append(
            Worker(consumer, store, judge, metrics, w, outcomes, settings.episodes.max_waiting)
        )
    return workers


async def refuse_another_tokenizer(
    settings: JudgeSettings, judge: Judge, engines: Sequence[SGLangClient]
) -> None:
    """opd/combine: wait for the teacher's engine and stop the start (closing `engines`, what
    was built) unless it reads the policy's token ids as the policy does (see `vocab`)."""
    assert judge.teacher is not None
    engine = judge.teacher.engine  # the teacher's: the judge engine, or the policy engine
    w = settings.workers
    try:
        tokenizer = judge.teacher.renderer.tokenizer
        mode = settings.judging.mode
        await wait_and_check_tokenizer(engine, tokenizer, mode, w.retry_initial_s, w.retry_max_s)
    except BaseException as exc:
        if isinstance(exc, TokenizerMismatch):
            log.error("refusing to start: %s", exc)
        if judge.backend is not None:
            await judge.backend.aclose()
        for client in engines:
            await client.aclose()
        raise


def warn_feedback_mismatch(settings: JudgeSettings) -> None:
    """The gateway finds the judge's done markers and audit stream through [feedback]: when
    they differ from this judge's, late feedback is neither recognised nor audited there."""
    f = settings.feedback
    if not f.enabled:
        return
    if f.judge_key_prefix != settings.workers.key_prefix:
        log.warning("feedback.judge_key_prefix (%s) is not workers.key_prefix (%s): gateways "
                    "with these settings do not see this judge's done markers, so feedback "
                    "arriving after a turn's sample was published is not recognised as late",
                    f.judge_key_prefix, settings.workers.key_prefix)  # fmt: skip
    if f.audit_stream != settings.audit.stream:
        log.warning("feedback.audit_stream (%s) is not audit.stream (%s): gateways with these "
                    "settings write late feedback to another stream than this judge's audit "
                    "trail", f.audit_stream, settings.audit.stream)  # fmt: skip


@contextlib.asynccontextmanager
async def running(settings: JudgeSettings, *, serve: bool = True) -> AsyncIterator[JudgeService]:
    """Build everything, start the workers (and the servers when `serve`), yield the service;
    on exit stop reading, drain in-flight turns and close every client."""
    metrics = JudgeMetrics()
    b, t = settings.backend, settings.teacher
    engine = policy_engine = None
    judge_teaches = settings.needs_teacher and t.engine == "judge"
    if b.engine_url and (judge_teaches or (settings.needs_votes and b.kind == "sglang")):
        engine = SGLangClient(
            b.engine_url, timeout_s=b.timeout_s, max_connections=b.max_connections
        )
    policy_teaches = settings.needs_teacher and t.engine == "policy"
    if t.policy_engine_url and (policy_teaches or settings.student_reference):
        policy_engine = SGLangClient(
            t.policy_engine_url, timeout_s=b.timeout_s, max_connections=b.max_connections
        )
    engines = [c for c in (engine, policy_engine) if c is not None]
    judge = await asyncio.to_thread(build_judge, settings, metrics, engine, policy_engine)
    if judge.teacher is not None:
        await refuse_another_tokenizer(settings, judge, engines)
    redis = create_redis(settings)
    stores = [build_store(settings, redis, metrics, k) for k in range(settings.redis.stream_shards)]
    warn_feedback_mismatch(settings)
    workers = build_workers(settings, redis, stores, judge, metrics)
    service = JudgeService(
        settings, judge, metrics, redis, stores[0], engine or policy_engine, workers
    )
    tasks = [asyncio.create_task(w.run(service.stop), name=f"judge-worker-{i}")
             for i, w in enumerate(workers)]  # fmt: skip
    # Samples too: the trainers' group decides what is acknowledged (nothing is trimmed
    # before a group exists); the XADD cap is only a backstop.
    retention_streams: dict[str, str | Sequence[str]] = {
        "turns": [store.config.turns_stream for store in stores],
        "samples": [store.config.samples_stream for store in stores],
    }
    shard_consumers = [workers[k * settings.workers.workers].consumer for k in range(len(stores))]
    tasks.append(asyncio.create_task(housekeeping(
        redis, shard_consumers, retention_streams, metrics, settings.retention, service.stop,
        audit_stream=[store.config.audit_stream for store in stores],
    )))  # fmt: skip
    for task in tasks:
        task.add_done_callback(service.supervise)
    grpc_server = http_runner = None
    try:
        if serve:
            s = settings.judge_server
            grpc_server, service.grpc_port = await start_grpc(judge, metrics, s.host, s.grpc_port)
            http_runner, service.metrics_port = await start_http(
                metrics, service.ready, s.host, s.metrics_port
            )
        log.info(
            "judge up: mode=%s votes=%s reward_fn=%s workers=%d group=%s grpc=%d metrics=%d",
            settings.judging.mode,
            settings.backend.kind if settings.needs_votes else "-",
            settings.judging.reward_fn or "-",
            len(workers),
            settings.workers.group,
            service.grpc_port,
            service.metrics_port,
        )
        yield service
    finally:
        service.stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        if grpc_server is not None:
            await grpc_server.stop(grace=2)
        if http_runner is not None:
            await http_runner.cleanup()
        if judge.backend is not None:
            await judge.backend.aclose()
        for client in engines:
            await client.aclose()
        await redis.aclose()
