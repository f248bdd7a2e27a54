//! The connection loop's limits, in process: a slowloris connection that
//! never finishes its head is closed after the header-read timeout, a
//! stalled body after the idle timeout; past the connection cap a new
//! connection waits until one closes; TLS serves a client that trusts the
//! CA and refuses one that does not.

use std::time::Duration;

use axum::Router;
use axum::routing::{get, post};
use http_serve::Limits;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

const DEADLINE: Duration = Duration::from_secs(10);

fn app() -> Router {
    Router::new()
        .route("/", get(|| async { "ok" }))
        .route("/echo", post(|body: String| async move { body }))
}

/// Serves `app()` on a loopback port until the returned sender is dropped.
async fn start(
    limits: Limits,
    tls: Option<http_serve::Tls>,
) -> (std::net::SocketAddr, tokio::sync::oneshot::Sender<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let address = listener.local_addr().expect("address");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let router = app();
    tokio::spawn(http_serve::serve(
        listener,
        tls,
        limits,
        move |_, _| router.clone(),
        async move {
            let _ = stopped.await;
        },
    ));
    (address, stop)
}

/// Reads until the server closes the connection (EOF or reset), within
/// [`DEADLINE`]; what it sent before.
async fn read_until_closed(stream: &mut TcpStream) -> Vec<u8> {
    let mut received = Vec::new();
    let mut buffer = [0u8; 1024];
    let deadline = Instant::now() + DEADLINE;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buffer)).await {
            Ok(Ok(0) | Err(_)) => return received,
            Ok(Ok(read)) => received.extend_from_slice(&buffer[..read]),
            Err(_) => panic!("the connection was still open after {DEADLINE:?}"),
        }
    }
}

fn limits(header_read_ms: u64, idle_ms: u64, connections_max: usize) -> Limits {
    Limits {
        header_read_timeout: Duration::from_millis(header_read_ms),
        idle_timeout: Duration::from_millis(idle_ms),
        connections_max,
    }
}

#[tokio::test]
async fn a_head_never_finished_is_closed_after_the_header_read_timeout() {
    let (address, _stop) = start(limits(200, 30_000, 16), None).await;
    let mut stream = TcpStream::connect(address).await.expect("connect");
    let sent = Instant::now();
    stream
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n")
        .await
        .expect("half a head");
    let answer = read_until_closed(&mut stream).await;
    let waited = sent.elapsed();
    assert!(
        waited >= Duration::from_millis(200),
        "closed after {waited:?}"
    );
    // hyper may answer 408 before closing; it never answers 200.
    assert!(
        !String::from_utf8_lossy(&answer).contains("200 OK"),
        "{answer:?}"
    );
    // A whole head within the timeout is served.
    let mut stream = TcpStream::connect(address).await.expect("connect");
    stream
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .expect("request");
    let answer = String::from_utf8(read_until_closed(&mut stream).await).expect("utf-8");
    assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
}

#[tokio::test]
async fn a_stalled_body_is_closed_after_the_idle_timeout() {
    let (address, _stop) = start(limits(30_000, 200, 16), None).await;
    let mut stream = TcpStream::connect(address).await.expect("connect");
    let sent = Instant::now();
    stream
        .write_all(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\nab")
        .await
        .expect("head and 2 of 10 body bytes");
    let answer = read_until_closed(&mut stream).await;
    let waited = sent.elapsed();
    assert!(
        waited >= Duration::from_millis(200),
        "closed after {waited:?}"
    );
    assert!(
        !String::from_utf8_lossy(&answer).contains("200 OK"),
        "{answer:?}"
    );
}

#[tokio::test]
async fn past_the_cap_a_connection_waits_until_one_closes() {
    let (address, _stop) = start(limits(30_000, 30_000, 1), None).await;
    let mut first = TcpStream::connect(address).await.expect("first");
    first
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("request");
    let mut buffer = [0u8; 1024];
    let read = tokio::time::timeout(DEADLINE, first.read(&mut buffer))
        .await
        .expect("answered")
        .expect("read");
    assert!(buffer[..read].starts_with(b"HTTP/1.1 200 OK"));
    // The first connection stays open (keep-alive): the second waits in
    // the backlog, unanswered.
    let mut second = TcpStream::connect(address).await.expect("second");
    second
        .write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .expect("request");
    let early = tokio::time::timeout(Duration::from_millis(300), second.read(&mut buffer)).await;
    assert!(early.is_err(), "answered past the cap: {early:?}");
    drop(first);
    let answer = String::from_utf8(read_until_closed(&mut second).await).expect("utf-8");
    assert!(answer.starts_with("HTTP/1.1 200 OK"), "{answer}");
}

#[tokio::test]
async fn tls_serves_a_client_that_trusts_the_ca_and_not_one_that_does_not() {
    let directory = tempfile_dir();
    let (ca, cert, key) = certificates(&directory);
    let tls = http_serve::tls(&cert, &key).expect("tls");
    let (address, _stop) = start(Limits::CENTRAL, Some(tls)).await;
    let url = format!("https://localhost:{}/", address.port());
    let provider = http_serve::crypto_provider();
    let client = |roots: rustls::RootCertStore| {
        let config = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_root_certificates(roots)
            .with_no_client_auth();
        reqwest::Client::builder()
            .tls_backend_preconfigured(config)
            .resolve("localhost", address)
            .build()
            .expect("client")
    };
    let mut trusting = rustls::RootCertStore::empty();
    trusting
        .add(rustls::pki_types::CertificateDer::from(ca.der().to_vec()))
        .expect("root");
    let answer = client(trusting).get(&url).send().await.expect("served");
    assert_eq!(answer.status(), 200);
    let other_ca = rcgen::CertificateParams::new(Vec::<String>::new())
        .expect("params")
        .self_signed(&rcgen::KeyPair::generate().expect("key"))
        .expect("other CA");
    let mut stranger = rustls::RootCertStore::empty();
    stranger
        .add(rustls::pki_types::CertificateDer::from(
            other_ca.der().to_vec(),
        ))
        .expect("root");
    let refused = client(stranger).get(&url).send().await;
    assert!(refused.is_err(), "{refused:?}");
    let _ = std::fs::remove_dir_all(&directory);
}

fn tempfile_dir() -> std::path::PathBuf {
    let mut nonce = [0u8; 8];
    getrandom::fill(&mut nonce).expect("random");
    let directory = std::env::temp_dir().join(format!("http-serve-{}", u64::from_le_bytes(nonce)));
    std::fs::create_dir_all(&directory).expect("dir");
    directory
}

/// A CA, and a certificate it signs for localhost (its PEM files).
fn certificates(
    directory: &std::path::Path,
) -> (rcgen::Certificate, std::path::PathBuf, std::path::PathBuf) {
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_key = rcgen::KeyPair::generate().expect("key");
    let ca = ca_params.self_signed(&ca_key).expect("ca");
    let issuer = rcgen::Issuer::new(ca_params, ca_key);
    let server_key = rcgen::KeyPair::generate().expect("key");
    let server = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
        .expect("params")
        .signed_by(&server_key, &issuer)
        .expect("server");
    let cert = directory.join("cert.pem");
    let key = directory.join("key.pem");
    std::fs::write(&cert, server.pem()).expect("cert");
    std::fs::write(&key, server_key.serialize_pem()).expect("key");
    (ca, cert, key)
}
