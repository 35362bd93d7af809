//! What making a component costs: the time to build (and drop) a
//! receiver and a dispatcher on an executor of 2, 16 and 64 workers, the
//! way a consumer does when partitions and bounded contexts come and go.
//! (The bytes an idle one holds are counted by `tests/idle_memory.rs`:
//! `KEYED_MEMORY_REPORT=1 KEYED_MEMORY_WORKERS=2,16,64 cargo test --release
//! --test idle_memory -- --nocapture`.)
//!
//! ```text
//! cargo bench --bench components
//! ```

use std::hint::black_box;
use std::time::{Duration, Instant};

use keyed_executor::{handler, Dispatcher, KeyedExecutor};

type D = Dispatcher<u64, u64, u64>;

fn dispatcher(executor: &KeyedExecutor) -> D {
    executor.dispatcher(handler::from_fn(|k: &u64, m: u64| k + m))
}

/// Median of `rounds` timings of `n` calls of `f`, per call.
fn per_call(rounds: usize, n: u32, mut f: impl FnMut()) -> Duration {
    let mut times: Vec<Duration> = (0..rounds)
        .map(|_| {
            let start = Instant::now();
            for _ in 0..n {
                f();
            }
            start.elapsed() / n
        })
        .collect();
    times.sort();
    times[rounds / 2]
}

fn main() {
    if std::env::args().any(|a| a == "--smoke") {
        return;
    }
    println!("| workers | make and drop a receiver | make and drop a dispatcher (with its default receiver) |");
    println!("|---|---|---|");
    for workers in [2, 16, 64] {
        let executor = KeyedExecutor::builder().workers(workers).build().unwrap();
        let d = dispatcher(&executor);
        let receiver = per_call(9, 2_000, || {
            black_box(d.receiver(256).unwrap());
        });
        let whole = per_call(9, 200, || {
            let d = dispatcher(&executor);
            black_box(d.default_receiver());
        });
        println!("| {workers} | {receiver:.2?} | {whole:.2?} |");
        drop(d);
        assert!(executor.shutdown(Duration::from_secs(10)));
    }
}
