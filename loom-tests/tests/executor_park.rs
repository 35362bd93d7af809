#![cfg(loom)]
//! Loom model of the worker's park protocol against a submit: a message
//! submitted while the worker is on its way to park is never left in the
//! queue of a sleeping worker (no lost wake-up).
//!
//! ```text
//! RUSTFLAGS="--cfg loom -C debug_assertions" LOOM_MAX_PREEMPTIONS=2 \
//!     cargo test -p loom-tests --release --test executor_park
//! ```

mod common;

use common::{executor, model, scripted_receiver, Log, Msg, LONG};

/// One worker; the main thread submits a message while the worker is
/// anywhere between its start and its park, waits for it, then submits a
/// second one while the worker goes to park again after the first. Both
/// run: a lost wake-up leaves the main thread and the worker both asleep,
/// which loom reports as a deadlock.
#[test]
fn submit_vs_park() {
    model("submit_vs_park", || {
        let log = Log::new();
        let ex = executor(1, 16);
        let (_d, r) = scripted_receiver(&ex, &log, 4);
        assert_eq!(
            r.submit_blocking(0, Msg::now(1)).unwrap().wait().unwrap(),
            1
        );
        assert_eq!(
            r.submit_blocking(0, Msg::now(2)).unwrap().wait().unwrap(),
            2
        );
        assert!(ex.shutdown(LONG), "graceful stop drains and joins");
        assert!(ex.is_terminated());
        log.assert_serial();
        assert!(log.position(common::Event::End(1)) < log.position(common::Event::Start(2)));
    });
}
