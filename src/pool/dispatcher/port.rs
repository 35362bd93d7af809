//! A dispatcher's port on one worker: its inbox, its gate, and its state
//! word ([`PortState`]).
//!
//! # The state word
//!
//! One word, every transition one read-modify-write (SeqCst), so that no
//! call site writes a compare-exchange by hand:
//!
//! ```text
//!             schedule() ─ Queue            begin_turn()
//!   IDLE ──────────────────────▶ SCHEDULED ──────────────▶ RUNNING
//!    ▲                               ▲                        │
//!    │                               └──── yield_turn() ──────┤
//!    └────────────────────────────────────── end_turn() ──────┘
//!
//!   flags, beside the phase:  CLOSED    set once by `close` (under the gate)
//!                             DEFERRED  `set_deferred` (under the gate)
//!                             STEALING  `claim_steal` / `clear_steal`
//! ```
//!
//! A submitter pushes, fences, and calls `schedule`: `Queue` means it moved
//! the port IDLE → SCHEDULED and must queue the port's task (exactly once);
//! `Busy` means a turn is queued or under way and will see the push. The
//! runner, done, calls `end_turn`, fences and re-checks the inbox and
//! `DEFERRED`: either the submitter saw SCHEDULED/RUNNING after its push,
//! or the runner sees the push (SeqCst on both sides).
//!
//! # Stealing a turn
//!
//! A message of a key without a mailbox runs lent the port's free mailbox
//! (the *loaner*), inside the port's turn, with the gate released; the rest
//! of the inbox waits for it. If that step is stuck and a worker idles, the
//! idle worker steals the rest of the turn (see `conserve/mod.rs`):
//!
//! ```text
//!   runner (worker r)                 gate                 idle worker i
//!   ─────────────────                 ────                 ─────────────
//!   lend the loaner: lent = Some ───▶ epoch e
//!   gate released, step runs ...                     ◀──── claim_steal(): Won
//!                                                          queue a steal task
//!                                                   ◀───── lock; lent still Some?
//!                                     lent → map,          yes: the loaner becomes
//!                                     epoch e+1,           its key's mailbox; i is
//!                                     runner = i           the runner, goes on to
//!                                                          the turn's mark
//!   step returns; lock ─────────────▶ epoch ≠ e:
//!   the turn is not ours: go on as that key's mailbox, never touch the state
//! ```
//!
//! - Who steals: an idle worker that finds a stuck worker whose port's
//!   turn holds deliveries (`StopTarget::steal_turn`); the `STEALING` flag
//!   keeps it to one steal on its way at a time, cleared by whoever runs or
//!   cancels that task. Submitters do not watch the turn's worker.
//! - The phase stays RUNNING throughout: nobody else schedules the port.
//! - Only the loaner's step can be stolen from: every other release of the
//!   gate in a turn happens with `lent` cleared.

use std::collections::{HashMap, VecDeque};
use std::ptr::NonNull;

use crossbeam_utils::CachePadded;

use crate::pool::handler::Handler;
use crate::pool::inbox::Inbox;
use crate::pool::mailbox::{Envelope, Stamp};
use crate::sync::atomic::{AtomicPtr, AtomicUsize, Ordering::*};
use crate::sync::SpinLock;

use super::keys::Keys;
use super::{KeyMailbox, MailboxRef};

pub(super) type PaddedPort<K, M, H, S> = CachePadded<Port<K, M, H, S>>;

/// In a port task's tag (beside the port's index): steal the port's
/// turn from a runner stuck in a lent step (see "Stealing a turn").
pub(super) const STEAL_TAG: usize = 1 << (usize::BITS - 1);

// ----- the state word --------------------------------------------------------

/// A port's state word: its phase in the low two bits, then three flags
/// (see "The state word").
pub(super) struct PortState(AtomicUsize);

/// What [`PortState::schedule`] did.
#[must_use]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Schedule {
    /// The port was idle and is now SCHEDULED: the caller queues its task.
    Queue,
    /// A turn is queued or under way: it will see what the caller pushed.
    Busy,
}

/// What [`PortState::claim_steal`] did.
#[must_use]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Claim {
    /// The caller set the flag: it queues the steal task.
    Won,
    /// A steal is already on its way.
    Lost,
}

impl PortState {
    /// Phase: not queued, no turn under way. Only `schedule` leaves it.
    const IDLE: usize = 0;
    /// Phase: the port's task is in a worker's queue, exactly once. Only
    /// `begin_turn` (the task running) leaves it.
    const SCHEDULED: usize = 1;
    /// Phase: a turn is under way; one runner at a time (a steal moves
    /// the turn, not the phase). Left by `yield_turn` or `end_turn`.
    const RUNNING: usize = 2;
    /// The phase bits.
    const PHASE: usize = 0b11;
    /// A force stop emptied the port: nothing is delivered after. Set under
    /// the gate, never cleared; submitters read it after their push.
    const CLOSED: usize = 1 << 2;
    /// The gate's `deferred` queue is not empty. Written under the gate
    /// only; the runner reads it after `end_turn` and a fence, as it reads
    /// the inbox.
    const DEFERRED: usize = 1 << 3;
    /// A steal of the port's turn is on its way to an idle worker. Set
    /// by the worker that claims it, cleared by whoever runs or cancels it.
    const STEALING: usize = 1 << 4;

    /// Idle, open, nothing deferred.
    pub(super) fn new() -> Self {
        PortState(AtomicUsize::new(Self::IDLE))
    }

    /// After a push: IDLE → SCHEDULED if the port is idle.
    #[inline]
    pub(super) fn schedule(&self) -> Schedule {
        let mut cur = self.0.load(SeqCst);
        loop {
            if cur & Self::PHASE != Self::IDLE {
                return Schedule::Busy;
            }
            match self
                .0
                .compare_exchange(cur, cur | Self::SCHEDULED, SeqCst, SeqCst)
            {
                Ok(_) => return Schedule::Queue,
                Err(actual) => cur = actual,
            }
        }
    }

    /// SCHEDULED → RUNNING: the port's task runs.
    #[inline]
    pub(super) fn begin_turn(&self) {
        let was = self.0.fetch_add(Self::RUNNING - Self::SCHEDULED, SeqCst);
        debug_assert_eq!(was & Self::PHASE, Self::SCHEDULED, "a turn began twice");
    }

    /// RUNNING → SCHEDULED: the turn stopped at its mark with deliveries
    /// left; its runner queues the port's task again.
    #[inline]
    pub(super) fn yield_turn(&self) {
        let was = self.0.fetch_sub(Self::RUNNING - Self::SCHEDULED, SeqCst);
        debug_assert_eq!(was & Self::PHASE, Self::RUNNING, "no turn to yield");
    }

    /// RUNNING → IDLE: the turn is over; its runner fences and re-checks
    /// the inbox and [`has_deferred`](Self::has_deferred) after.
    #[inline]
    pub(super) fn end_turn(&self) {
        let was = self.0.fetch_and(!Self::PHASE, SeqCst);
        debug_assert_eq!(was & Self::PHASE, Self::RUNNING, "no turn to end");
    }

    /// Whether the port is queued or running.
    #[inline]
    pub(super) fn is_busy(&self) -> bool {
        self.0.load(SeqCst) & Self::PHASE != Self::IDLE
    }

    /// Whether a turn is under way.
    #[inline]
    pub(super) fn is_running(&self) -> bool {
        self.0.load(SeqCst) & Self::PHASE == Self::RUNNING
    }

    /// Marks the port closed (a force stop emptied it); under the gate.
    pub(super) fn close(&self) {
        self.0.fetch_or(Self::CLOSED, SeqCst);
    }

    /// Whether a force stop emptied the port.
    #[inline]
    pub(super) fn is_closed(&self) -> bool {
        self.0.load(SeqCst) & Self::CLOSED != 0
    }

    /// Records whether the gate's `deferred` queue holds deliveries; under
    /// the gate.
    pub(super) fn set_deferred(&self, deferred: bool) {
        if deferred {
            self.0.fetch_or(Self::DEFERRED, SeqCst);
        } else {
            self.0.fetch_and(!Self::DEFERRED, SeqCst);
        }
    }

    /// Whether the gate's `deferred` queue holds deliveries.
    #[inline]
    pub(super) fn has_deferred(&self) -> bool {
        self.0.load(SeqCst) & Self::DEFERRED != 0
    }

    /// Claims the one steal that may be on its way.
    pub(super) fn claim_steal(&self) -> Claim {
        if self.0.fetch_or(Self::STEALING, SeqCst) & Self::STEALING == 0 {
            Claim::Won
        } else {
            Claim::Lost
        }
    }

    /// The steal claimed is running (or was cancelled): another may be
    /// claimed.
    pub(super) fn clear_steal(&self) {
        self.0.fetch_and(!Self::STEALING, SeqCst);
    }
}

// ----- ports -----------------------------------------------------------------

/// A message on its way to its key's mailbox.
pub(crate) struct Delivery<K, M, O> {
    pub(super) key: K,
    pub(super) hash: u64,
    pub(super) env: Envelope<M, O>,
}

/// A delivery a source stop kept back, with its metrics stamp.
pub(super) type Deferred<K, M, O> = (Delivery<K, M, O>, Stamp);

/// A dispatcher's port on one worker.
pub(super) struct Port<K, M, H: Handler<K, M>, S> {
    /// Its phase and flags (see "The state word").
    pub(super) state: PortState,
    /// The worker its turns run on (see `route.rs`): where a submitter
    /// queues its task. Written by whoever begins a turn elsewhere
    /// (relaxed: a stale home only sends the task to a worker that
    /// another may steal it from).
    home: AtomicUsize,
    pub(super) inbox: Inbox<Delivery<K, M, H::Output>>,
    /// Held for a delivery's bookkeeping, never across a handler (so a
    /// spin lock: one swap to take, a store to release). On its own lines:
    /// the worker takes it per delivery, submitters never touch it.
    pub(super) gate: CachePadded<SpinLock<Gate<K, M, H, S>>>,
}

/// A dispatcher's ports, one per worker, each made when its worker first
/// gets a delivery of the dispatcher: an idle dispatcher pays a pointer per
/// worker, not a port. Made ports live as long as the dispatcher.
pub(super) struct Ports<P> {
    pub(super) ptrs: Box<[AtomicPtr<P>]>,
}

impl<P> Ports<P> {
    pub(super) fn new(n: usize) -> Self {
        Ports {
            ptrs: (0..n)
                .map(|_| AtomicPtr::new(std::ptr::null_mut()))
                .collect(),
        }
    }

    /// Port `i`, if it was made.
    #[inline]
    pub(super) fn get(&self, i: usize) -> Option<&P> {
        // SeqCst: against a force stop, which sets its flag and then walks
        // the pointers (see `DispatcherInner::port`).
        let p = self.ptrs[i].load(SeqCst);
        // SAFETY: a non-null pointer points to a port made by `get_or_make`,
        // freed only when `self` drops.
        (!p.is_null()).then(|| unsafe { &*p })
    }

    /// Port `i`, which a task or a mailbox of it shows was made.
    #[inline]
    pub(super) fn made(&self, i: usize) -> &P {
        self.get(i).expect("a port with work was made")
    }

    /// Port `i`, made now (with `make`) if it was not: one CAS decides
    /// between racing makers, the loser frees its own.
    #[inline]
    pub(super) fn get_or_make(&self, i: usize, make: impl FnOnce() -> P) -> &P {
        if let Some(p) = self.get(i) {
            return p;
        }
        self.make(i, make)
    }

    #[cold]
    fn make(&self, i: usize, make: impl FnOnce() -> P) -> &P {
        let new = Box::into_raw(Box::new(make()));
        match self.ptrs[i].compare_exchange(std::ptr::null_mut(), new, SeqCst, SeqCst) {
            // SAFETY: just published; freed only when `self` drops.
            Ok(_) => unsafe { &*new },
            Err(theirs) => {
                // SAFETY: ours, never published.
                drop(unsafe { Box::from_raw(new) });
                // SAFETY: as in `get`.
                unsafe { &*theirs }
            }
        }
    }

    /// The ports made so far, with their worker.
    pub(super) fn iter(&self) -> impl Iterator<Item = (usize, &P)> + '_ {
        (0..self.ptrs.len()).filter_map(move |i| self.get(i).map(|p| (i, p)))
    }
}

impl<P> Drop for Ports<P> {
    fn drop(&mut self) {
        for ptr in self.ptrs.iter() {
            let p = ptr.load(Acquire);
            if !p.is_null() {
                // SAFETY: made by `make` with `Box::into_raw`; nobody holds
                // a reference once the dispatcher drops.
                drop(unsafe { Box::from_raw(p) });
            }
        }
    }
}

impl<K, M, H: Handler<K, M>, S> Port<K, M, H, S> {
    /// The worker its turns run on (see `route.rs`).
    #[inline]
    pub(super) fn home(&self) -> usize {
        self.home.load(Relaxed)
    }

    /// A turn of it begins on worker `w`: `w` is its home from now on.
    #[inline]
    pub(super) fn move_home(&self, w: usize) {
        if self.home.load(Relaxed) != w {
            self.home.store(w, Relaxed);
        }
    }

    /// Its identity among the ports a worker serves (its address: a port
    /// lives as long as its dispatcher).
    #[inline]
    pub(super) fn id(&self) -> usize {
        self as *const Self as usize
    }

    /// A port homed on worker `home`, idle and empty.
    pub(super) fn new(home: usize) -> Self {
        Port {
            state: PortState::new(),
            home: AtomicUsize::new(home),
            inbox: Inbox::new(),
            gate: CachePadded::new(SpinLock::new(Gate {
                active: HashMap::default(),
                loaner: None,
                lent: None,
                epoch: 0,
                runner: home,
                until: 0,
                spares: Vec::new(),
                deferred: VecDeque::new(),
            })),
        }
    }
}

/// What a port's gate guards.
pub(super) struct Gate<K, M, H: Handler<K, M>, S> {
    /// The mailboxes of this worker's keys that have work (a backlog, a
    /// running turn, a suspended future). A key without a mailbox has none.
    pub(super) active: Keys<K, M, H, S>,
    /// The free mailbox the port lends a message of a key without one.
    pub(super) loaner: Option<MailboxRef<K, M, H, S>>,
    /// The loaner out running a message in the turn's owner's hands, if
    /// any (for stats, and for a steal, which moves it into the map).
    pub(super) lent: Option<Lent<K, M, H, S>>,
    /// Bumped by each steal of the port's turn: a runner that finds it
    /// changed when its loaner comes back has lost the turn.
    pub(super) epoch: u32,
    /// The worker whose turn it is (or was last).
    pub(super) runner: usize,
    /// The inbox's mark when the turn began: the turn takes the deliveries
    /// claimed before it (see "Fairness"); a steal goes on to the same.
    pub(super) until: usize,
    /// Free mailboxes for keys that get one.
    pub(super) spares: Vec<MailboxRef<K, M, H, S>>,
    /// Deliveries a source stop took out of the inbox to hand back its own
    /// and kept for the others (with their metrics stamps): they go ahead
    /// of the inbox, in order.
    pub(super) deferred: VecDeque<Deferred<K, M, H::Output>>,
}

/// The loaner out running: a pointer, not a reference count (that would cost two
/// atomic operations a message); the runner holds the `Arc` while it is
/// set, and clears it under the gate before it lets the loaner go.
pub(super) struct Lent<K, M, H: Handler<K, M>, S>(pub(super) NonNull<KeyMailbox<K, M, H, S>>);

impl<K, M, H: Handler<K, M>, S> Clone for Lent<K, M, H, S> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<K, M, H: Handler<K, M>, S> Copy for Lent<K, M, H, S> {}

// SAFETY: a pointer to a mailbox, which is `Send + Sync` under the bounds
// every dispatcher has; it is only dereferenced under the gate while the
// runner keeps the mailbox alive (see above).
unsafe impl<K, M, H: Handler<K, M>, S> Send for Lent<K, M, H, S> {}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::{Claim, PortState, Schedule};

    #[test]
    fn only_an_idle_port_is_scheduled_and_only_once() {
        let s = PortState::new();
        assert!(!s.is_busy());
        assert_eq!(s.schedule(), Schedule::Queue);
        assert!(s.is_busy() && !s.is_running());
        assert_eq!(s.schedule(), Schedule::Busy);
        s.begin_turn();
        assert!(s.is_running());
        assert_eq!(s.schedule(), Schedule::Busy);
        s.end_turn();
        assert!(!s.is_busy());
        assert_eq!(s.schedule(), Schedule::Queue);
    }

    #[test]
    fn a_yielded_turn_is_scheduled_until_it_runs_again() {
        let s = PortState::new();
        assert_eq!(s.schedule(), Schedule::Queue);
        s.begin_turn();
        s.yield_turn();
        assert!(s.is_busy() && !s.is_running());
        assert_eq!(s.schedule(), Schedule::Busy);
        s.begin_turn();
        assert!(s.is_running());
    }

    #[test]
    fn flags_survive_every_phase_change() {
        let s = PortState::new();
        s.set_deferred(true);
        assert_eq!(s.claim_steal(), Claim::Won);
        assert_eq!(s.schedule(), Schedule::Queue);
        s.begin_turn();
        s.close();
        s.yield_turn();
        s.begin_turn();
        s.end_turn();
        assert!(s.is_closed() && s.has_deferred() && !s.is_busy());
        assert_eq!(s.claim_steal(), Claim::Lost);
        // A closed port is still scheduled: its runner finds it closed.
        assert_eq!(s.schedule(), Schedule::Queue);
        s.set_deferred(false);
        assert!(!s.has_deferred() && s.is_closed());
    }

    #[test]
    fn one_steal_at_a_time() {
        let s = PortState::new();
        assert_eq!(s.claim_steal(), Claim::Won);
        assert_eq!(s.claim_steal(), Claim::Lost);
        s.clear_steal();
        assert_eq!(s.claim_steal(), Claim::Won);
    }
}
