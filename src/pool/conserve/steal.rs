//! Steal: an idle worker takes one task waiting behind a stuck worker's
//! step, or the rest of its port's turn.

use crate::pool::dispatcher::StopTarget;
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
        // Out of the registry's lock: a watch takes ports' gates.
        let targets: Vec<Box<dyn StopTarget>> = {
            let registry = self.registry.lock();
            registry.targets.iter().map(|t| t.clone_box()).collect()
        };
        targets.iter().find_map(|t| t.steal_turn(stuck))
    }
}

impl WorkerCx<'_> {
    /// Out of work: takes one task waiting behind a stuck worker's step
    /// (see `conserve/mod.rs`) onto this worker's queue.
    /// True if it found one.
    pub(crate) fn steal(&self) -> bool {
        let me = self.me();
        me.watched.call.store(false, Relaxed);
        let workers = &self.shared.workers;
        let n = workers.len();
        for i in 1..n {
            let w = (self.index + i) % n;
            let other = &workers[w];
            // Nothing queued and no port's turn under way: nothing waits
            // behind its step. (The queues themselves, not `local_len`,
            // which its owner publishes relaxed.)
            let waiting = !other.thief.is_empty()
                || !other.queue.is_empty()
                || other.local_len.load(Relaxed) != 0;
            if waiting && other.watch(|| self.shared.now_us()) == Sighting::Stuck {
                // A task queued behind the step, else the rest of a port's
                // turn that the step holds up.
                if let Some(task) = other.steal_task().or_else(|| self.shared.steal_turn(w)) {
                    self.local.push(task);
                    self.publish_len(self.local.len());
                    return true;
                }
            }
        }
        false
    }
}
