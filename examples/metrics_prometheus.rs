//! The crate's metrics served to Prometheus: `metrics-exporter-prometheus`
//! installed as the global recorder with its HTTP listener on a loopback
//! port, a known workload (a sync "ledger" dispatcher with a few panics, an
//! async "journal" dispatcher, a `Lanes` "accounts"), then one scrape of
//! `/metrics` over HTTP, checked against the workload.
//!
//! ```text
//! cargo run --release --features metrics --example metrics_prometheus
//! ```
//!
//! Install the recorder before building the executor, its dispatchers and
//! receivers and the `Lanes`: their handles are registered when they are
//! built. The `_seconds` series are histograms only because the exporter is
//! given buckets for them (otherwise it renders summaries).

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use keyed_executor::lanes::{BatchResult, Kernel, Lanes};
use keyed_executor::{handler, KeyedExecutor};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};

/// Messages the workload sends to the ledger (every 100th panics), the
/// journal, and commands to the Lanes.
pub const LEDGER: u64 = 20_000;
pub const JOURNAL: u64 = 2_000;
pub const COMMANDS: u64 = 1_000;

type Error = Box<dyn std::error::Error + Send + Sync>;

/// A free loopback port (the listener binds it again right after).
pub fn free_port() -> std::io::Result<SocketAddr> {
    TcpListener::bind("127.0.0.1:0")?.local_addr()
}

/// Installs the exporter as the global recorder, serving `/metrics` on
/// `addr`.
pub fn install(addr: SocketAddr) -> Result<(), Error> {
    PrometheusBuilder::new()
        .with_http_listener(addr)
        .set_buckets_for_metric(
            Matcher::Suffix("_seconds".to_owned()),
            &[1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.1, 1.0],
        )?
        .set_buckets_for_metric(
            Matcher::Full("keyed_executor_lane_batch_size".to_owned()),
            &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
        )?
        .install()?;
    Ok(())
}

struct Accounts;

impl Kernel for Accounts {
    type Key = u64;
    type Command = u64;
    type Output = u64;
    type Error = String;

    async fn execute_batch(
        &self,
        _account: &u64,
        deposits: Vec<u64>,
    ) -> BatchResult<u64, u64, String> {
        BatchResult::committed(deposits.into_iter().map(Ok).collect())
    }
}

/// Runs the workload to its end (every message and command finished).
pub fn workload() -> Result<(), Error> {
    let executor = KeyedExecutor::builder()
        .workers(2)
        .thread_name("metrics-demo")
        .slow_step(Duration::from_secs(1))
        .build()?;
    let ledger = executor
        .dispatcher_builder(handler::from_fn(|_account: &u64, amount: u64| {
            assert!(amount % 100 != 99, "a bad amount");
            amount
        }))
        .name("ledger")
        .on_panic(|_, _| {})
        .build();
    let journal = executor
        .dispatcher_builder(handler::from_async_fn(|_key: u64, n: u64| async move {
            // A write that completes on another thread.
            let (tx, rx) = futures::channel::oneshot::channel();
            std::thread::spawn(move || tx.send(n));
            rx.await.unwrap_or(0)
        }))
        .name("journal")
        .build();
    let partition = ledger.named_receiver("partition-0", 256)?;
    let events = journal.receiver(64)?;
    for n in 0..LEDGER {
        partition.send(n % 1_000, n)?;
    }
    let writes: Vec<_> = (0..JOURNAL)
        .map(|n| events.submit_blocking(n % 50, n))
        .collect::<Result<_, _>>()?;
    for w in writes {
        w.wait()?;
    }
    // Wait until the ledger's messages finished too (fire-and-forget).
    let deadline = Instant::now() + Duration::from_secs(30);
    while partition.in_flight() > 0 {
        assert!(Instant::now() < deadline, "the ledger never drained");
        std::thread::sleep(Duration::from_millis(1));
    }
    let lanes = Lanes::builder(Accounts).name("accounts").build()?;
    for n in 0..COMMANDS {
        lanes
            .execute_blocking(n % 10, n, Duration::from_secs(5))
            .map_err(|e| e.to_string())?;
    }
    assert!(lanes.close_blocking(Duration::from_secs(5)));
    // A graceful stop: every worker flushes its counts as it exits.
    assert!(executor.shutdown(Duration::from_secs(10)));
    Ok(())
}

/// `GET /metrics` on `addr` (retried while the listener starts).
pub fn scrape(addr: SocketAddr) -> Result<String, Error> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut stream = loop {
        match TcpStream::connect(addr) {
            Ok(s) => break s,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => return Err(e.into()),
        }
    };
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .ok_or("no HTTP header in the response")?;
    if !head.starts_with("HTTP/1.1 200") {
        return Err(format!("scrape failed: {head}").into());
    }
    Ok(body.to_owned())
}

/// The samples of a Prometheus text exposition: `name{labels}` → value
/// (labels as written, sorted).
pub fn parse(body: &str) -> BTreeMap<String, f64> {
    let mut samples = BTreeMap::new();
    for line in body
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
    {
        let Some((series, value)) = line.rsplit_once(' ') else {
            continue;
        };
        let Ok(value) = value.parse::<f64>() else {
            continue;
        };
        let key = match series.split_once('{') {
            Some((name, labels)) => {
                let mut labels: Vec<&str> = labels.trim_end_matches('}').split(',').collect();
                labels.sort_unstable();
                format!("{name}{{{}}}", labels.join(","))
            }
            None => series.to_owned(),
        };
        samples.insert(key, value);
    }
    samples
}

/// Checks the scrape against the workload: every documented series with
/// its labels, exact counts, and plausible histogram figures.
pub fn check(samples: &BTreeMap<String, f64>) -> Result<(), String> {
    let get = |key: &str| {
        samples
            .get(key)
            .copied()
            .ok_or_else(|| format!("missing series {key}"))
    };
    let expect = |key: &str, want: f64| -> Result<(), String> {
        let got = get(key)?;
        if got == want {
            Ok(())
        } else {
            Err(format!("{key} = {got}, expected {want}"))
        }
    };
    let outcome = |d: &str, o: &str| {
        format!("keyed_executor_messages_total{{dispatcher=\"{d}\",outcome=\"{o}\"}}")
    };
    let panics = (LEDGER / 100) as f64;
    expect(&outcome("ledger", "done"), LEDGER as f64 - panics)?;
    expect(&outcome("ledger", "panicked"), panics)?;
    expect(&outcome("journal", "done"), JOURNAL as f64)?;
    for d in ["ledger", "journal"] {
        for o in ["rejected", "cancelled", "refused"] {
            expect(&outcome(d, o), 0.0)?;
        }
        expect(
            &format!("keyed_executor_slow_steps_total{{dispatcher=\"{d}\"}}"),
            0.0,
        )?;
        expect(
            &format!("keyed_executor_live_mailboxes{{dispatcher=\"{d}\"}}"),
            0.0,
        )?;
        // Sampled 1 in 256 by position: at least one sample (position 0), at most all.
        let total = if d == "ledger" { LEDGER } else { JOURNAL } as f64;
        for h in ["queue", "run", "poll"] {
            let count = get(&format!(
                "keyed_executor_{h}_seconds_count{{dispatcher=\"{d}\"}}"
            ))?;
            let sum = get(&format!(
                "keyed_executor_{h}_seconds_sum{{dispatcher=\"{d}\"}}"
            ))?;
            if !(1.0..=2.0 * total).contains(&count) || !(0.0..60.0).contains(&sum) {
                return Err(format!("{d} {h}_seconds: count {count}, sum {sum}"));
            }
            let inf = get(&format!(
                "keyed_executor_{h}_seconds_bucket{{dispatcher=\"{d}\",le=\"+Inf\"}}"
            ))?;
            if inf != count {
                return Err(format!(
                    "{d} {h}_seconds: +Inf bucket {inf} != count {count}"
                ));
            }
        }
    }
    expect(
        "keyed_executor_in_flight{dispatcher=\"ledger\",receiver=\"partition-0\"}",
        0.0,
    )?;
    expect(
        "keyed_executor_in_flight{dispatcher=\"journal\",receiver=\"0\"}",
        0.0,
    )?;
    expect("keyed_executor_workers_parked", 0.0)?;
    let lane = |o: &str| {
        format!("keyed_executor_lane_commands_total{{lanes=\"accounts\",outcome=\"{o}\"}}")
    };
    expect(&lane("ok"), COMMANDS as f64)?;
    for o in ["error", "panicked", "withdrawn", "busy", "closed"] {
        expect(&lane(o), 0.0)?;
    }
    for r in ["lane_full", "in_flight_limit"] {
        expect(
            &format!("keyed_executor_lane_busy_total{{lanes=\"accounts\",reason=\"{r}\"}}"),
            0.0,
        )?;
    }
    // One caller at a time: every batch holds one command.
    expect(
        "keyed_executor_lane_batch_size_count{lanes=\"accounts\"}",
        COMMANDS as f64,
    )?;
    expect(
        "keyed_executor_lane_batch_size_sum{lanes=\"accounts\"}",
        COMMANDS as f64,
    )?;
    expect(
        "keyed_executor_lane_wait_seconds_count{lanes=\"accounts\"}",
        COMMANDS as f64,
    )?;
    Ok(())
}

fn main() -> Result<(), Error> {
    let addr = free_port()?;
    install(addr)?;
    println!("serving /metrics on http://{addr}/metrics");
    let start = Instant::now();
    workload()?;
    let body = scrape(addr)?;
    let samples = parse(&body);
    check(&samples)?;
    for (key, value) in samples.iter().filter(|(k, _)| {
        k.starts_with("keyed_executor_messages_total")
            || k.starts_with("keyed_executor_queue_seconds_count")
            || k.starts_with("keyed_executor_lane_commands_total{lanes=\"accounts\",outcome=\"ok\"")
    }) {
        println!("  {key} {value}");
    }
    println!(
        "ok: {} series scraped, every documented one as the workload predicts ({:.2?})",
        samples.len(),
        start.elapsed()
    );
    Ok(())
}
