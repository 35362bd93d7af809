//! The workloads, each generic over the design ([`Family`]), and the list of
//! designs a run compares.
//!
//! W1–W6 and W8 are the (see BENCHMARKS.md). W1, W2, W1b and W7
//! also print the process CPU per message over the timed part (first send
//! to last message done) and that minus the handler's calibrated work,
//! measured just before each run ([`work_ns_now`]): "overhead ns/msg", the
//! design's own cost per message, the producer's send path and the
//! harness's sequence checks included (the same checks for every design;
//! `inline`'s overhead is the harness's floor). The calibration times
//! back-to-back calls, which overlap a little differently from a call inside
//! a handler, so the absolute zero is good to a few ns (inline can come out
//! a few ns below zero); every design's CPU has the same work subtracted, so
//! the differences between designs do not depend on it.
//!
//! The later workloads, and how to run each alone (`KEYED_BENCH_SCALE=0.1`
//! for a quick look; `KEYED_BENCH_DESIGNS=keyed` for the crate's rows only):
//!
//! - **W1b, batched source** (`w1b`): W1's schedule (10,000 keys, 2 M msgs
//!   round-robin, 50 ns handler, one producer) cut into polls of 256
//!   records, as a Kafka / Redis consumer hands them over; each poll goes to
//!   the design in its natural batched form through [`SendTo::send_batch`]:
//!   striped sends one `Vec` per stripe per poll, the actor peers one send
//!   per message, the crate `keyed.rs`'s `send_poll` (its `send_batch` once
//!   it exists). Under the table: the machine's limit, cores ÷ the handler's
//!   measured ns per message, and each design's share of it.
//!   `KEYED_BENCH_ONLY=w1,w1b cargo bench --bench compare -- --table`
//! - **W7, multi-producer** (`w7`: 2 producer threads, `w7b`: 4): 2 M msgs in
//!   total, the 10,000 keys split into disjoint sets (`key % producers`),
//!   each producer round-robin over its own keys through its own source
//!   ([`Design::source`]: a fresh receiver with its own credit for the crate,
//!   a sender clone for the others, its own trampoline for inline). M msg/s of
//!   all producers together, from their common release to the last message
//!   done, plus the CPU columns.
//!   `KEYED_BENCH_ONLY=w7,w7b cargo bench --bench compare -- --table`
//! - **W9, slow key** (`w9`): 10,000 fast keys (50 ns) and one slow key
//!   (1 ms of CPU, 1 in 200 messages: 90 % of a core) under an open-loop
//!   producer paced at 180,000 msg/s for ~2 s (360,000 msgs; the count
//!   scales, the rate does not). Latency = handler start − scheduled send,
//!   fast keys only, so a design that blocks the producer (the crate
//!   waiting for credit) shows as latency too; the first 10 % of the
//!   schedule is warm-up and left out of the percentiles. Each table run
//!   does a baseline (the same schedule, the slow key fast) and the slow
//!   run; the `p99 slow÷base` column is the one with a target (the crate
//!   ≤ 2×). The producer wakes every 50 µs and sends what is due, so the
//!   latency's floor is tens of µs for every design. ~4.5 s per design per
//!   table run. `KEYED_BENCH_ONLY=w9 cargo bench --bench compare -- --table`
//! - **`--grid`**: the crate alone on W1, W2, W3 at spin 0 / 50 / 100 µs ×
//!   `max_in_flight` 256 / 1,024 / 4,096, medians and ratios to the crate's
//!   defaults (spin 0, 256), cells more than 20 % worse flagged ⚠; then the
//!   W3 curve. `KEYED_BENCH_RUNS=3 cargo bench --bench compare -- --grid`
//!   (`KEYED_BENCH_ONLY=w1` for one workload)
//! - **`--w3-curve`**: W3 for the crate at `max_in_flight` 256 / 1,024 /
//!   4,096 / 16,384 next to tokio-actors, interleaved, with ratios.
//!   `cargo bench --bench compare -- --w3-curve`

use super::alloc;
use super::design::{
    Cfg, CpuHandler, Design, DoneHandler, Family, Handler, IoHandler, PingHandler, SendTo,
    SlowKeyHandler,
};
use super::device::{Device, DeviceHandle};
use super::latency::{percentile, Recorder, Stamps, TimerSlack};
use super::peers::inline::InlineFamily;
use super::peers::smol_actors::SmolFamily;
use super::peers::stripe;
use super::peers::striped::StripedFamily;
use super::peers::tokio_actors::TokioFamily;
use super::work::{iters_for, work_ns, work_ns_now, Checker, Gate, Msg, Schedule};
use std::sync::{Arc, Barrier, Mutex, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

/// Sizes of every workload; [`Sizes::full`] is the issue's.
#[derive(Clone, Debug)]
pub struct Sizes {
    /// W1, W2, W6: keys.
    pub keys: usize,
    /// W1, W2: messages.
    pub msgs: usize,
    /// Handler CPU work in W1, W2, W1b, W7 (ns).
    pub work_ns: u64,
    /// W1b: messages per poll of the batched source.
    pub poll: usize,
    /// W3: keys.
    pub io_keys: usize,
    /// W3: messages for the async designs.
    pub io_msgs: usize,
    /// W3: messages for the designs that block a thread per I/O (inline,
    /// striped): at 100 µs each they would take seconds at the full count.
    pub io_msgs_blocking: usize,
    /// W3: the device's delay.
    pub io_delay: Duration,
    /// W4: round trips.
    pub rounds: usize,
    /// W5: keys, one message each.
    pub mem_keys: usize,
    /// W6: keys (few, so the queued messages, not the per-key state, dominate).
    pub overload_keys: usize,
    /// W6: messages.
    pub overload_msgs: usize,
    /// W6: handler CPU work (ns).
    pub overload_work_ns: u64,
    /// W8: messages, one per `idle_interval`.
    pub idle_msgs: usize,
    /// W8: the producer's interval.
    pub idle_interval: Duration,
    /// W9: messages per run (fast keys: `keys`, plus one slow key).
    pub slow_msgs: usize,
    /// W9: the open-loop producer's rate, messages per second.
    pub slow_rate: f64,
    /// W9: one message in `slow_every` goes to the slow key.
    pub slow_every: usize,
    /// W9: the slow key's CPU work per message (ns).
    pub slow_work_ns: u64,
    /// W9: the producer wakes on this tick and sends what is due.
    pub slow_tick: Duration,
    /// `--sweep`: W1 at each handler work (ns) with its message count,
    /// chosen so a cell takes ~0.2–1 s on 2 cores (the machine's limit is
    /// 2 ÷ work: 2 M msg/s at 1 µs, 0.2 M msg/s at 10 µs).
    pub sweep: [(u64, usize); 3],
    /// How long a run may take before its missing messages count as lost.
    pub timeout: Duration,
}

impl Sizes {
    /// The sizes.
    pub fn full() -> Self {
        Sizes {
            keys: 10_000,
            msgs: 2_000_000,
            work_ns: 50,
            poll: 256,
            io_keys: 10_000,
            io_msgs: 200_000,
            io_msgs_blocking: 4_000,
            io_delay: Duration::from_micros(100),
            rounds: 100_000,
            mem_keys: 1_000_000,
            overload_keys: 100,
            overload_msgs: 100_000,
            overload_work_ns: 2_000,
            idle_msgs: 1_000,
            idle_interval: Duration::from_millis(1),
            slow_msgs: 360_000,
            slow_rate: 180_000.0,
            slow_every: 200,
            slow_work_ns: 1_000_000,
            slow_tick: Duration::from_micros(50),
            sweep: [(50, 2_000_000), (1_000, 800_000), (10_000, 80_000)],
            timeout: Duration::from_secs(60),
        }
    }

    /// CI's smoke size: every workload and design in a few seconds.
    pub fn smoke() -> Self {
        Sizes {
            keys: 100,
            msgs: 20_000,
            io_keys: 100,
            io_msgs: 2_000,
            io_msgs_blocking: 200,
            rounds: 1_000,
            mem_keys: 10_000,
            overload_keys: 10,
            overload_msgs: 2_000,
            idle_msgs: 30,
            slow_msgs: 3_600,
            sweep: [(50, 20_000), (1_000, 4_000), (10_000, 400)],
            timeout: Duration::from_secs(30),
            ..Self::full()
        }
    }

    /// `KEYED_BENCH_SCALE` (a factor, default 1) applied to every count.
    pub fn scaled_from_env(self) -> Self {
        let f: f64 = std::env::var("KEYED_BENCH_SCALE")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1.0);
        if f == 1.0 {
            return self;
        }
        let s = |n: usize| ((n as f64 * f).round() as usize).max(2);
        Sizes {
            keys: s(self.keys),
            msgs: s(self.msgs),
            io_keys: s(self.io_keys),
            io_msgs: s(self.io_msgs),
            io_msgs_blocking: s(self.io_msgs_blocking),
            rounds: s(self.rounds),
            mem_keys: s(self.mem_keys),
            overload_keys: s(self.overload_keys),
            overload_msgs: s(self.overload_msgs),
            idle_msgs: s(self.idle_msgs),
            slow_msgs: s(self.slow_msgs),
            sweep: self.sweep.map(|(ns, n)| (ns, s(n))),
            ..self
        }
    }
}

/// A workload: the W1–W6 and W8, and the later W1b, W7 and W9.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Workload {
    /// Uniform keys, CPU handler.
    W1,
    /// As W1, the producer polling 256 records at a time (batched source).
    W1b,
    /// Half the messages to one key.
    W2,
    /// Handler awaits a ~100 µs device.
    W3,
    /// Two keys sending to each other.
    W4,
    /// One message to each of many keys: bytes per key.
    W5,
    /// Producer 10× faster than the handlers: peak memory.
    W6,
    /// Two producer threads, each with its own source and its own keys.
    W7,
    /// As W7 with four producers.
    W7b,
    /// One message per ms: CPU used.
    W8,
    /// One slow key among fast ones, open-loop producer: fast keys' latency.
    W9,
}

/// One column of a workload's table.
#[derive(Clone, Copy, Debug)]
pub struct Metric {
    /// Column header, with its unit.
    pub name: &'static str,
    /// Which way is better.
    pub higher_is_better: bool,
    /// The table prints the crate's ratio to every peer on this column.
    pub compare: bool,
}

/// A column.
const fn m(name: &'static str, higher_is_better: bool) -> Metric {
    Metric {
        name,
        higher_is_better,
        compare: false,
    }
}

/// A column with a "crate ÷ peer" line under the table.
const fn mc(name: &'static str, higher_is_better: bool) -> Metric {
    Metric {
        compare: true,
        ..m(name, higher_is_better)
    }
}

impl Workload {
    /// Every workload, in table order.
    pub const ALL: [Workload; 11] = [
        Workload::W1,
        Workload::W1b,
        Workload::W2,
        Workload::W3,
        Workload::W4,
        Workload::W5,
        Workload::W6,
        Workload::W7,
        Workload::W7b,
        Workload::W8,
        Workload::W9,
    ];

    /// `w1` … `w8`.
    pub fn id(self) -> &'static str {
        match self {
            Workload::W1 => "w1",
            Workload::W1b => "w1b",
            Workload::W2 => "w2",
            Workload::W3 => "w3",
            Workload::W4 => "w4",
            Workload::W5 => "w5",
            Workload::W6 => "w6",
            Workload::W7 => "w7",
            Workload::W7b => "w7b",
            Workload::W8 => "w8",
            Workload::W9 => "w9",
        }
    }

    /// The criterion group's name.
    pub fn group(self) -> &'static str {
        match self {
            Workload::W1 => "w1_uniform",
            Workload::W1b => "w1b_batched",
            Workload::W2 => "w2_hot_key",
            Workload::W3 => "w3_async_io",
            Workload::W4 => "w4_ping_pong",
            Workload::W5 => "w5_memory",
            Workload::W6 => "w6_overload",
            Workload::W7 => "w7_two_producers",
            Workload::W7b => "w7b_four_producers",
            Workload::W8 => "w8_idle",
            Workload::W9 => "w9_slow_key",
        }
    }

    /// A heading that states the sizes.
    pub fn title(self, s: &Sizes) -> String {
        match self {
            Workload::W1 => format!(
                "W1 uniform: {} keys, {} msgs round-robin, {} ns handler",
                s.keys, s.msgs, s.work_ns
            ),
            Workload::W1b => format!(
                "W1b batched source: {} keys, {} msgs round-robin, polled {} at a time and handed over per poll, {} ns handler",
                s.keys, s.msgs, s.poll, s.work_ns
            ),
            Workload::W2 => format!(
                "W2 hot key: {} keys, {} msgs, every other one to key 0, {} ns handler",
                s.keys, s.msgs, s.work_ns
            ),
            Workload::W3 => format!(
                "W3 async I/O: {} keys, {} msgs ({} for the thread-blocking designs), handler awaits a {:?} device",
                s.io_keys, s.io_msgs, s.io_msgs_blocking, s.io_delay
            ),
            Workload::W4 => format!("W4 ping-pong: 2 keys, {} round trips", s.rounds),
            Workload::W5 => format!(
                "W5 memory: {} keys, one message each (bytes requested from the allocator)",
                s.mem_keys
            ),
            Workload::W6 => format!(
                "W6 overload: {} keys, {} msgs, {} ns handler, producer paced at 2× and 10× the handlers' total rate",
                s.overload_keys, s.overload_msgs, s.overload_work_ns
            ),
            Workload::W7 | Workload::W7b => format!(
                "W7 {} producers: {} keys split into disjoint sets, {} msgs in total, each producer round-robin over its own keys with its own source, {} ns handler",
                self.producers(),
                s.keys,
                s.msgs,
                s.work_ns
            ),
            Workload::W8 => format!(
                "W8 idle: one message every {:?}, {} msgs; CPU of the design's threads (the producer's own excluded)",
                s.idle_interval, s.idle_msgs
            ),
            Workload::W9 => format!(
                "W9 slow key: {} fast keys ({} ns handler) and one slow key ({:?} of CPU per message, 1 in {} messages); open-loop producer paced at {} msg/s, {} msgs (~{:.1} s); latency = handler start − scheduled send, fast keys only, after a 10 % warm-up; baseline = the same schedule with the slow key's messages fast",
                s.keys,
                s.work_ns,
                Duration::from_nanos(s.slow_work_ns),
                s.slow_every,
                s.slow_rate,
                s.slow_msgs,
                s.slow_msgs as f64 / s.slow_rate
            ),
        }
    }

    /// Its columns.
    pub fn metrics(self) -> &'static [Metric] {
        const RATE: &[Metric] = &[mc("M msg/s", true)];
        // Process CPU over the timed part ÷ messages, raw and minus the
        // handler's calibrated work (see `throughput`).
        const RATE_CPU: &[Metric] = &[
            mc("M msg/s", true),
            m("CPU ns/msg", false),
            mc("overhead ns/msg", false),
        ];
        const RTT: &[Metric] = &[mc("µs per round trip", false)];
        const MEM: &[Metric] = &[
            mc("B/key while queued", false),
            m("B/key after completion", false),
            m("peak B/key", false),
        ];
        const OVERLOAD: &[Metric] = &[mc("peak KiB @2×", false), m("peak KiB @10×", false)];
        const CPU: &[Metric] = &[mc("CPU % of a core", false), m("CPU µs per msg", false)];
        // Baseline, then with the slow key; "send lag" is how late the
        // producer got to a send (a design that blocks it shows there).
        const SLOW: &[Metric] = &[
            m("base fast k msg/s", true),
            m("base p50 µs", false),
            m("base p99 µs", false),
            m("slow fast k msg/s", true),
            m("slow p50 µs", false),
            mc("slow p99 µs", false),
            mc("p99 slow÷base", false),
            m("slow send lag p99 µs", false),
        ];
        match self {
            Workload::W1 | Workload::W1b | Workload::W2 | Workload::W7 | Workload::W7b => RATE_CPU,
            Workload::W3 => RATE,
            Workload::W4 => RTT,
            Workload::W5 => MEM,
            Workload::W6 => OVERLOAD,
            Workload::W8 => CPU,
            Workload::W9 => SLOW,
        }
    }

    /// W7's producer threads.
    pub fn producers(self) -> usize {
        match self {
            Workload::W7b => 4,
            _ => 2,
        }
    }

    /// Elements per run, for criterion's throughput (messages or round trips).
    pub fn elements(self, s: &Sizes, blocking: bool) -> u64 {
        (match self {
            Workload::W1 | Workload::W1b | Workload::W2 | Workload::W7 | Workload::W7b => s.msgs,
            Workload::W3 if blocking => s.io_msgs_blocking,
            Workload::W3 => s.io_msgs,
            Workload::W4 => s.rounds,
            Workload::W5 => s.mem_keys,
            Workload::W6 => s.overload_msgs,
            Workload::W8 => s.idle_msgs,
            Workload::W9 => 2 * s.slow_msgs,
        }) as u64
    }

    /// keyed-executor's `max_in_flight` for this workload, per receiver
    /// (`KEYED_BENCH_CREDIT` overrides it for W1, W1b, W2, W3, W7 and W9).
    ///
    /// The throughput workloads use what a user would pick for them, not a
    /// value tuned to the harness. A sync handler holds its credit only while
    /// the message is queued or running (~50 ns of work), so the credit only
    /// has to cover the producer running ahead while a parked worker wakes
    /// (tens of µs): 1,024 messages, 4× the default, is ~50 µs of work per
    /// receiver. An async handler (W3) holds its credit for the whole ~100 µs
    /// I/O, so by Little's law the credit caps the rate at
    /// `max_in_flight / 100 µs`: 256 would cap it at 2.6 M msg/s, under
    /// tokio-actors' rate; 4,096 leaves room up to ~40 M msg/s.
    pub fn credit(self, s: &Sizes) -> usize {
        let env = || {
            std::env::var("KEYED_BENCH_CREDIT")
                .ok()
                .and_then(|v| v.parse().ok())
                .filter(|&c| c > 0)
        };
        match self {
            // W7: per source (each producer has its own receiver).
            // W9 too: its handlers are sync (its queues are short unless a
            // design lets the slow key hold the fast ones up).
            Workload::W1
            | Workload::W1b
            | Workload::W2
            | Workload::W7
            | Workload::W7b
            | Workload::W9 => env().unwrap_or(1024),
            Workload::W3 => env().unwrap_or(4096),
            Workload::W4 => 16,
            // Every key's message stays queued while memory is read.
            Workload::W5 => s.mem_keys + 1,
            // The crate's default: W6 shows that credit bounds memory.
            Workload::W6 | Workload::W8 => 256,
        }
    }
}

/// The designs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Producer calls the handler.
    Inline,
    /// Thread per stripe, crossbeam channels.
    Striped,
    /// Task per key on tokio.
    Tokio,
    /// Task per key on async-executor.
    Smol,
    /// The crate.
    Keyed,
    /// Diagnostic: striped plus the contract's per-message work (only when
    /// `KEYED_BENCH_DESIGNS` names it).
    Floor,
}

/// A design with its settings.
#[derive(Clone, Copy, Debug)]
pub struct Spec {
    /// Which design.
    pub kind: Kind,
    /// keyed-executor's spin.
    pub spin: Duration,
    /// keyed-executor's `max_in_flight` for this run (`--grid`,
    /// `--w3-curve`); `None`: the workload's ([`Workload::credit`]).
    pub credit: Option<usize>,
}

impl Spec {
    /// A design with the default settings.
    pub const fn of(kind: Kind) -> Self {
        Spec {
            kind,
            spin: Duration::ZERO,
            credit: None,
        }
    }

    /// The crate with this spin and, if given, this `max_in_flight`.
    pub const fn keyed(spin: Duration, credit: Option<usize>) -> Self {
        Spec {
            kind: Kind::Keyed,
            spin,
            credit,
        }
    }

    /// Its row label.
    pub fn name(&self) -> String {
        let base = match self.kind {
            Kind::Inline => "inline",
            Kind::Striped => "striped",
            Kind::Tokio => "tokio-actors",
            Kind::Smol => "smol-actors",
            Kind::Keyed => "keyed-executor",
            Kind::Floor => "contract-floor",
        };
        let mut settings = Vec::new();
        if !self.spin.is_zero() {
            settings.push(format!("spin {:?}", self.spin));
        }
        if let Some(c) = self.credit {
            settings.push(format!("max_in_flight {c}"));
        }
        if settings.is_empty() {
            base.to_string()
        } else {
            format!("{base} ({})", settings.join(", "))
        }
    }

    /// One of the crate's rows.
    pub fn is_crate(&self) -> bool {
        self.kind == Kind::Keyed
    }

    /// Blocks a thread per awaited I/O (runs W3's smaller count).
    pub fn blocks_on_io(&self) -> bool {
        matches!(self.kind, Kind::Inline | Kind::Striped | Kind::Floor)
    }
}

/// The designs compared on a workload, filtered by `KEYED_BENCH_DESIGNS`
/// (comma-separated substrings of the row labels).
pub fn designs(w: Workload) -> Vec<Spec> {
    #[allow(unused_mut)]
    let mut all = vec![
        Spec::of(Kind::Inline),
        Spec::of(Kind::Striped),
        Spec::of(Kind::Tokio),
        Spec::of(Kind::Smol),
    ];
    {
        all.push(Spec::of(Kind::Keyed));
        // The crate's default is `spin` 0; a second row shows the setting a
        // throughput-minded user would pick (it costs nothing at idle: W8).
        if matches!(
            w,
            Workload::W1
                | Workload::W1b
                | Workload::W2
                | Workload::W3
                | Workload::W4
                | Workload::W7
                | Workload::W7b
                | Workload::W8
                | Workload::W9
        ) {
            all.push(Spec::keyed(Duration::from_micros(50), None));
        }
    }
    let _ = w;
    if std::env::var("KEYED_BENCH_DESIGNS").is_ok_and(|f| f.contains("floor")) {
        all.push(Spec::of(Kind::Floor));
    }
    all.retain(|s| design_selected(&s.name()));
    all
}

/// Whether `KEYED_BENCH_DESIGNS` (comma-separated substrings of the row
/// labels, or `=label` for exactly one row; unset or empty: all) selects
/// the row `name`.
pub fn design_selected(name: &str) -> bool {
    match std::env::var("KEYED_BENCH_DESIGNS") {
        Ok(filter) if !filter.is_empty() => filter.split(',').map(str::trim).any(|f| {
            f.strip_prefix('=')
                .map_or_else(|| name.contains(f), |exact| name == exact)
        }),
        _ => true,
    }
}

/// Handler threads of every design: `KEYED_BENCH_WORKERS`, default 2.
pub fn workers() -> usize {
    std::env::var("KEYED_BENCH_WORKERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(2)
}

/// What one run measured.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// The timed part (criterion's measurement).
    pub elapsed: Duration,
    /// One value per [`Workload::metrics`] column.
    pub values: Vec<f64>,
}

/// Runs workload `w` once on design `spec`; `Err` if any message was
/// reordered, overlapped, duplicated or lost.
pub fn run(spec: Spec, w: Workload, sizes: &Sizes) -> Result<Outcome, String> {
    let cfg = Cfg {
        workers: workers(),
        spin: spec.spin,
        credit: spec.credit.unwrap_or_else(|| w.credit(sizes)),
    };
    match spec.kind {
        Kind::Inline => run_on::<InlineFamily>(w, &cfg, sizes),
        Kind::Striped => run_on::<StripedFamily>(w, &cfg, sizes),
        Kind::Tokio => run_on::<TokioFamily>(w, &cfg, sizes),
        Kind::Smol => run_on::<SmolFamily>(w, &cfg, sizes),
        Kind::Keyed => run_on::<super::keyed::KeyedFamily>(w, &cfg, sizes),
        Kind::Floor => run_on::<super::floor::FloorFamily>(w, &cfg, sizes),
    }
}

fn run_on<F: Family>(w: Workload, cfg: &Cfg, s: &Sizes) -> Result<Outcome, String> {
    match w {
        Workload::W1 => throughput::<F>(cfg, s, &Schedule::round_robin(s.msgs, s.keys)),
        Workload::W1b => batched::<F>(cfg, s),
        Workload::W2 => throughput::<F>(cfg, s, &Schedule::hot_key(s.msgs, s.keys)),
        Workload::W3 => async_io::<F>(cfg, s),
        Workload::W4 => ping_pong::<F>(cfg, s),
        Workload::W5 => memory::<F>(cfg, s),
        Workload::W6 => overload::<F>(cfg, s),
        Workload::W7 | Workload::W7b => multi_producer::<F>(cfg, s, w.producers()),
        Workload::W8 => idle::<F>(cfg, s),
        Workload::W9 => slow_key::<F>(cfg, s),
    }
}

fn start<F: Family, H: Handler>(cfg: &Cfg, h: H) -> F::D<H> {
    <F::D<H> as Design<H>>::start(cfg, h)
}

/// Waits until every key's last message has finished: the end of a timed
/// part. On timeout the design is left behind (a stuck design might never
/// stop) and the error says how many keys are missing.
fn drained<H: Handler, D: Design<H>>(
    d: D,
    checker: &Checker,
    timeout: Duration,
) -> Result<D, String> {
    if checker.wait(timeout) {
        Ok(d)
    } else {
        std::mem::forget(d);
        Err(format!(
            "timed out after {timeout:?}: {} keys never finished their last message (lost or stuck)",
            checker.remaining()
        ))
    }
}

/// Waits for the last messages, stops the design, recounts.
fn settle<H: Handler, D: Design<H>>(
    d: D,
    checker: &Checker,
    total: usize,
    timeout: Duration,
) -> Result<Duration, String> {
    let t = Instant::now();
    if !checker.wait(timeout) {
        // A stuck design might never stop: leave its threads behind.
        std::mem::forget(d);
        return Err(format!(
            "timed out after {timeout:?}: {} keys never finished their last message (lost or stuck)",
            checker.remaining()
        ));
    }
    let waited = t.elapsed();
    d.finish();
    checker.verify(total as u64)?;
    Ok(waited)
}

fn send_all<S: SendTo>(s: &S, sched: &Schedule) {
    for &(k, m) in &sched.msgs {
        s.send(k, m);
    }
}

/// The process's CPU time (every thread: producer, workers, runtime threads).
fn process_cpu() -> Duration {
    cpu_time(libc::CLOCK_PROCESS_CPUTIME_ID)
}

/// The columns of [`Workload::metrics`]'s `RATE_CPU`: M msg/s, CPU ns per
/// message, and that minus the handler's own work (`work_ns`, measured the
/// calibration's way just before the run): what the design costs per message, the producer's
/// send path and the harness's sequence checks included (the same checks
/// for every design; `inline`'s overhead is the harness's floor).
fn rate_cpu(msgs: usize, elapsed: Duration, cpu: Duration, work_ns: f64) -> Vec<f64> {
    let cpu_ns = cpu.as_nanos() as f64 / msgs as f64;
    vec![
        msgs as f64 / elapsed.as_secs_f64() / 1e6,
        cpu_ns,
        cpu_ns - work_ns,
    ]
}

fn throughput<F: Family>(cfg: &Cfg, s: &Sizes, sched: &Schedule) -> Result<Outcome, String> {
    let checker = Arc::new(sched.checker());
    let handler = CpuHandler {
        checker: checker.clone(),
        iters: iters_for(s.work_ns),
        gate: None,
    };
    let work_ns = work_ns_now(s.work_ns);
    let d = start::<F, _>(cfg, handler);
    let sender = d.sender();
    // The timed part, for the clock and the CPU alike: from the first send
    // to the last message done (schedule, design start and stop excluded).
    let cpu0 = process_cpu();
    let t = Instant::now();
    send_all(&sender, sched);
    drop(sender);
    let d = drained(d, &checker, s.timeout)?;
    let elapsed = t.elapsed();
    let cpu = process_cpu() - cpu0;
    settle(d, &checker, sched.msgs.len(), s.timeout)?;
    Ok(Outcome {
        elapsed,
        values: rate_cpu(sched.msgs.len(), elapsed, cpu, work_ns),
    })
}

/// W1b: W1's schedule cut into polls of `s.poll` messages (built before
/// the clock, as a consumer's poll hands over records it already holds),
/// each handed to the design with [`SendTo::send_batch`].
fn batched<F: Family>(cfg: &Cfg, s: &Sizes) -> Result<Outcome, String> {
    let sched = Schedule::round_robin(s.msgs, s.keys);
    let polls: Vec<Vec<(u64, Msg)>> = sched
        .msgs
        .chunks(s.poll.max(1))
        .map(<[_]>::to_vec)
        .collect();
    let checker = Arc::new(sched.checker());
    let handler = CpuHandler {
        checker: checker.clone(),
        iters: iters_for(s.work_ns),
        gate: None,
    };
    let work_ns = work_ns_now(s.work_ns);
    let d = start::<F, _>(cfg, handler);
    let sender = d.sender();
    let cpu0 = process_cpu();
    let t = Instant::now();
    for poll in polls {
        sender.send_batch(poll);
    }
    drop(sender);
    let d = drained(d, &checker, s.timeout)?;
    let elapsed = t.elapsed();
    let cpu = process_cpu() - cpu0;
    settle(d, &checker, sched.msgs.len(), s.timeout)?;
    Ok(Outcome {
        elapsed,
        values: rate_cpu(sched.msgs.len(), elapsed, cpu, work_ns),
    })
}

/// W1b's machine limit in M msg/s: every core running nothing but the
/// handler's work, `cores ÷ work_ns` (cores = `available_parallelism`).
pub fn machine_limit(s: &Sizes) -> (usize, f64, f64) {
    let cores = thread::available_parallelism().map_or(1, |n| n.get());
    let ns = work_ns(s.work_ns);
    (cores, ns, cores as f64 / ns * 1e3)
}

/// W7: `producers` threads, producer `p` sending round-robin to the keys
/// `k` with `k % producers == p` (its share of W1's schedule, in W1's
/// order), each through its own [`Design::source`]. Timed from the moment
/// every producer is released to the last message done.
fn multi_producer<F: Family>(cfg: &Cfg, s: &Sizes, producers: usize) -> Result<Outcome, String> {
    let sched = Schedule::round_robin(s.msgs, s.keys);
    let mut parts: Vec<Vec<(u64, Msg)>> = vec![Vec::new(); producers];
    for &(k, m) in &sched.msgs {
        parts[k as usize % producers].push((k, m));
    }
    let checker = Arc::new(sched.checker());
    let handler = CpuHandler {
        checker: checker.clone(),
        iters: iters_for(s.work_ns),
        gate: None,
    };
    let work_ns = work_ns_now(s.work_ns);
    let d = start::<F, _>(cfg, handler);
    // Two barriers: every producer is started and parked in the second one
    // when the clocks are read, and none has sent yet.
    let ready = Arc::new(Barrier::new(producers + 1));
    let go = Arc::new(Barrier::new(producers + 1));
    let threads: Vec<thread::JoinHandle<Vec<(u64, Msg)>>> = parts
        .into_iter()
        .enumerate()
        .map(|(p, part)| {
            let source = d.source();
            let (ready, go) = (ready.clone(), go.clone());
            thread::Builder::new()
                .name(format!("producer-{p}"))
                .spawn(move || {
                    ready.wait();
                    go.wait();
                    for &(k, m) in &part {
                        source.send(k, m);
                    }
                    drop(source);
                    // Freed by the main thread, after the timed part.
                    part
                })
                .expect("spawn a producer")
        })
        .collect();
    ready.wait();
    let cpu0 = process_cpu();
    let t = Instant::now();
    go.wait();
    // On timeout the producers may be stuck in a send: leave them behind.
    let d = drained(d, &checker, s.timeout)?;
    let elapsed = t.elapsed();
    let cpu = process_cpu() - cpu0;
    for t in threads {
        drop(t.join().map_err(|_| "a producer panicked".to_string())?);
    }
    settle(d, &checker, sched.msgs.len(), s.timeout)?;
    Ok(Outcome {
        elapsed,
        values: rate_cpu(sched.msgs.len(), elapsed, cpu, work_ns),
    })
}

/// The process's device thread, and a checker leaked once per size and
/// reused (W3's futures borrow both for `'static`, see [`IoHandler`]).
fn io_fixtures(keys: usize, active: usize) -> (&'static DeviceHandle, &'static Checker) {
    static DEVICE: OnceLock<(Device, DeviceHandle)> = OnceLock::new();
    static CHECKERS: Mutex<Vec<&'static Checker>> = Mutex::new(Vec::new());
    let (_, handle) = DEVICE.get_or_init(|| {
        let d = Device::start(Sizes::full().io_delay);
        let h = d.handle();
        (d, h)
    });
    let mut checkers = CHECKERS.lock().unwrap();
    let checker = match checkers.iter().find(|c| c.keys() == keys) {
        Some(c) => *c,
        None => {
            let c: &'static Checker = Box::leak(Box::new(Checker::new(keys, active)));
            checkers.push(c);
            c
        }
    };
    checker.reset(active);
    (handle, checker)
}

fn async_io<F: Family>(cfg: &Cfg, s: &Sizes) -> Result<Outcome, String> {
    let n = if F::BLOCKS_ON_IO {
        s.io_msgs_blocking
    } else {
        s.io_msgs
    };
    let sched = Schedule::round_robin(n, s.io_keys);
    let (device, checker) = io_fixtures(sched.keys, sched.active_keys);
    let d = start::<F, _>(cfg, IoHandler { checker, device });
    let sender = d.sender();
    let t = Instant::now();
    send_all(&sender, &sched);
    let sent = t.elapsed();
    drop(sender);
    let elapsed = sent + settle(d, checker, n, s.timeout)?;
    Ok(Outcome {
        elapsed,
        values: vec![n as f64 / elapsed.as_secs_f64() / 1e6],
    })
}

fn ping_pong<F: Family>(cfg: &Cfg, s: &Sizes) -> Result<Outcome, String> {
    // Two keys the striped design puts on different threads, so it hands off.
    let a = 0;
    let b = if cfg.workers < 2 {
        1
    } else {
        (1..)
            .find(|&k| stripe(k, cfg.workers) != stripe(a, cfg.workers))
            .unwrap()
    };
    let rounds = s.rounds as u32;
    let checker = Arc::new(Checker::new(b as usize + 1, 2));
    let send = Arc::new(OnceLock::new());
    let handler = PingHandler {
        checker: checker.clone(),
        a,
        b,
        rounds,
        send: send.clone(),
    };
    let d = start::<F, _>(cfg, handler);
    let _ = send.set(d.handler_sender());
    let sender = d.sender();
    let t = Instant::now();
    sender.send(
        a,
        Msg {
            seq: 0,
            last: rounds == 0,
        },
    );
    drop(sender);
    let elapsed = t.elapsed() + settle(d, &checker, 2 * s.rounds + 1, s.timeout)?;
    Ok(Outcome {
        elapsed,
        values: vec![elapsed.as_secs_f64() * 1e6 / s.rounds as f64],
    })
}

fn memory<F: Family>(cfg: &Cfg, s: &Sizes) -> Result<Outcome, String> {
    let sched = Schedule::round_robin(s.mem_keys, s.mem_keys);
    let checker = Arc::new(sched.checker());
    // `inline` runs the handler on the producer's thread: nothing can wait.
    let gate = (!F::SAME_THREAD).then(|| Arc::new(Gate::default()));
    alloc::start();
    let handler = CpuHandler {
        checker: checker.clone(),
        iters: 0,
        gate: gate.clone(),
    };
    let d = start::<F, _>(cfg, handler);
    let sender = d.sender();
    let base = alloc::net();
    let t = Instant::now();
    send_all(&sender, &sched);
    let queued = alloc::net() - base;
    if let Some(g) = &gate {
        g.open();
    }
    let ok = checker.wait(s.timeout);
    let elapsed = t.elapsed();
    // Let the design drop what it drops after the last message (idle mailboxes).
    thread::sleep(Duration::from_millis(50));
    let after = alloc::net() - base;
    let peak = alloc::peak() - base;
    alloc::stop();
    drop(sender);
    if ok {
        settle(d, &checker, s.mem_keys, s.timeout)?;
    } else {
        settle(d, &checker, s.mem_keys, Duration::ZERO)?;
    }
    let per_key = |b: isize| b as f64 / s.mem_keys as f64;
    Ok(Outcome {
        elapsed,
        values: vec![per_key(queued), per_key(after), per_key(peak)],
    })
}

/// One W6 run with the producer paced at `factor` × the handlers' total rate;
/// returns the peak bytes and the run's time.
fn overload_at<F: Family>(cfg: &Cfg, s: &Sizes, factor: u64) -> Result<(isize, Duration), String> {
    let sched = Schedule::round_robin(s.overload_msgs, s.overload_keys);
    let checker = Arc::new(sched.checker());
    let iters = iters_for(s.overload_work_ns);
    alloc::start();
    let handler = CpuHandler {
        checker: checker.clone(),
        iters,
        gate: None,
    };
    let d = start::<F, _>(cfg, handler);
    let sender = d.sender();
    let base = alloc::net();
    let interval_ns = s.overload_work_ns as f64 / (factor as f64 * cfg.workers as f64);
    let t = Instant::now();
    for (i, &(k, m)) in sched.msgs.iter().enumerate() {
        let due = Duration::from_nanos((i as f64 * interval_ns) as u64);
        while t.elapsed() < due {
            std::hint::spin_loop();
        }
        sender.send(k, m);
    }
    drop(sender);
    let ok = checker.wait(s.timeout);
    let elapsed = t.elapsed();
    let peak = alloc::peak() - base;
    alloc::stop();
    settle(
        d,
        &checker,
        s.overload_msgs,
        if ok { s.timeout } else { Duration::ZERO },
    )?;
    Ok((peak, elapsed))
}

fn overload<F: Family>(cfg: &Cfg, s: &Sizes) -> Result<Outcome, String> {
    let (peak2, t2) = overload_at::<F>(cfg, s, 2)?;
    let (peak10, t10) = overload_at::<F>(cfg, s, 10)?;
    Ok(Outcome {
        elapsed: t2 + t10,
        values: vec![peak2 as f64 / 1024.0, peak10 as f64 / 1024.0],
    })
}

fn cpu_time(clock: libc::clockid_t) -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the clock ids used are
    // the process and thread CPU clocks, which always exist on Linux.
    let rc = unsafe { libc::clock_gettime(clock, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime");
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

fn idle<F: Family>(cfg: &Cfg, s: &Sizes) -> Result<Outcome, String> {
    let sched = Schedule::round_robin(s.idle_msgs, 16.min(s.idle_msgs));
    let checker = Arc::new(sched.checker());
    let handler = CpuHandler {
        checker: checker.clone(),
        iters: 0,
        gate: None,
    };
    let d = start::<F, _>(cfg, handler);
    let sender = d.sender();
    thread::sleep(Duration::from_millis(50));
    let process0 = cpu_time(libc::CLOCK_PROCESS_CPUTIME_ID);
    let own0 = cpu_time(libc::CLOCK_THREAD_CPUTIME_ID);
    let t = Instant::now();
    for (i, &(k, m)) in sched.msgs.iter().enumerate() {
        let due = s.idle_interval * i as u32;
        let now = t.elapsed();
        if due > now {
            thread::sleep(due - now);
        }
        sender.send(k, m);
    }
    let ok = checker.wait(s.timeout);
    let wall = t.elapsed();
    let own = cpu_time(libc::CLOCK_THREAD_CPUTIME_ID) - own0;
    let cpu = (cpu_time(libc::CLOCK_PROCESS_CPUTIME_ID) - process0).saturating_sub(own);
    drop(sender);
    settle(
        d,
        &checker,
        s.idle_msgs,
        if ok { s.timeout } else { Duration::ZERO },
    )?;
    Ok(Outcome {
        elapsed: wall,
        values: vec![
            cpu.as_secs_f64() / wall.as_secs_f64() * 100.0,
            cpu.as_secs_f64() * 1e6 / s.idle_msgs as f64,
        ],
    })
}

/// W9's schedule: message `i` goes to the slow key (`s.keys`) when
/// `i % slow_every == slow_every - 1`, else round-robin over the fast keys.
fn slow_schedule(s: &Sizes) -> Schedule {
    let every = s.slow_every.max(2);
    let mut fast = 0usize;
    let ks = (0..s.slow_msgs)
        .map(|i| {
            if i % every == every - 1 {
                s.keys as u64
            } else {
                fast += 1;
                ((fast - 1) % s.keys) as u64
            }
        })
        .collect();
    Schedule::from_keys(ks, s.keys + 1)
}

/// One W9 run.
struct Paced {
    /// Fast messages ÷ (first send → last fast message done), k msg/s.
    fast_rate: f64,
    /// Fast keys' latency percentiles after the warm-up, µs.
    p50: f64,
    p99: f64,
    /// The producer's lateness at each send after the warm-up, 99th
    /// percentile, µs.
    lag99: f64,
    /// First send → every message done.
    elapsed: Duration,
}

/// One W9 run: the open-loop producer schedules message `i` at `t0 + i /
/// rate` and sends it then or, when it is late, at once, whatever the design
/// does, so a design that holds a fast key up, or blocks the producer, shows
/// as latency from the scheduled send. It wakes on absolute ticks of
/// `s.slow_tick` (50 µs; timer slack 1 ns) and sends everything due: a
/// sleep per message (every 5.5 µs) cost this 2-core VM half a core of
/// kernel time by itself and saturated it once the designs' wake-ups were
/// added, which showed as milliseconds of latency in every baseline. The
/// tick is the latency's floor (tens of µs), the same for every design and
/// in both runs. `slow`: the slow key's messages burn `slow_work_ns`;
/// otherwise they are as fast as the rest (the baseline).
fn paced<F: Family>(cfg: &Cfg, s: &Sizes, sched: &Schedule, slow: bool) -> Result<Paced, String> {
    let slow_key = s.keys as u64;
    let checker = Arc::new(sched.checker());
    let recorder = Arc::new(Recorder::new(sched));
    let iters = iters_for(s.work_ns);
    let handler = SlowKeyHandler {
        checker: checker.clone(),
        recorder: recorder.clone(),
        iters,
        slow_key,
        slow_iters: if slow {
            iters_for(s.slow_work_ns)
        } else {
            iters
        },
    };
    let n = sched.msgs.len();
    let interval = 1e9 / s.slow_rate;
    let tick = (s.slow_tick.as_nanos() as u64).max(1);
    // Not zero, so its pages are touched before the clock starts.
    let mut lag = vec![u64::MAX; n];
    let d = start::<F, _>(cfg, handler);
    let sender = d.sender();
    let slack = TimerSlack::set(1);
    let t0 = recorder.now();
    let due = |i: usize| t0 + (i as f64 * interval) as u64;
    let mut i = 0;
    while i < n {
        let now = recorder.now();
        let at = due(i);
        if at > now {
            // The next tick, or the next message if it is due later.
            let next_tick = t0 + (now - t0) / tick * tick + tick;
            thread::sleep(Duration::from_nanos(next_tick.max(at) - now));
            continue;
        }
        let (k, m) = sched.msgs[i];
        sender.send(k, m);
        lag[i] = now - at;
        i += 1;
    }
    drop(slack);
    drop(sender);
    let d = drained(d, &checker, s.timeout)?;
    let elapsed = Duration::from_nanos(recorder.now() - t0);
    settle(d, &checker, n, s.timeout)?;
    // Everything below is after the run. The percentiles leave out the
    // warm-up (the first 10 % of the schedule, each key's first ~3
    // messages), where the actor peers spawn a task per key: on its own it
    // set their baseline p99.
    let warm = n / 10;
    let mut lat = Vec::with_capacity(n);
    let (mut fast, mut last_fast_done) = (0usize, t0);
    for (i, &(k, m)) in sched.msgs.iter().enumerate() {
        if k == slow_key {
            continue;
        }
        fast += 1;
        if i >= warm {
            lat.push(recorder.start_of(k, m.seq).saturating_sub(due(i)));
        }
        if m.last {
            last_fast_done = last_fast_done.max(recorder.end_of(k));
        }
    }
    lat.sort_unstable();
    let mut lag = lag.split_off(warm);
    lag.sort_unstable();
    let us = |ns: u64| ns as f64 / 1e3;
    Ok(Paced {
        fast_rate: fast as f64 / ((last_fast_done - t0).max(1) as f64 / 1e9) / 1e3,
        p50: us(percentile(&lat, 50.0)),
        p99: us(percentile(&lat, 99.0)),
        lag99: us(percentile(&lag, 99.0)),
        elapsed,
    })
}

/// W9: the baseline run, then the slow-key run, on the same schedule.
fn slow_key<F: Family>(cfg: &Cfg, s: &Sizes) -> Result<Outcome, String> {
    let sched = slow_schedule(s);
    // Calibrated outside the runs (the 1 ms work takes a few ms to calibrate).
    iters_for(s.slow_work_ns);
    let base = paced::<F>(cfg, s, &sched, false)?;
    let slow = paced::<F>(cfg, s, &sched, true)?;
    Ok(Outcome {
        elapsed: base.elapsed + slow.elapsed,
        values: vec![
            base.fast_rate,
            base.p50,
            base.p99,
            slow.fast_rate,
            slow.p50,
            slow.p99,
            slow.p99 / base.p99.max(1e-3),
            slow.lag99,
        ],
    })
}

/// The open-loop latency row's columns (`--latency`).
pub const OPEN_LOOP_METRICS: &[Metric] = &[
    m("p50 µs", false),
    mc("p99 µs", false),
    m("p99.9 µs", false),
    m("max µs", false),
    m("send lag p99 µs", false),
];

/// The open-loop latency row on design `spec`: W1's schedule (its keys,
/// messages and handler work) sent at `rate` messages per second, see
/// [`open_loop`]. `Err` if any message was reordered, overlapped,
/// duplicated or lost.
pub fn run_open_loop(spec: Spec, sizes: &Sizes, rate: f64) -> Result<Outcome, String> {
    let cfg = Cfg {
        workers: workers(),
        spin: spec.spin,
        credit: spec.credit.unwrap_or_else(|| Workload::W1.credit(sizes)),
    };
    match spec.kind {
        Kind::Inline => open_loop::<InlineFamily>(&cfg, sizes, rate),
        Kind::Striped => open_loop::<StripedFamily>(&cfg, sizes, rate),
        Kind::Tokio => open_loop::<TokioFamily>(&cfg, sizes, rate),
        Kind::Smol => open_loop::<SmolFamily>(&cfg, sizes, rate),
        Kind::Keyed => open_loop::<super::keyed::KeyedFamily>(&cfg, sizes, rate),
        Kind::Floor => open_loop::<super::floor::FloorFamily>(&cfg, sizes, rate),
    }
}

/// One open-loop run: message `i` of W1's schedule is due at `t0 + i /
/// rate`, fixed before the run. The producer sends each message when it is
/// due or, if it is late (the design blocked it, or it lost its core), at
/// once, whatever the design does; it never waits for the design to catch
/// up. Latency = the handler's done stamp − the message's *scheduled* send
/// time, so the producer's lateness counts too; the send lag (actual send −
/// scheduled) is reported on its own. While no message is due the producer
/// yields its core (`sched_yield`) rather than spin, so a worker sharing
/// its core runs; at the rates used (millions per second) the next message
/// is due within a microsecond, so a sleep would overshoot every time.
/// The first 10 % of the schedule (at W1's sizes, each key's first 20
/// messages: the actor peers spawn a task per key, the crate makes a
/// mailbox) is left out of the percentiles.
fn open_loop<F: Family>(cfg: &Cfg, s: &Sizes, rate: f64) -> Result<Outcome, String> {
    let sched = Schedule::round_robin(s.msgs, s.keys);
    let checker = Arc::new(sched.checker());
    let done = Arc::new(Stamps::new(&sched, Instant::now()));
    let handler = DoneHandler {
        checker: checker.clone(),
        done: done.clone(),
        iters: iters_for(s.work_ns),
    };
    let n = sched.msgs.len();
    let interval = 1e9 / rate;
    // Not zero, so its pages are touched before the clock starts.
    let mut sent = vec![u64::MAX; n];
    let d = start::<F, _>(cfg, handler);
    let sender = d.sender();
    let t0 = done.now();
    let due = |i: usize| t0 + (i as f64 * interval) as u64;
    let mut i = 0;
    while i < n {
        let now = done.now();
        if now < due(i) {
            thread::yield_now();
            continue;
        }
        let (k, m) = sched.msgs[i];
        sent[i] = now;
        sender.send(k, m);
        i += 1;
    }
    drop(sender);
    let d = drained(d, &checker, s.timeout)?;
    let elapsed = Duration::from_nanos(done.now() - t0);
    settle(d, &checker, n, s.timeout)?;
    // Everything below is after the run.
    let warm = n / 10;
    let mut lat: Vec<u64> = sched.msgs[warm..]
        .iter()
        .enumerate()
        .map(|(j, &(k, m))| done.get(k, m.seq).saturating_sub(due(warm + j)))
        .collect();
    lat.sort_unstable();
    let mut lag: Vec<u64> = (warm..n).map(|i| sent[i] - due(i)).collect();
    lag.sort_unstable();
    let us = |ns: u64| ns as f64 / 1e3;
    Ok(Outcome {
        elapsed,
        values: vec![
            us(percentile(&lat, 50.0)),
            us(percentile(&lat, 99.0)),
            us(percentile(&lat, 99.9)),
            us(lat.last().copied().unwrap_or(0)),
            us(percentile(&lag, 99.0)),
        ],
    })
}
