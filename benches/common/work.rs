//! What the handlers do: the calibrated CPU work, the message, and the
//! per-key sequence checker that fails the run on any reordering, overlap or
//! lost message.

use std::hint::black_box;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::*};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

/// A message: its key's sequence number, and whether it is the key's last.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Msg {
    /// 0, 1, 2, … per key, in the order the producer sent them.
    pub seq: u32,
    /// The key's last message of the run.
    pub last: bool,
}

/// The same busy loop for every design; `iters` comes from [`iters_for`].
/// Never inlined, so the calibration times the very code the handlers run.
#[inline(never)]
pub fn spin_work(iters: u64) -> u64 {
    let mut x = 0x2545_f491_4f6c_dd1d_u64;
    for _ in 0..iters {
        x = black_box(
            x.wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407),
        );
    }
    x
}

/// This thread's CPU time, in ns. The calibration times on it rather than
/// on the wall clock: on the shared machine a try is often preempted, and
/// the wall clock would count the time the thread did not run as work
/// (under a steady load of 2 on 2 cores, every try of 5), so the handlers
/// would get too few iterations and the overhead columns, which subtract
/// the work, would go below zero.
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; the calling thread's CPU
    // clock always exists on Linux.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    assert_eq!(rc, 0, "clock_gettime");
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Nanoseconds of CPU one call of `spin_work(iters)` takes when called back
/// to back, as a handler is (the best of several tries). Back-to-back calls
/// overlap in the out-of-order core, so this is measured rather than
/// derived from one long loop.
fn ns_per_call(iters: u64) -> f64 {
    // About 2M loop iterations per try.
    let calls = (2_000_000 / (iters + 4)).clamp(1_000, 100_000) as u32;
    let mut best = f64::MAX;
    for _ in 0..5 {
        let t = thread_cpu_ns();
        for _ in 0..calls {
            black_box(spin_work(black_box(iters)));
        }
        best = best.min((thread_cpu_ns() - t) as f64 / calls as f64);
    }
    best
}

/// From this length of work on (W9's 1 ms slow key), [`iters_for`]
/// extrapolates instead of bisecting: bisecting with 1,000 calls per try
/// would take minutes, and back-to-back overlap no longer matters.
const LONG_NS: u64 = 100_000;

/// The best of five single calls of `spin_work(iters)`, in ns of CPU (long
/// work).
fn ns_per_long_call(iters: u64) -> f64 {
    (0..5)
        .map(|_| {
            let t = thread_cpu_ns();
            black_box(spin_work(black_box(iters)));
            (thread_cpu_ns() - t) as f64
        })
        .fold(f64::MAX, f64::min)
}

/// `KEYED_BENCH_ITERS` (`50:23,1000:480`: ns of work, then iterations):
/// the iteration counts to use instead of calibrating. `--steady` sets it
/// for each invocation it starts, so that every invocation runs the same
/// handler; a count calibrated afresh in each process varies by ±10 % on
/// the shared machine, which would show as the designs' unsteadiness.
pub const ITERS_ENV: &str = "KEYED_BENCH_ITERS";

/// The iterations [`ITERS_ENV`] gives for `ns`, if any.
fn iters_from_env(ns: u64) -> Option<u64> {
    let v = std::env::var(ITERS_ENV).ok()?;
    v.split(',').find_map(|pair| {
        let (n, i) = pair.split_once(':')?;
        (n.trim().parse::<u64>().ok()? == ns)
            .then(|| i.trim().parse().ok())
            .flatten()
    })
}

/// Iterations of [`spin_work`] whose back-to-back calls take about `ns`
/// nanoseconds each (calibrated once per `ns`, unless [`ITERS_ENV`] gives
/// them). Work of [`LONG_NS`] or more is scaled from the 2 µs calibration
/// and corrected once by timing the long call itself.
pub fn iters_for(ns: u64) -> u64 {
    static CACHE: Mutex<Vec<(u64, u64)>> = Mutex::new(Vec::new());
    if ns == 0 {
        return 0;
    }
    if let Some(&(_, iters)) = CACHE.lock().unwrap().iter().find(|(n, _)| *n == ns) {
        return iters;
    }
    let iters = if let Some(iters) = iters_from_env(ns) {
        iters
    } else if ns >= LONG_NS {
        let guess = (iters_for(2_000) * (ns / 2_000)).max(1);
        ((guess as f64 * ns as f64 / ns_per_long_call(guess)).round() as u64).max(1)
    } else {
        // Grow until a call takes `ns`, then bisect down to the smallest count that does.
        let (mut lo, mut hi) = (0u64, 1u64);
        while ns_per_call(hi) < ns as f64 {
            lo = hi;
            hi *= 2;
        }
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if ns_per_call(mid) < ns as f64 {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        hi
    };
    CACHE.lock().unwrap().push((ns, iters));
    iters
}

/// Nanoseconds one call of the handler's work for `ns` takes, measured at
/// [`iters_for`]`(ns)` the way the calibration measures it (the best of
/// several tries of back-to-back calls), measured once per process: for
/// headers and limits. See [`work_ns_now`] for the overhead columns.
pub fn work_ns(ns: u64) -> f64 {
    static CACHE: Mutex<Vec<(u64, f64)>> = Mutex::new(Vec::new());
    if let Some(&(_, t)) = CACHE.lock().unwrap().iter().find(|(n, _)| *n == ns) {
        return t;
    }
    let t = work_ns_now(ns);
    CACHE.lock().unwrap().push((ns, t));
    t
}

/// As [`work_ns`], measured afresh (~10 ms for short work): the CPU-per-
/// message columns take it just before each run and subtract it, so a host
/// whose cores slow down during a table (they do, by 10 % and more, on the
/// shared machine) does not show as the designs' overhead.
pub fn work_ns_now(ns: u64) -> f64 {
    let iters = iters_for(ns);
    if ns >= LONG_NS {
        ns_per_long_call(iters)
    } else {
        ns_per_call(iters)
    }
}

/// One key's state on its own cache line, so two workers finishing
/// neighbouring keys do not share a line.
#[repr(align(64))]
struct Slot(AtomicU64);

/// Per-key sequence checks, shared by every design.
///
/// A slot holds `2 × (messages finished)`, plus one while a message runs.
/// [`begin`](Self::begin) expects exactly `2 × seq` (so a message that came
/// early, late, twice, or while the previous one of its key still runs is an
/// error) and [`end`](Self::end) sets `2 × seq + 2`. A key's last message
/// counts the key off; when every key is counted off, [`wait`](Self::wait)
/// returns. [`verify`](Self::verify) then recounts every slot.
pub struct Checker {
    slots: Box<[Slot]>,
    errors: AtomicU64,
    first_error: Mutex<Option<String>>,
    remaining: AtomicUsize,
    done: Mutex<bool>,
    done_cv: Condvar,
}

impl Checker {
    /// `keys` slots; `active_keys` of them will receive a last message.
    pub fn new(keys: usize, active_keys: usize) -> Self {
        Checker {
            slots: (0..keys).map(|_| Slot(AtomicU64::new(0))).collect(),
            errors: AtomicU64::new(0),
            first_error: Mutex::new(None),
            remaining: AtomicUsize::new(active_keys),
            done: Mutex::new(active_keys == 0),
            done_cv: Condvar::new(),
        }
    }

    /// Makes the checker as new, for `active_keys` keys (reused across runs
    /// when it is leaked for W3).
    pub fn reset(&self, active_keys: usize) {
        for slot in self.slots.iter() {
            slot.0.store(0, Relaxed);
        }
        self.errors.store(0, Relaxed);
        *self.first_error.lock().unwrap() = None;
        self.remaining.store(active_keys, Release);
        *self.done.lock().unwrap() = active_keys == 0;
    }

    /// Slots (keys) this checker holds.
    pub fn keys(&self) -> usize {
        self.slots.len()
    }

    /// A message starts.
    #[inline]
    pub fn begin(&self, key: u64, msg: Msg) {
        let slot = &self.slots[key as usize].0;
        let seen = slot.load(Relaxed);
        if seen != 2 * msg.seq as u64 {
            self.fail(key, msg, seen);
        }
        slot.store(2 * msg.seq as u64 + 1, Relaxed);
    }

    /// The message that began finishes.
    #[inline]
    pub fn end(&self, key: u64, msg: Msg) {
        self.slots[key as usize]
            .0
            .store(2 * msg.seq as u64 + 2, Relaxed);
        if msg.last && self.remaining.fetch_sub(1, AcqRel) == 1 {
            *self.done.lock().unwrap() = true;
            self.done_cv.notify_all();
        }
    }

    #[cold]
    fn fail(&self, key: u64, msg: Msg, seen: u64) {
        self.errors.fetch_add(1, Relaxed);
        let mut first = self.first_error.lock().unwrap();
        if first.is_none() {
            *first = Some(format!(
                "key {key}: message seq {} arrived when the slot said {} finished{}",
                msg.seq,
                seen / 2,
                if seen % 2 == 1 {
                    " and one still running (overlap)"
                } else {
                    " (reordered, duplicated or lost)"
                }
            ));
        }
    }

    /// Waits until every key's last message has finished; false on timeout.
    pub fn wait(&self, timeout: Duration) -> bool {
        let done = self.done.lock().unwrap();
        let (done, _) = self
            .done_cv
            .wait_timeout_while(done, timeout, |d| !*d)
            .unwrap();
        *done
    }

    /// After [`wait`](Self::wait): no error, no message running, and exactly
    /// `total` messages finished.
    pub fn verify(&self, total: u64) -> Result<(), String> {
        if let Some(e) = self.first_error.lock().unwrap().take() {
            return Err(format!(
                "{} sequence errors; first: {e}",
                self.errors.load(Relaxed)
            ));
        }
        let mut finished = 0;
        for (key, slot) in self.slots.iter().enumerate() {
            let v = slot.0.load(Acquire);
            if v % 2 == 1 {
                return Err(format!("key {key}: a message is still running"));
            }
            finished += v / 2;
        }
        if finished != total {
            return Err(format!("{finished} messages finished, {total} sent"));
        }
        Ok(())
    }

    /// Keys whose last message has not finished yet.
    pub fn remaining(&self) -> usize {
        self.remaining.load(Acquire)
    }
}

/// Holds handlers back until opened (W5: keeps every key's message queued
/// while memory is read).
#[derive(Default)]
pub struct Gate(AtomicBool);

impl Gate {
    /// Lets every waiting handler go.
    pub fn open(&self) {
        self.0.store(true, Release);
    }

    /// Returns once the gate is open (polls: this is not a hot path).
    #[inline]
    pub fn wait(&self) {
        while !self.0.load(Acquire) {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

/// Who sends which message to which key, computed before the clock starts
/// so every design's producer runs the same loop.
pub struct Schedule {
    /// `(key, message)` in sending order.
    pub msgs: Vec<(u64, Msg)>,
    /// Slots the checker needs (highest key + 1).
    pub keys: usize,
    /// Keys that get at least one message.
    pub active_keys: usize,
}

impl Schedule {
    /// `n` messages, the `i`-th to `key_of(i)`, keys below `keys`.
    pub fn new(n: usize, keys: usize, key_of: impl Fn(usize) -> u64) -> Self {
        Self::from_keys((0..n).map(&key_of).collect(), keys)
    }

    /// One message per entry of `ks`, to that key, keys below `keys`.
    pub fn from_keys(ks: Vec<u64>, keys: usize) -> Self {
        let mut count = vec![0u32; keys];
        for &k in &ks {
            count[k as usize] += 1;
        }
        let active_keys = count.iter().filter(|&&c| c > 0).count();
        let mut next = vec![0u32; keys];
        let msgs = ks
            .into_iter()
            .map(|k| {
                let seq = next[k as usize];
                next[k as usize] += 1;
                let last = seq + 1 == count[k as usize];
                (k, Msg { seq, last })
            })
            .collect();
        Schedule {
            msgs,
            keys,
            active_keys,
        }
    }

    /// Round-robin over `keys`.
    pub fn round_robin(n: usize, keys: usize) -> Self {
        Self::new(n, keys, |i| (i % keys) as u64)
    }

    /// Every other message to key 0, the rest round-robin over keys 1..`keys`.
    pub fn hot_key(n: usize, keys: usize) -> Self {
        let cold = (keys - 1).max(1);
        Self::new(n, keys, |i| {
            if i % 2 == 0 {
                0
            } else {
                1 + ((i / 2) % cold) as u64
            }
        })
    }

    /// A fresh checker for this schedule.
    pub fn checker(&self) -> Checker {
        Checker::new(self.keys, self.active_keys)
    }
}
