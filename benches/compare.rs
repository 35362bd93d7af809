//! keyed-executor against the designs users would pick instead (issue 5).
//!
//! ```text
//! cargo bench --bench compare -- --table     # the whole comparison table (~3–3.5 min on 2 cores)
//! cargo bench --bench compare -- --grid      # the crate alone: W1–W3 at spin × max_in_flight, then the W3 curve
//! cargo bench --bench compare -- --w3-curve  # W3: the crate at max_in_flight 256 … 16,384 next to tokio-actors
//! cargo bench --bench compare -- --sweep     # W1 at handler work 50 ns, 1 µs, 10 µs, every threaded design
//! cargo bench --bench compare -- --latency   # open-loop latency at half the fastest design's W1 rate
//! cargo bench --bench compare -- --steady    # W1 over 10 separate invocations per design, alternated
//! cargo bench --bench compare -- --smoke     # tiny sizes, sequence checks only (CI): every workload,
//!                                            #   design, and the crate at every grid/curve setting
//! cargo test  --release --bench compare      # the same smoke run (no `--bench` argument)
//! cargo bench --bench compare                # criterion groups w1_uniform … w4_ping_pong
//! cargo bench --bench compare -- w1_uniform  # one criterion group
//! ```
//!
//! Workloads (ids for `KEYED_BENCH_ONLY`): `w1`, `w1b` (batched source),
//! `w2`, `w3`, `w4`, `w5`, `w6`, `w7` (2 producers), `w7b` (4 producers),
//! `w8`, `w9` (slow key); see `common/workloads.rs` for what each does and
//! how to run it alone.
//!
//! Environment: `KEYED_BENCH_SCALE` (size factor), `KEYED_BENCH_RUNS`
//! (runs per design in `--table` / `--latency`, per cell in `--grid` /
//! `--w3-curve` / `--sweep`; default 3), `KEYED_BENCH_INVOCATIONS`
//! (`--steady`'s invocations per design, default 10),
//! `KEYED_BENCH_LATENCY_RATE` (`--latency` at this many msg/s instead of
//! half the fastest W1 measured first), `KEYED_BENCH_ITERS` (`50:23`:
//! handler work in ns and the loop iterations to use instead of
//! calibrating; `--steady` sets it for its invocations), `KEYED_BENCH_WORKERS` (default 2), `KEYED_BENCH_ONLY`
//! (`w1,w4`; also picks `--grid`'s workloads among w1–w3),
//! `KEYED_BENCH_DESIGNS` (`tokio,striped`: substrings of the row labels),
//! `KEYED_BENCH_CREDIT` (the crate's `max_in_flight` per receiver in W1,
//! W1b, W2, W3, W7, W9; default 1,024 for the sync handlers, 4,096 for W3's
//! async one; `--grid` and `--w3-curve` set their own). Diagnostics for the
//! crate's rows: `KEYED_BENCH_STATS=1` prints its workers' counters after
//! each run (messages run per worker, parks, wake-ups, spin hits) on
//! stderr; `KEYED_BENCH_NO_WC=1` turns its work conservation off. For the
//! striped peer, `KEYED_BENCH_STRIPED_BOUND=N` gives each of its channels
//! room for N ÷ workers messages (unbounded by default), so that its
//! producer blocks as the crate's does at `max_in_flight` N (W1, W2, W7
//! only: W4's handlers send into their own pool). `KEYED_BENCH_FLOOR`
//! (`credit,turns,return=16` by default) says what the diagnostic
//! `contract-floor` row pays for (`benches/common/floor.rs`); the row runs
//! only when `KEYED_BENCH_DESIGNS` names it (`floor`), and in the smoke
//! run.

mod common;

use common::workloads::{designs, run, Sizes, Workload};
use criterion::{Criterion, SamplingMode, Throughput};
use std::time::Duration;

#[global_allocator]
static ALLOC: common::alloc::CountingAlloc = common::alloc::CountingAlloc;

/// Criterion measures time, so it gets the timed workloads; memory (W5, W6)
/// and CPU (W8) are in the `--table` run only.
fn criterion_groups(c: &mut Criterion) {
    let sizes = Sizes::full().scaled_from_env();
    for w in [Workload::W1, Workload::W2, Workload::W3, Workload::W4] {
        let mut group = c.benchmark_group(w.group());
        group
            .sampling_mode(SamplingMode::Flat)
            .sample_size(10)
            .warm_up_time(Duration::from_secs(1))
            .measurement_time(Duration::from_secs(4));
        for spec in designs(w) {
            group.throughput(Throughput::Elements(
                w.elements(&sizes, spec.blocks_on_io()),
            ));
            group.bench_function(spec.name(), |b| {
                b.iter_custom(|iters| {
                    (0..iters)
                        .map(|_| match run(spec, w, &sizes) {
                            Ok(o) => o.elapsed,
                            Err(e) => panic!("{} {}: {e}", w.id(), spec.name()),
                        })
                        .sum()
                })
            });
        }
        group.finish();
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let has = |flag: &str| args.iter().any(|a| a == flag);
    // Built with `--features metrics`, the crate records into whatever
    // recorder is installed: the Prometheus exporter's (without its HTTP
    // listener), so the measured cost includes real handles, not no-ops.
    #[cfg(feature = "metrics")]
    metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .expect("install the Prometheus recorder");
    // One `--steady` invocation (started by `--steady` itself).
    if let Some(i) = args.iter().position(|a| a == common::steady::ONCE_FLAG) {
        let label = args.get(i + 1).map_or("", String::as_str);
        let sizes = if has(common::steady::TINY_FLAG) {
            Sizes::smoke()
        } else {
            Sizes::full().scaled_from_env()
        };
        std::process::exit(common::steady::w1_once(label, &sizes));
    }
    if has("--table") {
        std::process::exit(common::report::table(Sizes::full().scaled_from_env()));
    }
    if has("--grid") {
        std::process::exit(common::report::grid(Sizes::full().scaled_from_env()));
    }
    if has("--w3-curve") {
        std::process::exit(common::report::w3_curve(Sizes::full().scaled_from_env()));
    }
    if has("--sweep") {
        std::process::exit(common::report::sweep(Sizes::full().scaled_from_env()));
    }
    if has("--latency") {
        std::process::exit(common::report::latency(Sizes::full().scaled_from_env()));
    }
    if has("--steady") {
        std::process::exit(common::steady::steady(
            &Sizes::full().scaled_from_env(),
            common::steady::invocations(),
            false,
        ));
    }
    // `cargo test` runs bench targets without `--bench`: treat that as CI's smoke run.
    if has("--smoke") || !has("--bench") {
        std::process::exit(common::report::smoke(Sizes::smoke()));
    }
    let mut c = Criterion::default().configure_from_args();
    criterion_groups(&mut c);
    c.final_summary();
}
