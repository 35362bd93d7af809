//! The completion handle of a submitted message: a one-shot result that is a
//! `Future` and can also be waited on from a plain thread.
//!
//! # State machine
//!
//! The shared [`Reply`] is a small mutex-protected record; every transition is
//! made under its lock, so there is no lock-free protocol to get wrong here
//! (the lock is taken twice per message: once by the worker, once by the
//! waiter).
//!
//! | state      | `value`  | `done` | `handle` | meaning                                  |
//! |------------|----------|--------|----------|------------------------------------------|
//! | PENDING    | `None`   | false  | true     | message accepted, not finished           |
//! | READY      | `Some`   | true   | true     | finished; the handle has not taken it    |
//! | TAKEN      | `None`   | true   | true     | the handle took the result (fused)       |
//! | ABANDONED  | `None`   | any    | false    | the handle was dropped                   |
//!
//! Transitions and who makes them:
//! - PENDING → READY: the executor, exactly once ([`Reply::complete`]), then
//!   wakes the registered waiter (a task's `Waker` or a parked thread).
//! - READY → TAKEN: the handle (`poll`, `wait`, `wait_timeout`).
//! - PENDING/READY/TAKEN → ABANDONED: dropping the handle. A value already in
//!   the reply is dropped then and there; a value completed later is dropped by
//!   the completing thread instead of being stored, so nothing finished is
//!   retained for a handle nobody holds.
//!
//! Dropping the handle never cancels the message.

use std::fmt;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use crate::error::TaskError;
use crate::sync::thread;
use crate::sync::{Arc, Mutex};
use crate::waiter::Waiter;

/// The outcome of a message: its handler's output or why there is none.
pub type Outcome<O, M> = Result<O, TaskError<M>>;

struct ReplyState<O, M> {
    value: Option<Outcome<O, M>>,
    done: bool,
    handle: bool,
    waiter: Option<Waiter>,
}

/// The shared half: written once by the executor, read once by the handle.
pub(crate) struct Reply<O, M> {
    state: Mutex<ReplyState<O, M>>,
}

impl<O, M> Reply<O, M> {
    pub(crate) fn new() -> Self {
        Reply {
            state: Mutex::new(ReplyState {
                value: None,
                done: false,
                handle: true,
                waiter: None,
            }),
        }
    }

    /// Delivers the outcome (PENDING → READY) and wakes the waiter. If the
    /// handle is gone the outcome is dropped here, outside the lock.
    pub(crate) fn complete(&self, outcome: Outcome<O, M>) {
        let mut st = self.state.lock();
        debug_assert!(!st.done, "a completion is completed twice");
        st.done = true;
        if !st.handle {
            drop(st);
            // The output (or the rejected message) has a user `Drop`, run
            // here on a worker or a stopping thread: a panic in it must not
            // unwind into the executor.
            let _ = catch_unwind(AssertUnwindSafe(move || drop(outcome)));
            return;
        }
        st.value = Some(outcome);
        let waiter = st.waiter.take();
        drop(st);
        if let Some(w) = waiter {
            w.wake();
        }
    }
}

/// The handle of one submitted message: resolves to the handler's output, or
/// to a [`TaskError`] saying why there is none.
///
/// It is a [`Future`] (`done.await`) and can also be waited on from a plain
/// thread ([`wait`](Self::wait), [`wait_timeout`](Self::wait_timeout)).
/// Dropping it does not cancel the message; the output is then dropped as soon
/// as it is produced. It is `Send`, `Sync` and `Unpin`; after it has yielded
/// its result it is fused: polling it again returns `Pending` and
/// [`is_terminated`](Self::is_terminated) is true.
///
/// Calling `wait` inside an async task blocks that task's thread until the
/// message finishes; prefer `.await` there, or call it on a blocking thread
/// (tokio's `spawn_blocking`). On a current-thread runtime, blocking its only
/// thread on a handler that awaits that runtime's timers or sockets never
/// returns: the runtime cannot run while its thread waits.
///
/// It does not implement `futures::future::FusedFuture` (the crate does not
/// depend on `futures-core`); in `futures::select!`, wrap it with
/// `FutureExt::fuse`.
///
/// ```
/// use keyed_executor::{handler, KeyedExecutor};
///
/// let executor = KeyedExecutor::builder().workers(1).build()?;
/// let receiver = executor
///     .dispatcher(handler::from_fn(|_key: &u32, s: String| s.len()))
///     .receiver(8)?;
/// let done = receiver.submit_blocking(1, "hello".to_string())?;
/// assert_eq!(done.wait()?, 5);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[must_use = "a completion does nothing unless waited on or awaited (dropping it does not cancel the message)"]
pub struct Completion<O, M> {
    reply: Arc<Reply<O, M>>,
    position: u64,
}

impl<O, M> Completion<O, M> {
    pub(crate) fn new(reply: Arc<Reply<O, M>>, position: u64) -> Self {
        Completion { reply, position }
    }

    /// The message's position in its receiver: 0, 1, 2, … in the order the
    /// receiver (and its clones) accepted messages. See
    /// [`Receiver::committable`](crate::Receiver::committable).
    pub fn position(&self) -> u64 {
        self.position
    }

    /// Whether the message has finished (its outcome is ready or was taken).
    pub fn is_finished(&self) -> bool {
        self.reply.state.lock().done
    }

    /// Whether the handle has already yielded its outcome.
    pub fn is_terminated(&self) -> bool {
        let st = self.reply.state.lock();
        st.done && st.value.is_none()
    }

    /// Blocks the current thread until the message finishes.
    ///
    /// # Errors
    /// [`TaskError`]: the handler panicked, the message was rejected by a
    /// force stop (and is handed back), or its future was cancelled.
    ///
    /// # Panics
    /// If the outcome was already taken by an earlier `poll`.
    pub fn wait(self) -> Outcome<O, M> {
        match self.wait_until(None) {
            Ok(outcome) => outcome,
            Err(_) => unreachable!("an untimed wait does not time out"),
        }
    }

    /// Blocks the current thread until the message finishes or `timeout`
    /// passes. On timeout the handle is given back to wait again later.
    ///
    /// ```
    /// # use std::time::Duration;
    /// # use keyed_executor::{handler, KeyedExecutor};
    /// # let executor = KeyedExecutor::builder().workers(1).build()?;
    /// # let receiver = executor.dispatcher(handler::from_fn(|_: &u8, n: u8| n)).receiver(4)?;
    /// let done = receiver.submit_blocking(0, 7)?;
    /// match done.wait_timeout(Duration::from_secs(5)) {
    ///     Ok(outcome) => assert_eq!(outcome?, 7),
    ///     Err(_still_running) => unreachable!("the handler is instant"),
    /// }
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Panics
    /// If the outcome was already taken by an earlier `poll`.
    pub fn wait_timeout(self, timeout: Duration) -> Result<Outcome<O, M>, Self> {
        let deadline = Instant::now().checked_add(timeout);
        self.wait_until(deadline)
    }

    fn wait_until(self, deadline: Option<Instant>) -> Result<Outcome<O, M>, Self> {
        let mut st = self.reply.state.lock();
        loop {
            if let Some(v) = st.value.take() {
                return Ok(v);
            }
            assert!(
                !st.done,
                "Completion::wait called after its outcome was taken by poll"
            );
            st.waiter = Some(Waiter::current_thread());
            drop(st);
            match deadline {
                None => thread::park(),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        self.reply.state.lock().waiter = None;
                        return Err(self);
                    }
                    thread::park_timeout(d - now);
                }
            }
            st = self.reply.state.lock();
        }
    }
}

impl<O, M> Future for Completion<O, M> {
    type Output = Outcome<O, M>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let mut st = self.reply.state.lock();
        if let Some(v) = st.value.take() {
            return Poll::Ready(v);
        }
        if !st.done {
            Waiter::register_task(&mut st.waiter, cx.waker());
        }
        Poll::Pending
    }
}

impl<O, M> Drop for Completion<O, M> {
    fn drop(&mut self) {
        let mut st = self.reply.state.lock();
        st.handle = false;
        st.waiter = None;
        let value = st.value.take();
        drop(st);
        drop(value);
    }
}

impl<O, M> fmt::Debug for Completion<O, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Completion")
            .field("position", &self.position)
            .field("finished", &self.is_finished())
            .finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::task::Wake;

    struct Flag(std::sync::atomic::AtomicBool);
    impl Wake for Flag {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    fn pair() -> (Arc<Reply<u32, &'static str>>, Completion<u32, &'static str>) {
        let reply = Arc::new(Reply::new());
        (reply.clone(), Completion::new(reply, 0))
    }

    #[test]
    fn wait_gets_value_from_another_thread() {
        let (reply, done) = pair();
        let t = std::thread::spawn(move || reply.complete(Ok(7)));
        assert_eq!(done.wait().unwrap(), 7);
        t.join().unwrap();
    }

    #[test]
    fn poll_registers_and_is_woken_then_fused() {
        let (reply, mut done) = pair();
        let flag = std::sync::Arc::new(Flag(Default::default()));
        let waker = std::task::Waker::from(flag.clone());
        let mut cx = Context::from_waker(&waker);
        assert!(Pin::new(&mut done).poll(&mut cx).is_pending());
        reply.complete(Err(TaskError::Rejected("m")));
        assert!(flag.0.load(std::sync::atomic::Ordering::SeqCst));
        match Pin::new(&mut done).poll(&mut cx) {
            Poll::Ready(Err(e)) => assert_eq!(e.into_message(), Some("m")),
            _ => panic!("expected the rejection"),
        }
        assert!(done.is_terminated());
        assert!(Pin::new(&mut done).poll(&mut cx).is_pending());
    }

    #[test]
    fn wait_timeout_gives_the_handle_back() {
        let (reply, done) = pair();
        let done = done.wait_timeout(Duration::from_millis(1)).unwrap_err();
        reply.complete(Ok(1));
        assert_eq!(
            done.wait_timeout(Duration::from_secs(5))
                .ok()
                .unwrap()
                .unwrap(),
            1
        );
    }

    #[test]
    fn dropped_handle_drops_late_value() {
        let (reply, done) = pair();
        drop(done);
        reply.complete(Ok(3));
        assert!(reply.state.lock().value.is_none());
    }
}
