//! The agent decision core driven through its scenarios: healthy forwarding,
//! lost replies, partitions and emergency shards, restarts, fences, local
//! overage, expiry races and fair starts. Every scenario runs the real agent
//! core against the real central ledger in one process; after each, the
//! central audit must be clean.

// The scenarios of each area of the core, one file each.
mod flexible_rules;
mod legs_rules;
mod retention_rules;
mod shard_rules;
mod sync_rules;

use agent_core::{
    AgentCore, AgentState, CentralCall, CentralReply, GatewayRequest, GatewayReserve,
    GatewayResponse, ReservationPath, ShardStatus,
};
use ledger::protocol::ErrorCode;
use ledger::store::contract::sample_policy;
use ledger::{Dimension, PairKey, invariants};
use reservoir_tests::world::World;
use shard_format::{
    AdmissionBudgetV1, IdempotencyKey, OperationId, ReservationId, Route, ShardCloseReason, Subject,
};

/// Every shard `core` holds, read as `GET /v1/shards` reads them, two to
/// a page: each scenario that looks at its shards walks the pages too.
pub(crate) fn all_shards(core: &AgentCore) -> Vec<ShardStatus> {
    let mut shards = Vec::new();
    let mut after = None;
    loop {
        let page = core.shards(after.as_ref(), 2);
        assert!(
            !page.shards.is_empty() || after.is_none(),
            "a page after {after:?} is empty"
        );
        assert!(page.shards.len() <= 2, "{page:?}");
        shards.extend(page.shards);
        match page.next {
            Some(next) => after = Some(next),
            None => return shards,
        }
    }
}

pub(crate) fn pair() -> PairKey {
    PairKey::new(
        Subject::new("tenant-7").unwrap(),
        Route::new("chat.generate").unwrap(),
    )
}

pub(crate) fn reserve(world: &mut World, agent: usize, key: &str, units: u64) -> GatewayResponse {
    reserve_between(world, agent, key, None, units)
}

/// A reserve of anything from `min_units` (`None`: exactly `units`) to
/// `units`.
pub(crate) fn reserve_between(
    world: &mut World,
    agent: usize,
    key: &str,
    min_units: Option<u64>,
    units: u64,
) -> GatewayResponse {
    let call = world.gateway(
        agent,
        GatewayRequest::Reserve(GatewayReserve {
            idempotency_key: IdempotencyKey::new(key).unwrap(),
            subject: pair().subject,
            route: pair().route,
            units,
            min_units,
            deadline_ms: None,
            priority: None,
            request: None,
            more_legs: Vec::new(),
        }),
    );
    world.response(agent, call).cloned().expect("answered")
}

pub(crate) fn reservation_id(response: &GatewayResponse) -> ReservationId {
    match response {
        GatewayResponse::Reservation { reservation, .. } => reservation.reservation.clone(),
        other => panic!("expected a reservation, got {other:?}"),
    }
}

pub(crate) fn state_of(response: &GatewayResponse) -> AgentState {
    match response {
        GatewayResponse::Reservation { reservation, .. }
        | GatewayResponse::Accepted(reservation) => reservation.state,
        other => panic!("expected a reservation, got {other:?}"),
    }
}

pub(crate) fn start(
    world: &mut World,
    agent: usize,
    id: &ReservationId,
    op: &str,
) -> GatewayResponse {
    let call = world.gateway(
        agent,
        GatewayRequest::Start {
            reservation: id.clone(),
            operation_id: OperationId::new(op).unwrap(),
        },
    );
    world.response(agent, call).cloned().expect("answered")
}

pub(crate) fn settle(
    world: &mut World,
    agent: usize,
    id: &ReservationId,
    op: &str,
    actual: u64,
) -> GatewayResponse {
    let call = world.gateway(
        agent,
        GatewayRequest::Settle {
            reservation: id.clone(),
            operation_id: OperationId::new(op).unwrap(),
            actual_units: actual,
        },
    );
    world.response(agent, call).cloned().expect("answered")
}

pub(crate) fn release(world: &mut World, agent: usize, id: &ReservationId) -> GatewayResponse {
    let call = world.gateway(
        agent,
        GatewayRequest::Release {
            reservation: id.clone(),
        },
    );
    world.response(agent, call).cloned().expect("answered")
}

/// The current account's (available, reserved, spent, retired, minted).
pub(crate) fn central_terms(world: &World) -> (u64, u64, u64, u64, u64) {
    let (_, terms) = world
        .central
        .ledger
        .accounts()
        .last()
        .expect("an account exists");
    (
        terms.available,
        terms.reserved,
        terms.spent,
        terms.retired_for_emergency,
        terms.minted,
    )
}

pub(crate) fn assert_audit_clean(world: &World) {
    let report = invariants::audit(&world.central.ledger);
    assert!(report.is_clean(), "central audit: {:?}", report.violations);
    for node in &world.agents {
        for shard in node.core.shard_ledgers() {
            assert!(
                shard.terms().is_balanced(),
                "shard equation: {:?}",
                shard.terms()
            );
        }
    }
}

/// Policy without emergency shards, so healthy tests see the plain ledger.
pub(crate) fn no_shards_policy() -> AdmissionBudgetV1 {
    let mut policy = sample_policy(1);
    policy.emergency_mode = shard_format::EmergencyMode::Disabled;
    policy.emergency_shard_units = 0;
    policy
}

#[test]
fn healthy_reserve_start_settle_refunds_once() {
    let mut world = World::new(1, no_shards_policy(), |_| {});
    let reserved = reserve(&mut world, 0, "req-1", 600);
    assert_eq!(state_of(&reserved), AgentState::Reserved);
    assert!(matches!(
        reserved,
        GatewayResponse::Reservation { created: true, .. }
    ));
    let id = reservation_id(&reserved);
    assert_eq!(central_terms(&world), (400, 600, 0, 0, 0));

    // The gateway retries after a timeout: the same reservation, nothing new.
    let again = reserve(&mut world, 0, "req-1", 600);
    assert_eq!(reservation_id(&again), id);
    assert_eq!(central_terms(&world), (400, 600, 0, 0, 0));

    assert_eq!(
        state_of(&start(&mut world, 0, &id, "op-1")),
        AgentState::Started
    );
    assert_eq!(
        state_of(&settle(&mut world, 0, &id, "op-1", 200)),
        AgentState::Settled
    );
    assert_eq!(central_terms(&world), (800, 0, 200, 0, 0));
    // The agent's copy of the receipt says what the center's says.
    let record = world.agents[0].core.reservation(&id).expect("the record");
    let central = world.central.ledger.reservation(&id).expect("the center's");
    assert_eq!(record.receipt.as_deref(), Some(&central.receipt));
    // The settle is repeated: nothing moves.
    assert_eq!(
        state_of(&settle(&mut world, 0, &id, "op-1", 200)),
        AgentState::Settled
    );
    assert_eq!(central_terms(&world), (800, 0, 200, 0, 0));
    assert_audit_clean(&world);
}

#[test]
fn three_agents_reserve_600_of_1000_one_admitted() {
    let mut world = World::new(3, no_shards_policy(), |_| {});
    let answers: Vec<GatewayResponse> = (0..3)
        .map(|agent| reserve(&mut world, agent, "req", 600))
        .collect();
    let admitted = answers
        .iter()
        .filter(|a| matches!(a, GatewayResponse::Reservation { .. }))
        .count();
    assert_eq!(admitted, 1);
    for answer in &answers[1..] {
        match answer {
            GatewayResponse::Rejected { rejection, .. } => {
                assert_eq!(rejection.dimension, Dimension::Capacity);
                assert_eq!(rejection.retry_after_seconds, Some(2));
            }
            other => panic!("expected 429, got {other:?}"),
        }
    }
    assert_audit_clean(&world);
}

#[test]
fn same_key_other_request_is_a_conflict() {
    let mut world = World::new(1, no_shards_policy(), |_| {});
    reserve(&mut world, 0, "req-1", 100);
    let other = reserve(&mut world, 0, "req-1", 101);
    assert!(
        matches!(
            other,
            GatewayResponse::Conflict {
                code: ErrorCode::IdempotencyConflict,
                ..
            }
        ),
        "{other:?}"
    );
}

/// An idempotency key names a request of one pair (§3.3: the ID derives
/// from the identity, the pair and the key): the same key on another route
/// is another request, admitted on its own, not a conflict.
#[test]
fn the_same_key_on_another_route_is_another_reservation() {
    let mut world = World::new(1, no_shards_policy(), |_| {});
    let mut embed = no_shards_policy();
    embed.route = Route::new("embed").unwrap();
    let wall = world.now().wall;
    world
        .central
        .operate(ledger::protocol::Operation::Publish(Box::new(embed)), wall)
        .expect("published");
    let chat = reservation_id(&reserve(&mut world, 0, "req-1", 100));
    let call = world.gateway(
        0,
        GatewayRequest::Reserve(GatewayReserve {
            idempotency_key: IdempotencyKey::new("req-1").unwrap(),
            subject: pair().subject,
            route: Route::new("embed").unwrap(),
            units: 100,
            min_units: None,
            deadline_ms: None,
            priority: None,
            request: None,
            more_legs: Vec::new(),
        }),
    );
    let embedded = world.response(0, call).cloned().expect("answered");
    assert_eq!(state_of(&embedded), AgentState::Reserved, "{embedded:?}");
    assert_ne!(reservation_id(&embedded), chat);
    // Each retry still finds its own.
    assert_eq!(reservation_id(&reserve(&mut world, 0, "req-1", 100)), chat);
    assert_audit_clean(&world);
}

/// A route the center has `off` admits without a hold (§3.8), though the
/// agent itself enforces it: the gateway gets the pass-through answer, and
/// a retry asks again.
#[test]
fn a_route_off_at_the_center_passes_through() {
    let mut off = no_shards_policy();
    off.mode = shard_format::RouteMode::Off;
    let mut world = World::new(1, off, |_| {});
    assert_eq!(
        reserve(&mut world, 0, "req-1", 100),
        GatewayResponse::PassThrough
    );
    assert_eq!(
        reserve(&mut world, 0, "req-1", 100),
        GatewayResponse::PassThrough
    );
    assert_eq!(central_terms(&world).1, 0, "nothing held");
}

#[test]
fn lost_reserve_reply_is_resolved_without_a_second_reservation() {
    let mut world = World::new(1, no_shards_policy(), |_| {});
    world.lose_next_reply[0] = true;
    let first = reserve(&mut world, 0, "req-1", 300);
    assert!(
        matches!(
            first,
            GatewayResponse::Unavailable {
                code: ErrorCode::ReservationUnknown,
                ..
            }
        ),
        "{first:?}"
    );
    // The central ledger did reserve; the agent does not know it.
    assert_eq!(central_terms(&world), (700, 300, 0, 0, 0));
    let id = world.agents[0]
        .core
        .reservations()
        .next()
        .unwrap()
        .reservation
        .clone();
    assert_eq!(
        world.agents[0].core.reservation(&id).unwrap().state,
        AgentState::ReservationUnknown
    );
    assert_eq!(
        world.agents[0].core.status().unknown,
        [(id.clone(), AgentState::ReservationUnknown)],
        "the status lists it for the unknown-age gauge"
    );

    // The gateway retries under the same key: the same ID is re-sent and the
    // first reservation comes back; nothing is reserved twice.
    let retry = reserve(&mut world, 0, "req-1", 300);
    assert_eq!(reservation_id(&retry), id);
    assert_eq!(state_of(&retry), AgentState::Reserved);
    assert_eq!(central_terms(&world), (700, 300, 0, 0, 0));
    let reserves = world
        .central_log
        .iter()
        .filter(|(_, call, _)| matches!(call, CentralCall::Reserve(_)))
        .count();
    assert_eq!(
        reserves, 2,
        "one send and one resend, both under the same ID"
    );
    assert_eq!(world.agents[0].core.status().unknown, []);
    assert_audit_clean(&world);
}

#[test]
fn the_status_lists_unknown_reservations_in_id_order() {
    // The core keeps its records in a hash map: the status sorts what it
    // lists, whatever the map's order.
    let mut world = World::new(1, no_shards_policy(), |_| {});
    // Three lost replies: the third partitions the pair.
    for key in ["req-1", "req-2", "req-3"] {
        world.lose_next_reply[0] = true;
        reserve(&mut world, 0, key, 10);
    }
    let unknown = world.agents[0].core.status().unknown;
    assert_eq!(unknown.len(), 3, "{unknown:?}");
    assert!(
        unknown.is_sorted_by(|(a, _), (b, _)| a < b),
        "in ID order: {unknown:?}"
    );
}

#[test]
fn unknown_reserve_resolves_by_resending_under_the_same_id() {
    let mut world = World::new(1, no_shards_policy(), |_| {});
    world.lose_next_reply[0] = true;
    reserve(&mut world, 0, "req-1", 300);
    // Nobody retries: the retry timer re-sends the same reserve, which comes
    // back as the one reservation already made.
    world.advance(1_000);
    let record = world.agents[0].core.reservations().next().unwrap().clone();
    assert_eq!(record.state, AgentState::Reserved);
    assert_eq!(
        central_terms(&world),
        (700, 300, 0, 0, 0),
        "nothing reserved twice"
    );
}

#[test]
fn unknown_reserve_nobody_waits_for_is_abandoned() {
    // A grace period shorter than the hold, so the abandon (not expiry)
    // is what gives the units back.
    let mut world = World::new(1, no_shards_policy(), |config| {
        config.unknown_abandon_grace_ms = 5_000;
    });
    world.lose_next_reply[0] = true;
    reserve(&mut world, 0, "req-1", 300);
    assert_eq!(central_terms(&world), (700, 300, 0, 0, 0));
    // The central ledger stays out of reach for the whole grace period.
    world.partitioned[0] = true;
    let grace = world.agents[0].config.unknown_abandon_grace_ms;
    world.advance(1_000);
    world.advance(grace);
    assert_eq!(
        world.agents[0].core.reservations().next().unwrap().sync,
        Some(agent_core::SyncOp::Abandon),
        "after the grace period the ID is to be abandoned, never replaced"
    );
    // Back online: the abandon releases the units and tombstones the ID.
    world.partitioned[0] = false;
    world.advance(1_000);
    world.advance(1_000);
    let record = world.agents[0].core.reservations().next().unwrap().clone();
    assert_eq!(record.state, AgentState::Abandoned);
    assert_eq!(central_terms(&world), (1000, 0, 0, 0, 0));
    // A late duplicate of the reserve can never reserve again.
    let late = world.central.ledger.reserve(
        ledger::ReserveRequest {
            owner: world.agents[0].config.identity.clone(),
            idempotency_key: record.idempotency_key.clone(),
            reservation: record.reservation.clone(),
            subject: record.subject.clone(),
            route: record.route.clone(),
            units: 300,
            min_units: None,
            policy_generation: None,
            request_digest: record.request_digest,
            hold_ttl_ms: None,
            more_legs: Vec::new(),
        },
        world.now().wall,
    );
    assert_eq!(late.outcome, ledger::ReserveOutcome::Abandoned);
    assert_audit_clean(&world);
}

/// Healthy agent takes a shard, then the partition starts.
pub(crate) fn partitioned_world_with_shard() -> World {
    let mut world = World::new(2, sample_policy(1), |config| {
        config.partition_failures_max = 1;
    });
    // Traffic makes the pair known; the retry timer then asks for a shard.
    let first = reserve(&mut world, 0, "warm-up", 100);
    let id = reservation_id(&first);
    let call = world.gateway(0, GatewayRequest::Release { reservation: id });
    assert!(world.response(0, call).is_some());
    world.advance(1_000);
    assert_eq!(
        all_shards(&world.agents[0].core).len(),
        1,
        "a shard was issued"
    );
    assert_eq!(central_terms(&world), (800, 0, 0, 200, 0));
    world.partitioned[0] = true;
    world
}

#[test]
fn partition_admits_from_shard_then_reconnect_remints_unused_once() {
    let mut world = partitioned_world_with_shard();
    // The first call after the partition fails and marks the pair.
    let failed = reserve(&mut world, 0, "p-0", 120);
    assert!(
        matches!(failed, GatewayResponse::Unavailable { .. }),
        "{failed:?}"
    );
    assert!(world.agents[0].core.is_partitioned(&pair()));

    let local = reserve(&mut world, 0, "p-1", 120);
    let id = reservation_id(&local);
    match &local {
        GatewayResponse::Reservation { reservation, .. } => {
            assert!(matches!(reservation.path, ReservationPath::Shard(_)));
        }
        other => panic!("{other:?}"),
    }
    start(&mut world, 0, &id, "op-1");
    assert_eq!(
        state_of(&settle(&mut world, 0, &id, "op-1", 50)),
        AgentState::Settled
    );
    let shard = all_shards(&world.agents[0].core)[0].clone();
    assert_eq!(
        (
            shard.terms.local_available,
            shard.terms.local_reserved,
            shard.terms.local_spent
        ),
        (150, 0, 50)
    );

    // Reconnect: the used shard is closed and its receipt re-mints 150 once.
    world.partitioned[0] = false;
    world.advance(1_000);
    world.advance(1_000);
    let receipts: Vec<_> = world.agents[0].core.terminal_receipts().collect();
    assert_eq!(receipts.len(), 1);
    assert!(receipts[0].1, "acknowledged");
    assert_eq!(receipts[0].0.confirmed_unused_units, 150);
    assert_eq!(receipts[0].0.spent_units, 50);
    assert_eq!(receipts[0].0.reason, ShardCloseReason::Reconnect);
    let reconciled = world.central.ledger.shard(&receipts[0].0.shard).unwrap();
    let done = reconciled.reconciliation.as_ref().unwrap();
    // Refills filled the bucket meanwhile, so `burst` may cut the re-mint;
    // the cut is reported, never lost silently.
    assert_eq!(
        done.repaid_units + done.reminted_units + done.cut_units,
        150
    );

    // The same receipt again re-mints nothing.
    let before = central_terms(&world);
    let receipt = receipts[0].0.clone();
    let identity = world.agents[0].identity().clone();
    let reply = world.central.handle(
        &identity,
        &CentralCall::UploadReceipt(Box::new(receipt)),
        shard_format::BootNonce([0; 16]),
        world.now().wall,
    );
    assert!(matches!(
        reply,
        reservoir_tests::central_node::Delivery::Answered(CentralReply::ReceiptAccepted(_))
    ));
    assert_eq!(central_terms(&world).4, before.4, "minted unchanged");
    assert_audit_clean(&world);
}

#[test]
fn restart_never_uses_an_old_shard() {
    let mut world = partitioned_world_with_shard();
    reserve(&mut world, 0, "p-0", 10); // marks the partition
    let local = reserve(&mut world, 0, "p-1", 40);
    let id = reservation_id(&local);
    start(&mut world, 0, &id, "op-1");

    world.restart_agent(0);
    let status = world.agents[0].core.status();
    assert_eq!(
        status.boot_epoch, None,
        "partitioned: no new boot epoch yet"
    );
    assert!(status.shards.is_empty(), "no shard is open");
    assert_eq!(status.shards_closed, 1);
    assert!(
        all_shards(&world.agents[0].core)
            .iter()
            .all(|shard| shard.closed),
        "the old shard is closed"
    );
    let receipt = world.agents[0]
        .core
        .terminal_receipts()
        .next()
        .unwrap()
        .0
        .clone();
    assert_eq!(receipt.reason, ShardCloseReason::Restart);
    assert_eq!(receipt.unknown_units, 40, "in-flight units stay unknown");
    assert_eq!(receipt.confirmed_unused_units, 160);

    // Still partitioned: no emergency capacity at all.
    let refused = reserve(&mut world, 0, "p-2", 10);
    assert!(
        matches!(refused, GatewayResponse::Unavailable { .. }),
        "{refused:?}"
    );

    // Back online: registers a new epoch, uploads the receipt once.
    world.partitioned[0] = false;
    world.advance(1_000);
    world.advance(1_000);
    assert_eq!(world.agents[0].core.boot_epoch(), Some(2));
    let (_, acknowledged) = world.agents[0].core.terminal_receipts().next().unwrap();
    assert!(acknowledged);
    assert_audit_clean(&world);
}

#[test]
fn a_shard_presented_by_another_agent_is_refused() {
    let mut world = partitioned_world_with_shard();
    let shard = world.agents[0]
        .core
        .shard_ledgers()
        .next()
        .unwrap()
        .shard()
        .clone();
    world.advance(1_000); // agent 1 registers
    let now = world.now();
    let refusal = world.agents[1].core.accept_shard(shard, now).unwrap_err();
    assert_eq!(refusal, agent_core::ShardRefusal::OtherIdentity);
}

#[test]
fn a_replayed_fence_is_refused() {
    let mut world = partitioned_world_with_shard();
    let shard = world.agents[0]
        .core
        .shard_ledgers()
        .next()
        .unwrap()
        .shard()
        .clone();
    let now = world.now();
    // The very same shard again, and a copy under a new ID with the old fence.
    assert!(
        world.agents[0]
            .core
            .accept_shard(shard.clone(), now)
            .is_err()
    );
    let mut replay = shard;
    replay.shard = shard_format::ShardId::new("sh-replayed").unwrap();
    let refusal = world.agents[0].core.accept_shard(replay, now).unwrap_err();
    assert!(
        matches!(
            refusal,
            agent_core::ShardRefusal::StaleFence { .. } | agent_core::ShardRefusal::Signature(_)
        ),
        "{refusal:?}"
    );
}

#[test]
fn local_overage_pauses_the_pair_and_becomes_debt() {
    let mut world = partitioned_world_with_shard();
    reserve(&mut world, 0, "p-0", 10); // marks the partition
    let first = reservation_id(&reserve(&mut world, 0, "p-1", 50));
    start(&mut world, 0, &first, "op-1");
    settle(&mut world, 0, &first, "op-1", 50);
    // Local available 150: reserve 100, actual 180 → the last 50 and 30 of debt.
    let second = reservation_id(&reserve(&mut world, 0, "p-2", 100));
    start(&mut world, 0, &second, "op-2");
    let settled = settle(&mut world, 0, &second, "op-2", 180);
    assert_eq!(state_of(&settled), AgentState::SettledWithDebt);
    let shard = all_shards(&world.agents[0].core)[0].clone();
    assert_eq!(shard.overdraft_debt, 30);
    assert_eq!(shard.terms.local_available, 0);
    let paused = reserve(&mut world, 0, "p-3", 1);
    assert!(
        matches!(
            paused,
            GatewayResponse::Unavailable {
                code: ErrorCode::EmergencyDebt,
                ..
            }
        ),
        "{paused:?}"
    );

    // Reconnect: the debt reaches the center as overdraft and blocks admission.
    world.partitioned[0] = false;
    world.advance(1_000);
    world.advance(1_000);
    let (_, terms) = world.central.ledger.accounts().next().unwrap();
    assert_eq!(terms.overdraft_issued, 30);
    assert_eq!(terms.spent, 30, "debt is recorded as spent too");
    let blocked = world.central.ledger.admission_open(&pair());
    assert!(!blocked || world.central.ledger.pair_debt(&pair()) == 0);
    world.advance(1_000);
    assert_eq!(
        world.central.ledger.pair_debt(&pair()),
        0,
        "the next refill repays it"
    );
    assert!(world.central.ledger.admission_open(&pair()));
    assert_audit_clean(&world);
}

#[test]
fn local_start_after_the_hold_loses_to_expiry() {
    let mut world = partitioned_world_with_shard();
    reserve(&mut world, 0, "p-0", 10);
    let id = reservation_id(&reserve(&mut world, 0, "p-1", 60));
    let hold = world.agents[0].config.local_hold_ms;
    world.advance(hold);
    let late = start(&mut world, 0, &id, "op-1");
    assert!(
        matches!(
            late,
            GatewayResponse::Conflict {
                code: ErrorCode::ReservationExpired,
                ..
            }
        ),
        "{late:?}"
    );
    let shard = all_shards(&world.agents[0].core)[0].clone();
    assert_eq!(shard.terms.local_available, 200, "the hold came back");
}

#[test]
fn local_start_before_the_hold_wins_and_stays_reserved() {
    let mut world = partitioned_world_with_shard();
    reserve(&mut world, 0, "p-0", 10);
    let id = reservation_id(&reserve(&mut world, 0, "p-1", 60));
    assert_eq!(
        state_of(&start(&mut world, 0, &id, "op-1")),
        AgentState::Started
    );
    let hold = world.agents[0].config.local_hold_ms;
    world.advance(hold + 1);
    let shard = all_shards(&world.agents[0].core)[0].clone();
    assert_eq!(
        shard.terms.local_reserved, 60,
        "expiry never takes a started item"
    );
}

#[test]
fn contended_starts_are_shared_by_weight() {
    let mut policy = no_shards_policy();
    policy.reservation_units_max = 10;
    let mut world = World::new(1, policy, |config| {
        config
            .route_concurrency
            .insert(Route::new("chat.generate").unwrap(), 1);
    });
    // One subject only is configured in the policy; shares are per subject
    // of the reservation, so use the start scheduler's view directly.
    let ids: Vec<ReservationId> = (0..9)
        .map(|n| reservation_id(&reserve(&mut world, 0, &format!("k{n}"), 1)))
        .collect();
    let first = start(&mut world, 0, &ids[0], "op-0");
    assert_eq!(state_of(&first), AgentState::Started);
    let calls: Vec<_> = ids[1..]
        .iter()
        .enumerate()
        .map(|(n, id)| {
            world.gateway(
                0,
                GatewayRequest::Start {
                    reservation: id.clone(),
                    operation_id: OperationId::new(format!("op-{}", n + 1)).unwrap(),
                },
            )
        })
        .collect();
    assert!(
        calls.iter().all(|call| world.response(0, *call).is_none()),
        "starts wait while the slot is taken"
    );
    settle(&mut world, 0, &ids[0], "op-0", 1);
    assert!(
        world.response(0, calls[0]).is_some(),
        "the next start is granted"
    );
    let shares = world.agents[0].core.shares();
    assert_eq!(
        shares.iter().map(|share| share.granted).sum::<u64>(),
        0,
        "one subject: no contention between subjects"
    );
}

#[test]
fn journal_batches_are_bounded_and_answers_wait_for_all_of_them() {
    let mut world = World::new(1, no_shards_policy(), |config| {
        config.journal_batch_max = 1;
    });
    // Drive the core by hand: one gateway reserve, then the central reply.
    let now = world.now();
    let core = &mut world.agents[0].core;
    core.handle_gateway(
        1,
        GatewayRequest::Reserve(GatewayReserve {
            idempotency_key: IdempotencyKey::new("batch").unwrap(),
            subject: pair().subject,
            route: pair().route,
            units: 10,
            min_units: None,
            deadline_ms: None,
            priority: None,
            request: None,
            more_legs: Vec::new(),
        }),
        now,
    );
    assert!(
        core.poll_central().is_none(),
        "nothing leaves before the journal commit"
    );
    let batch = core.poll_journal().expect("the reservation is journaled");
    assert_eq!(batch.records.len(), 1);
    core.handle_journal_committed(batch.seq);
    let calls = core.poll_central_batch(8);
    assert_eq!(
        calls.len(),
        1,
        "the reserve goes out once its record is committed"
    );
    assert!(
        core.poll_reply().is_none(),
        "no answer before the central reply"
    );
}

/// A settle repeated while the first still waits to reach the central
/// ledger (the pair is partitioned) gets the first one's 202 again. Found
/// by the process test that kills the center mid-burst: a gateway retrying
/// its settle after the restart was answered 200 with the record still
/// `SETTLING`, as if the settle had completed.
#[test]
fn a_settle_repeated_while_partitioned_is_accepted_again() {
    let mut world = World::new(1, no_shards_policy(), |config| {
        config.partition_failures_max = 1;
    });
    let reserved = reserve(&mut world, 0, "req-1", 100);
    let id = reservation_id(&reserved);
    assert_eq!(
        state_of(&start(&mut world, 0, &id, "op-1")),
        AgentState::Started
    );
    world.partitioned[0] = true;
    let probe = reserve(&mut world, 0, "probe", 10);
    assert!(
        matches!(probe, GatewayResponse::Unavailable { .. }),
        "{probe:?}"
    );
    assert!(world.agents[0].core.is_partitioned(&pair()));
    let first = settle(&mut world, 0, &id, "op-1", 40);
    assert!(matches!(first, GatewayResponse::Accepted(_)), "{first:?}");
    let again = settle(&mut world, 0, &id, "op-1", 40);
    assert!(matches!(again, GatewayResponse::Accepted(_)), "{again:?}");
    assert_eq!(state_of(&again), AgentState::Settling);
}

// ----- retention -----

pub(crate) const WINDOW_MS: u64 = 60_000;

pub(crate) fn short_window_world() -> World {
    World::new(1, no_shards_policy(), |config| {
        config.retention_ms = WINDOW_MS;
    })
}

pub(crate) fn journal_holds(world: &World, id: &ReservationId) -> bool {
    world.agents[0]
        .journal
        .contains_key(&agent_core::JournalKey::Reservation(id.clone()))
}

pub(crate) fn settled(world: &mut World, key: &str) -> ReservationId {
    let id = reservation_id(&reserve(world, 0, key, 100));
    assert_eq!(state_of(&start(world, 0, &id, "op-1")), AgentState::Started);
    assert_eq!(
        state_of(&settle(world, 0, &id, "op-1", 60)),
        AgentState::Settled
    );
    id
}

#[test]
fn a_settled_reservation_replays_until_its_window_ends_then_its_key_is_new() {
    let mut world = short_window_world();
    let id = settled(&mut world, "req-1");
    let ended_at = world.agents[0]
        .core
        .reservation(&id)
        .unwrap()
        .ended_at
        .map(u64::from);
    assert_eq!(ended_at, Some(world.now().wall.unix_ms()));

    // One ms before the window ends: kept, and a retry replays it.
    world.advance(WINDOW_MS - 1);
    let replay = reserve(&mut world, 0, "req-1", 100);
    assert!(matches!(
        replay,
        GatewayResponse::Reservation { created: false, .. }
    ));
    assert_eq!(reservation_id(&replay), id);
    assert_eq!(state_of(&replay), AgentState::Settled);
    assert!(journal_holds(&world, &id));

    // Exactly at the window's end: forgotten, from memory and journal.
    world.advance(1);
    assert!(world.agents[0].core.reservation(&id).is_none());
    assert!(!journal_holds(&world, &id));

    // A restart from the journal does not bring it back.
    world.restart_agent(0);
    assert!(world.agents[0].core.reservation(&id).is_none());

    // The key is a new request now. The same ID is derived; the center,
    // whose window (24 h) is longer, still knows it and its answer rules.
    let again = reserve(&mut world, 0, "req-1", 100);
    assert!(matches!(
        again,
        GatewayResponse::Reservation { created: true, .. }
    ));
    assert_eq!(reservation_id(&again), id);
    assert_eq!(state_of(&again), AgentState::Settled);
    assert_audit_clean(&world);
}

#[test]
fn a_rejected_request_is_forgotten_after_its_window() {
    let mut world = short_window_world();
    let rejected = reserve(&mut world, 0, "big", 5_000);
    let GatewayResponse::Rejected { reservation, .. } = rejected else {
        panic!("expected 429, got {rejected:?}");
    };
    assert_eq!(
        world.agents[0]
            .core
            .reservation(&reservation)
            .unwrap()
            .state,
        AgentState::Rejected
    );
    world.advance(WINDOW_MS - 1);
    assert!(world.agents[0].core.reservation(&reservation).is_some());
    world.advance(1);
    assert!(world.agents[0].core.reservation(&reservation).is_none());
    assert!(!journal_holds(&world, &reservation));
    // A fitting request under the same key is new: reserved.
    let fitting = reserve(&mut world, 0, "big", 100);
    assert!(matches!(
        fitting,
        GatewayResponse::Reservation { created: true, .. }
    ));
    assert_eq!(state_of(&fitting), AgentState::Reserved);
}

#[test]
fn a_settle_still_to_sync_is_kept_past_the_window_until_delivered() {
    let mut world = short_window_world();
    let id = reservation_id(&reserve(&mut world, 0, "req-1", 100));
    start(&mut world, 0, &id, "op-1");
    world.partitioned[0] = true;
    // Enough failures to count as partitioned: the settle is accepted locally.
    for _ in 0..4 {
        world.advance(1_000);
    }
    let accepted = settle(&mut world, 0, &id, "op-1", 60);
    assert!(
        matches!(accepted, GatewayResponse::Accepted(_)),
        "{accepted:?}"
    );
    world.advance(WINDOW_MS + 10_000);
    let record = world.agents[0].core.reservation(&id).unwrap();
    assert_eq!(record.state, AgentState::Settling);
    assert_eq!(
        record.ended_at, None,
        "not at rest while the settle is owed"
    );

    world.partitioned[0] = false;
    world.advance(1_000);
    world.advance(1_000);
    let record = world.agents[0].core.reservation(&id).unwrap().clone();
    assert_eq!(record.state, AgentState::Settled);
    let ended_at = record.ended_at.expect("at rest once delivered").get();
    // The window runs from delivery, not from the gateway's settle.
    let left = ended_at + WINDOW_MS - world.now().wall.unix_ms();
    world.advance(left - 1);
    assert!(world.agents[0].core.reservation(&id).is_some());
    world.advance(1);
    assert!(world.agents[0].core.reservation(&id).is_none());
    assert_audit_clean(&world);
}

/// Issue 13: a shard bound to this agent's identity and boot but tampered
/// in transit (its central signature broken) is refused, and its units do
/// not stay retired until the shard is marked lost: the agent signs an
/// all-unused terminal receipt at once and uploads it like any other, and
/// the center re-mints the units.
#[test]
fn a_tampered_shard_of_this_boot_is_handed_back_with_an_all_unused_receipt() {
    let mut world = World::new(1, sample_policy(1), |_| {});
    world.tamper_next_shard[0] = true;
    let first = reserve(&mut world, 0, "warm-up", 100);
    let id = reservation_id(&first);
    let call = world.gateway(0, GatewayRequest::Release { reservation: id });
    assert!(world.response(0, call).is_some());
    world.advance(1_000);
    let core = &mut world.agents[0].core;
    assert!(
        all_shards(core).is_empty(),
        "the tampered shard is never accepted"
    );
    let refused = core.poll_refused_shards();
    assert_eq!(refused.len(), 1, "{refused:?}");
    assert_eq!(refused[0].units, 200);
    let (receipt, _) = core.terminal_receipts().next().expect("a receipt");
    assert_eq!(
        (
            receipt.confirmed_unused_units,
            receipt.spent_units,
            receipt.unknown_units
        ),
        (200, 0, 0)
    );
    assert_eq!(receipt.shard, refused[0].shard);
    // The receipt goes up with the next round of the retry timer.
    world.advance(1_000);
    let (receipt, acknowledged) = world.agents[0]
        .core
        .terminal_receipts()
        .next()
        .expect("a receipt");
    assert!(acknowledged, "the center acknowledged the receipt");
    let record = world
        .central
        .ledger
        .shard(&receipt.shard)
        .expect("the center issued it");
    let done = record.reconciliation.as_ref().expect("reconciled at once");
    assert_eq!(
        done.repaid_units + done.reminted_units + done.cut_units,
        200
    );
    assert_eq!(record.lost_at, None);
    assert_audit_clean(&world);
}

/// Whether the answer is a reservation admitted from a shard.
pub(crate) fn from_shard(response: &GatewayResponse) -> bool {
    matches!(
        response,
        GatewayResponse::Reservation { reservation, .. }
            if matches!(reservation.path, ReservationPath::Shard(_))
    )
}

#[test]
fn a_shard_admits_until_its_last_usable_millisecond() {
    // docs/design.md §5.5: usable until arrival + (notAfter − notBefore) −
    // shard_skew_margin_ms, on the agent's own clock.
    let mut world = partitioned_world_with_shard();
    reserve(&mut world, 0, "p-0", 10); // marks the partition
    let shard = all_shards(&world.agents[0].core)[0].clone();
    let margin = world.agents[0].config.shard_skew_margin_ms;
    // The shard arrived with the retry timer, at the agent's 1000 ms.
    assert_eq!(shard.usable_until_ms, 1_000 + 600_000 - margin);
    world.advance(shard.usable_until_ms - 1 - world.now().mono_ms);
    let last = reserve(&mut world, 0, "p-last", 10);
    assert!(from_shard(&last), "{last:?}");
    assert!(!all_shards(&world.agents[0].core)[0].closed);

    world.advance(1);
    let shards = all_shards(&world.agents[0].core);
    assert!(shards[0].closed, "its validity ended");
    let late = reserve(&mut world, 0, "p-late", 10);
    assert!(
        matches!(late, GatewayResponse::Unavailable { .. }),
        "{late:?}"
    );
    let receipt = world.agents[0]
        .core
        .terminal_receipts()
        .next()
        .expect("closed shards have receipts")
        .0
        .clone();
    assert_eq!(receipt.reason, ShardCloseReason::ValidityEnded);
}

#[test]
fn a_local_start_at_the_last_millisecond_of_the_hold_wins() {
    let mut world = partitioned_world_with_shard();
    reserve(&mut world, 0, "p-0", 10);
    let id = reservation_id(&reserve(&mut world, 0, "p-1", 60));
    let hold = world.agents[0].config.local_hold_ms;
    world.advance(hold - 1);
    assert_eq!(
        state_of(&start(&mut world, 0, &id, "op-1")),
        AgentState::Started
    );
}

#[test]
fn a_pair_is_partitioned_at_exactly_partition_failures_max_failures() {
    let mut world = World::new(1, no_shards_policy(), |config| {
        config.partition_failures_max = 3;
    });
    let id = reservation_id(&reserve(&mut world, 0, "warm-up", 10));
    let call = world.gateway(0, GatewayRequest::Release { reservation: id });
    assert!(world.response(0, call).is_some());
    world.partitioned[0] = true;
    for failures in 1..=2 {
        let failed = reserve(&mut world, 0, &format!("f-{failures}"), 10);
        assert!(
            matches!(failed, GatewayResponse::Unavailable { .. }),
            "{failed:?}"
        );
        assert!(
            !world.agents[0].core.is_partitioned(&pair()),
            "{failures} failure(s) of 3"
        );
    }
    reserve(&mut world, 0, "f-3", 10);
    assert!(world.agents[0].core.is_partitioned(&pair()));
}

#[test]
fn reservations_of_one_pair_share_one_copy_of_its_names() {
    // An agent keeps every open reservation in memory: each record holds
    // the pair map's subject and route, not the copy its request parsed.
    let mut world = partitioned_world_with_shard();
    reserve(&mut world, 0, "names-0", 10); // marks the partition
    let ids: Vec<ReservationId> = ["names-1", "names-2"]
        .into_iter()
        .map(|key| reservation_id(&reserve(&mut world, 0, key, 10)))
        .collect();
    let names = |id: &ReservationId| {
        let record = world.agents[0].core.reservation(id).expect("recorded");
        (
            record.subject.as_str().as_ptr(),
            record.route.as_str().as_ptr(),
        )
    };
    assert_eq!(names(&ids[0]), names(&ids[1]));
    let record = world.agents[0].core.reservation(&ids[0]).unwrap();
    assert_eq!(
        (record.subject.clone(), record.route.clone()),
        (pair().subject, pair().route)
    );
}
