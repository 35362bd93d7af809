//! Failures stay where they belong: a panicking kernel fails its batch and
//! the lane goes on; kernel errors reach their callers; the classifier
//! records the first fatal error; a failing commit hook is logged and never
//! fails committed commands.

mod lanes_support;

use std::sync::{Arc, Mutex};

use keyed_executor::lanes::{BatchResult, Kernel, LaneError, Lanes, LanesEvent, NodeFatals};
use lanes_support::*;

#[test]
fn a_panicking_batch_fails_its_commands_and_the_lane_goes_on() {
    let lanes = lanes(TestKernel::new());
    let k = lanes.kernel();
    let mut leader = waiting(&lanes, 1, op(1, Op::Block(1)));
    let mut a = Manual::new(lanes.execute(1, cmd(2)));
    let mut b = Manual::new(lanes.execute(1, op(3, Op::Panic)));
    let mut c = Manual::new(lanes.execute(1, cmd(4)));
    a.pending();
    b.pending();
    c.pending();
    k.open(1);
    leader.ready().unwrap();
    // [2, 3, 4] panics at 3: all three fail, the head with the original payload.
    let pa = a.ready().unwrap_err().into_panic().unwrap();
    assert_eq!(pa.message(), "kernel panic 3");
    assert_eq!(
        pa.into_payload().downcast_ref::<String>().unwrap(),
        "kernel panic 3"
    );
    for m in [&mut b, &mut c] {
        match m.ready() {
            Err(LaneError::Panicked(p)) => assert_eq!(p.message(), "kernel panic 3"),
            other => panic!("expected Panicked, got {other:?}"),
        }
    }
    // The lane goes on.
    let mut d = Manual::new(lanes.execute(1, cmd(5)));
    assert_eq!(d.ready().unwrap(), 50);
    assert_idle(&lanes);
}

#[test]
fn a_panic_in_execute_batch_itself_is_contained_too() {
    let lanes = lanes(TestKernel::new());
    let e = futures::executor::block_on(lanes.execute(1, op(1, Op::PanicEarly))).unwrap_err();
    assert_eq!(e.into_panic().unwrap().message(), "early panic");
    assert_eq!(
        futures::executor::block_on(lanes.execute(1, cmd(2))).unwrap(),
        20
    );
}

#[test]
fn rejected_commands_and_failed_appends_reach_their_callers() {
    let lanes = lanes(TestKernel::new());
    let k = lanes.kernel();
    let mut leader = waiting(&lanes, 1, op(1, Op::Block(1)));
    let mut ok = Manual::new(lanes.execute(1, cmd(2)));
    let mut rejected = Manual::new(lanes.execute(1, op(3, Op::Reject)));
    ok.pending();
    rejected.pending();
    k.open(1);
    leader.ready().unwrap();
    assert_eq!(ok.ready().unwrap(), 20);
    assert_eq!(
        rejected.ready().unwrap_err().into_kernel_error().unwrap(),
        TestError("rejected 3".into())
    );

    // One failing append fails every decided command of the batch.
    let mut leader = waiting(&lanes, 1, op(10, Op::Block(2)));
    let mut x = Manual::new(lanes.execute(1, cmd(11)));
    let mut y = Manual::new(lanes.execute(1, op(12, Op::FailAppend)));
    x.pending();
    y.pending();
    k.open(2);
    leader.ready().unwrap();
    for m in [&mut x, &mut y] {
        assert_eq!(
            m.ready().unwrap_err().into_kernel_error().unwrap(),
            TestError("append failed".into())
        );
    }
}

#[test]
fn the_first_fatal_error_is_recorded_for_the_node() {
    let fatals = NodeFatals::new();
    let events = Arc::new(Mutex::new(Vec::new()));
    let ev = Arc::clone(&events);
    let build = |fatals: &NodeFatals| {
        let ev = Arc::clone(&ev);
        Lanes::builder(TestKernel::new())
            .fatals(fatals.clone())
            .fatal_if(|e: &TestError| e.0.starts_with("fatal"))
            .on_event(move |e| ev.lock().unwrap().push(e.to_string()))
            .build()
            .unwrap()
    };
    let a = build(&fatals);
    let b = build(&fatals);
    let run = |l: &Lanes<TestKernel>, c| futures::executor::block_on(l.execute(1, c));
    assert!(run(&a, op(1, Op::Reject)).unwrap_err().is_kernel());
    assert!(fatals.first().is_none(), "not every error is fatal");
    assert!(run(&b, op(2, Op::Fatal)).unwrap_err().is_kernel());
    assert!(run(&a, op(3, Op::Fatal)).unwrap_err().is_kernel());
    assert_eq!(fatals.first().unwrap().message(), "fatal 2");
    assert!(a.fatals().same_as(&fatals) && b.fatals().is_fatal());
    // The lanes go on after a fatal error: acting on it is the node's call.
    assert_eq!(run(&a, cmd(4)).unwrap(), 40);
    let events = events.lock().unwrap();
    assert_eq!(
        events.as_slice(),
        ["fatal error recorded for the node: fatal 2"]
    );
}

#[test]
fn the_commit_hook_sees_each_batch_before_the_next_starts() {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let s = Arc::clone(&seen);
    let lanes = Lanes::builder(TestKernel::new())
        .on_commit(move |key: &u32, outcomes: &[Result<u64, TestError>]| {
            let ok: Vec<u64> = outcomes.iter().filter_map(|o| o.clone().ok()).collect();
            s.lock().unwrap().push((*key, ok));
            Ok(())
        })
        .build()
        .unwrap();
    let k = lanes.kernel();
    let mut leader = waiting(&lanes, 1, op(1, Op::Block(1)));
    let mut a = waiting(&lanes, 1, cmd(2));
    k.open(1);
    // The hook ran for [1] before the leader got its outcome, and before
    // the next batch [2] could start.
    assert_eq!(leader.ready().unwrap(), 10);
    assert_eq!(seen.lock().unwrap().as_slice(), [(1, vec![10])]);
    assert_eq!(a.ready().unwrap(), 20);
    assert_eq!(seen.lock().unwrap().len(), 2);

    // A batch whose append failed is not shown to the hook.
    let mut leader = waiting(&lanes, 1, op(5, Op::Block(2)));
    let mut b = Manual::new(lanes.execute(1, op(3, Op::FailAppend)));
    let mut c = Manual::new(lanes.execute(1, cmd(4)));
    b.pending();
    c.pending();
    k.open(2);
    assert_eq!(leader.ready().unwrap(), 50);
    assert!(b.ready().unwrap_err().is_kernel());
    assert!(c.ready().unwrap_err().is_kernel());
    assert_eq!(k.batch_ids(), vec![vec![1], vec![2], vec![5], vec![3, 4]]);
    assert_eq!(
        seen.lock().unwrap().as_slice(),
        [(1, vec![10]), (1, vec![20]), (1, vec![50])]
    );
}

#[test]
fn a_failing_or_panicking_hook_never_fails_committed_commands() {
    let events = Arc::new(Mutex::new(Vec::new()));
    let ev = Arc::clone(&events);
    let lanes = Lanes::builder(TestKernel::new())
        .on_commit(
            |_key: &u32, outcomes: &[Result<u64, TestError>]| match outcomes.first() {
                Some(Ok(10)) => Err("view store down".into()),
                Some(Ok(20)) => panic!("view bug"),
                _ => Ok(()),
            },
        )
        .on_event(move |e| {
            if let LanesEvent::CommitHookFailed { key, .. }
            | LanesEvent::CommitHookPanicked { key, .. } = e
            {
                ev.lock().unwrap().push((**key, e.to_string()));
            }
        })
        .build()
        .unwrap();
    let run = |c| futures::executor::block_on(lanes.execute(7, c));
    assert_eq!(run(cmd(1)).unwrap(), 10);
    assert_eq!(run(cmd(2)).unwrap(), 20);
    assert_eq!(run(cmd(3)).unwrap(), 30);
    assert_eq!(
        events.lock().unwrap().as_slice(),
        [
            (
                7,
                "commit hook failed (commands unaffected): view store down".to_string()
            ),
            (
                7,
                "commit hook panicked (commands unaffected): view bug".to_string()
            ),
        ]
    );
}

/// A kernel that breaks the `BatchResult` contract (too few outcomes).
struct Liar;

impl Kernel for Liar {
    type Key = u8;
    type Command = u8;
    type Output = u8;
    type Error = String;

    // Implementations may use `async fn`.
    async fn execute_batch(&self, _key: &u8, _commands: Vec<u8>) -> BatchResult<u8, u8, String> {
        BatchResult::committed(Vec::new())
    }
}

#[test]
fn a_kernel_breaking_the_contract_fails_its_batch_clearly() {
    let lanes = Lanes::builder(Liar).build().unwrap();
    let e = futures::executor::block_on(lanes.execute(1, 1)).unwrap_err();
    assert_eq!(
        e.into_panic().unwrap().message(),
        "kernel broke the BatchResult contract: 0 outcomes and 0 again commands for a batch of 1 commands"
    );
    assert_idle(&lanes);
}
