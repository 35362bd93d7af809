//! Submitting: a message (or a batch) into its port's inbox, and the
//! port's task queued if the port was idle.

use crate::pool::handler::Handler;
use crate::pool::mailbox::Envelope;
use crate::pool::receiver::Batch;
use crate::pool::source::Ended;
use crate::pool::task::Task;
use crate::pool::worker::WorkerCx;
use crate::pool::{PoolHasher, PoolKey};
use crate::sync::atomic::fence;
use crate::sync::atomic::Ordering::*;
use crate::sync::Arc;

use super::port::{Delivery, Schedule};
use super::DispatcherInner;

impl<K, M, H, S> DispatcherInner<K, M, H, S>
where
    K: PoolKey,
    M: Send + 'static,
    H: Handler<K, M>,
    S: PoolHasher,
{
    /// Accepts `env` for `key` and returns its position, or hands both
    /// back if the executor, the dispatcher or the message's source is
    /// closed.
    /// The message's credit unit is already taken.
    ///
    /// The position is taken *before* the last look at the stop flags
    /// (both SeqCst): a stop sets its flag, then waits until every position
    /// taken so far has ended; so a message either sees the flag and is
    /// refused (its position recorded as returned: the commit point never
    /// passes a message that did not run), or is waited for.
    ///
    /// Inlined into the receiver's erased handle, whose call it is.
    #[inline(always)]
    pub(super) fn enqueue(
        this: &Arc<Self>,
        key: K,
        mut env: Envelope<M, H::Output>,
    ) -> Result<u64, (K, Envelope<M, H::Output>)> {
        // The key's `Hash` is user code: a panic here reaches the submitter
        // (whose credit unit is given back by the receiver).
        let hash = this.hasher.hash_one(&key);
        let source_ref = env.held.source;
        let source = source_ref.get();
        if source.is_closed() || this.refuses() {
            return Err((key, env));
        }
        let position = source.take_position();
        env.held.set_position(position);
        if source.is_closed() || this.refuses() {
            source.record(position, Ended::Returned);
            return Err((key, env));
        }
        let p = this.port_of(hash);
        let port = this.port(p);
        let d = Delivery { key, hash, env };
        port.inbox
            .push_stamped(d, this.shared.metrics.stamp(position));
        fence(SeqCst);
        if port.state.is_closed() {
            // A force stop may have emptied the inbox before our push
            // landed: hand back what is left, here.
            this.reject_late(port);
            return Ok(position);
        }
        Self::schedule_port(this, p);
        Ok(position)
    }

    /// After a push to port `p`'s inbox (and a fence): queues the port's
    /// task unless it is queued or running already. If it is, the delivery
    /// waits for that turn, maybe behind a long step. The submitter does
    /// not watch the step (a watch reads a line the busy worker writes per
    /// step): the idle workers do, and steal the turn if the step is stuck
    /// (see "Stealing a turn" in `port.rs`). It only makes sure one of them
    /// will watch again: if every idle one sleeps, one is called (see "Why
    /// no wake-up is lost" in `conserve/mod.rs`).
    #[inline(always)]
    pub(super) fn schedule_port(this: &Arc<Self>, p: usize) {
        let port = this.ports.made(p);
        if port.state.schedule() == Schedule::Queue {
            Self::queue_port(this, p);
        } else {
            // SeqCst (in `any_sleeper`): a sleeper counted itself before
            // it looked at the ports and the workers.
            this.shared.call_watcher(port.home());
        }
    }

    /// Queues port `p`'s task, the port just made SCHEDULED: on the worker
    /// of a handler that submits (no wake-up: it is running; keys that
    /// message each other then share a worker, and the port's home moves
    /// there — with work conservation off, only if it is the port's home
    /// already), else on the port's home, waking it if it sleeps, or on an
    /// idle worker if the home runs a step (see `Shared::schedule`).
    #[inline(never)]
    pub(super) fn queue_port(this: &Arc<Self>, p: usize) {
        let port = this.ports.made(p);
        let mut task = Some(Task::tagged(this.clone(), p));
        let here = WorkerCx::with_current(|cx| {
            let local = cx.is_of(this.shared.id())
                && (this.shared.config.work_conservation || cx.index == port.home());
            if local {
                port.move_home(cx.index);
                cx.push_local(task.take().expect("taken once"));
            }
            cx.index
        });
        match task {
            Some(task) => {
                let w = this.shared.schedule(port.home(), task);
                port.move_home(w);
            }
            // Behind the handler that sent it, which may run long.
            None => this.shared.call_watcher(here.expect("queued on a worker")),
        }
    }

    /// Accepts a batch of one source, every message holding its own unit,
    /// in order; returns the first of its consecutive positions. The keys'
    /// hashes are computed first (user code: a panic reaches the caller
    /// before anything was accepted); positions are taken once; each port
    /// touched gets its deliveries, in the batch's order, as one run of
    /// consecutive inbox entries (one claim per inbox block,
    /// `Inbox::push_many`), then one fence and one schedule check for the
    /// whole batch. If the dispatcher or the source is closed, every
    /// message is handed back, in order.
    pub(super) fn enqueue_batch(
        this: &Arc<Self>,
        batch: Batch<K, M, H::Output>,
    ) -> Result<u64, Batch<K, M, H::Output>> {
        let Some((_, first)) = batch.first() else {
            return Ok(0);
        };
        let source = first.held.source.get();
        if source.is_closed() || this.refuses() {
            return Err(batch);
        }
        let hashes: Vec<u64> = batch.iter().map(|(k, _)| this.hasher.hash_one(k)).collect();
        let n = batch.len() as u64;
        let start = source.take_positions(n);
        if source.is_closed() || this.refuses() {
            for p in start..start + n {
                source.record(p, Ended::Returned);
            }
            return Err(batch);
        }
        // Each delivery's port, and the ports touched in first-touch order
        // with how many deliveries each gets.
        let ports: Vec<usize> = hashes.iter().map(|&h| this.port_of(h)).collect();
        let mut touched: Vec<(usize, usize)> = Vec::new();
        for &p in &ports {
            match touched.iter_mut().find(|(q, _)| *q == p) {
                Some((_, count)) => *count += 1,
                None => touched.push((p, 1)),
            }
        }
        let mut deliveries =
            batch
                .into_iter()
                .zip(hashes)
                .enumerate()
                .map(|(i, ((key, mut env), hash))| {
                    let position = start + i as u64;
                    env.held.set_position(position);
                    let stamp = this.shared.metrics.stamp(position);
                    (Delivery { key, hash, env }, stamp)
                });
        if let [(p, _)] = touched[..] {
            // One port: the batch goes in as it is.
            this.port(p).inbox.push_many(&mut deliveries, n as usize);
        } else {
            let mut by_port: Vec<Vec<_>> = touched
                .iter()
                .map(|&(_, count)| Vec::with_capacity(count))
                .collect();
            for (d, p) in deliveries.zip(&ports) {
                let at = touched.iter().position(|(q, _)| q == p).expect("touched");
                by_port[at].push(d);
            }
            for (&(p, count), run) in touched.iter().zip(by_port) {
                this.port(p).inbox.push_many(run.into_iter(), count);
            }
        }
        fence(SeqCst);
        for (p, _) in touched {
            let port = this.ports.made(p);
            if port.state.is_closed() {
                // As in `enqueue`: a force stop may have emptied the inbox
                // before our pushes landed.
                this.reject_late(port);
                continue;
            }
            Self::schedule_port(this, p);
        }
        Ok(start)
    }
}
