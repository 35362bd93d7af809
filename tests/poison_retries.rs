//! Messages that fail (issue 30), through the public API: retries keep each
//! key's order and hold no worker; dead letters go to their hook, end
//! `DeadLettered` and let the commit point move; every stop during a
//! backoff ends the message exactly once (finished within a graceful
//! stop's timeout, or handed back by a force stop of any scope). No test
//! asserts on elapsed time.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use common::{quiet_injected_panics, seeds, Replay, Rng, INJECTED};
use keyed_executor::handler::{self, DeadLetter, LastFailure};
use keyed_executor::{
    Backoff, Completion, Dispatcher, Jitter, KeyedExecutor, Receiver, RetryPolicy, TaskError,
};

const LONG: Duration = Duration::from_secs(30);
/// A backoff that never ends within a test: a message waiting on it is
/// surely in its backoff when the test stops it.
const HOUR: Duration = Duration::from_secs(3600);

/// A message that is not `Clone`: it fails its first `fail` attempts.
#[derive(Debug, PartialEq, Eq)]
struct Msg {
    seq: u32,
    fail: u32,
}

/// Returns `Pending` once (waking itself), then `Ready`.
async fn yield_now() {
    let mut yielded = false;
    std::future::poll_fn(|cx| {
        if yielded {
            std::task::Poll::Ready(())
        } else {
            yielded = true;
            cx.waker().wake_by_ref();
            std::task::Poll::Pending
        }
    })
    .await
}

fn policy(attempts: u32, delay: Duration) -> RetryPolicy<String> {
    RetryPolicy::builder()
        .max_attempts(attempts)
        .backoff(Backoff::fixed(delay))
        .jitter(Jitter::Full)
        .build()
        .unwrap()
}

/// What happened, in order, per key: attempts begun and messages ended.
#[derive(Default)]
struct Log {
    events: Mutex<HashMap<u64, Vec<Event>>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Event {
    Attempt(u32),
    Done(u32),
    Dead(u32),
}

impl Log {
    fn push(&self, key: u64, event: Event) {
        self.events
            .lock()
            .unwrap()
            .entry(key)
            .or_default()
            .push(event);
    }

    /// Checks one key's history: each message's attempts come after the
    /// previous message ended (order, one at a time), it had as many
    /// attempts as its failures allow, and it ended once.
    fn check(&self, key: u64, sent: &[(u32, u32)], max_attempts: u32) {
        let events = self.events.lock().unwrap();
        let got = events.get(&key).cloned().unwrap_or_default();
        let mut want = Vec::new();
        for &(seq, fail) in sent {
            let attempts = (fail + 1).min(max_attempts);
            want.extend((0..attempts).map(|_| Event::Attempt(seq)));
            want.push(if fail < max_attempts {
                Event::Done(seq)
            } else {
                Event::Dead(seq)
            });
        }
        assert_eq!(got, want, "key {key}");
    }
}

/// Several keys, random failures, retries with jitter on two workers: each
/// key's messages run one at a time and in order, each has exactly the
/// attempts its failures allow, a dead letter ends before its key's next
/// message starts, and every completion says how its message ended.
fn order_under_retries(async_form: bool) {
    quiet_injected_panics();
    const MAX: u32 = 3;
    for seed in seeds(3) {
        let _replay = Replay::new("order_under_retries", seed);
        let mut rng = Rng::new(seed);
        let log = Arc::new(Log::default());
        let executor = KeyedExecutor::builder().workers(2).build().unwrap();
        let dispatcher: Dispatcher<u64, Msg, u32> = if async_form {
            let (attempts, l2) = (Arc::new(Mutex::new(HashMap::new())), log.clone());
            executor.dispatcher(
                handler::retrying_async(
                    policy(MAX, Duration::from_micros(300)),
                    move |key: u64, msg: Msg| {
                        let n = {
                            let mut a = attempts.lock().unwrap();
                            let n: &mut u32 = a.entry((key, msg.seq)).or_default();
                            *n += 1;
                            *n
                        };
                        let log = l2.clone();
                        async move {
                            log.push(key, Event::Attempt(msg.seq));
                            // Suspend once, as real I/O would.
                            yield_now().await;
                            if n <= msg.fail {
                                Err((msg, format!("attempt {n} failed")))
                            } else {
                                log.push(key, Event::Done(msg.seq));
                                Ok(msg.seq)
                            }
                        }
                    },
                )
                .on_dead_letter({
                    let log = log.clone();
                    move |d: DeadLetter<u64, Msg, String>| {
                        assert_eq!(d.attempts, MAX);
                        log.push(d.key, Event::Dead(d.message.seq))
                    }
                }),
            )
        } else {
            let (attempts, l2) = (Arc::new(Mutex::new(HashMap::new())), log.clone());
            executor.dispatcher(
                handler::retrying(
                    policy(MAX, Duration::from_micros(300)),
                    move |key: &u64, msg: &Msg| {
                        l2.push(*key, Event::Attempt(msg.seq));
                        let n = {
                            let mut a = attempts.lock().unwrap();
                            let n: &mut u32 = a.entry((*key, msg.seq)).or_default();
                            *n += 1;
                            *n
                        };
                        if n <= msg.fail {
                            if n == 1 {
                                panic!("{INJECTED}: a panic is a failed attempt");
                            }
                            Err(format!("attempt {n} failed"))
                        } else {
                            l2.push(*key, Event::Done(msg.seq));
                            Ok(msg.seq)
                        }
                    },
                )
                .on_dead_letter({
                    let log = log.clone();
                    move |d: DeadLetter<u64, Msg, String>| {
                        assert_eq!(d.attempts, MAX);
                        log.push(d.key, Event::Dead(d.message.seq))
                    }
                }),
            )
        };
        let receiver = dispatcher.receiver(32).unwrap();
        let mut sent: HashMap<u64, Vec<(u32, u32)>> = HashMap::new();
        let mut handles: Vec<(u32, u32, Completion<u32, Msg>)> = Vec::new();
        for seq in 0..300 {
            let key = rng.below(6);
            // Mostly fine; some fail once or twice; a few always fail.
            let fail = match rng.below(10) {
                0..=5 => 0,
                6 | 7 => 1,
                8 => 2,
                _ => 10,
            } as u32;
            sent.entry(key).or_default().push((seq, fail));
            let done = receiver.submit_blocking(key, Msg { seq, fail }).unwrap();
            handles.push((seq, fail, done));
        }
        for (seq, fail, done) in handles {
            match done
                .wait_timeout(LONG)
                .unwrap_or_else(|_| panic!("never ended"))
            {
                Ok(out) => {
                    assert!(fail < MAX);
                    assert_eq!(out, seq);
                }
                Err(TaskError::DeadLettered {
                    attempts,
                    message,
                    error,
                }) => {
                    assert!(fail >= MAX, "{seq} dead-lettered: {error}");
                    assert_eq!(attempts, MAX);
                    assert!(message.is_none(), "the hook took it");
                }
                Err(e) => panic!("{seq}: {e}"),
            }
        }
        for (key, sent) in &sent {
            log.check(*key, sent, MAX);
        }
        assert!(executor.shutdown(LONG));
    }
}

#[test]
fn order_under_retries_sync() {
    order_under_retries(false);
}

#[test]
fn order_under_retries_async() {
    order_under_retries(true);
}

/// A message waiting for its next attempt holds no worker: with one
/// worker, another key's message runs while it waits — here it even has
/// to, for the waiting one to succeed. And the key's next message waits
/// behind it, and its credit unit stays taken.
#[test]
fn a_backoff_holds_no_worker_but_holds_its_key_and_unit() {
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let other_ran = Arc::new(AtomicBool::new(false));
    let order = Arc::new(Mutex::new(Vec::new()));
    let (o, r) = (order.clone(), other_ran.clone());
    let dispatcher = executor.dispatcher(handler::retrying(
        policy(u32::MAX, Duration::from_millis(1)),
        move |key: &u64, n: &u32| {
            if *key == 1 && *n == 0 && !r.load(Ordering::SeqCst) {
                return Err("key 2 has not run yet".to_owned());
            }
            if *key == 2 {
                r.store(true, Ordering::SeqCst);
            }
            o.lock().unwrap().push((*key, *n));
            Ok(*n)
        },
    ));
    let one = dispatcher.receiver(2).unwrap();
    let first = one.submit_blocking(1, 0).unwrap();
    let second = one.submit_blocking(1, 1).unwrap();
    assert!(
        one.try_submit(1, 2).unwrap_err().is_full(),
        "units are held"
    );
    let other = dispatcher.receiver(1).unwrap();
    assert_eq!(other.submit_blocking(2, 7).unwrap().wait().unwrap(), 7);
    assert_eq!(first.wait().unwrap(), 0);
    assert_eq!(second.wait().unwrap(), 1);
    assert_eq!(*order.lock().unwrap(), [(2, 7), (1, 0), (1, 1)]);
    assert!(executor.shutdown(LONG));
}

/// Dead letters count as finished: the commit point moves past them, the
/// hook sees each with its key, error, attempts and the position its
/// completion reported, and a failure the policy does not retry is
/// dead-lettered after one attempt.
#[test]
fn commit_point_moves_past_dead_letters() {
    let executor = KeyedExecutor::builder().workers(2).build().unwrap();
    let letters = Arc::new(Mutex::new(Vec::new()));
    let l = letters.clone();
    let retryable = RetryPolicy::builder()
        .max_attempts(4)
        .backoff(Backoff::exponential(
            Duration::from_micros(100),
            Duration::from_millis(2),
        ))
        .retry_if(|e: &String| e != "fatal")
        .build()
        .unwrap();
    let dispatcher = executor.dispatcher(
        handler::retrying(retryable, |_key: &u32, n: &u32| match n % 5 {
            0 => Err("poison".to_owned()),
            1 => Err("fatal".to_owned()),
            _ => Ok(*n),
        })
        .on_dead_letter(move |d: DeadLetter<u32, u32, String>| {
            let LastFailure::Error(e) = d.failure else {
                panic!("no panics here")
            };
            l.lock()
                .unwrap()
                .push((d.key, d.message, e, d.attempts, d.position));
        }),
    );
    let receiver = dispatcher
        .receiver_builder()
        .max_in_flight(8)
        .track_commits(true)
        .build()
        .unwrap();
    let mut want = Vec::new();
    let mut handles = Vec::new();
    for n in 0..40u32 {
        let done = receiver.submit_blocking(n % 3, n).unwrap();
        match n % 5 {
            0 => want.push((n % 3, n, "poison".to_owned(), 4, done.position())),
            1 => want.push((n % 3, n, "fatal".to_owned(), 1, done.position())),
            _ => {}
        }
        handles.push((n, done));
    }
    for (n, done) in handles {
        match (n % 5, done.wait()) {
            (0, Err(TaskError::DeadLettered { attempts: 4, .. })) => {}
            (1, Err(TaskError::DeadLettered { attempts: 1, .. })) => {}
            (_, Ok(out)) => assert_eq!(out, n),
            (_, other) => panic!("{n}: {other:?}"),
        }
    }
    assert_eq!(receiver.committable(), Some(40));
    assert_eq!(receiver.accepted(), 40);
    let stats = executor.stats();
    assert_eq!(stats.dead_lettered, 16, "8 poison, 8 fatal");
    assert_eq!(stats.retried, 8 * 3, "only the poison ones are retried");
    assert_eq!(stats.done, 24);
    assert_eq!(
        stats.workers.iter().map(|w| w.dead_lettered).sum::<u64>(),
        16
    );
    let mut got = letters.lock().unwrap().clone();
    got.sort_by_key(|l| l.4);
    assert_eq!(got, want);
    assert!(executor.shutdown(LONG));
}

/// Without a hook, a dead letter's message comes back in its completion.
#[test]
fn without_a_hook_the_completion_hands_the_message_back() {
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let dispatcher = executor.dispatcher(handler::retrying(
        policy(2, Duration::ZERO),
        |_: &u8, _: &String| Err::<(), _>("no".to_owned()),
    ));
    let receiver = dispatcher.receiver(1).unwrap();
    let err = receiver
        .submit_blocking(0, "keep me".to_owned())
        .unwrap()
        .wait()
        .unwrap_err();
    assert!(err.is_dead_lettered());
    assert_eq!(
        err.to_string(),
        "message dead-lettered after 2 attempt(s): no"
    );
    assert_eq!(err.into_message().as_deref(), Some("keep me"));
    assert!(executor.shutdown(LONG));
}

/// A panic in an async attempt takes the message with it: `Panicked`.
#[test]
fn an_async_panic_ends_the_message_panicked() {
    quiet_injected_panics();
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let dispatcher = executor.dispatcher(handler::retrying_async(
        policy(3, Duration::ZERO),
        |_: u8, n: u32| async move {
            if n == 0 {
                panic!("{INJECTED}");
            }
            Ok::<_, (u32, String)>(n)
        },
    ));
    let receiver = dispatcher.receiver(2).unwrap();
    assert!(receiver
        .submit_blocking(0, 0)
        .unwrap()
        .wait()
        .unwrap_err()
        .is_panic());
    assert_eq!(receiver.submit_blocking(0, 1).unwrap().wait().unwrap(), 1);
    assert!(executor.shutdown(LONG));
}

// ----- stops during a backoff -------------------------------------------------

/// A dispatcher whose messages fail their first attempt, then (after
/// `delay`) succeed; each attempt is reported on the channel.
fn fails_once(
    executor: &KeyedExecutor,
    delay: Duration,
    async_form: bool,
    on_reject: Option<mpsc::Sender<u32>>,
) -> (
    Dispatcher<u8, u32, u32>,
    mpsc::Receiver<u32>,
    Arc<AtomicU32>,
) {
    let (tx, rx) = mpsc::channel();
    let tx = Mutex::new(tx);
    let attempts = Arc::new(AtomicU32::new(0));
    let a = attempts.clone();
    let attempt = move |n: u32| {
        let first = a.fetch_add(1, Ordering::SeqCst) == 0;
        tx.lock().unwrap().send(n).unwrap();
        first
    };
    macro_rules! build {
        ($handler:expr) => {{
            let mut b = executor.dispatcher_builder($handler);
            if let Some(rejected) = on_reject {
                let rejected = Mutex::new(rejected);
                b = b.on_reject(move |_key, n| rejected.lock().unwrap().send(n).unwrap());
            }
            b.build()
        }};
    }
    let dispatcher = if async_form {
        let attempt = Arc::new(attempt);
        build!(handler::retrying_async(
            policy(2, delay),
            move |_: u8, n: u32| {
                let first = attempt(n);
                async move {
                    if first {
                        Err((n, "first attempt".to_owned()))
                    } else {
                        Ok(n)
                    }
                }
            }
        ))
    } else {
        build!(handler::retrying(
            policy(2, delay),
            move |_: &u8, n: &u32| {
                if attempt(*n) {
                    Err("first attempt".to_owned())
                } else {
                    Ok(*n)
                }
            }
        ))
    };
    (dispatcher, rx, attempts)
}

#[derive(Clone, Copy, Debug)]
enum Stop {
    Executor,
    Dispatcher,
    Receiver,
}

fn stop_now(
    stop: Stop,
    executor: &KeyedExecutor,
    d: &Dispatcher<u8, u32, u32>,
    r: &Receiver<u8, u32, u32>,
) {
    match stop {
        Stop::Executor => executor.shutdown_now(),
        Stop::Dispatcher => d.shutdown_now(),
        Stop::Receiver => r.shutdown_now(),
    }
}

/// A force stop of any scope hands a message in its backoff back at once,
/// `Rejected(msg)` (through its completion, or `on_reject` for a send),
/// after exactly the one attempt it had: not lost, not run twice. The
/// message queued behind it on its key is handed back too.
#[test]
fn a_force_stop_hands_back_a_message_in_backoff() {
    for async_form in [false, true] {
        for stop in [Stop::Executor, Stop::Dispatcher, Stop::Receiver] {
            let what = format!("{stop:?}, async {async_form}");
            let executor = KeyedExecutor::builder().workers(2).build().unwrap();
            let (dispatcher, attempts_seen, attempts) =
                fails_once(&executor, HOUR, async_form, None);
            let receiver = dispatcher.receiver(4).unwrap();
            let first = receiver.submit_blocking(0, 10).unwrap();
            let behind = receiver.submit_blocking(0, 11).unwrap();
            assert_eq!(attempts_seen.recv_timeout(LONG).unwrap(), 10, "{what}");
            stop_now(stop, &executor, &dispatcher, &receiver);
            match first
                .wait_timeout(LONG)
                .unwrap_or_else(|_| panic!("never ended"))
            {
                Err(TaskError::Rejected(10)) => {}
                other => panic!("{what}: {other:?}"),
            }
            match behind
                .wait_timeout(LONG)
                .unwrap_or_else(|_| panic!("never ended"))
            {
                Err(TaskError::Rejected(11)) => {}
                other => panic!("{what}: {other:?}"),
            }
            assert_eq!(attempts.load(Ordering::SeqCst), 1, "{what}");
            assert_eq!(receiver.in_flight(), 0, "{what}: every unit came back");
            let stats = executor.stats();
            assert_eq!((stats.rejected, stats.cancelled), (2, 0), "{what}");
            assert_eq!(stats.retried, 1, "{what}");
            executor.shutdown_now();
            assert!(attempts_seen.try_recv().is_err(), "{what}: never ran again");
        }
    }
}

/// The same with fire-and-forget sends: the message in its backoff reaches
/// the dispatcher's `on_reject` hook, once.
#[test]
fn a_force_stop_hands_a_sent_message_in_backoff_to_on_reject() {
    for async_form in [false, true] {
        for stop in [Stop::Executor, Stop::Dispatcher, Stop::Receiver] {
            let what = format!("{stop:?}, async {async_form}");
            let executor = KeyedExecutor::builder().workers(2).build().unwrap();
            let (rejected_tx, rejected) = mpsc::channel();
            let (dispatcher, attempts_seen, attempts) =
                fails_once(&executor, HOUR, async_form, Some(rejected_tx));
            let receiver = dispatcher.receiver(4).unwrap();
            receiver.send(0, 20).unwrap();
            assert_eq!(attempts_seen.recv_timeout(LONG).unwrap(), 20, "{what}");
            stop_now(stop, &executor, &dispatcher, &receiver);
            assert_eq!(rejected.recv_timeout(LONG).unwrap(), 20, "{what}");
            assert_eq!(attempts.load(Ordering::SeqCst), 1, "{what}");
            executor.shutdown_now();
            drop(dispatcher);
            assert!(rejected.try_recv().is_err(), "{what}: handed back once");
        }
    }
}

/// A graceful stop of any scope lets a message in its backoff finish its
/// attempts within the timeout.
#[test]
fn a_graceful_stop_lets_a_backoff_finish() {
    for async_form in [false, true] {
        for stop in [Stop::Executor, Stop::Dispatcher, Stop::Receiver] {
            let what = format!("{stop:?}, async {async_form}");
            let executor = KeyedExecutor::builder().workers(2).build().unwrap();
            let (dispatcher, attempts_seen, attempts) =
                fails_once(&executor, Duration::from_millis(20), async_form, None);
            let receiver = dispatcher.receiver(4).unwrap();
            let done = receiver.submit_blocking(0, 30).unwrap();
            assert_eq!(attempts_seen.recv_timeout(LONG).unwrap(), 30, "{what}");
            let drained = match stop {
                Stop::Executor => executor.shutdown(LONG),
                Stop::Dispatcher => dispatcher.shutdown(LONG),
                Stop::Receiver => receiver.shutdown(LONG),
            };
            assert!(drained, "{what}");
            assert_eq!(done.wait().unwrap(), 30, "{what}");
            assert_eq!(attempts.load(Ordering::SeqCst), 2, "{what}");
            assert!(executor.shutdown(LONG));
        }
    }
}
