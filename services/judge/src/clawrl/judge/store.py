"""The judge's Redis state, written atomically per turn by one Lua script: the sample on the
samples stream, the audit record, the "judged" marker that deduplicates redeliveries, the
session's promotion state, and the XACK of the turn. The same step freezes the turn's explicit
feedback (clawrl.common.feedback): any the judge did not read, having arrived while the turn was
judged, becomes late and is written to the audit trail, and the done marker makes the gateway
file every later one as late.

Why one script: at-least-once delivery means a turn can be judged twice (a worker died after
judging, another took the entry over). The marker `{prefix}:done:{turn_id}` is set in the same
atomic step that publishes the sample and acknowledges the turn, so a turn's sample is written
exactly once, and a turn is never acknowledged without its sample. The at-least-one-sample-per-
session rule reads and updates `{prefix}:session:{session_id}` in that step too, so it holds with
any number of workers and replicas."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import orjson
from redis.asyncio import Redis

from clawrl.common.feedback import feedback_key, judged_marker
from clawrl.common.records import encode_entry, session_state_of
from clawrl.common.redis_client import Script, run_script
from clawrl.common.redis_text import text
from clawrl.judge.core import Judgement
from clawrl.judge.feedback import TurnFeedback, read_feedback
from clawrl.judge.metrics import JudgeMetrics
from clawrl.judge.samples import promote

log = logging.getLogger(__name__)

# KEYS: done marker, session state, samples stream, audit stream, turns stream, feedback hash
# ARGV: group, entry id, sample id, sample type, sample data, promoted sample data,
#       effective (0/1), promotable (0/1), audit json, samples maxlen, audit maxlen,
#       done ttl, session ttl, feedback read (0/1), ids of the feedback merged (space-separated),
#       late-feedback audit head (JSON without its closing brace)
# Returns 'duplicate', or {outcome, feedback made late}.
COMMIT = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('XACK', KEYS[5], ARGV[1], ARGV[2])
  return 'duplicate'
end
local data = ARGV[5]
local outcome = 'published'
if ARGV[7] == '1' then
  redis.call('HINCRBY', KEYS[2], 'effective', 1)
  redis.call('EXPIRE', KEYS[2], ARGV[13])
elseif ARGV[8] == '1' then
  local state = redis.call('HMGET', KEYS[2], 'effective', 'promoted')
  if (tonumber(state[1]) or 0) == 0 and not state[2] then
    redis.call('HSET', KEYS[2], 'promoted', ARGV[3])
    redis.call('EXPIRE', KEYS[2], ARGV[13])
    data = ARGV[6]
    outcome = 'promoted'
  end
end
local sample_entry = redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[10], '*',
  'id', ARGV[3], 'type', ARGV[4], 'data', data)
redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[11], '*',
  'id', ARGV[3], 'outcome', outcome, 'sample_entry', sample_entry, 'data', ARGV[9])
redis.call('SET', KEYS[1], sample_entry, 'EX', ARGV[12])
redis.call('XACK', KEYS[5], ARGV[1], ARGV[2])
local late = {}
if ARGV[14] == '1' then
  local merged = {}
  for id in string.gmatch(ARGV[15], '%S+') do merged[id] = true end
  local fields = redis.call('HGETALL', KEYS[6])
  for i = 1, #fields, 2 do
    local id = string.sub(fields[i], 3)
    if string.sub(fields[i], 1, 2) == 'f:' and not merged[id] then
      table.insert(late, fields[i + 1])
      redis.call('HDEL', KEYS[6], fields[i])
      redis.call('HSET', KEYS[6], 'l:' .. id, fields[i + 1])
    end
  end
  if #late > 0 then
    redis.call('XADD', KEYS[4], 'MAXLEN', '~', ARGV[11], '*', 'id', ARGV[3],
      'outcome', 'late_feedback', 'data', ARGV[16] .. ',"sample_entry":"' .. sample_entry
      .. '","late_feedback":[' .. table.concat(late, ',') .. ']}')
  end
end
return {outcome, #late}
"""


@dataclass(frozen=True)
class StoreConfig:
    prefix: str
    turns_stream: str
    samples_stream: str
    audit_stream: str
    group: str
    samples_maxlen: int
    audit_maxlen: int
    done_ttl_s: int
    session_ttl_s: int
    feedback_prefix: str | None = None  # None: explicit feedback is not read


class JudgeStore:
    """Commits judgements and answers "was this turn judged already?"."""

    def __init__(
        self, redis: Redis, config: StoreConfig, metrics: JudgeMetrics | None = None
    ) -> None:
        self.redis = redis
        self.config = config
        self.metrics = metrics
        self._commit = Script(redis, COMMIT)

    def done_key(self, turn_id: str) -> str:
        return judged_marker(self.config.prefix, turn_id)

    async def feedback(self, turn_id: str) -> TurnFeedback | None:
        """The turn's explicit feedback to merge; None when feedback is off."""
        if self.config.feedback_prefix is None:
            return None
        return await read_feedback(self.redis, self.config.feedback_prefix, turn_id)

    def session_key(self, session_state: str) -> str:
        """The promotion state of one session state (`session_state_of`: per caller)."""
        return f"{self.config.prefix}:session:{session_state}"

    async def judged(self, turn_ids: list[str]) -> list[bool]:
        """For each turn id, whether its sample is already written (one MGET)."""
        if not turn_ids:
            return []
        markers = await self.redis.mget([self.done_key(turn_id) for turn_id in turn_ids])
        return [marker is not None for marker in markers]

    def _args(self, entry_id: str, judgement: Judgement) -> tuple[list[str], list]:
        c = self.config
        sample = judgement.sample
        fields = encode_entry(sample)
        promoted = promote(sample).SerializeToString() if judgement.promotable else b""
        keys = [
            self.done_key(sample.sample_id),
            self.session_key(session_state_of(sample.sample_id)),
            c.samples_stream,
            c.audit_stream,
            c.turns_stream,
            feedback_key(c.feedback_prefix or "", sample.sample_id),
        ]
        feedback = judgement.feedback
        args = [
            c.group,
            entry_id,
            fields["id"],
            fields["type"],
            fields["data"],
            promoted,
            int(judgement.effective),
            int(judgement.promotable),
            orjson.dumps(judgement.audit, default=str),
            c.samples_maxlen,
            c.audit_maxlen,
            c.done_ttl_s,
            c.session_ttl_s,
            int(c.feedback_prefix is not None),
            " ".join(feedback.ids) if feedback is not None else "",
            b'{"turn_id":' + orjson.dumps(sample.sample_id),
        ]
        return keys, args

    async def commit(self, items: list[tuple[str, Judgement]]) -> list[str]:
        """Commit `(entry_id, judgement)` pairs in one pipeline; each outcome is 'published',
        'promoted' or 'duplicate'."""
        if not items:
            return []
        calls = [self._args(entry_id, judgement) for entry_id, judgement in items]
        results = await run_script(self.redis, self._commit, calls)
        outcomes = []
        for (_, judgement), result in zip(items, results, strict=True):
            if isinstance(result, list):
                outcome, late = text(result[0]), int(result[1])
            else:
                outcome, late = text(result), 0
            if late:
                self._late_feedback(judgement.sample.sample_id, late)
            outcomes.append(outcome)
        return outcomes

    def _late_feedback(self, turn_id: str, count: int) -> None:
        if self.metrics is not None:
            self.metrics.feedback.labels("late").inc(count)
        log.info("%d feedback(s) on turn %s arrived while it was judged: audited as late, not "
                 "merged", count, turn_id)  # fmt: skip

    async def record_rejection(self, turn_id: str, reason: str, entry_id: str) -> None:
        """An audit record for a dead-lettered turn (the dead-letter entry is already written)."""
        record = {"turn_id": turn_id, "dead_letter": reason, "entry_id": entry_id}
        await self.redis.xadd(
            self.config.audit_stream,
            {"id": turn_id, "outcome": "dead_letter", "data": orjson.dumps(record)},
            maxlen=self.config.audit_maxlen,
            approximate=True,
        )
