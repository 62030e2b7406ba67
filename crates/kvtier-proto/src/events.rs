//! `WatchEvents` messages (`EventBatch`), encoded and decoded by hand, both sides of the
//! stream in one place.
//!
//! kvtierd encodes a published batch of events once, however many streams carry it, and
//! each stream's message is its header (stream id, node) then the entries it sends, copied.
//! A protobuf message is the concatenation of its fields, so an `EventBatch` is
//! `header ++ entry ++ entry ...`, each entry being one `PageEvent` as field 3 (tag,
//! length, body): the bytes prost itself would write (tested below).
//!
//! A subscriber decodes a message straight into domain events ([`EventBatch`]), without
//! building the generated `v1::EventBatch` first: no allocation per event. A malformed
//! event is refused by its field, as the generated types' conversions would.

use crate::v1;
use kvtier_core::events::{Event, EventKind, EventTier};
use kvtier_core::{LayoutFingerprint, PageKey, TenantTag};

/// Protobuf wire types.
const VARINT: u64 = 0;
const LEN: u64 = 2;

fn varint_len(v: u64) -> usize {
    // 7 bits a byte; 0 takes one.
    (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
}

fn put_varint(buf: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        buf.push((v as u8) | 0x80);
        v >>= 7;
    }
    buf.push(v as u8);
}

/// A varint field's bytes (proto3 leaves out a zero).
fn varint_field_len(tag: u64, v: u64) -> usize {
    if v == 0 {
        0
    } else {
        varint_len(tag << 3) + varint_len(v)
    }
}

fn put_varint_field(buf: &mut Vec<u8>, tag: u64, v: u64) {
    if v != 0 {
        put_varint(buf, (tag << 3) | VARINT);
        put_varint(buf, v);
    }
}

/// A length-delimited field's bytes (proto3 leaves out an empty one).
fn bytes_field_len(tag: u64, b: &[u8]) -> usize {
    if b.is_empty() {
        0
    } else {
        varint_len(tag << 3) + varint_len(b.len() as u64) + b.len()
    }
}

fn put_bytes_field(buf: &mut Vec<u8>, tag: u64, b: &[u8]) {
    if !b.is_empty() {
        put_varint(buf, (tag << 3) | LEN);
        put_varint(buf, b.len() as u64);
        buf.extend_from_slice(b);
    }
}

/// The `PageEventKind` of an event.
fn wire_kind(k: &EventKind) -> v1::PageEventKind {
    match k {
        EventKind::Stored { .. } => v1::PageEventKind::Stored,
        EventKind::Removed { .. } => v1::PageEventKind::Removed,
        EventKind::Cleared { .. } => v1::PageEventKind::Cleared,
        EventKind::Resync => v1::PageEventKind::Resync,
    }
}

fn wire_tier(t: EventTier) -> v1::EventTier {
    match t {
        EventTier::L2Host => v1::EventTier::L2Host,
        EventTier::L3Storage => v1::EventTier::L3Storage,
    }
}

/// `EventBatch` field numbers.
const BATCH_STREAM_ID: u64 = 1;
const BATCH_NODE: u64 = 2;
const BATCH_EVENTS: u64 = 3;

/// The start of every message of one stream: its id and its node's name.
pub fn batch_header(stream_id: u64, node: &str) -> Vec<u8> {
    let mut b = Vec::with_capacity(16 + node.len());
    put_varint_field(&mut b, BATCH_STREAM_ID, stream_id);
    put_bytes_field(&mut b, BATCH_NODE, node.as_bytes());
    b
}

/// Events encoded as `EventBatch.events` entries, back to back, with where each ends: a
/// stream sends any run of them as they are.
#[derive(Debug, Default)]
pub struct EncodedEvents {
    bytes: Vec<u8>,
    ends: Vec<usize>,
    /// The last layout's hex (a batch is nearly always of one layout).
    hex: Option<(LayoutFingerprint, [u8; 32])>,
}

impl EncodedEvents {
    /// `events`, encoded.
    pub fn new(events: &[Event]) -> Self {
        // A STORED event with a parent: ~120 bytes.
        let mut e = Self {
            bytes: Vec::with_capacity(events.len() * 128),
            ends: Vec::with_capacity(events.len()),
            hex: None,
        };
        for ev in events {
            e.push(ev);
        }
        e
    }

    /// How many events.
    pub fn len(&self) -> usize {
        self.ends.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.ends.is_empty()
    }

    /// The entries of events `from..to`, as they go in a message.
    pub fn entries(&self, from: usize, to: usize) -> &[u8] {
        let start = if from == 0 { 0 } else { self.ends[from - 1] };
        let end = if to == 0 { 0 } else { self.ends[to - 1] };
        &self.bytes[start..end]
    }

    fn layout_hex(&mut self, fp: LayoutFingerprint) -> [u8; 32] {
        match self.hex {
            Some((f, h)) if f == fp => h,
            _ => {
                let mut h = [0u8; 32];
                h.copy_from_slice(fp.to_hex().as_bytes());
                self.hex = Some((fp, h));
                h
            }
        }
    }

    /// Appends `e`'s entry.
    pub fn push(&mut self, e: &Event) {
        let (key, parent): (&[u8], &[u8]) = match &e.kind {
            EventKind::Stored { key, parent } => (
                key.as_bytes(),
                parent.as_ref().map_or(&[][..], |p| p.as_bytes()),
            ),
            EventKind::Removed { key } => (key.as_bytes(), &[]),
            EventKind::Cleared { .. } | EventKind::Resync => (&[], &[]),
        };
        let hex = e.layout.map(|fp| self.layout_hex(fp));
        let layout: &[u8] = hex.as_ref().map_or(&[], |h| &h[..]);
        let kind = wire_kind(&e.kind) as u64;
        let tier = wire_tier(e.tier) as u64;
        let tenant = match e.kind {
            EventKind::Cleared { tenant: Some(t) } => t.0,
            _ => 0,
        };
        // PageEvent's fields, in number order, as prost writes them.
        let body = varint_field_len(1, e.seq)
            + varint_field_len(2, e.unix_nanos)
            + varint_field_len(3, kind)
            + varint_field_len(4, tier)
            + bytes_field_len(5, key)
            + bytes_field_len(6, parent)
            + bytes_field_len(7, layout)
            + varint_field_len(8, tenant);
        let b = &mut self.bytes;
        put_varint(b, (BATCH_EVENTS << 3) | LEN);
        put_varint(b, body as u64);
        put_varint_field(b, 1, e.seq);
        put_varint_field(b, 2, e.unix_nanos);
        put_varint_field(b, 3, kind);
        put_varint_field(b, 4, tier);
        put_bytes_field(b, 5, key);
        put_bytes_field(b, 6, parent);
        put_bytes_field(b, 7, layout);
        put_varint_field(b, 8, tenant);
        self.ends.push(b.len());
    }
}

/// One `WatchEvents` message, decoded.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventBatch {
    /// The stream's id (a new one after each kvtierd restart): what a resume names.
    pub stream_id: u64,
    /// The node's name.
    pub node: String,
    /// The events, in order.
    pub events: Vec<Event>,
}

/// Reads protobuf fields from a message's bytes.
struct Fields<'a>(&'a [u8]);

/// A field's value.
enum Value<'a> {
    Varint(u64),
    Bytes(&'a [u8]),
    /// A fixed-width value (no field here has one; skipped when unknown).
    Fixed,
}

impl<'a> Fields<'a> {
    fn varint(&mut self) -> Result<u64, String> {
        let mut v = 0u64;
        for i in 0..10 {
            let Some((&b, rest)) = self.0.split_first() else {
                return Err("the message ends inside a varint".into());
            };
            self.0 = rest;
            v |= u64::from(b & 0x7f) << (7 * i);
            if b < 0x80 {
                return Ok(v);
            }
        }
        Err("a varint longer than 10 bytes".into())
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], String> {
        if n > self.0.len() {
            return Err(format!(
                "a field of {n} bytes where {} are left",
                self.0.len()
            ));
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(head)
    }

    /// The next field (its number and value), or `None` at the end.
    fn next(&mut self) -> Result<Option<(u64, Value<'a>)>, String> {
        if self.0.is_empty() {
            return Ok(None);
        }
        let key = self.varint()?;
        let value = match key & 7 {
            0 => Value::Varint(self.varint()?),
            1 => {
                self.take(8)?;
                Value::Fixed
            }
            2 => {
                let n = self.varint()?;
                Value::Bytes(self.take(usize::try_from(n).map_err(|_| "a huge length")?)?)
            }
            5 => {
                self.take(4)?;
                Value::Fixed
            }
            w => {
                return Err(format!(
                    "field {}: wire type {w} is not supported",
                    key >> 3
                ));
            }
        };
        Ok(Some((key >> 3, value)))
    }
}

fn want_varint(field: &str, v: Value<'_>) -> Result<u64, String> {
    match v {
        Value::Varint(x) => Ok(x),
        _ => Err(format!("{field}: not a varint")),
    }
}

fn want_bytes<'a>(field: &str, v: Value<'a>) -> Result<&'a [u8], String> {
    match v {
        Value::Bytes(b) => Ok(b),
        _ => Err(format!("{field}: not length-delimited")),
    }
}

/// Decodes one `EventBatch` message. An error names what is wrong (`events[3].key: ...`).
/// Unknown fields are skipped, as protobuf readers do.
pub fn decode_batch(msg: &[u8]) -> Result<EventBatch, String> {
    let mut batch = EventBatch {
        stream_id: 0,
        node: String::new(),
        events: Vec::new(),
    };
    // A batch's events are nearly always of one layout: its hex is parsed once.
    let mut last: Option<(&[u8], LayoutFingerprint)> = None;
    let mut f = Fields(msg);
    while let Some((n, v)) = f.next()? {
        match n {
            BATCH_STREAM_ID => batch.stream_id = want_varint("stream_id", v)?,
            BATCH_NODE => {
                batch.node = std::str::from_utf8(want_bytes("node", v)?)
                    .map_err(|_| "node: not UTF-8")?
                    .to_string();
            }
            BATCH_EVENTS => {
                let i = batch.events.len();
                let body = want_bytes("events", v)?;
                let e =
                    decode_event(body, &mut last).map_err(|why| format!("events[{i}].{why}"))?;
                batch.events.push(e);
            }
            _ => {}
        }
    }
    Ok(batch)
}

/// One `PageEvent`; `last` is the layout parsed for an event before (kept for the next).
fn decode_event<'a>(
    body: &'a [u8],
    last: &mut Option<(&'a [u8], LayoutFingerprint)>,
) -> Result<Event, String> {
    let (mut seq, mut unix_nanos, mut kind, mut tier, mut tenant) = (0, 0, 0u64, 0u64, 0u64);
    let (mut key, mut parent, mut layout): (&[u8], &[u8], &[u8]) = (&[], &[], &[]);
    let mut f = Fields(body);
    while let Some((n, v)) = f.next()? {
        match n {
            1 => seq = want_varint("seq", v)?,
            2 => unix_nanos = want_varint("unix_nanos", v)?,
            3 => kind = want_varint("kind", v)?,
            4 => tier = want_varint("tier", v)?,
            5 => key = want_bytes("key", v)?,
            6 => parent = want_bytes("parent", v)?,
            7 => layout = want_bytes("layout", v)?,
            8 => tenant = want_varint("tenant_tag", v)?,
            _ => {}
        }
    }
    let page =
        |field: &'static str, b: &[u8]| PageKey::from_slice(field, b).map_err(|e| e.to_string());
    // An enum is an int32 on the wire: a negative one is 10 bytes of varint.
    let kind = match v1::PageEventKind::try_from(kind as i32) {
        Ok(v1::PageEventKind::Stored) => EventKind::Stored {
            key: page("key", key)?,
            parent: match parent.len() {
                0 => None,
                _ => Some(page("parent", parent)?),
            },
        },
        Ok(v1::PageEventKind::Removed) => EventKind::Removed {
            key: page("key", key)?,
        },
        Ok(v1::PageEventKind::Cleared) => EventKind::Cleared {
            tenant: (tenant != 0).then_some(TenantTag(tenant)),
        },
        Ok(v1::PageEventKind::Resync) => EventKind::Resync,
        _ => return Err(format!("kind: {} is not an event kind", kind as i32)),
    };
    let tier = match v1::EventTier::try_from(tier as i32) {
        Ok(v1::EventTier::L2Host) => EventTier::L2Host,
        Ok(v1::EventTier::L3Storage) => EventTier::L3Storage,
        _ => return Err(format!("tier: {} is not a tier", tier as i32)),
    };
    let layout = match layout {
        [] => None,
        hex => match last {
            Some((h, fp)) if *h == hex => Some(*fp),
            _ => {
                let s = std::str::from_utf8(hex).map_err(|_| "layout: not UTF-8")?;
                let fp = LayoutFingerprint::from_hex("layout", s).map_err(|e| e.to_string())?;
                *last = Some((hex, fp));
                Some(fp)
            }
        },
    };
    Ok(Event {
        seq,
        unix_nanos,
        kind,
        layout,
        tier,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;

    /// What prost makes of `events`, built field by field from the domain values.
    fn expected(stream_id: u64, node: &str, events: &[Event]) -> v1::EventBatch {
        let events = events
            .iter()
            .map(|e| {
                let (key, parent) = match e.kind {
                    EventKind::Stored { key, parent } => (
                        key.as_bytes().to_vec(),
                        parent.map(|p| p.as_bytes().to_vec()).unwrap_or_default(),
                    ),
                    EventKind::Removed { key } => (key.as_bytes().to_vec(), Vec::new()),
                    _ => (Vec::new(), Vec::new()),
                };
                v1::PageEvent {
                    seq: e.seq,
                    unix_nanos: e.unix_nanos,
                    kind: wire_kind(&e.kind) as i32,
                    tier: wire_tier(e.tier) as i32,
                    key,
                    parent,
                    layout: e.layout.map(|l| l.to_hex()).unwrap_or_default(),
                    tenant_tag: match e.kind {
                        EventKind::Cleared { tenant: Some(t) } => t.0,
                        _ => 0,
                    },
                }
            })
            .collect();
        v1::EventBatch {
            stream_id,
            node: node.to_string(),
            events,
        }
    }

    fn sample() -> Vec<Event> {
        let fp = |b| LayoutFingerprint([b; 16]);
        let k = |b| PageKey([b; 32]);
        let ev = |seq, kind, layout, tier| Event {
            seq,
            unix_nanos: 1_764_000_000_123_456_789u64.wrapping_add(seq),
            kind,
            layout,
            tier,
        };
        let mut v = vec![
            ev(0, EventKind::Resync, None, EventTier::L2Host),
            ev(
                0,
                EventKind::Stored {
                    key: k(1),
                    parent: None,
                },
                Some(fp(7)),
                EventTier::L2Host,
            ),
            ev(
                1,
                EventKind::Stored {
                    key: k(2),
                    parent: Some(k(1)),
                },
                Some(fp(7)),
                EventTier::L2Host,
            ),
            ev(
                u64::MAX,
                EventKind::Removed { key: k(2) },
                Some(fp(8)),
                EventTier::L3Storage,
            ),
            ev(
                300,
                EventKind::Cleared { tenant: None },
                None,
                EventTier::L3Storage,
            ),
            ev(
                301,
                EventKind::Cleared { tenant: None },
                Some(fp(7)),
                EventTier::L2Host,
            ),
            ev(
                302,
                EventKind::Cleared {
                    tenant: Some(TenantTag(0xacac_0000_1111_2222)),
                },
                Some(fp(7)),
                EventTier::L2Host,
            ),
        ];
        // A zero is left out, as prost leaves it out.
        v[4].unix_nanos = 0;
        v
    }

    #[test]
    fn entries_after_a_header_decode_as_prost_encodes_them() {
        let events = sample();
        let enc = EncodedEvents::new(&events);
        assert_eq!(enc.len(), events.len());
        for (id, node) in [(0u64, ""), (u64::MAX, "node-a"), (0x80, "n")] {
            let mut msg = batch_header(id, node);
            msg.extend_from_slice(enc.entries(0, enc.len()));
            let got = v1::EventBatch::decode(&msg[..]).unwrap();
            assert_eq!(got, expected(id, node, &events));
            // The same bytes as prost's own encoding.
            assert_eq!(msg, expected(id, node, &events).encode_to_vec());
        }
        // Any run of entries is a message of those events.
        let mut msg = batch_header(9, "n");
        msg.extend_from_slice(enc.entries(2, 5));
        assert_eq!(
            v1::EventBatch::decode(&msg[..]).unwrap(),
            expected(9, "n", &events[2..5])
        );
        assert!(enc.entries(3, 3).is_empty());
    }

    #[test]
    fn varint_lengths_match_the_encoding_at_every_width() {
        for shift in 0..64 {
            for v in [1u64 << shift, (1u64 << shift) - 1, u64::MAX >> shift] {
                let mut b = Vec::new();
                put_varint(&mut b, v);
                assert_eq!(b.len(), varint_len(v), "{v}");
                assert_eq!(prost::encoding::decode_varint(&mut &b[..]).unwrap(), v);
            }
        }
    }

    #[test]
    fn a_message_decodes_into_the_events_it_was_encoded_from() {
        let events = sample();
        let enc = EncodedEvents::new(&events);
        let mut msg = batch_header(42, "node-b");
        msg.extend_from_slice(enc.entries(0, enc.len()));
        let got = decode_batch(&msg).unwrap();
        assert_eq!(
            got,
            EventBatch {
                stream_id: 42,
                node: "node-b".into(),
                events: events.clone(),
            }
        );
        // prost's own encoding too, and with a field this version does not know (a newer
        // kvtierd's) inside an event and in the batch.
        let mut wire = expected(42, "node-b", &events).encode_to_vec();
        wire.extend_from_slice(&[0x50, 0x01]); // field 10, varint 1
        assert_eq!(decode_batch(&wire).unwrap(), got);
        let mut one = batch_header(1, "n");
        let e = v1::PageEvent {
            seq: 5,
            ..expected(0, "", &events[2..3]).events[0].clone()
        };
        let mut body = e.encode_to_vec();
        body.extend_from_slice(&[0x4a, 0x02, 0xff, 0xff]); // field 9, 2 bytes
        prost::encoding::bytes::encode(3, &body, &mut one);
        let got = decode_batch(&one).unwrap();
        assert_eq!(got.events[0].seq, 5);
        assert_eq!(got.events[0].kind, events[2].kind);
    }

    #[test]
    fn each_event_keeps_its_own_layout_when_a_batch_mixes_them() {
        // None, then fp 7, 7, 8, none, and 7 again.
        let events = sample();
        let layouts: Vec<_> = events.iter().map(|e| e.layout).collect();
        let enc = EncodedEvents::new(&events);
        let mut msg = batch_header(1, "n");
        msg.extend_from_slice(enc.entries(0, enc.len()));
        let got: Vec<_> = decode_batch(&msg)
            .unwrap()
            .events
            .iter()
            .map(|e| e.layout)
            .collect();
        assert_eq!(got, layouts);
    }

    #[test]
    fn a_malformed_event_is_refused_by_its_field() {
        let events = sample();
        let good = expected(1, "n", &events);
        let refused = |mutate: &dyn Fn(&mut v1::PageEvent)| {
            let mut b = good.clone();
            mutate(&mut b.events[2]);
            decode_batch(&b.encode_to_vec()).unwrap_err()
        };
        let e = refused(&|e| e.key = vec![1; 31]);
        assert!(
            e.starts_with("events[2].") && e.contains("key") && e.contains("31"),
            "{e}"
        );
        let e = refused(&|e| e.parent = vec![1; 33]);
        assert!(e.contains("events[2].") && e.contains("parent"), "{e}");
        let e = refused(&|e| e.layout = "zz".repeat(16));
        assert!(e.contains("events[2].") && e.contains("layout"), "{e}");
        let e = refused(&|e| e.kind = 9);
        assert!(e.contains("events[2].kind: 9"), "{e}");
        let e = refused(&|e| e.kind = -1);
        assert!(e.contains("events[2].kind: -1"), "{e}");
        let e = refused(&|e| e.tier = 0);
        assert!(e.contains("events[2].tier: 0"), "{e}");
        // A layout that is bad after a good one of the same batch is still refused.
        let e = refused(&|e| e.layout = good.events[1].layout.replace('0', "g"));
        assert!(e.contains("layout"), "{e}");
        // Cut anywhere, a message is an error, never a panic or a shorter batch.
        let whole = good.encode_to_vec();
        for cut in 1..whole.len() {
            if let Ok(b) = decode_batch(&whole[..cut]) {
                // Only a cut between two events leaves a well-formed message.
                assert!(b.events.len() < events.len(), "cut {cut}");
                assert_eq!(b.events[..], events[..b.events.len()]);
            }
        }
        assert!(decode_batch(&[0x1a, 0x05, 0x08]).is_err());
        assert!(decode_batch(&[0x0b]).unwrap_err().contains("wire type 3"));
        let mut long = vec![0x08];
        long.extend([0xff; 11]);
        assert!(decode_batch(&long).unwrap_err().contains("10 bytes"));
    }
}
