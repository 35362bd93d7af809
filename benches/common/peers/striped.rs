//! `striped`: N threads, each draining its own unbounded crossbeam channel;
//! a key always goes to the thread `stripe(key)` picks, so its messages run
//! in order on that thread (the ordered executor of Apache BookKeeper and
//! Hazelcast). Async handlers block their thread until the future is done.
//!
//! A batched source (W1b) sends one `Vec` per stripe per poll: the poll's
//! messages for that stripe, in order, run by the stripe thread one by one.

use super::stripe;
use crate::common::design::{Cfg, Design, Family, Handler, SendTo};
use crate::common::work::Msg;
use crossbeam_channel::{bounded, unbounded, Receiver, Sender};
use std::marker::PhantomData;
use std::sync::Arc;
use std::thread::JoinHandle;

/// See the module docs.
pub struct StripedFamily;

impl Family for StripedFamily {
    type D<H: Handler> = Striped<H>;
    const BLOCKS_ON_IO: bool = true;
}

enum Cmd {
    Run(u64, Msg),
    Batch(Vec<(u64, Msg)>),
    Stop,
}

/// The striped design.
pub struct Striped<H> {
    txs: Arc<[Sender<Cmd>]>,
    threads: Vec<JoinHandle<()>>,
    _handler: PhantomData<fn(H)>,
}

/// Its sender: hash the key, push to that thread's channel.
#[derive(Clone)]
pub struct StripedSender(Arc<[Sender<Cmd>]>);

impl SendTo for StripedSender {
    #[inline]
    fn send(&self, key: u64, msg: Msg) {
        let tx = &self.0[stripe(key, self.0.len())];
        if tx.send(Cmd::Run(key, msg)).is_err() {
            panic!("striped: sent after finish");
        }
    }

    fn send_batch(&self, batch: Vec<(u64, Msg)>) {
        let n = self.0.len();
        let mut per: Vec<Vec<(u64, Msg)>> = (0..n)
            .map(|_| Vec::with_capacity(batch.len() / n + batch.len() / 8 + 1))
            .collect();
        for (k, m) in batch {
            per[stripe(k, n)].push((k, m));
        }
        for (tx, part) in self.0.iter().zip(per) {
            if !part.is_empty() && tx.send(Cmd::Batch(part)).is_err() {
                panic!("striped: sent after finish");
            }
        }
    }
}

impl<H: Handler> Design<H> for Striped<H> {
    type Sender = StripedSender;

    fn start(cfg: &Cfg, handler: H) -> Self {
        let handler = Arc::new(handler);
        let mut txs = Vec::new();
        let mut threads = Vec::new();
        // `KEYED_BENCH_STRIPED_BOUND=N` (diagnostic): bounded channels of
        // N ÷ workers each, so the producer blocks as the crate's does at
        // `max_in_flight` N (a batch counts as one). For W1, W2 and W7 only:
        // W4's handlers send to their own pool and could block on a full
        // channel for good.
        let bound = std::env::var("KEYED_BENCH_STRIPED_BOUND")
            .ok()
            .and_then(|v| v.parse::<usize>().ok());
        for i in 0..cfg.workers {
            let (tx, rx): (Sender<Cmd>, Receiver<Cmd>) = match bound {
                Some(n) => bounded((n / cfg.workers).max(1)),
                None => unbounded(),
            };
            let h = handler.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("striped-{i}"))
                    .spawn(move || {
                        for cmd in rx {
                            match cmd {
                                Cmd::Run(k, m) => h.call_blocking(k, m),
                                Cmd::Batch(v) => {
                                    for (k, m) in v {
                                        h.call_blocking(k, m);
                                    }
                                }
                                Cmd::Stop => break,
                            }
                        }
                    })
                    .expect("spawn"),
            );
            txs.push(tx);
        }
        Striped {
            txs: txs.into(),
            threads,
            _handler: PhantomData,
        }
    }

    fn sender(&self) -> StripedSender {
        StripedSender(self.txs.clone())
    }

    fn finish(self) {
        // An explicit stop: a handler may hold a sender (W4), so waiting for
        // every sender to drop could wait forever.
        for tx in self.txs.iter() {
            let _ = tx.send(Cmd::Stop);
        }
        for t in self.threads {
            t.join().expect("striped worker panicked");
        }
    }
}
