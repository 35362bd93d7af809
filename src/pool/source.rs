//! Credit: how many messages one receiver holds unfinished, and who waits for
//! a unit to come back.
//!
//! # The word
//!
//! All of a credit's shared state lives in one atomic word, so that a message
//! costs one read-modify-write when it is accepted and (amortised) less than
//! one when it finishes:
//!
//! | bits  | meaning |
//! |-------|---------|
//! | 0–39  | `in_flight`: units held by accepted, unfinished messages |
//! | 40–62 | `handles`: live [`CreditHandle`]s (receivers and their clones, plus temporary pins) |
//! | 63    | `WAITERS`: the waiter list is not empty |
//!
//! The credit is heap-allocated once and freed by whoever makes the word
//! reach zero: no handle, no unit, no waiter. An accepted message therefore
//! needs no reference count of its own: it carries a plain [`CreditRef`],
//! kept valid by the unit it holds.
//!
//! # Transitions and who makes them
//!
//! - acquire (a submitter, holding a handle): CAS `in_flight + 1` while it
//!   is below `max`.
//! - release `n` (whoever finished `n` messages: a worker, possibly batched;
//!   a force stop; a refused enqueue): if `WAITERS` is clear, CAS
//!   `in_flight - n`, freeing the credit if the word became zero. If it is
//!   set, first pin the credit (`handles + 1`), then subtract, pop and wake up
//!   to `n` waiters, and drop the pin. A CAS that fails because `WAITERS` was
//!   set meanwhile retries on the slow path, so a release never misses a
//!   waiter.
//! - register a waiter (a submitter, holding a handle): under the list lock,
//!   push and set `WAITERS`; then try to acquire once more. Against a release
//!   this is the Dekker pattern on one word: either the release saw `WAITERS`
//!   (and wakes a waiter), or the retry sees the unit it gave back.
//! - a waiter that was popped (notified) and gives up without taking a unit
//!   passes the notification on, so a unit is never left unused while someone
//!   sleeps.
//! - handle clone/drop: `handles ± 1`; the drop that makes the word zero
//!   frees the credit.
//!
//! Acquisition is not strictly FIFO (a `try_submit` can barge in); the list
//! only orders who is woken.

use std::collections::VecDeque;
use std::ptr::NonNull;

use crossbeam_utils::CachePadded;

use crate::pool::executor::Shared;
use crate::sync::atomic::{AtomicU64, Ordering::*};
use crate::sync::{cas_guess, Arc, Mutex};
use crate::waiter::Waiter;

const IN_FLIGHT_MASK: u64 = (1 << 40) - 1;

/// How long a blocking submitter retries for credit before it parks.
#[cfg(not(loom))]
const CREDIT_SPIN: std::time::Duration = std::time::Duration::from_micros(20);
const HANDLE: u64 = 1 << 40;
const WAITERS: u64 = 1 << 63;

/// The most units a receiver can hold (the in-flight field's capacity).
pub(crate) const MAX_CREDIT: usize = IN_FLIGHT_MASK as usize;

pub(crate) struct Credit {
    /// The word above, alone on its cache line (it is the hot one).
    word: CachePadded<AtomicU64>,
    /// Read-only after creation (on another line, shared by every core).
    max: u64,
    /// How many released units a worker may hold back before returning them.
    batch: u64,
    waiters: Mutex<Waiters>,
    /// The executor: it counts this credit in its list of sources (a
    /// graceful stop waits until no source has a unit out), and is woken
    /// when the last unit comes back during a stop. `None` in unit tests.
    shared: Option<Arc<Shared>>,
}

#[derive(Default)]
struct Waiters {
    queue: VecDeque<(u64, Option<Waiter>)>,
    next_id: u64,
}

/// A counted handle to a credit (held by receivers).
pub(crate) struct CreditHandle(NonNull<Credit>);

/// An uncounted pointer to a credit, valid while its holder holds a unit
/// (or, for the executor's list of sources, while it is in that list).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct CreditRef(NonNull<Credit>);

// SAFETY: `Credit` is `Sync` (atomics and a mutex); handles and refs are
// pointers to it whose validity is governed by the counts in its word, not by
// the thread that holds them.
unsafe impl Send for CreditHandle {}
// SAFETY: as above.
unsafe impl Sync for CreditHandle {}
// SAFETY: as above.
unsafe impl Send for CreditRef {}
// SAFETY: as above.
unsafe impl Sync for CreditRef {}

impl CreditHandle {
    /// A new credit of `max` units, with this one handle, counted in
    /// `shared`'s sources.
    pub(crate) fn new(max: usize, shared: Option<Arc<Shared>>) -> Self {
        let max = max.min(MAX_CREDIT) as u64;
        let credit = Box::new(Credit {
            word: CachePadded::new(AtomicU64::new(HANDLE)),
            max,
            // Hold back at most 1/16 of the window (and never more than 16),
            // so batching never starves a small receiver.
            batch: (max / 16).clamp(1, 16),
            waiters: Mutex::new(Waiters::default()),
            shared,
        });
        let ptr = NonNull::from(Box::leak(credit));
        // SAFETY: just made; the handle keeps it alive.
        if let Some(shared) = unsafe { ptr.as_ref() }.shared.as_ref() {
            shared.register_source(CreditRef(ptr));
        }
        CreditHandle(ptr)
    }

    #[inline]
    pub(crate) fn credit(&self) -> &Credit {
        // SAFETY: a handle is counted in the word, so the credit is alive.
        unsafe { self.0.as_ref() }
    }

    /// The pointer an accepted message carries. Only valid while that
    /// message holds its unit.
    #[inline]
    pub(crate) fn as_ref(&self) -> CreditRef {
        CreditRef(self.0)
    }
}

impl Clone for CreditHandle {
    fn clone(&self) -> Self {
        self.credit().word.fetch_add(HANDLE, Relaxed);
        CreditHandle(self.0)
    }
}

impl Drop for CreditHandle {
    fn drop(&mut self) {
        // SAFETY: this handle is counted, so the credit is alive until the
        // subtraction; `unpin` frees it if the word reaches zero.
        unsafe { unpin(self.0) }
    }
}

/// Drops one handle count; frees the credit if the word reached zero.
///
/// # Safety
/// The caller owns one handle count of the credit at `ptr`.
unsafe fn unpin(ptr: NonNull<Credit>) {
    // SAFETY: the count we own keeps the credit alive for this access.
    let prev = unsafe { ptr.as_ref() }.word.fetch_sub(HANDLE, AcqRel);
    if prev == HANDLE {
        // SAFETY: the word is zero: no handle, unit or waiter is left.
        unsafe { free(ptr) };
    }
}

/// Frees a credit whose word reached zero: no handle, unit or waiter is
/// left, so nobody but the executor's list of sources can reach it, and
/// it is taken out of that list first.
///
/// # Safety
/// The caller made the word zero; `ptr` came from `Box::leak`.
unsafe fn free(ptr: NonNull<Credit>) {
    // SAFETY: alive until we drop it below (caller's contract).
    let credit = unsafe { Box::from_raw(ptr.as_ptr()) };
    if let Some(shared) = &credit.shared {
        shared.deregister_source(CreditRef(ptr));
    }
    drop(credit);
}

impl CreditRef {
    /// Gives back `n` units.
    ///
    /// # Safety
    /// The caller holds `n` units of this credit (acquired and not released).
    pub(crate) unsafe fn release(self, n: u64) {
        // SAFETY: the units we hold keep the credit alive until we give them
        // back below.
        let credit = unsafe { self.0.as_ref() };
        let mut cur = cas_guess(&credit.word);
        loop {
            debug_assert!(cur & IN_FLIGHT_MASK >= n, "credit released twice");
            if cur & WAITERS != 0 {
                // Slow path: pin, so the credit outlives the wake-ups.
                credit.word.fetch_add(HANDLE, Relaxed);
                let prev = credit.word.fetch_sub(n, SeqCst);
                credit.notify(n);
                if (prev - n) & IN_FLIGHT_MASK == 0 {
                    credit.drained();
                }
                // SAFETY: we own the pin taken above.
                unsafe { unpin(self.0) };
                return;
            }
            match credit
                .word
                .compare_exchange_weak(cur, cur - n, SeqCst, Relaxed)
            {
                Ok(_) => {
                    if cur == n {
                        // SAFETY: we made the word zero; it was made by
                        // `Box::leak`.
                        unsafe { free(self.0) };
                    } else if (cur - n) & IN_FLIGHT_MASK == 0 {
                        // The last unit came back: a graceful stop may be
                        // waiting for that (the handles keep it alive).
                        credit.drained();
                    }
                    return;
                }
                Err(actual) => cur = actual,
            }
        }
    }

    /// The credit (valid while a unit is held, or while it is listed).
    #[inline]
    pub(crate) fn get(&self) -> &Credit {
        // SAFETY: the caller's unit or the list keeps it alive.
        unsafe { self.0.as_ref() }
    }

    /// Units a worker may hold back before giving them back.
    #[inline]
    pub(crate) fn batch(self) -> u64 {
        // SAFETY: only called while the caller holds a unit.
        unsafe { self.0.as_ref() }.batch
    }
}

impl Credit {
    /// No unit is out any more: during a graceful stop, the workers check
    /// whether everything drained.
    fn drained(&self) {
        if let Some(shared) = &self.shared {
            shared.wake_if_closed();
        }
    }

    pub(crate) fn max(&self) -> usize {
        self.max as usize
    }

    pub(crate) fn in_flight(&self) -> usize {
        (self.word.load(Relaxed) & IN_FLIGHT_MASK) as usize
    }

    /// Takes one unit if one is free.
    #[inline]
    pub(crate) fn try_acquire(&self) -> bool {
        let mut cur = cas_guess(&self.word);
        loop {
            if cur & IN_FLIGHT_MASK >= self.max {
                // Re-read with SeqCst so a failing acquire that is followed by
                // registration cannot miss a release (see module docs).
                cur = self.word.load(SeqCst);
                if cur & IN_FLIGHT_MASK >= self.max {
                    return false;
                }
            }
            match self
                .word
                .compare_exchange_weak(cur, cur + 1, SeqCst, Relaxed)
            {
                Ok(_) => return true,
                Err(actual) => cur = actual,
            }
        }
    }

    /// Retries [`try_acquire`](Self::try_acquire) for up to
    /// [`CREDIT_SPIN`], yielding the thread between rounds, before a
    /// blocking caller registers as a waiter. Calls `before_wait` first:
    /// the receiver passes a function that gives back the units this
    /// thread's worker holds back (a handler submitting), since those may
    /// be the ones it waits for.
    #[cfg(not(loom))]
    pub(crate) fn spin_acquire(&self, before_wait: fn()) -> bool {
        before_wait();
        let start = std::time::Instant::now();
        loop {
            for _ in 0..16 {
                if self.try_acquire() {
                    return true;
                }
                core::hint::spin_loop();
            }
            if start.elapsed() >= CREDIT_SPIN {
                return false;
            }
            std::thread::yield_now();
        }
    }

    /// Pops up to `n` waiters and wakes them. The caller keeps the credit
    /// alive (a pin or a handle).
    #[cold]
    fn notify(&self, n: u64) {
        let mut woken = Vec::new();
        {
            let mut w = self.waiters.lock();
            for _ in 0..n {
                match w.queue.pop_front() {
                    Some((_, waiter)) => woken.extend(waiter),
                    None => break,
                }
            }
            if w.queue.is_empty() {
                self.word.fetch_and(!WAITERS, SeqCst);
            }
        }
        for waiter in woken {
            waiter.wake();
        }
    }
}

/// One submitter's attempt to take a unit of credit, possibly over several
/// polls. Dropping it deregisters (or passes on a notification it received).
/// The submitter holds a handle for as long as this lives.
pub(crate) struct Acquire<'a> {
    credit: &'a Credit,
    id: Option<u64>,
    /// Called once before each registration as a waiter (see
    /// [`Credit::spin_acquire`]).
    before_wait: fn(),
}

impl<'a> Acquire<'a> {
    pub(crate) fn new(credit: &'a Credit, before_wait: fn()) -> Self {
        Acquire {
            credit,
            id: None,
            before_wait,
        }
    }

    /// True when a unit was taken (and the attempt is over); otherwise the
    /// waiter is registered and will be woken by a release.
    pub(crate) fn poll(&mut self, waiter: &dyn Fn(&mut Option<Waiter>)) -> bool {
        loop {
            if self.credit.try_acquire() {
                self.leave_queue(true);
                return true;
            }
            if self.id.is_none() {
                // About to wait: a worker running this (a handler submitting)
                // must not sit on units it holds back.
                (self.before_wait)();
                if self.credit.try_acquire() {
                    return true;
                }
            }
            let mut w = self.credit.waiters.lock();
            match self.id {
                Some(id) => match w.queue.iter_mut().find(|(i, _)| *i == id) {
                    Some((_, slot)) => {
                        waiter(slot);
                        return false;
                    }
                    // Popped by a release: retry from scratch.
                    None => self.id = None,
                },
                None => {
                    let id = w.next_id;
                    w.next_id += 1;
                    let mut new = None;
                    waiter(&mut new);
                    w.queue.push_back((id, new));
                    self.credit.word.fetch_or(WAITERS, SeqCst);
                    self.id = Some(id);
                    drop(w);
                    if self.credit.try_acquire() {
                        self.leave_queue(true);
                        return true;
                    }
                    return false;
                }
            }
        }
    }

    /// Leaves the queue. If we had been popped (notified) and did not take a
    /// unit, pass the notification on.
    fn leave_queue(&mut self, acquired: bool) {
        let Some(id) = self.id.take() else { return };
        let mut w = self.credit.waiters.lock();
        if let Some(pos) = w.queue.iter().position(|(i, _)| *i == id) {
            w.queue.remove(pos);
            if w.queue.is_empty() {
                self.credit.word.fetch_and(!WAITERS, SeqCst);
            }
        } else if !acquired {
            drop(w);
            // The submitter's handle keeps the credit alive.
            self.credit.notify(1);
        }
    }
}

impl Drop for Acquire<'_> {
    fn drop(&mut self) {
        self.leave_queue(false);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::sync::thread;

    fn thread_waiter(slot: &mut Option<Waiter>) {
        if !matches!(slot, Some(Waiter::Thread(_))) {
            *slot = Some(Waiter::current_thread());
        }
    }

    #[test]
    fn counts_caps_and_releases() {
        let h = CreditHandle::new(2, None);
        let c = h.credit();
        assert!(c.try_acquire());
        assert!(c.try_acquire());
        assert!(!c.try_acquire());
        // SAFETY: one unit is held.
        unsafe { h.as_ref().release(1) };
        assert!(c.try_acquire());
        assert_eq!(c.in_flight(), 2);
        // SAFETY: two units are held.
        unsafe { h.as_ref().release(2) };
        assert_eq!(c.in_flight(), 0);
    }

    #[test]
    fn outlives_its_handles_while_units_are_held() {
        let h = CreditHandle::new(4, None);
        assert!(h.credit().try_acquire());
        let r = h.as_ref();
        let h2 = h.clone();
        drop(h);
        drop(h2);
        // The unit keeps it alive; releasing it frees it (Miri checks this).
        // SAFETY: one unit is held.
        unsafe { r.release(1) };
    }

    #[test]
    fn blocked_acquirer_is_woken_by_release() {
        let h = CreditHandle::new(1, None);
        assert!(h.credit().try_acquire());
        let h2 = h.clone();
        let t = std::thread::spawn(move || {
            let mut a = Acquire::new(h2.credit(), || {});
            while !a.poll(&thread_waiter) {
                thread::park();
            }
        });
        while h.credit().word.load(SeqCst) & WAITERS == 0 {
            std::thread::yield_now();
        }
        // SAFETY: one unit is held.
        unsafe { h.as_ref().release(1) };
        t.join().unwrap();
        assert_eq!(h.credit().in_flight(), 1);
        assert!(h.credit().waiters.lock().queue.is_empty());
        assert_eq!(h.credit().word.load(SeqCst) & WAITERS, 0);
        // Give back the unit the thread took, or the credit is never freed
        // (Miri reports the leak).
        // SAFETY: one unit is held.
        unsafe { h.as_ref().release(1) };
    }

    #[test]
    fn dropped_notified_waiter_passes_the_wake_on() {
        let h = CreditHandle::new(1, None);
        let c = h.credit();
        assert!(c.try_acquire());
        let mut a = Acquire::new(c, || {});
        let mut b = Acquire::new(c, || {});
        assert!(!a.poll(&thread_waiter));
        assert!(!b.poll(&thread_waiter));
        // SAFETY: one unit is held.
        unsafe { h.as_ref().release(1) }; // pops `a`
        drop(a); // never retried: must hand the wake to `b`
        assert!(c.waiters.lock().queue.is_empty(), "b was popped too");
        assert!(b.poll(&thread_waiter));
        // SAFETY: `b` took the one unit.
        unsafe { h.as_ref().release(1) };
    }
}
