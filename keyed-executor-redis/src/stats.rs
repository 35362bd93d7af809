//! What a consumer counts, and what it tells as it happens.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// A node's counters, kept by its loops (one atomic add each).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) read: AtomicU64,
    pub(crate) redelivered: AtomicU64,
    pub(crate) applied: AtomicU64,
    pub(crate) acked: AtomicU64,
    pub(crate) dead_lettered: AtomicU64,
    pub(crate) handed_back: AtomicU64,
    pub(crate) hand_offs_in: AtomicU64,
    pub(crate) hand_offs_out: AtomicU64,
    pub(crate) takeovers: AtomicU64,
    pub(crate) fenced: AtomicU64,
    pub(crate) retries: AtomicU64,
    /// Per owned partition: what its loop last saw.
    pub(crate) partitions: Mutex<BTreeMap<usize, PartitionStats>>,
}

pub(crate) fn bump(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

impl Counters {
    pub(crate) fn snapshot(&self) -> Stats {
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Stats {
            read: get(&self.read),
            redelivered: get(&self.redelivered),
            applied: get(&self.applied),
            acked: get(&self.acked),
            dead_lettered: get(&self.dead_lettered),
            handed_back: get(&self.handed_back),
            hand_offs_in: get(&self.hand_offs_in),
            hand_offs_out: get(&self.hand_offs_out),
            takeovers: get(&self.takeovers),
            fenced: get(&self.fenced),
            retries: get(&self.retries),
            partitions: self
                .partitions
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
        }
    }

    pub(crate) fn partition(&self, p: usize, f: impl FnOnce(&mut PartitionStats)) {
        let mut map = self.partitions.lock().unwrap_or_else(|p| p.into_inner());
        f(map.entry(p).or_default());
    }

    pub(crate) fn forget_partition(&self, p: usize) {
        self.partitions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&p);
    }
}

/// A node's counters at one moment ([`Consumer::stats`](crate::Consumer::stats)),
/// counted since it started. Redis keeps the group's own view (`XINFO
/// GROUPS`, `XPENDING`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Entries read as new (`XREADGROUP … >`).
    pub read: u64,
    /// Entries taken over from the pending list (`XAUTOCLAIM`): delivered
    /// before, to this node or another, and not acked.
    pub redelivered: u64,
    /// Messages the handler finished and the verdict acked.
    pub applied: u64,
    /// Entries acked (`XACK`), dead letters not included.
    pub acked: u64,
    /// Entries this node wrote to the dead-letter stream (and acked with
    /// it): did not decode, given up on by a retrying handler, expired, or
    /// [`Verdict::DeadLetter`](crate::Verdict::DeadLetter). A write whose
    /// reply was lost is not counted (its retry finds it done).
    pub dead_lettered: u64,
    /// Messages a stop handed back or cancelled: not acked, they stay
    /// pending for the partition's next owner.
    pub handed_back: u64,
    /// Partitions this node took over from an owner's graceful release.
    pub hand_offs_in: u64,
    /// Partitions this node released gracefully to another.
    pub hand_offs_out: u64,
    /// Partitions this node took whose lease was vacant (its owner died,
    /// or nobody held it yet).
    pub takeovers: u64,
    /// Partitions this node stopped at once because its lease was lost or
    /// not renewed in time.
    pub fenced: u64,
    /// Redis calls of the consumer's loops retried after a connection
    /// error or a timeout.
    pub retries: u64,
    /// The partitions this node owns, by number.
    pub partitions: BTreeMap<usize, PartitionStats>,
}

/// One owned partition, as its loop last saw it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct PartitionStats {
    /// Its stream.
    pub stream: String,
    /// Where it stands.
    pub state: PartitionState,
    /// Entries in the stream not yet delivered to the group (`XINFO
    /// GROUPS`' `lag`, Redis ≥ 7.0), read about once a second; `None`
    /// before the first reading, or when Redis cannot tell.
    pub lag: Option<u64>,
    /// Messages of this partition submitted and not finished.
    pub in_flight: usize,
}

/// Where an owned partition stands.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum PartitionState {
    /// Taking over: waiting for a dead owner's pending entries to idle, or
    /// claiming them.
    #[default]
    Claiming,
    /// Reading new entries.
    Reading,
    /// Stopping: handing off, or fenced.
    Stopping,
    /// Stopped on a [`Verdict::Halt`](crate::Verdict::Halt) or a handler
    /// panic: owned, its entries pending, nothing read until the node
    /// restarts (see [`Event::Halted`]).
    Halted,
}

/// How a node came to own a partition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Takeover {
    /// Its owner released it gracefully: what it left pending is claimed
    /// at once.
    HandedOff,
    /// Its lease was absent (its owner died, or nobody held it yet): what
    /// is pending is claimed once all of it has been idle for the claim
    /// idle time.
    Vacant,
}

/// What a node tells about itself as it happens (see
/// [`ConsumerBuilder::on_event`](crate::ConsumerBuilder::on_event)).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Event {
    /// Its first heartbeat went through: it is a member.
    Joined {
        /// The live members then, this node included.
        members: Vec<String>,
    },
    /// It took `partition`'s lease: it owns it from now on, and starts by
    /// claiming what is pending there.
    Acquired {
        /// The partition.
        partition: usize,
        /// From a release, or a vacant lease.
        how: Takeover,
    },
    /// It owns `partition`, claimed what was pending there, and reads new
    /// entries from now on.
    Started {
        /// The partition.
        partition: usize,
        /// From a release, or a vacant lease.
        how: Takeover,
        /// How long it waited for the pending entries to idle.
        waited: Duration,
        /// Entries it claimed from the pending list.
        claimed: u64,
    },
    /// It let go of `partition` (a hand-off): drained or stopped its
    /// messages and acked what finished; its lease is released right after.
    Released {
        /// The partition.
        partition: usize,
        /// Every message finished within the hand-off deadline (else the
        /// rest was force-stopped, handed back and left pending).
        drained: bool,
        /// Messages handed back (left pending for the next owner).
        handed_back: u64,
        /// How long the release took.
        took: Duration,
    },
    /// It stopped `partition` at once, without acking or releasing: its
    /// lease was lost, or could not be renewed for two-thirds of its
    /// length. Whoever takes the partition next redelivers what was
    /// pending.
    Fenced {
        /// The partition.
        partition: usize,
        /// Why.
        why: String,
    },
    /// `partition` stopped on a [`Verdict::Halt`](crate::Verdict::Halt) or
    /// a handler panic. The entry stays pending and the partition stays
    /// owned, nothing more is read from it, so no later record of that
    /// key overtakes it. Restarting the node takes it up again.
    Halted {
        /// The partition.
        partition: usize,
        /// Why.
        why: String,
    },
    /// A Redis call failed and is being retried.
    Trouble {
        /// What failed.
        what: String,
    },
    /// It released everything and left the group.
    Left,
}

impl fmt::Display for Event {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Event::Joined { members } => write!(f, "joined; members {members:?}"),
            Event::Acquired { partition, how } => write!(
                f,
                "partition {partition}: lease taken ({})",
                match how {
                    Takeover::HandedOff => "released by its owner",
                    Takeover::Vacant => "vacant",
                }
            ),
            Event::Started {
                partition,
                how: Takeover::HandedOff,
                claimed,
                ..
            } => write!(
                f,
                "partition {partition}: taken over from its owner's release; claimed {claimed} \
                 pending, reading"
            ),
            Event::Started {
                partition,
                how: Takeover::Vacant,
                waited,
                claimed,
            } => write!(
                f,
                "partition {partition}: lease vacant; waited {waited:.1?} for its pending entries \
                 to idle, claimed {claimed}, reading"
            ),
            Event::Released {
                partition,
                drained,
                handed_back,
                took,
            } => write!(
                f,
                "partition {partition}: released in {took:.1?} ({}, {handed_back} handed back)",
                if *drained {
                    "drained"
                } else {
                    "hand-off deadline passed: force-stopped"
                }
            ),
            Event::Fenced { partition, why } => write!(f, "partition {partition}: fenced ({why})"),
            Event::Halted { partition, why } => write!(f, "partition {partition}: HALTED: {why}"),
            Event::Trouble { what } => write!(f, "retrying: {what}"),
            Event::Left => f.write_str("left the group"),
        }
    }
}
