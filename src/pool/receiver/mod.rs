//! Receivers: the sources that feed a dispatcher, each with its own credit
//! of `max_in_flight` unfinished messages, its positions and commit point,
//! and its own stop.
//!
//! | file | holds |
//! |---|---|
//! | `mod.rs` | [`Receiver`], [`WeakReceiver`], and [`Core`]: what a receiver needs of its dispatcher |
//! | `builder.rs` | [`ReceiverBuilder`] and the commit span's defaults |
//! | `admit.rs` | how a message gets its unit of credit and is accepted; sending from a handler |
//! | `future.rs` | [`SubmitFuture`], [`SendFuture`], [`ShutdownFuture`] |
//! | `sink.rs` | `ReceiverSink` (the `sink` feature): a receiver as a `futures::Sink`, credit reserved in `poll_ready` |
//!
//! What a receiver shares with its clones (credit, positions, stop flags,
//! commit point) is a `Source` (`pool::source`); batched sends are in
//! `pool::batch`.

use std::fmt;
use std::time::{Duration, Instant};

use crate::completion::Completion;
use crate::error::SubmitError;
use crate::pool::mailbox::Envelope;
use crate::pool::observe::Identity;
use crate::pool::shared::Shared;
use crate::pool::source::{wait_all_drained, Acquire, Settings, SourceHandle, SourceRef};
use crate::pool::worker;
use crate::sync::Arc;

mod admit;
mod builder;
mod future;
#[cfg(feature = "sink")]
mod sink;

pub(in crate::pool) use admit::{give_back, task_waiter, Refused, Unit};
pub use builder::{ReceiverBuilder, DEFAULT_COMMIT_SPAN_FACTOR, MIN_DEFAULT_COMMIT_SPAN};
pub use future::{SendFuture, ShutdownFuture, SubmitFuture};
#[cfg(feature = "sink")]
pub use sink::ReceiverSink;

/// A chunk of a batch on its way in: keys and their envelopes, in order.
pub(crate) type Batch<K, M, O> = Vec<(K, Envelope<M, O>)>;

/// The type-erased face of a dispatcher that handles and receivers hold.
/// (Defined here, implemented by `dispatcher/erased.rs`: the receiver states what
/// it needs from a dispatcher.)
pub(crate) trait Core<K, M, O>: Send + Sync {
    /// Accepts `env` (its unit of credit taken) and returns its position,
    /// or hands it back with its key if the executor, the dispatcher or
    /// the source is closed.
    fn enqueue(&self, key: K, env: Envelope<M, O>) -> Result<u64, (K, Envelope<M, O>)>;
    /// Accepts a batch of one source in order (each message holding one of
    /// its own units) and returns its first position, or hands every
    /// message back, in order, if the executor, the dispatcher or the
    /// source is closed.
    fn enqueue_batch(&self, batch: Batch<K, M, O>) -> Result<u64, Batch<K, M, O>>;
    /// The executor or the dispatcher refuses new messages.
    fn is_closed(&self) -> bool;
    fn live_mailboxes(&self) -> usize;
    fn shared(&self) -> &Arc<Shared>;
    /// The dispatcher's name and metrics handles.
    fn ident(&self) -> &Identity;
    /// The dispatcher's id.
    fn id(&self) -> u64;
    /// The dispatcher refuses new messages from now on (its own stop).
    fn close(&self);
    /// Hands back (on this thread) every queued message whose source
    /// `stopped` picks and cancels its suspended futures; returns how many.
    fn stop_sources(&self, stopped: &dyn Fn(SourceRef) -> bool) -> usize;
    fn clone_box(&self) -> Box<dyn Core<K, M, O>>;
    #[cfg(not(loom))]
    fn downgrade(&self) -> Box<dyn WeakCore<K, M, O>>;
}

/// A dispatcher reference that keeps nothing alive (see [`WeakReceiver`]).
#[cfg(not(loom))]
pub(crate) trait WeakCore<K, M, O>: Send + Sync {
    /// A strong handle, while any `Dispatcher` or `Receiver` handle lives.
    fn upgrade(&self) -> Option<Box<dyn Core<K, M, O>>>;
    fn clone_box(&self) -> Box<dyn WeakCore<K, M, O>>;
}

/// A source of messages for one dispatcher, holding at most `max_in_flight`
/// of them unfinished (queued in a mailbox or running).
///
/// Make one per source (a partition, a bounded context, a connection) with
/// [`Dispatcher::receiver`](crate::Dispatcher::receiver) or
/// [`Dispatcher::receiver_builder`](crate::Dispatcher::receiver_builder).
/// Clones share the same credit, positions and stop; a new receiver from the
/// dispatcher has its own.
///
/// | method | waits for credit | returns | when full |
/// |---|---|---|---|
/// | [`submit`](Self::submit) | async | a [`Completion`] | waits |
/// | [`submit_blocking`](Self::submit_blocking) | blocks the thread | a [`Completion`] | waits |
/// | [`try_submit`](Self::try_submit) | no | a [`Completion`] | `Full(msg)` |
/// | [`send_async`](Self::send_async) | async | the position | waits |
/// | [`send`](Self::send) | blocks the thread | the position | waits |
/// | [`try_send`](Self::try_send) | no | the position | `Full(msg)` |
///
/// With the `sink` feature, `sink()` and `into_sink()` make it a
/// `futures::Sink` of `(key, message)` pairs (`ReceiverSink`): credit is
/// its backpressure, as for `send_async`.
///
/// All of them refuse with `Closed(msg)` once the receiver, its dispatcher or
/// the executor is shutting down, handing the message back — a submitter
/// already waiting for credit too, as soon as the stop begins (it never
/// waits for a unit to free). Messages given to
/// the `send` family have no completion handle: their output is dropped, a
/// panic goes to the dispatcher's [`on_panic`](crate::DispatcherBuilder::on_panic)
/// hook and a stop's rejection to its [`on_reject`](crate::DispatcherBuilder::on_reject) hook.
///
/// **Positions.** Every message the receiver accepts gets the next
/// *position* (0, 1, 2, … in acceptance order), returned by the `send`
/// family and by [`Completion::position`]. A receiver built with
/// [`ReceiverBuilder::track_commits`] also keeps a commit point:
/// [`committable`](Self::committable) says how many leading positions
/// have all finished (`None` without the setting): what a consumer
/// commits (a Kafka offset, a stream ID) when keys finish out of order. See
/// [`ReceiverBuilder::commit_span`] for the bound on unfinished positions.
///
/// **Stops.** A receiver stops on its own, the others going on:
/// [`close`](Self::close), [`shutdown`](Self::shutdown) (drain),
/// [`shutdown_now`](Self::shutdown_now) (hand back what waits).
///
/// **From a handler** (its call or any poll of its future), a submission
/// never waits for credit: it takes a free unit, or shares the running
/// message's own unit (once per message: the unit comes back when both
/// have ended), or is refused with `Full(msg)`. A chain of one follow-up
/// per message therefore never deadlocks the pool, whatever the credit;
/// fan-out beyond the credit is refused, never left hanging. Hold a
/// [`WeakReceiver`] in a handler to reach its own dispatcher without a
/// reference cycle.
///
/// What a handler may call: any submit or send (they never block it), and
/// `.await` on the [`Completion`] of another key's message (the handler's
/// future suspends; its worker runs other keys meanwhile). What deadlocks:
/// waiting for a message of the handler's *own* key, which queues behind
/// it and cannot start until it returns; and a *blocking*
/// [`Completion::wait`] in a sync handler, which holds its worker — if the
/// awaited key lives on that worker (or every worker blocks so), it never
/// runs. Block only on work of another executor.
///
/// ```
/// use keyed_executor::{handler, KeyedExecutor, SubmitError};
///
/// let executor = KeyedExecutor::builder().workers(1).build()?;
/// let dispatcher = executor.dispatcher(handler::from_fn(|_: &u8, n: u32| n * 2));
/// let receiver = dispatcher.receiver(1)?;
/// let first = receiver.try_submit(1, 10)?;
/// assert_eq!(first.position(), 0);
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
    pub(super) core: Box<dyn Core<K, M, O>>,
    pub(super) source: SourceHandle,
    /// Counts refusals (zero-sized without the `metrics` feature).
    pub(super) metrics: crate::pool::metrics::ReceiverMetrics,
}

impl<K, M, O> Receiver<K, M, O> {
    /// `label`: its `receiver` label in the metrics (default: its number).
    pub(crate) fn new(
        core: Box<dyn Core<K, M, O>>,
        max_in_flight: usize,
        span: usize,
        track: bool,
        label: Option<String>,
    ) -> Self {
        let settings = Settings {
            max_in_flight,
            span: span.max(max_in_flight),
            track,
            dispatcher: core.id(),
        };
        let source = SourceHandle::new(settings, Some(core.shared().clone()));
        let metrics = crate::pool::metrics::ReceiverMetrics::new(&core.ident().metrics);
        core.shared()
            .metrics
            .source_created(source.as_ref(), &core.ident().metrics, label);
        Receiver {
            core,
            source,
            metrics,
        }
    }

    /// Counts a refused message (`Full` or `Closed`) and hands the error on.
    #[inline]
    fn refused<T>(&self, e: SubmitError<T>) -> SubmitError<T> {
        self.metrics.refused();
        e
    }

    /// The most unfinished messages this receiver holds.
    pub fn max_in_flight(&self) -> usize {
        self.source.source().max()
    }

    /// Messages accepted by this receiver (and its clones) and not finished.
    /// (A follow-up a handler sent through another receiver, holding one of
    /// this receiver's units, counts here until it finishes.)
    pub fn in_flight(&self) -> usize {
        self.source.source().in_flight()
    }

    /// The cap on positions between the commit point and the newest one
    /// (see [`ReceiverBuilder::commit_span`]), or `None` if the receiver
    /// does not [track commits](Self::tracks_commits): it then has no
    /// commit point and no cap.
    pub fn commit_span(&self) -> Option<u64> {
        let source = self.source.source();
        source.tracks_commits().then(|| source.span())
    }

    /// Whether the receiver keeps a commit point
    /// ([`ReceiverBuilder::track_commits`]).
    pub fn tracks_commits(&self) -> bool {
        self.source.source().tracks_commits()
    }

    /// Positions this receiver (and its clones) gave out so far: the next
    /// position. A submission that races a stop may take a position and
    /// then be refused (`Closed`, the message handed back); its position is
    /// resolved as returned, so the commit point stops there.
    pub fn accepted(&self) -> u64 {
        self.source.source().positions()
    }

    /// How many leading positions have all finished — done, or failed with
    /// a panic: what a consumer can commit. A message handed back by a stop
    /// or cancelled is never passed: it and what follows are delivered
    /// again. One atomic load: call it as often as you like.
    ///
    /// `None` if the receiver does not keep a commit point: only one built
    /// with [`track_commits(true)`](ReceiverBuilder::track_commits) (or a
    /// [`commit_span`](ReceiverBuilder::commit_span)) does, and
    /// [`Dispatcher::receiver`](crate::Dispatcher::receiver) makes one that
    /// does not. A consumer that commits offsets must decide what `None`
    /// means to it; a bare number would let one that forgot the setting
    /// commit nothing, silently, and read its whole partition again after a
    /// restart.
    ///
    /// ```
    /// use keyed_executor::{handler, KeyedExecutor};
    ///
    /// let executor = KeyedExecutor::builder().workers(1).build()?;
    /// let dispatcher = executor.dispatcher(handler::from_fn(|_: &u8, n: u32| n));
    /// let partition = dispatcher.receiver_builder().track_commits(true).build()?;
    /// partition.submit_blocking(1, 10)?.wait()?;
    /// assert_eq!(partition.committable(), Some(1)); // commit offset 1
    ///
    /// // A receiver made without the setting has no commit point to give.
    /// let untracked = dispatcher.receiver(16)?;
    /// untracked.submit_blocking(1, 10)?.wait()?;
    /// assert_eq!(untracked.committable(), None);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// The answer is not a bare number, so that forgetting the setting
    /// cannot go unnoticed:
    ///
    /// ```compile_fail,E0308
    /// # use keyed_executor::{handler, KeyedExecutor};
    /// # let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    /// # let dispatcher = executor.dispatcher(handler::from_fn(|_: &u8, n: u32| n));
    /// let receiver = dispatcher.receiver(16).unwrap();
    /// let offset: u64 = receiver.committable(); // error: expected `u64`, found `Option<u64>`
    /// ```
    pub fn committable(&self) -> Option<u64> {
        let source = self.source.source();
        source.tracks_commits().then(|| source.committable())
    }

    /// Whether this receiver refuses new messages: it was closed, or its
    /// dispatcher or the executor is shutting down.
    pub fn is_closed(&self) -> bool {
        self.source.source().is_closed() || self.core.is_closed()
    }

    /// Refuses new messages from this source from now on (`Closed(msg)`),
    /// for every clone; what it accepted goes on. Submitters waiting for
    /// its credit (or its commit span) get their messages back at once.
    /// Idempotent. Other receivers, even of the same keys, are untouched.
    pub fn close(&self) {
        self.source.source().close();
    }

    /// Closes this source and waits until every message it accepted has
    /// ended (finished, or handed back by another stop). `true` if that
    /// happened within `timeout` (zero: look now), `false` if not; the
    /// messages go on either way, and a later call can wait again.
    ///
    /// Called from a handler (on a worker) it cannot wait for work that may
    /// need that worker: it closes and says whether the source has drained.
    pub fn shutdown(&self, timeout: Duration) -> bool {
        self.close();
        let source = self.source.source();
        if worker::on_worker_of(self.core.shared().id()) {
            return source.is_drained();
        }
        // An overflowing deadline is no deadline.
        wait_all_drained(&[source], Instant::now().checked_add(timeout), false)
    }

    /// The async form of [`shutdown`](Self::shutdown): resolves to `true`
    /// once every message of this source has ended, `false` once `timeout`
    /// passed first. Needs no runtime: the timeout is kept by a small
    /// thread started on the first `Pending` and stopped when the future
    /// resolves or is dropped.
    pub fn shutdown_async(&self, timeout: Duration) -> ShutdownFuture<'_, K, M, O> {
        self.close();
        ShutdownFuture::new(self, Instant::now().checked_add(timeout))
    }

    /// Stops this source now, on the calling thread, as the executor's force
    /// stop does for all: closes it, hands back every message of it still
    /// queued (through its [`Completion`] as `Rejected(msg)`, or the
    /// dispatcher's `on_reject` hook for the `send` family) and cancels its
    /// suspended futures (`Cancelled`); a step already running finishes, and
    /// this call waits for it. After it returns no message of this source
    /// starts or runs: a revoked partition's keys can be taken over
    /// elsewhere. Other sources, even on the same keys and workers, go on
    /// untouched. Idempotent.
    ///
    /// Called from a handler (on a worker) it hands back and cancels what it
    /// can reach and returns without waiting for running steps.
    pub fn shutdown_now(&self) {
        let source = self.source.source();
        let me = self.source.as_ref();
        source.stopper_enter();
        source.stop();
        self.core.stop_sources(&|s| s == me);
        if !worker::on_worker_of(self.core.shared().id()) {
            wait_all_drained(&[source], None, true);
        }
        source.stopper_leave();
        // As after the executor's force stop: the in-flight gauges show
        // what the stop handed back.
        self.core.shared().metrics.refresh_gauges();
    }

    /// A handle to this receiver that keeps nothing alive: neither its
    /// dispatcher nor the handler's state. Give it to a handler that sends
    /// to its own dispatcher, so that the dispatcher and the handler can be
    /// freed once the last strong handle is gone.
    #[cfg(not(loom))]
    pub fn downgrade(&self) -> WeakReceiver<K, M, O> {
        WeakReceiver {
            core: self.core.downgrade(),
            source: self.source.clone(),
        }
    }

    /// Submits `message` for `key`, waiting (asynchronously) for credit.
    ///
    /// Resolves to the message's [`Completion`] once it is accepted; the
    /// completion resolves when it finished. Dropping the returned future
    /// before it resolves gives up the submission (the message is dropped
    /// with it, never half-submitted). From a handler it never waits (see
    /// the type's docs).
    ///
    /// # Errors
    /// `Closed(message)` if the receiver, its dispatcher or the executor is
    /// shutting down; from a handler, `Full(message)` when neither a unit
    /// of credit nor the running message's own is available.
    pub fn submit(&self, key: K, message: M) -> SubmitFuture<'_, K, M, O> {
        SubmitFuture::new(
            self,
            key,
            message,
            Acquire::new(self.source.source(), worker::flush_held_credit),
        )
    }

    /// Submits `message` for `key`, blocking the current thread while the
    /// receiver is full (from a handler it never blocks: see the type's
    /// docs).
    ///
    /// # Errors
    /// As for [`submit`](Self::submit).
    pub fn submit_blocking(&self, key: K, message: M) -> Result<Completion<O, M>, SubmitError<M>> {
        let unit = match self.unit_blocking() {
            Ok(unit) => unit,
            Err(refused) => return Err(self.refused(refused.with(message))),
        };
        self.enqueue(key, message, true, unit)
            .map(|(p, c)| Completion::new(c.expect("reply requested"), p))
    }

    /// Submits `message` for `key` if the receiver has credit, without
    /// waiting.
    ///
    /// # Errors
    /// `Full(message)` if `max_in_flight` messages are unfinished (or the
    /// commit span is full), `Closed(message)` if the receiver is closed.
    pub fn try_submit(&self, key: K, message: M) -> Result<Completion<O, M>, SubmitError<M>> {
        let unit = match self.unit_now() {
            Ok(unit) => unit,
            Err(refused) => return Err(self.refused(refused.with(message))),
        };
        self.enqueue(key, message, true, unit)
            .map(|(p, c)| Completion::new(c.expect("reply requested"), p))
    }

    /// Fire-and-forget: enqueues `message` for `key` without a completion
    /// handle, blocking the current thread while the receiver is full
    /// (use [`send_async`](Self::send_async) in async code, or
    /// [`try_send`](Self::try_send) to never block). Returns its position.
    ///
    /// # Errors
    /// As for [`submit`](Self::submit).
    pub fn send(&self, key: K, message: M) -> Result<u64, SubmitError<M>> {
        let unit = match self.unit_blocking() {
            Ok(unit) => unit,
            Err(refused) => return Err(self.refused(refused.with(message))),
        };
        self.enqueue(key, message, false, unit).map(|(p, _)| p)
    }

    /// Fire-and-forget without waiting: enqueues `message` if the receiver
    /// has credit. Returns its position.
    ///
    /// # Errors
    /// `Full(message)` or `Closed(message)`.
    pub fn try_send(&self, key: K, message: M) -> Result<u64, SubmitError<M>> {
        let unit = match self.unit_now() {
            Ok(unit) => unit,
            Err(refused) => return Err(self.refused(refused.with(message))),
        };
        self.enqueue(key, message, false, unit).map(|(p, _)| p)
    }

    /// Fire-and-forget, waiting asynchronously for credit; resolves to the
    /// message's position.
    ///
    /// # Errors
    /// As for [`submit`](Self::submit).
    pub fn send_async(&self, key: K, message: M) -> SendFuture<'_, K, M, O> {
        SendFuture::new(self.submit(key, message))
    }
}

impl<K, M, O> Clone for Receiver<K, M, O> {
    /// A clone shares this receiver's credit, positions and stop.
    fn clone(&self) -> Self {
        Receiver {
            core: self.core.clone_box(),
            source: self.source.clone(),
            metrics: crate::pool::metrics::ReceiverMetrics::new(&self.core.ident().metrics),
        }
    }
}

impl<K, M, O> fmt::Debug for Receiver<K, M, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Receiver")
            .field("in_flight", &self.in_flight())
            .field("max_in_flight", &self.max_in_flight())
            .field("accepted", &self.accepted())
            .field("closed", &self.is_closed())
            .finish()
    }
}

/// A [`Receiver`] that keeps nothing alive: made by
/// [`Receiver::downgrade`]. [`upgrade`](Self::upgrade) gives the receiver
/// back while its dispatcher still has a strong handle (a `Dispatcher` or
/// a `Receiver`), like tokio's `WeakSender`.
///
/// ```
/// use std::sync::atomic::{AtomicUsize, Ordering};
/// use std::sync::{Arc, OnceLock};
/// use keyed_executor::{handler, KeyedExecutor, WeakReceiver};
///
/// let executor = KeyedExecutor::builder().workers(1).build()?;
/// // A saga: each step forwards the next one to the next key, through a
/// // weak handle to its own dispatcher (no reference cycle).
/// let next: Arc<OnceLock<WeakReceiver<u32, u32, ()>>> = Arc::new(OnceLock::new());
/// let steps = Arc::new(AtomicUsize::new(0));
/// let (n, s) = (next.clone(), steps.clone());
/// let dispatcher = executor.dispatcher(handler::from_fn(move |key: &u32, hops: u32| {
///     s.fetch_add(1, Ordering::SeqCst);
///     if hops > 0 {
///         if let Some(r) = n.get().and_then(|w| w.upgrade()) {
///             // From a handler this never waits for credit.
///             r.send(key + 1, hops - 1).expect("forwarded");
///         }
///     }
/// }));
/// let receiver = dispatcher.receiver(2)?;
/// next.set(receiver.downgrade()).ok();
/// receiver.send(0, 5)?;
/// // A stop refuses follow-ups too: let the saga end first.
/// while steps.load(Ordering::SeqCst) < 6 {
///     std::thread::sleep(std::time::Duration::from_millis(1));
/// }
/// assert!(executor.shutdown(std::time::Duration::from_secs(5)));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[cfg(not(loom))]
pub struct WeakReceiver<K, M, O> {
    core: Box<dyn WeakCore<K, M, O>>,
    source: SourceHandle,
}

#[cfg(not(loom))]
impl<K, M, O> WeakReceiver<K, M, O> {
    /// The receiver, while its dispatcher has a strong handle.
    pub fn upgrade(&self) -> Option<Receiver<K, M, O>> {
        let core = self.core.upgrade()?;
        let metrics = crate::pool::metrics::ReceiverMetrics::new(&core.ident().metrics);
        Some(Receiver {
            core,
            source: self.source.clone(),
            metrics,
        })
    }
}

#[cfg(not(loom))]
impl<K, M, O> Clone for WeakReceiver<K, M, O> {
    fn clone(&self) -> Self {
        WeakReceiver {
            core: self.core.clone_box(),
            source: self.source.clone(),
        }
    }
}

#[cfg(not(loom))]
impl<K, M, O> fmt::Debug for WeakReceiver<K, M, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WeakReceiver").finish_non_exhaustive()
    }
}
