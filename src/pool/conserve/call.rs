//! Call: ask an idle worker to watch and steal; the pusher's side of the
//! protocol (see `mod.rs`).

use crate::pool::shared::Shared;
use crate::pool::task::Task;
use crate::pool::worker::{Worker, WorkerCx};
use crate::sync::atomic::{fence, Ordering::*};

use super::Sighting;

/// The least time (µs) between two calls for the same stuck step.
#[cfg(not(loom))]
pub(crate) const CALL_INTERVAL: u32 = 50;

impl Shared {
    /// Pushes `task` on `worker`'s queue from any thread, waking the worker
    /// if it sleeps — or on an idle worker's, if `worker` is stuck. Returns
    /// the worker it pushed to.
    #[inline]
    pub(crate) fn schedule(&self, worker: usize, task: Task) -> usize {
        let (worker, seen) = if self.any_idle() {
            self.push_target(worker)
        } else {
            (worker, None)
        };
        self.push(worker, task);
        // After the push and its fence: a worker that went idle meanwhile
        // either sees the task behind a stuck `worker` itself, or is seen
        // here and called to take it. A watch made before the push is
        // reused, not repeated: it is a few nanoseconds old, and a watch
        // reads the clock.
        if self.any_idle() {
            self.call_if_stuck(worker, seen);
        }
        worker
    }

    /// Calls an idle worker to steal from `worker` if it is stuck (and is not
    /// the caller). `seen`: what this schedule's watch it before the
    /// push found, if it made one.
    #[cold]
    pub(crate) fn call_if_stuck(&self, worker: usize, seen: Option<Sighting>) {
        if WorkerCx::with_current(|cx| cx.is_of(self.id()) && cx.index == worker) == Some(true) {
            // Queued behind the caller's own step (a handler woke a future
            // of its own worker): the step may go on for long.
            self.call_watcher(worker);
            return;
        }
        let sighting = seen.unwrap_or_else(|| self.workers[worker].watch(|| self.now_us()));
        match sighting {
            Sighting::Stuck => self.call_idle(worker),
            Sighting::Fresh => self.call_watcher(worker),
            Sighting::NotRunning => {}
        }
    }

    /// Where a task meant for `worker` should go: an idle worker if
    /// `worker` is stuck in a step (and the caller is not `worker` itself,
    /// which is not stuck if it runs this), else `worker`; with what the
    /// watch `worker` found (none if the task goes elsewhere).
    #[cold]
    pub(crate) fn push_target(&self, worker: usize) -> (usize, Option<Sighting>) {
        if WorkerCx::with_current(|cx| cx.is_of(self.id()) && cx.index == worker) == Some(true) {
            return (worker, Some(Sighting::NotRunning));
        }
        match self.workers[worker].watch(|| self.now_us()) {
            Sighting::Stuck => match self.idle_worker(worker) {
                Some(i) => (i, None),
                None => (worker, Some(Sighting::Stuck)),
            },
            sighting => (worker, Some(sighting)),
        }
    }

    /// An idle worker other than `not` (one not parked first: it needs no
    /// wake-up).
    pub(crate) fn idle_worker(&self, not: usize) -> Option<usize> {
        let mut parked = None;
        for (i, w) in self.workers.iter().enumerate() {
            if i == not || !w.is_idle() {
                continue;
            }
            match w.state.load(Relaxed) {
                Worker::PARKED => parked = parked.or(Some(i)),
                _ => return Some(i),
            }
        }
        parked
    }

    /// Work was queued behind `busy`'s step (seen, but not yet for long
    /// enough to call it stuck, or not watched): a later watch must come
    /// even if no submitter does. An idle worker parked with a timeout,
    /// spinning or on its way to park watches by itself; if
    /// every idle one sleeps without a timeout, one is called, and parks
    /// watching from then on while some worker is active (see "Who
    /// watches"). (Without this, a future woken behind a blocked step
    /// waited for good: the one watch it came before the step was old
    /// enough.)
    #[inline]
    pub(crate) fn call_watcher(&self, busy: usize) {
        // No sleeper (the count is at least the marks): every idle
        // worker watches again by itself.
        if self.any_sleeper() {
            self.call_sleeper(busy);
        }
    }

    /// [`call_watcher`](Self::call_watcher) with a sleeper
    /// counted: calls one, unless another idle worker (not `busy`) watches
    /// again by itself.
    #[cold]
    pub(crate) fn call_sleeper(&self, busy: usize) {
        let mut watched = false;
        let mut sleeper = None;
        for (i, w) in self.workers.iter().enumerate() {
            if i == busy || !w.is_idle() {
                continue;
            }
            if w.is_sleeper() {
                sleeper = sleeper.or(Some(i));
            } else {
                // Spinning, yielding, watching or about to watch
                // the others before it parks: it watches again.
                watched = true;
            }
        }
        if let (false, Some(i)) = (watched, sleeper) {
            // Uncounted here, by the one caller that clears its mark:
            // the submitters after this one see no sleeper and
            // call nobody (the called worker watches from now on).
            if self.workers[i].clear_sleeper() {
                self.idle.sleepers.fetch_sub(1, SeqCst);
                self.workers[i].call();
            }
        }
    }

    /// `stuck` is stuck with work queued behind its step: call an idle
    /// worker to take it.
    #[cold]
    pub(crate) fn call_idle(&self, stuck: usize) {
        // A call already pending is not repeated (`Worker::call`), nor one
        // made for the same step less than `CALL_INTERVAL` ago: a thief
        // that found nothing to take when called would otherwise be woken
        // by every submit (a futex wake-up each: it starved the producer
        // of the slow-key workload). A call swallowed that way is made by
        // the next submitter after the interval, and a parked thief
        // watching an active worker watches again within `WATCH_PARK_MAX`.
        if let Some(i) = self.idle_worker(stuck) {
            #[cfg(not(loom))]
            {
                let now = self.now_us();
                if !self.workers[stuck].may_call(now) {
                    return;
                }
            }
            self.workers[i].call();
        }
    }
}

impl Worker {
    /// Whether a thief may be called for this (stuck) worker at `now` (µs):
    /// not if one was called for the same step less than [`CALL_INTERVAL`]
    /// µs ago (see `Shared::call_idle`).
    #[cfg(not(loom))]
    pub(crate) fn may_call(&self, now: u32) -> bool {
        let step = self.steps.load(Relaxed);
        let last = self.watched.called.load(Relaxed);
        if (last >> 32) as u32 == step && now.wrapping_sub(last as u32) < CALL_INTERVAL {
            return false;
        }
        self.watched
            .called
            .store((u64::from(step) << 32) | u64::from(now), Relaxed);
        true
    }

    /// Asks this worker to watch for a stuck one to steal from (see
    /// `Shared::call_idle`); false if it was asked already.
    pub(crate) fn call(&self) -> bool {
        if self.watched.call.load(Relaxed) || self.watched.call.swap(true, SeqCst) {
            return false;
        }
        fence(SeqCst);
        self.wake_if_parked();
        true
    }
}
