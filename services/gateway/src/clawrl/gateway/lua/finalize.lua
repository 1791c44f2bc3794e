-- Finalise a session's pending turn with no next state: session done, or idle when the
-- session's last activity is still at or before the cutoff (a request that touched it since
-- wins).
-- KEYS: active, stream, request key, (unused), session state, pending-history index.
-- ARGV: (unused), session member (`{scope}:{session_id}`), maxlen, extra, cutoff ('' = none),
--       dedupe ttl.
-- Returns the finalised turn id, '' when there was none or the session was touched since.
local earlier = replayed()
if earlier then return earlier[1] end
local member = ARGV[2]
if ARGV[5] ~= '' then
  local score = redis.call('ZSCORE', KEYS[1], member)
  if not score or tonumber(score) > tonumber(ARGV[5]) then return '' end
end
redis.call('ZREM', KEYS[1], member)
return remember({finalize_pending(member, KEYS[5], KEYS[2], ARGV[3], ARGV[4])}, ARGV[6])[1]
