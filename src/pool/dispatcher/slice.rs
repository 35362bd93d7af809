//! A slice of a port's backlog: an idle worker takes a part of the inbox
//! of a port whose turn runs on another worker (see *steal* in
//! `conserve/mod.rs`).
//!
//! A port runs one turn at a time, so the deliveries waiting in its inbox
//! would all wait for its runner, however many workers idle. An idle
//! worker takes a *slice* of them: under the port's gate (taken between two of the
//! runner's decisions, typically while the runner runs a message lent the
//! port's loaner), it pops up to half of what waits ([`SLICE_MAX`] at
//! most), from the head, in order, and does with each what the runner
//! would do with a delivery for a key whose turn is spent: into its key's
//! mailbox if the key has one, else into a new mailbox that joins the
//! port's map and is queued on the idle worker. From then on the runner's
//! later deliveries of those keys go into their mailboxes, behind, so
//! per-key order and one-at-a-time hold as they do for any mailbox; the
//! fairness bound holds as for any mailbox (a turn of at most
//! `throughput` messages, then the back of its worker's queue).
//!
//! Two keys need care, because they run without being in the map:
//!
//! - the key the runner runs lent right now (`Gate::lent`): a delivery of
//!   it (by hash: a different key with the same hash is simply treated the
//!   same) goes to the gate's `deferred` queue, which the runner takes
//!   before the inbox, so it runs after the lent message, in order;
//! - keys that already wait in `deferred`: a slice is taken only while
//!   `deferred` is empty, so the only keys there are those a slice put
//!   there itself, all with the lent key's hash.
//!
//! The runner's turn is untouched: its mark, its phase and its epoch stay;
//! it just finds fewer deliveries. A stopped source's delivery is handed
//! over, a closed mailbox's rejected, as in a turn.

use crate::pool::handler::Handler;
use crate::pool::inbox::Popped;
use crate::pool::worker::WorkerCx;
use crate::pool::{PoolHasher, PoolKey};
use crate::sync::Arc;

use super::keys::Sorted;
use super::DispatcherInner;

/// The most deliveries one slice takes.
pub(super) const SLICE_MAX: usize = 64;

/// The fewest deliveries a port's inbox must hold for an idle worker to
/// take a slice (of half of them).
pub(super) const SLICE_MIN: usize = 2;

impl<K, M, H, S> DispatcherInner<K, M, H, S>
where
    K: PoolKey,
    M: Send + 'static,
    H: Handler<K, M>,
    S: PoolHasher,
{
    /// Worker `cx`, out of work, takes a slice of the backlog of one of
    /// this dispatcher's ports whose turn runs on another worker (see the
    /// module docs). True if it took any delivery.
    pub(super) fn steal_slice(this: &Arc<Self>, cx: &WorkerCx<'_>) -> bool {
        if this.shared.is_forced() {
            return false;
        }
        for (p, port) in this.ports.iter() {
            if !port.state.is_running() || port.state.has_deferred() || port.state.is_closed() {
                continue;
            }
            let waiting = port.inbox.len();
            if waiting < SLICE_MIN {
                continue;
            }
            let mut gate = port.gate.lock();
            if gate.runner == cx.index
                || !port.state.is_running()
                || port.state.is_closed()
                || !gate.deferred.is_empty()
            {
                continue;
            }
            // SAFETY: a lent loaner is alive while `lent` is set, and its
            // hash is written before it is lent, under the gate we hold.
            let lent = gate.lent.map(|l| unsafe { l.0.as_ref().hash() });
            let mut settles = Vec::new();
            let mut took = 0;
            for _ in 0..(waiting / 2).clamp(1, SLICE_MAX) {
                // SAFETY: we hold the gate: the only consumer.
                let (delivery, stamp) = match unsafe { port.inbox.pop_before(usize::MAX) } {
                    Popped::Value(d, stamp) => (d, stamp),
                    Popped::Past | Popped::Unwritten => break,
                };
                took += 1;
                if lent == Some(delivery.hash) && !delivery.env.held.source.get().is_stopped() {
                    // Behind the message the runner runs lent: the runner
                    // takes `deferred` before the inbox.
                    gate.deferred.push_back((delivery, stamp));
                    port.state.set_deferred(true);
                    continue;
                }
                match Self::sort(&gate, delivery, stamp) {
                    Sorted::Delivered => {}
                    Sorted::Settle(settle) => settles.push(settle),
                    Sorted::Absent(absent) => {
                        settles.push(Self::new_mailbox(this, &mut gate, p, absent, cx));
                    }
                }
            }
            drop(gate);
            for settle in settles {
                Self::settle(this, settle, cx);
            }
            if took > 0 {
                return true;
            }
        }
        false
    }
}
