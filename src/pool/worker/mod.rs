//! Workers: a FIFO queue of scheduled mailboxes each, and the spin-then-park
//! loop that runs them.
//!
//! # Worker state machine
//!
//! `state` is written by the worker itself except for one edge:
//!
//! - `RUNNING`: taking tasks from its queue (or about to). Made by the worker,
//!   or by a pusher/stopper that wakes it from `PARKED`.
//! - `SPINNING`: out of work, busy-waiting up to `spin` for a push. Made and
//!   left by the worker only; pushers never need to wake it.
//! - `PARKED`: asleep in `thread::park`. Made by the worker. Left by whoever
//!   wins the CAS `PARKED` → `RUNNING` (a pusher, or a stop), which then
//!   unparks the thread — so a worker is unparked at most once per park.
//! - `EXITED`: terminal, set by the worker as it leaves.
//!
//! # No lost wake-ups
//!
//! A pusher does `queue.push; fence(SeqCst); load(state)`; a worker going to
//! sleep does `swap(state, PARKED); fence(SeqCst); check queue and executor
//! state`. By the SeqCst fences, either the pusher sees `PARKED` (and wakes
//! it) or the worker sees the pushed task (and cancels its park). Stops set
//! the executor state first and then wake every parked worker the same way.
//! During a graceful stop, the runner that retires a mailbox wakes the parked
//! workers after removing it, so a worker going to sleep also re-checks,
//! after its fence, whether everything drained.
//!
//! # Spin then park
//!
//! A worker that runs out of work spins for up to `spin` (zero by default:
//! park at once) and only if its *last* wait was shorter than `spin`; after a
//! longer wait it parks at once. The spin also stops at once when a stop
//! begins. Under loom the spin loop yields to the scheduler.

mod cx;
mod run;

pub(crate) use cx::{
    current_index, flush_held_credit, give_back_running_unit, home_for_new_key, in_handler,
    on_worker_of, take_running_unit, with_worker_cx, WorkerCx,
};
pub(crate) use run::run;
use run::{park, park_watching, WATCH_PARK, WATCH_PARK_MAX};

use crossbeam_utils::CachePadded;

use crate::pool::task::Task;
use crate::sync::atomic::{
    fence, AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering::*,
};
use crate::sync::{thread, Mutex, Queue, RunQueue, Thief};

pub(crate) const RUNNING: u8 = 0;
pub(crate) const SPINNING: u8 = 1;
pub(crate) const PARKED: u8 = 2;
pub(crate) const EXITED: u8 = 3;

/// Counters a worker keeps about itself (relaxed; for stats only).
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) done: AtomicU64,
    pub(crate) panicked: AtomicU64,
    pub(crate) cancelled: AtomicU64,
    pub(crate) parks: AtomicU64,
    pub(crate) unparks: AtomicU64,
    pub(crate) spin_hits: AtomicU64,
    pub(crate) gave_way: AtomicU64,
}

/// How long (µs) a stretch of a mailbox's turn must have run for its
/// worker to yield its thread before the next message (see "Long steps
/// give way" in `executor.rs`). Far above a short message (1–5 µs), below
/// the kernel's time slice (a few ms), so that a thread queued behind a
/// long step on its CPU waits for one message, not a slice.
pub(crate) const LONG_STEP_US: u32 = 300;

/// How long (µs) one step must have been seen running before its worker
/// counts as stuck in it: from the first look at the step (by a submitter
/// that queued work behind it, or an idle worker looking for some) to a
/// later one. A time, not a number of looks: a burst of wake-ups behind
/// one short step (a device completing many futures at once) is many
/// looks within a microsecond, and counting them made a 2-look rule call
/// a step of a few µs stuck, moving tasks to a parked worker (a futex
/// wake-up each; see BENCHMARKS.md, issue 11).
#[cfg(not(loom))]
const STUCK_AFTER_US: u32 = 50;

/// What a look at a worker found (see [`Worker::look`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Look {
    /// Not running a step (idle, parked, exited).
    No,
    /// Running a step seen for less than [`STUCK_AFTER_US`]: whoever
    /// queued work behind it must see that someone looks again later
    /// (`Shared::ensure_watcher`). Never under loom.
    #[cfg_attr(loom, allow(dead_code))]
    Pending,
    /// Stuck: the same step, seen at least [`STUCK_AFTER_US`] ago.
    Stuck,
}

/// The least time (µs) between two calls for help for the same stuck step.
#[cfg(not(loom))]
const CALL_INTERVAL: u32 = 50;

/// One worker's shared half.
pub(crate) struct Worker {
    /// Tasks pushed from other threads (wakes, new ports, spawns).
    pub(crate) queue: Queue<Task>,
    /// Takes the oldest task of the worker's own run queue (see "Work
    /// conservation" in `executor.rs`).
    thief: Thief<Task>,
    /// The run queue itself, until the worker's thread takes it.
    local: Mutex<Option<RunQueue<Task>>>,
    /// Steps the worker began (wrapping): a task taken, or a message its
    /// port runs in the slot. Written by the worker only (relaxed), read by
    /// whoever wonders whether it is stuck.
    steps: CachePadded<AtomicU32>,
    /// What others saw of `steps` (see [`Worker::stuck`]) and calls for
    /// help (see `Shared::call_helper`).
    watched: CachePadded<Watched>,
    /// Length of the worker's local run queue, plus one during a port's
    /// turn (the rest of its inbox is work queued on this worker too;
    /// written by the worker only; for placement and stats).
    pub(crate) local_len: AtomicUsize,
    pub(crate) state: CachePadded<AtomicU8>,
    thread: Mutex<Option<thread::Thread>>,
    pub(crate) counters: CachePadded<Counters>,
}

/// The part of a worker other threads write: sightings and calls.
struct Watched {
    /// The step last seen (low 32 bits) and when it was first seen (µs
    /// since the executor's epoch, high 32 bits).
    #[cfg(not(loom))]
    seen: AtomicU64,
    /// The worker sleeps, or is about to, without a timeout and has not
    /// been called since (see "Who watches" in `executor.rs`). Set by the
    /// worker, counted in `Shared`'s deep sleepers; cleared (and uncounted)
    /// by whoever swaps it back: the worker when it wakes, or the caller
    /// that calls it (so that one call is enough for every submitter).
    deep: AtomicBool,
    /// Another thread asked this (idle) worker to look for a stuck one.
    call: AtomicBool,
    /// When a helper was last called for this worker (µs since the
    /// executor's epoch, low 32 bits) and for which step (high 32 bits).
    #[cfg(not(loom))]
    called: AtomicU64,
    /// The worker is idle (see `Shared::idle`): out of work, looking for
    /// some, spinning or parked. Written by the worker (SeqCst).
    idle: AtomicBool,
}

impl Worker {
    pub(crate) fn new() -> Self {
        let local = RunQueue::new();
        Worker {
            thief: local.thief(),
            local: Mutex::new(Some(local)),
            steps: CachePadded::new(AtomicU32::new(0)),
            watched: CachePadded::new(Watched {
                #[cfg(not(loom))]
                seen: AtomicU64::new(0),
                deep: AtomicBool::new(false),
                call: AtomicBool::new(false),
                #[cfg(not(loom))]
                called: AtomicU64::new(u64::MAX),
                idle: AtomicBool::new(false),
            }),
            queue: Queue::new(),
            local_len: AtomicUsize::new(0),
            state: CachePadded::new(AtomicU8::new(RUNNING)),
            thread: Mutex::new(None),
            counters: CachePadded::new(Counters::default()),
        }
    }

    /// Tasks waiting on this worker (remote and local).
    pub(crate) fn queued(&self) -> usize {
        self.queue.len() + self.local_len.load(Relaxed)
    }

    /// Whether this worker counts as stuck in the step it runs: `RUNNING`,
    /// and the same step seen at least [`STUCK_AFTER_US`] before this look
    /// (`now`: µs since the executor's epoch, read only if the worker runs
    /// a step). A look at a step not seen before records it as first seen
    /// now. A worker that makes progress moves `steps` on and is never
    /// stuck, however busy.
    /// Sightings race (relaxed, last writer wins): a lost one only delays
    /// the verdict, by at most one more look.
    pub(crate) fn look(&self, now: impl FnOnce() -> u32) -> Look {
        if self.state.load(SeqCst) != RUNNING || self.watched.idle.load(SeqCst) {
            return Look::No;
        }
        #[cfg(loom)]
        {
            // Under loom every running worker counts as stuck, so that the
            // models explore a steal wherever one can happen.
            let _ = now;
            Look::Stuck
        }
        #[cfg(not(loom))]
        {
            let step = self.steps.load(Relaxed);
            let seen = self.watched.seen.load(Relaxed);
            if seen as u32 == step {
                let first = (seen >> 32) as u32;
                return if now().wrapping_sub(first) >= STUCK_AFTER_US {
                    Look::Stuck
                } else {
                    Look::Pending
                };
            }
            self.watched
                .seen
                .store(u64::from(step) | (u64::from(now()) << 32), Relaxed);
            Look::Pending
        }
    }

    /// Whether it sleeps (or is about to) without a timeout, not called
    /// yet: it looks at nobody until called.
    pub(crate) fn is_deep(&self) -> bool {
        self.watched.deep.load(SeqCst)
    }

    /// Marks it a deep sleeper (its own thread, counted first).
    pub(crate) fn set_deep(&self) {
        self.watched.deep.store(true, SeqCst);
    }

    /// Clears the mark; true for the one caller that cleared it (which
    /// then uncounts it).
    pub(crate) fn clear_deep(&self) -> bool {
        self.watched.deep.load(SeqCst) && self.watched.deep.swap(false, SeqCst)
    }

    /// Whether a helper may be called for this (stuck) worker at `now` (µs):
    /// not if one was called for the same step less than [`CALL_INTERVAL`]
    /// µs ago (see `Shared::call_helper`).
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

    /// Asks this worker to look for a stuck one to help (see
    /// `Shared::call_helper`); false if it was asked already.
    pub(crate) fn call(&self) -> bool {
        if self.watched.call.load(Relaxed) || self.watched.call.swap(true, SeqCst) {
            return false;
        }
        fence(SeqCst);
        self.wake_if_parked();
        true
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
    fn busy_with_backlog(&self) -> bool {
        self.state.load(Relaxed) == RUNNING && self.queued() > 0
    }

    /// Whether it runs, spins or has work queued: a step it runs or starts
    /// may get stuck (what a worker about to park deep checks; see "Who
    /// watches" in `executor.rs`). A parked worker with nothing queued is
    /// woken by whoever queues it work, after that push.
    fn active(&self) -> bool {
        !matches!(self.state.load(SeqCst), PARKED | EXITED)
            || !self.queue.is_empty()
            || self.local_len.load(Relaxed) != 0
    }

    /// Takes one task that waits on this worker: the oldest of its own run
    /// queue, else of its queue of pushes.
    fn steal(&self) -> Option<Task> {
        self.thief.steal().or_else(|| self.queue.pop())
    }

    /// Whether a call or a push is waiting (what a worker about to sleep
    /// re-checks).
    #[inline]
    fn has_news(&self) -> bool {
        !self.queue.is_empty() || self.watched.call.load(SeqCst)
    }

    /// Wakes the worker if it is parked. Call after publishing the reason
    /// (a push, a stop) and a SeqCst fence.
    #[inline]
    pub(crate) fn wake_if_parked(&self) {
        if self.state.load(SeqCst) == PARKED
            && self
                .state
                .compare_exchange(PARKED, RUNNING, SeqCst, Relaxed)
                .is_ok()
        {
            self.unpark();
        }
    }

    #[cold]
    fn unpark(&self) {
        self.counters.unparks.fetch_add(1, Relaxed);
        if let Some(t) = &*self.thread.lock() {
            t.unpark();
        }
    }
}
