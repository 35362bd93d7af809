//! [`futures_task::Spawn`] for [`KeyedExecutor`](crate::KeyedExecutor) (the
//! impl is in `executor.rs`, the tasks here): a spawned future runs on
//! the executor's workers, unkeyed, with the crate's own waker, and takes
//! part in the executor's lifecycle like a message does.
//!
//! # State machine
//!
//! Each spawned future is a [`SpawnTask`] whose `state` holds one of four
//! states plus a flag; every transition is a single SeqCst read-modify-write
//! (spawning is not the hot path, and SeqCst keeps the force-stop argument
//! below a plain total-order one).
//!
//! - `SCHEDULED`: the task is in exactly one worker queue; nobody polls it.
//!   Made by: the spawner, a waker (from `IDLE`), or the runner re-queuing it
//!   (woken during its poll).
//! - `RUNNING`: a worker polls it. Only the runner touches `future`. Made by:
//!   the worker that popped it (`SCHEDULED` → `RUNNING`).
//! - `IDLE`: the future returned `Pending`; no worker holds the task, only
//!   wakers do. Made by: the runner. Left by: a waker (→ `SCHEDULED`, and it
//!   pushes the task on a worker queue) or a force stop that claims it
//!   (→ `COMPLETE`, and it drops the future as cancelled).
//! - `COMPLETE`: terminal; the future was dropped (it finished, panicked or
//!   was cancelled) and the task left the registry. Wakes are ignored.
//! - `NOTIFIED` (flag, with `RUNNING`): a wake arrived during the poll. If the
//!   poll returns `Pending`, the runner re-queues the task (`SCHEDULED`)
//!   instead of going `IDLE`, so the wake is not lost; only the `IDLE` →
//!   `SCHEDULED` edge pushes from a waker, so the task is never queued twice.
//!
//! ```text
//!     spawn ---> SCHEDULED --pop--> RUNNING --Ready / panic / forced--> COMPLETE
//!                  ^   ^               |  |                                ^
//!                  |   +-- Pending +   |  | Pending                        |
//!                  |       NOTIFIED ---+  v                                |
//!                  +------- wake ------- IDLE --- force stop claims it ----+
//! ```
//!
//! A task is taken by the worker that pops it; a wake from `IDLE` pushes it on
//! the worker [`Shared::pick_worker`] chooses (tasks have no key to stick to),
//! a wake during its poll back on the worker that ran it.
//!
//! # Lifecycle
//!
//! Live tasks are kept in a registry (`Spawned`) so the executor can find them:
//!
//! - Spawning checks `CLOSED` and registers the task under the registry lock,
//!   so a spawn racing a stop is either refused (`SpawnError::shutdown()`, the
//!   future is dropped on the spawner's thread) or seen by the stop.
//! - Graceful [`shutdown`](crate::KeyedExecutor::shutdown) waits for
//!   registered tasks like it waits for live mailboxes
//!   (`Shared::is_drained`); a task that completes while `CLOSED` wakes the
//!   workers to check again.
//! - [`shutdown_now`](crate::KeyedExecutor::shutdown_now) sets `FORCED`,
//!   then takes the whole registry and claims every `IDLE` task
//!   (→ `COMPLETE`), dropping its future on the stopping thread. A
//!   `SCHEDULED` task is cancelled by whoever pops it (a worker, or the
//!   stop emptying the queues). A `RUNNING` one finishes its poll; its
//!   runner then sees `FORCED` and drops the future. The race between the
//!   claim and a runner going `IDLE` is closed by SeqCst: the stop sets
//!   `FORCED` before its claim; the runner moves to `IDLE` before it reads
//!   `FORCED`. If the claim read `RUNNING`, the runner's later read sees
//!   `FORCED` and claims the task back itself.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_task::{FutureObj, SpawnError};

use crate::error::Panic;
use crate::pool::shared::Shared;
use crate::pool::stats::SpawnedStats;
use crate::pool::task::{Runnable, Task};
use crate::pool::waker::{Wake, WakerRef};
use crate::pool::worker::WorkerCx;
use crate::sync::atomic::{AtomicU64, AtomicUsize, Ordering::*};
use crate::sync::{Arc, Mutex, UnsafeCell};
use crate::trace;

/// How a task ended.
enum End {
    Done,
    Panicked(Panic),
    Cancelled,
}

/// What a runner whose poll returned `Pending` did with the task.
#[must_use]
enum AfterPending {
    /// `IDLE` until a wake.
    Idle,
    /// Woken during the poll: back in `SCHEDULED`; the caller re-queues it.
    Requeue,
}

/// The registry of live spawned tasks, and their counters. One per executor
/// (a field of [`Shared`]).
pub(crate) struct Spawned {
    registry: Mutex<Registry>,
    done: AtomicU64,
    panicked: AtomicU64,
    cancelled: AtomicU64,
}

struct Registry {
    live: HashMap<u64, Arc<SpawnTask>>,
    next_id: u64,
}

impl Spawned {
    pub(crate) fn new() -> Self {
        Spawned {
            registry: Mutex::new(Registry {
                live: HashMap::new(),
                next_id: 0,
            }),
            done: AtomicU64::new(0),
            panicked: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
        }
    }

    /// No spawned future is alive.
    pub(crate) fn is_drained(&self) -> bool {
        self.registry.lock().live.is_empty()
    }

    /// Live spawned futures.
    pub(crate) fn live(&self) -> usize {
        self.registry.lock().live.len()
    }

    pub(crate) fn stats(&self) -> SpawnedStats {
        SpawnedStats {
            live: self.live(),
            done: self.done.load(Relaxed),
            panicked: self.panicked.load(Relaxed),
            cancelled: self.cancelled.load(Relaxed),
        }
    }

    /// Force stop, on the stopping thread, after `FORCED` is set: takes every
    /// registered task and cancels the `IDLE` ones. Returns how many it
    /// cancelled.
    pub(crate) fn force_cancel(&self) -> usize {
        let taken = std::mem::take(&mut self.registry.lock().live);
        let mut n = 0;
        for task in taken.into_values() {
            if task
                .state
                .compare_exchange(SpawnTask::IDLE, SpawnTask::COMPLETE, SeqCst, SeqCst)
                .is_ok()
            {
                // SAFETY: the CAS from IDLE made us the owner of the task.
                unsafe { task.end(End::Cancelled) };
                n += 1;
            }
        }
        n
    }

    fn deregister(&self, id: u64) {
        let removed = self.registry.lock().live.remove(&id);
        drop(removed);
    }
}

/// Spawns `future` on `shared`'s workers, or refuses it once the executor is
/// closed.
pub(crate) fn spawn(
    shared: &Arc<Shared>,
    future: FutureObj<'static, ()>,
) -> Result<(), SpawnError> {
    let task = {
        let mut reg = shared.spawned.registry.lock();
        // Read under the registry lock: see the module docs, "Lifecycle".
        if shared.is_closed() {
            // `future` is dropped by our caller's frame after this guard.
            return Err(SpawnError::shutdown());
        }
        let id = reg.next_id;
        reg.next_id += 1;
        let task = Arc::new(SpawnTask {
            state: AtomicUsize::new(SpawnTask::SCHEDULED),
            id,
            future: UnsafeCell::new(Some(future)),
            shared: shared.clone(),
        });
        reg.live.insert(id, task.clone());
        task
    };
    shared.schedule(shared.pick_worker(), Task::new(task));
    Ok(())
}

/// One spawned future.
pub(crate) struct SpawnTask {
    state: AtomicUsize,
    id: u64,
    /// Owned by whoever holds `RUNNING` (or claimed `IDLE` → `COMPLETE`, or
    /// popped the task to cancel it). `FutureObj` is `Unpin`: it may move.
    future: UnsafeCell<Option<FutureObj<'static, ()>>>,
    shared: Arc<Shared>,
}

// SAFETY: `future` is only touched by the single owner of the task's turn
// (handed over by the state machine's SeqCst read-modify-writes); everything
// else is `Sync`. `FutureObj<'static, ()>` is `Send`.
unsafe impl Sync for SpawnTask {}

// SAFETY: every field is `Send` (`FutureObj` is `Send`).
unsafe impl Send for SpawnTask {}

impl SpawnTask {
    /// In exactly one worker queue; nobody polls it.
    const SCHEDULED: usize = 1;
    /// A worker polls it.
    const RUNNING: usize = 2;
    /// Its future is pending; only a waker moves it on.
    const IDLE: usize = 3;
    /// Terminal: finished, panicked or cancelled.
    const COMPLETE: usize = 4;
    /// The state bits.
    const STATE_MASK: usize = 0b111;
    /// With `SCHEDULED` or `RUNNING`: woken meanwhile; polled again.
    const NOTIFIED: usize = 0b1000;

    /// Ends the task: drops its future (after marking it `COMPLETE`, so a wake
    /// from its `Drop` is ignored), counts, and leaves the registry.
    ///
    /// # Safety
    /// The caller owns the task's turn (`RUNNING`, a claimed `IDLE`, or a
    /// popped `SCHEDULED`) and ends it exactly once.
    unsafe fn end(&self, end: End) {
        // SAFETY: caller's contract: nobody else touches the cell.
        let future = self.future.with_mut(|f| unsafe { (*f).take() });
        self.state.store(SpawnTask::COMPLETE, SeqCst);
        // The future's `Drop` is user code: contain a panic there too.
        let _ = catch_unwind(AssertUnwindSafe(move || drop(future)));
        let spawned = &self.shared.spawned;
        match end {
            End::Done => spawned.done.fetch_add(1, Relaxed),
            End::Panicked(p) => {
                trace::spawned_panicked(&p);
                spawned.panicked.fetch_add(1, Relaxed)
            }
            End::Cancelled => spawned.cancelled.fetch_add(1, Relaxed),
        };
        spawned.deregister(self.id);
        // A graceful stop may be waiting for this task.
        self.shared.wake_if_closed();
    }

    /// `RUNNING` → `IDLE`, or → `SCHEDULED` if woken during the poll.
    fn transition_to_idle(&self) -> AfterPending {
        let mut cur = self.state.load(SeqCst);
        loop {
            debug_assert_eq!(cur & SpawnTask::STATE_MASK, SpawnTask::RUNNING);
            let (next, res) = if cur & SpawnTask::NOTIFIED != 0 {
                (SpawnTask::SCHEDULED, AfterPending::Requeue)
            } else {
                (SpawnTask::IDLE, AfterPending::Idle)
            };
            match self.state.compare_exchange(cur, next, SeqCst, SeqCst) {
                Ok(_) => return res,
                Err(actual) => cur = actual,
            }
        }
    }

    /// The wake transition. True if the caller moved the task `IDLE` →
    /// `SCHEDULED` and must push it on a worker queue.
    fn transition_wake(&self) -> bool {
        let mut cur = self.state.load(SeqCst);
        loop {
            let next = match cur & SpawnTask::STATE_MASK {
                SpawnTask::IDLE => SpawnTask::SCHEDULED,
                SpawnTask::RUNNING if cur & SpawnTask::NOTIFIED == 0 => cur | SpawnTask::NOTIFIED,
                // Already queued, already notified, or complete.
                _ => return false,
            };
            match self.state.compare_exchange(cur, next, SeqCst, SeqCst) {
                Ok(_) => return next == SpawnTask::SCHEDULED,
                Err(actual) => cur = actual,
            }
        }
    }

    fn after_pending(this: Arc<Self>, cx: &WorkerCx<'_>) {
        if this.shared.is_forced() {
            // SAFETY: we still own the turn (RUNNING).
            return unsafe { this.end(End::Cancelled) };
        }
        match this.transition_to_idle() {
            AfterPending::Requeue => cx.push_local(Task::new(this)),
            AfterPending::Idle => {
                // A force stop whose claim found us RUNNING left the task to us.
                if this.shared.is_forced()
                    && this
                        .state
                        .compare_exchange(SpawnTask::IDLE, SpawnTask::COMPLETE, SeqCst, SeqCst)
                        .is_ok()
                {
                    // SAFETY: the CAS from IDLE made us the owner again.
                    unsafe { this.end(End::Cancelled) };
                }
            }
        }
    }
}

impl Runnable for SpawnTask {
    fn run(this: Arc<Self>, cx: &WorkerCx<'_>, _tag: usize) {
        let prev = this.state.swap(SpawnTask::RUNNING, SeqCst);
        debug_assert_eq!(
            prev & SpawnTask::STATE_MASK,
            SpawnTask::SCHEDULED,
            "ran a task that was not scheduled"
        );
        if this.shared.is_forced() {
            // SAFETY: we popped a SCHEDULED task: the turn is ours.
            return unsafe { this.end(End::Cancelled) };
        }
        let waker = WakerRef::new(&this);
        let mut task_cx = Context::from_waker(&waker);
        let polled = this.future.with_mut(|f| {
            // SAFETY: RUNNING: we own the cell.
            let future = unsafe { (*f).as_mut() }.expect("a scheduled task has its future");
            catch_unwind(AssertUnwindSafe(|| Pin::new(future).poll(&mut task_cx)))
        });
        cx.step_break();
        let end = match polled {
            Ok(Poll::Pending) => return Self::after_pending(this, cx),
            Ok(Poll::Ready(())) => End::Done,
            Err(payload) => End::Panicked(Panic::new(payload)),
        };
        // SAFETY: still RUNNING: we own the turn.
        unsafe { this.end(end) }
    }

    fn cancel(this: Arc<Self>, _tag: usize) {
        let prev = this.state.swap(SpawnTask::RUNNING, SeqCst);
        debug_assert_eq!(
            prev & SpawnTask::STATE_MASK,
            SpawnTask::SCHEDULED,
            "cancelled a task that was not scheduled"
        );
        // SAFETY: it was SCHEDULED and we popped it: the turn is ours.
        unsafe { this.end(End::Cancelled) };
    }
}

impl Wake for SpawnTask {
    fn wake(this: Arc<Self>) {
        if this.transition_wake() {
            let shared = this.shared.clone();
            shared.schedule(shared.pick_worker(), Task::new(this));
        }
    }

    fn wake_by_ref(this: &Arc<Self>) {
        if this.transition_wake() {
            let shared = &this.shared;
            shared.schedule(shared.pick_worker(), Task::new(this.clone()));
        }
    }
}

impl fmt::Debug for SpawnTask {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SpawnTask")
            .field("id", &self.id)
            .field("state", &self.state.load(Relaxed))
            .finish_non_exhaustive()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::pool::executor::KeyedExecutor;
    use futures_task::Spawn;
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc as StdArc;
    use std::time::Duration;

    #[test]
    fn a_wake_during_the_poll_requeues_once() {
        // The future wakes itself during its first poll, then completes on
        // its second: it must be polled exactly twice.
        let executor = KeyedExecutor::builder().workers(1).build().unwrap();
        let polls = StdArc::new(AtomicUsize::new(0));
        let p = polls.clone();
        let fut = std::future::poll_fn(move |cx| {
            if p.fetch_add(1, SeqCst) == 0 {
                cx.waker().wake_by_ref();
                cx.waker().wake_by_ref();
                Poll::Pending
            } else {
                Poll::Ready(())
            }
        });
        executor.spawn_obj(FutureObj::new(Box::new(fut))).unwrap();
        assert!(executor.shutdown(Duration::from_secs(10)));
        assert_eq!(polls.load(SeqCst), 2);
        assert_eq!(executor.stats().spawned.done, 1);
    }

    #[test]
    fn a_refused_future_is_dropped_on_the_spawners_thread() {
        struct OnDrop(StdArc<AtomicBool>);
        impl Drop for OnDrop {
            fn drop(&mut self) {
                self.0.store(true, SeqCst);
            }
        }
        let executor = KeyedExecutor::builder().workers(1).build().unwrap();
        executor.shutdown_now();
        let dropped = StdArc::new(AtomicBool::new(false));
        let guard = OnDrop(dropped.clone());
        let fut = async move {
            let _g = guard;
        };
        assert!(executor
            .spawn_obj(FutureObj::new(Box::new(fut)))
            .unwrap_err()
            .is_shutdown());
        assert!(dropped.load(SeqCst));
        assert!(executor.status().is_err());
    }
}
