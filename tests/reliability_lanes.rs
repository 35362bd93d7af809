//! Randomized model test of `Lanes`, through its public API only.
//!
//! Each round generates a schedule from a seed: caller threads run commands
//! either blocking (`execute_blocking` with a timeout) or as hand-driven
//! futures, several at once and often on the same key (`execute`,
//! `execute_with_deadline`), and drop futures at random points: queued, while
//! leading their lane, in the middle of a batch. The kernel decides, rejects,
//! panics (in `execute_batch` or in its future), hands commands back
//! (`again`), fails the append, and awaits external events fired by a test
//! thread, which also moves the manual clock (deadlines). Lane capacity,
//! batch size and the node's in-flight limit are random and small, so `Busy`
//! is common. At a random point the lanes are closed (blocking or async,
//! sometimes first with a timeout too short to drain).
//!
//! Checked against the model at the end of the round:
//!
//! - the kernel never runs two batches of one key at once, nor a batch
//!   larger than `max_batch`; per key, each caller's commands are decided in
//!   the order they entered;
//! - every command was decided at most once (a command handed back as
//!   `again` may be seen again, never decided twice), or failed once with its
//!   whole batch on a panic — never both;
//! - a caller that stayed got exactly the outcome the kernel produced for
//!   its command; `Busy`/`Closed` handed back its own command, which never
//!   reached the kernel; `Withdrawn` handed back its own command, which the
//!   kernel never decided;
//! - a caller that went away left its command either decided once (its batch
//!   ran to its end) or never decided;
//! - `in_flight` never exceeded the limit; after the close: nothing in flight,
//!   no lane alive, no unit of the limit held, and no command or output
//!   alive.
//!
//! Replay: a failing round prints its seed; `KEYED_SEED=<seed> cargo test
//! --test reliability_lanes -- --nocapture`. `KEYED_ROUNDS=<n>` runs more.

mod common;

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::{Duration, Instant};

use common::*;
use keyed_executor::lanes::{BatchResult, Clock, Kernel, LaneError, Lanes, ManualClock};
use keyed_executor::limit::InFlightLimit;

const LONG: Duration = Duration::from_secs(60);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum KOp {
    Ok,
    Reject,
    /// Panics while the batch future is polled.
    Panic,
    /// Panics in `execute_batch` itself.
    PanicEarly,
    /// Handed back (with the rest of the batch) the first time it is seen.
    AgainOnce,
    /// Decided Ok, but the batch's append fails.
    FailAppend,
    /// The batch awaits event `n` before deciding.
    Wait(usize),
}

struct Cmd {
    id: u64,
    op: KOp,
    ledger: Arc<Ledger>,
}

impl Drop for Cmd {
    fn drop(&mut self) {
        self.ledger.with(self.id, |r, _| r.cmd_drops += 1);
    }
}

struct KOut {
    id: u64,
    _live: Token,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct KErr {
    id: Option<u64>,
    append: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Decision {
    Ok,
    Rejected,
    AppendFailed,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Seen {
    Ok,
    Kernel,
    Panicked,
    Withdrawn,
    Closed,
    Busy,
    Gone,
}

#[derive(Debug)]
struct Rec {
    key: u32,
    stream: u64,
    seq: u64,
    seen: Option<Seen>,
    seen_n: u8,
    in_batches: u32,
    decided: Option<Decision>,
    decided_n: u8,
    panicked_batches: u8,
    cmd_drops: u8,
}

#[derive(Default)]
struct State {
    recs: HashMap<u64, Rec>,
    running: HashSet<u32>,
    last_decided: HashMap<(u32, u64), u64>,
    errors: Vec<String>,
    batches: u64,
    again: u64,
}

struct Ledger {
    next: AtomicUsize,
    st: Mutex<State>,
    outs: Live,
    max_batch: usize,
}

impl Ledger {
    fn error(st: &mut State, e: String) {
        if st.errors.len() < 20 {
            st.errors.push(e);
        }
    }

    fn fail(&self, e: String) {
        Self::error(&mut self.st.lock().unwrap(), e);
    }

    fn create(self: &Arc<Self>, key: u32, stream: u64, seq: u64, op: KOp) -> Cmd {
        let id = self.next.fetch_add(1, SeqCst) as u64;
        self.st.lock().unwrap().recs.insert(
            id,
            Rec {
                key,
                stream,
                seq,
                seen: None,
                seen_n: 0,
                in_batches: 0,
                decided: None,
                decided_n: 0,
                panicked_batches: 0,
                cmd_drops: 0,
            },
        );
        Cmd {
            id,
            op,
            ledger: self.clone(),
        }
    }

    fn with(&self, id: u64, f: impl FnOnce(&mut Rec, &mut Vec<String>)) {
        let mut st = self.st.lock().unwrap();
        let st = &mut *st;
        let mut errs = Vec::new();
        match st.recs.get_mut(&id) {
            Some(r) => f(r, &mut errs),
            None => errs.push(format!("unknown command {id}")),
        }
        for e in errs {
            Self::error(st, e);
        }
    }

    fn batch_begin(&self, key: u32, ids: &[u64]) {
        let mut st = self.st.lock().unwrap();
        let st = &mut *st;
        st.batches += 1;
        if !st.running.insert(key) {
            Self::error(st, format!("key {key}: two batches at once"));
        }
        if ids.is_empty() || ids.len() > self.max_batch {
            Self::error(st, format!("key {key}: batch of {} commands", ids.len()));
        }
        for id in ids {
            match st.recs.get_mut(id) {
                Some(r) => {
                    r.in_batches += 1;
                    if r.key != key {
                        let k = r.key;
                        Self::error(st, format!("command {id} of key {k} in a batch of {key}"));
                    }
                }
                None => Self::error(st, format!("unknown command {id} in a batch")),
            }
        }
    }

    fn batch_end(&self, key: u32) {
        self.st.lock().unwrap().running.remove(&key);
    }

    fn panicked(&self, ids: &[u64]) {
        for &id in ids {
            self.with(id, |r, _| r.panicked_batches += 1);
        }
    }

    fn decided(&self, key: u32, decisions: &[(u64, Decision)], again: usize) {
        let mut st = self.st.lock().unwrap();
        let st = &mut *st;
        st.again += again as u64;
        for &(id, d) in decisions {
            let Some(r) = st.recs.get_mut(&id) else {
                Self::error(st, format!("decided unknown {id}"));
                continue;
            };
            r.decided = Some(d);
            r.decided_n += 1;
            let (n, stream, seq) = (r.decided_n, r.stream, r.seq);
            if n > 1 {
                Self::error(st, format!("command {id} decided {n} times"));
            }
            if let Some(&prev) = st.last_decided.get(&(key, stream)) {
                if prev >= seq {
                    Self::error(
                        st,
                        format!("key {key} caller {stream}: {seq} decided after {prev}"),
                    );
                }
            }
            st.last_decided.insert((key, stream), seq);
        }
    }

    /// What the caller of `id` got.
    fn outcome(&self, id: u64, outcome: Result<KOut, LaneError<Cmd, KErr>>) {
        let seen = match outcome {
            Ok(out) => {
                if out.id != id {
                    self.fail(format!("{id}: got the output of {}", out.id));
                }
                Seen::Ok
            }
            Err(LaneError::Kernel(e)) => {
                if !e.append && e.id != Some(id) {
                    self.fail(format!("{id}: got the kernel error of {:?}", e.id));
                }
                Seen::Kernel
            }
            Err(LaneError::Panicked(_)) => Seen::Panicked,
            Err(e) => {
                let seen = if e.is_withdrawn() {
                    Seen::Withdrawn
                } else if e.is_closed() {
                    Seen::Closed
                } else {
                    Seen::Busy
                };
                match e.into_command() {
                    Some(c) if c.id == id => {}
                    Some(c) => self.fail(format!("{id}: handed back {}", c.id)),
                    None => self.fail(format!("{id}: nothing handed back")),
                }
                seen
            }
        };
        self.seen(id, seen);
    }

    fn seen(&self, id: u64, seen: Seen) {
        self.with(id, |r, _| {
            r.seen = Some(seen);
            r.seen_n += 1;
        });
    }
}

/// Clears the key's "batch running" mark however the batch future ends.
struct Running<'a> {
    ledger: &'a Ledger,
    key: u32,
}

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.ledger.batch_end(self.key);
    }
}

struct ModelKernel {
    ledger: Arc<Ledger>,
    events: Arc<Events>,
    again_seen: Mutex<HashSet<u64>>,
}

impl Kernel for ModelKernel {
    type Key = u32;
    type Command = Cmd;
    type Output = KOut;
    type Error = KErr;

    fn execute_batch(
        &self,
        key: &u32,
        commands: Vec<Cmd>,
    ) -> impl Future<Output = BatchResult<Cmd, KOut, KErr>> + Send {
        let key = *key;
        let ids: Vec<u64> = commands.iter().map(|c| c.id).collect();
        if commands.iter().any(|c| c.op == KOp::PanicEarly) {
            self.ledger.batch_begin(key, &ids);
            self.ledger.batch_end(key);
            self.ledger.panicked(&ids);
            panic!("{INJECTED} panic in execute_batch");
        }
        async move {
            self.ledger.batch_begin(key, &ids);
            let _running = Running {
                ledger: &self.ledger,
                key,
            };
            for c in &commands {
                if let KOp::Wait(e) = c.op {
                    self.events.wait(e).await;
                }
            }
            if commands.iter().any(|c| c.op == KOp::Panic) {
                self.ledger.panicked(&ids);
                panic!("{INJECTED} panic in a batch");
            }
            let mut outcomes = Vec::new();
            let mut decisions = Vec::new();
            let mut again = Vec::new();
            let mut fail_append = false;
            let mut rest = commands.into_iter();
            for c in rest.by_ref() {
                let (outcome, d) = match c.op {
                    KOp::AgainOnce if self.again_seen.lock().unwrap().insert(c.id) => {
                        again.push(c);
                        break;
                    }
                    KOp::Reject => (
                        Err(KErr {
                            id: Some(c.id),
                            append: false,
                        }),
                        Decision::Rejected,
                    ),
                    KOp::FailAppend => {
                        fail_append = true;
                        (Ok(()), Decision::AppendFailed)
                    }
                    _ => (Ok(()), Decision::Ok),
                };
                decisions.push((c.id, d));
                outcomes.push(outcome.map(|()| KOut {
                    id: c.id,
                    _live: self.ledger.outs.token(),
                }));
            }
            again.extend(rest);
            if fail_append {
                // The append failed: every decided command fails with it.
                for d in decisions.iter_mut() {
                    d.1 = Decision::AppendFailed;
                }
                self.ledger.decided(key, &decisions, again.len());
                let n = outcomes.len();
                drop(outcomes);
                let err = KErr {
                    id: None,
                    append: true,
                };
                return BatchResult::failed(n, err).with_again(again);
            }
            self.ledger.decided(key, &decisions, again.len());
            BatchResult::committed(outcomes).with_again(again)
        }
    }
}

// ----- one round --------------------------------------------------------------

#[derive(Debug, Clone)]
struct Plan {
    lane_capacity: usize,
    max_batch: usize,
    limit: usize,
    keys: u64,
    callers: usize,
    per_caller: u64,
    p_blocking: u64,
    p_drop: u64,
    p_deadline: u64,
    p_panic: u64,
    p_again: u64,
    p_reject: u64,
    p_wait: u64,
    close_after: usize,
    close_first_short: bool,
    close_async: bool,
}

impl Plan {
    fn generate(rng: &mut Rng) -> Plan {
        let callers = rng.range(2, 4) as usize;
        let per_caller = rng.range(10, 120);
        Plan {
            lane_capacity: rng.range(1, 8) as usize,
            max_batch: rng.range(1, 6) as usize,
            limit: if rng.percent(30) {
                rng.range(1, 6) as usize
            } else {
                1000
            },
            keys: rng.range(1, 6),
            callers,
            per_caller,
            p_blocking: rng.below(60),
            p_drop: rng.below(30),
            p_deadline: rng.below(40),
            p_panic: rng.below(10),
            p_again: rng.below(20),
            p_reject: rng.below(15),
            p_wait: rng.below(35),
            close_after: rng.below(callers as u64 * per_caller + 1) as usize,
            close_first_short: rng.percent(30),
            close_async: rng.percent(50),
        }
    }

    fn op(&self, rng: &mut Rng, events: &Events) -> KOp {
        let r = rng.below(100);
        let mut t = self.p_panic;
        if r < t {
            return if rng.percent(30) {
                KOp::PanicEarly
            } else {
                KOp::Panic
            };
        }
        t += self.p_again;
        if r < t {
            return KOp::AgainOnce;
        }
        t += self.p_reject;
        if r < t {
            return if rng.percent(70) {
                KOp::Reject
            } else {
                KOp::FailAppend
            };
        }
        t += self.p_wait;
        if r < t {
            return KOp::Wait(events.add());
        }
        KOp::Ok
    }
}

struct Caller {
    index: u64,
    rng: Rng,
    lanes: Lanes<ModelKernel>,
    clock: ManualClock,
    entered: Arc<AtomicUsize>,
}

fn caller(me: Caller, plan: &Plan) {
    let Caller {
        index,
        mut rng,
        lanes,
        clock,
        entered,
    } = me;
    let ledger = lanes.kernel().ledger.clone();
    let events = lanes.kernel().events.clone();
    let waker = thread_waker();
    let mut seq = 0;
    let mut closed = 0;
    while seq < plan.per_caller && closed < 3 {
        if rng.percent(plan.p_blocking) {
            let key = rng.zipf(plan.keys) as u32;
            let cmd = ledger.create(key, index, seq, plan.op(&mut rng, &events));
            seq += 1;
            let id = cmd.id;
            let timeout = if rng.percent(plan.p_deadline) {
                Duration::from_micros(rng.below(3000))
            } else {
                LONG
            };
            let out = lanes.execute_blocking(key, cmd, timeout);
            if matches!(out, Err(LaneError::Closed(_))) {
                closed += 1;
            }
            entered.fetch_add(1, SeqCst);
            ledger.outcome(id, out);
            continue;
        }
        // A group of futures driven together, entered in order, often on
        // the same key; some are dropped along the way.
        let n = rng.range(1, 4);
        let mut group = Vec::new();
        for _ in 0..n {
            let key = rng.zipf(plan.keys) as u32;
            let cmd = ledger.create(key, index, seq, plan.op(&mut rng, &events));
            seq += 1;
            let id = cmd.id;
            let fut = if rng.percent(plan.p_deadline) {
                let deadline = clock.now() + Duration::from_micros(rng.below(3000));
                lanes.execute_with_deadline(key, cmd, deadline)
            } else {
                lanes.execute(key, cmd)
            };
            // Dropped after this many polls (if ever).
            let drop_after = rng.percent(plan.p_drop).then(|| rng.below(6));
            group.push(Some((id, fut, drop_after, 0u64)));
        }
        loop {
            let mut pending = 0;
            for slot in group.iter_mut() {
                let Some((id, fut, drop_after, polls)) = slot else {
                    continue;
                };
                if drop_after.is_some_and(|d| *polls >= d) {
                    let id = *id;
                    *slot = None; // the caller goes away
                    ledger.seen(id, Seen::Gone);
                    continue;
                }
                *polls += 1;
                if *polls == 1 {
                    entered.fetch_add(1, SeqCst);
                }
                match poll_once(fut, &waker) {
                    Poll::Ready(out) => {
                        if matches!(out, Err(LaneError::Closed(_))) {
                            closed += 1;
                        }
                        ledger.outcome(*id, out);
                        *slot = None;
                    }
                    Poll::Pending => pending += 1,
                }
            }
            if pending == 0 {
                break;
            }
            std::thread::park_timeout(Duration::from_micros(rng.range(50, 1000)));
        }
    }
}

#[derive(Default)]
struct Tally {
    rounds: u64,
    commands: u64,
    batches: u64,
    again: u64,
    seen: HashMap<String, u64>,
    closes_timed_out: u64,
}

fn run_round(seed: u64, tally: &mut Tally) {
    let _replay = Replay::new("lanes_model_random_schedules", seed);
    let mut rng = Rng::new(seed);
    let plan = Plan::generate(&mut rng);
    let ledger = Arc::new(Ledger {
        next: AtomicUsize::new(0),
        st: Mutex::new(State::default()),
        outs: Live::new(),
        max_batch: plan.max_batch,
    });
    let events = Events::new();
    let clock = ManualClock::new();
    let limit = InFlightLimit::new(plan.limit);
    let lanes = Lanes::builder(ModelKernel {
        ledger: ledger.clone(),
        events: events.clone(),
        again_seen: Mutex::new(HashSet::new()),
    })
    .lane_capacity(plan.lane_capacity)
    .max_batch(plan.max_batch)
    .limit(limit.clone())
    .clock(clock.clone())
    .on_event(|_| {})
    .build()
    .unwrap();

    let quit = Arc::new(AtomicBool::new(false));
    let firer = spawn_firer(events.clone(), rng.fork(), quit.clone());
    let ticker = {
        // Moves the manual clock, so deadlines pass while commands wait.
        let (quit, clock, lanes, ledger) =
            (quit.clone(), clock.clone(), lanes.clone(), ledger.clone());
        let limit = limit.clone();
        let mut rng = rng.fork();
        std::thread::spawn(move || loop {
            let last = quit.load(SeqCst);
            clock.advance(Duration::from_micros(rng.below(400)));
            // The limit itself never overshoots. `Lanes::in_flight` counts a
            // command from the moment it asks to enter, so it may briefly
            // include commands about to be refused (one per caller thread).
            let (held, n) = (limit.in_flight(), lanes.in_flight());
            if held > plan.limit || n > plan.limit + plan.callers {
                ledger.fail(format!("limit {held} / in_flight {n} > {}", plan.limit));
            }
            if last {
                break;
            }
            std::thread::sleep(Duration::from_micros(100));
        })
    };
    let entered = Arc::new(AtomicUsize::new(0));
    let callers: Vec<_> = (0..plan.callers)
        .map(|i| {
            let me = Caller {
                index: i as u64,
                rng: rng.fork(),
                lanes: lanes.clone(),
                clock: clock.clone(),
                entered: entered.clone(),
            };
            let plan = plan.clone();
            std::thread::spawn(move || caller(me, &plan))
        })
        .collect();

    eventually("the close point", || {
        entered.load(SeqCst) >= plan.close_after || callers.iter().all(|c| c.is_finished())
    });
    if plan.close_first_short {
        let t = Duration::from_micros(rng.below(500));
        if !lanes.close_blocking(t) {
            tally.closes_timed_out += 1;
        }
    }
    let drained = if plan.close_async {
        futures::executor::block_on(lanes.close(LONG))
    } else {
        lanes.close_blocking(LONG)
    };
    assert!(
        drained,
        "close did not drain: in flight {}, busy {:?}, unfired events {}",
        lanes.in_flight(),
        lanes.busy_keys(),
        events.unfired()
    );
    for c in callers {
        c.join().expect("caller");
    }
    quit.store(true, SeqCst);
    firer.join().unwrap();
    ticker.join().unwrap();
    assert_eq!(lanes.in_flight(), 0);
    assert_eq!(lanes.lanes_alive(), 0);
    assert_eq!(limit.in_flight(), 0, "a unit of the in-flight limit leaked");
    events.wake_stale();
    events.clear();
    drop(lanes);
    assert_eq!(ledger.outs.count(), 0, "an output leaked");

    let st = ledger.st.lock().unwrap();
    assert!(st.errors.is_empty(), "violations: {:#?}", st.errors);
    assert!(st.running.is_empty());
    for (&id, r) in &st.recs {
        let ctx = || format!("command {id}: {r:?} (plan {plan:?})");
        assert_eq!(r.cmd_drops, 1, "dropped != once: {}", ctx());
        assert_eq!(r.seen_n, 1, "{}", ctx());
        assert!(r.decided_n <= 1 && r.panicked_batches <= 1, "{}", ctx());
        assert!(r.decided_n + r.panicked_batches <= 1, "{}", ctx());
        let seen = r.seen.unwrap();
        match seen {
            Seen::Ok => assert_eq!(r.decided, Some(Decision::Ok), "{}", ctx()),
            Seen::Kernel => assert!(
                matches!(r.decided, Some(Decision::Rejected | Decision::AppendFailed)),
                "{}",
                ctx()
            ),
            Seen::Panicked => assert_eq!(r.panicked_batches, 1, "{}", ctx()),
            Seen::Withdrawn => {
                assert!(r.decided_n + r.panicked_batches == 0, "{}", ctx())
            }
            Seen::Closed | Seen::Busy => assert_eq!(r.in_batches, 0, "{}", ctx()),
            Seen::Gone => {}
        }
        *tally.seen.entry(format!("{seen:?}")).or_default() += 1;
    }
    tally.rounds += 1;
    tally.commands += st.recs.len() as u64;
    tally.batches += st.batches;
    tally.again += st.again;
}

#[test]
fn lanes_model_random_schedules() {
    quiet_injected_panics();
    let started = Instant::now();
    let mut tally = Tally::default();
    for seed in seeds(1500) {
        run_round(seed, &mut tally);
    }
    eprintln!(
        "lanes model: {} rounds, {} commands in {} batches ({} handed back as again); \
         outcomes {:?}; {} closes timed out first; values leaked: 0 ({:?})",
        tally.rounds,
        tally.commands,
        tally.batches,
        tally.again,
        tally.seen,
        tally.closes_timed_out,
        started.elapsed(),
    );
}
