//! Real Reservoir processes on a temporary directory: one central service
//! and any number of agents, spawned from a `reservoir` binary (the demo
//! passes [`std::env::current_exe`], tests `env!("CARGO_BIN_EXE_reservoir")`).
//! `reservoir demo`, the benchmark and the process tests drive them.
//!
//! ```no_run
//! # async fn example() -> Result<(), reservoir::cluster::ClusterError> {
//! use reservoir::cluster::{Cluster, ClusterOptions};
//!
//! let mut cluster = Cluster::start(ClusterOptions::new("target/debug/reservoir", 2)).await?;
//! cluster.central().publish(&reservoir::cluster::policy("tenant-7", "chat.generate", 1)).await?;
//! let answer = cluster.agent(0).client().reserve("req-1", "tenant-7", "chat.generate", 600).await?;
//! assert_eq!(answer.status, 201);
//! cluster.agent_mut(0).kill().await?; // kill -9
//! cluster.agent_mut(0).start().await?; // the same key, data directory and socket
//! # Ok(()) }
//! ```
//!
//! # The directory
//!
//! ```text
//! central/           the service's data: central.key, ledger.redb, operator.token
//! central.log        its stderr (every start appends)
//! agent-a/           agent.key, agent.toml, agent.sock, agent.log, data/journal.redb
//! agent-b/           …
//! ```
//!
//! # Promises
//!
//! - Every wait is bounded ([`START_TIMEOUT`], [`STOP_TIMEOUT`],
//!   [`CALL_TIMEOUT`]); a process that dies or does not come up is an error
//!   naming it, with the tail of its log.
//! - Dropping a [`Cluster`] kills (SIGKILL) and reaps every child it
//!   started, then removes the directory unless [`Cluster::keep`] was
//!   called: no orphans even when a test panics.
//! - Processes are started, stopped and killed only through their own
//!   handles, by their own process IDs.

use ledger::protocol::ErrorCode;
use std::ffi::OsString;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use central_client::wire::{AccountsResponse, AuditResponse};
use central_client::{CallError, CentralClient, ClientConfig, RetryPolicy};
use http_body_util::{BodyExt as _, Full};
use hyper::body::Bytes;
use hyper::header::{CONTENT_TYPE, HOST, RETRY_AFTER};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use shard_format::{
    AdmissionBudgetV1, Ed25519Signer, EmergencyMode, IdempotencyKey, KeyId, Refill, Route, Subject,
};
use tokio::io::{AsyncBufReadExt as _, BufReader};
use tokio::process::{Child, Command};

/// Longest wait for a process to print `listening on …`, and for a
/// one-shot command (`keygen`) to finish.
pub const START_TIMEOUT: Duration = Duration::from_secs(30);
/// Longest wait for a process to exit after SIGTERM or SIGKILL.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(20);
/// Longest wait for one answer over an agent's socket.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);
/// How often [`wait_until`] asks again.
pub const POLL_INTERVAL: Duration = Duration::from_millis(20);
/// Lines of a process's log quoted in an error.
const LOG_TAIL_LINES: usize = 25;

/// Why the cluster could not do what was asked.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The binary could not be executed.
    #[error("cannot start {process} from {binary}: {source}")]
    Spawn {
        process: String,
        binary: PathBuf,
        source: io::Error,
    },
    /// A process exited, printed something unexpected, or did not come up
    /// or stop in time.
    #[error("{process} {what}; the last lines of {log}:\n{tail}", log = log.display())]
    Process {
        process: String,
        what: String,
        log: PathBuf,
        tail: String,
    },
    /// A one-shot command (`reservoir keygen`) failed.
    #[error("`{command}` failed ({outcome}): {stderr}")]
    Command {
        command: String,
        outcome: String,
        stderr: String,
    },
    /// A file of the cluster could not be read or written.
    #[error("{what}: {source}")]
    Io { what: String, source: io::Error },
    /// The central service refused or did not answer a call.
    #[error("central service: {call}: {source}")]
    Central { call: String, source: CallError },
    /// An agent gave no answer over its socket (it is down, or too slow).
    #[error("{agent}: {request}: no answer: {message}")]
    Socket {
        agent: String,
        request: String,
        message: String,
    },
    /// A condition did not come true within its deadline.
    #[error("{what}: not within {waited:?}")]
    Timeout { what: String, waited: Duration },
    /// The cluster was asked something that makes no sense in its state
    /// (start a running process, a path that is not UTF-8).
    #[error("{0}")]
    Usage(String),
}

fn io_error(what: impl Into<String>) -> impl FnOnce(io::Error) -> ClusterError {
    let what = what.into();
    move |source| ClusterError::Io { what, source }
}

/// The last lines of a log file, for error messages.
pub fn log_tail(log: &Path) -> String {
    match std::fs::read(log) {
        Ok(bytes) => {
            let text = String::from_utf8_lossy(&bytes);
            let lines: Vec<&str> = text.lines().collect();
            let start = lines.len().saturating_sub(LOG_TAIL_LINES);
            if lines.is_empty() {
                "(empty)".to_owned()
            } else {
                lines[start..].join("\n")
            }
        }
        Err(error) => format!("(cannot read it: {error})"),
    }
}

/// Polls `probe` every [`POLL_INTERVAL`] until it returns `Some`, for at
/// most `deadline`. An error from `probe` ends the wait at once.
pub async fn wait_until<T, F, Fut>(
    what: &str,
    deadline: Duration,
    mut probe: F,
) -> Result<T, ClusterError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<Option<T>, ClusterError>>,
{
    let started = Instant::now();
    loop {
        if let Some(value) = probe().await? {
            return Ok(value);
        }
        if started.elapsed() >= deadline {
            return Err(ClusterError::Timeout {
                what: what.to_owned(),
                waited: deadline,
            });
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// A policy for `(subject, route)` shaped like that of docs/design.md §4.7:
/// opening and burst 1000, refill 100 every second, hold TTL 30 s, overdraft
/// up to 200, emergency shards off. Callers adjust the fields they care about.
/// The accounting epoch is as long as the format allows, so no epoch
/// boundary falls inside a run.
pub fn policy(subject: &str, route: &str, generation: u64) -> AdmissionBudgetV1 {
    let mut policy = ledger::store::contract::sample_policy(generation);
    policy.subject = Subject::new(subject).unwrap_or(policy.subject);
    policy.route = Route::new(route).unwrap_or(policy.route);
    policy.refill = Refill {
        units: 100,
        interval_ms: 1000,
    };
    policy.accounting_epoch_ms = shard_format::limits::DURATION_MS_MAX;
    policy.emergency_mode = EmergencyMode::Disabled;
    policy.emergency_shard_units = 0;
    policy
}

/// The reserve request `agent` (a client with an identity key) sends for
/// idempotency key `key` on the pair: the ID its identity derives and the
/// request digest of `units` alone, as an agent computes both.
pub fn signed_reserve_request(
    agent: &CentralClient,
    subject: &str,
    route: &str,
    key: &str,
    units: u64,
) -> Result<ledger::ReserveRequest, ClusterError> {
    let usage = |error: shard_format::ValueError| ClusterError::Usage(error.to_string());
    let owner = agent.identity().ok_or_else(|| {
        ClusterError::Usage("a reserve needs a client with an identity key".into())
    })?;
    let subject = Subject::new(subject).map_err(usage)?;
    let route = Route::new(route).map_err(usage)?;
    let digest = shard_format::request_digest(&subject, &route, units, None);
    Ok(ledger::ReserveRequest::new(
        owner.clone(),
        IdempotencyKey::new(key).map_err(usage)?,
        subject,
        route,
        units,
        digest,
    ))
}

/// One running child: its stderr goes to `log`, its stdout is read for the
/// `listening on ADDR` line. Dropping it kills and reaps the child.
#[derive(Debug)]
struct Process {
    name: String,
    log: PathBuf,
    child: Option<Child>,
}

impl Process {
    /// Spawns `command` and waits (at most [`START_TIMEOUT`]) for its first
    /// stdout line, `listening on ADDR`; returns the process and ADDR.
    async fn spawn(
        name: &str,
        binary: &Path,
        mut command: Command,
        log: &Path,
    ) -> Result<(Self, String), ClusterError> {
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .map_err(io_error(format!("cannot open {}", log.display())))?;
        command
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::from(log_file))
            .kill_on_drop(true);
        let mut child = command.spawn().map_err(|source| ClusterError::Spawn {
            process: name.to_owned(),
            binary: binary.to_owned(),
            source,
        })?;
        let stdout = child.stdout.take();
        let mut process = Self {
            name: name.to_owned(),
            log: log.to_owned(),
            child: Some(child),
        };
        let Some(stdout) = stdout else {
            return Err(process.failure("has no stdout to read".to_owned()));
        };
        let mut lines = BufReader::new(stdout).lines();
        let line = match tokio::time::timeout(START_TIMEOUT, lines.next_line()).await {
            Ok(Ok(Some(line))) => line,
            Ok(Ok(None)) | Ok(Err(_)) => {
                let outcome = process.reap().await;
                return Err(process.failure(format!("exited before listening ({outcome})")));
            }
            Err(_) => {
                return Err(process.failure(format!(
                    "did not print `listening on …` within {START_TIMEOUT:?}"
                )));
            }
        };
        let Some(address) = line.strip_prefix("listening on ") else {
            return Err(process.failure(format!(
                "printed {line:?} where `listening on ADDR` was expected"
            )));
        };
        let address = address.trim().to_owned();
        // Whatever else it prints is read and dropped, so it never blocks
        // on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        Ok((process, address))
    }

    /// An error about this process, quoting its log.
    fn failure(&self, what: String) -> ClusterError {
        ClusterError::Process {
            process: self.name.clone(),
            what,
            log: self.log.clone(),
            tail: log_tail(&self.log),
        }
    }

    /// Waits (bounded) for the exit of a child that is exiting anyway, and
    /// describes it.
    async fn reap(&mut self) -> String {
        let Some(child) = self.child.as_mut() else {
            return "not running".to_owned();
        };
        match tokio::time::timeout(STOP_TIMEOUT, child.wait()).await {
            Ok(Ok(status)) => {
                self.child = None;
                status.to_string()
            }
            Ok(Err(error)) => format!("cannot wait for it: {error}"),
            Err(_) => "still running".to_owned(),
        }
    }

    /// The exit status if the child has exited (it is reaped then).
    fn exited(&mut self) -> Option<ExitStatus> {
        let status = self.child.as_mut()?.try_wait().ok().flatten();
        if status.is_some() {
            self.child = None;
        }
        status
    }

    /// Whether the child runs (an exited one is reaped).
    fn is_running(&mut self) -> bool {
        self.child.is_some() && self.exited().is_none()
    }

    /// An error if the child has exited.
    fn check_alive(&mut self) -> Result<(), ClusterError> {
        match self.exited() {
            Some(status) => Err(self.failure(format!("exited unexpectedly ({status})"))),
            None if self.child.is_none() => Err(self.failure("is not running".to_owned())),
            None => Ok(()),
        }
    }

    /// SIGTERM, then waits (at most [`STOP_TIMEOUT`]) for the exit. A
    /// process that does not stop in time is killed, and that is an error.
    async fn terminate(&mut self) -> Result<ExitStatus, ClusterError> {
        let Some(child) = self.child.as_mut() else {
            return Err(self.failure("cannot be stopped: it is not running".to_owned()));
        };
        if let Some(pid) = child
            .id()
            .and_then(|pid| i32::try_from(pid).ok())
            .and_then(rustix::process::Pid::from_raw)
        {
            // It may have exited on its own already: the wait below tells.
            let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        }
        match tokio::time::timeout(STOP_TIMEOUT, child.wait()).await {
            Ok(Ok(status)) => {
                self.child = None;
                Ok(status)
            }
            Ok(Err(error)) => Err(self.failure(format!("cannot be waited for: {error}"))),
            Err(_) => {
                let _ = child.start_kill();
                let _ = self.reap().await;
                Err(self.failure(format!(
                    "did not exit within {STOP_TIMEOUT:?} of SIGTERM (killed)"
                )))
            }
        }
    }

    /// SIGKILL (`kill -9`), then waits for the exit.
    async fn kill(&mut self) -> Result<(), ClusterError> {
        let Some(child) = self.child.as_mut() else {
            return Err(self.failure("cannot be killed: it is not running".to_owned()));
        };
        // An error means it exited already; the wait below reaps it.
        let _ = child.start_kill();
        match tokio::time::timeout(STOP_TIMEOUT, child.wait()).await {
            Ok(Ok(_)) => {
                self.child = None;
                Ok(())
            }
            Ok(Err(error)) => Err(self.failure(format!("cannot be waited for: {error}"))),
            Err(_) => Err(self.failure(format!("survived SIGKILL for {STOP_TIMEOUT:?}"))),
        }
    }

    fn pid(&self) -> Option<u32> {
        self.child.as_ref().and_then(Child::id)
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let _ = child.start_kill();
        // Reap it before the directory goes (bounded: SIGKILL is prompt).
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            match child.try_wait() {
                Ok(None) => std::thread::sleep(Duration::from_millis(5)),
                Ok(Some(_)) | Err(_) => break,
            }
        }
    }
}

/// Runs a one-shot `reservoir keygen …` and returns the key ID it prints.
async fn keygen(binary: &Path, args: &[OsString]) -> Result<KeyId, ClusterError> {
    let described = format!(
        "reservoir {}",
        args.iter()
            .map(|arg| arg.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ")
    );
    let mut command = Command::new(binary);
    command.args(args).stdin(Stdio::null()).kill_on_drop(true);
    let output = tokio::time::timeout(START_TIMEOUT, command.output())
        .await
        .map_err(|_| ClusterError::Command {
            command: described.clone(),
            outcome: format!("no exit within {START_TIMEOUT:?}"),
            stderr: String::new(),
        })?
        .map_err(|source| ClusterError::Spawn {
            process: described.clone(),
            binary: binary.to_owned(),
            source,
        })?;
    let stdout = String::from_utf8_lossy(&output.stdout);
    let key: Option<KeyId> = stdout
        .lines()
        .next()
        .and_then(|line| line.trim().parse().ok());
    match key {
        Some(key) if output.status.success() => Ok(key),
        _ => Err(ClusterError::Command {
            command: described,
            outcome: output.status.to_string(),
            stderr: format!(
                "{}{}",
                stdout,
                String::from_utf8_lossy(&output.stderr).trim()
            ),
        }),
    }
}

fn utf8(path: &Path) -> Result<&str, ClusterError> {
    path.to_str().ok_or_else(|| {
        ClusterError::Usage(format!(
            "{} is not UTF-8; set TMPDIR to a UTF-8 path",
            path.display()
        ))
    })
}

/// The files of a generated certificate authority and the central
/// service's certificate ([`generate_tls`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The CA certificate (PEM): agents' and operator tools' trust root.
    pub ca: PathBuf,
    /// The server certificate chain (PEM): `central serve --tls-cert`.
    pub cert: PathBuf,
    /// The server key (PEM, mode 0600): `central serve --tls-key`.
    pub key: PathBuf,
}

/// Generates a CA and a server certificate it signs for `127.0.0.1`,
/// `::1` and `localhost` into `dir` (`ca.pem`, `central.pem`,
/// `central-key.pem`): what the process tests and the demo serve HTTPS
/// with. Never for production: the CA's key is thrown away.
pub fn generate_tls(dir: &Path) -> Result<TlsFiles, ClusterError> {
    use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
    let failed =
        |error: rcgen::Error| ClusterError::Usage(format!("cannot generate TLS files: {error}"));
    std::fs::create_dir_all(dir).map_err(io_error(format!("cannot create {}", dir.display())))?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).map_err(failed)?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params
        .distinguished_name
        .push(DnType::CommonName, "Reservoir test CA");
    let ca_key = KeyPair::generate().map_err(failed)?;
    let ca = ca_params.self_signed(&ca_key).map_err(failed)?;
    let issuer = Issuer::new(ca_params, ca_key);
    let mut server_params = CertificateParams::new(vec![
        "localhost".to_owned(),
        "127.0.0.1".to_owned(),
        "::1".to_owned(),
    ])
    .map_err(failed)?;
    server_params
        .distinguished_name
        .push(DnType::CommonName, "reservoir central");
    let server_key = KeyPair::generate().map_err(failed)?;
    let server = server_params
        .signed_by(&server_key, &issuer)
        .map_err(failed)?;
    let files = TlsFiles {
        ca: dir.join("ca.pem"),
        cert: dir.join("central.pem"),
        key: dir.join("central-key.pem"),
    };
    let write = |path: &Path, text: String| {
        std::fs::write(path, text).map_err(io_error(format!("cannot write {}", path.display())))
    };
    write(&files.ca, ca.pem())?;
    write(&files.cert, server.pem())?;
    central_client::key_file::write_secret_file(&files.key, server_key.serialize_pem().as_bytes())
        .map_err(|error| ClusterError::Usage(error.to_string()))?;
    Ok(files)
}

/// A central service process (`reservoir central serve`) on its own data
/// directory. After the first start it keeps its address, so agents find
/// it again after [`Central::start`].
///
/// A [`Cluster`] starts one; [`Central::create`] starts more of them, e.g.
/// replicas over one PostgreSQL database.
#[derive(Debug)]
pub struct Central {
    binary: PathBuf,
    data: PathBuf,
    log: PathBuf,
    /// `--postgres URL`, if its records are kept there.
    postgres: Option<String>,
    /// More `central serve` arguments, passed at every start.
    serve_args: Vec<String>,
    /// Its certificate and CA, if it serves HTTPS.
    tls: Option<TlsFiles>,
    address: SocketAddr,
    key_id: KeyId,
    token: String,
    process: Option<Process>,
}

impl Central {
    /// Creates a service's signing key in `dir/NAME` (its data directory;
    /// its log is `dir/NAME.log`) and starts it on a free loopback port.
    /// Its records go to `dir/NAME/ledger.redb`, or with `postgres` to that
    /// PostgreSQL database (`--postgres URL`; replicas may share one). The
    /// process dies when the value is dropped; the caller owns `dir`.
    pub async fn create(
        binary: &Path,
        dir: &Path,
        name: &str,
        postgres: Option<&str>,
    ) -> Result<Self, ClusterError> {
        Self::create_with_args(binary, dir, name, postgres, &[]).await
    }

    /// [`Central::create`], with more `central serve` arguments (e.g.
    /// `--retention 32s`), passed again at every [`Central::start`]. It
    /// serves HTTPS with a certificate from [`generate_tls`] (in
    /// `dir/NAME-tls/`).
    pub async fn create_with_args(
        binary: &Path,
        dir: &Path,
        name: &str,
        postgres: Option<&str>,
        serve_args: &[String],
    ) -> Result<Self, ClusterError> {
        let tls = generate_tls(&dir.join(format!("{name}-tls")))?;
        Self::create_with(binary, dir, name, postgres, serve_args, Some(tls)).await
    }

    /// [`Central::create_with_args`] with the TLS files given: `None`
    /// serves plain HTTP (on loopback).
    pub async fn create_with(
        binary: &Path,
        dir: &Path,
        name: &str,
        postgres: Option<&str>,
        serve_args: &[String],
        tls: Option<TlsFiles>,
    ) -> Result<Self, ClusterError> {
        let mut serve_args = serve_args.to_vec();
        if let Some(tls) = &tls {
            serve_args.extend([
                "--tls-cert".to_owned(),
                utf8(&tls.cert)?.to_owned(),
                "--tls-key".to_owned(),
                utf8(&tls.key)?.to_owned(),
            ]);
        }
        let serve_args = serve_args.as_slice();
        let data = dir.join(name);
        let key_id = keygen(
            binary,
            &["keygen".into(), "--data".into(), data.clone().into()],
        )
        .await?;
        let log = dir.join(format!("{name}.log"));
        let (process, address) =
            Self::spawn(binary, &data, &log, "127.0.0.1:0", postgres, serve_args).await?;
        let address: SocketAddr = address.parse().map_err(|_| {
            process.failure(format!("printed the address {address:?}, which is not one"))
        })?;
        let token_path = data.join("operator.token");
        let token = central_client::key_file::read_secret_file(&token_path)
            .map_err(|error| process.failure(format!("left no operator token: {error}")))?
            .trim()
            .to_owned();
        Ok(Self {
            binary: binary.to_owned(),
            data,
            log,
            postgres: postgres.map(str::to_owned),
            serve_args: serve_args.to_vec(),
            tls,
            address,
            key_id,
            token,
            process: Some(process),
        })
    }

    async fn spawn(
        binary: &Path,
        data: &Path,
        log: &Path,
        listen: &str,
        postgres: Option<&str>,
        serve_args: &[String],
    ) -> Result<(Process, String), ClusterError> {
        let mut command = Command::new(binary);
        command
            .args(["central", "serve", "--listen", listen, "--data"])
            .arg(data);
        if let Some(url) = postgres {
            command.args(["--postgres", url]);
        }
        command.args(serve_args);
        command
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            // An error ends in its cause, not in a backtrace (panics keep theirs).
            .env("RUST_LIB_BACKTRACE", "0");
        Process::spawn("the central service", binary, command, log).await
    }

    /// Starts the service again on the same data directory and address.
    pub async fn start(&mut self) -> Result<(), ClusterError> {
        if self.is_running() {
            return Err(ClusterError::Usage(
                "the central service is running already".to_owned(),
            ));
        }
        let (process, address) = Self::spawn(
            &self.binary,
            &self.data,
            &self.log,
            &self.address.to_string(),
            self.postgres.as_deref(),
            &self.serve_args,
        )
        .await?;
        if address != self.address.to_string() {
            return Err(process.failure(format!(
                "listens on {address}, not on its old address {}",
                self.address
            )));
        }
        self.process = Some(process);
        Ok(())
    }

    /// SIGTERM and a graceful exit (bounded); its exit status.
    pub async fn stop(&mut self) -> Result<ExitStatus, ClusterError> {
        self.running()?.terminate().await
    }

    /// `kill -9`.
    pub async fn kill(&mut self) -> Result<(), ClusterError> {
        self.running()?.kill().await
    }

    fn running(&mut self) -> Result<&mut Process, ClusterError> {
        self.process
            .as_mut()
            .ok_or_else(|| ClusterError::Usage("the central service is not running".to_owned()))
    }

    /// An error (with the log's tail) if the process has died.
    pub fn check_alive(&mut self) -> Result<(), ClusterError> {
        self.running()?.check_alive()
    }

    /// Whether the process runs.
    pub fn is_running(&mut self) -> bool {
        self.process.as_mut().is_some_and(Process::is_running)
    }

    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().and_then(Process::pid)
    }

    /// `https://127.0.0.1:PORT` (`http://` without TLS).
    pub fn url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://{}", self.address)
    }

    /// The CA file its certificate chains to, if it serves HTTPS.
    pub fn ca_file(&self) -> Option<&Path> {
        self.tls.as_ref().map(|tls| tls.ca.as_path())
    }

    pub fn address(&self) -> SocketAddr {
        self.address
    }

    /// The shard-signing key's ID: agents trust it.
    pub fn key_id(&self) -> &KeyId {
        &self.key_id
    }

    pub fn data_dir(&self) -> &Path {
        &self.data
    }

    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// The operator token file (`reservoir audit --operator-token-file`).
    pub fn token_path(&self) -> PathBuf {
        self.data.join("operator.token")
    }

    fn client_config(&self) -> ClientConfig {
        let mut config = ClientConfig::new(self.url());
        config.ca_file = self.ca_file().map(Path::to_owned);
        config.call_timeout = Duration::from_secs(10);
        config.retry = RetryPolicy {
            attempts_max: 5,
            backoff_initial: Duration::from_millis(20),
            backoff_max: Duration::from_millis(500),
            deadline: Duration::from_secs(10),
        };
        config
    }

    /// A client making operator calls.
    pub fn operator(&self) -> Result<CentralClient, ClusterError> {
        Ok(CentralClient::new(self.client_config())
            .map_err(|error| ClusterError::Usage(error.to_string()))?
            .with_operator_token(self.token.clone()))
    }

    /// A client making agent calls signed with `agent`'s identity key (to
    /// read reservations at the center, or replay a receipt).
    pub fn as_agent(&self, agent: &Agent) -> Result<CentralClient, ClusterError> {
        let signer = central_client::key_file::load(&agent.key_path())
            .map_err(|error| ClusterError::Usage(error.to_string()))?;
        self.as_identity(signer)
    }

    /// A client making agent calls signed with `signer` (an identity the
    /// service must have enrolled), without an agent process: a test
    /// playing the agent's part.
    pub fn as_identity(&self, signer: Ed25519Signer) -> Result<CentralClient, ClusterError> {
        Ok(CentralClient::new(self.client_config())
            .map_err(|error| ClusterError::Usage(error.to_string()))?
            .with_identity(signer))
    }

    /// `PUT /v1/policies`.
    pub async fn publish(&self, policy: &AdmissionBudgetV1) -> Result<(), ClusterError> {
        self.operator()?
            .publish_policy(policy)
            .await
            .map(|_| ())
            .map_err(|source| ClusterError::Central {
                call: format!(
                    "publish {}/{} generation {}",
                    policy.subject, policy.route, policy.policy_generation
                ),
                source,
            })
    }

    /// `PUT /v1/gateways/{identity}`.
    pub async fn enroll(&self, identity: &KeyId) -> Result<(), ClusterError> {
        self.operator()?
            .enroll_gateway(identity)
            .await
            .map(|_| ())
            .map_err(|source| ClusterError::Central {
                call: format!("enroll {identity}"),
                source,
            })
    }

    /// `GET /v1/audit` (drift is an answer: `ok: false`).
    pub async fn audit(&self) -> Result<AuditResponse, ClusterError> {
        self.operator()?
            .audit()
            .await
            .map_err(|source| ClusterError::Central {
                call: "audit".to_owned(),
                source,
            })
    }

    /// `GET /v1/accounts/{subject}/{route}`.
    pub async fn accounts(
        &self,
        subject: &str,
        route: &str,
    ) -> Result<AccountsResponse, ClusterError> {
        let subject = Subject::new(subject).map_err(|e| ClusterError::Usage(e.to_string()))?;
        let route = Route::new(route).map_err(|e| ClusterError::Usage(e.to_string()))?;
        self.operator()?
            .accounts(&subject, &route)
            .await
            .map_err(|source| ClusterError::Central {
                call: format!("accounts of {subject}/{route}"),
                source,
            })
    }
}

/// How an agent is configured (its `[timeouts]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AgentOptions {
    /// Deadline of one central call.
    pub central_call_ms: u64,
    /// Retry and probe interval; a refused shard request waits 60 of them.
    pub retry_interval_ms: u64,
}

impl Default for AgentOptions {
    /// Quick enough for tests and the demo: 1 s calls, 100 ms retries.
    fn default() -> Self {
        Self {
            central_call_ms: 1000,
            retry_interval_ms: 100,
        }
    }
}

/// An agent process (`reservoir agent run`) with its own identity key,
/// data directory and socket, all under `dir/NAME/`.
#[derive(Debug)]
pub struct Agent {
    name: String,
    binary: PathBuf,
    dir: PathBuf,
    identity: KeyId,
    process: Option<Process>,
}

impl Agent {
    /// Creates the key and the configuration; does not start the process.
    async fn create(
        binary: &Path,
        dir: &Path,
        name: &str,
        central: &Central,
        options: AgentOptions,
    ) -> Result<Self, ClusterError> {
        let dir = dir.join(name);
        std::fs::create_dir_all(dir.join("data"))
            .map_err(io_error(format!("cannot create {}", dir.display())))?;
        let key = dir.join("agent.key");
        let identity = keygen(binary, &["keygen".into(), "--out".into(), key.into()]).await?;
        let agent = Self {
            name: name.to_owned(),
            binary: binary.to_owned(),
            dir,
            identity,
            process: None,
        };
        let mut timeouts = toml::Table::new();
        let integer = |value: u64| toml::Value::Integer(i64::try_from(value).unwrap_or(i64::MAX));
        timeouts.insert("central_call_ms".into(), integer(options.central_call_ms));
        timeouts.insert(
            "retry_interval_ms".into(),
            integer(options.retry_interval_ms),
        );
        let mut config = toml::Table::new();
        let path = |path: PathBuf| -> Result<toml::Value, ClusterError> {
            Ok(toml::Value::String(utf8(&path)?.to_owned()))
        };
        config.insert("socket".into(), path(agent.socket_path())?);
        config.insert("data".into(), path(agent.data_dir())?);
        config.insert("central".into(), toml::Value::String(central.url()));
        if let Some(ca) = central.ca_file() {
            config.insert("central_ca_file".into(), path(ca.to_owned())?);
        }
        config.insert("identity_key".into(), path(agent.key_path())?);
        config.insert(
            "trusted_central_keys".into(),
            toml::Value::Array(vec![toml::Value::String(central.key_id().to_string())]),
        );
        config.insert("timeouts".into(), toml::Value::Table(timeouts));
        let text = toml::to_string(&config)
            .map_err(|error| ClusterError::Usage(format!("agent configuration: {error}")))?;
        std::fs::write(agent.config_path(), text).map_err(io_error(format!(
            "cannot write {}",
            agent.config_path().display()
        )))?;
        Ok(agent)
    }

    /// Starts the process (again: the same key, data directory and
    /// socket) and waits for `listening on`. Registration with the central
    /// service follows on its own; see [`Agent::wait_for_boot`].
    pub async fn start(&mut self) -> Result<(), ClusterError> {
        if self.is_running() {
            return Err(ClusterError::Usage(format!(
                "{} is running already",
                self.name
            )));
        }
        let mut command = Command::new(&self.binary);
        command
            .args(["agent", "run", "--config"])
            .arg(self.config_path())
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            // An error ends in its cause, not in a backtrace (panics keep theirs).
            .env("RUST_LIB_BACKTRACE", "0");
        let (process, _) =
            Process::spawn(&self.name, &self.binary, command, &self.log_path()).await?;
        self.process = Some(process);
        Ok(())
    }

    /// SIGTERM and a graceful exit (bounded); its exit status.
    pub async fn stop(&mut self) -> Result<ExitStatus, ClusterError> {
        self.running()?.terminate().await
    }

    /// `kill -9`.
    pub async fn kill(&mut self) -> Result<(), ClusterError> {
        self.running()?.kill().await
    }

    fn running(&mut self) -> Result<&mut Process, ClusterError> {
        let name = &self.name;
        self.process
            .as_mut()
            .ok_or_else(|| ClusterError::Usage(format!("{name} is not running")))
    }

    /// An error (with the log's tail) if the process has died.
    pub fn check_alive(&mut self) -> Result<(), ClusterError> {
        self.running()?.check_alive()
    }

    /// Whether the process runs.
    pub fn is_running(&mut self) -> bool {
        self.process.as_mut().is_some_and(Process::is_running)
    }

    /// `GET /v1/status` as JSON.
    pub async fn status(&self) -> Result<Value, ClusterError> {
        self.client().status().await
    }

    /// Waits until the agent has registered a boot epoch above `above` and
    /// returns it. An agent that dies meanwhile is an error quoting its log.
    pub async fn wait_for_boot(&mut self, above: u64) -> Result<u64, ClusterError> {
        let client = self.client();
        let what = format!("{} registers a boot epoch above {above}", self.name);
        let started = Instant::now();
        loop {
            self.check_alive()?;
            if let Ok(status) = client.status().await
                && let Some(epoch) = status["bootEpoch"].as_u64()
                && epoch > above
            {
                return Ok(epoch);
            }
            if started.elapsed() >= START_TIMEOUT {
                let error = self.running()?.failure(format!("did not: {what}"));
                return Err(error);
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }

    /// A client for this agent's socket.
    pub fn client(&self) -> AgentClient {
        AgentClient::new(&self.name, self.socket_path())
    }

    pub fn pid(&self) -> Option<u32> {
        self.process.as_ref().and_then(Process::pid)
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its gateway identity (`ed25519:…`).
    pub fn identity(&self) -> &KeyId {
        &self.identity
    }

    pub fn key_path(&self) -> PathBuf {
        self.dir.join("agent.key")
    }

    /// The directory holding `journal.redb`.
    pub fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    pub fn socket_path(&self) -> PathBuf {
        self.dir.join("agent.sock")
    }

    /// Its stderr (every start appends).
    pub fn log_path(&self) -> PathBuf {
        self.dir.join("agent.log")
    }

    pub fn config_path(&self) -> PathBuf {
        self.dir.join("agent.toml")
    }
}

/// What to start.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// The `reservoir` binary.
    pub binary: PathBuf,
    /// How many agents (named `agent-a`, `agent-b`, …).
    pub agents: usize,
    pub agent: AgentOptions,
    /// More `central serve` arguments (e.g. `--retention 32s`).
    pub central_args: Vec<String>,
    /// Serve plain HTTP on loopback instead of HTTPS with a generated CA.
    pub plain_http: bool,
}

impl ClusterOptions {
    pub fn new(binary: impl Into<PathBuf>, agents: usize) -> Self {
        Self {
            binary: binary.into(),
            agents,
            agent: AgentOptions::default(),
            central_args: Vec::new(),
            plain_http: false,
        }
    }
}

/// `agent-a` … `agent-z`, then `agent-27` ….
fn agent_name(index: usize) -> String {
    match u8::try_from(index) {
        Ok(letter @ 0..=25) => format!("agent-{}", char::from(b'a' + letter)),
        _ => format!("agent-{}", index + 1),
    }
}

/// A central service and its agents on one temporary directory.
#[derive(Debug)]
pub struct Cluster {
    // Field order is drop order: the processes die before the directory goes.
    agents: Vec<Agent>,
    central: Central,
    binary: PathBuf,
    agent_options: AgentOptions,
    path: PathBuf,
    dir: Option<tempfile::TempDir>,
}

impl Cluster {
    /// Creates the directory, starts the central service, then creates,
    /// enrols and starts every agent and waits until each has registered
    /// its first boot. No policy is published yet.
    pub async fn start(options: ClusterOptions) -> Result<Self, ClusterError> {
        let dir = tempfile::Builder::new()
            .prefix("reservoir-cluster-")
            .tempdir()
            .map_err(io_error("cannot create a temporary directory"))?;
        let path = dir.path().to_owned();
        let tls = if options.plain_http {
            None
        } else {
            Some(generate_tls(&path.join("central-tls"))?)
        };
        let central = Central::create_with(
            &options.binary,
            &path,
            "central",
            None,
            &options.central_args,
            tls,
        )
        .await?;
        let mut cluster = Self {
            agents: Vec::new(),
            central,
            binary: options.binary,
            agent_options: options.agent,
            path,
            dir: Some(dir),
        };
        for _ in 0..options.agents {
            cluster.add_agent().await?;
        }
        for agent in &mut cluster.agents {
            agent.wait_for_boot(0).await?;
        }
        Ok(cluster)
    }

    /// Creates, enrols and starts one more agent (with the cluster's
    /// options) and returns its index. It registers its boot on its own.
    pub async fn add_agent(&mut self) -> Result<usize, ClusterError> {
        let index = self.agents.len();
        let mut agent = Agent::create(
            &self.binary,
            &self.path,
            &agent_name(index),
            &self.central,
            self.agent_options,
        )
        .await?;
        self.central.enroll(agent.identity()).await?;
        agent.start().await?;
        self.agents.push(agent);
        Ok(index)
    }

    /// The directory everything lives in.
    pub fn dir(&self) -> &Path {
        &self.path
    }

    /// Keeps the directory after the cluster is dropped (the processes
    /// still die) and returns its path.
    pub fn keep(&mut self) -> PathBuf {
        if let Some(dir) = self.dir.take() {
            let _ = dir.keep();
        }
        self.path.clone()
    }

    pub fn central(&self) -> &Central {
        &self.central
    }

    pub fn central_mut(&mut self) -> &mut Central {
        &mut self.central
    }

    /// The agent at `index`; panics if there is none (a caller's bug).
    pub fn agent(&self, index: usize) -> &Agent {
        &self.agents[index]
    }

    pub fn agent_mut(&mut self, index: usize) -> &mut Agent {
        &mut self.agents[index]
    }

    pub fn agents(&self) -> &[Agent] {
        &self.agents
    }

    pub fn agents_mut(&mut self) -> &mut [Agent] {
        &mut self.agents
    }

    /// Stops every agent, then the central service (SIGTERM, graceful);
    /// the first failure is returned after trying them all.
    pub async fn stop(&mut self) -> Result<(), ClusterError> {
        let mut first_error = None;
        for agent in &mut self.agents {
            if agent.is_running()
                && let Err(error) = agent.stop().await
            {
                first_error.get_or_insert(error);
            }
        }
        if self.central.is_running()
            && let Err(error) = self.central.stop().await
        {
            first_error.get_or_insert(error);
        }
        first_error.map_or(Ok(()), Err)
    }
}

/// One answer over an agent's socket.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentResponse {
    pub status: u16,
    /// The `Retry-After` header, if any.
    pub retry_after: Option<String>,
    /// The JSON body (a string for a body that is not JSON, null if empty).
    pub body: Value,
}

impl AgentResponse {
    pub fn is_success(&self) -> bool {
        (200..300).contains(&self.status)
    }

    /// `body.reservation`, if it is a string.
    pub fn reservation(&self) -> Option<&str> {
        self.body["reservation"].as_str()
    }

    /// `body.state`, if it is a string.
    pub fn state(&self) -> Option<&str> {
        self.body["state"].as_str()
    }

    /// `body.error`, the refusal's stable code, if the body has one.
    pub fn error(&self) -> Option<ErrorCode> {
        self.body["error"].as_str().map(ErrorCode::from_wire)
    }
}

/// HTTP/1.1 over an agent's Unix socket (hyper; one connection per call).
/// `Err` means no answer came: the agent is down or did not answer within
/// the timeout, so the call's outcome is unknown.
#[derive(Debug, Clone)]
pub struct AgentClient {
    agent: String,
    socket: PathBuf,
    timeout: Duration,
}

impl AgentClient {
    /// A client for the socket at `socket`; `agent` names it in errors.
    pub fn new(agent: &str, socket: PathBuf) -> Self {
        Self {
            agent: agent.to_owned(),
            socket,
            timeout: CALL_TIMEOUT,
        }
    }

    /// The longest wait for one answer ([`CALL_TIMEOUT`] by default).
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// One request; `body` is sent as JSON.
    pub async fn send(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> Result<AgentResponse, ClusterError> {
        let failure = |message: String| ClusterError::Socket {
            agent: self.agent.clone(),
            request: format!("{method} {path}"),
            message,
        };
        let method = hyper::Method::from_bytes(method.as_bytes())
            .map_err(|error| failure(error.to_string()))?;
        let body = body.map(Value::to_string).unwrap_or_default();
        let exchange = async {
            let stream = tokio::net::UnixStream::connect(&self.socket)
                .await
                .map_err(|error| format!("cannot connect to {}: {error}", self.socket.display()))?;
            let (mut sender, connection) =
                hyper::client::conn::http1::handshake(TokioIo::new(stream))
                    .await
                    .map_err(|error| error.to_string())?;
            let driver = tokio::spawn(connection);
            let request = hyper::Request::builder()
                .method(method)
                .uri(path)
                .header(HOST, "agent")
                .header(CONTENT_TYPE, "application/json")
                .body(Full::new(Bytes::from(body)))
                .map_err(|error| error.to_string())?;
            let response = sender
                .send_request(request)
                .await
                .map_err(|error| error.to_string())?;
            let status = response.status().as_u16();
            let retry_after = response
                .headers()
                .get(RETRY_AFTER)
                .and_then(|value| value.to_str().ok())
                .map(str::to_owned);
            let bytes = response
                .into_body()
                .collect()
                .await
                .map_err(|error| error.to_string())?
                .to_bytes();
            drop(sender);
            driver.abort();
            Ok::<_, String>((status, retry_after, bytes))
        };
        let (status, retry_after, bytes) = tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| failure(format!("no answer within {:?}", self.timeout)))?
            .map_err(failure)?;
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()))
        };
        Ok(AgentResponse {
            status,
            retry_after,
            body,
        })
    }

    /// `POST /v1/reservations`.
    pub async fn reserve(
        &self,
        idempotency_key: &str,
        subject: &str,
        route: &str,
        units: u64,
    ) -> Result<AgentResponse, ClusterError> {
        let body = json!({
            "idempotencyKey": idempotency_key,
            "subject": subject,
            "route": route,
            "units": units,
        });
        self.send("POST", "/v1/reservations", Some(&body)).await
    }

    /// `GET /v1/reservations/{reservation}`.
    pub async fn reservation(&self, reservation: &str) -> Result<AgentResponse, ClusterError> {
        self.send("GET", &format!("/v1/reservations/{reservation}"), None)
            .await
    }

    /// `POST /v1/reservations/{reservation}/start`.
    pub async fn start(
        &self,
        reservation: &str,
        operation_id: &str,
    ) -> Result<AgentResponse, ClusterError> {
        let body = json!({ "operationId": operation_id });
        self.send(
            "POST",
            &format!("/v1/reservations/{reservation}/start"),
            Some(&body),
        )
        .await
    }

    /// `POST /v1/reservations/{reservation}/settle`.
    pub async fn settle(
        &self,
        reservation: &str,
        operation_id: &str,
        actual_units: u64,
    ) -> Result<AgentResponse, ClusterError> {
        let body = json!({ "operationId": operation_id, "actualUnits": actual_units });
        self.send(
            "POST",
            &format!("/v1/reservations/{reservation}/settle"),
            Some(&body),
        )
        .await
    }

    /// `POST /v1/reservations/{reservation}/release`.
    pub async fn release(&self, reservation: &str) -> Result<AgentResponse, ClusterError> {
        self.send(
            "POST",
            &format!("/v1/reservations/{reservation}/release"),
            None,
        )
        .await
    }

    /// `GET /v1/status`; an answer other than 200 is an error.
    pub async fn status(&self) -> Result<Value, ClusterError> {
        self.get("/v1/status").await
    }

    /// `GET /v1/shards`: the first page of the shards, closed ones too
    /// (up to 1,000, more than any test holds); an answer other than 200
    /// is an error.
    pub async fn shards(&self) -> Result<Value, ClusterError> {
        self.get("/v1/shards").await
    }

    /// `GET path`'s body; an answer other than 200 is an error.
    async fn get(&self, path: &str) -> Result<Value, ClusterError> {
        let answer = self.send("GET", path, None).await?;
        if answer.status == 200 {
            Ok(answer.body)
        } else {
            Err(ClusterError::Socket {
                agent: self.agent.clone(),
                request: format!("GET {path}"),
                message: format!("answered {}: {}", answer.status, answer.body),
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn agents_are_named_by_letter_then_number() {
        assert_eq!(agent_name(0), "agent-a");
        assert_eq!(agent_name(2), "agent-c");
        assert_eq!(agent_name(25), "agent-z");
        assert_eq!(agent_name(26), "agent-27");
    }

    #[test]
    fn a_log_tail_keeps_the_last_lines() {
        let dir = tempfile::tempdir().expect("temp dir");
        let log = dir.path().join("x.log");
        let text: String = (0..40).map(|line| format!("line {line}\n")).collect();
        std::fs::write(&log, text).expect("write");
        let tail = log_tail(&log);
        assert!(tail.starts_with("line 15\n"), "{tail}");
        assert!(tail.ends_with("line 39"), "{tail}");
        assert!(log_tail(&dir.path().join("none")).contains("cannot read"));
    }

    #[test]
    fn the_policy_is_the_designs_with_a_long_epoch() {
        let policy = policy("tenant-9", "chat.summarize", 3);
        assert_eq!(
            (policy.subject.as_str(), policy.route.as_str()),
            ("tenant-9", "chat.summarize")
        );
        assert_eq!(
            (policy.opening, policy.burst, policy.policy_generation),
            (1000, 1000, 3)
        );
        assert_eq!(policy.emergency_mode, EmergencyMode::Disabled);
        assert_eq!(
            policy.accounting_epoch_ms,
            shard_format::limits::DURATION_MS_MAX
        );
    }
}
