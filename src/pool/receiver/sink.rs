//! [`ReceiverSink`]: a receiver as a [`futures_sink::Sink`] of `(key,
//! message)` pairs (the `sink` feature), so that async pipelines feed a
//! dispatcher with `stream.forward(sink)` or `SinkExt::send_all`.
//!
//! # The protocol
//!
//! Credit is the backpressure. A sink is in one of three states; only the
//! task that owns it moves it (`&mut self`):
//!
//! | state | holds | `start_send(item)` |
//! |---|---|---|
//! | `Idle` | nothing (maybe a registration in the credit wait, `wait`) | tries for a unit without waiting (`Receiver::unit_now`): `Full` or `Closed` hand the item back |
//! | `Reserved` | one unit of the receiver's credit | enqueues the item on that unit: never `Full` |
//! | `Shut` | nothing (`poll_close` was called) | hands the item back as `Closed` |
//!
//! - **Reserve** (`poll_ready`, `Idle`): poll the credit wait (`Acquire`,
//!   `source/credit.rs`) with the task's waker. A unit: `Reserved`, ready.
//!   No unit: the task is a registered waiter (no thread is held) and a
//!   release or a stop wakes it. The receiver, its dispatcher or the
//!   executor closed: ready *without* a unit, so that the item the caller
//!   holds reaches `start_send` and comes back in its error — an error from
//!   `poll_ready` would leave it with the combinator (`forward`, `send`),
//!   which drops it.
//! - **Send** (`start_send`): `Reserved` → `Idle`, the unit goes with the
//!   message. If a stop raced the send, the dispatcher refuses it, the unit
//!   is given back and the item handed back (`Closed`), as for `submit`.
//! - **Give back** (`abort_send`, `poll_close`, drop, or `poll_ready`
//!   finding the receiver closed while `Reserved`): the unit goes back to
//!   the receiver (a release: it wakes a waiting submitter, or a drain).
//!   A registration in the credit wait is withdrawn on drop (passing on a
//!   wake it received, as every submitter does).
//!
//! So a reserved unit is counted like a message in flight: `max_in_flight`
//! bounds messages and reservations together, and a stop that waits for
//! the source to drain (graceful, or `shutdown_now`) waits for a
//! reservation as for a message — until the sink's next `poll_ready` or
//! `start_send` (which give it back, the receiver being closed), or its
//! drop. A combinator holds a reservation only between `poll_ready` and
//! the `start_send` right after; a stop never waits for a *waiting* sink,
//! which holds no unit (it is woken and leaves, as every submitter does).
//!
//! **From a handler** of the receiver's own executor (a handler's future
//! forwarding a stream), `poll_ready` never waits and reserves nothing:
//! `start_send` takes a unit as `try_send` does there (a free one, else a
//! share of the running message's, else `Full` with the item), so a
//! pipeline inside a handler cannot deadlock the pool (see "Sending from a
//! handler" in `admit.rs`).

use std::fmt;
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_sink::Sink;

use super::{give_back, task_waiter, Receiver, Refused, Unit};
use crate::error::SubmitError;
use crate::pool::source::{Acquire, Acquired, Source};
use crate::pool::worker;

/// What a [`ReceiverSink`] holds (see the module docs).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum State {
    Idle,
    Reserved,
    Shut,
}

/// A [`Receiver`] as a [`Sink`](futures_sink::Sink) of `(key, message)`
/// pairs, for async pipelines: `stream.forward(sink)`,
/// `SinkExt::send_all`, `SinkExt::send`. Made by [`Receiver::sink`] (a
/// clone of the receiver inside) or [`Receiver::into_sink`]; needs the
/// `sink` feature.
///
/// - **Backpressure is the receiver's credit.** `poll_ready` reserves one
///   unit of `max_in_flight`, waiting for it without holding a thread (the
///   task is woken when a message of the receiver finishes), and
///   `start_send` enqueues the pair on that unit: after `poll_ready` said
///   ready, `start_send` never refuses for lack of credit. A reserved unit
///   counts like a message in flight, so `max_in_flight` stays a hard
///   bound; dropping the sink (or [`abort_send`](Self::abort_send)) gives
///   an unused reservation back.
/// - **Hold a reservation briefly.** The combinators (`forward`,
///   `send_all`, `send`, `feed`) call `start_send` right after `poll_ready`
///   said ready. Code that calls `poll_ready` by hand and then awaits
///   something else keeps a unit out meanwhile: other submitters find one
///   unit less, and a stop that waits for the receiver to drain — a
///   graceful `shutdown`, and also `shutdown_now`, which returns only once
///   nothing of the source runs — waits for the reservation too, until the
///   sink's next `poll_ready` or `start_send` (which give it back once the
///   receiver is closed), its `abort_send`, or its drop.
/// - **Stops hand the item back.** Once the receiver, its dispatcher or
///   the executor stops taking messages, a waiting `poll_ready` is woken at
///   once and says ready, and `start_send` refuses the item with
///   [`SubmitError::Closed`]`((key, message))`: the combinator ends with
///   that error, and the pair it held is in it (`into_inner`). A stop that
///   races a `start_send` is refused the same way.
/// - **Flush and close.** Each message is accepted by `start_send` itself
///   (it has its position, queued for its key), so `poll_flush` is ready at
///   once: flushed means *accepted*, not finished. `poll_close` gives back
///   a reservation and makes this sink refuse further items (`Closed`); it
///   does not close the receiver or its clones, and does not wait for the
///   messages. To wait until they finished, call
///   [`Receiver::shutdown_async`] (it closes the receiver), or submit
///   through [`Receiver::submit`] and await the [`Completion`](crate::Completion)s
///   when each outcome matters.
/// - **Fire and forget**, like [`Receiver::send`]: a message's output is
///   dropped, a panic goes to the dispatcher's
///   [`on_panic`](crate::DispatcherBuilder::on_panic) hook and a force
///   stop's rejection to its [`on_reject`](crate::DispatcherBuilder::on_reject)
///   hook. [`last_position`](Self::last_position) is the position of the
///   last message this sink sent.
/// - **Order.** Pairs of one key run in the order the sink took them (and
///   in order with everything else sent through the receiver).
/// - **From a handler** of the same executor, `poll_ready` does not wait
///   and `start_send` takes a unit as [`Receiver::try_send`] does there (a
///   free one, else a share of the running message's), else refuses with
///   [`SubmitError::Full`]: a pipeline inside a handler never deadlocks the
///   pool.
///
/// ```
/// use futures::{stream, StreamExt};
/// use keyed_executor::{handler, KeyedExecutor};
///
/// let executor = KeyedExecutor::builder().workers(2).build()?;
/// let dispatcher = executor.dispatcher(handler::from_fn(|account: &u64, amount: i64| {
///     let _ = (account, amount); // apply it
/// }));
/// let receiver = dispatcher.receiver(64)?;
/// let records = stream::iter((0..1_000u64).map(|i| Ok((i % 10, i as i64))));
/// // Waits for credit whenever 64 messages are unfinished, holding no thread.
/// futures::executor::block_on(records.forward(receiver.sink()))?;
/// assert!(receiver.shutdown(std::time::Duration::from_secs(5)));
/// assert_eq!(receiver.accepted(), 1_000);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct ReceiverSink<K, M, O> {
    /// The credit wait in progress, if `poll_ready` returned `Pending`. It
    /// borrows the source of `receiver`: declared first, so dropped first.
    wait: Option<Acquire<'static>>,
    state: State,
    last: Option<u64>,
    receiver: Receiver<K, M, O>,
}

impl<K, M, O> Receiver<K, M, O> {
    /// A [`Sink`](futures_sink::Sink) of `(key, message)` pairs feeding this
    /// receiver (a clone of it: the same credit, positions and stop); see
    /// [`ReceiverSink`]. Needs the `sink` feature.
    pub fn sink(&self) -> ReceiverSink<K, M, O> {
        self.clone().into_sink()
    }

    /// This receiver as a [`ReceiverSink`]. Needs the `sink` feature.
    pub fn into_sink(self) -> ReceiverSink<K, M, O> {
        ReceiverSink {
            wait: None,
            state: State::Idle,
            last: None,
            receiver: self,
        }
    }
}

impl<K, M, O> ReceiverSink<K, M, O> {
    /// The receiver this sink feeds.
    pub fn get_ref(&self) -> &Receiver<K, M, O> {
        &self.receiver
    }

    /// The position of the last message this sink sent, if any.
    pub fn last_position(&self) -> Option<u64> {
        self.last
    }

    /// Whether `poll_ready` reserved a unit that no `start_send` used yet.
    pub fn is_reserved(&self) -> bool {
        self.state == State::Reserved
    }

    /// Gives back a unit `poll_ready` reserved and no `start_send` used,
    /// and stops waiting for one; returns whether a unit was given back.
    /// The sink stays usable: the next `poll_ready` reserves again.
    pub fn abort_send(&mut self) -> bool {
        self.wait = None;
        if self.state != State::Reserved {
            return false;
        }
        self.state = State::Idle;
        give_back(self.receiver.source.as_ref(), Unit::Own);
        true
    }

    /// `poll_ready`'s work (see the module docs).
    fn reserve(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        match self.state {
            State::Shut => return Poll::Ready(()),
            State::Reserved => {
                if self.receiver.refuses() {
                    // A stop came: give the unit back now (a drain may wait
                    // for it); `start_send` hands the item back.
                    self.abort_send();
                }
                return Poll::Ready(());
            }
            State::Idle => {}
        }
        let receiver = &self.receiver;
        if worker::in_handler(receiver.core.shared().id()) {
            // From a handler: never wait (`start_send` tries once).
            return Poll::Ready(());
        }
        let acquire = self.wait.get_or_insert_with(|| {
            let source: *const Source = receiver.source.source();
            // SAFETY: the source lives on the heap for as long as a handle
            // to it lives, and `receiver` (owned by this sink, never
            // replaced or moved out) holds one; `wait` is dropped before
            // `receiver` (field order, and every place that clears it) and
            // the reference never leaves this sink.
            Acquire::new(unsafe { &*source }, worker::flush_held_credit)
        });
        match acquire.poll(&task_waiter(cx.waker()), &|| receiver.refuses()) {
            Acquired::Unit => {
                self.wait = None;
                self.state = State::Reserved;
                Poll::Ready(())
            }
            Acquired::Closed => {
                // Ready without a unit: `start_send` hands the item back.
                self.wait = None;
                Poll::Ready(())
            }
            // Woken by a release, or by a stop.
            Acquired::Waiting => Poll::Pending,
        }
    }

    /// `start_send`'s work (see the module docs).
    fn send(&mut self, key: K, message: M) -> Result<(), SubmitError<(K, M)>> {
        let r = &self.receiver;
        let unit = match std::mem::replace(&mut self.state, State::Idle) {
            State::Shut => {
                self.state = State::Shut;
                Err(Refused::Closed)
            }
            State::Reserved => Ok(Unit::Own),
            State::Idle => r.unit_now(),
        };
        let unit = match unit {
            Ok(unit) => unit,
            Err(refused) => return Err(r.refused(refused.with((key, message)))),
        };
        match r.accept(key, message, false, unit) {
            Ok((position, _)) => {
                self.last = Some(position);
                Ok(())
            }
            Err(item) => Err(r.refused(SubmitError::Closed(item))),
        }
    }
}

impl<K, M, O> Sink<(K, M)> for ReceiverSink<K, M, O> {
    type Error = SubmitError<(K, M)>;

    /// Reserves a unit of credit, waiting for one without holding a
    /// thread. Never fails: once the receiver is closed it is ready
    /// without a unit, and `start_send` hands the item back.
    fn poll_ready(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.get_mut().reserve(cx).map(Ok)
    }

    /// Enqueues the pair on the unit `poll_ready` reserved.
    ///
    /// # Errors
    /// `Closed((key, message))` if the receiver, its dispatcher or the
    /// executor stopped taking messages, or this sink was closed;
    /// `Full((key, message))` only without a reservation (`poll_ready` not
    /// called, or called from a handler and no unit was free).
    fn start_send(self: Pin<&mut Self>, (key, message): (K, M)) -> Result<(), Self::Error> {
        self.get_mut().send(key, message)
    }

    /// Ready at once: every item `start_send` took is accepted already.
    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    /// Gives back a reservation and refuses further items; the receiver
    /// stays open. Ready at once.
    fn poll_close(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        let this = self.get_mut();
        this.abort_send();
        this.state = State::Shut;
        Poll::Ready(Ok(()))
    }
}

impl<K, M, O> Drop for ReceiverSink<K, M, O> {
    fn drop(&mut self) {
        // An unused reservation goes back; `wait` (dropped next, before
        // `receiver`) withdraws a registration.
        self.abort_send();
    }
}

impl<K, M, O> fmt::Debug for ReceiverSink<K, M, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReceiverSink")
            .field("state", &self.state)
            .field("waiting", &self.wait.is_some())
            .field("last_position", &self.last)
            .field("receiver", &self.receiver)
            .finish()
    }
}
