//! `reservoir demo`: the seed's story (docs/design.md §1 and §4.7), walked by
//! real processes — one central service and three agents, one per gateway,
//! on a temporary directory — with a table at every step and a check of what
//! must have happened. The demo exits 0 only if every check held, and
//! otherwise names the first one that did not, keeping the directory (with
//! every process's log) for inspection.
//!
//! The numbers are chosen so that nothing depends on timing: generation 1
//! opens at its burst (1000), so refills mint nothing until units are
//! spent, and the demo waits for the refill it needs instead of racing
//! it; generation 2 has no refill, so every change in it is the shards'.

use std::fmt::Display;
use std::process::{ExitCode, Stdio};
use std::time::{Duration, Instant};

use agent_core::JournalRecord;
use anyhow::{Context as _, bail, ensure};
use central_client::wire::AccountView;
use clap::Args;
use reservoir::cluster::{AgentOptions, AgentResponse, Cluster, ClusterOptions, wait_until};
use serde_json::Value;
use shard_format::{EmergencyMode, Refill};

/// Start a real central service and three real agents on temporary
/// directories and walk the seed's story.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Keep the temporary directory (data, sockets, logs) afterwards; it is
    /// always kept when a step fails.
    #[arg(long)]
    pub keep: bool,
}

const SUBJECT: &str = "tenant-7";
const ROUTE: &str = "chat.generate";
const GATEWAYS: [&str; 3] = ["A", "B", "C"];
/// The dimensions of one tenant and model (docs/design.md §3.13): route,
/// opening, largest reservation.
const LLM_ROUTES: [(&str, u64, u64); 3] = [
    ("gpt-4o.requests", 600, 1),
    ("gpt-4o.tokens", 3000, 2500),
    ("gpt-4o.concurrency", 1, 1),
];
/// Longest wait for a refill, a shard, a partition to be noticed …
const WAIT: Duration = Duration::from_secs(20);

pub fn run(args: DemoArgs) -> anyhow::Result<ExitCode> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(demo(args))
}

async fn demo(args: DemoArgs) -> anyhow::Result<ExitCode> {
    let started = Instant::now();
    let binary = std::env::current_exe().context("cannot find the reservoir binary")?;
    println!("Reservoir demo: the seed's story on real processes\n");
    let options = ClusterOptions {
        // A generous call deadline (a loaded machine may take a while to
        // commit); the partition here is a stopped process, refused at once.
        agent: AgentOptions {
            central_call_ms: 5000,
            retry_interval_ms: 50,
        },
        ..ClusterOptions::new(binary, GATEWAYS.len())
    };
    let cluster = match Cluster::start(options).await {
        Ok(cluster) => cluster,
        Err(error) => {
            println!("FAILED before the story began: {error}");
            return Ok(ExitCode::FAILURE);
        }
    };
    let mut story = Story {
        cluster,
        step: 0,
        title: "setting up".to_owned(),
    };
    story.introduce();
    let outcome = story.walk().await;
    match outcome {
        Ok(()) => {
            let _ = story.cluster.stop().await;
            println!(
                "\nAll {} steps happened as the seed's story says ({:.1} s).",
                story.step,
                started.elapsed().as_secs_f64()
            );
            if args.keep {
                println!("Kept {}", story.cluster.keep().display());
            }
            Ok(ExitCode::SUCCESS)
        }
        Err(error) => {
            let dir = story.cluster.keep();
            println!(
                "\nFAILED at step {} ({}): {error:#}",
                story.step, story.title
            );
            println!(
                "Logs kept in {}: central.log, agent-*/agent.log",
                dir.display()
            );
            Ok(ExitCode::FAILURE)
        }
    }
}

/// The cluster and where the story is.
#[derive(Debug)]
struct Story {
    cluster: Cluster,
    step: usize,
    title: String,
}

/// Prints rows with aligned columns; numbers are right-aligned.
fn table(header: &[&str], rows: &[Vec<String>]) {
    let columns = header.len();
    let mut widths: Vec<usize> = header.iter().map(|cell| cell.chars().count()).collect();
    for row in rows {
        for (index, cell) in row.iter().enumerate().take(columns) {
            widths[index] = widths[index].max(cell.chars().count());
        }
    }
    let numeric: Vec<bool> = (0..columns)
        .map(|index| {
            rows.iter().all(|row| {
                row.get(index)
                    .is_some_and(|cell| cell.parse::<u64>().is_ok() || cell == "-")
            })
        })
        .collect();
    let line = |cells: Vec<&str>| {
        let text: Vec<String> = cells
            .iter()
            .enumerate()
            .map(|(index, cell)| {
                if numeric[index] {
                    format!("{cell:>width$}", width = widths[index])
                } else {
                    format!("{cell:<width$}", width = widths[index])
                }
            })
            .collect();
        println!("    {}", text.join("  ").trim_end());
    };
    line(header.to_vec());
    let rules: Vec<String> = widths.iter().map(|width| "-".repeat(*width)).collect();
    line(rules.iter().map(String::as_str).collect());
    for row in rows {
        line(row.iter().map(String::as_str).collect());
    }
}

fn gateway(index: usize) -> &'static str {
    GATEWAYS[index]
}

/// The state an answer reports, or its error code.
fn outcome(answer: &AgentResponse) -> String {
    answer
        .state()
        .or(answer.error().map(|code| code.as_str()))
        .unwrap_or("")
        .to_owned()
}

/// `200 RESERVED`, for tables without an HTTP column.
fn answer_summary(answer: &AgentResponse) -> String {
    format!("{} {}", answer.status, outcome(answer))
}

fn short(id: &str) -> String {
    if id.chars().count() > 22 {
        format!("{}…", id.chars().take(21).collect::<String>())
    } else {
        id.to_owned()
    }
}

fn equation(account: &AccountView) -> String {
    let t = account.terms;
    format!(
        "{} + {} + {} = {} + {} + {} + {} + {}",
        t.opening,
        t.minted,
        t.overdraft_issued,
        t.available,
        t.reserved,
        t.spent,
        t.retired_for_emergency,
        t.overdraft_repaid
    )
}

fn balanced(account: &AccountView) -> bool {
    let t = account.terms;
    t.opening + t.minted + t.overdraft_issued
        == t.available + t.reserved + t.spent + t.retired_for_emergency + t.overdraft_repaid
}

/// `allocated = available + reserved + spent + retired` of a shard in an
/// agent's status.
fn shard_equation(shard: &Value) -> String {
    let terms = &shard["terms"];
    format!(
        "{} = {} + {} + {} + {}",
        terms["allocated"],
        terms["localAvailable"],
        terms["localReserved"],
        terms["localSpent"],
        terms["localRetired"]
    )
}

impl Story {
    fn introduce(&self) {
        let central = self.cluster.central();
        let mut rows = vec![vec![
            "central ledger".to_owned(),
            central.pid().map_or("-".into(), |pid| pid.to_string()),
            central.url(),
        ]];
        for (index, agent) in self.cluster.agents().iter().enumerate() {
            rows.push(vec![
                format!("gateway {} agent", gateway(index)),
                agent.pid().map_or("-".into(), |pid| pid.to_string()),
                agent.socket_path().display().to_string(),
            ]);
        }
        table(&["process", "pid", "listens on"], &rows);
        println!("    (logs and data under {})", self.cluster.dir().display());
    }

    fn begin(&mut self, title: &str) {
        self.step += 1;
        self.title = title.to_owned();
        println!("\n{}. {title}", self.step);
    }

    fn say(&self, text: impl Display) {
        println!("    {text}");
    }

    fn check(&self, holds: bool, what: impl Display) -> anyhow::Result<()> {
        ensure!(holds, "expected: {what}");
        println!("    ok: {what}");
        Ok(())
    }

    fn client(&self, index: usize) -> reservoir::cluster::AgentClient {
        self.cluster.agent(index).client()
    }

    /// The account of `generation`, printed with its equation.
    async fn account(&self, generation: u64) -> anyhow::Result<AccountView> {
        let view = self.cluster.central().accounts(SUBJECT, ROUTE).await?;
        view.accounts
            .into_iter()
            .find(|account| account.policy_generation == generation)
            .with_context(|| format!("no account of generation {generation}"))
    }

    fn show_accounts(&self, accounts: &[&AccountView]) {
        let rows: Vec<Vec<String>> = accounts
            .iter()
            .map(|account| {
                let t = account.terms;
                vec![
                    account.policy_generation.to_string(),
                    t.opening.to_string(),
                    t.minted.to_string(),
                    t.overdraft_issued.to_string(),
                    t.available.to_string(),
                    t.reserved.to_string(),
                    t.spent.to_string(),
                    t.retired_for_emergency.to_string(),
                    t.overdraft_repaid.to_string(),
                    account.debt.to_string(),
                ]
            })
            .collect();
        table(
            &[
                "generation",
                "opening",
                "minted",
                "overdraftIssued",
                "available",
                "reserved",
                "spent",
                "retired",
                "overdraftRepaid",
                "debt",
            ],
            &rows,
        );
        for account in accounts {
            self.say(format!(
                "generation {}: {}{}",
                account.policy_generation,
                equation(account),
                if balanced(account) {
                    ""
                } else {
                    "   DOES NOT HOLD"
                }
            ));
        }
    }

    /// Waits until the account of `generation` satisfies `condition`.
    async fn wait_for_account(
        &self,
        what: &str,
        generation: u64,
        condition: impl Fn(&AccountView) -> bool,
    ) -> anyhow::Result<AccountView> {
        let central = self.cluster.central();
        let account = wait_until(what, WAIT, || async {
            let view = central.accounts(SUBJECT, ROUTE).await?;
            Ok(view
                .accounts
                .into_iter()
                .find(|account| account.policy_generation == generation && condition(account)))
        })
        .await?;
        Ok(account)
    }

    async fn walk(&mut self) -> anyhow::Result<()> {
        self.open().await?;
        let (admitted, id) = self.three_gateways().await?;
        self.retry_after_timeout(admitted, &id).await?;
        self.settle_actual(admitted, &id).await?;
        self.overage_becomes_debt().await?;
        self.refill_repays_debt().await?;
        self.enable_shards().await?;
        let unknown = self.partition().await?;
        self.admit_from_shards().await?;
        let unknown_c = self.restart_partitioned().await?;
        self.central_returns([unknown, unknown_c].concat()).await?;
        self.one_request_three_limits().await?;
        self.receipts_exactly_once().await?;
        self.final_audit().await?;
        Ok(())
    }

    async fn open(&mut self) -> anyhow::Result<()> {
        self.begin("A tenant has 1000 tokens");
        let mut policy = reservoir::cluster::policy(SUBJECT, ROUTE, 1);
        policy.overdraft_units_max = 200;
        self.cluster.central().publish(&policy).await?;
        self.say(format!(
            "policy {SUBJECT}/{ROUTE}, generation 1: opening {}, burst {}, refill {} per second,",
            policy.opening, policy.burst, policy.refill.units
        ));
        self.say(format!(
            "largest reservation {}, overdraft up to {}, emergency shards off",
            policy.reservation_units_max, policy.overdraft_units_max
        ));
        let account = self.account(1).await?;
        self.show_accounts(&[&account]);
        self.check(
            account.terms.available == 1000 && balanced(&account),
            "1000 available; the equation holds",
        )
    }

    /// Returns the admitted gateway's index and its reservation ID.
    async fn three_gateways(&mut self) -> anyhow::Result<(usize, String)> {
        self.begin("Three gateways each see 1000 left and reserve 600 at once");
        let clients = [self.client(0), self.client(1), self.client(2)];
        let (a, b, c) = tokio::join!(
            clients[0].reserve("story-a", SUBJECT, ROUTE, 600),
            clients[1].reserve("story-b", SUBJECT, ROUTE, 600),
            clients[2].reserve("story-c", SUBJECT, ROUTE, 600),
        );
        let answers = [a?, b?, c?];
        let rows: Vec<Vec<String>> = answers
            .iter()
            .enumerate()
            .map(|(index, answer)| {
                vec![
                    gateway(index).to_owned(),
                    answer.status.to_string(),
                    answer
                        .state()
                        .map(str::to_owned)
                        .or_else(|| {
                            answer.body["dimension"]
                                .as_str()
                                .map(|d| format!("rejected: {d}"))
                        })
                        .unwrap_or_default(),
                    answer.retry_after.clone().unwrap_or_else(|| "-".into()),
                    answer.reservation().map(short).unwrap_or_default(),
                ]
            })
            .collect();
        table(
            &["gateway", "HTTP", "outcome", "Retry-After", "reservation"],
            &rows,
        );
        let admitted: Vec<usize> = (0..3).filter(|i| answers[*i].status == 201).collect();
        let rejected: Vec<usize> = (0..3)
            .filter(|i| answers[*i].status == 429 && answers[*i].retry_after.is_some())
            .collect();
        self.check(
            admitted.len() == 1 && rejected.len() == 2,
            "exactly one admitted (201); two refused with 429 and a Retry-After",
        )?;
        let admitted = admitted[0];
        let id = answers[admitted]
            .reservation()
            .context("the 201 names no reservation")?
            .to_owned();
        let account = self.account(1).await?;
        self.show_accounts(&[&account]);
        self.check(
            account.terms.available == 400 && account.terms.reserved == 600,
            "the ledger linearized them: 400 available, 600 reserved, never oversold",
        )?;
        Ok((admitted, id))
    }

    async fn retry_after_timeout(&mut self, admitted: usize, id: &str) -> anyhow::Result<()> {
        self.begin(&format!(
            "Gateway {}'s request starts (op-1); its client times out and retries",
            gateway(admitted)
        ));
        let client = self.client(admitted);
        let started = client.start(id, "op-1").await?;
        let key = format!("story-{}", gateway(admitted).to_lowercase());
        let retried = client.reserve(&key, SUBJECT, ROUTE, 600).await?;
        table(
            &["call", "HTTP", "state", "reservation"],
            &[
                vec![
                    "start op-1".into(),
                    started.status.to_string(),
                    started.state().unwrap_or("").into(),
                    started.reservation().map(short).unwrap_or_default(),
                ],
                vec![
                    format!("reserve again, key {key}"),
                    retried.status.to_string(),
                    retried.state().unwrap_or("").into(),
                    retried.reservation().map(short).unwrap_or_default(),
                ],
            ],
        );
        self.check(
            started.status == 200 && started.state() == Some("STARTED"),
            "STARTED, bound to op-1",
        )?;
        self.check(
            retried.status == 200 && retried.reservation() == Some(id),
            "the same idempotency key returns the same reservation (200, not a new 201)",
        )?;
        let account = self.account(1).await?;
        self.check(
            account.terms.reserved == 600,
            "still 600 reserved: nothing was reserved twice",
        )
    }

    async fn settle_actual(&mut self, admitted: usize, id: &str) -> anyhow::Result<()> {
        self.begin("The executor used 200: settle refunds 400, exactly once");
        let client = self.client(admitted);
        let settled = client.settle(id, "op-1", 200).await?;
        let again = client.settle(id, "op-1", 200).await?;
        let receipt = |answer: &AgentResponse| answer.body["settlement"].clone();
        table(
            &["call", "HTTP", "state", "actual", "refunded", "overdraft"],
            &[&settled, &again]
                .iter()
                .zip(["settle op-1, 200", "the same settle (ACK lost)"])
                .map(|(answer, call)| {
                    let settlement = receipt(answer);
                    vec![
                        call.to_owned(),
                        answer.status.to_string(),
                        answer.state().unwrap_or("").into(),
                        settlement["actualUnits"].to_string(),
                        settlement["refundedUnits"].to_string(),
                        settlement["overdraftUnits"].to_string(),
                    ]
                })
                .collect::<Vec<_>>(),
        );
        self.check(
            settled.status == 200
                && settled.state() == Some("SETTLED")
                && receipt(&settled)["refundedUnits"] == 400,
            "SETTLED with 400 refunded",
        )?;
        self.check(
            again.status == 200 && receipt(&again) == receipt(&settled),
            "the repeated settle returns the first settlement receipt",
        )?;
        let account = self.account(1).await?;
        self.show_accounts(&[&account]);
        let t = account.terms;
        if t.minted > 0 {
            self.say(format!("(a refill tick minted {} meanwhile)", t.minted));
        }
        self.check(
            t.spent == 200
                && t.reserved == 0
                && t.available == 800 + t.minted
                && balanced(&account),
            "available 800, reserved 0, spent 200: 1000 = 800 + 0 + 200 + 0 + 0",
        )
    }

    async fn overage_becomes_debt(&mut self) -> anyhow::Result<()> {
        self.begin("An overage becomes debt, and debt stops admission");
        let account = self
            .wait_for_account("the refill brings available back to 1000", 1, |account| {
                account.terms.available == 1000
            })
            .await?;
        self.say(format!(
            "refills brought available back to 1000 (minted {}); no refill fits while available + reserved = burst",
            account.terms.minted
        ));
        let b = self.client(1);
        let reserved = b.reserve("big-job", SUBJECT, ROUTE, 500).await?;
        let id = reserved.reservation().unwrap_or("").to_owned();
        let started = b.start(&id, "op-2").await?;
        let settled = b.settle(&id, "op-2", 1100).await?;
        let c = self.client(2);
        let refused = c.reserve("after-debt", SUBJECT, ROUTE, 50).await?;
        table(
            &["gateway", "call", "HTTP", "outcome"],
            &[
                vec![
                    "B".into(),
                    "reserve 500".into(),
                    reserved.status.to_string(),
                    outcome(&reserved),
                ],
                vec![
                    "B".into(),
                    "start op-2".into(),
                    started.status.to_string(),
                    outcome(&started),
                ],
                vec![
                    "B".into(),
                    "settle: actually used 1100".into(),
                    settled.status.to_string(),
                    format!(
                        "{} (overdraft {})",
                        settled.state().unwrap_or(""),
                        settled.body["settlement"]["overdraftUnits"]
                    ),
                ],
                vec![
                    "C".into(),
                    "reserve 50".into(),
                    refused.status.to_string(),
                    format!(
                        "rejected: {} (Retry-After {})",
                        refused.body["dimension"].as_str().unwrap_or("?"),
                        refused.retry_after.as_deref().unwrap_or("none")
                    ),
                ],
            ],
        );
        self.check(
            reserved.status == 201 && settled.state() == Some("SETTLED_WITH_DEBT"),
            "the overage of 600 takes the 500 available; the last 100 is debt (SETTLED_WITH_DEBT)",
        )?;
        let account = self.account(1).await?;
        self.show_accounts(&[&account]);
        self.check(
            account.debt == 100
                && account.terms.overdraft_issued == 100
                && account.terms.available == 0
                && balanced(&account),
            "overdraftIssued 100, debt 100, available 0",
        )?;
        self.check(
            refused.status == 429 && refused.body["dimension"] == "debt",
            "admission for the pair is 0 while debt is owed (429, dimension debt)",
        )
    }

    async fn refill_repays_debt(&mut self) -> anyhow::Result<()> {
        self.begin("Refills repay the debt first; then admission resumes");
        let repaid = self
            .wait_for_account("a refill repays the debt", 1, |account| account.debt == 0)
            .await?;
        self.show_accounts(&[&repaid]);
        self.check(
            repaid.terms.overdraft_repaid == 100 && balanced(&repaid),
            "the first 100 refilled went to overdraftRepaid",
        )?;
        self.wait_for_account("the next refill reaches available", 1, |account| {
            account.terms.available >= 50
        })
        .await?;
        let c = self.client(2);
        let admitted = c.reserve("after-debt", SUBJECT, ROUTE, 50).await?;
        let id = admitted.reservation().unwrap_or("").to_owned();
        let released = c.release(&id).await?;
        table(
            &["gateway", "call", "HTTP", "outcome", "reservation"],
            &[
                vec![
                    "C".into(),
                    "reserve 50 again, same key".into(),
                    admitted.status.to_string(),
                    outcome(&admitted),
                    short(&id),
                ],
                vec![
                    "C".into(),
                    "release (not needed after all)".into(),
                    released.status.to_string(),
                    outcome(&released),
                    short(&id),
                ],
            ],
        );
        self.check(
            admitted.is_success() && admitted.state() == Some("RESERVED"),
            "with debt 0 and units available, the same request is admitted",
        )?;
        self.check(
            released.status == 200 && released.state() == Some("RELEASED"),
            "released: its 50 units are available again",
        )
    }

    async fn enable_shards(&mut self) -> anyhow::Result<()> {
        self.begin("The operator turns emergency shards on (generation 2)");
        let mut policy = reservoir::cluster::policy(SUBJECT, ROUTE, 2);
        policy.overdraft_units_max = 200;
        policy.emergency_mode = EmergencyMode::Enabled;
        policy.emergency_shard_units = 200;
        policy.emergency_shard_validity_ms = 600_000;
        // No refill in generation 2: every change below is the shards'.
        policy.refill = Refill {
            units: 0,
            interval_ms: 1000,
        };
        self.cluster.central().publish(&policy).await?;
        self.say(
            "generation 2: opening 1000, no refill, a shard of 200 per agent, valid 10 minutes",
        );
        let mut rows = Vec::new();
        for index in 0..GATEWAYS.len() {
            let client = self.client(index);
            let shard = wait_until(
                &format!("gateway {}'s agent holds a shard", gateway(index)),
                WAIT,
                || async {
                    let status = client.status().await?;
                    Ok(open_shards(&status).into_iter().next())
                },
            )
            .await?;
            rows.push(vec![
                gateway(index).to_owned(),
                short(shard["shard"].as_str().unwrap_or("")),
                shard["fence"].to_string(),
                shard["bootEpoch"].to_string(),
                shard_equation(&shard),
            ]);
        }
        table(
            &[
                "gateway",
                "shard",
                "fence",
                "boot epoch",
                "allocated = available + reserved + spent + retired",
            ],
            &rows,
        );
        let account = self.account(2).await?;
        self.show_accounts(&[&account]);
        self.check(
            account.terms.available == 400
                && account.terms.retired_for_emergency == 600
                && balanced(&account),
            "600 moved from available to retiredForEmergency: 1000 = 400 + 0 + 0 + 600 + 0",
        )
    }

    /// Returns the gateways' requests whose outcome is unknown.
    async fn partition(&mut self) -> anyhow::Result<Vec<(usize, String)>> {
        self.begin("Partition: the central ledger goes away");
        let status = self.cluster.central_mut().stop().await?;
        self.say(format!("central ledger stopped ({status})"));
        let mut rows = Vec::new();
        let mut unknown = Vec::new();
        let mut all_503 = true;
        for index in 0..GATEWAYS.len() {
            let key = format!("probe-{}", gateway(index).to_lowercase());
            let answer = self.client(index).reserve(&key, SUBJECT, ROUTE, 10).await?;
            all_503 &= answer.status == 503;
            unknown.push((index, key.clone()));
            let client = self.client(index);
            let mode = wait_until(
                &format!("gateway {}'s agent notices the partition", gateway(index)),
                WAIT,
                || async {
                    let status = client.status().await?;
                    Ok((status["mode"] == "partitioned").then_some(()))
                },
            )
            .await
            .map(|()| "partitioned".to_owned())?;
            rows.push(vec![
                gateway(index).to_owned(),
                format!("reserve 10 ({key})"),
                answer.status.to_string(),
                answer.error().map_or("", |code| code.as_str()).to_owned(),
                answer.retry_after.clone().unwrap_or_else(|| "-".into()),
                mode,
            ]);
        }
        table(
            &[
                "gateway",
                "call",
                "HTTP",
                "error",
                "Retry-After",
                "agent mode after",
            ],
            &rows,
        );
        self.check(
            all_503,
            "no answer is a guess: 503 (the outcome is unknown, retry under the same key)",
        )?;
        self.check(true, "every agent now treats the pair as partitioned")?;
        Ok(unknown)
    }

    async fn admit_from_shards(&mut self) -> anyhow::Result<()> {
        self.begin("Partitioned, each agent admits from its own signed shard");
        let mut rows = Vec::new();
        let mut all_admitted = true;
        for index in 0..GATEWAYS.len() {
            let g = gateway(index).to_lowercase();
            let client = self.client(index);
            let reserved = client
                .reserve(&format!("offline-{g}-1"), SUBJECT, ROUTE, 120)
                .await?;
            let id = reserved.reservation().unwrap_or("").to_owned();
            let from_shard = reserved.body["path"]["kind"] == "shard";
            let operation = format!("op-{g}-1");
            let started = client.start(&id, &operation).await?;
            let settled = client.settle(&id, &operation, 50).await?;
            all_admitted &= reserved.status == 201
                && from_shard
                && started.status == 200
                && settled.state() == Some("SETTLED");
            rows.push(vec![
                gateway(index).to_owned(),
                "reserve 120, settle 50".into(),
                from(&reserved),
                settled.state().unwrap_or("").to_owned(),
            ]);
        }
        let c = self.client(2);
        let reserved = c.reserve("offline-c-2", SUBJECT, ROUTE, 40).await?;
        let id = reserved.reservation().unwrap_or("").to_owned();
        let started = c.start(&id, "op-c-2").await?;
        all_admitted &= reserved.status == 201
            && reserved.body["path"]["kind"] == "shard"
            && started.state() == Some("STARTED");
        rows.push(vec![
            "C".into(),
            "reserve 40, start (outcome never known)".into(),
            from(&reserved),
            started.state().unwrap_or("").to_owned(),
        ]);
        table(&["gateway", "calls", "HTTP", "state"], &rows);
        self.check(
            all_admitted,
            "every agent admitted from its shard while the center was away",
        )?;
        let mut shards = Vec::new();
        for index in 0..GATEWAYS.len() {
            let status = self.client(index).status().await?;
            let shard = open_shards(&status)
                .into_iter()
                .next()
                .with_context(|| format!("gateway {}'s agent has no open shard", gateway(index)))?;
            shards.push(vec![gateway(index).to_owned(), shard_equation(&shard)]);
        }
        table(
            &[
                "gateway",
                "shard: allocated = available + reserved + spent + retired",
            ],
            &shards,
        );
        self.check(
            shards[0][1] == "200 = 150 + 0 + 50 + 0" && shards[2][1] == "200 = 110 + 40 + 50 + 0",
            "each shard's equation holds: A 200 = 150 + 0 + 50 + 0, C 200 = 110 + 40 + 50 + 0",
        )
    }

    /// Returns the requests gateway C's agent could not decide.
    async fn restart_partitioned(&mut self) -> anyhow::Result<Vec<(usize, String)>> {
        self.begin("Gateway C's agent crashes (kill -9) and restarts, still partitioned");
        let before = self.client(2).status().await?;
        let old_epoch = before["bootEpoch"].as_u64().unwrap_or(0);
        let old_shard = open_shards(&before)
            .into_iter()
            .next()
            .context("C holds no open shard")?;
        let agent = self.cluster.agent_mut(2);
        agent.kill().await?;
        agent.start().await?;
        let client = self.client(2);
        let first = client.reserve("offline-c-3", SUBJECT, ROUTE, 30).await?;
        wait_until("C's new process notices the partition", WAIT, || async {
            let status = client.status().await?;
            Ok((status["mode"] == "partitioned").then_some(()))
        })
        .await?;
        let second = client.reserve("offline-c-4", SUBJECT, ROUTE, 30).await?;
        let after = client.status().await?;
        let old = client.shards().await?["shards"]
            .as_array()
            .and_then(|shards| {
                shards
                    .iter()
                    .find(|shard| shard["shard"] == old_shard["shard"])
            })
            .cloned()
            .unwrap_or(Value::Null);
        self.say(format!(
            "boot epoch before: {old_epoch}; after the restart: {} (the center is away)",
            after["bootEpoch"]
        ));
        table(
            &[
                "shard",
                "closed",
                "allocated = available + reserved + spent + retired",
            ],
            &[vec![
                short(old_shard["shard"].as_str().unwrap_or("")),
                old["closed"].to_string(),
                shard_equation(&old),
            ]],
        );
        table(
            &["gateway", "call", "HTTP", "error"],
            &[
                vec![
                    "C".into(),
                    "reserve 30".into(),
                    first.status.to_string(),
                    first.error().map_or("", |code| code.as_str()).into(),
                ],
                vec![
                    "C".into(),
                    "reserve 30 (partition noticed)".into(),
                    second.status.to_string(),
                    second.error().map_or("", |code| code.as_str()).into(),
                ],
            ],
        );
        self.check(
            old["closed"] == true && old["terms"]["localAvailable"] == 0,
            "the old shard is closed: 110 confirmed unused and 40 unknown moved to retired",
        )?;
        self.check(
            !first.is_success() && !second.is_success() && after["bootEpoch"].is_null(),
            "a restarted process never inherits an old shard: nothing admitted until it reaches the center",
        )?;
        Ok(vec![(2, "offline-c-3".to_owned())])
    }

    async fn central_returns(&mut self, unknown: Vec<(usize, String)>) -> anyhow::Result<()> {
        self.begin("The central ledger returns; the agents reconnect");
        self.cluster.central_mut().start().await?;
        let epoch = self.cluster.agent_mut(2).wait_for_boot(1).await?;
        self.say(format!("gateway C's agent registered boot epoch {epoch}"));
        for index in 0..GATEWAYS.len() {
            let client = self.client(index);
            wait_until(
                &format!("gateway {}'s agent is healthy again", gateway(index)),
                WAIT,
                || async {
                    let status = client.status().await?;
                    Ok((status["mode"] == "healthy").then_some(()))
                },
            )
            .await?;
        }
        let account = self
            .wait_for_account(
                "the terminal receipts of the three used shards are reconciled",
                2,
                |account| account.terms.minted >= 410,
            )
            .await?;
        self.show_accounts(&[&account]);
        self.say(
            "the used shards' units stay retired; their unused units came back as minted, and each agent took a fresh shard (another 600 retired)",
        );
        self.check(
            account.terms.minted == 410 && balanced(&account),
            "re-minted 410 = 150 (A) + 150 (B) + 110 (C); C's 40 unknown stay retired",
        )?;
        let mut rows = Vec::new();
        let mut resolved = true;
        for (index, key) in unknown {
            let client = self.client(index);
            let units = if key.starts_with("probe") { 10 } else { 30 };
            let answer = wait_until(&format!("{key} is decided"), WAIT, || async {
                let answer = client.reserve(&key, SUBJECT, ROUTE, units).await?;
                Ok((answer.status != 503).then_some(answer))
            })
            .await?;
            let id = answer.reservation().unwrap_or("").to_owned();
            let released = client.release(&id).await?;
            resolved &= answer.is_success()
                && answer.state() == Some("RESERVED")
                && released.state() == Some("RELEASED");
            rows.push(vec![
                gateway(index).to_owned(),
                key.clone(),
                answer_summary(&answer),
                short(&id),
                answer_summary(&released),
            ]);
        }
        table(
            &[
                "gateway",
                "retried key",
                "answer",
                "reservation",
                "then release",
            ],
            &rows,
        );
        self.check(
            resolved,
            "every unknown request resolved once, under its original reservation ID",
        )
    }

    async fn receipts_exactly_once(&mut self) -> anyhow::Result<()> {
        self.begin("Terminal receipts re-mint unused units exactly once");
        let minted_before = self.account(2).await?.terms.minted;
        let mut receipts = Vec::new();
        for index in 0..GATEWAYS.len() {
            let agent = self.cluster.agent_mut(index);
            agent.stop().await?;
            let journal = agent::journal::Journal::open(&agent.data_dir().join("journal.redb"))
                .with_context(|| format!("cannot open gateway {}'s journal", gateway(index)))?;
            for record in journal.load()? {
                if let JournalRecord::TerminalReceipt { receipt, .. } = record {
                    receipts.push((index, *receipt));
                }
            }
        }
        self.say("the agents stopped; their journals hold these signed terminal receipts:");
        let rows: Vec<Vec<String>> = receipts
            .iter()
            .map(|(index, receipt)| {
                vec![
                    gateway(*index).to_owned(),
                    short(receipt.shard.as_str()),
                    receipt.boot_epoch.to_string(),
                    receipt.allocated_units.to_string(),
                    receipt.spent_units.to_string(),
                    receipt.confirmed_unused_units.to_string(),
                    receipt.unknown_units.to_string(),
                    format!("{:?}", receipt.reason),
                ]
            })
            .collect();
        table(
            &[
                "gateway",
                "shard",
                "boot",
                "allocated",
                "spent",
                "unused",
                "unknown",
                "closed by",
            ],
            &rows,
        );
        let unused: u64 = receipts.iter().map(|(_, r)| r.confirmed_unused_units).sum();
        self.check(
            receipts.len() == 3 && unused == minted_before,
            "the re-minted units are exactly the receipts' confirmed unused units",
        )?;
        let mut replays = Vec::new();
        for (index, receipt) in &receipts {
            let client = self
                .cluster
                .central()
                .as_agent(self.cluster.agent(*index))?;
            let answer = client
                .reconcile_shard(receipt)
                .await
                .with_context(|| format!("replaying gateway {}'s receipt", gateway(*index)))?;
            replays.push(vec![
                gateway(*index).to_owned(),
                short(receipt.shard.as_str()),
                answer.duplicate.to_string(),
                answer.reconciliation.reminted_units.to_string(),
            ]);
        }
        self.say("each receipt sent again (a lost ACK, or a replay):");
        table(
            &["gateway", "shard", "duplicate", "re-minted (first time)"],
            &replays,
        );
        let minted_after = self.account(2).await?.terms.minted;
        self.check(
            replays.iter().all(|row| row[2] == "true") && minted_after == minted_before,
            format!("every replay is a duplicate; minted stays {minted_before}"),
        )
    }

    /// (available, reserved, spent) of each of the LLM routes' accounts.
    async fn llm_accounts(&self) -> anyhow::Result<Vec<(u64, u64, u64)>> {
        let mut all = Vec::new();
        for (route, _, _) in LLM_ROUTES {
            let view = self.cluster.central().accounts(SUBJECT, route).await?;
            let terms = view.accounts.last().context("an account")?.terms;
            all.push((terms.available, terms.reserved, terms.spent));
        }
        Ok(all)
    }

    fn show_llm_accounts(&self, accounts: &[(u64, u64, u64)]) {
        let rows: Vec<Vec<String>> = LLM_ROUTES
            .iter()
            .zip(accounts)
            .map(|((route, _, _), (available, reserved, spent))| {
                vec![
                    format!("{SUBJECT}/{route}"),
                    available.to_string(),
                    reserved.to_string(),
                    spent.to_string(),
                ]
            })
            .collect();
        table(&["account", "available", "reserved", "spent"], &rows);
    }

    async fn one_request_three_limits(&mut self) -> anyhow::Result<()> {
        self.begin("One LLM request reserves requests, tokens and a slot in flight at once");
        for (route, opening, units_max) in LLM_ROUTES {
            let mut policy = reservoir::cluster::policy(SUBJECT, route, 1);
            policy.opening = opening;
            policy.burst = opening;
            policy.reservation_units_max = units_max;
            policy.overdraft_units_max = 0;
            policy.emergency_mode = EmergencyMode::Disabled;
            policy.refill = Refill {
                units: 0,
                interval_ms: 1000,
            };
            self.cluster.central().publish(&policy).await?;
        }
        self.say(
            "policies: 600 requests, 3000 tokens (at most 2500 at once), 1 request in flight (nothing refills)",
        );
        let request = |key: &str| {
            serde_json::json!({
                "idempotencyKey": key,
                "legs": [
                    {"subject": SUBJECT, "route": LLM_ROUTES[0].0, "units": 1},
                    {"subject": SUBJECT, "route": LLM_ROUTES[1].0, "units": 4000, "minUnits": 500},
                    {"subject": SUBJECT, "route": LLM_ROUTES[2].0, "units": 1},
                ],
            })
        };
        let client = self.client(0);
        let first = client
            .send("POST", "/v1/reservations", Some(&request("llm-1")))
            .await?;
        let second = client
            .send("POST", "/v1/reservations", Some(&request("llm-2")))
            .await?;
        let grants = |answer: &AgentResponse| -> String {
            answer.body["legs"].as_array().map_or_else(
                || "-".to_owned(),
                |legs| {
                    legs.iter()
                        .map(|leg| leg["reservedUnits"].to_string())
                        .collect::<Vec<_>>()
                        .join(" + ")
                },
            )
        };
        let limited = |answer: &AgentResponse| -> String {
            match (
                answer.body["route"].as_str(),
                answer.body["dimension"].as_str(),
            ) {
                (Some(route), Some(dimension)) if answer.status == 429 => {
                    format!("{route}: {dimension}")
                }
                _ => "-".to_owned(),
            }
        };
        table(
            &[
                "request",
                "HTTP",
                "granted (requests + tokens + slot)",
                "limited by",
            ],
            &[
                vec![
                    "llm-1: 1 + 4000 (at least 500) + 1".into(),
                    first.status.to_string(),
                    grants(&first),
                    limited(&first),
                ],
                vec![
                    "llm-2: the same".into(),
                    second.status.to_string(),
                    grants(&second),
                    limited(&second),
                ],
            ],
        );
        let accounts = self.llm_accounts().await?;
        self.show_llm_accounts(&accounts);
        self.check(
            first.status == 201 && grants(&first) == "1 + 2500 + 1",
            "all three legs admitted in one transition; the flexible tokens leg got 2500 of its 4000",
        )?;
        self.check(
            second.status == 429
                && second.body["route"] == LLM_ROUTES[2].0
                && accounts == [(599, 1, 0), (500, 2500, 0), (0, 1, 0)],
            "the second is refused on its slot leg and holds nothing on any leg",
        )?;
        let id = first
            .reservation()
            .context("the 201 names no reservation")?
            .to_owned();
        client.start(&id, "op-llm").await?;
        let settle = serde_json::json!({
            "operationId": "op-llm",
            "legs": [
                {"subject": SUBJECT, "route": LLM_ROUTES[1].0, "actualUnits": 1200},
                {"subject": SUBJECT, "route": LLM_ROUTES[2].0, "actualUnits": 0},
            ],
        });
        let settled = client
            .send(
                "POST",
                &format!("/v1/reservations/{id}/settle"),
                Some(&settle),
            )
            .await?;
        let accounts = self.llm_accounts().await?;
        self.show_llm_accounts(&accounts);
        self.check(
            settled.status == 200 && accounts == [(599, 0, 1), (1800, 0, 1200), (1, 0, 0)],
            "settled per leg: 1200 tokens used and 1300 refunded, the slot freed, the request counted",
        )
    }

    async fn final_audit(&mut self) -> anyhow::Result<()> {
        self.begin("Final audit: every account and shard against its equation");
        let central = self.cluster.central();
        let binary = std::env::current_exe()?;
        let output = tokio::process::Command::new(binary)
            .args([
                "audit",
                "--central",
                &central.url(),
                "--operator-token-file",
            ])
            .arg(central.token_path())
            .args(
                central
                    .ca_file()
                    .map(|ca| [std::ffi::OsStr::new("--central-ca-file"), ca.as_os_str()])
                    .into_iter()
                    .flatten(),
            )
            .stdin(Stdio::null())
            .output()
            .await?;
        for line in String::from_utf8_lossy(&output.stdout).lines() {
            self.say(line);
        }
        let report = central.audit().await?;
        self.check(
            output.status.success() && report.ok && report.debt == 0,
            "`reservoir audit` is clean: every equation holds, no debt",
        )?;
        if report.violations.is_empty() {
            Ok(())
        } else {
            bail!("violations: {:?}", report.violations)
        }
    }
}

/// `201 from its shard` (or the status and where it came from).
fn from(answer: &AgentResponse) -> String {
    match answer.body["path"]["kind"].as_str() {
        Some("shard") => format!("{} from its shard", answer.status),
        Some(kind) => format!("{} from {kind}", answer.status),
        None => answer.status.to_string(),
    }
}

/// The shards of an agent's status that are still open.
fn open_shards(status: &Value) -> Vec<Value> {
    status["shards"]
        .as_array()
        .map(|shards| {
            shards
                .iter()
                .filter(|shard| shard["closed"] == false)
                .cloned()
                .collect()
        })
        .unwrap_or_default()
}
