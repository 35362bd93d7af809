//! Dispatchers: one handler, the route table that says which worker each
//! key's bucket lives on, and one port per worker: its inbox and the
//! mailboxes of the keys that live there.
//!
//! # Routing
//!
//! A submitter hashes the key (the dispatcher's hasher) and picks the key's
//! *bucket* from the hash's high bits: one of `routes.len()` (≥ 1,024)
//! words that map buckets to workers. A submitter *reads* its bucket's
//! word (acquire); a bucket nobody has placed yet is placed by the first
//! submitter, with one CAS (`pick_worker`: a running worker with nothing
//! queued, else a parked one, else the least loaded). The submitter then
//! pushes a delivery (key, hash, message) on that worker's port inbox and,
//! if the port is idle, schedules it. The route table is small (8 bytes a
//! bucket) and written once per bucket, so it stays shared in every
//! submitter's cache: a submit touches no per-key state and writes no
//! line another submitter reads (before, a `fetch_add` per message counted
//! it in the bucket — a locked instruction on the producer's path, and a
//! line that bounced between producers whose keys shared it).
//!
//! The port's runner owns its mailboxes: the port's map (key → mailbox,
//! keyed by the submitter's hash) lives under the port's *gate*, a lock
//! the runner takes per delivery and that stops, retirement and takeovers
//! take to touch the port. A port's turn takes its deliveries in order:
//! one for a key with a mailbox joins that mailbox's queue; one for a key
//! without runs at once in the port's slot, with the gate released, if
//! the key has `throughput` left in its turn (see [`Turns`]), and
//! otherwise gets a mailbox with the message queued, at the back of the
//! worker's queue.
//!
//! # Fairness: a turn takes what its inbox held when it began
//!
//! A turn begins with a mark of its inbox's tail (`Inbox::mark`) and takes
//! every delivery claimed before it, however many (the credit of the
//! sources bounds them); what is pushed after the mark waits for the
//! port's next turn, which the port queues behind the worker's other
//! tasks. A mailbox the turn gives a queued message (a key whose turn was
//! spent in the slot) or that yields meanwhile goes to the back of the
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
//! ahead of the inbox, and the credit bounds them as it bounds the rest. A turn lets its gate go every
//! `GATE_HOLD` deliveries, so that a stop or a retiring mailbox never
//! waits for a whole backlog.
//!
//! A bucket keeps the port it was placed on for the dispatcher's life.
//! Port `p` belongs to worker `p`: its task is queued there, and its
//! mailboxes run there. Its task carries the port's index (the task's
//! tag), so that another worker can run it when work conservation moves
//! it (see `executor.rs`): for that turn only.
//!
//! # Taking over a turn
//!
//! A message of a key without a mailbox runs in the port's slot, inside the
//! port's turn, with the gate released; the rest of the inbox waits for it.
//! If that step is long and a worker idles, the idle worker takes the rest
//! of the turn over:
//!
//! - Who asks: an idle worker that finds a stuck worker whose port's turn
//!   holds deliveries (`StopTarget::takeover`, from `WorkerCx::help`; it
//!   takes the `TAKEOVER` task itself, and `rescue` keeps it to one at a
//!   time). Submitters do not look at the turn's worker (see "Who watches"
//!   in `executor.rs`).
//! - Under the gate, if the slot is still lent (`lent`), the taker puts
//!   the lent slot in the map as its key's mailbox (so that key's next
//!   deliveries queue behind its running message), bumps `epoch`, becomes
//!   the `runner`, and runs the rest of the turn as its own. `state` stays
//!   `RUNNING` throughout: nobody else schedules the port meanwhile.
//! - The old runner, when its message returns, finds `epoch` changed under
//!   the gate: the turn is not its own any more. It goes on as the slot's
//!   mailbox (its queue, then retirement through `drained`, or suspension),
//!   and never touches the port's state again.
//! - Only the slot's step can be taken over: every other release of the
//!   gate in a turn happens with `lent` cleared.
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

use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::hash::{BuildHasher, BuildHasherDefault, Hash, Hasher};
use std::marker::PhantomData;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;

use crate::completion::{Outcome, Slot};
use crate::error::{ConfigError, Panic, TaskError};
use crate::pool::executor::{KeyedExecutor, Shared};
use crate::pool::handler::Handler;
use crate::pool::inbox::{Inbox, Popped};
use crate::pool::mailbox::{Envelope, Held, Mailbox, Stamp, Step};
use crate::pool::observe::Identity;
#[cfg(not(loom))]
use crate::pool::receiver::WeakCore;
use crate::pool::receiver::{Batch, Core, Receiver, ReceiverBuilder};
use crate::pool::source::{wait_all_drained, Ended, Source, SourceRef};
use crate::pool::task::{Runnable, Task};
use crate::pool::worker::WorkerCx;
use crate::sync::atomic::fence;
use crate::sync::atomic::{AtomicBool, AtomicPtr, AtomicU16, AtomicUsize, Ordering::*};
use crate::sync::{Arc, SpinGuard, SpinLock};
use crate::trace;

type RejectHook<K, M> = Box<dyn Fn(K, M) + Send + Sync + 'static>;
type PanicHook<K> = Box<dyn Fn(&K, Panic) + Send + Sync + 'static>;
type PaddedPort<K, M, H, S> = CachePadded<Port<K, M, H, S>>;
pub(crate) type MailboxRef<K, M, H, S> = Arc<Mailbox<K, M, H, S>>;
type Keys<K, M, H, S> = HashMap<Hashed<K>, MailboxRef<K, M, H, S>, BuildHasherDefault<PassThrough>>;

/// Deliveries a port's turn takes in a row before it lets its gate go
/// for a moment (a stop, a retiring mailbox or a look for a takeover may
/// be waiting for it); the turn goes on after. (Loom models never reach
/// it: each lock is a scheduling point, and the turn owns nothing at that
/// moment that another thread could take.)
const GATE_HOLD: usize = 64;

/// Port states.
const PORT_IDLE: usize = 0;
const PORT_SCHEDULED: usize = 1;
const PORT_RUNNING: usize = 2;

/// In a port task's tag (beside the port's index): take over the port's
/// turn from a runner stuck in its slot (see "Taking over a turn").
const TAKEOVER: usize = 1 << (usize::BITS - 1);

// ----- the route table -------------------------------------------------------

/// A bucket's word: its worker's index, `UNPLACED` until the first
/// submitter places it. UNPLACED → placed is its only transition (one CAS,
/// by any submitter); nothing writes it after. Two bytes a bucket: the
/// table is paid by every dispatcher, idle or not.
const UNPLACED: u16 = u16::MAX;

/// Buckets per dispatcher: enough that two keys rarely share one, and
/// that placement spreads keys over the workers.
fn bucket_count(workers: usize) -> usize {
    #[cfg(not(loom))]
    return (64 * workers).next_power_of_two().clamp(1024, 16384);
    // Under loom two buckets: keys 0 and 1 may share one or not.
    #[cfg(loom)]
    {
        let _ = workers;
        2
    }
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

/// A borrowed (hash, key) to look a key up in a port's map without owning
/// it (`Hashed<K>: Borrow<dyn KeyProbe<K>>`).
pub(crate) trait KeyProbe<K> {
    fn probe(&self) -> (u64, &K);
}

impl<K> KeyProbe<K> for Hashed<K> {
    #[inline]
    fn probe(&self) -> (u64, &K) {
        (self.hash, &self.key)
    }
}

impl<K> KeyProbe<K> for (u64, &K) {
    #[inline]
    fn probe(&self) -> (u64, &K) {
        (self.0, self.1)
    }
}

impl<'a, K: 'a> std::borrow::Borrow<dyn KeyProbe<K> + 'a> for Hashed<K> {
    #[inline]
    fn borrow(&self) -> &(dyn KeyProbe<K> + 'a) {
        self
    }
}

impl<K: Eq> PartialEq for dyn KeyProbe<K> + '_ {
    #[inline]
    fn eq(&self, other: &Self) -> bool {
        let ((h1, k1), (h2, k2)) = (self.probe(), other.probe());
        h1 == h2 && k1 == k2
    }
}

impl<K: Eq> Eq for dyn KeyProbe<K> + '_ {}

impl<K> Hash for dyn KeyProbe<K> + '_ {
    #[inline]
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.probe().0);
    }
}

/// Spare mailboxes a port keeps for keys that get one (a backlog, a
/// suspended future) at least; it keeps up to as many as it has live
/// mailboxes (see `drained`), and beyond that a released one is freed.
const SPARES: usize = 32;

// ----- ports -----------------------------------------------------------------

/// A message on its way to its key's mailbox.
pub(crate) struct Delivery<K, M, O> {
    key: K,
    hash: u64,
    env: Envelope<M, O>,
}

/// A delivery a source stop kept back, with its metrics stamp.
type Deferred<K, M, O> = (Delivery<K, M, O>, Stamp);

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
    /// A takeover of its turn is on its way to an idle worker (set by the
    /// idle worker that found the turn stuck, cleared by whoever runs it).
    rescue: AtomicBool,
    /// Set (under the gate) by a force stop once it emptied the inbox;
    /// read by submitters after their push (see the module docs).
    closed: AtomicBool,
    /// The gate's `deferred` queue is not empty (set by a source stop under
    /// the gate, cleared by the port's turn under it; read by the port at
    /// the end of a turn, after a fence, like the inbox).
    deferred: AtomicBool,
    inbox: Inbox<Delivery<K, M, H::Output>>,
    /// Held for a delivery's bookkeeping, never across a handler (so a
    /// spin lock: one swap to take, a store to release). On its own lines:
    /// the worker takes it per delivery, submitters never touch it.
    gate: CachePadded<SpinLock<Gate<K, M, H, S>>>,
}

/// A dispatcher's ports, one per worker, each made when its worker first
/// gets a delivery of the dispatcher: an idle dispatcher pays a pointer per
/// worker, not a port. Made ports live as long as the dispatcher.
struct Ports<P> {
    slots: Box<[AtomicPtr<P>]>,
}

impl<P> Ports<P> {
    fn new(n: usize) -> Self {
        Ports {
            slots: (0..n)
                .map(|_| AtomicPtr::new(std::ptr::null_mut()))
                .collect(),
        }
    }

    /// Port `i`, if it was made.
    #[inline]
    fn get(&self, i: usize) -> Option<&P> {
        // SeqCst: against a force stop, which sets its flag and then walks
        // the slots (see `DispatcherInner::port`).
        let p = self.slots[i].load(SeqCst);
        // SAFETY: a non-null slot points to a port made by `get_or_make`,
        // freed only when `self` drops.
        (!p.is_null()).then(|| unsafe { &*p })
    }

    /// Port `i`, which a task or a mailbox of it shows was made.
    #[inline]
    fn made(&self, i: usize) -> &P {
        self.get(i).expect("a port with work was made")
    }

    /// Port `i`, made now (with `make`) if it was not: one CAS decides
    /// between racing makers, the loser frees its own.
    #[inline]
    fn get_or_make(&self, i: usize, make: impl FnOnce() -> P) -> &P {
        if let Some(p) = self.get(i) {
            return p;
        }
        self.make(i, make)
    }

    #[cold]
    fn make(&self, i: usize, make: impl FnOnce() -> P) -> &P {
        let new = Box::into_raw(Box::new(make()));
        match self.slots[i].compare_exchange(std::ptr::null_mut(), new, SeqCst, SeqCst) {
            // SAFETY: just published; freed only when `self` drops.
            Ok(_) => unsafe { &*new },
            Err(theirs) => {
                // SAFETY: ours, never published.
                drop(unsafe { Box::from_raw(new) });
                // SAFETY: as in `get`.
                unsafe { &*theirs }
            }
        }
    }

    /// The ports made so far, with their worker.
    fn iter(&self) -> impl Iterator<Item = (usize, &P)> + '_ {
        (0..self.slots.len()).filter_map(move |i| self.get(i).map(|p| (i, p)))
    }
}

impl<P> Drop for Ports<P> {
    fn drop(&mut self) {
        for slot in self.slots.iter() {
            let p = slot.load(Acquire);
            if !p.is_null() {
                // SAFETY: made by `make` with `Box::into_raw`; nobody holds
                // a reference once the dispatcher drops.
                drop(unsafe { Box::from_raw(p) });
            }
        }
    }
}

impl<K, M, H: Handler<K, M>, S> Port<K, M, H, S> {
    /// Its identity among the ports a worker serves (its address: a port
    /// lives as long as its dispatcher).
    #[inline]
    fn id(&self) -> usize {
        self as *const Self as usize
    }

    /// Worker `p`'s port, idle and empty.
    fn new(p: usize) -> Self {
        Port {
            state: AtomicUsize::new(PORT_IDLE),
            rescue: AtomicBool::new(false),
            closed: AtomicBool::new(false),
            deferred: AtomicBool::new(false),
            inbox: Inbox::new(),
            gate: CachePadded::new(SpinLock::new(Gate {
                closed: false,
                active: HashMap::default(),
                slot: None,
                lent: None,
                epoch: 0,
                runner: p,
                until: 0,
                spares: Vec::new(),
                deferred: VecDeque::new(),
            })),
        }
    }
}

/// What a port's gate guards.
struct Gate<K, M, H: Handler<K, M>, S> {
    /// Set once a force stop emptied the port: nothing is delivered after.
    closed: bool,
    /// The mailboxes of this worker's keys that have work (a backlog, a
    /// running turn, a suspended future). A key without a mailbox has none.
    active: Keys<K, M, H, S>,
    /// The free mailbox the port lends a message of a key without one.
    slot: Option<MailboxRef<K, M, H, S>>,
    /// The slot out running a message in the turn's owner's hands, if
    /// any (for stats, and for a takeover, which moves it into the map).
    lent: Option<Lent<K, M, H, S>>,
    /// Bumped by each takeover of the port's turn: a runner that finds it
    /// changed when its slot comes back has lost the turn.
    epoch: u32,
    /// The worker whose turn it is (or was last).
    runner: usize,
    /// The inbox's mark when the turn began: the turn takes the deliveries
    /// claimed before it (see "Fairness"); a takeover goes on to the same.
    until: usize,
    /// Free mailboxes for keys that get one.
    spares: Vec<MailboxRef<K, M, H, S>>,
    /// Deliveries a source stop took out of the inbox to hand back its own
    /// and kept for the others (with their metrics stamps): they go ahead
    /// of the inbox, in order.
    deferred: VecDeque<Deferred<K, M, H::Output>>,
}

/// The lent slot: a pointer, not a reference count (that would cost two
/// atomic operations a message); the runner holds the `Arc` while it is
/// set, and clears it under the gate before it lets the slot go.
struct Lent<K, M, H: Handler<K, M>, S>(NonNull<Mailbox<K, M, H, S>>);

impl<K, M, H: Handler<K, M>, S> Clone for Lent<K, M, H, S> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<K, M, H: Handler<K, M>, S> Copy for Lent<K, M, H, S> {}

// SAFETY: a pointer to a mailbox, which is `Send + Sync` under the bounds
// every dispatcher has; it is only dereferenced under the gate while the
// runner keeps the mailbox alive (see above).
unsafe impl<K, M, H: Handler<K, M>, S> Send for Lent<K, M, H, S> {}

/// The outcome of looking a delivery's key up in a port's map.
enum Lookup<K, M, H: Handler<K, M>, S> {
    /// The key has a mailbox (in the map); the key is handed back too.
    Active(NonNull<Mailbox<K, M, H, S>>, K),
    /// It has none: the key is handed back.
    Absent(K),
}

/// A delivery taken out of an inbox or map by a force stop.
enum Stopped<K, M, H: Handler<K, M>, S> {
    Delivery(Delivery<K, M, H::Output>),
    Mailbox(MailboxRef<K, M, H, S>),
}

/// A message taken out by a source's stop, with its key (none when the
/// key's `Clone` panicked: it goes back through its completion only).
type Handed<K, M, O> = (Option<K>, Envelope<M, O>);

/// The typed heart of a dispatcher. Mailboxes point back to it.
///
/// Aligned to a line pair of its own: its `Arc`'s counts (moved by every
/// port task and mailbox made) then sit on a line apart from the fields
/// every submit reads.
#[repr(align(128))]
pub(crate) struct DispatcherInner<K, M, H: Handler<K, M>, S> {
    pub(crate) shared: Arc<Shared>,
    pub(crate) handler: H,
    hasher: S,
    routes: Box<[AtomicU16]>,
    ports: Ports<PaddedPort<K, M, H, S>>,
    on_reject: Option<RejectHook<K, M>>,
    on_panic: Option<PanicHook<K>>,
    /// User-facing handles (`Dispatcher`s and `Receiver`s).
    handles: AtomicUsize,
    id: u64,
    /// Its name and metrics handles (see `observe.rs`).
    pub(crate) ident: Identity,
    /// The dispatcher refuses new messages (its own stop).
    closed: AtomicBool,
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

    /// The worker of bucket `b`.
    #[inline]
    fn route(&self, b: usize) -> usize {
        match self.routes[b].load(Acquire) {
            UNPLACED => self.place(b),
            w => usize::from(w),
        }
    }

    /// Places bucket `b`, unplaced when we looked, unless another
    /// submitter did meanwhile: the CAS decides, and both use its winner.
    #[cold]
    fn place(&self, b: usize) -> usize {
        let p = self.shared.pick_worker();
        match self.routes[b].compare_exchange(UNPLACED, p as u16, AcqRel, Acquire) {
            Ok(_) => p,
            Err(placed) => usize::from(placed),
        }
    }

    /// Port `p`, made now if this is its first delivery. A port made after
    /// a force stop began is closed at once (the stop's walk may have
    /// passed its slot; see `force_drain`).
    #[inline]
    fn port(&self, p: usize) -> &Port<K, M, H, S> {
        if let Some(port) = self.ports.get(p) {
            return port;
        }
        let port = self.ports.get_or_make(p, || CachePadded::new(Port::new(p)));
        if self.shared.is_forced() {
            let mut gate = port.gate.lock();
            gate.closed = true;
            port.closed.store(true, SeqCst);
        }
        port
    }

    /// Whether the dispatcher (or the executor) refuses new messages.
    #[inline]
    fn refuses(&self) -> bool {
        self.closed.load(SeqCst) || self.shared.is_closed()
    }

    /// Accepts `env` for `key` and returns its position, or hands it back
    /// if the executor, the dispatcher or the message's source is closed.
    /// The message's credit unit is already taken.
    ///
    /// The position is taken *before* the last look at the stop flags
    /// (both SeqCst): a stop sets its flag, then waits until every position
    /// taken so far has ended; so a message either sees the flag and is
    /// refused (its position recorded as returned: the commit point never
    /// passes a message that did not run), or is waited for.
    fn enqueue(
        this: &Arc<Self>,
        key: K,
        mut env: Envelope<M, H::Output>,
    ) -> Result<u64, Envelope<M, H::Output>> {
        // The key's `Hash` is user code: a panic here reaches the submitter
        // (whose credit unit is given back by the receiver).
        let hash = this.hasher.hash_one(&key);
        let source_ref = env.held.source;
        let source = source_ref.get();
        if source.is_closed() || this.refuses() {
            return Err(env);
        }
        let position = source.take_position();
        env.held.set_position(position);
        if source.is_closed() || this.refuses() {
            source.record(position, Ended::Returned);
            return Err(env);
        }
        let worker = this.route(this.bucket_of(hash));
        let port = this.port(worker);
        let d = Delivery { key, hash, env };
        port.inbox
            .push_stamped(d, this.shared.metrics.stamp(position));
        fence(SeqCst);
        if port.closed.load(SeqCst) {
            // A force stop may have emptied the inbox before our push
            // landed: hand back what is left, here.
            this.reject_late(port);
            return Ok(position);
        }
        Self::schedule_port(this, worker);
        Ok(position)
    }

    /// After a push to port `p`'s inbox (and a fence): queues the port's
    /// task unless it is queued or running already. If it is, the delivery
    /// waits for that turn, maybe behind a long step. The submitter does
    /// not look at the step (a look reads a line the busy worker writes per
    /// step): the idle workers do, and take the turn over if the step is
    /// stuck (see "Taking over a turn"). It only makes sure one of them
    /// will look again: if one sleeps without a timeout, it is called
    /// (see "Who watches" in `executor.rs`).
    #[inline]
    fn schedule_port(this: &Arc<Self>, p: usize) {
        let state = &this.ports.made(p).state;
        if state.load(SeqCst) == PORT_IDLE
            && state
                .compare_exchange(PORT_IDLE, PORT_SCHEDULED, SeqCst, SeqCst)
                .is_ok()
        {
            Self::queue_port(this, p);
        } else {
            // SeqCst (in `any_deep`): a deep sleeper counted itself before
            // it looked at the ports and the workers.
            this.shared.ensure_watcher(p);
        }
    }

    /// Queues port `p`'s task, the port just made SCHEDULED: locally for a
    /// handler submitting to a key of its own worker (no wake-up: it is
    /// running), else on the worker's queue, waking it if it sleeps.
    #[inline]
    fn queue_port(this: &Arc<Self>, p: usize) {
        let mut task = Some(Task::tagged(this.clone(), p));
        let _ = crate::pool::worker::with_worker_cx(this.shared.id(), p, |cx| {
            cx.push_local(task.take().expect("taken once"));
        });
        match task {
            // To an idle worker instead if `p` is stuck.
            Some(task) => {
                this.shared.schedule(p, task);
            }
            // Behind the handler that sent it, which may run long.
            None => this.shared.ensure_watcher(p),
        }
    }

    /// Accepts a batch of one source, every message holding its own unit,
    /// in order; returns the first of its consecutive positions. The keys'
    /// hashes are computed first (user code: a panic reaches the caller
    /// before anything was accepted); positions are taken once, and each
    /// port touched gets one fence and one schedule check for the whole
    /// batch. If the dispatcher or the source is closed, every message is
    /// handed back, in order.
    fn enqueue_batch(
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
        // Ports touched, in first-touch order.
        let mut touched: Vec<usize> = Vec::new();
        for (i, ((key, mut env), hash)) in batch.into_iter().zip(hashes).enumerate() {
            let position = start + i as u64;
            env.held.set_position(position);
            let worker = this.route(this.bucket_of(hash));
            this.port(worker).inbox.push_stamped(
                Delivery { key, hash, env },
                this.shared.metrics.stamp(position),
            );
            if !touched.contains(&worker) {
                touched.push(worker);
            }
        }
        fence(SeqCst);
        for worker in touched {
            let port = this.ports.made(worker);
            if port.closed.load(SeqCst) {
                // As in `enqueue`: a force stop may have emptied the inbox
                // before our pushes landed.
                this.reject_late(port);
                continue;
            }
            Self::schedule_port(this, worker);
        }
        Ok(start)
    }

    /// Looks a delivery's key up among the port's active mailboxes (the
    /// gate held). `Err` if the key's `Eq` panicked (user code).
    #[inline]
    fn lookup(
        gate: &Gate<K, M, H, S>,
        hash: u64,
        key: K,
    ) -> Result<Lookup<K, M, H, S>, (K, Panic)> {
        if gate.active.is_empty() {
            return Ok(Lookup::Absent(key));
        }
        let found = catch_unwind(AssertUnwindSafe(|| {
            gate.active
                .get(&(hash, &key) as &dyn KeyProbe<K>)
                .map(|m| mailbox_ptr(m))
        }));
        match found {
            Ok(Some(m)) => Ok(Lookup::Active(m, key)),
            Ok(None) => Ok(Lookup::Absent(key)),
            Err(payload) => Err((key, Panic::new(payload))),
        }
    }

    /// A free mailbox for port `p`: a spare, or a new one.
    fn spare(this: &Arc<Self>, gate: &mut Gate<K, M, H, S>, p: usize) -> MailboxRef<K, M, H, S> {
        gate.spares
            .pop()
            .unwrap_or_else(|| Arc::new(Mailbox::new(p, this.clone())))
    }

    /// Puts `mailbox` (assigned to its key, not yet in the map) into the
    /// port's map. `Err` (the mailbox back) if the key's `Clone` or `Eq`
    /// panicked.
    fn activate(
        &self,
        gate: &mut Gate<K, M, H, S>,
        mailbox: &MailboxRef<K, M, H, S>,
    ) -> Result<(), Panic> {
        // SAFETY: under the gate, the mailbox is ours and has a key.
        let (hash, key) = unsafe { (mailbox.hash(), mailbox.key()) };
        let active = &mut gate.active;
        let inserted = catch_unwind(AssertUnwindSafe(|| {
            active.insert(
                Hashed {
                    hash,
                    key: key.clone(),
                },
                mailbox.clone(),
            )
        }));
        match inserted {
            Ok(old) => {
                debug_assert!(old.is_none(), "a key got a second mailbox");
                Ok(())
            }
            Err(payload) => Err(Panic::new(payload)),
        }
    }

    /// A mailbox's runner found its queue empty (see `Mailbox::turn`):
    /// under the port's gate, if it still is, the mailbox leaves the map and
    /// goes back to the port's spares (`None`); a message that arrived
    /// meanwhile keeps it (`Some`, go on).
    pub(crate) fn drained(
        mailbox: &MailboxRef<K, M, H, S>,
        cx: &WorkerCx<'_>,
        spent: usize,
    ) -> bool {
        let this = &mailbox.dispatcher_ref();
        let port = this.ports.made(mailbox.port());
        let mut gate = port.gate.lock();
        // SAFETY: we own the turn and hold the gate.
        if !unsafe { mailbox.still_empty() } {
            return false;
        }
        if gate.closed || this.shared.is_forced() {
            // A force stop took (or takes) the map: it hands back the rest.
            // SAFETY: as above.
            let _ = unsafe { mailbox.release(true) };
            return true;
        }
        // SAFETY: as above: a mailbox in the map has a key.
        let hash = unsafe { mailbox.hash() };
        let active = &mut gate.active;
        // `Eq` is user code: if it panics, or is not reflexive, the
        // mailbox stays in the map, closed; nothing is queued in it, and a
        // delivery that finds it fails its message.
        let removed = catch_unwind(AssertUnwindSafe(|| {
            // SAFETY: as above.
            let key = unsafe { mailbox.key() };
            active.remove(&(hash, key) as &dyn KeyProbe<K>).is_some()
        }));
        if !matches!(removed, Ok(true)) {
            // SAFETY: as above.
            let _ = unsafe { mailbox.release(true) };
            return true;
        }
        crate::pool::metrics::mailboxes(cx, &this.ident.metrics, -1);
        cx.record_turn(port.id(), hash, spent.min(u32::MAX as usize) as u32);
        // SAFETY: as above: the queue is empty, no future is stored.
        let key = unsafe { mailbox.release(false) };
        // Keep as many spares as the port has live mailboxes, plus a
        // quarter, plus `SPARES`: keys whose handlers suspend (async I/O)
        // each hold a mailbox while they wait, and with a fixed cap every
        // message paid an allocation and a free (W3). The margin absorbs a
        // burst of completions (a device finishing many futures at once):
        // with the cap at the live count exactly, each drain of a burst
        // lowered the cap by one and freed two mailboxes, which the next
        // burst of new keys allocated again. As the live ones drain, one
        // excess spare goes per drain, so the spares follow them down; the
        // last live one's drain keeps `SPARES` and lets the rest go.
        let live = gate.active.len();
        let keep = SPARES + live + live / 4;
        let excess: Vec<MailboxRef<K, M, H, S>> = if live == 0 && gate.spares.len() > SPARES {
            gate.spares.split_off(SPARES)
        } else if gate.spares.len() < keep {
            gate.spares.push(mailbox.clone());
            Vec::new()
        } else if gate.spares.len() > keep {
            gate.spares.pop().into_iter().collect()
        } else {
            Vec::new()
        };
        drop(gate);
        drop(excess);
        // The key's `Drop` is user code, out of the gate.
        let _ = catch_unwind(AssertUnwindSafe(move || drop(key)));
        this.maybe_deregister();
        true
    }

    /// A message whose key's `Eq`/`Clone` panicked in a port: it fails as
    /// panicked (without the `on_panic` hook, which needs the key).
    fn fail_unkeyed(&self, env: Envelope<M, H::Output>, panic: Panic) {
        self.ident.metrics.finished_direct(false);
        let Envelope { reply, held, .. } = env;
        self.end(held, Ended::Finished, None, false);
        if let Some(slot) = reply {
            slot.complete(Err(TaskError::Panicked(panic)));
        }
    }

    /// A message of this dispatcher ended (finished, failed, handed back or
    /// cancelled): records how at its position, gives back its unit
    /// (batched on a worker if `batched`) and drops its pin on its source.
    #[inline]
    fn end(&self, held: Held, ended: Ended, cx: Option<&WorkerCx<'_>>, batched: bool) {
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
        if held.pinned() {
            // No unit of its source came back: wake whoever waits on it.
            source.share_ended();
            // SAFETY: the message held this pin (see `Held`).
            unsafe { held.source.unpin() };
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
    fn returned(&self, env: Envelope<M, H::Output>) -> (M, Option<Arc<Slot<H::Output, M>>>) {
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
    fn reject_keyless(&self, env: Envelope<M, H::Output>) {
        let (msg, reply) = self.returned(env);
        match reply {
            Some(slot) => slot.complete(Err(TaskError::Rejected(msg))),
            None => {
                let _ = catch_unwind(AssertUnwindSafe(move || drop(msg)));
            }
        }
    }

    /// A source stop, on the stopping thread (see `receiver.rs`): hands back
    /// every message of a source that `stopped` picks waiting in this
    /// dispatcher's ports (inboxes and mailbox queues) and cancels their
    /// suspended futures; a mailbox running a step is asked to look before
    /// it suspends. The other sources' deliveries taken out of an inbox go
    /// ahead of it, in order. Returns how many messages came back.
    fn stop_sources(this: &Arc<Self>, stopped: &dyn Fn(SourceRef) -> bool) -> usize {
        let mut n = 0;
        for (worker, port) in this.ports.iter() {
            let mut handed: Vec<Handed<K, M, H::Output>> = Vec::new();
            let mut claimed: Vec<MailboxRef<K, M, H, S>> = Vec::new();
            let deferred = {
                let mut gate = port.gate.lock();
                if gate.closed {
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
                port.deferred.store(deferred, SeqCst);
                for m in gate.active.values() {
                    let out = m.take_queued(stopped);
                    if !out.is_empty() {
                        // SAFETY: under the gate, a mailbox in the map has a
                        // key nobody takes. Its `Clone` is user code.
                        let key =
                            catch_unwind(AssertUnwindSafe(|| unsafe { m.key() }.clone())).ok();
                        handed.extend(out.into_iter().map(|env| (key.clone(), env)));
                    }
                    if m.claim_for_stop() {
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
                if port.state.load(SeqCst) == PORT_IDLE
                    && port
                        .state
                        .compare_exchange(PORT_IDLE, PORT_SCHEDULED, SeqCst, Relaxed)
                        .is_ok()
                {
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

    /// Port `p`'s turn on `cx`'s worker: take the deliveries its inbox
    /// holds now, in order (see "Fairness" and `mailbox.rs`).
    fn run_port(this: Arc<Self>, p: usize, cx: &WorkerCx<'_>) {
        let port = this.ports.made(p);
        port.state.store(PORT_RUNNING, SeqCst);
        cx.port_turn(Some(p));
        let mut gate = port.gate.lock();
        gate.until = port.inbox.mark();
        gate.runner = cx.index;
        let epoch = gate.epoch;
        Self::deliveries(&this, p, gate, epoch, cx);
    }

    /// A takeover (see "Taking over a turn"): if port `p`'s turn is still
    /// running a message in its slot, this worker takes the rest of the
    /// turn; the slot becomes its key's mailbox, so that key's next
    /// messages queue behind the running one.
    fn take_over(this: Arc<Self>, p: usize, cx: &WorkerCx<'_>) {
        let port = this.ports.made(p);
        port.rescue.store(false, Release);
        let mut gate = port.gate.lock();
        let Some(Lent(slot)) = gate.lent else {
            // The runner is back from its slot: its turn goes on.
            return;
        };
        if gate.closed || this.shared.is_forced() {
            return;
        }
        // SAFETY: the lent slot is alive while `lent` is set (its runner
        // holds it), and `Arc::as_ptr` made the pointer.
        let slot = unsafe { crate::sync::arc_clone_raw(slot.as_ptr().cast_const()) };
        if this.activate(&mut gate, &slot).is_err() {
            // The key's `Clone` or `Eq` panicked: leave the turn to its runner.
            return;
        }
        crate::pool::metrics::mailboxes(cx, &this.ident.metrics, 1);
        gate.lent = None;
        gate.epoch = gate.epoch.wrapping_add(1);
        let epoch = gate.epoch;
        gate.runner = cx.index;
        drop(slot);
        cx.port_turn(Some(p));
        Self::deliveries(&this, p, gate, epoch, cx);
    }

    /// The body of port `p`'s turn, owned while the gate's epoch is
    /// `epoch`.
    fn deliveries<'a>(
        this: &'a Arc<Self>,
        p: usize,
        mut gate: SpinGuard<'a, Gate<K, M, H, S>>,
        epoch: u32,
        cx: &WorkerCx<'_>,
    ) {
        let port = this.ports.made(p);
        let throughput = this.shared.config.throughput as u32;
        let port_id = port.id();
        // Whether the turn stopped at its mark with deliveries maybe left.
        let mut more = false;
        let mut held = 0;
        loop {
            if gate.closed {
                break;
            }
            held += 1;
            if held > GATE_HOLD {
                // Nothing is lent: the turn cannot be taken over meanwhile.
                drop(gate);
                gate = port.gate.lock();
                held = 1;
                if gate.closed {
                    break;
                }
            }
            // Deliveries a source stop took out of the inbox first: they
            // were there before any the inbox still holds.
            let next = match gate.deferred.pop_front() {
                Some(d) => {
                    if gate.deferred.is_empty() {
                        port.deferred.store(false, Relaxed);
                    }
                    d
                }
                // SAFETY: we hold the gate: the only consumer.
                None => match unsafe { port.inbox.pop_before(gate.until) } {
                    Popped::Value(d, stamp) => (d, stamp),
                    Popped::Past => {
                        more = true;
                        break;
                    }
                    Popped::Unwritten => break,
                },
            };
            let (Delivery { key, hash, env }, stamp) = next;
            if env.held.source.get().is_stopped() {
                // Its source is stopping: hand it back, do not start it.
                drop(gate);
                Self::hand_over(this, &key, env);
                gate = port.gate.lock();
                continue;
            }
            let key = match Self::lookup(&gate, hash, key) {
                Ok(Lookup::Active(m, key)) => {
                    // SAFETY: in the map, under the gate.
                    if let Err(env) = unsafe { m.as_ref() }.deliver(env, stamp) {
                        // Closed (a force stop under way, or a key whose
                        // `Eq` failed it): handed back.
                        drop(gate);
                        this.reject(&key, env);
                        gate = port.gate.lock();
                    }
                    continue;
                }
                Ok(Lookup::Absent(key)) => key,
                Err((key, p)) => {
                    drop(gate);
                    this.fail_unkeyed(env, p);
                    drop(key);
                    gate = port.gate.lock();
                    continue;
                }
            };
            // The key has no mailbox: nothing of it waits or runs.
            let spent = cx.turn_spent(port_id, hash);
            if spent < throughput && !this.shared.is_forced() {
                // Run it now, in the port's slot, with the gate released (a
                // long handler must not hold up a stop, which takes it).
                let slot = match gate.slot.take() {
                    Some(slot) => slot,
                    None => Self::spare(this, &mut gate, p),
                };
                // SAFETY: the slot is free and we hold the gate.
                unsafe {
                    slot.assign(key, hash);
                    slot.lend();
                }
                gate.lent = Some(Lent(mailbox_ptr(&slot)));
                drop(gate);
                cx.step();
                // SAFETY: the slot is ours (`RUNNING`), with a key, no future.
                let step = unsafe { Mailbox::start(&slot, env, stamp, cx) };
                gate = port.gate.lock();
                if gate.epoch != epoch {
                    // Taken over while the message ran: the turn is another
                    // worker's, and the slot its key's mailbox, in the map
                    // (maybe with messages queued): go on as that mailbox.
                    drop(gate);
                    cx.port_turn(None);
                    match step {
                        Step::Done => {
                            let left = (throughput - spent - 1) as usize;
                            Mailbox::turn(slot, cx, left);
                        }
                        Step::Pending => Mailbox::after_pending(slot, cx),
                    }
                    return;
                }
                gate.lent = None;
                match step {
                    Step::Done => {
                        cx.record_turn(port_id, hash, spent + 1);
                        // SAFETY: ours, under the gate, finished.
                        let key = unsafe { slot.release(false) };
                        match gate.slot {
                            None => gate.slot = Some(slot),
                            Some(_) => gate.spares.push(slot),
                        }
                        if std::mem::needs_drop::<K>() {
                            drop(gate);
                            let _ = catch_unwind(AssertUnwindSafe(move || drop(key)));
                            gate = port.gate.lock();
                        }
                    }
                    Step::Pending => {
                        // The slot becomes the key's mailbox. (After a force
                        // stop emptied the port, the runner cancels it.)
                        if !gate.closed {
                            if let Err(p) = this.activate(&mut gate, &slot) {
                                drop(gate);
                                this.stray_pending(slot, p, cx);
                                gate = port.gate.lock();
                                continue;
                            }
                            crate::pool::metrics::mailboxes(cx, &this.ident.metrics, 1);
                        }
                        drop(gate);
                        Mailbox::after_pending(slot, cx);
                        gate = port.gate.lock();
                    }
                }
            } else {
                // Its turn is spent (or a force stop began): it gets a
                // mailbox with this message queued, at the back of the
                // worker's queue, as a mailbox that used up its turn goes.
                let m = Self::spare(this, &mut gate, p);
                // SAFETY: free, under the gate.
                unsafe { m.assign(key, hash) };
                if let Err(p) = this.activate(&mut gate, &m) {
                    // SAFETY: free, under the gate.
                    let key = unsafe { m.take_key() };
                    drop(gate);
                    this.fail_unkeyed(env, p);
                    let _ = catch_unwind(AssertUnwindSafe(move || drop(key)));
                    gate = port.gate.lock();
                    continue;
                }
                crate::pool::metrics::mailboxes(cx, &this.ident.metrics, 1);
                // SAFETY: free, assigned, under the gate.
                unsafe { m.schedule_with(env, stamp) };
                drop(gate);
                cx.requeue_local(Task::new(m));
                gate = port.gate.lock();
            }
        }
        if more {
            more = !port.inbox.is_empty() || !gate.deferred.is_empty();
        }
        drop(gate);
        cx.port_turn(None);
        if more {
            // Fairness: what was pushed during the turn waits behind the
            // worker's other tasks, the mailboxes this turn queued
            // included (see "Fairness").
            port.state.store(PORT_SCHEDULED, SeqCst);
            cx.requeue_local(Task::tagged(this.clone(), p));
            return;
        }
        port.state.store(PORT_IDLE, SeqCst);
        fence(SeqCst);
        // A submitter that pushed before our store sees `RUNNING` or
        // `SCHEDULED` and leaves the scheduling to us. Re-queue only for a
        // value that is there: one claimed but not yet written makes
        // `is_empty` false while `pop` sees nothing, and its producer,
        // which reads the state after its push, schedules us itself.
        if !port.inbox.is_empty() || port.deferred.load(SeqCst) {
            let ready = {
                let gate = port.gate.lock();
                // SAFETY: we hold the gate: the only consumer.
                !gate.closed && (!gate.deferred.is_empty() || unsafe { port.inbox.has_ready() })
            };
            if ready
                && port
                    .state
                    .compare_exchange(PORT_IDLE, PORT_SCHEDULED, SeqCst, Relaxed)
                    .is_ok()
            {
                cx.push_local(Task::tagged(this.clone(), p));
                return;
            }
        }
        if this.handles.load(Acquire) == 0 {
            this.maybe_deregister();
        }
    }

    /// A suspended future whose key could not be put in the map (its
    /// `Clone` or `Eq` panicked): nothing could deliver its key's next
    /// messages to it, so it is cancelled here, its message failed.
    #[cold]
    fn stray_pending(&self, slot: MailboxRef<K, M, H, S>, _panic: Panic, cx: &WorkerCx<'_>) {
        let _ = cx;
        // SAFETY: the slot is still ours (`RUNNING`, not in the map).
        unsafe { slot.cancel_current() };
        slot.close();
    }

    /// With no handle left, the dispatcher leaves the executor's registry
    /// once nothing of it is in flight, freeing its spare mailboxes (which
    /// hold it).
    pub(crate) fn maybe_deregister(&self) {
        if self.handles.load(Acquire) == 0 {
            self.shared.deregister_if_idle(self.id);
        }
    }

    /// Delivers a finished message's outcome, records it at its position
    /// and returns its credit.
    pub(crate) fn finish(
        &self,
        key: &K,
        reply: Option<Arc<Slot<H::Output, M>>>,
        held: Held,
        cx: Option<&WorkerCx<'_>>,
        outcome: Outcome<H::Output, M>,
    ) {
        if let Some(cx) = cx {
            let counters = &self.shared.workers[cx.index].counters;
            match &outcome {
                // Only this worker's thread writes these two: no RMW needed.
                Ok(_) => {
                    let done = counters.done.load(Relaxed) + 1;
                    counters.done.store(done, Relaxed);
                    crate::pool::metrics::done(Some(cx), &self.ident.metrics, done);
                }
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

    /// (keys with work in a mailbox, free mailboxes kept for reuse, map
    /// entries plus slots out running).
    fn count_mailboxes(&self) -> (usize, usize, usize) {
        let (mut live, mut free, mut all) = (0, 0, 0);
        for (_, port) in self.ports.iter() {
            let gate = port.gate.lock();
            let lent = usize::from(gate.lent.is_some());
            all += gate.active.len() + lent;
            live += gate.active.values().filter(|m| !m.is_closed()).count() + lent;
            free += gate.spares.len() + usize::from(gate.slot.is_some());
        }
        (live, free, all)
    }

    /// Whether nothing of this dispatcher is in flight: no mailbox, no slot
    /// out, nothing in an inbox.
    fn is_quiet(&self) -> bool {
        self.ports.iter().all(|(_, port)| {
            let gate = port.gate.lock();
            gate.active.is_empty()
                && gate.lent.is_none()
                && gate.deferred.is_empty()
                && port.inbox.is_empty()
        })
    }

    /// Frees the ports' slots and spare mailboxes (each holds the
    /// dispatcher: a cycle until this). Only once nothing is in flight.
    fn release_spares(&self) {
        for (_, port) in self.ports.iter() {
            let freed: Vec<MailboxRef<K, M, H, S>> = {
                let mut gate = port.gate.lock();
                let mut freed = std::mem::take(&mut gate.spares);
                freed.extend(gate.slot.take());
                freed
            };
            drop(freed);
        }
    }

    /// Force stop, on the stopping thread (see the module docs).
    fn force_drain(&self) -> usize {
        let mut n = 0;
        for (_, port) in self.ports.iter() {
            // Take everything out under the gate (which waits for a worker
            // in the middle of a delivery); reject it after, outside.
            let (stopped, mailboxes): (Vec<Stopped<K, M, H, S>>, usize) = {
                let mut gate = port.gate.lock();
                gate.closed = true;
                port.closed.store(true, SeqCst);
                // After `closed`: a push this drain does not see sees it.
                fence(SeqCst);
                // SAFETY: we hold the gate: the only consumer.
                let mut out: Vec<_> = std::mem::take(&mut gate.deferred)
                    .into_iter()
                    .map(|(d, _)| d)
                    .chain(std::iter::from_fn(|| unsafe { port.inbox.pop() }))
                    .map(Stopped::Delivery)
                    .collect();
                port.deferred.store(false, Relaxed);
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

/// A mailbox's pointer from its `Arc` (`Arc::as_ptr` keeps the provenance
/// of the whole allocation, which `arc_clone_raw` needs).
#[inline]
fn mailbox_ptr<K, M, H: Handler<K, M>, S>(
    m: &MailboxRef<K, M, H, S>,
) -> NonNull<Mailbox<K, M, H, S>> {
    // SAFETY: an `Arc`'s pointer is never null.
    unsafe { NonNull::new_unchecked(Arc::as_ptr(m).cast_mut()) }
}

impl<K, M, H, S> Runnable for DispatcherInner<K, M, H, S>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    M: Send + 'static,
    H: Handler<K, M>,
    S: BuildHasher + Send + Sync + 'static,
{
    /// A port task (`tag`: the port, and whether to take over its turn).
    fn run(this: Arc<Self>, cx: &WorkerCx<'_>, tag: usize) {
        if tag & TAKEOVER != 0 {
            Self::take_over(this, tag & !TAKEOVER, cx);
        } else {
            Self::run_port(this, tag, cx);
        }
    }

    /// A force stop empties inboxes itself; the port just goes idle.
    fn cancel(this: Arc<Self>, tag: usize) {
        if tag & TAKEOVER != 0 {
            this.ports
                .made(tag & !TAKEOVER)
                .rescue
                .store(false, Release);
        }
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
    /// Nothing of the dispatcher is in flight (see `is_quiet`).
    fn is_quiet(&self) -> bool;
    /// Frees its spare mailboxes (it is leaving the registry).
    fn release_spares(&self);
    /// A takeover of a port whose worker `stuck` runs its turn with
    /// deliveries waiting (see "Taking over a turn").
    fn takeover(&self, stuck: usize) -> Option<Task>;
    /// Whether one of its ports is queued or running (SeqCst loads; see
    /// "Who watches" in `executor.rs`).
    fn any_port_busy(&self) -> bool;
    fn id(&self) -> u64;
    /// Its name and metrics handles.
    fn ident(&self) -> &Identity;
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
        self.0.ports.get(worker).map_or(0, |port| port.inbox.len())
    }

    fn is_quiet(&self) -> bool {
        self.0.is_quiet()
    }

    fn release_spares(&self) {
        self.0.release_spares()
    }

    fn takeover(&self, stuck: usize) -> Option<Task> {
        let (p, _) = self.0.ports.iter().find(|(_, port)| {
            port.state.load(SeqCst) == PORT_RUNNING
                && (!port.inbox.is_empty() || port.deferred.load(SeqCst))
                && {
                    let gate = port.gate.lock();
                    gate.runner == stuck && gate.lent.is_some()
                }
                && !port.rescue.swap(true, AcqRel)
        })?;
        Some(Task::tagged(self.0.clone(), p | TAKEOVER))
    }

    fn any_port_busy(&self) -> bool {
        self.0
            .ports
            .iter()
            .any(|(_, port)| port.state.load(SeqCst) != PORT_IDLE)
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
    fn enqueue(&self, key: K, env: Envelope<M, H::Output>) -> Result<u64, Envelope<M, H::Output>> {
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
struct WeakHandle<K, M, H: Handler<K, M>, S>(std::sync::Weak<DispatcherInner<K, M, H, S>>);

#[cfg(not(loom))]
impl<K, M, H, S> WeakCore<K, M, H::Output> for WeakHandle<K, M, H, S>
where
    K: Hash + Eq + Clone + Send + Sync + 'static,
    M: Send + 'static,
    H: Handler<K, M>,
    S: BuildHasher + Send + Sync + 'static,
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
    /// messages, with the default commit span (see
    /// [`receiver_builder`](Self::receiver_builder) for more settings).
    ///
    /// # Errors
    /// [`ConfigError::ZeroMaxInFlight`] if `max_in_flight` is 0,
    /// [`ConfigError::MaxInFlightTooLarge`] beyond 2^40 − 1.
    pub fn receiver(&self, max_in_flight: usize) -> Result<Receiver<K, M, O>, ConfigError> {
        self.receiver_builder().max_in_flight(max_in_flight).build()
    }

    /// A new receiver like [`receiver`](Self::receiver), whose
    /// `keyed_executor_in_flight` series (with the `metrics` feature) is
    /// labelled `receiver = name` instead of its number in this dispatcher
    /// (`"0"`, `"1"`, …); the same as
    /// `receiver_builder().max_in_flight(max_in_flight).name(name).build()`
    /// (see [`ReceiverBuilder::name`]). Name the receivers of sources that
    /// come and go (a partition revoked and assigned again): the series is
    /// then reused rather than a new one made each time. Without the
    /// feature the name is not kept.
    ///
    /// # Errors
    /// As for [`receiver`](Self::receiver).
    pub fn named_receiver(
        &self,
        name: impl Into<String>,
        max_in_flight: usize,
    ) -> Result<Receiver<K, M, O>, ConfigError> {
        self.receiver_builder()
            .max_in_flight(max_in_flight)
            .name(name)
            .build()
    }

    /// A new receiver with the default `max_in_flight`
    /// ([`DEFAULT_MAX_IN_FLIGHT`](crate::DEFAULT_MAX_IN_FLIGHT), 256).
    pub fn default_receiver(&self) -> Receiver<K, M, O> {
        self.receiver_builder()
            .build()
            .expect("the defaults are valid")
    }

    /// Configures a new receiver: its credit, its commit span and its
    /// metrics label.
    pub fn receiver_builder(&self) -> ReceiverBuilder<K, M, O> {
        ReceiverBuilder::new(self.core.clone_box())
    }

    /// Its name ([`DispatcherBuilder::name`]; by default `dispatcher-{n}`,
    /// `n` counting this executor's dispatchers from 1).
    pub fn name(&self) -> &str {
        &self.core.ident().name
    }

    /// Keys with work right now: a mailbox with messages queued, running,
    /// or suspended on a future (a key that has none has no mailbox).
    /// Counting visits every mailbox: cheap enough to poll now and then, not
    /// per message.
    pub fn live_mailboxes(&self) -> usize {
        self.core.live_mailboxes()
    }

    /// Whether the dispatcher refuses new messages: it was shut down, or the
    /// executor is shutting down.
    pub fn is_closed(&self) -> bool {
        self.core.is_closed()
    }

    /// Stops this dispatcher (a component) gracefully while the others go
    /// on, on the same workers: from now on every receiver of it refuses new
    /// messages (`Closed(msg)`), and this waits until every message they
    /// accepted has ended. `true` if that happened within `timeout` (zero:
    /// look now); `false` if not (the messages go on; call again to wait
    /// more, or [`shutdown_now`](Self::shutdown_now)). Idempotent.
    ///
    /// A service stops its components first, then the executor:
    /// `dispatcher.shutdown(t)` for each, then
    /// [`KeyedExecutor::shutdown`](crate::KeyedExecutor::shutdown).
    ///
    /// Called from a handler (on a worker) it closes and says whether the
    /// dispatcher has drained, without waiting.
    pub fn shutdown(&self, timeout: Duration) -> bool {
        let shared = self.core.shared();
        self.core.close();
        let sources = shared.sources_of(Some(self.core.id()));
        // Submitters waiting for credit leave with their messages: after
        // the flag (see `Acquire`). A source made after this look sees the
        // flag when it first waits.
        for s in &sources {
            s.release_waiters();
        }
        let refs: Vec<&Source> = sources.iter().map(|s| &**s).collect();
        if crate::pool::worker::on_worker_of(shared.id()) {
            return refs.iter().all(|s| s.is_drained());
        }
        wait_all_drained(&refs, Instant::now().checked_add(timeout), false)
    }

    /// Stops this dispatcher now, as [`Receiver::shutdown_now`] does for one
    /// source, for all of its receivers: they refuse new messages, every
    /// queued message is handed back on the calling thread (through its
    /// [`Completion`](crate::Completion) as `Rejected(msg)`, or the
    /// `on_reject` hook), every suspended future is cancelled, and this
    /// waits for the steps running now. After it returns no message of this
    /// dispatcher starts; the other dispatchers go on. Idempotent.
    pub fn shutdown_now(&self) {
        let shared = self.core.shared();
        self.core.close();
        let sources = shared.sources_of(Some(self.core.id()));
        for s in &sources {
            s.stopper_enter();
            s.stop();
        }
        self.core.stop_sources(&|_| true);
        if !crate::pool::worker::on_worker_of(shared.id()) {
            let refs: Vec<&Source> = sources.iter().map(|s| &**s).collect();
            wait_all_drained(&refs, None, true);
        }
        for s in &sources {
            s.stopper_leave();
        }
        // As after the executor's force stop: the in-flight gauges show
        // what the stop handed back.
        shared.metrics.refresh_gauges();
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
            .field("name", &self.name())
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
    name: Option<String>,
    _types: PhantomData<fn(K, M)>,
}

impl<K, M, H, S> fmt::Debug for DispatcherBuilder<'_, K, M, H, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DispatcherBuilder")
            .field("name", &self.name)
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
            name: None,
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

    /// The dispatcher's name, used in its metrics series (label
    /// `dispatcher`, with the `metrics` feature), its tracing events (field
    /// `dispatcher`), [`ExecutorStats::dispatchers`](crate::ExecutorStats::dispatchers),
    /// [`WorkerStats::current_step`](crate::WorkerStats::current_step) and
    /// slow-step reports. Default: `dispatcher-{n}`, `n` counting this
    /// executor's dispatchers from 1.
    ///
    /// Any string is taken as it is (`build` cannot fail); names need not
    /// be unique: dispatchers sharing a name share their series, which is
    /// what a component re-created after a restart wants. Give names when
    /// one process has several executors: their default names repeat.
    pub fn name(mut self, name: impl Into<String>) -> Self {
        self.name = Some(name.into());
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
            name: self.name,
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
            routes: (0..buckets).map(|_| AtomicU16::new(UNPLACED)).collect(),
            ports: Ports::new(shared.workers.len()),
            hasher: self.hasher,
            on_reject: self.on_reject,
            on_panic: self.on_panic,
            handles: AtomicUsize::new(0),
            id,
            ident: Identity::new(id, self.name),
            closed: AtomicBool::new(false),
        });
        let handle = CoreHandle::new(inner.clone());
        shared.register(Box::new(Target(inner)));
        Dispatcher {
            core: Box::new(handle),
        }
    }
}
