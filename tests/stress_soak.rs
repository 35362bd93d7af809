//! Soak: many messages over many keys with a Zipf-like skew and random async
//! waits, through a succession of executors that are force-stopped (or
//! stopped gracefully) at random points and replaced, checking the same
//! invariants as the model tests with compact per-message accounting.
//!
//! Default size is small (CI, debug build). `KEYED_SOAK=1` runs the big one:
//! 10 million messages over 100,000 keys (`--release` recommended);
//! `KEYED_SOAK_MESSAGES` / `KEYED_SOAK_KEYS` set other sizes, `KEYED_SEED`
//! the schedule.

mod common;

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering::*};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use common::*;
use keyed_executor::{handler, KeyedExecutor, SubmitError, TaskError};

const ACCEPTED: u8 = 1;
const REFUSED: u8 = 2;
const DONE: u8 = 4;
const PANICKED: u8 = 8;
const REJECTED: u8 = 16;
const CANCELLED: u8 = 32;
const ENDS: u8 = DONE | PANICKED | REJECTED | CANCELLED;
const PRODUCERS: u64 = 2;
const LONG: Duration = Duration::from_secs(120);

struct Book {
    fates: Vec<AtomicU8>,
    /// Per (key, producer): the last sequence number that started.
    last: Vec<AtomicU64>,
    violations: AtomicUsize,
    first_violation: Mutex<Option<String>>,
}

impl Book {
    fn mark(&self, id: u64, bit: u8) {
        let prev = self.fates[id as usize].fetch_or(bit, SeqCst);
        let dup = prev & bit != 0 || (bit & ENDS != 0 && prev & ENDS != 0);
        if dup {
            self.violate(format!("message {id}: fate {bit:#x} on top of {prev:#x}"));
        }
    }

    fn violate(&self, what: String) {
        if self.violations.fetch_add(1, SeqCst) == 0 {
            *self.first_violation.lock().unwrap() = Some(what);
        }
    }
}

struct Msg {
    id: u64,
    key: u64,
    stream: u64,
    seq: u64,
    /// 0: instant, 1: waits, 2: panics.
    kind: u8,
    _live: Token,
}

/// Random async waits: futures park here; a timer thread releases them in
/// batches.
#[derive(Default)]
struct Waits(Mutex<Vec<(Waker, Arc<AtomicBool>)>>);

struct Wait {
    waits: Arc<Waits>,
    flag: Option<Arc<AtomicBool>>,
}

impl Future for Wait {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        match &self.flag {
            Some(f) if f.load(SeqCst) => Poll::Ready(()),
            Some(_) => Poll::Pending, // spurious poll
            None => {
                let f = Arc::new(AtomicBool::new(false));
                self.waits
                    .0
                    .lock()
                    .unwrap()
                    .push((cx.waker().clone(), f.clone()));
                self.flag = Some(f);
                Poll::Pending
            }
        }
    }
}

/// Marks the message cancelled if its future is dropped before it ended.
struct Guard<'a> {
    book: &'a Book,
    id: u64,
    ended: bool,
}

impl Drop for Guard<'_> {
    fn drop(&mut self) {
        if !self.ended && !std::thread::panicking() {
            self.book.mark(self.id, CANCELLED);
        }
    }
}

#[derive(Default)]
struct Figures {
    cycles: u64,
    forced: u64,
    graceful: u64,
    accepted: u64,
    refused: u64,
    done: u64,
    panicked: u64,
    rejected: u64,
    cancelled: u64,
    waits: u64,
}

#[test]
fn soak_zipf_keys_async_waits_force_stops_and_restarts() {
    quiet_injected_panics();
    let big = std::env::var("KEYED_SOAK").is_ok_and(|v| v != "0");
    let total = env_u64(
        "KEYED_SOAK_MESSAGES",
        if big { 10_000_000 } else { 400_000 },
    );
    let keys = env_u64("KEYED_SOAK_KEYS", if big { 100_000 } else { 10_000 });
    let seed = seeds(1)[0];
    let _replay = Replay::new("soak_zipf_keys_async_waits_force_stops_and_restarts", seed);
    let mut rng = Rng::new(seed);
    let started = Instant::now();
    let book = Arc::new(Book {
        fates: (0..total).map(|_| AtomicU8::new(0)).collect(),
        last: (0..keys * PRODUCERS).map(|_| AtomicU64::new(0)).collect(),
        violations: AtomicUsize::new(0),
        first_violation: Mutex::new(None),
    });
    let live = Live::new();
    let mut fig = Figures::default();
    let mut next_id = 0u64;
    let mut seqs = vec![1u64; PRODUCERS as usize];

    while next_id < total {
        // One executor's life: a slice of the messages, then a stop.
        let slice = (total / 8).max(1000).min(total - next_id);
        let cycle_end = next_id + slice;
        let issued = Arc::new(AtomicU64::new(next_id));
        let ids = next_id..cycle_end;
        let prefix = unique_prefix("rsoak");
        let executor = KeyedExecutor::builder()
            .workers(2)
            .throughput(*[1, 4, 16, 64].get(rng.below(4) as usize).unwrap())
            .thread_name(prefix.clone())
            .build()
            .unwrap();
        let waits = Arc::new(Waits::default());
        let (b1, b2, b3, w1) = (book.clone(), book.clone(), book.clone(), waits.clone());
        let d = executor
            .dispatcher_builder(handler::from_async_fn(move |key: u64, m: Msg| {
                let (book, waits) = (b1.clone(), w1.clone());
                async move {
                    let slot = &book.last[(m.key * PRODUCERS + m.stream) as usize];
                    let prev = slot.swap(m.seq, Relaxed);
                    if prev >= m.seq || key != m.key {
                        book.violate(format!("key {key}: seq {} after {prev}", m.seq));
                    }
                    let mut guard = Guard {
                        book: &book,
                        id: m.id,
                        ended: false,
                    };
                    match m.kind {
                        1 => Wait { waits, flag: None }.await,
                        2 => {
                            guard.ended = true;
                            panic!("{INJECTED} #{}", m.id);
                        }
                        _ => {}
                    }
                    guard.ended = true;
                    book.mark(m.id, DONE);
                    m.id
                }
            }))
            .on_reject(move |_k, m: Msg| b2.mark(m.id, REJECTED))
            .on_panic(
                move |_k, p| match p.message().rsplit('#').next().map(str::parse) {
                    Some(Ok(id)) => b3.mark(id, PANICKED),
                    _ => b3.violate(format!("foreign panic {p}")),
                },
            )
            .build();
        let r = d.receiver(256).unwrap();
        let quit = Arc::new(AtomicBool::new(false));
        let timer = {
            let (waits, quit) = (waits.clone(), quit.clone());
            let mut rng = rng.fork();
            std::thread::spawn(move || loop {
                let last = quit.load(SeqCst);
                let batch = std::mem::take(&mut *waits.0.lock().unwrap());
                for (w, f) in batch {
                    f.store(true, SeqCst);
                    w.wake();
                }
                if last {
                    break;
                }
                std::thread::sleep(Duration::from_micros(rng.range(20, 300)));
            })
        };
        let stop_at = ids.start + rng.below(slice);
        let force = rng.percent(75);
        let accepted_here = Arc::new(AtomicU64::new(0));
        let producers: Vec<_> = (0..PRODUCERS)
            .map(|p| {
                let (r, book, live, accepted_here, issued) = (
                    r.clone(),
                    book.clone(),
                    live.clone(),
                    accepted_here.clone(),
                    issued.clone(),
                );
                let mut rng = rng.fork();
                let mut seq = seqs[p as usize];
                std::thread::spawn(move || {
                    let mut handles = Vec::new();
                    let mut stats = (0u64, 0u64); // waits, closed
                    while stats.1 == 0 {
                        let id = issued.fetch_add(1, Relaxed);
                        if id >= cycle_end {
                            break;
                        }
                        let key = rng.zipf(keys);
                        let kind = match rng.below(1000) {
                            0..=29 => 1,
                            30..=34 => 2,
                            _ => 0,
                        };
                        stats.0 += u64::from(kind == 1);
                        let m = Msg {
                            id,
                            key,
                            stream: p,
                            seq,
                            kind,
                            _live: live.token(),
                        };
                        seq += 1;
                        let res = if rng.percent(85) {
                            r.send(key, m).map(|_| None)
                        } else {
                            r.submit_blocking(key, m).map(Some)
                        };
                        match res {
                            Ok(h) => {
                                book.mark(id, ACCEPTED);
                                accepted_here.fetch_add(1, Relaxed);
                                handles.extend(h.map(|h| (id, h)));
                            }
                            Err(SubmitError::Closed(m)) | Err(SubmitError::Full(m)) => {
                                if m.id != id {
                                    book.violate(format!("{id}: handed back {}", m.id));
                                }
                                book.mark(id, REFUSED);
                                stats.1 += 1;
                            }
                        }
                    }
                    (handles, seq, stats)
                })
            })
            .collect();
        while accepted_here.load(Relaxed) < stop_at - ids.start
            && !producers.iter().all(|p| p.is_finished())
        {
            std::thread::sleep(Duration::from_micros(200));
        }
        if force {
            executor.shutdown_now();
            fig.forced += 1;
        } else {
            assert!(executor.shutdown(LONG), "graceful stop did not finish");
            fig.graceful += 1;
        }
        for (p, h) in producers.into_iter().enumerate() {
            let (handles, seq, stats) = h.join().unwrap();
            seqs[p] = seq;
            fig.waits += stats.0;
            for (id, h) in handles {
                match h.wait_timeout(LONG).expect("a completion never resolved") {
                    Ok(out) => assert_eq!(out, id),
                    Err(TaskError::Panicked(_)) => book.mark(id, PANICKED),
                    Err(TaskError::Rejected(m)) => {
                        assert_eq!(m.id, id);
                        book.mark(id, REJECTED);
                    }
                    Err(TaskError::Cancelled) => {} // its guard marked it
                    Err(e) => panic!("no retrying handler here: {e}"),
                }
            }
        }
        // The ids this life issued; the next life starts after them.
        let ids = ids.start..issued.load(SeqCst).min(cycle_end);
        next_id = ids.end;
        quit.store(true, SeqCst);
        timer.join().unwrap();
        assert!(executor.is_terminated());
        assert_eq!(d.live_mailboxes(), 0);
        assert_eq!(r.in_flight(), 0, "credit held after the stop");
        let stats = executor.stats();
        drop((r, d, executor));
        eventually("workers gone", || threads_named(&prefix) == 0);
        assert_eq!(live.count(), 0, "a message outlived its executor");

        // Every message of this life: refused, or accepted and ended once.
        let mut here = [0u64; 6];
        for id in ids {
            let f = book.fates[id as usize].load(SeqCst);
            let ends = (f & ENDS).count_ones();
            let ok = match f & (ACCEPTED | REFUSED) {
                REFUSED => ends == 0,
                ACCEPTED => ends == 1,
                _ => false,
            };
            assert!(ok, "message {id}: fate {f:#x}");
            if !force {
                assert!(
                    f & (REJECTED | CANCELLED) == 0,
                    "graceful stop dropped {id}"
                );
            }
            for (i, bit) in [ACCEPTED, REFUSED, DONE, PANICKED, REJECTED, CANCELLED]
                .into_iter()
                .enumerate()
            {
                here[i] += u64::from(f & bit != 0);
            }
        }
        assert_eq!(stats.done, here[2]);
        assert_eq!(stats.panicked, here[3]);
        assert_eq!(stats.rejected, here[4]);
        assert_eq!(stats.cancelled, here[5]);
        fig.cycles += 1;
        fig.accepted += here[0];
        fig.refused += here[1];
        fig.done += here[2];
        fig.panicked += here[3];
        fig.rejected += here[4];
        fig.cancelled += here[5];
    }
    let violations = book.violations.load(SeqCst);
    assert_eq!(
        violations,
        0,
        "first: {:?}",
        book.first_violation.lock().unwrap()
    );
    eprintln!(
        "soak: {total} messages over {keys} keys (Zipf-like), {} executors ({} force-stopped, \
         {} graceful) then replaced; {} accepted, {} refused and handed back; {} done, \
         {} panicked (injected), {} rejected, {} cancelled; {} async waits; values leaked: 0; \
         {:.1?}",
        fig.cycles,
        fig.forced,
        fig.graceful,
        fig.accepted,
        fig.refused,
        fig.done,
        fig.panicked,
        fig.rejected,
        fig.cancelled,
        fig.waits,
        started.elapsed()
    );
}
