#![cfg(loom)]
//! Loom model of a receiver's credit: a message finishing (and releasing
//! its unit) races submitters blocked for credit — one in `submit_blocking`
//! (a parked thread), one in `.await`ing `submit` (a task waker), one that
//! gives up. Every waiter proceeds (a lost notification is a loom
//! deadlock) and the receiver never holds more than `max_in_flight`
//! unfinished messages.
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

use common::{assert_all_seen, executor, model, Fixed, LONG};
use keyed_executor::handler;
use loom::future::block_on;
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
