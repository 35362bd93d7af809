//! A worker's context: what a running task knows about the worker running
//! it (`WorkerCx`, on the worker's stack), and the thread-local through
//! which code running on a worker reaches it.

use std::cell::{Cell, RefCell};

use crate::pool::observe::StepLocal;
use crate::pool::shared::Shared;
use crate::pool::source::{SourceRef, UnitRef};
use crate::pool::task::Task;
use crate::pool::turns::{Seat, Turns};
use crate::sync::atomic::Ordering::*;
use crate::sync::RunQueue;

use super::Worker;

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
    /// Whether a port's turn runs on this worker (see
    /// [`port_turn`](Self::port_turn)).
    in_turn: Cell<bool>,
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
/// a message it sends may share (see `receiver/admit.rs`, "Sending from a
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
            in_turn: Cell::new(false),
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
            .store(len + usize::from(self.in_turn.get()), Relaxed);
    }

    /// A port's turn begins on this worker (`true`), or ends: while it
    /// lasts the worker counts as having work queued (see
    /// `Worker::local_len`).
    #[inline]
    pub(crate) fn port_turn(&self, running: bool) {
        self.in_turn.set(running);
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

    /// Messages the key at `seat` (`Turns::seat`) ran in its current turn
    /// (see `turns.rs`).
    #[inline]
    pub(crate) fn turn_spent(&self, seat: Seat) -> u32 {
        self.turns.borrow().spent(seat, self.tick())
    }

    /// The key at `seat` has run `spent` messages in its turn, which ends
    /// (or goes on) in the task running now.
    #[inline]
    pub(crate) fn record_turn(&self, seat: Seat, spent: u32) {
        self.turns.borrow_mut().record(seat, spent, self.tick());
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
        /// The executor (its `Shared` address) whose worker this thread is,
        /// or 0. Set before the worker's start hook, cleared after its stop
        /// hook.
        pub(super) static CURRENT: Cell<usize> = Cell::new(0);
        /// This worker thread's `WorkerCx` (it lives on the thread's stack
        /// for as long as the worker runs), or null. Set after the start
        /// hook, cleared after the stop hook, while `CURRENT` is set.
        pub(super) static CX: Cell<*const ()> = Cell::new(std::ptr::null());
    }
}
use current::{CURRENT, CX};

/// Marks the current thread as a worker of the executor at `shared_id`
/// (0: no longer), before its start hook and after its stop hook.
pub(super) fn mark_thread(shared_id: usize) {
    CURRENT.with(|c| c.set(shared_id));
}

/// Whether the current thread is a worker of the executor at `shared_id`
/// (its start and stop hooks included).
pub(crate) fn on_worker_of(shared_id: usize) -> bool {
    CURRENT.with(|c| c.get() == shared_id)
}

impl<'a> WorkerCx<'a> {
    /// Makes this the current thread's context until
    /// [`uninstall`](WorkerCx::uninstall), which must come before it drops.
    pub(super) fn install(&self) {
        CX.with(|c| c.set((self as *const WorkerCx<'a>).cast()));
    }

    /// The current thread's context is gone (before it drops).
    pub(super) fn uninstall() {
        CX.with(|c| c.set(std::ptr::null()));
    }
}

impl WorkerCx<'_> {
    /// A retrying handler's message failed an attempt and will run again
    /// (`poison.rs`): counted on this worker, if the caller is one (it is
    /// when the dispatcher polls the handler's future).
    #[cold]
    pub(crate) fn count_retry() {
        Self::with_current(|cx| {
            // Only this worker's thread writes it: no RMW needed.
            let retried = &cx.me().counters.retried;
            retried.store(retried.load(Relaxed) + 1, Relaxed);
        });
        crate::pool::metrics::retried();
    }

    /// The one way to the current thread's context: runs `f` with it if
    /// this thread is a worker (of any executor; see
    /// [`is_of`](Self::is_of)) and returns what `f` returns.
    pub(crate) fn with_current<R>(f: impl FnOnce(&WorkerCx<'_>) -> R) -> Option<R> {
        CX.with(|cx| {
            let cx = cx.get().cast::<WorkerCx<'static>>();
            // SAFETY: `CX` is set only on a worker thread, to its `WorkerCx`,
            // which outlives every call made from that thread while it is
            // set (`uninstall` comes before it drops). Only `Cell`/`RefCell`
            // access follows, and no `RefCell` borrow is held while a
            // handler runs.
            (!cx.is_null()).then(|| f(unsafe { &*cx }))
        })
    }

    /// Whether this is a worker of the executor at `shared_id`.
    #[inline]
    pub(crate) fn is_of(&self, shared_id: usize) -> bool {
        self.shared.id() == shared_id
    }

    /// Whether a handler runs on this worker now (its call or a poll of
    /// its future).
    pub(crate) fn in_handler(&self) -> bool {
        !matches!(self.handling.get(), Handling::Nothing)
    }

    /// From a running handler: shares its message's unit with a message
    /// it sends (`Some(unit)`: the follow-up's share), or says the message
    /// passed its unit on already (`None`). `None` outside a handler too.
    ///
    /// A message whose unit becomes a share keeps its own source alive
    /// with a handle count from then on: the share may be given back by the
    /// follow-up first.
    pub(crate) fn share_running_unit(&self) -> Option<Option<UnitRef>> {
        match self.handling.get() {
            Handling::Nothing => None,
            Handling::Message { passed: true, .. } => Some(None),
            Handling::Message { unit, source, .. } => {
                if unit == UnitRef::plain(source) {
                    // From now on the message holds a share, like its follow-up.
                    source.add_ref();
                    source.get().share_held();
                }
                // SAFETY: the running message holds `unit`.
                let (mine, theirs) = unsafe { unit.share() };
                self.handling.set(Handling::Message {
                    unit: mine,
                    source,
                    passed: true,
                });
                Some(Some(theirs))
            }
        }
    }

    /// A message given a share of the running handler's unit was not
    /// accepted after all: it gives the share back, and the running
    /// message may pass its unit on again.
    pub(crate) fn unshare_running_unit(&self, share: UnitRef) {
        if let Handling::Message { unit, source, .. } = self.handling.get() {
            // SAFETY: the refused message held this share; the running
            // message still holds another.
            unsafe { share.unshare() };
            self.handling.set(Handling::Message {
                unit,
                source,
                passed: false,
            });
        }
    }
}

// What `receiver/` and `batch.rs` ask of the current worker, by name.

/// A submitter is about to wait for credit. If it runs on a worker (a
/// handler submitting), give back the units that worker holds back first:
/// they may be the very ones it waits for.
pub(crate) fn flush_held_credit() {
    let _ = WorkerCx::with_current(|cx| cx.flush_credit());
}

/// Whether a handler of the executor at `shared_id` runs on this thread
/// (its call or a poll of its future).
pub(crate) fn in_handler(shared_id: usize) -> bool {
    WorkerCx::with_current(|cx| cx.is_of(shared_id) && cx.in_handler()).unwrap_or(false)
}

/// [`WorkerCx::share_running_unit`] on this thread, if it is a worker of
/// the executor at `shared_id` (a handler of another executor, whose stop
/// would not count a unit it does not know, shares nothing).
pub(crate) fn take_running_unit(shared_id: usize) -> Option<Option<UnitRef>> {
    WorkerCx::with_current(|cx| {
        if cx.is_of(shared_id) {
            cx.share_running_unit()
        } else {
            None
        }
    })
    .flatten()
}

/// [`WorkerCx::unshare_running_unit`] on this thread, if it is a worker.
pub(crate) fn give_back_running_unit(share: UnitRef) {
    let _ = WorkerCx::with_current(|cx| cx.unshare_running_unit(share));
}
