//! The `KeyedExecutor` front-end: a fixed pool of worker threads that runs
//! each key's messages one at a time, in arrival order, through per-key
//! mailboxes.
//!
//! The files and folders, from the user's side inwards (`ARCHITECTURE.md`
//! at the repository's root walks one message through them):
//!
//! - `config.rs`: the executor's builder, defaults and validation.
//! - `executor.rs`: `KeyedExecutor`, its start and its stops.
//! - `shared.rs`: `Shared`, the state every part of the pool reaches.
//! - `handler.rs`: what a dispatcher runs for a message, sync or async.
//! - `deadline.rs`: messages with a deadline, not run once it passed.
//! - `poison.rs`: the retrying handler: attempts, backoffs, dead letters.
//! - `dispatcher/`: one handler and its ports, to which keys belong by hash
//!   (`mod.rs` the public `Dispatcher`; `route`, `submit`, `port`, `turn`,
//!   `slice`, `keys`, `outcome`, `stop`, `erased`, `hasher`).
//! - `receiver/`: the sources that feed a dispatcher: the type, its builder,
//!   admission and its futures.
//! - `batch.rs`: a receiver's batched sends (`send_batch` and its forms).
//! - `retry/`: retry policies: attempts, backoff, jitter, which failures
//!   retry.
//! - `source/`: a receiver's shared state: credit, positions, drains,
//!   whether it takes messages, and its commit point.
//! - `mailbox/`: one key's queue and running future (`mod.rs`), its state
//!   word (`state.rs`) and its runner (`run.rs`).
//! - `worker/`: a worker's queues and state (`mod.rs`), its context
//!   (`cx.rs`) and its spin-then-park loop (`run.rs`).
//! - `conserve/`: work conservation, the protocol that lets an idle worker
//!   take work waiting behind a stuck one (`watch`, `call`, `steal`,
//!   `park`).
//! - `inbox.rs`: a port's multi-producer inbox.
//! - `task.rs`: the type-erased handle a worker's queue holds.
//! - `turns.rs`: a worker's record of the turns keys without a mailbox ran.
//! - `waker.rs`: the crate's own waker over a mailbox (or spawned task).
//! - `spawn.rs`: the unkeyed futures `futures_task::Spawn` runs (the impl
//!   for `KeyedExecutor` is in `executor.rs`).
//! - `observe.rs`: names, the slow-step watch, metrics handles.
//! - `metrics.rs`: the `metrics` feature's series.
//! - `stats.rs`: the snapshot types `KeyedExecutor::stats` returns, and
//!   `SlowStep`, the slow-step hook's report.

use std::hash::{BuildHasher, Hash};

/// What the pool's internals ask of a key, named once; every type with
/// these bounds has it. (Public signatures spell the bounds out.)
pub(crate) trait PoolKey: Hash + Eq + Clone + Send + Sync + 'static {}

impl<T: Hash + Eq + Clone + Send + Sync + 'static> PoolKey for T {}

/// What the pool's internals ask of a dispatcher's hasher, named once.
pub(crate) trait PoolHasher: BuildHasher + Send + Sync + 'static {}

impl<T: BuildHasher + Send + Sync + 'static> PoolHasher for T {}

pub(crate) mod batch;
pub(crate) mod config;
pub(crate) mod conserve;
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
pub(crate) mod shared;
pub(crate) mod source;
pub(crate) mod spawn;
pub(crate) mod stats;
pub(crate) mod task;
pub(crate) mod turns;
pub(crate) mod waker;
pub(crate) mod worker;
