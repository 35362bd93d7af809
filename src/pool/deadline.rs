//! Deadlines: a message that carries one ([`Timed`]) and is not run once
//! it passed.
//!
//! [`with_deadlines`] wraps any [`Handler`] of `M` as a handler of
//! `Timed<M>`. When the dispatcher starts a message (just before its first
//! poll), the wrapper compares the message's deadline — its own
//! ([`Timed::until`], [`Timed::within`]), or the wrapper's time-to-live
//! counted from when the `Timed` was made ([`Deadlined::ttl`]), whichever
//! comes first — with the clock. Past it, the inner handler is not called:
//! the message ends [`TaskError::Expired`], handed to the
//! [expiry hook](Deadlined::on_expire) if there is one, else back through
//! its completion. An expired message counts as finished for the commit
//! point. A message that started is never interrupted by its deadline.
//!
//! Nothing of this is paid by a handler that is not wrapped: the check is
//! the wrapper's own `call`, and the deadline travels in the message.
//!
//! # State machine (one message's future)
//!
//! ```text
//!   call: deadline passed ---------> Expired(msg or none) --poll--> Done: Expired
//!   call: in time ---> Running(inner future) --poll*--> Done: the inner outcome
//! ```
//!
//! `Running` forwards every poll, and a force stop's `reclaim`, to the
//! inner handler, re-wrapping a message it hands back (`Rejected`,
//! `DeadLettered`) with its deadline. Owned by the future alone.

use std::fmt;
use std::marker::PhantomData;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use crate::completion::Outcome;
use crate::error::TaskError;
use crate::pool::handler::Handler;

/// The expiry hook's type.
type ExpireHook<K, M> = dyn Fn(&K, M) + Send + Sync + 'static;

/// A message with a deadline, for a handler wrapped by
/// [`with_deadlines`]. It remembers when it was made, from which the
/// handler's [time-to-live](Deadlined::ttl) counts.
///
/// ```
/// use std::time::{Duration, Instant};
/// use keyed_executor::handler::Timed;
///
/// let plain = Timed::new("no deadline of its own");
/// assert_eq!(plain.deadline(), None);
/// let soon = Timed::within("in 5 s or never", Duration::from_secs(5));
/// assert!(soon.deadline().unwrap() > Instant::now());
/// assert_eq!(soon.into_inner(), "in 5 s or never");
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Timed<M> {
    message: M,
    made: Instant,
    deadline: Option<Instant>,
}

impl<M> Timed<M> {
    /// `message` without a deadline of its own (the handler's
    /// [`ttl`](Deadlined::ttl), if any, counts from now).
    pub fn new(message: M) -> Self {
        Timed {
            message,
            made: Instant::now(),
            deadline: None,
        }
    }

    /// `message`, not to be started after `deadline`.
    pub fn until(message: M, deadline: Instant) -> Self {
        Timed {
            message,
            made: Instant::now(),
            deadline: Some(deadline),
        }
    }

    /// `message`, not to be started once `within` has passed from now (a
    /// duration too long for the clock means no deadline).
    pub fn within(message: M, within: Duration) -> Self {
        let made = Instant::now();
        Timed {
            message,
            made,
            deadline: made.checked_add(within),
        }
    }

    /// Its own deadline, if it has one.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }

    /// The message.
    pub fn get_ref(&self) -> &M {
        &self.message
    }

    /// The message, unwrapped.
    pub fn into_inner(self) -> M {
        self.message
    }

    /// The earlier of its own deadline and `ttl` after it was made.
    fn effective(&self, ttl: Option<Duration>) -> Option<Instant> {
        let by_ttl = ttl.and_then(|ttl| self.made.checked_add(ttl));
        match (self.deadline, by_ttl) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// `message` with this one's deadline (to hand it back as it came).
    fn rewrap<N>(made: Instant, deadline: Option<Instant>, message: N) -> Timed<N> {
        Timed {
            message,
            made,
            deadline,
        }
    }
}

/// A handler of [`Timed`] messages that runs `H` for those still in time
/// (see [`with_deadlines`]).
pub struct Deadlined<K, M, H> {
    inner: H,
    ttl: Option<Duration>,
    on_expire: Option<Box<ExpireHook<K, M>>>,
    _types: PhantomData<fn(K, M)>,
}

impl<K, M, H: fmt::Debug> fmt::Debug for Deadlined<K, M, H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Deadlined")
            .field("inner", &self.inner)
            .field("ttl", &self.ttl)
            .field("on_expire", &self.on_expire.is_some())
            .finish()
    }
}

/// Wraps `inner`, a handler of `M`, as a handler of [`Timed<M>`]: a
/// message whose deadline passed before it started is not run, and ends
/// [`TaskError::Expired`] (through its completion, or the
/// [expiry hook](Deadlined::on_expire)); it counts as finished for the
/// commit point. A started message is never interrupted.
///
/// ```
/// use std::time::{Duration, Instant};
/// use keyed_executor::handler::{self, Timed};
/// use keyed_executor::{KeyedExecutor, TaskError};
///
/// let executor = KeyedExecutor::builder().workers(1).build()?;
/// let dispatcher = executor.dispatcher(
///     handler::with_deadlines(handler::from_fn(|_key: &u64, n: u32| n * 2))
///         .ttl(Duration::from_secs(60)),
/// );
/// let receiver = dispatcher.receiver(16)?;
/// assert_eq!(receiver.submit_blocking(1, Timed::new(21))?.wait()?, 42);
/// let late = Timed::until(5, Instant::now() - Duration::from_millis(1));
/// match receiver.submit_blocking(1, late)?.wait() {
///     Err(TaskError::Expired { message: Some(m) }) => assert_eq!(m.into_inner(), 5),
///     other => panic!("{other:?}"),
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn with_deadlines<K, M, H>(inner: H) -> Deadlined<K, M, H>
where
    H: Handler<K, M>,
{
    Deadlined {
        inner,
        ttl: None,
        on_expire: None,
        _types: PhantomData,
    }
}

impl<K, M, H> Deadlined<K, M, H> {
    /// A time-to-live for every message: one not started `ttl` after its
    /// [`Timed`] was made (before it was submitted, so the wait for credit
    /// counts) expires, as does one past its own deadline, whichever comes
    /// first.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.ttl = Some(ttl);
        self
    }

    /// Sets the hook that gets each expired message (with its key), on the
    /// worker, outside every lock of the crate, in `catch_unwind`: for a
    /// message sent with `send`, which has no completion to hand it back
    /// through. Its completion, if it has one, then says
    /// [`Expired`](TaskError::Expired) without the message.
    pub fn on_expire(mut self, hook: impl Fn(&K, M) + Send + Sync + 'static) -> Self {
        self.on_expire = Some(Box::new(hook));
        self
    }
}

/// Where a message of a [`Deadlined`] handler stands.
enum Stage<M, Fut> {
    /// Expired before it started: the message, unless the hook took it.
    Expired(Option<M>),
    /// In time: the inner handler's future (structurally pinned).
    Running(Fut),
    Done,
}

/// The future of one message of a [`Deadlined`] handler.
pub struct DeadlineFuture<K, M, H: Handler<K, M>> {
    stage: Stage<M, H::Future>,
    made: Instant,
    deadline: Option<Instant>,
    _key: PhantomData<fn(K)>,
}

impl<K, M, H: Handler<K, M>> DeadlineFuture<K, M, H> {
    /// The stage, pinned.
    fn stage(self: Pin<&mut Self>) -> Pin<&mut Stage<M, H::Future>> {
        // SAFETY: `stage` is structurally pinned: it is never moved out
        // while pinned, only overwritten in place (`Pin::set`), and the type
        // has no `Drop` of its own and no `Unpin` impl beyond the auto one.
        unsafe { self.map_unchecked_mut(|s| &mut s.stage) }
    }

    fn poll_settle(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Outcome<H::Output, Timed<M>>> {
        let (made, deadline) = (self.made, self.deadline);
        let wrap = move |m: M| Timed::<M>::rewrap(made, deadline, m);
        let mut stage = self.as_mut().stage();
        // SAFETY: only the `Running` variant's future is used pinned (and
        // re-pinned at once); the `Expired` message is moved out only after
        // checking that the stage holds no future.
        match unsafe { stage.as_mut().get_unchecked_mut() } {
            Stage::Running(fut) => {
                // SAFETY: the inner future lives in the pinned stage and is
                // dropped in place.
                let fut = unsafe { Pin::new_unchecked(fut) };
                let outcome = match H::poll_outcome(fut, cx) {
                    Poll::Pending => return Poll::Pending,
                    Poll::Ready(outcome) => outcome,
                };
                stage.set(Stage::Done);
                Poll::Ready(outcome.map_err(|e| e.map_message(wrap)))
            }
            Stage::Expired(message) => {
                let message = message.take();
                stage.set(Stage::Done);
                Poll::Ready(Err(TaskError::Expired {
                    message: message.map(wrap),
                }))
            }
            Stage::Done => panic!("a deadline handler's future polled after it ended"),
        }
    }
}

impl<K, M, H: Handler<K, M>> std::future::Future for DeadlineFuture<K, M, H> {
    type Output = H::Output;

    /// Polled by hand (not by a dispatcher, which uses
    /// [`Handler::poll_outcome`]), an expired message has no output: it
    /// panics.
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<H::Output> {
        self.poll_settle(cx).map(|outcome| match outcome {
            Ok(out) => out,
            Err(e) => panic!("{e}"),
        })
    }
}

impl<K, M, H: Handler<K, M>> fmt::Debug for DeadlineFuture<K, M, H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let stage = match self.stage {
            Stage::Expired(_) => "Expired",
            Stage::Running(_) => "Running",
            Stage::Done => "Done",
        };
        f.debug_struct("DeadlineFuture")
            .field("stage", &stage)
            .field("deadline", &self.deadline)
            .finish()
    }
}

impl<K, M, H> Handler<K, Timed<M>> for Deadlined<K, M, H>
where
    K: Send + Sync + 'static,
    M: Send + 'static,
    H: Handler<K, M>,
{
    type Output = H::Output;
    type Future = DeadlineFuture<K, M, H>;

    fn call(&self, key: &K, message: Timed<M>) -> Self::Future {
        self.call_at(key, message, 0)
    }

    fn call_at(&self, key: &K, message: Timed<M>, position: u64) -> Self::Future {
        let deadline = message.effective(self.ttl);
        let made = message.made;
        let expired = deadline.is_some_and(|d| Instant::now() >= d);
        let stage = if expired {
            let message = message.message;
            match &self.on_expire {
                Some(hook) => {
                    let _ = catch_unwind(AssertUnwindSafe(|| hook(key, message)));
                    Stage::Expired(None)
                }
                None => Stage::Expired(Some(message)),
            }
        } else {
            Stage::Running(match deadline {
                Some(deadline) => self
                    .inner
                    .call_until(key, message.message, position, deadline),
                None => self.inner.call_at(key, message.message, position),
            })
        };
        DeadlineFuture {
            stage,
            made,
            deadline: message.deadline,
            _key: PhantomData,
        }
    }

    fn poll_outcome(
        future: Pin<&mut Self::Future>,
        cx: &mut Context<'_>,
    ) -> Poll<Outcome<H::Output, Timed<M>>> {
        future.poll_settle(cx)
    }

    fn reclaim(future: Pin<&mut Self::Future>) -> Option<Timed<M>> {
        let (made, deadline) = (future.made, future.deadline);
        let mut future = future;
        let stage = future.as_mut().stage();
        // SAFETY: the inner future, if any, is only used pinned.
        match unsafe { stage.get_unchecked_mut() } {
            Stage::Running(fut) => {
                // SAFETY: it lives in the pinned stage.
                let fut = unsafe { Pin::new_unchecked(fut) };
                H::reclaim(fut).map(|m| Timed::<M>::rewrap(made, deadline, m))
            }
            // Not pending: a force stop never finds it (it ends in its
            // first poll).
            Stage::Expired(_) | Stage::Done => None,
        }
    }
}
