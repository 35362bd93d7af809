//! `close`: refuses new commands at once, waits for the ones taken, drives
//! batches nobody else will, and says `false` at its timeout with the busy
//! lanes named.

mod lanes_support;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use keyed_executor::lanes::{Lanes, LanesEvent, ManualClock};
use lanes_support::*;

#[test]
fn close_refuses_at_once_and_waits_for_what_was_taken() {
    let lanes = Arc::new(lanes(TestKernel::new()));
    let mut leader = waiting(&lanes, 1, op(1, Op::Block(1)));
    let mut queued = waiting(&lanes, 1, cmd(2));

    let mut close = Manual::new(lanes.close(Duration::from_secs(3600)));
    assert!(lanes.is_closed(), "closed as soon as close is called");
    close.pending();
    let refused = futures::executor::block_on(lanes.execute(2, cmd(3))).unwrap_err();
    assert!(refused.is_closed());
    assert_eq!(refused.into_command().unwrap().id, 3);
    assert_eq!(
        format!(
            "{:?}",
            lanes
                .execute_blocking(1, cmd(4), Duration::ZERO)
                .unwrap_err()
        ),
        "Closed(..)"
    );

    lanes.kernel().open(1);
    assert_eq!(leader.ready().unwrap(), 10);
    close.pending(); // the queued command is still running
    assert_eq!(queued.ready().unwrap(), 20);
    assert!(close.woken() >= 1, "the last release wakes the closer");
    assert!(close.ready());
    assert_eq!(lanes.kernel().batch_ids(), vec![vec![1], vec![2]]);
}

#[test]
fn close_on_an_idle_lanes_is_immediate() {
    let lanes = lanes(TestKernel::new());
    assert!(lanes.close_blocking(Duration::ZERO));
    assert!(futures::executor::block_on(lanes.close(Duration::ZERO)));
}

#[test]
fn close_drives_a_batch_whose_callers_all_left() {
    let lanes = lanes(TestKernel::new());
    let mut a = Manual::new(lanes.execute(1, op(1, Op::Block(1))));
    let mut b = Manual::new(lanes.execute(1, op(2, Op::Block(2))));
    a.pending();
    b.pending();
    lanes.kernel().open(1);
    a.ready().unwrap();
    b.pending(); // B leads [2], blocked on gate 2
    drop(b); // ... and leaves: the batch is orphaned
    assert_eq!(lanes.in_flight(), 1);
    lanes.kernel().open(2); // nobody is polling it now
    assert!(lanes.close_blocking(Duration::from_secs(3600)));
    assert_eq!(lanes.kernel().decided_ids(), vec![1, 2]);
    assert_idle(&lanes);
}

#[test]
fn close_times_out_naming_the_busy_lanes() {
    let clock = ManualClock::new();
    let events = Arc::new(Mutex::new(Vec::new()));
    let ev = Arc::clone(&events);
    let lanes = Lanes::builder(TestKernel::new())
        .clock(clock.clone())
        .on_event(move |e| {
            if let LanesEvent::CloseTimedOut { busy, in_flight } = e {
                ev.lock().unwrap().push((busy.to_vec(), *in_flight));
            }
        })
        .build()
        .unwrap();
    let mut stuck = waiting(&lanes, 9, op(1, Op::Block(1)));
    let mut close = Manual::new(lanes.close(Duration::from_secs(5)));
    close.pending();
    clock.advance(Duration::from_secs(4));
    close.pending();
    clock.advance(Duration::from_secs(1));
    assert!(!close.ready());
    assert_eq!(events.lock().unwrap().as_slice(), [(vec![9], 1)]);
    assert_eq!(lanes.busy_keys(), vec![9]);
    // The command still finishes for its caller.
    lanes.kernel().open(1);
    assert_eq!(stuck.ready().unwrap(), 10);
    assert!(lanes.busy_keys().is_empty());
}

#[test]
fn async_close_times_out_without_a_runtime_timer() {
    let lanes = Lanes::builder(TestKernel::new())
        .on_event(|_| {})
        .build()
        .unwrap();
    let mut stuck = waiting(&lanes, 1, op(1, Op::Block(1)));
    // futures' block_on has no timer: the close future's own timer thread
    // wakes it at the deadline.
    assert!(!futures::executor::block_on(
        lanes.close(Duration::from_millis(10))
    ));
    assert!(!lanes.close_blocking(Duration::from_millis(1)));
    lanes.kernel().open(1);
    stuck.ready().unwrap();
    assert!(lanes.close_blocking(Duration::ZERO));
}

#[test]
fn close_under_tokio_with_live_callers() {
    let rt = tokio_runtime();
    let lanes = Arc::new(
        Lanes::builder(TestKernel::yielding())
            .max_batch(4)
            .build()
            .unwrap(),
    );
    rt.block_on(async {
        let mut tasks = Vec::new();
        for caller in 0..8u64 {
            let l = Arc::clone(&lanes);
            tasks.push(tokio::spawn(async move {
                let mut ok = 0;
                let mut closed = 0;
                for i in 0..200u64 {
                    match l.execute((caller % 3) as u32, cmd(caller * 1000 + i)).await {
                        Ok(_) => ok += 1,
                        Err(e) if e.is_closed() => closed += 1,
                        Err(e) => panic!("unexpected {e:?}"),
                    }
                }
                (ok, closed)
            }));
        }
        while lanes.kernel().decided().len() < 100 {
            tokio::task::yield_now().await;
        }
        assert!(lanes.close(Duration::from_secs(3600)).await);
        assert_eq!(lanes.in_flight(), 0);
        let mut ok_total = 0;
        for t in tasks {
            let (ok, closed) = t.await.unwrap();
            assert_eq!(ok + closed, 200);
            ok_total += ok;
        }
        // Everything accepted ran exactly once; nothing refused ran.
        assert_eq!(lanes.kernel().decided().len(), ok_total);
    });
}
