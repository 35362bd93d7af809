//! Mailboxes: what a key has while it has work waiting — its queue of
//! messages, the future of the message it is running — and the state
//! machine that makes "one at a time, in arrival order, nothing lost" hold
//! under every interleaving of delivery, wake, panic, stop and reuse.
//!
//! A key has a mailbox only while it has a backlog or a suspended future.
//! A message for a key with neither runs at once in its port's turn, lent
//! the port's *loaner*: a free mailbox that the port lends to one message
//! at a time (see `dispatcher/turn.rs`). If that message's future completes
//! in its first poll, the loaner is free again for the next message and the
//! key never had any state of its own; if it returns `Pending`, the loaner
//! becomes the key's mailbox (the port puts it in its map of active keys
//! and takes a new loaner). A mailbox whose queue runs dry, with no future left, leaves
//! the map and goes back to its port's spares, to be lent again.
//!
//! # State machine
//!
//! In `state.rs` ([`MailboxState`]): FREE / SCHEDULED / RUNNING /
//! SUSPENDED / CLOSED, the `NOTIFIED` and `STOP_CHECK` flags, who makes
//! each transition, and the diagram.
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
//! spares it returns to) and runs wherever its task is taken: its *home*
//! is the worker that ran it last. A turn that yields goes to the back of
//! that worker's queue, and a wake queues it there — or on an idle worker
//! if that one runs a step (`Shared::schedule`). An idle worker may steal
//! it from a busy worker's queue (see `conserve/mod.rs`), and it then
//! stays on the thief. Its deliveries still come through its port, under
//! the port's gate, wherever it runs. A port's loaner may even be taken
//! into the map while it runs, by a worker that steals the port's turn
//! (see "Stealing a turn" in `dispatcher/port.rs`): it is `RUNNING` then,
//! so only deliveries into its queue follow, as for any running mailbox.
//!
//! The files: `mod.rs` (the mailbox, its cells, and what the port and the
//! stops call), `state.rs` (the state word), `run.rs` (the runner's side:
//! a message's start and polls, the rest of a turn, what follows
//! `Pending`).
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

use crate::completion::Outcome;
use crate::completion::Reply;
use crate::pool::observe::Identity;
use crate::pool::shared::Shared;
use crate::pool::source::{SourceRef, UnitRef};
use crate::pool::task::{Runnable, Task};
use crate::pool::waker::Wake;
use crate::pool::worker::WorkerCx;
use crate::pool::PoolKey;
use crate::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use crate::sync::{Arc, SpinLock, UnsafeCell};
use crate::trace;

mod run;
mod state;

pub(crate) use state::StopClaim;
use state::{AfterPending, Claim, ForceClaim, MailboxState, Woken};

/// What the messages of a mailbox's owner are: the types a mailbox stores.
pub(crate) trait Produces<K, M> {
    /// What a message produces (the handler's output).
    type Output: Send + 'static;
    /// The work of one message (the handler's future).
    type Future: std::future::Future<Output = Self::Output> + Send + 'static;
}

/// What a mailbox needs of its owner, the dispatcher whose port it belongs
/// to: declared here and implemented by the dispatcher
/// (`dispatcher/erased.rs`), so that the mailbox knows no dispatcher type.
pub(crate) trait Owner<K, M>: Produces<K, M> + Send + Sync + Sized + 'static {
    /// Calls the handler: starts the work of `msg` for `key`, the message
    /// at `position` of its source (`Handler::call_at`).
    ///
    /// `Ok`: the work was done at once, with this outcome
    /// (`Handler::call_now`); `Err`: its future, to poll.
    fn call(
        &self,
        key: &K,
        msg: M,
        position: u64,
    ) -> Result<Outcome<Self::Output, M>, Self::Future>;
    /// Polls the handler's future for its outcome (`Handler::poll_outcome`:
    /// a plain poll, unless the handler ends messages with crate errors, as
    /// a retrying one does).
    fn poll_outcome(
        fut: std::pin::Pin<&mut Self::Future>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Outcome<Self::Output, M>>;
    /// Asks a pending future for its message back (`Handler::reclaim`): a
    /// force stop hands such a message back instead of cancelling it.
    fn reclaim(fut: std::pin::Pin<&mut Self::Future>) -> Option<M>;
    /// The executor's state.
    fn shared(&self) -> &Arc<Shared>;
    /// The owner's name and metrics handles.
    fn ident(&self) -> &Identity;
    /// Delivers a finished message's outcome, records it at its position
    /// and returns its credit.
    fn finish(
        &self,
        key: &K,
        reply: Option<Arc<Reply<Self::Output, M>>>,
        held: Held,
        cx: Option<&WorkerCx<'_>>,
        outcome: Outcome<Self::Output, M>,
    );
    /// [`finish`](Self::finish) of a message whose handler returned its
    /// output, on worker `cx`: the common end, without the whole outcome.
    fn finish_ok(
        &self,
        reply: Option<Arc<Reply<Self::Output, M>>>,
        held: Held,
        cx: &WorkerCx<'_>,
        output: Self::Output,
    );
    /// Counts a suspended message cancelled on worker `worker`.
    fn cancelled(&self, worker: usize);
    /// Hands a queued message back (force stop).
    fn reject(&self, key: &K, env: Envelope<M, Self::Output>);
    /// A message of a stopped source met by a runner: hand it back.
    fn hand_over(this: &Arc<Self>, key: &K, env: Envelope<M, Self::Output>);
    /// The runner found `mailbox`'s queue empty after `spent` messages:
    /// under its port's gate, the mailbox leaves the map if it still is
    /// (`true`), or goes on (`false`).
    fn drained(mailbox: &Arc<Mailbox<K, M, Self>>, cx: &WorkerCx<'_>, spent: usize) -> bool;
}

/// One accepted message on its way through a mailbox.
pub(crate) struct Envelope<M, O> {
    pub(crate) msg: M,
    /// The completion to deliver to; `None` for fire-and-forget sends.
    pub(crate) reply: Option<Arc<Reply<O, M>>>,
    pub(crate) held: Held,
}

/// What an accepted message holds of its source until it ends.
///
/// Invariant: the message keeps `source` alive by its unit when `unit` is
/// a plain unit of `source`, and by a handle count otherwise — when
/// it holds a share of a unit (a follow-up, or a message that passed its
/// unit on; see `receiver/admit.rs`).
///
/// 24 bytes: a delivery's size is paid on every message (inbox entries,
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

    /// Whether it holds a share (and a handle count on `source`: see the invariant).
    #[inline]
    pub(crate) fn holds_share(&self) -> bool {
        self.unit != UnitRef::plain(self.source)
    }
}

/// A message's metrics stamp: its acceptance time if the metrics sample it
/// (zero-sized without the `metrics` feature). It travels beside the
/// envelope (in the inbox entry's padding, then the mailbox queue), not in
/// it: a bigger envelope makes every delivery bigger.
pub(crate) type Stamp = crate::pool::metrics::Stamp;

/// A queued message and its stamp.
type Queued<M, O> = (Envelope<M, O>, Stamp);

/// Where the running message's outcome goes.
struct Meta<O, M> {
    reply: Option<Arc<Reply<O, M>>>,
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

// `repr(C)`, hot fields first: a message that completes in its first poll
// touches `state`, `owner`, `key` and `future`, which share the first
// cache line with the `Arc`'s counts (for small keys and futures); the
// queue and a suspended message's `meta` follow.
#[repr(C)]
pub(crate) struct Mailbox<K, M, D: Produces<K, M>> {
    state: MailboxState,
    owner: Arc<D>,
    /// The key it serves (`None` while `FREE`). Written by the port under
    /// its gate while the mailbox is `FREE`; read by the runner, the gate
    /// holder and a force stop that claimed it.
    key: UnsafeCell<Option<K>>,
    /// The running message's future. Owned by whoever holds `RUNNING` (or
    /// claimed `SUSPENDED` → `CLOSED`); pinned in place until dropped.
    future: UnsafeCell<Option<trace::Instrumented<D::Future>>>,
    /// Where a suspended message's outcome goes (stored only when its
    /// future returns `Pending`; a message finished in its first poll keeps
    /// it on the stack).
    meta: UnsafeCell<Option<Meta<D::Output, M>>>,
    queue: SpinLock<VecDeque<Queued<M, D::Output>>>,
    /// The key's hash (its submitter's); written with `key`.
    hash: UnsafeCell<u64>,
    /// The port whose map and spares it belongs to (for good).
    port: usize,
    /// The worker it last ran on, where a wake queues it (see "Where it
    /// runs"). Written by its runner (relaxed: a stale home only queues it
    /// where another worker may steal it).
    home: AtomicUsize,
}

// SAFETY: the `UnsafeCell`s are only accessed by the single party that owns
// the mailbox (the state machine above hands that ownership over with
// read-modify-writes and the port's gate); everything else is `Sync` on its
// own. The future and messages move between threads, hence the `Send`
// bounds.
unsafe impl<K, M, D> Sync for Mailbox<K, M, D>
where
    K: Send + Sync,
    M: Send,
    D: Produces<K, M> + Send + Sync,
{
}

// SAFETY: as above: all fields are `Send` under these bounds.
unsafe impl<K, M, D> Send for Mailbox<K, M, D>
where
    K: Send + Sync,
    M: Send,
    D: Produces<K, M> + Send + Sync,
{
}

impl<K, M, D> Mailbox<K, M, D>
where
    K: PoolKey,
    M: Send + 'static,
    D: Owner<K, M>,
{
    /// A free mailbox of port `port`.
    pub(crate) fn new(port: usize, owner: Arc<D>) -> Self {
        Mailbox {
            state: MailboxState::new(),
            owner,
            key: UnsafeCell::new(None),
            future: UnsafeCell::new(None),
            meta: UnsafeCell::new(None),
            queue: SpinLock::new(VecDeque::new()),
            hash: UnsafeCell::new(0),
            port,
            home: AtomicUsize::new(0),
        }
    }

    /// The port it belongs to.
    #[inline]
    pub(crate) fn port(&self) -> usize {
        self.port
    }

    /// The worker it last ran on (see "Where it runs").
    #[inline]
    fn home(&self) -> usize {
        self.home.load(Relaxed)
    }

    /// It runs on worker `w` (its runner): `w` is its home from now on.
    #[inline]
    pub(crate) fn move_home(&self, w: usize) {
        if self.home.load(Relaxed) != w {
            self.home.store(w, Relaxed);
        }
    }

    /// Queues a mailbox that already had a turn again: at the back of the
    /// queue of the worker that ran it.
    #[inline]
    fn requeue(this: Arc<Self>, cx: &WorkerCx<'_>) {
        this.move_home(cx.index);
        cx.requeue_local(Task::new(this));
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
        debug_assert!(self.state.is_free());
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
    ///
    /// # Safety
    /// The caller holds the port's gate; the mailbox is `FREE`, with a key.
    #[inline]
    pub(crate) unsafe fn lend(&self) {
        self.state.lend();
    }

    /// The port gives this free mailbox (just assigned) the first message
    /// of its queue: `FREE` → `SCHEDULED`; the caller queues its task.
    ///
    /// # Safety
    /// As for [`lend`](Self::lend).
    pub(crate) unsafe fn schedule_with(&self, env: Envelope<M, D::Output>, stamp: Stamp) {
        self.queue.lock().push_back((env, stamp));
        self.state.schedule_free();
    }

    /// Its owner (the dispatcher whose port it belongs to).
    pub(crate) fn owner(&self) -> &Arc<D> {
        &self.owner
    }

    /// Closes it for good (a mailbox that cannot be used any more).
    pub(crate) fn close(&self) {
        self.state.close();
    }

    /// Whether the mailbox reached its terminal state.
    pub(crate) fn is_closed(&self) -> bool {
        self.state.is_closed()
    }

    /// Delivers a message into the queue of a mailbox in its port's map
    /// (the port, under its gate). False if the mailbox is closed: the
    /// caller fails the message.
    #[inline]
    pub(crate) fn deliver(
        &self,
        env: Envelope<M, D::Output>,
        stamp: Stamp,
    ) -> Result<(), Envelope<M, D::Output>> {
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
    ) -> Vec<Envelope<M, D::Output>> {
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
            self.owner.reject(unsafe { self.key() }, env);
        }
        // Claim the mailbox unless its worker is running it (that runner sees
        // FORCED and stops, or cancels its future, after the current step).
        if self.state.claim_for_force_stop() == ForceClaim::Owned {
            // SAFETY: the claim made us the owner of the mailbox.
            unsafe { self.cancel_current() };
        }
        n
    }

    /// A source stop (the caller holds the port's gate; the mailbox is in
    /// its map): claims a `SUSPENDED` mailbox (→ `RUNNING`, `Claimed`: the
    /// caller now owns its turn), or asks a `RUNNING` one to look before it
    /// suspends (`STOP_CHECK`, `Asked`). Others need nothing: a `SCHEDULED`
    /// mailbox's runner looks when it takes it.
    pub(crate) fn claim_for_stop(&self) -> StopClaim {
        self.state.claim_for_stop()
    }

    /// A stopper claimed the mailbox but its current message is of another
    /// source: suspend it again, or, if woken meanwhile, queue it.
    pub(crate) fn unclaim(this: &Arc<Self>) {
        match this.state.to_idle() {
            AfterPending::Suspended => {}
            AfterPending::Requeued => {
                let shared = this.owner.shared().clone();
                shared.schedule(this.home(), Task::new(this.clone()));
            }
            AfterPending::Check => {
                this.state.clear_stop_check();
                Self::unclaim(this)
            }
        }
    }

    /// A stopper cancelled the claimed mailbox's message: its worker goes
    /// on with the queue (or lets the mailbox go, if it is empty).
    pub(crate) fn resume_after_stop(this: Arc<Self>) {
        this.state.reschedule();
        let shared = this.owner.shared().clone();
        shared.schedule(this.home(), Task::new(this));
    }
}

impl<K, M, D> Runnable for Mailbox<K, M, D>
where
    K: PoolKey,
    M: Send + 'static,
    D: Owner<K, M>,
{
    fn run(this: Arc<Self>, cx: &WorkerCx<'_>, _tag: usize) {
        if this.state.claim_scheduled(true) == Claim::Lost {
            return;
        }
        this.move_home(cx.index);

        let mut budget = this.owner.shared().config.throughput;
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
        if this.state.claim_scheduled(false) == Claim::Won {
            // SAFETY: it was SCHEDULED and we popped it: the turn is ours.
            unsafe { this.cancel_current() };
        }
    }
}

impl<K, M, D> Wake for Mailbox<K, M, D>
where
    K: PoolKey,
    M: Send + 'static,
    D: Owner<K, M>,
{
    fn wake(this: Arc<Self>) {
        if this.state.wake() == Woken::Push {
            let worker = this.home();
            let shared = this.owner.shared().clone();
            shared.schedule(worker, Task::new(this));
        }
    }

    fn wake_by_ref(this: &Arc<Self>) {
        if this.state.wake() == Woken::Push {
            this.owner
                .shared()
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
