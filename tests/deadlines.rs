//! Deadlines (issue 30), through the public API: a message whose deadline
//! (its own, or the handler's time-to-live) passed while it waited is not
//! run and is handed back as expired — exactly those, through their
//! completions or the expiry hook — and counts as finished for the commit
//! point; a started message is never interrupted. No test asserts on
//! elapsed time: a test waits until a deadline has surely passed before
//! it lets the queue move.

mod common;

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use common::Gate;
use keyed_executor::handler::{self, Timed};
use keyed_executor::{Backoff, Jitter, KeyedExecutor, RetryPolicy, TaskError};

const LONG: Duration = Duration::from_secs(30);
const HOUR: Duration = Duration::from_secs(3600);

/// Sleeps until `deadline` has passed (so a check after it sees it passed).
fn pass(deadline: Instant) {
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A message: 0 blocks its worker until the gate opens; others are logged.
fn blocking_handler(
    gate: Gate,
    ran: Arc<Mutex<Vec<u32>>>,
) -> impl Fn(&u8, u32) -> u32 + Send + Sync + 'static {
    move |_key: &u8, n: u32| {
        if n == 0 {
            gate.wait();
        }
        ran.lock().unwrap().push(n);
        n
    }
}

/// Queued behind a blocked step on one worker, messages of several keys
/// with deadlines that pass while they wait, far deadlines and none: the
/// expired ones, exactly, come back `Expired` with the message and never
/// ran; the others ran in order; the commit point passes them all.
#[test]
fn deadlines_hand_back_exactly_the_expired_messages() {
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let (gate, ran) = (Gate::new(), Arc::new(Mutex::new(Vec::new())));
    let dispatcher = executor.dispatcher(handler::with_deadlines(handler::from_fn(
        blocking_handler(gate.clone(), ran.clone()),
    )));
    let receiver = dispatcher
        .receiver_builder()
        .max_in_flight(64)
        .track_commits(true)
        .build()
        .unwrap();
    let blocker = receiver.submit_blocking(9, Timed::new(0)).unwrap();
    let soon = Instant::now() + Duration::from_millis(20);
    let mut handles = Vec::new();
    let mut expired_ids = Vec::new();
    for n in 1..=30u32 {
        let msg = match n % 3 {
            0 => {
                expired_ids.push(n);
                Timed::until(n, soon)
            }
            1 => Timed::within(n, HOUR),
            _ => Timed::new(n),
        };
        handles.push((n, receiver.submit_blocking((n % 4) as u8, msg).unwrap()));
    }
    pass(soon);
    gate.open();
    assert_eq!(blocker.wait().unwrap(), 0);
    let mut got_expired = Vec::new();
    for (n, done) in handles {
        match done
            .wait_timeout(LONG)
            .unwrap_or_else(|_| panic!("never ended"))
        {
            Ok(out) => assert_eq!(out, n),
            Err(TaskError::Expired { message: Some(m) }) => {
                assert_eq!(m.deadline(), Some(soon), "handed back as it came");
                got_expired.push(m.into_inner());
            }
            Err(e) => panic!("{n}: {e}"),
        }
    }
    assert_eq!(got_expired, expired_ids);
    let ran = ran.lock().unwrap().clone();
    assert!(
        ran.iter().all(|n| *n == 0 || n % 3 != 0),
        "an expired message ran: {ran:?}"
    );
    assert_eq!(ran.len(), 1 + 20);
    assert_eq!(
        receiver.committable(),
        Some(31),
        "expired messages count as finished"
    );
    let stats = executor.stats();
    assert_eq!((stats.expired, stats.done), (10, 21));
    assert!(executor.shutdown(LONG));
}

/// The handler's time-to-live counts from when the `Timed` was made; with
/// `send`, expired messages go to the expiry hook, exactly once each, and
/// never run.
#[test]
fn a_ttl_expires_sent_messages_into_the_hook() {
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    // Another dispatcher's step blocks the only worker until the gate opens.
    let gate = Gate::new();
    let (started_tx, started) = mpsc::channel();
    let started_tx = Mutex::new(started_tx);
    let g = gate.clone();
    let blocker = executor.dispatcher(handler::from_fn(move |_: &u8, _: u32| {
        started_tx.lock().unwrap().send(()).unwrap();
        g.wait();
    }));
    let blocker = blocker.receiver(1).unwrap();
    blocker.send(0, 0).unwrap();
    started.recv_timeout(LONG).unwrap();

    let ran = Arc::new(Mutex::new(Vec::new()));
    let r = ran.clone();
    let (tx, expired) = mpsc::channel();
    let tx = Mutex::new(tx);
    let dispatcher = executor.dispatcher(
        handler::with_deadlines(handler::from_fn(move |_: &u8, n: u32| {
            r.lock().unwrap().push(n)
        }))
        .ttl(Duration::from_millis(20))
        .on_expire(move |key: &u8, n: u32| tx.lock().unwrap().send((*key, n)).unwrap()),
    );
    let receiver = dispatcher.receiver(16).unwrap();
    let made = Instant::now();
    for n in 1..=5 {
        receiver.send(n as u8, Timed::new(n)).unwrap();
    }
    pass(made + Duration::from_millis(25));
    gate.open();
    let mut got: Vec<(u8, u32)> = (1..=5)
        .map(|_| expired.recv_timeout(LONG).unwrap())
        .collect();
    got.sort();
    assert_eq!(got, (1..=5).map(|n| (n as u8, n)).collect::<Vec<_>>());
    assert!(receiver.shutdown(LONG));
    assert!(expired.try_recv().is_err(), "each once");
    assert!(ran.lock().unwrap().is_empty());
    assert!(executor.shutdown(LONG));
}

/// A started message is never interrupted by its deadline: an async step
/// that outlives its deadline finishes with its output.
#[test]
fn a_started_message_is_not_interrupted() {
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let (started_tx, started) = mpsc::channel();
    let started_tx = Mutex::new(started_tx);
    let (go_tx, go) = futures::channel::oneshot::channel::<()>();
    let go = Mutex::new(Some(go));
    let dispatcher = executor.dispatcher(handler::with_deadlines(handler::from_async_fn(
        move |_key: u8, n: u32| {
            started_tx.lock().unwrap().send(()).unwrap();
            let go = go.lock().unwrap().take().unwrap();
            async move {
                let _ = go.await;
                n
            }
        },
    )));
    let receiver = dispatcher.receiver(1).unwrap();
    let deadline = Instant::now() + Duration::from_millis(200);
    let done = receiver
        .submit_blocking(0, Timed::until(7, deadline))
        .unwrap();
    started.recv_timeout(LONG).unwrap();
    pass(deadline);
    go_tx.send(()).unwrap();
    assert_eq!(done.wait().unwrap(), 7);
    assert!(executor.shutdown(LONG));
}

/// Deadlines wrap a retrying handler: a message in time runs its attempts;
/// a force stop during its backoff hands it back `Rejected` with its
/// deadline, after one attempt.
#[test]
fn deadlines_wrap_a_retrying_handler() {
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let attempts = Arc::new(AtomicU32::new(0));
    let a = attempts.clone();
    let policy = RetryPolicy::builder()
        .max_attempts(3)
        .backoff(Backoff::fixed(HOUR))
        .build()
        .unwrap();
    let (tx, first_attempt) = mpsc::channel();
    let tx = Mutex::new(tx);
    let dispatcher = executor.dispatcher(handler::with_deadlines(handler::retrying(
        policy,
        move |_: &u8, _: &u32| {
            a.fetch_add(1, Ordering::SeqCst);
            tx.lock().unwrap().send(()).unwrap();
            Err::<u32, _>("down")
        },
    )));
    let receiver = dispatcher.receiver(2).unwrap();
    let deadline = Instant::now() + HOUR;
    let done = receiver
        .submit_blocking(0, Timed::until(3, deadline))
        .unwrap();
    first_attempt.recv_timeout(LONG).unwrap();
    executor.shutdown_now();
    match done.wait() {
        Err(TaskError::Rejected(m)) => {
            assert_eq!(m.deadline(), Some(deadline));
            assert_eq!(m.into_inner(), 3);
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(attempts.load(Ordering::SeqCst), 1);
}

/// A retry whose next attempt would start past the message's deadline is
/// not made: the message ends `Expired` after the attempts it had, and the
/// dead-letter hook (it failed, and is not tried again) gets it; with no
/// hook the completion hands it back.
#[test]
fn a_retry_past_the_deadline_ends_expired() {
    for with_hook in [false, true] {
        let executor = KeyedExecutor::builder().workers(1).build().unwrap();
        let attempts = Arc::new(AtomicU32::new(0));
        let a = attempts.clone();
        let policy = RetryPolicy::builder()
            .max_attempts(5)
            .backoff(Backoff::fixed(Duration::from_secs(60)))
            .jitter(Jitter::None)
            .build()
            .unwrap();
        let letters = Arc::new(Mutex::new(Vec::new()));
        let l = letters.clone();
        let retrying = handler::retrying(policy, move |_: &u8, _: &u32| {
            a.fetch_add(1, Ordering::SeqCst);
            Err::<u32, _>("down")
        });
        let retrying = if with_hook {
            retrying.on_dead_letter(move |d: handler::DeadLetter<u8, u32, &str>| {
                l.lock().unwrap().push((d.message, d.attempts))
            })
        } else {
            retrying
        };
        let dispatcher = executor.dispatcher(handler::with_deadlines(retrying));
        let receiver = dispatcher.receiver(2).unwrap();
        // Its deadline is within the first backoff.
        let done = receiver
            .submit_blocking(0, Timed::within(4, Duration::from_secs(30)))
            .unwrap();
        match done.wait() {
            Err(TaskError::Expired { message }) => {
                assert_eq!(message.map(Timed::into_inner), (!with_hook).then_some(4));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(attempts.load(Ordering::SeqCst), 1);
        let want: &[(u32, u32)] = if with_hook { &[(4, 1)] } else { &[] };
        assert_eq!(*letters.lock().unwrap(), want);
        let stats = executor.stats();
        assert_eq!(
            (stats.expired, stats.retried, stats.dead_lettered),
            (1, 0, 0)
        );
        assert!(executor.shutdown(LONG));
    }
}
