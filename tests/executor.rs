//! KeyedExecutor through its public API: ordering, parallelism, async
//! handlers, fairness, credit, stops, panics and retention.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{eventually, threads_named, Gate, Tracked, YieldOnce};
use futures::channel::oneshot;
use keyed_executor::{handler, ConfigError, KeyedExecutor, SubmitError, TaskError, MAX_SPIN};

#[test]
fn per_key_order_without_overlap_while_keys_run_in_parallel() {
    const KEYS: u64 = 64;
    const PER_KEY: u64 = 200;
    let executor = KeyedExecutor::builder().workers(4).build().unwrap();
    // Per key: the last sequence seen, and whether a message is running.
    let seen: Arc<Vec<Mutex<Option<u64>>>> =
        Arc::new((0..KEYS).map(|_| Mutex::new(None)).collect());
    let running: Arc<Vec<AtomicBool>> =
        Arc::new((0..KEYS).map(|_| AtomicBool::new(false)).collect());
    let max_parallel = Arc::new(AtomicUsize::new(0));
    let now_parallel = Arc::new(AtomicUsize::new(0));

    let check = {
        let (seen, running) = (seen.clone(), running.clone());
        let (max_parallel, now_parallel) = (max_parallel.clone(), now_parallel.clone());
        move |key: u64, seq: u64, enter: bool| {
            let k = key as usize;
            if enter {
                assert!(
                    !running[k].swap(true, Ordering::SeqCst),
                    "key {key} overlapped"
                );
                let n = now_parallel.fetch_add(1, Ordering::SeqCst) + 1;
                max_parallel.fetch_max(n, Ordering::SeqCst);
                let mut last = seen[k].lock().unwrap();
                assert_eq!(*last, seq.checked_sub(1), "key {key} out of order");
                *last = Some(seq);
            } else {
                now_parallel.fetch_sub(1, Ordering::SeqCst);
                running[k].store(false, Ordering::SeqCst);
            }
        }
    };
    let check = Arc::new(check);
    let c = check.clone();
    // Odd sequence numbers are async: they yield to the worker in the middle.
    let dispatcher = executor.dispatcher(handler::from_async_fn(move |key: u64, seq: u64| {
        let c = c.clone();
        async move {
            c(key, seq, true);
            if seq % 2 == 1 {
                YieldOnce(false).await;
                std::thread::yield_now();
            } else {
                std::hint::black_box((0..200).sum::<u64>());
            }
            c(key, seq, false);
            seq
        }
    }));
    let receiver = dispatcher.receiver(1024).unwrap();
    let producers: Vec<_> = (0..2)
        .map(|p| {
            let r = receiver.clone();
            std::thread::spawn(move || {
                let mut handles = Vec::new();
                for seq in 0..PER_KEY {
                    for key in (p..KEYS).step_by(2) {
                        handles.push((key, seq, r.submit_blocking(key, seq).unwrap()));
                    }
                }
                for (_, seq, h) in handles {
                    assert_eq!(h.wait().unwrap(), seq);
                }
            })
        })
        .collect();
    for p in producers {
        p.join().unwrap();
    }
    for k in 0..KEYS as usize {
        assert_eq!(*seen[k].lock().unwrap(), Some(PER_KEY - 1));
    }
    assert!(max_parallel.load(Ordering::SeqCst) >= 1);
    assert!(executor.shutdown(Duration::from_secs(10)));
}

#[test]
fn different_keys_really_run_at_the_same_time() {
    // Each handler waits until another key's handler is running too, which
    // serial execution could never satisfy. Placement may put every key on
    // the busy worker (it is "running with nothing queued"); then the idle
    // worker takes the rest of that turn over (work conservation).
    let executor = KeyedExecutor::builder().workers(2).build().unwrap();
    let inside = Arc::new(AtomicUsize::new(0));
    let i = inside.clone();
    let dispatcher = executor.dispatcher(handler::from_fn(move |_k: &u8, _m: ()| {
        i.fetch_add(1, Ordering::SeqCst);
        eventually("two keys inside their handlers at once", || {
            i.load(Ordering::SeqCst) >= 2
        });
    }));
    let r = dispatcher.receiver(4).unwrap();
    let handles: Vec<_> = (1..=3).map(|k| r.submit_blocking(k, ()).unwrap()).collect();
    for h in handles {
        h.wait().unwrap();
    }
}

#[test]
fn handlers_run_only_on_pool_threads_named_from_the_prefix() {
    let executor = KeyedExecutor::builder()
        .workers(3)
        .thread_name("pooltest")
        .build()
        .unwrap();
    let dispatcher = executor.dispatcher(handler::from_fn(|_k: &u32, _m: u32| {
        std::thread::current().name().unwrap_or("").to_owned()
    }));
    let r = dispatcher.receiver(64).unwrap();
    let handles: Vec<_> = (0..200)
        .map(|i| r.submit_blocking(i % 17, i).unwrap())
        .collect();
    let mut names: Vec<String> = handles.into_iter().map(|h| h.wait().unwrap()).collect();
    names.sort();
    names.dedup();
    for n in &names {
        assert!(
            ["pooltest-0", "pooltest-1", "pooltest-2"].contains(&n.as_str()),
            "handler ran on {n}"
        );
    }
    assert_eq!(threads_named("pooltest-"), 3);
    assert!(executor.shutdown(Duration::from_secs(5)));
    eventually("threads gone", || threads_named("pooltest-") == 0);
}

#[test]
fn a_key_awaiting_an_event_holds_no_worker() {
    // One worker. Key 0 awaits an event that fires only after keys 1..=4
    // finished: if the pending future held the worker this would hang.
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let (tx, rx) = oneshot::channel::<u32>();
    let rx = Arc::new(Mutex::new(Some(rx)));
    let order = Arc::new(Mutex::new(Vec::new()));
    let (rx2, order2) = (rx.clone(), order.clone());
    let dispatcher = executor.dispatcher(handler::from_async_fn(move |key: u32, _m: ()| {
        let rx = if key == 0 {
            rx2.lock().unwrap().take()
        } else {
            None
        };
        let order = order2.clone();
        async move {
            if let Some(rx) = rx {
                let v = rx.await.unwrap();
                order.lock().unwrap().push(key);
                v
            } else {
                order.lock().unwrap().push(key);
                key
            }
        }
    }));
    let r = dispatcher.receiver(16).unwrap();
    let waiting = r.submit_blocking(0, ()).unwrap();
    let others: Vec<_> = (1..=4).map(|k| r.submit_blocking(k, ()).unwrap()).collect();
    for (k, h) in (1..=4).zip(others) {
        assert_eq!(h.wait().unwrap(), k);
    }
    assert!(!waiting.is_finished());
    eventually("only the suspended key is alive", || {
        dispatcher.live_mailboxes() == 1
    });
    tx.send(99).unwrap();
    assert_eq!(waiting.wait().unwrap(), 99);
    assert_eq!(*order.lock().unwrap(), vec![1, 2, 3, 4, 0]);
}

#[test]
fn next_message_of_a_key_waits_for_its_suspended_future() {
    let executor = KeyedExecutor::builder().workers(2).build().unwrap();
    let (tx, rx) = oneshot::channel::<()>();
    let rx = Arc::new(Mutex::new(Some(rx)));
    let log = Arc::new(Mutex::new(Vec::new()));
    let (rx2, log2) = (rx.clone(), log.clone());
    let dispatcher = executor.dispatcher(handler::from_async_fn(move |_k: u8, m: u32| {
        let rx = if m == 0 {
            rx2.lock().unwrap().take()
        } else {
            None
        };
        let log = log2.clone();
        async move {
            log.lock().unwrap().push(format!("start {m}"));
            if let Some(rx) = rx {
                rx.await.unwrap();
            }
            log.lock().unwrap().push(format!("end {m}"));
        }
    }));
    let r = dispatcher.receiver(8).unwrap();
    let first = r.submit_blocking(7, 0).unwrap();
    let second = r.submit_blocking(7, 1).unwrap();
    eventually("first started", || log.lock().unwrap().len() == 1);
    std::thread::sleep(Duration::from_millis(20));
    assert!(
        !second.is_finished(),
        "second started before first's future completed"
    );
    tx.send(()).unwrap();
    first.wait().unwrap();
    second.wait().unwrap();
    assert_eq!(
        *log.lock().unwrap(),
        vec!["start 0", "end 0", "start 1", "end 1"]
    );
}

#[test]
fn throughput_fairness_cold_key_runs_after_one_turn_of_the_hot_key() {
    let executor = KeyedExecutor::builder()
        .workers(1)
        .throughput(4)
        .build()
        .unwrap();
    let gate = Gate::new();
    let (started_tx, started_rx) = std::sync::mpsc::channel::<()>();
    let started_tx = Mutex::new(started_tx);
    let order = Arc::new(Mutex::new(Vec::new()));
    let (g, o) = (gate.clone(), order.clone());
    let dispatcher = executor.dispatcher(handler::from_fn(move |key: &&'static str, i: u32| {
        if *key == "gate" {
            started_tx.lock().unwrap().send(()).unwrap();
            g.wait();
            return;
        }
        o.lock().unwrap().push(format!("{key}{i}"));
    }));
    let r = dispatcher.receiver(64).unwrap();
    let gate_done = r.submit_blocking("gate", 0).unwrap();
    // The worker is held: every message below is waiting when it frees up.
    // (The next test has the worker take some of them first.)
    started_rx.recv().unwrap();
    let mut handles = Vec::new();
    for i in 0..10 {
        handles.push(r.submit_blocking("hot", i).unwrap());
    }
    handles.push(r.submit_blocking("cold", 0).unwrap());
    gate.open();
    gate_done.wait().unwrap();
    for h in handles {
        h.wait().unwrap();
    }
    let order = order.lock().unwrap();
    assert_eq!(order.len(), 11);
    assert_eq!(order[4], "cold0", "order was {order:?}");
    assert_eq!(&order[..4], ["hot0", "hot1", "hot2", "hot3"]);
}

/// The same fairness when the hot key's messages reach the worker in two
/// batches: the first `k` are already in its mailbox, the rest and the cold
/// key's message still wait in the worker's inbox when the worker frees up.
/// The cold key still runs 5th, after one turn of the hot key:
/// - `k` = 4 (= throughput): the hot key yields while the cold message is
///   in the inbox; taken in, the cold key goes ahead of it (not two turns);
/// - `k` < 4: the hot key's turn runs dry after `k` (its next messages are
///   still in the inbox) and it is revived with them, first; its next turn
///   continues the one that ran dry (not `k` plus one turn).
#[test]
fn throughput_fairness_holds_when_the_cold_message_is_still_in_the_inbox() {
    for k in 1..=4 {
        let executor = KeyedExecutor::builder()
            .workers(1)
            .throughput(4)
            .build()
            .unwrap();
        let (first, second) = (Gate::new(), Gate::new());
        let (started_tx, started_rx) = std::sync::mpsc::channel::<u32>();
        let started_tx = Mutex::new(started_tx);
        let order = Arc::new(Mutex::new(Vec::new()));
        let (g1, g2, o) = (first.clone(), second.clone(), order.clone());
        let dispatcher =
            executor.dispatcher(handler::from_fn(move |key: &&'static str, i: u32| {
                if *key == "gate" {
                    started_tx.lock().unwrap().send(i).unwrap();
                    if i == 0 {
                        g1.wait()
                    } else {
                        g2.wait()
                    }
                    return;
                }
                o.lock().unwrap().push(format!("{key}{i}"));
            }));
        let r = dispatcher.receiver(64).unwrap();
        let mut handles = vec![r.submit_blocking("gate", 0).unwrap()];
        assert_eq!(started_rx.recv().unwrap(), 0);
        // The worker is held: these wait in its inbox and arrive together.
        handles.push(r.submit_blocking("gate", 1).unwrap());
        for i in 0..k {
            handles.push(r.submit_blocking("hot", i).unwrap());
        }
        first.open();
        // The worker delivered them and is held again, by gate message 1,
        // with hot0..hot{k-1} in the hot key's mailbox behind it.
        assert_eq!(started_rx.recv().unwrap(), 1);
        for i in k..10 {
            handles.push(r.submit_blocking("hot", i).unwrap());
        }
        handles.push(r.submit_blocking("cold", 0).unwrap());
        second.open();
        for h in handles {
            h.wait().unwrap();
        }
        let order = order.lock().unwrap();
        assert_eq!(order.len(), 11);
        let cold = order.iter().position(|m| m == "cold0").unwrap();
        let hot: Vec<String> = (0..10).map(|i| format!("hot{i}")).collect();
        let hot_order: Vec<&String> = order.iter().filter(|m| *m != "cold0").collect();
        assert!(
            hot_order.iter().zip(&hot).all(|(a, b)| *a == b),
            "k = {k}: {order:?}"
        );
        assert_eq!(cold, 4, "k = {k}: order was {order:?}");
    }
}

#[test]
fn credit_try_submit_fails_at_max_in_flight_and_returns_as_messages_finish() {
    let executor = KeyedExecutor::builder().workers(2).build().unwrap();
    let gate = Gate::new();
    let g = gate.clone();
    let dispatcher = executor.dispatcher(handler::from_fn(move |_k: &u32, m: u32| {
        g.wait();
        m
    }));
    let r = dispatcher.receiver(3).unwrap();
    let held: Vec<_> = (0..3).map(|i| r.try_submit(i, i).unwrap()).collect();
    assert_eq!(r.in_flight(), 3);
    match r.try_submit(9, 42) {
        Err(SubmitError::Full(m)) => assert_eq!(m, 42),
        other => panic!("expected Full, got {other:?}"),
    }
    assert!(matches!(r.try_send(9, 43), Err(SubmitError::Full(43))));
    // A second receiver of the same dispatcher has its own credit.
    let r2 = dispatcher.receiver(1).unwrap();
    let other = r2.try_submit(100, 100).unwrap();
    gate.open();
    for (i, h) in held.into_iter().enumerate() {
        assert_eq!(h.wait().unwrap(), i as u32);
    }
    other.wait().unwrap();
    eventually("credit back", || r.in_flight() == 0);
    assert_eq!(r.try_submit(5, 5).unwrap().wait().unwrap(), 5);
}

#[test]
fn slow_messages_holding_part_of_the_window_do_not_stall_fast_ones() {
    let executor = KeyedExecutor::builder().workers(2).build().unwrap();
    let gate = Gate::new();
    let (tx, rx) = oneshot::channel::<()>();
    let rx = Arc::new(Mutex::new(Some(rx)));
    let rx2 = rx.clone();
    drop(gate);
    // Key 0 is slow (awaits an event); the rest are instant.
    let dispatcher = executor.dispatcher(handler::from_async_fn(move |key: u32, m: u32| {
        let rx = if key == 0 {
            rx2.lock().unwrap().take()
        } else {
            None
        };
        async move {
            if let Some(rx) = rx {
                let _ = rx.await;
            }
            m
        }
    }));
    let r = dispatcher.receiver(4).unwrap();
    let slow = r.submit_blocking(0, 0).unwrap();
    // With 1 of 4 units held by the slow key, 1000 fast messages still flow
    // through the other 3 (submit_blocking waits for credit as they finish).
    for i in 1..1000 {
        let h = r.submit_blocking(1 + i % 5, i).unwrap();
        drop(h);
    }
    eventually("fast messages finished", || r.in_flight() == 1);
    tx.send(()).unwrap();
    assert_eq!(slow.wait().unwrap(), 0);
}

#[test]
fn submit_async_waits_for_credit_without_a_thread() {
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let gate = Gate::new();
    let g = gate.clone();
    let dispatcher = executor.dispatcher(handler::from_fn(move |_k: &u32, m: u32| {
        if m == 0 {
            g.wait();
        }
        m
    }));
    let r = dispatcher.receiver(1).unwrap();
    let first = r.try_submit(1, 0).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let got = rt.block_on(async {
        let r2 = r.clone();
        // The submit below must wait for credit; the runtime stays free to
        // run this other task, which opens the gate.
        let opener = tokio::spawn(async move {
            tokio::task::yield_now().await;
            gate.open();
        });
        let done = r2.submit(2, 7).await.unwrap();
        opener.await.unwrap();
        done.await.unwrap()
    });
    assert_eq!(got, 7);
    assert_eq!(first.wait().unwrap(), 0);
}

#[test]
fn graceful_shutdown_runs_everything_accepted_then_refuses() {
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let gate = Gate::new();
    let g = gate.clone();
    let ran = Arc::new(AtomicUsize::new(0));
    let ran2 = ran.clone();
    let dispatcher = executor.dispatcher(handler::from_fn(move |_k: &u32, m: u32| {
        if m == 0 {
            g.wait();
        }
        ran2.fetch_add(1, Ordering::SeqCst);
        m
    }));
    let r = dispatcher.receiver(64).unwrap();
    let handles: Vec<_> = (0..20)
        .map(|m| r.submit_blocking(m % 3, m).unwrap())
        .collect();
    let ex2 = executor.clone();
    let stopper = std::thread::spawn(move || ex2.shutdown(Duration::from_secs(30)));
    eventually("stop began", || r.is_closed());
    match r.submit_blocking(1, 100) {
        Err(SubmitError::Closed(m)) => assert_eq!(m, 100),
        other => panic!("expected Closed, got {other:?}"),
    }
    gate.open();
    assert!(stopper.join().unwrap());
    for (m, h) in handles.into_iter().enumerate() {
        assert_eq!(h.wait().unwrap(), m as u32);
    }
    assert_eq!(ran.load(Ordering::SeqCst), 20);
    assert!(executor.is_terminated());
}

#[test]
fn graceful_shutdown_drains_suspended_futures_woken_late() {
    let executor = KeyedExecutor::builder().workers(2).build().unwrap();
    let (tx, rx) = oneshot::channel::<u32>();
    let rx = Arc::new(Mutex::new(Some(rx)));
    let rx2 = rx.clone();
    let dispatcher = executor.dispatcher(handler::from_async_fn(move |_k: u8, _m: ()| {
        let rx = rx2.lock().unwrap().take();
        async move { rx.unwrap().await.unwrap() }
    }));
    let r = dispatcher.receiver(2).unwrap();
    let done = r.submit_blocking(1, ()).unwrap();
    eventually("suspended", || executor.stats().live_mailboxes == 1);
    assert!(
        !executor.shutdown(Duration::from_millis(20)),
        "cannot finish before the wake"
    );
    let waker = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(20));
        tx.send(5).unwrap();
    });
    assert!(executor.shutdown(Duration::from_secs(30)));
    assert_eq!(done.wait().unwrap(), 5);
    waker.join().unwrap();
}

#[test]
fn force_stop_finishes_the_running_message_and_hands_back_the_other_19() {
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let started = Gate::new();
    let gate = Gate::new();
    let (s, g) = (started.clone(), gate.clone());
    let dispatcher = executor.dispatcher(handler::from_fn(move |_k: &u32, m: String| {
        if m == "m0" {
            s.open();
            g.wait();
        }
        m.len()
    }));
    let r = dispatcher.receiver(64).unwrap();
    let handles: Vec<_> = (0..20)
        .map(|i| r.submit_blocking(i % 4, format!("m{i}")).unwrap())
        .collect();
    started.wait();
    let ex2 = executor.clone();
    let stopper = std::thread::spawn(move || ex2.shutdown_now());
    let mut handles = handles.into_iter();
    let first = handles.next().unwrap();
    let mut rejected = Vec::new();
    for h in handles {
        match h.wait() {
            Err(TaskError::Rejected(m)) => rejected.push(m),
            other => panic!("expected a rejection, got {other:?}"),
        }
    }
    let expected: Vec<String> = (1..20).map(|i| format!("m{i}")).collect();
    rejected.sort_by_key(|m| m[1..].parse::<u32>().unwrap());
    assert_eq!(rejected, expected);
    gate.open();
    stopper.join().unwrap();
    assert_eq!(first.wait().unwrap(), 2, "the running message finishes");
    assert!(executor.is_terminated());
    executor.shutdown_now(); // idempotent
    assert!(matches!(
        r.try_submit(1, "late".into()),
        Err(SubmitError::Closed(_))
    ));
    assert_eq!(executor.stats().rejected, 19);
}

#[test]
fn force_stop_cancels_suspended_futures_and_rejects_sends_through_the_hook() {
    let executor = KeyedExecutor::builder().workers(2).build().unwrap();
    let rejected = Arc::new(Mutex::new(Vec::new()));
    let rj = rejected.clone();
    let live = Arc::new(AtomicUsize::new(0));
    let l2 = live.clone();
    let dispatcher = executor
        .dispatcher_builder(handler::from_async_fn(move |_k: u32, m: u32| {
            let guard = Tracked::new(&l2, m as u64);
            async move {
                futures::future::pending::<()>().await;
                drop(guard);
            }
        }))
        .on_reject(move |k, m| rj.lock().unwrap().push((k, m)))
        .build();
    let r = dispatcher.receiver(16).unwrap();
    let suspended = r.submit_blocking(1, 10).unwrap();
    r.send(1, 11).unwrap(); // queued behind the suspended one
    r.send(2, 20).unwrap(); // suspends too
    eventually("two futures alive", || live.load(Ordering::SeqCst) == 2);
    executor.shutdown_now();
    assert!(matches!(suspended.wait(), Err(TaskError::Cancelled)));
    assert_eq!(*rejected.lock().unwrap(), vec![(1, 11)]);
    assert_eq!(
        live.load(Ordering::SeqCst),
        0,
        "suspended futures were dropped"
    );
    assert_eq!(r.in_flight(), 0);
    let stats = executor.stats();
    assert_eq!(stats.cancelled, 2);
    assert_eq!(stats.rejected, 1);
}

#[test]
fn a_panicking_handler_fails_its_message_and_the_key_goes_on() {
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let dispatcher = executor.dispatcher(handler::from_fn(|_k: &u8, m: u32| {
        if m % 3 == 0 {
            panic!("boom {m}");
        }
        m
    }));
    let r = dispatcher.receiver(64).unwrap();
    let handles: Vec<_> = (0..12).map(|m| r.submit_blocking(1, m).unwrap()).collect();
    for (m, h) in handles.into_iter().enumerate() {
        let m = m as u32;
        match h.wait() {
            Ok(v) => assert_eq!(v, m),
            Err(TaskError::Panicked(p)) => {
                assert_eq!(m % 3, 0);
                assert_eq!(p.message(), format!("boom {m}"));
            }
            Err(e) => panic!("unexpected {e}"),
        }
    }
    assert_eq!(executor.stats().panicked, 4);
}

#[test]
fn a_panicking_async_handler_and_panic_hook_for_sends() {
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let panics = Arc::new(Mutex::new(Vec::new()));
    let p2 = panics.clone();
    let dispatcher = executor
        .dispatcher_builder(handler::from_async_fn(|_k: u8, m: u32| async move {
            YieldOnce(false).await;
            assert!(m != 1, "async boom");
            m
        }))
        .on_panic(move |k, p| p2.lock().unwrap().push((*k, p.message().to_owned())))
        .build();
    let r = dispatcher.receiver(8).unwrap();
    r.send(3, 1).unwrap();
    assert!(r
        .submit_blocking(3, 1)
        .unwrap()
        .wait()
        .unwrap_err()
        .is_panic());
    assert_eq!(r.submit_blocking(3, 2).unwrap().wait().unwrap(), 2);
    eventually("hook saw the panic", || panics.lock().unwrap().len() == 1);
    assert_eq!(panics.lock().unwrap()[0], (3, "async boom".to_owned()));
}

#[test]
fn finished_messages_and_idle_mailboxes_are_not_retained() {
    let executor = KeyedExecutor::builder().workers(2).build().unwrap();
    let live = Arc::new(AtomicUsize::new(0));
    let dispatcher = executor.dispatcher(handler::from_fn(|_k: &u64, m: Tracked| m));
    let r = dispatcher.receiver(256).unwrap();
    let mut kept = Vec::new();
    for i in 0..5000u64 {
        let h = r.submit_blocking(i % 1000, Tracked::new(&live, i)).unwrap();
        if i % 10 == 0 {
            kept.push(h);
        } // the others are dropped: their outputs must be dropped too
    }
    for h in kept {
        drop(h.wait().unwrap());
    }
    eventually("outputs dropped", || live.load(Ordering::SeqCst) == 0);
    eventually("mailboxes retired", || dispatcher.live_mailboxes() == 0);
    assert_eq!(executor.stats().live_mailboxes, 0);
    assert_eq!(r.in_flight(), 0);
}

/// Keys whose handlers suspend each hold a mailbox while they wait; the
/// ports keep the ones that come back for reuse while about as many are
/// still live (no allocation and free per message), and let them go as the
/// live ones drain.
#[test]
fn spare_mailboxes_follow_the_suspended_keys_up_and_down() {
    const KEYS: u64 = 400;
    let executor = KeyedExecutor::builder().workers(2).build().unwrap();
    let dispatcher = executor.dispatcher(handler::from_async_fn(
        |_k: u64, rx: oneshot::Receiver<()>| async move {
            let _ = rx.await;
        },
    ));
    let r = dispatcher.receiver(KEYS as usize).unwrap();
    let mut release = Vec::new();
    for k in 0..KEYS {
        let (tx, rx) = oneshot::channel();
        r.send(k, rx).unwrap();
        release.push(tx);
    }
    eventually("every key suspended", || {
        executor.stats().live_mailboxes == KEYS as usize
    });
    let rest = release.split_off(KEYS as usize / 2);
    for tx in release {
        tx.send(()).unwrap();
    }
    eventually("half drained", || {
        executor.stats().live_mailboxes == KEYS as usize / 2
    });
    // A fixed cap kept at most 32 a port (plus its slot): 66 on two.
    let kept = executor.stats().idle_mailboxes;
    assert!(
        kept >= 100,
        "only {kept} spare mailboxes kept for 200 live ones"
    );
    for tx in rest {
        tx.send(()).unwrap();
    }
    eventually("all drained", || executor.stats().live_mailboxes == 0);
    let left = executor.stats().idle_mailboxes;
    assert!(left <= 66, "{left} spare mailboxes kept with none live");
    assert_eq!(r.in_flight(), 0);
}

#[test]
fn every_bad_config_value_is_an_error_not_a_panic() {
    assert_eq!(
        KeyedExecutor::builder().workers(0).build().unwrap_err(),
        ConfigError::ZeroWorkers
    );
    assert_eq!(
        KeyedExecutor::builder().throughput(0).build().unwrap_err(),
        ConfigError::ZeroThroughput
    );
    let too_long = MAX_SPIN * 2;
    assert_eq!(
        KeyedExecutor::builder().spin(too_long).build().unwrap_err(),
        ConfigError::SpinTooLong {
            spin: too_long,
            max: MAX_SPIN
        }
    );
    assert!(matches!(
        KeyedExecutor::builder()
            .thread_name("bad\0name")
            .build()
            .unwrap_err(),
        ConfigError::InvalidThreadName(_)
    ));
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let dispatcher = executor.dispatcher(handler::from_fn(|_k: &u8, m: u8| m));
    assert_eq!(
        dispatcher.receiver(0).unwrap_err(),
        ConfigError::ZeroMaxInFlight
    );
    assert_eq!(dispatcher.default_receiver().max_in_flight(), 256);
}

#[test]
fn dropping_the_last_handle_leaves_no_thread() {
    {
        let executor = KeyedExecutor::builder()
            .workers(3)
            .thread_name("droptest")
            .build()
            .unwrap();
        let d = executor.dispatcher(handler::from_fn(|_k: &u8, m: u8| m));
        let r = d.receiver(8).unwrap();
        assert_eq!(r.submit_blocking(1, 2).unwrap().wait().unwrap(), 2);
        assert_eq!(threads_named("droptest-"), 3);
        // The receiver outlives the executor: it refuses from now on.
        drop(executor);
        eventually("threads gone", || threads_named("droptest-") == 0);
        assert!(matches!(r.try_submit(1, 1), Err(SubmitError::Closed(1))));
    }
}

#[test]
fn works_from_block_on_and_from_tokio() {
    let executor = KeyedExecutor::builder().workers(2).build().unwrap();
    let dispatcher = executor.dispatcher(handler::from_async_fn(|k: u32, m: u32| async move {
        tokio::task::yield_now().await; // a tokio-flavoured await (runtime-free)
        k * 1000 + m
    }));
    let r = dispatcher.receiver(32).unwrap();
    let v = futures::executor::block_on(async { r.submit(3, 4).await.unwrap().await.unwrap() });
    assert_eq!(v, 3004);

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let results = rt.block_on(async {
        let mut tasks = Vec::new();
        for k in 0..8u32 {
            let r = r.clone();
            tasks.push(tokio::spawn(async move {
                let mut out = Vec::new();
                for m in 0..50 {
                    out.push(r.submit(k, m).await.unwrap());
                }
                let mut vals = Vec::new();
                for h in out {
                    vals.push(h.await.unwrap());
                }
                vals
            }));
        }
        let mut all = HashMap::new();
        for (k, t) in tasks.into_iter().enumerate() {
            all.insert(k as u32, t.await.unwrap());
        }
        all
    });
    for (k, vals) in results {
        assert_eq!(vals, (0..50).map(|m| k * 1000 + m).collect::<Vec<_>>());
    }
}

#[test]
fn shutdown_from_inside_a_handler_does_not_deadlock() {
    let executor = KeyedExecutor::builder().workers(2).build().unwrap();
    let ex2 = Arc::new(Mutex::new(Some(executor.clone())));
    let e3 = ex2.clone();
    let dispatcher = executor.dispatcher(handler::from_fn(move |_k: &u8, graceful: bool| {
        let ex = e3.lock().unwrap().clone().unwrap();
        if graceful {
            ex.shutdown(Duration::from_secs(5))
        } else {
            ex.shutdown_now();
            true
        }
    }));
    let r = dispatcher.receiver(4).unwrap();
    assert!(
        !r.submit_blocking(1, true).unwrap().wait().unwrap(),
        "cannot wait for itself"
    );
    assert!(executor.shutdown(Duration::from_secs(10)));
    ex2.lock().unwrap().take();
}

#[test]
fn a_handler_waiting_for_credit_is_not_starved_by_units_its_worker_holds_back() {
    // One worker, a full receiver of 32: the gate message finishes (its unit
    // may be held back by the worker to return in a batch), then key 0's
    // handler submits on the same receiver and waits for a unit while 30
    // fillers wait behind it on the same worker. Only the unit the worker
    // holds can unblock it.
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let gate = Gate::new();
    let slot: Arc<Mutex<Option<keyed_executor::Receiver<u32, u32, u32>>>> = Arc::default();
    let (g, s) = (gate.clone(), slot.clone());
    let dispatcher = executor.dispatcher(handler::from_fn(move |key: &u32, m: u32| {
        match *key {
            99 => g.wait(),
            0 => {
                let r = s.lock().unwrap().clone().unwrap();
                let done = r.submit_blocking(98, m + 1).unwrap();
                drop(done);
            }
            _ => {}
        }
        m
    }));
    let r = dispatcher.receiver(32).unwrap();
    *slot.lock().unwrap() = Some(r.clone());
    let first = r.try_submit(99, 0).unwrap();
    let blocked = r.try_submit(0, 10).unwrap();
    let fillers: Vec<_> = (1..=30).map(|k| r.try_submit(k, k).unwrap()).collect();
    assert!(r.try_submit(1, 1).unwrap_err().is_full());
    gate.open();
    first.wait().unwrap();
    assert_eq!(blocked.wait().unwrap(), 10);
    for (k, h) in (1..=30).zip(fillers) {
        assert_eq!(h.wait().unwrap(), k);
    }
    slot.lock().unwrap().take();
}
