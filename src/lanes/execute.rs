//! [`Execute`]: one caller's command, as a future.
//!
//! ```text
//!   Start ──first poll──▶ Entered ──outcome taken──▶ Done
//!     │                      │
//!     └─refused (Busy/Closed)┴──withdrawn──────────▶ Done
//! ```
//!
//! - `Start`: nothing is counted or queued yet; dropping it is free.
//! - `Entered`: the command is in its lane (see `lane.rs` for what happens
//!   there). Each poll is one [`Lane::step`]: take the outcome, wait, or, as
//!   the lane's driver, form and poll a batch inside this very poll. Dropping
//!   the future here calls [`Lane::abandon`], which is what makes every await
//!   point cancellation-safe: a queued command leaves the queue (it never
//!   reaches the kernel), a command in a running batch is left to that batch
//!   (which the next driver finishes), and if this caller was the driver, the
//!   driving is handed on and the new driver woken.
//! - `Done`: the outcome was returned; polling again panics, like any future.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Instant;

use super::error::LaneError;
use super::kernel::Kernel;
#[cfg(doc)]
use super::lane::Lane;
use super::lane::{Driver, Step, TicketId};
use super::shared::{Driven, Shared};
use crate::sync::Arc;

/// The future of [`Lanes::execute`](super::Lanes::execute): resolves to the
/// command's output or a [`LaneError`].
///
/// The command enters its lane (is counted, or refused as `Busy`/`Closed`) at
/// the first poll. While it waits, this future may be its lane's leader and
/// run the kernel for a whole batch inside its own polls; it only ever
/// *waits* for its own command.
///
/// Cancellation-safe at every await point: dropping it withdraws the command
/// if no batch took it yet, and otherwise leaves the batch to finish for the
/// other callers (see the module docs of [`lanes`](super)).
///
/// Keep polling it or drop it: while it leads its lane, the lane moves only
/// when it is polled (as with an async mutex held across an await). A
/// future parked in a `select!` branch that is never polled again, yet not
/// dropped, stalls its key.
#[must_use = "futures do nothing unless polled"]
pub struct Execute<K: Kernel> {
    shared: Arc<Shared<K>>,
    deadline: Option<Instant>,
    state: State<K>,
}

enum State<K: Kernel> {
    Start {
        key: K::Key,
        command: K::Command,
    },
    Entered {
        lane: Arc<super::lane::Lane<K>>,
        ticket: TicketId,
    },
    Done,
}

// No field is ever pinned (the kernel's future is boxed separately), so the
// future may move between polls whatever the key and command types are.
impl<K: Kernel> Unpin for Execute<K> {}

impl<K: Kernel> Execute<K> {
    pub(crate) fn new(
        shared: Arc<Shared<K>>,
        key: K::Key,
        command: K::Command,
        deadline: Option<Instant>,
    ) -> Self {
        Execute {
            shared,
            deadline,
            state: State::Start { key, command },
        }
    }

    /// The deadline, if any, in the `Lanes`' clock.
    pub fn deadline(&self) -> Option<Instant> {
        self.deadline
    }
}

impl<K: Kernel> Future for Execute<K> {
    type Output = Result<K::Output, LaneError<K::Command, K::Error>>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        if matches!(this.state, State::Start { .. }) {
            let State::Start { key, command } = std::mem::replace(&mut this.state, State::Done)
            else {
                unreachable!("checked above")
            };
            match this.shared.enter(key, command, this.deadline, cx.waker()) {
                Ok((lane, ticket)) => this.state = State::Entered { lane, ticket },
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
        let (lane, ticket) = match &this.state {
            State::Entered { lane, ticket } => (Arc::clone(lane), *ticket),
            State::Done => panic!("`Execute` polled after completion"),
            State::Start { .. } => unreachable!("entered above"),
        };
        let shared = &*this.shared;
        let mut drove = false;
        loop {
            let now = shared.now();
            if this.deadline.is_some_and(|d| now >= d) {
                if let Some(command) = shared.withdraw(&lane, ticket) {
                    this.state = State::Done;
                    return Poll::Ready(Err(LaneError::Withdrawn(command)));
                }
            }
            let (step, after) = lane.step(
                ticket,
                cx.waker(),
                now,
                shared.max_batch,
                !drove,
                &shared.accounts,
            );
            shared.settle(after);
            let future = match step {
                Step::Ready(outcome) => {
                    this.state = State::Done;
                    return Poll::Ready(outcome);
                }
                Step::Wait => return Poll::Pending,
                Step::Yield => {
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                Step::Start(commands) => shared.batch_future(&lane, commands),
                Step::Drive(future) => future,
            };
            drove = true;
            match shared.drive(&lane, future, cx, Driver::Caller(ticket)) {
                Driven::Pending => return Poll::Pending,
                Driven::Finished => continue,
            }
        }
    }
}

impl<K: Kernel> Drop for Execute<K> {
    fn drop(&mut self) {
        if let State::Entered { lane, ticket } = &self.state {
            self.shared.abandon(lane, *ticket);
        }
    }
}

impl<K: Kernel> fmt::Debug for Execute<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = match self.state {
            State::Start { .. } => "Start",
            State::Entered { .. } => "Entered",
            State::Done => "Done",
        };
        f.debug_struct("Execute")
            .field("state", &state)
            .field("deadline", &self.deadline)
            .finish_non_exhaustive()
    }
}
