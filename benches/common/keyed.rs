//! `keyed-executor`: the crate under test, through its public API, written
//! the way a user would write it: the builder, the dispatcher's **default
//! hasher** (no `.hasher(..)` tuning), one receiver per source.

use crate::common::design::{Cfg, Design, Family, Handler, SendTo};
use crate::common::work::Msg;
use keyed_executor::{handler, Dispatcher, KeyedExecutor, Receiver};
use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

/// See the module docs.
pub struct KeyedFamily;

impl Family for KeyedFamily {
    type D<H: Handler> = Keyed<H>;
}

/// The crate: one executor, one dispatcher, one receiver (plus one more
/// receiver per extra source, see [`Design::source`]).
pub struct Keyed<H> {
    executor: KeyedExecutor,
    // Typed by key, message and output only (not by the handler closure), so
    // it can hand out fresh receivers.
    dispatcher: Dispatcher<u64, Msg, ()>,
    receiver: Receiver<u64, Msg, ()>,
    /// `max_in_flight` of each receiver.
    credit: usize,
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

    fn send_batch(&self, batch: Vec<(u64, Msg)>) {
        send_poll(&self.0, batch);
    }
}

/// W1b: hands one poll of a batched source (a Kafka / Redis consumer's
/// `poll()`) to the crate in one call: fire-and-forget, blocking for
/// credit, the whole batch in order.
pub fn send_poll(receiver: &Receiver<u64, Msg, ()>, poll: Vec<(u64, Msg)>) {
    if receiver.send_batch(poll).is_err() {
        panic!("keyed-executor: batch refused (executor closed)");
    }
}

impl<H: Handler> Design<H> for Keyed<H> {
    type Sender = KeyedSender;

    fn start(cfg: &Cfg, work: H) -> Self {
        let executor = KeyedExecutor::builder()
            .workers(cfg.workers)
            .throughput(16)
            .spin(cfg.spin)
            // `KEYED_BENCH_NO_WC=1`: work conservation off (diagnostic).
            .work_conservation(std::env::var_os("KEYED_BENCH_NO_WC").is_none())
            .build()
            .expect("keyed-executor config");
        let work = Arc::new(work);
        // The crate's default hasher, as a user who does not tune it gets.
        let dispatcher: Dispatcher<u64, Msg, ()> = if H::ASYNC {
            executor.dispatcher(handler::from_async_fn(move |key: u64, msg: Msg| {
                work.call(key, msg)
            }))
        } else {
            executor.dispatcher(handler::from_fn(move |key: &u64, msg: Msg| {
                work.call_blocking(*key, msg)
            }))
        };
        let receiver = dispatcher.receiver(cfg.credit).expect("receiver");
        Keyed {
            executor,
            dispatcher,
            receiver,
            credit: cfg.credit,
            _handler: PhantomData,
        }
    }

    fn sender(&self) -> KeyedSender {
        KeyedSender(self.receiver.clone())
    }

    /// A fresh receiver of the same dispatcher: a source with its own credit,
    /// as a partitioned consumer gives each partition.
    fn source(&self) -> KeyedSender {
        KeyedSender(self.dispatcher.receiver(self.credit).expect("receiver"))
    }

    /// What a user writes for a handler that sends to its own dispatcher:
    /// a `WeakReceiver`, upgraded for each send (a strong receiver inside
    /// the handler would keep the dispatcher alive for ever).
    fn handler_sender(&self) -> Box<dyn Fn(u64, Msg) + Send + Sync> {
        let weak = self.receiver.downgrade();
        Box::new(move |k, m| {
            let receiver = weak.upgrade().expect("keyed-executor: dispatcher gone");
            if receiver.send(k, m).is_err() {
                panic!("keyed-executor: message refused (executor closed)");
            }
        })
    }

    fn finish(self) {
        let Keyed {
            executor,
            dispatcher,
            receiver,
            ..
        } = self;
        drop(receiver);
        // `KEYED_BENCH_STATS=1`: the workers' park/wake counters, to see
        // how often a run blocks (diagnostic; off by default).
        if std::env::var_os("KEYED_BENCH_STATS").is_some() {
            let stats = executor.stats();
            let sum = |f: fn(&keyed_executor::WorkerStats) -> u64| -> u64 {
                stats.workers.iter().map(f).sum()
            };
            let per: Vec<u64> = stats.workers.iter().map(|w| w.done).collect();
            let beside: Vec<(u64, u128)> = stats
                .workers
                .iter()
                .map(|w| (w.parked_beside_work, w.idle_beside_work.as_millis()))
                .collect();
            eprintln!(
                "keyed-executor stats: done {} per worker {per:?} parks {} unparks {} spin_hits {} stolen {} parked beside work (count, ms) {beside:?}",
                stats.done,
                sum(|w| w.parks),
                sum(|w| w.unparks),
                sum(|w| w.spin_hits),
                sum(|w| w.stolen)
            );
        }
        assert!(
            executor.shutdown(Duration::from_secs(10)),
            "keyed-executor: shutdown did not drain in 10 s"
        );
        drop(dispatcher);
    }
}
