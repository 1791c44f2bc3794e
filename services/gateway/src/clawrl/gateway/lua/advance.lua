-- The start of a main request: resolve its session and finalise the session's pending turn with
-- this request's next state.
-- KEYS: active, stream, request key.
-- ARGV: prefix, session_id ('' = anonymous), scope, now, ttl, maxlen, prefixes (space-separated
--       history hashes ending at an assistant reply, longest first), next-state extra,
--       mismatch extra, new session id (for an anonymous request nobody claims), dedupe ttl.
-- Returns {session_id, finalised turn id or '', history mismatch 0/1, ambiguous 0/1}.
local earlier = replayed()
if earlier then return earlier end
local sid = ARGV[2]
local ambiguous = 0
if sid == '' then
  -- The caller's conversation that ends with the longest recorded reply in this history. Two
  -- live sessions claiming one history ('*') are not guessed between.
  for h in string.gmatch(ARGV[7], '%S+') do
    local owner = redis.call('GET', conversation_key(ARGV[3], h))
    if owner == '*' then ambiguous = 1; break end
    if owner then sid = owner; break end
  end
  if sid == '' then
    -- A new conversation: nothing can be pending yet.
    return remember({ARGV[10], '', 0, ambiguous}, ARGV[11])
  end
end
local skey = session_key(sid)
local result = {sid, '', 0, 0}
local hist = redis.call('HGET', skey, 'hist')
if hist then
  local extra = ARGV[8] .. ARGV[9]
  result[3] = 1
  for h in string.gmatch(ARGV[7], '%S+') do
    if h == hist then extra = ARGV[8]; result[3] = 0; break end
  end
  result[2] = finalize_pending(skey, KEYS[2], ARGV[6], extra)
end
redis.call('EXPIRE', skey, ARGV[5])
redis.call('ZADD', KEYS[1], ARGV[4], sid)
return remember(result, ARGV[11])
