//! Receivers: the sources that feed a dispatcher, each with its own credit
//! of `max_in_flight` unfinished messages.
//!
//! The credit itself (one atomic word per receiver) is in `credit.rs`.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use crate::completion::{Completion, Slot};
use crate::error::SubmitError;
use crate::pool::executor::Shared;
use crate::pool::mailbox::Envelope;
use crate::pool::observe::Identity;
use crate::pool::source::{Acquire, CreditHandle};
use crate::pool::worker;
use crate::sync::{thread, Arc};
use crate::waiter::Waiter;

/// The type-erased face of a dispatcher that handles and receivers hold.
/// (Defined here, implemented by `dispatcher.rs`: the receiver states what
/// it needs from a dispatcher.)
pub(crate) trait Core<K, M, O>: Send + Sync {
    fn enqueue(&self, key: K, env: Envelope<M, O>) -> Result<(), Envelope<M, O>>;
    fn is_closed(&self) -> bool;
    fn live_mailboxes(&self) -> usize;
    fn shared(&self) -> &Arc<Shared>;
    /// The dispatcher's name and metrics handles.
    fn ident(&self) -> &Identity;
    fn clone_box(&self) -> Box<dyn Core<K, M, O>>;
}

fn task_waiter(waker: &Waker) -> impl Fn(&mut Option<Waiter>) + '_ {
    move |slot| Waiter::register_task(slot, waker)
}

fn thread_waiter(slot: &mut Option<Waiter>) {
    if !matches!(slot, Some(Waiter::Thread(_))) {
        *slot = Some(Waiter::current_thread());
    }
}

/// A source of messages for one dispatcher, holding at most `max_in_flight`
/// of them unfinished (queued in a mailbox or running).
///
/// Make one per source (a partition, a bounded context, a connection) with
/// [`Dispatcher::receiver`](crate::Dispatcher::receiver). Clones share the
/// same credit; a new receiver from the dispatcher has its own.
///
/// | method | waits for credit | returns a handle | when full |
/// |---|---|---|---|
/// | [`submit`](Self::submit) | async | yes | waits |
/// | [`submit_blocking`](Self::submit_blocking) | blocks the thread | yes | waits |
/// | [`try_submit`](Self::try_submit) | no | yes | `Full(msg)` |
/// | [`send_async`](Self::send_async) | async | no | waits |
/// | [`send`](Self::send) | blocks the thread | no | waits |
/// | [`try_send`](Self::try_send) | no | no | `Full(msg)` |
///
/// All of them refuse with `Closed(msg)` once the executor is shutting down,
/// handing the message back. Messages given to the `send` family have no
/// completion handle: their output is dropped, a panic goes to the
/// dispatcher's [`on_panic`](crate::DispatcherBuilder::on_panic) hook and a
/// force-stop rejection to its [`on_reject`](crate::DispatcherBuilder::on_reject) hook.
///
/// ```
/// use keyed_executor::{handler, KeyedExecutor, SubmitError};
///
/// let executor = KeyedExecutor::builder().workers(1).build()?;
/// let dispatcher = executor.dispatcher(handler::from_fn(|_: &u8, n: u32| n * 2));
/// let receiver = dispatcher.receiver(1)?;
/// let first = receiver.try_submit(1, 10)?;
/// // Until the first message finishes, the receiver is full...
/// match receiver.try_submit(1, 11) {
///     Err(SubmitError::Full(msg)) => assert_eq!(msg, 11),
///     Ok(second) => drop(second), // ...unless it already finished.
///     Err(e) => panic!("{e}"),
/// }
/// assert_eq!(first.wait()?, 20);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Receiver<K, M, O> {
    core: Box<dyn Core<K, M, O>>,
    credit: CreditHandle,
    /// Counts refusals (zero-sized without the `metrics` feature).
    metrics: crate::metrics::ReceiverMetrics,
}

impl<K, M, O> Receiver<K, M, O> {
    /// `label`: its `receiver` label in the metrics (default: its number).
    pub(crate) fn new(
        core: Box<dyn Core<K, M, O>>,
        max_in_flight: usize,
        label: Option<String>,
    ) -> Self {
        let credit = CreditHandle::new(max_in_flight, Some(core.shared().clone()));
        let metrics = crate::metrics::ReceiverMetrics::new(&core.ident().metrics);
        core.shared()
            .metrics
            .source_created(credit.as_ref(), &core.ident().metrics, label);
        Receiver {
            core,
            credit,
            metrics,
        }
    }

    /// Counts a refused message (`Full` or `Closed`) and hands the error on.
    #[inline]
    fn refused(&self, e: SubmitError<M>) -> SubmitError<M> {
        self.metrics.refused();
        e
    }

    /// The most unfinished messages this receiver holds.
    pub fn max_in_flight(&self) -> usize {
        self.credit.credit().max()
    }

    /// Messages accepted by this receiver (and its clones) and not finished.
    pub fn in_flight(&self) -> usize {
        self.credit.credit().in_flight()
    }

    /// Whether the executor refuses new messages (it is shutting down).
    pub fn is_closed(&self) -> bool {
        self.core.is_closed()
    }

    /// Submits `message` for `key`, waiting (asynchronously) for credit.
    ///
    /// Resolves to the message's [`Completion`] once it is accepted; the
    /// completion resolves when it finished. Dropping the returned future
    /// before it resolves gives up the submission (the message is dropped
    /// with it, never half-submitted).
    ///
    /// # Errors
    /// `Closed(message)` if the executor is shutting down.
    pub fn submit(&self, key: K, message: M) -> SubmitFuture<'_, K, M, O> {
        SubmitFuture {
            receiver: self,
            item: Some((key, message)),
            acquire: Acquire::new(self.credit.credit(), worker::flush_held_credit),
        }
    }

    /// Submits `message` for `key`, blocking the current thread while the
    /// receiver is full.
    ///
    /// # Errors
    /// `Closed(message)` if the executor is shutting down.
    pub fn submit_blocking(&self, key: K, message: M) -> Result<Completion<O, M>, SubmitError<M>> {
        if self.core.is_closed() {
            return Err(self.refused(SubmitError::Closed(message)));
        }
        self.acquire_blocking();
        self.enqueue(key, message, true)
            .map(|c| c.expect("reply requested"))
    }

    /// Submits `message` for `key` if the receiver has credit, without
    /// waiting.
    ///
    /// # Errors
    /// `Full(message)` if `max_in_flight` messages are unfinished,
    /// `Closed(message)` if the executor is shutting down.
    pub fn try_submit(&self, key: K, message: M) -> Result<Completion<O, M>, SubmitError<M>> {
        if self.core.is_closed() {
            return Err(self.refused(SubmitError::Closed(message)));
        }
        if !self.credit.credit().try_acquire() {
            return Err(self.refused(SubmitError::Full(message)));
        }
        self.enqueue(key, message, true)
            .map(|c| c.expect("reply requested"))
    }

    /// Fire-and-forget: enqueues `message` for `key` without a completion
    /// handle, blocking the current thread while the receiver is full
    /// (use [`send_async`](Self::send_async) in async code, or
    /// [`try_send`](Self::try_send) to never block).
    ///
    /// # Errors
    /// `Closed(message)` if the executor is shutting down.
    pub fn send(&self, key: K, message: M) -> Result<(), SubmitError<M>> {
        // With credit at hand the dispatcher's own check refuses a closed
        // executor; without, look before waiting for a unit.
        if !self.credit.credit().try_acquire() {
            if self.core.is_closed() {
                return Err(self.refused(SubmitError::Closed(message)));
            }
            self.acquire_blocking();
        }
        self.enqueue(key, message, false).map(drop)
    }

    /// Fire-and-forget without waiting: enqueues `message` if the receiver
    /// has credit.
    ///
    /// # Errors
    /// `Full(message)` or `Closed(message)`.
    pub fn try_send(&self, key: K, message: M) -> Result<(), SubmitError<M>> {
        if self.core.is_closed() {
            return Err(self.refused(SubmitError::Closed(message)));
        }
        if !self.credit.credit().try_acquire() {
            return Err(self.refused(SubmitError::Full(message)));
        }
        self.enqueue(key, message, false).map(drop)
    }

    /// Fire-and-forget, waiting asynchronously for credit.
    ///
    /// # Errors
    /// `Closed(message)` if the executor is shutting down.
    pub fn send_async(&self, key: K, message: M) -> SendFuture<'_, K, M, O> {
        SendFuture {
            inner: SubmitFuture {
                receiver: self,
                item: Some((key, message)),
                acquire: Acquire::new(self.credit.credit(), worker::flush_held_credit),
            },
        }
    }

    fn acquire_blocking(&self) {
        let credit = self.credit.credit();
        if credit.try_acquire() {
            return;
        }
        // Out of credit: a worker gives units back every few messages, so
        // spin briefly before registering as a waiter; parking here makes
        // every release of the next batch a futex wake (see BENCHMARKS.md,
        // W1). Not under loom: the wait below is the protocol it checks.
        #[cfg(not(loom))]
        if credit.spin_acquire(worker::flush_held_credit) {
            return;
        }
        let mut acquire = Acquire::new(credit, worker::flush_held_credit);
        while !acquire.poll(&thread_waiter) {
            thread::park();
        }
    }

    /// Enqueues a message whose credit unit is already taken.
    fn enqueue(&self, key: K, message: M, reply: bool) -> MaybeCompletion<O, M> {
        /// Gives the unit back if the key's `Hash`/`Eq` panics in `enqueue`.
        struct Unwind<'a>(&'a CreditHandle);
        impl Drop for Unwind<'_> {
            fn drop(&mut self) {
                // SAFETY: armed only while the unit taken by our caller has
                // not been handed to a message.
                unsafe { self.0.as_ref().release(1) };
            }
        }
        let slot = reply.then(|| Arc::new(Slot::new()));
        let env = Envelope {
            msg: message,
            reply: slot.clone(),
            credit: self.credit.as_ref(),
        };
        // The key's `Hash` and `Eq` run inside: if they panic, the panic
        // goes to the caller with the message, and the unit comes back.
        let unwind = Unwind(&self.credit);
        let res = self.core.enqueue(key, env);
        std::mem::forget(unwind);
        match res {
            Ok(()) => Ok(slot.map(Completion::new)),
            Err(env) => {
                let Envelope { msg, credit, .. } = env;
                // SAFETY: the refused message still holds its unit.
                unsafe { credit.release(1) };
                Err(self.refused(SubmitError::Closed(msg)))
            }
        }
    }
}

impl<K, M, O> Clone for Receiver<K, M, O> {
    /// A clone shares this receiver's credit.
    fn clone(&self) -> Self {
        Receiver {
            core: self.core.clone_box(),
            credit: self.credit.clone(),
            metrics: crate::metrics::ReceiverMetrics::new(&self.core.ident().metrics),
        }
    }
}

impl<K, M, O> fmt::Debug for Receiver<K, M, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Receiver")
            .field("in_flight", &self.in_flight())
            .field("max_in_flight", &self.max_in_flight())
            .finish()
    }
}

type MaybeCompletion<O, M> = Result<Option<Completion<O, M>>, SubmitError<M>>;

/// Future of [`Receiver::submit`]: resolves to the message's [`Completion`]
/// once credit was available and the message was accepted.
#[must_use = "futures do nothing unless polled"]
pub struct SubmitFuture<'a, K, M, O> {
    receiver: &'a Receiver<K, M, O>,
    item: Option<(K, M)>,
    acquire: Acquire<'a>,
}

// The message is never pinned: it is moved out by value when submitted.
impl<K, M, O> Unpin for SubmitFuture<'_, K, M, O> {}

impl<K, M, O> SubmitFuture<'_, K, M, O> {
    fn poll_submit(&mut self, cx: &mut Context<'_>, reply: bool) -> Poll<MaybeCompletion<O, M>> {
        let Some((_, _)) = self.item.as_ref() else {
            panic!("submit future polled after completion");
        };
        if self.receiver.core.is_closed() {
            let (_, msg) = self.item.take().expect("checked");
            return Poll::Ready(Err(self.receiver.refused(SubmitError::Closed(msg))));
        }
        if !self.acquire.poll(&task_waiter(cx.waker())) {
            return Poll::Pending;
        }
        let (key, msg) = self.item.take().expect("checked");
        Poll::Ready(self.receiver.enqueue(key, msg, reply))
    }
}

impl<K, M, O> Future for SubmitFuture<'_, K, M, O> {
    type Output = Result<Completion<O, M>, SubmitError<M>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.get_mut()
            .poll_submit(cx, true)
            .map(|r| r.map(|c| c.expect("reply requested")))
    }
}

impl<K, M, O> fmt::Debug for SubmitFuture<'_, K, M, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SubmitFuture")
            .field("pending", &self.item.is_some())
            .finish()
    }
}

/// Future of [`Receiver::send_async`].
#[must_use = "futures do nothing unless polled"]
pub struct SendFuture<'a, K, M, O> {
    inner: SubmitFuture<'a, K, M, O>,
}

impl<K, M, O> Future for SendFuture<'_, K, M, O> {
    type Output = Result<(), SubmitError<M>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.get_mut()
            .inner
            .poll_submit(cx, false)
            .map(|r| r.map(drop))
    }
}

impl<K, M, O> fmt::Debug for SendFuture<'_, K, M, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SendFuture")
            .field("pending", &self.inner.item.is_some())
            .finish()
    }
}
