//! [`LanesEvent`]: what a [`Lanes`](super::Lanes) reports without failing
//! anyone's command: a failing commit hook, a fatal error recorded, a close
//! that timed out with busy lanes.
//!
//! Events go to the hook given to
//! [`LanesBuilder::on_event`](super::LanesBuilder::on_event), or, without
//! one, to standard error (with the `tracing` feature: a WARN event with
//! target `keyed_executor::lanes`). Their `Display` never prints keys (the key type
//! need not be `Debug`); a hook that can print keys reads them from the
//! variant.

use std::error::Error;
use std::fmt;

use super::fatal::Fatal;
use crate::error::Panic;

/// Something worth logging that fails no command.
#[non_exhaustive]
pub enum LanesEvent<'a, Key> {
    /// The commit hook returned an error for a committed batch. The batch's
    /// callers got their results anyway.
    CommitHookFailed {
        /// The lane.
        key: &'a Key,
        /// What the hook said.
        error: &'a (dyn Error + Send + Sync + 'static),
    },
    /// The commit hook panicked for a committed batch. The batch's callers got
    /// their results anyway.
    CommitHookPanicked {
        /// The lane.
        key: &'a Key,
        /// The panic.
        panic: &'a Panic,
    },
    /// The fatal-error classifier panicked; the error was not recorded as fatal.
    ClassifierPanicked {
        /// The lane.
        key: &'a Key,
        /// The panic.
        panic: &'a Panic,
    },
    /// The first fatal error of the node was recorded.
    FatalRecorded {
        /// The lane whose batch met it.
        key: &'a Key,
        /// The record.
        fatal: &'a Fatal,
    },
    /// Dropping a kernel future panicked (after it had already completed or
    /// panicked); ignored.
    KernelDropPanicked {
        /// The lane.
        key: &'a Key,
        /// The panic.
        panic: &'a Panic,
    },
    /// `close` timed out with these lanes still holding commands.
    CloseTimedOut {
        /// The lanes still busy.
        busy: &'a [Key],
        /// Commands taken and not finished.
        in_flight: usize,
    },
    /// An async `close` could not start its timer thread; it will notice its
    /// timeout only when polled.
    TimerUnavailable {
        /// What the OS said.
        reason: &'a str,
    },
}

impl<Key> fmt::Display for LanesEvent<'_, Key> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LanesEvent::CommitHookFailed { error, .. } => {
                write!(f, "commit hook failed (commands unaffected): {error}")
            }
            LanesEvent::CommitHookPanicked { panic, .. } => write!(
                f,
                "commit hook panicked (commands unaffected): {}",
                panic.message()
            ),
            LanesEvent::ClassifierPanicked { panic, .. } => {
                write!(f, "fatal-error classifier panicked: {}", panic.message())
            }
            LanesEvent::FatalRecorded { fatal, .. } => {
                write!(f, "fatal error recorded for the node: {fatal}")
            }
            LanesEvent::KernelDropPanicked { panic, .. } => {
                write!(f, "dropping a kernel future panicked: {}", panic.message())
            }
            LanesEvent::CloseTimedOut { busy, in_flight } => write!(
                f,
                "close timed out: {} lane(s) busy, {in_flight} command(s) unfinished",
                busy.len()
            ),
            LanesEvent::TimerUnavailable { reason } => {
                write!(f, "close could not start its timer thread: {reason}")
            }
        }
    }
}

impl<Key> fmt::Debug for LanesEvent<'_, Key> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "LanesEvent({self})")
    }
}
