//! keyed-executor: run work one at a time per key, in arrival order, with
//! different keys in parallel.
#![deny(missing_docs)]
#![warn(unreachable_pub)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub(crate) mod sync;

mod completion;
mod config;
mod dispatcher;
pub mod error;
mod executor;
pub mod handler;
pub mod lanes;
pub mod limit;
mod mailbox;
mod receiver;
mod spawn;
mod stats;
mod task;
mod trace;
mod waiter;
mod waker;
mod worker;

pub use completion::{Completion, Outcome};
pub use config::{
    Builder, DEFAULT_MAX_IN_FLIGHT, DEFAULT_THREAD_NAME, DEFAULT_THROUGHPUT, MAX_SPIN,
};
pub use dispatcher::{Dispatcher, DispatcherBuilder};
pub use error::{ConfigError, Panic, SubmitError, TaskError};
pub use executor::KeyedExecutor;
pub use lanes::{BatchResult, Kernel, LaneError, Lanes};
pub use limit::InFlightLimit;
pub use receiver::{Receiver, SendFuture, SubmitFuture};
pub use stats::{ExecutorStats, SpawnedStats, WorkerState, WorkerStats};
