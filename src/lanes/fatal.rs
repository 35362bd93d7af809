//! [`NodeFatals`]: where the first fatal error a batch meets is recorded for
//! the node to act on (hand its partitions off, restart, …).
//!
//! Which errors are fatal is the user's call
//! ([`LanesBuilder::fatal_if`](super::LanesBuilder::fatal_if)). Recording does
//! not stop anything: the command still fails with its error, the lane goes
//! on, and the node reads [`NodeFatals::first`] when it decides to.

use std::fmt;

use crate::sync::{Arc, Mutex};

/// The first fatal error of a node, shared by every `Lanes` given a clone.
///
/// ```
/// use keyed_executor::lanes::NodeFatals;
///
/// let fatals = NodeFatals::new();
/// assert!(fatals.first().is_none());
/// assert!(fatals.record("disk full"));
/// assert!(!fatals.record("later error")); // only the first is kept
/// assert_eq!(fatals.first().unwrap().message(), "disk full");
/// ```
#[derive(Clone)]
pub struct NodeFatals {
    first: Arc<Mutex<Option<Fatal>>>,
}

/// A fatal error, as described by the error's `Display`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fatal {
    message: String,
}

impl Fatal {
    /// What the error said.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for Fatal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl NodeFatals {
    /// No fatal error yet.
    pub fn new() -> Self {
        NodeFatals {
            first: Arc::new(Mutex::new(None)),
        }
    }

    /// Records `message` if nothing was recorded before; true if it was.
    pub fn record(&self, message: impl Into<String>) -> bool {
        let mut first = self.first.lock();
        if first.is_some() {
            return false;
        }
        *first = Some(Fatal {
            message: message.into(),
        });
        true
    }

    /// The first fatal error, if any.
    pub fn first(&self) -> Option<Fatal> {
        self.first.lock().clone()
    }

    /// Whether a fatal error was recorded.
    pub fn is_fatal(&self) -> bool {
        self.first.lock().is_some()
    }

    /// Whether two handles share one record.
    pub fn same_as(&self, other: &NodeFatals) -> bool {
        Arc::ptr_eq(&self.first, &other.first)
    }
}

impl Default for NodeFatals {
    fn default() -> Self {
        Self::new()
    }
}

impl fmt::Debug for NodeFatals {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NodeFatals")
            .field("first", &self.first())
            .finish()
    }
}
