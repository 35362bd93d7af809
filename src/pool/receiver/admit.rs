//! Admission: how a message gets its unit of credit and is accepted.
//!
//! Outside a handler, a submitter takes a free unit of its receiver's
//! credit or waits for one (`Acquire`, `pool::source`: the credit
//! protocol); `try_*` forms never wait. With its unit the message goes to
//! the dispatcher ([`Core::enqueue`](super::Core::enqueue)), which gives
//! it a position or refuses it (a stop raced the submission): a refused
//! message's unit is given back ([`give_back`]) and the message handed
//! back in `Closed(msg)`.
//!
//! # Sending from a handler
//!
//!
//! A handler that submits through a receiver of its own executor (a saga's
//! next step, an event after a command) must never deadlock the pool by
//! waiting for credit that only the pool can give back. So from inside a
//! handler (its call, or any poll of its future, on a worker of the same
//! executor) a submission never waits: it takes a unit of the receiver's
//! credit if one is free; otherwise the running message *shares* its own
//! unit with the follow-up, once per message (the unit comes back when the
//! last of the two ends, and a follow-up may pass it on in turn);
//! otherwise it is refused with `Full(msg)`. A chain of one follow-up per
//! message thus needs no more credit than its first message held, a
//! producer outside stays held back by the units the chain keeps out, and
//! memory stays bounded by the credit (times the length of a chain whose
//! messages all stay alive). Follow-ups are not held by the commit span
//! either; their positions are tracked all the same.
//!
//! Why sharing rather than handing the unit over: a message that passed
//! its unit on and then awaits something else would otherwise hold no
//! unit, and a producer could start any number of such messages.

use std::task::Waker;

use super::Receiver;
use crate::completion::Reply;
use crate::error::SubmitError;
use crate::pool::mailbox::{Envelope, Held};
use crate::pool::source::{Acquire, Acquired, SourceHandle, SourceRef, UnitRef};
use crate::pool::worker;
use crate::sync::{thread, Arc};
use crate::waiter::Waiter;

/// Registers the task behind `waker` as a waiter.
pub(in crate::pool) fn task_waiter(waker: &Waker) -> impl Fn(&mut Option<Waiter>) + '_ {
    move |slot| Waiter::register_task(slot, waker)
}

/// The unit of credit a message about to be accepted holds.
#[derive(Clone, Copy)]
pub(in crate::pool) enum Unit {
    /// One of its own receiver's.
    Own,
    /// A share of the running message's, passed on to its follow-up.
    Inherited(UnitRef),
}

impl<K, M, O> Receiver<K, M, O> {
    /// A unit without waiting: one of ours, else (from a handler) the
    /// running message's.
    #[inline]
    pub(in crate::pool) fn unit_now(&self) -> Result<Unit, Refused> {
        let source = self.source.source();
        if source.is_closed() || self.core.is_closed() {
            return Err(Refused::Closed);
        }
        if source.try_acquire() {
            return Ok(Unit::Own);
        }
        match worker::take_running_unit(self.core.shared().id()) {
            Some(Some(unit)) => Ok(Unit::Inherited(unit)),
            _ => Err(Refused::Full),
        }
    }

    /// A unit, waiting for one outside a handler. The common case (credit
    /// at hand) is inlined into the send; the rest is out of line.
    #[inline(always)]
    pub(in crate::pool) fn unit_blocking(&self) -> Result<Unit, Refused> {
        // With credit at hand the dispatcher's own check refuses a closed
        // executor; without, look before anything else.
        if self.source.source().try_acquire() {
            return Ok(Unit::Own);
        }
        self.unit_blocking_slow()
    }

    /// [`unit_blocking`](Self::unit_blocking) with no credit at hand.
    #[inline(never)]
    fn unit_blocking_slow(&self) -> Result<Unit, Refused> {
        let source = self.source.source();
        if source.try_acquire() {
            return Ok(Unit::Own);
        }
        if source.is_closed() || self.core.is_closed() {
            return Err(Refused::Closed);
        }
        match worker::take_running_unit(self.core.shared().id()) {
            // In a handler: never wait (see the module docs).
            Some(Some(unit)) => return Ok(Unit::Inherited(unit)),
            Some(None) => return Err(Refused::Full),
            None => {}
        }
        // Out of credit: a worker gives units back every few messages, so
        // spin briefly before registering as a waiter; parking here would
        // make every release of the next batch a futex wake. Not under
        // loom: the wait below is the protocol it checks.
        #[cfg(not(loom))]
        if source.spin_acquire(worker::flush_held_credit) {
            return Ok(Unit::Own);
        }
        let mut acquire = Acquire::new(source, worker::flush_held_credit);
        loop {
            match acquire.poll(&Waiter::register_thread, &|| self.refuses()) {
                Acquired::Unit => return Ok(Unit::Own),
                Acquired::Closed => return Err(Refused::Closed),
                // Woken by a release, or by a stop (see `Acquire`).
                Acquired::Waiting => thread::park(),
            }
        }
    }

    /// Whether the receiver, its dispatcher or the executor refuses new
    /// messages (SeqCst loads of the three flags).
    #[inline]
    pub(in crate::pool) fn refuses(&self) -> bool {
        self.source.source().is_closed() || self.core.is_closed()
    }

    /// Enqueues a message holding `unit`. Returns its position and, if
    /// `reply`, the record its completion reads.
    pub(super) fn enqueue(&self, key: K, message: M, reply: bool, unit: Unit) -> Accepted<O, M> {
        self.accept(key, message, reply, unit)
            .map_err(|(_, message)| self.refused(SubmitError::Closed(message)))
    }

    /// [`enqueue`](Self::enqueue), handing a refused message back with its
    /// key (a stop raced the submission: its unit is given back). The
    /// caller counts the refusal.
    pub(super) fn accept(
        &self,
        key: K,
        message: M,
        reply: bool,
        unit: Unit,
    ) -> Result<Taken<O, M>, (K, M)> {
        /// Gives the unit back if the key's `Hash` panics in `enqueue`.
        struct Unwind<'a> {
            source: &'a SourceHandle,
            unit: Unit,
        }
        impl Drop for Unwind<'_> {
            fn drop(&mut self) {
                give_back(self.source.as_ref(), self.unit);
            }
        }
        let reply = reply.then(|| Arc::new(Reply::new()));
        let me = self.source.as_ref();
        let held = match unit {
            Unit::Own => UnitRef::plain(me),
            Unit::Inherited(share) => {
                // The message holds a share of another message's unit: it
                // keeps this source alive with a handle count until it ends.
                me.add_ref();
                me.get().share_held();
                share
            }
        };
        let env = Envelope {
            msg: message,
            reply: reply.clone(),
            held: Held::new(me, held),
        };
        // The key's `Hash` runs inside: if it panics, the panic goes to the
        // caller with the message, and the unit comes back.
        let unwind = Unwind {
            source: &self.source,
            unit,
        };
        let res = self.core.enqueue(key, env);
        std::mem::forget(unwind);
        match res {
            Ok(position) => Ok((position, reply)),
            Err((key, env)) => {
                give_back(me, unit);
                Err((key, env.msg))
            }
        }
    }
}

/// Undoes a unit taken for a message that was not accepted.
pub(in crate::pool) fn give_back(me: SourceRef, unit: Unit) {
    match unit {
        // SAFETY: the refused message held this unit.
        Unit::Own => unsafe { me.release(1) },
        Unit::Inherited(share) => {
            me.get().share_ended();
            // SAFETY: `enqueue` took a handle count for the message.
            unsafe { me.drop_ref() };
            worker::give_back_running_unit(share);
        }
    }
}

/// Why a submission was refused before it got a unit.
#[derive(Clone, Copy)]
pub(in crate::pool) enum Refused {
    Full,
    Closed,
}

impl Refused {
    /// The error that hands `message` back.
    pub(in crate::pool) fn with<M>(self, message: M) -> SubmitError<M> {
        match self {
            Refused::Full => SubmitError::Full(message),
            Refused::Closed => SubmitError::Closed(message),
        }
    }
}

/// An accepted message's position and, if a reply was asked for, the
/// record its completion reads.
pub(super) type Taken<O, M> = (u64, Option<Arc<Reply<O, M>>>);

/// A message's position and, if a reply was asked for, its completion.
pub(super) type Accepted<O, M> = Result<Taken<O, M>, SubmitError<M>>;
