//! `tokio-actors`: the usual tokio idiom. A multi-thread runtime with N
//! workers; one task per key, spawned on the key's first message, owning the
//! receiver of an unbounded `tokio::sync::mpsc` channel and running the
//! key's messages in order; the senders in a [`SenderMap`] (DashMap, FxHash).
//! Tasks live until the map is cleared, as an actor's usually do.

use super::SenderMap;
use crate::common::design::{Cfg, Design, Family, Handler, SendTo};
use crate::common::work::Msg;
use std::sync::Arc;
use std::time::Duration;
use tokio::runtime::{Handle, Runtime};
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};

/// See the module docs.
pub struct TokioFamily;

impl Family for TokioFamily {
    type D<H: Handler> = TokioActors<H>;
}

struct Shared<H> {
    map: SenderMap<UnboundedSender<Msg>>,
    rt: Handle,
    handler: Arc<H>,
}

/// The tokio design.
pub struct TokioActors<H> {
    rt: Runtime,
    shared: Arc<Shared<H>>,
}

/// Its sender: look the key's channel up (spawn its task on first use), send.
pub struct TokioSender<H>(Arc<Shared<H>>);

impl<H> Clone for TokioSender<H> {
    fn clone(&self) -> Self {
        TokioSender(self.0.clone())
    }
}

impl<H: Handler> SendTo for TokioSender<H> {
    #[inline]
    fn send(&self, key: u64, msg: Msg) {
        let shared = &*self.0;
        if let Some(tx) = shared.map.get(&key) {
            tx.send(msg).expect("tokio-actors: key task gone");
            return;
        }
        shared
            .map
            .entry(key)
            .or_insert_with(|| {
                let (tx, mut rx) = unbounded_channel::<Msg>();
                let h = shared.handler.clone();
                shared.rt.spawn(async move {
                    while let Some(m) = rx.recv().await {
                        h.call(key, m).await;
                    }
                });
                tx
            })
            .send(msg)
            .expect("tokio-actors: key task gone");
    }
}

impl<H: Handler> Design<H> for TokioActors<H> {
    type Sender = TokioSender<H>;

    fn start(cfg: &Cfg, handler: H) -> Self {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(cfg.workers)
            .thread_name("tokio-actors")
            .build()
            .expect("tokio runtime");
        let shared = Arc::new(Shared {
            map: SenderMap::default(),
            rt: rt.handle().clone(),
            handler: Arc::new(handler),
        });
        TokioActors { rt, shared }
    }

    fn sender(&self) -> TokioSender<H> {
        TokioSender(self.shared.clone())
    }

    fn finish(self) {
        self.shared.map.clear();
        self.rt.shutdown_timeout(Duration::from_secs(10));
    }
}
