//! A ledger consumer over a real broker, **Redis Streams**, on top of the
//! `keyed-executor-redis` crate: a consumer group, at-least-once delivery,
//! graceful partition hand-off and crash recovery, dead letters. One
//! process per node; the crate runs a node's records (one at a time per
//! key, in order, keys in parallel) and spreads the partitions across
//! nodes.
//!
//! ```text
//! cargo run --release --example redis_consumer                  # self-check (own redis-server)
//! cargo run --release --example redis_consumer -- produce --records 200000 --rate 20000
//! cargo run --release --example redis_consumer -- consume --name a --exit-when-idle 5
//! cargo run --release --example redis_consumer -- consume --name b --exit-when-idle 5
//! cargo run --release --example redis_consumer -- check
//! ```
//!
//! - Partition `p` is the stream `ledger:{p}`; a key's records are always
//!   in stream `partition_of(key)` (the crate's stable hash of the key's
//!   decimal digits). The crate owns the partitions (leases), reads them
//!   with `XREADGROUP`, submits each record to the node's executor, and
//!   `XACK`s it only after its completion says it was applied.
//! - The handler is async: a Lua script applies the record to the state
//!   in Redis idempotently by the key's sequence number — `seq == last +
//!   1` applies, `seq <= last` is a duplicate (skipped, counted), anything
//!   else an order violation (the partition halts) — so redeliveries after
//!   a crash are harmless.
//!
//! `ledger.rs` is the ledger (record, handler, producer, check),
//! `scenario.rs` the self-checking run, `server.rs` a throwaway
//! `redis-server`. `tests/broker_redis.rs` runs the same scenario and
//! checks it. Needs Redis ≥ 6.2 (`XAUTOCLAIM`, `XPENDING … IDLE`).

#[allow(dead_code)] // the test uses what the command line does not
mod ledger;
mod scenario;
#[allow(dead_code)] // pid() is for the crate's tests
mod server;

use std::collections::HashMap;
use std::error::Error;
use std::sync::Arc;
use std::time::{Duration, Instant};

use keyed_executor_redis::Event;
use ledger::{ConsumerConfig, Node};

const DEFAULT_URL: &str = "redis://127.0.0.1:6379/";

/// `--name value` flags after the subcommand.
struct Args(HashMap<String, String>);

impl Args {
    fn parse(args: &[String]) -> Result<Args, String> {
        let mut map = HashMap::new();
        let mut it = args.iter();
        while let Some(flag) = it.next() {
            let name = flag
                .strip_prefix("--")
                .ok_or_else(|| format!("unexpected argument {flag:?}"))?;
            let value = it.next().ok_or_else(|| format!("--{name} needs a value"))?;
            map.insert(name.to_string(), value.clone());
        }
        Ok(Args(map))
    }

    fn get<T: std::str::FromStr>(&self, name: &str, default: T) -> Result<T, String> {
        match self.0.get(name) {
            Some(v) => v
                .parse()
                .map_err(|_| format!("--{name}: cannot parse {v:?}")),
            None => Ok(default),
        }
    }

    fn url(&self) -> String {
        self.0
            .get("url")
            .cloned()
            .unwrap_or_else(|| DEFAULT_URL.into())
    }

    fn secs(&self, name: &str, default: f64) -> Result<Duration, String> {
        Ok(Duration::from_secs_f64(self.get(name, default)?))
    }
}

fn main() {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let (command, rest) = match argv.split_first() {
        Some((c, rest)) => (c.as_str(), rest),
        None => ("selfcheck", &argv[..]),
    };
    let result = Args::parse(rest)
        .map_err(Into::into)
        .and_then(|args| match command {
            "selfcheck" => selfcheck(&args),
            "produce" => produce(&args),
            "consume" => consume(&args),
            "check" => check(&args),
            other => Err(format!(
                "unknown command {other:?}: selfcheck | produce | consume | check"
            )
            .into()),
        });
    if let Err(e) = result {
        eprintln!("redis_consumer {command}: {e}");
        std::process::exit(1);
    }
}

fn runtime() -> Result<tokio::runtime::Runtime, Box<dyn Error>> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

fn connect(
    rt: &tokio::runtime::Runtime,
    url: &str,
) -> Result<redis::aio::MultiplexedConnection, Box<dyn Error>> {
    let client = redis::Client::open(url)?;
    Ok(rt.block_on(client.get_multiplexed_async_connection())?)
}

/// Without arguments: start a throwaway redis-server and run the
/// scenario (produce, two consumers, a hand-off, a crash) and check it.
/// Skips (exit 0) when redis-server is not installed.
fn selfcheck(args: &Args) -> Result<(), Box<dyn Error>> {
    let server = match server::RedisServer::start() {
        Ok(server) => server,
        Err(server::StartError::NotInstalled) => {
            println!(
                "redis_consumer: SKIPPED: redis-server is not on PATH (apt-get install redis-server); \
                 nothing checked"
            );
            return Ok(());
        }
        Err(e) => return Err(e.into()),
    };
    let mut s = scenario::Scenario::new(server.url());
    s.records = args.get("records", 40_000)?;
    s.keys = args.get("keys", 1_000)?;
    s.stall_before_crash = args.get("stall", 32)?;
    s.drain_timeout = args.secs("drain", 5.0)?;
    s.verbose = true;
    println!(
        "redis_consumer self-check: redis-server on port {}, {} records over {} keys, {} partitions, \
         two consumers (a, b), lease {:?}",
        server.port(),
        s.records,
        s.keys,
        s.partitions,
        s.lease
    );
    let report = scenario::run(&s)?;
    let v = &report.verification;
    let (takeovers, claimed) = report.takeovers_by_a();
    println!("summary");
    println!(
        "  hand-off     b took over {} partitions from a's graceful release ({} releases by a \
         in all, counting those when it left at the end)",
        report.hand_offs_to_b(),
        report.releases_by_a()
    );
    let (handed_back, forced) = report.handed_back_by_a();
    if forced > 0 {
        println!(
            "               {forced} of them force-stopped at the drain deadline, handing back \
             {handed_back} records (left pending, claimed by b)"
        );
    }
    println!(
        "  crash        b died with {} finished records not acked, and its writes in flight; a took \
         {} partitions over and claimed {} pending entries: {} duplicates skipped",
        report.finished_unacked_by_b,
        takeovers,
        claimed,
        report.crash_duplicates()
    );
    println!(
        "  ledger       {} keys, {} records produced, {} applied once each in order, {} duplicates \
         skipped, {} gaps, {} pending",
        v.keys, v.produced, v.applied, v.duplicates, v.gaps, v.pending
    );
    println!(
        "  dead letters {} records the handler could not apply: each tried {} times with backoff \
         while its key waited, then written to {} ({} entries) and acked; their partitions moved on",
        v.dead,
        ledger::ATTEMPTS,
        ledger::DEAD_LETTERS,
        v.dead_stream
    );
    for (name, st) in [("a", report.stats_a), ("b", report.stats_b)] {
        println!(
            "  consumer {name}   applied {}, duplicates {}, read {}, claimed {}, acked {}, handed back {}{}",
            st.applied,
            st.duplicates,
            st.read,
            st.claimed,
            st.acked,
            st.handed_back,
            if name == "b" { " (at its crash)" } else { "" }
        );
    }
    println!("  elapsed      {:.2?}", report.elapsed);
    let problems = v.problems();
    if !problems.is_empty() {
        return Err(format!("verification failed: {}", problems.join("; ")).into());
    }
    let dups_expected = s.stall_before_crash > 0;
    if report.hand_offs_to_b() == 0
        || takeovers == 0
        || (dups_expected && report.crash_duplicates() == 0)
    {
        return Err(
            "the run did not exercise a hand-off, a crash takeover and its duplicates".into(),
        );
    }
    println!("verified: every record applied exactly once, in per-key order, across a hand-off and a crash, and every malformed one dead-lettered once; nothing pending");
    Ok(())
}

/// Appends records; run it again to append more (each key's sequence
/// numbers go on).
fn produce(args: &Args) -> Result<(), Box<dyn Error>> {
    let records: u64 = args.get("records", 100_000)?;
    let keys: u64 = args.get("keys", 1_000)?;
    let partitions: usize = args.get("partitions", 4)?;
    let rate: u64 = args.get("rate", 0)?;
    let rt = runtime()?;
    let mut conn = connect(&rt, &args.url())?;
    println!(
        "producing {records} records over {keys} keys into {partitions} partitions{}",
        if rate > 0 {
            format!(" at {rate}/s")
        } else {
            String::new()
        }
    );
    let began = Instant::now();
    let mut last_print = Instant::now();
    rt.block_on(ledger::produce(
        &mut conn,
        partitions,
        keys,
        records,
        200,
        (rate > 0).then_some(rate),
        |n| {
            if last_print.elapsed() >= Duration::from_secs(1) {
                last_print = Instant::now();
                println!("  {n} produced");
            }
        },
    ))?;
    let took = began.elapsed();
    println!(
        "produced {records} in {took:.2?} ({:.0} records/s)",
        records as f64 / took.as_secs_f64()
    );
    Ok(())
}

/// Joins the group and consumes until killed (a crash: the others take
/// its partitions over once its lease expires) or, with
/// `--exit-when-idle S`, until nothing new arrived for S seconds (then it
/// leaves gracefully: its partitions are handed off).
fn consume(args: &Args) -> Result<(), Box<dyn Error>> {
    let name: String = args.get("name", String::new())?;
    if name.is_empty() {
        return Err("consume needs --name NAME (unique per consumer)".into());
    }
    let mut cfg = ConsumerConfig::new(args.url(), name.clone(), args.get("partitions", 4)?);
    cfg.lease = args.secs("lease", 3.0)?;
    cfg.claim_idle = cfg.lease;
    cfg.workers = args.get("workers", 2)?;
    let idle_exit: f64 = args.get("exit-when-idle", 0.0)?;
    let began = Instant::now();
    let sink: ledger::EventSink = Arc::new(move |node: &str, e: &Event| {
        println!("{:>7.2}s [{node}] {e}", began.elapsed().as_secs_f64());
    });
    let consumer = Node::start(cfg, sink)?;
    let mut last = consumer.stats();
    let mut last_change = Instant::now();
    loop {
        std::thread::sleep(Duration::from_secs(1));
        let now = consumer.stats();
        let done = now.applied + now.duplicates;
        if done != last.applied + last.duplicates {
            println!(
                "{:>7.2}s [{name}] owns {:?}: applied {} (+{}/s), duplicates {}, acked {}, claimed {}",
                began.elapsed().as_secs_f64(),
                consumer.owned(),
                now.applied,
                now.applied - last.applied,
                now.duplicates,
                now.acked,
                now.claimed
            );
            last_change = Instant::now();
        }
        last = now;
        if idle_exit > 0.0
            && last_change.elapsed().as_secs_f64() >= idle_exit
            && now.acked >= now.applied + now.duplicates
        {
            break;
        }
    }
    println!(
        "{:>7.2}s [{name}] idle for {idle_exit} s: leaving",
        began.elapsed().as_secs_f64()
    );
    let stats = consumer.stats();
    consumer.leave(Duration::from_secs(30))?;
    println!(
        "[{name}] done: applied {}, duplicates skipped {}, acked {}, claimed {}",
        stats.applied, stats.duplicates, stats.acked, stats.claimed
    );
    Ok(())
}

/// Verifies the ledger: every produced record applied once, in order,
/// balances right, nothing pending. Exit code 1 if not.
fn check(args: &Args) -> Result<(), Box<dyn Error>> {
    let rt = runtime()?;
    let mut conn = connect(&rt, &args.url())?;
    let v = rt.block_on(ledger::verify(&mut conn, args.get("partitions", 4)?))?;
    println!(
        "{} keys, {} records produced, {} applied, {} dead-lettered ({} in {}), {} duplicates \
         skipped, {} gaps, {} pending",
        v.keys,
        v.produced,
        v.applied,
        v.dead,
        v.dead_stream,
        ledger::DEAD_LETTERS,
        v.duplicates,
        v.gaps,
        v.pending
    );
    let problems = v.problems();
    if problems.is_empty() {
        println!(
            "ok: every record applied exactly once, in per-key order, or dead-lettered once; \
             nothing pending"
        );
        Ok(())
    } else {
        Err(problems.join("; ").into())
    }
}
