//! What a worker remembers of the turns of keys without a mailbox.
//!
//! A key with nothing queued runs its message at once in its port's loaner
//! (see `dispatcher/turn.rs`); that message counts against the `throughput` of
//! the key's turn, so a key whose messages keep arriving one at a time
//! cannot run more than a turn's worth in a row while others wait. Its turn
//! is the one it ran in this very task, or in the task just before it on
//! the same worker (it only ran dry because its next messages were still
//! in the inbox); otherwise a fresh one.
//!
//! # Counts that are never short
//!
//! A count is read and written on every message a port runs lent, so it
//! must cost a few instructions and a line of L1, whatever the number of
//! keys a turn runs. The counts live in a *sketch* per parity of the
//! worker's task number (a count-min sketch with conservative updates):
//! [`ROWS`] rows of [`WIDTH`] 8-bit counters, a key (its hash, mixed with
//! its port: a worker serves the ports of many dispatchers) picking one
//! counter per row. A key's count is the least of its counters; writing
//! count `n` raises each of its counters to at least `n`. Other keys may
//! only *raise* a counter, so a count read is never less than the key's
//! own — at worst a key is found spent a little early and gets a mailbox
//! (the fairness bound holds either way), never late. With a turn's few
//! hundred keys over 2 × 4,096 counters, a key's count is exact unless
//! another key shares both of its counters (about one key in 75 when the
//! two tasks ran 500 keys each: its count then reads one high).
//!
//! The sketch of task `t` is emptied when task `t` first writes to it
//! (it held task `t - 2`'s counts) by moving to a new generation: each
//! counter carries the generation that wrote it, and one of another
//! generation reads zero; every 255 generations the counters are zeroed.
//! A counter stops at 255, and a key read there counts as spent whatever
//! the `throughput` (a larger `throughput` then lets a key without a
//! mailbox run 255 messages lent, and the rest of its turn in a mailbox).
//! The sketches are a fixed 32 KiB a worker: a burst of keys grows
//! nothing.
//!
//! The sketches belong to the worker's thread (`WorkerCx`), not to a port:
//! one pair per worker, whatever the number of dispatchers.

/// Counters a row (a power of two).
const WIDTH: usize = 4096;

/// Rows: a key's count is the least of one counter in each.
const ROWS: usize = 2;

const _: () = assert!(WIDTH.is_power_of_two());

/// A counter's ceiling: a key read there is spent whatever the
/// `throughput` (`spent` says `u32::MAX`).
const SATURATED: u32 = u8::MAX as u32;

/// See the module docs.
pub(crate) struct Turns {
    sketches: [Sketch; 2],
}

struct Sketch {
    /// The task whose counts it holds.
    tick: u32,
    /// The generation of its counters (see [`Cell`]); never 0.
    generation: u8,
    counters: Box<[Cell; WIDTH * ROWS]>,
}

/// A counter: its count in the low byte, the generation that wrote it in
/// the high byte (a counter of another generation reads zero).
type Cell = u16;

/// Where a key's counters are, one per row (see [`Turns::seat`]).
#[derive(Clone, Copy)]
pub(crate) struct Seat([usize; ROWS]);

impl Sketch {
    fn new() -> Self {
        Sketch {
            tick: u32::MAX,
            generation: 1,
            counters: Box::new([0; WIDTH * ROWS]),
        }
    }

    #[inline]
    fn read(&self, cell: usize) -> u32 {
        let c = self.counters[cell % (WIDTH * ROWS)];
        if (c >> 8) as u8 == self.generation {
            u32::from(c as u8)
        } else {
            0
        }
    }

    #[inline]
    fn count(&self, seat: Seat) -> u32 {
        self.read(seat.0[0]).min(self.read(seat.0[1]))
    }

    /// Raises the key's counters to at least `n`.
    #[inline]
    fn raise(&mut self, seat: Seat, n: u32) {
        let n = n.min(SATURATED);
        let cell = (u16::from(self.generation) << 8) | n as u16;
        for &c in &seat.0 {
            if self.read(c) < n {
                self.counters[c % (WIDTH * ROWS)] = cell;
            }
        }
    }

    /// Empties it for task `tick`: a new generation (every counter of the
    /// old one reads zero), all counters zeroed when the generation wraps.
    fn begin(&mut self, tick: u32) {
        self.tick = tick;
        self.generation = self.generation.wrapping_add(1);
        if self.generation == 0 {
            self.counters.fill(0);
            self.generation = 1;
        }
    }
}

impl Turns {
    pub(crate) fn new() -> Self {
        Turns {
            sketches: [Sketch::new(), Sketch::new()],
        }
    }

    /// Where the counters of the key with `hash` of `port` are: a
    /// multiply-shift of (hash ^ port) per row, a different odd multiplier
    /// each.
    #[inline]
    pub(crate) fn seat(port: usize, hash: u64) -> Seat {
        const MUL: [u64; ROWS] = [0x9E37_79B9_7F4A_7C15, 0xC2B2_AE3D_27D4_EB4F];
        let h = hash ^ (port as u64).rotate_left(17);
        let bits = WIDTH.trailing_zeros();
        Seat([
            (h.wrapping_mul(MUL[0]) >> (64 - bits)) as usize,
            WIDTH + (h.wrapping_mul(MUL[1]) >> (64 - bits)) as usize,
        ])
    }

    /// Messages the key at `seat` ran in its current turn (`tick` is the
    /// task running now): never less than it ran, maybe more (see the
    /// module docs); `u32::MAX` at the counters' ceiling.
    #[inline]
    pub(crate) fn spent(&self, seat: Seat, tick: u32) -> u32 {
        // The larger of the two: a key that ran in this task carried its
        // count from the task before into this one, and another key's
        // counters may raise this task's reading but never lower it.
        let mut n = 0;
        for t in [tick, tick.wrapping_sub(1)] {
            let sketch = &self.sketches[(t & 1) as usize];
            if sketch.tick == t {
                n = n.max(sketch.count(seat));
            }
        }
        if n >= SATURATED {
            u32::MAX
        } else {
            n
        }
    }

    /// The key at `seat` has run `spent` messages in its turn, which ended
    /// (or goes on) in task `tick`.
    #[inline]
    pub(crate) fn record(&mut self, seat: Seat, spent: u32, tick: u32) {
        let sketch = &mut self.sketches[(tick & 1) as usize];
        if sketch.tick != tick {
            sketch.begin(tick);
        }
        sketch.raise(seat, spent);
    }
}

// Not under Miri: this file has no `unsafe`, and its tests walk sketches of
// thousands of counters, which Miri runs for minutes.
#[cfg(all(test, not(loom), not(miri)))]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn spent(t: &Turns, port: usize, hash: u64, tick: u32) -> u32 {
        t.spent(Turns::seat(port, hash), tick)
    }

    fn record(t: &mut Turns, port: usize, hash: u64, n: u32, tick: u32) {
        t.record(Turns::seat(port, hash), n, tick)
    }

    #[test]
    fn a_count_carries_into_the_next_task_only() {
        let mut turns = Turns::new();
        record(&mut turns, 1, 42, 3, 7);
        assert_eq!(spent(&turns, 1, 42, 7), 3, "in its own task");
        assert_eq!(spent(&turns, 1, 42, 8), 3, "in the next task");
        assert_eq!(spent(&turns, 1, 42, 9), 0, "two tasks later: a fresh turn");
        record(&mut turns, 1, 42, 4, 8);
        assert_eq!(spent(&turns, 1, 42, 9), 4, "carried on through task 8");
        assert_eq!(spent(&turns, 1, 43, 8), 0, "a key not recorded");
    }

    #[test]
    fn keys_of_different_ports_are_apart() {
        let mut turns = Turns::new();
        record(&mut turns, 0x1000, 42, 3, 5);
        record(&mut turns, 0x2000, 42, 1, 5);
        assert_eq!(spent(&turns, 0x1000, 42, 5), 3);
        assert_eq!(spent(&turns, 0x2000, 42, 5), 1);
        assert_eq!(spent(&turns, 0x3000, 42, 5), 0);
    }

    /// Against an exact model, with tasks of many keys and hot keys among
    /// them: a count is never short, and, in tasks of a turn's usual few
    /// hundred keys after another such task, nearly always exact (a task
    /// of 4,000 keys fills the counters, so in it and the task after it
    /// many counts read one or two high: those keys get a mailbox a
    /// message or two early).
    #[test]
    fn counts_are_never_short_and_nearly_always_exact() {
        let mut turns = Turns::new();
        let mut model: [HashMap<(usize, u64), u32>; 2] = Default::default();
        let (mut reads, mut exact) = (0u64, 0u64);
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for tick in 0..600u32 {
            let t = (tick & 1) as usize;
            model[t].clear();
            let keys = if tick % 10 == 0 { 4_000 } else { 500 };
            for i in 0..keys {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                // A few hot keys, and many cold ones.
                let hash = if i % 8 == 0 { x % 4 } else { x };
                let port = 0x1000 + (x % 3) as usize * 0x40;
                let truth = model[t]
                    .get(&(port, hash))
                    .or_else(|| model[1 - t].get(&(port, hash)))
                    .copied()
                    .unwrap_or(0);
                let read = spent(&turns, port, hash, tick);
                assert!(read >= truth.min(SATURATED), "short: {read} < {truth}");
                if tick % 10 > 1 && truth < SATURATED {
                    reads += 1;
                    exact += u64::from(read == truth);
                }
                model[t].insert((port, hash), truth + 1);
                record(&mut turns, port, hash, read.saturating_add(1), tick);
            }
        }
        // A key shares both counters with one of the other ~500 keys of a
        // sketch about one time in 75 (both rows ~1/8 full): one high.
        assert!(exact * 100 >= reads * 97, "{exact} of {reads} exact");
    }

    #[test]
    fn a_generation_that_wraps_zeroes_the_counters() {
        let mut turns = Turns::new();
        record(&mut turns, 1, 9, 4, 0);
        for tick in (2..600).step_by(2) {
            record(&mut turns, 1, 10, 1, tick);
            assert_eq!(spent(&turns, 1, 9, tick), 0, "task {tick}");
            assert_eq!(spent(&turns, 1, 10, tick), 1);
        }
    }

    #[test]
    fn a_count_at_the_ceiling_is_spent() {
        let mut turns = Turns::new();
        record(&mut turns, 1, 9, 1_000_000, 0);
        assert_eq!(spent(&turns, 1, 9, 0), u32::MAX);
        record(&mut turns, 1, 10, SATURATED - 1, 0);
        assert_eq!(spent(&turns, 1, 10, 0), SATURATED - 1);
    }
}
