//! One key's lane: the state machine behind caller-driven, batched,
//! cancellation-safe execution.
//!
//! A lane exists (is in its shard's map) only while it has commands: queued,
//! or in a running batch. It has no thread; its callers move it. Everything
//! below is guarded by the lane's mutex, which is never held while user code
//! runs (kernel, hooks, clock, wakers, drops of commands or outputs: those
//! are handed out in an [`After`] and run after unlocking).
//!
//! # Tickets (one per caller)
//!
//! ```text
//!            enter             batch formed               batch finished
//!   (none) ───────▶ Queued ──────────────────▶ InBatch ───────────────────▶ Done ──▶ (removed by its caller)
//!                     │  ▲                        │        decided prefix     ▲
//!                     │  └────────────────────────┘ again (to the queue head) │
//!                     └───────────────────────────────────────────────────────┘
//!                        deadline passed at formation / in the caller's own poll: Done(Withdrawn)
//! ```
//!
//! - `Queued(command)`: waiting in `queue`, in arrival order. Made by the
//!   caller (`enter`); left by the driver forming a batch (`step`), by the
//!   caller withdrawing itself (`withdraw`) or dropping (`abandon`).
//! - `InBatch`: its command is inside the running batch; only the batch's end
//!   (`finish`) moves it on. If its caller drops meanwhile the ticket is marked
//!   `abandoned` and `finish` throws its outcome away (or drops its `again`
//!   command): the batch still runs to its end.
//! - `Done(outcome)`: waiting for its caller to take it (`step`), which
//!   removes the ticket.
//!
//! # The lane
//!
//! `batch` is `Idle` or `Running { members, future }`; `future` is `None`
//! exactly while its driver is polling it or finishing it (outside the lock).
//! `driver` names who moves the lane on: `Caller(ticket)`, `Closer` (a `close`
//! driving a batch nobody else waits for) or `Nobody`.
//!
//! Invariants (checked by the loom models in `loom-tests/tests/lanes.rs`):
//!
//! 1. `driver == Nobody` ⇔ no live caller is in the lane (the queue is empty
//!    and every member of the running batch, if any, is abandoned) and no
//!    `close` drives it. Such a running batch is *orphaned*; the next caller
//!    of the key, or `close`, becomes its driver.
//! 2. `batch == Idle` and the queue is not empty ⇒ `driver` is the caller at
//!    the queue head (the *leader*), and it has been woken since it became so.
//! 3. Only the driver forms a batch, polls the batch future, or finishes the
//!    batch; it does so from its own poll, so a dropped future is never in
//!    the middle of any of them.
//! 4. `batch == Idle` and the queue is empty ⇒ the lane is dead: it is
//!    removed from the map in the same critical section of the shard lock
//!    (`finish`, `withdraw`, `abandon`, `closer_release` run under it).
//!
//! Transitions of the lane and who makes them:
//!
//! | transition | by | effect |
//! |---|---|---|
//! | `enter` | a new caller (shard lock held) | queue a ticket; if `driver == Nobody` take the driving (idle lane: the caller leads; orphaned batch: it drives the batch) |
//! | `step` | a caller, each poll | take a `Done` outcome; or, as driver: take the batch future to poll, or form a batch from the queue head (its own command first, then up to `max_batch - 1` behind it, never waiting for more; expired deadlines withdrawn on the way) |
//! | `put_back` | the driver, poll returned `Pending` | the future goes back into the lane, where any later driver can poll it |
//! | `finish` | the driver, future completed or panicked | outcomes to the prefix, `again` back to the queue head in order, `driver` = queue head (woken) or `Nobody` (lane dead) |
//! | `withdraw` | a queued caller past its deadline | `Done(Withdrawn)` by return; if it was the driver, hand the driving on |
//! | `abandon` | a caller's future dropped | queued: removed; in batch: marked abandoned; driver: hand the driving on to the first live member, else the queue head, else `Nobody` (orphan) — and wake the new driver |
//! | `closer_take` / `closer_release` | `close` | drive an orphaned batch / hand it back |

use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::task::Waker;
use std::time::{Duration, Instant};

use super::accounts::Accounts;
use super::error::LaneError;
use super::kernel::{BatchResult, Kernel};
use crate::error::Panic;
use crate::limit::DrainRate;
use crate::sync::Mutex;

/// A caller's result.
pub(crate) type Outcome<K> =
    Result<<K as Kernel>::Output, LaneError<<K as Kernel>::Command, <K as Kernel>::Error>>;

/// A kernel's answer for `K`.
pub(crate) type KernelResult<K> =
    BatchResult<<K as Kernel>::Command, <K as Kernel>::Output, <K as Kernel>::Error>;

/// The running batch, boxed once per batch so any driver can poll it.
pub(crate) type BatchFuture<K> = Pin<Box<dyn Future<Output = KernelResult<K>> + Send + 'static>>;

/// A caller's place in a lane.
pub(crate) type TicketId = usize;

/// Who moves the lane on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Driver {
    Nobody,
    Caller(TicketId),
    Closer,
}

/// What a finished batch came to.
pub(crate) enum Finished<K: Kernel> {
    Completed(KernelResult<K>),
    Panicked(Panic),
}

/// Work left for after the lane (and shard) locks are released.
#[must_use = "wakers, drops and the close notification must be run"]
pub(crate) struct After<K: Kernel> {
    pub(crate) wake: Vec<Waker>,
    /// A release brought a closed `Lanes` to zero commands.
    pub(crate) drained: bool,
    /// A running batch lost its last driver.
    pub(crate) orphaned: bool,
    /// Commands finished by a batch (for the node's drain rate).
    pub(crate) finished: usize,
    /// The lane emptied: remove it from the map (under the shard lock).
    pub(crate) dead: bool,
    /// User values to drop outside the locks.
    pub(crate) garbage: Garbage<K>,
    /// Outcomes and waits for the metrics (zero-sized without the
    /// `metrics` feature).
    pub(crate) tally: crate::lanes::metrics::LaneTally,
}

/// Outcomes and commands nobody waits for any more.
pub(crate) struct Garbage<K: Kernel> {
    outcomes: Vec<Outcome<K>>,
    commands: Vec<K::Command>,
}

impl<K: Kernel> After<K> {
    pub(crate) fn new() -> Self {
        After {
            wake: Vec::new(),
            drained: false,
            orphaned: false,
            finished: 0,
            dead: false,
            garbage: Garbage {
                outcomes: Vec::new(),
                commands: Vec::new(),
            },
            tally: crate::lanes::metrics::LaneTally::new(),
        }
    }
}

/// Result of [`Lane::enter`].
#[must_use]
pub(crate) enum Enter<C> {
    Queued(TicketId),
    /// At capacity; nothing changed.
    Full {
        command: C,
        retry_after: Duration,
    },
    /// The lane died before this caller got its lock; use a fresh one.
    Dead(C),
}

/// Result of [`Lane::step`]: what the caller must do next.
#[must_use]
pub(crate) enum Step<K: Kernel> {
    /// Its outcome; the ticket is gone.
    Ready(Outcome<K>),
    /// Nothing to do; its waker is registered.
    Wait,
    /// It is the driver and must poll this future (then `put_back` or `finish`).
    Drive(BatchFuture<K>),
    /// It is the driver and formed a batch of these commands: it must build
    /// the batch future and poll it.
    Start(Vec<K::Command>),
    /// It would form a batch but was asked not to in this poll: it must wake
    /// itself and return `Pending` (cooperative yield).
    Yield,
}

enum TicketState<K: Kernel> {
    Queued(K::Command),
    InBatch,
    Done(Outcome<K>),
}

struct Ticket<K: Kernel> {
    state: TicketState<K>,
    deadline: Option<Instant>,
    /// When it entered (for the metrics' lane wait; zero-sized without the
    /// `metrics` feature).
    entered: crate::lanes::metrics::LaneStamp,
    waker: Option<Waker>,
    abandoned: bool,
}

enum Batch<K: Kernel> {
    Idle,
    Running {
        members: Vec<TicketId>,
        future: Option<BatchFuture<K>>,
    },
}

struct LaneState<K: Kernel> {
    tickets: Slab<Ticket<K>>,
    queue: VecDeque<TicketId>,
    batch: Batch<K>,
    driver: Driver,
    dead: bool,
    drain: DrainRate,
}

/// One key's lane.
pub(crate) struct Lane<K: Kernel> {
    key: K::Key,
    state: Mutex<LaneState<K>>,
}

impl<K: Kernel> Lane<K> {
    pub(crate) fn new(key: K::Key) -> Self {
        Lane {
            key,
            state: Mutex::new(LaneState {
                tickets: Slab::new(),
                queue: VecDeque::new(),
                batch: Batch::Idle,
                driver: Driver::Nobody,
                dead: false,
                drain: DrainRate::new(),
            }),
        }
    }

    pub(crate) fn key(&self) -> &K::Key {
        &self.key
    }

    /// Queues a command (the caller holds the shard lock). The first caller
    /// of an idle lane, or the next caller of an orphaned one, becomes its
    /// driver.
    pub(crate) fn enter(
        &self,
        command: K::Command,
        deadline: Option<Instant>,
        waker: &Waker,
        capacity: usize,
        now: Instant,
    ) -> Enter<K::Command> {
        let mut st = self.state.lock();
        if st.dead {
            return Enter::Dead(command);
        }
        if st.queue.len() >= capacity {
            let backlog = st.queue.len();
            let retry_after = st.drain.retry_after(now, backlog);
            return Enter::Full {
                command,
                retry_after,
            };
        }
        let id = st.tickets.insert(Ticket {
            state: TicketState::Queued(command),
            deadline,
            entered: crate::lanes::metrics::LaneStamp::new(now),
            waker: Some(waker.clone()),
            abandoned: false,
        });
        st.queue.push_back(id);
        if st.driver == Driver::Nobody {
            st.driver = Driver::Caller(id);
        }
        Enter::Queued(id)
    }

    /// One poll's worth of progress for the caller owning `ticket`.
    pub(crate) fn step(
        &self,
        ticket: TicketId,
        waker: &Waker,
        now: Instant,
        max_batch: usize,
        may_start: bool,
        acc: &Accounts,
    ) -> (Step<K>, After<K>) {
        let mut after = After::new();
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let me = st.tickets.get_mut(ticket);
        if matches!(me.state, TicketState::Done(_)) {
            let Ticket { state, .. } = st.tickets.remove(ticket);
            let TicketState::Done(outcome) = state else {
                unreachable!("checked above")
            };
            return (Step::Ready(outcome), after);
        }
        match &me.waker {
            Some(w) if w.will_wake(waker) => {}
            _ => me.waker = Some(waker.clone()),
        }
        if st.driver != Driver::Caller(ticket) {
            return (Step::Wait, after);
        }
        match &mut st.batch {
            Batch::Running { future, .. } => match future.take() {
                Some(f) => (Step::Drive(f), after),
                // Unreachable by invariant 3 (the driver is not polling it
                // elsewhere); waiting is the safe answer.
                None => (Step::Wait, after),
            },
            Batch::Idle if !may_start => (Step::Yield, after),
            Batch::Idle => {
                debug_assert_eq!(
                    st.queue.front(),
                    Some(&ticket),
                    "the leader heads the queue"
                );
                let mut members = Vec::with_capacity(max_batch.min(st.queue.len()));
                let mut commands = Vec::with_capacity(members.capacity());
                let mut withdrawn = 0;
                while members.len() < max_batch {
                    let Some(id) = st.queue.pop_front() else {
                        break;
                    };
                    let s = st.tickets.get_mut(id);
                    let expired = id != ticket && s.deadline.is_some_and(|d| now >= d);
                    let state = std::mem::replace(&mut s.state, TicketState::InBatch);
                    let TicketState::Queued(command) = state else {
                        unreachable!("only queued tickets are in the queue")
                    };
                    if expired {
                        s.state = TicketState::Done(Err(LaneError::Withdrawn(command)));
                        after.wake.extend(s.waker.take());
                        withdrawn += 1;
                    } else {
                        after.tally.waited(&s.entered, now);
                        members.push(id);
                        commands.push(command);
                    }
                }
                after.tally.withdrawn(withdrawn);
                after.drained |= acc.release(withdrawn);
                st.batch = Batch::Running {
                    members,
                    future: None,
                };
                (Step::Start(commands), after)
            }
        }
    }

    /// Returns a polled, still pending batch future to the lane.
    pub(crate) fn put_back(&self, fut: BatchFuture<K>) {
        let mut st = self.state.lock();
        match &mut st.batch {
            Batch::Running { future, .. } if future.is_none() => *future = Some(fut),
            _ => unreachable!("put_back without a running batch being polled"),
        }
    }

    /// Ends the running batch: outcomes to the decided prefix, `again` back
    /// to the queue head in order, the driving to the new queue head. Called
    /// by the driver `me` under the shard lock.
    pub(crate) fn finish(
        &self,
        finished: Finished<K>,
        me: Driver,
        now: Instant,
        acc: &Accounts,
    ) -> After<K> {
        let mut after = After::new();
        let mut guard = self.state.lock();
        let st = &mut *guard;
        debug_assert_eq!(st.driver, me, "only the driver finishes a batch");
        let Batch::Running { members, future } = std::mem::replace(&mut st.batch, Batch::Idle)
        else {
            unreachable!("finish without a running batch")
        };
        debug_assert!(future.is_none());
        let finished = match finished {
            Finished::Completed(r) if r.decided() + r.again().len() != members.len() => {
                Finished::Panicked(Panic::new(Box::new(format!(
                    "kernel broke the BatchResult contract: {} outcomes and {} again commands \
                     for a batch of {} commands",
                    r.decided(),
                    r.again().len(),
                    members.len()
                ))))
            }
            f => f,
        };
        let mut released = 0;
        match finished {
            Finished::Completed(r) => {
                let (outcomes, _committed, again) = r.into_parts();
                let decided = outcomes.len();
                for (&id, outcome) in members.iter().zip(outcomes) {
                    after.tally.decided(outcome.is_ok());
                    deliver(st, id, outcome.map_err(LaneError::Kernel), &mut after);
                }
                released += decided;
                after.finished = decided;
                for (&id, command) in members[decided..].iter().zip(again).rev() {
                    let s = st.tickets.get_mut(id);
                    if s.abandoned {
                        st.tickets.remove(id);
                        after.garbage.commands.push(command);
                        after.tally.withdrawn(1);
                        released += 1;
                    } else {
                        s.state = TicketState::Queued(command);
                        st.queue.push_front(id);
                    }
                }
            }
            Finished::Panicked(panic) => {
                let message = panic.message().to_owned();
                let mut original = Some(panic);
                for &id in &members {
                    let p = if st.tickets.get_mut(id).abandoned {
                        Panic::new(Box::new(message.clone()))
                    } else {
                        original
                            .take()
                            .unwrap_or_else(|| Panic::new(Box::new(message.clone())))
                    };
                    deliver(st, id, Err(LaneError::Panicked(p)), &mut after);
                }
                released += members.len();
                after.finished = members.len();
                after.tally.panicked(members.len());
            }
        }
        st.drain.record(now, after.finished);
        after.drained |= acc.release(released);
        match st.queue.front() {
            Some(&head) => {
                st.driver = Driver::Caller(head);
                if me != Driver::Caller(head) {
                    after.wake.extend(st.tickets.get_mut(head).waker.take());
                }
            }
            None => {
                st.driver = Driver::Nobody;
                st.dead = true;
                after.dead = true;
            }
        }
        after
    }

    /// Withdraws a still queued command (its deadline passed). `None` if a
    /// batch already took it or it is done. Called under the shard lock.
    pub(crate) fn withdraw(
        &self,
        ticket: TicketId,
        acc: &Accounts,
    ) -> Option<(K::Command, After<K>)> {
        let mut after = After::new();
        let mut guard = self.state.lock();
        let st = &mut *guard;
        if !matches!(st.tickets.get_mut(ticket).state, TicketState::Queued(_)) {
            return None;
        }
        let Ticket { state, .. } = st.tickets.remove(ticket);
        let TicketState::Queued(command) = state else {
            unreachable!("checked above")
        };
        st.queue.retain(|&id| id != ticket);
        after.drained |= acc.release(1);
        after.tally.withdrawn(1);
        if st.driver == Driver::Caller(ticket) {
            hand_off(st, &mut after);
        }
        Some((command, after))
    }

    /// The caller owning `ticket` went away (its future was dropped). Called
    /// under the shard lock.
    pub(crate) fn abandon(&self, ticket: TicketId, acc: &Accounts) -> After<K> {
        let mut after = After::new();
        let mut guard = self.state.lock();
        let st = &mut *guard;
        let s = st.tickets.get_mut(ticket);
        match s.state {
            TicketState::Done(_) => {
                let Ticket { state, .. } = st.tickets.remove(ticket);
                if let TicketState::Done(outcome) = state {
                    after.garbage.outcomes.push(outcome);
                }
            }
            TicketState::InBatch => {
                s.abandoned = true;
                s.waker = None;
            }
            TicketState::Queued(_) => {
                let Ticket { state, .. } = st.tickets.remove(ticket);
                if let TicketState::Queued(command) = state {
                    after.garbage.commands.push(command);
                }
                st.queue.retain(|&id| id != ticket);
                after.drained |= acc.release(1);
                after.tally.withdrawn(1);
            }
        }
        if st.driver == Driver::Caller(ticket) {
            hand_off(st, &mut after);
        }
        after
    }

    /// `close` takes the driving of an orphaned (or its own) batch. `None`
    /// if the batch has another driver, is being polled, or there is none.
    pub(crate) fn closer_take(&self) -> Option<BatchFuture<K>> {
        let mut guard = self.state.lock();
        let st = &mut *guard;
        if !matches!(st.driver, Driver::Nobody | Driver::Closer) {
            return None;
        }
        let Batch::Running { future, .. } = &mut st.batch else {
            return None;
        };
        let f = future.take()?;
        st.driver = Driver::Closer;
        Some(f)
    }

    /// `close` stops driving (it finished or was dropped): the driving goes
    /// to a live caller if one came, else the batch is orphaned again.
    /// Called under the shard lock.
    pub(crate) fn closer_release(&self) -> After<K> {
        let mut after = After::new();
        let mut guard = self.state.lock();
        let st = &mut *guard;
        if st.driver == Driver::Closer {
            hand_off(st, &mut after);
        }
        after
    }

    /// Whether the lane holds commands (queued or in a batch).
    pub(crate) fn is_busy(&self) -> bool {
        let st = self.state.lock();
        !st.queue.is_empty() || matches!(st.batch, Batch::Running { .. })
    }
}

/// Sets a member's outcome (or throws it away if its caller left).
fn deliver<K: Kernel>(
    st: &mut LaneState<K>,
    id: TicketId,
    outcome: Outcome<K>,
    after: &mut After<K>,
) {
    let s = st.tickets.get_mut(id);
    if s.abandoned {
        st.tickets.remove(id);
        after.garbage.outcomes.push(outcome);
    } else {
        s.state = TicketState::Done(outcome);
        after.wake.extend(s.waker.take());
    }
}

/// The driver is leaving: the driving goes to the first live member of the
/// running batch (it cares about the batch), else to the queue head, else to
/// nobody (an orphaned batch, or a dead lane).
fn hand_off<K: Kernel>(st: &mut LaneState<K>, after: &mut After<K>) {
    let running = matches!(st.batch, Batch::Running { .. });
    let member = match &st.batch {
        Batch::Running { members, .. } => members
            .iter()
            .copied()
            .find(|&id| !st.tickets.get(id).abandoned),
        Batch::Idle => None,
    };
    match member.or_else(|| st.queue.front().copied()) {
        Some(next) => {
            st.driver = Driver::Caller(next);
            after.wake.extend(st.tickets.get_mut(next).waker.take());
        }
        None => {
            st.driver = Driver::Nobody;
            if running {
                after.orphaned = true;
            } else {
                st.dead = true;
                after.dead = true;
            }
        }
    }
}

impl<K: Kernel> fmt::Debug for Lane<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let st = self.state.lock();
        f.debug_struct("Lane")
            .field("queued", &st.queue.len())
            .field("running", &matches!(st.batch, Batch::Running { .. }))
            .field("driver", &st.driver)
            .finish_non_exhaustive()
    }
}

/// A vector of entries with a free list; ids are stable while an entry lives.
struct Slab<T> {
    entries: Vec<Option<T>>,
    free: Vec<usize>,
}

impl<T> Slab<T> {
    const fn new() -> Self {
        Slab {
            entries: Vec::new(),
            free: Vec::new(),
        }
    }

    fn insert(&mut self, value: T) -> usize {
        match self.free.pop() {
            Some(id) => {
                self.entries[id] = Some(value);
                id
            }
            None => {
                self.entries.push(Some(value));
                self.entries.len() - 1
            }
        }
    }

    fn get(&self, id: usize) -> &T {
        self.entries[id].as_ref().expect("live entry")
    }

    fn get_mut(&mut self, id: usize) -> &mut T {
        self.entries[id].as_mut().expect("live entry")
    }

    fn remove(&mut self, id: usize) -> T {
        let value = self.entries[id].take().expect("live entry");
        self.free.push(id);
        value
    }
}
