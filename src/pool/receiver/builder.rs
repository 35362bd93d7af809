//! [`ReceiverBuilder`]: a receiver's credit, commit tracking and commit
//! span, validated by `build`, and their defaults.

use std::fmt;

use super::{Core, Receiver};
use crate::error::ConfigError;
use crate::pool::source::{MAX_CREDIT, MAX_SPAN};

/// The default span of positions a receiver allows between its commit
/// point and its newest message, as a multiple of its `max_in_flight`
/// (see [`ReceiverBuilder::commit_span`]); never less than
/// [`MIN_DEFAULT_COMMIT_SPAN`].
///
/// Large on purpose: a slow message holds the commit point while the keys
/// behind it go on, and a span that fills stops the whole source (every
/// key), which is what work conservation is there to avoid. At 1,024
/// in flight and 180,000 msg/s, the default lets one message hold the
/// commit point for about 0.36 s. A consumer that wants a shorter
/// redelivery after a crash sets a smaller span.
pub const DEFAULT_COMMIT_SPAN_FACTOR: usize = 64;

/// The least default commit span (see [`DEFAULT_COMMIT_SPAN_FACTOR`]).
#[cfg(not(loom))]
pub const MIN_DEFAULT_COMMIT_SPAN: usize = 65536;
/// The least default commit span (small under loom, so that a model of a
/// few messages stays small).
#[cfg(loom)]
pub const MIN_DEFAULT_COMMIT_SPAN: usize = 4;

/// Builds a [`Receiver`]: its credit and its commit span. Made by
/// [`Dispatcher::receiver_builder`](crate::Dispatcher::receiver_builder).
///
/// ```
/// use keyed_executor::{handler, KeyedExecutor};
///
/// let executor = KeyedExecutor::builder().workers(1).build()?;
/// let dispatcher = executor.dispatcher(handler::from_fn(|_: &u8, n: u32| n));
/// let partition = dispatcher
///     .receiver_builder()
///     .max_in_flight(64)
///     .commit_span(1024)
///     .build()?;
/// assert_eq!(partition.commit_span(), Some(1024));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[must_use = "a builder does nothing until `build()` is called"]
pub struct ReceiverBuilder<K, M, O> {
    core: Box<dyn Core<K, M, O>>,
    max_in_flight: usize,
    commit_span: Option<usize>,
    track_commits: bool,
    name: Option<String>,
}

impl<K, M, O> ReceiverBuilder<K, M, O> {
    pub(crate) fn new(core: Box<dyn Core<K, M, O>>) -> Self {
        ReceiverBuilder {
            core,
            max_in_flight: crate::DEFAULT_MAX_IN_FLIGHT,
            commit_span: None,
            track_commits: false,
            name: None,
        }
    }

    /// The most unfinished messages (queued or running) the receiver
    /// holds. Default [`DEFAULT_MAX_IN_FLIGHT`](crate::DEFAULT_MAX_IN_FLIGHT).
    pub fn max_in_flight(mut self, n: usize) -> Self {
        self.max_in_flight = n;
        self
    }

    /// Whether the receiver keeps a commit point: it then records how each
    /// message ended at its position, and [`Receiver::committable`] says
    /// how many leading positions all finished — what a partitioned
    /// consumer commits (a Kafka offset, a stream ID). Default `false`: a
    /// receiver that does not track commits pays nothing per message for
    /// it (its `committable()` is `None`), which is what a source without
    /// offsets wants. Positions are given out either way.
    ///
    /// Cost when on: a short lock per finished message, and one bit per
    /// position that finished ahead of one still running (none while the
    /// receiver is idle).
    pub fn track_commits(mut self, on: bool) -> Self {
        self.track_commits = on;
        self
    }

    /// The most positions between the commit point and the newest one
    /// accepted: when a slow message holds the commit point, the receiver
    /// accepts this many messages past it, then submitters wait (as they
    /// wait for credit) until it finishes — a consumer's uncommitted tail,
    /// and what it redelivers after a crash, stays this short. Default
    /// [`DEFAULT_COMMIT_SPAN_FACTOR`] × `max_in_flight`, at least
    /// [`MIN_DEFAULT_COMMIT_SPAN`]; it must be at least `max_in_flight`.
    /// Setting it turns [`track_commits`](Self::track_commits) on; without
    /// commit tracking there is no cap. Memory: one bit per position that
    /// finished ahead of the commit point, so at most `n / 8` bytes while
    /// a slow message holds it.
    ///
    /// Messages a handler forwards by inheriting its own message's unit
    /// are not held by the cap (a handler never waits).
    pub fn commit_span(mut self, n: usize) -> Self {
        self.commit_span = Some(n);
        self.track_commits = true;
        self
    }

    /// Its `receiver` label in the `keyed_executor_in_flight` series (with
    /// the `metrics` feature) instead of its number in its dispatcher
    /// (`"0"`, `"1"`, …). Name the receivers of sources that come and go
    /// (a partition revoked and assigned again): the series is then reused
    /// rather than a new one made each time. Without the feature the name
    /// is not kept.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
        self
    }

    /// The receiver.
    ///
    /// # Errors
    /// [`ConfigError::ZeroMaxInFlight`], [`ConfigError::MaxInFlightTooLarge`],
    /// [`ConfigError::InvalidCommitSpan`].
    pub fn build(self) -> Result<Receiver<K, M, O>, ConfigError> {
        let max = self.max_in_flight;
        if max == 0 {
            return Err(ConfigError::ZeroMaxInFlight);
        }
        if max > MAX_CREDIT {
            return Err(ConfigError::MaxInFlightTooLarge {
                got: max,
                max: MAX_CREDIT,
            });
        }
        let span = match self.commit_span {
            Some(n) if n < max || n > MAX_SPAN => {
                return Err(ConfigError::InvalidCommitSpan {
                    got: n,
                    min: max,
                    max: MAX_SPAN,
                })
            }
            Some(n) => n,
            None => max
                .saturating_mul(DEFAULT_COMMIT_SPAN_FACTOR)
                .clamp(MIN_DEFAULT_COMMIT_SPAN, MAX_SPAN),
        };
        Ok(Receiver::new(
            self.core,
            max,
            span,
            self.track_commits,
            self.name,
        ))
    }
}

impl<K, M, O> fmt::Debug for ReceiverBuilder<K, M, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReceiverBuilder")
            .field("max_in_flight", &self.max_in_flight)
            .field("commit_span", &self.commit_span)
            .field("track_commits", &self.track_commits)
            .field("name", &self.name)
            .finish()
    }
}
