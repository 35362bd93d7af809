#![cfg(loom)]
//! The port inbox alone (`src/pool/inbox.rs`), with two-slot blocks so
//! that producers cross block boundaries and reuse the spare block: each
//! producer's values come out in its order, each exactly once, and the
//! consumer never reads a slot before it is written (loom checks every
//! access to the slots' cells).
//!
//! ```text
//! RUSTFLAGS="--cfg loom -C debug_assertions" LOOM_MAX_PREEMPTIONS=2 \
//!     cargo test -p loom-tests --release --test inbox
//! ```

mod common;

use common::model;
use keyed_executor::__loom::Inbox;
use loom::sync::Arc;

/// Pops until `n` values came out, checking per-producer order.
fn drain(q: &Inbox<(u8, u8), 2>, n: usize) {
    let mut next = [0u8; 2];
    let mut got = 0;
    while got < n {
        // SAFETY: this thread is the only consumer.
        match unsafe { q.pop() } {
            Some((who, i)) => {
                assert_eq!(next[who as usize], i, "producer {who} out of order");
                next[who as usize] += 1;
                got += 1;
            }
            None => loom::thread::yield_now(),
        }
    }
}

/// Two producers, one of them crossing the first block's end, against the
/// consumer.
#[test]
fn two_producers_and_the_consumer() {
    model("inbox_two_producers", || {
        let q: Arc<Inbox<(u8, u8), 2>> = Arc::new(Inbox::new());
        let q2 = q.clone();
        let p = loom::thread::spawn(move || {
            q2.push((1, 0));
            q2.push((1, 1));
        });
        q.push((0, 0));
        drain(&q, 3);
        p.join().unwrap();
        assert!(q.is_empty());
        // SAFETY: the only consumer.
        assert!(unsafe { q.pop() }.is_none());
    });
}

/// One producer pushing five values (three blocks: the first one the
/// consumer finishes comes back as the spare and is linked again) while
/// the consumer pops.
#[test]
fn a_producer_reuses_the_block_the_consumer_freed() {
    model("inbox_spare_block", || {
        let q: Arc<Inbox<(u8, u8), 2>> = Arc::new(Inbox::new());
        let q2 = q.clone();
        let p = loom::thread::spawn(move || {
            for i in 0..5 {
                q2.push((0, i));
            }
        });
        drain(&q, 5);
        p.join().unwrap();
        assert!(q.is_empty());
    });
}
