//! What the tests against a real `redis-server` share: the server, a
//! record format, an idempotent handler, a producer and the final check.
//!
//! Records are numbered per key (`seq` 0, 1, 2, … atomically with the
//! `XADD`, so a key's sequence order is its stream order). The handler
//! applies a record with a Lua script only if `seq == last + 1`; `seq <=
//! last` is a redelivery (skipped, counted) and anything else a gap (an
//! order violation: counted, and the partition halts). So "every key at its
//! last seq, no gap" means every record was applied once and in order.
//!
//! Two kinds of poison: a record with amount 0 (the handler refuses it; a
//! retrying handler gives up after its attempts and its dead-letter hook
//! advances the key past it), and an entry that does not decode (no
//! numbers; it takes no seq). Both must end in the dead-letter stream, each
//! exactly once.

#![allow(dead_code)]

#[path = "../../../examples/redis_consumer/server.rs"]
pub mod server;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyed_executor::handler::{self, Handler};
use keyed_executor::{Backoff, RetryPolicy};
use keyed_executor_redis::{partition_of, DecodeError, Entry, Streams, Verdict};
use redis::aio::MultiplexedConnection;
use redis::{Script, Value};

pub const GROUP: &str = "t";
pub const DEAD: &str = "t:dead";
const LAST: &str = "t:last";
const BALANCE: &str = "t:balance";
const STATS: &str = "t:stats";
const PRODUCED: &str = "t:produced";
const EXPECTED: &str = "t:expected";
const POISON: &str = "t:poison";

pub fn streams(partitions: usize) -> Streams {
    Streams::numbered("t:", partitions)
}

/// A server, or `None` (and a printed reason) when `redis-server` is not
/// installed; with `KEYED_REQUIRE_REDIS=1` a missing server is a failure.
pub fn redis_or_skip(test: &str) -> Option<server::RedisServer> {
    let required = std::env::var("KEYED_REQUIRE_REDIS").is_ok_and(|v| v == "1");
    match server::RedisServer::start() {
        Ok(server) => Some(server),
        Err(e @ server::StartError::NotInstalled) if !required => {
            println!(
                "SKIPPED {test}: {e} (install redis-server, or set KEYED_REQUIRE_REDIS=1 to make \
                 this a failure)"
            );
            None
        }
        Err(e @ server::StartError::NotInstalled) => {
            panic!("KEYED_REQUIRE_REDIS=1, but {e} (apt-get install redis-server)")
        }
        Err(e) => panic!("{e}"),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rec {
    pub key: u64,
    pub seq: u64,
    pub amount: i64,
}

pub fn decode(e: &Entry) -> Result<(u64, Rec), DecodeError> {
    let rec = Rec {
        key: e.parse("key")?,
        seq: e.parse("seq")?,
        amount: e.parse("amount")?,
    };
    Ok((rec.key, rec))
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Applied,
    Duplicate,
    Gap { last: i64 },
}

/// A gap halts the partition: the record stays pending for a person.
pub fn verdict(a: &Outcome) -> Verdict {
    match a {
        Outcome::Gap { last } => Verdict::Halt(format!("order violation: last applied {last}")),
        _ => Verdict::Ack,
    }
}

/// KEYS: last, balance, stats. ARGV: key, seq, amount.
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

/// The dead-letter hook's half: advances the key past a refused record,
/// idempotently. KEYS: last, stats. ARGV: key, seq.
const SKIP: &str = r#"
local last = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '-1')
local seq = tonumber(ARGV[2])
if seq == last + 1 then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
  redis.call('HINCRBY', KEYS[2], 'refused', 1)
  return 1
elseif seq <= last then
  redis.call('HINCRBY', KEYS[2], 'duplicates', 1)
  return 0
end
redis.call('HINCRBY', KEYS[2], 'gaps', 1)
return -1
"#;

/// The handler's connections to the state it writes, opened again after
/// they broke (a handler must outlive Redis going away as the consumer
/// does).
pub struct Store {
    client: redis::Client,
    conn: Mutex<Option<MultiplexedConnection>>,
    sync: Mutex<Option<redis::Connection>>,
    apply: Script,
    skip: Script,
}

impl Store {
    /// Connects on `rt` (which drives the first connection).
    pub fn connect(rt: &tokio::runtime::Runtime, url: &str) -> Arc<Store> {
        let client = redis::Client::open(url).expect("url");
        let conn = rt
            .block_on(client.get_multiplexed_async_connection_with_config(&Self::config()))
            .expect("store connection");
        Arc::new(Store {
            conn: Mutex::new(Some(conn)),
            sync: Mutex::new(None),
            client,
            apply: Script::new(APPLY),
            skip: Script::new(SKIP),
        })
    }

    fn config() -> redis::AsyncConnectionConfig {
        redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(2)))
            .set_response_timeout(Some(Duration::from_secs(2)))
    }

    async fn conn(&self) -> redis::RedisResult<MultiplexedConnection> {
        if let Some(c) = self.conn.lock().unwrap().clone() {
            return Ok(c);
        }
        let c = self
            .client
            .get_multiplexed_async_connection_with_config(&Self::config())
            .await?;
        *self.conn.lock().unwrap() = Some(c.clone());
        Ok(c)
    }

    async fn apply(&self, r: Rec) -> Outcome {
        let mut delay = Duration::from_millis(5);
        loop {
            let mut inv = self.apply.prepare_invoke();
            inv.key(LAST)
                .key(BALANCE)
                .key(STATS)
                .arg(r.key)
                .arg(r.seq)
                .arg(r.amount);
            let done = match self.conn().await {
                Ok(mut conn) => inv.invoke_async::<(i64, i64)>(&mut conn).await,
                Err(e) => Err(e),
            };
            match done {
                Ok((1, _)) => return Outcome::Applied,
                Ok((0, _)) => return Outcome::Duplicate,
                Ok((_, last)) => return Outcome::Gap { last },
                // Redis away: the record waits (and so does its key).
                Err(_) => {
                    *self.conn.lock().unwrap() = None;
                    tokio::time::sleep(delay).await;
                    delay = (delay * 2).min(Duration::from_millis(500));
                }
            }
        }
    }

    fn skip(&self, r: &Rec) {
        let mut delay = Duration::from_millis(5);
        loop {
            let mut slot = self.sync.lock().unwrap();
            if slot.is_none() {
                *slot = self
                    .client
                    .get_connection_with_timeout(Duration::from_secs(2))
                    .ok();
            }
            let done = match slot.as_mut() {
                Some(conn) => self
                    .skip
                    .key(LAST)
                    .key(STATS)
                    .arg(r.key)
                    .arg(r.seq)
                    .invoke::<i64>(conn)
                    .is_ok(),
                None => false,
            };
            if done {
                return;
            }
            *slot = None;
            drop(slot);
            std::thread::sleep(delay);
            delay = (delay * 2).min(Duration::from_millis(500));
        }
    }
}

/// A retrying async handler: a zero amount is refused, tried twice more,
/// then dead-lettered (the hook advances its key past it).
pub fn handler(store: Arc<Store>) -> impl Handler<u64, Rec, Output = Outcome> {
    let policy = RetryPolicy::builder()
        .max_attempts(3)
        .backoff(Backoff::exponential(
            Duration::from_millis(1),
            Duration::from_millis(10),
        ))
        .build()
        .expect("policy");
    let hook = store.clone();
    handler::retrying_async(policy, move |_key: u64, rec: Rec| {
        let store = store.clone();
        async move {
            if rec.amount == 0 {
                Err((rec, format!("key {} seq {}: zero amount", rec.key, rec.seq)))
            } else {
                Ok(store.apply(rec).await)
            }
        }
    })
    .on_dead_letter(move |d| hook.skip(&d.message))
}

/// Appends records, numbering each key's records 0, 1, 2, …; counts what
/// it wrote. KEYS: produced, expected, poison, then every partition's
/// stream. ARGV: (partition, key, amount) triples; key `bad` writes an
/// entry that does not decode (amount is its poison number) and takes no
/// seq.
const PRODUCE: &str = r#"
for i = 1, #ARGV, 3 do
  local p, key, amount = tonumber(ARGV[i]), ARGV[i + 1], ARGV[i + 2]
  if key == 'bad' then
    redis.call('XADD', KEYS[4 + p], '*', 'key', 'not-a-number', 'poison', amount)
    redis.call('SADD', KEYS[3], 'bad:' .. amount)
  else
    local seq = redis.call('HINCRBY', KEYS[1], key, 1) - 1
    redis.call('HINCRBY', KEYS[2], key, amount)
    if tonumber(amount) == 0 then
      redis.call('SADD', KEYS[3], key .. ':' .. seq)
    end
    redis.call('XADD', KEYS[4 + p], '*', 'key', key, 'seq', seq, 'amount', amount)
  end
end
return #ARGV / 3
"#;

/// The amount of the `i`-th record: mostly deposits, some withdrawals,
/// every thousandth a zero (refused by the handler).
pub fn amount_of(i: u64) -> i64 {
    if i % 1000 == 999 {
        0
    } else if i % 5 == 4 {
        -25
    } else {
        10
    }
}

/// Appends records `first..first + records` over `keys` keys (`key = i %
/// keys`), 200 per call, plus one undecodable entry after every 1,000th
/// record, at most `rate` records a second if given. Calls `progress`
/// after each call.
#[allow(clippy::too_many_arguments)]
pub async fn produce(
    conn: &mut MultiplexedConnection,
    streams: &Streams,
    keys: u64,
    first: u64,
    records: u64,
    rate: Option<u64>,
    mut progress: impl FnMut(u64),
) -> redis::RedisResult<()> {
    let script = Script::new(PRODUCE);
    let began = std::time::Instant::now();
    let mut done = 0;
    while done < records {
        let n = 200.min(records - done);
        let mut inv = script.prepare_invoke();
        inv.key(PRODUCED).key(EXPECTED).key(POISON);
        for s in streams.iter() {
            inv.key(s);
        }
        for i in first + done..first + done + n {
            let key = i % keys;
            inv.arg(partition_of(key.to_string(), streams.len()))
                .arg(key)
                .arg(amount_of(i));
            if i % 1000 == 500 {
                inv.arg(partition_of(i.to_string(), streams.len()))
                    .arg("bad")
                    .arg(i);
            }
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

/// Records applied or refused so far (by the scripts' counts), and
/// duplicates skipped.
pub async fn settled(conn: &mut MultiplexedConnection) -> redis::RedisResult<(u64, u64)> {
    let (a, r, d): (Option<u64>, Option<u64>, Option<u64>) = redis::cmd("HMGET")
        .arg(STATS)
        .arg("applied")
        .arg("refused")
        .arg("duplicates")
        .query_async(conn)
        .await?;
    Ok((a.unwrap_or(0) + r.unwrap_or(0), d.unwrap_or(0)))
}

/// Entries delivered and not acked, over all partitions, and per consumer.
pub async fn pending(
    conn: &mut MultiplexedConnection,
    streams: &Streams,
) -> redis::RedisResult<(u64, BTreeMap<String, u64>)> {
    let mut total = 0;
    let mut by = BTreeMap::new();
    for s in streams.iter() {
        let summary: Value = redis::cmd("XPENDING")
            .arg(s)
            .arg(GROUP)
            .query_async(conn)
            .await?;
        if let Value::Array(v) = summary {
            total += v.first().and_then(num).unwrap_or(0);
            if let Some(Value::Array(consumers)) = v.get(3) {
                for c in consumers {
                    if let Value::Array(pair) = c {
                        if let (Some(name), Some(n)) =
                            (pair.first().and_then(text), pair.get(1).and_then(num))
                        {
                            *by.entry(name).or_default() += n;
                        }
                    }
                }
            }
        }
    }
    Ok((total, by))
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

fn num(v: &Value) -> Option<u64> {
    match v {
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        Value::Int(i) => u64::try_from(*i).ok(),
        _ => None,
    }
}

/// What Redis holds after a run.
#[derive(Debug, Default)]
pub struct Verification {
    pub keys: usize,
    pub produced: u64,
    pub applied: u64,
    pub refused: u64,
    pub duplicates: u64,
    pub gaps: u64,
    pub pending: u64,
    /// The poison the producer wrote (`key:seq` refused, `bad:n` undecodable).
    pub poison: BTreeSet<String>,
    /// The dead-letter stream's entries, as the same names.
    pub dead_letters: Vec<String>,
    /// (key, produced, applied up to) for keys not at their last seq.
    pub incomplete: Vec<(u64, u64, u64)>,
    /// (key, expected, actual).
    pub wrong_balance: Vec<(u64, i64, i64)>,
}

impl Verification {
    /// Every record applied once, in order; nothing pending; the dead
    /// letters exactly the poison, each once.
    pub fn problems(&self) -> Vec<String> {
        let mut out = Vec::new();
        if self.applied + self.refused != self.produced {
            out.push(format!(
                "{} applied + {} refused of {} produced",
                self.applied, self.refused, self.produced
            ));
        }
        if self.gaps != 0 {
            out.push(format!("{} order violations (gaps)", self.gaps));
        }
        if self.pending != 0 {
            out.push(format!("{} entries still pending", self.pending));
        }
        let dead: BTreeSet<String> = self.dead_letters.iter().cloned().collect();
        if dead.len() != self.dead_letters.len() {
            out.push(format!(
                "{} dead letters, {} distinct: some written twice",
                self.dead_letters.len(),
                dead.len()
            ));
        }
        if dead != self.poison {
            let missing: Vec<_> = self.poison.difference(&dead).take(5).collect();
            let extra: Vec<_> = dead.difference(&self.poison).take(5).collect();
            out.push(format!(
                "dead letters are not the poison: missing {missing:?}, not poison {extra:?}"
            ));
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
                "{} keys with a wrong balance, e.g. {:?}",
                self.wrong_balance.len(),
                &self.wrong_balance[..self.wrong_balance.len().min(5)]
            ));
        }
        out
    }
}

pub async fn verify(
    conn: &mut MultiplexedConnection,
    streams: &Streams,
) -> redis::RedisResult<Verification> {
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
    let stats: BTreeMap<String, u64> = redis::cmd("HGETALL").arg(STATS).query_async(conn).await?;
    let poison: BTreeSet<String> = redis::cmd("SMEMBERS").arg(POISON).query_async(conn).await?;
    let dead: Value = redis::cmd("XRANGE")
        .arg(DEAD)
        .arg("-")
        .arg("+")
        .query_async(conn)
        .await?;
    let mut dead_letters = Vec::new();
    if let Value::Array(items) = dead {
        for item in items {
            let Value::Array(parts) = item else { continue };
            let Some(Value::Array(fields)) = parts.get(1) else {
                continue;
            };
            let mut map = BTreeMap::new();
            for pair in fields.chunks(2) {
                if let [n, v] = pair {
                    map.insert(text(n).unwrap_or_default(), text(v).unwrap_or_default());
                }
            }
            dead_letters.push(match map.get("poison") {
                Some(n) => format!("bad:{n}"),
                None => format!(
                    "{}:{}",
                    map.get("key").cloned().unwrap_or_default(),
                    map.get("seq").cloned().unwrap_or_default()
                ),
            });
        }
    }
    let get = |k: &str| stats.get(k).copied().unwrap_or(0);
    let mut v = Verification {
        keys: produced.len(),
        produced: produced.values().sum(),
        applied: get("applied"),
        refused: get("refused"),
        duplicates: get("duplicates"),
        gaps: get("gaps"),
        pending: pending(conn, streams).await?.0,
        poison,
        dead_letters,
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

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime")
}
