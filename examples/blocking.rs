//! Plain threads, no async runtime: a stock-reservation service.
//!
//! Four request threads reserve items of 200 SKUs. Each SKU's reservations
//! run one at a time, in arrival order, on a two-thread pool, so the handler
//! needs no lock discipline of its own: it reads and writes the SKU's stock
//! knowing nothing else touches it. The request threads use blocking handles:
//! `submit_blocking` (waits for credit) and `wait` (waits for the answer). A
//! restock thread uses fire-and-forget `send`, and an audit thread
//! `try_submit`, which never blocks and hands the message back when the
//! receiver is full.
//!
//! ```text
//! cargo run --release --example blocking
//! ```

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keyed_executor::{handler, KeyedExecutor, SubmitError};

const SKUS: u32 = 200;
const INITIAL_STOCK: u64 = 100;
const REQUEST_THREADS: u32 = 4;
const REQUESTS_PER_THREAD: u32 = 5_000;

enum Command {
    /// A customer reserves `qty`; `(thread, seq)` lets the handler check
    /// that each thread's requests for a SKU arrive in the order sent.
    Reserve {
        qty: u64,
        thread: u32,
        seq: u64,
    },
    Restock {
        qty: u64,
    },
    /// Read the stock (the audit).
    Count,
}

#[derive(Debug, PartialEq)]
enum Reply {
    Reserved { left: u64 },
    OutOfStock { left: u64 },
    Restocked,
    Stock(u64),
}

/// One SKU's state. The executor runs one command per SKU at a time, so the
/// mutex is never contended; it only makes the shared map `Sync`.
#[derive(Default)]
struct Sku {
    stock: u64,
    reserved: u64,
    restocked: u64,
    /// Last sequence number seen from each request thread.
    last_seq: HashMap<u32, u64>,
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let skus: Arc<Vec<Mutex<Sku>>> = Arc::new(
        (0..SKUS)
            .map(|_| {
                Mutex::new(Sku {
                    stock: INITIAL_STOCK,
                    ..Sku::default()
                })
            })
            .collect(),
    );

    let executor = KeyedExecutor::builder()
        .workers(2)
        .thread_name("stock")
        .build()?;
    let state = skus.clone();
    let dispatcher = executor.dispatcher(handler::from_fn(move |sku: &u32, cmd: Command| {
        let mut s = state[*sku as usize].lock().unwrap();
        match cmd {
            Command::Reserve { qty, thread, seq } => {
                let last = s.last_seq.insert(thread, seq);
                assert!(last < Some(seq), "sku {sku}: thread {thread} out of order");
                if s.stock >= qty {
                    s.stock -= qty;
                    s.reserved += qty;
                    Reply::Reserved { left: s.stock }
                } else {
                    Reply::OutOfStock { left: s.stock }
                }
            }
            Command::Restock { qty } => {
                s.stock += qty;
                s.restocked += qty;
                Reply::Restocked
            }
            Command::Count => Reply::Stock(s.stock),
        }
    }));

    let started = Instant::now();
    let sold_out = Arc::new(AtomicU64::new(0));
    std::thread::scope(|scope| {
        // Request threads: one receiver each (one source, its own credit).
        for thread in 0..REQUEST_THREADS {
            let requests = dispatcher.receiver(64).expect("max_in_flight > 0");
            let sold_out = sold_out.clone();
            scope.spawn(move || {
                let mut rng = Lcg(u64::from(thread) + 1);
                for seq in 0..u64::from(REQUESTS_PER_THREAD) {
                    let sku = (rng.next() % u64::from(SKUS)) as u32;
                    let qty = 1 + rng.next() % 3;
                    // Request/response: block for credit, then for the answer.
                    let done = requests
                        .submit_blocking(sku, Command::Reserve { qty, thread, seq })
                        .expect("executor open");
                    if let Reply::OutOfStock { .. } = done.wait().expect("handler ran") {
                        sold_out.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
        // Restocks: fire-and-forget; `send` still blocks while the receiver
        // is full, so the restock thread cannot run away from the pool.
        let restocks = dispatcher.receiver(16).expect("max_in_flight > 0");
        scope.spawn(move || {
            for round in 0..20u32 {
                for sku in 0..SKUS {
                    restocks
                        .send(sku, Command::Restock { qty: 2 })
                        .expect("executor open");
                }
                if round % 5 == 4 {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        });
        // Audits: `try_submit` never blocks. A full receiver hands the
        // message back, and the audit thread decides what to do: here, wait
        // for its oldest audit, then retry.
        let audits = dispatcher.receiver(4).expect("max_in_flight > 0");
        scope.spawn(move || {
            let (mut answered, mut full) = (0, 0);
            let mut pending = std::collections::VecDeque::new();
            for i in 0..2_000u32 {
                let mut cmd = Command::Count;
                loop {
                    match audits.try_submit(i % SKUS, cmd) {
                        Ok(done) => break pending.push_back(done),
                        Err(SubmitError::Full(handed_back)) => {
                            full += 1;
                            cmd = handed_back;
                            if let Some(oldest) = pending.pop_front() {
                                // Bound the wait; on timeout we get the handle back.
                                match oldest.wait_timeout(Duration::from_secs(5)) {
                                    Ok(reply) => {
                                        assert!(matches!(reply, Ok(Reply::Stock(_))));
                                        answered += 1;
                                    }
                                    Err(_still_running) => panic!("an audit took over 5 s"),
                                }
                            } else {
                                // Credit returns a moment after the answer.
                                std::thread::yield_now();
                            }
                        }
                        Err(SubmitError::Closed(_)) => unreachable!("executor open"),
                    }
                }
            }
            for done in pending {
                assert!(matches!(done.wait(), Ok(Reply::Stock(_))));
                answered += 1;
            }
            println!("audits: {answered} answered; {full} times the receiver was full and handed the audit back");
        });
    });
    let elapsed = started.elapsed();

    // Graceful stop: runs whatever is still queued (restocks), joins threads.
    assert!(executor.shutdown(Duration::from_secs(10)));

    let (mut stock, mut reserved, mut restocked) = (0, 0, 0);
    for (i, sku) in skus.iter().enumerate() {
        let s = sku.lock().unwrap();
        assert_eq!(
            s.stock + s.reserved,
            INITIAL_STOCK + s.restocked,
            "sku {i}: units appeared or vanished"
        );
        (stock, reserved, restocked) = (
            stock + s.stock,
            reserved + s.reserved,
            restocked + s.restocked,
        );
    }
    let requests = REQUEST_THREADS * REQUESTS_PER_THREAD;
    let stats = executor.stats();
    println!(
        "{requests} reservations from {REQUEST_THREADS} threads on {SKUS} SKUs in {:.0?} ({:.0} requests/s, each a blocking round trip)",
        elapsed,
        f64::from(requests) / elapsed.as_secs_f64()
    );
    println!(
        "  {reserved} units reserved, {} requests found the SKU sold out, {restocked} units restocked, {stock} in stock",
        sold_out.load(Ordering::Relaxed)
    );
    println!(
        "  every SKU balances (stock + reserved = initial + restocked); every thread's requests ran in order"
    );
    println!(
        "  {} messages on {} workers; mailboxes now {}; workers parked {} times",
        stats.done,
        executor.workers(),
        stats.live_mailboxes,
        stats.workers.iter().map(|w| w.parks).sum::<u64>()
    );
    Ok(())
}

/// A tiny deterministic pseudo-random generator (no dependency needed).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
}
