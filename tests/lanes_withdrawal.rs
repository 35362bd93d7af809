//! Withdrawal: a command still waiting when its deadline passes, or whose
//! caller's future is dropped, never reaches the kernel, and `Withdrawn`
//! hands it back. Time is a `ManualClock`, or a real deadline whose outcome
//! does not depend on how long anything took.

mod lanes_support;

use std::sync::Arc;
use std::time::Duration;

use keyed_executor::lanes::{Clock, LaneError, Lanes, ManualClock};
use lanes_support::*;

fn with_clock() -> (Lanes<TestKernel>, ManualClock) {
    let clock = ManualClock::new();
    let lanes = Lanes::builder(TestKernel::new())
        .clock(clock.clone())
        .build()
        .unwrap();
    (lanes, clock)
}

#[test]
fn deadline_passed_at_batch_formation_withdraws_the_command() {
    let (lanes, clock) = with_clock();
    let k = lanes.kernel();
    let mut leader = waiting(&lanes, 1, op(1, Op::Block(1)));
    let mut next = Manual::new(lanes.execute(1, cmd(2)));
    let deadline = clock.now() + Duration::from_secs(1);
    let mut late = Manual::new(lanes.execute_with_deadline(1, cmd(3), deadline));
    let mut last = Manual::new(lanes.execute(1, cmd(4)));
    next.pending();
    late.pending();
    last.pending();

    clock.advance(Duration::from_secs(2));
    k.open(1);
    leader.ready().unwrap();
    // `next` leads the next batch; forming it finds `late` expired.
    assert_eq!(next.ready().unwrap(), 20);
    assert_eq!(late.woken(), 1);
    match late.ready() {
        Err(LaneError::Withdrawn(c)) => assert_eq!(c.id, 3),
        other => panic!("expected Withdrawn, got {other:?}"),
    }
    assert_eq!(last.ready().unwrap(), 40);
    assert_eq!(k.batch_ids(), vec![vec![1], vec![2, 4]]);
    assert!(!k.saw(3), "a withdrawn command never reaches the kernel");
    assert_eq!(lanes.in_flight(), 0);
}

#[test]
fn deadline_is_checked_when_the_caller_is_polled() {
    let (lanes, clock) = with_clock();
    let mut leader = waiting(&lanes, 1, op(1, Op::Block(1)));
    let mut late = Manual::new(lanes.execute_with_deadline(
        1,
        cmd(2),
        clock.now() + Duration::from_millis(10),
    ));
    late.pending();
    clock.advance(Duration::from_millis(10));
    // No batch was formed, but its own poll notices the deadline.
    assert_eq!(late.ready().unwrap_err().into_command().unwrap().id, 2);
    assert_eq!(lanes.in_flight(), 1);
    lanes.kernel().open(1);
    leader.ready().unwrap();
    assert!(!lanes.kernel().saw(2));
    assert_eq!(lanes.lanes_alive(), 0);
}

#[test]
fn a_leader_past_its_deadline_withdraws_and_passes_the_lane_on() {
    let (lanes, clock) = with_clock();
    let mut first = waiting(&lanes, 1, op(1, Op::Block(1)));
    let mut head =
        Manual::new(lanes.execute_with_deadline(1, cmd(2), clock.now() + Duration::from_millis(5)));
    let mut behind = Manual::new(lanes.execute(1, cmd(3)));
    head.pending();
    behind.pending();
    clock.advance(Duration::from_millis(5));
    lanes.kernel().open(1);
    first.ready().unwrap();
    // `head` was handed the lane but its deadline passed: it withdraws and
    // the lane passes to `behind`.
    assert!(head.ready().unwrap_err().is_withdrawn());
    assert_eq!(behind.woken(), 1);
    assert_eq!(behind.ready().unwrap(), 30);
    assert_eq!(lanes.kernel().batch_ids(), vec![vec![1], vec![3]]);
}

#[test]
fn a_command_already_in_a_batch_is_not_withdrawn() {
    let (lanes, clock) = with_clock();
    let mut first = Manual::new(lanes.execute_with_deadline(
        1,
        op(1, Op::Block(1)),
        clock.now() + Duration::from_millis(5),
    ));
    first.pending(); // in the kernel now
    clock.advance(Duration::from_secs(1));
    first.pending(); // past its deadline, but it already started
    lanes.kernel().open(1);
    assert_eq!(first.ready().unwrap(), 10);
}

#[test]
fn an_expired_deadline_before_entering_is_withdrawn_at_once() {
    let (lanes, clock) = with_clock();
    let now = clock.now();
    let mut m = Manual::new(lanes.execute_with_deadline(1, cmd(1), now));
    assert!(m.ready().unwrap_err().is_withdrawn());
    assert_eq!(lanes.in_flight(), 0);
    assert!(lanes.kernel().batches().is_empty());
}

#[test]
fn blocking_wait_withdraws_at_its_timeout() {
    let lanes = lanes(TestKernel::new());
    let mut leader = waiting(&lanes, 1, op(1, Op::Block(1)));
    // The gate opens only after the blocking call returned, so the call can
    // only return by withdrawing its own command.
    let e = lanes
        .execute_blocking(1, cmd(2), Duration::from_millis(20))
        .unwrap_err();
    match e {
        LaneError::Withdrawn(c) => assert_eq!(c.id, 2),
        other => panic!("expected Withdrawn, got {other:?}"),
    }
    lanes.kernel().open(1);
    leader.ready().unwrap();
    assert!(!lanes.kernel().saw(2));
    assert_eq!(lanes.in_flight(), 0);
}

#[test]
fn blocking_caller_behind_a_blocked_leader_gets_its_result() {
    let lanes = Arc::new(lanes(TestKernel::new()));
    let mut leader = waiting(&lanes, 1, op(1, Op::Block(1)));
    let l2 = Arc::clone(&lanes);
    let t = std::thread::spawn(move || l2.execute_blocking(1, cmd(2), Duration::from_secs(60)));
    while lanes.in_flight() < 2 {
        std::thread::yield_now();
    }
    lanes.kernel().open(1);
    // The leader's poll finishes its batch and wakes the blocked thread,
    // which leads its own batch.
    leader.ready().unwrap();
    assert_eq!(t.join().unwrap().unwrap(), 20);
}

#[test]
fn dropped_queued_future_is_withdrawn() {
    let lanes = lanes(TestKernel::new());
    let mut leader = waiting(&lanes, 1, op(1, Op::Block(1)));
    let gone = waiting(&lanes, 1, cmd(2));
    assert_eq!(lanes.in_flight(), 2);
    drop(gone);
    assert_eq!(lanes.in_flight(), 1);
    lanes.kernel().open(1);
    leader.ready().unwrap();
    assert!(!lanes.kernel().saw(2));
}

#[test]
fn runtime_timeout_drops_the_future_and_withdraws() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_time()
        .build()
        .unwrap();
    let lanes = Arc::new(lanes(TestKernel::new()));
    rt.block_on(async {
        let l = Arc::clone(&lanes);
        let leader = tokio::spawn(async move { l.execute(1, op(1, Op::Block(1))).await });
        while lanes.kernel().batches().is_empty() {
            tokio::task::yield_now().await;
        }
        let timed_out =
            tokio::time::timeout(Duration::from_millis(10), lanes.execute(1, cmd(2))).await;
        assert!(
            timed_out.is_err(),
            "the leader is blocked, so this must time out"
        );
        lanes.kernel().open(1);
        assert_eq!(leader.await.unwrap().unwrap(), 10);
    });
    assert!(!lanes.kernel().saw(2));
    assert_eq!(lanes.in_flight(), 0);
}
