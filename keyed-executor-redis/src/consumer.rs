//! The running node: how it starts, what its handle can do, how it stops.

use std::collections::BTreeSet;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use keyed_executor::handler::Handler;
use keyed_executor::KeyedExecutor;
use redis::{Client, RedisError, Script, Value};
use tokio::sync::{watch, Notify};
use tokio::task::JoinHandle;

use crate::builder::{Config, ConfigError, ConsumerBuilder, Decide, EventHook};
use crate::control::{control_loop, Spawn};
use crate::entry::{DecodeError, Entry};
use crate::layout::Streams;
use crate::link::{backoff_delay, Link};
use crate::partition::{run_partition, Ctx};
use crate::scripts;
use crate::stats::{Counters, Event, Stats};

/// Why a consumer did not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// A setting cannot work.
    #[error("bad setting: {0}")]
    Config(#[from] ConfigError),
    /// Redis did not answer within the connect timeout.
    #[error("Redis at {url} unreachable for {waited:?}: {source}")]
    Unreachable {
        /// The URL.
        url: String,
        /// How long `start` kept trying.
        waited: Duration,
        /// The last error.
        #[source]
        source: RedisError,
    },
    /// Redis records another set of partitions for this group: nodes that
    /// disagree on the partitions would route one key to two streams and
    /// lose its order, so this node refuses to start.
    #[error(
        "group {group:?} has {recorded_count} partitions recorded in Redis ({recorded}), but this \
         node was given {ours_count} ({ours}). Every node and producer of a group must use the \
         same streams; to change them, stop every node, drain the streams, and delete the key \
         {layout_key:?}"
    )]
    LayoutMismatch {
        /// The group.
        group: String,
        /// How many partitions Redis records.
        recorded_count: usize,
        /// Redis's streams, abridged.
        recorded: String,
        /// How many this node has.
        ours_count: usize,
        /// This node's streams, abridged.
        ours: String,
        /// The key that records the layout.
        layout_key: String,
    },
    /// A stream or its group does not exist, and the builder was told not
    /// to create them ([`ConsumerBuilder::create_groups`]).
    #[error(
        "stream {stream:?} has no consumer group {group:?} ({why}); create it (XGROUP CREATE \
         {stream} {group} 0 MKSTREAM) or let the consumer do it (create_groups(true))"
    )]
    GroupMissing {
        /// The stream.
        stream: String,
        /// The group.
        group: String,
        /// What Redis said.
        why: String,
    },
    /// Redis refused a command at start.
    #[error("Redis: {0}")]
    Redis(#[from] RedisError),
    /// The consumer's runtime could not be made.
    #[error("tokio runtime: {0}")]
    Runtime(#[from] std::io::Error),
}

/// [`Consumer::leave`] did not hand every partition off in time.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "partitions {partitions:?} were not handed off within {timeout:?}: they were force-stopped, \
     their messages handed back and left pending; other nodes take them once their leases expire"
)]
pub struct LeaveError {
    /// The partitions still owned at the deadline.
    pub partitions: Vec<usize>,
    /// The timeout given.
    pub timeout: Duration,
}

/// What the handle, the heartbeat and the partition loops share.
pub(crate) struct Common {
    pub(crate) config: Config,
    pub(crate) client: Client,
    pub(crate) counters: Counters,
    pub(crate) owned: Mutex<BTreeSet<usize>>,
    /// Every link's cut-off switch (see [`Link`]): set when the consumer is
    /// dropped without leaving.
    pub(crate) cut: Arc<AtomicBool>,
    /// Fault injection for tests: acks stop going out.
    pub(crate) stall_acks: AtomicBool,
    /// A partition's loop ended: the heartbeat handles it now rather than
    /// at its next tick.
    pub(crate) ended: Notify,
    on_event: Option<EventHook>,
}

impl Common {
    pub(crate) fn emit(&self, event: Event) {
        if let Some(hook) = &self.on_event {
            hook(&event);
        }
    }

    pub(crate) fn trouble(&self, what: impl fmt::Display) {
        crate::stats::bump(&self.counters.retries, 1);
        self.emit(Event::Trouble {
            what: what.to_string(),
        });
    }

    /// A link for one loop of this node, named `{namespace}:{name}:{role}`.
    pub(crate) fn link(&self, role: &str) -> Link {
        Link::new(
            self.client.clone(),
            format!("{}:{}:{role}", self.config.namespace(), self.config.name),
            self.config.response_timeout(),
            self.cut.clone(),
        )
    }

    pub(crate) fn set_owned(&self, owned: BTreeSet<usize>) {
        *self.owned.lock().unwrap_or_else(|p| p.into_inner()) = owned;
    }
}

/// A running node of a consumer group: it owns some of the group's
/// partitions (a [`Receiver`](keyed_executor::Receiver) each, on one
/// executor), hands them over when nodes join or leave, and takes over
/// those of nodes that died. Made by [`Consumer::builder`].
///
/// **Stopping.** [`leave`](Self::leave) hands every partition off
/// gracefully. **Dropping** the handle without `leave` stops the node at
/// once, as if its process died: no partition is released, its
/// dispatcher is force-stopped (queued messages handed back, suspended
/// ones cancelled; none is acked), nothing more is sent to Redis, and the
/// other nodes take its partitions over once its leases expire,
/// delivering again what it had not acked (at-least-once).
pub struct Consumer {
    common: Arc<Common>,
    runtime: Option<tokio::runtime::Runtime>,
    control: Option<JoinHandle<()>>,
    leave: watch::Sender<bool>,
    stop_now: Box<dyn Fn() + Send + Sync>,
    /// The executor made for this consumer, if it made one.
    own_executor: Option<KeyedExecutor>,
}

impl fmt::Debug for Consumer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Consumer")
            .field("name", &self.common.config.name)
            .field("group", &self.common.config.group)
            .field("owned", &self.owned())
            .finish_non_exhaustive()
    }
}

/// Runs `fut` on `runtime` and waits for it on this thread, from any
/// thread (inside another runtime's context too, where `block_on` would
/// panic).
fn wait_on<T: Send + 'static>(
    runtime: &tokio::runtime::Runtime,
    fut: impl std::future::Future<Output = T> + Send + 'static,
) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    runtime.spawn(async move {
        let _ = tx.send(fut.await);
    });
    rx.recv()
        .expect("the consumer's runtime runs until the handle drops")
}

impl Consumer {
    /// A builder for a node reading `streams` from the Redis at `url`
    /// (`redis://host:port/db`). Set at least [`group`](ConsumerBuilder::group),
    /// [`name`](ConsumerBuilder::name), [`decode`](ConsumerBuilder::decode)
    /// and [`handler`](ConsumerBuilder::handler).
    pub fn builder(url: &str, streams: Streams) -> ConsumerBuilder {
        ConsumerBuilder::new(url, streams)
    }

    pub(crate) fn start<K, M, D, H, V>(b: ConsumerBuilder<D, H, V>) -> Result<Consumer, StartError>
    where
        K: std::hash::Hash + Eq + Clone + Send + Sync + 'static,
        M: Send + 'static,
        D: Fn(&Entry) -> Result<(K, M), DecodeError> + Send + Sync + 'static,
        H: Handler<K, M>,
        V: Decide<H::Output>,
    {
        let config = b.config;
        config.validate()?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(config.io_threads)
            .thread_name(format!("{}-io", config.name))
            .enable_all()
            .build()?;
        let own_executor = match b.executor {
            Some(_) => None,
            None => {
                // Handlers that use tokio (timers, sockets) find the
                // consumer's runtime on every worker. The guard is
                // forgotten: a fresh thread has no earlier context.
                let handle = runtime.handle().clone();
                let mut builder = KeyedExecutor::builder()
                    .thread_name(format!("{}-worker", config.name))
                    .on_thread_start(move || std::mem::forget(handle.enter()));
                if let Some(n) = config.workers {
                    builder = builder.workers(n);
                }
                Some(builder.build().map_err(ConfigError::from)?)
            }
        };
        let executor = b
            .executor
            .as_ref()
            .or(own_executor.as_ref())
            .expect("one of them");
        let dispatcher = executor
            .dispatcher_builder(b.handler)
            .name(format!("redis:{}", config.group))
            .build();

        let client = Client::open(config.url.as_str()).map_err(|e| ConfigError::Url {
            url: config.url.clone(),
            why: e.to_string(),
        })?;
        let common = Arc::new(Common {
            client,
            counters: Counters::default(),
            owned: Mutex::new(BTreeSet::new()),
            cut: Arc::new(AtomicBool::new(false)),
            stall_acks: AtomicBool::new(false),
            ended: Notify::new(),
            on_event: b.on_event,
            config,
        });
        if let Err(e) = wait_on(&runtime, prepare(common.clone())) {
            dispatcher.shutdown_now();
            if let Some(executor) = &own_executor {
                executor.shutdown_now();
            }
            runtime.shutdown_background();
            return Err(e);
        }

        let ctx = Arc::new(Ctx {
            common: common.clone(),
            dispatcher: dispatcher.clone(),
            decode: Box::new(b.decode),
            verdict: Box::new(move |o: &H::Output| b.verdict.decide(o)),
        });
        let spawn: Spawn =
            Arc::new(move |p, how, stop| tokio::spawn(run_partition(ctx.clone(), p, how, stop)));
        let (leave, leave_rx) = watch::channel(false);
        let (joined_tx, joined_rx) = std::sync::mpsc::channel();
        let control = runtime.spawn(control_loop(common.clone(), spawn, leave_rx, joined_tx));
        // Wait for the first heartbeat: from here on the node is a member.
        let _ = joined_rx.recv_timeout(common.config.connect_timeout);
        Ok(Consumer {
            common,
            runtime: Some(runtime),
            control: Some(control),
            leave,
            stop_now: Box::new(move || dispatcher.shutdown_now()),
            own_executor,
        })
    }

    /// This node's name.
    pub fn name(&self) -> &str {
        &self.common.config.name
    }

    /// The partitions this node owns now: taking over, reading, or
    /// stopping; halted ones included.
    pub fn owned(&self) -> BTreeSet<usize> {
        self.common
            .owned
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// This node's counters, and per owned partition its state, lag and
    /// messages in flight.
    pub fn stats(&self) -> Stats {
        self.common.counters.snapshot()
    }

    /// Fault injection for tests: from now on this node's acks no longer go
    /// out while it goes on handling messages, as a process about to die
    /// whose work is never acked. What it finishes from now on is
    /// delivered again after it is gone.
    #[doc(hidden)]
    pub fn stall_acks(&self) {
        self.common.stall_acks.store(true, Ordering::SeqCst);
    }

    /// Leaves the group gracefully: every partition is handed off (its
    /// reads stop, its messages finish within the hand-off deadline or are
    /// force-stopped and handed back, what finished is acked, then its
    /// lease is released for the next owner), and the node leaves the
    /// membership. Blocks until done or `timeout`; then stops the
    /// consumer's loops and, if the consumer made its executor, that
    /// executor. A halted partition is not handed off: its entry stays
    /// pending and its lease expires, after which another node takes it
    /// up.
    ///
    /// # Errors
    /// [`LeaveError`] if partitions were still owned at `timeout`: they are
    /// force-stopped (nothing more is acked), and the other nodes take
    /// them over once their leases expire.
    pub fn leave(mut self, timeout: Duration) -> Result<(), LeaveError> {
        let _ = self.leave.send(true);
        let runtime = self.runtime.take().expect("running until leave or drop");
        let control = self.control.take().expect("running until leave or drop");
        let left = wait_on(&runtime, async move {
            matches!(tokio::time::timeout(timeout, control).await, Ok(Ok(())))
        });
        let result = if left {
            Ok(())
        } else {
            let partitions = self.owned().into_iter().collect();
            self.common.cut.store(true, Ordering::SeqCst);
            (self.stop_now)();
            Err(LeaveError {
                partitions,
                timeout,
            })
        };
        runtime.shutdown_background();
        if let Some(executor) = self.own_executor.take() {
            if !executor.shutdown(Duration::from_secs(5)) {
                executor.shutdown_now();
            }
        }
        result
    }
}

impl Drop for Consumer {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            // As a killed process: nothing more goes out, nothing released.
            self.common.cut.store(true, Ordering::SeqCst);
            (self.stop_now)();
            runtime.shutdown_background();
            if let Some(executor) = self.own_executor.take() {
                executor.shutdown_now();
            }
        }
    }
}

/// Connects (retrying until the connect timeout), checks the layout, and
/// checks or creates every stream's group.
async fn prepare(common: Arc<Common>) -> Result<(), StartError> {
    let cfg = &common.config;
    let link = common.link("start");
    let began = Instant::now();
    let mut attempt = 0;
    loop {
        match link.query::<String>(&redis::cmd("PING")).await {
            Ok(_) => break,
            Err(e) if crate::link::transient(&e) || e.kind() == redis::ErrorKind::Io => {
                let wait = backoff_delay(attempt);
                attempt += 1;
                if began.elapsed() + wait > cfg.connect_timeout {
                    return Err(StartError::Unreachable {
                        url: cfg.url.clone(),
                        waited: began.elapsed(),
                        source: e,
                    });
                }
                tokio::time::sleep(wait).await;
            }
            Err(e) => return Err(e.into()),
        }
    }

    let layout_script = Script::new(scripts::LAYOUT);
    let mut layout = layout_script.prepare_invoke();
    layout.key(cfg.layout_key()).arg(cfg.streams.fingerprint());
    let recorded: String = link.invoke(&layout).await?;
    if recorded != cfg.streams.fingerprint() {
        let recorded = Streams::list(recorded.lines());
        let abridged = |s: &Streams| format!("{s:?}");
        return Err(StartError::LayoutMismatch {
            group: cfg.group.clone(),
            recorded_count: recorded.len(),
            recorded: abridged(&recorded),
            ours_count: cfg.streams.len(),
            ours: abridged(&cfg.streams),
            layout_key: cfg.layout_key(),
        });
    }

    for stream in cfg.streams.iter() {
        if cfg.create_groups {
            let mut create = redis::cmd("XGROUP");
            create
                .arg("CREATE")
                .arg(stream)
                .arg(&cfg.group)
                .arg("0")
                .arg("MKSTREAM");
            match link.query::<()>(&create).await {
                Ok(()) => {}
                Err(e) if e.code() == Some("BUSYGROUP") => {}
                Err(e) => return Err(e.into()),
            }
        } else {
            let mut info = redis::cmd("XINFO");
            info.arg("GROUPS").arg(stream);
            let missing = |why: String| StartError::GroupMissing {
                stream: stream.to_string(),
                group: cfg.group.clone(),
                why,
            };
            match link.query::<Value>(&info).await {
                Ok(v) if group_names(&v).iter().any(|g| g == &cfg.group) => {}
                Ok(_) => return Err(missing("the stream has no such group".into())),
                Err(e)
                    if e.kind()
                        == redis::ErrorKind::Server(redis::ServerErrorKind::ResponseError) =>
                {
                    return Err(missing(e.to_string()))
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
    Ok(())
}

/// The group names in an `XINFO GROUPS` reply.
fn group_names(v: &Value) -> Vec<String> {
    crate::partition::info_groups(v)
        .into_iter()
        .map(|(name, _)| name)
        .collect()
}
