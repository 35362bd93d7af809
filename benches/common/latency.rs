//! W9's latency recording: no lock and no allocation on the hot path.
//!
//! Every slot is preallocated with the schedule. A handler writes the time
//! its message *started* into the message's own slot, found through a
//! per-key table built with the schedule (`base[key] + seq`: a key's slots
//! are contiguous, so two workers rarely write one cache line), and the time
//! a key's last message finished into the key's slot. The scheduled send
//! times are a function of the message's index, so the latencies (start −
//! scheduled send) and the percentiles are computed after the run.

use super::work::{Msg, Schedule};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Instant;

/// Start and end times of one run, in ns since the recorder's epoch.
pub struct Recorder {
    epoch: Instant,
    /// Per key: its first slot in `starts`.
    base: Box<[u32]>,
    /// Per message, by `base[key] + seq`: when its handler started.
    starts: Box<[AtomicU64]>,
    /// Per key: when its last message finished.
    ends: Box<[AtomicU64]>,
}

impl Recorder {
    /// Slots for every message of `sched`.
    pub fn new(sched: &Schedule) -> Self {
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
        Recorder {
            epoch: Instant::now(),
            base,
            // Not zero, so the pages are touched here, not during the run
            // (a slot left at MAX means its message never started).
            starts: (0..sched.msgs.len())
                .map(|_| AtomicU64::new(u64::MAX))
                .collect(),
            ends: (0..sched.keys).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    /// Now, in ns since the epoch.
    #[inline]
    pub fn now(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// A handler starts `msg` of `key`.
    #[inline]
    pub fn started(&self, key: u64, msg: Msg) {
        let slot = self.base[key as usize] as usize + msg.seq as usize;
        self.starts[slot].store(self.now(), Relaxed);
    }

    /// `key`'s last message finishes (called before the checker hears of it,
    /// so the harness reads it after its wait).
    #[inline]
    pub fn ended(&self, key: u64) {
        self.ends[key as usize].store(self.now(), Relaxed);
    }

    /// After the run: when `seq` of `key` started.
    pub fn start_of(&self, key: u64, seq: u32) -> u64 {
        self.starts[self.base[key as usize] as usize + seq as usize].load(Relaxed)
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
