//! The node-wide bound on commands in flight, and the drain-rate estimate
//! behind every `Busy { retry_after }` hint.
//!
//! An [`InFlightLimit`] is a counter shared (by cloning the handle) by every
//! [`Lanes`](crate::lanes::Lanes) of a node. A command takes one unit when it
//! enters a lane and gives it back when it finishes (its result is delivered,
//! it is withdrawn, or its caller went away). Past the limit a command is
//! refused at once as [`Busy`](crate::lanes::LaneError::Busy): a store that
//! slows down (rather than fails) turns the commands beyond it into refusals
//! with a retry hint instead of an unbounded queue spread over many lanes.
//!
//! # The `retry_after` formula
//!
//! Every finished batch records how many commands it finished. The drain rate
//! `r` (commands per second) is measured over windows of at least
//! [`DRAIN_WINDOW`] (100 ms) and smoothed: when a window closes after `t`
//! seconds having seen `n` commands finish, `r = n / t` for the first window
//! and `r = (r + n / t) / 2` afterwards. Before the first window closes, the
//! partial window's `n / t` is used if anything finished. Then
//!
//! ```text
//! retry_after = clamp(backlog / r, MIN_RETRY_AFTER, MAX_RETRY_AFTER)
//! ```
//!
//! where `backlog` is the work that must drain before a retry can get in: the
//! commands in flight on the node for the limit, the commands waiting in the
//! lane for a full lane. A rate of zero (a whole window passed with nothing
//! finished: the store is stuck) gives [`MAX_RETRY_AFTER`]; no observation at
//! all yet gives [`DEFAULT_RETRY_AFTER`].
//!
//! # Zero
//!
//! [`InFlightLimit::new`] never panics: a limit of 0 is stored as given and
//! refused by [`LanesBuilder::build`](crate::lanes::LanesBuilder::build) with
//! [`ConfigError::ZeroInFlightLimit`]. [`InFlightLimit::try_new`] refuses it
//! at once instead.

use std::fmt;
use std::time::{Duration, Instant};

use crate::error::ConfigError;
use crate::sync::atomic::{AtomicUsize, Ordering};
use crate::sync::{Arc, Mutex};

/// The limit a [`Lanes`](crate::lanes::Lanes) gets when none is given: its
/// own, not shared.
pub const DEFAULT_IN_FLIGHT_LIMIT: usize = 10_000;

/// The shortest window over which the drain rate is measured.
pub const DRAIN_WINDOW: Duration = Duration::from_millis(100);

/// The smallest `retry_after` ever suggested.
pub const MIN_RETRY_AFTER: Duration = Duration::from_millis(1);

/// The largest `retry_after` ever suggested (also the hint when nothing
/// drained during a whole window).
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(10);

/// The hint before any drain has been observed.
pub const DEFAULT_RETRY_AFTER: Duration = Duration::from_millis(100);

/// A bound on the commands in flight on a node, shared by every
/// [`Lanes`](crate::lanes::Lanes) given a clone of it.
///
/// Cloning is cheap and every clone counts against the same bound.
///
/// ```
/// use keyed_executor::limit::InFlightLimit;
///
/// let limit = InFlightLimit::new(10_000);
/// let same = limit.clone(); // give one to every `Lanes` of the node
/// assert_eq!(same.max(), 10_000);
/// assert_eq!(limit.in_flight(), 0);
///
/// // A limit of zero is refused, never a panic:
/// assert!(InFlightLimit::try_new(0).is_err());
/// ```
#[derive(Clone)]
pub struct InFlightLimit {
    inner: Arc<LimitInner>,
}

struct LimitInner {
    max: usize,
    in_flight: AtomicUsize,
    drain: Mutex<DrainRate>,
}

impl InFlightLimit {
    /// A limit of `max` commands in flight.
    ///
    /// Never panics: `max == 0` is kept and refused later by
    /// [`LanesBuilder::build`](crate::lanes::LanesBuilder::build) with
    /// [`ConfigError::ZeroInFlightLimit`]. Use [`try_new`](Self::try_new) to
    /// refuse it here.
    pub fn new(max: usize) -> Self {
        InFlightLimit {
            inner: Arc::new(LimitInner {
                max,
                in_flight: AtomicUsize::new(0),
                drain: Mutex::new(DrainRate::new()),
            }),
        }
    }

    /// A limit of `max` commands in flight, or
    /// [`ConfigError::ZeroInFlightLimit`] for 0.
    pub fn try_new(max: usize) -> Result<Self, ConfigError> {
        if max == 0 {
            Err(ConfigError::ZeroInFlightLimit)
        } else {
            Ok(Self::new(max))
        }
    }

    /// The bound.
    pub fn max(&self) -> usize {
        self.inner.max
    }

    /// The commands counted now, over every `Lanes` sharing this limit.
    pub fn in_flight(&self) -> usize {
        self.inner.in_flight.load(Ordering::SeqCst)
    }

    /// Whether two handles count against the same bound.
    pub fn same_as(&self, other: &InFlightLimit) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// Takes one unit if one is free.
    pub(crate) fn try_acquire(&self) -> bool {
        let max = self.inner.max;
        self.inner
            .in_flight
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                if n < max {
                    Some(n + 1)
                } else {
                    None
                }
            })
            .is_ok()
    }

    /// Gives back `n` units (no drain is recorded: see
    /// [`record_drain`](Self::record_drain)).
    pub(crate) fn release(&self, n: usize) {
        if n > 0 {
            let prev = self.inner.in_flight.fetch_sub(n, Ordering::SeqCst);
            debug_assert!(prev >= n, "in-flight limit released more than taken");
        }
    }

    /// Records that `n` commands finished at `now` (feeds the drain rate).
    pub(crate) fn record_drain(&self, now: Instant, n: usize) {
        if n > 0 {
            self.inner.drain.lock().record(now, n);
        }
    }

    /// The hint for a command refused by this limit at `now`.
    pub(crate) fn retry_after(&self, now: Instant) -> Duration {
        let backlog = self.in_flight();
        self.inner.drain.lock().retry_after(now, backlog)
    }
}

impl fmt::Debug for InFlightLimit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("InFlightLimit")
            .field("max", &self.max())
            .field("in_flight", &self.in_flight())
            .finish()
    }
}

/// A windowed, smoothed estimate of how fast commands finish (see the module
/// docs for the formula). Not synchronized: its owner locks it.
#[derive(Debug)]
pub(crate) struct DrainRate {
    window_start: Option<Instant>,
    window_count: u64,
    /// Commands per second, smoothed over the closed windows.
    rate: Option<f64>,
}

impl DrainRate {
    pub(crate) const fn new() -> Self {
        DrainRate {
            window_start: None,
            window_count: 0,
            rate: None,
        }
    }

    /// Closes the current window if it is at least [`DRAIN_WINDOW`] old.
    fn roll(&mut self, now: Instant) -> Duration {
        let start = *self.window_start.get_or_insert(now);
        let elapsed = now.saturating_duration_since(start);
        if elapsed >= DRAIN_WINDOW {
            let observed = self.window_count as f64 / elapsed.as_secs_f64();
            self.rate = Some(match self.rate {
                Some(r) => (r + observed) / 2.0,
                None => observed,
            });
            self.window_start = Some(now);
            self.window_count = 0;
            Duration::ZERO
        } else {
            elapsed
        }
    }

    /// `n` commands finished at `now`.
    pub(crate) fn record(&mut self, now: Instant, n: usize) {
        self.roll(now);
        self.window_count += n as u64;
    }

    /// Commands per second, if anything has been observed.
    pub(crate) fn rate(&mut self, now: Instant) -> Option<f64> {
        let elapsed = self.roll(now);
        match self.rate {
            Some(r) => Some(r),
            None if self.window_count > 0 => {
                let secs = elapsed.max(Duration::from_micros(100)).as_secs_f64();
                Some(self.window_count as f64 / secs)
            }
            None => None,
        }
    }

    /// `clamp(backlog / rate, MIN_RETRY_AFTER, MAX_RETRY_AFTER)`.
    pub(crate) fn retry_after(&mut self, now: Instant, backlog: usize) -> Duration {
        match self.rate(now) {
            None => DEFAULT_RETRY_AFTER,
            Some(r) if r <= 0.0 => MAX_RETRY_AFTER,
            Some(r) => {
                let secs = backlog.max(1) as f64 / r;
                if secs >= MAX_RETRY_AFTER.as_secs_f64() {
                    MAX_RETRY_AFTER
                } else {
                    Duration::from_secs_f64(secs).max(MIN_RETRY_AFTER)
                }
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn zero_is_refused_not_a_panic() {
        assert_eq!(
            InFlightLimit::try_new(0).unwrap_err(),
            ConfigError::ZeroInFlightLimit
        );
        let zero = InFlightLimit::new(0);
        assert_eq!(zero.max(), 0);
        assert!(!zero.try_acquire());
    }

    #[test]
    fn acquire_and_release_count_across_clones() {
        let a = InFlightLimit::new(2);
        let b = a.clone();
        assert!(a.same_as(&b));
        assert!(a.try_acquire());
        assert!(b.try_acquire());
        assert!(!a.try_acquire());
        assert_eq!(b.in_flight(), 2);
        a.release(1);
        assert!(b.try_acquire());
        b.release(2);
        assert_eq!(a.in_flight(), 0);
        assert!(!a.same_as(&InFlightLimit::new(2)));
    }

    #[test]
    fn retry_after_follows_the_drain_rate() {
        let t0 = Instant::now();
        let mut d = DrainRate::new();
        assert_eq!(d.retry_after(t0, 10), DEFAULT_RETRY_AFTER);
        // 100 commands in the first 100 ms: 1000/s.
        d.record(t0, 0);
        d.record(t0 + Duration::from_millis(50), 100);
        let now = t0 + Duration::from_millis(100);
        assert_eq!(d.rate(now), Some(1000.0));
        // 500 waiting at 1000/s: half a second.
        assert_eq!(d.retry_after(now, 500), Duration::from_millis(500));
        // Next window 3000/s: smoothed to 2000/s.
        d.record(now + Duration::from_millis(10), 300);
        let later = now + Duration::from_millis(100);
        assert_eq!(d.rate(later), Some(2000.0));
        assert_eq!(
            d.retry_after(later, 0),
            Duration::from_micros(500).max(MIN_RETRY_AFTER)
        );
    }

    #[test]
    fn a_stuck_store_gives_the_longest_hint() {
        let t0 = Instant::now();
        let mut d = DrainRate::new();
        d.record(t0, 0);
        assert_eq!(d.retry_after(t0 + DRAIN_WINDOW, 5), MAX_RETRY_AFTER);
    }

    #[test]
    fn partial_window_is_used_before_the_first_closes() {
        let t0 = Instant::now();
        let mut d = DrainRate::new();
        d.record(t0, 0);
        d.record(t0 + Duration::from_millis(10), 10);
        // 10 in 10 ms = 1000/s; 100 waiting -> 100 ms.
        assert_eq!(
            d.retry_after(t0 + Duration::from_millis(10), 100),
            Duration::from_millis(100)
        );
    }
}
