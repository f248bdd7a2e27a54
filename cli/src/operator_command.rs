//! `reservoir policy|gateway|pair …`: the operator's commands against a
//! running central service — publish, read and roll back a pair's policy,
//! enrol an agent's identity, freeze and unfreeze a pair.
//!
//! Each takes the service's URL from `--central` (or
//! `RESERVOIR_CENTRAL_URL`) and the operator token from
//! `--operator-token-file` (or `RESERVOIR_OPERATOR_TOKEN_FILE`) or from the
//! variable `RESERVOIR_OPERATOR_TOKEN` — never from a flag, which anyone on
//! the host could read in the process list.

use std::io::Read as _;
use std::path::PathBuf;

use anyhow::{Context as _, bail};
use central_client::CentralClient;
use clap::{Args, Subcommand};
use ledger::protocol::views::AccountsResponse;
use shard_format::{AdmissionBudgetV1, DocumentSigner as _, KeyId, Route, Subject};

use crate::central_command::{OperatorArgs, operator_client};

/// The operator's commands, to flatten into `reservoir`'s.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Publish, read or roll back a pair's policy (`admissionBudget.v1`).
    #[command(subcommand)]
    Policy(PolicyCommand),
    /// Enrol gateways: an agent's identity may then reserve, boot and take
    /// shards.
    #[command(subcommand)]
    Gateway(GatewayCommand),
    /// Freeze or unfreeze a pair: a frozen pair admits nothing until an
    /// operator unfreezes it.
    #[command(subcommand)]
    Pair(PairCommand),
}

#[derive(Debug, Subcommand)]
pub enum PolicyCommand {
    /// Validate a policy file locally, publish it, and print the account it
    /// opened.
    #[command(after_help = "Examples:\n  \
        reservoir policy publish examples/policies/tenant-7-chat.json \\\n      \
        --central https://central.example:7070 --operator-token-file /etc/reservoir/operator.token\n  \
        cat policy.json | RESERVOIR_OPERATOR_TOKEN=… reservoir policy publish - --central …\n\n\
        The generation must rise: publishing generation N + 1 stops admission under N at once\n\
        (its reservations still settle). Examples live in examples/policies/.")]
    Publish(PublishArgs),
    /// Print a pair's current policy, its state (frozen, stopped, debt) and
    /// its accounts.
    #[command(after_help = "Example:\n  \
        reservoir policy get tenant-7 chat.generate --central https://central.example:7070\n\n\
        --json prints the whole view (`GET /v1/accounts/{subject}/{route}`).")]
    Get(PairArgs),
    /// Stop admission under the pair's current generation (the rollback
    /// switch), or resume it with `--resume`; settlement, debt and
    /// reconciliation go on.
    #[command(after_help = "Examples:\n  \
        reservoir policy rollback tenant-7 chat.generate --central …   # stop admitting under the current generation\n  \
        reservoir policy rollback tenant-7 chat.generate --resume --central …\n\n\
        To roll forward instead, publish a corrected policy at the next generation.")]
    Rollback(RollbackArgs),
}

#[derive(Debug, Subcommand)]
pub enum GatewayCommand {
    /// Enrol an agent's identity (`ed25519:<64 hex digits>`, printed by
    /// `reservoir keygen --out FILE`).
    #[command(after_help = "Examples:\n  \
        reservoir gateway enroll ed25519:3b6a27bc… --central https://central.example:7070\n  \
        reservoir gateway enroll --key-file /var/lib/reservoir-agent/identity.key --central …")]
    Enroll(GatewayEnrollArgs),
}

#[derive(Debug, Subcommand)]
pub enum PairCommand {
    /// Freeze a pair: it admits nothing (reservations and shards) until
    /// unfrozen.
    #[command(after_help = "Example:\n  \
        reservoir pair freeze tenant-7 chat.generate --central https://central.example:7070")]
    Freeze(PairArgs),
    /// Unfreeze a pair (a breach froze it, or an operator did).
    #[command(after_help = "Example:\n  \
        reservoir pair unfreeze tenant-7 chat.generate --central https://central.example:7070")]
    Unfreeze(PairArgs),
}

#[derive(Debug, Args)]
pub struct PublishArgs {
    /// The policy file (`admissionBudget.v1` JSON), or `-` for stdin.
    #[arg(value_name = "FILE|-")]
    pub file: PathBuf,
    #[command(flatten)]
    pub operator: OperatorArgs,
}

#[derive(Debug, Args)]
pub struct PairArgs {
    /// The pair's subject (a tenant), e.g. `tenant-7`.
    pub subject: Subject,
    /// The pair's route, e.g. `chat.generate`.
    pub route: Route,
    /// Print the central service's JSON answer instead of a summary.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub operator: OperatorArgs,
}

#[derive(Debug, Args)]
pub struct RollbackArgs {
    #[command(flatten)]
    pub pair: PairArgs,
    /// Resume admission instead of stopping it.
    #[arg(long)]
    pub resume: bool,
    /// The generation to stop; the command refuses if it is not the
    /// current one (default: the current one, read first).
    #[arg(long, value_name = "N")]
    pub generation: Option<u64>,
}

#[derive(Debug, Args)]
pub struct GatewayEnrollArgs {
    /// The agent's identity, `ed25519:<64 hex digits>`.
    #[arg(value_name = "IDENTITY", required_unless_present = "key_file")]
    pub identity: Option<KeyId>,
    /// Read the identity from the agent's key file instead.
    #[arg(long, value_name = "FILE", conflicts_with = "identity")]
    pub key_file: Option<PathBuf>,
    #[command(flatten)]
    pub operator: OperatorArgs,
}

pub async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Policy(PolicyCommand::Publish(args)) => publish(args).await,
        Command::Policy(PolicyCommand::Get(args)) => get(args).await,
        Command::Policy(PolicyCommand::Rollback(args)) => rollback(args).await,
        Command::Gateway(GatewayCommand::Enroll(args)) => enroll(args).await,
        Command::Pair(PairCommand::Freeze(args)) => set_frozen(args, true).await,
        Command::Pair(PairCommand::Unfreeze(args)) => set_frozen(args, false).await,
    }
}

/// Reads and validates a policy document exactly as the service will.
fn read_policy(file: &PathBuf) -> anyhow::Result<AdmissionBudgetV1> {
    let (bytes, name) = if file.as_os_str() == "-" {
        let mut bytes = Vec::new();
        std::io::stdin()
            .read_to_end(&mut bytes)
            .context("reading the policy from stdin")?;
        (bytes, "stdin".to_owned())
    } else {
        let bytes = std::fs::read(file)
            .with_context(|| format!("reading the policy file {}", file.display()))?;
        (bytes, file.display().to_string())
    };
    shard_format::parse(&bytes).with_context(|| format!("{name} is not a valid policy"))
}

async fn publish(args: PublishArgs) -> anyhow::Result<()> {
    let policy = read_policy(&args.file)?;
    let client = operator_client(&args.operator)?;
    let published = client.publish_policy(&policy).await.with_context(|| {
        format!(
            "publishing {}/{} generation {}",
            policy.subject, policy.route, policy.policy_generation
        )
    })?;
    println!(
        "published {}/{} generation {}",
        published.subject, published.route, published.policy_generation
    );
    let view = accounts(&client, &policy.subject, &policy.route).await?;
    if let Some(account) = view
        .accounts
        .iter()
        .rev()
        .find(|account| account.policy_generation == published.policy_generation)
    {
        let terms = &account.terms;
        println!(
            "account {} generation {}: opening {}, available {}, reserved {}, debt {}",
            account.accounting_epoch,
            account.policy_generation,
            terms.opening,
            terms.available,
            terms.reserved,
            account.debt
        );
    }
    Ok(())
}

async fn accounts(
    client: &CentralClient,
    subject: &Subject,
    route: &Route,
) -> anyhow::Result<AccountsResponse> {
    client
        .accounts(subject, route)
        .await
        .with_context(|| format!("reading {subject}/{route}"))
}

async fn get(args: PairArgs) -> anyhow::Result<()> {
    let client = operator_client(&args.operator)?;
    let view = accounts(&client, &args.subject, &args.route).await?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&view)?);
        return Ok(());
    }
    println!(
        "{}",
        String::from_utf8(shard_format::canonical_bytes(view.policy.as_ref()))?
    );
    println!(
        "{}/{}: generation {}{}{}, debt {}",
        view.subject,
        view.route,
        view.current_generation,
        if view.admission_stopped {
            ", admission stopped"
        } else {
            ""
        },
        if view.frozen { ", frozen" } else { "" },
        view.debt
    );
    for account in &view.accounts {
        let terms = &account.terms;
        println!(
            "  account {} generation {}: available {}, reserved {}, spent {}, retired {}, debt {}",
            account.accounting_epoch,
            account.policy_generation,
            terms.available,
            terms.reserved,
            terms.spent,
            terms.retired_for_emergency,
            account.debt
        );
    }
    Ok(())
}

async fn rollback(args: RollbackArgs) -> anyhow::Result<()> {
    let pair = &args.pair;
    let client = operator_client(&pair.operator)?;
    let current = accounts(&client, &pair.subject, &pair.route)
        .await?
        .current_generation;
    let generation = args.generation.unwrap_or(current);
    if generation != current {
        bail!(
            "{}/{}: generation {generation} is not the current one ({current}); only the current generation's admission can be stopped or resumed",
            pair.subject,
            pair.route
        );
    }
    let stopped = !args.resume;
    let answer = client
        .set_admission_stopped(&pair.subject, &pair.route, generation, stopped)
        .await
        .with_context(|| format!("{}/{}", pair.subject, pair.route))?;
    let state = if stopped { "stopped" } else { "resumed" };
    if pair.json {
        println!("{}", serde_json::to_string_pretty(&answer)?);
    } else if answer.changed {
        println!(
            "{}/{} generation {generation}: admission {state}",
            pair.subject, pair.route
        );
    } else {
        println!(
            "{}/{} generation {generation}: admission was {state} already",
            pair.subject, pair.route
        );
    }
    Ok(())
}

async fn enroll(args: GatewayEnrollArgs) -> anyhow::Result<()> {
    enroll_gateway(args.identity, args.key_file, &args.operator).await
}

/// Enrols `identity`, or the identity of the agent's key file.
pub async fn enroll_gateway(
    identity: Option<KeyId>,
    key_file: Option<PathBuf>,
    operator: &OperatorArgs,
) -> anyhow::Result<()> {
    let identity = match (identity, key_file) {
        (Some(identity), _) => identity,
        (None, Some(file)) => central_client::key_file::load(&file)?.key_id().clone(),
        (None, None) => bail!("name the agent: its identity, or --key-file FILE"),
    };
    let client = operator_client(operator)?;
    let response = client.enroll_gateway(&identity).await?;
    if response.enrolled {
        println!("enrolled {identity}");
    } else {
        println!("{identity} was enrolled already");
    }
    Ok(())
}

async fn set_frozen(args: PairArgs, frozen: bool) -> anyhow::Result<()> {
    let client = operator_client(&args.operator)?;
    let answer = client
        .set_frozen(&args.subject, &args.route, frozen)
        .await
        .with_context(|| format!("{}/{}", args.subject, args.route))?;
    let state = if frozen { "frozen" } else { "unfrozen" };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&answer)?);
    } else if answer.changed {
        println!("{}/{}: {state}", args.subject, args.route);
    } else {
        println!("{}/{}: {state} already", args.subject, args.route);
    }
    Ok(())
}
