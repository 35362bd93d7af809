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
        let prefix = unique_prefix("rst");
        let executor = KeyedExecutor::builder()
            .workers(3)
            .thread_name(prefix.clone())
            .build()
            .unwrap();
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
