//! A future that returns `Pending` once, waking itself first, then is
//! ready: a handler's or a kernel's `.await` point that always suspends.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// Returns `Pending` once (waking itself), then `Ready`.
pub struct YieldOnce(pub bool);

impl Future for YieldOnce {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.0 {
            Poll::Ready(())
        } else {
            self.0 = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }
}
