//! An async pipeline: a `Stream` of records fed into a dispatcher through
//! `stream.forward(receiver.sink())` (the `sink` feature).
//!
//! A partition is read as a stream of records, as a streaming client gives
//! one (rdkafka's `StreamConsumer::stream()`, Redis streams read in a
//! loop): here 40,000 records for 400 accounts, arriving in polls of 500.
//! Each record is applied by an async handler that, for one record in 16,
//! awaits a (simulated, 200 µs) write on a tokio timer: a pending write
//! holds no worker, and the account's next record waits for it.
//!
//! 1. **Backpressure.** `forward` waits for a unit of the receiver's
//!    credit (64) before it takes each record, without holding a thread;
//!    a sampler checks that no more than 64 records are ever unfinished.
//! 2. **A stop mid-stream hands the record back.** Half-way through, the
//!    partition is revoked (the receiver is closed): `forward` ends with
//!    `Closed((account, record))`, the record it held. It goes back in
//!    front of the rest of the stream, and a new receiver (the partition's
//!    next owner) takes over from there — nothing lost, nothing twice.
//!
//! At the end, every account saw each of its records once, in offset
//! order; the first owner's commit point is the offset of the record it
//! handed back, where the second took over.
//!
//! ```text
//! cargo run --release --features sink --example stream_pipeline
//! ```

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{stream, StreamExt};
use keyed_executor::{handler, KeyedExecutor, SubmitError};

const ACCOUNTS: u64 = 400;
const RECORDS: u64 = 40_000;
const POLL: usize = 500;
const MAX_IN_FLIGHT: usize = 64;
/// The partition is revoked once this many records were accepted.
const REVOKE_AT: u64 = RECORDS / 2;

/// One record of the partition.
#[derive(Debug, Clone, Copy)]
struct Record {
    offset: u64,
    amount: i64,
}

/// The records each account applied, by offset, in the order applied.
type Applied = Arc<Mutex<HashMap<u64, Vec<u64>>>>;

/// The partition as a stream: records in offset order, a poll of `POLL`
/// at a time (each poll a yield to the runtime, as a network read is).
fn partition(from: u64) -> impl futures::Stream<Item = (u64, Record)> {
    let offsets: Vec<u64> = (from..RECORDS).collect();
    let polls: Vec<Vec<u64>> = offsets.chunks(POLL).map(<[u64]>::to_vec).collect();
    stream::iter(polls)
        .then(|poll| async move {
            tokio::task::yield_now().await;
            stream::iter(poll)
        })
        .flatten()
        .map(|offset| {
            let account = offset.wrapping_mul(0x9E37_79B9_7F4A_7C15) % ACCOUNTS;
            (
                account,
                Record {
                    offset,
                    amount: (offset % 7) as i64 - 3,
                },
            )
        })
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_time()
        .build()?;
    let handle = rt.handle().clone();
    let executor = KeyedExecutor::builder()
        .workers(2)
        // The handler awaits tokio timers: enter the runtime on each worker.
        .on_thread_start(move || std::mem::forget(handle.enter()))
        .build()?;

    let applied = Applied::default();
    let balances = Arc::new(Mutex::new(HashMap::<u64, i64>::new()));
    let (a, b) = (applied.clone(), balances.clone());
    let dispatcher = executor.dispatcher(handler::from_async_fn(move |account: u64, r: Record| {
        let (applied, balances) = (a.clone(), b.clone());
        async move {
            if r.offset % 16 == 0 {
                tokio::time::sleep(Duration::from_micros(200)).await; // the write
            }
            *balances.lock().unwrap().entry(account).or_default() += r.amount;
            applied
                .lock()
                .unwrap()
                .entry(account)
                .or_default()
                .push(r.offset);
        }
    }));

    let start = Instant::now();
    // The first owner of the partition: a receiver that tracks commits.
    let first = dispatcher
        .receiver_builder()
        .max_in_flight(MAX_IN_FLIGHT)
        .track_commits(true)
        .build()?;

    // A sampler: never more than MAX_IN_FLIGHT records unfinished.
    let peak = Arc::new(AtomicUsize::new(0));
    let done = Arc::new(AtomicBool::new(false));
    let sampler = {
        let (r, peak, done) = (first.clone(), peak.clone(), done.clone());
        std::thread::spawn(move || {
            while !done.load(SeqCst) {
                peak.fetch_max(r.in_flight(), SeqCst);
                if r.accepted() >= REVOKE_AT {
                    // The rebalance: this partition moves to another node.
                    r.close();
                }
                std::thread::yield_now();
            }
        })
    };

    let mut records = Box::pin(partition(0).map(Ok));
    let mut sink = first.sink();
    let end = rt.block_on(records.as_mut().forward(&mut sink));
    done.store(true, SeqCst);
    sampler.join().expect("sampler");
    let handed_back = match end {
        Err(SubmitError::Closed(pair)) => pair,
        Ok(()) => return Err("the partition ended before it was revoked".into()),
        Err(e) => return Err(e.into()),
    };
    let accepted = first.accepted();
    let drained = rt.block_on(first.shutdown_async(Duration::from_secs(10)));
    let commit = first.committable().expect("the first owner tracks commits");
    println!(
        "first owner: {accepted} records accepted (peak {} unfinished, credit {MAX_IN_FLIGHT}), \
         revoked; drained {drained}; commit point {commit}; record at offset {} handed back",
        peak.load(SeqCst),
        handed_back.1.offset,
    );
    assert!(drained);
    assert!(peak.load(SeqCst) <= MAX_IN_FLIGHT, "credit is a hard bound");
    // Every record before the one handed back finished: the commit point
    // is that record's offset (positions are offsets here: one source, in
    // order). A send that raced the close may have taken a position before
    // it was refused; the commit point stops there all the same.
    assert_eq!(
        commit, handed_back.1.offset,
        "committed up to the record handed back"
    );
    assert_eq!(sink.last_position(), Some(commit - 1));

    // The next owner takes over at the commit point: the record handed back
    // first, then the rest of the stream.
    let second = dispatcher.receiver(MAX_IN_FLIGHT)?;
    let rest = stream::iter([Ok(handed_back)]).chain(records);
    rt.block_on(rest.forward(second.sink()))?;
    assert!(rt.block_on(second.shutdown_async(Duration::from_secs(10))));
    println!(
        "second owner: {} records from offset {commit}",
        second.accepted()
    );

    // Every account saw each of its records once, in offset order.
    let applied = applied.lock().unwrap();
    let mut total = 0;
    for (account, offsets) in applied.iter() {
        assert!(
            offsets.windows(2).all(|w| w[0] < w[1]),
            "account {account}: out of order or twice"
        );
        total += offsets.len() as u64;
    }
    assert_eq!(total, RECORDS, "every record applied once");
    let sum: i64 = balances.lock().unwrap().values().sum();
    let want: i64 = (0..RECORDS).map(|o| (o % 7) as i64 - 3).sum();
    assert_eq!(sum, want);
    println!(
        "{RECORDS} records over {} accounts applied once each, in order, in {:.2?}",
        applied.len(),
        start.elapsed()
    );
    drop(applied);
    assert!(executor.shutdown(Duration::from_secs(5)));
    Ok(())
}
