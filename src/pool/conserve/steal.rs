//! Steal: an idle worker takes one task waiting behind another worker's
//! step, or the rest of a port's turn that a stuck step holds up.

use crate::pool::shared::Shared;
use crate::pool::task::Task;
use crate::pool::worker::{Worker, WorkerCx};
use crate::sync::atomic::Ordering::*;

use super::Sighting;

impl Worker {
    /// Takes one task that waits on this worker: the oldest of its own run
    /// queue, else of its queue of pushes.
    pub(crate) fn steal_task(&self) -> Option<Task> {
        self.thief.steal().or_else(|| self.queue.pop())
    }
}

impl Shared {
    /// A takeover of the turn of a port whose worker `stuck` runs it with
    /// deliveries waiting (any dispatcher's), if there is one.
    #[cold]
    pub(crate) fn steal_turn(&self, stuck: usize) -> Option<Task> {
        // Out of the registry's lock: a steal takes ports' gates.
        self.targets().iter().find_map(|t| t.steal_turn(stuck))
    }
}

impl Shared {
    /// `cx` (idle) takes a slice of the backlog of a port whose turn runs
    /// on another worker, in any dispatcher (see `dispatcher/slice.rs`).
    #[cold]
    pub(crate) fn steal_slice(&self, cx: &WorkerCx<'_>) -> bool {
        // Out of the registry's lock: a slice takes ports' gates.
        self.targets().iter().any(|t| t.steal_slice(cx))
    }
}

impl WorkerCx<'_> {
    /// Out of work: takes one task waiting behind another worker's step
    /// (the oldest), else the rest of a port's turn that a stuck step
    /// holds up (see `conserve/mod.rs`), onto this worker's queue. True if
    /// it found one.
    pub(crate) fn steal(&self) -> bool {
        let me = self.me();
        me.watched.call.store(false, Relaxed);
        let workers = &self.shared.workers;
        let n = workers.len();
        for i in 1..n {
            let w = (self.index + i) % n;
            let other = &workers[w];
            // Tasks queued behind the step it runs (the queues themselves,
            // not `local_len`, which its owner publishes relaxed): taken if
            // two or more wait, or one behind a stuck step. One task queued
            // behind a step that makes progress is the next it runs (a
            // handler's message to another key, say): moving it would only
            // split keys that message each other. An idle worker takes its
            // own.
            let queued = other.thief.len() + other.queue.len();
            if queued > 0
                && other.runs_a_step()
                && (queued >= 2 || other.watch(|| self.shared.now_us()) == Sighting::Stuck)
            {
                if let Some(task) = other.steal_task() {
                    self.local.push(task);
                    self.publish_len(self.local.len());
                    self.me().counters.stolen.fetch_add(1, Relaxed);
                    return true;
                }
            }
            // Nothing queued, but maybe a port's turn under way: its
            // deliveries wait behind its step. Take a slice of them; else,
            // from a stuck step, the rest of the turn (which makes the
            // running message's key a mailbox).
            if other.local_len.load(Relaxed) == 0 {
                continue;
            }
            if self.shared.steal_slice(self) {
                self.me().counters.stolen.fetch_add(1, Relaxed);
                return true;
            }
            if other.watch(|| self.shared.now_us()) == Sighting::Stuck {
                if let Some(task) = self.shared.steal_turn(w) {
                    self.local.push(task);
                    self.publish_len(self.local.len());
                    self.me().counters.stolen.fetch_add(1, Relaxed);
                    return true;
                }
            }
        }
        false
    }
}
