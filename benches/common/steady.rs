//! `--steady`: how steady W1 is from one invocation to the next.
//!
//! One process can be lucky or unlucky as a whole: where the scheduler
//! first puts its threads, what the allocator's arenas look like, how busy
//! the host is in those seconds. So this mode does not repeat runs inside
//! one process; it starts the bench binary itself once per run
//! (`--w1-once <design>`: one W1 run, one figure on stdout), for each
//! design in turn, `KEYED_BENCH_INVOCATIONS` rounds (default 10), the
//! designs alternated and each round starting one design later (no design
//! is always first after a pause). Every invocation runs the same handler:
//! the parent calibrates the work once and hands the iteration count down
//! ([`ITERS_ENV`]).
//!
//! Printed per design: min, median and max M msg/s, slowest ÷ median, and
//! every figure in the order measured. Issue 31's target is the crate's
//! slowest ≥ 0.85× its median over 10 invocations.
//!
//! ```text
//! cargo bench --bench compare -- --steady
//! KEYED_BENCH_INVOCATIONS=20 KEYED_BENCH_DESIGNS=keyed,tokio cargo bench --bench compare -- --steady
//! ```

use super::work::{iters_for, work_ns, ITERS_ENV};
use super::workloads::{designs, run, workers, Sizes, Spec, Workload};
use std::fmt::Write as _;
use std::process::Command;
use std::time::Instant;

/// The flag of one child invocation.
pub const ONCE_FLAG: &str = "--w1-once";
/// With [`ONCE_FLAG`]: the child runs CI's smoke sizes.
pub const TINY_FLAG: &str = "--tiny";
/// What the child's figure line starts with on stdout.
const ONCE_PREFIX: &str = "w1-once";

/// Invocations per design: `KEYED_BENCH_INVOCATIONS`, default 10.
pub fn invocations() -> usize {
    std::env::var("KEYED_BENCH_INVOCATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(10)
}

/// The child: W1 once on the design labelled `label`, its M msg/s on
/// stdout (`w1-once <rate>`). Returns the exit code.
pub fn w1_once(label: &str, sizes: &Sizes) -> i32 {
    let Some(spec) = designs(Workload::W1)
        .into_iter()
        .find(|s| s.name() == label)
    else {
        println!("{ONCE_PREFIX} FAILED: no W1 design is labelled {label:?}");
        return 2;
    };
    match run(spec, Workload::W1, sizes) {
        Ok(o) => {
            println!("{ONCE_PREFIX} {}", o.values[0]);
            0
        }
        Err(e) => {
            println!("{ONCE_PREFIX} FAILED: {e}");
            1
        }
    }
}

/// One child invocation on `spec`; its M msg/s.
fn invoke(spec: &Spec, tiny: bool, iters: &str) -> Result<f64, String> {
    let exe = std::env::current_exe().map_err(|e| format!("current_exe: {e}"))?;
    let mut cmd = Command::new(exe);
    cmd.arg(ONCE_FLAG).arg(spec.name()).env(ITERS_ENV, iters);
    if tiny {
        cmd.arg(TINY_FLAG);
    }
    let out = cmd.output().map_err(|e| format!("start: {e}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix(ONCE_PREFIX))
        .map(str::trim)
        .ok_or_else(|| format!("no figure ({})", out.status))?;
    if !out.status.success() {
        return Err(line.to_string());
    }
    line.parse().map_err(|e| format!("{line:?}: {e}"))
}

/// A design's figures in the order measured, or its first error.
struct Series {
    spec: Spec,
    values: Vec<f64>,
    error: Option<String>,
}

/// Runs the steadiness mode: `n` invocations per design of W1 at `sizes`
/// (the children use CI's smoke sizes if `tiny`). Prints a markdown table;
/// returns the exit code (1 if any invocation failed).
pub fn steady(sizes: &Sizes, n: usize, tiny: bool) -> i32 {
    let started = Instant::now();
    let specs = designs(Workload::W1);
    let iters = format!("{}:{}", sizes.work_ns, iters_for(sizes.work_ns));
    let mut series: Vec<Series> = specs
        .iter()
        .map(|&spec| Series {
            spec,
            values: Vec::new(),
            error: None,
        })
        .collect();
    println!(
        "## W1 steadiness: {n} separate single-run invocations per design, alternated; {} keys, {} msgs, {} ns handler ({ITERS_ENV}={iters}, measured {:.1} ns per call), {} handler threads\n",
        sizes.keys,
        sizes.msgs,
        sizes.work_ns,
        work_ns(sizes.work_ns),
        workers()
    );
    println!("Load average at start: {}\n", super::report::loadavg());
    for round in 0..n {
        for j in 0..series.len() {
            let k = (round + j) % series.len();
            let s = &mut series[k];
            if s.error.is_some() {
                continue;
            }
            eprint!("invocation {}/{n} {} … ", round + 1, s.spec.name());
            match invoke(&s.spec, tiny, &iters) {
                Ok(v) => {
                    eprintln!("{v:.3}");
                    s.values.push(v);
                }
                Err(e) => {
                    eprintln!("FAILED: {e}");
                    s.error = Some(e);
                }
            }
        }
    }
    let mut out = String::new();
    let _ = writeln!(
        out,
        "| design | M msg/s min | median | max | slowest ÷ median | every invocation, in the order measured |\n|---|---|---|---|---|---|"
    );
    let mut failed = false;
    for s in &series {
        if let Some(e) = &s.error {
            failed = true;
            let _ = writeln!(out, "| {} | FAILED: {e} | | | | |", s.spec.name());
            continue;
        }
        let (lo, med, hi) = super::report::spread(&s.values);
        let all: Vec<String> = s.values.iter().map(|&v| super::report::num(v)).collect();
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} |",
            s.spec.name(),
            super::report::num(lo),
            super::report::num(med),
            super::report::num(hi),
            super::report::num(lo / med),
            all.join(", ")
        );
    }
    // CI's smoke sizes check that the mode works, not the target.
    if let Some(s) = series
        .iter()
        .filter(|_| !tiny)
        .find(|s| s.spec.is_crate() && s.error.is_none() && !s.values.is_empty())
    {
        let (lo, med, _) = super::report::spread(&s.values);
        let q = lo / med;
        let _ = writeln!(
            out,
            "\nTarget (issue 31): {}'s slowest ≥ 0.85× its median over 10 invocations; here {}× over {}: {}",
            s.spec.name(),
            super::report::num(q),
            s.values.len(),
            if q >= 0.85 { "met" } else { "missed" }
        );
    }
    print!("{out}");
    println!(
        "\nTotal time: {:.1} s; load average at the end: {}",
        started.elapsed().as_secs_f64(),
        super::report::loadavg()
    );
    i32::from(failed)
}
