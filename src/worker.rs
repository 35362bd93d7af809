//! Workers: a FIFO queue of scheduled mailboxes each, and the spin-then-park
//! loop that runs them.
//!
//! # Worker state machine
//!
//! `state` is written by the worker itself except for one edge:
//!
//! - `RUNNING`: taking tasks from its queue (or about to). Made by the worker,
//!   or by a pusher/stopper that wakes it from `PARKED`.
//! - `SPINNING`: out of work, busy-waiting up to `spin` for a push. Made and
//!   left by the worker only; pushers never need to wake it.
//! - `PARKED`: asleep in `thread::park`. Made by the worker. Left by whoever
//!   wins the CAS `PARKED` → `RUNNING` (a pusher, or a stop), which then
//!   unparks the thread — so a worker is unparked at most once per park.
//! - `EXITED`: terminal, set by the worker as it leaves.
//!
//! # No lost wake-ups
//!
//! A pusher does `queue.push; fence(SeqCst); load(state)`; a worker going to
//! sleep does `swap(state, PARKED); fence(SeqCst); check queue and executor
//! state`. By the SeqCst fences, either the pusher sees `PARKED` (and wakes
//! it) or the worker sees the pushed task (and cancels its park). Stops set
//! the executor state first and then wake every parked worker the same way.
//! During a graceful stop, the runner that retires a mailbox wakes the parked
//! workers after removing it, so a worker going to sleep also re-checks,
//! after its fence, whether everything drained.
//!
//! # Spin then park
//!
//! A worker that runs out of work spins for up to `spin` (zero by default:
//! park at once) and only if its *last* wait was shorter than `spin`; after a
//! longer wait it parks at once. The spin also stops at once when a stop
//! begins. Under loom the spin loop yields to the scheduler.

use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;

use crate::executor::Shared;
use crate::sync::atomic::{fence, AtomicU64, AtomicU8, Ordering::*};
use crate::sync::{spin_loop, thread, Arc, Mutex, Queue};
use crate::task::Task;

pub(crate) const RUNNING: u8 = 0;
pub(crate) const SPINNING: u8 = 1;
pub(crate) const PARKED: u8 = 2;
pub(crate) const EXITED: u8 = 3;

/// Counters a worker keeps about itself (relaxed; for stats only).
#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) done: AtomicU64,
    pub(crate) panicked: AtomicU64,
    pub(crate) cancelled: AtomicU64,
    pub(crate) parks: AtomicU64,
    pub(crate) unparks: AtomicU64,
    pub(crate) spin_hits: AtomicU64,
}

/// One worker's shared half.
pub(crate) struct Worker {
    pub(crate) queue: Queue<Task>,
    pub(crate) state: CachePadded<AtomicU8>,
    thread: Mutex<Option<thread::Thread>>,
    pub(crate) counters: CachePadded<Counters>,
}

impl Worker {
    pub(crate) fn new() -> Self {
        Worker {
            queue: Queue::new(),
            state: CachePadded::new(AtomicU8::new(RUNNING)),
            thread: Mutex::new(None),
            counters: CachePadded::new(Counters::default()),
        }
    }

    /// Wakes the worker if it is parked. Call after publishing the reason
    /// (a push, a stop) and a SeqCst fence.
    #[inline]
    pub(crate) fn wake_if_parked(&self) {
        if self.state.load(SeqCst) == PARKED
            && self
                .state
                .compare_exchange(PARKED, RUNNING, SeqCst, Relaxed)
                .is_ok()
        {
            self.unpark();
        }
    }

    #[cold]
    fn unpark(&self) {
        self.counters.unparks.fetch_add(1, Relaxed);
        if let Some(t) = &*self.thread.lock() {
            t.unpark();
        }
    }
}

/// What a running task knows about the worker running it.
pub(crate) struct WorkerCx<'a> {
    pub(crate) shared: &'a Shared,
    pub(crate) index: usize,
}

// loom's `thread_local!` does not take a `const { }` initializer.
#[allow(clippy::missing_const_for_thread_local)]
mod current {
    use std::cell::Cell;
    crate::sync::thread_local! {
        /// The executor (its `Shared` address) whose worker this thread is, or 0.
        pub(super) static CURRENT: Cell<usize> = Cell::new(0);
    }
}
use current::CURRENT;

/// Whether the current thread is a worker of the executor at `shared_id`.
pub(crate) fn on_worker_of(shared_id: usize) -> bool {
    CURRENT.with(|c| c.get() == shared_id)
}

/// The worker thread's main loop.
pub(crate) fn run(shared: Arc<Shared>, index: usize) {
    let me = &shared.workers[index];
    *me.thread.lock() = Some(thread::current());
    CURRENT.with(|c| c.set(shared.id()));
    if let Some(hook) = &shared.config.on_thread_start {
        hook();
    }
    shared.worker_started();
    let spin = shared.config.spin;
    let cx = WorkerCx {
        shared: &shared,
        index,
    };
    // Allow a spin on the first idle period.
    let mut last_wait = Duration::ZERO;
    loop {
        while let Some(task) = me.queue.pop() {
            if shared.is_forced() {
                task.cancel();
            } else {
                task.run(&cx);
            }
        }
        let st = shared.state();
        if shared.should_exit(st) {
            break;
        }
        let idle_since = (!spin.is_zero()).then(Instant::now);
        if let Some(start) = idle_since {
            if last_wait < spin && spin_for_work(&shared, me, spin, start, st) {
                me.counters.spin_hits.fetch_add(1, Relaxed);
                last_wait = start.elapsed();
                continue;
            }
        }
        // Park: announce, then re-check everything a waker would publish:
        // a push, a stop, and (during a graceful stop) the retirement of the
        // last mailbox, whose retirer wakes only workers it sees parked.
        me.state.swap(PARKED, SeqCst);
        fence(SeqCst);
        if !me.queue.is_empty() || shared.state() != st || shared.should_exit(st) {
            // Cancel the park. If a waker already flipped us to RUNNING it
            // also unparked us: the stale token only costs a spurious wake.
            let _ = me.state.compare_exchange(PARKED, RUNNING, SeqCst, Relaxed);
            continue;
        }
        me.counters.parks.fetch_add(1, Relaxed);
        while me.state.load(SeqCst) == PARKED {
            thread::park();
        }
        if let Some(start) = idle_since {
            last_wait = start.elapsed();
        }
    }
    // Forced stop: cancel whatever was pushed meanwhile.
    while let Some(task) = me.queue.pop() {
        task.cancel();
    }
    me.state.store(EXITED, SeqCst);
    if let Some(hook) = &shared.config.on_thread_stop {
        hook();
    }
    CURRENT.with(|c| c.set(0));
    shared.worker_exited();
}

/// Spins until work arrives (true), `spin` passes, or a stop begins.
fn spin_for_work(shared: &Shared, me: &Worker, spin: Duration, start: Instant, st: usize) -> bool {
    me.state.store(SPINNING, SeqCst);
    let mut found = false;
    let mut i: u32 = 0;
    loop {
        if !me.queue.is_empty() {
            found = true;
            break;
        }
        if shared.state() != st {
            break;
        }
        i = i.wrapping_add(1);
        if i % 64 == 0 && start.elapsed() >= spin {
            break;
        }
        spin_loop();
    }
    me.state.store(RUNNING, SeqCst);
    found
}
