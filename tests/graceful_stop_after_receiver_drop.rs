//! A graceful stop waits for the messages of a receiver that was dropped
//! while they were in flight: the release that gives back the last unit
//! also frees the receiver's credit, and must wake the parked workers so
//! they see that everything drained (asleep, they would leave `shutdown`
//! to time out).

use std::time::Duration;

use keyed_executor::{handler, KeyedExecutor};

#[test]
fn shutdown_drains_a_dropped_receivers_messages() {
    for round in 0..20 {
        let executor = KeyedExecutor::builder().workers(2).build().unwrap();
        let dispatcher = executor.dispatcher(handler::from_fn(|k: &u64, m: u64| {
            std::hint::black_box(k.wrapping_mul(m));
        }));
        let receiver = dispatcher.receiver(4096).unwrap();
        for i in 0..50_000u64 {
            receiver.send(i % 1_000, i).unwrap();
        }
        drop(receiver);
        assert!(
            executor.shutdown(Duration::from_secs(10)),
            "round {round}: the stop did not drain"
        );
        assert_eq!(executor.stats().done, 50_000);
    }
}
