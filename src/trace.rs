//! Optional [`tracing`](https://docs.rs/tracing) instrumentation, behind the
//! `tracing` cargo feature.
//!
//! Every hook the rest of the crate calls is defined twice: with the feature,
//! it creates a span or emits an event; without it, it is an empty
//! `#[inline(always)]` function, a zero-sized type or a type alias to the
//! uninstrumented type, so the default build carries no field, no branch and
//! no call for it. Call sites stay one line each and carry no `cfg`.
//!
//! What is emitted (all under the target `keyed_executor`):
//!
//! | what | level | where |
//! |---|---|---|
//! | span `message` (fields `dispatcher`, `key_hash`, `worker`) around a message's handler call and every poll of its future | DEBUG | mailbox |
//! | a handler (or its future) panicked (fields `dispatcher`, `worker`, `panic`) | WARN | dispatcher |
//! | a step ran longer than the `slow_step` threshold (fields `dispatcher`, `key_hash`, `worker`, `running_for`, `finished`) | WARN | observe |
//! | a spawned future panicked | WARN | spawn |
//! | a queued message handed back by a force stop (fields `dispatcher`, `has_completion`) | DEBUG | dispatcher |
//! | a message dead-lettered by a retrying handler (fields `attempts`, `position`, `error`) | WARN | handler |
//! | a force stop finished: how many messages it handed back, futures it cancelled | INFO | executor |
//! | a graceful shutdown timed out, or took more than half its timeout | WARN | executor |
//! | a graceful shutdown finished | DEBUG | executor |
//! | a [`LanesEvent`](crate::lanes::LanesEvent) without an `on_event` hook | WARN (instead of standard error) | lanes |

#[cfg(feature = "tracing")]
mod imp {
    use std::fmt::Display;
    use std::time::Duration;

    use crate::error::Panic;

    /// The span of one message, created when it starts.
    pub(crate) struct MessageSpan(tracing::Span);

    impl MessageSpan {
        #[inline]
        pub(crate) fn new(dispatcher: &str, key_hash: u64, worker: usize) -> Self {
            MessageSpan(tracing::debug_span!(
                target: "keyed_executor",
                "message",
                dispatcher,
                key_hash,
                worker
            ))
        }

        /// Enters the span until the guard is dropped.
        #[inline]
        pub(crate) fn enter(&self) -> tracing::span::Entered<'_> {
            self.0.enter()
        }
    }

    /// A message's future, polled (and dropped) inside its span.
    pub(crate) type Instrumented<F> = tracing::instrument::Instrumented<F>;

    /// Attaches `span` to `future`: every poll of it enters the span.
    #[inline]
    pub(crate) fn instrument<F>(future: F, span: MessageSpan) -> Instrumented<F> {
        tracing::Instrument::instrument(future, span.0)
    }

    /// Runs `f` on the future inside `future`, in its span (a poll through
    /// the handler's `poll_outcome`).
    #[inline]
    pub(crate) fn in_span<F, R>(
        future: std::pin::Pin<&mut Instrumented<F>>,
        f: impl FnOnce(std::pin::Pin<&mut F>) -> R,
    ) -> R {
        let span = future.span().clone();
        let _entered = span.enter();
        f(future.inner_pin_mut())
    }

    #[cold]
    pub(crate) fn dead_lettered(attempts: u32, position: u64, error: &dyn Display) {
        tracing::warn!(
            target: "keyed_executor",
            attempts,
            position,
            error = %error,
            "message dead-lettered"
        );
    }

    #[cold]
    pub(crate) fn handler_panicked(dispatcher: &str, worker: usize, panic: &Panic) {
        tracing::warn!(
            target: "keyed_executor",
            dispatcher,
            worker,
            panic = panic.message(),
            "handler panicked"
        );
    }

    #[cold]
    pub(crate) fn slow_step(
        dispatcher: &str,
        key_hash: u64,
        worker: usize,
        running_for: Duration,
        finished: bool,
    ) {
        tracing::warn!(
            target: "keyed_executor",
            dispatcher,
            key_hash,
            worker,
            ?running_for,
            finished,
            "slow step: a handler step ran longer than the slow_step threshold"
        );
    }

    #[cold]
    pub(crate) fn spawned_panicked(panic: &Panic) {
        tracing::warn!(target: "keyed_executor", panic = panic.message(), "spawned future panicked");
    }

    #[cold]
    pub(crate) fn message_rejected(dispatcher: &str, has_completion: bool) {
        tracing::debug!(
            target: "keyed_executor",
            dispatcher,
            has_completion,
            "queued message handed back by a force stop"
        );
    }

    #[cold]
    pub(crate) fn force_stopped(rejected: usize, cancelled_spawned: usize) {
        tracing::info!(
            target: "keyed_executor",
            rejected,
            cancelled_spawned,
            "force stop: queued messages handed back, spawned futures cancelled"
        );
    }

    #[cold]
    pub(crate) fn shutdown_finished(elapsed: Duration, timeout: Duration) {
        if elapsed > timeout / 2 {
            tracing::warn!(
                target: "keyed_executor",
                ?elapsed,
                ?timeout,
                "graceful shutdown was slow: it took more than half its timeout"
            );
        } else {
            tracing::debug!(target: "keyed_executor", ?elapsed, "graceful shutdown finished");
        }
    }

    #[cold]
    pub(crate) fn shutdown_timed_out(
        timeout: Duration,
        live_mailboxes: usize,
        live_spawned: usize,
    ) {
        tracing::warn!(
            target: "keyed_executor",
            ?timeout,
            live_mailboxes,
            live_spawned,
            "graceful shutdown timed out; the drain goes on in the background"
        );
    }

    #[cold]
    pub(crate) fn lanes_event(event: &dyn Display) {
        tracing::warn!(target: "keyed_executor::lanes", "{event}");
    }

    /// Whether the shutdown hooks need the live counts (they cost a lock).
    #[inline]
    pub(crate) fn wants_shutdown_details() -> bool {
        tracing::enabled!(target: "keyed_executor", tracing::Level::WARN)
    }
}

#[cfg(not(feature = "tracing"))]
mod imp {
    use std::fmt::Display;
    use std::time::Duration;

    use crate::error::Panic;

    /// Zero-sized without the `tracing` feature.
    pub(crate) struct MessageSpan;

    /// Zero-sized without the `tracing` feature.
    pub(crate) struct Entered;

    impl MessageSpan {
        #[inline(always)]
        pub(crate) fn new(_dispatcher: &str, _key_hash: u64, _worker: usize) -> Self {
            MessageSpan
        }

        #[inline(always)]
        pub(crate) fn enter(&self) -> Entered {
            Entered
        }
    }

    /// The future itself without the `tracing` feature.
    pub(crate) type Instrumented<F> = F;

    #[inline(always)]
    pub(crate) fn instrument<F>(future: F, _span: MessageSpan) -> Instrumented<F> {
        future
    }

    #[inline(always)]
    pub(crate) fn in_span<F, R>(
        future: std::pin::Pin<&mut Instrumented<F>>,
        f: impl FnOnce(std::pin::Pin<&mut F>) -> R,
    ) -> R {
        f(future)
    }

    #[inline(always)]
    pub(crate) fn dead_lettered(_attempts: u32, _position: u64, _error: &dyn std::fmt::Display) {}

    #[inline(always)]
    pub(crate) fn handler_panicked(_dispatcher: &str, _worker: usize, _panic: &Panic) {}

    #[inline(always)]
    pub(crate) fn slow_step(
        _dispatcher: &str,
        _key_hash: u64,
        _worker: usize,
        _running_for: Duration,
        _finished: bool,
    ) {
    }

    #[inline(always)]
    pub(crate) fn spawned_panicked(_panic: &Panic) {}

    #[inline(always)]
    pub(crate) fn message_rejected(_dispatcher: &str, _has_completion: bool) {}

    #[inline(always)]
    pub(crate) fn force_stopped(_rejected: usize, _cancelled_spawned: usize) {}

    #[inline(always)]
    pub(crate) fn shutdown_finished(_elapsed: Duration, _timeout: Duration) {}

    #[inline(always)]
    pub(crate) fn shutdown_timed_out(
        _timeout: Duration,
        _live_mailboxes: usize,
        _live_spawned: usize,
    ) {
    }

    /// Without the `tracing` feature, Lanes events go to standard error.
    #[cold]
    pub(crate) fn lanes_event(event: &dyn Display) {
        eprintln!("keyed-executor lanes: {event}");
    }

    #[inline(always)]
    pub(crate) fn wants_shutdown_details() -> bool {
        false
    }
}

pub(crate) use imp::*;
