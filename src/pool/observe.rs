//! What the executor tells about itself beyond its counters: each
//! dispatcher's name, and the report of slow steps.
//!
//! # Names
//!
//! Every dispatcher has an [`Identity`]: a number (per executor, from 1),
//! a name (`DispatcherBuilder::name`, default `dispatcher-{number}`) and its
//! metrics handles (`crate::metrics`, zero-sized without the `metrics`
//! feature). The name labels its metrics series, its tracing events and its
//! entries in `stats()`.
//!
//! # Slow steps
//!
//! Only when `Builder::slow_step(threshold)` is set. A *step* is one call of
//! a handler with the first poll of its future (and the delivery of its
//! outcome if that poll finished it), or one later poll of a suspended
//! future. Each worker publishes the step it runs on its own cache line, a
//! [`StepBoard`], with a seqlock:
//!
//! - `seq` is odd while a step runs and even between steps; only the worker
//!   writes it, the other fields and `seq` alike.
//! - begin: release fence, store `started` (the clock, in nanoseconds since
//!   the executor's epoch), `dispatcher`, `key_hash` (relaxed), then `seq =
//!   2k + 1` (release). End: `seq = 2k + 2` (release).
//! - a reader loads `seq` (acquire), the fields (relaxed), an acquire fence
//!   and `seq` again; the fields belong to step `k` iff both loads read the
//!   same odd value (the worker's release fence before it overwrites the
//!   fields orders its previous `seq` store before them).
//!
//! The worker reads the clock once per step: the reading at a step's end is
//! also the start of its next step, unless the worker went idle or polled a
//! spawned future in between (then the next step reads afresh). A step
//! therefore includes the little bookkeeping of the worker before it.
//!
//! Who reports a step that overran (`now - started > threshold`): the worker
//! when the step ends, another worker when it runs out of work, or a
//! `stats()` caller — whoever comes first. Each claims the report with one
//! `fetch_max` of the step's `seq` on the board's `reported` word, so a step
//! is reported exactly once. There is no timer thread: a step that never
//! ends, on an executor whose other workers are asleep and whose stats
//! nobody reads, is not reported until someone looks.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;

use crate::pool::shared::{Shared, StopTarget};
use crate::pool::stats::{CurrentStep, SlowStep};
use crate::pool::worker::WorkerCx;
use crate::sync::atomic::{fence, AtomicU64, Ordering::*};
use crate::trace;

/// A dispatcher's number, name and metrics handles.
pub(crate) struct Identity {
    pub(crate) id: u64,
    pub(crate) name: Box<str>,
    pub(crate) metrics: crate::pool::metrics::DispatcherMetrics,
}

impl Identity {
    pub(crate) fn new(id: u64, name: Option<String>) -> Self {
        let name = name.unwrap_or_else(|| format!("dispatcher-{id}"));
        Identity {
            id,
            metrics: crate::pool::metrics::DispatcherMetrics::new(&name),
            name: name.into_boxed_str(),
        }
    }
}

/// One worker's published step (see the module docs).
#[derive(Default)]
pub(crate) struct StepBoard {
    seq: AtomicU64,
    started: AtomicU64,
    dispatcher: AtomicU64,
    key_hash: AtomicU64,
    /// The highest `seq` whose step was reported.
    reported: AtomicU64,
}

/// A consistent read of a running step.
struct BoardStep {
    seq: u64,
    started: u64,
    dispatcher: u64,
    key_hash: u64,
}

impl StepBoard {
    fn read(&self) -> Option<BoardStep> {
        let seq = self.seq.load(Acquire);
        if seq & 1 == 0 {
            return None;
        }
        let started = self.started.load(Relaxed);
        let dispatcher = self.dispatcher.load(Relaxed);
        let key_hash = self.key_hash.load(Relaxed);
        fence(Acquire);
        (self.seq.load(Relaxed) == seq).then_some(BoardStep {
            seq,
            started,
            dispatcher,
            key_hash,
        })
    }

    /// Claims the report of step `seq`: true exactly once per step.
    fn claim(&self, seq: u64) -> bool {
        self.reported.load(Relaxed) < seq && self.reported.fetch_max(seq, AcqRel) < seq
    }
}

/// The executor's side of the slow-step report: the clock's epoch, the threshold and
/// one board per worker (none without a threshold).
pub(crate) struct SlowSteps {
    epoch: Instant,
    /// The threshold in nanoseconds; 0 = no report.
    threshold: u64,
    boards: Box<[CachePadded<StepBoard>]>,
}

impl SlowSteps {
    pub(crate) fn new(threshold: Option<Duration>, workers: usize) -> Self {
        let threshold = threshold.map_or(0, |t| u64::try_from(t.as_nanos()).unwrap_or(u64::MAX));
        let boards = if threshold == 0 { 0 } else { workers };
        SlowSteps {
            epoch: Instant::now(),
            threshold,
            boards: (0..boards).map(|_| CachePadded::default()).collect(),
        }
    }

    /// Nanoseconds since the epoch, never 0 (0 means "not measured").
    #[inline]
    pub(crate) fn now(&self) -> u64 {
        (self.epoch.elapsed().as_nanos() as u64).max(1)
    }

    /// The epoch the nanosecond readings count from.
    pub(crate) fn epoch(&self) -> Instant {
        self.epoch
    }

    fn on(&self) -> bool {
        self.threshold != 0
    }

    /// Worker `worker`'s running step, for `stats()`; reports it if it
    /// overran (the caller holds no lock: the hook may run).
    pub(crate) fn current_step(
        &self,
        shared: &Shared,
        worker: usize,
        targets: &[Box<dyn StopTarget>],
    ) -> Option<CurrentStep> {
        let board = self.boards.get(worker)?;
        let step = board.read()?;
        let running = self.now().saturating_sub(step.started);
        let target = targets.iter().find(|t| t.ident().id == step.dispatcher);
        if running > self.threshold && board.claim(step.seq) {
            report(
                shared,
                target.map(|t| t.ident()),
                worker,
                step.key_hash,
                running,
                false,
            );
        }
        Some(CurrentStep {
            dispatcher: target.map_or_else(|| "?".to_owned(), |t| t.ident().name.to_string()),
            key_hash: step.key_hash,
            running_for: Duration::from_nanos(running),
        })
    }

    /// A worker ran out of work at `now`: report the other workers' steps
    /// that overran.
    fn check_others(&self, shared: &Shared, me: usize, now: u64) {
        for (worker, board) in self.boards.iter().enumerate() {
            if worker == me {
                continue;
            }
            let Some(step) = board.read() else { continue };
            let running = now.saturating_sub(step.started);
            if running > self.threshold && board.claim(step.seq) {
                let targets = shared.targets();
                let target = targets.iter().find(|t| t.ident().id == step.dispatcher);
                report(
                    shared,
                    target.map(|t| t.ident()),
                    worker,
                    step.key_hash,
                    running,
                    false,
                );
            }
        }
    }
}

/// Reports a slow step: the dispatcher's counter, a WARN event, the hook.
#[cold]
fn report(
    shared: &Shared,
    ident: Option<&Identity>,
    worker: usize,
    key_hash: u64,
    running: u64,
    finished: bool,
) {
    let running_for = Duration::from_nanos(running);
    let name = ident.map_or("?", |i| &i.name);
    if let Some(i) = ident {
        i.metrics.slow_step();
    }
    trace::slow_step(name, key_hash, worker, running_for, finished);
    if let Some(hook) = &shared.config.on_slow_step {
        let step = SlowStep {
            dispatcher: name.to_owned(),
            key_hash,
            worker,
            running_for,
            finished,
        };
        // User code: a panic in it must not take the worker (or the
        // `stats()` caller) down.
        let _ = catch_unwind(AssertUnwindSafe(|| hook(&step)));
    }
}

/// A worker's side of the slow-step report (in its `WorkerCx`; only its
/// thread).
pub(crate) struct StepLocal {
    /// A threshold is set.
    on: bool,
    /// The reading that ended the previous step, reused as the next
    /// step's start (0: read afresh).
    last: std::cell::Cell<u64>,
    /// This worker's `seq` (see `StepBoard`).
    seq: std::cell::Cell<u64>,
}

impl StepLocal {
    pub(crate) fn new(slow: &SlowSteps) -> Self {
        StepLocal {
            on: slow.on(),
            last: std::cell::Cell::new(0),
            seq: std::cell::Cell::new(0),
        }
    }
}

/// A step under way: when it started (0: not measured).
#[must_use]
#[derive(Clone, Copy)]
pub(crate) struct StepToken {
    started: u64,
}

impl StepToken {
    /// A step that is not measured.
    pub(crate) const NONE: StepToken = StepToken { started: 0 };

    /// When the step started, in nanoseconds since the epoch; 0 if it is
    /// not measured.
    #[inline]
    pub(crate) fn started(self) -> u64 {
        self.started
    }
}

impl WorkerCx<'_> {
    /// Whether this worker times its steps (a slow-step threshold is set).
    #[inline]
    pub(crate) fn times_steps(&self) -> bool {
        self.slow_steps.on
    }

    /// A step of `ident`'s handler for the key with `key_hash` begins.
    /// `timed`: the metrics want its start and end (a sampled message).
    #[inline]
    pub(crate) fn step_begin(&self, ident: &Identity, key_hash: u64, timed: bool) -> StepToken {
        if !self.slow_steps.on && !timed {
            return StepToken { started: 0 };
        }
        self.step_begin_measured(ident, key_hash)
    }

    fn step_begin_measured(&self, ident: &Identity, key_hash: u64) -> StepToken {
        let slow = &self.shared.slow_steps;
        if !self.slow_steps.on {
            return StepToken {
                started: slow.now(),
            };
        }
        let started = match self.slow_steps.last.replace(0) {
            0 => slow.now(),
            t => t,
        };
        let seq = self.slow_steps.seq.get() + 1;
        self.slow_steps.seq.set(seq);
        let board = &slow.boards[self.index];
        // Orders the previous step's `seq` store before the fields' stores
        // (see the module docs).
        fence(Release);
        board.started.store(started, Relaxed);
        board.dispatcher.store(ident.id, Relaxed);
        board.key_hash.store(key_hash, Relaxed);
        board.seq.store(seq, Release);
        StepToken { started }
    }

    /// The step ended; returns the reading that ended it (0 if it was not
    /// measured), after reporting it if it overran.
    #[inline]
    pub(crate) fn step_end(&self, ident: &Identity, key_hash: u64, step: StepToken) -> u64 {
        if step.started == 0 {
            return 0;
        }
        self.step_end_measured(ident, key_hash, step)
    }

    fn step_end_measured(&self, ident: &Identity, key_hash: u64, step: StepToken) -> u64 {
        let slow = &self.shared.slow_steps;
        let now = slow.now();
        if !self.slow_steps.on {
            return now;
        }
        let seq = self.slow_steps.seq.get();
        let board = &slow.boards[self.index];
        board.seq.store(seq + 1, Release);
        self.slow_steps.seq.set(seq + 1);
        self.slow_steps.last.set(now);
        let ran = now.saturating_sub(step.started);
        if ran > slow.threshold && board.claim(seq) {
            report(self.shared, Some(ident), self.index, key_hash, ran, true);
        }
        now
    }

    /// The worker did something that is not a step (polled a spawned
    /// future): the next step reads the clock afresh.
    #[inline]
    pub(crate) fn step_break(&self) {
        if self.slow_steps.on {
            self.slow_steps.last.set(0);
        }
    }

    /// The worker ran out of work at `idle_since`: the next step reads the
    /// clock afresh, and the other workers' overrunning steps are reported.
    #[inline]
    pub(crate) fn step_idle(&self, idle_since: Instant) {
        if self.slow_steps.on {
            self.slow_steps.last.set(0);
            let slow = &self.shared.slow_steps;
            let now = (idle_since.saturating_duration_since(slow.epoch).as_nanos() as u64).max(1);
            slow.check_others(self.shared, self.index, now);
        }
    }
}
