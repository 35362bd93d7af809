//! The executor's [`metrics`](https://docs.rs/metrics) instrumentation,
//! behind the `metrics` cargo feature (the `Lanes` front-end has its own,
//! in `lanes/metrics.rs`).
//!
//! As in `trace.rs`, every hook is defined twice: with the feature it
//! records through handles registered once (when the executor, a
//! dispatcher or a receiver is built); without it, the types are
//! zero-sized and the functions empty `#[inline(always)]` ones, so the
//! default build carries no field, branch or call for it.
//!
//! # Cost on the message path (with the feature)
//!
//! - Outcome counters: a worker counts `done` / `panicked` (and the
//!   live-mailbox changes) in plain per-worker cells, per dispatcher (the
//!   last four it saw), and adds them to the handles every
//!   [`FLUSH_EVERY`] messages and before it parks. The counters a scrape
//!   sees lag by at most that.
//! - Histograms: a submitter stamps one message in
//!   `metrics_sampling` (default `DEFAULT_METRICS_SAMPLING`, in
//!   `config.rs` with the other defaults; by the
//!   message's position in its receiver, so no counter of its own is
//!   touched, and each receiver's first message is timed) with a clock
//!   reading; the worker reads the clock when the message starts and when
//!   its step ends.
//!   Three readings and three histogram records per sampled message
//!   (see `DEFAULT_METRICS_SAMPLING` for what that costs). The stamp (4
//!   bytes: microseconds, modulo 2^32) travels in the padding of the inbox
//!   slot and beside the envelope in a mailbox's queue, never in the
//!   envelope, whose size every delivery pays.
//! - Gauges: `workers_parked` moves by ±1 around each park; a dispatcher's
//!   `live_mailboxes` by the batched deltas above; each receiver's
//!   `in_flight` is re-read (one load per receiver, under one lock) when a
//!   worker flushes after running messages, when it parks, by
//!   `KeyedExecutor::stats()`, after a force stop or a receiver's or
//!   dispatcher's `shutdown_now`, and when a receiver's last handle and
//!   message are gone (then it is set to 0). A source that stalls with
//!   every worker stuck or asleep keeps its last value until one of those
//!   happens: poll `stats()` from the scrape loop to refresh it.
//!
//! Handles come from the recorder installed when the object is built
//! (`metrics::set_global_recorder`, or `metrics::with_local_recorder`
//! around the build): install the exporter first.

#[cfg(feature = "metrics")]
mod imp {
    use std::cell::{Cell, RefCell};
    use std::time::Instant;

    use metrics::{Counter, Gauge, Histogram, Unit};

    use crate::pool::config::Config;
    use crate::pool::source::SourceRef;
    use crate::pool::worker::WorkerCx;
    use crate::sync::atomic::{AtomicUsize, Ordering::Relaxed};
    use crate::sync::{Arc, Mutex};

    /// Messages a worker counts before adding its counts to the handles.
    pub(crate) const FLUSH_EVERY: u32 = 1024;

    /// Per-worker pending entries (one per dispatcher seen lately).
    const PENDING: usize = 4;

    fn secs(nanos: u64) -> f64 {
        nanos as f64 * 1e-9
    }

    fn describe() {
        use metrics::{describe_counter, describe_gauge, describe_histogram};
        describe_counter!(
            "keyed_executor_messages_total",
            "Messages by outcome: done, panicked, rejected (handed back by a stop: the executor's force stop or a receiver's or dispatcher's shutdown_now), cancelled (suspended future dropped by such a stop), refused (Full or Closed at submission), dead_lettered (given up on by a retrying handler), expired (not run: its deadline passed)"
        );
        describe_counter!(
            "keyed_executor_retries_total",
            "Failed attempts that a retrying handler runs again, over every dispatcher"
        );
        describe_counter!(
            "keyed_executor_slow_steps_total",
            "Handler steps that ran longer than the executor's slow_step threshold"
        );
        describe_gauge!(
            "keyed_executor_in_flight",
            "Units of a receiver's credit held by unfinished messages (queued or running): one per message it accepted, none for a follow-up sharing its sender's unit"
        );
        describe_gauge!(
            "keyed_executor_live_mailboxes",
            "Keys with a mailbox: a backlog or a suspended future"
        );
        describe_gauge!("keyed_executor_workers_parked", "Worker threads asleep");
        describe_counter!(
            "keyed_executor_parks_beside_work_total",
            "Times a worker parked while another had work of the kind an idle worker takes waiting (tasks queued behind its step, a port's backlog): the pool's imbalance, per worker"
        );
        describe_counter!(
            "keyed_executor_idle_beside_work_microseconds_total",
            Unit::Microseconds,
            "How long those parks lasted, per worker"
        );
        describe_histogram!(
            "keyed_executor_queue_seconds",
            Unit::Seconds,
            "Time from acceptance to the first poll (sampled)"
        );
        describe_histogram!(
            "keyed_executor_run_seconds",
            Unit::Seconds,
            "Time from the first poll to the outcome, suspended time included (sampled)"
        );
        describe_histogram!(
            "keyed_executor_poll_seconds",
            Unit::Seconds,
            "Duration of one step: a handler call with its first poll, or a later poll (sampled)"
        );
    }

    // ----- executor ----------------------------------------------------------

    struct SourceGauge {
        credit: SourceRef,
        gauge: Gauge,
    }

    /// The executor's handles and its receivers' gauges.
    pub(crate) struct ExecutorMetrics {
        parked: Gauge,
        /// Per worker: parks beside work, and their length in µs.
        beside: Box<[(Counter, Counter)]>,
        /// `metrics_sampling - 1`.
        mask: u32,
        epoch: Instant,
        sources: Mutex<Vec<SourceGauge>>,
    }

    impl ExecutorMetrics {
        pub(crate) fn new(config: &Config, epoch: Instant) -> Self {
            describe();
            ExecutorMetrics {
                parked: metrics::gauge!("keyed_executor_workers_parked"),
                beside: (0..config.workers)
                    .map(|i| {
                        let w = i.to_string();
                        (
                            metrics::counter!("keyed_executor_parks_beside_work_total", "worker" => w.clone()),
                            metrics::counter!("keyed_executor_idle_beside_work_microseconds_total", "worker" => w),
                        )
                    })
                    .collect(),
                mask: config.metrics_sampling - 1,
                epoch,
                sources: Mutex::new(Vec::new()),
            }
        }

        /// A worker is about to sleep.
        #[inline]
        pub(crate) fn parking(&self) {
            self.parked.increment(1.0);
        }

        /// A worker woke up.
        #[inline]
        pub(crate) fn unparked(&self) {
            self.parked.decrement(1.0);
        }

        /// Worker `worker` parked for `idle` beside work it could not take.
        pub(crate) fn parked_beside_work(&self, worker: usize, idle: std::time::Duration) {
            let (parks, micros) = &self.beside[worker];
            parks.increment(1);
            micros.increment(idle.as_micros() as u64);
        }

        /// The stamp of an accepted message: a clock reading for one in
        /// `metrics_sampling` (by its position in its source).
        #[inline]
        pub(crate) fn stamp(&self, position: u64) -> Stamp {
            if position as u32 & self.mask != 0 {
                return Stamp(0);
            }
            Stamp(micros(self.epoch.elapsed().as_nanos() as u64))
        }

        /// A receiver's credit exists: its `in_flight` gauge.
        pub(crate) fn source_created(
            &self,
            credit: SourceRef,
            dispatcher: &DispatcherMetrics,
            label: Option<String>,
        ) {
            let h = &dispatcher.0;
            let label = label.unwrap_or_else(|| h.receivers.fetch_add(1, Relaxed).to_string());
            let gauge = metrics::gauge!(
                "keyed_executor_in_flight",
                "dispatcher" => h.name.clone(),
                "receiver" => label
            );
            gauge.set(0.0);
            self.sources.lock().push(SourceGauge { credit, gauge });
        }

        /// A receiver's credit is freed (nothing of it is in flight).
        pub(crate) fn source_gone(&self, credit: SourceRef) {
            let mut sources = self.sources.lock();
            if let Some(i) = sources.iter().position(|s| s.credit == credit) {
                sources.swap_remove(i).gauge.set(0.0);
            }
        }

        /// Re-reads every receiver's `in_flight` into its gauge (under the
        /// lock: two refreshes never interleave their reads and writes, and
        /// a credit is not freed meanwhile).
        pub(crate) fn refresh_gauges(&self) {
            for s in self.sources.lock().iter() {
                s.gauge.set(s.credit.get().in_flight() as f64);
            }
        }
    }

    /// Microseconds since the executor's epoch, modulo 2^32 (about 71
    /// minutes), never 0.
    fn micros(nanos: u64) -> u32 {
        ((nanos / 1000) as u32).max(1)
    }

    /// An accepted message's clock reading if it is sampled, else 0:
    /// microseconds since the executor's epoch, modulo 2^32 (4 bytes, so it
    /// fits in the padding of an inbox slot; queue times up to 71 minutes
    /// come out right with wrapping arithmetic).
    #[derive(Clone, Copy, Default)]
    pub(crate) struct Stamp(u32);

    impl Stamp {
        pub(crate) const NONE: Stamp = Stamp(0);

        #[inline]
        pub(crate) fn sampled(&self) -> bool {
            self.0 != 0
        }
    }

    /// A sampled message's first poll (its run's start), kept while its
    /// future is suspended; 0 if not sampled.
    #[derive(Clone, Copy, Default)]
    pub(crate) struct RunStart(u64);

    impl RunStart {
        #[inline]
        pub(crate) fn sampled(&self) -> bool {
            self.0 != 0
        }
    }

    // ----- dispatcher --------------------------------------------------------

    struct Handles {
        name: String,
        done: Counter,
        panicked: Counter,
        rejected: Counter,
        cancelled: Counter,
        refused: Counter,
        dead_lettered: Counter,
        expired: Counter,
        slow_steps: Counter,
        live_mailboxes: Gauge,
        queue: Histogram,
        run: Histogram,
        poll: Histogram,
        /// The next receiver's default label.
        receivers: AtomicUsize,
    }

    /// A dispatcher's handles.
    #[derive(Clone)]
    pub(crate) struct DispatcherMetrics(Arc<Handles>);

    impl DispatcherMetrics {
        pub(crate) fn new(name: &str) -> Self {
            let n = || name.to_owned();
            let outcome = |o: &'static str| {
                metrics::counter!(
                    "keyed_executor_messages_total",
                    "dispatcher" => n(),
                    "outcome" => o
                )
            };
            let live_mailboxes =
                metrics::gauge!("keyed_executor_live_mailboxes", "dispatcher" => n());
            live_mailboxes.set(0.0);
            DispatcherMetrics(Arc::new(Handles {
                done: outcome("done"),
                panicked: outcome("panicked"),
                rejected: outcome("rejected"),
                cancelled: outcome("cancelled"),
                refused: outcome("refused"),
                dead_lettered: outcome("dead_lettered"),
                expired: outcome("expired"),
                slow_steps: metrics::counter!("keyed_executor_slow_steps_total", "dispatcher" => n()),
                live_mailboxes,
                queue: metrics::histogram!("keyed_executor_queue_seconds", "dispatcher" => n()),
                run: metrics::histogram!("keyed_executor_run_seconds", "dispatcher" => n()),
                poll: metrics::histogram!("keyed_executor_poll_seconds", "dispatcher" => n()),
                receivers: AtomicUsize::new(0),
                name: n(),
            }))
        }

        /// Off the workers: counted at once.
        #[cold]
        pub(crate) fn finished_direct(&self, ok: bool) {
            if ok {
                self.0.done.increment(1);
            } else {
                self.0.panicked.increment(1);
            }
        }

        #[cold]
        pub(crate) fn rejected(&self) {
            self.0.rejected.increment(1);
        }

        #[cold]
        pub(crate) fn cancelled(&self) {
            self.0.cancelled.increment(1);
        }

        #[cold]
        pub(crate) fn dead_lettered(&self) {
            self.0.dead_lettered.increment(1);
        }

        #[cold]
        pub(crate) fn expired(&self) {
            self.0.expired.increment(1);
        }

        #[cold]
        pub(crate) fn slow_step(&self) {
            self.0.slow_steps.increment(1);
        }

        /// A force stop took `n` mailboxes out of their maps.
        #[cold]
        pub(crate) fn mailboxes_removed(&self, n: usize) {
            if n > 0 {
                self.0.live_mailboxes.decrement(n as f64);
            }
        }

        /// A message's first poll began at `started` (0: not measured):
        /// records its time in the queue if it is sampled.
        #[inline]
        pub(crate) fn first_poll(&self, stamp: &Stamp, started: u64) -> RunStart {
            if !stamp.sampled() || started == 0 {
                return RunStart(0);
            }
            // A start reused from the previous step's end may precede the
            // acceptance: a "negative" wait is no wait.
            let waited = micros(started).wrapping_sub(stamp.0);
            let waited = if waited > u32::MAX / 2 { 0 } else { waited };
            self.0.queue.record(f64::from(waited) * 1e-6);
            RunStart(started)
        }

        /// A sampled message's step ran from `started` to `ended`; `done`:
        /// it delivered its outcome.
        #[inline]
        pub(crate) fn polled(&self, run: &RunStart, started: u64, ended: u64, done: bool) {
            if !run.sampled() || ended == 0 {
                return;
            }
            self.0.poll.record(secs(ended.saturating_sub(started)));
            if done {
                self.0.run.record(secs(ended.saturating_sub(run.0)));
            }
        }
    }

    /// What one receiver records itself: refusals.
    pub(crate) struct ReceiverMetrics {
        refused: Counter,
    }

    impl ReceiverMetrics {
        pub(crate) fn new(dispatcher: &DispatcherMetrics) -> Self {
            ReceiverMetrics {
                refused: dispatcher.0.refused.clone(),
            }
        }

        #[inline]
        pub(crate) fn refused(&self) {
            self.refused.increment(1);
        }
    }

    // ----- per worker --------------------------------------------------------

    struct Pending {
        handles: Arc<Handles>,
        done: u64,
        panicked: u64,
        mailboxes: i64,
    }

    impl Pending {
        fn flush(&mut self) {
            let h = &self.handles;
            if self.done > 0 {
                h.done.increment(std::mem::take(&mut self.done));
            }
            if self.panicked > 0 {
                h.panicked.increment(std::mem::take(&mut self.panicked));
            }
            match std::mem::take(&mut self.mailboxes) {
                0 => {}
                d if d > 0 => h.live_mailboxes.increment(d as f64),
                d => h.live_mailboxes.decrement(-d as f64),
            }
        }
    }

    /// A worker's counts not yet added to the handles (only its thread).
    ///
    /// Messages done are not counted again here: the worker's own
    /// `Counters::done` (which it bumps for every message anyway) is read,
    /// and the difference since `base` belongs to `hot`, the dispatcher of
    /// the last message done (kept alive by its entry in `pending`). So a
    /// message done costs one pointer compare; only a message of another
    /// dispatcher (a switch), a panic or a mailbox entering or leaving its
    /// map touches `pending`.
    pub(crate) struct WorkerLocal {
        hot: Cell<*const Handles>,
        /// `Counters::done` when `hot`'s messages were last taken.
        base: Cell<u64>,
        /// `Counters::done` at the last flush.
        flushed: Cell<u64>,
        /// Most recent first; at most `PENDING` dispatchers.
        pending: RefCell<Vec<Pending>>,
        /// Panics or mailbox changes since the last flush.
        dirty: Cell<bool>,
    }

    /// The worker's messages done so far (its `Counters::done`).
    #[inline]
    fn done_now(cx: &WorkerCx<'_>) -> u64 {
        cx.shared.workers[cx.index].counters.done.load(Relaxed)
    }

    impl WorkerLocal {
        pub(crate) fn new() -> Self {
            WorkerLocal {
                hot: Cell::new(std::ptr::null()),
                base: Cell::new(0),
                flushed: Cell::new(0),
                pending: RefCell::new(Vec::new()),
                dirty: Cell::new(false),
            }
        }

        /// Gives `hot` its messages done up to `done` (`Counters::done`).
        fn cool(&self, pending: &mut [Pending], done: u64) {
            let n = done - self.base.replace(done);
            let hot = self.hot.get();
            if n > 0 && !hot.is_null() {
                if let Some(p) = pending.iter_mut().find(|p| Arc::as_ptr(&p.handles) == hot) {
                    p.done += n;
                }
            }
        }

        /// The entry of `d` in `pending`, first (made if missing; if full,
        /// the least recent one is flushed and dropped). `hot` was cooled.
        fn entry<'a>(
            &self,
            pending: &'a mut Vec<Pending>,
            d: &DispatcherMetrics,
        ) -> &'a mut Pending {
            let i = match pending.iter().position(|p| Arc::ptr_eq(&p.handles, &d.0)) {
                Some(i) => i,
                None => {
                    if pending.len() == PENDING {
                        let mut evicted = pending.pop().expect("full");
                        if std::ptr::eq(Arc::as_ptr(&evicted.handles), self.hot.get()) {
                            self.hot.set(std::ptr::null());
                        }
                        evicted.flush();
                    }
                    pending.push(Pending {
                        handles: d.0.clone(),
                        done: 0,
                        panicked: 0,
                        mailboxes: 0,
                    });
                    pending.len() - 1
                }
            };
            pending.swap(0, i);
            &mut pending[0]
        }

        /// A message of `d` finished with an output; `done` is the
        /// worker's `Counters::done` counting it.
        #[inline]
        pub(crate) fn done(&self, d: &DispatcherMetrics, done: u64) {
            if !std::ptr::eq(self.hot.get(), Arc::as_ptr(&d.0)) {
                self.switch(d, done - 1);
            }
        }

        /// `d` becomes the hot dispatcher; `before`: `Counters::done`
        /// before its message.
        #[cold]
        fn switch(&self, d: &DispatcherMetrics, before: u64) {
            let mut pending = self.pending.borrow_mut();
            self.cool(&mut pending, before);
            let p = self.entry(&mut pending, d);
            self.hot.set(Arc::as_ptr(&p.handles));
        }

        /// A message of `d` panicked.
        #[cold]
        pub(crate) fn panicked(&self, cx: &WorkerCx<'_>, d: &DispatcherMetrics) {
            let mut pending = self.pending.borrow_mut();
            self.cool(&mut pending, done_now(cx));
            self.entry(&mut pending, d).panicked += 1;
            self.dirty.set(true);
        }

        /// A mailbox of `d` entered (`1`) or left (`-1`) its port's map.
        #[cold]
        pub(crate) fn mailboxes(&self, cx: &WorkerCx<'_>, d: &DispatcherMetrics, delta: i64) {
            let mut pending = self.pending.borrow_mut();
            self.cool(&mut pending, done_now(cx));
            self.entry(&mut pending, d).mailboxes += delta;
            self.dirty.set(true);
        }

        /// After each task: flush if `FLUSH_EVERY` messages were done since
        /// the last flush.
        #[inline]
        pub(crate) fn after_task(&self, cx: &WorkerCx<'_>) {
            let done = done_now(cx);
            if done - self.flushed.get() >= u64::from(FLUSH_EVERY) {
                self.flush_at(done, &cx.shared.metrics);
            }
        }

        /// Adds every pending count to its handles and, if messages
        /// finished since the last refresh, re-reads the in-flight gauges.
        pub(crate) fn flush(&self, cx: &WorkerCx<'_>) {
            self.flush_at(done_now(cx), &cx.shared.metrics);
        }

        fn flush_at(&self, done: u64, ex: &ExecutorMetrics) {
            let dirty = self.dirty.replace(false) | (self.flushed.replace(done) != done);
            {
                let mut pending = self.pending.borrow_mut();
                self.cool(&mut pending, done);
                for p in pending.iter_mut() {
                    p.flush();
                }
            }
            if dirty {
                ex.refresh_gauges();
            }
        }
    }

    /// A message of `d` finished with an output: counted by the worker
    /// (`cx`; `done` is its `Counters::done` counting the message), or at
    /// once off the workers.
    #[inline]
    pub(crate) fn done(cx: Option<&WorkerCx<'_>>, d: &DispatcherMetrics, done: u64) {
        match cx {
            Some(cx) => cx.metrics.done(d, done),
            None => d.finished_direct(true),
        }
    }

    /// A message of `d` panicked: counted by the worker, or at once.
    #[cold]
    pub(crate) fn panicked(cx: Option<&WorkerCx<'_>>, d: &DispatcherMetrics) {
        match cx {
            Some(cx) => cx.metrics.panicked(cx, d),
            None => d.finished_direct(false),
        }
    }

    /// A mailbox of `d` entered (`1`) or left (`-1`) its port's map on
    /// `cx`'s worker.
    #[inline]
    pub(crate) fn mailboxes(cx: &WorkerCx<'_>, d: &DispatcherMetrics, delta: i64) {
        cx.metrics.mailboxes(cx, d, delta);
    }

    /// A retrying handler runs a failed attempt again: counted at once
    /// (a retry waits a backoff; one recorder look-up is nothing beside it).
    #[cold]
    pub(crate) fn retried() {
        metrics::counter!("keyed_executor_retries_total").increment(1);
    }
}

#[cfg(not(feature = "metrics"))]
mod imp {
    use std::time::Instant;

    use crate::pool::config::Config;
    use crate::pool::source::SourceRef;
    use crate::pool::worker::WorkerCx;

    /// Zero-sized without the `metrics` feature.
    pub(crate) struct ExecutorMetrics;

    impl ExecutorMetrics {
        #[inline(always)]
        pub(crate) fn new(_config: &Config, _epoch: Instant) -> Self {
            ExecutorMetrics
        }

        #[inline(always)]
        pub(crate) fn parking(&self) {}

        #[inline(always)]
        pub(crate) fn unparked(&self) {}

        #[inline(always)]
        pub(crate) fn parked_beside_work(&self, _worker: usize, _idle: std::time::Duration) {}

        #[inline(always)]
        pub(crate) fn stamp(&self, _position: u64) -> Stamp {
            Stamp
        }

        #[inline(always)]
        pub(crate) fn source_created(
            &self,
            _credit: SourceRef,
            _dispatcher: &DispatcherMetrics,
            _label: Option<String>,
        ) {
        }

        #[inline(always)]
        pub(crate) fn source_gone(&self, _credit: SourceRef) {}

        #[inline(always)]
        pub(crate) fn refresh_gauges(&self) {}
    }

    /// Zero-sized without the `metrics` feature.
    #[derive(Clone, Copy, Default)]
    pub(crate) struct Stamp;

    impl Stamp {
        pub(crate) const NONE: Stamp = Stamp;

        #[inline(always)]
        pub(crate) fn sampled(&self) -> bool {
            false
        }
    }

    /// Zero-sized without the `metrics` feature.
    #[derive(Clone, Copy, Default)]
    pub(crate) struct RunStart;

    impl RunStart {
        #[inline(always)]
        pub(crate) fn sampled(&self) -> bool {
            false
        }
    }

    /// Zero-sized without the `metrics` feature.
    #[derive(Clone)]
    pub(crate) struct DispatcherMetrics;

    impl DispatcherMetrics {
        #[inline(always)]
        pub(crate) fn new(_name: &str) -> Self {
            DispatcherMetrics
        }

        #[inline(always)]
        pub(crate) fn finished_direct(&self, _ok: bool) {}

        #[inline(always)]
        pub(crate) fn rejected(&self) {}

        #[inline(always)]
        pub(crate) fn cancelled(&self) {}

        #[inline(always)]
        pub(crate) fn dead_lettered(&self) {}

        #[inline(always)]
        pub(crate) fn expired(&self) {}

        #[inline(always)]
        pub(crate) fn slow_step(&self) {}

        #[inline(always)]
        pub(crate) fn mailboxes_removed(&self, _n: usize) {}

        #[inline(always)]
        pub(crate) fn first_poll(&self, _stamp: &Stamp, _started: u64) -> RunStart {
            RunStart
        }

        #[inline(always)]
        pub(crate) fn polled(&self, _run: &RunStart, _started: u64, _ended: u64, _done: bool) {}
    }

    /// Zero-sized without the `metrics` feature.
    pub(crate) struct ReceiverMetrics;

    impl ReceiverMetrics {
        #[inline(always)]
        pub(crate) fn new(_dispatcher: &DispatcherMetrics) -> Self {
            ReceiverMetrics
        }

        #[inline(always)]
        pub(crate) fn refused(&self) {}
    }

    /// Zero-sized without the `metrics` feature.
    pub(crate) struct WorkerLocal;

    impl WorkerLocal {
        #[inline(always)]
        pub(crate) fn new() -> Self {
            WorkerLocal
        }

        #[inline(always)]
        pub(crate) fn after_task(&self, _cx: &WorkerCx<'_>) {}

        #[inline(always)]
        pub(crate) fn flush(&self, _cx: &WorkerCx<'_>) {}
    }

    #[inline(always)]
    pub(crate) fn done(_cx: Option<&WorkerCx<'_>>, _d: &DispatcherMetrics, _done: u64) {}

    #[inline(always)]
    pub(crate) fn panicked(_cx: Option<&WorkerCx<'_>>, _d: &DispatcherMetrics) {}

    #[inline(always)]
    pub(crate) fn mailboxes(_cx: &WorkerCx<'_>, _d: &DispatcherMetrics, _delta: i64) {}

    #[inline(always)]
    pub(crate) fn retried() {}
}

pub(crate) use imp::*;
