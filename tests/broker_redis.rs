//! Against a real broker: a `redis-server` this test starts itself (a temp
//! dir, a free loopback port, no persistence; killed at the end, also on
//! a panic). It runs the example's own ledger (`examples/redis_consumer/`,
//! included below, not copied) on the `keyed-executor-redis` crate: a
//! producer, two nodes with their own executors, runtimes and connections
//! in one process, a graceful hand-off and a crash midway (the crate's own
//! tests run separate processes), and checks in Redis that every key's records were applied
//! exactly once and in order (duplicates skipped and counted, no gap) and
//! that nothing stays pending.
//!
//! Skips with a printed reason when `redis-server` is not on `PATH`,
//! unless `KEYED_REQUIRE_REDIS=1` (CI), which makes that a failure.

#[allow(dead_code)] // the command line uses what the test does not
#[path = "../examples/redis_consumer/ledger.rs"]
mod ledger;
#[path = "../examples/redis_consumer/scenario.rs"]
mod scenario;
#[allow(dead_code)]
#[path = "../examples/redis_consumer/server.rs"]
mod server;

fn redis_or_skip() -> Option<server::RedisServer> {
    let required = std::env::var("KEYED_REQUIRE_REDIS").is_ok_and(|v| v == "1");
    match server::RedisServer::start() {
        Ok(server) => Some(server),
        Err(e @ server::StartError::NotInstalled) if !required => {
            println!("SKIPPED broker_redis: {e} (install redis-server, or set KEYED_REQUIRE_REDIS=1 to make this a failure)");
            None
        }
        Err(e @ server::StartError::NotInstalled) => {
            panic!("KEYED_REQUIRE_REDIS=1, but {e} (apt-get install redis-server)")
        }
        Err(e) => panic!("{e}"),
    }
}

/// Runs the scenario, prints what happened, and checks what must hold in
/// every run: exactly once, in order, nothing pending, a hand-off and a
/// crash recovered with its duplicates skipped.
fn run_and_check(s: &scenario::Scenario) -> scenario::Report {
    let report = scenario::run(s).unwrap_or_else(|e| panic!("scenario failed: {e}"));
    for (node, e) in &report.events {
        println!("  [{node}] {e}");
    }
    let v = &report.verification;
    let (takeovers, claimed) = report.takeovers_by_a();
    println!(
        "hand-off: b took over {} partitions from a's release; crash: b died with {} finished \
         records not acked, a took {takeovers} partitions over, claimed {claimed} pending, {} \
         duplicates skipped",
        report.hand_offs_to_b(),
        report.finished_unacked_by_b,
        report.crash_duplicates()
    );
    println!("consumer a: {:?}", report.stats_a);
    println!("consumer b (at its crash): {:?}", report.stats_b);
    println!(
        "ledger: {} keys, {} produced, {} applied, {} duplicates, {} gaps, {} pending ({:.2?})",
        v.keys, v.produced, v.applied, v.duplicates, v.gaps, v.pending, report.elapsed
    );

    // Exactly once, in order: the script advances a key only by
    // `seq == last + 1`, so every key at its last produced seq with no gap
    // and `applied == produced` means each record applied once, in order.
    assert_eq!(v.produced, s.records);
    assert_eq!(v.keys as u64, s.keys);
    assert!(v.problems().is_empty(), "{:?}", v.problems());
    // Every thousandth record cannot be applied: each was dead-lettered
    // once (counted, and one entry in the dead-letter stream), and acked.
    assert!(v.poisoned >= 1);
    assert_eq!(v.applied + v.poisoned, s.records);
    assert_eq!((v.dead, v.dead_stream), (v.poisoned, v.poisoned));
    assert_eq!(v.gaps, 0);
    assert_eq!(v.pending, 0, "XPENDING is empty on every partition");

    // The hand-off happened: a released, b took over from the release.
    assert!(report.hand_offs_to_b() >= 1, "b took over by hand-off");
    assert!(report.releases_by_a() >= 1);
    // The crash happened and was recovered: a claimed b's pending entries,
    // and what b had applied without acking came back as duplicates.
    // (b applied `stall_before_crash` records after its acks stalled.)
    assert!(takeovers >= 1 && claimed >= s.stall_before_crash);
    assert!(
        report.crash_duplicates() >= s.stall_before_crash,
        "every record b applied and never acked is redelivered and skipped"
    );
    report
}

fn scenario(url: String) -> scenario::Scenario {
    let mut s = scenario::Scenario::new(url);
    s.partitions = 4;
    s.keys = 300;
    // The producer holds the last eighth back until `b`'s acks stall
    // (see the scenario): 14,000 up front keep `a` busy at the hand-off.
    s.records = 16_000;
    s
}

#[test]
fn two_consumers_a_hand_off_and_a_crash_apply_every_record_once_in_order() {
    let Some(server) = redis_or_skip() else {
        return;
    };
    let report = run_and_check(&scenario(server.url()));
    let (_, forced) = report.handed_back_by_a();
    assert_eq!(forced, 0, "with a 5 s deadline the hand-off drains");
}

/// The same, with no time to drain at the hand-off: `a` force-stops the
/// released partitions, what was queued comes back `Rejected` (a running
/// write `Cancelled`), stays pending unacked, and `b` claims it first.
#[test]
fn a_hand_off_past_its_drain_deadline_hands_records_back_and_still_applies_each_once() {
    let Some(server) = redis_or_skip() else {
        return;
    };
    let mut s = scenario(server.url());
    s.drain_timeout = std::time::Duration::ZERO;
    let report = run_and_check(&s);
    let (handed_back, forced) = report.handed_back_by_a();
    println!("a's releases: {forced} force-stopped, {handed_back} records handed back");
    assert!(forced >= 1, "a zero deadline force-stops a busy partition");
}
