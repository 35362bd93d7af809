#![cfg(loom)]
//! Loom models of futures spawned on the executor (`futures_task::Spawn`):
//! a wake from another thread during or after the poll, under a graceful
//! stop; and a force stop racing the task going idle. The spawned future
//! counts its polls and its drops; the task is a loom `Arc`, so a task
//! nobody frees fails the model.
//!
//! ```text
//! RUSTFLAGS="--cfg loom -C debug_assertions" LOOM_MAX_PREEMPTIONS=2 \
//!     cargo test -p loom-tests --release --test executor_spawn
//! ```

mod common;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize as StdCounter, Ordering::Relaxed};
use std::sync::Arc as StdArc;
use std::task::{Context, Poll};

use common::{assert_all_seen, executor, model, Gate, LONG};
use futures_task::{FutureObj, Spawn};
use loom::sync::Arc;
use loom::thread;

#[derive(Default)]
struct Counts {
    polls: StdCounter,
    done: StdCounter,
    drops: StdCounter,
}

/// Pending until its gate opens; counts polls, completion and drop.
struct Gated {
    gate: Arc<Gate>,
    counts: StdArc<Counts>,
    done: bool,
}

impl Future for Gated {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        assert!(!self.done, "polled after it completed");
        self.counts.polls.fetch_add(1, Relaxed);
        let ready = self.gate.poll_open(cx);
        if ready.is_ready() {
            self.done = true;
            self.counts.done.fetch_add(1, Relaxed);
        }
        ready
    }
}

impl Drop for Gated {
    fn drop(&mut self) {
        self.counts.drops.fetch_add(1, Relaxed);
    }
}

fn spawn_gated(ex: &keyed_executor::KeyedExecutor, gate: &Arc<Gate>) -> StdArc<Counts> {
    let counts = StdArc::new(Counts::default());
    let fut = Gated {
        gate: gate.clone(),
        counts: counts.clone(),
        done: false,
    };
    ex.spawn_obj(FutureObj::new(Box::new(fut))).expect("spawn");
    counts
}

/// One worker. A spawned future parks its waker; a loom thread opens the
/// gate and wakes it (during the poll or after it), then wakes it again
/// late, while the main thread stops gracefully. The stop waits for the
/// task; it is polled exactly twice, completes once and is dropped once.
#[test]
fn spawned_wake_vs_graceful_stop() {
    model("spawned_wake_vs_graceful_stop", || {
        let gate = Gate::new();
        let ex = executor(1, 16);
        let counts = spawn_gated(&ex, &gate);
        let g = gate.clone();
        let waker = thread::spawn(move || g.open_and_wake(1));
        assert!(ex.shutdown(LONG), "waited for the spawned task");
        waker.join().unwrap();
        gate.clear();
        assert_eq!(counts.polls.load(Relaxed), 2);
        assert_eq!(counts.done.load(Relaxed), 1);
        assert_eq!(counts.drops.load(Relaxed), 1);
    });
}

/// One worker. A spawned future parks its waker; a loom thread opens the
/// gate and wakes it while the main thread force-stops (twice). The future
/// either completed or was dropped unfinished (cancelled) — dropped exactly
/// once either way, whether the stop claimed it idle, its runner saw the
/// stop, or the stop found it queued; a late wake does nothing.
#[test]
fn spawned_wake_vs_shutdown_now() {
    model("spawned_wake_vs_shutdown_now", || {
        let gate = Gate::new();
        let ex = executor(1, 16);
        let counts = spawn_gated(&ex, &gate);
        let g = gate.clone();
        let waker = thread::spawn(move || g.open_and_wake(0));
        ex.shutdown_now();
        ex.shutdown_now();
        assert!(ex.is_terminated());
        // The waker thread waits for a poll that may never come (the stop
        // dropped the task first): open the way for it.
        gate.release_waiter();
        waker.join().unwrap();
        gate.clear();
        assert_eq!(counts.drops.load(Relaxed), 1, "dropped exactly once");
        let done = counts.done.load(Relaxed);
        assert!(done <= 1);
        assert!(counts.polls.load(Relaxed) <= 2);
        SPAWN_ENDS[done].fetch_add(1, Relaxed);
    });
    assert_all_seen(
        "spawned_wake_vs_shutdown_now",
        &[
            ("cancelled (dropped unfinished)", &SPAWN_ENDS[0]),
            ("completed", &SPAWN_ENDS[1]),
        ],
    );
}

static SPAWN_ENDS: [StdCounter; 2] = [StdCounter::new(0), StdCounter::new(0)];

/// One worker. A loom thread spawns a future (ready on its first poll)
/// while the main thread force-stops: the spawn is refused (the future
/// dropped on the spawner's thread, never polled), or the task runs, or
/// it is cancelled unpolled — dropped exactly once in every case.
#[test]
fn spawn_vs_shutdown_now() {
    model("spawn_vs_shutdown_now", || {
        let gate = Gate::new();
        gate.open_now();
        let ex = executor(1, 16);
        let counts = StdArc::new(Counts::default());
        let (ex2, g, c) = (ex.clone(), gate.clone(), counts.clone());
        let spawner = thread::spawn(move || {
            let fut = Gated {
                gate: g,
                counts: c,
                done: false,
            };
            ex2.spawn_obj(FutureObj::new(Box::new(fut))).is_ok()
        });
        ex.shutdown_now();
        let accepted = spawner.join().unwrap();
        assert_eq!(counts.drops.load(Relaxed), 1, "dropped exactly once");
        let polls = counts.polls.load(Relaxed);
        assert!(polls <= 1);
        if !accepted {
            assert_eq!(polls, 0, "a refused future is never polled");
        }
        SPAWNED[usize::from(accepted) + polls].fetch_add(1, Relaxed);
    });
    assert_all_seen(
        "spawn_vs_shutdown_now",
        &[
            ("refused", &SPAWNED[0]),
            ("accepted, cancelled unpolled", &SPAWNED[1]),
            ("accepted and ran", &SPAWNED[2]),
        ],
    );
}

static SPAWNED: [StdCounter; 3] = [StdCounter::new(0), StdCounter::new(0), StdCounter::new(0)];
