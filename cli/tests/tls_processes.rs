//! TLS between the processes (issue #13): the cluster's center serves HTTPS
//! with a generated CA and its agents trust that CA. An agent given another
//! CA cannot reach the center, and its status says so (`mode:
//! central_unreachable` and the TLS error), not `healthy`. Plain HTTP still
//! works on loopback; off loopback the center refuses to serve it and the
//! operator tools refuse to call it, unless told it is insecure.

use std::time::Duration;

use reservoir::cluster::{Cluster, ClusterOptions, generate_tls, wait_until};
use serde_json::Value;

const BINARY: &str = env!("CARGO_BIN_EXE_reservoir");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_that_does_not_trust_the_center_says_so_in_its_status() {
    let mut cluster = Cluster::start(ClusterOptions::new(BINARY, 1))
        .await
        .expect("the cluster starts over TLS");
    assert!(cluster.central().url().starts_with("https://"));
    let healthy = cluster.agent(0).status().await.expect("status");
    assert_eq!(healthy["mode"], "healthy", "{healthy}");
    assert_eq!(healthy["centralError"], Value::Null, "{healthy}");

    // The same agent, restarted with a CA that did not sign the center's
    // certificate.
    let stranger = generate_tls(&cluster.dir().join("stranger-tls")).expect("another CA");
    let agent = cluster.agent_mut(0);
    agent.stop().await.expect("stops");
    let config = std::fs::read_to_string(agent.config_path()).expect("config");
    let mut table: toml::Table = config.parse().expect("toml");
    table.insert(
        "central_ca_file".into(),
        toml::Value::String(stranger.ca.display().to_string()),
    );
    std::fs::write(agent.config_path(), table.to_string()).expect("rewrite config");
    agent.start().await.expect("starts");
    let client = agent.client();
    let status = wait_until(
        "the agent reports the center unreachable",
        Duration::from_secs(20),
        || {
            let client = client.clone();
            async move {
                let status = client.status().await?;
                Ok((status["mode"] == "central_unreachable").then_some(status))
            }
        },
    )
    .await
    .expect("the status says the center is unreachable");
    let error = status["centralError"].as_str().unwrap_or_default();
    assert!(
        error.contains("certificate") || error.contains("UnknownIssuer"),
        "the error names the certificate: {status}"
    );
    assert_eq!(status["bootEpoch"], Value::Null, "{status}");

    // What an operator sees.
    let output = tokio::process::Command::new(BINARY)
        .args(["status", "--socket"])
        .arg(agent.socket_path())
        .output()
        .await
        .expect("reservoir status");
    let table = String::from_utf8_lossy(&output.stdout);
    assert!(
        table.contains("mode:               central_unreachable"),
        "{table}"
    );
    assert!(table.contains("central:            UNREACHABLE"), "{table}");
    cluster.stop().await.expect("stops");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_http_on_loopback_still_serves() {
    let mut cluster = Cluster::start(ClusterOptions {
        plain_http: true,
        ..ClusterOptions::new(BINARY, 1)
    })
    .await
    .expect("the cluster starts over plain HTTP on loopback");
    assert!(cluster.central().url().starts_with("http://127.0.0.1:"));
    let status = cluster.agent(0).status().await.expect("status");
    assert_eq!(status["mode"], "healthy", "{status}");
    assert!(cluster.central().audit().await.expect("audit").ok);
    cluster.stop().await.expect("stops");
}

#[tokio::test]
async fn plain_http_off_loopback_is_refused_unless_called_insecure() {
    let dir = tempfile::tempdir().expect("dir");
    let keygen = tokio::process::Command::new(BINARY)
        .args(["keygen", "--data"])
        .arg(dir.path())
        .output()
        .await
        .expect("keygen");
    assert!(keygen.status.success());
    let serve = tokio::process::Command::new(BINARY)
        .args(["central", "serve", "--listen", "0.0.0.0:0", "--data"])
        .arg(dir.path())
        .env_remove("RESERVOIR_CENTRAL_INSECURE_HTTP")
        .output()
        .await
        .expect("central serve");
    assert!(!serve.status.success());
    let stderr = String::from_utf8_lossy(&serve.stderr);
    assert!(
        stderr.contains("refusing to serve plain HTTP on 0.0.0.0:0"),
        "{stderr}"
    );

    let token = dir.path().join("token");
    central_client::key_file::write_secret_file(&token, b"t\n").expect("token");
    let audit = tokio::process::Command::new(BINARY)
        .args(["audit", "--central", "http://192.0.2.1:7070"])
        .arg("--operator-token-file")
        .arg(&token)
        .env_remove("RESERVOIR_INSECURE_HTTP")
        .output()
        .await
        .expect("audit");
    assert!(!audit.status.success());
    let stderr = String::from_utf8_lossy(&audit.stderr);
    assert!(
        stderr.contains("refusing plain http:// to 192.0.2.1"),
        "{stderr}"
    );
}
