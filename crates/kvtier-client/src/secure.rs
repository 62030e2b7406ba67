//! TCP targets with TLS and a bearer token: the client side of `server.tls_*` /
//! `server.token`, used by the remote L3 backend (`[l3.remote]`) and kvtierctl (environment:
//! `KVTIER_TOKEN`, `KVTIER_TLS_CA`, `KVTIER_TLS_CERT`, `KVTIER_TLS_KEY`).

use std::path::Path;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

use crate::ClientError;

/// Makes ring rustls's process-wide crypto provider. Other dependencies (object_store's
/// HTTP client) bring aws-lc-rs too, and with two providers compiled in rustls refuses to
/// guess; TLS servers and clients call this first. Idempotent.
pub fn install_crypto_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // An error means another provider was installed first, which serves as well.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// What a client presents to a TCP target: a token, the CA its certificate chains to, and a
/// client certificate where the server asks for one. The default presents nothing.
#[derive(Clone, Default)]
pub struct TcpSecurity {
    /// Sent as `authorization: Bearer <token>` on every call.
    pub token: Option<String>,
    /// PEM CA bundle for `https://` targets.
    pub ca_pem: Option<Vec<u8>>,
    /// PEM client certificate chain and key.
    pub identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for TcpSecurity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpSecurity")
            .field("token", &self.token.as_ref().map(|_| "***"))
            .field("ca_pem", &self.ca_pem.is_some())
            .field("identity", &self.identity.is_some())
            .finish()
    }
}

fn read(what: &str, path: Option<&Path>) -> Result<Option<Vec<u8>>, ClientError> {
    let Some(path) = path else {
        return Ok(None);
    };
    std::fs::read(path)
        .map(Some)
        .map_err(|e| ClientError::Security(format!("reading {what} {path:?}: {e}")))
}

impl TcpSecurity {
    /// From a token and PEM file paths (each optional).
    pub fn from_files(
        token: Option<String>,
        ca: Option<&Path>,
        cert: Option<&Path>,
        key: Option<&Path>,
    ) -> Result<Self, ClientError> {
        let identity = match (read("certificate", cert)?, read("key", key)?) {
            (Some(c), Some(k)) => Some((c, k)),
            (None, None) => None,
            _ => {
                return Err(ClientError::Security(
                    "a client certificate and its key go together".into(),
                ));
            }
        };
        Ok(Self {
            token,
            ca_pem: read("CA bundle", ca)?,
            identity,
        })
    }

    /// From `KVTIER_TOKEN`, `KVTIER_TLS_CA`, `KVTIER_TLS_CERT` and `KVTIER_TLS_KEY` (kvtierctl).
    pub fn from_env() -> Result<Self, ClientError> {
        let var = |k: &str| std::env::var(k).unwrap_or_default();
        let path =
            |k: &str| Some(std::path::PathBuf::from(var(k))).filter(|p| !p.as_os_str().is_empty());
        let token = Some(var("KVTIER_TOKEN").trim().to_string()).filter(|t| !t.is_empty());
        let (ca, cert, key) = (
            path("KVTIER_TLS_CA"),
            path("KVTIER_TLS_CERT"),
            path("KVTIER_TLS_KEY"),
        );
        Self::from_files(token, ca.as_deref(), cert.as_deref(), key.as_deref())
    }

    /// The endpoint of an `http://` or `https://` target, with TLS for https.
    pub(crate) fn endpoint(&self, target: &str) -> Result<Endpoint, ClientError> {
        let connect = |source| ClientError::Connect {
            target: target.to_string(),
            source,
        };
        let e = crate::tune(Endpoint::from_shared(target.to_string()).map_err(connect)?);
        if !target.starts_with("https://") {
            if self.ca_pem.is_some() || self.identity.is_some() {
                return Err(ClientError::Security(format!(
                    "TLS settings are given but {target} is not https://"
                )));
            }
            return Ok(e);
        }
        let Some(ca) = &self.ca_pem else {
            return Err(ClientError::Security(format!(
                "{target} is https: give the PEM CA bundle its certificate chains to \
                 (l3.remote.tls_ca, KVTIER_TLS_CA)"
            )));
        };
        install_crypto_provider();
        let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca));
        if let Some((cert, key)) = &self.identity {
            tls = tls.identity(Identity::from_pem(cert, key));
        }
        e.tls_config(tls).map_err(connect)
    }

    fn bearer(&self) -> Result<Bearer, ClientError> {
        match &self.token {
            None => Ok(Bearer(None)),
            Some(t) => format!("Bearer {t}")
                .parse()
                .map(|v| Bearer(Some(v)))
                .map_err(|_| {
                    ClientError::Security("the token must be printable ASCII without spaces".into())
                }),
        }
    }
}

/// Adds `authorization: Bearer <token>` to every call, when there is a token.
#[derive(Clone, Debug)]
pub struct Bearer(Option<MetadataValue<Ascii>>);

impl Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

/// A channel that presents a [`TcpSecurity`]'s token on every call.
pub type AuthChannel = InterceptedService<Channel, Bearer>;

/// Connects to a Unix socket path or an `http(s)://host:port` target with `sec`.
pub async fn connect_with(target: &str, sec: &TcpSecurity) -> Result<AuthChannel, ClientError> {
    let channel = if target.starts_with("http://") || target.starts_with("https://") {
        sec.endpoint(target)?
            .connect()
            .await
            .map_err(|source| ClientError::Connect {
                target: target.to_string(),
                source,
            })?
    } else {
        crate::connect(target).await?
    };
    Ok(InterceptedService::new(channel, sec.bearer()?))
}

/// Like [`connect_with`], but connects on first use (see [`crate::connect_lazy`]).
pub fn connect_lazy_with(target: &str, sec: &TcpSecurity) -> Result<AuthChannel, ClientError> {
    let channel = if target.starts_with("http://") || target.starts_with("https://") {
        sec.endpoint(target)?.connect_lazy()
    } else {
        crate::connect_lazy(target)?
    };
    Ok(InterceptedService::new(channel, sec.bearer()?))
}
