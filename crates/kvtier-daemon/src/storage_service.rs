//! `kvtier.v1.ObjectStorage`: this daemon's storage tier, served to other kvtierds (their
//! `remote` L3 backend). Objects stream in chunks of up to the size the client asks for
//! (`PAGE_CHUNK` from kvtier's own client, so a page is one message); a set becomes visible
//! only when the whole object arrived with the announced length. An upload holds room for its
//! bytes under [`UPLOAD_BUDGET`] and must finish within [`upload_deadline`]; empty chunks
//! after the first are refused. The service is for peer kvtierds and the operator only
//! (`crate::roles`).

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use bytes::BytesMut;
use kvtier_proto::ApiError;
use kvtier_proto::v1;
use kvtier_proto::v1::object_storage_server::ObjectStorage;
use kvtier_storage::remote::{CHUNK, MAX_CHUNK, MAX_OBJECT};
use kvtier_storage::{StorageError, Store, check_name};
use tokio::sync::Semaphore;
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

/// Bytes of unfinished uploads held at once, over every stream: two of the largest objects.
/// An upload waits for room (up to its deadline) before it takes a byte.
pub const UPLOAD_BUDGET: u64 = 2 * MAX_OBJECT;

/// How long an upload of `total` bytes may take from its first message to its last: 30 s,
/// plus a second per 8 MiB (a peer that stops sending holds its bytes no longer).
pub fn upload_deadline(total: u64) -> Duration {
    Duration::from_secs(30 + total / (8 << 20))
}

/// The service over the daemon's current storage tier.
#[derive(Debug, Clone)]
pub struct ObjectStorageService {
    l3: Arc<crate::l3::L3Slot>,
    /// Room for the bytes of unfinished uploads ([`UPLOAD_BUDGET`]).
    uploads: Arc<Semaphore>,
}

impl ObjectStorageService {
    /// Serves whatever tier `l3` holds at each call.
    pub fn new(l3: Arc<crate::l3::L3Slot>) -> Self {
        Self {
            l3,
            uploads: Arc::new(Semaphore::new(UPLOAD_BUDGET as usize)),
        }
    }

    fn store(&self) -> Result<Arc<dyn Store>, Status> {
        match self.l3.current() {
            Some(l3) => Ok(l3.breaker.clone()),
            None => {
                Err(ApiError::Unavailable("this kvtierd has no L3 backend attached".into()).into())
            }
        }
    }
}

fn api(e: StorageError) -> ApiError {
    match e {
        StorageError::Invalid(m) => ApiError::invalid("name", m),
        StorageError::Refused(m) => ApiError::invalid("object", m),
        StorageError::NoSpace(m) => ApiError::ResourceExhausted(m),
        other => ApiError::Unavailable(other.to_string()),
    }
}

fn name(n: &str) -> Result<(), Status> {
    check_name(n).map_err(|e| Status::from(api(e)))
}

type ChunkStream = Pin<Box<dyn Stream<Item = Result<v1::ObjectChunk, Status>> + Send>>;

#[tonic::async_trait]
impl ObjectStorage for ObjectStorageService {
    type GetStream = ChunkStream;

    async fn get(
        &self,
        request: Request<v1::GetObjectRequest>,
    ) -> Result<Response<Self::GetStream>, Status> {
        let n = &request.get_ref().name;
        name(n)?;
        let chunk = match request.get_ref().max_chunk {
            0 => CHUNK,
            c => usize::try_from(c)
                .unwrap_or(MAX_CHUNK)
                .clamp(64 << 10, MAX_CHUNK),
        };
        let obj = self
            .store()?
            .get(n)
            .await
            .map_err(|e| Status::from(api(e)))?;
        let chunks: Vec<Result<v1::ObjectChunk, Status>> = match obj {
            None => vec![Ok(v1::ObjectChunk::default())],
            Some(b) if b.is_empty() => vec![Ok(v1::ObjectChunk {
                found: true,
                total_len: 0,
                data: b,
            })],
            Some(b) => (0..b.len())
                .step_by(chunk)
                .map(|at| {
                    Ok(v1::ObjectChunk {
                        found: true,
                        total_len: b.len() as u64,
                        data: b.slice(at..(at + chunk).min(b.len())),
                    })
                })
                .collect(),
        };
        Ok(Response::new(Box::pin(tokio_stream::iter(chunks))))
    }

    async fn set(
        &self,
        request: Request<Streaming<v1::SetObjectChunk>>,
    ) -> Result<Response<v1::SetObjectResponse>, Status> {
        let mut stream = request.into_inner();
        let first = stream
            .message()
            .await?
            .ok_or_else(|| Status::from(ApiError::invalid("name", "empty stream")))?;
        name(&first.name)?;
        if first.total_len > MAX_OBJECT {
            return Err(ApiError::invalid(
                "total_len",
                format!(
                    "{} bytes exceeds the {MAX_OBJECT}-byte limit",
                    first.total_len
                ),
            )
            .into());
        }
        let total = first.total_len as usize;
        let deadline = tokio::time::Instant::now() + upload_deadline(first.total_len);
        let late = || {
            Status::deadline_exceeded(format!(
                "an upload of {total} bytes did not finish within {:?}",
                upload_deadline(first.total_len)
            ))
        };
        // Its bytes count against the budget of unfinished uploads until it is stored.
        let _room = tokio::time::timeout_at(
            deadline,
            self.uploads
                .clone()
                .acquire_many_owned(u32::try_from(total.max(1)).unwrap_or(u32::MAX)),
        )
        .await
        .map_err(|_| late())?
        .map_err(|_| Status::unavailable("shutting down"))?;
        // Up to two messages (a page's header and body) go to the backend as they came;
        // more are joined into one buffer.
        let mut parts = vec![first.data];
        let mut got = parts[0].len();
        while got <= total {
            match tokio::time::timeout_at(deadline, stream.message())
                .await
                .map_err(|_| late())??
            {
                // Every chunk after the first carries bytes: no stream of empty ones.
                Some(c) if c.data.is_empty() => {
                    return Err(ApiError::invalid("data", "an empty chunk after the first").into());
                }
                Some(c) => {
                    got += c.data.len();
                    parts.push(c.data);
                }
                None => break,
            }
        }
        if got != total {
            // Cut short or overlong: nothing is stored.
            return Err(ApiError::invalid(
                "data",
                format!("received {got} bytes of an announced {total}"),
            )
            .into());
        }
        let (head, body) = match parts.len() {
            1 => (bytes::Bytes::new(), parts.remove(0)),
            2 => {
                let body = parts.remove(1);
                (parts.remove(0), body)
            }
            _ => {
                let mut buf = BytesMut::with_capacity(total);
                for p in &parts {
                    buf.extend_from_slice(p);
                }
                (bytes::Bytes::new(), buf.freeze())
            }
        };
        self.store()?
            .set(&first.name, head, body)
            .await
            .map_err(|e| Status::from(api(e)))?;
        Ok(Response::new(v1::SetObjectResponse {}))
    }

    async fn exists(
        &self,
        request: Request<v1::ExistsRequest>,
    ) -> Result<Response<v1::ExistsResponse>, Status> {
        let names = &request.get_ref().names;
        if names.len() > 1 << 16 {
            return Err(ApiError::invalid("names", "more than 65536 names").into());
        }
        for (i, n) in names.iter().enumerate() {
            check_name(n).map_err(|e| {
                Status::from(ApiError::invalid(format!("names[{i}]"), e.to_string()))
            })?;
        }
        let n = self
            .store()?
            .exists_prefix(names)
            .await
            .map_err(|e| Status::from(api(e)))?;
        Ok(Response::new(v1::ExistsResponse { leading: n as u32 }))
    }

    async fn delete(
        &self,
        request: Request<v1::DeleteObjectRequest>,
    ) -> Result<Response<v1::DeleteObjectResponse>, Status> {
        let n = &request.get_ref().name;
        name(n)?;
        self.store()?
            .delete(n)
            .await
            .map_err(|e| Status::from(api(e)))?;
        Ok(Response::new(v1::DeleteObjectResponse {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_upload_gets_longer_the_larger_it_is_and_a_stalled_one_ends() {
        assert_eq!(upload_deadline(0), Duration::from_secs(30));
        assert_eq!(upload_deadline(8 << 20), Duration::from_secs(31));
        // The largest object: a little over two minutes at 8 MiB/s.
        assert_eq!(upload_deadline(MAX_OBJECT), Duration::from_secs(158));
        assert!(UPLOAD_BUDGET >= 2 * MAX_OBJECT && UPLOAD_BUDGET < u64::from(u32::MAX));
    }
}
