//! Latency recording for W9 and the open-loop row (`--latency`): no lock
//! and no allocation on the hot path.
//!
//! Every slot is preallocated with the schedule ([`Stamps`]). In W9 a
//! handler writes the time its message *started* into the message's own
//! slot and the time a key's last message finished into the key's slot
//! ([`Recorder`]); in the open-loop row it writes the time its message's
//! work was *done*. The scheduled send times are a function of the
//! message's index, so the latencies (stamp − scheduled send) and the
//! percentiles are computed after the run.

use super::work::{Msg, Schedule};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

/// One time per message, in ns since a shared epoch, in a slot found from
/// the message's key and sequence number (`base[key] + seq`): a key's slots
/// are contiguous, so two workers rarely write one cache line.
pub struct Stamps {
    epoch: Instant,
    /// Per key: its first slot.
    base: Box<[u32]>,
    /// Per message, by `base[key] + seq`.
    slots: Box<[AtomicU64]>,
}

impl Stamps {
    /// A slot for every message of `sched`, times counted from `epoch`.
    pub fn new(sched: &Schedule, epoch: Instant) -> Self {
        let mut count = vec![0u32; sched.keys];
        for &(k, _) in &sched.msgs {
            count[k as usize] += 1;
        }
        let mut next = 0u32;
        let base = count
            .iter()
            .map(|&c| {
                let b = next;
                next += c;
                b
            })
            .collect();
        Stamps {
            epoch,
            base,
            // Not zero, so the pages are touched here, not during the run
            // (a slot left at MAX means its message never got there).
            slots: (0..sched.msgs.len())
                .map(|_| AtomicU64::new(u64::MAX))
                .collect(),
        }
    }

    /// Now, in ns since the epoch.
    #[inline]
    pub fn now(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Stamps `msg` of `key` with the time now.
    #[inline]
    pub fn stamp(&self, key: u64, msg: Msg) {
        let slot = self.base[key as usize] as usize + msg.seq as usize;
        self.slots[slot].store(self.now(), Relaxed);
    }

    /// After the run: the stamp of `seq` of `key`.
    pub fn get(&self, key: u64, seq: u32) -> u64 {
        self.slots[self.base[key as usize] as usize + seq as usize].load(Relaxed)
    }
}

/// W9's start and end times of one run, in ns since the recorder's epoch.
pub struct Recorder {
    /// Per message: when its handler started.
    starts: Stamps,
    /// Per key: when its last message finished.
    ends: Box<[AtomicU64]>,
}

impl Recorder {
    /// Slots for every message of `sched`.
    pub fn new(sched: &Schedule) -> Self {
        Recorder {
            starts: Stamps::new(sched, Instant::now()),
            ends: (0..sched.keys).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Now, in ns since the epoch.
    #[inline]
    pub fn now(&self) -> u64 {
        self.starts.now()
    }

    /// A handler starts `msg` of `key`.
    #[inline]
    pub fn started(&self, key: u64, msg: Msg) {
        self.starts.stamp(key, msg);
    }

    /// `key`'s last message finishes (called before the checker hears of it,
    /// so the harness reads it after its wait).
    #[inline]
    pub fn ended(&self, key: u64) {
        self.ends[key as usize].store(self.now(), Relaxed);
    }

    /// After the run: when `seq` of `key` started.
    pub fn start_of(&self, key: u64, seq: u32) -> u64 {
        self.starts.get(key, seq)
    }

    /// After the run: when `key`'s last message finished.
    pub fn end_of(&self, key: u64) -> u64 {
        self.ends[key as usize].load(Relaxed)
    }
}

/// The `p`-th percentile (0 < p ≤ 100) of sorted `v`, nearest rank.
pub fn percentile(sorted: &[u64], p: f64) -> u64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p / 100.0 * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// Sets this thread's timer slack (Linux) for as long as it lives, then
/// restores it: the paced producer sleeps between sends, and with the
/// default 50 µs slack its sleeps would overshoot by that much.
pub struct TimerSlack(#[allow(dead_code)] Option<libc::c_ulong>);

impl TimerSlack {
    /// Timer slack `ns` on the calling thread.
    pub fn set(ns: u64) -> Self {
        #[cfg(target_os = "linux")]
        {
            // SAFETY: prctl(PR_GET_TIMERSLACK) takes no argument and returns
            // the calling thread's slack; PR_SET_TIMERSLACK takes a plain
            // integer and changes only the calling thread's slack.
            unsafe {
                let old = libc::prctl(libc::PR_GET_TIMERSLACK);
                if old > 0 {
                    libc::prctl(libc::PR_SET_TIMERSLACK, ns as libc::c_ulong);
                    return TimerSlack(Some(old as libc::c_ulong));
                }
            }
        }
        let _ = ns;
        TimerSlack(None)
    }
}

impl Drop for TimerSlack {
    fn drop(&mut self) {
        #[cfg(target_os = "linux")]
        if let Some(old) = self.0 {
            // SAFETY: as in `set`.
            unsafe {
                libc::prctl(libc::PR_SET_TIMERSLACK, old);
            }
        }
    }
}
