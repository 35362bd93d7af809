//! `examples/metrics_prometheus.rs` end to end: the Prometheus exporter
//! installed as the global recorder with its HTTP listener on a loopback
//! port, the example's known workload, one scrape of `/metrics` over HTTP,
//! and every documented series found with the values the workload
//! predicts (exact counts; histogram counts within the sampling's bounds).
//!
//! ```text
//! cargo test --features metrics --test metrics_prometheus
//! ```
#![cfg(feature = "metrics")]

// The example's functions; its `main` is not used here.
#[allow(dead_code)]
#[path = "../examples/metrics_prometheus.rs"]
mod example;

#[test]
fn the_example_serves_every_documented_series_over_http() {
    // One test in this binary: it installs the process's global recorder.
    let addr = example::free_port().unwrap();
    example::install(addr).unwrap();
    example::workload().unwrap();
    let body = example::scrape(addr).unwrap();
    for (name, kind) in [
        ("keyed_executor_messages_total", "counter"),
        ("keyed_executor_slow_steps_total", "counter"),
        ("keyed_executor_in_flight", "gauge"),
        ("keyed_executor_live_mailboxes", "gauge"),
        ("keyed_executor_workers_parked", "gauge"),
        ("keyed_executor_parks_beside_work_total", "counter"),
        (
            "keyed_executor_idle_beside_work_microseconds_total",
            "counter",
        ),
        ("keyed_executor_queue_seconds", "histogram"),
        ("keyed_executor_run_seconds", "histogram"),
        ("keyed_executor_poll_seconds", "histogram"),
        ("keyed_executor_lane_commands_total", "counter"),
        ("keyed_executor_lane_busy_total", "counter"),
        ("keyed_executor_lane_batch_size", "histogram"),
        ("keyed_executor_lane_wait_seconds", "histogram"),
    ] {
        assert!(
            body.contains(&format!("# TYPE {name} {kind}")),
            "{name} is not a {kind} in:\n{body}"
        );
        assert!(
            body.contains(&format!("# HELP {name} ")),
            "{name} has no help"
        );
    }
    let samples = example::parse(&body);
    if let Err(e) = example::check(&samples) {
        panic!("{e}\n{body}");
    }
}
