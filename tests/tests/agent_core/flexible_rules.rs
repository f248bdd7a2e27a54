//! Flexible reservations at the agent (docs/design.md §3.2): `minUnits` on
//! a reserve is granted the largest amount down to it that the center's
//! account — or, partitioned, the pair's shard — covers; the answer's
//! `reservedUnits` is the grant, and settling above it is overage.

use agent_core::{AgentState, GatewayResponse, ReservationPath};
use ledger::Dimension;
use ledger::protocol::ErrorCode;

use super::{
    all_shards, assert_audit_clean, central_terms, no_shards_policy, partitioned_world_with_shard,
    reservation_id, reserve, reserve_between, settle, start, state_of,
};
use reservoir_tests::world::World;

/// The grant an answer reports.
fn granted(response: &GatewayResponse) -> Option<u64> {
    match response {
        GatewayResponse::Reservation { reservation, .. } => {
            reservation.reserved_units.map(u64::from)
        }
        other => panic!("expected a reservation, got {other:?}"),
    }
}

/// 700 of the pair's 1000 units held by `big`: 300 stay available.
fn with_300_available() -> World {
    let mut world = World::new(1, no_shards_policy(), |_| {});
    let big = reserve(&mut world, 0, "big", 700);
    assert_eq!(
        granted(&big),
        Some(700),
        "an exact reserve's grant is its units"
    );
    world
}

#[test]
fn a_flexible_reserve_is_granted_what_the_center_has_down_to_its_floor() {
    let mut world = with_300_available();
    let flexible = reserve_between(&mut world, 0, "flex", Some(100), 500);
    assert_eq!(state_of(&flexible), AgentState::Reserved);
    assert_eq!(granted(&flexible), Some(300));
    let id = reservation_id(&flexible);
    let record = world.agents[0].core.reservation(&id).expect("the record");
    assert_eq!(
        (record.units, record.min_units.map(u64::from)),
        (500, Some(100))
    );
    let receipt = record.receipt.as_ref().expect("the center's receipt");
    assert_eq!(
        (receipt.reserved_units, receipt.requested_units),
        (300, Some(500))
    );
    assert_eq!(central_terms(&world), (0, 1000, 0, 0, 0));
    // Settling 350 on a grant of 300 is 50 of overage, now debt.
    start(&mut world, 0, &id, "op-1");
    assert_eq!(
        state_of(&settle(&mut world, 0, &id, "op-1", 350)),
        AgentState::SettledWithDebt
    );
    assert_eq!(world.central.ledger.pair_debt(&super::pair()), 50);
    assert_audit_clean(&world);
}

#[test]
fn a_floor_one_above_what_the_center_has_is_rejected_and_holds_nothing() {
    let mut world = with_300_available();
    match reserve_between(&mut world, 0, "flex", Some(301), 500) {
        GatewayResponse::Rejected { rejection, .. } => {
            assert_eq!(rejection.dimension, Dimension::Capacity);
        }
        other => panic!("expected 429, got {other:?}"),
    }
    assert_eq!(central_terms(&world), (300, 700, 0, 0, 0));
    let exactly = reserve_between(&mut world, 0, "flex-300", Some(300), 500);
    assert_eq!(granted(&exactly), Some(300));
    assert_audit_clean(&world);
}

#[test]
fn a_floor_of_zero_or_above_units_is_refused_naming_the_field() {
    let mut world = with_300_available();
    for (key, min_units) in [("zero", 0), ("above", 101)] {
        match reserve_between(&mut world, 0, key, Some(min_units), 100) {
            GatewayResponse::Invalid { code, field, .. } => {
                assert_eq!(
                    (code, field),
                    (ErrorCode::InvalidUnits, "minUnits".to_owned())
                );
            }
            other => panic!("expected 400 for minUnits {min_units}, got {other:?}"),
        }
    }
    assert_eq!(world.agents[0].core.reservations().count(), 1, "only `big`");
    assert_eq!(central_terms(&world), (300, 700, 0, 0, 0));
    // At the bounds it is valid.
    assert_eq!(
        granted(&reserve_between(&mut world, 0, "one", Some(1), 100)),
        Some(100)
    );
    assert_eq!(
        granted(&reserve_between(&mut world, 0, "same", Some(100), 100)),
        Some(100)
    );
}

#[test]
fn a_retry_is_answered_with_the_first_grant_and_another_floor_conflicts() {
    let mut world = with_300_available();
    let first = reserve_between(&mut world, 0, "flex", Some(100), 500);
    assert_eq!(granted(&first), Some(300));
    let again = reserve_between(&mut world, 0, "flex", Some(100), 500);
    assert_eq!(reservation_id(&again), reservation_id(&first));
    assert_eq!(granted(&again), Some(300));
    for other_floor in [Some(99), None] {
        let conflict = reserve_between(&mut world, 0, "flex", other_floor, 500);
        assert!(
            matches!(
                conflict,
                GatewayResponse::Conflict {
                    code: ErrorCode::IdempotencyConflict,
                    ..
                }
            ),
            "floor {other_floor:?}: {conflict:?}"
        );
    }
    assert_eq!(central_terms(&world), (0, 1000, 0, 0, 0));
}

#[test]
fn partitioned_a_flexible_reserve_is_granted_what_the_shard_has_left() {
    let mut world = partitioned_world_with_shard();
    // The first call after the partition fails and marks the pair.
    assert!(matches!(
        reserve(&mut world, 0, "p-0", 10),
        GatewayResponse::Unavailable { .. }
    ));
    let exact = reserve(&mut world, 0, "p-1", 150);
    assert_eq!(granted(&exact), Some(150));
    // 50 left in the shard of 200.
    match reserve_between(&mut world, 0, "p-51", Some(51), 120) {
        GatewayResponse::Unavailable { code, .. } => {
            assert_eq!(code, ErrorCode::CentralUnreachable);
        }
        other => panic!("a floor of 51 cannot be covered by 50: {other:?}"),
    }
    let flexible = reserve_between(&mut world, 0, "p-50", Some(50), 120);
    assert_eq!(granted(&flexible), Some(50));
    let id = reservation_id(&flexible);
    let record = world.agents[0].core.reservation(&id).expect("the record");
    assert!(matches!(record.path, ReservationPath::Shard(_)));
    let shard = all_shards(&world.agents[0].core)[0].clone();
    assert_eq!(
        (shard.terms.local_available, shard.terms.local_reserved),
        (0, 200)
    );
    // Settling 70 on the local grant of 50: 20 over, with nothing left in
    // the shard it is receipt debt and pauses it.
    start(&mut world, 0, &id, "op-1");
    settle(&mut world, 0, &id, "op-1", 70);
    let shard = all_shards(&world.agents[0].core)[0].clone();
    assert_eq!(shard.terms.local_spent, 50);
    assert_eq!(shard.overdraft_debt, 20);
}

/// Partitioned with two shards of 200 of this boot: the first as issued,
/// the second (a higher fence) issued and accepted by hand.
fn partitioned_world_with_two_shards() -> World {
    let mut world = partitioned_world_with_shard();
    let first = world.agents[0]
        .core
        .shard_ledgers()
        .next()
        .expect("the first shard")
        .shard()
        .clone();
    let identity = world.agents[0].identity().clone();
    let call = agent_core::CentralCall::IssueShard {
        subject: first.subject.clone(),
        route: first.route.clone(),
        boot_epoch: first.boot_epoch,
        boot_nonce: first.boot_nonce,
    };
    let now = world.now();
    let reservoir_tests::central_node::Delivery::Answered(agent_core::CentralReply::Shard(second)) =
        world
            .central
            .handle(&identity, &call, first.boot_nonce, now.wall)
    else {
        panic!("a second shard is issued");
    };
    assert!(second.fence > first.fence);
    world.agents[0]
        .core
        .accept_shard(*second, now)
        .expect("the second shard is accepted");
    // The first call after the partition fails and marks the pair.
    assert!(matches!(
        reserve(&mut world, 0, "p-0", 10),
        GatewayResponse::Unavailable { .. }
    ));
    world
}

/// Each shard's `localAvailable`, lowest fence first.
fn shards_available(world: &World) -> Vec<u64> {
    let mut shards = all_shards(&world.agents[0].core);
    shards.sort_by_key(|shard| shard.fence);
    shards
        .iter()
        .map(|shard| shard.terms.local_available)
        .collect()
}

#[test]
fn partitioned_a_flexible_reserve_takes_the_oldest_shard_that_covers_it_whole() {
    let mut world = partitioned_world_with_two_shards();
    assert_eq!(granted(&reserve(&mut world, 0, "p-1", 150)), Some(150));
    assert_eq!(
        shards_available(&world),
        [50, 200],
        "the oldest fence first"
    );
    // The first shard could grant 50; the second covers all 120.
    let whole = reserve_between(&mut world, 0, "p-2", Some(10), 120);
    assert_eq!(granted(&whole), Some(120));
    assert_eq!(shards_available(&world), [50, 80]);
    // Neither covers 100: the one with the most left grants all it has.
    let most = reserve_between(&mut world, 0, "p-3", Some(10), 100);
    assert_eq!(granted(&most), Some(80));
    assert_eq!(shards_available(&world), [50, 0]);
    // And then the other, down to a floor it covers exactly.
    let last = reserve_between(&mut world, 0, "p-4", Some(50), 100);
    assert_eq!(granted(&last), Some(50));
    assert_eq!(shards_available(&world), [0, 0]);
}
