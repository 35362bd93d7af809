//! The state every handle, caller and closer of one `Lanes` shares: the
//! kernel, the settings and hooks, the counters, and the map from key to
//! live lane (sharded, each shard under its own mutex).
//!
//! Lock order: shard, then lane. The close waiters' mutex is taken alone.
//! A lane is removed from its shard in the same critical section that found
//! it empty (see invariant 4 in `lane.rs`), so a caller never queues into a
//! dead lane unnoticed.

use std::collections::hash_map::{HashMap, RandomState};
use std::error::Error;
use std::hash::BuildHasher;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::task::{Context, Poll, Waker};
use std::time::Instant;

use super::accounts::{Accounts, Refused};
use super::clock::Clock;
use super::error::{BusyReason, LaneError};
use super::event::LanesEvent;
use super::fatal::NodeFatals;
use super::kernel::Kernel;
use super::lane::{After, BatchFuture, Driver, Enter, Finished, Lane, TicketId};
use crate::error::Panic;
use crate::sync::{Arc, Mutex, MutexGuard};

/// Shards of the key map (one under loom, to keep models small).
#[cfg(not(loom))]
const SHARDS: usize = 16;
#[cfg(loom)]
const SHARDS: usize = 1;

/// The commit hook's type.
pub(crate) type CommitHook<K> = dyn Fn(
        &<K as Kernel>::Key,
        &[Result<<K as Kernel>::Output, <K as Kernel>::Error>],
    ) -> Result<(), Box<dyn Error + Send + Sync>>
    + Send
    + Sync;

/// The classifier: `Some(description)` if the error is fatal.
pub(crate) type Classifier<K> = dyn Fn(&<K as Kernel>::Error) -> Option<String> + Send + Sync;

/// The event hook's type.
pub(crate) type EventHook<K> = dyn Fn(&LanesEvent<'_, <K as Kernel>::Key>) + Send + Sync;

/// A caller's place: its lane and its ticket there.
pub(crate) type Entered<K> = (Arc<Lane<K>>, TicketId);

type Shard<K> = Mutex<HashMap<<K as Kernel>::Key, Arc<Lane<K>>>>;

pub(crate) struct Shared<K: Kernel> {
    /// In its own `Arc` so batch futures can own it without a cycle through
    /// the lanes that store them.
    pub(crate) kernel: Arc<K>,
    pub(crate) lane_capacity: usize,
    pub(crate) max_batch: usize,
    pub(crate) accounts: Accounts,
    pub(crate) clock: Box<dyn Clock>,
    pub(crate) classifier: Option<Box<Classifier<K>>>,
    pub(crate) fatals: NodeFatals,
    pub(crate) on_commit: Option<Box<CommitHook<K>>>,
    pub(crate) on_event: Option<Box<EventHook<K>>>,
    /// Its name (the `lanes` label of its metrics series).
    pub(crate) name: Box<str>,
    /// Metrics handles (zero-sized without the `metrics` feature).
    pub(crate) metrics: crate::lanes::metrics::LanesMetrics,
    shards: Box<[Shard<K>]>,
    hasher: RandomState,
    /// Wakers of pending `close` futures: woken when the count drains to
    /// zero, or a batch is orphaned, while closed.
    close_waiters: Mutex<Vec<Waker>>,
}

/// Gives back one entered command's count when dropped (see `enter`).
struct Uncount<'a, K: Kernel>(&'a Shared<K>);

impl<K: Kernel> Drop for Uncount<'_, K> {
    fn drop(&mut self) {
        if self.0.accounts.release(1) {
            self.0.wake_closers();
        }
    }
}

/// What driving a batch future for one poll came to.
#[must_use]
pub(crate) enum Driven {
    /// Still running; the future is back in the lane.
    Pending,
    /// Finished; outcomes delivered.
    Finished,
}

pub(crate) struct Settings<K: Kernel> {
    pub(crate) kernel: K,
    pub(crate) lane_capacity: usize,
    pub(crate) max_batch: usize,
    pub(crate) accounts: Accounts,
    pub(crate) clock: Box<dyn Clock>,
    pub(crate) classifier: Option<Box<Classifier<K>>>,
    pub(crate) fatals: NodeFatals,
    pub(crate) on_commit: Option<Box<CommitHook<K>>>,
    pub(crate) on_event: Option<Box<EventHook<K>>>,
    pub(crate) name: String,
}

impl<K: Kernel> Shared<K> {
    pub(crate) fn new(s: Settings<K>) -> Self {
        Shared {
            kernel: Arc::new(s.kernel),
            lane_capacity: s.lane_capacity,
            max_batch: s.max_batch,
            accounts: s.accounts,
            clock: s.clock,
            classifier: s.classifier,
            fatals: s.fatals,
            on_commit: s.on_commit,
            on_event: s.on_event,
            metrics: crate::lanes::metrics::LanesMetrics::new(&s.name),
            name: s.name.into_boxed_str(),
            shards: (0..SHARDS).map(|_| Mutex::new(HashMap::new())).collect(),
            hasher: RandomState::new(),
            close_waiters: Mutex::new(Vec::new()),
        }
    }

    pub(crate) fn now(&self) -> Instant {
        self.clock.now()
    }

    // Under loom there is one shard (`% 1`).
    #[cfg_attr(loom, allow(clippy::modulo_one))]
    fn shard(&self, key: &K::Key) -> MutexGuard<'_, HashMap<K::Key, Arc<Lane<K>>>> {
        let i = (self.hasher.hash_one(key) as usize) % SHARDS;
        self.shards[i].lock()
    }

    /// Counts the command in and queues it in its key's lane.
    pub(crate) fn enter(
        &self,
        key: K::Key,
        mut command: K::Command,
        deadline: Option<Instant>,
        waker: &Waker,
    ) -> Result<Entered<K>, LaneError<K::Command, K::Error>> {
        let now = self.now();
        match self.accounts.enter() {
            Ok(()) => {}
            Err(Refused::Closed) => {
                self.metrics.closed();
                return Err(LaneError::Closed(command));
            }
            Err(Refused::Limit { drained }) => {
                if drained {
                    self.wake_closers();
                }
                self.metrics.busy(BusyReason::InFlightLimit);
                return Err(LaneError::Busy {
                    command,
                    retry_after: self.accounts.limit.retry_after(now),
                    reason: BusyReason::InFlightLimit,
                });
            }
        }
        // Counted in. The key's `Hash`, `Eq` and `Clone` run below: if one
        // panics, the panic goes to the caller with the command, and the
        // count (and the limit's unit) comes back.
        let counted = Uncount(self);
        let mut map = self.shard(&key);
        loop {
            let lane = map
                .entry(key.clone())
                .or_insert_with(|| Arc::new(Lane::new(key.clone())))
                .clone();
            match lane.enter(command, deadline, waker, self.lane_capacity, now) {
                Enter::Queued(ticket) => {
                    std::mem::forget(counted);
                    return Ok((lane, ticket));
                }
                Enter::Full {
                    command,
                    retry_after,
                } => {
                    drop(map);
                    drop(counted);
                    self.metrics.busy(BusyReason::LaneFull);
                    return Err(LaneError::Busy {
                        command,
                        retry_after,
                        reason: BusyReason::LaneFull,
                    });
                }
                Enter::Dead(c) => {
                    // Defensive: dead lanes leave the map when they die.
                    map.remove(&key);
                    command = c;
                }
            }
        }
    }

    /// Runs `f` (a lane transition that may kill the lane) under the lane's
    /// shard lock, removes the lane if it died, then settles the rest.
    fn under_shard<R>(&self, lane: &Arc<Lane<K>>, f: impl FnOnce() -> (R, After<K>)) -> R {
        let mut map = self.shard(lane.key());
        let (r, mut after) = f();
        if after.dead {
            if map.get(lane.key()).is_some_and(|l| Arc::ptr_eq(l, lane)) {
                map.remove(lane.key());
            }
            after.dead = false;
        }
        drop(map);
        self.settle(after);
        r
    }

    /// Runs what a transition left for after the locks.
    pub(crate) fn settle(&self, after: After<K>) {
        debug_assert!(
            !after.dead,
            "a dying transition must run under the shard lock"
        );
        if after.finished > 0 {
            self.accounts.limit.record_drain(self.now(), after.finished);
        }
        let notify = after.drained || (after.orphaned && self.accounts.is_closed());
        self.metrics.settled(&after.tally);
        drop(after.garbage);
        for w in after.wake {
            w.wake();
        }
        if notify {
            self.wake_closers();
        }
    }

    /// Withdraws a still queued command.
    pub(crate) fn withdraw(&self, lane: &Arc<Lane<K>>, ticket: TicketId) -> Option<K::Command> {
        self.under_shard(lane, || match lane.withdraw(ticket, &self.accounts) {
            Some((command, after)) => (Some(command), after),
            None => (None, After::new()),
        })
    }

    /// A caller's future was dropped.
    pub(crate) fn abandon(&self, lane: &Arc<Lane<K>>, ticket: TicketId) {
        self.under_shard(lane, || ((), lane.abandon(ticket, &self.accounts)));
    }

    /// `close` gives up driving `lane`.
    pub(crate) fn closer_release(&self, lane: &Arc<Lane<K>>) {
        self.under_shard(lane, || ((), lane.closer_release()));
    }

    /// Boxes the kernel's future for a new batch. The future owns the kernel
    /// handle and the key, so it is `'static` and any driver can poll it.
    pub(crate) fn batch_future(&self, lane: &Lane<K>, commands: Vec<K::Command>) -> BatchFuture<K> {
        self.metrics.batch_started(commands.len());
        let kernel = Arc::clone(&self.kernel);
        let key = lane.key().clone();
        Box::pin(async move { kernel.execute_batch(&key, commands).await })
    }

    /// Polls the batch future once as `me`, and finishes the batch if it
    /// completed or panicked.
    pub(crate) fn drive(
        &self,
        lane: &Arc<Lane<K>>,
        mut future: BatchFuture<K>,
        cx: &mut Context<'_>,
        me: Driver,
    ) -> Driven {
        let polled = catch_unwind(AssertUnwindSafe(|| future.as_mut().poll(cx)));
        let finished = match polled {
            Ok(Poll::Pending) => {
                lane.put_back(future);
                return Driven::Pending;
            }
            Ok(Poll::Ready(result)) => {
                self.drop_future(lane, future);
                self.inspect(lane, &result);
                Finished::Completed(result)
            }
            Err(payload) => {
                self.drop_future(lane, future);
                Finished::Panicked(Panic::new(payload))
            }
        };
        let now = self.now();
        self.under_shard(lane, || {
            ((), lane.finish(finished, me, now, &self.accounts))
        });
        Driven::Finished
    }

    /// Drops a finished kernel future, containing a panic in its drop.
    fn drop_future(&self, lane: &Lane<K>, future: BatchFuture<K>) {
        if let Err(payload) = catch_unwind(AssertUnwindSafe(move || drop(future))) {
            let panic = Panic::new(payload);
            self.emit(&LanesEvent::KernelDropPanicked {
                key: lane.key(),
                panic: &panic,
            });
        }
    }

    /// The classifier and the commit hook see a completed batch, before its
    /// callers get their outcomes and before the lane's next batch.
    fn inspect(&self, lane: &Lane<K>, result: &super::lane::KernelResult<K>) {
        let key = lane.key();
        if let Some(classify) = &self.classifier {
            for e in result.outcomes().iter().filter_map(|o| o.as_ref().err()) {
                match catch_unwind(AssertUnwindSafe(|| classify(e))) {
                    Ok(Some(message)) => {
                        if self.fatals.record(message) {
                            if let Some(fatal) = self.fatals.first() {
                                self.emit(&LanesEvent::FatalRecorded { key, fatal: &fatal });
                            }
                        }
                    }
                    Ok(None) => {}
                    Err(payload) => {
                        let panic = Panic::new(payload);
                        self.emit(&LanesEvent::ClassifierPanicked { key, panic: &panic });
                    }
                }
            }
        }
        if !result.is_committed() {
            return;
        }
        if let Some(hook) = &self.on_commit {
            match catch_unwind(AssertUnwindSafe(|| hook(key, result.outcomes()))) {
                Ok(Ok(())) => {}
                Ok(Err(error)) => self.emit(&LanesEvent::CommitHookFailed {
                    key,
                    error: &*error,
                }),
                Err(payload) => {
                    let panic = Panic::new(payload);
                    self.emit(&LanesEvent::CommitHookPanicked { key, panic: &panic });
                }
            }
        }
    }

    /// Reports an event to the hook, or without one to standard error (with
    /// the `tracing` feature: a WARN event).
    pub(crate) fn emit(&self, event: &LanesEvent<'_, K::Key>) {
        match &self.on_event {
            Some(hook) => {
                // A panicking log hook must not take a lane down with it.
                let _ = catch_unwind(AssertUnwindSafe(|| hook(event)));
            }
            None => crate::trace::lanes_event(&event),
        }
    }

    /// Every lane in the map now.
    pub(crate) fn lanes(&self) -> Vec<Arc<Lane<K>>> {
        let mut all = Vec::new();
        for shard in self.shards.iter() {
            all.extend(shard.lock().values().cloned());
        }
        all
    }

    /// How many lanes are alive.
    pub(crate) fn lanes_alive(&self) -> usize {
        self.shards.iter().map(|s| s.lock().len()).sum()
    }

    /// The keys of the lanes holding commands.
    pub(crate) fn busy_keys(&self) -> Vec<K::Key> {
        self.lanes()
            .into_iter()
            .filter(|l| l.is_busy())
            .map(|l| l.key().clone())
            .collect()
    }

    /// Registers a closer's waker.
    pub(crate) fn register_closer(&self, waker: &Waker) {
        let mut waiters = self.close_waiters.lock();
        if !waiters.iter().any(|w| w.will_wake(waker)) {
            waiters.push(waker.clone());
        }
    }

    fn wake_closers(&self) {
        let waiters = std::mem::take(&mut *self.close_waiters.lock());
        for w in waiters {
            w.wake();
        }
    }
}
