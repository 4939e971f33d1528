//! TLS 1.3 material: server identities (PEM files or a self-signed certificate generated at
//! start), SHA-256 certificate fingerprints, and the client's trust choice (CA roots or a pinned
//! fingerprint). Verification is never disabled: a pinned certificate is checked byte for byte
//! and the handshake signature is still verified against it.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::Arc;

use rustls::DigitallySignedStruct;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{CryptoProvider, verify_tls12_signature, verify_tls13_signature};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer, ServerName, UnixTime};
use sha2::{Digest, Sha256};

/// The crypto provider claudelink uses (ring).
pub(crate) fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Why a TLS identity or trust setting could not be built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// A PEM file could not be read or parsed.
    #[error("cannot read PEM from {path}: {source}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// The parser's error.
        source: rustls::pki_types::pem::Error,
    },
    /// The certificate file holds no certificate.
    #[error("{path} contains no certificate")]
    NoCertificate {
        /// The file.
        path: PathBuf,
    },
    /// Generating a self-signed certificate failed.
    #[error("cannot generate a self-signed certificate: {0}")]
    Generate(#[from] rcgen::Error),
    /// rustls refused the certificate, key or protocol settings.
    #[error("rustls rejected the configuration: {0}")]
    Rustls(#[from] rustls::Error),
    /// A fingerprint string is not 32 hex bytes.
    #[error("invalid SHA-256 fingerprint `{0}` (expected 64 hex digits, colons optional)")]
    BadFingerprint(String),
}

/// SHA-256 of a DER certificate, written as 32 colon-separated hex bytes.
///
/// ```
/// use claudelink_proto::CertFingerprint;
/// let f = CertFingerprint::of_der(b"not really a certificate");
/// let parsed: CertFingerprint = f.to_string().parse().unwrap();
/// assert_eq!(f, parsed);
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct CertFingerprint(pub [u8; 32]);

impl CertFingerprint {
    /// Fingerprint of DER bytes.
    pub fn of_der(der: &[u8]) -> Self {
        Self(Sha256::digest(der).into())
    }
}

impl fmt::Display for CertFingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, b) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(":")?;
            }
            write!(f, "{b:02X}")?;
        }
        Ok(())
    }
}

impl fmt::Debug for CertFingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CertFingerprint({self})")
    }
}

impl FromStr for CertFingerprint {
    type Err = TlsError;
    fn from_str(s: &str) -> Result<Self, TlsError> {
        let hex: String = s.chars().filter(|c| *c != ':').collect();
        if hex.len() != 64 || !hex.is_ascii() {
            return Err(TlsError::BadFingerprint(s.to_owned()));
        }
        let mut out = [0u8; 32];
        for (i, o) in out.iter_mut().enumerate() {
            *o = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)
                .map_err(|_| TlsError::BadFingerprint(s.to_owned()))?;
        }
        Ok(Self(out))
    }
}

/// A server's certificate chain and private key.
#[derive(Debug)]
pub struct Identity {
    certs: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
}

impl Clone for Identity {
    fn clone(&self) -> Self {
        Self {
            certs: self.certs.clone(),
            key: self.key.clone_key(),
        }
    }
}

impl Identity {
    /// Loads a PEM certificate chain and a PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub fn from_pem_files(
        cert_path: impl AsRef<Path>,
        key_path: impl AsRef<Path>,
    ) -> Result<Self, TlsError> {
        let cert_path = cert_path.as_ref();
        let key_path = key_path.as_ref();
        let certs = CertificateDer::pem_file_iter(cert_path)
            .and_then(|it| it.collect::<Result<Vec<_>, _>>())
            .map_err(|source| TlsError::Pem {
                path: cert_path.to_owned(),
                source,
            })?;
        if certs.is_empty() {
            return Err(TlsError::NoCertificate {
                path: cert_path.to_owned(),
            });
        }
        let key = PrivateKeyDer::from_pem_file(key_path).map_err(|source| TlsError::Pem {
            path: key_path.to_owned(),
            source,
        })?;
        Ok(Self { certs, key })
    }

    /// Generates a self-signed certificate for `names` (e.g. `["localhost"]`) for local use.
    /// Clients must pin its [`Identity::fingerprint`] or add [`Identity::certificate`] to roots.
    pub fn self_signed(names: &[&str]) -> Result<Self, TlsError> {
        let names: Vec<String> = names.iter().map(|s| (*s).to_owned()).collect();
        let c = rcgen::generate_simple_self_signed(names)?;
        let cert = CertificateDer::from(c.cert);
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(c.signing_key.serialize_der()));
        Ok(Self {
            certs: vec![cert],
            key,
        })
    }

    /// The end-entity certificate.
    pub fn certificate(&self) -> &CertificateDer<'static> {
        &self.certs[0]
    }

    /// SHA-256 fingerprint of the end-entity certificate.
    pub fn fingerprint(&self) -> CertFingerprint {
        CertFingerprint::of_der(self.certificate())
    }

    pub(crate) fn rustls_server_config(
        &self,
        alpns: Vec<Vec<u8>>,
    ) -> Result<rustls::ServerConfig, TlsError> {
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_no_client_auth()
            .with_single_cert(self.certs.clone(), self.key.clone_key())?;
        cfg.alpn_protocols = alpns;
        // QUIC 0-RTT: quinn requires max_early_data_size = u32::MAX when early data is enabled.
        cfg.max_early_data_size = u32::MAX;
        // 0-RTT anti-replay (RFC 8446 section 8.1, single-use tickets): with no `Ticketer`, a
        // TLS 1.3 ticket is only the key of an entry in this in-memory store, and rustls
        // `take`s (removes) the entry when a client resumes with it, so a ticket resumes (and
        // carries early data) at most once; a replayed first flight gets a full handshake and
        // its early data is dropped. rustls refuses early data altogether with a stateless
        // `Ticketer`, so never set one here. The store holds 4096 tickets (two per
        // connection); when it is full the oldest go, and their clients do a full handshake.
        cfg.session_storage = rustls::server::ServerSessionMemoryCache::new(4096);
        debug_assert!(!cfg.ticketer.enabled());
        Ok(cfg)
    }

    /// The TLS configuration of HTTPS on TCP: TLS 1.3 and 1.2, ALPN `h2` then `http/1.1`,
    /// session resumption from an in-memory store (4096 sessions), and no early data (0-RTT
    /// over TCP would let a recorded request be replayed; claudelink has 0-RTT over QUIC).
    pub fn tcp_server_config(&self) -> Result<Arc<rustls::ServerConfig>, TlsError> {
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])?
            .with_no_client_auth()
            .with_single_cert(self.certs.clone(), self.key.clone_key())?;
        cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
        cfg.max_early_data_size = 0;
        cfg.session_storage = rustls::server::ServerSessionMemoryCache::new(4096);
        Ok(Arc::new(cfg))
    }
}

/// How a client authenticates the server.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Trust {
    /// Verify the chain against these roots (WebPKI rules, the name must match).
    Roots(Arc<rustls::RootCertStore>),
    /// Accept exactly the certificate with this SHA-256 fingerprint (the handshake signature is
    /// still verified with its key). For self-signed servers.
    Pinned(CertFingerprint),
}

impl Trust {
    /// Trust one certificate as a root (e.g. a self-signed server's, for tests).
    pub fn certificate(cert: CertificateDer<'static>) -> Result<Self, TlsError> {
        let mut roots = rustls::RootCertStore::empty();
        roots.add(cert)?;
        Ok(Self::Roots(Arc::new(roots)))
    }

    /// Trust the CA certificates of a PEM file.
    pub fn pem_file(path: impl AsRef<Path>) -> Result<Self, TlsError> {
        let path = path.as_ref();
        let certs = CertificateDer::pem_file_iter(path)
            .and_then(|it| it.collect::<Result<Vec<_>, _>>())
            .map_err(|source| TlsError::Pem {
                path: path.to_owned(),
                source,
            })?;
        if certs.is_empty() {
            return Err(TlsError::NoCertificate {
                path: path.to_owned(),
            });
        }
        let mut roots = rustls::RootCertStore::empty();
        for c in certs {
            roots.add(c)?;
        }
        Ok(Self::Roots(Arc::new(roots)))
    }

    /// The TLS 1.3 client configuration claudelink clients use, offering `alpns`: for a
    /// client of another protocol on the same endpoint (HTTP/3 on the claudelink port) that
    /// trusts the server the same way.
    ///
    /// ```
    /// use claudelink_proto::{Identity, Trust};
    /// let id = Identity::self_signed(&["localhost"])?;
    /// let tls = Trust::Pinned(id.fingerprint()).rustls_client_config(vec![b"h3".to_vec()])?;
    /// assert_eq!(tls.alpn_protocols, [b"h3".to_vec()]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn rustls_client_config(
        &self,
        alpns: Vec<Vec<u8>>,
    ) -> Result<rustls::ClientConfig, TlsError> {
        let builder = rustls::ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?;
        let mut cfg = match self {
            Self::Roots(roots) => builder
                .with_root_certificates(roots.clone())
                .with_no_client_auth(),
            Self::Pinned(fp) => builder
                .dangerous()
                .with_custom_certificate_verifier(Arc::new(PinnedVerifier {
                    fingerprint: *fp,
                    provider: provider(),
                }))
                .with_no_client_auth(),
        };
        cfg.alpn_protocols = alpns;
        cfg.enable_early_data = true;
        Ok(cfg)
    }
}

/// Accepts exactly one certificate, by SHA-256 fingerprint, and verifies handshake signatures
/// with its public key.
#[derive(Debug)]
pub struct PinnedVerifier {
    fingerprint: CertFingerprint,
    provider: Arc<CryptoProvider>,
}

impl PinnedVerifier {
    /// A verifier pinning `fingerprint`.
    pub fn new(fingerprint: CertFingerprint) -> Self {
        Self {
            fingerprint,
            provider: provider(),
        }
    }
}

impl ServerCertVerifier for PinnedVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        if CertFingerprint::of_der(end_entity) == self.fingerprint {
            Ok(ServerCertVerified::assertion())
        } else {
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::ApplicationVerificationFailure,
            ))
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls13_signature(
            message,
            cert,
            dss,
            &self.provider.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.provider
            .signature_verification_algorithms
            .supported_schemes()
    }
}
