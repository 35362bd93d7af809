//! `futures::task::Spawn` for `KeyedExecutor`: spawned futures run on the
//! pool's workers, hold no worker while pending, and take part in the
//! executor's lifecycle (graceful shutdown waits for them, a force stop
//! drops them, a closed executor refuses them).

mod interop_support;

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::channel::oneshot;
use futures::future::BoxFuture;
use futures::task::{Spawn, SpawnExt};
use interop_support::thread_nap;
use keyed_executor::{handler, KeyedExecutor};

/// Sets its flag when dropped.
struct DropFlag(Arc<AtomicBool>);

impl Drop for DropFlag {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
}

#[test]
fn spawned_futures_run_on_the_workers_and_graceful_shutdown_waits_for_them() {
    let executor = KeyedExecutor::builder()
        .workers(2)
        .thread_name("spawn-pool")
        .build()
        .unwrap();
    let ran = Arc::new(AtomicUsize::new(0));
    for i in 0..50u64 {
        let ran = ran.clone();
        executor
            .spawn(async move {
                // Pending at least once, woken from a foreign thread.
                thread_nap(Duration::from_micros(50 * (i % 4))).await;
                let name = std::thread::current().name().unwrap().to_owned();
                assert!(name.starts_with("spawn-pool-"), "{name}");
                ran.fetch_add(1, Ordering::SeqCst);
            })
            .unwrap();
    }
    assert!(executor.shutdown(Duration::from_secs(10)));
    assert_eq!(ran.load(Ordering::SeqCst), 50);
    let stats = executor.stats().spawned;
    assert_eq!((stats.live, stats.done, stats.cancelled), (0, 50, 0));
}

#[test]
fn spawn_with_handle_from_block_on_and_from_tokio() {
    let executor = KeyedExecutor::builder().workers(2).build().unwrap();
    let handle = executor
        .spawn_with_handle(async {
            thread_nap(Duration::from_micros(100)).await;
            6 * 7
        })
        .unwrap();
    assert_eq!(futures::executor::block_on(handle), 42);

    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let out = rt.block_on(async {
        let handles: Vec<_> = (0..10u32)
            .map(|i| executor.spawn_with_handle(async move { i * 2 }).unwrap())
            .collect();
        futures::future::join_all(handles).await
    });
    assert_eq!(out, (0..10).map(|i| i * 2).collect::<Vec<_>>());
    assert!(executor.shutdown(Duration::from_secs(10)));
}

#[test]
fn a_pending_spawned_future_holds_no_worker() {
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let (tx, rx) = oneshot::channel::<u32>();
    let waiting = executor.spawn_with_handle(rx).unwrap();
    // The only worker still runs other spawned futures and messages.
    let quick = executor.spawn_with_handle(async { 1 }).unwrap();
    assert_eq!(futures::executor::block_on(quick), 1);
    let receiver = executor
        .dispatcher(handler::from_fn(|_: &u8, n: u8| n))
        .receiver(4)
        .unwrap();
    assert_eq!(receiver.submit_blocking(1, 2).unwrap().wait().unwrap(), 2);
    assert_eq!(executor.stats().spawned.live, 1);
    tx.send(3).unwrap();
    assert_eq!(futures::executor::block_on(waiting).unwrap(), 3);
    assert!(executor.shutdown(Duration::from_secs(10)));
}

#[test]
fn a_closed_executor_refuses_spawns() {
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    assert!(executor.status().is_ok());
    assert!(executor.shutdown(Duration::from_secs(5)));
    let err = executor.spawn(async {}).unwrap_err();
    assert!(err.is_shutdown());
    assert!(executor.status().unwrap_err().is_shutdown());

    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    executor.shutdown_now();
    let dropped = Arc::new(AtomicBool::new(false));
    let guard = DropFlag(dropped.clone());
    let err = executor
        .spawn(async move {
            let _g = guard;
        })
        .unwrap_err();
    assert!(err.is_shutdown());
    assert!(
        dropped.load(Ordering::SeqCst),
        "the refused future is dropped"
    );
}

#[test]
fn graceful_shutdown_times_out_on_a_stuck_future_then_shutdown_now_drops_it() {
    let executor = KeyedExecutor::builder().workers(2).build().unwrap();
    let (tx, rx) = oneshot::channel::<()>();
    let dropped = Arc::new(AtomicBool::new(false));
    let guard = DropFlag(dropped.clone());
    let handle = executor
        .spawn_with_handle(async move {
            let _g = guard;
            let _ = rx.await;
        })
        .unwrap();
    assert!(!executor.shutdown(Duration::from_millis(20)));
    assert_eq!(executor.stats().spawned.live, 1);
    assert!(!dropped.load(Ordering::SeqCst));
    executor.shutdown_now();
    assert!(dropped.load(Ordering::SeqCst), "force stop drops it");
    assert!(executor.is_terminated());
    let stats = executor.stats().spawned;
    assert_eq!((stats.live, stats.cancelled), (0, 1));
    // As with every `futures` executor, a `RemoteHandle` whose future was
    // dropped panics when polled.
    let polled = catch_unwind(AssertUnwindSafe(|| futures::executor::block_on(handle)));
    assert!(polled.is_err());
    drop(tx);
}

#[test]
fn dropping_the_last_handle_cancels_pending_spawned_futures() {
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let (_tx, rx) = oneshot::channel::<()>();
    let dropped = Arc::new(AtomicBool::new(false));
    let guard = DropFlag(dropped.clone());
    executor
        .spawn(async move {
            let _g = guard;
            let _ = rx.await;
        })
        .unwrap();
    drop(executor);
    assert!(dropped.load(Ordering::SeqCst));
}

#[test]
fn a_panicking_spawned_future_is_contained() {
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    executor.spawn(async { panic!("boom") }).unwrap();
    // With a handle, the panic goes to the handle.
    let handle = executor
        .spawn_with_handle(async { panic!("handled boom") })
        .unwrap();
    let caught = catch_unwind(AssertUnwindSafe(|| -> () {
        futures::executor::block_on(handle)
    }));
    let payload = caught.unwrap_err();
    assert_eq!(*payload.downcast_ref::<&str>().unwrap(), "handled boom");
    // The worker goes on.
    let after = executor.spawn_with_handle(async { "alive" }).unwrap();
    assert_eq!(futures::executor::block_on(after), "alive");
    assert!(executor.shutdown(Duration::from_secs(5)));
    let stats = executor.stats().spawned;
    assert_eq!(stats.panicked, 1, "the bare spawn's panic is counted");
    assert_eq!(stats.done, 2, "the handle's future caught its own panic");
}

#[test]
fn spawning_from_a_spawned_future_and_from_a_handler() {
    let executor = KeyedExecutor::builder().workers(2).build().unwrap();
    let inner = executor.clone();
    let nested = executor
        .spawn_with_handle(async move {
            let child = inner.spawn_with_handle(async { 5 }).unwrap();
            child.await + 1
        })
        .unwrap();
    assert_eq!(futures::executor::block_on(nested), 6);

    let spawner = executor.clone();
    let results = Arc::new(Mutex::new(Vec::new()));
    let r = results.clone();
    let receiver = executor
        .dispatcher(handler::from_fn(move |key: &u32, n: u32| {
            let r = r.clone();
            let key = *key;
            spawner
                .spawn(async move { r.lock().unwrap().push((key, n)) })
                .is_ok()
        }))
        .receiver(8)
        .unwrap();
    for n in 0..4 {
        assert!(receiver.submit_blocking(n % 2, n).unwrap().wait().unwrap());
    }
    drop(receiver);
    assert!(executor.shutdown(Duration::from_secs(10)));
    assert_eq!(results.lock().unwrap().len(), 4);
}

/// Keyed futures: a dispatcher whose handler is the submitted future runs
/// them one at a time per key, in submission order.
#[test]
fn keyed_futures_through_a_dispatcher() {
    let executor = KeyedExecutor::builder().workers(2).build().unwrap();
    let jobs = executor
        .dispatcher(handler::from_async_fn(
            |_key: u32, job: BoxFuture<'static, u32>| job,
        ))
        .receiver(16)
        .unwrap();
    let log = Arc::new(Mutex::new(Vec::new()));
    let handles: Vec<_> = (0..6u32)
        .map(|i| {
            let log = log.clone();
            let job: BoxFuture<'static, u32> = Box::pin(async move {
                thread_nap(Duration::from_micros(100 * u64::from(3 - i % 3))).await;
                log.lock().unwrap().push(i);
                i
            });
            jobs.submit_blocking(7, job).unwrap()
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        assert_eq!(h.wait().unwrap(), i as u32);
    }
    assert_eq!(*log.lock().unwrap(), (0..6).collect::<Vec<_>>());
    assert!(executor.shutdown(Duration::from_secs(10)));
}

#[test]
fn spawned_futures_awaiting_tokio_timers() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_time()
        .build()
        .unwrap();
    let handle = rt.handle().clone();
    let executor = KeyedExecutor::builder()
        .workers(2)
        .on_thread_start(move || std::mem::forget(handle.enter()))
        .build()
        .unwrap();
    let handles: Vec<_> = (0..8u64)
        .map(|i| {
            executor
                .spawn_with_handle(async move {
                    tokio::time::sleep(Duration::from_millis(i % 3)).await;
                    i
                })
                .unwrap()
        })
        .collect();
    let out = futures::executor::block_on(futures::future::join_all(handles));
    assert_eq!(out, (0..8).collect::<Vec<_>>());
    assert!(executor.shutdown(Duration::from_secs(10)));
}
