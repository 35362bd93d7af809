//! `smol-actors`: `async-executor` run by N threads; one task per key,
//! spawned on the key's first message, owning the receiver of an unbounded
//! `async-channel`; the senders in a [`SenderMap`] (DashMap, FxHash).
//!
//! As a user writes it from async-executor's docs: one shared `Executor`,
//! each of the N threads running `future::block_on(ex.run(shutdown))` (the
//! crate's multi-threaded example does the same through `easy-parallel`);
//! the producer, a plain thread, spawns with `Executor::spawn` and sends
//! with `try_send` (an unbounded channel is never full). The map's read
//! lock (`get`) is the hot path, the write lock (`entry`) a key's first
//! message only. A sync handler is called straight from the receive loop;
//! only W3's async one is awaited. `Executor::leak`, which the docs offer
//! for fewer synchronising operations, is not used: it would leak one
//! executor per run, and measured no faster on W1 (BENCHMARKS.md).

use super::SenderMap;
use crate::common::design::{Cfg, Design, Family, Handler, SendTo};
use crate::common::work::Msg;
use async_executor::Executor;
use std::sync::Arc;
use std::thread::JoinHandle;

/// See the module docs.
pub struct SmolFamily;

impl Family for SmolFamily {
    type D<H: Handler> = SmolActors<H>;
}

struct Shared<H> {
    map: SenderMap<async_channel::Sender<Msg>>,
    ex: Arc<Executor<'static>>,
    handler: Arc<H>,
}

/// The smol design.
pub struct SmolActors<H> {
    shared: Arc<Shared<H>>,
    stop: async_channel::Sender<()>,
    threads: Vec<JoinHandle<()>>,
}

/// Its sender: look the key's channel up (spawn its task on first use), send.
pub struct SmolSender<H>(Arc<Shared<H>>);

impl<H> Clone for SmolSender<H> {
    fn clone(&self) -> Self {
        SmolSender(self.0.clone())
    }
}

impl<H: Handler> SendTo for SmolSender<H> {
    #[inline]
    fn send(&self, key: u64, msg: Msg) {
        let shared = &*self.0;
        if let Some(tx) = shared.map.get(&key) {
            tx.try_send(msg).expect("smol-actors: key task gone");
            return;
        }
        shared
            .map
            .entry(key)
            .or_insert_with(|| {
                let (tx, rx) = async_channel::unbounded::<Msg>();
                let h = shared.handler.clone();
                shared
                    .ex
                    .spawn(async move {
                        while let Ok(m) = rx.recv().await {
                            if H::ASYNC {
                                h.call(key, m).await;
                            } else {
                                h.call_blocking(key, m);
                            }
                        }
                    })
                    .detach();
                tx
            })
            .try_send(msg)
            .expect("smol-actors: key task gone");
    }
}

impl<H: Handler> Design<H> for SmolActors<H> {
    type Sender = SmolSender<H>;

    fn start(cfg: &Cfg, handler: H) -> Self {
        let ex = Arc::new(Executor::new());
        let (stop, stopped) = async_channel::bounded::<()>(1);
        let threads = (0..cfg.workers)
            .map(|i| {
                let ex = ex.clone();
                let stopped = stopped.clone();
                std::thread::Builder::new()
                    .name(format!("smol-actors-{i}"))
                    .spawn(move || {
                        let _ = futures_lite::future::block_on(ex.run(stopped.recv()));
                    })
                    .expect("spawn")
            })
            .collect();
        let shared = Arc::new(Shared {
            map: SenderMap::default(),
            ex,
            handler: Arc::new(handler),
        });
        SmolActors {
            shared,
            stop,
            threads,
        }
    }

    fn sender(&self) -> SmolSender<H> {
        SmolSender(self.shared.clone())
    }

    fn finish(self) {
        self.shared.map.clear();
        self.stop.close();
        for t in self.threads {
            t.join().expect("smol worker panicked");
        }
    }
}
