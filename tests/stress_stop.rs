//! Stops racing the last messages, repeated many times: every stop must
//! finish and leave no worker thread behind.

mod common;

use std::time::Duration;

use common::*;
use keyed_executor::{handler, KeyedExecutor};

/// Regression: a worker that found the pool not yet drained, and parked just
/// as another worker retired the last mailbox, was never woken again, so a
/// graceful stop never finished (found by `reliability_executor`, seed
/// 0x65e74e3c7fb2c9f0: one worker left `Parked` with no live mailbox).
#[test]
fn graceful_stop_never_strands_a_parked_worker() {
    let rounds = env_u64("KEYED_STOP_ROUNDS", 3000);
    for round in 0..rounds {
        let (executor, prefix) = named_executor("rst", 3);
        let d = executor.dispatcher(handler::from_async_fn(|_k: u32, n: u32| async move {
            if n % 2 == 0 {
                YieldOnce(false).await;
            }
            n
        }));
        let r = d.receiver(64).unwrap();
        for i in 0..(round % 7) as u32 {
            r.send(i % 5, i).unwrap();
        }
        assert!(
            executor.shutdown(Duration::from_secs(20)),
            "round {round}: graceful stop stranded: {:#?}",
            executor.stats()
        );
        eventually("worker threads gone", || {
            threads_named(&format!("{prefix}-")) == 0
        });
    }
}

/// Two force stops at once (a handler calling `shutdown_now` while other
/// threads do too): one stop may still be rejecting the messages it took
/// from a port's inbox while another has already emptied the port's map,
/// and no worker may retire and free a mailbox that a stop still reads.
/// Every message must end exactly once: ran, or handed back through
/// `on_reject`.
#[test]
fn concurrent_force_stops_hand_back_every_message_once() {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use std::sync::{Arc, Barrier, Mutex};

    let rounds = env_u64("KEYED_STOP_ROUNDS", 3000) / 10;
    for round in 0..rounds.max(20) {
        let (executor, prefix) = named_executor("rfs", 2);
        // 0 = not seen, 1 = ran, 2 = handed back; anything else: ended twice.
        let ends: Arc<Vec<AtomicUsize>> = Arc::new((0..400).map(|_| AtomicUsize::new(0)).collect());
        let stop_from_handler: Arc<Mutex<Option<KeyedExecutor>>> =
            Arc::new(Mutex::new(Some(executor.clone())));
        let (ran, back) = (ends.clone(), ends.clone());
        let inside = stop_from_handler.clone();
        let d = executor
            .dispatcher_builder(handler::from_fn(move |_k: &u32, id: usize| {
                assert_eq!(ran[id].fetch_add(1, SeqCst), 0, "message {id} ended twice");
                if id == 150 {
                    if let Some(ex) = inside.lock().unwrap().take() {
                        ex.shutdown_now();
                    }
                }
            }))
            .on_reject(move |_k: u32, id: usize| {
                assert_eq!(back[id].fetch_add(2, SeqCst), 0, "message {id} ended twice");
            })
            .build();
        let r = d.receiver(400).unwrap();
        let barrier = Arc::new(Barrier::new(3));
        let stoppers: Vec<_> = (0..2)
            .map(|_| {
                let (ex, b) = (executor.clone(), barrier.clone());
                std::thread::spawn(move || {
                    b.wait();
                    ex.shutdown_now();
                })
            })
            .collect();
        let mut accepted = Vec::new();
        for id in 0..400usize {
            if id == 100 + (round as usize % 200) {
                barrier.wait();
            }
            match r.send((id % 37) as u32, id) {
                Ok(_) => accepted.push(id),
                Err(e) => assert_eq!(e.into_inner(), id, "refused message handed back"),
            }
        }
        for s in stoppers {
            s.join().unwrap();
        }
        executor.shutdown_now();
        drop(stop_from_handler.lock().unwrap().take());
        for id in accepted {
            let end = ends[id].load(SeqCst);
            assert!(
                end == 1 || end == 2,
                "round {round}: accepted message {id} ended {end} (1 = ran, 2 = handed back)"
            );
        }
        eventually("worker threads gone", || {
            threads_named(&format!("{prefix}-")) == 0
        });
    }
}
