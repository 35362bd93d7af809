//! The producer writes each record to its key's partition, in order, and
//! a consumer reads them back per key in that order. Needs `redis-server`
//! (skips with a printed reason without it, unless `KEYED_REQUIRE_REDIS=1`).

mod support;

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keyed_executor::handler;
use keyed_executor_redis::{partition_of, Consumer, DecodeError, Entry, Producer, Streams};

#[test]
fn records_land_in_their_keys_partition_and_are_consumed_in_order_per_key() {
    let Some(server) = support::redis_or_skip("producer") else {
        return;
    };
    let url = server.url();
    let streams = Streams::numbered("orders:", 4);
    let rt = support::runtime();
    let mut producer = rt
        .block_on(Producer::connect(&url, streams.clone()))
        .expect("connect");
    let keys: Vec<String> = (0..20).map(|i| format!("order-{i}")).collect();
    let mut sent: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for n in 0..10u64 {
        for key in &keys {
            let id = rt
                .block_on(producer.send(key, &[("key", key.as_str()), ("n", &n.to_string())]))
                .expect("XADD");
            sent.entry(key.clone()).or_default().push(id);
        }
    }
    // One more of each through a pipeline of the same commands.
    let mut pipe = redis::pipe();
    for key in &keys {
        pipe.add_command(producer.xadd(key, &[("key", key.as_str()), ("n", "10")]));
    }
    let mut conn = rt
        .block_on(
            redis::Client::open(url.as_str())
                .expect("url")
                .get_multiplexed_async_connection(),
        )
        .expect("connect");
    let ids: Vec<String> = rt.block_on(pipe.query_async(&mut conn)).expect("pipeline");
    for (key, id) in keys.iter().zip(ids) {
        sent.get_mut(key).expect("sent").push(id);
    }
    // Every entry is in the stream partition_of(key) names.
    for (key, ids) in &sent {
        let stream = streams.stream(partition_of(key, 4));
        assert_eq!(stream, producer.stream_of(key));
        for id in ids {
            let found: Vec<redis::Value> = rt
                .block_on(
                    redis::cmd("XRANGE")
                        .arg(stream)
                        .arg(id)
                        .arg(id)
                        .query_async(&mut conn),
                )
                .expect("XRANGE");
            assert_eq!(found.len(), 1, "{key}'s entry {id} is in {stream}");
        }
    }

    // A consumer sees each key's records in the order they were sent.
    let seen: Arc<Mutex<BTreeMap<String, Vec<u64>>>> = Arc::default();
    let s = seen.clone();
    let node = Consumer::builder(&url, streams)
        .group("g")
        .name("a")
        .workers(2)
        .decode(|e: &Entry| -> Result<(String, u64), DecodeError> {
            Ok((e.text("key")?.to_string(), e.parse("n")?))
        })
        .handler(handler::from_fn(move |key: &String, n: u64| {
            s.lock().unwrap().entry(key.clone()).or_default().push(n);
        }))
        .start()
        .expect("starts");
    let deadline = Instant::now() + Duration::from_secs(30);
    while node.stats().acked < 220 {
        assert!(
            Instant::now() < deadline,
            "not all 220 acked: {:?}",
            node.stats()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    node.leave(Duration::from_secs(10)).expect("leaves");
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 20);
    for (key, ns) in seen.iter() {
        assert_eq!(ns, &(0..=10).collect::<Vec<_>>(), "{key}");
    }
}
