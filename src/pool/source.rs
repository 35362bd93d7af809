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
//! # Positions and the commit point
//!
//! Each accepted message takes the next *position* (`next`, one
//! `fetch_add` by its submitter). When it ends, whoever ended it records a
//! one-byte *tag* in the source's window: one row per worker (so that
//! workers never write each other's cache lines) and one for the other
//! threads (stops handing messages back), a slot per position modulo the
//! window's size. A tag says finished (done or panicked: committable) or
//! returned (handed back or cancelled: resolved, but never passed by the
//! commit point, since it will be delivered again).
//!
//! The commit point and the resolved point are advanced lazily, under a
//! lock, by whoever asks (`committable()`, a drain check, a submitter at the
//! cap): from where they stand, they pass each position whose tag some row
//! holds. The commit point clears the slots it passes before it publishes
//! its new value, and a recorder writes into the window only if its
//! position is less than one window ahead of the commit point it reads
//! (else into an overflow map, ordered by position): so a slot holds a tag
//! of its own lap or none, and no stale tag can be taken for a current one.
//!
//! The span of positions between the commit point and `next` is capped
//! (`span`): a submitter finding it full advances the commit point and, if
//! it is still full, waits as it waits for credit (a message that ends
//! releases a unit, or pokes, and wakes it). The window has room for a
//! span of at most `WINDOW_SPAN_FACTOR` × the credit (at least
//! `MIN_WINDOW_SPAN`) plus one message per unit of credit (submitters
//! that passed the cap check together): a larger cap lets a slow message
//! hold the commit point longer without stopping its source, and what
//! ends beyond the window meanwhile goes to the overflow map (a lock per
//! message while the commit point is held that far back; the window alone
//! otherwise). Follow-ups that inherit another message's unit (see
//! `receiver.rs`) are not held by the cap — a handler never waits — and
//! may overflow too; they are bounded by the credit they hold.
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

use std::collections::{BTreeMap, VecDeque};
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

/// The window holds a span of at most this many times the credit (see the
/// module docs); positions further ahead of the commit point overflow.
const WINDOW_SPAN_FACTOR: u64 = 4;

/// The least span the window holds (when the commit span is at least this).
#[cfg(not(loom))]
const MIN_WINDOW_SPAN: u64 = 4096;
/// Under loom each slot is a modelled atomic.
#[cfg(loom)]
const MIN_WINDOW_SPAN: u64 = 4;

const CLOSED: u8 = 1;
const STOPPED: u8 = 2;

/// Tags: nothing recorded (or cleared), finished, returned.
const EMPTY: u8 = 0;
const FINISHED: u8 = 1;
const RETURNED: u8 = 2;

/// What ended a message, for its tag.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Ended {
    /// Done or panicked: the commit point may pass it.
    Finished,
    /// Handed back or cancelled: it will be delivered again; the commit
    /// point stops before it.
    Returned,
}

/// A rejection a worker leaves for the thread stopping the source.
pub(crate) type Handover = Box<dyn FnOnce() + Send>;

/// The words submitters touch on every message.
struct Hot {
    word: AtomicU64,
    /// The next position.
    next: AtomicU64,
}

/// The lazily advanced points (see the module docs).
struct Points {
    /// Leading positions all finished (done or panicked).
    committed: AtomicU64,
    /// Leading positions all ended (committable or returned).
    resolved: AtomicU64,
    /// Serialises advancing.
    lock: Mutex<()>,
    /// While the commit point is held past the window (`advance_at`), the
    /// next `next` at which a submitter advances it again: one advance per
    /// [`RETRY_EVERY`] positions, not one per message.
    retry_at: AtomicU64,
}

/// See [`Points::retry_at`].
const RETRY_EVERY: u64 = 64;

pub(crate) struct Source {
    hot: CachePadded<Hot>,
    /// Read-only after creation, or rarely written (`flags`), on a line of
    /// their own that every core shares.
    max: u64,
    /// How many released units a worker may hold back before returning them.
    batch: u64,
    /// The commit span's cap.
    span: u64,
    /// How far `next` may run ahead of the commit point before a submitter
    /// advances it: the cap, or less if the window is shorter (so that
    /// ends are recorded in the window, not the overflow map, while the
    /// commit point can follow).
    advance_at: u64,
    flags: AtomicU8,
    /// Threads in `shutdown_now` waiting for the source to drain.
    stoppers: AtomicUsize,
    /// The id of the dispatcher the source feeds.
    dispatcher: u64,
    points: CachePadded<Points>,
    /// `rows` rows of `1 << shift` tags (see the module docs).
    window: Box<[AtomicU8]>,
    shift: u32,
    rows: usize,
    /// Tags of positions too far ahead of the commit point for the window
    /// (a slow message held it back; or follow-ups that inherited another
    /// message's unit, not held by the span cap); `overflowed` counts them,
    /// so lookups skip the lock while it is empty.
    overflow: Mutex<BTreeMap<u64, Ended>>,
    overflowed: AtomicUsize,
    waiters: Mutex<Waiters>,
    drainers: Mutex<Vec<Waiter>>,
    handover: Mutex<Vec<Handover>>,
    /// The executor: it counts this source in its list (a graceful stop
    /// waits until no source has a unit out), and is woken when the last
    /// unit comes back during a stop. `None` in unit tests.
    shared: Option<Arc<Shared>>,
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
    /// Rows of the window: one per worker, plus one.
    pub(crate) rows: usize,
    pub(crate) dispatcher: u64,
}

impl SourceHandle {
    /// A new source, with this one handle, counted in `shared`'s sources.
    pub(crate) fn new(settings: Settings, shared: Option<Arc<Shared>>) -> Self {
        let max = settings.max_in_flight.min(MAX_CREDIT) as u64;
        let span = (settings.span.min(MAX_SPAN) as u64).max(max);
        // Room for the span (up to the window's share of it) and a unit's
        // worth of overshoot per unit of credit (submitters that passed the
        // cap check together).
        let windowed = span.min((max * WINDOW_SPAN_FACTOR).max(MIN_WINDOW_SPAN));
        let size = (windowed + max).next_power_of_two();
        let rows = settings.rows.max(1);
        let source = Box::new(Source {
            hot: CachePadded::new(Hot {
                word: AtomicU64::new(HANDLE),
                next: AtomicU64::new(0),
            }),
            max,
            // Hold back at most 1/16 of the window (and never more than 16),
            // so batching never starves a small receiver.
            batch: (max / 16).clamp(1, 16),
            span,
            advance_at: span.min(size - max),
            flags: AtomicU8::new(0),
            stoppers: AtomicUsize::new(0),
            dispatcher: settings.dispatcher,
            points: CachePadded::new(Points {
                committed: AtomicU64::new(0),
                resolved: AtomicU64::new(0),
                lock: Mutex::new(()),
                retry_at: AtomicU64::new(0),
            }),
            window: (0..size as usize * rows)
                .map(|_| AtomicU8::new(EMPTY))
                .collect(),
            shift: size.trailing_zeros(),
            rows,
            overflow: Mutex::new(BTreeMap::new()),
            overflowed: AtomicUsize::new(0),
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
        self.get().batch
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
        self.max as usize
    }

    pub(crate) fn span(&self) -> u64 {
        self.span
    }

    pub(crate) fn dispatcher(&self) -> u64 {
        self.dispatcher
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
            if cur & IN_FLIGHT_MASK >= self.max {
                // Re-read with SeqCst so a failing acquire that is followed by
                // registration cannot miss a release (see module docs).
                cur = word.load(SeqCst);
                if cur & IN_FLIGHT_MASK >= self.max {
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
        // Room in the span (a stale `next` errs on the small side).
        let room = self.span.saturating_sub(
            self.hot
                .next
                .load(Relaxed)
                .saturating_sub(self.points.committed.load(Relaxed)),
        );
        let want = n.min(room.max(1));
        let word = &self.hot.word;
        let mut cur = cas_guess(word);
        loop {
            let mut free = self.max.saturating_sub(cur & IN_FLIGHT_MASK);
            if free == 0 {
                // As in `try_acquire`: a failing acquire reads with SeqCst.
                cur = word.load(SeqCst);
                free = self.max.saturating_sub(cur & IN_FLIGHT_MASK);
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
    /// cap (after advancing the commit point, if it seemed to).
    #[inline]
    fn span_full(&self) -> bool {
        // `next` may be read stale, behind a commit point that another
        // thread moved since: the difference saturates (an old `next` only
        // makes the span look smaller, and the position taken later is
        // checked against the window again when it is recorded).
        let next = self.hot.next.load(Relaxed);
        let lag = next.saturating_sub(self.points.committed.load(Relaxed));
        if lag < self.advance_at {
            return false;
        }
        // Past the window but below the cap: advance now and then only (a
        // held commit point stays held; what ends meanwhile overflows).
        if lag < self.span && next < self.points.retry_at.load(Relaxed) {
            return false;
        }
        self.advance();
        let lag = next.saturating_sub(self.points.committed.load(Acquire));
        if lag >= self.advance_at {
            self.points
                .retry_at
                .store(next.saturating_add(RETRY_EVERY), Relaxed);
        }
        lag >= self.span
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
        self.hot.next.fetch_add(1, Relaxed)
    }

    /// Takes `n` consecutive positions (a batch); returns the first.
    pub(crate) fn take_positions(&self, n: u64) -> u64 {
        self.hot.next.fetch_add(n, Relaxed)
    }

    /// Positions taken so far.
    pub(crate) fn positions(&self) -> u64 {
        self.hot.next.load(Acquire)
    }

    /// Records how the message at `position` ended, in row `row` (a worker's
    /// index, or [`other_row`](Self::other_row)).
    ///
    /// The slot of `position` in the window is free once the commit point
    /// passed the position one window-length before it. A stale read of the
    /// commit point is lower than the real one, so the test errs on the
    /// safe side; a position that does not fit goes to the overflow map.
    #[inline]
    pub(crate) fn record(&self, row: usize, position: u64, ended: Ended) {
        let size = 1u64 << self.shift;
        if position.wrapping_sub(self.points.committed.load(Acquire)) >= size {
            return self.record_overflow(position, ended);
        }
        let at = (row << self.shift) + (position & (size - 1)) as usize;
        let t = match ended {
            Ended::Finished => FINISHED,
            Ended::Returned => RETURNED,
        };
        self.window[at].store(t, Release);
    }

    #[cold]
    fn record_overflow(&self, position: u64, ended: Ended) {
        let mut map = self.overflow.lock();
        map.insert(position, ended);
        self.overflowed.store(map.len(), SeqCst);
    }

    /// The row for threads that are not workers (a stop handing back).
    pub(crate) fn other_row(&self) -> usize {
        self.rows - 1
    }

    /// How the message at `position` ended, if some row says. Only for
    /// positions at or past the commit point, whose slots hold their own
    /// tag or none (see [`advance`](Self::advance)).
    fn ended(&self, position: u64) -> Option<Ended> {
        self.ended_at(position).map(|(ended, _)| ended)
    }

    /// As [`ended`](Self::ended), with the index of the window slot that
    /// holds the tag (`None` if the overflow map does). A position's tag is
    /// written once, in one row, so that slot is the only one of the
    /// position's that is not clear.
    #[inline]
    fn ended_at(&self, position: u64) -> Option<(Ended, Option<usize>)> {
        let mask = (1u64 << self.shift) - 1;
        let at = (position & mask) as usize;
        for row in 0..self.rows {
            let i = (row << self.shift) + at;
            match self.window[i].load(Acquire) {
                FINISHED => return Some((Ended::Finished, Some(i))),
                RETURNED => return Some((Ended::Returned, Some(i))),
                _ => {}
            }
        }
        if self.overflowed.load(SeqCst) == 0 {
            return None;
        }
        self.overflow.lock().get(&position).map(|&e| (e, None))
    }

    /// Advances the commit point and the resolved point as far as the
    /// recorded tags allow. Returns (committed, resolved).
    ///
    /// The commit point clears the slots of each position it passes before
    /// it publishes its new value (a release store), so a recorder that
    /// read it (acquire) and writes one lap ahead writes a clear slot: a
    /// slot never holds a tag of another lap than its position's.
    pub(crate) fn advance(&self) -> (u64, u64) {
        let _guard = self.points.lock.lock();
        let next = self.hot.next.load(Acquire);
        let mut committed = self.points.committed.load(Relaxed);
        // Whether the commit point stands at a returned message (for good).
        let mut at_returned = false;
        while committed < next {
            let slot = match self.ended_at(committed) {
                Some((Ended::Finished, slot)) => slot,
                Some((Ended::Returned, _)) => {
                    at_returned = true;
                    break;
                }
                None => break,
            };
            // The position's one tag: its other rows are clear already (a
            // recorder one lap ahead writes only once the commit point
            // passed this position, which it reads after this store).
            if let Some(i) = slot {
                self.window[i].store(EMPTY, Relaxed);
            }
            committed += 1;
        }
        // The resolved point also passes returned messages; the commit
        // point stops at the first one, for good.
        let mut resolved = self.points.resolved.load(Relaxed).max(committed);
        while resolved < next && self.ended(resolved).is_some() {
            resolved += 1;
        }
        self.points.committed.store(committed, Release);
        self.points.resolved.store(resolved, Release);
        if self.overflowed.load(SeqCst) != 0 {
            // Positions behind the commit point are never looked at again,
            // nor, once it stopped for good at a returned message, those
            // behind the resolved point. Not those between the two
            // otherwise: the resolved walk may pass a tag recorded just
            // after the commit walk looked for it, and the commit point
            // reads it next time (dropping it here stalled the commit point
            // for good, and with it the source at its span).
            let keep_from = if at_returned { resolved } else { committed };
            let mut map = self.overflow.lock();
            *map = map.split_off(&keep_from);
            self.overflowed.store(map.len(), SeqCst);
        }
        (committed, resolved)
    }

    /// Leading positions whose messages all finished (done or panicked).
    pub(crate) fn committable(&self) -> u64 {
        self.advance().0
    }

    /// Whether every message accepted so far has ended (finished, handed
    /// back or cancelled).
    pub(crate) fn is_drained(&self) -> bool {
        let (_, resolved) = self.advance();
        resolved >= self.hot.next.load(Acquire)
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
        self.flags.fetch_or(CLOSED, SeqCst);
        self.release_waiters();
    }

    /// Closes the source and makes workers hand its messages back instead
    /// of starting them. The caller counted itself in `stoppers` first.
    pub(crate) fn stop(&self) {
        self.flags.fetch_or(CLOSED | STOPPED, SeqCst);
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
        self.flags.load(SeqCst) & CLOSED != 0
    }

    /// SeqCst: a runner suspending a future reads it after its own state
    /// change, against a stopper that sets it before scanning the states.
    #[inline]
    pub(crate) fn is_stopped(&self) -> bool {
        self.flags.load(SeqCst) & STOPPED != 0
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
                rows: 3,
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
    fn the_window_serves_lap_after_lap_with_tags_in_any_row() {
        // A window of 32 slots a row (span 16 + credit 8, rounded up), 3
        // rows; 1,000 positions: about 30 laps.
        let h = source(8, 16);
        let s = h.source();
        let mut done = vec![false; 1000];
        let mut next = 0u64;
        let mut rng = 0x9E37_79B9_7F4A_7C15u64;
        while next < 1000 {
            // Up to the credit's 8 in flight, ended in a scrambled order,
            // each in a row of its own choosing.
            let chunk: Vec<u64> = (0..8.min(1000 - next)).map(|_| s.take_position()).collect();
            next += chunk.len() as u64;
            let mut order = chunk.clone();
            for i in (1..order.len()).rev() {
                rng ^= rng << 13;
                rng ^= rng >> 7;
                rng ^= rng << 17;
                order.swap(i, (rng % (i as u64 + 1)) as usize);
            }
            for p in order {
                s.record((p % 3) as usize, p, Ended::Finished);
                done[p as usize] = true;
                let leading = done.iter().take_while(|d| **d).count() as u64;
                assert_eq!(s.committable(), leading, "after position {p}");
            }
        }
        assert_eq!(s.committable(), 1000);
        assert!(s.is_drained());
    }

    #[test]
    fn the_commit_point_passes_finished_positions_in_order_and_stops_at_a_returned_one() {
        let h = source(8, 16);
        let s = h.source();
        let p: Vec<u64> = (0..6).map(|_| s.take_position()).collect();
        assert_eq!(p, [0, 1, 2, 3, 4, 5]);
        // Out of order, on different rows (workers).
        s.record(1, 2, Ended::Finished);
        s.record(0, 1, Ended::Finished);
        assert_eq!(s.committable(), 0, "position 0 is still running");
        s.record(0, 0, Ended::Finished);
        assert_eq!(s.committable(), 3);
        assert!(!s.is_drained());
        s.record(2, 3, Ended::Returned);
        s.record(1, 4, Ended::Finished);
        s.record(0, 5, Ended::Finished);
        assert_eq!(s.committable(), 3, "never past a handed-back message");
        assert!(s.is_drained(), "every message ended");
    }

    #[test]
    #[cfg_attr(
        miri,
        ignore = "tens of thousands of positions; no unsafe code on this path"
    )]
    fn a_span_beyond_the_window_overflows_and_the_commit_point_still_follows() {
        // Credit 8, span 20,000: the window holds 4,096 + 8 positions (8,192
        // slots a row); while position 0 runs, those past the window go to
        // the overflow map, in every row, in any order.
        let h = source(8, 20_000);
        let s = h.source();
        assert_eq!(
            1u64 << s.shift,
            8192,
            "the window does not grow with the span"
        );
        let n = 20_000u64;
        let all: Vec<u64> = (0..n).map(|_| s.take_position()).collect();
        assert_eq!(all.last(), Some(&(n - 1)));
        // Backwards, so most tags land ahead of the window first.
        for p in (1..n).rev() {
            s.record((p % 3) as usize, p, Ended::Finished);
        }
        assert!(
            s.overflowed.load(SeqCst) > 0,
            "positions past the window overflowed"
        );
        assert_eq!(s.committable(), 0, "position 0 still runs");
        assert!(!s.try_acquire(), "credit is free, but the span is full");
        s.record(1, 0, Ended::Finished);
        assert_eq!(s.committable(), n);
        assert!(s.try_acquire(), "the commit point moved on");
        // SAFETY: we hold the unit just taken.
        unsafe { h.as_ref().release(1) };
        assert_eq!(
            s.overflowed.load(SeqCst),
            0,
            "the map empties behind the point"
        );
        assert!(s.is_drained());
        // The window serves the next lap.
        let p = s.take_position();
        s.record(0, p, Ended::Finished);
        assert_eq!(s.committable(), n + 1);
    }

    #[test]
    #[cfg_attr(
        miri,
        ignore = "800,000 recorded tags across threads; no unsafe code on this path"
    )]
    fn overflowed_tags_survive_advances_racing_their_recorders() {
        // Two recorders end positions (most past the window while position
        // 0 is held) while this thread advances the points: a tag the
        // resolved walk passes just after the commit walk looked for it
        // must still be there for the commit point's next walk.
        for round in 0..20 {
            let h = source(8, 1 << 20);
            let s = h.source();
            let n = 40_000u64;
            for _ in 0..n {
                s.take_position();
            }
            let done = std::sync::atomic::AtomicBool::new(false);
            std::thread::scope(|t| {
                let recorders: Vec<_> = (0..2u64)
                    .map(|r| {
                        let s = &s;
                        t.spawn(move || {
                            for p in (1..n).filter(|p| p % 2 == r) {
                                s.record(r as usize, p, Ended::Finished);
                            }
                        })
                    })
                    .collect();
                t.spawn(|| {
                    while !done.load(SeqCst) {
                        s.advance();
                    }
                });
                std::thread::sleep(std::time::Duration::from_millis(2));
                s.record(2, 0, Ended::Finished);
                for r in recorders {
                    r.join().unwrap();
                }
                done.store(true, SeqCst);
            });
            // Every position ended: the commit point reaches the end.
            for _ in 0..3 {
                s.advance();
            }
            assert_eq!(s.committable(), n, "round {round}");
        }
    }

    #[test]
    #[cfg_attr(
        miri,
        ignore = "tens of thousands of positions; no unsafe code on this path"
    )]
    fn with_nothing_held_a_span_beyond_the_window_never_overflows() {
        // The commit point is advanced lazily, by submitters: they must do
        // it when the window, not only the cap, runs out.
        let h = source(8, 20_000);
        let s = h.source();
        // Past the window's advance point (8,184) several times.
        let n = 50_000;
        for i in 0..n {
            assert!(s.try_acquire(), "message {i}");
            let p = s.take_position();
            s.record((p % 2) as usize, p, Ended::Finished);
            // SAFETY: we hold the unit just taken.
            unsafe { h.as_ref().release(1) };
            assert_eq!(s.overflowed.load(SeqCst), 0, "position {p} overflowed");
        }
        assert_eq!(s.committable(), n);
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
            s.record(0, p, Ended::Finished);
        }
        // SAFETY: four units are held.
        unsafe { h.as_ref().release(3) };
        assert_eq!(s.in_flight(), 1);
        assert!(!s.try_acquire(), "credit is free, but the span is full");
        s.record(1, 0, Ended::Finished);
        assert!(s.try_acquire(), "the commit point moved on");
        assert_eq!(s.committable(), 4);
        // SAFETY: two units are held.
        unsafe { h.as_ref().release(2) };
    }
}
