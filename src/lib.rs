//! Run work **one at a time per key, in arrival order, with different keys in
//! parallel** — on a small shared pool of threads ([`KeyedExecutor`]) or on
//! the callers' own futures and threads ([`Lanes`]) — in any async runtime or
//! none.
//!
//! Every order, account, device or session gets a serial lane; thousands of
//! lanes share a few threads. Handlers may be sync or async: an async handler
//! that awaits holds no thread and delays only its own key, and per-key order
//! holds across `.await`. Backpressure is built in, and a stop hands back
//! every message it did not run.
//!
//! ```
//! use std::time::Duration;
//! use keyed_executor::{handler, KeyedExecutor};
//!
//! let executor = KeyedExecutor::builder().workers(2).build()?;
//! // One handler for many keys: each account's commands run alone, in order.
//! let dispatcher = executor.dispatcher(handler::from_fn(|account: &u64, amount: i64| {
//!     (*account, amount)
//! }));
//! let receiver = dispatcher.receiver(256)?; // one source: 256 unfinished at most
//! let done = receiver.submit_blocking(7, 100)?; // or `receiver.submit(7, 100).await?`
//! assert_eq!(done.wait()?, (7, 100)); // or `done.await?`
//! assert!(executor.shutdown(Duration::from_secs(5)));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! How the code is organised — each front-end's files, which file owns which
//! state machine, and the path of one message through them — is described in
//! `ARCHITECTURE.md` in the repository.
//!
//! # The model
//!
//! - **Keys and mailboxes.** A [`Dispatcher`] runs one [`Handler`](handler::Handler)
//!   for many keys. While a key has work it has a *mailbox*: a FIFO of its
//!   messages and, for an async handler, the future of the message it is
//!   running. The mailbox runs its messages one at a time; the next message
//!   starts only when the previous one's future completed. A mailbox leaves
//!   its key as soon as its queue runs dry (a few dozen empty ones are kept
//!   per worker for reuse), so memory follows the keys that have work now,
//!   not every key ever seen.
//! - **Workers.** One [`KeyedExecutor`] owns `workers` threads, shared by all
//!   its dispatchers — never a thread per key, per dispatcher or per type.
//!   Each worker has its own FIFO of tasks (ports' turns, mailboxes). A
//!   dispatcher spreads its keys over as many *ports* as workers, by the
//!   key's hash, from the first message on; a port's turns run on its
//!   *home* worker (at first port *i* on worker *i*), and a key's mailbox
//!   on the worker that ran it last. After `throughput` messages in one
//!   turn, a mailbox goes to the back of its worker's queue, so a hot key
//!   cannot starve the others. A worker out of work spins for `spin` (zero
//!   by default), then parks.
//! - **Balance and work conservation.** No worker idles beside work it
//!   could run. A worker out of work takes, from a busy one: a task queued
//!   behind its step when two or more wait (or one behind a step *stuck*
//!   for 50 µs: a CPU-heavy message, a handler that blocks); else a
//!   *slice* of a busy port's backlog (up to half of the messages waiting
//!   in its inbox, each into its key's mailbox on the idle worker); else,
//!   behind a stuck step, the rest of that port's turn. What it takes runs
//!   there, and that worker becomes its home. The step itself never moves,
//!   and its key's next messages wait for it (one at a time, in order, as
//!   ever). A parked worker looks again every 100 µs while another has work
//!   waiting, and a submitter wakes one that sleeps. A handler's message to
//!   another key queues that key's port on the handler's own worker (keys
//!   that message each other share a worker). [`WorkerStats::stolen`],
//!   [`WorkerStats::parked_beside_work`] and
//!   [`WorkerStats::idle_beside_work`] show it at work; see "Choosing
//!   settings" for what to expect.
//! - **Routing.** A submitter computes its key's port from the key's hash
//!   (no table) and pushes the message on that port's inbox; the port's
//!   turn moves it into the key's mailbox, or runs it at once if the key
//!   has none. The per-message hand-off between threads is one queue push,
//!   as in a striped pool.
//! - **Async handlers.** A handler's future is polled on the key's worker with
//!   the crate's own waker. `Pending` releases the worker; a wake from any
//!   thread (a runtime's timer or reactor, a channel, another thread)
//!   re-queues the mailbox on its worker.
//! - **Credit.** Messages enter through [`Receiver`]s, one per source (a
//!   partition, a connection, a bounded context). A receiver holds at most
//!   `max_in_flight` unfinished messages (queued or running); the unit comes
//!   back when the message finishes, whatever the outcome. `submit` waits
//!   (asynchronously) for credit, `submit_blocking` blocks, `try_submit` fails
//!   fast with [`SubmitError::Full`] and hands the message back. A slow
//!   handler slows its sources instead of growing a buffer.
//! - **Completion.** Each submitted message has a [`Completion`]: a `Future`
//!   that can also be waited on from a plain thread. It resolves to the
//!   handler's output or a [`TaskError`]: `Panicked` (the worker and the key
//!   go on), `Rejected(msg)` (a force stop handed the message back unrun) or
//!   `Cancelled` (a force stop dropped its suspended future). The `send`
//!   family skips the handle: fire and forget.
//! - **Stop.** [`KeyedExecutor::shutdown`] refuses new messages, runs
//!   everything accepted (suspended futures included) and joins the workers.
//!   [`KeyedExecutor::shutdown_now`] starts nothing new, hands queued messages
//!   back on the calling thread and cancels suspended futures. Dropping the
//!   last `KeyedExecutor` handle does the latter: no thread is left behind.
//!
//! # Partitions, commits and sagas
//!
//! - **One source stops on its own.** A partitioned consumer gives each
//!   partition its own [`Receiver`]. On a rebalance, [`Receiver::close`]
//!   refuses that partition's new records, [`Receiver::shutdown`] (or
//!   [`Receiver::shutdown_async`]) waits until what it accepted finished,
//!   and [`Receiver::shutdown_now`] hands back what is still queued and
//!   cancels its suspended futures: after it returns, none of its messages
//!   starts, so another node may take the partition over. The other
//!   receivers, even on the same keys and workers, go on.
//!   [`Dispatcher::shutdown`] and [`Dispatcher::shutdown_now`] do the same
//!   for one component.
//! - **What to commit.** Every accepted message gets a position (0, 1, 2, …
//!   per receiver), returned by every submit and send. A receiver built
//!   with [`ReceiverBuilder::track_commits`] keeps a commit point:
//!   [`Receiver::committable`] is `Some(n)`, `n` leading positions all
//!   finished — what a consumer commits when keys finish out of order. A
//!   message handed back or cancelled is never passed (it will be delivered
//!   again). Without the setting it is `None`, never a silent 0.
//! - **Batches.** [`Receiver::send_batch`] hands over one poll of records in
//!   one call, paying credit, positions and wake-ups per batch.
//! - **Sagas: handlers that send.** A handler may send to other keys of its
//!   own executor: from a handler a submit never waits for credit — it
//!   takes a free unit, else shares the running message's own unit (once
//!   per message), else is refused with [`SubmitError::Full`]. So one
//!   follow-up per message never deadlocks the pool, whatever the credit.
//!   Give the handler a [`WeakReceiver`] ([`Receiver::downgrade`]) to its
//!   own dispatcher, so it keeps nothing alive:
//!
//! ```
//! use std::sync::atomic::{AtomicUsize, Ordering};
//! use std::sync::{Arc, OnceLock};
//! use keyed_executor::{handler, KeyedExecutor, WeakReceiver};
//!
//! /// A saga's steps: an order is placed, then paid, then shipped.
//! #[derive(Debug, Clone, Copy, PartialEq)]
//! enum Step { Place, Pay, Ship }
//!
//! let executor = KeyedExecutor::builder().workers(2).build()?;
//! let me: Arc<OnceLock<WeakReceiver<u64, Step, ()>>> = Arc::default();
//! let shipped = Arc::new(AtomicUsize::new(0));
//! let (m, s) = (me.clone(), shipped.clone());
//! let orders = executor.dispatcher(handler::from_fn(move |order: &u64, step: Step| {
//!     let next = match step {
//!         Step::Place => Some(Step::Pay),
//!         Step::Pay => Some(Step::Ship),
//!         Step::Ship => {
//!             s.fetch_add(1, Ordering::SeqCst);
//!             None
//!         }
//!     };
//!     if let (Some(next), Some(rx)) = (next, m.get().and_then(WeakReceiver::upgrade)) {
//!         // Never waits here, even with the credit all taken.
//!         rx.send(*order, next).expect("one follow-up always goes through");
//!     }
//! }));
//! let receiver = orders.receiver(1)?; // even with one unit of credit
//! me.set(receiver.downgrade()).ok();
//! for order in 0..100 {
//!     receiver.send(order, Step::Place)?;
//! }
//! while shipped.load(Ordering::SeqCst) < 100 {
//!     std::thread::sleep(std::time::Duration::from_millis(1));
//! }
//! assert!(receiver.shutdown(std::time::Duration::from_secs(10)));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! A stop refuses follow-ups like any new message (`Closed`): let a saga
//! reach its end before closing its receiver. What deadlocks is waiting, inside a handler, for a
//! message of the handler's own key (it queues behind the handler), or
//! blocking a sync handler's thread on a completion whose key needs that
//! worker; see [`Receiver`].
//!
//! # Messages that fail
//!
//! A handler whose outcome is a `Result` can run under a [`RetryPolicy`]
//! (attempts, [`Backoff`] with [`Jitter`], which errors are retried; a panic
//! counts as a failed attempt): [`handler::retrying`] for a sync closure,
//! which borrows the message (no `Clone` bound), and
//! [`handler::retrying_async`] for an async one, whose future hands the
//! message back with its error.
//!
//! - **Order holds, no worker is held.** A message waiting for its next
//!   attempt keeps its key (the key's later messages wait behind it), keeps
//!   its unit of credit, and holds no worker: the wait is on the handler's
//!   own timer thread (one, started at the first backoff), which wakes the
//!   mailbox. Other keys run meanwhile.
//! - **Dead letters.** When attempts run out, or a failure is not retried,
//!   the message goes to [`Retrying::on_dead_letter`](handler::Retrying::on_dead_letter)
//!   with its key, last failure, attempt count and position (the hook runs
//!   outside every lock of the crate, in `catch_unwind`); the completion
//!   says [`TaskError::DeadLettered`] (with the message, if no hook took
//!   it), and for the commit point it is finished: `committable()` moves
//!   past it, so a poison record does not stall its partition.
//! - **Stops.** A graceful stop lets a message in its backoff finish its
//!   attempts (within the timeout); a force stop of any scope hands it back
//!   at once as [`TaskError::Rejected`] (or to `on_reject` for a `send`),
//!   as it does a queued message: it is never run again. An async attempt
//!   that is itself pending ends [`TaskError::Cancelled`], as any
//!   suspended future does.
//! - **Visibility.** [`ExecutorStats::retried`],
//!   [`ExecutorStats::dead_lettered`] and [`ExecutorStats::expired`] (per
//!   worker too), the `metrics` series `keyed_executor_retries_total` and
//!   `keyed_executor_messages_total{outcome="dead_lettered"|"expired"}`,
//!   and a WARN event per dead letter with the `tracing` feature.
//!
//! ```
//! use std::sync::{Arc, Mutex};
//! use std::time::Duration;
//! use keyed_executor::handler::{self, DeadLetter};
//! use keyed_executor::{Backoff, KeyedExecutor, RetryPolicy, TaskError};
//!
//! #[derive(Debug)]
//! enum ApplyError { Unavailable, Malformed }
//! impl std::fmt::Display for ApplyError {
//!     fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
//!         write!(f, "{self:?}")
//!     }
//! }
//!
//! let policy = RetryPolicy::builder()
//!     .max_attempts(3)
//!     .backoff(Backoff::exponential(Duration::from_millis(1), Duration::from_millis(50)))
//!     .retry_if(|e: &ApplyError| matches!(e, ApplyError::Unavailable))
//!     .build()?;
//! let dead = Arc::new(Mutex::new(Vec::new()));
//! let d = dead.clone();
//! let executor = KeyedExecutor::builder().workers(2).build()?;
//! let dispatcher = executor.dispatcher(
//!     handler::retrying(policy, |_account: &u64, record: &String| {
//!         if record.starts_with('{') { Ok(record.len()) } else { Err(ApplyError::Malformed) }
//!     })
//!     // E.g. write it to a dead-letter stream; here, keep it.
//!     .on_dead_letter(move |letter: DeadLetter<u64, String, ApplyError>| {
//!         d.lock().unwrap().push((letter.position, letter.message));
//!     }),
//! );
//! let receiver = dispatcher.receiver_builder().track_commits(true).build()?;
//! let good = receiver.submit_blocking(7, "{}".to_owned())?;
//! let poison = receiver.submit_blocking(7, "garbage".to_owned())?;
//! let after = receiver.submit_blocking(7, "{\"n\":1}".to_owned())?;
//! assert_eq!(good.wait()?, 2);
//! match poison.wait() {
//!     Err(TaskError::DeadLettered { attempts: 1, .. }) => {} // not retryable
//!     other => panic!("{other:?}"),
//! }
//! assert_eq!(after.wait()?, 7);
//! assert_eq!(receiver.committable(), Some(3)); // the partition moved on
//! assert_eq!(*dead.lock().unwrap(), [(1, "garbage".to_owned())]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! **Deadlines.** [`handler::with_deadlines`] wraps a handler of `M` as
//! one of [`Timed<M>`](handler::Timed): a message with its own deadline
//! ([`Timed::until`](handler::Timed::until),
//! [`Timed::within`](handler::Timed::within)) and the handler's
//! time-to-live ([`Deadlined::ttl`](handler::Deadlined::ttl), counted from
//! when the `Timed` was made), whichever comes first. A message whose
//! deadline passed before it started is not run: it ends
//! [`TaskError::Expired`], through its completion or to
//! [`on_expire`](handler::Deadlined::on_expire) (for `send`), and counts as
//! finished for the commit point. A started message is never interrupted;
//! a retrying handler inside does not start an attempt past the deadline
//! (the message ends `Expired`). Handlers that are not wrapped pay nothing.
//!
//! ```
//! use std::time::{Duration, Instant};
//! use keyed_executor::handler::{self, Timed};
//! use keyed_executor::{KeyedExecutor, TaskError};
//!
//! let executor = KeyedExecutor::builder().workers(1).build()?;
//! let dispatcher = executor.dispatcher(
//!     handler::with_deadlines(handler::from_fn(|_key: &u64, quote: u32| quote))
//!         .ttl(Duration::from_secs(5)),
//! );
//! let receiver = dispatcher.receiver(16)?;
//! let stale = Timed::until(1, Instant::now()); // already due
//! match receiver.submit_blocking(7, stale)?.wait() {
//!     Err(TaskError::Expired { message: Some(m) }) => assert_eq!(m.into_inner(), 1),
//!     other => panic!("{other:?}"),
//! }
//! assert_eq!(receiver.submit_blocking(7, Timed::new(2))?.wait()?, 2);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! # Two front-ends
//!
//! | | [`KeyedExecutor`] | [`Lanes`] |
//! |---|---|---|
//! | who runs the work | the executor's worker threads | the callers' own futures / threads (no threads of its own) |
//! | unit | a message to a handler | a command to a [`Kernel`], **batched** per key |
//! | backpressure | per-source credit, submitters wait | per-lane capacity and a node-wide [`InFlightLimit`]: refused at once with `Busy { retry_after }` |
//! | stop | `shutdown(timeout)` drains, `shutdown_now()` hands messages back | `close(timeout)` |
//! | use it for | event handling, projections, per-device or per-session work: many messages, a handler each, sync or async | command handling against a store with group commit: decide a batch in turn, append once |
//!
//! Take `Lanes` when the expensive part is a per-key append whose cost barely
//! depends on its size (an event store, a log, a database row): a hot key then
//! commits a batch per append instead of a command per append, and callers
//! that would wait too long get `Busy` instead of queueing. Take
//! `KeyedExecutor` for everything else, and when the work should not run on
//! the callers' tasks (fire-and-forget, a consumer loop that must keep
//! polling, CPU-bound handlers). A process can use both.
//!
//! # Choosing settings
//!
//! - **`workers`** (default: [`std::thread::available_parallelism`], which
//!   honours cgroup CPU quotas). For CPU-bound sync handlers: the cores the
//!   rest of the process leaves free (a tokio runtime in the same process has
//!   its own workers). For mostly-async handlers: one or two are usually
//!   enough, since a pending future holds no worker. A handler that *blocks*
//!   (file I/O, a sync database driver) or computes for long holds its
//!   worker for that step: the keys queued behind it move to an idle worker
//!   (work conservation), so they wait only when every worker is busy — but
//!   no executor can give back a thread a handler blocks, so with as many
//!   blocked steps as workers everything waits. Move blocking calls off the
//!   pool (e.g. tokio's `spawn_blocking`, awaited), or size `workers` for
//!   them knowingly. Expect a CPU-heavy key to cost the other keys about
//!   50–150 µs of latency when its step begins (until it is seen stuck),
//!   not the length of its step.
//! - **`throughput`** (default 16): messages a mailbox runs in one turn before
//!   going to the back of its worker's queue. Higher favours hot keys'
//!   throughput (fewer re-queues), lower the latency of other keys on the same
//!   worker; 1 is strict round-robin.
//! - **`spin`** (default zero, at most [`MAX_SPIN`]): how long an idle worker
//!   spins before it parks. Parking costs the sender a wake-up (a syscall) and
//!   the message the woken thread's scheduling delay; spinning costs a core
//!   while it lasts. Worth 10–100 µs only for in-memory, high-rate dispatch
//!   whose messages arrive microseconds apart, on cores you own (in the
//!   benchmarks, 50 µs lifted a hot-key workload by ~30 % and cost nothing at
//!   one message per millisecond, where the adaptive rule stops spinning).
//!   **In a container with a CPU quota, keep it at zero**: spinning spends
//!   the quota and gets the whole process throttled.
//! - **`max_in_flight`** (per receiver; [`DEFAULT_MAX_IN_FLIGHT`] = 256): how
//!   far a source may run ahead of its handlers. It bounds memory (at most that
//!   many messages of this source exist) and queueing delay (about
//!   `max_in_flight / rate`). To keep async handlers busy it must cover the
//!   work in flight: `rate × handler latency` (10,000 msg/s of 1 ms writes need
//!   10). A single fast producer feeding sync handlers gains from more (1,024
//!   or so) because it wakes workers less often. One key may use all of a
//!   source's credit: there is no per-key limit.
//! - **Hasher** ([`DispatcherBuilder::hasher`]): [`DefaultHashBuilder`] (a
//!   fast hash seeded at random per dispatcher) by default; for keys an
//!   adversary chooses and can probe, `std::hash::RandomState::new()`
//!   (SipHash) resists HashDoS better, at about 25 ns more per submit.
//! - **Names and hooks**: `thread_name` (`{prefix}-{i}`), `thread_stack_size`,
//!   `on_thread_start` / `on_thread_stop` (run on each worker; all start hooks
//!   ran before `build()` returns, all stop hooks before `shutdown` returns
//!   `true`).
//!
//! # Compared with the usual alternatives
//!
//! **A task per key on tokio** (an actor: a spawned task owning an `mpsc`
//! receiver, senders in a map). Ordering across `.await` comes for free and
//! it is quick to write. But each key keeps a task and a channel for as long
//! as it is in the map — about 1.1 KB per key in `BENCHMARKS.md`, W5 — and
//! removing idle ones races with new messages (a message sent to an actor
//! that is exiting is lost unless you close that race: this crate does, under
//! the lock of the key's worker port). Backpressure is per key (a bounded channel each),
//! not per source, and every message to an idle key is a wake through the
//! runtime's scheduler. It also ties the code to tokio. Here a key costs
//! memory only while it has work, credit is per source, sync handlers never
//! touch a runtime, and the same code runs under tokio, smol or plain threads.
//!
//! **A striped pool** (N single-thread executors, key → thread by hash, as in
//! BookKeeper's or Hazelcast's ordered executors). Simple and very fast for
//! short sync handlers. But a handler that waits blocks every key of its
//! stripe (`BENCHMARKS.md`, W3: a 100 µs wait caps a stripe at 10,000
//! messages/s), a hot key's stripe stays busy while others idle, queues are
//! unbounded unless you add a bound, and async handlers need a runtime per
//! stripe. Here a pending future holds no worker, a key's mailbox is placed
//! on a worker with nothing queued (if there is one) each time it is
//! created, and credit bounds every source.
//!
//! See `BENCHMARKS.md` in the repository for the measured comparison.
//!
//! # Runtime interop
//!
//! The crate depends on no async runtime: its futures ([`SubmitFuture`],
//! [`SendFuture`], [`Completion`], `Lanes::execute`, `Lanes::close`) are woken
//! through the standard [`Waker`](std::task::Waker), and the handlers' futures
//! are polled with the crate's own waker, so a wake may come from any thread
//! of any runtime. The test suite (`tests/interop_*.rs`) runs the same
//! scenarios from tokio (multi-thread and current-thread), smol, async-io,
//! `futures::executor::block_on`, `pollster`, and plain threads.
//!
//! - **Handles.** [`Completion`] is `Send`, `Sync` and `Unpin`; after it has
//!   yielded its outcome it stays `Pending` forever (fused) and
//!   [`Completion::is_terminated`] is true. It does not implement
//!   `futures::future::FusedFuture` (that would need `futures-core` as a
//!   dependency): in `futures::select!`, wrap it with `.fuse()`. Dropping it
//!   never cancels the message; to bound a wait, use your runtime's timeout
//!   on `.await`, or [`Completion::wait_timeout`] (which hands the handle back).
//! - **Blocking calls** (`submit_blocking`, `send`, `wait`, `wait_timeout`,
//!   `Lanes::execute_blocking`) park the calling thread. Inside an async task
//!   that blocks the runtime's thread with everything scheduled on it: prefer
//!   `.await` there, or call them on a blocking thread (tokio's
//!   `spawn_blocking` / `block_in_place`). On a **current-thread** runtime,
//!   never block its thread waiting for a handler that needs that runtime
//!   (its timers and sockets only make progress while the thread drives it):
//!   that is a deadlock.
//! - **smol / async-io** timers and I/O work in handlers with no set-up:
//!   async-io drives them from its own thread.
//! - **tokio** timers and sockets must be *created* inside a tokio runtime
//!   context (`tokio::time::sleep` panics with "there is no reactor running"
//!   otherwise), and a handler's future runs on the executor's workers. Two
//!   ways:
//!   1. Enter the runtime on every worker, once, with the builder's hook:
//!
//!      ```
//!      # let rt = tokio::runtime::Runtime::new().unwrap();
//!      let handle = rt.handle().clone();
//!      let executor = keyed_executor::KeyedExecutor::builder()
//!          .on_thread_start(move || std::mem::forget(handle.enter()))
//!          .build()?;
//!      # Ok::<(), keyed_executor::ConfigError>(())
//!      ```
//!
//!      `Handle::enter` returns an `EnterGuard` that is `!Send` and borrows
//!      the handle, so it cannot outlive the hook's call unless it is
//!      forgotten. Forgetting it is sound and leaks nothing: it only skips
//!      restoring the thread's previous context (a fresh worker has none),
//!      and the thread's context is released when the worker exits. Then
//!      handlers can `tokio::time::sleep(..).await` or use `tokio::net`
//!      directly. Shut the executor down before dropping the runtime: a
//!      handler that creates a timer after the runtime shut down panics
//!      (and fails its message with `Panicked`).
//!   2. Or run the tokio part on the runtime and await its `JoinHandle`
//!      (which needs no context): `handle.spawn(async move { sleep(d).await
//!      }).await`. Create the tokio resource *inside* the spawned block:
//!      `handle.spawn(tokio::time::sleep(d))` calls `sleep` on the worker and
//!      panics.
//! - **Lanes** run the kernel inside the caller's future, so a kernel sees
//!   the caller's runtime context; `execute_blocking` runs it on the calling
//!   thread.
//! - **Spawning.** `KeyedExecutor` implements [`futures_task::Spawn`], so
//!   `futures::task::SpawnExt::{spawn, spawn_with_handle}` run a future on the
//!   workers (unkeyed). Graceful `shutdown` waits for spawned futures,
//!   `shutdown_now` drops them, and a closed executor refuses new ones
//!   ([`futures_task::SpawnError::shutdown`]). For futures that must run one
//!   at a time *per key*, use a dispatcher whose handler is the future:
//!   `handler::from_async_fn(|_key: K, job: BoxFuture<'static, T>| job)`.
//!
//! # Async pipelines (the `sink` feature)
//!
//! With the `sink` cargo feature, `Receiver::sink()` (a clone of the
//! receiver inside) and `Receiver::into_sink()` give a `ReceiverSink`: a
//! receiver as a `futures::Sink<(K, M)>`, for `stream.forward(sink)`,
//! `SinkExt::send_all` and `SinkExt::send` — where a streaming client's
//! records (rdkafka's `StreamConsumer::stream()`, a Redis stream read in a
//! loop) meet a dispatcher.
//!
//! - Credit is the backpressure: `poll_ready` reserves one unit of
//!   `max_in_flight` (waiting without holding a thread), and `start_send`
//!   enqueues on it, never refusing for credit after `poll_ready` said
//!   ready. A reserved unit counts as in flight and comes back when unused
//!   (the sink's drop, `abort_send`, `poll_close`).
//! - A stop of the receiver, its dispatcher or the executor wakes a
//!   waiting `poll_ready`; `start_send` then hands the pair back as
//!   [`SubmitError::Closed`]`((key, message))`, so `forward` ends with the
//!   record it held. `poll_ready` itself never fails: an error there would
//!   leave the item with the combinator, which drops it.
//! - `poll_flush` is ready at once (every item is accepted inside
//!   `start_send`); `poll_close` ends that sink, not the receiver, and
//!   does not wait for the messages to finish (use
//!   [`Receiver::shutdown_async`], or `submit` and the completions).
//! - Fire-and-forget like [`Receiver::send`]; from a handler of the same
//!   executor it never waits (as a submit from a handler never does).
//!
//! The `ReceiverSink` docs (built with the feature) have a runnable
//! example; `examples/stream_pipeline.rs` feeds a `Stream` of records into
//! a dispatcher and revokes it mid-stream.
//!
//! # Observability
//!
//! - [`KeyedExecutor::stats`] returns an [`ExecutorStats`] snapshot — live
//!   mailboxes, per worker its state, queued mailboxes, messages done /
//!   panicked / cancelled, parks, unparks and spins that found work, plus the
//!   messages handed back by a force stop and the spawned futures' counters.
//!   It reads relaxed counters and briefly locks each dispatcher shard to
//!   count mailboxes: cheap enough to poll every second.
//! - [`Receiver::in_flight`] (per source) and [`Dispatcher::live_mailboxes`];
//!   [`Lanes::in_flight`], [`Lanes::lanes_alive`], [`Lanes::busy_keys`].
//! - The **`tracing` cargo feature** (off by default; zero cost when off: no
//!   field, branch or call is compiled in) adds, under the target
//!   `keyed_executor`: a DEBUG span `message` (fields `dispatcher`,
//!   `key_hash`, `worker`) entered around each message's handler call and
//!   every poll of its future,
//!   so a handler's own events nest under it; WARN events for a panicking
//!   handler or spawned future, and for a graceful shutdown that timed out or
//!   took more than half its timeout; a DEBUG event per message a stop
//!   hands back (the executor's force stop, or a receiver's or a
//!   dispatcher's `shutdown_now`) and an INFO summary of the executor's
//!   force stop; a WARN event per slow
//!   step (fields `dispatcher`, `key_hash`, `worker`, `running_for`). The
//!   events name their dispatcher in a `dispatcher` field. [`LanesEvent`]s
//!   without an `on_event` hook become WARN events (target
//!   `keyed_executor::lanes`) instead of lines on standard error.
//!
//! - **Names.** Every dispatcher has a name
//!   ([`DispatcherBuilder::name`]; default `dispatcher-{n}`, counting the
//!   executor's dispatchers from 1), and so does every `Lanes`
//!   ([`LanesBuilder::name`](lanes::LanesBuilder::name); default the
//!   kernel's type name): they label the metrics series, the tracing
//!   events and [`ExecutorStats::dispatchers`].
//! - **Slow steps.** [`Builder::slow_step`]`(threshold)` reports, once each,
//!   the handler steps (a call with its first poll, or a later poll) that
//!   run longer than `threshold`: to the [`Builder::on_slow_step`] hook
//!   (a [`SlowStep`]: dispatcher, key hash, worker, duration), as a WARN
//!   event with `tracing`, and in `keyed_executor_slow_steps_total` with
//!   `metrics`. No timer thread: the step's worker checks when the step
//!   ends, another worker when it runs out of work, and every
//!   [`KeyedExecutor::stats`] call checks the steps running then (a step
//!   stuck forever is reported by the next `stats()` after the threshold).
//!   [`WorkerStats::current_step`] shows what each worker runs and for how
//!   long. It costs a clock reading and a few stores per step (40–50 ns
//!   here: noise for handlers of microseconds, a doubling of the worker's
//!   cost for handlers that do nothing), and a branch without a threshold.
//!
//! # Metrics
//!
//! The **`metrics` cargo feature** (off by default; nothing of it is
//! compiled in without it) records through the
//! [`metrics`](https://docs.rs/metrics) facade, so any exporter works
//! (`metrics-exporter-prometheus`, StatsD, OpenTelemetry bridges;
//! `examples/metrics_prometheus.rs` serves them to Prometheus). Handles are
//! registered when the executor, a dispatcher, a receiver or a `Lanes` is
//! built: install the recorder first. The series:
//!
//! | series | type | labels | what |
//! |---|---|---|---|
//! | `keyed_executor_messages_total` | counter | `dispatcher`, `outcome` = `done` / `panicked` / `rejected` / `cancelled` / `refused` | messages by how they ended: an output, a panic, handed back by a stop, suspended future dropped by a stop (the executor's force stop, or [`Receiver::shutdown_now`] / [`Dispatcher::shutdown_now`]), refused at submission (`Full` or `Closed`) |
//! | `keyed_executor_slow_steps_total` | counter | `dispatcher` | steps reported slow ([`Builder::slow_step`]) |
//! | `keyed_executor_in_flight` | gauge | `dispatcher`, `receiver` (its name: [`Dispatcher::named_receiver`], [`ReceiverBuilder::name`]; else its number: `0`, `1`, …) | [`Receiver::in_flight`]: its units of credit held by unfinished messages (one per message it accepted; a follow-up a handler sent sharing its own message's unit adds none) |
//! | `keyed_executor_live_mailboxes` | gauge | `dispatcher` | keys with a mailbox (a backlog or a suspended future) |
//! | `keyed_executor_workers_parked` | gauge | — | worker threads asleep (all executors of the process) |
//! | `keyed_executor_parks_beside_work_total` | counter | `worker` | times a worker parked while another had work an idle worker takes waiting ([`WorkerStats::parked_beside_work`]): the pool's imbalance |
//! | `keyed_executor_idle_beside_work_microseconds_total` | counter | `worker` | how long those parks lasted ([`WorkerStats::idle_beside_work`]) |
//! | `keyed_executor_queue_seconds` | histogram | `dispatcher` | acceptance → first poll (sampled) |
//! | `keyed_executor_run_seconds` | histogram | `dispatcher` | first poll → outcome delivered, suspended time included (sampled) |
//! | `keyed_executor_poll_seconds` | histogram | `dispatcher` | one step: a handler call with its first poll, or a later poll (sampled) |
//! | `keyed_executor_lane_commands_total` | counter | `lanes`, `outcome` = `ok` / `error` / `panicked` / `withdrawn` / `busy` / `closed` | Lanes commands by outcome (`withdrawn`: its deadline passed, or its caller left, before a batch took it) |
//! | `keyed_executor_lane_busy_total` | counter | `lanes`, `reason` = `lane_full` / `in_flight_limit` | `Busy` refusals |
//! | `keyed_executor_lane_batch_size` | histogram | `lanes` | commands per kernel batch |
//! | `keyed_executor_lane_wait_seconds` | histogram | `lanes` | a command's wait in its lane before its batch started (the `Lanes`' clock) |
//!
//! How they stay cheap (the cost on W1 is in `BENCHMARKS.md`): a worker
//! counts outcomes in plain per-worker cells and adds them to the handles
//! every 1,024 messages and before it parks, so a scrape's counters lag by
//! at most that; one message in `metrics_sampling` (a builder setting with
//! the feature; default 256, counted by position in the receiver, so at
//! least the first message of each receiver) is timed for the `_seconds`
//! histograms (three clock readings); `in_flight` is re-read when a worker flushes, before
//! it parks, on every [`KeyedExecutor::stats`] call and after a stop — a
//! source stalled behind stuck workers shows its last value until then, so
//! call `stats()` from the scrape loop to refresh it. With the Prometheus
//! exporter, give the `_seconds` series buckets (`set_buckets_for_metric`),
//! or it renders them as summaries.
//!
//! # Checking your own code with loom
//!
//! Built with `RUSTFLAGS="--cfg loom"`, the crate takes every atomic, lock,
//! condition variable, `Arc`, thread and queue from
//! [loom](https://docs.rs/loom), so an executor created inside *your* loom
//! model runs its real workers, credit, stops and wake-ups interleaved with
//! your handlers and threads, and loom checks your invariants on every
//! schedule within its preemption bound. Add `loom = "0.7"` (the crate's
//! own loom) under `[target.'cfg(loom)'.dev-dependencies]` and run:
//!
//! ```text
//! RUSTFLAGS="--cfg loom -C debug_assertions" LOOM_MAX_PREEMPTIONS=2 \
//!     cargo test --release --target-dir target/loom --test my_model
//! ```
//!
//! The worked example, `loom-tests/tests/user_model.rs` in the repository
//! (public API only): a saga handler that forwards an order's next step to
//! another key while its receiver shuts down loses no order — one worker,
//! two preemptions: 24,735 executions, about 8 s on a 2-core machine; a
//! version that ignores the `Closed` refusal fails at once. The README,
//! "Checking your own code with loom", gives the measurements and the
//! rules; in short:
//!
//! - at most 5 loom threads per model, main included: each worker, each of
//!   your threads, and the crate's helper threads (a retry backoff's timer,
//!   `shutdown_async`'s timeout) count; use one or two workers (each
//!   multiplies the executions about tenfold);
//! - no clock: a timed wait is untimed (a stop that cannot finish is a loom
//!   deadlock), and deadlines, `ttl` and backoffs read the real clock;
//! - give the dispatcher a fixed hasher
//!   ([`DispatcherBuilder::hasher`] with
//!   `BuildHasherDefault::<DefaultHasher>`): loom replays executions, and
//!   the default hasher is seeded at random;
//! - share your state through loom's types; loom treats `SeqCst` loads and
//!   stores as acquire / release, so rely on `fence(SeqCst)` for a single
//!   order;
//! - there is no `WeakReceiver` under loom (loom has no `Weak`): hold a
//!   `Receiver` in a slot emptied at the end, or the cycle leaks and fails
//!   the model;
//! - loom 0.7 fails a `join` interrupted by a late wake-up of a thread that
//!   waited inside the crate: wait on spawned threads, join from one that
//!   did not;
//! - `work_conservation(false)` keeps a model small unless work
//!   conservation is what you check.
//!
//! # Cargo features
//!
//! - `tracing`: the spans and events above (adds the `tracing` dependency).
//! - `metrics`: the series above (adds the `metrics` facade, nothing else).
//! - `sink`: `ReceiverSink`, a receiver as a `futures::Sink` (adds
//!   `futures-sink`, the trait's own crate, without dependencies).
//!
//! [`Kernel`]: lanes::Kernel
//! [`InFlightLimit`]: limit::InFlightLimit
//! [`LanesEvent`]: lanes::LanesEvent
#![deny(missing_docs)]
#![warn(unreachable_pub)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub(crate) mod sync;

mod completion;
pub mod error;
pub mod lanes;
pub mod limit;
mod pool;
mod timer;
mod trace;
mod waiter;

pub use completion::{Completion, Outcome};
pub use error::{ConfigError, Panic, SubmitError, TaskError};
pub use lanes::{BatchResult, Kernel, LaneError, Lanes};
pub use limit::InFlightLimit;
pub use pool::batch::{BatchError, Positions, SendBatchFuture};
pub use pool::config::{
    Builder, DEFAULT_MAX_IN_FLIGHT, DEFAULT_THREAD_NAME, DEFAULT_THROUGHPUT, MAX_SPIN, MAX_WORKERS,
};
pub use pool::dispatcher::{DefaultHashBuilder, DefaultHasher, Dispatcher, DispatcherBuilder};
pub use pool::executor::KeyedExecutor;
#[doc(inline)]
pub use pool::handler;
#[cfg(not(loom))]
pub use pool::receiver::WeakReceiver;
pub use pool::receiver::{
    Receiver, ReceiverBuilder, SendFuture, ShutdownFuture, SubmitFuture,
    DEFAULT_COMMIT_SPAN_FACTOR, MIN_DEFAULT_COMMIT_SPAN,
};
pub use pool::retry::{Backoff, Failure, Jitter, RetryDecision, RetryPolicy, RetryPolicyBuilder};
pub use pool::stats::{
    CurrentStep, DispatcherStats, ExecutorStats, SlowStep, SpawnedStats, WorkerState, WorkerStats,
};

#[cfg(feature = "metrics")]
pub use crate::pool::config::DEFAULT_METRICS_SAMPLING;
#[cfg(feature = "sink")]
pub use crate::pool::receiver::ReceiverSink;

/// Internals that the loom models in `loom-tests/` check directly (built
/// with `--cfg loom` only; not part of the API).
#[cfg(loom)]
#[doc(hidden)]
pub mod __loom {
    pub use crate::pool::inbox::Inbox;
    pub use crate::timer::{Sleep, TimerKey, Timers};
}

/// The README's examples, compiled and run as doctests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
