//! Batched submission through the public API: `send_batch`,
//! `try_send_batch` and `send_batch_async` keep per-key order (within the
//! batch and relative to single sends), give each message a position, take
//! what the credit allows and hand back the rest in order, refuse whole when
//! closed, never wait in a handler, and give the credit back when a key's
//! `Hash` panics.

mod common;

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use common::{eventually, Gate};
use keyed_executor::{handler, KeyedExecutor, WeakReceiver};

const LONG: Duration = Duration::from_secs(30);

/// `(key, id)` in the order the handler ran them.
type Log = Arc<Mutex<Vec<(u64, u32)>>>;

fn per_key(log: &Log) -> HashMap<u64, Vec<u32>> {
    let mut m: HashMap<u64, Vec<u32>> = HashMap::new();
    for &(k, id) in log.lock().unwrap().iter() {
        m.entry(k).or_default().push(id);
    }
    m
}

fn logging(ex: &KeyedExecutor, log: &Log) -> keyed_executor::Dispatcher<u64, u32, ()> {
    let log = log.clone();
    ex.dispatcher(handler::from_fn(move |&k: &u64, id: u32| {
        log.lock().unwrap().push((k, id));
    }))
}

#[test]
fn a_batch_larger_than_the_credit_goes_through_in_order_with_its_positions() {
    let ex = KeyedExecutor::builder().workers(2).build().unwrap();
    let log: Log = Arc::default();
    let d = logging(&ex, &log);
    let r = d
        .receiver_builder()
        .max_in_flight(8)
        .track_commits(true)
        .build()
        .unwrap();
    let mut next_id = 0u32;
    let mut expected: HashMap<u64, Vec<u32>> = HashMap::new();
    let mut batch = |n: u32| -> Vec<(u64, u32)> {
        (0..n)
            .map(|i| {
                let key = u64::from(i % 13);
                next_id += 1;
                expected.entry(key).or_default().push(next_id);
                (key, next_id)
            })
            .collect()
    };
    let positions = r.send_batch(batch(500)).unwrap();
    assert_eq!(positions.len(), 500);
    // One producer: its chunks' positions follow each other.
    assert_eq!(
        positions.iter().collect::<Vec<_>>(),
        (0..500).collect::<Vec<_>>()
    );
    // Single sends and batches interleaved keep each key's order.
    let mut position = 500;
    for _ in 0..20 {
        for (k, id) in batch(7) {
            assert_eq!(r.send(k, id).unwrap(), position);
            position += 1;
        }
        let p = r.send_batch(batch(20)).unwrap();
        assert_eq!(
            p.iter().collect::<Vec<_>>(),
            (position..position + 20).collect::<Vec<_>>()
        );
        position += 20;
    }
    let total = next_id as usize;
    eventually("all ran", || log.lock().unwrap().len() == total);
    assert_eq!(per_key(&log), expected);
    assert!(r.shutdown(LONG));
    assert_eq!(r.accepted(), total as u64);
    assert_eq!(r.committable(), Some(total as u64));
    assert!(ex.shutdown(LONG));
}

#[test]
fn try_send_batch_takes_what_the_credit_allows_and_hands_back_the_rest_in_order() {
    let ex = KeyedExecutor::builder().workers(1).build().unwrap();
    let gate = Gate::new();
    let ran = Arc::new(AtomicUsize::new(0));
    let d = ex.dispatcher(handler::from_fn({
        let (gate, ran) = (gate.clone(), ran.clone());
        move |_: &u64, _: u32| {
            gate.wait();
            ran.fetch_add(1, SeqCst);
        }
    }));
    let r = d.receiver(4).unwrap();
    let batch: Vec<(u64, u32)> = (0..10).map(|i| (u64::from(i % 3), i)).collect();
    let err = r.try_send_batch(batch).unwrap_err();
    assert!(err.is_full() && !err.is_closed());
    assert_eq!(err.sent().iter().collect::<Vec<_>>(), vec![0, 1, 2, 3]);
    assert_eq!(err.sent().ranges().len(), 1, "one chunk");
    let rest = err.into_rest();
    assert_eq!(
        rest,
        (4..10).map(|i| (u64::from(i % 3), i)).collect::<Vec<_>>(),
        "the rest comes back whole, in order"
    );
    assert_eq!(r.in_flight(), 4);
    // Nothing free: nothing taken.
    let err = r.try_send_batch(rest).unwrap_err();
    assert!(err.sent().is_empty());
    assert_eq!(err.rest().len(), 6);
    // An empty batch is fine.
    assert!(r.try_send_batch(Vec::new()).unwrap().is_empty());
    gate.open();
    let positions = r.send_batch(err.into_rest()).unwrap();
    assert_eq!(
        positions.iter().collect::<Vec<_>>(),
        (4..10).collect::<Vec<_>>()
    );
    eventually("all ran", || ran.load(SeqCst) == 10);
    assert!(ex.shutdown(LONG));
}

#[test]
fn a_closed_receiver_refuses_a_batch_whole_and_a_stopped_executor_too() {
    let ex = KeyedExecutor::builder().workers(1).build().unwrap();
    let log: Log = Arc::default();
    let d = logging(&ex, &log);
    let (a, b) = (d.receiver(16).unwrap(), d.receiver(16).unwrap());
    a.close();
    let batch: Vec<(u64, u32)> = (0..5).map(|i| (1, i)).collect();
    for err in [
        a.send_batch(batch.clone()).unwrap_err(),
        a.try_send_batch(batch.clone()).unwrap_err(),
        futures::executor::block_on(a.send_batch_async(batch.clone())).unwrap_err(),
    ] {
        assert!(err.is_closed());
        assert!(err.sent().is_empty());
        assert_eq!(err.rest(), batch.as_slice());
        assert!(err.to_string().contains("closed"), "{err}");
    }
    assert_eq!(a.accepted(), 0, "refused messages take no position");
    assert_eq!(b.send_batch(batch.clone()).unwrap().len(), 5);
    assert!(ex.shutdown(LONG));
    let err = b.send_batch(batch.clone()).unwrap_err();
    assert!(err.is_closed() && err.rest() == batch.as_slice());
    assert_eq!(per_key(&log)[&1], vec![0, 1, 2, 3, 4]);
}

#[test]
fn send_batch_async_waits_for_credit_without_a_thread() {
    let ex = KeyedExecutor::builder().workers(2).build().unwrap();
    let log: Log = Arc::default();
    let d = logging(&ex, &log);
    let r = d.receiver(3).unwrap();
    let batch: Vec<(u64, u32)> = (0..300).map(|i| (u64::from(i % 7), i)).collect();
    let positions = futures::executor::block_on(r.send_batch_async(batch)).unwrap();
    assert_eq!(positions.len(), 300);
    // One producer: the chunks' positions follow each other (merged).
    assert_eq!(positions.ranges().len(), 1, "consecutive: one range");
    eventually("all ran", || log.lock().unwrap().len() == 300);
    for (k, ids) in per_key(&log) {
        let want: Vec<u32> = (0..300).filter(|i| u64::from(i % 7) == k).collect();
        assert_eq!(ids, want, "key {k}");
    }
    assert!(ex.shutdown(LONG));
}

#[test]
fn from_a_handler_a_batch_never_waits_and_hands_back_what_it_cannot_take() {
    let ex = KeyedExecutor::builder().workers(2).build().unwrap();
    /// How many follow-ups went, and those handed back.
    type Outcome = Option<(usize, Vec<(u64, u32)>)>;
    let outcome: Arc<Mutex<Outcome>> = Arc::default();
    let log: Log = Arc::default();
    let me: Arc<OnceLock<WeakReceiver<u64, u32, ()>>> = Arc::default();
    let d = ex.dispatcher(handler::from_fn({
        let (outcome, log, me) = (outcome.clone(), log.clone(), me.clone());
        move |&k: &u64, id: u32| {
            log.lock().unwrap().push((k, id));
            if id == 0 {
                let rx = me.get().unwrap().upgrade().unwrap();
                // Credit 1, held by this very message: the first follow-up
                // shares its unit, the others are handed back.
                let res = match rx.send_batch((1..=3).map(|i| (10 + u64::from(i), i))) {
                    Ok(p) => (p.len(), Vec::new()),
                    Err(e) => {
                        assert!(e.is_full());
                        let n = e.sent().len();
                        (n, e.into_rest())
                    }
                };
                *outcome.lock().unwrap() = Some(res);
            }
        }
    }));
    let r = d.receiver(1).unwrap();
    me.set(r.downgrade()).ok().unwrap();
    r.send(0, 0).unwrap();
    eventually("the handler sent", || outcome.lock().unwrap().is_some());
    let (sent, rest) = outcome.lock().unwrap().take().unwrap();
    assert!(sent >= 1, "one follow-up always goes through");
    assert_eq!(sent + rest.len(), 3);
    let want: Vec<(u64, u32)> = (1..=3).map(|i| (10 + u64::from(i), i)).skip(sent).collect();
    assert_eq!(rest, want, "handed back in order");
    eventually("the follow-ups ran", || {
        log.lock().unwrap().len() == 1 + sent
    });
    assert!(ex.shutdown(LONG));
    assert_eq!(r.in_flight(), 0);
}

/// A key whose `Hash` panics for one value.
#[derive(Clone, PartialEq, Eq)]
struct Touchy(u64);

impl Hash for Touchy {
    fn hash<H: Hasher>(&self, h: &mut H) {
        assert!(self.0 != 13, "key 13 cannot be hashed");
        self.0.hash(h);
    }
}

#[test]
fn a_key_whose_hash_panics_fails_the_batch_call_and_gives_the_credit_back() {
    let ex = KeyedExecutor::builder().workers(1).build().unwrap();
    let ran = Arc::new(AtomicUsize::new(0));
    let d = ex.dispatcher(handler::from_fn({
        let ran = ran.clone();
        move |_: &Touchy, _: u32| {
            ran.fetch_add(1, SeqCst);
        }
    }));
    let r = d.receiver(8).unwrap();
    let batch: Vec<(Touchy, u32)> = (10..16).map(|k| (Touchy(k), k as u32)).collect();
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| r.send_batch(batch)));
    assert!(panicked.is_err(), "the panic reaches the caller");
    assert_eq!(r.in_flight(), 0, "the credit came back");
    assert_eq!(r.accepted(), 0, "nothing of the chunk was accepted");
    let ok: Vec<(Touchy, u32)> = (20..25).map(|k| (Touchy(k), k as u32)).collect();
    assert_eq!(r.send_batch(ok).unwrap().len(), 5);
    eventually("the good batch ran", || ran.load(SeqCst) == 5);
    assert!(ex.shutdown(LONG));
}

/// Randomized: producers send batches of random sizes (and single sends)
/// to their own receivers over shared keys while a stop comes at a random
/// point — a receiver's `shutdown_now`, the dispatcher's, or the
/// executor's. Every message ends exactly once (ran, handed back through
/// `on_reject`, or refused in a `BatchError` / `SubmitError`), and per
/// producer and key the messages that ran did so in order, with no
/// message running after one of its own key and producer was handed back.
#[test]
fn batches_racing_stops_lose_nothing_and_keep_order() {
    use common::{seeds, Replay, Rng};
    const PRODUCERS: usize = 3;
    for seed in seeds(40) {
        let _replay = Replay::new("batches_racing_stops_lose_nothing_and_keep_order", seed);
        let mut rng = Rng::new(seed);
        let ex = KeyedExecutor::builder()
            .workers(1 + rng.below(2) as usize)
            .build()
            .unwrap();
        // (producer, key, seq) per id; what ran and what was handed back.
        let ran: Log = Arc::default();
        let hooked: Log = Arc::default();
        let d = ex
            .dispatcher_builder(handler::from_fn({
                let ran = ran.clone();
                move |&k: &u64, id: u32| ran.lock().unwrap().push((k, id))
            }))
            .on_reject({
                let hooked = hooked.clone();
                move |k, id: u32| hooked.lock().unwrap().push((k, id))
            })
            .build();
        let rxs: Vec<_> = (0..PRODUCERS)
            .map(|_| d.receiver(1 + rng.below(16) as usize).unwrap())
            .collect();
        let plans: Vec<(Rng, u32)> = (0..PRODUCERS)
            .map(|_| (rng.fork(), 100 + rng.below(400) as u32))
            .collect();
        let total: u32 = plans.iter().map(|(_, n)| n).sum();
        let stop_after = rng.below(600) as usize;
        let how = rng.below(3);
        let refused: Vec<(u64, u32)> = std::thread::scope(|s| {
            let producers: Vec<_> = plans
                .into_iter()
                .zip(&rxs)
                .enumerate()
                .map(|(p, ((mut rng, n), rx))| {
                    s.spawn(move || {
                        let mut refused = Vec::new();
                        let mut next = 0;
                        while next < n {
                            let size = (1 + rng.below(40) as u32).min(n - next);
                            let ids: Vec<(u64, u32)> = (next..next + size)
                                .map(|i| (rng.below(6), (p as u32) << 20 | i))
                                .collect();
                            next += size;
                            let res = match rng.below(3) {
                                0 => rx.send_batch(ids),
                                1 => futures::executor::block_on(rx.send_batch_async(ids)),
                                _ => {
                                    // Single sends between the batches.
                                    for (k, id) in ids {
                                        if let Err(e) = rx.send(k, id) {
                                            refused.push((k, e.into_inner()));
                                        }
                                    }
                                    Ok(Default::default())
                                }
                            };
                            if let Err(e) = res {
                                assert!(e.is_closed(), "blocking forms stop only when closed");
                                refused.extend(e.into_rest());
                            }
                        }
                        refused
                    })
                })
                .collect();
            while ran.lock().unwrap().len() < stop_after
                && producers.iter().any(|p| !p.is_finished())
            {
                std::thread::yield_now();
            }
            match how {
                0 => rxs.iter().for_each(|r| r.shutdown_now()),
                1 => d.shutdown_now(),
                _ => ex.shutdown_now(),
            }
            producers
                .into_iter()
                .flat_map(|p| p.join().unwrap())
                .collect()
        });
        ex.shutdown_now();
        let ran = ran.lock().unwrap().clone();
        let hooked = hooked.lock().unwrap().clone();
        let mut seen = std::collections::HashSet::new();
        for &(_, id) in ran.iter().chain(&hooked).chain(&refused) {
            assert!(seen.insert(id), "message {id:#x} ended twice");
        }
        // (A submission that raced the stop may have taken a position
        // before it was refused.)
        let positions: usize = rxs.iter().map(|r| r.accepted() as usize).sum();
        assert!(ran.len() + hooked.len() <= positions);
        assert_eq!(seen.len() as u32, total, "every message ended");
        for r in &rxs {
            assert_eq!(r.in_flight(), 0);
        }
        // Per producer (the id's high bits) and key, what ran ran in id
        // order; nothing ran after a message of its producer and key that
        // was handed back, nor after one of its producer refused (a stop is
        // for good).
        let producer = |id: u32| id >> 20;
        let mut last: HashMap<(u32, u64), u32> = HashMap::new();
        for &(k, id) in &ran {
            if let Some(prev) = last.insert((producer(id), k), id) {
                assert!(prev < id, "key {k}: {id:#x} ran after {prev:#x}");
            }
        }
        for &(k, id) in &hooked {
            if let Some(&ran_last) = last.get(&(producer(id), k)) {
                assert!(
                    ran_last < id,
                    "key {k}: {ran_last:#x} ran after {id:#x} was handed back"
                );
            }
        }
        for &(_, id) in &refused {
            for (&(p, _), &ran_last) in &last {
                if p == producer(id) {
                    assert!(ran_last < id, "{ran_last:#x} ran after {id:#x} was refused");
                }
            }
        }
    }
}
