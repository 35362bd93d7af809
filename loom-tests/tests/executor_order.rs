#![cfg(loom)]
//! Loom models of per-key order and of mailbox retirement: two producers
//! of one key see their messages run in their arrival order, one at a time
//! (also across an `.await`); and a mailbox retiring because it is idle
//! races a submit to its key without losing or duplicating the message.
//!
//! ```text
//! RUSTFLAGS="--cfg loom -C debug_assertions" LOOM_MAX_PREEMPTIONS=2 \
//!     cargo test -p loom-tests --release --test executor_order
//! ```

mod common;

use common::{
    assert_nothing_left, conserving, executor, model, scripted_receiver, Event, Fixed, Log, Msg,
    Script, LONG,
};
use loom::thread;

/// One worker, one key, two producers: a spawned thread submits 1 (which
/// suspends once, so the mailbox is re-queued with it half done) then 2;
/// the main thread submits 3. Each producer's messages run in its order,
/// one at a time (a message never starts while another of the key is
/// suspended), each exactly once.
#[test]
fn two_producers_one_key() {
    model("two_producers_one_key", || {
        let log = Log::new();
        let ex = executor(1, 16);
        let (d, r) = scripted_receiver(&ex, &log, 4);
        let r2 = r.clone();
        let producer = thread::spawn(move || {
            let a = r2.submit_blocking(0, Msg::yield_once(1)).unwrap();
            let b = r2.submit_blocking(0, Msg::now(2)).unwrap();
            (a, b)
        });
        let c = r.submit_blocking(0, Msg::now(3)).unwrap();
        let (a, b) = producer.join().unwrap();
        assert_eq!(a.wait().unwrap(), 1);
        assert_eq!(b.wait().unwrap(), 2);
        assert_eq!(c.wait().unwrap(), 3);
        assert!(ex.shutdown(LONG));
        log.assert_serial();
        assert!(log.position(Event::End(1)) < log.position(Event::Start(2)));
        assert_eq!(
            log.polls(1),
            2,
            "a self-wake during the poll costs one more poll"
        );
        assert_eq!(log.polls(2), 1);
        assert_eq!(log.polls(3), 1);
        assert_eq!(d.live_mailboxes(), 0);
    });
}

/// Two workers, one key: message 1 runs and its mailbox goes idle and
/// retires (under the shard lock) while the main thread submits message 2
/// to the same key. Message 2 lands in the old mailbox (which then keeps
/// running) or in a fresh one — possibly on the other worker — but runs
/// exactly once, after 1, never overlapping it; no mailbox is left behind
/// or leaked.
#[test]
fn retire_vs_submit() {
    model("retire_vs_submit", || {
        let log = Log::new();
        // With work conservation: the idle worker may take the port's task
        // or turn while the first message runs.
        let ex = conserving(2, 16);
        let d = ex
            .dispatcher_builder(Script::probed(&log))
            .hasher(Fixed::default())
            .build();
        let r = d.receiver(4).unwrap();
        let first = r.submit_blocking(0, Msg::now(1)).unwrap();
        let second = r.submit_blocking(0, Msg::now(2)).unwrap();
        assert_eq!(first.wait().unwrap(), 1);
        assert_eq!(second.wait().unwrap(), 2);
        assert!(ex.shutdown(LONG));
        log.assert_serial();
        assert!(log.position(Event::End(1)) < log.position(Event::Start(2)));
        assert_nothing_left(&d, &r);
    });
}
