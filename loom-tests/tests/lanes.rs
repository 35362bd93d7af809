#![cfg(loom)]
//! Loom models of the `Lanes` front-end's races: leader hand-off,
//! withdrawal vs. batch formation, a caller dropped mid-batch, and a
//! caller entering while the lanes close. Each
//! asserts order and nothing-lost from the kernel's own record: every
//! command that started in the kernel finished there (nothing half-run),
//! nothing ran twice, every answered command ran, every withdrawn one never
//! did, and the lanes end empty.
//!
//! ```text
//! RUSTFLAGS="--cfg loom -C debug_assertions" LOOM_MAX_PREEMPTIONS=2 \
//!     cargo test -p loom-tests --release --test lanes
//! ```

use std::future::Future;
use std::pin::{pin, Pin};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use std::sync::atomic::AtomicUsize as StdCounter;

use keyed_executor::lanes::{BatchResult, Clock, Kernel, LaneError, Lanes, ManualClock};
use loom::future::block_on;
use loom::sync::atomic::{AtomicBool, Ordering};
use loom::sync::Mutex;
use loom::thread;

/// Records what it starts and what it finishes; yields once inside every
/// batch so the batch future is suspended (and can change hands) mid-way.
#[derive(Default)]
struct Recorder {
    started: Mutex<Vec<u64>>,
    finished: Mutex<Vec<u64>>,
    running: AtomicBool,
}

struct YieldOnce(bool);

impl Future for YieldOnce {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.0 {
            Poll::Ready(())
        } else {
            self.0 = true;
            cx.waker().wake_by_ref();
            Poll::Pending
        }
    }
}

impl Kernel for Recorder {
    type Key = u8;
    type Command = u64;
    type Output = u64;
    type Error = ();

    async fn execute_batch(&self, _key: &u8, commands: Vec<u64>) -> BatchResult<u64, u64, ()> {
        assert!(
            !self.running.swap(true, Ordering::SeqCst),
            "two batches of one key overlapped"
        );
        self.started.lock().unwrap().extend(&commands);
        YieldOnce(false).await;
        self.finished.lock().unwrap().extend(&commands);
        self.running.swap(false, Ordering::SeqCst);
        BatchResult::committed(commands.iter().map(|c| Ok(c * 10)).collect())
    }
}

fn count(v: &[u64], id: u64) -> usize {
    v.iter().filter(|&&x| x == id).count()
}

/// Every outcome a model counted was reached in at least one execution.
fn assert_explored(outcomes: &[StdCounter]) {
    for (i, n) in outcomes.iter().enumerate() {
        assert!(
            n.load(std::sync::atomic::Ordering::Relaxed) > 0,
            "outcome {i} never explored"
        );
    }
}

/// Nothing half-run, nothing twice; the lanes are empty.
fn check_end(lanes: &Lanes<Recorder>) -> Vec<u64> {
    let k = lanes.kernel();
    let started = k.started.lock().unwrap().clone();
    let finished = k.finished.lock().unwrap().clone();
    assert_eq!(started, finished, "a started batch did not finish");
    for &id in &started {
        assert_eq!(count(&started, id), 1, "command {id} ran twice");
    }
    assert_eq!(lanes.in_flight(), 0);
    assert_eq!(lanes.lanes_alive(), 0);
    started
}

/// Three callers of one key race to lead; the lane passes from leader to
/// the head of the queue after each batch (max_batch 2, so both a batch and
/// a lone command are possible).
#[test]
fn leader_hand_off() {
    loom::model(|| {
        let lanes = Lanes::builder(Recorder::default())
            .max_batch(2)
            .build()
            .unwrap();
        let handles: Vec<_> = [1u64, 2]
            .into_iter()
            .map(|id| {
                let l = lanes.clone();
                thread::spawn(move || block_on(l.execute(0, id)))
            })
            .collect();
        assert_eq!(block_on(lanes.execute(0, 3)).unwrap(), 30);
        for (h, id) in handles.into_iter().zip([1u64, 2]) {
            assert_eq!(h.join().unwrap().unwrap(), id * 10);
        }
        let mut ran = check_end(&lanes);
        ran.sort();
        assert_eq!(ran, vec![1, 2, 3]);
    });
}

/// A caller with a deadline races a leader forming a batch while the clock
/// passes the deadline: the command either runs exactly once and its caller
/// gets the output, or is withdrawn, handed back, and never reaches the
/// kernel.
#[test]
fn withdrawal_vs_batch_formation() {
    loom::model(|| {
        let clock = ManualClock::new();
        let lanes = Lanes::builder(Recorder::default())
            .clock(clock.clone())
            .build()
            .unwrap();
        let deadline = clock.now() + Duration::from_millis(10);
        let l = lanes.clone();
        let leader = thread::spawn(move || block_on(l.execute(0, 1)));
        let l = lanes.clone();
        let timed = thread::spawn(move || block_on(l.execute_with_deadline(0, 2, deadline)));
        clock.advance(Duration::from_millis(20));
        assert_eq!(leader.join().unwrap().unwrap(), 10);
        let withdrawn = match timed.join().unwrap() {
            Ok(out) => {
                assert_eq!(out, 20);
                false
            }
            Err(LaneError::Withdrawn(cmd)) => {
                assert_eq!(cmd, 2, "the withdrawn command is handed back");
                true
            }
            Err(e) => panic!("unexpected {e:?}"),
        };
        let ran = check_end(&lanes);
        assert_eq!(count(&ran, 1), 1);
        assert_eq!(count(&ran, 2), usize::from(!withdrawn));
        OUTCOMES[usize::from(withdrawn)].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    });
    // The exploration reached both outcomes (counted outside loom's view).
    for (i, n) in OUTCOMES.iter().enumerate() {
        assert!(
            n.load(std::sync::atomic::Ordering::Relaxed) > 0,
            "outcome {i} never explored"
        );
    }
}

/// Ran / withdrawn counts over the withdrawal model's executions.
static OUTCOMES: [StdCounter; 2] = [StdCounter::new(0), StdCounter::new(0)];

/// Dropped command never ran / ran; over the drop model's executions.
static DROPPED_RAN: [StdCounter; 2] = [StdCounter::new(0), StdCounter::new(0)];

/// A caller polls its command once — possibly leading and suspending the
/// kernel mid-batch — and drops its future, while another caller of the key
/// runs to completion. The other caller always gets its output; the dropped
/// command ran once (if its batch had started) or never; no batch is left
/// half-run (a batch whose callers all left is finished by the next caller
/// of the key, or by `close`).
#[test]
fn caller_drop_mid_batch() {
    loom::model(|| {
        let lanes = Lanes::builder(Recorder::default()).build().unwrap();
        let l = lanes.clone();
        let dropper = thread::spawn(move || {
            let mut fut = pin!(l.execute(0, 1));
            let mut cx = Context::from_waker(Waker::noop());
            // Pending: queued, or leading a batch suspended in the kernel.
            // Ready: the other caller led a batch with it and finished that
            // batch between this caller's entering and its first step.
            if let Poll::Ready(out) = fut.as_mut().poll(&mut cx) {
                assert_eq!(out.unwrap(), 10);
            }
        });
        assert_eq!(block_on(lanes.execute(0, 2)).unwrap(), 20);
        dropper.join().unwrap();
        // If the dropped caller led a batch after the other had finished,
        // nobody is left to drive it: `close` does (no timeout, no timer).
        assert!(block_on(lanes.close(Duration::MAX)));
        let ran = check_end(&lanes);
        assert!(count(&ran, 1) <= 1);
        assert_eq!(count(&ran, 2), 1);
        DROPPED_RAN[count(&ran, 1)].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    });
    assert_explored(&DROPPED_RAN);
}

/// Outcomes of `close_vs_execute` seen: the command ran, or was refused.
static CLOSE_RACE: [StdCounter; 2] = [StdCounter::new(0), StdCounter::new(0)];

/// A caller enters a command while the lanes close. The command either
/// runs once (its caller gets the output, and `close` waited for it) or
/// is refused with the command handed back and never reaches the kernel.
/// Once `close` has returned, nothing counts in flight, even while the
/// refused caller is still on its way out: a refused command is never
/// counted (a count taken and given back would show here).
#[test]
fn close_vs_execute() {
    loom::model(|| {
        let lanes = Lanes::builder(Recorder::default()).build().unwrap();
        let l = lanes.clone();
        let caller = thread::spawn(move || block_on(l.execute(0, 1)));
        assert!(block_on(lanes.close(Duration::MAX)));
        assert_eq!(lanes.in_flight(), 0, "a refused command was counted");
        let out = caller.join().unwrap();
        let ran = check_end(&lanes);
        match out {
            Ok(v) => {
                assert_eq!(v, 10);
                assert_eq!(ran, vec![1]);
                CLOSE_RACE[0].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            Err(LaneError::Closed(c)) => {
                assert_eq!(c, 1, "the refused command is handed back");
                assert!(ran.is_empty(), "a refused command reached the kernel");
                CLOSE_RACE[1].fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            Err(e) => panic!("neither ran nor refused: {e:?}"),
        }
    });
    assert_explored(&CLOSE_RACE);
}
