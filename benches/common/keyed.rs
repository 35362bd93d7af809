//! `keyed-executor`: the crate under test, through its public API.

use crate::common::design::{Cfg, Design, Family, Handler, SendTo};
use crate::common::work::Msg;
use keyed_executor::{handler, KeyedExecutor, Receiver};
// Same hash as the tokio/smol peers' DashMaps (the crate's default is SipHash).
use rustc_hash::FxBuildHasher;
use std::any::Any;
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

/// See the module docs.
pub struct KeyedFamily;

impl Family for KeyedFamily {
    type D<H: Handler> = Keyed<H>;
}

/// The crate: one executor, one dispatcher, one receiver.
pub struct Keyed<H> {
    executor: KeyedExecutor,
    // Kept alive for the run; its type names the handler closure, so it is
    // held as `dyn Any`.
    _dispatcher: Box<dyn Any + Send>,
    receiver: Receiver<u64, Msg, ()>,
    _handler: PhantomData<fn(H)>,
}

/// Its sender: the receiver's fire-and-forget `send` (blocks while the
/// receiver has no credit).
#[derive(Clone)]
pub struct KeyedSender(Receiver<u64, Msg, ()>);

impl SendTo for KeyedSender {
    #[inline]
    fn send(&self, key: u64, msg: Msg) {
        if self.0.send(key, msg).is_err() {
            panic!("keyed-executor: message refused (executor closed)");
        }
    }
}

impl<H: Handler> Design<H> for Keyed<H> {
    type Sender = KeyedSender;

    fn start(cfg: &Cfg, work: H) -> Self {
        let executor = KeyedExecutor::builder()
            .workers(cfg.workers)
            .throughput(16)
            .spin(cfg.spin)
            .build()
            .expect("keyed-executor config");
        let work = Arc::new(work);
        let (dispatcher, receiver): (Box<dyn Any + Send>, _) = if H::ASYNC {
            let d = executor
                .dispatcher_builder(handler::from_async_fn(move |key: u64, msg: Msg| {
                    work.call(key, msg)
                }))
                .hasher(FxBuildHasher)
                .build();
            let r = d.receiver(cfg.credit).expect("receiver");
            (Box::new(d), r)
        } else {
            let d = executor
                .dispatcher_builder(handler::from_fn(move |key: &u64, msg: Msg| {
                    work.call_blocking(*key, msg)
                }))
                .hasher(FxBuildHasher)
                .build();
            let r = d.receiver(cfg.credit).expect("receiver");
            (Box::new(d), r)
        };
        Keyed {
            executor,
            _dispatcher: dispatcher,
            receiver,
            _handler: PhantomData,
        }
    }

    fn sender(&self) -> KeyedSender {
        KeyedSender(self.receiver.clone())
    }

    fn finish(self) {
        let Keyed {
            executor, receiver, ..
        } = self;
        drop(receiver);
        assert!(
            executor.shutdown(Duration::from_secs(10)),
            "keyed-executor: shutdown did not drain in 10 s"
        );
    }
}
