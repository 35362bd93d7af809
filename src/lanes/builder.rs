//! [`LanesBuilder`]: settings and hooks of a [`Lanes`], checked by `build`.

use std::error::Error;
use std::fmt;

use super::accounts::Accounts;
use super::clock::{Clock, SystemClock};
use super::event::LanesEvent;
use super::fatal::NodeFatals;
use super::kernel::Kernel;
use super::shared::{Classifier, CommitHook, EventHook, Settings, Shared};
use super::Lanes;
use crate::error::ConfigError;
use crate::limit::{InFlightLimit, DEFAULT_IN_FLIGHT_LIMIT};
use crate::sync::Arc;

/// Default [`LanesBuilder::lane_capacity`].
pub const DEFAULT_LANE_CAPACITY: usize = 64;

/// Default [`LanesBuilder::max_batch`].
pub const DEFAULT_MAX_BATCH: usize = 32;

/// Builds a [`Lanes`]; see [`Lanes::builder`].
///
/// ```
/// # use keyed_executor::lanes::{BatchResult, Kernel, Lanes, ManualClock, NodeFatals};
/// # use keyed_executor::limit::InFlightLimit;
/// # use std::future::Future;
/// # struct Store;
/// # impl Kernel for Store {
/// #     type Key = u64; type Command = u64; type Output = u64; type Error = String;
/// #     fn execute_batch(&self, _: &u64, c: Vec<u64>)
/// #         -> impl Future<Output = BatchResult<u64, u64, String>> + Send {
/// #         async move { BatchResult::committed(c.into_iter().map(Ok).collect()) }
/// #     }
/// # }
/// let node_limit = InFlightLimit::new(10_000); // shared by every Lanes of the node
/// let node_fatals = NodeFatals::new();
/// let lanes = Lanes::builder(Store)
///     .lane_capacity(64)
///     .max_batch(32)
///     .limit(node_limit.clone())
///     .fatals(node_fatals.clone())
///     .fatal_if(|e: &String| e.contains("out of disk"))
///     .on_commit(|key, outcomes| {
///         // refresh a view of `key` from the committed outcomes
///         let _ = (key, outcomes.len());
///         Ok(())
///     })
///     .build()
///     .unwrap();
/// assert!(lanes.limit().same_as(&node_limit));
///
/// // Bad values are refused, never a panic:
/// assert!(Lanes::builder(Store).max_batch(0).build().is_err());
/// ```
#[must_use = "a builder does nothing until `build` is called"]
pub struct LanesBuilder<K: Kernel> {
    kernel: K,
    lane_capacity: usize,
    max_batch: usize,
    limit: Option<InFlightLimit>,
    clock: Box<dyn Clock>,
    classifier: Option<Box<Classifier<K>>>,
    fatals: Option<NodeFatals>,
    on_commit: Option<Box<CommitHook<K>>>,
    on_event: Option<Box<EventHook<K>>>,
    name: Option<String>,
}

impl<K: Kernel> LanesBuilder<K> {
    pub(crate) fn new(kernel: K) -> Self {
        LanesBuilder {
            kernel,
            lane_capacity: DEFAULT_LANE_CAPACITY,
            max_batch: DEFAULT_MAX_BATCH,
            limit: None,
            clock: Box::new(SystemClock),
            classifier: None,
            fatals: None,
            on_commit: None,
            on_event: None,
            name: None,
        }
    }

    /// Its name: the `lanes` label of its metrics series (with the
    /// `metrics` feature) and [`Lanes::name`]. Default: the kernel's type
    /// name ([`std::any::type_name`]), which stays the same across
    /// restarts. Any string is taken as it is; `Lanes` sharing a name share
    /// their series.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// At most this many commands wait in one lane (not counting those in
    /// its running batch); the next is refused as
    /// [`Busy`](super::LaneError::Busy). Default 64; 0 is refused by `build`.
    pub fn lane_capacity(mut self, capacity: usize) -> Self {
        self.lane_capacity = capacity;
        self
    }

    /// At most this many commands in one batch: the leader's own and up to
    /// `max_batch - 1` queued behind it. 1 runs every command alone. Default
    /// 32; 0 is refused by `build`.
    pub fn max_batch(mut self, max_batch: usize) -> Self {
        self.max_batch = max_batch;
        self
    }

    /// The node's bound on commands in flight, shared by every `Lanes` given
    /// a clone. Default: a limit of
    /// [`DEFAULT_IN_FLIGHT_LIMIT`] of this `Lanes`' own.
    pub fn limit(mut self, limit: InFlightLimit) -> Self {
        self.limit = Some(limit);
        self
    }

    /// The clock deadlines, the close timeout and the drain rate are read
    /// from. Default: [`SystemClock`]. Tests use a
    /// [`ManualClock`](super::ManualClock).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Box::new(clock);
        self
    }

    /// Where fatal errors are recorded; share one [`NodeFatals`] across the
    /// node's `Lanes`. Default: a record of this `Lanes`' own
    /// ([`Lanes::fatals`]).
    pub fn fatals(mut self, fatals: NodeFatals) -> Self {
        self.fatals = Some(fatals);
        self
    }

    /// Classifies kernel errors: the first error (of any command's outcome)
    /// for which `is_fatal` returns true is recorded, by its `Display`, in
    /// the [`NodeFatals`]. The command still fails with its error and the
    /// lane goes on. A panicking classifier is logged and counts as "not
    /// fatal".
    pub fn fatal_if<F>(mut self, is_fatal: F) -> Self
    where
        F: Fn(&K::Error) -> bool + Send + Sync + 'static,
        K::Error: fmt::Display,
    {
        self.classifier = Some(Box::new(move |e| is_fatal(e).then(|| e.to_string())));
        self
    }

    /// A hook that sees each committed batch's outcomes (views): it runs
    /// after the kernel returned and before the batch's callers get their
    /// outcomes and before the key's next batch starts, so nothing can change
    /// the aggregate while it runs. An error it returns, or a panic, is
    /// logged ([`LanesEvent::CommitHookFailed`] /
    /// [`LanesEvent::CommitHookPanicked`]) and never fails the committed
    /// commands. Batches that were not committed are not shown.
    pub fn on_commit<F>(mut self, hook: F) -> Self
    where
        F: Fn(&K::Key, &[Result<K::Output, K::Error>]) -> Result<(), Box<dyn Error + Send + Sync>>
            + Send
            + Sync
            + 'static,
    {
        self.on_commit = Some(Box::new(hook));
        self
    }

    /// Where [`LanesEvent`]s go. Default: standard error, one line each
    /// (keys are not printed: the key type need not be `Debug`); with the
    /// `tracing` cargo feature, a WARN event (target `keyed_executor::lanes`)
    /// instead.
    pub fn on_event<F>(mut self, hook: F) -> Self
    where
        F: Fn(&LanesEvent<'_, K::Key>) + Send + Sync + 'static,
    {
        self.on_event = Some(Box::new(hook));
        self
    }

    /// Checks the settings and builds the `Lanes`.
    ///
    /// Errors: [`ConfigError::ZeroLaneCapacity`], [`ConfigError::ZeroMaxBatch`],
    /// [`ConfigError::ZeroInFlightLimit`] (a limit made with
    /// `InFlightLimit::new(0)`).
    pub fn build(self) -> Result<Lanes<K>, ConfigError> {
        if self.lane_capacity == 0 {
            return Err(ConfigError::ZeroLaneCapacity);
        }
        if self.max_batch == 0 {
            return Err(ConfigError::ZeroMaxBatch);
        }
        let limit = self
            .limit
            .unwrap_or_else(|| InFlightLimit::new(DEFAULT_IN_FLIGHT_LIMIT));
        if limit.max() == 0 {
            return Err(ConfigError::ZeroInFlightLimit);
        }
        let shared = Shared::new(Settings {
            kernel: self.kernel,
            lane_capacity: self.lane_capacity,
            max_batch: self.max_batch,
            accounts: Accounts::new(limit),
            clock: self.clock,
            classifier: self.classifier,
            fatals: self.fatals.unwrap_or_default(),
            on_commit: self.on_commit,
            on_event: self.on_event,
            name: self
                .name
                .unwrap_or_else(|| std::any::type_name::<K>().to_owned()),
        });
        Ok(Lanes {
            shared: Arc::new(shared),
        })
    }
}

impl<K: Kernel> fmt::Debug for LanesBuilder<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LanesBuilder")
            .field("name", &self.name)
            .field("lane_capacity", &self.lane_capacity)
            .field("max_batch", &self.max_batch)
            .field("limit", &self.limit)
            .field("fatal_if", &self.classifier.is_some())
            .field("on_commit", &self.on_commit.is_some())
            .finish_non_exhaustive()
    }
}
