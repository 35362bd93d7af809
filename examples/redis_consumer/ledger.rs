//! The ledger on top of `keyed-executor-redis`: what `main.rs` runs from
//! the command line and `tests/broker_redis.rs` runs in-process (both
//! include this file, so the test checks the very code the example ships).
//!
//! The crate does the consuming (partitions, leases, hand-offs, crash
//! recovery, acks, dead letters: see its docs). This file is what is the
//! ledger's own: its record format and decode function, its handler (the
//! `APPLY` and `DEAD` scripts), its producer and its check.
//!
//! # What lives where
//!
//! | Redis key | what |
//! |---|---|
//! | `ledger:{p}` | partition `p`: a stream; a key's records are all in stream `partition_of(key)` |
//! | group `ledger` on each stream | the consumer group |
//! | `ledger:last`, `ledger:balance` | the applied state: per key, the last sequence number applied and the balance |
//! | `ledger:stats` | `applied`, `duplicates` (a redelivery skipped), `gaps` (an order violation), `dead` (dead-lettered) |
//! | `ledger:dead` | the dead-letter stream (written by the crate): each record the handler gave up on |
//! | `ledger:produced`, `ledger:expected` | what the producer wrote: per key, how many records and the balance they sum to; `ledger:meta`'s `poisoned`: how many of them cannot be applied |
//! | `ledger:members`, `ledger:owner:{p}`, `ledger:layout` | the crate's membership, leases and layout |
//!
//! # The handler
//!
//! Async: it runs the `APPLY` Lua script over a shared multiplexed
//! connection, so one key's records apply one at a time, in order, while
//! thousands of keys' scripts are in flight together. The script applies
//! `seq == last + 1`, skips `seq <= last` as a duplicate (a redelivery
//! after a crash) and reports anything else as a gap; the verdict halts the
//! partition on a gap (its record stays pending for a person to look at).
//!
//! A record with a zero amount is malformed (every thousandth the producer
//! writes is one). The handler runs under a retry policy
//! (`handler::retrying_async`): a refused record is tried three more times
//! with backoff, its key's later records waiting behind it, and then goes
//! to the dead-letter hook, which runs the `DEAD` script — idempotent by
//! sequence number, like `APPLY`: it advances the key's last seq past the
//! record and counts it. Its completion says `DeadLettered`, and the crate
//! writes it to `ledger:dead` and acks it in one step: once, however often
//! it is delivered.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keyed_executor::handler::{self, DeadLetter};
use keyed_executor::{Backoff, RetryPolicy};
use keyed_executor_redis::{
    partition_of, Consumer, DecodeError, Entry, Event, LeaveError, StartError, Streams, Verdict,
};
use redis::aio::MultiplexedConnection;
use redis::{Client, RedisError, RedisResult, Script, Value};

/// The consumer group on every partition's stream.
pub const GROUP: &str = "ledger";
const LAST: &str = "ledger:last";
const BALANCE: &str = "ledger:balance";
const STATS: &str = "ledger:stats";
const PRODUCED: &str = "ledger:produced";
const EXPECTED: &str = "ledger:expected";
const META: &str = "ledger:meta";
/// The dead-letter stream.
pub const DEAD_LETTERS: &str = "ledger:dead";
/// Attempts a record gets before it is dead-lettered (three retries).
pub const ATTEMPTS: u32 = 4;

/// The partitions: `ledger:0`, `ledger:1`, ….
pub fn streams(partitions: usize) -> Streams {
    Streams::numbered("ledger:", partitions)
}

/// Partition `p`'s stream.
pub fn stream(p: usize) -> String {
    format!("ledger:{p}")
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

/// Gives up on a record the handler could not apply, idempotently by its
/// sequence number: `seq == last + 1` advances the key past it and counts
/// it; `seq <= last` is a redelivery (a duplicate); anything else a gap.
/// (The crate writes the record to the dead-letter stream.)
/// KEYS: last, stats. ARGV: key, seq.
const DEAD: &str = r#"
local last = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '-1')
local seq = tonumber(ARGV[2])
if seq == last + 1 then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('HINCRBY', KEYS[2], 'dead', 1)
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

// ----------------------------------------------------------------- record --

/// One ledger record: the `seq`-th change of `key`'s balance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    pub key: u64,
    pub seq: u64,
    pub amount: i64,
}

/// A stream entry's fields to `(key, record)`.
pub fn decode(entry: &Entry) -> Result<(u64, Record), DecodeError> {
    let record = Record {
        key: entry.parse("key")?,
        seq: entry.parse("seq")?,
        amount: entry.parse("amount")?,
    };
    Ok((record.key, record))
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

/// Ack what applied or was a duplicate; halt the partition on a gap or a
/// failure (the record stays pending for a person to look at).
pub fn verdict(a: &Apply) -> Verdict {
    match a {
        Apply::Applied | Apply::Duplicate => Verdict::Ack,
        Apply::Gap { last } => Verdict::Halt(format!(
            "order violation: the key's last applied seq is {last}"
        )),
        Apply::Failed(e) => Verdict::Halt(e.clone()),
    }
}

/// Why the handler refuses a record (before any write).
fn unapplicable(r: &Record) -> Option<String> {
    (r.amount == 0).then(|| format!("key {} seq {}: a zero amount is malformed", r.key, r.seq))
}

// ------------------------------------------------------------------ store --

/// Errors worth retrying: the connection or the server is away for now.
fn transient(e: &RedisError) -> bool {
    e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_connection_refusal()
}

/// The handler's side: applies records through the `APPLY` script over a
/// connection opened again after it broke.
pub struct Store {
    client: Client,
    conn: Mutex<Option<MultiplexedConnection>>,
    apply: Script,
    stats: Stats,
}

impl Store {
    fn new(client: Client) -> Store {
        Store {
            client,
            conn: Mutex::new(None),
            apply: Script::new(APPLY),
            stats: Stats::default(),
        }
    }

    async fn conn(&self) -> RedisResult<MultiplexedConnection> {
        if let Some(c) = self.conn.lock().unwrap().clone() {
            return Ok(c);
        }
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(2)))
            .set_response_timeout(Some(Duration::from_secs(2)));
        let c = self
            .client
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        *self.conn.lock().unwrap() = Some(c.clone());
        Ok(c)
    }

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
        let mut delay = Duration::from_millis(5);
        loop {
            let done = match self.conn().await {
                Ok(mut conn) => invocation.invoke_async::<(i64, i64)>(&mut conn).await,
                Err(e) => Err(e),
            };
            match done {
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
                    *self.conn.lock().unwrap() = None;
                    self.stats.retries.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_millis(500));
                }
                Err(e) => return Apply::Failed(e.to_string()),
            }
        }
    }

    /// The dead-letter hook: runs the `DEAD` script before the key's next
    /// record runs (the hook runs while the key is held), over a
    /// connection of its own (the hook is sync; dead letters are rare).
    /// Retries while Redis is away.
    fn dead_letter(&self, d: DeadLetter<u64, Record, String>) {
        let script = Script::new(DEAD);
        let mut delay = Duration::from_millis(5);
        loop {
            let done = self
                .client
                .get_connection_with_timeout(Duration::from_secs(2))
                .and_then(|mut conn| {
                    script
                        .key(LAST)
                        .key(STATS)
                        .arg(d.key)
                        .arg(d.message.seq)
                        .invoke::<i64>(&mut conn)
                });
            if done.is_ok() {
                self.stats.dead_lettered.fetch_add(1, Ordering::Relaxed);
                return;
            }
            std::thread::sleep(delay);
            delay = (delay * 2).min(Duration::from_millis(500));
        }
    }
}

// ------------------------------------------------------------------ stats --

/// A node's ledger counters (this process's view; Redis keeps the totals).
#[derive(Debug, Default)]
pub struct Stats {
    applied: AtomicU64,
    duplicates: AtomicU64,
    gaps: AtomicU64,
    retries: AtomicU64,
    dead_lettered: AtomicU64,
}

/// A node's counters at one moment: the ledger's and the consumer's.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct StatsSnapshot {
    /// Records the script applied.
    pub applied: u64,
    /// Records the script skipped as already applied.
    pub duplicates: u64,
    /// Records the script found out of order.
    pub gaps: u64,
    /// Script calls retried after a connection error.
    pub retries: u64,
    /// Records the dead-letter hook gave up on.
    pub dead_lettered: u64,
    /// Entries read as new.
    pub read: u64,
    /// Entries claimed from the pending list.
    pub claimed: u64,
    /// Entries acked.
    pub acked: u64,
    /// Records a force stop handed back or cancelled (left pending).
    pub handed_back: u64,
}

// ------------------------------------------------------------------- node --

/// Where a node's events go, with its name.
pub type EventSink = Arc<dyn Fn(&str, &Event) + Send + Sync>;

/// A node's settings. [`ConsumerConfig::new`] gives the defaults.
#[derive(Debug, Clone)]
pub struct ConsumerConfig {
    pub url: String,
    /// Its name in the group (unique per live consumer).
    pub name: String,
    pub partitions: usize,
    /// The executor's worker threads (they poll the handlers' futures).
    pub workers: usize,
    /// The consumer's tokio threads (sockets, read loops, heartbeat).
    pub io_threads: usize,
    /// How long a node and its leases live without a heartbeat.
    pub lease: Duration,
    /// How long a dead owner's pending entries must idle before a claim.
    pub claim_idle: Duration,
    /// How long a released partition may take to drain.
    pub drain_timeout: Duration,
}

impl ConsumerConfig {
    pub fn new(url: impl Into<String>, name: impl Into<String>, partitions: usize) -> Self {
        ConsumerConfig {
            url: url.into(),
            name: name.into(),
            partitions,
            workers: 2,
            io_threads: 1,
            lease: Duration::from_secs(3),
            claim_idle: Duration::from_secs(3),
            drain_timeout: Duration::from_secs(5),
        }
    }
}

/// One ledger node: a consumer of the crate with the ledger's handler.
/// Stop it with [`leave`](Self::leave) (graceful) or [`crash`](Self::crash).
pub struct Node {
    consumer: Consumer,
    store: Arc<Store>,
}

impl Node {
    /// Connects, joins the group and starts taking partitions.
    ///
    /// # Errors
    /// What the crate says: a bad setting, Redis unreachable, a ledger of
    /// another number of partitions.
    pub fn start(cfg: ConsumerConfig, events: EventSink) -> Result<Node, StartError> {
        let store = Arc::new(Store::new(Client::open(cfg.url.as_str())?));
        let (s, dl) = (store.clone(), store.clone());
        // A record the handler cannot apply is tried again after 5, 10 and
        // 20 ms (its key's later records wait behind it), then dead-lettered.
        let policy = RetryPolicy::builder()
            .max_attempts(ATTEMPTS)
            .backoff(Backoff::exponential(
                Duration::from_millis(5),
                Duration::from_millis(100),
            ))
            .build()
            .expect("a valid policy");
        let handler = handler::retrying_async(policy, move |_key: u64, record: Record| {
            let store = s.clone();
            async move {
                match unapplicable(&record) {
                    Some(error) => Err((record, error)),
                    None => Ok(store.apply(record).await),
                }
            }
        })
        .on_dead_letter(move |d| dl.dead_letter(d));
        let name = cfg.name.clone();
        let consumer = Consumer::builder(&cfg.url, streams(cfg.partitions))
            .group(GROUP)
            .name(&cfg.name)
            .namespace("ledger")
            .dead_letters(Some(DEAD_LETTERS.into()))
            .lease(cfg.lease)
            .heartbeat(Duration::from_millis(100))
            .claim_idle(cfg.claim_idle)
            .hand_off_deadline(cfg.drain_timeout)
            .block(Duration::from_millis(50))
            .workers(cfg.workers)
            .io_threads(cfg.io_threads)
            .decode(decode)
            .handler(handler)
            .verdict(verdict)
            .on_event(move |e| events(&name, e))
            .start()?;
        Ok(Node { consumer, store })
    }

    pub fn name(&self) -> &str {
        self.consumer.name()
    }

    /// The ledger's and the consumer's counters.
    pub fn stats(&self) -> StatsSnapshot {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let s = &self.store.stats;
        let c = self.consumer.stats();
        StatsSnapshot {
            applied: get(&s.applied),
            duplicates: get(&s.duplicates),
            gaps: get(&s.gaps),
            retries: get(&s.retries),
            dead_lettered: get(&s.dead_lettered),
            read: c.read,
            claimed: c.redelivered,
            acked: c.acked + c.dead_lettered,
            handed_back: c.handed_back,
        }
    }

    /// The partitions it owns now.
    pub fn owned(&self) -> BTreeSet<usize> {
        self.consumer.owned()
    }

    /// Fault injection for the crash test: its acks stop going out while
    /// it goes on applying records, as a process about to die.
    pub fn stall_acks(&self) {
        self.consumer.stall_acks();
    }

    /// Hands every partition off and leaves the group.
    pub fn leave(self, timeout: Duration) -> Result<(), LeaveError> {
        self.consumer.leave(timeout)
    }

    /// Dies as a killed process does (the consumer's drop): nothing
    /// released, its entries stay pending until a survivor claims them.
    pub fn crash(self) {
        drop(self.consumer);
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
            inv.arg(partition_of(key.to_string(), partitions))
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

fn number<T: std::str::FromStr>(v: &Value) -> Option<T> {
    match v {
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        Value::Int(i) => i.to_string().parse().ok(),
        _ => None,
    }
}

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
