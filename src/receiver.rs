//! Receivers: the sources that feed a dispatcher, each with its own credit
//! of `max_in_flight` unfinished messages.
//!
//! # Credit
//!
//! [`Credit`] counts the receiver's messages that are accepted and not
//! finished (queued in a mailbox or running, suspended futures included). A
//! message takes one unit before it is enqueued and gives it back when it
//! finishes: done, panicked, rejected by a force stop, or cancelled. A slow
//! handler therefore slows its source instead of growing a buffer.
//!
//! Waiting for credit (async `submit`/`send_async`, `submit_blocking`/`send`)
//! uses a FIFO of waiters, each a task `Waker` or a parked thread:
//!
//! - acquire: CAS `in_flight` up while below `max`. On failure, register in
//!   the FIFO (setting `has_waiters`), then try once more: a release that ran
//!   in between either saw `has_waiters` and will wake us, or left a unit the
//!   retry takes (both sides use SeqCst, the Dekker pattern).
//! - release(n): `in_flight -= n`, then if `has_waiters`, pop up to `n`
//!   waiters and wake them. A woken waiter retries; if another submitter took
//!   the unit first it registers again.
//! - a waiter that was popped (notified) and is dropped before it retried
//!   passes the notification on, so a unit is never left unused while someone
//!   sleeps.
//!
//! Acquisition is not strictly FIFO (a `try_submit` can barge in); the FIFO
//! only orders who is woken.

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use crate::completion::{Completion, Slot};
use crate::dispatcher::Core;
use crate::error::SubmitError;
use crate::mailbox::Envelope;
use crate::sync::atomic::{AtomicBool, AtomicUsize, Ordering::*};
use crate::sync::{thread, Arc, Mutex};
use crate::waiter::Waiter;

/// The credit of one receiver.
pub(crate) struct Credit {
    in_flight: AtomicUsize,
    max: usize,
    has_waiters: AtomicBool,
    waiters: Mutex<Waiters>,
}

#[derive(Default)]
struct Waiters {
    queue: VecDeque<(u64, Option<Waiter>)>,
    next_id: u64,
}

impl Credit {
    pub(crate) fn new(max: usize) -> Self {
        Credit {
            in_flight: AtomicUsize::new(0),
            max,
            has_waiters: AtomicBool::new(false),
            waiters: Mutex::new(Waiters::default()),
        }
    }

    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight.load(Relaxed)
    }

    /// Takes one unit if one is free.
    #[inline]
    pub(crate) fn try_acquire(&self) -> bool {
        let mut cur = self.in_flight.load(Relaxed);
        loop {
            if cur >= self.max {
                // Re-read with SeqCst so a failing acquire that is followed by
                // registration cannot miss a release (see module docs).
                cur = self.in_flight.load(SeqCst);
                if cur >= self.max {
                    return false;
                }
            }
            match self
                .in_flight
                .compare_exchange_weak(cur, cur + 1, SeqCst, Relaxed)
            {
                Ok(_) => return true,
                Err(actual) => cur = actual,
            }
        }
    }

    /// Gives back `n` units and wakes up to `n` waiters.
    #[inline]
    pub(crate) fn release(&self, n: usize) {
        let prev = self.in_flight.fetch_sub(n, SeqCst);
        debug_assert!(prev >= n, "credit released more than acquired");
        if self.has_waiters.load(SeqCst) {
            self.notify(n);
        }
    }

    #[cold]
    fn notify(&self, n: usize) {
        let mut woken = Vec::new();
        {
            let mut w = self.waiters.lock();
            for _ in 0..n {
                match w.queue.pop_front() {
                    Some((_, waiter)) => woken.extend(waiter),
                    None => break,
                }
            }
            if w.queue.is_empty() {
                self.has_waiters.store(false, SeqCst);
            }
        }
        for waiter in woken {
            waiter.wake();
        }
    }
}

/// One submitter's attempt to take a unit of credit, possibly over several
/// polls. Dropping it deregisters (or passes on a notification it received).
struct Acquire<'a> {
    credit: &'a Credit,
    id: Option<u64>,
}

impl<'a> Acquire<'a> {
    fn new(credit: &'a Credit) -> Self {
        Acquire { credit, id: None }
    }

    /// True when a unit was taken; otherwise the waiter is registered and
    /// will be woken by a release.
    fn poll(&mut self, waiter: &dyn Fn(&mut Option<Waiter>)) -> bool {
        loop {
            if self.credit.try_acquire() {
                if let Some(id) = self.id.take() {
                    // Whether we were still queued or already popped, the
                    // notification (if any) was meant for us and is used.
                    let mut w = self.credit.waiters.lock();
                    if let Some(pos) = w.queue.iter().position(|(i, _)| *i == id) {
                        w.queue.remove(pos);
                        if w.queue.is_empty() {
                            self.credit.has_waiters.store(false, SeqCst);
                        }
                    }
                }
                return true;
            }
            let mut w = self.credit.waiters.lock();
            match self.id {
                Some(id) => match w.queue.iter_mut().find(|(i, _)| *i == id) {
                    Some((_, slot)) => {
                        waiter(slot);
                        return false;
                    }
                    None => {
                        // Popped by a release: retry from scratch.
                        self.id = None;
                    }
                },
                None => {
                    let id = w.next_id;
                    w.next_id += 1;
                    let mut new = None;
                    waiter(&mut new);
                    w.queue.push_back((id, new));
                    self.credit.has_waiters.store(true, SeqCst);
                    self.id = Some(id);
                    drop(w);
                    if self.credit.try_acquire() {
                        self.cancel_registration(true);
                        return true;
                    }
                    return false;
                }
            }
        }
    }

    /// Leaves the queue. If we had been popped (notified) and did not take a
    /// unit, pass the notification on.
    fn cancel_registration(&mut self, acquired: bool) {
        let Some(id) = self.id.take() else { return };
        let mut w = self.credit.waiters.lock();
        if let Some(pos) = w.queue.iter().position(|(i, _)| *i == id) {
            w.queue.remove(pos);
            if w.queue.is_empty() {
                self.credit.has_waiters.store(false, SeqCst);
            }
        } else if !acquired {
            drop(w);
            self.credit.notify(1);
        }
    }
}

impl Drop for Acquire<'_> {
    fn drop(&mut self) {
        self.cancel_registration(false);
    }
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
    credit: Arc<Credit>,
}

impl<K, M, O> Receiver<K, M, O> {
    pub(crate) fn new(core: Box<dyn Core<K, M, O>>, max_in_flight: usize) -> Self {
        Receiver {
            core,
            credit: Arc::new(Credit::new(max_in_flight)),
        }
    }

    /// The most unfinished messages this receiver holds.
    pub fn max_in_flight(&self) -> usize {
        self.credit.max
    }

    /// Messages accepted by this receiver (and its clones) and not finished.
    pub fn in_flight(&self) -> usize {
        self.credit.in_flight()
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
            acquire: Acquire::new(&self.credit),
        }
    }

    /// Submits `message` for `key`, blocking the current thread while the
    /// receiver is full.
    ///
    /// # Errors
    /// `Closed(message)` if the executor is shutting down.
    pub fn submit_blocking(&self, key: K, message: M) -> Result<Completion<O, M>, SubmitError<M>> {
        if self.core.is_closed() {
            return Err(SubmitError::Closed(message));
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
            return Err(SubmitError::Closed(message));
        }
        if !self.credit.try_acquire() {
            return Err(SubmitError::Full(message));
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
        if self.core.is_closed() {
            return Err(SubmitError::Closed(message));
        }
        self.acquire_blocking();
        self.enqueue(key, message, false).map(drop)
    }

    /// Fire-and-forget without waiting: enqueues `message` if the receiver
    /// has credit.
    ///
    /// # Errors
    /// `Full(message)` or `Closed(message)`.
    pub fn try_send(&self, key: K, message: M) -> Result<(), SubmitError<M>> {
        if self.core.is_closed() {
            return Err(SubmitError::Closed(message));
        }
        if !self.credit.try_acquire() {
            return Err(SubmitError::Full(message));
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
                acquire: Acquire::new(&self.credit),
            },
        }
    }

    fn acquire_blocking(&self) {
        let mut acquire = Acquire::new(&self.credit);
        while !acquire.poll(&thread_waiter) {
            thread::park();
        }
        // The unit is ours; forget the (now empty) registration.
        acquire.id = None;
    }

    /// Enqueues a message whose credit unit is already taken.
    fn enqueue(&self, key: K, message: M, reply: bool) -> MaybeCompletion<O, M> {
        let slot = reply.then(|| Arc::new(Slot::new()));
        let env = Envelope {
            msg: message,
            reply: slot.clone(),
            credit: self.credit.clone(),
        };
        // The key's `Hash` and `Eq` run inside: if they panic, the panic
        // goes to the caller with the message, and the unit comes back.
        let unit = ReleaseOnUnwind(&self.credit);
        let enqueued = self.core.enqueue(key, env);
        std::mem::forget(unit);
        match enqueued {
            Ok(()) => Ok(slot.map(Completion::new)),
            Err(env) => {
                let Envelope { msg, credit, .. } = env;
                credit.release(1);
                Err(SubmitError::Closed(msg))
            }
        }
    }
}

/// Gives back one credit unit when dropped: armed while user code that may
/// panic runs between taking a unit and handing it to an envelope.
struct ReleaseOnUnwind<'a>(&'a Credit);

impl Drop for ReleaseOnUnwind<'_> {
    fn drop(&mut self) {
        self.0.release(1);
    }
}

impl<K, M, O> Clone for Receiver<K, M, O> {
    /// A clone shares this receiver's credit.
    fn clone(&self) -> Self {
        Receiver {
            core: self.core.clone_box(),
            credit: self.credit.clone(),
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
            return Poll::Ready(Err(SubmitError::Closed(msg)));
        }
        if !self.acquire.poll(&task_waiter(cx.waker())) {
            return Poll::Pending;
        }
        self.acquire.id = None;
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

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn credit_counts_and_caps() {
        let c = Credit::new(2);
        assert!(c.try_acquire());
        assert!(c.try_acquire());
        assert!(!c.try_acquire());
        c.release(1);
        assert!(c.try_acquire());
        assert_eq!(c.in_flight(), 2);
    }

    #[test]
    fn blocked_acquirer_is_woken_by_release() {
        let c = std::sync::Arc::new(Credit::new(1));
        assert!(c.try_acquire());
        let c2 = c.clone();
        let t = std::thread::spawn(move || {
            let mut a = Acquire::new(&c2);
            while !a.poll(&thread_waiter) {
                std::thread::park();
            }
            a.id = None;
        });
        std::thread::sleep(std::time::Duration::from_millis(10));
        c.release(1);
        t.join().unwrap();
        assert_eq!(c.in_flight(), 1);
        assert!(c.waiters.lock().queue.is_empty());
    }

    #[test]
    fn dropped_notified_waiter_passes_the_wake_on() {
        let c = Credit::new(1);
        assert!(c.try_acquire());
        let mut a = Acquire::new(&c);
        let mut b = Acquire::new(&c);
        assert!(!a.poll(&thread_waiter));
        assert!(!b.poll(&thread_waiter));
        c.release(1); // pops `a`
        drop(a); // never retried: must hand the wake to `b`
        assert!(c.waiters.lock().queue.is_empty(), "b was popped too");
        assert!(b.poll(&thread_waiter));
        b.id = None;
    }
}
