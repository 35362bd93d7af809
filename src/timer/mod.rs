//! Wake-ups at deadlines, for futures that have a timeout but no runtime to
//! keep it. Two services:
//!
//! - [`Timer`]: one wake-up on a thread of its own, for the crate's two rare
//!   waits with a timeout (`Receiver::shutdown_async`, `Lanes::close`).
//! - [`Timers`]: many wake-ups on one thread, for waits that come by the
//!   thousand (a message's backoff before its next attempt), and
//!   [`Sleep`], a future over one of them.
//!
//! # `Timer`
//!
//! A small thread sleeps until the deadline (by a clock the caller gives),
//! wakes the registered waker and exits. Re-arming moves the deadline and
//! the waker; dropping the `Timer` cancels it, and the thread exits at
//! once. State machine (under `state`'s lock): armed (a waker and a
//! deadline) → fired (the thread took the waker and woke it) or cancelled
//! (the owner dropped the timer); the thread exits in either. Re-arming a
//! fired timer is not possible: the owner starts a new one.
//!
//! # `Timers`
//!
//! One mutex holds a binary min-heap of *entries* (deadline, waker),
//! ordered by deadline and then by insertion, and a table of *slots* that
//! says where each entry sits in the heap, so that an entry is found from
//! its [`TimerKey`] (slot, id) in O(1) and removed or moved in O(log n).
//! An entry is *pending* from `insert` until it *fires* (the thread takes
//! it out and wakes its waker) or is *cancelled* (`cancel` takes it out and
//! drops its waker); either way its slot is freed at once, and ids are
//! never reused, so a stale key finds nothing (`cancel` says `false`,
//! `reset` says `false`: insert again).
//!
//! The thread starts on the first `insert` and loops under the lock: take
//! out the entries due by its clock (at most [`FIRE_BATCH`] a round), wake
//! them with the lock released, and when none is due wait on the condvar
//! until the earliest deadline (or until notified, with none pending).
//!
//! No lost wake-up: the thread reads the heap and begins its wait under
//! the lock (the wait releases it atomically), and every insert or re-arm
//! that makes its entry the heap's earliest notifies the condvar after
//! changing the heap under that lock. So a new earliest deadline is either
//! seen by the thread before it waits, or wakes it from the wait; one that
//! is not the earliest is due no sooner than the deadline the thread
//! already waits for, after which it looks again.
//!
//! A cancel racing the firing is harmless: whoever takes the entry out
//! under the lock owns its waker; the other finds nothing. A waker taken by
//! the thread may be woken just after a `cancel` that came too late (which
//! said `false`); wakers are owned values, so nothing is freed under
//! anyone. Wakers are woken and dropped outside the lock, in
//! `catch_unwind` on the thread, so a waker may call back into the
//! `Timers`, and one that panics does not stop the others.
//!
//! Dropping the `Timers` closes it: the thread exits (joined, unless the
//! drop runs on the thread itself, from a waker), and what is still
//! pending is woken, so no [`Sleep`] waits for a service that is gone.
//! Memory follows the pending entries: when the heap empties, the slot
//! table is cleared and every buffer shrinks back to [`KEEP`] entries; in
//! between, the heap's buffer halves whenever it is three-quarters empty.
//!
//! Under loom, a timed wait is an untimed one (the shim's `Condvar`), so a
//! model's thread sleeps until notified: a missing notify shows up as a
//! deadlock. The models (`loom-tests/tests/timers.rs`) use deadlines
//! already passed (due) or an hour away (never due).

use std::fmt;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use crate::sync::thread;
use crate::sync::{Arc, Condvar, Mutex};

/// The clock a timer reads (the caller's: `Instant::now`, or an injected
/// one in tests).
pub(crate) type Clock = Box<dyn Fn() -> Instant + Send + Sync>;

struct State {
    cancelled: bool,
    fired: bool,
    deadline: Instant,
    waker: Option<Waker>,
}

struct Inner {
    state: Mutex<State>,
    cond: Condvar,
}

/// See the module docs.
pub(crate) struct Timer {
    inner: Arc<Inner>,
}

impl Timer {
    /// Wakes `waker` at `deadline` (by `Instant::now`).
    pub(crate) fn start(deadline: Instant, waker: Waker) -> Result<Timer, String> {
        Self::start_with(deadline, waker, Box::new(Instant::now), "keyed-timer")
    }

    /// Wakes `waker` at `deadline` by `clock`, from a thread named `name`.
    pub(crate) fn start_with(
        deadline: Instant,
        waker: Waker,
        clock: Clock,
        name: &str,
    ) -> Result<Timer, String> {
        let inner = Arc::new(Inner {
            state: Mutex::new(State {
                cancelled: false,
                fired: false,
                deadline,
                waker: Some(waker),
            }),
            cond: Condvar::new(),
        });
        let theirs = Arc::clone(&inner);
        thread::Builder::new()
            .name(name.to_owned())
            .spawn(move || {
                let mut state = theirs.state.lock();
                loop {
                    if state.cancelled {
                        return;
                    }
                    // The clock may be user code: read it outside the lock.
                    drop(state);
                    let now = clock();
                    state = theirs.state.lock();
                    if state.cancelled {
                        return;
                    }
                    if now >= state.deadline {
                        state.fired = true;
                        let waker = state.waker.take();
                        drop(state);
                        if let Some(w) = waker {
                            w.wake();
                        }
                        return;
                    }
                    let wait = state.deadline - now;
                    state = theirs.cond.wait_timeout(state, wait).0;
                }
            })
            .map_err(|e| e.to_string())?;
        Ok(Timer { inner })
    }

    /// Keeps `waker` (if it would wake another task) for the same deadline.
    pub(crate) fn set_waker(&self, waker: &Waker) {
        let mut state = self.inner.state.lock();
        match &state.waker {
            Some(w) if w.will_wake(waker) => {}
            _ if state.fired => {}
            _ => state.waker = Some(waker.clone()),
        }
    }

    /// Moves the deadline to `deadline` and keeps `waker`. A timer that
    /// already fired stays fired (the caller is being woken anyway).
    pub(crate) fn rearm(&mut self, deadline: Instant, waker: &Waker) {
        {
            let mut state = self.inner.state.lock();
            if state.fired {
                drop(state);
                if let Ok(t) = Timer::start(deadline, waker.clone()) {
                    *self = t;
                }
                return;
            }
            state.deadline = deadline;
            match &state.waker {
                Some(w) if w.will_wake(waker) => {}
                _ => state.waker = Some(waker.clone()),
            }
        }
        self.inner.cond.notify_all();
    }
}

impl Drop for Timer {
    fn drop(&mut self) {
        let waker = {
            let mut state = self.inner.state.lock();
            state.cancelled = true;
            state.waker.take()
        };
        self.inner.cond.notify_all();
        drop(waker);
    }
}

impl fmt::Debug for Timer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Timer").finish_non_exhaustive()
    }
}

// ----- Timers ----------------------------------------------------------------

/// Entries whose buffers the heap keeps when it empties (about 2 KiB in
/// all), so a trickle of single entries does not allocate each time.
const KEEP: usize = 32;

/// The most entries the thread takes out under one hold of the lock: an
/// insert waits behind at most this many removals, and the thread's own
/// buffer of wakers never grows past it.
const FIRE_BATCH: usize = 64;

/// The thread's name when none is given.
const DEFAULT_TIMERS_NAME: &str = "keyed-timer";

/// Names a pending entry of a [`Timers`]: `slot` says where to look, `id`
/// (never reused) says whether what is there is still this entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[must_use = "an entry is cancelled or re-armed through its key"]
#[allow(unreachable_pub)]
pub struct TimerKey {
    slot: usize,
    id: u64,
}

/// A pending entry, in the heap.
struct Entry {
    deadline: Instant,
    id: u64,
    slot: usize,
    waker: Waker,
}

/// Where a slot's entry is: `id` 0 marks a free slot.
#[derive(Clone, Copy)]
struct Slot {
    id: u64,
    pos: usize,
}

/// A binary min-heap of entries by (deadline, id), with a slot table that
/// finds an entry from its key. Every move of an entry in `entries`
/// updates its slot's `pos`.
struct Heap {
    entries: Vec<Entry>,
    slots: Vec<Slot>,
    /// Free slots, reused before the table grows.
    free: Vec<usize>,
    next_id: u64,
}

impl Heap {
    fn new() -> Heap {
        Heap {
            entries: Vec::new(),
            slots: Vec::new(),
            free: Vec::new(),
            next_id: 1,
        }
    }

    fn len(&self) -> usize {
        self.entries.len()
    }

    /// The largest buffer, in elements (tests check it shrinks).
    fn capacity(&self) -> usize {
        self.entries
            .capacity()
            .max(self.slots.capacity())
            .max(self.free.capacity())
    }

    fn earliest(&self) -> Option<Instant> {
        self.entries.first().map(|e| e.deadline)
    }

    /// Adds an entry; the flag says whether it is now the earliest.
    fn push(&mut self, deadline: Instant, waker: Waker) -> (TimerKey, bool) {
        let id = self.next_id;
        self.next_id += 1;
        let pos = self.entries.len();
        let slot = match self.free.pop() {
            Some(slot) => {
                self.slots[slot] = Slot { id, pos };
                slot
            }
            None => {
                self.slots.push(Slot { id, pos });
                self.slots.len() - 1
            }
        };
        self.entries.push(Entry {
            deadline,
            id,
            slot,
            waker,
        });
        let pos = self.sift_up(pos);
        (TimerKey { slot, id }, pos == 0)
    }

    /// Where `key`'s entry sits, if it is still pending.
    fn position(&self, key: TimerKey) -> Option<usize> {
        match self.slots.get(key.slot) {
            Some(s) if s.id == key.id => Some(s.pos),
            _ => None,
        }
    }

    /// Takes `key`'s entry out, if it is still pending.
    fn remove(&mut self, key: TimerKey) -> Option<Waker> {
        let pos = self.position(key)?;
        Some(self.remove_at(pos).waker)
    }

    /// Moves `key`'s entry to `deadline`. `None` if it is not pending, else
    /// whether it is now the earliest.
    fn reset(&mut self, key: TimerKey, deadline: Instant) -> Option<bool> {
        let pos = self.position(key)?;
        self.entries[pos].deadline = deadline;
        let pos = self.sift_up(pos);
        let pos = self.sift_down(pos);
        Some(pos == 0)
    }

    /// The waker of `key`'s entry, if it is still pending.
    fn waker_mut(&mut self, key: TimerKey) -> Option<&mut Waker> {
        let pos = self.position(key)?;
        Some(&mut self.entries[pos].waker)
    }

    /// Takes out the earliest entry if it is due by `now`.
    fn pop_due(&mut self, now: Instant) -> Option<Waker> {
        if self.earliest()? > now {
            return None;
        }
        Some(self.remove_at(0).waker)
    }

    /// Takes every entry out (closing); every key goes stale.
    fn take_all(&mut self) -> Vec<Waker> {
        let all = self.entries.drain(..).map(|e| e.waker).collect();
        self.shrink();
        all
    }

    fn remove_at(&mut self, pos: usize) -> Entry {
        let entry = self.entries.swap_remove(pos);
        self.slots[entry.slot] = Slot { id: 0, pos: 0 };
        self.free.push(entry.slot);
        if pos < self.entries.len() {
            // The last entry moved into the hole: put it in its place.
            self.slots[self.entries[pos].slot].pos = pos;
            let pos = self.sift_up(pos);
            self.sift_down(pos);
        }
        self.shrink();
        entry
    }

    /// Gives memory back: all of it (down to [`KEEP`]) once nothing is
    /// pending, and half of the heap's buffer whenever it is three-quarters
    /// empty (each halving follows at least as many removals as it frees
    /// places, so the cost per removal stays constant).
    fn shrink(&mut self) {
        if self.entries.is_empty() {
            self.slots.clear();
            self.free.clear();
            if self.capacity() > KEEP {
                self.entries.shrink_to(KEEP);
                self.slots.shrink_to(KEEP);
                self.free.shrink_to(KEEP);
            }
        } else {
            let cap = self.entries.capacity();
            if cap > KEEP && self.entries.len() <= cap / 4 {
                self.entries.shrink_to(cap / 2);
            }
        }
    }

    fn earlier(&self, a: usize, b: usize) -> bool {
        let (a, b) = (&self.entries[a], &self.entries[b]);
        (a.deadline, a.id) < (b.deadline, b.id)
    }

    fn swap(&mut self, a: usize, b: usize) {
        self.entries.swap(a, b);
        self.slots[self.entries[a].slot].pos = a;
        self.slots[self.entries[b].slot].pos = b;
    }

    fn sift_up(&mut self, mut pos: usize) -> usize {
        while pos > 0 {
            let parent = (pos - 1) / 2;
            if !self.earlier(pos, parent) {
                break;
            }
            self.swap(pos, parent);
            pos = parent;
        }
        pos
    }

    fn sift_down(&mut self, mut pos: usize) -> usize {
        loop {
            let left = 2 * pos + 1;
            if left >= self.entries.len() {
                return pos;
            }
            let right = left + 1;
            let child = if right < self.entries.len() && self.earlier(right, left) {
                right
            } else {
                left
            };
            if !self.earlier(child, pos) {
                return pos;
            }
            self.swap(pos, child);
            pos = child;
        }
    }
}

/// What the thread and every handle share.
struct TimersInner {
    state: Mutex<TimersState>,
    /// Wakes the thread: a new earliest entry, or the close.
    cond: Condvar,
    name: String,
}

struct TimersState {
    heap: Heap,
    /// The thread, once started (taken by the close).
    thread: Option<thread::JoinHandle<()>>,
    /// The `Timers` was dropped: nothing new is pending, the thread exits.
    closed: bool,
}

/// Why an entry could not be made pending.
enum Refused {
    /// The `Timers` was dropped.
    Closed,
    /// The thread could not be started (what the OS said).
    Unavailable(String),
}

/// Many wake-ups at deadlines on one thread (see the module docs): for
/// thousands of concurrent waits, each insert, re-arm and cancel costs
/// O(log n) under one short lock, and a pending entry costs about 70 bytes
/// of shared buffers (heap, slot table, free list), no allocation of its
/// own.
#[cfg_attr(not(any(test, loom)), allow(dead_code))]
#[allow(unreachable_pub)]
pub struct Timers {
    inner: Arc<TimersInner>,
}

#[cfg_attr(not(any(test, loom)), allow(dead_code))]
#[allow(unreachable_pub)]
impl Timers {
    /// A service whose thread, started on first use, is named
    /// `keyed-timer`.
    pub fn new() -> Timers {
        Timers::with_name(DEFAULT_TIMERS_NAME)
    }

    /// A service whose thread, started on first use, is named `name`.
    pub fn with_name(name: impl Into<String>) -> Timers {
        Timers {
            inner: Arc::new(TimersInner {
                state: Mutex::new(TimersState {
                    heap: Heap::new(),
                    thread: None,
                    closed: false,
                }),
                cond: Condvar::new(),
                name: name.into(),
            }),
        }
    }

    /// Wakes `waker` once `deadline` has passed, unless the entry is
    /// cancelled first. Fails only if the thread, not started yet, could
    /// not be started (what the OS said); a later insert tries again.
    pub fn insert(&self, deadline: Instant, waker: &Waker) -> Result<TimerKey, String> {
        match insert(&self.inner, deadline, waker.clone()) {
            Ok(key) => Ok(key),
            Err(Refused::Unavailable(reason)) => Err(reason),
            Err(Refused::Closed) => unreachable!("a `Timers` is closed only when dropped"),
        }
    }

    /// Takes `key`'s entry out: `true` if it was pending (its waker is
    /// dropped unwoken), `false` if it had fired or was cancelled already
    /// (a firing may still be waking its waker).
    pub fn cancel(&self, key: TimerKey) -> bool {
        cancel(&self.inner, key)
    }

    /// Moves `key`'s pending entry to `deadline`, earlier or later, and
    /// makes it wake `waker` (kept if it would wake the same task). `false`
    /// if the entry is no longer pending: insert a new one.
    pub fn reset(&self, key: TimerKey, deadline: Instant, waker: &Waker) -> bool {
        let (earliest, old) = {
            let mut st = self.inner.state.lock();
            let Some(earliest) = st.heap.reset(key, deadline) else {
                return false;
            };
            (earliest, replace_waker(&mut st.heap, key, waker))
        };
        if earliest {
            self.inner.cond.notify_one();
        }
        drop(old);
        true
    }

    /// Whether `key`'s entry is still pending (neither fired nor cancelled).
    pub fn is_pending(&self, key: TimerKey) -> bool {
        self.inner.state.lock().heap.position(key).is_some()
    }

    /// How many entries are pending.
    pub fn len(&self) -> usize {
        self.inner.state.lock().heap.len()
    }

    /// Whether no entry is pending.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A future that is ready once `deadline` has passed (see [`Sleep`]).
    pub fn sleep_until(&self, deadline: Instant) -> Sleep {
        Sleep {
            inner: Arc::clone(&self.inner),
            deadline,
            key: None,
        }
    }

    /// A future that is ready once `duration` has passed from now; a
    /// duration past what an `Instant` can hold sleeps for about 30 years.
    pub fn sleep(&self, duration: Duration) -> Sleep {
        let now = Instant::now();
        self.sleep_until(now.checked_add(duration).unwrap_or_else(|| far_future(now)))
    }

    /// The largest buffer the heap holds, in entries.
    #[cfg(test)]
    fn capacity(&self) -> usize {
        self.inner.state.lock().heap.capacity()
    }

    /// Whether the thread was started.
    #[cfg(test)]
    fn started(&self) -> bool {
        self.inner.state.lock().thread.is_some()
    }
}

impl Default for Timers {
    fn default() -> Self {
        Timers::new()
    }
}

impl Drop for Timers {
    fn drop(&mut self) {
        let (handle, pending) = {
            let mut st = self.inner.state.lock();
            st.closed = true;
            (st.thread.take(), st.heap.take_all())
        };
        self.inner.cond.notify_one();
        for waker in pending {
            wake(waker);
        }
        if let Some(handle) = handle {
            // A waker may drop the last owner on the thread itself: it
            // exits by itself when it gets the lock back.
            if handle.thread().id() != thread::current().id() {
                let _ = handle.join();
            }
        }
    }
}

impl fmt::Debug for Timers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Timers")
            .field("name", &self.inner.name)
            .field("pending", &self.len())
            .finish()
    }
}

/// A time about 30 years after `now`: "never", for a deadline past what an
/// `Instant` can hold.
fn far_future(now: Instant) -> Instant {
    const THIRTY_YEARS: Duration = Duration::from_secs(30 * 365 * 86_400);
    now.checked_add(THIRTY_YEARS).unwrap_or(now)
}

/// Makes an entry pending, starting the thread if this is the first.
fn insert(inner: &Arc<TimersInner>, deadline: Instant, waker: Waker) -> Result<TimerKey, Refused> {
    let (key, earliest) = {
        let mut st = inner.state.lock();
        if st.closed {
            return Err(Refused::Closed);
        }
        if st.thread.is_none() {
            let theirs = Arc::clone(inner);
            let handle = thread::Builder::new()
                .name(inner.name.clone())
                .spawn(move || run(&theirs))
                .map_err(|e| Refused::Unavailable(e.to_string()))?;
            st.thread = Some(handle);
        }
        st.heap.push(deadline, waker)
    };
    // After the change, under the lock, and before the thread can have
    // begun a wait that misses it: see "No lost wake-up".
    if earliest {
        inner.cond.notify_one();
    }
    Ok(key)
}

fn cancel(inner: &TimersInner, key: TimerKey) -> bool {
    let waker = inner.state.lock().heap.remove(key);
    // Dropped outside the lock: a waker's drop may be anyone's code.
    waker.is_some()
}

/// Makes `key`'s pending entry wake `waker`, returning the waker it
/// replaced (to be dropped outside the lock).
fn replace_waker(heap: &mut Heap, key: TimerKey, waker: &Waker) -> Option<Waker> {
    let slot = heap.waker_mut(key)?;
    if slot.will_wake(waker) {
        return None;
    }
    Some(std::mem::replace(slot, waker.clone()))
}

/// Wakes `waker` on the thread or a closing caller: a panicking waker is
/// somebody else's bug and must not stop the wake-ups after it.
fn wake(waker: Waker) {
    let _ = catch_unwind(AssertUnwindSafe(move || waker.wake()));
}

/// The thread: fire what is due, then wait for the earliest deadline.
fn run(inner: &TimersInner) {
    let mut due: Vec<Waker> = Vec::new();
    let mut st = inner.state.lock();
    loop {
        if st.closed {
            return;
        }
        let now = Instant::now();
        while due.len() < FIRE_BATCH {
            match st.heap.pop_due(now) {
                Some(waker) => due.push(waker),
                None => break,
            }
        }
        if !due.is_empty() {
            drop(st);
            for waker in due.drain(..) {
                wake(waker);
            }
            st = inner.state.lock();
            continue;
        }
        st = match st.heap.earliest() {
            // Not due, so after `now`.
            Some(deadline) => inner.cond.wait_timeout(st, deadline - now).0,
            None => inner.cond.wait(st),
        };
    }
}

/// A future that is ready once its deadline has passed
/// ([`Timers::sleep_until`]).
///
/// Readiness is decided by the clock: a poll at or after the deadline is
/// ready, before it registers the task's waker with the [`Timers`] (on the
/// first poll, again only when the waker changed) and is pending. Dropping
/// it takes its entry out. If the `Timers` was dropped first, the sleep
/// is ready at once: nothing would wake it any more. If the `Timers` could
/// not start its thread, the sleep wakes itself to be polled again (a busy
/// wait, only while the OS refuses threads) rather than end early or never.
#[cfg_attr(not(any(test, loom)), allow(dead_code))]
#[allow(unreachable_pub)]
#[must_use = "futures do nothing unless polled"]
pub struct Sleep {
    inner: Arc<TimersInner>,
    deadline: Instant,
    key: Option<TimerKey>,
}

#[cfg_attr(not(any(test, loom)), allow(dead_code))]
#[allow(unreachable_pub)]
impl Sleep {
    /// When the sleep ends.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Whether the deadline has passed.
    pub fn is_elapsed(&self) -> bool {
        Instant::now() >= self.deadline
    }

    /// Moves the deadline, earlier or later, keeping the registered waker
    /// (the sleep is not ready before the new deadline, even if the old one
    /// passed).
    pub fn reset(&mut self, deadline: Instant) {
        self.deadline = deadline;
        let Some(key) = self.key else { return };
        let earliest = self.inner.state.lock().heap.reset(key, deadline);
        match earliest {
            Some(true) => self.inner.cond.notify_one(),
            Some(false) => {}
            // Fired already: the next poll inserts a new entry.
            None => self.key = None,
        }
    }

    fn unregister(&mut self) {
        if let Some(key) = self.key.take() {
            cancel(&self.inner, key);
        }
    }
}

impl Future for Sleep {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        // Under loom a sleep always goes through the thread (the path of a
        // deadline that passes just after this check), so a model sees the
        // thread's wake race whatever else it runs.
        if cfg!(not(loom)) && Instant::now() >= this.deadline {
            this.unregister();
            return Poll::Ready(());
        }
        if let Some(key) = this.key {
            let old = {
                let mut st = this.inner.state.lock();
                if st.heap.position(key).is_some() {
                    Some(replace_waker(&mut st.heap, key, cx.waker()))
                } else {
                    None
                }
            };
            match old {
                Some(old) => {
                    drop(old);
                    return Poll::Pending;
                }
                // Fired (for this deadline: a `reset` forgets a fired
                // entry): the deadline passed by the thread's clock.
                None => {
                    this.key = None;
                    return Poll::Ready(());
                }
            }
        }
        match insert(&this.inner, this.deadline, cx.waker().clone()) {
            Ok(key) => {
                this.key = Some(key);
                Poll::Pending
            }
            Err(Refused::Closed) => Poll::Ready(()),
            Err(Refused::Unavailable(_)) => {
                cx.waker().wake_by_ref();
                Poll::Pending
            }
        }
    }
}

impl Drop for Sleep {
    fn drop(&mut self) {
        self.unregister();
    }
}

impl fmt::Debug for Sleep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sleep")
            .field("deadline", &self.deadline)
            .field("registered", &self.key.is_some())
            .finish()
    }
}

// Not under Miri: this file has no `unsafe`, and its tests wait on the
// clock, which Miri runs hundreds of times slower than the deadlines they set.
#[cfg(all(test, not(loom), not(miri)))]
mod tests;
