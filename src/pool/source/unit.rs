//! Units: what one accepted message holds of a source's credit — a whole
//! unit, or a share of one.
//!
//! # The protocol
//!
//! A message running on a worker may pass its unit on to a follow-up it
//! submits (see "Sending from a handler" in `receiver`): the unit becomes a
//! [`SharedUnit`] with a count of holders, and comes back to its source
//! when the last holder ends.
//!
//! - **share** ([`UnitRef::share`], a holder): a whole unit becomes a
//!   share with two holders (its source's `lent + 1`); a share gains one
//!   holder.
//! - **unshare** ([`UnitRef::unshare`]): a holder that took a share for a
//!   message that was then refused gives it back; another holder remains.
//! - **leave** ([`UnitRef::leave`], a holder that ends): `holders - 1`;
//!   the last holder frees the share, drops its source's `lent` (before
//!   the unit is released, so a drain check never sees it early: see
//!   `drain.rs`) and gives the unit back.
//!
//! A message that holds a share keeps its own source alive with a handle
//! count (see the module docs of `source`) and is counted in that source's
//! `inherited` until it ends.
//!
//! A [`UnitRef`] is one word: the pointer to the source (a whole unit) or,
//! one byte further, to the share (a share: both are aligned to at least
//! 8 bytes, so the lowest bit tells them apart). A message's envelope stays
//! small, and its size is paid on every message.

use std::ptr::NonNull;

use super::SourceRef;
use crate::sync::atomic::{AtomicUsize, Ordering::*};

/// A unit of credit shared by a message and the follow-ups it passed it
/// on to: given back when the last of them ends. Allocated when a running
/// message first passes its unit on; freed by the last holder.
pub(crate) struct SharedUnit {
    unit: SourceRef,
    holders: AtomicUsize,
}

/// The unit of credit a message holds: a whole unit of a source, or a
/// share of one. One word (see the module docs and [`kind`](Self::kind)).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct UnitRef(NonNull<u8>);

/// What a [`UnitRef`] points to.
pub(crate) enum UnitKind {
    /// A whole unit of this source.
    Plain(SourceRef),
    /// A share of a unit.
    Shared(NonNull<SharedUnit>),
}

// SAFETY: a `SharedUnit` is atomics and a `SourceRef` (both `Sync`); its
// lifetime is governed by `holders`, not by the thread holding a ref.
unsafe impl Send for UnitRef {}
// SAFETY: as above.
unsafe impl Sync for UnitRef {}

impl UnitRef {
    /// A whole unit of `source`.
    #[inline]
    pub(crate) fn plain(source: SourceRef) -> Self {
        debug_assert_eq!(source.0.as_ptr() as usize & 1, 0);
        UnitRef(source.0.cast())
    }

    fn shared(share: NonNull<SharedUnit>) -> Self {
        debug_assert_eq!(share.as_ptr() as usize & 1, 0);
        // SAFETY: one byte into the share's allocation (larger than a
        // byte): in bounds, not null, and the provenance is the share's.
        UnitRef(unsafe { NonNull::new_unchecked(share.as_ptr().cast::<u8>().add(1)) })
    }

    /// A whole unit, or a share.
    #[inline]
    pub(crate) fn kind(self) -> UnitKind {
        if self.0.as_ptr() as usize & 1 == 0 {
            UnitKind::Plain(SourceRef(self.0.cast()))
        } else {
            // SAFETY: made by `shared`, one byte into the share: one byte
            // back is the share itself, in the same allocation.
            UnitKind::Shared(unsafe { NonNull::new_unchecked(self.0.as_ptr().sub(1).cast()) })
        }
    }

    /// The source whose unit this is.
    #[inline]
    pub(crate) fn source(self) -> SourceRef {
        match self.kind() {
            UnitKind::Plain(s) => s,
            // SAFETY: the caller is a holder, which keeps the share alive.
            UnitKind::Shared(t) => unsafe { t.as_ref() }.unit,
        }
    }

    /// Passes the unit on to one more holder: returns (the caller's new
    /// ref, the new holder's).
    ///
    /// # Safety
    /// The caller holds this unit (or share).
    pub(crate) unsafe fn share(self) -> (UnitRef, UnitRef) {
        match self.kind() {
            UnitKind::Plain(unit) => {
                unit.get().lent.fetch_add(1, SeqCst);
                let t = NonNull::from(Box::leak(Box::new(SharedUnit {
                    unit,
                    holders: AtomicUsize::new(2),
                })));
                (UnitRef::shared(t), UnitRef::shared(t))
            }
            UnitKind::Shared(t) => {
                // SAFETY: we are a holder.
                unsafe { t.as_ref() }.holders.fetch_add(1, Relaxed);
                (self, self)
            }
        }
    }

    /// A holder that took a share with [`share`](Self::share) gives it back
    /// unused (its message was refused); the share's first holder is still
    /// there, so the unit stays out.
    ///
    /// # Safety
    /// The caller holds this share, and another holder remains.
    pub(crate) unsafe fn unshare(self) {
        if let UnitKind::Shared(t) = self.kind() {
            // SAFETY: caller's contract.
            let prev = unsafe { t.as_ref() }.holders.fetch_sub(1, AcqRel);
            debug_assert!(prev > 1, "the last holder of a unit left without it");
        }
    }

    /// A holder ends: the unit to give back now, if this was its last
    /// holder (always, for a plain one).
    ///
    /// # Safety
    /// The caller holds this unit (or share), and does not use it after.
    #[inline]
    pub(crate) unsafe fn leave(self) -> Option<SourceRef> {
        match self.kind() {
            UnitKind::Plain(s) => Some(s),
            UnitKind::Shared(t) => {
                // SAFETY: we are a holder.
                let share = unsafe { t.as_ref() };
                if share.holders.fetch_sub(1, AcqRel) != 1 {
                    return None;
                }
                let unit = share.unit;
                // SAFETY: the last holder: nobody else can reach it; made by
                // `Box::leak` in `share`.
                drop(unsafe { Box::from_raw(t.as_ptr()) });
                // Before the unit goes back (the caller releases it): a
                // drain check in between sees a unit out, not one lent.
                unit.get().lent.fetch_sub(1, SeqCst);
                Some(unit)
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::super::tests::source;
    use super::*;

    #[test]
    fn a_unit_ref_is_one_word_that_tells_a_share_from_a_whole_unit() {
        assert_eq!(std::mem::size_of::<UnitRef>(), 8);
        let h = source(2, 1024);
        let me = h.as_ref();
        assert!(h.source().try_acquire());
        let whole = UnitRef::plain(me);
        assert!(matches!(whole.kind(), UnitKind::Plain(s) if s == me));
        // SAFETY: we hold the unit; each holder leaves once.
        unsafe {
            let (mine, theirs) = whole.share();
            assert!(mine == theirs && mine != whole);
            assert!(matches!(mine.kind(), UnitKind::Shared(_)));
            assert!(mine.source() == me);
            // A holder passes its share on once more, and the taker gives
            // it back unused: two holders again.
            let (again, third) = mine.share();
            assert!(again == mine && third == mine);
            third.unshare();
            assert!(mine.leave().is_none(), "one holder is left");
            let back = theirs.leave().expect("the last holder gives the unit back");
            assert!(back == me);
            back.release(1);
        }
        assert_eq!(h.source().in_flight(), 0);
    }

    #[test]
    fn a_shared_unit_is_lent_until_its_last_holder_leaves() {
        let h = source(1, 1024);
        let s = h.source();
        let me = h.as_ref();
        assert!(s.try_acquire());
        // SAFETY: we hold the unit; each holder leaves once.
        unsafe {
            let (a, b) = UnitRef::plain(me).share();
            assert_eq!(s.lent.load(SeqCst), 1);
            assert!(a.leave().is_none());
            assert_eq!(s.lent.load(SeqCst), 1, "one holder is left");
            let unit = b.leave().expect("the last holder gets the unit");
            assert_eq!(s.lent.load(SeqCst), 0);
            assert_eq!(s.in_flight(), 1, "its caller gives the unit back");
            unit.release(1);
        }
        assert_eq!(s.in_flight(), 0);
    }
}
