//! One owned partition: its receiver, its read connection, the messages in
//! flight and the acks not yet sent.
//!
//! 1. **Claim.** A partition taken from a release claims what its owner
//!    left pending at once; a vacant one (its owner died) first waits until
//!    every pending entry has been idle for the claim idle time, so no
//!    delivery of the old owner is younger than that. Then `XAUTOCLAIM …
//!    0 0-0`, in ID order until the cursor comes back to `0-0`, submitting
//!    each entry. Everything pending has a lower ID than anything new, so
//!    a key's records are submitted in stream order across the move.
//! 2. **Read.** `XREADGROUP … >`, each entry decoded and submitted with
//!    `Receiver::submit(key, message).await` (which waits while the
//!    partition has `max_in_flight` unfinished). Every read goes out
//!    pipelined behind one `XACK` of the entries that finished since the
//!    round before: acking costs no round trip of its own.
//! 3. **Settle.** An entry is acked only after its completion said it was
//!    done and the verdict said ack. A dead letter is written to the
//!    dead-letter stream and acked in one script (`DEAD_LETTER`), so it is
//!    written once however often it is delivered. A message a stop handed
//!    back or cancelled is not acked: it stays pending for the next owner.
//! 4. **Stop.** A hand-off drains the receiver within the hand-off
//!    deadline (else `Receiver::shutdown_now`: queued messages come back,
//!    suspended ones are cancelled), acks what finished, and returns; the
//!    heartbeat then releases the lease. A fence stops the receiver now and
//!    acks nothing.
//!
//! **Lost replies.** A read whose reply is lost (a timeout, a dropped
//! connection) may have been run by Redis: its entries are then pending
//! under this node's name, unseen. After any failed read the loop first
//! reads its own pending entries past the last one it saw (`XREADGROUP …
//! <last seen ID>`) and submits them, then goes back to `>`: nothing is
//! left behind, and nothing overtakes them. A failed `XAUTOCLAIM` is
//! retried from the same cursor (with no idle threshold, so what the lost
//! call claimed comes back). An `XACK` whose reply was lost is sent again
//! with the next round; Redis ignores an ID already acked.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use keyed_executor::{Completion, Dispatcher, Receiver, TaskError};
use redis::{Script, Value};
use tokio::sync::watch;

use crate::builder::Verdict;
use crate::consumer::Common;
use crate::control::{PartitionEnd, Stop};
use crate::entry::{self, DecodeError, Entry};
use crate::link::{backoff, transient, Link};
use crate::scripts;
use crate::stats::{bump, Event, PartitionState, Takeover};

/// The user's decode function, boxed.
pub(crate) type DecodeFn<K, M> = Box<dyn Fn(&Entry) -> Result<(K, M), DecodeError> + Send + Sync>;

/// What every partition loop of one consumer shares (generic over the
/// user's key, message and handler output).
pub(crate) struct Ctx<K, M, O> {
    pub(crate) common: Arc<Common>,
    pub(crate) dispatcher: Dispatcher<K, M, O>,
    pub(crate) decode: DecodeFn<K, M>,
    pub(crate) verdict: Box<dyn Fn(&O) -> Verdict + Send + Sync>,
}

/// An entry to write to the dead-letter stream: the entry, why, attempts.
type Dead = (Entry, String, u32);

struct Partition<K, M, O> {
    ctx: Arc<Ctx<K, M, O>>,
    p: usize,
    stream: String,
    link: Link,
    receiver: Receiver<K, M, O>,
    in_flight: Vec<(Entry, Completion<O, M>)>,
    acks: Vec<String>,
    dead: Vec<Dead>,
    handed_back: u64,
    /// Everything pending when it started has been claimed.
    claimed_all: bool,
    /// Why the partition must stop (a verdict, a panic, a dead letter that
    /// cannot be written).
    halt: Option<String>,
    /// The highest entry ID submitted or dead-lettered here.
    last_seen: Option<String>,
    /// A read failed: its entries may be pending here, unseen.
    recover: bool,
    /// When the lag was last asked for.
    lag_asked: Option<Instant>,
}

/// Claims, then reads, until asked to stop (or halted); then drains or
/// stops.
pub(crate) async fn run_partition<K, M, O>(
    ctx: Arc<Ctx<K, M, O>>,
    p: usize,
    how: Takeover,
    mut stop: watch::Receiver<Stop>,
) -> PartitionEnd
where
    K: Send + Sync + 'static,
    M: Send + 'static,
    O: Send + 'static,
{
    let common = ctx.common.clone();
    let receiver = ctx
        .dispatcher
        .receiver_builder()
        .max_in_flight(common.config.max_in_flight)
        .name(format!("p{p}"))
        .build()
        .expect("max_in_flight was validated");
    let stream = common.config.streams.stream(p).to_string();
    common.counters.partition(p, |s| {
        s.stream = stream.clone();
        s.state = PartitionState::Claiming;
    });
    let mut part = Partition {
        link: common.link(&format!("p{p}")),
        ctx,
        p,
        stream,
        receiver,
        in_flight: Vec::new(),
        acks: Vec::new(),
        dead: Vec::new(),
        handed_back: 0,
        claimed_all: false,
        halt: None,
        last_seen: None,
        recover: false,
        lag_asked: None,
    };
    if part.claim(how, &mut stop).await {
        common
            .counters
            .partition(p, |s| s.state = PartitionState::Reading);
        part.read(&mut stop).await;
    }
    common
        .counters
        .partition(p, |s| s.state = PartitionState::Stopping);
    let how_stopped = *stop.borrow();
    let end = part.finish(how_stopped).await;
    if matches!(end, PartitionEnd::Halted(_)) {
        common.counters.partition(p, |s| {
            s.state = PartitionState::Halted;
            s.in_flight = 0;
        });
    }
    // Wakes the heartbeat (a permit is kept if it is busy right now).
    common.ended.notify_one();
    end
}

fn stopping(stop: &watch::Receiver<Stop>) -> bool {
    *stop.borrow() != Stop::Run
}

impl<K, M, O> Partition<K, M, O>
where
    K: Send + Sync + 'static,
    M: Send + 'static,
    O: Send + 'static,
{
    fn common(&self) -> &Common {
        &self.ctx.common
    }

    /// Claims everything pending in the stream and submits it in ID order.
    /// `false` if asked to stop (or halted) first.
    async fn claim(&mut self, how: Takeover, stop: &mut watch::Receiver<Stop>) -> bool {
        let common = self.ctx.common.clone();
        let cfg = &common.config;
        let began = Instant::now();
        if how == Takeover::Vacant && !self.wait_until_idle(cfg.claim_idle(), stop).await {
            return false;
        }
        let waited = began.elapsed();
        let mut claimed = 0u64;
        let mut cursor = "0-0".to_string();
        let mut attempt = 0;
        loop {
            if stopping(stop) || self.halt.is_some() {
                return false;
            }
            // No idle threshold: a released partition's owner has stopped,
            // a vacant one's pending entries were all idle long enough
            // (above), and a retried call gets back what a lost one claimed.
            let mut cmd = redis::cmd("XAUTOCLAIM");
            cmd.arg(&self.stream)
                .arg(&cfg.group)
                .arg(&cfg.name)
                .arg(0)
                .arg(&cursor)
                .arg("COUNT")
                .arg(cfg.read_count);
            let reply: Value = match self.link.query(&cmd).await {
                Ok(v) => v,
                Err(e) => {
                    common.trouble(format_args!("XAUTOCLAIM {}: {e}", self.stream));
                    backoff(&mut attempt).await;
                    continue;
                }
            };
            attempt = 0;
            let Value::Array(parts) = &reply else {
                self.halt = Some(format!("unexpected XAUTOCLAIM reply {reply:?}"));
                return false;
            };
            let next = parts
                .first()
                .and_then(entry::text)
                .unwrap_or_else(|| "0-0".into());
            let entries = parts.get(1).map(entry::entries).unwrap_or_default();
            claimed += entries.len() as u64;
            bump(&common.counters.redelivered, entries.len() as u64);
            if !self.submit(entries, stop).await {
                return false;
            }
            self.collect();
            self.flush(stop).await;
            if next == "0-0" {
                break;
            }
            cursor = next;
        }
        self.claimed_all = true;
        bump(
            match how {
                Takeover::HandedOff => &common.counters.hand_offs_in,
                Takeover::Vacant => &common.counters.takeovers,
            },
            1,
        );
        common.emit(Event::Started {
            partition: self.p,
            how,
            waited,
            claimed,
        });
        true
    }

    /// Waits until every pending entry of the stream has been idle for
    /// `idle`, so one claim pass takes them all: claiming some and reading
    /// new ones before the rest would let a key's later record overtake an
    /// earlier one.
    async fn wait_until_idle(&mut self, idle: Duration, stop: &mut watch::Receiver<Stop>) -> bool {
        let common = self.ctx.common.clone();
        let mut attempt = 0;
        loop {
            if stopping(stop) {
                return false;
            }
            let mut summary = redis::cmd("XPENDING");
            summary.arg(&self.stream).arg(&common.config.group);
            let pending = match self.link.query::<Value>(&summary).await {
                Ok(Value::Array(v)) => v.first().and_then(entry::number).unwrap_or(0),
                Ok(_) => 0,
                Err(e) => {
                    common.trouble(format_args!("XPENDING {}: {e}", self.stream));
                    backoff(&mut attempt).await;
                    continue;
                }
            };
            if pending == 0 {
                return true;
            }
            let mut old = redis::cmd("XPENDING");
            old.arg(&self.stream)
                .arg(&common.config.group)
                .arg("IDLE")
                .arg(idle.as_millis() as u64)
                .arg("-")
                .arg("+")
                .arg(pending);
            match self.link.query::<Vec<Value>>(&old).await {
                Ok(v) if v.len() as u64 >= pending => return true,
                Ok(_) => {}
                Err(e) => common.trouble(format_args!("XPENDING IDLE {}: {e}", self.stream)),
            }
            tokio::select! {
                _ = tokio::time::sleep(common.config.heartbeat) => {}
                _ = stop.changed() => {}
            }
        }
    }

    /// Reads new entries until asked to stop (or halted).
    async fn read(&mut self, stop: &mut watch::Receiver<Stop>) {
        let common = self.ctx.common.clone();
        let cfg = &common.config;
        let mut attempt = 0;
        while !stopping(stop) && self.halt.is_none() {
            self.collect();
            // Dead letters go out on their own (rare); acks ride on the read.
            self.flush_dead(stop).await;
            if self.recover {
                match self.recover_lost(stop).await {
                    Some(true) => self.recover = false,
                    Some(false) => {
                        backoff(&mut attempt).await;
                        continue;
                    }
                    None => return,
                }
            }
            // One round trip: the acks of everything finished since the
            // last round, the lag now and then, then the read.
            let mut pipe = redis::pipe();
            let acking = !self.acks.is_empty() && !common.stall_acks.load(Ordering::SeqCst);
            if acking {
                pipe.cmd("XACK")
                    .arg(&self.stream)
                    .arg(&cfg.group)
                    .arg(&self.acks);
            }
            let asking_lag = match self.lag_asked {
                Some(t) => t.elapsed() >= Duration::from_secs(1),
                None => true,
            };
            if asking_lag {
                pipe.cmd("XINFO").arg("GROUPS").arg(&self.stream);
            }
            pipe.cmd("XREADGROUP")
                .arg("GROUP")
                .arg(&cfg.group)
                .arg(&cfg.name)
                .arg("COUNT")
                .arg(cfg.read_count)
                .arg("BLOCK")
                .arg(cfg.block.as_millis() as u64)
                .arg("STREAMS")
                .arg(&self.stream)
                .arg(">");
            let replies: Vec<Value> = match self.link.query_pipe(&pipe).await {
                Ok(v) => v,
                Err(e) => {
                    common.trouble(format_args!("XREADGROUP {}: {e}", self.stream));
                    self.recover = true;
                    backoff(&mut attempt).await;
                    continue;
                }
            };
            attempt = 0;
            if acking {
                self.note_acked();
            }
            if asking_lag {
                self.lag_asked = Some(Instant::now());
                let lag = replies
                    .get(usize::from(acking))
                    .and_then(|v| {
                        info_groups(v)
                            .into_iter()
                            .find(|(name, _)| name == &cfg.group)
                    })
                    .and_then(|(_, lag)| lag);
                common.counters.partition(self.p, |s| s.lag = lag);
            }
            let entries = replies.last().map(entry::read_reply).unwrap_or_default();
            bump(&common.counters.read, entries.len() as u64);
            if !self.submit(entries, stop).await {
                return;
            }
        }
    }

    /// After a failed read: reads this node's own pending entries past the
    /// last one seen (entries a lost reply delivered) and submits them.
    /// `Some(true)` when none is left, `Some(false)` on a Redis error (try
    /// again), `None` if asked to stop.
    async fn recover_lost(&mut self, stop: &mut watch::Receiver<Stop>) -> Option<bool> {
        let common = self.ctx.common.clone();
        let cfg = &common.config;
        loop {
            let from = self.last_seen.clone().unwrap_or_else(|| "0".into());
            let mut cmd = redis::cmd("XREADGROUP");
            cmd.arg("GROUP")
                .arg(&cfg.group)
                .arg(&cfg.name)
                .arg("COUNT")
                .arg(cfg.read_count)
                .arg("STREAMS")
                .arg(&self.stream)
                .arg(&from);
            let entries = match self.link.query::<Value>(&cmd).await {
                Ok(v) => entry::read_reply(&v),
                Err(e) => {
                    common.trouble(format_args!(
                        "XREADGROUP {} {from} (own pending): {e}",
                        self.stream
                    ));
                    return Some(false);
                }
            };
            if entries.is_empty() {
                return Some(true);
            }
            bump(&common.counters.redelivered, entries.len() as u64);
            if !self.submit(entries, stop).await {
                return None;
            }
        }
    }

    /// Decodes and submits entries in order, waiting for credit; an entry
    /// that does not decode goes to the dead letters. `false` if asked to
    /// stop first: the entries not submitted stay pending (the next owner
    /// claims them, after those submitted here).
    async fn submit(&mut self, entries: Vec<Entry>, stop: &mut watch::Receiver<Stop>) -> bool {
        for entry in entries {
            if stopping(stop) {
                return false;
            }
            let id = entry.id().to_string();
            match (self.ctx.decode)(&entry) {
                Ok((key, message)) => {
                    let submitted = tokio::select! {
                        biased;
                        _ = stop.changed() => return false,
                        r = self.receiver.submit(key, message) => r,
                    };
                    match submitted {
                        Ok(done) => self.in_flight.push((entry, done)),
                        // Closed: the dispatcher or the executor is stopping
                        // under us (the consumer was dropped).
                        Err(_) => return false,
                    }
                }
                Err(e) => self.dead.push((entry, format!("does not decode: {e}"), 0)),
            }
            self.last_seen = Some(id);
        }
        let in_flight = self.in_flight.len();
        self.ctx
            .common
            .counters
            .partition(self.p, |s| s.in_flight = in_flight);
        true
    }

    /// Settles every finished message of `in_flight`.
    fn collect(&mut self) {
        let mut i = 0;
        while i < self.in_flight.len() {
            if self.in_flight[i].1.is_finished() {
                let (entry, done) = self.in_flight.swap_remove(i);
                self.settle(entry, done.wait());
            } else {
                i += 1;
            }
        }
    }

    fn settle(&mut self, entry: Entry, outcome: Result<O, TaskError<M>>) {
        let counters = &self.ctx.common.counters;
        match outcome {
            Ok(output) => match (self.ctx.verdict)(&output) {
                Verdict::Ack => {
                    bump(&counters.applied, 1);
                    self.acks.push(entry.id().to_string());
                }
                Verdict::DeadLetter(why) => self.dead.push((entry, why, 1)),
                Verdict::Halt(why) => {
                    self.halt
                        .get_or_insert(format!("entry {}: {why}", entry.id()));
                }
            },
            Err(TaskError::DeadLettered {
                attempts, error, ..
            }) => self.dead.push((entry, error, attempts)),
            Err(TaskError::Expired { .. }) => self.dead.push((
                entry,
                "expired: its deadline passed before it started".into(),
                0,
            )),
            // Handed back by a stop: not run (or not to its end); pending.
            Err(TaskError::Rejected(_) | TaskError::Cancelled) => {
                self.handed_back += 1;
                bump(&counters.handed_back, 1);
            }
            Err(TaskError::Panicked(p)) => {
                self.halt
                    .get_or_insert(format!("entry {}: handler panicked: {p}", entry.id()));
            }
            Err(other) => {
                self.halt
                    .get_or_insert(format!("entry {}: {other}", entry.id()));
            }
        }
    }

    fn note_acked(&mut self) {
        bump(&self.ctx.common.counters.acked, self.acks.len() as u64);
        self.acks.clear();
    }

    /// Writes the dead letters, then sends the acks on their own (when no
    /// read carries them).
    async fn flush(&mut self, stop: &watch::Receiver<Stop>) {
        self.flush_dead(stop).await;
        self.flush_acks(stop).await;
    }

    /// Writes the dead letters (each acked with it), retrying while Redis
    /// is away unless the partition is fenced: what could not be written
    /// stays pending and is delivered again. Halts the partition when there
    /// is no dead-letter stream, or Redis refuses the write.
    async fn flush_dead(&mut self, stop: &watch::Receiver<Stop>) {
        let common = self.ctx.common.clone();
        let cfg = &common.config;
        let mut attempt = 0;
        let fenced = || *stop.borrow() == Stop::Fence;
        while !self.dead.is_empty() && !common.stall_acks.load(Ordering::SeqCst) && !fenced() {
            let Some(dlq) = cfg.dead_letter_stream() else {
                let (entry, why, _) = self.dead.remove(0);
                self.halt.get_or_insert(format!(
                    "entry {}: {why}; no dead-letter stream is set, so it stays pending",
                    entry.id()
                ));
                continue;
            };
            let (entry, why, attempts) = &self.dead[0];
            let script = Script::new(scripts::DEAD_LETTER);
            let mut inv = script.prepare_invoke();
            inv.key(&self.stream)
                .key(&dlq)
                .arg(&cfg.group)
                .arg(entry.id())
                .arg(why)
                .arg(*attempts)
                .arg(&cfg.name);
            for (name, value) in entry.fields() {
                inv.arg(name).arg(value);
            }
            match self.link.invoke::<i64>(&inv).await {
                Ok(written) => {
                    bump(&common.counters.dead_lettered, written as u64);
                    self.dead.remove(0);
                    attempt = 0;
                }
                Err(e) if transient(&e) && attempt < 10 => {
                    common.trouble(format_args!("dead-lettering to {dlq}: {e}"));
                    backoff(&mut attempt).await;
                }
                Err(e) => {
                    let (entry, _, _) = self.dead.remove(0);
                    self.halt.get_or_insert(format!(
                        "entry {}: could not be dead-lettered to {dlq}: {e}",
                        entry.id()
                    ));
                }
            }
        }
    }

    /// Sends the acks on their own, retrying a few times unless the
    /// partition is fenced: what could not be acked stays pending and is
    /// delivered again.
    async fn flush_acks(&mut self, stop: &watch::Receiver<Stop>) {
        let common = self.ctx.common.clone();
        let cfg = &common.config;
        let mut attempt = 0;
        let fenced = || *stop.borrow() == Stop::Fence;
        while !self.acks.is_empty() && !common.stall_acks.load(Ordering::SeqCst) && !fenced() {
            let mut cmd = redis::cmd("XACK");
            cmd.arg(&self.stream).arg(&cfg.group).arg(&self.acks);
            match self.link.query::<u64>(&cmd).await {
                Ok(_) => self.note_acked(),
                Err(e) if attempt < 10 => {
                    common.trouble(format_args!("XACK {}: {e}", self.stream));
                    backoff(&mut attempt).await;
                }
                // Give up: they stay pending and are delivered again.
                Err(_) => return,
            }
        }
    }

    /// `Receiver::shutdown_now`: hands back what is queued, cancels what
    /// is suspended, and waits for a step that is running (on this runtime
    /// thread, so the runtime's other tasks, the heartbeat among them, move
    /// to another thread meanwhile).
    fn stop_now(&self) {
        tokio::task::block_in_place(|| self.receiver.shutdown_now());
    }

    /// Stops as `stop` (or a halt) says, settles every message, and acks
    /// what finished unless fenced.
    async fn finish(mut self, stop: Stop) -> PartitionEnd {
        let began = Instant::now();
        let graceful = stop == Stop::Release && self.halt.is_none();
        let drained = if graceful {
            let deadline = self.common().config.hand_off_deadline;
            let drained = self.receiver.shutdown_async(deadline).await;
            if !drained {
                self.stop_now();
            }
            drained
        } else {
            self.stop_now();
            false
        };
        // Every message has ended now: finished, handed back or cancelled.
        for (entry, done) in std::mem::take(&mut self.in_flight) {
            let outcome = done.await;
            self.settle(entry, outcome);
        }
        if stop != Stop::Fence {
            let (_, rx) = watch::channel(stop);
            self.flush(&rx).await;
        }
        if let Some(why) = self.halt {
            return PartitionEnd::Halted(why);
        }
        match stop {
            Stop::Release => PartitionEnd::Released {
                clean: self.claimed_all,
                drained,
                handed_back: self.handed_back,
                took: began.elapsed(),
            },
            Stop::Fence => PartitionEnd::Fenced("its lease was lost or not renewed in time".into()),
            Stop::Run => PartitionEnd::Fenced("its dispatcher stopped under it".into()),
        }
    }
}

/// The groups in an `XINFO GROUPS` reply, each with its lag (`None` before
/// Redis 7.0, or when Redis cannot tell).
pub(crate) fn info_groups(v: &Value) -> Vec<(String, Option<u64>)> {
    let Value::Array(groups) = v else {
        return Vec::new();
    };
    groups
        .iter()
        .filter_map(|g| {
            let pairs: Vec<(&Value, &Value)> = match g {
                Value::Array(flat) => flat
                    .chunks(2)
                    .filter_map(|c| Some((c.first()?, c.get(1)?)))
                    .collect(),
                Value::Map(m) => m.iter().map(|(k, v)| (k, v)).collect(),
                _ => return None,
            };
            let field = |name: &str| {
                pairs
                    .iter()
                    .find(|(k, _)| entry::text(k).as_deref() == Some(name))
                    .map(|(_, v)| *v)
            };
            let name = entry::text(field("name")?)?;
            let lag = field("lag").and_then(entry::number);
            Some((name, lag))
        })
        .collect()
}
