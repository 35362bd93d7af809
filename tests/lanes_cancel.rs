//! Cancellation safety: dropping any caller's future — the leader's, a
//! batch member's, a queued one's — never loses, duplicates or half-runs
//! anyone else's command. Futures are polled by hand, so every interleaving
//! here is exact.

mod lanes_support;

use lanes_support::*;

#[test]
fn leader_dropped_mid_batch_others_get_results_once() {
    let lanes = lanes(TestKernel::new());
    let k = lanes.kernel();

    // A leads batch [A], blocked on gate 1.
    let mut a = waiting(&lanes, 1, op(1, Op::Block(1)));
    // B, C, D queue behind it.
    let mut b = Manual::new(lanes.execute(1, op(2, Op::Block(2))));
    let mut c = Manual::new(lanes.execute(1, cmd(3)));
    let mut d = Manual::new(lanes.execute(1, cmd(4)));
    b.pending();
    c.pending();
    d.pending();
    assert_eq!(lanes.in_flight(), 4);

    k.open(1);
    assert_eq!(a.woken(), 1, "the gate wakes the driver");
    assert_eq!(a.ready().unwrap(), 10);
    assert_eq!(b.woken(), 1, "the lane passed to the head of the queue");

    // B leads [B, C, D] and blocks in the kernel on gate 2.
    b.pending();
    assert_eq!(k.batch_ids(), vec![vec![1], vec![2, 3, 4]]);
    // The leader goes away mid-batch: the driving passes to C, woken.
    drop(b);
    assert_eq!(c.woken(), 1);
    c.pending(); // C polls the batch future, registering its own waker.
    k.open(2);
    assert_eq!(c.woken(), 2);
    assert_eq!(c.ready().unwrap(), 30);
    assert!(d.woken() >= 1);
    assert_eq!(d.ready().unwrap(), 40);

    // B's command ran exactly once (it was in the batch); nothing else ran.
    assert_eq!(k.decided_ids(), vec![1, 2, 3, 4]);
    assert_eq!(k.batch_ids(), vec![vec![1], vec![2, 3, 4]]);
    assert_idle(&lanes);
    assert!(!k.overlap.load(std::sync::atomic::Ordering::SeqCst));
}

#[test]
fn every_member_dropped_next_caller_drives_the_orphan_then_its_own() {
    let lanes = lanes(TestKernel::new());
    let k = lanes.kernel();

    let a = waiting(&lanes, 1, op(1, Op::Block(1)));
    let b = waiting(&lanes, 1, cmd(2));
    // Both go away; A's batch is orphaned in the kernel, B's command withdrawn.
    drop(a);
    drop(b);
    assert_eq!(lanes.in_flight(), 1, "the started batch still counts");
    assert_eq!(lanes.lanes_alive(), 1);
    k.open(1);

    // The next caller of the key drives the orphaned batch to its end first,
    // yields once (it drove someone else's batch in this poll), then leads
    // its own.
    let mut e = waiting(&lanes, 1, cmd(5));
    assert_eq!(k.batch_ids(), vec![vec![1]]);
    assert_eq!(e.woken(), 1);
    assert_eq!(e.ready().unwrap(), 50);
    assert_eq!(k.batch_ids(), vec![vec![1], vec![5]]);
    assert!(
        !k.saw(2),
        "a dropped queued command never reaches the kernel"
    );
    assert_idle(&lanes);
}

#[test]
fn queued_driver_dropped_before_forming_hands_the_lane_on() {
    let lanes = lanes(TestKernel::new());
    let k = lanes.kernel();
    let mut a = waiting(&lanes, 1, op(1, Op::Block(1)));
    let mut b = Manual::new(lanes.execute(1, cmd(2)));
    let mut c = Manual::new(lanes.execute(1, cmd(3)));
    b.pending();
    c.pending();
    k.open(1);
    assert_eq!(a.ready().unwrap(), 10);
    // B is now the leader (woken) but goes away before it is polled.
    assert_eq!(b.woken(), 1);
    drop(b);
    assert_eq!(c.woken(), 1, "the lane passed on to C");
    assert_eq!(c.ready().unwrap(), 30);
    assert_eq!(k.batch_ids(), vec![vec![1], vec![3]]);
}

#[test]
fn member_dropped_mid_batch_result_is_discarded_not_lost() {
    let lanes = lanes(TestKernel::new());
    let k = lanes.kernel();
    let mut a = waiting(&lanes, 1, op(1, Op::Block(1)));
    let mut b = Manual::new(lanes.execute(1, op(2, Op::Block(2))));
    let mut c = Manual::new(lanes.execute(1, cmd(3)));
    b.pending();
    c.pending();
    k.open(1);
    a.ready().unwrap();
    b.pending(); // B leads [B, C]
    drop(c); // a non-driving member leaves: nothing to hand off
    k.open(2);
    assert_eq!(b.ready().unwrap(), 20);
    assert_eq!(k.decided_ids(), vec![1, 2, 3]);
    assert_idle(&lanes);
}

#[test]
fn dropped_again_command_is_not_run_again() {
    let lanes = lanes(TestKernel::new());
    let k = lanes.kernel();
    let mut a = waiting(&lanes, 1, op(1, Op::Block(1)));
    let mut b = Manual::new(lanes.execute(1, op(2, Op::Block(2))));
    let mut c = Manual::new(lanes.execute(1, op(3, Op::AgainOnce)));
    let mut d = Manual::new(lanes.execute(1, cmd(4)));
    b.pending();
    c.pending();
    d.pending();
    k.open(1);
    a.ready().unwrap();
    b.pending(); // [B, C, D]: B decided, C and D handed back
    drop(c);
    k.open(2);
    assert_eq!(b.ready().unwrap(), 20);
    // D leads the next batch alone: C's caller is gone, so C is dropped.
    assert_eq!(d.ready().unwrap(), 40);
    assert_eq!(k.batch_ids(), vec![vec![1], vec![2, 3, 4], vec![4]]);
    assert_eq!(k.decided_ids(), vec![1, 2, 4]);
    assert_eq!(lanes.in_flight(), 0);
}

#[test]
fn dropping_an_unpolled_future_costs_nothing() {
    let lanes = lanes(TestKernel::new());
    drop(lanes.execute(1, cmd(1)));
    assert_idle(&lanes);
    assert!(lanes.kernel().batches().is_empty());
}

#[test]
fn dropping_a_finished_but_unread_outcome_frees_everything() {
    let lanes = lanes(TestKernel::new());
    let k = lanes.kernel();
    let mut a = waiting(&lanes, 1, op(1, Op::Block(1)));
    let mut b = Manual::new(lanes.execute(1, cmd(2)));
    let mut c = Manual::new(lanes.execute(1, cmd(3)));
    b.pending();
    c.pending();
    k.open(1);
    a.ready().unwrap();
    assert_eq!(b.ready().unwrap(), 20); // B led [B, C] within this poll
    assert_eq!(c.woken(), 1, "C's outcome is waiting for it");
    drop(c);
    assert_eq!(k.decided_ids(), vec![1, 2, 3]);
    assert_idle(&lanes);
}
