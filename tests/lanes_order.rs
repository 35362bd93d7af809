//! Per-key order, no overlap and nothing lost under many concurrent callers:
//! on a tokio multi-thread runtime, on plain threads, and with callers that
//! give up at random points. Sized to run in well under a second each.

mod lanes_support;

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::task::Poll;
use std::time::Duration;

use keyed_executor::lanes::Lanes;
use lanes_support::*;

const KEYS: u64 = 4;

/// Caller `c`'s `i`-th command.
fn id(caller: u64, i: u64) -> u64 {
    caller * 100_000 + i
}

fn caller_of(id: u64) -> (u64, u64) {
    (id / 100_000, id % 100_000)
}

fn key_of(caller: u64) -> u32 {
    (caller % KEYS) as u32
}

/// Everything a run must satisfy whatever the interleaving.
fn check_run(lanes: &Lanes<TestKernel>, max_batch: usize, ok: &HashSet<u64>) {
    let k = lanes.kernel();
    assert!(
        !k.overlap.load(Ordering::SeqCst),
        "two batches of one key overlapped"
    );
    let decided = k.decided();
    let mut seen = HashSet::new();
    for &(key, id) in &decided {
        assert!(seen.insert(id), "command {id} decided twice");
        assert_eq!(
            key,
            key_of(caller_of(id).0),
            "command {id} ran in another key's lane"
        );
    }
    for id in ok {
        assert!(
            seen.contains(id),
            "command {id} answered Ok but never decided"
        );
    }
    assert_caller_order(&decided, caller_of);
    for (_, batch) in k.batches() {
        assert!(!batch.is_empty() && batch.len() <= max_batch);
    }
    assert_idle(lanes);
}

#[test]
fn tokio_many_callers_keep_per_key_order() {
    let rt = tokio_runtime();
    let lanes = Arc::new(
        Lanes::builder(TestKernel::yielding())
            .max_batch(8)
            .build()
            .unwrap(),
    );
    let ok = rt.block_on(async {
        let tasks: Vec<_> = (0..12u64)
            .map(|c| {
                let l = Arc::clone(&lanes);
                tokio::spawn(async move {
                    let mut ok = Vec::new();
                    for i in 0..150 {
                        let out = l.execute(key_of(c), cmd(id(c, i))).await.unwrap();
                        assert_eq!(out, id(c, i) * 10);
                        ok.push(id(c, i));
                    }
                    ok
                })
            })
            .collect();
        let mut ok = HashSet::new();
        for t in tasks {
            ok.extend(t.await.unwrap());
        }
        ok
    });
    assert_eq!(ok.len(), 12 * 150);
    assert_eq!(lanes.kernel().decided().len(), ok.len());
    check_run(&lanes, 8, &ok);
}

#[test]
fn plain_threads_keep_per_key_order() {
    let lanes = Arc::new(
        Lanes::builder(TestKernel::yielding())
            .max_batch(4)
            .build()
            .unwrap(),
    );
    let threads: Vec<_> = (0..6u64)
        .map(|c| {
            let l = Arc::clone(&lanes);
            std::thread::spawn(move || {
                (0..150)
                    .map(|i| {
                        let out = l
                            .execute_blocking(key_of(c), cmd(id(c, i)), Duration::from_secs(60))
                            .unwrap();
                        assert_eq!(out, id(c, i) * 10);
                        id(c, i)
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut ok = HashSet::new();
    for t in threads {
        ok.extend(t.join().unwrap());
    }
    assert_eq!(lanes.kernel().decided().len(), 6 * 150);
    check_run(&lanes, 4, &ok);
}

/// Polls `fut` up to `polls` times, yielding to the runtime in between.
async fn poll_a_few<F: Future + Unpin>(fut: &mut F, polls: u64) -> Option<F::Output> {
    for _ in 0..polls {
        if let Poll::Ready(out) = futures::poll!(&mut *fut) {
            return Some(out);
        }
        tokio::task::yield_now().await;
    }
    None
}

/// A small deterministic generator for the random mix.
struct XorShift(u64);

impl XorShift {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

#[test]
fn callers_giving_up_at_random_points_lose_nothing() {
    let rt = tokio_runtime();
    let lanes = Arc::new(
        Lanes::builder(TestKernel::yielding())
            .max_batch(4)
            .lane_capacity(16)
            .build()
            .unwrap(),
    );
    let (ok, rejected, gave_up) = rt.block_on(async {
        let tasks: Vec<_> = (0..10u64)
            .map(|c| {
                let l = Arc::clone(&lanes);
                tokio::spawn(async move {
                    let mut rng = XorShift(0x9E37_79B9_7F4A_7C15 ^ (c + 1));
                    let (mut ok, mut rejected, mut gave_up) = (vec![], vec![], vec![]);
                    for i in 0..150 {
                        let this = id(c, i);
                        let which = match rng.next() % 10 {
                            0 => Op::AgainOnce,
                            1 => Op::Reject,
                            _ => Op::Ok,
                        };
                        let fut = l.execute(key_of(c), op(this, which));
                        let out = if rng.next() % 3 == 0 {
                            // Give up after a few polls: by then it may be
                            // queued, leading, or inside a batch.
                            let mut fut = fut;
                            match poll_a_few(&mut fut, rng.next() % 4).await {
                                Some(out) => out,
                                None => {
                                    drop(fut);
                                    gave_up.push(this);
                                    continue;
                                }
                            }
                        } else {
                            fut.await
                        };
                        match out {
                            Ok(v) => {
                                assert_eq!(v, this * 10);
                                ok.push(this);
                            }
                            Err(e) if e.is_kernel() => rejected.push(this),
                            Err(e) if e.is_busy() => {
                                gave_up.push(e.into_command().unwrap().id);
                            }
                            Err(e) => panic!("unexpected {e:?}"),
                        }
                    }
                    (ok, rejected, gave_up)
                })
            })
            .collect();
        let (mut ok, mut rejected, mut gave_up) = (HashSet::new(), HashSet::new(), HashSet::new());
        for t in tasks {
            let (o, r, g) = t.await.unwrap();
            ok.extend(o);
            rejected.extend(r);
            gave_up.extend(g);
        }
        (ok, rejected, gave_up)
    });
    assert_eq!(ok.len() + rejected.len() + gave_up.len(), 10 * 150);
    // A batch whose callers all gave up, with no later caller of its key,
    // is still waiting for a driver: close drives it to its end.
    assert!(lanes.close_blocking(Duration::from_secs(60)));
    // Every answered command was decided exactly once; a command whose
    // caller gave up was decided at most once (only if a batch had taken it).
    let decided: HashSet<u64> = lanes.kernel().decided_ids().into_iter().collect();
    for id in ok.iter().chain(&rejected) {
        assert!(decided.contains(id));
    }
    for id in &decided {
        assert!(ok.contains(id) || rejected.contains(id) || gave_up.contains(id));
    }
    check_run(&lanes, 4, &ok);
}

#[test]
fn commit_hook_runs_between_a_batch_and_the_next_of_its_key() {
    let journal: Journal = Arc::new(Mutex::new(Vec::new()));
    let j = Arc::clone(&journal);
    let lanes = Arc::new(
        Lanes::builder(TestKernel::with_journal(Arc::clone(&journal)))
            .max_batch(4)
            .on_commit(move |key: &u32, _outcomes: &[Result<u64, TestError>]| {
                j.lock().unwrap().push((*key, "commit"));
                Ok(())
            })
            .build()
            .unwrap(),
    );
    let rt = tokio_runtime();
    rt.block_on(async {
        let tasks: Vec<_> = (0..8u64)
            .map(|c| {
                let l = Arc::clone(&lanes);
                tokio::spawn(async move {
                    for i in 0..100 {
                        l.execute(key_of(c), cmd(id(c, i))).await.unwrap();
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
    });
    let journal = journal.lock().unwrap();
    let mut per_key: HashMap<u32, Vec<&str>> = HashMap::new();
    for &(key, what) in journal.iter() {
        per_key.entry(key).or_default().push(what);
    }
    for (key, events) in per_key {
        for chunk in events.chunks(3) {
            assert_eq!(chunk, ["start", "end", "commit"], "key {key}");
        }
    }
}
