//! Runtime-agnostic scenarios for the interop tests (`tests/interop_*.rs`).
//!
//! Each scenario takes a `nap` function that makes a runtime's timer future
//! (tokio's `sleep`, async-io's `Timer`, or an instant `ready(())` where no
//! runtime exists), so every runtime runs the *same* checks: per-key order
//! with no overlap, every message completed once, credit honoured.
#![allow(dead_code)]

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::join_all;
use keyed_executor::handler::{self, Handler};
use keyed_executor::lanes::{BatchResult, Kernel, Lanes};
use keyed_executor::{KeyedExecutor, Receiver};

/// Messages (or commands) per key, keys per scenario: small, so every
/// runtime's run takes milliseconds.
pub const KEYS: u32 = 8;
pub const PER_KEY: u32 = 12;

/// Records, per key, the message running now and the ones finished, and
/// fails the test on an overlap or an out-of-order message.
#[derive(Clone, Default)]
pub struct OrderLog(Arc<Mutex<HashMap<u32, KeyLog>>>);

/// Per key: the message running now, the ones finished.
type KeyLog = (Option<u32>, Vec<u32>);

impl OrderLog {
    pub fn enter(&self, key: u32, seq: u32) {
        let mut map = self.0.lock().unwrap();
        let (running, done) = map.entry(key).or_default();
        assert!(
            running.is_none(),
            "key {key}: {seq} started while {running:?} runs"
        );
        assert_eq!(
            done.last().map_or(0, |s| s + 1),
            seq,
            "key {key}: out of order"
        );
        *running = Some(seq);
    }

    pub fn exit(&self, key: u32, seq: u32) {
        let mut map = self.0.lock().unwrap();
        let (running, done) = map.get_mut(&key).expect("entered");
        assert_eq!(*running, Some(seq));
        *running = None;
        done.push(seq);
    }

    /// Every key ran exactly `0..per_key`, in order.
    pub fn assert_complete(&self, keys: u32, per_key: u32) {
        let map = self.0.lock().unwrap();
        for key in 0..keys {
            let (running, done) = &map[&key];
            assert!(running.is_none());
            assert_eq!(*done, (0..per_key).collect::<Vec<_>>(), "key {key}");
        }
    }
}

/// An async handler that logs each message around `nap(key, seq).await`,
/// returning the message's sequence number.
pub fn napping_handler<F, Fut>(log: &OrderLog, nap: F) -> impl Handler<u32, u32, Output = u32>
where
    F: Fn(u32, u32) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let log = log.clone();
    handler::from_async_fn(move |key: u32, seq: u32| {
        let log = log.clone();
        let nap = nap(key, seq);
        async move {
            log.enter(key, seq);
            nap.await;
            log.exit(key, seq);
            seq
        }
    })
}

/// An executor plus a napping dispatcher's receiver with a small credit
/// window (so submitters really wait for credit).
pub fn napping_receiver<F, Fut>(
    workers: usize,
    nap: F,
) -> (KeyedExecutor, Receiver<u32, u32, u32>, OrderLog)
where
    F: Fn(u32, u32) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let executor = KeyedExecutor::builder()
        .workers(workers)
        .build()
        .expect("valid settings");
    napping_receiver_on(executor, nap)
}

/// Like [`napping_receiver`] on an executor built by the caller (e.g. with
/// an `on_thread_start` hook).
pub fn napping_receiver_on<F, Fut>(
    executor: KeyedExecutor,
    nap: F,
) -> (KeyedExecutor, Receiver<u32, u32, u32>, OrderLog)
where
    F: Fn(u32, u32) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let log = OrderLog::default();
    let receiver = executor
        .dispatcher(napping_handler(&log, nap))
        .receiver(4)
        .expect("max_in_flight > 0");
    (executor, receiver, log)
}

/// The async scenario: submit `KEYS x PER_KEY` messages with `submit().await`
/// (waiting for credit), then await every completion.
pub async fn submit_and_await(receiver: &Receiver<u32, u32, u32>, log: &OrderLog) {
    let mut handles = Vec::new();
    for seq in 0..PER_KEY {
        for key in 0..KEYS {
            let done = receiver.submit(key, seq).await.expect("executor open");
            handles.push((seq, done));
        }
    }
    for (seq, done) in handles {
        assert_eq!(done.await.expect("completed"), seq);
    }
    credit_returns(receiver);
    log.assert_complete(KEYS, PER_KEY);
}

/// The same scenario from a plain thread: `submit_blocking` and `wait`.
pub fn submit_and_wait(receiver: &Receiver<u32, u32, u32>, log: &OrderLog) {
    let mut handles = Vec::new();
    for seq in 0..PER_KEY {
        for key in 0..KEYS {
            let done = receiver.submit_blocking(key, seq).expect("executor open");
            handles.push((seq, done));
        }
    }
    for (seq, done) in handles {
        assert_eq!(done.wait().expect("completed"), seq);
    }
    credit_returns(receiver);
    log.assert_complete(KEYS, PER_KEY);
}

/// Every unit of credit comes back. A completion resolves just before its
/// message's credit unit is released, so the last one may lag a moment.
fn credit_returns(receiver: &Receiver<u32, u32, u32>) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while receiver.in_flight() != 0 {
        assert!(
            std::time::Instant::now() < deadline,
            "credit never came back"
        );
        std::thread::yield_now();
    }
}

/// A kernel that naps once per batch, logging its commands per key.
pub struct NapKernel<F> {
    nap: F,
    log: OrderLog,
}

impl<F, Fut> Kernel for NapKernel<F>
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    type Key = u32;
    type Command = u32;
    type Output = u32;
    type Error = String;

    fn execute_batch(
        &self,
        key: &u32,
        commands: Vec<u32>,
    ) -> impl Future<Output = BatchResult<u32, u32, String>> + Send {
        let (key, log, nap) = (*key, self.log.clone(), (self.nap)());
        async move {
            for &seq in &commands {
                log.enter(key, seq);
                log.exit(key, seq);
            }
            nap.await;
            BatchResult::committed(commands.into_iter().map(Ok).collect())
        }
    }
}

/// Lanes over a napping kernel.
pub fn napping_lanes<F, Fut>(nap: F) -> (Lanes<NapKernel<F>>, OrderLog)
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let log = OrderLog::default();
    let lanes = Lanes::builder(NapKernel {
        nap,
        log: log.clone(),
    })
    .max_batch(4)
    .build()
    .expect("valid settings");
    (lanes, log)
}

/// The Lanes scenario: one caller per key, all concurrent in one task
/// (`join_all`), each executing `PER_KEY` commands in turn; then close.
pub async fn lanes_execute<F, Fut>(lanes: &Lanes<NapKernel<F>>, log: &OrderLog)
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let callers = (0..KEYS).map(|key| async move {
        for seq in 0..PER_KEY {
            assert_eq!(lanes.execute(key, seq).await.expect("executed"), seq);
        }
    });
    join_all(callers).await;
    log.assert_complete(KEYS, PER_KEY);
    assert!(lanes.close(Duration::from_secs(10)).await);
}

/// The Lanes scenario from plain threads, one per key.
pub fn lanes_execute_blocking<F, Fut>(lanes: &Lanes<NapKernel<F>>, log: &OrderLog)
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    std::thread::scope(|s| {
        for key in 0..KEYS {
            s.spawn(move || {
                for seq in 0..PER_KEY {
                    let out = lanes.execute_blocking(key, seq, Duration::from_secs(10));
                    assert_eq!(out.expect("executed"), seq);
                }
            });
        }
    });
    log.assert_complete(KEYS, PER_KEY);
    assert!(lanes.close_blocking(Duration::from_secs(10)));
}

/// A timer with no runtime at all: a thread sleeps `d`, then wakes the
/// future (from a thread the executor does not know).
pub fn thread_nap(d: Duration) -> impl Future<Output = ()> + Send + 'static {
    let (tx, rx) = futures::channel::oneshot::channel::<()>();
    let mut tx = Some(tx);
    let mut rx = rx;
    let mut started = false;
    std::future::poll_fn(move |cx| {
        if !started {
            started = true;
            let tx = tx.take().expect("armed once");
            std::thread::spawn(move || {
                std::thread::sleep(d);
                let _ = tx.send(());
            });
        }
        std::pin::Pin::new(&mut rx).poll(cx).map(|_| ())
    })
}
