//! `tokio-actors`: the usual tokio idiom. A multi-thread runtime with N
//! workers; one task per key, spawned on the key's first message, owning the
//! receiver of an unbounded `tokio::sync::mpsc` channel and running the
//! key's messages in order; the senders in a [`SenderMap`] (DashMap, FxHash).
//! Tasks live until the map is cleared, as an actor's usually do.
//!
//! Each choice below is what a user writes for this job, with the tokio
//! documentation's defaults (tokio 1.54):
//!
//! - `Builder::new_multi_thread().worker_threads(N)`: the same N handler
//!   threads as every other design (N = 2 = the cores here, which is also
//!   `Runtime::new()`'s default). `event_interval` and
//!   `global_queue_interval` stay at their defaults: the runtime module docs
//!   ("Multi threaded runtime") describe them as the tuned behaviour, and a
//!   task woken from a thread that is not a worker goes to the global queue
//!   whatever they are set to.
//! - No `enable_all()`: the handlers use neither tokio's I/O nor its timers,
//!   and the builder's drivers are opt-in (`enable_io`, `enable_time`).
//!   `Runtime::new()` / `#[tokio::main]` would enable both, which costs
//!   an idle worker an `epoll_wait` instead of a condvar and a busy one a
//!   driver poll every `event_interval` ticks, and buys these handlers nothing.
//! - The producer is a plain thread outside the runtime and spawns through
//!   the runtime's [`Handle`]: `Runtime::spawn` is `Handle::spawn`, and
//!   `tokio::spawn` outside a worker needs the same handle entered. Both
//!   put the task on the global queue, as the runtime docs say for any
//!   spawn or wake from a non-worker thread.
//! - The hot path takes the map's read lock (`get`) and sends; only a key's
//!   first message takes the write lock (`entry`) and spawns.
//! - A sync handler is called straight from the task's receive loop, as a
//!   user calls a plain function; only the async handler (W3) is awaited.

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
                        if H::ASYNC {
                            h.call(key, m).await;
                        } else {
                            h.call_blocking(key, m);
                        }
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

    /// Closes every channel (each task's loop ends) and joins the workers;
    /// the harness calls this after the timed part.
    fn finish(self) {
        self.shared.map.clear();
        self.rt.shutdown_timeout(Duration::from_secs(10));
    }
}
