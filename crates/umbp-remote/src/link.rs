//! One connection to one Redis / Valkey server whose replies are read by
//! [`crate::resp::Reader`] (bounded, whatever the peer claims), in place of the `redis` crate's
//! own connection, which buffers a whole bulk string before it looks at it. The crate's
//! commands and pipelines run over it unchanged ([`redis::ConnectionLike`]). (Not its cluster
//! pipelines, which take only the crate's own connections: a cluster is still read by the
//! crate.)
//!
//! It speaks RESP2 over TCP or TLS (rustls; the system's roots, or `SSL_CERT_FILE`; no check
//! with `#insecure`), authenticates with the URL's user and password, and selects its
//! database.

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use redis::{
    ConnectionAddr, ConnectionInfo, ErrorKind, ProtocolVersion, RedisError, RedisResult, Value,
};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, ClientConnection, DigitallySignedStruct, SignatureScheme, StreamOwned};

use crate::resp::Reader;

enum Stream {
    Tcp(TcpStream),
    Tls(Box<StreamOwned<ClientConnection, TcpStream>>),
}

impl Stream {
    fn tcp(&self) -> &TcpStream {
        match self {
            Stream::Tcp(s) => s,
            Stream::Tls(s) => s.get_ref(),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, b: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(b),
            Stream::Tls(s) => s.read(b),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(b),
            Stream::Tls(s) => s.write(b),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.flush(),
            Stream::Tls(s) => s.flush(),
        }
    }
}

/// A connection whose replies are read within bounds (see the module's text).
pub(crate) struct Link {
    stream: Stream,
    reader: Reader,
    db: i64,
    /// False once a read or write failed: the stream may be mid-reply.
    open: bool,
}

fn client_err(what: &'static str, detail: String) -> RedisError {
    RedisError::from((ErrorKind::InvalidClientConfig, what, detail))
}

/// Accepts any certificate (`#insecure`), but still checks the handshake's signatures.
#[derive(Debug)]
struct AnyCertificate(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
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

fn tls_config(insecure: bool) -> RedisResult<ClientConfig> {
    let provider = rustls::crypto::CryptoProvider::get_default()
        .cloned()
        .unwrap_or_else(|| Arc::new(rustls::crypto::ring::default_provider()));
    let builder = ClientConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(|e| client_err("TLS versions", e.to_string()))?;
    if insecure {
        return Ok(builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(AnyCertificate(provider)))
            .with_no_client_auth());
    }
    let mut roots = rustls::RootCertStore::empty();
    let found = rustls_native_certs::load_native_certs();
    for c in found.certs {
        // A certificate the store cannot take is skipped, as the redis crate does.
        let _ = roots.add(c);
    }
    if roots.is_empty() {
        return Err(client_err(
            "no TLS root certificates",
            format!(
                "none found in the system's store ({:?}); set SSL_CERT_FILE to the CA's file",
                found.errors
            ),
        ));
    }
    Ok(builder.with_root_certificates(roots).with_no_client_auth())
}

fn connect_tcp(host: &str, port: u16, timeout: Option<Duration>) -> RedisResult<TcpStream> {
    let mut last = None;
    for addr in (host, port).to_socket_addrs()? {
        let r = match timeout {
            Some(t) => TcpStream::connect_timeout(&addr, t),
            None => TcpStream::connect(addr),
        };
        match r {
            Ok(s) => {
                let _ = s.set_nodelay(true);
                return Ok(s);
            }
            Err(e) => last = Some(e),
        }
    }
    Err(match last {
        Some(e) => e.into(),
        None => client_err("no address", format!("{host}:{port} resolves to nothing")),
    })
}

impl Link {
    fn open(info: &ConnectionInfo, timeout: Option<Duration>) -> RedisResult<Link> {
        let stream = match info.addr() {
            ConnectionAddr::Tcp(host, port) => Stream::Tcp(connect_tcp(host, *port, timeout)?),
            ConnectionAddr::TcpTls {
                host,
                port,
                insecure,
                tls_params,
            } => {
                if tls_params.is_some() {
                    return Err(client_err(
                        "TLS parameters",
                        "client certificates and custom roots are not supported here; use SSL_CERT_FILE for a CA".into(),
                    ));
                }
                let tcp = connect_tcp(host, *port, timeout)?;
                tcp.set_read_timeout(timeout)?;
                tcp.set_write_timeout(timeout)?;
                let name = ServerName::try_from(host.clone())
                    .map_err(|e| client_err("TLS server name", e.to_string()))?;
                let conn = ClientConnection::new(Arc::new(tls_config(*insecure)?), name)
                    .map_err(|e| client_err("TLS", e.to_string()))?;
                let mut tls = StreamOwned::new(conn, tcp);
                while tls.conn.is_handshaking() {
                    tls.conn.complete_io(&mut tls.sock).map_err(|e| {
                        RedisError::from((ErrorKind::Io, "TLS handshake", e.to_string()))
                    })?;
                }
                Stream::Tls(Box::new(tls))
            }
            other => {
                return Err(client_err(
                    "address",
                    format!("{other:?} is not a TCP address; the remote tier connects over TCP"),
                ))
            }
        };
        let r = info.redis_settings();
        if r.protocol() != ProtocolVersion::RESP2 {
            return Err(client_err(
                "protocol",
                "UMBP speaks RESP2 to the remote; drop protocol=resp3 from remote_url".into(),
            ));
        }
        let mut link = Link {
            stream,
            reader: Reader::default(),
            db: r.db(),
            open: true,
        };
        link.set_timeouts(timeout)?;
        if let Some(pw) = r.password() {
            let mut c = redis::cmd("AUTH");
            if let Some(u) = r.username() {
                c.arg(u);
            }
            c.arg(pw);
            c.query::<()>(&mut link).map_err(|e| {
                RedisError::from((
                    ErrorKind::AuthenticationFailed,
                    "the remote refused the password",
                    e.to_string(),
                ))
            })?;
        }
        if r.db() != 0 {
            redis::cmd("SELECT").arg(r.db()).query::<()>(&mut link)?;
        }
        Ok(link)
    }

    fn set_timeouts(&self, t: Option<Duration>) -> RedisResult<()> {
        self.set_read_timeout(t)?;
        self.set_write_timeout(t)
    }

    fn send(&mut self, bytes: &[u8]) -> RedisResult<()> {
        if !self.open {
            return Err(RedisError::from(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the connection was dropped after an earlier failure",
            )));
        }
        let r = self
            .stream
            .write_all(bytes)
            .and_then(|_| self.stream.flush());
        if r.is_err() {
            self.open = false;
        }
        Ok(r?)
    }

    fn recv(&mut self) -> RedisResult<Value> {
        let r = self.reader.reply(&mut self.stream);
        if r.is_err() {
            // Mid-reply, or a reply refused before it was read: nothing after it can be
            // told apart.
            self.open = false;
        }
        r
    }
}

impl Link {
    /// Connects to one server.
    pub(crate) fn connect_to(info: &ConnectionInfo, timeout: Duration) -> RedisResult<Link> {
        Link::open(info, Some(timeout))
    }

    fn set_read_timeout(&self, dur: Option<Duration>) -> RedisResult<()> {
        Ok(self.stream.tcp().set_read_timeout(dur)?)
    }

    fn set_write_timeout(&self, dur: Option<Duration>) -> RedisResult<()> {
        Ok(self.stream.tcp().set_write_timeout(dur)?)
    }
}

impl redis::ConnectionLike for Link {
    fn req_packed_command(&mut self, cmd: &[u8]) -> RedisResult<Value> {
        self.send(cmd)?;
        self.recv()
    }

    fn req_packed_commands(
        &mut self,
        cmd: &[u8],
        offset: usize,
        count: usize,
    ) -> RedisResult<Vec<Value>> {
        self.send(cmd)?;
        let mut out = Vec::with_capacity(count.min(1024));
        for i in 0..offset + count {
            // The first error of the stream ends the pipeline: the replies after it cannot be
            // found (the connection is closed).
            let v = self.recv()?;
            if i >= offset {
                out.push(v);
            }
        }
        Ok(out)
    }

    fn get_db(&self) -> i64 {
        self.db
    }

    fn check_connection(&mut self) -> bool {
        redis::cmd("PING").query::<String>(self).is_ok()
    }

    fn is_open(&self) -> bool {
        self.open
    }
}
