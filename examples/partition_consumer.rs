//! A consumer of a partitioned transport (think Kafka, Pulsar or a
//! partitioned queue), with at-least-once delivery and per-key order kept
//! across a restart.
//!
//! - The simulated broker has 4 partitions; every record has a key (an
//!   account) and the key's sequence number. A key always lives in one
//!   partition, so a partition's order is each of its keys' order.
//! - One consumer thread per partition, each with its own receiver (one
//!   source, its own credit): it polls records, submits them, and **acks a
//!   record only after its completion says it was applied**.
//! - The handler is async: it awaits a store write (~200 µs on an async-io
//!   timer), then applies the record — per key one at a time, in order.
//! - A rebalance moves partition 3 to another node (here a second
//!   executor in the same process): the old owner stops polling it,
//!   **closes that one receiver** and drains it within a deadline
//!   (`Receiver::shutdown`, else `shutdown_now` hands the rest back), acks
//!   what finished, reports its commit point (`Receiver::committable`), and
//!   only then does the new owner start consuming the partition. The other
//!   partitions, on the same keys' workers, never stop. The store checks
//!   that no key ever runs on two nodes at once.
//! - Midway, the process "crashes": `shutdown_now()`. A write that was in
//!   progress is dropped (`TaskError::Cancelled`), queued records come back
//!   through their completions (`TaskError::Rejected(record)`), and records
//!   offered after the stop are refused (`SubmitError::Closed(record)`). The
//!   consumer nacks them all: the broker will redeliver them.
//! - A new executor then consumes again from the broker, which redelivers
//!   the nacked records first, in offset order. The store checks, for every
//!   key, that records are applied exactly in sequence: nothing lost,
//!   nothing reordered, nothing applied twice.
//!
//! (For fire-and-forget `send`, the dispatcher's `on_reject` hook is where
//! a force stop hands records back instead.)
//!
//! ```text
//! cargo run --release --example partition_consumer
//! ```

use std::collections::{BTreeSet, HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keyed_executor::{handler, Completion, KeyedExecutor, TaskError};

const PARTITIONS: usize = 4;
const KEYS: u64 = 400;
const RECORDS_PER_KEY: u64 = 50;

#[derive(Debug, Clone, Copy)]
struct Record {
    key: u64,
    seq: u64,
    amount: i64,
}

// ---------------------------------------------------------------- broker --

/// One partition: an append-only log, what was delivered, acked, nacked.
#[derive(Default)]
struct Partition {
    log: Vec<Record>,
    /// Next offset never delivered.
    next: usize,
    /// Delivered, neither acked nor nacked yet.
    outstanding: BTreeSet<usize>,
    /// Handed back: redelivered first, in offset order.
    nacked: BTreeSet<usize>,
    acked: usize,
}

#[derive(Default)]
struct Broker {
    partitions: Vec<Mutex<Partition>>,
    redelivered: AtomicU64,
}

impl Broker {
    fn new() -> Self {
        let mut partitions: Vec<Partition> =
            (0..PARTITIONS).map(|_| Partition::default()).collect();
        for seq in 0..RECORDS_PER_KEY {
            for key in 0..KEYS {
                let amount = if seq % 4 == 3 { -5 } else { 10 };
                partitions[(key % PARTITIONS as u64) as usize]
                    .log
                    .push(Record { key, seq, amount });
            }
        }
        Broker {
            partitions: partitions.into_iter().map(Mutex::new).collect(),
            redelivered: AtomicU64::new(0),
        }
    }

    /// Up to `max` records: nacked ones first (lowest offset first), then
    /// new ones. A consumer hands records back only when it stops, so the
    /// next consumer gets each key's unfinished records again, in order,
    /// before that key's later ones.
    fn poll(&self, p: usize, max: usize) -> Vec<(usize, Record)> {
        let mut part = self.partitions[p].lock().unwrap();
        let mut out = Vec::new();
        while out.len() < max {
            let offset = match part.nacked.first() {
                Some(&o) => {
                    part.nacked.remove(&o);
                    self.redelivered.fetch_add(1, Ordering::Relaxed);
                    o
                }
                None if part.next < part.log.len() => {
                    part.next += 1;
                    part.next - 1
                }
                None => break,
            };
            part.outstanding.insert(offset);
            out.push((offset, part.log[offset]));
        }
        out
    }

    fn ack(&self, p: usize, offset: usize) {
        let mut part = self.partitions[p].lock().unwrap();
        assert!(
            part.outstanding.remove(&offset),
            "ack of an offset not outstanding"
        );
        part.acked += 1;
    }

    fn nack(&self, p: usize, offset: usize) {
        let mut part = self.partitions[p].lock().unwrap();
        assert!(
            part.outstanding.remove(&offset),
            "nack of an offset not outstanding"
        );
        part.nacked.insert(offset);
    }

    fn acked(&self) -> usize {
        self.partitions
            .iter()
            .map(|p| p.lock().unwrap().acked)
            .sum()
    }
}

// ----------------------------------------------------------------- store --

/// The consumer's database: per key, the last applied sequence number.
/// Survives the "crash" (it is the durable state).
#[derive(Default)]
struct Store {
    applied: Mutex<HashMap<u64, (u64, i64)>>, // key -> (records applied, balance)
    writes: AtomicU64,
    /// Keys with a write in progress, on any node.
    running: Mutex<HashSet<u64>>,
}

/// Marks a key's write in progress; unmarks it when the write ends or is
/// dropped (cancelled by a stop).
struct Running<'a>(&'a Store, u64);

impl Drop for Running<'_> {
    fn drop(&mut self) {
        self.0.running.lock().unwrap().remove(&self.1);
    }
}

impl Store {
    async fn apply(&self, r: Record) {
        // One key never runs on two nodes at once, even while its
        // partition moves between them.
        assert!(
            self.running.lock().unwrap().insert(r.key),
            "key {} written by two nodes at once",
            r.key
        );
        let _running = Running(self, r.key);
        // The write: ~200 µs, then it takes effect. A force stop that drops
        // this future before the write completes leaves the store unchanged.
        async_io::Timer::after(Duration::from_micros(200)).await;
        let mut applied = self.applied.lock().unwrap();
        let (count, balance) = applied.entry(r.key).or_default();
        // Per-key order across executors: exactly the next record, once.
        assert_eq!(
            *count, r.seq,
            "key {}: record {} out of order or twice",
            r.key, r.seq
        );
        *count += 1;
        *balance += r.amount;
        self.writes.fetch_add(1, Ordering::Relaxed);
    }
}

// -------------------------------------------------------------- consumer --

#[derive(Default, Debug, Clone, Copy)]
struct Tally {
    acked: u64,
    rejected: u64,
    cancelled: u64,
    refused: u64,
}

impl Tally {
    fn add(self, t: Tally) -> Tally {
        Tally {
            acked: self.acked + t.acked,
            rejected: self.rejected + t.rejected,
            cancelled: self.cancelled + t.cancelled,
            refused: self.refused + t.refused,
        }
    }
}

/// What a consumer did when its partition was revoked.
#[derive(Debug, Clone, Copy)]
struct HandOff {
    /// The source drained within the deadline (else it was stopped).
    drained: bool,
    /// Its commit point: how many leading positions all finished.
    committable: u64,
    /// Positions it was given in all.
    accepted: u64,
}

/// Acks a finished record, nacks one a stop handed back.
fn settle_one(
    p: usize,
    broker: &Broker,
    offset: usize,
    done: Completion<(), Record>,
    tally: &mut Tally,
    position: u64,
    acked_positions: &mut HashSet<u64>,
) {
    match done.wait() {
        Ok(()) => {
            broker.ack(p, offset);
            acked_positions.insert(position);
            tally.acked += 1;
        }
        Err(TaskError::Rejected(_record)) => {
            // Queued, never started: handed back whole. Redeliver it.
            broker.nack(p, offset);
            tally.rejected += 1;
        }
        Err(TaskError::Cancelled) => {
            // Started, dropped mid-write by the force stop: not applied.
            broker.nack(p, offset);
            tally.cancelled += 1;
        }
        Err(TaskError::Panicked(panic)) => panic!("handler panicked: {panic}"),
        // This handler does not retry, so nothing is dead-lettered.
        Err(other) => panic!("unexpected end: {other}"),
    }
}

/// Consumes partition `p` until the broker has nothing left, the executor
/// stops, or `revoked` is set (then it hands the partition off: see
/// [`HandOff`]). Acks after completion; nacks what a stop hands back.
fn consume(
    p: usize,
    broker: &Broker,
    receiver: &keyed_executor::Receiver<u64, Record, ()>,
    revoked: &AtomicBool,
) -> (Tally, Option<HandOff>) {
    let mut tally = Tally::default();
    let mut hand_off = None;
    let mut in_flight: VecDeque<(usize, Completion<(), Record>)> = VecDeque::new();
    // Which positions were acked: the commit point never passes one that
    // was not.
    let mut acked_positions = HashSet::new();
    let mut settle = |offset: usize, done: Completion<(), Record>, tally: &mut Tally| {
        let position = done.position();
        settle_one(
            p,
            broker,
            offset,
            done,
            tally,
            position,
            &mut acked_positions,
        )
    };
    'consume: loop {
        if revoked.load(Ordering::SeqCst) {
            // The rebalance: no new records of this partition from here; let
            // what was accepted finish within a deadline, else stop it (what
            // it hands back is nacked below and redelivered to the new
            // owner).
            receiver.close();
            let drained = receiver.shutdown(Duration::from_secs(2));
            if !drained {
                receiver.shutdown_now();
            }
            for (offset, done) in in_flight.drain(..) {
                settle(offset, done, &mut tally);
            }
            hand_off = Some(HandOff {
                drained,
                committable: receiver.committable().expect("the receiver tracks commits"),
                accepted: receiver.accepted(),
            });
            break;
        }
        let batch = broker.poll(p, 32);
        if batch.is_empty() {
            // Nothing new: wait for the oldest record in flight, or finish.
            match in_flight.pop_front() {
                Some((offset, done)) => settle(offset, done, &mut tally),
                None => break,
            }
            continue;
        }
        let mut records = batch.into_iter();
        while let Some((offset, record)) = records.next() {
            // Blocks while this partition has 64 records unfinished.
            match receiver.submit_blocking(record.key, record) {
                Ok(done) => in_flight.push_back((offset, done)),
                Err(refused) => {
                    // Stopped (`Closed(record)`): hand this record and the
                    // rest of the batch back to the broker.
                    debug_assert!(refused.is_closed());
                    broker.nack(p, offset);
                    tally.refused += 1;
                    for (offset, _) in records {
                        broker.nack(p, offset);
                        tally.refused += 1;
                    }
                    break 'consume;
                }
            }
        }
        // Ack what finished, oldest first, without blocking.
        while in_flight
            .front()
            .is_some_and(|(_, done)| done.is_finished())
        {
            let (offset, done) = in_flight.pop_front().expect("front exists");
            settle(offset, done, &mut tally);
        }
    }
    // Every completion resolves: done, or handed back by the stop.
    for (offset, done) in in_flight {
        settle(offset, done, &mut tally);
    }
    if let Some(h) = hand_off {
        // What a Kafka consumer would commit: every position below the
        // commit point was applied and acked.
        assert!((0..h.committable).all(|pos| acked_positions.contains(&pos)));
    }
    (tally, hand_off)
}

/// The rebalance of one consumer life: move `partition` to another node
/// once `after` records were acked in total.
#[derive(Clone, Copy)]
struct Rebalance {
    partition: usize,
    after: usize,
}

/// What one consumer life did: its own tally, the hand-off (if it gave a
/// partition away) and what the new owner of that partition did.
struct Life {
    tally: Tally,
    hand_off: Option<HandOff>,
    new_owner: Tally,
}

/// A node: an executor of 2 workers, the store-writing handler, and a
/// receiver per partition it owns (each its own source, 64 in flight).
fn node(
    name: &str,
    store: &Arc<Store>,
) -> (KeyedExecutor, keyed_executor::Dispatcher<u64, Record, ()>) {
    let executor = KeyedExecutor::builder()
        .workers(2)
        .thread_name(name)
        .build()
        .expect("valid settings");
    let s = store.clone();
    let dispatcher = executor.dispatcher(handler::from_async_fn(move |_key: u64, r: Record| {
        let store = s.clone();
        async move { store.apply(r).await }
    }));
    (executor, dispatcher)
}

/// One life of the consumer process. `crash_after`: force-stop once that
/// many records were acked in total. `rebalance`: hand one partition to a
/// second node midway.
fn run(
    broker: &Arc<Broker>,
    store: &Arc<Store>,
    crash_after: Option<usize>,
    rebalance: Option<Rebalance>,
) -> Life {
    let (executor, dispatcher) = node("consumer", store);
    let revoked: Vec<AtomicBool> = (0..PARTITIONS).map(|_| AtomicBool::new(false)).collect();
    let wait_for = |n: usize| {
        let deadline = Instant::now() + Duration::from_secs(60);
        while broker.acked() < n {
            assert!(Instant::now() < deadline, "consumers stalled");
            std::thread::sleep(Duration::from_millis(1));
        }
    };
    std::thread::scope(|scope| {
        let mut consumers: Vec<_> = (0..PARTITIONS)
            .map(|p| {
                let receiver = dispatcher
                    .receiver_builder()
                    .max_in_flight(64)
                    .track_commits(true)
                    .build()
                    .expect("max_in_flight > 0");
                let (broker, revoked) = (&**broker, &revoked[p]);
                Some(scope.spawn(move || consume(p, broker, &receiver, revoked)))
            })
            .collect();
        let mut hand_off = None;
        let mut new_owner = None;
        if let Some(r) = rebalance {
            wait_for(r.after);
            // Revoke: the old owner drains (or stops) its source and acks;
            // only once it returned does the new node start the partition,
            // the nacked records first.
            revoked[r.partition].store(true, Ordering::SeqCst);
            let (tally, h) = consumers[r.partition]
                .take()
                .expect("spawned")
                .join()
                .expect("consumer");
            hand_off = Some((tally, h.expect("revoked")));
            let broker = &**broker;
            let partition = r.partition;
            new_owner = Some(scope.spawn(move || {
                let (executor, dispatcher) = node("new-owner", store);
                let receiver = dispatcher
                    .receiver_builder()
                    .max_in_flight(64)
                    .track_commits(true)
                    .build()
                    .expect("max_in_flight > 0");
                let (tally, _) = consume(partition, broker, &receiver, &AtomicBool::new(false));
                drop(receiver);
                assert!(executor.shutdown(Duration::from_secs(10)));
                tally
            }));
        }
        if let Some(n) = crash_after {
            wait_for(n);
            // The crash: nothing new starts, queued records come back on
            // this thread, pending writes are dropped.
            executor.shutdown_now();
        }
        let mut tally = consumers
            .into_iter()
            .flatten()
            .map(|c| c.join().expect("consumer").0)
            .fold(Tally::default(), Tally::add);
        if let Some((t, _)) = hand_off {
            tally = tally.add(t);
        }
        let new_owner = new_owner.map_or(Tally::default(), |c| c.join().expect("new owner"));
        if crash_after.is_none() {
            assert!(executor.shutdown(Duration::from_secs(10)));
        }
        Life {
            tally,
            hand_off: hand_off.map(|(_, h)| h),
            new_owner,
        }
    })
}

fn main() {
    let broker = Arc::new(Broker::new());
    let store = Arc::new(Store::default());
    let total = (KEYS * RECORDS_PER_KEY) as usize;
    println!(
        "{total} records, {KEYS} keys, {PARTITIONS} partitions; each record a ~200 µs async write"
    );

    let started = Instant::now();
    let rebalance = Rebalance {
        partition: 3,
        after: total / 5,
    };
    let life = run(&broker, &store, Some(total * 2 / 5), Some(rebalance));
    let h = life.hand_off.expect("the partition was handed off");
    println!(
        "rebalance: partition {} closed and {} (commit point {} of {} positions), then started on the new owner, \
         which applied and acked {}",
        rebalance.partition,
        if h.drained { "drained in time" } else { "stopped at the deadline" },
        h.committable,
        h.accepted,
        life.new_owner.acked,
    );
    let first = life.tally;
    println!(
        "first executor: {} applied and acked, then shutdown_now(): {} handed back queued (Rejected), \
         {} dropped mid-write (Cancelled), {} refused at submit (Closed) -> all nacked",
        first.acked, first.rejected, first.cancelled, first.refused
    );

    let second = run(&broker, &store, None, None).tally;
    let elapsed = started.elapsed();
    println!(
        "second executor: {} applied and acked ({} of them redelivered after the crash)",
        second.acked,
        broker.redelivered.load(Ordering::Relaxed)
    );

    // Verify: every record applied exactly once, in per-key order (the
    // store asserted the order as it went), and acked.
    assert_eq!(
        first.acked + life.new_owner.acked + second.acked,
        total as u64
    );
    assert_eq!(broker.acked(), total);
    assert_eq!(store.writes.load(Ordering::Relaxed), total as u64);
    let applied = store.applied.lock().unwrap();
    let expected_balance: i64 = (0..RECORDS_PER_KEY)
        .map(|s| if s % 4 == 3 { -5 } else { 10 })
        .sum();
    for key in 0..KEYS {
        assert_eq!(
            applied[&key],
            (RECORDS_PER_KEY, expected_balance),
            "key {key}"
        );
    }
    println!(
        "verified in {elapsed:.2?}: {total} records applied exactly once, each key's in order across the hand-off and the restart, never on two nodes at once, all acked"
    );
}
