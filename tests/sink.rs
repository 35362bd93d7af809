//! `ReceiverSink` (the `sink` feature): a receiver as a `futures::Sink` of
//! `(key, message)` pairs. A stream forwarded into a dispatcher keeps each
//! key's order and loses nothing; credit is the backpressure (`poll_ready`
//! waits at `max_in_flight`, holding no thread, and a release wakes it); a
//! stop wakes a waiting `poll_ready` and hands the pair back; a reserved
//! unit that is never used comes back (drop, `abort_send`, `poll_close`, a
//! stop seen by `poll_ready`); from a handler the sink never waits.
//!
//! Run with `cargo test --features sink --test sink`. Nothing here asserts
//! on time: waits are for outcomes, with a generous guard.

mod common;

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll, Wake, Waker};
use std::thread;
use std::time::Duration;

use common::eventually;
use futures::channel::oneshot;
use futures::executor::block_on;
use futures::{stream, Sink, SinkExt, StreamExt};
use keyed_executor::{
    handler, Dispatcher, KeyedExecutor, Receiver, ReceiverSink, SubmitError, WeakReceiver,
};

const LONG: Duration = Duration::from_secs(60);

/// Per key, the values its messages carried, in the order they ran.
type Ran = Arc<Mutex<HashMap<u32, Vec<u32>>>>;

/// A dispatcher whose sync handler logs each message under its key.
fn logging(executor: &KeyedExecutor, ran: &Ran) -> Dispatcher<u32, u32, ()> {
    let ran = ran.clone();
    executor.dispatcher(handler::from_fn(move |key: &u32, v: u32| {
        ran.lock().unwrap().entry(*key).or_default().push(v);
    }))
}

/// Every key ran exactly the values `0..n` with `v % keys == key`, in
/// ascending order: per-key order held and nothing was lost or doubled.
fn assert_in_order_and_complete(ran: &Ran, n: u32, keys: u32) {
    let ran = ran.lock().unwrap();
    assert_eq!(ran.len(), keys as usize);
    for key in 0..keys {
        let want: Vec<u32> = (0..n).filter(|v| v % keys == key).collect();
        assert_eq!(ran[&key], want, "key {key}");
    }
}

/// A message that waits (asynchronously: its worker goes on) until the
/// test lets it finish.
struct Held {
    id: u32,
    release: oneshot::Receiver<()>,
}

/// A dispatcher whose async handler suspends each [`Held`] message until
/// it is released, then counts it in `ended` and returns its id.
fn holding(executor: &KeyedExecutor, ended: &Arc<AtomicUsize>) -> Dispatcher<u32, Held, u32> {
    let ended = ended.clone();
    executor.dispatcher(handler::from_async_fn(move |_key: u32, msg: Held| {
        let ended = ended.clone();
        async move {
            let _ = msg.release.await;
            ended.fetch_add(1, SeqCst);
            msg.id
        }
    }))
}

fn held(id: u32) -> (Held, oneshot::Sender<()>) {
    let (tx, rx) = oneshot::channel();
    (Held { id, release: rx }, tx)
}

/// A waker that counts its wakes.
#[derive(Default)]
struct Counter(AtomicUsize);

impl Wake for Counter {
    fn wake(self: Arc<Self>) {
        self.0.fetch_add(1, SeqCst);
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.fetch_add(1, SeqCst);
    }
}

fn counting_waker() -> (Arc<Counter>, Waker) {
    let c = Arc::new(Counter::default());
    (c.clone(), Waker::from(c))
}

fn poll_ready<S: Sink<(u32, Held)> + Unpin>(sink: &mut S, waker: &Waker) -> Poll<()> {
    Pin::new(sink)
        .poll_ready(&mut Context::from_waker(waker))
        .map(|r| r.unwrap_or_else(|_| panic!("poll_ready never fails")))
}

#[test]
fn a_sink_is_send_sync_unpin_and_static_for_spawned_pipelines() {
    fn check<T: Send + Sync + Unpin + 'static>() {}
    check::<ReceiverSink<u32, String, u32>>();
    check::<ReceiverSink<String, Box<dyn std::any::Any + Send>, ()>>();
}

/// `stream.forward(sink)`: 10,000 records over 97 keys into two workers
/// with 8 units of credit. Every record runs once, each key's in the
/// order of the stream; the sink's last position is the last record's.
#[test]
fn forward_a_stream_into_a_dispatcher_keeps_each_keys_order() {
    let executor = KeyedExecutor::builder().workers(2).build().unwrap();
    let ran = Ran::default();
    let receiver = logging(&executor, &ran).receiver(8).unwrap();
    let mut sink = receiver.sink();
    let records = stream::iter((0..10_000u32).map(|v| Ok((v % 97, v))));
    block_on(records.forward(&mut sink)).unwrap();
    assert_eq!(sink.last_position(), Some(9_999));
    assert!(!sink.is_reserved());
    assert!(receiver.shutdown(LONG));
    assert_in_order_and_complete(&ran, 10_000, 97);
    assert_eq!(receiver.in_flight(), 0);
    assert!(executor.shutdown(LONG));
}

/// The same through `SinkExt::send_all`, from tasks of a tokio runtime:
/// four pipelines, one per receiver (each its own source with 4 units),
/// spawned (the sink is `'static`), into an async handler that suspends
/// once per message.
#[test]
fn send_all_from_spawned_tokio_tasks_with_an_async_handler() {
    let executor = KeyedExecutor::builder().workers(2).build().unwrap();
    let ran = Ran::default();
    let r2 = ran.clone();
    let dispatcher = executor.dispatcher(handler::from_async_fn(move |key: u32, v: u32| {
        let ran = r2.clone();
        async move {
            common::YieldOnce(false).await;
            ran.lock().unwrap().entry(key).or_default().push(v);
        }
    }));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    let tasks: Vec<_> = (0..4u32)
        .map(|p| {
            let mut sink = dispatcher.receiver(4).unwrap().into_sink();
            // Pipeline p carries the values v with v % 4 == p, for keys
            // 10 * p .. 10 * p + 9: each key is fed by one pipeline.
            rt.spawn(async move {
                let mut records = stream::iter((0..2_000u32).filter(move |v| v % 4 == p))
                    .map(move |v| Ok::<_, SubmitError<(u32, u32)>>((10 * p + (v / 4) % 10, v)));
                sink.send_all(&mut records).await?;
                sink.close().await?;
                Ok::<_, SubmitError<(u32, u32)>>(sink.last_position())
            })
        })
        .collect();
    for t in tasks {
        assert_eq!(rt.block_on(t).unwrap().unwrap(), Some(499));
    }
    assert!(dispatcher.shutdown(LONG));
    let ran = ran.lock().unwrap();
    assert_eq!(ran.values().map(Vec::len).sum::<usize>(), 2_000);
    for (key, values) in ran.iter() {
        let p = key / 10;
        let want: Vec<u32> = (0..2_000u32)
            .filter(|v| v % 4 == p && 10 * p + (v / 4) % 10 == *key)
            .collect();
        assert_eq!(values, &want, "key {key}");
    }
    drop(ran);
    assert!(executor.shutdown(LONG));
}

/// Backpressure, step by step: with 4 units, four `poll_ready` +
/// `start_send` go through; the fifth `poll_ready` is pending (no unit is
/// reserved, nothing more accepted, and polling again changes nothing)
/// until a message finishes, whose release wakes the task; then it
/// reserves, and `start_send` cannot be refused for credit.
#[test]
fn poll_ready_waits_at_max_in_flight_until_a_message_finishes() {
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let ended = Arc::new(AtomicUsize::new(0));
    let receiver = holding(&executor, &ended).receiver(4).unwrap();
    let mut sink = receiver.sink();
    let (wakes, waker) = counting_waker();
    let mut releases = Vec::new();
    for id in 0..4 {
        assert_eq!(poll_ready(&mut sink, &waker), Poll::Ready(()));
        assert!(sink.is_reserved());
        let (msg, release) = held(id);
        releases.push(release);
        Pin::new(&mut sink).start_send((id, msg)).unwrap();
    }
    assert_eq!((receiver.in_flight(), receiver.accepted()), (4, 4));
    for _ in 0..3 {
        assert_eq!(poll_ready(&mut sink, &waker), Poll::Pending);
        assert!(!sink.is_reserved());
        assert_eq!((receiver.in_flight(), receiver.accepted()), (4, 4));
    }
    // Another submitter finds no unit either: the sink holds none back.
    let (msg, _keep) = held(99);
    assert!(receiver.try_send(9, msg).unwrap_err().is_full());
    assert_eq!(wakes.0.load(SeqCst), 0, "nothing woke it yet");
    releases.remove(0).send(()).unwrap();
    eventually("a release woke the waiting poll_ready", || {
        wakes.0.load(SeqCst) > 0
    });
    eventually("the unit was reserved", || {
        poll_ready(&mut sink, &waker).is_ready()
    });
    assert!(sink.is_reserved());
    assert_eq!(receiver.in_flight(), 4, "a reservation counts as in flight");
    let (msg, release) = held(4);
    releases.push(release);
    Pin::new(&mut sink).start_send((4, msg)).unwrap();
    assert_eq!(sink.last_position(), Some(4));
    for r in releases {
        r.send(()).unwrap();
    }
    assert!(receiver.shutdown(LONG));
    assert_eq!(ended.load(SeqCst), 5);
    assert!(executor.shutdown(LONG));
}

/// Backpressure under `forward`: 200 held messages through 4 units, each
/// released by a thread as soon as it is accepted. At every sample, the
/// messages accepted and not yet ended are at most 4 (`ended` counts
/// before the unit comes back, so the sample can only overstate it).
#[test]
fn forward_never_holds_more_than_max_in_flight_unfinished() {
    let executor = KeyedExecutor::builder().workers(2).build().unwrap();
    let ended = Arc::new(AtomicUsize::new(0));
    let receiver = holding(&executor, &ended).receiver(4).unwrap();
    let (tx, releases) = std::sync::mpsc::channel::<oneshot::Sender<()>>();
    let releaser = thread::spawn(move || {
        for r in releases {
            thread::yield_now();
            let _ = r.send(());
        }
    });
    let sink = receiver.sink();
    let producer = thread::spawn(move || {
        let records = stream::iter(0..200u32).map(move |id| {
            let (msg, release) = held(id);
            tx.send(release).unwrap();
            Ok((id % 7, msg))
        });
        block_on(records.forward(sink))
    });
    let mut samples = 0;
    while !producer.is_finished() {
        let accepted = receiver.accepted() as usize;
        let done = ended.load(SeqCst);
        assert!(
            accepted <= done + 4,
            "{accepted} accepted, {done} ended: over max_in_flight"
        );
        assert!(receiver.in_flight() <= 4);
        samples += 1;
        thread::yield_now();
    }
    assert!(samples > 0);
    assert!(producer.join().unwrap().is_ok());
    releaser.join().unwrap();
    assert!(receiver.shutdown(LONG));
    assert_eq!(ended.load(SeqCst), 200);
    assert!(executor.shutdown(LONG));
}

/// A stop while `poll_ready` waits wakes it at once (within the stop's
/// call); it says ready without a unit, and `start_send` hands the very
/// pair back as `Closed`. Checked for each of the receiver's, the
/// dispatcher's and the executor's stops.
#[test]
fn a_stop_wakes_a_waiting_poll_ready_and_start_send_hands_the_pair_back() {
    for stop in 0..4 {
        let executor = KeyedExecutor::builder().workers(1).build().unwrap();
        let ended = Arc::new(AtomicUsize::new(0));
        let dispatcher = holding(&executor, &ended);
        let receiver = dispatcher.receiver(1).unwrap();
        let (first, release) = held(0);
        let done = receiver.submit_blocking(0, first).unwrap();
        let mut sink = receiver.sink();
        let (wakes, waker) = counting_waker();
        assert_eq!(poll_ready(&mut sink, &waker), Poll::Pending);
        let stopper = match stop {
            0 => {
                receiver.close();
                None
            }
            1 => {
                let d = dispatcher.clone();
                Some(thread::spawn(move || assert!(d.shutdown(LONG))))
            }
            2 => {
                let r = receiver.clone();
                Some(thread::spawn(move || r.shutdown_now()))
            }
            _ => {
                let ex = executor.clone();
                Some(thread::spawn(move || ex.shutdown_now()))
            }
        };
        eventually("the stop woke the waiting poll_ready", || {
            wakes.0.load(SeqCst) > 0
        });
        assert_eq!(poll_ready(&mut sink, &waker), Poll::Ready(()));
        assert!(!sink.is_reserved(), "stop {stop}: no unit taken");
        let (msg, _keep) = held(7);
        match Pin::new(&mut sink).start_send((3, msg)) {
            Err(SubmitError::Closed((key, msg))) => assert_eq!((key, msg.id), (3, 7)),
            other => panic!("stop {stop}: expected Closed((3, 7)), got {other:?}"),
        }
        assert_eq!(receiver.accepted(), 1, "stop {stop}");
        let _ = release.send(());
        let _ = done.wait();
        if let Some(s) = stopper {
            s.join().unwrap();
        }
        assert!(executor.shutdown(LONG));
        assert_eq!(receiver.in_flight(), 0, "stop {stop}");
    }
}

/// Nothing is lost at a stop under `forward`: of three records, the first
/// is accepted, the second waits in `forward` for credit and comes back in
/// the error when the receiver closes, the third is still in the stream.
#[test]
fn forward_ends_at_a_stop_with_the_record_it_held() {
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let ended = Arc::new(AtomicUsize::new(0));
    let receiver = holding(&executor, &ended).receiver(1).unwrap();
    let (m0, release) = held(0);
    let (m1, _k1) = held(1);
    let (m2, _k2) = held(2);
    let sink = receiver.sink();
    let producer = thread::spawn(move || {
        let mut records = stream::iter([(10, m0), (11, m1), (12, m2)]).map(Ok);
        let end = block_on(records.by_ref().forward(sink));
        let rest: Vec<u32> = block_on(records.map(|r| r.unwrap().1.id).collect());
        (end, rest)
    });
    eventually("the first record is accepted", || receiver.accepted() == 1);
    receiver.close();
    let (end, rest) = producer.join().unwrap();
    match end {
        Err(SubmitError::Closed((key, msg))) => assert_eq!((key, msg.id), (11, 1)),
        other => panic!("expected Closed((11, 1)), got {other:?}"),
    }
    assert_eq!(rest, [2], "the third record is still in the stream");
    release.send(()).unwrap();
    assert!(receiver.shutdown(LONG));
    assert_eq!((receiver.accepted(), ended.load(SeqCst)), (1, 1));
    assert!(executor.shutdown(LONG));
}

/// A unit reserved and never used comes back: on drop, on `abort_send`,
/// on `poll_close`, and when `poll_ready` finds the receiver closed. Until
/// then it counts as in flight (another submitter finds the receiver
/// full, and a graceful drain waits for it).
#[test]
fn an_unused_reservation_comes_back() {
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let ended = Arc::new(AtomicUsize::new(0));
    let dispatcher = holding(&executor, &ended);
    let receiver = dispatcher.receiver(1).unwrap();
    let (_wakes, waker) = counting_waker();
    let full = |r: &Receiver<u32, Held, u32>| {
        let (msg, _) = held(99);
        r.try_send(0, msg).map(drop).map_err(|e| e.is_full())
    };

    // Drop.
    let mut sink = receiver.sink();
    assert_eq!(poll_ready(&mut sink, &waker), Poll::Ready(()));
    assert_eq!(receiver.in_flight(), 1);
    assert_eq!(full(&receiver), Err(true), "the reservation holds the unit");
    drop(sink);
    assert_eq!(receiver.in_flight(), 0, "dropping the sink gave it back");

    // abort_send, then poll_close.
    let mut sink = receiver.sink();
    assert_eq!(poll_ready(&mut sink, &waker), Poll::Ready(()));
    assert!(sink.abort_send());
    assert!(!sink.abort_send(), "nothing left to give back");
    assert_eq!(receiver.in_flight(), 0);
    assert_eq!(poll_ready(&mut sink, &waker), Poll::Ready(()));
    assert_eq!(receiver.in_flight(), 1);
    block_on(SinkExt::<(u32, Held)>::close(&mut sink)).unwrap();
    assert_eq!(receiver.in_flight(), 0, "poll_close gave it back");
    let (msg, _keep) = held(5);
    match Pin::new(&mut sink).start_send((5, msg)) {
        Err(SubmitError::Closed((5, msg))) => assert_eq!(msg.id, 5),
        other => panic!("a closed sink refuses: {other:?}"),
    }
    assert!(
        !receiver.is_closed(),
        "closing the sink left the receiver open"
    );
    drop(sink);

    // A graceful drain waits for a reservation; the stop makes the sink
    // give it back at its next poll_ready (or start_send).
    let mut sink = receiver.sink();
    assert_eq!(poll_ready(&mut sink, &waker), Poll::Ready(()));
    assert!(
        !receiver.shutdown(Duration::ZERO),
        "the reservation is in flight"
    );
    assert_eq!(poll_ready(&mut sink, &waker), Poll::Ready(()));
    assert!(!sink.is_reserved());
    assert_eq!(receiver.in_flight(), 0);
    assert!(receiver.shutdown(Duration::ZERO), "drained");
    drop(sink);
    assert_eq!(ended.load(SeqCst), 0, "nothing was sent");
    assert!(executor.shutdown(LONG));
}

/// Two sinks wait for the one unit; the first is woken by the release and
/// dropped before it polls again: its wake passes to the second, which
/// reserves. No unit is left unused while a sink waits.
#[test]
fn a_woken_sink_dropped_before_it_polls_passes_the_wake_on() {
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let ended = Arc::new(AtomicUsize::new(0));
    let receiver = holding(&executor, &ended).receiver(1).unwrap();
    let (m0, release) = held(0);
    receiver.send(0, m0).unwrap();
    let (mut a, mut b) = (receiver.sink(), receiver.sink());
    let (wakes_a, waker_a) = counting_waker();
    let (wakes_b, waker_b) = counting_waker();
    assert_eq!(poll_ready(&mut a, &waker_a), Poll::Pending);
    assert_eq!(poll_ready(&mut b, &waker_b), Poll::Pending);
    release.send(()).unwrap();
    eventually("the release woke the first sink", || {
        wakes_a.0.load(SeqCst) > 0
    });
    drop(a);
    eventually("the wake passed on to the second sink", || {
        wakes_b.0.load(SeqCst) > 0
    });
    eventually("the second sink reserved the unit", || {
        poll_ready(&mut b, &waker_b).is_ready() && b.is_reserved()
    });
    let (m1, r1) = held(1);
    Pin::new(&mut b).start_send((0, m1)).unwrap();
    r1.send(()).unwrap();
    assert!(receiver.shutdown(LONG));
    assert_eq!(ended.load(SeqCst), 2);
    assert!(executor.shutdown(LONG));
}

/// From a handler the sink never waits: with one unit of credit, a root
/// message's handler sends three follow-ups through a sink to its own
/// dispatcher. The first shares the running message's unit and goes
/// through; the next two find no unit and come back `Full` with their
/// pairs — refused, never a deadlock. The follow-up runs.
#[test]
fn from_a_handler_the_sink_never_waits() {
    let executor = KeyedExecutor::builder().workers(2).build().unwrap();
    /// What the root's three sends came to: the pairs refused.
    type Sent = Vec<Result<(), (u32, u32)>>;
    let me: Arc<OnceLock<WeakReceiver<u32, u32, Sent>>> = Arc::default();
    let m = me.clone();
    let dispatcher = executor.dispatcher(handler::from_async_fn(move |key: u32, v: u32| {
        let me = m.get().and_then(WeakReceiver::upgrade);
        async move {
            let mut results = Vec::new();
            if let (0, Some(rx)) = (v, me) {
                let mut sink = rx.sink();
                for i in 1..=3 {
                    results.push(sink.send((key + i, i)).await.map_err(|e| {
                        assert!(e.is_full(), "refused for credit, not closed");
                        e.into_inner()
                    }));
                }
            }
            results
        }
    }));
    let receiver = dispatcher.receiver(1).unwrap();
    me.set(receiver.downgrade()).ok();
    let root = receiver.submit_blocking(0, 0).unwrap();
    assert_eq!(root.wait().unwrap(), [Ok(()), Err((2, 2)), Err((3, 3))]);
    assert!(receiver.shutdown(LONG));
    assert_eq!(receiver.accepted(), 2, "the root and its one follow-up");
    assert!(executor.shutdown(LONG));
}

/// A force stop waits for the source to drain, a reservation included: it
/// returns once the sink, polled again, sees the stop and gives the unit
/// back (as documented: hold a reservation briefly).
#[test]
fn shutdown_now_returns_once_a_reserving_sink_sees_the_stop() {
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let ended = Arc::new(AtomicUsize::new(0));
    let receiver = holding(&executor, &ended).receiver(2).unwrap();
    let mut sink = receiver.sink();
    let (_wakes, waker) = counting_waker();
    assert_eq!(poll_ready(&mut sink, &waker), Poll::Ready(()));
    assert!(sink.is_reserved());
    let stopper = {
        let r = receiver.clone();
        thread::spawn(move || r.shutdown_now())
    };
    eventually("the stop closed the receiver", || receiver.is_closed());
    assert_eq!(receiver.in_flight(), 1, "the reservation is still out");
    assert_eq!(poll_ready(&mut sink, &waker), Poll::Ready(()));
    assert!(
        !sink.is_reserved(),
        "the sink saw the stop and gave it back"
    );
    stopper.join().unwrap();
    assert_eq!(receiver.in_flight(), 0);
    let (msg, _keep) = held(1);
    match Pin::new(&mut sink).start_send((1, msg)) {
        Err(SubmitError::Closed((1, msg))) => assert_eq!(msg.id, 1),
        other => panic!("expected Closed((1, 1)), got {other:?}"),
    }
    assert_eq!(ended.load(SeqCst), 0);
    assert!(executor.shutdown(LONG));
}
