//! The operator's commands (`reservoir policy|gateway|pair …`) against a
//! real central service: each does what it says, the ledger shows it, and
//! bad input fails before anything is sent.

use std::path::Path;
use std::process::Output;

use central_client::ReserveReply;
use reservoir::cluster::{Central, Cluster, ClusterOptions, policy};
use shard_format::{ReservationState, canonical_bytes};
use tokio::process::Command;

const BINARY: &str = env!("CARGO_BIN_EXE_reservoir");
const SUBJECT: &str = "tenant-7";
const ROUTE: &str = "chat.generate";

async fn start_central() -> Cluster {
    Cluster::start(ClusterOptions::new(BINARY, 0))
        .await
        .expect("the central service starts")
}

/// `reservoir ARGS --central URL --central-ca-file CA`, the token from the
/// token file unless `token_env` gives it in `RESERVOIR_OPERATOR_TOKEN`.
async fn operator(central: &Central, args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut command = Command::new(BINARY);
    command
        .args(args)
        .args(["--central", &central.url()])
        .arg("--central-ca-file")
        .arg(central.ca_file().expect("the center serves HTTPS"))
        .env_remove("RESERVOIR_OPERATOR_TOKEN")
        .env("RESERVOIR_OPERATOR_TOKEN_FILE", central.token_path())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = command.spawn().expect("the binary runs");
    if let Some(bytes) = stdin {
        use tokio::io::AsyncWriteExt as _;
        let mut pipe = child.stdin.take().expect("stdin");
        pipe.write_all(bytes).await.expect("write stdin");
    }
    drop(child.stdin.take());
    child.wait_with_output().await.expect("the command ends")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn succeeded(output: &Output) -> String {
    assert!(
        output.status.success(),
        "{}\n{}",
        stdout(output),
        String::from_utf8_lossy(&output.stderr)
    );
    stdout(output)
}

fn write_policy(dir: &Path, generation: u64) -> std::path::PathBuf {
    let path = dir.join(format!("policy-{generation}.json"));
    std::fs::write(&path, canonical_bytes(&policy(SUBJECT, ROUTE, generation))).expect("write");
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_get_rollback_freeze_and_enroll() {
    let mut cluster = start_central().await;
    let central = cluster.central();
    let operator_client = central.operator().expect("operator client");

    // Publish from a file: the account it opened is printed.
    let file = write_policy(cluster.dir(), 1);
    let out = succeeded(
        &operator(
            central,
            &["policy", "publish", file.to_str().unwrap()],
            None,
        )
        .await,
    );
    assert!(
        out.contains("published tenant-7/chat.generate generation 1"),
        "{out}"
    );
    assert!(
        out.contains("generation 1: opening 1000, available 1000"),
        "{out}"
    );

    // Publish generation 2 from stdin.
    let bytes = canonical_bytes(&policy(SUBJECT, ROUTE, 2));
    let out = succeeded(&operator(central, &["policy", "publish", "-"], Some(&bytes)).await);
    assert!(out.contains("generation 2"), "{out}");

    // Get: the current policy document and the pair's state.
    let out = succeeded(&operator(central, &["policy", "get", SUBJECT, ROUTE], None).await);
    assert!(out.contains("\"policyGeneration\":2"), "{out}");
    assert!(
        out.contains("tenant-7/chat.generate: generation 2, debt 0"),
        "{out}"
    );

    // Rollback stops admission under generation 2; resume restarts it.
    let out = succeeded(&operator(central, &["policy", "rollback", SUBJECT, ROUTE], None).await);
    assert!(out.contains("generation 2: admission stopped"), "{out}");
    let view = operator_client
        .accounts(&SUBJECT.parse().unwrap(), &ROUTE.parse().unwrap())
        .await
        .expect("accounts");
    assert!(view.admission_stopped);
    let out = succeeded(&operator(central, &["policy", "rollback", SUBJECT, ROUTE], None).await);
    assert!(out.contains("admission was stopped already"), "{out}");
    // Only the current generation can be rolled back.
    let refused = operator(
        central,
        &["policy", "rollback", SUBJECT, ROUTE, "--generation", "1"],
        None,
    )
    .await;
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("not the current one (2)"),
        "{refused:?}"
    );
    let out = succeeded(
        &operator(
            central,
            &["policy", "rollback", SUBJECT, ROUTE, "--resume"],
            None,
        )
        .await,
    );
    assert!(out.contains("admission resumed"), "{out}");

    // Freeze and unfreeze.
    let out = succeeded(&operator(central, &["pair", "freeze", SUBJECT, ROUTE], None).await);
    assert!(out.contains("tenant-7/chat.generate: frozen"), "{out}");
    let view = operator_client
        .accounts(&SUBJECT.parse().unwrap(), &ROUTE.parse().unwrap())
        .await
        .expect("accounts");
    assert!(view.frozen && !view.admission_stopped);
    let out = succeeded(&operator(central, &["pair", "unfreeze", SUBJECT, ROUTE], None).await);
    assert!(out.contains("unfrozen"), "{out}");

    // Enroll an agent's identity; the agent may then reserve.
    let key = cluster.dir().join("agent.key");
    let keygen = Command::new(BINARY)
        .args(["keygen", "--out"])
        .arg(&key)
        .output()
        .await
        .expect("keygen");
    let identity = succeeded(&keygen).trim().to_owned();
    let out = succeeded(&operator(central, &["gateway", "enroll", &identity], None).await);
    assert_eq!(out.trim(), format!("enrolled {identity}"));
    let out = succeeded(
        &operator(
            central,
            &["gateway", "enroll", "--key-file", key.to_str().unwrap()],
            None,
        )
        .await,
    );
    assert_eq!(out.trim(), format!("{identity} was enrolled already"));
    let agent = central
        .as_identity(central_client::key_file::load(&key).expect("the agent key"))
        .expect("client");
    let request =
        reservoir::cluster::signed_reserve_request(&agent, SUBJECT, ROUTE, "k-1", 10).unwrap();
    let reply = agent
        .reserve(&request)
        .await
        .expect("the enrolled agent reserves");
    assert!(
        matches!(&reply, ReserveReply::Reserved(receipt) if receipt.state == ReservationState::Reserved),
        "{reply:?}"
    );

    let status = cluster.central_mut().stop().await.expect("stop");
    assert!(status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_fails_before_anything_is_sent() {
    let mut cluster = start_central().await;
    let central = cluster.central();

    // A policy that breaks a rule is refused locally, naming the field.
    let mut broken = policy(SUBJECT, ROUTE, 1);
    broken.opening = broken.burst + 1;
    let path = cluster.dir().join("broken.json");
    std::fs::write(&path, canonical_bytes(&broken)).expect("write");
    let refused = operator(
        central,
        &["policy", "publish", path.to_str().unwrap()],
        None,
    )
    .await;
    assert!(!refused.status.success());
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(
        stderr.contains("is not a valid policy") && stderr.contains("opening"),
        "{stderr}"
    );
    // Nothing was published.
    let out = operator(central, &["policy", "get", SUBJECT, ROUTE], None).await;
    assert!(!out.status.success(), "no policy yet: {out:?}");

    // A missing file, and no token at all.
    let refused = operator(central, &["policy", "publish", "/nonexistent.json"], None).await;
    assert!(String::from_utf8_lossy(&refused.stderr).contains("reading the policy file"));
    let refused = Command::new(BINARY)
        .args([
            "pair",
            "freeze",
            SUBJECT,
            ROUTE,
            "--central",
            &central.url(),
        ])
        .env_remove("RESERVOIR_OPERATOR_TOKEN")
        .env_remove("RESERVOIR_OPERATOR_TOKEN_FILE")
        .output()
        .await
        .expect("runs");
    assert!(!refused.status.success());
    assert!(
        String::from_utf8_lossy(&refused.stderr).contains("no operator token"),
        "{refused:?}"
    );

    // The token from the environment variable works as well as the file.
    let token = std::fs::read_to_string(central.token_path()).expect("token");
    let file = write_policy(cluster.dir(), 1);
    let published = Command::new(BINARY)
        .args([
            "policy",
            "publish",
            file.to_str().unwrap(),
            "--central",
            &central.url(),
        ])
        .arg("--central-ca-file")
        .arg(central.ca_file().expect("HTTPS"))
        .env_remove("RESERVOIR_OPERATOR_TOKEN_FILE")
        .env("RESERVOIR_OPERATOR_TOKEN", token.trim())
        .output()
        .await
        .expect("runs");
    assert!(succeeded(&published).contains("published"));

    let status = cluster.central_mut().stop().await.expect("stop");
    assert!(status.success());
}
