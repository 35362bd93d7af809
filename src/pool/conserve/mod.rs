//! Work conservation: no worker idles beside work it could run. The whole
//! protocol is here; the rest of the pool reaches it through two hooks:
//! `Shared::schedule` (whoever queues a task) and `Shared::call_watcher`
//! (whoever queues work behind a running step without queueing a task),
//! plus the idle worker's own [`WorkerCx::steal`] and [`WorkerCx::park`].
//!
//! # Where work starts
//!
//! A key belongs to one of its dispatcher's ports by its hash, for good
//! (`dispatcher/route.rs`): as many ports as workers, so keys spread as
//! evenly as their hashes do, from the first message on. A port runs one
//! turn at a time on its *home* worker, and a mailbox runs on its home
//! (the worker that ran it last). Homes are where work starts, not where
//! it must stay: whichever worker runs a port's turn or a mailbox becomes
//! its home. A handler's message to another key queues that key's port on
//! the handler's own worker (keys that message each other share a worker
//! and deliver without a wake-up); a woken mailbox goes to its home.
//!
//! # Words
//!
//! Four verbs, each with its file:
//!
//! - *watch* (`watch.rs`): look at another worker's step. A worker is
//!   *stuck* when a watch finds it `RUNNING` in the same step (its `steps`
//!   count: a task taken, or a message its port runs lent) that a watch
//!   first saw at least `STUCK_AFTER_US` (50 µs) before. A worker making
//!   progress is never stuck, however busy. Only idle workers watch, and
//!   whoever queues a task while some worker is idle.
//! - *steal* (`steal.rs`): an idle worker takes, from a worker running a
//!   step, in this order: a task queued behind it (the oldest of its run
//!   queue, else of its queue of pushes) when two or more wait, or one
//!   waits behind a stuck step (one task behind a step that makes progress
//!   is the next it runs — typically a handler's message to another key —
//!   and moving it would split keys that message each other); else a
//!   *slice* of the backlog of a port whose turn it runs: up to half of
//!   the deliveries waiting in that port's inbox, each into its key's
//!   mailbox, a new one queued on the thief for a key without one
//!   (`dispatcher/slice.rs`); else, behind a stuck step, the rest of that
//!   port's turn ("Stealing a turn" in `dispatcher/port.rs`). What is
//!   stolen runs on the thief, which becomes its home. The running step
//!   never moves.
//! - *call* (`call.rs`): ask an idle worker to watch (and steal). A
//!   pusher that finds the target worker stuck pushes on an idle worker
//!   instead, or calls one after its push; whoever queues work behind a
//!   step while every idle worker sleeps calls a sleeper.
//! - *yield* (`mod.rs`): a long stretch of a mailbox's turn gives its
//!   thread up before the next message.
//!
//! States of a worker, beside its `RUNNING`/`SPINNING`/`PARKED`/`EXITED`
//! (see `worker/mod.rs`): *idle* (counted in `Idle::count` from when it
//! runs out of work until it has work again), and, among the idle, a
//! *sleeper* (counted in `Idle::sleepers` and marked in its `Watched`):
//! parked without a timeout, watching nobody until called. An idle worker
//! that is not a sleeper is a *watcher*: it watches again by itself.
//!
//! # The pusher's side
//!
//! 1. Push (the task, or the delivery behind a busy port), then a SeqCst
//!    fence (the push's own).
//! 2. Read `Idle::count` (one relaxed load). Zero: nobody could steal,
//!    done. A submit to a busy port does not even do this: it only reads
//!    `Idle::sleepers` (step 4).
//! 3. A task: watch the target worker (before the push, to pick an idle
//!    worker instead if it is stuck; after it, to call one).
//! 4. Work queued behind a step that is not stuck yet (a fresh sighting,
//!    or not watched at all): read `Idle::sleepers` (SeqCst, a line of its
//!    own). Not zero: if no watcher is idle, call one sleeper (`call_sleeper`;
//!    it uncounts the sleeper, so one call serves every pusher).
//!
//! # The parker's side
//!
//! 1. Out of work: count itself idle (`Shared::idle`), then a SeqCst fence.
//! 2. Steal once (a task, a slice, a stuck turn: see *steal*); if it
//!    did, run it and go to 1.
//! 3. Spin or yield as `spin` says (`worker/run.rs`); then park:
//! 4. Count itself a sleeper (`Shared::count_sleeper`), then a SeqCst
//!    fence, then watch the other workers and the ports. If any is
//!    active, stop counting as a sleeper and park watching: wake after
//!    `WATCH_PARK` (100 µs) if a worker has work queued behind its step,
//!    else after `WATCH_PARK_MAX` (1.6 ms), and go to 2. Otherwise sleep
//!    until woken or called.
//!
//! # Why no wake-up is lost
//!
//! Each side writes, fences (SeqCst), then reads what the other writes:
//! the pusher its push then `Idle::count` / `Idle::sleepers`; the parker
//! its count then the queues and the ports. In the SeqCst order one of the
//! two reads comes second and sees the other's write: either the parker's
//! watch sees the work (and steals it, or watches it), or the pusher sees
//! the idle worker (and pushes to it, or calls it). So a step with work
//! behind it is always watched again by some idle worker, which takes
//! what it can. The loom models are `loom-tests/tests/executor_steal.rs`
//! (under loom every running worker is stuck at the first watch, so steals
//! happen wherever they can; `watch_vs_park` and `steal_turn_vs_submit`
//! fail with the pusher's call removed; `slice_vs_lent_key` takes slices);
//! `tests/work_conservation.rs` and `tests/balance.rs` are the public-API
//! side.
//!
//! # Seeing imbalance
//!
//! A worker about to park looks whether another has work of the kind a
//! steal takes waiting (`Shared::work_beside`); if so, the park is counted
//! in `WorkerStats::parked_beside_work`, with its length in
//! `idle_beside_work`. With work conservation on these are the moments a
//! slice came too late or nothing could be taken; with it off, the whole
//! imbalance.
//!
//! A call already pending is not repeated, nor one for the same stuck step
//! within `CALL_INTERVAL` (50 µs) (`Worker::may_call`); a thief watches
//! again by itself after each task it steals.
//!
//! # Yield: long steps give their thread up
//!
//! Stealing needs a worker that is idle, and a CPU for it. With as many
//! busy threads as cores the kernel can queue a worker with work behind
//! the thread running a long step on the same CPU for a whole time slice:
//! nobody is idle, so nothing moves, and a receiver's credit runs out
//! meanwhile. So a stretch of a mailbox's turn that ran for
//! [`LONG_STEP_US`] or more makes its worker yield its thread before the
//! next message ([`WorkerCx::yield_long_step`], counted in
//! `WorkerStats::gave_way`). The first stretch begins as the turn's second
//! message starts (a turn of one message reads no clock), and the clock is
//! read after the 1st, 2nd, 4th, 8th, … message of a stretch (a yield
//! begins the next one): a key whose messages all run long yields after
//! each but its turn's first; a hot key of short ones pays a few reads a
//! turn. Messages run lent a port's free mailbox are not timed: that would
//! be a clock read on every message of the common path. A yield changes no
//! state, so no loom model covers it (under loom the clock reads zero).

mod call;
mod park;
mod steal;
mod watch;

pub(crate) use park::Idle;
pub(crate) use watch::{Sighting, Watched};

use crate::pool::worker::WorkerCx;
use crate::sync::atomic::Ordering::*;

/// How long (µs) a stretch of a mailbox's turn must have run for its
/// worker to yield its thread before the next message (see "Yield" in
/// `conserve/mod.rs`). Far above a short message (1–5 µs), below
/// the kernel's time slice (a few ms), so that a thread queued behind a
/// long step on its CPU waits for one message, not a slice.
pub(crate) const LONG_STEP_US: u32 = 300;

impl WorkerCx<'_> {
    /// A stretch of a mailbox's turn ran for [`LONG_STEP_US`] or more:
    /// yield the thread, so that a thread the kernel queued behind this
    /// one on its CPU (another worker with work, a producer) runs before
    /// the next message (see "Yield" in `mod.rs`).
    #[cold]
    pub(crate) fn yield_long_step(&self) {
        self.me().counters.gave_way.fetch_add(1, Relaxed);
        crate::sync::thread::yield_now();
    }
}
