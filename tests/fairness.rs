//! The fairness bound whatever the backlog: a key waiting for a worker runs
//! after at most one turn (`throughput` messages, or up to a suspension) of
//! each busier key of the same worker — however many messages are queued
//! ahead of it, in mailboxes or in the worker's inbox, sync or async.
//!
//! Every test holds the one worker with a "gate" message, queues a backlog
//! of hot keys' messages and then one message of a cold key behind it, and
//! releases the gate: all of it waits when the worker frees up. The
//! backlogs (100, 1,000, 10,000) are longer than what a worker takes from
//! its inbox in one go.

mod common;

use std::sync::{mpsc, Arc, Mutex};

use common::{Gate, YieldOnce};
use keyed_executor::{handler, Completion, KeyedExecutor, Receiver};

const THROUGHPUT: usize = 4;
const GATE: u32 = u32::MAX;
const COLD: u32 = 1_000_000;

/// What a handler records: a message of `key` started (its first poll).
type Log = Arc<Mutex<Vec<u32>>>;

/// How the hot keys' messages are laid out in the backlog.
#[derive(Clone, Copy, Debug)]
enum Layout {
    /// Round-robin: key 0, 1, …, 0, 1, …
    Interleaved,
    /// Each key's messages together: all of key 0, then all of key 1, …
    Blocks,
}

/// The kind of handler.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kind {
    Sync,
    /// An async handler whose future completes at its first poll.
    AsyncReady,
    /// An async handler whose future wakes itself and suspends once.
    AsyncYield,
}

/// One worker, throughput 4, a receiver with room for the whole backlog.
/// The gate message blocks the worker in its handler until `gate` opens.
fn setup(
    kind: Kind,
    credit: usize,
    gate: &Gate,
    log: &Log,
) -> (KeyedExecutor, Receiver<u32, u32, ()>, mpsc::Receiver<()>) {
    let executor = KeyedExecutor::builder()
        .workers(1)
        .throughput(THROUGHPUT)
        .build()
        .unwrap();
    let (started_tx, started_rx) = mpsc::channel::<()>();
    let started_tx = Mutex::new(started_tx);
    let (g, o) = (gate.clone(), log.clone());
    let receiver = match kind {
        Kind::Sync => executor
            .dispatcher(handler::from_fn(move |key: &u32, _: u32| {
                if *key == GATE {
                    started_tx.lock().unwrap().send(()).unwrap();
                    g.wait();
                    return;
                }
                o.lock().unwrap().push(*key);
            }))
            .receiver(credit)
            .unwrap(),
        Kind::AsyncReady | Kind::AsyncYield => {
            let started_tx = Arc::new(started_tx);
            executor
                .dispatcher(handler::from_async_fn(move |key: u32, _: u32| {
                    let (g, o, started_tx) = (g.clone(), o.clone(), started_tx.clone());
                    async move {
                        if key == GATE {
                            started_tx.lock().unwrap().send(()).unwrap();
                            // Blocks the worker in the future's first poll.
                            g.wait();
                            return;
                        }
                        o.lock().unwrap().push(key);
                        if kind == Kind::AsyncYield {
                            YieldOnce(false).await;
                        }
                    }
                }))
                .receiver(credit)
                .unwrap()
        }
    };
    (executor, receiver, started_rx)
}

/// Holds the worker, queues `backlog` messages of `hot` keys (laid out as
/// `layout`) and then one of the cold key, releases the worker, and
/// returns the keys in the order their messages started.
fn run(kind: Kind, hot: u32, backlog: usize, layout: Layout) -> Vec<u32> {
    let gate = Gate::new();
    let log: Log = Arc::new(Mutex::new(Vec::new()));
    let (executor, r, started) = setup(kind, backlog + 8, &gate, &log);
    let gate_done = r.submit_blocking(GATE, 0).unwrap();
    // The worker is held: everything below waits when it frees up.
    started.recv().unwrap();
    let per_key = backlog / hot as usize;
    let mut handles: Vec<Completion<(), u32>> = Vec::with_capacity(backlog + 1);
    for i in 0..backlog {
        let key = match layout {
            Layout::Interleaved => i as u32 % hot,
            Layout::Blocks => (i / per_key).min(hot as usize - 1) as u32,
        };
        handles.push(r.submit_blocking(key, i as u32).unwrap());
    }
    handles.push(r.submit_blocking(COLD, 0).unwrap());
    gate.open();
    gate_done.wait().unwrap();
    for h in handles {
        h.wait().unwrap();
    }
    assert!(executor.shutdown(std::time::Duration::from_secs(30)));
    let order = std::mem::take(&mut *log.lock().unwrap());
    assert_eq!(order.len(), backlog + 1);
    order
}

/// Checks the bound: before the cold key's message started, each hot key
/// started at most `turn` messages (one turn).
fn bound(order: &[u32], hot: u32, turn: usize, what: &str) -> Result<(), String> {
    let cold = order
        .iter()
        .position(|k| *k == COLD)
        .expect("the cold key ran");
    for key in 0..hot {
        let before = order[..cold].iter().filter(|k| **k == key).count();
        if before > turn {
            return Err(format!(
                "{what}: hot key {key} started {before} messages before the cold key \
                 (one turn is {turn}); the cold key started {}th; the first keys: {:?}",
                cold + 1,
                &order[..(cold + 1).min(40)]
            ));
        }
    }
    Ok(())
}

/// One run; `Err` says how the bound failed.
fn check(kind: Kind, hot: u32, backlog: usize, layout: Layout) -> Result<(), String> {
    let order = run(kind, hot, backlog, layout);
    let what = format!("{kind:?}, {hot} hot keys, backlog {backlog}, {layout:?}");
    match kind {
        Kind::Sync | Kind::AsyncReady => {
            bound(&order, hot, THROUGHPUT, &what)?;
            // Each hot key has a full turn's worth queued ahead of the cold
            // key: the cold key starts right after those turns.
            let cold = order.iter().position(|k| *k == COLD).unwrap();
            if cold != hot as usize * THROUGHPUT {
                return Err(format!("{what}: the cold key started {}th", cold + 1));
            }
            Ok(())
        }
        // A turn of a key whose messages suspend ends at the suspension.
        Kind::AsyncYield => bound(&order, hot, 1, &what),
    }
}

/// Runs every case and fails with all the failures, not only the first.
fn all(cases: &[(Kind, u32, Layout)]) {
    let mut failed = Vec::new();
    for backlog in [100, 1_000, 10_000] {
        for &(kind, hot, layout) in cases {
            if let Err(e) = check(kind, hot, backlog, layout) {
                failed.push(e);
            }
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

#[test]
fn a_cold_key_runs_fifth_behind_100_messages_of_a_hot_key() {
    let order = run(Kind::Sync, 1, 100, Layout::Blocks);
    assert_eq!(
        order.iter().position(|k| *k == COLD),
        Some(4),
        "the cold key ran after more than one turn of the hot key: {:?}",
        &order[..12]
    );
}

#[test]
fn one_hot_key_backlogs_of_100_1000_10000() {
    all(&[(Kind::Sync, 1, Layout::Blocks)]);
}

#[test]
fn several_hot_keys_interleaved_backlogs_of_100_1000_10000() {
    all(&[(Kind::Sync, 4, Layout::Interleaved)]);
}

#[test]
fn several_hot_keys_in_blocks_backlogs_of_100_1000_10000() {
    all(&[(Kind::Sync, 3, Layout::Blocks)]);
}

#[test]
fn async_futures_ready_at_their_first_poll_backlogs_of_100_1000_10000() {
    all(&[
        (Kind::AsyncReady, 1, Layout::Blocks),
        (Kind::AsyncReady, 4, Layout::Interleaved),
    ]);
}

#[test]
fn async_futures_that_suspend_once_backlogs_of_100_1000_10000() {
    all(&[
        (Kind::AsyncYield, 1, Layout::Blocks),
        (Kind::AsyncYield, 4, Layout::Interleaved),
        (Kind::AsyncYield, 3, Layout::Blocks),
    ]);
}
