//! Every stop releases the submitters waiting on its sources: a submitter
//! blocked for credit, or for the commit span, when its receiver, its
//! dispatcher or the executor stops gets `Closed(its message)` at once (a
//! batch: the part not taken, in order, with the positions of what was
//! taken). It never waits for a unit to free.
//!
//! Each case holds the receiver's credit (or its commit span) with a
//! message that does not end by itself — a future suspended on an event,
//! or, for the force stops, a step blocked on a gate (a force stop cancels
//! a suspended future, which would give its unit back) — and blocks a
//! submitter behind it in one of the six waiting forms (seven with the
//! `sink` feature: `ReceiverSink`'s `poll_ready`). Then the stop
//! comes, and the submitter must come back before that message is
//! released. The timeouts below only keep a failing test from hanging;
//! nothing asserts on how fast anything is.

mod common;

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::Duration;

use common::Gate;
use futures::channel::oneshot;
use keyed_executor::{
    handler, BatchError, Completion, Dispatcher, KeyedExecutor, Positions, Receiver, SubmitError,
    TaskError,
};

/// How long a case waits for something that must happen before it calls
/// it a failure (a guard, not a measure).
const GUARD: Duration = Duration::from_secs(10);
/// How long the submitter is given to block before the stop comes. If it
/// has not blocked yet it is refused all the same; the case checks that it
/// did not return before the stop.
const SETTLE: Duration = Duration::from_millis(50);
const LONG: Duration = Duration::from_secs(60);

/// The holding message's value: suspends until the event fires.
const SUSPEND: u32 = 0;
/// The holding message's value: blocks its worker until the gate opens.
const BLOCK: u32 = 1;

type Msg = Box<u32>;
type Rx = Receiver<u32, Msg, u32>;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Form {
    Send,
    SubmitBlocking,
    SubmitAwait,
    SendAsync,
    SendBatch,
    SendBatchAsync,
    /// `SinkExt::send` on a `ReceiverSink` (the `sink` feature): its
    /// `poll_ready` waits for credit.
    #[cfg(feature = "sink")]
    Sink,
}

const FORMS: &[Form] = &[
    Form::Send,
    Form::SubmitBlocking,
    Form::SubmitAwait,
    Form::SendAsync,
    Form::SendBatch,
    Form::SendBatchAsync,
    #[cfg(feature = "sink")]
    Form::Sink,
];

impl Form {
    fn batch(self) -> bool {
        matches!(self, Form::SendBatch | Form::SendBatchAsync)
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Cause {
    /// Every unit of credit is out.
    Credit,
    /// Credit is free, but the commit span is full: position 0 is held.
    Span,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Stop {
    ReceiverClose,
    ReceiverShutdown,
    ReceiverShutdownAsync,
    ReceiverShutdownNow,
    DispatcherShutdown,
    DispatcherShutdownNow,
    ExecutorShutdown,
    ExecutorShutdownNow,
    ExecutorDrop,
}

impl Stop {
    fn forced(self) -> bool {
        matches!(
            self,
            Stop::ReceiverShutdownNow
                | Stop::DispatcherShutdownNow
                | Stop::ExecutorShutdownNow
                | Stop::ExecutorDrop
        )
    }
}

/// How the holding message holds its unit.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Hold {
    Suspended,
    Running,
}

/// What a waiting form returned.
enum Got {
    One(Result<(), SubmitError<Msg>>),
    Batch(Result<Positions, BatchError<u32, Msg>>),
}

/// One case's world: a one-worker executor whose handler suspends message
/// [`SUSPEND`] on `event`, blocks on `gate` for [`BLOCK`], and returns any
/// other message's value at once.
struct World {
    executor: KeyedExecutor,
    dispatcher: Dispatcher<u32, Msg, u32>,
    receiver: Rx,
    gate: Gate,
    event: Option<oneshot::Sender<()>>,
    started: mpsc::Receiver<u32>,
}

/// `span`: the commit span (`None`: the default, far from full here).
fn world(max_in_flight: usize, span: Option<usize>) -> World {
    let executor = KeyedExecutor::builder().workers(1).build().unwrap();
    let gate = Gate::new();
    let (event, on_event) = oneshot::channel::<()>();
    let on_event = Arc::new(Mutex::new(Some(on_event)));
    let (started_tx, started) = mpsc::channel::<u32>();
    let started_tx = Arc::new(Mutex::new(started_tx));
    let g = gate.clone();
    let dispatcher = executor.dispatcher(handler::from_async_fn(move |_key: u32, msg: Msg| {
        let (g, on_event, started_tx) = (g.clone(), on_event.clone(), started_tx.clone());
        async move {
            let v = *msg;
            if v == SUSPEND || v == BLOCK {
                let _ = started_tx.lock().unwrap().send(v);
            }
            if v == SUSPEND {
                let rx = on_event
                    .lock()
                    .unwrap()
                    .take()
                    .expect("one suspending message");
                let _ = rx.await;
            } else if v == BLOCK {
                g.wait();
            }
            v
        }
    }));
    let mut builder = dispatcher.receiver_builder().max_in_flight(max_in_flight);
    if let Some(span) = span {
        builder = builder.commit_span(span);
    }
    let receiver = builder.build().unwrap();
    World {
        executor,
        dispatcher,
        receiver,
        gate,
        event: Some(event),
        started,
    }
}

impl World {
    /// Lets the holding message end.
    fn release(&mut self) {
        self.gate.open();
        if let Some(event) = self.event.take() {
            let _ = event.send(());
        }
    }
}

/// The messages a form submits (key, message), and their addresses.
fn messages(form: Form, key: u32, n: usize) -> (Vec<(u32, Msg)>, Vec<usize>) {
    let n = if form.batch() { n } else { 1 };
    let msgs: Vec<(u32, Msg)> = (0..n).map(|i| (key, Box::new(100 + i as u32))).collect();
    let addrs = msgs.iter().map(|(_, m)| addr(m)).collect();
    (msgs, addrs)
}

fn addr(m: &Msg) -> usize {
    &**m as *const u32 as usize
}

/// Calls `form` with `msgs` on its own thread; its outcome comes on the
/// channel.
fn waiter(form: Form, r: Rx, mut msgs: Vec<(u32, Msg)>) -> mpsc::Receiver<Got> {
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        use futures::executor::block_on;
        let got = if form.batch() {
            Got::Batch(match form {
                Form::SendBatch => r.send_batch(msgs),
                _ => block_on(r.send_batch_async(msgs)),
            })
        } else {
            let (key, msg) = msgs.pop().unwrap();
            Got::One(match form {
                Form::Send => r.send(key, msg).map(drop),
                Form::SubmitBlocking => r.submit_blocking(key, msg).map(drop),
                Form::SubmitAwait => block_on(r.submit(key, msg)).map(drop),
                #[cfg(feature = "sink")]
                Form::Sink => {
                    use futures::SinkExt;
                    // The sink hands back the pair; the case checks the
                    // message.
                    block_on(r.sink().send((key, msg))).map_err(|e| match e {
                        SubmitError::Full((_, m)) => SubmitError::Full(m),
                        SubmitError::Closed((_, m)) => SubmitError::Closed(m),
                    })
                }
                _ => block_on(r.send_async(key, msg)).map(drop),
            })
        };
        let _ = tx.send(got);
    });
    rx
}

/// Starts `stop`; what it returns (a graceful stop's "drained") comes
/// from the handle once it ends.
fn start_stop(stop: Stop, w: &mut World) -> Option<thread::JoinHandle<bool>> {
    let r = w.receiver.clone();
    let d = w.dispatcher.clone();
    match stop {
        Stop::ReceiverClose => {
            w.receiver.close();
            None
        }
        Stop::ReceiverShutdown => Some(thread::spawn(move || r.shutdown(LONG))),
        Stop::ReceiverShutdownAsync => Some(thread::spawn(move || {
            futures::executor::block_on(r.shutdown_async(LONG))
        })),
        Stop::ReceiverShutdownNow => Some(thread::spawn(move || {
            r.shutdown_now();
            true
        })),
        Stop::DispatcherShutdown => Some(thread::spawn(move || d.shutdown(LONG))),
        Stop::DispatcherShutdownNow => Some(thread::spawn(move || {
            d.shutdown_now();
            true
        })),
        Stop::ExecutorShutdown => {
            let ex = w.executor.clone();
            Some(thread::spawn(move || ex.shutdown(LONG)))
        }
        Stop::ExecutorShutdownNow => {
            let ex = w.executor.clone();
            Some(thread::spawn(move || {
                ex.shutdown_now();
                true
            }))
        }
        Stop::ExecutorDrop => {
            // The last handle: the world keeps a clone that it gives up
            // here, and the stopping thread drops the other.
            let ex = std::mem::replace(
                &mut w.executor,
                KeyedExecutor::builder().workers(1).build().unwrap(),
            );
            Some(thread::spawn(move || {
                drop(ex);
                true
            }))
        }
    }
}

/// One case; `Err` says what went wrong.
fn case(form: Form, cause: Cause, stop: Stop) -> Result<(), String> {
    let what = format!("{form:?} waiting for {cause:?}, stopped by {stop:?}");
    // The holding message, and what the receiver looks like around it.
    let hold = if cause == Cause::Credit && stop.forced() {
        Hold::Running
    } else {
        Hold::Suspended
    };
    let (mut w, key, batch_len, taken) = match (cause, hold) {
        // One unit, held by a running step: the whole batch waits.
        (Cause::Credit, Hold::Running) => (world(1, None), 0, 2, vec![]),
        // Two units: the second is held by a message of the held key
        // queued behind it (a batch's first message takes it).
        (Cause::Credit, Hold::Suspended) => (world(2, None), 0, 3, vec![1]),
        // A span of 4 from position 0, which is held; positions 1..3 end
        // at once. A batch's first chunk takes positions 3 and 4: the
        // chunk passed the cap check with room for one, and tops up with
        // what credit is free (the span's overshoot of one message per
        // unit of credit).
        (Cause::Span, _) => (world(4, Some(4)), 1, 4, vec![3, 4]),
    };
    let holder: Completion<u32, Msg> = w
        .receiver
        .submit_blocking(
            0,
            Box::new(if hold == Hold::Running {
                BLOCK
            } else {
                SUSPEND
            }),
        )
        .unwrap();
    let started = w
        .started
        .recv_timeout(GUARD)
        .map_err(|_| format!("{what}: never started"))?;
    assert_eq!(
        started,
        if hold == Hold::Running {
            BLOCK
        } else {
            SUSPEND
        }
    );
    match cause {
        Cause::Credit if hold == Hold::Suspended && !form.batch() => {
            drop(w.receiver.submit_blocking(0, Box::new(10)).unwrap());
        }
        Cause::Span => {
            let n = if form.batch() { 2 } else { 3 };
            for i in 0..n {
                let done = w.receiver.submit_blocking(1, Box::new(10 + i)).unwrap();
                done.wait().unwrap();
            }
        }
        _ => {}
    }
    let (msgs, addrs) = messages(form, key, batch_len);
    let got = waiter(form, w.receiver.clone(), msgs);
    thread::sleep(SETTLE);
    if got.try_recv().is_ok() {
        w.release();
        return Err(format!(
            "{what}: the submitter did not wait (case set up wrong)"
        ));
    }
    let in_flight = w.receiver.in_flight();
    let stopper = start_stop(stop, &mut w);
    let result = match got.recv_timeout(GUARD) {
        Ok(got) => got,
        Err(_) => {
            // Let the holding message end so the case can finish.
            w.release();
            let late = got.recv_timeout(GUARD).is_ok();
            return Err(format!(
                "{what}: the submitter was still waiting {GUARD:?} after the stop \
                 ({} once the holding message was released)",
                if late { "it returned" } else { "and still" }
            ));
        }
    };
    // The holding message was not released: the submitter did not wait
    // for its unit. A graceful stop touched nothing the receiver accepted.
    if (hold == Hold::Running || !stop.forced()) && holder.is_finished() {
        return Err(format!("{what}: the holding message ended meanwhile"));
    }
    if !stop.forced() && cause == Cause::Credit && w.receiver.in_flight() != in_flight {
        return Err(format!(
            "{what}: in flight {} after the stop, {in_flight} before",
            w.receiver.in_flight()
        ));
    }
    match result {
        Got::One(Err(SubmitError::Closed(m))) if addr(&m) == addrs[0] => {}
        Got::One(Err(SubmitError::Closed(_))) => {
            return Err(format!("{what}: Closed, but with another message"))
        }
        Got::One(Err(SubmitError::Full(_))) => return Err(format!("{what}: Full, not Closed")),
        Got::One(Ok(())) => return Err(format!("{what}: accepted after the stop")),
        Got::Batch(Err(e)) => {
            if !e.is_closed() {
                return Err(format!("{what}: {e}"));
            }
            if e.sent().iter().collect::<Vec<u64>>() != taken {
                return Err(format!("{what}: sent {:?}, expected {taken:?}", e.sent()));
            }
            let rest: Vec<(u32, usize)> = e.rest().iter().map(|(k, m)| (*k, addr(m))).collect();
            let expected: Vec<(u32, usize)> =
                addrs[taken.len()..].iter().map(|a| (key, *a)).collect();
            if rest != expected {
                return Err(format!(
                    "{what}: rest {rest:?}, expected {expected:?} (in order)"
                ));
            }
        }
        Got::Batch(Ok(p)) => return Err(format!("{what}: batch accepted whole: {p:?}")),
    }
    w.release();
    if let Some(stopper) = stopper {
        let drained = stopper
            .join()
            .map_err(|_| format!("{what}: the stop panicked"))?;
        if !drained {
            return Err(format!("{what}: the stop did not drain"));
        }
    }
    let outcome = holder.wait();
    match (stop.forced(), hold, outcome) {
        (false, _, Ok(_)) | (true, Hold::Running, Ok(_)) => {}
        (true, Hold::Suspended, Err(TaskError::Cancelled)) => {}
        (_, _, other) => {
            return Err(format!(
                "{what}: the holding message ended as {:?}",
                other.map_err(|e| e.to_string())
            ))
        }
    }
    assert!(w.executor.shutdown(LONG) || stop == Stop::ExecutorDrop);
    Ok(())
}

/// Every waiting form, for both causes, against `stop`, each case on its
/// own executor, all at once; fails with every failing case.
fn all_forms(stop: Stop) {
    let cases: Vec<_> = FORMS
        .iter()
        .flat_map(|&f| [Cause::Credit, Cause::Span].map(|c| (f, c)))
        .map(|(f, c)| thread::spawn(move || case(f, c, stop)))
        .collect();
    let failed: Vec<String> = cases
        .into_iter()
        .filter_map(|h| match h.join() {
            Ok(Ok(())) => None,
            Ok(Err(e)) => Some(e),
            Err(_) => Some(format!("a case of {stop:?} panicked")),
        })
        .collect();
    assert!(
        failed.is_empty(),
        "{} failed:\n{}",
        failed.len(),
        failed.join("\n")
    );
}

/// The scenario, step by step: a `send` blocked for the one unit,
/// held by a suspended future, comes back with its very message at
/// `close()`; the accepted message goes on and finishes later.
#[test]
fn close_releases_a_send_blocked_for_credit_with_its_own_message() {
    let mut w = world(1, None);
    let first = w.receiver.submit_blocking(1, Box::new(SUSPEND)).unwrap();
    assert_eq!(w.started.recv_timeout(GUARD).unwrap(), SUSPEND);
    let msg: Msg = Box::new(1);
    let at = addr(&msg);
    let (tx, rx) = mpsc::channel();
    let r = w.receiver.clone();
    thread::spawn(move || {
        let _ = tx.send(r.send(2, msg));
    });
    thread::sleep(Duration::from_millis(100));
    assert!(rx.try_recv().is_err(), "the send waits for credit");
    w.receiver.close();
    let back = match rx.recv_timeout(GUARD) {
        Ok(back) => back,
        Err(_) => {
            w.release();
            panic!("the send was still blocked {GUARD:?} after close()");
        }
    };
    match back {
        Err(SubmitError::Closed(m)) => assert_eq!(addr(&m), at, "not the very message"),
        other => panic!(
            "expected Closed(msg), got {:?}",
            other.map_err(|e| e.to_string())
        ),
    }
    assert_eq!(
        w.receiver.in_flight(),
        1,
        "the accepted message is untouched"
    );
    w.release();
    assert_eq!(first.wait().unwrap(), SUSPEND);
    assert!(w.receiver.shutdown(LONG));
    assert!(w.executor.shutdown(LONG));
}

/// One test per stop, each checking that the stop releases every waiting
/// form ([`all_forms`]).
macro_rules! each_stop_releases_every_waiting_form {
    ($($name:ident: $stop:ident,)*) => {$(
        #[test]
        fn $name() {
            all_forms(Stop::$stop);
        }
    )*};
}

each_stop_releases_every_waiting_form! {
    receiver_close_releases_every_waiting_form: ReceiverClose,
    receiver_shutdown_releases_every_waiting_form: ReceiverShutdown,
    receiver_shutdown_async_releases_every_waiting_form: ReceiverShutdownAsync,
    receiver_shutdown_now_releases_every_waiting_form: ReceiverShutdownNow,
    dispatcher_shutdown_releases_every_waiting_form: DispatcherShutdown,
    dispatcher_shutdown_now_releases_every_waiting_form: DispatcherShutdownNow,
    executor_shutdown_releases_every_waiting_form: ExecutorShutdown,
    executor_shutdown_now_releases_every_waiting_form: ExecutorShutdownNow,
    dropping_the_last_executor_handle_releases_every_waiting_form: ExecutorDrop,
}
