//! The worker thread's loop: run tasks, then out of work spin, settle or
//! park (see "Spin then park" in `mod.rs`).

use std::time::{Duration, Instant};

use crate::pool::shared::Shared;
use crate::sync::atomic::{fence, Ordering::*};
use crate::sync::{spin_loop, thread, Arc};

use super::cx::{self, WorkerCx};
use super::Worker;

/// The worker thread's main loop.
pub(crate) fn run(shared: Arc<Shared>, index: usize) {
    let me = &shared.workers[index];
    *me.thread.lock() = Some(thread::current());
    cx::mark_thread(shared.id());
    if let Some(hook) = &shared.config.on_thread_start {
        hook();
    }
    shared.worker_started();
    let spin = shared.config.spin;
    let local = me
        .local
        .lock()
        .take()
        .expect("a worker's run queue is taken once");
    let cx = WorkerCx::new(&shared, index, local);
    cx.install();
    // Allow a spin on the first idle period.
    let mut last_wait = Duration::ZERO;
    loop {
        while let Some(task) = cx.next_task() {
            if shared.is_forced() {
                task.cancel();
            } else {
                task.run(&cx);
            }
            cx.metrics.after_task(&cx);
        }
        // Out of work: counted idle from here (a submitter that sees it
        // may send work; one it does not see left work this look finds),
        // help a stuck worker, else give back held-back credit and wait.
        let conserve = shared.config.work_conservation;
        let _idle = conserve.then(|| shared.idle(index));
        if conserve && !shared.is_forced() && cx.steal() {
            continue;
        }
        cx.flush_credit();
        let st = shared.state();
        if shared.should_exit(st) {
            break;
        }
        let idle_since = Instant::now();
        cx.step_idle(idle_since);
        if !spin.is_zero() && last_wait < spin {
            if spin_for_work(&shared, me, spin, idle_since, st) {
                me.counters.spin_hits.fetch_add(1, Relaxed);
                last_wait = idle_since.elapsed();
                continue;
            }
        } else {
            #[cfg(not(loom))]
            if last_wait < YIELD_WINDOW && yield_before_park(&shared, me, st) {
                last_wait = idle_since.elapsed();
                continue;
            }
        }
        // Park: announce, then re-check everything a waker would publish:
        // a push, a stop, and (during a graceful stop) the retirement of the
        // last mailbox, whose retirer wakes only workers it sees parked.
        cx.metrics.flush(&cx);
        shared.metrics.parking();
        me.state.swap(Worker::PARKED, SeqCst);
        fence(SeqCst);
        if me.has_news() || shared.state() != st || shared.should_exit(st) {
            // Cancel the park. If a waker already flipped us to RUNNING it
            // also unparked us: the stale token only costs a spurious wake.
            let _ = me
                .state
                .compare_exchange(Worker::PARKED, Worker::RUNNING, SeqCst, Relaxed);
            shared.metrics.unparked();
            continue;
        }
        me.counters.parks.fetch_add(1, Relaxed);
        let beside = cfg!(not(loom)) && shared.workers.len() > 1 && shared.work_beside(index);
        if conserve && shared.workers.len() > 1 && shared.config.watchers() {
            cx.park();
        } else {
            park_until_woken(me);
        }
        shared.metrics.unparked();
        last_wait = idle_since.elapsed();
        if beside {
            cx.parked_beside_work(last_wait);
        }
    }
    cx.flush_credit();
    cx.metrics.flush(&cx);
    // Forced stop: cancel whatever was queued or pushed meanwhile.
    while let Some(task) = cx.next_task() {
        task.cancel();
    }
    me.state.store(Worker::EXITED, SeqCst);
    // Against a push from another worker (work conservation sends a task
    // home): it sees `EXITED` after its push and cancels the task itself,
    // or this look sees the task.
    fence(SeqCst);
    while let Some(task) = cx.next_task() {
        task.cancel();
    }
    if let Some(hook) = &shared.config.on_thread_stop {
        hook();
    }
    WorkerCx::uninstall();
    cx::mark_thread(0);
    shared.worker_exited();
}

/// Sleeps until woken (a pusher or a stop moves `state` out of `PARKED`).
pub(crate) fn park_until_woken(me: &Worker) {
    while me.state.load(SeqCst) == Worker::PARKED {
        thread::park();
    }
}

/// Spins until work arrives (true), `spin` passes, or a stop begins.
///
/// Every 64 rounds it yields its core (`sched_yield`): on a machine with
/// more runnable threads than cores, the thread it waits for (a producer,
/// a device) may be the one that needs the core, and a spin that keeps it
/// off only delays the work it waits for.
fn spin_for_work(shared: &Shared, me: &Worker, spin: Duration, start: Instant, st: usize) -> bool {
    me.state.store(Worker::SPINNING, SeqCst);
    let mut found = false;
    let mut i: u32 = 0;
    loop {
        if me.has_news() {
            found = true;
            break;
        }
        if shared.state() != st {
            break;
        }
        i = i.wrapping_add(1);
        if i % 64 == 0 {
            if start.elapsed() >= spin {
                break;
            }
            thread::yield_now();
        } else {
            spin_loop();
        }
    }
    me.state.store(Worker::RUNNING, SeqCst);
    found
}

/// Before parking, a worker whose last wait was shorter than this yields
/// its core a few times, looking for work between yields
/// ([`YIELDS_BEFORE_PARK`]); after a longer wait it parks at once.
#[cfg(not(loom))]
const YIELD_WINDOW: Duration = Duration::from_micros(50);
#[cfg(not(loom))]
const YIELDS_BEFORE_PARK: u32 = 4;

/// The settle before a park (see [`YIELD_WINDOW`]): true if work arrived.
/// A message that arrives while a worker yields costs its sender no
/// wake-up; the yields give the core to whichever thread the worker waits
/// for, and cost a few system calls when none is runnable.
#[cfg(not(loom))]
fn yield_before_park(shared: &Shared, me: &Worker, st: usize) -> bool {
    me.state.store(Worker::SPINNING, SeqCst);
    let mut found = false;
    for _ in 0..YIELDS_BEFORE_PARK {
        thread::yield_now();
        if me.has_news() {
            found = true;
            break;
        }
        if shared.state() != st {
            break;
        }
    }
    me.state.store(Worker::RUNNING, SeqCst);
    found
}
