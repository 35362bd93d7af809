//! The time a [`Lanes`](super::Lanes) reads: deadlines, the close timeout and
//! the drain-rate estimate. Injectable so tests decide when a deadline has
//! passed instead of sleeping.

use std::fmt;
use std::time::{Duration, Instant};

use crate::sync::atomic::{AtomicU64, Ordering};
use crate::sync::Arc;

/// A monotonic clock.
///
/// `now` is called outside every lock of the crate, so an implementation may
/// take its own locks. It must not panic (a panic there escapes to whichever
/// caller was reading the time, possibly mid-way through finishing a batch).
pub trait Clock: Send + Sync + 'static {
    /// The current instant.
    fn now(&self) -> Instant;
}

/// [`Instant::now`]: the default.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// A clock that moves only when told to, for tests. Clones share the time.
///
/// ```
/// use keyed_executor::lanes::{Clock, ManualClock};
/// use std::time::Duration;
///
/// let clock = ManualClock::new();
/// let t0 = clock.now();
/// clock.advance(Duration::from_secs(3));
/// assert_eq!(clock.now() - t0, Duration::from_secs(3));
/// ```
#[derive(Clone)]
pub struct ManualClock {
    inner: Arc<ManualInner>,
}

struct ManualInner {
    base: Instant,
    offset_nanos: AtomicU64,
}

impl ManualClock {
    /// A clock standing at the moment of creation.
    pub fn new() -> Self {
        ManualClock {
            inner: Arc::new(ManualInner {
                base: Instant::now(),
                offset_nanos: AtomicU64::new(0),
            }),
        }
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        let nanos = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        self.inner.offset_nanos.fetch_add(nanos, Ordering::SeqCst);
    }
}

impl Default for ManualClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Instant {
        // A read-modify-write rather than a load: loom models SeqCst loads
        // loosely, and the value is the same.
        let nanos = self.inner.offset_nanos.fetch_add(0, Ordering::SeqCst);
        self.inner.base + Duration::from_nanos(nanos)
    }
}

impl fmt::Debug for ManualClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let nanos = self.inner.offset_nanos.fetch_add(0, Ordering::SeqCst);
        f.debug_struct("ManualClock")
            .field("elapsed", &Duration::from_nanos(nanos))
            .finish()
    }
}
