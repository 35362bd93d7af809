//! The executor: the pool of workers every dispatcher shares, and its
//! lifecycle. The state its handles share with the workers and the
//! dispatchers is `Shared`, in `shared.rs`. `impl Spawn` is at the end;
//! the spawned tasks it makes are `spawn.rs`'s.
//!
//! # Lifecycle
//!
//! `Shared::state` holds two flags, only ever set (never cleared):
//! `CLOSED` (nothing new is accepted) and `FORCED` (nothing new starts).
//!
//! Graceful stop, [`KeyedExecutor::shutdown`]:
//! 1. Set `CLOSED`, then wake every parked worker and every submitter
//!    waiting for credit (it leaves with `Closed(msg)`; see `Acquire` in
//!    `source/`).
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

use std::fmt;
use std::hash::Hash;
use std::time::{Duration, Instant};

use futures_task::{FutureObj, Spawn, SpawnError};

use crate::error::ConfigError;
use crate::pool::config::{Builder, Config};
use crate::pool::dispatcher::{Dispatcher, DispatcherBuilder};
use crate::pool::handler::Handler;
use crate::pool::shared::Shared;
use crate::pool::spawn::spawn;
use crate::pool::stats::ExecutorStats;
use crate::pool::worker::{self, Worker};
use crate::sync::atomic::Ordering::*;
use crate::sync::{thread, Arc};
use crate::trace;

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
        let shared = Arc::new(Shared::new(config));
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
                        shared.workers[j].state.store(Worker::EXITED, SeqCst);
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
        DispatcherBuilder::new(&self.shared, handler).build()
    }

    /// A builder for a dispatcher running `handler`, to set its hooks or
    /// hasher.
    pub fn dispatcher_builder<K, M, H>(&self, handler: H) -> DispatcherBuilder<'_, K, M, H>
    where
        K: Hash + Eq + Clone + Send + Sync + 'static,
        M: Send + 'static,
        H: Handler<K, M>,
    {
        DispatcherBuilder::new(&self.shared, handler)
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
    /// to poll (it briefly takes each port's gate to count mailboxes).
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

/// Runs spawned futures on the executor's workers, so code written against
/// the `futures` spawn traits ([`Spawn`], and `futures::task::SpawnExt`'s
/// `spawn` / `spawn_with_handle`) can use the pool.
///
/// A spawned future is *unkeyed*: it is ordered with nothing, and a pending
/// one holds no worker (it is polled with the crate's waker, like an async
/// handler). It takes part in the executor's lifecycle:
///
/// - after [`shutdown`](KeyedExecutor::shutdown) or
///   [`shutdown_now`](KeyedExecutor::shutdown_now) began, `spawn_obj`
///   refuses with [`SpawnError::shutdown()`] and drops the future;
/// - a graceful `shutdown` waits for every spawned future to finish, like
///   for accepted messages (a future that never finishes makes it time out);
/// - `shutdown_now` drops every spawned future that has not finished (a poll
///   already running completes first). A `RemoteHandle` from
///   `spawn_with_handle` whose future was dropped this way panics when
///   polled, as with every `futures` executor.
///
/// A panic in a spawned future is caught: the future is dropped, the worker
/// goes on, and [`ExecutorStats::spawned`](crate::ExecutorStats::spawned)
/// counts it (with the `tracing` feature, a WARN event reports it).
/// `spawn_with_handle` reports it to the handle instead.
///
/// ```
/// use futures::task::SpawnExt;
/// use keyed_executor::KeyedExecutor;
///
/// let executor = KeyedExecutor::builder().workers(2).build()?;
/// let handle = executor.spawn_with_handle(async { 6 * 7 })?;
/// assert_eq!(futures::executor::block_on(handle), 42);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// For futures that must run **one at a time per key**, use a dispatcher
/// whose handler is the future itself:
///
/// ```
/// use futures::future::BoxFuture;
/// use keyed_executor::{handler, KeyedExecutor};
///
/// let executor = KeyedExecutor::builder().workers(2).build()?;
/// let jobs = executor
///     .dispatcher(handler::from_async_fn(|_key: u64, job: BoxFuture<'static, u32>| job))
///     .receiver(64)?;
/// let done = jobs.submit_blocking(7, Box::pin(async { 1 + 1 }))?;
/// assert_eq!(done.wait()?, 2);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
impl Spawn for KeyedExecutor {
    fn spawn_obj(&self, future: FutureObj<'static, ()>) -> Result<(), SpawnError> {
        spawn(self.shared(), future)
    }

    fn status(&self) -> Result<(), SpawnError> {
        if self.is_shutdown() {
            Err(SpawnError::shutdown())
        } else {
            Ok(())
        }
    }
}
