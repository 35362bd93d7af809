//! The seam every design plugs into: a [`Handler`] (what runs for a message,
//! sync or async), a [`Design`] (how messages reach it) and a [`Family`] (the
//! design, for any handler).

use super::device::DeviceHandle;
use super::latency::{Recorder, Stamps};
use super::work::{spin_work, Checker, Gate, Msg};
use std::future::{ready, Future, Ready};
use std::hint::black_box;
use std::pin::{pin, Pin};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll, Wake, Waker};
use std::thread::{self, Thread};
use std::time::Duration;

/// What runs for one message of one key.
pub trait Handler: Send + Sync + 'static {
    /// The async form's future (a ready one for sync handlers).
    type Fut: Future<Output = ()> + Send + 'static;
    /// The handler awaits (W3): async designs poll [`call`](Self::call),
    /// sync designs block their thread in [`call_blocking`](Self::call_blocking).
    const ASYNC: bool;
    /// The async form.
    fn call(&self, key: u64, msg: Msg) -> Self::Fut;
    /// The blocking form: runs the message to its end on this thread.
    fn call_blocking(&self, key: u64, msg: Msg) {
        block_on(self.call(key, msg));
    }
}

/// Sends a message to a key, from any thread, handlers included.
pub trait SendTo: Clone + Send + Sync + 'static {
    /// Sends; panics if the design is stopped (a harness bug).
    fn send(&self, key: u64, msg: Msg);
    /// Sends one poll of a batched source (W1b), in order, in the design's
    /// natural batched form. The default is one [`send`](Self::send) per
    /// message (the actor peers' natural form: a channel per key).
    fn send_batch(&self, batch: Vec<(u64, Msg)>) {
        for (k, m) in batch {
            self.send(k, m);
        }
    }
}

/// Settings shared by every design of a run.
#[derive(Clone, Copy, Debug)]
pub struct Cfg {
    /// Threads that run handlers (the same for every design).
    pub workers: usize,
    /// keyed-executor only: a worker's spin before it parks.
    pub spin: Duration,
    /// keyed-executor only: the receiver's `max_in_flight`.
    pub credit: usize,
}

/// A design running one handler.
pub trait Design<H: Handler>: Sized {
    /// Its sending handle.
    type Sender: SendTo;
    /// Starts the design's threads.
    fn start(cfg: &Cfg, handler: H) -> Self;
    /// A sending handle.
    fn sender(&self) -> Self::Sender;
    /// A sending handle for one more independent source (W7: one per
    /// producer thread). The default is a clone of [`sender`](Self::sender),
    /// which is what the peers offer; keyed-executor gives each source its
    /// own receiver, with its own credit.
    fn source(&self) -> Self::Sender {
        self.sender()
    }
    /// A sending function for a handler that sends to its own design (W4).
    /// The default wraps a [`sender`](Self::sender); keyed-executor gives a
    /// `WeakReceiver`, so that the handler does not keep its own dispatcher
    /// alive (a reference cycle).
    #[allow(clippy::type_complexity)]
    fn handler_sender(&self) -> Box<dyn Fn(u64, Msg) + Send + Sync> {
        let sender = self.sender();
        Box::new(move |k, m| sender.send(k, m))
    }
    /// Stops the threads once the harness saw every message finish.
    fn finish(self);
}

/// A design for any handler.
pub trait Family {
    /// The design running handler `H`.
    type D<H: Handler>: Design<H>;
    /// Handlers run on the producer's own thread (`inline`): nothing may block them.
    const SAME_THREAD: bool = false;
    /// Runs an async handler by blocking its thread until the future is done
    /// (W3 gives these designs a smaller message count).
    const BLOCKS_ON_IO: bool = false;
}

struct ThreadWaker(Thread);

impl Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

/// Runs a future to completion on this thread, parking while it is pending.
pub fn block_on<F: Future>(fut: F) -> F::Output {
    thread_local! {
        static WAKER: Waker = Waker::from(Arc::new(ThreadWaker(thread::current())));
    }
    let mut fut = pin!(fut);
    WAKER.with(|waker| {
        let mut cx = Context::from_waker(waker);
        loop {
            if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
                return v;
            }
            thread::park();
        }
    })
}

/// W1, W2, W5, W6, W8: check the sequence around `iters` of CPU work.
pub struct CpuHandler {
    /// The run's checker.
    pub checker: Arc<Checker>,
    /// Iterations of [`spin_work`].
    pub iters: u64,
    /// W5: hold every handler until memory is read.
    pub gate: Option<Arc<Gate>>,
}

impl Handler for CpuHandler {
    type Fut = Ready<()>;
    const ASYNC: bool = false;

    fn call(&self, key: u64, msg: Msg) -> Ready<()> {
        self.call_blocking(key, msg);
        ready(())
    }

    #[inline]
    fn call_blocking(&self, key: u64, msg: Msg) {
        if let Some(gate) = &self.gate {
            gate.wait();
        }
        self.checker.begin(key, msg);
        black_box(spin_work(self.iters));
        self.checker.end(key, msg);
    }
}

/// The open-loop latency row (`--latency`): W1's handler, stamping the
/// moment each message's work is done (before the checker counts it off,
/// so every stamp is written when the harness's wait returns).
pub struct DoneHandler {
    /// The run's checker.
    pub checker: Arc<Checker>,
    /// Per message: when its work was done.
    pub done: Arc<Stamps>,
    /// Iterations of [`spin_work`].
    pub iters: u64,
}

impl Handler for DoneHandler {
    type Fut = Ready<()>;
    const ASYNC: bool = false;

    fn call(&self, key: u64, msg: Msg) -> Ready<()> {
        self.call_blocking(key, msg);
        ready(())
    }

    #[inline]
    fn call_blocking(&self, key: u64, msg: Msg) {
        self.checker.begin(key, msg);
        black_box(spin_work(self.iters));
        self.done.stamp(key, msg);
        self.checker.end(key, msg);
    }
}

/// W9: CPU work, `slow_iters` for the slow key and `iters` for the others;
/// records when each message starts and when each key's last one ends.
pub struct SlowKeyHandler {
    /// The run's checker.
    pub checker: Arc<Checker>,
    /// The run's start and end times.
    pub recorder: Arc<Recorder>,
    /// Iterations of [`spin_work`] for a fast key.
    pub iters: u64,
    /// The slow key.
    pub slow_key: u64,
    /// Iterations of [`spin_work`] for the slow key (`iters` in the baseline).
    pub slow_iters: u64,
}

impl Handler for SlowKeyHandler {
    type Fut = Ready<()>;
    const ASYNC: bool = false;

    fn call(&self, key: u64, msg: Msg) -> Ready<()> {
        self.call_blocking(key, msg);
        ready(())
    }

    #[inline]
    fn call_blocking(&self, key: u64, msg: Msg) {
        self.recorder.started(key, msg);
        self.checker.begin(key, msg);
        let iters = if key == self.slow_key {
            self.slow_iters
        } else {
            self.iters
        };
        black_box(spin_work(iters));
        if msg.last {
            self.recorder.ended(key);
        }
        self.checker.end(key, msg);
    }
}

/// W3: begin, issue an I/O and await it, end.
///
/// The checker and the device are `&'static` (leaked once per run) so the
/// per-message future clones no `Arc`: a shared refcount touched by both
/// workers on every message would cost every async design the same
/// contended cache line and blur the comparison.
pub struct IoHandler {
    /// The run's checker.
    pub checker: &'static Checker,
    /// The run's device.
    pub device: &'static DeviceHandle,
}

/// The future of one W3 message. The I/O is issued at the first poll, i.e.
/// when the design actually starts the message, not when it calls the fn.
pub struct IoCall {
    checker: &'static Checker,
    device: &'static DeviceHandle,
    key: u64,
    msg: Msg,
    io: Option<super::device::Io>,
}

impl Future for IoCall {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        let io = this.io.get_or_insert_with(|| {
            this.checker.begin(this.key, this.msg);
            this.device.io()
        });
        match Pin::new(io).poll(cx) {
            Poll::Ready(()) => {
                this.checker.end(this.key, this.msg);
                Poll::Ready(())
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Handler for IoHandler {
    type Fut = IoCall;
    const ASYNC: bool = true;

    fn call(&self, key: u64, msg: Msg) -> IoCall {
        IoCall {
            checker: self.checker,
            device: self.device,
            key,
            msg,
            io: None,
        }
    }
}

/// W4: key `a` and key `b` send each other the ball, `rounds` round trips.
pub struct PingHandler {
    /// The run's checker.
    pub checker: Arc<Checker>,
    /// The two keys.
    pub a: u64,
    /// See `a`.
    pub b: u64,
    /// Round trips.
    pub rounds: u32,
    /// The design's sender, set once the design has started.
    #[allow(clippy::type_complexity)]
    pub send: Arc<OnceLock<Box<dyn Fn(u64, Msg) + Send + Sync>>>,
}

impl Handler for PingHandler {
    type Fut = Ready<()>;
    const ASYNC: bool = false;

    fn call(&self, key: u64, msg: Msg) -> Ready<()> {
        self.call_blocking(key, msg);
        ready(())
    }

    fn call_blocking(&self, key: u64, msg: Msg) {
        self.checker.begin(key, msg);
        // `a` gets seq 0..=rounds, `b` gets seq 0..rounds.
        let next = if key == self.a {
            (msg.seq < self.rounds).then_some((
                self.b,
                Msg {
                    seq: msg.seq,
                    last: msg.seq + 1 == self.rounds,
                },
            ))
        } else {
            Some((
                self.a,
                Msg {
                    seq: msg.seq + 1,
                    last: msg.seq + 1 == self.rounds,
                },
            ))
        };
        self.checker.end(key, msg);
        if let Some((k, m)) = next {
            (self
                .send
                .get()
                .expect("sender set before the first message"))(k, m);
        }
    }
}
