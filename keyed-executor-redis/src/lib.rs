//! Consume partitioned Redis Streams from several processes with
//! [`keyed-executor`](keyed_executor): each process (a *node*) owns some of
//! a consumer group's partitions, runs their records one at a time per key,
//! in stream order, different keys in parallel, and acks each record only
//! after the handler finished it. Nodes that join, leave or die hand
//! partitions over through leases in Redis — the pattern of Kinesis' lease
//! table and Kafka's group rebalance — and the records a dead node had not
//! acked are delivered again to the next owner.
//!
//! ```no_run
//! use std::time::Duration;
//! use keyed_executor::handler;
//! use keyed_executor_redis::{Consumer, DecodeError, Entry, Streams};
//!
//! struct Deposit { account: String, amount: i64 }
//!
//! fn decode(entry: &Entry) -> Result<(String, Deposit), DecodeError> {
//!     let account = entry.text("account")?.to_string();
//!     let amount = entry.parse("amount")?;
//!     Ok((account.clone(), Deposit { account, amount }))
//! }
//!
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let node = Consumer::builder("redis://127.0.0.1/", Streams::numbered("deposits:", 8))
//!     .group("ledger")
//!     .name("node-a")                      // unique per live process
//!     .decode(decode)
//!     .handler(handler::from_fn(|account: &String, d: Deposit| {
//!         // Apply it idempotently: a record may be delivered again.
//!         println!("{account}: {:+}", d.amount);
//!     }))
//!     .start()?;
//! std::thread::sleep(Duration::from_secs(60));
//! println!("owned {:?}, {:?}", node.owned(), node.stats());
//! node.leave(Duration::from_secs(30))?;    // hand every partition off
//! # Ok(())
//! # }
//! ```
//!
//! # Guarantees
//!
//! - **At-least-once.** An entry is acked (`XACK`) only after its message
//!   finished and the [`Verdict`] said ack, or after it was written to the
//!   dead-letter stream. Anything else — a crash, a force stop, a fence —
//!   leaves it pending, and the partition's next owner delivers it again.
//!   Handlers must therefore be idempotent (e.g. by a sequence number).
//! - **Per-key order**, within a partition and across hand-offs, given
//!   that every producer routes a key to one partition ([`partition_of`]):
//!   a node submits a partition's entries in ID order to one
//!   [`Receiver`](keyed_executor::Receiver), and a new owner claims what
//!   is pending (lower IDs) before it reads anything new.
//! - **One owner at a time.** A node starts a partition only after taking
//!   its lease; it releases the lease only after the partition's messages
//!   have finished or been stopped; a node that cannot renew its leases
//!   for two-thirds of the lease stops those partitions itself; a new
//!   owner of a dead node's partition waits until all its pending entries
//!   have been idle for the claim idle time.
//! - **Nothing dropped.** An entry that does not decode, and a message the
//!   handler gave up on (a [retrying](keyed_executor::handler::retrying)
//!   handler's dead letter, an [expired](keyed_executor::TaskError::Expired)
//!   one, [`Verdict::DeadLetter`]), is written to the dead-letter stream
//!   with its fields, the error and where it came from, and acked, in one
//!   script: once, however often it is delivered. A handler panic or
//!   [`Verdict::Halt`] stops the partition with the entry pending.
//!
//! # Errors you will meet
//!
//! | situation | what happens |
//! |---|---|
//! | a bad setting | [`start`](ConsumerBuilder::start) fails with [`StartError::Config`] ([`ConfigError`] says which) |
//! | Redis unreachable at start | `start` retries with backoff for the connect timeout, then fails with [`StartError::Unreachable`] |
//! | Redis unreachable mid-run | every loop reconnects with backoff (5 ms doubling to 500 ms); acks wait and go out later; after two-thirds of a lease without a renewal the node fences its partitions (stops them, acks nothing) and takes them up again once Redis answers; nothing is lost, what was done and not acked is delivered again |
//! | a stream or group missing | created (`XGROUP CREATE … 0 MKSTREAM`), or with [`create_groups(false)`](ConsumerBuilder::create_groups) [`StartError::GroupMissing`] |
//! | nodes with different partitions | the first node records the group's streams in Redis; a node given others refuses to start with [`StartError::LayoutMismatch`] |
//! | a lease lost while handling | the partition's receiver is stopped now ([`Receiver::shutdown_now`](keyed_executor::Receiver::shutdown_now) hands its queued messages back), nothing more of it is acked, [`Event::Fenced`] |
//! | [`leave`](Consumer::leave) too slow | [`LeaveError`]: the rest is force-stopped and left pending |
//!
//! # What lives in Redis
//!
//! With `namespace` defaulting to the group name:
//!
//! | key | what |
//! |---|---|
//! | the partitions' streams | a consumer group `group` on each; an entry is pending from its delivery to its `XACK` |
//! | `{namespace}:layout` | the group's streams, one a line: every node must agree |
//! | `{namespace}:members` | live nodes: a sorted set scored by the server time each one's membership expires |
//! | `{namespace}:owner:{p}` | partition `p`'s lease: its owner's name with a TTL of one lease, `""` once released gracefully |
//! | `{namespace}:dead` | the dead-letter stream (unless set otherwise): the entry's fields, plus `dead:stream`, `dead:id`, `dead:error`, `dead:attempts`, `dead:consumer` |
//!
//! The assignment is computed by every node alike from the live members:
//! sorted by name, partition `p` goes to member `p % n`.
//!
//! # Threads
//!
//! A node has its own tokio runtime (`io_threads`, default 1) for its
//! sockets, read loops and heartbeat; the handlers run on the executor's
//! workers. A handler may use tokio: an executor made for the consumer
//! enters the consumer's runtime on each worker.
//!
//! Needs Redis ≥ 6.2 (`XAUTOCLAIM`, `XPENDING … IDLE`); the lag in
//! [`PartitionStats`] needs 7.0. One Redis, not a cluster (the scripts
//! touch a partition's stream and the dead-letter stream together).

#![deny(missing_docs)]

mod builder;
mod consumer;
mod control;
mod entry;
mod layout;
mod link;
mod partition;
mod producer;
mod scripts;
mod stats;

pub use builder::{AckAll, ConfigError, ConsumerBuilder, Decide, Verdict};
pub use consumer::{Consumer, LeaveError, StartError};
pub use entry::{DecodeError, Entry};
pub use layout::{partition_of, Streams};
pub use producer::Producer;
pub use stats::{Event, PartitionState, PartitionStats, Stats, Takeover};

#[cfg(test)]
mod tests {
    /// The handles cross threads: a node is started on one thread and
    /// left from another, its stats read from anywhere.
    #[test]
    fn handles_are_send_and_sync() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<crate::Consumer>();
        send_sync::<crate::Producer>();
        send_sync::<crate::Stats>();
        send_sync::<crate::StartError>();
    }
}
