//! Per-thread cost of one message, with threads pinned: the producer on one
//! core, one handler thread on the other, so neither shares its core and the
//! figures are the threads' own CPU time (`CLOCK_THREAD_CPUTIME_ID`), not
//! throughput under time-slicing.
//!
//! ```text
//! cargo bench --bench probe                       # crate and striped, 2,000,000 msgs, 10,000 keys
//! KEYED_PROBE_MSGS=500000 cargo bench --bench probe
//! KEYED_PROBE_SLOW_STEP_MS=100 cargo bench --bench probe   # with the slow-step watch on
//! ```
//!
//! Printed per design: producer ns/msg, worker ns/msg (both including the
//! idle spinning a thread does while it waits, which is why the worker runs
//! a handler of 0 ns: its figure is the design's own cost of taking a
//! message in and running it), and wall ns/msg. Needs 2 cores; on one it
//! still runs, unpinned.

use crossbeam_channel::unbounded;
use keyed_executor::{handler, KeyedExecutor};
use std::hint::black_box;
use std::sync::atomic::{AtomicU64, Ordering::*};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn thread_cpu() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid, writable timespec; the thread CPU clock always exists.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0);
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn pin(cpu: usize) {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes into it.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        let _ = libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

struct Figures {
    producer: f64,
    worker: f64,
    wall: f64,
}

/// The crate: one worker pinned to core 1, the producer on core 0, `send`.
fn keyed(msgs: u64, keys: u64, credit: usize) -> Figures {
    let worker_cpu = Arc::new(AtomicU64::new(0));
    let mut builder = KeyedExecutor::builder()
        .workers(1)
        .on_thread_start(|| pin(1))
        .on_thread_stop({
            let w = worker_cpu.clone();
            move || w.store(thread_cpu().as_nanos() as u64, SeqCst)
        });
    // `KEYED_PROBE_SLOW_STEP_MS=n`: watch for steps longer than n ms (the
    // cost of the slow-step watch: a clock reading per step).
    if let Some(ms) = std::env::var("KEYED_PROBE_SLOW_STEP_MS")
        .ok()
        .and_then(|v| v.parse().ok())
    {
        builder = builder.slow_step(Duration::from_millis(ms));
    }
    let ex = builder.build().unwrap();
    let done = Arc::new(AtomicU64::new(0));
    let d2 = done.clone();
    let dispatcher = ex.dispatcher(handler::from_fn(move |k: &u64, m: u64| {
        black_box((k, m));
        d2.fetch_add(1, Relaxed);
    }));
    let receiver = dispatcher.receiver(credit).unwrap();
    pin(0);
    let c0 = thread_cpu();
    let t0 = Instant::now();
    for i in 0..msgs {
        receiver.send(i % keys, i).unwrap();
    }
    let producer = thread_cpu() - c0;
    while done.load(Relaxed) < msgs {
        std::hint::spin_loop();
    }
    let wall = t0.elapsed();
    drop(receiver);
    assert!(ex.shutdown(Duration::from_secs(10)));
    Figures {
        producer: producer.as_nanos() as f64 / msgs as f64,
        worker: worker_cpu.load(SeqCst) as f64 / msgs as f64,
        wall: wall.as_nanos() as f64 / msgs as f64,
    }
}

/// A striped peer: one thread on core 1 draining a crossbeam channel.
fn striped(msgs: u64, keys: u64) -> Figures {
    let (tx, rx) = unbounded::<(u64, u64)>();
    let done = Arc::new(AtomicU64::new(0));
    let d2 = done.clone();
    let t = std::thread::spawn(move || {
        pin(1);
        for (k, m) in rx {
            black_box((k, m));
            d2.fetch_add(1, Relaxed);
        }
        thread_cpu()
    });
    pin(0);
    let c0 = thread_cpu();
    let t0 = Instant::now();
    for i in 0..msgs {
        tx.send((i % keys, i)).unwrap();
    }
    let producer = thread_cpu() - c0;
    while done.load(Relaxed) < msgs {
        std::hint::spin_loop();
    }
    let wall = t0.elapsed();
    drop(tx);
    let worker = t.join().unwrap();
    Figures {
        producer: producer.as_nanos() as f64 / msgs as f64,
        worker: worker.as_nanos() as f64 / msgs as f64,
        wall: wall.as_nanos() as f64 / msgs as f64,
    }
}

fn main() {
    // With `--features metrics` the crate records into a real recorder.
    #[cfg(feature = "metrics")]
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .expect("install the Prometheus recorder");
    let args: Vec<String> = std::env::args().collect();
    // `cargo test` runs bench targets: keep that quick.
    let smoke = !args.iter().any(|a| a == "--bench");
    let env = |k: &str, d: u64| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let msgs = if smoke {
        20_000
    } else {
        env("KEYED_PROBE_MSGS", 2_000_000)
    };
    let keys = env("KEYED_PROBE_KEYS", 10_000);
    let credit = env("KEYED_PROBE_CREDIT", 1024) as usize;
    let runs = if smoke { 1 } else { env("KEYED_PROBE_RUNS", 5) };
    println!("probe: {msgs} msgs over {keys} keys, 0 ns handler, producer pinned to core 0, one worker to core 1, keyed credit {credit}");
    println!("| design | producer ns/msg | worker ns/msg | wall ns/msg |");
    println!("|---|---|---|---|");
    let mut rows: Vec<(&str, Vec<Figures>)> = vec![("keyed-executor", vec![]), ("striped", vec![])];
    for _ in 0..runs {
        rows[0].1.push(keyed(msgs, keys, credit));
        rows[1].1.push(striped(msgs, keys));
    }
    let med = |mut v: Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        v[v.len() / 2]
    };
    for (name, f) in &rows {
        println!(
            "| {name} | {:.1} | {:.1} | {:.1} |",
            med(f.iter().map(|x| x.producer).collect()),
            med(f.iter().map(|x| x.worker).collect()),
            med(f.iter().map(|x| x.wall).collect()),
        );
    }
}
