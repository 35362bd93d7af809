//! `Task`: one reference to something a worker can run (a mailbox, or a
//! spawned future), type-erased behind a hand-written vtable.
//!
//! Workers serve mailboxes of every dispatcher, each with its own key,
//! message and handler types, so their queues hold an erased handle. A
//! `dyn` trait object would do on `std`, but loom's `Arc` cannot be coerced to
//! `Arc<dyn Trait>`; a pointer from `Arc::into_raw` plus a `'static` table of
//! monomorphised functions works with both, and costs the same as a `dyn`
//! call.
//!
//! A `Task` owns exactly one strong reference. `run` and `cancel` consume it;
//! dropping an unrun task releases it.

use std::fmt;
use std::marker::PhantomData;
use std::ptr::NonNull;

use crate::pool::worker::WorkerCx;
use crate::sync::Arc;

/// Something a worker can run.
pub(crate) trait Runnable: Send + Sync + 'static {
    /// Runs one turn on the worker that popped the task; `tag` is the one
    /// the task was made with ([`Task::tagged`], else 0).
    fn run(this: Arc<Self>, cx: &WorkerCx<'_>, tag: usize);
    /// Called instead of `run` once a force stop is under way: give up the
    /// turn, dropping any suspended work as cancelled.
    fn cancel(this: Arc<Self>, tag: usize);
}

struct VTable {
    run: unsafe fn(NonNull<()>, &WorkerCx<'_>, usize),
    cancel: unsafe fn(NonNull<()>, usize),
    drop: unsafe fn(NonNull<()>),
}

struct VTableFor<R>(PhantomData<R>);

impl<R: Runnable> VTableFor<R> {
    const VTABLE: VTable = VTable {
        run: Self::run,
        cancel: Self::cancel,
        drop: Self::drop,
    };

    /// # Safety
    /// `ptr` must come from `Arc::<R>::into_raw` and own that reference.
    unsafe fn run(ptr: NonNull<()>, cx: &WorkerCx<'_>, tag: usize) {
        // SAFETY: per this function's contract the pointer owns one
        // reference of an `Arc<R>`; we take that reference back.
        let arc = unsafe { Arc::from_raw(ptr.as_ptr().cast::<R>().cast_const()) };
        R::run(arc, cx, tag);
    }

    /// # Safety
    /// As for `run`.
    unsafe fn cancel(ptr: NonNull<()>, tag: usize) {
        // SAFETY: as in `run`.
        let arc = unsafe { Arc::from_raw(ptr.as_ptr().cast::<R>().cast_const()) };
        R::cancel(arc, tag);
    }

    /// # Safety
    /// As for `run`.
    unsafe fn drop(ptr: NonNull<()>) {
        // SAFETY: as in `run`; the reference is released.
        drop(unsafe { Arc::from_raw(ptr.as_ptr().cast::<R>().cast_const()) });
    }
}

/// One owned, type-erased reference to a [`Runnable`], with a word the
/// runnable gives meaning to (a dispatcher's port task carries its port).
pub(crate) struct Task {
    ptr: NonNull<()>,
    vtable: &'static VTable,
    tag: usize,
}

// SAFETY: a `Task` is only built from an `Arc<R>` with `R: Runnable`, which
// requires `R: Send + Sync`; moving the reference to another thread is what
// `Arc<R>: Send` already allows.
unsafe impl Send for Task {}

impl Task {
    /// Wraps one reference of `arc`.
    #[inline]
    pub(crate) fn new<R: Runnable>(arc: Arc<R>) -> Self {
        Self::tagged(arc, 0)
    }

    /// Wraps one reference of `arc`, with `tag` for its `run`/`cancel`.
    #[inline]
    pub(crate) fn tagged<R: Runnable>(arc: Arc<R>, tag: usize) -> Self {
        let raw = Arc::into_raw(arc).cast_mut().cast::<()>();
        Task {
            // SAFETY: `Arc::into_raw` never returns null.
            ptr: unsafe { NonNull::new_unchecked(raw) },
            vtable: &VTableFor::<R>::VTABLE,
            tag,
        }
    }

    /// Runs the task's turn on the worker described by `cx`, consuming the
    /// reference.
    pub(crate) fn run(self, cx: &WorkerCx<'_>) {
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `ptr` owns one reference (built in `new` from the matching
        // `R`); `ManuallyDrop` stops `Drop` from releasing it a second time.
        unsafe { (this.vtable.run)(this.ptr, cx, this.tag) }
    }

    /// Cancels the task (force stop), consuming the reference.
    pub(crate) fn cancel(self) {
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: as in `run`.
        unsafe { (this.vtable.cancel)(this.ptr, this.tag) }
    }
}

impl Drop for Task {
    fn drop(&mut self) {
        // SAFETY: the task still owns its reference (run/cancel forget self).
        unsafe { (self.vtable.drop)(self.ptr) }
    }
}

impl fmt::Debug for Task {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Task")
            .field("ptr", &self.ptr)
            .field("tag", &self.tag)
            .finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    struct Probe {
        runs: AtomicUsize,
        cancels: AtomicUsize,
    }

    impl Runnable for Probe {
        fn run(this: Arc<Self>, _cx: &WorkerCx<'_>, _tag: usize) {
            this.runs.fetch_add(1, Ordering::SeqCst);
        }
        fn cancel(this: Arc<Self>, _tag: usize) {
            this.cancels.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[test]
    fn run_cancel_and_drop_each_release_one_reference() {
        let probe = Arc::new(Probe {
            runs: AtomicUsize::new(0),
            cancels: AtomicUsize::new(0),
        });
        Task::new(probe.clone()).cancel();
        drop(Task::new(probe.clone()));
        let t = Task::new(probe.clone());
        std::thread::spawn(move || t.cancel()).join().unwrap();
        assert_eq!(probe.runs.load(Ordering::SeqCst), 0);
        assert_eq!(probe.cancels.load(Ordering::SeqCst), 2);
        assert_eq!(Arc::strong_count(&probe), 1);
    }
}
