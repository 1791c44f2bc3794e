-- A main request, once served (or failed): finalise the turn pending in its session with this
-- request's next state, and store the request's own turn as the session's pending one (or
-- publish it at once when the session is done). An anonymous request's session was resolved
-- before (SessionStore.resolve), as the session's keys must be known to be passed in KEYS.
-- A turn stored after this request arrived is a concurrent sibling, not the turn this request
-- answers: it is finalised as superseded, never given this request's next state. Nor is a turn
-- whose request had this request's very history: the client retried it (an SDK's retry after a
-- timeout) and never used its reply; it is finalised as the retry's orphan.
-- The session is the caller's own: its state key, its active-set and pending-history entries
-- are of member `{scope}:{session_id}`; the session id in turn ids and claims is the client's.
-- KEYS: 1 active, 2 stream, 3 request key, 4 (below), 5 session state, 6 pending-history
--       index, 7 the caller's conversation key of history hash ARGV[15].
-- ARGV: 1 ambiguous (0/1: the resolution found a history claimed by two live sessions),
--       2 session_id, 3 scope, 4 now, 5 ttl, 6 maxlen,
--       7 prefixes (space-separated history hashes ending at an assistant reply, longest first),
--       8 next-state extra, 9 mismatch extra, 10 hash of this request's history ('' = do not
--       look for a retry), 11 dedupe ttl,
--       12 arrival time of the request, 13 superseded extra,
--       14 turn bytes ('' = the request failed: nothing to store), 15 history hash (with the
--       reply), 16 done extra ('' = keep the turn pending), 17 epoch for a session state this
--       request creates, 18 feedback index TTL (0 = feedback off), 19 orphaned extra ('' =
--       the superseded extra: a call spooled by an older gateway), 20 episode ('1': the turn
--       is an episode's, X-Episode; absent on calls spooled by an older gateway).
-- KEYS[4]: the feedback index of this request's response id (POST /v1/feedback).
-- Returns {session id, finalised turn id or '', history mismatch 0/1, ambiguous history 0/1,
--          turn id or '', superseded turn id or '', ambiguous claim 0/1, orphaned turn id or ''}.
local earlier = replayed()
if earlier then return earlier end
local sid = ARGV[2]
local member = ARGV[3] .. ':' .. sid
local result = {sid, '', 0, tonumber(ARGV[1]), '', '', 0, ''}
local skey = KEYS[5]

local hist = redis.call('HGET', skey, 'hist')
if hist then
  local at = tonumber(redis.call('HGET', skey, 'at') or '0')
  if at > tonumber(ARGV[12]) then
    result[6] = finalize_pending(member, skey, KEYS[2], ARGV[6], ARGV[13])
  elseif ARGV[10] ~= '' and redis.call('HGET', skey, 'req') == ARGV[10] then
    local orphaned = ARGV[19]
    if orphaned == '' then orphaned = ARGV[13] end
    result[8] = finalize_pending(member, skey, KEYS[2], ARGV[6], orphaned)
  else
    local extra = ARGV[8] .. ARGV[9]
    result[3] = 1
    for h in string.gmatch(ARGV[7], '%S+') do
      if h == hist then extra = ARGV[8]; result[3] = 0; break end
    end
    result[2] = finalize_pending(member, skey, KEYS[2], ARGV[6], extra)
  end
end

if ARGV[14] == '' then
  -- A failed request stores nothing; one that closed its session takes it off the idle set.
  if ARGV[16] ~= '' then
    redis.call('ZREM', KEYS[1], member)
  elseif redis.call('EXISTS', skey) == 1 then
    redis.call('ZADD', KEYS[1], ARGV[4], member)
    redis.call('EXPIRE', skey, ARGV[5])
  end
  return remember(result, ARGV[11])
end

local index = redis.call('HINCRBY', skey, 'next', 1) - 1
-- The epoch is made with the session's state and is part of every turn id: a session id whose
-- state expired (TTL) starts again at index 0 under a new epoch, never under an old turn's id.
redis.call('HSETNX', skey, 'epoch', ARGV[17])
if ARGV[20] == '1' then redis.call('HSET', skey, 'episode', '1') end
local tid = sid .. ':' .. redis.call('HGET', skey, 'epoch') .. ':' .. index
-- Who may rate this turn (POST /v1/feedback): the response id names the turn and its caller
-- (scope) for longer than the session lives (by session id, the caller's own state names it).
if ARGV[18] ~= '0' then
  redis.call('SET', KEYS[4], tid .. '\n' .. ARGV[3], 'EX', ARGV[18])
end
-- turn_id (field 1, string), session_id (field 2, string) and turn_index (field 3, varint)
-- merge into the stored bytes.
local turn = '\10' .. varint(#tid) .. tid .. '\18' .. varint(#sid) .. sid .. '\24' .. varint(index)
  .. ARGV[14]
result[5] = tid
if ARGV[16] ~= '' then
  publish(KEYS[2], ARGV[6], tid, turn .. ARGV[16])
  redis.call('ZREM', KEYS[1], member)
else
  redis.call('HSET', skey, 'turn', turn, 'tid', tid, 'hist', ARGV[15], 'req', ARGV[10],
    'at', ARGV[4])
  redis.call('HSET', KEYS[6], member, ARGV[15])
  redis.call('ZADD', KEYS[1], ARGV[4], member)
  -- Claim the history for the caller's anonymous follow-ups. Another session of the same
  -- caller whose pending turn ends the same history makes it ambiguous (a claim is written
  -- in its session's shard, so the owner's entry is in this shard's index).
  local ckey = KEYS[7]
  local owner = redis.call('GET', ckey)
  local claim = sid
  if owner == '*' then
    claim = '*'
  elseif owner and owner ~= sid and redis.call('HGET', KEYS[6], ARGV[3] .. ':' .. owner)
      == ARGV[15] then
    claim = '*'
  end
  if claim == '*' then result[7] = 1 end
  redis.call('SET', ckey, claim, 'EX', ARGV[5])
end
redis.call('EXPIRE', skey, ARGV[5])
return remember(result, ARGV[11])
