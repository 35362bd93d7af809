//! Sources: what one receiver and its clones share — the credit of
//! `max_in_flight` units, the positions of the messages it accepted and
//! what has become of each (the commit point), and whether it still takes
//! messages.
//!
//! # The credit word
//!
//! The credit's shared state lives in one atomic word, so that a message
//! costs one read-modify-write when it is accepted and (amortised) less than
//! one when it finishes:
//!
//! | bits  | meaning |
//! |-------|---------|
//! | 0–39  | `in_flight`: units held by accepted, unfinished messages |
//! | 40–61 | `handles`: live [`SourceHandle`]s (receivers and their clones, forwarded messages that hold another source's unit, temporary pins) |
//! | 62    | `DRAINERS`: someone waits for the source to drain |
//! | 63    | `WAITERS`: the list of submitters waiting for a unit is not empty |
//!
//! The source is heap-allocated once and freed by whoever makes the word
//! reach zero: no handle, no unit, no waiter. An accepted message therefore
//! needs no reference count of its own: it carries a plain [`SourceRef`],
//! kept valid by the unit it holds (or, for a forwarded message holding
//! another source's unit, by a handle it pins).
//!
//! Transitions, and who makes them:
//! - acquire (a submitter, holding a handle): CAS `in_flight + 1` while it
//!   is below `max` and the span of unfinished positions is below the cap.
//! - release `n` (whoever finished `n` messages: a worker, possibly batched;
//!   a stop handing messages back; a refused enqueue): if neither waiter bit
//!   is set, CAS `in_flight - n`, freeing the source if the word became
//!   zero. Otherwise first pin the source (`handles + 1`), subtract, wake up
//!   to `n` submitters and every drainer, and drop the pin. A CAS that fails
//!   because a bit was set meanwhile retries on the slow path, so a release
//!   never misses a waiter.
//! - register a waiter (a submitter, holding a handle): under the list lock,
//!   push and set `WAITERS`; then try to acquire once more. Against a release
//!   this is the Dekker pattern on one word: either the release saw
//!   `WAITERS` (and wakes a waiter), or the retry sees the unit it gave back.
//!   Then, after a fence, it looks at the stop flags (its source's, its
//!   dispatcher's, the executor's). A drainer does the same with
//!   `DRAINERS` and its own list.
//! - a stop (any that refuses the source's messages) sets its flag,
//!   fences and, if `WAITERS` is set, pops and wakes every waiter, who
//!   finds the flag and leaves with its message: either the stop saw the
//!   waiter's `WAITERS` or the waiter sees the flag (see [`Acquire`]).
//! - a waiter that was popped (notified) and gives up without taking a unit
//!   passes the notification on, so a unit is never left unused while someone
//!   sleeps; one that leaves because the source closed does not (every
//!   waiter of the source leaves).
//! - handle clone/drop: `handles ± 1`; the drop that makes the word zero
//!   frees the source.
//!
//! Acquisition is not strictly FIFO (a `try_submit` can barge in); the list
//! only orders who is woken.
//!
//! # Positions, drains and the commit point
//!
//! Each accepted message takes the next *position* (`next`, one
//! `fetch_add` by its submitter, on a line of its own). Whether every
//! message a source accepted has ended (a drain) is read off counts, not
//! positions: a message holding one of the source's own units holds it
//! until it ends, so `in_flight` counts them — except units that became
//! shares (`lent`), which live until their last holder ends — and
//! `inherited` counts the source's messages that hold a share of some
//! unit (a follow-up, or a message that passed its unit on). Those paths
//! are rare (forwarding beyond the credit); every count moves before the
//! message it stands for can be seen ended, so a drain is never seen early.
//!
//! A receiver that tracks commits (`ReceiverBuilder::track_commits`) also
//! records how each message ended at its position (`commits.rs`): the
//! commit point is how many leading positions all finished. The span of
//! positions between the commit point and `next` is capped (`span`): a
//! submitter finding it full waits as it waits for credit (a message that
//! ends releases a unit, or pokes, and wakes it). Follow-ups that inherit
//! another message's unit (see `receiver.rs`) are not held by the cap — a
//! handler never waits — and are bounded by the credit they hold. A
//! receiver that does not track commits pays for none of it: no record
//! per message, no cap.
//!
//! # Stops
//!
//! `flags` holds `CLOSED` (no new message is accepted) and `STOPPED` (a
//! `shutdown_now`: its messages are handed back instead of started).
//! Setting either, like the dispatcher's and the executor's stops, sends
//! the submitters waiting for a unit or for the span away with their
//! messages (`release_waiters`). A worker that meets a message of a
//! stopped source hands it to the stopping thread (`handover`) while one
//! waits there (`stoppers`), or hands it back itself if none does (a stop
//! called from a worker).

use std::collections::VecDeque;
use std::ptr::NonNull;

use crossbeam_utils::CachePadded;

use crate::pool::executor::Shared;
use crate::sync::atomic::{fence, AtomicU64, AtomicU8, AtomicUsize, Ordering::*};
use crate::sync::{cas_guess, Arc, Mutex};
use crate::waiter::Waiter;

const IN_FLIGHT_MASK: u64 = (1 << 40) - 1;
const HANDLE: u64 = 1 << 40;
const DRAINERS: u64 = 1 << 62;
const WAITERS: u64 = 1 << 63;
const WAITER_BITS: u64 = WAITERS | DRAINERS;

/// The most units a receiver can hold (the in-flight field's capacity).
pub(crate) const MAX_CREDIT: usize = IN_FLIGHT_MASK as usize;

/// How long a blocking submitter retries for credit before it parks.
#[cfg(not(loom))]
const CREDIT_SPIN: std::time::Duration = std::time::Duration::from_micros(20);

/// The largest commit span a receiver may be given.
pub(crate) const MAX_SPAN: usize = 1 << 24;

const CLOSED: u8 = 1;
const STOPPED: u8 = 2;

mod commits;

use commits::Commits;
pub(crate) use commits::Ended;

/// A rejection a worker leaves for the thread stopping the source.
pub(crate) type Handover = Box<dyn FnOnce() + Send>;

/// The credit word: submitters and releasers touch it.
struct Hot {
    word: AtomicU64,
}

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
    /// "Positions, drains and the commit point").
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
    /// message holds its unit (or a pin).
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
        // subtraction; `unpin` frees it if the word reaches zero.
        unsafe { unpin(self.0) }
    }
}

/// Drops one handle count; frees the source if the word reached zero.
///
/// # Safety
/// The caller owns one handle count of the source at `ptr`.
unsafe fn unpin(ptr: NonNull<Source>) {
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
        // zero frees the source (the executor's list pins only a non-zero
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
            // are back, freeing the source under `drained` (Miri caught
            // it). Pin first, like a wake-up.
            let last_with_handles = cur & IN_FLIGHT_MASK == n && cur != n;
            if cur & WAITER_BITS != 0 || last_with_handles {
                // Slow path: pin, so the source outlives the wake-ups.
                word.fetch_add(HANDLE, Relaxed);
                let now = (word.fetch_sub(n, SeqCst) - n) & IN_FLIGHT_MASK;
                source.notify(n);
                source.wake_drainers();
                if now == 0 {
                    source.drained();
                }
                // SAFETY: we own the pin taken above.
                unsafe { unpin(self.0) };
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
                        unsafe { free(self.0) };
                    }
                    // Units are still out (the last ones take the slow
                    // path): the source is not touched after the CAS.
                    return;
                }
                Err(actual) => cur = actual,
            }
        }
    }

    /// Takes a handle count, keeping the source alive without a unit (a
    /// forwarded message that holds another source's unit).
    pub(crate) fn pin(self) {
        self.get().hot.word.fetch_add(HANDLE, Relaxed);
    }

    /// Takes a handle count unless the source is being freed (its word is
    /// zero). For the executor's list of sources, under its lock: `free`
    /// takes that lock before the memory goes.
    pub(crate) fn try_pin(self) -> bool {
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

    /// Gives back a count [`pin`](Self::pin) took.
    ///
    /// # Safety
    /// The caller owns such a count.
    pub(crate) unsafe fn unpin(self) {
        // SAFETY: caller's contract.
        unsafe { unpin(self.0) }
    }

    /// The source (valid while a unit or a handle is held, or while it is
    /// listed).
    #[inline]
    pub(crate) fn get(&self) -> &Source {
        // SAFETY: the caller's unit, pin or the list keeps it alive.
        unsafe { self.0.as_ref() }
    }

    /// Units a worker may hold back before giving them back.
    #[inline]
    pub(crate) fn batch(self) -> u64 {
        self.get().fixed.batch
    }
}

impl Source {
    /// No unit is out any more: during a graceful stop, the workers check
    /// whether everything drained.
    fn drained(&self) {
        if let Some(shared) = &self.shared {
            shared.wake_if_closed();
        }
    }

    pub(crate) fn max(&self) -> usize {
        self.fixed.max as usize
    }

    pub(crate) fn span(&self) -> u64 {
        self.fixed.span
    }

    pub(crate) fn dispatcher(&self) -> u64 {
        self.fixed.dispatcher
    }

    pub(crate) fn in_flight(&self) -> usize {
        (self.hot.word.load(Relaxed) & IN_FLIGHT_MASK) as usize
    }

    // ----- credit --------------------------------------------------------

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
                // registration cannot miss a release (see module docs).
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
                self.hot.word.fetch_and(!WAITERS, SeqCst);
            }
        }
        for waiter in woken {
            waiter.wake();
        }
    }

    /// Wakes every thread or task waiting for the source to drain (each
    /// looks again and waits again if it has to).
    #[cold]
    fn wake_drainers(&self) {
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

    // ----- positions -------------------------------------------------------

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

    // ----- stops -------------------------------------------------------------

    /// Refuses new messages from now on, and sends the submitters waiting
    /// for a unit away with their messages.
    pub(crate) fn close(&self) {
        self.fixed.flags.fetch_or(CLOSED, SeqCst);
        self.release_waiters();
    }

    /// Closes the source and makes workers hand its messages back instead
    /// of starting them. The caller counted itself in `stoppers` first.
    pub(crate) fn stop(&self) {
        self.fixed.flags.fetch_or(CLOSED | STOPPED, SeqCst);
        self.release_waiters();
    }

    /// A stop set a flag that refuses this source's messages (its own, its
    /// dispatcher's or the executor's): wakes every submitter waiting for
    /// a unit or for the commit span, who looks at the flags and leaves
    /// with `Closed(its message)` (see [`Acquire`]). The caller keeps the
    /// source alive.
    pub(crate) fn release_waiters(&self) {
        fence(SeqCst);
        if self.has_waiters() {
            self.wake_all_waiters();
        }
    }

    /// Whether a submitter is registered as a waiter. Read by a stop after
    /// its flag and a SeqCst fence (see [`Acquire`]).
    #[inline]
    pub(crate) fn has_waiters(&self) -> bool {
        self.hot.word.load(Relaxed) & WAITERS != 0
    }

    /// Wakes every submitter waiting for a unit (a stop: see
    /// [`release_waiters`](Self::release_waiters)).
    #[cold]
    pub(crate) fn wake_all_waiters(&self) {
        self.notify(u64::MAX);
    }

    #[inline]
    pub(crate) fn is_closed(&self) -> bool {
        self.fixed.flags.load(SeqCst) & CLOSED != 0
    }

    /// SeqCst: a runner suspending a future reads it after its own state
    /// change, against a stopper that sets it before scanning the states.
    #[inline]
    pub(crate) fn is_stopped(&self) -> bool {
        self.fixed.flags.load(SeqCst) & STOPPED != 0
    }

    /// A thread starts waiting in `shutdown_now` (before [`stop`]).
    ///
    /// [`stop`]: Self::stop
    pub(crate) fn stopper_enter(&self) {
        self.stoppers.fetch_add(1, SeqCst);
    }

    /// A thread is done waiting in `shutdown_now`; runs what was handed
    /// over since.
    pub(crate) fn stopper_leave(&self) {
        let left = {
            let mut list = self.handover.lock();
            self.stoppers.fetch_sub(1, SeqCst);
            std::mem::take(&mut *list)
        };
        for reject in left {
            reject();
        }
        self.run_handovers();
    }

    /// A worker met a message of a stopped source: `reject` hands it back.
    /// If a thread waits in `shutdown_now`, it runs `reject` (on its
    /// thread, as the stop hands back the rest); otherwise `reject` runs
    /// here. (`stoppers` is read under the list's lock, which the last
    /// stopper to leave takes to empty the list: nothing is left behind.)
    pub(crate) fn hand_over(&self, reject: Handover) {
        {
            let mut list = self.handover.lock();
            if self.stoppers.load(SeqCst) != 0 {
                list.push(reject);
                drop(list);
                // The message still holds its unit; wake the stopper
                // waiting for the source to drain.
                self.wake_drainers();
                return;
            }
        }
        reject();
    }

    /// Runs the rejections workers handed over (the stopping thread).
    pub(crate) fn run_handovers(&self) {
        loop {
            let batch = std::mem::take(&mut *self.handover.lock());
            if batch.is_empty() {
                return;
            }
            for reject in batch {
                reject();
            }
        }
    }
}

/// A unit of credit shared by a message and the follow-ups it passed it
/// on to (see `receiver.rs`, "Sending from a handler"): given back when
/// the last of them ends. Allocated when a running message first passes
/// its unit on; freed by the last holder.
pub(crate) struct SharedUnit {
    unit: SourceRef,
    holders: AtomicUsize,
}

/// The unit of credit a message holds: one of its own (or another
/// message's, handed over whole), or a share of one. One word, so that a
/// message's envelope stays small: the pointer to the source (`Plain`) or
/// to the share (`Shared`, marked by its lowest bit; both are aligned to
/// at least 8 bytes). See [`kind`](Self::kind).
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

/// A source kept alive by a handle count (taken with
/// [`SourceRef::try_pin`]), dropped on drop.
pub(crate) struct PinnedSource(SourceRef);

impl PinnedSource {
    /// Pins `source` unless it is being freed.
    pub(crate) fn new(source: SourceRef) -> Option<Self> {
        source.try_pin().then_some(PinnedSource(source))
    }
}

impl std::ops::Deref for PinnedSource {
    type Target = Source;

    fn deref(&self) -> &Source {
        self.0.get()
    }
}

impl Drop for PinnedSource {
    fn drop(&mut self) {
        // SAFETY: we own the pin `new` took.
        unsafe { self.0.unpin() }
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
        if !source.wait_drained(&|slot| {
            if !matches!(slot, Some(Waiter::Thread(_))) {
                *slot = Some(Waiter::current_thread());
            }
        }) {
            crate::sync::thread::park_timeout(left.min(DRAIN_RECHECK));
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
/// polls. Dropping it deregisters (or passes on a notification it received).
/// The submitter holds a handle for as long as this lives.
///
/// Against a stop it is the Dekker hand-shake it is against a release,
/// with fences: a stop sets its flag, fences (SeqCst) and reads `WAITERS`,
/// and if it is set wakes every waiter, popping them under the list's lock
/// ([`Source::release_waiters`]); a waiter registers (sets `WAITERS`),
/// fences and looks at the flags. Either the stop sees `WAITERS` and wakes
/// it, or the waiter sees the flag. `WAITERS` is cleared only when the
/// list is empty, so a waiter still registered keeps it set; one popped
/// was woken. A waiter that renews its registration needs no second look:
/// it finds itself still in the list, so the wake of a stop that saw its
/// first registration is still to come.
pub(crate) struct Acquire<'a> {
    source: &'a Source,
    id: Option<u64>,
    /// Called once before each registration as a waiter (the receiver
    /// passes a function that gives back the units this thread's worker
    /// holds back, since those may be the ones it waits for).
    before_wait: fn(),
}

impl<'a> Acquire<'a> {
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
    /// else, and again after a new registration (see the type's docs).
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
                    // After the registration (see the type's docs).
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
    use super::*;
    use crate::sync::thread;

    fn thread_waiter(slot: &mut Option<Waiter>) {
        if !matches!(slot, Some(Waiter::Thread(_))) {
            *slot = Some(Waiter::current_thread());
        }
    }

    fn source(max: usize, span: usize) -> SourceHandle {
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
    fn blocked_acquirer_is_woken_by_release() {
        let h = source(1, 1024);
        assert!(h.source().try_acquire());
        let h2 = h.clone();
        let t = std::thread::spawn(move || {
            let mut a = Acquire::new(h2.source(), || {});
            while !matches!(a.poll(&thread_waiter, &|| false), Acquired::Unit) {
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
            a.poll(&thread_waiter, &|| false),
            Acquired::Waiting
        ));
        assert!(matches!(
            b.poll(&thread_waiter, &|| false),
            Acquired::Waiting
        ));
        // SAFETY: one unit is held.
        unsafe { h.as_ref().release(1) }; // pops `a`
        drop(a); // never retried: must hand the wake to `b`
        assert!(c.waiters.lock().queue.is_empty(), "b was popped too");
        assert!(matches!(b.poll(&thread_waiter, &|| false), Acquired::Unit));
        // SAFETY: `b` took the one unit.
        unsafe { h.as_ref().release(1) };
    }

    #[test]
    fn close_wakes_a_blocked_acquirer_which_leaves_closed_without_a_unit() {
        let h = source(1, 1024);
        assert!(h.source().try_acquire());
        let h2 = h.clone();
        let t = std::thread::spawn(move || {
            let s = h2.source();
            let mut a = Acquire::new(s, || {});
            loop {
                match a.poll(&thread_waiter, &|| s.is_closed()) {
                    Acquired::Waiting => thread::park(),
                    got => return matches!(got, Acquired::Closed),
                }
            }
        });
        while h.source().hot.word.load(SeqCst) & WAITERS == 0 {
            std::thread::yield_now();
        }
        h.source().close();
        assert!(t.join().unwrap(), "left closed, not with a unit");
        assert_eq!(h.source().in_flight(), 1, "the held unit is untouched");
        assert!(h.source().waiters.lock().queue.is_empty());
        assert_eq!(h.source().hot.word.load(SeqCst) & WAITERS, 0);
        // SAFETY: one unit is held.
        unsafe { h.as_ref().release(1) };
    }

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
            me.pin();
            s.share_held();
            let (m, f) = UnitRef::plain(me).share();
            // F, accepted holding the share.
            me.pin();
            s.share_held();
            assert!(!s.is_drained());
            // M ends first: F still runs.
            assert!(m.leave().is_none());
            s.share_ended();
            me.unpin();
            assert!(!s.is_drained(), "the follow-up still runs");
            // F ends: the last holder gives the unit back.
            let unit = f.leave().expect("last holder");
            assert!(!s.is_drained(), "the unit is not back yet");
            unit.release(1);
            s.share_ended();
            me.unpin();
        }
        assert!(s.is_drained());
        assert_eq!(s.in_flight(), 0);
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
}
