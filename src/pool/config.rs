//! Executor configuration: the builder, its defaults and its validation.

use std::fmt;
use std::sync::Arc as StdArc;
use std::time::Duration;

use crate::error::ConfigError;
use crate::pool::stats::SlowStep;

/// The longest a worker may spin before parking (1 ms).
///
/// Longer spins only burn CPU: past a millisecond the wake-up a park costs
/// (tens of microseconds) is noise.
pub const MAX_SPIN: Duration = Duration::from_millis(1);

/// The most worker threads an executor may have.
pub const MAX_WORKERS: usize = 4096;

/// Default messages a mailbox runs in one turn before yielding its worker.
pub const DEFAULT_THROUGHPUT: usize = 16;

/// Default `max_in_flight` of a receiver created with
/// [`Dispatcher::default_receiver`](crate::Dispatcher::default_receiver).
pub const DEFAULT_MAX_IN_FLIGHT: usize = 256;

/// Default worker thread name prefix; threads are named `{prefix}-{i}`.
pub const DEFAULT_THREAD_NAME: &str = "keyed-worker";

/// Default [`Builder::metrics_sampling`](crate::Builder::metrics_sampling):
/// one message in 256 is timed for the `keyed_executor_*_seconds`
/// histograms (each timed message costs three clock readings and three
/// histogram records, ~300 ns with the Prometheus exporter: about 1 ns per
/// message at 1 in 256, 5 at 1 in 64).
#[cfg(feature = "metrics")]
pub const DEFAULT_METRICS_SAMPLING: u32 = 256;

pub(crate) type ThreadHook = StdArc<dyn Fn() + Send + Sync + 'static>;
pub(crate) type SlowStepHook = StdArc<dyn Fn(&SlowStep) + Send + Sync + 'static>;

/// Builds a [`KeyedExecutor`](crate::KeyedExecutor). Every setting has a default; [`build`](Self::build)
/// validates them and starts the workers.
///
/// ```
/// use std::time::Duration;
/// use keyed_executor::KeyedExecutor;
///
/// let executor = KeyedExecutor::builder()
///     .workers(2)
///     .throughput(16)
///     .spin(Duration::ZERO)
///     .thread_name("orders")
///     .build()?;
/// assert_eq!(executor.workers(), 2);
/// executor.shutdown(Duration::from_secs(1));
/// # Ok::<(), keyed_executor::ConfigError>(())
/// ```
///
/// Bad values are reported, never panicked on:
///
/// ```
/// use keyed_executor::{ConfigError, KeyedExecutor};
///
/// let err = KeyedExecutor::builder().workers(0).build().unwrap_err();
/// assert_eq!(err, ConfigError::ZeroWorkers);
/// ```
#[derive(Clone)]
#[must_use = "a builder does nothing until `build()` is called"]
pub struct Builder {
    workers: Option<usize>,
    throughput: usize,
    spin: Duration,
    work_conservation: bool,
    thread_name: String,
    stack_size: Option<usize>,
    on_thread_start: Option<ThreadHook>,
    on_thread_stop: Option<ThreadHook>,
    slow_step: Option<Duration>,
    on_slow_step: Option<SlowStepHook>,
    #[cfg(feature = "metrics")]
    metrics_sampling: u32,
    #[cfg(loom)]
    loom_watchers: bool,
}

impl fmt::Debug for Builder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Builder")
            .field("workers", &self.workers)
            .field("throughput", &self.throughput)
            .field("spin", &self.spin)
            .field("work_conservation", &self.work_conservation)
            .field("thread_name", &self.thread_name)
            .field("stack_size", &self.stack_size)
            .field("slow_step", &self.slow_step)
            .finish_non_exhaustive()
    }
}

impl Default for Builder {
    fn default() -> Self {
        Builder {
            workers: None,
            throughput: DEFAULT_THROUGHPUT,
            spin: Duration::ZERO,
            work_conservation: true,
            thread_name: DEFAULT_THREAD_NAME.to_owned(),
            stack_size: None,
            on_thread_start: None,
            on_thread_stop: None,
            slow_step: None,
            on_slow_step: None,
            #[cfg(feature = "metrics")]
            metrics_sampling: DEFAULT_METRICS_SAMPLING,
            #[cfg(loom)]
            loom_watchers: false,
        }
    }
}

impl Builder {
    /// A builder with the defaults: `workers` = available parallelism,
    /// `throughput` = 16, `spin` = zero, `thread_name` = `"keyed-worker"`.
    pub fn new() -> Self {
        Self::default()
    }

    /// Number of worker threads, shared by every dispatcher of the executor.
    ///
    /// Default: [`std::thread::available_parallelism`], which honours cgroup
    /// CPU quotas (1 if it cannot be read; at most [`MAX_WORKERS`]). Must
    /// be at least 1 and at most [`MAX_WORKERS`].
    ///
    /// Your own threads that submit share the cores too. When a producer
    /// thread is busy most of the time (a loop polling a broker and
    /// submitting, say), one worker per core leaves more busy threads than
    /// cores, and the operating system's time slices then decide much of
    /// the throughput: on 2 cores with one such producer, the uniform
    /// workload of BENCHMARKS.md (W1) ran 8.2 M messages/s with one worker
    /// against 6.4 with two (medians of 10 paired rounds). Measure with
    /// your own producers. Keep at least two workers if a key's step may
    /// run long: work conservation needs an idle worker to take the keys
    /// queued behind it.
    pub fn workers(mut self, workers: usize) -> Self {
        self.workers = Some(workers);
        self
    }

    /// The most messages of one key a worker runs in one turn, while they
    /// complete synchronously, before the mailbox goes to the back of its
    /// worker's queue, so one hot key cannot starve the others. Default 16;
    /// must be at least 1. Higher values amortise scheduling for hot keys,
    /// lower ones cut the latency other keys of the same worker see.
    ///
    /// The bound, precisely: a cold key's message waiting for a worker
    /// (queued in its mailbox, or still in the worker's inbox) runs after at
    /// most one turn of `throughput` messages of a hot key of that worker:
    /// messages still in the inbox when the hot key yields are taken in
    /// ahead of it, and a turn that ran dry only because the hot key's next
    /// messages were still in the inbox is continued, not restarted, when
    /// they arrive right after it.
    pub fn throughput(mut self, throughput: usize) -> Self {
        self.throughput = throughput;
        self
    }

    /// How long a worker that ran out of messages spins before it parks, at
    /// most [`MAX_SPIN`]. Default zero: park at once.
    ///
    /// A worker spins only when its last wait was shorter than `spin`; after
    /// a longer wait it parks at once. A spinning worker takes the next
    /// message without the wake-up a park costs (a syscall by the sender and
    /// the scheduling delay of the woken thread), but burns its core while it
    /// spins: up to `workers` cores while messages trickle in at intervals
    /// just under `spin`.
    ///
    /// Worth setting (10–100 µs) only for in-memory, high-rate dispatch whose
    /// messages arrive within microseconds of each other. With real I/O in
    /// the handlers the gain is noise. **In a container with a CPU quota
    /// (cgroup limit), leave it at zero**: spinning eats the quota.
    pub fn spin(mut self, spin: Duration) -> Self {
        self.spin = spin;
        self
    }

    /// Whether an idle worker takes work waiting behind a busy one: tasks
    /// queued behind its step, slices of a busy port's backlog, the rest
    /// of a turn behind a stuck step. Default `true`.
    ///
    /// With it, a key's messages may run on another worker than its port's
    /// first home; per-key order, one at a time, fairness and the stops
    /// hold either way (see the crate docs, "Balance and work
    /// conservation"). Turn it off to keep every port (and its keys'
    /// mailboxes) on its first worker for good — for handlers that rely on
    /// a worker's thread-local state, say — accepting that a backlog waits
    /// for its worker even while another idles
    /// ([`WorkerStats::parked_beside_work`](crate::WorkerStats::parked_beside_work)
    /// counts that).
    ///
    /// Its cost shows where threads outnumber cores: a worker the operating
    /// system has descheduled looks stuck like one in a long step, and idle
    /// workers wake to look for that. On 2 cores shared with one busy
    /// producer, W1 of BENCHMARKS.md ran 15–23 % faster with it off (paired
    /// rounds); a slow key's neighbours then wait for it (W9).
    ///
    /// ```
    /// let executor = keyed_executor::KeyedExecutor::builder()
    ///     .workers(2)
    ///     .work_conservation(false)
    ///     .build()
    ///     .unwrap();
    /// # drop(executor);
    /// ```
    pub fn work_conservation(mut self, on: bool) -> Self {
        self.work_conservation = on;
        self
    }

    /// Loom models only: idle workers watch for stuck steps by themselves
    /// as they do outside loom (a watching park is a yield), so that the
    /// work queued behind a blocked step in a busy port is found, as
    /// outside loom, by the idle workers' watch (submitters never look at
    /// a busy port's worker; see "Why no wake-up is lost" in `conserve/mod.rs`).
    #[cfg(loom)]
    #[doc(hidden)]
    pub fn loom_watchers(mut self) -> Self {
        self.loom_watchers = true;
        self
    }

    /// Worker thread name prefix; threads are named `{prefix}-{i}`.
    /// Default `"keyed-worker"`.
    pub fn thread_name(mut self, prefix: impl Into<String>) -> Self {
        self.thread_name = prefix.into();
        self
    }

    /// Stack size of each worker thread, in bytes (default: the platform's).
    pub fn thread_stack_size(mut self, bytes: usize) -> Self {
        self.stack_size = Some(bytes);
        self
    }

    /// Runs on each worker thread when it starts, before it takes work.
    /// Every worker's hook has returned before [`build`](Self::build)
    /// returns.
    ///
    /// The place to set up what handlers expect to find on their thread:
    /// thread-locals, a logging or tracing context, or an async runtime's
    /// context. For tokio, entering the runtime once per worker lets handler
    /// futures create tokio timers and sockets (`EnterGuard` is `!Send` and
    /// borrows the handle; forgetting it keeps the context for the thread's
    /// life and leaks nothing on a fresh thread):
    ///
    /// ```
    /// use std::time::Duration;
    /// use keyed_executor::{handler, KeyedExecutor};
    ///
    /// let rt = tokio::runtime::Runtime::new()?;
    /// let handle = rt.handle().clone();
    /// let executor = KeyedExecutor::builder()
    ///     .workers(2)
    ///     .on_thread_start(move || std::mem::forget(handle.enter()))
    ///     .build()?;
    /// let receiver = executor
    ///     .dispatcher(handler::from_async_fn(|_key: u32, ms: u64| async move {
    ///         tokio::time::sleep(Duration::from_millis(ms)).await; // needs the context
    ///         ms
    ///     }))
    ///     .receiver(16)?;
    /// let done = receiver.submit_blocking(1, 5)?;
    /// assert_eq!(rt.block_on(done)?, 5);
    /// assert!(executor.shutdown(Duration::from_secs(5))); // before the runtime goes
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn on_thread_start(mut self, f: impl Fn() + Send + Sync + 'static) -> Self {
        self.on_thread_start = Some(StdArc::new(f));
        self
    }

    /// Runs on each worker thread just before it exits. When
    /// [`shutdown`](crate::KeyedExecutor::shutdown) returns `true`, or
    /// [`shutdown_now`](crate::KeyedExecutor::shutdown_now) returns (called from
    /// outside the pool), every worker's hook has returned.
    pub fn on_thread_stop(mut self, f: impl Fn() + Send + Sync + 'static) -> Self {
        self.on_thread_stop = Some(StdArc::new(f));
        self
    }

    /// Reports every handler step that runs longer than `threshold`: a
    /// call of the handler together with the first poll of its future, or
    /// a later poll of a suspended future. Default: off.
    ///
    /// A step that overran is reported **once**, by whoever looks first:
    /// the worker itself when the step ends, another worker when it runs
    /// out of work, or a caller of
    /// [`KeyedExecutor::stats`](crate::KeyedExecutor::stats) (so a step
    /// that never ends is reported by the next `stats()` call after the
    /// threshold passed). No timer thread is involved. Each report goes to
    /// the [`on_slow_step`](Self::on_slow_step) hook, a WARN event with the
    /// `tracing` feature and `keyed_executor_slow_steps_total` with the
    /// `metrics` feature.
    ///
    /// Cost: with a threshold set, each step reads the clock once and
    /// publishes its start in its worker's cache line (shown by
    /// [`WorkerStats::current_step`](crate::WorkerStats::current_step)):
    /// about 40–50 ns a step on the development machine, which doubles
    /// the worker's own cost for a handler that does nothing (the probe
    /// bench: 37–48 → 81–101 ns a message) and is noise for handlers of a
    /// few microseconds or more. Without a threshold nothing is measured
    /// (one branch a message). A zero threshold is refused by
    /// [`build`](Self::build).
    pub fn slow_step(mut self, threshold: Duration) -> Self {
        self.slow_step = Some(threshold);
        self
    }

    /// Called with each slow step (see [`slow_step`](Self::slow_step)),
    /// once per step, on the thread that noticed it: the worker (after the
    /// step), another worker, or a `stats()` caller. Keep it short; a
    /// panic in it is caught and dropped. Needs `slow_step`.
    pub fn on_slow_step(mut self, hook: impl Fn(&SlowStep) + Send + Sync + 'static) -> Self {
        self.on_slow_step = Some(StdArc::new(hook));
        self
    }

    /// With the `metrics` feature: one message in `every` (a power of two;
    /// default [`DEFAULT_METRICS_SAMPLING`](crate::DEFAULT_METRICS_SAMPLING)
    /// = 256) is timed for the `keyed_executor_*_seconds` histograms; 1
    /// times every message (three clock readings each). Counters and
    /// gauges are exact whatever the sampling.
    #[cfg(feature = "metrics")]
    pub fn metrics_sampling(mut self, every: u32) -> Self {
        self.metrics_sampling = every;
        self
    }

    pub(crate) fn validate(self) -> Result<Config, ConfigError> {
        let workers = match self.workers {
            Some(0) => return Err(ConfigError::ZeroWorkers),
            Some(n) if n > MAX_WORKERS => {
                return Err(ConfigError::TooManyWorkers {
                    got: n,
                    max: MAX_WORKERS,
                })
            }
            Some(n) => n,
            None => std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .min(MAX_WORKERS),
        };
        if self.throughput == 0 {
            return Err(ConfigError::ZeroThroughput);
        }
        if self.spin > MAX_SPIN {
            return Err(ConfigError::SpinTooLong {
                spin: self.spin,
                max: MAX_SPIN,
            });
        }
        if self.thread_name.contains('\0') {
            return Err(ConfigError::InvalidThreadName(self.thread_name));
        }
        if self.slow_step == Some(Duration::ZERO) {
            return Err(ConfigError::ZeroSlowStep);
        }
        if self.on_slow_step.is_some() && self.slow_step.is_none() {
            return Err(ConfigError::SlowStepHookWithoutThreshold);
        }
        #[cfg(feature = "metrics")]
        if !self.metrics_sampling.is_power_of_two() {
            return Err(ConfigError::InvalidMetricsSampling(self.metrics_sampling));
        }
        Ok(Config {
            workers,
            throughput: self.throughput,
            spin: self.spin,
            work_conservation: self.work_conservation,
            thread_name: self.thread_name,
            stack_size: self.stack_size,
            on_thread_start: self.on_thread_start,
            on_thread_stop: self.on_thread_stop,
            slow_step: self.slow_step,
            on_slow_step: self.on_slow_step,
            #[cfg(feature = "metrics")]
            metrics_sampling: self.metrics_sampling,
            #[cfg(loom)]
            loom_watchers: self.loom_watchers,
        })
    }
}

/// Validated settings.
pub(crate) struct Config {
    pub(crate) workers: usize,
    pub(crate) throughput: usize,
    pub(crate) spin: Duration,
    pub(crate) work_conservation: bool,
    pub(crate) thread_name: String,
    pub(crate) stack_size: Option<usize>,
    pub(crate) on_thread_start: Option<ThreadHook>,
    pub(crate) on_thread_stop: Option<ThreadHook>,
    pub(crate) slow_step: Option<Duration>,
    pub(crate) on_slow_step: Option<SlowStepHook>,
    #[cfg(feature = "metrics")]
    pub(crate) metrics_sampling: u32,
    #[cfg(loom)]
    loom_watchers: bool,
}

impl Config {
    /// Whether idle workers watch for stuck steps by themselves (park with
    /// a timeout, or deep: "Why no wake-up is lost" in `conserve/mod.rs`). Always outside
    /// loom. Under loom only when a model asks
    /// ([`Builder::loom_watchers`]), since a watching park is a loop there:
    /// the other models keep workers that park until woken (enough where
    /// a task is queued: `Shared::schedule` looks).
    #[inline]
    pub(crate) fn watchers(&self) -> bool {
        #[cfg(not(loom))]
        return true;
        #[cfg(loom)]
        self.loom_watchers
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults() {
        let c = Builder::new().validate().unwrap();
        assert!(c.workers >= 1);
        assert_eq!(c.throughput, 16);
        assert_eq!(c.spin, Duration::ZERO);
        assert!(c.work_conservation);
        assert_eq!(c.thread_name, "keyed-worker");
    }

    #[test]
    fn rejects_each_bad_value() {
        assert_eq!(
            Builder::new().workers(0).validate().err(),
            Some(ConfigError::ZeroWorkers)
        );
        assert_eq!(
            Builder::new().workers(MAX_WORKERS + 1).validate().err(),
            Some(ConfigError::TooManyWorkers {
                got: MAX_WORKERS + 1,
                max: MAX_WORKERS
            })
        );
        assert_eq!(
            Builder::new().throughput(0).validate().err(),
            Some(ConfigError::ZeroThroughput)
        );
        let too_long = MAX_SPIN + Duration::from_nanos(1);
        assert_eq!(
            Builder::new().spin(too_long).validate().err(),
            Some(ConfigError::SpinTooLong {
                spin: too_long,
                max: MAX_SPIN
            })
        );
        assert!(matches!(
            Builder::new().thread_name("a\0b").validate().err(),
            Some(ConfigError::InvalidThreadName(_))
        ));
        assert!(Builder::new().spin(MAX_SPIN).validate().is_ok());
        assert_eq!(
            Builder::new().slow_step(Duration::ZERO).validate().err(),
            Some(ConfigError::ZeroSlowStep)
        );
        assert_eq!(
            Builder::new().on_slow_step(|_| {}).validate().err(),
            Some(ConfigError::SlowStepHookWithoutThreshold)
        );
        assert!(Builder::new()
            .slow_step(Duration::from_millis(1))
            .on_slow_step(|_| {})
            .validate()
            .is_ok());
    }

    #[test]
    fn messages_say_which_value_and_why() {
        let msg = ConfigError::SpinTooLong {
            spin: Duration::from_millis(5),
            max: MAX_SPIN,
        }
        .to_string();
        assert!(msg.contains("spin") && msg.contains("5ms") && msg.contains("MAX_SPIN"));
        assert!(ConfigError::ZeroWorkers.to_string().contains("workers"));
    }
}
