//! A simulated event store for the group-commit benchmark
//! (`benches/group_commit.rs`) and its quick table
//! (`examples/lanes_group_commit.rs`).
//!
//! The store is one device thread: each append takes [`APPEND`] of
//! (sleeping) time whatever its size, then completes a oneshot that wakes the
//! awaiting kernel future. So commands/s is bounded by
//! `batch size / append time`, and group commit is the only way past
//! `1 / append time`.
#![allow(dead_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use futures::channel::oneshot;
use keyed_executor::lanes::{BatchResult, Kernel, Lanes};

/// What one append costs, whatever its size.
pub const APPEND: Duration = Duration::from_millis(1);

struct Append {
    done: oneshot::Sender<()>,
}

/// The simulated store: one device thread, one append at a time.
pub struct SimStore {
    device: Mutex<mpsc::Sender<Append>>,
    pub appends: AtomicU64,
    pub commands: AtomicU64,
    /// Total nanoseconds the device spent appending.
    pub busy_nanos: Arc<AtomicU64>,
}

impl SimStore {
    pub fn new() -> Self {
        let (tx, rx) = mpsc::channel::<Append>();
        let busy_nanos = Arc::new(AtomicU64::new(0));
        let busy = Arc::clone(&busy_nanos);
        thread::Builder::new()
            .name("sim-store".into())
            .spawn(move || {
                for append in rx {
                    let t = Instant::now();
                    thread::sleep(APPEND);
                    busy.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    let _ = append.done.send(());
                }
            })
            .expect("spawn the simulated store");
        SimStore {
            device: Mutex::new(tx),
            appends: AtomicU64::new(0),
            commands: AtomicU64::new(0),
            busy_nanos,
        }
    }
}

impl Kernel for SimStore {
    type Key = u32;
    type Command = u64;
    type Output = u64;
    type Error = String;

    async fn execute_batch(&self, _key: &u32, commands: Vec<u64>) -> BatchResult<u64, u64, String> {
        // Decide every command (trivially), then append them all at once.
        let (done, appended) = oneshot::channel();
        self.device
            .lock()
            .unwrap()
            .send(Append { done })
            .expect("store thread alive");
        appended.await.expect("store thread alive");
        self.appends.fetch_add(1, Ordering::Relaxed);
        self.commands
            .fetch_add(commands.len() as u64, Ordering::Relaxed);
        BatchResult::committed(commands.into_iter().map(Ok).collect())
    }
}

/// One measured run.
#[derive(Debug, Clone, Copy)]
pub struct Run {
    pub elapsed: Duration,
    pub commands: u64,
    pub appends: u64,
    pub append_time: Duration,
}

impl Run {
    pub fn per_sec(&self) -> f64 {
        self.commands as f64 / self.elapsed.as_secs_f64()
    }

    pub fn mean_batch(&self) -> f64 {
        self.commands as f64 / self.appends as f64
    }
}

/// `callers` tasks on one key, each running `per_caller` commands in a
/// row, on a 2-worker tokio runtime.
pub fn run(rt: &tokio::runtime::Runtime, callers: usize, max_batch: usize, per_caller: u64) -> Run {
    let lanes = Lanes::builder(SimStore::new())
        .max_batch(max_batch)
        .lane_capacity(callers.max(1))
        .build()
        .expect("valid settings");
    let start = Instant::now();
    rt.block_on(async {
        let tasks: Vec<_> = (0..callers as u64)
            .map(|c| {
                let lanes = lanes.clone();
                tokio::spawn(async move {
                    for i in 0..per_caller {
                        let cmd = c * 1_000_000 + i;
                        let out = lanes.execute(0, cmd).await.expect("no refusals here");
                        debug_assert_eq!(out, cmd);
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.expect("caller task");
        }
    });
    let elapsed = start.elapsed();
    let store = lanes.kernel();
    let appends = store.appends.load(Ordering::Relaxed);
    Run {
        elapsed,
        commands: store.commands.load(Ordering::Relaxed),
        appends,
        append_time: Duration::from_nanos(
            store.busy_nanos.load(Ordering::Relaxed) / appends.max(1),
        ),
    }
}

pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .expect("tokio runtime")
}
