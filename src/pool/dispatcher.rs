//! Dispatchers: one handler, the route table that says which worker each
//! key's bucket lives on, and one port per worker: its inbox and the
//! mailboxes of the keys that live there.
//!
//! # Routing
//!
//! A submitter hashes the key (the dispatcher's hasher) and picks the key's
//! *bucket* from the hash's high bits: one of `routes.len()` (≥ 1,024)
//! words that map buckets to workers. One `fetch_add` on the bucket's word
//! counts the message in its `sent` field and reads its worker; a bucket
//! nobody has placed yet is placed by the first submitter (`pick_worker`:
//! a running worker with nothing queued, else a parked one, else the least
//! loaded). The submitter then pushes a delivery (key, hash, message) on
//! that worker's port inbox and, if the port is idle, schedules it. The
//! route table is small (8 bytes a bucket) and written by submitters only,
//! so it stays in their caches: a submit touches no per-key state.
//!
//! The worker owns its port's mailboxes: the port's map (key → mailbox,
//! keyed by the submitter's hash) lives under the port's *gate*, a lock
//! the worker takes per delivery and that stops, retirement and stealing
//! take to touch the port. A port's turn takes up to `PORT_BATCH`
//! deliveries in order; each counts in its bucket's `received`, finds or
//! creates its key's mailbox, and is offered to it (`Mailbox::offer`): an
//! idle mailbox with budget left in its turn runs the message at once, with
//! the gate released; otherwise the message joins the mailbox's queue (and
//! a mailbox revived with its turn spent goes to the back of the worker's
//! queue). A port with deliveries left re-queues itself behind the worker's
//! other tasks.
//!
//! A bucket stays on its worker (sticky) while it has keys there; once the
//! worker has retired every mailbox of the bucket and every delivery sent
//! to it was received (`sent == received`, under the gate), it un-places
//! the bucket with one compare-exchange (which fails if a submitter sent
//! meanwhile), and the bucket's next message places it afresh.
//!
//! # The gate decides the races
//!
//! - submit vs. retire: a message for a key reaches its mailbox only
//!   through its bucket's port, which retires mailboxes under its gate: a
//!   delivery either finds the mailbox or makes a new one. There is no race
//!   with the submitter, who never sees mailboxes.
//! - submit vs. graceful stop: the executor's `CLOSED` flag is read after
//!   the credit unit is taken, and the stop waits until no receiver has a
//!   unit out (see `credit.rs`), so a message that got in is run.
//! - submit vs. force stop: the stop sets `FORCED`, then for each port
//!   takes the gate, marks the port `closed`, rejects what the inbox holds
//!   and takes every mailbox out of the map; then, on the stopping thread,
//!   hands back each mailbox's queue and cancels suspended futures. A
//!   submitter pushes, fences and reads `closed`: if it is set, the stop may
//!   have emptied the inbox before the push landed, so the submitter takes
//!   the gate and rejects what is left itself. A message is either refused
//!   with `Closed(msg)`, or run, or handed back — never lost in between.

use std::collections::HashMap;
use std::fmt;
use std::hash::{BuildHasher, BuildHasherDefault, Hash, Hasher};
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
use crate::pool::inbox::Inbox;
use crate::pool::mailbox::{Envelope, Mailbox, Offer, Retire};
use crate::pool::receiver::{Core, Receiver};
use crate::pool::task::{Runnable, Task};
use crate::pool::worker::WorkerCx;
use crate::sync::atomic::fence;
use crate::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use crate::sync::{Arc, SpinLock};
use crate::trace;

type RejectHook<K, M> = Box<dyn Fn(K, M) + Send + Sync + 'static>;
type PanicHook<K> = Box<dyn Fn(&K, Panic) + Send + Sync + 'static>;
type PaddedPort<K, M, H, S> = CachePadded<Port<K, M, H, S>>;
pub(crate) type MailboxRef<K, M, H, S> = Arc<Mailbox<K, M, H, S>>;
type Keys<K, M, H, S> = HashMap<Hashed<K>, MailboxRef<K, M, H, S>, BuildHasherDefault<PassThrough>>;

/// Deliveries a port takes per turn before letting the worker's other
/// tasks run.
#[cfg(not(loom))]
const PORT_BATCH: usize = 64;
/// Under loom two per turn, so that a port re-queues itself with deliveries
/// left (models with three or more messages to one worker explore that).
#[cfg(loom)]
const PORT_BATCH: usize = 2;

/// Port states.
const PORT_IDLE: usize = 0;
const PORT_SCHEDULED: usize = 1;
const PORT_RUNNING: usize = 2;

// ----- the route table -------------------------------------------------------

/// A bucket's word: `sent` in the low 32 bits (messages routed to it,
/// modulo 2^32: fewer are ever in flight, each holding a credit unit), its
/// worker in the next 16, `UNPLACED` if none.
const SENT_MASK: u64 = (1 << 32) - 1;
const WORKER_SHIFT: u32 = 32;
const UNPLACED: u64 = 0xFFFF;

#[inline]
fn worker_of(word: u64) -> u64 {
    word >> WORKER_SHIFT
}

#[inline]
fn sent_of(word: u64) -> u32 {
    (word & SENT_MASK) as u32
}

#[inline]
fn route_word(worker: u64, sent: u32) -> u64 {
    (worker << WORKER_SHIFT) | u64::from(sent)
}

/// Buckets per dispatcher: enough that two keys rarely share one.
fn bucket_count(workers: usize) -> usize {
    #[cfg(not(loom))]
    return (256 * workers).next_power_of_two().clamp(1024, 16384);
    // Under loom two buckets: keys 0 and 1 may share one or not.
    #[cfg(loom)]
    {
        let _ = workers;
        2
    }
}

/// What a port keeps per bucket, under its gate.
#[derive(Clone, Copy, Default)]
struct BucketCount {
    /// Deliveries of the bucket this port took (modulo 2^32). Zero unless
    /// the port is the bucket's worker.
    received: u32,
    /// The bucket's mailboxes in this port's map.
    live: u32,
}

// ----- keys ------------------------------------------------------------------

/// The key hasher a dispatcher uses unless told otherwise
/// ([`DispatcherBuilder::hasher`]): a fast hash (foldhash) seeded at random
/// for each dispatcher.
///
/// Every message hashes its key once, on the submitting thread, so the
/// hasher is on the hot path: std's `RandomState` (SipHash-1-3) costs about
/// as much there as the rest of a submit. Random seeds keep keys an
/// attacker did not see from colliding on purpose; for keys an adversary
/// chooses *and* can probe (e.g. timing your service), give the dispatcher
/// `std::hash::RandomState::new()` instead.
#[derive(Clone, Debug, Default)]
pub struct DefaultHashBuilder(foldhash::fast::RandomState);

impl DefaultHashBuilder {
    /// A builder with fresh random seeds.
    pub fn new() -> Self {
        Self::default()
    }
}

impl BuildHasher for DefaultHashBuilder {
    type Hasher = DefaultHasher;

    #[inline]
    fn build_hasher(&self) -> DefaultHasher {
        DefaultHasher(self.0.build_hasher())
    }
}

/// The [`Hasher`] of [`DefaultHashBuilder`].
#[derive(Clone)]
pub struct DefaultHasher(foldhash::fast::FoldHasher<'static>);

impl fmt::Debug for DefaultHasher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DefaultHasher").finish_non_exhaustive()
    }
}

impl Hasher for DefaultHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0.finish()
    }
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        self.0.write(bytes)
    }
    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.0.write_u8(i)
    }
    #[inline]
    fn write_u16(&mut self, i: u16) {
        self.0.write_u16(i)
    }
    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.0.write_u32(i)
    }
    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.0.write_u64(i)
    }
    #[inline]
    fn write_u128(&mut self, i: u128) {
        self.0.write_u128(i)
    }
    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.0.write_usize(i)
    }
}

/// A key with the hash its submitter computed: the port's map never calls
/// the user's `Hash` again (only `Eq`).
pub(crate) struct Hashed<K> {
    hash: u64,
    key: K,
}

impl<K> Hash for Hashed<K> {
    #[inline]
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

impl<K: Eq> PartialEq for Hashed<K> {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        self.hash == other.hash && self.key == other.key
    }
}

impl<K: Eq> Eq for Hashed<K> {}

/// The hasher of a port's map: hands the submitter's hash through.
#[derive(Default)]
pub(crate) struct PassThrough(u64);

impl Hasher for PassThrough {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }

    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u64` is used (by `Hashed`); fold anything else in.
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

// ----- ports -----------------------------------------------------------------

/// A message on its way to its key's mailbox.
pub(crate) struct Delivery<K, M, O> {
    key: K,
    hash: u64,
    env: Envelope<M, O>,
}

/// A dispatcher's port on one worker.
///
/// `state`: `PORT_IDLE` (not queued), `PORT_SCHEDULED` (its task is in the
/// worker's queue, exactly once), `PORT_RUNNING` (a turn is under way). A
/// submitter pushes, fences, and moves it `IDLE` → `SCHEDULED` (CAS) to
/// queue it; the worker, done, stores `IDLE`, fences and re-checks the
/// inbox: either the submitter saw `RUNNING`/`SCHEDULED` after its push, or
/// the worker sees the push (SeqCst fences on both sides).
struct Port<K, M, H: Handler<K, M>, S> {
    state: AtomicUsize,
    /// Set (under the gate) by a force stop once it emptied the inbox;
    /// read by submitters after their push (see the module docs).
    closed: AtomicBool,
    inbox: Inbox<Delivery<K, M, H::Output>>,
    /// Held for a delivery's bookkeeping, never across a handler (so a
    /// spin lock: one swap to take, a store to release).
    gate: SpinLock<Gate<K, M, H, S>>,
}

/// What a port's gate guards.
struct Gate<K, M, H: Handler<K, M>, S> {
    /// Set once a force stop emptied the port: nothing is delivered after.
    closed: bool,
    /// The mailboxes of this worker's keys.
    keys: Keys<K, M, H, S>,
    /// Per bucket (allocated on the first delivery).
    buckets: Box<[BucketCount]>,
}

impl<K, M, H: Handler<K, M>, S> Gate<K, M, H, S> {
    #[inline]
    fn bucket(&mut self, b: usize, n: usize) -> &mut BucketCount {
        if self.buckets.is_empty() {
            self.buckets = vec![BucketCount::default(); n].into_boxed_slice();
        }
        &mut self.buckets[b]
    }
}

/// A delivery taken out of an inbox or map by a force stop.
enum Stopped<K, M, H: Handler<K, M>, S> {
    Delivery(Delivery<K, M, H::Output>),
    Mailbox(MailboxRef<K, M, H, S>),
}

/// The typed heart of a dispatcher. Mailboxes point back to it.
pub(crate) struct DispatcherInner<K, M, H: Handler<K, M>, S> {
    pub(crate) shared: Arc<Shared>,
    pub(crate) handler: H,
    hasher: S,
    routes: Box<[AtomicU64]>,
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
    /// The bucket of a hash: its high bits (the map uses the low ones).
    #[inline]
    fn bucket_of(&self, hash: u64) -> usize {
        (hash >> 40) as usize & (self.routes.len() - 1)
    }

    /// The worker of bucket `b`, whose word (after our `fetch_add`) is
    /// `word`; places the bucket if nobody has.
    #[cold]
    fn place(&self, b: usize, mut word: u64) -> usize {
        let mut picked = None;
        loop {
            if worker_of(word) != UNPLACED {
                return worker_of(word) as usize;
            }
            let p = *picked.get_or_insert_with(|| self.shared.pick_worker());
            match self.routes[b].compare_exchange(
                word,
                route_word(p as u64, sent_of(word)),
                SeqCst,
                SeqCst,
            ) {
                Ok(_) => return p,
                Err(actual) => word = actual,
            }
        }
    }

    /// Accepts `env` for `key`, or hands it back if the executor is closed.
    /// The message's credit unit is already taken.
    fn enqueue(
        this: &Arc<Self>,
        key: K,
        env: Envelope<M, H::Output>,
    ) -> Result<(), Envelope<M, H::Output>> {
        // The key's `Hash` is user code: a panic here reaches the submitter
        // (whose credit unit is given back by the receiver).
        let hash = this.hasher.hash_one(&key);
        if this.shared.is_closed() {
            return Err(env);
        }
        let b = this.bucket_of(hash);
        let word = this.routes[b].fetch_add(1, SeqCst);
        let worker = match worker_of(word) {
            UNPLACED => this.place(b, word + 1),
            w => w as usize,
        };
        let port = &this.ports[worker];
        let d = Delivery { key, hash, env };
        port.inbox.push(d);
        fence(SeqCst);
        if port.closed.load(SeqCst) {
            // A force stop may have emptied the inbox before our push
            // landed: hand back what is left, here.
            this.reject_late(port);
            return Ok(());
        }
        if port.state.load(SeqCst) == PORT_IDLE
            && port
                .state
                .compare_exchange(PORT_IDLE, PORT_SCHEDULED, SeqCst, Relaxed)
                .is_ok()
        {
            // A handler submitting to a key of its own worker queues the
            // port locally (no wake-up: it is running); anyone else pushes
            // it on the worker's queue and wakes it if it sleeps.
            let mut task = Some(Task::new(this.clone()));
            let _ = crate::pool::worker::with_worker_cx(this.shared.id(), worker, |cx| {
                cx.push_local(task.take().expect("taken once"));
            });
            if let Some(task) = task {
                this.shared.schedule(worker, task);
            }
        }
        Ok(())
    }

    /// The mailbox of `key` in this port's map, made if it has none (its
    /// pointer, valid while it is in the map: under the gate). `Err` if
    /// the key's `Eq`, `Clone` or `Drop` panicked (user code).
    fn mailbox_for(
        this: &Arc<Self>,
        gate: &mut Gate<K, M, H, S>,
        b: usize,
        hash: u64,
        key: K,
        worker: usize,
    ) -> Result<NonNull<Mailbox<K, M, H, S>>, Panic> {
        use std::collections::hash_map::Entry;
        fn ptr<T>(m: &Arc<T>) -> NonNull<T> {
            // From `Arc::as_ptr`: the pointer keeps the provenance of the
            // whole allocation, which `arc_clone_raw` needs to reach the
            // reference counts (Miri's Stacked Borrows rejects a pointer
            // derived from a `&T`).
            // SAFETY: an `Arc`'s pointer is never null.
            unsafe { NonNull::new_unchecked(Arc::as_ptr(m).cast_mut()) }
        }
        let keys = &mut gate.keys;
        let found = catch_unwind(AssertUnwindSafe(|| {
            match keys.entry(Hashed { hash, key }) {
                Entry::Occupied(e) => (ptr(e.get()), false),
                Entry::Vacant(e) => {
                    let key = e.key().key.clone();
                    let m = e.insert(Arc::new(Mailbox::new(key, hash, worker, this.clone())));
                    (ptr(m), true)
                }
            }
        }));
        match found {
            Ok((m, created)) => {
                if created {
                    gate.bucket(b, this.routes.len()).live += 1;
                }
                Ok(m)
            }
            Err(payload) => Err(Panic::new(payload)),
        }
    }

    /// A message whose key's `Eq`/`Clone` panicked in a port: it fails as
    /// panicked (without the `on_panic` hook, which needs the key).
    fn fail_unkeyed(&self, env: Envelope<M, H::Output>, panic: Panic) {
        let Envelope { reply, credit, .. } = env;
        // SAFETY: the failed message held this unit.
        unsafe { credit.release(1) };
        if let Some(slot) = reply {
            slot.complete(Err(TaskError::Panicked(panic)));
        }
    }

    /// A push that landed after a force stop emptied `port`: hand back
    /// whatever the inbox holds, on this (the submitter's) thread.
    #[cold]
    fn reject_late(&self, port: &Port<K, M, H, S>) {
        let late: Vec<Delivery<K, M, H::Output>> = {
            let _gate = port.gate.lock();
            // SAFETY: we hold the gate: the only consumer.
            std::iter::from_fn(|| unsafe { port.inbox.pop() }).collect()
        };
        for d in late {
            self.reject(&d.key, d.env);
        }
    }

    /// The port's turn on `cx`'s worker: take up to `PORT_BATCH` deliveries
    /// in order and offer each to its key's mailbox (see the module docs).
    fn run_port(this: Arc<Self>, cx: &WorkerCx<'_>) {
        let port = &this.ports[cx.index];
        port.state.store(PORT_RUNNING, SeqCst);
        cx.port_turn(true);
        let n = this.routes.len();
        let mut more = true;
        for _ in 0..PORT_BATCH {
            let mut gate = port.gate.lock();
            if gate.closed {
                more = false;
                break;
            }
            // SAFETY: we hold the gate: the only consumer.
            let Some(Delivery { key, hash, env }) = (unsafe { port.inbox.pop() }) else {
                more = false;
                break;
            };
            let b = this.bucket_of(hash);
            let count = gate.bucket(b, n);
            count.received = count.received.wrapping_add(1);
            let mailbox = match Self::mailbox_for(&this, &mut gate, b, hash, key, cx.index) {
                Ok(m) => m,
                Err(p) => {
                    drop(gate);
                    this.fail_unkeyed(env, p);
                    continue;
                }
            };
            // SAFETY: on the mailbox's worker, in its port's turn, gate held
            // and open; the map keeps the mailbox alive.
            match unsafe { Mailbox::offer(mailbox, env, cx) } {
                Offer::Inline(own, env) => {
                    // Not under the gate: a long handler must not hold up a
                    // stop (which takes the gate).
                    drop(gate);
                    Mailbox::run_inline(own, env, cx);
                }
                Offer::Queued(Some(task)) => {
                    drop(gate);
                    cx.requeue_local(task);
                }
                Offer::Queued(None) => {}
            }
        }
        if more {
            more = !port.inbox.is_empty();
        }
        cx.port_turn(false);
        if more {
            // Fairness: let the worker's other tasks run, then come back.
            port.state.store(PORT_SCHEDULED, SeqCst);
            cx.requeue_local(Task::new(this));
            return;
        }
        port.state.store(PORT_IDLE, SeqCst);
        fence(SeqCst);
        // A submitter that pushed before our store sees `RUNNING` or
        // `SCHEDULED` and leaves the scheduling to us. Re-queue only for a
        // value that is there: one claimed but not yet written makes
        // `is_empty` false while `pop` sees nothing, and its producer,
        // which reads the state after its push, schedules us itself.
        if !port.inbox.is_empty() {
            let ready = {
                let gate = port.gate.lock();
                // SAFETY: we hold the gate: the only consumer.
                !gate.closed && unsafe { port.inbox.has_ready() }
            };
            if ready
                && port
                    .state
                    .compare_exchange(PORT_IDLE, PORT_SCHEDULED, SeqCst, Relaxed)
                    .is_ok()
            {
                cx.push_local(Task::new(this));
            }
        }
    }

    /// The worker of an idle `mailbox` retires it: under its port's gate, if
    /// it is still idle and in the map, close it and remove it; a bucket left
    /// with no mailbox and no delivery in flight is un-placed.
    pub(crate) fn retire(&self, mailbox: &MailboxRef<K, M, H, S>, worker: usize) -> Retire {
        let port = &self.ports[worker];
        let mut gate = port.gate.lock();
        let mut outcome = Retire::Busy;
        let b = self.bucket_of(mailbox.hash());
        // `Eq` is user code: a panic here must not kill the worker. If it
        // does, the mailbox stays (idle) in the map.
        let removed = catch_unwind(AssertUnwindSafe(|| {
            let probe = Hashed {
                hash: mailbox.hash(),
                key: mailbox.key().clone(),
            };
            match gate.keys.get(&probe) {
                Some(m) if Arc::ptr_eq(m, mailbox) => {
                    if mailbox.is_idle() {
                        gate.keys.remove(&probe);
                        true
                    } else {
                        false
                    }
                }
                // Not findable: taken by a force stop, or a key whose `Eq`
                // is not reflexive (then no delivery can reach it).
                _ => {
                    if mailbox.close_if_idle() {
                        outcome = Retire::Retired;
                    }
                    false
                }
            }
        }));
        if let Ok(true) = removed {
            let closed = mailbox.close_if_idle();
            debug_assert!(closed, "an idle mailbox in the map changed under the gate");
            if closed {
                outcome = Retire::Retired;
            }
            let n = self.routes.len();
            let count = gate.bucket(b, n);
            count.live -= 1;
            if count.live == 0 {
                let received = count.received;
                // Un-place the bucket if every message sent to it arrived
                // here (the CAS fails if a submitter sent meanwhile).
                let placed = route_word(worker as u64, received);
                if self.routes[b]
                    .compare_exchange(placed, route_word(UNPLACED, 0), SeqCst, Relaxed)
                    .is_ok()
                {
                    gate.bucket(b, n).received = 0;
                }
            }
            // Give memory back once most keys went quiet.
            let len = gate.keys.len();
            if gate.keys.capacity() > 64 && len * 4 < gate.keys.capacity() {
                gate.keys.shrink_to(len * 2);
            }
        }
        drop(gate);
        if matches!(outcome, Retire::Retired) && self.handles.load(Acquire) == 0 {
            self.shared.deregister_if_idle(self.id);
        }
        outcome
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

    /// (mailboxes with work, idle mailboxes kept for reuse, map entries).
    fn count_mailboxes(&self) -> (usize, usize, usize) {
        let (mut live, mut idle, mut all) = (0, 0, 0);
        for port in self.ports.iter() {
            let gate = port.gate.lock();
            all += gate.keys.len();
            for m in gate.keys.values() {
                if m.is_at_rest() {
                    idle += usize::from(!m.is_closed());
                } else {
                    live += 1;
                }
            }
        }
        (live, idle, all)
    }

    /// Force stop, on the stopping thread (see the module docs).
    fn force_drain(&self) -> usize {
        let mut n = 0;
        for port in self.ports.iter() {
            // Take everything out under the gate (which waits for a worker
            // in the middle of a delivery); reject it after, outside.
            let stopped: Vec<Stopped<K, M, H, S>> = {
                let mut gate = port.gate.lock();
                gate.closed = true;
                port.closed.store(true, SeqCst);
                // After `closed`: a push this drain does not see sees it.
                fence(SeqCst);
                // SAFETY: we hold the gate: the only consumer.
                let mut out: Vec<_> = std::iter::from_fn(|| unsafe { port.inbox.pop() })
                    .map(Stopped::Delivery)
                    .collect();
                out.extend(gate.keys.drain().map(|(_, m)| Stopped::Mailbox(m)));
                out
            };
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
    /// Force stop: take every mailbox out of its port, reject its queue on
    /// this thread and cancel its suspended future.
    fn force_drain(&self) -> usize;
    /// (mailboxes with work, idle mailboxes kept for reuse, map entries).
    fn count_mailboxes(&self) -> (usize, usize, usize);
    /// Messages in worker `worker`'s inbox of this dispatcher.
    fn inbox_len(&self, worker: usize) -> usize;
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

    fn count_mailboxes(&self) -> (usize, usize, usize) {
        self.0.count_mailboxes()
    }

    fn inbox_len(&self, worker: usize) -> usize {
        self.0.ports[worker].inbox.len()
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

    fn shared(&self) -> &Arc<Shared> {
        &self.0.shared
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
pub struct DispatcherBuilder<'e, K, M, H, S = DefaultHashBuilder> {
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

impl<'e, K, M, H> DispatcherBuilder<'e, K, M, H, DefaultHashBuilder> {
    pub(crate) fn new(executor: &'e KeyedExecutor, handler: H) -> Self {
        DispatcherBuilder {
            executor,
            handler,
            hasher: DefaultHashBuilder::new(),
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

    /// The hasher for keys (default: [`DefaultHashBuilder`], a fast hash
    /// seeded at random per dispatcher). For keys an adversary chooses and
    /// can probe, `std::hash::RandomState::new()` (SipHash) resists HashDoS
    /// better, at a cost on every submit.
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
        let id = shared.next_dispatcher_id();
        let buckets = bucket_count(shared.workers.len());
        let inner = Arc::new(DispatcherInner {
            shared: shared.clone(),
            handler: self.handler,
            routes: (0..buckets)
                .map(|_| AtomicU64::new(route_word(UNPLACED, 0)))
                .collect(),
            ports: (0..shared.workers.len())
                .map(|_| {
                    CachePadded::new(Port {
                        state: AtomicUsize::new(PORT_IDLE),
                        closed: AtomicBool::new(false),
                        inbox: Inbox::new(),
                        gate: SpinLock::new(Gate {
                            closed: false,
                            keys: HashMap::default(),
                            buckets: Box::new([]),
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
