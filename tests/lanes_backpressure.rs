//! Busy, not queues: a full lane and an exhausted in-flight limit refuse at
//! once and hand the command back; bad settings are refused by `build`.

mod lanes_support;

use std::time::Duration;

use keyed_executor::lanes::{BusyReason, LaneError, Lanes, ManualClock};
use keyed_executor::limit::{InFlightLimit, MAX_RETRY_AFTER, MIN_RETRY_AFTER};
use keyed_executor::ConfigError;
use lanes_support::*;

#[test]
fn a_full_lane_refuses_with_busy_and_hands_the_command_back() {
    let lanes = Lanes::builder(TestKernel::new())
        .lane_capacity(2)
        .build()
        .unwrap();
    let k = lanes.kernel();
    // The leader's batch is running: it no longer counts against capacity.
    let mut leader = waiting(&lanes, 1, op(1, Op::Block(1)));
    let mut w1 = Manual::new(lanes.execute(1, cmd(2)));
    let mut w2 = Manual::new(lanes.execute(1, cmd(3)));
    w1.pending();
    w2.pending();
    let mut refused = Manual::new(lanes.execute(1, cmd(4)));
    match refused.ready() {
        Err(LaneError::Busy {
            command,
            retry_after,
            reason,
        }) => {
            assert_eq!(command.id, 4);
            assert_eq!(reason, BusyReason::LaneFull);
            assert!((MIN_RETRY_AFTER..=MAX_RETRY_AFTER).contains(&retry_after));
        }
        other => panic!("expected Busy, got {other:?}"),
    }
    assert_eq!(lanes.in_flight(), 3, "the refused command is not counted");
    // Another key is not affected.
    let mut other = Manual::new(lanes.execute(2, cmd(5)));
    assert_eq!(other.ready().unwrap(), 50);

    k.open(1);
    leader.ready().unwrap();
    w1.ready().unwrap();
    w2.ready().unwrap();
    assert!(!k.saw(4));
    // Room again: accepted.
    let mut again = Manual::new(lanes.execute(1, cmd(6)));
    assert_eq!(again.ready().unwrap(), 60);
}

#[test]
fn the_node_limit_is_shared_by_every_lanes_given_a_clone() {
    let limit = InFlightLimit::new(2);
    let a = Lanes::builder(TestKernel::new())
        .limit(limit.clone())
        .build()
        .unwrap();
    let b = Lanes::builder(TestKernel::new())
        .limit(limit.clone())
        .build()
        .unwrap();
    let mut x = Manual::new(a.execute(1, op(1, Op::Block(1))));
    let mut y = Manual::new(b.execute(7, op(2, Op::Block(1))));
    x.pending();
    y.pending();
    assert_eq!(limit.in_flight(), 2);
    // Different Lanes, different key: refused by the shared limit.
    let mut z = Manual::new(b.execute(8, cmd(3)));
    let e = z.ready().unwrap_err();
    assert!(e.is_busy());
    assert!(matches!(
        e,
        LaneError::Busy {
            reason: BusyReason::InFlightLimit,
            ..
        }
    ));
    assert_eq!(e.into_command().unwrap().id, 3);
    a.kernel().open(1);
    b.kernel().open(1);
    x.ready().unwrap();
    y.ready().unwrap();
    assert_eq!(limit.in_flight(), 0);
    let mut z = Manual::new(b.execute(8, cmd(3)));
    assert_eq!(z.ready().unwrap(), 30);
}

#[test]
fn retry_after_comes_from_the_observed_drain_rate() {
    let clock = ManualClock::new();
    let limit = InFlightLimit::new(4);
    let lanes = Lanes::builder(TestKernel::new())
        .limit(limit.clone())
        .clock(clock.clone())
        .build()
        .unwrap();
    // Drain 100 commands in 100 ms of (manual) time: 1000 commands/s.
    for id in 0..100 {
        futures::executor::block_on(lanes.execute(id as u32, cmd(id))).unwrap();
        clock.advance(Duration::from_millis(1));
    }
    // Fill the limit with 4 blocked commands, then ask for a fifth.
    let mut blocked: Vec<_> = (0..4)
        .map(|i| waiting(&lanes, 1000 + i, op(1000 + i as u64, Op::Block(1))))
        .collect();
    let e = Manual::new(lanes.execute(5000, cmd(5000)))
        .ready()
        .unwrap_err();
    // 4 in flight at 1000/s: 4 ms.
    assert_eq!(e.retry_after(), Some(Duration::from_millis(4)));
    lanes.kernel().open(1);
    for m in &mut blocked {
        m.ready().unwrap();
    }
}

#[test]
fn bad_settings_are_refused_never_a_panic() {
    assert_eq!(
        Lanes::builder(TestKernel::new())
            .lane_capacity(0)
            .build()
            .unwrap_err(),
        ConfigError::ZeroLaneCapacity
    );
    assert_eq!(
        Lanes::builder(TestKernel::new())
            .max_batch(0)
            .build()
            .unwrap_err(),
        ConfigError::ZeroMaxBatch
    );
    let zero = InFlightLimit::new(0); // no panic here
    assert_eq!(
        Lanes::builder(TestKernel::new())
            .limit(zero)
            .build()
            .unwrap_err(),
        ConfigError::ZeroInFlightLimit
    );
    assert_eq!(
        InFlightLimit::try_new(0).unwrap_err(),
        ConfigError::ZeroInFlightLimit
    );
    let lanes = Lanes::builder(TestKernel::new())
        .lane_capacity(1)
        .max_batch(1)
        .build()
        .unwrap();
    assert_eq!((lanes.lane_capacity(), lanes.max_batch()), (1, 1));
    let defaults = Lanes::builder(TestKernel::new()).build().unwrap();
    assert_eq!((defaults.lane_capacity(), defaults.max_batch()), (64, 32));
    assert_eq!(defaults.limit().max(), 10_000);
}

#[test]
fn nothing_grows_when_the_kernel_stalls() {
    // One stalled key and a flood of callers: the lane holds at most its
    // capacity, the rest are refused at once.
    let lanes = Lanes::builder(TestKernel::new())
        .lane_capacity(8)
        .build()
        .unwrap();
    let mut leader = waiting(&lanes, 1, op(0, Op::Block(1)));
    let mut waiting = Vec::new();
    let mut busy = 0;
    for id in 1..=100 {
        let mut m = Manual::new(lanes.execute(1, cmd(id)));
        match m.poll() {
            std::task::Poll::Pending => waiting.push(m),
            std::task::Poll::Ready(Err(e)) if e.is_busy() => busy += 1,
            std::task::Poll::Ready(other) => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!((waiting.len(), busy), (8, 92));
    assert_eq!(lanes.in_flight(), 9);
    lanes.kernel().open(1);
    leader.ready().unwrap();
    for m in &mut waiting {
        m.ready().unwrap();
    }
    assert_eq!(lanes.kernel().decided().len(), 9);
}
