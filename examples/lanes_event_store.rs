//! Group commit against a simulated event store.
//!
//! Bank accounts are event-sourced aggregates. Each command (deposit or
//! withdraw) is decided against the account's balance; the accepted ones are
//! appended to the account's stream. An append costs about 1 ms whatever its
//! size, so a hot account commits a batch per append instead of a command
//! per append. A commit hook keeps a read-side view of the balances up to
//! date; at the end the view, the event streams and the callers' receipts
//! must all agree.
//!
//! ```text
//! cargo run --release --example lanes_event_store
//! ```

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keyed_executor::lanes::{BatchResult, Kernel, LaneError, Lanes};

type AccountId = u32;

#[derive(Clone, Copy)]
enum Cmd {
    Deposit(u64),
    Withdraw(u64),
}

#[derive(Clone, Copy, Debug)]
enum Event {
    Deposited(u64),
    Withdrew(u64),
}

/// What a caller gets for an accepted command.
#[derive(Clone, Copy, Debug)]
struct Receipt {
    version: u64,
    balance: u64,
}

#[derive(Clone, Debug)]
enum StoreError {
    Insufficient { balance: u64, wanted: u64 },
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Insufficient { balance, wanted } => {
                write!(f, "insufficient funds: balance {balance}, wanted {wanted}")
            }
        }
    }
}

impl std::error::Error for StoreError {}

/// The simulated store: one stream of events per account.
#[derive(Default)]
struct EventStore {
    streams: Mutex<HashMap<AccountId, Vec<Event>>>,
    appends: AtomicU64,
    appends_per_account: Mutex<HashMap<AccountId, u64>>,
}

impl EventStore {
    /// The account's state, folded from its stream.
    fn load(&self, account: AccountId) -> (u64, u64) {
        let streams = self.streams.lock().unwrap();
        let events = streams.get(&account).map(Vec::as_slice).unwrap_or(&[]);
        let balance = events.iter().fold(0, |b, e| match e {
            Event::Deposited(n) => b + n,
            Event::Withdrew(n) => b - n,
        });
        (balance, events.len() as u64)
    }

    /// One append of many events: ~1 ms whatever their number.
    async fn append(&self, account: AccountId, events: Vec<Event>) {
        tokio::time::sleep(Duration::from_millis(1)).await;
        self.appends.fetch_add(1, Ordering::Relaxed);
        *self
            .appends_per_account
            .lock()
            .unwrap()
            .entry(account)
            .or_default() += 1;
        self.streams
            .lock()
            .unwrap()
            .entry(account)
            .or_default()
            .extend(events);
    }
}

/// The command side: decides against the stream, appends once per batch.
struct Accounts {
    store: Arc<EventStore>,
}

impl Kernel for Accounts {
    type Key = AccountId;
    type Command = Cmd;
    type Output = Receipt;
    type Error = StoreError;

    async fn execute_batch(
        &self,
        account: &AccountId,
        commands: Vec<Cmd>,
    ) -> BatchResult<Cmd, Receipt, StoreError> {
        // The lane guarantees no other batch of this account runs now, so the
        // state read here stays valid until the append.
        let (mut balance, mut version) = self.store.load(*account);
        let mut events = Vec::new();
        let outcomes = commands
            .into_iter()
            .map(|cmd| {
                let event = match cmd {
                    Cmd::Deposit(n) => Event::Deposited(n),
                    Cmd::Withdraw(n) if n > balance => {
                        return Err(StoreError::Insufficient { balance, wanted: n });
                    }
                    Cmd::Withdraw(n) => Event::Withdrew(n),
                };
                balance = match event {
                    Event::Deposited(n) => balance + n,
                    Event::Withdrew(n) => balance - n,
                };
                version += 1;
                events.push(event);
                Ok(Receipt { version, balance })
            })
            .collect();
        if !events.is_empty() {
            self.store.append(*account, events).await;
        }
        BatchResult::committed(outcomes)
    }
}

fn main() {
    let store = Arc::new(EventStore::default());
    let view: Arc<Mutex<HashMap<AccountId, u64>>> = Arc::default();
    let v = Arc::clone(&view);
    let lanes = Lanes::builder(Accounts {
        store: Arc::clone(&store),
    })
    .max_batch(32)
    .lane_capacity(256)
    .on_commit(move |account, outcomes| {
        // The last accepted receipt of the batch carries the new balance.
        if let Some(Ok(r)) = outcomes.iter().rev().find(|o| o.is_ok()) {
            v.lock().unwrap().insert(*account, r.balance);
        }
        Ok(())
    })
    .build()
    .expect("valid settings");

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_time()
        .build()
        .unwrap();

    // 4 hot accounts shared by 200 clients, plus 40 clients with an account
    // of their own; 20 commands each.
    const HOT: u32 = 4;
    let clients = 240u32;
    let per_client = 20u32;
    let started = Instant::now();
    let (accepted, rejected) = rt.block_on(async {
        let tasks: Vec<_> = (0..clients)
            .map(|c| {
                let lanes = lanes.clone();
                tokio::spawn(async move {
                    let account = if c < 200 { c % HOT } else { 100 + c };
                    let (mut ok, mut refused) = (0u64, 0u64);
                    let mut last_version = 0;
                    for i in 0..per_client {
                        let cmd = if (c + i) % 3 == 2 {
                            Cmd::Withdraw(15)
                        } else {
                            Cmd::Deposit(10)
                        };
                        match lanes.execute(account, cmd).await {
                            Ok(receipt) => {
                                // A client's commands commit in its order.
                                assert!(receipt.version > last_version);
                                last_version = receipt.version;
                                ok += 1;
                            }
                            Err(LaneError::Kernel(StoreError::Insufficient { .. })) => refused += 1,
                            Err(e) => panic!("unexpected: {e}"),
                        }
                    }
                    (ok, refused)
                })
            })
            .collect();
        let mut totals = (0, 0);
        for t in tasks {
            let (ok, refused) = t.await.unwrap();
            totals.0 += ok;
            totals.1 += refused;
        }
        totals
    });
    let elapsed = started.elapsed();
    assert!(rt.block_on(lanes.close(Duration::from_secs(5))));

    let appends = store.appends.load(Ordering::Relaxed);
    let commands = u64::from(clients * per_client);
    println!("{clients} clients x {per_client} commands against a store whose append costs ~1 ms");
    println!(
        "  {commands} commands in {:.2?}: {accepted} accepted, {rejected} refused (insufficient funds)",
        elapsed
    );
    println!(
        "  {appends} appends: {:.1} accepted commands per append, {:.0} commands/s",
        accepted as f64 / appends as f64,
        commands as f64 / elapsed.as_secs_f64()
    );

    // The view, the streams and the receipts agree.
    let view = view.lock().unwrap();
    let mut total_events = 0;
    for account in (0..HOT).chain(300..340) {
        let (balance, version) = store.load(account);
        total_events += version;
        assert_eq!(
            view.get(&account).copied().unwrap_or(0),
            balance,
            "view of {account}"
        );
    }
    assert_eq!(total_events, accepted, "one event per accepted command");
    let per_account = store.appends_per_account.lock().unwrap();
    let busiest = (0..HOT).map(|a| store.load(a).1).max().unwrap_or(0);
    println!(
        "  without group commit (one append per command) the busiest account would need {busiest} appends in a row, ~{:.1} s",
        busiest as f64 / 1000.0
    );
    for account in 0..HOT {
        let (balance, events) = store.load(account);
        let appends = per_account[&account];
        println!(
            "  hot account {account}: balance {balance} after {events} events in {appends} appends \
             ({:.1} per append; the view agrees)",
            events as f64 / appends as f64
        );
    }
    assert_eq!(lanes.in_flight(), 0);
    assert_eq!(lanes.lanes_alive(), 0);
}
