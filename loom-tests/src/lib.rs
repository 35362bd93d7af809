//! Loom model checks for `keyed-executor` live in `tests/`; this crate has no
//! code of its own. Run them with:
//!
//! ```text
//! RUSTFLAGS="--cfg loom -C debug_assertions" LOOM_MAX_PREEMPTIONS=2 \
//!     cargo test -p loom-tests --release
//! ```
