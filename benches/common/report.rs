//! The two non-criterion modes: `--table` (every workload × design, several
//! runs, a markdown table of median and min–max) and `--smoke` (tiny sizes,
//! one run each, sequence checks only, never timing).

use super::work::work_ns;
use super::workloads::{designs, machine_limit, run, workers, Sizes, Spec, Workload};
use std::fmt::Write as _;
use std::time::Instant;

/// Workloads to run: `KEYED_BENCH_ONLY` (comma-separated ids such as
/// `w1,w4`), default all.
pub fn selected() -> Vec<Workload> {
    match std::env::var("KEYED_BENCH_ONLY") {
        Ok(only) if !only.is_empty() => Workload::ALL
            .into_iter()
            .filter(|w| {
                only.split(',')
                    .any(|o| o.trim().eq_ignore_ascii_case(w.id()))
            })
            .collect(),
        _ => Workload::ALL.to_vec(),
    }
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Three significant digits, no exponent.
fn num(x: f64) -> String {
    let a = x.abs();
    if a >= 100.0 {
        format!("{x:.0}")
    } else if a >= 10.0 {
        format!("{x:.1}")
    } else if a >= 1.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.3}")
    }
}

struct Row {
    spec: Spec,
    /// `samples[run][metric]`.
    samples: Vec<Vec<f64>>,
    error: Option<String>,
}

impl Row {
    fn metric(&self, i: usize) -> Vec<f64> {
        self.samples.iter().map(|s| s[i]).collect()
    }
}

fn table_of(w: Workload, sizes: &Sizes, rows: &[Row], runs: usize) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "### {}\n", w.title(sizes));
    let metrics = w.metrics();
    let _ = write!(out, "| design |");
    for m in metrics {
        let better = if m.higher_is_better { "↑" } else { "↓" };
        let _ = write!(out, " {} {better} median (min–max) |", m.name);
    }
    let _ = write!(out, "\n|---|");
    for _ in metrics {
        let _ = write!(out, "---|");
    }
    out.push('\n');
    for row in rows {
        let _ = write!(out, "| {} |", row.spec.name());
        if let Some(e) = &row.error {
            let _ = writeln!(out, " FAILED: {e} |");
            continue;
        }
        for i in 0..metrics.len() {
            let v = row.metric(i);
            let lo = v.iter().cloned().fold(f64::MAX, f64::min);
            let hi = v.iter().cloned().fold(f64::MIN, f64::max);
            let _ = write!(out, " {} ({}–{}) |", num(median(&v)), num(lo), num(hi));
        }
        out.push('\n');
    }
    // The crate against each peer, on the columns marked `compare`:
    // crate ÷ peer (a peer whose median is not positive has no ratio).
    let ok = |r: &&Row| r.error.is_none() && !r.samples.is_empty();
    for (i, mi) in metrics.iter().enumerate().filter(|(_, m)| m.compare) {
        for c in rows.iter().filter(ok).filter(|r| r.spec.is_crate()) {
            let cv = median(&c.metric(i));
            let mut parts = Vec::new();
            for p in rows.iter().filter(ok).filter(|r| !r.spec.is_crate()) {
                let pv = median(&p.metric(i));
                if pv > 0.0 {
                    parts.push(format!("{} {}×", p.spec.name(), num(cv / pv)));
                }
            }
            let _ = writeln!(
                out,
                "\n{} ÷ peer, {} ({}): {}",
                c.spec.name(),
                mi.name,
                if mi.higher_is_better {
                    "above 1 = crate better"
                } else {
                    "below 1 = crate better"
                },
                parts.join(", ")
            );
        }
    }
    if w == Workload::W1b {
        let (cores, ns, limit) = machine_limit(sizes);
        let shares: Vec<String> = rows
            .iter()
            .filter(ok)
            .map(|r| {
                let share = median(&r.metric(0)) / limit * 100.0;
                format!("{} {share:.0} %", r.spec.name())
            })
            .collect();
        let _ = writeln!(
            out,
            "\nMachine limit: {cores} cores ÷ {ns:.1} ns of handler work per message = {} M msg/s; share of it (median): {}",
            num(limit),
            shares.join(", ")
        );
    }
    if w == Workload::W9 {
        let slow_ns = work_ns(sizes.slow_work_ns);
        let load = sizes.slow_rate / sizes.slow_every as f64 * slow_ns / 1e9 * 100.0;
        let _ = writeln!(
            out,
            "\nThe slow key: {:.3} ms of work per message (best of 5 calls), {:.0} msg/s: {load:.0} % of one core, so a design that makes other keys wait behind it, or a host that slows that core, shows at once. Target: the crate's p99 slow÷base ≤ 2×.",
            slow_ns / 1e6,
            sizes.slow_rate / sizes.slow_every as f64,
        );
    }
    let _ = writeln!(out, "\n({runs} runs per design)\n");
    out
}

/// The 1/5/15-minute load averages: the machine is shared, so a table says
/// how busy it was.
fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

/// Every selected workload × design, `KEYED_BENCH_RUNS` runs (default 3);
/// prints markdown tables to stdout and progress to stderr. Returns the exit
/// code: 1 if any run failed its sequence checks.
pub fn table(sizes: Sizes) -> i32 {
    let runs: usize = std::env::var("KEYED_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(3);
    let started = Instant::now();
    println!(
        "## keyed-executor comparison: {} handler threads per design, {runs} runs each; {} ns of handler work = {} loop iterations (measured {:.1} ns per call)\n",
        workers(),
        sizes.work_ns,
        super::work::iters_for(sizes.work_ns),
        work_ns(sizes.work_ns),
    );
    println!("Load average at start: {}\n", loadavg());
    let mut failed = 0;
    for w in selected() {
        let specs = designs(w);
        let mut rows: Vec<Row> = specs
            .iter()
            .map(|&spec| Row {
                spec,
                samples: Vec::new(),
                error: None,
            })
            .collect();
        // Interleave the designs run by run, so a noisy neighbour on the
        // shared machine hits all of them rather than one.
        for r in 0..runs {
            for row in rows.iter_mut().filter(|row| row.error.is_none()) {
                eprint!("{} {} run {}/{runs} … ", w.id(), row.spec.name(), r + 1);
                match run(row.spec, w, &sizes) {
                    Ok(o) => {
                        eprintln!("{:?}", o.values);
                        row.samples.push(o.values);
                    }
                    Err(e) => {
                        eprintln!("FAILED: {e}");
                        row.error = Some(e);
                        failed += 1;
                    }
                }
            }
        }
        print!("{}", table_of(w, &sizes, &rows, runs));
    }
    println!(
        "Total time: {:.1} s; load average at the end: {}",
        started.elapsed().as_secs_f64(),
        loadavg()
    );
    i32::from(failed > 0)
}

/// Every workload × design once at CI's tiny size; checks only.
pub fn smoke(sizes: Sizes) -> i32 {
    let (mut passed, mut failed) = (0, 0);
    let started = Instant::now();
    for w in selected() {
        for spec in designs(w) {
            let t = Instant::now();
            match run(spec, w, &sizes) {
                Ok(_) => {
                    passed += 1;
                    println!(
                        "ok   {} {} ({} ms)",
                        w.group(),
                        spec.name(),
                        t.elapsed().as_millis()
                    );
                }
                Err(e) => {
                    failed += 1;
                    println!("FAIL {} {}: {e}", w.group(), spec.name());
                }
            }
        }
    }
    println!(
        "smoke run of the comparison took {:.1} s",
        started.elapsed().as_secs_f64()
    );
    println!("smoke: {passed} passed, {failed} failed");
    i32::from(failed > 0)
}
