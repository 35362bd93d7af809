//! Retry policies: how many attempts a failing message gets, how long it
//! waits between them, and which failures are worth another attempt.
//!
//! A [`RetryPolicy`] is pure computation. Given the attempt that failed and
//! how it failed ([`Failure`]: an error value or a panic), it says whether
//! to try again ([`RetryPolicy::should_retry`]) and after how long
//! ([`RetryPolicy::delay`]), or both at once ([`RetryPolicy::decide`]). It
//! keeps no state per message: the caller counts the attempts and supplies
//! the randomness for jitter, so a decision is a function of its inputs and
//! the same inputs give the same answer, in tests as in production.
//!
//! Jitter turns the `random: u64` a caller passes (a message's position, a
//! hash, any seed) into a fraction with a splitmix64 step over the seed and
//! the attempt number, so one seed per message gives a different draw at
//! each attempt. No random number generator is involved.

use std::any::type_name;
use std::fmt;
use std::sync::Arc as StdArc;
use std::time::Duration;

use crate::error::{ConfigError, Panic};

/// The predicate that says which error values are retried.
type Predicate<E> = dyn Fn(&E) -> bool + Send + Sync + 'static;

/// How the wait between two attempts grows with the attempts that failed.
///
/// The delays, for the attempt `n` that just failed (`n` ≥ 1):
///
/// | kind | wait before attempt `n + 1` |
/// |---|---|
/// | `Fixed(d)` | `d` |
/// | `Exponential { initial, factor, max }` | `min(initial × factor^(n−1), max)` |
///
/// [`Jitter`] then spreads each delay out. The values are checked when the
/// policy is built ([`RetryPolicyBuilder::build`]); a `Backoff` on its own
/// may hold any values.
///
/// ```
/// use std::time::Duration;
/// use keyed_executor::Backoff;
///
/// let ms = Duration::from_millis;
/// // 100 ms, 200 ms, 400 ms, ... at most 10 s.
/// let doubling = Backoff::exponential(ms(100), Duration::from_secs(10));
/// // 50 ms, 150 ms, 450 ms, ... at most 2 s.
/// let tripling = Backoff::Exponential { initial: ms(50), factor: 3.0, max: Duration::from_secs(2) };
/// // The same 250 ms every time.
/// let steady = Backoff::fixed(ms(250));
/// # let _ = (doubling, tripling, steady);
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
#[non_exhaustive]
pub enum Backoff {
    /// The same delay before every retry (zero: retry at once).
    Fixed(Duration),
    /// A delay that starts at `initial` and is multiplied by `factor` after
    /// each further failure, never above `max`.
    Exponential {
        /// The delay after the first failure. Must be above zero.
        initial: Duration,
        /// What each further failure multiplies the delay by: finite and
        /// above 1.0.
        factor: f64,
        /// The longest delay, at least `initial`.
        max: Duration,
    },
}

impl Backoff {
    /// The same `delay` before every retry.
    pub const fn fixed(delay: Duration) -> Backoff {
        Backoff::Fixed(delay)
    }

    /// A delay that starts at `initial` and doubles after each further
    /// failure, up to `max`. For another factor, write the variant out:
    /// `Backoff::Exponential { initial, factor: 1.5, max }`.
    pub const fn exponential(initial: Duration, max: Duration) -> Backoff {
        Backoff::Exponential {
            initial,
            factor: 2.0,
            max,
        }
    }

    /// The delay after attempt `attempt` failed, before jitter.
    fn base(&self, attempt: u32) -> Duration {
        if attempt == 0 {
            return Duration::ZERO;
        }
        match *self {
            Backoff::Fixed(delay) => delay,
            Backoff::Exponential {
                initial,
                factor,
                max,
            } => scaled(initial, factor, attempt - 1, max),
        }
    }

    fn validate(&self) -> Result<(), ConfigError> {
        match *self {
            Backoff::Fixed(_) => Ok(()),
            Backoff::Exponential {
                initial,
                factor,
                max,
            } => {
                if !(factor.is_finite() && factor > 1.0) {
                    return Err(ConfigError::InvalidBackoffFactor(format!("{factor:?}")));
                }
                if initial.is_zero() {
                    return Err(ConfigError::ZeroBackoffInitial);
                }
                if max < initial {
                    return Err(ConfigError::BackoffMaxBelowInitial { initial, max });
                }
                Ok(())
            }
        }
    }
}

/// `min(initial × factor^exponent, max)`, computed in nanoseconds as an
/// `f64` (exact for the usual factors while the delay is under 2^53 ns,
/// about 104 days) and saturating at `max`, whatever the exponent.
fn scaled(initial: Duration, factor: f64, exponent: u32, max: Duration) -> Duration {
    let power = power(factor, exponent);
    let nanos = initial.as_nanos() as f64 * power;
    // A NaN (impossible after validation) also lands on `max`.
    if nanos.is_nan() || nanos >= max.as_nanos() as f64 {
        return max;
    }
    if nanos < u64::MAX as f64 {
        Duration::from_nanos(nanos as u64)
    } else {
        // Over 584 years but still under `max`: seconds keep the range.
        Duration::from_secs_f64(nanos / 1e9).min(max)
    }
}

/// `base^exponent` by squaring: plain multiplications, each exact while
/// the products are integers under 2^53 (`powi` may round differently on
/// another target or interpreter); past `f64::MAX` it is infinite.
fn power(mut base: f64, mut exponent: u32) -> f64 {
    let mut acc = 1.0;
    while exponent > 0 {
        if exponent & 1 == 1 {
            acc *= base;
        }
        base *= base;
        exponent >>= 1;
    }
    acc
}

/// How each delay of a [`Backoff`] is spread out, so that messages that
/// failed together do not all retry together.
///
/// For a delay `d`:
///
/// | kind | wait |
/// |---|---|
/// | `None` | `d` |
/// | `Full` | uniform in `[0, d]` |
/// | `Equal` | `d/2` + uniform in `[0, d/2]` |
///
/// `Full` spreads the retries the most and so loads a recovering service the
/// least; `Equal` keeps at least half of each delay. Either never waits
/// longer than the delay itself, so a backoff's `max` stays a bound.
///
/// ```
/// use std::time::Duration;
/// use keyed_executor::{Backoff, Jitter, RetryPolicy};
///
/// let second = Duration::from_secs(1);
/// let policy: RetryPolicy<()> = RetryPolicy::builder()
///     .backoff(Backoff::fixed(second))
///     .jitter(Jitter::Equal)
///     .build()?;
/// // Messages seeded 0..100 (their positions, say) spread over [0.5 s, 1 s].
/// for position in 0..100 {
///     let wait = policy.delay(1, position);
///     assert!(second / 2 <= wait && wait <= second);
/// }
/// # Ok::<(), keyed_executor::ConfigError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[non_exhaustive]
pub enum Jitter {
    /// Wait exactly the backoff's delay.
    None,
    /// Wait a uniform fraction of the delay, from zero to all of it (the
    /// default).
    #[default]
    Full,
    /// Wait half the delay plus a uniform fraction of the other half.
    Equal,
}

impl Jitter {
    /// `delay` spread out by a draw from `random` (already mixed).
    fn apply(self, delay: Duration, random: u64) -> Duration {
        let nanos = delay.as_nanos();
        let spread = match self {
            Jitter::None => return delay,
            Jitter::Full => uniform_up_to(nanos, random),
            Jitter::Equal => nanos - nanos / 2 + uniform_up_to(nanos / 2, random),
        };
        from_nanos(spread)
    }
}

/// A value in `[0, bound]` from the top 32 bits of `random`: `bound` is at
/// most about 2^94 (`Duration::MAX` in nanoseconds), so the product stays
/// within a `u128`.
fn uniform_up_to(bound: u128, random: u64) -> u128 {
    ((bound + 1) * u128::from(random >> 32)) >> 32
}

/// A duration of `nanos` nanoseconds, for `nanos` no larger than some
/// `Duration::as_nanos()` (so the seconds fit in a `u64`).
fn from_nanos(nanos: u128) -> Duration {
    const NANOS_PER_SEC: u128 = 1_000_000_000;
    let secs = u64::try_from(nanos / NANOS_PER_SEC).unwrap_or(u64::MAX);
    // The remainder is below 10^9.
    Duration::new(secs, (nanos % NANOS_PER_SEC) as u32)
}

/// The `index`-th output of the splitmix64 sequence that starts at `seed`
/// (Steele, Lea and Flood, "Fast splittable pseudorandom number
/// generators", 2014): every input bit reaches every output bit, so
/// neighbouring seeds (positions 0, 1, 2, …) give unrelated draws.
fn splitmix64(seed: u64, index: u32) -> u64 {
    const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut z = seed.wrapping_add(GAMMA.wrapping_mul(u64::from(index) + 1));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// How an attempt failed: the handler's error value, or a panic.
///
/// ```
/// use keyed_executor::{Failure, Panic};
///
/// let timeout = std::io::Error::from(std::io::ErrorKind::TimedOut);
/// let failure = Failure::Error(&timeout);
/// assert!(!failure.is_panic());
///
/// let caught = std::panic::catch_unwind(|| panic!("boom")).unwrap_err();
/// let panic = Panic::new(caught);
/// assert!(Failure::<std::io::Error>::Panicked(&panic).is_panic());
/// ```
pub enum Failure<'a, E: ?Sized> {
    /// The attempt returned this error.
    Error(&'a E),
    /// The attempt panicked.
    Panicked(&'a Panic),
}

impl<E: ?Sized> Failure<'_, E> {
    /// The attempt panicked.
    pub fn is_panic(&self) -> bool {
        matches!(self, Failure::Panicked(_))
    }

    /// The error value, unless the attempt panicked.
    pub fn error(&self) -> Option<&E> {
        match self {
            Failure::Error(e) => Some(e),
            Failure::Panicked(_) => None,
        }
    }
}

// Not derived: a derive would ask `E: Clone`, but only references are held.
impl<E: ?Sized> Clone for Failure<'_, E> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<E: ?Sized> Copy for Failure<'_, E> {}

impl<E: ?Sized + fmt::Debug> fmt::Debug for Failure<'_, E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Error(e) => f.debug_tuple("Error").field(e).finish(),
            Failure::Panicked(p) => f.debug_tuple("Panicked").field(p).finish(),
        }
    }
}

/// What a [`RetryPolicy`] says about a failed attempt
/// ([`RetryPolicy::decide`]).
///
/// ```
/// use std::time::Duration;
/// use keyed_executor::{Failure, RetryDecision, RetryPolicy};
///
/// let policy: RetryPolicy<&str> = RetryPolicy::builder().max_attempts(2).build()?;
/// match policy.decide(1, Failure::Error(&"busy"), 0) {
///     RetryDecision::Retry(wait) => assert!(wait <= Duration::from_millis(100)),
///     other => panic!("expected a retry, got {other:?}"),
/// }
/// assert_eq!(policy.decide(2, Failure::Error(&"busy"), 0), RetryDecision::Exhausted);
/// # Ok::<(), keyed_executor::ConfigError>(())
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[must_use = "a decision says whether the message runs again or gives up"]
pub enum RetryDecision {
    /// Run the message again after waiting this long.
    Retry(Duration),
    /// The failure is retryable, but the attempt that failed was the last
    /// one allowed.
    Exhausted,
    /// The failure is not one the policy retries (the predicate said no, or
    /// a panic with [`retry_panics(false)`](RetryPolicyBuilder::retry_panics)).
    NotRetryable,
}

/// A retry policy for messages whose handler returns `Result<_, E>`: how
/// many attempts, how long to wait between them, which failures to retry.
///
/// Built with [`RetryPolicy::builder`]; every setting has a default, and
/// bad values are reported by [`build`](RetryPolicyBuilder::build), never
/// panicked on. A policy is cheap to clone (one reference count) and can be
/// shared between threads whatever `E` is.
///
/// A policy only computes: it keeps nothing per message. Whoever runs the
/// attempts counts them and passes a seed for the jitter (the message's
/// position, say), so the same failure at the same attempt always gets the
/// same answer.
///
/// ```
/// use std::time::Duration;
/// use keyed_executor::{Backoff, Failure, Jitter, RetryDecision, RetryPolicy};
///
/// #[derive(Debug)]
/// enum StoreError { Unavailable, Conflict }
///
/// let policy = RetryPolicy::builder()
///     .max_attempts(4)
///     .backoff(Backoff::exponential(Duration::from_millis(100), Duration::from_secs(5)))
///     .jitter(Jitter::None)
///     .retry_if(|e: &StoreError| matches!(e, StoreError::Unavailable))
///     .build()?;
///
/// // The first attempt failed with a transient error: try again in 100 ms.
/// let failed = Failure::Error(&StoreError::Unavailable);
/// assert_eq!(policy.decide(1, failed, 0), RetryDecision::Retry(Duration::from_millis(100)));
/// assert_eq!(policy.decide(3, failed, 0), RetryDecision::Retry(Duration::from_millis(400)));
/// // The fourth attempt was the last.
/// assert_eq!(policy.decide(4, failed, 0), RetryDecision::Exhausted);
/// // A conflict will not go away by waiting.
/// assert_eq!(policy.decide(1, Failure::Error(&StoreError::Conflict), 0), RetryDecision::NotRetryable);
/// # Ok::<(), keyed_executor::ConfigError>(())
/// ```
pub struct RetryPolicy<E: ?Sized> {
    inner: StdArc<Settings<E>>,
}

/// A policy's validated settings, shared by its clones (a `std` `Arc`: the
/// settings are read-only, so there is no race for loom to check, and a
/// loom `Arc` cannot hold the unsized predicate).
struct Settings<E: ?Sized> {
    max_attempts: u32,
    backoff: Backoff,
    jitter: Jitter,
    retry_if: Option<StdArc<Predicate<E>>>,
    retry_panics: bool,
}

/// The default attempts of a [`RetryPolicy`], the first one included.
const DEFAULT_MAX_ATTEMPTS: u32 = 3;

/// The default backoff of a [`RetryPolicy`]: 100 ms, doubling, at most 10 s.
const DEFAULT_BACKOFF: Backoff =
    Backoff::exponential(Duration::from_millis(100), Duration::from_secs(10));

impl<E: ?Sized> RetryPolicy<E> {
    /// A builder with the defaults: 3 attempts (the first one and two
    /// retries), exponential backoff from 100 ms doubling up to 10 s, full
    /// jitter, every error retried, a panic retried like an error.
    ///
    /// ```
    /// use std::time::Duration;
    /// use keyed_executor::{Backoff, Jitter, RetryPolicy};
    ///
    /// let policy: RetryPolicy<std::io::Error> = RetryPolicy::builder().build()?;
    /// assert_eq!(policy.max_attempts(), 3);
    /// assert_eq!(
    ///     policy.backoff(),
    ///     Backoff::exponential(Duration::from_millis(100), Duration::from_secs(10))
    /// );
    /// assert_eq!(policy.jitter(), Jitter::Full);
    /// assert!(policy.retries_panics());
    /// # Ok::<(), keyed_executor::ConfigError>(())
    /// ```
    pub fn builder() -> RetryPolicyBuilder<E> {
        RetryPolicyBuilder {
            max_attempts: DEFAULT_MAX_ATTEMPTS,
            backoff: DEFAULT_BACKOFF,
            jitter: Jitter::default(),
            retry_if: None,
            retry_panics: true,
        }
    }

    /// How many attempts a message gets, the first one included (1: it is
    /// never retried).
    pub fn max_attempts(&self) -> u32 {
        self.inner.max_attempts
    }

    /// The backoff between attempts.
    pub fn backoff(&self) -> Backoff {
        self.inner.backoff
    }

    /// How each delay is spread out.
    pub fn jitter(&self) -> Jitter {
        self.inner.jitter
    }

    /// Whether a panic counts as a retryable failed attempt.
    pub fn retries_panics(&self) -> bool {
        self.inner.retry_panics
    }

    /// Whether `failure` is worth another attempt, whatever the attempts
    /// left: the predicate's answer for an error (every error without
    /// one), [`retries_panics`](Self::retries_panics) for a panic.
    ///
    /// ```
    /// use keyed_executor::{Failure, RetryPolicy};
    ///
    /// let policy = RetryPolicy::builder().retry_if(|code: &u16| *code >= 500).build()?;
    /// assert!(policy.is_retryable(Failure::Error(&503)));
    /// assert!(!policy.is_retryable(Failure::Error(&404)));
    /// # Ok::<(), keyed_executor::ConfigError>(())
    /// ```
    pub fn is_retryable(&self, failure: Failure<'_, E>) -> bool {
        match failure {
            Failure::Error(e) => self.inner.retry_if.as_ref().map_or(true, |f| f(e)),
            Failure::Panicked(_) => self.inner.retry_panics,
        }
    }

    /// Whether a message whose attempt number `attempt` (1 for the first)
    /// just failed with `failure` runs again: the failure is retryable and
    /// `attempt` is below [`max_attempts`](Self::max_attempts).
    ///
    /// ```
    /// use keyed_executor::{Failure, RetryPolicy};
    ///
    /// let policy: RetryPolicy<&str> = RetryPolicy::builder().max_attempts(2).build()?;
    /// assert!(policy.should_retry(1, Failure::Error(&"timeout")));
    /// assert!(!policy.should_retry(2, Failure::Error(&"timeout"))); // that was the last
    /// # Ok::<(), keyed_executor::ConfigError>(())
    /// ```
    pub fn should_retry(&self, attempt: u32, failure: Failure<'_, E>) -> bool {
        attempt < self.inner.max_attempts && self.is_retryable(failure)
    }

    /// How long to wait after attempt number `attempt` (1 for the first)
    /// failed, before attempt `attempt + 1`: the backoff's delay, spread by
    /// the jitter with a draw from `random` (zero for `attempt` 0, which
    /// follows no failure).
    ///
    /// Deterministic: the same arguments give the same delay. The draw
    /// mixes `random` with `attempt`, so one seed per message (its
    /// position, say) gives a fresh draw at every attempt. The delay never
    /// exceeds the backoff's (its `max` for an exponential one), and any
    /// `attempt` is fine: past the cap the delay stays at the cap.
    ///
    /// ```
    /// use std::time::Duration;
    /// use keyed_executor::{Backoff, Jitter, RetryPolicy};
    ///
    /// let ms = Duration::from_millis;
    /// let policy: RetryPolicy<()> = RetryPolicy::builder()
    ///     .backoff(Backoff::exponential(ms(10), ms(50)))
    ///     .jitter(Jitter::None)
    ///     .build()?;
    /// let delays: Vec<_> = (1..=4).map(|attempt| policy.delay(attempt, 0)).collect();
    /// assert_eq!(delays, [ms(10), ms(20), ms(40), ms(50)]);
    /// assert_eq!(policy.delay(u32::MAX, 0), ms(50));
    ///
    /// // With jitter, a seed gives a delay within the bounds, the same every time.
    /// let jittered: RetryPolicy<()> = RetryPolicy::builder()
    ///     .backoff(Backoff::fixed(ms(100)))
    ///     .jitter(Jitter::Equal)
    ///     .build()?;
    /// let d = jittered.delay(1, 42);
    /// assert!(ms(50) <= d && d <= ms(100));
    /// assert_eq!(d, jittered.delay(1, 42));
    /// # Ok::<(), keyed_executor::ConfigError>(())
    /// ```
    pub fn delay(&self, attempt: u32, random: u64) -> Duration {
        let base = self.inner.backoff.base(attempt);
        self.inner.jitter.apply(base, splitmix64(random, attempt))
    }

    /// What to do after attempt number `attempt` (1 for the first) failed
    /// with `failure`: retry after [`delay`](Self::delay)`(attempt,
    /// random)`, or give up, saying why. A failure that is not retryable
    /// is [`NotRetryable`](RetryDecision::NotRetryable) even on the last
    /// attempt.
    ///
    /// ```
    /// use std::time::Duration;
    /// use keyed_executor::{Backoff, Failure, Panic, RetryDecision, RetryPolicy};
    ///
    /// let policy: RetryPolicy<String> = RetryPolicy::builder()
    ///     .backoff(Backoff::fixed(Duration::ZERO))
    ///     .retry_panics(false)
    ///     .build()?;
    /// let error = "unavailable".to_owned();
    /// assert_eq!(policy.decide(1, Failure::Error(&error), 7), RetryDecision::Retry(Duration::ZERO));
    /// assert_eq!(policy.decide(3, Failure::Error(&error), 7), RetryDecision::Exhausted);
    ///
    /// let panic = Panic::new(std::panic::catch_unwind(|| panic!("bug")).unwrap_err());
    /// assert_eq!(policy.decide(1, Failure::Panicked(&panic), 7), RetryDecision::NotRetryable);
    /// # Ok::<(), keyed_executor::ConfigError>(())
    /// ```
    pub fn decide(&self, attempt: u32, failure: Failure<'_, E>, random: u64) -> RetryDecision {
        if !self.is_retryable(failure) {
            RetryDecision::NotRetryable
        } else if attempt >= self.inner.max_attempts {
            RetryDecision::Exhausted
        } else {
            RetryDecision::Retry(self.delay(attempt, random))
        }
    }
}

impl<E: ?Sized> Default for RetryPolicy<E> {
    /// The defaults of [`RetryPolicy::builder`].
    fn default() -> Self {
        RetryPolicy::builder()
            .build()
            .expect("the default settings are valid")
    }
}

// Not derived: a derive would ask `E: Clone`, but clones share the settings.
impl<E: ?Sized> Clone for RetryPolicy<E> {
    fn clone(&self) -> Self {
        RetryPolicy {
            inner: StdArc::clone(&self.inner),
        }
    }
}

impl<E: ?Sized> fmt::Debug for RetryPolicy<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.inner;
        f.debug_struct("RetryPolicy")
            .field("error", &type_name::<E>())
            .field("max_attempts", &s.max_attempts)
            .field("backoff", &s.backoff)
            .field("jitter", &s.jitter)
            .field("retry_if", &s.retry_if.as_ref().map(|_| "<predicate>"))
            .field("retry_panics", &s.retry_panics)
            .finish()
    }
}

/// Builds a [`RetryPolicy`] ([`RetryPolicy::builder`]). Every setting has a
/// default; [`build`](Self::build) checks them.
///
/// ```
/// use std::time::Duration;
/// use keyed_executor::{Backoff, ConfigError, RetryPolicy};
///
/// let err = RetryPolicy::<std::io::Error>::builder().max_attempts(0).build().unwrap_err();
/// assert_eq!(err, ConfigError::ZeroMaxAttempts);
///
/// let backwards = Backoff::exponential(Duration::from_secs(1), Duration::from_millis(10));
/// let err = RetryPolicy::<std::io::Error>::builder().backoff(backwards).build().unwrap_err();
/// assert!(err.to_string().contains("`max`"));
/// ```
#[must_use = "a builder does nothing until `build()` is called"]
pub struct RetryPolicyBuilder<E: ?Sized> {
    max_attempts: u32,
    backoff: Backoff,
    jitter: Jitter,
    retry_if: Option<StdArc<Predicate<E>>>,
    retry_panics: bool,
}

impl<E: ?Sized> RetryPolicyBuilder<E> {
    /// How many attempts a message gets, the first one included: 1 never
    /// retries, 3 (the default) retries twice. Must be at least 1.
    pub fn max_attempts(mut self, attempts: u32) -> Self {
        self.max_attempts = attempts;
        self
    }

    /// The wait between attempts. Default:
    /// `Backoff::exponential(100 ms, 10 s)` (100 ms, 200 ms, 400 ms, …).
    pub fn backoff(mut self, backoff: Backoff) -> Self {
        self.backoff = backoff;
        self
    }

    /// How each delay is spread out. Default [`Jitter::Full`].
    pub fn jitter(mut self, jitter: Jitter) -> Self {
        self.jitter = jitter;
        self
    }

    /// Retries only the errors for which `predicate` returns `true` (by
    /// default every error is retried). It runs once per failed attempt,
    /// on the thread that saw the failure; keep it cheap. A later call
    /// replaces an earlier one.
    pub fn retry_if(mut self, predicate: impl Fn(&E) -> bool + Send + Sync + 'static) -> Self {
        self.retry_if = Some(StdArc::new(predicate));
        self
    }

    /// Whether a panicking attempt is retried like a retryable error
    /// (`true`, the default) or gives up at once (`false`: a panic is a
    /// bug that another attempt will meet again).
    pub fn retry_panics(mut self, retry: bool) -> Self {
        self.retry_panics = retry;
        self
    }

    /// The policy, or what is wrong with the settings: zero attempts
    /// ([`ZeroMaxAttempts`](ConfigError::ZeroMaxAttempts)); for an
    /// exponential backoff a factor that is not a finite number above 1.0
    /// ([`InvalidBackoffFactor`](ConfigError::InvalidBackoffFactor)), a zero
    /// initial delay ([`ZeroBackoffInitial`](ConfigError::ZeroBackoffInitial))
    /// or a `max` below it
    /// ([`BackoffMaxBelowInitial`](ConfigError::BackoffMaxBelowInitial)).
    pub fn build(self) -> Result<RetryPolicy<E>, ConfigError> {
        if self.max_attempts == 0 {
            return Err(ConfigError::ZeroMaxAttempts);
        }
        self.backoff.validate()?;
        Ok(RetryPolicy {
            inner: StdArc::new(Settings {
                max_attempts: self.max_attempts,
                backoff: self.backoff,
                jitter: self.jitter,
                retry_if: self.retry_if,
                retry_panics: self.retry_panics,
            }),
        })
    }
}

// Not derived: a derive would ask `E: Clone`, but the predicate is shared.
impl<E: ?Sized> Clone for RetryPolicyBuilder<E> {
    fn clone(&self) -> Self {
        RetryPolicyBuilder {
            max_attempts: self.max_attempts,
            backoff: self.backoff,
            jitter: self.jitter,
            retry_if: self.retry_if.clone(),
            retry_panics: self.retry_panics,
        }
    }
}

impl<E: ?Sized> fmt::Debug for RetryPolicyBuilder<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RetryPolicyBuilder")
            .field("error", &type_name::<E>())
            .field("max_attempts", &self.max_attempts)
            .field("backoff", &self.backoff)
            .field("jitter", &self.jitter)
            .field("retry_if", &self.retry_if.as_ref().map(|_| "<predicate>"))
            .field("retry_panics", &self.retry_panics)
            .finish()
    }
}

#[cfg(all(test, not(loom)))]
mod tests;
