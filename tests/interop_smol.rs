//! Driving the executor and Lanes from smol, with handlers and kernels
//! awaiting async-io timers. async-io runs its own reactor thread, so a
//! handler can create a `Timer` on the executor's workers with no set-up.

mod interop_support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_io::Timer;
use futures::future::{select, Either};
use interop_support::*;
use keyed_executor::{handler, KeyedExecutor, WorkerState};

async fn io_nap(d: Duration) {
    Timer::after(d).await;
}

#[test]
fn smol_block_on_submit_await_with_async_io_timers_in_handlers() {
    let (executor, receiver, log) = napping_receiver(2, |_, seq| {
        io_nap(Duration::from_micros(200 * u64::from(seq % 3)))
    });
    smol::block_on(submit_and_await(&receiver, &log));
    assert!(executor.shutdown(Duration::from_secs(10)));
}

#[test]
fn submitting_from_smol_tasks() {
    let (executor, receiver, log) = napping_receiver(2, |_, _| io_nap(Duration::from_micros(100)));
    let task = smol::spawn(async move { submit_and_await(&receiver, &log).await });
    smol::block_on(task);
    assert!(executor.shutdown(Duration::from_secs(10)));
}

#[test]
fn lanes_from_smol_with_async_io_timers_in_the_kernel() {
    let (lanes, log) = napping_lanes(|| io_nap(Duration::from_micros(100)));
    smol::block_on(lanes_execute(&lanes, &log));
}

/// One worker: key 0 waits on an hour-long async-io timer (or a release)
/// while keys 1..=10 complete and the worker parks.
#[test]
fn a_handler_pending_on_an_async_io_timer_keeps_no_worker_busy() {
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let (release_tx, release_rx) = futures::channel::oneshot::channel::<()>();
    let release = Arc::new(std::sync::Mutex::new(Some(release_rx)));
    let started = Arc::new(AtomicBool::new(false));
    let s = started.clone();
    let dispatcher = executor.dispatcher(handler::from_async_fn(move |key: u32, _: ()| {
        let (release, started) = (release.clone(), s.clone());
        async move {
            if key != 0 {
                return "quick";
            }
            started.store(true, Ordering::SeqCst);
            let rx = release.lock().unwrap().take().unwrap();
            match select(Timer::after(Duration::from_secs(3600)), rx).await {
                Either::Left(_) => "timer",
                Either::Right(_) => "released",
            }
        }
    }));
    let receiver = dispatcher.receiver(64).unwrap();
    smol::block_on(async {
        let slow = receiver.submit(0, ()).await.unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !started.load(Ordering::SeqCst) {
            assert!(std::time::Instant::now() < deadline, "key 0 never started");
            Timer::after(Duration::from_millis(1)).await;
        }
        for key in 1..=10 {
            assert_eq!(
                receiver.submit(key, ()).await.unwrap().await.unwrap(),
                "quick"
            );
        }
        assert!(!slow.is_finished());
        while executor.stats().workers[0].state != WorkerState::Parked {
            assert!(
                std::time::Instant::now() < deadline,
                "the worker never parked"
            );
            Timer::after(Duration::from_millis(1)).await;
        }
        release_tx.send(()).unwrap();
        assert_eq!(slow.await.unwrap(), "released");
    });
    assert!(executor.shutdown(Duration::from_secs(10)));
}
