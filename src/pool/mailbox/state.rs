//! A mailbox's state word ([`MailboxState`]): five states plus two flags,
//! and every transition as a method returning what happened.
//!
//! # State machine
//!
//! The word holds one of five states plus two flags; every transition by a
//! party other than the owner is a single read-modify-write.
//!
//! - `FREE`: no key's work: a port's loaner between messages, or one of its
//!   spares. Only the port's gate holder touches it. Made by: a runner
//!   whose message completed lent, or whose queue ran dry (under the gate,
//!   leaving the map). Left by: the port lending it (→ `RUNNING`, under the
//!   gate) or giving it a queued message (→ `SCHEDULED`).
//! - `SCHEDULED`: in its worker's queue (at least once; a stale entry from
//!   before a force stop finds it `CLOSED`). Nobody runs it. Made by: the
//!   port (a key whose turn was spent gets a mailbox with its message), a
//!   waker (from `SUSPENDED`), or the runner re-queuing itself (throughput
//!   spent, or woken during its poll).
//! - `RUNNING`: its worker runs a step. Only the runner touches the
//!   mailbox's future, meta and key. Made by: the worker that popped it
//!   (`SCHEDULED` → `RUNNING`, clearing `NOTIFIED`), or the port lending it.
//! - `SUSPENDED`: the current message's future returned `Pending`; no
//!   worker holds the mailbox, which is in its port's map. Made by: the
//!   runner. Left by: a waker (→ `SCHEDULED`, and it pushes the mailbox on
//!   its worker's queue) or a stop that claims it.
//! - `CLOSED`: terminal. A force stop took the mailbox (or the runner saw
//!   the stop). Wakes are ignored.
//! - `NOTIFIED` (flag, with `SCHEDULED` or `RUNNING`): a wake arrived while
//!   the mailbox was queued or running. If the runner's poll then returns
//!   `Pending`, it re-queues the mailbox instead of suspending, so the
//!   future is polled once more: a wake during a poll is never lost, and
//!   since only the `SUSPENDED` → `SCHEDULED` edge pushes from a waker (one
//!   CAS), never scheduled twice. Wakes on `FREE` or `CLOSED` come from
//!   wakers of finished messages (a mailbox is reused) and do nothing; a
//!   stale waker of a reused mailbox may at worst cost its new key one
//!   spurious poll, which futures tolerate.
//! - `STOP_CHECK` (flag, with `RUNNING`): a source stop began while the
//!   step ran; the runner looks whether its message's source is the
//!   stopped one before it suspends.
//!
//! ```text
//!          lend (port, gate)                 queue a spent key's message (port)
//!   FREE ------------------> RUNNING <-- pop --- SCHEDULED <-------------------- FREE
//!    ^  ^   completed lent     |  |  \                ^  ^
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

use crate::sync::atomic::{AtomicUsize, Ordering::*};
use crate::sync::overwrite;

/// A mailbox's state word (see the module docs).
pub(crate) struct MailboxState(AtomicUsize);

/// What [`MailboxState::to_idle`] did with a `RUNNING` mailbox whose
/// future returned `Pending`.
#[must_use]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum AfterPending {
    /// Parked in `SUSPENDED` until a wake.
    Suspended,
    /// A wake came during the poll: now `SCHEDULED`, the caller queues it.
    Requeued,
    /// A source stop asked to look (`STOP_CHECK`); still `RUNNING`.
    Check,
}

/// What a claim of the mailbox's turn found.
#[must_use]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Claim {
    /// The caller owns the turn now.
    Won,
    /// It does not (another state, or another party was first).
    Lost,
}

/// What [`MailboxState::claim_for_force_stop`] did.
#[must_use]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ForceClaim {
    /// Its worker runs it: that runner sees the stop.
    Running,
    /// It was free: now `CLOSED`, nothing to cancel.
    Free,
    /// It was `SUSPENDED` or `SCHEDULED`: now `CLOSED`, and the caller owns
    /// (and cancels) its current message.
    Owned,
}

/// What [`MailboxState::claim_for_stop`] did.
#[must_use]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum StopClaim {
    /// It was `SUSPENDED`: now `RUNNING`, and the caller owns its turn.
    Claimed,
    /// It was `RUNNING`: `STOP_CHECK` asks its runner to look.
    Asked,
    /// Nothing to do (a `SCHEDULED` mailbox's runner looks when it pops it).
    Untouched,
}

/// What [`MailboxState::wake`] did.
#[must_use]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Woken {
    /// `SUSPENDED` → `SCHEDULED`: the caller pushes it on its worker.
    Push,
    /// Queued or running: `NOTIFIED` set, it is polled again.
    Noted,
    /// Free or closed: a stale waker, nothing to do.
    Stale,
}

impl MailboxState {
    /// Popped from a worker's queue; the popper runs it. Made from
    /// `SCHEDULED`, which only the popper leaves.
    const SCHEDULED: usize = 1;
    /// A step runs; only the runner touches the mailbox's cells.
    const RUNNING: usize = 2;
    /// Its future is pending; no worker holds it; it is in its port's map.
    const SUSPENDED: usize = 3;
    /// Terminal: wakes are ignored, nothing runs again.
    const CLOSED: usize = 4;
    /// No key: only the port's gate holder touches it.
    const FREE: usize = 5;
    /// The state bits.
    const MASK: usize = 0b111;
    /// With `SCHEDULED` or `RUNNING`: a wake came; poll again.
    const NOTIFIED: usize = 0b1000;
    /// With `RUNNING`: a source stop began while the step ran.
    const STOP_CHECK: usize = 0b1_0000;

    /// `FREE`.
    pub(crate) fn new() -> Self {
        MailboxState(AtomicUsize::new(Self::FREE))
    }

    #[inline]
    fn state(&self, ordering: crate::sync::atomic::Ordering) -> usize {
        self.0.load(ordering) & Self::MASK
    }

    /// Whether it is `FREE` (a relaxed look, for assertions).
    pub(crate) fn is_free(&self) -> bool {
        self.state(Relaxed) == Self::FREE
    }

    /// Whether it reached `CLOSED`.
    #[inline]
    pub(crate) fn is_closed(&self) -> bool {
        self.state(Acquire) == Self::CLOSED
    }

    /// `FREE` → `RUNNING`: the port lends it, under its gate. A plain
    /// store: under the gate nobody else moves a free mailbox, and a stale
    /// waker only sets `NOTIFIED` on `RUNNING`.
    #[inline]
    pub(crate) fn lend(&self) {
        overwrite(&self.0, Self::RUNNING);
    }

    /// `FREE` → `SCHEDULED`: the port gave it a queued message, under its
    /// gate (a plain store, as in [`lend`](Self::lend)).
    #[inline]
    pub(crate) fn schedule_free(&self) {
        overwrite(&self.0, Self::SCHEDULED);
    }

    /// `RUNNING` → `FREE`: the runner, under the gate, its queue empty.
    #[inline]
    pub(crate) fn release(&self) {
        overwrite(&self.0, Self::FREE);
    }

    /// → `SCHEDULED` by its owner (`RUNNING`: a turn that yields, or a
    /// claimed mailbox that goes on with its queue).
    #[inline]
    pub(crate) fn reschedule(&self) {
        self.0.swap(Self::SCHEDULED, AcqRel);
    }

    /// → `CLOSED` by its owner.
    #[inline]
    pub(crate) fn close(&self) {
        self.0.swap(Self::CLOSED, AcqRel);
    }

    /// The popper of a queued mailbox takes it: `SCHEDULED` → `RUNNING`
    /// (`run`, clearing `NOTIFIED`) or → `CLOSED` (`!run`: a cancelled
    /// task). `Lost` if a force stop claimed it first (`CLOSED`).
    pub(crate) fn claim_scheduled(&self, run: bool) -> Claim {
        let to = if run { Self::RUNNING } else { Self::CLOSED };
        let mut cur = self.0.load(Acquire);
        loop {
            match cur & Self::MASK {
                Self::SCHEDULED => match self.0.compare_exchange(cur, to, SeqCst, Acquire) {
                    Ok(_) => return Claim::Won,
                    Err(actual) => cur = actual,
                },
                Self::CLOSED => return Claim::Lost,
                other => {
                    debug_assert!(false, "popped a mailbox in state {other}");
                    return Claim::Lost;
                }
            }
        }
    }

    /// A waker: `SUSPENDED` → `SCHEDULED` (`Push`), or `NOTIFIED` on a
    /// queued or running one.
    pub(crate) fn wake(&self) -> Woken {
        let mut cur = self.0.load(Acquire);
        loop {
            let next = match cur & Self::MASK {
                Self::SUSPENDED => Self::SCHEDULED,
                // No future is pending: a stale waker of a finished message.
                Self::CLOSED | Self::FREE => return Woken::Stale,
                _ => cur | Self::NOTIFIED,
            };
            match self.0.compare_exchange(cur, next, AcqRel, Acquire) {
                Ok(_) if cur & Self::MASK == Self::SUSPENDED => return Woken::Push,
                Ok(_) => return Woken::Noted,
                Err(actual) => cur = actual,
            }
        }
    }

    /// The runner, its future pending: `RUNNING` → `SUSPENDED`, or →
    /// `SCHEDULED` if woken during the poll; unless a source stop asked to
    /// look first (see `Mailbox::after_pending` for the races).
    pub(crate) fn to_idle(&self) -> AfterPending {
        let mut cur = self.0.load(Acquire);
        loop {
            debug_assert_eq!(cur & Self::MASK, Self::RUNNING);
            if cur & Self::STOP_CHECK != 0 {
                return AfterPending::Check;
            }
            let (next, res) = if cur & Self::NOTIFIED != 0 {
                (Self::SCHEDULED, AfterPending::Requeued)
            } else {
                (Self::SUSPENDED, AfterPending::Suspended)
            };
            match self.0.compare_exchange(cur, next, SeqCst, Acquire) {
                Ok(_) => return res,
                Err(actual) => cur = actual,
            }
        }
    }

    /// The runner looked at its source after a `STOP_CHECK`.
    #[inline]
    pub(crate) fn clear_stop_check(&self) {
        self.0.fetch_and(!Self::STOP_CHECK, AcqRel);
    }

    /// The runner, after suspending, saw a force stop: `SUSPENDED` →
    /// `CLOSED`, `Won` if it got there before the stopper.
    pub(crate) fn close_suspended(&self) -> Claim {
        match self
            .0
            .compare_exchange(Self::SUSPENDED, Self::CLOSED, SeqCst, Acquire)
        {
            Ok(_) => Claim::Won,
            Err(_) => Claim::Lost,
        }
    }

    /// A source stop, under the port's gate: claims a `SUSPENDED` mailbox
    /// (→ `RUNNING`), or asks a `RUNNING` one to look before it suspends.
    pub(crate) fn claim_for_stop(&self) -> StopClaim {
        let mut cur = self.0.load(SeqCst);
        loop {
            let (next, res) = match cur & Self::MASK {
                Self::SUSPENDED => (Self::RUNNING, StopClaim::Claimed),
                Self::RUNNING => (cur | Self::STOP_CHECK, StopClaim::Asked),
                _ => return StopClaim::Untouched,
            };
            match self.0.compare_exchange(cur, next, SeqCst, SeqCst) {
                Ok(_) => return res,
                Err(actual) => cur = actual,
            }
        }
    }

    /// A force stop, on the stopping thread: claims the mailbox unless its
    /// worker runs it (that runner sees `FORCED`). A queued one is claimed
    /// too: its task, when popped, finds it closed.
    pub(crate) fn claim_for_force_stop(&self) -> ForceClaim {
        let mut cur = self.0.load(Acquire);
        loop {
            let st = cur & Self::MASK;
            if !matches!(st, Self::SUSPENDED | Self::SCHEDULED | Self::FREE) {
                return ForceClaim::Running;
            }
            match self.0.compare_exchange(cur, Self::CLOSED, SeqCst, Acquire) {
                Ok(_) if st == Self::FREE => return ForceClaim::Free,
                Ok(_) => return ForceClaim::Owned,
                Err(actual) => cur = actual,
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn running() -> MailboxState {
        let s = MailboxState::new();
        s.lend();
        s
    }

    #[test]
    fn a_wake_during_the_poll_requeues_instead_of_suspending() {
        let s = running();
        assert_eq!(s.wake(), Woken::Noted);
        assert_eq!(s.to_idle(), AfterPending::Requeued);
        assert_eq!(s.claim_scheduled(true), Claim::Won);
        assert_eq!(s.to_idle(), AfterPending::Suspended, "NOTIFIED was cleared");
    }

    #[test]
    fn only_the_wake_of_a_suspended_mailbox_pushes_it() {
        let s = running();
        assert_eq!(s.to_idle(), AfterPending::Suspended);
        assert_eq!(s.wake(), Woken::Push);
        assert_eq!(s.wake(), Woken::Noted, "queued: never pushed twice");
        assert_eq!(s.claim_scheduled(true), Claim::Won);
    }

    #[test]
    fn wakes_of_free_or_closed_mailboxes_are_stale() {
        let s = MailboxState::new();
        assert_eq!(s.wake(), Woken::Stale);
        s.close();
        assert_eq!(s.wake(), Woken::Stale);
        assert!(s.is_closed());
    }

    #[test]
    fn a_source_stop_claims_a_suspended_mailbox_and_asks_a_running_one() {
        let s = running();
        assert_eq!(s.claim_for_stop(), StopClaim::Asked);
        assert_eq!(s.to_idle(), AfterPending::Check);
        s.clear_stop_check();
        assert_eq!(s.to_idle(), AfterPending::Suspended);
        assert_eq!(s.claim_for_stop(), StopClaim::Claimed);
        s.reschedule();
        assert_eq!(s.claim_for_stop(), StopClaim::Untouched);
    }

    #[test]
    fn a_force_stop_claims_all_but_a_running_mailbox() {
        let s = running();
        assert_eq!(s.claim_for_force_stop(), ForceClaim::Running);
        assert_eq!(s.to_idle(), AfterPending::Suspended);
        assert_eq!(s.claim_for_force_stop(), ForceClaim::Owned);
        assert_eq!(s.claim_scheduled(true), Claim::Lost, "a stale task");
        assert_eq!(s.close_suspended(), Claim::Lost);
        let free = MailboxState::new();
        assert_eq!(free.claim_for_force_stop(), ForceClaim::Free);
    }

    #[test]
    fn the_runner_closes_a_suspended_mailbox_before_the_stopper() {
        let s = running();
        assert_eq!(s.to_idle(), AfterPending::Suspended);
        assert_eq!(s.close_suspended(), Claim::Won);
        assert!(s.is_closed());
    }

    #[test]
    fn a_free_mailbox_is_lent_or_scheduled_and_released() {
        let s = MailboxState::new();
        assert!(s.is_free());
        s.schedule_free();
        assert_eq!(s.claim_scheduled(true), Claim::Won);
        s.release();
        assert!(s.is_free());
    }
}
