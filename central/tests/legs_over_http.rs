//! Multi-leg reservations over the central API (docs/design.md §3.13):
//! requests, tokens and concurrency of one tenant and model admitted in one
//! transition or not at all, flexible tokens, the 429 naming the limiting
//! leg, the 400s naming the leg's field, and settling per leg. Once per
//! store (redb, and PostgreSQL when a server is configured).

mod common;

use central_client::wire::{SettleBody, StartBody};
use central_client::{CallError, ReserveReply, SettleReply, StartReply};
use common::*;
use ledger::protocol::ErrorCode;
use ledger::{Dimension, LegActual, LegAsk, ReserveRequest, SettleActuals};
use shard_format::{
    AdmissionBudgetV1, DocumentSigner as _, IdempotencyKey, OperationId, Refill, ReservationState,
    Route,
};

fn gpt(dimension: &str) -> Route {
    Route::new(format!("gpt-4o.{dimension}")).expect("valid")
}

/// The example policy set's shape, small: 1000 requests and 1000 tokens
/// (100 a second), and 2 in flight with no refill.
fn policies() -> [AdmissionBudgetV1; 3] {
    let mut requests = policy(1);
    requests.route = gpt("requests");
    let mut tokens = policy(1);
    tokens.route = gpt("tokens");
    let mut concurrency = policy(1);
    concurrency.route = gpt("concurrency");
    concurrency.opening = 2;
    concurrency.burst = 2;
    concurrency.refill = Refill {
        units: 0,
        interval_ms: 1000,
    };
    concurrency.reservation_units_max = 1;
    concurrency.overdraft_units_max = 0;
    concurrency.emergency_shard_units = 1;
    [requests, tokens, concurrency]
}

fn leg(dimension: &str, units: u64, min_units: Option<u64>) -> LegAsk {
    LegAsk {
        subject: subject(),
        route: gpt(dimension),
        units,
        min_units,
    }
}

/// One request of the tests' agent: 1 request, `tokens` tokens (at least
/// `min_tokens`), 1 in flight.
fn llm_request(key: &str, tokens: u64, min_tokens: u64) -> ReserveRequest {
    let signer = agent_signer(1);
    let tokens_leg = leg("tokens", tokens, Some(min_tokens));
    let mut request = ReserveRequest::new(
        signer.key_id().clone(),
        IdempotencyKey::new(key).expect("valid"),
        subject(),
        gpt("requests"),
        1,
        digest_of(key),
    );
    request.reservation = shard_format::ReservationId::derive(
        signer.key_id(),
        &subject(),
        &gpt("requests"),
        &request.idempotency_key,
    );
    request.with_legs(vec![tokens_leg, leg("concurrency", 1, None)])
}

/// `(available, reserved, spent)` of each dimension's current account.
async fn terms(harness: &Harness) -> Vec<(u64, u64, u64)> {
    let mut all = Vec::new();
    for dimension in ["requests", "tokens", "concurrency"] {
        let view = harness
            .operator
            .accounts(&subject(), &gpt(dimension))
            .await
            .expect("the accounts");
        let terms = view.accounts[0].terms;
        all.push((terms.available, terms.reserved, terms.spent));
    }
    all
}

fn refusal(answer: Result<ReserveReply, CallError>) -> Box<ledger::protocol::Refusal> {
    match answer {
        Err(CallError::Rejected(refusal)) => refusal,
        other => panic!("expected a definite refusal, got {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_legs_are_admitted_together_or_not_at_all() {
    for store in stores("legs").await {
        let harness = Harness::start(store).await;
        let name = harness.store.name();
        for policy in policies() {
            harness.publish(&policy).await;
        }
        let agent = harness.agent(agent_signer(1)).await;

        // 700 tokens, then 700 again with a floor of 100: the second gets
        // what is left, 300.
        let first = agent
            .reserve(&llm_request("rq-1", 700, 100))
            .await
            .expect("reserve");
        let ReserveReply::Reserved(first) = first else {
            panic!("[{name}] expected a reservation, got {first:?}");
        };
        let grants = |receipt: &shard_format::LimitReservationV1| -> Vec<u64> {
            let legs = receipt.legs.as_ref().expect("three legs");
            legs.iter().map(|leg| leg.reserved_units).collect()
        };
        assert_eq!(grants(&first), [1, 700, 1], "[{name}]");
        let second = agent
            .reserve(&llm_request("rq-2", 700, 100))
            .await
            .expect("reserve");
        let ReserveReply::Reserved(second) = second else {
            panic!("[{name}] expected a reservation, got {second:?}");
        };
        assert_eq!(grants(&second), [1, 300, 1], "[{name}]");
        assert_eq!(
            terms(&harness).await,
            [(998, 2, 0), (0, 1000, 0), (0, 2, 0)],
            "[{name}] every account's reserved term is the sum of its admitted legs"
        );

        // A third: tokens (1 s to refill the floor of 100) and concurrency
        // (no refill: a hold's 30 s) both refuse; the 429 names the
        // concurrency leg, the longer wait, and nothing is held.
        let refused = refusal(agent.reserve(&llm_request("rq-3", 700, 100)).await);
        assert_eq!(refused.status, 429, "[{name}] {refused:?}");
        assert_eq!(refused.error, ErrorCode::RateLimited);
        assert_eq!(refused.details.leg, Some(2), "[{name}] {refused:?}");
        assert_eq!(refused.details.subject, Some(subject()));
        assert_eq!(refused.details.route, Some(gpt("concurrency")));
        assert_eq!(refused.details.dimension, Some(Dimension::Capacity));
        assert_eq!(refused.details.retry_after_seconds, Some(30));
        assert_eq!(
            terms(&harness).await,
            [(998, 2, 0), (0, 1000, 0), (0, 2, 0)],
            "[{name}] a refused leg leaves every account unchanged"
        );

        // Settle per leg: the first used 500 tokens and frees its slot; its
        // request leg, left out, settles at its reserved 1.
        let operation = OperationId::new("op-1").expect("valid");
        let started = agent
            .start(
                &first.reservation,
                &StartBody {
                    operation_id: operation.clone(),
                    deadline_ms: None,
                },
            )
            .await
            .expect("start");
        let StartReply::Started(started) = started else {
            panic!("[{name}] expected a start, got {started:?}");
        };
        assert_eq!(started.state, ReservationState::Started);
        let actuals = SettleActuals::Legs(vec![
            LegActual {
                subject: subject(),
                route: gpt("tokens"),
                actual_units: 500,
            },
            LegActual {
                subject: subject(),
                route: gpt("concurrency"),
                actual_units: 0,
            },
        ]);
        let settled = agent
            .settle(
                &first.reservation,
                &SettleBody::from((operation.clone(), actuals)),
            )
            .await
            .expect("settle");
        let SettleReply::Settled(settlement) = settled else {
            panic!("[{name}] expected a settlement, got {settled:?}");
        };
        let settled_legs: Vec<(u64, u64)> = settlement
            .legs
            .as_ref()
            .expect("every leg's settlement")
            .iter()
            .map(|leg| (leg.reserved_units, leg.actual_units))
            .collect();
        assert_eq!(settled_legs, [(1, 1), (700, 500), (1, 0)], "[{name}]");
        assert_eq!(
            terms(&harness).await,
            [(998, 1, 1), (200, 300, 500), (1, 1, 0)],
            "[{name}] each leg settled against its own account"
        );
        // The one-number form does not fit three legs: nothing moves.
        let form = agent
            .settle(&second.reservation, &SettleBody::one(operation, 1))
            .await
            .expect_err("refused");
        let form = form.rejection().expect("a definite refusal");
        assert_eq!(
            (form.status, form.error, form.details.field.as_deref()),
            (400, ErrorCode::InvalidLegs, Some("actualUnits")),
            "[{name}] {form:?}"
        );
        harness.assert_audit_clean().await;
        harness.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_legs_are_400_naming_the_field_and_hold_nothing() {
    for store in stores("bad-legs").await {
        let harness = Harness::start(store).await;
        let name = harness.store.name();
        for policy in policies() {
            harness.publish(&policy).await;
        }
        let agent = harness.agent(agent_signer(1)).await;
        let before = terms(&harness).await;
        let base = llm_request("rq-bad", 10, 1);

        let mut nine = base.clone();
        nine.more_legs = (1..9)
            .map(|index| leg(&format!("extra-{index}"), 1, None))
            .collect();
        let mut repeated = base.clone();
        repeated.more_legs[1] = leg("tokens", 1, None);
        let mut floor_above = base.clone();
        floor_above.more_legs[0].min_units = Some(11);
        let mut unknown = base.clone();
        unknown.more_legs[1] = leg("unpublished", 1, None);
        for (request, status, code, field) in [
            (nine, 400, ErrorCode::InvalidLegs, "legs"),
            (repeated, 400, ErrorCode::InvalidLegs, "legs[2].route"),
            (
                floor_above,
                400,
                ErrorCode::InvalidUnits,
                "legs[1].minUnits",
            ),
            (unknown, 400, ErrorCode::NoPolicy, "legs[2].route"),
        ] {
            let refused = refusal(agent.reserve(&request).await);
            assert_eq!(
                (
                    refused.status,
                    refused.error,
                    refused.details.field.as_deref()
                ),
                (status, code, Some(field)),
                "[{name}] {refused:?}"
            );
        }
        assert_eq!(terms(&harness).await, before, "[{name}] nothing held");
        harness.assert_audit_clean().await;
        harness.stop().await;
    }
}
