//! Drains: whether every message a source accepted has ended (finished,
//! handed back or cancelled), and waiting for it.
//!
//! # The protocol
//!
//! A drain is read off counts, not positions:
//!
//! - a message holding a plain unit of its own source holds it until it
//!   ends, so `in_flight` counts it;
//! - except units that became shares (`lent`, `unit.rs`): such a unit
//!   lives until its last holder ends, whichever source that holder
//!   belongs to;
//! - and `inherited` counts the source's messages that hold a share of
//!   some unit (a follow-up, or a message that passed its unit on).
//!
//! Drained is `in_flight - lent == 0 && inherited == 0`. Every count moves
//! before the message it stands for can be seen ended (a share's `lent`
//! drops before its unit is released; `inherited` drops only when its
//! message ended), so a drain is never seen early; a transient difference
//! reads as not drained.
//!
//! Whoever waits for a drain (a receiver's `shutdown`, a stopper, a
//! dispatcher's graceful stop) registers in `drainers` and sets `DRAINERS`
//! in the word under the list's lock, then looks once more
//! ([`Source::wait_drained`]). A release that sees the bit wakes every
//! drainer (each looks again and waits again if it has to); a message that
//! ends holding a share pokes (`credit.rs`), and a worker that hands a
//! message over to a stopper wakes the drainers too (`stop.rs`). Waiting
//! threads also look again every `DRAIN_RECHECK` on their own.
//!
//! The last unit coming back while handles remain calls `drained`, which
//! wakes the executor's parked workers during a graceful stop so they look
//! whether everything drained.

use super::{Source, DRAINERS, IN_FLIGHT_MASK};
use crate::sync::atomic::Ordering::*;
use crate::waiter::Waiter;

impl Source {
    /// No unit is out any more: during a graceful stop, the workers check
    /// whether everything drained.
    pub(super) fn drained(&self) {
        if let Some(shared) = &self.shared {
            shared.wake_if_closed();
        }
    }

    /// A message of this source was accepted holding a share of a unit,
    /// or one of its messages passed its own unit on (it holds a share
    /// from now on): counted until it ends ([`share_ended`](Self::share_ended)).
    pub(crate) fn share_held(&self) {
        self.inherited.fetch_add(1, SeqCst);
    }

    /// A message counted by [`share_held`](Self::share_held) ended (or
    /// was refused): wake whoever waits on the source, since no release
    /// of its own unit does.
    pub(crate) fn share_ended(&self) {
        self.inherited.fetch_sub(1, SeqCst);
        self.poke();
    }

    /// Whether every message accepted so far has ended (finished, handed
    /// back or cancelled).
    pub(crate) fn is_drained(&self) -> bool {
        let word = self.hot.word.load(SeqCst) & IN_FLIGHT_MASK;
        let lent = self.lent.load(SeqCst) as u64;
        // Counts move before what they stand for ends (see the module
        // docs): a transient difference reads as not drained.
        word.wrapping_sub(lent) == 0 && self.inherited.load(SeqCst) == 0
    }

    /// Registers `waiter` to be woken by the next release (or poke), then
    /// looks once more: true if the source drained meanwhile.
    pub(crate) fn wait_drained(&self, waiter: &dyn Fn(&mut Option<Waiter>)) -> bool {
        {
            let mut d = self.drainers.lock();
            let mut slot = None;
            waiter(&mut slot);
            d.extend(slot);
            self.hot.word.fetch_or(DRAINERS, SeqCst);
        }
        self.is_drained()
    }

    /// Wakes every thread or task waiting for the source to drain (each
    /// looks again and waits again if it has to).
    #[cold]
    pub(super) fn wake_drainers(&self) {
        let woken: Vec<Waiter> = {
            let mut d = self.drainers.lock();
            if d.is_empty() {
                return;
            }
            self.hot.word.fetch_and(!DRAINERS, SeqCst);
            std::mem::take(&mut *d)
        };
        for waiter in woken {
            waiter.wake();
        }
    }
}

/// How often a thread waiting for sources to drain looks again on its own
/// (it is also woken whenever a unit of a source it waits on comes back,
/// or a message is handed over to it).
#[cfg(not(loom))]
const DRAIN_RECHECK: std::time::Duration = std::time::Duration::from_millis(1);
#[cfg(loom)]
const DRAIN_RECHECK: std::time::Duration = std::time::Duration::from_millis(0);

/// Waits (parking the thread) until every source in `sources` has drained
/// — every message it accepted ended — or `deadline` passes (`None`: no
/// deadline). Runs what workers hand over meanwhile if `handovers` (the
/// caller is their stopper). True if all drained.
pub(crate) fn wait_all_drained(
    sources: &[&Source],
    deadline: Option<std::time::Instant>,
    handovers: bool,
) -> bool {
    loop {
        let mut waiting = None;
        for s in sources {
            if handovers {
                s.run_handovers();
            }
            if !s.is_drained() {
                waiting = Some(*s);
                break;
            }
        }
        let Some(source) = waiting else { return true };
        let left = match deadline {
            Some(d) => match d.checked_duration_since(std::time::Instant::now()) {
                Some(left) if !left.is_zero() => left,
                _ => return false,
            },
            None => DRAIN_RECHECK,
        };
        if !source.wait_drained(&Waiter::register_thread) {
            crate::sync::thread::park_timeout(left.min(DRAIN_RECHECK));
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::super::tests::source;
    use super::super::UnitRef;

    #[test]
    fn drained_follows_units_and_shares_not_positions() {
        let h = source(4, 1024);
        let s = h.source();
        let me = h.as_ref();
        assert!(s.is_drained());
        // A message M holds a unit, then passes it on to a follow-up F of
        // another source (here: the same one).
        assert!(s.try_acquire());
        assert!(!s.is_drained());
        // SAFETY: M holds the unit; each holder leaves once.
        unsafe {
            me.add_ref();
            s.share_held();
            let (m, f) = UnitRef::plain(me).share();
            // F, accepted holding the share.
            me.add_ref();
            s.share_held();
            assert!(!s.is_drained());
            // M ends first: F still runs.
            assert!(m.leave().is_none());
            s.share_ended();
            me.drop_ref();
            assert!(!s.is_drained(), "the follow-up still runs");
            // F ends: the last holder gives the unit back.
            let unit = f.leave().expect("last holder");
            assert!(!s.is_drained(), "the unit is not back yet");
            unit.release(1);
            s.share_ended();
            me.drop_ref();
        }
        assert!(s.is_drained());
        assert_eq!(s.in_flight(), 0);
    }
}
