//! A counting global allocator for the memory workloads (W5, W6).
//!
//! It counts only while tracking is on, so the throughput workloads pay
//! nothing for it. While on, it keeps the net bytes requested since
//! [`start`] (allocations minus frees, by `Layout::size`, so it measures what
//! the designs ask for, not the allocator's overhead) and the peak of that
//! net. Frees of blocks allocated before [`start`] count too, so the net can
//! dip below zero; every reading subtracts a baseline taken inside the window.
//!
//! The bench binary installs it with `#[global_allocator]`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, AtomicIsize, Ordering::Relaxed};

/// `System`, plus counting while tracking is on.
pub struct CountingAlloc;

static TRACKING: AtomicBool = AtomicBool::new(false);
static NET: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

#[inline]
fn grow(bytes: isize) {
    let now = NET.fetch_add(bytes, Relaxed) + bytes;
    PEAK.fetch_max(now, Relaxed);
}

// SAFETY: every method forwards to `System` with the caller's arguments and
// returns its result unchanged; the counting touches only atomics.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is; the caller upholds `GlobalAlloc::alloc`'s contract.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() && TRACKING.load(Relaxed) {
            grow(layout.size() as isize);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() && TRACKING.load(Relaxed) {
            grow(layout.size() as isize);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded as is; `ptr` came from this allocator, i.e. from `System`.
        unsafe { System.dealloc(ptr, layout) };
        if TRACKING.load(Relaxed) {
            NET.fetch_sub(layout.size() as isize, Relaxed);
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded as is.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() && TRACKING.load(Relaxed) {
            grow(new_size as isize - layout.size() as isize);
        }
        p
    }
}

/// Starts counting from zero.
pub fn start() {
    NET.store(0, Relaxed);
    PEAK.store(0, Relaxed);
    TRACKING.store(true, Relaxed);
}

/// Stops counting.
pub fn stop() {
    TRACKING.store(false, Relaxed);
}

/// Net bytes requested since [`start`].
pub fn net() -> isize {
    NET.load(Relaxed)
}

/// Highest [`net`] seen since [`start`].
pub fn peak() -> isize {
    PEAK.load(Relaxed)
}
