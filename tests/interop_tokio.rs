//! Driving the executor and Lanes from tokio: multi-thread and current-thread
//! runtimes, handlers awaiting tokio timers and tokio I/O, and the two ways
//! to give a handler the tokio context it needs (entering the runtime on
//! each worker with `on_thread_start`, or `Handle::spawn` + awaiting the
//! `JoinHandle`).

mod interop_support;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::future::{select, Either};
use interop_support::*;
use keyed_executor::{handler, KeyedExecutor, WorkerState};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};
use tokio::runtime::{Builder, Handle, Runtime};

fn multi_thread() -> Runtime {
    Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

fn current_thread() -> Runtime {
    Builder::new_current_thread().enable_all().build().unwrap()
}

/// An executor whose workers have entered `handle`'s runtime for their whole
/// life, so handler futures can create tokio timers and sockets. The
/// `EnterGuard` is `!Send` and borrows the handle, so it cannot be kept in
/// the closure: forgetting it leaves the context set until the thread exits
/// (a fresh thread had no previous context to restore, so nothing leaks).
fn executor_in(handle: &Handle, workers: usize) -> KeyedExecutor {
    let handle = handle.clone();
    KeyedExecutor::builder()
        .workers(workers)
        .on_thread_start(move || std::mem::forget(handle.enter()))
        .build()
        .unwrap()
}

fn tokio_nap(_key: u32, seq: u32) -> tokio::time::Sleep {
    tokio::time::sleep(Duration::from_micros(200 * u64::from(seq % 3)))
}

#[test]
fn multi_thread_runtime_submit_await_with_tokio_timers_in_handlers() {
    let rt = multi_thread();
    let (executor, receiver, log) = napping_receiver_on(executor_in(rt.handle(), 2), tokio_nap);
    // Submit from a tokio task (not just from block_on).
    rt.block_on(async move {
        tokio::spawn(async move { submit_and_await(&receiver, &log).await })
            .await
            .unwrap()
    });
    assert!(executor.shutdown(Duration::from_secs(10)));
}

#[test]
fn current_thread_runtime_submit_await_with_tokio_timers_in_handlers() {
    // The timers fire only while the runtime's thread is driven: here it is
    // (block_on awaits the completions).
    let rt = current_thread();
    let (executor, receiver, log) = napping_receiver_on(executor_in(rt.handle(), 2), tokio_nap);
    rt.block_on(submit_and_await(&receiver, &log));
    assert!(executor.shutdown(Duration::from_secs(10)));
}

#[test]
fn handle_spawn_and_join_handle_need_no_context_on_the_workers() {
    let rt = multi_thread();
    let handle = rt.handle().clone();
    let (executor, receiver, log) = napping_receiver(2, move |key, seq| {
        // `sleep()` registers its timer where it is *called*, so call it
        // inside the spawned task, on tokio's threads (calling it here, on
        // the worker, would panic: no reactor). Awaiting a `JoinHandle`
        // needs no context.
        let nap = handle.spawn(async move { tokio_nap(key, seq).await });
        async move { nap.await.unwrap() }
    });
    rt.block_on(submit_and_await(&receiver, &log));
    assert!(executor.shutdown(Duration::from_secs(10)));
}

#[test]
fn handlers_doing_tokio_tcp_io() {
    let rt = multi_thread();
    // A line echo server on loopback.
    let listener = rt.block_on(TcpListener::bind("127.0.0.1:0")).unwrap();
    let addr = listener.local_addr().unwrap();
    let server = rt.spawn(async move {
        loop {
            let (socket, _) = listener.accept().await.unwrap();
            tokio::spawn(async move {
                let (read, mut write) = socket.into_split();
                let mut lines = BufReader::new(read).lines();
                while let Some(line) = lines.next_line().await.unwrap() {
                    write
                        .write_all(format!("{line}\n").as_bytes())
                        .await
                        .unwrap();
                }
            });
        }
    });
    let (executor, receiver, log) =
        napping_receiver_on(executor_in(rt.handle(), 2), move |key, seq| async move {
            let mut stream = TcpStream::connect(addr).await.unwrap();
            let sent = format!("{key}:{seq}");
            stream
                .write_all(format!("{sent}\n").as_bytes())
                .await
                .unwrap();
            let mut echoed = String::new();
            BufReader::new(&mut stream)
                .read_line(&mut echoed)
                .await
                .unwrap();
            assert_eq!(echoed.trim_end(), sent);
        });
    rt.block_on(submit_and_await(&receiver, &log));
    assert!(executor.shutdown(Duration::from_secs(10)));
    server.abort();
}

/// One worker. Key 0 awaits a tokio timer of an hour (or a release); keys
/// 1..=25 all complete meanwhile, and the worker parks: the pending future
/// holds no worker. Deterministic: nothing depends on how fast anything is.
#[test]
fn a_handler_pending_on_a_tokio_timer_keeps_no_worker_busy() {
    let rt = multi_thread();
    let executor = executor_in(rt.handle(), 1);
    let (release_tx, release_rx) = futures::channel::oneshot::channel::<()>();
    let release = Arc::new(std::sync::Mutex::new(Some(release_rx)));
    let started = Arc::new(AtomicBool::new(false));
    let s = started.clone();
    let dispatcher = executor.dispatcher(handler::from_async_fn(move |key: u32, _: ()| {
        let release = release.clone();
        let started = s.clone();
        async move {
            if key != 0 {
                return "quick";
            }
            started.store(true, Ordering::SeqCst);
            let timer = Box::pin(tokio::time::sleep(Duration::from_secs(3600)));
            let rx = release.lock().unwrap().take().unwrap();
            match select(timer, rx).await {
                Either::Left(_) => "timer",
                Either::Right(_) => "released",
            }
        }
    }));
    let receiver = dispatcher.receiver(64).unwrap();
    let slow = receiver.submit_blocking(0, ()).unwrap();
    while !started.load(Ordering::SeqCst) {
        std::thread::yield_now();
    }
    for key in 1..=25 {
        let done = receiver.submit_blocking(key, ()).unwrap();
        assert_eq!(done.wait().unwrap(), "quick");
    }
    assert!(!slow.is_finished(), "key 0 is still waiting on its timer");
    // With nothing else to do, the only worker parks.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while executor.stats().workers[0].state != WorkerState::Parked {
        assert!(
            std::time::Instant::now() < deadline,
            "the worker never parked"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(executor.stats().live_mailboxes, 1, "only key 0 is live");
    release_tx.send(()).unwrap();
    assert_eq!(slow.wait().unwrap(), "released");
    assert!(executor.shutdown(Duration::from_secs(10)));
}

/// The same with a timer that fires: key 0's tokio timer wakes the mailbox
/// from tokio's driver thread and the message completes.
#[test]
fn a_tokio_timer_firing_wakes_the_handler_on_its_worker() {
    let rt = current_thread();
    let executor = executor_in(rt.handle(), 1);
    let dispatcher = executor.dispatcher(handler::from_async_fn(|key: u32, _: ()| async move {
        if key == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        std::thread::current().name().unwrap().to_owned()
    }));
    let receiver = dispatcher.receiver(64).unwrap();
    rt.block_on(async {
        let slow = receiver.submit(0, ()).await.unwrap();
        let quick: Vec<_> = futures::future::join_all((1..=10).map(|k| receiver.submit(k, ())))
            .await
            .into_iter()
            .map(Result::unwrap)
            .collect();
        for done in quick {
            assert_eq!(done.await.unwrap(), "keyed-worker-0");
        }
        assert_eq!(slow.await.unwrap(), "keyed-worker-0");
    });
    assert!(executor.shutdown(Duration::from_secs(10)));
}

#[test]
fn lanes_from_tokio_multi_thread_and_current_thread() {
    for rt in [multi_thread(), current_thread()] {
        let (lanes, log) = napping_lanes(|| tokio::time::sleep(Duration::from_micros(100)));
        rt.block_on(lanes_execute(&lanes, &log));
    }
    // Callers as separate tokio tasks on the multi-thread runtime.
    let rt = multi_thread();
    let (lanes, log) = napping_lanes(|| tokio::time::sleep(Duration::from_micros(100)));
    rt.block_on(async {
        let tasks: Vec<_> = (0..KEYS)
            .map(|key| {
                let lanes = lanes.clone();
                tokio::spawn(async move {
                    for seq in 0..PER_KEY {
                        assert_eq!(lanes.execute(key, seq).await.unwrap(), seq);
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        assert!(lanes.close(Duration::from_secs(10)).await);
    });
    log.assert_complete(KEYS, PER_KEY);
}

/// `wait()` blocks its thread: inside tokio, call it on a blocking thread
/// (`spawn_blocking`, `block_in_place`), or just `.await` the handle.
#[test]
fn blocking_wait_from_tokio_on_a_blocking_thread() {
    let rt = multi_thread();
    let (executor, receiver, _log) = napping_receiver(2, |_, _| std::future::ready(()));
    rt.block_on(async move {
        let done = receiver.submit(0, 0).await.unwrap();
        let out = tokio::task::spawn_blocking(move || done.wait())
            .await
            .unwrap();
        assert_eq!(out.unwrap(), 0);
        let done = receiver.submit(0, 1).await.unwrap();
        let out = tokio::task::block_in_place(move || done.wait());
        assert_eq!(out.unwrap(), 1);
    });
    assert!(executor.shutdown(Duration::from_secs(10)));
}

/// Credit backpressure from async code: a full receiver makes `submit`
/// wait without holding a runtime thread (the current-thread runtime keeps
/// running other tasks meanwhile).
#[test]
fn async_submit_waits_for_credit_without_blocking_the_runtime() {
    let rt = current_thread();
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let (gate_tx, gate_rx) = futures::channel::oneshot::channel::<()>();
    let gate = Arc::new(std::sync::Mutex::new(Some(gate_rx)));
    let dispatcher = executor.dispatcher(handler::from_async_fn(move |_: u32, n: u32| {
        let gate = gate.lock().unwrap().take();
        async move {
            if let Some(gate) = gate {
                let _ = gate.await;
            }
            n
        }
    }));
    let receiver = dispatcher.receiver(1).unwrap();
    rt.block_on(async {
        let first = receiver.submit(1, 1).await.unwrap();
        // The receiver is full: the second submit waits for credit...
        let second = tokio::spawn({
            let receiver = receiver.clone();
            async move { receiver.submit(2, 2).await.unwrap().await.unwrap() }
        });
        // ...while this task (same thread) still runs and opens the gate.
        tokio::task::yield_now().await;
        assert!(!second.is_finished());
        assert_eq!(receiver.in_flight(), 1);
        gate_tx.send(()).unwrap();
        assert_eq!(first.await.unwrap(), 1);
        assert_eq!(second.await.unwrap(), 2);
    });
    assert!(executor.shutdown(Duration::from_secs(10)));
}
