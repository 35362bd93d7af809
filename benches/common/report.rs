//! The non-criterion modes: `--table` (every workload × design, several
//! runs, a markdown table of median and min–max), `--grid` (the crate alone
//! on W1–W3 over spin × `max_in_flight`), `--w3-curve` (W3 for the crate at
//! four credits next to tokio-actors), `--sweep` (W1 at handler work 50 ns,
//! 1 µs, 10 µs), `--latency` (the open-loop latency row) and `--smoke`
//! (tiny sizes, one run each, sequence checks only, never timing).
//! `--steady` is in `steady.rs`.

use super::work::{iters_for, work_ns, work_ns_now};
use super::workloads::{
    design_selected, designs, machine_limit, run, run_open_loop, workers, Kind, Metric, Outcome,
    Sizes, Spec, Workload, OPEN_LOOP_METRICS,
};
use std::fmt::Write as _;
use std::time::{Duration, Instant};

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

pub(crate) fn median(v: &[f64]) -> f64 {
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
pub(crate) fn num(x: f64) -> String {
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
    let mut out = table_md(&w.title(sizes), w.metrics(), rows);
    let ok = |r: &&Row| r.error.is_none() && !r.samples.is_empty();
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
        // Measured now, after the runs: the host's drift since the
        // calibration shows.
        let slow_ns = work_ns_now(sizes.slow_work_ns);
        let load = sizes.slow_rate / sizes.slow_every as f64 * slow_ns / 1e9 * 100.0;
        let _ = writeln!(
            out,
            "\nThe slow key: calibrated to {:?} of work per message before the runs, {:.3} ms measured after them (best of 5 calls); at {:.0} msg/s that is {load:.0} % of one core, so a design that makes other keys wait behind it, or a host that slows that core, shows at once. Target: the crate's p99 slow÷base ≤ 2×.",
            Duration::from_nanos(sizes.slow_work_ns),
            slow_ns / 1e6,
            sizes.slow_rate / sizes.slow_every as f64,
        );
    }
    let _ = writeln!(out, "\n({runs} runs per design)\n");
    out
}

/// A markdown table under `### title`: per row, each metric's median
/// (min–max) over its runs; then, for each metric marked `compare`, a line
/// per crate row with its ratio to every peer (crate ÷ peer; a peer whose
/// median is not positive has no ratio).
fn table_md(title: &str, metrics: &[Metric], rows: &[Row]) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "### {title}\n");
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
            let _ = write!(out, " {} |", summary(&row.metric(i)));
        }
        out.push('\n');
    }
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
    out
}

/// Table runs per design: `KEYED_BENCH_RUNS`, default 3.
fn runs() -> usize {
    std::env::var("KEYED_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(3)
}

/// The 1/5/15-minute load averages: the machine is shared, so a table says
/// how busy it was.
pub(crate) fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

/// Every selected workload × design, `KEYED_BENCH_RUNS` runs (default 3);
/// prints markdown tables to stdout and progress to stderr. Returns the exit
/// code: 1 if any run failed its sequence checks.
pub fn table(sizes: Sizes) -> i32 {
    let runs = runs();
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

/// The crate's settings `--grid` and `--w3-curve` run on `w` (none for
/// the other workloads), filtered like [`designs`].
fn grid_specs(w: Workload) -> Vec<Spec> {
    let mut specs: Vec<Spec> = match w {
        Workload::W1 | Workload::W2 | Workload::W3 => GRID_SPINS
            .iter()
            .flat_map(|&spin| {
                GRID_CREDITS
                    .iter()
                    .map(move |&c| Spec::keyed(spin, Some(c)))
            })
            .collect(),
        _ => Vec::new(),
    };
    if w == Workload::W3 {
        specs.extend(
            CURVE_CREDITS
                .iter()
                .filter(|c| !GRID_CREDITS.contains(c))
                .map(|&c| Spec::keyed(Duration::ZERO, Some(c))),
        );
    }
    specs.retain(|s| design_selected(&s.name()));
    specs
}

/// Every workload × design once at CI's tiny size (the diagnostic
/// `contract-floor` too), then the crate at every `--grid` / `--w3-curve`
/// setting; checks only.
pub fn smoke(sizes: Sizes) -> i32 {
    let (mut passed, mut failed) = (0, 0);
    let started = Instant::now();
    for w in selected() {
        let mut specs = designs(w);
        let floor = Spec::of(Kind::Floor);
        if design_selected(&floor.name()) && !specs.iter().any(|s| s.kind == Kind::Floor) {
            specs.push(floor);
        }
        for spec in specs.into_iter().chain(grid_specs(w)) {
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
    if selected().contains(&Workload::W1) {
        // `--sweep`'s cells, `--latency`'s open-loop runs (at a fixed
        // rate: no peak to measure) and one `--steady` invocation per
        // design, at CI's sizes.
        let mut check = |what: String, r: Result<Outcome, String>| match r {
            Ok(_) => {
                passed += 1;
                println!("ok   {what}");
            }
            Err(e) => {
                failed += 1;
                println!("FAIL {what}: {e}");
            }
        };
        for spec in threaded() {
            for &(ns, msgs) in &sizes.sweep {
                let s = w1_with(&sizes, ns, msgs);
                check(
                    format!("sweep {} {}", work_label(ns), spec.name()),
                    run(spec, Workload::W1, &s),
                );
            }
        }
        for spec in designs(Workload::W1) {
            check(
                format!("open loop {}", spec.name()),
                run_open_loop(spec, &sizes, SMOKE_OPEN_LOOP_RATE),
            );
        }
        if super::steady::steady(&sizes, 1, true) == 0 {
            passed += 1;
            println!("ok   steady, one invocation per design");
        } else {
            failed += 1;
            println!("FAIL steady, one invocation per design");
        }
    }
    println!(
        "smoke run of the comparison took {:.1} s",
        started.elapsed().as_secs_f64()
    );
    println!("smoke: {passed} passed, {failed} failed");
    i32::from(failed > 0)
}

/// The smoke run's open-loop rate, messages per second (a fixed one: the
/// smoke run measures no peak).
const SMOKE_OPEN_LOOP_RATE: f64 = 1e6;

/// `--grid`'s spins.
const GRID_SPINS: [Duration; 3] = [
    Duration::ZERO,
    Duration::from_micros(50),
    Duration::from_micros(100),
];
/// `--grid`'s `max_in_flight` values.
const GRID_CREDITS: [usize; 3] = [256, 1024, 4096];
/// `--w3-curve`'s `max_in_flight` values.
const CURVE_CREDITS: [usize; 4] = [256, 1024, 4096, 16_384];
/// A grid cell under this fraction of the reference cell is flagged.
const GRID_FLAG: f64 = 0.8;

/// Runs `specs` on `w`, `runs` times, interleaved run by run; the first
/// column of each run, or the first error.
fn sample(
    w: Workload,
    sizes: &Sizes,
    specs: &[Spec],
    runs: usize,
) -> Vec<Result<Vec<f64>, String>> {
    let mut out: Vec<Result<Vec<f64>, String>> = specs.iter().map(|_| Ok(Vec::new())).collect();
    for r in 0..runs {
        for (spec, slot) in specs.iter().zip(out.iter_mut()) {
            let Ok(v) = slot else { continue };
            eprint!("{} {} run {}/{runs} … ", w.id(), spec.name(), r + 1);
            match run(*spec, w, sizes) {
                Ok(o) => {
                    eprintln!("{:.3}", o.values[0]);
                    v.push(o.values[0]);
                }
                Err(e) => {
                    eprintln!("FAILED: {e}");
                    *slot = Err(e);
                }
            }
        }
    }
    out
}

/// `(min, median, max)` of `v`.
pub(crate) fn spread(v: &[f64]) -> (f64, f64, f64) {
    let lo = v.iter().cloned().fold(f64::MAX, f64::min);
    let hi = v.iter().cloned().fold(f64::MIN, f64::max);
    (lo, median(v), hi)
}

/// `median (min–max)`.
fn summary(v: &[f64]) -> String {
    let (lo, med, hi) = spread(v);
    format!("{} ({}–{})", num(med), num(lo), num(hi))
}

/// The spin as a row label.
fn spin_label(spin: Duration) -> String {
    if spin.is_zero() {
        "0".into()
    } else {
        format!("{spin:?}")
    }
}

/// The crate alone on W1, W2 and W3 (those of them `KEYED_BENCH_ONLY`
/// selects) at every spin × `max_in_flight` of [`GRID_SPINS`] ×
/// [`GRID_CREDITS`], `KEYED_BENCH_RUNS` runs each, interleaved: per
/// workload a table of medians and ratios to the (spin 0, 256) cell, the
/// crate's defaults, flagging ratios under [`GRID_FLAG`]. Then the W3 curve
/// if W3 is selected. Returns the exit code.
pub fn grid(sizes: Sizes) -> i32 {
    let runs = runs();
    let started = Instant::now();
    println!(
        "## keyed-executor grid: spin × max_in_flight, {} workers, {runs} runs per cell\n",
        workers()
    );
    println!("Load average at start: {}\n", loadavg());
    let mut failed = false;
    let workloads: Vec<Workload> = selected()
        .into_iter()
        .filter(|w| matches!(w, Workload::W1 | Workload::W2 | Workload::W3))
        .collect();
    for &w in &workloads {
        let specs: Vec<Spec> = GRID_SPINS
            .iter()
            .flat_map(|&spin| {
                GRID_CREDITS
                    .iter()
                    .map(move |&c| Spec::keyed(spin, Some(c)))
            })
            .collect();
        let results = sample(w, &sizes, &specs, runs);
        let metric = w.metrics()[0];
        let reference = results[0].as_ref().ok().map(|v| median(v));
        let mut out = String::new();
        let _ = writeln!(
            out,
            "### Grid, {}\n\nkeyed-executor only; {} {} median (min–max) and ratio to spin 0 / max_in_flight {} (the crate's defaults){}\n",
            w.title(&sizes),
            metric.name,
            if metric.higher_is_better { "↑" } else { "↓" },
            GRID_CREDITS[0],
            if metric.higher_is_better { "" } else { "; below 1 = faster" },
        );
        let _ = write!(out, "| spin \\ max_in_flight |");
        for c in GRID_CREDITS {
            let _ = write!(out, " {c} |");
        }
        let _ = write!(out, "\n|---|");
        for _ in GRID_CREDITS {
            let _ = write!(out, "---|");
        }
        out.push('\n');
        let mut flagged = Vec::new();
        for (si, &spin) in GRID_SPINS.iter().enumerate() {
            let _ = write!(out, "| {} |", spin_label(spin));
            for (ci, &c) in GRID_CREDITS.iter().enumerate() {
                match &results[si * GRID_CREDITS.len() + ci] {
                    Err(e) => {
                        failed = true;
                        let _ = write!(out, " FAILED: {e} |");
                    }
                    Ok(v) => {
                        let ratio = reference.map(|r| median(v) / r);
                        // "Worse than the reference by more than 20 %".
                        let bad = ratio.is_some_and(|q| {
                            if metric.higher_is_better {
                                q < GRID_FLAG
                            } else {
                                q > 1.0 / GRID_FLAG
                            }
                        });
                        let ratio_s = ratio.map_or("–".into(), |q| format!("{}×", num(q)));
                        let _ = write!(
                            out,
                            " {} {ratio_s}{} |",
                            summary(v),
                            if bad { " ⚠" } else { "" }
                        );
                        if bad {
                            flagged.push(format!("spin {} / {c}: {ratio_s}", spin_label(spin)));
                        }
                    }
                }
            }
            out.push('\n');
        }
        let _ = writeln!(
            out,
            "\nFlagged (more than {:.0} % worse than the defaults' cell): {}\n",
            (1.0 - GRID_FLAG) * 100.0,
            if flagged.is_empty() {
                "none".to_string()
            } else {
                flagged.join(", ")
            }
        );
        print!("{out}");
    }
    if workloads.contains(&Workload::W3) && !w3_curve_table(&sizes, runs) {
        failed = true;
    }
    println!(
        "Total time: {:.1} s; load average at the end: {}",
        started.elapsed().as_secs_f64(),
        loadavg()
    );
    i32::from(failed)
}

/// `--w3-curve`: W3 for the crate at each of [`CURVE_CREDITS`] next to
/// tokio-actors, interleaved run by run. Returns the exit code.
pub fn w3_curve(sizes: Sizes) -> i32 {
    let started = Instant::now();
    println!("Load average at start: {}\n", loadavg());
    let ok = w3_curve_table(&sizes, runs());
    println!(
        "Total time: {:.1} s; load average at the end: {}",
        started.elapsed().as_secs_f64(),
        loadavg()
    );
    i32::from(!ok)
}

/// Prints the W3 curve; false if a run failed.
fn w3_curve_table(sizes: &Sizes, runs: usize) -> bool {
    let w = Workload::W3;
    let mut specs = vec![Spec::of(Kind::Tokio)];
    specs.extend(
        CURVE_CREDITS
            .iter()
            .map(|&c| Spec::keyed(Duration::ZERO, Some(c))),
    );
    let results = sample(w, sizes, &specs, runs);
    let tokio = results[0].as_ref().ok().map(|v| median(v));
    let mut out = String::new();
    let _ = writeln!(
        out,
        "### W3 curve: keyed-executor's max_in_flight next to tokio-actors\n\n{}; {runs} runs each, interleaved\n",
        w.title(sizes)
    );
    let _ = writeln!(
        out,
        "| design | M msg/s ↑ median (min–max) | ÷ tokio-actors |\n|---|---|---|"
    );
    let mut ok = true;
    for (spec, r) in specs.iter().zip(&results) {
        match r {
            Err(e) => {
                ok = false;
                let _ = writeln!(out, "| {} | FAILED: {e} | |", spec.name());
            }
            Ok(v) => {
                let ratio = tokio.map_or("–".into(), |t| format!("{}×", num(median(v) / t)));
                let _ = writeln!(out, "| {} | {} | {ratio} |", spec.name(), summary(v));
            }
        }
    }
    out.push('\n');
    print!("{out}");
    ok
}

/// Runs `one(spec)` for every spec, `runs` times, interleaved run by run (a
/// busy moment of the shared machine hits every design rather than one);
/// a design that fails stops there and keeps its error. `what` names the
/// runs in the progress lines on stderr.
fn rows_of(
    specs: &[Spec],
    runs: usize,
    what: &str,
    mut one: impl FnMut(Spec) -> Result<Outcome, String>,
) -> Vec<Row> {
    let mut rows: Vec<Row> = specs
        .iter()
        .map(|&spec| Row {
            spec,
            samples: Vec::new(),
            error: None,
        })
        .collect();
    for r in 0..runs {
        for row in rows.iter_mut().filter(|row| row.error.is_none()) {
            eprint!("{what} {} run {}/{runs} … ", row.spec.name(), r + 1);
            match one(row.spec) {
                Ok(o) => {
                    eprintln!("{:?}", o.values);
                    row.samples.push(o.values);
                }
                Err(e) => {
                    eprintln!("FAILED: {e}");
                    row.error = Some(e);
                }
            }
        }
    }
    rows
}

/// The designs that hand messages to handler threads: every W1 design but
/// `inline` (filtered by `KEYED_BENCH_DESIGNS`).
fn threaded() -> Vec<Spec> {
    designs(Workload::W1)
        .into_iter()
        .filter(|s| s.kind != Kind::Inline)
        .collect()
}

/// A handler's work as a column label: `50 ns`, `1 µs`, `10 µs`.
fn work_label(ns: u64) -> String {
    if ns >= 1_000 && ns % 1_000 == 0 {
        format!("{} µs", ns / 1_000)
    } else {
        format!("{ns} ns")
    }
}

/// W1 with handler work `ns` and `msgs` messages (the rest of `sizes` as is).
fn w1_with(sizes: &Sizes, ns: u64, msgs: usize) -> Sizes {
    Sizes {
        work_ns: ns,
        msgs,
        ..sizes.clone()
    }
}

/// `--sweep`: W1 for every threaded design at each handler work of
/// `sizes.sweep` (50 ns, 1 µs, 10 µs, each with a message count that makes
/// a cell take ~0.2–1 s), `KEYED_BENCH_RUNS` runs per cell, interleaved.
/// Prints M msg/s with each design's share of the machine's limit (cores ÷
/// the handler's measured work), the crate's ratio to each peer per work,
/// and the per-message overhead (CPU ÷ messages minus the work). Returns
/// the exit code: 1 if any run failed its sequence checks.
pub fn sweep(sizes: Sizes) -> i32 {
    let runs = runs();
    let started = Instant::now();
    let specs = threaded();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!(
        "## W1 handler-cost sweep: {} keys round-robin, one producer, {} handler threads per design, {runs} runs per cell, designs interleaved\n",
        sizes.keys,
        workers()
    );
    println!("Load average at start: {}\n", loadavg());
    // Every work size is calibrated before the first run.
    for &(ns, _) in &sizes.sweep {
        println!(
            "- {}: {} loop iterations, measured {:.1} ns per call",
            work_label(ns),
            iters_for(ns),
            work_ns(ns)
        );
    }
    println!();
    let cells: Vec<Vec<Row>> = sizes
        .sweep
        .iter()
        .map(|&(ns, msgs)| {
            let s = w1_with(&sizes, ns, msgs);
            rows_of(&specs, runs, &format!("w1 {}", work_label(ns)), |spec| {
                run(spec, Workload::W1, &s)
            })
        })
        .collect();
    let limit = |ns: u64| cores as f64 / work_ns(ns) * 1e3;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "### W1 by handler work: M msg/s ↑ median (min–max), share of the machine's limit\n"
    );
    let _ = write!(out, "| design |");
    for &(ns, msgs) in &sizes.sweep {
        let _ = write!(out, " {} ({msgs} msgs) |", work_label(ns));
    }
    let _ = write!(out, "\n|---|");
    for _ in &sizes.sweep {
        let _ = write!(out, "---|");
    }
    let _ = write!(out, "\n| machine limit: {cores} cores ÷ work |");
    for &(ns, _) in &sizes.sweep {
        let _ = write!(out, " {} |", num(limit(ns)));
    }
    out.push('\n');
    let mut failed = false;
    for (d, spec) in specs.iter().enumerate() {
        let _ = write!(out, "| {} |", spec.name());
        for (c, &(ns, _)) in sizes.sweep.iter().enumerate() {
            let row = &cells[c][d];
            match &row.error {
                Some(e) => {
                    failed = true;
                    let _ = write!(out, " FAILED: {e} |");
                }
                None => {
                    let v = row.metric(0);
                    let share = median(&v) / limit(ns) * 100.0;
                    let _ = write!(out, " {}, {share:.0} % |", summary(&v));
                }
            }
        }
        out.push('\n');
    }
    // The crate's ratio to each peer, per work: where the overhead stops mattering.
    let med = |c: usize, d: usize, i: usize| -> Option<f64> {
        let row = &cells[c][d];
        (row.error.is_none() && !row.samples.is_empty()).then(|| median(&row.metric(i)))
    };
    let _ = writeln!(
        out,
        "\n#### The crate ÷ each peer, M msg/s medians (above 1 = crate faster)\n"
    );
    let _ = write!(out, "| |");
    for &(ns, _) in &sizes.sweep {
        let _ = write!(out, " {} |", work_label(ns));
    }
    let _ = write!(out, "\n|---|");
    for _ in &sizes.sweep {
        let _ = write!(out, "---|");
    }
    out.push('\n');
    for (ci, crate_spec) in specs.iter().enumerate().filter(|(_, s)| s.is_crate()) {
        for (pi, peer) in specs.iter().enumerate().filter(|(_, s)| !s.is_crate()) {
            let _ = write!(out, "| {} ÷ {} |", crate_spec.name(), peer.name());
            for c in 0..sizes.sweep.len() {
                match (med(c, ci, 0), med(c, pi, 0)) {
                    (Some(x), Some(y)) if y > 0.0 => {
                        let _ = write!(out, " {}× |", num(x / y));
                    }
                    _ => {
                        let _ = write!(out, " – |");
                    }
                }
            }
            out.push('\n');
        }
    }
    let _ = writeln!(
        out,
        "\n#### Overhead ns/msg ↓ median: process CPU ÷ messages minus the handler's measured work (the producer's send path and the harness's checks included; a 1 % drift of the cores' speed is 0.5 ns of 50 ns but 100 ns of 10 µs, so the last column is good to a few hundred ns)\n"
    );
    let _ = write!(out, "| design |");
    for &(ns, _) in &sizes.sweep {
        let _ = write!(out, " {} |", work_label(ns));
    }
    let _ = write!(out, "\n|---|");
    for _ in &sizes.sweep {
        let _ = write!(out, "---|");
    }
    out.push('\n');
    for (d, spec) in specs.iter().enumerate() {
        let _ = write!(out, "| {} |", spec.name());
        for c in 0..sizes.sweep.len() {
            let cell = med(c, d, 2).map_or("–".into(), num);
            let _ = write!(out, " {cell} |");
        }
        out.push('\n');
    }
    let _ = writeln!(out, "\n({runs} runs per cell)\n");
    print!("{out}");
    println!(
        "Total time: {:.1} s; load average at the end: {}",
        started.elapsed().as_secs_f64(),
        loadavg()
    );
    i32::from(failed)
}

/// `KEYED_BENCH_LATENCY_RATE`: the open-loop row's rate in messages per
/// second, instead of half the fastest design's W1 measured first.
fn fixed_latency_rate() -> Option<f64> {
    std::env::var("KEYED_BENCH_LATENCY_RATE")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&r: &f64| r > 0.0)
}

/// `--latency`: the open-loop latency row. First W1 for every threaded
/// design (`KEYED_BENCH_RUNS` runs, interleaved; the fastest median is the
/// machine's rate at this moment), then every design, `inline` included,
/// fed W1's schedule at half that rate by an open-loop producer
/// ([`run_open_loop`]): submit → done latency p50 / p99 / p99.9 / max.
/// `KEYED_BENCH_LATENCY_RATE` skips the first part. Returns the exit code.
pub fn latency(sizes: Sizes) -> i32 {
    let runs = runs();
    let started = Instant::now();
    println!(
        "## Open-loop latency: W1's schedule ({} keys round-robin, {} msgs, {} ns handler) at half the machine's rate, {} handler threads per design, {runs} runs each, designs interleaved\n",
        sizes.keys,
        sizes.msgs,
        sizes.work_ns,
        workers()
    );
    println!("Load average at start: {}\n", loadavg());
    iters_for(sizes.work_ns);
    let mut failed = false;
    let rate = match fixed_latency_rate() {
        Some(r) => {
            println!(
                "Offered rate: {} M msg/s (KEYED_BENCH_LATENCY_RATE)\n",
                num(r / 1e6)
            );
            r
        }
        None => {
            let rows = rows_of(&threaded(), runs, "w1 peak", |spec| {
                run(spec, Workload::W1, &sizes)
            });
            print!(
                "{}",
                table_md(
                    &format!("First, the peak: {}", Workload::W1.title(&sizes)),
                    Workload::W1.metrics(),
                    &rows
                )
            );
            failed |= rows.iter().any(|r| r.error.is_some());
            let Some((best, peak)) = rows
                .iter()
                .filter(|r| r.error.is_none() && !r.samples.is_empty())
                .map(|r| (r.spec.name(), median(&r.metric(0))))
                .max_by(|a, b| a.1.total_cmp(&b.1))
            else {
                println!("\nNo design finished W1: no rate to offer.");
                return 1;
            };
            println!(
                "\nOffered rate: {} M msg/s, half of the fastest W1 median in this run ({best}, {} M msg/s)\n",
                num(peak / 2.0),
                num(peak)
            );
            peak / 2.0 * 1e6
        }
    };
    let rows = rows_of(&designs(Workload::W1), runs, "open loop", |spec| {
        run_open_loop(spec, &sizes, rate)
    });
    failed |= rows.iter().any(|r| r.error.is_some());
    let mut out = table_md(
        &format!(
            "Open-loop latency at {} M msg/s: scheduled send → handler done, µs (first 10 % of the schedule left out)",
            num(rate / 1e6)
        ),
        OPEN_LOOP_METRICS,
        &rows,
    );
    let _ = writeln!(out, "\n({runs} runs per design)\n");
    print!("{out}");
    println!(
        "Total time: {:.1} s; load average at the end: {}",
        started.elapsed().as_secs_f64(),
        loadavg()
    );
    i32::from(failed)
}
