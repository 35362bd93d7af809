//! What idle components hold: bytes requested from the allocator (counted
//! by a `#[global_allocator]` wrapper around `System`) by dispatchers and
//! receivers that ran messages and went idle, and by ones that were
//! dropped. DESIGN.md: an idle dispatcher (its default receiver included)
//! costs at most 16 KiB + 1 KiB per worker, an idle receiver at most 8 KiB
//! whatever the worker count, and a dropped one leaves nothing once its
//! messages ended.
//!
//! A dispatcher makes its port on a worker when that worker first gets one
//! of its messages, and keeps it while it lives (an inbox block, the slot
//! it lends to messages, its lock): about 3 KiB a port for small messages.
//! So one whose messages ran on every worker is held to 16 KiB + 3 KiB per
//! worker.
//!
//! The figures are exact and repeatable (requested bytes, not RSS), so the
//! bounds are asserted. Everything runs in one test function: the counter
//! is process-wide, and a second test running beside it would count too.
//! `KEYED_MEMORY_REPORT=1` prints the figures (BENCHMARKS.md's row is made
//! from them, at 2, 16 and 64 workers: `KEYED_MEMORY_WORKERS=2,16,64`).

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering::Relaxed};
use std::time::Duration;

use keyed_executor::{handler, Dispatcher, KeyedExecutor, Receiver};

struct Counting;

static NET: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every method forwards to `System` with the caller's arguments and
// returns its result unchanged; the counting touches one atomic.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            NET.fetch_add(layout.size() as isize, Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            NET.fetch_add(layout.size() as isize, Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as is.
        unsafe { System.dealloc(ptr, layout) };
        NET.fetch_sub(layout.size() as isize, Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded as is.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            NET.fetch_add(new_size as isize - layout.size() as isize, Relaxed);
        }
        p
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// What the executor's own buffers may move by between two readings (see
/// the dropped-components checks).
const DROPPED_SLACK: isize = 4096;

/// The tests of this file count every allocation of the process, so they
/// run one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn net() -> isize {
    NET.load(Relaxed)
}

/// Lets the workers finish what follows a message's end (a mailbox going
/// back to its port, credit given back) and settle.
fn settle(executor: &KeyedExecutor) {
    for _ in 0..1000 {
        let stats = executor.stats();
        if stats.live_mailboxes == 0 && stats.workers.iter().all(|w| w.queued_tasks == 0) {
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(20));
}

type D = Dispatcher<u64, u64, u64>;

fn dispatcher(executor: &KeyedExecutor) -> D {
    executor.dispatcher(handler::from_fn(|k: &u64, m: u64| k + m))
}

/// Runs `n` messages through `receiver` (spread over keys, so over
/// workers) and waits for each.
fn run(receiver: &Receiver<u64, u64, u64>, n: u64) {
    let done: Vec<_> = (0..n)
        .map(|i| {
            receiver
                .submit_blocking(i.wrapping_mul(0x9e37_79b9), i)
                .unwrap()
        })
        .collect();
    for d in done {
        d.wait().unwrap();
    }
}

/// What `round` leaves held once the executor settles, over four rounds,
/// keeping the least any round after the first left: a round may grow what
/// the executor keeps for good (its workers' run queues, the registry of
/// sources), more often on a loaded machine, while a leak shows in every
/// round.
fn least_left(executor: &KeyedExecutor, mut round: impl FnMut()) -> isize {
    let mut least = isize::MAX;
    for n in 0..4 {
        let before = net();
        round();
        settle(executor);
        if n > 0 {
            least = least.min(net() - before);
        }
    }
    least
}

struct Figures {
    dispatcher: f64,
    busy_dispatcher: f64,
    receiver: f64,
    tracked_receiver: f64,
    dropped_receivers: isize,
    dropped_dispatchers: isize,
}

fn measure(workers: usize) -> Figures {
    const DISPATCHERS: usize = 500;
    const RECEIVERS: usize = 2000;
    let executor = KeyedExecutor::builder().workers(workers).build().unwrap();
    // Warm up: what the first dispatcher of an executor pays once (thread
    // locals, the registry's first growth) is not per component.
    {
        let d = dispatcher(&executor);
        let r = d.default_receiver();
        run(&r, 64);
        drop(r);
        drop(d);
        settle(&executor);
    }

    // Idle dispatchers, each with its default receiver, each having run one
    // message.
    let before = net();
    let mut kept = Vec::with_capacity(DISPATCHERS);
    for _ in 0..DISPATCHERS {
        let d = dispatcher(&executor);
        let r = d.default_receiver();
        run(&r, 1);
        kept.push((d, r));
    }
    settle(&executor);
    let per_dispatcher = (net() - before) as f64 / DISPATCHERS as f64;

    // Idle receivers of one dispatcher, each having accepted and finished
    // messages spread over the workers.
    let d = dispatcher(&executor);
    let before = net();
    let mut receivers = Vec::with_capacity(RECEIVERS);
    for _ in 0..RECEIVERS {
        let r = d.receiver(256).unwrap();
        run(&r, 4);
        receivers.push(r);
    }
    settle(&executor);
    let per_receiver = (net() - before) as f64 / RECEIVERS as f64;
    drop(receivers);

    // The same, tracking commits.
    let before = net();
    let mut receivers = Vec::with_capacity(RECEIVERS);
    for _ in 0..RECEIVERS {
        let r = d
            .receiver_builder()
            .max_in_flight(256)
            .track_commits(true)
            .build()
            .unwrap();
        run(&r, 4);
        assert_eq!(r.committable(), Some(4));
        receivers.push(r);
    }
    settle(&executor);
    let per_tracked_receiver = (net() - before) as f64 / RECEIVERS as f64;
    drop(receivers);

    // Idle dispatchers whose messages ran on every worker.
    let before = net();
    let mut busy = Vec::with_capacity(DISPATCHERS / 10);
    for _ in 0..DISPATCHERS / 10 {
        let d = dispatcher(&executor);
        let r = d.default_receiver();
        run(&r, 8 * workers as u64);
        busy.push((d, r));
    }
    settle(&executor);
    let per_busy_dispatcher = (net() - before) as f64 / (DISPATCHERS / 10) as f64;
    drop(busy);
    drop(kept);
    settle(&executor);

    // Receivers made, used and dropped: nothing left.
    let dropped_receivers = least_left(&executor, || {
        for i in 0..10_000u64 {
            let r = d
                .receiver_builder()
                .max_in_flight(64)
                .track_commits(i % 2 == 0)
                .build()
                .unwrap();
            if i % 10 == 0 {
                run(&r, 2);
            }
        }
    });

    // Dispatchers made, used on every worker and dropped: nothing left.
    let dropped_dispatchers = least_left(&executor, || {
        for i in 0..1_000u64 {
            let d = dispatcher(&executor);
            if i % 10 == 0 {
                run(&d.default_receiver(), 8 * workers as u64);
            }
        }
    });

    drop(d);
    assert!(executor.shutdown(Duration::from_secs(30)));
    Figures {
        dispatcher: per_dispatcher,
        busy_dispatcher: per_busy_dispatcher,
        receiver: per_receiver,
        tracked_receiver: per_tracked_receiver,
        dropped_receivers,
        dropped_dispatchers,
    }
}

#[test]
fn idle_components_cost_little_and_dropped_ones_nothing() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let workers: Vec<usize> = std::env::var("KEYED_MEMORY_WORKERS")
        .ok()
        .map(|s| s.split(',').map(|w| w.trim().parse().unwrap()).collect())
        .unwrap_or_else(|| vec![2, 16]);
    let report = std::env::var_os("KEYED_MEMORY_REPORT").is_some();
    let mut failures = Vec::new();
    for w in workers {
        let f = measure(w);
        let dispatcher_bound = (16 + w) as f64 * 1024.0;
        let busy_dispatcher_bound = (16 + 3 * w) as f64 * 1024.0;
        let receiver_bound = 8.0 * 1024.0;
        if report {
            println!(
                "workers {w:>3}: idle dispatcher {:.0} B (bound {dispatcher_bound:.0}), after \
                 running on every worker {:.0} B (bound {busy_dispatcher_bound:.0}); idle receiver {:.0} B, tracking commits {:.0} B \
                 (bound {receiver_bound:.0}); dropped: 10,000 receivers {} B, 1,000 dispatchers {} B",
                f.dispatcher,
                f.busy_dispatcher,
                f.receiver,
                f.tracked_receiver,
                f.dropped_receivers,
                f.dropped_dispatchers
            );
        }
        if f.dispatcher > dispatcher_bound {
            failures.push(format!(
                "{w} workers: an idle dispatcher holds {:.0} B, over {dispatcher_bound:.0}",
                f.dispatcher
            ));
        }
        if f.busy_dispatcher > busy_dispatcher_bound {
            failures.push(format!(
                "{w} workers: an idle dispatcher that ran on every worker holds {:.0} B, \
                 over {busy_dispatcher_bound:.0}",
                f.busy_dispatcher
            ));
        }
        if f.tracked_receiver > receiver_bound {
            failures.push(format!(
                "{w} workers: an idle receiver tracking commits holds {:.0} B, over \
                 {receiver_bound:.0}",
                f.tracked_receiver
            ));
        }
        if f.receiver > receiver_bound {
            failures.push(format!(
                "{w} workers: an idle receiver holds {:.0} B, over {receiver_bound:.0}",
                f.receiver
            ));
        }
        // What the executor itself keeps (its workers' queues hold a block
        // or two of task slots, allocated and freed as tasks pass) may
        // move by a block between two readings: a few KiB for 10,000
        // components, where a leak of one word each would be 80 KB.
        if f.dropped_receivers > DROPPED_SLACK {
            failures.push(format!(
                "{w} workers: 10,000 dropped receivers left {} B",
                f.dropped_receivers
            ));
        }
        if f.dropped_dispatchers > DROPPED_SLACK {
            failures.push(format!(
                "{w} workers: 1,000 dropped dispatchers left {} B",
                f.dropped_dispatchers
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A burst of many keys (a backlog drained in one port turn) leaves
/// nothing behind once the worker is out of work: what it grew for the
/// burst (its turn records of a hundred thousand keys) goes, so memory
/// follows the live keys, not the most there ever were.
#[test]
fn a_burst_of_keys_leaves_nothing_behind_once_the_worker_idles() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    const KEYS: u64 = 100_000;
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let gate = std::sync::Arc::new(std::sync::Barrier::new(2));
    let held = std::sync::Arc::clone(&gate);
    let d: D = executor.dispatcher(handler::from_fn(move |k: &u64, m: u64| {
        if m == u64::MAX {
            held.wait(); // the first message holds the worker until the burst is in
        }
        k.wrapping_add(m)
    }));
    let r = d
        .receiver_builder()
        .max_in_flight(KEYS as usize + 1)
        .build()
        .unwrap();
    let burst = |keys: u64| {
        let first = r.submit_blocking(u64::MAX, u64::MAX).unwrap();
        let done: Vec<_> = (0..keys)
            .map(|k| r.submit_blocking(k, 1).unwrap())
            .collect();
        gate.wait();
        first.wait().unwrap();
        for c in done {
            c.wait().unwrap();
        }
        settle(&executor);
    };
    // Warm up with a small burst: what any burst makes once (the port, its
    // inbox, the worker's queues) is there before measuring.
    burst(1_000);
    let before = net();
    burst(KEYS);
    let left = net() - before;
    assert!(
        left <= 256 * 1024,
        "a burst of {KEYS} keys left {left} B behind once the worker idled"
    );
    drop(r);
    drop(d);
    assert!(executor.shutdown(Duration::from_secs(30)));
}

/// A burst of keys whose futures each suspend once (so every key gets a
/// mailbox), on two workers, all waited for: once the workers idle, what
/// stays held is bounded by a constant, not by the burst's size (the
/// ports' key maps shrink, spare mailboxes beyond a few go, the inbox
/// keeps one spare block). Before, 20-40 bytes stayed for every key gone.
#[test]
fn a_burst_of_suspending_keys_gives_its_memory_back() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let report = std::env::var_os("KEYED_MEMORY_REPORT").is_some();
    let executor = KeyedExecutor::builder().workers(2).build().unwrap();
    let d: D = executor.dispatcher(handler::from_async_fn(|k: u64, m: u64| async move {
        common::YieldOnce(false).await;
        k.wrapping_add(m)
    }));
    let burst = |keys: u64| {
        let r = d
            .receiver_builder()
            .max_in_flight(keys as usize)
            .build()
            .unwrap();
        let peak_before = net();
        let done: Vec<_> = (0..keys)
            .map(|k| {
                r.submit_blocking(k.wrapping_mul(0x9e37_79b9_7f4a_7c15), 1)
                    .unwrap()
            })
            .collect();
        let queued = net() - peak_before;
        for c in done {
            c.wait().unwrap();
        }
        drop(r);
        settle(&executor);
        queued
    };
    // What any burst makes once (ports, inbox blocks, queues) is made here.
    burst(2_000);
    let before = net();
    let grown = burst(20_000);
    let small = net() - before;
    // Two bursts of 200,000, keeping the lesser leftover: what one burst
    // leaves in flight on a loaded machine (a run queue's buffer not yet
    // shrunk, a block another burst will free) moves by a few hundred KB
    // between readings either way, where the leak this guards against held
    // 20-40 bytes for every key (4-8 MB).
    let (mut peak, mut left) = (0, isize::MAX);
    for _ in 0..2 {
        let before = net();
        peak = burst(200_000);
        left = left.min(net() - before);
    }
    if report {
        eprintln!(
            "burst of suspending keys: 20,000 keys grew {grown} B, left {small} B; \
             200,000 keys grew {peak} B, left {left} B ({:.1} B a key)",
            left as f64 / 200_000.0
        );
    }
    assert!(
        left <= 256 * 1024,
        "a burst of 200,000 suspending keys left {left} B behind once the workers idled \
         ({:.1} B a key)",
        left as f64 / 200_000.0
    );
    drop(d);
    assert!(executor.shutdown(Duration::from_secs(30)));
}
