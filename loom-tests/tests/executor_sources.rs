#![cfg(loom)]
//! Loom models of the sources and forwarding: one receiver's `shutdown_now`
//! racing its own running step and another receiver's submit on the same
//! key; the commit point read while two workers finish out of order; a
//! handler's follow-up sharing the running message's only unit of credit,
//! racing a producer's `try_submit` and each stop; one dispatcher's
//! `shutdown_now` racing another dispatcher on the same worker.
//!
//! ```text
//! RUSTFLAGS="--cfg loom -C debug_assertions" LOOM_MAX_PREEMPTIONS=2 \
//!     cargo test -p loom-tests --release --test executor_sources
//! ```

mod common;

use std::future::{ready, Ready};
use std::sync::atomic::{AtomicUsize as StdCounter, Ordering::Relaxed};
use std::sync::Mutex as StdMutex;

use common::{
    assert_all_seen, batch_of_two_vs_stop, executor, model, scripted, Event, Fixed, Log, Msg,
    BATCH_HOOKED, BATCH_RAN, BATCH_REFUSED, LONG,
};
use keyed_executor::handler::Handler;
use keyed_executor::{Receiver, SubmitError, TaskError};
use loom::thread;

#[allow(clippy::declare_interior_mutable_const)]
const ZERO: StdCounter = StdCounter::new(0);

/// How message 1 of the stopped source ended.
static STOP_ENDS: [StdCounter; 3] = [ZERO; 3];

/// One worker, two receivers A and B of one dispatcher, one key. A's
/// message 1 re-queues itself once mid-way (so the stop can find it queued,
/// running, re-queued or done); a loom thread sends B's message 2 on the
/// same key while the main thread calls `A.shutdown_now()`. Message 1 ends
/// exactly once (done, handed back, or cancelled) and does not start after
/// the stop returned; B's message always runs; A's commit point counts
/// message 1 only if it finished; every unit comes back.
#[test]
fn receiver_shutdown_now_vs_its_step_and_another_source() {
    model(
        "receiver_shutdown_now_vs_its_step_and_another_source",
        || {
            let log = Log::new();
            let ex = executor(1, 16);
            let d = scripted(&ex, &log);
            let (a, b) = (
                d.receiver_builder()
                    .max_in_flight(2)
                    .track_commits(true)
                    .build()
                    .unwrap(),
                d.receiver_builder()
                    .max_in_flight(2)
                    .track_commits(true)
                    .build()
                    .unwrap(),
            );
            let first = a.submit_blocking(0, Msg::yield_once(1)).unwrap();
            assert_eq!(first.position(), 0);
            let other = thread::spawn(move || {
                let c = b.submit_blocking(0, Msg::now(2)).unwrap();
                assert_eq!(c.wait().unwrap(), 2, "the other source is untouched");
                assert_eq!(b.committable(), Some(1));
            });
            a.shutdown_now();
            log.mark(0);
            let end = match first.wait() {
                Ok(1) => 0,
                Err(TaskError::Rejected(msg)) => {
                    assert_eq!(msg.id, 1);
                    1
                }
                Err(TaskError::Cancelled) => 2,
                other => panic!("unexpected {other:?}"),
            };
            other.join().unwrap();
            let events = log.events();
            match end {
                0 => assert!(log.ended(1)),
                1 => assert!(!log.started(1), "handed back but ran: {events:?}"),
                _ => assert!(log.started(1) && !log.ended(1)),
            }
            if log.started(1) {
                assert!(
                    log.position(Event::Start(1)) < log.position(Event::Mark(0)),
                    "a message of the stopped source started after the stop: {events:?}"
                );
            }
            if end != 2 {
                // (A cancelled message has no end in the log; the handler's
                // busy flag, cleared when its future is dropped, checked
                // that message 2 did not overlap it.)
                log.assert_serial();
            }
            assert_eq!(a.committable(), Some(u64::from(end == 0)));
            assert!(a.try_send(0, Msg::now(3)).unwrap_err().is_closed());
            STOP_ENDS[end].fetch_add(1, Relaxed);
            ex.shutdown_now();
            // With the workers joined, units a worker held back are back.
            assert_eq!(a.in_flight(), 0, "every unit came back");
        },
    );
    assert_all_seen(
        "receiver_shutdown_now_vs_its_step_and_another_source",
        &[
            ("1 done", &STOP_ENDS[0]),
            ("1 handed back", &STOP_ENDS[1]),
            ("1 cancelled", &STOP_ENDS[2]),
        ],
    );
}

/// The commit points the reader saw (two reads per execution).
static COMMIT_SEEN: [StdCounter; 3] = [ZERO; 3];

/// Two workers, keys 0 and 1: messages at positions 0 and 1 finish in
/// either order while the main thread reads `committable()`. The commit
/// point never passes an unfinished message, never goes back, and ends at
/// 2.
#[test]
fn commit_point_vs_out_of_order_finishes() {
    model("commit_point_vs_out_of_order_finishes", || {
        let log = Log::new();
        let ex = executor(2, 16);
        let d = scripted(&ex, &log);
        let r = d
            .receiver_builder()
            .max_in_flight(2)
            .track_commits(true)
            .build()
            .unwrap();
        let c0 = r.submit_blocking(0, Msg::now(0)).unwrap();
        let c1 = r.submit_blocking(1, Msg::now(1)).unwrap();
        assert_eq!((c0.position(), c1.position()), (0, 1));
        let mut seen = [0u64; 2];
        for (read, point) in seen.iter_mut().enumerate() {
            *point = r.committable().expect("the receiver tracks commits");
            log.mark(100 + read as u32);
        }
        assert!(seen[1] >= seen[0], "the commit point went back: {seen:?}");
        assert_eq!(c0.wait().unwrap(), 0);
        assert_eq!(c1.wait().unwrap(), 1);
        // Whatever a read passed had finished before it.
        let events = log.events();
        for (read, &point) in seen.iter().enumerate() {
            let at = log.position(Event::Mark(100 + read as u32));
            for p in 0..point as u32 {
                assert!(
                    events[..at].contains(&Event::End(p)),
                    "read {read} passed unfinished {p}: {events:?}"
                );
            }
            COMMIT_SEEN[point as usize].fetch_add(1, Relaxed);
        }
        assert_eq!(r.committable(), Some(2));
        ex.shutdown_now();
    });
    assert_all_seen(
        "commit_point_vs_out_of_order_finishes",
        &[("read 0", &COMMIT_SEEN[0]), ("read 2", &COMMIT_SEEN[2])],
    );
}

// ----- forwarding ---------------------------------------------------------

/// A message that, when `forward` is set, sends message `forward` to key 1
/// through the handler's receiver before it returns.
struct Fwd {
    id: u32,
    forward: Option<u32>,
}

/// What the forwarding handler saw: ids run, and how each forward went.
#[derive(Default)]
struct FwdLog {
    ran: StdMutex<Vec<u32>>,
    /// `Ok(position)` or the refusal's kind (`"full"`, `"closed"`).
    forwards: StdMutex<Vec<Result<u64, &'static str>>>,
}

/// A sync handler holding (a clone of) its own receiver: a cycle, broken
/// at the end of each model by taking it out.
struct Forwarder {
    me: std::sync::Arc<StdMutex<Option<Receiver<u8, Fwd, u32>>>>,
    log: std::sync::Arc<FwdLog>,
}

impl Handler<u8, Fwd> for Forwarder {
    type Output = u32;
    type Future = Ready<u32>;

    fn call(&self, _key: &u8, msg: Fwd) -> Ready<u32> {
        self.log.ran.lock().unwrap().push(msg.id);
        if let Some(id) = msg.forward {
            let rx = self.me.lock().unwrap().clone();
            if let Some(rx) = rx {
                let sent = rx
                    .try_send(1, Fwd { id, forward: None })
                    .map_err(|e| match e {
                        SubmitError::Full(_) => "full",
                        SubmitError::Closed(_) => "closed",
                    });
                self.log.forwards.lock().unwrap().push(sent);
            }
        }
        ready(msg.id)
    }
}

type Me = std::sync::Arc<StdMutex<Option<Receiver<u8, Fwd, u32>>>>;

/// What a forwarding model works with.
type Forwarding = (
    keyed_executor::KeyedExecutor,
    keyed_executor::Dispatcher<u8, Fwd, u32>,
    Receiver<u8, Fwd, u32>,
    Me,
    std::sync::Arc<FwdLog>,
);

/// An executor of `workers`, a forwarding dispatcher, and its receiver
/// with `max_in_flight` 1 (also given to the handler).
fn forwarding(workers: usize) -> Forwarding {
    let ex = executor(workers, 16);
    let log = std::sync::Arc::new(FwdLog::default());
    let me: Me = Default::default();
    let d = ex
        .dispatcher_builder(Forwarder {
            me: me.clone(),
            log: log.clone(),
        })
        .hasher(Fixed::default())
        .build();
    let r = d
        .receiver_builder()
        .max_in_flight(1)
        .track_commits(true)
        .build()
        .unwrap();
    *me.lock().unwrap() = Some(r.clone());
    (ex, d, r, me, log)
}

static PRODUCER_ENDS: [StdCounter; 2] = [ZERO; 2];

/// `max_in_flight` 1, two workers. Message 1 holds the only unit and
/// forwards message 2 (sharing that unit) while a loom thread's
/// `try_submit` of message 3 competes for it. The follow-up is never
/// refused; message 3 is accepted or refused `Full` (handed back); every
/// accepted message runs; the unit comes back once everything ended.
#[test]
fn a_follow_up_shares_the_running_unit_vs_a_producer() {
    model("a_follow_up_shares_the_running_unit_vs_a_producer", || {
        let (ex, _d, r, me, log) = forwarding(2);
        let root = r
            .submit_blocking(
                0,
                Fwd {
                    id: 1,
                    forward: Some(2),
                },
            )
            .unwrap();
        let r3 = r.clone();
        let producer = thread::spawn(move || {
            match r3.try_submit(
                2,
                Fwd {
                    id: 3,
                    forward: None,
                },
            ) {
                Ok(c) => {
                    assert_eq!(c.wait().unwrap(), 3);
                    true
                }
                Err(SubmitError::Full(msg)) => {
                    assert_eq!(msg.id, 3, "the refused message is handed back");
                    false
                }
                Err(e) => panic!("unexpected {e:?}"),
            }
        });
        assert_eq!(root.wait().unwrap(), 1);
        let accepted = producer.join().unwrap();
        assert!(ex.shutdown(LONG));
        me.lock().unwrap().take();
        let forwards = log.forwards.lock().unwrap().clone();
        assert!(
            matches!(forwards.as_slice(), [Ok(_)]),
            "the one follow-up goes through: {forwards:?}"
        );
        let mut ran = log.ran.lock().unwrap().clone();
        ran.sort_unstable();
        let want: &[u32] = if accepted { &[1, 2, 3] } else { &[1, 2] };
        assert_eq!(ran, want);
        assert_eq!(r.in_flight(), 0, "the unit came back");
        assert_eq!(r.committable(), Some(r.accepted()));
        PRODUCER_ENDS[usize::from(accepted)].fetch_add(1, Relaxed);
    });
    assert_all_seen(
        "a_follow_up_shares_the_running_unit_vs_a_producer",
        &[
            ("3 refused (Full)", &PRODUCER_ENDS[0]),
            ("3 accepted", &PRODUCER_ENDS[1]),
        ],
    );
}

static FWD_STOP_ENDS: [StdCounter; 3] = [ZERO; 3];

/// `max_in_flight` 1, one worker: message 1 forwards message 2 on the
/// shared unit while a loom thread stops — the receiver at once
/// (`shutdown_now`) or gracefully (`shutdown`), in alternate models. The
/// follow-up is refused `Closed`, or accepted and then run (graceful) or
/// run or handed back (at once); the shared unit comes back either way.
#[test]
fn a_follow_up_on_a_shared_unit_vs_both_stops() {
    for graceful in [false, true] {
        let name = if graceful {
            "a_follow_up_on_a_shared_unit_vs_receiver_shutdown"
        } else {
            "a_follow_up_on_a_shared_unit_vs_receiver_shutdown_now"
        };
        model(name, move || {
            let (ex, _d, r, me, log) = forwarding(1);
            let root = r
                .submit_blocking(
                    0,
                    Fwd {
                        id: 1,
                        forward: Some(2),
                    },
                )
                .unwrap();
            let stopper = r.clone();
            let stop = thread::spawn(move || {
                if graceful {
                    assert!(stopper.shutdown(LONG), "drained");
                } else {
                    stopper.shutdown_now();
                }
            });
            let root_end = root.wait();
            stop.join().unwrap();
            assert!(r.is_closed());
            let forwards = log.forwards.lock().unwrap().clone();
            let ran = log.ran.lock().unwrap().clone();
            let end = match (&root_end, forwards.as_slice()) {
                // The stop came before message 1 started.
                (Err(TaskError::Rejected(_)), []) => {
                    assert!(!graceful, "a graceful stop runs what it accepted");
                    assert!(ran.is_empty());
                    0
                }
                (Ok(1), [Err("closed")]) => {
                    assert_eq!(ran, [1]);
                    1
                }
                (Ok(1), [Ok(_)]) => {
                    if graceful {
                        assert_eq!(ran, [1, 2], "a graceful stop runs the follow-up");
                    } else {
                        assert!(ran == [1, 2] || ran == [1], "ran {ran:?}");
                    }
                    2
                }
                other => panic!("unexpected {other:?} (ran {ran:?})"),
            };
            // What ran when the stop returned is all that ever runs, and
            // the commit point passed exactly what ran.
            assert_eq!(r.committable(), Some(ran.len() as u64));
            ex.shutdown_now();
            assert_eq!(
                *log.ran.lock().unwrap(),
                ran,
                "a message ran after the stop"
            );
            // With the workers joined, the shared unit is back.
            assert_eq!(r.in_flight(), 0, "the shared unit came back");
            me.lock().unwrap().take();
            FWD_STOP_ENDS[end].fetch_add(1, Relaxed);
        });
    }
    assert_all_seen(
        "a_follow_up_on_a_shared_unit_vs_both_stops",
        &[
            ("root handed back", &FWD_STOP_ENDS[0]),
            ("follow-up refused (Closed)", &FWD_STOP_ENDS[1]),
            ("follow-up accepted", &FWD_STOP_ENDS[2]),
        ],
    );
}

static DISPATCHER_ENDS: [StdCounter; 3] = [ZERO; 3];

/// One worker, two dispatchers. D1's message 1 re-queues itself once; a
/// loom thread submits D2's message 2 while the main thread calls
/// `D1.shutdown_now()`. D2's message always runs and D2 stays open; D1's
/// message ends exactly once; D1 refuses new messages.
#[test]
fn dispatcher_shutdown_now_vs_another_dispatcher() {
    model("dispatcher_shutdown_now_vs_another_dispatcher", || {
        let (log1, log2) = (Log::new(), Log::new());
        let ex = executor(1, 16);
        let d1 = scripted(&ex, &log1);
        let d2 = scripted(&ex, &log2);
        let (r1, r2) = (d1.receiver(2).unwrap(), d2.receiver(2).unwrap());
        let first = r1.submit_blocking(0, Msg::yield_once(1)).unwrap();
        let other = thread::spawn(move || {
            let c = r2.submit_blocking(0, Msg::now(2)).unwrap();
            assert_eq!(c.wait().unwrap(), 2);
        });
        d1.shutdown_now();
        let end = match first.wait() {
            Ok(1) => 0,
            Err(TaskError::Rejected(_)) => {
                assert!(!log1.started(1));
                1
            }
            Err(TaskError::Cancelled) => {
                assert!(log1.started(1) && !log1.ended(1));
                2
            }
            other => panic!("unexpected {other:?}"),
        };
        other.join().unwrap();
        assert!(d1.is_closed() && !d2.is_closed());
        assert!(r1.try_send(0, Msg::now(3)).unwrap_err().is_closed());
        if end != 2 {
            log1.assert_serial();
        }
        log2.assert_serial();
        DISPATCHER_ENDS[end].fetch_add(1, Relaxed);
        ex.shutdown_now();
        assert_eq!(r1.in_flight(), 0);
    });
    assert_all_seen(
        "dispatcher_shutdown_now_vs_another_dispatcher",
        &[
            ("1 done", &DISPATCHER_ENDS[0]),
            ("1 handed back", &DISPATCHER_ENDS[1]),
            ("1 cancelled", &DISPATCHER_ENDS[2]),
        ],
    );
}

static BATCH_ENDS: [StdCounter; 3] = [ZERO; 3];

/// One worker: a loom thread sends a batch of two messages for one key
/// while the main thread calls the receiver's `shutdown_now`. Each message
/// ends exactly once — run, handed back through `on_reject`, or refused
/// in the batch's error — the key's order holds (a message handed back is
/// never followed by a later one that ran), and the units come back (see
/// `common::batch_of_two_vs_stop`).
#[test]
fn a_batch_vs_receiver_shutdown_now() {
    model("a_batch_vs_receiver_shutdown_now", || {
        let kind = batch_of_two_vs_stop(|_, r| r.shutdown_now());
        BATCH_ENDS[kind].fetch_add(1, Relaxed);
    });
    assert_all_seen(
        "a_batch_vs_receiver_shutdown_now",
        &[
            ("refused in the batch error", &BATCH_ENDS[BATCH_REFUSED]),
            ("handed back through on_reject", &BATCH_ENDS[BATCH_HOOKED]),
            ("both ran", &BATCH_ENDS[BATCH_RAN]),
        ],
    );
}

static CLOSE_ENDS: [StdCounter; 2] = [ZERO; 2];

/// One worker: a loom thread sends message 1 while the main thread closes
/// the receiver. The message is refused `Closed` (handed back), or
/// accepted and then run — a close hands nothing back; once `close`
/// returned every send is refused; the commit point passes what ran.
#[test]
fn receiver_close_vs_send() {
    model("receiver_close_vs_send", || {
        let log = Log::new();
        let ex = executor(1, 16);
        let d = scripted(&ex, &log);
        let r = d
            .receiver_builder()
            .max_in_flight(2)
            .track_commits(true)
            .build()
            .unwrap();
        let r2 = r.clone();
        let sender = thread::spawn(move || match r2.send(0, Msg::now(1)) {
            Ok(position) => {
                assert_eq!(position, 0);
                true
            }
            Err(SubmitError::Closed(msg)) => {
                assert_eq!(msg.id, 1, "the refused message is handed back");
                false
            }
            Err(e) => panic!("unexpected {e:?}"),
        });
        r.close();
        assert!(r.try_send(0, Msg::now(2)).unwrap_err().is_closed());
        let accepted = sender.join().unwrap();
        assert!(r.shutdown(LONG), "drained");
        assert_eq!(log.ended(1), accepted, "accepted ⇔ ran");
        assert!(!log.started(2));
        assert_eq!(r.committable(), Some(u64::from(accepted)));
        ex.shutdown_now();
        assert_eq!(r.in_flight(), 0);
        CLOSE_ENDS[usize::from(accepted)].fetch_add(1, Relaxed);
    });
    assert_all_seen(
        "receiver_close_vs_send",
        &[
            ("refused", &CLOSE_ENDS[0]),
            ("accepted and ran", &CLOSE_ENDS[1]),
        ],
    );
}
