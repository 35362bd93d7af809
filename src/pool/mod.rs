//! The `KeyedExecutor` front-end: a fixed pool of worker threads that runs
//! each key's messages one at a time, in arrival order, through per-key
//! mailboxes.
//!
//! The files, from the user's side inwards (`ARCHITECTURE.md` at the
//! repository's root walks one message through them):
//!
//! - `config.rs`: the executor's builder, defaults and validation.
//! - `executor.rs`: the pool's handle and lifecycle (graceful and force stop).
//! - `handler.rs`: what a dispatcher runs for a message, sync or async.
//! - `deadline.rs`: messages with a deadline, not run once it passed.
//! - `dispatcher.rs`: one handler, its keys' pins and its per-worker inboxes.
//! - `receiver.rs`: the sources that feed a dispatcher, with their credit.
//! - `batch.rs`: a receiver's batched sends (`send_batch` and its forms).
//! - `retry.rs`: retry policies: attempts, backoff, jitter, which failures
//!   retry.
//! - `poison.rs`: the retrying handler: attempts, backoffs, dead letters.
//! - `source.rs`: a receiver's shared state: credit, positions, drains,
//!   and whether it takes messages.
//! - `commits.rs`: the commit point of a receiver that tracks commits.
//! - `mailbox.rs`: one key's queue, its running future and its state machine.
//! - `worker.rs`: a worker's queues and its spin-then-park loop.
//! - `inbox.rs`: a port's multi-producer inbox.
//! - `task.rs`: the type-erased handle a worker's queue holds.
//! - `turns.rs`: a worker's record of the turns keys without a mailbox ran.
//! - `waker.rs`: the crate's own waker over a mailbox (or spawned task).
//! - `spawn.rs`: `futures_task::Spawn` for unkeyed futures.
//! - `stats.rs`: the snapshot types `KeyedExecutor::stats` returns.

pub(crate) mod batch;
pub(crate) mod commits;
pub(crate) mod config;
pub(crate) mod deadline;
pub(crate) mod dispatcher;
pub(crate) mod executor;
pub mod handler;
pub(crate) mod inbox;
pub(crate) mod mailbox;
pub(crate) mod metrics;
pub(crate) mod observe;
pub(crate) mod poison;
pub(crate) mod receiver;
pub(crate) mod retry;
pub(crate) mod source;
pub(crate) mod spawn;
pub(crate) mod stats;
pub(crate) mod task;
pub(crate) mod turns;
pub(crate) mod waker;
pub(crate) mod worker;
