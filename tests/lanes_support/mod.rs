//! Test kernel and helpers shared by the `lanes_*` integration tests.
//!
//! The kernel records every batch it is given and every command it decides,
//! checks that no two batches of one key overlap, and obeys each command's
//! `Op` (succeed, reject, panic, hand back once, fail the append, block on a
//! gate the test opens). Tests assert on these records, never on time.
#![allow(dead_code)]

#[path = "../common/yield_once.rs"]
mod yield_once;
pub use yield_once::YieldOnce;

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll, Waker};

use futures::task::ArcWake;
use keyed_executor::lanes::{BatchResult, Kernel, Lanes};

/// What the kernel does with a command.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// Decided: `Ok(id * 10)`.
    Ok,
    /// Decided: `Err(rejected)`.
    Reject,
    /// Decided: `Err(fatal ...)`.
    Fatal,
    /// Panics while the batch future is polled.
    Panic,
    /// Panics in `execute_batch` itself, before a future exists.
    PanicEarly,
    /// Handed back (with everything after it) the first time it is seen.
    AgainOnce,
    /// Decided Ok, but the batch's append fails.
    FailAppend,
    /// Before the batch decides anything, waits for gate `n` to open.
    Block(u32),
}

/// A command. Deliberately not `Debug`: the crate must not need it.
pub struct Cmd {
    pub id: u64,
    pub op: Op,
}

pub fn cmd(id: u64) -> Cmd {
    Cmd { id, op: Op::Ok }
}

pub fn op(id: u64, op: Op) -> Cmd {
    Cmd { id, op }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TestError(pub String);

impl fmt::Display for TestError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for TestError {}

/// A one-way gate: futures wait until it opens.
#[derive(Default)]
pub struct Gate {
    state: Mutex<(bool, Vec<Waker>)>,
}

impl Gate {
    pub fn open(&self) {
        let wakers = {
            let mut st = self.state.lock().unwrap();
            st.0 = true;
            std::mem::take(&mut st.1)
        };
        for w in wakers {
            w.wake();
        }
    }

    fn poll_open(&self, cx: &mut Context<'_>) -> Poll<()> {
        let mut st = self.state.lock().unwrap();
        if st.0 {
            Poll::Ready(())
        } else {
            if !st.1.iter().any(|w| w.will_wake(cx.waker())) {
                st.1.push(cx.waker().clone());
            }
            Poll::Pending
        }
    }
}

#[derive(Default)]
pub struct Record {
    /// Every batch as given: (key, ids).
    pub batches: Vec<(u32, Vec<u64>)>,
    /// Every decided command, in decision order: (key, id).
    pub decided: Vec<(u32, u64)>,
}

#[derive(Default)]
pub struct TestKernel {
    record: Mutex<Record>,
    started: Condvar,
    running: Mutex<HashSet<u32>>,
    pub overlap: AtomicBool,
    gates: Mutex<HashMap<u32, Arc<Gate>>>,
    again_seen: Mutex<HashSet<u64>>,
    /// Yield once inside every batch (exercises the Pending paths).
    pub yield_inside: AtomicBool,
    /// If set, batches log `(key, "start")` and `(key, "end")` here.
    pub journal: Option<Journal>,
}

/// A log shared by the kernel and a test's hooks.
pub type Journal = Arc<Mutex<Vec<(u32, &'static str)>>>;

impl TestKernel {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn yielding() -> Self {
        let k = Self::default();
        k.yield_inside.store(true, Ordering::SeqCst);
        k
    }

    pub fn with_journal(journal: Journal) -> Self {
        let mut k = Self::yielding();
        k.journal = Some(journal);
        k
    }

    fn note(&self, key: u32, what: &'static str) {
        if let Some(j) = &self.journal {
            j.lock().unwrap().push((key, what));
        }
    }

    pub fn gate(&self, n: u32) -> Arc<Gate> {
        Arc::clone(self.gates.lock().unwrap().entry(n).or_default())
    }

    pub fn open(&self, n: u32) {
        self.gate(n).open();
    }

    pub fn batches(&self) -> Vec<(u32, Vec<u64>)> {
        self.record.lock().unwrap().batches.clone()
    }

    pub fn batch_ids(&self) -> Vec<Vec<u64>> {
        self.batches().into_iter().map(|(_, ids)| ids).collect()
    }

    pub fn decided(&self) -> Vec<(u32, u64)> {
        self.record.lock().unwrap().decided.clone()
    }

    pub fn decided_ids(&self) -> Vec<u64> {
        self.decided().into_iter().map(|(_, id)| id).collect()
    }

    /// Blocks until at least `n` batches have started.
    pub fn wait_batches(&self, n: usize) {
        let mut rec = self.record.lock().unwrap();
        while rec.batches.len() < n {
            rec = self.started.wait(rec).unwrap();
        }
    }

    pub fn saw(&self, id: u64) -> bool {
        self.batches().iter().any(|(_, ids)| ids.contains(&id))
    }
}

struct Running<'a> {
    kernel: &'a TestKernel,
    key: u32,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.kernel.running.lock().unwrap().remove(&self.key);
    }
}

impl Kernel for TestKernel {
    type Key = u32;
    type Command = Cmd;
    type Output = u64;
    type Error = TestError;

    fn execute_batch(
        &self,
        key: &u32,
        commands: Vec<Cmd>,
    ) -> impl Future<Output = BatchResult<Cmd, u64, TestError>> + Send {
        if commands.iter().any(|c| c.op == Op::PanicEarly) {
            panic!("early panic");
        }
        let key = *key;
        async move {
            {
                let mut rec = self.record.lock().unwrap();
                rec.batches
                    .push((key, commands.iter().map(|c| c.id).collect()));
                self.started.notify_all();
            }
            if !self.running.lock().unwrap().insert(key) {
                self.overlap.store(true, Ordering::SeqCst);
            }
            let _running = Running { kernel: self, key };
            self.note(key, "start");
            for c in &commands {
                if let Op::Block(n) = c.op {
                    let gate = self.gate(n);
                    std::future::poll_fn(|cx| gate.poll_open(cx)).await;
                }
            }
            if self.yield_inside.load(Ordering::SeqCst) {
                YieldOnce(false).await;
            }
            let mut outcomes = Vec::new();
            let mut fail_append = false;
            let mut rest = commands.into_iter();
            let mut again = Vec::new();
            for c in rest.by_ref() {
                let outcome = match c.op {
                    Op::Ok | Op::Block(_) => Ok(c.id * 10),
                    Op::Reject => Err(TestError(format!("rejected {}", c.id))),
                    Op::Fatal => Err(TestError(format!("fatal {}", c.id))),
                    Op::Panic => panic!("kernel panic {}", c.id),
                    Op::PanicEarly => unreachable!(),
                    Op::FailAppend => {
                        fail_append = true;
                        Ok(c.id * 10)
                    }
                    Op::AgainOnce => {
                        if self.again_seen.lock().unwrap().insert(c.id) {
                            again.push(c);
                            break;
                        }
                        Ok(c.id * 10)
                    }
                };
                self.record.lock().unwrap().decided.push((key, c.id));
                outcomes.push(outcome);
            }
            again.extend(rest);
            self.note(key, "end");
            let result = if fail_append {
                BatchResult::failed(outcomes.len(), TestError("append failed".into()))
            } else {
                BatchResult::committed(outcomes)
            };
            result.with_again(again)
        }
    }
}

/// A waker that counts its wakes.
#[derive(Default)]
pub struct CountingWaker(pub AtomicUsize);

impl ArcWake for CountingWaker {
    fn wake_by_ref(arc_self: &Arc<Self>) {
        arc_self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// A hand-driven future: poll it when the test says so.
pub struct Manual<F> {
    pub fut: Pin<Box<F>>,
    pub wakes: Arc<CountingWaker>,
}

impl<F: Future> Manual<F> {
    pub fn new(fut: F) -> Self {
        Manual {
            fut: Box::pin(fut),
            wakes: Arc::new(CountingWaker::default()),
        }
    }

    pub fn poll(&mut self) -> Poll<F::Output> {
        let waker = futures::task::waker(Arc::clone(&self.wakes));
        let mut cx = Context::from_waker(&waker);
        self.fut.as_mut().poll(&mut cx)
    }

    pub fn woken(&self) -> usize {
        self.wakes.0.load(Ordering::SeqCst)
    }

    /// Polls, expecting `Pending`.
    pub fn pending(&mut self) {
        assert!(self.poll().is_pending(), "expected Pending");
    }

    /// Polls, expecting `Ready`.
    pub fn ready(&mut self) -> F::Output {
        match self.poll() {
            Poll::Ready(v) => v,
            Poll::Pending => panic!("expected Ready"),
        }
    }
}

/// A caller of `lanes` with `command` for `key`, polled once: it waits (in
/// the queue, or leading a batch that has not finished).
pub fn waiting<K: Kernel>(
    lanes: &Lanes<K>,
    key: K::Key,
    command: K::Command,
) -> Manual<keyed_executor::lanes::Execute<K>> {
    let mut caller = Manual::new(lanes.execute(key, command));
    caller.pending();
    caller
}

/// Lanes over `kernel` with the default settings.
pub fn lanes(kernel: TestKernel) -> Lanes<TestKernel> {
    Lanes::builder(kernel).build().unwrap()
}

/// Nothing is left: no command counted in flight, no lane alive.
pub fn assert_idle<K: Kernel>(lanes: &Lanes<K>) {
    assert_eq!(lanes.in_flight(), 0);
    assert_eq!(lanes.lanes_alive(), 0);
}

/// A tokio runtime of two worker threads, for callers on many tasks.
pub fn tokio_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap()
}

/// Checks that each key's decided ids keep every caller's own order: `seq`
/// gives, per id, (caller, position in that caller's sequence).
pub fn assert_caller_order(decided: &[(u32, u64)], seq: impl Fn(u64) -> (u64, u64)) {
    let mut last: HashMap<u64, u64> = HashMap::new();
    for &(_, id) in decided {
        let (caller, pos) = seq(id);
        if let Some(prev) = last.insert(caller, pos) {
            assert!(
                prev < pos,
                "caller {caller}: command {pos} decided after {prev}"
            );
        }
    }
}
