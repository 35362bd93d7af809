//! Helpers shared by the integration tests.
#![allow(dead_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

mod yield_once;
#[allow(unused_imports)]
pub use yield_once::YieldOnce;

/// Waits (without asserting on time) until `cond` holds; fails the test if it
/// never does within a generous bound.
pub fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cond() {
        assert!(Instant::now() < deadline, "never happened: {what}");
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A one-shot gate a handler can block on until the test opens it.
#[derive(Clone, Default)]
pub struct Gate(Arc<(Mutex<bool>, Condvar)>);

impl Gate {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn open(&self) {
        *self.0 .0.lock().unwrap() = true;
        self.0 .1.notify_all();
    }
    pub fn wait(&self) {
        let mut open = self.0 .0.lock().unwrap();
        while !*open {
            open = self.0 .1.wait(open).unwrap();
        }
    }
}

/// Counts live instances: construct with `Tracked::new(&counter)`.
pub struct Tracked {
    live: Arc<AtomicUsize>,
    pub value: u64,
}

impl Tracked {
    pub fn new(live: &Arc<AtomicUsize>, value: u64) -> Self {
        live.fetch_add(1, Ordering::SeqCst);
        Tracked {
            live: live.clone(),
            value,
        }
    }
}

impl Drop for Tracked {
    fn drop(&mut self) {
        self.live.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Number of live threads of this process whose name starts with `prefix`.
pub fn threads_named(prefix: &str) -> usize {
    let Ok(dir) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    dir.filter_map(|e| e.ok())
        .filter_map(|e| std::fs::read_to_string(e.path().join("comm")).ok())
        .filter(|name| name.trim_end().starts_with(prefix))
        .count()
}

// ----- randomized tests: seeds, a small PRNG, quiet injected panics -------

/// The marker every deliberately injected panic carries in its message, so
/// the quiet panic hook can tell them from real failures.
pub const INJECTED: &str = "injected";

/// SplitMix64: tiny, seedable, plenty for generating schedules. Not for
/// anything cryptographic.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0);
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    /// True with probability `percent`/100.
    pub fn percent(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    /// Uniform in `[0, 1)`.
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Zipf-like (log-uniform, P(k) ~ 1/(k+1)) in `0..n`: a few hot keys and
    /// a long tail.
    pub fn zipf(&mut self, n: u64) -> u64 {
        let k = ((n as f64 + 1.0).ln() * self.unit()).exp() as u64;
        k.saturating_sub(1).min(n - 1)
    }

    /// An independent generator derived from this one.
    pub fn fork(&mut self) -> Rng {
        Rng::new(self.next_u64())
    }
}

/// A number from the environment, or `default`.
pub fn env_u64(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(v) => parse_u64(&v).unwrap_or_else(|| panic!("{name}={v:?} is not a number")),
        Err(_) => default,
    }
}

fn parse_u64(v: &str) -> Option<u64> {
    let v = v.trim();
    match v.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16).ok(),
        None => v.parse().ok(),
    }
}

/// The seeds a randomized test runs: `KEYED_SEED` alone if it is set (to
/// replay a failure), else `rounds` seeds (`KEYED_ROUNDS` overrides) derived
/// from the clock.
pub fn seeds(rounds: u64) -> Vec<u64> {
    if let Ok(v) = std::env::var("KEYED_SEED") {
        return vec![parse_u64(&v).unwrap_or_else(|| panic!("KEYED_SEED={v:?} is not a number"))];
    }
    let rounds = env_u64("KEYED_ROUNDS", rounds);
    let base = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut rng = Rng::new(base);
    (0..rounds).map(|_| rng.next_u64()).collect()
}

/// Prints how to replay the round if the test fails (panics) while it lives.
pub struct Replay {
    test: &'static str,
    seed: u64,
}

impl Replay {
    pub fn new(test: &'static str, seed: u64) -> Self {
        Replay { test, seed }
    }
}

impl Drop for Replay {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "\n*** {} failed with seed {:#x}; replay the same schedule with\n    \
                 KEYED_SEED={:#x} cargo test --test <this file> -- {} --nocapture\n",
                self.test, self.seed, self.seed, self.test
            );
        }
    }
}

/// Installs (once per test binary) a panic hook that stays silent for panics
/// whose message contains [`INJECTED`] and prints every other one as usual.
pub fn quiet_injected_panics() {
    if std::env::var_os("KEYED_LOUD").is_some() {
        return; // show every panic
    }
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let payload = info.payload();
            let msg = payload
                .downcast_ref::<&str>()
                .copied()
                .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
                .unwrap_or("");
            if !msg.contains(INJECTED) {
                default(info);
            }
        }));
    });
}

/// A thread-name prefix unique in this process (Linux keeps 15 bytes of a
/// thread's name; `{prefix}-{i}` stays well inside).
pub fn unique_prefix(tag: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let n = NEXT.fetch_add(1, Ordering::SeqCst);
    let name = format!("{tag}{n}");
    assert!(name.len() <= 11, "thread prefix {name:?} too long");
    name
}

/// An executor of `workers` threads named after a fresh
/// [`unique_prefix`] of `tag` (so [`threads_named`] counts its threads
/// alone), and that prefix.
pub fn named_executor(tag: &str, workers: usize) -> (keyed_executor::KeyedExecutor, String) {
    let prefix = unique_prefix(tag);
    let executor = keyed_executor::KeyedExecutor::builder()
        .workers(workers)
        .thread_name(prefix.clone())
        .build()
        .unwrap();
    (executor, prefix)
}

/// Calls `shutdown_now` on another thread: a force stop waits for the step
/// that runs, which the test lets finish meanwhile.
pub fn shutdown_now_elsewhere(
    executor: &keyed_executor::KeyedExecutor,
) -> std::thread::JoinHandle<()> {
    let executor = executor.clone();
    std::thread::spawn(move || executor.shutdown_now())
}

/// Counts live values of one kind: clone a [`Token`] into each value.
#[derive(Clone, Default)]
pub struct Live(Arc<AtomicUsize>);

impl Live {
    pub fn new() -> Self {
        Self::default()
    }
    pub fn token(&self) -> Token {
        self.0.fetch_add(1, Ordering::SeqCst);
        Token(self.0.clone())
    }
    pub fn count(&self) -> usize {
        self.0.load(Ordering::SeqCst)
    }
}

/// One live value of a [`Live`] count.
pub struct Token(Arc<AtomicUsize>);

impl Drop for Token {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A waker that unparks the thread that made it (for hand-driven futures).
pub fn thread_waker() -> std::task::Waker {
    struct Unpark(std::thread::Thread);
    impl std::task::Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
        fn wake_by_ref(self: &Arc<Self>) {
            self.0.unpark();
        }
    }
    std::task::Waker::from(Arc::new(Unpark(std::thread::current())))
}

/// Polls `fut` once with `waker`.
pub fn poll_once<F: std::future::Future + Unpin>(
    fut: &mut F,
    waker: &std::task::Waker,
) -> std::task::Poll<F::Output> {
    let mut cx = std::task::Context::from_waker(waker);
    std::pin::Pin::new(fut).poll(&mut cx)
}

/// External events futures can await, fired by a test thread in random
/// order. Every waker ever registered is also kept ("stale" wakers), so a
/// test can call them long after their futures finished.
#[derive(Default)]
pub struct Events {
    inner: Mutex<EventsInner>,
}

#[derive(Default)]
struct EventsInner {
    fired: Vec<bool>,
    wakers: Vec<Vec<std::task::Waker>>,
    unfired: Vec<usize>,
    stale: Vec<std::task::Waker>,
}

impl Events {
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// A new, unfired event.
    pub fn add(&self) -> usize {
        let mut st = self.inner.lock().unwrap();
        let id = st.fired.len();
        st.fired.push(false);
        st.wakers.push(Vec::new());
        st.unfired.push(id);
        id
    }

    /// A future that completes once event `id` fired.
    pub fn wait(self: &Arc<Self>, id: usize) -> EventFuture {
        EventFuture {
            events: self.clone(),
            id,
        }
    }

    pub fn fire(&self, id: usize) {
        let wakers = {
            let mut st = self.inner.lock().unwrap();
            if st.fired[id] {
                return;
            }
            st.fired[id] = true;
            st.unfired.retain(|&e| e != id);
            std::mem::take(&mut st.wakers[id])
        };
        for w in wakers {
            w.wake();
        }
    }

    /// Fires one unfired event chosen at random; false if none is left.
    pub fn fire_random(&self, rng: &mut Rng) -> bool {
        let id = {
            let st = self.inner.lock().unwrap();
            if st.unfired.is_empty() {
                return false;
            }
            st.unfired[rng.below(st.unfired.len() as u64) as usize]
        };
        self.fire(id);
        true
    }

    pub fn fire_all(&self) {
        let n = self.inner.lock().unwrap().fired.len();
        for id in 0..n {
            self.fire(id);
        }
    }

    pub fn unfired(&self) -> usize {
        self.inner.lock().unwrap().unfired.len()
    }

    /// Calls every waker ever registered once more (their futures are long
    /// done or dropped: this must be harmless), then forgets them.
    pub fn wake_stale(&self) -> usize {
        let stale = std::mem::take(&mut self.inner.lock().unwrap().stale);
        let n = stale.len();
        for w in stale {
            w.wake();
        }
        n
    }

    /// Forgets every waker (they may keep their tasks' memory alive).
    pub fn clear(&self) {
        let mut st = self.inner.lock().unwrap();
        st.stale.clear();
        for w in st.wakers.iter_mut() {
            w.clear();
        }
    }
}

/// See [`Events::wait`].
pub struct EventFuture {
    events: Arc<Events>,
    id: usize,
}

impl std::future::Future for EventFuture {
    type Output = ();
    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<()> {
        let mut st = self.events.inner.lock().unwrap();
        if st.fired[self.id] {
            return std::task::Poll::Ready(());
        }
        let w = cx.waker().clone();
        st.stale.push(w.clone());
        st.wakers[self.id].push(w);
        std::task::Poll::Pending
    }
}

/// Fires `events` in random order at random short intervals until `quit`.
pub fn spawn_firer(
    events: Arc<Events>,
    mut rng: Rng,
    quit: Arc<std::sync::atomic::AtomicBool>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        while !quit.load(Ordering::SeqCst) {
            if !events.fire_random(&mut rng) || rng.percent(30) {
                std::thread::sleep(Duration::from_micros(rng.below(300)));
            } else {
                std::thread::yield_now();
            }
        }
    })
}

/// Hashes a `u64` key to itself: a test chooses which keys share a port
/// (a dispatcher of two workers puts a key in port `hash >> 63`).
#[derive(Default)]
pub struct IdentityHasher(u64);

impl std::hash::Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 << 8) | u64::from(b);
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// A dispatcher's hasher that hands `u64` keys through ([`IdentityHasher`]).
pub type ByIdentity = std::hash::BuildHasherDefault<IdentityHasher>;
