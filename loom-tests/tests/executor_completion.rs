#![cfg(loom)]
//! Loom models of the completion handle: the worker setting the outcome
//! races a blocking `wait`, an `.await`, a poll followed by a drop, and a
//! plain drop of the handle. The value is delivered exactly once (to the
//! handle, or dropped by the completing side when the handle is gone) and
//! nothing leaks: the output carries a loom `Arc` token, so an output kept
//! alive by nobody fails the model, as does a leaked slot or mailbox.
//!
//! ```text
//! RUSTFLAGS="--cfg loom -C debug_assertions" LOOM_MAX_PREEMPTIONS=2 \
//!     cargo test -p loom-tests --release --test executor_completion
//! ```

mod common;

use std::future::Future;
use std::pin::pin;
use std::sync::atomic::{AtomicUsize as StdCounter, Ordering::Relaxed};
use std::task::{Context, Poll, Waker};

use common::{assert_all_seen, executor, model, Fixed, LONG};
use keyed_executor::{handler, Completion, Dispatcher, KeyedExecutor};
use loom::future::block_on;

/// A handler output that counts its drops and holds a loom `Arc` token.
struct Out {
    id: u32,
    drops: std::sync::Arc<StdCounter>,
    _token: loom::sync::Arc<()>,
}

impl Drop for Out {
    fn drop(&mut self) {
        self.drops.fetch_add(1, Relaxed);
    }
}

type D = Dispatcher<u8, u32, Out>;

fn setup() -> (KeyedExecutor, D, std::sync::Arc<StdCounter>) {
    let drops = std::sync::Arc::new(StdCounter::new(0));
    let d2 = drops.clone();
    let ex = executor(1, 16);
    let d = ex
        .dispatcher_builder(handler::from_fn(move |_: &u8, id: u32| Out {
            id,
            drops: d2.clone(),
            _token: loom::sync::Arc::new(()),
        }))
        .hasher(Fixed::default())
        .build();
    (ex, d, drops)
}

fn submit(d: &D, id: u32) -> Completion<Out, u32> {
    d.receiver(1).unwrap().submit_blocking(0, id).unwrap()
}

/// `wait()` on the main thread races the worker completing.
#[test]
fn completion_vs_wait() {
    model("completion_vs_wait", || {
        let (ex, d, drops) = setup();
        let out = submit(&d, 1).wait().unwrap();
        assert_eq!(out.id, 1);
        assert_eq!(drops.load(Relaxed), 0, "delivered, not dropped");
        drop(out);
        assert!(ex.shutdown(LONG));
        assert_eq!(drops.load(Relaxed), 1);
    });
}

/// `.await` (loom's `block_on`) races the worker completing.
#[test]
fn completion_vs_await() {
    model("completion_vs_await", || {
        let (ex, d, drops) = setup();
        let done = submit(&d, 1);
        assert!(!done.is_terminated());
        let out = block_on(done).unwrap();
        assert_eq!(out.id, 1);
        drop(out);
        assert!(ex.shutdown(LONG));
        assert_eq!(drops.load(Relaxed), 1);
    });
}

/// The handle is polled once (registering a waker, or getting the value)
/// and then dropped, racing the worker completing; or dropped without a
/// poll. Either the handle got the value or the worker dropped it: once.
#[test]
fn completion_vs_poll_and_drop() {
    model("completion_vs_poll_and_drop", || {
        let (ex, d, drops) = setup();
        let mut done = submit(&d, 1);
        let got = match pin!(&mut done).poll(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(out) => {
                assert_eq!(out.unwrap().id, 1);
                assert_eq!(drops.load(Relaxed), 1);
                assert!(done.is_terminated(), "fused after its value");
                true
            }
            Poll::Pending => false,
        };
        drop(done);
        let unpolled = submit(&d, 2);
        drop(unpolled);
        assert!(ex.shutdown(LONG));
        assert_eq!(drops.load(Relaxed), 2, "each output dropped exactly once");
        POLLED[usize::from(got)].fetch_add(1, Relaxed);
    });
    assert_all_seen(
        "completion_vs_poll_and_drop",
        &[
            ("dropped while pending", &POLLED[0]),
            ("value taken by the poll", &POLLED[1]),
        ],
    );
}

static POLLED: [StdCounter; 2] = [StdCounter::new(0), StdCounter::new(0)];
