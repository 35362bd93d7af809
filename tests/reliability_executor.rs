//! Randomized model test of `KeyedExecutor`, through its public API only.
//!
//! Each round generates a schedule from a seed: several producer threads
//! feed two dispatchers (one async, one sync) through several receivers with
//! every submission method (`submit`, `submit_blocking`, `try_submit`,
//! `send`, `try_send`, `send_async`, and a `submit` future given up while it
//! waits for credit), keeping or dropping the completion handles. Handlers
//! panic (before or after an await), await an external event fired by a test
//! thread, yield, submit to another key from inside the handler, and some
//! futures panic when dropped. At a random point the executor is stopped:
//! gracefully, gracefully with a short timeout then forced, forced, or from
//! inside a handler (either kind).
//!
//! Everything observed goes to a ledger (the sequential model), checked at the
//! end of the round:
//!
//! - per key, the messages that started did so in arrival order (per
//!   producer, and per parent key for messages submitted by handlers), one at
//!   a time;
//! - every accepted message ended exactly once as done, panicked, rejected
//!   and handed back (through its completion or the `on_reject` hook), or
//!   cancelled; completions and hooks agree with what the handler saw;
//! - every refused submission handed back its own message
//!   (`Full`/`Closed`), and a given-up `submit` dropped it unprocessed;
//! - a receiver never had more than `max_in_flight` messages unfinished, nor
//!   more of its producers' messages running at once (sampled and counted;
//!   a handler's submission may share its parent's unit, so it is not
//!   counted against its own receiver);
//! - after the stop: no live mailbox, no worker thread (by name, in /proc),
//!   no credit held, the executor's counters equal the model's, and once the
//!   handles are dropped no message, output, future or handler is alive;
//!   every stale waker was called once more, harmlessly.
//!
//! Replay: a failing round prints its seed; `KEYED_SEED=<seed> cargo test
//! --test reliability_executor -- --nocapture` runs the same schedule (the
//! same operations, keys, stop plan and stop point; thread interleavings
//! differ from run to run). `KEYED_ROUNDS=<n>` runs more rounds.

mod common;

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use common::*;
use keyed_executor::handler::{self, Handler};
use keyed_executor::{
    Completion, Dispatcher, DispatcherBuilder, KeyedExecutor, Panic, Receiver, SubmitError,
    TaskError,
};

type Rx = Receiver<u32, Msg, Out>;
type Handle = (u64, Completion<Out, Msg>);

/// Streams of messages submitted by handlers start here (producers are 0..).
const CHILD_STREAM: u64 = 1 << 32;
/// The most live mailboxes seen beyond the credit of their dispatcher.
static MAX_EXCESS: AtomicUsize = AtomicUsize::new(0);
const LONG: Duration = Duration::from_secs(60);

// ----- messages ---------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    Ok,
    /// The handler panics before it makes its future.
    PanicAtCall,
    /// The future panics after one `Pending` (sync dispatcher: at call).
    PanicInFuture,
    /// The future awaits external event `n`.
    Wait(usize),
    /// The future wakes itself and returns `Pending` once.
    Yield,
    /// The handler submits a message to another key with `try_submit` /
    /// `try_send`.
    Child(ChildPlan),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ChildPlan {
    rx: usize,
    key: u32,
    send: bool,
    keep: bool,
    /// 0: Ok, 1: panics, 2: awaits a new event.
    op: u8,
}

struct Msg {
    id: u64,
    op: Op,
    drop_panics: bool,
    ledger: Arc<Ledger>,
}

impl Drop for Msg {
    fn drop(&mut self) {
        self.ledger.msg_dropped(self.id);
    }
}

struct Out {
    id: u64,
    _live: Token,
}

// ----- the model --------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum How {
    Submit { keep: bool },
    Send,
}

#[derive(Clone, Copy, Debug)]
struct Meta {
    disp: usize,
    key: u32,
    /// Global receiver index.
    src: usize,
    stream: u64,
    seq: u64,
    how: How,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    Finished,
    Panicked,
    Cancelled,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Delivered {
    Ok,
    Panicked,
    Rejected,
    Cancelled,
}

#[derive(Debug)]
struct Rec {
    meta: Meta,
    accepted: u8,
    refused: u8,
    started: u8,
    end: Option<End>,
    ends: u8,
    delivered: Option<Delivered>,
    deliveries: u8,
    hook_reject: u8,
    hook_panic: u8,
    msg_drops: u8,
}

#[derive(Default)]
struct State {
    recs: HashMap<u64, Rec>,
    running_keys: HashSet<(usize, u32)>,
    last_seq: HashMap<(usize, u32, u64), u64>,
    child_seq: HashMap<(usize, u32), u64>,
    running_per_src: Vec<usize>,
    max_per_src: Vec<usize>,
    errors: Vec<String>,
}

struct Ledger {
    next_id: AtomicU64,
    accepted: AtomicUsize,
    st: Mutex<State>,
    outs: Live,
    futures: Live,
}

impl Ledger {
    fn new(max_per_src: Vec<usize>) -> Arc<Self> {
        Arc::new(Ledger {
            next_id: AtomicU64::new(0),
            accepted: AtomicUsize::new(0),
            st: Mutex::new(State {
                running_per_src: vec![0; max_per_src.len()],
                max_per_src,
                ..State::default()
            }),
            outs: Live::new(),
            futures: Live::new(),
        })
    }

    fn error(st: &mut State, e: String) {
        if st.errors.len() < 20 {
            st.errors.push(e);
        }
    }

    fn create(self: &Arc<Self>, meta: Meta, op: Op, drop_panics: bool) -> Msg {
        let id = self.next_id.fetch_add(1, SeqCst);
        self.st.lock().unwrap().recs.insert(
            id,
            Rec {
                meta,
                accepted: 0,
                refused: 0,
                started: 0,
                end: None,
                ends: 0,
                delivered: None,
                deliveries: 0,
                hook_reject: 0,
                hook_panic: 0,
                msg_drops: 0,
            },
        );
        Msg {
            id,
            op,
            drop_panics,
            ledger: self.clone(),
        }
    }

    fn with(&self, id: u64, f: impl FnOnce(&mut Rec, &mut Vec<String>)) {
        let mut st = self.st.lock().unwrap();
        let st = &mut *st;
        match st.recs.get_mut(&id) {
            Some(rec) => {
                let mut errs = Vec::new();
                f(rec, &mut errs);
                for e in errs {
                    Self::error(st, e);
                }
            }
            None => Self::error(st, format!("unknown message id {id}")),
        }
    }

    fn fail(&self, e: String) {
        Self::error(&mut self.st.lock().unwrap(), e);
    }

    fn accepted(&self, id: u64) {
        self.accepted.fetch_add(1, SeqCst);
        self.with(id, |r, _| r.accepted += 1);
    }

    fn refused(&self, id: u64) {
        self.with(id, |r, _| r.refused += 1);
    }

    fn msg_dropped(&self, id: u64) {
        self.with(id, |r, _| r.msg_drops += 1);
    }

    fn hook_reject(&self, id: u64) {
        self.with(id, |r, _| r.hook_reject += 1);
    }

    fn hook_panic(&self, id: u64) {
        self.with(id, |r, _| r.hook_panic += 1);
    }

    fn delivered(&self, id: u64, d: Delivered) {
        self.with(id, |r, _| {
            r.delivered = Some(d);
            r.deliveries += 1;
        });
    }

    /// The handler was called for `id`: check order, exclusivity and credit.
    fn started(&self, id: u64) {
        let mut st = self.st.lock().unwrap();
        let st = &mut *st;
        let Some(rec) = st.recs.get_mut(&id) else {
            return Self::error(st, format!("started unknown {id}"));
        };
        rec.started += 1;
        let m = rec.meta;
        let started = rec.started;
        if started > 1 {
            Self::error(st, format!("message {id} started {started} times"));
        }
        if !st.running_keys.insert((m.disp, m.key)) {
            Self::error(
                st,
                format!("key {}/{} ran two messages at once ({id})", m.disp, m.key),
            );
        }
        if let Some(&prev) = st.last_seq.get(&(m.disp, m.key, m.stream)) {
            if prev >= m.seq {
                Self::error(
                    st,
                    format!(
                        "key {}/{} stream {}: seq {} started after {prev}",
                        m.disp, m.key, m.stream, m.seq
                    ),
                );
            }
        }
        st.last_seq.insert((m.disp, m.key, m.stream), m.seq);
        // Only producers' messages count: a message a handler submits may
        // share the unit of the message that submitted it (forwarding never
        // waits for credit), so it runs beyond its receiver's credit.
        if m.stream >= CHILD_STREAM {
            return;
        }
        st.running_per_src[m.src] += 1;
        if st.running_per_src[m.src] > st.max_per_src[m.src] {
            let (n, max) = (st.running_per_src[m.src], st.max_per_src[m.src]);
            Self::error(st, format!("receiver {}: {n} running > {max}", m.src));
        }
    }

    fn ended(&self, id: u64, end: End) {
        let mut st = self.st.lock().unwrap();
        let st = &mut *st;
        let Some(rec) = st.recs.get_mut(&id) else {
            return Self::error(st, format!("ended unknown {id}"));
        };
        rec.end = Some(end);
        rec.ends += 1;
        let (m, ends) = (rec.meta, rec.ends);
        if ends > 1 {
            Self::error(st, format!("message {id} ended {ends} times"));
        }
        st.running_keys.remove(&(m.disp, m.key));
        if m.stream < CHILD_STREAM {
            st.running_per_src[m.src] -= 1;
        }
    }

    /// A future was dropped: if its message had not ended, it was cancelled.
    fn cancel_if_unended(&self, id: u64) {
        let unended = {
            let st = self.st.lock().unwrap();
            st.recs.get(&id).is_some_and(|r| r.end.is_none())
        };
        if unended {
            self.ended(id, End::Cancelled);
        }
    }

    fn next_child_seq(&self, disp: usize, key: u32) -> u64 {
        let mut st = self.st.lock().unwrap();
        let s = st.child_seq.entry((disp, key)).or_insert(0);
        *s += 1;
        *s
    }

    fn record(&self, id: u64, outcome: Result<Out, TaskError<Msg>>) {
        let d = match outcome {
            Ok(out) => {
                if out.id != id {
                    self.with(id, |_, e| e.push(format!("{id}: output of {}", out.id)));
                }
                Delivered::Ok
            }
            Err(TaskError::Panicked(p)) => {
                if panic_id(&p) != Some(id) {
                    let m = p.message().to_owned();
                    self.with(id, |_, e| e.push(format!("{id}: foreign panic {m:?}")));
                }
                Delivered::Panicked
            }
            Err(TaskError::Rejected(msg)) => {
                if msg.id != id {
                    self.with(id, |_, e| e.push(format!("{id}: rejected {}", msg.id)));
                }
                Delivered::Rejected
            }
            Err(TaskError::Cancelled) => Delivered::Cancelled,
            Err(e) => panic!("{id}: no retrying handler here: {e}"),
        };
        self.delivered(id, d);
    }
}

fn panic_id(p: &Panic) -> Option<u64> {
    p.message().rsplit('#').next()?.parse().ok()
}

// ----- handlers ---------------------------------------------------------------

/// What the handlers share with the test.
struct Ctx {
    ledger: Arc<Ledger>,
    events: Arc<Events>,
    /// Receivers for messages submitted from inside handlers; taken out at
    /// the end of the round (a handler holding a receiver is a cycle).
    rxs: Mutex<Option<Vec<Rx>>>,
    rx_disp: Vec<usize>,
    /// For a stop from inside a handler; taken out at the end.
    exec: Mutex<Option<KeyedExecutor>>,
    /// 1: the next handler stops gracefully, 2: force.
    stop_inside: AtomicU8,
    inside_graceful_returned_true: AtomicBool,
    child_handles: Mutex<Vec<Handle>>,
}

impl Ctx {
    fn maybe_stop_inside(&self) {
        let how = self.stop_inside.swap(0, SeqCst);
        if how == 0 {
            return;
        }
        let ex = self.exec.lock().unwrap().clone();
        if let Some(ex) = ex {
            let stopped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                if how == 1 {
                    if ex.shutdown(Duration::from_secs(5)) {
                        self.inside_graceful_returned_true.store(true, SeqCst);
                    }
                } else {
                    ex.shutdown_now();
                }
            }));
            if let Err(p) = stopped {
                let m = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
                self.ledger
                    .fail(format!("a stop from inside a handler panicked: {m:?}"));
            }
        }
    }

    fn child(&self, origin_disp: usize, origin_key: u32, plan: ChildPlan) {
        let guard = self.rxs.lock().unwrap();
        let Some(rxs) = guard.as_ref() else { return };
        let disp = self.rx_disp[plan.rx];
        let seq = self.ledger.next_child_seq(origin_disp, origin_key);
        let meta = Meta {
            disp,
            key: plan.key,
            src: plan.rx,
            stream: CHILD_STREAM + (origin_disp as u64) * 1_000_000 + origin_key as u64,
            seq,
            how: if plan.send {
                How::Send
            } else {
                How::Submit { keep: plan.keep }
            },
        };
        let op = match plan.op {
            0 => Op::Ok,
            1 => Op::PanicAtCall,
            _ => Op::Wait(self.events.add()),
        };
        let msg = self.ledger.create(meta, op, false);
        let id = msg.id;
        let rx = &rxs[plan.rx];
        if plan.send {
            match rx.try_send(plan.key, msg) {
                Ok(_) => self.ledger.accepted(id),
                Err(e) => refused(&self.ledger, id, e),
            }
        } else {
            match rx.try_submit(plan.key, msg) {
                Ok(c) => {
                    self.ledger.accepted(id);
                    if plan.keep {
                        self.child_handles.lock().unwrap().push((id, c));
                    }
                }
                Err(e) => refused(&self.ledger, id, e),
            }
        }
    }
}

fn refused(ledger: &Ledger, id: u64, e: SubmitError<Msg>) {
    let msg = e.into_inner();
    if msg.id != id {
        ledger.with(id, |_, errs| {
            errs.push(format!("{id}: refusal handed back {}", msg.id))
        });
    }
    ledger.refused(id);
}

/// The async handler's future: the work, plus the bookkeeping the model needs
/// (its end, or its cancellation when dropped unfinished) and an optional
/// panic in `drop`.
struct HFut {
    ctx: Arc<Ctx>,
    id: u64,
    drop_panics: bool,
    inner: Pin<Box<dyn Future<Output = ()> + Send>>,
    _live: Token,
}

impl Future for HFut {
    type Output = Out;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Out> {
        match self.inner.as_mut().poll(cx) {
            Poll::Pending => Poll::Pending,
            Poll::Ready(()) => {
                self.ctx.ledger.ended(self.id, End::Finished);
                Poll::Ready(Out {
                    id: self.id,
                    _live: self.ctx.ledger.outs.token(),
                })
            }
        }
    }
}

impl Drop for HFut {
    fn drop(&mut self) {
        self.ctx.ledger.cancel_if_unended(self.id);
        if self.drop_panics && !std::thread::panicking() {
            panic!("{INJECTED} panic in drop of #{}", self.id);
        }
    }
}

fn async_call(ctx: &Arc<Ctx>, key: u32, msg: Msg) -> HFut {
    let id = msg.id;
    ctx.ledger.started(id);
    ctx.maybe_stop_inside();
    match msg.op {
        Op::PanicAtCall => {
            ctx.ledger.ended(id, End::Panicked);
            panic!("{INJECTED} panic at call #{id}");
        }
        Op::Child(plan) => ctx.child(0, key, plan),
        _ => {}
    }
    let drop_panics = msg.drop_panics;
    let c = ctx.clone();
    let inner = Box::pin(async move {
        match msg.op {
            Op::Wait(e) => c.events.wait(e).await,
            Op::Yield => YieldOnce(false).await,
            Op::PanicInFuture => {
                YieldOnce(false).await;
                c.ledger.ended(msg.id, End::Panicked);
                panic!("{INJECTED} panic in future #{}", msg.id);
            }
            _ => {}
        }
        drop(msg);
    });
    HFut {
        ctx: ctx.clone(),
        id,
        drop_panics,
        inner,
        _live: ctx.ledger.futures.token(),
    }
}

fn sync_call(ctx: &Ctx, key: u32, msg: Msg) -> Out {
    let id = msg.id;
    ctx.ledger.started(id);
    ctx.maybe_stop_inside();
    match msg.op {
        Op::PanicAtCall | Op::PanicInFuture => {
            ctx.ledger.ended(id, End::Panicked);
            panic!("{INJECTED} panic in sync handler #{id}");
        }
        Op::Child(plan) => ctx.child(1, key, plan),
        _ => {}
    }
    drop(msg);
    ctx.ledger.ended(id, End::Finished);
    Out {
        id,
        _live: ctx.ledger.outs.token(),
    }
}

/// A graceful stop that must finish (every event keeps being fired).
fn graceful(
    executor: &KeyedExecutor,
    dispatchers: &[Dispatcher<u32, Msg, Out>],
    events: &Events,
    rxs: &[Rx],
) {
    if !executor.shutdown(LONG) {
        panic!(
            "graceful stop did not finish: {:#?}\nlive mailboxes {:?}, unfired events {}, \
             in flight {:?}",
            executor.stats(),
            dispatchers
                .iter()
                .map(|d| d.live_mailboxes())
                .collect::<Vec<_>>(),
            events.unfired(),
            rxs.iter().map(|r| r.in_flight()).collect::<Vec<_>>(),
        );
    }
}

/// The hooks account for fire-and-forget messages: rejected by a force stop,
/// or panicked.
fn with_hooks<H>(
    b: DispatcherBuilder<'_, u32, Msg, H>,
    ledger: &Arc<Ledger>,
) -> Dispatcher<u32, Msg, Out>
where
    H: Handler<u32, Msg, Output = Out>,
{
    let (l1, l2) = (ledger.clone(), ledger.clone());
    b.on_reject(move |_key, msg: Msg| l1.hook_reject(msg.id))
        .on_panic(move |_key, p: Panic| match panic_id(&p) {
            Some(id) => l2.hook_panic(id),
            None => l2.fail(format!("a panic without an id: {}", p.message())),
        })
        .build()
}

// ----- one round --------------------------------------------------------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum StopPlan {
    Graceful,
    GracefulShortThenForce,
    Force,
    InsideGraceful,
    InsideForce,
    /// Receivers stop one by one at once (`Receiver::shutdown_now`), then
    /// a dispatcher (`Dispatcher::shutdown_now`), then the executor.
    SourcesThenForce,
}

#[derive(Debug, Clone)]
struct Plan {
    workers: usize,
    throughput: usize,
    spin_us: u64,
    /// `max_in_flight` per receiver, and each receiver's dispatcher.
    rx_max: Vec<usize>,
    rx_disp: Vec<usize>,
    keys: u64,
    producers: usize,
    per_producer: u64,
    p_panic: u64,
    p_wait: u64,
    p_yield: u64,
    p_child: u64,
    p_drop_panics: u64,
    p_keep: u64,
    stop: StopPlan,
    stop_after: usize,
}

impl Plan {
    fn generate(rng: &mut Rng) -> Plan {
        let n_async = rng.range(1, 2) as usize;
        let mut rx_disp = vec![0; n_async];
        rx_disp.push(1);
        let rx_max = rx_disp.iter().map(|_| rng.range(1, 12) as usize).collect();
        let producers = rng.range(2, 3) as usize;
        let per_producer = rng.range(20, 220);
        let stop = match rng.below(6) {
            0 => StopPlan::Graceful,
            1 => StopPlan::GracefulShortThenForce,
            2 => StopPlan::Force,
            3 => StopPlan::InsideGraceful,
            4 => StopPlan::InsideForce,
            _ => StopPlan::SourcesThenForce,
        };
        Plan {
            workers: rng.range(1, 3) as usize,
            throughput: *[1, 2, 4, 16].get(rng.below(4) as usize).unwrap(),
            spin_us: if rng.percent(25) {
                rng.range(1, 200)
            } else {
                0
            },
            rx_max,
            rx_disp,
            keys: rng.range(1, 12),
            producers,
            per_producer,
            p_panic: rng.below(15),
            p_wait: rng.below(30),
            p_yield: rng.below(20),
            p_child: rng.below(15),
            p_drop_panics: rng.below(10),
            p_keep: rng.below(101),
            stop,
            stop_after: rng.below(producers as u64 * per_producer + 1) as usize,
        }
    }

    fn op(&self, rng: &mut Rng, disp: usize, events: &Events) -> Op {
        let r = rng.below(100);
        let mut t = self.p_panic;
        if r < t {
            return if rng.percent(50) {
                Op::PanicAtCall
            } else {
                Op::PanicInFuture
            };
        }
        t += self.p_child;
        if r < t {
            let rx = rng.below(self.rx_disp.len() as u64) as usize;
            return Op::Child(ChildPlan {
                rx,
                key: rng.zipf(self.keys) as u32,
                send: rng.percent(40),
                keep: rng.percent(self.p_keep),
                op: rng.below(3) as u8,
            });
        }
        if disp == 1 {
            return Op::Ok; // the sync handler cannot wait
        }
        t += self.p_wait;
        if r < t {
            return Op::Wait(events.add());
        }
        t += self.p_yield;
        if r < t {
            return Op::Yield;
        }
        Op::Ok
    }
}

#[derive(Default)]
struct Tally {
    rounds: u64,
    messages: u64,
    accepted: u64,
    refused: u64,
    done: u64,
    panicked: u64,
    rejected: u64,
    cancelled: u64,
    stops: HashMap<String, u64>,
    stale_wakes: u64,
}

struct Producer {
    p: usize,
    rng: Rng,
    rxs: Vec<Rx>,
}

fn produce(me: Producer, plan: &Plan, ctx: &Arc<Ctx>) -> Vec<Handle> {
    let Producer { p, mut rng, rxs } = me;
    let ledger = &ctx.ledger;
    let mut kept = Vec::new();
    let mut closed = 0;
    let waker = futures::task::noop_waker();
    for seq in 0..plan.per_producer {
        if closed >= 3 {
            break; // a few refusals after the stop are enough
        }
        let src = rng.below(rxs.len() as u64) as usize;
        let disp = plan.rx_disp[src];
        let key = rng.zipf(plan.keys) as u32;
        let op = plan.op(&mut rng, disp, &ctx.events);
        let method = rng.below(7);
        let send = matches!(method, 3..=5);
        let keep = !send && rng.percent(plan.p_keep);
        let meta = Meta {
            disp,
            key,
            src,
            stream: p as u64,
            seq,
            how: if send {
                How::Send
            } else {
                How::Submit { keep }
            },
        };
        let drop_panics = disp == 0 && rng.percent(plan.p_drop_panics);
        let msg = ledger.create(meta, op, drop_panics);
        let id = msg.id;
        let rx = &rxs[src];
        let submitted: Result<Option<Completion<Out, Msg>>, SubmitError<Msg>> = match method {
            0 => rx.submit_blocking(key, msg).map(Some),
            1 => rx.try_submit(key, msg).map(Some),
            2 => futures::executor::block_on(rx.submit(key, msg)).map(Some),
            3 => rx.send(key, msg).map(|_| None),
            4 => rx.try_send(key, msg).map(|_| None),
            5 => futures::executor::block_on(rx.send_async(key, msg)).map(|_| None),
            _ => {
                // Poll once; if it must wait for credit, give up (drop it).
                let mut fut = rx.submit(key, msg);
                match poll_once(&mut fut, &waker) {
                    Poll::Ready(r) => r.map(Some),
                    Poll::Pending => {
                        drop(fut);
                        ledger.refused(id);
                        continue;
                    }
                }
            }
        };
        match submitted {
            Ok(c) => {
                ledger.accepted(id);
                if let Some(c) = c {
                    if keep {
                        if rng.percent(10) {
                            // Wait right away, sometimes with a short timeout
                            // first (the handle comes back).
                            let c = match c.wait_timeout(Duration::from_micros(rng.below(50))) {
                                Ok(outcome) => {
                                    ledger.record(id, outcome);
                                    continue;
                                }
                                Err(c) => c,
                            };
                            // ... then as a future.
                            match await_bounded(c) {
                                Ok(outcome) => ledger.record(id, outcome),
                                Err(_) => ledger.fail(format!(
                                    "completion of {id} never resolved: {:?}",
                                    ledger.st.lock().unwrap().recs.get(&id)
                                )),
                            }
                        } else {
                            kept.push((id, c));
                        }
                    }
                }
            }
            Err(e) => {
                if e.is_closed() {
                    closed += 1;
                } else if matches!(method, 0 | 2 | 3 | 5) {
                    ledger.with(id, |_, errs| {
                        errs.push(format!("{id}: a waiting submit returned Full"))
                    });
                }
                refused(ledger, id, e);
            }
        }
        if rng.percent(3) {
            std::thread::yield_now();
        }
    }
    kept
}

/// Awaits a completion as a future (polled with a thread waker), giving up
/// after a generous bound.
fn await_bounded(mut c: Completion<Out, Msg>) -> Result<Result<Out, TaskError<Msg>>, ()> {
    let waker = thread_waker();
    let deadline = std::time::Instant::now() + LONG;
    loop {
        if let Poll::Ready(outcome) = poll_once(&mut c, &waker) {
            return Ok(outcome);
        }
        if std::time::Instant::now() >= deadline {
            return Err(());
        }
        std::thread::park_timeout(Duration::from_millis(10));
    }
}

fn run_round(seed: u64, tally: &mut Tally) {
    let _replay = Replay::new("executor_model_random_schedules", seed);
    let mut rng = Rng::new(seed);
    let plan = Plan::generate(&mut rng);
    if std::env::var("KEYED_SEED").is_ok() {
        eprintln!("{plan:#?}");
    }
    let prefix = unique_prefix("rlx");
    let executor = KeyedExecutor::builder()
        .workers(plan.workers)
        .throughput(plan.throughput)
        .spin(Duration::from_micros(plan.spin_us))
        .thread_name(prefix.clone())
        .build()
        .unwrap();
    assert_eq!(threads_named(&format!("{prefix}-")), plan.workers);

    let ledger = Ledger::new(plan.rx_max.clone());
    let events = Events::new();
    let handlers = Live::new();
    let ctx = Arc::new(Ctx {
        ledger: ledger.clone(),
        events: events.clone(),
        rxs: Mutex::new(None),
        rx_disp: plan.rx_disp.clone(),
        exec: Mutex::new(Some(executor.clone())),
        stop_inside: AtomicU8::new(0),
        inside_graceful_returned_true: AtomicBool::new(false),
        child_handles: Mutex::new(Vec::new()),
    });

    let (c0, t0) = (ctx.clone(), handlers.token());
    let d_async: Dispatcher<u32, Msg, Out> = with_hooks(
        executor.dispatcher_builder(handler::from_async_fn(move |key: u32, msg: Msg| {
            let _ = &t0;
            async_call(&c0, key, msg)
        })),
        &ledger,
    );
    let (c1, t1) = (ctx.clone(), handlers.token());
    let d_sync: Dispatcher<u32, Msg, Out> = with_hooks(
        executor.dispatcher_builder(handler::from_fn(move |key: &u32, msg: Msg| {
            let _ = &t1;
            sync_call(&c1, *key, msg)
        })),
        &ledger,
    );
    let dispatchers = [d_async, d_sync];
    let rxs: Vec<Rx> = plan
        .rx_disp
        .iter()
        .zip(&plan.rx_max)
        .map(|(&d, &max)| dispatchers[d].receiver(max).unwrap())
        .collect();
    *ctx.rxs.lock().unwrap() = Some(rxs.clone());

    let quit = Arc::new(AtomicBool::new(false));
    let firer = spawn_firer(events.clone(), rng.fork(), quit.clone());
    let sampler = {
        let (quit, rxs, ledger) = (quit.clone(), rxs.clone(), ledger.clone());
        let dispatchers = dispatchers.clone();
        let plan = plan.clone();
        std::thread::spawn(move || {
            let mut samples = 0u64;
            loop {
                let last = quit.load(SeqCst);
                for (i, rx) in rxs.iter().enumerate() {
                    let n = rx.in_flight();
                    if n > rx.max_in_flight() {
                        ledger.fail(format!("rx {i}: in_flight {n} > max"));
                    }
                }
                for (d, disp) in dispatchers.iter().enumerate() {
                    let credit: usize = (plan.rx_disp.iter().zip(&plan.rx_max))
                        .filter(|(&rd, _)| rd == d)
                        .map(|(_, &m)| m)
                        .sum();
                    // A mailbox lives while it holds an unfinished message,
                    // and for one more turn once a message that spent its
                    // throughput emptied it (it then retires): at most one
                    // such leftover per unfinished message that took its
                    // place in the worker queue, plus one per worker.
                    let live = disp.live_mailboxes();
                    if live > 2 * (credit + plan.workers) {
                        ledger.fail(format!("dispatcher {d}: {live} mailboxes, {credit} credit"));
                    }
                    MAX_EXCESS.fetch_max(live.saturating_sub(credit), SeqCst);
                }
                samples += 1;
                if last {
                    break samples;
                }
                std::thread::sleep(Duration::from_micros(100));
            }
        })
    };

    let producers: Vec<_> = (0..plan.producers)
        .map(|p| {
            let me = Producer {
                p,
                rng: rng.fork(),
                rxs: rxs.clone(),
            };
            let (plan, ctx) = (plan.clone(), ctx.clone());
            std::thread::spawn(move || produce(me, &plan, &ctx))
        })
        .collect();

    // The stop, at a random point.
    eventually("the stop point", || {
        ledger.accepted.load(SeqCst) >= plan.stop_after || producers.iter().all(|p| p.is_finished())
    });
    let forced = match plan.stop {
        StopPlan::Graceful => {
            graceful(&executor, &dispatchers, &events, &rxs);
            false
        }
        StopPlan::GracefulShortThenForce => {
            let drained = executor.shutdown(Duration::from_micros(rng.below(2000)));
            executor.shutdown_now();
            !drained
        }
        StopPlan::Force => {
            executor.shutdown_now();
            true
        }
        StopPlan::SourcesThenForce => {
            // A random order, producers still sending: each stopped source
            // refuses from then on, the others go on until their turn.
            let mut order: Vec<usize> = (0..rxs.len()).collect();
            for i in (1..order.len()).rev() {
                order.swap(i, rng.below(i as u64 + 1) as usize);
            }
            for i in order {
                rxs[i].shutdown_now();
                assert!(rxs[i].is_closed());
            }
            dispatchers[rng.below(dispatchers.len() as u64) as usize].shutdown_now();
            executor.shutdown_now();
            true
        }
        StopPlan::InsideGraceful | StopPlan::InsideForce => {
            let how = if plan.stop == StopPlan::InsideGraceful {
                1
            } else {
                2
            };
            ctx.stop_inside.store(how, SeqCst);
            eventually("a handler ran the stop (or nothing is left to run)", || {
                executor.is_shutdown() || producers.iter().all(|p| p.is_finished())
            });
            if ctx.stop_inside.swap(0, SeqCst) != 0 {
                // No handler ran after the flag: stop from here instead.
                if how == 1 {
                    executor.shutdown(Duration::ZERO);
                } else {
                    executor.shutdown_now();
                }
            }
            if how == 1 {
                graceful(&executor, &dispatchers, &events, &rxs);
                false
            } else {
                executor.shutdown_now();
                true
            }
        }
    };
    *tally.stops.entry(format!("{:?}", plan.stop)).or_default() += 1;
    assert!(
        !ctx.inside_graceful_returned_true.load(SeqCst),
        "shutdown from a worker must return false at once"
    );
    let mut kept: Vec<Handle> = Vec::new();
    for p in producers {
        kept.extend(p.join().expect("producer"));
    }
    // Idempotent, and both report the pool gone.
    executor.shutdown_now();
    assert!(executor.shutdown(Duration::ZERO));
    assert!(executor.is_terminated());

    quit.store(true, SeqCst);
    firer.join().unwrap();
    let samples = sampler.join().unwrap();
    assert!(samples > 0);
    events.fire_all();

    kept.extend(std::mem::take(&mut *ctx.child_handles.lock().unwrap()));
    for (id, c) in kept {
        match c.wait_timeout(LONG) {
            Ok(outcome) => ledger.record(id, outcome),
            Err(_) => panic!(
                "completion of {id} never resolved: {:?}; plan {plan:?}; stats {:?}",
                ledger.st.lock().unwrap().recs.get(&id),
                executor.stats()
            ),
        }
    }

    // Nothing left behind by the stop.
    eventually("worker threads gone", || {
        threads_named(&format!("{prefix}-")) == 0
    });
    let stats = executor.stats();
    assert_eq!(stats.live_mailboxes, 0);
    for d in &dispatchers {
        assert_eq!(d.live_mailboxes(), 0);
    }
    let held: Vec<usize> = rxs.iter().map(|r| r.in_flight()).collect();
    if held.iter().any(|&n| n > 0) {
        // Which accepted messages never ended nor were handed back?
        let st = ledger.st.lock().unwrap();
        let suspects: Vec<String> = st
            .recs
            .iter()
            .filter(|(_, r)| {
                r.accepted == 1
                    && r.end.is_none()
                    && r.hook_reject == 0
                    && r.delivered != Some(Delivered::Rejected)
            })
            .map(|(id, r)| format!("{id}: {r:?}"))
            .collect();
        panic!(
            "credit left after the stop: {held:?}; plan {plan:?}; stats {:?}; \
             accepted messages with no end and no hand-back: {suspects:#?}",
            executor.stats()
        );
    }
    tally.stale_wakes += events.wake_stale() as u64;

    // Drop everything; nothing may stay alive.
    ctx.rxs.lock().unwrap().take();
    ctx.exec.lock().unwrap().take();
    events.clear();
    drop(rxs);
    drop(dispatchers);
    drop(executor);
    assert_eq!(handlers.count(), 0, "a dispatcher (and its handler) leaked");
    assert_eq!(ledger.futures.count(), 0, "a handler future leaked");
    assert_eq!(ledger.outs.count(), 0, "an output leaked");

    // The model.
    let st = ledger.st.lock().unwrap();
    assert!(st.errors.is_empty(), "violations: {:#?}", st.errors);
    let (mut done, mut panicked, mut rejected, mut cancelled) = (0, 0, 0, 0);
    for (&id, r) in &st.recs {
        let ctx_msg = || format!("message {id}: {r:?} (plan {plan:?})");
        assert_eq!(r.msg_drops, 1, "dropped != once: {}", ctx_msg());
        assert_eq!(r.accepted + r.refused, 1, "{}", ctx_msg());
        if r.refused == 1 {
            assert!(
                r.started == 0 && r.ends == 0 && r.deliveries == 0,
                "{}",
                ctx_msg()
            );
            assert!(r.hook_reject == 0 && r.hook_panic == 0, "{}", ctx_msg());
            tally.refused += 1;
            continue;
        }
        tally.accepted += 1;
        assert!(r.started <= 1 && r.ends == r.started, "{}", ctx_msg());
        let fate = match r.end {
            Some(End::Finished) => {
                done += 1;
                Delivered::Ok
            }
            Some(End::Panicked) => {
                panicked += 1;
                Delivered::Panicked
            }
            Some(End::Cancelled) => {
                cancelled += 1;
                Delivered::Cancelled
            }
            None => {
                rejected += 1;
                Delivered::Rejected
            }
        };
        if !forced {
            assert!(
                matches!(fate, Delivered::Ok | Delivered::Panicked),
                "a graceful stop rejected or cancelled: {}",
                ctx_msg()
            );
        }
        match r.meta.how {
            How::Submit { keep: true } => {
                assert_eq!(r.deliveries, 1, "{}", ctx_msg());
                assert_eq!(r.delivered, Some(fate), "{}", ctx_msg());
            }
            How::Submit { keep: false } => assert_eq!(r.deliveries, 0, "{}", ctx_msg()),
            How::Send => {
                assert_eq!(
                    r.hook_reject,
                    u8::from(fate == Delivered::Rejected),
                    "{}",
                    ctx_msg()
                );
                assert_eq!(
                    r.hook_panic,
                    u8::from(fate == Delivered::Panicked),
                    "{}",
                    ctx_msg()
                );
            }
        }
        if !matches!(r.meta.how, How::Send) {
            assert!(r.hook_reject == 0 && r.hook_panic == 0, "{}", ctx_msg());
        }
    }
    assert_eq!(stats.done, done, "executor counted done");
    assert_eq!(stats.panicked, panicked, "executor counted panicked");
    assert_eq!(stats.rejected, rejected, "executor counted rejected");
    assert_eq!(stats.cancelled, cancelled, "executor counted cancelled");
    tally.rounds += 1;
    tally.messages += st.recs.len() as u64;
    tally.done += done;
    tally.panicked += panicked;
    tally.rejected += rejected;
    tally.cancelled += cancelled;
}

#[test]
fn executor_model_random_schedules() {
    quiet_injected_panics();
    let mut tally = Tally::default();
    for seed in seeds(1500) {
        run_round(seed, &mut tally);
    }
    eprintln!(
        "executor model: {} rounds, {} messages ({} accepted, {} refused and handed back): \
         {} done, {} panicked, {} rejected, {} cancelled; stops {:?}; {} stale wakes; \
         values leaked: 0; live mailboxes at most {} beyond the credit",
        tally.rounds,
        tally.messages,
        tally.accepted,
        tally.refused,
        tally.done,
        tally.panicked,
        tally.rejected,
        tally.cancelled,
        tally.stops,
        tally.stale_wakes,
        MAX_EXCESS.load(SeqCst),
    );
}
