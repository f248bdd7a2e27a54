//! The HTTP edge, request by request with a raw client: strict bodies (400
//! naming the field), the body limit, signatures (401/400), operator tokens,
//! route modes, and what a 2xx carries. The store does not matter here:
//! these run on redb.

mod common;

use central_client::http_signature;
use central_client::{ReserveReply, ShardReply};
use common::*;
use ledger::protocol::ErrorCode;
use reqwest::{Method, StatusCode};
use shard_format::{DocumentSigner, Ed25519Signer, RouteMode};

async fn harness() -> (Harness, Ed25519Signer) {
    redb_with_agent("edges", 9).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_bodies_get_400_naming_the_field() {
    let (harness, signer) = harness().await;
    let base = harness.base_url.clone();
    let digest = shard_format::request_digest(&subject(), &route(), 5, None);
    let cases: Vec<(String, &str)> = vec![
        ("{not json".to_owned(), ""),
        (
            format!(
                r#"{{"reservation":"rl-1","idempotencyKey":"k-1","subject":"tenant-7","route":"chat.generate","units":5,"requestDigest":"{digest}","extra":1}}"#
            ),
            "extra",
        ),
        (
            format!(
                r#"{{"reservation":"rl-1","idempotencyKey":"k-1","subject":"tenant-7","route":"chat.generate","units":5,"requestDigest":"{digest}","holdTtlMs":null}}"#
            ),
            "holdTtlMs",
        ),
        (
            format!(
                r#"{{"reservation":"rl-1","idempotencyKey":"k-1","subject":"tenant-7","route":"chat.generate","units":-5,"requestDigest":"{digest}"}}"#
            ),
            "units",
        ),
        (
            format!(
                r#"{{"reservation":"rl-1","idempotencyKey":"k-1","subject":"tenant-7","route":"chat.generate","units":9007199254740992,"requestDigest":"{digest}"}}"#
            ),
            "units",
        ),
        (
            format!(
                r#"{{"reservation":"rl-1","subject":"tenant-7","route":"chat.generate","units":5,"requestDigest":"{digest}"}}"#
            ),
            "idempotencyKey",
        ),
        (
            r#"{"reservation":"rl 1","idempotencyKey":"k-1","subject":"tenant-7","route":"chat.generate","units":5,"requestDigest":"sha256:00"}"#
                .to_owned(),
            "reservation",
        ),
        (
            r#"{"reservation":"rl-1","idempotencyKey":"k-1","subject":"tenant-7","route":"chat.generate","units":5}"#
                .to_owned(),
            "requestDigest",
        ),
    ];
    for (body, field) in cases {
        let (status, _, answer) = signed(
            &base,
            &signer,
            Method::POST,
            "/v1/reservations",
            body.as_bytes(),
            0,
        )
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{body}: {answer}");
        let error = error_of(&answer);
        assert_eq!(error.error, ErrorCode::InvalidBody);
        assert_eq!(error.details.field.as_deref(), Some(field), "{body}");
        assert!(error.message.contains(field), "{}", error.message);
    }
    // A policy with the wrong schema, as an operator.
    let mut policy = serde_json::to_value(policy(2)).expect("json");
    policy["schema"] = serde_json::json!("admissionBudget.v2");
    let (status, _, answer) = send(
        http()
            .put(format!("{base}/v1/policies"))
            .bearer_auth(OPERATOR_TOKEN)
            .json(&policy),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert_eq!(error_of(&answer).details.field.as_deref(), Some("schema"));
    harness.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bodies_above_the_limit_are_refused() {
    let (harness, signer) = harness().await;
    let body = vec![b' '; central::BODY_SIZE_MAX + 1];
    let (status, _, answer) = signed(
        &harness.base_url,
        &signer,
        Method::POST,
        "/v1/reservations",
        &body,
        0,
    )
    .await;
    assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(error_of(&answer).error, ErrorCode::BodyTooLarge);
    harness.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_calls_must_be_signed_by_an_enrolled_identity() {
    let (harness, signer) = harness().await;
    let base = harness.base_url.clone();
    let body = serde_json::to_vec(&central_client::wire::ReserveBody::from(
        reserve_request_by(&signer, "rl-signed", 5),
    ))
    .expect("json");
    // Unsigned.
    let (status, _, answer) = send(
        http()
            .post(format!("{base}/v1/reservations"))
            .body(body.clone()),
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(error_of(&answer).error, ErrorCode::SignatureInvalid);
    // Signed by a key that is not enrolled.
    let (status, _, answer) = signed(
        &base,
        &agent_signer(10),
        Method::POST,
        "/v1/reservations",
        &body,
        0,
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(error_of(&answer).error, ErrorCode::UnknownIdentity);
    // Too old.
    let (status, _, _) = signed(
        &base,
        &signer,
        Method::POST,
        "/v1/reservations",
        &body,
        -600,
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    // Another key claiming the enrolled identity.
    let forger = agent_signer(11);
    let nonce = http_signature::Nonce::random();
    let mut headers =
        http_signature::sign(&forger, "POST", "/v1/reservations", &body, now(), &nonce);
    headers.signature_input = format!(
        "sig1={}",
        http_signature::signature_params(now(), &nonce, signer.key_id())
    );
    let (status, _, _) = send(
        http()
            .post(format!("{base}/v1/reservations"))
            .header(http_signature::CONTENT_DIGEST, headers.content_digest)
            .header(http_signature::SIGNATURE_INPUT, headers.signature_input)
            .header(http_signature::SIGNATURE, headers.signature)
            .body(body.clone()),
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    // A body that is not the one signed.
    let headers = http_signature::sign(
        &signer,
        "POST",
        "/v1/reservations",
        &body,
        now(),
        &http_signature::Nonce::random(),
    );
    let (status, _, answer) = send(
        http()
            .post(format!("{base}/v1/reservations"))
            .header(http_signature::CONTENT_DIGEST, headers.content_digest)
            .header(http_signature::SIGNATURE_INPUT, headers.signature_input)
            .header(http_signature::SIGNATURE, headers.signature)
            .body(body.replace_units()),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
    // Properly signed: admitted.
    let (status, headers, _) =
        signed(&base, &signer, Method::POST, "/v1/reservations", &body, 0).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(headers["reservoir-outcome"], "reserved");
    // The same signed request sent twice: the replay is refused, even
    // within the skew window.
    let once = http_signature::sign(
        &signer,
        "GET",
        "/v1/reservations/rl-edge",
        b"",
        now(),
        &http_signature::Nonce::random(),
    );
    let send_once = || {
        send(
            http()
                .get(format!("{base}/v1/reservations/rl-edge"))
                .header(http_signature::CONTENT_DIGEST, once.content_digest.clone())
                .header(
                    http_signature::SIGNATURE_INPUT,
                    once.signature_input.clone(),
                )
                .header(http_signature::SIGNATURE, once.signature.clone()),
        )
    };
    let (first, _, _) = send_once().await;
    assert_ne!(first, StatusCode::UNAUTHORIZED, "the first use is accepted");
    let (status, _, answer) = send_once().await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(error_of(&answer).error, ErrorCode::SignatureInvalid);
    assert!(
        error_of(&answer).message.contains("nonce was used before"),
        "{answer}"
    );
    // One second past the skew allowance: stale.
    let skew = http_signature::CREATED_SKEW_SECONDS_MAX as i64;
    let (status, _, _) = signed(
        &base,
        &signer,
        Method::GET,
        "/v1/reservations/rl-edge",
        b"",
        -(skew + 2),
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    // A boot for another identity is forbidden.
    let path = format!("/v1/gateways/{}/boot", agent_signer(12).key_id());
    let (status, _, _) = signed(&base, &signer, Method::POST, &path, b"", 0).await;
    assert_eq!(status, StatusCode::FORBIDDEN);
    harness.stop().await;
}

fn now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("clock")
        .as_secs()
}

trait ReplaceUnits {
    fn replace_units(&self) -> Vec<u8>;
}

impl ReplaceUnits for Vec<u8> {
    fn replace_units(&self) -> Vec<u8> {
        String::from_utf8(self.clone())
            .expect("utf-8")
            .replace("\"units\":5", "\"units\":6")
            .into_bytes()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_calls_need_the_token() {
    let (harness, _) = harness().await;
    let base = harness.base_url.clone();
    let (status, _, answer) = send(http().get(format!("{base}/v1/audit"))).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(error_of(&answer).error, ErrorCode::OperatorTokenRequired);
    let (status, _, answer) = send(
        http()
            .get(format!("{base}/v1/audit"))
            .bearer_auth("not-the-token"),
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(error_of(&answer).error, ErrorCode::OperatorTokenInvalid);
    let (status, _, answer) = send(
        http()
            .put(format!("{base}/v1/gateways/not-a-key"))
            .bearer_auth(OPERATOR_TOKEN),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{answer}");
    // /metrics names every pair's traffic and debt: an operator call too.
    let (status, _, answer) = send(http().get(format!("{base}/metrics"))).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(error_of(&answer).error, ErrorCode::OperatorTokenRequired);
    let (status, _, answer) = send(
        http()
            .get(format!("{base}/metrics"))
            .bearer_auth("not-the-token"),
    )
    .await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    assert_eq!(error_of(&answer).error, ErrorCode::OperatorTokenInvalid);
    let scraped = http()
        .get(format!("{base}/metrics"))
        .bearer_auth(OPERATOR_TOKEN)
        .send()
        .await
        .expect("answered");
    assert_eq!(scraped.status(), StatusCode::OK);
    assert!(
        scraped
            .text()
            .await
            .expect("text")
            .contains("reservoir_reserved_units"),
        "Prometheus text"
    );
    let (status, _, answer) = send(http().get(format!("{base}/v1/nothing"))).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(error_of(&answer).error, ErrorCode::NoSuchEndpoint);
    // A generation that does not rise.
    let republished = harness
        .operator
        .publish_policy(&policy(1))
        .await
        .expect("a retried publish of the same generation is answered");
    assert_eq!(republished.policy_generation, 1);
    harness.publish(&policy(3)).await;
    let refused = harness
        .operator
        .publish_policy(&policy(2))
        .await
        .expect_err("not rising");
    assert_eq!(
        refused.rejection().map(|r| r.error),
        Some(ErrorCode::GenerationNotRising)
    );
    harness.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_and_off_modes() {
    let (harness, signer) = harness().await;
    let agent = harness.agent(signer).await;
    let mut shadow = policy(2);
    shadow.mode = RouteMode::Shadow;
    harness.publish(&shadow).await;
    // Shadow: recorded and admitted, nothing held, would-reject reported.
    let big = reserve_request_by(&agent_signer(9), "rl-shadow-big", 800);
    let reply = agent.reserve(&big).await.expect("admitted");
    assert!(
        matches!(
            reply,
            ReserveReply::Shadow {
                would_reject: None,
                ..
            }
        ),
        "{reply:?}"
    );
    let reply = agent
        .reserve(&reserve_request_by(
            &agent_signer(9),
            "rl-shadow-too-big",
            900,
        ))
        .await
        .expect("admitted anyway");
    assert!(
        matches!(
            reply,
            ReserveReply::Shadow {
                would_reject: Some(ledger::Dimension::ReservationUnitsMax),
                ..
            }
        ),
        "{reply:?}"
    );
    let view = harness.accounts().await;
    assert!(
        view.accounts
            .iter()
            .all(|account| account.terms.reserved == 0)
    );
    let mut off = policy(3);
    off.mode = RouteMode::Off;
    harness.publish(&off).await;
    let reply = agent
        .reserve(&reserve_request_by(&agent_signer(9), "rl-off", 5))
        .await
        .expect("admitted");
    assert_eq!(reply, ReserveReply::NotEnforced);
    // Emergency shards are off unless the policy enables them and enforces.
    let boot = agent
        .boot_with(&harness.boot_request())
        .await
        .expect("boot");
    let refused = agent
        .issue_shard(&central_client::wire::IssueShardBody {
            subject: subject(),
            route: route(),
            boot_epoch: boot.boot_epoch,
            boot_nonce: boot.boot_nonce,
            shard: None,
        })
        .await;
    assert!(
        !matches!(refused, Ok(ShardReply::Issued(_))),
        "no shard while the route is off: {refused:?}"
    );
    harness.assert_audit_clean().await;
    harness.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_expose_outcomes_batches_and_gauges() {
    let (harness, signer) = harness().await;
    let agent = harness.agent(signer).await;
    for index in 0..3 {
        agent
            .reserve(&reserve_request_by(
                &agent_signer(9),
                &format!("rl-metric-{index}"),
                100,
            ))
            .await
            .expect("reserve");
    }
    let text = harness.operator.metrics().await.expect("metrics");
    for needle in [
        "reservoir_reservations_total{outcome=\"reserved\",dimension=\"\"} 3",
        "reservoir_commit_batch_size_count",
        "reservoir_commit_seconds_bucket{le=\"+Inf\"}",
        "reservoir_batch_step_seconds_bucket{step=\"scope\",le=\"+Inf\"}",
        "reservoir_batch_step_seconds_sum{step=\"begin\"}",
        "reservoir_debt_outstanding_units 0",
        "reservoir_frozen_routes 0",
        "reservoir_shard_units_out 0",
        "reservoir_reserved_units 300",
    ] {
        assert!(text.contains(needle), "missing {needle} in\n{text}");
    }
    // Every reserve went through a batch's steps: each step counted.
    for step in ["scope", "begin", "apply"] {
        let prefix = format!("reservoir_batch_step_seconds_count{{step=\"{step}\"}} ");
        let count: u64 = text
            .lines()
            .find_map(|line| line.strip_prefix(&prefix))
            .and_then(|count| count.parse().ok())
            .unwrap_or_else(|| panic!("no {prefix} in\n{text}"));
        assert!(count >= 1, "{step}: {count} batches");
    }
    harness.stop().await;
}

/// docs/design.md §6.1: every answer that is not a 2xx is JSON `{error,
/// message}` with a stable code, the refusals axum would write itself
/// included: 405 (with `Allow`), a path segment that does not decode,
/// an unknown path. Any content type is accepted: every body is JSON.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_edges_answer_json_errors() {
    let (harness, _) = harness().await;
    let base = harness.base_url.clone();
    let refused = |status: StatusCode,
                   headers: &reqwest::header::HeaderMap,
                   answer: &serde_json::Value,
                   code: ErrorCode| {
        assert_eq!(
            headers
                .get(reqwest::header::CONTENT_TYPE)
                .and_then(|value| value.to_str().ok()),
            Some("application/json"),
            "{status}: {answer}"
        );
        let error = error_of(answer);
        assert_eq!(error.error, code, "{status}: {answer}");
        assert!(!error.message.is_empty(), "{answer}");
    };
    // Known paths, methods they do not answer.
    let cases = [
        (Method::DELETE, "/v1/reservations", "POST"),
        (Method::PUT, "/v1/reservations/rl-1", "GET,HEAD"),
        (Method::GET, "/v1/policies", "PUT"),
        (Method::POST, "/healthz", "GET,HEAD"),
    ];
    for (method, path, allow) in cases {
        let (status, headers, answer) =
            send(http().request(method.clone(), format!("{base}{path}"))).await;
        assert_eq!(status, StatusCode::METHOD_NOT_ALLOWED, "{method} {path}");
        refused(status, &headers, &answer, ErrorCode::MethodNotAllowed);
        assert_eq!(headers["allow"], allow, "{method} {path}");
    }
    // Path segments that are not UTF-8 once decoded: refused before
    // anything else is looked at.
    for (method, path) in [
        (Method::GET, "/v1/reservations/%FF"),
        (Method::POST, "/v1/reservations/%E2%82/start"),
        (Method::GET, "/v1/accounts/tenant-7/%C0"),
        (Method::POST, "/v1/gateways/%FF/boot"),
    ] {
        let (status, headers, answer) = send(
            http()
                .request(method, format!("{base}{path}"))
                .bearer_auth(OPERATOR_TOKEN),
        )
        .await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{path}");
        refused(status, &headers, &answer, ErrorCode::InvalidPath);
    }
    // A segment that decodes but is no ID names its field.
    let (status, headers, answer) = send(
        http()
            .get(format!("{base}/v1/reservations/rl%zz"))
            .bearer_auth(OPERATOR_TOKEN),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    refused(status, &headers, &answer, ErrorCode::InvalidPath);
    assert_eq!(
        error_of(&answer).details.field.as_deref(),
        Some("reservation")
    );
    // An unknown path.
    let (status, headers, answer) = send(http().delete(format!("{base}/v2/anything"))).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    refused(status, &headers, &answer, ErrorCode::NoSuchEndpoint);
    // A body that is not JSON, whatever its type says.
    let (status, headers, answer) = send(
        http()
            .put(format!("{base}/v1/policies"))
            .bearer_auth(OPERATOR_TOKEN)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body("{"),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    refused(status, &headers, &answer, ErrorCode::InvalidBody);
    // Any content type, or none: the body is read as JSON.
    let policy = serde_json::to_vec(&policy(2)).expect("json");
    let (status, _, answer) = send(
        http()
            .put(format!("{base}/v1/policies"))
            .bearer_auth(OPERATOR_TOKEN)
            .header(reqwest::header::CONTENT_TYPE, "text/plain")
            .body(policy),
    )
    .await;
    assert_eq!(status, StatusCode::CREATED, "{answer}");
    harness.stop().await;
}
