//! The futures of a receiver's async forms: [`SubmitFuture`]
//! (`submit`), [`SendFuture`] (`send_async`) and [`ShutdownFuture`]
//! (`shutdown_async`). None needs a runtime: they wait on the crate's own
//! waiter lists (`pool::source`), and a shutdown's timeout on a `Timer`.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use super::admit::Accepted;
use super::{task_waiter, Receiver, Refused, Unit};
use crate::completion::Completion;
use crate::error::SubmitError;
use crate::pool::source::{Acquire, Acquired};
use crate::pool::worker;

/// How often a thread waiting for a source to drain looks again on its own
/// (it is also woken whenever a unit of the source comes back).
const DRAIN_RECHECK: Duration = Duration::from_millis(1);

/// Future of [`Receiver::submit`]: resolves to the message's [`Completion`]
/// once credit was available and the message was accepted.
#[must_use = "futures do nothing unless polled"]
pub struct SubmitFuture<'a, K, M, O> {
    receiver: &'a Receiver<K, M, O>,
    item: Option<(K, M)>,
    acquire: Acquire<'a>,
}

impl<'a, K, M, O> SubmitFuture<'a, K, M, O> {
    pub(super) fn new(
        receiver: &'a Receiver<K, M, O>,
        key: K,
        message: M,
        acquire: Acquire<'a>,
    ) -> Self {
        SubmitFuture {
            receiver,
            item: Some((key, message)),
            acquire,
        }
    }
}

// The message is never pinned: it is moved out by value when submitted.
impl<K, M, O> Unpin for SubmitFuture<'_, K, M, O> {}

impl<K, M, O> SubmitFuture<'_, K, M, O> {
    fn poll_submit(&mut self, cx: &mut Context<'_>, reply: bool) -> Poll<Accepted<O, M>> {
        let Some((_, _)) = self.item.as_ref() else {
            panic!("submit future polled after completion");
        };
        let r = self.receiver;
        let source = r.source.source();
        let unit = if source.is_closed() || r.core.is_closed() {
            Err(Refused::Closed)
        } else if worker::in_handler(r.core.shared().id()) {
            // From a handler: never wait.
            r.unit_now()
        } else {
            match self.acquire.poll(&task_waiter(cx.waker()), &|| r.refuses()) {
                Acquired::Unit => Ok(Unit::Own),
                Acquired::Closed => Err(Refused::Closed),
                // Woken by a release, or by a stop (see `Acquire`).
                Acquired::Waiting => return Poll::Pending,
            }
        };
        let (key, msg) = self.item.take().expect("checked");
        Poll::Ready(match unit {
            Ok(unit) => r.enqueue(key, msg, reply, unit),
            Err(refused) => Err(r.refused(refused.with(msg))),
        })
    }
}

impl<K, M, O> Future for SubmitFuture<'_, K, M, O> {
    type Output = Result<Completion<O, M>, SubmitError<M>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.get_mut()
            .poll_submit(cx, true)
            .map(|r| r.map(|(p, c)| Completion::new(c.expect("reply requested"), p)))
    }
}

impl<K, M, O> fmt::Debug for SubmitFuture<'_, K, M, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SubmitFuture")
            .field("pending", &self.item.is_some())
            .finish()
    }
}

/// Future of [`Receiver::send_async`]: resolves to the message's position.
#[must_use = "futures do nothing unless polled"]
pub struct SendFuture<'a, K, M, O> {
    inner: SubmitFuture<'a, K, M, O>,
}

impl<'a, K, M, O> SendFuture<'a, K, M, O> {
    pub(super) fn new(inner: SubmitFuture<'a, K, M, O>) -> Self {
        SendFuture { inner }
    }
}

impl<K, M, O> Future for SendFuture<'_, K, M, O> {
    type Output = Result<u64, SubmitError<M>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.get_mut()
            .inner
            .poll_submit(cx, false)
            .map(|r| r.map(|(p, _)| p))
    }
}

impl<K, M, O> fmt::Debug for SendFuture<'_, K, M, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SendFuture")
            .field("pending", &self.inner.item.is_some())
            .finish()
    }
}

/// Future of [`Receiver::shutdown_async`]: `true` once every message of the
/// source has ended, `false` once the timeout passed first.
#[must_use = "futures do nothing unless polled; the receiver is closed already"]
pub struct ShutdownFuture<'a, K, M, O> {
    receiver: &'a Receiver<K, M, O>,
    deadline: Option<Instant>,
    timer: Option<crate::timer::Timer>,
}

impl<'a, K, M, O> ShutdownFuture<'a, K, M, O> {
    pub(super) fn new(receiver: &'a Receiver<K, M, O>, deadline: Option<Instant>) -> Self {
        ShutdownFuture {
            receiver,
            deadline,
            timer: None,
        }
    }
}

impl<K, M, O> Future for ShutdownFuture<'_, K, M, O> {
    type Output = bool;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<bool> {
        let this = self.get_mut();
        let source = this.receiver.source.source();
        if source.is_drained() {
            this.timer.take();
            return Poll::Ready(true);
        }
        if let Some(d) = this.deadline {
            if Instant::now() >= d {
                this.timer.take();
                return Poll::Ready(false);
            }
        }
        if source.wait_drained(&task_waiter(cx.waker())) {
            this.timer.take();
            return Poll::Ready(true);
        }
        // A wake-up no later than the deadline, and now and then meanwhile
        // (a release wakes us too, but a follow-up holding another source's
        // unit ends without one).
        let due = Instant::now() + DRAIN_RECHECK;
        let at = this.deadline.map_or(due, |d| d.min(due));
        match &mut this.timer {
            Some(t) => t.rearm(at, cx.waker()),
            None => this.timer = crate::timer::Timer::start(at, cx.waker().clone()).ok(),
        }
        Poll::Pending
    }
}

impl<K, M, O> fmt::Debug for ShutdownFuture<'_, K, M, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ShutdownFuture")
            .field("deadline", &self.deadline)
            .finish_non_exhaustive()
    }
}
