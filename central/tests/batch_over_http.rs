//! `POST /v1/batch` (docs/design.md §6.3): many reservation calls of one
//! agent under one signature, applied in order and answered in order, each
//! result the status and body its single call would have answered. A
//! malformed operation is its own 400 and the others go on; a malformed
//! envelope, an empty batch or one above `BATCH_OPERATIONS_MAX` is a 400 of
//! the whole; the signature covers the whole body and is checked once.
//! The mixed and refused cases run once per store (redb, and PostgreSQL
//! when a server is configured); the edges run on redb.

mod common;

use central_client::wire::{
    AbandonBody, BATCH_OPERATIONS_MAX, BatchBody, BatchOperation, ReserveBody, StartBody,
};
use central_client::{AgentCall, CallError, CentralClient};
use common::*;
use ledger::protocol::{Answer, Answered, Body, ErrorCode, Outcome, Refusal};
use ledger::{ReservationOrigin, ReserveRequest};
use reqwest::{Method, StatusCode};
use shard_format::{IdempotencyKey, OperationId, ReservationId, ReservationState};

fn answered(result: &Result<Answer, CallError>) -> &Answered {
    match result {
        Ok(Ok(answered)) => answered,
        other => panic!("expected an answer, got {other:?}"),
    }
}

fn refused(result: &Result<Answer, CallError>) -> &Refusal {
    match result {
        Ok(Err(refusal)) => refusal,
        other => panic!("expected a refusal, got {other:?}"),
    }
}

fn receipt_state(answered: &Answered) -> ReservationState {
    match &answered.body {
        Body::Reservation(receipt) => receipt.state,
        other => panic!("expected a receipt, got {other:?}"),
    }
}

fn origin(key: &str) -> ReservationOrigin {
    ReservationOrigin {
        subject: subject(),
        route: route(),
        idempotency_key: IdempotencyKey::new(key).expect("valid"),
    }
}

fn operation(name: &str) -> OperationId {
    OperationId::new(name).expect("valid")
}

/// The value of one series of the service's `/metrics`.
async fn series(operator: &CentralClient, name: &str) -> u64 {
    let text = operator.metrics().await.expect("metrics");
    text.lines()
        .find_map(|line| line.strip_prefix(name)?.trim().parse().ok())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mixed_batch_answers_each_call_as_its_single_call_would() {
    for store in stores("batch-mixed").await {
        let harness = Harness::start(store).await;
        let name = harness.store.name();
        harness.publish(&policy(1)).await;
        let agent = harness.agent(agent_signer(1)).await;
        let first = reserve_request("b-1", 10);
        let second = reserve_request("b-2", 20);

        // Applied in order: the read after the reserves finds the first.
        let results = agent
            .batch(&[
                AgentCall::Reserve(first.clone()),
                AgentCall::Reserve(second.clone()),
                AgentCall::Get(first.reservation.clone()),
            ])
            .await;
        assert_eq!(results.len(), 3, "[{name}]");
        for result in &results[..2] {
            let reserved = answered(result);
            assert_eq!(
                (reserved.status, reserved.outcome),
                (201, Outcome::Reserved),
                "[{name}]"
            );
        }
        let found = answered(&results[2]);
        assert_eq!((found.status, found.outcome), (200, Outcome::Found));
        assert_eq!(receipt_state(found), ReservationState::Reserved);

        let results = agent
            .batch(&[
                AgentCall::Start(
                    first.reservation.clone(),
                    StartBody {
                        operation_id: operation("op-1"),
                        deadline_ms: None,
                    },
                ),
                AgentCall::Release(second.reservation.clone()),
                AgentCall::Abandon(reservation_id("b-3"), origin("b-3").into()),
                AgentCall::Settle(
                    first.reservation.clone(),
                    central_client::wire::SettleBody::one(operation("op-1"), 7),
                ),
                AgentCall::Get(second.reservation.clone()),
            ])
            .await;
        let outcomes: Vec<(u16, Outcome)> = results
            .iter()
            .map(|result| {
                let answered = answered(result);
                (answered.status, answered.outcome)
            })
            .collect();
        assert_eq!(
            outcomes,
            [
                (200, Outcome::Started),
                (200, Outcome::Released),
                (200, Outcome::Tombstoned),
                (200, Outcome::Settled),
                (200, Outcome::Found),
            ],
            "[{name}]"
        );
        assert_eq!(
            receipt_state(answered(&results[4])),
            ReservationState::Released
        );

        // The very answers of the single calls: a read, and a repeated
        // settle (its first receipt).
        let single = agent
            .answer(AgentCall::Get(second.reservation.clone()))
            .await
            .expect("answered");
        assert_eq!(Ok(answered(&results[4]).clone()), single, "[{name}]");
        let again = agent
            .answer(AgentCall::Settle(
                first.reservation.clone(),
                central_client::wire::SettleBody::one(operation("op-1"), 7),
            ))
            .await
            .expect("answered");
        let again = again.expect("a settlement");
        assert_eq!(again.outcome, Outcome::Duplicate);
        assert_eq!(again.body, answered(&results[3]).body, "[{name}]");

        // Counted as the single calls are.
        let operator = &harness.operator;
        assert_eq!(
            series(
                operator,
                "reservoir_reservations_total{outcome=\"reserved\",dimension=\"\"}"
            )
            .await,
            2,
            "[{name}]"
        );
        assert_eq!(
            series(operator, "reservoir_settlements_total{outcome=\"settled\"}").await,
            1,
            "[{name}]"
        );
        harness.assert_audit_clean().await;
        harness.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_operation_is_its_own_answer_and_the_others_go_on() {
    for store in stores("batch-refused").await {
        let harness = Harness::start(store).await;
        let name = harness.store.name();
        harness.publish(&policy(1)).await;
        let agent = harness.agent(agent_signer(1)).await;
        let other = harness.agent(agent_signer(2)).await;
        let theirs = reserve_request_by(&agent_signer(2), "theirs", 5);
        other.reserve(&theirs).await.expect("their reservation");

        // An ID derived from another identity, another's reservation, an
        // unknown one, one beyond the policy's largest reservation, and
        // one that goes through.
        let mut foreign = reserve_request("foreign", 5);
        foreign.reservation = theirs.reservation.clone();
        let too_large = reserve_request("too-large", 5_000);
        let fine = reserve_request("fine", 5);
        let results = agent
            .batch(&[
                AgentCall::Reserve(foreign),
                AgentCall::Get(theirs.reservation.clone()),
                AgentCall::Release(theirs.reservation.clone()),
                AgentCall::Start(
                    reservation_id("unknown"),
                    StartBody {
                        operation_id: operation("op-1"),
                        deadline_ms: None,
                    },
                ),
                AgentCall::Reserve(too_large),
                AgentCall::Reserve(fine.clone()),
            ])
            .await;
        let codes: Vec<(u16, ErrorCode)> = results[..5]
            .iter()
            .map(|result| {
                let refusal = refused(result);
                (refusal.status, refusal.error)
            })
            .collect();
        let single = agent.reserve(&reserve_request("too-large", 5_000)).await;
        let Err(CallError::Rejected(single)) = single else {
            panic!("[{name}] expected a refusal, got {single:?}");
        };
        assert_eq!(
            codes,
            [
                (403, ErrorCode::ReservationIdForeign),
                (404, ErrorCode::ReservationNotFound),
                (404, ErrorCode::ReservationNotFound),
                (404, ErrorCode::ReservationNotFound),
                (single.status, single.error),
            ],
            "[{name}]"
        );
        // The single call's refusal; only the caller's remaining budget
        // moved since (the last reserve of the batch took from it).
        let mut in_batch = refused(&results[4]).clone();
        in_batch.details.rate_limit = single.details.rate_limit;
        assert_eq!(in_batch, *single, "[{name}] the single call's refusal");
        assert_eq!(answered(&results[5]).outcome, Outcome::Reserved, "[{name}]");

        // The other agent's reservation is untouched.
        let theirs_now = other
            .reservation(&theirs.reservation)
            .await
            .expect("their receipt");
        assert_eq!(theirs_now.state, ReservationState::Reserved, "[{name}]");
        harness.assert_audit_clean().await;
        harness.stop().await;
    }
}

async fn harness() -> (Harness, shard_format::Ed25519Signer) {
    redb_with_agent("batch-edges", 1).await
}

fn reserve_body(request: &ReserveRequest) -> serde_json::Value {
    let mut value = serde_json::to_value(ReserveBody::from(request.clone())).expect("serializes");
    value["op"] = "reserve".into();
    value
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_operation_is_a_400_naming_its_field_and_the_rest_go_on() {
    let (harness, signer) = harness().await;
    let base = harness.base_url.clone();
    let reservation = reservation_id("x");
    let body = serde_json::json!({"operations": [
        {"op": "explode", "reservation": reservation},
        {"reservation": reservation},
        {"op": "start", "reservation": reservation, "operationId": "op-1", "bogus": 1},
        {"op": "release"},
        {"op": "getReservation", "reservation": 5},
        7,
        {"op": "settle", "reservation": reservation, "operationId": "op-1"},
        {"op": "abandon", "reservation": reservation, "subject": "tenant-7", "route": "chat.generate"},
        reserve_body(&reserve_request("fine", 5)),
    ]});
    let bytes = serde_json::to_vec(&body).expect("serializes");
    let (status, _, answer) = signed(&base, &signer, Method::POST, "/v1/batch", &bytes, 0).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    let results = answer["results"].as_array().expect("results");
    assert_eq!(results.len(), 9);
    let fields: Vec<(u64, &str, &str)> = results[..8]
        .iter()
        .map(|result| {
            (
                result["status"].as_u64().expect("a status"),
                result["body"]["error"].as_str().expect("a code"),
                result["body"]["field"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(
        fields,
        [
            (400, "invalid_body", "op"),
            (400, "invalid_body", "op"),
            (400, "invalid_body", "bogus"),
            (400, "invalid_body", "reservation"),
            (400, "invalid_body", "reservation"),
            (400, "invalid_body", ""),
            (400, "invalid_body", "actualUnits"),
            (400, "invalid_body", "idempotencyKey"),
        ]
    );
    assert_eq!(results[8]["status"], 201);
    assert_eq!(results[8]["outcome"], "reserved");

    // A duplicate member is refused as a single call's body is.
    let duplicate = format!(
        r#"{{"operations": [{{"op": "release", "reservation": "{reservation}", "reservation": "{reservation}"}}]}}"#
    );
    let (status, _, answer) = signed(
        &base,
        &signer,
        Method::POST,
        "/v1/batch",
        duplicate.as_bytes(),
        0,
    )
    .await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(answer["results"][0]["status"], 400, "{answer}");
    harness.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_batch_is_a_400_naming_the_member() {
    let (harness, signer) = harness().await;
    let base = harness.base_url.clone();
    let fine = reserve_body(&reserve_request("fine", 5));
    let cases: [(&[u8], &str); 6] = [
        (b"not json", ""),
        (b"{}", "operations"),
        (br#"{"operations": null}"#, "operations"),
        (br#"{"operations": []}"#, "operations"),
        (br#"{"operations": {}}"#, "operations"),
        (br#"[1]"#, "operations"),
    ];
    for (body, field) in cases {
        let (status, _, answer) = signed(&base, &signer, Method::POST, "/v1/batch", body, 0).await;
        let text = String::from_utf8_lossy(body);
        assert_eq!(status, StatusCode::BAD_REQUEST, "{text}: {answer}");
        let refusal = error_of(&answer);
        assert_eq!(refusal.error, ErrorCode::InvalidBody, "{text}");
        assert_eq!(
            refusal.details.field.as_deref().unwrap_or(""),
            field,
            "{text}"
        );
    }
    let extra = serde_json::to_vec(&serde_json::json!({"operations": [fine], "extra": 1}))
        .expect("serializes");
    let (status, _, answer) = signed(&base, &signer, Method::POST, "/v1/batch", &extra, 0).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(error_of(&answer).details.field.as_deref(), Some("extra"));
    assert_eq!(harness.accounts().await.accounts[0].terms.reserved, 0);
    harness.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_holds_at_most_its_limit() {
    let (harness, signer) = harness().await;
    let base = harness.base_url.clone();
    let batch = |count: usize, prefix: &str| {
        let operations = (0..count)
            .map(|index| {
                // Keys of 64 characters: the batch is above 64 KiB.
                let key = format!("{prefix}-{index:0>58}");
                BatchOperation::Reserve(reserve_request(&key, 1).into())
            })
            .collect();
        serde_json::to_vec(&BatchBody { operations }).expect("serializes")
    };
    let over = batch(BATCH_OPERATIONS_MAX + 1, "over");
    let (status, _, answer) = signed(&base, &signer, Method::POST, "/v1/batch", &over, 0).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
    let refusal = error_of(&answer);
    assert_eq!(
        (refusal.error, refusal.details.field.as_deref()),
        (ErrorCode::InvalidBody, Some("operations"))
    );
    assert_eq!(harness.accounts().await.accounts[0].terms.reserved, 0);

    // Exactly the limit: above one document's 64 KiB, all answered.
    let full = batch(BATCH_OPERATIONS_MAX, "full");
    assert!(full.len() > central::BODY_SIZE_MAX, "{} bytes", full.len());
    let (status, _, answer) = signed(&base, &signer, Method::POST, "/v1/batch", &full, 0).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    let results = answer["results"].as_array().expect("results");
    assert_eq!(results.len(), BATCH_OPERATIONS_MAX);
    assert!(results.iter().all(|result| result["status"] == 201));
    assert_eq!(
        harness.accounts().await.accounts[0].terms.reserved,
        BATCH_OPERATIONS_MAX as u64
    );
    harness.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_signature_covers_the_whole_batch() {
    let (harness, signer) = harness().await;
    let base = harness.base_url.clone();
    let body = serde_json::to_vec(&BatchBody {
        operations: vec![
            BatchOperation::Reserve(reserve_request("signed-1", 5).into()),
            BatchOperation::Abandon {
                reservation: reservation_id("signed-2"),
                body: AbandonBody::from(origin("signed-2")),
            },
        ],
    })
    .expect("serializes");

    // Signed for one body, sent with another: nothing is applied.
    let headers = central_client::http_signature::sign(
        &signer,
        "POST",
        "/v1/batch",
        &body,
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_secs(),
        &central_client::http_signature::Nonce::random(),
    );
    let mut tampered = body.clone();
    let at = tampered.len() - 3;
    tampered[at] = b' ';
    let (status, _, answer) =
        send(with_signature(http().post(format!("{base}/v1/batch")), &headers).body(tampered))
            .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
    assert_eq!(error_of(&answer).error, ErrorCode::SignatureInvalid);
    assert_eq!(harness.accounts().await.accounts[0].terms.reserved, 0);

    // The signed body is applied once; sent again it is a replay.
    let request =
        || with_signature(http().post(format!("{base}/v1/batch")), &headers).body(body.clone());
    let (status, _, answer) = send(request()).await;
    assert_eq!(status, StatusCode::OK, "{answer}");
    assert_eq!(answer["results"][0]["outcome"], "reserved");
    assert_eq!(answer["results"][1]["outcome"], "tombstoned");
    let (status, _, answer) = send(request()).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED, "{answer}");
    assert_eq!(error_of(&answer).error, ErrorCode::SignatureInvalid);

    // A stranger's batch is refused whole, each call refused so by the
    // client.
    let stranger = harness.stranger(agent_signer(3));
    let results = stranger
        .batch(&[
            AgentCall::Get(reservation_id("signed-1")),
            AgentCall::Get(reservation_id("signed-2")),
        ])
        .await;
    for result in &results {
        assert_eq!(refused(result).error, ErrorCode::UnknownIdentity);
    }
    assert_eq!(harness.accounts().await.accounts[0].terms.reserved, 5);
    harness.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_without_an_answer_leaves_every_outcome_unknown() {
    let (harness, _) = harness().await;
    let agent = harness.agent(agent_signer(1)).await;
    let base = harness.base_url.clone();
    harness.stop().await;
    let results = agent
        .batch(&[
            AgentCall::Reserve(reserve_request("gone-1", 1)),
            AgentCall::Release(reservation_id("gone-2")),
        ])
        .await;
    assert_eq!(results.len(), 2);
    for result in results {
        let Err(error) = result else {
            panic!("expected no answer from {base}, got {result:?}");
        };
        assert!(
            matches!(error, CallError::OutcomeUnknown(_) | CallError::NotSent(_)),
            "{error:?}"
        );
    }
}

#[test]
fn a_reservation_id_of_the_path_is_a_member_of_the_operation() {
    let reservation: ReservationId = reservation_id("member");
    let written = serde_json::to_value(BatchOperation::GetReservation {
        reservation: reservation.clone(),
    })
    .expect("serializes");
    assert_eq!(
        written,
        serde_json::json!({"op": "getReservation", "reservation": reservation})
    );
}
