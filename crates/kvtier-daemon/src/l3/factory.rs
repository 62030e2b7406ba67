//! The backend factory: turns `[l3]` into a store. One arm per [`L3Backend`]; the match is
//! exhaustive, so a backend added to the configuration without an arm here does not compile.

use std::sync::Arc;

use kvtier_config::daemon::{DaemonConfig, L3Backend};
use kvtier_core::TenantScope;
use kvtier_storage::file::{FileConfig, FileStore};
use kvtier_storage::memory::MemoryStore;
use kvtier_storage::remote::RemoteStore;
use kvtier_storage::rocks::{RocksConfig, RocksStore};
use kvtier_storage::s3::{S3Config, S3Store};
use kvtier_storage::{StorageError, Store};

/// Opens the configured backend, or `None` for `l3.backend = "none"`.
pub async fn open_backend(cfg: &DaemonConfig) -> Result<Option<Arc<dyn Store>>, StorageError> {
    let l3 = &cfg.l3;
    // Every tenant is tracked (usage for status and metrics); those with l3_bytes are held
    // to it. Validation refuses l3_bytes for backends without an object index.
    let tenants = cfg
        .tenants()
        .map_err(|e| StorageError::Invalid(e.to_string()))?;
    let tenant_quotas: Vec<_> = tenants
        .quotas()
        .iter()
        .map(|q| (TenantScope::new(&q.name).tag(), q.l3_bytes.unwrap_or(0)))
        .collect();
    Ok(match l3.backend {
        L3Backend::None => None,
        L3Backend::Memory => Some(Arc::new(MemoryStore::with_capacity(
            l3.memory.capacity_bytes.0,
        ))),
        L3Backend::Remote => {
            let r = &l3.remote;
            let token = r
                .bearer_token()
                .map_err(|e| StorageError::Invalid(e.to_string()))?;
            let sec =
                kvtier_client::TcpSecurity::from_files(token, &r.tls_ca, &r.tls_cert, &r.tls_key)
                    .map_err(|e| StorageError::Invalid(format!("l3.remote: {e}")))?;
            Some(Arc::new(RemoteStore::connect_with(&r.address, &sec)?))
        }
        L3Backend::S3 => {
            let s3 = &l3.s3;
            Some(Arc::new(S3Store::new(&S3Config {
                endpoint: s3.endpoint.clone(),
                region: s3.region.clone(),
                bucket: s3.bucket.clone(),
                prefix: s3.prefix.clone(),
                access_key: s3.access_key.clone(),
                secret_key: s3.secret_key.expose().to_string(),
                virtual_hosted: s3.virtual_hosted,
                request_timeout: l3.timeout.0,
                retries: s3.retries as usize,
            })?))
        }
        L3Backend::Rocksdb => Some(
            RocksStore::open(RocksConfig {
                path: cfg.l3_rocksdb_path(),
                capacity_bytes: l3.rocksdb.capacity_bytes.0,
                tenant_quotas,
                sync: l3.rocksdb.sync,
            })
            .await?,
        ),
        L3Backend::File => Some(
            FileStore::open(FileConfig {
                root: cfg.l3_file_path(),
                capacity_bytes: l3.file.capacity_bytes.0,
                tenant_quotas,
                min_free_bytes: l3.file.min_free_bytes.0,
                ttl: (!l3.file.ttl.0.is_zero()).then_some(l3.file.ttl.0),
                sync: l3.file.sync,
            })
            .await?,
        ),
    })
}
