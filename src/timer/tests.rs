use super::*;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::Mutex as StdMutex;
use std::task::Wake;

/// Counts its wakes; unparks the thread that made it.
struct Flag {
    woken: AtomicUsize,
    thread: std::thread::Thread,
}

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }

    fn wake_by_ref(self: &Arc<Self>) {
        self.woken.fetch_add(1, SeqCst);
        self.thread.unpark();
    }
}

fn flag_waker() -> (Arc<Flag>, Waker) {
    let flag = Arc::new(Flag {
        woken: AtomicUsize::new(0),
        thread: std::thread::current(),
    });
    let waker = Waker::from(Arc::clone(&flag));
    (flag, waker)
}

fn noop() -> Waker {
    flag_waker().1
}

/// Waits (parked, up to 10 s) until `done`; whether it came true.
fn eventually(mut done: impl FnMut() -> bool) -> bool {
    let give_up = Instant::now() + Duration::from_secs(10);
    while !done() {
        if Instant::now() >= give_up {
            return false;
        }
        std::thread::park_timeout(Duration::from_millis(1));
    }
    true
}

/// Drives `future` on this thread, parking between polls.
fn block_on<F: Future>(future: F) -> F::Output {
    let (_, waker) = flag_waker();
    let mut cx = Context::from_waker(&waker);
    let mut future = std::pin::pin!(future);
    loop {
        if let Poll::Ready(out) = future.as_mut().poll(&mut cx) {
            return out;
        }
        std::thread::park();
    }
}

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

/// A deterministic sequence (xorshift64) for the randomized tests.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Every entry's slot points at it, and no child is earlier than its
/// parent.
fn check_heap(h: &Heap) {
    for (pos, e) in h.entries.iter().enumerate() {
        assert_eq!(h.slots[e.slot].id, e.id);
        assert_eq!(h.slots[e.slot].pos, pos);
        if pos > 0 {
            assert!(!h.earlier(pos, (pos - 1) / 2), "heap order broken at {pos}");
        }
    }
    let live = h.slots.iter().filter(|s| s.id != 0).count();
    assert_eq!(live, h.entries.len());
    assert_eq!(live + h.free.len(), h.slots.len());
}

#[test]
fn the_heap_agrees_with_a_sorted_set() {
    let base = Instant::now();
    let mut rng = Rng(0x2545_f491_4f6c_dd1d);
    let mut heap = Heap::new();
    // The model: (deadline, id) of every pending entry, and its key.
    let mut model: BTreeSet<(Instant, u64)> = BTreeSet::new();
    let mut keys: Vec<(TimerKey, Instant)> = Vec::new();
    let mut gone: Vec<TimerKey> = Vec::new();
    for round in 0..20_000 {
        match rng.below(10) {
            0..=3 => {
                let at = base + Duration::from_micros(rng.below(1_000));
                let (key, earliest) = heap.push(at, noop());
                model.insert((at, key.id));
                assert_eq!(earliest, model.first() == Some(&(at, key.id)));
                keys.push((key, at));
            }
            4 | 5 if !keys.is_empty() => {
                let (key, at) = keys.swap_remove(rng.below(keys.len() as u64) as usize);
                assert!(heap.remove(key).is_some());
                assert!(model.remove(&(at, key.id)));
                gone.push(key);
            }
            6 if !keys.is_empty() => {
                let i = rng.below(keys.len() as u64) as usize;
                let (key, at) = keys[i];
                let to = base + Duration::from_micros(rng.below(1_000));
                let earliest = heap.reset(key, to).expect("pending");
                model.remove(&(at, key.id));
                model.insert((to, key.id));
                assert_eq!(earliest, model.first() == Some(&(to, key.id)));
                keys[i].1 = to;
            }
            7 => {
                let now = base + Duration::from_micros(rng.below(1_000));
                while heap.pop_due(now).is_some() {
                    let first = model.pop_first().expect("the model has it");
                    assert!(first.0 <= now);
                    let i = keys.iter().position(|(k, _)| k.id == first.1).unwrap();
                    gone.push(keys.swap_remove(i).0);
                }
                assert!(model.first().map_or(true, |f| f.0 > now));
            }
            _ => {
                // A stale key finds nothing, even where its slot is reused.
                if let Some(&key) = gone.last() {
                    assert!(heap.position(key).is_none());
                    assert!(heap.remove(key).is_none());
                    assert!(heap.reset(key, base).is_none());
                }
            }
        }
        assert_eq!(heap.len(), model.len());
        assert_eq!(heap.earliest(), model.first().map(|f| f.0));
        if round % 97 == 0 {
            check_heap(&heap);
        }
    }
    check_heap(&heap);
}

#[test]
fn equal_deadlines_fire_in_insertion_order() {
    let at = Instant::now();
    let mut heap = Heap::new();
    let keys: Vec<TimerKey> = (0..50).map(|_| heap.push(at, noop()).0).collect();
    let mut order = Vec::new();
    while heap.len() > 0 {
        let first = heap.entries[0].id;
        heap.pop_due(at).unwrap();
        order.push(first);
    }
    assert_eq!(order, keys.iter().map(|k| k.id).collect::<Vec<_>>());
}

#[test]
fn the_heap_gives_memory_back() {
    let base = Instant::now();
    let mut heap = Heap::new();
    // A burst, cancelled.
    let keys: Vec<TimerKey> = (0..10_000)
        .map(|i| heap.push(base + Duration::from_micros(i % 977), noop()).0)
        .collect();
    assert!(heap.capacity() >= 10_000);
    for (i, key) in keys.iter().enumerate() {
        assert!(heap.remove(*key).is_some());
        if i == 9_000 {
            // Mostly drained: the heap's buffer followed.
            assert!(heap.entries.capacity() <= 4 * 1_000);
        }
    }
    assert!(heap.capacity() <= KEEP, "{}", heap.capacity());
    // A burst, fired.
    for i in 0..10_000 {
        let _ = heap.push(base + Duration::from_micros(i % 977), noop());
    }
    while heap.pop_due(base + ms(1)).is_some() {}
    assert_eq!(heap.len(), 0);
    assert!(heap.capacity() <= KEEP, "{}", heap.capacity());
    // A trickle keeps its small buffers.
    let (key, _) = heap.push(base, noop());
    let cap = heap.entries.capacity();
    heap.remove(key);
    let _ = heap.push(base, noop());
    assert_eq!(heap.entries.capacity(), cap);
}

#[test]
fn many_deadlines_fire_in_order_and_not_early() {
    let timers = Timers::with_name("tmr-order");
    let fired: Arc<StdMutex<Vec<(usize, Instant)>>> = Arc::default();
    // Far enough ahead that every insert lands before the first fires
    // (Miri runs the inserts hundreds of times slower).
    let base = Instant::now() + ms(if cfg!(miri) { 2_000 } else { 20 });
    let n = 300;
    let mut deadlines = Vec::new();
    for i in 0..n {
        // Scattered over 30 ms, inserted out of order.
        let at = base + Duration::from_micros((i as u64 * 7_919) % 30_000);
        deadlines.push(at);
        let fired = Arc::clone(&fired);
        let waker = Waker::from(Arc::new(Record(i, fired)));
        let _ = timers.insert(at, &waker).unwrap();
    }
    let inserted = Instant::now();
    assert!(eventually(|| fired.lock().unwrap().len() == n));
    let fired = fired.lock().unwrap().clone();
    for (i, woken_at) in &fired {
        assert!(*woken_at >= deadlines[*i], "entry {i} fired early");
    }
    // Order is promised among entries that were all in the heap when
    // they fell due: on a stalled machine the first may fire before
    // the last insert.
    let queued: Vec<_> = fired
        .iter()
        .filter(|(i, _)| deadlines[*i] > inserted)
        .collect();
    for pair in queued.windows(2) {
        assert!(
            deadlines[pair[0].0] <= deadlines[pair[1].0],
            "fired out of order"
        );
    }
    assert!(timers.is_empty());
}

/// Records (its index, when) on wake.
struct Record(usize, Arc<StdMutex<Vec<(usize, Instant)>>>);

impl Wake for Record {
    fn wake(self: Arc<Self>) {
        self.1.lock().unwrap().push((self.0, Instant::now()));
    }
}

#[test]
fn a_cancelled_entry_is_not_woken_and_its_waker_is_dropped() {
    let timers = Timers::with_name("tmr-cancel");
    let (flag, waker) = flag_waker();
    let key = timers.insert(Instant::now() + ms(30), &waker).unwrap();
    assert!(timers.is_pending(key));
    assert_eq!(Arc::strong_count(&flag), 3, "the entry holds a clone");
    assert!(timers.cancel(key));
    assert!(!timers.cancel(key), "cancelled once");
    assert!(!timers.is_pending(key));
    assert_eq!(Arc::strong_count(&flag), 2, "the entry's clone dropped");
    // Past the deadline, nothing comes.
    let other = timers.insert(Instant::now() + ms(60), &noop()).unwrap();
    assert!(eventually(|| !timers.is_pending(other)));
    assert_eq!(flag.woken.load(SeqCst), 0);
}

#[test]
fn a_cancel_racing_the_firing_wakes_at_most_once() {
    let timers = Arc::new(Timers::with_name("tmr-race"));
    let per_thread = 400;
    let outcomes: Vec<Vec<(bool, Arc<Flag>)>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4u64)
            .map(|t| {
                let timers = Arc::clone(&timers);
                s.spawn(move || {
                    let mut rng = Rng(0x9e37_79b9 + t);
                    (0..per_thread)
                        .map(|_| {
                            let (flag, waker) = flag_waker();
                            let at = Instant::now() + Duration::from_micros(rng.below(300));
                            let key = timers.insert(at, &waker).unwrap();
                            drop(waker);
                            // Cancel around the deadline: before, during
                            // or after the firing.
                            let spin = Instant::now() + Duration::from_micros(rng.below(400));
                            while Instant::now() < spin {
                                std::hint::spin_loop();
                            }
                            (timers.cancel(key), flag)
                        })
                        .collect()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    // Joins the thread: every firing has finished waking.
    drop(Arc::into_inner(timers).expect("the last owner"));
    let (mut cancelled, mut fired) = (0, 0);
    for (was_cancelled, flag) in outcomes.into_iter().flatten() {
        let woken = flag.woken.load(SeqCst);
        if was_cancelled {
            assert_eq!(woken, 0, "cancelled yet woken");
            cancelled += 1;
        } else {
            assert_eq!(woken, 1, "fired but woken {woken} times");
            fired += 1;
        }
        assert_eq!(Arc::strong_count(&flag), 1, "a waker was kept");
    }
    assert_eq!(cancelled + fired, 4 * per_thread);
}

#[test]
fn re_arming_moves_the_wake_up_earlier_or_later() {
    let timers = Timers::with_name("tmr-rearm");
    // Earlier: from an hour away to now-ish, while the thread sleeps on it.
    let (early, waker) = flag_waker();
    let key = timers
        .insert(Instant::now() + Duration::from_secs(3600), &waker)
        .unwrap();
    std::thread::sleep(ms(10));
    assert!(timers.reset(key, Instant::now() + ms(5), &waker));
    assert!(eventually(|| early.woken.load(SeqCst) == 1));
    assert!(!timers.is_pending(key));
    // A fired entry is not re-armed: insert again.
    assert!(!timers.reset(key, Instant::now(), &waker));

    // Later: from soon to an hour away; it stays pending past the first.
    let (late, waker) = flag_waker();
    let key = timers.insert(Instant::now() + ms(20), &waker).unwrap();
    assert!(timers.reset(key, Instant::now() + Duration::from_secs(3600), &waker));
    let witness = timers.insert(Instant::now() + ms(40), &noop()).unwrap();
    assert!(eventually(|| !timers.is_pending(witness)));
    assert!(timers.is_pending(key));
    assert_eq!(late.woken.load(SeqCst), 0);

    // A re-arm with another waker wakes that one.
    let (other, other_waker) = flag_waker();
    assert!(timers.reset(key, Instant::now(), &other_waker));
    assert!(eventually(|| other.woken.load(SeqCst) == 1));
    assert_eq!(late.woken.load(SeqCst), 0);
    assert_eq!(
        Arc::strong_count(&late),
        2,
        "the replaced waker was dropped"
    );
}

#[test]
fn an_earlier_entry_wakes_the_sleeping_thread() {
    let timers = Timers::with_name("tmr-earlier");
    let far = timers
        .insert(Instant::now() + Duration::from_secs(3600), &noop())
        .unwrap();
    // Let the thread settle into its hour-long wait.
    std::thread::sleep(ms(20));
    let (flag, waker) = flag_waker();
    let _ = timers.insert(Instant::now() + ms(1), &waker).unwrap();
    assert!(eventually(|| flag.woken.load(SeqCst) == 1));
    assert!(timers.is_pending(far));
}

/// The threads of this process named `name` (Linux: `/proc`).
#[cfg(target_os = "linux")]
fn threads_named(name: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.trim_end() == name)
        .count()
}

#[test]
fn the_thread_starts_on_first_use_and_exits_on_drop() {
    let name = "tmr-lifecycle";
    let timers = Timers::with_name(name);
    let sleep = timers.sleep_until(Instant::now());
    block_on(sleep); // already due: no entry, no thread
    assert!(!timers.started());
    let _ = timers.insert(Instant::now() + ms(1), &noop()).unwrap();
    assert!(timers.started());
    // The thread names itself once it runs.
    #[cfg(target_os = "linux")]
    assert!(eventually(|| threads_named(name) == 1));
    drop(timers);
    #[cfg(target_os = "linux")]
    assert_eq!(threads_named(name), 0, "the thread outlived its Timers");
}

#[test]
fn dropping_the_timers_wakes_what_is_pending() {
    let timers = Timers::with_name("tmr-close");
    let (flag, waker) = flag_waker();
    let key = timers
        .insert(Instant::now() + Duration::from_secs(3600), &waker)
        .unwrap();
    let mut sleep = timers.sleep(Duration::from_secs(3600));
    let (sleeper, sleeper_waker) = flag_waker();
    let mut cx = Context::from_waker(&sleeper_waker);
    assert!(Pin::new(&mut sleep).poll(&mut cx).is_pending());
    drop(timers);
    assert_eq!(flag.woken.load(SeqCst), 1);
    assert_eq!(sleeper.woken.load(SeqCst), 1);
    // The sleep ends: nothing would wake it any more.
    assert!(Pin::new(&mut sleep).poll(&mut cx).is_ready());
    let _ = key;
}

#[test]
fn a_waker_may_drop_the_timers_on_its_thread() {
    let name = "tmr-self-drop";
    let slot: Arc<StdMutex<Option<Timers>>> = Arc::new(StdMutex::new(None));
    struct DropTimers(Arc<StdMutex<Option<Timers>>>);
    impl Wake for DropTimers {
        fn wake(self: Arc<Self>) {
            drop(self.0.lock().unwrap().take());
        }
    }
    let timers = Timers::with_name(name);
    let waker = Waker::from(Arc::new(DropTimers(Arc::clone(&slot))));
    let _ = timers.insert(Instant::now(), &waker).unwrap();
    drop(waker);
    *slot.lock().unwrap() = Some(timers);
    assert!(eventually(|| slot.lock().unwrap().is_none()));
    #[cfg(target_os = "linux")]
    assert!(
        eventually(|| threads_named(name) == 0),
        "the thread did not exit"
    );
}

#[test]
fn a_panicking_waker_does_not_stop_the_others() {
    struct Bomb;
    impl Wake for Bomb {
        fn wake(self: Arc<Self>) {
            panic!("a waker that panics");
        }
    }
    let timers = Timers::with_name("tmr-bomb");
    let now = Instant::now();
    let _ = timers.insert(now, &Waker::from(Arc::new(Bomb))).unwrap();
    let (flag, waker) = flag_waker();
    let _ = timers.insert(now + ms(1), &waker).unwrap();
    assert!(eventually(|| flag.woken.load(SeqCst) == 1));
}

#[test]
fn capacity_shrinks_after_a_burst() {
    let timers = Timers::with_name("tmr-shrink");
    // Far enough that the burst is in before the first entry fires, even
    // on a loaded machine; if it was not (the thread stalled past `at`),
    // the heap may already have shrunk and only the end is checked.
    let at = Instant::now() + ms(200);
    for _ in 0..5_000 {
        let _ = timers.insert(at, &noop()).unwrap();
    }
    let grown = timers.capacity();
    assert!(grown >= 5_000 || Instant::now() >= at, "{grown}");
    assert!(eventually(|| timers.is_empty()));
    assert!(timers.capacity() <= KEEP, "{}", timers.capacity());
}

#[test]
fn a_sleep_waits_for_its_deadline() {
    let timers = Timers::with_name("tmr-sleep");
    let deadline = Instant::now() + ms(15);
    block_on(timers.sleep_until(deadline));
    assert!(Instant::now() >= deadline);
    assert!(timers.is_empty());
    // A duration too large for an `Instant` saturates.
    let sleep = timers.sleep(Duration::MAX);
    assert!(sleep.deadline() > Instant::now() + Duration::from_secs(365 * 86_400));
}

#[test]
fn a_sleep_registers_once_follows_its_waker_and_unregisters_on_drop() {
    let timers = Timers::with_name("tmr-sleep-reg");
    let mut sleep = timers.sleep(ms(40));
    let (first, first_waker) = flag_waker();
    let (second, second_waker) = flag_waker();
    assert!(Pin::new(&mut sleep)
        .poll(&mut Context::from_waker(&first_waker))
        .is_pending());
    assert_eq!(timers.len(), 1);
    // The same waker again: nothing changes.
    assert!(Pin::new(&mut sleep)
        .poll(&mut Context::from_waker(&first_waker))
        .is_pending());
    assert_eq!(timers.len(), 1);
    // Moved to another task: that one is woken, the first is let go.
    assert!(Pin::new(&mut sleep)
        .poll(&mut Context::from_waker(&second_waker))
        .is_pending());
    assert_eq!(timers.len(), 1);
    assert_eq!(Arc::strong_count(&first), 2, "the first waker was dropped");
    assert!(eventually(|| second.woken.load(SeqCst) == 1));
    assert_eq!(first.woken.load(SeqCst), 0);
    assert!(Pin::new(&mut sleep)
        .poll(&mut Context::from_waker(&second_waker))
        .is_ready());

    // Dropped while pending: the entry goes.
    let mut sleep = timers.sleep(Duration::from_secs(3600));
    assert!(Pin::new(&mut sleep)
        .poll(&mut Context::from_waker(&first_waker))
        .is_pending());
    assert_eq!(timers.len(), 1);
    drop(sleep);
    assert!(timers.is_empty());
    assert_eq!(Arc::strong_count(&first), 2);
}

#[test]
fn a_sleep_can_be_reset() {
    let timers = Timers::with_name("tmr-sleep-reset");
    let mut sleep = timers.sleep(Duration::from_secs(3600));
    let (flag, waker) = flag_waker();
    assert!(Pin::new(&mut sleep)
        .poll(&mut Context::from_waker(&waker))
        .is_pending());
    sleep.reset(Instant::now() + ms(5));
    assert!(eventually(|| flag.woken.load(SeqCst) == 1));
    assert!(sleep.is_elapsed());
    assert!(Pin::new(&mut sleep)
        .poll(&mut Context::from_waker(&waker))
        .is_ready());
    // Reset later after it ended: pending again, until the new deadline.
    sleep.reset(Instant::now() + ms(10));
    assert!(!sleep.is_elapsed());
    block_on(&mut sleep);
    assert!(sleep.is_elapsed());
}

#[test]
fn sleeps_run_under_tokio() {
    let timers = Arc::new(Timers::with_name("tmr-tokio"));
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_time()
        .build()
        .unwrap();
    rt.block_on(async {
        let start = Instant::now();
        let tasks: Vec<_> = (0..200u64)
            .map(|i| {
                let timers = Arc::clone(&timers);
                tokio::spawn(async move {
                    let deadline = start + Duration::from_micros(i * 97 % 20_000);
                    timers.sleep_until(deadline).await;
                    assert!(Instant::now() >= deadline);
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        // Cancelled by the runtime's timeout: the entry goes with it.
        let long = timers.sleep(Duration::from_secs(3600));
        assert!(tokio::time::timeout(ms(5), long).await.is_err());
    });
    assert!(timers.is_empty());
    assert!(timers.capacity() <= KEEP);
}

#[test]
fn timers_and_sleeps_cross_threads() {
    fn check<T: Send + Sync>() {}
    check::<Timers>();
    check::<Sleep>();
    check::<TimerKey>();
}
