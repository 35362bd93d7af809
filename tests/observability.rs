//! What users build their metrics on: `stats()` snapshots, a receiver's
//! `in_flight()`, a dispatcher's `live_mailboxes()`, and the builder's
//! `on_thread_start` / `on_thread_stop` hooks.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{eventually, shutdown_now_elsewhere, Gate};
use futures::channel::oneshot;
use keyed_executor::{handler, KeyedExecutor, TaskError, WorkerState};

type Names = Arc<Mutex<Vec<String>>>;

fn hooked(workers: usize, prefix: &str) -> (KeyedExecutor, Names, Names) {
    let started: Names = Arc::default();
    let stopped: Names = Arc::default();
    let (s, t) = (started.clone(), stopped.clone());
    let name = || std::thread::current().name().unwrap_or("?").to_owned();
    let executor = KeyedExecutor::builder()
        .workers(workers)
        .thread_name(prefix)
        .on_thread_start(move || s.lock().unwrap().push(name()))
        .on_thread_stop(move || t.lock().unwrap().push(name()))
        .build()
        .unwrap();
    (executor, started, stopped)
}

fn sorted(names: &Names) -> Vec<String> {
    let mut v = names.lock().unwrap().clone();
    v.sort();
    v
}

fn expected(prefix: &str, n: usize) -> Vec<String> {
    let mut v: Vec<_> = (0..n).map(|i| format!("{prefix}-{i}")).collect();
    v.sort();
    v
}

#[test]
fn thread_hooks_run_on_every_worker_start_before_build_returns_stop_before_shutdown_returns() {
    let (executor, started, stopped) = hooked(3, "hooked");
    // Every start hook ran, on the worker itself, before `build()` returned.
    assert_eq!(sorted(&started), expected("hooked", 3));
    assert!(stopped.lock().unwrap().is_empty());
    assert!(executor.shutdown(Duration::from_secs(5)));
    // Every stop hook ran, on its worker, before `shutdown` returned.
    assert_eq!(sorted(&stopped), expected("hooked", 3));
}

#[test]
fn thread_stop_hooks_run_before_shutdown_now_and_drop_return() {
    let (executor, _, stopped) = hooked(2, "forced");
    executor.shutdown_now();
    assert_eq!(sorted(&stopped), expected("forced", 2));

    let (executor, _, stopped) = hooked(2, "dropped");
    drop(executor);
    assert_eq!(sorted(&stopped), expected("dropped", 2));
}

#[test]
fn a_thread_start_hook_can_set_thread_locals_the_handlers_see() {
    thread_local!(static WORKER_TAG: std::cell::Cell<u32> = const { std::cell::Cell::new(0) });
    let executor = KeyedExecutor::builder()
        .workers(2)
        .on_thread_start(|| WORKER_TAG.with(|t| t.set(7)))
        .build()
        .unwrap();
    let receiver = executor
        .dispatcher(handler::from_fn(|_: &u8, ()| WORKER_TAG.with(|t| t.get())))
        .receiver(4)
        .unwrap();
    assert_eq!(receiver.submit_blocking(1, ()).unwrap().wait().unwrap(), 7);
    assert!(executor.shutdown(Duration::from_secs(5)));
}

#[test]
fn stats_count_every_outcome() {
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let gate = Gate::new();
    let g = gate.clone();
    let entered = Arc::new(AtomicUsize::new(0));
    let e = entered.clone();
    let dispatcher = executor.dispatcher(handler::from_fn(move |key: &u32, n: u32| {
        match (*key, n) {
            (0, _) => {
                e.fetch_add(1, Ordering::SeqCst);
                g.wait()
            }
            (_, 13) => panic!("unlucky"),
            _ => {}
        }
        n
    }));
    let receiver = dispatcher.receiver(64).unwrap();
    for n in 0..5 {
        receiver.submit_blocking(1, n).unwrap().wait().unwrap();
    }
    let failed = receiver.submit_blocking(1, 13).unwrap().wait().unwrap_err();
    assert!(failed.is_panic());

    // Key 0 blocks the only worker; three more keys queue behind it.
    let blocker = receiver.submit_blocking(0, 0).unwrap();
    eventually("key 0 runs, key 1 retired", || {
        entered.load(Ordering::SeqCst) == 1 && dispatcher.live_mailboxes() == 1
    });
    let queued: Vec<_> = (2..5)
        .map(|k| receiver.submit_blocking(k, k).unwrap())
        .collect();
    let stats = executor.stats();
    assert_eq!(stats.workers.len(), 1);
    assert_eq!(stats.workers[0].state, WorkerState::Running);
    // The three messages wait on the blocked worker, in its inbox: the port
    // whose turn runs key 0 counts as a queued task, and their keys have no
    // mailbox yet (only key 0's is live).
    assert!(stats.workers[0].queued_tasks >= 1);
    assert_eq!(stats.workers[0].inbox, 3);
    assert_eq!(stats.live_mailboxes, 1);
    assert_eq!(dispatcher.live_mailboxes(), 1);
    assert_eq!(receiver.in_flight(), 4);
    assert_eq!((stats.done, stats.panicked, stats.rejected), (5, 1, 0));
    assert!(!stats.closed);

    // Force stop from another thread while key 0 still runs: the three
    // queued messages come back; the running one finishes.
    let stopper = shutdown_now_elsewhere(&executor);
    eventually("the stop handed the queue back", || {
        executor.stats().rejected == 3
    });
    gate.open();
    stopper.join().unwrap();
    for (k, done) in (2..5).zip(queued) {
        match done.wait() {
            Err(TaskError::Rejected(msg)) => assert_eq!(msg, k),
            other => panic!("expected a rejection, got {other:?}"),
        }
    }
    assert_eq!(blocker.wait().unwrap(), 0);
    let stats = executor.stats();
    assert_eq!((stats.done, stats.panicked, stats.rejected), (6, 1, 3));
    assert_eq!(stats.live_mailboxes, 0);
    assert_eq!(stats.workers[0].state, WorkerState::Exited);
    assert_eq!(stats.workers[0].done, 6);
    assert!(stats.closed);
    assert_eq!(receiver.in_flight(), 0, "every unit of credit came back");
}

#[test]
fn stats_count_cancelled_futures_and_parks() {
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let (_tx, rx) = oneshot::channel::<()>();
    let rx = Mutex::new(Some(rx));
    let receiver = executor
        .dispatcher(handler::from_async_fn(move |_: u8, ()| {
            let rx = rx.lock().unwrap().take();
            async move {
                if let Some(rx) = rx {
                    let _ = rx.await;
                }
            }
        }))
        .receiver(4)
        .unwrap();
    let pending = receiver.submit_blocking(1, ()).unwrap();
    eventually("the worker parks with the future pending", || {
        let s = executor.stats();
        s.workers[0].state == WorkerState::Parked && s.workers[0].parks >= 1
    });
    let before = executor.stats().workers[0].unparks;
    receiver.submit_blocking(2, ()).unwrap().wait().unwrap();
    assert!(
        executor.stats().workers[0].unparks > before,
        "the submit woke it"
    );
    executor.shutdown_now();
    assert!(pending.wait().unwrap_err().is_cancelled());
    assert_eq!(executor.stats().cancelled, 1);
    assert_eq!(executor.stats().workers[0].cancelled, 1);
}

#[test]
fn in_flight_is_per_receiver_and_shared_by_clones() {
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let gate = Gate::new();
    let g = gate.clone();
    let dispatcher = executor.dispatcher(handler::from_fn(move |_: &u8, ()| g.wait()));
    let a = dispatcher.receiver(8).unwrap();
    let a2 = a.clone();
    let b = dispatcher.receiver(8).unwrap();
    let held: Vec<_> = (0..3).map(|_| a.submit_blocking(1, ()).unwrap()).collect();
    let other = b.submit_blocking(1, ()).unwrap();
    assert_eq!((a.in_flight(), a2.in_flight(), b.in_flight()), (3, 3, 1));
    assert_eq!((a.max_in_flight(), b.max_in_flight()), (8, 8));
    gate.open();
    for h in held {
        h.wait().unwrap();
    }
    other.wait().unwrap();
    // A completion resolves a moment before its credit unit is released.
    eventually("credit comes back", || {
        (a.in_flight(), b.in_flight()) == (0, 0)
    });
    assert!(executor.shutdown(Duration::from_secs(5)));
}

#[test]
fn spin_hits_are_counted_only_with_spin() {
    let executor = KeyedExecutor::builder()
        .workers(1)
        .spin(Duration::ZERO)
        .build()
        .unwrap();
    let counter = Arc::new(AtomicUsize::new(0));
    let c = counter.clone();
    let receiver = executor
        .dispatcher(handler::from_fn(move |_: &u8, ()| {
            c.fetch_add(1, Ordering::Relaxed);
        }))
        .receiver(1)
        .unwrap();
    for _ in 0..20 {
        receiver.submit_blocking(1, ()).unwrap().wait().unwrap();
    }
    assert_eq!(counter.load(Ordering::Relaxed), 20);
    assert_eq!(
        executor.stats().workers[0].spin_hits,
        0,
        "spin is zero: never spins"
    );
    assert!(executor.shutdown(Duration::from_secs(5)));
}

#[test]
fn dispatchers_have_names_default_a_counter_shown_in_stats_and_debug() {
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let first = executor.dispatcher(handler::from_fn(|_: &u8, n: u8| n));
    let ledger = executor
        .dispatcher_builder(handler::from_fn(|_: &u8, n: u8| n))
        .name("ledger")
        .build();
    let third = executor.dispatcher(handler::from_fn(|_: &u8, n: u8| n));
    assert_eq!(first.name(), "dispatcher-1");
    assert_eq!(ledger.name(), "ledger");
    assert_eq!(third.name(), "dispatcher-3");
    assert!(format!("{ledger:?}").contains("\"ledger\""));
    let names: Vec<String> = executor
        .stats()
        .dispatchers
        .into_iter()
        .map(|d| d.name)
        .collect();
    assert_eq!(names, ["dispatcher-1", "ledger", "dispatcher-3"]);

    // Per dispatcher: a key blocked in its handler with one more message
    // queued behind it shows as that dispatcher's live mailbox.
    let gate = Gate::new();
    let g = gate.clone();
    let blocking = executor
        .dispatcher_builder(handler::from_async_fn(move |_: u8, ()| {
            let g = g.clone();
            async move {
                let (tx, rx) = oneshot::channel::<()>();
                std::thread::spawn(move || {
                    g.wait();
                    let _ = tx.send(());
                });
                let _ = rx.await;
            }
        }))
        .name("journal")
        .build();
    let r = blocking.named_receiver("partition-0", 4).unwrap();
    let done = r.submit_blocking(1, ()).unwrap();
    eventually("the key has a mailbox", || {
        executor
            .stats()
            .dispatchers
            .iter()
            .any(|d| d.name == "journal" && d.live_mailboxes == 1)
    });
    gate.open();
    done.wait().unwrap();
    assert!(executor.shutdown(Duration::from_secs(5)));
}

#[test]
fn lanes_have_names_default_the_kernel_type() {
    use keyed_executor::lanes::{BatchResult, Kernel, Lanes};
    struct Store;
    impl Kernel for Store {
        type Key = u8;
        type Command = u8;
        type Output = u8;
        type Error = String;
        async fn execute_batch(&self, _: &u8, c: Vec<u8>) -> BatchResult<u8, u8, String> {
            BatchResult::committed(c.into_iter().map(Ok).collect())
        }
    }
    let lanes = Lanes::builder(Store).build().unwrap();
    assert!(lanes.name().ends_with("Store"), "{}", lanes.name());
    let named = Lanes::builder(Store).name("accounts").build().unwrap();
    assert_eq!(named.name(), "accounts");
}
