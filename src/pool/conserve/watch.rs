//! Watch: look at another worker's step, and decide whether it is stuck.

use crate::pool::shared::Shared;
use crate::pool::worker::{Worker, WorkerCx};
#[cfg(not(loom))]
use crate::sync::atomic::AtomicU64;
use crate::sync::atomic::{AtomicBool, Ordering::*};

/// How long (µs) one step must have been seen running before its worker
/// counts as stuck in it: from the first watch of the step (by a pusher
/// that queued work behind it, or an idle worker) to a later one. A time,
/// not a number of watches: a burst of wake-ups behind one short step (a
/// device completing many futures at once) is many watches within a
/// microsecond, and would call a step of a few µs stuck.
#[cfg(not(loom))]
pub(crate) const STUCK_AFTER_US: u32 = 50;

/// What a watch of a worker found (see [`Worker::watch`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Sighting {
    /// Not running a step (idle, parked, exited).
    NotRunning,
    /// Running a step seen for less than [`STUCK_AFTER_US`]: whoever
    /// queued work behind it must see that someone watches again later
    /// (`Shared::call_watcher`). Never under loom.
    #[cfg_attr(loom, allow(dead_code))]
    Fresh,
    /// Stuck: the same step, seen at least [`STUCK_AFTER_US`] ago.
    Stuck,
}

/// The part of a worker other threads write: sightings and calls.
pub(crate) struct Watched {
    /// The step last seen (low 32 bits) and when it was first seen (µs
    /// since the executor's epoch, high 32 bits).
    #[cfg(not(loom))]
    pub(crate) seen: AtomicU64,
    /// The worker sleeps, or is about to, without a timeout and has not
    /// been called since (see "Why no wake-up is lost" in `mod.rs`). Set by the
    /// worker, counted in `Shared`'s sleepers; cleared (and uncounted)
    /// by whoever swaps it back: the worker when it wakes, or the caller
    /// that calls it (so that one call is enough for every submitter).
    pub(crate) sleeper: AtomicBool,
    /// Another thread asked this (idle) worker to watch for a stuck one.
    pub(crate) call: AtomicBool,
    /// When a thief was last called for this worker (µs since the
    /// executor's epoch, low 32 bits) and for which step (high 32 bits).
    #[cfg(not(loom))]
    pub(crate) called: AtomicU64,
    /// The worker is idle (see `Shared::idle`): out of work, looking for
    /// some, spinning or parked. Written by the worker (SeqCst).
    pub(crate) idle: AtomicBool,
}

impl Worker {
    /// Whether this worker counts as stuck in the step it runs: `RUNNING`,
    /// and the same step seen at least [`STUCK_AFTER_US`] before this watch
    /// (`now`: µs since the executor's epoch, read only if the worker runs
    /// a step). A watch a step not seen before records it as first seen
    /// now. A worker that makes progress moves `steps` on and is never
    /// stuck, however busy.
    /// Sightings race (relaxed, last writer wins): a lost one only delays
    /// the verdict, by at most one more watch.
    pub(crate) fn watch(&self, now: impl FnOnce() -> u32) -> Sighting {
        if self.state.load(SeqCst) != Worker::RUNNING || self.watched.idle.load(SeqCst) {
            return Sighting::NotRunning;
        }
        #[cfg(loom)]
        {
            // Under loom every running worker counts as stuck, so that the
            // models explore a steal wherever one can happen.
            let _ = now;
            Sighting::Stuck
        }
        #[cfg(not(loom))]
        {
            let step = self.steps.load(Relaxed);
            let seen = self.watched.seen.load(Relaxed);
            if seen as u32 == step {
                let first = (seen >> 32) as u32;
                return if now().wrapping_sub(first) >= STUCK_AFTER_US {
                    Sighting::Stuck
                } else {
                    Sighting::Fresh
                };
            }
            self.watched
                .seen
                .store(u64::from(step) | (u64::from(now()) << 32), Relaxed);
            Sighting::Fresh
        }
    }

    /// Whether it runs a step: `RUNNING` and not idle (an idle worker takes
    /// what is queued on it by itself).
    #[inline]
    pub(crate) fn runs_a_step(&self) -> bool {
        self.state.load(SeqCst) == Worker::RUNNING && !self.watched.idle.load(SeqCst)
    }

    /// Whether it counts as idle (see `Watched::idle`).
    #[inline]
    pub(crate) fn is_idle(&self) -> bool {
        self.watched.idle.load(SeqCst)
    }

    /// Marks it idle or not (its own thread; see `Shared::idle`).
    pub(crate) fn set_idle(&self, idle: bool) {
        self.watched.idle.store(idle, SeqCst);
    }

    /// Whether it runs a step with work waiting behind it (its queue, or
    /// the rest of a port's inbox during a port's turn).
    pub(crate) fn busy_with_backlog(&self) -> bool {
        self.state.load(Relaxed) == Worker::RUNNING && self.queued() > 0
    }

    /// Whether it runs, spins or has work queued: a step it runs or starts
    /// may get stuck (what a worker about to park checks before it sleeps;
    /// see "Why no wake-up is lost" in `mod.rs`). A parked worker with nothing queued is
    /// woken by whoever queues it work, after that push.
    pub(crate) fn active(&self) -> bool {
        !matches!(self.state.load(SeqCst), Worker::PARKED | Worker::EXITED)
            || !self.queue.is_empty()
            || self.local_len.load(Relaxed) != 0
    }
}

impl Shared {
    /// Whether some worker spins or parks.
    #[inline]
    pub(crate) fn any_idle(&self) -> bool {
        self.idle.count.load(Relaxed) != 0
    }

    /// Whether some dispatcher's port is queued or running (not idle): its
    /// turn may get stuck with deliveries behind it.
    pub(crate) fn any_port_busy(&self) -> bool {
        self.registry
            .lock()
            .targets
            .iter()
            .any(|t| t.any_port_busy())
    }

    /// Microseconds since the executor's epoch (wrapping): the clock of
    /// stuck verdicts and thief calls.
    #[inline]
    pub(crate) fn now_us(&self) -> u32 {
        #[cfg(not(loom))]
        return self.slow_steps.epoch().elapsed().as_micros() as u32;
        #[cfg(loom)]
        0
    }
}

impl WorkerCx<'_> {
    /// Whether another worker runs a step with work waiting behind it: then
    /// this one watches closely (`WATCH_PARK`).
    pub(crate) fn watch_others(&self) -> bool {
        let workers = &self.shared.workers;
        workers
            .iter()
            .enumerate()
            .any(|(i, w)| i != self.index && w.busy_with_backlog())
    }
}
