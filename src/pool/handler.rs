//! Handlers: what a dispatcher runs for each message.
//!
//! One trait, [`Handler`], covers both kinds. Its `call` returns a future; a
//! sync handler ([`from_fn`]) returns [`std::future::Ready`], which completes
//! on its first poll and is never boxed. An async handler ([`from_async_fn`])
//! returns its closure's future type as is: the mailbox stores it inline
//! (its type is known), so there is no per-message `Box<dyn Future>`.

use std::fmt;
use std::future::{ready, Future, Ready};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use crate::completion::Outcome;

pub use crate::pool::deadline::{with_deadlines, DeadlineFuture, Deadlined, Timed};
pub use crate::pool::poison::{
    retrying, retrying_async, AsyncKind, DeadLetter, LastFailure, RetryAsyncFuture, RetryFuture,
    Retrying, SyncKind,
};

/// Runs one message of a key. The returned future is polled on the key's
/// worker with the crate's own waker; the key's next message starts only
/// after it completes, so per-key order holds across `.await`.
///
/// Implement it directly for a handler with state, or use [`from_fn`] /
/// [`from_async_fn`] for a closure.
///
/// ```
/// use std::future::{ready, Ready};
/// use keyed_executor::handler::Handler;
///
/// struct Add(u64);
///
/// impl Handler<String, u64> for Add {
///     type Output = u64;
///     type Future = Ready<u64>;
///     fn call(&self, _key: &String, n: u64) -> Ready<u64> {
///         ready(n + self.0)
///     }
/// }
/// ```
pub trait Handler<K, M>: Send + Sync + 'static {
    /// What a message produces.
    type Output: Send + 'static;
    /// The work of one message. `Send` because a force stop may drop a
    /// suspended future on the stopping thread.
    type Future: Future<Output = Self::Output> + Send + 'static;

    /// Starts the work of `message` for `key`.
    fn call(&self, key: &K, message: M) -> Self::Future;

    /// Starts the work of `message` for `key`, knowing its `position` in
    /// the receiver that accepted it (see
    /// [`Receiver::committable`](crate::Receiver::committable)). The
    /// dispatcher calls this one; the provided version ignores the
    /// position and calls [`call`](Self::call). The retrying handler
    /// ([`retrying`]) overrides it to seed its jitter and to tell its
    /// dead-letter hook where the message stood.
    #[inline(always)]
    fn call_at(&self, key: &K, message: M, _position: u64) -> Self::Future {
        self.call(key, message)
    }

    /// Starts the work of a message that must not *start* an attempt after
    /// `deadline` (a [`Timed`] message in time, run by [`with_deadlines`]).
    /// The provided version ignores the deadline and calls
    /// [`call_at`](Self::call_at); the retrying handler ([`retrying`])
    /// overrides it: a retry whose next attempt would start past the
    /// deadline ends [`Expired`](crate::TaskError::Expired) instead.
    #[inline(always)]
    fn call_until(&self, key: &K, message: M, position: u64, _deadline: Instant) -> Self::Future {
        self.call_at(key, message, position)
    }

    /// Starts the work of `message` for `key` (at `position`, as
    /// [`call_at`](Self::call_at)) and, if that work is done at once,
    /// returns its outcome instead of a future: the dispatcher then skips
    /// storing and polling a future. The provided version returns the
    /// future of [`call_at`](Self::call_at) (`Err`), which the dispatcher
    /// polls; [`from_fn`] overrides it with the closure's output. Override
    /// it for a handler whose future is always ready: the outcome must be
    /// what polling that future would give.
    #[inline(always)]
    fn call_now(
        &self,
        key: &K,
        message: M,
        position: u64,
    ) -> Result<Outcome<Self::Output, M>, Self::Future> {
        Err(self.call_at(key, message, position))
    }

    /// Polls a future this handler returned, as the dispatcher does: what
    /// it is ready with is the message's outcome, which a handler may make
    /// an error of the crate's own ([`TaskError`](crate::TaskError), e.g.
    /// `DeadLettered`). The provided version polls the future and wraps
    /// its output in `Ok`; it compiles to the plain poll.
    #[inline(always)]
    fn poll_outcome(
        future: Pin<&mut Self::Future>,
        cx: &mut Context<'_>,
    ) -> Poll<Outcome<Self::Output, M>> {
        future.poll(cx).map(Ok)
    }

    /// Called by a force stop (`shutdown_now` of the executor, the
    /// dispatcher or the receiver) on a pending future, just before it is
    /// dropped: a future that has not begun the message's work in a way
    /// that must not be repeated (e.g. one waiting for its next attempt)
    /// may hand the message back, and it is then handed back as
    /// [`Rejected`](crate::TaskError::Rejected) like a queued message,
    /// instead of ending [`Cancelled`](crate::TaskError::Cancelled). The
    /// provided version hands nothing back.
    #[inline(always)]
    fn reclaim(_future: Pin<&mut Self::Future>) -> Option<M> {
        None
    }
}

/// A sync handler: see [`from_fn`].
#[derive(Clone)]
pub struct FromFn<F>(F);

/// An async handler: see [`from_async_fn`].
#[derive(Clone)]
pub struct FromAsyncFn<F>(F);

impl<F> fmt::Debug for FromFn<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FromFn(..)")
    }
}

impl<F> fmt::Debug for FromAsyncFn<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("FromAsyncFn(..)")
    }
}

/// Wraps a sync closure `Fn(&K, M) -> O` as a [`Handler`]. Its result is
/// handed back through a [`std::future::Ready`], so nothing is boxed.
///
/// ```
/// use keyed_executor::{handler, KeyedExecutor};
///
/// let executor = KeyedExecutor::builder().workers(1).build()?;
/// let dispatcher = executor.dispatcher(handler::from_fn(|key: &u64, n: u64| key + n));
/// let receiver = dispatcher.receiver(16)?;
/// let done = receiver.submit_blocking(40, 2)?;
/// assert_eq!(done.wait()?, 42);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn from_fn<K, M, O, F>(f: F) -> FromFn<F>
where
    F: Fn(&K, M) -> O + Send + Sync + 'static,
    O: Send + 'static,
{
    FromFn(f)
}

/// Wraps an async closure `Fn(K, M) -> impl Future<Output = O>` as a
/// [`Handler`]. The key is cloned for each message (the future must own it).
/// While the future is pending it holds no worker; the key's next message
/// waits for it to complete.
///
/// ```
/// use keyed_executor::{handler, KeyedExecutor};
///
/// let executor = KeyedExecutor::builder().workers(1).build()?;
/// let dispatcher = executor.dispatcher(handler::from_async_fn(|key: u64, n: u64| async move {
///     // e.g. `store.append(key, n).await`
///     key * n
/// }));
/// let receiver = dispatcher.receiver(16)?;
/// assert_eq!(receiver.submit_blocking(6, 7)?.wait()?, 42);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn from_async_fn<K, M, Fut, F>(f: F) -> FromAsyncFn<F>
where
    K: Clone,
    F: Fn(K, M) -> Fut + Send + Sync + 'static,
    Fut: Future + Send + 'static,
    Fut::Output: Send + 'static,
{
    FromAsyncFn(f)
}

impl<K, M, O, F> Handler<K, M> for FromFn<F>
where
    F: Fn(&K, M) -> O + Send + Sync + 'static,
    O: Send + 'static,
{
    type Output = O;
    type Future = Ready<O>;

    #[inline]
    fn call(&self, key: &K, message: M) -> Ready<O> {
        ready((self.0)(key, message))
    }

    #[inline]
    fn call_now(&self, key: &K, message: M, _position: u64) -> Result<Outcome<O, M>, Ready<O>> {
        Ok(Ok((self.0)(key, message)))
    }
}

impl<K, M, Fut, F> Handler<K, M> for FromAsyncFn<F>
where
    K: Clone,
    F: Fn(K, M) -> Fut + Send + Sync + 'static,
    Fut: Future + Send + 'static,
    Fut::Output: Send + 'static,
{
    type Output = Fut::Output;
    type Future = Fut;

    #[inline]
    fn call(&self, key: &K, message: M) -> Fut {
        (self.0)(key.clone(), message)
    }
}
