//! The crate's own waker: a `Waker` whose data pointer is one reference of an
//! `Arc` to a mailbox (or spawned task), with a static vtable per type.
//!
//! `std::task::Wake` would do on `std` alone, but it needs `std::sync::Arc`
//! and loom's `Arc` is not that; a raw vtable over the shim's `Arc` works for
//! both.
//!
//! While polling, the worker lends a [`WakerRef`]: a `Waker` built over the
//! mailbox pointer *without* taking a reference, so a poll that never clones
//! its waker (every sync handler) costs no reference-count traffic. A future
//! that keeps the waker clones it, and that clone owns a reference.

use std::marker::PhantomData;
use std::mem::ManuallyDrop;
use std::ops::Deref;
use std::task::{RawWaker, RawWakerVTable, Waker};

use crate::sync::{arc_clone_raw, Arc};

/// Something a waker can wake.
pub(crate) trait Wake: Send + Sync + 'static {
    /// Wakes, consuming one reference.
    fn wake(this: Arc<Self>);
    /// Wakes without consuming the reference.
    fn wake_by_ref(this: &Arc<Self>);
}

struct VTableFor<W>(PhantomData<W>);

impl<W: Wake> VTableFor<W> {
    const VTABLE: RawWakerVTable =
        RawWakerVTable::new(Self::clone, Self::wake, Self::wake_by_ref, Self::drop);

    unsafe fn clone(ptr: *const ()) -> RawWaker {
        // SAFETY: every `RawWaker` of this vtable points at a live `W` kept
        // alive by an `Arc` reference (owned by the waker, or by the lender of
        // a `WakerRef`); cloning takes a new reference for the new waker.
        let arc = unsafe { arc_clone_raw(ptr.cast::<W>()) };
        RawWaker::new(Arc::into_raw(arc).cast::<()>(), &Self::VTABLE)
    }

    unsafe fn wake(ptr: *const ()) {
        // SAFETY: `wake` consumes the waker, which owns one reference
        // (a `WakerRef` is never consumed: it lives in a `ManuallyDrop`).
        let arc = unsafe { Arc::from_raw(ptr.cast::<W>()) };
        W::wake(arc);
    }

    unsafe fn wake_by_ref(ptr: *const ()) {
        // SAFETY: the pointer is kept alive by the waker's reference for the
        // duration of this call; `ManuallyDrop` leaves that reference alone.
        let arc = ManuallyDrop::new(unsafe { Arc::from_raw(ptr.cast::<W>()) });
        W::wake_by_ref(&arc);
    }

    unsafe fn drop(ptr: *const ()) {
        // SAFETY: dropping a waker releases the reference it owns.
        drop(unsafe { Arc::from_raw(ptr.cast::<W>()) });
    }
}

/// A borrowed waker: valid while the `Arc` it was made from is borrowed.
pub(crate) struct WakerRef<'a> {
    waker: ManuallyDrop<Waker>,
    _arc: PhantomData<&'a ()>,
}

impl<'a> WakerRef<'a> {
    /// Lends a waker over `arc` without touching its reference count.
    pub(crate) fn new<W: Wake>(arc: &'a Arc<W>) -> Self {
        let raw = RawWaker::new(Arc::as_ptr(arc).cast::<()>(), &VTableFor::<W>::VTABLE);
        WakerRef {
            // SAFETY: the pointer is live for `'a` (borrowed from `arc`);
            // `ManuallyDrop` ensures the borrowed waker never runs the vtable's
            // `drop`, which would release a reference it does not own, and
            // `Deref` only hands out `&Waker`, so it can't be consumed by `wake`.
            waker: ManuallyDrop::new(unsafe { Waker::from_raw(raw) }),
            _arc: PhantomData,
        }
    }
}

impl Deref for WakerRef<'_> {
    type Target = Waker;

    fn deref(&self) -> &Waker {
        &self.waker
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    use std::sync::atomic::{AtomicUsize, Ordering};

    /// An owned waker holding one reference of `arc`.
    fn waker<W: Wake>(arc: Arc<W>) -> Waker {
        let raw = RawWaker::new(Arc::into_raw(arc).cast::<()>(), &VTableFor::<W>::VTABLE);
        // SAFETY: the vtable functions uphold the `RawWaker` contract for
        // pointers made by `Arc::<W>::into_raw`, which `raw` is.
        unsafe { Waker::from_raw(raw) }
    }

    #[derive(Default)]
    struct Count(AtomicUsize);

    impl Wake for Count {
        fn wake(this: Arc<Self>) {
            this.0.fetch_add(1, Ordering::SeqCst);
        }
        fn wake_by_ref(this: &Arc<Self>) {
            this.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn borrowed_and_owned_wakers_keep_counts_right() {
        let c = Arc::new(Count::default());
        {
            let r = WakerRef::new(&c);
            r.wake_by_ref();
            let owned: Waker = (*r).clone();
            assert_eq!(Arc::strong_count(&c), 2);
            let owned2 = owned.clone();
            owned.wake();
            owned2.wake_by_ref();
            drop(owned2);
        }
        let w = waker(c.clone());
        std::thread::spawn(move || w.wake()).join().unwrap();
        assert_eq!(c.0.load(Ordering::SeqCst), 4);
        assert_eq!(Arc::strong_count(&c), 1);
    }
}
