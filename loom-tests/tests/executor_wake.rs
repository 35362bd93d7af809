#![cfg(loom)]
//! Loom models of the mailbox waker: a wake from another thread during the
//! poll, after it, and after the message completed; and a wake racing the
//! fairness re-queue of the same mailbox (throughput 1).
//!
//! Double scheduling is caught by the mailbox's own debug assertion (a
//! popped mailbox must be `SCHEDULED`; these models are built with
//! `-C debug_assertions`), a poll after completion by the scripted future,
//! a lost wake by loom's deadlock detection, and a leaked waker or mailbox
//! by loom's `Arc` leak check.
//!
//! ```text
//! RUSTFLAGS="--cfg loom -C debug_assertions" LOOM_MAX_PREEMPTIONS=2 \
//!     cargo test -p loom-tests --release --test executor_wake
//! ```

mod common;

use std::sync::atomic::{AtomicUsize as StdCounter, Ordering::Relaxed};

use common::{assert_all_seen, executor, model, Event, Fixed, Gate, Log, Msg, Script, LONG};
use loom::thread;

/// One worker. Message 1's future parks its waker and returns `Pending`; a
/// loom thread takes the waker, opens the gate and wakes it — during the
/// poll (the mailbox is still `RUNNING`: it must be re-queued, not
/// suspended), or after it — then wakes it once more, late (possibly while
/// message 2 runs or after the mailbox retired). Message 1 is polled
/// exactly twice, message 2 exactly once, both complete, in order.
#[test]
fn wake_during_and_after_poll() {
    model("wake_during_and_after_poll", || {
        let log = Log::new();
        let gate = Gate::new();
        let ex = executor(1, 16);
        let d = ex
            .dispatcher_builder(Script::new(&log))
            .hasher(Fixed::default())
            .build();
        let r = d.receiver(4).unwrap();
        let first = r.submit_blocking(0, Msg::gated(1, &gate)).unwrap();
        let g = gate.clone();
        let waker = thread::spawn(move || g.open_and_wake(1));
        let second = r.submit_blocking(0, Msg::now(2)).unwrap();
        assert_eq!(first.wait().unwrap(), 1);
        assert_eq!(second.wait().unwrap(), 2);
        waker.join().unwrap();
        assert!(ex.shutdown(LONG));
        gate.clear();
        log.assert_serial();
        assert_eq!(
            log.polls(1),
            2,
            "polled once, woken once: polled again once"
        );
        assert_eq!(log.polls(2), 1);
        assert!(log.position(Event::End(1)) < log.position(Event::Start(2)));
        assert_eq!(d.live_mailboxes(), 0);
    });
}

/// One worker, throughput 1, keys 0 and 1. Key 0's message 1 waits on a
/// gate opened (and then woken once more, late) by a loom thread; key 0's
/// message 2, key 1's message 3 and key 0's message 4 are submitted
/// meanwhile. Every time key 0's mailbox finishes a message it goes to the
/// back of the worker's queue — racing the late wake of the same mailbox,
/// which must neither push it a second time nor be lost.
///
/// Fairness: if message 3 was submitted before message 1 completed, key 0
/// runs at most one more message (2) before key 1's turn, so 3 starts
/// before 4. (Not "before 2": a submit hands the message to the worker's
/// inbox, and key 1's mailbox joins the queue when the worker delivers it —
/// which may be just after key 0's mailbox went to the back.)
#[test]
fn fairness_requeue_vs_wake() {
    model("fairness_requeue_vs_wake", || {
        let log = Log::new();
        let gate = Gate::new();
        let ex = executor(1, 1);
        let d = ex
            .dispatcher_builder(Script::new(&log))
            .hasher(Fixed::default())
            .build();
        let r = d.receiver(4).unwrap();
        let a1 = r.submit_blocking(0, Msg::gated(1, &gate)).unwrap();
        let g = gate.clone();
        let waker = thread::spawn(move || g.open_and_wake(1));
        let a2 = r.submit_blocking(0, Msg::now(2)).unwrap();
        let b = r.submit_blocking(1, Msg::now(3)).unwrap();
        // Message 3 is in the worker's inbox (or already ran) from here on.
        log.mark(3);
        let a4 = r.submit_blocking(0, Msg::now(4)).unwrap();
        assert_eq!(a1.wait().unwrap(), 1);
        assert_eq!(a2.wait().unwrap(), 2);
        assert_eq!(b.wait().unwrap(), 3);
        assert_eq!(a4.wait().unwrap(), 4);
        waker.join().unwrap();
        assert!(ex.shutdown(LONG));
        gate.clear();
        assert_eq!(log.polls(1), 2);
        assert_eq!(log.polls(2), 1);
        assert_eq!(log.polls(3), 1);
        assert_eq!(log.polls(4), 1);
        let end1 = log.position(Event::End(1));
        let start2 = log.position(Event::Start(2));
        let start3 = log.position(Event::Start(3));
        let start4 = log.position(Event::Start(4));
        assert!(end1 < start2);
        assert!(log.position(Event::End(2)) < start4);
        let queued_before = log.position(Event::Mark(3)) < end1;
        if queued_before {
            assert!(
                start3 < start4,
                "key 1 waited behind two more turns of key 0: {:?}",
                log.events()
            );
        }
        FAIRNESS[usize::from(queued_before)].fetch_add(1, Relaxed);
        assert_eq!(d.live_mailboxes(), 0);
    });
    assert_all_seen(
        "fairness_requeue_vs_wake",
        &[
            ("key 1 submitted after message 1 completed", &FAIRNESS[0]),
            ("key 1 queued when message 1 completed", &FAIRNESS[1]),
        ],
    );
}

static FAIRNESS: [StdCounter; 2] = [StdCounter::new(0), StdCounter::new(0)];
