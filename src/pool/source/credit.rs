//! Credit: taking and giving back a source's units, and the submitters
//! that wait for one.
//!
//! # The protocol
//!
//! `in_flight` and the `WAITERS` bit live in the source's word (see the
//! module docs of `source`). Transitions, and who makes them:
//!
//! - **acquire** (a submitter, holding a handle): CAS `in_flight + 1`
//!   while it is below `max` and the commit span is below its cap. A
//!   failing acquire re-reads the word with SeqCst before it gives up, so
//!   that a registration that follows cannot miss a release.
//! - **release** `n` (whoever ended `n` messages: a worker, possibly
//!   batched; a stop handing messages back; a refused enqueue): if neither
//!   waiter bit is set, CAS `in_flight - n`, freeing the source if the word
//!   became zero. Otherwise first take a handle count (`handles + 1`),
//!   subtract, wake up to `n` submitters and every drainer, and drop the
//!   count. The last units while handles remain take that slow path too: a
//!   graceful stop may wait for them (`drained`), and the handles may all
//!   go the moment the units are back. A CAS that fails because a bit was
//!   set meanwhile retries on the slow path, so a release never misses a
//!   waiter.
//! - **register a waiter** ([`Acquire::poll`], a submitter holding a
//!   handle): under the list lock, push and set `WAITERS`; then try to
//!   acquire once more. Against a release this is the Dekker pattern on one
//!   word: either the release saw `WAITERS` (and wakes a waiter), or the
//!   retry sees the unit it gave back. Then, after a fence, it looks at the
//!   stop flags (its source's, its dispatcher's, the executor's): against a
//!   stop it is the same hand-shake, written down in `stop.rs`.
//! - **pass a wake on**: a waiter that was popped (notified) and gives up
//!   without taking a unit passes the notification on, so a unit is never
//!   left unused while someone sleeps; one that leaves because the source
//!   closed does not (every waiter of the source leaves).
//! - **poke**: a message that ends without giving back a unit of this
//!   source (it held a share) wakes one waiter and every drainer, since no
//!   release of its own will.
//!
//! `WAITERS` is cleared only when the list is empty, so a waiter still
//! registered keeps it set. Acquisition is not strictly FIFO (a
//! `try_submit` can barge in); the list only orders who is woken.
//!
//! # The commit span
//!
//! A receiver that tracks commits caps the span of positions between its
//! commit point and `next` (`span`): a submitter finding it full waits as
//! it waits for credit (a message that ends releases a unit, or pokes, and
//! wakes it). Follow-ups that share another message's unit (`unit.rs`) are
//! not held by the cap — a handler never waits — and are bounded by the
//! credit they hold.

use super::{Source, SourceRef, HANDLE, IN_FLIGHT_MASK, WAITERS, WAITER_BITS};
use crate::sync::atomic::{fence, Ordering::*};
use crate::sync::cas_guess;
use crate::waiter::Waiter;

/// The most units a receiver can hold (the in-flight field's capacity).
pub(crate) const MAX_CREDIT: usize = IN_FLIGHT_MASK as usize;

/// How long a blocking submitter retries for credit before it parks.
#[cfg(not(loom))]
const CREDIT_SPIN: std::time::Duration = std::time::Duration::from_micros(20);

/// The largest commit span a receiver may be given.
pub(crate) const MAX_SPAN: usize = 1 << 24;

impl SourceRef {
    /// Gives back `n` units.
    ///
    /// # Safety
    /// The caller holds `n` units of this source (acquired and not released).
    pub(crate) unsafe fn release(self, n: u64) {
        // SAFETY: the units we hold keep the source alive until we give them
        // back below.
        let source = unsafe { self.0.as_ref() };
        let word = &source.hot.word;
        let mut cur = cas_guess(word);
        loop {
            debug_assert!(cur & IN_FLIGHT_MASK >= n, "credit released twice");
            // The last units while handles remain: a graceful stop may be
            // waiting for them, and the handles may all go the moment they
            // are back, freeing the source under `drained`. Take a handle
            // count first, like a wake-up.
            let last_with_handles = cur & IN_FLIGHT_MASK == n && cur != n;
            if cur & WAITER_BITS != 0 || last_with_handles {
                // Slow path: a handle count, so the source outlives the wake-ups.
                word.fetch_add(HANDLE, Relaxed);
                let now = (word.fetch_sub(n, SeqCst) - n) & IN_FLIGHT_MASK;
                source.notify(n);
                source.wake_drainers();
                if now == 0 {
                    source.drained();
                }
                // SAFETY: we own the handle count taken above.
                unsafe { super::drop_ref(self.0) };
                return;
            }
            match word.compare_exchange_weak(cur, cur - n, SeqCst, Relaxed) {
                Ok(_) => {
                    if cur == n {
                        // The last unit came back and no handle is left
                        // (`free` takes the source out of the executor's
                        // list, which wakes a graceful stop).
                        // SAFETY: we made the word zero; it was made by
                        // `Box::leak`.
                        unsafe { super::free(self.0) };
                    }
                    // Units are still out (the last ones take the slow
                    // path): the source is not touched after the CAS.
                    return;
                }
                Err(actual) => cur = actual,
            }
        }
    }
}

impl Source {
    /// Takes one unit if one is free and the span of unfinished positions
    /// is below its cap.
    #[inline]
    pub(crate) fn try_acquire(&self) -> bool {
        if self.span_full() {
            return false;
        }
        let word = &self.hot.word;
        let mut cur = cas_guess(word);
        loop {
            if cur & IN_FLIGHT_MASK >= self.fixed.max {
                // Re-read with SeqCst so a failing acquire that is followed by
                // registration cannot miss a release (see the module docs).
                cur = word.load(SeqCst);
                if cur & IN_FLIGHT_MASK >= self.fixed.max {
                    return false;
                }
            }
            match word.compare_exchange_weak(cur, cur + 1, SeqCst, Relaxed) {
                Ok(_) => return true,
                Err(actual) => cur = actual,
            }
        }
    }

    /// Takes up to `n` units at once (a batch), as many as are free and as
    /// the span below its cap allows; returns how many (0 if none).
    pub(crate) fn try_acquire_many(&self, n: u64) -> u64 {
        if n == 0 || self.span_full() {
            return 0;
        }
        let want = n.min(self.span_room().max(1));
        let word = &self.hot.word;
        let mut cur = cas_guess(word);
        loop {
            let mut free = self.fixed.max.saturating_sub(cur & IN_FLIGHT_MASK);
            if free == 0 {
                // As in `try_acquire`: a failing acquire reads with SeqCst.
                cur = word.load(SeqCst);
                free = self.fixed.max.saturating_sub(cur & IN_FLIGHT_MASK);
                if free == 0 {
                    return 0;
                }
            }
            let take = want.min(free);
            match word.compare_exchange_weak(cur, cur + take, SeqCst, Relaxed) {
                Ok(_) => return take,
                Err(actual) => cur = actual,
            }
        }
    }

    /// Retries [`try_acquire`](Self::try_acquire) for up to
    /// [`CREDIT_SPIN`], yielding the thread between rounds, before a
    /// blocking caller registers as a waiter: workers give units back a few
    /// at a time, and parking at once would make each of those releases a
    /// futex wake. Calls `before_wait` first (see [`Acquire`]).
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

    /// Whether the span from the commit point to `next` has reached its
    /// cap (tracked receivers only).
    #[inline]
    fn span_full(&self) -> bool {
        self.commits.is_some() && self.span_room() == 0
    }

    /// Positions the span's cap allows past `next` (all, untracked). A
    /// stale `next` only makes the span look smaller: the difference
    /// saturates.
    #[inline]
    fn span_room(&self) -> u64 {
        match &self.commits {
            None => u64::MAX,
            Some(c) => {
                let lag = self.next.load(Relaxed).saturating_sub(c.committed());
                self.fixed.span.saturating_sub(lag)
            }
        }
    }

    /// Pops up to `n` waiters and wakes them. The caller keeps the source
    /// alive (a handle count).
    #[cold]
    pub(super) fn notify(&self, n: u64) {
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
                self.hot.word.fetch_and(!WAITERS, SeqCst);
            }
        }
        for waiter in woken {
            waiter.wake();
        }
    }

    /// A message of this source ended without giving back one of its units
    /// (it held another source's unit): wake whoever might wait on this
    /// source, since no release of its own will.
    #[cold]
    pub(crate) fn poke(&self) {
        fence(SeqCst);
        if self.hot.word.load(SeqCst) & WAITER_BITS != 0 {
            self.notify(1);
            self.wake_drainers();
        }
    }
}

/// What one poll of an [`Acquire`] came to.
#[must_use]
pub(crate) enum Acquired {
    /// A unit was taken; the attempt is over.
    Unit,
    /// The submitter is registered as a waiter: a release, or a stop,
    /// wakes it to poll again.
    Waiting,
    /// The source, its dispatcher or the executor is closed: the attempt
    /// is over, without a unit.
    Closed,
}

/// One submitter's attempt to take a unit of credit, possibly over several
/// polls (see the module docs; against a stop, `stop.rs`). Dropping it
/// deregisters (or passes on a notification it received). The submitter
/// holds a handle for as long as this lives.
pub(crate) struct Acquire<'a> {
    source: &'a Source,
    id: Option<u64>,
    /// Called once before each registration as a waiter (the receiver
    /// passes a function that gives back the units this thread's worker
    /// holds back, since those may be the ones it waits for).
    before_wait: fn(),
}

impl<'a> Acquire<'a> {
    /// An attempt on `source`; `before_wait` runs before each registration.
    pub(crate) fn new(source: &'a Source, before_wait: fn()) -> Self {
        Acquire {
            source,
            id: None,
            before_wait,
        }
    }

    /// Takes a unit if one is free, else registers the waiter (or renews
    /// its registration) to be woken by a release or a stop. `closed` says
    /// whether the source, its dispatcher or the executor refuses new
    /// messages (SeqCst loads of their flags); it is asked before anything
    /// else, and again after a new registration (see `stop.rs`).
    pub(crate) fn poll(
        &mut self,
        waiter: &dyn Fn(&mut Option<Waiter>),
        closed: &dyn Fn() -> bool,
    ) -> Acquired {
        loop {
            if closed() {
                self.leave_closed();
                return Acquired::Closed;
            }
            if self.source.try_acquire() {
                self.leave_queue(false);
                return Acquired::Unit;
            }
            if self.id.is_none() {
                // About to wait: a worker running this (a handler submitting)
                // must not sit on units it holds back.
                (self.before_wait)();
                if self.source.try_acquire() {
                    return Acquired::Unit;
                }
            }
            let mut w = self.source.waiters.lock();
            match self.id {
                // Still registered: a stop that saw the first registration
                // has yet to pop it, and will wake the waiter set here.
                Some(id) => match w.queue.iter_mut().find(|(i, _)| *i == id) {
                    Some((_, slot)) => {
                        waiter(slot);
                        return Acquired::Waiting;
                    }
                    // Popped by a release or a stop: retry from scratch.
                    None => self.id = None,
                },
                None => {
                    let id = w.next_id;
                    w.next_id += 1;
                    let mut new = None;
                    waiter(&mut new);
                    w.queue.push_back((id, new));
                    self.source.hot.word.fetch_or(WAITERS, SeqCst);
                    self.id = Some(id);
                    drop(w);
                    if self.source.try_acquire() {
                        self.leave_queue(false);
                        return Acquired::Unit;
                    }
                    // After the registration (see `stop.rs`).
                    fence(SeqCst);
                    if closed() {
                        self.leave_closed();
                        return Acquired::Closed;
                    }
                    return Acquired::Waiting;
                }
            }
        }
    }

    /// Leaves the queue. If we had been popped (notified) and `pass_on`
    /// (we leave without a unit), pass the notification on.
    fn leave_queue(&mut self, pass_on: bool) {
        let Some(id) = self.id.take() else { return };
        let mut w = self.source.waiters.lock();
        if let Some(pos) = w.queue.iter().position(|(i, _)| *i == id) {
            w.queue.remove(pos);
            if w.queue.is_empty() {
                self.source.hot.word.fetch_and(!WAITERS, SeqCst);
            }
        } else if pass_on {
            drop(w);
            // The submitter's handle keeps the source alive.
            self.source.notify(1);
        }
    }

    /// Leaves the queue, closed. A notification we got is not passed on:
    /// every waiter of this source finds it closed too (they share its
    /// flags, its dispatcher's and the executor's), and a stop woke them
    /// all.
    fn leave_closed(&mut self) {
        self.leave_queue(false);
    }
}

impl Drop for Acquire<'_> {
    fn drop(&mut self) {
        self.leave_queue(true);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::super::tests::source;
    use super::super::{Ended, WAITERS};
    use super::*;
    use crate::sync::thread;

    #[test]
    fn counts_caps_and_releases() {
        let h = source(2, 1024);
        let c = h.source();
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
    fn blocked_acquirer_is_woken_by_release() {
        let h = source(1, 1024);
        assert!(h.source().try_acquire());
        let h2 = h.clone();
        let t = std::thread::spawn(move || {
            let mut a = Acquire::new(h2.source(), || {});
            while !matches!(a.poll(&Waiter::register_thread, &|| false), Acquired::Unit) {
                thread::park();
            }
        });
        while h.source().hot.word.load(SeqCst) & WAITERS == 0 {
            std::thread::yield_now();
        }
        // SAFETY: one unit is held.
        unsafe { h.as_ref().release(1) };
        t.join().unwrap();
        assert_eq!(h.source().in_flight(), 1);
        assert!(h.source().waiters.lock().queue.is_empty());
        assert_eq!(h.source().hot.word.load(SeqCst) & WAITERS, 0);
        // Give back the unit the thread took, or the source is never freed
        // (Miri reports the leak).
        // SAFETY: one unit is held.
        unsafe { h.as_ref().release(1) };
    }

    #[test]
    fn dropped_notified_waiter_passes_the_wake_on() {
        let h = source(1, 1024);
        let c = h.source();
        assert!(c.try_acquire());
        let mut a = Acquire::new(c, || {});
        let mut b = Acquire::new(c, || {});
        assert!(matches!(
            a.poll(&Waiter::register_thread, &|| false),
            Acquired::Waiting
        ));
        assert!(matches!(
            b.poll(&Waiter::register_thread, &|| false),
            Acquired::Waiting
        ));
        // SAFETY: one unit is held.
        unsafe { h.as_ref().release(1) }; // pops `a`
        drop(a); // never retried: must hand the wake to `b`
        assert!(c.waiters.lock().queue.is_empty(), "b was popped too");
        assert!(matches!(
            b.poll(&Waiter::register_thread, &|| false),
            Acquired::Unit
        ));
        // SAFETY: `b` took the one unit.
        unsafe { h.as_ref().release(1) };
    }

    #[test]
    fn a_full_span_refuses_credit_until_the_commit_point_moves() {
        let h = source(4, 4);
        let s = h.source();
        for _ in 0..4 {
            assert!(s.try_acquire());
            s.take_position();
        }
        // Positions 1..3 finish (their units come back); 0 still runs.
        for p in 1..4 {
            s.record(p, Ended::Finished);
        }
        // SAFETY: four units are held.
        unsafe { h.as_ref().release(3) };
        assert_eq!(s.in_flight(), 1);
        assert!(!s.try_acquire(), "credit is free, but the span is full");
        s.record(0, Ended::Finished);
        assert!(s.try_acquire(), "the commit point moved on");
        assert_eq!(s.committable(), 4);
        // SAFETY: two units are held.
        unsafe { h.as_ref().release(2) };
    }

    #[test]
    fn a_batch_takes_what_both_the_credit_and_the_span_allow() {
        let h = source(4, 6);
        let s = h.source();
        assert_eq!(s.try_acquire_many(0), 0);
        assert_eq!(s.try_acquire_many(3), 3);
        s.take_positions(3);
        assert_eq!(s.try_acquire_many(3), 1, "one unit was left");
        s.take_positions(1);
        assert_eq!(s.try_acquire_many(1), 0, "no credit left");
        // SAFETY: four units are held.
        unsafe { h.as_ref().release(4) };
        // Positions 0..4 are not committed: a span of 6 leaves room for 2.
        assert_eq!(s.try_acquire_many(4), 2);
        s.take_positions(2);
        assert_eq!(
            s.try_acquire_many(1),
            0,
            "credit is free, but the span is full"
        );
        for p in 0..6 {
            s.record(p, Ended::Finished);
        }
        assert_eq!(s.committable(), 6);
        assert_eq!(s.try_acquire_many(4), 2, "two units are still out");
        // SAFETY: four units are held.
        unsafe { h.as_ref().release(4) };
        assert_eq!(s.in_flight(), 0);
    }
}
