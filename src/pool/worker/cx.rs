//! A worker's context: what a running task knows about the worker running
//! it (`WorkerCx`, on the worker's stack), and the thread-local through
//! which code running on a worker reaches it.

use std::cell::{Cell, RefCell};

use crate::pool::observe::StepLocal;
use crate::pool::shared::Shared;
use crate::pool::source::{SourceRef, UnitRef};
use crate::pool::task::Task;
use crate::pool::turns::Turns;
use crate::sync::atomic::Ordering::*;
use crate::sync::RunQueue;

use super::Worker;

/// `WorkerCx::in_port` outside a port's turn.
pub(super) const NO_PORT: usize = usize::MAX;

/// What a running task knows about the worker running it.
pub(crate) struct WorkerCx<'a> {
    pub(crate) shared: &'a Shared,
    pub(crate) index: usize,
    /// The worker's FIFO run queue. Tasks it queues itself (a mailbox its
    /// port's turn gave a queued message, a mailbox yielding after `throughput` messages or woken
    /// during its poll) go here without atomics; tasks from other threads
    /// arrive through `Worker::queue` and are appended here in arrival order
    /// before the next task is taken, so the order stays FIFO. Only this
    /// thread pushes and pops; an idle worker may take the oldest task
    /// while this one is stuck in a step (`Worker::thief`).
    pub(crate) local: RunQueue<Task>,
    /// Steps begun (see `Worker::steps`, which this mirrors).
    progress: Cell<u32>,
    /// Credit units of finished messages not given back yet: returning them
    /// in small batches keeps the credit's cache line from crossing cores on
    /// every message. Given back when the batch is full, before a message of
    /// another receiver starts, and before the worker waits for work.
    pending: Cell<Option<(SourceRef, u64)>>,
    /// Tasks this worker has taken from its queue (wrapping): the `Turns`
    /// tables tell "this task or the one before" by it (see `turns.rs`).
    ticks: Cell<u32>,
    /// The port whose turn runs on this worker, or [`NO_PORT`] (see
    /// [`port_turn`](Self::port_turn)). The port's own worker is the home
    /// of the keys the turn's handlers send to first (see
    /// [`home_for_new_key`]).
    in_port: Cell<usize>,
    /// This worker's side of the slow-step report (see `observe.rs`).
    pub(crate) slow_steps: StepLocal,
    /// Counts not yet added to the metrics handles (zero-sized without the
    /// `metrics` feature).
    pub(crate) metrics: crate::pool::metrics::WorkerLocal,
    /// The message whose handler runs now (see [`Handling`]).
    handling: Cell<Handling>,
    /// The turns of keys without a mailbox that ran lately (see `turns.rs`).
    turns: RefCell<Turns>,
}

/// The message whose handler a worker runs now, with the unit of credit
/// a message it sends may share (see `receiver.rs`, "Sending from a
/// handler").
#[derive(Clone, Copy)]
pub(crate) enum Handling {
    /// No handler runs.
    Nothing,
    /// A handler runs for a message of `source` holding `unit`; `passed`:
    /// it already passed its unit on to a follow-up (once per message).
    Message {
        unit: UnitRef,
        source: SourceRef,
        passed: bool,
    },
}

impl<'a> WorkerCx<'a> {
    /// Worker `index`'s context, with its run queue `local`.
    pub(super) fn new(shared: &'a Shared, index: usize, local: RunQueue<Task>) -> Self {
        WorkerCx {
            shared,
            index,
            local,
            progress: Cell::new(0),
            pending: Cell::new(None),
            ticks: Cell::new(0),
            in_port: Cell::new(NO_PORT),
            slow_steps: StepLocal::new(&shared.slow_steps),
            metrics: crate::pool::metrics::WorkerLocal::new(),
            handling: Cell::new(Handling::Nothing),
            turns: RefCell::new(Turns::new()),
        }
    }

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
    pub(crate) fn publish_len(&self, len: usize) {
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

    /// A step begins on this worker (a task, or a message run lent a
    /// port's loaner): others see it making progress.
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
        self.handling.set(Handling::Message {
            unit,
            source,
            passed,
        });
    }

    /// The handler returned: the message's unit now (a share, if it passed
    /// it on) and whether it passed it on.
    #[inline]
    pub(crate) fn leave_handler(&self) -> (UnitRef, bool) {
        match self.handling.replace(Handling::Nothing) {
            Handling::Message { unit, passed, .. } => (unit, passed),
            Handling::Nothing => unreachable!("leave_handler without enter_handler"),
        }
    }

    pub(crate) fn me(&self) -> &Worker {
        &self.shared.workers[self.index]
    }

    /// The next task: first what other threads pushed (appended in order),
    /// then the front of the local queue.
    #[inline]
    pub(super) fn next_task(&self) -> Option<Task> {
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
        pub(in crate::pool::worker) static CURRENT: Cell<usize> = Cell::new(0);
        /// This worker thread's `WorkerCx` (it lives on the thread's stack for
        /// as long as the worker runs), or null.
        pub(in crate::pool::worker) static CX: Cell<*const ()> = Cell::new(std::ptr::null());
    }
}
pub(super) use current::{CURRENT, CX};

/// Where a handler running on a worker of the executor `shared`
/// places a new key, if it has a preference: the worker its port's turn
/// belongs to, when the turn was moved here (work conservation) and that
/// worker has nothing queued — the keys a key messages first then share
/// its home, not the worker that happened to run one turn of it (which
/// would split a pair of keys that message each other across workers, a
/// wake-up per message) — else the current worker, if it has nothing queued besides the task it
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

/// Whether a handler of the executor at `shared_id` runs on this thread (its
/// call or a poll of its future).
pub(crate) fn in_handler(shared_id: usize) -> bool {
    CURRENT.with(|c| c.get()) == shared_id
        && with_any_cx(|cx| !matches!(cx.handling.get(), Handling::Nothing)).unwrap_or(false)
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
    with_any_cx(|cx| match cx.handling.get() {
        Handling::Nothing => None,
        Handling::Message { passed: true, .. } => Some(None),
        Handling::Message { unit, source, .. } => {
            if unit == UnitRef::plain(source) {
                // From now on the message holds a share, like its follow-up.
                source.pin();
                source.get().share_held();
            }
            // SAFETY: the running message holds `unit`.
            let (mine, theirs) = unsafe { unit.share() };
            cx.handling.set(Handling::Message {
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
        if let Handling::Message { unit, source, .. } = cx.handling.get() {
            // SAFETY: the refused message held this share; the running
            // message still holds another.
            unsafe { share.unshare() };
            cx.handling.set(Handling::Message {
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
