//! The `Lanes` front-end's [`metrics`](https://docs.rs/metrics)
//! instrumentation, behind the `metrics` cargo feature: command outcomes,
//! `Busy` refusals, batch sizes and waits, per `Lanes` (label `lanes`).
//!
//! As in `trace.rs`, every hook is defined twice: with the feature it
//! records through handles registered when the `Lanes` is built; without
//! it, the types are zero-sized and the functions empty
//! `#[inline(always)]` ones. A lane transition counts its outcomes in a
//! [`LaneTally`] under the lane's lock and records them once the locks are
//! released.

#[cfg(feature = "metrics")]
mod imp {
    use std::time::{Duration, Instant};

    use metrics::{Counter, Histogram, Unit};

    use crate::lanes::BusyReason;

    fn describe() {
        use metrics::{describe_counter, describe_histogram};
        describe_counter!(
            "keyed_executor_lane_commands_total",
            "Lanes commands by outcome: ok, error, panicked, withdrawn, busy, closed"
        );
        describe_counter!(
            "keyed_executor_lane_busy_total",
            "Lanes commands refused as Busy, by reason: lane_full, in_flight_limit"
        );
        describe_histogram!(
            "keyed_executor_lane_batch_size",
            "Commands per batch given to the kernel"
        );
        describe_histogram!(
            "keyed_executor_lane_wait_seconds",
            Unit::Seconds,
            "Time a command waited in its lane before its batch started"
        );
    }

    // ----- Lanes -------------------------------------------------------------

    /// A `Lanes`' handles.
    pub(crate) struct LanesMetrics {
        ok: Counter,
        error: Counter,
        panicked: Counter,
        withdrawn: Counter,
        busy: Counter,
        closed: Counter,
        busy_lane_full: Counter,
        busy_limit: Counter,
        batch: Histogram,
        wait: Histogram,
    }

    impl LanesMetrics {
        pub(crate) fn new(name: &str) -> Self {
            describe();
            let n = || name.to_owned();
            let outcome = |o: &'static str| metrics::counter!("keyed_executor_lane_commands_total", "lanes" => n(), "outcome" => o);
            let busy = |r: &'static str| metrics::counter!("keyed_executor_lane_busy_total", "lanes" => n(), "reason" => r);
            LanesMetrics {
                ok: outcome("ok"),
                error: outcome("error"),
                panicked: outcome("panicked"),
                withdrawn: outcome("withdrawn"),
                busy: outcome("busy"),
                closed: outcome("closed"),
                busy_lane_full: busy("lane_full"),
                busy_limit: busy("in_flight_limit"),
                batch: metrics::histogram!("keyed_executor_lane_batch_size", "lanes" => n()),
                wait: metrics::histogram!("keyed_executor_lane_wait_seconds", "lanes" => n()),
            }
        }

        pub(crate) fn closed(&self) {
            self.closed.increment(1);
        }

        pub(crate) fn busy(&self, reason: BusyReason) {
            self.busy.increment(1);
            match reason {
                BusyReason::LaneFull => self.busy_lane_full.increment(1),
                BusyReason::InFlightLimit => self.busy_limit.increment(1),
            }
        }

        pub(crate) fn batch_started(&self, commands: usize) {
            self.batch.record(commands as f64);
        }

        /// What a lane transition counted (after the locks).
        pub(crate) fn settled(&self, tally: &LaneTally) {
            for (c, n) in [
                (&self.ok, tally.ok),
                (&self.error, tally.error),
                (&self.panicked, tally.panicked),
                (&self.withdrawn, tally.withdrawn),
            ] {
                if n > 0 {
                    c.increment(n);
                }
            }
            for w in &tally.waits {
                self.wait.record(w.as_secs_f64());
            }
        }
    }

    /// Outcomes and waits a lane transition produced, recorded by
    /// `LanesMetrics::settled` once the locks are released.
    #[derive(Default)]
    pub(crate) struct LaneTally {
        ok: u64,
        error: u64,
        panicked: u64,
        withdrawn: u64,
        waits: Vec<Duration>,
    }

    impl LaneTally {
        pub(crate) fn new() -> Self {
            Self::default()
        }

        #[inline]
        pub(crate) fn decided(&mut self, ok: bool) {
            if ok {
                self.ok += 1;
            } else {
                self.error += 1;
            }
        }

        #[inline]
        pub(crate) fn panicked(&mut self, n: usize) {
            self.panicked += n as u64;
        }

        #[inline]
        pub(crate) fn withdrawn(&mut self, n: usize) {
            self.withdrawn += n as u64;
        }

        /// A command entered at `entered` joined a batch at `now`.
        #[inline]
        pub(crate) fn waited(&mut self, entered: &LaneStamp, now: Instant) {
            self.waits.push(now.saturating_duration_since(entered.0));
        }
    }

    /// When a command entered its lane (the `Lanes`' clock).
    pub(crate) struct LaneStamp(Instant);

    impl LaneStamp {
        #[inline]
        pub(crate) fn new(now: Instant) -> Self {
            LaneStamp(now)
        }
    }
}

#[cfg(not(feature = "metrics"))]
mod imp {
    use std::time::Instant;

    use crate::lanes::BusyReason;

    /// Zero-sized without the `metrics` feature.
    pub(crate) struct LanesMetrics;

    impl LanesMetrics {
        #[inline(always)]
        pub(crate) fn new(_name: &str) -> Self {
            LanesMetrics
        }

        #[inline(always)]
        pub(crate) fn closed(&self) {}

        #[inline(always)]
        pub(crate) fn busy(&self, _reason: BusyReason) {}

        #[inline(always)]
        pub(crate) fn batch_started(&self, _commands: usize) {}

        #[inline(always)]
        pub(crate) fn settled(&self, _tally: &LaneTally) {}
    }

    /// Zero-sized without the `metrics` feature.
    pub(crate) struct LaneTally;

    impl LaneTally {
        #[inline(always)]
        pub(crate) fn new() -> Self {
            LaneTally
        }

        #[inline(always)]
        pub(crate) fn decided(&mut self, _ok: bool) {}

        #[inline(always)]
        pub(crate) fn panicked(&mut self, _n: usize) {}

        #[inline(always)]
        pub(crate) fn withdrawn(&mut self, _n: usize) {}

        #[inline(always)]
        pub(crate) fn waited(&mut self, _entered: &LaneStamp, _now: Instant) {}
    }

    /// Zero-sized without the `metrics` feature.
    pub(crate) struct LaneStamp;

    impl LaneStamp {
        #[inline(always)]
        pub(crate) fn new(_now: Instant) -> Self {
            LaneStamp
        }
    }
}

pub(crate) use imp::*;
