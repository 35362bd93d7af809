//! Records per second with 1, 2 and 3 consumer processes, beside the limit:
//! a plain `XREADGROUP`/`XACK` loop with no handler work.
//!
//! ```text
//! cargo run --release -p keyed-executor-redis --example throughput
//! cargo run --release -p keyed-executor-redis --example throughput -- --records 200000 --processes 1,2,3 --runs 3
//! ```
//!
//! It starts its own `redis-server` (or uses `--url`), and for each number
//! of processes and each design, `--runs` times: empties Redis, writes
//! `--records` records over 1,000 keys into 8 partitions, starts that many
//! processes of itself, and times from the first partition read to the
//! moment every entry is delivered and acked (the group's lag and pending
//! count both 0). The designs, each process with one tokio thread:
//!
//! - `plain`: process `i` of `n` reads partitions `p % n == i`, one task a
//!   partition: `XREADGROUP … COUNT 128 BLOCK 100 >` pipelined behind the
//!   `XACK` of the entries read in the round before. No decoding, no
//!   handler: what Redis and the client allow.
//! - `crate`: a `keyed-executor-redis` node (one executor worker, one I/O
//!   thread, the crate's defaults otherwise) whose decode function parses
//!   two numbers and whose handler does nothing; partitions are assigned
//!   by the crate (nodes join within its `join_delay`).
//!
//! Prints a markdown table (medians, min–max) on stdout.

#[allow(dead_code)]
#[path = "../../examples/redis_consumer/server.rs"]
mod server;

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use keyed_executor::handler;
use keyed_executor_redis::{Consumer, DecodeError, Entry, Event, Streams};
use redis::Value;

const PARTITIONS: usize = 8;
const GROUP: &str = "bench";

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock")
        .as_micros() as u64
}

fn flag(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1))
        .cloned()
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("child") {
        child(&args[1..]);
        return;
    }
    let records: u64 = flag(&args, "--records").map_or(200_000, |v| v.parse().expect("--records"));
    let runs: usize = flag(&args, "--runs").map_or(3, |v| v.parse().expect("--runs"));
    let processes: Vec<usize> = flag(&args, "--processes")
        .unwrap_or_else(|| "1,2,3".into())
        .split(',')
        .map(|n| n.parse().expect("--processes 1,2,3"))
        .collect();
    let own = match flag(&args, "--url") {
        Some(_) => None,
        None => match server::RedisServer::start() {
            Ok(s) => Some(s),
            Err(e) => {
                eprintln!("throughput: {e} (apt-get install redis-server, or pass --url)");
                std::process::exit(1);
            }
        },
    };
    let url = flag(&args, "--url").unwrap_or_else(|| own.as_ref().expect("started").url());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let client = redis::Client::open(url.as_str()).expect("url");
    let mut conn = rt
        .block_on(client.get_multiplexed_async_connection())
        .expect("connect");
    let version: String = rt
        .block_on(redis::cmd("INFO").arg("server").query_async(&mut conn))
        .expect("INFO");
    let version = version
        .lines()
        .find_map(|l| l.strip_prefix("redis_version:"))
        .unwrap_or("?")
        .trim()
        .to_string();
    eprintln!(
        "throughput: {records} records over 1,000 keys, {PARTITIONS} partitions, redis {version}, \
         {runs} runs each; load average {}",
        loadavg()
    );
    println!("| processes | plain `XREADGROUP`/`XACK` loop: records/s (per process) | keyed-executor-redis, no-op handler: records/s (per process) | crate / plain |");
    println!("|---:|---:|---:|---:|");
    for &n in &processes {
        let mut rates = [Vec::new(), Vec::new()];
        for run in 0..runs {
            for (d, design) in ["plain", "crate"].iter().enumerate() {
                let rate = one_run(&rt, &mut conn, &url, design, n, records);
                eprintln!(
                    "  {n} process(es), {design}, run {}: {rate:.0} records/s",
                    run + 1
                );
                rates[d].push(rate);
            }
        }
        let [plain, krate] = rates.map(|mut v| {
            v.sort_by(f64::total_cmp);
            v
        });
        let med = |v: &[f64]| v[v.len() / 2];
        let cell = |v: &[f64]| {
            format!(
                "{:.0} ({:.0}–{:.0}) ({:.0})",
                med(v),
                v[0],
                v[v.len() - 1],
                med(v) / n as f64
            )
        };
        println!(
            "| {n} | {} | {} | {:.2} |",
            cell(&plain),
            cell(&krate),
            med(&krate) / med(&plain)
        );
    }
    eprintln!("throughput: done; load average {}", loadavg());
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

/// Empties Redis, produces, runs `n` processes of `design`, returns
/// records per second (all processes together).
fn one_run(
    rt: &tokio::runtime::Runtime,
    conn: &mut redis::aio::MultiplexedConnection,
    url: &str,
    design: &str,
    n: usize,
    records: u64,
) -> f64 {
    let streams = Streams::numbered("bench:", PARTITIONS);
    rt.block_on(async {
        redis::cmd("FLUSHALL").query_async::<()>(conn).await?;
        for s in streams.iter() {
            redis::cmd("XGROUP")
                .arg("CREATE")
                .arg(s)
                .arg(GROUP)
                .arg("0")
                .arg("MKSTREAM")
                .query_async::<()>(conn)
                .await?;
        }
        let mut i = 0;
        while i < records {
            let mut pipe = redis::pipe();
            for j in i..(i + 1000).min(records) {
                let key = j % 1000;
                pipe.cmd("XADD")
                    .arg(streams.stream_of(key.to_string()))
                    .arg("*")
                    .arg("key")
                    .arg(key)
                    .arg("seq")
                    .arg(j)
                    .ignore();
            }
            pipe.query_async::<()>(conn).await?;
            i += 1000;
        }
        Ok::<(), redis::RedisError>(())
    })
    .expect("produce");

    let me = std::env::current_exe().expect("own path");
    let mut children: Vec<_> = (0..n)
        .map(|i| {
            Command::new(&me)
                .args(["child", "--url", url, "--design", design])
                .args(["--index", &i.to_string(), "--of", &n.to_string()])
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .spawn()
                .expect("spawn")
        })
        .collect();
    // Each child prints `STARTED <µs>` when it reads its first partition.
    let (tx, rx) = std::sync::mpsc::channel();
    for c in &mut children {
        let out = c.stdout.take().expect("piped");
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Some(t) = line.strip_prefix("STARTED ") {
                    let _ = tx.send(t.parse::<u64>().unwrap_or(0));
                }
            }
        });
    }
    let first_start = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("a child started");
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        if done(rt, conn, &streams) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{design} with {n} processes did not finish"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    let took = Duration::from_micros(now_us().saturating_sub(first_start));
    for c in &mut children {
        let _ = writeln!(c.stdin.as_mut().expect("piped"), "stop");
    }
    for mut c in children {
        drop(c.stdin.take());
        let _ = c.wait();
    }
    records as f64 / took.as_secs_f64()
}

/// Every entry delivered to the group and acked.
fn done(
    rt: &tokio::runtime::Runtime,
    conn: &mut redis::aio::MultiplexedConnection,
    streams: &Streams,
) -> bool {
    let mut pipe = redis::pipe();
    for s in streams.iter() {
        pipe.cmd("XINFO").arg("GROUPS").arg(s);
    }
    let replies: Vec<Value> = rt.block_on(pipe.query_async(conn)).expect("XINFO");
    replies.iter().all(|r| {
        let Value::Array(groups) = r else {
            return false;
        };
        groups.iter().all(|g| {
            let fields: Vec<(String, Value)> = match g {
                Value::Array(flat) => flat
                    .chunks(2)
                    .filter_map(|c| match c {
                        [Value::BulkString(k), v] => {
                            Some((String::from_utf8_lossy(k).into_owned(), v.clone()))
                        }
                        _ => None,
                    })
                    .collect(),
                Value::Map(m) => m
                    .iter()
                    .filter_map(|(k, v)| match k {
                        Value::BulkString(k) => {
                            Some((String::from_utf8_lossy(k).into_owned(), v.clone()))
                        }
                        _ => None,
                    })
                    .collect(),
                _ => return false,
            };
            let get = |name: &str| {
                fields
                    .iter()
                    .find(|(k, _)| k == name)
                    .map(|(_, v)| matches!(v, Value::Int(0)))
            };
            get("pending") == Some(true) && get("lag") == Some(true)
        })
    })
}

// ---------------------------------------------------------------- a child --

fn child(args: &[String]) {
    let url = flag(args, "--url").expect("--url");
    let design = flag(args, "--design").expect("--design");
    let index: usize = flag(args, "--index")
        .expect("--index")
        .parse()
        .expect("index");
    let of: usize = flag(args, "--of").expect("--of").parse().expect("of");
    let streams = Streams::numbered("bench:", PARTITIONS);
    let started = std::sync::Once::new();
    let announce = move || {
        started.call_once(|| {
            println!("STARTED {}", now_us());
            let _ = std::io::stdout().flush();
        })
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let node = if design == "plain" {
        let announce = std::sync::Arc::new(announce);
        for p in (0..PARTITIONS).filter(|p| p % of == index) {
            let (url, stream) = (url.clone(), streams.stream(p).to_string());
            let announce = announce.clone();
            rt.spawn(async move {
                let client = redis::Client::open(url.as_str()).expect("url");
                let mut conn = client
                    .get_multiplexed_async_connection()
                    .await
                    .expect("connect");
                announce();
                plain_loop(&mut conn, &stream).await;
            });
        }
        None
    } else {
        let announce = std::sync::Arc::new(announce);
        let name = format!("c{index}");
        Some(
            Consumer::builder(&url, streams)
                .group(GROUP)
                .name(&name)
                .workers(1)
                .join_delay(Duration::from_millis(1000))
                .decode(|e: &Entry| -> Result<(u64, u64), DecodeError> {
                    Ok((e.parse("key")?, e.parse("seq")?))
                })
                .handler(handler::from_fn(|_: &u64, _: u64| ()))
                .on_event(move |e| {
                    if matches!(e, Event::Started { .. }) {
                        announce();
                    }
                })
                .start()
                .expect("start"),
        )
    };
    // Until the parent says stop (or goes away).
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    if let Some(node) = node {
        let _ = node.leave(Duration::from_secs(10));
    }
    rt.shutdown_background();
}

/// Reads and acks one partition as fast as Redis allows: each read goes
/// out pipelined behind the ack of the entries of the read before.
async fn plain_loop(conn: &mut redis::aio::MultiplexedConnection, stream: &str) {
    let mut acks: Vec<String> = Vec::new();
    loop {
        let mut pipe = redis::pipe();
        if !acks.is_empty() {
            pipe.cmd("XACK").arg(stream).arg(GROUP).arg(&acks).ignore();
        }
        pipe.cmd("XREADGROUP")
            .arg("GROUP")
            .arg(GROUP)
            .arg("plain")
            .arg("COUNT")
            .arg(128)
            .arg("BLOCK")
            .arg(100)
            .arg("STREAMS")
            .arg(stream)
            .arg(">");
        let reply: Vec<Value> = match pipe.query_async(conn).await {
            Ok(v) => v,
            Err(_) => return,
        };
        acks.clear();
        // [[stream, [[id, fields], …]]] (or a map in RESP3), nil on timeout.
        let entries = match reply.first() {
            Some(Value::Array(streams)) => match streams.first() {
                Some(Value::Array(pair)) => pair.get(1).cloned(),
                _ => None,
            },
            Some(Value::Map(m)) => m.first().map(|(_, v)| v.clone()),
            _ => None,
        };
        if let Some(Value::Array(entries)) = entries {
            for e in entries {
                if let Value::Array(parts) = e {
                    if let Some(Value::BulkString(id)) = parts.first() {
                        acks.push(String::from_utf8_lossy(id).into_owned());
                    }
                }
            }
        }
    }
}
