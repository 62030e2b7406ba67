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

/// A store's bound (`l3.file.capacity_bytes`): a size, `0` for none, or a share of the space
/// the store may use, `"50%"`: of the filesystem's free space when the store opens plus the
/// bytes the store already holds (so a restart over a full store keeps the same bound).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Capacity {
    /// No bound.
    Unbounded,
    /// At most this many bytes.
    Bytes(u64),
    /// This percentage (more than 0, at most 100) of the free space at start plus the
    /// store's own bytes.
    Percent(f64),
}

impl Capacity {
    /// Parses `50%`, `256GiB`, `0`.
    pub fn parse(s: &str) -> Result<Self, String> {
        if let Some(p) = s.trim().strip_suffix('%') {
            let p: f64 = p
                .trim()
                .parse()
                .map_err(|_| format!("{s:?} is not a percentage (e.g. 50%)"))?;
            if !(p > 0.0 && p <= 100.0) {
                return Err(format!(
                    "{s:?}: a share must be more than 0% and at most 100%"
                ));
            }
            return Ok(Self::Percent(p));
        }
        match ByteSize::parse(s)?.0 {
            0 => Ok(Self::Unbounded),
            n => Ok(Self::Bytes(n)),
        }
    }

    /// The bound in bytes, given the filesystem's free bytes at start and the store's own
    /// (0: none).
    pub fn resolve(self, free_at_start: u64, held: u64) -> u64 {
        match self {
            Self::Unbounded => 0,
            Self::Bytes(n) => n,
            Self::Percent(p) => {
                let space = free_at_start.saturating_add(held) as f64;
                ((space * p / 100.0) as u64).max(1)
            }
        }
    }
}

impl fmt::Display for Capacity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Unbounded => f.write_str("0"),
            Self::Bytes(n) => ByteSize(*n).fmt(f),
            Self::Percent(p) => write!(f, "{p}%"),
        }
    }
}

struct CapacityVisitor;

impl Visitor<'_> for CapacityVisitor {
    type Value = Capacity;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a size such as 256GiB, a number of bytes, or a share such as 50%")
    }
    fn visit_i64<E: de::Error>(self, v: i64) -> Result<Capacity, E> {
        let bytes = SizeVisitor.visit_i64::<E>(v)?;
        Capacity::parse(&bytes.0.to_string()).map_err(E::custom)
    }
    fn visit_u64<E: de::Error>(self, v: u64) -> Result<Capacity, E> {
        Capacity::parse(&v.to_string()).map_err(E::custom)
    }
    fn visit_str<E: de::Error>(self, v: &str) -> Result<Capacity, E> {
        Capacity::parse(v).map_err(E::custom)
    }
}

impl<'de> Deserialize<'de> for Capacity {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_any(CapacityVisitor)
    }
}

impl Serialize for Capacity {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

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
    fn a_capacity_is_a_size_none_or_a_share_of_the_space() {
        assert_eq!(Capacity::parse("0").unwrap(), Capacity::Unbounded);
        assert_eq!(Capacity::parse("2GiB").unwrap(), Capacity::Bytes(2 << 30));
        assert_eq!(Capacity::parse(" 50 % ").unwrap(), Capacity::Percent(50.0));
        for bad in ["0%", "101%", "-5%", "half%", "12 parsecs"] {
            assert!(Capacity::parse(bad).is_err(), "{bad}");
        }
        // Round trips as the default files spell it.
        for s in ["0", "2GiB", "50%", "33.5%"] {
            assert_eq!(Capacity::parse(s).unwrap().to_string(), s);
        }
        // A share of the free space plus what the store holds: a restart over a store that
        // filled its share keeps the same bound.
        let half = Capacity::Percent(50.0);
        assert_eq!(half.resolve(100, 0), 50);
        assert_eq!(half.resolve(50, 50), 50);
        assert_eq!(Capacity::Unbounded.resolve(100, 7), 0);
        assert_eq!(Capacity::Bytes(9).resolve(100, 7), 9);
        // Never 0 (which would mean no bound) on a full disk.
        assert_eq!(Capacity::Percent(1.0).resolve(0, 0), 1);
    }

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
