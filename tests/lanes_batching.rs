//! Batching: a command runs alone unless others wait behind it, batches never
//! exceed `max_batch`, and `again` commands return to the head in order.

mod lanes_support;

use keyed_executor::lanes::Lanes;
use lanes_support::*;

#[test]
fn an_idle_key_runs_each_command_alone() {
    let lanes = lanes(TestKernel::new());
    for id in 1..=5 {
        let out = futures::executor::block_on(lanes.execute(1, cmd(id)));
        assert_eq!(out.unwrap(), id * 10);
    }
    assert_eq!(
        lanes.kernel().batch_ids(),
        vec![vec![1], vec![2], vec![3], vec![4], vec![5]]
    );
    assert_eq!(lanes.lanes_alive(), 0);
}

/// A leader blocked in the kernel, `n` callers queued behind it.
fn contended(
    lanes: &Lanes<TestKernel>,
    n: u64,
) -> (
    Manual<keyed_executor::lanes::Execute<TestKernel>>,
    Vec<Manual<keyed_executor::lanes::Execute<TestKernel>>>,
) {
    let leader = waiting(lanes, 1, op(100, Op::Block(1)));
    let queued: Vec<_> = (1..=n).map(|id| waiting(lanes, 1, cmd(id))).collect();
    assert_eq!(lanes.in_flight(), n as usize + 1);
    (leader, queued)
}

#[test]
fn batches_form_under_contention_and_respect_max_batch() {
    let lanes = Lanes::builder(TestKernel::new())
        .max_batch(4)
        .build()
        .unwrap();
    let (mut leader, mut queued) = contended(&lanes, 10);
    lanes.kernel().open(1);
    assert_eq!(leader.ready().unwrap(), 1000);
    // Each head leads the next batch when polled; the others just wait.
    for (i, m) in queued.iter_mut().enumerate() {
        assert_eq!(m.ready().unwrap(), (i as u64 + 1) * 10);
    }
    assert_eq!(
        lanes.kernel().batch_ids(),
        vec![vec![100], vec![1, 2, 3, 4], vec![5, 6, 7, 8], vec![9, 10]]
    );
    assert_eq!(lanes.in_flight(), 0);
}

#[test]
fn the_leader_never_waits_to_fill_a_batch() {
    let lanes = lanes(TestKernel::new()); // max_batch 32
    let (mut leader, mut queued) = contended(&lanes, 3);
    lanes.kernel().open(1);
    leader.ready().unwrap();
    // Three were waiting: the batch is those three, not 32.
    queued[0].ready().unwrap();
    // A fourth arrives after the batch formed: it runs in its own batch.
    let mut late = Manual::new(lanes.execute(1, cmd(4)));
    assert_eq!(late.ready().unwrap(), 40);
    for m in &mut queued[1..] {
        m.ready().unwrap();
    }
    assert_eq!(
        lanes.kernel().batch_ids(),
        vec![vec![100], vec![1, 2, 3], vec![4]]
    );
}

#[test]
fn max_batch_one_runs_every_command_alone() {
    let lanes = Lanes::builder(TestKernel::new())
        .max_batch(1)
        .build()
        .unwrap();
    let (mut leader, mut queued) = contended(&lanes, 4);
    lanes.kernel().open(1);
    leader.ready().unwrap();
    for m in &mut queued {
        m.ready().unwrap();
    }
    assert_eq!(
        lanes.kernel().batch_ids(),
        vec![vec![100], vec![1], vec![2], vec![3], vec![4]]
    );
}

#[test]
fn again_returns_to_the_head_in_order() {
    let lanes = Lanes::builder(TestKernel::new())
        .max_batch(4)
        .build()
        .unwrap();
    let k = lanes.kernel();
    let mut leader = waiting(&lanes, 1, op(100, Op::Block(1)));
    let ops = [
        op(1, Op::Ok),
        op(2, Op::AgainOnce), // 2, 3, 4 handed back the first time
        op(3, Op::Ok),
        op(4, Op::Ok),
        op(5, Op::Ok),
        op(6, Op::Ok),
    ];
    let mut queued: Vec<_> = ops.into_iter().map(|c| waiting(&lanes, 1, c)).collect();
    k.open(1);
    leader.ready().unwrap();
    for (i, m) in queued.iter_mut().enumerate() {
        assert_eq!(m.ready().unwrap(), (i as u64 + 1) * 10);
    }
    // [1, 2, 3, 4] decides 1 and hands back 2, 3, 4: they return to the
    // head, in order, ahead of 5 and 6, and lead the next batch.
    assert_eq!(
        k.batch_ids(),
        vec![vec![100], vec![1, 2, 3, 4], vec![2, 3, 4, 5], vec![6]]
    );
    assert_eq!(k.decided_ids(), vec![100, 1, 2, 3, 4, 5, 6]);
}

#[test]
fn a_kernel_that_hands_everything_back_yields_between_attempts() {
    let lanes = lanes(TestKernel::new());
    let mut m = Manual::new(lanes.execute(1, op(1, Op::AgainOnce)));
    // First poll: batch [1] hands 1 back; the caller leads again but yields
    // first instead of looping inside one poll.
    m.pending();
    assert_eq!(m.woken(), 1);
    assert_eq!(m.ready().unwrap(), 10);
    assert_eq!(lanes.kernel().batch_ids(), vec![vec![1], vec![1]]);
}

#[test]
fn different_keys_do_not_wait_for_each_other() {
    let lanes = lanes(TestKernel::new());
    let mut blocked = waiting(&lanes, 1, op(1, Op::Block(1)));
    // Key 2 runs while key 1 is stuck in the kernel.
    let mut other = Manual::new(lanes.execute(2, cmd(2)));
    assert_eq!(other.ready().unwrap(), 20);
    assert_eq!(lanes.lanes_alive(), 1);
    lanes.kernel().open(1);
    blocked.ready().unwrap();
    assert_eq!(lanes.lanes_alive(), 0);
}
