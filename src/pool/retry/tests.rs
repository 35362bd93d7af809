use super::*;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

fn policy(backoff: Backoff, jitter: Jitter) -> RetryPolicy<()> {
    RetryPolicy::builder()
        .backoff(backoff)
        .jitter(jitter)
        .build()
        .unwrap()
}

fn sequence(p: &RetryPolicy<()>, attempts: std::ops::RangeInclusive<u32>) -> Vec<Duration> {
    attempts.map(|a| p.delay(a, 0)).collect()
}

fn a_panic() -> Panic {
    Panic::new(Box::new("boom"))
}

#[test]
fn fixed_backoff_waits_the_same_every_time() {
    let p = policy(Backoff::fixed(ms(250)), Jitter::None);
    assert_eq!(sequence(&p, 1..=4), [ms(250); 4]);
    assert_eq!(p.delay(u32::MAX, 0), ms(250));
    let p = policy(Backoff::fixed(Duration::ZERO), Jitter::Full);
    assert_eq!(p.delay(3, u64::MAX), Duration::ZERO);
}

#[test]
fn exponential_backoff_multiplies_up_to_its_max() {
    let p = policy(Backoff::exponential(ms(100), ms(1_000)), Jitter::None);
    assert_eq!(
        sequence(&p, 1..=6),
        [ms(100), ms(200), ms(400), ms(800), ms(1_000), ms(1_000)]
    );
    let p = policy(
        Backoff::Exponential {
            initial: ms(10),
            factor: 3.0,
            max: Duration::from_secs(60),
        },
        Jitter::None,
    );
    assert_eq!(sequence(&p, 1..=4), [ms(10), ms(30), ms(90), ms(270)]);
    let p = policy(
        Backoff::Exponential {
            initial: ms(100),
            factor: 1.5,
            max: Duration::from_secs(60),
        },
        Jitter::None,
    );
    assert_eq!(sequence(&p, 1..=3), [ms(100), ms(150), ms(225)]);
    // `initial` equal to `max` is a fixed delay.
    let p = policy(Backoff::exponential(ms(5), ms(5)), Jitter::None);
    assert_eq!(sequence(&p, 1..=3), [ms(5); 3]);
}

#[test]
fn no_delay_before_the_first_attempt() {
    for backoff in [Backoff::fixed(ms(7)), Backoff::exponential(ms(7), ms(70))] {
        for jitter in [Jitter::None, Jitter::Full, Jitter::Equal] {
            assert_eq!(policy(backoff, jitter).delay(0, 12345), Duration::ZERO);
        }
    }
}

#[test]
fn huge_attempt_numbers_saturate_at_the_max() {
    let max = Duration::from_secs(30);
    let p = policy(
        Backoff::exponential(Duration::from_nanos(1), max),
        Jitter::None,
    );
    for attempt in [
        64,
        65,
        1_000,
        i32::MAX as u32,
        i32::MAX as u32 + 1,
        u32::MAX,
    ] {
        assert_eq!(p.delay(attempt, 0), max, "attempt {attempt}");
    }
    // A factor barely above 1 still reaches the max without overflow.
    let p = policy(
        Backoff::Exponential {
            initial: ms(1),
            factor: 1.000_001,
            max,
        },
        Jitter::None,
    );
    assert_eq!(p.delay(u32::MAX, 0), max);
    // The largest durations: no overflow, the max holds.
    let p = policy(
        Backoff::Exponential {
            initial: Duration::from_secs(1 << 62),
            factor: 2.0,
            max: Duration::MAX,
        },
        Jitter::None,
    );
    assert_eq!(p.delay(1, 0), Duration::from_secs(1 << 62));
    assert_eq!(p.delay(10, 0), Duration::MAX);
    for jitter in [Jitter::Full, Jitter::Equal] {
        let p = policy(Backoff::fixed(Duration::MAX), jitter);
        for r in [0, 1, u64::MAX / 3, u64::MAX] {
            assert!(p.delay(u32::MAX, r) <= Duration::MAX);
        }
    }
}

#[test]
fn jitter_stays_within_its_bounds_and_spreads() {
    let d = ms(1_000);
    let full = policy(Backoff::fixed(d), Jitter::Full);
    let equal = policy(Backoff::fixed(d), Jitter::Equal);
    let (mut full_min, mut full_max) = (d, Duration::ZERO);
    let (mut equal_min, mut equal_max) = (d, Duration::ZERO);
    let mut full_sum = Duration::ZERO;
    let draws = 20_000u64;
    for seed in 0..draws {
        let f = full.delay(1, seed);
        assert!(f <= d, "full jitter {f:?} above {d:?}");
        full_min = full_min.min(f);
        full_max = full_max.max(f);
        full_sum += f;
        let e = equal.delay(1, seed);
        assert!(d / 2 <= e && e <= d, "equal jitter {e:?} outside [d/2, d]");
        equal_min = equal_min.min(e);
        equal_max = equal_max.max(e);
    }
    // The draws cover the range: sequential seeds are not correlated.
    assert!(
        full_min < ms(5) && full_max > ms(995),
        "{full_min:?}..{full_max:?}"
    );
    assert!(
        equal_min < ms(505) && equal_max > ms(995),
        "{equal_min:?}..{equal_max:?}"
    );
    let mean = full_sum / draws as u32;
    assert!(
        ms(480) < mean && mean < ms(520),
        "mean of full jitter {mean:?}"
    );
}

#[test]
fn jitter_is_deterministic_and_fresh_at_each_attempt() {
    let p = policy(Backoff::fixed(ms(1_000)), Jitter::Full);
    assert_eq!(p.delay(1, 99), p.delay(1, 99));
    // One seed for a message: its attempts draw differently.
    let draws: Vec<Duration> = (1..=8).map(|a| p.delay(a, 99)).collect();
    let mut distinct = draws.clone();
    distinct.sort();
    distinct.dedup();
    assert_eq!(distinct.len(), draws.len(), "{draws:?}");
    // No jitter ignores the seed.
    let p = policy(Backoff::fixed(ms(1_000)), Jitter::None);
    assert_eq!(p.delay(1, 1), p.delay(1, 2));
}

#[test]
fn jitter_caps_an_exponential_backoff_at_its_max() {
    let max = ms(300);
    let p = policy(Backoff::exponential(ms(100), max), Jitter::Equal);
    for attempt in 1..50 {
        for seed in 0..50 {
            assert!(p.delay(attempt, seed) <= max);
        }
    }
    assert!(p.delay(40, 3) >= max / 2);
}

#[test]
fn each_bad_setting_is_refused() {
    fn build(b: RetryPolicyBuilder<()>) -> Option<ConfigError> {
        b.build().err()
    }
    assert_eq!(
        build(RetryPolicy::builder().max_attempts(0)),
        Some(ConfigError::ZeroMaxAttempts)
    );
    let exp = |initial, factor, max| {
        build(RetryPolicy::builder().backoff(Backoff::Exponential {
            initial,
            factor,
            max,
        }))
    };
    let s = Duration::from_secs(1);
    for factor in [
        1.0,
        0.5,
        0.0,
        -2.0,
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
    ] {
        assert_eq!(
            exp(ms(1), factor, s),
            Some(ConfigError::InvalidBackoffFactor(format!("{factor:?}"))),
            "factor {factor}"
        );
    }
    assert_eq!(
        exp(Duration::ZERO, 2.0, s),
        Some(ConfigError::ZeroBackoffInitial)
    );
    assert_eq!(
        exp(s, 2.0, ms(999)),
        Some(ConfigError::BackoffMaxBelowInitial {
            initial: s,
            max: ms(999)
        })
    );
    // The edges that are fine.
    assert_eq!(exp(s, 1.000_1, s), None);
    assert_eq!(build(RetryPolicy::builder().max_attempts(1)), None);
    assert_eq!(build(RetryPolicy::builder().max_attempts(u32::MAX)), None);
    assert_eq!(
        build(RetryPolicy::builder().backoff(Backoff::fixed(Duration::ZERO))),
        None
    );
}

#[test]
fn messages_name_the_setting() {
    let msg = |e: ConfigError| e.to_string();
    assert!(msg(ConfigError::ZeroMaxAttempts).contains("max_attempts"));
    let m = msg(ConfigError::InvalidBackoffFactor("NaN".into()));
    assert!(m.contains("factor") && m.contains("NaN"), "{m}");
    assert!(msg(ConfigError::ZeroBackoffInitial).contains("initial"));
    let m = msg(ConfigError::BackoffMaxBelowInitial {
        initial: ms(20),
        max: ms(10),
    });
    assert!(
        m.contains("max") && m.contains("20ms") && m.contains("10ms"),
        "{m}"
    );
}

#[test]
fn the_predicate_picks_the_errors_to_retry() {
    let p = RetryPolicy::builder()
        .retry_if(|e: &std::io::ErrorKind| *e == std::io::ErrorKind::TimedOut)
        .build()
        .unwrap();
    let timed_out = std::io::ErrorKind::TimedOut;
    let denied = std::io::ErrorKind::PermissionDenied;
    assert!(p.should_retry(1, Failure::Error(&timed_out)));
    assert!(!p.should_retry(1, Failure::Error(&denied)));
    assert_eq!(
        p.decide(1, Failure::Error(&denied), 0),
        RetryDecision::NotRetryable
    );
    // Not retryable wins over exhausted: it says more.
    assert_eq!(
        p.decide(3, Failure::Error(&denied), 0),
        RetryDecision::NotRetryable
    );
    assert_eq!(
        p.decide(3, Failure::Error(&timed_out), 0),
        RetryDecision::Exhausted
    );
    // Without a predicate, every error is retried.
    let all: RetryPolicy<std::io::ErrorKind> = RetryPolicy::default();
    assert!(all.should_retry(1, Failure::Error(&denied)));
    // The last call wins.
    let p = RetryPolicy::builder()
        .retry_if(|_: &u8| false)
        .retry_if(|_: &u8| true)
        .build()
        .unwrap();
    assert!(p.is_retryable(Failure::Error(&0)));
}

#[test]
fn attempts_count_the_first_one() {
    let p: RetryPolicy<()> = RetryPolicy::builder().max_attempts(1).build().unwrap();
    assert!(!p.should_retry(1, Failure::Error(&())));
    assert_eq!(
        p.decide(1, Failure::Error(&()), 0),
        RetryDecision::Exhausted
    );
    let p: RetryPolicy<()> = RetryPolicy::builder()
        .max_attempts(3)
        .jitter(Jitter::None)
        .build()
        .unwrap();
    let answers: Vec<bool> = (1..=4)
        .map(|a| p.should_retry(a, Failure::Error(&())))
        .collect();
    assert_eq!(answers, [true, true, false, false]);
    assert_eq!(
        p.decide(2, Failure::Error(&()), 0),
        RetryDecision::Retry(ms(200))
    );
    let forever: RetryPolicy<()> = RetryPolicy::builder()
        .max_attempts(u32::MAX)
        .build()
        .unwrap();
    assert!(forever.should_retry(u32::MAX - 1, Failure::Error(&())));
    assert!(!forever.should_retry(u32::MAX, Failure::Error(&())));
}

#[test]
fn a_panic_retries_unless_told_otherwise() {
    let panic = a_panic();
    let p: RetryPolicy<()> = RetryPolicy::default();
    assert!(p.retries_panics());
    assert!(p.should_retry(1, Failure::Panicked(&panic)));
    assert_eq!(
        p.decide(3, Failure::Panicked(&panic), 0),
        RetryDecision::Exhausted
    );
    let p: RetryPolicy<()> = RetryPolicy::builder().retry_panics(false).build().unwrap();
    assert!(!p.should_retry(1, Failure::Panicked(&panic)));
    assert!(p.should_retry(1, Failure::Error(&())));
    assert_eq!(
        p.decide(1, Failure::Panicked(&panic), 0),
        RetryDecision::NotRetryable
    );
    // The predicate is for error values only: a panic never reaches it.
    let p = RetryPolicy::builder()
        .retry_if(|_: &()| panic!("the predicate saw a panic"))
        .build()
        .unwrap();
    assert!(p.should_retry(1, Failure::Panicked(&panic)));
}

#[test]
fn a_policy_is_shared_cheaply_whatever_the_error_type() {
    fn check<T: Send + Sync + Clone + 'static>() {}
    check::<RetryPolicy<std::rc::Rc<()>>>();
    check::<RetryPolicy<dyn std::error::Error>>();
    check::<RetryPolicyBuilder<std::cell::Cell<u8>>>();
    let p = RetryPolicy::<dyn std::error::Error>::builder()
        .retry_if(|e| e.to_string().contains("again"))
        .build()
        .unwrap();
    let q = p.clone();
    assert!(StdArc::ptr_eq(&p.inner, &q.inner));
    let e = std::io::Error::other("try again");
    assert!(q.should_retry(1, Failure::Error(&e as &dyn std::error::Error)));
    let debug = format!("{p:?}");
    assert!(
        debug.contains("max_attempts: 3") && debug.contains("<predicate>"),
        "{debug}"
    );
}

#[test]
fn splitmix_mixes_neighbouring_seeds() {
    // Reference value of splitmix64 seeded with 0 (its first output).
    assert_eq!(splitmix64(0, 0), 0xe220_a839_7b1d_cdaf);
    let a = splitmix64(1, 0);
    let b = splitmix64(2, 0);
    assert!((a ^ b).count_ones() > 16);
}
