//! The comparison harness shared by `benches/compare.rs`: the peers, the
//! crate's adapter, the workloads and the reports. Layout:
//!
//! - [`design`]: the `Handler` / `Design` / `Family` traits every design plugs into;
//! - [`peers`]: `inline`, `striped`, `tokio-actors`, `smol-actors`;
//! - [`keyed`]: the crate under test;
//! - [`floor`]: `contract-floor`, a diagnostic: striped plus the contract's
//!   per-message work (credit, turn counts), never in the default rows;
//! - [`work`]: the message, calibrated CPU work, per-key sequence checker;
//! - [`device`]: W3's simulated ~100 µs device;
//! - [`alloc`]: the counting global allocator (W5, W6);
//! - [`latency`]: W9's and the open-loop row's lock-free per-message
//!   times, and percentiles;
//! - [`workloads`]: W1–W9, the open-loop latency run and the list of designs;
//! - [`report`]: `--table`, `--grid`, `--w3-curve`, `--sweep`, `--latency`
//!   and `--smoke`;
//! - [`steady`]: `--steady`, W1 over separate invocations.

pub mod alloc;
pub mod design;
pub mod device;
pub mod floor;
pub mod keyed;
pub mod latency;
pub mod peers;
pub mod report;
pub mod steady;
pub mod work;
pub mod workloads;
