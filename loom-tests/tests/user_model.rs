#![cfg(loom)]
//! Checking *your own* code with the executor inside a loom model: the
//! worked example of README's "Checking your own code with loom".
//!
//! Under `RUSTFLAGS="--cfg loom"` keyed-executor builds on loom's atomics,
//! locks, threads and `Arc` (its `sync` shim), so a loom model that creates
//! an executor runs the crate's real code — its workers, credit, stops and
//! wake-ups — interleaved with yours, every schedule within the preemption
//! bound. This file uses the public API only, as a crate of yours would
//! (see the README for the `Cargo.toml` lines and the limits).
//!
//! The code under test: an order saga. A handler that places an order
//! forwards the `Ship` step to the warehouse's key through its own
//! receiver. The property: when the receiver shuts down while orders are
//! being placed, no order is lost — each is shipped, or (its follow-up
//! refused because the receiver closed) kept in the saga's outbox to be
//! sent again after a restart; none both, none twice.
//!
//! `forward_on_shutdown_careless` is the same handler with the refusal
//! ignored (`let _ = rx.send(..)`): loom finds the schedule that loses an
//! order (the stop closes the receiver between the order's placement and
//! its forward) and the model fails — the test expects that failure.
//!
//! ```text
//! RUSTFLAGS="--cfg loom -C debug_assertions" LOOM_MAX_PREEMPTIONS=2 \
//!     cargo test -p loom-tests --release --target-dir target/loom --test user_model -- --nocapture
//! ```

use std::collections::hash_map::DefaultHasher;
use std::hash::BuildHasherDefault;
use std::sync::atomic::{AtomicUsize as StdCounter, Ordering::Relaxed};
use std::time::{Duration, Instant};

use keyed_executor::{handler, KeyedExecutor, Receiver};
// Your state, shared with the executor's threads: loom's types, so that
// loom sees (and interleaves) every access to it.
use loom::sync::{Arc, Mutex};
use loom::thread;

// ----- the code under test ---------------------------------------------------

/// The warehouse's key; orders use their own number as their key.
const WAREHOUSE: u32 = 0;

#[derive(Debug)]
enum Step {
    Place(u32),
    Ship(u32),
}

/// The saga's state: orders shipped, and follow-ups the executor refused
/// (to send again after a restart).
#[derive(Default)]
struct Saga {
    shipped: Mutex<Vec<u32>>,
    outbox: Mutex<Vec<u32>>,
}

/// The handler's way back to its own dispatcher. (Outside loom a
/// `WeakReceiver` does this without a reference cycle; loom has no `Weak`,
/// so under loom the crate has no `downgrade`: the slot is emptied when the
/// saga ends, which breaks the cycle.)
type Me = Arc<Mutex<Option<Receiver<u32, Step, ()>>>>;

/// The saga's handler. `careful`: a refused follow-up goes to the outbox;
/// careless: it is ignored (the bug the model finds).
fn saga_handler(
    saga: Arc<Saga>,
    me: Me,
    careful: bool,
) -> impl handler::Handler<u32, Step, Output = ()> {
    handler::from_fn(move |_key: &u32, step: Step| match step {
        Step::Place(order) => {
            let rx = me.lock().unwrap().clone();
            let Some(rx) = rx else { return };
            // From a handler a send never waits for credit: it is taken,
            // or refused (`Full`, `Closed`) with the message handed back.
            if let Err(refused) = rx.send(WAREHOUSE, Step::Ship(order)) {
                if careful {
                    let Step::Ship(order) = refused.into_inner() else {
                        unreachable!()
                    };
                    saga.outbox.lock().unwrap().push(order);
                }
            }
        }
        Step::Ship(order) => saga.shipped.lock().unwrap().push(order),
    })
}

// ----- the model -------------------------------------------------------------

/// How often each ending was reached over a model's executions (shipped,
/// kept in the outbox, placement refused): a model that never reaches a
/// branch it asserts on proves nothing about it. One per test: the tests
/// of a file run at once.
type Endings = [StdCounter; 3];
#[allow(clippy::declare_interior_mutable_const)]
const ZERO: StdCounter = StdCounter::new(0);
static ONE_WORKER: Endings = [ZERO; 3];
static TWO_WORKERS: Endings = [ZERO; 3];
static CARELESS: Endings = [ZERO; 3];

/// `workers` workers; order 1 is placed (main thread) while another thread
/// shuts the receiver down gracefully. Afterwards: order 1 was shipped
/// once, or is in the outbox once, or its placement itself was refused
/// (`Closed`, handed back to the caller) — exactly one of the three.
fn forward_on_shutdown(workers: usize, careful: bool, seen: &Endings) {
    let saga = Arc::new(Saga::default());
    let me: Me = Arc::default();
    let executor = KeyedExecutor::builder()
        .workers(workers)
        // Keeps the model small: work conservation's idle watch adds
        // scheduling points to every idle period (see the README).
        .work_conservation(false)
        .build()
        .unwrap();
    let dispatcher = executor
        .dispatcher_builder(saga_handler(saga.clone(), me.clone(), careful))
        // Loom replays each execution: the key's route must not depend on
        // a random hash seed.
        .hasher(BuildHasherDefault::<DefaultHasher>::default())
        .build();
    let receiver = dispatcher.receiver(2).unwrap();
    *me.lock().unwrap() = Some(receiver.clone());

    let stopper = {
        let receiver = receiver.clone();
        thread::spawn(move || {
            // Under loom a timed wait never times out: a drain that
            // cannot finish is reported as a deadlock, not as `false`.
            assert!(receiver.shutdown(Duration::from_secs(3600)));
        })
    };
    let placed = receiver.send(1, Step::Place(1)).is_ok();
    // The main thread waited for nothing in the crate (the credit was
    // free), so it may join: see the README on `join` under loom.
    stopper.join().unwrap();
    assert!(executor.shutdown(Duration::from_secs(3600)));
    me.lock().unwrap().take(); // the end of the saga: breaks the cycle

    let shipped = saga.shipped.lock().unwrap().clone();
    let outbox = saga.outbox.lock().unwrap().clone();
    let ending = match (placed, shipped.as_slice(), outbox.as_slice()) {
        (true, [1], []) => 0,
        (true, [], [1]) => 1,
        (false, [], []) => 2,
        _ => panic!(
            "order 1 lost or doubled: placed {placed}, shipped {shipped:?}, outbox {outbox:?}"
        ),
    };
    seen[ending].fetch_add(1, Relaxed);
}

/// `loom::model`, printing how many executions it explored and how long
/// that took; `preemptions` overrides `LOOM_MAX_PREEMPTIONS`.
fn model(name: &str, preemptions: Option<usize>, f: impl Fn() + Sync + Send + 'static) {
    let runs = std::sync::Arc::new(StdCounter::new(0));
    let counted = runs.clone();
    let start = Instant::now();
    let mut builder = loom::model::Builder::new();
    if preemptions.is_some() {
        builder.preemption_bound = preemptions;
    }
    builder.check(move || {
        counted.fetch_add(1, Relaxed);
        f();
    });
    eprintln!(
        "model {name}: {} executions in {:.1?} (at most {:?} preemptions)",
        runs.load(Relaxed),
        start.elapsed(),
        builder.preemption_bound,
    );
}

fn assert_reached(seen: &Endings) {
    for (ending, n) in ["shipped", "kept in the outbox", "placement refused"]
        .iter()
        .zip(seen)
    {
        let n = n.load(Relaxed);
        eprintln!("  {ending}: {n} executions");
        assert!(n > 0, "never reached: {ending}");
    }
}

#[test]
fn forward_on_shutdown_loses_nothing_one_worker() {
    model("forward_on_shutdown_loses_nothing_one_worker", None, || {
        forward_on_shutdown(1, true, &ONE_WORKER)
    });
    assert_reached(&ONE_WORKER);
}

/// Two workers multiply the executions: within two preemptions this model
/// explores 323,902 of them (147 s here), within one 3,831 (1.2 s). CI
/// runs it within one.
#[test]
fn forward_on_shutdown_loses_nothing_two_workers() {
    model(
        "forward_on_shutdown_loses_nothing_two_workers",
        Some(1),
        || forward_on_shutdown(2, true, &TWO_WORKERS),
    );
    assert_reached(&TWO_WORKERS);
}

/// The careless handler: loom finds the order it loses.
#[test]
#[should_panic(expected = "order 1 lost")]
fn forward_on_shutdown_careless() {
    model("forward_on_shutdown_careless", None, || {
        forward_on_shutdown(1, false, &CARELESS)
    });
}
