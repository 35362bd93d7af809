//! The commit point of a receiver that tracks commits: how many leading
//! positions have all finished.
//!
//! Messages end in any order (keys run in parallel); a consumer may only
//! commit a prefix of what it accepted. Whoever ends a message records its
//! position here, finished (done or panicked: the commit point may pass
//! it) or returned (handed back by a stop, or cancelled: it will be
//! delivered again, so the commit point stops before it, for good).
//!
//! # Representation
//!
//! Under one lock: the commit point (`base`), and a bitset of the
//! positions at or past it that finished, as a queue of 64-bit words. The
//! first word covers the 64 positions from `base` rounded down to a
//! multiple of 64; the bits below `base` in it are set. A record sets its
//! bit, then the commit point passes the set bits at its front, dropping
//! each word it passes. So the memory follows the span of positions that
//! finished ahead of a message still running — none when the receiver is
//! idle — and a position costs one bit while it waits.
//!
//! Returned positions are few (only stops make them): a sorted list. Once
//! the commit point reaches one, it stops for good and nothing more is
//! kept.
//!
//! The published commit point (`committed`) is written under the lock and
//! read without it: submitters check the commit span on every message.

use std::collections::VecDeque;

use crate::sync::atomic::{AtomicU64, Ordering::*};
use crate::sync::Mutex;

/// What ended a message, for the commit point.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Ended {
    /// Done or panicked: the commit point may pass it.
    Finished,
    /// Handed back or cancelled: it will be delivered again; the commit
    /// point stops before it.
    Returned,
}

/// A receiver's commit point (see the module docs).
pub(crate) struct Commits {
    /// The commit point as last published (see [`CommitState::base`]).
    committed: AtomicU64,
    state: Mutex<CommitState>,
}

struct CommitState {
    /// Every position below it finished.
    base: u64,
    /// Finished positions from `base & !63` on, a bit each.
    ended: VecDeque<u64>,
    /// Returned positions at or past `base`, in order.
    returned: Vec<u64>,
    /// The commit point reached a returned position: it never moves again.
    stopped: bool,
}

/// Words a bitset keeps when it empties; more are given back.
const KEEP_WORDS: usize = 4;

impl Commits {
    pub(crate) fn new() -> Self {
        Commits {
            committed: AtomicU64::new(0),
            state: Mutex::new(CommitState {
                base: 0,
                ended: VecDeque::new(),
                returned: Vec::new(),
                stopped: false,
            }),
        }
    }

    /// The commit point: leading positions that all finished.
    #[inline]
    pub(crate) fn committed(&self) -> u64 {
        self.committed.load(Acquire)
    }

    /// Records how the message at `position` ended.
    pub(crate) fn record(&self, position: u64, ended: Ended) {
        let mut st = self.state.lock();
        if st.stopped || position < st.base {
            return;
        }
        match ended {
            Ended::Returned => {
                if position == st.base {
                    st.stop();
                } else if let Err(at) = st.returned.binary_search(&position) {
                    st.returned.insert(at, position);
                }
            }
            Ended::Finished => {
                st.set(position);
                if position == st.base {
                    st.advance();
                    self.committed.store(st.base, Release);
                }
            }
        }
    }
}

impl CommitState {
    /// The commit point stops for good: nothing more is kept.
    fn stop(&mut self) {
        self.stopped = true;
        self.ended = VecDeque::new();
        self.returned = Vec::new();
    }

    /// The first word's first position.
    fn word_base(&self) -> u64 {
        self.base & !63
    }

    fn set(&mut self, position: u64) {
        if self.ended.is_empty() {
            // The bits below `base` in the first word count as set.
            let below = self.base & 63;
            self.ended
                .push_back(if below == 0 { 0 } else { (1u64 << below) - 1 });
        }
        let at = position - self.word_base();
        let word = (at / 64) as usize;
        while self.ended.len() <= word {
            self.ended.push_back(0);
        }
        self.ended[word] |= 1 << (at % 64);
    }

    /// Passes the finished positions at the front, up to the first one
    /// still running or returned.
    fn advance(&mut self) {
        while let Some(&first) = self.ended.front() {
            if first == u64::MAX {
                self.ended.pop_front();
                self.base = self.word_base() + 64;
                continue;
            }
            self.base = self.word_base() + u64::from(first.trailing_ones());
            break;
        }
        if self.ended.len() <= 1 && self.ended.capacity() > KEEP_WORDS {
            self.ended.shrink_to(KEEP_WORDS);
        }
        // Stop at a returned position the commit point reached.
        let passed = self.returned.partition_point(|&r| r < self.base);
        self.returned.drain(..passed);
        if self.returned.first() == Some(&self.base) {
            self.stop();
        }
    }
}

// Not under Miri: this file has no `unsafe`, and its tests walk tables of
// thousands of entries, which Miri runs for minutes.
#[cfg(all(test, not(loom), not(miri)))]
mod tests {
    use super::*;

    fn shuffled(n: u64, mut rng: u64) -> Vec<u64> {
        let mut v: Vec<u64> = (0..n).collect();
        for i in (1..v.len()).rev() {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            v.swap(i, (rng % (i as u64 + 1)) as usize);
        }
        v
    }

    #[test]
    fn the_commit_point_passes_finished_positions_in_order() {
        let c = Commits::new();
        c.record(2, Ended::Finished);
        c.record(1, Ended::Finished);
        assert_eq!(c.committed(), 0, "position 0 is still running");
        c.record(0, Ended::Finished);
        assert_eq!(c.committed(), 3);
        c.record(3, Ended::Finished);
        assert_eq!(c.committed(), 4);
    }

    #[test]
    fn it_stops_for_good_at_a_returned_position() {
        let c = Commits::new();
        for p in [0, 1, 2] {
            c.record(p, Ended::Finished);
        }
        c.record(4, Ended::Finished);
        c.record(3, Ended::Returned);
        c.record(5, Ended::Finished);
        assert_eq!(c.committed(), 3, "never past a handed-back message");
        // A returned position ahead of the point stops it when it gets there.
        let c = Commits::new();
        c.record(2, Ended::Returned);
        c.record(1, Ended::Finished);
        c.record(3, Ended::Finished);
        c.record(0, Ended::Finished);
        assert_eq!(c.committed(), 2);
        c.record(4, Ended::Finished);
        assert_eq!(c.committed(), 2);
        assert!(c.state.lock().stopped);
    }

    #[test]
    fn any_order_over_many_words_and_nothing_kept_behind_the_point() {
        for seed in 1..20u64 {
            let c = Commits::new();
            let n = 10_000;
            let mut done = vec![false; n as usize];
            let mut leading = 0u64;
            for p in shuffled(n, seed.wrapping_mul(0x9E37_79B9_7F4A_7C15)) {
                c.record(p, Ended::Finished);
                done[p as usize] = true;
                while leading < n && done[leading as usize] {
                    leading += 1;
                }
                assert_eq!(c.committed(), leading, "seed {seed}, after {p}");
            }
            assert_eq!(c.committed(), n);
            assert!(c.state.lock().ended.len() <= 1, "the bitset emptied");
        }
    }

    #[test]
    fn memory_follows_the_span_ahead_of_a_held_point() {
        let c = Commits::new();
        for p in 1..65_537u64 {
            c.record(p, Ended::Finished);
        }
        assert_eq!(c.committed(), 0);
        // 65,536 positions ahead of the point: one bit each.
        assert_eq!(c.state.lock().ended.len(), 1025);
        c.record(0, Ended::Finished);
        assert_eq!(c.committed(), 65_537);
        let st = c.state.lock();
        assert!(st.ended.len() <= 1 && st.ended.capacity() <= 2 * KEEP_WORDS);
    }

    #[test]
    fn records_behind_the_point_or_after_a_stop_are_ignored() {
        let c = Commits::new();
        c.record(0, Ended::Finished);
        c.record(0, Ended::Finished);
        assert_eq!(c.committed(), 1);
        c.record(1, Ended::Returned);
        c.record(2, Ended::Finished);
        c.record(1, Ended::Finished);
        assert_eq!(c.committed(), 1);
    }
}
