//! The mailbox of one key: its queue of messages, the future of the message
//! it is running, and the state machine that makes "one at a time, in arrival
//! order, nothing lost" hold under every interleaving of submit, wake, panic,
//! retirement and stop.
//!
//! # State machine
//!
//! `state` holds one of five states plus a flag; every transition is a single
//! read-modify-write — also the runner's own writes out of `RUNNING`, which
//! race a waker's CAS setting `NOTIFIED`: as a swap, the write is ordered
//! after that CAS or makes it fail, and loom (which models a plain store
//! racing a CAS too loosely: a later RMW could read the CAS's value over the
//! store) checks exactly this code.
//!
//! - `SCHEDULED`: the mailbox is in its worker's queue, exactly once. Nobody
//!   runs it. Made by: the submitter that creates the mailbox or finds it
//!   `IDLE`, a waker (from `SUSPENDED`), or the runner re-queuing itself
//!   (throughput spent, or woken during its poll).
//! - `RUNNING`: its worker runs a turn. Only the runner touches `future` and
//!   `meta`. Made by: the worker that popped it (`SCHEDULED` → `RUNNING`,
//!   clearing `NOTIFIED`).
//! - `SUSPENDED`: the current message's future returned `Pending`; no worker
//!   holds the mailbox. Made by: the runner. Left by: a waker (→ `SCHEDULED`,
//!   and it pushes the mailbox on its worker's queue) or a force stop that
//!   claims it (→ `CLOSED`, and it drops the future).
//! - `IDLE`: no message, no future, not queued, still in the dispatcher's map
//!   and in its worker's idle list, so the key's next message reuses it
//!   without allocating. Made by: the runner, under the queue lock, when it
//!   finds the queue empty. Left by: a submitter (→ `SCHEDULED`, under the
//!   queue lock after pushing), or the worker retiring it (→ `CLOSED`, under
//!   the shard lock, removing it from the map) once it has had nothing to do
//!   for `IDLE_RETIRE_AFTER` or keeps too many idle mailboxes, or a force
//!   stop (→ `CLOSED`).
//! - `CLOSED`: terminal. The mailbox was removed from its dispatcher's map
//!   (retired) or stopped by a force stop. Wakes are ignored.
//! - `NOTIFIED` (flag, with `SCHEDULED` or `RUNNING`): a wake arrived while the
//!   mailbox was queued or running. If the runner's poll then returns
//!   `Pending`, it re-queues the mailbox (`SCHEDULED`) instead of suspending,
//!   so the future is polled once more: a wake during a poll is never lost,
//!   and since only the `SUSPENDED`/`IDLE` → `SCHEDULED` edges push (each
//!   made by exactly one CAS), never scheduled twice. Wakes on `IDLE` or
//!   `CLOSED` come from wakers of finished messages and do nothing.
//!
//! ```text
//!            create (submitter)          push into IDLE (submitter)
//!                   |                  +---------------------------- IDLE <--+
//!                   v                  v                              |      |
//!   +-------->  SCHEDULED  ---- pop (worker) ---->  RUNNING  -- queue empty --+
//!   |               ^                              |  |   \                  |
//!   |  wake         |  throughput spent, or        |  |    force stop seen   | retire (worker, shard lock)
//!   |               +--- Pending + NOTIFIED -------+  |    between messages  | or force stop
//!   |                                                 | Pending    |         v
//!   +------------------  SUSPENDED  <-----------------+            +----> CLOSED
//!                            |                                             ^
//!                            +----------- force stop claims it ------------+
//! ```
//!
//! # Messages and removal
//!
//! Messages reach a mailbox through its worker's port (see `dispatcher.rs`):
//! only the mailbox's own worker pushes them (`deliver`), under the queue
//! lock, counting them in `received`. The runner goes `IDLE` only under that
//! lock after seeing the queue empty, and `deliver` checks for `IDLE` under
//! it after pushing: a message is either found by the runner or revives the
//! idle mailbox. An idle mailbox is retired (its pin removed, `IDLE` →
//! `CLOSED`) only under its key's shard lock and only when the pin's `sent`
//! equals `received`, i.e. no delivery of it is still in flight: the
//! remove-vs-submit race cannot lose a message.
//!
//! # Force stop
//!
//! The stopping thread sets `FORCED`, empties every port inbox, then walks
//! every pin: it takes each mailbox out, rejects its queued messages on its
//! own thread, and claims the mailbox unless its worker is running it:
//! `SUSPENDED`, `SCHEDULED` (the popped task then finds it `CLOSED` and is
//! dropped) or `IDLE` → `CLOSED`, dropping a pending future as cancelled. A
//! runner checks `FORCED` under the queue lock before starting each message,
//! so no message starts after the walk took the queue; a running step
//! finishes, and if its future is still pending it is cancelled by the
//! runner.

use std::collections::VecDeque;
use std::future::Future;
use std::hash::Hash;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::ptr::{self, NonNull};
use std::task::{Context, Poll};

use crate::completion::{Outcome, Slot};
use crate::error::{Panic, TaskError};
use crate::pool::credit::CreditRef;
use crate::pool::dispatcher::DispatcherInner;
use crate::pool::handler::Handler;
use crate::pool::task::{Runnable, Task};
use crate::pool::waker::{Wake, WakerRef};
use crate::pool::worker::WorkerCx;
use crate::sync::atomic::{AtomicUsize, Ordering::*};
use crate::sync::{arc_clone_raw, overwrite, Arc, SpinLock, UnsafeCell};
use crate::trace;

const SCHEDULED: usize = 1;
const RUNNING: usize = 2;
const SUSPENDED: usize = 3;
const CLOSED: usize = 4;
const IDLE: usize = 5;
const STATE_MASK: usize = 0b111;
const NOTIFIED: usize = 0b1000;

/// One accepted message on its way through a mailbox.
pub(crate) struct Envelope<M, O> {
    pub(crate) msg: M,
    /// The completion to deliver to; `None` for fire-and-forget sends.
    pub(crate) reply: Option<Arc<Slot<O, M>>>,
    /// The credit unit this message holds until it finishes.
    pub(crate) credit: CreditRef,
}

/// Where the running message's outcome goes.
struct Meta<O, M> {
    reply: Option<Arc<Slot<O, M>>>,
    credit: CreditRef,
}

/// What a step of the current message ended with.
#[must_use]
enum Step {
    /// The message finished (output or panic) and was delivered.
    Done,
    /// Its future returned `Pending`.
    Pending,
}

/// What the runner found when it asked for the next message.
enum Next<M, O> {
    Message(Envelope<M, O>),
    /// The queue was empty: the mailbox went `RUNNING` → `IDLE`.
    Idle,
    Forced,
}

/// The result of trying to go idle after `Pending`.
#[must_use]
enum AfterPending {
    /// Parked in `SUSPENDED` until a wake.
    Suspended,
    /// A wake came during the poll: re-queued to be polled again.
    Requeued,
}

/// What a port turn does with a delivery (see [`Mailbox::offer`]).
#[must_use]
pub(crate) enum Offer<K, M, H: Handler<K, M>, S> {
    /// The mailbox was idle with budget left in its turn: it is now
    /// `RUNNING`, and the caller runs the message with
    /// [`Mailbox::run_inline`] (after releasing the port's gate), handing
    /// over the reference taken for it.
    Inline(Arc<Mailbox<K, M, H, S>>, Envelope<M, H::Output>),
    /// Delivered into the mailbox's queue. `Some` if this revived the idle
    /// mailbox (its turn was spent): the caller queues the task at the back.
    Queued(Option<Task>),
}

/// A mailbox's bookkeeping between turns. Only its worker thread touches
/// it; 8 bytes, in what used to be the padding after a flag.
#[derive(Default, Clone, Copy)]
struct Turn {
    /// Whether the mailbox is in its worker's idle list.
    listed: bool,
    /// The worker's tick (low 16 bits) when the last turn ran dry.
    idle_tick: u16,
    /// Messages that turn had run; the next turn counts them against
    /// `throughput` if the very next task revived the mailbox at the front
    /// of the queue (see `Mailbox::revived`), else starts afresh.
    spent: u32,
}

// `repr(C)`, hot fields first: a message that completes in its first poll
// touches `state`, `parked`, `turn`, `dispatcher`, `key` and `future`, which
// share the first cache line with the `Arc`'s counts (for small keys and
// futures); the queue, the suspended message's `meta` and the rest follow.
#[repr(C)]
pub(crate) struct Mailbox<K, M, H: Handler<K, M>, S> {
    state: AtomicUsize,
    /// The reference an idle mailbox keeps to itself for its next turn, so
    /// reviving it costs no reference-count traffic. Only its worker thread
    /// touches it; dropped when the mailbox is retired or closed.
    parked: UnsafeCell<Option<Arc<Self>>>,
    /// What only its worker thread touches between turns (see [`Turn`]).
    turn: UnsafeCell<Turn>,
    dispatcher: Arc<DispatcherInner<K, M, H, S>>,
    key: K,
    /// The running message's future. Owned by whoever holds `RUNNING` (or
    /// claimed `SUSPENDED` → `CLOSED`); pinned in place until dropped.
    future: UnsafeCell<Option<trace::Instrumented<H::Future>>>,
    /// Where a suspended message's outcome goes (stored only when its
    /// future returns `Pending`; a message finished in its first poll keeps
    /// it on the stack).
    meta: UnsafeCell<Option<Meta<H::Output, M>>>,
    queue: SpinLock<VecDeque<Envelope<M, H::Output>>>,
    /// The worker this mailbox always runs on (sticky).
    worker: usize,
    /// The key's hash (its submitter's).
    hash: u64,
}

// SAFETY: the `UnsafeCell`s are only accessed by the single party that owns
// the mailbox's turn (the state machine above hands that ownership over with
// AcqRel read-modify-writes), or, for `parked` and `turn`, only by the
// mailbox's worker thread; everything else is `Sync` on its own. The
// future and messages move between threads, hence the `Send` bounds.
unsafe impl<K, M, H, S> Sync for Mailbox<K, M, H, S>
where
    K: Send + Sync,
    M: Send,
    H: Handler<K, M>,
    S: Send + Sync,
{
}

// SAFETY: as above: all fields are `Send` under these bounds.
unsafe impl<K, M, H, S> Send for Mailbox<K, M, H, S>
where
    K: Send + Sync,
    M: Send,
    H: Handler<K, M>,
    S: Send + Sync,
{
}

impl<K, M, H, S> Mailbox<K, M, H, S>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    M: Send + 'static,
    H: Handler<K, M>,
    S: std::hash::BuildHasher + Send + Sync + 'static,
{
    /// A new, idle mailbox pinned to `worker`; its first message arrives
    /// through the worker's port like every other.
    pub(crate) fn new(
        key: K,
        hash: u64,
        worker: usize,
        dispatcher: Arc<DispatcherInner<K, M, H, S>>,
    ) -> Self {
        Mailbox {
            state: AtomicUsize::new(IDLE),
            worker,
            hash,
            key,
            queue: SpinLock::new(VecDeque::new()),
            parked: UnsafeCell::new(None),
            future: UnsafeCell::new(None),
            meta: UnsafeCell::new(None),
            turn: UnsafeCell::new(Turn::default()),
            dispatcher,
        }
    }

    pub(crate) fn key(&self) -> &K {
        &self.key
    }

    /// The key's hash (its submitter's).
    pub(crate) fn hash(&self) -> u64 {
        self.hash
    }

    /// Whether the mailbox reached its terminal state.
    pub(crate) fn is_closed(&self) -> bool {
        self.state.load(Acquire) & STATE_MASK == CLOSED
    }

    /// Whether the mailbox is `IDLE` (no message, no future, not queued).
    pub(crate) fn is_idle(&self) -> bool {
        self.state.load(Acquire) & STATE_MASK == IDLE
    }

    /// Whether the mailbox has no work (idle, waiting to be retired, or
    /// closed).
    pub(crate) fn is_at_rest(&self) -> bool {
        matches!(self.state.load(Acquire) & STATE_MASK, IDLE | CLOSED)
    }

    /// Delivers a message (its worker's port, on the worker). Returns true
    /// if the mailbox was idle: this call moved it `IDLE` → `SCHEDULED` and
    /// the caller must queue it (see [`take_parked`](Self::take_parked)).
    #[inline]
    pub(crate) fn deliver(&self, env: Envelope<M, H::Output>) -> bool {
        let mut q = self.queue.lock();
        q.push_back(env);
        // The runner goes idle only under this lock, so either it is still
        // running (and will find the message) or it is idle and we revive it.
        let revive = self.state.load(Relaxed) == IDLE
            && self
                .state
                .compare_exchange(IDLE, SCHEDULED, AcqRel, Relaxed)
                .is_ok();
        drop(q);
        revive
    }

    /// A delivery of this mailbox's port, in the port's turn on its worker.
    ///
    /// An idle mailbox whose turn has budget left takes the message at once
    /// (`IDLE` → `RUNNING`; the caller runs it with [`run_inline`]): its
    /// message is the next in line, so the handler runs without a trip
    /// through the queue and the worker's run queue. The turn is the one
    /// the mailbox ran last if that was in this very task, or in the task
    /// just before it (its turn only ran dry because its next messages were
    /// still in the inbox); otherwise a fresh one. Its budget spent, or a
    /// mailbox that is queued, running or suspended, the message goes into
    /// the queue; a revived one goes to the back of the worker's queue, as
    /// a mailbox that used up its turn does.
    ///
    /// Plain stores suffice for `IDLE` → `RUNNING`: the port's gate is held
    /// and not closed, so no force stop is past its inbox step for this
    /// dispatcher (none claims mailboxes), retirement is this thread's, and
    /// a stale waker only sets `NOTIFIED` on `RUNNING`.
    ///
    /// [`run_inline`]: Self::run_inline
    ///
    /// # Safety
    /// On the mailbox's worker thread, in its port's turn, with the port's
    /// gate held and not closed; `ptr` is the mailbox's `Arc` pointer, kept
    /// alive by its pin (this delivery is counted in `sent`).
    #[inline]
    pub(crate) unsafe fn offer(
        ptr: NonNull<Self>,
        env: Envelope<M, H::Output>,
        cx: &WorkerCx<'_>,
    ) -> Offer<K, M, H, S> {
        // SAFETY: the pin keeps the mailbox alive (caller's contract).
        let this = unsafe { ptr.as_ref() };
        if this.state.load(Relaxed) == IDLE && !this.dispatcher.shared.is_forced() {
            let throughput = this.dispatcher.shared.config.throughput;
            let tick = cx.tick() as u16;
            // SAFETY: only the worker thread touches `turn`.
            let spent = this.turn.with_mut(|t| unsafe {
                let continues = (*t).idle_tick == tick || (*t).idle_tick.wrapping_add(1) == tick;
                if !continues {
                    (*t).spent = 0;
                }
                (*t).spent as usize
            });
            if spent < throughput {
                overwrite(&this.state, RUNNING);
                // Our own reference, taken under the gate: once it is
                // released a force stop may take the mailbox out of the map.
                // SAFETY: we are the mailbox's worker thread.
                let own = unsafe { this.take_parked() }.unwrap_or_else(|| {
                    // A new mailbox has no parked reference: take one.
                    // SAFETY: `ptr` is an `Arc`'s, kept alive by the map.
                    unsafe { arc_clone_raw(ptr.as_ptr().cast_const()) }
                });
                return Offer::Inline(own, env);
            }
        }
        if !this.deliver(env) {
            return Offer::Queued(None);
        }
        // Revived with its turn spent: a fresh turn, at the back.
        // SAFETY: only the worker thread touches `turn`.
        this.turn.with_mut(|t| unsafe { (*t).spent = 0 });
        // SAFETY: we are the mailbox's worker thread.
        let arc = unsafe { this.take_parked() }.unwrap_or_else(|| {
            // A new mailbox has no parked reference: take one.
            // SAFETY: `ptr` is an `Arc`'s, kept alive by the map.
            unsafe { arc_clone_raw(ptr.as_ptr().cast_const()) }
        });
        Offer::Queued(Some(Task::new(arc)))
    }

    /// Runs the message [`offer`](Self::offer) took inline, then goes on
    /// with the mailbox's turn (its queue is empty unless something was
    /// delivered meanwhile) and goes idle as a turn does. On the mailbox's
    /// worker thread, with the reference `offer` handed out.
    pub(crate) fn run_inline(own: Arc<Self>, env: Envelope<M, H::Output>, cx: &WorkerCx<'_>) {
        let throughput = own.dispatcher.shared.config.throughput;
        // SAFETY: only the worker thread touches `turn`.
        let spent = own.turn.with_mut(|t| unsafe { (*t).spent }) as usize;
        // SAFETY: we own the turn (`RUNNING`, set by `offer`) and no future
        // is stored (the mailbox was idle).
        match unsafe { Self::start(&own, env, cx) } {
            Step::Done if !own.dispatcher.shared.is_forced() => {
                // Nothing can have reached the queue meanwhile: deliveries
                // come through the port (whose turn this is; a handler's
                // direct delivery needs it idle) and a thief never takes a
                // running mailbox. So go idle without taking the queue's
                // lock. A force stop that found us running left us alone (it
                // took our empty queue); one that comes later finds us idle.
                overwrite(&own.state, IDLE);
                Self::went_idle(own, cx, spent + 1);
            }
            Step::Done => Self::turn(own, cx, throughput - spent - 1),
            Step::Pending => Self::after_pending(own, cx),
        }
    }

    /// The reference the mailbox kept to itself when it went idle (none for
    /// a new mailbox).
    ///
    /// # Safety
    /// Only on the mailbox's worker thread.
    #[inline]
    pub(crate) unsafe fn take_parked(&self) -> Option<Arc<Self>> {
        // SAFETY: only the mailbox's worker thread touches `parked`
        // (caller's contract).
        self.parked.with_mut(|p| unsafe { (*p).take() })
    }

    /// Under the shard lock: closes the mailbox if it is idle, so it can be
    /// removed from the map.
    pub(crate) fn close_if_idle(&self) -> bool {
        self.state
            .compare_exchange(IDLE, CLOSED, AcqRel, Acquire)
            .is_ok()
    }

    /// Force stop, on the stopping thread: hand back every queued message,
    /// and if the mailbox is suspended, claim it and cancel its future.
    /// The caller has already taken the mailbox out of its map.
    pub(crate) fn force_stop(&self) -> usize {
        let queued = std::mem::take(&mut *self.queue.lock());
        let n = queued.len();
        for env in queued {
            self.dispatcher.reject(&self.key, env);
        }
        // Claim the mailbox unless its worker is running it (that runner sees
        // FORCED and stops, or cancels its future, after the current step).
        // A queued one is claimed too: its task, when popped, finds it closed.
        let mut cur = self.state.load(Acquire);
        loop {
            let st = cur & STATE_MASK;
            if !matches!(st, SUSPENDED | SCHEDULED | IDLE) {
                break;
            }
            match self.state.compare_exchange(cur, CLOSED, SeqCst, Acquire) {
                Ok(_) => {
                    if st != IDLE {
                        // SAFETY: the CAS made us the owner of the mailbox.
                        unsafe { self.cancel_current() };
                    }
                    break;
                }
                Err(actual) => cur = actual,
            }
        }
        n
    }

    // ----- the runner's side -------------------------------------------------

    /// Starts `env`: calls the handler and polls the future once.
    ///
    /// # Safety
    /// The caller owns the mailbox's turn (`RUNNING`) and no future is stored.
    unsafe fn start(this: &Arc<Self>, env: Envelope<M, H::Output>, cx: &WorkerCx<'_>) -> Step {
        let Envelope { msg, reply, credit } = env;
        cx.before_start(credit);
        let handler = &this.dispatcher.handler;
        let span = trace::MessageSpan::new(this.hash, cx.index);
        let called = catch_unwind(AssertUnwindSafe(|| {
            let _entered = span.enter();
            handler.call(&this.key, msg)
        }));
        let outcome = match called {
            Ok(fut) => {
                let fut = trace::instrument(fut, span);
                // SAFETY: we own the turn (caller's contract).
                unsafe {
                    this.future.with_mut(|f| ptr::write(f, Some(fut)));
                    match Self::poll_in_place(this) {
                        Poll::Ready(outcome) => outcome,
                        Poll::Pending => {
                            this.meta
                                .with_mut(|m| ptr::write(m, Some(Meta { reply, credit })));
                            return Step::Pending;
                        }
                    }
                }
            }
            Err(payload) => Err(TaskError::Panicked(Panic::new(payload))),
        };
        this.dispatcher
            .finish(&this.key, cx.index, reply, credit, Some(cx), outcome);
        Step::Done
    }

    /// Polls the stored future once with the mailbox's waker; on `Ready` or a
    /// panic, drops it in place and delivers the outcome.
    ///
    /// # Safety
    /// The caller owns the mailbox's turn; a future and its `meta` are
    /// stored.
    unsafe fn poll_current(this: &Arc<Self>, wcx: &WorkerCx<'_>) -> Step {
        // SAFETY: caller's contract.
        let Poll::Ready(outcome) = (unsafe { Self::poll_in_place(this) }) else {
            return Step::Pending;
        };
        // SAFETY: we own the turn.
        let meta = unsafe { this.meta.with_mut(|m| (*m).take()) }.expect("meta is stored");
        this.dispatcher.finish(
            &this.key,
            wcx.index,
            meta.reply,
            meta.credit,
            Some(wcx),
            outcome,
        );
        Step::Done
    }

    /// Polls the stored future once with the mailbox's waker; if it is done
    /// (an output or a panic), drops it in place and returns the outcome.
    ///
    /// # Safety
    /// The caller owns the mailbox's turn and a future is stored.
    #[inline]
    unsafe fn poll_in_place(this: &Arc<Self>) -> Poll<Outcome<H::Output, M>> {
        let waker = WakerRef::new(this);
        let mut cx = Context::from_waker(&waker);
        let polled = this.future.with_mut(|f| {
            // SAFETY: we own the turn, so nobody else touches the cell; the
            // future is stored inside the `Arc`'d mailbox and is never moved
            // before it is dropped in place (`drop_future`), so pinning it is
            // sound.
            let fut = unsafe { Pin::new_unchecked((*f).as_mut().expect("a future is stored")) };
            catch_unwind(AssertUnwindSafe(|| fut.poll(&mut cx)))
        });
        let outcome = match polled {
            Ok(Poll::Pending) => return Poll::Pending,
            Ok(Poll::Ready(out)) => Ok(out),
            Err(payload) => Err(TaskError::Panicked(Panic::new(payload))),
        };
        // SAFETY: we own the turn.
        unsafe { this.drop_future() };
        Poll::Ready(outcome)
    }

    /// Drops the stored future in place (it is pinned), even if its `Drop`
    /// panics; the panic is swallowed (the outcome is already decided).
    ///
    /// # Safety
    /// The caller owns the mailbox's turn.
    unsafe fn drop_future(&self) {
        struct Clear<F>(*mut Option<F>);
        impl<F> Drop for Clear<F> {
            fn drop(&mut self) {
                // SAFETY: the inner value was dropped in place (or its drop
                // unwound, which also ends its life); overwrite without
                // dropping again.
                unsafe { ptr::write(self.0, None) }
            }
        }
        self.future.with_mut(|f| {
            let _ = catch_unwind(AssertUnwindSafe(|| {
                let _clear = Clear(f);
                // SAFETY: the owner of the turn may drop the future; it is
                // dropped where it was pinned.
                if let Some(fut) = unsafe { (*f).as_mut() } {
                    // SAFETY: `fut` is valid and never used again: `_clear`
                    // overwrites the slot with `None` without dropping it.
                    unsafe { ptr::drop_in_place(fut) }
                }
            }));
        });
    }

    /// Drops a pending future as cancelled (force stop).
    ///
    /// # Safety
    /// The caller owns the mailbox (its turn, or a claimed `SUSPENDED`).
    unsafe fn cancel_current(&self) {
        // SAFETY: caller's contract.
        let meta = unsafe { self.meta.with_mut(|m| (*m).take()) };
        if let Some(meta) = meta {
            // SAFETY: caller's contract.
            unsafe { self.drop_future() };
            self.dispatcher.cancelled(self.worker);
            self.dispatcher.finish(
                &self.key,
                self.worker,
                meta.reply,
                meta.credit,
                None,
                Err(TaskError::Cancelled),
            );
        }
    }

    /// The mailbox went `IDLE` after `spent` messages in its turn: remember
    /// the turn (see `offer`), and stay in the map for a while, so the
    /// key's next message reuses this mailbox; the worker retires it later.
    fn went_idle(this: Arc<Self>, cx: &WorkerCx<'_>, spent: usize) {
        let spent = spent.min(u32::MAX as usize) as u32;
        let idle_tick = cx.tick() as u16;
        // SAFETY: we own the turn, on the mailbox's worker thread.
        let was_listed = this.turn.with_mut(|t| unsafe {
            let listed = (*t).listed;
            *t = Turn {
                listed: true,
                idle_tick,
                spent,
            };
            listed
        });
        let list = (!was_listed).then(|| Task::new(this.clone()));
        // Keep our reference for the next turn (see `parked`), before
        // listing: listing may retire idle mailboxes.
        let cell: *const UnsafeCell<Option<Arc<Self>>> = &this.parked;
        // SAFETY: we are the mailbox's worker thread, the only one touching
        // `parked`; the cell lives inside the mailbox, which the reference
        // we store keeps alive.
        let stale = unsafe { (*cell).with_mut(|p| (*p).replace(this)) };
        debug_assert!(stale.is_none());
        if let Some(task) = list {
            cx.went_idle(task);
        }
    }

    /// The rest of a turn (`RUNNING`, no future stored): up to `budget`
    /// more messages, then yield; or go idle when the queue runs dry.
    fn turn(this: Arc<Self>, cx: &WorkerCx<'_>, mut budget: usize) {
        let throughput = this.dispatcher.shared.config.throughput;
        loop {
            if budget == 0 {
                // Fairness: go behind the other mailboxes of this worker.
                this.state.swap(SCHEDULED, AcqRel);
                cx.requeue_local(Task::new(this));
                return;
            }
            match this.next() {
                Next::Message(env) => {
                    budget -= 1;
                    // SAFETY: we own the turn and no future is stored.
                    match unsafe { Self::start(&this, env, cx) } {
                        Step::Done => {}
                        Step::Pending => return Self::after_pending(this, cx),
                    }
                }
                Next::Idle => {
                    let spent = throughput - budget;
                    return Self::went_idle(this, cx, spent);
                }
                Next::Forced => {
                    // The stopping thread hands back the queue; we stop here.
                    this.state.swap(CLOSED, AcqRel);
                    return;
                }
            }
        }
    }

    fn has_current(&self) -> bool {
        // SAFETY: only called by the owner of the turn.
        self.meta.with(|m| unsafe { (*m).is_some() })
    }

    fn next(&self) -> Next<M, H::Output> {
        let mut q = self.queue.lock();
        // Checked under the queue lock: a force stop sets FORCED before it
        // takes the queue, so after it took it nothing here starts.
        if self.dispatcher.shared.is_forced() {
            return Next::Forced;
        }
        match q.pop_front() {
            Some(env) => Next::Message(env),
            None => {
                // Go idle under the queue lock (see `push`). A wake racing
                // this is stale: no future is pending between messages.
                self.state.swap(IDLE, AcqRel);
                Next::Idle
            }
        }
    }

    /// `RUNNING` → `SUSPENDED`, or → `SCHEDULED` if woken during the poll.
    ///
    /// Against a force stop this is the store-buffering pattern: we CAS the
    /// state then load `FORCED`; the stopper sets `FORCED` then CASes the
    /// state. All four are SeqCst, so at least one side sees the other and
    /// the suspended future is cancelled exactly once (by whichever CAS wins).
    fn after_pending(this: Arc<Self>, cx: &WorkerCx<'_>) {
        if this.dispatcher.shared.is_forced() {
            // SAFETY: we still own the turn.
            unsafe { this.cancel_current() };
            this.state.swap(CLOSED, AcqRel);
            return;
        }
        match this.transition_to_idle() {
            AfterPending::Requeued => cx.requeue_local(Task::new(this)),
            AfterPending::Suspended => {
                // A force stop that began before we suspended may have found
                // us RUNNING and left us to cancel ourselves.
                if this.dispatcher.shared.is_forced()
                    && this
                        .state
                        .compare_exchange(SUSPENDED, CLOSED, SeqCst, Acquire)
                        .is_ok()
                {
                    // SAFETY: the CAS made us the owner again.
                    unsafe { this.cancel_current() };
                }
            }
        }
    }

    fn transition_to_idle(&self) -> AfterPending {
        let mut cur = self.state.load(Acquire);
        loop {
            debug_assert_eq!(cur & STATE_MASK, RUNNING);
            let (next, res) = if cur & NOTIFIED != 0 {
                (SCHEDULED, AfterPending::Requeued)
            } else {
                (SUSPENDED, AfterPending::Suspended)
            };
            match self.state.compare_exchange(cur, next, SeqCst, Acquire) {
                Ok(_) => return res,
                Err(actual) => cur = actual,
            }
        }
    }

    /// The popper of a queued mailbox takes it: `SCHEDULED` → `to`
    /// (clearing `NOTIFIED`). False if a force stop claimed it first
    /// (`CLOSED`): the task is then just dropped.
    fn claim_scheduled(&self, to: usize) -> bool {
        let mut cur = self.state.load(Acquire);
        loop {
            match cur & STATE_MASK {
                SCHEDULED => match self.state.compare_exchange(cur, to, SeqCst, Acquire) {
                    Ok(_) => return true,
                    Err(actual) => cur = actual,
                },
                CLOSED => return false,
                other => {
                    debug_assert!(false, "popped a mailbox in state {other}");
                    return false;
                }
            }
        }
    }

    /// The wake transition. Returns true if the caller moved the mailbox
    /// `SUSPENDED` → `SCHEDULED` and must push it on its worker's queue.
    fn transition_wake(&self) -> bool {
        let mut cur = self.state.load(Acquire);
        loop {
            let next = match cur & STATE_MASK {
                SUSPENDED => SCHEDULED,
                // No future is pending: a stale waker of a finished message.
                CLOSED | IDLE => return false,
                _ => cur | NOTIFIED,
            };
            match self.state.compare_exchange(cur, next, AcqRel, Acquire) {
                Ok(_) => return cur & STATE_MASK == SUSPENDED,
                Err(actual) => cur = actual,
            }
        }
    }
}

/// The outcome of [`DispatcherInner::retire`].
#[must_use]
pub(crate) enum Retire {
    /// Removed from the map and closed.
    Retired,
    /// Not idle any more (a message arrived): left alone.
    Busy,
}

impl<K, M, H, S> Runnable for Mailbox<K, M, H, S>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    M: Send + 'static,
    H: Handler<K, M>,
    S: std::hash::BuildHasher + Send + Sync + 'static,
{
    fn run(this: Arc<Self>, cx: &WorkerCx<'_>) {
        debug_assert_eq!(cx.index, this.worker, "a mailbox ran off its worker");
        if !this.claim_scheduled(RUNNING) {
            return;
        }
        let throughput = this.dispatcher.shared.config.throughput;
        // SAFETY: we own the turn, on the mailbox's worker thread.
        let carried =
            this.turn
                .with_mut(|t| unsafe { std::mem::take(&mut (*t).spent) }) as usize;
        let mut budget = throughput.saturating_sub(carried).max(1);
        if this.has_current() {
            // SAFETY: we own the turn and a future is stored.
            match unsafe { Self::poll_current(&this, cx) } {
                Step::Pending => return Self::after_pending(this, cx),
                Step::Done => budget -= 1,
            }
        }
        Self::turn(this, cx, budget);
    }

    fn retire(this: Arc<Self>) {
        // SAFETY: `retire` runs on the mailbox's worker thread.
        this.turn.with_mut(|t| unsafe { (*t).listed = false });
        let _ = this.dispatcher.retire(&this, this.worker);
        // Drop the reference it kept to itself whatever happened: closed
        // for good, it would never be freed; still busy (a delivery in
        // flight), it is no longer listed and a force stop could reject that
        // delivery, leaving nobody to drop it. Reviving it then takes a new
        // reference instead.
        // SAFETY: `retire` runs on the mailbox's worker thread.
        drop(unsafe { this.take_parked() });
    }

    fn cancel(this: Arc<Self>) {
        if this.claim_scheduled(CLOSED) {
            // SAFETY: it was SCHEDULED and we popped it: the turn is ours.
            unsafe { this.cancel_current() };
        }
    }
}

impl<K, M, H, S> Wake for Mailbox<K, M, H, S>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    M: Send + 'static,
    H: Handler<K, M>,
    S: std::hash::BuildHasher + Send + Sync + 'static,
{
    fn wake(this: Arc<Self>) {
        if this.transition_wake() {
            let worker = this.worker;
            let shared = this.dispatcher.shared.clone();
            shared.schedule(worker, Task::new(this));
        }
    }

    fn wake_by_ref(this: &Arc<Self>) {
        if this.transition_wake() {
            this.dispatcher
                .shared
                .schedule(this.worker, Task::new(this.clone()));
        }
    }
}
