//! Several consumer **processes** sharing a group's partitions, against a
//! real `redis-server` this test starts (a temp dir, a free port).
//!
//! This binary is both the test and its consumers: `multi_process consume
//! --url U --name N` runs one node (the test spawns it four times, as
//! separate processes) and prints its events on stdout; without arguments
//! it runs the scenario:
//!
//! 1. three nodes (c1, c2, c3) share 8 partitions; a producer writes the
//!    records (100,000 over 1,000 keys in a release build, 20,000 in a
//!    debug one; `KEYED_REDIS_RECORDS` sets it) at a steady rate, with
//!    poison among them (a record the handler refuses every 1,000, an
//!    entry that does not decode every 1,000);
//! 2. c1 is killed with SIGKILL while it holds pending entries; c2 and c3
//!    take its partitions over once its lease expires;
//! 3. c4 joins: partitions are handed off to it;
//! 4. c2 leaves gracefully: its partitions are handed off;
//! 5. once everything is applied, c3 and c4 leave.
//!
//! Then it checks: every record applied exactly once and in per-key order
//! (the handler's script applies only `seq == last + 1`), nothing pending,
//! the dead letters exactly the poison, each once; no partition ever run
//! by two nodes at once (from the nodes' own acquire / release times) and
//! every partition owned again after each change; what c1 left pending
//! was claimed by the survivors. It prints the hand-off and recovery times.
//!
//! Skips with a printed reason when `redis-server` is not installed,
//! unless `KEYED_REQUIRE_REDIS=1`. `KEYED_REDIS_RECORDS` and
//! `KEYED_REDIS_LEASE_MS` change its size and its lease.

mod support;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use keyed_executor_redis::{Consumer, Event, Takeover};

const PARTITIONS: usize = 8;
const KEYS: u64 = 1_000;
/// The lease (and claim idle time) of every node: 2 s, or
/// `KEYED_REDIS_LEASE_MS` (the nodes inherit the variable).
fn lease() -> Duration {
    Duration::from_millis(
        std::env::var("KEYED_REDIS_LEASE_MS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(2_000),
    )
}
const HEARTBEAT: Duration = Duration::from_millis(100);
/// The producer's run time: the changes happen while it writes.
const PRODUCE_FOR: Duration = Duration::from_secs(20);
/// The longest any one step may take before the test fails.
const STEP: Duration = Duration::from_secs(120);

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_micros() as u64
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("consume") {
        consume(&args[1..]);
        return;
    }
    if args.iter().any(|a| a == "--list") {
        println!("multi_process: test");
        return;
    }
    let began = Instant::now();
    let Some(server) = support::redis_or_skip("multi_process") else {
        println!("0 passed, 0 failed, 1 skipped");
        return;
    };
    scenario(&server.url());
    println!(
        "multi_process: passed in {:.1?}\n1 passed, 0 failed",
        began.elapsed()
    );
}

// ---------------------------------------------------------------- a node --

/// One node: runs until a `leave` line (or the end of stdin), printing
/// `EV <unix µs> <event>` lines as it goes.
fn consume(args: &[String]) {
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .cloned()
            .unwrap_or_else(|| panic!("consume needs {name}"))
    };
    let (url, name) = (flag("--url"), flag("--name"));
    let rt = support::runtime();
    let store = support::Store::connect(&rt, &url);
    let out = Arc::new(Mutex::new(std::io::stdout()));
    let print = move |line: String| {
        let mut out = out.lock().unwrap();
        let _ = writeln!(out, "{line}");
        let _ = out.flush();
    };
    let p = print.clone();
    let consumer = Consumer::builder(&url, support::streams(PARTITIONS))
        .group(support::GROUP)
        .name(&name)
        .dead_letters(Some(support::DEAD.into()))
        .lease(lease())
        .heartbeat(HEARTBEAT)
        .join_delay(Duration::from_millis(500))
        .workers(2)
        .decode(support::decode)
        .handler(support::handler(store))
        .verdict(support::verdict)
        .on_event(move |e| {
            let t = now_us();
            let line = match e {
                Event::Acquired { partition, .. } => format!("EV {t} acquired {partition}"),
                Event::Started {
                    partition,
                    how,
                    claimed,
                    ..
                } => format!(
                    "EV {t} started {partition} {} {claimed}",
                    if *how == Takeover::HandedOff {
                        "handed-off"
                    } else {
                        "vacant"
                    }
                ),
                Event::Released { partition, .. } => format!("EV {t} released {partition}"),
                Event::Fenced { partition, why } => format!("EV {t} fenced {partition} {why}"),
                Event::Halted { partition, why } => format!("EV {t} halted {partition} {why}"),
                other => format!("LOG {t} {other}"),
            };
            p(line);
        })
        .start()
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let mut line = String::new();
    loop {
        line.clear();
        match std::io::stdin().read_line(&mut line) {
            Ok(0) | Err(_) => break,
            Ok(_) if line.trim() == "leave" => break,
            Ok(_) => {}
        }
    }
    let t = now_us();
    print(format!("EV {t} leaving"));
    let stats = consumer.stats();
    let left = consumer.leave(Duration::from_secs(30));
    print(format!(
        "STATS read={} redelivered={} applied={} acked={} dead_lettered={} handed_back={}",
        stats.read,
        stats.redelivered,
        stats.applied,
        stats.acked,
        stats.dead_lettered,
        stats.handed_back
    ));
    match left {
        Ok(()) => print("LEFT ok".into()),
        Err(e) => {
            print(format!("LEFT failed: {e}"));
            std::process::exit(1);
        }
    }
}

// ------------------------------------------------------------ the nodes --

/// An event a node printed: (time µs, node, what, partition, rest).
#[derive(Debug, Clone)]
struct Ev {
    t: u64,
    node: String,
    what: String,
    partition: Option<usize>,
    rest: Vec<String>,
}

type Log = Arc<Mutex<Vec<Ev>>>;

/// A node process; killed if still running when dropped (a failed test).
struct Node {
    name: String,
    child: Child,
    stdin: Option<ChildStdin>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Node {
    fn spawn(url: &str, name: &str, log: &Log) -> Node {
        let mut child = Command::new(std::env::current_exe().expect("own path"))
            .args(["consume", "--url", url, "--name", name])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn a node");
        let stdout = child.stdout.take().expect("piped");
        let stdin = child.stdin.take();
        let (log, node) = (log.clone(), name.to_string());
        let reader = std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let words: Vec<&str> = line.split_whitespace().collect();
                match words.as_slice() {
                    ["EV", t, what, rest @ ..] => {
                        let partition = rest.first().and_then(|p| p.parse().ok());
                        log.lock().unwrap().push(Ev {
                            t: t.parse().unwrap_or(0),
                            node: node.clone(),
                            what: what.to_string(),
                            partition,
                            rest: rest.iter().skip(1).map(|s| s.to_string()).collect(),
                        });
                        if *what == "halted" || *what == "fenced" {
                            println!("  [{node}] {line}");
                        }
                    }
                    _ => println!("  [{node}] {line}"),
                }
            }
        });
        Node {
            name: name.into(),
            child,
            stdin,
            reader: Some(reader),
        }
    }

    fn kill(&mut self) -> u64 {
        // SAFETY: kill(2) on our own child's pid; no memory is involved.
        let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGKILL) };
        let t = now_us();
        assert_eq!(rc, 0, "SIGKILL {}", self.name);
        let _ = self.child.wait();
        t
    }

    /// Asks the node to leave; returns when it asked.
    fn leave(&mut self) -> u64 {
        let t = now_us();
        let stdin = self.stdin.as_mut().expect("running");
        writeln!(stdin, "leave").expect("write to the node");
        stdin.flush().expect("flush");
        t
    }

    fn wait(&mut self) {
        let deadline = Instant::now() + STEP;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                assert!(status.success(), "{} exited with {status}", self.name);
                break;
            }
            assert!(Instant::now() < deadline, "{} did not leave", self.name);
            std::thread::sleep(Duration::from_millis(20));
        }
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn step(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + STEP;
    while !cond() {
        assert!(
            Instant::now() < deadline,
            "no progress within {STEP:?}: {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn events(log: &Log, node: &str, what: &str) -> Vec<Ev> {
    log.lock()
        .unwrap()
        .iter()
        .filter(|e| e.node == node && e.what == what)
        .cloned()
        .collect()
}

/// Partitions `node` owns now, from its acquire and release events.
fn owned_by(log: &Log, node: &str) -> BTreeSet<usize> {
    let mut owned = BTreeSet::new();
    for e in log.lock().unwrap().iter().filter(|e| e.node == node) {
        match (e.what.as_str(), e.partition) {
            ("acquired", Some(p)) => {
                owned.insert(p);
            }
            ("released" | "fenced", Some(p)) => {
                owned.remove(&p);
            }
            _ => {}
        }
    }
    owned
}

/// When each of `partitions` was next started (reading) by a node other
/// than `old` after `since`: the latest of those times.
fn all_started_elsewhere(
    log: &Log,
    old: &str,
    partitions: &BTreeSet<usize>,
    since: u64,
) -> Option<u64> {
    let log = log.lock().unwrap();
    let mut latest = 0;
    for &p in partitions {
        let t = log
            .iter()
            .filter(|e| {
                e.node != old && e.what == "started" && e.partition == Some(p) && e.t >= since
            })
            .map(|e| e.t)
            .min()?;
        latest = latest.max(t);
    }
    Some(latest)
}

// ------------------------------------------------------------- scenario --

fn scenario(url: &str) {
    let records: u64 = std::env::var("KEYED_REDIS_RECORDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if cfg!(debug_assertions) {
            20_000
        } else {
            100_000
        });
    let streams = support::streams(PARTITIONS);
    let rt = support::runtime();
    let client = redis::Client::open(url).expect("url");
    let mut conn = rt
        .block_on(client.get_multiplexed_async_connection())
        .expect("connect");
    let settled = |conn: &mut redis::aio::MultiplexedConnection| {
        rt.block_on(support::settled(conn)).expect("settled").0
    };
    println!(
        "multi_process: {records} records over {KEYS} keys, {PARTITIONS} partitions, lease \
         {:?}, heartbeat {HEARTBEAT:?}, claim idle = lease",
        lease()
    );
    let log: Log = Arc::default();
    let began = Instant::now();
    let mut c1 = Node::spawn(url, "c1", &log);
    let mut c2 = Node::spawn(url, "c2", &log);
    let mut c3 = Node::spawn(url, "c3", &log);

    // The producer, paced so that the changes below happen while it runs.
    let producing = {
        let url = url.to_string();
        let streams = streams.clone();
        std::thread::spawn(move || {
            let rt = support::runtime();
            rt.block_on(async {
                let client = redis::Client::open(url.as_str())?;
                let mut conn = client.get_multiplexed_async_connection().await?;
                let rate = (records as f64 / PRODUCE_FOR.as_secs_f64()) as u64;
                support::produce(
                    &mut conn,
                    &streams,
                    KEYS,
                    0,
                    records,
                    Some(rate.max(1)),
                    |_| {},
                )
                .await
            })
        })
    };

    // 1. Three nodes share the partitions.
    step("c1, c2, c3 started all 8 partitions", || {
        let log = log.lock().unwrap();
        let started: BTreeSet<usize> = log
            .iter()
            .filter(|e| e.what == "started")
            .filter_map(|e| e.partition)
            .collect();
        started.len() == PARTITIONS
    });
    step("15 % applied", || settled(&mut conn) >= records * 15 / 100);

    // 2. c1 dies with entries pending.
    step("c1 has entries pending", || {
        let (_, by) = rt
            .block_on(support::pending(&mut conn, &streams))
            .expect("pending");
        by.get("c1").copied().unwrap_or(0) > 0
    });
    let c1_partitions = owned_by(&log, "c1");
    let killed_at = c1.kill();
    // Its last acks may still be on the wire: read what it left once they landed.
    std::thread::sleep(Duration::from_millis(200));
    let (_, by) = rt
        .block_on(support::pending(&mut conn, &streams))
        .expect("pending");
    let left_pending = by.get("c1").copied().unwrap_or(0);
    println!(
        "  {:>6.2}s c1 killed (SIGKILL) owning {c1_partitions:?}, {left_pending} entries pending",
        began.elapsed().as_secs_f64()
    );
    let mut recovered_at = None;
    step("c2 and c3 took c1's partitions over and read them", || {
        recovered_at = all_started_elsewhere(&log, "c1", &c1_partitions, killed_at);
        recovered_at.is_some()
    });
    let recovery = Duration::from_micros(recovered_at.expect("set") - killed_at);
    println!(
        "  {:>6.2}s recovered: c1's partitions read again {recovery:.2?} after the kill",
        began.elapsed().as_secs_f64()
    );

    // 3. c4 joins.
    step("45 % applied", || settled(&mut conn) >= records * 45 / 100);
    let mut c4 = Node::spawn(url, "c4", &log);
    step("c4 reads its share", || {
        events(&log, "c4", "started").len() >= PARTITIONS / 3
    });
    println!(
        "  {:>6.2}s c4 joined: reads {:?}",
        began.elapsed().as_secs_f64(),
        owned_by(&log, "c4")
    );

    // 4. c2 leaves gracefully.
    step("65 % applied", || settled(&mut conn) >= records * 65 / 100);
    let c2_partitions = owned_by(&log, "c2");
    let leave_at = c2.leave();
    c2.wait();
    let mut handed_at = None;
    step("c2's partitions read by their new owners", || {
        handed_at = all_started_elsewhere(&log, "c2", &c2_partitions, leave_at);
        handed_at.is_some()
    });
    let hand_off = Duration::from_micros(handed_at.expect("set") - leave_at);
    println!(
        "  {:>6.2}s c2 left: its partitions {c2_partitions:?} read by their new owners \
         {hand_off:.2?} after it was asked to leave",
        began.elapsed().as_secs_f64()
    );

    // 5. Everything applied and acked; the last two leave.
    step("the producer finishes", || producing.is_finished());
    producing.join().expect("producer").expect("produce");
    let mut last = (0, Instant::now());
    let deadline = Instant::now() + STEP;
    loop {
        let done = settled(&mut conn);
        let (pending, _) = rt
            .block_on(support::pending(&mut conn, &streams))
            .expect("pending");
        if done >= records && pending == 0 {
            break;
        }
        if done != last.0 {
            last = (done, Instant::now());
        }
        assert!(
            last.1.elapsed() < Duration::from_secs(30) && Instant::now() < deadline,
            "stuck at {done} of {records} settled, {pending} pending"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let owned_at_end: BTreeSet<usize> = ["c3", "c4"]
        .iter()
        .flat_map(|n| owned_by(&log, n))
        .collect();
    let end_of_run = now_us();
    c3.leave();
    c4.leave();
    c3.wait();
    c4.wait();
    let elapsed = began.elapsed();

    // The checks.
    let v = rt
        .block_on(support::verify(&mut conn, &streams))
        .expect("verify");
    println!(
        "  ledger: {} keys, {} records produced, {} applied, {} refused, {} duplicates skipped, \
         {} gaps, {} pending, {} dead letters ({} poison)",
        v.keys,
        v.produced,
        v.applied,
        v.refused,
        v.duplicates,
        v.gaps,
        v.pending,
        v.dead_letters.len(),
        v.poison.len()
    );
    assert_eq!(v.produced, records);
    assert!(
        v.poison.len() as u64 >= 2 * (records / 1000) - 1,
        "poison was written"
    );
    assert!(v.problems().is_empty(), "{:#?}", v.problems());

    let log = log.lock().unwrap().clone();
    let halted: Vec<&Ev> = log.iter().filter(|e| e.what == "halted").collect();
    assert!(halted.is_empty(), "partitions halted: {halted:?}");

    // No partition run by two nodes at once: per partition, each node's
    // ownership [acquired, released or fenced or killed] is disjoint from
    // the others'.
    let mut intervals: BTreeMap<usize, Vec<(u64, u64, String)>> = BTreeMap::new();
    let mut open: BTreeMap<(String, usize), u64> = BTreeMap::new();
    for e in &log {
        let Some(p) = e.partition else { continue };
        match e.what.as_str() {
            "acquired" => {
                open.insert((e.node.clone(), p), e.t);
            }
            "released" | "fenced" => {
                let from = open.remove(&(e.node.clone(), p)).unwrap_or_else(|| {
                    panic!("{} {} partition {p} it never acquired", e.node, e.what)
                });
                intervals
                    .entry(p)
                    .or_default()
                    .push((from, e.t, e.node.clone()));
            }
            _ => {}
        }
    }
    for ((node, p), from) in open {
        assert_eq!(node, "c1", "{node} still owned partition {p} after leaving");
        intervals
            .entry(p)
            .or_default()
            .push((from, killed_at, node));
    }
    let mut max_gap = Duration::ZERO;
    for (p, list) in &mut intervals {
        list.sort();
        for pair in list.windows(2) {
            let ((_, end, a), (start, _, b)) = (&pair[0], &pair[1]);
            assert!(
                start >= end,
                "partition {p} was owned by {b} from {start} while {a} still owned it until {end}"
            );
            // After a kill the gap includes waiting out the lease.
            if *end != killed_at {
                max_gap = max_gap.max(Duration::from_micros(start - end));
            }
        }
    }
    // Every partition was owned again after each change, and by the two
    // live nodes at the end.
    assert_eq!(
        owned_at_end,
        (0..PARTITIONS).collect(),
        "partitions owned by c3 and c4 when everything was applied"
    );
    for p in 0..PARTITIONS {
        let covered = intervals[&p]
            .iter()
            .any(|(s, e, _)| *s <= end_of_run && *e >= end_of_run);
        assert!(covered, "partition {p} had no owner at the end of the run");
    }

    // What c1 left pending was claimed by the survivors (then applied,
    // or skipped as a duplicate: nothing is pending now).
    let claimed_from_c1: u64 = log
        .iter()
        .filter(|e| {
            e.what == "started"
                && e.t >= killed_at
                && e.partition.is_some_and(|p| c1_partitions.contains(&p))
                && e.rest.first().map(String::as_str) == Some("vacant")
        })
        .filter_map(|e| e.rest.get(1).and_then(|n| n.parse::<u64>().ok()))
        .sum();
    assert!(
        claimed_from_c1 >= left_pending,
        "c1 left {left_pending} entries pending, the survivors claimed {claimed_from_c1}"
    );
    println!(
        "  recovery (SIGKILL → c1's partitions read by the survivors): {recovery:.2?}; \
         hand-off (c2 asked to leave → its partitions read by their new owners): {hand_off:.2?}; \
         longest gap between one owner's release and the next one's lease: {max_gap:.2?}; \
         claimed from c1: {claimed_from_c1} (it left {left_pending} pending); {} duplicates; \
         whole run {elapsed:.1?}",
        v.duplicates
    );
}
