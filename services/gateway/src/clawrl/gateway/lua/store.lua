-- The end of a main request: store its turn as the session's pending one (or publish it at
-- once when the session is done). A turn still pending (concurrent requests in one session) is
-- finalised as superseded first, never overwritten.
-- KEYS: active, stream, request key.
-- ARGV: prefix, session_id, scope, now, ttl, maxlen, turn bytes, history hash (with the reply),
--       superseded extra, done extra ('' = keep pending), dedupe ttl.
-- Returns {turn id, superseded turn id or '', ambiguous 0/1}.
local earlier = replayed()
if earlier then return earlier end
local sid = ARGV[2]
local skey = session_key(sid)
local result = {'', '', 0}
result[2] = finalize_pending(skey, KEYS[2], ARGV[6], ARGV[9])
local index = redis.call('HINCRBY', skey, 'next', 1) - 1
local tid = sid .. ':' .. index
-- turn_id (field 1, string) and turn_index (field 3, varint) merge into the stored bytes.
local turn = '\10' .. varint(#tid) .. tid .. '\24' .. varint(index) .. ARGV[7]
result[1] = tid
if ARGV[10] ~= '' then
  publish(KEYS[2], ARGV[6], tid, turn .. ARGV[10])
  redis.call('ZREM', KEYS[1], sid)
else
  redis.call('HSET', skey, 'turn', turn, 'tid', tid, 'hist', ARGV[8])
  redis.call('ZADD', KEYS[1], ARGV[4], sid)
  -- Claim the history for the caller's anonymous follow-ups. Another session of the same
  -- caller whose pending turn ends the same history makes it ambiguous.
  local ckey = conversation_key(ARGV[3], ARGV[8])
  local owner = redis.call('GET', ckey)
  local claim = sid
  if owner == '*' then
    claim = '*'
  elseif owner and owner ~= sid and redis.call('HGET', session_key(owner), 'hist') == ARGV[8] then
    claim = '*'
  end
  if claim == '*' then result[3] = 1 end
  redis.call('SET', ckey, claim, 'EX', ARGV[5])
end
redis.call('EXPIRE', skey, ARGV[5])
return remember(result, ARGV[11])
