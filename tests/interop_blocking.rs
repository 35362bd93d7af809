//! Driving the executor and Lanes with no async runtime at all: from
//! `futures::executor::block_on`, from `pollster`, and from plain threads
//! with blocking handles. Handlers "nap" on a timer made of a plain thread,
//! so the wake comes from a thread the executor does not know. Also: what
//! the handles promise (`Send`, `Sync`, `Unpin`, fused after completion).

mod interop_support;

use std::cell::Cell;
use std::future::Future;
use std::pin::Pin;
use std::task::Context;
use std::time::Duration;

use interop_support::*;
use keyed_executor::lanes::{Close, Execute};
use keyed_executor::{handler, Completion, KeyedExecutor, SendFuture, SubmitFuture, TaskError};

fn nap(_key: u32, seq: u32) -> impl Future<Output = ()> + Send + 'static {
    thread_nap(Duration::from_micros(100 * u64::from(seq % 2)))
}

#[test]
fn futures_block_on() {
    let (executor, receiver, log) = napping_receiver(2, nap);
    futures::executor::block_on(submit_and_await(&receiver, &log));
    assert!(executor.shutdown(Duration::from_secs(10)));
}

#[test]
fn pollster_block_on() {
    let (executor, receiver, log) = napping_receiver(2, nap);
    pollster::block_on(submit_and_await(&receiver, &log));
    assert!(executor.shutdown(Duration::from_secs(10)));
}

#[test]
fn plain_threads_with_blocking_handles() {
    let (executor, receiver, log) = napping_receiver(2, nap);
    // Another thread submits and waits; this one only shuts down.
    std::thread::spawn(move || submit_and_wait(&receiver, &log))
        .join()
        .unwrap();
    assert!(executor.shutdown(Duration::from_secs(10)));
}

#[test]
fn lanes_from_block_on_pollster_and_threads() {
    let (lanes, log) = napping_lanes(|| thread_nap(Duration::from_micros(100)));
    futures::executor::block_on(lanes_execute(&lanes, &log));
    let (lanes, log) = napping_lanes(|| thread_nap(Duration::from_micros(100)));
    pollster::block_on(lanes_execute(&lanes, &log));
    let (lanes, log) = napping_lanes(|| thread_nap(Duration::from_micros(100)));
    lanes_execute_blocking(&lanes, &log);
}

/// A message type that is `Send` but not `Sync`.
type NotSync = Cell<u8>;

#[test]
fn handles_are_send_sync_unpin() {
    fn send_sync_unpin<T: Send + Sync + Unpin>() {}
    fn send_unpin<T: Send + Unpin>() {}
    // The completion handle is shareable even when the message is not Sync.
    send_sync_unpin::<Completion<u32, NotSync>>();
    send_sync_unpin::<keyed_executor::Receiver<u32, NotSync, u32>>();
    send_sync_unpin::<keyed_executor::Dispatcher<u32, NotSync, u32>>();
    send_sync_unpin::<KeyedExecutor>();
    // Errors hold the message: as Sync as the message is.
    send_sync_unpin::<TaskError<u8>>();
    send_unpin::<TaskError<NotSync>>();
    // The submit futures hold the message, so they are Send (not Sync).
    send_unpin::<SubmitFuture<'static, u32, NotSync, u32>>();
    send_unpin::<SendFuture<'static, u32, NotSync, u32>>();
    send_unpin::<Execute<NapKernel<fn() -> std::future::Ready<()>>>>();
    send_unpin::<Close<NapKernel<fn() -> std::future::Ready<()>>>>();
}

fn noop_cx() -> Context<'static> {
    Context::from_waker(futures::task::noop_waker_ref())
}

#[test]
fn a_completion_is_fused_after_it_yielded() {
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let receiver = executor
        .dispatcher(handler::from_fn(|_: &u8, n: u8| n))
        .receiver(4)
        .unwrap();
    let mut done = receiver.submit_blocking(1, 7).unwrap();
    assert!(!done.is_terminated());
    let out = futures::executor::block_on(&mut done);
    assert_eq!(out.unwrap(), 7);
    assert!(done.is_finished());
    assert!(done.is_terminated());
    // Polling again is harmless: it stays pending and never yields twice.
    for _ in 0..3 {
        assert!(Pin::new(&mut done).poll(&mut noop_cx()).is_pending());
    }
    // In `futures::select!`, use `.fuse()` (Completion does not implement
    // `FusedFuture`: the crate does not depend on futures-core).
    let mut fused = futures::FutureExt::fuse(receiver.submit_blocking(1, 8).unwrap());
    let out = futures::executor::block_on(async {
        futures::select! { out = fused => out }
    });
    assert_eq!(out.unwrap(), 8);
    assert!(executor.shutdown(Duration::from_secs(5)));
}

#[test]
#[should_panic(expected = "outcome was taken by poll")]
fn waiting_on_a_completion_that_already_yielded_panics() {
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let receiver = executor
        .dispatcher(handler::from_fn(|_: &u8, n: u8| n))
        .receiver(4)
        .unwrap();
    let mut done = receiver.submit_blocking(1, 7).unwrap();
    futures::executor::block_on(&mut done).unwrap();
    let _ = done.wait();
}

#[test]
fn wait_timeout_hands_the_completion_back() {
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let rx = std::sync::Mutex::new(rx);
    let receiver = executor
        .dispatcher(handler::from_fn(move |_: &u8, n: u8| {
            rx.lock().unwrap().recv().unwrap();
            n
        }))
        .receiver(4)
        .unwrap();
    let done = receiver.submit_blocking(1, 9).unwrap();
    let done = done
        .wait_timeout(Duration::from_millis(1))
        .expect_err("blocked until we send");
    tx.send(()).unwrap();
    let out = done.wait_timeout(Duration::from_secs(10)).ok().unwrap();
    assert_eq!(out.unwrap(), 9);
    assert!(executor.shutdown(Duration::from_secs(5)));
}
