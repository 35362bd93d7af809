//! Dispatchers: one handler, its pins (which worker each key with work is
//! on), its ports (one inbox per worker) and the receivers that feed it.
//!
//! # Routing
//!
//! A submitter hashes the key, locks the key's shard and looks up its
//! [`Pin`]: the key's mailbox, its worker, and how many messages were `sent`
//! to it (the submitter never reads the mailbox itself). A key
//! without a pin gets a new mailbox on the worker `pick_worker` chooses (a
//! running one with nothing queued, else a parked one, else the least
//! loaded). The submitter then pushes a delivery (mailbox pointer + message) on
//! that worker's [`Port`] inbox, *still under the shard lock*, and wakes the
//! port if it is idle. Only submitters write pins and only the port's worker
//! writes its mailboxes, so a message costs no cache-line exchange on the
//! key's state: signalling is per worker, as in a striped pool.
//!
//! The worker drains its port into the mailboxes' queues (counting them in
//! `received`) and puts each mailbox that was idle into its own FIFO queue
//! at the port's place, in delivery order (not at the back: their messages
//! were waiting since the port was queued, and must not wait behind a
//! mailbox that yielded after `throughput` messages meanwhile), where it
//! runs as described in `mailbox.rs`. It takes
//! deliveries from the inbox in batches (one compare-exchange per batch, into
//! a buffer under the port's gate) and delivers up to `PORT_BATCH` per turn;
//! a port with deliveries left, in the buffer or the inbox, re-queues itself,
//! so the buffer is empty whenever the port is idle.
//!
//! # The shard lock decides the races
//!
//! - submit vs. retire: the worker retires an idle mailbox (removes its pin)
//!   under the shard lock, and only if `sent == received`: no delivery of it
//!   is in flight, and no submitter can find it afterwards.
//! - submit vs. stop: the executor's `CLOSED` flag is read under the shard
//!   lock. A graceful stop counts a key as drained under that lock only when
//!   `sent == received` and its mailbox is idle. A force stop takes every
//!   shard lock once after setting `FORCED` (so every push that got past the
//!   flag is in an inbox), then empties each port's inbox under the port's
//!   gate (which the worker holds while it delivers, so no delivery is half
//!   way), then walks the pins and hands back every queued message, all on
//!   the stopping thread. A message is either refused with `Closed(msg)` or
//!   seen by the stop — never lost in between.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasher, Hash};
use std::marker::PhantomData;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;

use crossbeam_utils::CachePadded;

use crate::completion::{Outcome, Slot};
use crate::error::{ConfigError, Panic, TaskError};
use crate::pool::config::DEFAULT_MAX_IN_FLIGHT;
use crate::pool::credit::CreditRef;
use crate::pool::executor::{KeyedExecutor, Shared};
use crate::pool::handler::Handler;
use crate::pool::mailbox::{Envelope, Mailbox, Retire};
use crate::pool::receiver::{Core, Receiver};
use crate::pool::task::{Runnable, Task};
use crate::pool::worker::WorkerCx;
use crate::sync::atomic::fence;
use crate::sync::atomic::{AtomicUsize, Ordering::*};
use crate::sync::{arc_clone_raw, Arc, LocalFifo, Mutex, Queue};
use crate::trace;

type RejectHook<K, M> = Box<dyn Fn(K, M) + Send + Sync + 'static>;
type PanicHook<K> = Box<dyn Fn(&K, Panic) + Send + Sync + 'static>;
type Map<K, M, H, S> = HashMap<K, Pin<K, M, H, S>, S>;
type Shard<K, M, H, S> = CachePadded<Mutex<Map<K, M, H, S>>>;
type PaddedPort<K, M, H, S> = CachePadded<Port<K, M, H, S>>;

/// Deliveries a port moves into mailboxes per turn before letting the
/// worker's other tasks run.
#[cfg(not(loom))]
const PORT_BATCH: usize = 64;
/// Under loom one per turn, so that a port re-queues itself with deliveries
/// left in its batch buffer (`Gate::buf`) and the models explore that state.
#[cfg(loom)]
const PORT_BATCH: usize = 1;

/// Deliveries a port takes from its inbox at once (one compare-exchange).
const STEAL_BATCH: usize = 64;

/// Port states.
const PORT_IDLE: usize = 0;
const PORT_SCHEDULED: usize = 1;
const PORT_RUNNING: usize = 2;

/// Where a key with work lives. Written only under its shard lock.
pub(crate) struct Pin<K, M, H: Handler<K, M>, S> {
    mailbox: Arc<Mailbox<K, M, H, S>>,
    /// Messages pushed to the mailbox's port, modulo 2^32; compared with the
    /// mailbox's `received` (same modulus) to know that none is in flight.
    /// Fewer than 2^32 are ever in flight (each holds a credit unit), so
    /// equality modulo 2^32 is exact; 32 bits keep a pin at 16 bytes.
    sent: u32,
    /// The mailbox's worker (a copy: submitters read only the pin).
    worker: u32,
}

impl<K, M, H: Handler<K, M>, S> Pin<K, M, H, S> {
    /// No delivery to the mailbox is in flight (every one sent was received).
    #[inline]
    fn none_in_flight(&self) -> bool {
        // Truncation intended: both counters are compared modulo 2^32.
        self.sent == self.mailbox.received() as u32
    }
}

/// A delivery taken out of an inbox by a force stop, holding its mailbox.
type OwnedDelivery<K, M, H, S> = (
    Arc<Mailbox<K, M, H, S>>,
    Envelope<M, <H as Handler<K, M>>::Output>,
);

/// A message on its way to its mailbox. The pointer is valid because the
/// pin holds the mailbox while `sent > received` (this delivery counts).
struct Delivery<K, M, H: Handler<K, M>, S> {
    mailbox: NonNull<Mailbox<K, M, H, S>>,
    env: Envelope<M, H::Output>,
}

// SAFETY: a delivery moves a message (`M: Send`) and a pointer to a mailbox
// that is `Sync` (see `mailbox.rs`) to the mailbox's worker.
unsafe impl<K, M, H, S> Send for Delivery<K, M, H, S>
where
    K: Send + Sync,
    M: Send,
    H: Handler<K, M>,
    S: Send + Sync,
{
}

/// A dispatcher's inbox on one worker.
///
/// `state`: `PORT_IDLE` (not queued), `PORT_SCHEDULED` (its task is in the
/// worker's queue, exactly once), `PORT_RUNNING` (the worker delivers). A
/// submitter pushes, fences, and moves it `IDLE` → `SCHEDULED` (CAS) to queue
/// it; the worker, done delivering, stores `IDLE`, fences and re-checks the
/// inbox: either the submitter saw `RUNNING`/`SCHEDULED` after its push, or
/// the worker sees the push (SeqCst fences on both sides).
struct Port<K, M, H: Handler<K, M>, S> {
    state: AtomicUsize,
    inbox: Queue<Delivery<K, M, H, S>>,
    /// Held by the worker while it delivers, and by a force stop while it
    /// empties the inbox.
    gate: Mutex<Gate<K, M, H, S>>,
}

/// What a port's gate guards.
struct Gate<K, M, H: Handler<K, M>, S> {
    /// Set once a force stop emptied the port: nothing is delivered after.
    closed: bool,
    /// Deliveries taken from the inbox in one batch (one compare-exchange)
    /// and not delivered yet: older than everything still in the inbox.
    /// Non-empty only while the port is scheduled or running.
    buf: LocalFifo<Delivery<K, M, H, S>>,
}

/// The typed heart of a dispatcher. Mailboxes point back to it.
pub(crate) struct DispatcherInner<K, M, H: Handler<K, M>, S> {
    pub(crate) shared: Arc<Shared>,
    pub(crate) handler: H,
    hasher: S,
    shards: Box<[Shard<K, M, H, S>]>,
    ports: Box<[PaddedPort<K, M, H, S>]>,
    on_reject: Option<RejectHook<K, M>>,
    on_panic: Option<PanicHook<K>>,
    /// User-facing handles (`Dispatcher`s and `Receiver`s).
    handles: AtomicUsize,
    id: u64,
}

impl<K, M, H, S> DispatcherInner<K, M, H, S>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    M: Send + 'static,
    H: Handler<K, M>,
    S: BuildHasher + Send + Sync + 'static,
{
    #[inline]
    fn shard(&self, hash: u64) -> &Mutex<Map<K, M, H, S>> {
        // The set uses the low bits of the same hash; take the shard from the
        // high ones.
        let i = (hash >> 40) as usize & (self.shards.len() - 1);
        &self.shards[i]
    }

    /// Accepts `env` for `key`, or hands it back if the executor is closed.
    /// The message's credit unit is already taken.
    fn enqueue(
        this: &Arc<Self>,
        key: K,
        env: Envelope<M, H::Output>,
    ) -> Result<(), Envelope<M, H::Output>> {
        use std::collections::hash_map::Entry;
        let hash = this.hasher.hash_one(&key);
        let shard = this.shard(hash);
        let mut map = shard.lock();
        if this.shared.is_closed() {
            return Err(env);
        }
        // The submitter reads only the pin, never the mailbox (whose first
        // line its worker writes on every message). A pinned mailbox may be
        // closed only by a force stop's runner (after FORCED is set and seen
        // by our check above only if the stop got here first): then our
        // delivery is handed back by the stop — it empties the inboxes after
        // taking this shard lock, and rejects what reached the mailbox's
        // queue when it walks the pins. Retirement removes the pin before
        // it closes the mailbox.
        let pin = match map.entry(key) {
            Entry::Occupied(e) => e.into_mut(),
            Entry::Vacant(e) => {
                let worker = this.shared.pick_worker();
                let mailbox = Mailbox::new(e.key().clone(), hash, worker, this.clone());
                e.insert(Pin {
                    mailbox: Arc::new(mailbox),
                    sent: 0,
                    worker: worker as u32,
                })
            }
        };
        pin.sent = pin.sent.wrapping_add(1);
        let worker = pin.worker as usize;
        let port = &this.ports[worker];
        // A handler submitting to a key of its own worker, with nothing in
        // that worker's inbox for us to overtake: deliver straight into the
        // mailbox (we are its worker, and not inside the port's turn). An
        // idle port also has nothing in its batch buffer (it goes idle only
        // with the buffer empty, and only this thread runs it). The
        // thread-local is checked first: other threads never read the
        // port's lines here.
        let mut env = Some(env);
        {
            let mailbox = &pin.mailbox;
            let direct = crate::pool::worker::with_worker_cx(this.shared.id(), worker, |cx| {
                if port.state.load(Relaxed) != PORT_IDLE || !port.inbox.is_empty() {
                    return false;
                }
                let env = env.take().expect("taken once");
                if mailbox.deliver(env) {
                    // SAFETY: we are the mailbox's worker thread.
                    unsafe { mailbox.revived(cx, false) };
                    // SAFETY: we are the mailbox's worker thread.
                    let arc = unsafe { mailbox.take_parked() }.unwrap_or_else(|| mailbox.clone());
                    cx.push_local(Task::new(arc));
                }
                true
            });
            if direct == Some(true) {
                return Ok(());
            }
        }
        port.inbox.push(Delivery {
            // From `Arc::as_ptr`, not from a `&Mailbox`: the pointer keeps
            // the provenance of the whole allocation, which `arc_clone_raw`
            // needs to reach the reference counts (Miri's Stacked Borrows
            // rejects a pointer derived from the reference).
            // SAFETY: an `Arc`'s pointer is never null.
            mailbox: unsafe { NonNull::new_unchecked(Arc::as_ptr(&pin.mailbox).cast_mut()) },
            env: env.take().expect("not delivered directly"),
        });
        // Pushed under the shard lock: a force stop that has taken this lock
        // after setting FORCED finds the delivery in the inbox.
        drop(map);
        fence(SeqCst);
        if port.state.load(SeqCst) == PORT_IDLE
            && port
                .state
                .compare_exchange(PORT_IDLE, PORT_SCHEDULED, SeqCst, Relaxed)
                .is_ok()
        {
            this.shared.schedule(worker, Task::new(this.clone()));
        }
        Ok(())
    }

    /// The worker of an idle `mailbox` retires it: under the shard lock, if
    /// no delivery of it is in flight, close it and remove its pin.
    pub(crate) fn retire(&self, mailbox: &Arc<Mailbox<K, M, H, S>>, hash: u64) -> Retire {
        let mut map = self.shard(hash).lock();
        let mut outcome = Retire::Busy;
        // `Hash`/`Eq` are user code: a panic here must not kill the worker.
        // If it does, the mailbox stays (idle) and its pin with it.
        let _ = catch_unwind(AssertUnwindSafe(|| {
            match map.get(mailbox.key()) {
                Some(pin) if Arc::ptr_eq(&pin.mailbox, mailbox) => {
                    // Unpin first, then close: submitters do not check for a
                    // closed mailbox, so none may stay pinned if `remove`
                    // panics (the key's `Hash`/`Eq`). Under this lock, with
                    // the pin in place, only this thread changes an idle
                    // mailbox (a force stop claims it after taking the pin).
                    if pin.none_in_flight() && mailbox.is_idle() {
                        map.remove(mailbox.key());
                        let closed = mailbox.close_if_idle();
                        debug_assert!(closed, "an idle pinned mailbox changed under the lock");
                        if closed {
                            outcome = Retire::Retired;
                        }
                    }
                }
                // Not findable: taken by a force stop, or a key whose `Eq`
                // is not reflexive (then no submit can reach it).
                _ => {
                    if mailbox.close_if_idle() {
                        outcome = Retire::Retired;
                    }
                }
            }
            // Give memory back once most keys went quiet.
            let len = map.len();
            if map.capacity() > 64 && len * 4 < map.capacity() {
                map.shrink_to(len * 2);
            }
        }));
        drop(map);
        if matches!(outcome, Retire::Retired) && self.handles.load(Acquire) == 0 {
            self.shared.deregister_if_idle(self.id);
        }
        outcome
    }

    /// The port's turn on `cx`'s worker: move up to `PORT_BATCH` deliveries
    /// into their mailboxes, queueing each mailbox that was idle.
    fn run_port(this: Arc<Self>, cx: &WorkerCx<'_>) {
        let port = &this.ports[cx.index];
        port.state.store(PORT_RUNNING, SeqCst);
        let mut more = false;
        // Where the next revived mailbox goes: the port's own place at the
        // front of the worker's queue (see `WorkerCx::push_at`).
        let mut place = 0;
        {
            let gate = port.gate.lock();
            if !gate.closed {
                for _ in 0..PORT_BATCH {
                    let next = gate.buf.pop();
                    let Some(d) =
                        next.or_else(|| port.inbox.pop_batch_into(&gate.buf, STEAL_BATCH))
                    else {
                        break;
                    };
                    // SAFETY: the pin holds the mailbox while this delivery is
                    // counted in `sent` and not yet in `received`.
                    let mailbox = unsafe { d.mailbox.as_ref() };
                    if mailbox.deliver(d.env) {
                        // SAFETY: we are the mailbox's worker thread.
                        unsafe { mailbox.revived(cx, true) };
                        // SAFETY: we are the mailbox's worker thread.
                        let arc = unsafe { mailbox.take_parked() }.unwrap_or_else(|| {
                            // A new mailbox has no parked reference: take one.
                            // SAFETY: the pointer is an `Arc`'s, kept alive by
                            // the pin (see above).
                            unsafe { arc_clone_raw(d.mailbox.as_ptr().cast_const()) }
                        });
                        cx.push_at(place, Task::new(arc));
                        place += 1;
                    }
                }
                more = !gate.buf.is_empty() || !port.inbox.is_empty();
            }
        }
        if more {
            // Fairness: let the worker's other tasks run, then come back.
            port.state.store(PORT_SCHEDULED, SeqCst);
            cx.requeue_local(Task::new(this));
            return;
        }
        port.state.store(PORT_IDLE, SeqCst);
        fence(SeqCst);
        if !port.inbox.is_empty()
            && port
                .state
                .compare_exchange(PORT_IDLE, PORT_SCHEDULED, SeqCst, Relaxed)
                .is_ok()
        {
            cx.push_local(Task::new(this));
        }
    }

    /// Delivers a finished message's outcome and returns its credit.
    pub(crate) fn finish(
        &self,
        key: &K,
        worker: usize,
        reply: Option<Arc<Slot<H::Output, M>>>,
        credit: CreditRef,
        cx: Option<&WorkerCx<'_>>,
        outcome: Outcome<H::Output, M>,
    ) {
        let counters = &self.shared.workers[worker].counters;
        match &outcome {
            // Only this worker's thread writes these two: no RMW needed.
            Ok(_) => counters
                .done
                .store(counters.done.load(Relaxed) + 1, Relaxed),
            Err(TaskError::Panicked(p)) => {
                trace::handler_panicked(worker, p);
                counters
                    .panicked
                    .store(counters.panicked.load(Relaxed) + 1, Relaxed)
            }
            Err(_) => {}
        }
        match reply {
            Some(slot) => {
                // Give the unit back before the completion resolves, so a
                // caller that saw its message finish can submit again at once.
                // SAFETY: the finished message held this unit.
                unsafe { credit.release(1) };
                slot.complete(outcome);
            }
            None => {
                // The hook and the drop of the output (or of the panic's
                // payload) are user code: contain them, here on the worker.
                let _ = catch_unwind(AssertUnwindSafe(move || {
                    if let Err(TaskError::Panicked(p)) = outcome {
                        if let Some(hook) = &self.on_panic {
                            hook(key, p);
                        }
                    }
                }));
                // Nobody watches a fire-and-forget message finish: its unit
                // may come back in a small batch (see `WorkerCx::pending`).
                match cx {
                    Some(cx) => cx.release_credit(credit),
                    // SAFETY: the finished message held this unit.
                    None => unsafe { credit.release(1) },
                }
            }
        }
    }

    pub(crate) fn cancelled(&self, worker: usize) {
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
        let Envelope { msg, reply, credit } = env;
        trace::message_rejected(reply.is_some());
        self.shared.rejected.fetch_add(1, Relaxed);
        // SAFETY: the rejected message held this unit; given back first so a
        // caller that sees the rejection sees the unit back.
        unsafe { credit.release(1) };
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

    /// (mailboxes with work, idle mailboxes kept for reuse, all entries).
    fn count_mailboxes(&self) -> (usize, usize, usize) {
        let (mut live, mut idle, mut all) = (0, 0, 0);
        for shard in self.shards.iter() {
            let map = shard.lock();
            all += map.len();
            for pin in map.values() {
                if pin.none_in_flight() && pin.mailbox.is_at_rest() {
                    idle += usize::from(!pin.mailbox.is_closed());
                } else {
                    live += 1;
                }
            }
        }
        (live, idle, all)
    }

    /// Force stop, on the stopping thread (see the module docs).
    fn force_drain(&self) -> usize {
        // 1. Every push that got past the CLOSED check is in an inbox once
        //    we have held each shard lock.
        for shard in self.shards.iter() {
            drop(shard.lock());
        }
        // 2. Empty the inboxes; the gate waits for a worker mid-delivery.
        let mut n = 0;
        for port in self.ports.iter() {
            // Own a reference to each delivery's mailbox before the gate is
            // released: once it is, a concurrent force stop (another thread,
            // or a handler calling `shutdown_now`) may pass this gate, reach
            // step 3 and drop the pins, and the mailbox's worker may then
            // retire and free it while we still reject into it.
            let deliveries: Vec<OwnedDelivery<K, M, H, S>> = {
                let mut gate = port.gate.lock();
                gate.closed = true;
                let gate = &*gate;
                std::iter::from_fn(|| gate.buf.pop().or_else(|| port.inbox.pop()))
                    .map(|d| {
                        // SAFETY: the pin holds the mailbox while this
                        // delivery is in flight, and no pin is dropped yet:
                        // after the shard barrier nothing is pushed, so a
                        // force stop that passed this gate before us popped
                        // this delivery itself; one that passes after us
                        // reaches step 3 only then.
                        let mailbox = unsafe { arc_clone_raw(d.mailbox.as_ptr().cast_const()) };
                        (mailbox, d.env)
                    })
                    .collect()
            };
            for (mailbox, env) in deliveries {
                self.reject(mailbox.key(), env);
                n += 1;
            }
        }
        // 3. Walk the pins: hand back queued messages, cancel suspended
        //    futures.
        for shard in self.shards.iter() {
            let taken: Vec<Pin<K, M, H, S>> = shard.lock().drain().map(|(_, p)| p).collect();
            for pin in taken {
                n += pin.mailbox.force_stop();
            }
        }
        n
    }
}

impl<K, M, H, S> Runnable for DispatcherInner<K, M, H, S>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    M: Send + 'static,
    H: Handler<K, M>,
    S: BuildHasher + Send + Sync + 'static,
{
    /// A port task: deliver on this worker.
    fn run(this: Arc<Self>, cx: &WorkerCx<'_>) {
        Self::run_port(this, cx);
    }

    /// A force stop empties inboxes itself; the port just goes idle.
    fn cancel(this: Arc<Self>) {
        drop(this);
    }
}

/// What the executor needs from every dispatcher, whatever its types.
pub(crate) trait StopTarget: Send + Sync + 'static {
    /// Force stop: take every mailbox out of the map, reject its queue on
    /// this thread and cancel its suspended future.
    fn force_drain(&self) -> usize;
    /// No mailbox has work (idle ones waiting to be retired and closed
    /// leftovers do not count).
    fn is_drained(&self) -> bool;
    /// (mailboxes with work, idle mailboxes kept for reuse, map entries).
    fn count_mailboxes(&self) -> (usize, usize, usize);
    fn id(&self) -> u64;
    fn clone_box(&self) -> Box<dyn StopTarget>;
}

struct Target<K, M, H: Handler<K, M>, S>(Arc<DispatcherInner<K, M, H, S>>);

impl<K, M, H, S> StopTarget for Target<K, M, H, S>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    M: Send + 'static,
    H: Handler<K, M>,
    S: BuildHasher + Send + Sync + 'static,
{
    fn force_drain(&self) -> usize {
        self.0.force_drain()
    }

    fn is_drained(&self) -> bool {
        self.0.shards.iter().all(|s| {
            s.lock()
                .values()
                .all(|p| p.none_in_flight() && p.mailbox.is_at_rest())
        })
    }

    fn count_mailboxes(&self) -> (usize, usize, usize) {
        self.0.count_mailboxes()
    }

    fn id(&self) -> u64 {
        self.0.id
    }

    fn clone_box(&self) -> Box<dyn StopTarget> {
        Box::new(Target(self.0.clone()))
    }
}

/// One user-facing handle: counts itself in `handles`.
struct CoreHandle<K, M, H: Handler<K, M>, S>(Arc<DispatcherInner<K, M, H, S>>);

impl<K, M, H: Handler<K, M>, S> CoreHandle<K, M, H, S> {
    fn new(inner: Arc<DispatcherInner<K, M, H, S>>) -> Self {
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
    K: Hash + Eq + Clone + Send + Sync + 'static,
    M: Send + 'static,
    H: Handler<K, M>,
    S: BuildHasher + Send + Sync + 'static,
{
    #[inline]
    fn enqueue(&self, key: K, env: Envelope<M, H::Output>) -> Result<(), Envelope<M, H::Output>> {
        DispatcherInner::enqueue(&self.0, key, env)
    }

    fn is_closed(&self) -> bool {
        self.0.shared.is_closed()
    }

    fn live_mailboxes(&self) -> usize {
        self.0.count_mailboxes().0
    }

    fn clone_box(&self) -> Box<dyn Core<K, M, H::Output>> {
        Box::new(CoreHandle::new(self.0.clone()))
    }
}

/// Runs one handler for many keys: each key's messages one at a time, in
/// arrival order, on the executor's shared workers.
///
/// A dispatcher keeps a mailbox per key *while that key has work*; an idle
/// mailbox is removed, so memory follows the live keys. Feed it through one
/// or more [`Receiver`]s (one per source), each with its own credit.
///
/// `K` is the key, `M` the message and `O` the handler's output. Clones share
/// the same mailboxes. A dispatcher does not keep the executor's workers
/// alive: once the last [`KeyedExecutor`] handle is dropped, it refuses new
/// messages.
///
/// ```
/// use keyed_executor::{handler, KeyedExecutor};
///
/// let executor = KeyedExecutor::builder().workers(2).build()?;
/// let dispatcher = executor.dispatcher(handler::from_fn(|account: &u64, amount: i64| {
///     // apply `amount` to `account`: runs alone for this account
///     (*account, amount)
/// }));
/// let receiver = dispatcher.receiver(256)?;
/// let done = receiver.submit_blocking(7, 100)?;
/// assert_eq!(done.wait()?, (7, 100));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct Dispatcher<K, M, O> {
    core: Box<dyn Core<K, M, O>>,
}

impl<K, M, O> Dispatcher<K, M, O> {
    /// A new receiver (source) holding at most `max_in_flight` unfinished
    /// messages.
    ///
    /// # Errors
    /// [`ConfigError::ZeroMaxInFlight`] if `max_in_flight` is 0.
    pub fn receiver(&self, max_in_flight: usize) -> Result<Receiver<K, M, O>, ConfigError> {
        if max_in_flight == 0 {
            return Err(ConfigError::ZeroMaxInFlight);
        }
        Ok(Receiver::new(self.core.clone_box(), max_in_flight))
    }

    /// A new receiver with the default `max_in_flight`
    /// ([`DEFAULT_MAX_IN_FLIGHT`], 256).
    pub fn default_receiver(&self) -> Receiver<K, M, O> {
        Receiver::new(self.core.clone_box(), DEFAULT_MAX_IN_FLIGHT)
    }

    /// Keys with work right now: a mailbox with messages queued, running,
    /// or suspended on a future. (A mailbox that went idle is kept a short
    /// while for the key's next message and is not counted; see
    /// [`ExecutorStats::idle_mailboxes`](crate::ExecutorStats::idle_mailboxes).)
    /// Counting visits every mailbox: cheap enough to poll now and then, not
    /// per message.
    pub fn live_mailboxes(&self) -> usize {
        self.core.live_mailboxes()
    }

    /// Whether the executor refuses new messages.
    pub fn is_closed(&self) -> bool {
        self.core.is_closed()
    }
}

impl<K, M, O> Clone for Dispatcher<K, M, O> {
    fn clone(&self) -> Self {
        Dispatcher {
            core: self.core.clone_box(),
        }
    }
}

impl<K, M, O> fmt::Debug for Dispatcher<K, M, O> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Dispatcher")
            .field("live_mailboxes", &self.live_mailboxes())
            .finish()
    }
}

/// Configures a [`Dispatcher`]: hooks and the key hasher. Made by
/// [`KeyedExecutor::dispatcher_builder`].
///
/// ```
/// use std::sync::{Arc, Mutex};
/// use keyed_executor::{handler, KeyedExecutor};
///
/// let executor = KeyedExecutor::builder().workers(1).build()?;
/// let redeliver = Arc::new(Mutex::new(Vec::new()));
/// let sink = redeliver.clone();
/// let dispatcher = executor
///     .dispatcher_builder(handler::from_fn(|_: &u32, msg: String| msg.len()))
///     .on_reject(move |key, msg| sink.lock().unwrap().push((key, msg)))
///     .on_panic(|key, panic| eprintln!("handler for {key} panicked: {panic}"))
///     .build();
/// # drop(dispatcher);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[must_use = "a builder does nothing until `build()` is called"]
pub struct DispatcherBuilder<'e, K, M, H, S = RandomState> {
    executor: &'e KeyedExecutor,
    handler: H,
    hasher: S,
    on_reject: Option<RejectHook<K, M>>,
    on_panic: Option<PanicHook<K>>,
    _types: PhantomData<fn(K, M)>,
}

impl<K, M, H, S> fmt::Debug for DispatcherBuilder<'_, K, M, H, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DispatcherBuilder")
            .field("on_reject", &self.on_reject.is_some())
            .field("on_panic", &self.on_panic.is_some())
            .finish_non_exhaustive()
    }
}

impl<'e, K, M, H> DispatcherBuilder<'e, K, M, H, RandomState> {
    pub(crate) fn new(executor: &'e KeyedExecutor, handler: H) -> Self {
        DispatcherBuilder {
            executor,
            handler,
            hasher: RandomState::new(),
            on_reject: None,
            on_panic: None,
            _types: PhantomData,
        }
    }
}

impl<'e, K, M, H, S> DispatcherBuilder<'e, K, M, H, S>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    M: Send + 'static,
    H: Handler<K, M>,
    S: BuildHasher + Clone + Send + Sync + 'static,
{
    /// Called with each fire-and-forget message ([`Receiver::send`] and
    /// friends) that a force stop hands back unprocessed, on the stopping
    /// thread. Messages with a completion handle come back through it instead
    /// ([`TaskError::Rejected`]). Without a hook they are dropped (and counted
    /// in [`ExecutorStats::rejected`](crate::ExecutorStats::rejected)).
    pub fn on_reject(mut self, hook: impl Fn(K, M) + Send + Sync + 'static) -> Self {
        self.on_reject = Some(Box::new(hook));
        self
    }

    /// Called with the panic of a fire-and-forget message's handler (one with
    /// a completion handle reports it there instead), on the worker.
    pub fn on_panic(mut self, hook: impl Fn(&K, Panic) + Send + Sync + 'static) -> Self {
        self.on_panic = Some(Box::new(hook));
        self
    }

    /// The hasher for keys (default: `RandomState`, which resists HashDoS).
    /// A faster non-keyed hasher is fine when keys are not attacker-chosen.
    pub fn hasher<S2>(self, hasher: S2) -> DispatcherBuilder<'e, K, M, H, S2>
    where
        S2: BuildHasher + Clone + Send + Sync + 'static,
    {
        DispatcherBuilder {
            executor: self.executor,
            handler: self.handler,
            hasher,
            on_reject: self.on_reject,
            on_panic: self.on_panic,
            _types: PhantomData,
        }
    }

    /// Creates the dispatcher on the executor's workers.
    pub fn build(self) -> Dispatcher<K, M, H::Output> {
        let shared = self.executor.shared().clone();
        #[cfg(not(loom))]
        let shards = (shared.workers.len() * 8).next_power_of_two().clamp(8, 256);
        // Under loom each shard is a mutex that every drained check and
        // force stop locks in turn: two keep the models small and still
        // let two keys land in different shards.
        #[cfg(loom)]
        let shards = 2;
        let id = shared.next_dispatcher_id();
        let inner = Arc::new(DispatcherInner {
            shared: shared.clone(),
            handler: self.handler,
            shards: (0..shards)
                .map(|_| CachePadded::new(Mutex::new(HashMap::with_hasher(self.hasher.clone()))))
                .collect(),
            ports: (0..shared.workers.len())
                .map(|_| {
                    CachePadded::new(Port {
                        state: AtomicUsize::new(PORT_IDLE),
                        inbox: Queue::new(),
                        gate: Mutex::new(Gate {
                            closed: false,
                            buf: LocalFifo::new(),
                        }),
                    })
                })
                .collect(),
            hasher: self.hasher,
            on_reject: self.on_reject,
            on_panic: self.on_panic,
            handles: AtomicUsize::new(0),
            id,
        });
        let handle = CoreHandle::new(inner.clone());
        shared.register(Box::new(Target(inner)));
        Dispatcher {
            core: Box::new(handle),
        }
    }
}
