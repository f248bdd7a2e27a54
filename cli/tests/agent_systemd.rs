//! `reservoir agent run` as systemd runs it: a real process, a real central
//! service (redb, in process, on loopback), the notification socket played
//! by a datagram socket of the test (`NOTIFY_SOCKET`), socket activation by
//! `systemd-socket-activate` (Debian's `systemd` package;
//! `scripts/check-systemd` installs it).
//!
//! - READY=1 comes with the registered boot in STATUS=, WATCHDOG=1 follows
//!   at half `WATCHDOG_USEC`, SIGTERM brings STOPPING=1 and a clean exit;
//!   the socket comes from the environment over the file, the data
//!   directory from the flag over the environment.
//! - A center that does not answer at start: READY=1 still comes, with
//!   STATUS=degraded, and STATUS=healthy once the center registers the boot.
//! - A retention window below the agent's floor (here from the
//!   environment, over the file's) refuses to start, naming the setting
//!   and the floor, before anything is created or bound.
//! - A socket passed by systemd is served, and left in place on exit.
//!   Without `systemd-socket-activate` on the machine, a few lines of
//!   Python pass the socket the same way (fd 3, `LISTEN_FDS=1`,
//!   `LISTEN_PID` of the process that execs the agent).

use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use central::{ManualClock, Service, ServiceConfig, StoreConfig};
use central_client::{CentralClient, ClientConfig};
use shard_format::{DocumentSigner as _, Ed25519Signer, EmergencyMode, KeyId, Timestamp};
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::net::{TcpListener, UnixDatagram};
use tokio::process::{Child, Command};

const BINARY: &str = env!("CARGO_BIN_EXE_reservoir");
const OPERATOR_TOKEN: &str = "test-operator-token";
/// How long any one expected event may take on a loaded machine.
const EVENT_TIMEOUT: Duration = Duration::from_secs(30);

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

fn now() -> Timestamp {
    central::Clock::now(&central::SystemClock)
}

/// The central service on `listener` with the policy of docs/design.md §4.7
/// and `identity` enrolled.
async fn start_central(dir: &Path, listener: TcpListener, identity: &KeyId) -> Service {
    let mut config = ServiceConfig::new(
        StoreConfig::Redb(dir.join("ledger.redb")),
        central_signer(),
        OPERATOR_TOKEN.to_owned(),
    );
    config.workers = None;
    let service = Service::start(config, listener, Arc::new(ManualClock::new(now())))
        .await
        .expect("the central service starts");
    let operator = CentralClient::new(ClientConfig::new(format!(
        "http://{}",
        service.local_addr()
    )))
    .expect("client")
    .with_operator_token(OPERATOR_TOKEN);
    let mut policy = ledger::store::contract::sample_policy(1);
    policy.emergency_mode = EmergencyMode::Disabled;
    operator.publish_policy(&policy).await.expect("publish");
    operator.enroll_gateway(identity).await.expect("enrol");
    service
}

/// A configuration file naming `socket`, `data` and `central`, the agent's
/// identity key (created here) and the center's key; `extra` is appended.
fn write_config(dir: &Path, socket: &Path, data: &Path, central: &str, extra: &str) -> KeyId {
    let key = dir.join("agent.key");
    let identity = central_client::key_file::generate(&key).expect("an identity key");
    let quote = |path: &Path| serde_json::to_string(path.to_str().expect("UTF-8")).expect("str");
    std::fs::write(
        dir.join("agent.toml"),
        format!(
            "socket = {}\ndata = {}\ncentral = \"{central}\"\nidentity_key = {}\ntrusted_central_keys = [\"{}\"]\n{extra}",
            quote(socket),
            quote(data),
            quote(&key),
            central_signer().key_id()
        ),
    )
    .expect("write the configuration");
    identity
}

/// The notifications an agent sends, one datagram at a time.
struct Notifications {
    socket: UnixDatagram,
    seen: Vec<String>,
}

impl Notifications {
    fn bind(path: &Path) -> Self {
        Self {
            socket: UnixDatagram::bind(path).expect("bind the notification socket"),
            seen: Vec::new(),
        }
    }

    /// The next datagram containing `needle`.
    async fn wait_for(&mut self, needle: &str) -> String {
        let mut buffer = vec![0u8; 4096];
        loop {
            let received = tokio::time::timeout(EVENT_TIMEOUT, self.socket.recv(&mut buffer)).await;
            let Ok(Ok(length)) = received else {
                panic!("no notification with {needle:?}; seen: {:?}", self.seen);
            };
            let message = String::from_utf8_lossy(&buffer[..length]).into_owned();
            self.seen.push(message.clone());
            if message.contains(needle) {
                return message;
            }
        }
    }
}

/// The agent's command without anything systemd may have given this test;
/// its logs go to `log`.
fn agent_command(program: &str, log: &Path) -> Command {
    let mut command = Command::new(program);
    for name in [
        "NOTIFY_SOCKET",
        "WATCHDOG_USEC",
        "WATCHDOG_PID",
        "LISTEN_FDS",
        "LISTEN_PID",
        "LISTEN_FDNAMES",
        "RESERVOIR_AGENT_CONFIG",
        "RESERVOIR_AGENT_SOCKET",
        "RESERVOIR_AGENT_DATA",
        "RESERVOIR_AGENT_CENTRAL",
        "RESERVOIR_AGENT_IDENTITY_KEY",
        "RESERVOIR_AGENT_TRUSTED_CENTRAL_KEYS",
        "RESERVOIR_AGENT_RETENTION",
    ] {
        command.env_remove(name);
    }
    command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(log).expect("the agent's log"))
        .kill_on_drop(true);
    command
}

/// The first line on the child's stdout.
async fn first_line(child: &mut Child) -> String {
    let stdout = child.stdout.take().expect("piped stdout");
    let mut lines = BufReader::new(stdout).lines();
    tokio::time::timeout(EVENT_TIMEOUT, lines.next_line())
        .await
        .expect("a line in time")
        .expect("stdout readable")
        .expect("a line before EOF")
}

async fn terminate(child: &mut Child) -> ExitStatus {
    let pid = child
        .id()
        .and_then(|pid| i32::try_from(pid).ok())
        .and_then(rustix::process::Pid::from_raw)
        .expect("a running child");
    rustix::process::kill_process(pid, rustix::process::Signal::TERM).expect("SIGTERM");
    tokio::time::timeout(EVENT_TIMEOUT, child.wait())
        .await
        .expect("the agent stops in time")
        .expect("the agent's exit status")
}

async fn status_of(socket: &Path) -> String {
    let output = Command::new(BINARY)
        .args(["status", "--socket", socket.to_str().expect("UTF-8")])
        .output()
        .await
        .expect("run reservoir status");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ready_watchdog_and_stopping_and_flag_over_env_over_file() {
    let dir = temp_dir("agent-notify");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let central = format!("http://{}", listener.local_addr().expect("address"));
    let from_file = dir.join("from-file.sock");
    let from_env = dir.join("from-env.sock");
    let identity = write_config(&dir, &from_file, &dir.join("file-data"), &central, "");
    let service = start_central(&dir, listener, &identity).await;
    let mut notifications = Notifications::bind(&dir.join("notify.sock"));

    let mut agent = agent_command(BINARY, &dir.join("agent.log"))
        .args(["agent", "run", "--data"])
        .arg(dir.join("flag-data"))
        .env("RESERVOIR_AGENT_CONFIG", dir.join("agent.toml"))
        .env("RESERVOIR_AGENT_SOCKET", &from_env)
        .env("RESERVOIR_AGENT_DATA", dir.join("env-data"))
        .env("NOTIFY_SOCKET", dir.join("notify.sock"))
        .env("WATCHDOG_USEC", "400000")
        .spawn()
        .expect("spawn the agent");
    assert_eq!(
        first_line(&mut agent).await,
        format!("listening on {}", from_env.display())
    );
    let ready = notifications.wait_for("READY=1").await;
    assert!(ready.contains("STATUS=healthy: boot epoch "), "{ready:?}");
    // Pings at half the interval, each after a round trip through the core.
    notifications.wait_for("WATCHDOG=1").await;
    notifications.wait_for("WATCHDOG=1").await;
    assert!(
        status_of(&from_env)
            .await
            .contains("mode:               healthy"),
        "the socket of the environment serves"
    );
    assert!(!from_file.exists(), "the file's socket is overridden");
    assert!(dir.join("flag-data/journal.redb").exists(), "the flag wins");
    assert!(!dir.join("env-data").exists(), "over the environment");
    assert!(!dir.join("file-data").exists(), "and the file");

    let exit = terminate(&mut agent).await;
    let stopping = notifications.wait_for("STOPPING=1").await;
    assert!(stopping.contains("STATUS=draining"), "{stopping:?}");
    assert!(exit.success(), "{exit}");
    assert!(!from_env.exists(), "the agent removes the socket it bound");
    service.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retention_below_the_floor_refuses_to_start_naming_it() {
    let dir = temp_dir("agent-retention");
    let socket = dir.join("agent.sock");
    let data = dir.join("data");
    // Nothing listens there: the agent must stop before it calls.
    write_config(
        &dir,
        &socket,
        &data,
        "http://127.0.0.1:9",
        "retention = \"24h\"\n",
    );
    // The default timeouts: 30 s hold + 1 h deadline + 30 s margin = 1h 1m.
    let exit = tokio::time::timeout(
        EVENT_TIMEOUT,
        agent_command(BINARY, &dir.join("agent.log"))
            .args(["agent", "run", "--config"])
            .arg(dir.join("agent.toml"))
            .env("RESERVOIR_AGENT_RETENTION", "1h 59s 999ms")
            .status(),
    )
    .await
    .expect("the agent exits in time")
    .expect("run the agent");
    assert!(!exit.success(), "{exit}");
    let log = std::fs::read_to_string(dir.join("agent.log")).expect("the agent's log");
    for part in [
        "`retention` 1h 59s 999ms is too short",
        "shorter than 3660000 ms",
        "local_hold_ms + deadline_ms_max = 30000 + 3600000 ms",
    ] {
        assert!(log.contains(part), "{part:?} in {log}");
    }
    assert!(!socket.exists(), "no socket is bound");
    assert!(!data.exists(), "no data directory is created");
    let _ = std::fs::remove_dir_all(dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_center_is_ready_degraded_then_healthy() {
    let dir = temp_dir("agent-degraded");
    // Bound but not serving yet: connections wait unanswered.
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let central = format!("http://{}", listener.local_addr().expect("address"));
    let socket = dir.join("agent.sock");
    let identity = write_config(
        &dir,
        &socket,
        &dir.join("data"),
        &central,
        "[timeouts]\ncentral_call_ms = 200\nretry_interval_ms = 200\n",
    );
    let mut notifications = Notifications::bind(&dir.join("notify.sock"));
    let mut agent = agent_command(BINARY, &dir.join("agent.log"))
        .args(["agent", "run", "--config"])
        .arg(dir.join("agent.toml"))
        .env("NOTIFY_SOCKET", dir.join("notify.sock"))
        .spawn()
        .expect("spawn the agent");
    first_line(&mut agent).await;
    let ready = notifications.wait_for("READY=1").await;
    assert!(
        ready.contains("STATUS=degraded: central ledger unreachable"),
        "{ready:?}"
    );
    assert!(
        status_of(&socket)
            .await
            .contains("boot epoch:         not registered"),
        "ready, serving, and saying it has no boot yet"
    );

    let service = start_central(&dir, listener, &identity).await;
    let healthy = notifications.wait_for("STATUS=healthy").await;
    assert!(healthy.contains("boot epoch "), "{healthy:?}");
    assert!(!healthy.contains("READY=1"), "ready once only: {healthy:?}");

    let exit = terminate(&mut agent).await;
    notifications.wait_for("STOPPING=1").await;
    assert!(exit.success(), "{exit}");
    service.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}

/// systemd's socket activation of a stream socket, for machines without
/// `systemd-socket-activate`: bind and listen, move the socket to fd 3, set
/// `LISTEN_FDS`/`LISTEN_PID` and exec the rest of the arguments.
const ACTIVATE_PY: &str = r#"
import os, socket, sys
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(sys.argv[2])
listener.listen(128)
if listener.fileno() != 3:
    os.dup2(listener.fileno(), 3)
os.set_inheritable(3, True)
os.environ["LISTEN_FDS"] = "1"
os.environ["LISTEN_PID"] = str(os.getpid())
print("Listening on " + sys.argv[2] + " as 3.", file=sys.stderr, flush=True)
os.execv(sys.argv[3], sys.argv[3:])
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_socket_passed_by_systemd_is_served_and_left_in_place() {
    let activate = "/usr/bin/systemd-socket-activate";
    let dir = temp_dir("agent-activated");
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let central = format!("http://{}", listener.local_addr().expect("address"));
    let configured = dir.join("configured.sock");
    let passed = dir.join("passed.sock");
    let identity = write_config(&dir, &configured, &dir.join("data"), &central, "");
    let service = start_central(&dir, listener, &identity).await;

    // systemd-socket-activate listens, and execs the agent with the
    // listening socket as fd 3 (LISTEN_FDS=1).
    let mut command = if Path::new(activate).exists() {
        agent_command(activate, &dir.join("agent.log"))
    } else {
        let mut python = agent_command("python3", &dir.join("agent.log"));
        python.args(["-c", ACTIVATE_PY]);
        python
    };
    let mut agent = command
        .arg("--listen")
        .arg(&passed)
        .arg(BINARY)
        .args(["agent", "run", "--config"])
        .arg(dir.join("agent.toml"))
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn systemd-socket-activate");
    let stderr = agent.stderr.take().expect("piped stderr");
    let mut stderr = BufReader::new(stderr).lines();
    loop {
        let line = tokio::time::timeout(EVENT_TIMEOUT, stderr.next_line())
            .await
            .expect("systemd-socket-activate says it listens")
            .expect("stderr readable")
            .expect("a line before EOF");
        if line.contains("Listening on") {
            break;
        }
    }
    // Keep draining the agent's logs so that it never blocks on them.
    tokio::spawn(async move { while let Ok(Some(_)) = stderr.next_line().await {} });

    assert!(
        status_of(&passed)
            .await
            .contains("mode:               healthy"),
        "the passed socket serves"
    );
    assert_eq!(
        first_line(&mut agent).await,
        format!("listening on {} (passed by systemd)", passed.display())
    );
    assert!(!configured.exists(), "the configured socket is not bound");
    let exit = terminate(&mut agent).await;
    assert!(exit.success(), "{exit}");
    assert!(passed.exists(), "systemd's socket is left to systemd");
    service.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}
