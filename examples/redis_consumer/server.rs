//! A throwaway `redis-server` for the self-checking run and the test: a
//! temporary directory, a free loopback port, no persistence, killed (and
//! its directory removed) when the handle drops, also while a panic
//! unwinds.

use std::io::Read;
use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A `redis-server` this process started, listening on 127.0.0.1 only.
pub struct RedisServer {
    child: Child,
    port: u16,
    dir: PathBuf,
}

/// Why no server could be started.
#[derive(Debug)]
pub enum StartError {
    /// `redis-server` is not on `PATH`.
    NotInstalled,
    /// It is installed but did not come up; the message says why.
    Failed(String),
}

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StartError::NotInstalled => f.write_str("redis-server is not on PATH"),
            StartError::Failed(why) => write!(f, "redis-server did not start: {why}"),
        }
    }
}

impl std::error::Error for StartError {}

impl RedisServer {
    /// Starts `redis-server` on a free loopback port and waits until it
    /// answers. A port taken between choosing and binding it is retried.
    pub fn start() -> Result<RedisServer, StartError> {
        match Command::new("redis-server")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
        {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(StartError::NotInstalled)
            }
            Err(e) => return Err(StartError::Failed(e.to_string())),
        }
        let mut last = String::new();
        for attempt in 0..5 {
            match Self::start_once(attempt) {
                Ok(server) => return Ok(server),
                Err(why) => last = why,
            }
        }
        Err(StartError::Failed(last))
    }

    fn start_once(attempt: u32) -> Result<RedisServer, String> {
        // Ask the kernel for a free port, then give it to the server.
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .and_then(|l| l.local_addr())
            .map_err(|e| e.to_string())?
            .port();
        let dir = std::env::temp_dir().join(format!(
            "keyed-executor-redis-{}-{port}-{attempt}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string()])
            .args(["--bind", "127.0.0.1"])
            .args(["--save", ""])
            .args(["--appendonly", "no"])
            .arg("--dir")
            .arg(&dir)
            .args(["--logfile", "redis.log"])
            .args(["--daemonize", "no"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| e.to_string())?;
        let mut server = RedisServer { child, port, dir };
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(status) = server.child.try_wait().map_err(|e| e.to_string())? {
                let mut stderr = String::new();
                if let Some(mut err) = server.child.stderr.take() {
                    let _ = err.read_to_string(&mut stderr);
                }
                return Err(format!(
                    "exited with {status}: {stderr}{}",
                    server.log_tail()
                ));
            }
            if server.answers_ping() {
                return Ok(server);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Err(format!(
            "no answer on port {port} within 10 s{}",
            server.log_tail()
        ))
    }

    /// A plain RESP `PING` over a fresh socket (no client library needed).
    fn answers_ping(&self) -> bool {
        use std::io::Write;
        let Ok(mut s) = TcpStream::connect((Ipv4Addr::LOCALHOST, self.port)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
        let mut buf = [0u8; 7];
        s.write_all(b"PING\r\n").is_ok() && s.read_exact(&mut buf).is_ok() && &buf == b"+PONG\r\n"
    }

    fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("redis.log")).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(5).collect();
        if tail.is_empty() {
            String::new()
        } else {
            format!(
                "; log: {}",
                tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
            )
        }
    }

    /// The server's URL, for `redis::Client::open`.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// The server's process ID (to pause it with SIGSTOP, say).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The port it listens on.
    pub fn port(&self) -> u16 {
        self.port
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
