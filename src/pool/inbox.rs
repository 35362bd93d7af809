//! A port's inbox: an unbounded FIFO that many producers push to and one
//! consumer at a time pops from (whoever holds the port's gate).
//!
//! # Algorithm
//!
//! A linked list of blocks of `CAP` entries ([`BLOCK_CAP`] by default), the
//! classic segmented
//! queue (as in crossbeam's `SegQueue`), specialised for a single consumer:
//!
//! - A producer claims the next index with one compare-exchange on the
//!   shared `tail`, writes its entry and sets the entry's `ready` flag
//!   (release). Indices run `0..CAP` within a block; the value
//!   `CAP` is a marker meaning "the next block is being installed":
//!   the producer that claims a block's last entry first links a new block
//!   (`tail.block`, then the old block's `next`), then moves `tail` past
//!   the marker. Producers that see the marker wait for that.
//! - The consumer owns `head`: it reads an entry once its `ready` flag is set
//!   (acquire), moves on, and frees a block once it has read its last entry
//!   (every producer of that block has written it by then), or keeps it
//!   as the one spare block. The producer that takes the spare for a new
//!   block resets its entries' flags: the consumer only ever reads a block's
//!   lines (see `new_block`). An entry claimed
//!   but not yet written stops the consumer there, so the queue is FIFO in
//!   claim order; [`pop`](Inbox::pop) then returns `None` and the producer,
//!   which checks its port's state after its push (see `dispatcher/submit.rs`),
//!   schedules the port again. No read-modify-write is paid per value on
//!   the consumer's side.
//!
//! `head.index` is an atomic only so that [`is_empty`](Inbox::is_empty) can
//! be asked from any thread; only the consumer writes it.

use std::mem::MaybeUninit;
use std::ptr;

use crossbeam_utils::CachePadded;

use crate::sync::atomic::{AtomicBool, AtomicPtr, AtomicUsize, Ordering::*};
use crate::sync::{spin_loop, UnsafeCell};

/// Entries per block (31: a block of small deliveries stays within a few
/// pages of the allocator's fast size classes).
#[cfg(not(loom))]
pub(crate) const BLOCK_CAP: usize = 31;
/// Under loom four entries per block: the executor's models then rarely
/// cross a block boundary (each crossing multiplies their interleavings);
/// this file's own loom model crosses them with two-entry blocks.
#[cfg(loom)]
pub(crate) const BLOCK_CAP: usize = 4;

struct Entry<T> {
    value: UnsafeCell<MaybeUninit<T>>,
    ready: AtomicBool,
    /// The value's metrics stamp, written with it: zero-sized without the
    /// `metrics` feature, else 4 bytes that sit in the padding after
    /// `ready` (an entry is no larger with it).
    stamp: UnsafeCell<crate::pool::metrics::Stamp>,
}

struct Block<T, const CAP: usize> {
    next: AtomicPtr<Block<T, CAP>>,
    entries: [Entry<T>; CAP],
}

impl<T, const CAP: usize> Block<T, CAP> {
    fn new() -> Box<Self> {
        Box::new(Block {
            next: AtomicPtr::new(ptr::null_mut()),
            entries: std::array::from_fn(|_| Entry {
                value: UnsafeCell::new(MaybeUninit::uninit()),
                ready: AtomicBool::new(false),
                stamp: UnsafeCell::new(crate::pool::metrics::Stamp::NONE),
            }),
        })
    }
}

struct Tail<T, const CAP: usize> {
    index: AtomicUsize,
    block: AtomicPtr<Block<T, CAP>>,
}

struct Head<T, const CAP: usize> {
    /// Written only by the consumer.
    index: AtomicUsize,
    /// The block `index` is in. Consumer only.
    block: UnsafeCell<*mut Block<T, CAP>>,
}

/// What [`Inbox::pop_before`] found.
pub(crate) enum Popped<T> {
    /// The oldest value, with its metrics stamp.
    Value(T, crate::pool::metrics::Stamp),
    /// Every value claimed before the mark was taken.
    Past,
    /// The oldest value before the mark is claimed but not written yet
    /// (its producer, which checks the port's state after its push, sees
    /// to the port being scheduled again).
    Unwritten,
}

/// See the module docs.
/// `CAP` entries a block (see [`BLOCK_CAP`]).
// `pub` (in a private module) so that `loom-tests` can model it through
// `keyed_executor::__loom` (cfg(loom) builds only).
#[allow(unreachable_pub)]
pub struct Inbox<T, const CAP: usize = BLOCK_CAP> {
    head: CachePadded<Head<T, CAP>>,
    tail: CachePadded<Tail<T, CAP>>,
    /// A block the consumer finished with, for the next producer that needs
    /// one: a producer allocating what a consumer on another thread frees
    /// makes the allocator hand out fresh pages again and again.
    spare: CachePadded<AtomicPtr<Block<T, CAP>>>,
}

// SAFETY: values move from producers to the consumer (`T: Send`); the
// consumer's cells are touched by one consumer at a time (the port's gate
// serialises consumers, and the lock hand-over orders their accesses).
unsafe impl<T: Send, const CAP: usize> Send for Inbox<T, CAP> {}
// SAFETY: as above.
unsafe impl<T: Send, const CAP: usize> Sync for Inbox<T, CAP> {}

impl<T, const CAP: usize> Default for Inbox<T, CAP> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T, const CAP: usize> Inbox<T, CAP> {
    /// Index values per block: the entries and the "next block" marker.
    const LAP: usize = CAP + 1;

    /// An empty inbox (one block).
    #[allow(unreachable_pub)]
    pub fn new() -> Self {
        let first = Box::into_raw(Block::<T, CAP>::new());
        Inbox {
            head: CachePadded::new(Head {
                index: AtomicUsize::new(0),
                block: UnsafeCell::new(first),
            }),
            tail: CachePadded::new(Tail {
                index: AtomicUsize::new(0),
                block: AtomicPtr::new(first),
            }),
            spare: CachePadded::new(AtomicPtr::new(ptr::null_mut())),
        }
    }

    /// A fresh block: the spare one if there is one, reset here.
    ///
    /// The producer that takes the spare resets it, not the consumer that
    /// gave it back: the consumer then only ever reads a block's lines, and
    /// the producer takes every line of the block it is about to write
    /// into its cache at once, here, instead of one cross-core transfer of
    /// a line the consumer wrote for each entry it writes (each waited for
    /// by the fence that follows a push).
    fn new_block(&self) -> *mut Block<T, CAP> {
        let spare = self.spare.swap(ptr::null_mut(), Acquire);
        if spare.is_null() {
            return Box::into_raw(Block::new());
        }
        // SAFETY: the spare was reachable only through `spare`, which we
        // just took it from: it is ours, and it holds no value.
        unsafe {
            (*spare).next.store(ptr::null_mut(), Relaxed);
            for entry in (*spare).entries.iter() {
                entry.ready.store(false, Relaxed);
            }
        }
        spare
    }

    /// Appends `value` (any thread), unstamped: for the loom models and
    /// the unit tests (the dispatcher pushes with
    /// [`push_stamped`](Self::push_stamped)).
    #[cfg(any(test, loom))]
    #[allow(unreachable_pub)]
    #[inline]
    pub fn push(&self, value: T) {
        self.push_stamped(value, crate::pool::metrics::Stamp::NONE);
    }

    /// Appends `value` with its metrics stamp (any thread). Inlined into
    /// the submitter: as a call, the value was moved once more.
    #[inline(always)]
    pub(crate) fn push_stamped(&self, value: T, stamp: crate::pool::metrics::Stamp) {
        let mut spare: Option<*mut Block<T, CAP>> = None;
        let mut index = self.tail.index.load(Acquire);
        loop {
            let offset = index % Self::LAP;
            if offset == CAP {
                // Another producer is linking the next block.
                spin_loop();
                index = self.tail.index.load(Acquire);
                continue;
            }
            // Loaded after `index`: the block that index is in (the linker
            // stores the block before it moves `tail` past the marker).
            let block = self.tail.block.load(Acquire);
            if offset + 1 == CAP && spare.is_none() {
                spare = Some(self.new_block());
            }
            match self
                .tail
                .index
                .compare_exchange_weak(index, index + 1, SeqCst, Acquire)
            {
                Ok(_) => {
                    if offset + 1 == CAP {
                        // We took the block's last entry: link the next one
                        // before our entry becomes readable, so the consumer
                        // finds `next` set once it has read this entry.
                        let next = spare.take().expect("allocated above");
                        self.tail.block.store(next, Release);
                        // SAFETY: `block` is alive: its last entry (ours) is
                        // not ready, so the consumer has not freed it.
                        unsafe { (*block).next.store(next, Release) };
                        // Past the marker, to the first entry of `next`.
                        self.tail.index.store(index + 2, Release);
                    }
                    // SAFETY: we own this entry (claimed by the CAS); the
                    // block is alive until the consumer has read it.
                    unsafe {
                        let entry = &(*block).entries[offset];
                        entry.value.with_mut(|p| (*p).write(value));
                        entry.stamp.with_mut(|p| *p = stamp);
                        entry.ready.store(true, Release);
                    }
                    if let Some(unused) = spare {
                        // Claimed an entry elsewhere after all.
                        self.recycle(unused);
                    }
                    return;
                }
                Err(actual) => index = actual,
            }
        }
    }

    /// Appends `values` (exactly `n` of them, with their stamps) in order,
    /// as consecutive entries: one compare-exchange claims as many entries
    /// as are left in the tail's block (up to `n`), so a batch pays one
    /// claim a block, not one a value. The values of one call are
    /// consecutive in the queue (no other producer's entry lands between
    /// two of them within a block); the consumer may take the first ones
    /// while the last are still being written (an unwritten entry stops
    /// it, as for `push`).
    pub(crate) fn push_many(
        &self,
        mut values: impl Iterator<Item = (T, crate::pool::metrics::Stamp)>,
        mut n: usize,
    ) {
        let mut spare: Option<*mut Block<T, CAP>> = None;
        let mut index = self.tail.index.load(Acquire);
        while n > 0 {
            let offset = index % Self::LAP;
            if offset == CAP {
                // Another producer is linking the next block.
                spin_loop();
                index = self.tail.index.load(Acquire);
                continue;
            }
            let block = self.tail.block.load(Acquire);
            let take = n.min(CAP - offset);
            let last = offset + take == CAP;
            if last && spare.is_none() {
                spare = Some(self.new_block());
            }
            match self
                .tail
                .index
                .compare_exchange_weak(index, index + take, SeqCst, Acquire)
            {
                Ok(_) => {
                    if last {
                        // We took the block's last entry: link the next one
                        // before any of our entries becomes readable (see
                        // `push_stamped`).
                        let next = spare.take().expect("allocated above");
                        self.tail.block.store(next, Release);
                        // SAFETY: `block` is alive: its last entry (ours) is
                        // not ready, so the consumer has not freed it.
                        unsafe { (*block).next.store(next, Release) };
                        self.tail.index.store(index + take + 1, Release);
                    }
                    for i in 0..take {
                        let (value, stamp) = values.next().expect("`n` values");
                        // SAFETY: we own these entries (claimed by the CAS);
                        // the block is alive until the consumer has read them.
                        unsafe {
                            let entry = &(*block).entries[offset + i];
                            entry.value.with_mut(|p| (*p).write(value));
                            entry.stamp.with_mut(|p| *p = stamp);
                            entry.ready.store(true, Release);
                        }
                    }
                    n -= take;
                    index = if last { index + take + 1 } else { index + take };
                }
                Err(actual) => index = actual,
            }
        }
        if let Some(unused) = spare {
            // Claimed elsewhere after all.
            self.recycle(unused);
        }
    }

    /// Keeps `block` (no producer or consumer can reach it any more, and
    /// it holds no value) as the spare, or frees it if there is one
    /// already. The producer that takes it resets it (`new_block`).
    fn recycle(&self, block: *mut Block<T, CAP>) {
        let old = self.spare.swap(block, AcqRel);
        if !old.is_null() {
            // SAFETY: the previous spare was reachable only through `spare`,
            // which we just took it from; it came from `Box::into_raw`.
            drop(unsafe { Box::from_raw(old) });
        }
    }

    /// Takes the oldest value if it has been written.
    ///
    /// # Safety
    /// Only one consumer at a time (the holder of the port's gate), with
    /// its accesses ordered after the previous consumer's (the gate's lock
    /// hand-over does that).
    #[allow(unreachable_pub)]
    #[inline]
    pub unsafe fn pop(&self) -> Option<T> {
        // SAFETY: our caller's contract.
        unsafe { self.pop_stamped() }.map(|(value, _)| value)
    }

    /// [`pop`](Self::pop), with the value's metrics stamp.
    ///
    /// # Safety
    /// As for `pop`.
    #[inline]
    pub(crate) unsafe fn pop_stamped(&self) -> Option<(T, crate::pool::metrics::Stamp)> {
        let index = self.head.index.load(Relaxed);
        // SAFETY: our caller's contract.
        unsafe { self.pop_at(index) }
    }

    /// Where the values pushed so far end: the index the next push claims.
    /// [`pop_before`](Self::pop_before) takes only values claimed before
    /// it (a port's turn takes what its inbox held when the turn began).
    /// SeqCst, like the producers' claims: the mark is past every claim
    /// that precedes it in the SeqCst order (under loom, too, which
    /// otherwise lets a load read any older claim).
    #[inline]
    pub(crate) fn mark(&self) -> usize {
        self.tail.index.load(SeqCst)
    }

    /// [`pop_stamped`](Self::pop_stamped), unless the oldest value was
    /// claimed at or after `mark` (a [`mark`](Self::mark) taken earlier):
    /// then [`Popped::Past`]. Indices only grow (a `usize` does not wrap in
    /// the life of a process), and the consumer's index jumps over a
    /// block's marker as the producers' does, so "claimed before the mark"
    /// is `index < mark`.
    ///
    /// # Safety
    /// As for `pop`.
    #[inline]
    pub(crate) unsafe fn pop_before(&self, mark: usize) -> Popped<T> {
        let index = self.head.index.load(Relaxed);
        if index >= mark {
            return Popped::Past;
        }
        // SAFETY: our caller's contract.
        match unsafe { self.pop_at(index) } {
            Some((value, stamp)) => Popped::Value(value, stamp),
            None => Popped::Unwritten,
        }
    }

    /// Pops the value at the consumer's `index` (just loaded) if written.
    ///
    /// # Safety
    /// As for `pop`.
    #[inline]
    unsafe fn pop_at(&self, index: usize) -> Option<(T, crate::pool::metrics::Stamp)> {
        let offset = index % Self::LAP;
        debug_assert!(offset < CAP, "head never rests on the marker");
        // SAFETY: consumer-only cell (caller's contract).
        let block = self.head.block.with(|b| unsafe { *b });
        // SAFETY: the head block is alive until we free it below.
        let entry = unsafe { &(*block).entries[offset] };
        if !entry.ready.load(Acquire) {
            return None;
        }
        // SAFETY: the entry is ready (written, acquired) and read once.
        let value = entry.value.with(|p| unsafe { (*p).assume_init_read() });
        // SAFETY: written before `ready`, as the value.
        let stamp = entry.stamp.with(|p| unsafe { *p });
        if offset + 1 == CAP {
            // SAFETY: the producer of this entry linked `next` before it
            // set `ready` (acquired above).
            let next = unsafe { (*block).next.load(Acquire) };
            debug_assert!(!next.is_null());
            // SAFETY: consumer-only cell.
            self.head.block.with_mut(|b| unsafe { *b = next });
            self.head.index.store(index + 2, Release);
            // Every entry of `block` has been read and no producer touches a
            // block after writing its entry: nobody can reach it.
            self.recycle(block);
        } else {
            self.head.index.store(index + 1, Release);
        }
        Some((value, stamp))
    }

    /// Whether the oldest value has been written (so [`pop`](Self::pop)
    /// would return it).
    ///
    /// # Safety
    /// As for `pop`: called by the one consumer.
    pub(crate) unsafe fn has_ready(&self) -> bool {
        let offset = self.head.index.load(Relaxed) % Self::LAP;
        // SAFETY: consumer-only cell (caller's contract).
        let block = self.head.block.with(|b| unsafe { *b });
        // SAFETY: the head block is alive while we are the consumer.
        unsafe { (*block).entries[offset].ready.load(Acquire) }
    }

    /// Whether no value has been pushed since the consumer last drained it
    /// (any thread; a value claimed but not yet written counts as present).
    #[inline]
    #[allow(unreachable_pub)]
    pub fn is_empty(&self) -> bool {
        self.head.index.load(Acquire) == self.tail.index.load(Acquire)
    }

    /// Roughly how many values wait (for stats).
    pub(crate) fn len(&self) -> usize {
        let head = self.head.index.load(Acquire);
        let tail = self.tail.index.load(Acquire);
        let entries = |i: usize| i / Self::LAP * CAP + (i % Self::LAP).min(CAP);
        entries(tail).saturating_sub(entries(head))
    }
}

impl<T, const CAP: usize> Drop for Inbox<T, CAP> {
    fn drop(&mut self) {
        // SAFETY: `&mut self`: no producer or consumer is left.
        unsafe {
            while self.pop().is_some() {}
            let block = self.head.block.with(|b| *b);
            drop(Box::from_raw(block));
            let spare = self.spare.load(Relaxed);
            if !spare.is_null() {
                drop(Box::from_raw(spare));
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn the_metrics_stamp_costs_an_entry_no_space() {
        // A delivery of 8-byte key and message is 40 bytes; its entry is 48
        // with or without the `metrics` feature's stamp (in the padding).
        assert_eq!(std::mem::size_of::<Entry<[u64; 5]>>(), 48);
    }

    #[test]
    fn fifo_across_blocks_and_drop_frees_the_rest() {
        let q: Inbox<Box<usize>> = Inbox::new();
        for i in 0..(BLOCK_CAP * 3 + 5) {
            q.push(Box::new(i));
        }
        assert!(!q.is_empty());
        assert_eq!(q.len(), BLOCK_CAP * 3 + 5);
        for i in 0..(BLOCK_CAP * 2) {
            // SAFETY: the only consumer.
            assert_eq!(*unsafe { q.pop() }.unwrap(), i);
        }
        drop(q); // the remaining boxes are freed (Miri checks the leak)
    }

    #[test]
    fn pop_before_takes_only_what_was_claimed_before_the_mark() {
        let q: Inbox<usize> = Inbox::new();
        // A block full: the mark stands at the next block's first entry.
        for i in 0..BLOCK_CAP {
            q.push(i);
        }
        assert_eq!(q.mark(), BLOCK_CAP + 1);
        // A mark taken while the next block was being linked (the marker
        // index) stands between the same two values.
        let mark = BLOCK_CAP;
        for i in 0..5 {
            q.push(100 + i);
        }
        let taken: Vec<usize> = std::iter::from_fn(|| {
            // SAFETY: the only consumer.
            match unsafe { q.pop_before(mark) } {
                Popped::Value(v, _) => Some(v),
                Popped::Past => None,
                Popped::Unwritten => panic!("every value is written"),
            }
        })
        .collect();
        assert_eq!(taken, (0..BLOCK_CAP).collect::<Vec<_>>());
        let mark = q.mark();
        // SAFETY: the only consumer.
        let rest: Vec<usize> = std::iter::from_fn(|| match unsafe { q.pop_before(mark) } {
            Popped::Value(v, _) => Some(v),
            _ => None,
        })
        .collect();
        assert_eq!(rest, (100..105).collect::<Vec<_>>());
        // SAFETY: the only consumer.
        assert!(matches!(unsafe { q.pop_before(mark) }, Popped::Past));
        assert!(q.is_empty());
    }

    #[test]
    fn push_many_appends_in_order_across_blocks() {
        let q: Inbox<Box<usize>> = Inbox::new();
        let stamp = crate::pool::metrics::Stamp::NONE;
        q.push(Box::new(0));
        // From offset 1: fills the rest of the first block, two whole
        // blocks and part of a fourth.
        let n = BLOCK_CAP * 3 + 3;
        q.push_many((1..=n).map(|i| (Box::new(i), stamp)), n);
        q.push(Box::new(n + 1));
        assert_eq!(q.len(), n + 2);
        for i in 0..=n + 1 {
            // SAFETY: the only consumer.
            assert_eq!(*unsafe { q.pop() }.unwrap(), i);
        }
        assert!(q.is_empty());
        // Batches that end exactly at a block's end, then empty ones.
        q.push_many((0..BLOCK_CAP).map(|i| (Box::new(i), stamp)), BLOCK_CAP);
        q.push_many(std::iter::empty(), 0);
        q.push_many((0..BLOCK_CAP).map(|i| (Box::new(i), stamp)), BLOCK_CAP);
        for i in (0..BLOCK_CAP).chain(0..BLOCK_CAP) {
            // SAFETY: the only consumer.
            assert_eq!(*unsafe { q.pop() }.unwrap(), i);
        }
        drop(q);
    }

    #[test]
    fn batches_and_single_pushes_of_many_producers_keep_each_ones_order() {
        let q: Arc<Inbox<(u64, u64)>> = Arc::new(Inbox::new());
        let stamp = crate::pool::metrics::Stamp::NONE;
        let producers: Vec<_> = (0..4u64)
            .map(|p| {
                let q = q.clone();
                std::thread::spawn(move || {
                    let mut i = 0u64;
                    while i < 3_000 {
                        let k = (i % 7 + 1).min(3_000 - i);
                        if k == 1 {
                            q.push((p, i));
                        } else {
                            q.push_many((i..i + k).map(|j| ((p, j), stamp)), k as usize);
                        }
                        i += k;
                    }
                })
            })
            .collect();
        let mut next = [0u64; 4];
        let mut got = 0;
        while got < 12_000 {
            // SAFETY: the only consumer.
            if let Some((p, i)) = unsafe { q.pop() } {
                assert_eq!(i, next[p as usize], "producer {p}");
                next[p as usize] += 1;
                got += 1;
            } else {
                std::thread::yield_now();
            }
        }
        for t in producers {
            t.join().unwrap();
        }
        assert!(q.is_empty());
    }

    #[test]
    fn many_producers_keep_each_ones_order() {
        let q: Arc<Inbox<(u64, u64)>> = Arc::new(Inbox::new());
        let producers: Vec<_> = (0..4u64)
            .map(|p| {
                let q = q.clone();
                std::thread::spawn(move || {
                    for i in 0..2_000u64 {
                        q.push((p, i));
                    }
                })
            })
            .collect();
        let mut next = [0u64; 4];
        let mut got = 0;
        while got < 8_000 {
            // SAFETY: the only consumer.
            match unsafe { q.pop() } {
                Some((p, i)) => {
                    assert_eq!(next[p as usize], i, "producer {p} out of order");
                    next[p as usize] += 1;
                    got += 1;
                }
                None => std::thread::yield_now(),
            }
        }
        for p in producers {
            p.join().unwrap();
        }
        assert!(q.is_empty());
        // SAFETY: the only consumer.
        assert!(unsafe { q.pop() }.is_none());
    }
}
