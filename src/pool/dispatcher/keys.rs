//! A port's key map: the mailboxes of its keys with work, found by the
//! submitter's hash, and their retirement when they drain.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hash, Hasher};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::NonNull;

use crate::error::Panic;
use crate::pool::handler::Handler;
use crate::pool::mailbox::{Envelope, Mailbox, Stamp};
use crate::pool::task::Task;
use crate::pool::turns::Turns;
use crate::pool::worker::WorkerCx;
use crate::pool::{PoolHasher, PoolKey};
use crate::sync::Arc;

use super::port::{Delivery, Gate};
use super::{DispatcherInner, KeyMailbox, MailboxRef};

pub(super) type Keys<K, M, H, S> =
    HashMap<Hashed<K>, MailboxRef<K, M, H, S>, BuildHasherDefault<PassThrough>>;

/// A key with the hash its submitter computed: the port's map never calls
/// the user's `Hash` again (only `Eq`).
pub(crate) struct Hashed<K> {
    pub(super) hash: u64,
    pub(super) key: K,
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
/// suspended future) at least; it keeps up to [`SPARES_PER_LIVE`] for each
/// live mailbox beside them (see [`trim`]), and beyond that a released one
/// is freed.
pub(super) const SPARES: usize = 32;

/// Spares a port may keep for each of its live mailboxes, beyond
/// [`SPARES`]. Keys whose handlers suspend (async I/O) each hold a mailbox
/// while they wait, and the number waiting swings with the device: a
/// device that finishes many futures at once drains many mailboxes, and
/// the next burst of sends suspends as many again. Each spare freed on the
/// way down is an allocation on the way up. With 4, the live count may
/// fall to a fifth of its peak before a drain frees anything; memory
/// still follows the live keys (about five mailboxes a live one, and
/// `SPARES` once the port has none live).
const SPARES_PER_LIVE: usize = 4;

/// What a drained mailbox does with itself and its port's spares, given
/// the spares kept and the live mailboxes left (see `drained`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Trim {
    /// Join the spares.
    Keep,
    /// Be freed, the spares being at or over their cap, and `more` spares
    /// with it (at most [`SPARES_PER_LIVE`]: the cap falls by as many with
    /// each live mailbox gone, so the spares follow it down, a bounded
    /// number a drain).
    Free { more: usize },
    /// No live mailbox is left: be freed with every spare beyond `SPARES`.
    FreeAllButSpares,
}

/// See [`Trim`].
fn trim(spares: usize, live: usize) -> Trim {
    let cap = SPARES + SPARES_PER_LIVE * live;
    if live == 0 && spares > SPARES {
        Trim::FreeAllButSpares
    } else if spares < cap {
        Trim::Keep
    } else {
        Trim::Free {
            more: (spares - cap).min(SPARES_PER_LIVE),
        }
    }
}

/// What to do with a delivery once its port's gate is let go (see
/// [`DispatcherInner::settle`]): the turn's and a slice's common ends.
pub(super) enum Settle<K, M, H: Handler<K, M>, S> {
    /// A delivery of a stopping source: hand it back.
    HandOver(K, Envelope<M, H::Output>),
    /// A delivery its (closed) mailbox refused: hand it back.
    Reject(K, Envelope<M, H::Output>),
    /// A delivery whose key's `Eq` panicked: fail it, then drop the key.
    FailKeyed(K, Envelope<M, H::Output>, Panic),
    /// A delivery whose new mailbox could not join the map (the key's
    /// `Clone` or `Eq` panicked): fail it, then drop the key, contained.
    FailNew(Option<K>, Envelope<M, H::Output>, Panic),
    /// A new mailbox with the delivery queued: to the back of this
    /// worker's queue.
    Queue(MailboxRef<K, M, H, S>),
}

/// A delivery whose key has no mailbox.
pub(super) struct Absent<K, M, O> {
    pub(super) key: K,
    pub(super) hash: u64,
    pub(super) env: Envelope<M, O>,
    pub(super) stamp: Stamp,
}

/// Where a delivery taken off a port's inbox goes, sorted under the gate
/// (see [`DispatcherInner::sort`]).
pub(super) enum Sorted<K, M, H: Handler<K, M>, S> {
    /// Into its key's mailbox: done.
    Delivered,
    /// Its key has no mailbox (nothing of it waits or runs): the caller
    /// runs it lent the loaner, or gives it a mailbox (`new_mailbox`).
    Absent(Absent<K, M, H::Output>),
    /// To settle with the gate let go.
    Settle(Settle<K, M, H, S>),
}

/// Below this many entries a port's map and its spares' list keep
/// whatever capacity they grew to.
const SHRINK_FLOOR: usize = 1024;

/// Memory follows the live keys: once a burst of keys has drained, a
/// port's map and its list of spares (neither of which shrinks by itself)
/// go back to about twice what they hold, as soon as they hold less than
/// an eighth of their capacity. A shrink moves what is left, so it is paid
/// once per burst, not per key.
fn shrink_after_burst<A, B>(
    active: &mut HashMap<A, B, impl std::hash::BuildHasher>,
    spares: &mut Vec<impl Sized>,
) where
    A: Hash + Eq,
{
    if active.capacity() > SHRINK_FLOOR && active.len() < active.capacity() / 8 {
        active.shrink_to(active.len() * 2);
    }
    if spares.capacity() > SHRINK_FLOOR && spares.len() < spares.capacity() / 8 {
        spares.shrink_to(spares.len() * 2);
    }
}

/// The outcome of looking a delivery's key up in a port's map.
pub(super) enum Lookup<K, M, H: Handler<K, M>, S> {
    /// The key has a mailbox (in the map); the key is handed back too.
    Active(NonNull<KeyMailbox<K, M, H, S>>, K),
    /// It has none: the key is handed back.
    Absent(K),
}

/// A mailbox's pointer from its `Arc` (`Arc::as_ptr` keeps the provenance
/// of the whole allocation, which `arc_clone_raw` needs).
#[inline]
pub(super) fn mailbox_ptr<K, M, H: Handler<K, M>, S>(
    m: &MailboxRef<K, M, H, S>,
) -> NonNull<KeyMailbox<K, M, H, S>> {
    // SAFETY: an `Arc`'s pointer is never null.
    unsafe { NonNull::new_unchecked(Arc::as_ptr(m).cast_mut()) }
}

impl<K, M, H, S> DispatcherInner<K, M, H, S>
where
    K: PoolKey,
    M: Send + 'static,
    H: Handler<K, M>,
    S: PoolHasher,
{
    /// Looks a delivery's key up among the port's active mailboxes (the
    /// gate held). `Err` if the key's `Eq` panicked (user code).
    #[inline]
    pub(super) fn lookup(
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

    /// Under the gate, a delivery just taken off port's inbox: handed
    /// over if its source is stopping, into its key's mailbox if it has
    /// one, else `Absent`.
    #[inline(always)]
    pub(super) fn sort(
        gate: &Gate<K, M, H, S>,
        delivery: Delivery<K, M, H::Output>,
        stamp: Stamp,
    ) -> Sorted<K, M, H, S> {
        let Delivery { key, hash, env } = delivery;
        if env.held.source.get().is_stopped() {
            // Its source is stopping: hand it back, do not start it.
            return Sorted::Settle(Settle::HandOver(key, env));
        }
        match Self::lookup(gate, hash, key) {
            Ok(Lookup::Active(m, key)) => {
                // SAFETY: in the map, under the gate.
                match unsafe { m.as_ref() }.deliver(env, stamp) {
                    Ok(()) => Sorted::Delivered,
                    // Closed (a force stop under way, or a key whose `Eq`
                    // failed it): handed back.
                    Err(env) => Sorted::Settle(Settle::Reject(key, env)),
                }
            }
            Ok(Lookup::Absent(key)) => Sorted::Absent(Absent {
                key,
                hash,
                env,
                stamp,
            }),
            Err((key, panic)) => Sorted::Settle(Settle::FailKeyed(key, env, panic)),
        }
    }

    /// Under the gate of port `p`: gives `key` (without a mailbox) a new
    /// one, in the map, with the delivery queued (`Queue`: the caller
    /// queues its task), or fails the delivery (`FailNew`).
    pub(super) fn new_mailbox(
        this: &Arc<Self>,
        gate: &mut Gate<K, M, H, S>,
        p: usize,
        absent: Absent<K, M, H::Output>,
        cx: &WorkerCx<'_>,
    ) -> Settle<K, M, H, S> {
        let Absent {
            key,
            hash,
            env,
            stamp,
        } = absent;
        let m = Self::spare(this, gate, p);
        // SAFETY: free, under the gate.
        unsafe { m.assign(key, hash) };
        if let Err(panic) = this.activate(gate, &m) {
            // SAFETY: free, under the gate.
            let key = unsafe { m.take_key() };
            return Settle::FailNew(key, env, panic);
        }
        crate::pool::metrics::mailboxes(cx, &this.ident.metrics, 1);
        // SAFETY: free, assigned, under the gate.
        unsafe { m.schedule_with(env, stamp) };
        Settle::Queue(m)
    }

    /// With the gate let go: what a delivery's sorting left to do (user
    /// code — a key's `Drop`, hooks — runs here, never under the gate).
    pub(super) fn settle(this: &Arc<Self>, settle: Settle<K, M, H, S>, cx: &WorkerCx<'_>) {
        match settle {
            Settle::HandOver(key, env) => Self::hand_over(this, &key, env),
            Settle::Reject(key, env) => this.reject(&key, env),
            Settle::FailKeyed(key, env, panic) => {
                this.fail_unkeyed(env, panic);
                drop(key);
            }
            Settle::FailNew(key, env, panic) => {
                this.fail_unkeyed(env, panic);
                let _ = catch_unwind(AssertUnwindSafe(move || drop(key)));
            }
            Settle::Queue(m) => cx.requeue_local(Task::new(m)),
        }
    }

    /// A free mailbox for port `p`: a spare, or a new one.
    pub(super) fn spare(
        this: &Arc<Self>,
        gate: &mut Gate<K, M, H, S>,
        p: usize,
    ) -> MailboxRef<K, M, H, S> {
        gate.spares
            .pop()
            .unwrap_or_else(|| Arc::new(Mailbox::new(p, this.clone())))
    }

    /// Puts `mailbox` (assigned to its key, not yet in the map) into the
    /// port's map. `Err` (the mailbox back) if the key's `Clone` or `Eq`
    /// panicked.
    pub(super) fn activate(
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
        let this = &mailbox.owner();
        let port = this.ports.made(mailbox.port());
        let mut gate = port.gate.lock();
        // SAFETY: we own the turn and hold the gate.
        if !unsafe { mailbox.still_empty() } {
            return false;
        }
        if port.state.is_closed() || this.shared.is_forced() {
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
        cx.record_turn(
            Turns::seat(port.id(), hash),
            spent.min(u32::MAX as usize) as u32,
        );
        // SAFETY: as above: the queue is empty, no future is stored.
        let key = unsafe { mailbox.release(false) };
        // The spares follow the live mailboxes (see `SPARES_PER_LIVE`);
        // what is freed is dropped out of the gate.
        let mut excess: Vec<MailboxRef<K, M, H, S>> = Vec::new();
        let mut more: [Option<MailboxRef<K, M, H, S>>; SPARES_PER_LIVE] = Default::default();
        match trim(gate.spares.len(), gate.active.len()) {
            Trim::Keep => gate.spares.push(mailbox.clone()),
            Trim::Free { more: n } => {
                for slot in more.iter_mut().take(n) {
                    *slot = gate.spares.pop();
                }
            }
            Trim::FreeAllButSpares => excess = gate.spares.split_off(SPARES),
        }
        {
            let gate = &mut *gate;
            shrink_after_burst(&mut gate.active, &mut gate.spares);
        }
        drop(gate);
        drop(excess);
        drop(more);
        // The key's `Drop` is user code, out of the gate.
        let _ = catch_unwind(AssertUnwindSafe(move || drop(key)));
        this.maybe_deregister();
        true
    }

    /// (keys with work in a mailbox, free mailboxes kept for reuse, map
    /// entries plus loaners out running).
    pub(super) fn count_mailboxes(&self) -> (usize, usize, usize) {
        let (mut live, mut free, mut all) = (0, 0, 0);
        for (_, port) in self.ports.iter() {
            let gate = port.gate.lock();
            let lent = usize::from(gate.lent.is_some());
            all += gate.active.len() + lent;
            live += gate.active.values().filter(|m| !m.is_closed()).count() + lent;
            free += gate.spares.len() + usize::from(gate.loaner.is_some());
        }
        (live, free, all)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::collections::HashMap;
    use std::hash::{BuildHasher, BuildHasherDefault};

    use super::{Hashed, KeyProbe, PassThrough};

    type Map = HashMap<Hashed<String>, u32, BuildHasherDefault<PassThrough>>;

    fn insert(map: &mut Map, hash: u64, key: &str, v: u32) {
        map.insert(
            Hashed {
                hash,
                key: key.to_owned(),
            },
            v,
        );
    }

    fn get(map: &Map, hash: u64, key: &str) -> Option<u32> {
        let key = key.to_owned();
        map.get(&(hash, &key) as &dyn KeyProbe<String>).copied()
    }

    #[test]
    fn the_map_hashes_with_the_submitters_hash() {
        let b = BuildHasherDefault::<PassThrough>::default();
        let h = Hashed {
            hash: 0xdead_beef,
            key: "k".to_owned(),
        };
        assert_eq!(b.hash_one(&h), 0xdead_beef);
        let probe: &dyn KeyProbe<String> = &h;
        assert_eq!(b.hash_one(probe), 0xdead_beef);
    }

    #[test]
    fn a_probe_finds_its_key_without_owning_one() {
        let mut map = Map::default();
        insert(&mut map, 1, "a", 10);
        insert(&mut map, 2, "b", 20);
        assert_eq!(get(&map, 1, "a"), Some(10));
        assert_eq!(get(&map, 2, "b"), Some(20));
        assert_eq!(get(&map, 3, "c"), None);
        let key = "a".to_owned();
        assert_eq!(
            map.remove(&(1u64, &key) as &dyn KeyProbe<String>),
            Some(10),
            "retirement removes by probe"
        );
        assert_eq!(get(&map, 1, "a"), None);
    }

    #[test]
    fn keys_that_share_a_hash_stay_apart() {
        let mut map = Map::default();
        insert(&mut map, 7, "x", 1);
        insert(&mut map, 7, "y", 2);
        assert_eq!(map.len(), 2);
        assert_eq!(get(&map, 7, "x"), Some(1));
        assert_eq!(get(&map, 7, "y"), Some(2));
        // The same key under another hash is another entry: the hash is
        // part of the identity (a key always comes with its own hash).
        assert_eq!(get(&map, 8, "x"), None);
    }

    /// Drains one mailbox at a time from `live` live ones and `spares`
    /// spares; returns how many were freed before `live` fell to `until`.
    fn drain(mut spares: usize, mut live: usize, until: usize) -> (usize, usize) {
        use super::{trim, Trim, SPARES};
        let mut freed = 0;
        while live > until {
            live -= 1;
            match trim(spares, live) {
                Trim::Keep => spares += 1,
                Trim::Free { more } => {
                    spares -= more;
                    freed += 1 + more;
                }
                Trim::FreeAllButSpares => {
                    freed += 1 + spares - SPARES;
                    spares = SPARES;
                }
            }
        }
        (spares, freed)
    }

    #[test]
    fn a_swing_of_suspended_keys_keeps_its_mailboxes() {
        // 10,000 live mailboxes fall to 2,000 and rise again: every drained
        // one stays a spare for the rise.
        let (spares, freed) = drain(0, 10_000, 2_000);
        assert_eq!((spares, freed), (8_000, 0));
    }

    #[test]
    fn spares_follow_the_live_mailboxes_down() {
        use super::{SPARES, SPARES_PER_LIVE};
        // From 10,000 live to 100: the spares end at their cap, at most
        // `SPARES_PER_LIVE` a live mailbox beyond `SPARES`.
        let (spares, freed) = drain(0, 10_000, 100);
        assert_eq!(spares, SPARES + SPARES_PER_LIVE * 100);
        assert_eq!(spares + freed, 9_900, "every drained mailbox is counted");
        // Spares far over their cap go `SPARES_PER_LIVE` more a drain.
        let (spares, _) = drain(50_000, 1_000, 990);
        assert_eq!(spares, 50_000 - 10 * SPARES_PER_LIVE);
        // The last live mailbox's drain keeps `SPARES`.
        let (spares, freed) = drain(3_000, 1, 0);
        assert_eq!((spares, freed), (SPARES, 3_000 - SPARES + 1));
    }
}
