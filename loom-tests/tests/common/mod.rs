#![cfg(loom)]
//! Helpers shared by the `KeyedExecutor` models: a scripted handler whose
//! messages say how their future behaves, a log of what ran, a gate future
//! whose waker is handed to another loom thread, and a wrapper around
//! `loom::model` that reports how many executions it explored.
//!
//! The log and the counters are plain `std` types on purpose: they are the
//! models' own bookkeeping, invisible to loom, so they add no interleavings.
//! (Loom runs its threads one at a time on one OS thread, and no `std` lock
//! here is held across a loom operation.) Where an overlap must be *observable*
//! the handler also touches a loom atomic, which is a scheduling point.
#![allow(dead_code)]

use std::collections::hash_map::DefaultHasher;
use std::future::Future;
use std::hash::BuildHasherDefault;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool as StdBool, AtomicUsize as StdCounter, Ordering::*};
use std::sync::Mutex as StdMutex;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use keyed_executor::handler::Handler;
use keyed_executor::KeyedExecutor;
use loom::sync::atomic::AtomicBool;
use loom::sync::{Arc, Condvar, Mutex};

/// A deterministic key hasher: `RandomState` would pick a different shard
/// (a different loom mutex) in each execution.
pub type Fixed = BuildHasherDefault<DefaultHasher>;

/// A long graceful-stop timeout. Under loom a timed wait never times out
/// (it is an untimed wait), so a stop that cannot finish is reported as a
/// deadlock rather than as `false`.
pub const LONG: Duration = Duration::from_secs(3600);

/// An executor with `workers` threads and the given `throughput`, without
/// work conservation: an idle worker's look for a stuck one (an idle count,
/// sightings, steal attempts) adds dozens of scheduling points to every
/// idle period, multiplying these models' executions 2–5 times for races
/// they do not check. The models of work conservation
/// (`executor_steal.rs`, `retire_vs_submit`) use [`conserving`].
pub fn executor(workers: usize, throughput: usize) -> KeyedExecutor {
    KeyedExecutor::builder()
        .workers(workers)
        .throughput(throughput)
        .work_conservation(false)
        .build()
        .expect("executor")
}

/// An executor with the default work conservation (under loom every
/// running worker counts as stuck at the first look, so steals and
/// stolen turns happen wherever they can).
pub fn conserving(workers: usize, throughput: usize) -> KeyedExecutor {
    KeyedExecutor::builder()
        .workers(workers)
        .throughput(throughput)
        .build()
        .expect("executor")
}

/// [`conserving`], with idle workers that watch by themselves
/// (`Builder::loom_watchers`): a worker going idle while another is active
/// parks "watching" (a yield here, loom having no clock) and looks again,
/// as outside loom. Submitters never look at a busy port's worker, so a
/// steal of a turn that a step holds up needs a watcher. The yield loop
/// multiplies the executions: these models fit in one preemption.
pub fn watching(workers: usize, throughput: usize) -> KeyedExecutor {
    KeyedExecutor::builder()
        .workers(workers)
        .throughput(throughput)
        .loom_watchers()
        .build()
        .expect("executor")
}

/// A dispatcher of `ex` running the [`Script`] handler that logs to `log`,
/// with the deterministic hasher.
pub fn scripted(
    ex: &KeyedExecutor,
    log: &std::sync::Arc<Log>,
) -> keyed_executor::Dispatcher<u8, Msg, u32> {
    ex.dispatcher_builder(Script::new(log))
        .hasher(Fixed::default())
        .build()
}

/// A [`scripted`] dispatcher of `ex` and one receiver of `credit` units.
pub fn scripted_receiver(
    ex: &KeyedExecutor,
    log: &std::sync::Arc<Log>,
    credit: usize,
) -> (
    keyed_executor::Dispatcher<u8, Msg, u32>,
    keyed_executor::Receiver<u8, Msg, u32>,
) {
    let d = scripted(ex, log);
    let r = d.receiver(credit).expect("receiver");
    (d, r)
}

/// Nothing is left of the model's work: `d` has no live mailbox and every
/// unit of `r` came back.
pub fn assert_nothing_left(
    d: &keyed_executor::Dispatcher<u8, Msg, u32>,
    r: &keyed_executor::Receiver<u8, Msg, u32>,
) {
    assert_eq!(d.live_mailboxes(), 0);
    assert_eq!(r.in_flight(), 0);
}

/// Runs `f` in `loom::model` and prints the number of executions explored
/// and the time taken.
pub fn model<F>(name: &str, f: F)
where
    F: Fn() + Sync + Send + 'static,
{
    model_bounded(name, None, f)
}

/// [`model`], with at most `preemptions` preemptions per execution when
/// given (else `LOOM_MAX_PREEMPTIONS` decides): for a model whose workers
/// loop (an idle worker that watches yields and looks again), where two
/// preemptions put the executions out of reach.
pub fn model_bounded<F>(name: &str, preemptions: Option<usize>, f: F)
where
    F: Fn() + Sync + Send + 'static,
{
    let runs = std::sync::Arc::new(StdCounter::new(0));
    let counted = runs.clone();
    let start = Instant::now();
    // Work conservation's looks (idle counts, sightings, steals) add a
    // few dozen scheduling points to a worker's every idle period: more
    // than loom's default 1,000 branches in the longer models.
    let mut builder = loom::model::Builder::new();
    builder.max_branches = 10_000;
    if let Some(n) = preemptions {
        builder.preemption_bound = Some(n);
    }
    let bound = builder
        .preemption_bound
        .map_or_else(|| "unbounded".to_owned(), |n| n.to_string());
    builder.check(move || {
        counted.fetch_add(1, Relaxed);
        f();
    });
    eprintln!(
        "model {name}: {} executions in {:.1?} (at most {bound} preemptions)",
        runs.load(Relaxed),
        start.elapsed(),
    );
}

/// Fails unless every outcome counted (over all the executions of a model)
/// happened at least once: the model reached each branch it asserts on.
pub fn assert_all_seen(model: &str, seen: &[(&str, &StdCounter)]) {
    for (label, n) in seen {
        let n = n.load(Relaxed);
        eprintln!("model {model}: {label}: {n} executions");
        assert!(n > 0, "model {model} never explored: {label}");
    }
}

// ----- the log --------------------------------------------------------------

/// What a handler did, in the order it did it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// The handler was called for message `id` (its future created).
    Start(u32),
    /// Message `id`'s future returned `Ready`.
    End(u32),
    /// A point in the model's own thread (see [`Log::mark`]).
    Mark(u32),
}

/// Shared by a [`Script`] handler and the model that checks it.
#[derive(Default)]
pub struct Log {
    events: StdMutex<Vec<Event>>,
    /// Per key (index): set while a message of the key is between `Start`
    /// and `End` (or dropped unfinished).
    busy: [StdBool; 4],
    /// The key of each message id (index).
    keys: StdMutex<Vec<Option<u8>>>,
    /// Polls per message id (index).
    polls: StdMutex<Vec<usize>>,
}

impl Log {
    pub fn new() -> std::sync::Arc<Log> {
        std::sync::Arc::new(Log::default())
    }

    fn push(&self, e: Event) {
        self.events.lock().unwrap().push(e);
    }

    fn polled(&self, id: u32) {
        let mut p = self.polls.lock().unwrap();
        let i = id as usize;
        if p.len() <= i {
            p.resize(i + 1, 0);
        }
        p[i] += 1;
    }

    /// Records that the calling thread got to point `n`. Call it right
    /// after a crate call returns, with no loom operation in between, and
    /// it is ordered exactly against the handler's events.
    pub fn mark(&self, n: u32) {
        self.push(Event::Mark(n));
    }

    pub fn events(&self) -> Vec<Event> {
        self.events.lock().unwrap().clone()
    }

    /// How many times message `id`'s future was polled.
    pub fn polls(&self, id: u32) -> usize {
        self.polls
            .lock()
            .unwrap()
            .get(id as usize)
            .copied()
            .unwrap_or(0)
    }

    pub fn started(&self, id: u32) -> bool {
        self.events().contains(&Event::Start(id))
    }

    pub fn ended(&self, id: u32) -> bool {
        self.events().contains(&Event::End(id))
    }

    /// Position of `e` in the log; panics if it is not there exactly once.
    pub fn position(&self, e: Event) -> usize {
        let ev = self.events();
        let hits: Vec<usize> = ev
            .iter()
            .enumerate()
            .filter(|(_, x)| **x == e)
            .map(|(i, _)| i)
            .collect();
        assert_eq!(
            hits.len(),
            1,
            "{e:?} happened {} times in {ev:?}",
            hits.len()
        );
        hits[0]
    }

    fn started_on(&self, key: u8, id: u32) {
        let mut k = self.keys.lock().unwrap();
        let i = id as usize;
        if k.len() <= i {
            k.resize(i + 1, None);
        }
        assert!(k[i].is_none(), "message {id} started twice");
        k[i] = Some(key);
    }

    fn key_of(&self, id: u32) -> Option<u8> {
        self.keys
            .lock()
            .unwrap()
            .get(id as usize)
            .copied()
            .flatten()
    }

    /// Per key: every message started ran to its end before the next one
    /// of its key started (one at a time), and none started twice.
    pub fn assert_serial(&self) {
        for key in 0..self.busy.len() as u8 {
            self.assert_serial_key(key);
        }
    }

    fn assert_serial_key(&self, key: u8) {
        let ev: Vec<Event> = self
            .events()
            .into_iter()
            .filter(|e| match *e {
                Event::Start(id) | Event::End(id) => self.key_of(id) == Some(key),
                Event::Mark(_) => false,
            })
            .collect();
        let mut open: Option<u32> = None;
        let mut seen = Vec::new();
        for e in &ev {
            match *e {
                Event::Start(id) => {
                    assert!(open.is_none(), "{id} started while {open:?} ran: {ev:?}");
                    assert!(!seen.contains(&id), "{id} started twice: {ev:?}");
                    seen.push(id);
                    open = Some(id);
                }
                Event::End(id) => {
                    assert_eq!(open, Some(id), "{id} ended out of turn: {ev:?}");
                    open = None;
                }
                Event::Mark(_) => {}
            }
        }
    }
}

// ----- the gate ---------------------------------------------------------------

/// A future's wake-up source on another loom thread: the future parks its
/// waker here and returns `Pending`; [`Gate::open_and_wake`] (on another
/// thread) takes the waker, opens the gate and wakes it — possibly while
/// the worker is still inside the poll that stored it.
pub struct Gate {
    open: AtomicBool,
    /// The parked waker, and whether the opener should stop waiting for
    /// one ([`Gate::release_waiter`]).
    waker: Mutex<(Option<Waker>, bool)>,
    stored: Condvar,
}

impl Gate {
    pub fn new() -> Arc<Gate> {
        Arc::new(Gate {
            open: AtomicBool::new(false),
            waker: Mutex::new((None, false)),
            stored: Condvar::new(),
        })
    }

    /// Waits until a poll stored its waker, opens the gate and wakes the
    /// task; then wakes it `stale` more times (late, possibly after the
    /// message completed), and drops the waker. Returns at once, without
    /// opening, if [`Gate::release_waiter`] was called first.
    pub fn open_and_wake(&self, stale: usize) {
        let waker = {
            let mut slot = self.waker.lock().unwrap();
            loop {
                if let Some(w) = slot.0.take() {
                    break w;
                }
                if slot.1 {
                    return;
                }
                slot = self.stored.wait(slot).unwrap();
            }
        };
        self.open.store(true, SeqCst);
        waker.wake_by_ref();
        for _ in 0..stale {
            waker.wake_by_ref();
        }
        drop(waker);
    }

    /// Waits until a poll stored its waker (the future is pending, or about
    /// to return `Pending`), without opening the gate.
    pub fn wait_stored(&self) {
        let mut slot = self.waker.lock().unwrap();
        while slot.0.is_none() {
            slot = self.stored.wait(slot).unwrap();
        }
    }

    /// Opens the gate before anyone polls it (no waker involved).
    pub fn open_now(&self) {
        self.open.store(true, SeqCst);
    }

    /// Ready once the gate is open; otherwise parks the waker (telling
    /// [`Gate::open_and_wake`] it is there) and is pending.
    pub fn poll_open(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.open.load(SeqCst) {
            return Poll::Ready(());
        }
        self.waker.lock().unwrap().0 = Some(cx.waker().clone());
        self.stored.notify_one();
        Poll::Pending
    }

    /// Drops a waker left behind (the handler that holds the gate lives in
    /// the dispatcher, and a waker holds its mailbox: a cycle otherwise).
    pub fn clear(&self) {
        drop(self.waker.lock().unwrap().0.take());
    }

    /// Lets a waiting [`Gate::open_and_wake`] return without a waker (the
    /// future was dropped before its first poll).
    pub fn release_waiter(&self) {
        self.waker.lock().unwrap().1 = true;
        self.stored.notify_one();
    }
}

// ----- the scripted handler -------------------------------------------------

/// How a message's future behaves.
pub enum Act {
    /// Ready on its first poll (a sync handler).
    Now,
    /// Wakes itself and returns `Pending` once, then is ready: the mailbox
    /// is re-queued with its future half done.
    YieldOnce,
    /// Pending until its [`Gate`] is opened by another thread.
    Gated(Arc<Gate>),
    /// Blocks its worker thread in its first poll until its [`Latch`] is
    /// opened (a step that does not return: a long computation, a
    /// blocking call), then is ready.
    Blocked(Arc<Latch>),
}

/// What a [`Act::Blocked`] message blocks on.
pub struct Latch {
    /// (the step has begun, the latch is open)
    state: Mutex<(bool, bool)>,
    cv: Condvar,
}

impl Latch {
    pub fn new() -> Arc<Latch> {
        Arc::new(Latch {
            state: Mutex::new((false, false)),
            cv: Condvar::new(),
        })
    }

    fn enter_and_wait(&self) {
        let mut s = self.state.lock().unwrap();
        s.0 = true;
        self.cv.notify_all();
        while !s.1 {
            s = self.cv.wait(s).unwrap();
        }
    }

    /// Waits until the blocked message's step has begun.
    pub fn wait_entered(&self) {
        let mut s = self.state.lock().unwrap();
        while !s.0 {
            s = self.cv.wait(s).unwrap();
        }
    }

    /// Lets the blocked step return.
    pub fn open(&self) {
        self.state.lock().unwrap().1 = true;
        self.cv.notify_all();
    }
}

/// A message: an id (the handler's output) and how to behave.
pub struct Msg {
    pub id: u32,
    pub act: Act,
}

impl Msg {
    pub fn now(id: u32) -> Msg {
        Msg { id, act: Act::Now }
    }
    pub fn yield_once(id: u32) -> Msg {
        Msg {
            id,
            act: Act::YieldOnce,
        }
    }
    pub fn gated(id: u32, gate: &Arc<Gate>) -> Msg {
        Msg {
            id,
            act: Act::Gated(gate.clone()),
        }
    }
    pub fn blocked(id: u32, latch: &Arc<Latch>) -> Msg {
        Msg {
            id,
            act: Act::Blocked(latch.clone()),
        }
    }
}

impl std::fmt::Debug for Msg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Msg({})", self.id)
    }
}

/// The handler: logs `Start`, `End` and every poll; with `probe`, also
/// touches a loom atomic at the start and the end of each message, so an
/// overlap of two messages (on two workers) is an interleaving loom can
/// produce, and the `busy` flag catches it.
pub struct Script {
    pub log: std::sync::Arc<Log>,
    probe: Option<Arc<AtomicBool>>,
}

impl Script {
    pub fn new(log: &std::sync::Arc<Log>) -> Script {
        Script {
            log: log.clone(),
            probe: None,
        }
    }

    /// With a loom scheduling point at the start and the end of each message.
    pub fn probed(log: &std::sync::Arc<Log>) -> Script {
        Script {
            log: log.clone(),
            probe: Some(Arc::new(AtomicBool::new(false))),
        }
    }
}

impl Handler<u8, Msg> for Script {
    type Output = u32;
    type Future = Work;

    fn call(&self, key: &u8, msg: Msg) -> Work {
        assert!(
            !self.log.busy[*key as usize].swap(true, SeqCst),
            "message {} started while another of key {key} ran",
            msg.id
        );
        self.log.started_on(*key, msg.id);
        self.log.push(Event::Start(msg.id));
        if let Some(p) = &self.probe {
            p.store(true, SeqCst);
        }
        Work {
            key: *key,
            id: msg.id,
            act: msg.act,
            yielded: false,
            done: false,
            log: self.log.clone(),
            probe: self.probe.clone(),
        }
    }
}

/// The future of one scripted message.
pub struct Work {
    key: u8,
    id: u32,
    act: Act,
    yielded: bool,
    done: bool,
    log: std::sync::Arc<Log>,
    probe: Option<Arc<AtomicBool>>,
}

impl Future for Work {
    type Output = u32;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<u32> {
        assert!(!self.done, "message {} polled after it completed", self.id);
        self.log.polled(self.id);
        let ready = match &self.act {
            Act::Now => true,
            Act::YieldOnce => {
                if self.yielded {
                    true
                } else {
                    self.yielded = true;
                    cx.waker().wake_by_ref();
                    false
                }
            }
            Act::Gated(gate) => gate.poll_open(cx).is_ready(),
            Act::Blocked(latch) => {
                latch.enter_and_wait();
                true
            }
        };
        if !ready {
            return Poll::Pending;
        }
        if let Some(p) = &self.probe {
            p.store(false, SeqCst);
        }
        self.done = true;
        self.log.push(Event::End(self.id));
        assert!(
            self.log.busy[self.key as usize].swap(false, SeqCst),
            "busy flag lost"
        );
        Poll::Ready(self.id)
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        // A future dropped before it completed (cancelled by a force stop)
        // frees its key.
        if !self.done {
            self.log.busy[self.key as usize].store(false, SeqCst);
        }
    }
}

// ----- a batch racing a stop --------------------------------------------------

/// How a batch-vs-stop execution ended (see [`batch_of_two_vs_stop`]).
pub const BATCH_REFUSED: usize = 0;
/// Some message was handed back through the `on_reject` hook.
pub const BATCH_HOOKED: usize = 1;
/// Both messages ran.
pub const BATCH_RAN: usize = 2;

/// One worker: a loom thread sends a batch of two messages for key 0 (one
/// chunk) on a receiver with two units while the main thread runs `stop`
/// (given the executor and the receiver). Each message ends exactly once
/// — ran, handed back through `on_reject`, or refused in the batch's
/// error — a message handed back never started, the key's order holds (a
/// message handed back is never followed by one that ran), and every unit
/// comes back. Returns how the execution ended (`BATCH_*`).
pub fn batch_of_two_vs_stop(
    stop: impl FnOnce(&KeyedExecutor, &keyed_executor::Receiver<u8, Msg, u32>),
) -> usize {
    let log = Log::new();
    let hooked = std::sync::Arc::new(StdMutex::new(Vec::new()));
    let h = hooked.clone();
    let ex = executor(1, 16);
    let d = ex
        .dispatcher_builder(Script::new(&log))
        .hasher(Fixed::default())
        .on_reject(move |_, msg: Msg| h.lock().unwrap().push(msg.id))
        .build();
    let r = d.receiver(2).unwrap();
    let r2 = r.clone();
    let sender =
        loom::thread::spawn(
            move || match r2.send_batch([(0, Msg::now(1)), (0, Msg::now(2))]) {
                Ok(p) => {
                    assert_eq!(p.iter().collect::<Vec<_>>(), [0, 1]);
                    Vec::new()
                }
                Err(e) => {
                    assert!(e.is_closed());
                    let taken = e.sent().len();
                    let rest: Vec<u32> = e.into_rest().into_iter().map(|(_, m)| m.id).collect();
                    assert_eq!(rest.len() + taken, 2);
                    rest
                }
            },
        );
    stop(&ex, &r);
    let refused = sender.join().unwrap();
    ex.shutdown_now();
    let hooked = hooked.lock().unwrap().clone();
    for id in [1, 2] {
        let ran = log.ended(id);
        let ways = [ran, hooked.contains(&id), refused.contains(&id)];
        assert_eq!(
            ways.iter().filter(|w| **w).count(),
            1,
            "message {id}: ran/hooked/refused = {ways:?}"
        );
        if !ran {
            assert!(!log.started(id), "{id} handed back but it started");
        }
    }
    if log.ended(2) {
        assert!(log.ended(1), "2 ran although 1 did not");
    }
    log.assert_serial();
    assert_eq!(r.in_flight(), 0, "every unit came back");
    if !refused.is_empty() {
        BATCH_REFUSED
    } else if !hooked.is_empty() {
        BATCH_HOOKED
    } else {
        BATCH_RAN
    }
}
