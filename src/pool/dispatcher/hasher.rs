//! The dispatchers' default key hasher.

use std::fmt;
use std::hash::{BuildHasher, Hasher};

/// The key hasher a dispatcher uses unless told otherwise
/// ([`DispatcherBuilder::hasher`](super::DispatcherBuilder::hasher)): a fast hash (foldhash) seeded at random
/// for each dispatcher.
///
/// Every message hashes its key once, on the submitting thread, so the
/// hasher is on the hot path: std's `RandomState` (SipHash-1-3) costs about
/// as much there as the rest of a submit. Random seeds keep keys an
/// attacker did not see from colliding on purpose; for keys an adversary
/// chooses *and* can probe (e.g. timing your service), give the dispatcher
/// `std::hash::RandomState::new()` instead.
#[derive(Clone, Debug, Default)]
pub struct DefaultHashBuilder(foldhash::fast::RandomState);

impl DefaultHashBuilder {
    /// A builder with fresh random seeds.
    pub fn new() -> Self {
        Self::default()
    }
}

impl BuildHasher for DefaultHashBuilder {
    type Hasher = DefaultHasher;

    #[inline]
    fn build_hasher(&self) -> DefaultHasher {
        DefaultHasher(self.0.build_hasher())
    }
}

/// The [`Hasher`] of [`DefaultHashBuilder`].
#[derive(Clone)]
pub struct DefaultHasher(foldhash::fast::FoldHasher<'static>);

impl fmt::Debug for DefaultHasher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DefaultHasher").finish_non_exhaustive()
    }
}

impl Hasher for DefaultHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0.finish()
    }
    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        self.0.write(bytes)
    }
    #[inline]
    fn write_u8(&mut self, i: u8) {
        self.0.write_u8(i)
    }
    #[inline]
    fn write_u16(&mut self, i: u16) {
        self.0.write_u16(i)
    }
    #[inline]
    fn write_u32(&mut self, i: u32) {
        self.0.write_u32(i)
    }
    #[inline]
    fn write_u64(&mut self, i: u64) {
        self.0.write_u64(i)
    }
    #[inline]
    fn write_u128(&mut self, i: u128) {
        self.0.write_u128(i)
    }
    #[inline]
    fn write_usize(&mut self, i: usize) {
        self.0.write_usize(i)
    }
}
