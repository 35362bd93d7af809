//! A port's turn: the deliveries its inbox held when it began.
//!
//! # Fairness: a turn takes what its inbox held when it began
//!
//! A turn begins with a mark of its inbox's tail (`Inbox::mark`) and takes
//! every delivery claimed before it, however many (the credit of the
//! sources bounds them); what is pushed after the mark waits for the
//! port's next turn, which the port queues behind the worker's other
//! tasks. A mailbox the turn gives a queued message (a key whose turn was
//! spent lent) or that yields meanwhile goes to the back of the
//! worker's queue while the turn still runs, so it gets no second turn
//! before the turn has delivered everything that was waiting when it
//! began. That is the fairness bound for messages still in the inbox: a
//! key whose message waited there runs after at most one turn of each
//! busier key, whatever the backlog ahead of it. (Cut after a fixed number
//! of deliveries, a turn would let the mailboxes it made run a second turn
//! before it came back for the rest.) A delivery claimed before the mark
//! but not yet written ends the turn early: its producer schedules the
//! port again, as after any push. Deliveries a source stop took out of
//! the inbox while the turn ran (the gate's `deferred`, ahead of the
//! inbox) are all taken, even those pushed after the mark: they stand
//! ahead of the inbox, and the credit bounds them as it bounds the rest.
//! A turn lets its gate go every `GATE_HOLD` deliveries, so that a stop or
//! a retiring mailbox never waits for a whole backlog.
//!
//! A port's turn runs on its home worker (`route.rs`); its task carries
//! the port's index (the task's tag), so that whichever worker takes the
//! task runs the turn — an idle worker that stole it, or one whose handler
//! queued it — and becomes the port's home.
//!
//! # Decide under the gate, act outside
//!
//! The turn holds its gate only to decide: `decide` takes deliveries
//! while each one needs nothing but the gate (a delivery into a key's
//! mailbox), and returns an `Act` for the first that needs more — hand it
//! back, fail it, run it lent the loaner, queue a new mailbox. The turn
//! lets the gate go, acts, and takes the gate again. A lent step's result
//! is decided the same way (`after_lent`: is the turn still ours, and
//! what becomes of the loaner). User code (handlers, a key's `Drop`,
//! hooks) never runs under the gate.

use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::error::Panic;
use crate::pool::handler::Handler;
use crate::pool::inbox::Popped;
use crate::pool::mailbox::{Envelope, Mailbox, Stamp, Step};
use crate::pool::task::Task;
use crate::pool::turns::{Seat, Turns};
use crate::pool::worker::WorkerCx;
use crate::pool::{PoolHasher, PoolKey};
use crate::sync::atomic::fence;
use crate::sync::atomic::Ordering::*;
use crate::sync::{Arc, SpinGuard};

use super::keys::{mailbox_ptr, Absent, Settle, Sorted};
use super::port::{Gate, Lent, Port, Schedule};
use super::{DispatcherInner, MailboxRef};

/// Deliveries a port's turn takes in a row before it lets its gate go
/// for a moment (a stop, a retiring mailbox or a thief may
/// be waiting for it); the turn goes on after. (Loom models never reach
/// it: each lock is a scheduling point, and the turn owns nothing at that
/// moment that another thread could take.)
pub(super) const GATE_HOLD: usize = 64;

/// What a turn does with its gate let go, decided while it was held
/// (see `DispatcherInner::decide` and `after_lent`).
enum Act<K, M, H: Handler<K, M>, S> {
    /// Run the delivery lent the loaner (assigned and lent already).
    RunLent {
        loaner: MailboxRef<K, M, H, S>,
        env: Envelope<M, H::Output>,
        stamp: Stamp,
        seat: Seat,
        spent: u32,
    },
    /// Something rarer, done out of line (`DispatcherInner::aside`).
    Aside(Aside<K, M, H, S>),
    /// The turn was stolen during a lent step: go on as the key's mailbox
    /// (`left`: what remains of its `throughput`).
    Stolen {
        loaner: MailboxRef<K, M, H, S>,
        step: Step,
        left: usize,
    },
    /// The turn is over; `more`: it stopped at its mark with deliveries
    /// maybe left.
    End { more: bool },
}

/// The acts of a turn off its common path.
enum Aside<K, M, H: Handler<K, M>, S> {
    /// Nothing: the gate is let go for a moment (every `GATE_HOLD`
    /// deliveries).
    LetGo,
    /// A delivery sorted under the gate (handed back, failed, or a new
    /// mailbox to queue; see `keys.rs`).
    Settle(Settle<K, M, H, S>),
    /// A lent step finished: drop its key (user code).
    DropKey(Option<K>),
    /// A lent step is pending: suspend its loaner, now its key's mailbox
    /// (or, the port closed, cancel it).
    Suspend(MailboxRef<K, M, H, S>),
    /// A lent step is pending but its key could not join the map.
    Stray(MailboxRef<K, M, H, S>, Panic),
}

/// A lent step that came back, to decide on under the gate.
struct Back<K, M, H: Handler<K, M>, S> {
    loaner: MailboxRef<K, M, H, S>,
    step: Step,
    seat: Seat,
    spent: u32,
}

/// A turn's own bookkeeping.
struct Turn {
    /// The port (its worker's index).
    p: usize,
    /// The port's identity in the `Turns` tables.
    port_id: usize,
    /// The gate's epoch while the turn is ours.
    epoch: u32,
    /// The `throughput` of a key's turn.
    throughput: u32,
    /// Deliveries taken since the gate was last let go for `GATE_HOLD`.
    taken: usize,
    /// The gate was let go for `GATE_HOLD` before the delivery that
    /// counted it: take that one without counting again.
    resumed: bool,
}

impl<K, M, H, S> DispatcherInner<K, M, H, S>
where
    K: PoolKey,
    M: Send + 'static,
    H: Handler<K, M>,
    S: PoolHasher,
{
    /// Port `p`'s turn on `cx`'s worker: take the deliveries its inbox
    /// holds now, in order (see "Fairness" and `mailbox/mod.rs`).
    pub(super) fn run_port(this: Arc<Self>, p: usize, cx: &WorkerCx<'_>) {
        let port = this.ports.made(p);
        port.state.begin_turn();
        port.move_home(cx.index);
        cx.port_turn(true);
        let mut gate = port.gate.lock();
        gate.until = port.inbox.mark();
        gate.runner = cx.index;
        let epoch = gate.epoch;
        Self::deliveries(&this, p, gate, epoch, cx);
    }

    /// A steal (see "Stealing a turn" in `port.rs`): if port `p`'s turn is still
    /// running a message lent, this worker takes the rest of the
    /// turn; the loaner becomes its key's mailbox, so that key's next
    /// messages queue behind the running one.
    pub(super) fn run_stolen_turn(this: Arc<Self>, p: usize, cx: &WorkerCx<'_>) {
        let port = this.ports.made(p);
        port.state.clear_steal();
        let mut gate = port.gate.lock();
        let Some(Lent(loaner)) = gate.lent else {
            // The runner is back from its lent step: its turn goes on.
            return;
        };
        if port.state.is_closed() || this.shared.is_forced() {
            return;
        }
        // SAFETY: the loaner is alive while `lent` is set (its runner
        // holds it), and `Arc::as_ptr` made the pointer.
        let loaner = unsafe { crate::sync::arc_clone_raw(loaner.as_ptr().cast_const()) };
        if this.activate(&mut gate, &loaner).is_err() {
            // The key's `Clone` or `Eq` panicked: leave the turn to its runner.
            return;
        }
        crate::pool::metrics::mailboxes(cx, &this.ident.metrics, 1);
        gate.lent = None;
        gate.epoch = gate.epoch.wrapping_add(1);
        let epoch = gate.epoch;
        gate.runner = cx.index;
        drop(loaner);
        port.move_home(cx.index);
        cx.port_turn(true);
        Self::deliveries(&this, p, gate, epoch, cx);
    }

    /// The body of port `p`'s turn, owned while the gate's epoch is
    /// `epoch`: decide under the gate (`decide`, `after_lent`), act with it
    /// let go, take it again, until the turn ends.
    pub(super) fn deliveries<'a>(
        this: &'a Arc<Self>,
        p: usize,
        mut gate: SpinGuard<'a, Gate<K, M, H, S>>,
        epoch: u32,
        cx: &WorkerCx<'_>,
    ) {
        let port = this.ports.made(p);
        let mut turn = Turn {
            p,
            port_id: port.id(),
            epoch,
            throughput: this.shared.config.throughput as u32,
            taken: 0,
            resumed: false,
        };
        // The lent step that just came back, to decide on under the gate.
        let mut back: Option<Back<K, M, H, S>> = None;
        // Whether the turn stopped at its mark with deliveries maybe left.
        let more = loop {
            let act = match back.take() {
                Some(b) => Self::after_lent(this, port, &mut gate, &turn, b, cx),
                None => None,
            };
            let act = match act {
                Some(act) => act,
                None => Self::decide(this, port, &mut gate, &mut turn, cx),
            };
            match act {
                Act::End { more } => break more,
                // The common path first, moved whole (no drop of a
                // half-moved `Act` on every message).
                Act::RunLent {
                    loaner,
                    env,
                    stamp,
                    seat,
                    spent,
                } => {
                    drop(gate);
                    cx.step();
                    // SAFETY: the loaner is ours (`RUNNING`), with a key, no future.
                    let step = unsafe { Mailbox::start(&loaner, env, stamp, cx) };
                    back = Some(Back {
                        loaner,
                        step,
                        seat,
                        spent,
                    });
                }
                Act::Stolen { loaner, step, left } => {
                    drop(gate);
                    // The turn is another worker's: go on as the key's
                    // mailbox, and never touch the port's state again.
                    cx.port_turn(false);
                    match step {
                        Step::Done => Mailbox::turn(loaner, cx, left),
                        Step::Pending => Mailbox::after_pending(loaner, cx),
                    }
                    return;
                }
                Act::Aside(aside) => {
                    drop(gate);
                    Self::aside(this, aside, cx);
                }
            }
            gate = port.gate.lock();
        };
        let more = more && (!port.inbox.is_empty() || !gate.deferred.is_empty());
        drop(gate);
        cx.port_turn(false);
        if more {
            // Fairness: what was pushed during the turn waits behind the
            // worker's other tasks, the mailboxes this turn queued
            // included (see "Fairness").
            port.state.yield_turn();
            cx.requeue_local(Task::tagged(this.clone(), p));
            return;
        }
        port.state.end_turn();
        fence(SeqCst);
        // A submitter that pushed before our store sees `RUNNING` or
        // `SCHEDULED` and leaves the scheduling to us. Re-queue only for a
        // value that is there: one claimed but not yet written makes
        // `is_empty` false while `pop` sees nothing, and its producer,
        // which reads the state after its push, schedules us itself.
        if !port.inbox.is_empty() || port.state.has_deferred() {
            let ready = {
                let gate = port.gate.lock();
                // SAFETY: we hold the gate: the only consumer.
                !port.state.is_closed()
                    && (!gate.deferred.is_empty() || unsafe { port.inbox.has_ready() })
            };
            if ready && port.state.schedule() == Schedule::Queue {
                cx.push_local(Task::tagged(this.clone(), p));
                return;
            }
        }
        if this.handles.load(Acquire) == 0 {
            this.maybe_deregister();
        }
    }

    /// The rarer acts, with the gate let go.
    #[inline(never)]
    fn aside(this: &Arc<Self>, aside: Aside<K, M, H, S>, cx: &WorkerCx<'_>) {
        match aside {
            Aside::LetGo => {}
            Aside::Settle(settle) => Self::settle(this, settle, cx),
            Aside::DropKey(key) => {
                let _ = catch_unwind(AssertUnwindSafe(move || drop(key)));
            }
            Aside::Suspend(loaner) => Mailbox::after_pending(loaner, cx),
            Aside::Stray(loaner, panic) => this.stray_pending(loaner, panic, cx),
        }
    }

    /// Under the gate: takes deliveries until one needs the gate let go,
    /// and says what to do then. A delivery for a key with a mailbox joins
    /// its queue here; every other one becomes an [`Act`].
    fn decide(
        this: &Arc<Self>,
        port: &Port<K, M, H, S>,
        gate: &mut SpinGuard<'_, Gate<K, M, H, S>>,
        turn: &mut Turn,
        cx: &WorkerCx<'_>,
    ) -> Act<K, M, H, S> {
        loop {
            if port.state.is_closed() {
                return Act::End { more: false };
            }
            if turn.resumed {
                // The delivery the let-go was for, counted already.
                turn.resumed = false;
            } else {
                turn.taken += 1;
                if turn.taken > GATE_HOLD {
                    // Nothing is lent: the turn cannot be stolen meanwhile.
                    turn.taken = 1;
                    turn.resumed = true;
                    return Act::Aside(Aside::LetGo);
                }
            }
            // Deliveries a source stop took out of the inbox first: they
            // were there before any the inbox still holds.
            let next = match gate.deferred.pop_front() {
                Some(d) => {
                    if gate.deferred.is_empty() {
                        port.state.set_deferred(false);
                    }
                    d
                }
                // SAFETY: we hold the gate: the only consumer.
                None => match unsafe { port.inbox.pop_before(gate.until) } {
                    Popped::Value(d, stamp) => (d, stamp),
                    Popped::Past => return Act::End { more: true },
                    Popped::Unwritten => return Act::End { more: false },
                },
            };
            let absent = match Self::sort(gate, next.0, next.1) {
                Sorted::Delivered => continue,
                Sorted::Settle(settle) => return Act::Aside(Aside::Settle(settle)),
                Sorted::Absent(absent) => absent,
            };
            // The key has no mailbox: nothing of it waits or runs.
            let seat = Turns::seat(turn.port_id, absent.hash);
            let spent = cx.turn_spent(seat);
            if spent < turn.throughput && !this.shared.is_forced() {
                // Run it now, lent the port's loaner, with the gate released
                // (a long handler must not hold up a stop, which takes it).
                let loaner = match gate.loaner.take() {
                    Some(loaner) => loaner,
                    None => Self::spare(this, gate, turn.p),
                };
                let Absent {
                    key,
                    hash,
                    env,
                    stamp,
                } = absent;
                // SAFETY: the loaner is free and we hold the gate.
                unsafe {
                    loaner.assign(key, hash);
                    loaner.lend();
                }
                gate.lent = Some(Lent(mailbox_ptr(&loaner)));
                return Act::RunLent {
                    loaner,
                    env,
                    stamp,
                    seat,
                    spent,
                };
            }
            // Its turn is spent (or a force stop began): it gets a mailbox
            // with this message queued, at the back of the worker's queue,
            // as a mailbox that used up its turn goes.
            return Act::Aside(Aside::Settle(Self::new_mailbox(
                this, gate, turn.p, absent, cx,
            )));
        }
    }

    /// Under the gate again after a lent step: whether the turn is still
    /// ours, and what becomes of the loaner. `None`: nothing to do with the
    /// gate let go; go on with the next delivery.
    fn after_lent(
        this: &Arc<Self>,
        port: &Port<K, M, H, S>,
        gate: &mut SpinGuard<'_, Gate<K, M, H, S>>,
        turn: &Turn,
        back: Back<K, M, H, S>,
        cx: &WorkerCx<'_>,
    ) -> Option<Act<K, M, H, S>> {
        let Back {
            loaner,
            step,
            seat,
            spent,
        } = back;
        if gate.epoch != turn.epoch {
            // Stolen while the message ran: the turn is another worker's,
            // and the loaner its key's mailbox, in the map (maybe with
            // messages queued).
            let left = (turn.throughput - spent - 1) as usize;
            return Some(Act::Stolen { loaner, step, left });
        }
        gate.lent = None;
        match step {
            Step::Done => {
                cx.record_turn(seat, spent + 1);
                // SAFETY: ours, under the gate, finished.
                let key = unsafe { loaner.release(false) };
                match gate.loaner {
                    None => gate.loaner = Some(loaner),
                    Some(_) => gate.spares.push(loaner),
                }
                // The key's `Drop` is user code: out of the gate. (Not
                // `then_some`: it would build the `Act` and drop it again
                // on every message of a key without drop glue.)
                if std::mem::needs_drop::<K>() {
                    Some(Act::Aside(Aside::DropKey(key)))
                } else {
                    None
                }
            }
            Step::Pending => {
                // The loaner becomes the key's mailbox. (After a force stop
                // emptied the port, the runner cancels it.)
                if !port.state.is_closed() {
                    if let Err(panic) = this.activate(gate, &loaner) {
                        return Some(Act::Aside(Aside::Stray(loaner, panic)));
                    }
                    crate::pool::metrics::mailboxes(cx, &this.ident.metrics, 1);
                }
                Some(Act::Aside(Aside::Suspend(loaner)))
            }
        }
    }

    /// A suspended future whose key could not be put in the map (its
    /// `Clone` or `Eq` panicked): nothing could deliver its key's next
    /// messages to it, so it is cancelled here, its message failed.
    #[cold]
    pub(super) fn stray_pending(
        &self,
        loaner: MailboxRef<K, M, H, S>,
        _panic: Panic,
        cx: &WorkerCx<'_>,
    ) {
        let _ = cx;
        // SAFETY: the loaner is still ours (`RUNNING`, not in the map).
        unsafe { loaner.cancel_current() };
        loaner.close();
    }
}
