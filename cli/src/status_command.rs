//! `reservoir status`: what a running agent says about itself, over its socket.
//!
//! One `GET /v1/status` over HTTP/1.1 on the agent's Unix socket (hyper's
//! client), printed as a table or, with `--json`, as the agent's JSON.
//! Exits 0 when the agent answered, 1 with a message naming the socket and
//! what failed otherwise.
//!
//! The socket is, in this order: `--socket`, the `socket` of `--config`,
//! `RESERVOIR_AGENT_SOCKET`, the `socket` of `RESERVOIR_AGENT_CONFIG`, and
//! [`DEFAULT_SOCKET`] (where the systemd units put it).

use std::fmt::Write as _;
use std::io;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;
use http_body_util::{BodyExt as _, Empty, Limited};
use hyper::body::Bytes;
use hyper::{Request, StatusCode, header};
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use tokio::net::UnixStream;

use crate::agent_command::ConfigFile;

/// Where the systemd units put the agent's socket.
pub const DEFAULT_SOCKET: &str = "/run/reservoir-agent/agent.sock";

/// How long the whole exchange may take.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);

/// Largest status answer read.
pub const ANSWER_BYTES_MAX: usize = 16 * 1024 * 1024;

/// Ask a running agent over its Unix socket for its status.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// The agent's socket (default: `RESERVOIR_AGENT_SOCKET`, then the
    /// configuration's `socket`, then /run/reservoir-agent/agent.sock).
    #[arg(long, value_name = "PATH", conflicts_with = "config")]
    pub socket: Option<PathBuf>,
    /// Take the socket from the agent's configuration file (default:
    /// `RESERVOIR_AGENT_CONFIG`).
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Print the agent's JSON as it answered instead of the table.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: StatusArgs) -> anyhow::Result<ExitCode> {
    let socket = match socket_of(&args) {
        Ok(socket) => socket,
        Err(message) => return Ok(fail(&message)),
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let answer = runtime.block_on(async {
        match tokio::time::timeout(ANSWER_TIMEOUT, fetch(&socket)).await {
            Ok(answer) => answer,
            Err(_) => Err(format!(
                "the agent on {} did not answer within {} s",
                socket.display(),
                ANSWER_TIMEOUT.as_secs()
            )),
        }
    });
    let body = match answer {
        Ok(body) => body,
        Err(message) => return Ok(fail(&message)),
    };
    if args.json {
        let value: serde_json::Value = match serde_json::from_slice(&body) {
            Ok(value) => value,
            Err(error) => return Ok(fail(&unreadable(&socket, &error))),
        };
        println!("{}", serde_json::to_string_pretty(&value)?);
        return Ok(ExitCode::SUCCESS);
    }
    match serde_json::from_slice::<Status>(&body) {
        Ok(status) => {
            print!("{}", table(&status));
            Ok(ExitCode::SUCCESS)
        }
        Err(error) => Ok(fail(&unreadable(&socket, &error))),
    }
}

fn fail(message: &str) -> ExitCode {
    eprintln!("reservoir status: {message}");
    ExitCode::FAILURE
}

fn unreadable(socket: &Path, error: &serde_json::Error) -> String {
    format!(
        "the agent on {} answered a status this reservoir cannot read ({error}); is it the same version?",
        socket.display()
    )
}

/// The socket to ask (see the module documentation).
fn socket_of(args: &StatusArgs) -> Result<PathBuf, String> {
    if let Some(socket) = &args.socket {
        return Ok(socket.clone());
    }
    if let Some(config) = &args.config {
        return socket_in(config);
    }
    if let Some(socket) = std::env::var_os("RESERVOIR_AGENT_SOCKET") {
        return Ok(PathBuf::from(socket));
    }
    if let Some(config) = std::env::var_os("RESERVOIR_AGENT_CONFIG") {
        return socket_in(Path::new(&config));
    }
    Ok(PathBuf::from(DEFAULT_SOCKET))
}

fn socket_in(config: &Path) -> Result<PathBuf, String> {
    let file = ConfigFile::load(config).map_err(|error| format!("{error:#}"))?;
    file.socket.ok_or_else(|| {
        format!(
            "the configuration {} names no `socket`; pass --socket PATH",
            config.display()
        )
    })
}

/// `GET /v1/status` on `socket`: the body of a 200, or what went wrong.
async fn fetch(socket: &Path) -> Result<Bytes, String> {
    let shown = socket.display();
    let stream = UnixStream::connect(socket)
        .await
        .map_err(|error| match error.kind() {
            io::ErrorKind::NotFound => format!(
                "no agent is listening on {shown} (no such socket); is reservoir-agent running? (systemctl status reservoir-agent)"
            ),
            io::ErrorKind::ConnectionRefused => format!(
                "no agent is listening on {shown} (connection refused); is reservoir-agent running? (systemctl status reservoir-agent)"
            ),
            io::ErrorKind::PermissionDenied => format!(
                "permission denied on {shown}: the socket is for the agent's user and group (`reservoir`); run as a member of that group"
            ),
            _ => format!("cannot connect to the agent on {shown}: {error}"),
        })?;
    let (mut sender, connection) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|error| format!("cannot speak HTTP/1.1 with the agent on {shown}: {error}"))?;
    let connection = tokio::spawn(connection);
    let request = Request::get("/v1/status")
        .header(header::HOST, "reservoir-agent")
        .header(header::ACCEPT, "application/json")
        .body(Empty::<Bytes>::new())
        .map_err(|error| format!("cannot build the request: {error}"))?;
    let response = sender
        .send_request(request)
        .await
        .map_err(|error| format!("the agent on {shown} did not answer: {error}"))?;
    let status = response.status();
    let body = Limited::new(response.into_body(), ANSWER_BYTES_MAX)
        .collect()
        .await
        .map_err(|error| format!("cannot read the agent's answer on {shown}: {error}"))?
        .to_bytes();
    connection.abort();
    if status != StatusCode::OK {
        return Err(format!(
            "the agent on {shown} answered {status}: {}",
            String::from_utf8_lossy(&body).trim()
        ));
    }
    Ok(body)
}

/// The parts of `GET /v1/status` the table shows (agent/src/socket.rs
/// `status_json`); members added later are ignored.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Status {
    mode: String,
    identity: String,
    boot_epoch: Option<u64>,
    #[serde(default)]
    pairs: Vec<PairStatus>,
    #[serde(default)]
    shards: Vec<ShardStatus>,
    /// Absent from agents that listed closed shards in `shards`.
    #[serde(default)]
    shards_closed: Option<u64>,
    pending_sync: u64,
    pending_receipts: u64,
    reservations_in_flight: u64,
    /// Absent from agents older than retention.
    #[serde(default)]
    reservations_held: Option<u64>,
    #[serde(default)]
    reservations_retained: Option<u64>,
    #[serde(default)]
    journal_bytes: Option<u64>,
    /// Why the center cannot be reached or trusted (absent from older
    /// agents; null while it answers).
    #[serde(default)]
    central_error: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PairStatus {
    subject: String,
    route: String,
    partitioned: bool,
    consecutive_failures: u64,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ShardStatus {
    shard: String,
    subject: String,
    route: String,
    fence: u64,
    boot_epoch: u64,
    terms: ShardTerms,
    overdraft_debt: u64,
    closed: bool,
}

#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ShardTerms {
    allocated: u64,
    local_available: u64,
    local_reserved: u64,
    local_spent: u64,
    local_retired: u64,
}

fn table(status: &Status) -> String {
    let mut out = String::new();
    let boot = status.boot_epoch.map_or_else(
        || "not registered (the central ledger has not been reached this boot)".to_owned(),
        |epoch| epoch.to_string(),
    );
    let _ = writeln!(out, "mode:               {}", status.mode);
    let _ = writeln!(out, "identity:           {}", status.identity);
    let _ = writeln!(out, "boot epoch:         {boot}");
    if let Some(error) = &status.central_error {
        let _ = writeln!(out, "central:            UNREACHABLE: {error}");
    }
    let _ = writeln!(
        out,
        "pending sync:       {} reservations, {} terminal receipts",
        status.pending_sync, status.pending_receipts
    );
    let _ = writeln!(out, "open reservations:  {}", status.reservations_in_flight);
    if let (Some(held), Some(retained)) = (status.reservations_held, status.reservations_retained) {
        let _ = writeln!(
            out,
            "held in memory:     {held} reservations, {retained} of them terminal (kept for the retention window)"
        );
    }
    if let Some(bytes) = status.journal_bytes {
        let _ = writeln!(
            out,
            "journal on disk:    {bytes} bytes ({:.1} MiB)",
            bytes as f64 / (1024.0 * 1024.0)
        );
    }
    if !status.pairs.is_empty() {
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "{:<48} {:<12} {:>8}",
            "SUBJECT/ROUTE", "MODE", "FAILURES"
        );
        for pair in &status.pairs {
            let _ = writeln!(
                out,
                "{:<48} {:<12} {:>8}",
                format!("{}/{}", pair.subject, pair.route),
                if pair.partitioned {
                    "partitioned"
                } else {
                    "healthy"
                },
                pair.consecutive_failures
            );
        }
    }
    if let Some(closed) = status.shards_closed {
        let _ = writeln!(
            out,
            "closed shards:      {closed} (kept for the retention window; GET /v1/shards lists them)"
        );
    }
    let _ = writeln!(out);
    if status.shards.is_empty() {
        let _ = writeln!(out, "shards: none open");
        return out;
    }
    let _ = writeln!(
        out,
        "{:<20} {:<32} {:>6} {:>5} {:>10} {:>10} {:>10} {:>10} {:>10} {:>8} {:<6}",
        "SHARD",
        "SUBJECT/ROUTE",
        "FENCE",
        "BOOT",
        "ALLOCATED",
        "AVAILABLE",
        "RESERVED",
        "SPENT",
        "RETIRED",
        "DEBT",
        "STATE"
    );
    for shard in &status.shards {
        let terms = &shard.terms;
        let _ = writeln!(
            out,
            "{:<20} {:<32} {:>6} {:>5} {:>10} {:>10} {:>10} {:>10} {:>10} {:>8} {:<6}",
            shard.shard,
            format!("{}/{}", shard.subject, shard.route),
            shard.fence,
            shard.boot_epoch,
            terms.allocated,
            terms.local_available,
            terms.local_reserved,
            terms.local_spent,
            terms.local_retired,
            shard.overdraft_debt,
            if shard.closed { "closed" } else { "open" },
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_shows_every_term_of_every_shard() {
        let status: Status = serde_json::from_value(serde_json::json!({
            "mode": "partitioned",
            "identity": "ed25519:ab",
            "bootEpoch": 4,
            "pairs": [{"subject": "tenant-7", "route": "chat.generate", "partitioned": true, "consecutiveFailures": 3}],
            "shards": [{
                "shard": "shard-1", "subject": "tenant-7", "route": "chat.generate",
                "fence": 9, "bootEpoch": 4,
                "terms": {"allocated": 100, "localAvailable": 60, "localReserved": 25, "localSpent": 10, "localRetired": 5},
                "overdraftDebt": 0, "closed": false, "usableUntilMs": 1
            }],
            "pendingSync": 2, "pendingReceipts": 1, "reservationsInFlight": 3, "shares": []
        }))
        .expect("the agent's status");
        let table = table(&status);
        assert!(table.contains("mode:               partitioned"), "{table}");
        assert!(table.contains("boot epoch:         4"), "{table}");
        assert!(
            table.contains("2 reservations, 1 terminal receipts"),
            "{table}"
        );
        let shard = table
            .lines()
            .find(|line| line.starts_with("shard-1"))
            .expect("the shard's row");
        let numbers: Vec<&str> = shard.split_whitespace().collect();
        assert_eq!(
            numbers,
            [
                "shard-1",
                "tenant-7/chat.generate",
                "9",
                "4",
                "100",
                "60",
                "25",
                "10",
                "5",
                "0",
                "open"
            ]
        );
    }

    #[test]
    fn retained_reservations_closed_shards_and_the_journal_size_are_shown_when_the_agent_says_them()
    {
        let base = serde_json::json!({
            "mode": "healthy", "identity": "ed25519:ab", "bootEpoch": 1,
            "pendingSync": 0, "pendingReceipts": 0, "reservationsInFlight": 2
        });
        let old: Status = serde_json::from_value(base.clone()).expect("an older agent's status");
        let table_old = table(&old);
        assert!(!table_old.contains("held in memory"), "{table_old}");
        assert!(!table_old.contains("journal on disk"), "{table_old}");
        assert!(!table_old.contains("closed shards"), "{table_old}");
        let mut new = base;
        new["shardsClosed"] = 144.into();
        new["reservationsHeld"] = 7.into();
        new["reservationsRetained"] = 5.into();
        new["journalBytes"] = 2_097_152.into();
        let new: Status = serde_json::from_value(new).expect("the agent's status");
        let table = table(&new);
        assert!(
            table.contains("held in memory:     7 reservations, 5 of them terminal"),
            "{table}"
        );
        assert!(
            table.contains("journal on disk:    2097152 bytes (2.0 MiB)"),
            "{table}"
        );
        assert!(
            table.contains("closed shards:      144 (kept for the retention window"),
            "{table}"
        );
        assert!(table.contains("shards: none open"), "{table}");
    }
}
