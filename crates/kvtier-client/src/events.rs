//! kvtierd's `WatchEvents` stream, read into domain events (`kvtier_core::events`).

use kvtier_core::events::{Event, EventKind, EventTier};
use kvtier_core::{LayoutFingerprint, PageKey};
use kvtier_proto::v1;

use crate::ClientError;

/// One message of the stream.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EventBatch {
    /// The stream's id (a new one after each kvtierd restart): what a resume names.
    pub stream_id: u64,
    /// The node's name.
    pub node: String,
    /// The events, in order.
    pub events: Vec<Event>,
}

/// The events of one `WatchEvents` call ([`crate::HostClient::watch_events`]).
pub struct EventStream(pub(crate) tonic::Streaming<v1::EventBatch>);

impl EventStream {
    /// The next batch; `None` when kvtierd ended the stream. A malformed event is an error
    /// naming its field.
    pub async fn next(&mut self) -> Result<Option<EventBatch>, ClientError> {
        let Some(b) = self.0.message().await? else {
            return Ok(None);
        };
        // A batch's events are nearly always of one layout: its hex is parsed once.
        let mut last: Option<(&str, LayoutFingerprint)> = None;
        let events = b
            .events
            .iter()
            .enumerate()
            .map(|(i, e)| {
                event(e, &mut last)
                    .map_err(|why| ClientError::Protocol(format!("events[{i}]: {why}")))
            })
            .collect::<Result<_, _>>()?;
        Ok(Some(EventBatch {
            stream_id: b.stream_id,
            node: b.node,
            events,
        }))
    }
}

/// One event; `last` is the layout parsed for the event before (kept for the next).
fn event<'a>(
    e: &'a v1::PageEvent,
    last: &mut Option<(&'a str, LayoutFingerprint)>,
) -> Result<Event, String> {
    let key = || PageKey::from_slice("key", &e.key).map_err(|x| x.to_string());
    let kind = match v1::PageEventKind::try_from(e.kind) {
        Ok(v1::PageEventKind::Stored) => EventKind::Stored {
            key: key()?,
            parent: match e.parent.len() {
                0 => None,
                _ => Some(PageKey::from_slice("parent", &e.parent).map_err(|x| x.to_string())?),
            },
        },
        Ok(v1::PageEventKind::Removed) => EventKind::Removed { key: key()? },
        Ok(v1::PageEventKind::Cleared) => EventKind::Cleared,
        Ok(v1::PageEventKind::Resync) => EventKind::Resync,
        _ => return Err(format!("kind: {} is not an event kind", e.kind)),
    };
    let layout = match e.layout.as_str() {
        "" => None,
        hex => match last {
            Some((h, fp)) if *h == hex => Some(*fp),
            _ => {
                let fp = LayoutFingerprint::from_hex("layout", hex).map_err(|x| x.to_string())?;
                *last = Some((hex, fp));
                Some(fp)
            }
        },
    };
    let tier = match v1::EventTier::try_from(e.tier) {
        Ok(v1::EventTier::L2Host) => EventTier::L2Host,
        Ok(v1::EventTier::L3Storage) => EventTier::L3Storage,
        _ => return Err(format!("tier: {} is not a tier", e.tier)),
    };
    Ok(Event {
        seq: e.seq,
        unix_nanos: e.unix_nanos,
        kind,
        layout,
        tier,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(layout: String) -> v1::PageEvent {
        v1::PageEvent {
            seq: 1,
            unix_nanos: 2,
            kind: v1::PageEventKind::Stored as i32,
            tier: v1::EventTier::L2Host as i32,
            key: vec![7; 32],
            parent: Vec::new(),
            layout,
        }
    }

    #[test]
    fn each_event_keeps_its_own_layout_when_a_batch_mixes_them() {
        let (a, b) = ("ab".repeat(16), "cd".repeat(16));
        let evs = [
            stored(a.clone()),
            stored(a.clone()),
            stored(b.clone()),
            stored(a.clone()),
        ];
        let mut last = None;
        let got: Vec<_> = evs
            .iter()
            .map(|e| event(e, &mut last).unwrap().layout.unwrap().to_hex())
            .collect();
        assert_eq!(got, [a.clone(), a.clone(), b, a]);
        // A malformed hex after a good one is still refused, by name.
        let bad = stored("zz".repeat(16));
        let err = event(&bad, &mut last).unwrap_err();
        assert!(err.contains("layout"), "{err}");
    }
}
