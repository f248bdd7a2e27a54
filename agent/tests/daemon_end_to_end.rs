//! The agent daemon end to end over real sockets: a real central service
//! (redb, in process, on loopback), the daemon with its redb journal on a
//! temporary Unix socket, and a gateway speaking HTTP/1.1 over that socket.
//! The first story of docs/design.md §4.7: 1000 available, reserve 600, the
//! same idempotency key again (same reservation), start, settle 200 — the
//! center then shows 800 available and 200 spent. A restart on the same
//! journal still knows the settled reservation. The socket's allow-list
//! holds at every request of a connection, and its refusals are counted.

use ledger::protocol::ErrorCode;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;

use agent::daemon::{Daemon, DaemonConfig, DaemonHandle};
use agent::socket::{self, Peer, PeerPolicy};
use agent_core::AgentConfig;
use central_client::CentralClient;
use serde_json::{Value, json};
use shard_format::{DocumentSigner as _, Route, Subject};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::UnixStream;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

mod common;

use common::{
    agent_signer, central_signer, client_config, start_central, start_central_on, temp_dir,
};

/// One HTTP/1.1 exchange over the Unix socket; `Connection: close` and a
/// `Content-Length` answer keep the parsing trivial.
async fn http(socket: &Path, method: &str, path: &str, body: Option<&Value>) -> (u16, Value) {
    let body = body.map(|value| value.to_string()).unwrap_or_default();
    let (status, _, body) = exchange(socket, method, path, "application/json", &body).await;
    (status, body)
}

/// [`http`] with a raw body and content type; also returns the head's
/// header lines, lowercased.
async fn exchange(
    socket: &Path,
    method: &str,
    path: &str,
    content_type: &str,
    body: &str,
) -> (u16, String, Value) {
    let request = format!(
        "{method} {path} HTTP/1.1\r\nHost: agent\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    send_raw(socket, request.as_bytes()).await
}

/// Sends `request` as it is on a new connection and reads the answer to
/// the end, as [`exchange`] gives it.
async fn send_raw(socket: &Path, request: &[u8]) -> (u16, String, Value) {
    let mut stream = UnixStream::connect(socket).await.expect("connect");
    stream.write_all(request).await.expect("send the request");
    let mut answer = Vec::new();
    stream
        .read_to_end(&mut answer)
        .await
        .expect("read the answer");
    let answer = String::from_utf8(answer).expect("UTF-8 answer");
    let (head, body) = answer.split_once("\r\n\r\n").expect("a head and a body");
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .expect("a status line");
    let body = if body.is_empty() {
        Value::Null
    } else {
        serde_json::from_str(body).unwrap_or(Value::String(body.to_owned()))
    };
    (status, head.to_ascii_lowercase(), body)
}

struct Agent {
    daemon: Daemon,
    stop_socket: oneshot::Sender<()>,
    server: JoinHandle<std::io::Result<()>>,
}

impl Agent {
    async fn start(base_url: &str, data: &Path, socket_path: &Path) -> Self {
        Self::start_with(base_url, data, socket_path, |_| {}).await
    }

    async fn start_with(
        base_url: &str,
        data: &Path,
        socket_path: &Path,
        configure: impl FnOnce(&mut AgentConfig),
    ) -> Self {
        let signer = agent_signer();
        let mut agent = AgentConfig::new(signer.key_id().clone());
        configure(&mut agent);
        let config = DaemonConfig::new(
            agent,
            data.join("journal.redb"),
            vec![central_signer().key_id().clone()],
        );
        let client = CentralClient::new(client_config(base_url))
            .expect("client")
            .with_identity(agent_signer());
        let daemon = Daemon::start(config, signer, client)
            .await
            .expect("the daemon starts");
        let listener = socket::bind(socket_path).await.expect("bind the socket");
        let (stop_socket, stopping) = oneshot::channel::<()>();
        let server = tokio::spawn(socket::serve(
            listener,
            daemon.handle(),
            PeerPolicy::default(),
            async move {
                let _ = stopping.await;
            },
        ));
        Self {
            daemon,
            stop_socket,
            server,
        }
    }

    fn handle(&self) -> DaemonHandle {
        self.daemon.handle()
    }

    async fn stop(self) {
        let _ = self.stop_socket.send(());
        self.server
            .await
            .expect("the server task")
            .expect("the server stops cleanly");
        self.daemon.shutdown().await.expect("the daemon drains");
    }
}

/// Polls `condition` at most `tries` times, 20 ms apart.
async fn wait_for_boot(handle: &DaemonHandle) {
    for _ in 0..250 {
        if handle.status().await.expect("status").boot_epoch.is_some() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("the agent never registered its boot");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reserve_retry_start_settle_over_the_socket() {
    let dir = temp_dir("agent-e2e");
    let (service, base_url, operator) = start_central(&dir).await;

    let data = dir.join("agent");
    std::fs::create_dir_all(&data).expect("agent data dir");
    let socket_path = dir.join("agent.sock");
    let agent = Agent::start(&base_url, &data, &socket_path).await;
    let mode = std::fs::metadata(&socket_path).expect("socket file");
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&mode.permissions()) & 0o777,
        0o660
    );
    wait_for_boot(&agent.handle()).await;

    let reserve = json!({
        "idempotencyKey": "req-1",
        "subject": "tenant-7",
        "route": "chat.generate",
        "units": 600,
    });
    let (status, first) = http(&socket_path, "POST", "/v1/reservations", Some(&reserve)).await;
    assert_eq!(status, 201, "{first}");
    assert_eq!(first["state"], "RESERVED", "{first}");
    let id = first["reservation"].as_str().expect("an ID").to_owned();

    // The gateway retries (its reply was lost): the same reservation.
    let (status, again) = http(&socket_path, "POST", "/v1/reservations", Some(&reserve)).await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["reservation"], first["reservation"]);

    // Bad input is named, and changes nothing.
    let mut bad = reserve.clone();
    bad["colour"] = json!("blue");
    let (status, refusal) = http(&socket_path, "POST", "/v1/reservations", Some(&bad)).await;
    assert_eq!(status, 400, "{refusal}");
    assert_eq!(refusal["field"], "colour");

    // Too large a body, a malformed ID: refused at the edge.
    let mut huge = reserve.clone();
    huge["request"] = json!("x".repeat(70 * 1024));
    let (status, refusal) = http(&socket_path, "POST", "/v1/reservations", Some(&huge)).await;
    assert_eq!(status, 413, "{refusal}");
    let (status, refusal) = http(&socket_path, "GET", "/v1/reservations/not%20an%20id", None).await;
    assert_eq!((status, &refusal["field"]), (400, &json!("reservation")));
    assert_eq!(refusal["error"], "invalid_path", "{refusal}");

    let (status, started) = http(
        &socket_path,
        "POST",
        &format!("/v1/reservations/{id}/start"),
        Some(&json!({"operationId": "op-1"})),
    )
    .await;
    assert_eq!(status, 200, "{started}");
    assert_eq!(started["state"], "STARTED", "{started}");

    let (status, settled) = http(
        &socket_path,
        "POST",
        &format!("/v1/reservations/{id}/settle"),
        Some(&json!({"operationId": "op-1", "actualUnits": 200})),
    )
    .await;
    assert_eq!(status, 200, "{settled}");
    assert_eq!(settled["state"], "SETTLED", "{settled}");

    let (status, fetched) =
        http(&socket_path, "GET", &format!("/v1/reservations/{id}"), None).await;
    assert_eq!((status, &fetched["state"]), (200, &json!("SETTLED")));
    let (status, missing) = http(&socket_path, "GET", "/v1/reservations/rl-nope", None).await;
    assert_eq!(status, 404, "{missing}");
    assert_eq!(missing["error"], "reservation_not_found", "{missing}");

    let accounts = operator
        .accounts(
            &Subject::new("tenant-7").expect("valid"),
            &Route::new("chat.generate").expect("valid"),
        )
        .await
        .expect("the accounts");
    assert_eq!(accounts.accounts.len(), 1, "{accounts:?}");
    let terms = accounts.accounts[0].terms;
    assert_eq!(
        (terms.available, terms.spent, terms.reserved),
        (800, 200, 0)
    );
    assert!(operator.audit().await.expect("audit").ok);

    let (status, agent_status) = http(&socket_path, "GET", "/v1/status", None).await;
    assert_eq!(status, 200);
    assert_eq!(agent_status["mode"], "healthy");
    assert_eq!(agent_status["bootEpoch"], 1);
    assert_eq!(agent_status["shardsClosed"], 0, "{agent_status}");
    let (status, shards) = http(&socket_path, "GET", "/v1/shards", None).await;
    assert_eq!(status, 200);
    assert_eq!(
        (&shards["shards"], &shards["next"]),
        (&agent_status["shards"], &Value::Null),
        "none closed: the list is the status's, in one page"
    );
    let (status, refused) = http(&socket_path, "GET", "/v1/shards?limit=0", None).await;
    assert_eq!((status, &refused["error"]), (400, &json!("invalid_query")));
    let (status, metrics) = http(&socket_path, "GET", "/metrics", None).await;
    assert_eq!(status, 200);
    let metrics = metrics.as_str().expect("text").to_owned();
    assert!(
        metrics.contains("reservoir_agent_journal_commits_total"),
        "{metrics}"
    );
    assert!(
        metrics.contains("reservoir_agent_gateway_responses_total{status=\"201\"} 1"),
        "{metrics}"
    );
    // Reserve, start and settle went to the center: their requests' time
    // is counted.
    let counter = |name: &str| -> u64 {
        metrics
            .lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or_else(|| panic!("{name} in {metrics}"))
    };
    assert!(
        counter("reservoir_agent_central_requests_total") >= 3,
        "{metrics}"
    );
    assert!(
        counter("reservoir_agent_central_request_microseconds_total") > 0,
        "{metrics}"
    );
    for gauge in [
        "reservoir_agent_partitioned_pairs 0",
        "reservoir_agent_unknown_reservations{state=\"RESERVATION_UNKNOWN\"} 0",
        "reservoir_agent_unknown_reservations{state=\"USAGE_UNKNOWN\"} 0",
        "reservoir_agent_unknown_oldest_seconds 0",
    ] {
        assert!(metrics.contains(gauge), "{gauge} in {metrics}");
    }

    // Restart on the same journal and socket path (the old socket file is
    // stale now): the settled reservation is still known, under a new boot.
    agent.stop().await;
    assert!(socket_path.exists(), "a stale socket file is left behind");
    let agent = Agent::start(&base_url, &data, &socket_path).await;
    wait_for_boot(&agent.handle()).await;
    let (status, fetched) =
        http(&socket_path, "GET", &format!("/v1/reservations/{id}"), None).await;
    assert_eq!((status, &fetched["state"]), (200, &json!("SETTLED")));
    let (_, agent_status) = http(&socket_path, "GET", "/v1/status", None).await;
    assert_eq!(agent_status["bootEpoch"], 2);
    let (status, again) = http(&socket_path, "POST", "/v1/reservations", Some(&reserve)).await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["reservation"], first["reservation"]);

    agent.stop().await;
    service.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}

/// Concurrent gateways share journal commits (group commit): 200 reserves
/// at once over the socket, every one admitted, in fewer durable
/// transactions than records. Prints what it measured.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_reserves_share_journal_commits_and_central_requests() {
    let dir = temp_dir("agent-group-commit");
    let (service, base_url, operator) = start_central(&dir).await;
    let data = dir.join("agent");
    std::fs::create_dir_all(&data).expect("agent data dir");
    let socket_path = dir.join("agent.sock");
    let agent = Agent::start(&base_url, &data, &socket_path).await;
    wait_for_boot(&agent.handle()).await;
    let metrics = agent.handle().metrics().clone();
    let commits_before = metrics.journal_commits.load(Ordering::Relaxed);
    let records_before = metrics.journal_records.load(Ordering::Relaxed);
    let calls_before = metrics.central_calls.load(Ordering::Relaxed);
    let requests_before = metrics.central_requests.load(Ordering::Relaxed);

    const GATEWAYS: usize = 200;
    let started = std::time::Instant::now();
    let mut tasks = Vec::new();
    for index in 0..GATEWAYS {
        let socket_path = socket_path.clone();
        tasks.push(tokio::spawn(async move {
            let body = json!({
                "idempotencyKey": format!("burst-{index}"),
                "subject": "tenant-7",
                "route": "chat.generate",
                "units": 1,
            });
            http(&socket_path, "POST", "/v1/reservations", Some(&body)).await
        }));
    }
    for task in tasks {
        let (status, body) = task.await.expect("the gateway task");
        assert_eq!(status, 201, "{body}");
    }
    let elapsed = started.elapsed();
    let commits = metrics.journal_commits.load(Ordering::Relaxed) - commits_before;
    let records = metrics.journal_records.load(Ordering::Relaxed) - records_before;
    eprintln!(
        "{GATEWAYS} concurrent durable reserves in {elapsed:?} ({:.0}/s): {records} journal records in {commits} commits",
        GATEWAYS as f64 / elapsed.as_secs_f64()
    );
    // Each reserve journals its request and then its receipt.
    assert!(records >= 2 * GATEWAYS as u64, "{records} records");
    assert!(
        commits < records,
        "group commit: {commits} commits for {records} records"
    );
    // Calls released together go to the center together (POST /v1/batch).
    let calls = metrics.central_calls.load(Ordering::Relaxed) - calls_before;
    let requests = metrics.central_requests.load(Ordering::Relaxed) - requests_before;
    eprintln!("{calls} central calls in {requests} requests");
    assert!(calls >= GATEWAYS as u64, "{calls} calls");
    assert!(
        requests < calls,
        "batches: {requests} requests for {calls} calls"
    );
    let accounts = operator
        .accounts(
            &Subject::new("tenant-7").expect("valid"),
            &Route::new("chat.generate").expect("valid"),
        )
        .await
        .expect("the accounts");
    assert_eq!(accounts.accounts[0].terms.reserved, GATEWAYS as u64);

    agent.stop().await;
    service.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}

/// The central ledger goes away: a reserve's outcome is unknown, and the
/// gateway hears 503 with Retry-After (not a rejection, not a hang). When
/// the center is back, the same idempotency key reserves under the same ID.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_center_is_503_then_the_same_key_reserves() {
    let dir = temp_dir("agent-unreachable");
    let (service, base_url, operator) = start_central(&dir).await;
    let address = service.local_addr().to_string();
    let data = dir.join("agent");
    std::fs::create_dir_all(&data).expect("agent data dir");
    let socket_path = dir.join("agent.sock");
    let agent = Agent::start_with(&base_url, &data, &socket_path, |config| {
        config.central_call_timeout_ms = 300;
        // The retry timer abandons an unknown reserve nobody waits for
        // (docs/design.md §3.3: an ID is re-sent or abandoned, never
        // replaced); keep it from racing the gateway's retry here.
        config.retry_interval_ms = 600_000;
    })
    .await;
    wait_for_boot(&agent.handle()).await;
    service.shutdown().await;

    let reserve = json!({
        "idempotencyKey": "while-away",
        "subject": "tenant-7",
        "route": "chat.generate",
        "units": 100,
    });
    let (status, unknown) = http(&socket_path, "POST", "/v1/reservations", Some(&reserve)).await;
    assert_eq!(status, 503, "{unknown}");
    assert_eq!(
        serde_json::from_value::<ErrorCode>(unknown["error"].clone()).ok(),
        Some(ErrorCode::ReservationUnknown),
        "{unknown}"
    );
    assert_eq!(unknown["retryAfterSeconds"], 1);
    let (_, metrics) = http(&socket_path, "GET", "/metrics", None).await;
    let metrics = metrics.as_str().expect("text").to_owned();
    assert!(
        metrics.contains("reservoir_agent_unknown_reservations{state=\"RESERVATION_UNKNOWN\"} 1"),
        "{metrics}"
    );

    let (service, _, _) = start_central_on(&dir, &address, false).await;
    let mut answer = (0, Value::Null);
    for _ in 0..250 {
        answer = http(&socket_path, "POST", "/v1/reservations", Some(&reserve)).await;
        if answer.0 != 503 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (status, reserved) = answer;
    assert!(status == 200 || status == 201, "{status} {reserved}");
    assert_eq!(reserved["state"], "RESERVED", "{reserved}");
    let accounts = operator
        .accounts(
            &Subject::new("tenant-7").expect("valid"),
            &Route::new("chat.generate").expect("valid"),
        )
        .await
        .expect("the accounts");
    assert_eq!(accounts.accounts[0].terms.reserved, 100, "reserved once");
    let (_, metrics) = http(&socket_path, "GET", "/metrics", None).await;
    let metrics = metrics.as_str().expect("text").to_owned();
    assert!(
        metrics.contains("reservoir_agent_unknown_reservations{state=\"RESERVATION_UNKNOWN\"} 0")
            && metrics.contains("reservoir_agent_unknown_oldest_seconds 0"),
        "{metrics}"
    );

    agent.stop().await;
    service.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}

/// docs/design.md §6.1: every answer of the socket that is not a 2xx is
/// JSON `{error, message}` with the code set of the center's API — the
/// refusals axum would write itself, the agent's own, and the center's
/// passed on with its status and code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_refusal_is_a_json_error_with_the_centers_codes() {
    let dir = temp_dir("agent-errors");
    let (service, base_url, _operator) = start_central(&dir).await;
    let data = dir.join("agent");
    std::fs::create_dir_all(&data).expect("agent data dir");
    let socket_path = dir.join("agent.sock");
    let agent = Agent::start(&base_url, &data, &socket_path).await;
    wait_for_boot(&agent.handle()).await;
    let socket = socket_path.as_path();

    let refusal = |status: u16, head: &str, body: &Value, code: &str| {
        assert!(
            head.contains("content-type: application/json"),
            "{code}: {head}"
        );
        assert_eq!(body["error"], code, "{status}: {body}");
        assert!(
            body["message"]
                .as_str()
                .is_some_and(|message| !message.is_empty()),
            "{body}"
        );
    };

    // A known path, a method it does not answer: 405 naming the ones it does.
    let (status, head, body) = exchange(socket, "DELETE", "/v1/reservations", "", "").await;
    assert_eq!(status, 405, "{body}");
    refusal(status, &head, &body, "method_not_allowed");
    assert!(head.contains("allow: post"), "{head}");
    let (status, head, body) = exchange(socket, "PUT", "/v1/reservations/rl-1", "", "").await;
    assert_eq!(status, 405, "{body}");
    refusal(status, &head, &body, "method_not_allowed");
    assert!(head.contains("allow: get"), "{head}");
    // No such path.
    let (status, head, body) = exchange(socket, "GET", "/v1/nothing", "", "").await;
    assert_eq!(status, 404, "{body}");
    refusal(status, &head, &body, "no_such_endpoint");
    // A path segment that is not UTF-8 once decoded; one that does not
    // decode as percent-encoding, hence is no reservation ID.
    for (method, path) in [
        ("GET", "/v1/reservations/%FF"),
        ("POST", "/v1/reservations/%E2%82/start"),
    ] {
        let (status, head, body) = exchange(socket, method, path, "", "").await;
        assert_eq!(status, 400, "{path}: {body}");
        refusal(status, &head, &body, "invalid_path");
    }
    let (status, head, body) = exchange(socket, "GET", "/v1/reservations/rl%zz", "", "").await;
    assert_eq!(status, 400, "{body}");
    refusal(status, &head, &body, "invalid_path");
    assert_eq!(body["field"], "reservation");
    // Not JSON, and one byte past the body limit.
    let (status, head, body) =
        exchange(socket, "POST", "/v1/reservations", "application/json", "{").await;
    assert_eq!(status, 400, "{body}");
    refusal(status, &head, &body, "invalid_body");
    let huge = " ".repeat(socket::BODY_BYTES_MAX + 1);
    let (status, head, body) = exchange(
        socket,
        "POST",
        "/v1/reservations",
        "application/json",
        &huge,
    )
    .await;
    assert_eq!(status, 413, "{body}");
    refusal(status, &head, &body, "body_too_large");
    // Exactly at the limit the body is read (and then found not to be JSON).
    let at_limit = " ".repeat(socket::BODY_BYTES_MAX);
    let (status, _, body) = exchange(
        socket,
        "POST",
        "/v1/reservations",
        "application/json",
        &at_limit,
    )
    .await;
    assert_eq!((status, &body["error"]), (400, &json!("invalid_body")));
    // Any content type: the body is JSON whatever the header says.
    let reserve = json!({
        "idempotencyKey": "typed",
        "subject": "tenant-7",
        "route": "chat.generate",
        "units": 10,
    })
    .to_string();
    let (status, _, first) =
        exchange(socket, "POST", "/v1/reservations", "text/plain", &reserve).await;
    assert_eq!(status, 201, "{first}");
    let id = first["reservation"].as_str().expect("an ID").to_owned();

    // The agent's own refusals, with the center's codes for the same thing.
    let (status, head, body) = exchange(
        socket,
        "POST",
        "/v1/reservations",
        "application/json",
        &reserve.replace("10", "0"),
    )
    .await;
    assert_eq!(status, 400, "{body}");
    refusal(status, &head, &body, "invalid_units");
    assert_eq!(body["field"], "units");
    let (status, head, body) = exchange(
        socket,
        "POST",
        "/v1/reservations",
        "application/json",
        &reserve.replace("10", "11"),
    )
    .await;
    assert_eq!(status, 409, "{body}");
    refusal(status, &head, &body, "idempotency_conflict");
    let settle = json!({"operationId": "op-1", "actualUnits": 1}).to_string();
    let (status, head, body) = exchange(
        socket,
        "POST",
        &format!("/v1/reservations/{id}/settle"),
        "application/json",
        &settle,
    )
    .await;
    assert_eq!(status, 409, "{body}");
    refusal(status, &head, &body, "not_started");
    let start = json!({"operationId": "op-1"}).to_string();
    let (status, _, body) = exchange(
        socket,
        "POST",
        &format!("/v1/reservations/{id}/start"),
        "application/json",
        &start,
    )
    .await;
    assert_eq!(status, 200, "{body}");
    // The admission routes bypass axum's router unless a segment is
    // percent-encoded: the same start that way is the same answer (a
    // replay), and the body limit holds on both ways.
    let encoded = format!("%{:02X}{}", id.as_bytes()[0], &id[1..]);
    let (status, _, again) = exchange(
        socket,
        "POST",
        &format!("/v1/reservations/{encoded}/start"),
        "application/json",
        &start,
    )
    .await;
    assert_eq!((status, &again), (200, &body));
    for reservation in [&id, &encoded] {
        let (status, head, body) = exchange(
            socket,
            "POST",
            &format!("/v1/reservations/{reservation}/settle"),
            "application/json",
            &huge,
        )
        .await;
        assert_eq!(status, 413, "{reservation}: {body}");
        refusal(status, &head, &body, "body_too_large");
    }
    for reservation in [&id, &encoded] {
        let (status, head, body) = exchange(
            socket,
            "POST",
            &format!("/v1/reservations/{reservation}/release"),
            "",
            "",
        )
        .await;
        assert_eq!(status, 409, "{reservation}: {body}");
        refusal(status, &head, &body, "illegal_state");
    }
    // A cancel, which only the router answers: the record, marked.
    let (status, _, body) = exchange(
        socket,
        "POST",
        &format!("/v1/reservations/{id}/cancel"),
        "",
        "",
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        (&body["reservation"], &body["cancelRequested"]),
        (&json!(id), &json!(true)),
        "{body}"
    );
    // A chunked body that breaks off in a malformed chunk cannot be read.
    let (status, head, body) = send_raw(
        socket,
        b"POST /v1/reservations HTTP/1.1\r\nHost: agent\r\nTransfer-Encoding: chunked\r\n\r\n5\r\n{\"a\":xyz\r\n",
    )
    .await;
    assert_eq!(status, 400, "{body}");
    refusal(status, &head, &body, "unreadable_body");

    // The center's refusal, passed on as it came: no policy for the pair.
    let unpublished = json!({
        "idempotencyKey": "nowhere",
        "subject": "tenant-7",
        "route": "chat.unpublished",
        "units": 10,
    });
    let (status, head, body) = exchange(
        socket,
        "POST",
        "/v1/reservations",
        "application/json",
        &unpublished.to_string(),
    )
    .await;
    assert_eq!(status, 404, "{body}");
    refusal(status, &head, &body, "no_policy");

    agent.stop().await;
    service.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}

/// Serves `daemon` on `path` with `peers`; the sender stops it.
async fn serve_with(path: &Path, daemon: DaemonHandle, peers: PeerPolicy) -> oneshot::Sender<()> {
    let listener = socket::bind(path).await.expect("bind the socket");
    let (stop, stopping) = oneshot::channel::<()>();
    tokio::spawn(socket::serve(listener, daemon, peers, async move {
        let _ = stopping.await;
    }));
    stop
}

/// Two keep-alive requests on one connection: the status code and body of
/// each answer.
async fn two_gets(path: &Path, target: &str) -> Vec<(u16, String)> {
    let mut stream = UnixStream::connect(path).await.expect("connect");
    let mut answers = Vec::new();
    for close in ["keep-alive", "close"] {
        let request =
            format!("GET {target} HTTP/1.1\r\nHost: agent\r\nConnection: {close}\r\n\r\n");
        stream
            .write_all(request.as_bytes())
            .await
            .expect("send the request");
        let mut head = Vec::new();
        while !head.ends_with(b"\r\n\r\n") {
            head.push(stream.read_u8().await.expect("read the head"));
        }
        let head = String::from_utf8(head).expect("UTF-8 head");
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|code| code.parse().ok())
            .expect("a status line");
        let length: usize = head
            .lines()
            .find_map(|line| {
                let (name, value) = line.split_once(':')?;
                name.eq_ignore_ascii_case("content-length")
                    .then(|| value.trim().parse().ok())?
            })
            .expect("a Content-Length");
        let mut body = vec![0; length];
        stream.read_exact(&mut body).await.expect("read the body");
        answers.push((status, String::from_utf8(body).expect("UTF-8 body")));
    }
    answers
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_outside_the_allow_list_is_refused_at_every_request_and_counted() {
    let dir = temp_dir("agent-peer-policy");
    let signer = agent_signer();
    let config = DaemonConfig::new(
        AgentConfig::new(signer.key_id().clone()),
        dir.join("journal.redb"),
        vec![central_signer().key_id().clone()],
    );
    // No central service: no request here gets as far as the daemon's
    // core. Nothing listens there; the daemon runs partitioned.
    let client = CentralClient::new(client_config("http://127.0.0.1:9"))
        .expect("client")
        .with_identity(agent_signer());
    let daemon = Daemon::start(config, signer, client)
        .await
        .expect("the daemon starts");

    let (mine, _other_end) = UnixStream::pair().expect("a socket pair");
    let uid = Peer::of(&mine)
        .uid
        .expect("the kernel names this process's uid");
    let allowed = dir.join("allowed.sock");
    let refused = dir.join("refused.sock");
    let _stop_allowed = serve_with(
        &allowed,
        daemon.handle(),
        PeerPolicy {
            allowed_uids: vec![uid],
            allowed_gids: Vec::new(),
        },
    )
    .await;
    let _stop_refused = serve_with(
        &refused,
        daemon.handle(),
        PeerPolicy {
            allowed_uids: vec![uid.wrapping_add(1)],
            allowed_gids: Vec::new(),
        },
    )
    .await;

    for (status, body) in
        tokio::time::timeout(Duration::from_secs(10), two_gets(&refused, "/v1/status"))
            .await
            .expect("answers in time")
    {
        assert_eq!(status, 403, "{body}");
        let body: Value = serde_json::from_str(&body).expect("a JSON body");
        assert_eq!(body["error"], "peer_not_allowed", "{body}");
    }
    let answers = tokio::time::timeout(Duration::from_secs(10), two_gets(&allowed, "/metrics"))
        .await
        .expect("answers in time");
    for (status, body) in &answers {
        assert_eq!(*status, 200, "{body}");
    }
    // The second scrape counts the first one's 200 and both refusals.
    let (_, metrics) = &answers[1];
    for counted in [
        "reservoir_agent_gateway_responses_total{status=\"403\"} 2",
        "reservoir_agent_gateway_responses_total{status=\"200\"} 1",
    ] {
        assert!(
            metrics.lines().any(|line| line == counted),
            "{counted} in:\n{metrics}"
        );
    }
}
