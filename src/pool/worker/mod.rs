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

use crate::pool::conserve::Watched;

pub(crate) use cx::{
    flush_held_credit, give_back_running_unit, in_handler, on_worker_of, take_running_unit,
    WorkerCx,
};
pub(crate) use run::park_until_woken;
pub(crate) use run::run;

use crossbeam_utils::CachePadded;

use crate::pool::task::Task;
use crate::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering::*};
use crate::sync::{thread, Mutex, Queue, RunQueue, Thief};

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
    /// Tasks this worker took from another's queue, or turns it took over
    /// (`conserve/steal.rs`).
    pub(crate) stolen: AtomicU64,
    /// Times this worker parked while another had work waiting (tasks
    /// queued behind its step, or deliveries in the inbox of a port whose
    /// turn it ran), and how long those parks lasted (µs).
    pub(crate) parked_beside_work: AtomicU64,
    pub(crate) idle_beside_work_us: AtomicU64,
    /// Failed attempts that a retrying handler runs again (`poison.rs`).
    pub(crate) retried: AtomicU64,
    /// Messages a retrying handler gave up on.
    pub(crate) dead_lettered: AtomicU64,
    /// Messages not run because their deadline passed (`deadline.rs`).
    pub(crate) expired: AtomicU64,
}

/// One worker's shared half.
pub(crate) struct Worker {
    /// Tasks pushed from other threads (wakes, new ports, spawns).
    pub(crate) queue: Queue<Task>,
    /// Takes the oldest task of the worker's own run queue (see "Work
    /// conservation" in `conserve/mod.rs`).
    pub(crate) thief: Thief<Task>,
    /// The run queue itself, until the worker's thread takes it.
    local: Mutex<Option<RunQueue<Task>>>,
    /// Steps the worker began (wrapping): a task taken, or a message its
    /// port runs lent. Written by the worker only (relaxed), read by
    /// whoever wonders whether it is stuck.
    pub(crate) steps: CachePadded<AtomicU32>,
    /// What watchers saw of `steps` (see [`Worker::watch`]) and calls (see
    /// `Shared::call_idle`).
    pub(crate) watched: CachePadded<Watched>,
    /// Length of the worker's local run queue, plus one during a port's
    /// turn (the rest of its inbox is work queued on this worker too;
    /// written by the worker only; for placement and stats).
    pub(crate) local_len: AtomicUsize,
    pub(crate) state: CachePadded<AtomicU8>,
    thread: Mutex<Option<thread::Thread>>,
    pub(crate) counters: CachePadded<Counters>,
}

impl Worker {
    /// Taking tasks from its queue (or about to); see "Worker state machine".
    pub(crate) const RUNNING: u8 = 0;
    /// Out of work, spinning or yielding; left by the worker only.
    pub(crate) const SPINNING: u8 = 1;
    /// Asleep; left by whoever wins `PARKED` → `RUNNING`.
    pub(crate) const PARKED: u8 = 2;
    /// Terminal, set by the worker as it leaves.
    pub(crate) const EXITED: u8 = 3;

    pub(crate) fn new() -> Self {
        let local = RunQueue::new();
        Worker {
            thief: local.thief(),
            local: Mutex::new(Some(local)),
            steps: CachePadded::new(AtomicU32::new(0)),
            watched: CachePadded::new(Watched {
                #[cfg(not(loom))]
                seen: AtomicU64::new(0),
                sleeper: AtomicBool::new(false),
                call: AtomicBool::new(false),
                #[cfg(not(loom))]
                called: AtomicU64::new(u64::MAX),
                idle: AtomicBool::new(false),
            }),
            queue: Queue::new(),
            local_len: AtomicUsize::new(0),
            state: CachePadded::new(AtomicU8::new(Worker::RUNNING)),
            thread: Mutex::new(None),
            counters: CachePadded::new(Counters::default()),
        }
    }

    /// Tasks waiting on this worker (remote and local).
    pub(crate) fn queued(&self) -> usize {
        self.queue.len() + self.local_len.load(Relaxed)
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
        if self.state.load(SeqCst) == Worker::PARKED
            && self
                .state
                .compare_exchange(Worker::PARKED, Worker::RUNNING, SeqCst, Relaxed)
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
