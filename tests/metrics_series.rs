//! The `metrics` feature: after a scripted workload, every documented series
//! is there with the right labels, exact counts and exact histogram sample
//! counts (`metrics_sampling(1)` times every message), read from
//! `metrics-util`'s debugging recorder.
//!
//! ```text
//! cargo test --features metrics --test metrics_series
//! ```
#![cfg(feature = "metrics")]

mod common;

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use common::{eventually, shutdown_now_elsewhere, Gate};
use keyed_executor::lanes::{BatchResult, Clock, Kernel, LaneError, Lanes, ManualClock};
use keyed_executor::limit::InFlightLimit;
use keyed_executor::{handler, KeyedExecutor, SubmitError, TaskError};
use metrics_util::debugging::{DebugValue, DebuggingRecorder, Snapshotter};

/// Every series: (name, sorted labels) → value.
#[derive(Debug)]
struct Series(BTreeMap<(String, Vec<(String, String)>), DebugValue>);

impl Series {
    fn take(snapshotter: &Snapshotter) -> Self {
        let mut all = BTreeMap::new();
        for (key, _unit, _desc, value) in snapshotter.snapshot().into_vec() {
            let key = key.key();
            let mut labels: Vec<(String, String)> = key
                .labels()
                .map(|l| (l.key().to_owned(), l.value().to_owned()))
                .collect();
            labels.sort();
            all.insert((key.name().to_owned(), labels), value);
        }
        Series(all)
    }

    fn get(&self, name: &str, labels: &[(&str, &str)]) -> &DebugValue {
        let mut labels: Vec<(String, String)> = labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        labels.sort();
        let key = (name.to_owned(), labels);
        self.0
            .get(&key)
            .unwrap_or_else(|| panic!("no series {key:?} among {:#?}", self.0.keys()))
    }

    fn counter(&self, name: &str, labels: &[(&str, &str)]) -> u64 {
        match self.get(name, labels) {
            DebugValue::Counter(n) => *n,
            other => panic!("{name} is not a counter: {other:?}"),
        }
    }

    fn gauge(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        match self.get(name, labels) {
            DebugValue::Gauge(v) => v.into_inner(),
            other => panic!("{name} is not a gauge: {other:?}"),
        }
    }

    fn samples(&self, name: &str, labels: &[(&str, &str)]) -> Vec<f64> {
        match self.get(name, labels) {
            DebugValue::Histogram(v) => v.iter().map(|f| f.into_inner()).collect(),
            other => panic!("{name} is not a histogram: {other:?}"),
        }
    }
}

/// A future that returns `Pending` once (waking itself), then `n`.
async fn yield_once<T>(n: T) -> T {
    let mut yielded = false;
    std::future::poll_fn(|cx| {
        if yielded {
            Poll::Ready(())
        } else {
            yielded = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    })
    .await;
    n
}

#[test]
fn every_executor_series_with_exact_counts_after_a_scripted_workload() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    // Handles are registered when things are built: on this thread, with
    // this recorder.
    let _local = metrics::set_default_local_recorder(&recorder);

    let executor = KeyedExecutor::builder()
        .workers(1)
        .metrics_sampling(1)
        .build()
        .unwrap();

    // "journal": async. Five messages suspend once and finish; one
    // suspends forever (cancelled by the force stop below).
    let journal = executor
        .dispatcher_builder(handler::from_async_fn(|key: u32, n: u32| async move {
            if key == 99 {
                std::future::pending::<()>().await;
            }
            yield_once(n).await
        }))
        .name("journal")
        .build();
    let events = journal.receiver(8).unwrap();
    for n in 0..5 {
        assert_eq!(events.submit_blocking(n, n).unwrap().wait().unwrap(), n);
    }
    let forever = events.submit_blocking(99, 0).unwrap();
    eventually("the forever future is suspended", || {
        journal.live_mailboxes() == 1
    });

    // "ledger": sync. Ten done, two panics.
    let gate = Gate::new();
    let g = gate.clone();
    let entered = Arc::new(AtomicBool::new(false));
    let e = entered.clone();
    let ledger = executor
        .dispatcher_builder(handler::from_fn(move |key: &u32, n: u32| {
            if *key == 0 {
                e.store(true, Ordering::SeqCst);
                g.wait();
            }
            if n == 13 {
                panic!("unlucky");
            }
            n
        }))
        .name("ledger")
        .build();
    let orders = ledger.named_receiver("orders", 4).unwrap();
    for n in 0..10 {
        assert_eq!(
            orders
                .submit_blocking(1 + n % 3, n)
                .unwrap()
                .wait()
                .unwrap(),
            n
        );
    }
    for _ in 0..2 {
        assert!(orders
            .submit_blocking(1, 13)
            .unwrap()
            .wait()
            .unwrap_err()
            .is_panic());
    }
    // Key 0 blocks the only worker; three more wait behind it; the
    // receiver is full: two refusals.
    let blocker = orders.submit_blocking(0, 100).unwrap();
    eventually("key 0 runs", || entered.load(Ordering::SeqCst));
    let queued: Vec<_> = (2..5)
        .map(|k| orders.submit_blocking(k, k).unwrap())
        .collect();
    for _ in 0..2 {
        assert!(matches!(orders.try_submit(9, 9), Err(SubmitError::Full(9))));
    }
    // A force stop hands the three back and cancels the forever future;
    // the blocked message finishes.
    let stopper = shutdown_now_elsewhere(&executor);
    eventually("the stop handed the queue back", || {
        executor.stats().rejected == 3
    });
    gate.open();
    stopper.join().unwrap();
    assert_eq!(blocker.wait().unwrap(), 100);
    for q in queued {
        assert!(matches!(q.wait(), Err(TaskError::Rejected(_))));
    }
    assert!(matches!(forever.wait(), Err(TaskError::Cancelled)));
    // One more refusal: the executor is closed.
    assert!(matches!(
        orders.try_submit(1, 1),
        Err(SubmitError::Closed(1))
    ));

    let s = Series::take(&snapshotter);
    let m = "keyed_executor_messages_total";
    let count = |d: &str, o: &str| s.counter(m, &[("dispatcher", d), ("outcome", o)]);
    assert_eq!(count("ledger", "done"), 11);
    assert_eq!(count("ledger", "panicked"), 2);
    assert_eq!(count("ledger", "rejected"), 3);
    assert_eq!(count("ledger", "cancelled"), 0);
    assert_eq!(count("ledger", "refused"), 3);
    assert_eq!(count("journal", "done"), 5);
    assert_eq!(count("journal", "panicked"), 0);
    assert_eq!(count("journal", "rejected"), 0);
    assert_eq!(count("journal", "cancelled"), 1);
    assert_eq!(count("journal", "refused"), 0);

    // Every message that started was timed (sampling 1): its queue time
    // at the first poll, each step, and its run when it delivered.
    let hist = |name: &str, d: &str| s.samples(name, &[("dispatcher", d)]);
    assert_eq!(hist("keyed_executor_queue_seconds", "ledger").len(), 13);
    assert_eq!(hist("keyed_executor_poll_seconds", "ledger").len(), 13);
    assert_eq!(hist("keyed_executor_run_seconds", "ledger").len(), 13);
    assert_eq!(hist("keyed_executor_queue_seconds", "journal").len(), 6);
    // Five messages polled twice, the forever one once.
    assert_eq!(hist("keyed_executor_poll_seconds", "journal").len(), 11);
    assert_eq!(hist("keyed_executor_run_seconds", "journal").len(), 5);
    for name in ["queue", "poll", "run"] {
        let samples = hist(&format!("keyed_executor_{name}_seconds"), "ledger");
        assert!(
            samples.iter().all(|&v| (0.0..60.0).contains(&v)),
            "{samples:?}"
        );
    }
    // The blocked message's run is its longest (it waited for the gate,
    // which opened only after the stop handed three messages back).
    let runs = hist("keyed_executor_run_seconds", "ledger");
    assert!(runs.iter().any(|&v| v > 0.0));

    // Gauges: nothing in flight, no mailbox, no worker asleep (it exited).
    let in_flight = |d: &str, r: &str| {
        s.gauge(
            "keyed_executor_in_flight",
            &[("dispatcher", d), ("receiver", r)],
        )
    };
    assert_eq!(in_flight("ledger", "orders"), 0.0);
    assert_eq!(in_flight("journal", "0"), 0.0);
    for d in ["ledger", "journal"] {
        assert_eq!(
            s.gauge("keyed_executor_live_mailboxes", &[("dispatcher", d)]),
            0.0
        );
        assert_eq!(
            s.counter("keyed_executor_slow_steps_total", &[("dispatcher", d)]),
            0
        );
    }
    assert_eq!(s.gauge("keyed_executor_workers_parked", &[]), 0.0);
    drop((events, orders));
}

#[test]
fn gauges_follow_a_stalled_source_and_parked_workers() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);
    let executor = KeyedExecutor::builder().workers(2).build().unwrap();
    let gate = Gate::new();
    let g = gate.clone();
    let started = Arc::new(AtomicUsize::new(0));
    let st = started.clone();
    let dispatcher = executor
        .dispatcher_builder(handler::from_async_fn(move |_: u32, ()| {
            let g = g.clone();
            st.fetch_add(1, Ordering::SeqCst);
            async move {
                let (tx, rx) = futures::channel::oneshot::channel::<()>();
                std::thread::spawn(move || {
                    g.wait();
                    let _ = tx.send(());
                });
                let _ = rx.await;
            }
        }))
        .name("stalled")
        .build();
    let receiver = dispatcher.receiver(16).unwrap();
    let done: Vec<_> = (0..5)
        .map(|k| receiver.submit_blocking(k, ()).unwrap())
        .collect();
    eventually("five futures suspended", || {
        started.load(Ordering::SeqCst) == 5 && dispatcher.live_mailboxes() == 5
    });
    // Both workers have nothing to do and go to sleep (a worker counts
    // itself parked, and flushes its counts, before it says so).
    eventually("both workers parked", || {
        executor
            .stats()
            .workers
            .iter()
            .all(|w| w.state == keyed_executor::WorkerState::Parked)
    });
    // stats() refreshed the in-flight gauge. (The debugging recorder's
    // snapshot consumes what it reads: take one here, one at the end.)
    let s = Series::take(&snapshotter);
    assert_eq!(
        s.gauge(
            "keyed_executor_in_flight",
            &[("dispatcher", "stalled"), ("receiver", "0")]
        ),
        5.0
    );
    assert_eq!(
        s.gauge(
            "keyed_executor_live_mailboxes",
            &[("dispatcher", "stalled")]
        ),
        5.0
    );
    assert_eq!(s.gauge("keyed_executor_workers_parked", &[]), 2.0);
    gate.open();
    for d in done {
        d.wait().unwrap();
    }
    assert!(executor.shutdown(Duration::from_secs(5)));
    // Since the first snapshot (which reset every value to zero): the
    // in-flight gauge was set to 0, the five mailboxes retired (-5), both
    // workers woke and exited (-2), and five messages were done.
    let s = Series::take(&snapshotter);
    assert_eq!(
        s.gauge(
            "keyed_executor_in_flight",
            &[("dispatcher", "stalled"), ("receiver", "0")]
        ),
        0.0
    );
    assert_eq!(
        s.gauge(
            "keyed_executor_live_mailboxes",
            &[("dispatcher", "stalled")]
        ),
        -5.0
    );
    assert_eq!(s.gauge("keyed_executor_workers_parked", &[]), -2.0);
    assert_eq!(
        s.counter(
            "keyed_executor_messages_total",
            &[("dispatcher", "stalled"), ("outcome", "done")]
        ),
        5
    );
}

#[test]
fn per_source_and_per_dispatcher_stops_count_what_they_hand_back() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    // Key 0 and key 10 block the only worker, each until its gate opens;
    // key 99 suspends forever.
    let (first, second) = (Gate::new(), Gate::new());
    let (g1, g2) = (first.clone(), second.clone());
    // A failing assertion opens both, so the workers can exit.
    struct OpenOnDrop(Gate, Gate);
    impl Drop for OpenOnDrop {
        fn drop(&mut self) {
            self.0.open();
            self.1.open();
        }
    }
    let _open = OpenOnDrop(first.clone(), second.clone());
    let entered = Arc::new(AtomicUsize::new(0));
    let e = entered.clone();
    let orders = executor
        .dispatcher_builder(handler::from_async_fn(move |key: u32, n: u32| {
            let (g1, g2, e) = (g1.clone(), g2.clone(), e.clone());
            async move {
                match key {
                    0 | 10 => {
                        e.fetch_add(1, Ordering::SeqCst);
                        if key == 0 {
                            g1.wait()
                        } else {
                            g2.wait()
                        }
                    }
                    99 => std::future::pending::<()>().await,
                    _ => {}
                }
                n
            }
        }))
        .name("orders")
        .build();
    let p0 = orders
        .receiver_builder()
        .max_in_flight(8)
        .name("p0")
        .build()
        .unwrap();
    let p1 = orders.named_receiver("p1", 8).unwrap();
    let forever = p0.submit_blocking(99, 0).unwrap();
    eventually("the forever future is suspended", || {
        orders.live_mailboxes() == 1
    });
    let blocker = p1.submit_blocking(0, 0).unwrap();
    eventually("key 0 runs", || entered.load(Ordering::SeqCst) == 1);
    let queued: Vec<_> = (1..4).map(|k| p0.submit_blocking(k, k).unwrap()).collect();
    let other = p1.submit_blocking(4, 4).unwrap();

    // p0 stops on its own: its three queued messages come back, its
    // suspended future is cancelled; p1's messages stay.
    p0.shutdown_now();
    for q in queued {
        assert!(matches!(q.wait(), Err(TaskError::Rejected(_))));
    }
    assert!(matches!(forever.wait(), Err(TaskError::Cancelled)));
    let s = Series::take(&snapshotter);
    let m = "keyed_executor_messages_total";
    let count = |s: &Series, d: &str, o: &str| s.counter(m, &[("dispatcher", d), ("outcome", o)]);
    assert_eq!(count(&s, "orders", "rejected"), 3);
    assert_eq!(count(&s, "orders", "cancelled"), 1);
    // The stop refreshed the in-flight gauges (the worker, blocked, did
    // not): p0 has nothing left, p1 its running and its queued message.
    let in_flight = |s: &Series, r: &str| {
        s.gauge(
            "keyed_executor_in_flight",
            &[("dispatcher", "orders"), ("receiver", r)],
        )
    };
    assert_eq!(in_flight(&s, "p0"), 0.0);
    assert_eq!(in_flight(&s, "p1"), 2.0);
    assert!(matches!(p0.try_submit(5, 5), Err(SubmitError::Closed(5))));
    first.open();
    assert_eq!(blocker.wait().unwrap(), 0);
    assert_eq!(other.wait().unwrap(), 4);

    // A dispatcher stops on its own: "audit" hands its queue back while
    // "orders" blocks the worker again, and goes on after.
    let audit = executor
        .dispatcher_builder(handler::from_fn(|_: &u32, n: u32| n))
        .name("audit")
        .build();
    let trail = audit.receiver(8).unwrap();
    let blocker = p1.submit_blocking(10, 10).unwrap();
    eventually("key 10 runs", || entered.load(Ordering::SeqCst) == 2);
    let queued: Vec<_> = (0..3)
        .map(|k| trail.submit_blocking(k, k).unwrap())
        .collect();
    audit.shutdown_now();
    for q in queued {
        assert!(matches!(q.wait(), Err(TaskError::Rejected(_))));
    }
    assert!(matches!(trail.try_send(0, 0), Err(SubmitError::Closed(0))));
    second.open();
    assert_eq!(blocker.wait().unwrap(), 10);
    assert!(executor.shutdown(Duration::from_secs(10)));

    // Since the first snapshot (which reset every value to zero).
    let s = Series::take(&snapshotter);
    assert_eq!(count(&s, "orders", "done"), 3);
    assert_eq!(count(&s, "orders", "rejected"), 0);
    assert_eq!(count(&s, "orders", "refused"), 1);
    assert_eq!(count(&s, "audit", "rejected"), 3);
    assert_eq!(count(&s, "audit", "refused"), 1);
    assert_eq!(count(&s, "audit", "done"), 0);
    assert_eq!(in_flight(&s, "p0"), 0.0);
    assert_eq!(in_flight(&s, "p1"), 0.0);
    assert_eq!(
        s.gauge(
            "keyed_executor_in_flight",
            &[("dispatcher", "audit"), ("receiver", "0")]
        ),
        0.0
    );
    drop((p0, p1, trail));
}

#[test]
fn a_slow_step_is_counted_once() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);
    let executor = KeyedExecutor::builder()
        .workers(1)
        .slow_step(Duration::from_millis(10))
        .build()
        .unwrap();
    let receiver = executor
        .dispatcher_builder(handler::from_fn(|key: &u32, ()| {
            if *key == 1 {
                std::thread::sleep(Duration::from_millis(40));
            }
        }))
        .name("sleepy")
        .build()
        .receiver(4)
        .unwrap();
    receiver.submit_blocking(1, ()).unwrap().wait().unwrap();
    for k in 2..50 {
        receiver.submit_blocking(k, ()).unwrap().wait().unwrap();
    }
    assert!(executor.shutdown(Duration::from_secs(5)));
    let s = Series::take(&snapshotter);
    assert_eq!(
        s.counter(
            "keyed_executor_slow_steps_total",
            &[("dispatcher", "sleepy")]
        ),
        1
    );
}

// ----- Lanes -----------------------------------------------------------------

/// A kernel whose batches wait until `open`; odd commands fail, 99 panics.
struct Gated {
    open: Arc<AtomicBool>,
}

struct Hold(Arc<AtomicBool>);

impl Future for Hold {
    type Output = ();
    fn poll(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<()> {
        // Polled by hand in the test: no waker needed.
        if self.0.load(Ordering::SeqCst) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }
}

impl Kernel for Gated {
    type Key = u32;
    type Command = u32;
    type Output = u32;
    type Error = String;

    fn execute_batch(
        &self,
        _key: &u32,
        commands: Vec<u32>,
    ) -> impl Future<Output = BatchResult<u32, u32, String>> + Send {
        let open = self.open.clone();
        async move {
            Hold(open).await;
            assert!(!commands.contains(&99), "kernel panicked");
            let outcomes = commands
                .into_iter()
                .map(|c| {
                    if c % 2 == 0 {
                        Ok(c)
                    } else {
                        Err(format!("odd {c}"))
                    }
                })
                .collect();
            BatchResult::committed(outcomes)
        }
    }
}

fn poll<F: Future + Unpin>(f: &mut F) -> Poll<F::Output> {
    let waker = futures::task::noop_waker();
    Pin::new(f).poll(&mut Context::from_waker(&waker))
}

#[test]
fn every_lanes_series_with_exact_counts_after_a_scripted_workload() {
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);
    let open = Arc::new(AtomicBool::new(false));
    let clock = ManualClock::new();
    let lanes = Lanes::builder(Gated { open: open.clone() })
        .name("accounts")
        .lane_capacity(2)
        .max_batch(4)
        .limit(InFlightLimit::new(4))
        .clock(clock.clone())
        .build()
        .unwrap();
    let ms = Duration::from_millis;

    // a leads key 1; its batch [a] waits in the kernel.
    let mut a = lanes.execute(1, 2);
    assert!(poll(&mut a).is_pending());
    clock.advance(ms(10));
    // b and b2 wait in the lane (it is full); c is refused: LaneFull.
    let (mut b, mut b2) = (lanes.execute(1, 4), lanes.execute(1, 20));
    assert!(poll(&mut b).is_pending() && poll(&mut b2).is_pending());
    let mut c = lanes.execute(1, 6);
    assert!(matches!(
        poll(&mut c),
        Poll::Ready(Err(LaneError::Busy { .. }))
    ));
    open.store(true, Ordering::SeqCst);
    assert!(matches!(poll(&mut a), Poll::Ready(Ok(2))));
    clock.advance(ms(5));
    // b leads the next batch: [b, b2], both waited 5 ms.
    assert!(matches!(poll(&mut b), Poll::Ready(Ok(4))));
    assert!(matches!(poll(&mut b2), Poll::Ready(Ok(20))));
    // An error and a panic, each alone.
    let mut d = lanes.execute(1, 3);
    assert!(matches!(
        poll(&mut d),
        Poll::Ready(Err(LaneError::Kernel(_)))
    ));
    let mut e = lanes.execute(1, 99);
    assert!(matches!(
        poll(&mut e),
        Poll::Ready(Err(LaneError::Panicked(_)))
    ));

    // Key 2 and key 3 and key 5 hold batches; g waits behind f: four in
    // flight, so y is refused by the limit.
    open.store(false, Ordering::SeqCst);
    let mut f = lanes.execute(2, 8);
    assert!(poll(&mut f).is_pending());
    let deadline = clock.now() + ms(1);
    let mut g = lanes.execute_with_deadline(2, 10, deadline);
    assert!(poll(&mut g).is_pending());
    let (mut x, mut w) = (lanes.execute(3, 14), lanes.execute(5, 18));
    assert!(poll(&mut x).is_pending() && poll(&mut w).is_pending());
    let mut y = lanes.execute(4, 16);
    assert!(matches!(
        poll(&mut y),
        Poll::Ready(Err(LaneError::Busy { .. }))
    ));
    // g's deadline passes: withdrawn. h is dropped while queued: withdrawn.
    clock.advance(ms(2));
    assert!(matches!(
        poll(&mut g),
        Poll::Ready(Err(LaneError::Withdrawn(10)))
    ));
    let mut h = lanes.execute(2, 12);
    assert!(poll(&mut h).is_pending());
    drop(h);
    open.store(true, Ordering::SeqCst);
    assert!(matches!(poll(&mut f), Poll::Ready(Ok(8))));
    assert!(matches!(poll(&mut x), Poll::Ready(Ok(14))));
    assert!(matches!(poll(&mut w), Poll::Ready(Ok(18))));
    assert!(lanes.close_blocking(Duration::from_secs(1)));
    let mut z = lanes.execute(1, 2);
    assert!(matches!(
        poll(&mut z),
        Poll::Ready(Err(LaneError::Closed(2)))
    ));

    let s = Series::take(&snapshotter);
    let outcome = |o: &str| {
        s.counter(
            "keyed_executor_lane_commands_total",
            &[("lanes", "accounts"), ("outcome", o)],
        )
    };
    assert_eq!(outcome("ok"), 6);
    assert_eq!(outcome("error"), 1);
    assert_eq!(outcome("panicked"), 1);
    assert_eq!(outcome("withdrawn"), 2);
    assert_eq!(outcome("busy"), 2);
    assert_eq!(outcome("closed"), 1);
    let busy = |r: &str| {
        s.counter(
            "keyed_executor_lane_busy_total",
            &[("lanes", "accounts"), ("reason", r)],
        )
    };
    assert_eq!(busy("lane_full"), 1);
    assert_eq!(busy("in_flight_limit"), 1);
    let mut sizes = s.samples("keyed_executor_lane_batch_size", &[("lanes", "accounts")]);
    sizes.sort_by(f64::total_cmp);
    assert_eq!(sizes, [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0]);
    let mut waits = s.samples("keyed_executor_lane_wait_seconds", &[("lanes", "accounts")]);
    waits.sort_by(f64::total_cmp);
    assert_eq!(waits, [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.005, 0.005]);
}

#[test]
fn counts_stay_exact_when_many_dispatchers_share_a_worker() {
    // Six dispatchers (more than a worker keeps pending counts for) take
    // turns on one worker, message by message; every third message of the
    // odd ones panics.
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let _local = metrics::set_default_local_recorder(&recorder);
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let receivers: Vec<_> = (0..6)
        .map(|d| {
            executor
                .dispatcher_builder(handler::from_fn(move |_: &u32, n: u32| {
                    assert!(!(d % 2 == 1 && n % 3 == 0), "unlucky");
                    n
                }))
                .name(format!("d{d}"))
                .build()
                .receiver(8)
                .unwrap()
        })
        .collect();
    for n in 0..300u32 {
        for r in &receivers {
            let _ = r.submit_blocking(n % 7, n).unwrap().wait();
        }
    }
    // Fire-and-forget too: a batch of sends to each, interleaved.
    for n in 0..3000u32 {
        receivers[(n % 6) as usize].send(n % 11, 1 + 3 * n).unwrap();
    }
    assert!(executor.shutdown(Duration::from_secs(10)));
    let s = Series::take(&snapshotter);
    for d in 0..6 {
        let name = format!("d{d}");
        let count = |o: &str| {
            s.counter(
                "keyed_executor_messages_total",
                &[("dispatcher", name.as_str()), ("outcome", o)],
            )
        };
        let panicked = if d % 2 == 1 { 100 } else { 0 };
        assert_eq!(count("done"), 300 - panicked + 500, "{name}");
        assert_eq!(count("panicked"), panicked, "{name}");
    }
    drop(receivers);
}
