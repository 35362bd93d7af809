//! The counters of one `Lanes`: commands in flight (taken and not finished)
//! and the closed flag, in one word, plus the node's shared
//! [`InFlightLimit`].
//!
//! The word is `CLOSED | count`. Entering is a compare-exchange that counts
//! the command only if the flag is clear; closing is one `fetch_or` that also
//! reads the count; so a command racing `close` either sees the flag (and is
//! refused, never counted: a closed `Lanes` reads zero in flight once its
//! commands finished, whatever callers still knock) or is counted before
//! `close` reads the count (and `close` waits for it). Releasing is one
//! `fetch_sub`; the release that brings a closed count to zero reports it, so
//! the closer is woken exactly when the last command finishes.

use crate::limit::InFlightLimit;
use crate::sync::atomic::{AtomicUsize, Ordering};

const CLOSED: usize = 1 << (usize::BITS - 1);

/// Why [`Accounts::enter`] refused a command.
#[must_use]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The `Lanes` is closed; nothing was counted.
    Closed,
    /// The in-flight limit is exhausted (nothing is counted). `drained`:
    /// backing the count out brought a closed count to zero (a `close`
    /// came in meanwhile), so the closer must be woken.
    Limit { drained: bool },
}

#[derive(Debug)]
pub(crate) struct Accounts {
    word: AtomicUsize,
    pub(crate) limit: InFlightLimit,
}

impl Accounts {
    pub(crate) fn new(limit: InFlightLimit) -> Self {
        Accounts {
            word: AtomicUsize::new(0),
            limit,
        }
    }

    /// Counts one command in, unless closed or over the limit.
    pub(crate) fn enter(&self) -> Result<(), Refused> {
        let mut cur = self.word.load(Ordering::SeqCst);
        loop {
            if cur & CLOSED != 0 {
                // Not counted (a count taken and given back here would show
                // in `in_flight` after `close` saw zero).
                return Err(Refused::Closed);
            }
            match self
                .word
                .compare_exchange_weak(cur, cur + 1, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => break,
                Err(actual) => cur = actual,
            }
        }
        if !self.limit.try_acquire() {
            let drained = self.release_word(1);
            return Err(Refused::Limit { drained });
        }
        Ok(())
    }

    /// Gives back `n` commands (and their limit units). True if this brought
    /// a closed count to zero.
    #[must_use]
    pub(crate) fn release(&self, n: usize) -> bool {
        if n == 0 {
            return false;
        }
        self.limit.release(n);
        self.release_word(n)
    }

    fn release_word(&self, n: usize) -> bool {
        let prev = self.word.fetch_sub(n, Ordering::SeqCst);
        debug_assert!(prev & !CLOSED >= n, "released more commands than taken");
        prev & CLOSED != 0 && prev & !CLOSED == n
    }

    /// Sets the closed flag; returns the count at that moment.
    pub(crate) fn close(&self) -> usize {
        self.word.fetch_or(CLOSED, Ordering::SeqCst) & !CLOSED
    }

    pub(crate) fn in_flight(&self) -> usize {
        self.word.fetch_add(0, Ordering::SeqCst) & !CLOSED
    }

    pub(crate) fn is_closed(&self) -> bool {
        self.word.fetch_add(0, Ordering::SeqCst) & CLOSED != 0
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn enter_release_close() {
        let a = Accounts::new(InFlightLimit::new(2));
        assert!(a.enter().is_ok());
        assert!(a.enter().is_ok());
        assert_eq!(a.enter(), Err(Refused::Limit { drained: false }));
        assert_eq!(a.in_flight(), 2);
        assert!(!a.release(1));
        assert_eq!(a.close(), 1);
        assert!(a.is_closed());
        assert_eq!(a.enter(), Err(Refused::Closed));
        assert!(a.release(1), "last release after close reports the drain");
        assert_eq!(a.in_flight(), 0);
        assert_eq!(a.limit.in_flight(), 0);
    }
}
