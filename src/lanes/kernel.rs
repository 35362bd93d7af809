//! The [`Kernel`] trait a [`Lanes`](super::Lanes) runs commands through, and
//! the [`BatchResult`] it answers a batch with.
//!
//! A kernel is the decide-and-append step of an event-sourced command path:
//! given an aggregate's key and a batch of its commands, it decides them in
//! order against the aggregate's state, commits the events of the decided
//! prefix with **one** append, and hands back the commands it did not get to
//! (`again`). The lane re-queues those at its head, in order, so the next
//! batch starts with them.
//!
//! # One error, several callers
//!
//! When the append fails, every command of the decided prefix fails with the
//! same error. A [`BatchResult`] holds one `Result` per command, so that error
//! must reach each caller: [`BatchResult::failed`] clones it, and is the only
//! place that needs `Error: Clone`. A kernel whose error is not `Clone` (an
//! `std::io::Error`, say) either declares `type Error = Arc<MyError>` and
//! uses `failed`, or builds the per-command results itself with
//! [`BatchResult::not_committed`].

use std::future::Future;
use std::hash::Hash;

/// Decides and commits batches of commands for one key at a time.
///
/// [`Lanes`](super::Lanes) guarantees, per key: at most one
/// `execute_batch` future at a time, batches in arrival order, and each
/// command in at most one batch unless the kernel handed it back as `again`.
/// Different keys run concurrently, so `&self` is shared.
///
/// The future runs on the callers' tasks or threads (whoever is driving the
/// lane), never on threads of the crate's own, and may be polled by
/// different callers in turn (the driving passes on when a caller goes
/// away), hence `Send`. Once started it is polled to its end; it is dropped
/// early only if every handle to the `Lanes` and every caller is gone. A
/// panic, in `execute_batch` or while its future is polled, fails the
/// batch's commands with [`LaneError::Panicked`](super::LaneError::Panicked)
/// and the lane goes on.
///
/// A kernel must not execute commands of the key it is running a batch for
/// through the same `Lanes` and wait for them: they queue behind the running
/// batch, which would wait for itself.
///
/// ```
/// use keyed_executor::lanes::{BatchResult, Kernel};
/// use std::future::Future;
///
/// /// Adds each command to a counter; one "append" per batch.
/// struct Counter;
///
/// impl Kernel for Counter {
///     type Key = u64;
///     type Command = u64;
///     type Output = u64;
///     type Error = String;
///
///     fn execute_batch(
///         &self,
///         _key: &u64,
///         commands: Vec<u64>,
///     ) -> impl Future<Output = BatchResult<u64, u64, String>> + Send {
///         async move {
///             let outcomes = commands.into_iter().map(|c| Ok(c * 2)).collect();
///             BatchResult::committed(outcomes)
///         }
///     }
/// }
/// ```
pub trait Kernel: Send + Sync + 'static {
    /// The aggregate a lane serializes (an account id, an order id, …).
    type Key: Hash + Eq + Clone + Send + Sync + 'static;
    /// What a caller asks for.
    type Command: Send + 'static;
    /// What a caller gets back when its command was decided and committed.
    type Output: Send + 'static;
    /// Why a command failed (rejected by decide, or the append failed).
    type Error: Send + 'static;

    /// Decides `commands` in order, commits the decided prefix with one
    /// append, and hands back the rest as `again`.
    ///
    /// The result must hold exactly one outcome per decided command, in
    /// order, followed by the undecided commands, in order:
    /// `outcomes.len() + again.len() == commands.len()`. A result that breaks
    /// this fails every command of the batch with
    /// [`LaneError::Panicked`](super::LaneError::Panicked) naming the counts.
    fn execute_batch(
        &self,
        key: &Self::Key,
        commands: Vec<Self::Command>,
    ) -> impl Future<Output = BatchResult<Self::Command, Self::Output, Self::Error>> + Send;
}

/// What a [`Kernel`] made of a batch: one outcome per decided command (the
/// prefix), whether the prefix was committed, and the commands it handed back.
///
/// ```
/// use keyed_executor::lanes::BatchResult;
///
/// // Decided the first two (one rejected by decide), appended, left the third.
/// let r: BatchResult<&str, u32, String> =
///     BatchResult::committed(vec![Ok(1), Err("overdrawn".to_string())]).with_again(vec!["c"]);
/// assert!(r.is_committed());
/// assert_eq!(r.decided(), 2);
/// assert_eq!(r.again(), &["c"]);
///
/// // The append failed: both decided commands fail with the store's error.
/// let r: BatchResult<&str, u32, String> =
///     BatchResult::failed(2, "store unavailable".to_string()).with_again(vec!["c"]);
/// assert!(!r.is_committed());
/// assert_eq!(r.outcomes()[1], Err("store unavailable".to_string()));
/// ```
#[must_use = "a BatchResult carries the callers' outcomes and the commands to run again"]
pub struct BatchResult<C, O, E> {
    outcomes: Vec<Result<O, E>>,
    committed: bool,
    again: Vec<C>,
}

impl<C, O, E> BatchResult<C, O, E> {
    /// The prefix was committed (its append succeeded, or it had nothing to
    /// append): one outcome per decided command, in order. `Err` outcomes are
    /// commands the decision rejected; they fail on their own.
    ///
    /// The [commit hook](super::LanesBuilder::on_commit) sees committed
    /// batches only.
    pub fn committed(outcomes: Vec<Result<O, E>>) -> Self {
        BatchResult {
            outcomes,
            committed: true,
            again: Vec::new(),
        }
    }

    /// The prefix was not committed; each decided command gets the given
    /// outcome (usually an `Err` each). Use this when `E` is not `Clone`.
    pub fn not_committed(outcomes: Vec<Result<O, E>>) -> Self {
        BatchResult {
            outcomes,
            committed: false,
            again: Vec::new(),
        }
    }

    /// The append of the first `decided` commands failed: each of them fails
    /// with a clone of `error`.
    pub fn failed(decided: usize, error: E) -> Self
    where
        E: Clone,
    {
        let mut outcomes = Vec::with_capacity(decided);
        if decided > 0 {
            outcomes.extend((1..decided).map(|_| Err(error.clone())));
            outcomes.push(Err(error));
        }
        BatchResult {
            outcomes,
            committed: false,
            again: Vec::new(),
        }
    }

    /// Nothing was decided: every command goes back to the head of its lane,
    /// in order, and the next batch retries them (a kernel that does this
    /// forever never finishes them; the lane yields between attempts).
    pub fn all_again(commands: Vec<C>) -> Self {
        BatchResult {
            outcomes: Vec::new(),
            committed: false,
            again: commands,
        }
    }

    /// Hands back the undecided rest of the batch, in order. They return to
    /// the head of the lane and lead the next batch.
    pub fn with_again(mut self, again: Vec<C>) -> Self {
        self.again = again;
        self
    }

    /// The outcomes of the decided prefix, in order.
    pub fn outcomes(&self) -> &[Result<O, E>] {
        &self.outcomes
    }

    /// How many commands were decided.
    pub fn decided(&self) -> usize {
        self.outcomes.len()
    }

    /// The commands handed back, in order.
    pub fn again(&self) -> &[C] {
        &self.again
    }

    /// Whether the decided prefix was committed.
    pub fn is_committed(&self) -> bool {
        self.committed
    }

    /// The parts: outcomes, committed, again.
    pub fn into_parts(self) -> (Vec<Result<O, E>>, bool, Vec<C>) {
        (self.outcomes, self.committed, self.again)
    }
}

impl<C, O, E> std::fmt::Debug for BatchResult<C, O, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BatchResult")
            .field("decided", &self.outcomes.len())
            .field("committed", &self.committed)
            .field("again", &self.again.len())
            .finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn failed_clones_the_error_for_each_decided_command() {
        let r: BatchResult<(), (), String> = BatchResult::failed(3, "x".into());
        assert_eq!(r.decided(), 3);
        assert!(r.outcomes().iter().all(|o| o == &Err("x".to_string())));
        let r: BatchResult<(), (), String> = BatchResult::failed(0, "x".into());
        assert_eq!(r.decided(), 0);
    }

    #[test]
    fn all_again_decides_nothing() {
        let r: BatchResult<u8, (), ()> = BatchResult::all_again(vec![1, 2]);
        let (o, c, a) = r.into_parts();
        assert!(o.is_empty() && !c);
        assert_eq!(a, vec![1, 2]);
    }
}
