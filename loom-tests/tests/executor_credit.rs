#![cfg(loom)]
//! Loom model of a receiver's credit: a message finishing (and releasing
//! its unit) races submitters blocked for credit — one in `submit_blocking`
//! (a parked thread), one in `.await`ing `submit` (a task waker), one that
//! gives up. Every waiter proceeds (a lost notification is a loom
//! deadlock) and the receiver never holds more than `max_in_flight`
//! unfinished messages.
//!
//! And stops against a submitter blocked for credit: the receiver's
//! `close`, its dispatcher's or the executor's graceful stop, racing the
//! submitter from before its first look at the flags to after it parked
//! (a thread, or a task). The submitter ends with `Closed` holding its own
//! message while the unit is still held — a lost wake-up is a loom
//! deadlock — and, racing a release as well, either gets the unit or
//! `Closed`, never both, never neither.
//!
//! ```text
//! RUSTFLAGS="--cfg loom -C debug_assertions" LOOM_MAX_PREEMPTIONS=2 \
//!     cargo test -p loom-tests --release --test executor_credit
//! ```

mod common;

use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicUsize as StdCounter, Ordering::SeqCst};
use std::sync::Arc as StdArc;
use std::task::{Context, Poll, Waker};

use common::{
    assert_all_seen, executor, model, scripted, scripted_receiver, Fixed, Gate, Log, Msg, LONG,
};
use keyed_executor::{handler, SubmitError};
use loom::future::block_on;
use loom::sync::atomic::AtomicBool;
use loom::thread;

/// `max_in_flight` = 1, one worker, one key: the main thread submits 1,
/// then blocks in `submit_blocking(2)` (a parked thread) while the worker
/// finishes 1 and releases its unit. 2 is accepted only after 1 finished.
#[test]
fn credit_release_vs_submit_blocking() {
    model("credit_release_vs_submit_blocking", || {
        let (ex, r, finished) = setup();
        let first = r.submit_blocking(0, 1).unwrap();
        let second = r.submit_blocking(0, 2).unwrap();
        assert!(finished.load(SeqCst) >= 1, "accepted with 1 unfinished");
        assert!(r.in_flight() <= 1);
        assert_eq!(first.wait().unwrap(), 1);
        assert_eq!(second.wait().unwrap(), 2);
        assert!(ex.shutdown(LONG));
        assert_eq!(r.in_flight(), 0, "every unit came back");
    });
}

/// As above, the waiter being a task (`.await` on `submit`, its waker
/// registered in the credit's queue).
#[test]
fn credit_release_vs_submit_await() {
    model("credit_release_vs_submit_await", || {
        let (ex, r, finished) = setup();
        let first = r.submit_blocking(0, 1).unwrap();
        let second = block_on(r.submit(0, 2)).unwrap();
        assert!(finished.load(SeqCst) >= 1, "accepted with 1 unfinished");
        assert_eq!(block_on(second).unwrap(), 2);
        assert_eq!(first.wait().unwrap(), 1);
        assert!(ex.shutdown(LONG));
        assert_eq!(r.in_flight(), 0);
    });
}

/// A waiter that gives up: `max_in_flight` = 1. The main thread submits 1,
/// then blocks in `submit_blocking(3)`; a loom thread polls `submit(2)`
/// once and drops it — before or after a release picked it as the waiter
/// to wake. A notification handed to a waiter that leaves is passed on:
/// the main thread proceeds, and 2 is accepted only if that one poll got
/// the unit.
#[test]
fn credit_waiter_gives_up() {
    model("credit_waiter_gives_up", || {
        let (ex, r, finished) = setup();
        drop(r.submit_blocking(0, 1).unwrap());
        let r = StdArc::new(r);
        let r2 = r.clone();
        let quitter = thread::spawn(move || {
            let mut submit = pin!(r2.submit(0, 2));
            match submit
                .as_mut()
                .poll(&mut Context::from_waker(Waker::noop()))
            {
                Poll::Ready(done) => {
                    drop(done.unwrap());
                    true
                }
                Poll::Pending => false,
            }
        });
        drop(r.submit_blocking(0, 3).unwrap());
        let accepted = quitter.join().unwrap();
        assert!(ex.shutdown(LONG));
        assert_eq!(finished.load(SeqCst), 2 + usize::from(accepted));
        assert_eq!(r.in_flight(), 0);
        GAVE_UP[usize::from(accepted)].fetch_add(1, SeqCst);
    });
    assert_all_seen(
        "credit_waiter_gives_up",
        &[
            ("2 given up while waiting", &GAVE_UP[0]),
            ("2 accepted on its only poll", &GAVE_UP[1]),
        ],
    );
}

static GAVE_UP: [StdCounter; 2] = [StdCounter::new(0), StdCounter::new(0)];

type R = keyed_executor::Receiver<u8, u32, u32>;

fn setup() -> (keyed_executor::KeyedExecutor, R, StdArc<StdCounter>) {
    let finished = StdArc::new(StdCounter::new(0));
    let f2 = finished.clone();
    let ex = executor(1, 16);
    let d = ex
        .dispatcher_builder(handler::from_fn(move |_: &u8, id: u32| {
            // Counted before the worker releases the unit.
            f2.fetch_add(1, SeqCst);
            id
        }))
        .hasher(Fixed::default())
        .build();
    let r = d.receiver(1).unwrap();
    (ex, r, finished)
}

/// Two waiters at once: `max_in_flight` = 1, one worker, one key. The
/// main thread submits 1, then blocks in `submit_blocking(3)`; a loom
/// thread `.await`s `submit(2)`. Each release wakes one waiter, and the
/// one woken may lose the unit to the other (who barges in), so this is
/// where a notification could be lost or a unit handed out twice. With
/// one unit, a submit may return only once every message accepted before
/// it has finished: the handler counts finished messages, each submitter
/// counts acceptances, and at each acceptance `finished >= accepted
/// before`. The graceful stop then drains everything.
#[test]
fn credit_two_waiters() {
    model("credit_two_waiters", || {
        let (ex, r, finished) = setup();
        let accepted = StdArc::new(StdCounter::new(0));
        // Right after a submit returns (no loom operation in between).
        let check = {
            let (finished, accepted) = (finished.clone(), accepted.clone());
            move || {
                let before = accepted.fetch_add(1, SeqCst);
                let done = finished.load(SeqCst);
                assert!(
                    done >= before,
                    "accepted with {} unfinished, max_in_flight 1",
                    before - done + 1
                );
            }
        };
        drop(r.submit_blocking(0, 1).unwrap());
        check();
        // Shared, not cloned: a clone is one more handle count on the
        // credit's word, and the model grows with every operation on it.
        let r = StdArc::new(r);
        let (r2, check2) = (r.clone(), check.clone());
        let other = thread::spawn(move || {
            drop(block_on(r2.submit(0, 2)).unwrap());
            check2();
        });
        drop(r.submit_blocking(0, 3).unwrap());
        check();
        other.join().unwrap();
        assert!(ex.shutdown(LONG));
        assert_eq!(finished.load(SeqCst), 3);
        assert_eq!(r.in_flight(), 0, "every unit came back");
    });
}

/// Which stop a model makes.
#[derive(Clone, Copy)]
enum Stop {
    /// `Receiver::close`: the source's own flag.
    Close,
    /// `Dispatcher::shutdown`: the dispatcher's flag (looked at with zero
    /// timeout: the held message never drains while the model waits).
    Dispatcher,
    /// `KeyedExecutor::shutdown`: the executor's flag (zero timeout too).
    Executor,
}

/// How the blocked submitter waits.
#[derive(Clone, Copy)]
enum Wait {
    Thread,
    Task,
}

/// One worker, `max_in_flight` = 1: message 1 suspends on a gate and holds
/// the one unit until the model ends. A loom thread submits message 2
/// (`submit_blocking`, or `.await`ing `submit`), which waits for the unit,
/// while the main thread stops. Message 2 comes back as `Closed(its
/// message)`, however the stop and the submitter interleave: a stop that
/// wakes no waiter, or a waiter that misses the flag after registering,
/// leaves the submitter parked for good (a loom deadlock). Message 1 is
/// untouched and finishes once the gate opens. Counted: the stop came
/// before the submitter began, or while it was submitting or waiting.
fn stop_vs_blocked_submit(
    name: &'static str,
    stop: Stop,
    wait: Wait,
    seen: &'static [StdCounter; 2],
) {
    model(name, move || {
        let log = Log::new();
        let gate = Gate::new();
        let ex = executor(1, 16);
        let (d, r) = scripted_receiver(&ex, &log, 1);
        let first = r.submit_blocking(0, Msg::gated(1, &gate)).unwrap();
        let r = StdArc::new(r);
        let began = std::sync::Arc::new(AtomicBool::new(false));
        let (r2, b2) = (r.clone(), began.clone());
        let submitter = thread::spawn(move || {
            b2.store(true, SeqCst);
            let refused = match wait {
                Wait::Thread => r2.submit_blocking(0, Msg::now(2)).map(drop),
                Wait::Task => block_on(r2.submit(0, Msg::now(2))).map(drop),
            };
            match refused {
                Err(SubmitError::Closed(msg)) => msg.id,
                Err(e) => panic!("message 2: {e}, not Closed"),
                Ok(()) => panic!("message 2 accepted while the unit was held"),
            }
        });
        let before = !began.load(SeqCst);
        match stop {
            Stop::Close => r.close(),
            Stop::Dispatcher => assert!(!d.shutdown(std::time::Duration::ZERO)),
            Stop::Executor => assert!(!ex.shutdown(std::time::Duration::ZERO)),
        }
        assert_eq!(submitter.join().unwrap(), 2, "its own message back");
        assert_eq!(r.in_flight(), 1, "message 1 still holds its unit");
        gate.open_and_wake(0);
        assert_eq!(first.wait().unwrap(), 1);
        assert!(ex.shutdown(LONG));
        gate.clear();
        assert_eq!(r.in_flight(), 0);
        assert_eq!(r.accepted(), 1, "message 2 never took a position");
        seen[usize::from(before)].fetch_add(1, SeqCst);
    });
    assert_all_seen(
        name,
        &[
            ("stopped while the submitter submitted or waited", &seen[0]),
            ("stopped before the submitter began", &seen[1]),
        ],
    );
}

#[allow(clippy::declare_interior_mutable_const)]
const ZERO: StdCounter = StdCounter::new(0);
static CLOSE_THREAD: [StdCounter; 2] = [ZERO; 2];
static CLOSE_TASK: [StdCounter; 2] = [ZERO; 2];
static DISPATCHER_THREAD: [StdCounter; 2] = [ZERO; 2];
static EXECUTOR_TASK: [StdCounter; 2] = [ZERO; 2];

#[test]
fn close_vs_submit_blocking_waiting_for_credit() {
    stop_vs_blocked_submit(
        "close_vs_submit_blocking_waiting_for_credit",
        Stop::Close,
        Wait::Thread,
        &CLOSE_THREAD,
    );
}

#[test]
fn close_vs_submit_await_waiting_for_credit() {
    stop_vs_blocked_submit(
        "close_vs_submit_await_waiting_for_credit",
        Stop::Close,
        Wait::Task,
        &CLOSE_TASK,
    );
}

#[test]
fn dispatcher_shutdown_vs_submit_blocking_waiting_for_credit() {
    stop_vs_blocked_submit(
        "dispatcher_shutdown_vs_submit_blocking_waiting_for_credit",
        Stop::Dispatcher,
        Wait::Thread,
        &DISPATCHER_THREAD,
    );
}

#[test]
fn executor_shutdown_vs_submit_await_waiting_for_credit() {
    stop_vs_blocked_submit(
        "executor_shutdown_vs_submit_await_waiting_for_credit",
        Stop::Executor,
        Wait::Task,
        &EXECUTOR_TASK,
    );
}

/// As above with `close`, and a loom thread opening message 1's gate
/// meanwhile: its unit comes back while the submitter waits and the stop
/// comes. Message 2 is either accepted (it got the unit before it saw the
/// flag) and then runs, or comes back `Closed` with its own message;
/// every unit comes back. Both outcomes are reached.
#[test]
fn close_vs_release_vs_submit_blocking() {
    model("close_vs_release_vs_submit_blocking", || {
        let log = Log::new();
        let gate = Gate::new();
        let ex = executor(1, 16);
        let d = scripted(&ex, &log);
        let r = d
            .receiver_builder()
            .max_in_flight(1)
            .track_commits(true)
            .build()
            .unwrap();
        let first = r.submit_blocking(0, Msg::gated(1, &gate)).unwrap();
        let r = StdArc::new(r);
        let r2 = r.clone();
        let submitter = thread::spawn(move || r2.submit_blocking(0, Msg::now(2)));
        let g = gate.clone();
        let opener = thread::spawn(move || g.open_and_wake(0));
        r.close();
        let accepted = match submitter.join().unwrap() {
            Ok(done) => {
                assert_eq!(done.wait().unwrap(), 2);
                true
            }
            Err(SubmitError::Closed(msg)) => {
                assert_eq!(msg.id, 2, "its own message back");
                false
            }
            Err(e) => panic!("message 2: {e}"),
        };
        opener.join().unwrap();
        assert_eq!(first.wait().unwrap(), 1);
        assert!(ex.shutdown(LONG));
        gate.clear();
        assert_eq!(r.in_flight(), 0, "every unit came back");
        // A refused message 2 may have taken a position (seen the flag
        // after it): resolved as returned, never committed.
        assert!(r.accepted() > u64::from(accepted));
        assert_eq!(r.committable(), Some(1 + u64::from(accepted)));
        RELEASE_VS_CLOSE[usize::from(accepted)].fetch_add(1, SeqCst);
    });
    assert_all_seen(
        "close_vs_release_vs_submit_blocking",
        &[
            ("message 2 refused: Closed", &RELEASE_VS_CLOSE[0]),
            ("message 2 accepted before the close", &RELEASE_VS_CLOSE[1]),
        ],
    );
}

static RELEASE_VS_CLOSE: [StdCounter; 2] = [ZERO; 2];
