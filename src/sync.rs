//! The loom shim: every atomic, lock, condition variable, cell, `Arc`, thread
//! and queue the crate uses comes from this module.
//!
//! Without `cfg(loom)` the items are the fast production primitives
//! (`std` atomics and `Arc`, `parking_lot` locks, `crossbeam-deque` queues,
//! `std::thread`). With `RUSTFLAGS="--cfg loom"` they are replaced by
//! [loom](https://docs.rs/loom)'s models so the model checks in `loom-tests/`
//! explore every interleaving of the crate's *real* code. The two halves have
//! the same API; code elsewhere in the crate must never import a primitive from
//! anywhere else (loom cannot see `parking_lot`, `std` atomics, crossbeam's
//! queues or `std::thread::park`).
//!
//! Differences callers must respect:
//! - There is no `Weak`: loom does not model it. Registries hold `Arc`s and
//!   deregister explicitly.
//! - Locks never poison: a panic while holding one is a bug in this crate, not
//!   a state to recover from (user code never runs under a crate lock).
//! - [`spin_loop`] yields to the loom scheduler under loom, so spin loops stay
//!   finite in a model.

#![allow(dead_code, unused_imports)]

#[cfg(not(loom))]
mod imp {
    use std::time::Duration;

    pub(crate) use std::sync::Arc;

    /// Atomics (re-exported from `std`).
    pub(crate) mod atomic {
        pub(crate) use std::sync::atomic::{
            fence, AtomicBool, AtomicPtr, AtomicU16, AtomicU32, AtomicU64, AtomicU8, AtomicUsize,
            Ordering,
        };
    }

    /// A mutex that never poisons.
    #[derive(Debug, Default)]
    pub(crate) struct Mutex<T>(parking_lot::Mutex<T>);

    /// Guard of [`Mutex`].
    pub(crate) type MutexGuard<'a, T> = parking_lot::MutexGuard<'a, T>;

    impl<T> Mutex<T> {
        pub(crate) fn new(value: T) -> Self {
            Mutex(parking_lot::Mutex::new(value))
        }

        #[inline]
        pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
            self.0.lock()
        }

        #[inline]
        pub(crate) fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
            self.0.try_lock()
        }

        pub(crate) fn into_inner(self) -> T {
            self.0.into_inner()
        }
    }

    /// A condition variable for [`Mutex`].
    #[derive(Debug, Default)]
    pub(crate) struct Condvar(parking_lot::Condvar);

    impl Condvar {
        pub(crate) fn new() -> Self {
            Condvar(parking_lot::Condvar::new())
        }

        pub(crate) fn wait<'a, T>(&self, mut guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
            self.0.wait(&mut guard);
            guard
        }

        /// Waits at most `timeout`; the flag says whether it timed out.
        pub(crate) fn wait_timeout<'a, T>(
            &self,
            mut guard: MutexGuard<'a, T>,
            timeout: Duration,
        ) -> (MutexGuard<'a, T>, bool) {
            let timed_out = self.0.wait_for(&mut guard, timeout).timed_out();
            (guard, timed_out)
        }

        pub(crate) fn notify_one(&self) {
            self.0.notify_one();
        }

        pub(crate) fn notify_all(&self) {
            self.0.notify_all();
        }
    }

    /// `UnsafeCell` with loom's closure-based access API.
    #[derive(Debug, Default)]
    pub(crate) struct UnsafeCell<T>(core::cell::UnsafeCell<T>);

    impl<T> UnsafeCell<T> {
        pub(crate) const fn new(value: T) -> Self {
            UnsafeCell(core::cell::UnsafeCell::new(value))
        }

        #[inline(always)]
        pub(crate) fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
            f(self.0.get())
        }

        #[inline(always)]
        pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
            f(self.0.get())
        }

        pub(crate) fn into_inner(self) -> T {
            self.0.into_inner()
        }
    }

    /// A lock for tiny critical sections that are almost never contended
    /// (a mailbox's queue: its worker, and a force stop once). Taking it is
    /// one atomic swap and releasing it a plain store, half the locked
    /// instructions of a `parking_lot` mutex; under contention it spins, then
    /// yields.
    #[derive(Debug, Default)]
    pub(crate) struct SpinLock<T> {
        locked: std::sync::atomic::AtomicBool,
        value: core::cell::UnsafeCell<T>,
    }

    // SAFETY: the lock hands out `&mut T` to one thread at a time.
    unsafe impl<T: Send> Sync for SpinLock<T> {}
    // SAFETY: it owns a `T`.
    unsafe impl<T: Send> Send for SpinLock<T> {}

    /// Guard of [`SpinLock`].
    pub(crate) struct SpinGuard<'a, T>(&'a SpinLock<T>);

    impl<T> SpinLock<T> {
        pub(crate) const fn new(value: T) -> Self {
            SpinLock {
                locked: std::sync::atomic::AtomicBool::new(false),
                value: core::cell::UnsafeCell::new(value),
            }
        }

        #[inline]
        pub(crate) fn lock(&self) -> SpinGuard<'_, T> {
            use std::sync::atomic::Ordering::{Acquire, Relaxed};
            if self.locked.swap(true, Acquire) {
                self.lock_slow();
            }
            SpinGuard(self)
        }

        #[cold]
        fn lock_slow(&self) {
            use std::sync::atomic::Ordering::{Acquire, Relaxed};
            let mut spins = 0u32;
            loop {
                while self.locked.load(Relaxed) {
                    spins += 1;
                    if spins < 64 {
                        core::hint::spin_loop();
                    } else {
                        std::thread::yield_now();
                    }
                }
                if !self.locked.swap(true, Acquire) {
                    return;
                }
            }
        }
    }

    impl<T> core::ops::Deref for SpinGuard<'_, T> {
        type Target = T;
        #[inline]
        fn deref(&self) -> &T {
            // SAFETY: the guard holds the lock.
            unsafe { &*self.0.value.get() }
        }
    }

    impl<T> core::ops::DerefMut for SpinGuard<'_, T> {
        #[inline]
        fn deref_mut(&mut self) -> &mut T {
            // SAFETY: the guard holds the lock.
            unsafe { &mut *self.0.value.get() }
        }
    }

    impl<T> Drop for SpinGuard<'_, T> {
        #[inline]
        fn drop(&mut self) {
            self.0
                .locked
                .store(false, std::sync::atomic::Ordering::Release);
        }
    }

    /// Threads: spawning, parking, identity.
    pub(crate) mod thread {
        pub(crate) use std::thread::{
            current, park, park_timeout, yield_now, Builder, JoinHandle, Thread,
        };
    }

    pub(crate) use std::thread_local;

    /// An unbounded MPMC FIFO queue (a worker's queue of scheduled mailboxes).
    pub(crate) struct Queue<T>(crossbeam_deque::Injector<T>);

    impl<T> Queue<T> {
        pub(crate) fn new() -> Self {
            Queue(crossbeam_deque::Injector::new())
        }

        #[inline]
        pub(crate) fn push(&self, value: T) {
            self.0.push(value);
        }

        #[inline]
        pub(crate) fn pop(&self) -> Option<T> {
            loop {
                match self.0.steal() {
                    crossbeam_deque::Steal::Success(v) => return Some(v),
                    crossbeam_deque::Steal::Empty => return None,
                    crossbeam_deque::Steal::Retry => core::hint::spin_loop(),
                }
            }
        }

        #[inline]
        pub(crate) fn is_empty(&self) -> bool {
            self.0.is_empty()
        }

        #[inline]
        pub(crate) fn len(&self) -> usize {
            self.0.len()
        }
    }

    /// A worker's own run queue (FIFO): its owner pushes and pops at no
    /// cost beyond a few plain stores and one `fetch_add` a pop; other
    /// threads take the oldest value through a [`Thief`].
    pub(crate) struct RunQueue<T>(crossbeam_deque::Worker<T>);

    impl<T> RunQueue<T> {
        pub(crate) fn new() -> Self {
            RunQueue(crossbeam_deque::Worker::new_fifo())
        }

        /// The handle other threads take values through.
        pub(crate) fn thief(&self) -> Thief<T> {
            Thief(self.0.stealer())
        }

        #[inline]
        pub(crate) fn push(&self, value: T) {
            self.0.push(value);
        }

        #[inline]
        pub(crate) fn pop(&self) -> Option<T> {
            self.0.pop()
        }

        #[inline]
        pub(crate) fn is_empty(&self) -> bool {
            self.0.is_empty()
        }

        #[inline]
        pub(crate) fn len(&self) -> usize {
            self.0.len()
        }
    }

    /// Takes values out of another thread's [`RunQueue`], the oldest first.
    pub(crate) struct Thief<T>(crossbeam_deque::Stealer<T>);

    impl<T> Thief<T> {
        #[inline]
        pub(crate) fn is_empty(&self) -> bool {
            self.0.is_empty()
        }

        #[inline]
        pub(crate) fn len(&self) -> usize {
            self.0.len()
        }

        pub(crate) fn steal(&self) -> Option<T> {
            loop {
                match self.0.steal() {
                    crossbeam_deque::Steal::Success(v) => return Some(v),
                    crossbeam_deque::Steal::Empty => return None,
                    crossbeam_deque::Steal::Retry => core::hint::spin_loop(),
                }
            }
        }
    }

    /// A hint inside a busy-wait loop.
    #[inline(always)]
    pub(crate) fn spin_loop() {
        core::hint::spin_loop();
    }

    /// The first expected value of a compare-exchange loop on `a`: a relaxed
    /// load (see the loom half for why it is a function).
    #[inline(always)]
    pub(crate) fn cas_guess(a: &atomic::AtomicU64) -> u64 {
        a.load(atomic::Ordering::Relaxed)
    }

    /// Writes `v` into a state word that only the caller moves, where the
    /// one racing write is a compare-exchange adding a flag that `v` may
    /// discard (a stale waker's `NOTIFIED`): a release store. Under loom a
    /// swap (see the loom half).
    #[inline(always)]
    pub(crate) fn overwrite(a: &atomic::AtomicUsize, v: usize) {
        a.store(v, atomic::Ordering::Release);
    }
}

#[cfg(loom)]
mod imp {
    use std::collections::VecDeque;
    use std::time::Duration;

    pub(crate) use loom::sync::Arc;

    /// Atomics (loom's models, behind [`SeqCstInit`]).
    pub(crate) mod atomic {
        pub(crate) use loom::sync::atomic::{fence, Ordering};

        use super::SeqCstInit;
        pub(crate) type AtomicBool = SeqCstInit<loom::sync::atomic::AtomicBool>;
        pub(crate) type AtomicU8 = SeqCstInit<loom::sync::atomic::AtomicU8>;
        pub(crate) type AtomicU16 = SeqCstInit<loom::sync::atomic::AtomicU16>;
        pub(crate) type AtomicU32 = SeqCstInit<loom::sync::atomic::AtomicU32>;
        pub(crate) type AtomicU64 = SeqCstInit<loom::sync::atomic::AtomicU64>;
        pub(crate) type AtomicUsize = SeqCstInit<loom::sync::atomic::AtomicUsize>;
        pub(crate) type AtomicPtr<T> = SeqCstInit<loom::sync::atomic::AtomicPtr<T>>;
    }

    /// A loom atomic whose initial value is also written with `SeqCst`.
    ///
    /// Loom records an atomic's initial value as a non-`SeqCst` store, and
    /// lets a `SeqCst` load read a non-`SeqCst` store even when a newer
    /// `SeqCst` store exists. So in a Dekker hand-shake on a fresh atomic
    /// (`pool/source/credit.rs`: set `WAITERS` then retry the acquire,
    /// against `in_flight.fetch_sub` then read `has_waiters`; the worker's
    /// park against a push) loom would let both sides read the old values, an
    /// outcome the C++ model forbids (the initial value happens before every
    /// access, so a `SeqCst` load cannot read it past a `SeqCst` store that
    /// precedes the load in the single total order). A `SeqCst` store of the
    /// same value right after creation closes that gap; it changes no value.
    #[derive(Debug)]
    pub(crate) struct SeqCstInit<A>(A);

    impl<A> core::ops::Deref for SeqCstInit<A> {
        type Target = A;

        fn deref(&self) -> &A {
            &self.0
        }
    }

    macro_rules! seq_cst_init {
        ($($atomic:ident: $t:ty),*) => {$(
            impl SeqCstInit<loom::sync::atomic::$atomic> {
                pub(crate) fn new(value: $t) -> Self {
                    let a = loom::sync::atomic::$atomic::new(value);
                    a.store(value, loom::sync::atomic::Ordering::SeqCst);
                    SeqCstInit(a)
                }
            }

            impl Default for SeqCstInit<loom::sync::atomic::$atomic> {
                fn default() -> Self {
                    Self::new(<$t>::default())
                }
            }
        )*};
    }

    seq_cst_init!(
        AtomicBool: bool,
        AtomicU8: u8,
        AtomicU16: u16,
        AtomicU32: u32,
        AtomicU64: u64,
        AtomicUsize: usize
    );

    impl<T> SeqCstInit<loom::sync::atomic::AtomicPtr<T>> {
        pub(crate) fn new(value: *mut T) -> Self {
            let a = loom::sync::atomic::AtomicPtr::new(value);
            a.store(value, loom::sync::atomic::Ordering::SeqCst);
            SeqCstInit(a)
        }
    }

    /// A mutex that never poisons (loom's, unwrapped).
    #[derive(Debug)]
    pub(crate) struct Mutex<T>(loom::sync::Mutex<T>);

    /// Guard of [`Mutex`].
    pub(crate) type MutexGuard<'a, T> = loom::sync::MutexGuard<'a, T>;

    impl<T> Mutex<T> {
        pub(crate) fn new(value: T) -> Self {
            Mutex(loom::sync::Mutex::new(value))
        }

        pub(crate) fn lock(&self) -> MutexGuard<'_, T> {
            self.0.lock().unwrap_or_else(|e| e.into_inner())
        }

        pub(crate) fn try_lock(&self) -> Option<MutexGuard<'_, T>> {
            self.0.try_lock().ok()
        }

        pub(crate) fn into_inner(self) -> T {
            self.0.into_inner().unwrap_or_else(|e| e.into_inner())
        }
    }

    impl<T: Default> Default for Mutex<T> {
        fn default() -> Self {
            Mutex::new(T::default())
        }
    }

    /// A condition variable for [`Mutex`] (loom's).
    #[derive(Debug, Default)]
    pub(crate) struct Condvar(loom::sync::Condvar);

    impl Condvar {
        pub(crate) fn new() -> Self {
            Condvar(loom::sync::Condvar::new())
        }

        pub(crate) fn wait<'a, T>(&self, guard: MutexGuard<'a, T>) -> MutexGuard<'a, T> {
            self.0.wait(guard).unwrap_or_else(|e| e.into_inner())
        }

        /// Loom has no time: a timed wait is an untimed wait that may also
        /// return spuriously, which every caller already tolerates.
        pub(crate) fn wait_timeout<'a, T>(
            &self,
            guard: MutexGuard<'a, T>,
            timeout: Duration,
        ) -> (MutexGuard<'a, T>, bool) {
            let (guard, res) = self
                .0
                .wait_timeout(guard, timeout)
                .unwrap_or_else(|e| e.into_inner());
            (guard, res.timed_out())
        }

        pub(crate) fn notify_one(&self) {
            self.0.notify_one();
        }

        pub(crate) fn notify_all(&self) {
            self.0.notify_all();
        }
    }

    /// loom's `UnsafeCell`, which checks every access for data races.
    #[derive(Debug)]
    pub(crate) struct UnsafeCell<T>(loom::cell::UnsafeCell<T>);

    impl<T> UnsafeCell<T> {
        pub(crate) fn new(value: T) -> Self {
            UnsafeCell(loom::cell::UnsafeCell::new(value))
        }

        pub(crate) fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
            self.0.with(f)
        }

        pub(crate) fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
            self.0.with_mut(f)
        }

        pub(crate) fn into_inner(self) -> T {
            self.0.into_inner()
        }
    }

    /// Under loom the spin lock is loom's mutex (a spinning lock would blow
    /// up the state space and loom checks the same mutual exclusion).
    pub(crate) type SpinLock<T> = Mutex<T>;
    /// Guard of [`SpinLock`].
    pub(crate) type SpinGuard<'a, T> = MutexGuard<'a, T>;

    /// Threads (loom's).
    pub(crate) mod thread {
        pub(crate) use loom::thread::{current, park, yield_now, Builder, JoinHandle, Thread};

        /// Loom has no clock: a timed park returns at once, like a spurious
        /// wake-up, which every caller already tolerates.
        pub(crate) fn park_timeout(_timeout: std::time::Duration) {
            loom::thread::yield_now();
        }
    }

    pub(crate) use loom::thread_local;

    /// A loom-visible FIFO queue standing in for crossbeam's injector.
    pub(crate) struct Queue<T>(Mutex<VecDeque<T>>);

    impl<T> Queue<T> {
        pub(crate) fn new() -> Self {
            Queue(Mutex::new(VecDeque::new()))
        }

        pub(crate) fn push(&self, value: T) {
            self.0.lock().push_back(value);
        }

        pub(crate) fn pop(&self) -> Option<T> {
            self.0.lock().pop_front()
        }

        pub(crate) fn is_empty(&self) -> bool {
            self.0.lock().is_empty()
        }

        pub(crate) fn len(&self) -> usize {
            self.0.lock().len()
        }
    }

    /// A worker's run queue under loom: a shared `VecDeque` behind a loom
    /// mutex, so steals are explored like any other access.
    pub(crate) struct RunQueue<T>(Arc<Mutex<VecDeque<T>>>);

    impl<T> RunQueue<T> {
        pub(crate) fn new() -> Self {
            RunQueue(Arc::new(Mutex::new(VecDeque::new())))
        }

        pub(crate) fn thief(&self) -> Thief<T> {
            Thief(self.0.clone())
        }

        pub(crate) fn push(&self, value: T) {
            self.0.lock().push_back(value);
        }

        pub(crate) fn pop(&self) -> Option<T> {
            self.0.lock().pop_front()
        }

        pub(crate) fn is_empty(&self) -> bool {
            self.0.lock().is_empty()
        }

        pub(crate) fn len(&self) -> usize {
            self.0.lock().len()
        }
    }

    /// Takes values out of another thread's [`RunQueue`], the oldest first.
    pub(crate) struct Thief<T>(Arc<Mutex<VecDeque<T>>>);

    impl<T> Thief<T> {
        pub(crate) fn is_empty(&self) -> bool {
            self.0.lock().is_empty()
        }

        pub(crate) fn len(&self) -> usize {
            self.0.lock().len()
        }

        pub(crate) fn steal(&self) -> Option<T> {
            self.0.lock().pop_front()
        }
    }

    /// Under loom a busy-wait must give the scheduler a chance to run the
    /// thread it is waiting for.
    pub(crate) fn spin_loop() {
        loom::thread::yield_now();
    }

    /// The first expected value of a compare-exchange loop on `a`, read
    /// under loom with a relaxed `fetch_add(0)`: the latest value, with no
    /// synchronization (what a relaxed load adds). A relaxed load may return
    /// any value not yet superseded in the thread's view, and loom explores
    /// each one; for a guess whose only use is to be checked by the CAS that
    /// follows, a stale value only costs a failed CAS and a retry (or, in
    /// `Credit::release`, a needless but harmless slow path), yet on the
    /// credit's busy word those branches multiplied the credit models'
    /// executions more than fiftyfold.
    pub(crate) fn cas_guess(a: &atomic::AtomicU64) -> u64 {
        a.fetch_add(0, atomic::Ordering::Relaxed)
    }

    /// Under loom, [`overwrite`]'s store is a swap: loom lets a later
    /// read-modify-write read a compare-exchange's value over a plain store
    /// that follows it in modification order, an outcome the C++ model
    /// forbids; as a swap the write is ordered after that CAS or makes it
    /// fail, which is what the store does on real hardware.
    pub(crate) fn overwrite(a: &atomic::AtomicUsize, v: usize) {
        a.swap(v, atomic::Ordering::AcqRel);
    }
}

pub(crate) use imp::*;

/// Clones an `Arc` from a raw pointer obtained with `Arc::into_raw`, leaving
/// the original count untouched (the caller still owns that reference).
///
/// # Safety
/// `ptr` must come from `Arc::<T>::into_raw` and that reference must still be
/// alive for the duration of the call.
pub(crate) unsafe fn arc_clone_raw<T>(ptr: *const T) -> Arc<T> {
    // SAFETY: the caller guarantees `ptr` came from `Arc::into_raw` and is
    // still owned by someone; `ManuallyDrop` keeps that reference alive, and
    // the clone takes a new one.
    let borrowed = core::mem::ManuallyDrop::new(unsafe { Arc::from_raw(ptr) });
    Arc::clone(&borrowed)
}

impl<T> core::fmt::Debug for Queue<T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Queue").finish_non_exhaustive()
    }
}
