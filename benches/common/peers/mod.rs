//! The designs a user would write instead of using the crate.

pub mod inline;
pub mod smol_actors;
pub mod striped;
pub mod tokio_actors;

/// The striped executor's key → thread map (a multiplicative hash, so
/// neighbouring keys spread over the threads).
#[inline]
pub fn stripe(key: u64, n: usize) -> usize {
    ((key.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 32) % n as u64) as usize
}

/// The concurrent map the actor peers keep their senders in: DashMap with
/// FxHash (the usual idiom with a fast hasher for integer keys; SipHash would
/// only make the peers slower).
pub type SenderMap<T> = dashmap::DashMap<u64, T, rustc_hash::FxBuildHasher>;
