"""Turning served main turns into `Turn` records: the pending turn is stored when a response is
served, and finalised (put on the turns stream) by the session's next main request, by
X-Session-Done, or by the idle sweep. Redis trouble never fails a request: the step is counted
and logged, the script call waits in the local spool (spool.py), and it is replayed in order
when Redis answers again (redis-py reconnects by itself). A write outlives its request: a client
that hangs up while its turn is being written (which cancels the request) has the write run again
in the background (idempotent), so the turn is recorded or spooled, never lost."""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson
from google.protobuf.timestamp_pb2 import Timestamp

from clawrl.common.proto.records_pb2 import FinalizeReason
from clawrl.common.records import Turn
from clawrl.common.redis_client import REDIS_ERRORS
from clawrl.gateway.metrics import GatewayMetrics
from clawrl.gateway.sessions import (
    Recorded,
    SessionStore,
    assistant_prefixes,
    extend_hash,
    history_hashes,
    member_session_id,
    session_member,
)
from clawrl.gateway.spool import RecordingSpool, SpooledCall

log = logging.getLogger(__name__)

# Failures worth degrading on, not crashing: Redis down or slow (a Redis Cluster client
# rebuilding its slot map included), a script error.
RECORDING_ERRORS = REDIS_ERRORS
MISMATCH = Turn(history_mismatch=True).SerializeToString()
T = TypeVar("T")


def next_state_messages(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """What follows the last assistant reply of a request (all tool results of parallel calls,
    then the user's message): the next state of the turn that reply came from. A request with
    no assistant message (or ending with one) gives its last message."""
    for i in range(len(messages) - 1, -1, -1):
        if messages[i].get("role") == "assistant":
            return list(messages[i + 1 :]) or [messages[-1]]
    return [messages[-1]]


@dataclass
class TurnContext:
    """A main request's session as known when it arrived."""

    request_id: str  # keys the record script's write, so a retried write is a no-op
    session_id: str  # "" until prepared, when the client sent none
    explicit: bool  # the client named the session
    scope: str  # caller_scope of the client: its anonymous conversations' namespace
    messages: list[dict[str, Any]]  # as rendered: what the history hashes are of
    raw_messages: list[dict[str, Any]]  # as sent: the next state, the turn's messages_json
    done: bool
    api: str = "chat"
    arrived: float = field(default_factory=time.time)  # turns stored later are siblings
    settled: bool = False  # recorded (or abandoned): nothing more to write for it
    # The request's share of the record, worked out by Recorder.prepare while the engine
    # generates (or, at the latest, when the request is recorded):
    hashes: list[str] = field(default_factory=list)  # history_hashes of `messages`
    prefixes: list[str] = field(default_factory=list)  # assistant_prefixes: what it may continue
    next_state: bytes = b""  # finalize_fields of the next state it is, less finalized_at
    turn_head: bytes | None = None  # its pending Turn's request fields (request_fields)
    prepared: bool = False  # hashes, prefixes, next state and session id are set


@dataclass
class ServedTurn:
    """What the serving core hands over once a main turn's response is complete."""

    model: str
    policy_version: int  # of the engine's weight_version at the end of the generation
    admitted_policy_version: int  # of the weights the generation started under
    weight_version: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    response_text: str
    response_message: dict[str, Any]
    finish_reason: str
    temperature: float
    top_p: float
    created_ns: int = field(default_factory=time.time_ns)
    unknown_weights: bool = False  # the engine's weights were of no known version
    tenant: str = ""  # the caller's tenant (common/tenants.py)
    probe: bool = False  # X-Turn-Type: probe: recorded, never trained
    episode: bool = False  # X-Episode (the record sets it only when true: old replays)


def _timestamp(ns: int | None = None) -> Timestamp:
    stamp = Timestamp()
    stamp.FromNanoseconds(ns if ns is not None else time.time_ns())
    return stamp


# Serialised protobuf messages merge when concatenated (the last singular field wins, repeated
# ones append): a record is made of parts, the request's while the engine generates.


def finalize_fields(
    gateway_id: str,
    reason: int,
    next_state: Sequence[dict[str, Any]] = (),
    history_mismatch: bool = False,
) -> bytes:
    """The finalisation fields but `finalized_at`, serialised."""
    turn = Turn(finalize_reason=reason, gateway_id=gateway_id)
    if next_state:
        turn.next_state_messages_json.extend(orjson.dumps(m).decode() for m in next_state)
        turn.next_state_json = turn.next_state_messages_json[-1]
    if history_mismatch:
        turn.history_mismatch = True
    return turn.SerializeToString()


# Those of a bare reason are the same for every request of a gateway.
reason_fields = functools.lru_cache(maxsize=64)(finalize_fields)


def finalized_at(ns: int | None = None) -> bytes:
    """`finalized_at` alone, serialised: appended after finalize_fields."""
    return Turn(finalized_at=_timestamp(ns)).SerializeToString()


def finalize_extra(
    gateway_id: str,
    reason: int,
    next_state: Sequence[dict[str, Any]] = (),
    history_mismatch: bool = False,
) -> bytes:
    """The finalisation fields, serialised; appended to a pending turn's bytes they merge in."""
    return finalize_fields(gateway_id, reason, next_state, history_mismatch) + finalized_at()


def request_fields(
    request_id: str,
    model: str,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    prompt_ids: list[int],
) -> bytes:
    """The fields of a pending Turn that the request alone decides (the bulk of it, in a long
    conversation), serialised: made while the engine generates (Recorder.prepare)."""
    return Turn(
        request_id=request_id,
        model=model,
        messages_json=orjson.dumps(messages).decode(),
        tools_json=orjson.dumps(tools).decode() if tools else "",
        prompt_ids=prompt_ids,
    ).SerializeToString()


def pending_turn(request_id: str, served: ServedTurn, head: bytes | None = None) -> bytes:
    """A served turn as stored while it waits for its next state (the record script adds its
    session id, turn id and index: an anonymous request's session is only known in there).
    `head`: its request_fields, if they were made ahead."""
    if head is None:
        head = request_fields(
            request_id, served.model, served.messages, served.tools, served.prompt_ids
        )
    reply = Turn(
        policy_version=served.policy_version,
        admitted_policy_version=served.admitted_policy_version,
        weight_version=served.weight_version,
        unknown_weights=served.unknown_weights,
        response_ids=served.response_ids,
        response_logprobs=served.response_logprobs,
        response_text=served.response_text,
        response_message_json=orjson.dumps(served.response_message).decode(),
        finish_reason=served.finish_reason,
        temperature=served.temperature,
        top_p=served.top_p,
        created_at=_timestamp(served.created_ns),
        tenant=served.tenant,
        probe=served.probe,
        episode=served.episode,
    ).SerializeToString()
    return head + reply


class Recorder:
    """Session bookkeeping around each main request; owns the idle sweeper."""

    def __init__(
        self,
        store: SessionStore,
        metrics: GatewayMetrics,
        *,
        gateway_id: str,
        anonymous_matching: bool,
        idle_timeout_s: float,
        sweep_interval_s: float,
        sweep_batch: int,
        spool: RecordingSpool | None = None,
        replay_interval_s: float = 1.0,
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.spool = spool
        self.replay_interval_s = replay_interval_s
        self.gateway_id = gateway_id
        self.anonymous_matching = anonymous_matching
        self.idle_timeout_s = idle_timeout_s
        self.sweep_interval_s = sweep_interval_s
        self.sweep_batch = sweep_batch
        self._background: set[asyncio.Task] = set()

    def _failed(self, stage: str, exc: BaseException, session_id: str | None = None) -> None:
        self.metrics.recording_failures.labels(stage).inc()
        log.warning(
            "recording step %s failed, serving goes on: %s: %s",
            stage,
            type(exc).__name__,
            exc,
            extra={"session_id": session_id},
        )

    def _finalized(self, reason: str, turn_id: str | None) -> None:
        if turn_id:
            self.metrics.turns_finalized.labels(reason).inc()

    def begin(
        self,
        request_id: str,
        session_id: str | None,
        messages: list[dict[str, Any]],
        raw_messages: list[dict[str, Any]],
        *,
        scope: str,
        done: bool,
        api: str = "chat",
    ) -> TurnContext:
        """A main request's recording, begun when it arrives (pure and cheap: the work is
        `prepare`'s; Redis is written once, when the request ends, by `finish` or `abandon`)."""
        return TurnContext(
            request_id=request_id,
            session_id=session_id or "",
            explicit=session_id is not None,
            scope=scope,
            messages=messages,
            raw_messages=raw_messages,
            done=done,
            api=api,
        )

    def prepare(
        self,
        context: TurnContext,
        *,
        model: str,
        tools: list[dict[str, Any]] | None,
        prompt_ids: list[int],
    ) -> None:
        """What the record takes from the request alone (history hashes, the next state, the
        turn's request fields: in a long conversation most of its CPU), worked out while the
        engine generates, so that little is left between the reply and the response."""
        if context.settled:  # recorded already (the engine call failed at once)
            return
        self._prepare_history(context)
        if context.turn_head is None:
            context.turn_head = request_fields(
                context.request_id, model, context.raw_messages, tools, prompt_ids
            )

    def _prepare_history(self, context: TurnContext) -> None:
        """The part of `prepare` that a failed request's record needs too."""
        if context.prepared:
            return
        context.hashes = history_hashes(context.messages, context.api)
        context.prefixes = assistant_prefixes(context.messages, context.hashes)
        context.next_state = finalize_fields(
            self.gateway_id,
            FinalizeReason.FINALIZE_REASON_NEXT_STATE,
            next_state_messages(context.raw_messages),
        )
        if not context.session_id:
            context.session_id = f"anon-{uuid.uuid4().hex}"  # used unless a session matches
        context.prepared = True

    async def finish(self, context: TurnContext, served: ServedTurn) -> str | None:
        """Finalise the session's pending turn with this request's next state and store the
        served turn as pending (or publish it at once when the session is done), in one round
        trip; returns its turn id, None when recording failed."""
        result = await self._record(context, served)
        return None if result is None else result.turn_id

    async def abandon(self, context: TurnContext) -> None:
        """A main request that failed (or whose client left) records no turn, but it is still
        the next state of the session's pending turn, and X-Session-Done still closes it."""
        await self._record(context, None)

    def abandon_soon(self, context: TurnContext) -> None:
        """`abandon` in the background, for a stream whose client left mid-response."""
        if context.settled:
            return
        task = asyncio.create_task(self.abandon(context))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _record(self, context: TurnContext, served: ServedTurn | None) -> Recorded | None:
        if context.settled:
            return None
        context.settled = True
        self._prepare_history(context)
        if served is None:
            turn, history_hash = b"", ""
        else:
            turn = pending_turn(context.request_id, served, context.turn_head)
            history_hash = extend_hash(context.hashes[-1], served.response_message)
        now_ns, reason = time.time_ns(), functools.partial(reason_fields, self.gateway_id)
        stamp = finalized_at(now_ns)
        call = SpooledCall("record", {
            "request_id": context.request_id,
            "session_id": context.session_id if context.explicit else None,
            "scope": context.scope,
            "arrived": context.arrived,
            "now": now_ns / 1e9,
            "prefixes": context.prefixes if context.explicit or self.anonymous_matching else [],
            "next_state": context.next_state + stamp,
            "mismatch": MISMATCH,
            "superseded": reason(FinalizeReason.FINALIZE_REASON_SUPERSEDED) + stamp,
            "orphaned": reason(FinalizeReason.FINALIZE_REASON_RETRY_ORPHAN) + stamp,
            "new_session_id": context.session_id,
            "turn": turn,
            "history_hash": history_hash,
            "request_hash": context.hashes[-1],
            "done": reason(FinalizeReason.FINALIZE_REASON_SESSION_DONE) + stamp
            if context.done
            else b"",
        })  # fmt: skip
        call.kwargs.update({"episode": True} if served is not None and served.episode else {})
        if self._queue_behind_spool(call):
            return None
        return await self._outliving_request(lambda: self._write(context, call), context.session_id)

    async def _write(self, context: TurnContext, call: SpooledCall) -> Recorded | None:
        try:
            result = await self._recorded(call)
        except RECORDING_ERRORS as exc:
            self._failed("record", exc, context.session_id)
            self._spool(call)
            return None
        context.session_id = result.session_id
        if not context.explicit and result.ambiguous:
            self._ambiguous("new_session", context.session_id)
        return result

    async def _outliving_request(self, write: Callable[[], Awaitable[T]], session_id: str) -> T:
        """A recording write, awaited in the request (no task: none of its passes of the loop)
        and run again in the background if the request is cancelled mid-write (a streaming
        client hanging up): it is marked settled, so nothing else would write it. Both scripts
        are idempotent by request id: a call that went through returns its first result, one
        that did not (cut while sent, or never sent) runs now; its metrics count once."""
        try:
            return await write()
        except asyncio.CancelledError:
            task = asyncio.create_task(write())
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            self.metrics.recording_detached.inc()
            log.info("the client left while its turn was being written: the write goes on "
                     "in the background", extra={"session_id": session_id})  # fmt: skip
            raise

    async def drain(self) -> None:
        """Wait for the writes that outlived their requests (the gateway is stopping)."""
        while self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    async def _recorded(self, call: SpooledCall) -> Recorded:
        """Run a record call (live or replayed) and count what it stored and finalised."""
        result = await self.store.record(**call.kwargs)
        if call.kwargs["turn"]:
            self.metrics.turns_recorded.inc()
        if result.claim_ambiguous:
            self._ambiguous("claim", result.session_id)
        if call.kwargs["done"]:
            self._finalized("done", result.turn_id)
        if result.orphaned_turn_id:
            # The client retried the request of the pending turn (same caller, session and
            # history): it never used that reply. Finalised as RETRY_ORPHAN (no next state),
            # so it is neither trained a second time beside the retry's turn (the judge masks
            # it) nor given the retry's own prompt as its next state.
            self._finalized("retry_orphan", result.orphaned_turn_id)
            self._note(
                "turn %s finalised as a retry's orphan: the next request repeated its history",
                result.orphaned_turn_id,
                session_id=result.session_id,
            )
        if result.finalized_turn_id:
            self._finalized("next_state", result.finalized_turn_id)
            if result.history_mismatch:
                self.metrics.history_mismatches.inc()
                self._note(
                    "turn %s finalised with history_mismatch: the next request's history does "
                    "not extend it",
                    result.finalized_turn_id,
                    session_id=result.session_id,
                )
        if result.superseded_turn_id:
            self._finalized("superseded", result.superseded_turn_id)
        return result

    def _ambiguous(self, event: str, session_id: str) -> None:
        self.metrics.ambiguous_histories.labels(event).inc()
        self._note(
            "a history claimed by two live sessions of one caller: %s",
            "this anonymous request started a new session instead of guessing"
            if event == "new_session"
            else "anonymous follow-ups of it will start new sessions",
            session_id=session_id,
        )

    @staticmethod
    def _note(message: str, *args: Any, session_id: str) -> None:
        """An INFO line of a recorded turn, written on the loop's next pass: after the response
        it belongs to has gone out (the request's log context goes with it). A line costs
        more than the rest of the record's bookkeeping, and the response waits for none."""
        extra = {"session_id": session_id}
        asyncio.get_running_loop().call_soon(
            functools.partial(log.info, message, *args, extra=extra)
        )

    async def close(self, request_id: str, session_id: str, scope: str) -> str | None:
        """X-Session-Done on a request that records nothing: finalise the pending turn of the
        caller's (`scope`'s) session."""
        call = SpooledCall("finalize", {
            "request_id": request_id,
            "member": session_member(scope, session_id),
            "extra": finalize_extra(self.gateway_id, FinalizeReason.FINALIZE_REASON_SESSION_DONE),
        })  # fmt: skip
        if self._queue_behind_spool(call):
            return None
        return await self._outliving_request(lambda: self._close_now(call), session_id)

    async def _close_now(self, call: SpooledCall) -> str | None:
        try:
            return await self._closed(call)
        except RECORDING_ERRORS as exc:
            self._failed("done", exc, member_session_id(call.kwargs["member"]))
            self._spool(call)
            return None

    async def _closed(self, call: SpooledCall) -> str | None:
        kwargs = dict(call.kwargs)
        if "session_id" in kwargs:  # spooled before sessions were per caller: a bare member
            kwargs["member"] = kwargs.pop("session_id")
        turn_id = await self.store.finalize(**kwargs)
        self._finalized("done", turn_id)
        return turn_id

    # --- the spool: what Redis did not take, replayed in order --------------------------------

    def _queue_behind_spool(self, call: SpooledCall) -> bool:
        """While calls wait in the spool, a new one joins them (a session's calls must reach
        Redis in order); True when it was queued (or dropped, the spool being full)."""
        if self.spool is None or not len(self.spool):
            return False
        self._spool(call)
        return True

    def _spool(self, call: SpooledCall) -> None:
        if self.spool is None:
            return
        session_id = call.kwargs.get("session_id") or call.kwargs.get("new_session_id")
        if "member" in call.kwargs:
            session_id = member_session_id(call.kwargs["member"])
        if self.spool.append(call):
            self.metrics.spooled.labels(call.op).inc()
        else:
            self.metrics.spool_dropped.labels(call.op).inc()
            log.error("recording spool full (%d bytes): %s call of request %s dropped",
                      self.spool.bytes, call.op, call.kwargs["request_id"],
                      extra={"session_id": session_id})  # fmt: skip
        self._spool_gauges()

    def _spool_gauges(self) -> None:
        if self.spool is not None:
            self.metrics.spool_entries.set(len(self.spool))
            self.metrics.spool_bytes.set(self.spool.bytes)

    async def _replay_one(self, call: SpooledCall) -> None:
        if call.op == "record":
            await self._recorded(call)
        else:
            await self._closed(call)
        self.metrics.spool_replayed.labels(call.op).inc()

    async def replay_spool(self) -> int:
        """Replay spooled calls oldest first until Redis refuses one; how many went through."""
        if self.spool is None or not len(self.spool):
            return 0
        replayed = await self.spool.replay(self._replay_one, RECORDING_ERRORS)
        self._spool_gauges()
        if replayed:
            log.info("replayed %d spooled recording call(s); %d still waiting",
                     replayed, len(self.spool))  # fmt: skip
        return replayed

    async def replay_forever(self) -> None:
        self._spool_gauges()
        while True:
            await asyncio.sleep(self.replay_interval_s)
            await self.replay_spool()

    async def sweep_once(self) -> int:
        """Finalise the pending turns of sessions idle past the timeout; how many."""
        cutoff = time.time() - self.idle_timeout_s
        finalized = 0
        extra = finalize_extra(self.gateway_id, FinalizeReason.FINALIZE_REASON_IDLE_TIMEOUT)
        for member in await self.store.idle_sessions(cutoff, self.sweep_batch):
            turn_id = await self.store.finalize(
                f"sweep-{uuid.uuid4().hex}", member, extra, idle_cutoff=cutoff
            )
            if turn_id:
                finalized += 1
                self._finalized("idle", turn_id)
                log.info("turn %s finalised: idle", turn_id,
                         extra={"session_id": member_session_id(member)})  # fmt: skip
        self.metrics.active_sessions.set(await self.store.active_count())
        return finalized

    async def sweep_forever(self) -> None:
        """Every replica sweeps; the FINALIZE script makes concurrent sweeps harmless."""
        while True:
            # Jitter spreads the replicas' sweeps over the interval.
            await asyncio.sleep(self.sweep_interval_s * random.uniform(0.8, 1.2))
            try:
                await self.sweep_once()
            except RECORDING_ERRORS as exc:
                self._failed("sweep", exc)
