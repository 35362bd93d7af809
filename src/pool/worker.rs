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

use std::cell::{Cell, RefCell};
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;

use crate::pool::executor::Shared;
use crate::pool::observe::StepLocal;
use crate::pool::source::{SourceRef, UnitRef};
use crate::pool::task::Task;
use crate::pool::turns::Turns;
use crate::sync::atomic::{
    fence, AtomicBool, AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering::*,
};
use crate::sync::{spin_loop, thread, Arc, Mutex, Queue, RunQueue, Thief};

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
    /// Failed attempts that a retrying handler runs again (`poison.rs`).
    pub(crate) retried: AtomicU64,
    /// Messages a retrying handler gave up on.
    pub(crate) dead_lettered: AtomicU64,
    /// Messages not run because their deadline passed (`deadline.rs`).
    pub(crate) expired: AtomicU64,
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

/// `WorkerCx::in_port` outside a port's turn.
const NO_PORT: usize = usize::MAX;

/// What a running task knows about the worker running it.
pub(crate) struct WorkerCx<'a> {
    pub(crate) shared: &'a Shared,
    pub(crate) index: usize,
    /// The worker's FIFO run queue. Tasks it queues itself (a mailbox its
    /// port revived, a mailbox yielding after `throughput` messages or woken
    /// during its poll) go here without atomics; tasks from other threads
    /// arrive through `Worker::queue` and are appended here in arrival order
    /// before the next task is taken, so the order stays FIFO. Only this
    /// thread pushes and pops; an idle worker may take the oldest task
    /// while this one is stuck in a step (`Worker::thief`).
    local: RunQueue<Task>,
    /// Steps begun (see `Worker::steps`, which this mirrors).
    progress: Cell<u32>,
    /// Credit units of finished messages not given back yet: returning them
    /// in small batches keeps the credit's cache line from crossing cores on
    /// every message. Given back when the batch is full, before a message of
    /// another receiver starts, and before the worker waits for work.
    pending: Cell<Option<(SourceRef, u64)>>,
    /// Tasks this worker has taken from its queue (wrapping): a mailbox
    /// revived by the very task that followed its last turn continues that
    /// turn (see `Mailbox::revived`).
    ticks: Cell<u32>,
    /// The port whose turn runs on this worker, or [`NO_PORT`] (see
    /// [`port_turn`](Self::port_turn)). The port's own worker is the home
    /// of the keys the turn's handlers send to first (see
    /// [`home_for_new_key`]).
    in_port: Cell<usize>,
    /// This worker's side of the slow-step watch (see `observe.rs`).
    pub(crate) steps: StepLocal,
    /// Counts not yet added to the metrics handles (zero-sized without the
    /// `metrics` feature).
    pub(crate) metrics: crate::pool::metrics::WorkerLocal,
    /// The message whose handler runs now (see [`Running`]).
    running: Cell<Running>,
    /// The turns of keys without a mailbox that ran lately (see `turns.rs`).
    turns: RefCell<Turns>,
}

/// What a handler running on a worker holds that a message it sends may
/// share (see `receiver.rs`, "Sending from a handler").
#[derive(Clone, Copy)]
pub(crate) enum Running {
    /// No handler runs.
    Nothing,
    /// A handler runs for a message of `source` holding `unit`; `passed`:
    /// it already passed its unit on to a follow-up (once per message).
    Held {
        unit: UnitRef,
        source: SourceRef,
        passed: bool,
    },
}

impl WorkerCx<'_> {
    /// Queues a task on this (the current) worker, at the back.
    #[inline]
    pub(crate) fn push_local(&self, task: Task) {
        self.local.push(task);
        self.publish_len(self.local.len());
    }

    /// Puts a task that already had a turn (a mailbox yielding after
    /// `throughput` messages or woken during its poll, a port with more to
    /// deliver) at the back of this worker's queue: behind what other
    /// threads pushed meanwhile too, which is appended first. Otherwise a
    /// mailbox that keeps yielding would go ahead of a task pushed while it
    /// ran, again and again.
    #[inline]
    pub(crate) fn requeue_local(&self, task: Task) {
        let me = self.me();
        if !me.queue.is_empty() {
            while let Some(t) = me.queue.pop() {
                self.local.push(t);
            }
        }
        self.local.push(task);
        self.publish_len(self.local.len());
    }

    #[inline]
    fn publish_len(&self, len: usize) {
        self.me()
            .local_len
            .store(len + usize::from(self.in_port.get() != NO_PORT), Relaxed);
    }

    /// Port `p`'s turn begins on this worker (`Some(p)`: maybe moved here
    /// from `p`'s own worker), or the turn ends (`None`): while it lasts
    /// the worker counts as having work queued (see `Worker::local_len`).
    #[inline]
    pub(crate) fn port_turn(&self, p: Option<usize>) {
        self.in_port.set(p.unwrap_or(NO_PORT));
        self.publish_len(self.local.len());
    }

    /// A stretch of a mailbox's turn ran for [`LONG_STEP_US`] or more:
    /// yield the thread, so that a thread the kernel queued behind this
    /// one on its CPU (another worker with work, a producer) runs before
    /// the next message (see "Long steps give way" in `executor.rs`).
    #[cold]
    pub(crate) fn give_way(&self) {
        self.me().counters.gave_way.fetch_add(1, Relaxed);
        crate::sync::thread::yield_now();
    }

    /// A step begins on this worker (a task, or a message in a port's
    /// slot): others see it making progress.
    #[inline]
    pub(crate) fn step(&self) {
        if !self.shared.config.work_conservation {
            return;
        }
        let n = self.progress.get().wrapping_add(1);
        self.progress.set(n);
        self.me().steps.store(n, Relaxed);
    }

    /// A handler is about to be called or polled for a message of `source`
    /// holding `unit` (`passed`: it passed the unit on to a follow-up in an
    /// earlier poll).
    #[inline]
    pub(crate) fn enter_handler(&self, source: SourceRef, unit: UnitRef, passed: bool) {
        self.running.set(Running::Held {
            unit,
            source,
            passed,
        });
    }

    /// The handler returned: the message's unit now (a share, if it passed
    /// it on) and whether it passed it on.
    #[inline]
    pub(crate) fn leave_handler(&self) -> (UnitRef, bool) {
        match self.running.replace(Running::Nothing) {
            Running::Held { unit, passed, .. } => (unit, passed),
            Running::Nothing => unreachable!("leave_handler without enter_handler"),
        }
    }

    fn me(&self) -> &Worker {
        &self.shared.workers[self.index]
    }

    /// The next task: first what other threads pushed (appended in order),
    /// then the front of the local queue.
    #[inline]
    fn next_task(&self) -> Option<Task> {
        let me = self.me();
        while let Some(t) = me.queue.pop() {
            self.local.push(t);
        }
        let task = self.local.pop();
        self.publish_len(self.local.len());
        if task.is_some() {
            self.ticks.set(self.ticks.get().wrapping_add(1));
            self.step();
        }
        task
    }

    /// Out of work: takes one task waiting behind a stuck worker's step
    /// (see "Work conservation" in `executor.rs`) onto this worker's queue.
    /// True if it found one.
    fn help(&self) -> bool {
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
            if waiting && other.look(|| self.shared.now_us()) == Look::Stuck {
                // A task queued behind the step, else the rest of a port's
                // turn that the step holds up.
                if let Some(task) = other.steal().or_else(|| self.shared.takeover(w)) {
                    self.local.push(task);
                    self.publish_len(self.local.len());
                    return true;
                }
            }
        }
        false
    }

    /// Whether another worker runs a step with work waiting behind it: then
    /// this one watches closely ([`WATCH_PARK`]).
    fn watch_others(&self) -> bool {
        let workers = &self.shared.workers;
        workers
            .iter()
            .enumerate()
            .any(|(i, w)| i != self.index && w.busy_with_backlog())
    }

    /// Parks, out of work, with work conservation on and other workers
    /// there (see "Who watches" in `executor.rs`). Counted among the deep
    /// sleepers first, it looks at the other workers and the ports: if any
    /// is active, it stops counting as deep and parks watching — for
    /// [`WATCH_PARK`] if a worker has work queued behind its step, else for
    /// [`WATCH_PARK_MAX`]; otherwise it sleeps until woken or called,
    /// counted deep.
    fn park_conserving(&self) {
        let me = self.me();
        let deep = self.shared.sleep_deep(self.index);
        let active = self
            .shared
            .workers
            .iter()
            .enumerate()
            .any(|(i, w)| i != self.index && w.active())
            || self.shared.any_port_busy();
        if active {
            // No longer deep: a caller that still sees the count finds this
            // worker unmarked (a watcher), and calls nobody.
            drop(deep);
            let timeout = if self.watch_others() {
                WATCH_PARK
            } else {
                WATCH_PARK_MAX
            };
            park_watching(me, timeout);
        } else {
            park(me);
            drop(deep);
        }
    }

    /// The number of the task this worker is running (wrapping).
    #[inline]
    pub(crate) fn tick(&self) -> u32 {
        self.ticks.get()
    }

    /// Messages the key with `hash` of port `port` ran in its current turn
    /// (see `turns.rs`).
    #[inline]
    pub(crate) fn turn_spent(&self, port: usize, hash: u64) -> u32 {
        self.turns.borrow().spent(port, hash, self.tick())
    }

    /// The key with `hash` of port `port` has run `spent` messages in its
    /// turn, which ends (or goes on) in the task running now.
    #[inline]
    pub(crate) fn record_turn(&self, port: usize, hash: u64, spent: u32) {
        self.turns
            .borrow_mut()
            .record(port, hash, spent, self.tick());
    }

    /// A message of `credit` finished on this worker.
    #[inline]
    pub(crate) fn release_credit(&self, credit: SourceRef) {
        let n = match self.pending.get() {
            Some((c, n)) if c == credit => n + 1,
            other => {
                self.flush_credit_of(other);
                1
            }
        };
        if n >= credit.batch() {
            self.pending.set(None);
            // SAFETY: the `n` finished messages each held a unit.
            unsafe { credit.release(n) };
        } else {
            self.pending.set(Some((credit, n)));
        }
    }

    /// A message holding a unit of `credit` is about to start: give back
    /// what other receivers are owed first, so a long handler never sits on
    /// them.
    #[inline]
    pub(crate) fn before_start(&self, credit: SourceRef) {
        if let Some((c, _)) = self.pending.get() {
            if c != credit {
                self.flush_credit();
            }
        }
    }

    /// Gives back every unit held back.
    pub(crate) fn flush_credit(&self) {
        let pending = self.pending.take();
        self.flush_credit_of(pending);
    }

    fn flush_credit_of(&self, pending: Option<(SourceRef, u64)>) {
        if let Some((c, n)) = pending {
            self.pending.set(None);
            // SAFETY: the `n` finished messages each held a unit.
            unsafe { c.release(n) };
        }
    }
}

// loom's `thread_local!` does not take a `const { }` initializer.
#[allow(clippy::missing_const_for_thread_local)]
mod current {
    use std::cell::Cell;
    crate::sync::thread_local! {
        /// The executor (its `Shared` address) whose worker this thread is, or 0.
        pub(super) static CURRENT: Cell<usize> = Cell::new(0);
        /// This worker thread's `WorkerCx` (it lives on the thread's stack for
        /// as long as the worker runs), or null.
        pub(super) static CX: Cell<*const ()> = Cell::new(std::ptr::null());
    }
}
use current::{CURRENT, CX};

/// Where a handler running on a worker of the executor `shared`
/// places a new key, if it has a preference: the worker its port's turn
/// belongs to, when the turn was moved here (work conservation) and that
/// worker has nothing queued — the keys a key messages first then share
/// its home, not the worker that happened to run one turn of it (W4 split
/// its two keys across the workers that way, a wake-up per message) —
/// else the current worker, if it has nothing queued besides the task it
/// is running (a port's turn counts as queued work for other threads, not
/// for the handler running inside it).
pub(crate) fn home_for_new_key(shared: &Shared) -> Option<usize> {
    if CURRENT.with(|c| c.get()) != shared.id() {
        return None;
    }
    CX.with(|cx| {
        let cx = cx.get().cast::<WorkerCx<'static>>();
        if cx.is_null() {
            return None;
        }
        // SAFETY: as in `with_worker_cx`.
        let cx = unsafe { &*cx };
        let home = cx.in_port.get();
        if home != NO_PORT
            && home != cx.index
            && home < shared.workers.len()
            && shared.workers[home].queued() == 0
        {
            return Some(home);
        }
        (cx.local.is_empty() && cx.me().queue.is_empty()).then_some(cx.index)
    })
}

/// Runs `f` with the current thread's `WorkerCx` if this thread is worker
/// `index` of the executor at `shared_id` (a handler submitting to a key on
/// its own worker).
pub(crate) fn with_worker_cx<R>(
    shared_id: usize,
    index: usize,
    f: impl FnOnce(&WorkerCx<'_>) -> R,
) -> Option<R> {
    if CURRENT.with(|c| c.get()) != shared_id {
        return None;
    }
    CX.with(|cx| {
        let cx = cx.get().cast::<WorkerCx<'static>>();
        if cx.is_null() {
            return None;
        }
        // SAFETY: as in `flush_held_credit`: set only on a worker thread to
        // its live `WorkerCx`; only `Cell`/`RefCell` access follows, and no
        // `RefCell` borrow is held while a handler runs.
        let cx = unsafe { &*cx };
        (cx.index == index).then(|| f(cx))
    })
}

/// A submitter is about to wait for credit. If it runs on a worker (a handler
/// submitting), give back the units that worker holds back first: they may
/// be the very ones it waits for.
pub(crate) fn flush_held_credit() {
    CX.with(|cx| {
        let cx = cx.get().cast::<WorkerCx<'static>>();
        if !cx.is_null() {
            // SAFETY: `CX` is set only on a worker thread, to its `WorkerCx`,
            // which outlives every call made from that thread while it is set
            // (it is cleared before the `WorkerCx` is dropped). `Cell`-only
            // access: no borrow of it is live across a handler call.
            unsafe { (*cx).flush_credit() };
        }
    });
}

/// Runs `f` with the current thread's `WorkerCx`, if it is a worker.
fn with_any_cx<R>(f: impl FnOnce(&WorkerCx<'_>) -> R) -> Option<R> {
    CX.with(|cx| {
        let cx = cx.get().cast::<WorkerCx<'static>>();
        // SAFETY: as in `flush_held_credit`.
        (!cx.is_null()).then(|| f(unsafe { &*cx }))
    })
}

/// A retrying handler's message failed an attempt and will run again
/// (`poison.rs`): counted on this worker, if it is one (it is, when the
/// dispatcher polls the handler's future).
#[cold]
pub(crate) fn count_retry() {
    with_any_cx(|cx| {
        // Only this worker's thread writes it: no RMW needed.
        let retried = &cx.me().counters.retried;
        retried.store(retried.load(Relaxed) + 1, Relaxed);
    });
    crate::pool::metrics::retried();
}

/// Whether a handler of the executor at `shared_id` runs on this thread (its
/// call or a poll of its future).
pub(crate) fn in_handler(shared_id: usize) -> bool {
    CURRENT.with(|c| c.get()) == shared_id
        && with_any_cx(|cx| !matches!(cx.running.get(), Running::Nothing)).unwrap_or(false)
}

/// From a handler of the executor at `shared_id`: shares its message's
/// unit with a message it sends (`Some(Some(unit))`: the follow-up's
/// share), or says the message passed its unit on already (`Some(None)`).
/// `None` outside a handler (or in one of another executor, whose stop
/// would not count a unit it does not know).
///
/// A message whose unit becomes a share keeps its own source alive with a
/// pin from then on: the share may be given back by the follow-up first.
pub(crate) fn take_running_unit(shared_id: usize) -> Option<Option<UnitRef>> {
    if CURRENT.with(|c| c.get()) != shared_id {
        return None;
    }
    with_any_cx(|cx| match cx.running.get() {
        Running::Nothing => None,
        Running::Held { passed: true, .. } => Some(None),
        Running::Held { unit, source, .. } => {
            if unit == UnitRef::plain(source) {
                // From now on the message holds a share, like its follow-up.
                source.pin();
                source.get().share_held();
            }
            // SAFETY: the running message holds `unit`.
            let (mine, theirs) = unsafe { unit.share() };
            cx.running.set(Running::Held {
                unit: mine,
                source,
                passed: true,
            });
            Some(Some(theirs))
        }
    })
    .flatten()
}

/// A message given a share of the running handler's unit was not accepted
/// after all: it gives the share back, and the running message may pass
/// its unit on again.
pub(crate) fn give_back_running_unit(share: UnitRef) {
    let _ = with_any_cx(|cx| {
        if let Running::Held { unit, source, .. } = cx.running.get() {
            // SAFETY: the refused message held this share; the running
            // message still holds another.
            unsafe { share.unshare() };
            cx.running.set(Running::Held {
                unit,
                source,
                passed: false,
            });
        }
    });
}

/// Whether the current thread is a worker of the executor at `shared_id`.
pub(crate) fn on_worker_of(shared_id: usize) -> bool {
    CURRENT.with(|c| c.get() == shared_id)
}

/// The index of the worker the current thread is, if it is one of the
/// executor at `shared_id`'s.
pub(crate) fn current_index(shared_id: usize) -> Option<usize> {
    if CURRENT.with(|c| c.get()) != shared_id {
        return None;
    }
    with_any_cx(|cx| cx.index)
}

/// The worker thread's main loop.
pub(crate) fn run(shared: Arc<Shared>, index: usize) {
    let me = &shared.workers[index];
    *me.thread.lock() = Some(thread::current());
    CURRENT.with(|c| c.set(shared.id()));
    if let Some(hook) = &shared.config.on_thread_start {
        hook();
    }
    shared.worker_started();
    let spin = shared.config.spin;
    let local = me
        .local
        .lock()
        .take()
        .expect("a worker's run queue is taken once");
    let cx = WorkerCx {
        shared: &shared,
        index,
        local,
        progress: Cell::new(0),
        pending: Cell::new(None),
        ticks: Cell::new(0),
        in_port: Cell::new(NO_PORT),
        steps: StepLocal::new(&shared.watch),
        metrics: crate::pool::metrics::WorkerLocal::new(),
        running: Cell::new(Running::Nothing),
        turns: RefCell::new(Turns::new()),
    };
    CX.with(|c| c.set((&cx as *const WorkerCx<'_>).cast()));
    // Allow a spin on the first idle period.
    let mut last_wait = Duration::ZERO;
    loop {
        while let Some(task) = cx.next_task() {
            if shared.is_forced() {
                task.cancel();
            } else {
                task.run(&cx);
            }
            cx.metrics.after_task(&cx);
        }
        // Out of work: counted idle from here (a submitter that sees it
        // may send work; one it does not see left work this look finds),
        // help a stuck worker, else give back held-back credit and wait.
        let conserve = shared.config.work_conservation;
        let _idle = conserve.then(|| shared.idle(index));
        if conserve && !shared.is_forced() && cx.help() {
            continue;
        }
        cx.flush_credit();
        let st = shared.state();
        if shared.should_exit(st) {
            break;
        }
        let idle_since = Instant::now();
        cx.step_idle(idle_since);
        if !spin.is_zero() && last_wait < spin {
            if spin_for_work(&shared, me, spin, idle_since, st) {
                me.counters.spin_hits.fetch_add(1, Relaxed);
                last_wait = idle_since.elapsed();
                continue;
            }
        } else {
            #[cfg(not(loom))]
            if last_wait < SETTLE_WINDOW && settle(&shared, me, st) {
                last_wait = idle_since.elapsed();
                continue;
            }
        }
        // Park: announce, then re-check everything a waker would publish:
        // a push, a stop, and (during a graceful stop) the retirement of the
        // last mailbox, whose retirer wakes only workers it sees parked.
        cx.metrics.flush(&cx);
        shared.metrics.parking();
        me.state.swap(PARKED, SeqCst);
        fence(SeqCst);
        if me.has_news() || shared.state() != st || shared.should_exit(st) {
            // Cancel the park. If a waker already flipped us to RUNNING it
            // also unparked us: the stale token only costs a spurious wake.
            let _ = me.state.compare_exchange(PARKED, RUNNING, SeqCst, Relaxed);
            shared.metrics.unparked();
            continue;
        }
        me.counters.parks.fetch_add(1, Relaxed);
        if conserve && shared.workers.len() > 1 && shared.config.watchers() {
            cx.park_conserving();
        } else {
            park(me);
        }
        shared.metrics.unparked();
        last_wait = idle_since.elapsed();
    }
    cx.flush_credit();
    cx.metrics.flush(&cx);
    // Forced stop: cancel whatever was queued or pushed meanwhile.
    while let Some(task) = cx.next_task() {
        task.cancel();
    }
    me.state.store(EXITED, SeqCst);
    // Against a push from another worker (work conservation sends a task
    // home): it sees `EXITED` after its push and cancels the task itself,
    // or this look sees the task.
    fence(SeqCst);
    while let Some(task) = cx.next_task() {
        task.cancel();
    }
    if let Some(hook) = &shared.config.on_thread_stop {
        hook();
    }
    CX.with(|c| c.set(std::ptr::null()));
    CURRENT.with(|c| c.set(0));
    shared.worker_exited();
}

/// Sleeps until woken (a pusher or a stop moves `state` out of `PARKED`).
fn park(me: &Worker) {
    while me.state.load(SeqCst) == PARKED {
        thread::park();
    }
}

/// How long a worker sleeps while another runs a step with work behind it
/// (see [`WorkerCx::watch_others`]): a step that began after every other
/// thread last looked at it is found stuck within about this long, even if
/// no submitter comes by.
const WATCH_PARK: Duration = Duration::from_micros(100);

/// How long a worker sleeps while another is active but has nothing
/// queued behind its step: a pool with one busy worker does not wake the
/// others 10,000 times a second for nothing, and a step that gets work
/// queued behind it meanwhile is found by the sampled looks of the
/// submitters that queue it, or at the next watch. (Doubling the watch
/// from [`WATCH_PARK`] up to this instead was measured no better on W7;
/// see BENCHMARKS.md.)
const WATCH_PARK_MAX: Duration = Duration::from_micros(1_600);

/// Sleeps until woken or `timeout` passed; then leaves `PARKED` itself
/// (unless a waker did: its unpark then costs one spurious wake). Under
/// loom, which has no clock, it yields instead: the timeout has passed.
fn park_watching(me: &Worker, timeout: Duration) {
    #[cfg(not(loom))]
    if me.state.load(SeqCst) == PARKED {
        thread::park_timeout(timeout);
    }
    #[cfg(loom)]
    {
        let _ = timeout;
        thread::yield_now();
    }
    let _ = me.state.compare_exchange(PARKED, RUNNING, SeqCst, Relaxed);
}

/// Spins until work arrives (true), `spin` passes, or a stop begins.
///
/// Every 64 rounds it yields its core (`sched_yield`): on a machine with
/// more runnable threads than cores, the thread it waits for (a producer,
/// a device) may be the one that needs the core, and a spin that keeps it
/// off only delays the work it waits for.
fn spin_for_work(shared: &Shared, me: &Worker, spin: Duration, start: Instant, st: usize) -> bool {
    me.state.store(SPINNING, SeqCst);
    let mut found = false;
    let mut i: u32 = 0;
    loop {
        if me.has_news() {
            found = true;
            break;
        }
        if shared.state() != st {
            break;
        }
        i = i.wrapping_add(1);
        if i % 64 == 0 {
            if start.elapsed() >= spin {
                break;
            }
            thread::yield_now();
        } else {
            spin_loop();
        }
    }
    me.state.store(RUNNING, SeqCst);
    found
}

/// Before parking, a worker whose last wait was shorter than this yields
/// its core a few times, looking for work between yields
/// ([`SETTLE_YIELDS`]); after a longer wait it parks at once.
#[cfg(not(loom))]
const SETTLE_WINDOW: Duration = Duration::from_micros(50);
#[cfg(not(loom))]
const SETTLE_YIELDS: u32 = 4;

/// The settle before a park (see [`SETTLE_WINDOW`]): true if work arrived.
/// A message that arrives while a worker yields costs its sender no
/// wake-up; the yields give the core to whichever thread the worker waits
/// for, and cost a few system calls when none is runnable.
#[cfg(not(loom))]
fn settle(shared: &Shared, me: &Worker, st: usize) -> bool {
    me.state.store(SPINNING, SeqCst);
    let mut found = false;
    for _ in 0..SETTLE_YIELDS {
        thread::yield_now();
        if me.has_news() {
            found = true;
            break;
        }
        if shared.state() != st {
            break;
        }
    }
    me.state.store(RUNNING, SeqCst);
    found
}
