//! Blocking waits for plain threads: a [`Parker`] (a flag, a mutex and a
//! condition variable from the loom shim), a [`Waker`] that unparks it, and
//! [`block_on`], which drives one future on the calling thread.
//!
//! `execute_blocking` and `close_blocking` are the async forms run by
//! `block_on`, so a blocking caller goes through exactly the same lane state
//! machine as an async one: it can lead, drive a batch, be handed the driving
//! of a batch, and withdraw.
//!
//! The waker is a hand-made `RawWaker` over the shim's `Arc<Parker>` (not
//! `std::task::Wake`, which needs `std::sync::Arc`): under loom its reference
//! count is checked for leaks like every other `Arc` of the crate.
//!
//! Parker states: `notified` false (nothing pending) or true (an unpark has
//! not been consumed). `unpark` sets it and signals; `park` returns at once if
//! it is set, else waits (at most `timeout`), and clears it either way. A
//! wake before the park is therefore never lost.

use std::future::Future;
use std::pin::pin;
use std::task::{Context, Poll, RawWaker, RawWakerVTable, Waker};
use std::time::Duration;

use crate::sync::{arc_clone_raw, Arc, Condvar, Mutex};

/// A thread's wake-up flag.
#[derive(Debug, Default)]
pub(crate) struct Parker {
    notified: Mutex<bool>,
    cond: Condvar,
}

impl Parker {
    pub(crate) fn new() -> Arc<Parker> {
        Arc::new(Parker {
            notified: Mutex::new(false),
            cond: Condvar::new(),
        })
    }

    /// Wakes the parked thread, or makes its next `park` return at once.
    pub(crate) fn unpark(&self) {
        let mut notified = self.notified.lock();
        *notified = true;
        drop(notified);
        self.cond.notify_one();
    }

    /// Waits for an `unpark` (consuming it), at most `timeout` if given. May
    /// return early; callers re-check their condition.
    pub(crate) fn park(&self, timeout: Option<Duration>) {
        let mut notified = self.notified.lock();
        if !*notified {
            match timeout {
                None => {
                    while !*notified {
                        notified = self.cond.wait(notified);
                    }
                }
                Some(timeout) => {
                    notified = self.cond.wait_timeout(notified, timeout).0;
                }
            }
        }
        *notified = false;
    }

    /// A waker that unparks `parker`.
    pub(crate) fn waker(parker: &Arc<Self>) -> Waker {
        let raw = RawWaker::new(Arc::into_raw(Arc::clone(parker)).cast::<()>(), &VTABLE);
        // SAFETY: `raw` carries one strong reference of an `Arc<Parker>`
        // (from `into_raw`) and `VTABLE`'s functions treat the data pointer as
        // exactly that; each function below upholds the `RawWaker` contract.
        unsafe { Waker::from_raw(raw) }
    }
}

static VTABLE: RawWakerVTable = RawWakerVTable::new(clone_raw, wake_raw, wake_by_ref_raw, drop_raw);

unsafe fn clone_raw(data: *const ()) -> RawWaker {
    // SAFETY: `data` came from `Arc::<Parker>::into_raw` in `Parker::waker`
    // (or in this function), and the waker being cloned still owns that
    // reference; `arc_clone_raw` takes a new one without touching it.
    let clone = unsafe { arc_clone_raw(data.cast::<Parker>()) };
    RawWaker::new(Arc::into_raw(clone).cast::<()>(), &VTABLE)
}

unsafe fn wake_raw(data: *const ()) {
    // SAFETY: waking by value consumes the waker's reference, which came from
    // `Arc::into_raw`; `from_raw` takes it back exactly once.
    let parker = unsafe { Arc::from_raw(data.cast::<Parker>()) };
    parker.unpark();
}

unsafe fn wake_by_ref_raw(data: *const ()) {
    // SAFETY: the waker (and so its reference to the `Parker`) is alive for
    // this call; we only borrow the pointee.
    let parker = unsafe { &*data.cast::<Parker>() };
    parker.unpark();
}

unsafe fn drop_raw(data: *const ()) {
    // SAFETY: dropping the waker releases its reference, which came from
    // `Arc::into_raw`; `from_raw` takes it back exactly once.
    drop(unsafe { Arc::from_raw(data.cast::<Parker>()) });
}

/// Drives `future` to completion on this thread. Between polls the thread
/// parks until woken, or for at most `park_timeout()` when that says so (the
/// future then gets polled again and can notice a deadline).
pub(crate) fn block_on<F: Future>(
    future: F,
    mut park_timeout: impl FnMut() -> Option<Duration>,
) -> F::Output {
    let parker = Parker::new();
    let waker = Parker::waker(&parker);
    let mut cx = Context::from_waker(&waker);
    let mut future = pin!(future);
    loop {
        if let Poll::Ready(out) = future.as_mut().poll(&mut cx) {
            return out;
        }
        parker.park(park_timeout());
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::task::Poll;

    #[test]
    fn waker_clone_wake_and_drop_keep_counts() {
        let parker = Parker::new();
        let waker = Parker::waker(&parker);
        assert_eq!(Arc::strong_count(&parker), 2);
        let clone = waker.clone();
        assert_eq!(Arc::strong_count(&parker), 3);
        clone.wake_by_ref();
        parker.park(None); // consumed at once
        clone.wake();
        assert_eq!(Arc::strong_count(&parker), 2);
        parker.park(None);
        drop(waker);
        assert_eq!(Arc::strong_count(&parker), 1);
    }

    #[test]
    fn wake_from_another_thread_unparks() {
        let parker = Parker::new();
        let waker = Parker::waker(&parker);
        let t = std::thread::spawn(move || waker.wake());
        parker.park(None);
        t.join().unwrap();
    }

    #[test]
    fn block_on_runs_a_future_woken_elsewhere() {
        let mut polls = 0;
        let mut handle = None;
        let out = block_on(
            std::future::poll_fn(|cx| {
                polls += 1;
                if polls == 1 {
                    let w = cx.waker().clone();
                    handle = Some(std::thread::spawn(move || w.wake()));
                    Poll::Pending
                } else {
                    Poll::Ready(7)
                }
            }),
            || None,
        );
        assert_eq!(out, 7);
        handle.unwrap().join().unwrap();
    }

    #[test]
    fn timed_park_returns() {
        let parker = Parker::new();
        parker.park(Some(Duration::from_millis(1)));
    }
}
