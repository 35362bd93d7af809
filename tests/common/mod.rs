//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Waits (without asserting on time) until `cond` holds; fails the test if it
/// never does within a generous bound.
pub fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cond() {
        assert!(Instant::now() < deadline, "never happened: {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A one-shot gate a handler can block on until the test opens it.
#[derive(Clone, Default)]
pub struct Gate(Arc<(Mutex<bool>, Condvar)>);

impl Gate {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn open(&self) {
        *self.0 .0.lock().unwrap() = true;
        self.0 .1.notify_all();
    }
    pub fn wait(&self) {
        let mut open = self.0 .0.lock().unwrap();
        while !*open {
            open = self.0 .1.wait(open).unwrap();
        }
    }
}

/// Counts live instances: construct with `Tracked::new(&counter)`.
pub struct Tracked {
    live: Arc<AtomicUsize>,
    pub value: u64,
}

impl Tracked {
    pub fn new(live: &Arc<AtomicUsize>, value: u64) -> Self {
        live.fetch_add(1, Ordering::SeqCst);
        Tracked {
            live: live.clone(),
            value,
        }
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Number of live threads of this process whose name starts with `prefix`.
pub fn threads_named(prefix: &str) -> usize {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    dir.filter_map(|e| e.ok())
        .filter_map(|e| std::fs::read_to_string(e.path().join("comm")).ok())
        .filter(|name| name.trim_end().starts_with(prefix))
        .count()
}
