//! `s3`: pages as objects in any S3-compatible store (AWS S3, MinIO, Ceph RGW), through
//! object_store.
//!
//! Each page is one PUT of `header ‖ payload` (object_store sends the two buffers as one
//! payload without concatenating them) — S3 PUTs are atomic, so no torn object is ever
//! visible. Existence is a HEAD; `exists_prefix` issues HEADs concurrently and counts the
//! leading hits. Credentials come from the config, or from the standard `AWS_*` environment
//! variables when the config leaves them empty. Retries and timeouts are object_store's,
//! configured from kvtier's config; the caller's deadline still bounds every call.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use kvtier_config::l3::S3Section;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path;
use object_store::{ClientOptions, ObjectStore, ObjectStoreExt, PutPayload, RetryConfig};

use crate::{Removed, StorageError, Store, StoreStats, check_name};

/// The S3 backend.
#[derive(Debug)]
pub struct S3Store {
    store: Arc<AmazonS3>,
    prefix: String,
    bucket: String,
}

fn backend(op: &'static str, e: &object_store::Error) -> StorageError {
    let retryable = !matches!(
        e,
        object_store::Error::PermissionDenied { .. }
            | object_store::Error::Unauthenticated { .. }
            | object_store::Error::InvalidPath { .. }
            | object_store::Error::NotSupported { .. }
            | object_store::Error::NotImplemented { .. }
    );
    StorageError::Backend {
        backend: "s3",
        message: format!("{op}: {e}"),
        retryable,
    }
}

impl S3Store {
    /// Builds the client from `[l3.s3]`, each request bounded by `request_timeout` and tried
    /// once (the daemon's `Retrying` retries, above it). Fails on a configuration that cannot
    /// work (no bucket, bad URL); an unreachable server is found on first use.
    pub fn new(cfg: &S3Section, request_timeout: Duration) -> Result<Self, StorageError> {
        if cfg.bucket.is_empty() {
            return Err(StorageError::Invalid("s3: a bucket is required".into()));
        }
        let mut b = AmazonS3Builder::from_env()
            .with_bucket_name(&cfg.bucket)
            .with_virtual_hosted_style_request(cfg.virtual_hosted)
            .with_client_options(
                ClientOptions::new()
                    .with_timeout(request_timeout)
                    .with_connect_timeout(request_timeout)
                    .with_allow_http(
                        cfg.endpoint
                            .as_deref()
                            .is_some_and(|e| e.starts_with("http://")),
                    ),
            )
            // One retry layer: kvtierd's (`l3.retries`, jittered, within the call's
            // deadline, counted). The client's own would multiply its attempts.
            .with_retry(RetryConfig {
                max_retries: 0,
                retry_timeout: request_timeout,
                ..RetryConfig::default()
            });
        if let Some(endpoint) = &cfg.endpoint {
            b = b.with_endpoint(endpoint);
        }
        b = b.with_region(cfg.region.as_deref().unwrap_or("us-east-1"));
        if let Some(key) = &cfg.access_key {
            b = b
                .with_access_key_id(key)
                .with_secret_access_key(cfg.secret_key.expose());
        }
        let store = b
            .build()
            .map_err(|e| StorageError::Invalid(format!("s3: {e}")))?;
        Ok(Self {
            store: Arc::new(store),
            prefix: cfg.prefix.trim_matches('/').to_string(),
            bucket: cfg.bucket.clone(),
        })
    }

    /// The bucket.
    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    fn path(&self, name: &str) -> Path {
        if self.prefix.is_empty() {
            Path::from(name)
        } else {
            Path::from(format!("{}/{name}", self.prefix))
        }
    }
}

#[async_trait]
impl Store for S3Store {
    fn kind(&self) -> &'static str {
        "s3"
    }

    async fn get(&self, name: &str) -> Result<Option<Bytes>, StorageError> {
        check_name(name)?;
        match self.store.get(&self.path(name)).await {
            Ok(r) => Ok(Some(r.bytes().await.map_err(|e| backend("get", &e))?)),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(backend("get", &e)),
        }
    }

    async fn set(&self, name: &str, head: Bytes, body: Bytes) -> Result<(), StorageError> {
        check_name(name)?;
        let payload: PutPayload = [head, body].into_iter().collect();
        self.store
            .put(&self.path(name), payload)
            .await
            .map_err(|e| backend("put", &e))?;
        Ok(())
    }

    async fn exists(&self, name: &str) -> Result<bool, StorageError> {
        check_name(name)?;
        match self.store.head(&self.path(name)).await {
            Ok(_) => Ok(true),
            Err(object_store::Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(backend("head", &e)),
        }
    }

    async fn exists_prefix(&self, names: &[String]) -> Result<usize, StorageError> {
        for n in names {
            check_name(n)?;
        }
        // HEADs in flight at once; results stay in order, so the first miss ends the prefix.
        let heads: Vec<_> = names.iter().map(|n| self.exists(n)).collect();
        let mut heads = futures::stream::iter(heads).buffered(16);
        let mut leading = 0;
        while let Some(found) = heads.try_next().await? {
            if !found {
                break;
            }
            leading += 1;
        }
        Ok(leading)
    }

    async fn delete(&self, name: &str) -> Result<(), StorageError> {
        check_name(name)?;
        match self.store.delete(&self.path(name)).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(backend("delete", &e)),
        }
    }

    async fn clear(&self) -> Result<u64, StorageError> {
        // Everything under the prefix (the whole bucket without one), listed and deleted in
        // the store's bulk batches.
        let prefix = (!self.prefix.is_empty()).then(|| Path::from(self.prefix.as_str()));
        let listed = self
            .store
            .list(prefix.as_ref())
            .map_ok(|meta| meta.location)
            .boxed();
        let mut deleted = self.store.delete_stream(listed);
        let mut n = 0u64;
        while let Some(r) = deleted.next().await {
            match r {
                Ok(_) => n += 1,
                Err(object_store::Error::NotFound { .. }) => {}
                Err(e) => return Err(backend("clear", &e)),
            }
        }
        Ok(n)
    }

    fn take_removed(&self) -> Removed {
        Removed::default()
    }

    fn stats(&self) -> StoreStats {
        // The object store keeps its own accounting (and lifecycle rules bound it).
        StoreStats::default()
    }
}
