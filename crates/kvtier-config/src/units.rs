//! Human-friendly sizes (`256MiB`) and durations (`10s`) for config files.

use std::fmt;
use std::time::Duration;

use serde::de::{self, Deserializer, Visitor};
use serde::{Deserialize, Serialize, Serializer};

/// A secret (a key, a token). Deserialized from a string; never printed: `Debug` and
/// `Display` show `***` (or nothing when empty), so config dumps and logs cannot leak it.
#[derive(Clone, PartialEq, Eq, Default, Deserialize, Serialize)]
#[serde(transparent)]
pub struct Secret(pub String);

impl Secret {
    /// The secret itself, for the one place that needs it.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_empty() { "\"\"" } else { "\"***\"" })
    }
}

/// A size in bytes. Accepts an integer or a string with a unit: `B`, `K`/`KB`/`KiB`, `M`/`MB`/
/// `MiB`, `G`/`GB`/`GiB`, `T`/`TB`/`TiB` (all binary multiples: 1K = 1024).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct ByteSize(pub u64);

/// A duration. Accepts a string with a unit: `ms`, `s`, `m`, `h` (e.g. `500ms`, `10s`), or an
/// integer number of seconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Default)]
pub struct Dur(pub Duration);

fn split_number(s: &str) -> (&str, &str) {
    let s = s.trim();
    let end = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    (&s[..end], s[end..].trim())
}

impl ByteSize {
    /// Parses `256MiB`, `1G`, `4096`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let (num, unit) = split_number(s);
        let n: u64 = num
            .parse()
            .map_err(|_| format!("{s:?} is not a size (e.g. 256MiB)"))?;
        let mult: u64 = match unit.to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kb" | "kib" => 1 << 10,
            "m" | "mb" | "mib" => 1 << 20,
            "g" | "gb" | "gib" => 1 << 30,
            "t" | "tb" | "tib" => 1 << 40,
            _ => return Err(format!("{s:?}: unknown size unit {unit:?}")),
        };
        n.checked_mul(mult)
            .map(ByteSize)
            .ok_or_else(|| format!("{s:?} is too large"))
    }
}

impl Dur {
    /// Parses `500ms`, `10s`, `2m`, `1h`, `1.5s`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let (num, unit) = split_number(s);
        let n: f64 = num
            .parse()
            .map_err(|_| format!("{s:?} is not a duration (e.g. 10s)"))?;
        let secs = match unit {
            "ms" => n / 1000.0,
            "" | "s" => n,
            "m" => n * 60.0,
            "h" => n * 3600.0,
            _ => return Err(format!("{s:?}: unknown duration unit {unit:?}")),
        };
        Duration::try_from_secs_f64(secs)
            .map(Dur)
            .map_err(|_| format!("{s:?} is out of range"))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        for (shift, unit) in [(40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB")] {
            if b >= 1 << shift && b.is_multiple_of(1 << shift) {
                return write!(f, "{}{unit}", b >> shift);
            }
        }
        write!(f, "{b}B")
    }
}

impl fmt::Display for Dur {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

struct SizeVisitor;

impl Visitor<'_> for SizeVisitor {
    type Value = ByteSize;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a size such as 256MiB or a number of bytes")
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<ByteSize, E> {
        u64::try_from(v)
            .map(ByteSize)
            .map_err(|_| E::custom("a size cannot be negative"))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<ByteSize, E> {
        Ok(ByteSize(v))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<ByteSize, E> {
        ByteSize::parse(v).map_err(E::custom)
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(SizeVisitor)
    }
}

struct DurVisitor;

impl Visitor<'_> for DurVisitor {
    type Value = Dur;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a duration such as 10s or 500ms")
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Dur, E> {
        u64::try_from(v)
            .map(|s| Dur(Duration::from_secs(s)))
            .map_err(|_| E::custom("a duration cannot be negative"))
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Dur, E> {
        Ok(Dur(Duration::from_secs(v)))
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Dur, E> {
        Dur::parse(v).map_err(E::custom)
    }
}

impl<'de> Deserialize<'de> for Dur {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(DurVisitor)
    }
}

impl Serialize for ByteSize {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

impl Serialize for Dur {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        // Milliseconds round-trip through `Dur::parse` exactly for every configurable value.
        s.serialize_str(&format!("{}ms", self.0.as_millis()))
    }
}

/// Deserializes a key that may be unset: absent or `""` (the default files' spelling of
/// unset) is `None`.
pub(crate) fn empty_is_none<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: From<String>,
{
    let s: Option<String> = Option::deserialize(d)?;
    Ok(s.filter(|s| !s.is_empty()).map(T::from))
}

/// Serializes a key that may be unset as the default files spell it: `None` is `""`. For
/// keys whose default is set (an endpoint on by default), so that a configuration written
/// out and read again (`with_overrides`, `kvtierctl config`) keeps them off.
pub(crate) fn none_as_empty<S>(v: &Option<String>, s: S) -> Result<S::Ok, S::Error>
where
    S: serde::Serializer,
{
    s.serialize_str(v.as_deref().unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_durations_parse() {
        assert_eq!(ByteSize::parse("256MiB").unwrap().0, 256 << 20);
        assert_eq!(ByteSize::parse("1g").unwrap().0, 1 << 30);
        assert_eq!(ByteSize::parse("4096").unwrap().0, 4096);
        assert!(ByteSize::parse("12 parsecs").is_err());
        assert!(ByteSize::parse("99999999999T").is_err());
        assert_eq!(ByteSize(3 << 30).to_string(), "3GiB");
        assert_eq!(Dur::parse("500ms").unwrap().0, Duration::from_millis(500));
        assert_eq!(Dur::parse("2m").unwrap().0, Duration::from_secs(120));
        assert_eq!(Dur::parse("1.5s").unwrap().0, Duration::from_millis(1500));
        assert!(Dur::parse("-1s").is_err());
        assert!(Dur::parse("3 fortnights").is_err());
    }
}
