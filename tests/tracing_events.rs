//! The `tracing` feature: a DEBUG span per message (entered around the
//! handler call and every poll of its future), WARN events for panics and
//! slow or timed-out shutdowns, DEBUG/INFO events for force-stop rejections,
//! and Lanes events routed to tracing instead of standard error.
//!
//! ```text
//! cargo test --features tracing --test tracing_events
//! ```
#![cfg(feature = "tracing")]

mod common;

use std::fmt::Debug;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::shutdown_now_elsewhere;
use futures::task::SpawnExt;
use keyed_executor::lanes::{BatchResult, Kernel, Lanes};
use keyed_executor::{handler, KeyedExecutor, TaskError};
use tracing::field::{Field, Visit};
use tracing::span::Attributes;
use tracing::{Event, Id, Level, Subscriber};
use tracing_subscriber::layer::{Context, SubscriberExt};
use tracing_subscriber::registry::LookupSpan;
use tracing_subscriber::Layer;

/// One thing the subscriber saw.
#[derive(Debug, Clone)]
struct Seen {
    kind: &'static str,
    level: Level,
    target: String,
    /// The span name, or the event's message.
    text: String,
    /// For events: the name of the span they happened in.
    in_span: Option<String>,
    /// Every field but the message, as `name=value` (Debug), in order.
    fields: Vec<String>,
}

#[derive(Clone, Default)]
struct Capture(Arc<Mutex<Vec<Seen>>>);

struct Message(String, Vec<String>);

impl Visit for Message {
    fn record_debug(&mut self, field: &Field, value: &dyn Debug) {
        if field.name() == "message" {
            self.0 = format!("{value:?}");
        } else {
            self.1.push(format!("{}={value:?}", field.name()));
        }
    }
}

impl<S: Subscriber + for<'a> LookupSpan<'a>> Layer<S> for Capture {
    fn on_new_span(&self, attrs: &Attributes<'_>, _id: &Id, _ctx: Context<'_, S>) {
        let meta = attrs.metadata();
        let mut fields = Message(String::new(), Vec::new());
        attrs.record(&mut fields);
        self.0.lock().unwrap().push(Seen {
            kind: "span",
            level: *meta.level(),
            target: meta.target().to_owned(),
            text: meta.name().to_owned(),
            in_span: None,
            fields: fields.1,
        });
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        let mut message = Message(String::new(), Vec::new());
        event.record(&mut message);
        let meta = event.metadata();
        self.0.lock().unwrap().push(Seen {
            kind: "event",
            level: *meta.level(),
            target: meta.target().to_owned(),
            text: message.0,
            in_span: ctx.event_span(event).map(|s| s.name().to_owned()),
            fields: message.1,
        });
    }
}

impl Capture {
    fn take(&self) -> Vec<Seen> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

fn find<'a>(seen: &'a [Seen], level: Level, text: &str) -> Option<&'a Seen> {
    seen.iter()
        .find(|s| s.level == level && s.text.contains(text))
}

struct FailingViews;

impl Kernel for FailingViews {
    type Key = u8;
    type Command = u8;
    type Output = u8;
    type Error = String;

    async fn execute_batch(&self, _key: &u8, commands: Vec<u8>) -> BatchResult<u8, u8, String> {
        BatchResult::committed(commands.into_iter().map(Ok).collect())
    }
}

/// One test: the subscriber is process-global (events happen on the
/// executor's worker threads, not on the test's).
#[test]
fn spans_and_events() {
    let capture = Capture::default();
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(capture.clone()))
        .unwrap();

    // A span per message, entered around the handler call and around every
    // poll of its future (after an `.await` too).
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let receiver = executor
        .dispatcher_builder(handler::from_async_fn(|key: u32, n: u32| async move {
            tracing::info!("before await {key}");
            futures::future::ready(()).await;
            std::thread::yield_now();
            tracing::info!("after await {key}");
            if n == 13 {
                panic!("unlucky");
            }
            n
        }))
        .name("journal")
        .build()
        .receiver(8)
        .unwrap();
    assert_eq!(receiver.submit_blocking(1, 1).unwrap().wait().unwrap(), 1);
    let seen = capture.take();
    let span = seen
        .iter()
        .find(|s| s.kind == "span")
        .expect("a message span");
    assert_eq!((span.level, span.text.as_str()), (Level::DEBUG, "message"));
    assert_eq!(span.target, "keyed_executor");
    assert_eq!(
        span.fields[0], "dispatcher=\"journal\"",
        "{:?}",
        span.fields
    );
    for text in ["before await 1", "after await 1"] {
        let e = find(&seen, Level::INFO, text).expect(text);
        assert_eq!(e.in_span.as_deref(), Some("message"), "{text}");
    }

    // A panic: WARN.
    let err = receiver.submit_blocking(2, 13).unwrap().wait().unwrap_err();
    assert!(err.is_panic());
    let seen = capture.take();
    let e = find(&seen, Level::WARN, "handler panicked").expect("panic event");
    assert_eq!(e.target, "keyed_executor");
    assert!(
        e.fields.contains(&"dispatcher=\"journal\"".to_owned()),
        "{:?}",
        e.fields
    );

    // A spawned future's panic: WARN.
    executor.spawn(async { panic!("spawned boom") }).unwrap();
    assert!(executor.shutdown(Duration::from_secs(5)));
    let seen = capture.take();
    assert!(find(&seen, Level::WARN, "spawned future panicked").is_some());

    // A force stop with queued messages: DEBUG per message, INFO summary.
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let (tx, rx) = std::sync::mpsc::channel::<()>();
    let rx = Mutex::new(rx);
    let receiver = executor
        .dispatcher(handler::from_fn(move |_: &u32, n: u32| {
            if n == 0 {
                rx.lock().unwrap().recv().unwrap();
            }
            n
        }))
        .receiver(8)
        .unwrap();
    let running = receiver.submit_blocking(1, 0).unwrap();
    let queued: Vec<_> = (1..4)
        .map(|n| receiver.submit_blocking(1, n).unwrap())
        .collect();
    // A graceful stop that cannot finish (key 1 is blocked): WARN.
    assert!(!executor.shutdown(Duration::from_millis(10)));
    let seen = capture.take();
    assert!(find(&seen, Level::WARN, "graceful shutdown timed out").is_some());
    let stopper = shutdown_now_elsewhere(&executor);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while executor.stats().rejected < 3 {
        assert!(std::time::Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(1));
    }
    tx.send(()).unwrap();
    stopper.join().unwrap();
    for done in queued {
        assert!(matches!(done.wait(), Err(TaskError::Rejected(_))));
    }
    assert_eq!(running.wait().unwrap(), 0);
    let seen = capture.take();
    let rejected = seen
        .iter()
        .filter(|s| s.level == Level::DEBUG && s.text.contains("handed back by a force stop"))
        .count();
    assert_eq!(rejected, 3);
    assert!(find(&seen, Level::INFO, "force stop").is_some());

    // Lanes events without an `on_event` hook go to tracing (WARN).
    let lanes = Lanes::builder(FailingViews)
        .on_commit(|_, _| Err("view store down".into()))
        .build()
        .unwrap();
    assert_eq!(
        lanes
            .execute_blocking(1, 5, Duration::from_secs(5))
            .unwrap(),
        5
    );
    let seen = capture.take();
    let e = find(&seen, Level::WARN, "view store down").expect("lanes event");
    assert_eq!(e.target, "keyed_executor::lanes");

    // A slow step: WARN, with the dispatcher's name and the key's hash
    // (the same as the hook's report).
    let hashes = std::sync::Arc::new(Mutex::new(Vec::new()));
    let h = hashes.clone();
    let executor = KeyedExecutor::builder()
        .workers(1)
        .slow_step(Duration::from_millis(5))
        .on_slow_step(move |s| h.lock().unwrap().push(s.key_hash))
        .build()
        .unwrap();
    let receiver = executor
        .dispatcher_builder(handler::from_fn(|_: &u32, ()| {
            std::thread::sleep(Duration::from_millis(20));
        }))
        .name("sleepy")
        .build()
        .receiver(2)
        .unwrap();
    receiver.submit_blocking(4, ()).unwrap().wait().unwrap();
    assert!(executor.shutdown(Duration::from_secs(5)));
    let seen = capture.take();
    let e = find(&seen, Level::WARN, "slow step").expect("slow step event");
    assert_eq!(e.target, "keyed_executor");
    let hash = hashes.lock().unwrap()[0];
    for field in [
        "dispatcher=\"sleepy\"".to_owned(),
        format!("key_hash={hash}"),
    ] {
        assert!(e.fields.contains(&field), "{field} not in {:?}", e.fields);
    }
}
