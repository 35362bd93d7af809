#![cfg(loom)]
//! Loom models of `ReceiverSink` (the `sink` feature): the unit a
//! `poll_ready` reserves races a graceful stop of its receiver, and the
//! sink then either sends on it or is dropped with it. Nothing is lost:
//! the message runs, or comes back from `start_send` as `Closed` with its
//! key — never both, never neither; a reservation never used comes back,
//! so the stop's drain ends (a unit left out is a loom deadlock); the
//! receiver never holds more than `max_in_flight`.
//!
//! (The wait in `poll_ready` is the credit wait every async submitter uses,
//! with the task's waker: `executor_credit.rs` models it against releases
//! and stops.)
//!
//! ```text
//! RUSTFLAGS="--cfg loom -C debug_assertions" LOOM_MAX_PREEMPTIONS=2 \
//!     cargo test -p loom-tests --release --test executor_sink
//! ```

mod common;

use std::future::poll_fn;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize as StdCounter, Ordering::Relaxed};

use common::{assert_all_seen, executor, model, scripted_receiver, Log, Msg, LONG};
use futures_sink::Sink;
use keyed_executor::SubmitError;
use loom::future::block_on;
use loom::thread;

#[allow(clippy::declare_interior_mutable_const)]
const ZERO: StdCounter = StdCounter::new(0);

/// How the sink's attempt ended: message 1 ran; it came back `Closed`;
/// the sink was dropped holding a reserved unit; dropped without one (the
/// stop came first).
static ENDS: [StdCounter; 4] = [ZERO; 4];
const RAN: usize = 0;
const HANDED_BACK: usize = 1;
const DROPPED_RESERVED: usize = 2;
const DROPPED_EMPTY: usize = 3;

/// `max_in_flight` 1, one worker, one key. A loom thread's sink reserves
/// the unit in `poll_ready` (or finds the receiver closed), then
/// (`send`) `start_send`s message 1, or drops the sink with what it
/// reserved; meanwhile another shuts the receiver down gracefully (close,
/// then wait for every unit). Message 1 ends exactly once (it ran, or
/// came back with its key), every unit comes back, and the drain ends.
///
/// The main thread only joins: under loom a late `unpark` of a thread
/// blocked in `join` (a waker or a drain's wake-up arriving after its wait
/// ended, which is legal) fails the model, so no waiter joins.
fn reserve_vs_shutdown_then(send: bool) {
    let log = Log::new();
    let ex = executor(1, 16);
    let (_d, r) = scripted_receiver(&ex, &log, 1);
    let stopper = {
        let r = r.clone();
        thread::spawn(move || assert!(r.shutdown(LONG), "the drain ends: no unit is left out"))
    };
    let mut sink = r.sink();
    let producer = thread::spawn(move || {
        block_on(poll_fn(|cx| Pin::new(&mut sink).poll_ready(cx))).unwrap();
        let reserved = sink.is_reserved();
        assert!(sink.get_ref().in_flight() <= 1, "over max_in_flight");
        if !send {
            drop(sink);
            return if reserved {
                DROPPED_RESERVED
            } else {
                DROPPED_EMPTY
            };
        }
        match Pin::new(&mut sink).start_send((0, Msg::now(1))) {
            Ok(()) => {
                assert!(reserved, "accepted without a reservation");
                RAN
            }
            Err(SubmitError::Closed((key, msg))) => {
                assert_eq!((key, msg.id), (0, 1), "the very pair comes back");
                HANDED_BACK
            }
            Err(e) => panic!("refused for credit after Ready: {e:?}"),
        }
    });
    let end = producer.join().unwrap();
    stopper.join().unwrap();
    assert_eq!(
        log.ended(1),
        end == RAN,
        "1 ran exactly when accepted: {:?}, accepted {}, in flight {}",
        log.events(),
        r.accepted(),
        r.in_flight()
    );
    log.assert_serial();
    assert!(ex.shutdown(LONG));
    assert_eq!(r.in_flight(), 0, "every unit came back");
    ENDS[end].fetch_add(1, Relaxed);
}

#[test]
fn sink_reserve_vs_receiver_shutdown_then_send() {
    model("sink_reserve_vs_receiver_shutdown_then_send", || {
        reserve_vs_shutdown_then(true)
    });
    assert_all_seen(
        "sink_reserve_vs_receiver_shutdown_then_send",
        &[("1 ran", &ENDS[RAN]), ("1 handed back", &ENDS[HANDED_BACK])],
    );
}

#[test]
fn sink_reserve_vs_receiver_shutdown_then_drop() {
    model("sink_reserve_vs_receiver_shutdown_then_drop", || {
        reserve_vs_shutdown_then(false)
    });
    assert_all_seen(
        "sink_reserve_vs_receiver_shutdown_then_drop",
        &[
            ("dropped holding a unit", &ENDS[DROPPED_RESERVED]),
            ("dropped without one", &ENDS[DROPPED_EMPTY]),
        ],
    );
}
