//! Dispatchers: one handler, and its ports: each key belongs to one port
//! by its hash, and a port holds its keys' inbox and mailboxes and runs
//! its turns on one worker at a time, its *home*.
//!
//! The port's runner owns its mailboxes: the port's map (key → mailbox,
//! keyed by the submitter's hash) lives under the port's *gate*, a lock
//! the runner takes per delivery and that stops, retirement and steals
//! take to touch the port. A port's turn takes its deliveries in order:
//! one for a key with a mailbox joins that mailbox's queue; one for a key
//! without runs at once, lent the port's free mailbox, with the gate
//! released, if the key has `throughput` left in its turn (see `Turns`),
//! and otherwise gets a mailbox with the message queued, at the back of
//! the worker's queue.
//!
//! The files, in the order a message meets them:
//!
//! - `mod.rs`: `DispatcherInner`, the public `Dispatcher` and its builder.
//! - `hasher.rs`: `DefaultHashBuilder`, the default key hasher.
//! - `route.rs`: a key's port, and the worker a port runs on (its home).
//! - `submit.rs`: a message (or a batch) into its port's inbox.
//! - `port.rs`: a port, its gate, and its state word (`PortState`).
//! - `turn.rs`: the port's turn, and its fairness bound.
//! - `slice.rs`: an idle worker's slice of a busy port's backlog.
//! - `keys.rs`: the key map, and a drained mailbox's retirement.
//! - `outcome.rs`: how a message ends, and what that gives back.
//! - `stop.rs`: source stops and the force stop; the races the gate decides.
//! - `erased.rs`: the type-erased faces it implements: `Runnable`
//!   (declared in `task.rs`), `StopTarget` (`shared.rs`), `Core`
//!   (`receiver/`).

mod erased;
mod hasher;
mod keys;
mod outcome;
mod port;
mod route;
mod slice;
mod stop;
mod submit;
mod turn;

pub use hasher::{DefaultHashBuilder, DefaultHasher};

use std::fmt;
use std::hash::{BuildHasher, Hash};
use std::marker::PhantomData;
use std::time::{Duration, Instant};

use crate::error::{ConfigError, Panic};
use crate::pool::handler::Handler;
use crate::pool::mailbox::Mailbox;
use crate::pool::observe::Identity;
use crate::pool::receiver::{Core, Receiver, ReceiverBuilder};
use crate::pool::shared::Shared;
use crate::pool::source::{wait_all_drained, Source};
use crate::pool::{PoolHasher, PoolKey};
use crate::sync::atomic::{AtomicBool, AtomicUsize, Ordering::*};
use crate::sync::Arc;

use erased::{CoreHandle, Target};
use port::{PaddedPort, Ports};
use route::port_count;

type RejectHook<K, M> = Box<dyn Fn(K, M) + Send + Sync + 'static>;
type PanicHook<K> = Box<dyn Fn(&K, Panic) + Send + Sync + 'static>;
/// A mailbox of this dispatcher's keys.
pub(crate) type KeyMailbox<K, M, H, S> = Mailbox<K, M, DispatcherInner<K, M, H, S>>;
pub(crate) type MailboxRef<K, M, H, S> = Arc<KeyMailbox<K, M, H, S>>;

/// The typed heart of a dispatcher. Mailboxes point back to it.
///
/// Aligned to a line pair of its own: its `Arc`'s counts (moved by every
/// port task and mailbox made) then sit on a line apart from the fields
/// every submit reads.
#[repr(align(128))]
pub(crate) struct DispatcherInner<K, M, H: Handler<K, M>, S> {
    pub(crate) shared: Arc<Shared>,
    pub(crate) handler: H,
    hasher: S,
    ports: Ports<PaddedPort<K, M, H, S>>,
    on_reject: Option<RejectHook<K, M>>,
    on_panic: Option<PanicHook<K>>,
    /// User-facing handles (`Dispatcher`s and `Receiver`s).
    handles: AtomicUsize,
    id: u64,
    /// Its name and metrics handles (see `observe.rs`).
    pub(crate) ident: Identity,
    /// The dispatcher refuses new messages (its own stop).
    closed: AtomicBool,
}

impl<K, M, H, S> DispatcherInner<K, M, H, S>
where
    K: PoolKey,
    M: Send + 'static,
    H: Handler<K, M>,
    S: PoolHasher,
{
    /// Whether the dispatcher (or the executor) refuses new messages.
    #[inline]
    pub(super) fn refuses(&self) -> bool {
        self.closed.load(SeqCst) || self.shared.is_closed()
    }

    /// With no handle left, the dispatcher leaves the executor's registry
    /// once nothing of it is in flight, freeing its spare mailboxes (which
    /// hold it).
    pub(crate) fn maybe_deregister(&self) {
        if self.handles.load(Acquire) == 0 {
            self.shared.deregister_if_idle(self.id);
        }
    }
}

/// Runs one handler for many keys: each key's messages one at a time, in
/// arrival order, on the executor's shared workers.
///
/// A dispatcher keeps a mailbox per key *while that key has work*; an idle
/// mailbox is removed, so memory follows the live keys. Feed it through one
/// or more [`Receiver`]s (one per source), each with its own credit.
///
/// `K` is the key, `M` the message and `O` the handler's output. Clones share
/// the same mailboxes. A dispatcher does not keep the executor's workers
/// alive: once the last [`KeyedExecutor`](crate::KeyedExecutor) handle is
/// dropped, it refuses new messages.
///
/// ```
/// use keyed_executor::{handler, KeyedExecutor};
///
/// let executor = KeyedExecutor::builder().workers(2).build()?;
/// let dispatcher = executor.dispatcher(handler::from_fn(|account: &u64, amount: i64| {
///     // apply `amount` to `account`: runs alone for this account
///     (*account, amount)
/// }));
/// let receiver = dispatcher.receiver(256)?;
/// let done = receiver.submit_blocking(7, 100)?;
/// assert_eq!(done.wait()?, (7, 100));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Dispatcher<K, M, O> {
    core: Box<dyn Core<K, M, O>>,
}

impl<K, M, O> Dispatcher<K, M, O> {
    /// A new receiver (source) holding at most `max_in_flight` unfinished
    /// messages, with the default commit span (see
    /// [`receiver_builder`](Self::receiver_builder) for more settings).
    ///
    /// # Errors
    /// [`ConfigError::ZeroMaxInFlight`] if `max_in_flight` is 0,
    /// [`ConfigError::MaxInFlightTooLarge`] beyond 2^40 − 1.
    pub fn receiver(&self, max_in_flight: usize) -> Result<Receiver<K, M, O>, ConfigError> {
        self.receiver_builder().max_in_flight(max_in_flight).build()
    }

    /// A new receiver like [`receiver`](Self::receiver), whose
    /// `keyed_executor_in_flight` series (with the `metrics` feature) is
    /// labelled `receiver = name` instead of its number in this dispatcher
    /// (`"0"`, `"1"`, …); the same as
    /// `receiver_builder().max_in_flight(max_in_flight).name(name).build()`
    /// (see [`ReceiverBuilder::name`]). Name the receivers of sources that
    /// come and go (a partition revoked and assigned again): the series is
    /// then reused rather than a new one made each time. Without the
    /// feature the name is not kept.
    ///
    /// # Errors
    /// As for [`receiver`](Self::receiver).
    pub fn named_receiver(
        &self,
        name: impl Into<String>,
        max_in_flight: usize,
    ) -> Result<Receiver<K, M, O>, ConfigError> {
        self.receiver_builder()
            .max_in_flight(max_in_flight)
            .name(name)
            .build()
    }

    /// A new receiver with the default `max_in_flight`
    /// ([`DEFAULT_MAX_IN_FLIGHT`](crate::DEFAULT_MAX_IN_FLIGHT), 256).
    pub fn default_receiver(&self) -> Receiver<K, M, O> {
        self.receiver_builder()
            .build()
            .expect("the defaults are valid")
    }

    /// Configures a new receiver: its credit, its commit span and its
    /// metrics label.
    pub fn receiver_builder(&self) -> ReceiverBuilder<K, M, O> {
        ReceiverBuilder::new(self.core.clone_box())
    }

    /// Its name ([`DispatcherBuilder::name`]; by default `dispatcher-{n}`,
    /// `n` counting this executor's dispatchers from 1).
    pub fn name(&self) -> &str {
        &self.core.ident().name
    }

    /// Keys with work right now: a mailbox with messages queued, running,
    /// or suspended on a future (a key that has none has no mailbox).
    /// Counting visits every mailbox: cheap enough to poll now and then, not
    /// per message.
    pub fn live_mailboxes(&self) -> usize {
        self.core.live_mailboxes()
    }

    /// Whether the dispatcher refuses new messages: it was shut down, or the
    /// executor is shutting down.
    pub fn is_closed(&self) -> bool {
        self.core.is_closed()
    }

    /// Stops this dispatcher (a component) gracefully while the others go
    /// on, on the same workers: from now on every receiver of it refuses new
    /// messages (`Closed(msg)`), and this waits until every message they
    /// accepted has ended. `true` if that happened within `timeout` (zero:
    /// look now); `false` if not (the messages go on; call again to wait
    /// more, or [`shutdown_now`](Self::shutdown_now)). Idempotent.
    ///
    /// A service stops its components first, then the executor:
    /// `dispatcher.shutdown(t)` for each, then
    /// [`KeyedExecutor::shutdown`](crate::KeyedExecutor::shutdown).
    ///
    /// Called from a handler (on a worker) it closes and says whether the
    /// dispatcher has drained, without waiting.
    pub fn shutdown(&self, timeout: Duration) -> bool {
        let shared = self.core.shared();
        self.core.close();
        let sources = shared.sources_of(Some(self.core.id()));
        // Submitters waiting for credit leave with their messages: after
        // the flag (see `Acquire`). A source made after this look sees the
        // flag when it first waits.
        for s in &sources {
            s.release_waiters();
        }
        let refs: Vec<&Source> = sources.iter().map(|s| &**s).collect();
        if crate::pool::worker::on_worker_of(shared.id()) {
            return refs.iter().all(|s| s.is_drained());
        }
        wait_all_drained(&refs, Instant::now().checked_add(timeout), false)
    }

    /// Stops this dispatcher now, as [`Receiver::shutdown_now`] does for one
    /// source, for all of its receivers: they refuse new messages, every
    /// queued message is handed back on the calling thread (through its
    /// [`Completion`](crate::Completion) as `Rejected(msg)`, or the
    /// `on_reject` hook), every suspended future is cancelled, and this
    /// waits for the steps running now. After it returns no message of this
    /// dispatcher starts; the other dispatchers go on. Idempotent.
    pub fn shutdown_now(&self) {
        let shared = self.core.shared();
        self.core.close();
        let sources = shared.sources_of(Some(self.core.id()));
        for s in &sources {
            s.stopper_enter();
            s.stop();
        }
        self.core.stop_sources(&|_| true);
        if !crate::pool::worker::on_worker_of(shared.id()) {
            let refs: Vec<&Source> = sources.iter().map(|s| &**s).collect();
            wait_all_drained(&refs, None, true);
        }
        for s in &sources {
            s.stopper_leave();
        }
        // As after the executor's force stop: the in-flight gauges show
        // what the stop handed back.
        shared.metrics.refresh_gauges();
    }
}

impl<K, M, O> Clone for Dispatcher<K, M, O> {
    fn clone(&self) -> Self {
        Dispatcher {
            core: self.core.clone_box(),
        }
    }
}

impl<K, M, O> fmt::Debug for Dispatcher<K, M, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Dispatcher")
            .field("name", &self.name())
            .field("live_mailboxes", &self.live_mailboxes())
            .finish()
    }
}

/// Configures a [`Dispatcher`]: hooks and the key hasher. Made by
/// [`KeyedExecutor::dispatcher_builder`](crate::KeyedExecutor::dispatcher_builder).
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use keyed_executor::{handler, KeyedExecutor};
///
/// let executor = KeyedExecutor::builder().workers(1).build()?;
/// let redeliver = Arc::new(Mutex::new(Vec::new()));
/// let sink = redeliver.clone();
/// let dispatcher = executor
///     .dispatcher_builder(handler::from_fn(|_: &u32, msg: String| msg.len()))
///     .on_reject(move |key, msg| sink.lock().unwrap().push((key, msg)))
///     .on_panic(|key, panic| eprintln!("handler for {key} panicked: {panic}"))
///     .build();
/// # drop(dispatcher);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[must_use = "a builder does nothing until `build()` is called"]
pub struct DispatcherBuilder<'e, K, M, H, S = DefaultHashBuilder> {
    /// The executor's state, borrowed from the `KeyedExecutor` handle.
    shared: &'e Arc<Shared>,
    handler: H,
    hasher: S,
    on_reject: Option<RejectHook<K, M>>,
    on_panic: Option<PanicHook<K>>,
    name: Option<String>,
    _types: PhantomData<fn(K, M)>,
}

impl<K, M, H, S> fmt::Debug for DispatcherBuilder<'_, K, M, H, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DispatcherBuilder")
            .field("name", &self.name)
            .field("on_reject", &self.on_reject.is_some())
            .field("on_panic", &self.on_panic.is_some())
            .finish_non_exhaustive()
    }
}

impl<'e, K, M, H> DispatcherBuilder<'e, K, M, H, DefaultHashBuilder> {
    pub(crate) fn new(shared: &'e Arc<Shared>, handler: H) -> Self {
        DispatcherBuilder {
            shared,
            handler,
            hasher: DefaultHashBuilder::new(),
            on_reject: None,
            on_panic: None,
            name: None,
            _types: PhantomData,
        }
    }
}

impl<'e, K, M, H, S> DispatcherBuilder<'e, K, M, H, S>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    M: Send + 'static,
    H: Handler<K, M>,
    S: BuildHasher + Clone + Send + Sync + 'static,
{
    /// Called with each fire-and-forget message ([`Receiver::send`] and
    /// friends) that a force stop hands back unprocessed, on the stopping
    /// thread. Messages with a completion handle come back through it instead
    /// ([`TaskError::Rejected`](crate::TaskError::Rejected)). Without a hook they are dropped (and counted
    /// in [`ExecutorStats::rejected`](crate::ExecutorStats::rejected)).
    pub fn on_reject(mut self, hook: impl Fn(K, M) + Send + Sync + 'static) -> Self {
        self.on_reject = Some(Box::new(hook));
        self
    }

    /// Called with the panic of a fire-and-forget message's handler (one with
    /// a completion handle reports it there instead), on the worker.
    pub fn on_panic(mut self, hook: impl Fn(&K, Panic) + Send + Sync + 'static) -> Self {
        self.on_panic = Some(Box::new(hook));
        self
    }

    /// The dispatcher's name, used in its metrics series (label
    /// `dispatcher`, with the `metrics` feature), its tracing events (field
    /// `dispatcher`), [`ExecutorStats::dispatchers`](crate::ExecutorStats::dispatchers),
    /// [`WorkerStats::current_step`](crate::WorkerStats::current_step) and
    /// slow-step reports. Default: `dispatcher-{n}`, `n` counting this
    /// executor's dispatchers from 1.
    ///
    /// Any string is taken as it is (`build` cannot fail); names need not
    /// be unique: dispatchers sharing a name share their series, which is
    /// what a component re-created after a restart wants. Give names when
    /// one process has several executors: their default names repeat.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// The hasher for keys (default: [`DefaultHashBuilder`], a fast hash
    /// seeded at random per dispatcher). For keys an adversary chooses and
    /// can probe, `std::hash::RandomState::new()` (SipHash) resists HashDoS
    /// better, at a cost on every submit.
    /// A faster non-keyed hasher is fine when keys are not attacker-chosen.
    pub fn hasher<S2>(self, hasher: S2) -> DispatcherBuilder<'e, K, M, H, S2>
    where
        S2: BuildHasher + Clone + Send + Sync + 'static,
    {
        DispatcherBuilder {
            shared: self.shared,
            handler: self.handler,
            hasher,
            on_reject: self.on_reject,
            on_panic: self.on_panic,
            name: self.name,
            _types: PhantomData,
        }
    }

    /// Creates the dispatcher on the executor's workers.
    pub fn build(self) -> Dispatcher<K, M, H::Output> {
        let shared = self.shared.clone();
        let id = shared.next_dispatcher_id();
        let inner = Arc::new(DispatcherInner {
            shared: shared.clone(),
            handler: self.handler,
            ports: Ports::new(port_count(shared.workers.len())),
            hasher: self.hasher,
            on_reject: self.on_reject,
            on_panic: self.on_panic,
            handles: AtomicUsize::new(0),
            id,
            ident: Identity::new(id, self.name),
            closed: AtomicBool::new(false),
        });
        let handle = CoreHandle::new(inner.clone());
        shared.register(Box::new(Target(inner)));
        Dispatcher {
            core: Box::new(handle),
        }
    }
}
