//! Two enrolled identities against a real central service (`reservoir
//! central serve` through `reservoir::cluster`), once over HTTPS with a
//! generated CA and once over plain HTTP on loopback: gateway B, signing
//! with its own key, tries everything issue #13 found it could do to
//! gateway A (docs/design.md §3.11, §5.2, §5.3):
//!
//! - read, start, settle (for nothing and for far too much), release and
//!   abandon A's reservation: each is answered 404 `reservation_not_found`,
//!   exactly as for an ID that does not exist;
//! - reserve or tombstone the ID A's agent will derive for its next key:
//!   refused (403 `reservation_id_foreign`, 404), and A then reserves it;
//! - send a boot request again (re-signed, so the signature layer's nonce
//!   cache does not see it): the ledger refuses it, 409 `boot_replayed`;
//! - loop boot + shard requests: at most 2 × `emergencyShardUnits` are
//!   retired for B, then 429 `shard_cap_reached`.
//!
//! After B's attempts no account term has moved, and the audit is clean.

use central_client::wire::{BootBody, IssueShardBody, SettleBody, StartBody};
use central_client::{CallError, CentralClient, ReserveReply};
use ledger::ReserveRequest;
use ledger::protocol::ErrorCode;
use ledger::protocol::views::AccountsResponse;
use reservoir::cluster::{Cluster, ClusterOptions, policy, signed_reserve_request};
use shard_format::{
    AdmissionBudgetV1, DocumentSigner as _, Ed25519Signer, EmergencyMode, OperationId, Refill,
    Route, Subject,
};

const BINARY: &str = env!("CARGO_BIN_EXE_reservoir");
const SUBJECT: &str = "tenant-7";
const ROUTE: &str = "chat.generate";
const SHARD_UNITS: u64 = 100;

/// 1000 units, no refill (every unit moved is the test's doing), emergency
/// shards of 100.
fn still_policy() -> AdmissionBudgetV1 {
    let mut policy = policy(SUBJECT, ROUTE, 1);
    policy.refill = Refill {
        units: 0,
        interval_ms: 1000,
    };
    policy.hold_ttl_ms = 6 * 3_600_000;
    policy.emergency_mode = EmergencyMode::Enabled;
    policy.emergency_shard_units = SHARD_UNITS;
    policy
}

/// `agent`'s request under idempotency key `key`: the ID its identity
/// derives.
fn request(agent: &CentralClient, key: &str, units: u64) -> ReserveRequest {
    signed_reserve_request(agent, SUBJECT, ROUTE, key, units).expect("a valid request")
}

#[track_caller]
fn refused_with(result: Result<impl std::fmt::Debug, CallError>, status: u16, code: ErrorCode) {
    let error = result.expect_err("the call must be refused");
    let refusal = error
        .rejection()
        .unwrap_or_else(|| panic!("a definite refusal, got {error}"));
    assert_eq!(
        (refusal.status, refusal.error),
        (status, code),
        "{}",
        refusal.message
    );
}

async fn accounts(cluster: &Cluster) -> AccountsResponse {
    cluster
        .central()
        .accounts(SUBJECT, ROUTE)
        .await
        .expect("accounts")
}

async fn hostile_agent_is_refused(options: ClusterOptions) {
    let cluster = Cluster::start(options).await.expect("the center starts");
    let central = cluster.central();
    central.publish(&still_policy()).await.expect("publish");
    let (signer_a, signer_b) = (
        Ed25519Signer::from_secret_bytes(&[0xa1; 32]),
        Ed25519Signer::from_secret_bytes(&[0xb2; 32]),
    );
    for signer in [&signer_a, &signer_b] {
        central.enroll(signer.key_id()).await.expect("enrol");
    }
    let a = central.as_identity(signer_a).expect("client");
    let b = central.as_identity(signer_b).expect("client");

    // A holds 600.
    let held = request(&a, "a-1", 600);
    let Ok(ReserveReply::Reserved(_)) = a.reserve(&held).await else {
        panic!("A reserves");
    };
    let before = accounts(&cluster).await;

    // B on A's reservation: unseen, whatever it tries.
    let id = held.reservation.clone();
    let operation = OperationId::new("op-b").expect("valid");
    let not_found = |result| refused_with(result, 404, ErrorCode::ReservationNotFound);
    not_found(b.reservation(&id).await.map(|_| ()));
    not_found(
        b.start(
            &id,
            &StartBody {
                operation_id: operation.clone(),
                deadline_ms: None,
            },
        )
        .await
        .map(|_| ()),
    );
    for actual_units in [0, 100_000] {
        not_found(
            b.settle(&id, &SettleBody::one(operation.clone(), actual_units))
                .await
                .map(|_| ()),
        );
    }
    not_found(b.release(&id).await.map(|_| ()));
    not_found(b.abandon(&id, &held.origin()).await.map(|_| ()));

    // B squats the ID A will derive for its next key.
    let next = request(&a, "a-2", 100);
    let squat = ReserveRequest {
        owner: b.identity().expect("b").clone(),
        ..next.clone()
    };
    refused_with(
        b.reserve(&squat).await,
        403,
        ErrorCode::ReservationIdForeign,
    );
    not_found(
        b.abandon(&next.reservation, &next.origin())
            .await
            .map(|_| ()),
    );
    assert_eq!(
        accounts(&cluster).await,
        before,
        "no account term moved while B tried"
    );
    // A goes on: its reservation and its next key are untouched.
    let Ok(ReserveReply::Reserved(_)) = a.reserve(&next).await else {
        panic!("A reserves its next key");
    };
    let receipt = a.reservation(&id).await.expect("A reads its own");
    assert_eq!(receipt.reservation, id);
    // The operator reads B's view of nothing and A's reservation.
    let operator = central.operator().expect("operator");
    assert_eq!(
        operator
            .reservation_as_operator(&id)
            .await
            .expect("the operator reads any")
            .reservation,
        id
    );

    // Boots: the same request again is refused, re-signed or not.
    let boot = BootBody::fresh().expect("randomness");
    let first = b.boot_with(&boot).await.expect("B boots");
    refused_with(b.boot_with(&boot).await, 409, ErrorCode::BootReplayed);

    // Boot + shard loops retire at most twice the shard units for B.
    let subject = Subject::new(SUBJECT).expect("valid");
    let route = Route::new(ROUTE).expect("valid");
    let before_loop = accounts(&cluster).await;
    let mut issued = 0u64;
    let mut refused = 0u64;
    let mut boot = first;
    for _ in 0..5 {
        let body = IssueShardBody {
            subject: subject.clone(),
            route: route.clone(),
            boot_epoch: boot.boot_epoch,
            boot_nonce: boot.boot_nonce,
            shard: None,
        };
        match b.issue_shard(&body).await {
            Ok(_) => issued += 1,
            Err(error) => {
                let refusal = error.rejection().expect("a definite refusal");
                assert_eq!(
                    (refusal.status, refusal.error),
                    (429, ErrorCode::ShardCapReached),
                    "{}",
                    refusal.message
                );
                assert!(refusal.details.retry_after_seconds.is_some());
                refused += 1;
            }
        }
        boot = b.boot().await.expect("B boots again");
    }
    assert_eq!((issued, refused), (2, 3), "the cap is two shards of 100");
    let retired = |view: &AccountsResponse| -> u64 {
        view.accounts
            .iter()
            .map(|account| account.terms.retired_for_emergency)
            .sum()
    };
    assert_eq!(
        retired(&accounts(&cluster).await) - retired(&before_loop),
        2 * SHARD_UNITS
    );
    assert!(central.audit().await.expect("audit").ok);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_agent_is_refused_over_https() {
    hostile_agent_is_refused(ClusterOptions::new(BINARY, 0)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_agent_is_refused_over_plain_http() {
    let mut options = ClusterOptions::new(BINARY, 0);
    options.plain_http = true;
    hostile_agent_is_refused(options).await;
}
