//! The slow-step watch (`Builder::slow_step`): a step that runs past the
//! threshold is reported once — by a `stats()` reader while it runs, or by
//! its own worker when it ends — and a fast one never; `stats()` shows the
//! step a worker runs and for which dispatcher.
//!
//! No assertion here is on the wall clock: the slow handlers wait until the
//! report arrived (or sleep well past the threshold, so their step is
//! longer than it by construction), and the fast ones run under a
//! threshold of seconds.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{eventually, Gate};
use keyed_executor::{handler, ConfigError, KeyedExecutor, SlowStep};

type Reports = Arc<Mutex<Vec<SlowStep>>>;

fn watched(workers: usize, threshold: Duration) -> (KeyedExecutor, Reports) {
    let reports: Reports = Arc::default();
    let sink = reports.clone();
    let executor = KeyedExecutor::builder()
        .workers(workers)
        .slow_step(threshold)
        .on_slow_step(move |step| sink.lock().unwrap().push(step.clone()))
        .build()
        .unwrap();
    (executor, reports)
}

#[test]
fn a_handler_blocked_past_the_threshold_is_reported_once_by_a_stats_reader() {
    let threshold = Duration::from_millis(20);
    let reported = Gate::new();
    let opener = reported.clone();
    let reports: Reports = Arc::default();
    let sink = reports.clone();
    let executor = KeyedExecutor::builder()
        .workers(2)
        .slow_step(threshold)
        .on_slow_step(move |step| {
            sink.lock().unwrap().push(step.clone());
            opener.open();
        })
        .build()
        .unwrap();
    let gate = reported.clone();
    let dispatcher = executor
        .dispatcher_builder(handler::from_fn(move |key: &u32, n: u32| {
            if *key == 7 {
                // Blocks until the crate reported this very step.
                gate.wait();
            }
            n
        }))
        .name("ledger")
        .build();
    let receiver = dispatcher.receiver(16).unwrap();
    let blocked = receiver.submit_blocking(7, 1).unwrap();

    // While it runs, `stats()` shows the step (and, once the threshold has
    // passed, reports it: that opens the handler's gate).
    let mut seen = None;
    eventually("the blocked step is reported", || {
        let stats = executor.stats();
        if let Some(step) = stats.workers.iter().find_map(|w| w.current_step.clone()) {
            assert_eq!(step.dispatcher, "ledger");
            seen = Some(step.key_hash);
        }
        !reports.lock().unwrap().is_empty()
    });
    assert_eq!(blocked.wait().unwrap(), 1);
    // The worker, at the end of that step, sees it overran too: it must not
    // report it again. Nor are the fast steps that follow reported.
    for n in 0..200 {
        receiver.submit_blocking(n % 5, n).unwrap().wait().unwrap();
    }
    assert!(executor.shutdown(Duration::from_secs(5)));

    let reports = reports.lock().unwrap();
    assert_eq!(reports.len(), 1, "{reports:?}");
    let r = &reports[0];
    assert_eq!(r.dispatcher, "ledger");
    assert!(!r.finished, "reported while still running");
    assert!(r.running_for > threshold);
    assert_eq!(Some(r.key_hash), seen, "the key of the step stats() showed");
    let stats = executor.stats();
    assert!(stats.workers.iter().all(|w| w.current_step.is_none()));
}

#[test]
fn a_step_that_overruns_and_ends_is_reported_once_by_its_own_worker() {
    let threshold = Duration::from_millis(20);
    let (executor, reports) = watched(1, threshold);
    let dispatcher = executor
        .dispatcher_builder(handler::from_fn(|key: &u32, n: u32| {
            if *key == 1 {
                // Longer than the threshold by construction.
                std::thread::sleep(Duration::from_millis(60));
            }
            n
        }))
        .name("sleepy")
        .build();
    let receiver = dispatcher.receiver(16).unwrap();
    assert_eq!(receiver.submit_blocking(1, 5).unwrap().wait().unwrap(), 5);
    for n in 0..100 {
        receiver.submit_blocking(2, n).unwrap().wait().unwrap();
    }
    // The report is made at the step's end, after its outcome: join the
    // worker before looking.
    assert!(executor.shutdown(Duration::from_secs(5)));
    let reports = reports.lock().unwrap();
    assert_eq!(reports.len(), 1, "{reports:?}");
    let r = &reports[0];
    assert_eq!((r.dispatcher.as_str(), r.worker), ("sleepy", 0));
    assert!(r.finished, "reported by its worker when it ended");
    assert!(r.running_for >= Duration::from_millis(60));
}

#[test]
fn a_slow_poll_of_an_async_handler_is_a_step_of_its_own() {
    let (executor, reports) = watched(1, Duration::from_millis(20));
    let dispatcher = executor
        .dispatcher_builder(handler::from_async_fn(|_key: u32, n: u32| async move {
            // First poll fast, the second slow.
            let mut polled = false;
            std::future::poll_fn(|cx| {
                if polled {
                    std::thread::sleep(Duration::from_millis(40));
                    std::task::Poll::Ready(())
                } else {
                    polled = true;
                    cx.waker().wake_by_ref();
                    std::task::Poll::Pending
                }
            })
            .await;
            n
        }))
        .name("journal")
        .build();
    let receiver = dispatcher.receiver(4).unwrap();
    assert_eq!(receiver.submit_blocking(3, 9).unwrap().wait().unwrap(), 9);
    assert!(executor.shutdown(Duration::from_secs(5)));
    let reports = reports.lock().unwrap();
    assert_eq!(reports.len(), 1, "{reports:?}");
    assert_eq!(reports[0].dispatcher, "journal");
    assert!(reports[0].finished);
}

#[test]
fn fast_handlers_are_never_reported() {
    let (executor, reports) = watched(2, Duration::from_secs(5));
    let sync = executor
        .dispatcher_builder(handler::from_fn(|_: &u32, n: u64| n))
        .name("fast")
        .build();
    let async_ = executor
        .dispatcher_builder(handler::from_async_fn(|_: u32, n: u64| async move {
            let mut yielded = false;
            std::future::poll_fn(|cx| {
                if yielded {
                    std::task::Poll::Ready(n)
                } else {
                    yielded = true;
                    cx.waker().wake_by_ref();
                    std::task::Poll::Pending
                }
            })
            .await
        }))
        .name("fast-async")
        .build();
    let (r1, r2) = (sync.receiver(256).unwrap(), async_.receiver(256).unwrap());
    for n in 0..20_000u64 {
        r1.send((n % 97) as u32, n).unwrap();
        r2.send((n % 89) as u32, n).unwrap();
        if n % 1000 == 0 {
            for w in executor.stats().workers {
                if let Some(step) = w.current_step {
                    assert!(step.dispatcher.starts_with("fast"), "{step:?}");
                }
            }
        }
    }
    assert!(executor.shutdown(Duration::from_secs(10)));
    assert_eq!(executor.stats().done, 40_000);
    assert!(reports.lock().unwrap().is_empty());
}

#[test]
fn without_a_threshold_no_step_is_watched() {
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let gate = Gate::new();
    let g = gate.clone();
    let entered = Gate::new();
    let e = entered.clone();
    let receiver = executor
        .dispatcher(handler::from_fn(move |_: &u32, ()| {
            e.open();
            g.wait();
        }))
        .receiver(4)
        .unwrap();
    let done = receiver.submit_blocking(1, ()).unwrap();
    entered.wait();
    assert_eq!(executor.stats().workers[0].current_step, None);
    gate.open();
    done.wait().unwrap();
    assert!(executor.shutdown(Duration::from_secs(5)));
}

#[test]
fn a_panicking_hook_is_contained() {
    let executor = KeyedExecutor::builder()
        .workers(1)
        .slow_step(Duration::from_millis(5))
        .on_slow_step(|_| panic!("hook panicked"))
        .build()
        .unwrap();
    let receiver = executor
        .dispatcher(handler::from_fn(|_: &u32, n: u32| {
            std::thread::sleep(Duration::from_millis(20));
            n
        }))
        .receiver(4)
        .unwrap();
    for n in 0..3 {
        assert_eq!(receiver.submit_blocking(1, n).unwrap().wait().unwrap(), n);
    }
    assert!(executor.shutdown(Duration::from_secs(5)));
    assert_eq!(executor.stats().done, 3);
}

#[test]
fn bad_slow_step_settings_are_config_errors() {
    let zero = KeyedExecutor::builder().slow_step(Duration::ZERO).build();
    assert_eq!(zero.unwrap_err(), ConfigError::ZeroSlowStep);
    let hook_alone = KeyedExecutor::builder().on_slow_step(|_| {}).build();
    assert_eq!(
        hook_alone.unwrap_err(),
        ConfigError::SlowStepHookWithoutThreshold
    );
    assert!(ConfigError::ZeroSlowStep.to_string().contains("slow_step"));
}
