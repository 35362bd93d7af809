//! A stream entry as the decode function sees it, and why one does not
//! decode.

use std::fmt;
use std::str::FromStr;

use redis::Value;

/// One stream entry: its ID and its fields, in the order `XADD` wrote
/// them. The decode function turns it into a `(key, message)`; an entry
/// that does not decode is dead-lettered with its fields as they were.
#[derive(Clone, PartialEq, Eq)]
pub struct Entry {
    id: String,
    fields: Vec<(String, Vec<u8>)>,
}

impl Entry {
    /// An entry with this ID and these fields (for tests of a decode
    /// function).
    pub fn new<N, V>(id: impl Into<String>, fields: impl IntoIterator<Item = (N, V)>) -> Entry
    where
        N: Into<String>,
        V: Into<Vec<u8>>,
    {
        Entry {
            id: id.into(),
            fields: fields
                .into_iter()
                .map(|(n, v)| (n.into(), v.into()))
                .collect(),
        }
    }

    /// The entry's ID (`1712345678901-0`).
    pub fn id(&self) -> &str {
        &self.id
    }

    /// The value of the first field called `name`, as bytes.
    pub fn get(&self, name: &str) -> Option<&[u8]> {
        self.fields
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_slice())
    }

    /// The value of field `name` as UTF-8 text.
    ///
    /// # Errors
    /// [`DecodeError`] if the field is missing or not UTF-8.
    pub fn text(&self, name: &str) -> Result<&str, DecodeError> {
        let bytes = self.get(name).ok_or_else(|| DecodeError::missing(name))?;
        std::str::from_utf8(bytes).map_err(|_| DecodeError::invalid(name, "not UTF-8"))
    }

    /// The value of field `name` parsed as a `T` (a number, say).
    ///
    /// # Errors
    /// [`DecodeError`] if the field is missing, not UTF-8, or does not parse.
    pub fn parse<T: FromStr>(&self, name: &str) -> Result<T, DecodeError>
    where
        T::Err: fmt::Display,
    {
        let text = self.text(name)?;
        text.parse()
            .map_err(|e: T::Err| DecodeError::invalid(name, format!("{text:?}: {e}")))
    }

    /// Every field, in order.
    pub fn fields(&self) -> impl Iterator<Item = (&str, &[u8])> {
        self.fields.iter().map(|(n, v)| (n.as_str(), v.as_slice()))
    }

    /// One `[id, [field, value, …]]` entry of a stream reply; `None` for an
    /// entry deleted from the stream (`XAUTOCLAIM` and `XREADGROUP` of the
    /// pending list answer `[id, nil]` for those) or a reply of another
    /// shape.
    pub(crate) fn from_value(v: &Value) -> Option<Entry> {
        let Value::Array(parts) = v else { return None };
        let id = text(parts.first()?)?;
        let Value::Array(raw) = parts.get(1)? else {
            return None;
        };
        let mut fields = Vec::with_capacity(raw.len() / 2);
        for pair in raw.chunks(2) {
            let [name, value] = pair else { break };
            fields.push((text(name)?, bytes(value)?));
        }
        Some(Entry { id, fields })
    }
}

impl fmt::Debug for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut m = f.debug_map();
        m.entry(&"id", &self.id);
        for (n, v) in &self.fields {
            m.entry(n, &String::from_utf8_lossy(v));
        }
        m.finish()
    }
}

pub(crate) fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

fn bytes(v: &Value) -> Option<Vec<u8>> {
    match v {
        Value::BulkString(b) => Some(b.clone()),
        Value::SimpleString(s) => Some(s.clone().into_bytes()),
        Value::Int(i) => Some(i.to_string().into_bytes()),
        _ => None,
    }
}

pub(crate) fn number(v: &Value) -> Option<u64> {
    match v {
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        Value::Int(i) => u64::try_from(*i).ok(),
        _ => None,
    }
}

/// The entries of a reply that holds a list of them.
pub(crate) fn entries(v: &Value) -> Vec<Entry> {
    match v {
        Value::Array(items) => items.iter().filter_map(Entry::from_value).collect(),
        _ => Vec::new(),
    }
}

/// `XREADGROUP`'s reply for one stream: `nil` (timed out) or
/// `[[stream, [entry, …]]]` (a map in RESP3).
pub(crate) fn read_reply(v: &Value) -> Vec<Entry> {
    match v {
        Value::Array(streams) => streams
            .iter()
            .flat_map(|s| match s {
                Value::Array(pair) if pair.len() == 2 => entries(&pair[1]),
                _ => Vec::new(),
            })
            .collect(),
        Value::Map(streams) => streams.iter().flat_map(|(_, e)| entries(e)).collect(),
        _ => Vec::new(),
    }
}

/// Why an entry did not decode into a `(key, message)`. Such an entry is
/// written to the dead-letter stream with this text and acked: it is never
/// dropped silently, and never retried.
///
/// ```
/// use keyed_executor_redis::{DecodeError, Entry};
///
/// let entry = Entry::new("1-0", [("key", "42"), ("amount", "ten")]);
/// let err = entry.parse::<i64>("amount").unwrap_err();
/// assert_eq!(err.to_string(), "field `amount`: \"ten\": invalid digit found in string");
/// assert_eq!(entry.parse::<u64>("seq").unwrap_err(), DecodeError::missing("seq"));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct DecodeError(String);

impl DecodeError {
    /// An error that says `why`.
    pub fn new(why: impl fmt::Display) -> DecodeError {
        DecodeError(why.to_string())
    }

    /// Field `name` is missing.
    pub fn missing(name: &str) -> DecodeError {
        DecodeError(format!("field `{name}` is missing"))
    }

    /// Field `name` is there but not what it should be.
    pub fn invalid(name: &str, why: impl fmt::Display) -> DecodeError {
        DecodeError(format!("field `{name}`: {why}"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    #[test]
    fn an_entry_reply_keeps_its_fields_in_order_and_a_deleted_one_is_skipped() {
        let reply = Value::Array(vec![
            Value::Array(vec![
                bulk("1-0"),
                Value::Array(vec![bulk("key"), bulk("7"), bulk("amount"), bulk("-3")]),
            ]),
            Value::Array(vec![bulk("2-0"), Value::Nil]),
        ]);
        let got = entries(&reply);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].id(), "1-0");
        assert_eq!(got[0].parse::<u64>("key"), Ok(7));
        assert_eq!(got[0].parse::<i64>("amount"), Ok(-3));
        let names: Vec<&str> = got[0].fields().map(|(n, _)| n).collect();
        assert_eq!(names, ["key", "amount"]);
    }

    #[test]
    fn a_read_reply_in_resp2_and_resp3_and_a_timeout() {
        let entry = Value::Array(vec![bulk("5-1"), Value::Array(vec![bulk("k"), bulk("v")])]);
        let resp2 = Value::Array(vec![Value::Array(vec![
            bulk("s:0"),
            Value::Array(vec![entry.clone()]),
        ])]);
        let resp3 = Value::Map(vec![(bulk("s:0"), Value::Array(vec![entry]))]);
        assert_eq!(read_reply(&resp2)[0].get("k"), Some(&b"v"[..]));
        assert_eq!(read_reply(&resp3)[0].id(), "5-1");
        assert!(read_reply(&Value::Nil).is_empty());
    }
}
