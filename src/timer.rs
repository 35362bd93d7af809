//! A one-shot wake-up at a deadline, for the crate's futures that have a
//! timeout but no runtime to keep it (`Receiver::shutdown_async`,
//! `Lanes::close`): a small thread sleeps until the deadline (by a clock the
//! caller gives), wakes the registered waker and exits. Re-arming moves the
//! deadline and the waker; dropping the `Timer` cancels it, and the thread
//! exits at once.
//!
//! State machine (under `state`'s lock): armed (a waker and a deadline) →
//! fired (the thread took the waker and woke it) or cancelled (the owner
//! dropped the timer); the thread exits in either. Re-arming a fired timer
//! is not possible: the owner starts a new one.

use std::fmt;
use std::task::Waker;
use std::time::Instant;

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
