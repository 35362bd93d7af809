//! `inline`: the producer's own thread calls the handler directly — the
//! per-core limit, with no queue and no hand-off.
//!
//! A handler that sends (W4) would recurse, so a send made while a handler
//! runs is queued and run after it (a trampoline). The design is used from
//! one thread only; the queue is behind a `Mutex` only to stay `Sync`, and
//! the common path (no handler running) touches neither lock nor RMW.
//!
//! Each extra source ([`Design::source`], W7's producer threads) gets its
//! own trampoline around the shared handler, so every producer thread runs
//! its own messages: P threads calling the handler directly. That is correct
//! only because W7's producers own disjoint keys.

use crate::common::design::{Cfg, Design, Family, Handler, SendTo};
use crate::common::work::Msg;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

/// See the module docs.
pub struct InlineFamily;

impl Family for InlineFamily {
    type D<H: Handler> = Inline<H>;
    const SAME_THREAD: bool = true;
    const BLOCKS_ON_IO: bool = true;
}

struct Core<H> {
    handler: Arc<H>,
    running: AtomicBool,
    queued: AtomicBool,
    pending: Mutex<VecDeque<(u64, Msg)>>,
}

impl<H> Core<H> {
    fn new(handler: Arc<H>) -> Self {
        Core {
            handler,
            running: AtomicBool::new(false),
            queued: AtomicBool::new(false),
            pending: Mutex::new(VecDeque::new()),
        }
    }
}

/// The inline design.
pub struct Inline<H>(Arc<Core<H>>);

/// Its sender: runs the handler right here.
pub struct InlineSender<H>(Arc<Core<H>>);

impl<H> Clone for InlineSender<H> {
    fn clone(&self) -> Self {
        InlineSender(self.0.clone())
    }
}

impl<H: Handler> SendTo for InlineSender<H> {
    #[inline]
    fn send(&self, key: u64, msg: Msg) {
        let core = &*self.0;
        // One thread only: a plain load and store, no read-modify-write.
        if core.running.load(Relaxed) {
            core.pending.lock().unwrap().push_back((key, msg));
            core.queued.store(true, Relaxed);
            return;
        }
        core.running.store(true, Relaxed);
        core.handler.call_blocking(key, msg);
        while core.queued.load(Relaxed) {
            let next = {
                let mut pending = core.pending.lock().unwrap();
                let next = pending.pop_front();
                if pending.is_empty() {
                    core.queued.store(false, Relaxed);
                }
                next
            };
            if let Some((k, m)) = next {
                core.handler.call_blocking(k, m);
            }
        }
        core.running.store(false, Relaxed);
    }
}

impl<H: Handler> Design<H> for Inline<H> {
    type Sender = InlineSender<H>;

    fn start(_cfg: &Cfg, handler: H) -> Self {
        Inline(Arc::new(Core::new(Arc::new(handler))))
    }

    fn sender(&self) -> InlineSender<H> {
        InlineSender(self.0.clone())
    }

    fn source(&self) -> InlineSender<H> {
        InlineSender(Arc::new(Core::new(self.0.handler.clone())))
    }

    fn finish(self) {}
}
