#![cfg(loom)]
//! Loom models of the two stops: `shutdown_now` racing a submit and a
//! running step (every message finished or handed back exactly once; a
//! second `shutdown_now` is harmless), `shutdown_now` racing a batch
//! send, and `shutdown(timeout)` racing a suspended future woken late
//! (drained, workers joined).
//!
//! ```text
//! RUSTFLAGS="--cfg loom -C debug_assertions" LOOM_MAX_PREEMPTIONS=2 \
//!     cargo test -p loom-tests --release --test executor_stop
//! ```

mod common;

use std::sync::atomic::{AtomicUsize as StdCounter, Ordering::Relaxed};
use std::sync::Mutex as StdMutex;

use common::{
    assert_all_seen, assert_nothing_left, batch_of_two_vs_stop, executor, model, scripted_receiver,
    Fixed, Gate, Log, Msg, Script, BATCH_HOOKED, BATCH_RAN, BATCH_REFUSED, LONG,
};
use keyed_executor::{SubmitError, TaskError};
use loom::thread;

/// How one message ended, as its producer saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// Ran: the handler's output.
    Done,
    /// Queued when the stop came: handed back through its completion
    /// (`Rejected`) or the `on_reject` hook.
    Rejected,
    /// Its future was suspended (or re-queued mid-way) and was dropped.
    Cancelled,
    /// Refused at submission (`Closed`), handed back.
    Closed,
}

/// Checks that what the producer saw matches what the handler did.
fn check(log: &Log, id: u32, end: End) {
    match end {
        End::Done => assert!(log.ended(id), "{id} reported done but did not run"),
        End::Cancelled => assert!(
            log.started(id) && !log.ended(id),
            "{id} cancelled but it did not start, or finished"
        ),
        End::Rejected | End::Closed => {
            assert!(!log.started(id), "{id} handed back but it ran")
        }
    }
}

/// One worker. Message 1 (which re-queues itself once mid-way, so a force
/// stop can find it queued, running, re-queued or done) is submitted with a
/// completion; a loom thread fire-and-forgets message 2 (handed back, if
/// queued, through the `on_reject` hook) while the main thread calls
/// `shutdown_now` twice and the loom thread calls it too, concurrently.
/// Each message ends exactly once — done, rejected
/// (handed back), cancelled or refused (handed back) — and that matches
/// what the handler did; the workers are joined; nothing leaks.
#[test]
fn shutdown_now_vs_submit_vs_step() {
    model("shutdown_now_vs_submit_vs_step", || {
        let log = Log::new();
        let handed_back = std::sync::Arc::new(StdMutex::new(Vec::new()));
        let hb = handed_back.clone();
        let ex = executor(1, 16);
        let d = ex
            .dispatcher_builder(Script::new(&log))
            .hasher(Fixed::default())
            .on_reject(move |key, msg: Msg| hb.lock().unwrap().push((key, msg.id)))
            .build();
        let r = d.receiver(4).unwrap();
        let first = r.submit_blocking(0, Msg::yield_once(1)).unwrap();
        let r2 = r.clone();
        let ex2 = ex.clone();
        let producer = thread::spawn(move || {
            let refused = match r2.send(0, Msg::now(2)) {
                Ok(_) => None,
                Err(SubmitError::Closed(msg)) => Some(msg.id),
                Err(e) => panic!("unexpected {e:?}"),
            };
            ex2.shutdown_now();
            assert!(ex2.is_terminated());
            refused
        });
        ex.shutdown_now();
        assert!(ex.is_terminated(), "shutdown_now joins the workers");
        ex.shutdown_now();
        let end1 = match first.wait() {
            Ok(1) => End::Done,
            Err(TaskError::Rejected(msg)) => {
                assert_eq!(msg.id, 1, "the message itself is handed back");
                End::Rejected
            }
            Err(TaskError::Cancelled) => End::Cancelled,
            other => panic!("unexpected {other:?}"),
        };
        let refused = producer.join().unwrap();
        let hook = handed_back.lock().unwrap().clone();
        let end2 = match (refused, hook.as_slice()) {
            (Some(2), []) => End::Closed,
            (None, [(0, 2)]) => End::Rejected,
            (None, []) => End::Done,
            other => panic!("message 2 ended as {other:?}"),
        };
        check(&log, 1, end1);
        check(&log, 2, end2);
        log.assert_serial();
        assert_eq!(r.in_flight(), 0, "every unit came back");
        assert_eq!(d.live_mailboxes(), 0);
        ENDS[0][end1 as usize].fetch_add(1, Relaxed);
        ENDS[1][end2 as usize].fetch_add(1, Relaxed);
    });
    let (one, two) = (&ENDS[0], &ENDS[1]);
    assert_all_seen(
        "shutdown_now_vs_submit_vs_step",
        &[
            ("1 done", &one[End::Done as usize]),
            ("1 rejected (completion)", &one[End::Rejected as usize]),
            ("1 cancelled", &one[End::Cancelled as usize]),
            ("2 done", &two[End::Done as usize]),
            ("2 rejected (on_reject hook)", &two[End::Rejected as usize]),
            ("2 refused (Closed)", &two[End::Closed as usize]),
        ],
    );
}

#[allow(clippy::declare_interior_mutable_const)]
const ZERO: StdCounter = StdCounter::new(0);
static ENDS: [[StdCounter; 4]; 2] = [[ZERO; 4], [ZERO; 4]];

/// One worker. Message 1's future waits on a gate that a loom thread opens
/// late — before, during or after the main thread's graceful
/// `shutdown(timeout)` begins. The stop refuses a new message, keeps the
/// worker until the suspended future was woken and finished, then returns
/// `true` with the worker joined. (Under loom a timed wait does not time
/// out: a stop that never drains is reported as a deadlock.)
#[test]
fn shutdown_vs_late_wake() {
    model("shutdown_vs_late_wake", || {
        let log = Log::new();
        let gate = Gate::new();
        let ex = executor(1, 16);
        let (d, r) = scripted_receiver(&ex, &log, 4);
        let first = r.submit_blocking(0, Msg::gated(1, &gate)).unwrap();
        let g = gate.clone();
        let waker = thread::spawn(move || g.open_and_wake(0));
        assert!(ex.shutdown(LONG), "drained and joined");
        assert!(ex.is_terminated());
        match r.try_submit(0, Msg::now(2)) {
            Err(SubmitError::Closed(msg)) => assert_eq!(msg.id, 2),
            other => panic!("accepted after the stop: {other:?}"),
        }
        assert_eq!(first.wait().unwrap(), 1);
        waker.join().unwrap();
        gate.clear();
        assert_eq!(log.polls(1), 2);
        assert_nothing_left(&d, &r);
    });
}

/// Two workers, a graceful stop: key 0's message 1 suspends itself once
/// (re-queued mid-way) and key 1's message 2 runs at once, on the other
/// worker when the pool picks it, while the main thread stops. Each worker
/// may see the last mailbox retire on the other one; both must still exit,
/// so the stop returns `true`: a worker that checked "drained" just before
/// the other retired the last mailbox must not park for good.
#[test]
fn shutdown_two_workers() {
    model("shutdown_two_workers", || {
        let log = Log::new();
        let ex = executor(2, 16);
        let (d, r) = scripted_receiver(&ex, &log, 4);
        let first = r.submit_blocking(0, Msg::yield_once(1)).unwrap();
        let second = r.submit_blocking(1, Msg::now(2)).unwrap();
        assert!(ex.shutdown(LONG), "drained and joined");
        assert_eq!(first.wait().unwrap(), 1);
        assert_eq!(second.wait().unwrap(), 2);
        assert_eq!(log.polls(1), 2);
        assert_eq!(d.live_mailboxes(), 0);
    });
}

static BATCH_STOP_ENDS: [StdCounter; 3] = [ZERO; 3];

/// One worker: a loom thread sends a batch of two messages for one key
/// (one chunk: one unit CAS, one positions `fetch_add`, two pushes, one
/// fence) while the main thread calls the executor's `shutdown_now`. The
/// stop may come before the chunk's positions, between its pushes and
/// its look at the port's `closed`, or after both ran. Each message ends
/// exactly once — ran, handed back through `on_reject`, or refused in the
/// batch's error — the key's order holds (a message handed back is never
/// followed by one that ran), and every unit comes back. (Checked: it
/// fails if the batch skips its late hand-back after the pushes, and on a
/// variant that bundled a chunk into one inbox entry and lost its second
/// message in the stop.)
#[test]
fn a_batch_vs_shutdown_now() {
    model("a_batch_vs_shutdown_now", || {
        let kind = batch_of_two_vs_stop(|ex, _| {
            ex.shutdown_now();
            assert!(ex.is_terminated(), "shutdown_now joins the workers");
        });
        BATCH_STOP_ENDS[kind].fetch_add(1, Relaxed);
    });
    assert_all_seen(
        "a_batch_vs_shutdown_now",
        &[
            (
                "refused in the batch error",
                &BATCH_STOP_ENDS[BATCH_REFUSED],
            ),
            (
                "handed back through on_reject",
                &BATCH_STOP_ENDS[BATCH_HOOKED],
            ),
            ("both ran", &BATCH_STOP_ENDS[BATCH_RAN]),
        ],
    );
}
