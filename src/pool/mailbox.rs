//! Mailboxes: what a key has while it has work waiting — its queue of
//! messages, the future of the message it is running — and the state
//! machine that makes "one at a time, in arrival order, nothing lost" hold
//! under every interleaving of delivery, wake, panic, stop and reuse.
//!
//! A key has a mailbox only while it has a backlog or a suspended future.
//! A message for a key with neither runs at once in its port's turn, in
//! the port's *slot*: a free mailbox that the port lends to one message at
//! a time (see `dispatcher.rs`). If that message's future completes in its
//! first poll, the slot is free again for the next message and the key
//! never had any state of its own; if it returns `Pending`, the slot becomes
//! the key's mailbox (the port puts it in its map of active keys and takes
//! a new slot). A mailbox whose queue runs dry, with no future left, leaves
//! the map and goes back to its port's spares, to be lent again.
//!
//! # State machine
//!
//! `state` holds one of five states plus a flag; every transition by a
//! party other than the owner is a single read-modify-write.
//!
//! - `FREE`: no key's work: a port's slot between messages, or one of its
//!   spares. Only the port's gate holder touches it. Made by: a runner
//!   whose message completed in its slot, or whose queue ran dry (under the
//!   gate, leaving the map). Left by: the port lending it (→ `RUNNING`,
//!   under the gate) or giving it a queued message (→ `SCHEDULED`).
//! - `SCHEDULED`: in its worker's queue (at least once; a stale entry from
//!   before a force stop finds it `CLOSED`). Nobody runs it. Made by: the
//!   port (a key whose turn was spent gets a mailbox with its message), a
//!   waker (from `SUSPENDED`), or the runner re-queuing itself (throughput
//!   spent, or woken during its poll).
//! - `RUNNING`: its worker runs a step. Only the runner touches `future`,
//!   `meta` and `key`. Made by: the worker that popped it (`SCHEDULED` →
//!   `RUNNING`, clearing `NOTIFIED`), or the port lending its slot.
//! - `SUSPENDED`: the current message's future returned `Pending`; no
//!   worker holds the mailbox, which is in its port's map. Made by: the
//!   runner. Left by: a waker (→ `SCHEDULED`, and it pushes the mailbox on
//!   its worker's queue) or a force stop that claims it (→ `CLOSED`, and it
//!   drops the future).
//! - `CLOSED`: terminal. A force stop took the mailbox (or the runner saw the
//!   stop). Wakes are ignored.
//! - `NOTIFIED` (flag, with `SCHEDULED` or `RUNNING`): a wake arrived while
//!   the mailbox was queued or running. If the runner's poll then returns
//!   `Pending`, it re-queues the mailbox instead of suspending, so the
//!   future is polled once more: a wake during a poll is never lost, and
//!   since only the `SUSPENDED` → `SCHEDULED` edge pushes from a waker (one
//!   CAS), never scheduled twice. Wakes on `FREE` or `CLOSED` come from
//!   wakers of finished messages (a mailbox is reused) and do nothing; a
//!   stale waker of a reused mailbox may at worst cost its new key one
//!   spurious poll, which futures tolerate.
//!
//! ```text
//!          lend (port, gate)                 queue a spent key's message (port)
//!   FREE ------------------> RUNNING <-- pop --- SCHEDULED <-------------------- FREE
//!    ^  ^   completed in slot  |  |  \                ^  ^
//!    |  +---------------------+   |   \ throughput    |  | wake
//!    |                            |    \ spent, or    |  |
//!    |  queue dry (gate, leaves   |     +-- Pending --+  |
//!    |  the map)                  |       + NOTIFIED     |
//!    +----------------------------+                      |
//!                                 | Pending              |
//!                                 v                      |
//!                             SUSPENDED -----------------+
//!   (any of them) -- force stop claims it / runner sees the stop --> CLOSED
//! ```
//!
//! # Messages
//!
//! Messages reach a mailbox only through its port, under the port's gate
//! (`deliver`, into the queue, under the queue's lock). The runner pops
//! under the queue's lock; when it finds the queue empty it takes the
//! port's gate and looks again: still empty, it leaves the map and goes
//! `FREE` under the gate, so a delivery either finds the mailbox in the map
//! (and the runner sees the message) or finds no mailbox and runs the
//! message itself. A mailbox in the map is never `FREE`.
//!
//! # Where it runs
//!
//! A mailbox belongs to one port for good (`port`: the map it joins, the
//! spares it returns to) and runs on that port's worker: wakes queue it
//! there, and so does a turn that yields. A mailbox that work conservation
//! gave to another worker (see "Work conservation" in `executor.rs`) runs
//! that turn there and then goes back (`requeue`): its deliveries come
//! through its port, and a key split from its port would cost every
//! message a hand-off between cores. A port's slot may even be taken into
//! the map while it runs, by a worker taking over the port's turn (see
//! "Taking over a turn" in `dispatcher.rs`): it is `RUNNING` then, so only
//! deliveries into its queue follow, as for any running mailbox.
//!
//! # Force stop
//!
//! The stopping thread sets `FORCED`, then for each port takes the gate,
//! rejects its inbox and takes every mailbox out of the map; then, on its
//! own thread, hands back each one's queue and claims it unless its worker
//! is running it: `SUSPENDED` or `SCHEDULED` → `CLOSED`, dropping a pending
//! future as cancelled. A runner checks `FORCED` under the queue's lock
//! before starting each message, so no message starts after the stop took
//! the queue; a running step finishes, and if its future is still pending
//! it is cancelled by the runner.

use std::collections::VecDeque;
use std::hash::Hash;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::ptr;
use std::task::{Context, Poll};

use crate::completion::{Outcome, Slot};
use crate::error::{Panic, TaskError};
use crate::pool::dispatcher::DispatcherInner;
use crate::pool::handler::Handler;
use crate::pool::observe::StepToken;
use crate::pool::source::{SourceRef, UnitRef};
use crate::pool::task::{Runnable, Task};
use crate::pool::waker::{Wake, WakerRef};
use crate::pool::worker::{WorkerCx, LONG_STEP_US};
use crate::sync::atomic::{AtomicUsize, Ordering::*};
use crate::sync::{overwrite, Arc, SpinLock, UnsafeCell};
use crate::trace;

const SCHEDULED: usize = 1;
const RUNNING: usize = 2;
const SUSPENDED: usize = 3;
const CLOSED: usize = 4;
const FREE: usize = 5;
const STATE_MASK: usize = 0b111;
const NOTIFIED: usize = 0b1000;
/// With `RUNNING`: a source stop began while the step ran; the runner looks
/// whether its message's source is the stopped one before it suspends.
const STOP_CHECK: usize = 0b1_0000;

/// One accepted message on its way through a mailbox.
pub(crate) struct Envelope<M, O> {
    pub(crate) msg: M,
    /// The completion to deliver to; `None` for fire-and-forget sends.
    pub(crate) reply: Option<Arc<Slot<O, M>>>,
    pub(crate) held: Held,
}

/// What an accepted message holds of its source until it ends.
///
/// Invariant: the message keeps `source` alive by its unit when `unit` is
/// a plain unit of `source`, and by a pin (a handle count) otherwise — when
/// it holds a share of a unit (a follow-up, or a message that passed its
/// unit on; see `receiver.rs`).
///
/// 24 bytes: a delivery's size is paid on every message (inbox slots,
/// mailbox queues), so the flag that the message passed its unit on lives
/// in the position's top bit, and the unit is one word (see `UnitRef`).
#[derive(Clone, Copy)]
pub(crate) struct Held {
    /// The receiver that accepted it (its positions, its stop).
    pub(crate) source: SourceRef,
    /// Its position, and [`PASSED`](Self::PASSED) in the top bit.
    pos: u64,
    /// The unit of credit it gives back (or leaves) when it ends.
    pub(crate) unit: UnitRef,
}

impl Held {
    /// It passed its unit on to a follow-up (at most once).
    const PASSED: u64 = 1 << 63;

    /// A message of `source` holding `unit`, before it has a position.
    #[inline]
    pub(crate) fn new(source: SourceRef, unit: UnitRef) -> Self {
        Held {
            source,
            pos: 0,
            unit,
        }
    }

    /// Its position in its source.
    #[inline]
    pub(crate) fn position(&self) -> u64 {
        self.pos & !Self::PASSED
    }

    #[inline]
    pub(crate) fn set_position(&mut self, position: u64) {
        debug_assert!(position < Self::PASSED);
        self.pos = position | (self.pos & Self::PASSED);
    }

    /// Whether it passed its unit on to a follow-up.
    #[inline]
    pub(crate) fn passed(&self) -> bool {
        self.pos & Self::PASSED != 0
    }

    /// What a handler's run left it holding.
    #[inline]
    pub(crate) fn set_unit(&mut self, (unit, passed): (UnitRef, bool)) {
        self.unit = unit;
        self.pos = self.position() | if passed { Self::PASSED } else { 0 };
    }

    /// Whether it pins `source` (see the invariant).
    #[inline]
    pub(crate) fn pinned(&self) -> bool {
        self.unit != UnitRef::plain(self.source)
    }
}

/// A message's metrics stamp: its acceptance time if the metrics sample it
/// (zero-sized without the `metrics` feature). It travels beside the
/// envelope (in the inbox slot's padding, then the mailbox queue), not in
/// it: a bigger envelope makes every delivery bigger.
pub(crate) type Stamp = crate::pool::metrics::Stamp;

/// A queued message and its stamp.
type Queued<M, O> = (Envelope<M, O>, Stamp);

/// Where the running message's outcome goes.
struct Meta<O, M> {
    reply: Option<Arc<Slot<O, M>>>,
    held: Held,
    /// Its first poll, if the metrics sample it.
    run: crate::pool::metrics::RunStart,
}

/// What a step of the current message ended with.
#[must_use]
pub(crate) enum Step {
    /// The message finished (output or panic) and was delivered.
    Done,
    /// Its future returned `Pending` (its outcome is kept in `meta`).
    Pending,
}

/// What the runner found when it asked for the next message.
enum Next<M, O> {
    Message(Envelope<M, O>, Stamp),
    /// A message of a stopped source: handed back, not started.
    Stopped(Envelope<M, O>),
    /// The queue was empty.
    Empty,
    Forced,
}

/// The result of trying to go idle after `Pending`.
#[must_use]
enum AfterPending {
    /// Parked in `SUSPENDED` until a wake.
    Suspended,
    /// A wake came during the poll: re-queued to be polled again.
    Requeued,
    /// A source stop asked to look (`STOP_CHECK`); still `RUNNING`.
    Check,
}

// `repr(C)`, hot fields first: a message that completes in its first poll
// touches `state`, `dispatcher`, `key` and `future`, which share the first
// cache line with the `Arc`'s counts (for small keys and futures); the
// queue and a suspended message's `meta` follow.
#[repr(C)]
pub(crate) struct Mailbox<K, M, H: Handler<K, M>, S> {
    state: AtomicUsize,
    dispatcher: Arc<DispatcherInner<K, M, H, S>>,
    /// The key it serves (`None` while `FREE`). Written by the port under
    /// its gate while the mailbox is `FREE`; read by the runner, the gate
    /// holder and a force stop that claimed it.
    key: UnsafeCell<Option<K>>,
    /// The running message's future. Owned by whoever holds `RUNNING` (or
    /// claimed `SUSPENDED` → `CLOSED`); pinned in place until dropped.
    future: UnsafeCell<Option<trace::Instrumented<H::Future>>>,
    /// Where a suspended message's outcome goes (stored only when its
    /// future returns `Pending`; a message finished in its first poll keeps
    /// it on the stack).
    meta: UnsafeCell<Option<Meta<H::Output, M>>>,
    queue: SpinLock<VecDeque<Queued<M, H::Output>>>,
    /// The key's hash (its submitter's); written with `key`.
    hash: UnsafeCell<u64>,
    /// The port whose map and spares it belongs to (for good). It runs on
    /// that port's worker (see "Where it runs").
    port: usize,
}

// SAFETY: the `UnsafeCell`s are only accessed by the single party that owns
// the mailbox (the state machine above hands that ownership over with
// read-modify-writes and the port's gate); everything else is `Sync` on its
// own. The future and messages move between threads, hence the `Send`
// bounds.
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
    /// A free mailbox of port `port`.
    pub(crate) fn new(port: usize, dispatcher: Arc<DispatcherInner<K, M, H, S>>) -> Self {
        Mailbox {
            state: AtomicUsize::new(FREE),
            dispatcher,
            key: UnsafeCell::new(None),
            future: UnsafeCell::new(None),
            meta: UnsafeCell::new(None),
            queue: SpinLock::new(VecDeque::new()),
            hash: UnsafeCell::new(0),
            port,
        }
    }

    /// The port it belongs to.
    #[inline]
    pub(crate) fn port(&self) -> usize {
        self.port
    }

    /// The worker it runs on: its port's.
    #[inline]
    fn home(&self) -> usize {
        self.port
    }

    /// Queues a mailbox that already had a turn again: at the back of this
    /// worker's queue, or, if it ran here only because work conservation
    /// gave it to this worker, back on its port's worker.
    #[inline]
    fn requeue(this: Arc<Self>, cx: &WorkerCx<'_>) {
        let home = this.home();
        if home == cx.index {
            cx.requeue_local(Task::new(this));
        } else {
            let shared = this.dispatcher.shared.clone();
            shared.schedule(home, Task::new(this));
        }
    }

    /// The key it serves.
    ///
    /// # Safety
    /// The caller owns the mailbox (runner, gate holder while it is in the
    /// map or free, or a force stop that claimed it) and a key is set.
    #[inline]
    pub(crate) unsafe fn key(&self) -> &K {
        // SAFETY: caller's contract: nobody writes `key` meanwhile.
        self.key
            .with(|k| unsafe { (*k).as_ref() })
            .expect("a key is set")
    }

    /// The key's hash.
    ///
    /// # Safety
    /// As for [`key`](Self::key).
    #[inline]
    pub(crate) unsafe fn hash(&self) -> u64 {
        // SAFETY: caller's contract.
        self.hash.with(|h| unsafe { *h })
    }

    /// Gives a free mailbox to `key` (the port, under its gate).
    ///
    /// # Safety
    /// The mailbox is `FREE` and the caller holds its port's gate.
    #[inline]
    pub(crate) unsafe fn assign(&self, key: K, hash: u64) {
        debug_assert_eq!(self.state.load(Relaxed) & STATE_MASK, FREE);
        // SAFETY: caller's contract: a free mailbox is only touched by the
        // gate holder.
        unsafe {
            self.key.with_mut(|k| *k = Some(key));
            self.hash.with_mut(|h| *h = hash);
        }
    }

    /// Takes the key back (a mailbox going `FREE`).
    ///
    /// # Safety
    /// As for [`assign`](Self::assign), or the runner about to make it free.
    #[inline]
    pub(crate) unsafe fn take_key(&self) -> Option<K> {
        // SAFETY: caller's contract.
        self.key.with_mut(|k| unsafe { (*k).take() })
    }

    /// The port lends this free mailbox to a message (`FREE` → `RUNNING`).
    /// A plain store: under the gate nobody else moves a free mailbox, and
    /// a stale waker only sets `NOTIFIED` on `RUNNING`.
    ///
    /// # Safety
    /// The caller holds the port's gate; the mailbox is `FREE`, with a key.
    #[inline]
    pub(crate) unsafe fn lend(&self) {
        overwrite(&self.state, RUNNING);
    }

    /// The port gives this free mailbox (just assigned) the first message
    /// of its queue: `FREE` → `SCHEDULED`; the caller queues its task.
    ///
    /// # Safety
    /// As for [`lend`](Self::lend).
    pub(crate) unsafe fn schedule_with(&self, env: Envelope<M, H::Output>, stamp: Stamp) {
        self.queue.lock().push_back((env, stamp));
        overwrite(&self.state, SCHEDULED);
    }

    /// The dispatcher it belongs to.
    pub(crate) fn dispatcher_ref(&self) -> &Arc<DispatcherInner<K, M, H, S>> {
        &self.dispatcher
    }

    /// Closes it for good (a mailbox that cannot be used any more).
    pub(crate) fn close(&self) {
        self.state.swap(CLOSED, AcqRel);
    }

    /// Whether the mailbox reached its terminal state.
    pub(crate) fn is_closed(&self) -> bool {
        self.state.load(Acquire) & STATE_MASK == CLOSED
    }

    /// Delivers a message into the queue of a mailbox in its port's map
    /// (the port, under its gate). False if the mailbox is closed: the
    /// caller fails the message.
    #[inline]
    pub(crate) fn deliver(
        &self,
        env: Envelope<M, H::Output>,
        stamp: Stamp,
    ) -> Result<(), Envelope<M, H::Output>> {
        let mut q = self.queue.lock();
        if self.is_closed() {
            return Err(env);
        }
        q.push_back((env, stamp));
        Ok(())
    }

    /// A source stop (the caller holds the port's gate, the mailbox is in
    /// its map): takes out the queued messages whose source `stopped`
    /// picks, keeping the others in order.
    pub(crate) fn take_queued(
        &self,
        stopped: &dyn Fn(SourceRef) -> bool,
    ) -> Vec<Envelope<M, H::Output>> {
        let mut q = self.queue.lock();
        if !q.iter().any(|(e, _)| stopped(e.held.source)) {
            return Vec::new();
        }
        let mut out = Vec::new();
        let all = std::mem::take(&mut *q);
        for (e, stamp) in all {
            if stopped(e.held.source) {
                out.push(e);
            } else {
                q.push_back((e, stamp));
            }
        }
        out
    }

    /// Force stop, on the stopping thread: hand back every queued message,
    /// and if the mailbox is suspended or queued, claim it and cancel its
    /// future. The caller has already taken the mailbox out of its map.
    pub(crate) fn force_stop(&self) -> usize {
        let queued = std::mem::take(&mut *self.queue.lock());
        let n = queued.len();
        for (env, _) in queued {
            // SAFETY: a mailbox in a map has a key, and nobody takes it
            // while the mailbox is out of the map and not free.
            self.dispatcher.reject(unsafe { self.key() }, env);
        }
        // Claim the mailbox unless its worker is running it (that runner sees
        // FORCED and stops, or cancels its future, after the current step).
        // A queued one is claimed too: its task, when popped, finds it closed.
        let mut cur = self.state.load(Acquire);
        loop {
            let st = cur & STATE_MASK;
            if !matches!(st, SUSPENDED | SCHEDULED | FREE) {
                break;
            }
            match self.state.compare_exchange(cur, CLOSED, SeqCst, Acquire) {
                Ok(_) => {
                    if st != FREE {
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
    /// The caller owns the mailbox's turn (`RUNNING`), a key is set and no
    /// future is stored.
    pub(crate) unsafe fn start(
        this: &Arc<Self>,
        env: Envelope<M, H::Output>,
        stamp: Stamp,
        cx: &WorkerCx<'_>,
    ) -> Step {
        // One branch when nothing is measured (no slow-step threshold, the
        // message not sampled): that copy has no step hooks at all.
        if cx.watching() || stamp.sampled() {
            // SAFETY: our caller's contract.
            unsafe { Self::start_in::<true>(this, env, stamp, cx) }
        } else {
            // SAFETY: our caller's contract.
            unsafe { Self::start_in::<false>(this, env, stamp, cx) }
        }
    }

    /// [`start`](Self::start), with its step measured (`MEASURED`) or not.
    ///
    /// # Safety
    /// As for `start`.
    #[inline(always)]
    unsafe fn start_in<const MEASURED: bool>(
        this: &Arc<Self>,
        env: Envelope<M, H::Output>,
        stamp: Stamp,
        cx: &WorkerCx<'_>,
    ) -> Step {
        let Envelope {
            msg,
            reply,
            mut held,
        } = env;
        cx.before_start(held.unit.source());
        let handler = &this.dispatcher.handler;
        // SAFETY: we own the turn, a key is set (caller's contract).
        let key = unsafe { this.key() };
        // SAFETY: as above.
        let hash = unsafe { this.hash() };
        let ident = &this.dispatcher.ident;
        let step = if MEASURED {
            cx.step_begin(ident, hash, stamp.sampled())
        } else {
            StepToken::NONE
        };
        let run = ident.metrics.first_poll(&stamp, step.started());
        let span = trace::MessageSpan::new(&ident.name, hash, cx.index);
        cx.enter_handler(held.source, held.unit, held.passed());
        let called = catch_unwind(AssertUnwindSafe(|| {
            let _entered = span.enter();
            handler.call_at(key, msg, held.position())
        }));
        let outcome = match called {
            Ok(fut) => {
                let fut = trace::instrument(fut, span);
                // SAFETY: we own the turn (caller's contract).
                unsafe {
                    this.future.with_mut(|f| ptr::write(f, Some(fut)));
                    let polled = Self::poll_in_place(this);
                    held.set_unit(cx.leave_handler());
                    match polled {
                        Poll::Ready(outcome) => outcome,
                        Poll::Pending => {
                            if MEASURED {
                                let ended = cx.step_end(ident, hash, step);
                                ident.metrics.polled(&run, step.started(), ended, false);
                            }
                            let meta = Meta { reply, held, run };
                            this.meta.with_mut(|m| ptr::write(m, Some(meta)));
                            return Step::Pending;
                        }
                    }
                }
            }
            Err(payload) => {
                held.set_unit(cx.leave_handler());
                Err(TaskError::Panicked(Panic::new(payload)))
            }
        };
        this.dispatcher.finish(key, reply, held, Some(cx), outcome);
        if MEASURED {
            let ended = cx.step_end(ident, hash, step);
            ident.metrics.polled(&run, step.started(), ended, true);
        }
        Step::Done
    }

    /// Polls the stored future once with the mailbox's waker; on `Ready` or a
    /// panic, drops it in place and delivers the outcome.
    ///
    /// # Safety
    /// The caller owns the mailbox's turn; a future and its `meta` are
    /// stored.
    unsafe fn poll_current(this: &Arc<Self>, wcx: &WorkerCx<'_>) -> Step {
        let ident = &this.dispatcher.ident;
        // SAFETY: we own the turn; a mailbox with a future has a key.
        let hash = unsafe { this.hash() };
        // SAFETY: we own the turn (caller's contract): `meta` is ours.
        let (held, run) = unsafe { this.meta.with(|m| (*m).as_ref().map(|m| (m.held, m.run))) }
            .expect("meta is stored");
        wcx.before_start(held.unit.source());
        let step = wcx.step_begin(ident, hash, run.sampled());
        wcx.enter_handler(held.source, held.unit, held.passed());
        // SAFETY: caller's contract.
        let polled = unsafe { Self::poll_in_place(this) };
        let (unit, passed) = wcx.leave_handler();
        // SAFETY: we own the turn.
        let Poll::Ready(outcome) = polled else {
            // SAFETY: as above.
            unsafe {
                this.meta.with_mut(|m| {
                    if let Some(m) = (*m).as_mut() {
                        m.held.set_unit((unit, passed));
                    }
                })
            };
            let ended = wcx.step_end(ident, hash, step);
            ident.metrics.polled(&run, step.started(), ended, false);
            return Step::Pending;
        };
        // SAFETY: we own the turn.
        let mut meta = unsafe { this.meta.with_mut(|m| (*m).take()) }.expect("meta is stored");
        meta.held.set_unit((unit, passed));
        this.dispatcher.finish(
            // SAFETY: we own the turn; a mailbox with a future has a key.
            unsafe { this.key() },
            meta.reply,
            meta.held,
            Some(wcx),
            outcome,
        );
        let ended = wcx.step_end(ident, hash, step);
        ident.metrics.polled(&run, step.started(), ended, true);
        Step::Done
    }

    /// What the current (suspended) message holds, if one is stored.
    ///
    /// # Safety
    /// The caller owns the mailbox's turn (or claimed it).
    #[inline]
    pub(crate) unsafe fn current(&self) -> Option<Held> {
        // SAFETY: caller's contract.
        self.meta.with(|m| unsafe { (*m).as_ref().map(|m| m.held) })
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
            // The handler's `poll_outcome` (a plain poll unless it makes
            // crate errors, as the retrying handler does; see `poison.rs`).
            catch_unwind(AssertUnwindSafe(|| {
                trace::in_span(fut, |fut| H::poll_outcome(fut, &mut cx))
            }))
        });
        let outcome = match polled {
            Ok(Poll::Pending) => return Poll::Pending,
            Ok(Poll::Ready(outcome)) => outcome,
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
        if !std::mem::needs_drop::<trace::Instrumented<H::Future>>() {
            // SAFETY: the owner of the turn; nothing to drop (a ready future
            // that was polled, say).
            self.future.with_mut(|f| unsafe { ptr::write(f, None) });
            return;
        }
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

    /// Asks the stored future to hand its message back (`Handler::reclaim`),
    /// in `catch_unwind`: a panic there hands nothing back.
    ///
    /// # Safety
    /// The caller owns the mailbox (its turn, or a claimed `SUSPENDED`).
    unsafe fn reclaim_future(&self) -> Option<M> {
        self.future.with_mut(|f| {
            // SAFETY: caller's contract: nobody else touches the cell; the
            // future stays where it was pinned (see `poll_in_place`).
            let fut = unsafe { (*f).as_mut() }?;
            // SAFETY: as above: it is never moved before it is dropped.
            let fut = unsafe { Pin::new_unchecked(fut) };
            catch_unwind(AssertUnwindSafe(|| trace::in_span(fut, H::reclaim)))
                .ok()
                .flatten()
        })
    }

    /// Drops a pending future as cancelled (force stop).
    ///
    /// # Safety
    /// The caller owns the mailbox (its turn, or a claimed `SUSPENDED`).
    pub(crate) unsafe fn cancel_current(&self) {
        // SAFETY: caller's contract.
        let meta = unsafe { self.meta.with_mut(|m| (*m).take()) };
        if let Some(meta) = meta {
            // A future that can hand its message back (one waiting for its
            // next attempt, see `poison.rs`) does: it ends `Rejected`.
            // SAFETY: caller's contract: the future is ours and pinned in
            // place.
            let reclaimed = unsafe { self.reclaim_future() };
            // SAFETY: caller's contract.
            unsafe { self.drop_future() };
            // SAFETY: a mailbox with a future has a key.
            let key = unsafe { self.key() };
            if let Some(msg) = reclaimed {
                // Handed back as a queued message is: counted, through its
                // completion or `on_reject`.
                let env = Envelope {
                    msg,
                    reply: meta.reply,
                    held: meta.held,
                };
                self.dispatcher.reject(key, env);
                return;
            }
            self.dispatcher.cancelled(self.home());
            self.dispatcher
                .finish(key, meta.reply, meta.held, None, Err(TaskError::Cancelled));
        }
    }

    /// The rest of a turn (`RUNNING`, no future stored): up to `budget`
    /// more messages, then yield; or, with the queue dry, leave the map and
    /// go `FREE` (see `DispatcherInner::drained`).
    pub(crate) fn turn(this: Arc<Self>, cx: &WorkerCx<'_>, mut budget: usize) {
        let shared = &this.dispatcher.shared;
        let throughput = shared.config.throughput;
        // A stretch of the turn that ran `LONG_STEP_US` gives way before
        // the next message (see "Long steps give way" in `executor.rs`):
        // `mark` is when the stretch began, `ran` its messages. The first
        // stretch begins as the turn's second message starts (a turn of
        // one message reads no clock); the clock is then read after the
        // 1st, 2nd, 4th, 8th, … message of a stretch, so a key whose
        // messages all run long yields after each of them but its turn's
        // first, and a hot key of short ones pays a few reads a turn, not
        // one a message.
        let mut ended_one = false;
        let mut mark: Option<u32> = None;
        let mut ran = 0u32;
        loop {
            if budget == 0 {
                // With nothing queued, retire rather than re-queue (a
                // re-queue may go to another worker, which may have left
                // at the end of a graceful stop).
                let empty = this.queue.lock().is_empty();
                if empty && DispatcherInner::drained(&this, cx, throughput) {
                    return;
                }
                // Fairness: go behind the other mailboxes of this worker.
                this.state.swap(SCHEDULED, AcqRel);
                return Self::requeue(this, cx);
            }
            match this.next() {
                Next::Message(env, stamp) => {
                    budget -= 1;
                    if ended_one && mark.is_none() {
                        mark = Some(shared.now_us());
                    }
                    // SAFETY: we own the turn, a key is set (the mailbox is
                    // in its port's map) and no future is stored.
                    match unsafe { Self::start(&this, env, stamp, cx) } {
                        Step::Done => {
                            ended_one = true;
                            if let Some(since) = mark {
                                ran += 1;
                                if ran.is_power_of_two()
                                    && shared.now_us().wrapping_sub(since) >= LONG_STEP_US
                                {
                                    cx.give_way();
                                    mark = Some(shared.now_us());
                                    ran = 0;
                                }
                            }
                        }
                        Step::Pending => return Self::after_pending(this, cx),
                    }
                }
                Next::Stopped(env) => {
                    // SAFETY: we own the turn; a key is set.
                    let key = unsafe { this.key() };
                    DispatcherInner::hand_over(&this.dispatcher, key, env);
                }
                Next::Empty => {
                    // Gone back to the port's spares (or closed), unless a
                    // message arrived meanwhile: then go on.
                    if DispatcherInner::drained(&this, cx, throughput - budget) {
                        return;
                    }
                }
                Next::Forced => {
                    // The stopping thread hands back the queue; we stop here.
                    this.state.swap(CLOSED, AcqRel);
                    return;
                }
            }
        }
    }

    /// Under the port's gate: if the queue is still empty, the mailbox may
    /// leave the map (true); a message that arrived meanwhile keeps it
    /// (false). The caller (the runner) holds the gate.
    ///
    /// # Safety
    /// The caller owns the turn and holds the port's gate.
    pub(crate) unsafe fn still_empty(&self) -> bool {
        self.queue.lock().is_empty()
    }

    /// Runner: the mailbox leaves its port's map (under the gate) and goes
    /// `FREE` for reuse, or `CLOSED` if a force stop began.
    ///
    /// # Safety
    /// The caller owns the turn and holds the port's gate; the queue is
    /// empty and no future is stored.
    pub(crate) unsafe fn release(&self, forced: bool) -> Option<K> {
        if forced {
            self.state.swap(CLOSED, AcqRel);
            return None;
        }
        overwrite(&self.state, FREE);
        // SAFETY: caller's contract (we own the mailbox, under the gate).
        unsafe { self.take_key() }
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
            Some((env, _)) if env.held.source.get().is_stopped() => Next::Stopped(env),
            Some((env, stamp)) => Next::Message(env, stamp),
            None => Next::Empty,
        }
    }

    /// `RUNNING` → `SUSPENDED`, or → `SCHEDULED` if woken during the poll.
    ///
    /// Against a force stop this is the store-buffering pattern: we CAS the
    /// state then load `FORCED`; the stopper sets `FORCED` then CASes the
    /// state. All four are SeqCst, so at least one side sees the other and
    /// the suspended future is cancelled exactly once (by whichever CAS wins).
    ///
    /// Against a source stop likewise: the stopper sets `STOPPED` on the
    /// source, then (under the port's gate) claims a `SUSPENDED` mailbox or
    /// adds `STOP_CHECK` to a `RUNNING` one. Either our CAS to `SUSPENDED`
    /// comes first (the stopper claims it and cancels), or it fails on
    /// `STOP_CHECK` and we look at the source ourselves, still owning the
    /// turn — never after, when the message (and its source) may be gone.
    pub(crate) fn after_pending(this: Arc<Self>, cx: &WorkerCx<'_>) {
        if this.dispatcher.shared.is_forced() {
            // SAFETY: we still own the turn.
            unsafe { this.cancel_current() };
            this.state.swap(CLOSED, AcqRel);
            return;
        }
        // SAFETY: we own the turn.
        if unsafe { this.current_is_stopped() } {
            return Self::cancel_stopped(this, cx);
        }
        match this.transition_to_idle() {
            AfterPending::Check => {
                // SAFETY: still `RUNNING`: we own the turn.
                if unsafe { this.current_is_stopped() } {
                    return Self::cancel_stopped(this, cx);
                }
                // Another source stopped: suspend after all.
                this.clear_stop_check();
                Self::after_pending(this, cx)
            }
            AfterPending::Requeued => Self::requeue(this, cx),
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

    /// Whether the current message's source is being stopped.
    ///
    /// # Safety
    /// The caller owns the turn.
    unsafe fn current_is_stopped(&self) -> bool {
        // SAFETY: caller's contract; the message keeps its source alive.
        unsafe { self.current() }.is_some_and(|h| h.source.get().is_stopped())
    }

    /// The runner cancels its current message, whose source is stopping,
    /// and goes on with its queue (the rest of its keys' messages) from
    /// the back of its worker's queue.
    fn cancel_stopped(this: Arc<Self>, cx: &WorkerCx<'_>) {
        // SAFETY: we own the turn.
        unsafe { this.cancel_current() };
        Self::turn(this, cx, 0);
    }

    fn clear_stop_check(&self) {
        self.state.fetch_and(!STOP_CHECK, AcqRel);
    }

    /// A source stop (the caller holds the port's gate; the mailbox is in
    /// its map): claims a `SUSPENDED` mailbox (→ `RUNNING`, true: the
    /// caller now owns its turn), or asks a `RUNNING` one to look before it
    /// suspends (`STOP_CHECK`, false). Others need nothing: a `SCHEDULED`
    /// mailbox's runner looks when it takes it.
    pub(crate) fn claim_for_stop(&self) -> bool {
        let mut cur = self.state.load(SeqCst);
        loop {
            let next = match cur & STATE_MASK {
                SUSPENDED => RUNNING,
                RUNNING => cur | STOP_CHECK,
                _ => return false,
            };
            match self.state.compare_exchange(cur, next, SeqCst, SeqCst) {
                Ok(_) => return cur & STATE_MASK == SUSPENDED,
                Err(actual) => cur = actual,
            }
        }
    }

    /// A stopper claimed the mailbox but its current message is of another
    /// source: suspend it again, or, if woken meanwhile, queue it.
    pub(crate) fn unclaim(this: &Arc<Self>) {
        match this.transition_to_idle() {
            AfterPending::Suspended => {}
            AfterPending::Requeued => {
                let shared = this.dispatcher.shared.clone();
                shared.schedule(this.home(), Task::new(this.clone()));
            }
            AfterPending::Check => {
                this.clear_stop_check();
                Self::unclaim(this)
            }
        }
    }

    /// A stopper cancelled the claimed mailbox's message: its worker goes
    /// on with the queue (or lets the mailbox go, if it is empty).
    pub(crate) fn resume_after_stop(this: Arc<Self>) {
        this.state.swap(SCHEDULED, AcqRel);
        let shared = this.dispatcher.shared.clone();
        shared.schedule(this.home(), Task::new(this));
    }

    fn transition_to_idle(&self) -> AfterPending {
        let mut cur = self.state.load(Acquire);
        loop {
            debug_assert_eq!(cur & STATE_MASK, RUNNING);
            if cur & STOP_CHECK != 0 {
                return AfterPending::Check;
            }
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
                CLOSED | FREE => return false,
                _ => cur | NOTIFIED,
            };
            match self.state.compare_exchange(cur, next, AcqRel, Acquire) {
                Ok(_) => return cur & STATE_MASK == SUSPENDED,
                Err(actual) => cur = actual,
            }
        }
    }
}

impl<K, M, H, S> Runnable for Mailbox<K, M, H, S>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    M: Send + 'static,
    H: Handler<K, M>,
    S: std::hash::BuildHasher + Send + Sync + 'static,
{
    fn run(this: Arc<Self>, cx: &WorkerCx<'_>, _tag: usize) {
        if !this.claim_scheduled(RUNNING) {
            return;
        }

        let mut budget = this.dispatcher.shared.config.throughput;
        // SAFETY: we own the turn.
        if this.has_current() && unsafe { this.current_is_stopped() } {
            // Woken, but its source is stopping: cancel instead of polling.
            // SAFETY: as above.
            unsafe { this.cancel_current() };
        } else if this.has_current() {
            // SAFETY: we own the turn and a future is stored.
            match unsafe { Self::poll_current(&this, cx) } {
                Step::Pending => return Self::after_pending(this, cx),
                Step::Done => budget -= 1,
            }
        }
        Self::turn(this, cx, budget);
    }

    fn cancel(this: Arc<Self>, _tag: usize) {
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
            let worker = this.home();
            let shared = this.dispatcher.shared.clone();
            shared.schedule(worker, Task::new(this));
        }
    }

    fn wake_by_ref(this: &Arc<Self>) {
        if this.transition_wake() {
            this.dispatcher
                .shared
                .schedule(this.home(), Task::new(this.clone()));
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::Held;

    /// Every delivery carries a `Held`: keep it at three words (the
    /// passed flag in the position's top bit, the unit in one word).
    #[test]
    fn held_is_three_words() {
        assert_eq!(std::mem::size_of::<Held>(), 24);
    }
}
