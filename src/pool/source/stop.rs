//! Stops: whether a source still takes messages, sending its waiting
//! submitters away, and handing its messages over to the thread that
//! stops it.
//!
//! # The protocol
//!
//! `Fixed::flags` holds `CLOSED` (no new message is accepted) and
//! `STOPPED` (a `shutdown_now`: its messages are handed back instead of
//! started); flags are only ever set.
//!
//! **Sending waiters away.** A stop that refuses the source's messages —
//! its own ([`Source::close`], [`Source::stop`]), its dispatcher's or the
//! executor's — sets its flag, fences (SeqCst) and reads `WAITERS`; if it
//! is set, it pops and wakes every waiter under the list's lock
//! ([`Source::release_waiters`]). A waiter ([`Acquire`](super::Acquire))
//! registers (sets `WAITERS`), fences and looks at the flags. Either the
//! stop sees `WAITERS` and wakes it, or the waiter sees the flag and
//! leaves with `Closed(its message)`, without a unit. `WAITERS` is cleared
//! only when the list is empty, so a waiter still registered keeps it set;
//! one popped was woken. A waiter that renews its registration needs no
//! second look: it finds itself still in the list, so the wake of a stop
//! that saw its first registration is still to come.
//!
//! **Handing over.** A thread in `shutdown_now` counts itself in
//! `stoppers` before it sets `STOPPED`. A worker that meets a message of
//! a stopped source calls [`Source::hand_over`]: under the `handover`
//! list's lock, while a stopper is counted, the rejection is queued for it
//! (and the drainers woken: the stopper waits for the source to drain);
//! with none counted (a stop called from a worker does not wait), the
//! worker rejects the message itself. The last stopper to leave takes the
//! list under the same lock, so nothing is left behind.

use super::{Source, WAITERS};
use crate::sync::atomic::{fence, Ordering::*};

pub(super) const CLOSED: u8 = 1;
pub(super) const STOPPED: u8 = 2;

/// A rejection a worker leaves for the thread stopping the source.
pub(crate) type Handover = Box<dyn FnOnce() + Send>;

impl Source {
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
    /// with `Closed(its message)` (see the module docs). The caller keeps
    /// the source alive.
    pub(crate) fn release_waiters(&self) {
        fence(SeqCst);
        if self.has_waiters() {
            self.wake_all_waiters();
        }
    }

    /// Whether a submitter is registered as a waiter. Read by a stop after
    /// its flag and a SeqCst fence (see the module docs).
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

    /// Whether the source refuses new messages.
    #[inline]
    pub(crate) fn is_closed(&self) -> bool {
        self.fixed.flags.load(SeqCst) & CLOSED != 0
    }

    /// Whether a `shutdown_now` stopped the source. SeqCst: a runner suspending a future reads it after its own state
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

#[cfg(all(test, not(loom)))]
mod tests {
    use super::super::tests::source;
    use super::super::{Acquire, Acquired};
    use super::*;
    use crate::sync::thread;
    use crate::waiter::Waiter;

    #[test]
    fn close_wakes_a_blocked_acquirer_which_leaves_closed_without_a_unit() {
        let h = source(1, 1024);
        assert!(h.source().try_acquire());
        let h2 = h.clone();
        let t = std::thread::spawn(move || {
            let s = h2.source();
            let mut a = Acquire::new(s, || {});
            loop {
                match a.poll(&Waiter::register_thread, &|| s.is_closed()) {
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
}
