//! The self-checking run, shared by the example (run without arguments)
//! and `tests/broker_redis.rs`: one producer and two consumers, a graceful
//! hand-off and a crash midway, then a check of what Redis holds.
//!
//! 1. A producer thread appends `records` records over `keys` keys: all
//!    but the last eighth at once, that eighth once step 4 has stalled
//!    `b`'s acks. So `a` is busy when it hands partitions off, and `b`
//!    still has records to apply after its stall (an unpaced producer and
//!    two fast consumers could otherwise apply everything before it, and
//!    the crash would find nothing applied-but-unacked).
//! 2. Consumer `a` starts alone and owns every partition.
//! 3. Once a quarter is applied, consumer `b` joins: the assignment moves
//!    half the partitions, `a` hands them off (drain, ack, release) and
//!    `b` takes them over (claim what `a` left pending, then read).
//! 4. Once half is applied, `b`'s acks are stalled and, after it applied a
//!    few more records, it crashes: force stop, runtime and connections
//!    dropped, nothing released. Its member entry and leases expire; `a`
//!    takes its partitions back, claims the pending entries (idle for
//!    `claim_idle`) and re-applies them: those `b` had applied are skipped
//!    as duplicates.
//! 5. When everything is applied and acked, `a` leaves gracefully, and
//!    Redis is checked: every key's records applied exactly once and in
//!    order, balances right, nothing pending.

use std::error::Error;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keyed_executor_redis::{Event, Takeover};

use crate::ledger::{self, ConsumerConfig, Node, StatsSnapshot, Verification};

/// The run's size and timing.
#[derive(Debug, Clone)]
pub struct Scenario {
    pub url: String,
    pub partitions: usize,
    pub keys: u64,
    pub records: u64,
    /// Lease (and claim idle threshold) of both consumers: how long a
    /// crash goes unnoticed.
    pub lease: Duration,
    /// How long a released partition may drain before it is force-stopped
    /// (zero: force-stop at once, handing back what is queued).
    pub drain_timeout: Duration,
    /// Records `b` applies with its acks stalled before it crashes, so
    /// that the crash leaves that many applied-but-unacked records at
    /// least (0: it crashes at once, with whatever its last ack round had
    /// not yet acked).
    pub stall_before_crash: u64,
    /// Guard against a hang: the longest any one step may take.
    pub step_timeout: Duration,
    /// Print events and progress as they happen.
    pub verbose: bool,
}

impl Scenario {
    pub fn new(url: impl Into<String>) -> Self {
        Scenario {
            url: url.into(),
            partitions: 4,
            keys: 400,
            records: 20_000,
            lease: Duration::from_millis(1500),
            drain_timeout: Duration::from_secs(5),
            stall_before_crash: 32,
            step_timeout: Duration::from_secs(120),
            verbose: false,
        }
    }
}

/// What happened, for the caller to check and print.
#[derive(Debug)]
pub struct Report {
    pub verification: Verification,
    /// Every node's events, with its name.
    pub events: Vec<(String, Event)>,
    /// Duplicates counted in Redis before the crash and after the end.
    pub duplicates_before_crash: u64,
    pub stats_a: StatsSnapshot,
    pub stats_b: StatsSnapshot,
    /// Records `b` had finished (applied, or skipped as duplicates) and
    /// not acked, counted just before its crash. With its acks stalled
    /// each of them is redelivered and skipped; without, a last ack round
    /// may still go out. On top of these, the writes `b` had in flight when
    /// it died may have reached Redis too, and come back as duplicates.
    pub finished_unacked_by_b: u64,
    pub elapsed: Duration,
}

impl Report {
    /// Partitions `b` took over from `a`'s graceful release.
    pub fn hand_offs_to_b(&self) -> usize {
        self.events
            .iter()
            .filter(|e| {
                matches!(e, (consumer, Event::Started { how: Takeover::HandedOff, .. }) if consumer == "b")
            })
            .count()
    }

    /// Partitions `a` released gracefully.
    pub fn releases_by_a(&self) -> usize {
        self.events
            .iter()
            .filter(|e| matches!(e, (consumer, Event::Released { .. }) if consumer == "a"))
            .count()
    }

    /// Records `a`'s releases force-stopped and handed back (left pending
    /// for the next owner), and how many of its releases were
    /// force-stopped past the drain deadline.
    pub fn handed_back_by_a(&self) -> (u64, usize) {
        self.events
            .iter()
            .filter_map(|e| match e {
                (
                    consumer,
                    Event::Released {
                        drained,
                        handed_back,
                        ..
                    },
                ) if consumer == "a" => Some((*handed_back, usize::from(!drained))),
                _ => None,
            })
            .fold((0, 0), |(h, f), (hb, forced)| (h + hb, f + forced))
    }

    /// Partitions `a` took over after `b`'s crash (vacant leases), and the
    /// entries it claimed there.
    pub fn takeovers_by_a(&self) -> (usize, u64) {
        self.events
            .iter()
            .filter_map(|e| match e {
                (
                    consumer,
                    Event::Started {
                        how: Takeover::Vacant,
                        claimed,
                        ..
                    },
                ) if consumer == "a" => Some(*claimed),
                _ => None,
            })
            .fold((0, 0), |(n, c), claimed| {
                // `a`'s first start (an empty group) claims nothing.
                if claimed > 0 {
                    (n + 1, c + claimed)
                } else {
                    (n, c)
                }
            })
    }

    /// Duplicates the crash caused.
    pub fn crash_duplicates(&self) -> u64 {
        self.verification.duplicates - self.duplicates_before_crash
    }
}

fn unacked(s: &StatsSnapshot) -> u64 {
    (s.applied + s.duplicates).saturating_sub(s.acked)
}

/// Runs the scenario against the (empty) Redis at `s.url`.
pub fn run(s: &Scenario) -> Result<Report, Box<dyn Error>> {
    let began = Instant::now();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let client = redis::Client::open(s.url.as_str())?;
    let mut conn = rt.block_on(client.get_multiplexed_async_connection())?;

    let events: Arc<Mutex<Vec<(String, Event)>>> = Arc::default();
    let verbose = s.verbose;
    let log = events.clone();
    let sink: ledger::EventSink = Arc::new(move |node: &str, e: &Event| {
        if verbose && !matches!(e, Event::Acquired { .. }) {
            println!("  {:>6.2}s [{node}] {e}", began.elapsed().as_secs_f64());
        }
        log.lock().unwrap().push((node.to_string(), e.clone()));
    });
    let config = |name: &str| {
        let mut c = ConsumerConfig::new(s.url.clone(), name, s.partitions);
        c.lease = s.lease;
        c.claim_idle = s.lease;
        c.drain_timeout = s.drain_timeout;
        c
    };
    let step = |what: &str, cond: &mut dyn FnMut() -> Result<bool, Box<dyn Error>>| {
        let deadline = Instant::now() + s.step_timeout;
        while !cond()? {
            if Instant::now() > deadline {
                return Err(format!("no progress within {:?}: {what}", s.step_timeout).into());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok::<(), Box<dyn Error>>(())
    };
    let applied = |conn: &mut redis::aio::MultiplexedConnection| -> Result<u64, Box<dyn Error>> {
        Ok(rt.block_on(ledger::totals(conn))?.0)
    };

    // 1. The producer, on its own thread and connection. It waits at
    // `hold_at` until `release` is dropped (step 4, or any early return).
    let url = s.url.clone();
    let (partitions, keys, records) = (s.partitions, s.keys, s.records);
    let hold_at = records - records / 8;
    let (release, held) = std::sync::mpsc::channel::<()>();
    let mut release = Some(release);
    let producer = std::thread::spawn(move || -> Result<(), String> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| e.to_string())?;
        let mut waited = false;
        let hold = |done: u64| {
            if done >= hold_at && !waited {
                waited = true;
                // Nothing is ever sent: the scenario dropping its end is
                // the go-ahead.
                let _ = held.recv();
            }
        };
        rt.block_on(async {
            let client = redis::Client::open(url.as_str())?;
            let mut conn = client.get_multiplexed_async_connection().await?;
            ledger::produce(&mut conn, partitions, keys, records, 200, None, hold).await
        })
        .map_err(|e| e.to_string())
    });

    // 2. `a` alone.
    let a = Node::start(config("a"), sink.clone())?;
    let quarter = s.records / 4;
    step("a applies a quarter", &mut || {
        Ok(applied(&mut conn)? >= quarter)
    })?;

    // 3. `b` joins: a graceful hand-off of half the partitions.
    if verbose {
        println!(
            "  {:>6.2}s -- {} applied; b joins",
            began.elapsed().as_secs_f64(),
            applied(&mut conn)?
        );
    }
    let b = Node::start(config("b"), sink.clone())?;
    let half = s.partitions / 2;
    let started_by_b = || {
        events
            .lock()
            .unwrap()
            .iter()
            .filter(|e| matches!(e, (consumer, Event::Started { .. }) if consumer == "b"))
            .count()
    };
    step(
        "b takes over its partitions (claimed, reading)",
        &mut || Ok(started_by_b() >= half),
    )?;

    // 4. `b` crashes with applied-but-unacked records.
    step("half applied", &mut || {
        Ok(applied(&mut conn)? >= s.records / 2)
    })?;
    if s.stall_before_crash > 0 {
        // Stall first, then count: every record counted from here on got
        // its answer after the stall, so its ack never goes out.
        b.stall_acks();
        let stalled_at = b.stats().applied;
        // The held-back eighth: records for `b` to apply unacked.
        drop(release.take());
        step("b applies records it will never ack", &mut || {
            Ok(b.stats().applied >= stalled_at + s.stall_before_crash)
        })?;
    }
    drop(release.take());
    let duplicates_before_crash = rt.block_on(ledger::totals(&mut conn))?.1;
    let stats_b = b.stats();
    if verbose {
        println!(
            "  {:>6.2}s -- {} applied; b crashes (owning {:?}, {} of its finished records not acked)",
            began.elapsed().as_secs_f64(),
            applied(&mut conn)?,
            b.owned(),
            unacked(&stats_b)
        );
    }
    b.crash();

    // 5. `a` takes everything back and finishes.
    step("the producer finishes", &mut || Ok(producer.is_finished()))?;
    producer.join().expect("producer thread")?;
    step("everything applied and acked", &mut || {
        Ok(applied(&mut conn)? >= s.records
            && rt.block_on(ledger::pending(&mut conn, s.partitions))? == 0)
    })?;
    let stats_a = a.stats();
    a.leave(s.step_timeout)?;
    let verification = rt.block_on(ledger::verify(&mut conn, s.partitions))?;
    let events = std::mem::take(&mut *events.lock().unwrap());
    Ok(Report {
        verification,
        events,
        duplicates_before_crash,
        stats_a,
        stats_b,
        finished_unacked_by_b: unacked(&stats_b),
        elapsed: began.elapsed(),
    })
}
