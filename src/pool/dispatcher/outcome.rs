//! How a message of a dispatcher ends: finished, failed, handed back or
//! cancelled, and what each gives back (credit, position, completion).

use std::panic::{catch_unwind, AssertUnwindSafe};

use crate::completion::{Outcome, Reply};
use crate::error::{Panic, TaskError};
use crate::pool::handler::Handler;
use crate::pool::mailbox::{Envelope, Held};
use crate::pool::source::Ended;
use crate::pool::worker::WorkerCx;
use crate::pool::{PoolHasher, PoolKey};
use crate::sync::atomic::Ordering::*;
use crate::sync::Arc;
use crate::trace;

use super::DispatcherInner;

impl<K, M, H, S> DispatcherInner<K, M, H, S>
where
    K: PoolKey,
    M: Send + 'static,
    H: Handler<K, M>,
    S: PoolHasher,
{
    /// A message whose key's `Eq`/`Clone` panicked in a port: it fails as
    /// panicked (without the `on_panic` hook, which needs the key).
    pub(super) fn fail_unkeyed(&self, env: Envelope<M, H::Output>, panic: Panic) {
        self.ident.metrics.finished_direct(false);
        let Envelope { reply, held, .. } = env;
        self.end(held, Ended::Finished, None, false);
        if let Some(slot) = reply {
            slot.complete(Err(TaskError::Panicked(panic)));
        }
    }

    /// A message of this dispatcher ended (finished, failed, handed back or
    /// cancelled): records how at its position, gives back its unit
    /// (batched on a worker if `batched`) and drops its handle count on its source.
    #[inline(always)]
    pub(super) fn end(&self, held: Held, ended: Ended, cx: Option<&WorkerCx<'_>>, batched: bool) {
        let source = held.source.get();
        source.record(held.position(), ended);
        // SAFETY: the message held this unit (or share) until now.
        if let Some(unit) = unsafe { held.unit.leave() } {
            match cx {
                Some(cx) if batched => cx.release_credit(unit),
                // SAFETY: the unit was the message's (its last holder's).
                _ => unsafe { unit.release(1) },
            }
        }
        if held.holds_share() {
            // No unit of its source came back: wake whoever waits on it.
            source.share_ended();
            // SAFETY: the message held this handle count (see `Held`).
            unsafe { held.source.drop_ref() };
        }
    }

    /// A worker met a message of a stopped source: hand it back, on the
    /// stopping thread if one waits (see `Source::hand_over`).
    pub(crate) fn hand_over(this: &Arc<Self>, key: &K, env: Envelope<M, H::Output>) {
        let source = env.held.source;
        // The key's `Clone` is user code.
        match catch_unwind(AssertUnwindSafe(|| key.clone())) {
            Ok(key) => {
                let this = this.clone();
                source
                    .get()
                    .hand_over(Box::new(move || this.reject(&key, env)));
            }
            Err(_) => this.reject_keyless(env),
        }
    }

    /// Counts a message handed back and ends it (its unit given back first,
    /// so a caller that sees the rejection sees the unit back); returns the
    /// message and its completion, to hand it back through.
    #[allow(clippy::type_complexity)]
    pub(super) fn returned(
        &self,
        env: Envelope<M, H::Output>,
    ) -> (M, Option<Arc<Reply<H::Output, M>>>) {
        let Envelope { msg, reply, held } = env;
        trace::message_rejected(&self.ident.name, reply.is_some());
        self.ident.metrics.rejected();
        self.shared.rejected.fetch_add(1, Relaxed);
        self.end(held, Ended::Returned, None, false);
        (msg, reply)
    }

    /// Hands back a message whose key could not be cloned (its `Clone`
    /// panicked): through its completion; a fire-and-forget one is dropped
    /// (the `on_reject` hook needs the key) and counted as rejected.
    #[cold]
    pub(super) fn reject_keyless(&self, env: Envelope<M, H::Output>) {
        let (msg, reply) = self.returned(env);
        match reply {
            Some(slot) => slot.complete(Err(TaskError::Rejected(msg))),
            None => {
                let _ = catch_unwind(AssertUnwindSafe(move || drop(msg)));
            }
        }
    }

    /// Delivers a finished message's outcome, records it at its position
    /// and returns its credit. Inlined: it is the end of every message a
    /// worker runs, and as a call it moved the outcome through memory.
    #[inline(always)]
    pub(crate) fn finish(
        &self,
        key: &K,
        reply: Option<Arc<Reply<H::Output, M>>>,
        held: Held,
        cx: Option<&WorkerCx<'_>>,
        outcome: Outcome<H::Output, M>,
    ) {
        let outcome = match (outcome, cx) {
            (Ok(output), Some(cx)) => return self.finish_ok(reply, held, cx, output),
            (outcome, _) => outcome,
        };
        if let Some(cx) = cx {
            let counters = &self.shared.workers[cx.index].counters;
            match &outcome {
                // On a worker: `finish_ok`.
                Ok(_) => {}
                Err(TaskError::Panicked(p)) => {
                    trace::handler_panicked(&self.ident.name, cx.index, p);
                    counters
                        .panicked
                        .store(counters.panicked.load(Relaxed) + 1, Relaxed);
                    crate::pool::metrics::panicked(Some(cx), &self.ident.metrics);
                }
                // A retrying handler gave the message up (`poison.rs`).
                Err(TaskError::DeadLettered { .. }) => {
                    let n = &counters.dead_lettered;
                    n.store(n.load(Relaxed) + 1, Relaxed);
                    self.ident.metrics.dead_lettered();
                }
                // Its deadline passed before it started (`deadline.rs`).
                Err(TaskError::Expired { .. }) => {
                    let n = &counters.expired;
                    n.store(n.load(Relaxed) + 1, Relaxed);
                    self.ident.metrics.expired();
                }
                Err(_) => {}
            }
        }
        let ended = match &outcome {
            Err(TaskError::Cancelled | TaskError::Rejected(_)) => Ended::Returned,
            _ => Ended::Finished,
        };
        match reply {
            Some(slot) => {
                // Give the unit back before the completion resolves, so a
                // caller that saw its message finish can submit again at once.
                self.end(held, ended, cx, false);
                slot.complete(outcome);
            }
            None => {
                // The hook and the drop of the output (or of the panic's
                // payload) are user code: contain them, here on the worker.
                if outcome.is_err() || std::mem::needs_drop::<H::Output>() {
                    let _ = catch_unwind(AssertUnwindSafe(move || {
                        if let Err(TaskError::Panicked(p)) = outcome {
                            if let Some(hook) = &self.on_panic {
                                hook(key, p);
                            }
                        }
                    }));
                }
                // Nobody watches a fire-and-forget message finish: its unit
                // may come back in a small batch (see `WorkerCx::pending`).
                self.end(held, ended, cx, true);
            }
        }
    }

    /// [`finish`](Self::finish) of a message that ended with its handler's
    /// output, on a worker: the common end, given the output alone (the
    /// whole `Outcome`, with its error variants, is several words to move).
    #[inline(always)]
    pub(crate) fn finish_ok(
        &self,
        reply: Option<Arc<Reply<H::Output, M>>>,
        held: Held,
        cx: &WorkerCx<'_>,
        output: H::Output,
    ) {
        let counters = &self.shared.workers[cx.index].counters;
        // Only this worker's thread writes it: no RMW needed.
        let done = counters.done.load(Relaxed) + 1;
        counters.done.store(done, Relaxed);
        crate::pool::metrics::done(Some(cx), &self.ident.metrics, done);
        match reply {
            Some(slot) => {
                // As in `finish`: the unit back before the completion resolves.
                self.end(held, Ended::Finished, Some(cx), false);
                slot.complete(Ok(output));
            }
            None => {
                // Dropping the output is user code: contained, here.
                if std::mem::needs_drop::<H::Output>() {
                    let _ = catch_unwind(AssertUnwindSafe(move || drop(output)));
                }
                self.end(held, Ended::Finished, Some(cx), true);
            }
        }
    }

    pub(crate) fn cancelled(&self, worker: usize) {
        self.ident.metrics.cancelled();
        self.shared.workers[worker]
            .counters
            .cancelled
            .fetch_add(1, Relaxed);
    }

    /// Hands a queued message back (force stop): through its completion, or
    /// the `on_reject` hook for a fire-and-forget send.
    pub(crate) fn reject(&self, key: &K, env: Envelope<M, H::Output>)
    where
        K: Clone,
    {
        let (msg, reply) = self.returned(env);
        match reply {
            Some(slot) => slot.complete(Err(TaskError::Rejected(msg))),
            None => {
                // The hook, the key's `Clone` and (without a hook) the drop of
                // the message are user code: contain them, here on the
                // stopping thread, so the stop goes on with the rest.
                let _ = catch_unwind(AssertUnwindSafe(move || {
                    if let Some(hook) = &self.on_reject {
                        hook(key.clone(), msg);
                    }
                }));
            }
        }
    }
}
