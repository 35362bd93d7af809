//! [`LaneError`]: why a command did not produce an output.
//!
//! Refused and withdrawn commands are handed back inside the error
//! ([`into_command`](LaneError::into_command)); `Debug` and `Display` never
//! need the command type to be `Debug` (they print `Closed(..)`), so
//! `.unwrap()` and `?` work for any command type.

use std::fmt;
use std::time::Duration;

use crate::error::Panic;

/// Which bound refused a command as [`Busy`](LaneError::Busy).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BusyReason {
    /// The key's lane already held `lane_capacity` waiting commands.
    LaneFull,
    /// The node's [`InFlightLimit`](crate::limit::InFlightLimit) was exhausted.
    InFlightLimit,
}

/// A command did not produce an output.
///
/// | variant | did the kernel see the command? | command handed back? |
/// |---|---|---|
/// | [`Busy`](Self::Busy) | no | yes |
/// | [`Withdrawn`](Self::Withdrawn) | no (at most handed back undecided) | yes |
/// | [`Closed`](Self::Closed) | no | yes |
/// | [`Kernel`](Self::Kernel) | yes: decided and rejected, or its append failed | no |
/// | [`Panicked`](Self::Panicked) | yes (its batch panicked) | no |
///
/// ```
/// use keyed_executor::lanes::LaneError;
///
/// struct NotDebug;
/// let e: LaneError<NotDebug, String> = LaneError::Closed(NotDebug);
/// assert_eq!(format!("{e:?}"), "Closed(..)");
/// assert!(e.is_closed());
/// let _back: NotDebug = e.into_command().unwrap();
/// ```
pub enum LaneError<C, E> {
    /// Refused at once: the lane is full or the node's in-flight limit is
    /// reached. Retry after about `retry_after` (see
    /// [`limit`](crate::limit) for how it is estimated).
    Busy {
        /// The refused command.
        command: C,
        /// A hint derived from the observed drain rate.
        retry_after: Duration,
        /// Which bound refused it.
        reason: BusyReason,
    },
    /// The command waited in its lane past its deadline and was taken out
    /// before any batch took it (or after the kernel handed it back as
    /// `again`, undecided): the kernel never decided it, so a retry runs it
    /// afresh.
    Withdrawn(C),
    /// The `Lanes` was closing or closed: the command was not taken.
    Closed(C),
    /// The kernel decided the command and rejected it, or the append of its
    /// batch failed.
    Kernel(E),
    /// The kernel panicked in the command's batch (or broke the
    /// [`BatchResult`](super::BatchResult) contract, which the message says).
    /// The lane went on with its next batch.
    Panicked(Panic),
}

impl<C, E> LaneError<C, E> {
    /// The command, if it was handed back (`Busy`, `Withdrawn`, `Closed`).
    pub fn into_command(self) -> Option<C> {
        match self {
            LaneError::Busy { command, .. } | LaneError::Withdrawn(command) => Some(command),
            LaneError::Closed(command) => Some(command),
            LaneError::Kernel(_) | LaneError::Panicked(_) => None,
        }
    }

    /// The command handed back, by reference.
    pub fn command(&self) -> Option<&C> {
        match self {
            LaneError::Busy { command, .. } | LaneError::Withdrawn(command) => Some(command),
            LaneError::Closed(command) => Some(command),
            LaneError::Kernel(_) | LaneError::Panicked(_) => None,
        }
    }

    /// The kernel's error, if this is [`Kernel`](Self::Kernel).
    pub fn into_kernel_error(self) -> Option<E> {
        match self {
            LaneError::Kernel(e) => Some(e),
            _ => None,
        }
    }

    /// The panic, if this is [`Panicked`](Self::Panicked).
    pub fn into_panic(self) -> Option<Panic> {
        match self {
            LaneError::Panicked(p) => Some(p),
            _ => None,
        }
    }

    /// The retry hint, if this is [`Busy`](Self::Busy).
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            LaneError::Busy { retry_after, .. } => Some(*retry_after),
            _ => None,
        }
    }

    /// Refused by a full lane or the in-flight limit.
    pub fn is_busy(&self) -> bool {
        matches!(self, LaneError::Busy { .. })
    }

    /// Withdrawn before any batch took it.
    pub fn is_withdrawn(&self) -> bool {
        matches!(self, LaneError::Withdrawn(_))
    }

    /// Refused because the `Lanes` is closing or closed.
    pub fn is_closed(&self) -> bool {
        matches!(self, LaneError::Closed(_))
    }

    /// Failed in the kernel.
    pub fn is_kernel(&self) -> bool {
        matches!(self, LaneError::Kernel(_))
    }

    /// Its batch panicked.
    pub fn is_panic(&self) -> bool {
        matches!(self, LaneError::Panicked(_))
    }
}

impl<C, E: fmt::Debug> fmt::Debug for LaneError<C, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LaneError::Busy {
                retry_after,
                reason,
                ..
            } => f
                .debug_struct("Busy")
                .field("retry_after", retry_after)
                .field("reason", reason)
                .finish_non_exhaustive(),
            LaneError::Withdrawn(_) => f.write_str("Withdrawn(..)"),
            LaneError::Closed(_) => f.write_str("Closed(..)"),
            LaneError::Kernel(e) => f.debug_tuple("Kernel").field(e).finish(),
            LaneError::Panicked(p) => f.debug_tuple("Panicked").field(p).finish(),
        }
    }
}

impl<C, E: fmt::Display> fmt::Display for LaneError<C, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LaneError::Busy {
                retry_after,
                reason: BusyReason::LaneFull,
                ..
            } => write!(
                f,
                "busy: the key's lane is full; retry after {retry_after:?}"
            ),
            LaneError::Busy {
                retry_after,
                reason: BusyReason::InFlightLimit,
                ..
            } => write!(
                f,
                "busy: the node's in-flight limit is reached; retry after {retry_after:?}"
            ),
            LaneError::Withdrawn(_) => f.write_str(
                "command withdrawn: its deadline passed before a batch took it; it never ran",
            ),
            LaneError::Closed(_) => f.write_str("lanes closed: command refused"),
            LaneError::Kernel(e) => write!(f, "command failed: {e}"),
            LaneError::Panicked(p) => write!(f, "kernel panicked: {}", p.message()),
        }
    }
}

impl<C, E> std::error::Error for LaneError<C, E>
where
    E: std::error::Error + 'static,
{
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            LaneError::Kernel(e) => Some(e),
            _ => None,
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::error::Error as _;

    struct NotDebug;

    #[derive(Debug)]
    struct StoreDown;
    impl fmt::Display for StoreDown {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("store down")
        }
    }
    impl std::error::Error for StoreDown {}

    #[test]
    fn prints_without_debug_commands() {
        let e: LaneError<NotDebug, StoreDown> = LaneError::Busy {
            command: NotDebug,
            retry_after: Duration::from_millis(5),
            reason: BusyReason::LaneFull,
        };
        assert_eq!(
            format!("{e:?}"),
            "Busy { retry_after: 5ms, reason: LaneFull, .. }"
        );
        assert!(e.to_string().contains("lane is full"));
        assert_eq!(e.retry_after(), Some(Duration::from_millis(5)));
        assert!(e.is_busy());
        assert!(e.into_command().is_some());
        let e: LaneError<NotDebug, StoreDown> = LaneError::Withdrawn(NotDebug);
        assert_eq!(format!("{e:?}"), "Withdrawn(..)");
        assert!(e.command().is_some());
    }

    #[test]
    fn kernel_error_is_the_source() {
        let e: LaneError<NotDebug, StoreDown> = LaneError::Kernel(StoreDown);
        assert_eq!(e.to_string(), "command failed: store down");
        assert!(e.source().is_some());
        assert!(e.is_kernel());
        assert!(e.into_kernel_error().is_some());
        let e: LaneError<NotDebug, StoreDown> = LaneError::Panicked(Panic::new(Box::new("boom")));
        assert_eq!(e.to_string(), "kernel panicked: boom");
        assert!(e.into_panic().is_some());
    }

    #[test]
    fn is_send_sync() {
        fn check<T: Send + Sync + 'static>() {}
        check::<LaneError<u8, String>>();
    }
}
