//! Sources and components that stop on their own (partition revocation,
//! the commit point, the component lifecycle), through the
//! public API: a receiver's `close`, `shutdown`, `shutdown_async` and
//! `shutdown_now` while other receivers on the same keys and workers go on;
//! positions and `committable()`; a dispatcher's `shutdown` and
//! `shutdown_now` while another dispatcher runs on the same workers.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use common::{eventually, Gate};
use futures::channel::oneshot;
use keyed_executor::{
    handler, Completion, ConfigError, Dispatcher, KeyedExecutor, Receiver, SubmitError, TaskError,
};

const LONG: Duration = Duration::from_secs(30);

/// What a job does when it runs.
enum Kind {
    /// Returns at once.
    Plain,
    /// Blocks its worker until the gate opens (a long step).
    Block(Gate),
    /// Suspends until the event is sent (or its sender dropped).
    Await(oneshot::Receiver<()>),
    /// Panics.
    Panic,
}

struct Job {
    /// Which receiver sent it (for the log).
    src: u8,
    id: u32,
    kind: Kind,
}

fn job(src: u8, id: u32, kind: Kind) -> Job {
    Job { src, id, kind }
}

/// Starts, in order: (key, source, id).
type Starts = Arc<Mutex<Vec<(u32, u8, u32)>>>;

type Jobs = Dispatcher<u32, Job, u32>;

fn dispatcher(executor: &KeyedExecutor, starts: &Starts) -> Jobs {
    let starts = starts.clone();
    executor
        .dispatcher_builder(handler::from_async_fn(move |key: u32, job: Job| {
            starts.lock().unwrap().push((key, job.src, job.id));
            async move {
                match job.kind {
                    Kind::Plain => {}
                    Kind::Block(gate) => gate.wait(),
                    Kind::Await(rx) => {
                        let _ = rx.await;
                    }
                    Kind::Panic => panic!("job {} panics on purpose", job.id),
                }
                job.id
            }
        }))
        .build()
}

fn started(starts: &Starts, src: u8, id: u32) -> bool {
    starts
        .lock()
        .unwrap()
        .iter()
        .any(|&(_, s, i)| s == src && i == id)
}

/// Per key, the ids of source `src` in the order they started.
fn order_of(starts: &Starts, src: u8) -> HashMap<u32, Vec<u32>> {
    let mut out: HashMap<u32, Vec<u32>> = HashMap::new();
    for &(key, s, id) in starts.lock().unwrap().iter() {
        if s == src {
            out.entry(key).or_default().push(id);
        }
    }
    out
}

fn rejected_id(outcome: Result<u32, TaskError<Job>>) -> u32 {
    match outcome {
        Err(TaskError::Rejected(job)) => job.id,
        other => panic!(
            "expected a hand-back, got {:?}",
            other.map_err(|e| e.to_string())
        ),
    }
}

#[test]
fn a_closed_source_refuses_its_late_messages_while_another_on_the_same_keys_runs() {
    let executor = KeyedExecutor::builder().workers(2).build().unwrap();
    let starts = Starts::default();
    let d = dispatcher(&executor, &starts);
    let (a, b) = (
        d.receiver_builder()
            .max_in_flight(16)
            .track_commits(true)
            .build()
            .unwrap(),
        d.receiver_builder()
            .max_in_flight(128)
            .track_commits(true)
            .build()
            .unwrap(),
    );
    let gate = Gate::new();
    // A's first message holds key 0; its second queues behind it.
    let first = a
        .submit_blocking(0, job(0, 0, Kind::Block(gate.clone())))
        .unwrap();
    let second = a.submit_blocking(0, job(0, 1, Kind::Plain)).unwrap();
    assert_eq!((first.position(), second.position()), (0, 1));
    a.close();
    a.close(); // idempotent
    assert!(a.is_closed() && !b.is_closed() && !d.is_closed());
    // Every method hands the late message back whole.
    match a.try_send(0, job(0, 2, Kind::Plain)) {
        Err(SubmitError::Closed(j)) => assert_eq!(j.id, 2),
        other => panic!(
            "expected Closed, got {:?}",
            other.map_err(|e| e.to_string())
        ),
    }
    match a.send(1, job(0, 3, Kind::Plain)) {
        Err(SubmitError::Closed(j)) => assert_eq!(j.id, 3),
        other => panic!(
            "expected Closed, got {:?}",
            other.map_err(|e| e.to_string())
        ),
    }
    match futures::executor::block_on(a.submit(1, job(0, 4, Kind::Plain))) {
        Err(SubmitError::Closed(j)) => assert_eq!(j.id, 4),
        other => panic!(
            "expected Closed, got {:?}",
            other.map(|_| ()).map_err(|e| e.to_string())
        ),
    }
    // A clone shares the stop.
    assert!(a
        .clone()
        .try_send(2, job(0, 5, Kind::Plain))
        .unwrap_err()
        .is_closed());
    // Zero timeout: look now; its accepted messages are still running.
    assert!(!a.shutdown(Duration::ZERO));
    // B, on the same keys (and behind A's long step on key 0), is
    // untouched.
    let mut b_done = Vec::new();
    for i in 0..100u32 {
        b_done.push(b.submit_blocking(i % 3, job(1, i, Kind::Plain)).unwrap());
    }
    gate.open();
    for (i, c) in b_done.into_iter().enumerate() {
        assert_eq!(c.wait().unwrap(), i as u32);
    }
    assert_eq!(first.wait().unwrap(), 0);
    assert_eq!(second.wait().unwrap(), 1);
    assert!(a.shutdown(LONG), "A drained");
    assert_eq!(a.accepted(), 2, "refused messages take no position");
    assert_eq!(a.committable(), Some(2));
    for (key, ids) in order_of(&starts, 1) {
        let mut sorted = ids.clone();
        sorted.sort_unstable();
        assert_eq!(ids, sorted, "B's key {key} ran out of order");
    }
    assert!(b.send(0, job(1, 1000, Kind::Plain)).is_ok());
    assert!(executor.shutdown(LONG));
}

#[test]
fn draining_one_source_waits_for_its_suspended_futures_only() {
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let starts = Starts::default();
    let d = dispatcher(&executor, &starts);
    let (a, b) = (
        d.receiver_builder()
            .max_in_flight(8)
            .track_commits(true)
            .build()
            .unwrap(),
        d.receiver_builder()
            .max_in_flight(8)
            .track_commits(true)
            .build()
            .unwrap(),
    );
    let mut events = Vec::new();
    let mut done = Vec::new();
    for i in 0..3u32 {
        let (tx, rx) = oneshot::channel();
        events.push(tx);
        done.push(a.submit_blocking(i, job(0, i, Kind::Await(rx))).unwrap());
    }
    // B has a suspended future too: A's drain does not wait for it.
    let (b_tx, b_rx) = oneshot::channel();
    let b_slow = b.submit_blocking(10, job(1, 0, Kind::Await(b_rx))).unwrap();
    eventually("all four suspended", || starts.lock().unwrap().len() == 4);
    assert!(!a.shutdown(Duration::ZERO), "three futures still pending");
    // The async form, with a deadline that passes first: false.
    assert!(!futures::executor::block_on(
        a.shutdown_async(Duration::from_millis(5))
    ));
    let a2 = a.clone();
    let drainer = thread::spawn(move || a2.shutdown(LONG));
    for tx in events {
        tx.send(()).unwrap();
    }
    assert!(drainer.join().unwrap(), "A drained within the timeout");
    for (i, c) in done.into_iter().enumerate() {
        assert_eq!(c.wait().unwrap(), i as u32);
    }
    assert!(futures::executor::block_on(a.shutdown_async(LONG)));
    assert_eq!(a.committable(), Some(3));
    // B still suspended, and still taking messages.
    assert!(!b_slow.is_finished());
    assert_eq!(
        b.submit_blocking(1, job(1, 1, Kind::Plain))
            .unwrap()
            .wait()
            .unwrap(),
        1
    );
    b_tx.send(()).unwrap();
    assert_eq!(b_slow.wait().unwrap(), 0);
    assert!(executor.shutdown(LONG));
}

#[test]
fn shutdown_now_of_one_source_hands_back_only_its_own_messages_on_shared_keys_and_worker() {
    // One worker: every key's mailbox and both sources share it.
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let starts = Starts::default();
    let rejected_on = Arc::new(Mutex::new(Vec::new()));
    let hook_log = rejected_on.clone();
    let s2 = starts.clone();
    let d = executor
        .dispatcher_builder(handler::from_async_fn(move |key: u32, job: Job| {
            s2.lock().unwrap().push((key, job.src, job.id));
            async move {
                match job.kind {
                    Kind::Block(gate) => gate.wait(),
                    Kind::Await(rx) => {
                        let _ = rx.await;
                    }
                    _ => {}
                }
                job.id
            }
        }))
        .on_reject(move |_key, job: Job| {
            hook_log
                .lock()
                .unwrap()
                .push((job.src, job.id, thread::current().id()));
        })
        .build();
    let (a, b) = (
        d.receiver_builder()
            .max_in_flight(64)
            .track_commits(true)
            .build()
            .unwrap(),
        d.receiver_builder()
            .max_in_flight(64)
            .track_commits(true)
            .build()
            .unwrap(),
    );
    // A's future suspended on key 5, B's long step holding the worker.
    let (a_tx, a_rx) = oneshot::channel::<()>();
    let a_suspended = a
        .submit_blocking(5, job(0, 100, Kind::Await(a_rx)))
        .unwrap();
    eventually("A's future started", || started(&starts, 0, 100));
    let gate = Gate::new();
    let b_long = b
        .submit_blocking(0, job(1, 100, Kind::Block(gate.clone())))
        .unwrap();
    eventually("B's long step started", || started(&starts, 1, 100));
    // Interleaved on shared keys, all queued behind the long step.
    let mut a_done = Vec::new();
    let mut b_done = Vec::new();
    for i in 0..20u32 {
        let key = i % 4;
        if i % 5 == 4 {
            a.send(key, job(0, i, Kind::Plain)).unwrap();
        } else {
            a_done.push((i, a.submit_blocking(key, job(0, i, Kind::Plain)).unwrap()));
        }
        b_done.push((i, b.submit_blocking(key, job(1, i, Kind::Plain)).unwrap()));
    }
    a.shutdown_now();
    let stopped_at = starts.lock().unwrap().len();
    // Every queued A message came back, each once, on this thread.
    for (i, c) in a_done {
        assert_eq!(rejected_id(c.wait()), i);
    }
    let me = thread::current().id();
    let hooked: Vec<u32> = rejected_on
        .lock()
        .unwrap()
        .iter()
        .map(|&(src, id, on)| {
            assert_eq!(src, 0, "only A's sends come back");
            assert_eq!(on, me, "handed back on the stopping thread");
            id
        })
        .collect();
    assert_eq!(hooked, vec![4, 9, 14, 19]);
    // A's suspended future was cancelled.
    assert!(matches!(a_suspended.wait(), Err(TaskError::Cancelled)));
    drop(a_tx);
    a.shutdown_now(); // idempotent
    assert!(a
        .try_send(0, job(0, 99, Kind::Plain))
        .unwrap_err()
        .is_closed());
    // B runs everything, in order per key, after its long step.
    gate.open();
    assert_eq!(b_long.wait().unwrap(), 100);
    for (i, c) in b_done {
        assert_eq!(c.wait().unwrap(), i);
    }
    let after = starts.lock().unwrap()[stopped_at..].to_vec();
    assert!(
        after.iter().all(|&(_, src, _)| src == 1),
        "an A message started after shutdown_now returned: {after:?}"
    );
    for (key, ids) in order_of(&starts, 1) {
        let expect: Vec<u32> = if key == 0 {
            std::iter::once(100)
                .chain((0..20).filter(|i| i % 4 == 0))
                .collect()
        } else {
            (0..20).filter(|i| i % 4 == key).collect()
        };
        assert_eq!(ids, expect, "B's key {key}");
    }
    assert_eq!(
        a.committable(),
        Some(0),
        "position 0 was cancelled: never committed"
    );
    assert_eq!(a.accepted(), 21);
    assert!(executor.shutdown(LONG));
}

#[test]
fn the_commit_point_follows_out_of_order_finishes_panics_and_stops_at_a_hand_back() {
    common::quiet_injected_panics();
    let executor = KeyedExecutor::builder().workers(2).build().unwrap();
    let starts = Starts::default();
    let d = dispatcher(&executor, &starts);
    let r = d
        .receiver_builder()
        .max_in_flight(16)
        .track_commits(true)
        .build()
        .unwrap();
    let mut events = Vec::new();
    let mut done: Vec<Completion<u32, Job>> = Vec::new();
    for i in 0..4u32 {
        let (tx, rx) = oneshot::channel();
        events.push(Some(tx));
        done.push(r.submit_blocking(i, job(0, i, Kind::Await(rx))).unwrap());
    }
    assert_eq!(r.committable(), Some(0));
    // Finish 3, 1, 2: nothing is committable while 0 runs.
    for i in [3, 1, 2] {
        events[i].take().unwrap().send(()).unwrap();
        eventually("finished", || done[i].is_finished());
        assert_eq!(r.committable(), Some(0), "after {i} finished");
    }
    events[0].take().unwrap().send(()).unwrap();
    eventually("0 finished", || done[0].is_finished());
    assert_eq!(r.committable(), Some(4));
    // A panic is finished too: the commit point passes it.
    let p = r.submit_blocking(7, job(0, 4, Kind::Panic)).unwrap();
    assert_eq!(p.position(), 4);
    assert!(p.wait().unwrap_err().is_panic());
    assert_eq!(r.committable(), Some(5));
    // Position 5 runs long on key 9; 6 queues behind it and is handed back
    // by the stop; 7 (another key) finishes first.
    let gate = Gate::new();
    let long = r
        .submit_blocking(9, job(0, 5, Kind::Block(gate.clone())))
        .unwrap();
    eventually("5 started", || started(&starts, 0, 5));
    let queued = r.submit_blocking(9, job(0, 6, Kind::Plain)).unwrap();
    let other = r.submit_blocking(10, job(0, 7, Kind::Plain)).unwrap();
    assert_eq!(other.wait().unwrap(), 7);
    let r2 = r.clone();
    let stopper = thread::spawn(move || r2.shutdown_now());
    assert_eq!(rejected_id(queued.wait()), 6);
    assert_eq!(r.committable(), Some(5), "5 still runs");
    gate.open();
    stopper.join().unwrap();
    assert_eq!(long.wait().unwrap(), 5);
    assert_eq!(
        r.committable(),
        Some(6),
        "never past the handed-back 6, though 7 finished"
    );
    assert_eq!(r.accepted(), 8);
    assert!(executor.shutdown(LONG));
}

/// A receiver made without `track_commits` has no commit point, and says
/// so: `committable()` is `None` before and after its messages finished,
/// never a 0 that a consumer would commit (and, after a restart, read its
/// whole partition again). The same messages through a tracked receiver
/// give `Some` of how many finished.
#[test]
fn a_receiver_without_commit_tracking_answers_none_never_a_silent_zero() {
    let executor = KeyedExecutor::builder().workers(2).build().unwrap();
    let starts = Starts::default();
    let d = dispatcher(&executor, &starts);
    let untracked = d.receiver(8).unwrap();
    let tracked = d
        .receiver_builder()
        .max_in_flight(8)
        .track_commits(true)
        .build()
        .unwrap();
    assert!(!untracked.tracks_commits() && tracked.tracks_commits());
    assert_eq!(untracked.committable(), None);
    assert_eq!(tracked.committable(), Some(0));
    for i in 0..5u32 {
        for r in [&untracked, &tracked] {
            assert_eq!(
                r.submit_blocking(i, job(0, i, Kind::Plain))
                    .unwrap()
                    .wait()
                    .unwrap(),
                i
            );
        }
    }
    assert_eq!(
        untracked.accepted(),
        5,
        "positions are given out either way"
    );
    assert_eq!(untracked.committable(), None, "still no commit point");
    assert_eq!(tracked.committable(), Some(5));
    assert_eq!(
        (untracked.commit_span(), tracked.commit_span().is_some()),
        (None, true)
    );
    assert!(executor.shutdown(LONG));
}

#[test]
fn at_the_commit_span_submitters_wait_until_the_commit_point_moves() {
    let executor = KeyedExecutor::builder().workers(2).build().unwrap();
    let starts = Starts::default();
    let d = dispatcher(&executor, &starts);
    let r = d
        .receiver_builder()
        .max_in_flight(2)
        .commit_span(4)
        .build()
        .unwrap();
    assert_eq!((r.max_in_flight(), r.commit_span()), (2, Some(4)));
    let (tx, rx) = oneshot::channel();
    let slow = r.submit_blocking(0, job(0, 0, Kind::Await(rx))).unwrap();
    for i in 1..4u32 {
        assert_eq!(
            r.submit_blocking(i, job(0, i, Kind::Plain))
                .unwrap()
                .wait()
                .unwrap(),
            i
        );
    }
    assert_eq!(r.in_flight(), 1, "one unit of two is free...");
    match r.try_submit(5, job(0, 4, Kind::Plain)) {
        Err(SubmitError::Full(j)) => assert_eq!(j.id, 4, "...but the span is full"),
        other => panic!(
            "expected Full, got {:?}",
            other.map(|_| ()).map_err(|e| e.to_string())
        ),
    }
    let r2 = r.clone();
    let waiter = thread::spawn(move || r2.send(5, job(0, 4, Kind::Plain)).unwrap());
    thread::sleep(Duration::from_millis(20));
    assert!(!waiter.is_finished(), "a blocking send waits at the cap");
    tx.send(()).unwrap();
    assert_eq!(slow.wait().unwrap(), 0);
    assert_eq!(
        waiter.join().unwrap(),
        4,
        "accepted once 0 finished, at position 4"
    );
    assert!(r.shutdown(LONG));
    assert_eq!(r.committable(), Some(5));
    assert!(executor.shutdown(LONG));
}

#[test]
fn a_dispatcher_stopped_now_leaves_another_on_the_same_workers_running() {
    let executor = KeyedExecutor::builder().workers(2).build().unwrap();
    let starts = Starts::default();
    let (d1, d2) = (
        dispatcher(&executor, &starts),
        dispatcher(&executor, &starts),
    );
    let (r1, r1b) = (d1.receiver(64).unwrap(), d1.receiver(64).unwrap());
    let r2 = d2.receiver(64).unwrap();
    // d1: a long step on each worker's keys and queued work behind it; a
    // suspended future.
    let gate = Gate::new();
    let long = r1
        .submit_blocking(0, job(0, 1000, Kind::Block(gate.clone())))
        .unwrap();
    eventually("d1's long step", || started(&starts, 0, 1000));
    let (_tx, rx) = oneshot::channel::<()>();
    let suspended = r1b
        .submit_blocking(3, job(0, 1001, Kind::Await(rx)))
        .unwrap();
    eventually("d1's future", || started(&starts, 0, 1001));
    let queued: Vec<_> = (0..10u32)
        .map(|i| r1.submit_blocking(0, job(0, i, Kind::Plain)).unwrap())
        .collect();
    // d2 streams on the same keys while d1 stops.
    let r2c = r2.clone();
    let producer = thread::spawn(move || {
        (0..2000u32)
            .map(|i| r2c.submit_blocking(i % 8, job(2, i, Kind::Plain)).unwrap())
            .collect::<Vec<_>>()
    });
    let d1c = d1.clone();
    let stopper = thread::spawn(move || d1c.shutdown_now());
    for (i, c) in queued.into_iter().enumerate() {
        assert_eq!(rejected_id(c.wait()), i as u32);
    }
    assert!(matches!(suspended.wait(), Err(TaskError::Cancelled)));
    gate.open();
    stopper.join().unwrap();
    assert_eq!(long.wait().unwrap(), 1000, "a running step finishes");
    assert!(d1.is_closed() && !d2.is_closed());
    for r in [&r1, &r1b] {
        assert!(r
            .try_send(1, job(0, 1, Kind::Plain))
            .unwrap_err()
            .is_closed());
    }
    let late = d1.receiver(4).unwrap();
    assert!(late
        .try_send(1, job(0, 1, Kind::Plain))
        .unwrap_err()
        .is_closed());
    for (i, c) in producer.join().unwrap().into_iter().enumerate() {
        assert_eq!(c.wait().unwrap(), i as u32);
    }
    for (key, ids) in order_of(&starts, 2) {
        let mut sorted = ids.clone();
        sorted.sort_unstable();
        assert_eq!(ids, sorted, "d2's key {key} ran out of order");
    }
    d1.shutdown_now(); // idempotent
    assert!(d1.shutdown(Duration::ZERO));
    // Components stopped, then the executor.
    assert!(d2.shutdown(LONG));
    assert!(executor.shutdown(LONG));
}

#[test]
fn a_dispatcher_drains_gracefully_then_the_executor_stops() {
    let executor = KeyedExecutor::builder().workers(2).build().unwrap();
    let starts = Starts::default();
    let (d1, d2) = (
        dispatcher(&executor, &starts),
        dispatcher(&executor, &starts),
    );
    let r1 = d1.receiver(8).unwrap();
    let r2 = d2.receiver(8).unwrap();
    let (tx, rx) = oneshot::channel();
    let slow = r1.submit_blocking(0, job(0, 0, Kind::Await(rx))).unwrap();
    let queued = r1.submit_blocking(0, job(0, 1, Kind::Plain)).unwrap();
    assert!(!d1.shutdown(Duration::ZERO), "d1 has work");
    assert!(r1
        .try_send(2, job(0, 2, Kind::Plain))
        .unwrap_err()
        .is_closed());
    // d2 goes on.
    assert_eq!(
        r2.submit_blocking(0, job(2, 7, Kind::Plain))
            .unwrap()
            .wait()
            .unwrap(),
        7
    );
    let d1c = d1.clone();
    let drainer = thread::spawn(move || d1c.shutdown(LONG));
    tx.send(()).unwrap();
    assert!(drainer.join().unwrap());
    assert_eq!(slow.wait().unwrap(), 0);
    assert_eq!(
        queued.wait().unwrap(),
        1,
        "queued work of a draining dispatcher runs"
    );
    assert!(executor.shutdown(LONG));
}

#[test]
fn receiver_settings_are_validated_and_stops_are_idempotent() {
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let starts = Starts::default();
    let d = dispatcher(&executor, &starts);
    assert!(matches!(
        d.receiver_builder().max_in_flight(0).build(),
        Err(ConfigError::ZeroMaxInFlight)
    ));
    assert!(matches!(
        d.receiver_builder().max_in_flight(8).commit_span(7).build(),
        Err(ConfigError::InvalidCommitSpan { got: 7, min: 8, .. })
    ));
    assert!(matches!(
        d.receiver_builder().commit_span(usize::MAX).build(),
        Err(ConfigError::InvalidCommitSpan { .. })
    ));
    assert!(matches!(
        d.receiver_builder().max_in_flight(usize::MAX).build(),
        Err(ConfigError::MaxInFlightTooLarge { .. })
    ));
    let tracked: Receiver<u32, Job, u32> = d
        .receiver_builder()
        .max_in_flight(4)
        .track_commits(true)
        .build()
        .unwrap();
    assert!(tracked.commit_span() >= Some(keyed_executor::MIN_DEFAULT_COMMIT_SPAN as u64));
    let r: Receiver<u32, Job, u32> = d.receiver(4).unwrap();
    assert_eq!(r.commit_span(), None, "no commit point, no cap");
    assert!(r.shutdown(Duration::ZERO), "nothing accepted: drained");
    r.shutdown_now();
    r.shutdown_now();
    r.close();
    assert!(r.shutdown(Duration::ZERO));
    assert!(d
        .receiver(4)
        .unwrap()
        .send(0, job(0, 0, Kind::Plain))
        .is_ok());
    assert!(executor.shutdown(LONG));
}

/// The last unit of a source whose receivers are all gone comes back while
/// a graceful stop waits with its workers parked: the stop is woken and
/// drains, rather than waiting out its whole timeout.
#[test]
fn a_graceful_stop_ends_when_a_dropped_receivers_last_message_finishes() {
    for workers in [1, 2] {
        let executor = KeyedExecutor::builder().workers(workers).build().unwrap();
        let starts = Starts::default();
        let d = dispatcher(&executor, &starts);
        let r = d.receiver(4).unwrap();
        let (tx, rx) = oneshot::channel();
        r.send(7, job(0, 1, Kind::Await(rx))).unwrap();
        eventually("the message started", || started(&starts, 0, 1));
        drop(r);
        let waker = thread::spawn(move || {
            // Let the stop begin and the workers park first.
            thread::sleep(Duration::from_millis(100));
            tx.send(()).unwrap();
        });
        assert!(executor.shutdown(LONG), "drained ({workers} workers)");
        waker.join().unwrap();
    }
}
