//! The type-erased faces of a dispatcher: the port task (`Runnable`),
//! what the executor sees (`StopTarget`, declared with the registry in
//! `shared.rs`) and what a receiver sees (`Core`).

use crate::completion::{Outcome, Reply};
use crate::pool::handler::Handler;
use crate::pool::mailbox::{Envelope, Held, Owner, Produces};
use crate::pool::observe::Identity;
#[cfg(not(loom))]
use crate::pool::receiver::WeakCore;
use crate::pool::receiver::{Batch, Core};
use crate::pool::shared::{Shared, StopTarget};
use crate::pool::source::SourceRef;
use crate::pool::task::{Runnable, Task};
use crate::pool::worker::WorkerCx;
use crate::pool::{PoolHasher, PoolKey};
use crate::sync::atomic::Ordering::*;
use crate::sync::Arc;

use super::port::{Claim, STEAL_TAG};
use super::{DispatcherInner, MailboxRef};

impl<K, M, H, S> Runnable for DispatcherInner<K, M, H, S>
where
    K: PoolKey,
    M: Send + 'static,
    H: Handler<K, M>,
    S: PoolHasher,
{
    /// A port task (`tag`: the port, and whether to steal its turn).
    fn run(this: Arc<Self>, cx: &WorkerCx<'_>, tag: usize) {
        if tag & STEAL_TAG != 0 {
            Self::run_stolen_turn(this, tag & !STEAL_TAG, cx);
        } else {
            Self::run_port(this, tag, cx);
        }
    }

    /// A force stop empties inboxes itself; the port just goes idle.
    fn cancel(this: Arc<Self>, tag: usize) {
        if tag & STEAL_TAG != 0 {
            this.ports.made(tag & !STEAL_TAG).state.clear_steal();
        }
        drop(this);
    }
}

pub(super) struct Target<K, M, H: Handler<K, M>, S>(pub(super) Arc<DispatcherInner<K, M, H, S>>);

impl<K, M, H, S> StopTarget for Target<K, M, H, S>
where
    K: PoolKey,
    M: Send + 'static,
    H: Handler<K, M>,
    S: PoolHasher,
{
    fn force_drain(&self) -> usize {
        self.0.force_drain()
    }

    fn count_mailboxes(&self) -> (usize, usize, usize) {
        self.0.count_mailboxes()
    }

    fn inbox_len(&self, worker: usize) -> usize {
        self.0
            .ports
            .iter()
            .filter(|(_, port)| port.home() == worker)
            .map(|(_, port)| port.inbox.len())
            .sum()
    }

    fn backlog_beside(&self, me: usize) -> bool {
        self.0.ports.iter().any(|(_, port)| {
            port.state.is_running()
                && port.home() != me
                && port.inbox.len() >= super::slice::SLICE_MIN
        })
    }

    fn is_quiet(&self) -> bool {
        self.0.is_quiet()
    }

    fn release_spares(&self) {
        self.0.release_spares()
    }

    fn steal_turn(&self, stuck: usize) -> Option<Task> {
        let (p, _) = self.0.ports.iter().find(|(_, port)| {
            port.state.is_running()
                && (!port.inbox.is_empty() || port.state.has_deferred())
                && {
                    let gate = port.gate.lock();
                    gate.runner == stuck && gate.lent.is_some()
                }
                && port.state.claim_steal() == Claim::Won
        })?;
        Some(Task::tagged(self.0.clone(), p | STEAL_TAG))
    }

    fn steal_slice(&self, cx: &WorkerCx<'_>) -> bool {
        DispatcherInner::steal_slice(&self.0, cx)
    }

    fn any_port_busy(&self) -> bool {
        self.0.ports.iter().any(|(_, port)| port.state.is_busy())
    }

    fn id(&self) -> u64 {
        self.0.id
    }

    fn ident(&self) -> &Identity {
        &self.0.ident
    }

    fn clone_box(&self) -> Box<dyn StopTarget> {
        Box::new(Target(self.0.clone()))
    }
}

/// One user-facing handle: counts itself in `handles`.
pub(super) struct CoreHandle<K, M, H: Handler<K, M>, S>(
    pub(super) Arc<DispatcherInner<K, M, H, S>>,
);

impl<K, M, H: Handler<K, M>, S> CoreHandle<K, M, H, S> {
    pub(super) fn new(inner: Arc<DispatcherInner<K, M, H, S>>) -> Self {
        inner.handles.fetch_add(1, Relaxed);
        CoreHandle(inner)
    }
}

impl<K, M, H: Handler<K, M>, S> Drop for CoreHandle<K, M, H, S> {
    fn drop(&mut self) {
        if self.0.handles.fetch_sub(1, AcqRel) == 1 {
            self.0.shared.deregister_if_idle(self.0.id);
        }
    }
}

impl<K, M, H, S> Core<K, M, H::Output> for CoreHandle<K, M, H, S>
where
    K: PoolKey,
    M: Send + 'static,
    H: Handler<K, M>,
    S: PoolHasher,
{
    #[inline]
    fn enqueue(
        &self,
        key: K,
        env: Envelope<M, H::Output>,
    ) -> Result<u64, (K, Envelope<M, H::Output>)> {
        DispatcherInner::enqueue(&self.0, key, env)
    }

    fn enqueue_batch(&self, batch: Batch<K, M, H::Output>) -> Result<u64, Batch<K, M, H::Output>> {
        DispatcherInner::enqueue_batch(&self.0, batch)
    }

    fn is_closed(&self) -> bool {
        self.0.refuses()
    }

    fn id(&self) -> u64 {
        self.0.id
    }

    fn close(&self) {
        self.0.closed.store(true, SeqCst);
    }

    fn stop_sources(&self, stopped: &dyn Fn(SourceRef) -> bool) -> usize {
        DispatcherInner::stop_sources(&self.0, stopped)
    }

    #[cfg(not(loom))]
    fn downgrade(&self) -> Box<dyn WeakCore<K, M, H::Output>> {
        Box::new(WeakHandle(Arc::downgrade(&self.0)))
    }

    fn live_mailboxes(&self) -> usize {
        self.0.count_mailboxes().0
    }

    fn shared(&self) -> &Arc<Shared> {
        &self.0.shared
    }

    fn ident(&self) -> &Identity {
        &self.0.ident
    }

    fn clone_box(&self) -> Box<dyn Core<K, M, H::Output>> {
        Box::new(CoreHandle::new(self.0.clone()))
    }
}

/// A handle that keeps nothing alive (see `WeakReceiver`).
#[cfg(not(loom))]
pub(super) struct WeakHandle<K, M, H: Handler<K, M>, S>(
    std::sync::Weak<DispatcherInner<K, M, H, S>>,
);

#[cfg(not(loom))]
impl<K, M, H, S> WeakCore<K, M, H::Output> for WeakHandle<K, M, H, S>
where
    K: PoolKey,
    M: Send + 'static,
    H: Handler<K, M>,
    S: PoolHasher,
{
    fn upgrade(&self) -> Option<Box<dyn Core<K, M, H::Output>>> {
        let inner = self.0.upgrade()?;
        // Only while a strong handle lives: once the last one went, the
        // dispatcher may have left the executor's registry.
        let mut cur = inner.handles.load(Acquire);
        loop {
            if cur == 0 {
                return None;
            }
            match inner
                .handles
                .compare_exchange_weak(cur, cur + 1, AcqRel, Acquire)
            {
                Ok(_) => return Some(Box::new(CoreHandle(inner))),
                Err(actual) => cur = actual,
            }
        }
    }

    fn clone_box(&self) -> Box<dyn WeakCore<K, M, H::Output>> {
        Box::new(WeakHandle(self.0.clone()))
    }
}

impl<K, M, H: Handler<K, M>, S> Produces<K, M> for DispatcherInner<K, M, H, S> {
    type Output = H::Output;
    type Future = H::Future;
}

/// What a mailbox needs of its dispatcher (see `mailbox/mod.rs`).
impl<K, M, H, S> Owner<K, M> for DispatcherInner<K, M, H, S>
where
    K: PoolKey,
    M: Send + 'static,
    H: Handler<K, M>,
    S: PoolHasher,
{
    #[inline]
    fn call(&self, key: &K, msg: M, position: u64) -> Result<Outcome<H::Output, M>, H::Future> {
        self.handler.call_now(key, msg, position)
    }

    #[inline]
    fn poll_outcome(
        fut: std::pin::Pin<&mut H::Future>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Outcome<H::Output, M>> {
        H::poll_outcome(fut, cx)
    }

    #[inline]
    fn reclaim(fut: std::pin::Pin<&mut H::Future>) -> Option<M> {
        H::reclaim(fut)
    }

    #[inline]
    fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    #[inline]
    fn ident(&self) -> &Identity {
        &self.ident
    }

    #[inline(always)]
    fn finish(
        &self,
        key: &K,
        reply: Option<Arc<Reply<H::Output, M>>>,
        held: Held,
        cx: Option<&WorkerCx<'_>>,
        outcome: Outcome<H::Output, M>,
    ) {
        DispatcherInner::finish(self, key, reply, held, cx, outcome)
    }

    #[inline(always)]
    fn finish_ok(
        &self,
        reply: Option<Arc<Reply<H::Output, M>>>,
        held: Held,
        cx: &WorkerCx<'_>,
        output: H::Output,
    ) {
        DispatcherInner::finish_ok(self, reply, held, cx, output)
    }

    fn cancelled(&self, worker: usize) {
        DispatcherInner::cancelled(self, worker)
    }

    fn reject(&self, key: &K, env: Envelope<M, H::Output>) {
        DispatcherInner::reject(self, key, env)
    }

    fn hand_over(this: &Arc<Self>, key: &K, env: Envelope<M, H::Output>) {
        DispatcherInner::hand_over(this, key, env)
    }

    fn drained(mailbox: &MailboxRef<K, M, H, S>, cx: &WorkerCx<'_>, spent: usize) -> bool {
        DispatcherInner::drained(mailbox, cx, spent)
    }
}
