//! Overload: producers far faster than the handlers. Memory stays bounded by
//! the credit, and a full receiver refuses at once, handing the message back.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use keyed_executor::{handler, SubmitError};

const LONG: Duration = Duration::from_secs(60);

struct Msg(u64, #[allow(dead_code)] Token);

#[test]
fn a_producer_far_faster_than_the_handlers_is_held_to_the_credit() {
    const MAX: usize = 32;
    const PRODUCERS: usize = 4;
    let per_producer = env_u64("KEYED_OVERLOAD", 5000);
    let (executor, prefix) = named_executor("rovl", 2);
    let live = Live::new();
    let outs = Live::new();
    let o2 = outs.clone();
    // Slow handlers: each message sleeps; half of them also yield once.
    let d = executor.dispatcher(handler::from_async_fn(move |_k: u64, m: Msg| {
        let out = o2.token();
        async move {
            std::thread::sleep(Duration::from_micros(20));
            if m.0 % 2 == 0 {
                YieldOnce(false).await;
            }
            drop(m);
            out
        }
    }));
    let r = d.receiver(MAX).unwrap();
    let quit = Arc::new(AtomicBool::new(false));
    let peaks = Arc::new([
        AtomicUsize::new(0),
        AtomicUsize::new(0),
        AtomicUsize::new(0),
    ]);
    let sampler = {
        let (quit, peaks, live, r, d) = (
            quit.clone(),
            peaks.clone(),
            live.clone(),
            r.clone(),
            d.clone(),
        );
        std::thread::spawn(move || {
            while !quit.load(SeqCst) {
                peaks[0].fetch_max(live.count(), SeqCst);
                peaks[1].fetch_max(r.in_flight(), SeqCst);
                peaks[2].fetch_max(d.live_mailboxes(), SeqCst);
                std::thread::sleep(Duration::from_micros(50));
            }
        })
    };
    let producers: Vec<_> = (0..PRODUCERS as u64)
        .map(|p| {
            let (r, live) = (r.clone(), live.clone());
            std::thread::spawn(move || {
                let mut rng = Rng::new(p);
                for i in 0..per_producer {
                    let key = rng.zipf(1000);
                    let m = Msg(p * 1_000_000 + i, live.token());
                    if i % 2 == 0 {
                        r.send(key, m).unwrap();
                    } else {
                        drop(r.submit_blocking(key, m).unwrap());
                    }
                }
            })
        })
        .collect();
    eventually("the receiver saturates", || peaks[1].load(SeqCst) == MAX);
    for p in producers {
        p.join().unwrap();
    }
    assert!(executor.shutdown(LONG));
    quit.store(true, SeqCst);
    sampler.join().unwrap();
    let (msgs, credit, mailboxes) = (
        peaks[0].load(SeqCst),
        peaks[1].load(SeqCst),
        peaks[2].load(SeqCst),
    );
    eprintln!(
        "overload: {} messages; peak live messages {msgs}, in flight {credit}, mailboxes \
         {mailboxes} (max_in_flight {MAX}, {PRODUCERS} producers)",
        PRODUCERS as u64 * per_producer
    );
    // Each producer holds at most the one message it is submitting.
    assert!(msgs <= MAX + PRODUCERS, "{msgs} messages alive");
    assert!(credit <= MAX);
    assert!(mailboxes <= 2 * (MAX + 2), "{mailboxes} mailboxes alive");
    assert_eq!((live.count(), outs.count(), r.in_flight()), (0, 0, 0));
    eventually("workers gone", || threads_named(&prefix) == 0);
}

#[test]
fn a_full_receiver_refuses_at_once_with_the_very_message() {
    const MAX: usize = 8;
    let (executor, prefix) = named_executor("rfull", 2);
    let live = Live::new();
    let gate = Gate::new();
    let g = gate.clone();
    let d = executor.dispatcher(handler::from_fn(move |_k: &u64, m: Msg| {
        g.wait();
        m.0
    }));
    let r = d.receiver(MAX).unwrap();
    let held: Vec<_> = (0..MAX as u64)
        .map(|i| r.try_submit(i, Msg(i, live.token())).ok().unwrap())
        .collect();
    // Far more attempts than credit: each refused at once, message handed
    // back, nothing kept.
    let mut refused = 0;
    for i in 100..10_100u64 {
        let m = Msg(i, live.token());
        let res = if i % 2 == 0 {
            r.try_submit(i, m).map(drop)
        } else {
            r.try_send(i, m).map(drop)
        };
        match res {
            Err(SubmitError::Full(m)) => {
                assert_eq!(m.0, i);
                refused += 1;
            }
            other => panic!("expected Full, got {:?}", other.map(|_| ())),
        }
        assert_eq!(live.count(), MAX, "a refused message was kept");
    }
    assert_eq!(refused, 10_000);
    assert_eq!(r.in_flight(), MAX);
    gate.open();
    for (i, h) in held.into_iter().enumerate() {
        assert_eq!(h.wait().unwrap(), i as u64);
    }
    // Retrying the refused ones now succeeds.
    let mut retried = 0;
    for i in 100..200u64 {
        let mut m = Msg(i, live.token());
        loop {
            match r.try_submit(i, m) {
                Ok(h) => {
                    assert_eq!(h.wait().unwrap(), i);
                    retried += 1;
                    break;
                }
                Err(SubmitError::Full(back)) => {
                    m = back;
                    std::thread::yield_now();
                }
                Err(SubmitError::Closed(_)) => panic!("closed"),
            }
        }
    }
    assert_eq!(retried, 100);
    assert!(executor.shutdown(LONG));
    assert_eq!(live.count(), 0);
    eventually("workers gone", || threads_named(&prefix) == 0);
}
