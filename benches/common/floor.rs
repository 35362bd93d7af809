//! `contract-floor` (diagnostic, never in the default rows): the striped
//! design plus only the per-message work the crate's contract cannot drop on
//! a throughput run, so the table can say what the contract costs on the
//! cheapest skeleton there is, apart from what the crate's own structure
//! costs.
//!
//! The skeleton is striped's: a thread per stripe draining its own unbounded
//! crossbeam channel, a key always on the same thread. On top of it, each
//! switched by `KEYED_BENCH_FLOOR` (comma-separated; unset:
//! `credit,turns,return=16`, the crate's own granularity):
//!
//! - `credit`: a hard bound on each source's accepted, unfinished messages
//!   (the crate's `max_in_flight`, [`Cfg::credit`]): a send takes units with
//!   a CAS (`reserve=R` at a time into the sending thread's reserve; 1 by
//!   default, as the crate) and waits while there is none (spinning and
//!   yielding as crossbeam's bounded channel does, then it parks); the
//!   handler's thread gives units back `return=B` at a time (and all it
//!   owes before it waits for work) and wakes a waiting sender. Each source
//!   ([`Design::source`]) has its own bound, as each of the crate's
//!   receivers has. A handler's own sends (W4) take no unit. `sharded`
//!   keeps the same bound without a counter the threads share for
//!   writing: senders count units taken, each worker the units it gave
//!   back on a line of its own, and a sender sums the workers' lines only
//!   when the sum it saw last leaves nothing free (a stale sum only
//!   understates what is free). `perworker` splits the bound per (source,
//!   worker), `max_in_flight ÷ workers` each, as bounded striped channels
//!   split it: not the crate's contract (a hot key gets one worker's share,
//!   and W5, which holds every message until all are sent, hangs on it),
//!   there to tell the cost of sharing a count from the cost of keeping one.
//! - `turns`: the fairness bound. A worker runs its channel in turns (a turn
//!   takes what the channel held when it began), counts each key's messages
//!   in the turn, and a key past `throughput` (16, the harness's setting for
//!   the crate) waits, in order, until the next turn. The counts are a
//!   direct-mapped table per worker (a slot of another turn is free, so a
//!   turn ends without clearing it) and a map for the keys whose slot
//!   another key of the turn holds: exact, and memory follows the live
//!   keys.
//!
//! Left out, because a throughput run with a sync handler never needs them:
//! async handlers (a pending future would hold the thread here), work
//! conservation (a slow key stalls its stripe), stops that hand messages
//! back, commit points, forwarding. So this is a floor, not a design a user
//! could adopt: the crate can only be as cheap as this plus those.

use super::design::{Cfg, Design, Family, Handler, SendTo};
use super::peers::stripe;
use super::work::Msg;
use crossbeam_channel::{unbounded, Receiver, Sender};
use crossbeam_utils::CachePadded;
use rustc_hash::FxHashMap;
use std::collections::VecDeque;
use std::marker::PhantomData;
use std::sync::atomic::{fence, AtomicBool, AtomicUsize, Ordering::*};
use std::sync::{Arc, Mutex};
use std::thread::{JoinHandle, Thread};

/// The fairness bound's turn length, the harness's `throughput` for the crate.
const THROUGHPUT: u32 = 16;
/// Sources a run may open (W7 opens one per producer).
const SOURCES: usize = 16;
/// Credits a run may hold: a source's, or with `perworker` a source's per
/// worker (up to 8 workers).
const SLOTS_OF_CREDIT: usize = SOURCES * 8;
/// The source of a handler's sends, which take no credit.
const UNBOUNDED: u8 = u8::MAX;

/// See the module docs.
pub struct FloorFamily;

impl Family for FloorFamily {
    type D<H: Handler> = Floor<H>;
    const BLOCKS_ON_IO: bool = true;
}

/// Which parts of the contract this run pays for (`KEYED_BENCH_FLOOR`).
#[derive(Clone, Copy, Debug)]
pub struct Parts {
    /// A bounded credit per source.
    pub credit: bool,
    /// Per-key turn counts.
    pub turns: bool,
    /// Units a sender takes from its source's bound at once, kept in a
    /// thread-local reserve (`reserve=R`; 1: a CAS per message).
    pub reserve: usize,
    /// Units a worker gives back at once (`return=B`; 1: per message); it
    /// gives back whatever it owes before it waits for work.
    pub give_back: usize,
    /// The bound kept as counts nobody shares for writing (`sharded`): the
    /// senders count units taken, each worker the units it gave back on a
    /// line of its own (a plain store, no locked instruction), and a
    /// sender adds the workers' counts up only when the sum it saw last
    /// leaves no unit free.
    pub sharded: bool,
    /// The bound split per worker (`perworker`): `max_in_flight ÷ workers`
    /// units for each (source, worker), as bounded striped channels split
    /// it. Not the crate's contract (a hot key gets a worker's share only);
    /// here to tell the cost of a bound shared by the workers from the cost
    /// of waiting at a bound.
    pub perworker: bool,
}

impl Parts {
    /// From `KEYED_BENCH_FLOOR`, e.g. `credit,turns,reserve=64,return=64`
    /// (a number left out is 1; unset: `credit,turns,return=16`).
    pub fn from_env() -> Self {
        match std::env::var("KEYED_BENCH_FLOOR") {
            Ok(v) => {
                let num = |name: &str| {
                    v.split(',')
                        .filter_map(|p| p.trim().strip_prefix(name))
                        .filter_map(|n| n.parse::<usize>().ok())
                        .next()
                        .unwrap_or(1)
                        .max(1)
                };
                Parts {
                    credit: v.split(',').any(|p| p.trim() == "credit"),
                    turns: v.split(',').any(|p| p.trim() == "turns"),
                    reserve: num("reserve="),
                    give_back: num("return="),
                    sharded: v.split(',').any(|p| p.trim() == "sharded"),
                    perworker: v.split(',').any(|p| p.trim() == "perworker"),
                }
            }
            // The crate's own granularity: a unit per send, given back 16
            // at a time (its batch at `max_in_flight` 1,024).
            Err(_) => Parts {
                credit: true,
                turns: true,
                reserve: 1,
                give_back: 16,
                sharded: false,
                perworker: false,
            },
        }
    }
}

/// One source's bound: free units (or, `sharded`, units taken against
/// units given back per worker), and the senders parked for one.
struct Credit {
    max: usize,
    sharded: bool,
    free: CachePadded<AtomicUsize>,
    /// `sharded`: units ever taken.
    taken: CachePadded<AtomicUsize>,
    /// `sharded`: the workers' units given back, as a sender last summed
    /// them (never more than they gave: the bound holds on a stale sum).
    seen: CachePadded<AtomicUsize>,
    /// `sharded`: units ever given back, a line per worker, one writer each.
    given: Box<[CachePadded<AtomicUsize>]>,
    waiting: CachePadded<AtomicBool>,
    parked: Mutex<Vec<Thread>>,
}

impl Credit {
    fn new(units: usize, workers: usize, sharded: bool) -> Self {
        Credit {
            max: units,
            sharded,
            free: CachePadded::new(AtomicUsize::new(units)),
            taken: CachePadded::new(AtomicUsize::new(0)),
            seen: CachePadded::new(AtomicUsize::new(0)),
            given: (0..workers)
                .map(|_| CachePadded::new(AtomicUsize::new(0)))
                .collect(),
            waiting: CachePadded::new(AtomicBool::new(false)),
            parked: Mutex::new(Vec::new()),
        }
    }

    /// Takes up to `want` units; how many it took.
    fn try_take(&self, want: usize) -> usize {
        if self.sharded {
            return self.try_take_sharded(want);
        }
        let mut cur = self.free.load(Relaxed);
        while cur > 0 {
            let got = cur.min(want);
            match self
                .free
                .compare_exchange_weak(cur, cur - got, Acquire, Relaxed)
            {
                Ok(_) => return got,
                Err(now) => cur = now,
            }
        }
        0
    }

    fn try_take_sharded(&self, want: usize) -> usize {
        let mut taken = self.taken.load(Relaxed);
        loop {
            // With `taken` stale the CAS below fails; saturating keeps the
            // arithmetic from wrapping meanwhile.
            let mut free = self
                .max
                .saturating_sub(taken.saturating_sub(self.seen.load(Acquire)));
            if free == 0 {
                // The last sum leaves nothing: add the workers' counts up.
                fence(SeqCst);
                let sum: usize = self.given.iter().map(|g| g.load(Acquire)).sum();
                self.seen.fetch_max(sum, AcqRel);
                free = self
                    .max
                    .saturating_sub(taken.saturating_sub(self.seen.load(Acquire)));
                if free == 0 {
                    return 0;
                }
            }
            let got = free.min(want);
            match self
                .taken
                .compare_exchange_weak(taken, taken + got, AcqRel, Relaxed)
            {
                Ok(_) => return got,
                Err(now) => taken = now,
            }
        }
    }

    /// Takes a unit, waiting for one: spins and yields as crossbeam's
    /// bounded channel does (`Backoff::snooze`), then parks until a finished
    /// message wakes it (with a timeout as a guard).
    fn take(&self, want: usize) -> usize {
        let backoff = crossbeam_utils::Backoff::new();
        while !backoff.is_completed() {
            match self.try_take(want) {
                0 => backoff.snooze(),
                got => return got,
            }
        }
        loop {
            self.parked.lock().unwrap().push(std::thread::current());
            self.waiting.store(true, SeqCst);
            match self.try_take(want) {
                0 => {}
                got => return got,
            }
            std::thread::park_timeout(std::time::Duration::from_millis(1));
            match self.try_take(want) {
                0 => {}
                got => return got,
            }
        }
    }

    /// Worker `worker` gives back `units`.
    fn give(&self, worker: usize, units: usize) {
        if self.sharded {
            // One writer per line: a load and a store.
            let g = &self.given[worker];
            g.store(g.load(Relaxed) + units, Release);
            fence(SeqCst);
        } else {
            self.free.fetch_add(units, SeqCst);
        }
        if self.waiting.load(SeqCst) && self.waiting.swap(false, SeqCst) {
            for t in self.parked.lock().unwrap().drain(..) {
                t.unpark();
            }
        }
    }
}

enum Cmd {
    Run(u64, Msg, u8),
    Stop,
}

/// The floor design.
pub struct Floor<H> {
    txs: Arc<[Sender<Cmd>]>,
    credits: Arc<[Credit]>,
    next_source: AtomicUsize,
    parts: Parts,
    threads: Vec<JoinHandle<()>>,
    _handler: PhantomData<fn(H)>,
}

/// Its sender: a source's credit, the key's stripe.
#[derive(Clone)]
pub struct FloorSender {
    txs: Arc<[Sender<Cmd>]>,
    credits: Arc<[Credit]>,
    source: u8,
    credit: bool,
    reserve: usize,
    perworker: bool,
}

thread_local! {
    /// Each sending thread's reserve of units, per source.
    static RESERVE: [std::cell::Cell<usize>; SLOTS_OF_CREDIT] = const { [const { std::cell::Cell::new(0) }; SLOTS_OF_CREDIT] };
}

impl SendTo for FloorSender {
    #[inline]
    fn send(&self, key: u64, msg: Msg) {
        let stripe = stripe(key, self.txs.len());
        if self.credit && self.source != UNBOUNDED {
            let src = if self.perworker {
                self.source as usize * self.txs.len() + stripe
            } else {
                self.source as usize
            };
            RESERVE.with(|r| {
                let left = r[src].get();
                if left > 0 {
                    r[src].set(left - 1);
                } else {
                    let got = self.credits[src].take(self.reserve);
                    r[src].set(got - 1);
                }
            });
        }
        let tx = &self.txs[stripe];
        if tx.send(Cmd::Run(key, msg, self.source)).is_err() {
            panic!("contract-floor: sent after finish");
        }
    }
}

/// A worker's fairness state: this turn's count per key, and the keys past
/// the bound with what waits behind them, in the order they went past it.
struct Turns {
    /// This turn's counts, direct-mapped by key: a slot whose turn is not
    /// this one is free. Exact: a key whose slot another key holds is
    /// counted in `spill`.
    slots: Box<[Slot]>,
    spill: FxHashMap<u64, u32>,
    turn: u32,
    waiting: FxHashMap<u64, VecDeque<(Msg, u8)>>,
    order: VecDeque<u64>,
}

#[derive(Clone, Copy, Default)]
struct Slot {
    key: u64,
    turn: u32,
    count: u32,
}

/// Slots in a worker's count table (16 bytes each: 64 KiB).
const SLOTS: usize = 4096;

impl Turns {
    fn new() -> Self {
        Turns {
            slots: vec![Slot::default(); SLOTS].into(),
            spill: FxHashMap::default(),
            turn: 1,
            waiting: FxHashMap::default(),
            order: VecDeque::new(),
        }
    }

    /// Counts one more message of `k` in this turn; the count.
    #[inline]
    fn count(&mut self, k: u64) -> u32 {
        let i = (k.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 52) as usize % SLOTS;
        let s = &mut self.slots[i];
        if s.turn != self.turn {
            *s = Slot {
                key: k,
                turn: self.turn,
                count: 1,
            };
            1
        } else if s.key == k {
            s.count += 1;
            s.count
        } else {
            let n = self.spill.entry(k).or_insert(0);
            *n += 1;
            *n
        }
    }

    /// The turn ends: every count goes.
    fn end(&mut self) {
        self.turn = self.turn.wrapping_add(1);
        if self.turn == 0 {
            self.slots.fill(Slot::default());
            self.turn = 1;
        }
        if !self.spill.is_empty() {
            self.spill.clear();
        }
    }
}

fn worker<H: Handler>(
    me: usize,
    rx: Receiver<Cmd>,
    h: Arc<H>,
    credits: Arc<[Credit]>,
    parts: Parts,
) {
    let owed: [std::cell::Cell<usize>; SOURCES] = Default::default();
    let workers = if parts.perworker {
        credits.len() / SOURCES
    } else {
        1
    };
    // A source's credit, or its share for this worker.
    let mine = |src: usize| {
        if parts.perworker {
            src * workers + me
        } else {
            src
        }
    };
    let run = |k: u64, m: Msg, src: u8| {
        h.call_blocking(k, m);
        if parts.credit && src != UNBOUNDED {
            let o = &owed[src as usize];
            let n = o.get() + 1;
            if n >= parts.give_back {
                credits[mine(src as usize)].give(me, n);
                o.set(0);
            } else {
                o.set(n);
            }
        }
    };
    // Before waiting for work: give back every unit owed.
    let settle = || {
        for (i, o) in owed.iter().enumerate() {
            if o.get() > 0 {
                credits[mine(i)].give(me, o.replace(0));
            }
        }
    };
    let recv = || match rx.try_recv() {
        Ok(c) => Some(c),
        Err(_) => {
            settle();
            rx.recv().ok()
        }
    };
    if !parts.turns {
        while let Some(cmd) = recv() {
            match cmd {
                Cmd::Run(k, m, s) => run(k, m, s),
                Cmd::Stop => return,
            }
        }
        return;
    }
    let mut t = Turns::new();
    loop {
        // A turn: what the channel holds now (at least one: block for it
        // unless keys wait from the last turn).
        let held = rx.len();
        let mut first = if held == 0 && t.order.is_empty() {
            match recv() {
                Some(c) => Some(c),
                None => return,
            }
        } else {
            None
        };
        let mut left = held;
        // Keys held back last turn go first, up to the bound each.
        for _ in 0..t.order.len() {
            let k = t.order.pop_front().expect("counted");
            let q = t.waiting.get_mut(&k).expect("ordered keys wait");
            for _ in 0..THROUGHPUT {
                match q.pop_front() {
                    Some((m, s)) => run(k, m, s),
                    None => break,
                }
            }
            if q.is_empty() {
                t.waiting.remove(&k);
            } else {
                t.order.push_back(k);
            }
        }
        loop {
            let cmd = match first.take() {
                Some(c) => c,
                None if left > 0 => {
                    left -= 1;
                    match rx.try_recv() {
                        Ok(c) => c,
                        Err(_) => break,
                    }
                }
                None => break,
            };
            let (k, m, s) = match cmd {
                Cmd::Run(k, m, s) => (k, m, s),
                Cmd::Stop => return,
            };
            if let Some(q) = t.waiting.get_mut(&k) {
                q.push_back((m, s));
                continue;
            }
            if t.count(k) > THROUGHPUT {
                t.waiting.entry(k).or_default().push_back((m, s));
                t.order.push_back(k);
            } else {
                run(k, m, s);
            }
        }
        t.end();
        settle();
    }
}

impl<H: Handler> Design<H> for Floor<H> {
    type Sender = FloorSender;

    fn start(cfg: &Cfg, handler: H) -> Self {
        let parts = Parts::from_env();
        let handler = Arc::new(handler);
        assert!(
            !parts.perworker || cfg.workers * SOURCES <= SLOTS_OF_CREDIT,
            "contract-floor: perworker takes at most 8 workers"
        );
        let credits: Arc<[Credit]> = if parts.perworker {
            let share = (cfg.credit / cfg.workers).max(1);
            (0..SOURCES * cfg.workers)
                .map(|_| Credit::new(share, cfg.workers, parts.sharded))
                .collect()
        } else {
            (0..SOURCES)
                .map(|_| Credit::new(cfg.credit, cfg.workers, parts.sharded))
                .collect()
        };
        let mut txs = Vec::new();
        let mut threads = Vec::new();
        for i in 0..cfg.workers {
            let (tx, rx) = unbounded();
            let (h, c) = (handler.clone(), credits.clone());
            threads.push(
                std::thread::Builder::new()
                    .name(format!("floor-{i}"))
                    .spawn(move || worker(i, rx, h, c, parts))
                    .expect("spawn"),
            );
            txs.push(tx);
        }
        Floor {
            txs: txs.into(),
            credits,
            next_source: AtomicUsize::new(1),
            parts,
            threads,
            _handler: PhantomData,
        }
    }

    fn sender(&self) -> FloorSender {
        FloorSender {
            txs: self.txs.clone(),
            credits: self.credits.clone(),
            source: 0,
            credit: self.parts.credit,
            reserve: self.parts.reserve,
            perworker: self.parts.perworker,
        }
    }

    fn source(&self) -> FloorSender {
        let n = self.next_source.fetch_add(1, Relaxed);
        assert!(n < SOURCES, "contract-floor: at most {SOURCES} sources");
        FloorSender {
            source: n as u8,
            ..self.sender()
        }
    }

    fn handler_sender(&self) -> Box<dyn Fn(u64, Msg) + Send + Sync> {
        // A handler's send takes no credit: it would block its own worker
        // (the crate's forwarding never waits either).
        let s = FloorSender {
            source: UNBOUNDED,
            ..self.sender()
        };
        Box::new(move |k, m| s.send(k, m))
    }

    fn finish(self) {
        for tx in self.txs.iter() {
            let _ = tx.send(Cmd::Stop);
        }
        for t in self.threads {
            t.join().expect("contract-floor worker panicked");
        }
    }
}
