//! Bad input and misuse: each gets a clear error or a documented behaviour,
//! and nothing is lost, leaked or wedged.

mod common;

use std::collections::HashMap;
use std::future::Future;
use std::hash::{Hash, Hasher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::task::{Poll, Waker};
use std::time::Duration;

use common::*;
use keyed_executor::lanes::{BatchResult, Kernel, LaneError, Lanes};
use keyed_executor::limit::InFlightLimit;
use keyed_executor::{
    handler, ConfigError, KeyedExecutor, Receiver, SubmitError, TaskError, MAX_SPIN,
};

const LONG: Duration = Duration::from_secs(30);

/// A message that counts itself alive.
struct Msg(u32, #[allow(dead_code)] Token);

// ----- builders ---------------------------------------------------------------

struct Echo;

impl Kernel for Echo {
    type Key = u32;
    type Command = u32;
    type Output = u32;
    type Error = String;

    async fn execute_batch(&self, _key: &u32, c: Vec<u32>) -> BatchResult<u32, u32, String> {
        BatchResult::committed(c.into_iter().map(Ok).collect())
    }
}

#[test]
fn every_invalid_builder_value_is_a_clear_error_and_starts_nothing() {
    let prefix = unique_prefix("rbad");
    let names = |e: &ConfigError, what: &str| {
        let text = e.to_string();
        assert!(text.contains(what), "{text:?} should name `{what}`");
    };
    let b = || KeyedExecutor::builder().thread_name(prefix.clone());
    let e = b().workers(0).build().unwrap_err();
    assert_eq!(e, ConfigError::ZeroWorkers);
    names(&e, "workers");
    let e = b().throughput(0).build().unwrap_err();
    assert_eq!(e, ConfigError::ZeroThroughput);
    names(&e, "throughput");
    let spin = MAX_SPIN + Duration::from_nanos(1);
    let e = b().spin(spin).build().unwrap_err();
    assert_eq!(
        e,
        ConfigError::SpinTooLong {
            spin,
            max: MAX_SPIN
        }
    );
    names(&e, "spin");
    let e = KeyedExecutor::builder()
        .thread_name("a\0b")
        .build()
        .unwrap_err();
    assert!(matches!(e, ConfigError::InvalidThreadName(ref n) if n == "a\0b"));
    names(&e, "thread_name");
    // A stack the OS cannot give: the spawn error names the thread, and the
    // workers that did start are stopped again.
    let e = b()
        .workers(2)
        .thread_stack_size(1 << 46)
        .build()
        .unwrap_err();
    assert!(
        matches!(e, ConfigError::Spawn { ref name, .. } if name.starts_with(&prefix)),
        "{e:?}"
    );
    eventually("no worker left", || threads_named(&prefix) == 0);

    // Receivers.
    let executor = b().workers(1).build().unwrap();
    let d = executor.dispatcher(handler::from_fn(|_: &u32, m: u32| m));
    let e = d.receiver(0).unwrap_err();
    assert_eq!(e, ConfigError::ZeroMaxInFlight);
    names(&e, "max_in_flight");
    assert!(executor.shutdown(LONG));

    // Lanes.
    let e = Lanes::builder(Echo).lane_capacity(0).build().unwrap_err();
    assert_eq!(e, ConfigError::ZeroLaneCapacity);
    names(&e, "lane_capacity");
    let e = Lanes::builder(Echo).max_batch(0).build().unwrap_err();
    assert_eq!(e, ConfigError::ZeroMaxBatch);
    names(&e, "max_batch");
    let e = Lanes::builder(Echo)
        .limit(InFlightLimit::new(0))
        .build()
        .unwrap_err();
    assert_eq!(e, ConfigError::ZeroInFlightLimit);
    names(&e, "in-flight limit");
    assert_eq!(
        InFlightLimit::try_new(0).unwrap_err(),
        ConfigError::ZeroInFlightLimit
    );
}

// ----- after a stop -----------------------------------------------------------

/// Every submission method refuses with `Closed`, handing back the very
/// message, and keeps nothing.
fn all_methods_refuse(r: &Receiver<u32, Msg, u32>, live: &Live) {
    let before = live.count();
    let check = |res: Result<(), SubmitError<Msg>>, n: u32| match res {
        Err(SubmitError::Closed(m)) => assert_eq!(m.0, n),
        Err(SubmitError::Full(_)) => panic!("method {n}: Full after a stop"),
        Ok(()) => panic!("method {n}: accepted after a stop"),
    };
    check(r.submit_blocking(1, Msg(0, live.token())).map(drop), 0);
    check(r.try_submit(1, Msg(1, live.token())).map(drop), 1);
    check(
        futures::executor::block_on(r.submit(1, Msg(2, live.token()))).map(drop),
        2,
    );
    check(r.send(1, Msg(3, live.token())).map(drop), 3);
    check(r.try_send(1, Msg(4, live.token())).map(drop), 4);
    check(
        futures::executor::block_on(r.send_async(1, Msg(5, live.token()))).map(drop),
        5,
    );
    assert!(r.is_closed());
    assert_eq!(r.in_flight(), 0);
    assert_eq!(live.count(), before, "a refused message was kept");
}

#[test]
fn submitting_after_either_stop_or_the_last_drop_hands_the_message_back() {
    for how in 0..3 {
        let live = Live::new();
        let (executor, prefix) = named_executor("rafter", 2);
        let d = executor.dispatcher(handler::from_fn(|_: &u32, m: Msg| m.0));
        let r = d.receiver(4).unwrap();
        assert_eq!(
            r.submit_blocking(1, Msg(9, live.token()))
                .unwrap()
                .wait()
                .unwrap(),
            9
        );
        match how {
            0 => assert!(executor.shutdown(LONG)),
            1 => executor.shutdown_now(),
            _ => drop(executor),
        }
        all_methods_refuse(&r, &live);
        eventually("workers gone", || threads_named(&prefix) == 0);
        drop((r, d));
        assert_eq!(live.count(), 0);
    }
}

// ----- stopping from inside a handler ----------------------------------------

#[test]
fn shutdown_from_inside_a_handler_starts_the_stop_and_never_deadlocks() {
    for force in [false, true] {
        let (executor, prefix) = named_executor("rins", 1);
        let slot: Arc<Mutex<Option<KeyedExecutor>>> = Arc::new(Mutex::new(None));
        let gate = Gate::new();
        let (s2, g2) = (slot.clone(), gate.clone());
        let rejected_on = Arc::new(Mutex::new(Vec::new()));
        let rj = rejected_on.clone();
        let d = executor
            .dispatcher_builder(handler::from_fn(move |_: &u32, m: u32| {
                if m == 0 {
                    g2.wait();
                    let ex = s2.lock().unwrap().clone().unwrap();
                    // Graceful from a worker cannot wait for itself: it
                    // starts the stop and says false at once.
                    return if force {
                        ex.shutdown_now();
                        1
                    } else {
                        u32::from(ex.shutdown(LONG))
                    };
                }
                m
            }))
            .on_reject(move |_, m| {
                let t = std::thread::current().name().unwrap_or("").to_owned();
                rj.lock().unwrap().push((m, t));
            })
            .build();
        *slot.lock().unwrap() = Some(executor.clone());
        let r = d.receiver(16).unwrap();
        let first = r.submit_blocking(1, 0).unwrap();
        let queued: Vec<_> = (1..5).map(|m| r.submit_blocking(1, m).unwrap()).collect();
        r.send(1, 5).unwrap();
        gate.open();
        if force {
            assert_eq!(
                first.wait().unwrap(),
                1,
                "the stopping message itself finishes"
            );
            for (h, m) in queued.into_iter().zip(1..) {
                assert_eq!(h.wait().unwrap_err().into_message(), Some(m));
            }
            // Handed back on the stopping thread: here, the worker.
            let rej = rejected_on.lock().unwrap().clone();
            assert_eq!(rej.len(), 1);
            assert_eq!(rej[0].0, 5);
            assert!(rej[0].1.starts_with(&prefix), "rejected on {:?}", rej[0].1);
            executor.shutdown_now(); // joins
        } else {
            assert_eq!(
                first.wait().unwrap(),
                0,
                "shutdown from a worker returns false"
            );
            for (h, m) in queued.into_iter().zip(1..) {
                assert_eq!(
                    h.wait().unwrap(),
                    m,
                    "a graceful stop runs what was accepted"
                );
            }
            assert!(executor.shutdown(LONG));
        }
        assert!(executor.is_terminated());
        slot.lock().unwrap().take();
        eventually("workers gone", || threads_named(&prefix) == 0);
    }
}

#[test]
fn the_last_handle_dropped_inside_a_handler_stops_the_pool_without_a_deadlock() {
    let (executor, prefix) = named_executor("rlast", 2);
    let slot: Arc<Mutex<Option<KeyedExecutor>>> = Arc::new(Mutex::new(None));
    let s2 = slot.clone();
    let d = executor.dispatcher(handler::from_fn(move |_: &u32, m: u32| {
        drop(s2.lock().unwrap().take()); // the last `KeyedExecutor`
        m
    }));
    let r = d.receiver(4).unwrap();
    *slot.lock().unwrap() = Some(executor);
    assert_eq!(r.submit_blocking(1, 7).unwrap().wait().unwrap(), 7);
    eventually("workers gone", || threads_named(&prefix) == 0);
    assert!(matches!(r.try_submit(1, 8), Err(SubmitError::Closed(8))));
}

// ----- a handler that blocks its thread ---------------------------------------

#[test]
fn a_handler_blocking_its_thread_stalls_only_itself_and_the_stop_waits_for_it() {
    let (executor, prefix) = named_executor("rblk", 2);
    let gate = Gate::new();
    let inside = Arc::new(AtomicBool::new(false));
    let (g, i) = (gate.clone(), inside.clone());
    let d = executor.dispatcher(handler::from_fn(move |k: &u32, m: u32| {
        if *k == 0 {
            i.store(true, SeqCst);
            g.wait(); // blocks its worker thread
        }
        m
    }));
    let r = d.receiver(64).unwrap();
    let blocked = r.submit_blocking(0, 0).unwrap();
    eventually("the blocker runs", || inside.load(SeqCst));
    let others: Vec<_> = (1..=20).map(|k| r.submit_blocking(k, k).unwrap()).collect();
    // Every other key finishes while the blocker holds its thread: those
    // placed on the blocked worker move to the idle one (work conservation).
    eventually("every other key proceeds", || {
        others.iter().all(|h| h.is_finished())
    });
    // The stop cannot finish while a handler blocks; it does once it returns.
    assert!(!executor.shutdown(Duration::from_millis(50)));
    assert!(!blocked.is_finished());
    gate.open();
    assert!(executor.shutdown(LONG));
    assert_eq!(blocked.wait().unwrap(), 0);
    for (h, k) in others.into_iter().zip(1..) {
        assert_eq!(h.wait().unwrap(), k);
    }
    eventually("workers gone", || threads_named(&prefix) == 0);
}

// ----- wakers kept after their message finished -------------------------------

#[test]
fn a_waker_kept_and_called_long_after_its_message_finished_is_harmless() {
    let (executor, prefix) = named_executor("rwak", 2);
    let kept: Arc<Mutex<Vec<Waker>>> = Arc::default();
    let events = Events::new();
    let ev = events.add();
    let polls = Arc::new(AtomicUsize::new(0));
    let handler_live = Live::new();
    let (k2, e2, p2, t) = (
        kept.clone(),
        events.clone(),
        polls.clone(),
        handler_live.token(),
    );
    let d = executor.dispatcher(handler::from_async_fn(move |_k: u32, m: u32| {
        let _ = &t;
        let (kept, events, polls) = (k2.clone(), e2.clone(), p2.clone());
        let mut wait = (m == 100).then(|| events.wait(ev));
        std::future::poll_fn(move |cx| {
            kept.lock().unwrap().push(cx.waker().clone());
            if let Some(w) = wait.as_mut() {
                polls.fetch_add(1, SeqCst);
                if std::pin::Pin::new(w).poll(cx).is_pending() {
                    return Poll::Pending;
                }
            }
            Poll::Ready(m)
        })
    }));
    let r = d.receiver(8).unwrap();
    // Messages that finish at once; their wakers outlive them.
    for m in 0..5 {
        assert_eq!(r.submit_blocking(1, m).unwrap().wait().unwrap(), m);
    }
    eventually("key idle", || d.live_mailboxes() == 0);
    let before = executor.stats();
    for w in kept.lock().unwrap().iter() {
        w.wake_by_ref(); // the key is idle: nothing may run
    }
    std::thread::sleep(Duration::from_millis(20));
    let after = executor.stats();
    assert_eq!((after.done, after.live_mailboxes), (before.done, 0));

    // Now a message of the same key waits for an event; the old wakers (of
    // retired mailboxes) and the new one called early only cause spurious
    // polls, never an early or second completion.
    let waiting = r.submit_blocking(1, 100).unwrap();
    eventually("suspended", || polls.load(SeqCst) >= 1);
    for _ in 0..3 {
        for w in kept.lock().unwrap().clone() {
            w.wake();
        }
    }
    std::thread::sleep(Duration::from_millis(20));
    assert!(!waiting.is_finished());
    events.fire(ev);
    assert_eq!(waiting.wait().unwrap(), 100);
    let spurious = polls.load(SeqCst);

    // After the stop, and after every handle is gone, wakers still work.
    assert!(executor.shutdown(LONG));
    drop((r, d, executor));
    for w in kept.lock().unwrap().iter() {
        w.wake_by_ref();
    }
    assert_eq!(
        handler_live.count(),
        1,
        "the wakers keep the mailbox (and handler) memory"
    );
    kept.lock().unwrap().clear();
    events.clear();
    assert_eq!(handler_live.count(), 0, "freed with the last waker");
    eventually("workers gone", || threads_named(&prefix) == 0);
    eprintln!("waiting message polled {spurious} times (spurious wakes are allowed)");
}

// ----- panics in drops ----------------------------------------------------------

/// Panics when dropped (unless already unwinding).
struct PanicOnDrop(u32);

impl Drop for PanicOnDrop {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            panic!("{INJECTED} panic in drop of {}", self.0);
        }
    }
}

/// A future that completes at once (or waits for an event) and panics when
/// dropped.
struct DropBomb {
    m: u32,
    wait: Option<EventFuture>,
}

impl std::future::Future for DropBomb {
    type Output = u32;
    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<u32> {
        BOMBS_POLLED.fetch_add(1, SeqCst);
        if let Some(w) = self.wait.as_mut() {
            if std::pin::Pin::new(w).poll(cx).is_pending() {
                return Poll::Pending;
            }
        }
        Poll::Ready(self.m)
    }
}

static BOMBS_POLLED: AtomicUsize = AtomicUsize::new(0);

impl Drop for DropBomb {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            panic!("{INJECTED} future {} panics in drop", self.m);
        }
    }
}

#[test]
fn a_future_that_panics_on_drop_leaves_the_worker_alive_and_its_outcome_delivered() {
    quiet_injected_panics();
    let (executor, prefix) = named_executor("rfut", 1);
    let events = Events::new();
    let ev = events.add();
    let e2 = events.clone();
    let d = executor.dispatcher(handler::from_async_fn(move |_k: u32, m: u32| DropBomb {
        m,
        wait: (m >= 100).then(|| e2.wait(ev)),
    }));
    let r = d.receiver(8).unwrap();
    for m in 0..5 {
        // Completed, then dropped in place: the panic is contained.
        assert_eq!(r.submit_blocking(m % 2, m).unwrap().wait().unwrap(), m);
    }
    assert_eq!(threads_named(&prefix), 1, "the worker survived");
    // Suspended, then cancelled by a force stop: dropped on this thread.
    let suspended = r.submit_blocking(7, 100).unwrap();
    let queued = r.submit_blocking(7, 101).unwrap();
    eventually("suspended", || BOMBS_POLLED.load(SeqCst) == 6);
    executor.shutdown_now();
    assert!(suspended.wait().unwrap_err().is_cancelled());
    assert_eq!(queued.wait().unwrap_err().into_message(), Some(101));
    eventually("workers gone", || threads_named(&prefix) == 0);
}

static BLOCKER_IN: AtomicBool = AtomicBool::new(false);

/// An output (or a rejected message) whose `Drop` panics, dropped by the
/// crate because nobody holds its completion, must not unwind into the
/// worker (the thread would die and the pool never stop) or out of
/// `shutdown_now` (the rest of the stop would be skipped).
#[test]
fn outputs_and_messages_that_panic_on_drop_do_not_kill_workers_or_stops() {
    quiet_injected_panics();
    let (executor, prefix) = named_executor("rdrop", 1);
    let gate = Gate::new();
    let first = Gate::new();
    let (g, g1) = (gate.clone(), first.clone());
    let d = executor.dispatcher(handler::from_fn(move |_k: &u32, m: PanicOnDrop| {
        let n = m.0;
        std::mem::forget(m);
        if n == 1 {
            g1.wait();
        }
        if n == 50 {
            BLOCKER_IN.store(true, SeqCst);
            g.wait();
        }
        PanicOnDrop(n)
    }));
    let r = d.receiver(16).unwrap();
    // Output dropped on the worker (the handle is gone before it finishes).
    drop(r.submit_blocking(1, PanicOnDrop(1)).unwrap());
    first.open();
    r.send(1, PanicOnDrop(2)).unwrap(); // output of a send dropped on the worker
    let h = r.submit_blocking(2, PanicOnDrop(3)).unwrap();
    std::mem::forget(h.wait().unwrap()); // still delivered, worker alive
    assert_eq!(threads_named(&prefix), 1);
    // A force stop with queued messages whose handles are gone (and a send
    // without an `on_reject` hook): each dropped on this thread, each
    // contained, and the stop hands back the rest.
    let blocker = r.submit_blocking(3, PanicOnDrop(50)).unwrap();
    drop(r.submit_blocking(3, PanicOnDrop(51)).unwrap());
    r.send(3, PanicOnDrop(52)).unwrap();
    let kept = r.submit_blocking(3, PanicOnDrop(53)).unwrap();
    eventually("the blocker runs", || BLOCKER_IN.load(SeqCst));
    let stopper = {
        let ex = executor.clone();
        std::thread::spawn(move || ex.shutdown_now())
    };
    eventually("stop began", || r.is_closed());
    match kept.wait() {
        Err(TaskError::Rejected(m)) => std::mem::forget(m),
        other => panic!("expected a rejection: {:?}", other.map(std::mem::forget)),
    }
    gate.open();
    stopper.join().expect("shutdown_now must not panic");
    std::mem::forget(blocker.wait().unwrap());
    assert_eq!(r.in_flight(), 0);
    assert_eq!(executor.stats().rejected, 3);
    eventually("workers gone", || threads_named(&prefix) == 0);
}

// ----- keys with a bad Hash or Eq ---------------------------------------------

static HASH_PANICS: AtomicBool = AtomicBool::new(false);

/// Hashing key 13 always panics; hashing any key panics while
/// `HASH_PANICS` is set.
#[derive(Clone, PartialEq, Eq, Debug)]
struct BadHash(u32);

impl Hash for BadHash {
    fn hash<H: Hasher>(&self, h: &mut H) {
        if self.0 == 13 || HASH_PANICS.load(SeqCst) {
            panic!("{INJECTED} hash of {}", self.0);
        }
        self.0.hash(h);
    }
}

/// A `Hash` that panics inside `try_submit` gives back the credit unit it
/// took: otherwise `max_in_flight` such panics would make the receiver
/// refuse every key forever (`Full`).
#[test]
fn a_key_whose_hash_panics_fails_its_own_submission_and_nothing_else() {
    quiet_injected_panics();
    let (executor, prefix) = named_executor("rhash", 1);
    let log = Arc::new(Mutex::new(Vec::new()));
    let l2 = log.clone();
    let gate = Gate::new();
    let g = gate.clone();
    let d = executor.dispatcher(handler::from_fn(move |k: &BadHash, m: u32| {
        if m == 1000 {
            g.wait();
        }
        l2.lock().unwrap().push((k.0, m));
        m
    }));
    let r = d.receiver(2).unwrap();
    let live = Live::new();
    let msgs = executor.dispatcher(handler::from_fn(|_: &BadHash, m: Msg| m.0));
    let r2 = msgs.receiver(2).unwrap();
    for i in 0..5 {
        // The panic reaches the caller (the message unwinds with it)...
        let res = catch_unwind(AssertUnwindSafe(|| r.try_submit(BadHash(13), i)));
        assert!(res.is_err());
        let res = catch_unwind(AssertUnwindSafe(|| {
            r2.send(BadHash(13), Msg(i, live.token()))
        }));
        assert!(res.is_err());
        // ... and the credit unit comes back.
        assert_eq!(r.in_flight(), 0);
        assert_eq!(r2.in_flight(), 0);
    }
    assert_eq!(live.count(), 0);
    // Other keys: order kept, worker alive.
    let hs: Vec<_> = (0..6)
        .map(|m| r.submit_blocking(BadHash(m % 2), m).unwrap())
        .collect();
    for (h, m) in hs.into_iter().zip(0..) {
        assert_eq!(h.wait().unwrap(), m);
    }
    // A `Hash` that panics while a runner retires the key's mailbox (on the
    // worker): contained; the mailbox stays idle in its port's map (it
    // leaves the map before it closes), and the next submission of that
    // key revives it.
    let held = r.submit_blocking(BadHash(5), 1000).unwrap();
    eventually("running", || d.live_mailboxes() == 1);
    HASH_PANICS.store(true, SeqCst);
    gate.open();
    assert_eq!(held.wait().unwrap(), 1000);
    eventually("retired (or left closed)", || r.in_flight() == 0);
    HASH_PANICS.store(false, SeqCst);
    assert_eq!(threads_named(&prefix), 1, "the worker survived");
    assert_eq!(r.submit_blocking(BadHash(5), 7).unwrap().wait().unwrap(), 7);
    let log = log.lock().unwrap();
    for k in [0, 1] {
        let ms: Vec<u32> = log.iter().filter(|(kk, _)| *kk == k).map(|e| e.1).collect();
        let mut sorted = ms.clone();
        sorted.sort();
        assert_eq!(ms, sorted, "key {k} out of order");
    }
    assert!(executor.shutdown(LONG));
    eventually("workers gone", || threads_named(&prefix) == 0);
}

/// A key type whose `Eq` is not reflexive (like a float NaN): such a key
/// never finds its own mailbox, so each of its messages gets a new one (no
/// order among them, and their retired mailboxes stay in the map until a
/// force stop drains it). Other keys are untouched.
#[derive(Clone, Debug)]
struct NanKey(u32);

impl PartialEq for NanKey {
    fn eq(&self, other: &Self) -> bool {
        self.0 == other.0 && self.0 != 0 // key 0 is "NaN"
    }
}

impl Eq for NanKey {}

impl Hash for NanKey {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.0.hash(h);
    }
}

#[test]
fn a_key_whose_eq_is_inconsistent_gets_no_order_but_other_keys_keep_theirs() {
    let (executor, prefix) = named_executor("req", 2);
    let log: Arc<Mutex<HashMap<u32, Vec<u32>>>> = Arc::default();
    let l2 = log.clone();
    let handler_live = Live::new();
    let t = handler_live.token();
    let d = executor.dispatcher(handler::from_fn(move |k: &NanKey, m: u32| {
        let _ = &t;
        l2.lock().unwrap().entry(k.0).or_default().push(m);
        m
    }));
    let r = d.receiver(32).unwrap();
    let hs: Vec<_> = (0..300)
        .map(|m| r.submit_blocking(NanKey(m % 3), m).unwrap())
        .collect();
    for (h, m) in hs.into_iter().zip(0..) {
        assert_eq!(h.wait().unwrap(), m, "every message ran once");
    }
    for k in [1, 2] {
        let ms = log.lock().unwrap()[&k].clone();
        assert!(ms.windows(2).all(|w| w[0] < w[1]), "key {k} out of order");
    }
    assert_eq!(log.lock().unwrap()[&0].len(), 100);
    eventually("well-behaved keys retired", || r.in_flight() == 0);
    let leftovers = d.live_mailboxes();
    eprintln!("closed mailboxes of the NaN key left in the map: {leftovers} (of 100 messages)");
    assert_eq!(threads_named(&prefix), 2);
    // A force stop drains the leftovers: nothing leaks once handles go.
    executor.shutdown_now();
    assert_eq!(d.live_mailboxes(), 0);
    drop((r, d, executor));
    assert_eq!(handler_live.count(), 0);
    eventually("workers gone", || threads_named(&prefix) == 0);
}

/// A `Hash` that panics inside `Lanes::execute` leaves the command
/// uncounted (and gives back its unit of the node's in-flight limit):
/// otherwise `close` could never drain and the limit would shrink for
/// every `Lanes` sharing it.
#[test]
fn lanes_key_whose_hash_panics_fails_its_own_command_and_nothing_else() {
    quiet_injected_panics();
    struct K;
    impl Kernel for K {
        type Key = BadHash;
        type Command = u32;
        type Output = u32;
        type Error = String;
        async fn execute_batch(&self, _k: &BadHash, c: Vec<u32>) -> BatchResult<u32, u32, String> {
            BatchResult::committed(c.into_iter().map(Ok).collect())
        }
    }
    let limit = InFlightLimit::new(2);
    let lanes = Lanes::builder(K).limit(limit.clone()).build().unwrap();
    for i in 0..5 {
        let res = catch_unwind(AssertUnwindSafe(|| {
            lanes.execute_blocking(BadHash(13), i, LONG)
        }));
        assert!(res.is_err());
        let res = catch_unwind(AssertUnwindSafe(|| {
            futures::executor::block_on(lanes.execute(BadHash(13), i))
        }));
        assert!(res.is_err());
        assert_eq!((lanes.in_flight(), limit.in_flight()), (0, 0));
    }
    assert_eq!(lanes.execute_blocking(BadHash(1), 7, LONG).unwrap(), 7);
    assert!(lanes.close_blocking(LONG));
    assert!(matches!(
        lanes.execute_blocking(BadHash(1), 8, LONG),
        Err(LaneError::Closed(8))
    ));
}
