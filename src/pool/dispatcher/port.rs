//! A dispatcher's port on one worker: its inbox, its gate and its state.
//!
//! # Taking over a turn
//!
//! A message of a key without a mailbox runs in the port's slot, inside the
//! port's turn, with the gate released; the rest of the inbox waits for it.
//! If that step is long and a worker idles, the idle worker takes the rest
//! of the turn over:
//!
//! - Who asks: an idle worker that finds a stuck worker whose port's turn
//!   holds deliveries (`StopTarget::takeover`, from `WorkerCx::help`; it
//!   takes the `TAKEOVER` task itself, and `rescue` keeps it to one at a
//!   time). Submitters do not look at the turn's worker (see "Who watches"
//!   in `executor.rs`).
//! - Under the gate, if the slot is still lent (`lent`), the taker puts
//!   the lent slot in the map as its key's mailbox (so that key's next
//!   deliveries queue behind its running message), bumps `epoch`, becomes
//!   the `runner`, and runs the rest of the turn as its own. `state` stays
//!   `RUNNING` throughout: nobody else schedules the port meanwhile.
//! - The old runner, when its message returns, finds `epoch` changed under
//!   the gate: the turn is not its own any more. It goes on as the slot's
//!   mailbox (its queue, then retirement through `drained`, or suspension),
//!   and never touches the port's state again.
//! - Only the slot's step can be taken over: every other release of the
//!   gate in a turn happens with `lent` cleared.
//!

use std::collections::{HashMap, VecDeque};
use std::ptr::NonNull;

use crossbeam_utils::CachePadded;

use crate::pool::handler::Handler;
use crate::pool::inbox::Inbox;
use crate::pool::mailbox::{Envelope, Mailbox, Stamp};
use crate::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering::*};
use crate::sync::SpinLock;

use super::keys::Keys;
use super::MailboxRef;

pub(super) type PaddedPort<K, M, H, S> = CachePadded<Port<K, M, H, S>>;

/// Port states.
pub(super) const PORT_IDLE: usize = 0;
pub(super) const PORT_SCHEDULED: usize = 1;
pub(super) const PORT_RUNNING: usize = 2;

/// In a port task's tag (beside the port's index): take over the port's
/// turn from a runner stuck in its slot (see "Taking over a turn").
pub(super) const TAKEOVER: usize = 1 << (usize::BITS - 1);

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
///
/// `state`: `PORT_IDLE` (not queued), `PORT_SCHEDULED` (its task is in the
/// worker's queue, exactly once), `PORT_RUNNING` (a turn is under way). A
/// submitter pushes, fences, and moves it `IDLE` → `SCHEDULED` (CAS) to
/// queue it; the worker, done, stores `IDLE`, fences and re-checks the
/// inbox: either the submitter saw `RUNNING`/`SCHEDULED` after its push, or
/// the worker sees the push (SeqCst fences on both sides).
pub(super) struct Port<K, M, H: Handler<K, M>, S> {
    pub(super) state: AtomicUsize,
    /// A takeover of its turn is on its way to an idle worker (set by the
    /// idle worker that found the turn stuck, cleared by whoever runs it).
    pub(super) rescue: AtomicBool,
    /// Set (under the gate) by a force stop once it emptied the inbox;
    /// read by submitters after their push (see the module docs).
    pub(super) closed: AtomicBool,
    /// The gate's `deferred` queue is not empty (set by a source stop under
    /// the gate, cleared by the port's turn under it; read by the port at
    /// the end of a turn, after a fence, like the inbox).
    pub(super) deferred: AtomicBool,
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
    pub(super) slots: Box<[AtomicPtr<P>]>,
}

impl<P> Ports<P> {
    pub(super) fn new(n: usize) -> Self {
        Ports {
            slots: (0..n)
                .map(|_| AtomicPtr::new(std::ptr::null_mut()))
                .collect(),
        }
    }

    /// Port `i`, if it was made.
    #[inline]
    pub(super) fn get(&self, i: usize) -> Option<&P> {
        // SeqCst: against a force stop, which sets its flag and then walks
        // the slots (see `DispatcherInner::port`).
        let p = self.slots[i].load(SeqCst);
        // SAFETY: a non-null slot points to a port made by `get_or_make`,
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
        match self.slots[i].compare_exchange(std::ptr::null_mut(), new, SeqCst, SeqCst) {
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
        (0..self.slots.len()).filter_map(move |i| self.get(i).map(|p| (i, p)))
    }
}

impl<P> Drop for Ports<P> {
    fn drop(&mut self) {
        for slot in self.slots.iter() {
            let p = slot.load(Acquire);
            if !p.is_null() {
                // SAFETY: made by `make` with `Box::into_raw`; nobody holds
                // a reference once the dispatcher drops.
                drop(unsafe { Box::from_raw(p) });
            }
        }
    }
}

impl<K, M, H: Handler<K, M>, S> Port<K, M, H, S> {
    /// Its identity among the ports a worker serves (its address: a port
    /// lives as long as its dispatcher).
    #[inline]
    pub(super) fn id(&self) -> usize {
        self as *const Self as usize
    }

    /// Worker `p`'s port, idle and empty.
    pub(super) fn new(p: usize) -> Self {
        Port {
            state: AtomicUsize::new(PORT_IDLE),
            rescue: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            deferred: AtomicBool::new(false),
            inbox: Inbox::new(),
            gate: CachePadded::new(SpinLock::new(Gate {
                closed: false,
                active: HashMap::default(),
                slot: None,
                lent: None,
                epoch: 0,
                runner: p,
                until: 0,
                spares: Vec::new(),
                deferred: VecDeque::new(),
            })),
        }
    }
}

/// What a port's gate guards.
pub(super) struct Gate<K, M, H: Handler<K, M>, S> {
    /// Set once a force stop emptied the port: nothing is delivered after.
    pub(super) closed: bool,
    /// The mailboxes of this worker's keys that have work (a backlog, a
    /// running turn, a suspended future). A key without a mailbox has none.
    pub(super) active: Keys<K, M, H, S>,
    /// The free mailbox the port lends a message of a key without one.
    pub(super) slot: Option<MailboxRef<K, M, H, S>>,
    /// The slot out running a message in the turn's owner's hands, if
    /// any (for stats, and for a takeover, which moves it into the map).
    pub(super) lent: Option<Lent<K, M, H, S>>,
    /// Bumped by each takeover of the port's turn: a runner that finds it
    /// changed when its slot comes back has lost the turn.
    pub(super) epoch: u32,
    /// The worker whose turn it is (or was last).
    pub(super) runner: usize,
    /// The inbox's mark when the turn began: the turn takes the deliveries
    /// claimed before it (see "Fairness"); a takeover goes on to the same.
    pub(super) until: usize,
    /// Free mailboxes for keys that get one.
    pub(super) spares: Vec<MailboxRef<K, M, H, S>>,
    /// Deliveries a source stop took out of the inbox to hand back its own
    /// and kept for the others (with their metrics stamps): they go ahead
    /// of the inbox, in order.
    pub(super) deferred: VecDeque<Deferred<K, M, H::Output>>,
}

/// The lent slot: a pointer, not a reference count (that would cost two
/// atomic operations a message); the runner holds the `Arc` while it is
/// set, and clears it under the gate before it lets the slot go.
pub(super) struct Lent<K, M, H: Handler<K, M>, S>(pub(super) NonNull<Mailbox<K, M, H, S>>);

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
