//! The main job: a ledger of 10,000 accounts receiving 1,000,000 commands.
//!
//! - `ledger` dispatcher (sync handler, `handler::from_fn`): applies deposits
//!   and withdrawals to each account's in-memory state, one at a time per
//!   account, in arrival order.
//! - `journal` dispatcher (async handler, `handler::from_async_fn`): appends
//!   each account's events to a simulated store that answers ~100 µs later;
//!   while a write is pending its account's mailbox holds no worker.
//!
//! Two producer threads (two receivers, i.e. two sources with their own
//! credit) feed both dispatchers. Every command carries its account's
//! sequence number; handlers check it, and the end of the run verifies that
//! every account saw every command in order. Progress is printed while it
//! runs, then a summary: messages/s, latency p50/p99, workers, peak mailboxes.
//!
//! ```text
//! cargo run --release --example demo            # 10,000 accounts, 1,000,000 commands
//! cargo run --release --example demo -- --quick # 1,000 accounts, 100,000 commands (CI)
//! ```

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use keyed_executor::{handler, KeyedExecutor};

/// A ledger command. `seq` is the account's sequence number within its
/// dispatcher; `sent` is when the producer submitted it.
struct Command {
    seq: u64,
    amount: i64,
    sent: Instant,
}

/// Per-account state. The executor runs one command per account at a time,
/// so the mutex is never contended; it only makes the state `Sync`.
#[derive(Default)]
struct Account {
    balance: i64,
    applied: u64,
    journaled: u64,
}

/// Log-scale latency histogram: bucket `i` holds latencies in
/// [2^(i/4) .. 2^((i+1)/4)) nanoseconds.
struct Histogram {
    buckets: Vec<AtomicU64>,
}

impl Histogram {
    fn new() -> Self {
        Histogram {
            buckets: (0..160).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    fn record(&self, d: Duration) {
        let ns = d.as_nanos().max(1) as f64;
        let i = ((ns.log2() * 4.0) as usize).min(self.buckets.len() - 1);
        self.buckets[i].fetch_add(1, Ordering::Relaxed);
    }

    fn quantile(&self, q: f64) -> Duration {
        let counts: Vec<u64> = self
            .buckets
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .collect();
        let total: u64 = counts.iter().sum();
        let target = (total as f64 * q).ceil() as u64;
        let mut seen = 0;
        for (i, c) in counts.iter().enumerate() {
            seen += c;
            if seen >= target {
                return Duration::from_nanos(2f64.powf((i + 1) as f64 / 4.0) as u64);
            }
        }
        Duration::ZERO
    }
}

/// A simulated store: a write completes `latency` after it is issued, on the
/// store's own thread (like a device or a network reply).
struct Store {
    queue: Mutex<VecDeque<(Instant, Arc<Write>)>>,
    ready: Condvar,
    latency: Duration,
    stop: AtomicBool,
}

#[derive(Default)]
struct Write {
    done: AtomicBool,
    waker: Mutex<Option<Waker>>,
}

impl Store {
    fn start(latency: Duration) -> (Arc<Store>, std::thread::JoinHandle<()>) {
        let store = Arc::new(Store {
            queue: Mutex::new(VecDeque::new()),
            ready: Condvar::new(),
            latency,
            stop: AtomicBool::new(false),
        });
        let s = store.clone();
        let thread = std::thread::Builder::new()
            .name("store".into())
            .spawn(move || s.run())
            .unwrap();
        (store, thread)
    }

    fn run(&self) {
        let mut q = self.queue.lock().unwrap();
        loop {
            let now = Instant::now();
            while q.front().is_some_and(|(due, _)| *due <= now) {
                let (_, w) = q.pop_front().unwrap();
                w.done.store(true, Ordering::Release);
                let waker = w.waker.lock().unwrap().take();
                if let Some(waker) = waker {
                    waker.wake();
                }
            }
            if self.stop.load(Ordering::Relaxed) && q.is_empty() {
                return;
            }
            q = match q.front() {
                Some((due, _)) => {
                    let wait = due.saturating_duration_since(Instant::now());
                    self.ready.wait_timeout(q, wait).unwrap().0
                }
                None => {
                    self.ready
                        .wait_timeout(q, Duration::from_millis(50))
                        .unwrap()
                        .0
                }
            };
        }
    }

    /// Issues a write; the returned future resolves when it is durable.
    fn append(self: &Arc<Self>) -> WriteFuture {
        WriteFuture {
            store: self.clone(),
            write: None,
        }
    }

    fn stop(&self) {
        self.stop.store(true, Ordering::Relaxed);
        self.ready.notify_one();
    }
}

struct WriteFuture {
    store: Arc<Store>,
    write: Option<Arc<Write>>,
}

impl Future for WriteFuture {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let write = match &self.write {
            Some(w) => w.clone(),
            None => {
                // Issued at the first poll, i.e. when the message really runs.
                let w = Arc::new(Write::default());
                *w.waker.lock().unwrap() = Some(cx.waker().clone());
                let due = Instant::now() + self.store.latency;
                let was_empty = {
                    let mut q = self.store.queue.lock().unwrap();
                    q.push_back((due, w.clone()));
                    q.len() == 1
                };
                if was_empty {
                    self.store.ready.notify_one();
                }
                self.write = Some(w);
                return Poll::Pending;
            }
        };
        if write.done.load(Ordering::Acquire) {
            return Poll::Ready(());
        }
        *write.waker.lock().unwrap() = Some(cx.waker().clone());
        if write.done.load(Ordering::Acquire) {
            return Poll::Ready(());
        }
        Poll::Pending
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let quick = std::env::args().any(|a| a == "--quick");
    let (accounts, commands) = if quick {
        (1_000u64, 100_000u64)
    } else {
        (10_000u64, 1_000_000u64)
    };
    // Every 4th command of an account also goes to the async journal.
    let journal_every = 4;

    let executor = KeyedExecutor::builder().thread_name("ledger").build()?;
    let state: Arc<Vec<Mutex<Account>>> = Arc::new(
        (0..accounts)
            .map(|_| Mutex::new(Account::default()))
            .collect(),
    );
    let latency = Arc::new(Histogram::new());
    let order_errors = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let (store, store_thread) = Store::start(Duration::from_micros(100));

    let ledger = {
        let (state, latency, errors, done) = (
            state.clone(),
            latency.clone(),
            order_errors.clone(),
            done.clone(),
        );
        executor.dispatcher(handler::from_fn(move |account: &u64, cmd: Command| {
            let mut a = state[*account as usize].lock().unwrap();
            if cmd.seq != a.applied {
                errors.fetch_add(1, Ordering::Relaxed);
            }
            a.applied = cmd.seq + 1;
            a.balance += cmd.amount;
            latency.record(cmd.sent.elapsed());
            done.fetch_add(1, Ordering::Relaxed);
        }))
    };
    let journal = {
        let (state, latency, errors, done, store) = (
            state.clone(),
            latency.clone(),
            order_errors.clone(),
            done.clone(),
            store.clone(),
        );
        executor.dispatcher(handler::from_async_fn(move |account: u64, cmd: Command| {
            let (state, latency, errors, done) =
                (state.clone(), latency.clone(), errors.clone(), done.clone());
            let write = store.append();
            async move {
                write.await;
                let mut a = state[account as usize].lock().unwrap();
                if cmd.seq != a.journaled {
                    errors.fetch_add(1, Ordering::Relaxed);
                }
                a.journaled = cmd.seq + 1;
                latency.record(cmd.sent.elapsed());
                done.fetch_add(1, Ordering::Relaxed);
            }
        }))
    };

    let journal_total = (0..accounts)
        .map(|a| {
            let per_account = commands / accounts + u64::from(a < commands % accounts);
            per_account.div_ceil(journal_every)
        })
        .sum::<u64>();
    let total = commands + journal_total;
    println!(
        "keyed-executor demo: {accounts} accounts, {commands} ledger commands (sync) + {journal_total} journal writes (async, ~100 µs each), {} workers",
        executor.workers()
    );

    let peak_mailboxes = Arc::new(AtomicUsize::new(0));
    let finished = Arc::new(AtomicBool::new(false));
    let progress = {
        let (ledger, journal, done, peak, finished) = (
            ledger.clone(),
            journal.clone(),
            done.clone(),
            peak_mailboxes.clone(),
            finished.clone(),
        );
        std::thread::spawn(move || {
            let start = Instant::now();
            let mut last_print = Instant::now();
            while !finished.load(Ordering::Relaxed) {
                std::thread::sleep(Duration::from_millis(5));
                let live = ledger.live_mailboxes() + journal.live_mailboxes();
                peak.fetch_max(live, Ordering::Relaxed);
                if last_print.elapsed() >= Duration::from_millis(250) {
                    last_print = Instant::now();
                    let d = done.load(Ordering::Relaxed);
                    println!(
                        "  {:>6.2}s  {:>9}/{total} done  {:>5.1}%  live mailboxes {live}",
                        start.elapsed().as_secs_f64(),
                        d,
                        100.0 * d as f64 / total as f64
                    );
                }
            }
        })
    };

    let start = Instant::now();
    let producers: Vec<_> = (0..2u64)
        .map(|p| {
            // Each producer is one source: its own receivers and credit.
            let ledger_in = ledger.receiver(1024).expect("max_in_flight > 0");
            let journal_in = journal.receiver(1024).expect("max_in_flight > 0");
            std::thread::spawn(move || {
                // Producer p owns the accounts with account % 2 == p.
                let mine: Vec<u64> = (0..accounts).filter(|a| a % 2 == p).collect();
                let mut seq = vec![0u64; mine.len()];
                let mut journal_seq = vec![0u64; mine.len()];
                let share = commands / 2 + u64::from(p < commands % 2);
                for i in 0..share {
                    let slot = (i % mine.len() as u64) as usize;
                    let account = mine[slot];
                    let s = seq[slot];
                    seq[slot] += 1;
                    let amount = if s % 3 == 2 { -5 } else { 10 };
                    let now = Instant::now();
                    ledger_in
                        .send(
                            account,
                            Command {
                                seq: s,
                                amount,
                                sent: now,
                            },
                        )
                        .map_err(|e| e.to_string())?;
                    if s % journal_every == 0 {
                        let j = journal_seq[slot];
                        journal_seq[slot] += 1;
                        journal_in
                            .send(
                                account,
                                Command {
                                    seq: j,
                                    amount,
                                    sent: now,
                                },
                            )
                            .map_err(|e| e.to_string())?;
                    }
                }
                Ok::<(), String>(())
            })
        })
        .collect();
    for p in producers {
        p.join().expect("producer panicked")?;
    }
    // Graceful stop: everything accepted runs to the end, suspended journal
    // writes included.
    let drained = executor.shutdown(Duration::from_secs(60));
    let elapsed = start.elapsed();
    finished.store(true, Ordering::Relaxed);
    progress.join().unwrap();
    store.stop();
    store_thread.join().unwrap();

    // Verify: every account saw every command, in order, exactly once.
    let mut expected_total = 0;
    for (a, acct) in state.iter().enumerate() {
        let acct = acct.lock().unwrap();
        let sent = commands / accounts + u64::from((a as u64) < commands % accounts);
        expected_total += sent;
        assert_eq!(acct.applied, sent, "account {a}: ledger commands lost");
        assert_eq!(
            acct.journaled,
            sent.div_ceil(journal_every),
            "account {a}: journal writes lost"
        );
        let expected_balance: i64 = (0..sent).map(|s| if s % 3 == 2 { -5 } else { 10 }).sum();
        assert_eq!(acct.balance, expected_balance, "account {a}: wrong balance");
    }
    assert_eq!(expected_total, commands);
    let errors = order_errors.load(Ordering::Relaxed);
    assert_eq!(errors, 0, "{errors} commands ran out of order");
    assert!(drained, "shutdown did not drain within 60 s");
    assert_eq!(done.load(Ordering::Relaxed), total);

    let stats = executor.stats();
    println!("summary");
    println!("  messages      {total} ({commands} sync + {journal_total} async), all in order, none lost");
    println!("  elapsed       {:.3} s", elapsed.as_secs_f64());
    println!(
        "  throughput    {:.2} M msg/s",
        total as f64 / elapsed.as_secs_f64() / 1e6
    );
    println!(
        "  latency       p50 {:?}  p99 {:?}  (submit to handler done, incl. credit waits and the 100 µs writes)",
        latency.quantile(0.50),
        latency.quantile(0.99)
    );
    println!("  workers       {}", executor.workers());
    println!(
        "  mailboxes     peak {} live (sampled), {} now",
        peak_mailboxes.load(Ordering::Relaxed),
        stats.live_mailboxes
    );
    println!(
        "  workers parked {} times, woken {} times",
        stats.workers.iter().map(|w| w.parks).sum::<u64>(),
        stats.workers.iter().map(|w| w.unparks).sum::<u64>()
    );
    Ok(())
}
