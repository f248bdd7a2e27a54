//! `reservoir agent run --config FILE`: the per-gateway agent daemon — the
//! decision core behind a Unix socket, with its redb journal — configured by
//! a TOML file whose settings flags may override.
//!
//! # The configuration file
//!
//! ```toml
//! socket = "/run/reservoir-agent/agent.sock"
//! data = "/var/lib/reservoir-agent"          # journal.redb lives here
//! central = "https://central.example:7070"
//! central_ca_file = "/etc/reservoir/central-ca.pem" # the center's CA; default: system roots
//! insecure_http = false                      # true allows http:// to a non-loopback center (INSECURE)
//! identity_key = "/etc/reservoir/agent.key"  # from `reservoir keygen --out FILE`
//! trusted_central_keys = ["ed25519:…"]       # whose shards are accepted
//! allowed_uids = []                          # SO_PEERCRED allow-list; empty: any
//! allowed_gids = []
//! retention = "24h"                          # idempotency window; see below
//!
//! [routes."chat.generate"]
//! mode = "enforce"                           # off | shadow | enforce
//! concurrency = 64                           # starts at once; unset: unlimited
//!
//! [subjects."tenant-7"]
//! weight = 2                                 # fair start scheduler weight
//!
//! [timeouts]                                 # all optional, milliseconds
//! central_call_ms = 2000
//! retry_interval_ms = 1000
//! default_deadline_ms = 60000
//! deadline_ms_max = 3600000
//! local_hold_ms = 30000
//! shard_refresh_margin_ms = 60000            # ask for the next shard this early
//! shard_skew_margin_ms = 5000                # taken off a shard's validity
//! unknown_abandon_grace_ms = 30000           # before an unknown reserve is abandoned
//! header_read_ms = 10000                     # socket: a request's head within this
//! idle_ms = 60000                            # socket: close after this with no byte moving
//!
//! [limits]                                   # all optional
//! journal_batch_max = 4096
//! open_reservations_max = 1000000
//! gateway_queue_max = 4096
//! partition_failures_max = 3                 # failed calls before partitioned
//! connections_max = 256                      # socket connections; more wait in the backlog
//! ```
//!
//! Unknown keys are refused, so a typo never silently means a default.
//!
//! `retention` (a duration: `24h`, `90m`, `90s`; default 24 h) is how long
//! a finished reservation and a reconciled shard are remembered: within it
//! a gateway's retry with the same idempotency key gets the same
//! reservation, after it the key is a new request. It must cover the
//! longest life of a reservation here, `local_hold_ms` + `deadline_ms_max`
//! (or `default_deadline_ms` if longer) plus 30 s, or the agent refuses to
//! start. The central service has its own window (`central serve
//! --retention`).
//!
//! # Flags, environment, file
//!
//! Every flag may also come from the environment: `RESERVOIR_AGENT_CONFIG`,
//! `RESERVOIR_AGENT_SOCKET`, `RESERVOIR_AGENT_DATA`, `RESERVOIR_AGENT_CENTRAL`,
//! `RESERVOIR_AGENT_IDENTITY_KEY`, `RESERVOIR_AGENT_TRUSTED_CENTRAL_KEYS`
//! (comma-separated), `RESERVOIR_AGENT_RETENTION`,
//! `RESERVOIR_AGENT_CENTRAL_CA_FILE`, `RESERVOIR_AGENT_INSECURE_HTTP`,
//! `RESERVOIR_AGENT_HEADER_READ_TIMEOUT`, `RESERVOIR_AGENT_IDLE_TIMEOUT` and
//! `RESERVOIR_AGENT_CONNECTIONS_MAX`. A flag wins over its variable, a variable over the
//! file.
//!
//! # Under systemd
//!
//! - Socket activation: a listening socket passed by systemd
//!   (`LISTEN_FDS`) is served instead of binding `socket`, and left in
//!   place on exit (systemd owns it).
//! - `READY=1` once the journal is open, the socket listens and the central
//!   ledger registered this boot. A center unreachable at start does not
//!   hold readiness back past [`boot_wait`]: the agent then says `READY=1`
//!   with a `STATUS=` and a log line that it is degraded (no emergency
//!   capacity until the center registers the boot, docs/design.md §5.2), and
//!   updates the status when the boot registers later.
//! - `WATCHDOG=1` every half `WatchdogSec=`, each after a status round trip
//!   through the daemon task: a wedged core stops the pings.
//! - `STOPPING=1` when a signal starts the drain.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use agent::daemon::{Daemon, DaemonConfig, DaemonHandle};
use agent::socket::{self, PeerPolicy};
use agent_core::AgentConfig;
use anyhow::{Context as _, bail};
use central_client::{CentralClient, ClientConfig};
use clap::{Args, Subcommand};
use serde::Deserialize;
use shard_format::{DocumentSigner as _, KeyId, Route, RouteMode, Subject};

use crate::systemd;

/// The longest readiness waits for the central ledger to register the boot
/// (well inside systemd's default `TimeoutStartSec=` of 90 s).
pub const BOOT_WAIT_MAX: Duration = Duration::from_secs(30);

/// How long readiness waits for the boot registration: two central call
/// timeouts and a retry interval, at most [`BOOT_WAIT_MAX`].
pub fn boot_wait(agent: &AgentConfig) -> Duration {
    let ms = agent
        .central_call_timeout_ms
        .saturating_mul(2)
        .saturating_add(agent.retry_interval_ms);
    Duration::from_millis(ms).min(BOOT_WAIT_MAX)
}

/// The agent's commands, to flatten into `reservoir`'s.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// The per-gateway agent: admission on a Unix socket, a redb journal,
    /// emergency shards while the central ledger is unreachable.
    Agent(AgentArgs),
}

#[derive(Debug, Args)]
pub struct AgentArgs {
    #[command(subcommand)]
    pub command: AgentCommand,
}

#[derive(Debug, Subcommand)]
pub enum AgentCommand {
    /// Run the agent daemon until SIGINT or SIGTERM.
    Run(Box<RunArgs>),
    /// Print the socket API's OpenAPI 3.1 document (what the agent serves
    /// at `GET /openapi.json`; committed as docs/openapi/agent.json).
    Openapi,
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// The TOML configuration file (see `reservoir agent run --help`).
    #[arg(long, value_name = "FILE", env = "RESERVOIR_AGENT_CONFIG")]
    pub config: Option<PathBuf>,
    /// The Unix socket gateways connect to (overrides `socket`; unused when
    /// systemd passes the socket).
    #[arg(long, value_name = "PATH", env = "RESERVOIR_AGENT_SOCKET")]
    pub socket: Option<PathBuf>,
    /// The data directory holding `journal.redb` (overrides `data`).
    #[arg(long, value_name = "DIR", env = "RESERVOIR_AGENT_DATA")]
    pub data: Option<PathBuf>,
    /// The central service, e.g. `http://127.0.0.1:7070` (overrides `central`).
    #[arg(long, value_name = "URL", env = "RESERVOIR_AGENT_CENTRAL")]
    pub central: Option<String>,
    /// The agent's identity key file (overrides `identity_key`).
    #[arg(long, value_name = "FILE", env = "RESERVOIR_AGENT_IDENTITY_KEY")]
    pub identity_key: Option<PathBuf>,
    /// A central public key whose shards are accepted; repeatable or
    /// comma-separated (replaces `trusted_central_keys`).
    #[arg(
        long,
        value_name = "KEY_ID",
        env = "RESERVOIR_AGENT_TRUSTED_CENTRAL_KEYS",
        value_delimiter = ','
    )]
    pub trusted_central_key: Vec<KeyId>,
    /// The idempotency window (`24h`, `90m`, `90s`; overrides `retention`,
    /// default 24h): finished reservations and reconciled shards are kept
    /// this long, then forgotten; within it a retry gets the same
    /// reservation, after it the same key is a new request. It must cover
    /// local_hold_ms + deadline_ms_max (or default_deadline_ms if longer)
    /// plus 30 s, or the agent refuses to start.
    #[arg(
        long,
        value_name = "DURATION",
        env = "RESERVOIR_AGENT_RETENTION",
        value_parser = parse_retention
    )]
    pub retention: Option<Duration>,
    /// PEM CA certificate(s) the center's TLS certificate must chain to
    /// (overrides `central_ca_file`; default: the system's roots).
    #[arg(long, value_name = "FILE", env = "RESERVOIR_AGENT_CENTRAL_CA_FILE")]
    pub central_ca_file: Option<PathBuf>,
    /// INSECURE: allow an `http://` central URL that is not loopback (or
    /// `insecure_http = true`). The center's answers (admissions, shards)
    /// and the agent's calls then cross the network unauthenticated and in
    /// clear: anyone on the path can forge admissions.
    #[arg(long, env = "RESERVOIR_AGENT_INSECURE_HTTP")]
    pub insecure_http: bool,
    /// A request's head must arrive within this time of the socket server
    /// waiting for it (overrides `[timeouts] header_read_ms`; default 10s).
    #[arg(long, value_name = "DURATION", value_parser = crate::central_command::parse_positive_duration, env = "RESERVOIR_AGENT_HEADER_READ_TIMEOUT")]
    pub header_read_timeout: Option<Duration>,
    /// A connection on which no byte moves for this long is closed
    /// (overrides `[timeouts] idle_ms`; default 60s).
    #[arg(long, value_name = "DURATION", value_parser = crate::central_command::parse_positive_duration, env = "RESERVOIR_AGENT_IDLE_TIMEOUT")]
    pub idle_timeout: Option<Duration>,
    /// Open gateway connections at most; more wait in the socket's backlog
    /// (overrides `[limits] connections_max`; default 256).
    #[arg(long, value_name = "N", value_parser = crate::central_command::parse_connections_max, env = "RESERVOIR_AGENT_CONNECTIONS_MAX")]
    pub connections_max: Option<usize>,
    /// Threads that serve the socket and carry out the agent's decisions
    /// (default 1: a sidecar keeps to one core of the gateway's machine;
    /// journal commits and folds run on threads of their own either way).
    /// More spread the connections' work over that many cores.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..), env = "RESERVOIR_AGENT_WORKER_THREADS")]
    pub worker_threads: u16,
}

impl Command {
    /// The runtime's worker threads the command asks for.
    pub fn worker_threads(&self) -> u16 {
        match self {
            Self::Agent(AgentArgs {
                command: AgentCommand::Run(args),
            }) => args.worker_threads,
            Self::Agent(AgentArgs {
                command: AgentCommand::Openapi,
            }) => 1,
        }
    }
}

/// A retention window: a human duration (`24h`, `15m`, `90s`).
fn parse_retention(text: &str) -> Result<Duration, String> {
    humantime::parse_duration(text)
        .map_err(|error| format!("{error} (expected a duration such as 24h, 15m or 90s)"))
}

/// The configuration file. Every member is optional here so that flags
/// can supply what the file leaves out; [`Settings::resolve`] says what is
/// still missing.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    pub socket: Option<PathBuf>,
    pub data: Option<PathBuf>,
    pub central: Option<String>,
    /// PEM CA file the center's certificate must chain to.
    pub central_ca_file: Option<PathBuf>,
    /// Allow `http://` to a center that is not loopback (insecure).
    #[serde(default)]
    pub insecure_http: bool,
    pub identity_key: Option<PathBuf>,
    #[serde(default)]
    pub trusted_central_keys: Vec<KeyId>,
    #[serde(default)]
    pub allowed_uids: Vec<u32>,
    #[serde(default)]
    pub allowed_gids: Vec<u32>,
    /// The idempotency window, a duration such as `24h` (parsed by
    /// [`Settings::resolve`], which names the setting if it is not one).
    pub retention: Option<String>,
    #[serde(default)]
    pub routes: BTreeMap<Route, RouteSettings>,
    #[serde(default)]
    pub subjects: BTreeMap<Subject, SubjectSettings>,
    #[serde(default)]
    pub timeouts: Timeouts,
    #[serde(default)]
    pub limits: Limits,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RouteSettings {
    pub mode: Option<RouteMode>,
    pub concurrency: Option<usize>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubjectSettings {
    pub weight: u32,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Timeouts {
    pub central_call_ms: Option<u64>,
    pub retry_interval_ms: Option<u64>,
    pub default_deadline_ms: Option<u64>,
    pub deadline_ms_max: Option<u64>,
    pub local_hold_ms: Option<u64>,
    pub shard_refresh_margin_ms: Option<u64>,
    pub shard_skew_margin_ms: Option<u64>,
    pub unknown_abandon_grace_ms: Option<u64>,
    /// The socket server's header-read timeout.
    pub header_read_ms: Option<u64>,
    /// The socket server's idle timeout.
    pub idle_ms: Option<u64>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    pub journal_batch_max: Option<usize>,
    pub open_reservations_max: Option<usize>,
    pub gateway_queue_max: Option<usize>,
    pub partition_failures_max: Option<u32>,
    /// Open gateway connections at most.
    pub connections_max: Option<usize>,
}

impl ConfigFile {
    pub fn parse(text: &str) -> anyhow::Result<Self> {
        Ok(toml::from_str(text)?)
    }

    pub fn load(path: &Path) -> anyhow::Result<Self> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the configuration {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("in the configuration {}", path.display()))
    }
}

/// The file with the flags applied, checked complete.
#[derive(Debug)]
pub struct Settings {
    pub socket: PathBuf,
    pub data: PathBuf,
    pub central: String,
    pub central_ca_file: Option<PathBuf>,
    pub insecure_http: bool,
    pub identity_key: PathBuf,
    pub trusted_central_keys: Vec<KeyId>,
    pub peers: PeerPolicy,
    /// The socket server's timeouts and connection cap.
    pub server_limits: socket::ServerLimits,
    /// The idempotency window (flag, environment, file, or 24 h).
    pub retention: Duration,
    pub file: ConfigFile,
}

impl Settings {
    /// Flags win over the file; the four places and at least one trusted
    /// central key are required.
    pub fn resolve(mut file: ConfigFile, args: &RunArgs) -> anyhow::Result<Self> {
        let socket = args.socket.clone().or(file.socket.take());
        let data = args.data.clone().or(file.data.take());
        let central = args.central.clone().or(file.central.take());
        let identity_key = args.identity_key.clone().or(file.identity_key.take());
        let trusted = if args.trusted_central_key.is_empty() {
            std::mem::take(&mut file.trusted_central_keys)
        } else {
            args.trusted_central_key.clone()
        };
        let (Some(socket), Some(data), Some(central), Some(identity_key)) =
            (socket, data, central, identity_key)
        else {
            bail!(
                "the agent needs `socket`, `data`, `central` and `identity_key` (in the configuration file or as --socket, --data, --central, --identity-key)"
            );
        };
        if trusted.is_empty() {
            bail!(
                "the agent needs at least one trusted central key (`trusted_central_keys` or --trusted-central-key): shards are accepted only from them"
            );
        }
        let retention = match (args.retention, file.retention.take()) {
            (Some(retention), _) => retention,
            (None, Some(text)) => parse_retention(&text).map_err(|error| {
                anyhow::anyhow!("`retention = {text:?}` is not a duration: {error}")
            })?,
            (None, None) => Duration::from_millis(ledger::RETENTION_DEFAULT_MS),
        };
        let peers = PeerPolicy {
            allowed_uids: std::mem::take(&mut file.allowed_uids),
            allowed_gids: std::mem::take(&mut file.allowed_gids),
        };
        let mut server_limits = socket::ServerLimits::AGENT;
        if let Some(timeout) = args
            .header_read_timeout
            .or(file.timeouts.header_read_ms.map(Duration::from_millis))
        {
            server_limits.header_read_timeout = timeout.max(Duration::from_millis(1));
        }
        if let Some(timeout) = args
            .idle_timeout
            .or(file.timeouts.idle_ms.map(Duration::from_millis))
        {
            server_limits.idle_timeout = timeout.max(Duration::from_millis(1));
        }
        if let Some(max) = args.connections_max.or(file.limits.connections_max) {
            server_limits.connections_max = max.max(1);
        }
        Ok(Self {
            socket,
            data,
            central,
            central_ca_file: args.central_ca_file.clone().or(file.central_ca_file.take()),
            insecure_http: args.insecure_http || file.insecure_http,
            server_limits,
            identity_key,
            trusted_central_keys: trusted,
            peers,
            retention,
            file,
        })
    }

    /// The core's settings for `identity`, refused if the retention window
    /// is shorter than the core's floor ([`AgentConfig::check_retention`]).
    pub fn agent_config(&self, identity: KeyId) -> anyhow::Result<AgentConfig> {
        let mut config = AgentConfig::new(identity);
        for (route, settings) in &self.file.routes {
            if let Some(mode) = settings.mode {
                config.route_modes.insert(route.clone(), mode);
            }
            if let Some(limit) = settings.concurrency {
                config.route_concurrency.insert(route.clone(), limit);
            }
        }
        for (subject, settings) in &self.file.subjects {
            config
                .subject_weights
                .insert(subject.clone(), settings.weight);
        }
        let timeouts = &self.file.timeouts;
        let limits = &self.file.limits;
        let set = |target: &mut u64, value: Option<u64>| {
            if let Some(value) = value {
                *target = value;
            }
        };
        set(
            &mut config.central_call_timeout_ms,
            timeouts.central_call_ms,
        );
        set(&mut config.retry_interval_ms, timeouts.retry_interval_ms);
        set(
            &mut config.default_deadline_ms,
            timeouts.default_deadline_ms,
        );
        set(&mut config.deadline_ms_max, timeouts.deadline_ms_max);
        set(&mut config.local_hold_ms, timeouts.local_hold_ms);
        set(
            &mut config.shard_refresh_margin_ms,
            timeouts.shard_refresh_margin_ms,
        );
        set(
            &mut config.shard_skew_margin_ms,
            timeouts.shard_skew_margin_ms,
        );
        set(
            &mut config.unknown_abandon_grace_ms,
            timeouts.unknown_abandon_grace_ms,
        );
        if let Some(max) = limits.partition_failures_max {
            config.partition_failures_max = max.max(1);
        }
        if let Some(max) = limits.journal_batch_max {
            config.journal_batch_max = max.max(1);
        }
        if let Some(max) = limits.open_reservations_max {
            config.open_reservations_max = max;
        }
        config.retention_ms = u64::try_from(self.retention.as_millis()).unwrap_or(u64::MAX);
        if let Err(error) = config.check_retention() {
            bail!(
                "`retention` {} is too short: {error} (lengthen `retention`, or shorten `[timeouts]` {} or local_hold_ms)",
                humantime::format_duration(self.retention),
                error.deadline_setting
            );
        }
        Ok(config)
    }
}

/// Runs one of the commands.
pub async fn run(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Agent(AgentArgs {
            command: AgentCommand::Run(args),
        }) => run_agent(*args).await.map(|()| ExitCode::SUCCESS),
        Command::Agent(AgentArgs {
            command: AgentCommand::Openapi,
        }) => {
            print!("{}", agent::openapi::document_text());
            Ok(ExitCode::SUCCESS)
        }
    }
}

async fn run_agent(args: RunArgs) -> anyhow::Result<()> {
    init_logs();
    let file = match &args.config {
        Some(path) => ConfigFile::load(path)?,
        None => ConfigFile::default(),
    };
    let settings = Settings::resolve(file, &args)?;
    let signer = central_client::key_file::load(&settings.identity_key).with_context(|| {
        format!(
            "cannot load the identity key {}",
            settings.identity_key.display()
        )
    })?;
    let identity = signer.key_id().clone();
    let client_signer = central_client::key_file::load(&settings.identity_key)?;
    // Checked before anything is created or bound.
    let agent = settings.agent_config(identity.clone())?;
    use std::os::unix::fs::DirBuilderExt as _;
    // Private like the central data directory (the journal in it is 0600
    // too); an existing directory keeps its mode.
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&settings.data)
        .with_context(|| format!("cannot create {}", settings.data.display()))?;
    let mut client_config = ClientConfig::new(settings.central.clone());
    client_config.ca_file = settings.central_ca_file.clone();
    client_config.insecure_http = settings.insecure_http;
    if settings.insecure_http {
        tracing::warn!(event = "insecure_http_allowed", central = %settings.central,
            "plain http:// to a non-loopback center is allowed: its answers are not authenticated");
    }
    client_config.call_timeout = Duration::from_millis(agent.central_call_timeout_ms.max(1));
    let client = CentralClient::new(client_config)?.with_identity(client_signer);
    let mut config = DaemonConfig::new(
        agent,
        settings.data.join("journal.redb"),
        settings.trusted_central_keys.clone(),
    );
    if let Some(max) = settings.file.limits.gateway_queue_max {
        config.gateway_queue_max = max.max(1);
    }
    let boot_wait = boot_wait(&config.agent);
    // The socket first: a second agent on a live socket stops here, before
    // it registers a boot that would supersede the running one's.
    let (listener, activated) = match systemd::activated_unix_listener()
        .context("cannot use the socket systemd passed (LISTEN_FDS)")?
    {
        Some(listener) => (listener, true),
        None => (
            socket::bind(&settings.socket)
                .await
                .with_context(|| format!("cannot listen on {}", settings.socket.display()))?,
            false,
        ),
    };
    let where_ = if activated {
        let path = listener
            .local_addr()
            .ok()
            .and_then(|address| address.as_pathname().map(|path| path.display().to_string()));
        format!(
            "{} (passed by systemd)",
            path.as_deref().unwrap_or("an unnamed socket")
        )
    } else {
        settings.socket.display().to_string()
    };
    let daemon = Daemon::start(config, signer, client).await?;
    tracing::info!(%identity, socket = %where_, central = %settings.central, "agent listening");
    tracing::info!(
        retention = %humantime::format_duration(settings.retention),
        "finished reservations are forgotten after the retention window"
    );
    // The one line on stdout: scripts and tests wait for it.
    let mut stdout = std::io::stdout();
    writeln!(stdout, "listening on {where_}")?;
    stdout.flush()?;
    let supervisor = tokio::spawn(supervise(daemon.handle(), where_, boot_wait));
    let served = socket::serve_with_limits(
        listener,
        daemon.handle(),
        settings.peers.clone(),
        settings.server_limits,
        async {
            shutdown_signal().await;
            systemd::stopping("draining: answering the calls under way, committing the journal");
        },
    )
    .await;
    supervisor.abort();
    let drained = daemon.shutdown().await;
    if !activated {
        let _ = std::fs::remove_file(&settings.socket);
    }
    served.context("the socket server failed")?;
    drained.context("the agent daemon failed")?;
    Ok(())
}

/// Readiness and the watchdog (see the module documentation).
async fn supervise(handle: DaemonHandle, socket: String, boot_wait: Duration) {
    let ready = async {
        match tokio::time::timeout(boot_wait, handle.registered()).await {
            Ok(Ok(epoch)) => {
                tracing::info!(boot_epoch = epoch, "boot registered; ready");
                systemd::ready(&format!("healthy: boot epoch {epoch}; serving on {socket}"));
            }
            Ok(Err(_stopped)) => {}
            Err(_) => {
                tracing::warn!(
                    waited_ms = u64::try_from(boot_wait.as_millis()).unwrap_or(u64::MAX),
                    "degraded: the central ledger has not registered this boot; serving without emergency capacity until it does"
                );
                systemd::ready(&format!(
                    "degraded: central ledger unreachable, boot not registered (no emergency capacity); serving on {socket}"
                ));
                if let Ok(epoch) = handle.registered().await {
                    tracing::info!(boot_epoch = epoch, "boot registered; no longer degraded");
                    systemd::status(&format!("healthy: boot epoch {epoch}; serving on {socket}"));
                }
            }
        }
    };
    // A commit stuck longer than a ping period means a hung disk: the core
    // still answers, but nothing it acknowledges can be made durable.
    let commit_limit = systemd::watchdog_interval().map(|interval| interval / 2);
    let watchdog = systemd::watchdog(|| {
        let handle = handle.clone();
        async move {
            // The core answers (the gauges: a ping must not cost the
            // daemon's thread a pass over what it holds).
            handle
                .gauges()
                .await
                .map_err(|stopped| stopped.to_string())?;
            match (handle.metrics().journal_commit_running_for(), commit_limit) {
                (Some(running), Some(limit)) if running > limit => Err(format!(
                    "a journal commit has been running for {} ms",
                    running.as_millis()
                )),
                _ => Ok(()),
            }
        }
    });
    tokio::join!(ready, watchdog);
}

fn init_logs() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

/// SIGINT or SIGTERM.
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut terminate = match signal(SignalKind::terminate()) {
        Ok(terminate) => terminate,
        Err(error) => {
            tracing::error!(%error, "cannot listen for SIGTERM; only SIGINT stops the agent");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate.recv() => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY: &str = "ed25519:0000000000000000000000000000000000000000000000000000000000000000";

    fn args() -> RunArgs {
        RunArgs {
            config: None,
            socket: None,
            data: None,
            central: None,
            identity_key: None,
            trusted_central_key: Vec::new(),
            retention: None,
            central_ca_file: None,
            insecure_http: false,
            header_read_timeout: None,
            idle_timeout: None,
            connections_max: None,
            worker_threads: 1,
        }
    }

    /// `reservoir`'s command line, for parsing the agent's flags alone.
    #[derive(Debug, clap::Parser)]
    struct Cli {
        #[command(subcommand)]
        command: Command,
    }

    #[test]
    fn the_agent_runs_on_one_thread_unless_asked_for_more() {
        use clap::Parser as _;
        let threads = |extra: &[&str]| {
            Cli::try_parse_from(["reservoir", "agent", "run"].iter().chain(extra))
                .map(|cli| cli.command.worker_threads())
        };
        assert_eq!(threads(&[]).unwrap(), 1);
        assert_eq!(threads(&["--worker-threads", "4"]).unwrap(), 4);
        assert!(threads(&["--worker-threads", "0"]).is_err());
        let openapi = Cli::try_parse_from(["reservoir", "agent", "openapi"]).unwrap();
        assert_eq!(openapi.command.worker_threads(), 1);
    }

    #[test]
    fn the_file_configures_the_core_and_flags_override_it() {
        let file = ConfigFile::parse(&format!(
            r#"
            socket = "/run/agent.sock"
            data = "/var/lib/agent"
            central = "http://127.0.0.1:7070"
            identity_key = "/etc/agent.key"
            trusted_central_keys = ["{KEY}"]

            [routes."chat.generate"]
            mode = "shadow"
            concurrency = 8

            [subjects."tenant-7"]
            weight = 3

            [timeouts]
            central_call_ms = 500
            unknown_abandon_grace_ms = 9000
            shard_refresh_margin_ms = 7000

            [limits]
            partition_failures_max = 5
            "#
        ))
        .expect("parses");
        let mut flags = args();
        flags.socket = Some(PathBuf::from("/tmp/other.sock"));
        let settings = Settings::resolve(file, &flags).expect("complete");
        assert_eq!(settings.socket, PathBuf::from("/tmp/other.sock"));
        assert_eq!(settings.data, PathBuf::from("/var/lib/agent"));
        let key: KeyId = KEY.parse().expect("key");
        let config = settings.agent_config(key).expect("valid");
        let route = Route::new("chat.generate").expect("valid");
        assert_eq!(config.route_modes.get(&route), Some(&RouteMode::Shadow));
        assert_eq!(config.route_concurrency.get(&route), Some(&8));
        assert_eq!(
            config
                .subject_weights
                .get(&Subject::new("tenant-7").expect("valid")),
            Some(&3)
        );
        assert_eq!(config.central_call_timeout_ms, 500);
        assert_eq!(config.unknown_abandon_grace_ms, 9000);
        assert_eq!(config.shard_refresh_margin_ms, 7000);
        assert_eq!(config.partition_failures_max, 5);
    }

    #[test]
    fn the_example_configuration_is_complete() {
        let example = include_str!("../../systemd/agent.toml.example");
        let file = ConfigFile::parse(example).expect("the example parses");
        let settings = Settings::resolve(file, &args()).expect("and is complete");
        assert_eq!(
            settings.socket,
            PathBuf::from(crate::status_command::DEFAULT_SOCKET)
        );
        assert_eq!(settings.data, PathBuf::from("/var/lib/reservoir-agent"));
        assert_eq!(settings.retention, Duration::from_secs(24 * 3600));
        let config = settings
            .agent_config(KEY.parse().expect("key"))
            .expect("and valid");
        assert_eq!(config.retention_ms, ledger::RETENTION_DEFAULT_MS);
    }

    /// A complete file with `extra` at the top level and `timeouts` in
    /// `[timeouts]`.
    fn complete(extra: &str, timeouts: &str) -> ConfigFile {
        ConfigFile::parse(&format!(
            r#"
            socket = "/run/agent.sock"
            data = "/var/lib/agent"
            central = "http://127.0.0.1:7070"
            identity_key = "/etc/agent.key"
            trusted_central_keys = ["{KEY}"]
            {extra}

            [timeouts]
            {timeouts}
            "#
        ))
        .expect("parses")
    }

    fn retention_ms(file: ConfigFile, flags: &RunArgs) -> anyhow::Result<u64> {
        let settings = Settings::resolve(file, flags)?;
        Ok(settings
            .agent_config(KEY.parse().expect("key"))?
            .retention_ms)
    }

    #[test]
    fn retention_comes_from_the_flag_the_file_or_the_default() {
        assert_eq!(
            retention_ms(complete("", ""), &args()).expect("valid"),
            ledger::RETENTION_DEFAULT_MS
        );
        assert_eq!(
            retention_ms(complete(r#"retention = "36h""#, ""), &args()).expect("valid"),
            36 * 3_600_000
        );
        let mut flags = args();
        flags.retention = Some(parse_retention("48h").expect("a duration"));
        assert_eq!(
            retention_ms(complete(r#"retention = "36h""#, ""), &flags).expect("valid"),
            48 * 3_600_000
        );
    }

    #[test]
    fn retention_exactly_at_the_floor_is_accepted_one_ms_below_refused() {
        // 5 s hold + 20 s deadline + the 30 s margin.
        let timeouts = "local_hold_ms = 5000\ndefault_deadline_ms = 20000\ndeadline_ms_max = 20000";
        assert_eq!(
            retention_ms(complete(r#"retention = "55s""#, timeouts), &args()).expect("the floor"),
            55_000
        );
        let error = retention_ms(complete(r#"retention = "54s 999ms""#, timeouts), &args())
            .expect_err("one ms below the floor");
        let message = error.to_string();
        for part in [
            "`retention` 54s 999ms is too short",
            "shorter than 55000 ms",
            "local_hold_ms + deadline_ms_max = 5000 + 20000 ms",
            "margin of 30000 ms",
        ] {
            assert!(message.contains(part), "{part:?} in {message}");
        }
        // The flag is held to the same floor.
        let mut flags = args();
        flags.retention = Some(Duration::from_millis(54_999));
        let error = retention_ms(complete("", timeouts), &flags).expect_err("below");
        assert!(
            error.to_string().contains("shorter than 55000 ms"),
            "{error}"
        );
    }

    #[test]
    fn a_longer_default_deadline_raises_the_floor_and_is_named() {
        let timeouts = "local_hold_ms = 5000\ndefault_deadline_ms = 40000\ndeadline_ms_max = 20000";
        let error = retention_ms(complete(r#"retention = "60s""#, timeouts), &args())
            .expect_err("the default deadline counts");
        let message = error.to_string();
        assert!(message.contains("shorter than 75000 ms"), "{message}");
        assert!(
            message.contains("local_hold_ms + default_deadline_ms"),
            "{message}"
        );
    }

    #[test]
    fn an_unparsable_retention_is_refused_naming_it() {
        let error = retention_ms(complete(r#"retention = "soon""#, ""), &args())
            .expect_err("not a duration");
        let message = error.to_string();
        assert!(
            message.contains(r#"`retention = "soon"` is not a duration"#),
            "{message}"
        );
        let error = ConfigFile::parse("retention = 60").expect_err("a number is not a duration");
        assert!(error.to_string().contains("retention"), "{error}");
    }

    #[test]
    fn unknown_keys_and_missing_places_are_refused() {
        let error = ConfigFile::parse("sockett = \"/x\"").expect_err("typo");
        assert!(error.to_string().contains("sockett"), "{error}");
        let error = Settings::resolve(ConfigFile::default(), &args()).expect_err("incomplete");
        assert!(error.to_string().contains("socket"), "{error}");
    }
}
