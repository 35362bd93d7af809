//! Batched submission: [`Receiver::send_batch`] and its `try_` and async
//! forms, for a source that polls records in batches (a Kafka or Redis
//! Streams consumer's `poll`).
//!
//! A batch is taken in *chunks*: each chunk takes its units of credit in
//! one compare-exchange, its positions in one `fetch_add` (so a chunk's
//! positions are consecutive), pushes its messages to the inboxes of the
//! workers their keys live on, in batch order, and then pays one fence and
//! one schedule check per worker it touched. A chunk is as long as the
//! credit (and the commit span) allows at that moment: with enough credit
//! the whole batch is one chunk. The blocking and async forms wait for a
//! unit when none is free and go on with the next chunk; the `try_` form
//! stops at the first chunk it cannot take. Either way the messages not
//! taken are handed back, in batch order, with the positions of those that
//! were ([`BatchError`]).
//!
//! Per-key order holds within a batch (a key's messages are pushed in
//! batch order to the one inbox the key lives on) and relative to single
//! sends from the same thread, before and after.
//!
//! From a handler, as for a single send, a batch never waits: it takes the
//! credit that is free, the running message's own unit for one message if
//! none is, and hands back the rest with `Full`.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::task::{Context, Poll};

use crate::pool::mailbox::{Envelope, Held};
use crate::pool::receiver::{give_back, task_waiter, Receiver, Refused, Unit};
use crate::pool::source::{Acquire, Acquired, UnitRef};
use crate::pool::worker;

/// The positions a batch's messages were given, in batch order: one range
/// of consecutive positions per chunk (see [`Receiver::send_batch`]).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Positions {
    ranges: Vec<Range<u64>>,
}

impl Positions {
    /// How many messages were taken.
    pub fn len(&self) -> usize {
        self.ranges.iter().map(|r| (r.end - r.start) as usize).sum()
    }

    /// No message was taken.
    pub fn is_empty(&self) -> bool {
        self.ranges.is_empty()
    }

    /// Each taken message's position, in batch order.
    pub fn iter(&self) -> impl Iterator<Item = u64> + '_ {
        self.ranges.iter().flat_map(|r| r.clone())
    }

    /// The ranges of consecutive positions, one per chunk, in batch order.
    pub fn ranges(&self) -> &[Range<u64>] {
        &self.ranges
    }

    fn push(&mut self, first: u64, n: u64) {
        match self.ranges.last_mut() {
            Some(last) if last.end == first => last.end += n,
            _ => self.ranges.push(first..first + n),
        }
    }
}

impl fmt::Debug for Positions {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.ranges.iter()).finish()
    }
}

/// A batch was cut: the receiver was full (`try_` forms, or from a
/// handler) or closed. Holds the positions of the messages taken before
/// the cut and hands back every message not taken, in batch order.
pub struct BatchError<K, M> {
    closed: bool,
    sent: Positions,
    rest: Vec<(K, M)>,
}

impl<K, M> BatchError<K, M> {
    /// The receiver was full (only the `try_` forms, and sends from a
    /// handler, stop there).
    pub fn is_full(&self) -> bool {
        !self.closed
    }

    /// The receiver, its dispatcher or the executor refuses new messages.
    pub fn is_closed(&self) -> bool {
        self.closed
    }

    /// The positions of the messages taken before the cut.
    pub fn sent(&self) -> &Positions {
        &self.sent
    }

    /// The messages not taken, in batch order.
    pub fn rest(&self) -> &[(K, M)] {
        &self.rest
    }

    /// The messages not taken, in batch order.
    pub fn into_rest(self) -> Vec<(K, M)> {
        self.rest
    }

    /// The positions taken and the messages not taken.
    pub fn into_parts(self) -> (Positions, Vec<(K, M)>) {
        (self.sent, self.rest)
    }
}

impl<K, M> fmt::Debug for BatchError<K, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BatchError")
            .field("closed", &self.closed)
            .field("sent", &self.sent)
            .field("rest", &self.rest.len())
            .finish()
    }
}

impl<K, M> fmt::Display for BatchError<K, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let why = if self.closed {
            "the receiver is closed"
        } else {
            "the receiver is full"
        };
        write!(
            f,
            "batch cut after {} messages ({} handed back): {why}",
            self.sent.len(),
            self.rest.len()
        )
    }
}

impl<K, M> std::error::Error for BatchError<K, M> {}

/// Where a batch stands: what was taken, what is left.
struct Progress<K, M> {
    sent: Positions,
    rest: VecDeque<(K, M)>,
}

impl<K, M> Progress<K, M> {
    fn new(batch: impl IntoIterator<Item = (K, M)>) -> Self {
        Progress {
            sent: Positions::default(),
            rest: batch.into_iter().collect(),
        }
    }

    fn cut(
        self,
        refused: Refused,
        metrics: &crate::pool::metrics::ReceiverMetrics,
    ) -> BatchError<K, M> {
        for _ in 0..self.rest.len() {
            metrics.refused();
        }
        BatchError {
            closed: matches!(refused, Refused::Closed),
            sent: self.sent,
            rest: self.rest.into(),
        }
    }
}

impl<K, M, O> Receiver<K, M, O> {
    /// Sends a batch, fire-and-forget, in order, blocking the current
    /// thread while the receiver is full (use
    /// [`send_batch_async`](Self::send_batch_async) in async code, or
    /// [`try_send_batch`](Self::try_send_batch) to never block). Credit,
    /// positions, inbox pushes and wake-ups are paid per chunk of the batch
    /// (the whole batch when the credit allows), not per message; see
    /// [`Positions`] for the positions it returns.
    ///
    /// From a handler it never blocks: it takes what credit is free (and
    /// the running message's own unit for one message) and returns `Full`
    /// with the rest.
    ///
    /// ```
    /// use keyed_executor::{handler, KeyedExecutor};
    ///
    /// let executor = KeyedExecutor::builder().workers(2).build()?;
    /// let dispatcher = executor.dispatcher(handler::from_fn(|_: &u64, _: u32| {}));
    /// let receiver = dispatcher.receiver(64)?;
    /// // One poll of a partition: (key, record) pairs in offset order.
    /// let poll: Vec<(u64, u32)> = (0..256).map(|i| (i % 10, i as u32)).collect();
    /// let positions = receiver.send_batch(poll)?;
    /// assert_eq!(positions.len(), 256);
    /// assert_eq!(positions.iter().collect::<Vec<_>>(), (0..256).collect::<Vec<_>>());
    /// # assert!(executor.shutdown(std::time::Duration::from_secs(10)));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// [`BatchError`] (closed: the receiver, its dispatcher or the
    /// executor refuses new messages) with the positions taken so far and
    /// every message not taken, in order.
    pub fn send_batch(
        &self,
        batch: impl IntoIterator<Item = (K, M)>,
    ) -> Result<Positions, BatchError<K, M>> {
        let mut p = Progress::new(batch);
        if worker::in_handler(self.core.shared().id()) {
            return self.batch_now(p);
        }
        loop {
            if p.rest.is_empty() {
                return Ok(p.sent);
            }
            if let Err(refused) = self.chunk_now(&mut p) {
                return Err(p.cut(refused, &self.metrics));
            }
            if p.rest.is_empty() {
                return Ok(p.sent);
            }
            // Out of credit: wait for one unit as `send` does, then take
            // what else is free with it.
            match self.unit_blocking() {
                Ok(_) => {
                    if let Err(refused) = self.chunk(&mut p, 1) {
                        return Err(p.cut(refused, &self.metrics));
                    }
                }
                Err(refused) => return Err(p.cut(refused, &self.metrics)),
            }
        }
    }

    /// Sends as much of a batch as the credit allows now, in order, without
    /// waiting: one chunk, paid once (see [`send_batch`](Self::send_batch)).
    ///
    /// # Errors
    /// [`BatchError`] when the batch could not be taken whole: full (the
    /// positions of the leading messages taken, the rest handed back in
    /// order — send them again later) or closed.
    pub fn try_send_batch(
        &self,
        batch: impl IntoIterator<Item = (K, M)>,
    ) -> Result<Positions, BatchError<K, M>> {
        self.batch_now(Progress::new(batch))
    }

    /// Sends a batch, waiting asynchronously for credit when the receiver is
    /// full (see [`send_batch`](Self::send_batch)); resolves to the
    /// positions. Dropping the future gives up the messages it had not
    /// taken yet (they are dropped); those taken stay accepted.
    ///
    /// # Errors
    /// As for [`send_batch`](Self::send_batch).
    pub fn send_batch_async(
        &self,
        batch: impl IntoIterator<Item = (K, M)>,
    ) -> SendBatchFuture<'_, K, M, O> {
        SendBatchFuture {
            receiver: self,
            progress: Some(Progress::new(batch)),
            acquire: Acquire::new(self.source.source(), worker::flush_held_credit),
        }
    }

    /// One chunk without waiting, and from a handler the running message's
    /// unit for one message if no credit is free; `Full` with the rest.
    fn batch_now(&self, mut p: Progress<K, M>) -> Result<Positions, BatchError<K, M>> {
        if let Err(refused) = self.chunk_now(&mut p) {
            return Err(p.cut(refused, &self.metrics));
        }
        if p.sent.is_empty() && !p.rest.is_empty() {
            // A single send's way: a free unit, else (in a handler) the
            // running message's own.
            match self.unit_now() {
                Ok(Unit::Own) => {
                    if let Err(refused) = self.chunk(&mut p, 1) {
                        return Err(p.cut(refused, &self.metrics));
                    }
                }
                Ok(Unit::Inherited(share)) => {
                    if let Err(refused) = self.send_shared(&mut p, share) {
                        return Err(p.cut(refused, &self.metrics));
                    }
                }
                Err(refused) => return Err(p.cut(refused, &self.metrics)),
            }
        }
        if p.rest.is_empty() {
            Ok(p.sent)
        } else {
            Err(p.cut(Refused::Full, &self.metrics))
        }
    }

    /// Takes a chunk of the free credit (none: `Ok` with nothing taken).
    fn chunk_now(&self, p: &mut Progress<K, M>) -> Result<(), Refused> {
        let source = self.source.source();
        if source.is_closed() || self.core.is_closed() {
            return Err(Refused::Closed);
        }
        let units = source.try_acquire_many(p.rest.len() as u64);
        if units == 0 {
            return Ok(());
        }
        self.chunk(p, units)
    }

    /// Sends the first `units` messages left, holding `units` units of this
    /// source: topped up with what else is free when `units` is 1 after a
    /// wait.
    fn chunk(&self, p: &mut Progress<K, M>, mut units: u64) -> Result<(), Refused> {
        let me = self.source.as_ref();
        let left = p.rest.len() as u64;
        if units == 1 && left > 1 {
            units += self.source.source().try_acquire_many(left - 1);
        }
        /// Gives the units back if a key's `Hash` panics.
        struct Unwind(crate::pool::source::SourceRef, u64);
        impl Drop for Unwind {
            fn drop(&mut self) {
                // SAFETY: the chunk's messages were not accepted; we hold
                // their units.
                unsafe { self.0.release(self.1) };
            }
        }
        let chunk: Vec<(K, Envelope<M, O>)> = p
            .rest
            .drain(..units as usize)
            .map(|(key, msg)| {
                let env = Envelope {
                    msg,
                    reply: None,
                    held: Held::new(me, UnitRef::plain(me)),
                };
                (key, env)
            })
            .collect();
        let unwind = Unwind(me, units);
        let res = self.core.enqueue_batch(chunk);
        std::mem::forget(unwind);
        match res {
            Ok(first) => {
                p.sent.push(first, units);
                Ok(())
            }
            Err(back) => {
                // SAFETY: the refused messages held these units.
                unsafe { me.release(units) };
                for (key, env) in back.into_iter().rev() {
                    p.rest.push_front((key, env.msg));
                }
                Err(Refused::Closed)
            }
        }
    }

    /// Sends the first message left on a share of the running message's
    /// unit (from a handler, with no credit free).
    fn send_shared(&self, p: &mut Progress<K, M>, share: UnitRef) -> Result<(), Refused> {
        let me = self.source.as_ref();
        let (key, msg) = p.rest.pop_front().expect("a message is left");
        // As in a single send: the message keeps this source alive with a
        // handle count while it holds another's unit.
        me.add_ref();
        me.get().share_held();
        let env = Envelope {
            msg,
            reply: None,
            held: Held::new(me, share),
        };
        /// Gives the share back if the key's `Hash` panics.
        struct Unwind(crate::pool::source::SourceRef, UnitRef);
        impl Drop for Unwind {
            fn drop(&mut self) {
                give_back(self.0, Unit::Inherited(self.1));
            }
        }
        let unwind = Unwind(me, share);
        let res = self.core.enqueue_batch(vec![(key, env)]);
        std::mem::forget(unwind);
        match res {
            Ok(position) => {
                p.sent.push(position, 1);
                Ok(())
            }
            Err(mut back) => {
                give_back(me, Unit::Inherited(share));
                let (key, env) = back.pop().expect("handed back");
                p.rest.push_front((key, env.msg));
                Err(Refused::Closed)
            }
        }
    }
}

/// Future of [`Receiver::send_batch_async`].
#[must_use = "futures do nothing unless polled"]
pub struct SendBatchFuture<'a, K, M, O> {
    receiver: &'a Receiver<K, M, O>,
    progress: Option<Progress<K, M>>,
    acquire: Acquire<'a>,
}

// The messages are never pinned: they are moved out by value when sent.
impl<K, M, O> Unpin for SendBatchFuture<'_, K, M, O> {}

impl<K, M, O> Future for SendBatchFuture<'_, K, M, O> {
    type Output = Result<Positions, BatchError<K, M>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let r = this.receiver;
        let p = this
            .progress
            .as_mut()
            .expect("batch future polled after completion");
        if worker::in_handler(r.core.shared().id()) {
            let p = this.progress.take().expect("checked");
            return Poll::Ready(r.batch_now(p));
        }
        loop {
            if p.rest.is_empty() {
                break;
            }
            if let Err(refused) = r.chunk_now(p) {
                let p = this.progress.take().expect("checked");
                return Poll::Ready(Err(p.cut(refused, &r.metrics)));
            }
            if p.rest.is_empty() {
                break;
            }
            match this.acquire.poll(&task_waiter(cx.waker()), &|| r.refuses()) {
                Acquired::Unit => {}
                Acquired::Closed => {
                    let p = this.progress.take().expect("checked");
                    return Poll::Ready(Err(p.cut(Refused::Closed, &r.metrics)));
                }
                // Woken by a release, or by a stop (see `Acquire`).
                Acquired::Waiting => return Poll::Pending,
            }
            if let Err(refused) = r.chunk(p, 1) {
                let p = this.progress.take().expect("checked");
                return Poll::Ready(Err(p.cut(refused, &r.metrics)));
            }
        }
        let p = this.progress.take().expect("checked");
        Poll::Ready(Ok(p.sent))
    }
}

impl<K, M, O> fmt::Debug for SendBatchFuture<'_, K, M, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SendBatchFuture")
            .field("left", &self.progress.as_ref().map_or(0, |p| p.rest.len()))
            .finish()
    }
}
