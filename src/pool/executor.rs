//! The executor: the pool of workers every dispatcher shares, and its
//! lifecycle.
//!
//! # Lifecycle
//!
//! `Shared::state` holds two flags, only ever set (never cleared):
//! `CLOSED` (nothing new is accepted) and `FORCED` (nothing new starts).
//!
//! Graceful stop, [`KeyedExecutor::shutdown`]:
//! 1. Set `CLOSED`, then wake every parked worker and every submitter
//!    waiting for credit (it leaves with `Closed(msg)`; see `Acquire` in
//!    `source.rs`).
//! 2. From now on a submit is refused with `Closed(msg)`: the flag is read
//!    after the submitter took its unit of credit, so a submit that got in
//!    before is counted in its source's units, which step 3 waits for.
//! 3. Workers keep running everything accepted, suspended futures included
//!    (their wakes still schedule them). A worker that runs out of work checks
//!    whether every source has its units back and no spawned future is
//!    alive; if so it exits, otherwise it parks. A source whose last unit
//!    comes back while `CLOSED` wakes the workers to check again.
//! 4. The caller waits for every worker to exit, up to the timeout, and joins
//!    them. `true` means all accepted work finished and no worker is left.
//!    Called from one of the executor's own workers it cannot wait for itself:
//!    it starts the stop and returns `false`; the workers exit by themselves
//!    once drained.
//!
//! Force stop, [`KeyedExecutor::shutdown_now`] (also what dropping the last
//! `KeyedExecutor` handle does):
//! 1. Set `CLOSED | FORCED`, fence, wake every parked worker and every
//!    submitter waiting for credit.
//! 2. On the calling thread, walk every dispatcher's map: take each mailbox
//!    out, reject its queued messages (through their completion, or the
//!    dispatcher's `on_reject` hook), and cancel a suspended future.
//! 3. On the calling thread, pop every worker queue and cancel what is there.
//! 4. Runners check `FORCED` before starting each message; a step already
//!    running finishes, then its future (if still pending) is cancelled by the
//!    runner. Workers cancel anything they pop, then exit.
//! 5. A wake racing the stop may push a mailbox after step 3: the pusher
//!    fences, sees `FORCED` and cancels what it pushed itself.
//! 6. The caller waits for the workers to exit and joins them (not when
//!    called from a worker).
//!
//! Each accepted message therefore ends exactly once: done, panicked,
//! rejected (handed back) or cancelled.
//!
//! # Work conservation
//!
//! A port and its mailboxes belong to one worker — except that work
//! *waiting* behind a worker stuck in one step (a long handler call or
//! poll, a handler that blocks its thread) runs on an idle one meanwhile:
//!
//! - *Stuck*: a worker is `RUNNING` and the same step (its `steps` count: a
//!   task taken, or a message its port runs in the slot) was first seen at
//!   least 50 µs before a later look (`Worker::look`), by threads that
//!   looked because they had work for it or none of their own. A worker
//!   making progress is never stuck, however busy, so a busy pool keeps
//!   every task where it is (the sticky path costs one relaxed load of
//!   `idle` per task queued, none per delivery to a busy port). A look
//!   that queues work behind a step not yet old enough (`Look::Pending`)
//!   makes sure a later look comes: an idle worker parked with a timeout
//!   looks by itself; if every idle worker sleeps without one, one is
//!   called (`Shared::ensure_watcher`), and parks watching from then on. (The verdict used to be two looks at the
//!   same step: a burst of wake-ups behind one short step made them within
//!   a microsecond, and moved work for nothing.)
//! - Only while some worker is idle (`Shared::idle`, counted around its
//!   spin and park) does anyone but the idle workers look, and only where
//!   a task is queued: `Shared::schedule` (a port's first delivery, a
//!   woken future) puts a task meant for a stuck worker on an idle one
//!   instead, or calls an idle worker after the push (`call_helper`). A
//!   submitter whose port is already queued or running does not look at
//!   its worker: a look reads a line the busy worker writes per step (and
//!   the idle count, one the workers write at each idle period). Its
//!   delivery is found by the idle workers ("Who watches").
//! - An idle worker, before it spins or parks, and whenever called, takes
//!   one task of a stuck worker (the oldest of its run queue, else of its
//!   queue of pushes; `WorkerCx::help`), runs it, and looks again.
//! - What moved runs there for one turn, then goes home: the port's next
//!   task is queued on its own worker again (and moves again only if that
//!   worker is still stuck), and a mailbox that yields or is woken goes to
//!   its port's worker. The running step never moves. (Letting moved work
//!   stay — the port's home following whoever ran it last — was built and
//!   measured: on the slow-key workload the slow key's port then followed
//!   the free worker and took the slow key along, so the two workers kept
//!   swapping which one the slow key blocked; see BENCHMARKS.md.)
//! - *Who watches.* Nobody looks at a step that work is queued behind
//!   except the idle workers, so some idle worker must look again by
//!   itself. An idle worker parks with a timeout (`park_watching`: 100 µs
//!   while some worker runs with work queued, 1.6 ms while others only
//!   run) whenever another worker or a port is active, and without one
//!   (*deep*) only when, counted in `Idle::deep` and after a fence, it
//!   sees every other worker parked with nothing queued and every port
//!   idle. Whoever queues work behind a step — a delivery to a port
//!   already queued or running (including the loser of the port's IDLE →
//!   SCHEDULED race), a task a handler queues on its own worker — reads
//!   `deep` after its push (SeqCst; `deep` has a line of its own, written
//!   only when a worker sleeps deep or is called) and, if it is not zero,
//!   calls a deep sleeper (`ensure_watcher`). Either the sleeper's look
//!   saw the worker or the port active, or the queuer's read comes later
//!   in the SeqCst order than the sleeper's count, so some idle worker
//!   always looks again. The loom models are
//!   `executor_steal::watch_vs_park` and `takeover_vs_submit` (both fail
//!   with the submitter's call removed); the ports half, for two
//!   submitters racing on an idle port, is out of their reach (see
//!   there). (Calling the deep sleeper instead from a worker that takes a
//!   task after swapping `PARKED` in was built: it woke the sleeper at
//!   every wake-up, and tripled an idle pool's CPU; see BENCHMARKS.md.)
//! - A call already pending is not repeated, nor one for the same stuck
//!   step within 50 µs (`Worker::may_call`); a helper looks again by
//!   itself after each task it takes.
//! - *Long steps give way.* Moving work needs a worker that is idle, and
//!   a CPU for it. On a machine with as many busy threads as cores (two
//!   workers and a producer on two cores) the kernel can queue a worker
//!   with work behind the thread running a long step on the same CPU, and
//!   let it wait there for a whole time slice (4–8 ms were measured):
//!   nobody is idle, so nothing moves, and a receiver's credit runs out
//!   meanwhile. So a stretch of a mailbox's turn that ran for
//!   `LONG_STEP_US` (300 µs) or more makes its worker yield its thread
//!   before the next message (`WorkerCx::give_way`, counted in
//!   `WorkerStats::gave_way`). The first stretch begins as the turn's
//!   second message starts (a turn of one message reads no clock), and
//!   the clock is read after the 1st, 2nd, 4th, 8th,
//!   … message of a stretch (a yield begins the next one): a key whose
//!   messages all run long yields after each but its turn's first, a hot
//!   key of short ones pays a few reads a turn. Messages run in a port's
//!   slot (a key with nothing queued) are not timed: that would be a
//!   clock read on every message of the common path. (On the slow-key
//!   workload this took the fast keys' p99 from a median of 11–12 ms to
//!   about 4 ms, near tokio's; see BENCHMARKS.md.)

use std::fmt;
use std::hash::Hash;
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;

use crate::error::ConfigError;
use crate::pool::config::{Builder, Config};
use crate::pool::dispatcher::{Dispatcher, DispatcherBuilder, StopTarget};
use crate::pool::handler::Handler;
use crate::pool::observe::Watch;
use crate::pool::source::{PinnedSource, SourceRef};
use crate::pool::spawn::Spawned;
use crate::pool::stats::{DispatcherStats, ExecutorStats, WorkerState, WorkerStats};
use crate::pool::task::Task;
use crate::pool::worker::{self, Look, Worker, EXITED, PARKED, RUNNING, SPINNING};
use crate::sync::atomic::{fence, AtomicU64, AtomicUsize, Ordering::*};
use crate::sync::{thread, Arc, Condvar, Mutex};
use crate::trace;

const CLOSED: usize = 1;
const FORCED: usize = 2;

struct Registry {
    targets: Vec<Box<dyn StopTarget>>,
    next_id: u64,
    /// Every worker exited: nothing will run again, drop registrations.
    sealed: bool,
}

struct Lifecycle {
    handles: Vec<thread::JoinHandle<()>>,
    started: usize,
    exited: usize,
}

/// A worker counted idle (see [`Shared::idle`]).
pub(crate) struct IdleGuard<'a>(&'a Shared, usize);

impl Drop for IdleGuard<'_> {
    fn drop(&mut self) {
        self.0.idle.count.fetch_sub(1, SeqCst);
        self.0.workers[self.1].set_idle(false);
    }
}

/// A worker counted among those asleep without a timeout (see
/// [`Shared::sleep_deep`]).
pub(crate) struct DeepGuard<'a>(&'a Shared, usize);

impl Drop for DeepGuard<'_> {
    fn drop(&mut self) {
        // Unless a caller uncounted it already (`ensure_watcher`).
        if self.0.workers[self.1].clear_deep() {
            self.0.idle.deep.fetch_sub(1, SeqCst);
        }
    }
}

/// The idle workers, on one line that submitters read (and only idle
/// transitions write).
struct Idle {
    /// Workers spinning or parked (see "Work conservation"): while it is
    /// zero nobody could take work from a stuck worker, and submitters do
    /// not look.
    count: AtomicUsize,
    /// Idle workers that sleep, or are about to, without a timeout and
    /// were not called since (each also marked in its `Worker`; the count
    /// is raised before the mark is set and lowered after it is cleared):
    /// they look at nobody until called. Whoever queues work behind a
    /// running step while this is not zero sees that some idle worker
    /// watches (`Shared::ensure_watcher`); see "Who watches". On a line
    /// of its own: every delivery to a busy port reads it, and `count`
    /// changes at each idle period of each worker.
    deep: CachePadded<AtomicUsize>,
}

/// State shared by the executor's handles, its workers and its dispatchers.
pub(crate) struct Shared {
    pub(crate) config: Config,
    pub(crate) workers: Box<[Worker]>,
    state: CachePadded<AtomicUsize>,
    /// Idle workers, and those of them asleep without a timeout.
    idle: CachePadded<Idle>,
    next_worker: CachePadded<AtomicUsize>,
    registry: Mutex<Registry>,
    lifecycle: Mutex<Lifecycle>,
    lifecycle_cv: Condvar,
    /// `KeyedExecutor` handles; the last one dropped force-stops the pool.
    owners: AtomicUsize,
    pub(crate) rejected: AtomicU64,
    /// Every receiver's credit that is alive (see `credit.rs`).
    sources: Mutex<Vec<SourceRef>>,
    /// Futures spawned through `futures_task::Spawn` (see `spawn.rs`).
    pub(crate) spawned: Spawned,
    /// The slow-step watch and the clock's epoch (see `observe.rs`).
    pub(crate) watch: Watch,
    /// Metrics handles (zero-sized without the `metrics` feature).
    pub(crate) metrics: crate::pool::metrics::ExecutorMetrics,
}

impl Shared {
    /// An identity for this executor (its address), for thread-locals.
    pub(crate) fn id(&self) -> usize {
        self as *const Shared as usize
    }

    #[inline]
    pub(crate) fn state(&self) -> usize {
        self.state.load(SeqCst)
    }

    #[inline]
    pub(crate) fn is_closed(&self) -> bool {
        self.state() & CLOSED != 0
    }

    #[inline]
    pub(crate) fn is_forced(&self) -> bool {
        self.state() & FORCED != 0
    }

    /// Whether a worker that ran out of work should exit.
    pub(crate) fn should_exit(&self, state: usize) -> bool {
        if state & FORCED != 0 {
            return true;
        }
        state & CLOSED != 0 && self.is_drained()
    }

    /// No receiver has a credit unit out (every accepted message finished:
    /// each holds a unit until then) and no spawned future is alive.
    fn is_drained(&self) -> bool {
        let sources_drained = self.sources.lock().iter().all(|s| s.get().in_flight() == 0);
        sources_drained && self.spawned.is_drained()
    }

    /// A receiver's credit is made: count it among the sources.
    pub(crate) fn register_source(&self, source: SourceRef) {
        self.sources.lock().push(source);
    }

    /// The live sources (of dispatcher `dispatcher`, or all), pinned.
    pub(crate) fn sources_of(&self, dispatcher: Option<u64>) -> Vec<PinnedSource> {
        let sources = self.sources.lock();
        sources
            .iter()
            .filter(|s| dispatcher.map_or(true, |d| s.get().dispatcher() == d))
            .filter_map(|s| PinnedSource::new(*s))
            .collect()
    }

    /// A receiver's credit is freed (its word is zero).
    pub(crate) fn deregister_source(&self, source: SourceRef) {
        let mut sources = self.sources.lock();
        if let Some(i) = sources.iter().position(|s| *s == source) {
            sources.swap_remove(i);
        }
        drop(sources);
        self.metrics.source_gone(source);
        // Every source is freed through here once its last unit and handle
        // are gone: a graceful stop may be waiting for that unit.
        self.wake_if_closed();
    }

    /// The worker for a new mailbox: a running one with nothing queued, else
    /// a parked one, else the least loaded (fewest tasks queued, remote and
    /// local; the first such from a rotating start). A handler creating a
    /// mailbox prefers its own worker when that has nothing queued — or,
    /// if its port's turn was moved to this worker, the port's own worker
    /// when that has nothing queued ([`worker::home_for_new_key`]): keys
    /// that message each other then stay on one core (and deliver
    /// directly), instead of landing on another worker merely spinning
    /// for work.
    pub(crate) fn pick_worker(&self) -> usize {
        let n = self.workers.len();
        if n == 1 {
            return 0;
        }
        if let Some(me) = worker::home_for_new_key(self) {
            return me;
        }
        let start = self.next_worker.fetch_add(1, Relaxed) % n;
        let mut parked = None;
        let mut least = (usize::MAX, start);
        for i in 0..n {
            let idx = (start + i) % n;
            let w = &self.workers[idx];
            let load = w.queued();
            match w.state.load(Relaxed) {
                RUNNING | SPINNING if load == 0 => return idx,
                PARKED if parked.is_none() => parked = Some(idx),
                _ if load < least.0 => least = (load, idx),
                _ => {}
            }
        }
        parked.unwrap_or(least.1)
    }

    /// Pushes `task` on `worker`'s queue from any thread, waking the worker
    /// if it sleeps — or on an idle worker's, if `worker` is stuck. Returns
    /// the worker it pushed to.
    #[inline]
    pub(crate) fn schedule(&self, worker: usize, task: Task) -> usize {
        let (worker, seen) = if self.any_idle() {
            self.redirect(worker)
        } else {
            (worker, None)
        };
        self.push(worker, task);
        // After the push and its fence: a worker that went idle meanwhile
        // either sees the task behind a stuck `worker` itself, or is seen
        // here and called to take it. A look made before the push is
        // reused, not repeated: it is a few nanoseconds old, and a look
        // reads the clock (two per wake-up were 3 % of the device thread's
        // time in W3).
        if self.any_idle() {
            self.call_if_stuck(worker, seen);
        }
        worker
    }

    /// Calls an idle worker to help `worker` if it is stuck (and is not
    /// the caller). `seen`: what this schedule's look at it before the
    /// push found, if it made one.
    #[cold]
    fn call_if_stuck(&self, worker: usize, seen: Option<Look>) {
        if worker::current_index(self.id()) == Some(worker) {
            // Queued behind the caller's own step (a handler woke a future
            // of its own worker): the step may go on for long.
            self.ensure_watcher(worker);
            return;
        }
        let look = seen.unwrap_or_else(|| self.workers[worker].look(|| self.now_us()));
        match look {
            Look::Stuck => self.call_helper(worker),
            Look::Pending => self.ensure_watcher(worker),
            Look::No => {}
        }
    }

    /// Whether some worker spins or parks.
    #[inline]
    pub(crate) fn any_idle(&self) -> bool {
        self.idle.count.load(Relaxed) != 0
    }

    /// Whether some idle worker sleeps (or is about to) without a timeout.
    /// SeqCst: one side of the hand-shake in "Who watches".
    #[inline]
    pub(crate) fn any_deep(&self) -> bool {
        self.config.watchers() && self.idle.deep.load(SeqCst) != 0
    }

    /// Counts the caller (an idle worker about to park) among the deep
    /// sleepers until the guard drops, and fences: its look at the other
    /// workers and the ports that follows sees whatever was queued before a
    /// submitter's look at the count missed it (see "Who watches").
    pub(crate) fn sleep_deep(&self, index: usize) -> DeepGuard<'_> {
        self.idle.deep.fetch_add(1, SeqCst);
        self.workers[index].set_deep();
        fence(SeqCst);
        DeepGuard(self, index)
    }

    /// Whether some dispatcher's port is queued or running (not idle): its
    /// turn may get stuck with deliveries behind it.
    pub(crate) fn any_port_busy(&self) -> bool {
        self.registry
            .lock()
            .targets
            .iter()
            .any(|t| t.any_port_busy())
    }

    /// Counts worker `index` (the caller) idle until the guard drops.
    pub(crate) fn idle(&self, index: usize) -> IdleGuard<'_> {
        self.workers[index].set_idle(true);
        self.idle.count.fetch_add(1, SeqCst);
        // Against a submitter's push, fence, look at `idle`: it sees this
        // worker idle, or this worker's look (which follows) sees its push.
        fence(SeqCst);
        IdleGuard(self, index)
    }

    /// A takeover of the turn of a port whose worker `stuck` runs it with
    /// deliveries waiting (any dispatcher's), if there is one.
    #[cold]
    pub(crate) fn takeover(&self, stuck: usize) -> Option<Task> {
        // Out of the registry's lock: a look takes ports' gates.
        let targets: Vec<Box<dyn StopTarget>> = {
            let registry = self.registry.lock();
            registry.targets.iter().map(|t| t.clone_box()).collect()
        };
        targets.iter().find_map(|t| t.takeover(stuck))
    }

    /// Where a task meant for `worker` should go: an idle worker if
    /// `worker` is stuck in a step (and the caller is not `worker` itself,
    /// which is not stuck if it runs this), else `worker`; with what the
    /// look at `worker` found (none if the task goes elsewhere).
    #[cold]
    fn redirect(&self, worker: usize) -> (usize, Option<Look>) {
        if worker::current_index(self.id()) == Some(worker) {
            return (worker, Some(Look::No));
        }
        match self.workers[worker].look(|| self.now_us()) {
            Look::Stuck => match self.idle_worker(worker) {
                Some(i) => (i, None),
                None => (worker, Some(Look::Stuck)),
            },
            look => (worker, Some(look)),
        }
    }

    /// An idle worker other than `not` (one not parked first: it needs no
    /// wake-up).
    pub(crate) fn idle_worker(&self, not: usize) -> Option<usize> {
        let mut parked = None;
        for (i, w) in self.workers.iter().enumerate() {
            if i == not || !w.is_idle() {
                continue;
            }
            match w.state.load(Relaxed) {
                PARKED => parked = parked.or(Some(i)),
                _ => return Some(i),
            }
        }
        parked
    }

    /// Microseconds since the executor's epoch (wrapping): the clock of
    /// stuck verdicts and helper calls.
    #[inline]
    pub(crate) fn now_us(&self) -> u32 {
        #[cfg(not(loom))]
        return self.watch.epoch().elapsed().as_micros() as u32;
        #[cfg(loom)]
        0
    }

    /// Work was queued behind `busy`'s step (seen, but not yet for long
    /// enough to call it stuck, or not looked at): a later look must come
    /// even if no submitter does. An idle worker parked with a timeout,
    /// spinning or on its way to park looks by itself; if
    /// every idle one sleeps without a timeout, one is called, and parks
    /// watching from then on while some worker is active (see "Who
    /// watches"). (Without this, a future woken behind a blocked step
    /// waited for good: the one look at it came before the step was old
    /// enough.)
    #[inline]
    pub(crate) fn ensure_watcher(&self, busy: usize) {
        // No deep sleeper (the count is at least the marks): every idle
        // worker looks again by itself.
        if self.any_deep() {
            self.call_deep_sleeper(busy);
        }
    }

    /// [`ensure_watcher`](Self::ensure_watcher) with a deep sleeper
    /// counted: calls one, unless another idle worker (not `busy`) looks
    /// again by itself.
    #[cold]
    fn call_deep_sleeper(&self, busy: usize) {
        let mut watched = false;
        let mut sleeper = None;
        for (i, w) in self.workers.iter().enumerate() {
            if i == busy || !w.is_idle() {
                continue;
            }
            if w.is_deep() {
                sleeper = sleeper.or(Some(i));
            } else {
                // Spinning, settling, watching or about to look at
                // the others before it parks: it looks again.
                watched = true;
            }
        }
        if let (false, Some(i)) = (watched, sleeper) {
            // Uncounted here, by the one caller that clears its mark:
            // the submitters after this one see no deep sleeper and
            // call nobody (the called worker watches from now on).
            if self.workers[i].clear_deep() {
                self.idle.deep.fetch_sub(1, SeqCst);
                self.workers[i].call();
            }
        }
    }

    /// `stuck` is stuck with work queued behind its step: call an idle
    /// worker to take it.
    #[cold]
    pub(crate) fn call_helper(&self, stuck: usize) {
        // A call already pending is not repeated (`Worker::call`), nor one
        // made for the same step less than `CALL_INTERVAL` ago: a helper
        // that found nothing to take when called would otherwise be woken
        // by every submit (a futex wake-up each: it starved the producer
        // of the slow-key workload). A call swallowed that way is made by
        // the next submitter after the interval, and a parked helper
        // watching an active worker looks again within `WATCH_PARK_MAX`.
        if let Some(i) = self.idle_worker(stuck) {
            #[cfg(not(loom))]
            {
                let now = self.now_us();
                if !self.workers[stuck].may_call(now) {
                    return;
                }
            }
            self.workers[i].call();
        }
    }

    /// Pushes `task` on `worker`'s queue and wakes it if it sleeps (no
    /// redirection).
    pub(crate) fn push(&self, worker: usize, task: Task) {
        let w = &self.workers[worker];
        w.queue.push(task);
        fence(SeqCst);
        w.wake_if_parked();
        if self.is_forced() || w.state.load(SeqCst) == EXITED {
            // The stop may already have emptied this queue and the worker may
            // be gone (a force stop, or the end of a graceful one, which a
            // task sent home by work conservation can meet): cancel what we
            // pushed ourselves.
            self.cancel_queue(worker);
        }
    }

    fn cancel_queue(&self, worker: usize) {
        while let Some(task) = self.workers[worker].queue.pop() {
            task.cancel();
        }
    }

    fn wake_all(&self) {
        fence(SeqCst);
        for w in self.workers.iter() {
            w.wake_if_parked();
        }
    }

    /// Something that a graceful stop waits for ended (a source's last
    /// unit came back, a spawned future finished): workers re-check whether
    /// everything drained.
    pub(crate) fn wake_if_closed(&self) {
        // Dekker against `close` (flag, fence, look at the workers) and a
        // worker's park (PARKED, fence, look at the flag and the credit):
        // the caller's release is ordered before this look at the flag.
        fence(SeqCst);
        if self.is_closed() {
            self.wake_all();
        }
    }

    fn close(&self) {
        self.state.fetch_or(CLOSED, SeqCst);
        self.wake_all();
        self.release_waiters();
    }

    /// After a stop set `CLOSED`: every submitter waiting for credit (or
    /// for a commit span) leaves with `Closed(its message)` instead of
    /// waiting for a unit (see `Acquire` in `source.rs`). A source
    /// registered after this look is made after the flag, and its first
    /// waiter sees it.
    fn release_waiters(&self) {
        let waiting: Vec<PinnedSource> = {
            // The list keeps its sources alive while it is locked; those
            // with waiters are pinned to be woken outside the lock (a
            // waker is user code).
            let sources = self.sources.lock();
            fence(SeqCst);
            sources
                .iter()
                .filter(|s| s.get().has_waiters())
                .filter_map(|s| PinnedSource::new(*s))
                .collect()
        };
        for source in waiting {
            source.wake_all_waiters();
        }
    }

    fn force(&self) {
        // Set the flag and snapshot the dispatchers under the registry lock:
        // the last worker to exit empties the registry (under the same lock),
        // and workers exit as soon as they see FORCED, so a snapshot taken
        // after the flag could miss dispatchers whose mailboxes still hold
        // queued messages or suspended futures.
        let targets: Vec<Box<dyn StopTarget>> = {
            let reg = self.registry.lock();
            self.state.fetch_or(CLOSED | FORCED, SeqCst);
            reg.targets.iter().map(|t| t.clone_box()).collect()
        };
        self.wake_all();
        self.release_waiters();
        let mut rejected = 0;
        for t in &targets {
            rejected += t.force_drain();
        }
        drop(targets);
        let cancelled_spawned = self.spawned.force_cancel();
        trace::force_stopped(rejected, cancelled_spawned);
        self.metrics.refresh_gauges();
        for i in 0..self.workers.len() {
            self.cancel_queue(i);
        }
    }

    /// A worker is up (its `on_thread_start` hook ran).
    pub(crate) fn worker_started(&self) {
        let mut lc = self.lifecycle.lock();
        lc.started += 1;
        self.lifecycle_cv.notify_all();
    }

    /// Waits until `n` workers started or exited.
    fn wait_started(&self, n: usize) {
        let mut lc = self.lifecycle.lock();
        while lc.started + lc.exited < n {
            lc = self.lifecycle_cv.wait(lc);
        }
    }

    pub(crate) fn worker_exited(&self) {
        let sealed = {
            let mut lc = self.lifecycle.lock();
            lc.exited += 1;
            let last = lc.exited == self.workers.len();
            self.lifecycle_cv.notify_all();
            last
        };
        if sealed {
            // Nothing runs any more: drop the registrations (they hold the
            // dispatchers, which hold this `Shared`) outside the lock.
            let targets = {
                let mut reg = self.registry.lock();
                reg.sealed = true;
                std::mem::take(&mut reg.targets)
            };
            for t in &targets {
                t.release_spares();
            }
            drop(targets);
        }
    }

    /// Waits for every worker to exit (until `deadline`), then joins them.
    fn wait_workers(&self, deadline: Option<Instant>) -> bool {
        let mut lc = self.lifecycle.lock();
        while lc.exited < self.workers.len() {
            match deadline {
                None => lc = self.lifecycle_cv.wait(lc),
                Some(d) => {
                    let now = Instant::now();
                    if now >= d {
                        return false;
                    }
                    lc = self.lifecycle_cv.wait_timeout(lc, d - now).0;
                }
            }
        }
        let handles = std::mem::take(&mut lc.handles);
        drop(lc);
        for h in handles {
            let _ = h.join();
        }
        true
    }

    pub(crate) fn next_dispatcher_id(&self) -> u64 {
        let mut reg = self.registry.lock();
        reg.next_id += 1;
        reg.next_id
    }

    pub(crate) fn register(&self, target: Box<dyn StopTarget>) {
        let mut reg = self.registry.lock();
        if reg.sealed {
            drop(reg);
            drop(target);
            return;
        }
        reg.targets.push(target);
    }

    /// Drops the registration of a dispatcher nobody holds once nothing of
    /// it is in flight (its spare mailboxes, which hold it, are freed).
    pub(crate) fn deregister_if_idle(&self, id: u64) {
        let removed = {
            let mut reg = self.registry.lock();
            match reg.targets.iter().position(|t| t.id() == id) {
                Some(i) if reg.targets[i].is_quiet() => Some(reg.targets.swap_remove(i)),
                _ => None,
            }
        };
        if let Some(t) = removed {
            t.release_spares();
        }
    }

    /// The registered dispatchers, cloned out of the registry.
    pub(crate) fn targets(&self) -> Vec<Box<dyn StopTarget>> {
        let reg = self.registry.lock();
        reg.targets.iter().map(|t| t.clone_box()).collect()
    }

    fn stats(&self) -> ExecutorStats {
        let targets = self.targets();
        self.metrics.refresh_gauges();
        let workers: Vec<WorkerStats> = self
            .workers
            .iter()
            .enumerate()
            .map(|(i, w)| {
                let c = &w.counters;
                WorkerStats {
                    state: match w.state.load(Relaxed) {
                        RUNNING => WorkerState::Running,
                        SPINNING => WorkerState::Spinning,
                        PARKED => WorkerState::Parked,
                        _ => WorkerState::Exited,
                    },
                    queued_tasks: w.queued(),
                    inbox: targets.iter().map(|t| t.inbox_len(i)).sum(),
                    done: c.done.load(Relaxed),
                    panicked: c.panicked.load(Relaxed),
                    cancelled: c.cancelled.load(Relaxed),
                    retried: c.retried.load(Relaxed),
                    dead_lettered: c.dead_lettered.load(Relaxed),
                    expired: c.expired.load(Relaxed),
                    parks: c.parks.load(Relaxed),
                    unparks: c.unparks.load(Relaxed),
                    spin_hits: c.spin_hits.load(Relaxed),
                    gave_way: c.gave_way.load(Relaxed),
                    current_step: self.watch.current_step(self, i, &targets),
                }
            })
            .collect();
        let dispatchers: Vec<DispatcherStats> = targets
            .iter()
            .map(|t| {
                let (live, idle, _) = t.count_mailboxes();
                DispatcherStats {
                    name: t.ident().name.to_string(),
                    live_mailboxes: live,
                    idle_mailboxes: idle,
                    inbox: (0..self.workers.len()).map(|i| t.inbox_len(i)).sum(),
                }
            })
            .collect();
        let live_mailboxes = dispatchers.iter().map(|d| d.live_mailboxes).sum();
        let idle_mailboxes = dispatchers.iter().map(|d| d.idle_mailboxes).sum();
        ExecutorStats {
            spawned: self.spawned.stats(),
            done: workers.iter().map(|w| w.done).sum(),
            panicked: workers.iter().map(|w| w.panicked).sum(),
            cancelled: workers.iter().map(|w| w.cancelled).sum(),
            retried: workers.iter().map(|w| w.retried).sum(),
            dead_lettered: workers.iter().map(|w| w.dead_lettered).sum(),
            expired: workers.iter().map(|w| w.expired).sum(),
            rejected: self.rejected.load(Relaxed),
            live_mailboxes,
            idle_mailboxes,
            closed: self.is_closed(),
            workers,
            dispatchers,
        }
    }
}

impl Builder {
    /// Validates the settings and starts the workers.
    ///
    /// # Errors
    /// [`ConfigError`] naming the bad setting: zero workers, zero throughput,
    /// a spin above [`MAX_SPIN`](crate::MAX_SPIN), a thread name with a NUL byte, or the OS
    /// refusing to start a thread.
    pub fn build(self) -> Result<KeyedExecutor, ConfigError> {
        let config = self.validate()?;
        KeyedExecutor::start(config)
    }
}

/// A pool of worker threads that runs, for every key, its messages one at a
/// time and in arrival order, and different keys in parallel.
///
/// Create one per process (or per runtime) with [`KeyedExecutor::builder`],
/// then one [`Dispatcher`] per handler. All dispatchers share the same
/// workers: never a thread per key, per dispatcher or per type.
///
/// The handle is cheap to clone. The pool lives until [`shutdown`]
/// (graceful) or [`shutdown_now`] (force), or until the last
/// `KeyedExecutor` handle is dropped, which force-stops it and joins its
/// threads: queued messages are handed back as rejected and suspended
/// futures cancelled. Dispatchers and receivers do not keep it alive.
///
/// It also implements [`futures_task::Spawn`]: `futures::task::SpawnExt`'s
/// `spawn` and `spawn_with_handle` run unkeyed futures on the same workers
/// (see the impl's docs for how they take part in shutdown).
///
/// [`shutdown`]: KeyedExecutor::shutdown
/// [`shutdown_now`]: KeyedExecutor::shutdown_now
///
/// ```
/// use std::time::Duration;
/// use keyed_executor::{handler, KeyedExecutor};
///
/// let executor = KeyedExecutor::builder().workers(2).build()?;
/// let dispatcher = executor.dispatcher(handler::from_fn(|key: &u64, cmd: u32| (*key, cmd)));
/// let receiver = dispatcher.receiver(256)?;
/// let handles: Vec<_> = (0..10)
///     .map(|i| receiver.submit_blocking(i % 3, i as u32))
///     .collect::<Result<_, _>>()?;
/// for h in handles {
///     h.wait()?;
/// }
/// assert!(executor.shutdown(Duration::from_secs(5)));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct KeyedExecutor {
    shared: Arc<Shared>,
}

impl KeyedExecutor {
    /// A builder with the default settings.
    pub fn builder() -> Builder {
        Builder::new()
    }

    /// An executor with the default settings (see [`Builder`]).
    ///
    /// # Errors
    /// If a worker thread cannot be started.
    pub fn new() -> Result<Self, ConfigError> {
        Builder::new().build()
    }

    pub(crate) fn start(config: Config) -> Result<Self, ConfigError> {
        let n = config.workers;
        let watch = Watch::new(config.slow_step, n);
        let metrics = crate::pool::metrics::ExecutorMetrics::new(&config, watch.epoch());
        let shared = Arc::new(Shared {
            workers: (0..n).map(|_| Worker::new()).collect(),
            config,
            state: CachePadded::new(AtomicUsize::new(0)),
            idle: CachePadded::new(Idle {
                count: AtomicUsize::new(0),
                deep: CachePadded::new(AtomicUsize::new(0)),
            }),
            next_worker: CachePadded::new(AtomicUsize::new(0)),
            registry: Mutex::new(Registry {
                targets: Vec::new(),
                next_id: 0,
                sealed: false,
            }),
            lifecycle: Mutex::new(Lifecycle {
                handles: Vec::with_capacity(n),
                started: 0,
                exited: 0,
            }),
            lifecycle_cv: Condvar::new(),
            owners: AtomicUsize::new(1),
            rejected: AtomicU64::new(0),
            sources: Mutex::new(Vec::new()),
            spawned: Spawned::new(),
            watch,
            metrics,
        });
        let executor = KeyedExecutor {
            shared: shared.clone(),
        };
        for i in 0..n {
            let name = format!("{}-{}", shared.config.thread_name, i);
            let mut b = thread::Builder::new().name(name.clone());
            if let Some(size) = shared.config.stack_size {
                b = b.stack_size(size);
            }
            let s = shared.clone();
            match b.spawn(move || worker::run(s, i)) {
                Ok(h) => shared.lifecycle.lock().handles.push(h),
                Err(e) => {
                    // Count the workers that never started as exited, then
                    // stop the ones that did (dropping `executor` does that).
                    for j in i..n {
                        shared.workers[j].state.store(EXITED, SeqCst);
                        shared.worker_exited();
                    }
                    drop(executor);
                    return Err(ConfigError::Spawn {
                        name,
                        reason: e.to_string(),
                    });
                }
            }
        }
        // Return only once every worker runs (and its start hook ran), so a
        // caller sees the whole pool.
        shared.wait_started(n);
        Ok(executor)
    }

    pub(crate) fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// A dispatcher running `handler` on this executor's workers, with the
    /// default settings (see [`dispatcher_builder`](Self::dispatcher_builder)
    /// for hooks and a custom hasher).
    pub fn dispatcher<K, M, H>(&self, handler: H) -> Dispatcher<K, M, H::Output>
    where
        K: Hash + Eq + Clone + Send + Sync + 'static,
        M: Send + 'static,
        H: Handler<K, M>,
    {
        DispatcherBuilder::new(self, handler).build()
    }

    /// A builder for a dispatcher running `handler`, to set its hooks or
    /// hasher.
    pub fn dispatcher_builder<K, M, H>(&self, handler: H) -> DispatcherBuilder<'_, K, M, H>
    where
        K: Hash + Eq + Clone + Send + Sync + 'static,
        M: Send + 'static,
        H: Handler<K, M>,
    {
        DispatcherBuilder::new(self, handler)
    }

    /// Number of worker threads.
    pub fn workers(&self) -> usize {
        self.shared.workers.len()
    }

    /// Graceful stop: refuse new messages (handing them back as
    /// `Closed(msg)`), run everything already accepted — suspended futures
    /// included — and join the workers.
    ///
    /// Returns `true` if all of that finished within `timeout`, `false` if the
    /// timeout passed first; the stop then goes on in the background, and a
    /// later `shutdown` can wait again, or [`shutdown_now`](Self::shutdown_now)
    /// can force it. Called from inside a handler (on one of this executor's
    /// workers) it cannot wait for its own work: it starts the stop and
    /// returns `false` at once.
    pub fn shutdown(&self, timeout: Duration) -> bool {
        self.shared.close();
        if worker::on_worker_of(self.shared.id()) {
            return false;
        }
        let start = Instant::now();
        let drained = self.shared.wait_workers(start.checked_add(timeout));
        if drained {
            trace::shutdown_finished(start.elapsed(), timeout);
        } else if trace::wants_shutdown_details() {
            let stats = self.shared.stats();
            trace::shutdown_timed_out(timeout, stats.live_mailboxes, stats.spawned.live);
        }
        drained
    }

    /// Force stop. Idempotent.
    ///
    /// No mailbox starts another message. Messages still queued are rejected
    /// **on the calling thread** and handed back: through their completion
    /// ([`TaskError::Rejected`](crate::TaskError::Rejected)), or the
    /// dispatcher's [`on_reject`](crate::DispatcherBuilder::on_reject) hook for
    /// fire-and-forget sends. Suspended futures are dropped and their
    /// completions say [`Cancelled`](crate::TaskError::Cancelled). A handler
    /// already running finishes its current step (one poll), then the
    /// workers exit; this call waits for that and joins them, except when
    /// called from one of this executor's workers.
    pub fn shutdown_now(&self) {
        self.shared.force();
        if !worker::on_worker_of(self.shared.id()) {
            self.shared.wait_workers(None);
        }
    }

    /// Whether a stop began (new messages are refused).
    pub fn is_shutdown(&self) -> bool {
        self.shared.is_closed()
    }

    /// Whether every worker thread has exited.
    pub fn is_terminated(&self) -> bool {
        self.shared.lifecycle.lock().exited == self.shared.workers.len()
    }

    /// A snapshot of the executor's counters and worker states. Cheap enough
    /// to poll (it briefly locks each dispatcher's shards to count mailboxes).
    pub fn stats(&self) -> ExecutorStats {
        self.shared.stats()
    }
}

impl Clone for KeyedExecutor {
    fn clone(&self) -> Self {
        self.shared.owners.fetch_add(1, Relaxed);
        KeyedExecutor {
            shared: self.shared.clone(),
        }
    }
}

impl Drop for KeyedExecutor {
    /// Dropping the last handle force-stops the pool and joins its workers
    /// (see [`shutdown_now`](KeyedExecutor::shutdown_now)), so no thread is
    /// left behind.
    fn drop(&mut self) {
        if self.shared.owners.fetch_sub(1, AcqRel) == 1 {
            self.shutdown_now();
        }
    }
}

impl fmt::Debug for KeyedExecutor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KeyedExecutor")
            .field("workers", &self.workers())
            .field("throughput", &self.shared.config.throughput)
            .field("spin", &self.shared.config.spin)
            .field("thread_name", &self.shared.config.thread_name)
            .field("shutdown", &self.is_shutdown())
            .finish()
    }
}
