//! The ledger consumer over Redis Streams: what `main.rs` runs from the
//! command line and `tests/broker_redis.rs` runs in-process (both include
//! this file, so the test checks the very code the example ships).
//!
//! # What lives where
//!
//! | Redis key | what |
//! |---|---|
//! | `ledger:{p}` | partition `p`: a stream; a key's records are all in stream `partition_of(key)` |
//! | group `ledger` on each stream | the consumer group; each entry is pending (delivered, not acked) until `XACK` |
//! | `ledger:last`, `ledger:balance` | the applied state: per key, the last sequence number applied and the balance |
//! | `ledger:stats` | `applied`, `duplicates` (a redelivery skipped), `gaps` (an order violation), `dead` (dead-lettered) |
//! | `ledger:dead` | the dead-letter stream: each record the handler could not apply, with its error and attempts |
//! | `ledger:produced`, `ledger:expected` | what the producer wrote: per key, how many records and the balance they sum to; `ledger:meta`'s `poisoned`: how many of them cannot be applied |
//! | `ledger:members` | live consumers: a sorted set scored by the server time its heartbeat expires |
//! | `ledger:owner:{p}` | partition `p`'s lease: the owner's name with a TTL, `""` once released gracefully |
//!
//! # One process
//!
//! A consumer is one [`KeyedExecutor`] (its workers run the handler), one
//! tokio runtime (its threads drive the sockets and the loops below) and
//! one [`Receiver`] per partition it owns — one source each, with its own
//! credit and its own stop. The handler is async: it runs the `APPLY` Lua
//! script over a shared multiplexed connection, so one key's records apply
//! one at a time, in order, while thousands of keys' scripts are in flight
//! together. The script applies `seq == last + 1`, skips `seq <= last` as
//! a duplicate (a redelivery after a crash) and reports anything else as a
//! gap, which halts the partition: its record stays pending for a person
//! to look at.
//!
//! # Records that cannot be applied
//!
//! A record with a zero amount is malformed: the handler refuses it
//! (every thousandth record the producer writes is one). The handler runs
//! under a retry policy (`handler::retrying_async`): a refused record is
//! tried three more times with backoff, its key's later records waiting
//! behind it, and then goes to the dead-letter hook, which runs the `DEAD`
//! script — idempotent by sequence number, like `APPLY`: it advances the
//! key's last seq past the record, counts it, and `XADD`s it to
//! `ledger:dead` with its error. Its completion says `DeadLettered`, and
//! the record is acked: the partition moves on. A redelivered dead letter
//! (after a crash) is skipped as a duplicate and not written twice.
//!
//! # Reading and acking
//!
//! A partition's loop reads with `XREADGROUP … COUNT read_count BLOCK
//! block STREAMS ledger:{p} >` and submits each entry with
//! `Receiver::submit(key, record).await`, which waits while the partition
//! has `max_in_flight` records unfinished (so a slow store slows the read,
//! not memory). An entry is acked only after its [`Completion`] says the
//! script applied it or skipped it as a duplicate. **Acks are batched per
//! read round**: every `XREADGROUP` is pipelined behind one `XACK` of every
//! entry whose completion finished since the previous round, so acking
//! costs no extra round trip and an ack is at most one round late (at most
//! `block` when the stream is idle). Redis acks entries one by one, so
//! unlike a Kafka offset nothing waits for a commit point: a slow key
//! delays only its own acks (`Receiver::committable` is what a Kafka
//! consumer would commit instead).
//!
//! # Who owns a partition
//!
//! Every `tick` the control loop sends a heartbeat (`HEARTBEAT`): it keeps
//! the consumer in `ledger:members` and renews the lease of every
//! partition it owns, and returns the live members. The assignment is a
//! pure function of them ([`assignment`]: sorted names, partition `p` to
//! member `p % n`), so every consumer computes the same one. A consumer
//! starts a partition only after taking its lease (`ACQUIRE`), which
//! succeeds only if the key is absent (expired: the owner died) or `""`
//! (released gracefully).
//!
//! **Hand-off** (a consumer joins or leaves, the assignment moves `p`):
//! 1. the old owner stops reading `p` and closes its receiver;
//! 2. it drains it within `drain_timeout` (`Receiver::shutdown_async`),
//!    else stops it now (`Receiver::shutdown_now`): queued records come
//!    back `Rejected`, suspended ones `Cancelled`; they are not acked and
//!    stay pending;
//! 3. it acks everything that finished, then `PING`s its store connection:
//!    every script its handlers sent has run by the time the answer comes
//!    back (one connection runs its commands in order);
//! 4. only then it sets the lease to `""`;
//! 5. the new owner takes the lease, claims what is still pending
//!    (`XAUTOCLAIM … 0 0-0`, in ID order, until the cursor comes back to
//!    `0-0`) and submits it, and only then reads new entries with `>`.
//!
//! So two consumers never run one key's records at once, and per-key order
//! holds across the move: a key's records are in ID order in its stream,
//! everything pending has a lower ID than anything new, and the new owner
//! submits in ID order to one receiver.
//!
//! **Crash** (force stop, connection dropped, heartbeats stop): nothing is
//! released; entries stay pending, including records applied but not yet
//! acked. The member and its leases expire after `lease`; the survivor's
//! assignment then includes the partitions, it takes the expired leases,
//! waits until **every** pending entry has been idle for `claim_idle`
//! (`XPENDING … IDLE`) — so no delivery of the dead owner is younger than
//! that — then claims them all with `XAUTOCLAIM … claim_idle 0-0` before
//! reading new ones. Records the dead owner applied come back and the
//! script skips them (counted as `duplicates`): at-least-once delivery,
//! exactly-once effect. A consumer that cannot renew its leases for
//! two-thirds of `lease` fences itself: it stops those partitions now, so
//! it is gone before anyone may take them over.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keyed_executor::handler::{self, DeadLetter};
use keyed_executor::{
    Backoff, Completion, Dispatcher, KeyedExecutor, Receiver, RetryPolicy, TaskError,
};
use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, RedisError, RedisResult, Script, Value};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The consumer group on every partition's stream.
pub const GROUP: &str = "ledger";
const LAST: &str = "ledger:last";
const BALANCE: &str = "ledger:balance";
const STATS: &str = "ledger:stats";
const PRODUCED: &str = "ledger:produced";
const EXPECTED: &str = "ledger:expected";
const MEMBERS: &str = "ledger:members";
const META: &str = "ledger:meta";
/// The dead-letter stream.
pub const DEAD_LETTERS: &str = "ledger:dead";
/// Attempts a record gets before it is dead-lettered (three retries).
pub const ATTEMPTS: u32 = 4;
/// A lease's value once its owner released it gracefully.
const RELEASED: &str = "";

/// Partition `p`'s stream.
pub fn stream(p: usize) -> String {
    format!("ledger:{p}")
}

fn owner_key(p: usize) -> String {
    format!("ledger:owner:{p}")
}

/// The partition of `key`: a stable hash (FNV-1a, the same in every
/// process and every run), modulo the number of partitions.
pub fn partition_of(key: u64, partitions: usize) -> usize {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.to_le_bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h % partitions as u64) as usize
}

/// Which partitions `me` owns among `members`: sorted and deduplicated,
/// partition `p` goes to member `p % n`. Empty if `me` is not a member.
pub fn assignment(members: &[String], me: &str, partitions: usize) -> BTreeSet<usize> {
    let mut members = members.to_vec();
    members.sort();
    members.dedup();
    match members.iter().position(|m| m == me) {
        Some(i) => (0..partitions).filter(|p| p % members.len() == i).collect(),
        None => BTreeSet::new(),
    }
}

// ---------------------------------------------------------------- scripts --

/// Applies one record idempotently by its key's sequence number.
/// KEYS: last, balance, stats. ARGV: key, seq, amount.
/// Returns `{1, seq}` applied, `{0, last}` duplicate, `{-1, last}` gap.
const APPLY: &str = r#"
local last = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '-1')
local seq = tonumber(ARGV[2])
if seq == last + 1 then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('HINCRBY', KEYS[2], ARGV[1], ARGV[3])
  redis.call('HINCRBY', KEYS[3], 'applied', 1)
  return {1, seq}
elseif seq <= last then
  redis.call('HINCRBY', KEYS[3], 'duplicates', 1)
  return {0, last}
end
redis.call('HINCRBY', KEYS[3], 'gaps', 1)
return {-1, last}
"#;

/// Dead-letters a record the handler could not apply, idempotently by
/// its sequence number: `seq == last + 1` advances the key past it, counts
/// it and writes it to the dead-letter stream; `seq <= last` is a
/// redelivery (a duplicate); anything else a gap.
/// KEYS: last, stats, dead-letter stream. ARGV: key, seq, error, attempts.
const DEAD: &str = r#"
local last = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '-1')
local seq = tonumber(ARGV[2])
if seq == last + 1 then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('HINCRBY', KEYS[2], 'dead', 1)
  redis.call('XADD', KEYS[3], '*', 'key', ARGV[1], 'seq', ARGV[2], 'error', ARGV[3], 'attempts', ARGV[4])
  return 1
elseif seq <= last then
  redis.call('HINCRBY', KEYS[2], 'duplicates', 1)
  return 0
end
redis.call('HINCRBY', KEYS[2], 'gaps', 1)
return -1
"#;

/// Appends records, numbering each key's records 0, 1, 2, … (atomically
/// with the append, so a key's sequence order is its stream order), and
/// counts the records that cannot be applied (a zero amount).
/// KEYS: produced, expected, meta, then every partition's stream.
/// ARGV: (partition, key, amount) triples.
const PRODUCE: &str = r#"
for i = 1, #ARGV, 3 do
  local p, key, amount = tonumber(ARGV[i]), ARGV[i + 1], ARGV[i + 2]
  local seq = redis.call('HINCRBY', KEYS[1], key, 1) - 1
  redis.call('HINCRBY', KEYS[2], key, amount)
  if tonumber(amount) == 0 then
    redis.call('HINCRBY', KEYS[3], 'poisoned', 1)
  end
  redis.call('XADD', KEYS[4 + p], '*', 'key', key, 'seq', seq, 'amount', amount)
end
return #ARGV / 3
"#;

/// Keeps `me` a member (if ARGV[3] is 1), drops expired members, renews
/// the leases `me` holds. KEYS: members, then the owned partitions' lease
/// keys. ARGV: me, lease ms, join. Returns the live members and the
/// 1-based indexes (into the lease keys) of the leases `me` lost.
const HEARTBEAT: &str = r#"
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

/// Takes partition's lease if nobody holds it. KEYS: the lease key. ARGV:
/// me, lease ms. Returns 'released' (the owner let go gracefully),
/// 'vacant' (absent: it expired or never existed; or our own from an
/// earlier life), or nil (someone else holds it).
const ACQUIRE: &str = r#"
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
/// Clean (`1`: everything pending was claimed by `me` and is fenced): the
/// lease becomes `""`, no TTL, and the next owner claims at once. Not
/// clean (`0`: `me` stopped before it had claimed everything): the key is
/// deleted, and the next owner treats it as vacant. Returns 1 if it was
/// ours.
const RELEASE: &str = r#"
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

// ----------------------------------------------------------------- record --

/// One ledger record: the `seq`-th change of `key`'s balance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    pub key: u64,
    pub seq: u64,
    pub amount: i64,
}

/// A stream entry: its ID (what `XACK` takes) and its record.
#[derive(Debug)]
struct Entry {
    id: String,
    record: Record,
}

/// What the handler made of a record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Apply {
    /// `seq == last + 1`: applied now.
    Applied,
    /// `seq <= last`: applied before (a redelivery); skipped.
    Duplicate,
    /// `seq > last + 1`: an earlier record is missing — an order violation.
    Gap { last: i64 },
    /// Redis refused the script with an error that a retry does not fix.
    Failed(String),
}

// ------------------------------------------------------------ connections --

/// Errors worth retrying: the connection or the server is away for now.
fn transient(e: &RedisError) -> bool {
    e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_connection_refusal()
}

/// Sleeps 5 ms, 10 ms, … up to 500 ms between retries.
async fn backoff(attempt: &mut u32) {
    let ms = (5u64 << (*attempt).min(7)).min(500);
    *attempt += 1;
    tokio::time::sleep(Duration::from_millis(ms)).await;
}

/// A multiplexed connection that is opened on first use and again after
/// it broke. Every connection carries a client name (`CLIENT LIST` shows
/// who is who).
struct Link {
    client: Client,
    name: String,
    config: AsyncConnectionConfig,
    /// Set when the consumer dies: nothing more goes out (what was sent
    /// before still arrives, as when a process is killed).
    cut: Arc<AtomicBool>,
    /// The connection and its generation (so that a caller failing on an
    /// old one does not throw away a newer one).
    conn: Mutex<(u64, Option<MultiplexedConnection>)>,
}

impl Link {
    fn new(client: Client, name: String, response_timeout: Duration, cut: Arc<AtomicBool>) -> Link {
        Link {
            client,
            name,
            cut,
            config: AsyncConnectionConfig::new()
                .set_connection_timeout(Some(Duration::from_secs(2)))
                .set_response_timeout(Some(response_timeout)),
            conn: Mutex::new((0, None)),
        }
    }

    async fn get(&self) -> RedisResult<(u64, MultiplexedConnection)> {
        if self.cut.load(Ordering::SeqCst) {
            return Err(std::io::Error::from(std::io::ErrorKind::BrokenPipe).into());
        }
        let cached = {
            let slot = self.conn.lock().unwrap();
            slot.1.clone().map(|c| (slot.0, c))
        };
        if let Some(c) = cached {
            return Ok(c);
        }
        let mut fresh = self
            .client
            .get_multiplexed_async_connection_with_config(&self.config)
            .await?;
        redis::cmd("CLIENT")
            .arg("SETNAME")
            .arg(&self.name)
            .query_async::<()>(&mut fresh)
            .await?;
        let mut slot = self.conn.lock().unwrap();
        if slot.1.is_none() {
            slot.0 += 1;
            slot.1 = Some(fresh);
        }
        Ok((slot.0, slot.1.clone().expect("set above")))
    }

    /// After `e` on connection `generation`: forget it if it broke.
    fn failed(&self, generation: u64, e: &RedisError) {
        if e.is_io_error() || e.is_connection_dropped() || e.is_connection_refusal() {
            let mut slot = self.conn.lock().unwrap();
            if slot.0 == generation {
                slot.1 = None;
            }
        }
    }

    async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> RedisResult<T> {
        let (generation, mut conn) = self.get().await?;
        let res = cmd.query_async(&mut conn).await;
        if let Err(e) = &res {
            self.failed(generation, e);
        }
        res
    }

    async fn query_pipe<T: redis::FromRedisValue>(&self, pipe: &redis::Pipeline) -> RedisResult<T> {
        let (generation, mut conn) = self.get().await?;
        let res = pipe.query_async(&mut conn).await;
        if let Err(e) = &res {
            self.failed(generation, e);
        }
        res
    }

    async fn invoke<T: redis::FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> RedisResult<T> {
        let (generation, mut conn) = self.get().await?;
        let res = invocation.invoke_async(&mut conn).await;
        if let Err(e) = &res {
            self.failed(generation, e);
        }
        res
    }
}

// ---------------------------------------------------------------- replies --

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

fn number<T: std::str::FromStr>(v: &Value) -> Option<T> {
    match v {
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        Value::Int(i) => i.to_string().parse().ok(),
        _ => None,
    }
}

/// One `[id, [field, value, …]]` entry; `None` for an entry deleted from
/// the stream (not produced here) or a malformed one.
fn parse_entry(v: &Value) -> Option<Entry> {
    let Value::Array(parts) = v else { return None };
    let id = text(parts.first()?)?;
    let Value::Array(fields) = parts.get(1)? else {
        return None;
    };
    let (mut key, mut seq, mut amount) = (None, None, None);
    for pair in fields.chunks(2) {
        let [name, value] = pair else { break };
        match text(name)?.as_str() {
            "key" => key = number(value),
            "seq" => seq = number(value),
            "amount" => amount = number(value),
            _ => {}
        }
    }
    Some(Entry {
        id,
        record: Record {
            key: key?,
            seq: seq?,
            amount: amount?,
        },
    })
}

fn parse_entries(v: &Value) -> Vec<Entry> {
    match v {
        Value::Array(items) => items.iter().filter_map(parse_entry).collect(),
        _ => Vec::new(),
    }
}

/// `XREADGROUP`'s reply for one stream: `nil` (timed out) or
/// `[[stream, [entry, …]]]` (a map in RESP3).
fn parse_read(v: &Value) -> Vec<Entry> {
    match v {
        Value::Array(streams) => streams
            .iter()
            .flat_map(|s| match s {
                Value::Array(pair) if pair.len() == 2 => parse_entries(&pair[1]),
                _ => Vec::new(),
            })
            .collect(),
        Value::Map(streams) => streams.iter().flat_map(|(_, e)| parse_entries(e)).collect(),
        _ => Vec::new(),
    }
}

// ------------------------------------------------------------------ store --

/// The handler's side: applies records through the `APPLY` script.
struct Store {
    link: Link,
    apply: Script,
    stats: Arc<Stats>,
}

impl Store {
    /// Applies `r`, retrying while Redis is unreachable: the record's
    /// completion (and so its ack) waits until the script ran, and the
    /// key's next record waits behind it. A force stop cancels the wait.
    async fn apply(&self, r: Record) -> Apply {
        let mut invocation = self.apply.prepare_invoke();
        invocation
            .key(LAST)
            .key(BALANCE)
            .key(STATS)
            .arg(r.key)
            .arg(r.seq)
            .arg(r.amount);
        let mut attempt = 0;
        loop {
            match self.link.invoke::<(i64, i64)>(&invocation).await {
                Ok((1, _)) => {
                    self.stats.applied.fetch_add(1, Ordering::Relaxed);
                    return Apply::Applied;
                }
                Ok((0, _)) => {
                    self.stats.duplicates.fetch_add(1, Ordering::Relaxed);
                    return Apply::Duplicate;
                }
                Ok((_, last)) => {
                    self.stats.gaps.fetch_add(1, Ordering::Relaxed);
                    return Apply::Gap { last };
                }
                Err(e) if transient(&e) => {
                    self.stats.retries.fetch_add(1, Ordering::Relaxed);
                    backoff(&mut attempt).await;
                }
                Err(e) => return Apply::Failed(e.to_string()),
            }
        }
    }
}

impl Store {
    /// The dead-letter hook: records `d` with the `DEAD` script before the
    /// key's next record runs (the hook runs while the key is held), over
    /// a connection of its own (the hook is sync; dead letters are rare).
    /// Retries while Redis is away, unless the consumer died.
    fn dead_letter(&self, d: DeadLetter<u64, Record, String>) {
        let script = Script::new(DEAD);
        let mut delay = Duration::from_millis(5);
        while !self.link.cut.load(Ordering::SeqCst) {
            let done = self.link.client.get_connection().and_then(|mut conn| {
                script
                    .key(LAST)
                    .key(STATS)
                    .key(DEAD_LETTERS)
                    .arg(d.key)
                    .arg(d.message.seq)
                    .arg(d.failure.to_string())
                    .arg(d.attempts)
                    .invoke::<i64>(&mut conn)
            });
            match done {
                Ok(_) => {
                    self.stats.dead_lettered.fetch_add(1, Ordering::Relaxed);
                    return;
                }
                Err(_) => {
                    std::thread::sleep(delay);
                    delay = (delay * 2).min(Duration::from_millis(500));
                }
            }
        }
    }
}

/// Why the handler refuses a record (before any write).
fn unapplicable(r: &Record) -> Option<String> {
    (r.amount == 0).then(|| format!("key {} seq {}: a zero amount is malformed", r.key, r.seq))
}

// ------------------------------------------------------------------ stats --

/// A consumer's counters (this process's view; Redis keeps the totals).
#[derive(Debug, Default)]
pub struct Stats {
    /// Records the script applied for this consumer.
    pub applied: AtomicU64,
    /// Records the script skipped as already applied.
    pub duplicates: AtomicU64,
    /// Records the script found out of order.
    pub gaps: AtomicU64,
    /// Script calls retried after a connection error.
    pub retries: AtomicU64,
    /// Entries read as new (`>`).
    pub read: AtomicU64,
    /// Entries claimed from the pending list (`XAUTOCLAIM`).
    pub claimed: AtomicU64,
    /// Entries acked.
    pub acked: AtomicU64,
    /// Records a force stop handed back or cancelled (left pending).
    pub handed_back: AtomicU64,
    /// Records the handler could not apply, written to the dead-letter
    /// stream by this consumer.
    pub dead_lettered: AtomicU64,
}

/// A copy of [`Stats`] at one moment.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct StatsSnapshot {
    pub applied: u64,
    pub duplicates: u64,
    pub gaps: u64,
    pub retries: u64,
    pub read: u64,
    pub claimed: u64,
    pub acked: u64,
    pub handed_back: u64,
    pub dead_lettered: u64,
}

impl Stats {
    pub fn snapshot(&self) -> StatsSnapshot {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        StatsSnapshot {
            applied: get(&self.applied),
            duplicates: get(&self.duplicates),
            gaps: get(&self.gaps),
            retries: get(&self.retries),
            read: get(&self.read),
            claimed: get(&self.claimed),
            acked: get(&self.acked),
            handed_back: get(&self.handed_back),
            dead_lettered: get(&self.dead_lettered),
        }
    }
}

// ----------------------------------------------------------------- events --

/// How a consumer came to own a partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Takeover {
    /// Its owner released it gracefully: claim what it left pending at once.
    HandedOff,
    /// Its lease was absent (expired, or never taken): claim what is
    /// pending once all of it has been idle for `claim_idle`.
    Vacant,
}

/// What a consumer tells about itself (printed by the example, checked by
/// the test).
#[derive(Debug, Clone)]
pub enum Event {
    /// The first heartbeat went through.
    Joined {
        consumer: String,
        members: Vec<String>,
    },
    /// It owns `partition` and has claimed what was pending; it reads new
    /// entries from now on.
    Started {
        consumer: String,
        partition: usize,
        how: Takeover,
        /// Waiting for the pending entries to be idle for `claim_idle`.
        waited: Duration,
        claimed: u64,
    },
    /// It let go of `partition` (hand-off): acked what finished, then
    /// released the lease.
    Released {
        consumer: String,
        partition: usize,
        /// Drained within the deadline (else force-stopped).
        drained: bool,
        handed_back: u64,
        acked: u64,
        took: Duration,
    },
    /// It stopped `partition` at once without releasing it (lease lost or
    /// not renewed in time).
    Fenced {
        consumer: String,
        partition: usize,
        why: String,
    },
    /// `partition` stopped on an order violation or a failed record; it
    /// stays owned and pending until someone looks.
    Halted {
        consumer: String,
        partition: usize,
        why: String,
    },
    /// A Redis call failed and is being retried.
    Trouble { consumer: String, what: String },
    /// It released everything and left the group.
    Left { consumer: String },
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Event::Joined { consumer, members } => {
                write!(f, "[{consumer}] joined; members {members:?}")
            }
            Event::Started {
                consumer,
                partition,
                how,
                waited,
                claimed,
            } => match how {
                Takeover::HandedOff => write!(
                    f,
                    "[{consumer}] partition {partition}: taken over from its previous owner's \
                     release; claimed {claimed} pending, now reading new entries"
                ),
                Takeover::Vacant => write!(
                    f,
                    "[{consumer}] partition {partition}: lease was vacant; waited {waited:.1?} for \
                     its pending entries to idle, claimed {claimed}, now reading new entries"
                ),
            },
            Event::Released {
                consumer,
                partition,
                drained,
                handed_back,
                acked,
                took,
            } => write!(
                f,
                "[{consumer}] partition {partition}: released in {took:.1?} ({}; {acked} acked \
                 at release, {handed_back} handed back pending)",
                if *drained {
                    "drained"
                } else {
                    "drain deadline passed: force-stopped"
                }
            ),
            Event::Fenced {
                consumer,
                partition,
                why,
            } => write!(f, "[{consumer}] partition {partition}: fenced ({why})"),
            Event::Halted {
                consumer,
                partition,
                why,
            } => write!(f, "[{consumer}] partition {partition}: HALTED: {why}"),
            Event::Trouble { consumer, what } => write!(f, "[{consumer}] retrying: {what}"),
            Event::Left { consumer } => write!(f, "[{consumer}] left the group"),
        }
    }
}

/// Where a consumer's events go.
pub type EventSink = Arc<dyn Fn(Event) + Send + Sync>;

// --------------------------------------------------------------- consumer --

/// A consumer's settings. [`ConsumerConfig::new`] gives the defaults.
#[derive(Debug, Clone)]
pub struct ConsumerConfig {
    pub url: String,
    /// Its name in the group (unique per live consumer).
    pub name: String,
    pub partitions: usize,
    /// The executor's worker threads (they poll the handlers' futures).
    pub workers: usize,
    /// The tokio threads (sockets, read loops, control loop).
    pub io_threads: usize,
    /// Per partition: records unfinished at most (its receiver's credit).
    pub max_in_flight: usize,
    /// `XREADGROUP … COUNT`.
    pub read_count: usize,
    /// `XREADGROUP … BLOCK`: how long an idle read waits (and so how late
    /// an ack may be when nothing new arrives).
    pub block: Duration,
    /// How long a member and its leases live without a heartbeat.
    pub lease: Duration,
    /// How long a dead owner's pending entries must have been idle before
    /// they are claimed.
    pub claim_idle: Duration,
    /// Heartbeat period.
    pub tick: Duration,
    /// How long a released partition may take to drain before it is
    /// force-stopped.
    pub drain_timeout: Duration,
    /// Wait this long after joining before taking partitions, so that
    /// consumers started together split them without a hand-off.
    pub initial_delay: Duration,
}

impl ConsumerConfig {
    pub fn new(url: impl Into<String>, name: impl Into<String>, partitions: usize) -> Self {
        ConsumerConfig {
            url: url.into(),
            name: name.into(),
            partitions,
            workers: 2,
            io_threads: 1,
            max_in_flight: 256,
            read_count: 128,
            block: Duration::from_millis(50),
            lease: Duration::from_secs(3),
            claim_idle: Duration::from_secs(3),
            tick: Duration::from_millis(100),
            drain_timeout: Duration::from_secs(5),
            initial_delay: Duration::ZERO,
        }
    }
}

/// Creates every partition's stream and the group on it (idempotent), and
/// records the number of partitions, refusing a different one.
pub async fn setup(conn: &mut MultiplexedConnection, partitions: usize) -> RedisResult<()> {
    let set: bool = redis::cmd("HSETNX")
        .arg(META)
        .arg("partitions")
        .arg(partitions)
        .query_async(conn)
        .await?;
    if !set {
        let existing: usize = redis::cmd("HGET")
            .arg(META)
            .arg("partitions")
            .query_async(conn)
            .await?;
        if existing != partitions {
            return Err(RedisError::from((
                redis::ErrorKind::Client,
                "partition count mismatch",
                format!("this Redis holds a ledger of {existing} partitions, not {partitions}"),
            )));
        }
    }
    for p in 0..partitions {
        let created: RedisResult<()> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(stream(p))
            .arg(GROUP)
            .arg("0")
            .arg("MKSTREAM")
            .query_async(conn)
            .await;
        match created {
            Ok(()) => {}
            Err(e) if e.code() == Some("BUSYGROUP") => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// One consumer: its executor, runtime and loops. Stop it with
/// [`leave`](Self::leave) (graceful) or [`crash`](Self::crash); dropping
/// it crashes it.
pub struct Consumer {
    name: String,
    shared: Arc<Shared>,
    executor: KeyedExecutor,
    runtime: Option<tokio::runtime::Runtime>,
    control: Option<JoinHandle<()>>,
    leave: watch::Sender<bool>,
}

/// What the loops of one consumer share.
struct Shared {
    cfg: ConsumerConfig,
    client: Client,
    dispatcher: Dispatcher<u64, Record, Apply>,
    store: Arc<Store>,
    stats: Arc<Stats>,
    /// Test hook: acks stop going out (see [`Consumer::stall_acks`]).
    stall_acks: AtomicBool,
    /// Every link's cut-off switch (see [`Consumer::crash`]).
    cut: Arc<AtomicBool>,
    owned: Mutex<BTreeSet<usize>>,
    /// A partition's loop ended: the control loop releases its lease now
    /// rather than at the next tick.
    ended: tokio::sync::Notify,
    events: EventSink,
}

impl Shared {
    fn emit(&self, event: Event) {
        (self.events)(event);
    }

    fn trouble(&self, what: impl fmt::Display) {
        self.emit(Event::Trouble {
            consumer: self.cfg.name.clone(),
            what: what.to_string(),
        });
    }

    fn link(&self, role: &str) -> Link {
        // Longer than any BLOCK, shorter than a lease.
        let timeout = (self.cfg.block * 10).max(Duration::from_secs(2));
        Link::new(
            self.client.clone(),
            format!("ledger:{}:{role}", self.cfg.name),
            timeout,
            self.cut.clone(),
        )
    }
}

impl Consumer {
    /// Connects, joins the group and starts taking partitions.
    ///
    /// # Errors
    /// A bad URL, Redis unreachable, or a ledger with another number of
    /// partitions.
    pub fn start(
        cfg: ConsumerConfig,
        events: EventSink,
    ) -> Result<Consumer, Box<dyn std::error::Error>> {
        assert!(!cfg.name.is_empty(), "a consumer needs a name");
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(cfg.io_threads)
            .thread_name(format!("{}-io", cfg.name))
            .enable_all()
            .build()?;
        // The handlers' futures use tokio timers (redis's response timeout,
        // the retry backoff): each worker enters the runtime for its whole
        // life. (The guard is forgotten: a fresh thread has no earlier
        // context to restore.)
        let handle = runtime.handle().clone();
        let executor = KeyedExecutor::builder()
            .workers(cfg.workers)
            .thread_name(format!("{}-worker", cfg.name))
            .on_thread_start(move || std::mem::forget(handle.enter()))
            .build()?;
        let client = Client::open(cfg.url.as_str())?;
        let stats = Arc::new(Stats::default());
        let cut = Arc::new(AtomicBool::new(false));
        let store = Arc::new(Store {
            link: Link::new(
                client.clone(),
                format!("ledger:{}:apply", cfg.name),
                Duration::from_secs(2),
                cut.clone(),
            ),
            apply: Script::new(APPLY),
            stats: stats.clone(),
        });
        let (s, dl) = (store.clone(), store.clone());
        // A record the handler cannot apply is tried again after 5, 10 and
        // 20 ms (its key's later records wait behind it), then dead-lettered.
        let policy = RetryPolicy::builder()
            .max_attempts(ATTEMPTS)
            .backoff(Backoff::exponential(
                Duration::from_millis(5),
                Duration::from_millis(100),
            ))
            .build()?;
        let dispatcher = executor.dispatcher(
            handler::retrying_async(policy, move |_key: u64, record: Record| {
                let store = s.clone();
                async move {
                    match unapplicable(&record) {
                        Some(error) => Err((record, error)),
                        None => Ok(store.apply(record).await),
                    }
                }
            })
            .on_dead_letter(move |d| dl.dead_letter(d)),
        );
        runtime.block_on(async {
            let (_, mut conn) = store.link.get().await?;
            setup(&mut conn, cfg.partitions).await
        })?;
        let name = cfg.name.clone();
        let shared = Arc::new(Shared {
            cfg,
            client,
            dispatcher,
            store,
            stats,
            stall_acks: AtomicBool::new(false),
            cut,
            owned: Mutex::new(BTreeSet::new()),
            ended: tokio::sync::Notify::new(),
            events,
        });
        let (leave, leave_rx) = watch::channel(false);
        let control = runtime.spawn(control_loop(shared.clone(), leave_rx));
        Ok(Consumer {
            name,
            shared,
            executor,
            runtime: Some(runtime),
            control: Some(control),
            leave,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// This consumer's counters.
    pub fn stats(&self) -> StatsSnapshot {
        self.shared.stats.snapshot()
    }

    /// The partitions it owns now (started or starting).
    pub fn owned(&self) -> BTreeSet<usize> {
        self.shared.owned.lock().unwrap().clone()
    }

    /// Fault injection for the crash test: from now on this consumer's
    /// acks no longer go out while it goes on applying records — as a
    /// process about to die whose applied records never get acked. What it
    /// applies from now on is redelivered after the crash and skipped as a
    /// duplicate.
    pub fn stall_acks(&self) {
        self.shared.stall_acks.store(true, Ordering::SeqCst);
    }

    /// Leaves gracefully: hands every partition off (drain, ack, release)
    /// and leaves the group. `false` if that took longer than `timeout`
    /// (then what was left is force-stopped and stays pending).
    pub fn leave(mut self, timeout: Duration) -> bool {
        let _ = self.leave.send(true);
        let runtime = self.runtime.take().expect("running");
        let control = self.control.take().expect("running");
        let left = matches!(
            runtime.block_on(async { tokio::time::timeout(timeout, control).await }),
            Ok(Ok(()))
        );
        if !left {
            self.executor.shutdown_now();
        }
        let stopped = self.executor.shutdown(Duration::from_secs(5));
        runtime.shutdown_timeout(Duration::from_secs(1));
        left && stopped
    }

    /// Dies as a killed process does: from this instant nothing more of
    /// it reaches Redis (what it had sent still lands: writes in flight,
    /// an ack on the wire); then its executor is force-stopped and its
    /// runtime dropped with every connection. Nothing is released, it does
    /// not leave the group: its entries stay pending — records applied but
    /// not acked included — until a survivor claims them.
    pub fn crash(mut self) {
        self.die();
    }

    fn die(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            self.shared.cut.store(true, Ordering::SeqCst);
            self.executor.shutdown_now();
            runtime.shutdown_background();
        }
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        self.die();
    }
}

// ----------------------------------------------------------- control loop --

/// What a partition's loop is asked to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    Run,
    /// Hand off: drain, ack, and return (the control loop then releases
    /// the lease).
    Release,
    /// Stop now; do not release.
    Fence,
}

/// How a partition's loop ended.
enum PartitionEnd {
    Released {
        /// It had claimed everything pending before it stopped.
        clean: bool,
        drained: bool,
        handed_back: u64,
        acked: u64,
        took: Duration,
    },
    Fenced(String),
    Halted(String),
}

struct Running {
    stop: watch::Sender<Stop>,
    task: JoinHandle<PartitionEnd>,
}

/// The consumer's heartbeat: membership, leases, assignment; starts and
/// stops the partitions' loops. Returns once it left the group.
async fn control_loop(shared: Arc<Shared>, mut leave: watch::Receiver<bool>) {
    let cfg = &shared.cfg;
    let me = cfg.name.clone();
    let link = shared.link("control");
    let heartbeat = Script::new(HEARTBEAT);
    let acquire = Script::new(ACQUIRE);
    let release = Script::new(RELEASE);
    let mut running: BTreeMap<usize, Running> = BTreeMap::new();
    let mut halted: BTreeSet<usize> = BTreeSet::new();
    let mut releasing: BTreeSet<usize> = BTreeSet::new();
    let mut renewed: Option<Instant> = None;
    let mut joined = false;
    let started = Instant::now();
    let mut ticks = tokio::time::interval(cfg.tick);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            _ = leave.changed() => {}
            _ = shared.ended.notified() => {}
        }
        let leaving = *leave.borrow();

        // Partitions whose loop has ended.
        let ended: Vec<usize> = running
            .iter()
            .filter(|(_, r)| r.task.is_finished())
            .map(|(&p, _)| p)
            .collect();
        for p in ended {
            let r = running.remove(&p).expect("listed");
            releasing.remove(&p);
            match r.task.await {
                Ok(PartitionEnd::Released {
                    clean,
                    drained,
                    handed_back,
                    acked,
                    took,
                }) => {
                    // Everything acked and fenced: only now may the next
                    // owner start.
                    let mut inv = release.prepare_invoke();
                    inv.key(owner_key(p)).arg(&me).arg(u8::from(clean));
                    let mut attempt = 0;
                    while let Err(e) = link.invoke::<i64>(&inv).await {
                        shared.trouble(format_args!("releasing partition {p}: {e}"));
                        if attempt > 5 {
                            break; // it will expire instead
                        }
                        backoff(&mut attempt).await;
                    }
                    shared.emit(Event::Released {
                        consumer: me.clone(),
                        partition: p,
                        drained,
                        handed_back,
                        acked,
                        took,
                    });
                }
                Ok(PartitionEnd::Fenced(why)) => shared.emit(Event::Fenced {
                    consumer: me.clone(),
                    partition: p,
                    why,
                }),
                Ok(PartitionEnd::Halted(why)) => {
                    halted.insert(p);
                    shared.emit(Event::Halted {
                        consumer: me.clone(),
                        partition: p,
                        why,
                    });
                }
                Err(e) => shared.trouble(format_args!("partition {p}'s loop died: {e}")),
            }
        }
        *shared.owned.lock().unwrap() = running.keys().chain(&halted).copied().collect();

        // Heartbeat: membership and leases.
        let owned: Vec<usize> = running.keys().chain(&halted).copied().collect();
        let mut inv = heartbeat.prepare_invoke();
        inv.key(MEMBERS);
        for &p in &owned {
            inv.key(owner_key(p));
        }
        inv.arg(&me)
            .arg(cfg.lease.as_millis() as u64)
            .arg(u8::from(!leaving));
        let sent = Instant::now();
        let beat = tokio::time::timeout(
            cfg.lease / 3,
            link.invoke::<(Vec<String>, Vec<usize>)>(&inv),
        )
        .await;
        let members = match beat {
            Ok(Ok((members, lost))) => {
                renewed = Some(sent);
                for i in lost {
                    let p = owned[i - 1];
                    if let Some(r) = running.get(&p) {
                        let _ = r.stop.send(Stop::Fence);
                    }
                    if halted.remove(&p) {
                        shared.emit(Event::Fenced {
                            consumer: me.clone(),
                            partition: p,
                            why: "lease lost while halted".into(),
                        });
                    }
                }
                if !joined && !leaving {
                    joined = true;
                    shared.emit(Event::Joined {
                        consumer: me.clone(),
                        members: members.clone(),
                    });
                }
                members
            }
            failed => {
                let why = match failed {
                    Ok(Err(e)) => e.to_string(),
                    _ => "heartbeat timed out".to_string(),
                };
                shared.trouble(format_args!("heartbeat: {why}"));
                // Not renewed for 2/3 of a lease: someone may take our
                // partitions soon. Stop them now.
                let overdue = match renewed {
                    Some(t) => t.elapsed() > cfg.lease * 2 / 3,
                    None => true,
                };
                if overdue {
                    for r in running.values() {
                        let _ = r.stop.send(Stop::Fence);
                    }
                    halted.clear();
                }
                continue;
            }
        };
        if leaving && running.is_empty() {
            break;
        }

        if !leaving && started.elapsed() < cfg.initial_delay {
            continue; // let the others who start with us join first
        }
        // The assignment: release what is no longer ours, take what is.
        let wanted = if leaving {
            BTreeSet::new()
        } else {
            assignment(&members, &me, cfg.partitions)
        };
        for (p, r) in &running {
            if !wanted.contains(p) && releasing.insert(*p) {
                let _ = r.stop.send(Stop::Release);
            }
        }
        if leaving {
            continue;
        }
        for &p in &wanted {
            if running.contains_key(&p) || halted.contains(&p) {
                continue;
            }
            let mut inv = acquire.prepare_invoke();
            inv.key(owner_key(p))
                .arg(&me)
                .arg(cfg.lease.as_millis() as u64);
            let how = match link.invoke::<Option<String>>(&inv).await {
                Ok(Some(how)) if how == "released" => Takeover::HandedOff,
                Ok(Some(_)) => Takeover::Vacant,
                Ok(None) => continue, // still held: its owner is letting go
                Err(e) => {
                    shared.trouble(format_args!("acquiring partition {p}: {e}"));
                    continue;
                }
            };
            let (stop, stop_rx) = watch::channel(Stop::Run);
            let task = tokio::spawn(run_partition(shared.clone(), p, how, stop_rx));
            running.insert(p, Running { stop, task });
        }
        *shared.owned.lock().unwrap() = running.keys().chain(&halted).copied().collect();
    }
    shared.owned.lock().unwrap().clear();
    shared.emit(Event::Left { consumer: me });
}

// --------------------------------------------------------- partition loop --

/// One owned partition: its receiver, its read connection, the records in
/// flight and the acks not yet sent.
struct Partition {
    shared: Arc<Shared>,
    p: usize,
    stream: String,
    link: Link,
    receiver: Receiver<u64, Record, Apply>,
    in_flight: Vec<(String, Completion<Apply, Record>)>,
    acks: Vec<String>,
    acked: u64,
    handed_back: u64,
    /// Everything that was pending when it started has been claimed.
    claimed_all: bool,
    /// Why the partition must stop (an order violation, a failed record).
    halt: Option<String>,
}

/// Claims, then reads, until asked to stop; then drains or stops.
async fn run_partition(
    shared: Arc<Shared>,
    p: usize,
    how: Takeover,
    mut stop: watch::Receiver<Stop>,
) -> PartitionEnd {
    let receiver = shared
        .dispatcher
        .receiver_builder()
        .max_in_flight(shared.cfg.max_in_flight)
        // The commit point is what a partition acks up to.
        .track_commits(true)
        .build()
        .expect("max_in_flight > 0");
    let mut part = Partition {
        link: shared.link(&format!("p{p}")),
        shared: shared.clone(),
        p,
        stream: stream(p),
        receiver,
        in_flight: Vec::new(),
        acks: Vec::new(),
        acked: 0,
        handed_back: 0,
        claimed_all: false,
        halt: None,
    };
    if part.claim(how, &mut stop).await {
        part.read(&mut stop).await;
    }
    let how_stopped = *stop.borrow();
    let end = part.finish(how_stopped).await;
    // Wakes the control loop (a permit is kept if it is busy right now).
    shared.ended.notify_one();
    end
}

impl Partition {
    fn stopping(stop: &watch::Receiver<Stop>) -> bool {
        *stop.borrow() != Stop::Run
    }

    /// Claims everything pending in the stream and submits it in ID order.
    /// `false` if asked to stop (or halted) first.
    async fn claim(&mut self, how: Takeover, stop: &mut watch::Receiver<Stop>) -> bool {
        let shared = self.shared.clone();
        let cfg = &shared.cfg;
        let began = Instant::now();
        let min_idle = match how {
            // The owner drained, acked and fenced before letting go.
            Takeover::HandedOff => Duration::ZERO,
            Takeover::Vacant => {
                if !self.wait_until_idle(cfg.claim_idle, stop).await {
                    return false;
                }
                cfg.claim_idle
            }
        };
        let waited = began.elapsed();
        let mut claimed = 0u64;
        let mut cursor = "0-0".to_string();
        let mut attempt = 0;
        loop {
            if Self::stopping(stop) || self.halt.is_some() {
                return false;
            }
            let mut cmd = redis::cmd("XAUTOCLAIM");
            cmd.arg(&self.stream)
                .arg(GROUP)
                .arg(&cfg.name)
                .arg(min_idle.as_millis() as u64)
                .arg(&cursor)
                .arg("COUNT")
                .arg(cfg.read_count);
            let reply: Value = match self.link.query(&cmd).await {
                Ok(v) => v,
                Err(e) => {
                    self.shared
                        .trouble(format_args!("XAUTOCLAIM {}: {e}", self.stream));
                    backoff(&mut attempt).await;
                    continue;
                }
            };
            let Value::Array(parts) = &reply else {
                self.halt = Some(format!("unexpected XAUTOCLAIM reply {reply:?}"));
                return false;
            };
            let next = parts.first().and_then(text).unwrap_or_else(|| "0-0".into());
            let entries = parts.get(1).map(parse_entries).unwrap_or_default();
            claimed += entries.len() as u64;
            self.shared
                .stats
                .claimed
                .fetch_add(entries.len() as u64, Ordering::Relaxed);
            if !self.submit(entries, stop).await {
                return false;
            }
            self.collect();
            self.send_acks().await;
            if next == "0-0" {
                break;
            }
            cursor = next;
        }
        self.claimed_all = true;
        self.shared.emit(Event::Started {
            consumer: cfg.name.clone(),
            partition: self.p,
            how,
            waited,
            claimed,
        });
        true
    }

    /// Waits until every pending entry of the stream has been idle for
    /// `idle` (nobody delivered it more recently), so one claim pass takes
    /// them all: claiming some and reading new ones before the rest would
    /// let a key's later record overtake an earlier one.
    async fn wait_until_idle(&mut self, idle: Duration, stop: &mut watch::Receiver<Stop>) -> bool {
        let mut attempt = 0;
        loop {
            if Self::stopping(stop) {
                return false;
            }
            let mut summary = redis::cmd("XPENDING");
            summary.arg(&self.stream).arg(GROUP);
            let pending = match self.link.query::<Value>(&summary).await {
                Ok(Value::Array(v)) => v.first().and_then(number::<u64>).unwrap_or(0),
                Ok(_) => 0,
                Err(e) => {
                    self.shared.trouble(format_args!("XPENDING: {e}"));
                    backoff(&mut attempt).await;
                    continue;
                }
            };
            if pending == 0 {
                return true;
            }
            let mut old = redis::cmd("XPENDING");
            old.arg(&self.stream)
                .arg(GROUP)
                .arg("IDLE")
                .arg(idle.as_millis() as u64)
                .arg("-")
                .arg("+")
                .arg(pending);
            match self.link.query::<Vec<Value>>(&old).await {
                Ok(v) if v.len() as u64 >= pending => return true,
                Ok(_) => {}
                Err(e) => self.shared.trouble(format_args!("XPENDING IDLE: {e}")),
            }
            tokio::select! {
                _ = tokio::time::sleep(self.shared.cfg.tick) => {}
                _ = stop.changed() => {}
            }
        }
    }

    /// Reads new entries until asked to stop (or halted).
    async fn read(&mut self, stop: &mut watch::Receiver<Stop>) {
        let shared = self.shared.clone();
        let cfg = &shared.cfg;
        let mut attempt = 0;
        while !Self::stopping(stop) && self.halt.is_none() {
            self.collect();
            // One round trip: the acks of everything finished since the
            // last round, then the read.
            let mut pipe = redis::pipe();
            let acking = !self.acks.is_empty() && !self.shared.stall_acks.load(Ordering::SeqCst);
            if acking {
                pipe.cmd("XACK")
                    .arg(&self.stream)
                    .arg(GROUP)
                    .arg(&self.acks);
            }
            pipe.cmd("XREADGROUP")
                .arg("GROUP")
                .arg(GROUP)
                .arg(&cfg.name)
                .arg("COUNT")
                .arg(cfg.read_count)
                .arg("BLOCK")
                .arg(cfg.block.as_millis() as u64)
                .arg("STREAMS")
                .arg(&self.stream)
                .arg(">");
            let replies: Vec<Value> = match self.link.query_pipe(&pipe).await {
                Ok(v) => v,
                Err(e) => {
                    self.shared
                        .trouble(format_args!("XREADGROUP {}: {e}", self.stream));
                    backoff(&mut attempt).await;
                    continue;
                }
            };
            attempt = 0;
            if acking {
                self.note_acked();
            }
            let entries = replies.last().map(parse_read).unwrap_or_default();
            self.shared
                .stats
                .read
                .fetch_add(entries.len() as u64, Ordering::Relaxed);
            if !self.submit(entries, stop).await {
                return;
            }
        }
    }

    /// Submits entries in order, waiting for credit. `false` if asked to
    /// stop first: the entries not submitted stay pending (the next owner
    /// claims them, after those submitted here).
    async fn submit(&mut self, entries: Vec<Entry>, stop: &mut watch::Receiver<Stop>) -> bool {
        for Entry { id, record } in entries {
            if Self::stopping(stop) {
                return false;
            }
            let submitted = tokio::select! {
                biased;
                _ = stop.changed() => return false,
                r = self.receiver.submit(record.key, record) => r,
            };
            match submitted {
                Ok(done) => self.in_flight.push((id, done)),
                // Closed: the executor is stopping under us (a crash).
                Err(_) => return false,
            }
        }
        true
    }

    /// Moves every finished record out of `in_flight`: acks for the
    /// applied ones, a halt for a gap or a failure.
    fn collect(&mut self) {
        let mut i = 0;
        while i < self.in_flight.len() {
            if self.in_flight[i].1.is_finished() {
                let (id, done) = self.in_flight.swap_remove(i);
                self.settle(id, done.wait());
            } else {
                i += 1;
            }
        }
    }

    fn settle(&mut self, id: String, outcome: Result<Apply, TaskError<Record>>) {
        match outcome {
            Ok(Apply::Applied | Apply::Duplicate) => self.acks.push(id),
            Ok(Apply::Gap { last }) => {
                self.halt.get_or_insert(format!(
                    "entry {id}: order violation, the key's last applied seq is {last}"
                ));
            }
            Ok(Apply::Failed(e)) => {
                self.halt.get_or_insert(format!("entry {id}: {e}"));
            }
            Err(TaskError::Panicked(p)) => {
                self.halt
                    .get_or_insert(format!("entry {id}: handler panicked: {p}"));
            }
            // Handed back by a force stop: not applied; stays pending.
            Err(TaskError::Rejected(_) | TaskError::Cancelled) => {
                self.handed_back += 1;
                self.shared
                    .stats
                    .handed_back
                    .fetch_add(1, Ordering::Relaxed);
            }
            // Tried and refused `ATTEMPTS` times; the hook wrote it to the
            // dead-letter stream (and advanced its key): ack it, move on.
            Err(TaskError::DeadLettered { .. }) => self.acks.push(id),
            Err(other) => {
                self.halt
                    .get_or_insert(format!("entry {id}: unexpected end: {other}"));
            }
        }
    }

    fn note_acked(&mut self) {
        let n = self.acks.len() as u64;
        self.acked += n;
        self.shared.stats.acked.fetch_add(n, Ordering::Relaxed);
        self.acks.clear();
    }

    /// Sends the pending acks on their own (when there is no read to ride
    /// on), retrying a few times.
    async fn send_acks(&mut self) {
        let mut attempt = 0;
        while !self.acks.is_empty() && !self.shared.stall_acks.load(Ordering::SeqCst) {
            let mut cmd = redis::cmd("XACK");
            cmd.arg(&self.stream).arg(GROUP).arg(&self.acks);
            match self.link.query::<u64>(&cmd).await {
                Ok(_) => self.note_acked(),
                Err(e) if attempt < 10 => {
                    self.shared
                        .trouble(format_args!("XACK {}: {e}", self.stream));
                    backoff(&mut attempt).await;
                }
                // Give up: they stay pending and come back as duplicates.
                Err(_) => return,
            }
        }
    }

    /// Stops the partition as `stop` (or a halt) says, settles every
    /// record and acks what was applied.
    async fn finish(mut self, stop: Stop) -> PartitionEnd {
        let began = Instant::now();
        let acked_before = self.acked;
        let graceful = stop == Stop::Release && self.halt.is_none();
        let drained = if graceful {
            // Hand-off: drain within the deadline, else stop now.
            let drained = self
                .receiver
                .shutdown_async(self.shared.cfg.drain_timeout)
                .await;
            if !drained {
                self.receiver.shutdown_now();
            }
            drained
        } else {
            self.receiver.shutdown_now();
            false
        };
        // Every record has ended now (finished, handed back or cancelled).
        for (id, done) in std::mem::take(&mut self.in_flight) {
            let outcome = done.await;
            self.settle(id, outcome);
        }
        self.send_acks().await;
        if graceful {
            // Fence: the store connection runs commands in order, so once
            // this PING answers, no script of a cancelled record can still
            // land after the next owner starts.
            let _ = self
                .shared
                .store
                .link
                .query::<String>(&redis::cmd("PING"))
                .await;
        }
        if let Some(why) = self.halt {
            return PartitionEnd::Halted(why);
        }
        match stop {
            Stop::Release => PartitionEnd::Released {
                clean: self.claimed_all,
                drained,
                handed_back: self.handed_back,
                acked: self.acked - acked_before,
                took: began.elapsed(),
            },
            Stop::Fence => PartitionEnd::Fenced("its lease was lost or not renewed in time".into()),
            Stop::Run => PartitionEnd::Fenced("its executor stopped under it".into()),
        }
    }
}

// --------------------------------------------------------------- producer --

/// The amount of the `i`-th record produced: mostly deposits, some
/// withdrawals, and every thousandth a malformed one (zero) that the
/// handler cannot apply.
pub fn amount_of(i: u64) -> i64 {
    if i % 1000 == 999 {
        0 // malformed: the handler refuses it, and it is dead-lettered
    } else if i % 5 == 4 {
        -25
    } else {
        10
    }
}

/// Appends `records` records over `keys` keys (`key = i % keys`, from
/// `first_key`), `batch` per `PRODUCE` call, at most `rate` per second if
/// given. Calls `progress` with the total after each batch.
pub async fn produce(
    conn: &mut MultiplexedConnection,
    partitions: usize,
    keys: u64,
    records: u64,
    batch: u64,
    rate: Option<u64>,
    mut progress: impl FnMut(u64),
) -> RedisResult<()> {
    setup(conn, partitions).await?;
    let script = Script::new(PRODUCE);
    let began = Instant::now();
    let mut done = 0;
    while done < records {
        let n = batch.min(records - done);
        let mut inv = script.prepare_invoke();
        inv.key(PRODUCED).key(EXPECTED).key(META);
        for p in 0..partitions {
            inv.key(stream(p));
        }
        for i in done..done + n {
            let key = i % keys;
            inv.arg(partition_of(key, partitions))
                .arg(key)
                .arg(amount_of(i));
        }
        inv.invoke_async::<u64>(conn).await?;
        done += n;
        progress(done);
        if let Some(rate) = rate {
            let due = Duration::from_secs_f64(done as f64 / rate as f64);
            if let Some(ahead) = due.checked_sub(began.elapsed()) {
                tokio::time::sleep(ahead).await;
            }
        }
    }
    Ok(())
}

// ----------------------------------------------------------------- checks --

/// What Redis says after a run.
#[derive(Debug, Clone, Default)]
pub struct Verification {
    pub keys: usize,
    pub produced: u64,
    pub applied: u64,
    /// Records dead-lettered (by the `DEAD` script's count).
    pub dead: u64,
    /// Records the producer wrote that cannot be applied.
    pub poisoned: u64,
    /// Entries in the dead-letter stream.
    pub dead_stream: u64,
    pub duplicates: u64,
    pub gaps: u64,
    /// Entries delivered and not acked, over all partitions.
    pub pending: u64,
    /// Keys whose last applied seq is not their last produced one:
    /// (key, produced, applied).
    pub incomplete: Vec<(u64, u64, u64)>,
    /// Keys whose balance is not what the producer summed:
    /// (key, expected, actual).
    pub wrong_balance: Vec<(u64, i64, i64)>,
}

impl Verification {
    /// Every record applied exactly once, in order, and acked; each one
    /// that cannot be applied dead-lettered exactly once instead.
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.applied + self.poisoned != self.produced {
            out.push(format!(
                "{} applied of {} produced ({} cannot be)",
                self.applied, self.produced, self.poisoned
            ));
        }
        if self.dead != self.poisoned || self.dead_stream != self.poisoned {
            out.push(format!(
                "{} records cannot be applied, but {} were dead-lettered and the \
                 dead-letter stream holds {}",
                self.poisoned, self.dead, self.dead_stream
            ));
        }
        if self.gaps != 0 {
            out.push(format!("{} order violations (gaps)", self.gaps));
        }
        if self.pending != 0 {
            out.push(format!("{} entries still pending", self.pending));
        }
        if !self.incomplete.is_empty() {
            out.push(format!(
                "{} keys incomplete, e.g. (key, produced, applied) {:?}",
                self.incomplete.len(),
                &self.incomplete[..self.incomplete.len().min(5)]
            ));
        }
        if !self.wrong_balance.is_empty() {
            out.push(format!(
                "{} keys with a wrong balance, e.g. (key, expected, actual) {:?}",
                self.wrong_balance.len(),
                &self.wrong_balance[..self.wrong_balance.len().min(5)]
            ));
        }
        out
    }
}

/// Totals from `ledger:stats`: (settled: applied or dead-lettered,
/// duplicates, gaps).
pub async fn totals(conn: &mut MultiplexedConnection) -> RedisResult<(u64, u64, u64)> {
    let (a, x, d, g): (Option<u64>, Option<u64>, Option<u64>, Option<u64>) = redis::cmd("HMGET")
        .arg(STATS)
        .arg("applied")
        .arg("dead")
        .arg("duplicates")
        .arg("gaps")
        .query_async(conn)
        .await?;
    Ok((
        a.unwrap_or(0) + x.unwrap_or(0),
        d.unwrap_or(0),
        g.unwrap_or(0),
    ))
}

/// Records produced so far (the sum of every key's count).
pub async fn produced(conn: &mut MultiplexedConnection) -> RedisResult<u64> {
    let counts: Vec<u64> = redis::cmd("HVALS").arg(PRODUCED).query_async(conn).await?;
    Ok(counts.iter().sum())
}

/// Entries pending (delivered, not acked) over all partitions.
pub async fn pending(conn: &mut MultiplexedConnection, partitions: usize) -> RedisResult<u64> {
    let mut total = 0;
    for p in 0..partitions {
        let summary: Value = redis::cmd("XPENDING")
            .arg(stream(p))
            .arg(GROUP)
            .query_async(conn)
            .await?;
        if let Value::Array(v) = summary {
            total += v.first().and_then(number::<u64>).unwrap_or(0);
        }
    }
    Ok(total)
}

/// Checks the applied state against what was produced.
pub async fn verify(
    conn: &mut MultiplexedConnection,
    partitions: usize,
) -> RedisResult<Verification> {
    let produced: BTreeMap<u64, u64> = redis::cmd("HGETALL")
        .arg(PRODUCED)
        .query_async(conn)
        .await?;
    let expected: BTreeMap<u64, i64> = redis::cmd("HGETALL")
        .arg(EXPECTED)
        .query_async(conn)
        .await?;
    let last: BTreeMap<u64, i64> = redis::cmd("HGETALL").arg(LAST).query_async(conn).await?;
    let balance: BTreeMap<u64, i64> = redis::cmd("HGETALL").arg(BALANCE).query_async(conn).await?;
    let (settled, duplicates, gaps) = totals(conn).await?;
    let dead: Option<u64> = redis::cmd("HGET")
        .arg(STATS)
        .arg("dead")
        .query_async(conn)
        .await?;
    let poisoned: Option<u64> = redis::cmd("HGET")
        .arg(META)
        .arg("poisoned")
        .query_async(conn)
        .await?;
    let dead_stream: u64 = redis::cmd("XLEN")
        .arg(DEAD_LETTERS)
        .query_async(conn)
        .await?;
    let dead = dead.unwrap_or(0);
    let mut v = Verification {
        keys: produced.len(),
        produced: produced.values().sum(),
        applied: settled - dead,
        dead,
        poisoned: poisoned.unwrap_or(0),
        dead_stream,
        duplicates,
        gaps,
        pending: pending(conn, partitions).await?,
        ..Verification::default()
    };
    for (&key, &count) in &produced {
        let done = last.get(&key).map_or(0, |&l| (l + 1) as u64);
        if done != count {
            v.incomplete.push((key, count, done));
        }
        let want = expected.get(&key).copied().unwrap_or(0);
        let got = balance.get(&key).copied().unwrap_or(0);
        if want != got {
            v.wrong_balance.push((key, want, got));
        }
    }
    Ok(v)
}

/// The median round trip of `PING` over one connection, and of one
/// `APPLY` call (on a throwaway key, then removed), each over `n` calls.
pub async fn round_trips(
    conn: &mut MultiplexedConnection,
    n: usize,
) -> RedisResult<(Duration, Duration)> {
    let mut ping = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        redis::cmd("PING").query_async::<String>(conn).await?;
        ping.push(t.elapsed());
    }
    let script = Script::new(APPLY);
    let mut apply = Vec::with_capacity(n);
    for seq in 0..n as u64 {
        let t = Instant::now();
        script
            .key("ledger:rtt:last")
            .key("ledger:rtt:balance")
            .key("ledger:rtt:stats")
            .arg(0)
            .arg(seq)
            .arg(1)
            .invoke_async::<(i64, i64)>(conn)
            .await?;
        apply.push(t.elapsed());
    }
    redis::cmd("DEL")
        .arg("ledger:rtt:last")
        .arg("ledger:rtt:balance")
        .arg("ledger:rtt:stats")
        .query_async::<()>(conn)
        .await?;
    ping.sort();
    apply.sort();
    Ok((ping[n / 2], apply[n / 2]))
}
