//! Balance: does every worker run its share?
//!
//! The program a new user writes to see how the pool spreads work: an
//! executor of `workers(2)`, one dispatcher whose synchronous handler spins
//! for a fixed time, one receiver with `max_in_flight` 1,024, and one
//! producer thread `send`ing messages round-robin over 10,000 keys. After
//! each run it reads `stats().workers[i].done` and `parks`, prints the
//! split, and fails (exit 1) if any worker ran more than 60 % of the
//! messages in any run.
//!
//! ```text
//! cargo bench --bench balance                      # 20 runs at 10 µs, 20 at 1 µs, 10 at 50 ns
//! KEYED_BALANCE_RUNS=5 cargo bench --bench balance # fewer runs
//! KEYED_BALANCE_WORK=10000 cargo bench --bench balance   # one handler cost (ns)
//! KEYED_BALANCE_MAX_SHARE=0.6                      # the share that fails a run
//! ```
//!
//! Each run is a fresh executor (placement starts anew every time), so a
//! design that is lopsided only in some runs shows as such.

use std::hint::black_box;
use std::time::{Duration, Instant};

use keyed_executor::{handler, KeyedExecutor};

/// A busy loop of about `ns` nanoseconds of CPU (wall clock spin: the
/// machine is meant to be quiet while this runs).
#[inline(never)]
fn spin_for(ns: u64) {
    let start = Instant::now();
    let mut x = 1u64;
    while start.elapsed() < Duration::from_nanos(ns) {
        for _ in 0..16 {
            x = black_box(x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1));
        }
    }
}

struct Run {
    done: Vec<u64>,
    parks: Vec<u64>,
    rate: f64,
}

fn one_run(workers: usize, work_ns: u64, messages: u64, keys: u64) -> Run {
    let executor = KeyedExecutor::builder()
        .workers(workers)
        .build()
        .expect("executor");
    let dispatcher = executor.dispatcher(handler::from_fn(move |_key: &u64, _msg: u64| {
        spin_for(work_ns);
    }));
    let receiver = dispatcher.receiver(1024).expect("receiver");
    let start = Instant::now();
    let producer = {
        let receiver = receiver.clone();
        std::thread::spawn(move || {
            for i in 0..messages {
                if receiver.send(i % keys, i).is_err() {
                    panic!("refused");
                }
            }
        })
    };
    producer.join().expect("producer");
    assert!(receiver.shutdown(Duration::from_secs(60)), "drained");
    let elapsed = start.elapsed();
    let stats = executor.stats();
    executor.shutdown(Duration::from_secs(10));
    Run {
        done: stats.workers.iter().map(|w| w.done).collect(),
        parks: stats.workers.iter().map(|w| w.parks).collect(),
        rate: messages as f64 / elapsed.as_secs_f64(),
    }
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

fn main() {
    // `cargo test --benches` runs this without `--bench`: a tiny smoke run.
    let smoke = !std::env::args().any(|a| a == "--bench");
    let max_share: f64 = std::env::var("KEYED_BALANCE_MAX_SHARE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.6);
    let workers = env_u64("KEYED_BALANCE_WORKERS").unwrap_or(2) as usize;
    let runs_env = env_u64("KEYED_BALANCE_RUNS");
    // (handler ns, messages, runs)
    let plan: Vec<(u64, u64, u64)> = if smoke {
        vec![(1_000, 4_000, 1)]
    } else if let Some(ns) = env_u64("KEYED_BALANCE_WORK") {
        let msgs = (800_000_000 / ns.max(50)).clamp(80_000, 2_000_000);
        vec![(ns, msgs, runs_env.unwrap_or(20))]
    } else {
        vec![
            (10_000, 80_000, runs_env.unwrap_or(20)),
            (1_000, 800_000, runs_env.unwrap_or(20)),
            (50, 2_000_000, runs_env.unwrap_or(10)),
        ]
    };
    println!("| handler | run | done per worker | largest share | parks per worker | k msg/s |");
    println!("|---|---|---|---|---|---|");
    let mut failed = 0;
    for (ns, messages, runs) in plan {
        let mut worst: f64 = 0.0;
        for r in 0..runs {
            let run = one_run(workers, ns, messages, 10_000);
            let total: u64 = run.done.iter().sum();
            let share = *run.done.iter().max().unwrap_or(&0) as f64 / total.max(1) as f64;
            worst = worst.max(share);
            let lopsided = share > max_share && !smoke;
            failed += usize::from(lopsided);
            println!(
                "| {} ns | {} | {:?} | {:.1} %{} | {:?} | {:.0} |",
                ns,
                r + 1,
                run.done,
                share * 100.0,
                if lopsided { " FAIL" } else { "" },
                run.parks,
                run.rate / 1e3,
            );
            assert_eq!(total, messages, "every message ran once");
        }
        eprintln!("{ns} ns: largest share of any run {:.1} %", worst * 100.0);
    }
    if failed > 0 {
        eprintln!(
            "balance: {failed} run(s) had a worker above {:.0} %",
            max_share * 100.0
        );
        std::process::exit(1);
    }
}
