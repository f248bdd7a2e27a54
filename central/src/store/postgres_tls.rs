//! Connecting to PostgreSQL with the URL's `sslmode` honoured, over rustls
//! (`tokio-postgres` itself knows only `disable`, `prefer` and `require`,
//! and verifies nothing).
//!
//! | `sslmode` | TLS | the server's certificate |
//! |---|---|---|
//! | `disable` | never | — |
//! | `prefer` (the default) | if the server offers it | not checked |
//! | `require` | always | not checked; with `sslrootcert`, as `verify-ca` (libpq does the same) |
//! | `verify-ca` | always | chains to `sslrootcert` |
//! | `verify-full` | always | chains to `sslrootcert` and names the host |
//!
//! `sslrootcert` is a PEM file of trusted CA certificates; `verify-ca` and
//! `verify-full` need it. Both parameters are taken out of the URL (or
//! key=value string) before `tokio-postgres` parses the rest.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};
use tokio_postgres::config::SslMode;
use tokio_postgres::{Client, Config};
use tokio_postgres_rustls::MakeRustlsConnect;

/// What the URL's `sslmode` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

/// Why a PostgreSQL URL cannot be connected to as it asks.
#[derive(Debug, thiserror::Error)]
pub enum PostgresTlsError {
    #[error("sslmode={0:?} is not one of disable, prefer, require, verify-ca, verify-full")]
    UnknownMode(String),
    #[error("sslmode={mode} needs sslrootcert=FILE (the PEM CA certificates to trust)")]
    NoRootCert { mode: &'static str },
    #[error("cannot read sslrootcert {path}: {message}", path = .path.display())]
    RootCert { path: PathBuf, message: String },
    #[error("sslrootcert {path} holds no usable CA certificate", path = .path.display())]
    NoUsableRootCert { path: PathBuf },
    #[error("invalid postgresql connection string: {0}")]
    Config(tokio_postgres::Error),
    #[error("cannot build the TLS configuration: {0}")]
    Tls(#[from] rustls::Error),
    #[error("cannot build the certificate verifier: {0}")]
    Verifier(#[from] rustls::client::VerifierBuilderError),
}

/// The parsed connection string: `tokio-postgres`'s config and the TLS
/// connector for its `sslmode`.
pub struct Target {
    pub config: Config,
    pub mode: TlsMode,
    pub tls: MakeRustlsConnect,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Target")
            .field("config", &self.config)
            .field("mode", &self.mode)
            .finish_non_exhaustive()
    }
}

/// Parses `url` (a `postgres://` URL or a key=value string).
pub fn target(url: &str) -> Result<Target, PostgresTlsError> {
    let (rest, mode, root_cert) = split_tls_parameters(url)?;
    let mut config: Config = rest.parse().map_err(PostgresTlsError::Config)?;
    let mode = match (mode, &root_cert) {
        (TlsMode::Require, Some(_)) => TlsMode::VerifyCa,
        (mode, _) => mode,
    };
    config.ssl_mode(match mode {
        TlsMode::Disable => SslMode::Disable,
        TlsMode::Prefer => SslMode::Prefer,
        TlsMode::Require | TlsMode::VerifyCa | TlsMode::VerifyFull => SslMode::Require,
    });
    let provider = http_serve::crypto_provider();
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()?;
    let client = match mode {
        TlsMode::Disable | TlsMode::Prefer | TlsMode::Require => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(Unverified(provider)))
            .with_no_client_auth(),
        TlsMode::VerifyCa | TlsMode::VerifyFull => {
            let name = if mode == TlsMode::VerifyCa {
                "verify-ca"
            } else {
                "verify-full"
            };
            let path = root_cert.ok_or(PostgresTlsError::NoRootCert { mode: name })?;
            let roots = Arc::new(root_store(&path)?);
            let webpki =
                WebPkiServerVerifier::builder_with_provider(roots.clone(), provider).build()?;
            if mode == TlsMode::VerifyFull {
                builder.with_root_certificates(roots).with_no_client_auth()
            } else {
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(AnyName(webpki)))
                    .with_no_client_auth()
            }
        }
    };
    Ok(Target {
        config,
        mode,
        tls: MakeRustlsConnect::new(client),
    })
}

/// Connects to `url` as its `sslmode` says; the connection runs on a task
/// of its own, which the returned handle aborts.
pub async fn connect(url: &str) -> Result<(Client, tokio::task::JoinHandle<()>), ConnectError> {
    let target = target(url)?;
    let mode = target.mode;
    let (client, connection) = target
        .config
        .connect(target.tls)
        .await
        .map_err(|source| ConnectError::Connect { mode, source })?;
    let connection = tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::error!(%error, "postgresql connection ended");
        }
    });
    Ok((client, connection))
}

/// Why a connection failed.
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error(transparent)]
    Target(#[from] PostgresTlsError),
    #[error("postgresql (sslmode {mode}): {source}", mode = mode_name(*.mode))]
    Connect {
        mode: TlsMode,
        source: tokio_postgres::Error,
    },
}

fn mode_name(mode: TlsMode) -> &'static str {
    match mode {
        TlsMode::Disable => "disable",
        TlsMode::Prefer => "prefer",
        TlsMode::Require => "require",
        TlsMode::VerifyCa => "verify-ca",
        TlsMode::VerifyFull => "verify-full",
    }
}

/// `url` without `sslmode` and `sslrootcert`, and what they said.
fn split_tls_parameters(url: &str) -> Result<(String, TlsMode, Option<PathBuf>), PostgresTlsError> {
    let mut mode = TlsMode::Prefer;
    let mut root_cert = None;
    let mut take = |key: &str, value: &str| -> Result<bool, PostgresTlsError> {
        match key {
            "sslmode" => {
                mode = match value {
                    "disable" => TlsMode::Disable,
                    "prefer" => TlsMode::Prefer,
                    "require" => TlsMode::Require,
                    "verify-ca" => TlsMode::VerifyCa,
                    "verify-full" => TlsMode::VerifyFull,
                    other => return Err(PostgresTlsError::UnknownMode(other.to_owned())),
                };
                Ok(true)
            }
            "sslrootcert" => {
                root_cert = Some(PathBuf::from(value));
                Ok(true)
            }
            _ => Ok(false),
        }
    };
    let rest = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        match url.split_once('?') {
            None => url.to_owned(),
            Some((base, query)) => {
                let mut kept = Vec::new();
                for pair in query.split('&') {
                    let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
                    if !take(key, &percent_decode(value))? {
                        kept.push(pair);
                    }
                }
                if kept.is_empty() {
                    base.to_owned()
                } else {
                    format!("{base}?{}", kept.join("&"))
                }
            }
        }
    } else {
        let mut kept = Vec::new();
        for word in url.split_whitespace() {
            let (key, value) = word.split_once('=').unwrap_or((word, ""));
            if !take(key, value.trim_matches('\''))? {
                kept.push(word);
            }
        }
        kept.join(" ")
    };
    Ok((rest, mode, root_cert))
}

/// `%XX` escapes decoded (a path in a URL query); anything malformed is
/// kept as written.
fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while at < bytes.len() {
        let escaped = (bytes[at] == b'%')
            .then(|| text.get(at + 1..at + 3))
            .flatten()
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        match escaped {
            Some(byte) => {
                out.push(byte);
                at += 3;
            }
            None => {
                out.push(bytes[at]);
                at += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn root_store(path: &Path) -> Result<RootCertStore, PostgresTlsError> {
    let certificates = CertificateDer::pem_file_iter(path)
        .and_then(Iterator::collect::<Result<Vec<_>, _>>)
        .map_err(|error| PostgresTlsError::RootCert {
            path: path.to_owned(),
            message: error.to_string(),
        })?;
    let mut roots = RootCertStore::empty();
    let (added, _ignored) = roots.add_parsable_certificates(certificates);
    if added == 0 {
        return Err(PostgresTlsError::NoUsableRootCert {
            path: path.to_owned(),
        });
    }
    Ok(roots)
}

/// `sslmode=prefer`/`require`: encrypted, the server's certificate not
/// checked (its handshake signatures still are).
#[derive(Debug)]
struct Unverified(Arc<CryptoProvider>);

impl ServerCertVerifier for Unverified {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `sslmode=verify-ca`: the chain must lead to `sslrootcert`; the name in
/// the certificate is not compared with the host.
#[derive(Debug)]
struct AnyName(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for AnyName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_tls_parameters_leave_the_url_and_the_rest_stays() {
        let (rest, mode, root) = split_tls_parameters(
            "postgres://u@db:5432/x?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem&connect_timeout=3",
        )
        .expect("parsed");
        assert_eq!(rest, "postgres://u@db:5432/x?connect_timeout=3");
        assert_eq!(mode, TlsMode::VerifyFull);
        assert_eq!(root, Some(PathBuf::from("/etc/ca.pem")));
        let (rest, mode, root) =
            split_tls_parameters("host=db user=u sslmode=disable").expect("parsed");
        assert_eq!(rest, "host=db user=u");
        assert_eq!(mode, TlsMode::Disable);
        assert_eq!(root, None);
        let (rest, mode, _) = split_tls_parameters("postgres://u@db/x").expect("parsed");
        assert_eq!(rest, "postgres://u@db/x");
        assert_eq!(mode, TlsMode::Prefer);
    }

    #[test]
    fn an_unknown_mode_or_a_verifying_mode_without_a_root_is_refused() {
        assert!(matches!(
            target("postgres://u@db/x?sslmode=allow-anything"),
            Err(PostgresTlsError::UnknownMode(mode)) if mode == "allow-anything"
        ));
        assert!(matches!(
            target("postgres://u@db/x?sslmode=verify-full"),
            Err(PostgresTlsError::NoRootCert {
                mode: "verify-full"
            })
        ));
        assert!(matches!(
            target("postgres://u@db/x?sslmode=verify-ca&sslrootcert=/nonexistent/ca.pem"),
            Err(PostgresTlsError::RootCert { .. })
        ));
    }

    #[test]
    fn require_with_a_root_certificate_verifies_the_chain() {
        // libpq: a root certificate makes `require` behave as `verify-ca`.
        let directory = std::env::temp_dir().join(format!("pgtls-{}", std::process::id()));
        std::fs::create_dir_all(&directory).expect("dir");
        let ca = rcgen::CertificateParams::new(Vec::<String>::new())
            .expect("params")
            .self_signed(&rcgen::KeyPair::generate().expect("key"))
            .expect("ca");
        let path = directory.join("ca.pem");
        std::fs::write(&path, ca.pem()).expect("write");
        let target = target(&format!(
            "postgres://u@db/x?sslmode=require&sslrootcert={}",
            path.display()
        ))
        .expect("target");
        assert_eq!(target.mode, TlsMode::VerifyCa);
        let _ = std::fs::remove_dir_all(&directory);
    }
}
