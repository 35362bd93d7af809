//! The errors users meet, each with a clear error and nothing lost: bad
//! settings, Redis unreachable at start and mid-run, a missing group,
//! nodes that disagree on the partitions, a lease lost while handling, a
//! record nobody can dead-letter.
//!
//! The tests that need Redis start their own `redis-server` and skip with
//! a printed reason when it is not installed, unless
//! `KEYED_REQUIRE_REDIS=1`.

mod support;

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, TcpListener};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keyed_executor::handler;
use keyed_executor_redis::{ConfigError, Consumer, DecodeError, Entry, Event, StartError, Streams};

fn wait_for(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + timeout;
    while !cond() {
        assert!(Instant::now() < deadline, "not within {timeout:?}: {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn noop_decode(e: &Entry) -> Result<(u64, u64), DecodeError> {
    Ok((e.parse("key")?, e.parse("seq")?))
}

fn noop() -> impl keyed_executor::handler::Handler<u64, u64, Output = ()> {
    handler::from_fn(|_: &u64, _: u64| ())
}

/// A builder with the settings every test here shares.
fn node(url: &str, streams: Streams, name: &str) -> keyed_executor_redis::ConsumerBuilder {
    Consumer::builder(url, streams)
        .group(support::GROUP)
        .name(name)
        .lease(Duration::from_millis(1500))
        .heartbeat(Duration::from_millis(100))
        .claim_idle(Duration::from_millis(300))
        .workers(2)
        .connect_timeout(Duration::from_secs(5))
}

#[test]
fn bad_settings_are_reported_before_anything_connects() {
    let start = |b: keyed_executor_redis::ConsumerBuilder| match b
        .decode(noop_decode)
        .handler(noop())
        .start()
    {
        Err(StartError::Config(e)) => e,
        other => panic!("expected a config error, got {other:?}"),
    };
    let url = "redis://127.0.0.1:1/";
    let ok = || node(url, Streams::numbered("s:", 2), "a");
    assert_eq!(
        start(
            Consumer::builder(url, Streams::list(Vec::<String>::new()))
                .group("g")
                .name("a")
        ),
        ConfigError::NoPartitions
    );
    assert_eq!(
        start(
            Consumer::builder(url, Streams::list(["x", "y", "x"]))
                .group("g")
                .name("a")
        ),
        ConfigError::DuplicateStream("x".into())
    );
    assert_eq!(start(ok().group("")), ConfigError::EmptyGroup);
    assert_eq!(
        start(ok().name("node a")),
        ConfigError::BadName("node a".into())
    );
    assert_eq!(
        start(ok().max_in_flight(0)),
        ConfigError::Zero("max_in_flight")
    );
    assert_eq!(start(ok().read_count(0)), ConfigError::Zero("read_count"));
    assert_eq!(start(ok().workers(0)), ConfigError::Zero("workers"));
    assert_eq!(
        start(ok().block(Duration::from_micros(10))),
        ConfigError::ZeroTime("block")
    );
    let e = start(
        ok().lease(Duration::from_secs(1))
            .heartbeat(Duration::from_millis(400)),
    );
    assert!(matches!(e, ConfigError::HeartbeatTooSlow { .. }), "{e}");
    assert!(
        e.to_string().contains("at most a third of the lease"),
        "{e}"
    );
    let e = start(node("http://nowhere", Streams::numbered("s:", 2), "a"));
    assert!(matches!(e, ConfigError::Url { .. }), "{e}");
}

#[test]
fn start_fails_clearly_when_redis_is_unreachable() {
    // A port nobody listens on.
    let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let url = format!("redis://127.0.0.1:{port}/");
    let err = node(&url, Streams::numbered("s:", 2), "a")
        .connect_timeout(Duration::from_millis(300))
        .decode(noop_decode)
        .handler(noop())
        .start()
        .expect_err("nothing listens there");
    match &err {
        StartError::Unreachable { url: u, .. } => assert_eq!(u, &url),
        other => panic!("expected Unreachable, got {other:?}"),
    }
    assert!(err.to_string().contains("unreachable"), "{err}");
}

#[test]
fn a_missing_group_is_created_or_reported() {
    let Some(server) = support::redis_or_skip("a_missing_group_is_created_or_reported") else {
        return;
    };
    let streams = Streams::numbered("t:", 2);
    let err = node(&server.url(), streams.clone(), "a")
        .create_groups(false)
        .decode(noop_decode)
        .handler(noop())
        .start()
        .expect_err("no group exists");
    match &err {
        StartError::GroupMissing { stream, group, .. } => {
            assert_eq!((stream.as_str(), group.as_str()), ("t:0", support::GROUP));
        }
        other => panic!("expected GroupMissing, got {other:?}"),
    }
    assert!(err.to_string().contains("XGROUP CREATE t:0"), "{err}");
    // By default it creates them.
    let a = node(&server.url(), streams.clone(), "a")
        .decode(noop_decode)
        .handler(noop())
        .start()
        .expect("creates the streams and groups");
    a.leave(Duration::from_secs(10)).expect("leaves");
    // Now they exist, the strict form starts too.
    let b = node(&server.url(), streams, "b")
        .create_groups(false)
        .decode(noop_decode)
        .handler(noop())
        .start()
        .expect("the groups exist now");
    b.leave(Duration::from_secs(10)).expect("leaves");
}

#[test]
fn a_node_with_other_partitions_refuses_to_start_and_says_why() {
    let Some(server) = support::redis_or_skip("a_node_with_other_partitions_refuses_to_start")
    else {
        return;
    };
    let a = node(&server.url(), Streams::numbered("t:", 4), "a")
        .decode(noop_decode)
        .handler(noop())
        .start()
        .expect("the first node records the layout");
    wait_for("a owns the 4 partitions", Duration::from_secs(20), || {
        a.owned().len() == 4
    });
    let err = node(&server.url(), Streams::numbered("t:", 8), "b")
        .decode(noop_decode)
        .handler(noop())
        .start()
        .expect_err("8 partitions where the group has 4");
    match &err {
        StartError::LayoutMismatch {
            recorded_count,
            ours_count,
            layout_key,
            ..
        } => {
            assert_eq!((*recorded_count, *ours_count), (4, 8));
            assert_eq!(layout_key, "t:layout");
        }
        other => panic!("expected LayoutMismatch, got {other:?}"),
    }
    let text = err.to_string();
    assert!(
        text.contains("4 partitions recorded") && text.contains("given 8"),
        "{text}"
    );
    // The running node is untouched: b never joined.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(a.owned().len(), 4);
    a.leave(Duration::from_secs(10)).expect("leaves");
}

/// One partition whose first record blocks its handler; the lease is
/// taken from under the node: it stops the partition, hands the queued
/// records back and acks nothing; once the lease is free again it claims
/// them all and applies each (the one it had run comes back as a
/// duplicate).
#[test]
fn a_lease_lost_while_handling_stops_the_partition_hands_back_and_acks_nothing() {
    let Some(server) = support::redis_or_skip("a_lease_lost_while_handling") else {
        return;
    };
    let url = server.url();
    let streams = Streams::numbered("t:", 1);
    let rt = support::runtime();
    let client = redis::Client::open(url.as_str()).expect("url");
    let mut conn = rt
        .block_on(client.get_multiplexed_async_connection())
        .expect("connect");
    for seq in 0..40u64 {
        rt.block_on(
            redis::cmd("XADD")
                .arg("t:0")
                .arg("*")
                .arg("key")
                .arg(1)
                .arg("seq")
                .arg(seq)
                .query_async::<String>(&mut conn),
        )
        .expect("XADD");
    }
    let gate = Arc::new(AtomicBool::new(true));
    let applied: Arc<Mutex<Vec<u64>>> = Arc::default();
    let events: Arc<Mutex<Vec<Event>>> = Arc::default();
    let (g, a, ev) = (gate.clone(), applied.clone(), events.clone());
    let consumer = node(&url, streams.clone(), "a")
        .decode(noop_decode)
        .handler(handler::from_fn(move |_: &u64, seq: u64| {
            while g.load(Ordering::SeqCst) {
                std::thread::sleep(Duration::from_millis(1));
            }
            a.lock().unwrap().push(seq);
        }))
        .on_event(move |e| ev.lock().unwrap().push(e.clone()))
        .start()
        .expect("starts");
    wait_for("all 40 read and in flight", Duration::from_secs(20), || {
        let s = consumer.stats();
        s.read == 40 && s.partitions.get(&0).is_some_and(|p| p.in_flight == 40)
    });
    // Everything was delivered: the partition's lag (asked about once a
    // second) comes down to 0.
    wait_for("the lag is 0", Duration::from_secs(10), || {
        consumer.stats().partitions.get(&0).and_then(|p| p.lag) == Some(0)
    });

    // Someone else takes the lease.
    rt.block_on(
        redis::cmd("SET")
            .arg("t:owner:0")
            .arg("intruder")
            .arg("PX")
            .arg(60_000)
            .query_async::<()>(&mut conn),
    )
    .expect("SET");
    let fenced = |events: &Mutex<Vec<Event>>| {
        events
            .lock()
            .unwrap()
            .iter()
            .any(|e| matches!(e, Event::Fenced { partition: 0, .. }))
    };
    // The running record is let go only once the partition is stopping.
    wait_for("the partition is stopping", Duration::from_secs(10), || {
        consumer.owned().is_empty()
            || consumer
                .stats()
                .partitions
                .get(&0)
                .is_some_and(|p| p.state == keyed_executor_redis::PartitionState::Stopping)
    });
    // Give the stop time to close the receiver before the running record
    // ends (should the record behind it start first, the checks below
    // still hold: what ran is a prefix, the rest is handed back).
    std::thread::sleep(Duration::from_millis(200));
    gate.store(false, Ordering::SeqCst);
    wait_for("fenced", Duration::from_secs(10), || fenced(&events));
    let stats = consumer.stats();
    let ran = applied.lock().unwrap().clone();
    let k = ran.len() as u64;
    assert!(k >= 1, "the running record finished");
    assert_eq!(
        ran,
        (0..k).collect::<Vec<_>>(),
        "what ran is a prefix, in order"
    );
    assert_eq!(stats.handed_back, 40 - k, "the queued records came back");
    assert_eq!(stats.acked, 0, "nothing acked after the lease was lost");
    let (pending, by) = rt
        .block_on(support::pending(&mut conn, &streams))
        .expect("pending");
    assert_eq!((pending, by.get("a").copied()), (40, Some(40)));
    assert!(consumer.owned().is_empty(), "the intruder holds it");

    // The lease is free again: the node claims everything and goes on.
    rt.block_on(
        redis::cmd("DEL")
            .arg("t:owner:0")
            .query_async::<()>(&mut conn),
    )
    .expect("DEL");
    wait_for("all acked", Duration::from_secs(20), || {
        rt.block_on(support::pending(&mut conn, &streams))
            .expect("pending")
            .0
            == 0
    });
    let seen = applied.lock().unwrap().clone();
    let expected: Vec<u64> = (0..k).chain(0..40).collect();
    assert_eq!(
        seen, expected,
        "what ran before the fence ran again (not acked), then all 40 in order"
    );
    consumer.leave(Duration::from_secs(10)).expect("leaves");
}

/// Without a dead-letter stream, an entry that does not decode halts its
/// partition and stays pending: never dropped, never retried forever.
#[test]
fn without_a_dead_letter_stream_an_undecodable_entry_halts_its_partition() {
    let Some(server) = support::redis_or_skip("without_a_dead_letter_stream") else {
        return;
    };
    let url = server.url();
    let streams = Streams::numbered("t:", 1);
    let rt = support::runtime();
    let client = redis::Client::open(url.as_str()).expect("url");
    let mut conn = rt
        .block_on(client.get_multiplexed_async_connection())
        .expect("connect");
    for (key, seq) in [("1", "0"), ("oops", "1"), ("1", "2")] {
        rt.block_on(
            redis::cmd("XADD")
                .arg("t:0")
                .arg("*")
                .arg("key")
                .arg(key)
                .arg("seq")
                .arg(seq)
                .query_async::<String>(&mut conn),
        )
        .expect("XADD");
    }
    let events: Arc<Mutex<Vec<Event>>> = Arc::default();
    let ev = events.clone();
    let consumer = node(&url, streams.clone(), "a")
        .dead_letters(None)
        .decode(noop_decode)
        .handler(noop())
        .on_event(move |e| ev.lock().unwrap().push(e.clone()))
        .start()
        .expect("starts");
    wait_for("halted", Duration::from_secs(20), || {
        events.lock().unwrap().iter().any(
            |e| matches!(e, Event::Halted { partition: 0, why } if why.contains("does not decode")),
        )
    });
    let (pending, _) = rt
        .block_on(support::pending(&mut conn, &streams))
        .expect("pending");
    assert!(pending >= 1, "the undecodable entry stays pending");
    assert_eq!(
        consumer.owned().into_iter().collect::<Vec<_>>(),
        [0],
        "a halted partition stays owned"
    );
    let len: u64 = rt
        .block_on(redis::cmd("XLEN").arg("t:dead").query_async(&mut conn))
        .expect("XLEN");
    assert_eq!(len, 0, "no dead-letter stream was written");
    consumer.leave(Duration::from_secs(10)).expect("leaves");
}

/// Redis paused (SIGSTOP) for twice the lease, and every connection
/// dropped later: the nodes retry, fence their partitions, take them up
/// again; every record is applied once and in order, nothing pending.
#[test]
fn redis_unreachable_mid_run_loses_nothing() {
    let Some(server) = support::redis_or_skip("redis_unreachable_mid_run_loses_nothing") else {
        return;
    };
    let url = server.url();
    let streams = support::streams(4);
    let rt = support::runtime();
    let client = redis::Client::open(url.as_str()).expect("url");
    let mut conn = rt
        .block_on(client.get_multiplexed_async_connection())
        .expect("connect");
    let produce = |conn: &mut redis::aio::MultiplexedConnection, first, records| {
        rt.block_on(support::produce(
            conn,
            &streams,
            200,
            first,
            records,
            None,
            |_| {},
        ))
        .expect("produce")
    };
    produce(&mut conn, 0, 6_000);
    let store_rt = support::runtime();
    let events: Arc<Mutex<Vec<Event>>> = Arc::default();
    let nodes: Vec<Consumer> = ["a", "b"]
        .iter()
        .map(|name| {
            let ev = events.clone();
            node(&url, streams.clone(), name)
                .dead_letters(Some(support::DEAD.into()))
                .join_delay(Duration::from_millis(300))
                .decode(support::decode)
                .handler(support::handler(support::Store::connect(&store_rt, &url)))
                .verdict(support::verdict)
                .on_event(move |e| ev.lock().unwrap().push(e.clone()))
                .start()
                .expect("starts")
        })
        .collect();
    let settled = |conn: &mut redis::aio::MultiplexedConnection| {
        rt.block_on(support::settled(conn)).expect("settled").0
    };
    wait_for("a quarter applied", Duration::from_secs(60), || {
        settled(&mut conn) >= 1_500
    });

    // Redis stops answering for twice the lease.
    let pid = server.pid() as libc::pid_t;
    // SAFETY: kill(2) on the server this test started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    std::thread::sleep(Duration::from_secs(3));
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    // The client's own connection may have timed out meanwhile.
    let mut conn = rt
        .block_on(client.get_multiplexed_async_connection())
        .expect("reconnect");
    wait_for("half applied", Duration::from_secs(60), || {
        settled(&mut conn) >= 3_000
    });
    // Every connection of the nodes dropped at once.
    rt.block_on(
        redis::cmd("CLIENT")
            .arg("KILL")
            .arg("TYPE")
            .arg("normal")
            .arg("SKIPME")
            .arg("yes")
            .query_async::<u64>(&mut conn),
    )
    .expect("CLIENT KILL");
    produce(&mut conn, 6_000, 4_000);
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let done = settled(&mut conn);
        let (pending, by) = rt
            .block_on(support::pending(&mut conn, &streams))
            .expect("pending");
        if done >= 10_000 && pending == 0 {
            break;
        }
        if Instant::now() > deadline {
            for e in events.lock().unwrap().iter() {
                if !matches!(e, Event::Trouble { .. }) {
                    println!("  {e}");
                }
            }
            for n in &nodes {
                println!("  {}: owns {:?}, {:?}", n.name(), n.owned(), n.stats());
            }
            panic!("stuck: {done} of 10000 settled, {pending} pending {by:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let retries: u64 = nodes.iter().map(|n| n.stats().retries).sum();
    let dead_lettered: u64 = nodes.iter().map(|n| n.stats().dead_lettered).sum();
    for n in nodes {
        n.leave(Duration::from_secs(20)).expect("leaves");
    }
    let v = rt
        .block_on(support::verify(&mut conn, &streams))
        .expect("verify");
    let fences = events
        .lock()
        .unwrap()
        .iter()
        .filter(|e| matches!(e, Event::Fenced { .. }))
        .count();
    println!(
        "{} applied, {} refused, {} duplicates, {} dead letters, {fences} partitions fenced, \
         {retries} Redis calls retried",
        v.applied,
        v.refused,
        v.duplicates,
        v.dead_letters.len()
    );
    assert_eq!(v.produced, 10_000);
    assert!(v.problems().is_empty(), "{:#?}", v.problems());
    assert!(retries > 0, "the nodes saw Redis go away");
    // A write whose reply was lost in the outage is in the stream but not
    // counted (its retry finds it done): the counts never exceed it.
    assert!(
        dead_lettered <= v.dead_letters.len() as u64 && dead_lettered > 0,
        "the nodes counted {dead_lettered} dead letters, the stream holds {}",
        v.dead_letters.len()
    );
    assert!(
        fences > 0,
        "a 3 s pause outlasts a 1.5 s lease: the nodes fenced"
    );
    let mut count: BTreeMap<String, usize> = BTreeMap::new();
    for d in &v.dead_letters {
        *count.entry(d.clone()).or_default() += 1;
    }
    assert!(count.values().all(|&n| n == 1), "each dead letter once");
}
