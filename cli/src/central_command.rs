//! `reservoir central serve`, `reservoir central enroll`, `reservoir keygen`
//! and `reservoir audit`: the central ledger service and its operator tools.
//!
//! Every flag of `central serve` may also come from the environment
//! (`RESERVOIR_CENTRAL_DATA`, `RESERVOIR_CENTRAL_LISTEN`, …; `--help` names
//! them); a flag wins over its variable. Under systemd (`Type=notify`) the
//! service says `READY=1` once its store is open and it listens, pings the
//! watchdog after each round trip through the ledger writer, and says
//! `STOPPING=1` when it drains.

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, bail};
use central::{DataDir, Service, ServiceConfig, StartError, StoreConfig, SystemClock};
use central_client::{CentralClient, ClientConfig};
use clap::{Args, Subcommand, ValueEnum};
use shard_format::{DocumentSigner as _, KeyId};

use crate::systemd;

/// The central service's commands, to flatten into `reservoir`'s.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// The central ledger service and the operator calls that change it.
    Central(CentralArgs),
    /// Create an ed25519 key file: the central service's shard-signing key
    /// (`--data DIR`) or an agent's identity key (`--out FILE`).
    Keygen(KeygenArgs),
    /// Check every account and shard of a central service against its
    /// equation and print a table; exits 1 on drift.
    Audit(AuditArgs),
}

#[derive(Debug, Args)]
pub struct CentralArgs {
    #[command(subcommand)]
    pub command: CentralCommand,
}

#[derive(Debug, Subcommand)]
pub enum CentralCommand {
    /// Run the central ledger service.
    Serve(ServeArgs),
    /// Enrol an agent's identity so it may reserve, register boots and take
    /// shards.
    Enroll(EnrollArgs),
    /// Print the central API's OpenAPI 3.1 document (what the service
    /// serves at `GET /openapi.json`; committed as
    /// docs/openapi/central.json).
    Openapi,
}

/// How logs are written to stderr.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Data directory: `ledger.redb` (the embedded store), `central.key`
    /// (the shard-signing key, from `reservoir keygen --data DIR`) and
    /// `operator.token` (created mode 0600 on first start).
    #[arg(long, value_name = "DIR", env = "RESERVOIR_CENTRAL_DATA")]
    pub data: PathBuf,
    /// Address to listen on, e.g. `127.0.0.1:7070`. Port 0 picks a free
    /// port; the address is printed on stdout as `listening on ADDR`.
    #[arg(long, value_name = "ADDR", env = "RESERVOIR_CENTRAL_LISTEN")]
    pub listen: SocketAddr,
    /// Keep the records in PostgreSQL instead of `DIR/ledger.redb`
    /// (`postgres://user@host:port/database`). Many replicas may share one
    /// database; the schema is created and migrated automatically.
    #[arg(
        long,
        value_name = "URL",
        env = "RESERVOIR_CENTRAL_POSTGRES",
        hide_env_values = true
    )]
    pub postgres: Option<String>,
    /// Read the operator token from this file (mode 0600) instead of
    /// `DIR/operator.token`.
    #[arg(
        long,
        value_name = "FILE",
        env = "RESERVOIR_CENTRAL_OPERATOR_TOKEN_FILE"
    )]
    pub operator_token_file: Option<PathBuf>,
    /// Log format on stderr.
    #[arg(long, value_enum, default_value_t = LogFormat::Text, env = "RESERVOIR_CENTRAL_LOG_FORMAT")]
    pub log_format: LogFormat,
    /// The idempotency window (`24h`, `90m`, `90s`): finished reservations,
    /// tombstones and reconciled shards are kept this long, then forgotten;
    /// within it a retry gets the original answer, after it the same key is
    /// a new request. It must cover every policy's holdTtlMs +
    /// executionHardLimitMs plus 30 s, or the service refuses to start.
    #[arg(
        long,
        value_name = "DURATION",
        default_value = "24h",
        value_parser = parse_retention,
        env = "RESERVOIR_CENTRAL_RETENTION"
    )]
    pub retention: Duration,
    /// Serve HTTPS with this PEM certificate chain (the server's
    /// certificate first, then intermediates). Needs `--tls-key`.
    #[arg(
        long,
        value_name = "FILE",
        requires = "tls_key",
        env = "RESERVOIR_CENTRAL_TLS_CERT"
    )]
    pub tls_cert: Option<PathBuf>,
    /// The PEM private key of `--tls-cert`.
    #[arg(
        long,
        value_name = "FILE",
        requires = "tls_cert",
        env = "RESERVOIR_CENTRAL_TLS_KEY"
    )]
    pub tls_key: Option<PathBuf>,
    /// INSECURE: serve plain HTTP on a non-loopback address. The operator
    /// token and the agents' calls then cross the network in clear, and
    /// anyone on the path can read the token and forge the center's answers
    /// (admissions, shards). Without TLS the service listens only on
    /// loopback unless this is given.
    #[arg(long, env = "RESERVOIR_CENTRAL_INSECURE_HTTP")]
    pub insecure_http: bool,
    #[command(flatten)]
    pub limits: ServerLimitArgs,
}

/// The HTTP server's limits (flags and variables shared by the central
/// service's and, with other defaults, the agent's).
#[derive(Debug, Clone, Args)]
pub struct ServerLimitArgs {
    /// A request's head (and the TLS handshake) must arrive within this
    /// time of the server waiting for it, or the connection is closed; a
    /// keep-alive connection that starts no new request within it is closed
    /// too.
    #[arg(
        long,
        value_name = "DURATION",
        default_value = "10s",
        value_parser = parse_positive_duration,
        env = "RESERVOIR_CENTRAL_HEADER_READ_TIMEOUT"
    )]
    pub header_read_timeout: Duration,
    /// A connection on which no byte moves in either direction for this
    /// long is closed.
    #[arg(
        long,
        value_name = "DURATION",
        default_value = "60s",
        value_parser = parse_positive_duration,
        env = "RESERVOIR_CENTRAL_IDLE_TIMEOUT"
    )]
    pub idle_timeout: Duration,
    /// Open connections at most; more wait in the listen backlog (the
    /// kernel refuses them once it is full) until one closes.
    #[arg(
        long,
        value_name = "N",
        default_value_t = http_serve::Limits::CENTRAL.connections_max,
        value_parser = parse_connections_max,
        env = "RESERVOIR_CENTRAL_CONNECTIONS_MAX"
    )]
    pub connections_max: usize,
}

impl ServerLimitArgs {
    pub fn limits(&self) -> http_serve::Limits {
        http_serve::Limits {
            header_read_timeout: self.header_read_timeout,
            idle_timeout: self.idle_timeout,
            connections_max: self.connections_max,
        }
    }
}

/// A connection cap: at least 1.
pub fn parse_connections_max(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(0) => Err("at least 1 connection".to_owned()),
        Ok(max) => Ok(max),
        Err(error) => Err(error.to_string()),
    }
}

/// A duration flag (`10s`, `500ms`), more than zero.
pub fn parse_positive_duration(text: &str) -> Result<Duration, String> {
    let duration = humantime::parse_duration(text)
        .map_err(|error| format!("{error} (expected a duration such as 10s or 500ms)"))?;
    if duration.is_zero() {
        return Err("the duration must be more than zero".to_owned());
    }
    Ok(duration)
}

/// A `--retention` value: a human duration (`24h`, `15m`, `90s`), at least
/// one millisecond.
fn parse_retention(text: &str) -> Result<Duration, String> {
    let duration = humantime::parse_duration(text)
        .map_err(|error| format!("{error} (expected a duration such as 24h, 15m or 90s)"))?;
    if duration.as_millis() == 0 {
        return Err("the retention window must be at least 1ms".to_owned());
    }
    Ok(duration)
}

/// Where an operator call goes and how it authenticates.
#[derive(Debug, Args)]
pub struct OperatorArgs {
    /// The central service, e.g. `https://central.example:7070`
    /// (`http://` only to loopback unless `--insecure-http`).
    #[arg(long, value_name = "URL", env = "RESERVOIR_CENTRAL_URL")]
    pub central: String,
    #[command(flatten)]
    pub trust: CentralTrustArgs,
    /// File holding the operator token (the service's `DIR/operator.token`).
    /// Without it, the token is read from the environment variable
    /// `RESERVOIR_OPERATOR_TOKEN` (never from a flag: the process list
    /// shows flags to everyone on the host).
    #[arg(long, value_name = "FILE", env = "RESERVOIR_OPERATOR_TOKEN_FILE")]
    pub operator_token_file: Option<PathBuf>,
}

/// The environment variable that may hold the operator token itself.
const OPERATOR_TOKEN_VAR: &str = "RESERVOIR_OPERATOR_TOKEN";

/// How a command trusts the center (operator commands and the agent).
#[derive(Debug, Clone, Args)]
pub struct CentralTrustArgs {
    /// PEM CA certificate(s) the center's TLS certificate must chain to
    /// (default: the system's roots).
    #[arg(long, value_name = "FILE", env = "RESERVOIR_CENTRAL_CA_FILE")]
    pub central_ca_file: Option<PathBuf>,
    /// INSECURE: allow an `http://` central URL that is not loopback. The
    /// operator token and the center's answers then cross the network in
    /// clear and unauthenticated: anyone on the path can read the token
    /// and forge admissions.
    #[arg(long = "insecure-http", env = "RESERVOIR_INSECURE_HTTP")]
    pub insecure_http: bool,
}

impl CentralTrustArgs {
    /// A client configuration for `url` with this trust.
    pub fn client_config(&self, url: &str) -> ClientConfig {
        let mut config = ClientConfig::new(url);
        config.ca_file = self.central_ca_file.clone();
        config.insecure_http = self.insecure_http;
        if self.insecure_http {
            tracing::warn!(
                event = "insecure_http_allowed",
                central = url,
                "plain http:// to the center is allowed: the token and answers are not protected"
            );
        }
        config
    }
}

#[derive(Debug, Args)]
pub struct EnrollArgs {
    #[command(flatten)]
    pub operator: OperatorArgs,
    /// The agent's identity, `ed25519:<64 hex digits>` (printed by
    /// `reservoir keygen --out FILE`).
    #[arg(long, value_name = "IDENTITY", conflicts_with = "key_file")]
    pub identity: Option<KeyId>,
    /// Read the identity from the agent's key file instead.
    #[arg(long, value_name = "FILE")]
    pub key_file: Option<PathBuf>,
}

#[derive(Debug, Args)]
#[group(required = true, multiple = false)]
pub struct KeygenArgs {
    /// Create the central service's shard-signing key as `DIR/central.key`.
    #[arg(long, value_name = "DIR")]
    pub data: Option<PathBuf>,
    /// Create a key file here (an agent's identity key).
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct AuditArgs {
    #[command(flatten)]
    pub operator: OperatorArgs,
    /// Print the service's JSON report instead of the table.
    #[arg(long)]
    pub json: bool,
}

/// Runs one of the commands. `audit` exits 1 on drift.
pub async fn run(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Central(CentralArgs {
            command: CentralCommand::Serve(args),
        }) => serve(args).await.map(|()| ExitCode::SUCCESS),
        Command::Central(CentralArgs {
            command: CentralCommand::Enroll(args),
        }) => enroll(args).await.map(|()| ExitCode::SUCCESS),
        Command::Central(CentralArgs {
            command: CentralCommand::Openapi,
        }) => {
            print!("{}", central::openapi::document_text());
            Ok(ExitCode::SUCCESS)
        }
        Command::Keygen(args) => keygen(&args).map(|()| ExitCode::SUCCESS),
        Command::Audit(args) => audit(args).await,
    }
}

fn init_logs(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    // Another subscriber may be installed already (by `reservoir` itself).
    let _ = match format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder.json().try_init(),
    };
}

async fn serve(args: ServeArgs) -> anyhow::Result<()> {
    init_logs(args.log_format);
    let data = DataDir::open(&args.data)?;
    let signer = data.signer()?;
    let operator_token = data.operator_token(args.operator_token_file.as_deref())?;
    let store = match args.postgres {
        Some(url) => StoreConfig::Postgres(url),
        None => StoreConfig::Redb(data.ledger_path()),
    };
    tracing::info!(key_id = %signer.key_id(), "shards are signed with this key");
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(http_serve::tls(cert, key)?),
        _ => None,
    };
    if tls.is_none() {
        if !args.listen.ip().is_loopback() && !args.insecure_http {
            bail!(
                "refusing to serve plain HTTP on {}, which is not loopback: give --tls-cert and \
                 --tls-key, or --insecure-http to accept that the operator token and the \
                 center's answers cross the network in clear",
                args.listen
            );
        }
        if args.insecure_http {
            tracing::warn!(event = "insecure_http_serving", listen = %args.listen,
                "serving plain HTTP: the operator token and every answer cross the network in clear and unauthenticated");
        }
    }
    let scheme = if tls.is_some() { "https" } else { "http" };
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let mut config = ServiceConfig::new(store, signer, operator_token);
    config.ledger.retention_ms = u64::try_from(args.retention.as_millis()).unwrap_or(u64::MAX);
    config.tls = tls;
    config.limits = args.limits.limits();
    let retention = humantime::format_duration(args.retention);
    let service = match Service::start(config, listener, Arc::new(SystemClock)).await {
        Ok(service) => service,
        Err(StartError::Retention(error)) => {
            bail!("--retention {retention} is too short for a stored policy: {error}")
        }
        Err(error) => return Err(error.into()),
    };
    tracing::info!(%retention, "finished records are forgotten after the retention window");
    let limits = args.limits.limits();
    tracing::info!(
        scheme,
        header_read_timeout = %humantime::format_duration(limits.header_read_timeout),
        idle_timeout = %humantime::format_duration(limits.idle_timeout),
        connections_max = limits.connections_max,
        "serving"
    );
    // The one line on stdout: scripts and tests wait for it.
    let mut stdout = std::io::stdout();
    writeln!(stdout, "listening on {}", service.local_addr())?;
    stdout.flush()?;
    // The store is open and the socket listens: ready. The watchdog probe
    // goes through the writer that owns the ledger.
    systemd::ready(&format!("serving on {}", service.local_addr()));
    let ledger = service.ledger().clone();
    let watchdog = tokio::spawn(systemd::watchdog(move || {
        let ledger = ledger.clone();
        async move {
            ledger
                .call(central::Operation::Gauges)
                .await
                .map(|_| ())
                .map_err(|error| error.to_string())
        }
    }));
    service
        .run_until(async {
            shutdown_signal().await;
            systemd::stopping("draining in-flight requests");
        })
        .await;
    watchdog.abort();
    Ok(())
}

/// SIGINT or SIGTERM.
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut terminate = match signal(SignalKind::terminate()) {
        Ok(terminate) => terminate,
        Err(error) => {
            tracing::error!(%error, "cannot listen for SIGTERM; only SIGINT stops the service");
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate.recv() => {}
    }
}

/// A client of `args.central` that calls as the operator.
pub fn operator_client(args: &OperatorArgs) -> anyhow::Result<CentralClient> {
    let token = match &args.operator_token_file {
        Some(file) => central_client::key_file::read_secret_file(file)?,
        None => std::env::var(OPERATOR_TOKEN_VAR).map_err(|_| {
            anyhow::anyhow!(
                "no operator token: pass --operator-token-file FILE (the service's DIR/operator.token) \
                 or set {OPERATOR_TOKEN_VAR}"
            )
        })?,
    };
    let token = token.trim();
    if token.is_empty() {
        bail!("the operator token is empty");
    }
    Ok(CentralClient::new(args.trust.client_config(&args.central))?.with_operator_token(token))
}

async fn enroll(args: EnrollArgs) -> anyhow::Result<()> {
    crate::operator_command::enroll_gateway(args.identity, args.key_file, &args.operator).await
}

fn keygen(args: &KeygenArgs) -> anyhow::Result<()> {
    let path: PathBuf = match (&args.data, &args.out) {
        (Some(dir), _) => DataDir::open(dir)?.key_path(),
        (None, Some(file)) => file.clone(),
        (None, None) => bail!("name where the key goes: --data DIR or --out FILE"),
    };
    let key_id = central_client::key_file::generate(&path)?;
    println!("{key_id}");
    eprintln!("wrote {} (mode 0600)", display(&path));
    Ok(())
}

fn display(path: &Path) -> String {
    path.display().to_string()
}

async fn audit(args: AuditArgs) -> anyhow::Result<ExitCode> {
    let client = operator_client(&args.operator)?;
    let report = client.audit().await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "{:<40} {:>5} {:<9} {:>8} {:>10} {:>10} {:>14} {:<8}",
            "SUBJECT/ROUTE",
            "GEN",
            "STATE",
            "ACCOUNTS",
            "RESERVED",
            "DEBT",
            "OPEN SHARDS",
            "BALANCED"
        );
        for pair in &report.pairs {
            let state = if pair.frozen {
                "frozen"
            } else if pair.admission_stopped {
                "stopped"
            } else {
                "admitting"
            };
            println!(
                "{:<40} {:>5} {:<9} {:>8} {:>10} {:>10} {:>14} {:<8}",
                format!("{}/{}", pair.subject, pair.route),
                pair.current_generation,
                state,
                pair.accounts,
                pair.reserved,
                pair.debt,
                format!("{} ({} u)", pair.open_shards, pair.open_shard_units),
                if pair.balanced { "yes" } else { "NO" },
            );
            // Per generation: what a rolled-back one still has to drain.
            for generation in pair.generations.iter().filter(|generation| {
                generation.policy_generation != pair.current_generation
                    && (generation.reserved > 0
                        || generation.debt > 0
                        || generation.open_shard_units > 0)
            }) {
                println!(
                    "  generation {:>5}: reserved {}, debt {}, open shard units {}",
                    generation.policy_generation,
                    generation.reserved,
                    generation.debt,
                    generation.open_shard_units
                );
            }
        }
        for violation in &report.violations {
            println!("violation: {}", violation.message);
        }
        println!(
            "audit: {}: {} accounts, {} reservations, {} shards, debt {}",
            if report.ok { "clean" } else { "DRIFT" },
            report.accounts,
            report.reservations,
            report.shards,
            report.debt
        );
    }
    Ok(if report.ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}
