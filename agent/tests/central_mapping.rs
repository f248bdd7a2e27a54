//! The daemon's central calls against the real service: each HTTP outcome
//! must become the very `CentralReply` the in-process central node
//! (`tests/src/central_node.rs`) gives, because the core acts on the codes
//! (`reservation_not_found`, `reservation_abandoned`, `superseded_boot`, `illegal_state`).

use ledger::protocol::ErrorCode;
use std::path::PathBuf;
use std::sync::Arc;

use agent::daemon::execute;
use agent_core::{CentralCall, CentralReply, CentralResult};
use central::{ManualClock, Service, ServiceConfig, StoreConfig};
use central_client::{CentralClient, ClientConfig};
use ledger::{Dimension, ReserveRequest};
use shard_format::{
    BootNonce, DocumentSigner as _, Ed25519Signer, IdempotencyKey, OperationId, ReservationState,
    Route, Subject,
};

const OPERATOR_TOKEN: &str = "test-operator-token";

fn temp_dir(name: &str) -> PathBuf {
    let mut suffix = [0u8; 8];
    getrandom::fill(&mut suffix).expect("randomness");
    let dir = std::env::temp_dir().join(format!("reservoir-{name}-{}", hex::encode(suffix)));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

/// The agent's key in these tests.
fn agent_signer() -> Ed25519Signer {
    Ed25519Signer::from_secret_bytes(&[0x07; 32])
}

/// The agent's request under idempotency key `key` (its derived ID).
fn request(key: &str, units: u64, digest_of: u64) -> ReserveRequest {
    let subject = Subject::new("tenant-7").expect("valid");
    let route = Route::new("chat.generate").expect("valid");
    let digest = shard_format::request_digest(&subject, &route, digest_of, None);
    ReserveRequest::new(
        agent_signer().key_id().clone(),
        IdempotencyKey::new(key).expect("valid"),
        subject,
        route,
        units,
        digest,
    )
}

fn refused(result: &CentralResult) -> Option<ErrorCode> {
    match result {
        CentralResult::Reply(CentralReply::Refused { code, .. }) => Some(*code),
        _ => None,
    }
}

fn receipt_state(result: &CentralResult) -> Option<ReservationState> {
    match result {
        CentralResult::Reply(CentralReply::Reservation(receipt)) => Some(receipt.state),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_service_outcome_becomes_the_reply_the_core_expects() {
    let dir = temp_dir("agent-central-mapping");
    let mut config = ServiceConfig::new(
        StoreConfig::Redb(dir.join("ledger.redb")),
        Ed25519Signer::from_secret_bytes(&[0xc0; 32]),
        OPERATOR_TOKEN.to_owned(),
    );
    config.workers = None;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    // The agent's boot request carries its wall clock: the center's must
    // be within seconds of it.
    let now = central::Clock::now(&central::SystemClock);
    let service = Service::start(config, listener, Arc::new(ManualClock::new(now)))
        .await
        .expect("starts");
    let base_url = format!("http://{}", service.local_addr());
    let operator = CentralClient::new(ClientConfig::new(&base_url))
        .expect("client")
        .with_operator_token(OPERATOR_TOKEN);
    operator
        .publish_policy(&ledger::store::contract::sample_policy(1))
        .await
        .expect("publish");
    let signer = agent_signer();
    operator
        .enroll_gateway(signer.key_id())
        .await
        .expect("enrol");
    let client = CentralClient::new(ClientConfig::new(&base_url))
        .expect("client")
        .with_identity(signer);

    let registered = execute(&client, CentralCall::Register).await;
    assert!(
        matches!(
            registered,
            CentralResult::Reply(CentralReply::Registered { boot_epoch: 1, .. })
        ),
        "{registered:?}"
    );
    assert_eq!(
        execute(&client, CentralCall::Health).await,
        CentralResult::Reply(CentralReply::Healthy)
    );

    // Reserve, duplicate, idempotency conflict, capacity rejection.
    let first = request("rl-first", 600, 600);
    let reserved = execute(&client, CentralCall::Reserve(first.clone())).await;
    assert_eq!(receipt_state(&reserved), Some(ReservationState::Reserved));
    let again = execute(&client, CentralCall::Reserve(first.clone())).await;
    assert_eq!(receipt_state(&again), Some(ReservationState::Reserved));
    let conflict = execute(&client, CentralCall::Reserve(request("rl-first", 600, 7))).await;
    assert_eq!(refused(&conflict), Some(ErrorCode::IdempotencyConflict));
    let rejected = execute(
        &client,
        CentralCall::Reserve(request("rl-second", 600, 600)),
    )
    .await;
    match rejected {
        CentralResult::Reply(CentralReply::Rejected(rejection)) => {
            assert_eq!(rejection.dimension, Dimension::Capacity);
            assert_eq!(rejection.policy_generation, 1);
        }
        other => panic!("expected a rejection, got {other:?}"),
    }

    // Unknown IDs: not_found for get and start.
    let never_sent = request("rl-unknown", 5, 5);
    let unknown = never_sent.reservation.clone();
    let get = execute(
        &client,
        CentralCall::Get {
            reservation: unknown.clone(),
        },
    )
    .await;
    assert_eq!(refused(&get), Some(ErrorCode::ReservationNotFound));
    let start = execute(
        &client,
        CentralCall::Start {
            reservation: unknown.clone(),
            operation_id: OperationId::new("op-1").expect("valid"),
            deadline_ms: None,
        },
    )
    .await;
    assert_eq!(refused(&start), Some(ErrorCode::ReservationNotFound));

    // A settle before the start is refused: start binds the operation first.
    let settle = execute(
        &client,
        CentralCall::Settle {
            reservation: first.reservation.clone(),
            operation_id: OperationId::new("op-1").expect("valid"),
            actuals: ledger::SettleActuals::One(10),
        },
    )
    .await;
    assert_eq!(refused(&settle), Some(ErrorCode::NotStarted));

    // Abandon: an unknown ID is tombstoned and never reserves;
    // a RESERVED one comes back as its receipt.
    let tombstoned = execute(
        &client,
        CentralCall::Abandon {
            reservation: unknown.clone(),
            origin: never_sent.origin(),
        },
    )
    .await;
    assert_eq!(tombstoned, CentralResult::Reply(CentralReply::Tombstoned));
    let late = execute(&client, CentralCall::Reserve(never_sent)).await;
    assert_eq!(refused(&late), Some(ErrorCode::ReservationAbandoned));
    let get = execute(
        &client,
        CentralCall::Get {
            reservation: unknown,
        },
    )
    .await;
    assert_eq!(refused(&get), Some(ErrorCode::ReservationAbandoned));
    let abandoned = execute(
        &client,
        CentralCall::Abandon {
            reservation: first.reservation.clone(),
            origin: first.origin(),
        },
    )
    .await;
    assert!(receipt_state(&abandoned).is_some(), "{abandoned:?}");

    // A shard for a boot that is not the current one.
    let shard = execute(
        &client,
        CentralCall::IssueShard {
            subject: first.subject.clone(),
            route: first.route.clone(),
            boot_epoch: 1,
            boot_nonce: BootNonce([9; 16]),
        },
    )
    .await;
    assert_eq!(refused(&shard), Some(ErrorCode::SupersededBoot));

    service.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
}
