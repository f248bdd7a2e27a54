//! `reservoir status` against a running agent, and against none.
//!
//! A real central service (redb, in process, on loopback) with the policy of
//! docs/design.md §4.7 and an agent daemon on a temporary Unix socket; the
//! `reservoir` binary is run as an operator would run it. With one
//! reservation open the table shows a healthy agent, its identity, its
//! registered boot and that reservation; `--json` is the agent's own JSON; `--config` finds the
//! socket in the agent's configuration. With nobody listening (no socket
//! file, or a stale one) it exits 1 and says which socket and what to check.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use agent::daemon::{Daemon, DaemonConfig};
use agent::socket::{self, PeerPolicy};
use agent_core::{AgentConfig, GatewayRequest, GatewayReserve, GatewayResponse};
use central::{ManualClock, Service, ServiceConfig, StoreConfig};
use central_client::{CentralClient, ClientConfig};
use serde_json::{Value, json};
use shard_format::{DocumentSigner as _, Ed25519Signer, EmergencyMode};
use tokio::sync::oneshot;

const OPERATOR_TOKEN: &str = "test-operator-token";

fn temp_dir(name: &str) -> PathBuf {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let dir = std::env::temp_dir().join(format!(
        "reservoir-{name}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

fn central_signer() -> Ed25519Signer {
    Ed25519Signer::from_secret_bytes(&[0xc0; 32])
}

fn agent_signer() -> Ed25519Signer {
    Ed25519Signer::from_secret_bytes(&[0x07; 32])
}

async fn status(args: &[&str]) -> Output {
    tokio::process::Command::new(env!("CARGO_BIN_EXE_reservoir"))
        .arg("status")
        .args(args)
        .env_remove("RESERVOIR_AGENT_SOCKET")
        .env_remove("RESERVOIR_AGENT_CONFIG")
        .output()
        .await
        .expect("run reservoir status")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_the_running_agent() {
    let dir = temp_dir("status");
    let now = central::Clock::now(&central::SystemClock);
    let mut service_config = ServiceConfig::new(
        StoreConfig::Redb(dir.join("ledger.redb")),
        central_signer(),
        OPERATOR_TOKEN.to_owned(),
    );
    service_config.workers = None;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let service = Service::start(service_config, listener, Arc::new(ManualClock::new(now)))
        .await
        .expect("the central service starts");
    let base_url = format!("http://{}", service.local_addr());
    let operator = CentralClient::new(ClientConfig::new(&base_url))
        .expect("client")
        .with_operator_token(OPERATOR_TOKEN);
    let mut policy = ledger::store::contract::sample_policy(1);
    policy.emergency_mode = EmergencyMode::Disabled;
    operator.publish_policy(&policy).await.expect("publish");
    operator
        .enroll_gateway(agent_signer().key_id())
        .await
        .expect("enrol the agent");

    let signer = agent_signer();
    let identity = signer.key_id().to_string();
    let config = DaemonConfig::new(
        AgentConfig::new(signer.key_id().clone()),
        dir.join("journal.redb"),
        vec![central_signer().key_id().clone()],
    );
    let client = CentralClient::new(ClientConfig::new(&base_url))
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
    let reserve: GatewayReserve = serde_json::from_value(json!({
        "idempotencyKey": "open-one",
        "subject": "tenant-7",
        "route": "chat.generate",
        "units": 100,
    }))
    .expect("a reserve");
    let answer = daemon
        .handle()
        .call(GatewayRequest::Reserve(reserve))
        .await
        .expect("the daemon answers");
    assert!(
        matches!(answer, GatewayResponse::Reservation { .. }),
        "{answer:?}"
    );

    let socket_arg = socket_path.to_str().expect("UTF-8 path");
    let table = status(&["--socket", socket_arg]).await;
    let stdout = text(&table.stdout);
    assert!(table.status.success(), "{stdout}{}", text(&table.stderr));
    assert!(stdout.contains("mode:               healthy"), "{stdout}");
    assert!(
        stdout.contains(&format!("identity:           {identity}")),
        "{stdout}"
    );
    assert!(
        stdout.contains(&format!("boot epoch:         {epoch}\n")),
        "{stdout}"
    );
    assert!(stdout.contains("open reservations:  1\n"), "{stdout}");
    assert!(stdout.contains("shards: none"), "{stdout}");

    let raw = status(&["--socket", socket_arg, "--json"]).await;
    assert!(raw.status.success(), "{}", text(&raw.stderr));
    let raw: Value = serde_json::from_slice(&raw.stdout).expect("JSON on stdout");
    assert_eq!(raw["bootEpoch"], epoch, "{raw}");
    assert_eq!(raw["identity"], identity.as_str(), "{raw}");
    assert_eq!(raw["reservationsInFlight"], 1, "{raw}");

    // The socket from the agent's configuration file.
    let config_file = dir.join("agent.toml");
    std::fs::write(
        &config_file,
        format!("socket = {}\n", toml_string(&socket_path)),
    )
    .expect("write the configuration");
    let configured = status(&["--config", config_file.to_str().expect("UTF-8 path")]).await;
    assert!(configured.status.success(), "{}", text(&configured.stderr));
    assert!(
        text(&configured.stdout).contains("mode:               healthy"),
        "{}",
        text(&configured.stdout)
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

fn toml_string(path: &Path) -> String {
    serde_json::to_string(path.to_str().expect("UTF-8 path")).expect("a string")
}

#[tokio::test]
async fn no_agent_is_exit_1_with_the_socket_named() {
    let dir = temp_dir("status-none");
    let missing = dir.join("missing.sock");
    let answer = status(&["--socket", missing.to_str().expect("UTF-8 path")]).await;
    assert_eq!(answer.status.code(), Some(1));
    assert!(answer.stdout.is_empty(), "{}", text(&answer.stdout));
    let stderr = text(&answer.stderr);
    assert!(
        stderr.contains(&format!("no agent is listening on {}", missing.display())),
        "{stderr}"
    );
    assert!(stderr.contains("is reservoir-agent running?"), "{stderr}");

    // A socket file nobody listens on any more (an agent that was killed).
    let stale = dir.join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).expect("bind"));
    let answer = status(&["--socket", stale.to_str().expect("UTF-8 path")]).await;
    assert_eq!(answer.status.code(), Some(1));
    let stderr = text(&answer.stderr);
    assert!(
        stderr.contains(&format!(
            "no agent is listening on {} (connection refused)",
            stale.display()
        )),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(dir);
}
