//! Handlers that send to their own executor (issue: forwarding), through the
//! public API: chains of one follow-up per message never deadlock the pool,
//! whatever the credit (sync `send`, async `submit().await`, a cycle through
//! one receiver with `max_in_flight` 1); fan-out beyond the credit is
//! refused with `Full`, never a hang, and live messages stay bounded; a
//! handler holding a `WeakReceiver` to its own dispatcher keeps nothing
//! alive.
//!
//! No test asserts on elapsed time: a deadlock shows as a wait that never
//! ends, caught by `eventually`'s generous limit.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex, OnceLock};

use common::{eventually, Tracked};
use keyed_executor::{handler, KeyedExecutor, SubmitError, WeakReceiver};

/// `(chain, hop)` pairs in the order their handlers ran.
type Log = Arc<Mutex<Vec<(u32, u32)>>>;
/// Where a handler finds its own receiver, once it exists.
type Me<O> = Arc<OnceLock<WeakReceiver<u32, (u32, u32), O>>>;

fn executor(workers: usize) -> KeyedExecutor {
    KeyedExecutor::builder().workers(workers).build().unwrap()
}

/// Every chain ran hops `0..=last`, each once, in order.
fn assert_chains(log: &Log, chains: u32, last: u32) {
    let log = log.lock().unwrap();
    let mut per_chain: HashMap<u32, Vec<u32>> = HashMap::new();
    for &(chain, hop) in log.iter() {
        per_chain.entry(chain).or_default().push(hop);
    }
    assert_eq!(per_chain.len(), chains as usize, "chains that ran");
    let want: Vec<u32> = (0..=last).collect();
    for (chain, hops) in &per_chain {
        assert_eq!(hops, &want, "hops of chain {chain}");
    }
}

/// The first scenario: a sync handler forwards each message to the
/// next key with the blocking `send`, `max_in_flight` 8, 2 workers, 1,000
/// chains of 5 hops sent from another thread.
#[test]
fn sync_chains_forwarding_with_blocking_send_all_finish_in_order() {
    const CHAINS: u32 = 1_000;
    const HOPS: u32 = 5;
    let ex = executor(2);
    let log: Log = Arc::default();
    let me: Me<()> = Arc::default();
    let refused = Arc::new(AtomicUsize::new(0));
    let dispatcher = ex.dispatcher(handler::from_fn({
        let (log, me, refused) = (log.clone(), me.clone(), refused.clone());
        move |&key: &u32, (chain, hop): (u32, u32)| {
            log.lock().unwrap().push((chain, hop));
            if hop < HOPS {
                let rx = me.get().unwrap().upgrade().expect("dispatcher alive");
                if rx.send(key + 1, (chain, hop + 1)).is_err() {
                    refused.fetch_add(1, SeqCst);
                }
            }
        }
    }));
    let rx = dispatcher.receiver(8).unwrap();
    me.set(rx.downgrade()).ok().unwrap();
    let producer = std::thread::spawn({
        let rx = rx.clone();
        move || {
            for chain in 0..CHAINS {
                // Chains start on keys far apart; hops walk up from there.
                rx.send(chain * 16, (chain, 0)).unwrap();
            }
        }
    });
    producer.join().unwrap();
    eventually("every chain finished", || {
        log.lock().unwrap().len() == (CHAINS * (HOPS + 1)) as usize
    });
    assert_eq!(
        refused.load(SeqCst),
        0,
        "a single follow-up is never refused"
    );
    assert_chains(&log, CHAINS, HOPS);
    assert!(ex.shutdown(std::time::Duration::from_secs(30)));
    assert_eq!(rx.in_flight(), 0);
}

/// The async twin: `submit(k + 1, …).await` inside `from_async_fn`; the
/// parent also awaits its child's completion (another key), so every
/// message of a chain is unfinished at once.
#[test]
fn async_chains_submitting_and_awaiting_the_follow_up_all_finish() {
    const CHAINS: u32 = 300;
    const HOPS: u32 = 5;
    let ex = executor(2);
    let log: Log = Arc::default();
    type Rx = WeakReceiver<u32, (u32, u32), u32>;
    let me: Arc<OnceLock<Rx>> = Arc::default();
    let dispatcher = ex.dispatcher(handler::from_async_fn({
        let (log, me) = (log.clone(), me.clone());
        move |key: u32, (chain, hop): (u32, u32)| {
            log.lock().unwrap().push((chain, hop));
            let me = me.clone();
            async move {
                if hop == HOPS {
                    return hop;
                }
                let rx = me.get().unwrap().upgrade().expect("dispatcher alive");
                let child = rx
                    .submit(key + 1, (chain, hop + 1))
                    .await
                    .expect("one follow-up is never refused");
                // The child runs on another key: awaiting it here is allowed.
                child.await.expect("the follow-up finished")
            }
        }
    }));
    let rx = dispatcher.receiver(8).unwrap();
    me.set(rx.downgrade()).ok().unwrap();
    let roots: Vec<_> = (0..CHAINS)
        .map(|chain| futures::executor::block_on(rx.submit(chain * 16, (chain, 0))).unwrap())
        .collect();
    for root in roots {
        assert_eq!(
            futures::executor::block_on(root).unwrap(),
            HOPS,
            "a root returns its last hop"
        );
    }
    assert_chains(&log, CHAINS, HOPS);
    assert!(ex.shutdown(std::time::Duration::from_secs(30)));
    assert_eq!(rx.in_flight(), 0);
}

/// A cycle through one receiver with `max_in_flight` 1: each message
/// forwards to the next key of a ring, through the very receiver whose one
/// unit it holds, both sync (blocking `send`) and async (`submit().await`).
#[test]
fn a_cycle_through_one_receiver_with_one_unit_of_credit_goes_round() {
    const RING: u32 = 7;
    const HOPS: u32 = 50;
    const CHAINS: u32 = 40;
    for asynchronous in [false, true] {
        let ex = executor(2);
        let log: Log = Arc::default();
        let me: Me<()> = Arc::default();
        let forward = {
            let (log, me) = (log.clone(), me.clone());
            move |key: u32, (chain, hop): (u32, u32)| {
                log.lock().unwrap().push((chain, hop));
                (hop < HOPS).then(|| (me.get().unwrap().upgrade().unwrap(), key))
            }
        };
        let dispatcher = if asynchronous {
            ex.dispatcher(handler::from_async_fn(move |key, (chain, hop)| {
                let next = forward(key, (chain, hop));
                async move {
                    if let Some((rx, key)) = next {
                        rx.send_async((key + 1) % RING, (chain, hop + 1))
                            .await
                            .expect("the follow-up inherits the unit");
                    }
                }
            }))
        } else {
            ex.dispatcher(handler::from_fn(move |&key: &u32, (chain, hop)| {
                if let Some((rx, key)) = forward(key, (chain, hop)) {
                    rx.send((key + 1) % RING, (chain, hop + 1))
                        .expect("the follow-up inherits the unit");
                }
            }))
        };
        let rx = dispatcher.receiver(1).unwrap();
        me.set(rx.downgrade()).ok().unwrap();
        for chain in 0..CHAINS {
            rx.send(chain % RING, (chain, 0)).unwrap();
        }
        eventually("every chain went round", || {
            log.lock().unwrap().len() == (CHAINS * (HOPS + 1)) as usize
        });
        assert_chains(&log, CHAINS, HOPS);
        assert!(ex.shutdown(std::time::Duration::from_secs(30)));
        assert_eq!(rx.in_flight(), 0, "async: {asynchronous}");
    }
}

/// Two follow-ups per message, depth 4, credit 4: what cannot be taken is
/// refused with `Full` (handing the message back), never a hang; every
/// accepted message runs, and live messages stay bounded by the credit and
/// the workers.
#[test]
fn fan_out_beyond_the_credit_is_refused_with_full_and_stays_bounded() {
    const DEPTH: u32 = 4;
    const ROOTS: u64 = 200;
    const CREDIT: usize = 4;
    const WORKERS: usize = 2;
    struct Node {
        depth: u32,
        _live: Tracked,
    }
    let ex = executor(WORKERS);
    let live = Arc::new(AtomicUsize::new(0));
    let max_live = Arc::new(AtomicUsize::new(0));
    let ran = Arc::new(AtomicUsize::new(0));
    let inner = Arc::new(AtomicUsize::new(0));
    let accepted_children = Arc::new(AtomicUsize::new(0));
    let full = Arc::new(AtomicUsize::new(0));
    let me: Arc<OnceLock<WeakReceiver<u64, Node, ()>>> = Arc::default();
    let dispatcher = ex.dispatcher(handler::from_fn({
        let (live, max_live, ran, inner) =
            (live.clone(), max_live.clone(), ran.clone(), inner.clone());
        let (accepted_children, full, me) = (accepted_children.clone(), full.clone(), me.clone());
        move |&key: &u64, node: Node| {
            ran.fetch_add(1, SeqCst);
            max_live.fetch_max(live.load(SeqCst), SeqCst);
            if node.depth == 0 {
                return;
            }
            inner.fetch_add(1, SeqCst);
            let rx = me.get().unwrap().upgrade().unwrap();
            for branch in 0..2 {
                let child = Node {
                    depth: node.depth - 1,
                    _live: Tracked::new(&live, 0),
                };
                match rx.send(key * 2 + branch + 1, child) {
                    Ok(_) => {
                        accepted_children.fetch_add(1, SeqCst);
                    }
                    Err(SubmitError::Full(back)) => {
                        assert_eq!(
                            back.depth,
                            node.depth - 1,
                            "the refused message is handed back"
                        );
                        full.fetch_add(1, SeqCst);
                    }
                    Err(e) => panic!("unexpected refusal: {e}"),
                }
            }
        }
    }));
    let rx = dispatcher.receiver(CREDIT).unwrap();
    me.set(rx.downgrade()).ok().unwrap();
    for root in 0..ROOTS {
        let node = Node {
            depth: DEPTH,
            _live: Tracked::new(&live, 0),
        };
        rx.send(root << 32, node).unwrap();
    }
    eventually("every accepted message ran", || {
        ran.load(SeqCst) == ROOTS as usize + accepted_children.load(SeqCst)
            && live.load(SeqCst) == 0
    });
    assert!(ex.shutdown(std::time::Duration::from_secs(30)));
    let (ran, accepted, full) = (
        ran.load(SeqCst),
        accepted_children.load(SeqCst),
        full.load(SeqCst),
    );
    // Every node that ran above the leaves made two attempts, each taken
    // or refused; nothing else ran.
    let full_tree = ROOTS as usize * ((1 << (DEPTH + 1)) - 1);
    assert!(ran <= full_tree);
    assert_eq!(accepted + full, 2 * inner.load(SeqCst));
    assert_eq!(ran, ROOTS as usize + accepted);
    assert!(full > 0, "credit {CREDIT} cannot take the whole fan-out");
    // Running ≤ workers; each queued message holds its own unit, or shares
    // the unit of the running message that sent it (once per message); each
    // running handler holds at most two children not yet submitted.
    let bound = CREDIT + 4 * WORKERS;
    let max_live = max_live.load(SeqCst);
    assert!(max_live <= bound, "{max_live} live messages > {bound}");
}

/// A handler holding a `WeakReceiver` to its own dispatcher: once the last
/// strong handle is dropped, the handler's state, the dispatcher and its
/// receivers are freed, and `upgrade` says so.
#[test]
fn a_handler_holding_a_weak_receiver_to_itself_leaks_nothing() {
    struct State {
        dropped: Arc<AtomicUsize>,
        me: OnceLock<WeakReceiver<u32, u32, ()>>,
        seen: AtomicUsize,
    }
    impl Drop for State {
        fn drop(&mut self) {
            self.dropped.fetch_add(1, SeqCst);
        }
    }
    let ex = executor(2);
    let dropped = Arc::new(AtomicUsize::new(0));
    let state = Arc::new(State {
        dropped: dropped.clone(),
        me: OnceLock::new(),
        seen: AtomicUsize::new(0),
    });
    let dispatcher = ex.dispatcher(handler::from_fn({
        let state = state.clone();
        move |&key: &u32, hops: u32| {
            state.seen.fetch_add(1, SeqCst);
            if hops > 0 {
                if let Some(rx) = state.me.get().and_then(WeakReceiver::upgrade) {
                    rx.send(key + 1, hops - 1).unwrap();
                }
            }
        }
    }));
    let rx = dispatcher.receiver(4).unwrap();
    state.me.set(rx.downgrade()).ok().unwrap();
    let weak = rx.downgrade();
    let probe = Arc::downgrade(&state);
    drop(state);
    for key in 0..10 {
        rx.send(key * 100, 9).unwrap();
    }
    eventually("every hop ran", || {
        probe.upgrade().map(|s| s.seen.load(SeqCst)) == Some(100)
    });
    assert!(rx.shutdown(std::time::Duration::from_secs(30)));
    assert!(weak.upgrade().is_some(), "strong handles are still alive");
    drop(rx);
    drop(dispatcher);
    eventually("the handler's state was freed", || {
        dropped.load(SeqCst) == 1
    });
    assert!(probe.upgrade().is_none());
    assert!(weak.upgrade().is_none(), "nothing left to upgrade to");
    // The executor itself goes on.
    let other = ex.dispatcher(handler::from_fn(|_: &u32, m: u32| m));
    let c = other.receiver(1).unwrap().try_submit(1, 5).unwrap();
    assert_eq!(futures::executor::block_on(c).unwrap(), 5);
}
