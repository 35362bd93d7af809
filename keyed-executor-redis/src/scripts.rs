//! The Lua scripts of the protocol. Each runs atomically in Redis; their
//! keys are the group's coordination keys (see the crate docs, "What lives
//! in Redis").

/// Records the group's layout if none is, and returns the one recorded.
/// KEYS: the layout key. ARGV: the streams, one a line.
pub(crate) const LAYOUT: &str = r#"
redis.call('SETNX', KEYS[1], ARGV[1])
return redis.call('GET', KEYS[1])
"#;

/// Keeps `me` a member (if ARGV[3] is 1) or removes it, drops expired
/// members, renews the leases `me` holds. KEYS: members, then the owned
/// partitions' lease keys. ARGV: me, lease ms, join. Returns the live
/// members and the 1-based indexes (into the lease keys) of the leases
/// `me` no longer holds.
pub(crate) const HEARTBEAT: &str = r#"
local t = redis.call('TIME')
local now = t[1] * 1000 + math.floor(t[2] / 1000)
if ARGV[3] == '1' then
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
else
  redis.call('ZREM', KEYS[1], ARGV[1])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local lost = {}
for i = 2, #KEYS do
  if redis.call('GET', KEYS[i]) == ARGV[1] then
    redis.call('PEXPIRE', KEYS[i], ARGV[2])
  else
    lost[#lost + 1] = i - 1
  end
end
return {redis.call('ZRANGE', KEYS[1], 0, -1), lost}
"#;

/// Takes a partition's lease if nobody holds it. KEYS: the lease key.
/// ARGV: me, lease ms. Returns 'released' (its owner let go gracefully),
/// 'vacant' (absent: it expired or never existed; or ours from an earlier
/// life of this node), or nil (someone else holds it).
pub(crate) const ACQUIRE: &str = r#"
local cur = redis.call('GET', KEYS[1])
if cur == '' then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 'released'
elseif cur == false or cur == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 'vacant'
end
return false
"#;

/// Lets go of a lease `me` holds. KEYS: the lease key. ARGV: me, clean.
/// Clean (`1`: `me` had claimed everything pending, and has drained or
/// stopped what it ran): the lease becomes `""` without a TTL, and the
/// next owner claims at once. Not clean (`0`: `me` stopped before it had
/// claimed everything): the key is deleted, and the next owner treats the
/// partition as vacant (it waits for the pending entries to idle).
/// Returns 1 if the lease was ours.
pub(crate) const RELEASE: &str = r#"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  if ARGV[2] == '1' then
    redis.call('SET', KEYS[1], '')
  else
    redis.call('DEL', KEYS[1])
  end
  return 1
end
return 0
"#;

/// Dead-letters an entry: acks it and, only if that ack removed it from
/// the pending list, appends it to the dead-letter stream, in one step.
/// So an entry is dead-lettered once however often it is delivered, and
/// never both dead-lettered and left pending.
/// KEYS: the entry's stream, the dead-letter stream. ARGV: group, entry
/// ID, error, attempts, consumer, then the entry's fields and values.
pub(crate) const DEAD_LETTER: &str = r#"
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then
  return 0
end
local fields = {'dead:stream', KEYS[1], 'dead:id', ARGV[2], 'dead:error', ARGV[3],
  'dead:attempts', ARGV[4], 'dead:consumer', ARGV[5]}
for i = 6, #ARGV do
  fields[#fields + 1] = ARGV[i]
end
redis.call('XADD', KEYS[2], '*', unpack(fields))
return 1
"#;
