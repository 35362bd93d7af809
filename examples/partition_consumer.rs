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

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
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
}

impl Store {
    async fn apply(&self, r: Record) {
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

/// Consumes partition `p` until the broker has nothing left or the
/// executor stops. Acks after completion; nacks what a stop hands back.
fn consume(
    p: usize,
    broker: &Broker,
    receiver: &keyed_executor::Receiver<u64, Record, ()>,
) -> Tally {
    let mut tally = Tally::default();
    let mut in_flight: VecDeque<(usize, Completion<(), Record>)> = VecDeque::new();
    let settle = |offset: usize, done: Completion<(), Record>, tally: &mut Tally| match done.wait()
    {
        Ok(()) => {
            broker.ack(p, offset);
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
    };
    'consume: loop {
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
    tally
}

/// One life of the consumer process. `crash_after`: force-stop once that
/// many records were acked in total.
fn run(broker: &Arc<Broker>, store: &Arc<Store>, crash_after: Option<usize>) -> Tally {
    let executor = KeyedExecutor::builder()
        .workers(2)
        .thread_name("consumer")
        .build()
        .expect("valid settings");
    let s = store.clone();
    let dispatcher = executor.dispatcher(handler::from_async_fn(move |_key: u64, r: Record| {
        let store = s.clone();
        async move { store.apply(r).await }
    }));
    let tallies = std::thread::scope(|scope| {
        let consumers: Vec<_> = (0..PARTITIONS)
            .map(|p| {
                let receiver = dispatcher.receiver(64).expect("max_in_flight > 0");
                let broker = &**broker;
                scope.spawn(move || consume(p, broker, &receiver))
            })
            .collect();
        if let Some(n) = crash_after {
            let deadline = Instant::now() + Duration::from_secs(60);
            while broker.acked() < n {
                assert!(Instant::now() < deadline, "consumers stalled");
                std::thread::sleep(Duration::from_millis(1));
            }
            // The crash: nothing new starts, queued records come back on
            // this thread, pending writes are dropped.
            executor.shutdown_now();
        }
        consumers
            .into_iter()
            .map(|c| c.join().expect("consumer"))
            .collect::<Vec<_>>()
    });
    if crash_after.is_none() {
        assert!(executor.shutdown(Duration::from_secs(10)));
    }
    tallies.into_iter().fold(Tally::default(), |a, t| Tally {
        acked: a.acked + t.acked,
        rejected: a.rejected + t.rejected,
        cancelled: a.cancelled + t.cancelled,
        refused: a.refused + t.refused,
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
    let first = run(&broker, &store, Some(total * 2 / 5));
    println!(
        "first executor: {} applied and acked, then shutdown_now(): {} handed back queued (Rejected), \
         {} dropped mid-write (Cancelled), {} refused at submit (Closed) -> all nacked",
        first.acked, first.rejected, first.cancelled, first.refused
    );

    let second = run(&broker, &store, None);
    let elapsed = started.elapsed();
    println!(
        "second executor: {} applied and acked ({} of them redelivered after the crash)",
        second.acked,
        broker.redelivered.load(Ordering::Relaxed)
    );

    // Verify: every record applied exactly once, in per-key order (the
    // store asserted the order as it went), and acked.
    assert_eq!(first.acked + second.acked, total as u64);
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
        "verified in {elapsed:.2?}: {total} records applied exactly once, each key's in order across the restart, all acked"
    );
}
