//! Which streams are the partitions, and which partition a key goes to.

use std::fmt;

/// The partitions: one stream each, numbered 0, 1, 2, … in this order.
/// Every node of a group and every producer must use the same list: a
/// key's records must always land in the same stream for its order to
/// hold, and [`Consumer`](crate::Consumer) refuses to start when Redis
/// holds another layout for its group.
#[derive(Clone, PartialEq, Eq)]
pub struct Streams(Vec<String>);

impl Streams {
    /// `count` streams named `{prefix}0`, `{prefix}1`, …, e.g.
    /// `Streams::numbered("orders:", 8)` is `orders:0` … `orders:7`.
    pub fn numbered(prefix: &str, count: usize) -> Streams {
        Streams((0..count).map(|p| format!("{prefix}{p}")).collect())
    }

    /// These streams, in this order: partition `p` is the `p`-th.
    pub fn list<S: Into<String>>(streams: impl IntoIterator<Item = S>) -> Streams {
        Streams(streams.into_iter().map(Into::into).collect())
    }

    /// How many partitions.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// No partitions at all (a builder refuses this).
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Partition `p`'s stream.
    ///
    /// # Panics
    /// If `p >= self.len()`.
    pub fn stream(&self, p: usize) -> &str {
        &self.0[p]
    }

    /// Every stream, partition 0 first.
    pub fn iter(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(String::as_str)
    }

    /// The stream `key`'s records go to: `self.stream(partition_of(key,
    /// self.len()))`.
    ///
    /// # Panics
    /// If there are no partitions.
    pub fn stream_of(&self, key: impl AsRef<[u8]>) -> &str {
        self.stream(partition_of(key, self.len()))
    }

    /// What the group's layout record in Redis holds: the streams, one a
    /// line.
    pub(crate) fn fingerprint(&self) -> String {
        self.0.join("\n")
    }
}

impl fmt::Debug for Streams {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.as_slice() {
            [] => f.write_str("Streams([])"),
            [one] => write!(f, "Streams([{one:?}])"),
            [first, .., last] => {
                write!(f, "Streams({} streams: {first:?} … {last:?})", self.0.len())
            }
        }
    }
}

/// The partition of `key` among `partitions`: **FNV-1a, 64 bits, over the
/// key's bytes, modulo `partitions`**. It is the same in every process,
/// run and platform, so producers in any language can route a key to the
/// partition its earlier records went to:
///
/// ```text
/// h = 0xcbf29ce484222325                       (the FNV-1a 64 offset basis)
/// for each byte b of key: h = (h XOR b) * 0x100000001b3   (mod 2^64)
/// partition = h mod partitions                 (unsigned)
/// ```
///
/// A key is bytes: a string's UTF-8 bytes, a number's decimal digits (say
/// so and keep to it in every producer). Reference values, checked by the
/// crate's tests: `"" → 0xcbf29ce484222325`, `"a" → 0xaf63dc4c8601ec8c`,
/// `"order-42" → 0x7d1deb86a05662d4`.
///
/// ```
/// use keyed_executor_redis::partition_of;
///
/// assert_eq!(partition_of("a", 8), (0xaf63dc4c8601ec8c_u64 % 8) as usize);
/// assert_eq!(partition_of("order-42", 8), partition_of(b"order-42", 8));
/// ```
///
/// # Panics
/// If `partitions` is zero.
pub fn partition_of(key: impl AsRef<[u8]>, partitions: usize) -> usize {
    assert!(partitions > 0, "partition_of: zero partitions");
    (fnv1a(key.as_ref()) % partitions as u64) as usize
}

/// FNV-1a, 64 bits.
pub(crate) fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The published FNV-1a 64 test vectors (and the one the docs quote).
    #[test]
    fn fnv1a_matches_the_reference_values() {
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
        assert_eq!(fnv1a(b"order-42"), 0x7d1d_eb86_a056_62d4);
    }

    #[test]
    fn numbered_streams_and_routing() {
        let s = Streams::numbered("orders:", 3);
        assert_eq!(
            s.iter().collect::<Vec<_>>(),
            ["orders:0", "orders:1", "orders:2"]
        );
        assert_eq!(
            s.stream_of("a"),
            s.stream((0xaf63_dc4c_8601_ec8c_u64 % 3) as usize)
        );
        assert_eq!(
            format!("{s:?}"),
            "Streams(3 streams: \"orders:0\" … \"orders:2\")"
        );
    }
}
