//! Errors. Every error that refuses a message hands it back (`into_inner`),
//! and none of them needs the message type to implement `Debug`: their
//! `Debug` prints `Full(..)` the way crossbeam-channel prints `SendError { .. }`,
//! so `.unwrap()` and `?` work for any message type.

use std::any::Any;
use std::fmt;
use std::time::Duration;

/// A builder was given a value it cannot run with. The message names the
/// setting and says why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// `workers(0)`: the pool needs at least one thread.
    #[error("`workers` must be at least 1, got 0: the pool needs a thread to run messages")]
    ZeroWorkers,
    /// `workers(n)` above [`MAX_WORKERS`](crate::MAX_WORKERS).
    #[error("`workers` of {got} exceeds MAX_WORKERS ({max})")]
    TooManyWorkers {
        /// The value that was asked for.
        got: usize,
        /// The cap, [`MAX_WORKERS`](crate::MAX_WORKERS).
        max: usize,
    },
    /// `throughput(0)`: a turn must run at least one message.
    #[error(
        "`throughput` must be at least 1, got 0: a mailbox's turn must run at least one message"
    )]
    ZeroThroughput,
    /// `spin(d)` with `d` above [`MAX_SPIN`](crate::MAX_SPIN).
    #[error("`spin` of {spin:?} exceeds MAX_SPIN ({max:?}): a longer spin burns a core for no gain; use Duration::ZERO to park at once")]
    SpinTooLong {
        /// The value that was asked for.
        spin: Duration,
        /// The cap, [`MAX_SPIN`](crate::MAX_SPIN).
        max: Duration,
    },
    /// `thread_name(..)` with a name the OS cannot take (it contains a NUL byte).
    #[error("`thread_name` {0:?} is invalid: thread names must not contain a NUL byte")]
    InvalidThreadName(String),
    /// A receiver with `max_in_flight` 0 could never accept a message.
    #[error(
        "`max_in_flight` must be at least 1, got 0: the receiver could never accept a message"
    )]
    ZeroMaxInFlight,
    /// `max_in_flight(n)` above what a receiver can count.
    #[error("`max_in_flight` of {got} exceeds the most a receiver can hold ({max})")]
    MaxInFlightTooLarge {
        /// The value that was asked for.
        got: usize,
        /// The cap.
        max: usize,
    },
    /// `commit_span(n)` below the receiver's `max_in_flight` (it could
    /// never use all its credit) or above what it can track.
    #[error("`commit_span` of {got} must be between `max_in_flight` ({min}) and {max}: the span of unfinished positions must hold every message in flight")]
    InvalidCommitSpan {
        /// The value that was asked for.
        got: usize,
        /// The least it may be (the receiver's `max_in_flight`).
        min: usize,
        /// The most it may be.
        max: usize,
    },
    /// `lane_capacity(0)`: a lane must hold at least its leader's command.
    #[error("`lane_capacity` must be at least 1, got 0: a lane must hold at least one command")]
    ZeroLaneCapacity,
    /// `max_batch(0)`: a batch holds at least one command.
    #[error("`max_batch` must be at least 1, got 0: a batch holds at least one command (1 = never batch)")]
    ZeroMaxBatch,
    /// An in-flight limit of 0 would refuse every command.
    #[error("the in-flight limit must be at least 1, got 0: it would refuse every command")]
    ZeroInFlightLimit,
    /// `slow_step(Duration::ZERO)`: every step would be reported.
    #[error("`slow_step` must be above zero, got 0: every step would be reported as slow")]
    ZeroSlowStep,
    /// `on_slow_step(..)` without `slow_step(threshold)`: the hook would never
    /// be called.
    #[error(
        "`on_slow_step` needs `slow_step(threshold)`: without a threshold no step is reported"
    )]
    SlowStepHookWithoutThreshold,
    /// `metrics_sampling(n)` with `n` zero or not a power of two.
    #[error(
        "`metrics_sampling` must be a power of two (1, 2, 4, ..., 1 = every message), got {0}"
    )]
    InvalidMetricsSampling(u32),
    /// `max_attempts(0)` on a retry policy: the first attempt is one.
    #[error("`max_attempts` must be at least 1, got 0: the first attempt counts as one (1 = never retry)")]
    ZeroMaxAttempts,
    /// An exponential backoff whose `factor` is not a finite number above
    /// 1.0 (the value, printed).
    #[error("the `factor` of an exponential backoff must be a finite number above 1.0, got {0}: at or below 1.0 the delay never grows (use `Backoff::Fixed` for a steady delay)")]
    InvalidBackoffFactor(String),
    /// An exponential backoff whose `initial` delay is zero.
    #[error("the `initial` delay of an exponential backoff must be above zero: from zero it never grows (use `Backoff::Fixed(Duration::ZERO)` to retry at once)")]
    ZeroBackoffInitial,
    /// An exponential backoff whose `max` delay is below its `initial` one.
    #[error("the `max` delay of an exponential backoff ({max:?}) is below its `initial` delay ({initial:?})")]
    BackoffMaxBelowInitial {
        /// The delay after the first failure.
        initial: Duration,
        /// The cap that was asked for.
        max: Duration,
    },
    /// The operating system refused to start a worker thread.
    #[error("could not start worker thread `{name}`: {reason}")]
    Spawn {
        /// The thread's name.
        name: String,
        /// What the OS said.
        reason: String,
    },
}

/// A message was refused at submission; it is handed back.
///
/// `submit`, `submit_blocking` and `send` wait for credit and so only fail
/// with [`Closed`](SubmitError::Closed); the `try_` forms also fail with
/// [`Full`](SubmitError::Full).
pub enum SubmitError<M> {
    /// The receiver already holds `max_in_flight` unfinished messages.
    Full(M),
    /// The executor is shutting down (or was shut down); nothing new is taken.
    Closed(M),
}

impl<M> SubmitError<M> {
    /// The refused message.
    pub fn into_inner(self) -> M {
        match self {
            SubmitError::Full(m) | SubmitError::Closed(m) => m,
        }
    }

    /// The receiver was full.
    pub fn is_full(&self) -> bool {
        matches!(self, SubmitError::Full(_))
    }

    /// The executor was stopping or stopped.
    pub fn is_closed(&self) -> bool {
        matches!(self, SubmitError::Closed(_))
    }
}

impl<M> fmt::Debug for SubmitError<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SubmitError::Full(_) => f.write_str("Full(..)"),
            SubmitError::Closed(_) => f.write_str("Closed(..)"),
        }
    }
}

impl<M> fmt::Display for SubmitError<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            SubmitError::Full(_) => {
                f.write_str("receiver is full: max_in_flight messages are unfinished")
            }
            SubmitError::Closed(_) => f.write_str("executor is shut down: message refused"),
        }
    }
}

impl<M> std::error::Error for SubmitError<M> {}

/// An accepted message did not produce an output.
///
/// Non-exhaustive: ways for a message to end may be added (as
/// `DeadLettered` was); match with a wildcard arm.
#[non_exhaustive]
pub enum TaskError<M> {
    /// The handler (or its future) panicked. The mailbox and the worker went
    /// on with the next message.
    Panicked(Panic),
    /// A force stop ([`shutdown_now`](crate::KeyedExecutor::shutdown_now))
    /// took the message out of its queue before it started; it is handed back
    /// unprocessed, e.g. for redelivery.
    Rejected(M),
    /// A force stop dropped the message's suspended future: it started but did
    /// not finish, and will not.
    Cancelled,
    /// A retrying handler ([`handler::retrying`](crate::handler::retrying))
    /// gave the message up: its attempts ran out, or it failed in a way the
    /// policy does not retry. It counts as finished for the commit point.
    DeadLettered {
        /// How many attempts it had (the last one included).
        attempts: u32,
        /// The last failure, as text (its `Display`).
        error: String,
        /// The message, if no dead-letter hook took it
        /// ([`Retrying::on_dead_letter`](crate::handler::Retrying::on_dead_letter)).
        message: Option<M>,
    },
    /// The message's deadline passed before it started
    /// ([`handler::with_deadlines`](crate::handler::with_deadlines)): it
    /// was not run. It counts as finished for the commit point.
    Expired {
        /// The message, if no expiry hook took it
        /// ([`Deadlined::on_expire`](crate::handler::Deadlined::on_expire)).
        message: Option<M>,
    },
}

impl<M> TaskError<M> {
    /// The handler panicked.
    pub fn is_panic(&self) -> bool {
        matches!(self, TaskError::Panicked(_))
    }

    /// The message was rejected unprocessed by a force stop.
    pub fn is_rejected(&self) -> bool {
        matches!(self, TaskError::Rejected(_))
    }

    /// The message's future was dropped by a force stop.
    pub fn is_cancelled(&self) -> bool {
        matches!(self, TaskError::Cancelled)
    }

    /// A retrying handler gave the message up.
    pub fn is_dead_lettered(&self) -> bool {
        matches!(self, TaskError::DeadLettered { .. })
    }

    /// The message's deadline passed before it started.
    pub fn is_expired(&self) -> bool {
        matches!(self, TaskError::Expired { .. })
    }

    /// The same error with the message it holds (if any) mapped by `f`:
    /// for a handler that wraps another's messages.
    ///
    /// ```
    /// use keyed_executor::TaskError;
    ///
    /// let e: TaskError<u8> = TaskError::Rejected(7);
    /// assert_eq!(e.map_message(u32::from).into_message(), Some(7_u32));
    /// ```
    pub fn map_message<N>(self, f: impl FnOnce(M) -> N) -> TaskError<N> {
        match self {
            TaskError::Panicked(p) => TaskError::Panicked(p),
            TaskError::Rejected(m) => TaskError::Rejected(f(m)),
            TaskError::Cancelled => TaskError::Cancelled,
            TaskError::DeadLettered {
                attempts,
                error,
                message,
            } => TaskError::DeadLettered {
                attempts,
                error,
                message: message.map(f),
            },
            TaskError::Expired { message } => TaskError::Expired {
                message: message.map(f),
            },
        }
    }

    /// The message handed back, if this is [`Rejected`](TaskError::Rejected),
    /// or [`DeadLettered`](TaskError::DeadLettered) without a hook that took
    /// it.
    pub fn into_message(self) -> Option<M> {
        match self {
            TaskError::Rejected(m) => Some(m),
            TaskError::DeadLettered { message, .. } | TaskError::Expired { message } => message,
            _ => None,
        }
    }

    /// The panic, if this is [`Panicked`](TaskError::Panicked).
    pub fn into_panic(self) -> Option<Panic> {
        match self {
            TaskError::Panicked(p) => Some(p),
            _ => None,
        }
    }
}

impl<M> fmt::Debug for TaskError<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TaskError::Panicked(p) => f.debug_tuple("Panicked").field(p).finish(),
            TaskError::Rejected(_) => f.write_str("Rejected(..)"),
            TaskError::Cancelled => f.write_str("Cancelled"),
            TaskError::DeadLettered {
                attempts, error, ..
            } => f
                .debug_struct("DeadLettered")
                .field("attempts", attempts)
                .field("error", error)
                .finish_non_exhaustive(),
            TaskError::Expired { .. } => f.write_str("Expired(..)"),
        }
    }
}

impl<M> fmt::Display for TaskError<M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TaskError::Panicked(p) => write!(f, "handler panicked: {}", p.message()),
            TaskError::Rejected(_) => {
                f.write_str("message rejected by a force stop before it started")
            }
            TaskError::Cancelled => {
                f.write_str("message cancelled: a force stop dropped its suspended future")
            }
            TaskError::DeadLettered {
                attempts, error, ..
            } => write!(
                f,
                "message dead-lettered after {attempts} attempt(s): {error}"
            ),
            TaskError::Expired { .. } => {
                f.write_str("message expired: its deadline passed before it started")
            }
        }
    }
}

impl<M> std::error::Error for TaskError<M> {}

/// A caught panic: its message, and the payload for
/// [`std::panic::resume_unwind`].
pub struct Panic {
    message: String,
    payload: SyncPayload,
}

/// The payload is only reachable by value (`into_payload`), never through
/// `&self`, so sharing `&Panic` between threads cannot touch it.
struct SyncPayload(Box<dyn Any + Send + 'static>);

// SAFETY: `SyncPayload` exposes its content only by value (through
// `Panic::into_payload`), never by shared reference, so a `&SyncPayload` on
// another thread gives no access to the non-`Sync` payload.
unsafe impl Sync for SyncPayload {}

impl Panic {
    /// Wraps a panic's payload, as [`std::panic::catch_unwind`] returns it:
    /// for code that runs attempts itself and asks a
    /// [`RetryPolicy`](crate::RetryPolicy) about a [`Failure`](crate::Failure).
    ///
    /// ```
    /// use keyed_executor::Panic;
    ///
    /// let payload = std::panic::catch_unwind(|| panic!("out of {}", "cheese")).unwrap_err();
    /// assert_eq!(Panic::new(payload).message(), "out of cheese");
    /// ```
    pub fn new(payload: Box<dyn Any + Send + 'static>) -> Self {
        let message = if let Some(s) = payload.downcast_ref::<&'static str>() {
            (*s).to_owned()
        } else if let Some(s) = payload.downcast_ref::<String>() {
            s.clone()
        } else {
            "Box<dyn Any>".to_owned()
        };
        Panic {
            message,
            payload: SyncPayload(payload),
        }
    }

    /// The panic message (`"Box<dyn Any>"` when the payload was not a string).
    pub fn message(&self) -> &str {
        &self.message
    }

    /// The payload, e.g. for [`std::panic::resume_unwind`].
    pub fn into_payload(self) -> Box<dyn Any + Send + 'static> {
        self.payload.0
    }
}

impl fmt::Debug for Panic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Panic")
            .field("message", &self.message)
            .finish()
    }
}

impl fmt::Display for Panic {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct NotDebug;

    #[test]
    fn errors_print_without_debug_messages() {
        let e = SubmitError::Full(NotDebug);
        assert_eq!(format!("{e:?}"), "Full(..)");
        assert!(e.is_full());
        let e: TaskError<NotDebug> = TaskError::Rejected(NotDebug);
        assert_eq!(format!("{e:?}"), "Rejected(..)");
        assert!(e.into_message().is_some());
    }

    #[test]
    fn panic_keeps_message_and_payload() {
        let p = Panic::new(Box::new("boom"));
        assert_eq!(p.message(), "boom");
        let p = Panic::new(Box::new(String::from("bang")));
        assert_eq!(p.to_string(), "bang");
        let payload = p.into_payload();
        assert_eq!(payload.downcast_ref::<String>().unwrap(), "bang");
        let p = Panic::new(Box::new(7_u32));
        assert_eq!(p.message(), "Box<dyn Any>");
    }

    #[test]
    fn error_types_are_send_sync() {
        fn check<T: Send + Sync + 'static>() {}
        check::<SubmitError<u8>>();
        check::<TaskError<u8>>();
        check::<Panic>();
        check::<ConfigError>();
    }
}
