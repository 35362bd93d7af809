//! The consumer's settings, their validation, and the builder.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use keyed_executor::handler::Handler;
use keyed_executor::KeyedExecutor;

use crate::consumer::Consumer;
use crate::entry::{DecodeError, Entry};
use crate::layout::Streams;
use crate::stats::Event;

/// What to do with a message the handler finished, decided from its
/// output ([`ConsumerBuilder::verdict`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Done: ack the entry.
    Ack,
    /// Write the entry to the dead-letter stream with this reason, and ack
    /// it (in one step).
    DeadLetter(String),
    /// Stop the partition with this reason: the entry stays pending, and
    /// nothing more is read from the partition until the node restarts
    /// ([`Event::Halted`]). For failures a person must look at, where
    /// going on would let the key's later records overtake this one.
    Halt(String),
}

/// The default verdict: every finished message is acked.
#[derive(Debug, Clone, Copy, Default)]
pub struct AckAll;

/// Decides a [`Verdict`] from a handler's output: [`AckAll`], or any
/// `Fn(&O) -> Verdict`.
pub trait Decide<O>: Send + Sync + 'static {
    /// The verdict on `output`.
    fn decide(&self, output: &O) -> Verdict;
}

impl<O> Decide<O> for AckAll {
    fn decide(&self, _: &O) -> Verdict {
        Verdict::Ack
    }
}

impl<O, F> Decide<O> for F
where
    F: Fn(&O) -> Verdict + Send + Sync + 'static,
{
    fn decide(&self, output: &O) -> Verdict {
        self(output)
    }
}

/// A setting that cannot work, found before anything connects.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The Redis URL does not parse.
    #[error("Redis URL {url:?}: {why}")]
    Url {
        /// The URL given.
        url: String,
        /// What the client said.
        why: String,
    },
    /// No partitions.
    #[error("no partitions: give at least one stream")]
    NoPartitions,
    /// The same stream twice: two partitions would share its entries.
    #[error("stream {0:?} is listed twice")]
    DuplicateStream(String),
    /// The group name is empty.
    #[error("the consumer group name is empty")]
    EmptyGroup,
    /// The node name is empty or has whitespace (it is the consumer's
    /// name in the group and part of its connections' names).
    #[error("node name {0:?}: it must be non-empty, without whitespace, and unique per live node")]
    BadName(String),
    /// A count that must be at least 1 is zero.
    #[error("{0} must be at least 1")]
    Zero(&'static str),
    /// A time that must be positive is zero.
    #[error("{0} must be longer than zero")]
    ZeroTime(&'static str),
    /// The heartbeat is too slow for the lease: a node fences its
    /// partitions when a renewal is two-thirds of a lease late, so at least
    /// two heartbeats must fit in that.
    #[error("heartbeat {heartbeat:?} is too slow for lease {lease:?}: it must be at most a third of the lease")]
    HeartbeatTooSlow {
        /// The heartbeat period.
        heartbeat: Duration,
        /// The lease.
        lease: Duration,
    },
    /// The executor's own settings (`workers`).
    #[error("executor: {0}")]
    Executor(#[from] keyed_executor::ConfigError),
}

/// The settings of one node. Built by [`ConsumerBuilder`]; the defaults
/// are listed on its setters.
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) url: String,
    pub(crate) streams: Streams,
    pub(crate) group: String,
    pub(crate) name: String,
    pub(crate) namespace: Option<String>,
    pub(crate) max_in_flight: usize,
    pub(crate) read_count: usize,
    pub(crate) block: Duration,
    pub(crate) lease: Duration,
    pub(crate) heartbeat: Duration,
    pub(crate) hand_off_deadline: Duration,
    pub(crate) claim_idle: Option<Duration>,
    pub(crate) dead_letters: DeadLetters,
    pub(crate) create_groups: bool,
    pub(crate) connect_timeout: Duration,
    pub(crate) join_delay: Duration,
    pub(crate) workers: Option<usize>,
    pub(crate) io_threads: usize,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum DeadLetters {
    Default,
    Stream(String),
    Off,
}

impl Config {
    /// The prefix of the group's coordination keys.
    pub(crate) fn namespace(&self) -> &str {
        self.namespace.as_deref().unwrap_or(&self.group)
    }

    pub(crate) fn members_key(&self) -> String {
        format!("{}:members", self.namespace())
    }

    pub(crate) fn lease_key(&self, p: usize) -> String {
        format!("{}:owner:{p}", self.namespace())
    }

    pub(crate) fn layout_key(&self) -> String {
        format!("{}:layout", self.namespace())
    }

    pub(crate) fn dead_letter_stream(&self) -> Option<String> {
        match &self.dead_letters {
            DeadLetters::Default => Some(format!("{}:dead", self.namespace())),
            DeadLetters::Stream(s) => Some(s.clone()),
            DeadLetters::Off => None,
        }
    }

    pub(crate) fn claim_idle(&self) -> Duration {
        self.claim_idle.unwrap_or(self.lease)
    }

    /// Longer than any `BLOCK`, shorter than a lease where it can be.
    pub(crate) fn response_timeout(&self) -> Duration {
        (self.block * 10).max(Duration::from_secs(2))
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if let Err(e) = redis::Client::open(self.url.as_str()) {
            return Err(ConfigError::Url {
                url: self.url.clone(),
                why: e.to_string(),
            });
        }
        if self.streams.is_empty() {
            return Err(ConfigError::NoPartitions);
        }
        let mut seen = BTreeSet::new();
        for s in self.streams.iter() {
            if !seen.insert(s) {
                return Err(ConfigError::DuplicateStream(s.to_string()));
            }
        }
        if self.group.is_empty() {
            return Err(ConfigError::EmptyGroup);
        }
        if self.name.is_empty() || self.name.chars().any(char::is_whitespace) {
            return Err(ConfigError::BadName(self.name.clone()));
        }
        for (n, what) in [
            (self.max_in_flight, "max_in_flight"),
            (self.read_count, "read_count"),
            (self.io_threads, "io_threads"),
        ] {
            if n == 0 {
                return Err(ConfigError::Zero(what));
            }
        }
        if self.workers == Some(0) {
            return Err(ConfigError::Zero("workers"));
        }
        for (d, what) in [
            (self.block, "block"),
            (self.lease, "lease"),
            (self.heartbeat, "heartbeat"),
            (self.connect_timeout, "connect_timeout"),
        ] {
            // `BLOCK 0` would wait forever: the smallest block is 1 ms.
            if d.as_millis() == 0 {
                return Err(ConfigError::ZeroTime(what));
            }
        }
        if self.heartbeat * 3 > self.lease {
            return Err(ConfigError::HeartbeatTooSlow {
                heartbeat: self.heartbeat,
                lease: self.lease,
            });
        }
        Ok(())
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Config")
            .field("url", &self.url)
            .field("streams", &self.streams)
            .field("group", &self.group)
            .field("name", &self.name)
            .field("namespace", &self.namespace())
            .field("max_in_flight", &self.max_in_flight)
            .field("read_count", &self.read_count)
            .field("block", &self.block)
            .field("lease", &self.lease)
            .field("heartbeat", &self.heartbeat)
            .field("hand_off_deadline", &self.hand_off_deadline)
            .field("claim_idle", &self.claim_idle())
            .field("dead_letters", &self.dead_letter_stream())
            .finish_non_exhaustive()
    }
}

pub(crate) type EventHook = Arc<dyn Fn(&Event) + Send + Sync>;

/// Builds a [`Consumer`]: where to read, as whom, with which decode
/// function and handler. Start with [`Consumer::builder`]; set the decode
/// function and the handler, then [`start`](Self::start). Every other
/// setting has a default; bad values are reported by `start` as a
/// [`ConfigError`], never a panic.
///
/// The type parameters are the decode function `D`, the handler `H` and
/// the verdict `V`; `()` until set.
#[must_use = "a builder does nothing until `start()` is called"]
pub struct ConsumerBuilder<D = (), H = (), V = AckAll> {
    pub(crate) config: Config,
    pub(crate) decode: D,
    pub(crate) handler: H,
    pub(crate) verdict: V,
    pub(crate) executor: Option<KeyedExecutor>,
    pub(crate) on_event: Option<EventHook>,
}

impl<D, H, V> fmt::Debug for ConsumerBuilder<D, H, V> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ConsumerBuilder")
            .field("config", &self.config)
            .field("executor", &self.executor)
            .finish_non_exhaustive()
    }
}

impl ConsumerBuilder {
    pub(crate) fn new(url: &str, streams: Streams) -> Self {
        ConsumerBuilder {
            config: Config {
                url: url.to_string(),
                streams,
                group: String::new(),
                name: String::new(),
                namespace: None,
                max_in_flight: 256,
                read_count: 128,
                block: Duration::from_millis(100),
                lease: Duration::from_secs(3),
                heartbeat: Duration::from_millis(200),
                hand_off_deadline: Duration::from_secs(5),
                claim_idle: None,
                dead_letters: DeadLetters::Default,
                create_groups: true,
                connect_timeout: Duration::from_secs(10),
                join_delay: Duration::ZERO,
                workers: None,
                io_threads: 1,
            },
            decode: (),
            handler: (),
            verdict: AckAll,
            executor: None,
            on_event: None,
        }
    }
}

impl<D, H, V> ConsumerBuilder<D, H, V> {
    /// The consumer group (required). The same on every node.
    pub fn group(mut self, group: impl Into<String>) -> Self {
        self.config.group = group.into();
        self
    }

    /// This node's name in the group (required): unique among the live
    /// nodes, no whitespace. A node that restarts under the same name
    /// takes its own partitions up again.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.config.name = name.into();
        self
    }

    /// The prefix of the group's coordination keys in Redis (members,
    /// leases, layout; see the crate docs). Default: the group name.
    pub fn namespace(mut self, prefix: impl Into<String>) -> Self {
        self.config.namespace = Some(prefix.into());
        self
    }

    /// Per partition, the most messages submitted and not finished (its
    /// receiver's credit): a slow handler slows that partition's reads.
    /// Default 256.
    pub fn max_in_flight(mut self, n: usize) -> Self {
        self.config.max_in_flight = n;
        self
    }

    /// Entries per read (`XREADGROUP … COUNT`, and per `XAUTOCLAIM`).
    /// Default 128.
    pub fn read_count(mut self, n: usize) -> Self {
        self.config.read_count = n;
        self
    }

    /// How long a read waits for new entries (`BLOCK`); also how late an
    /// ack may go out on an idle partition. Default 100 ms; at least 1 ms.
    pub fn block(mut self, block: Duration) -> Self {
        self.config.block = block;
        self
    }

    /// How long a node's membership and leases live without a heartbeat:
    /// how long a crashed node's partitions wait before another takes them.
    /// Default 3 s.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.config.lease = lease;
        self
    }

    /// How often a node renews its membership and leases and looks at the
    /// assignment; also how soon a released partition is taken up. At
    /// most a third of the lease. Default 200 ms.
    pub fn heartbeat(mut self, every: Duration) -> Self {
        self.config.heartbeat = every;
        self
    }

    /// How long a partition being handed off may take to finish its
    /// messages before the rest is force-stopped (handed back, left pending
    /// for the next owner). Default 5 s.
    pub fn hand_off_deadline(mut self, deadline: Duration) -> Self {
        self.config.hand_off_deadline = deadline;
        self
    }

    /// How long every pending entry of a vacant partition must have been
    /// idle before the new owner claims them (so nothing the dead owner
    /// may still deliver is taken from under it). Default: the lease.
    pub fn claim_idle(mut self, idle: Duration) -> Self {
        self.config.claim_idle = Some(idle);
        self
    }

    /// The dead-letter stream. Default `{namespace}:dead`. `None`: a
    /// message to dead-letter halts its partition instead (it stays
    /// pending; nothing is dropped).
    pub fn dead_letters(mut self, stream: Option<String>) -> Self {
        self.config.dead_letters = match stream {
            Some(s) => DeadLetters::Stream(s),
            None => DeadLetters::Off,
        };
        self
    }

    /// Create each stream and the group on it when missing (`XGROUP CREATE
    /// … 0 MKSTREAM`: the group starts at the stream's first entry).
    /// Default `true`; with `false`, a missing stream or group fails
    /// [`start`](Self::start) with [`StartError::GroupMissing`](crate::StartError::GroupMissing).
    pub fn create_groups(mut self, create: bool) -> Self {
        self.config.create_groups = create;
        self
    }

    /// How long [`start`](Self::start) keeps trying to reach Redis before
    /// it fails with [`StartError::Unreachable`](crate::StartError::Unreachable).
    /// Default 10 s.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.config.connect_timeout = timeout;
        self
    }

    /// Wait this long after joining before taking partitions, so that
    /// nodes started together split them without hand-offs. Default zero.
    pub fn join_delay(mut self, delay: Duration) -> Self {
        self.config.join_delay = delay;
        self
    }

    /// Worker threads of the executor made for this consumer (ignored with
    /// [`executor`](Self::executor)). Default: `keyed-executor`'s (the
    /// available parallelism).
    pub fn workers(mut self, n: usize) -> Self {
        self.config.workers = Some(n);
        self
    }

    /// Threads of the consumer's tokio runtime (its sockets, read loops
    /// and heartbeat). Default 1.
    pub fn io_threads(mut self, n: usize) -> Self {
        self.config.io_threads = n;
        self
    }

    /// Run the handler on this executor instead of one made for the
    /// consumer. The consumer makes a dispatcher on it and stops only that
    /// dispatcher. Handlers that use tokio (timers, sockets) need a runtime
    /// context on its workers (see `keyed-executor`'s docs, "Runtime
    /// interop"); an executor made for the consumer enters the consumer's
    /// own runtime on each worker.
    pub fn executor(mut self, executor: &KeyedExecutor) -> Self {
        self.executor = Some(executor.clone());
        self
    }

    /// Called with each [`Event`] (joins, take-overs, hand-offs, fences,
    /// halts, retried Redis errors), on the consumer's runtime: keep it
    /// short (log it, count it).
    pub fn on_event(mut self, hook: impl Fn(&Event) + Send + Sync + 'static) -> Self {
        self.on_event = Some(Arc::new(hook));
        self
    }

    /// The decode function: a stream entry's fields to `(key, message)`.
    /// An entry it refuses is dead-lettered with the error's text (and
    /// acked), never retried.
    pub fn decode<K, M, D2>(self, decode: D2) -> ConsumerBuilder<D2, H, V>
    where
        D2: Fn(&Entry) -> Result<(K, M), DecodeError> + Send + Sync + 'static,
    {
        ConsumerBuilder {
            config: self.config,
            decode,
            handler: self.handler,
            verdict: self.verdict,
            executor: self.executor,
            on_event: self.on_event,
        }
    }

    /// The handler: any [`Handler`] of `keyed-executor` — sync
    /// ([`handler::from_fn`](keyed_executor::handler::from_fn)), async
    /// ([`from_async_fn`](keyed_executor::handler::from_async_fn)),
    /// retrying ([`retrying`](keyed_executor::handler::retrying),
    /// [`retrying_async`](keyed_executor::handler::retrying_async)) or with
    /// deadlines ([`with_deadlines`](keyed_executor::handler::with_deadlines)).
    /// Messages of one key run one at a time, in stream order.
    pub fn handler<H2>(self, handler: H2) -> ConsumerBuilder<D, H2, V> {
        ConsumerBuilder {
            config: self.config,
            decode: self.decode,
            handler,
            verdict: self.verdict,
            executor: self.executor,
            on_event: self.on_event,
        }
    }

    /// What to do with each finished message, from the handler's output.
    /// Default: ack every one ([`AckAll`]).
    pub fn verdict<V2>(self, verdict: V2) -> ConsumerBuilder<D, H, V2> {
        ConsumerBuilder {
            config: self.config,
            decode: self.decode,
            handler: self.handler,
            verdict,
            executor: self.executor,
            on_event: self.on_event,
        }
    }
}

impl<K, M, D, H, V> ConsumerBuilder<D, H, V>
where
    K: std::hash::Hash + Eq + Clone + Send + Sync + 'static,
    M: Send + 'static,
    D: Fn(&Entry) -> Result<(K, M), DecodeError> + Send + Sync + 'static,
    H: Handler<K, M>,
    V: Decide<H::Output>,
{
    /// Validates the settings, connects (retrying for
    /// [`connect_timeout`](Self::connect_timeout)), checks the group's
    /// layout, creates the streams and groups if asked, joins the group
    /// and starts taking partitions. Blocks the calling thread until its
    /// first heartbeat went through (at most the connect timeout more) or
    /// it failed; from async code, call it in `tokio::task::spawn_blocking`.
    ///
    /// # Errors
    /// [`StartError`](crate::StartError): a bad setting, Redis unreachable,
    /// another layout recorded for the group, a missing group.
    pub fn start(self) -> Result<Consumer, crate::StartError> {
        Consumer::start(self)
    }
}
