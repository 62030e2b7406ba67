//! The backend factory, next to the backends: turns `[l3]` into a store, each backend opened
//! from its own configuration section. One arm per [`L3Backend`]; the match is exhaustive,
//! so a backend added to the configuration without an arm here does not compile.

use std::sync::Arc;

use crate::file::FileStore;
use crate::memory::MemoryStore;
use crate::remote::RemoteStore;
use crate::rocks::RocksStore;
use crate::s3::S3Store;
use crate::{StorageError, Store};
use kvtier_config::daemon::{DaemonConfig, L3Backend};
use kvtier_core::TenantScope;

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
            let sec = kvtier_client::TcpSecurity::from_files(
                token,
                r.tls_ca.as_deref(),
                r.tls_cert.as_deref(),
                r.tls_key.as_deref(),
            )
            .map_err(|e| StorageError::Invalid(format!("l3.remote: {e}")))?;
            Some(Arc::new(RemoteStore::connect_with(&r.address, &sec)?))
        }
        L3Backend::S3 => Some(Arc::new(S3Store::new(&l3.s3, l3.timeout.0)?)),
        L3Backend::Rocksdb => {
            Some(RocksStore::open(cfg.l3_rocksdb_path(), &l3.rocksdb, &tenant_quotas).await?)
        }
        L3Backend::File => {
            Some(FileStore::open(cfg.l3_file_path(), &l3.file, &tenant_quotas).await?)
        }
    })
}
