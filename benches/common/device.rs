//! The simulated device of W3: I/O operations that complete a fixed delay
//! (~100 µs) after they were issued, completed by one device thread.
//!
//! Every operation has the same delay, so the device's timer queue is a FIFO
//! ordered by deadline (a timer wheel with one slot): issue pushes at the
//! back, the device thread pops what is due at the front, completes it, and
//! sleeps until the next deadline (timer slack set to 1 ns so the sleep is
//! close to the deadline). Issuing wakes the device thread only when the
//! queue was empty.
//!
//! An operation is a oneshot: [`Io`] is a `Future` for async handlers, and a
//! sync design blocks its thread on it with [`block_on`](super::design::block_on).

use atomic_waker::AtomicWaker;
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering::*};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::thread::{self, JoinHandle, Thread};
use std::time::{Duration, Instant};

#[derive(Default)]
struct Op {
    done: AtomicBool,
    waker: AtomicWaker,
}

/// An issued I/O operation; resolves when the device completes it.
pub struct Io(Arc<Op>);

impl Future for Io {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.0.done.load(Acquire) {
            return Poll::Ready(());
        }
        self.0.waker.register(cx.waker());
        if self.0.done.load(Acquire) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

struct Shared {
    queue: Mutex<VecDeque<(Instant, Arc<Op>)>>,
    delay: Duration,
    thread: Thread,
}

/// Issues operations; cheap to share (`&'static` or in an `Arc`).
pub struct DeviceHandle(Arc<Shared>);

impl DeviceHandle {
    /// Issues an operation that completes `delay` from now.
    pub fn io(&self) -> Io {
        let op = Arc::new(Op::default());
        let deadline = Instant::now() + self.0.delay;
        let was_empty = {
            let mut q = self.0.queue.lock().unwrap();
            let was_empty = q.is_empty();
            q.push_back((deadline, op.clone()));
            was_empty
        };
        if was_empty {
            self.0.thread.unpark();
        }
        Io(op)
    }
}

/// The device thread. The harness starts one for the process and keeps it:
/// parked with an empty queue it costs nothing.
pub struct Device {
    handle: Arc<Shared>,
    _thread: JoinHandle<()>,
}

impl Device {
    /// Starts the device thread.
    pub fn start(delay: Duration) -> Self {
        let (tx, rx) = std::sync::mpsc::channel();
        let thread = thread::Builder::new()
            .name("bench-device".into())
            .spawn(move || {
                // SAFETY: prctl(PR_SET_TIMERSLACK) takes a plain integer and
                // only changes this thread's timer slack.
                #[cfg(target_os = "linux")]
                unsafe {
                    libc::prctl(libc::PR_SET_TIMERSLACK, 1 as libc::c_ulong);
                }
                let shared: Arc<Shared> = rx.recv().unwrap();
                run(&shared);
            })
            .expect("spawn the device thread");
        let handle = Arc::new(Shared {
            queue: Mutex::new(VecDeque::new()),
            delay,
            thread: thread.thread().clone(),
        });
        tx.send(handle.clone()).unwrap();
        Device {
            handle,
            _thread: thread,
        }
    }

    /// A handle that issues operations.
    pub fn handle(&self) -> DeviceHandle {
        DeviceHandle(self.handle.clone())
    }
}

fn run(shared: &Shared) {
    let mut due = Vec::new();
    loop {
        let now = Instant::now();
        let next = {
            let mut q = shared.queue.lock().unwrap();
            while q.front().is_some_and(|(d, _)| *d <= now) {
                due.push(q.pop_front().unwrap().1);
            }
            q.front().map(|(d, _)| *d)
        };
        for op in due.drain(..) {
            op.done.store(true, Release);
            op.waker.wake();
        }
        match next {
            Some(deadline) => {
                let now = Instant::now();
                if deadline > now {
                    thread::park_timeout(deadline - now);
                }
            }
            None => thread::park(),
        }
    }
}
