//! [`Close`]: stop taking commands, finish the ones taken.
//!
//! Steps, in order:
//!
//! 1. `Lanes::close` sets the closed flag at once (one `fetch_or` on the
//!    counters word, see `accounts.rs`): from then on every new command is
//!    refused with `Closed(command)`. A command racing the flag either sees it
//!    and backs out, or was counted first and is waited for.
//! 2. Each poll registers the closer's waker *before* reading the count, so
//!    the release that brings it to zero always finds a waker to wake.
//! 3. Each poll drives the orphaned batches: a batch whose callers all went
//!    away keeps running to its end, and with no new callers coming, `close`
//!    is the one left to poll it (it becomes the lane's `Closer` driver). A
//!    batch orphaned later wakes the closer too.
//! 4. Ready(`true`) when no command is in flight; Ready(`false`) once the
//!    deadline has passed, after logging the busy lanes
//!    ([`LanesEvent::CloseTimedOut`](super::LanesEvent::CloseTimedOut); also
//!    [`Lanes::busy_keys`](super::Lanes::busy_keys)). Either way it hands back
//!    the driving of any batch it still drives (to a caller that came in
//!    while the flag was being set, or to nobody).
//!
//! The async form has no runtime timer to rely on: on its first `Pending` it
//! starts one small timer thread that sleeps until the deadline (by the
//! `Lanes`' clock), wakes the close future and exits; dropping or finishing
//! the close future cancels it. `close_blocking` parks its own thread
//! instead and needs no timer.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};
use std::time::Instant;

use super::event::LanesEvent;
use super::kernel::Kernel;
use super::lane::{Driver, Lane};
use super::shared::{Driven, Shared};
use crate::sync::Arc;
use crate::timer::Timer;

/// The future of [`Lanes::close`](super::Lanes::close): `true` once every
/// command taken has finished, `false` if the timeout passed first.
#[must_use = "futures do nothing unless polled; the `Lanes` is closed already"]
pub struct Close<K: Kernel> {
    shared: Arc<Shared<K>>,
    deadline: Option<Instant>,
    use_timer: bool,
    timer: Option<Timer>,
    timer_failed: bool,
    driving: Vec<Arc<Lane<K>>>,
    result: Option<bool>,
}

impl<K: Kernel> Unpin for Close<K> {}

impl<K: Kernel> Close<K> {
    pub(crate) fn new(shared: Arc<Shared<K>>, deadline: Option<Instant>, use_timer: bool) -> Self {
        Close {
            shared,
            deadline,
            use_timer,
            timer: None,
            timer_failed: false,
            driving: Vec::new(),
            result: None,
        }
    }

    /// Drives what nobody else drives: batches whose callers all left.
    fn drive_orphans(&mut self, cx: &mut Context<'_>) {
        for lane in self.shared.lanes() {
            while let Some(future) = lane.closer_take() {
                if !self.driving.iter().any(|l| Arc::ptr_eq(l, &lane)) {
                    self.driving.push(Arc::clone(&lane));
                }
                match self.shared.drive(&lane, future, cx, Driver::Closer) {
                    Driven::Pending => break,
                    Driven::Finished => {}
                }
            }
        }
    }

    fn release(&mut self) {
        for lane in std::mem::take(&mut self.driving) {
            self.shared.closer_release(&lane);
        }
        // Dropping the timer cancels it.
        self.timer.take();
    }

    fn ensure_timer(&mut self, deadline: Instant, waker: &Waker) {
        if !self.use_timer || self.timer_failed {
            return;
        }
        if let Some(timer) = &self.timer {
            return timer.set_waker(waker);
        }
        let shared = Arc::clone(&self.shared);
        let clock: crate::timer::Clock = Box::new(move || shared.now());
        match Timer::start_with(deadline, waker.clone(), clock, "lanes-close-timer") {
            Ok(timer) => self.timer = Some(timer),
            Err(reason) => {
                self.timer_failed = true;
                self.shared
                    .emit(&LanesEvent::TimerUnavailable { reason: &reason });
            }
        }
    }
}

impl<K: Kernel> Future for Close<K> {
    type Output = bool;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<bool> {
        let this = self.get_mut();
        if let Some(result) = this.result {
            return Poll::Ready(result);
        }
        this.shared.register_closer(cx.waker());
        this.drive_orphans(cx);
        if this.shared.accounts.in_flight() == 0 {
            this.release();
            this.result = Some(true);
            return Poll::Ready(true);
        }
        if let Some(deadline) = this.deadline {
            if this.shared.now() >= deadline {
                this.release();
                let busy = this.shared.busy_keys();
                this.shared.emit(&LanesEvent::CloseTimedOut {
                    busy: &busy,
                    in_flight: this.shared.accounts.in_flight(),
                });
                this.result = Some(false);
                return Poll::Ready(false);
            }
            this.ensure_timer(deadline, cx.waker());
        }
        Poll::Pending
    }
}

impl<K: Kernel> Drop for Close<K> {
    fn drop(&mut self) {
        self.release();
    }
}

impl<K: Kernel> fmt::Debug for Close<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Close")
            .field("deadline", &self.deadline)
            .field("result", &self.result)
            .finish_non_exhaustive()
    }
}
