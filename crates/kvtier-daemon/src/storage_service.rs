//! `kvtier.v1.ObjectStorage`: this daemon's storage tier, served to other kvtierds (their
//! `remote` L3 backend). Objects stream in chunks of up to the size the client asks for
//! (`PAGE_CHUNK` from kvtier's own client, so a page is one message); a set becomes visible
//! only when the whole object arrived with the announced length.

use std::pin::Pin;
use std::sync::Arc;

use bytes::BytesMut;
use kvtier_proto::ApiError;
use kvtier_proto::v1;
use kvtier_proto::v1::object_storage_server::ObjectStorage;
use kvtier_storage::remote::{CHUNK, MAX_CHUNK, MAX_OBJECT};
use kvtier_storage::{StorageError, Store, check_name};
use tokio_stream::Stream;
use tonic::{Request, Response, Status, Streaming};

/// The service over the daemon's current storage tier.
#[derive(Debug, Clone)]
pub struct ObjectStorageService {
    l3: Arc<crate::l3::L3Slot>,
}

impl ObjectStorageService {
    /// Serves whatever tier `l3` holds at each call.
    pub fn new(l3: Arc<crate::l3::L3Slot>) -> Self {
        Self { l3 }
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
        // Up to two messages (a page's header and body) go to the backend as they came;
        // more are joined into one buffer.
        let mut parts = vec![first.data];
        let mut got = parts[0].len();
        while got <= total {
            match stream.message().await? {
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
