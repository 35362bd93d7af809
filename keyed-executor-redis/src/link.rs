//! A connection that comes back: opened on first use, opened again after
//! it broke, with a backoff between failed calls.
//!
//! Each loop of a consumer (the heartbeat, each partition's reads) has a
//! link of its own, because `XREADGROUP … BLOCK` holds its connection for
//! the block time. A call that fails on a broken connection forgets that
//! connection, and the caller's next call opens a new one; the caller
//! decides what to retry (see `partition.rs`: nothing is acked twice, and
//! an ack that could not be sent leaves its entry pending, to be delivered
//! again).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::aio::MultiplexedConnection;
use redis::{AsyncConnectionConfig, Client, RedisError, RedisResult};

/// The connection or the server is away for now: worth retrying.
pub(crate) fn transient(e: &RedisError) -> bool {
    e.is_io_error() || e.is_timeout() || e.is_connection_dropped() || e.is_connection_refusal()
}

/// The wait before retry number `attempt` (0, 1, 2, …): 5 ms doubling up
/// to 500 ms.
pub(crate) fn backoff_delay(attempt: u32) -> Duration {
    Duration::from_millis((5u64 << attempt.min(7)).min(500))
}

/// Sleeps [`backoff_delay`] and counts the attempt.
pub(crate) async fn backoff(attempt: &mut u32) {
    let d = backoff_delay(*attempt);
    *attempt = attempt.saturating_add(1);
    tokio::time::sleep(d).await;
}

pub(crate) struct Link {
    client: Client,
    name: String,
    config: AsyncConnectionConfig,
    /// Set when the consumer stops at once (dropped): nothing more goes
    /// out, as when a process dies (what was sent before still arrives).
    cut: Arc<AtomicBool>,
    /// The connection and its generation, so that a caller failing on an
    /// old connection does not throw away a newer one.
    conn: Mutex<(u64, Option<MultiplexedConnection>)>,
}

impl Link {
    /// `name` is the connection's `CLIENT SETNAME` (so `CLIENT LIST` shows
    /// who is who; no spaces).
    pub(crate) fn new(
        client: Client,
        name: String,
        response_timeout: Duration,
        cut: Arc<AtomicBool>,
    ) -> Link {
        Link {
            client,
            name,
            cut,
            config: AsyncConnectionConfig::new()
                .set_connection_timeout(Some(Duration::from_secs(2)))
                .set_response_timeout(Some(response_timeout)),
            conn: Mutex::new((0, None)),
        }
    }

    async fn get(&self) -> RedisResult<(u64, MultiplexedConnection)> {
        if self.cut.load(Ordering::SeqCst) {
            return Err(std::io::Error::from(std::io::ErrorKind::BrokenPipe).into());
        }
        let cached = {
            let slot = self.conn.lock().unwrap_or_else(|p| p.into_inner());
            slot.1.clone().map(|c| (slot.0, c))
        };
        if let Some(c) = cached {
            return Ok(c);
        }
        let mut fresh = self
            .client
            .get_multiplexed_async_connection_with_config(&self.config)
            .await?;
        redis::cmd("CLIENT")
            .arg("SETNAME")
            .arg(&self.name)
            .query_async::<()>(&mut fresh)
            .await?;
        let mut slot = self.conn.lock().unwrap_or_else(|p| p.into_inner());
        if slot.1.is_none() {
            slot.0 += 1;
            slot.1 = Some(fresh);
        }
        Ok((slot.0, slot.1.clone().expect("set above")))
    }

    /// After `e` on connection `generation`: forget it if it broke.
    fn failed(&self, generation: u64, e: &RedisError) {
        if transient(e) {
            let mut slot = self.conn.lock().unwrap_or_else(|p| p.into_inner());
            if slot.0 == generation {
                slot.1 = None;
            }
        }
    }

    pub(crate) async fn query<T: redis::FromRedisValue>(&self, cmd: &redis::Cmd) -> RedisResult<T> {
        let (generation, mut conn) = self.get().await?;
        let res = cmd.query_async(&mut conn).await;
        if let Err(e) = &res {
            self.failed(generation, e);
        }
        res
    }

    pub(crate) async fn query_pipe<T: redis::FromRedisValue>(
        &self,
        pipe: &redis::Pipeline,
    ) -> RedisResult<T> {
        let (generation, mut conn) = self.get().await?;
        let res = pipe.query_async(&mut conn).await;
        if let Err(e) = &res {
            self.failed(generation, e);
        }
        res
    }

    pub(crate) async fn invoke<T: redis::FromRedisValue>(
        &self,
        invocation: &redis::ScriptInvocation<'_>,
    ) -> RedisResult<T> {
        let (generation, mut conn) = self.get().await?;
        let res = invocation.invoke_async(&mut conn).await;
        if let Err(e) = &res {
            self.failed(generation, e);
        }
        res
    }
}
