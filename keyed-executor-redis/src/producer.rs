//! Writing records to their key's partition.

use redis::aio::MultiplexedConnection;
use redis::{RedisResult, ToRedisArgs};

use crate::layout::{partition_of, Streams};

/// Appends records to the partition of their key (`XADD`), so that a
/// key's records are all in one stream, in the order they were sent. A
/// producer in another language does the same with [`partition_of`]'s
/// hash.
///
/// ```no_run
/// use keyed_executor_redis::{Producer, Streams};
///
/// # async fn run() -> redis::RedisResult<()> {
/// let mut producer = Producer::connect("redis://127.0.0.1/", Streams::numbered("orders:", 8)).await?;
/// let id = producer.send("order-42", &[("key", "order-42"), ("amount", "10")]).await?;
/// println!("appended {id} to {}", producer.stream_of("order-42"));
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Producer {
    streams: Streams,
    conn: MultiplexedConnection,
}

impl std::fmt::Debug for Producer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Producer")
            .field("streams", &self.streams)
            .finish_non_exhaustive()
    }
}

impl Producer {
    /// Connects to the Redis at `url` (on the current tokio runtime).
    ///
    /// # Errors
    /// A bad URL, or Redis unreachable.
    pub async fn connect(url: &str, streams: Streams) -> RedisResult<Producer> {
        let client = redis::Client::open(url)?;
        let conn = client.get_multiplexed_async_connection().await?;
        Ok(Producer::with_connection(conn, streams))
    }

    /// A producer over a connection the caller already has.
    pub fn with_connection(conn: MultiplexedConnection, streams: Streams) -> Producer {
        Producer { streams, conn }
    }

    /// The partitions.
    pub fn streams(&self) -> &Streams {
        &self.streams
    }

    /// The partition of `key` ([`partition_of`]).
    pub fn partition_of(&self, key: impl AsRef<[u8]>) -> usize {
        partition_of(key, self.streams.len())
    }

    /// The stream of `key`'s partition.
    pub fn stream_of(&self, key: impl AsRef<[u8]>) -> &str {
        self.streams.stream_of(key)
    }

    /// The `XADD` that [`send`](Self::send) runs, to put in a pipeline of
    /// your own (one round trip for many records).
    pub fn xadd<N: ToRedisArgs, V: ToRedisArgs>(
        &self,
        key: impl AsRef<[u8]>,
        fields: &[(N, V)],
    ) -> redis::Cmd {
        let mut cmd = redis::cmd("XADD");
        cmd.arg(self.stream_of(key)).arg("*");
        for (n, v) in fields {
            cmd.arg(n).arg(v);
        }
        cmd
    }

    /// Appends one record with these fields to `key`'s partition and
    /// returns its entry ID. The key decides the partition only; put it in
    /// the fields too if the decode function needs it.
    ///
    /// # Errors
    /// What Redis or the connection said.
    pub async fn send<N: ToRedisArgs, V: ToRedisArgs>(
        &mut self,
        key: impl AsRef<[u8]>,
        fields: &[(N, V)],
    ) -> RedisResult<String> {
        self.xadd(key, fields).query_async(&mut self.conn).await
    }
}
