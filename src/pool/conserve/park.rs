//! The parker's side: an idle worker counts itself idle, and parks
//! watching, or as a sleeper when nothing is active (see `mod.rs`).

use std::time::Duration;

use crossbeam_utils::CachePadded;

use crate::pool::shared::Shared;
use crate::pool::worker::{park_until_woken, Worker, WorkerCx};
use crate::sync::atomic::{fence, AtomicUsize, Ordering::*};
use crate::sync::thread;

/// A worker counted idle (see [`Shared::idle`]).
pub(crate) struct IdleGuard<'a>(&'a Shared, usize);

impl Drop for IdleGuard<'_> {
    fn drop(&mut self) {
        self.0.idle.count.fetch_sub(1, SeqCst);
        self.0.workers[self.1].set_idle(false);
    }
}

/// A worker counted among those asleep without a timeout (see
/// [`Shared::count_sleeper`]).
pub(crate) struct SleeperGuard<'a>(&'a Shared, usize);

impl Drop for SleeperGuard<'_> {
    fn drop(&mut self) {
        // Unless a caller uncounted it already (`call_watcher`).
        if self.0.workers[self.1].clear_sleeper() {
            self.0.idle.sleepers.fetch_sub(1, SeqCst);
        }
    }
}

/// The idle workers, on one line that submitters read (and only idle
/// transitions write).
pub(crate) struct Idle {
    /// Workers spinning or parked (see "Work conservation"): while it is
    /// zero nobody could take work from a stuck worker, and submitters do
    /// not watch.
    pub(crate) count: AtomicUsize,
    /// Idle workers that sleep, or are about to, without a timeout and
    /// were not called since (each also marked in its `Worker`; the count
    /// is raised before the mark is set and lowered after it is cleared):
    /// they watch nobody until called. Whoever queues work behind a
    /// running step while this is not zero sees that some idle worker
    /// watches (`Shared::call_watcher`); see "Why no wake-up is lost" in `mod.rs`. On a line
    /// of its own: every delivery to a busy port reads it, and `count`
    /// changes at each idle period of each worker.
    pub(crate) sleepers: CachePadded<AtomicUsize>,
}

/// How long a worker sleeps while another runs a step with work behind it
/// (see [`WorkerCx::watch_others`]): a step that began after every other
/// thread last watched it is found stuck within about this long, even if
/// no submitter comes by.
pub(crate) const WATCH_PARK: Duration = Duration::from_micros(100);

/// How long a worker sleeps while another is active but has nothing
/// queued behind its step: a pool with one busy worker does not wake the
/// others 10,000 times a second for nothing. A task queued behind its
/// step meanwhile is watched by its pusher ([`Shared::schedule`]); a
/// delivery queued behind a busy port waits for the next watch, at most
/// this long.
pub(crate) const WATCH_PARK_MAX: Duration = Duration::from_micros(1_600);

/// Sleeps until woken or `timeout` passed; then leaves `PARKED` itself
/// (unless a waker did: its unpark then costs one spurious wake). Under
/// loom, which has no clock, it yields instead: the timeout has passed.
pub(crate) fn park_watching(me: &Worker, timeout: Duration) {
    #[cfg(not(loom))]
    if me.state.load(SeqCst) == Worker::PARKED {
        thread::park_timeout(timeout);
    }
    #[cfg(loom)]
    {
        let _ = timeout;
        thread::yield_now();
    }
    let _ = me
        .state
        .compare_exchange(Worker::PARKED, Worker::RUNNING, SeqCst, Relaxed);
}

impl Worker {
    /// Whether it sleeps (or is about to) without a timeout, not called
    /// yet: it watches nobody until called.
    pub(crate) fn is_sleeper(&self) -> bool {
        self.watched.sleeper.load(SeqCst)
    }

    /// Marks it a sleeper (its own thread, counted first).
    pub(crate) fn set_sleeper(&self) {
        self.watched.sleeper.store(true, SeqCst);
    }

    /// Clears the mark; true for the one caller that cleared it (which
    /// then uncounts it).
    pub(crate) fn clear_sleeper(&self) -> bool {
        self.watched.sleeper.load(SeqCst) && self.watched.sleeper.swap(false, SeqCst)
    }
}

impl Shared {
    /// Whether another worker than `me` has work waiting of the kind an
    /// idle worker takes (`steal.rs`): two or more tasks queued behind its
    /// step, or deliveries in the inbox of a port whose turn it runs (what
    /// `WorkerStats::parked_beside_work` counts). Read once per park.
    pub(crate) fn work_beside(&self, me: usize) -> bool {
        let queued = self
            .workers
            .iter()
            .enumerate()
            .any(|(i, w)| i != me && w.runs_a_step() && w.thief.len() + w.queue.len() >= 2);
        queued
            || self
                .registry
                .lock()
                .targets
                .iter()
                .any(|t| t.backlog_beside(me))
    }

    /// Whether some idle worker sleeps (or is about to) without a timeout.
    /// SeqCst: one side of the hand-shake in "Why no wake-up is lost" (`mod.rs`).
    #[inline]
    pub(crate) fn any_sleeper(&self) -> bool {
        self.config.watchers() && self.idle.sleepers.load(SeqCst) != 0
    }

    /// Counts the caller (an idle worker about to park) among the sleepers
    /// until the guard drops, and fences: its look at the other workers and
    /// the ports that follows sees whatever was queued before a pusher's
    /// read of the count missed it (see "Why no wake-up is lost" in
    /// `mod.rs`).
    pub(crate) fn count_sleeper(&self, index: usize) -> SleeperGuard<'_> {
        self.idle.sleepers.fetch_add(1, SeqCst);
        self.workers[index].set_sleeper();
        fence(SeqCst);
        SleeperGuard(self, index)
    }

    /// Counts worker `index` (the caller) idle until the guard drops.
    pub(crate) fn idle(&self, index: usize) -> IdleGuard<'_> {
        self.workers[index].set_idle(true);
        self.idle.count.fetch_add(1, SeqCst);
        // Against a pusher's push, fence, read of `idle`: it sees this
        // worker idle, or this worker's look (which follows) sees its push.
        fence(SeqCst);
        IdleGuard(self, index)
    }
}

impl WorkerCx<'_> {
    /// This worker parked for `idle` while another had work waiting (see
    /// `Shared::work_beside`).
    pub(crate) fn parked_beside_work(&self, idle: Duration) {
        let c = &self.me().counters;
        c.parked_beside_work.fetch_add(1, Relaxed);
        c.idle_beside_work_us
            .fetch_add(idle.as_micros() as u64, Relaxed);
        self.shared.metrics.parked_beside_work(self.index, idle);
    }

    /// Parks, out of work, with work conservation on and other workers
    /// there (see "The parker's side" in `mod.rs`). Counted among the
    /// sleepers first, it looks at the other workers and the ports: if any
    /// is active, it stops counting as a sleeper and parks watching — for
    /// [`WATCH_PARK`] if a worker has work queued behind its step, else for
    /// [`WATCH_PARK_MAX`]; otherwise it sleeps until woken or called,
    /// counted a sleeper.
    pub(crate) fn park(&self) {
        let me = self.me();
        let sleeper = self.shared.count_sleeper(self.index);
        let active = self
            .shared
            .workers
            .iter()
            .enumerate()
            .any(|(i, w)| i != self.index && w.active())
            || self.shared.any_port_busy();
        if active {
            // No longer a sleeper: a caller that still sees the count finds this
            // worker unmarked (a watcher), and calls nobody.
            drop(sleeper);
            let timeout = if self.watch_others() {
                WATCH_PARK
            } else {
                WATCH_PARK_MAX
            };
            park_watching(me, timeout);
        } else {
            park_until_woken(me);
            drop(sleeper);
        }
    }
}
