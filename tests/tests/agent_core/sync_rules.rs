//! Scenarios of the agent core: replies from the center, unknown outcomes, retries, partitions, recovery and the start scheduler.

use agent_core::{
    AgentState, CentralCall, GatewayRequest, GatewayReserve, GatewayResponse, SyncOp,
};
use ledger::protocol::{ErrorCode, Operation};
use reservoir_tests::world::World;
use shard_format::{IdempotencyKey, OperationId, ReservationId, Subject};

use super::{
    all_shards, central_terms, no_shards_policy, pair, partitioned_world_with_shard, release,
    reservation_id, reserve, settle, start, state_of,
};

fn record_state(world: &World, agent: usize, id: &ReservationId) -> AgentState {
    world.agents[agent]
        .core
        .reservation(id)
        .expect("held")
        .state
}

/// How many calls of a kind reached the central ledger.
fn central_calls(world: &World, kind: impl Fn(&CentralCall) -> bool) -> usize {
    world
        .central_log
        .iter()
        .filter(|(_, call, _)| kind(call))
        .count()
}

fn unavailable_code(response: &GatewayResponse) -> ErrorCode {
    match response {
        GatewayResponse::Unavailable { code, .. } => *code,
        other => panic!("expected 503, got {other:?}"),
    }
}

#[test]
fn a_retried_unknown_reserve_whose_reply_is_lost_again_is_answered_unknown_again() {
    let mut world = World::new(1, no_shards_policy(), |_| {});
    world.lose_next_reply[0] = true;
    let first = reserve(&mut world, 0, "req-1", 300);
    assert_eq!(unavailable_code(&first), ErrorCode::ReservationUnknown);
    world.lose_next_reply[0] = true;
    let again = reserve(&mut world, 0, "req-1", 300);
    assert_eq!(unavailable_code(&again), ErrorCode::ReservationUnknown);
    // The third try gets the one reservation the center made.
    let third = reserve(&mut world, 0, "req-1", 300);
    assert_eq!(state_of(&third), AgentState::Reserved);
    assert_eq!(central_terms(&world).1, 300, "reserved once");
}

#[test]
fn a_start_whose_reply_is_lost_is_answered_start_unknown_and_resent() {
    let mut world = World::new(1, no_shards_policy(), |_| {});
    let id = reservation_id(&reserve(&mut world, 0, "req-1", 300));
    world.lose_next_reply[0] = true;
    let lost = start(&mut world, 0, &id, "op-1");
    assert_eq!(unavailable_code(&lost), ErrorCode::StartUnknown);
    assert_eq!(record_state(&world, 0, &id), AgentState::Starting);
    // The gateway retries: it waits for the resend at the next retry.
    let again = world.gateway(
        0,
        GatewayRequest::Start {
            reservation: id.clone(),
            operation_id: OperationId::new("op-1").unwrap(),
        },
    );
    assert!(world.response(0, again).is_none());
    world.advance(1_000);
    assert_eq!(
        state_of(world.response(0, again).expect("answered")),
        AgentState::Started
    );
    assert_eq!(record_state(&world, 0, &id), AgentState::Started);
}

#[test]
fn a_settle_whose_reply_is_lost_is_accepted_and_settled_at_the_next_retry() {
    // No grace: an unknown reserve would be abandoned at the first retry;
    // a settle in doubt must be resent instead.
    let mut world = World::new(1, no_shards_policy(), |config| {
        config.unknown_abandon_grace_ms = 0;
    });
    let id = reservation_id(&reserve(&mut world, 0, "req-1", 300));
    assert_eq!(
        state_of(&start(&mut world, 0, &id, "op-1")),
        AgentState::Started
    );
    // The settle does not reach the center.
    world.partitioned[0] = true;
    let accepted = settle(&mut world, 0, &id, "op-1", 200);
    assert!(
        matches!(&accepted, GatewayResponse::Accepted(record) if record.state == AgentState::Settling),
        "{accepted:?}"
    );
    world.partitioned[0] = false;
    world.advance(1_000);
    assert_eq!(record_state(&world, 0, &id), AgentState::Settled);
    assert_eq!(central_terms(&world).2, 200, "spent what was settled");
    assert_eq!(
        central_calls(&world, |call| matches!(call, CentralCall::Abandon { .. })),
        0
    );
}

#[test]
fn a_release_whose_reply_is_lost_is_accepted_and_released_at_the_next_retry() {
    let mut world = World::new(1, no_shards_policy(), |_| {});
    let id = reservation_id(&reserve(&mut world, 0, "req-1", 300));
    world.partitioned[0] = true;
    let accepted = release(&mut world, 0, &id);
    assert!(
        matches!(&accepted, GatewayResponse::Accepted(record) if record.state == AgentState::Releasing),
        "{accepted:?}"
    );
    world.partitioned[0] = false;
    world.advance(1_000);
    assert_eq!(record_state(&world, 0, &id), AgentState::Released);
    assert_eq!(central_terms(&world).1, 0, "nothing held");
}

#[test]
fn a_started_reservation_turns_usage_unknown_exactly_at_its_deadline() {
    let mut world = World::new(1, no_shards_policy(), |config| {
        config.default_deadline_ms = 5_000;
    });
    let id = reservation_id(&reserve(&mut world, 0, "req-1", 300));
    start(&mut world, 0, &id, "op-1");
    world.advance(4_999);
    assert_eq!(record_state(&world, 0, &id), AgentState::Started);
    world.advance(1);
    assert_eq!(record_state(&world, 0, &id), AgentState::UsageUnknown);
}

#[test]
fn a_settlement_beyond_what_is_available_is_settled_with_debt() {
    let mut world = World::new(1, no_shards_policy(), |_| {});
    let id = reservation_id(&reserve(&mut world, 0, "req-1", 800));
    start(&mut world, 0, &id, "op-1");
    // 800 reserved, 200 available: 1100 leaves 100 of debt.
    let settled = settle(&mut world, 0, &id, "op-1", 1_100);
    assert_eq!(state_of(&settled), AgentState::SettledWithDebt);
}

#[test]
fn a_release_refused_because_the_hold_expired_ends_expired() {
    let mut world = World::new(1, no_shards_policy(), |_| {});
    let id = reservation_id(&reserve(&mut world, 0, "req-1", 300));
    // The center's hold runs out; the agent does not know yet.
    world.advance(31_000);
    assert_eq!(record_state(&world, 0, &id), AgentState::Reserved);
    let refused = release(&mut world, 0, &id);
    assert!(
        matches!(
            refused,
            GatewayResponse::Refused { status: 409, .. } | GatewayResponse::Reservation { .. }
        ),
        "{refused:?}"
    );
    world.advance(1_000);
    assert_eq!(record_state(&world, 0, &id), AgentState::Expired);
    assert_eq!(world.agents[0].core.reservation(&id).unwrap().sync, None);
}

/// A reserve the agent journaled but had not sent when it crashed.
#[test]
fn a_reserve_in_flight_at_a_crash_is_unknown_and_a_retry_resolves_it_at_once() {
    let mut world = World::new(1, no_shards_policy(), |_| {});
    let request = GatewayRequest::Reserve(GatewayReserve {
        idempotency_key: IdempotencyKey::new("req-1").unwrap(),
        subject: pair().subject,
        route: pair().route,
        units: 300,
        min_units: None,
        deadline_ms: None,
        priority: None,
        request: None,
        more_legs: Vec::new(),
    });
    let now = world.now();
    world.agents[0].core.handle_gateway(1_000_000, request, now);
    world.agents[0].commit_journal();
    world.restart_agent(0);
    let record = world.agents[0].core.reservations().next().unwrap().clone();
    assert_eq!(record.state, AgentState::ReservationUnknown);
    // The gateway's retry re-sends it under the same ID and is answered.
    let retry = reserve(&mut world, 0, "req-1", 300);
    assert_eq!(reservation_id(&retry), record.reservation);
    assert_eq!(state_of(&retry), AgentState::Reserved);
    assert_eq!(central_terms(&world).1, 300);
}

#[test]
fn a_start_in_progress_at_a_crash_is_usage_unknown_and_asked_about_each_retry() {
    let mut world = World::new(1, no_shards_policy(), |_| {});
    let id = reservation_id(&reserve(&mut world, 0, "req-1", 300));
    start(&mut world, 0, &id, "op-1");
    world.restart_agent(0);
    assert_eq!(record_state(&world, 0, &id), AgentState::UsageUnknown);
    let gets = |world: &World| {
        central_calls(
            world,
            |call| matches!(call, CentralCall::Get { reservation } if *reservation == id),
        )
    };
    assert_eq!(gets(&world), 0);
    world.advance(1_000);
    assert_eq!(gets(&world), 1, "the center is asked how it ended");
    // Still running at the center: asked again at the next retry.
    assert_eq!(record_state(&world, 0, &id), AgentState::UsageUnknown);
    world.advance(1_000);
    assert_eq!(gets(&world), 2);
}

#[test]
fn an_acknowledged_terminal_receipt_is_uploaded_once() {
    let mut world = partitioned_world_with_shard();
    world.partitioned[0] = false;
    // The restart closes the old boot's shard and queues its receipt.
    world.restart_agent(0);
    // A receipt to upload is work for the retry timer: it runs at once.
    assert_eq!(world.agents[0].core.poll_timeout(), Some(world.mono_ms));
    let uploads =
        |world: &World| central_calls(world, |call| matches!(call, CentralCall::UploadReceipt(_)));
    for _ in 0..4 {
        world.advance(1_000);
    }
    let receipts: Vec<_> = world.agents[0].core.terminal_receipts().collect();
    assert_eq!(receipts.len(), 1);
    assert!(receipts[0].1, "acknowledged");
    assert_eq!(uploads(&world), 1);
}

#[test]
fn any_partitioned_follows_the_pairs() {
    let mut world = World::new(1, no_shards_policy(), |config| {
        config.partition_failures_max = 1;
    });
    reserve(&mut world, 0, "warm-up", 10);
    assert!(!world.agents[0].core.any_partitioned());
    world.partitioned[0] = true;
    reserve(&mut world, 0, "fails", 10);
    assert!(world.agents[0].core.any_partitioned());
    world.partitioned[0] = false;
    world.advance(1_000);
    assert!(!world.agents[0].core.any_partitioned(), "the probe ends it");
}

#[test]
fn an_idle_agent_sleeps_until_its_open_shard_needs_refreshing() {
    let mut world = partitioned_world_with_shard();
    reserve(&mut world, 0, "p-0", 120);
    let local = reservation_id(&reserve(&mut world, 0, "p-1", 120));
    start(&mut world, 0, &local, "op-1");
    settle(&mut world, 0, &local, "op-1", 50);
    // A long partition: the used shard's end comes before the next one's
    // refresh.
    world.advance(100_000);
    world.partitioned[0] = false;
    for _ in 0..3 {
        world.advance(1_000);
    }
    let status = world.agents[0].core.status();
    assert_eq!(status.pending_receipts, 0);
    let shards = all_shards(&world.agents[0].core);
    let open: Vec<_> = shards.iter().filter(|shard| !shard.closed).collect();
    let closed: Vec<_> = shards.iter().filter(|shard| shard.closed).collect();
    assert_eq!((open.len(), closed.len()), (1, 1), "{shards:?}");
    assert_eq!(
        status.shards,
        [open[0].clone()],
        "the status lists the open one"
    );
    assert_eq!(status.shards_closed, 1);
    let refresh = open[0].usable_until_ms - world.agents[0].config.shard_refresh_margin_ms;
    assert!(closed[0].usable_until_ms < refresh);
    assert!(world.mono_ms + 1_000 < refresh);
    assert_eq!(world.agents[0].core.poll_timeout(), Some(refresh));
}

#[test]
fn an_abandon_waiting_for_the_center_is_not_journaled_again_at_each_retry() {
    let mut world = World::new(1, no_shards_policy(), |config| {
        config.unknown_abandon_grace_ms = 0;
    });
    world.lose_next_reply[0] = true;
    let id = ReservationId::clone(&reservation_of_unknown(&mut world, "req-1", 300));
    world.partitioned[0] = true;
    world.advance(1_000);
    assert_eq!(
        world.agents[0].core.reservation(&id).unwrap().sync,
        Some(SyncOp::Abandon)
    );
    // Still partitioned: the next retries only probe.
    for _ in 0..2 {
        world.mono_ms += 1_000;
        let now = world.now();
        world.agents[0].core.handle_timeout(now);
        assert!(!world.agents[0].core.has_pending_journal());
        world.pump();
    }
}

/// Reserves under `key` with the reply lost: the ID of the unknown reserve.
fn reservation_of_unknown(world: &mut World, key: &str, units: u64) -> ReservationId {
    let response = reserve(world, 0, key, units);
    assert_eq!(unavailable_code(&response), ErrorCode::ReservationUnknown);
    world.agents[0]
        .core
        .reservations()
        .find(|record| record.idempotency_key.as_str() == key)
        .expect("recorded")
        .reservation
        .clone()
}

fn reserve_for(world: &mut World, subject: &Subject, key: &str, units: u64) -> ReservationId {
    let call = world.gateway(
        0,
        GatewayRequest::Reserve(GatewayReserve {
            idempotency_key: IdempotencyKey::new(key).unwrap(),
            subject: subject.clone(),
            route: pair().route,
            units,
            min_units: None,
            deadline_ms: None,
            priority: None,
            request: None,
            more_legs: Vec::new(),
        }),
    );
    reservation_id(world.response(0, call).expect("answered"))
}

#[test]
fn the_scheduler_and_shares_views_show_contended_starts() {
    let route = pair().route;
    let mut world = World::new(1, no_shards_policy(), |config| {
        config.route_concurrency.insert(route.clone(), 1);
    });
    let other = Subject::new("tenant-8").unwrap();
    let mut policy = no_shards_policy();
    policy.subject = other.clone();
    let wall = world.now().wall;
    world
        .central
        .operate(Operation::Publish(Box::new(policy)), wall)
        .expect("commit");
    let mine: Vec<ReservationId> = (0..3)
        .map(|n| reserve_for(&mut world, &pair().subject, &format!("a{n}"), 10))
        .collect();
    let theirs: Vec<ReservationId> = (0..2)
        .map(|n| reserve_for(&mut world, &other, &format!("b{n}"), 10))
        .collect();
    start(&mut world, 0, &mine[0], "op-a0");
    for (n, id) in mine[1..].iter().chain(&theirs).enumerate() {
        world.gateway(
            0,
            GatewayRequest::Start {
                reservation: id.clone(),
                operation_id: OperationId::new(format!("op-{n}")).unwrap(),
            },
        );
    }
    let core = &world.agents[0].core;
    assert_eq!(core.scheduler().running(&route), 1);
    assert_eq!(core.scheduler().waiting(&route), 4);
    settle(&mut world, 0, &mine[0], "op-a0", 10);
    let core = &world.agents[0].core;
    let shares = core.shares();
    assert_eq!(shares, core.status().shares);
    assert_eq!(
        shares.iter().map(|share| share.granted).sum::<u64>(),
        1,
        "one start granted while both subjects waited"
    );
}

/// A start the center answers USAGE_UNKNOWN keeps its slot until the
/// center settles it; then the next start waiting for the route goes.
#[test]
fn a_start_slot_held_in_doubt_is_freed_when_the_center_settles_it() {
    let route = pair().route;
    let mut world = World::new(1, no_shards_policy(), |config| {
        config.route_concurrency.insert(route.clone(), 1);
    });
    let first = reservation_id(&reserve(&mut world, 0, "req-1", 10));
    let second = reservation_id(&reserve(&mut world, 0, "req-2", 10));
    world.lose_next_reply[0] = true;
    let lost = start(&mut world, 0, &first, "op-1");
    assert_eq!(unavailable_code(&lost), ErrorCode::StartUnknown);
    let queued = world.gateway(
        0,
        GatewayRequest::Start {
            reservation: second.clone(),
            operation_id: OperationId::new("op-2").unwrap(),
        },
    );
    assert!(world.response(0, queued).is_none(), "the slot is taken");
    // Out of reach past the center's usage deadline (the hold TTL).
    world.partitioned[0] = true;
    world.advance(31_000);
    world.partitioned[0] = false;
    // The probe ends the partition, then the start is resent.
    world.advance(1_000);
    world.advance(1_000);
    assert_eq!(record_state(&world, 0, &first), AgentState::UsageUnknown);
    assert!(world.response(0, queued).is_none(), "still in doubt");
    // The hard limit settles it at the center; the refresh learns it.
    world.advance(600_000);
    world.advance(1_000);
    assert_eq!(record_state(&world, 0, &first), AgentState::Settled);
    // The next start goes at last (and learns its own hold ran out
    // meanwhile).
    let answer = world.response(0, queued).expect("the slot was freed");
    assert!(
        matches!(
            answer,
            GatewayResponse::Conflict {
                code: ErrorCode::ReservationExpired,
                ..
            }
        ),
        "{answer:?}"
    );
}

#[test]
fn a_refresh_waiting_for_the_center_is_not_journaled_again_at_each_retry() {
    let mut world = World::new(1, no_shards_policy(), |_| {});
    let id = reservation_id(&reserve(&mut world, 0, "req-1", 300));
    start(&mut world, 0, &id, "op-1");
    world.restart_agent(0);
    assert_eq!(record_state(&world, 0, &id), AgentState::UsageUnknown);
    // The center is out of reach: the refresh is decided once, then only
    // resent.
    world.partitioned[0] = true;
    world.advance(1_000);
    assert_eq!(
        world.agents[0].core.reservation(&id).unwrap().sync,
        Some(SyncOp::Refresh)
    );
    for _ in 0..2 {
        world.mono_ms += 1_000;
        let now = world.now();
        world.agents[0].core.handle_timeout(now);
        assert!(!world.agents[0].core.has_pending_journal());
        world.pump();
    }
}

/// A settle before any start bound an operation is refused as the center
/// refuses it: `not_started` while the reservation is `RESERVED`, and
/// `illegal_state` once it ended without starting (here: released).
#[test]
fn a_settle_before_the_start_is_not_started_and_after_a_release_illegal() {
    let mut world = World::new(1, no_shards_policy(), |_| {});
    let id = reservation_id(&reserve(&mut world, 0, "req-1", 100));
    let code = |response: &GatewayResponse| match response {
        GatewayResponse::Conflict { code, .. } => Some(*code),
        _ => None,
    };
    let early = settle(&mut world, 0, &id, "op-1", 50);
    assert_eq!(code(&early), Some(ErrorCode::NotStarted), "{early:?}");
    assert_eq!(record_state(&world, 0, &id), AgentState::Reserved);

    let released = release(&mut world, 0, &id);
    assert_eq!(state_of(&released), AgentState::Released);
    let late = settle(&mut world, 0, &id, "op-1", 50);
    assert_eq!(code(&late), Some(ErrorCode::IllegalState), "{late:?}");
    assert_eq!(central_terms(&world).1, 0, "nothing held, nothing settled");
}
