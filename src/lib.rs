//! keyed-executor: run work one at a time per key, in arrival order, with
//! different keys in parallel.
#![deny(missing_docs)]
#![warn(unreachable_pub)]
#![warn(clippy::undocumented_unsafe_blocks)]

pub(crate) mod sync;

pub mod error;
pub mod lanes;
pub mod limit;

pub use error::{ConfigError, Panic, SubmitError, TaskError};
pub use lanes::{BatchResult, Kernel, LaneError, Lanes};
pub use limit::InFlightLimit;
