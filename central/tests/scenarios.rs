//! The worked examples of docs/design.md §4.7 over HTTP, against a real
//! server on loopback, once per store (redb, and PostgreSQL when a server is
//! configured — always in CI). Time is a manual clock; workers run when the
//! test says so. Every scenario ends with a clean audit.

mod common;

use std::future::Future;

use central_client::wire::{IssueShardBody, SettleBody, StartBody};
use central_client::{CallError, ReserveReply, SettleReply, ShardReply, StartReply};
use common::*;
use ledger::Dimension;
use ledger::protocol::{ErrorCode, Outcome};
use shard_format::{
    DocumentSigner as _, Ed25519Verifier, OperationId, ReservationState, ShardCloseReason, ShardId,
    ShardTerminalReceiptV1, Signature, sign_document, verify_document,
};

fn op(name: &str) -> OperationId {
    OperationId::new(name).expect("valid")
}

fn start_body(operation: &str) -> StartBody {
    StartBody {
        operation_id: op(operation),
        deadline_ms: None,
    }
}

fn settle_body(operation: &str, actual_units: u64) -> SettleBody {
    SettleBody::one(op(operation), actual_units)
}

/// Story steps 1–4: three gateways reserve 600 at once; one is admitted,
/// two get 429 with `Retry-After: 2`; a retry returns the same receipt; the
/// settle refunds 400 exactly once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_gateways_one_admission_and_one_refund() {
    for store in stores("story").await {
        let harness = Harness::start(store).await;
        let name = harness.store.name();
        harness.publish(&policy(1)).await;
        let gateways = [
            harness.agent(agent_signer(1)).await,
            harness.agent(agent_signer(2)).await,
            harness.agent(agent_signer(3)).await,
        ];
        let requests = [
            reserve_request_by(&agent_signer(1), "rl-gateway-a", 600),
            reserve_request_by(&agent_signer(2), "rl-gateway-b", 600),
            reserve_request_by(&agent_signer(3), "rl-gateway-c", 600),
        ];
        // Truly concurrent: three connections, sent together.
        let (a, b, c) = tokio::join!(
            gateways[0].reserve(&requests[0]),
            gateways[1].reserve(&requests[1]),
            gateways[2].reserve(&requests[2]),
        );
        let answers = [a, b, c];
        let admitted: Vec<usize> = (0..3)
            .filter(|index| matches!(answers[*index], Ok(ReserveReply::Reserved(_))))
            .collect();
        assert_eq!(
            admitted.len(),
            1,
            "[{name}] exactly one admitted: {answers:?}"
        );
        for (index, answer) in answers.iter().enumerate() {
            if index == admitted[0] {
                continue;
            }
            let error = answer.as_ref().expect_err("the others are refused");
            let rejection = error.rejection().expect("a definite refusal");
            assert_eq!(rejection.status, 429, "[{name}]");
            let limit = rejection.rejection().expect("rate limit details");
            assert_eq!(limit.dimension, Dimension::Capacity);
            assert_eq!(limit.policy_generation, 1);
            assert_eq!(limit.retry_after_seconds, Some(2), "200 missing at 100/s");
            let state = limit.rate_limit.expect("the caller's own limit state");
            assert_eq!(state.policy_field(), "\"budget\";q=1000;w=10");
            assert_eq!(
                state.limit_field(limit.retry_after_seconds),
                "\"budget\";r=400;t=2"
            );
        }
        let winner = &gateways[admitted[0]];
        let request = &requests[admitted[0]];
        let accounts = harness.accounts().await;
        assert_eq!(accounts.accounts.len(), 1);
        assert_eq!(accounts.accounts[0].terms.available, 400);
        assert_eq!(accounts.accounts[0].terms.reserved, 600);

        // Step 3: start binds op-1; the client's retry gets the same receipt.
        let started = winner
            .start(&request.reservation, &start_body("op-1"))
            .await
            .expect("start");
        let StartReply::Started(started) = started else {
            panic!("[{name}] expected a start, got {started:?}");
        };
        assert_eq!(started.state, ReservationState::Started);
        let replay = winner
            .reserve(request)
            .await
            .expect("the retry is answered");
        assert_eq!(replay, ReserveReply::Duplicate(started.clone()));
        assert_eq!(harness.accounts().await.accounts[0].terms.reserved, 600);

        // Step 4: actual 200 refunds 400 exactly once.
        let settled = winner
            .settle(&request.reservation, &settle_body("op-1", 200))
            .await
            .expect("settle");
        let SettleReply::Settled(settlement) = settled else {
            panic!("[{name}] expected a settlement, got {settled:?}");
        };
        assert_eq!(settlement.refunded_units, 400);
        assert_eq!(settlement.state, ReservationState::Settled);
        let again = winner
            .settle(&request.reservation, &settle_body("op-1", 200))
            .await
            .expect("the lost ACK's resend");
        assert_eq!(again, SettleReply::Duplicate(settlement));
        let terms = harness.accounts().await.accounts[0].terms;
        assert_eq!(
            (terms.opening, terms.available, terms.reserved, terms.spent),
            (1000, 800, 0, 200),
            "[{name}] 1000 = 800 + 0 + 200 + 0 + 0"
        );
        let metrics = harness.operator.metrics().await.expect("metrics");
        assert!(metrics.contains("reservoir_settle_refunded_units_total 400"));
        assert!(metrics.contains(
            "reservoir_reservations_total{outcome=\"rejected\",dimension=\"capacity\"} 2"
        ));
        harness.assert_audit_clean().await;
        harness.stop().await;
    }
}

/// The same reservation ID and digest returns the first receipt; another
/// digest (or units) under the ID is a 409; an abandoned ID never reserves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotent_replay_and_digest_conflict() {
    for store in stores("idempotency").await {
        let harness = Harness::start(store).await;
        let name = harness.store.name();
        harness.publish(&policy(1)).await;
        let agent = harness.agent(agent_signer(1)).await;
        let request = reserve_request("rl-replayed", 100);
        let first = agent.reserve(&request).await.expect("reserve");
        let ReserveReply::Reserved(receipt) = first else {
            panic!("[{name}] expected a reservation, got {first:?}");
        };
        // Many concurrent replays: all the same receipt, nothing reserved twice.
        let replays = join_all(
            (0..16)
                .map(|_| {
                    let agent = agent.clone();
                    let request = request.clone();
                    async move { agent.reserve_with_retry(&request).await }
                })
                .collect(),
        )
        .await;
        for replay in replays {
            assert_eq!(
                replay.expect("replayed"),
                ReserveReply::Duplicate(receipt.clone())
            );
        }
        assert_eq!(harness.accounts().await.accounts[0].terms.reserved, 100);

        let mut other_digest = request.clone();
        other_digest.request_digest = digest_of("another request");
        let error = agent.reserve(&other_digest).await.expect_err("conflict");
        let rejection = error.rejection().expect("definite");
        assert_eq!(
            (rejection.status, rejection.error),
            (409, ErrorCode::IdempotencyConflict)
        );
        let mut other_units = request.clone();
        other_units.units = 101;
        let error = agent.reserve(&other_units).await.expect_err("conflict");
        assert_eq!(error.rejection().map(|r| r.status), Some(409));

        // RESERVATION_UNKNOWN resolved by abandoning: a late duplicate never reserves.
        let lost = reserve_request("rl-lost", 50);
        let abandoned = agent
            .abandon(&lost.reservation, &lost.origin())
            .await
            .expect("abandon");
        assert_eq!(abandoned.outcome, Outcome::Tombstoned);
        let late = agent.reserve(&lost).await.expect_err("a late duplicate");
        assert_eq!(
            late.rejection().map(|r| r.error),
            Some(ErrorCode::ReservationAbandoned)
        );
        let lookup = agent
            .reservation(&lost.reservation)
            .await
            .expect_err("no receipt");
        assert_eq!(lookup.rejection().map(|r| r.status), Some(404));
        // Abandoning a RESERVED one releases it.
        let abandoned = agent
            .abandon(&request.reservation, &request.origin())
            .await
            .expect("abandon");
        assert_eq!(abandoned.outcome, Outcome::Abandoned);
        let terms = harness.accounts().await.accounts[0].terms;
        assert_eq!((terms.available, terms.reserved), (1000, 0));
        let unknown = agent
            .reservation(&reservation_id("rl-never-sent"))
            .await
            .expect_err("unknown");
        assert_eq!(
            unknown.rejection().map(|r| r.error),
            Some(ErrorCode::ReservationNotFound)
        );
        harness.assert_audit_clean().await;
        harness.stop().await;
    }
}

/// Runs futures as tasks (concurrently) and collects their results.
async fn join_all<T: Send + 'static>(
    futures: Vec<impl Future<Output = T> + Send + 'static>,
) -> Vec<T> {
    let handles: Vec<_> = futures.into_iter().map(tokio::spawn).collect();
    let mut results = Vec::with_capacity(handles.len());
    for handle in handles {
        results.push(handle.await.expect("task"));
    }
    results
}

/// A start before `expiresAt` wins (and expiry leaves it alone); at or after
/// it the reservation expires and its units come back, whether the sweep or
/// the start gets there first. A started reservation past its deadline is
/// `USAGE_UNKNOWN`: its units stay reserved until a receipt settles it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn started_versus_expired() {
    for store in stores("expiry").await {
        let harness = Harness::start(store).await;
        let name = harness.store.name();
        harness.publish(&policy(1)).await;
        let agent = harness.agent(agent_signer(1)).await;
        let mut ids = Vec::new();
        for index in 0..8 {
            let mut request = reserve_request(&format!("rl-hold-{index}"), 10);
            request.hold_ttl_ms = Some(1000);
            agent.reserve(&request).await.expect("reserve");
            ids.push(request.reservation);
        }
        // One millisecond before expiry: starts and the sweep race; starts win.
        harness.clock.advance_ms(999);
        let early = ids[..4].to_vec();
        let starts = {
            let agent = agent.clone();
            tokio::spawn(async move {
                let mut results = Vec::new();
                for id in early {
                    results.push(agent.start(&id, &start_body(&format!("op-{id}"))).await);
                }
                results
            })
        };
        harness.workers().await;
        for result in starts.await.expect("task") {
            assert!(
                matches!(result, Ok(StartReply::Started(_))),
                "[{name}] {result:?}"
            );
        }
        // At expiry: the sweep and the remaining starts race; expiry wins.
        harness.clock.advance_ms(1);
        let late = ids[4..].to_vec();
        let starts = {
            let agent = agent.clone();
            tokio::spawn(async move {
                let mut results = Vec::new();
                for id in late {
                    results.push(agent.start(&id, &start_body(&format!("op-{id}"))).await);
                }
                results
            })
        };
        harness.workers().await;
        for result in starts.await.expect("task") {
            let error = result.expect_err("expired");
            assert_eq!(
                error.rejection().map(|r| r.error),
                Some(ErrorCode::ReservationExpired),
                "[{name}]"
            );
        }
        for (index, id) in ids.iter().enumerate() {
            let receipt = agent.reservation(id).await.expect("lookup");
            let expected = if index < 4 {
                ReservationState::Started
            } else {
                ReservationState::Expired
            };
            assert_eq!(receipt.state, expected, "[{name}] {id}");
        }
        let terms = harness.accounts().await.accounts[0].terms;
        assert_eq!((terms.available, terms.reserved), (960, 40), "[{name}]");

        // Past the start's deadline (the hold TTL): USAGE_UNKNOWN, units kept.
        harness.clock.advance_ms(30_000);
        harness.workers().await;
        let receipt = agent.reservation(&ids[0]).await.expect("lookup");
        assert_eq!(receipt.state, ReservationState::UsageUnknown, "[{name}]");
        assert_eq!(harness.accounts().await.accounts[0].terms.reserved, 40);
        // Only an operation receipt ends it.
        let settled = agent
            .settle(&ids[0], &settle_body(&format!("op-{}", ids[0]), 4))
            .await
            .expect("settle");
        assert!(matches!(settled, SettleReply::Settled(_)));
        let terms = harness.accounts().await.accounts[0].terms;
        assert_eq!((terms.reserved, terms.spent), (30, 4), "[{name}]");
        harness.assert_audit_clean().await;
        harness.stop().await;
    }
}

/// Story steps 5–7: an overage beyond `available` is debt; admission is 0
/// (429, dimension debt) until a refill repays it; the next refill reaches
/// `available` and admission resumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn overdraft_debt_refill_and_resume() {
    for store in stores("debt").await {
        let harness = Harness::start(store).await;
        let name = harness.store.name();
        harness.publish(&policy(1)).await;
        let agent = harness.agent(agent_signer(1)).await;
        // To available 800, as after the story.
        let first = reserve_request("rl-first", 600);
        agent.reserve(&first).await.expect("reserve");
        agent
            .start(&first.reservation, &start_body("op-1"))
            .await
            .expect("start");
        agent
            .settle(&first.reservation, &settle_body("op-1", 200))
            .await
            .expect("settle");
        // Step 5: reserve 500, actual 900.
        let second = reserve_request("rl-second", 500);
        agent.reserve(&second).await.expect("reserve");
        agent
            .start(&second.reservation, &start_body("op-2"))
            .await
            .expect("start");
        let settled = agent
            .settle(&second.reservation, &settle_body("op-2", 900))
            .await
            .expect("settle");
        let SettleReply::Settled(settlement) = settled else {
            panic!("[{name}] {settled:?}");
        };
        assert_eq!(settlement.state, ReservationState::SettledWithDebt);
        assert_eq!(settlement.overdraft_units, 100);
        let view = harness.accounts().await;
        let terms = view.accounts[0].terms;
        assert_eq!(
            (
                terms.available,
                terms.spent,
                terms.overdraft_issued,
                view.debt
            ),
            (0, 1100, 100, 100),
            "[{name}] 1000 + 0 + 100 = 0 + 0 + 1100 + 0 + 0"
        );
        let refused = agent
            .reserve(&reserve_request("rl-while-indebted", 10))
            .await
            .expect_err("admission is 0 while debt is uncleared");
        assert_eq!(
            rejected_dimension(&refused),
            Some(Dimension::Debt),
            "[{name}]"
        );
        // Step 6: one refill of 100 repays first.
        harness.clock.advance_ms(1000);
        harness.workers().await;
        let view = harness.accounts().await;
        let terms = view.accounts[0].terms;
        assert_eq!(
            (
                terms.minted,
                terms.overdraft_repaid,
                view.debt,
                terms.available
            ),
            (100, 100, 0, 0),
            "[{name}] 1000 + 100 + 100 = 0 + 0 + 1100 + 0 + 100"
        );
        let refused = agent
            .reserve(&reserve_request("rl-after-repay", 10))
            .await
            .expect_err("nothing available yet");
        assert_eq!(rejected_dimension(&refused), Some(Dimension::Capacity));
        // Step 7: the next refill reaches available; admission resumes.
        harness.clock.advance_ms(1000);
        harness.workers().await;
        assert_eq!(harness.accounts().await.accounts[0].terms.available, 100);
        let resumed = agent
            .reserve(&reserve_request("rl-resumed", 50))
            .await
            .expect("admission resumed");
        assert!(matches!(resumed, ReserveReply::Reserved(_)), "[{name}]");
        harness.assert_audit_clean().await;
        harness.stop().await;
    }
}

/// An overdraft above `overdraftUnitsMax` records the full debt and freezes
/// the route; unfreezing leaves the debt to be repaid first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn breach_freezes_the_route() {
    for store in stores("breach").await {
        let harness = Harness::start(store).await;
        let name = harness.store.name();
        harness.publish(&policy(1)).await;
        let agent = harness.agent(agent_signer(1)).await;
        let request = reserve_request("rl-breach", 500);
        agent.reserve(&request).await.expect("reserve");
        agent
            .start(&request.reservation, &start_body("op-b"))
            .await
            .expect("start");
        // Available 500 after the reserve; actual 1300: 500 from available,
        // 300 of debt above the 200 allowed.
        agent
            .settle(&request.reservation, &settle_body("op-b", 1300))
            .await
            .expect("settle");
        let view = harness.accounts().await;
        assert!(view.frozen, "[{name}] the route is frozen");
        assert_eq!(view.debt, 300, "[{name}] the debt is recorded in full");
        // Logged (event=breach_freeze) and counted once.
        let breach_freezes = || async {
            let text = harness.operator.metrics().await.expect("metrics");
            text.lines()
                .find_map(|line| line.strip_prefix("reservoir_breach_freezes_total "))
                .map(str::to_owned)
        };
        assert_eq!(breach_freezes().await.as_deref(), Some("1"), "[{name}]");
        // The same settle again freezes nothing new.
        agent
            .settle(&request.reservation, &settle_body("op-b", 1300))
            .await
            .expect("a repeated settle");
        assert_eq!(breach_freezes().await.as_deref(), Some("1"), "[{name}]");
        let refused = agent
            .reserve(&reserve_request("rl-frozen", 10))
            .await
            .expect_err("frozen");
        assert_eq!(
            rejected_dimension(&refused),
            Some(Dimension::Frozen),
            "[{name}]"
        );
        let limit = refused.rejection().and_then(|r| r.rejection());
        // Waiting alone will not help, yet every 429 says when to ask again.
        assert_eq!(
            limit.and_then(|l| l.retry_after_seconds),
            Some(ledger::RETRY_AFTER_NO_HORIZON_SECONDS),
            "[{name}]"
        );
        let changed = harness
            .operator
            .set_frozen(&subject(), &route(), false)
            .await
            .expect("unfreeze");
        assert!(changed.changed);
        let refused = agent
            .reserve(&reserve_request("rl-unfrozen", 10))
            .await
            .expect_err("the debt is still owed");
        assert_eq!(
            rejected_dimension(&refused),
            Some(Dimension::Debt),
            "[{name}]"
        );
        harness.assert_audit_clean().await;
        harness.stop().await;
    }
}

/// A new generation stops admission in the old one at once while its
/// reservations keep settling in their own account; rolling the new one
/// back stops its admission too, settlement goes on, resuming restores it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generation_crossover_and_rollback() {
    for store in stores("generations").await {
        let harness = Harness::start(store).await;
        let name = harness.store.name();
        harness.publish(&policy(1)).await;
        let agent = harness.agent(agent_signer(1)).await;
        let old = reserve_request("rl-gen-1", 300);
        agent
            .reserve(&old)
            .await
            .expect("reserve under generation 1");
        agent
            .start(&old.reservation, &start_body("op-old"))
            .await
            .expect("start");
        harness.publish(&policy(2)).await;
        let mut pinned = reserve_request("rl-pinned-1", 10);
        pinned.policy_generation = Some(1);
        let refused = agent
            .reserve(&pinned)
            .await
            .expect_err("generation 1 stopped");
        assert_eq!(
            rejected_dimension(&refused),
            Some(Dimension::PolicyGeneration)
        );
        let new = reserve_request("rl-gen-2", 100);
        let ReserveReply::Reserved(receipt) = agent.reserve(&new).await.expect("reserve") else {
            panic!("[{name}] generation 2 admits");
        };
        assert_eq!(receipt.policy_generation, 2);
        // The old reservation settles in its own account.
        agent
            .settle(&old.reservation, &settle_body("op-old", 100))
            .await
            .expect("settle under generation 1");
        let view = harness.accounts().await;
        assert_eq!(view.current_generation, 2);
        let by_generation = |generation| {
            view.accounts
                .iter()
                .find(|account| account.policy_generation == generation)
                .expect("the account exists")
                .terms
        };
        assert_eq!(
            (by_generation(1).spent, by_generation(1).reserved),
            (100, 0)
        );
        assert_eq!(
            (by_generation(2).available, by_generation(2).reserved),
            (900, 100)
        );
        // Roll generation 2 back: admission stops at once, settlement goes on.
        let stale = harness
            .operator
            .set_admission_stopped(&subject(), &route(), 1, true)
            .await
            .expect_err("only the current generation is rolled back");
        assert_eq!(stale.rejection().map(|r| r.status), Some(409));
        harness
            .operator
            .set_admission_stopped(&subject(), &route(), 2, true)
            .await
            .expect("roll back");
        let refused = agent
            .reserve(&reserve_request("rl-rolled-back", 10))
            .await
            .expect_err("rolled back");
        assert_eq!(
            rejected_dimension(&refused),
            Some(Dimension::PolicyGeneration)
        );
        agent
            .start(&new.reservation, &start_body("op-new"))
            .await
            .expect("start");
        agent
            .settle(&new.reservation, &settle_body("op-new", 100))
            .await
            .expect("settlement goes on");
        let report = harness.operator.audit().await.expect("audit");
        assert!(report.pairs[0].admission_stopped);
        assert_eq!(
            report.pairs[0].reserved, 0,
            "[{name}] open reservations drained"
        );
        harness
            .operator
            .set_admission_stopped(&subject(), &route(), 2, false)
            .await
            .expect("resume");
        agent
            .reserve(&reserve_request("rl-resumed", 10))
            .await
            .expect("admission resumed");
        harness.assert_audit_clean().await;
        harness.stop().await;
    }
}

/// Shard issuance carves units out of `available`; the terminal receipt
/// re-mints the confirmed unused units exactly once; only the bound identity
/// may hand it in, an unknown identity gets 401, an old boot cannot take
/// shards.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shard_issue_then_reconcile_once() {
    for store in stores("shards").await {
        let harness = Harness::start(store).await;
        let name = harness.store.name();
        harness.publish(&policy(1)).await;
        let gateway = harness.agent(agent_signer(1)).await;
        let other = harness.agent(agent_signer(2)).await;
        let stranger = harness.stranger(agent_signer(3));
        let unknown = stranger
            .boot_with(&harness.boot_request())
            .await
            .expect_err("not enrolled");
        assert_eq!(unknown.rejection().map(|r| r.status), Some(401), "[{name}]");

        let request = harness.boot_request();
        let boot = gateway.boot_with(&request).await.expect("boot");
        // The same request again, freshly signed: the ledger refuses the
        // replay, whatever the signature layer's nonce cache knows.
        let replay = gateway.boot_with(&request).await.expect_err("a replay");
        assert_eq!(
            replay.rejection().map(|r| (r.status, r.error)),
            Some((409, ErrorCode::BootReplayed)),
            "[{name}]"
        );
        assert_eq!(boot.boot_epoch, 1);
        let shard_id = ShardId::new("es-test-1").expect("valid");
        let body = IssueShardBody {
            subject: subject(),
            route: route(),
            boot_epoch: boot.boot_epoch,
            boot_nonce: boot.boot_nonce,
            shard: Some(shard_id.clone()),
        };
        let ShardReply::Issued(shard) = gateway.issue_shard(&body).await.expect("issue") else {
            panic!("[{name}] a new shard");
        };
        assert_eq!(shard.allocated_units, 200);
        assert_eq!(
            &shard.gateway_identity,
            gateway.identity().expect("identity")
        );
        let trusted = Ed25519Verifier::new([service_signer().key_id().clone()]);
        verify_document(&shard, &trusted).expect("signed by the service key");
        // The same request again (a retry) is the same shard.
        assert_eq!(
            gateway.issue_shard(&body).await.expect("retry"),
            ShardReply::Duplicate(shard.clone())
        );
        let terms = harness.accounts().await.accounts[0].terms;
        assert_eq!((terms.available, terms.retired_for_emergency), (800, 200));

        // Step 10's terminal receipt: spent 50, confirmed unused 110, unknown 40.
        let mut receipt = ShardTerminalReceiptV1 {
            schema: Default::default(),
            shard: shard_id.clone(),
            subject: subject(),
            route: route(),
            gateway_identity: shard.gateway_identity.clone(),
            boot_epoch: 1,
            allocated_units: 200,
            spent_units: 50,
            confirmed_unused_units: 110,
            unknown_units: 40,
            overdraft_debt_units: 0,
            reason: ShardCloseReason::Restart,
            closed_at: t0(),
            key_id: shard.gateway_identity.clone(),
            signature: Signature::UNSIGNED,
        };
        sign_document(&mut receipt, &agent_signer(1));
        let forbidden = other
            .reconcile_shard(&receipt)
            .await
            .expect_err("wrong identity");
        assert_eq!(
            forbidden.rejection().map(|r| r.status),
            Some(403),
            "[{name}]"
        );
        let stranger_call = stranger
            .reconcile_shard(&receipt)
            .await
            .expect_err("unknown");
        assert_eq!(stranger_call.rejection().map(|r| r.status), Some(401));

        let reconciled = gateway.reconcile_shard(&receipt).await.expect("reconcile");
        assert!(!reconciled.duplicate);
        assert_eq!(reconciled.reconciliation.reminted_units, 110);
        let terms = harness.accounts().await.accounts[0].terms;
        assert_eq!(
            (terms.minted, terms.available, terms.retired_for_emergency),
            (110, 910, 200),
            "[{name}] 1000 + 110 = 910 + 0 + 0 + 200 + 0"
        );
        let again = gateway
            .reconcile_shard(&receipt)
            .await
            .expect("the same receipt again");
        assert!(again.duplicate, "[{name}] reconciliation is exactly once");
        assert_eq!(harness.accounts().await.accounts[0].terms.available, 910);

        // A restart (boot epoch 2) makes the old boot's issuance fail.
        harness.clock.advance_ms(1);
        gateway
            .boot_with(&harness.boot_request())
            .await
            .expect("reboot");
        let mut stale = body.clone();
        stale.shard = Some(ShardId::new("es-test-2").expect("valid"));
        let error = gateway.issue_shard(&stale).await.expect_err("superseded");
        assert_eq!(
            error.rejection().map(|r| r.error),
            Some(ErrorCode::SupersededBoot),
            "[{name}]"
        );
        harness.assert_audit_clean().await;
        harness.stop().await;
    }
}

/// A failed commit answers 503 to its batch (an unknown outcome for the
/// client), nothing of it survives, and a retry under the same ID reserves
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_commit_answers_503_and_changes_nothing() {
    let store = central::SharedMemoryStore::new();
    let mut config = central::ServiceConfig::new(
        central::StoreConfig::Memory(store.clone()),
        service_signer(),
        OPERATOR_TOKEN.to_owned(),
    );
    config.workers = None;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let clock = central::ManualClock::new(t0());
    let service = central::Service::start(config, listener, std::sync::Arc::new(clock))
        .await
        .expect("start");
    let base_url = format!("http://{}", service.local_addr());
    let operator = central_client::CentralClient::new(client_config(&base_url))
        .expect("client")
        .with_operator_token(OPERATOR_TOKEN);
    operator.publish_policy(&policy(1)).await.expect("publish");
    let signer = agent_signer(1);
    operator
        .enroll_gateway(signer.key_id())
        .await
        .expect("enrol");
    let agent = central_client::CentralClient::new(client_config(&base_url))
        .expect("client")
        .with_identity(signer);
    let request = reserve_request("rl-unlucky", 100);
    store.fail_next_commits(1);
    let error = agent.reserve(&request).await.expect_err("the commit fails");
    assert!(matches!(error, CallError::OutcomeUnknown(_)), "{error:?}");
    let view = operator
        .accounts(&subject(), &route())
        .await
        .expect("accounts");
    assert_eq!(
        view.accounts[0].terms.reserved, 0,
        "nothing of the batch survived"
    );
    let retried = agent.reserve_with_retry(&request).await.expect("retry");
    assert!(matches!(retried, ReserveReply::Reserved(_)));
    let metrics = operator.metrics().await.expect("metrics");
    assert!(metrics.contains("reservoir_commit_failures_total 1"));
    assert!(operator.audit().await.expect("audit").ok);
    service.shutdown().await;
}

/// The retention window is checked against the stored policies at start:
/// one millisecond short of `holdTtlMs + executionHardLimitMs + margin`
/// is refused (naming the policy and the floor), the floor itself starts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retention_window_shorter_than_a_stored_policy_needs_is_refused_at_start() {
    let store = central::SharedMemoryStore::new();
    let start = |retention_ms: u64| {
        let store = store.clone();
        async move {
            let mut config = central::ServiceConfig::new(
                central::StoreConfig::Memory(store),
                service_signer(),
                OPERATOR_TOKEN.to_owned(),
            );
            config.workers = None;
            config.ledger.retention_ms = retention_ms;
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let clock = central::ManualClock::new(t0());
            central::Service::start(config, listener, std::sync::Arc::new(clock)).await
        }
    };
    let service = start(ledger::RETENTION_DEFAULT_MS).await.expect("start");
    let operator = central_client::CentralClient::new(client_config(&format!(
        "http://{}",
        service.local_addr()
    )))
    .expect("client")
    .with_operator_token(OPERATOR_TOKEN);
    let published = policy(1);
    operator.publish_policy(&published).await.expect("publish");
    service.shutdown().await;

    let floor =
        published.hold_ttl_ms + published.execution_hard_limit_ms + ledger::RETENTION_MARGIN_MS;
    match start(floor - 1).await {
        Err(central::StartError::Retention(error)) => {
            assert_eq!((error.retention_ms, error.floor_ms), (floor - 1, floor));
            assert_eq!(error.generation, 1);
            let message = error.to_string();
            assert!(message.contains(&floor.to_string()), "{message}");
        }
        Ok(_) => panic!("a window one millisecond short must be refused"),
        Err(other) => panic!("unexpected {other}"),
    }
    let service = start(floor).await.expect("the floor itself is enough");
    service.shutdown().await;
}
