//! Stops reaching a dispatcher's ports: a source's stop and the force
//! stop, and what a stop asks of a dispatcher (quiet, spares).
//!
//! # The gate decides the races
//!
//! - submit vs. retire: a message for a key reaches its mailbox only
//!   through its bucket's port, which retires mailboxes under its gate: a
//!   delivery either finds the mailbox or makes a new one. There is no race
//!   with the submitter, who never sees mailboxes.
//! - submit vs. graceful stop: the executor's `CLOSED` flag is read after
//!   the credit unit is taken, and the stop waits until no receiver has a
//!   unit out (see `source/`), so a message that got in is run.
//! - submit vs. force stop: the stop sets `FORCED`, then for each port
//!   takes the gate, marks the port `closed`, rejects what the inbox holds
//!   and takes every mailbox out of the map; then, on the stopping thread,
//!   hands back each mailbox's queue and cancels suspended futures. A
//!   submitter pushes, fences and reads `closed`: if it is set, the stop may
//!   have emptied the inbox before the push landed, so the submitter takes
//!   the gate and rejects what is left itself. A message is either refused
//!   with `Closed(msg)`, or run, or handed back — never lost in between.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::pool::handler::Handler;
use crate::pool::mailbox::{Envelope, Mailbox, StopClaim};
use crate::pool::source::SourceRef;
use crate::pool::task::Task;
use crate::pool::{PoolHasher, PoolKey};
use crate::sync::atomic::fence;
use crate::sync::atomic::Ordering::*;
use crate::sync::Arc;

use super::port::{Delivery, Port, Schedule};
use super::{DispatcherInner, MailboxRef};

/// A delivery taken out of an inbox or map by a force stop.
pub(super) enum Stopped<K, M, H: Handler<K, M>, S> {
    Delivery(Delivery<K, M, H::Output>),
    Mailbox(MailboxRef<K, M, H, S>),
}

/// A message taken out by a source's stop, with its key (none when the
/// key's `Clone` panicked: it goes back through its completion only).
pub(super) type Handed<K, M, O> = (Option<K>, Envelope<M, O>);

impl<K, M, H, S> DispatcherInner<K, M, H, S>
where
    K: PoolKey,
    M: Send + 'static,
    H: Handler<K, M>,
    S: PoolHasher,
{
    /// A source stop, on the stopping thread (see `receiver/mod.rs`): hands back
    /// every message of a source that `stopped` picks waiting in this
    /// dispatcher's ports (inboxes and mailbox queues) and cancels their
    /// suspended futures; a mailbox running a step is asked to look before
    /// it suspends. The other sources' deliveries taken out of an inbox go
    /// ahead of it, in order. Returns how many messages came back.
    pub(super) fn stop_sources(this: &Arc<Self>, stopped: &dyn Fn(SourceRef) -> bool) -> usize {
        let mut n = 0;
        for (worker, port) in this.ports.iter() {
            let mut handed: Vec<Handed<K, M, H::Output>> = Vec::new();
            let mut claimed: Vec<MailboxRef<K, M, H, S>> = Vec::new();
            let deferred = {
                let mut gate = port.gate.lock();
                if port.state.is_closed() {
                    // A force stop emptied the port; it hands back the rest.
                    continue;
                }
                let mut keep = VecDeque::new();
                let old = std::mem::take(&mut gate.deferred);
                let popped = std::iter::from_fn(|| {
                    // SAFETY: we hold the gate, so we are the inbox's only
                    // consumer.
                    unsafe { port.inbox.pop_stamped() }
                });
                for (d, stamp) in old.into_iter().chain(popped) {
                    if stopped(d.env.held.source) {
                        handed.push((Some(d.key), d.env));
                    } else {
                        keep.push_back((d, stamp));
                    }
                }
                let deferred = !keep.is_empty();
                gate.deferred = keep;
                port.state.set_deferred(deferred);
                for m in gate.active.values() {
                    let out = m.take_queued(stopped);
                    if !out.is_empty() {
                        // SAFETY: under the gate, a mailbox in the map has a
                        // key nobody takes. Its `Clone` is user code.
                        let key =
                            catch_unwind(AssertUnwindSafe(|| unsafe { m.key() }.clone())).ok();
                        handed.extend(out.into_iter().map(|env| (key.clone(), env)));
                    }
                    if m.claim_for_stop() == StopClaim::Claimed {
                        // SAFETY: the claim made us the owner of its turn.
                        match unsafe { m.current() } {
                            Some(held) if stopped(held.source) => claimed.push(m.clone()),
                            _ => Mailbox::unclaim(m),
                        }
                    }
                }
                deferred
            };
            if deferred {
                // As a submitter after its push: the port may have gone
                // idle having seen neither the inbox nor `deferred`.
                fence(SeqCst);
                if port.state.schedule() == Schedule::Queue {
                    let _ = this
                        .shared
                        .schedule(worker, Task::tagged(this.clone(), worker));
                }
            }
            for (key, env) in handed {
                match key {
                    Some(key) => this.reject(&key, env),
                    None => this.reject_keyless(env),
                }
                n += 1;
            }
            for m in claimed {
                // SAFETY: claimed above: we own its turn.
                unsafe { m.cancel_current() };
                Mailbox::resume_after_stop(m);
                n += 1;
            }
        }
        n
    }

    /// A push that landed after a force stop emptied `port`: hand back
    /// whatever the inbox holds, on this (the submitter's) thread.
    #[cold]
    pub(super) fn reject_late(&self, port: &Port<K, M, H, S>) {
        let late: Vec<Delivery<K, M, H::Output>> = {
            let _gate = port.gate.lock();
            // SAFETY: we hold the gate: the only consumer.
            std::iter::from_fn(|| unsafe { port.inbox.pop() }).collect()
        };
        for d in late {
            self.reject(&d.key, d.env);
        }
    }

    /// Whether nothing of this dispatcher is in flight: no mailbox, no loaner
    /// out, nothing in an inbox.
    pub(super) fn is_quiet(&self) -> bool {
        self.ports.iter().all(|(_, port)| {
            let gate = port.gate.lock();
            gate.active.is_empty()
                && gate.lent.is_none()
                && gate.deferred.is_empty()
                && port.inbox.is_empty()
        })
    }

    /// Frees the ports' loaners and spare mailboxes (each holds the
    /// dispatcher: a cycle until this). Only once nothing is in flight.
    pub(super) fn release_spares(&self) {
        for (_, port) in self.ports.iter() {
            let freed: Vec<MailboxRef<K, M, H, S>> = {
                let mut gate = port.gate.lock();
                let mut freed = std::mem::take(&mut gate.spares);
                freed.extend(gate.loaner.take());
                freed
            };
            drop(freed);
        }
    }

    /// Force stop, on the stopping thread (see the module docs).
    pub(super) fn force_drain(&self) -> usize {
        let mut n = 0;
        for (_, port) in self.ports.iter() {
            // Take everything out under the gate (which waits for a worker
            // in the middle of a delivery); reject it after, outside.
            let (stopped, mailboxes): (Vec<Stopped<K, M, H, S>>, usize) = {
                let mut gate = port.gate.lock();
                port.state.close();
                // After `closed`: a push this drain does not see sees it.
                fence(SeqCst);
                // SAFETY: we hold the gate: the only consumer.
                let mut out: Vec<_> = std::mem::take(&mut gate.deferred)
                    .into_iter()
                    .map(|(d, _)| d)
                    .chain(std::iter::from_fn(|| unsafe { port.inbox.pop() }))
                    .map(Stopped::Delivery)
                    .collect();
                port.state.set_deferred(false);
                let mailboxes = gate.active.len();
                out.extend(gate.active.drain().map(|(_, m)| Stopped::Mailbox(m)));
                (out, mailboxes)
            };
            self.ident.metrics.mailboxes_removed(mailboxes);
            for s in stopped {
                match s {
                    Stopped::Delivery(d) => {
                        self.reject(&d.key, d.env);
                        n += 1;
                    }
                    Stopped::Mailbox(m) => n += m.force_stop(),
                }
            }
        }
        n
    }
}
