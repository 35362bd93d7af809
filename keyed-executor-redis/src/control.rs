//! The heartbeat: membership, leases and the assignment. It starts and
//! stops the partitions' loops (`partition.rs`).
//!
//! Every heartbeat period the node runs `HEARTBEAT`: it stays in the
//! members set (scored by the server time its membership expires),
//! renews the lease of every partition it owns, and gets back the live
//! members and the leases it no longer holds. The assignment is a pure
//! function of the members ([`assignment`]: sorted names, partition `p`
//! to member `p % n`), so every node computes the same one. A node starts
//! a partition only after taking its lease with `ACQUIRE`, which succeeds
//! only if the lease is absent (expired, or never taken) or `""`
//! (released).
//!
//! - A partition the assignment no longer gives this node is **handed
//!   off**: its loop drains and acks (see `partition.rs`), then the lease
//!   is set to `""` (`RELEASE`): only then may the next owner start.
//! - A lease `HEARTBEAT` says this node lost is **fenced**: the loop stops
//!   at once and acks nothing.
//! - A node that cannot renew for two-thirds of the lease fences every
//!   partition itself, so it has stopped before anyone may take them.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use redis::Script;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::consumer::Common;
use crate::link::backoff;
use crate::scripts;
use crate::stats::{bump, Event, Takeover};

/// What a partition's loop is asked to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stop {
    Run,
    /// Hand off: drain, ack, return (then the lease is released).
    Release,
    /// Stop now; ack nothing; do not release.
    Fence,
}

/// How a partition's loop ended.
pub(crate) enum PartitionEnd {
    Released {
        /// It had claimed everything pending before it stopped.
        clean: bool,
        drained: bool,
        handed_back: u64,
        took: Duration,
    },
    Fenced(String),
    Halted(String),
}

/// Starts partition `p`'s loop (generic over the handler: made in
/// `consumer.rs`).
pub(crate) type Spawn =
    Arc<dyn Fn(usize, Takeover, watch::Receiver<Stop>) -> JoinHandle<PartitionEnd> + Send + Sync>;

struct Running {
    stop: watch::Sender<Stop>,
    task: JoinHandle<PartitionEnd>,
}

/// Which partitions `me` owns among `members`: sorted and deduplicated,
/// partition `p` goes to member `p % n`. Empty if `me` is not a member.
pub(crate) fn assignment(members: &[String], me: &str, partitions: usize) -> BTreeSet<usize> {
    let mut members = members.to_vec();
    members.sort();
    members.dedup();
    match members.iter().position(|m| m == me) {
        Some(i) => (0..partitions).filter(|p| p % members.len() == i).collect(),
        None => BTreeSet::new(),
    }
}

/// Returns once the node left the group.
pub(crate) async fn control_loop(
    common: Arc<Common>,
    spawn: Spawn,
    mut leave: watch::Receiver<bool>,
    joined_tx: std::sync::mpsc::Sender<()>,
) {
    let cfg = &common.config;
    let me = cfg.name.clone();
    let partitions = cfg.streams.len();
    let link = common.link("heartbeat");
    let heartbeat = Script::new(scripts::HEARTBEAT);
    let acquire = Script::new(scripts::ACQUIRE);
    let release = Script::new(scripts::RELEASE);
    let lease_ms = cfg.lease.as_millis() as u64;
    let mut running: BTreeMap<usize, Running> = BTreeMap::new();
    let mut halted: BTreeSet<usize> = BTreeSet::new();
    let mut releasing: BTreeSet<usize> = BTreeSet::new();
    let mut renewed: Option<Instant> = None;
    let mut joined = false;
    let mut joined_at: Option<Instant> = None;
    let mut ticks = tokio::time::interval(cfg.heartbeat);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            _ = leave.changed() => {}
            _ = common.ended.notified() => {}
        }
        let leaving = *leave.borrow();

        // Partitions whose loop has ended.
        let ended: Vec<usize> = running
            .iter()
            .filter(|(_, r)| r.task.is_finished())
            .map(|(&p, _)| p)
            .collect();
        for p in ended {
            let r = running.remove(&p).expect("listed");
            releasing.remove(&p);
            match r.task.await {
                Ok(PartitionEnd::Released {
                    clean,
                    drained,
                    handed_back,
                    took,
                }) => {
                    bump(&common.counters.hand_offs_out, 1);
                    common.counters.forget_partition(p);
                    common.emit(Event::Released {
                        partition: p,
                        drained,
                        handed_back,
                        took,
                    });
                    // Everything acked and stopped: only now may the next
                    // owner start.
                    let mut inv = release.prepare_invoke();
                    inv.key(cfg.lease_key(p)).arg(&me).arg(u8::from(clean));
                    let mut attempt = 0;
                    while let Err(e) = link.invoke::<i64>(&inv).await {
                        common.trouble(format_args!("releasing partition {p}: {e}"));
                        if attempt > 5 {
                            break; // it will expire instead
                        }
                        backoff(&mut attempt).await;
                    }
                }
                Ok(PartitionEnd::Fenced(why)) => {
                    bump(&common.counters.fenced, 1);
                    common.counters.forget_partition(p);
                    common.emit(Event::Fenced { partition: p, why });
                }
                Ok(PartitionEnd::Halted(why)) => {
                    halted.insert(p);
                    common.emit(Event::Halted { partition: p, why });
                }
                Err(e) => {
                    common.counters.forget_partition(p);
                    common.trouble(format_args!("partition {p}'s loop died: {e}"));
                }
            }
        }
        common.set_owned(running.keys().chain(&halted).copied().collect());

        // Heartbeat: membership and leases.
        let owned: Vec<usize> = running.keys().chain(&halted).copied().collect();
        let mut inv = heartbeat.prepare_invoke();
        inv.key(cfg.members_key());
        for &p in &owned {
            inv.key(cfg.lease_key(p));
        }
        inv.arg(&me).arg(lease_ms).arg(u8::from(!leaving));
        let sent = Instant::now();
        let beat = tokio::time::timeout(
            cfg.lease / 3,
            link.invoke::<(Vec<String>, Vec<usize>)>(&inv),
        )
        .await;
        let members = match beat {
            Ok(Ok((members, lost))) => {
                renewed = Some(sent);
                for i in lost {
                    let p = owned[i - 1];
                    if let Some(r) = running.get(&p) {
                        let _ = r.stop.send(Stop::Fence);
                    }
                    if halted.remove(&p) {
                        bump(&common.counters.fenced, 1);
                        common.counters.forget_partition(p);
                        common.emit(Event::Fenced {
                            partition: p,
                            why: "lease lost while halted".into(),
                        });
                    }
                }
                if !joined && !leaving {
                    joined = true;
                    joined_at = Some(Instant::now());
                    common.emit(Event::Joined {
                        members: members.clone(),
                    });
                    let _ = joined_tx.send(());
                }
                members
            }
            failed => {
                let why = match failed {
                    Ok(Err(e)) => e.to_string(),
                    _ => "heartbeat timed out".to_string(),
                };
                common.trouble(format_args!("heartbeat: {why}"));
                // Not renewed for 2/3 of a lease: someone may take our
                // partitions soon. Stop them now.
                let overdue = match renewed {
                    Some(t) => t.elapsed() > cfg.lease * 2 / 3,
                    None => true,
                };
                if overdue {
                    for r in running.values() {
                        let _ = r.stop.send(Stop::Fence);
                    }
                    for p in std::mem::take(&mut halted) {
                        bump(&common.counters.fenced, 1);
                        common.counters.forget_partition(p);
                        common.emit(Event::Fenced {
                            partition: p,
                            why: "lease not renewed in time while halted".into(),
                        });
                    }
                }
                if leaving && running.is_empty() {
                    break; // leaving, and Redis is away: nothing left to hand off
                }
                continue;
            }
        };
        if leaving && running.is_empty() {
            break;
        }
        if !leaving && joined_at.is_some_and(|t| t.elapsed() < cfg.join_delay) {
            continue; // let the others who start with us join first
        }

        // The assignment: release what is no longer ours, take what is.
        let wanted = if leaving {
            BTreeSet::new()
        } else {
            assignment(&members, &me, partitions)
        };
        for (p, r) in &running {
            if !wanted.contains(p) && releasing.insert(*p) {
                let _ = r.stop.send(Stop::Release);
            }
        }
        if leaving {
            continue;
        }
        for &p in &wanted {
            if running.contains_key(&p) || halted.contains(&p) {
                continue;
            }
            let mut inv = acquire.prepare_invoke();
            inv.key(cfg.lease_key(p)).arg(&me).arg(lease_ms);
            let how = match link.invoke::<Option<String>>(&inv).await {
                Ok(Some(how)) if how == "released" => Takeover::HandedOff,
                Ok(Some(_)) => Takeover::Vacant,
                Ok(None) => continue, // still held: its owner is letting go
                Err(e) => {
                    common.trouble(format_args!("acquiring partition {p}: {e}"));
                    continue;
                }
            };
            common.emit(Event::Acquired { partition: p, how });
            let (stop, stop_rx) = watch::channel(Stop::Run);
            let task = spawn(p, how, stop_rx);
            running.insert(p, Running { stop, task });
        }
        common.set_owned(running.keys().chain(&halted).copied().collect());
    }
    common.set_owned(BTreeSet::new());
    common.emit(Event::Left);
}

#[cfg(test)]
mod tests {
    use super::assignment;

    #[test]
    fn every_partition_goes_to_exactly_one_member_whatever_the_order_of_names() {
        let members: Vec<String> = ["c", "a", "b", "a"].iter().map(|s| s.to_string()).collect();
        let mut seen = Vec::new();
        for me in ["a", "b", "c"] {
            seen.extend(assignment(&members, me, 8));
        }
        seen.sort();
        assert_eq!(seen, (0..8).collect::<Vec<_>>());
        assert_eq!(
            assignment(&members, "b", 8).into_iter().collect::<Vec<_>>(),
            [1, 4, 7]
        );
        assert!(assignment(&members, "z", 8).is_empty());
    }
}
