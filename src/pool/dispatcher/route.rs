//! Routing a key to its worker: the route table.
//!
//! A submitter hashes the key (the dispatcher's hasher) and picks the key's
//! *bucket* from the hash's high bits: one of `routes.len()` (≥ 1,024)
//! words that map buckets to workers. A submitter *reads* its bucket's
//! word (acquire); a bucket nobody has placed yet is placed by the first
//! submitter, with one CAS (`pick_worker`: a running worker with nothing
//! queued, else a parked one, else the least loaded). The submitter then
//! pushes a delivery (key, hash, message) on that worker's port inbox and,
//! if the port is idle, schedules it. The route table is small (two bytes
//! a bucket) and written once per bucket, so it stays shared in every
//! submitter's cache: a submit touches no per-key state and writes no line
//! another submitter reads.
//!
//! A bucket keeps the port it was placed on for the dispatcher's life.

use crossbeam_utils::CachePadded;

use crate::pool::handler::Handler;
use crate::pool::{PoolHasher, PoolKey};
use crate::sync::atomic::Ordering::*;

use super::port::Port;
use super::DispatcherInner;

// ----- the route table -------------------------------------------------------

/// A bucket's word: its worker's index, `UNPLACED` until the first
/// submitter places it. UNPLACED → placed is its only transition (one CAS,
/// by any submitter); nothing writes it after. Two bytes a bucket: the
/// table is paid by every dispatcher, idle or not.
pub(super) const UNPLACED: u16 = u16::MAX;

/// Buckets per dispatcher: enough that two keys rarely share one, and
/// that placement spreads keys over the workers.
pub(super) fn bucket_count(workers: usize) -> usize {
    #[cfg(not(loom))]
    return (64 * workers).next_power_of_two().clamp(1024, 16384);
    // Under loom two buckets: keys 0 and 1 may share one or not.
    #[cfg(loom)]
    {
        let _ = workers;
        2
    }
}

impl<K, M, H, S> DispatcherInner<K, M, H, S>
where
    K: PoolKey,
    M: Send + 'static,
    H: Handler<K, M>,
    S: PoolHasher,
{
    /// The bucket of a hash: its high bits (the map uses the low ones).
    #[inline]
    pub(super) fn bucket_of(&self, hash: u64) -> usize {
        (hash >> 40) as usize & (self.routes.len() - 1)
    }

    /// The worker of bucket `b`.
    #[inline]
    pub(super) fn route(&self, b: usize) -> usize {
        match self.routes[b].load(Acquire) {
            UNPLACED => self.place(b),
            w => usize::from(w),
        }
    }

    /// Places bucket `b`, unplaced when we looked, unless another
    /// submitter did meanwhile: the CAS decides, and both use its winner.
    #[cold]
    pub(super) fn place(&self, b: usize) -> usize {
        let p = self.shared.pick_worker();
        match self.routes[b].compare_exchange(UNPLACED, p as u16, AcqRel, Acquire) {
            Ok(_) => p,
            Err(placed) => usize::from(placed),
        }
    }

    /// Port `p`, made now if this is its first delivery. A port made after
    /// a force stop began is closed at once (the stop's walk may have
    /// passed its pointer; see `force_drain`).
    #[inline]
    pub(super) fn port(&self, p: usize) -> &Port<K, M, H, S> {
        if let Some(port) = self.ports.get(p) {
            return port;
        }
        let port = self.ports.get_or_make(p, || CachePadded::new(Port::new(p)));
        if self.shared.is_forced() {
            let _gate = port.gate.lock();
            port.state.close();
        }
        port
    }
}
