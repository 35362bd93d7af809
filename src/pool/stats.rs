//! Snapshots of the executor's counters, for tests and users' metrics,
//! and the report of a slow step: plain types, nothing of the pool's.

use std::time::Duration;

/// What a worker was doing when the snapshot was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerState {
    /// Running mailboxes (or about to look for one).
    Running,
    /// Out of work, spinning before it parks.
    Spinning,
    /// Asleep until work arrives.
    Parked,
    /// Stopped.
    Exited,
}

/// One worker's counters.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct WorkerStats {
    /// What it was doing.
    pub state: WorkerState,
    /// Tasks waiting in its queue: mailboxes with work to run, dispatcher
    /// inboxes with messages to deliver, spawned futures to poll (a port's
    /// turn under way counts as one).
    pub queued_tasks: usize,
    /// Messages in the inboxes of the ports it is home to (a dispatcher's
    /// keys are spread over its ports by hash; a port's turns run on its
    /// home worker), not yet taken into their keys' mailboxes: a key whose
    /// messages all wait here has no mailbox yet, and is not counted in
    /// [`ExecutorStats::live_mailboxes`].
    pub inbox: usize,
    /// Messages it finished with an output.
    pub done: u64,
    /// Messages whose handler panicked.
    pub panicked: u64,
    /// Suspended futures of its mailboxes dropped by a force stop.
    pub cancelled: u64,
    /// Failed attempts it ran that a retrying handler
    /// ([`handler::retrying`](crate::handler::retrying)) runs again.
    pub retried: u64,
    /// Messages it ran that a retrying handler gave up on
    /// ([`TaskError::DeadLettered`](crate::TaskError::DeadLettered)).
    pub dead_lettered: u64,
    /// Messages it did not run because their deadline passed
    /// ([`TaskError::Expired`](crate::TaskError::Expired)).
    pub expired: u64,
    /// Times it parked.
    pub parks: u64,
    /// Times someone woke it from a park.
    pub unparks: u64,
    /// Spins that found work before parking.
    pub spin_hits: u64,
    /// Times it yielded its thread in a mailbox's turn, before the next
    /// message, because the turn's messages after its first (or since
    /// the last yield) had run for 300 µs or more: a long step
    /// gives way to a thread waiting for its CPU.
    pub gave_way: u64,
    /// Tasks it took from another worker's queue (a port's turn, a key's
    /// mailbox, a spawned future waiting behind that worker's step), and
    /// turns it took over from a stuck step: work conservation at work.
    pub stolen: u64,
    /// Times it parked while another worker had work waiting: tasks queued
    /// behind that worker's step, or messages in the inbox of a port whose
    /// turn that worker ran. The pool's imbalance, as this worker saw it:
    /// near zero when work is spread well (a park that finds work waiting
    /// elsewhere steals it instead, so these are parks beside work it
    /// could not take, such as the rest of a running turn).
    pub parked_beside_work: u64,
    /// How long those parks lasted in all.
    pub idle_beside_work: Duration,
    /// The handler step it is running now, and for how long. Only watched
    /// when the executor has a [`slow_step`](crate::Builder::slow_step)
    /// threshold (`None` otherwise, and between steps). Reading it
    /// reports the step if it already overran the threshold.
    pub current_step: Option<CurrentStep>,
}

/// A handler step running on a worker (see [`WorkerStats::current_step`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct CurrentStep {
    /// The dispatcher's [name](crate::DispatcherBuilder::name).
    pub dispatcher: String,
    /// The key's hash (as in [`SlowStep::key_hash`](crate::SlowStep::key_hash)).
    pub key_hash: u64,
    /// How long it has been running.
    pub running_for: Duration,
}

/// A step that ran longer than the executor's
/// [`slow_step`](crate::Builder::slow_step) threshold, as given to the
/// [`on_slow_step`](crate::Builder::on_slow_step) hook.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SlowStep {
    /// The dispatcher's [name](crate::DispatcherBuilder::name) (`"?"` in
    /// the rare case it was dropped before the report was made).
    pub dispatcher: String,
    /// The key's hash (the dispatcher's hasher): the same value the
    /// `tracing` feature's `message` span carries as `key_hash`.
    pub key_hash: u64,
    /// The worker that ran it (`{thread_name}-{worker}`).
    pub worker: usize,
    /// How long it ran: its whole duration if it had ended when it was
    /// reported (`finished`), else how long it had been running then.
    /// Always above the threshold.
    pub running_for: Duration,
    /// Whether the step had ended when it was reported (reported by its
    /// own worker) or was still running (reported by another worker or a
    /// `stats()` caller).
    pub finished: bool,
}

/// One dispatcher's part of a snapshot.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DispatcherStats {
    /// Its [name](crate::DispatcherBuilder::name).
    pub name: String,
    /// Keys with work in a mailbox (see [`ExecutorStats::live_mailboxes`]).
    pub live_mailboxes: usize,
    /// Free mailboxes kept for reuse.
    pub idle_mailboxes: usize,
    /// Messages in its inboxes, not yet taken into their keys' mailboxes.
    pub inbox: usize,
}

/// A snapshot of a [`KeyedExecutor`](crate::KeyedExecutor).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ExecutorStats {
    /// Per worker.
    pub workers: Vec<WorkerStats>,
    /// Keys with work in a mailbox (messages queued, running or suspended),
    /// over every dispatcher. Messages still in a worker's inbox are
    /// counted in [`WorkerStats::inbox`] instead.
    pub live_mailboxes: usize,
    /// Free mailboxes kept for reuse (a few per dispatcher and worker): a
    /// key gets one only while it has a backlog or a suspended future.
    pub idle_mailboxes: usize,
    /// Messages finished with an output.
    pub done: u64,
    /// Messages whose handler panicked.
    pub panicked: u64,
    /// Queued messages handed back by a force stop.
    pub rejected: u64,
    /// Suspended futures dropped by a force stop.
    pub cancelled: u64,
    /// Failed attempts that retrying handlers run again (see
    /// [`WorkerStats::retried`]).
    pub retried: u64,
    /// Messages that retrying handlers gave up on (see
    /// [`WorkerStats::dead_lettered`]).
    pub dead_lettered: u64,
    /// Messages not run because their deadline passed (see
    /// [`WorkerStats::expired`]).
    pub expired: u64,
    /// Futures spawned through [`futures_task::Spawn`].
    pub spawned: SpawnedStats,
    /// Whether a stop began.
    pub closed: bool,
    /// Per dispatcher that is registered (alive, or with work in flight),
    /// in creation order.
    pub dispatchers: Vec<DispatcherStats>,
}

/// Counters of the futures spawned on a [`KeyedExecutor`](crate::KeyedExecutor)
/// through [`futures_task::Spawn`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct SpawnedStats {
    /// Spawned and not finished (queued, running or pending).
    pub live: usize,
    /// Ran to completion.
    pub done: u64,
    /// Panicked (the future was dropped; the worker went on).
    pub panicked: u64,
    /// Dropped unfinished by a force stop.
    pub cancelled: u64,
}
