//! Lanes: run commands through a [`Kernel`] one batch at a time per key, in
//! arrival order, on the callers' own futures or threads, with group commit.
//!
//! Every key (aggregate) with commands in flight has a *lane*: a queue of its
//! commands in arrival order. A lane exists only while it has commands and
//! has no thread of its own: the first caller of an idle lane is its
//! *leader* and runs the work inside its own future (or blocking call). The
//! leader takes its own command and up to `max_batch - 1` queued behind it,
//! never waiting for more, and calls [`Kernel::execute_batch`] once: decide in
//! turn, commit the decided prefix with one append. So an idle key's command
//! runs alone, and a hot key commits a batch per append instead of a command
//! per append. Commands the kernel did not finish (`again`) go back to the
//! head of the lane in order; the lane then passes to the caller at its head,
//! who leads the next batch in *its* future. A caller waits for its own
//! command, never for others'.
//!
//! # Guarantees
//!
//! - **Order**: per key, at most one batch at a time, batches in arrival
//!   order; `again` commands keep their place at the head.
//! - **Bounded**: at most `lane_capacity` commands wait per lane, and the
//!   node's [`InFlightLimit`] bounds all lanes
//!   together; past either, [`LaneError::Busy`] with a `retry_after` hint
//!   from the observed drain rate ([formula](crate::limit#the-retry_after-formula)).
//! - **Withdrawal**: a command whose deadline passes while it still waits
//!   (checked when a batch is formed and whenever its caller is polled or its
//!   blocking wait wakes), or whose caller's future is dropped, never enters
//!   the kernel; [`LaneError::Withdrawn`] hands it back. No timers: async
//!   callers use their runtime's timeout, which drops the future.
//! - **Cancellation safety**: dropping any caller's future, the leader's
//!   included, at any await point never loses, duplicates or half-runs
//!   another caller's command. A batch that started always runs to its end —
//!   its future lives in the lane, and is driven by a remaining caller of
//!   the batch, else the next caller of the key, else [`Lanes::close`] — and
//!   its callers get their outcomes. Until one of those comes, a batch
//!   whose callers all left waits, suspended and still counted in
//!   [`Lanes::in_flight`]: there is no thread to run it.
//! - **Panics**: a panic in the kernel (creating or polling its future) fails
//!   that batch's commands with [`LaneError::Panicked`]; the lane goes on.
//! - **Fatals and views**: [`LanesBuilder::fatal_if`] records the first
//!   fatal error in [`NodeFatals`]; [`LanesBuilder::on_commit`] sees every
//!   committed batch before the key's next batch starts, and its failure is
//!   only logged.
//! - **Close**: [`Lanes::close`] refuses new commands at once and reports
//!   whether everything taken finished before the timeout.
//!
//! The lane's state machine is described at the top of `src/lanes/lane.rs`.
//!
//! # Example
//!
//! ```
//! use keyed_executor::lanes::{BatchResult, Kernel, Lanes};
//! use std::future::Future;
//! use std::time::Duration;
//!
//! /// A toy event store: one append per batch.
//! struct Accounts;
//!
//! impl Kernel for Accounts {
//!     type Key = u32;            // account id
//!     type Command = i64;        // amount to deposit
//!     type Output = i64;         // amount accepted
//!     type Error = String;
//!
//!     fn execute_batch(&self, _account: &u32, deposits: Vec<i64>)
//!         -> impl Future<Output = BatchResult<i64, i64, String>> + Send
//!     {
//!         async move {
//!             let outcomes = deposits
//!                 .into_iter()
//!                 .map(|d| if d > 0 { Ok(d) } else { Err(format!("bad deposit {d}")) })
//!                 .collect();
//!             // ... append the events of the accepted deposits, once ...
//!             BatchResult::committed(outcomes)
//!         }
//!     }
//! }
//!
//! let lanes = Lanes::builder(Accounts).build()?;
//! // From a plain thread:
//! assert_eq!(lanes.execute_blocking(7, 100, Duration::from_secs(1)).unwrap(), 100);
//! // From async code (any runtime):
//! let out = futures::executor::block_on(lanes.execute(7, -5));
//! assert_eq!(out.unwrap_err().into_kernel_error().unwrap(), "bad deposit -5");
//! assert!(lanes.close_blocking(Duration::from_secs(1)));
//! assert!(lanes.execute_blocking(7, 1, Duration::from_secs(1)).unwrap_err().is_closed());
//! # Ok::<(), keyed_executor::ConfigError>(())
//! ```

mod accounts;
mod builder;
mod clock;
mod close;
mod error;
mod event;
mod execute;
mod fatal;
mod kernel;
mod lane;
mod metrics;
mod park;
mod shared;

use std::fmt;
use std::time::{Duration, Instant};

pub use builder::{LanesBuilder, DEFAULT_LANE_CAPACITY, DEFAULT_MAX_BATCH};
pub use clock::{Clock, ManualClock, SystemClock};
pub use close::Close;
pub use error::{BusyReason, LaneError};
pub use event::LanesEvent;
pub use execute::Execute;
pub use fatal::{Fatal, NodeFatals};
pub use kernel::{BatchResult, Kernel};

use crate::limit::InFlightLimit;
use crate::sync::Arc;
use shared::Shared;

/// What [`Lanes::execute`] resolves to for kernel `K`.
pub type LaneResult<K> =
    Result<<K as Kernel>::Output, LaneError<<K as Kernel>::Command, <K as Kernel>::Error>>;

/// Per-key lanes over a [`Kernel`]; see the [module docs](self).
///
/// Cheap to clone: clones share the lanes, the counters and the kernel.
pub struct Lanes<K: Kernel> {
    shared: Arc<Shared<K>>,
}

impl<K: Kernel> Clone for Lanes<K> {
    fn clone(&self) -> Self {
        Lanes {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<K: Kernel> Lanes<K> {
    /// A builder with the defaults: `lane_capacity` 64, `max_batch` 32, an
    /// in-flight limit of 10 000 of its own, the system clock, no
    /// classifier, no commit hook, events to standard error.
    pub fn builder(kernel: K) -> LanesBuilder<K> {
        LanesBuilder::new(kernel)
    }

    /// Runs `command` in `key`'s lane; resolves to its output or why not.
    ///
    /// The command enters the lane at the first poll. Errors:
    /// [`Busy`](LaneError::Busy) and [`Closed`](LaneError::Closed) at once
    /// (command handed back), [`Kernel`](LaneError::Kernel) and
    /// [`Panicked`](LaneError::Panicked) from its batch. To bound the wait,
    /// use [`execute_with_deadline`](Self::execute_with_deadline) or your
    /// runtime's timeout (dropping the future withdraws the command if no
    /// batch took it yet).
    pub fn execute(&self, key: K::Key, command: K::Command) -> Execute<K> {
        Execute::new(Arc::clone(&self.shared), key, command, None)
    }

    /// Like [`execute`](Self::execute), but a command still waiting in its
    /// lane at `deadline` (by this `Lanes`' [`Clock`]) is withdrawn:
    /// [`Withdrawn(command)`](LaneError::Withdrawn), and the kernel never sees
    /// it. The deadline is checked when a batch is formed and each time this
    /// future is polled (no timer is armed: pair it with a runtime timeout if
    /// nothing else would poll it). A command already in a batch is not
    /// withdrawn: its outcome comes when the batch ends.
    pub fn execute_with_deadline(
        &self,
        key: K::Key,
        command: K::Command,
        deadline: Instant,
    ) -> Execute<K> {
        Execute::new(Arc::clone(&self.shared), key, command, Some(deadline))
    }

    /// Runs `command` from a plain thread, blocking it. `timeout` bounds the
    /// wait *in the lane*: if no batch has taken the command by then, it is
    /// withdrawn and handed back ([`Withdrawn`](LaneError::Withdrawn)). Once
    /// a batch took it, the call returns that batch's outcome (the kernel
    /// bounds its own I/O). The calling thread may lead its lane and run the
    /// kernel, exactly like an async caller.
    ///
    /// Do not call it from inside an async task: it blocks the task's thread.
    pub fn execute_blocking(
        &self,
        key: K::Key,
        command: K::Command,
        timeout: Duration,
    ) -> LaneResult<K> {
        let deadline = self.shared.now().checked_add(timeout);
        let shared = Arc::clone(&self.shared);
        let fut = Execute::new(Arc::clone(&self.shared), key, command, deadline);
        park::block_on(fut, move || {
            deadline.map(|d| d.saturating_duration_since(shared.now()))
        })
    }

    /// Stops taking commands at once (later ones fail with
    /// [`Closed(command)`](LaneError::Closed)) and resolves to `true` once
    /// every command already taken has finished, or `false` when `timeout`
    /// (by this `Lanes`' clock) passed first; the busy lanes are then logged
    /// ([`LanesEvent::CloseTimedOut`]) and listed by
    /// [`busy_keys`](Self::busy_keys).
    ///
    /// While polled it also drives batches whose callers all went away, so
    /// they run to their end. It needs no runtime timer: while pending it
    /// keeps one timer thread that wakes it at the deadline. A `timeout` too
    /// large to add to the clock's now (`Duration::MAX`) means no timeout
    /// and no timer thread.
    pub fn close(&self, timeout: Duration) -> Close<K> {
        self.shared.accounts.close();
        let deadline = self.shared.now().checked_add(timeout);
        Close::new(Arc::clone(&self.shared), deadline, true)
    }

    /// [`close`](Self::close) from a plain thread.
    pub fn close_blocking(&self, timeout: Duration) -> bool {
        self.shared.accounts.close();
        let deadline = self.shared.now().checked_add(timeout);
        let shared = Arc::clone(&self.shared);
        let fut = Close::new(Arc::clone(&self.shared), deadline, false);
        park::block_on(fut, move || {
            deadline.map(|d| d.saturating_duration_since(shared.now()))
        })
    }

    /// Whether [`close`](Self::close) was called.
    pub fn is_closed(&self) -> bool {
        self.shared.accounts.is_closed()
    }

    /// The lanes alive: keys with commands queued or in a running batch.
    pub fn lanes_alive(&self) -> usize {
        self.shared.lanes_alive()
    }

    /// The commands taken and not finished: waiting in their lanes or in
    /// the kernel.
    pub fn in_flight(&self) -> usize {
        self.shared.accounts.in_flight()
    }

    /// The keys whose lanes hold commands now (for a close that timed out).
    pub fn busy_keys(&self) -> Vec<K::Key> {
        self.shared.busy_keys()
    }

    /// Where fatal errors are recorded.
    pub fn fatals(&self) -> &NodeFatals {
        &self.shared.fatals
    }

    /// The in-flight limit this `Lanes` counts against.
    pub fn limit(&self) -> &InFlightLimit {
        &self.shared.accounts.limit
    }

    /// The kernel.
    pub fn kernel(&self) -> &K {
        &self.shared.kernel
    }

    /// The largest batch.
    pub fn max_batch(&self) -> usize {
        self.shared.max_batch
    }

    /// The most commands waiting in one lane.
    pub fn lane_capacity(&self) -> usize {
        self.shared.lane_capacity
    }

    /// Its name ([`LanesBuilder::name`]; by default the kernel's type name).
    pub fn name(&self) -> &str {
        &self.shared.name
    }
}

impl<K: Kernel> fmt::Debug for Lanes<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lanes")
            .field("lanes_alive", &self.lanes_alive())
            .field("in_flight", &self.in_flight())
            .field("closed", &self.is_closed())
            .field("max_batch", &self.shared.max_batch)
            .field("lane_capacity", &self.shared.lane_capacity)
            .finish_non_exhaustive()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    struct Echo;

    impl Kernel for Echo {
        type Key = u8;
        type Command = std::cell::Cell<u8>; // Send, not Sync
        type Output = u8;
        type Error = String;

        async fn execute_batch(
            &self,
            _key: &u8,
            commands: Vec<Self::Command>,
        ) -> BatchResult<Self::Command, u8, String> {
            BatchResult::committed(commands.into_iter().map(|c| Ok(c.get())).collect())
        }
    }

    #[test]
    fn handles_and_futures_cross_threads() {
        fn send<T: Send>() {}
        fn send_sync<T: Send + Sync>() {}
        send_sync::<Lanes<Echo>>();
        send::<Execute<Echo>>();
        send::<Close<Echo>>();
        send_sync::<LaneError<u8, String>>();
        send_sync::<NodeFatals>();
    }

    #[test]
    fn blocking_round_trip_and_debug() {
        let lanes = Lanes::builder(Echo).build().unwrap();
        let out = lanes.execute_blocking(1, std::cell::Cell::new(7), Duration::from_secs(1));
        assert_eq!(out.unwrap(), 7);
        assert_eq!(
            format!("{lanes:?}"),
            "Lanes { lanes_alive: 0, in_flight: 0, closed: false, max_batch: 32, lane_capacity: 64, .. }"
        );
        let fut = lanes.execute(1, std::cell::Cell::new(1));
        assert!(format!("{fut:?}").starts_with("Execute { state: \"Start\""));
    }
}
