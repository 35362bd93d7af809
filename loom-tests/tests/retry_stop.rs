#![cfg(loom)]
//! Loom model of a retrying handler's backoff (`src/pool/poison.rs`):
//! the timer thread's wake-up of a message waiting for its next attempt
//! races `shutdown_now` (of the executor, from another thread). The
//! message ends exactly once: run to its end (both attempts), or handed
//! back `Rejected` with the message itself after at most its first attempt
//! — never both, never neither, never a second attempt after the stop
//! took it.
//!
//! Under loom a sleep always goes through the timer thread (see `Sleep` in
//! `src/timer.rs`), so its wake is a real race even with a zero backoff.
//!
//! ```text
//! RUSTFLAGS="--cfg loom -C debug_assertions" LOOM_MAX_PREEMPTIONS=2 \
//!     cargo test -p loom-tests --release --test retry_stop
//! ```

mod common;

use std::sync::atomic::{AtomicUsize as StdCounter, Ordering::Relaxed};
use std::sync::Arc as StdArc;
use std::time::Duration;

use common::{assert_all_seen, executor, model, Fixed};
use keyed_executor::{handler, Backoff, Jitter, RetryPolicy, TaskError};
use loom::thread;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// Both attempts ran; the second succeeded.
    Done,
    /// Handed back before its first attempt (still queued).
    RejectedQueued,
    /// Handed back in its backoff, after its first attempt.
    RejectedInBackoff,
}

#[allow(clippy::declare_interior_mutable_const)]
const ZERO: StdCounter = StdCounter::new(0);
static ENDS: [StdCounter; 3] = [ZERO; 3];

/// One worker. Message 1 fails its first attempt and waits a (zero)
/// backoff on the timer thread, whose wake re-queues it; a loom thread
/// calls `shutdown_now` meanwhile. Its completion says `Ok` after exactly
/// two attempts, or `Rejected(1)` after at most one; its unit comes back;
/// nothing runs after the stop returned.
#[test]
fn backoff_wake_vs_shutdown_now() {
    model("backoff_wake_vs_shutdown_now", || {
        let attempts = StdArc::new(StdCounter::new(0));
        let a = attempts.clone();
        let policy = RetryPolicy::builder()
            .max_attempts(2)
            .backoff(Backoff::fixed(Duration::ZERO))
            .jitter(Jitter::None)
            .build()
            .unwrap();
        let ex = executor(1, 16);
        let d = ex
            .dispatcher_builder(handler::retrying(policy, move |_: &u64, n: &u32| {
                if a.fetch_add(1, Relaxed) == 0 {
                    Err("first attempt")
                } else {
                    Ok(*n)
                }
            }))
            .hasher(Fixed::default())
            .build();
        let r = d.receiver(2).unwrap();
        let done = r.submit_blocking(0, 1).unwrap();
        let ex2 = ex.clone();
        let stopper = thread::spawn(move || {
            ex2.shutdown_now();
            assert!(ex2.is_terminated());
        });
        let end = match done.wait() {
            Ok(1) => End::Done,
            Err(TaskError::Rejected(1)) => {
                if attempts.load(Relaxed) == 0 {
                    End::RejectedQueued
                } else {
                    End::RejectedInBackoff
                }
            }
            other => panic!("unexpected {other:?}"),
        };
        stopper.join().unwrap();
        let ran = attempts.load(Relaxed);
        match end {
            End::Done => assert_eq!(ran, 2, "done after both attempts"),
            End::RejectedQueued => assert_eq!(ran, 0),
            End::RejectedInBackoff => assert_eq!(ran, 1, "handed back, never run again"),
        }
        assert_eq!(r.in_flight(), 0, "its unit came back");
        drop((r, d, ex));
        assert_eq!(attempts.load(Relaxed), ran, "nothing ran after the stop");
        ENDS[end as usize].fetch_add(1, Relaxed);
    });
    assert_all_seen(
        "backoff_wake_vs_shutdown_now",
        &[
            ("done", &ENDS[End::Done as usize]),
            ("rejected while queued", &ENDS[End::RejectedQueued as usize]),
            (
                "rejected in its backoff",
                &ENDS[End::RejectedInBackoff as usize],
            ),
        ],
    );
}
