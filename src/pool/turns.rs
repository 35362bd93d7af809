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
//! Two open-addressing tables, one per parity of the worker's task number:
//! a record made in task `t` goes to table `t & 1`, emptied (by a
//! generation bump) when task `t` first writes to it; so table `t & 1`
//! holds task `t`'s keys and the other one task `t - 1`'s, if that task
//! wrote any. A record is keyed by the key's hash and its port (a worker
//! serves the ports of many dispatchers). A port's turn records every key
//! it runs lent and takes as many deliveries as its inbox held, so
//! a table grows (doubling) to stay at most a quarter full — lookups stay
//! exact and short — and goes back to [`RECORDS`] records after a task
//! that recorded few keys: at once if it had grown past [`KEEP_MAX`]
//! records (a burst of many keys; memory follows the live keys: such a
//! table also goes when its worker runs out of work, [`Turns::trim`]), else
//! once [`SHRINK_AFTER`] such tasks came in a row (under a steady load
//! tasks of many keys and of few alternate, and a table that shrank after
//! each would grow again in the next).
//!
//! The tables belong to the worker's thread (`WorkerCx`), not to a port:
//! one pair per worker, whatever the number of dispatchers.

/// Records of an empty table (a power of two): 64 keys a task before it
/// grows.
const RECORDS: usize = 256;

const _: () = assert!(RECORDS.is_power_of_two());

/// Emptyings in a row, after tasks that recorded few keys, before a grown
/// table goes back to [`RECORDS`] records.
const SHRINK_AFTER: u32 = 64;

/// The largest table kept through tasks of few keys (96 KiB of records);
/// a larger one goes back to [`RECORDS`] after the first such task.
const KEEP_MAX: usize = 4096;

/// See the module docs.
pub(crate) struct Turns {
    tables: [Table; 2],
}

struct Table {
    /// The task whose keys it holds.
    tick: u32,
    /// Entries of another generation are empty.
    generation: u32,
    /// Entries of this generation.
    len: usize,
    /// Emptyings in a row, while grown, after a task that recorded few keys.
    small: u32,
    /// A power of two, at least `RECORDS`.
    records: Box<[Record]>,
}

#[derive(Clone, Copy, Default)]
struct Record {
    hash: u64,
    /// The port the key belongs to (its address).
    port: usize,
    spent: u32,
    generation: u32,
}

impl Table {
    fn new() -> Self {
        Table {
            tick: u32::MAX,
            generation: 1,
            len: 0,
            small: 0,
            records: vec![Record::default(); RECORDS].into_boxed_slice(),
        }
    }

    /// The record of (`port`, `hash`), or the empty one it would go in.
    #[inline]
    fn find(&self, port: usize, hash: u64) -> (usize, bool) {
        let mask = self.records.len() - 1;
        let mut at = (hash ^ port as u64) as usize & mask;
        loop {
            let s = &self.records[at];
            if s.generation != self.generation {
                return (at, false);
            }
            if s.hash == hash && s.port == port {
                return (at, true);
            }
            at = (at + 1) & mask;
        }
    }

    /// Empties the table: a new generation, and the small size again after
    /// tasks that recorded few keys (see the module docs).
    fn clear(&mut self) {
        if self.records.len() > RECORDS {
            self.small = if self.len <= RECORDS / 4 {
                self.small + 1
            } else {
                0
            };
            if self.small >= SHRINK_AFTER || (self.small > 0 && self.records.len() > KEEP_MAX) {
                *self = Table {
                    tick: self.tick,
                    ..Table::new()
                };
                return;
            }
        }
        self.len = 0;
        self.generation = self.generation.wrapping_add(1);
        if self.generation == 0 {
            // Wrapped: a record last written 2^32 generations ago would look
            // current. Clear them all, once in a long while.
            self.records.fill(Record::default());
            self.generation = 1;
        }
    }

    /// Doubles the table, keeping this generation's entries.
    #[cold]
    fn grow(&mut self) {
        let bigger = vec![Record::default(); self.records.len() * 2].into_boxed_slice();
        let old = std::mem::replace(&mut self.records, bigger);
        let generation = self.generation;
        // The new records are all of generation 0: empty unless it is 0,
        // which `clear` never leaves.
        debug_assert_ne!(generation, 0);
        for s in old.iter().filter(|s| s.generation == generation) {
            let (at, _) = self.find(s.port, s.hash);
            self.records[at] = *s;
        }
    }
}

impl Turns {
    pub(crate) fn new() -> Self {
        Turns {
            tables: [Table::new(), Table::new()],
        }
    }

    /// Forgets a table grown past [`KEEP_MAX`] records: its worker is out of
    /// work (about to park), so no key waits behind the turns it records,
    /// and memory follows the live keys.
    pub(crate) fn trim(&mut self) {
        for table in &mut self.tables {
            if table.records.len() > KEEP_MAX {
                *table = Table::new();
            }
        }
    }

    /// Messages the key with `hash` of `port` ran in its current turn
    /// (`tick` is the task running now).
    #[inline]
    pub(crate) fn spent(&self, port: usize, hash: u64, tick: u32) -> u32 {
        for t in [tick, tick.wrapping_sub(1)] {
            let table = &self.tables[(t & 1) as usize];
            if table.tick == t {
                if let (at, true) = table.find(port, hash) {
                    return table.records[at].spent;
                }
            }
        }
        0
    }

    /// The key with `hash` of `port` has run `spent` messages in its turn,
    /// which ended (or goes on) in task `tick`.
    #[inline]
    pub(crate) fn record(&mut self, port: usize, hash: u64, spent: u32, tick: u32) {
        let table = &mut self.tables[(tick & 1) as usize];
        if table.tick != tick {
            table.clear();
            table.tick = tick;
        }
        let (mut at, found) = table.find(port, hash);
        if !found {
            if (table.len + 1) * 4 > table.records.len() {
                table.grow();
                at = table.find(port, hash).0;
            }
            table.len += 1;
        }
        table.records[at] = Record {
            hash,
            port,
            spent,
            generation: table.generation,
        };
    }
}

// Not under Miri: this file has no `unsafe`, and its tests walk tables of
// thousands of entries, which Miri runs for minutes.
#[cfg(all(test, not(loom), not(miri)))]
mod tests {
    use super::*;

    /// Scrambled, distinct hashes (a turn's keys).
    fn hashes(n: u64) -> impl Iterator<Item = u64> {
        (1..=n).map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }

    #[test]
    fn a_task_records_any_number_of_keys_exactly_and_the_tables_shrink_back() {
        let mut turns = Turns::new();
        // One task (a turn of a long backlog) records 10,000 keys.
        for (i, h) in hashes(10_000).enumerate() {
            turns.record(1, h, (i % 4) as u32 + 1, 7);
        }
        assert!(turns.tables[1].records.len() >= 4 * 10_000);
        for (i, h) in hashes(10_000).enumerate() {
            assert_eq!(turns.spent(1, h, 7), (i % 4) as u32 + 1, "in its own task");
            assert_eq!(turns.spent(1, h, 8), (i % 4) as u32 + 1, "in the next task");
            assert_eq!(turns.spent(1, h, 9), 0, "two tasks later: a fresh turn");
        }
        assert_eq!(turns.spent(1, 12345, 7), 0, "a key not recorded");
        // Task 9 writes table 1 again: emptied, kept at its size. Task 11
        // empties it after task 9's few keys: grown past KEEP_MAX (a burst),
        // it is small again at once.
        turns.record(1, 1, 1, 9);
        assert_eq!(turns.spent(1, hashes(1).next().unwrap(), 9), 0);
        assert!(turns.tables[1].records.len() > KEEP_MAX, "emptied, kept");
        turns.record(1, 1, 1, 11);
        assert_eq!(turns.tables[1].records.len(), RECORDS, "a burst's table");
        // A table grown less far is kept through tasks of few keys, until
        // SHRINK_AFTER of them in a row.
        for h in hashes(KEEP_MAX as u64 / 8) {
            turns.record(1, h, 1, 13);
        }
        let grown = turns.tables[1].records.len();
        assert!(grown > RECORDS && grown <= KEEP_MAX, "{grown}");
        turns.record(1, 1, 1, 15);
        let mut tick = 15;
        for _ in 1..SHRINK_AFTER {
            tick += 2;
            turns.record(1, 1, 1, tick);
            assert!(turns.tables[1].records.len() > RECORDS, "kept while few");
        }
        tick += 2;
        turns.record(1, 1, 2, tick);
        assert_eq!(turns.tables[1].records.len(), RECORDS, "back to small");
        assert_eq!(turns.spent(1, 1, tick), 2);
        assert_eq!(turns.spent(1, 1, tick + 1), 2);
        assert_eq!(turns.spent(1, 1, tick + 2), 0);
    }

    #[test]
    fn trimming_forgets_only_a_burst_table() {
        let mut turns = Turns::new();
        for h in hashes(KEEP_MAX as u64) {
            turns.record(1, h, 1, 3);
        }
        turns.record(1, 7, 2, 4);
        assert!(turns.tables[1].records.len() > KEEP_MAX);
        turns.trim();
        assert_eq!(turns.tables[1].records.len(), RECORDS, "the burst's table");
        assert_eq!(turns.spent(1, hashes(1).next().unwrap(), 4), 0);
        assert_eq!(turns.spent(1, 7, 4), 2, "a small table is kept");
    }

    #[test]
    fn keys_of_different_ports_are_apart() {
        let mut turns = Turns::new();
        turns.record(0x1000, 42, 3, 5);
        turns.record(0x2000, 42, 1, 5);
        assert_eq!(turns.spent(0x1000, 42, 5), 3);
        assert_eq!(turns.spent(0x2000, 42, 5), 1);
        assert_eq!(turns.spent(0x3000, 42, 5), 0);
    }

    #[test]
    fn the_generation_wrapping_clears_every_record() {
        let mut turns = Turns::new();
        turns.record(1, 9, 4, 0);
        turns.tables[0].generation = u32::MAX;
        turns.tables[0].records[0].generation = u32::MAX;
        // Task 2 writes table 0 again: the generation wraps to 0, and the
        // table is cleared rather than letting generation-0 records look live.
        turns.record(1, 10, 1, 2);
        assert_eq!(turns.tables[0].generation, 1);
        assert_eq!(turns.spent(1, 9, 2), 0);
        assert_eq!(turns.spent(1, 10, 2), 1);
    }
}
