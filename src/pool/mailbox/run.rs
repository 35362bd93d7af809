//! The runner's side of a mailbox: starting a message, polling its future,
//! the rest of a turn, and what follows a `Pending`.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::ptr;
use std::task::{Context, Poll};

use crate::completion::Outcome;
use crate::error::{Panic, TaskError};
use crate::pool::conserve::LONG_STEP_US;
use crate::pool::observe::StepToken;
use crate::pool::waker::WakerRef;
use crate::pool::worker::WorkerCx;
use crate::pool::PoolKey;
use crate::sync::Arc;
use crate::trace;

use super::state::{AfterPending, Claim};
use super::{Envelope, Held, Mailbox, Meta, Owner, Stamp, Step};

/// What the runner found when it asked for the next message.
enum Next<M, O> {
    Message(Envelope<M, O>, Stamp),
    /// A message of a stopped source: handed back, not started.
    Stopped(Envelope<M, O>),
    /// The queue was empty.
    Empty,
    Forced,
}

impl<K, M, D> Mailbox<K, M, D>
where
    K: PoolKey,
    M: Send + 'static,
    D: Owner<K, M>,
{
    /// Starts `env`: calls the handler and polls the future once.
    ///
    /// # Safety
    /// The caller owns the mailbox's turn (`RUNNING`), a key is set and no
    /// future is stored.
    ///
    /// Inlined into its two callers (a port's turn, a mailbox's turn) with
    /// only the unmeasured copy: a call here moved the message through
    /// memory on every step.
    #[inline(always)]
    pub(crate) unsafe fn start(
        this: &Arc<Self>,
        env: Envelope<M, D::Output>,
        stamp: Stamp,
        cx: &WorkerCx<'_>,
    ) -> Step {
        // One branch when nothing is measured (no slow-step threshold, the
        // message not sampled): that copy has no step hooks at all.
        if cx.times_steps() || stamp.sampled() {
            // SAFETY: our caller's contract.
            unsafe { Self::start_measured(this, env, stamp, cx) }
        } else {
            // SAFETY: our caller's contract.
            unsafe { Self::start_in::<false>(this, env, stamp, cx) }
        }
    }

    /// [`start`](Self::start) with its step measured, out of line.
    ///
    /// # Safety
    /// As for `start`.
    #[inline(never)]
    unsafe fn start_measured(
        this: &Arc<Self>,
        env: Envelope<M, D::Output>,
        stamp: Stamp,
        cx: &WorkerCx<'_>,
    ) -> Step {
        // SAFETY: our caller's contract.
        unsafe { Self::start_in::<true>(this, env, stamp, cx) }
    }

    /// [`start`](Self::start), with its step measured (`MEASURED`) or not.
    ///
    /// # Safety
    /// As for `start`.
    #[inline(always)]
    pub(super) unsafe fn start_in<const MEASURED: bool>(
        this: &Arc<Self>,
        env: Envelope<M, D::Output>,
        stamp: Stamp,
        cx: &WorkerCx<'_>,
    ) -> Step {
        let Envelope {
            msg,
            reply,
            mut held,
        } = env;
        cx.before_start(held.unit.source());
        // SAFETY: we own the turn, a key is set (caller's contract).
        let key = unsafe { this.key() };
        // SAFETY: as above.
        let hash = unsafe { this.hash() };
        let ident = &this.owner.ident();
        let step = if MEASURED {
            cx.step_begin(ident, hash, stamp.sampled())
        } else {
            StepToken::NONE
        };
        let run = ident.metrics.first_poll(&stamp, step.started());
        let span = trace::MessageSpan::new(&ident.name, hash, cx.index);
        cx.enter_handler(held.source, held.unit, held.passed());
        let called = catch_unwind(AssertUnwindSafe(|| {
            let _entered = span.enter();
            this.owner.call(key, msg, held.position())
        }));
        // The step's end, measured or not.
        let step_ended = |done: bool| {
            if MEASURED {
                let ended = cx.step_end(ident, hash, step);
                ident.metrics.polled(&run, step.started(), ended, done);
            }
        };
        let outcome = match called {
            // Done at once with its output (a sync handler): no future to
            // store or poll, and the output alone to hand on (matched here,
            // not out of the whole `Outcome`: that is several words to move
            // on every message).
            Ok(Ok(Ok(output))) => {
                held.set_unit(cx.leave_handler());
                this.owner.finish_ok(reply, held, cx, output);
                step_ended(true);
                return Step::Done;
            }
            // Done at once with a crate error (a retrying handler's).
            Ok(Ok(outcome)) => {
                held.set_unit(cx.leave_handler());
                outcome
            }
            Ok(Err(fut)) => {
                let fut = trace::instrument(fut, span);
                // SAFETY: we own the turn (caller's contract).
                unsafe {
                    this.future.with_mut(|f| ptr::write(f, Some(fut)));
                    let polled = Self::poll_in_place(this);
                    held.set_unit(cx.leave_handler());
                    match polled {
                        Poll::Ready(outcome) => outcome,
                        Poll::Pending => {
                            step_ended(false);
                            let meta = Meta { reply, held, run };
                            this.meta.with_mut(|m| ptr::write(m, Some(meta)));
                            return Step::Pending;
                        }
                    }
                }
            }
            Err(payload) => {
                held.set_unit(cx.leave_handler());
                Err(TaskError::Panicked(Panic::new(payload)))
            }
        };
        this.owner.finish(key, reply, held, Some(cx), outcome);
        step_ended(true);
        Step::Done
    }

    /// Polls the stored future once with the mailbox's waker; on `Ready` or a
    /// panic, drops it in place and delivers the outcome.
    ///
    /// # Safety
    /// The caller owns the mailbox's turn; a future and its `meta` are
    /// stored.
    pub(super) unsafe fn poll_current(this: &Arc<Self>, wcx: &WorkerCx<'_>) -> Step {
        let ident = &this.owner.ident();
        // SAFETY: we own the turn; a mailbox with a future has a key.
        let hash = unsafe { this.hash() };
        // SAFETY: we own the turn (caller's contract): `meta` is ours.
        let (held, run) = unsafe { this.meta.with(|m| (*m).as_ref().map(|m| (m.held, m.run))) }
            .expect("meta is stored");
        wcx.before_start(held.unit.source());
        let step = wcx.step_begin(ident, hash, run.sampled());
        wcx.enter_handler(held.source, held.unit, held.passed());
        // SAFETY: caller's contract.
        let polled = unsafe { Self::poll_in_place(this) };
        let (unit, passed) = wcx.leave_handler();
        // SAFETY: we own the turn.
        let Poll::Ready(outcome) = polled else {
            // SAFETY: as above.
            unsafe {
                this.meta.with_mut(|m| {
                    if let Some(m) = (*m).as_mut() {
                        m.held.set_unit((unit, passed));
                    }
                })
            };
            let ended = wcx.step_end(ident, hash, step);
            ident.metrics.polled(&run, step.started(), ended, false);
            return Step::Pending;
        };
        // SAFETY: we own the turn.
        let mut meta = unsafe { this.meta.with_mut(|m| (*m).take()) }.expect("meta is stored");
        meta.held.set_unit((unit, passed));
        this.owner.finish(
            // SAFETY: we own the turn; a mailbox with a future has a key.
            unsafe { this.key() },
            meta.reply,
            meta.held,
            Some(wcx),
            outcome,
        );
        let ended = wcx.step_end(ident, hash, step);
        ident.metrics.polled(&run, step.started(), ended, true);
        Step::Done
    }

    /// What the current (suspended) message holds, if one is stored.
    ///
    /// # Safety
    /// The caller owns the mailbox's turn (or claimed it).
    #[inline]
    pub(crate) unsafe fn current(&self) -> Option<Held> {
        // SAFETY: caller's contract.
        self.meta.with(|m| unsafe { (*m).as_ref().map(|m| m.held) })
    }

    /// Polls the stored future once with the mailbox's waker; if it is done
    /// (an output or a panic), drops it in place and returns the outcome.
    ///
    /// # Safety
    /// The caller owns the mailbox's turn and a future is stored.
    #[inline]
    pub(super) unsafe fn poll_in_place(this: &Arc<Self>) -> Poll<Outcome<D::Output, M>> {
        let waker = WakerRef::new(this);
        let mut cx = Context::from_waker(&waker);
        let polled = this.future.with_mut(|f| {
            // SAFETY: we own the turn, so nobody else touches the cell; the
            // future is stored inside the `Arc`'d mailbox and is never moved
            // before it is dropped in place (`drop_future`), so pinning it is
            // sound.
            let fut = unsafe { Pin::new_unchecked((*f).as_mut().expect("a future is stored")) };
            catch_unwind(AssertUnwindSafe(|| {
                trace::in_span(fut, |fut| D::poll_outcome(fut, &mut cx))
            }))
        });
        let outcome = match polled {
            Ok(Poll::Pending) => return Poll::Pending,
            Ok(Poll::Ready(outcome)) => outcome,
            Err(payload) => Err(TaskError::Panicked(Panic::new(payload))),
        };
        // SAFETY: we own the turn.
        unsafe { this.drop_future() };
        Poll::Ready(outcome)
    }

    /// Drops the stored future in place (it is pinned), even if its `Drop`
    /// panics; the panic is swallowed (the outcome is already decided).
    ///
    /// # Safety
    /// The caller owns the mailbox's turn.
    pub(super) unsafe fn drop_future(&self) {
        if !std::mem::needs_drop::<trace::Instrumented<D::Future>>() {
            // SAFETY: the owner of the turn; nothing to drop (a ready future
            // that was polled, say).
            self.future.with_mut(|f| unsafe { ptr::write(f, None) });
            return;
        }
        struct Clear<F>(*mut Option<F>);
        impl<F> Drop for Clear<F> {
            fn drop(&mut self) {
                // SAFETY: the inner value was dropped in place (or its drop
                // unwound, which also ends its life); overwrite without
                // dropping again.
                unsafe { ptr::write(self.0, None) }
            }
        }
        self.future.with_mut(|f| {
            let _ = catch_unwind(AssertUnwindSafe(|| {
                let _clear = Clear(f);
                // SAFETY: the owner of the turn may drop the future; it is
                // dropped where it was pinned.
                if let Some(fut) = unsafe { (*f).as_mut() } {
                    // SAFETY: `fut` is valid and never used again: `_clear`
                    // overwrites the slot with `None` without dropping it.
                    unsafe { ptr::drop_in_place(fut) }
                }
            }));
        });
    }

    /// Drops a pending future as cancelled (force stop).
    ///
    /// # Safety
    /// The caller owns the mailbox (its turn, or a claimed `SUSPENDED`).
    pub(crate) unsafe fn cancel_current(&self) {
        // SAFETY: caller's contract.
        let meta = unsafe { self.meta.with_mut(|m| (*m).take()) };
        if let Some(meta) = meta {
            // A future that can hand its message back (one waiting for its
            // next attempt, see `poison.rs`) does: it ends `Rejected`.
            // SAFETY: caller's contract: the future is ours and pinned in
            // place.
            let reclaimed = unsafe { self.reclaim_future() };
            // SAFETY: caller's contract.
            unsafe { self.drop_future() };
            // SAFETY: a mailbox with a future has a key.
            let key = unsafe { self.key() };
            if let Some(msg) = reclaimed {
                // Handed back as a queued message is: counted, through its
                // completion or `on_reject`.
                let env = Envelope {
                    msg,
                    reply: meta.reply,
                    held: meta.held,
                };
                self.owner.reject(key, env);
                return;
            }
            self.owner.cancelled(self.home());
            self.owner
                .finish(key, meta.reply, meta.held, None, Err(TaskError::Cancelled));
        }
    }

    /// Asks the stored future to hand its message back (`Owner::reclaim`),
    /// in `catch_unwind`: a panic there hands nothing back.
    ///
    /// # Safety
    /// The caller owns the mailbox (its turn, or a claimed `SUSPENDED`).
    unsafe fn reclaim_future(&self) -> Option<M> {
        self.future.with_mut(|f| {
            // SAFETY: caller's contract: nobody else touches the cell; the
            // future stays where it was pinned (see `poll_in_place`).
            let fut = unsafe { (*f).as_mut() }?;
            // SAFETY: as above: it is never moved before it is dropped.
            let fut = unsafe { Pin::new_unchecked(fut) };
            catch_unwind(AssertUnwindSafe(|| trace::in_span(fut, D::reclaim)))
                .ok()
                .flatten()
        })
    }

    /// The rest of a turn (`RUNNING`, no future stored): up to `budget`
    /// more messages, then yield; or, with the queue dry, leave the map and
    /// go `FREE` (see `Owner::drained`).
    pub(crate) fn turn(this: Arc<Self>, cx: &WorkerCx<'_>, mut budget: usize) {
        let shared = &this.owner.shared();
        let throughput = shared.config.throughput;
        // A stretch of the turn that ran `LONG_STEP_US` gives way before
        // the next message (see "Yield" in `conserve/mod.rs`):
        // `mark` is when the stretch began, `ran` its messages. The first
        // stretch begins as the turn's second message starts (a turn of
        // one message reads no clock); the clock is then read after the
        // 1st, 2nd, 4th, 8th, … message of a stretch, so a key whose
        // messages all run long yields after each of them but its turn's
        // first, and a hot key of short ones pays a few reads a turn, not
        // one a message.
        let mut ended_one = false;
        let mut mark: Option<u32> = None;
        let mut ran = 0u32;
        loop {
            if budget == 0 {
                // With nothing queued, retire rather than re-queue (a
                // re-queue may go to another worker, which may have left
                // at the end of a graceful stop).
                let empty = this.queue.lock().is_empty();
                if empty && D::drained(&this, cx, throughput) {
                    return;
                }
                // Fairness: go behind the other mailboxes of this worker.
                this.state.reschedule();
                return Self::requeue(this, cx);
            }
            match this.next() {
                Next::Message(env, stamp) => {
                    budget -= 1;
                    if ended_one && mark.is_none() {
                        mark = Some(shared.now_us());
                    }
                    // SAFETY: we own the turn, a key is set (the mailbox is
                    // in its port's map) and no future is stored.
                    match unsafe { Self::start(&this, env, stamp, cx) } {
                        Step::Done => {
                            ended_one = true;
                            if let Some(since) = mark {
                                ran += 1;
                                if ran.is_power_of_two()
                                    && shared.now_us().wrapping_sub(since) >= LONG_STEP_US
                                {
                                    cx.yield_long_step();
                                    mark = Some(shared.now_us());
                                    ran = 0;
                                }
                            }
                        }
                        Step::Pending => return Self::after_pending(this, cx),
                    }
                }
                Next::Stopped(env) => {
                    // SAFETY: we own the turn; a key is set.
                    let key = unsafe { this.key() };
                    D::hand_over(&this.owner, key, env);
                }
                Next::Empty => {
                    // Gone back to the port's spares (or closed), unless a
                    // message arrived meanwhile: then go on.
                    if D::drained(&this, cx, throughput - budget) {
                        return;
                    }
                }
                Next::Forced => {
                    // The stopping thread hands back the queue; we stop here.
                    this.state.close();
                    return;
                }
            }
        }
    }

    /// Under the port's gate: if the queue is still empty, the mailbox may
    /// leave the map (true); a message that arrived meanwhile keeps it
    /// (false). The caller (the runner) holds the gate.
    ///
    /// # Safety
    /// The caller owns the turn and holds the port's gate.
    pub(crate) unsafe fn still_empty(&self) -> bool {
        self.queue.lock().is_empty()
    }

    /// Runner: the mailbox leaves its port's map (under the gate) and goes
    /// `FREE` for reuse, or `CLOSED` if a force stop began.
    ///
    /// # Safety
    /// The caller owns the turn and holds the port's gate; the queue is
    /// empty and no future is stored.
    pub(crate) unsafe fn release(&self, forced: bool) -> Option<K> {
        if forced {
            self.state.close();
            return None;
        }
        self.state.release();
        // SAFETY: caller's contract (we own the mailbox, under the gate).
        unsafe { self.take_key() }
    }

    pub(super) fn has_current(&self) -> bool {
        // SAFETY: only called by the owner of the turn.
        self.meta.with(|m| unsafe { (*m).is_some() })
    }

    fn next(&self) -> Next<M, D::Output> {
        let mut q = self.queue.lock();
        // Checked under the queue lock: a force stop sets FORCED before it
        // takes the queue, so after it took it nothing here starts.
        if self.owner.shared().is_forced() {
            return Next::Forced;
        }
        match q.pop_front() {
            Some((env, _)) if env.held.source.get().is_stopped() => Next::Stopped(env),
            Some((env, stamp)) => Next::Message(env, stamp),
            None => Next::Empty,
        }
    }

    /// `RUNNING` → `SUSPENDED`, or → `SCHEDULED` if woken during the poll.
    ///
    /// Against a force stop this is the store-buffering pattern: we CAS the
    /// state then load `FORCED`; the stopper sets `FORCED` then CASes the
    /// state. All four are SeqCst, so at least one side sees the other and
    /// the suspended future is cancelled exactly once (by whichever CAS wins).
    ///
    /// Against a source stop likewise: the stopper sets `STOPPED` on the
    /// source, then (under the port's gate) claims a `SUSPENDED` mailbox or
    /// adds `STOP_CHECK` to a `RUNNING` one. Either our CAS to `SUSPENDED`
    /// comes first (the stopper claims it and cancels), or it fails on
    /// `STOP_CHECK` and we look at the source ourselves, still owning the
    /// turn — never after, when the message (and its source) may be gone.
    pub(crate) fn after_pending(this: Arc<Self>, cx: &WorkerCx<'_>) {
        this.move_home(cx.index);
        if this.owner.shared().is_forced() {
            // SAFETY: we still own the turn.
            unsafe { this.cancel_current() };
            this.state.close();
            return;
        }
        // SAFETY: we own the turn.
        if unsafe { this.current_is_stopped() } {
            return Self::cancel_stopped(this, cx);
        }
        match this.state.to_idle() {
            AfterPending::Check => {
                // SAFETY: still `RUNNING`: we own the turn.
                if unsafe { this.current_is_stopped() } {
                    return Self::cancel_stopped(this, cx);
                }
                // Another source stopped: suspend after all.
                this.state.clear_stop_check();
                Self::after_pending(this, cx)
            }
            AfterPending::Requeued => Self::requeue(this, cx),
            AfterPending::Suspended => {
                // A force stop that began before we suspended may have found
                // us RUNNING and left us to cancel ourselves.
                if this.owner.shared().is_forced() && this.state.close_suspended() == Claim::Won {
                    // SAFETY: the CAS made us the owner again.
                    unsafe { this.cancel_current() };
                }
            }
        }
    }

    /// Whether the current message's source is being stopped.
    ///
    /// # Safety
    /// The caller owns the turn.
    pub(super) unsafe fn current_is_stopped(&self) -> bool {
        // SAFETY: caller's contract; the message keeps its source alive.
        unsafe { self.current() }.is_some_and(|h| h.source.get().is_stopped())
    }

    /// The runner cancels its current message, whose source is stopping,
    /// and goes on with its queue (the rest of its keys' messages) from
    /// the back of its worker's queue.
    pub(super) fn cancel_stopped(this: Arc<Self>, cx: &WorkerCx<'_>) {
        // SAFETY: we own the turn.
        unsafe { this.cancel_current() };
        Self::turn(this, cx, 0);
    }
}
