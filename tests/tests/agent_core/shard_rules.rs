//! Scenarios of the agent core: emergency shards: requesting, accepting, local admission, closing and handing back.

use agent_core::{
    AgentState, CentralCall, CentralReply, CentralResult, GatewayRequest, GatewayReserve,
    GatewayResponse, ShardRefusal,
};
use ledger::protocol::ErrorCode;
use ledger::store::contract::sample_policy;
use ledger::{Dimension, Rejection};
use reservoir_tests::central_node::Delivery;
use reservoir_tests::crypto::SimSigner;
use reservoir_tests::world::World;
use shard_format::{
    BootNonce, EmergencyShardV1, IdempotencyKey, Route, ShardCloseReason, ShardId, Timestamp,
    sign_document,
};

use super::{
    all_shards, from_shard, no_shards_policy, pair, partitioned_world_with_shard, reservation_id,
    reserve, settle, start, state_of,
};

/// The shard requests the center answered so far (every one of them, in a
/// world whose agents are not partitioned from it).
fn shard_requests(world: &World) -> usize {
    world
        .central_log
        .iter()
        .filter(|(_, call, _)| matches!(call, CentralCall::IssueShard { .. }))
        .count()
}

/// The center's answers to shard requests for `route`, in order.
fn shard_replies(world: &World, route: &str) -> Vec<CentralReply> {
    world
        .central_log
        .iter()
        .filter_map(|(_, call, reply)| match call {
            CentralCall::IssueShard { route: asked, .. } if asked.as_str() == route => {
                Some(reply.clone())
            }
            _ => None,
        })
        .collect()
}

/// Makes the pair known to agent 0 with one central reservation, given back
/// at once, so the retry timer starts asking for the pair's shards.
fn make_pair_known(world: &mut World, route: &str) {
    let call = world.gateway(
        0,
        GatewayRequest::Reserve(GatewayReserve {
            idempotency_key: IdempotencyKey::new(format!("warm-up-{route}")).unwrap(),
            subject: pair().subject,
            route: Route::new(route).unwrap(),
            units: 10,
            min_units: None,
            deadline_ms: None,
            priority: None,
            request: None,
            more_legs: Vec::new(),
        }),
    );
    let id = reservation_id(world.response(0, call).expect("answered"));
    let call = world.gateway(0, GatewayRequest::Release { reservation: id });
    assert!(world.response(0, call).is_some());
}

/// Moves the world to monotonic time `mono_ms` in one step (one timeout).
fn advance_to(world: &mut World, mono_ms: u64) {
    let now = world.now().mono_ms;
    assert!(mono_ms > now, "time only moves forward");
    world.advance(mono_ms - now);
}

/// Asserts that after a first shard request at 1000 ms answered with a
/// backoff of `backoff_ms`, nothing is asked one retry interval before the
/// backoff ends and the next request goes out exactly when it ends.
fn assert_next_request_after(world: &mut World, backoff_ms: u64) {
    assert_eq!(shard_requests(world), 1, "the first request, at 1000 ms");
    let due = 1_000 + backoff_ms;
    advance_to(world, due - 1_000);
    assert_eq!(shard_requests(world), 1, "nothing asked during the backoff");
    world.advance(1_000);
    assert_eq!(
        shard_requests(world),
        2,
        "asked again when the backoff ends"
    );
}

#[test]
fn a_refused_shard_is_asked_for_again_after_ten_retry_intervals() {
    let mut world = World::new(1, sample_policy(1), |_| {});
    world.tamper_next_shard[0] = true;
    make_pair_known(&mut world, "chat.generate");
    world.advance(1_000);
    assert!(all_shards(&world.agents[0].core).is_empty(), "refused");
    let retry = world.agents[0].config.retry_interval_ms;
    assert_next_request_after(&mut world, 10 * retry);
    assert_eq!(
        all_shards(&world.agents[0].core).len(),
        1,
        "the second one, untampered, is accepted"
    );
}

#[test]
fn a_rejected_shard_request_waits_for_its_retry_after() {
    // Refills of 100 units every 5 s; 900 units held leave 100 of the 200 a
    // shard takes: the center answers 429 with Retry-After 5 s.
    let mut policy = sample_policy(1);
    policy.refill.interval_ms = 5_000;
    let mut world = World::new(1, policy, |_| {});
    let held = reserve(&mut world, 0, "held-800", 800);
    assert_eq!(state_of(&held), AgentState::Reserved);
    let held = reserve(&mut world, 0, "held-100", 100);
    assert_eq!(state_of(&held), AgentState::Reserved);
    world.advance(1_000);
    match &shard_replies(&world, "chat.generate")[..] {
        [CentralReply::Rejected(rejection)] => {
            assert_eq!(rejection.retry_after_seconds, Some(5));
        }
        other => panic!("expected one 429, got {other:?}"),
    }
    assert_next_request_after(&mut world, 5_000);
}

/// A 429 that names no Retry-After (the center always names one, 60 s
/// when waiting alone will not help; a reply read from a center that left
/// it out has none): the next request waits thirty retry intervals.
#[test]
fn a_rejected_shard_request_without_retry_after_waits_thirty_retry_intervals() {
    let mut world = World::new(1, sample_policy(1), |_| {});
    make_pair_known(&mut world, "chat.generate");
    // Drive the agent by hand: its timeout sends the shard request, which
    // is answered with a 429 without Retry-After.
    world.mono_ms += 1_000;
    let now = world.now();
    let node = &mut world.agents[0];
    node.core.handle_timeout(now);
    node.commit_journal();
    let outgoing = node.core.poll_central().expect("the shard request");
    assert!(matches!(outgoing.call, CentralCall::IssueShard { .. }));
    let rejection = Rejection {
        dimension: Dimension::Capacity,
        policy_generation: 1,
        retry_after_seconds: None,
        rate_limit: None,
    };
    node.core.handle_central(
        outgoing.request,
        CentralResult::Reply(CentralReply::Rejected(rejection)),
        now,
    );
    node.commit_journal();
    let retry = node.config.retry_interval_ms;
    assert_eq!(
        node.core.poll_timeout(),
        Some(now.mono_ms + 30 * retry),
        "the agent sleeps until the backoff ends"
    );
}

#[test]
fn a_shard_request_refused_by_policy_waits_sixty_retry_intervals() {
    let mut world = World::new(1, no_shards_policy(), |_| {});
    make_pair_known(&mut world, "chat.generate");
    world.advance(1_000);
    assert!(
        matches!(
            &shard_replies(&world, "chat.generate")[..],
            [CentralReply::Refused { .. }]
        ),
        "{:?}",
        world.central_log.last()
    );
    let retry = world.agents[0].config.retry_interval_ms;
    assert_next_request_after(&mut world, 60 * retry);
}

/// §5.2: another registration of the same identity supersedes the boot;
/// the next shard request is refused `superseded_boot` and the agent
/// registers again, then gets shards of its new boot.
#[test]
fn a_superseded_boot_registers_again_and_is_supplied_under_the_new_one() {
    let mut world = World::new(1, sample_policy(1), |_| {});
    assert_eq!(world.agents[0].core.boot_epoch(), Some(1));
    make_pair_known(&mut world, "chat.generate");
    // Another process with the same key registers meanwhile (its request
    // 1 ms after this one's, so the center takes it).
    let identity = world.agents[0].identity().clone();
    let wall = Timestamp::from_unix_ms(world.now().wall.unix_ms() + 1).unwrap();
    let other = world.central.handle(
        &identity,
        &CentralCall::Register,
        BootNonce([0xAB; 16]),
        wall,
    );
    assert!(
        matches!(
            other,
            Delivery::Answered(CentralReply::Registered { boot_epoch: 2, .. })
        ),
        "{other:?}"
    );
    world.advance(1_000);
    assert!(
        matches!(
            &shard_replies(&world, "chat.generate")[..],
            [CentralReply::Refused {
                code: ErrorCode::SupersededBoot,
                ..
            }]
        ),
        "{:?}",
        world.central_log.last()
    );
    world.advance(1_000);
    assert_eq!(
        world.agents[0].core.boot_epoch(),
        Some(3),
        "registered again"
    );
    world.advance(1_000);
    let shards = all_shards(&world.agents[0].core);
    assert_eq!(shards.len(), 1, "{shards:?}");
    assert_eq!(shards[0].boot_epoch, 3);
}

/// §5.3: a shard is fresh while it stays usable for longer than
/// `shard_refresh_margin_ms`; the agent wakes for the refresh and asks for
/// the next one exactly when the margin is reached.
#[test]
fn a_shard_is_refreshed_exactly_its_margin_before_its_end() {
    // A retry timer of 1 ms, so the agent looks at every millisecond.
    let mut world = World::new(1, sample_policy(1), |config| {
        config.retry_interval_ms = 1;
    });
    make_pair_known(&mut world, "chat.generate");
    world.advance(1_000);
    assert_eq!(shard_requests(&world), 1);
    let shard = all_shards(&world.agents[0].core)[0].clone();
    let margin = world.agents[0].config.shard_refresh_margin_ms;
    let refresh_at = shard.usable_until_ms - margin;
    assert_eq!(
        world.agents[0].core.poll_timeout(),
        Some(refresh_at),
        "nothing else to do: the agent sleeps until the refresh"
    );
    world.advance(1);
    assert_eq!(shard_requests(&world), 1, "fresh: nothing asked");
    advance_to(&mut world, refresh_at - 1);
    assert_eq!(shard_requests(&world), 1, "still fresh at the last ms");
    world.advance(1);
    assert_eq!(shard_requests(&world), 2, "refreshed at the margin");
    let shards = all_shards(&world.agents[0].core);
    assert_eq!(shards.len(), 2);
    assert!(shards.iter().all(|shard| !shard.closed), "{shards:?}");
}

/// Each pair is supplied on its own: a shard of one route of a subject
/// neither stops the other route's request nor sets its refresh time.
#[test]
fn each_route_of_a_subject_gets_and_refreshes_its_own_shard() {
    let mut world = World::new(1, sample_policy(1), |_| {});
    let mut embed = sample_policy(1);
    embed.route = Route::new("embed").unwrap();
    let wall = world.now().wall;
    world
        .central
        .operate(ledger::protocol::Operation::Publish(Box::new(embed)), wall)
        .expect("published");
    make_pair_known(&mut world, "chat.generate");
    world.advance(1_000);
    make_pair_known(&mut world, "embed");
    world.advance(1_000);
    let shards = all_shards(&world.agents[0].core);
    let routes: Vec<&str> = shards.iter().map(|shard| shard.route.as_str()).collect();
    assert_eq!(routes.len(), 2, "{shards:?}");
    assert!(routes.contains(&"chat.generate") && routes.contains(&"embed"));
    // The older one, the chat route's, is the first to refresh.
    let margin = world.agents[0].config.shard_refresh_margin_ms;
    let first_refresh = shards
        .iter()
        .map(|shard| shard.usable_until_ms - margin)
        .min()
        .unwrap();
    assert_eq!(world.agents[0].core.poll_timeout(), Some(first_refresh));
}

/// While a pair's shard request is out, the pair sets no timer of its own:
/// its answer (or its deadline, reported by the shell) wakes the agent.
#[test]
fn a_shard_request_in_flight_sets_no_timer_for_its_pair() {
    let mut world = World::new(1, sample_policy(1), |_| {});
    make_pair_known(&mut world, "chat.generate");
    // Drive the agent by hand: its timeout sends the shard request, which
    // stays out while the timer is asked.
    world.mono_ms += 1_000;
    let now = world.now();
    let node = &mut world.agents[0];
    node.core.handle_timeout(now);
    node.commit_journal();
    let outgoing = node.core.poll_central().expect("the shard request");
    assert!(matches!(outgoing.call, CentralCall::IssueShard { .. }));
    assert!(node.core.poll_central().is_none());
    let retry = node.config.retry_interval_ms;
    let wake = node.core.poll_timeout().unwrap_or(u64::MAX);
    assert!(
        wake > now.mono_ms + retry,
        "no wake-up for the pair while its request is out: {wake}"
    );
    // The answer comes: the timer is the new shard's refresh.
    let identity = node.identity().clone();
    let Delivery::Answered(reply) =
        world
            .central
            .handle(&identity, &outgoing.call, BootNonce([0; 16]), now.wall)
    else {
        panic!("the center answers");
    };
    let node = &mut world.agents[0];
    node.core
        .handle_central(outgoing.request, CentralResult::Reply(reply), now);
    node.commit_journal();
    let shard = all_shards(&node.core)[0].clone();
    assert_eq!(
        node.core.poll_timeout(),
        Some(shard.usable_until_ms - node.config.shard_refresh_margin_ms)
    );
}

/// §5.8: an unused shard stays open until its end, through a partition and
/// the reconnect after it.
#[test]
fn an_unused_shard_stays_open_through_a_partition_and_its_end() {
    let mut world = partitioned_world_with_shard();
    reserve(&mut world, 0, "p-0", 10); // marks the partition
    world.advance(1_000);
    world.partitioned[0] = false;
    for _ in 0..3 {
        world.advance(1_000);
    }
    assert!(!world.agents[0].core.is_partitioned(&pair()));
    let shards = all_shards(&world.agents[0].core);
    assert!(!shards[0].closed, "{shards:?}");
    assert_eq!(world.agents[0].core.terminal_receipts().count(), 0);
}

/// §5.8: a shard used while partitioned (here by one unit) is closed
/// `reconnect` once its pair is healthy again, not before.
#[test]
fn a_shard_used_by_one_unit_is_handed_back_once_its_pair_is_healthy() {
    let mut world = partitioned_world_with_shard();
    reserve(&mut world, 0, "p-0", 10); // marks the partition
    let id = reservation_id(&reserve(&mut world, 0, "p-1", 1));
    start(&mut world, 0, &id, "op-1");
    assert_eq!(
        state_of(&settle(&mut world, 0, &id, "op-1", 1)),
        AgentState::Settled
    );
    // Still partitioned: the shard stays open and keeps admitting.
    world.advance(1_000);
    assert!(!all_shards(&world.agents[0].core)[0].closed);
    let again = reserve(&mut world, 0, "p-2", 10);
    assert!(from_shard(&again), "{again:?}");
    let id = reservation_id(&again);
    let call = world.gateway(0, GatewayRequest::Release { reservation: id });
    assert!(world.response(0, call).is_some());
    assert_eq!(world.agents[0].core.terminal_receipts().count(), 0);

    world.partitioned[0] = false;
    world.advance(1_000); // the probe's answer ends the partition
    world.advance(1_000); // the shard closes; its receipt goes up
    let shards = all_shards(&world.agents[0].core);
    assert!(shards[0].closed, "{shards:?}");
    let (receipt, acknowledged) = world.agents[0].core.terminal_receipts().next().unwrap();
    assert_eq!(receipt.reason, ShardCloseReason::Reconnect);
    assert_eq!(
        (receipt.spent_units, receipt.confirmed_unused_units),
        (1, 199)
    );
    assert!(acknowledged);
}

/// §5.6: a partitioned pair is admitted only from a shard of its own pair,
/// whatever shards another route of the same subject holds.
#[test]
fn a_pair_without_a_shard_is_not_admitted_from_another_routes_shard() {
    let mut world = partitioned_world_with_shard();
    let embed = |world: &mut World, key: &str| {
        let call = world.gateway(
            0,
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
            }),
        );
        world.response(0, call).cloned().expect("answered")
    };
    embed(&mut world, "e-0"); // marks the embed pair partitioned
    let refused = embed(&mut world, "e-1");
    assert!(
        matches!(
            refused,
            GatewayResponse::Unavailable {
                code: ErrorCode::CentralUnreachable,
                ..
            }
        ),
        "{refused:?}"
    );
    assert_eq!(
        all_shards(&world.agents[0].core)[0].terms.local_available,
        200,
        "the chat route's shard lent nothing"
    );
}

/// §5.5: a shard admits until the last millisecond before its usable end,
/// even when a gateway request comes before the timer that closes it.
#[test]
fn a_reserve_at_the_shards_usable_end_is_not_admitted_from_it() {
    let mut world = partitioned_world_with_shard();
    reserve(&mut world, 0, "p-0", 10); // marks the partition
    let until = all_shards(&world.agents[0].core)[0].usable_until_ms;
    // Requests arrive without a timeout in between (the timer is late).
    world.mono_ms = until - 1;
    assert!(from_shard(&reserve(&mut world, 0, "p-last", 10)));
    world.mono_ms = until;
    let late = reserve(&mut world, 0, "p-late", 10);
    assert!(
        matches!(late, GatewayResponse::Unavailable { .. }),
        "{late:?}"
    );
}

/// §5.8: when a shard closes, its unstarted reservations become `EXPIRED`,
/// its started ones `USAGE_UNKNOWN`, and nothing else changes.
#[test]
fn a_closing_shard_ends_its_own_reservations_and_no_others() {
    let mut world = partitioned_world_with_shard();
    // A central reservation made while the center was reachable.
    world.partitioned[0] = false;
    let central = reservation_id(&reserve(&mut world, 0, "c-1", 10));
    world.partitioned[0] = true;
    reserve(&mut world, 0, "p-0", 10); // marks the partition
    let until = all_shards(&world.agents[0].core)[0].usable_until_ms;
    advance_to(&mut world, until - 10);
    let started = reservation_id(&reserve(&mut world, 0, "p-1", 10));
    assert_eq!(
        state_of(&start(&mut world, 0, &started, "op-1")),
        AgentState::Started
    );
    let reserved = reserve(&mut world, 0, "p-2", 10);
    assert!(from_shard(&reserved), "{reserved:?}");
    let reserved = reservation_id(&reserved);
    world.advance(10); // the shard's validity ends
    let core = &world.agents[0].core;
    assert!(all_shards(core)[0].closed);
    assert_eq!(
        core.reservation(&started).unwrap().state,
        AgentState::UsageUnknown
    );
    assert_eq!(
        core.reservation(&reserved).unwrap().state,
        AgentState::Expired
    );
    assert_eq!(
        core.reservation(&central).unwrap().state,
        AgentState::Reserved,
        "a central reservation is not the shard's"
    );
}

/// The key the simulated center signs with (`World::new`'s).
fn central_signer() -> SimSigner {
    SimSigner::new("central", 0xC0FFEE)
}

/// The agent's accepted shard, copied under a new ID and the next fence,
/// with `change` applied, signed again by the center's key.
fn variant_of_the_shard(
    world: &World,
    name: &str,
    change: impl FnOnce(&mut EmergencyShardV1),
) -> EmergencyShardV1 {
    let mut shard = world.agents[0]
        .core
        .shard_ledgers()
        .next()
        .unwrap()
        .shard()
        .clone();
    shard.shard = ShardId::new(name).unwrap();
    shard.fence += 1;
    change(&mut shard);
    sign_document(&mut shard, &central_signer());
    shard
}

/// §5.4: a shard is accepted only for this process's registered boot, its
/// epoch and its nonce both.
#[test]
fn a_shard_of_another_boot_epoch_or_nonce_is_refused() {
    let mut world = partitioned_world_with_shard();
    let now = world.now();
    let other_nonce = variant_of_the_shard(&world, "sh-other-nonce", |shard| {
        shard.boot_nonce = BootNonce([0xAB; 16]);
    });
    let other_epoch = variant_of_the_shard(&world, "sh-other-epoch", |shard| {
        shard.boot_epoch += 1;
    });
    let same_boot = variant_of_the_shard(&world, "sh-same-boot", |_| {});
    let core = &mut world.agents[0].core;
    assert_eq!(
        core.accept_shard(other_nonce, now),
        Err(ShardRefusal::OtherBoot)
    );
    assert_eq!(
        core.accept_shard(other_epoch, now),
        Err(ShardRefusal::OtherBoot)
    );
    assert_eq!(core.accept_shard(same_boot, now), Ok(()), "the control");
}

/// §5.8: only a refused shard naming this identity and this boot (epoch
/// and nonce), and neither held nor handed back already, is handed back
/// with an all-unused receipt.
#[test]
fn a_refused_shard_of_another_boot_is_not_handed_back() {
    let mut world = partitioned_world_with_shard();
    let now = world.now();
    let other_nonce = variant_of_the_shard(&world, "sh-other-nonce", |shard| {
        shard.boot_nonce = BootNonce([0xAB; 16]);
    });
    let other_epoch = variant_of_the_shard(&world, "sh-other-epoch", |shard| {
        shard.boot_epoch += 1;
    });
    let same_boot = variant_of_the_shard(&world, "sh-same-boot", |_| {});
    let refusal = ShardRefusal::Expired;
    let core = &mut world.agents[0].core;
    assert!(!core.hand_back_refused_shard(&other_nonce, &refusal, now));
    assert!(!core.hand_back_refused_shard(&other_epoch, &refusal, now));
    assert_eq!(core.terminal_receipts().count(), 0);
    assert!(core.poll_refused_shards().is_empty());
    // Nor is a shard of this boot refused for a reason that is not this
    // process's own: another identity, another boot, a duplicate.
    for not_ours in [
        ShardRefusal::OtherIdentity,
        ShardRefusal::OtherBoot,
        ShardRefusal::Duplicate,
    ] {
        assert!(!core.hand_back_refused_shard(&same_boot, &not_ours, now));
    }
    assert_eq!(core.terminal_receipts().count(), 0);
    // The control: a shard of this boot refused here is handed back, once.
    assert!(core.hand_back_refused_shard(&same_boot, &refusal, now));
    assert_eq!(core.terminal_receipts().count(), 1);
    assert_eq!(core.poll_refused_shards().len(), 1);
    assert!(!core.hand_back_refused_shard(&same_boot, &refusal, now));
    assert_eq!(core.poll_refused_shards().len(), 0);
    // A refused copy of a shard the agent holds (tampered in transit) is
    // not handed back: the one it holds is in use and closes on its own.
    let mut tampered = core.shard_ledgers().next().unwrap().shard().clone();
    tampered.signature.0[0] ^= 1;
    let refusal = core.accept_shard(tampered.clone(), now).unwrap_err();
    assert!(matches!(refusal, ShardRefusal::Signature(_)), "{refusal:?}");
    assert!(!core.hand_back_refused_shard(&tampered, &refusal, now));
    assert_eq!(
        core.terminal_receipts().count(),
        1,
        "none for the held shard"
    );
    assert!(core.poll_refused_shards().is_empty());
}
