//! Sources: what one receiver and its clones share — the credit of
//! `max_in_flight` units, the positions of the messages it accepted and
//! what has become of each (the commit point), and whether it still takes
//! messages.
//!
//! | file | holds | protocol written down at its top |
//! |---|---|---|
//! | `mod.rs` | [`Source`], its word, its lifetime ([`SourceHandle`], [`SourceRef`], [`SourceGuard`]), positions | who frees a source |
//! | `credit.rs` | taking and giving back units, the waiters ([`Acquire`]), the commit span's cap | credit |
//! | `unit.rs` | [`UnitRef`], [`SharedUnit`](unit::SharedUnit): a unit one message shares with its follow-ups | sharing a unit |
//! | `drain.rs` | whether every accepted message ended; waiting for that | drains |
//! | `stop.rs` | the stop flags, sending waiters away, handing messages over to a stopper | stops |
//! | `commits.rs` | the commit point of a receiver that tracks commits | the commit point |
//!
//! # The word
//!
//! Credit, handle counts and the waiter bits live in one atomic word, so
//! that a message costs one read-modify-write when it is accepted and
//! (amortised) less than one when it finishes:
//!
//! | bits  | meaning |
//! |-------|---------|
//! | 0–39  | `in_flight`: units held by accepted, unfinished messages |
//! | 40–61 | `handles`: handle counts — live [`SourceHandle`]s (receivers and their clones), messages holding a share of a unit, [`SourceGuard`]s, a release that wakes waiters |
//! | 62    | `DRAINERS`: someone waits for the source to drain (`drain.rs`) |
//! | 63    | `WAITERS`: the list of submitters waiting for a unit is not empty (`credit.rs`) |
//!
//! # Who frees a source
//!
//! The source is heap-allocated once and freed by whoever makes the word
//! reach zero: no handle count, no unit, no waiter bit. `free` takes it
//! out of the executor's list of sources first.
//!
//! - A [`SourceHandle`] owns one handle count: clone `handles + 1`, drop
//!   `handles - 1` (`drop_ref`).
//! - An accepted message needs no count of its own: it carries a plain
//!   [`SourceRef`], kept valid by the plain unit of its source it holds
//!   until it ends. A message holding a share of a unit (`unit.rs`) takes
//!   a handle count instead ([`SourceRef::add_ref`]) and gives it back when it
//!   ends ([`SourceRef::drop_ref`]).
//! - The executor's list holds uncounted refs; under the list's lock, a
//!   [`SourceGuard`] takes a count unless the word is already zero
//!   ([`SourceRef::try_add_ref`]): `free` takes the same lock before the
//!   memory goes.
//! - A release that must wake someone, or gives back the last units while
//!   handles remain, takes a count for the time of its wake-ups
//!   (`credit.rs`).
//! - A waiter bit left set with nothing else in the word is stale (its
//!   waiter held a handle, and it is gone): the last handle drop clears it
//!   with one compare-exchange and frees the source.
//!
//! # Positions
//!
//! Each accepted message takes the next *position* (`next`, one
//! `fetch_add` by its submitter, on a line of its own). A receiver that
//! tracks commits (`ReceiverBuilder::track_commits`) also records how each
//! message ended at its position (`commits.rs`); one that does not pays
//! for none of it: no record per message, no cap on the span.

use std::collections::VecDeque;
use std::ptr::NonNull;

use crossbeam_utils::CachePadded;

use crate::pool::shared::Shared;
use crate::sync::atomic::{AtomicU64, AtomicU8, AtomicUsize, Ordering::*};
use crate::sync::{Arc, Mutex};
use crate::waiter::Waiter;

mod commits;
mod credit;
mod drain;
mod stop;
mod unit;

use commits::Commits;
pub(crate) use commits::Ended;
pub(crate) use credit::{Acquire, Acquired, MAX_CREDIT, MAX_SPAN};
pub(crate) use drain::wait_all_drained;
pub(crate) use stop::Handover;
pub(crate) use unit::UnitRef;

const IN_FLIGHT_MASK: u64 = (1 << 40) - 1;
const HANDLE: u64 = 1 << 40;
const DRAINERS: u64 = 1 << 62;
const WAITERS: u64 = 1 << 63;
const WAITER_BITS: u64 = WAITERS | DRAINERS;

/// The word (see "The word"): submitters, releasers and handle counts
/// touch it.
struct Hot {
    word: AtomicU64,
}

/// What a receiver and its clones share (see the module docs).
pub(crate) struct Source {
    hot: CachePadded<Hot>,
    /// The next position: its own line, so that taking one does not pull
    /// the credit word away from the workers that give units back.
    next: CachePadded<AtomicU64>,
    /// Read on every message by submitters and workers, written only by
    /// stops: on lines of their own, away from the locks and counts below.
    fixed: CachePadded<Fixed>,
    /// Threads in `shutdown_now` waiting for the source to drain.
    stoppers: AtomicUsize,
    /// The source's units that became shares (a message passed its unit
    /// on), until the share's last holder gives the unit back (see
    /// `drain.rs`).
    lent: AtomicUsize,
    /// The source's messages that hold a share of a unit.
    inherited: AtomicUsize,
    /// The commit point, if the receiver tracks commits.
    commits: Option<Commits>,
    waiters: Mutex<Waiters>,
    drainers: Mutex<Vec<Waiter>>,
    handover: Mutex<Vec<Handover>>,
    /// The executor: it counts this source in its list (a graceful stop
    /// waits until no source has a unit out), and is woken when the last
    /// unit comes back during a stop. `None` in unit tests.
    shared: Option<Arc<Shared>>,
}

/// What every message reads of its source (see `Source::fixed`).
struct Fixed {
    max: u64,
    /// How many released units a worker may hold back before returning them.
    batch: u64,
    /// The commit span's cap (tracked receivers only).
    span: u64,
    /// `CLOSED`, `STOPPED`: only ever set.
    flags: AtomicU8,
    /// The id of the dispatcher the source feeds.
    dispatcher: u64,
}

#[derive(Default)]
struct Waiters {
    queue: VecDeque<(u64, Option<Waiter>)>,
    next_id: u64,
}

/// A counted handle to a source (held by receivers).
pub(crate) struct SourceHandle(NonNull<Source>);

/// An uncounted pointer to a source, valid while its holder holds a unit
/// or a handle (or, for the executor's list of sources, while it is in that
/// list).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct SourceRef(NonNull<Source>);

// SAFETY: `Source` is `Sync` (atomics and mutexes); handles and refs are
// pointers to it whose validity is governed by the counts in its word, not by
// the thread that holds them.
unsafe impl Send for SourceHandle {}
// SAFETY: as above.
unsafe impl Sync for SourceHandle {}
// SAFETY: as above.
unsafe impl Send for SourceRef {}
// SAFETY: as above.
unsafe impl Sync for SourceRef {}

/// How a receiver's source is made.
pub(crate) struct Settings {
    pub(crate) max_in_flight: usize,
    pub(crate) span: usize,
    /// Record how each message ends, for the commit point.
    pub(crate) track: bool,
    pub(crate) dispatcher: u64,
}

impl SourceHandle {
    /// A new source, with this one handle, counted in `shared`'s sources.
    pub(crate) fn new(settings: Settings, shared: Option<Arc<Shared>>) -> Self {
        let max = settings.max_in_flight.min(MAX_CREDIT) as u64;
        let span = (settings.span.min(MAX_SPAN) as u64).max(max);
        let source = Box::new(Source {
            hot: CachePadded::new(Hot {
                word: AtomicU64::new(HANDLE),
            }),
            next: CachePadded::new(AtomicU64::new(0)),
            fixed: CachePadded::new(Fixed {
                max,
                // Hold back at most 1/16 of the credit (and never more than
                // 16), so batching never starves a small receiver.
                batch: (max / 16).clamp(1, 16),
                span,
                flags: AtomicU8::new(0),
                dispatcher: settings.dispatcher,
            }),
            stoppers: AtomicUsize::new(0),
            lent: AtomicUsize::new(0),
            inherited: AtomicUsize::new(0),
            commits: settings.track.then(Commits::new),
            waiters: Mutex::new(Waiters::default()),
            drainers: Mutex::new(Vec::new()),
            handover: Mutex::new(Vec::new()),
            shared,
        });
        let ptr = NonNull::from(Box::leak(source));
        // SAFETY: just made; the handle keeps it alive.
        if let Some(shared) = unsafe { ptr.as_ref() }.shared.as_ref() {
            shared.register_source(SourceRef(ptr));
        }
        SourceHandle(ptr)
    }

    #[inline]
    pub(crate) fn source(&self) -> &Source {
        // SAFETY: a handle is counted in the word, so the source is alive.
        unsafe { self.0.as_ref() }
    }

    /// The pointer an accepted message carries. Only valid while that
    /// message holds its unit (or a handle count).
    #[inline]
    pub(crate) fn as_ref(&self) -> SourceRef {
        SourceRef(self.0)
    }
}

impl Clone for SourceHandle {
    fn clone(&self) -> Self {
        self.source().hot.word.fetch_add(HANDLE, Relaxed);
        SourceHandle(self.0)
    }
}

impl Drop for SourceHandle {
    fn drop(&mut self) {
        // SAFETY: this handle is counted, so the source is alive until the
        // subtraction; `drop_ref` frees it if the word reaches zero.
        unsafe { drop_ref(self.0) }
    }
}

/// Drops one handle count; frees the source if the word reached zero.
///
/// # Safety
/// The caller owns one handle count of the source at `ptr`.
unsafe fn drop_ref(ptr: NonNull<Source>) {
    // SAFETY: the count we own keeps the source alive for this access.
    let word = &unsafe { ptr.as_ref() }.hot.word;
    let now = word.fetch_sub(HANDLE, AcqRel) - HANDLE;
    if now == 0 {
        // SAFETY: the word is zero: no handle, unit or waiter is left.
        unsafe { free(ptr) };
    } else if now & !WAITER_BITS == 0 {
        // No handle and no unit, but a waiter bit is still set: a drainer
        // (or a submitter) registered, then found what it waited for and
        // left its entry behind. Nobody can be waiting any more (a waiter
        // holds a handle), so the bit is stale; whoever turns the word to
        // zero frees the source (the executor's list counts only a non-zero
        // word, and only one compare-exchange from `now` can succeed).
        if word.compare_exchange(now, 0, AcqRel, Relaxed).is_ok() {
            // SAFETY: as above: we made the word zero.
            unsafe { free(ptr) };
        }
    }
}

/// Frees a source whose word reached zero: no handle, unit or waiter is
/// left, so nobody but the executor's list of sources can reach it, and
/// it is taken out of that list first.
///
/// # Safety
/// The caller made the word zero; `ptr` came from `Box::leak`.
unsafe fn free(ptr: NonNull<Source>) {
    // SAFETY: alive until we drop it below (caller's contract).
    let source = unsafe { Box::from_raw(ptr.as_ptr()) };
    if let Some(shared) = &source.shared {
        shared.deregister_source(SourceRef(ptr));
    }
    drop(source);
}

impl SourceRef {
    /// Takes a handle count, keeping the source alive without a unit (a
    /// forwarded message that holds another source's unit).
    pub(crate) fn add_ref(self) {
        self.get().hot.word.fetch_add(HANDLE, Relaxed);
    }

    /// Takes a handle count unless the source is being freed (its word is
    /// zero). For the executor's list of sources, under its lock: `free`
    /// takes that lock before the memory goes.
    pub(crate) fn try_add_ref(self) -> bool {
        let word = &self.get().hot.word;
        let mut cur = word.load(SeqCst);
        loop {
            if cur == 0 {
                return false;
            }
            match word.compare_exchange_weak(cur, cur + HANDLE, SeqCst, SeqCst) {
                Ok(_) => return true,
                Err(actual) => cur = actual,
            }
        }
    }

    /// Gives back a count [`add_ref`](Self::add_ref) took.
    ///
    /// # Safety
    /// The caller owns such a count.
    pub(crate) unsafe fn drop_ref(self) {
        // SAFETY: caller's contract.
        unsafe { drop_ref(self.0) }
    }

    /// The source (valid while a unit or a handle is held, or while it is
    /// listed).
    #[inline]
    pub(crate) fn get(&self) -> &Source {
        // SAFETY: the caller's unit, handle count or the list keeps it alive.
        unsafe { self.0.as_ref() }
    }

    /// Units a worker may hold back before giving them back.
    #[inline]
    pub(crate) fn batch(self) -> u64 {
        self.get().fixed.batch
    }
}

impl Source {
    /// Its credit: `max_in_flight`.
    pub(crate) fn max(&self) -> usize {
        self.fixed.max as usize
    }

    /// The commit span's cap.
    pub(crate) fn span(&self) -> u64 {
        self.fixed.span
    }

    /// The id of the dispatcher it feeds.
    pub(crate) fn dispatcher(&self) -> u64 {
        self.fixed.dispatcher
    }

    /// Units held by accepted, unfinished messages.
    pub(crate) fn in_flight(&self) -> usize {
        (self.hot.word.load(Relaxed) & IN_FLIGHT_MASK) as usize
    }

    // ----- positions and the commit point ---------------------------------

    /// The position of a message that is being accepted.
    #[inline]
    pub(crate) fn take_position(&self) -> u64 {
        self.next.fetch_add(1, Relaxed)
    }

    /// Takes `n` consecutive positions (a batch); returns the first.
    pub(crate) fn take_positions(&self, n: u64) -> u64 {
        self.next.fetch_add(n, Relaxed)
    }

    /// Positions taken so far.
    pub(crate) fn positions(&self) -> u64 {
        self.next.load(Acquire)
    }

    /// Whether the receiver records how its messages end.
    #[inline]
    pub(crate) fn tracks_commits(&self) -> bool {
        self.commits.is_some()
    }

    /// Records how the message at `position` ended (tracked receivers).
    #[inline]
    pub(crate) fn record(&self, position: u64, ended: Ended) {
        if let Some(c) = &self.commits {
            c.record(position, ended);
        }
    }

    /// Leading positions whose messages all finished (done or panicked);
    /// 0 for a receiver that does not track commits.
    pub(crate) fn committable(&self) -> u64 {
        self.commits.as_ref().map_or(0, Commits::committed)
    }
}

/// A source kept alive by a handle count (taken with
/// [`SourceRef::try_add_ref`]), dropped on drop.
pub(crate) struct SourceGuard(SourceRef);

impl SourceGuard {
    /// Pins `source` unless it is being freed.
    pub(crate) fn new(source: SourceRef) -> Option<Self> {
        // `then`, not `then_some`: the latter builds the guard even when no
        // count was taken, and its drop then gives back a count it never
        // had (the word of a source being freed went below zero).
        source.try_add_ref().then(|| SourceGuard(source))
    }
}

impl std::ops::Deref for SourceGuard {
    type Target = Source;

    fn deref(&self) -> &Source {
        self.0.get()
    }
}

impl Drop for SourceGuard {
    fn drop(&mut self) {
        // SAFETY: we own the handle count `new` took.
        unsafe { self.0.drop_ref() }
    }
}

#[cfg(all(test, not(loom)))]
pub(super) mod tests {
    use super::*;

    /// A tracked source of `max` units and commit span `span`, outside any
    /// executor.
    pub(in crate::pool::source) fn source(max: usize, span: usize) -> SourceHandle {
        SourceHandle::new(
            Settings {
                max_in_flight: max,
                span,
                track: true,
                dispatcher: 0,
            },
            None,
        )
    }

    #[test]
    fn a_guard_of_a_source_being_freed_touches_nothing() {
        let h = source(4, 1024);
        let word = &h.source().hot.word;
        // As while the last handle's `drop_ref` frees it: the word is zero.
        let was = word.swap(0, SeqCst);
        assert!(SourceGuard::new(h.as_ref()).is_none());
        assert_eq!(word.load(SeqCst), 0, "a refused guard gave back a count");
        word.store(was, SeqCst);
        let g = SourceGuard::new(h.as_ref()).expect("a live source is pinned");
        assert_eq!(word.load(SeqCst), was + HANDLE);
        drop(g);
        assert_eq!(word.load(SeqCst), was);
    }

    #[test]
    fn outlives_its_handles_while_units_are_held() {
        let h = source(4, 1024);
        assert!(h.source().try_acquire());
        let r = h.as_ref();
        let h2 = h.clone();
        drop(h);
        drop(h2);
        // The unit keeps it alive; releasing it frees it (Miri checks this).
        // SAFETY: one unit is held.
        unsafe { r.release(1) };
    }

    #[test]
    fn a_receiver_without_tracking_has_no_cap_and_no_commit_point() {
        let h = SourceHandle::new(
            Settings {
                max_in_flight: 2,
                span: 2,
                track: false,
                dispatcher: 0,
            },
            None,
        );
        let s = h.source();
        for _ in 0..10 {
            assert!(s.try_acquire());
            let p = s.take_position();
            s.record(p, Ended::Finished);
            // SAFETY: we hold the unit just taken.
            unsafe { h.as_ref().release(1) };
        }
        assert_eq!(s.positions(), 10);
        assert_eq!(s.committable(), 0);
        assert!(!s.tracks_commits());
    }

    #[test]
    fn the_last_handle_frees_a_source_whose_drainer_left_its_bit_set() {
        let h = source(1, 1024);
        // A drainer registers, finds the source drained and leaves.
        assert!(h.source().wait_drained(&Waiter::register_thread));
        assert_ne!(h.source().hot.word.load(SeqCst) & DRAINERS, 0);
        // The stale bit does not keep the source alive (Miri reports a
        // leak if it does).
        drop(h);
    }
}
