//! Scenarios of the agent core: the idempotency window, forgetting reservations and shards, and the retention queue.

use agent_core::{
    AgentConfig, AgentState, GatewayRequest, GatewayReserve, GatewayResponse, JournalKey,
    JournalRecord,
};
use ledger::protocol::ErrorCode;
use ledger::store::contract::sample_policy;
use reservoir_tests::world::World;
use shard_format::limits::UNITS_MAX;
use shard_format::{
    IdempotencyKey, OperationId, ReservationId, ReservationState, Route, RouteMode, ShardId,
    ShardTerminalReceiptV1,
};

use super::{
    WINDOW_MS, all_shards, from_shard, journal_holds, no_shards_policy, pair, release,
    reservation_id, reserve, settle, settled, short_window_world, start, state_of,
};

/// A reservation reserved and released at once: at rest from now.
fn released(world: &mut World, key: &str) -> ReservationId {
    let id = reservation_id(&reserve(world, 0, key, 10));
    assert_eq!(state_of(&release(world, 0, &id)), AgentState::Released);
    id
}

fn wall_ms(world: &World) -> u64 {
    world.now().wall.unix_ms()
}

/// Moves the world's clock to wall time `wall`.
fn advance_to(world: &mut World, wall: u64) {
    let now = wall_ms(world);
    assert!(wall >= now, "time only moves forward");
    world.advance(wall - now);
}

fn held(world: &World, id: &ReservationId) -> bool {
    world.agents[0].core.reservation(id).is_some()
}

/// Whether agent 0's journal holds reservation `id` with its hold on
/// `shard`.
fn journal_holds_on(world: &World, id: &ReservationId, shard: &ShardId) -> bool {
    match world.agents[0]
        .journal
        .get(&JournalKey::Reservation(id.clone()))
    {
        Some(JournalRecord::ReservationWithHolds { holds, .. }) => holds
            .iter()
            .any(|hold| hold.shard == *shard && hold.local.reservation == *id),
        _ => false,
    }
}

/// Whether agent 0 still holds `shard`: its slot, and in its journal the
/// shard, its book and its terminal receipt.
fn shard_held(world: &World, shard: &ShardId) -> bool {
    let core = &world.agents[0].core;
    let in_memory = core
        .shard_ledgers()
        .any(|ledger| &ledger.shard().shard == shard);
    let journal = &world.agents[0].journal;
    let keys = [
        JournalKey::Shard(shard.clone()),
        JournalKey::ShardBook(shard.clone()),
        JournalKey::TerminalReceipt(shard.clone()),
    ];
    let journaled = keys.iter().filter(|key| journal.contains_key(key)).count();
    assert!(
        journaled == 0 || journaled == keys.len(),
        "a shard's records leave together ({journaled} of {} left)",
        keys.len()
    );
    assert_eq!(in_memory, journaled > 0, "memory and journal agree");
    in_memory
}

fn receipt_of(world: &World, shard: &ShardId) -> Option<(ShardTerminalReceiptV1, bool)> {
    world.agents[0]
        .core
        .terminal_receipts()
        .find(|(receipt, _)| &receipt.shard == shard)
        .map(|(receipt, acknowledged)| (receipt.clone(), acknowledged))
}

/// One agent that took an emergency shard for the pair (as in
/// `partitioned_world_with_shard`), still healthy, configured by
/// `configure` besides.
fn shard_world(configure: impl Fn(&mut AgentConfig)) -> (World, ShardId) {
    let mut world = World::new(1, sample_policy(1), |config| {
        config.partition_failures_max = 1;
        configure(config);
    });
    released(&mut world, "warm-up");
    world.advance(1_000);
    let shards = all_shards(&world.agents[0].core);
    assert_eq!(shards.len(), 1, "a shard was issued");
    (world, shards[0].shard.clone())
}

/// The partition starts; a first failed reserve (`p-0`: unknown until the
/// partition ends, then reserved, and live from there) marks it.
fn partition(world: &mut World) {
    world.partitioned[0] = true;
    let failed = reserve(world, 0, "p-0", 10);
    assert!(
        matches!(failed, GatewayResponse::Unavailable { .. }),
        "{failed:?}"
    );
    assert!(world.agents[0].core.is_partitioned(&pair()));
}

/// [`shard_world`] with a short retention window and at most
/// `forget_batch_max` records forgotten per sweep, partitioned.
fn short_window_shard_world(forget_batch_max: usize) -> (World, ShardId) {
    let (mut world, shard) = shard_world(|config| {
        config.retention_ms = WINDOW_MS;
        config.forget_batch_max = forget_batch_max;
    });
    partition(&mut world);
    (world, shard)
}

/// The partition ends: the pair's shard is handed back, its receipt
/// acknowledged, and `p-0` resolved.
fn reconnect(world: &mut World, shard: &ShardId) -> ShardTerminalReceiptV1 {
    world.partitioned[0] = false;
    world.advance(1_000);
    world.advance(1_000);
    let (receipt, acknowledged) = receipt_of(world, shard).expect("the shard has a receipt");
    assert!(acknowledged, "the center acknowledged the receipt");
    receipt
}

fn p0(world: &mut World) -> ReservationId {
    let replay = reserve(world, 0, "p-0", 10);
    assert_eq!(state_of(&replay), AgentState::Reserved, "{replay:?}");
    reservation_id(&replay)
}

/// The record a settle or a release answers with, read back by `Get`: the
/// same, its rest time (`endedAt`) included.
fn answered_as_stored(world: &mut World, answer: &GatewayResponse) {
    let GatewayResponse::Reservation { reservation, .. } = answer else {
        panic!("expected a reservation, got {answer:?}");
    };
    assert!(reservation.ended_at.is_some(), "at rest: {reservation:?}");
    let call = world.gateway(
        0,
        GatewayRequest::Get {
            reservation: reservation.reservation.clone(),
        },
    );
    match world.response(0, call) {
        Some(GatewayResponse::Reservation {
            reservation: read, ..
        }) => {
            assert_eq!(read, reservation);
        }
        other => panic!("expected the reservation, got {other:?}"),
    }
}

/// On agent 0: a reservation of `units` reserved, started and settled,
/// another reserved and released, both on a shard or both not
/// (`on_shard`); each answer that ended one is its record as stored.
fn ends_answered_as_stored(world: &mut World, units: u64, on_shard: bool) {
    let reserved = reserve(world, 0, "to-settle", units);
    assert_eq!(from_shard(&reserved), on_shard, "{reserved:?}");
    let id = reservation_id(&reserved);
    start(world, 0, &id, "op-1");
    let answer = settle(world, 0, &id, "op-1", units / 2);
    answered_as_stored(world, &answer);
    let reserved = reserve(world, 0, "to-release", units);
    assert_eq!(from_shard(&reserved), on_shard, "{reserved:?}");
    let answer = release(world, 0, &reservation_id(&reserved));
    answered_as_stored(world, &answer);
}

/// The answer that brings a reservation to rest is the record as stored,
/// as a retry of the call reads it: on the central path (answered when
/// the center's reply comes) and on a shard's.
#[test]
fn the_answer_that_ends_a_reservation_carries_its_rest_time() {
    ends_answered_as_stored(&mut short_window_world(), 100, false);
    let (mut world, _) = short_window_shard_world(1);
    ends_answered_as_stored(&mut world, 10, true);
}

/// A closed shard whose receipt was acknowledged goes once `closedAt +
/// retention_ms` has passed, in one piece: slot, book, local reservations,
/// receipt and the reservations it admitted. Until then a retry of one of
/// those finds it (its shard still holds its local reservation). The
/// pair's fence stays, and so does everything of other paths.
#[test]
fn a_closed_shard_leaves_with_its_reservations_when_its_window_ends() {
    let (mut world, shard) = short_window_shard_world(1);
    let local = reserve(&mut world, 0, "p-1", 60);
    assert!(from_shard(&local), "{local:?}");
    let id = reservation_id(&local);
    assert_eq!(
        state_of(&start(&mut world, 0, &id, "op-1")),
        AgentState::Started
    );
    assert_eq!(
        state_of(&settle(&mut world, 0, &id, "op-1", 40)),
        AgentState::Settled
    );
    let settled_at = world.agents[0]
        .core
        .reservation(&id)
        .unwrap()
        .ended_at
        .map(u64::from);
    assert_eq!(settled_at, Some(wall_ms(&world)));
    let receipt = reconnect(&mut world, &shard);
    let closed_at = receipt.closed_at.unix_ms();
    assert!(closed_at > settled_at.unwrap());
    let live = p0(&mut world);
    // A central reservation at rest from (about) the close on.
    let late = released(&mut world, "late");
    let late_end = world.agents[0]
        .core
        .reservation(&late)
        .unwrap()
        .ended_at
        .unwrap()
        .get();
    assert!(late_end >= closed_at);

    // The last millisecond of the shard's window: everything is kept, and
    // p-1 (whose own window passed long ago) still replays.
    advance_to(&mut world, closed_at + WINDOW_MS - 1);
    // More sweeps at that millisecond: each forgets one record due by now
    // (the budget is 1), and the first took the warm-up's.
    world.advance(0);
    world.advance(0);
    assert!(shard_held(&world, &shard));
    assert!(journal_holds(&world, &id));
    let replay = reserve(&mut world, 0, "p-1", 60);
    assert_eq!(reservation_id(&replay), id);
    assert_eq!(state_of(&replay), AgentState::Settled);
    assert!(
        journal_holds_on(&world, &id, &shard),
        "its hold is journaled"
    );

    // One sweep once both windows passed, with a central call in flight
    // (a gateway's reserve not yet answered): the shard counts as one of
    // the sweep's budget of 1, so `late` waits for the next sweep.
    world.mono_ms += late_end + WINDOW_MS - wall_ms(&world);
    let now = world.now();
    assert!(world.central.run_workers(now.wall));
    let core = &mut world.agents[0].core;
    core.handle_gateway(
        1_000_000,
        GatewayRequest::Reserve(GatewayReserve {
            idempotency_key: IdempotencyKey::new("in-flight").unwrap(),
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
    core.handle_timeout(now);
    world.pump();
    assert!(!shard_held(&world, &shard), "the shard is forgotten");
    assert!(receipt_of(&world, &shard).is_none());
    assert!(!held(&world, &id));
    assert!(!journal_holds(&world, &id), "with its hold");
    assert!(
        world.agents[0]
            .journal
            .contains_key(&JournalKey::Fence(pair())),
        "fencing outlives every shard"
    );
    assert!(held(&world, &live), "a live reservation stays");
    assert!(held(&world, &late), "the budget was spent on the shard");
    assert_eq!(
        world.agents[0].core.poll_timeout(),
        Some(world.mono_ms),
        "the sweep ran out of budget: the next one is due at once"
    );
    world.advance(0);
    assert!(!held(&world, &late));
    assert!(held(&world, &live));
}

/// A shard closed while one of its reservations still ran (a restart)
/// stays past its own window until that reservation, settled later, has
/// passed its window too; meanwhile the sweep looks again every
/// `retry_interval_ms`, and a sweep out of budget goes on at once.
#[test]
fn a_shard_waits_for_the_window_of_every_reservation_it_admitted() {
    let (mut world, shard) = short_window_shard_world(1);
    let id = reservation_id(&reserve(&mut world, 0, "p-1", 60));
    assert_eq!(
        state_of(&start(&mut world, 0, &id, "op-1")),
        AgentState::Started
    );
    world.restart_agent(0);
    assert_eq!(
        world.agents[0].core.reservation(&id).unwrap().state,
        AgentState::UsageUnknown
    );
    let receipt = reconnect(&mut world, &shard);
    let closed_at = receipt.closed_at.unix_ms();
    p0(&mut world);
    let first = released(&mut world, "a");
    let second = released(&mut world, "b");
    let released_at = wall_ms(&world);
    world.advance(10_000);
    // The shard is closed: the usage is recorded here.
    assert_eq!(
        state_of(&settle(&mut world, 0, &id, "op-1", 40)),
        AgentState::Settled
    );
    let settled_at = world.agents[0]
        .core
        .reservation(&id)
        .unwrap()
        .ended_at
        .unwrap()
        .get();
    assert_eq!(settled_at, released_at + 10_000);

    advance_to(&mut world, closed_at + WINDOW_MS - 1);
    assert!(shard_held(&world, &shard));
    // One sweep: the shard's window passed, p-1's not (blocked); `a` is
    // forgotten and the budget of 1 is spent with `b` still due.
    advance_to(&mut world, released_at + WINDOW_MS);
    assert!(shard_held(&world, &shard), "p-1's window has not passed");
    assert!(held(&world, &id));
    assert_eq!(
        [&first, &second]
            .iter()
            .filter(|id| held(&world, id))
            .count(),
        1,
        "one of `a` and `b` forgotten"
    );
    let retry_interval = world.agents[0].config.retry_interval_ms;
    assert_eq!(
        world.agents[0].core.poll_timeout(),
        Some(world.mono_ms),
        "out of budget with records due: the next sweep is due at once"
    );
    world.advance(0);
    world.advance(0);
    assert!(!held(&world, &first) && !held(&world, &second));
    // Only the blocked shard is left: the sweep looks again after the
    // retry interval, not at once.
    assert_eq!(
        world.agents[0].core.poll_timeout(),
        Some(world.mono_ms + retry_interval)
    );

    advance_to(&mut world, settled_at + WINDOW_MS - 1);
    assert!(shard_held(&world, &shard));
    assert!(held(&world, &id));
    world.advance(1);
    assert!(!shard_held(&world, &shard));
    assert!(!held(&world, &id));
    assert!(!journal_holds(&world, &id));
}

/// A shard refused and handed back leaves only its receipt; once
/// acknowledged, that goes at `closedAt + retention_ms`, as one record of a
/// sweep's budget.
#[test]
fn a_handed_back_receipt_is_forgotten_after_its_window() {
    let mut world = World::new(1, sample_policy(1), |config| {
        config.retention_ms = WINDOW_MS;
        config.forget_batch_max = 1;
    });
    world.tamper_next_shard[0] = true;
    released(&mut world, "warm-up");
    world.advance(1_000);
    assert!(all_shards(&world.agents[0].core).is_empty());
    world.advance(1_000);
    let (receipt, acknowledged) = world.agents[0]
        .core
        .terminal_receipts()
        .next()
        .map(|(receipt, acknowledged)| (receipt.clone(), acknowledged))
        .expect("the refused shard's receipt");
    assert!(acknowledged);
    let shard = receipt.shard.clone();
    let closed_at = receipt.closed_at.unix_ms();
    let late = released(&mut world, "late");
    let late_end = wall_ms(&world);
    assert!(late_end >= closed_at);

    advance_to(&mut world, closed_at + WINDOW_MS - 1);
    assert!(receipt_of(&world, &shard).is_some());
    assert!(
        world.agents[0]
            .journal
            .contains_key(&JournalKey::TerminalReceipt(shard.clone()))
    );
    // Both due in one sweep of budget 1: the receipt goes first.
    advance_to(&mut world, late_end + WINDOW_MS);
    assert!(receipt_of(&world, &shard).is_none());
    assert!(
        !world.agents[0]
            .journal
            .contains_key(&JournalKey::TerminalReceipt(shard.clone()))
    );
    assert!(held(&world, &late), "the budget was spent on the receipt");
    world.advance(0);
    assert!(!held(&world, &late));
}

/// A sweep forgets at most `forget_batch_max` reservations; the rest go
/// with the next sweep, due at once.
#[test]
fn a_sweep_forgets_at_most_forget_batch_max_reservations() {
    let mut world = World::new(1, no_shards_policy(), |config| {
        config.retention_ms = WINDOW_MS;
        config.forget_batch_max = 2;
    });
    let ids: Vec<ReservationId> = ["a", "b", "c"]
        .iter()
        .map(|key| released(&mut world, key))
        .collect();
    world.advance(WINDOW_MS);
    let left: Vec<&ReservationId> = ids.iter().filter(|id| held(&world, id)).collect();
    assert_eq!(left.len(), 1, "two of three forgotten");
    assert_eq!(world.agents[0].core.poll_timeout(), Some(world.mono_ms));
    world.advance(0);
    assert!(ids.iter().all(|id| !held(&world, id)));
}

/// The retention timer: the core asks to be woken exactly when the oldest
/// record at rest reaches the end of its window (a wall time, converted to
/// the monotonic clock).
#[test]
fn the_timer_is_due_when_the_oldest_window_ends() {
    let mut world = short_window_world();
    world.advance(5_000);
    let id = settled(&mut world, "req-1");
    let settled_mono = world.mono_ms;
    world.advance(1_000);
    released(&mut world, "later");
    assert_eq!(
        world.agents[0].core.poll_timeout(),
        Some(settled_mono + WINDOW_MS)
    );
    let end = wall_ms(&world) + WINDOW_MS;
    advance_to(&mut world, end);
    assert!(!held(&world, &id));
}

// ----- gateway requests (`reservations.rs`) -----

fn reserve_request(key: &str, units: u64, deadline_ms: Option<u64>) -> GatewayRequest {
    GatewayRequest::Reserve(GatewayReserve {
        idempotency_key: IdempotencyKey::new(key).unwrap(),
        subject: pair().subject,
        route: pair().route,
        units,
        min_units: None,
        deadline_ms,
        priority: None,
        request: None,
        more_legs: Vec::new(),
    })
}

fn ask(world: &mut World, request: GatewayRequest) -> GatewayResponse {
    let call = world.gateway(0, request);
    world.response(0, call).cloned().expect("answered")
}

fn invalid_field(response: &GatewayResponse) -> Option<&str> {
    match response {
        GatewayResponse::Invalid { field, .. } => Some(field),
        _ => None,
    }
}

/// The code of a 409 the agent answers itself or passes on from the center.
fn conflict_code(response: &GatewayResponse) -> Option<ErrorCode> {
    match response {
        GatewayResponse::Conflict { code, .. } => Some(*code),
        GatewayResponse::Refused {
            status: 409, code, ..
        } => Some(*code),
        _ => None,
    }
}

fn unavailable_code(response: &GatewayResponse) -> Option<ErrorCode> {
    match response {
        GatewayResponse::Unavailable { code, .. } => Some(*code),
        _ => None,
    }
}

fn central_state(world: &World, id: &ReservationId) -> Option<ReservationState> {
    world
        .central
        .ledger
        .reservation(id)
        .map(|record| record.receipt.state)
}

#[test]
fn reserve_units_are_between_1_and_the_unit_maximum() {
    let mut world = World::new(1, no_shards_policy(), |_| {});
    let zero = ask(&mut world, reserve_request("zero", 0, None));
    assert_eq!(invalid_field(&zero), Some("units"), "{zero:?}");
    let above = ask(&mut world, reserve_request("above", UNITS_MAX + 1, None));
    assert_eq!(invalid_field(&above), Some("units"), "{above:?}");
    // At the maximum the request is valid: the policy decides (its
    // reservationUnitsMax is far below).
    let at = ask(&mut world, reserve_request("at", UNITS_MAX, None));
    assert_eq!(invalid_field(&at), None, "{at:?}");
    let one = ask(&mut world, reserve_request("one", 1, None));
    assert_eq!(state_of(&one), AgentState::Reserved);
}

#[test]
fn a_deadline_is_between_1_and_deadline_ms_max() {
    let mut world = World::new(1, no_shards_policy(), |_| {});
    let max = world.agents[0].config.deadline_ms_max;
    let zero = ask(&mut world, reserve_request("zero", 10, Some(0)));
    assert_eq!(invalid_field(&zero), Some("deadlineMs"), "{zero:?}");
    let above = ask(&mut world, reserve_request("above", 10, Some(max + 1)));
    assert_eq!(invalid_field(&above), Some("deadlineMs"), "{above:?}");
    let at = ask(&mut world, reserve_request("at", 10, Some(max)));
    assert_eq!(state_of(&at), AgentState::Reserved, "{at:?}");
    let one = ask(&mut world, reserve_request("one", 10, Some(1)));
    assert_eq!(state_of(&one), AgentState::Reserved, "{one:?}");
}

/// A cancel is recorded (journaled) and shown at once; repeating it
/// changes nothing.
#[test]
fn a_cancel_is_recorded_and_shown() {
    let mut world = World::new(1, no_shards_policy(), |_| {});
    let id = reservation_id(&reserve(&mut world, 0, "req-1", 10));
    for _ in 0..2 {
        let cancelled = ask(
            &mut world,
            GatewayRequest::Cancel {
                reservation: id.clone(),
            },
        );
        let GatewayResponse::Reservation { reservation, .. } = cancelled else {
            panic!("expected the reservation, got {cancelled:?}");
        };
        assert!(reservation.cancel_requested);
        let journaled = world.agents[0]
            .journal
            .get(&JournalKey::Reservation(id.clone()));
        assert!(
            matches!(
                journaled,
                Some(JournalRecord::ReservationWithHolds { record, .. }) if record.cancel_requested
            ),
            "{journaled:?}"
        );
    }
}

/// A gateway retrying its reserve while the first is still on its way to
/// the center waits for the center's answer, and both get it.
#[test]
fn a_retry_while_the_reserve_is_in_flight_waits_for_the_center() {
    let mut world = World::new(1, no_shards_policy(), |_| {});
    let now = world.now();
    let node = &mut world.agents[0];
    node.core
        .handle_gateway(1_000_001, reserve_request("req-1", 100, None), now);
    node.core
        .handle_gateway(1_000_002, reserve_request("req-1", 100, None), now);
    node.commit_journal();
    assert_eq!(
        node.core.poll_reply(),
        None,
        "nobody is answered before the center"
    );
    world.pump();
    let first = world.response(0, 1_000_001).cloned().expect("answered");
    let second = world.response(0, 1_000_002).cloned().expect("answered");
    assert_eq!(state_of(&first), AgentState::Reserved);
    assert_eq!(state_of(&second), AgentState::Reserved);
    assert_eq!(reservation_id(&first), reservation_id(&second));
}

/// The center refused a request; retried during a partition, it is decided
/// afresh, from the shard (the center's no is no answer for the shard).
#[test]
fn a_rejected_request_retried_during_a_partition_is_admitted_from_the_shard() {
    let (mut world, _) = shard_world(|_| {});
    // 800 available at the center: a live 700, then 150 does not fit.
    reserve(&mut world, 0, "hog", 700);
    let rejected = reserve(&mut world, 0, "big", 150);
    assert!(
        matches!(rejected, GatewayResponse::Rejected { .. }),
        "{rejected:?}"
    );
    partition(&mut world);
    let retried = reserve(&mut world, 0, "big", 150);
    assert!(from_shard(&retried), "{retried:?}");
}

/// Partitioned without a shard that can admit the request: 503
/// `CENTRAL_UNREACHABLE`, unless the pair's own shard is paused by debt.
#[test]
fn partitioned_without_room_is_central_unreachable_unless_the_pairs_shard_is_paused() {
    let (mut world, _) = shard_world(|_| {});
    partition(&mut world);
    // The pair's shard is open, without debt, but holds only 200.
    let too_big = reserve(&mut world, 0, "too-big", 500);
    assert_eq!(
        unavailable_code(&too_big),
        Some(ErrorCode::CentralUnreachable),
        "{too_big:?}"
    );
    // Local overage pauses the pair's shard.
    let id = reservation_id(&reserve(&mut world, 0, "p-1", 100));
    start(&mut world, 0, &id, "op-1");
    assert_eq!(
        state_of(&settle(&mut world, 0, &id, "op-1", 250)),
        AgentState::SettledWithDebt
    );
    let paused = reserve(&mut world, 0, "p-2", 1);
    assert_eq!(
        unavailable_code(&paused),
        Some(ErrorCode::EmergencyDebt),
        "{paused:?}"
    );
    // Another route of the same subject, partitioned too, has no shard:
    // the paused shard of the other pair is not its reason.
    let embed = |key: &str| {
        GatewayRequest::Reserve(GatewayReserve {
            idempotency_key: IdempotencyKey::new(key).unwrap(),
            subject: pair().subject,
            route: Route::new("embed").unwrap(),
            units: 10,
            min_units: None,
            deadline_ms: None,
            priority: None,
            request: None,
            more_legs: Vec::new(),
        })
    };
    ask(&mut world, embed("e-0"));
    let other = ask(&mut world, embed("e-1"));
    assert_eq!(
        unavailable_code(&other),
        Some(ErrorCode::CentralUnreachable),
        "{other:?}"
    );
}

#[test]
fn a_repeated_start_replays_and_another_operation_conflicts() {
    let mut world = World::new(1, no_shards_policy(), |_| {});
    let id = reservation_id(&reserve(&mut world, 0, "req-1", 100));
    assert_eq!(
        state_of(&start(&mut world, 0, &id, "op-1")),
        AgentState::Started
    );
    assert_eq!(
        state_of(&start(&mut world, 0, &id, "op-1")),
        AgentState::Started
    );
    let other = start(&mut world, 0, &id, "op-2");
    assert_eq!(
        conflict_code(&other),
        Some(ErrorCode::OperationConflict),
        "{other:?}"
    );
}

/// Shadow mode with the center reachable: the center records the start,
/// the settle and the release like any other.
#[test]
fn a_shadow_reservation_made_at_the_center_starts_settles_and_releases_there() {
    let mut world = World::new(1, no_shards_policy(), |config| {
        config.route_modes.insert(pair().route, RouteMode::Shadow);
    });
    let id = reservation_id(&reserve(&mut world, 0, "s-1", 100));
    assert_eq!(central_state(&world, &id), Some(ReservationState::Reserved));
    assert_eq!(
        state_of(&start(&mut world, 0, &id, "op-1")),
        AgentState::Started
    );
    assert_eq!(central_state(&world, &id), Some(ReservationState::Started));
    assert_eq!(
        state_of(&settle(&mut world, 0, &id, "op-1", 60)),
        AgentState::Settled
    );
    assert_eq!(central_state(&world, &id), Some(ReservationState::Settled));
    let other = reservation_id(&reserve(&mut world, 0, "s-2", 100));
    assert_eq!(
        state_of(&release(&mut world, 0, &other)),
        AgentState::Released
    );
    assert_eq!(
        central_state(&world, &other),
        Some(ReservationState::Released)
    );
}

/// Shadow mode admits what the center refuses: that answer too is the
/// record as stored, at rest with its `endedAt`, as a retry reads it.
#[test]
fn a_shadow_reservation_the_center_refuses_is_answered_as_stored() {
    let mut world = World::new(1, no_shards_policy(), |config| {
        config.route_modes.insert(pair().route, RouteMode::Shadow);
    });
    let answer = reserve(&mut world, 0, "s-over", UNITS_MAX);
    assert_eq!(state_of(&answer), AgentState::Rejected, "{answer:?}");
    answered_as_stored(&mut world, &answer);
}

/// Shadow mode admits locally while partitioned; such a reservation never
/// reaches the center, so its start, settle and release stay local too,
/// also once the center is back.
#[test]
fn a_shadow_reservation_admitted_while_partitioned_stays_local() {
    let mut world = World::new(1, no_shards_policy(), |config| {
        config.partition_failures_max = 1;
        config.route_modes.insert(pair().route, RouteMode::Shadow);
    });
    world.partitioned[0] = true;
    reserve(&mut world, 0, "probe", 10);
    assert!(world.agents[0].core.is_partitioned(&pair()));
    let first = reservation_id(&reserve(&mut world, 0, "s-1", 100));
    let second = reservation_id(&reserve(&mut world, 0, "s-2", 100));
    world.partitioned[0] = false;
    world.advance(1_000);
    world.advance(1_000);
    assert!(!world.agents[0].core.is_partitioned(&pair()));
    assert_eq!(
        state_of(&start(&mut world, 0, &first, "op-1")),
        AgentState::Started
    );
    assert_eq!(
        state_of(&settle(&mut world, 0, &first, "op-1", 60)),
        AgentState::Settled
    );
    assert_eq!(
        state_of(&release(&mut world, 0, &second)),
        AgentState::Released
    );
    assert_eq!(central_state(&world, &first), None);
    assert_eq!(central_state(&world, &second), None);
}

#[test]
fn settle_units_are_at_most_the_unit_maximum() {
    let mut world = World::new(1, no_shards_policy(), |_| {});
    let id = reservation_id(&reserve(&mut world, 0, "req-1", 100));
    start(&mut world, 0, &id, "op-1");
    let above = settle(&mut world, 0, &id, "op-1", UNITS_MAX + 1);
    assert_eq!(invalid_field(&above), Some("actualUnits"), "{above:?}");
    let at = settle(&mut world, 0, &id, "op-1", UNITS_MAX);
    assert_eq!(invalid_field(&at), None, "{at:?}");
}

/// A settle while the start's outcome is unknown is refused: the
/// reservation is not started as far as the agent knows.
#[test]
fn a_settle_before_the_start_is_confirmed_is_refused() {
    let mut world = World::new(1, no_shards_policy(), |_| {});
    let id = reservation_id(&reserve(&mut world, 0, "req-1", 100));
    world.lose_next_reply[0] = true;
    let unknown = start(&mut world, 0, &id, "op-1");
    assert_eq!(
        unavailable_code(&unknown),
        Some(ErrorCode::StartUnknown),
        "{unknown:?}"
    );
    let early = settle(&mut world, 0, &id, "op-1", 60);
    assert_eq!(
        conflict_code(&early),
        Some(ErrorCode::IllegalState),
        "{early:?}"
    );
    world.advance(1_000);
    assert_eq!(
        state_of(&settle(&mut world, 0, &id, "op-1", 60)),
        AgentState::Settled
    );
}

/// Usage the center settled conservatively at the hard limit (the agent
/// learns it by asking) is corrected once by the gateway's late receipt.
#[test]
fn a_late_settle_after_the_hard_limit_is_forwarded_to_the_center() {
    let mut world = World::new(1, no_shards_policy(), |_| {});
    let id = reservation_id(&ask(&mut world, reserve_request("req-1", 100, Some(1_000))));
    start(&mut world, 0, &id, "op-1");
    world.advance(1_000);
    world.advance(600_000);
    world.advance(1_000);
    let record = world.agents[0].core.reservation(&id).unwrap().clone();
    assert!(record.state.is_final(), "{:?}", record.state);
    assert_eq!(record.actual_units, None);
    let late = settle(&mut world, 0, &id, "op-1", 60);
    assert!(
        matches!(late, GatewayResponse::Reservation { .. }),
        "{late:?}"
    );
    let central = world.central.ledger.reservation(&id).unwrap();
    assert_eq!(central.receipt.actual_units, Some(60));
}

#[test]
fn a_repeated_release_replays_the_release() {
    let mut world = World::new(1, no_shards_policy(), |_| {});
    let id = reservation_id(&reserve(&mut world, 0, "req-1", 100));
    assert_eq!(state_of(&release(&mut world, 0, &id)), AgentState::Released);
    assert_eq!(state_of(&release(&mut world, 0, &id)), AgentState::Released);
}

/// While partitioned a release is accepted (202) and delivered later; a
/// repeat is accepted again.
#[test]
fn a_release_repeated_while_partitioned_is_accepted_again() {
    let mut world = World::new(1, no_shards_policy(), |config| {
        config.partition_failures_max = 1;
    });
    let id = reservation_id(&reserve(&mut world, 0, "req-1", 100));
    world.partitioned[0] = true;
    reserve(&mut world, 0, "probe", 10);
    for _ in 0..2 {
        let accepted = release(&mut world, 0, &id);
        assert!(
            matches!(accepted, GatewayResponse::Accepted(_)),
            "{accepted:?}"
        );
        assert_eq!(state_of(&accepted), AgentState::Releasing);
    }
}

/// A release whose reply was lost is still on its way: a repeat (the
/// center reachable) waits for the center's answer.
#[test]
fn a_release_repeated_after_a_lost_reply_waits_for_the_center() {
    let mut world = World::new(1, no_shards_policy(), |_| {});
    let id = reservation_id(&reserve(&mut world, 0, "req-1", 100));
    world.lose_next_reply[0] = true;
    let first = release(&mut world, 0, &id);
    assert!(matches!(first, GatewayResponse::Accepted(_)), "{first:?}");
    let call = world.gateway(
        0,
        GatewayRequest::Release {
            reservation: id.clone(),
        },
    );
    assert_eq!(world.response(0, call), None, "waits for the center");
    world.advance(1_000);
    let answer = world.response(0, call).cloned().expect("answered");
    assert_eq!(state_of(&answer), AgentState::Released);
}

/// A start waiting for a slot binds the operation: the reservation can no
/// longer be released.
#[test]
fn a_reservation_whose_start_waits_for_a_slot_cannot_be_released() {
    let mut world = World::new(1, no_shards_policy(), |config| {
        config.route_concurrency.insert(pair().route, 1);
    });
    let first = reservation_id(&reserve(&mut world, 0, "a", 10));
    let second = reservation_id(&reserve(&mut world, 0, "b", 10));
    assert_eq!(
        state_of(&start(&mut world, 0, &first, "op-a")),
        AgentState::Started
    );
    let queued = world.gateway(
        0,
        GatewayRequest::Start {
            reservation: second.clone(),
            operation_id: OperationId::new("op-b").unwrap(),
        },
    );
    assert_eq!(
        world.response(0, queued),
        None,
        "the start waits for the slot"
    );
    let refused = release(&mut world, 0, &second);
    assert_eq!(
        conflict_code(&refused),
        Some(ErrorCode::IllegalState),
        "{refused:?}"
    );
}

/// An execution past its deadline without a receipt: its usage is unknown
/// from the deadline's millisecond on, not before.
#[test]
fn usage_becomes_unknown_exactly_at_the_execution_deadline() {
    let mut world = World::new(1, no_shards_policy(), |_| {});
    let id = reservation_id(&ask(&mut world, reserve_request("req-1", 100, Some(5_000))));
    start(&mut world, 0, &id, "op-1");
    world.advance(4_999);
    assert_eq!(
        world.agents[0].core.reservation(&id).unwrap().state,
        AgentState::Started
    );
    world.advance(1);
    assert_eq!(
        world.agents[0].core.reservation(&id).unwrap().state,
        AgentState::UsageUnknown
    );
    // The gateway's receipt still settles it.
    assert_eq!(
        state_of(&settle(&mut world, 0, &id, "op-1", 60)),
        AgentState::Settled
    );
}

/// A receipt the center has not acknowledged yet is no work for the
/// retention sweep, even past its window: the timer stays due when the
/// next record's window ends, not a retry interval later.
#[test]
fn an_unacknowledged_receipt_does_not_hold_up_the_retention_timer() {
    let (mut world, shard) = short_window_shard_world(1024);
    // Still partitioned: the restart closes the shard, and its receipt
    // waits for the center.
    world.restart_agent(0);
    let (receipt, acknowledged) = receipt_of(&world, &shard).expect("a receipt");
    assert!(!acknowledged);
    let closed_at = receipt.closed_at.unix_ms();
    world.advance(500);
    // The first call marks the partition; the next is refused at once (no
    // shard left): a record at rest from here.
    reserve(&mut world, 0, "x", 10);
    let refused = reserve(&mut world, 0, "y", 10);
    assert!(
        matches!(refused, GatewayResponse::Unavailable { .. }),
        "{refused:?}"
    );
    let refused_at = wall_ms(&world);
    advance_to(&mut world, closed_at + WINDOW_MS);
    assert_eq!(
        receipt_of(&world, &shard).map(|(_, acked)| acked),
        Some(false)
    );
    assert_eq!(
        world.agents[0].core.poll_timeout(),
        Some(world.mono_ms + (refused_at + WINDOW_MS - wall_ms(&world)))
    );
}

/// A release the center refused while its hold was half expired
/// (`EXPIRING`) ends as the center's reservation does: the agent asks how it
/// ended and the record reads `EXPIRED`, not `RELEASING` for good (a record
/// left so would count against `open_reservations_max` and never be
/// forgotten). A release repeated then is refused at once.
#[test]
fn a_release_refused_while_the_hold_expires_ends_expired() {
    let mut world = World::new(1, no_shards_policy(), |_| {});
    let id = reservation_id(&reserve(&mut world, 0, "req-1", 100));
    // The hold runs out; the center's expiry runs its first half only.
    world.mono_ms += 30_000;
    let wall = world.now().wall;
    world
        .central
        .operate(ledger::protocol::Operation::BeginExpiry, wall)
        .expect("committed");
    assert_eq!(central_state(&world, &id), Some(ReservationState::Expiring));
    let refused = release(&mut world, 0, &id);
    assert_eq!(
        conflict_code(&refused),
        Some(ErrorCode::IllegalState),
        "the center's refusal, passed on: {refused:?}"
    );
    // The retry timer asks the center how it ended (no worker runs).
    world.mono_ms += 1_000;
    let now = world.now();
    world.agents[0].core.handle_timeout(now);
    world.pump();
    let record = world.agents[0].core.reservation(&id).unwrap();
    assert_eq!((record.state, &record.sync), (AgentState::Expired, &None));
    assert_eq!(world.agents[0].core.status().reservations_in_flight, 0);
    let again = release(&mut world, 0, &id);
    assert_eq!(
        conflict_code(&again),
        Some(ErrorCode::IllegalState),
        "{again:?}"
    );
}
