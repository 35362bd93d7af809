//! Messages that fail: a handler that runs a message's attempts under a
//! [`RetryPolicy`], waits between them without holding a worker, and hands
//! a message it gives up on to a dead-letter hook.
//!
//! [`retrying`] wraps a sync closure `Fn(&K, &M) -> Result<O, E>` (the
//! message is borrowed, so it survives a failed attempt: no `Clone`
//! bound); [`retrying_async`] an async one, `Fn(K, M) -> impl Future<Output
//! = Result<O, (M, E)>>`, whose future hands the message back with the
//! error. Both are ordinary [`Handler`]s: the dispatcher runs their future
//! as any other, so what holds for a pending future holds for a message
//! waiting for its next attempt — it holds its key (the key's later
//! messages wait behind it: per-key order), its credit unit, and no worker
//! (the wait is a [`Sleep`] on the handler's [`Timers`], one thread
//! started at the first backoff, which wakes the mailbox).
//!
//! # State machine (one message's future)
//!
//! ```text
//!   Ready(msg) --poll--> attempt n --Ok(out)----------------------------> Done: Ok(out)
//!        ^                  |  \
//!        |  sleep elapsed   |   +--failed, policy says stop--> Done: DeadLettered
//!        |                  v                                  (hook gets the message)
//!        +---------- Backoff(msg, sleep)
//!                           |
//!        force stop (reclaim: the message is taken back) --> Done: Rejected(msg)
//! ```
//!
//! - `Ready`: the message is held, no attempt is running (before the
//!   first poll, and after a backoff elapsed).
//! - `Running` (async form only): attempt `n`'s future is pinned in place
//!   and owns the message; it hands it back with its error.
//! - `Backoff`: the message is held, a `Sleep` is registered with the
//!   timers. The only state in which [`Handler::reclaim`] hands the
//!   message back (a force stop), so a message is either run to an end or
//!   handed back unstarted-again, never both.
//! - `Done`: the outcome was returned (or the message reclaimed).
//!
//! The sync form never rests in `Running`: an attempt runs inside one poll.
//! Everything is owned by the future: one party (whoever holds the
//! mailbox's turn, or a force stop that claimed it) touches it at a time,
//! so there is no lock or atomic here besides the timers' own.
//!
//! # Outcomes
//!
//! The future's outcome goes through [`Handler::poll_outcome`]: `Ok(out)`,
//! or [`TaskError::DeadLettered`] when the policy gave up (attempts ran out,
//! or a failure it does not retry). A dead letter counts as finished for
//! the commit point. A panic in the sync form is a failed attempt (retried
//! if the policy [`retries_panics`](RetryPolicy::retries_panics)); in the
//! async form the panicking future took the message with it, so the
//! message ends [`Panicked`](TaskError::Panicked) as with any handler.

use std::fmt;
use std::future::Future;
use std::marker::PhantomData;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use crate::completion::Outcome;
use crate::error::{Panic, TaskError};
use crate::pool::handler::Handler;
use crate::pool::retry::{Failure, RetryDecision, RetryPolicy};
use crate::sync::Arc;
use crate::timer::{Sleep, Timers};
use crate::trace;

/// The name of the thread a retrying handler's backoffs wait on.
const RETRY_TIMERS_NAME: &str = "keyed-retry";

/// The dead-letter hook's type.
type DeadLetterHook<K, M, E> = dyn Fn(DeadLetter<K, M, E>) + Send + Sync + 'static;

/// How the last attempt of a dead-lettered message failed.
pub enum LastFailure<E> {
    /// It returned this error.
    Error(E),
    /// It panicked (sync handlers only: see [`retrying`]).
    Panicked(Panic),
}

impl<E> LastFailure<E> {
    /// The error, unless the attempt panicked.
    pub fn into_error(self) -> Option<E> {
        match self {
            LastFailure::Error(e) => Some(e),
            LastFailure::Panicked(_) => None,
        }
    }

    /// The attempt panicked.
    pub fn is_panic(&self) -> bool {
        matches!(self, LastFailure::Panicked(_))
    }

    fn as_failure(&self) -> Failure<'_, E> {
        match self {
            LastFailure::Error(e) => Failure::Error(e),
            LastFailure::Panicked(p) => Failure::Panicked(p),
        }
    }
}

impl<E: fmt::Display> fmt::Display for LastFailure<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LastFailure::Error(e) => e.fmt(f),
            LastFailure::Panicked(p) => write!(f, "panicked: {}", p.message()),
        }
    }
}

impl<E: fmt::Debug> fmt::Debug for LastFailure<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LastFailure::Error(e) => f.debug_tuple("Error").field(e).finish(),
            LastFailure::Panicked(p) => f.debug_tuple("Panicked").field(p).finish(),
        }
    }
}

/// A message a retrying handler gave up on, as its dead-letter hook gets
/// it ([`Retrying::on_dead_letter`]).
#[non_exhaustive]
pub struct DeadLetter<K, M, E> {
    /// The message's key.
    pub key: K,
    /// The message itself, handed over.
    pub message: M,
    /// How its last attempt failed.
    pub failure: LastFailure<E>,
    /// How many attempts it had (the last one included).
    pub attempts: u32,
    /// Its position in the receiver that accepted it (see
    /// [`Receiver::committable`](crate::Receiver::committable)): the
    /// commit point moves past it once it is dead-lettered.
    pub position: u64,
}

impl<K: fmt::Debug, M, E: fmt::Debug> fmt::Debug for DeadLetter<K, M, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeadLetter")
            .field("key", &self.key)
            .field("failure", &self.failure)
            .field("attempts", &self.attempts)
            .field("position", &self.position)
            .finish_non_exhaustive()
    }
}

/// What the futures of one retrying handler share.
struct Core<K, M, E, F> {
    f: F,
    policy: RetryPolicy<E>,
    timers: Timers,
    on_dead_letter: Option<Box<DeadLetterHook<K, M, E>>>,
}

impl<K, M, E: fmt::Display, F> Core<K, M, E, F> {
    /// Gives `message` up: the hook gets it (in `catch_unwind`; no lock of
    /// the crate is held during a poll), or, without a hook, the completion
    /// hands it back. `expired`: it gives up because its next attempt would
    /// start past its deadline; it ends `Expired` (the hook still gets it:
    /// it failed, and will not be tried again).
    #[cold]
    fn dead_letter(
        &self,
        key: K,
        message: M,
        failure: LastFailure<E>,
        (attempts, position): (u32, u64),
        expired: bool,
    ) -> TaskError<M> {
        let error = failure.to_string();
        if !expired {
            trace::dead_lettered(attempts, position, &error);
        }
        let message = match &self.on_dead_letter {
            Some(hook) => {
                let letter = DeadLetter {
                    key,
                    message,
                    failure,
                    attempts,
                    position,
                };
                let _ = catch_unwind(AssertUnwindSafe(|| hook(letter)));
                None
            }
            None => Some(message),
        };
        if expired {
            TaskError::Expired { message }
        } else {
            TaskError::DeadLettered {
                attempts,
                error,
                message,
            }
        }
    }

    /// After attempt `attempt` failed: the sleep before the next one, or
    /// `Err(expired)` to give up (`expired`: the next attempt would start
    /// at or past `deadline`).
    fn next(
        &self,
        attempt: u32,
        failure: Failure<'_, E>,
        position: u64,
        deadline: Option<Instant>,
    ) -> Result<Sleep, bool> {
        match self.policy.decide(attempt, failure, position) {
            RetryDecision::Retry(delay) => {
                if let Some(deadline) = deadline {
                    if Instant::now()
                        .checked_add(delay)
                        .map_or(true, |at| at >= deadline)
                    {
                        return Err(true);
                    }
                }
                crate::pool::worker::WorkerCx::count_retry();
                Ok(self.timers.sleep(delay))
            }
            RetryDecision::Exhausted | RetryDecision::NotRetryable => Err(false),
        }
    }
}

/// A handler that runs each message's attempts under a [`RetryPolicy`]
/// (see [`retrying`] and [`retrying_async`]).
pub struct Retrying<K, M, E, F, Kind> {
    core: Arc<Core<K, M, E, F>>,
    _kind: PhantomData<fn() -> Kind>,
}

/// [`Retrying`]'s kind for a sync closure ([`retrying`]): a marker type.
pub enum SyncKind {}

/// [`Retrying`]'s kind for an async closure ([`retrying_async`]): a marker
/// type.
pub enum AsyncKind {}

impl<K, M, E, F, Kind> fmt::Debug for Retrying<K, M, E, F, Kind> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Retrying")
            .field("max_attempts", &self.core.policy.max_attempts())
            .field("on_dead_letter", &self.core.on_dead_letter.is_some())
            .finish()
    }
}

impl<K, M, E, F, Kind> Retrying<K, M, E, F, Kind> {
    fn new(policy: RetryPolicy<E>, f: F) -> Self {
        Retrying {
            core: Arc::new(Core {
                f,
                policy,
                timers: Timers::with_name(RETRY_TIMERS_NAME),
                on_dead_letter: None,
            }),
            _kind: PhantomData,
        }
    }

    /// Sets the hook that gets each message the policy gave up on, with its
    /// key, its last failure, its attempts and its position (a
    /// [`DeadLetter`]): to write it to a dead-letter queue, say. It runs on
    /// the worker, outside every lock of the crate, in `catch_unwind` (a
    /// panic in it is contained; the message is then dropped). The
    /// message's completion says
    /// [`DeadLettered`](TaskError::DeadLettered) either way; without a
    /// hook, the message is handed back in it.
    pub fn on_dead_letter(
        self,
        hook: impl Fn(DeadLetter<K, M, E>) + Send + Sync + 'static,
    ) -> Self {
        let core = match Arc::try_unwrap(self.core) {
            Ok(core) => core,
            Err(_) => unreachable!("a handler being built is not shared yet"),
        };
        Retrying {
            core: Arc::new(Core {
                on_dead_letter: Some(Box::new(hook)),
                ..core
            }),
            _kind: PhantomData,
        }
    }
}

/// Runs a sync closure `Fn(&K, &M) -> Result<O, E>` under `policy`: each
/// message is tried until it succeeds, its failure is not retryable, or it
/// had [`max_attempts`](RetryPolicy::max_attempts); between attempts it
/// waits the policy's backoff (jitter seeded by the message's position)
/// without holding a worker, and the key's later messages wait behind it.
/// A panic is a failed attempt (unless
/// [`retry_panics(false)`](crate::RetryPolicyBuilder::retry_panics), which
/// makes it final). A message given up on goes to the
/// [dead-letter hook](Retrying::on_dead_letter) and ends
/// [`TaskError::DeadLettered`]; it counts as finished for the commit point.
///
/// The closure borrows the message, so a message needs no `Clone`.
///
/// ```
/// use std::time::Duration;
/// use std::sync::atomic::{AtomicU32, Ordering};
/// use keyed_executor::{handler, Backoff, KeyedExecutor, RetryPolicy, TaskError};
///
/// let policy = RetryPolicy::builder()
///     .max_attempts(3)
///     .backoff(Backoff::fixed(Duration::from_millis(1)))
///     .build()?;
/// let tries = AtomicU32::new(0);
/// let executor = KeyedExecutor::builder().workers(1).build()?;
/// let dispatcher = executor.dispatcher(handler::retrying(policy, move |_key: &u64, n: &u32| {
///     // Fails twice, then succeeds.
///     if tries.fetch_add(1, Ordering::Relaxed) < 2 { Err("busy") } else { Ok(n * 2) }
/// }));
/// let receiver = dispatcher.receiver(16)?;
/// assert_eq!(receiver.submit_blocking(1, 21)?.wait()?, 42);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn retrying<K, M, O, E, F>(policy: RetryPolicy<E>, f: F) -> Retrying<K, M, E, F, SyncKind>
where
    K: Clone + Send + Sync + 'static,
    M: Send + 'static,
    O: Send + 'static,
    E: fmt::Display + Send + 'static,
    F: Fn(&K, &M) -> Result<O, E> + Send + Sync + 'static,
{
    Retrying::new(policy, f)
}

/// Runs an async closure `Fn(K, M) -> impl Future<Output = Result<O, (M,
/// E)>>` under `policy`, as [`retrying`] does a sync one: a failed attempt
/// hands the message back with its error, so it can be tried again
/// without `Clone`. The backoff is a wait on the handler's timer thread:
/// no worker is held and no runtime timer is needed.
///
/// A panic in the future takes the message with it: it ends
/// [`Panicked`](TaskError::Panicked), as with any handler, whatever the
/// policy says about panics.
///
/// ```
/// use std::time::Duration;
/// use keyed_executor::{handler, Backoff, KeyedExecutor, RetryPolicy, TaskError};
///
/// let policy = RetryPolicy::builder()
///     .max_attempts(2)
///     .backoff(Backoff::fixed(Duration::from_millis(1)))
///     .build()?;
/// let executor = KeyedExecutor::builder().workers(1).build()?;
/// let dispatcher = executor.dispatcher(handler::retrying_async(policy, |_key: u64, n: u32| async move {
///     if n % 2 == 0 { Ok(n) } else { Err((n, "odd")) }
/// }));
/// let receiver = dispatcher.receiver(16)?;
/// assert_eq!(receiver.submit_blocking(1, 4)?.wait()?, 4);
/// match receiver.submit_blocking(1, 3)?.wait() {
///     Err(TaskError::DeadLettered { attempts, message, .. }) => {
///         assert_eq!(attempts, 2);
///         assert_eq!(message, Some(3)); // no hook: handed back
///     }
///     other => panic!("{other:?}"),
/// }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn retrying_async<K, M, O, E, F, Fut>(
    policy: RetryPolicy<E>,
    f: F,
) -> Retrying<K, M, E, F, AsyncKind>
where
    K: Clone + Send + Sync + 'static,
    M: Send + 'static,
    O: Send + 'static,
    E: fmt::Display + Send + 'static,
    F: Fn(K, M) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<O, (M, E)>> + Send + 'static,
{
    Retrying::new(policy, f)
}

// ----- the sync form ---------------------------------------------------------

/// The future of one message of a [`retrying`] handler.
pub struct RetryFuture<K, M, O, E, F> {
    core: Arc<Core<K, M, E, F>>,
    key: K,
    /// The message: `Some` in `Ready` and `Backoff`.
    message: Option<M>,
    /// `Some` in `Backoff`.
    sleep: Option<Sleep>,
    attempts: u32,
    position: u64,
    /// No attempt starts at or after it (see [`Handler::call_until`]).
    deadline: Option<Instant>,
    _out: PhantomData<fn() -> O>,
}

// Nothing in it is ever pinned: the closure runs to its end within a poll,
// and `Sleep` is `Unpin`.
impl<K, M, O, E, F> Unpin for RetryFuture<K, M, O, E, F> {}

impl<K, M, O, E, F> RetryFuture<K, M, O, E, F>
where
    K: Clone,
    E: fmt::Display,
    F: Fn(&K, &M) -> Result<O, E>,
{
    fn poll_settle(&mut self, cx: &mut Context<'_>) -> Poll<Outcome<O, M>> {
        loop {
            if let Some(sleep) = self.sleep.as_mut() {
                if Pin::new(sleep).poll(cx).is_pending() {
                    return Poll::Pending;
                }
                self.sleep = None;
            }
            let Some(message) = self.message.as_ref() else {
                panic!("a retrying handler's future polled after it ended");
            };
            self.attempts += 1;
            let core = &*self.core;
            let failure = match catch_unwind(AssertUnwindSafe(|| (core.f)(&self.key, message))) {
                Ok(Ok(out)) => {
                    self.message = None;
                    return Poll::Ready(Ok(out));
                }
                Ok(Err(e)) => LastFailure::Error(e),
                Err(payload) => LastFailure::Panicked(Panic::new(payload)),
            };
            match core.next(
                self.attempts,
                failure.as_failure(),
                self.position,
                self.deadline,
            ) {
                Ok(sleep) => self.sleep = Some(sleep),
                Err(expired) => {
                    let message = self.message.take().expect("the message is held");
                    let key = self.key.clone();
                    return Poll::Ready(Err(core.dead_letter(
                        key,
                        message,
                        failure,
                        (self.attempts, self.position),
                        expired,
                    )));
                }
            }
        }
    }
}

impl<K, M, O, E, F> Future for RetryFuture<K, M, O, E, F>
where
    K: Clone,
    E: fmt::Display,
    F: Fn(&K, &M) -> Result<O, E>,
{
    type Output = O;

    /// Polled by hand (not by a dispatcher, which uses
    /// [`Handler::poll_outcome`]), a dead letter has no output: it panics.
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<O> {
        self.get_mut().poll_settle(cx).map(|outcome| match outcome {
            Ok(out) => out,
            Err(e) => panic!("{e}"),
        })
    }
}

impl<K, M, O, E, F> fmt::Debug for RetryFuture<K, M, O, E, F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryFuture")
            .field("attempts", &self.attempts)
            .field("backoff", &self.sleep.is_some())
            .finish_non_exhaustive()
    }
}

impl<K, M, O, E, F> Handler<K, M> for Retrying<K, M, E, F, SyncKind>
where
    K: Clone + Send + Sync + 'static,
    M: Send + 'static,
    O: Send + 'static,
    E: fmt::Display + Send + 'static,
    F: Fn(&K, &M) -> Result<O, E> + Send + Sync + 'static,
{
    type Output = O;
    type Future = RetryFuture<K, M, O, E, F>;

    fn call(&self, key: &K, message: M) -> Self::Future {
        self.call_at(key, message, 0)
    }

    fn call_at(&self, key: &K, message: M, position: u64) -> Self::Future {
        RetryFuture {
            core: Arc::clone(&self.core),
            key: key.clone(),
            message: Some(message),
            sleep: None,
            attempts: 0,
            position,
            deadline: None,
            _out: PhantomData,
        }
    }

    fn call_until(&self, key: &K, message: M, position: u64, deadline: Instant) -> Self::Future {
        RetryFuture {
            deadline: Some(deadline),
            ..self.call_at(key, message, position)
        }
    }

    fn poll_outcome(future: Pin<&mut Self::Future>, cx: &mut Context<'_>) -> Poll<Outcome<O, M>> {
        future.get_mut().poll_settle(cx)
    }

    fn reclaim(future: Pin<&mut Self::Future>) -> Option<M> {
        // Only a message waiting for its next attempt (or not started): an
        // attempt runs within a poll, so none is half-run here.
        future.get_mut().message.take()
    }
}

// ----- the async form --------------------------------------------------------

/// Where one message of a [`retrying_async`] handler stands (see the
/// module's state machine).
enum Stage<M, Fut> {
    Ready(M),
    Running(Fut),
    Backoff(M, Sleep),
    Done,
}

/// The future of one message of a [`retrying_async`] handler.
pub struct RetryAsyncFuture<K, M, E, F, Fut> {
    core: Arc<Core<K, M, E, F>>,
    key: K,
    /// Structurally pinned in `Running` (the attempt's future).
    stage: Stage<M, Fut>,
    attempts: u32,
    position: u64,
    /// No attempt starts at or after it (see [`Handler::call_until`]).
    deadline: Option<Instant>,
}

impl<K, M, E, F, Fut> RetryAsyncFuture<K, M, E, F, Fut> {
    /// The stage, pinned.
    fn stage(self: Pin<&mut Self>) -> Pin<&mut Stage<M, Fut>> {
        // SAFETY: `stage` is structurally pinned: it is never moved out
        // while pinned (it is only overwritten in place, which drops the
        // old value first, as `Pin::set` does), and the type has no `Drop`
        // of its own and no `Unpin` impl beyond the auto one.
        unsafe { self.map_unchecked_mut(|s| &mut s.stage) }
    }
}

impl<K, M, O, E, F, Fut> RetryAsyncFuture<K, M, E, F, Fut>
where
    K: Clone,
    E: fmt::Display,
    F: Fn(K, M) -> Fut,
    Fut: Future<Output = Result<O, (M, E)>>,
{
    fn poll_settle(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Outcome<O, M>> {
        loop {
            // SAFETY: only the `Running` variant's future is used pinned;
            // the other variants' fields are moved out only after the whole
            // stage is replaced (`mem::replace` on a stage that holds no
            // pinned future: checked by the match).
            let stage = unsafe { self.as_mut().stage().get_unchecked_mut() };
            match stage {
                Stage::Running(fut) => {
                    // SAFETY: the attempt's future lives in `stage`, which is
                    // pinned (see `stage`), and is dropped in place.
                    let fut = unsafe { Pin::new_unchecked(fut) };
                    let (message, error) = match fut.poll(cx) {
                        Poll::Pending => return Poll::Pending,
                        Poll::Ready(Ok(out)) => {
                            self.as_mut().stage().set(Stage::Done);
                            return Poll::Ready(Ok(out));
                        }
                        Poll::Ready(Err(failed)) => failed,
                    };
                    self.as_mut().stage().set(Stage::Done);
                    // SAFETY: `Done` holds nothing pinned.
                    let this = unsafe { self.as_mut().get_unchecked_mut() };
                    let failure = LastFailure::Error(error);
                    match this.core.next(
                        this.attempts,
                        failure.as_failure(),
                        this.position,
                        this.deadline,
                    ) {
                        Ok(sleep) => this.stage = Stage::Backoff(message, sleep),
                        Err(expired) => {
                            let key = this.key.clone();
                            return Poll::Ready(Err(this.core.dead_letter(
                                key,
                                message,
                                failure,
                                (this.attempts, this.position),
                                expired,
                            )));
                        }
                    }
                }
                Stage::Backoff(_, sleep) => {
                    if Pin::new(sleep).poll(cx).is_pending() {
                        return Poll::Pending;
                    }
                    let Stage::Backoff(message, _) = std::mem::replace(stage, Stage::Done) else {
                        unreachable!()
                    };
                    *stage = Stage::Ready(message);
                }
                Stage::Ready(_) => {
                    let Stage::Ready(message) = std::mem::replace(stage, Stage::Done) else {
                        unreachable!()
                    };
                    // SAFETY: `stage` holds `Done` (nothing pinned) until the
                    // new attempt's future is written in place.
                    let this = unsafe { self.as_mut().get_unchecked_mut() };
                    this.attempts += 1;
                    let fut = (this.core.f)(this.key.clone(), message);
                    this.stage = Stage::Running(fut);
                }
                Stage::Done => panic!("a retrying handler's future polled after it ended"),
            }
        }
    }
}

impl<K, M, O, E, F, Fut> Future for RetryAsyncFuture<K, M, E, F, Fut>
where
    K: Clone,
    E: fmt::Display,
    F: Fn(K, M) -> Fut,
    Fut: Future<Output = Result<O, (M, E)>>,
{
    type Output = O;

    /// Polled by hand (not by a dispatcher, which uses
    /// [`Handler::poll_outcome`]), a dead letter has no output: it panics.
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<O> {
        self.poll_settle(cx).map(|outcome| match outcome {
            Ok(out) => out,
            Err(e) => panic!("{e}"),
        })
    }
}

impl<K, M, E, F, Fut> fmt::Debug for RetryAsyncFuture<K, M, E, F, Fut> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let stage = match self.stage {
            Stage::Ready(_) => "Ready",
            Stage::Running(_) => "Running",
            Stage::Backoff(..) => "Backoff",
            Stage::Done => "Done",
        };
        f.debug_struct("RetryAsyncFuture")
            .field("attempts", &self.attempts)
            .field("stage", &stage)
            .finish_non_exhaustive()
    }
}

impl<K, M, O, E, F, Fut> Handler<K, M> for Retrying<K, M, E, F, AsyncKind>
where
    K: Clone + Send + Sync + 'static,
    M: Send + 'static,
    O: Send + 'static,
    E: fmt::Display + Send + 'static,
    F: Fn(K, M) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<O, (M, E)>> + Send + 'static,
{
    type Output = O;
    type Future = RetryAsyncFuture<K, M, E, F, Fut>;

    fn call(&self, key: &K, message: M) -> Self::Future {
        self.call_at(key, message, 0)
    }

    fn call_at(&self, key: &K, message: M, position: u64) -> Self::Future {
        RetryAsyncFuture {
            core: Arc::clone(&self.core),
            key: key.clone(),
            stage: Stage::Ready(message),
            attempts: 0,
            position,
            deadline: None,
        }
    }

    fn call_until(&self, key: &K, message: M, position: u64, deadline: Instant) -> Self::Future {
        let mut future = self.call_at(key, message, position);
        future.deadline = Some(deadline);
        future
    }

    fn poll_outcome(future: Pin<&mut Self::Future>, cx: &mut Context<'_>) -> Poll<Outcome<O, M>> {
        future.poll_settle(cx)
    }

    fn reclaim(future: Pin<&mut Self::Future>) -> Option<M> {
        let stage = future.stage();
        // Only a message that no attempt holds: an attempt's future that
        // is pending has begun work that may not be repeatable, so it ends
        // `Cancelled` as any suspended future does.
        if !matches!(&*stage, Stage::Ready(_) | Stage::Backoff(..)) {
            return None;
        }
        // SAFETY: the stage holds no pinned future (checked above), so
        // moving its message out is fine.
        let stage = unsafe { stage.get_unchecked_mut() };
        match std::mem::replace(stage, Stage::Done) {
            Stage::Ready(message) | Stage::Backoff(message, _) => Some(message),
            _ => unreachable!("checked above"),
        }
    }
}
