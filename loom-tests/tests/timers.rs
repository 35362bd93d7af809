#![cfg(loom)]
//! The deadline service alone (`Timers` in `src/timer.rs`): its thread
//! against inserts, re-arms, cancels and the close. Under loom the
//! thread's timed wait is an untimed one, so an entry that becomes the
//! earliest without notifying the thread leaves it waiting for good, and
//! loom reports the deadlock. Deadlines are either already passed (due as
//! soon as the thread looks) or an hour away (never due in a model).
//!
//! ```text
//! RUSTFLAGS="--cfg loom -C debug_assertions" LOOM_MAX_PREEMPTIONS=2 \
//!     cargo test -p loom-tests --release --test timers
//! ```

mod common;

use std::future::poll_fn;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use common::{assert_all_seen, model};
use futures_task::ArcWake;
use keyed_executor::__loom::{TimerKey, Timers};

/// A waker that counts its wakes. Its count is the model's own
/// bookkeeping (a `std` atomic, invisible to loom).
struct Count(AtomicUsize);

impl ArcWake for Count {
    fn wake_by_ref(arc_self: &std::sync::Arc<Self>) {
        arc_self.0.fetch_add(1, SeqCst);
    }
}

fn counting() -> (std::sync::Arc<Count>, Waker) {
    let count = std::sync::Arc::new(Count(AtomicUsize::new(0)));
    let waker = futures_task::waker(count.clone());
    (count, waker)
}

fn woken(count: &Count) -> usize {
    count.0.load(SeqCst)
}

const HOUR: Duration = Duration::from_secs(3600);

/// Blocks (a loom park) until `key`'s entry is no longer pending, having
/// inserted it with the blocked task's waker; loom reports a deadlock if
/// that waker is never woken.
fn wait_fired(timers: &Timers, insert: impl FnOnce(&Waker) -> TimerKey) {
    let mut insert = Some(insert);
    let mut key = None;
    loom::future::block_on(poll_fn(|cx| {
        if let Some(insert) = insert.take() {
            key = Some(insert(cx.waker()));
        }
        match key {
            Some(k) if !timers.is_pending(k) => Poll::Ready(()),
            _ => Poll::Pending,
        }
    }));
}

/// The thread starts on an entry an hour away and goes to wait for it;
/// meanwhile a due entry arrives. Whether the thread sees it before it
/// waits or is waiting already, the due entry fires.
#[test]
fn an_earlier_entry_wakes_the_waiting_thread() {
    model("timers_earlier_entry", || {
        let now = Instant::now();
        let timers = Timers::with_name("loom-timer");
        let (far_count, far_waker) = counting();
        let far = timers.insert(now + HOUR, &far_waker).unwrap();
        wait_fired(&timers, |waker| timers.insert(now, waker).unwrap());
        assert!(timers.is_pending(far));
        assert_eq!(woken(&far_count), 0);
        // The close joins the thread and wakes what is left.
        drop(timers);
        assert_eq!(woken(&far_count), 1);
    });
}

/// The same race through a re-arm: the only entry moves from an hour away
/// to now while the thread goes to wait for it.
#[test]
fn a_re_arm_earlier_wakes_the_waiting_thread() {
    model("timers_rearm_earlier", || {
        let now = Instant::now();
        let timers = Timers::with_name("loom-timer");
        let (count, idle) = counting();
        wait_fired(&timers, |waker| {
            let key = timers.insert(now + HOUR, &idle).unwrap();
            assert!(timers.reset(key, now, waker), "an hour away: still pending");
            key
        });
        assert_eq!(woken(&count), 0, "the re-arm replaced the first waker");
        drop(timers);
    });
}

/// A due entry cancelled while the thread fires it: cancelled (and never
/// woken), or fired (and woken exactly once) — never both, never neither.
#[test]
fn a_cancel_racing_the_firing() {
    static CANCELLED: AtomicUsize = AtomicUsize::new(0);
    static FIRED: AtomicUsize = AtomicUsize::new(0);
    model("timers_cancel_vs_fire", || {
        let timers = Timers::with_name("loom-timer");
        let (count, waker) = counting();
        let key = timers.insert(Instant::now(), &waker).unwrap();
        drop(waker);
        let cancelled = timers.cancel(key);
        // The close joins the thread: any firing has finished waking.
        drop(timers);
        if cancelled {
            assert_eq!(woken(&count), 0, "cancelled, yet woken");
            CANCELLED.fetch_add(1, SeqCst);
        } else {
            assert_eq!(woken(&count), 1, "not cancelled: woken once");
            FIRED.fetch_add(1, SeqCst);
        }
        assert_eq!(std::sync::Arc::strong_count(&count), 1, "a waker was kept");
    });
    assert_all_seen(
        "timers_cancel_vs_fire",
        &[("cancelled", &CANCELLED), ("fired", &FIRED)],
    );
}

/// A due entry's waker replaced (a `Sleep` polled by another task) while
/// the thread fires it: exactly one of the two wakers is woken, the new
/// one if the re-arm found the entry pending.
#[test]
fn a_new_waker_racing_the_firing() {
    static MOVED: AtomicUsize = AtomicUsize::new(0);
    static LATE: AtomicUsize = AtomicUsize::new(0);
    model("timers_new_waker_vs_fire", || {
        let now = Instant::now();
        let timers = Timers::with_name("loom-timer");
        let (old_count, old) = counting();
        let (new_count, new) = counting();
        let key = timers.insert(now, &old).unwrap();
        let moved = timers.reset(key, now, &new);
        drop(timers);
        let (old_woken, new_woken) = (woken(&old_count), woken(&new_count));
        if moved {
            assert_eq!((old_woken, new_woken), (0, 1));
            MOVED.fetch_add(1, SeqCst);
        } else {
            assert_eq!((old_woken, new_woken), (1, 0));
            LATE.fetch_add(1, SeqCst);
        }
    });
    assert_all_seen(
        "timers_new_waker_vs_fire",
        &[("moved before the firing", &MOVED), ("fired first", &LATE)],
    );
}

/// The `Timers` dropped while its thread fires a due entry: the entry is
/// woken exactly once (by the thread, or by the close), and the thread
/// exits (loom checks every thread ends and every `Arc` is freed).
#[test]
fn the_close_racing_the_firing() {
    model("timers_close_vs_fire", || {
        let timers = Timers::with_name("loom-timer");
        let (count, waker) = counting();
        let _ = timers.insert(Instant::now(), &waker).unwrap();
        drop(timers);
        assert_eq!(woken(&count), 1);
    });
}
