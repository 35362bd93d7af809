//! `Shared`: the state every part of the pool reaches — the workers, the
//! lifecycle flags, the dispatcher registry, the live sources, the idle
//! workers (whose protocol is `conserve/`). What the registry needs of a
//! dispatcher, `StopTarget`, is declared here and implemented by the
//! dispatcher, so `shared` does not import it.

use std::time::Instant;

use crossbeam_utils::CachePadded;

use crate::pool::config::Config;
use crate::pool::conserve::Idle;
use crate::pool::observe::{Identity, SlowSteps};
use crate::pool::source::{SourceGuard, SourceRef};
use crate::pool::spawn::Spawned;
use crate::pool::stats::{DispatcherStats, ExecutorStats, WorkerState, WorkerStats};
use crate::pool::task::Task;
use crate::pool::worker::{Worker, WorkerCx};
use crate::sync::atomic::{fence, AtomicU64, AtomicUsize, Ordering::*};
use crate::sync::{thread, Condvar, Mutex};
use crate::trace;

/// What the executor needs from every dispatcher, whatever its types: the
/// registry's entries, implemented in `dispatcher/erased.rs`.
pub(crate) trait StopTarget: Send + Sync + 'static {
    /// Force stop: take every mailbox out of its port, reject its queue on
    /// this thread and cancel its suspended future.
    fn force_drain(&self) -> usize;
    /// (mailboxes with work, idle mailboxes kept for reuse, map entries).
    fn count_mailboxes(&self) -> (usize, usize, usize);
    /// Messages in the inboxes of this dispatcher's ports homed on worker
    /// `worker`.
    fn inbox_len(&self, worker: usize) -> usize;
    /// Whether one of its ports whose turn runs on a worker other than
    /// `me` has deliveries waiting in its inbox (a backlog `me` cannot take).
    fn backlog_beside(&self, me: usize) -> bool;
    /// Nothing of the dispatcher is in flight (see `is_quiet`).
    fn is_quiet(&self) -> bool;
    /// Frees its spare mailboxes (it is leaving the registry).
    fn release_spares(&self);
    /// A steal of the turn of a port whose worker `stuck` runs its turn with
    /// deliveries waiting (see "Stealing a turn" in `dispatcher/port.rs`).
    fn steal_turn(&self, stuck: usize) -> Option<Task>;
    /// Worker `cx` (idle) takes a slice of the backlog of a port whose
    /// turn runs on another worker (see `dispatcher/slice.rs`); true if it did.
    fn steal_slice(&self, cx: &WorkerCx<'_>) -> bool;
    /// Whether one of its ports is queued or running (SeqCst loads; see
    /// "Why no wake-up is lost" in `conserve/mod.rs`).
    fn any_port_busy(&self) -> bool;
    fn id(&self) -> u64;
    /// Its name and metrics handles.
    fn ident(&self) -> &Identity;
    fn clone_box(&self) -> Box<dyn StopTarget>;
}

pub(crate) struct Registry {
    pub(crate) targets: Vec<Box<dyn StopTarget>>,
    next_id: u64,
    /// Every worker exited: nothing will run again, drop registrations.
    sealed: bool,
}

pub(super) struct Lifecycle {
    pub(super) handles: Vec<thread::JoinHandle<()>>,
    started: usize,
    pub(super) exited: usize,
}

/// State shared by the executor's handles, its workers and its dispatchers.
pub(crate) struct Shared {
    pub(crate) config: Config,
    pub(crate) workers: Box<[Worker]>,
    state: CachePadded<AtomicUsize>,
    /// Idle workers, and those of them asleep without a timeout.
    pub(crate) idle: CachePadded<Idle>,
    next_worker: CachePadded<AtomicUsize>,
    pub(crate) registry: Mutex<Registry>,
    pub(super) lifecycle: Mutex<Lifecycle>,
    lifecycle_cv: Condvar,
    /// `KeyedExecutor` handles; the last one dropped force-stops the pool.
    pub(super) owners: AtomicUsize,
    pub(crate) rejected: AtomicU64,
    /// Every source that is alive (see `source/mod.rs`).
    sources: Mutex<Vec<SourceRef>>,
    /// Futures spawned through `futures_task::Spawn` (see `spawn.rs`).
    pub(crate) spawned: Spawned,
    /// The slow-step report and the clock's epoch (see `observe.rs`).
    pub(crate) slow_steps: SlowSteps,
    /// Metrics handles (zero-sized without the `metrics` feature).
    pub(crate) metrics: crate::pool::metrics::ExecutorMetrics,
}

impl Shared {
    /// In `state`: nothing new is accepted. Only ever set.
    const CLOSED: usize = 1;
    /// In `state`: nothing new starts (a force stop). Only ever set, with
    /// `CLOSED`.
    const FORCED: usize = 2;

    /// The state of a new executor of `config`: no worker started yet,
    /// one `KeyedExecutor` handle.
    pub(crate) fn new(config: Config) -> Self {
        let n = config.workers;
        let slow_steps = SlowSteps::new(config.slow_step, n);
        let metrics = crate::pool::metrics::ExecutorMetrics::new(&config, slow_steps.epoch());
        Shared {
            workers: (0..n).map(|_| Worker::new()).collect(),
            config,
            state: CachePadded::new(AtomicUsize::new(0)),
            idle: CachePadded::new(Idle {
                count: AtomicUsize::new(0),
                sleepers: CachePadded::new(AtomicUsize::new(0)),
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
            slow_steps,
            metrics,
        }
    }

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
        self.state() & Self::CLOSED != 0
    }

    #[inline]
    pub(crate) fn is_forced(&self) -> bool {
        self.state() & Self::FORCED != 0
    }

    /// Whether a worker that ran out of work should exit.
    pub(crate) fn should_exit(&self, state: usize) -> bool {
        if state & Self::FORCED != 0 {
            return true;
        }
        state & Self::CLOSED != 0 && self.is_drained()
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

    /// The live sources (of dispatcher `dispatcher`, or all), each held by a `SourceGuard`.
    pub(crate) fn sources_of(&self, dispatcher: Option<u64>) -> Vec<SourceGuard> {
        let sources = self.sources.lock();
        sources
            .iter()
            .filter(|s| dispatcher.map_or(true, |d| s.get().dispatcher() == d))
            .filter_map(|s| SourceGuard::new(*s))
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

    /// The worker for a spawned future (it has no key): the spawning
    /// worker, if a worker of this executor spawns it; else a running one
    /// with nothing queued, else a parked one, else the least loaded
    /// (fewest tasks queued, remote and local; the first such from a
    /// rotating start).
    pub(crate) fn pick_worker(&self) -> usize {
        let n = self.workers.len();
        if n == 1 {
            return 0;
        }
        if let Some(Some(me)) = WorkerCx::with_current(|cx| cx.is_of(self.id()).then_some(cx.index))
        {
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
                Worker::RUNNING | Worker::SPINNING if load == 0 => return idx,
                Worker::PARKED if parked.is_none() => parked = Some(idx),
                _ if load < least.0 => least = (load, idx),
                _ => {}
            }
        }
        parked.unwrap_or(least.1)
    }

    /// Pushes `task` on `worker`'s queue and wakes it if it sleeps (no
    /// redirection).
    pub(crate) fn push(&self, worker: usize, task: Task) {
        let w = &self.workers[worker];
        w.queue.push(task);
        fence(SeqCst);
        w.wake_if_parked();
        if self.is_forced() || w.state.load(SeqCst) == Worker::EXITED {
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

    pub(super) fn close(&self) {
        self.state.fetch_or(Self::CLOSED, SeqCst);
        self.wake_all();
        self.release_waiters();
    }

    /// After a stop set `CLOSED`: every submitter waiting for credit (or
    /// for a commit span) leaves with `Closed(its message)` instead of
    /// waiting for a unit (see `Acquire` in `source/credit.rs`). A source
    /// registered after this look is made after the flag, and its first
    /// waiter sees it.
    fn release_waiters(&self) {
        let waiting: Vec<SourceGuard> = {
            // The list keeps its sources alive while it is locked; those
            // with waiters are guarded to be woken outside the lock (a
            // waker is user code).
            let sources = self.sources.lock();
            fence(SeqCst);
            sources
                .iter()
                .filter(|s| s.get().has_waiters())
                .filter_map(|s| SourceGuard::new(*s))
                .collect()
        };
        for source in waiting {
            source.wake_all_waiters();
        }
    }

    pub(super) fn force(&self) {
        // Set the flag and snapshot the dispatchers under the registry lock:
        // the last worker to exit empties the registry (under the same lock),
        // and workers exit as soon as they see FORCED, so a snapshot taken
        // after the flag could miss dispatchers whose mailboxes still hold
        // queued messages or suspended futures.
        let targets: Vec<Box<dyn StopTarget>> = {
            let reg = self.registry.lock();
            self.state.fetch_or(Self::CLOSED | Self::FORCED, SeqCst);
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
    pub(super) fn wait_started(&self, n: usize) {
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
    pub(super) fn wait_workers(&self, deadline: Option<Instant>) -> bool {
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

    pub(super) fn stats(&self) -> ExecutorStats {
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
                        Worker::RUNNING => WorkerState::Running,
                        Worker::SPINNING => WorkerState::Spinning,
                        Worker::PARKED => WorkerState::Parked,
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
                    stolen: c.stolen.load(Relaxed),
                    parked_beside_work: c.parked_beside_work.load(Relaxed),
                    idle_beside_work: std::time::Duration::from_micros(
                        c.idle_beside_work_us.load(Relaxed),
                    ),
                    current_step: self.slow_steps.current_step(self, i, &targets),
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
