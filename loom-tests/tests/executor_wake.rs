#![cfg(loom)]
//! Loom models of the mailbox waker: a wake from another thread during the
//! poll, after it, and after the message completed; and a wake racing the
//! fairness re-queue of the same mailbox (throughput 1); and a port's turn
//! taking what its inbox held when it began, against a push racing it.
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

use std::sync::atomic::{AtomicUsize as StdCounter, Ordering::Relaxed, Ordering::SeqCst};

use common::{
    assert_all_seen, assert_nothing_left, executor, model, scripted_receiver, Event, Gate, Latch,
    Log, Msg, LONG,
};
use loom::sync::atomic::AtomicBool;
use loom::sync::Arc;
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
        let (d, r) = scripted_receiver(&ex, &log, 4);
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
        let (d, r) = scripted_receiver(&ex, &log, 4);
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

/// One worker, throughput 1: a port's turn takes what its inbox held when
/// it began, and a push racing the turn's mark waits for the next turn,
/// whoever re-queues the port. Message 1 (key 2) blocks the worker in the
/// port's slot; meanwhile messages 2, 3 and 5 (key 0) are submitted, and
/// a loom thread submits message 4 (key 1) while the main thread lets 1
/// return. The next turn runs 2 in the slot (key 0's turn) and gives key
/// 0 a mailbox with 3 and 5 queued, at the back of the worker's queue.
///
/// Fairness: if 4 was in the inbox before 1 was let go (so before the
/// next turn began), key 0 runs one turn (message 2) before key 1, not
/// two: 4 starts before 3. (A turn cut after two deliveries fails here:
/// key 0's mailbox runs 3 before the port comes back for 4.) ("Before" is seen through a loom atomic that
/// the submitter sets after its submit and the main thread reads before
/// it opens the latch, so that loom orders the push before the turn.)
/// Either way every message runs once, per-key order holds, and nothing
/// is left.
#[test]
fn fairness_turn_mark_vs_push() {
    model("fairness_turn_mark_vs_push", || {
        let log = Log::new();
        let latch = Latch::new();
        let ex = executor(1, 1);
        let (d, r) = scripted_receiver(&ex, &log, 8);
        let first = r.submit_blocking(2, Msg::blocked(1, &latch)).unwrap();
        latch.wait_entered();
        let second = r.submit_blocking(0, Msg::now(2)).unwrap();
        let third = r.submit_blocking(0, Msg::now(3)).unwrap();
        let fifth = r.submit_blocking(0, Msg::now(5)).unwrap();
        let r = std::sync::Arc::new(r);
        let pushed = Arc::new(AtomicBool::new(false));
        let (r2, p2) = (r.clone(), pushed.clone());
        let cold = thread::spawn(move || {
            let done = r2.submit_blocking(1, Msg::now(4)).unwrap();
            p2.store(true, SeqCst);
            done
        });
        let queued_before = pushed.load(SeqCst);
        latch.open();
        let fourth = cold.join().unwrap();
        assert_eq!(first.wait().unwrap(), 1);
        assert_eq!(second.wait().unwrap(), 2);
        assert_eq!(third.wait().unwrap(), 3);
        assert_eq!(fourth.wait().unwrap(), 4);
        assert_eq!(fifth.wait().unwrap(), 5);
        assert!(ex.shutdown(LONG));
        log.assert_serial();
        let start = |id| log.position(Event::Start(id));
        assert!(start(2) < start(3) && start(3) < start(5));
        if queued_before {
            assert!(
                start(4) < start(3),
                "key 1 waited behind two turns of key 0: {:?}",
                log.events()
            );
        }
        MARK_VS_PUSH[usize::from(queued_before)].fetch_add(1, Relaxed);
        assert_nothing_left(&d, &r);
    });
    assert_all_seen(
        "fairness_turn_mark_vs_push",
        &[
            (
                "key 1 submitted as message 1 was let go, or after",
                &MARK_VS_PUSH[0],
            ),
            (
                "key 1 in the inbox before message 1 was let go",
                &MARK_VS_PUSH[1],
            ),
        ],
    );
}

static MARK_VS_PUSH: [StdCounter; 2] = [StdCounter::new(0), StdCounter::new(0)];
