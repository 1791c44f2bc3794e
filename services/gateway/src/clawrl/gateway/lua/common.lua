-- Shared by every session script (prepended to each). Every key a script touches is in KEYS,
-- and all of them are in one shard (one hash slot under Redis Cluster; see sessions.py):
-- KEYS[1] the shard's active set, KEYS[2] its turn stream, KEYS[3] the request key,
-- KEYS[5] the session's state, KEYS[6] the shard's pending-history index (session member ->
-- hash of the history its pending turn ends, for the claims of other sessions).

-- protobuf varint, to encode turn_index (only known in here) in the stored Turn bytes.
local function varint(n)
  local s = ''
  while n >= 128 do
    s = s .. string.char(n % 128 + 128)
    n = math.floor(n / 128)
  end
  return s .. string.char(n)
end

local function publish(stream, maxlen, tid, data)
  redis.call('XADD', stream, 'MAXLEN', '~', maxlen, '*', 'id', tid, 'type', TURN_TYPE, 'data', data)
end

-- Idempotency: KEYS[3] is `{prefix}:r:{request_id}:{step}`. A retried script (the client timed
-- out, the first run went through) finds the first run's result there and changes nothing.
local function replayed()
  local done = redis.call('GET', KEYS[3])
  if done then return cjson.decode(done) end
  return nil
end

local function remember(result, ttl)
  redis.call('SET', KEYS[3], cjson.encode(result), 'EX', ttl)
  return result
end

-- Finalise the pending turn (if any) of session `member` with `extra` appended; its turn id or
-- ''.
local function finalize_pending(member, skey, stream, maxlen, extra)
  redis.call('HDEL', KEYS[6], member)
  local turn = redis.call('HGET', skey, 'turn')
  if not turn then return '' end
  local tid = redis.call('HGET', skey, 'tid')
  publish(stream, maxlen, tid, turn .. extra)
  redis.call('HDEL', skey, 'turn', 'tid', 'hist', 'req', 'at')
  return tid
end
