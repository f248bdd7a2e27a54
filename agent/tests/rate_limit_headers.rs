//! docs/design.md §6.4: every 429 from the agent's socket carries
//! `Retry-After`, and the IETF `RateLimit-Policy`/`RateLimit` fields of the
//! caller's own subject when the center sent them. Two rejections from a
//! real central service (redb, in process, on loopback) with the policy of
//! docs/design.md §4.7 (opening and burst 1000, refill 100 a second,
//! reservationUnitsMax 800):
//!
//! - capacity: 800 reserved, 300 more do not fit. The ledger gives a
//!   horizon; header and body agree on it.
//! - units above `reservationUnitsMax`: waiting alone will not help and the
//!   ledger gives no horizon. The agent used to send no `Retry-After` at
//!   all here; now it sends `RETRY_AFTER_NO_HORIZON_SECONDS`.

use std::path::Path;
use std::time::Duration;

use agent::daemon::{Daemon, DaemonConfig};
use agent::socket::{self, PeerPolicy, RETRY_AFTER_NO_HORIZON_SECONDS};
use agent_core::AgentConfig;
use central_client::CentralClient;
use serde_json::{Value, json};
use shard_format::DocumentSigner as _;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::UnixStream;
use tokio::sync::oneshot;

mod common;

use common::{agent_signer, central_signer, client_config, start_central, temp_dir};

/// An answer: status, lower-cased header names with their values, body.
struct Answer {
    status: u16,
    headers: Vec<(String, String)>,
    body: Value,
}

impl Answer {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(key, _)| key == name)
            .map(|(_, value)| value.as_str())
    }
}

/// One HTTP/1.1 exchange over the Unix socket (`Connection: close`).
async fn post(socket: &Path, path: &str, body: &Value) -> Answer {
    let mut stream = UnixStream::connect(socket).await.expect("connect");
    let body = body.to_string();
    let request = format!(
        "POST {path} HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    stream
        .write_all(request.as_bytes())
        .await
        .expect("send the request");
    let mut answer = Vec::new();
    stream
        .read_to_end(&mut answer)
        .await
        .expect("read the answer");
    let answer = String::from_utf8(answer).expect("UTF-8 answer");
    let (head, body) = answer.split_once("\r\n\r\n").expect("a head and a body");
    let mut lines = head.lines();
    let status = lines
        .next()
        .and_then(|line| line.split_whitespace().nth(1))
        .and_then(|code| code.parse().ok())
        .expect("a status line");
    let headers = lines
        .filter_map(|line| line.split_once(':'))
        .map(|(name, value)| (name.trim().to_ascii_lowercase(), value.trim().to_owned()))
        .collect();
    let body = serde_json::from_str(body).expect("a JSON body");
    Answer {
        status,
        headers,
        body,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_429_says_when_to_retry_and_the_callers_own_limit() {
    let dir = temp_dir("agent-rate-limit");
    // The center's clock stands still: no refill between the calls.
    let (service, base_url, _operator) = start_central(&dir).await;

    let signer = agent_signer();
    let config = DaemonConfig::new(
        AgentConfig::new(signer.key_id().clone()),
        dir.join("journal.redb"),
        vec![central_signer().key_id().clone()],
    );
    let client = CentralClient::new(client_config(&base_url))
        .expect("client")
        .with_identity(agent_signer());
    let daemon = Daemon::start(config, signer, client)
        .await
        .expect("the daemon starts");
    let socket_path = dir.join("agent.sock");
    let listener = socket::bind(&socket_path).await.expect("bind the socket");
    let (stop_socket, stopping) = oneshot::channel::<()>();
    let server = tokio::spawn(socket::serve(
        listener,
        daemon.handle(),
        PeerPolicy::default(),
        async move {
            let _ = stopping.await;
        },
    ));
    let epoch = tokio::time::timeout(Duration::from_secs(10), daemon.handle().registered())
        .await
        .expect("the boot registers in time")
        .expect("the daemon runs");
    assert!(epoch >= 1, "boot epoch {epoch}");

    let reserve = |key: &str, units: u64| json!({"idempotencyKey": key, "subject": "tenant-7", "route": "chat.generate", "units": units});
    let admitted = post(&socket_path, "/v1/reservations", &reserve("first", 800)).await;
    assert_eq!(admitted.status, 201, "{}", admitted.body);

    // Capacity: 200 left, 300 asked. The ledger's horizon, in both places.
    let capacity = post(&socket_path, "/v1/reservations", &reserve("second", 300)).await;
    assert_eq!(capacity.status, 429, "{}", capacity.body);
    assert_eq!(capacity.body["dimension"], "capacity", "{}", capacity.body);
    // The center's code and sentence for the same rejection.
    assert_eq!(capacity.body["error"], "rate_limited", "{}", capacity.body);
    assert!(
        capacity.body["message"]
            .as_str()
            .is_some_and(|message| message.starts_with("not enough capacity is available")),
        "{}",
        capacity.body
    );
    let seconds = capacity.body["retryAfterSeconds"]
        .as_u64()
        .expect("a horizon in the body");
    assert!(seconds >= 1, "{}", capacity.body);
    assert_eq!(
        capacity.header("retry-after"),
        Some(seconds.to_string().as_str())
    );
    // burst 1000, refilled at 100 a second: a 10 s window; 200 remain.
    assert_eq!(
        capacity.header("ratelimit-policy"),
        Some("\"budget\";q=1000;w=10")
    );
    let limit = capacity.header("ratelimit").expect("the RateLimit field");
    assert!(limit.starts_with("\"budget\";r=200;t="), "{limit}");

    // Above reservationUnitsMax: no horizon from the ledger, still a
    // Retry-After from the agent, and the same number in the body.
    let too_big = post(&socket_path, "/v1/reservations", &reserve("third", 900)).await;
    assert_eq!(too_big.status, 429, "{}", too_big.body);
    assert_eq!(
        too_big.body["dimension"], "reservationUnitsMax",
        "{}",
        too_big.body
    );
    let fallback = RETRY_AFTER_NO_HORIZON_SECONDS.to_string();
    assert_eq!(too_big.header("retry-after"), Some(fallback.as_str()));
    assert_eq!(
        too_big.body["retryAfterSeconds"],
        RETRY_AFTER_NO_HORIZON_SECONDS
    );
    assert_eq!(
        too_big.header("ratelimit-policy"),
        Some("\"budget\";q=1000;w=10")
    );

    let _ = stop_socket.send(());
    server
        .await
        .expect("the server task")
        .expect("the server stops cleanly");
    daemon.shutdown().await.expect("the daemon drains");
    service.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}
