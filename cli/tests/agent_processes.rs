//! Agents and the central service as real processes (`reservoir agent
//! run`, `reservoir central serve`, through `reservoir::cluster`), killed
//! and restarted on their own data:
//!
//! - `kill -9` of an agent under a burst of concurrent reserves, starts and
//!   settles, 100 times in a row: no acknowledged reservation is lost
//!   (each is found again in the same state or a later one) and none is
//!   doubled (the same idempotency key gives the same reservation ID, and
//!   the central account's reserved and spent terms are exactly those of
//!   the reservations the gateways made); the audit is clean every time.
//! - `kill -9` of the central service mid-burst: acknowledged reservations
//!   survive at the center, the agents recover, the audit is clean.
//! - A journal copied to another agent (another identity key) lends it
//!   nothing: it never admits from the first agent's shard; and the same
//!   identity restarted on a restored copy gets a new boot epoch and never
//!   reuses the old shard, whose unused units are re-minted exactly once.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reservoir::cluster::{
    AgentClient, AgentOptions, AgentResponse, Cluster, ClusterError, ClusterOptions, POLL_INTERVAL,
    policy, wait_until,
};
use serde_json::Value;
use shard_format::{AdmissionBudgetV1, EmergencyMode, Refill};

const BINARY: &str = env!("CARGO_BIN_EXE_reservoir");
const SUBJECT: &str = "tenant-7";
const ROUTE: &str = "chat.generate";
/// Longest wait for anything the processes do on their own.
const WAIT: Duration = Duration::from_secs(20);

/// Plenty of capacity, no refill, holds that never expire while a test
/// looks: every unit moved is a test's doing.
fn big_policy() -> AdmissionBudgetV1 {
    let mut policy = policy(SUBJECT, ROUTE, 1);
    policy.opening = 10_000_000;
    policy.burst = 10_000_000;
    policy.reservation_units_max = 1000;
    policy.refill = Refill {
        units: 0,
        interval_ms: 1000,
    };
    // No hold expires within a test; with the hard limit, the policy fits
    // the default retention window (24 h).
    policy.hold_ttl_ms = 6 * 3_600_000;
    policy
}

async fn start_cluster(agents: usize) -> Cluster {
    let options = ClusterOptions {
        agent: AgentOptions {
            central_call_ms: 5000,
            retry_interval_ms: 50,
        },
        ..ClusterOptions::new(BINARY, agents)
    };
    Cluster::start(options).await.expect("the cluster starts")
}

/// How far a reservation got, as the agent reports it.
fn rank(state: Option<&str>) -> u8 {
    match state {
        Some("RESERVED") => 1,
        Some("STARTING") => 2,
        Some("STARTED" | "USAGE_UNKNOWN") => 3,
        Some("SETTLING") => 4,
        Some("SETTLED" | "SETTLED_WITH_DEBT") => 5,
        _ => 0,
    }
}

/// What a gateway knows of one request it sent.
#[derive(Debug, Clone)]
struct Note {
    agent: usize,
    units: u64,
    actual: u64,
    /// The reservation ID, once a reserve was acknowledged.
    id: Option<String>,
    /// The furthest acknowledged state.
    rank: u8,
}

type Notes = Arc<Mutex<BTreeMap<String, Note>>>;

/// How many reserves the gateways saw acknowledged so far.
type Acknowledged = Arc<tokio::sync::watch::Sender<usize>>;

fn acknowledged_counter() -> Acknowledged {
    Arc::new(tokio::sync::watch::Sender::new(0))
}

fn note(notes: &Notes, key: &str, update: impl FnOnce(&mut Note)) {
    let mut notes = notes.lock().expect("notes");
    if let Some(note) = notes.get_mut(key) {
        update(note);
    }
}

/// One gateway: reserve, start, settle, again and again, until a call gets
/// no 2xx answer (the agent or the center is gone) or `count` are done.
async fn lane(
    agent: usize,
    client: AgentClient,
    prefix: String,
    count: usize,
    notes: Notes,
    acknowledged: Acknowledged,
) {
    for n in 0..count {
        let key = format!("{prefix}-{n}");
        let units = 2 + (n as u64 % 4);
        let actual = 1 + (n as u64 % 2);
        notes.lock().expect("notes").insert(
            key.clone(),
            Note {
                agent,
                units,
                actual,
                id: None,
                rank: 0,
            },
        );
        let Ok(answer) = client.reserve(&key, SUBJECT, ROUTE, units).await else {
            return;
        };
        if !answer.is_success() {
            return;
        }
        let id = answer.reservation().expect("a reservation ID").to_owned();
        note(&notes, &key, |note| {
            note.id = Some(id.clone());
            note.rank = rank(answer.state());
        });
        acknowledged.send_modify(|count| *count += 1);
        let operation = format!("op-{key}");
        let Ok(answer) = client.start(&id, &operation).await else {
            return;
        };
        if !answer.is_success() {
            return;
        }
        note(&notes, &key, |note| {
            note.rank = note.rank.max(rank(answer.state()))
        });
        let Ok(answer) = client.settle(&id, &operation, actual).await else {
            return;
        };
        if !answer.is_success() {
            return;
        }
        note(&notes, &key, |note| {
            note.rank = note.rank.max(rank(answer.state()))
        });
    }
}

/// Repeats `call` until it gets an answer that is neither 503 (unknown,
/// retry) nor 202 (accepted, not yet delivered).
async fn definite<F, Fut>(what: &str, mut call: F) -> AgentResponse
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<AgentResponse, ClusterError>>,
{
    let started = Instant::now();
    loop {
        if let Ok(answer) = call().await
            && answer.status != 503
            && answer.status != 202
        {
            return answer;
        }
        assert!(
            started.elapsed() < WAIT,
            "{what}: no definite answer within {WAIT:?}"
        );
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// After a crash: the gateway retries `key` and finishes its request.
/// Asserts that an acknowledged reservation comes back under the same ID
/// and in the same state or a later one; returns the settled actual units.
async fn resolve(client: &AgentClient, key: &str, note: &Note) -> u64 {
    let answer = definite(&format!("reserve {key} again"), || {
        client.reserve(key, SUBJECT, ROUTE, note.units)
    })
    .await;
    assert!(answer.is_success(), "{key}: {answer:?}");
    let id = answer.reservation().expect("a reservation ID").to_owned();
    if let Some(acknowledged) = &note.id {
        assert_eq!(
            &id, acknowledged,
            "{key}: the same key, another reservation"
        );
        assert_eq!(
            answer.status, 200,
            "{key}: an acknowledged reservation was created again: {answer:?}"
        );
    }
    let found = client.reservation(&id).await.expect("GET answers");
    assert_eq!(found.status, 200, "{key}: {found:?}");
    assert!(
        rank(found.state()) >= note.rank,
        "{key}: acknowledged up to rank {}, found {found:?}",
        note.rank
    );
    let operation = format!("op-{key}");
    let mut state = found.state().unwrap_or("").to_owned();
    if state == "RESERVED" || state == "STARTING" {
        let started = definite(&format!("start {key}"), || client.start(&id, &operation)).await;
        assert_eq!(started.status, 200, "{key}: {started:?}");
        state = started.state().unwrap_or("").to_owned();
    }
    if state != "SETTLED" {
        let settled = definite(&format!("settle {key}"), || {
            client.settle(&id, &operation, note.actual)
        })
        .await;
        assert_eq!(settled.status, 200, "{key}: {settled:?}");
        state = settled.state().unwrap_or("").to_owned();
    }
    assert_eq!(state, "SETTLED", "{key}");
    let settled = client.reservation(&id).await.expect("GET answers");
    assert_eq!(
        settled.body["actualUnits"].as_u64(),
        Some(note.actual),
        "{key}: {settled:?}"
    );
    note.actual
}

/// Resolves every noted request at once (each gateway retries its own);
/// returns the units they spent.
async fn resolve_all(cluster: &Cluster, notes: BTreeMap<String, Note>) -> u64 {
    let mut tasks = tokio::task::JoinSet::new();
    for (key, note) in notes {
        let client = cluster.agent(note.agent).client();
        tasks.spawn(async move { resolve(&client, &key, &note).await });
    }
    let mut spent = 0;
    while let Some(actual) = tasks.join_next().await {
        spent += actual.expect("a request resolves");
    }
    spent
}

/// The central account: nothing reserved, `spent` exactly as expected,
/// and a clean audit.
async fn assert_center(cluster: &Cluster, spent: u64) {
    let central = cluster.central();
    let view = central.accounts(SUBJECT, ROUTE).await.expect("accounts");
    assert_eq!(view.accounts.len(), 1, "{view:?}");
    let terms = view.accounts[0].terms;
    assert_eq!(
        (terms.reserved, terms.spent),
        (0, spent),
        "the center holds exactly the gateways' reservations: {terms:?}"
    );
    let report = central.audit().await.expect("audit");
    assert!(report.ok, "{:#?}", report.violations);
}

/// Starts `lanes` gateways per agent in `agents`, waits until `target`
/// reservations are acknowledged, and returns the running lanes.
fn burst(
    cluster: &Cluster,
    agents: &[usize],
    lanes: usize,
    prefix: &str,
    notes: &Notes,
    acknowledged: &Acknowledged,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut tasks = Vec::new();
    for &agent in agents {
        for lane_index in 0..lanes {
            tasks.push(tokio::spawn(lane(
                agent,
                cluster.agent(agent).client(),
                format!("{prefix}-{agent}-{lane_index}"),
                1000,
                notes.clone(),
                acknowledged.clone(),
            )));
        }
    }
    tasks
}

async fn wait_for_acknowledged(acknowledged: &Acknowledged, target: usize) {
    let mut counter = acknowledged.subscribe();
    tokio::time::timeout(WAIT, counter.wait_for(|count| *count >= target))
        .await
        .unwrap_or_else(|_| panic!("{target} acknowledged reservations within {WAIT:?}"))
        .expect("the counter lives");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_of_an_agent_under_a_burst_100_times_loses_and_doubles_nothing() {
    const ROUNDS: usize = 100;
    const LANES: usize = 4;
    let started = Instant::now();
    let mut cluster = start_cluster(1).await;
    cluster
        .central()
        .publish(&big_policy())
        .await
        .expect("publish");
    let mut spent = 0;
    let mut epoch = cluster.agent(0).status().await.expect("status")["bootEpoch"]
        .as_u64()
        .expect("booted");
    let mut acknowledged_total = 0;
    let mut restarting = Duration::ZERO;
    for round in 0..ROUNDS {
        let notes: Notes = Arc::default();
        let acknowledged = acknowledged_counter();
        let lanes = burst(
            &cluster,
            &[0],
            LANES,
            &format!("r{round}"),
            &notes,
            &acknowledged,
        );
        // Kill at a different point of the burst each round.
        wait_for_acknowledged(&acknowledged, 1 + (round * 7) % 9).await;
        cluster.agent_mut(0).kill().await.expect("kill -9");
        for lane in lanes {
            lane.await.expect("a lane");
        }
        let restarted = Instant::now();
        cluster.agent_mut(0).start().await.expect("restart");
        epoch = cluster
            .agent_mut(0)
            .wait_for_boot(epoch)
            .await
            .expect("a new boot");
        restarting += restarted.elapsed();
        let notes = std::mem::take(&mut *notes.lock().expect("notes"));
        acknowledged_total += notes.values().filter(|note| note.id.is_some()).count();
        spent += resolve_all(&cluster, notes).await;
        assert_center(&cluster, spent).await;
    }
    eprintln!(
        "{ROUNDS} kill -9 rounds, {acknowledged_total} acknowledged reservations, {spent} units spent, in {:?} ({restarting:?} of it restarting the agent)",
        started.elapsed()
    );
    cluster.stop().await.expect("a graceful stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn kill_9_of_the_center_mid_burst_loses_no_acknowledged_reservation() {
    let started = Instant::now();
    let mut cluster = start_cluster(2).await;
    cluster
        .central()
        .publish(&big_policy())
        .await
        .expect("publish");
    let notes: Notes = Arc::default();
    let acknowledged = acknowledged_counter();
    let lanes = burst(&cluster, &[0, 1], 3, "center", &notes, &acknowledged);
    wait_for_acknowledged(&acknowledged, 60).await;
    cluster.central_mut().kill().await.expect("kill -9");
    for lane in lanes {
        lane.await.expect("a lane");
    }
    cluster
        .central_mut()
        .start()
        .await
        .expect("restart on the same data");
    let notes = std::mem::take(&mut *notes.lock().expect("notes"));
    let spent = resolve_all(&cluster, notes.clone()).await;
    // Every acknowledged reservation is at the center too, settled once.
    for (key, note) in &notes {
        let Some(id) = &note.id else { continue };
        let center = cluster
            .central()
            .as_agent(cluster.agent(note.agent))
            .expect("a client");
        let receipt = center
            .reservation(&shard_format::ReservationId::new(id.as_str()).expect("an ID"))
            .await
            .unwrap_or_else(|error| panic!("{key} ({id}) was acknowledged: {error}"));
        assert_eq!(receipt.reserved_units, note.units, "{key}");
        assert_eq!(receipt.actual_units, Some(note.actual), "{key}");
    }
    assert_center(&cluster, spent).await;
    for agent in cluster.agents() {
        let client = agent.client();
        wait_until(
            &format!("{} is healthy with nothing left to sync", agent.name()),
            WAIT,
            || async {
                let status = client.status().await?;
                Ok((status["mode"] == "healthy" && status["pendingSync"] == 0).then_some(()))
            },
        )
        .await
        .expect("the agents recover");
    }
    eprintln!(
        "center killed after {} acknowledged of {} sent; all resolved in {:?}",
        notes.values().filter(|note| note.id.is_some()).count(),
        notes.len(),
        started.elapsed()
    );
    cluster.stop().await.expect("a graceful stop");
}

/// The shards in an agent's status (the open ones) or its shard list.
fn shards(status: &Value) -> Vec<Value> {
    status["shards"].as_array().cloned().unwrap_or_default()
}

/// Reserves under fresh keys until the agent treats the pair as
/// partitioned; asserts that nothing was admitted by the (stopped) center
/// meanwhile. The agent's own retries of the refused probes count as
/// failures too, so the pair may turn partitioned between two probes: the
/// next probe is then admitted from the shard, which is the partition
/// showing (its hold is released at once, leaving the shard's books as
/// they were).
async fn until_partitioned(client: &AgentClient, prefix: &str) {
    let mut attempt = 0;
    wait_until("the agent notices the partition", WAIT, || {
        attempt += 1;
        let key = format!("{prefix}-{attempt}");
        async move {
            let answer = client.reserve(&key, SUBJECT, ROUTE, 1).await?;
            if answer.is_success() {
                assert_eq!(
                    answer.body["path"]["kind"], "shard",
                    "admitted by a stopped center: {answer:?}"
                );
                let released = client.release(answer.reservation().expect("an ID")).await?;
                assert_eq!(released.status, 200, "{released:?}");
                return Ok(Some(()));
            }
            let status = client.status().await?;
            Ok((status["mode"] == "partitioned").then_some(()))
        }
    })
    .await
    .expect("partitioned");
}

/// Asserts that the agent admits nothing while partitioned.
async fn admits_nothing(client: &AgentClient, what: &str) {
    until_partitioned(client, &format!("{what}-probe")).await;
    for index in 0..5 {
        let answer = client
            .reserve(&format!("{what}-{index}"), SUBJECT, ROUTE, 1)
            .await
            .expect("an answer");
        assert_eq!(answer.status, 503, "{what}: {answer:?}");
    }
    let status = client.status().await.expect("status");
    assert!(status["bootEpoch"].is_null(), "{what}: {status}");
    assert!(
        shards(&status).is_empty(),
        "{what}: an open shard: {status}"
    );
    let held = client.shards().await.expect("shards");
    for shard in shards(&held) {
        assert_eq!(
            shard["closed"], true,
            "{what}: an old shard is open: {shard}"
        );
    }
}

/// Copies the journal (its redb file and write-ahead log files) of the
/// stopped agent with data directory `from` over the one in `to`, as a
/// backup and a restore do: the files of the journal it replaces go first.
fn copy_journal(from: &std::path::Path, to: &std::path::Path) {
    std::fs::create_dir_all(to).expect("data dir");
    for file in record_log::store_files(&to.join("journal.redb")).expect("list") {
        if file.exists() {
            std::fs::remove_file(&file).expect("remove the replaced journal");
        }
    }
    for file in record_log::store_files(&from.join("journal.redb")).expect("list") {
        let name = file.file_name().expect("a file name");
        std::fs::copy(&file, to.join(name)).expect("copy the journal");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_copied_journal_lends_no_shard_and_a_restored_one_is_refused() {
    let mut cluster = start_cluster(2).await;
    let mut policy = big_policy();
    policy.opening = 1000;
    policy.burst = 1000;
    policy.emergency_mode = EmergencyMode::Enabled;
    policy.emergency_shard_units = 200;
    policy.emergency_shard_validity_ms = 600_000;
    cluster.central().publish(&policy).await.expect("publish");
    let a = cluster.agent(0).client();
    let b = cluster.agent(1).client();
    let b_epoch = cluster.agent(1).status().await.expect("status")["bootEpoch"]
        .as_u64()
        .expect("booted");

    // A learns the pair and takes a shard; the center goes away; A admits
    // 50 from its shard.
    let warm = a.reserve("warm", SUBJECT, ROUTE, 10).await.expect("answer");
    assert_eq!(warm.status, 201, "{warm:?}");
    let released = a
        .release(warm.reservation().expect("ID"))
        .await
        .expect("answer");
    assert_eq!(released.status, 200, "{released:?}");
    let shard = wait_until("A holds a shard", WAIT, || async {
        Ok(shards(&a.status().await?)
            .into_iter()
            .find(|shard| shard["closed"] == false))
    })
    .await
    .expect("a shard");
    let a_epoch = shard["bootEpoch"].as_u64().expect("epoch");
    cluster.central_mut().stop().await.expect("stop the center");
    until_partitioned(&a, "a-probe").await;
    let offline = a
        .reserve("offline", SUBJECT, ROUTE, 50)
        .await
        .expect("answer");
    assert_eq!(offline.status, 201, "{offline:?}");
    assert_eq!(offline.body["path"]["kind"], "shard", "{offline:?}");

    // A's disk, copied while its shard was open: a backup, and B's disk.
    cluster.agent_mut(0).stop().await.expect("stop A");
    cluster.agent_mut(1).stop().await.expect("stop B");
    let backup = cluster.dir().join("a-backup");
    copy_journal(&cluster.agent(0).data_dir(), &backup);
    copy_journal(&cluster.agent(0).data_dir(), &cluster.agent(1).data_dir());

    // B, another identity on A's journal, admits nothing from A's shard.
    cluster
        .agent_mut(1)
        .start()
        .await
        .expect("B on A's journal");
    admits_nothing(&b, "b").await;
    // A restarted, then restarted again on the restored backup: its old
    // shard is closed both times, never used.
    cluster.agent_mut(0).start().await.expect("restart A");
    admits_nothing(&a, "a-restarted").await;
    cluster.agent_mut(0).stop().await.expect("stop A");
    copy_journal(&backup, &cluster.agent(0).data_dir());
    cluster
        .agent_mut(0)
        .start()
        .await
        .expect("A on the restored backup");
    admits_nothing(&a, "a-restored").await;

    // The center returns: A registers a new boot epoch; the shard's 150
    // unused units (50 were in flight: unknown) are re-minted exactly once,
    // though A closed it twice and B holds a copy.
    cluster
        .central_mut()
        .start()
        .await
        .expect("the center returns");
    let new_epoch = cluster
        .agent_mut(0)
        .wait_for_boot(a_epoch)
        .await
        .expect("boot");
    assert!(new_epoch > a_epoch);
    cluster
        .agent_mut(1)
        .wait_for_boot(b_epoch)
        .await
        .expect("boot");
    let central = cluster.central();
    let account = wait_until("the old shard is reconciled", WAIT, || async {
        let view = central.accounts(SUBJECT, ROUTE).await?;
        Ok(view
            .accounts
            .into_iter()
            .find(|account| account.terms.minted > 0))
    })
    .await
    .expect("re-minted");
    for agent in [&a, &b] {
        wait_until("the receipts are sent", WAIT, || async {
            Ok((agent.status().await?["pendingReceipts"] == 0).then_some(()))
        })
        .await
        .expect("receipts delivered or refused");
    }
    let view = central.accounts(SUBJECT, ROUTE).await.expect("accounts");
    assert_eq!(
        view.accounts[0].terms.minted, 150,
        "{view:?} (first {account:?})"
    );
    // B holds no shard of A's: whatever it holds now was issued to its own
    // new boot.
    let b_shards = b.shards().await.expect("shards");
    for held in shards(&b_shards) {
        assert!(
            held["shard"] != shard["shard"] || held["closed"] == true,
            "B holds A's shard open: {held}"
        );
    }
    let report = central.audit().await.expect("audit");
    assert!(report.ok, "{:#?}", report.violations);
    cluster.stop().await.expect("a graceful stop");
}

/// A process that cannot come up is an error that names it and quotes the
/// tail of its log, where the cause is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_that_cannot_start_is_named_with_its_log() {
    let mut cluster = start_cluster(1).await;
    cluster.agent_mut(0).stop().await.expect("stop");
    std::fs::write(cluster.agent(0).config_path(), "sockett = \"/x\"\n")
        .expect("a broken configuration");
    let error = cluster
        .agent_mut(0)
        .start()
        .await
        .expect_err("the agent cannot start");
    let message = error.to_string();
    assert!(
        message.contains("agent-a exited before listening"),
        "{message}"
    );
    assert!(
        message.contains("sockett"),
        "the cause is quoted: {message}"
    );
}
