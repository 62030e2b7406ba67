//! `remote`: another kvtierd's storage tier, over its `kvtier.v1.ObjectStorage` byte-streaming
//! service. A page travels as one message of up to [`PAGE_CHUNK`] bytes (larger objects in
//! several); HTTP/2 flow-control windows are widened so a 2 MiB page does not stall on the
//! 64 KiB default, and frames are 256 KiB ([`kvtier_client::MAX_FRAME`]).

use async_trait::async_trait;
use bytes::{Bytes, BytesMut};
use kvtier_client::{AuthChannel, TcpSecurity};
use kvtier_proto::v1;
use kvtier_proto::v1::object_storage_client::ObjectStorageClient;

use crate::{Removed, StorageError, Store, StoreStats, check_name};

/// Bytes per streamed get message when the client does not say (kvtier ≤ 0.1 clients).
pub const CHUNK: usize = 1 << 20;

/// The chunk size kvtier sends and asks for: a page up to 8 MiB arrives as one message,
/// which the receiver keeps as it came instead of copying it into a second buffer. A set
/// sends the page's header and body as separate messages, which the server hands to its
/// backend as they are.
pub const PAGE_CHUNK: usize = 8 << 20;

/// The largest message a server sends or accepts, whatever a client asks for.
pub const MAX_CHUNK: usize = 16 << 20;

/// Largest object accepted in either direction (a 1 GiB page plus its header).
pub const MAX_OBJECT: u64 = (1 << 30) + 4096;

/// The remote backend.
#[derive(Debug, Clone)]
pub struct RemoteStore {
    client: ObjectStorageClient<AuthChannel>,
    target: String,
}

fn status(op: &'static str) -> impl FnOnce(tonic::Status) -> StorageError {
    move |s| StorageError::Backend {
        backend: "remote",
        message: format!("{op}: {}: {}", s.code(), s.message()),
        retryable: matches!(
            s.code(),
            tonic::Code::Unavailable
                | tonic::Code::DeadlineExceeded
                | tonic::Code::ResourceExhausted
                | tonic::Code::Aborted
                | tonic::Code::Internal
                | tonic::Code::Unknown
        ),
    }
}

impl RemoteStore {
    /// A store backed by the kvtierd at `target` (`http://host:port` or a Unix socket path),
    /// presenting nothing. Connects on first use, so a peer that is down now only makes calls
    /// fail (misses). Call it inside a tokio runtime (the channel's worker task is spawned
    /// there).
    pub fn connect(target: &str) -> Result<Self, StorageError> {
        Self::connect_with(target, &TcpSecurity::default())
    }

    /// Like [`RemoteStore::connect`], with TLS (for `https://` targets) and a bearer token.
    pub fn connect_with(target: &str, sec: &TcpSecurity) -> Result<Self, StorageError> {
        let channel =
            kvtier_client::connect_lazy_with(target, sec).map_err(|e| StorageError::Backend {
                backend: "remote",
                message: e.to_string(),
                retryable: !matches!(e, kvtier_client::ClientError::Security(_)),
            })?;
        Ok(Self {
            client: ObjectStorageClient::new(channel)
                .max_decoding_message_size(PAGE_CHUNK + 4096)
                .max_encoding_message_size(PAGE_CHUNK + 4096),
            target: target.to_string(),
        })
    }

    /// Where it connects.
    pub fn target(&self) -> &str {
        &self.target
    }
}

#[async_trait]
impl Store for RemoteStore {
    fn kind(&self) -> &'static str {
        "remote"
    }

    async fn get(&self, name: &str) -> Result<Option<Bytes>, StorageError> {
        check_name(name)?;
        let mut stream = self
            .client
            .clone()
            .get(v1::GetObjectRequest {
                name: name.to_string(),
                max_chunk: PAGE_CHUNK as u64,
            })
            .await
            .map_err(status("get"))?
            .into_inner();
        let mut buf = BytesMut::new();
        let mut total = None;
        while let Some(chunk) = stream.message().await.map_err(status("get"))? {
            if !chunk.found {
                return Ok(None);
            }
            let want = *total.get_or_insert(chunk.total_len);
            if want > MAX_OBJECT {
                return Err(StorageError::Invalid(format!(
                    "remote object of {want} bytes"
                )));
            }
            if buf.is_empty() {
                if chunk.data.len() as u64 == want {
                    // The whole object in one message: keep it as it came, once the stream
                    // has ended cleanly (a trailing error or chunk means it is not the object).
                    return match stream.message().await.map_err(status("get"))? {
                        None => Ok(Some(chunk.data)),
                        Some(_) => Err(StorageError::Backend {
                            backend: "remote",
                            message: format!("get {name}: more than the announced {want} bytes"),
                            retryable: true,
                        }),
                    };
                }
                buf.reserve(want as usize);
            }
            buf.extend_from_slice(&chunk.data);
            if buf.len() as u64 > want {
                break;
            }
        }
        match total {
            Some(t) if t == buf.len() as u64 => Ok(Some(buf.freeze())),
            // A stream cut short or overlong is not the object: report a failure, not data.
            Some(t) => Err(StorageError::Backend {
                backend: "remote",
                message: format!("get {name}: got {} of {t} bytes", buf.len()),
                retryable: true,
            }),
            None => Err(StorageError::Backend {
                backend: "remote",
                message: format!("get {name}: empty response"),
                retryable: true,
            }),
        }
    }

    async fn set(&self, name: &str, head: Bytes, body: Bytes) -> Result<(), StorageError> {
        check_name(name)?;
        let total = (head.len() + body.len()) as u64;
        let mut chunks: Vec<v1::SetObjectChunk> = [head, body]
            .iter()
            .flat_map(|part| {
                (0..part.len())
                    .step_by(PAGE_CHUNK)
                    .map(|at| part.slice(at..(at + PAGE_CHUNK).min(part.len())))
            })
            .map(|data| v1::SetObjectChunk {
                name: String::new(),
                total_len: 0,
                data,
            })
            .collect();
        if chunks.is_empty() {
            chunks.push(v1::SetObjectChunk::default());
        }
        chunks[0].name = name.to_string();
        chunks[0].total_len = total;
        self.client
            .clone()
            .set(tokio_stream_iter(chunks))
            .await
            .map_err(status("set"))?;
        Ok(())
    }

    async fn exists(&self, name: &str) -> Result<bool, StorageError> {
        Ok(self.exists_prefix(&[name.to_string()]).await? == 1)
    }

    async fn exists_prefix(&self, names: &[String]) -> Result<usize, StorageError> {
        for n in names {
            check_name(n)?;
        }
        if names.is_empty() {
            return Ok(0);
        }
        let r = self
            .client
            .clone()
            .exists(v1::ExistsRequest {
                names: names.to_vec(),
            })
            .await
            .map_err(status("exists"))?
            .into_inner();
        Ok((r.leading as usize).min(names.len()))
    }

    async fn delete(&self, name: &str) -> Result<(), StorageError> {
        check_name(name)?;
        self.client
            .clone()
            .delete(v1::DeleteObjectRequest {
                name: name.to_string(),
            })
            .await
            .map_err(status("delete"))?;
        Ok(())
    }

    async fn clear(&self) -> Result<u64, StorageError> {
        // The peer's tier is shared by every node that uses it: clearing it is the peer
        // operator's call, through the peer's own admin socket.
        Err(StorageError::Invalid(format!(
            "remote: the tier belongs to the kvtierd at {}; clear it there (kvtierctl clear l3 on that node)",
            self.target
        )))
    }

    fn take_removed(&self) -> Removed {
        Removed::default()
    }

    fn stats(&self) -> StoreStats {
        // The remote daemon reports its own tier; nothing is held here.
        StoreStats::default()
    }
}

/// A stream over owned messages, for client-streaming calls.
fn tokio_stream_iter(
    items: Vec<v1::SetObjectChunk>,
) -> impl tonic::codegen::tokio_stream::Stream<Item = v1::SetObjectChunk> + Send + 'static {
    tonic::codegen::tokio_stream::iter(items)
}
