//! Prints the group-commit table of BENCHMARKS.md in a few seconds: one key,
//! a store whose append costs a fixed 1 ms, 1/8/64/256 concurrent callers,
//! `max_batch = 32` against `max_batch = 1`.
//!
//! ```text
//! cargo run --release --example lanes_group_commit
//! ```
//! (`cargo bench --bench group_commit` measures the same with criterion.)

#[path = "../benches/lanes_sim/mod.rs"]
mod lanes_sim;

use std::time::Duration;

/// About this long per measured run.
const RUN: Duration = Duration::from_millis(400);

fn main() {
    let rt = lanes_sim::runtime();
    println!(
        "append = {:?} (simulated device), 1 key, tokio multi-thread runtime with 2 workers",
        lanes_sim::APPEND
    );
    println!();
    println!("| callers | max_batch=32 cmds/s | mean batch | max_batch=1 cmds/s | speed-up | expected min(callers,32)/append |");
    println!("|---:|---:|---:|---:|---:|---:|");
    for callers in [1usize, 8, 64, 256] {
        let mut cells = Vec::new();
        let mut append_time = Duration::ZERO;
        for max_batch in [32usize, 1] {
            // Size the run from the rate we expect so each takes about RUN.
            let expected = callers.min(max_batch) as f64 / lanes_sim::APPEND.as_secs_f64();
            let per_caller = ((expected * RUN.as_secs_f64()) / callers as f64)
                .ceil()
                .max(1.0) as u64;
            let run = lanes_sim::run(&rt, callers, max_batch, per_caller);
            append_time = append_time.max(run.append_time);
            cells.push(run);
        }
        let (batched, single) = (cells[0], cells[1]);
        let expected = callers.min(32) as f64 / append_time.as_secs_f64();
        println!(
            "| {callers} | {:.0} | {:.1} | {:.0} | {:.1}x | {:.0} (at the measured {:.2} ms append) |",
            batched.per_sec(),
            batched.mean_batch(),
            single.per_sec(),
            batched.per_sec() / single.per_sec(),
            expected,
            append_time.as_secs_f64() * 1e3,
        );
    }
}
