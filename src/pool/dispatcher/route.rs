//! Routing a key to its port, and a port to the worker that runs it.
//!
//! A submitter hashes the key (the dispatcher's hasher) and takes the key's
//! *port* from the hash's high bits: a fixed function of the hash (a
//! multiply-shift of bits 32–63 onto the port count), the same for every
//! submitter and for the dispatcher's life, read from no table. Ports are
//! as many as workers, so keys spread over them as evenly as their hashes
//! do, from the first message on — no racy look at which worker runs.
//!
//! Where a port's turn runs is its *home*: a worker index in the port,
//! initially the port's own index. The home moves: a port's turn runs on
//! whichever worker takes its task (the home, a worker that stole the task,
//! or the worker whose handler queued it, see `submit.rs`), and that worker
//! becomes its home. A submitter that finds the port idle queues its task
//! on the home. Per-key order does not depend on the home: a port runs one
//! turn at a time, wherever (its state word, `port.rs`).

use crossbeam_utils::CachePadded;

use crate::pool::handler::Handler;
use crate::pool::{PoolHasher, PoolKey};

use super::port::Port;
use super::DispatcherInner;

impl<K, M, H, S> DispatcherInner<K, M, H, S>
where
    K: PoolKey,
    M: Send + 'static,
    H: Handler<K, M>,
    S: PoolHasher,
{
    /// The port of a hash: bits 32–63 scaled onto the port count (the key
    /// map uses the low bits).
    #[inline]
    pub(super) fn port_of(&self, hash: u64) -> usize {
        port_of(hash, self.ports.ptrs.len())
    }

    /// Port `p`, made now if this is its first delivery. A port made after
    /// a force stop began is closed at once (the stop's walk may have
    /// passed its pointer; see `force_drain`).
    #[inline(always)]
    pub(super) fn port(&self, p: usize) -> &Port<K, M, H, S> {
        match self.ports.get(p) {
            Some(port) => port,
            None => self.make_port(p),
        }
    }

    /// [`port`](Self::port) on its first delivery: out of line, once a
    /// port.
    #[cold]
    #[inline(never)]
    fn make_port(&self, p: usize) -> &Port<K, M, H, S> {
        let workers = self.shared.workers.len();
        let port = self
            .ports
            .get_or_make(p, || CachePadded::new(Port::new(p % workers)));
        if self.shared.is_forced() {
            let _gate = port.gate.lock();
            port.state.close();
        }
        port
    }
}

/// How many ports a dispatcher has on `workers` workers.
pub(super) fn port_count(workers: usize) -> usize {
    workers
}

/// The port (of `ports`) of a key's hash: a multiply-shift of its bits
/// 32–63, so that every port gets an equal share of the hash space.
#[inline]
pub(super) fn port_of(hash: u64, ports: usize) -> usize {
    (((hash >> 32) * ports as u64) >> 32) as usize
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::port_of;

    #[test]
    fn hashes_spread_evenly_over_the_ports() {
        for ports in [1usize, 2, 3, 7, 64] {
            let mut count = vec![0usize; ports];
            // Hashes whose high half walks the whole range.
            let n = 1usize << 16;
            for i in 0..n {
                let hash = ((i as u64) << 48) | 0xdead_beef;
                let p = port_of(hash, ports);
                assert!(p < ports);
                count[p] += 1;
            }
            let (lo, hi) = (count.iter().min().unwrap(), count.iter().max().unwrap());
            assert!(hi - lo <= 1 + n / ports / 1000, "{ports} ports: {count:?}");
        }
    }

    #[test]
    fn a_port_depends_only_on_the_high_half() {
        assert_eq!(port_of(0x8000_0000_0000_0000, 2), 1);
        assert_eq!(port_of(0x7fff_ffff_ffff_ffff, 2), 0);
        assert_eq!(
            port_of(0x7fff_ffff_0000_0000, 2),
            port_of(0x7fff_ffff_ffff_ffff, 2)
        );
    }
}
