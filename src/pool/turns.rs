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
//! keys a turn runs. The counts live in one table a worker (a count-min
//! sketch with conservative updates): [`ROWS`] rows of [`WIDTH`] counters,
//! a key (its hash, mixed with its port: a worker serves the ports of many
//! dispatchers) picking one counter per row. A counter holds a count and
//! the task that wrote it (its *stamp*); read in task `t`, a counter
//! stamped `t` or `t - 1` gives its count, any other reads zero. A key's
//! count is the least of its counters; writing count `n` in task `t` sets
//! each of its counters to the larger of `n` and what it read, stamped
//! `t`. Other keys may only *raise* a counter (or carry it, restamped, into
//! the next task), so a count read is never less than the key's own — at
//! worst a key is found spent a little early and gets a mailbox (the
//! fairness bound holds either way), never late. With a turn's few hundred
//! keys over 2 × 4,096 counters, a key's count is exact unless another key
//! shares both of its counters (about one key in 75 when the two tasks ran
//! 500 keys each: its count then reads one high).
//!
//! Nothing is emptied between tasks: the stamp does it. A stamp keeps the
//! low 24 bits of the task number, so a counter untouched for exactly a
//! multiple of 2²⁴ tasks reads as fresh again — a count too high, never
//! too low. A counter stops at 255, and a key read there counts as spent
//! whatever the `throughput` (a larger `throughput` then lets a key without
//! a mailbox run 255 messages lent, and the rest of its turn in a mailbox).
//! The table is a fixed 32 KiB a worker: a burst of keys grows nothing;
//! one read is two loads and two compares, one write two stores.
//!
//! The table belongs to the worker's thread (`WorkerCx`), not to a port:
//! one per worker, whatever the number of dispatchers.

/// Counters a row (a power of two).
const WIDTH: usize = 4096;

/// Rows: a key's count is the least of one counter in each.
const ROWS: usize = 2;

const _: () = assert!(WIDTH.is_power_of_two());

/// A counter's ceiling: a key read there is spent whatever the
/// `throughput` (`spent` says `u32::MAX`).
const SATURATED: u32 = u8::MAX as u32;

/// The bits of a task number a counter's stamp keeps.
const STAMP_MASK: u32 = (1 << 24) - 1;

/// See the module docs.
pub(crate) struct Turns {
    /// Row `r`'s counters at `r * WIDTH ..`; each is a [`Counter`].
    counters: Box<[Counter; WIDTH * ROWS]>,
}

/// A counter: its count in the low byte, the low 24 bits of the task
/// that wrote it (its stamp) above.
type Counter = u32;

/// Where a key's counters are, one per row (see [`Turns::seat`]).
#[derive(Clone, Copy)]
pub(crate) struct Seat([usize; ROWS]);

/// The count of `c` read in task `tick`: zero unless stamped `tick` or
/// `tick - 1`.
#[inline(always)]
fn read(c: Counter, tick: u32) -> u32 {
    // How many tasks ago it was written, modulo 2^24: 0 or 1 reads.
    let age = tick.wrapping_sub(c >> 8) & STAMP_MASK;
    if age <= 1 {
        c & 0xFF
    } else {
        0
    }
}

impl Turns {
    pub(crate) fn new() -> Self {
        Turns {
            // Stamp 0, count 0: reads zero in any task.
            counters: Box::new([0; WIDTH * ROWS]),
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
        let c = &self.counters;
        let n = read(c[seat.0[0] % (WIDTH * ROWS)], tick)
            .min(read(c[seat.0[1] % (WIDTH * ROWS)], tick));
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
        let n = spent.min(SATURATED);
        let stamp = (tick & STAMP_MASK) << 8;
        for &at in &seat.0 {
            let c = &mut self.counters[at % (WIDTH * ROWS)];
            // Restamped even when not raised: another key's count read in
            // this task must still read in the next.
            *c = stamp | read(*c, tick).max(n);
        }
    }
}

// Not under Miri: this file has no `unsafe`, and its tests walk tables of
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
    fn stamps_carry_across_the_task_numbers_wrap() {
        let mut turns = Turns::new();
        record(&mut turns, 1, 9, 4, u32::MAX);
        assert_eq!(spent(&turns, 1, 9, 0), 4, "task 0 follows task u32::MAX");
        assert_eq!(spent(&turns, 1, 9, 1), 0);
        // The stamp keeps 24 bits: the counter reads zero until tasks come
        // round to a number with the same low 24 bits.
        record(&mut turns, 1, 10, 2, 5);
        for tick in [7, 1 << 20, (1 << 24) + 2] {
            assert_eq!(spent(&turns, 1, 10, tick), 0, "task {tick}");
        }
        assert_eq!(
            spent(&turns, 1, 10, (1 << 24) + 5),
            2,
            "too high, never short"
        );
    }

    #[test]
    fn another_keys_count_carried_into_the_next_task_is_never_short() {
        // Two keys sharing both counters: the second's record in task 3
        // must carry the first's count on (restamped), or the first would
        // read short in task 4.
        let mut turns = Turns::new();
        let seat = Turns::seat(1, 42);
        turns.record(seat, 5, 2);
        turns.record(seat, 1, 3);
        assert_eq!(turns.spent(seat, 3), 5);
        assert_eq!(turns.spent(seat, 4), 5);
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
