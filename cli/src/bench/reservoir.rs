//! Reservoir's own cases: reserve → start → settle cycles through the
//! agent's socket (healthy and emergency paths) and directly against the
//! central service (signed agent calls), every request durable before its
//! answer. Each request is timed; a cycle counts when its settle answers.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context as _, bail};
use central_client::http_signature;
use central_client::wire::{BatchBody, BatchOperation, ReserveBody, SettleBody, StartBody};
use shard_format::{
    DocumentSigner as _, Ed25519Signer, IdempotencyKey, OperationId, ReservationId, Route, Subject,
    request_digest,
};

use super::load::{Endpoint, HttpConnection, Kind, Lane, LoadResult, Window, run_lanes};
use super::processes::{Agent, Central, ROUTE, publish, wait_until};

/// Which answers a lane expects from the agent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AgentPath {
    /// Forwarded to the central ledger.
    Healthy,
    /// Admitted from an emergency shard.
    Emergency,
}

/// What a lane reads of the agent's reserve answer. Only these fields are
/// taken, borrowed from the body: a whole `serde_json::Value` per answer
/// was client work the echo lanes do not pay, on the cores the agent runs
/// on.
#[derive(serde::Deserialize)]
struct Reserved<'a> {
    #[serde(borrow)]
    reservation: std::borrow::Cow<'a, str>,
    #[serde(borrow)]
    path: ReservedPath<'a>,
}

#[derive(serde::Deserialize)]
struct ReservedPath<'a> {
    #[serde(borrow)]
    kind: std::borrow::Cow<'a, str>,
}

/// Reserve → start → settle cycles over the agent's socket on one pair.
pub async fn agent_cycles(
    agent: &Agent,
    subject: &str,
    path: AgentPath,
    in_flight: usize,
    window: Window,
    prefix: &str,
) -> anyhow::Result<LoadResult> {
    let endpoint = agent.endpoint();
    let subject: Arc<str> = subject.into();
    let prefix: Arc<str> = prefix.into();
    run_lanes(in_flight, window, |index, lane| {
        agent_lane(
            endpoint.clone(),
            subject.clone(),
            prefix.clone(),
            path,
            index,
            lane,
        )
    })
    .await
}

async fn agent_lane(
    endpoint: Endpoint,
    subject: Arc<str>,
    prefix: Arc<str>,
    path: AgentPath,
    index: usize,
    mut lane: Lane,
) -> anyhow::Result<Lane> {
    let mut connection = HttpConnection::open(&endpoint).await?;
    let mut sequence = 0u64;
    while !lane.done() {
        sequence += 1;
        let key = format!("{prefix}-{index}-{sequence}");
        let body = format!(
            r#"{{"idempotencyKey":"{key}","subject":"{subject}","route":"{ROUTE}","units":1}}"#
        );
        let sent = Instant::now();
        let answer = connection
            .request("POST", "/v1/reservations", "", body.as_bytes())
            .await?;
        lane.record(Kind::Reserve, sent);
        if answer.status != 201 {
            lane.error();
            // 503/429: back off a little instead of spinning.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        }
        let reserved: Reserved<'_> = serde_json::from_slice(&answer.body).with_context(|| {
            format!(
                "the reserve answer has no reservation ID and path: {}",
                String::from_utf8_lossy(&answer.body)
            )
        })?;
        let from_shard = reserved.path.kind == "shard";
        if from_shard != (path == AgentPath::Emergency) {
            bail!(
                "expected the {path:?} path, the agent answered {}",
                String::from_utf8_lossy(&answer.body)
            );
        }
        let reservation = reserved.reservation.into_owned();
        let operation = format!(r#"{{"operationId":"op-{key}"}}"#);
        let sent = Instant::now();
        let answer = connection
            .request(
                "POST",
                &format!("/v1/reservations/{reservation}/start"),
                "",
                operation.as_bytes(),
            )
            .await?;
        lane.record(Kind::Other, sent);
        if !answer.is_success() {
            lane.error();
            continue;
        }
        let settle = format!(r#"{{"operationId":"op-{key}","actualUnits":1}}"#);
        let sent = Instant::now();
        let answer = connection
            .request(
                "POST",
                &format!("/v1/reservations/{reservation}/settle"),
                "",
                settle.as_bytes(),
            )
            .await?;
        lane.record(Kind::Other, sent);
        if answer.is_success() {
            lane.cycle_done();
        } else {
            lane.error();
        }
    }
    Ok(lane)
}

/// Reserves `count` units over the agent's socket with `in_flight` lanes
/// and leaves them open (the memory case).
pub async fn agent_open_reservations(
    agent: &Agent,
    subject: &str,
    count: usize,
    in_flight: usize,
    prefix: &str,
) -> anyhow::Result<()> {
    let per_lane = count.div_ceil(in_flight);
    let mut lanes = tokio::task::JoinSet::new();
    for index in 0..in_flight {
        let endpoint = agent.endpoint();
        let subject = subject.to_owned();
        let prefix = prefix.to_owned();
        let todo = per_lane.min(count.saturating_sub(index * per_lane));
        lanes.spawn(async move {
            let mut connection = HttpConnection::open(&endpoint).await?;
            let mut done = 0;
            let mut attempts = 0u64;
            while done < todo {
                attempts += 1;
                let body = format!(
                    r#"{{"idempotencyKey":"{prefix}-{index}-{done}","subject":"{subject}","route":"{ROUTE}","units":1}}"#
                );
                let answer = connection
                    .request("POST", "/v1/reservations", "", body.as_bytes())
                    .await?;
                if answer.status == 201 {
                    done += 1;
                } else if attempts > (todo as u64) * 2 + 100 {
                    bail!(
                        "the agent keeps refusing reserves: {} {}",
                        answer.status,
                        String::from_utf8_lossy(&answer.body)
                    );
                } else {
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
            Ok::<_, anyhow::Error>(())
        });
    }
    while let Some(result) = lanes.join_next().await {
        result.context("a lane panicked")??;
    }
    Ok(())
}

/// Publishes the pair's policy with shards of `shard_units` and lets the
/// agent learn the pair (one healthy cycle) and take its shard.
pub async fn prepare_agent(
    central: &Central,
    agent: &Agent,
    subject: &str,
    shard_units: u64,
) -> anyhow::Result<()> {
    publish(&central.operator, &[subject.to_owned()], shard_units).await?;
    let mut connection = HttpConnection::open(&agent.endpoint()).await?;
    let body = format!(
        r#"{{"idempotencyKey":"prepare-{subject}","subject":"{subject}","route":"{ROUTE}","units":1}}"#
    );
    let answer = connection
        .request("POST", "/v1/reservations", "", body.as_bytes())
        .await?;
    if answer.status != 201 {
        bail!(
            "the agent's first reserve answered {}: {}",
            answer.status,
            String::from_utf8_lossy(&answer.body)
        );
    }
    if shard_units > 0 {
        wait_until(
            Duration::from_secs(30),
            "the agent holds a shard",
            || async {
                let status = agent.status().await?;
                Ok(status["shards"].as_array().is_some_and(|shards| {
                    shards
                        .iter()
                        .any(|shard| shard["subject"] == subject && shard["closed"] == false)
                }))
            },
        )
        .await?;
    }
    Ok(())
}

/// With the central service gone, sends reserves until the agent treats
/// the pair as partitioned and admits from its shard.
pub async fn partition(agent: &Agent, subject: &str) -> anyhow::Result<()> {
    let mut connection = HttpConnection::open(&agent.endpoint()).await?;
    let started = Instant::now();
    for attempt in 0u64.. {
        let body = format!(
            r#"{{"idempotencyKey":"partition-{subject}-{attempt}","subject":"{subject}","route":"{ROUTE}","units":1}}"#
        );
        let answer = connection
            .request("POST", "/v1/reservations", "", body.as_bytes())
            .await?;
        if answer.status == 201 && answer.json()?["path"]["kind"] == "shard" {
            return Ok(());
        }
        if started.elapsed() > Duration::from_secs(60) {
            bail!(
                "the agent never admitted from its shard; last answer {}: {}",
                answer.status,
                String::from_utf8_lossy(&answer.body)
            );
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    unreachable!("the loop returns")
}

/// The accounts a central case spreads over.
#[derive(Debug, Clone)]
pub struct Accounts {
    pub subjects: Arc<Vec<String>>,
}

/// Reserve → start → settle cycles straight to the central service, signed
/// as an agent's calls are, spread over `accounts` (lane `i`'s `n`-th
/// cycle uses account `(i + n·in_flight) mod len`).
pub async fn central_cycles(
    central: &Central,
    signer: Arc<Ed25519Signer>,
    accounts: &Accounts,
    in_flight: usize,
    window: Window,
    prefix: &str,
) -> anyhow::Result<LoadResult> {
    let endpoint = Endpoint::Tcp(central.address);
    let subjects = accounts.subjects.clone();
    let prefix: Arc<str> = prefix.into();
    run_lanes(in_flight, window, |index, lane| {
        central_lane(
            endpoint.clone(),
            signer.clone(),
            subjects.clone(),
            prefix.clone(),
            in_flight,
            index,
            lane,
        )
    })
    .await
}

fn unix_seconds() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_secs())
}

/// One signed request (the agent's headers: RFC 9421 over method, path
/// and content digest).
async fn signed(
    connection: &mut HttpConnection,
    signer: &Ed25519Signer,
    path: &str,
    body: &[u8],
) -> anyhow::Result<super::load::HttpResponse> {
    let headers = http_signature::sign(
        signer,
        "POST",
        path,
        body,
        unix_seconds(),
        &http_signature::Nonce::random(),
    );
    let extra = format!(
        "{}: {}\r\n{}: {}\r\n{}: {}\r\n",
        http_signature::CONTENT_DIGEST,
        headers.content_digest,
        http_signature::SIGNATURE_INPUT,
        headers.signature_input,
        http_signature::SIGNATURE,
        headers.signature
    );
    connection.request("POST", path, &extra, body).await
}

async fn central_lane(
    endpoint: Endpoint,
    signer: Arc<Ed25519Signer>,
    subjects: Arc<Vec<String>>,
    prefix: Arc<str>,
    in_flight: usize,
    index: usize,
    mut lane: Lane,
) -> anyhow::Result<Lane> {
    let mut connection = HttpConnection::open(&endpoint).await?;
    let route = Route::new(ROUTE)?;
    let mut sequence = 0usize;
    while !lane.done() {
        sequence += 1;
        let subject =
            Subject::new(subjects[(index + sequence * in_flight) % subjects.len()].as_str())?;
        let key = IdempotencyKey::new(format!("{prefix}-{index}-{sequence}"))?;
        let (reservation, reserve) = reserve_of_one(&signer, subject, &route, key);
        let reserve = serde_json::to_vec(&reserve)?;
        let sent = Instant::now();
        let answer = signed(&mut connection, &signer, "/v1/reservations", &reserve).await?;
        lane.record(Kind::Reserve, sent);
        if answer.status != 201 {
            lane.error();
            if lane.done() {
                break;
            }
            bail!(
                "the central service refused a reserve: {} {}",
                answer.status,
                String::from_utf8_lossy(&answer.body)
            );
        }
        let operation_id = OperationId::new(format!("op-{reservation}"))?;
        let start = serde_json::to_vec(&StartBody {
            operation_id: operation_id.clone(),
            deadline_ms: None,
        })?;
        let sent = Instant::now();
        let answer = signed(
            &mut connection,
            &signer,
            &format!("/v1/reservations/{reservation}/start"),
            &start,
        )
        .await?;
        lane.record(Kind::Other, sent);
        if !answer.is_success() {
            lane.error();
            continue;
        }
        let settle = serde_json::to_vec(&SettleBody::one(operation_id, 1))?;
        let sent = Instant::now();
        let answer = signed(
            &mut connection,
            &signer,
            &format!("/v1/reservations/{reservation}/settle"),
            &settle,
        )
        .await?;
        lane.record(Kind::Other, sent);
        if answer.is_success() {
            lane.cycle_done();
        } else {
            lane.error();
        }
    }
    Ok(lane)
}

/// A reserve of one unit under the ID `signer` derives from `key`.
fn reserve_of_one(
    signer: &Ed25519Signer,
    subject: Subject,
    route: &Route,
    key: IdempotencyKey,
) -> (ReservationId, ReserveBody) {
    let reservation = ReservationId::derive(signer.key_id(), &subject, route, &key);
    let body = ReserveBody {
        reservation: reservation.clone(),
        idempotency_key: key,
        request_digest: request_digest(&subject, route, 1, None),
        subject,
        route: route.clone(),
        units: 1,
        min_units: None,
        policy_generation: None,
        hold_ttl_ms: None,
        more_legs: Vec::new(),
    };
    (reservation, body)
}

/// Reservations per batch request of [`central_batch_cycles`].
pub const BATCH_CYCLES: usize = 16;

/// Reserve → start → settle cycles against the central service in batches:
/// each of `in_flight / BATCH_CYCLES` lanes sends [`BATCH_CYCLES`] reserves
/// in one `POST /v1/batch`, then their starts in one, then their settles
/// in one; `in_flight` reservations are under way at once. A request is a
/// batch; a cycle is one reservation settled.
pub async fn central_batch_cycles(
    central: &Central,
    signer: Arc<Ed25519Signer>,
    accounts: &Accounts,
    in_flight: usize,
    window: Window,
    prefix: &str,
) -> anyhow::Result<LoadResult> {
    let endpoint = Endpoint::Tcp(central.address);
    let subjects = accounts.subjects.clone();
    let prefix: Arc<str> = prefix.into();
    let lanes = (in_flight / BATCH_CYCLES).max(1);
    run_lanes(lanes, window, |index, lane| {
        central_batch_lane(
            endpoint.clone(),
            signer.clone(),
            subjects.clone(),
            prefix.clone(),
            index,
            lane,
        )
    })
    .await
}

async fn central_batch_lane(
    endpoint: Endpoint,
    signer: Arc<Ed25519Signer>,
    subjects: Arc<Vec<String>>,
    prefix: Arc<str>,
    index: usize,
    mut lane: Lane,
) -> anyhow::Result<Lane> {
    let mut connection = HttpConnection::open(&endpoint).await?;
    let route = Route::new(ROUTE)?;
    let mut sequence = 0usize;
    while !lane.done() {
        let mut reserves = Vec::with_capacity(BATCH_CYCLES);
        let mut starts = Vec::with_capacity(BATCH_CYCLES);
        let mut settles = Vec::with_capacity(BATCH_CYCLES);
        for _ in 0..BATCH_CYCLES {
            sequence += 1;
            let subject = Subject::new(subjects[(index + sequence) % subjects.len()].as_str())?;
            let key = IdempotencyKey::new(format!("{prefix}-{index}-{sequence}"))?;
            let (reservation, reserve) = reserve_of_one(&signer, subject, &route, key);
            let operation_id = OperationId::new(format!("op-{reservation}"))?;
            reserves.push(BatchOperation::Reserve(reserve));
            starts.push(BatchOperation::Start {
                reservation: reservation.clone(),
                body: StartBody {
                    operation_id: operation_id.clone(),
                    deadline_ms: None,
                },
            });
            settles.push(BatchOperation::Settle {
                reservation,
                body: SettleBody::one(operation_id, 1),
            });
        }
        let mut settled = 0;
        for (kind, operations) in [
            (Kind::Reserve, reserves),
            (Kind::Other, starts),
            (Kind::Other, settles),
        ] {
            let body = serde_json::to_vec(&BatchBody { operations })?;
            let sent = Instant::now();
            let answer = signed(&mut connection, &signer, "/v1/batch", &body).await?;
            lane.record(kind, sent);
            let results: serde_json::Value = serde_json::from_slice(&answer.body)?;
            let answered = results["results"].as_array().map_or(0, |results| {
                results
                    .iter()
                    .filter(|result| result["status"].as_u64().is_some_and(|status| status < 300))
                    .count()
            });
            if answer.status != 200 || answered != BATCH_CYCLES {
                lane.error();
                if lane.done() {
                    break;
                }
                bail!(
                    "the central service refused a batch: {} {}",
                    answer.status,
                    String::from_utf8_lossy(&answer.body)
                );
            }
            settled = answered;
        }
        for _ in 0..settled {
            lane.cycle_done();
        }
    }
    Ok(lane)
}

/// A fresh agent identity (its key file in `dir`), enrolled at `central`,
/// for direct calls.
pub async fn direct_identity(
    central: &Central,
    dir: &std::path::Path,
) -> anyhow::Result<Arc<Ed25519Signer>> {
    let path = dir.join("direct.key");
    central_client::key_file::generate(&path)?;
    let signer = central_client::key_file::load(&path)?;
    central.operator.enroll_gateway(signer.key_id()).await?;
    Ok(Arc::new(signer))
}
