//! Who waits for something: an async task (its `Waker`) or a plain thread
//! (parked, woken with `unpark`). One type serves both, so every handle of
//! the crate can be `.await`ed and also waited on from a blocking thread.

use std::task::Waker;

use crate::sync::thread::{self, Thread};

/// A party waiting for an event.
#[derive(Debug)]
pub(crate) enum Waiter {
    /// An async task.
    Task(Waker),
    /// A blocked thread.
    Thread(Thread),
}

impl Waiter {
    /// The current thread, for blocking waits.
    pub(crate) fn current_thread() -> Self {
        Waiter::Thread(thread::current())
    }

    /// Wakes the waiter.
    pub(crate) fn wake(self) {
        match self {
            Waiter::Task(w) => w.wake(),
            Waiter::Thread(t) => t.unpark(),
        }
    }

    /// Puts the current thread in `slot`, unless it already holds a thread
    /// (a blocking waiter registers from one thread only).
    pub(crate) fn register_thread(slot: &mut Option<Waiter>) {
        if !matches!(slot, Some(Waiter::Thread(_))) {
            *slot = Some(Waiter::current_thread());
        }
    }

    /// Replaces `slot` with a waiter for the task behind `waker`, unless it
    /// already holds one that would wake the same task.
    pub(crate) fn register_task(slot: &mut Option<Waiter>, waker: &Waker) {
        match slot {
            Some(Waiter::Task(w)) if w.will_wake(waker) => {}
            _ => *slot = Some(Waiter::Task(waker.clone())),
        }
    }
}
