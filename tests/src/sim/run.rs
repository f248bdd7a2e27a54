//! One simulated run: the real central ledger and real agent cores, driven
//! by one seed through a network that delays, drops, duplicates and
//! partitions, agents that crash (and restart from stale disks), a central
//! store whose commits fail, gateways that retry, executors that overrun
//! or report late, policy publishes, refills, epoch rollovers and attacks
//! with copied and replayed shards. Every step is checked; a liveness phase
//! then heals all faults and everything in doubt must resolve.

use std::collections::{BTreeMap, BTreeSet};

use agent_core::{
    AgentConfig, AgentReservation, AgentState, CallId, CentralCall, CentralReply, CentralResult,
    GatewayRequest, GatewayReserve, GatewayResponse, JournalKey, JournalRecord, Now, RequestId,
    ReservationPath,
};
use ledger::protocol::{ErrorCode, Operation, Reply};
use ledger::{
    AccountKey, LegActual, LegAsk, PairKey, PublishOutcome, RegisterOutcome, ReservationOrigin,
    ReserveRequest, invariants,
};
use shard_format::{
    AdmissionBudgetV1, BootNonce, Digest, EmergencyMode, GatewayIdentity, IdempotencyKey,
    LimitReservationV1, OperationId, Refill, ReservationId, ReservationState, Route, RouteMode,
    ShardId, Subject, Timestamp,
};

use super::admission::{Admission, LegHold, check_legs_together, check_partial_admission};
use super::queue::EventQueue;
use super::rng::Rng;
use super::{RunOutcome, Scenario, SimOptions, ViolationClass};
use crate::agent_node::{AgentKey, AgentNode, Journal};
use crate::central_node::{CentralNode, Delivery, Observation};
use crate::crypto::{SimSigner, SimVerifier};
use crate::world::WALL_START_MS;

/// Subjects and their fairness weights: two tenants.
const SUBJECTS: [(&str, u32); 2] = [("tenant-a", 1), ("tenant-b", 3)];
/// Every subject's routes: tokens (the route of one-leg requests), requests
/// (a few units a call, refilled), and a concurrency-like route (a few
/// units opening each epoch, never refilled). Multi-leg requests draw
/// their legs from these.
const ROUTES: [&str; 3] = ["chat.generate", "chat.requests", "chat.concurrent"];
const TOKENS: usize = 0;
const REQUESTS: usize = 1;
const CONCURRENT: usize = 2;
/// Faults stop here; the liveness phase begins.
const HEAL_AT_MS: u64 = 40_000;
/// The liveness phase must converge before this.
const LIVENESS_DEADLINE_MS: u64 = HEAL_AT_MS + 20 * 60 * 1000;
const WORKER_INTERVAL_MS: u64 = 1_000;
/// Every this many checked central steps, and at the end of every run, the
/// whole central ledger is audited; the steps between audit only the
/// accounts (with all their records) and pairs their transitions wrote.
/// Whatever a step broke without writing it is still found within 64
/// checked steps (a run takes about 580 steps of every kind), and the full
/// audit, whose cost grows with the ledger, stays a small share of a run.
const FULL_AUDIT_EVERY: u64 = 64;
/// One gateway reserve in this many is flexible: it gives a `minUnits`.
const FLEXIBLE_RESERVE_ONE_IN: u64 = 4;
/// One logical request in this many (of the main workload) has several
/// legs: its tokens leg and one or two of the subject's other routes.
const MULTI_LEG_ONE_IN: u64 = 4;

#[derive(Debug, Clone)]
enum Event {
    GatewayStep(usize),
    ToCentral {
        agent: usize,
        incarnation: u64,
        request: RequestId,
        call: CentralCall,
        duplicate: bool,
    },
    ToAgent {
        agent: usize,
        incarnation: u64,
        request: RequestId,
        reply: CentralReply,
    },
    Deadline {
        agent: usize,
        incarnation: u64,
        request: RequestId,
    },
    AgentTimer(usize),
    Workers,
    Snapshot(usize),
    Crash {
        agent: usize,
        stale: bool,
    },
    Publish(usize),
    ShardCopyAttack {
        from: usize,
        to: usize,
    },
    ReceiptReplayAttack(usize),
    /// A gateway sends a finished logical request's reserve again (same
    /// idempotency key), inside or past the retention window, as it was or
    /// with one field changed.
    Replay {
        index: usize,
        after_window: bool,
        change: ReplayChange,
    },
    /// The hostile identity tries to act on, read and squat other
    /// identities' reservations with its own key.
    HostileAttack,
}

/// What a replayed reserve changes from the original request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReplayChange {
    /// The very request again: a duplicate.
    Unchanged,
    /// One more unit.
    Units,
    /// Another request body (so another request digest).
    Body,
    /// Another `minUnits` (a fixed request made flexible, or a flexible
    /// one's floor lowered or dropped).
    MinUnits,
    /// Another set of legs: a leg added to a one-leg request; a later
    /// leg's units changed, or the last of three legs dropped.
    Leg,
}

/// Where a gateway's logical request stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Reserve,
    AwaitReserve,
    Start,
    AwaitStart,
    /// The executor runs; its report is the next step.
    Running,
    Settle,
    AwaitSettle,
    Release,
    AwaitRelease,
    Done,
}

#[derive(Debug, Clone)]
struct Logical {
    agent: usize,
    subject: usize,
    /// The route of the first leg (an index into [`ROUTES`]).
    route: usize,
    key: IdempotencyKey,
    /// The first leg's ask.
    units: u64,
    /// A flexible request's floor (the first leg's).
    min_units: Option<u64>,
    /// The legs after the first, on the same subject; empty for one leg.
    more_legs: Vec<LegShape>,
    /// The leg a multi-leg settle leaves out (it settles at its grant).
    settle_without: Option<usize>,
    phase: Phase,
    reservation: Option<ReservationId>,
    operation: OperationId,
    /// The first leg's actual units.
    actual: u64,
    attempts: u32,
}

/// A leg after the first of a multi-leg logical request; its subject is
/// the request's (the burst workload may change that after planning).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct LegShape {
    route: usize,
    units: u64,
    min_units: Option<u64>,
    actual: u64,
}

impl Logical {
    /// The `index`-th logical request, not yet sent: its legs `shapes`
    /// (the first leg first) on `subject`, from `agent`'s gateway.
    fn planned(
        index: usize,
        agent: usize,
        subject: usize,
        shapes: &[LegShape],
        settle_without: Option<usize>,
    ) -> Self {
        let first = shapes[0];
        Logical {
            agent,
            subject,
            route: first.route,
            key: IdempotencyKey::new(format!("k{index}")).expect("valid"),
            units: first.units,
            min_units: first.min_units,
            more_legs: shapes[1..].to_vec(),
            settle_without,
            phase: Phase::Reserve,
            reservation: None,
            operation: OperationId::new(format!("op-{index}")).expect("valid"),
            actual: first.actual,
            attempts: 0,
        }
    }

    fn is_multi(&self) -> bool {
        !self.more_legs.is_empty()
    }

    /// Every leg's (route, units, floor, actual), the first leg first.
    fn shapes(&self) -> Vec<LegShape> {
        let first = LegShape {
            route: self.route,
            units: self.units,
            min_units: self.min_units,
            actual: self.actual,
        };
        std::iter::once(first)
            .chain(self.more_legs.iter().copied())
            .collect()
    }

    fn more_leg_asks(&self) -> Vec<LegAsk> {
        self.more_legs
            .iter()
            .map(|leg| LegAsk {
                subject: subject(self.subject),
                route: route_at(leg.route),
                units: leg.units,
                min_units: leg.min_units,
            })
            .collect()
    }

    /// The per-leg actuals of a multi-leg settle, one leg perhaps left out.
    fn leg_actuals(&self) -> Vec<LegActual> {
        self.shapes()
            .into_iter()
            .enumerate()
            .filter(|(index, _)| Some(*index) != self.settle_without)
            .map(|(_, leg)| LegActual {
                subject: subject(self.subject),
                route: route_at(leg.route),
                actual_units: leg.actual,
            })
            .collect()
    }

    /// Every leg's reservation ID under `owner`, the first leg's first.
    fn leg_ids(&self, owner: &GatewayIdentity) -> Vec<ReservationId> {
        self.shapes()
            .iter()
            .map(|leg| {
                ReservationId::derive(
                    owner,
                    &subject(self.subject),
                    &route_at(leg.route),
                    &self.key,
                )
            })
            .collect()
    }
}

/// The fault rates and shapes one run draws (swarm testing).
#[derive(Debug, Clone)]
struct Swarm {
    drop_rate: f64,
    reply_loss_rate: f64,
    duplicate_rate: f64,
    delay_max_ms: u64,
    commit_failure_rate: f64,
    crash_before_commit_rate: f64,
    overage_rate: f64,
    late_report_rate: f64,
    slow_start_rate: f64,
    /// Starts are limited to one at a time per agent and route.
    limited: bool,
}

/// What a thread's runs take over from one another: buffers allocated by
/// the first run and only cleared after.
#[derive(Default)]
pub(super) struct RunBuffers {
    queue: EventQueue<Event>,
}

pub(super) struct Run {
    seed: u64,
    options: SimOptions,
    rng: Rng,
    swarm: Swarm,
    now: u64,
    queue: EventQueue<Event>,
    central: CentralNode,
    agents: Vec<AgentNode>,
    /// Per agent: offset of its monotonic clock, skew of its wall clock.
    mono_offset: Vec<u64>,
    wall_skew: Vec<i64>,
    incarnation: Vec<u64>,
    partitions: Vec<Option<(u64, u64)>>,
    snapshots: Vec<Option<Journal>>,
    next_timer: Vec<u64>,
    answered: BTreeSet<(usize, u64, RequestId)>,
    logicals: Vec<Logical>,
    calls: BTreeMap<(usize, CallId), usize>,
    next_call: CallId,
    next_nonce: u64,
    policies: Vec<AdmissionBudgetV1>,
    // ----- the auditor's reference -----
    /// Central reservations ever made (a second `Reserved` is a violation).
    reserved_ids: BTreeSet<ReservationId>,
    /// Reservations gateways were told are started (central path).
    started_central: BTreeSet<ReservationId>,
    /// Actual usage each executor reported and which agent acknowledged it.
    reported: BTreeMap<ReservationId, (usize, u64)>,
    /// Which process admitted from which shard.
    shard_admitter: BTreeMap<ShardId, (usize, u64)>,
    /// When each unknown began, by owner (agent, or usize::MAX for
    /// central) and ID. Nested rather than keyed by (owner, ID) so that a
    /// check looks IDs up by reference, cloning only the new ones.
    unknown_since: BTreeMap<usize, BTreeMap<ReservationId, u64>>,
    last_reserve: BTreeMap<usize, (usize, u64)>,
    // ----- retention (the `retention` scenario) -----
    /// The retention window of the central ledger and the agents, in a
    /// retention run.
    retention: Option<u64>,
    /// When the central ledger last made each reservation ID (a second
    /// `Reserved` inside the window is a violation).
    first_reserved: BTreeMap<ReservationId, u64>,
    /// When each logical request's gateway was first told it is reserved.
    first_admitted: BTreeMap<usize, u64>,
    /// Logical requests whose replays are scheduled.
    replayed: BTreeSet<usize>,
    /// When each agent last restarted from a disk restored from an older
    /// copy: what it acknowledged before is legitimately gone from it
    /// (design §7.4), so a replay may be new to the agent; the center,
    /// which keeps the derived ID, must still not reserve twice.
    stale_restart_at: BTreeMap<usize, u64>,
    /// Replays scheduled but not yet sent.
    replays_pending: usize,
    /// Replays sent and not yet answered: (agent, call) → (logical, past
    /// the window).
    replay_calls: BTreeMap<(usize, CallId), (usize, bool, ReplayChange)>,
    // ----- the hostile agent (the `hostile_agent` scenario) -----
    /// An enrolled identity that runs no agent, only attacks; and the
    /// stream its choices come from (apart from the run's, so that every
    /// other run's trajectory is what it was before it existed).
    hostile: Option<(GatewayIdentity, Rng)>,
    /// Shards the hostile identity was issued (their IDs).
    hostile_shards: u64,
    outcome: RunOutcome,
    healed: bool,
    /// Central steps checked so far (every [`FULL_AUDIT_EVERY`]th audits all).
    central_checks: u64,
    /// Agent reservations whose legs were found apart (reported once).
    /// Per agent, so that the check looks them up without a clone.
    legs_apart: Vec<BTreeSet<ReservationId>>,
}

type CentralFingerprint = (
    Vec<(AccountKey, ledger::AccountTerms)>,
    Vec<LimitReservationV1>,
    Vec<ledger::TombstoneRecord>,
);

fn subject(index: usize) -> Subject {
    Subject::new(SUBJECTS[index].0).expect("valid")
}

fn route() -> Route {
    route_at(TOKENS)
}

fn route_at(index: usize) -> Route {
    Route::new(ROUTES[index]).expect("valid")
}

fn pair(index: usize) -> PairKey {
    PairKey::new(subject(index), route())
}

/// One owner's unknowns after a check: those in `current` start (now, if
/// new), those no longer in it are resolved (their durations recorded, in
/// ID order).
fn track_unknowns(
    since: &mut BTreeMap<ReservationId, u64>,
    current: &BTreeSet<&ReservationId>,
    now: u64,
    durations_ms: &mut Vec<u64>,
) {
    for id in current {
        if !since.contains_key(*id) {
            since.insert((*id).clone(), now);
        }
    }
    since.retain(|id, began| {
        let unresolved = current.contains(id);
        if !unresolved {
            durations_ms.push(now - *began);
        }
        unresolved
    });
}

/// A floor for one reserve in [`FLEXIBLE_RESERVE_ONE_IN`]: the boundaries
/// (1 and `units` itself) as often as any floor between.
fn draw_min_units(rng: &mut Rng, units: u64) -> Option<u64> {
    if rng.range(1, FLEXIBLE_RESERVE_ONE_IN) != 1 {
        return None;
    }
    Some(match rng.index(0, 2) {
        0 => 1,
        1 => units,
        _ => rng.range(1, units),
    })
}

/// The policy of a subject's requests or concurrency route, beside its
/// tokens route's `tokens`: small asks, its own hold and hard limit (a
/// multi-leg reservation takes the shortest of its legs'), the same epoch,
/// weight and emergency mode. The concurrency route opens a few units each
/// epoch and never refills: units come back only as holds end.
fn leg_policy(tokens: &AdmissionBudgetV1, route: usize, rng: &mut Rng) -> AdmissionBudgetV1 {
    // Refills come seldom (every 5 s; never for the concurrency route):
    // each refill tick writes the pair's record, which the audit and the
    // reference model then check.
    let (opening, refill, units_max, shard_units) = if route == CONCURRENT {
        (rng.range(8, 12), 0, 2, 2)
    } else {
        (40, 20, 8, 8)
    };
    let emergency = tokens.emergency_mode == EmergencyMode::Enabled;
    AdmissionBudgetV1 {
        route: route_at(route),
        capacity_unit: if route == CONCURRENT {
            "concurrent".into()
        } else {
            "requests".into()
        },
        opening,
        refill: Refill {
            units: refill,
            interval_ms: if refill == 0 { 3_600_000 } else { 5_000 },
        },
        burst: opening,
        reservation_units_max: units_max,
        hold_ttl_ms: rng.range(2_000, 8_000),
        overdraft_units_max: rng.range(0, 10),
        execution_hard_limit_ms: rng.range(15_000, 40_000),
        emergency_shard_units: if emergency { shard_units } else { 0 },
        ..tokens.clone()
    }
}

/// For one logical request in [`MULTI_LEG_ONE_IN`], its legs: the tokens
/// leg `tokens` and a requests leg, a concurrency leg or both; sometimes
/// the tokens leg goes last (another leg's ID then names the reservation).
/// With them, the leg its settle leaves out, if any.
fn draw_legs(rng: &mut Rng, tokens: LegShape) -> Option<(Vec<LegShape>, Option<usize>)> {
    if rng.range(1, MULTI_LEG_ONE_IN) != 1 {
        return None;
    }
    Some(legs_beside(rng, tokens))
}

/// The legs of a multi-leg request around its tokens leg (see
/// [`draw_legs`]).
fn legs_beside(rng: &mut Rng, tokens: LegShape) -> (Vec<LegShape>, Option<usize>) {
    let requests = |rng: &mut Rng| {
        let units = rng.range(1, 4);
        let actual = match rng.index(0, 6) {
            0 => units + 1,
            1 => rng.range(0, units),
            _ => units,
        };
        LegShape {
            route: REQUESTS,
            units,
            min_units: rng.chance(0.2).then(|| rng.range(1, units)),
            actual,
        }
    };
    let concurrent = |rng: &mut Rng| {
        let units = rng.range(1, 2);
        LegShape {
            route: CONCURRENT,
            units,
            min_units: (units == 2 && rng.chance(0.5)).then_some(1),
            actual: rng.range(0, units),
        }
    };
    let mut legs = vec![tokens];
    match rng.index(0, 2) {
        0 => legs.push(requests(rng)),
        1 => legs.push(concurrent(rng)),
        _ => {
            legs.push(requests(rng));
            legs.push(concurrent(rng));
        }
    }
    if rng.chance(0.25) {
        legs.rotate_left(1);
    }
    let settle_without = rng.chance(0.3).then(|| rng.index(0, legs.len() - 1));
    (legs, settle_without)
}

impl Run {
    pub(super) fn new(seed: u64, options: SimOptions, buffers: RunBuffers) -> Self {
        let RunBuffers { mut queue } = buffers;
        queue.clear();
        let mut rng = Rng::new(seed);
        let swarm = Swarm {
            drop_rate: rng.rate(0.15),
            reply_loss_rate: rng.rate(0.15),
            duplicate_rate: rng.rate(0.1),
            delay_max_ms: rng.range(1, 80),
            commit_failure_rate: rng.rate(0.03),
            crash_before_commit_rate: rng.rate(0.01),
            overage_rate: rng.rate(0.4),
            late_report_rate: rng.rate(0.3),
            slow_start_rate: rng.rate(0.2),
            limited: rng.chance(0.4),
        };
        let real_crypto = rng.chance(1.0 / 64.0);
        let agent_count = rng.index(2, 3);
        let central_signer = SimSigner::new("central", seed ^ 0xC0FFEE);
        let mut agent_verifier = SimVerifier::default();
        agent_verifier.trust_sim(&central_signer);
        let keys: Vec<AgentKey> = (0..agent_count)
            .map(|index| {
                if real_crypto {
                    let mut secret = [0u8; 32];
                    secret[..8].copy_from_slice(&seed.to_le_bytes());
                    secret[8..16].copy_from_slice(&(index as u64 + 1).to_le_bytes());
                    AgentKey::Ed25519(secret)
                } else {
                    AgentKey::Sim(SimSigner::new(
                        &format!("agent-{index}"),
                        seed ^ (index as u64 + 7),
                    ))
                }
            })
            .collect();
        let mut central_verifier = SimVerifier::default();
        for key in &keys {
            match key {
                AgentKey::Sim(signer) => central_verifier.trust_sim(signer),
                AgentKey::Ed25519(_) => central_verifier.trust_ed25519(key.identity()),
            }
        }
        let short_epochs = rng.chance(0.3);
        let emergency = rng.chance(0.8);
        let hold_ttl_ms = rng.range(2_000, 8_000);
        let policies: Vec<AdmissionBudgetV1> = (0..SUBJECTS.len())
            .map(|index| AdmissionBudgetV1 {
                schema: Default::default(),
                subject: subject(index),
                route: route(),
                region: "sim".into(),
                capacity_unit: "tokens".into(),
                policy_generation: 1,
                opening: 1000,
                refill: Refill {
                    units: 100,
                    interval_ms: 1000,
                },
                burst: 1000,
                accounting_epoch_ms: if short_epochs { 20_000 } else { 3_600_000 },
                estimator_digest: Digest([1; 32]),
                reservation_units_max: 800,
                hold_ttl_ms,
                priority: 0,
                fairness_weight: SUBJECTS[index].1,
                overdraft_units_max: 50 + 50 * rng.range(0, 5),
                execution_hard_limit_ms: rng.range(15_000, 40_000),
                emergency_mode: if emergency {
                    EmergencyMode::Enabled
                } else {
                    EmergencyMode::Disabled
                },
                mode: RouteMode::Enforce,
                emergency_shard_units: if emergency { 200 } else { 0 },
                emergency_shard_validity_ms: rng.range(20_000, 90_000),
            })
            .collect();
        // The policies of the other routes (the legs' workload) draw from
        // their own stream too.
        let mut legs_rng = Rng::new(seed ^ 0x1E65_0000_0000_0004);
        let leg_policies: Vec<AdmissionBudgetV1> = (0..SUBJECTS.len())
            .flat_map(|index| [(index, REQUESTS), (index, CONCURRENT)])
            .map(|(index, route)| leg_policy(&policies[index], route, &mut legs_rng))
            .collect();
        // Retention runs draw from their own stream: every other run's
        // trajectory is what it was before retention existed. The window is
        // the shortest the policies allow, plus a little.
        let mut side = Rng::new(seed ^ 0x5E7E_4710_0000_0001);
        let retention = side.chance(0.15).then(|| {
            let floor = policies
                .iter()
                .chain(&leg_policies)
                .map(|policy| policy.hold_ttl_ms + policy.execution_hard_limit_ms)
                .max()
                .unwrap_or(0)
                + ledger::RETENTION_MARGIN_MS;
            floor + side.range(0, 10_000)
        });
        let mut hostile_rng = Rng::new(seed ^ 0x4057_11E0_0000_0002);
        let hostile = hostile_rng.chance(0.3).then(|| {
            let signer = SimSigner::new("hostile", seed ^ 0x4057_11E0);
            (
                shard_format::DocumentSigner::key_id(&signer).clone(),
                hostile_rng,
            )
        });
        let mut central_config = ledger::CentralConfig::default();
        if let Some(window) = retention {
            central_config.retention_ms = window;
        }
        let mut central = CentralNode::with_config(
            Box::new(central_signer),
            Box::new(central_verifier),
            central_config,
        );
        #[cfg(feature = "canaries")]
        central.ledger.plant_canaries(options.canaries);
        central.keep_touched();
        let wall0 = Timestamp::from_unix_ms(WALL_START_MS).expect("valid");
        for policy in policies.iter().chain(&leg_policies) {
            central
                .operate(Operation::Publish(Box::new(policy.clone())), wall0)
                .expect("no faults at setup");
        }
        if let Some((identity, _)) = &hostile {
            central
                .operate(Operation::Enroll(identity.clone()), wall0)
                .expect("no faults at setup");
        }
        let limited = swarm.limited;
        let partition_failures_max = [1, 2, 3][rng.index(0, 2)];
        let retry_interval_ms = rng.range(500, 1_500);
        let central_call_timeout_ms = rng.range(200, 1_000);
        let default_deadline_ms = rng.range(2_000, 10_000);
        let mut agents = Vec::new();
        let mut mono_offset = Vec::new();
        let mut wall_skew = Vec::new();
        let mut partitions = Vec::new();
        for key in keys {
            central
                .operate(Operation::Enroll(key.identity().clone()), wall0)
                .expect("no faults at setup");
            let mut config = AgentConfig::new(key.identity());
            config.partition_failures_max = partition_failures_max;
            config.retry_interval_ms = retry_interval_ms;
            config.central_call_timeout_ms = central_call_timeout_ms;
            config.default_deadline_ms = default_deadline_ms;
            config.local_hold_ms = hold_ttl_ms;
            config.shard_refresh_margin_ms = 5_000;
            config.shard_skew_margin_ms = 1_000;
            if let Some(window) = retention {
                // A configuration `reservoir agent run` accepts: gateways
                // here never ask for a deadline, so the longest is the
                // default one.
                config.deadline_ms_max = default_deadline_ms;
                config.retention_ms = window.max(config.retention_floor_ms());
                debug_assert!(config.check_retention().is_ok());
            }
            for (name, weight) in SUBJECTS {
                config
                    .subject_weights
                    .insert(Subject::new(name).expect("valid"), weight);
            }
            if limited {
                config.route_concurrency.insert(route(), 1);
            }
            #[cfg(feature = "canaries")]
            {
                config.canaries = options.agent_canaries;
            }
            let offset = rng.range(0, 1_000_000);
            mono_offset.push(offset);
            wall_skew.push(rng.range(0, 4_000) as i64 - 2_000);
            let now = Now {
                mono_ms: offset,
                wall: wall0,
            };
            agents.push(AgentNode::start(config, key, agent_verifier.clone(), now));
            partitions.push(rng.chance(0.6).then(|| {
                let start = rng.range(2_000, 25_000);
                (start, start + rng.range(3_000, 20_000))
            }));
        }
        let count = agents.len();
        let mut run = Self {
            seed,
            options,
            rng,
            swarm,
            now: 0,
            queue,
            central,
            agents,
            mono_offset,
            wall_skew,
            incarnation: vec![0; count],
            partitions,
            snapshots: vec![None; count],
            next_timer: vec![u64::MAX; count],
            answered: BTreeSet::new(),
            logicals: Vec::new(),
            calls: BTreeMap::new(),
            next_call: 1,
            next_nonce: 1,
            policies,
            reserved_ids: BTreeSet::new(),
            started_central: BTreeSet::new(),
            reported: BTreeMap::new(),
            shard_admitter: BTreeMap::new(),
            unknown_since: BTreeMap::new(),
            last_reserve: BTreeMap::new(),
            retention,
            first_reserved: BTreeMap::new(),
            first_admitted: BTreeMap::new(),
            replayed: BTreeSet::new(),
            stale_restart_at: BTreeMap::new(),
            replays_pending: 0,
            replay_calls: BTreeMap::new(),
            hostile,
            hostile_shards: 0,
            outcome: RunOutcome::new(seed),
            healed: false,
            central_checks: 0,
            legs_apart: vec![BTreeSet::new(); count],
        };
        run.plan();
        run
    }

    /// Schedules the run's workload and faults.
    fn plan(&mut self) {
        let agents = self.agents.len();
        let logicals = self.rng.index(8, 16);
        // Floors come from their own stream: the run's other draws are
        // what they were before flexible reservations existed.
        let mut flexible = Rng::new(self.seed ^ 0xF1E8_1B1E_0000_0003);
        // And so do legs.
        let mut legs = Rng::new(self.seed ^ 0x1E65_0000_0000_0005);
        for index in 0..logicals {
            let agent = self.rng.index(0, agents - 1);
            let subject = self.rng.index(0, SUBJECTS.len() - 1);
            // Mostly sizes a 200-unit shard can admit; some only the center can.
            let units = if self.rng.chance(0.7) {
                self.rng.range(20, 180)
            } else {
                self.rng.range(180, 700)
            };
            let actual = if self.rng.chance(self.swarm.overage_rate) {
                units + self.rng.range(1, 600)
            } else if self.rng.chance(0.2) {
                units
            } else {
                self.rng.range(0, units)
            };
            let tokens = LegShape {
                route: TOKENS,
                units,
                min_units: draw_min_units(&mut flexible, units),
                actual,
            };
            let (shapes, settle_without) =
                draw_legs(&mut legs, tokens).unwrap_or_else(|| (vec![tokens], None));
            self.logicals.push(Logical::planned(
                index,
                agent,
                subject,
                &shapes,
                settle_without,
            ));
            let at = self.rng.range(0, 32_000);
            self.schedule(at, Event::GatewayStep(index));
        }
        // Some agents see a multi-leg request early, before any partition
        // can begin: they hold shards of every route when one does, and
        // later multi-leg requests can be admitted from shards.
        for agent in 0..agents {
            if !legs.chance(0.5) {
                continue;
            }
            let index = self.logicals.len();
            let units = legs.range(20, 60);
            let tokens = LegShape {
                route: TOKENS,
                units,
                min_units: None,
                actual: units,
            };
            let (shapes, settle_without) = legs_beside(&mut legs, tokens);
            let subject = legs.index(0, SUBJECTS.len() - 1);
            self.logicals.push(Logical::planned(
                index,
                agent,
                subject,
                &shapes,
                settle_without,
            ));
            let at = legs.range(0, 1_500);
            self.schedule(at, Event::GatewayStep(index));
        }
        // Bursts of simultaneous reserves from different agents.
        if self.rng.chance(0.5) {
            let at = self.rng.range(1_000, 30_000);
            for index in 0..logicals.min(4) {
                if let Some(logical) = self.logicals.get_mut(index) {
                    logical.agent = index % agents;
                    logical.subject = 0;
                }
                self.schedule(at, Event::GatewayStep(index));
            }
        }
        if self.swarm.limited {
            // Both tenants queue starts behind one slot: the fairness
            // workload. Small units, quick executions, all at once.
            let agent = self.rng.index(0, agents - 1);
            let at = self.rng.range(1_000, 20_000);
            for subject in 0..SUBJECTS.len() {
                for _ in 0..self.rng.index(4, 8) {
                    let index = self.logicals.len();
                    let units = self.rng.range(5, 20);
                    let tokens = LegShape {
                        route: TOKENS,
                        units,
                        min_units: draw_min_units(&mut flexible, units),
                        actual: units,
                    };
                    self.logicals
                        .push(Logical::planned(index, agent, subject, &[tokens], None));
                    self.schedule(at, Event::GatewayStep(index));
                }
            }
        }
        self.schedule(0, Event::Workers);
        for agent in 0..agents {
            self.next_timer[agent] = 0;
            self.schedule(0, Event::AgentTimer(agent));
            if self.rng.chance(0.3) {
                let crash_at = self.rng.range(1_000, 36_000);
                let stale = self.rng.chance(0.4);
                if stale {
                    let snapshot_at = self.rng.range(0, crash_at);
                    self.schedule(snapshot_at, Event::Snapshot(agent));
                }
                self.schedule(crash_at, Event::Crash { agent, stale });
                if self.rng.chance(0.5) {
                    // The partition comes right after the restart: the new
                    // process must not live on the old process's shards.
                    let start = crash_at + self.rng.range(200, 3_000);
                    self.partitions[agent] = Some((start, start + self.rng.range(3_000, 15_000)));
                }
            }
            if let Some((start, _)) = self.partitions[agent] {
                // Probing the partition shows in the agent's state; counted there.
                let _ = start;
            }
        }
        if self.rng.chance(0.35) {
            let at = self.rng.range(3_000, 30_000);
            let subject = self.rng.index(0, SUBJECTS.len() - 1);
            self.schedule(at, Event::Publish(subject));
        }
        if self.rng.chance(0.3) && agents > 1 {
            let at = self.rng.range(3_000, 35_000);
            self.schedule(at, Event::ShardCopyAttack { from: 0, to: 1 });
        }
        if self.rng.chance(0.3) {
            let at = self.rng.range(10_000, 39_000);
            let agent = self.rng.index(0, agents - 1);
            self.schedule(at, Event::ReceiptReplayAttack(agent));
        }
        let attacks: Vec<u64> = match &mut self.hostile {
            Some((_, rng)) => (0..rng.index(1, 4))
                .map(|_| rng.range(1_000, HEAL_AT_MS - 1))
                .collect(),
            None => Vec::new(),
        };
        for at in attacks {
            self.schedule(at, Event::HostileAttack);
        }
    }

    fn schedule(&mut self, at: u64, event: Event) {
        self.queue.schedule(at, event);
    }

    fn agent_now(&self, agent: usize) -> Now {
        let wall = (WALL_START_MS + self.now) as i64 + self.wall_skew[agent];
        Now {
            mono_ms: self.now + self.mono_offset[agent],
            wall: Timestamp::from_unix_ms(wall as u64).expect("valid"),
        }
    }

    fn wall(&self) -> Timestamp {
        Timestamp::from_unix_ms(WALL_START_MS + self.now).expect("valid")
    }

    fn partitioned(&self, agent: usize) -> bool {
        !self.healed
            && self.partitions[agent]
                .is_some_and(|(start, end)| self.now >= start && self.now < end)
    }

    fn violation(&mut self, class: ViolationClass, detail: String) {
        if self.outcome.violations.len() < 16 {
            self.outcome.violations.push((class, detail));
        } else {
            self.outcome.violations_dropped += 1;
        }
    }

    fn hit(&mut self, scenario: Scenario) {
        self.outcome.hits[scenario as usize] += 1;
    }

    fn trace(&mut self, event_kind: u64, a: u64, b: u64, text: impl FnOnce() -> String) {
        // FNV-1a over the step's essentials: same seed, same hash.
        for value in [self.now, event_kind, a, b] {
            for byte in value.to_le_bytes() {
                self.outcome.trace_hash ^= u64::from(byte);
                self.outcome.trace_hash = self.outcome.trace_hash.wrapping_mul(0x0100_0000_01B3);
            }
        }
        if self.options.trace {
            self.outcome
                .trace
                .push(format!("{:>8} ms  {}", self.now, text()));
        }
    }

    /// Runs to the end of the liveness phase.
    pub(super) fn run(&mut self) {
        while let Some((at, event)) = self.queue.pop() {
            if at >= HEAL_AT_MS && !self.healed {
                self.healed = true;
            }
            if at > LIVENESS_DEADLINE_MS {
                break;
            }
            self.now = at;
            // An agent has one timer, the one it asked for last, as the
            // daemon's one sleep: a timer an earlier one replaced is no
            // step (it woke the core for nothing: three steps in ten).
            if let Event::AgentTimer(agent) = event
                && at != self.next_timer[agent]
            {
                continue;
            }
            self.outcome.steps += 1;
            let workers = matches!(event, Event::Workers);
            let committed = self.central.records_committed;
            let central_touched = self.step(event);
            // Checked after every step that changed the central ledger (a
            // crash, which rebuilds it from the store, counts as a change).
            if central_touched && self.central.records_committed != committed {
                self.central_checks += 1;
                self.check_central(self.central_checks.is_multiple_of(FULL_AUDIT_EVERY));
            }
            self.central.clear_touched();
            // Convergence is judged once per worker round, not every step.
            if self.healed && workers && self.converged() {
                break;
            }
        }
        self.check_final();
        self.outcome.fairness = self
            .agents
            .iter()
            .flat_map(|node| node.core.shares())
            .map(|share| (share.weight, share.granted))
            .collect();
    }

    /// What the run did: all of it after [`Self::run`], or what it found
    /// before a panic cut it short.
    pub(super) fn into_outcome(self) -> (RunOutcome, RunBuffers) {
        let buffers = RunBuffers { queue: self.queue };
        (self.outcome, buffers)
    }

    /// Handles one event; returns whether central state may have changed.
    fn step(&mut self, event: Event) -> bool {
        match event {
            Event::GatewayStep(index) => {
                self.gateway_step(index);
                false
            }
            Event::ToCentral {
                agent,
                incarnation,
                request,
                call,
                duplicate,
            } => {
                self.trace(2, agent as u64, request, || {
                    format!("agent {agent} → central: {call:?}")
                });
                self.deliver_to_central(agent, incarnation, request, call, duplicate);
                true
            }
            Event::ToAgent {
                agent,
                incarnation,
                request,
                reply,
            } => {
                self.trace(3, agent as u64, request, || {
                    format!("central → agent {agent}: {reply:?}")
                });
                if incarnation == self.incarnation[agent]
                    && self.answered.insert((agent, incarnation, request))
                {
                    let now = self.agent_now(agent);
                    self.agents[agent].core.handle_central(
                        request,
                        CentralResult::Reply(reply),
                        now,
                    );
                    self.pump(agent);
                }
                false
            }
            Event::Deadline {
                agent,
                incarnation,
                request,
            } => {
                if incarnation == self.incarnation[agent]
                    && self.answered.insert((agent, incarnation, request))
                {
                    self.trace(4, agent as u64, request, || {
                        format!("agent {agent}: call {request} timed out")
                    });
                    let now = self.agent_now(agent);
                    let was_partitioned = self.agents[agent].core.any_partitioned();
                    self.agents[agent].core.handle_central(
                        request,
                        CentralResult::OutcomeUnknown,
                        now,
                    );
                    if !was_partitioned && self.agents[agent].core.any_partitioned() {
                        self.hit(Scenario::CentralPartition);
                    }
                    self.pump(agent);
                }
                false
            }
            Event::AgentTimer(agent) => {
                self.next_timer[agent] = u64::MAX;
                let now = self.agent_now(agent);
                self.agents[agent].core.handle_timeout(now);
                self.pump(agent);
                false
            }
            Event::Workers => {
                self.trace(6, 0, 0, || "central workers".into());
                let wall = self.wall();
                if !self.healed && self.rng.chance(self.swarm.commit_failure_rate) {
                    self.central.store.fail_next_commits(1);
                }
                self.central.run_workers(wall);
                self.observe();
                self.schedule(self.now + WORKER_INTERVAL_MS, Event::Workers);
                true
            }
            Event::Replay {
                index,
                after_window,
                change,
            } => {
                self.replays_pending -= 1;
                self.replay(index, after_window, change);
                false
            }
            Event::Snapshot(agent) => {
                self.snapshots[agent] = Some(self.agents[agent].journal.clone());
                false
            }
            Event::Crash { agent, stale } => {
                if self.healed {
                    return false;
                }
                self.trace(8, agent as u64, u64::from(stale), || {
                    format!("agent {agent} crashes (stale disk: {stale})")
                });
                self.restart(agent, stale);
                false
            }
            Event::Publish(subject) => {
                let mut policy = self.policies[subject].clone();
                policy.policy_generation += 1;
                let pair = pair(subject);
                let old_generation = policy.policy_generation - 1;
                let crossing = self.central.ledger.reservations().any(|r| {
                    r.receipt.subject == pair.subject
                        && r.receipt.policy_generation == old_generation
                        && r.receipt.state.holds_units()
                });
                let published = self
                    .central
                    .operate(Operation::Publish(Box::new(policy.clone())), self.wall());
                if matches!(published, Some(Reply::Publish(PublishOutcome::Published))) {
                    self.policies[subject] = policy;
                    if crossing {
                        self.hit(Scenario::GenerationCrossover);
                    }
                }
                true
            }
            Event::ShardCopyAttack { from, to } => {
                let shard = self.agents[from]
                    .core
                    .shard_ledgers()
                    .next()
                    .map(|ledger| ledger.shard().clone());
                if let Some(shard) = shard {
                    self.hit(Scenario::TwoGatewaysOneShard);
                    let now = self.agent_now(to);
                    if self.agents[to].core.accept_shard(shard, now).is_ok() {
                        self.violation(
                            ViolationClass::DoubleShardConsumption,
                            format!("agent {to} accepted a shard bound to agent {from}"),
                        );
                    }
                    self.pump(to);
                }
                false
            }
            Event::HostileAttack => {
                self.hostile_attack();
                true
            }
            Event::ReceiptReplayAttack(agent) => {
                let receipt = self.agents[agent]
                    .core
                    .terminal_receipts()
                    .find(|(_, acknowledged)| *acknowledged)
                    .map(|(receipt, _)| receipt.clone());
                if let Some(receipt) = receipt {
                    let identity = self.agents[agent].identity().clone();
                    let minted_before = self.total_minted();
                    let call = CentralCall::UploadReceipt(Box::new(receipt));
                    let nonce = self.nonce();
                    self.central.handle(&identity, &call, nonce, self.wall());
                    self.observe();
                    if self.total_minted() != minted_before {
                        self.violation(
                            ViolationClass::DoubleReclaim,
                            "a replayed terminal receipt minted units".into(),
                        );
                    }
                }
                true
            }
        }
    }

    /// The hostile identity, with its own key, reads and acts on another
    /// identity's reservation (start, settle for nothing and for far too
    /// much, release, abandon) and squats the ID a gateway's agent will
    /// derive for a request not yet reserved (reserve it, tombstone it).
    /// Every call must be refused and no account term, receipt or tombstone
    /// may move.
    fn hostile_attack(&mut self) {
        let Some((hostile, mut rng)) = self.hostile.take() else {
            return;
        };
        let mut calls = Vec::new();
        let mut victims: Vec<LimitReservationV1> = self
            .central
            .ledger
            .reservations()
            .filter(|record| record.owner.as_ref() != Some(&hostile))
            .map(|record| record.receipt.clone())
            .collect();
        // The ledger's order is its hash map's: the seed picks by ID order.
        victims.sort_by(|a, b| a.reservation.cmp(&b.reservation));
        if !victims.is_empty() {
            let victim = &victims[rng.index(0, victims.len() - 1)];
            let id = victim.reservation.clone();
            let operation_id = victim
                .operation_id
                .clone()
                .unwrap_or_else(|| OperationId::new("op-hostile").expect("valid"));
            calls.extend([
                CentralCall::Get {
                    reservation: id.clone(),
                },
                CentralCall::Start {
                    reservation: id.clone(),
                    operation_id: operation_id.clone(),
                    deadline_ms: None,
                },
                CentralCall::Settle {
                    reservation: id.clone(),
                    operation_id: operation_id.clone(),
                    actuals: ledger::SettleActuals::One(0),
                },
                CentralCall::Settle {
                    reservation: id.clone(),
                    operation_id,
                    actuals: ledger::SettleActuals::One(100_000),
                },
                CentralCall::Release {
                    reservation: id.clone(),
                },
                CentralCall::Abandon {
                    reservation: id,
                    origin: ReservationOrigin {
                        subject: victim.subject.clone(),
                        route: victim.route.clone(),
                        idempotency_key: IdempotencyKey::new("hostile-guess").expect("valid"),
                    },
                },
            ]);
        }
        let waiting: Vec<usize> = (0..self.logicals.len())
            .filter(|&index| self.logicals[index].reservation.is_none())
            .collect();
        if !waiting.is_empty() {
            let logical = &self.logicals[waiting[rng.index(0, waiting.len() - 1)]];
            let owner = self.agents[logical.agent].identity().clone();
            let (subject, route) = (subject(logical.subject), route_at(logical.route));
            let id = ReservationId::derive(&owner, &subject, &route, &logical.key);
            let origin = ReservationOrigin {
                subject: subject.clone(),
                route: route.clone(),
                idempotency_key: logical.key.clone(),
            };
            calls.extend([
                CentralCall::Reserve(ReserveRequest {
                    owner: owner.clone(),
                    idempotency_key: logical.key.clone(),
                    reservation: id.clone(),
                    subject,
                    route,
                    units: logical.units,
                    min_units: logical.min_units,
                    policy_generation: None,
                    request_digest: Digest([7; 32]),
                    hold_ttl_ms: None,
                    more_legs: logical.more_leg_asks(),
                }),
                CentralCall::Abandon {
                    reservation: id,
                    origin,
                },
            ]);
        }
        if !calls.is_empty() {
            self.hit(Scenario::HostileAgent);
        }
        let before = self.central_fingerprint();
        for call in calls {
            self.trace(9, 0, 0, || format!("hostile → central: {call:?}"));
            let nonce = BootNonce(u128::from(rng.next_u64()).to_le_bytes());
            let delivery = self.central.handle(&hostile, &call, nonce, self.wall());
            self.observe();
            if let Delivery::Answered(reply) = delivery
                && !matches!(reply, CentralReply::Refused { .. })
            {
                self.violation(
                    ViolationClass::HostileActionAccepted,
                    format!("the hostile identity's {call:?} was answered {reply:?}"),
                );
            }
        }
        if self.central_fingerprint() != before {
            self.violation(
                ViolationClass::HostileActionAccepted,
                "the hostile identity's refused calls moved the central ledger".into(),
            );
        }
        self.hostile_boot_loop(&hostile, &mut rng);
        self.hostile = Some((hostile, rng));
    }

    /// The hostile identity registers boot after boot and asks for a shard
    /// under each, then replays its last boot request: the units retired
    /// for it on the pair (shards neither reconciled nor lost, over every
    /// boot) stay within the cap, and the replay is refused.
    fn hostile_boot_loop(&mut self, hostile: &GatewayIdentity, rng: &mut Rng) {
        let index = rng.index(0, SUBJECTS.len() - 1);
        let pair = pair(index);
        let wall = self.wall();
        let mut last = None;
        for round in 0..4u64 {
            let request = ledger::BootRequest {
                request_nonce: BootNonce(u128::from(rng.next_u64()).to_le_bytes()),
                requested_at: wall.saturating_add_ms(round),
            };
            let boot_nonce = BootNonce(u128::from(rng.next_u64()).to_le_bytes());
            let registered = self.central.operate(
                Operation::Register {
                    identity: hostile.clone(),
                    boot_nonce,
                    request,
                },
                wall,
            );
            let Some(Reply::Register(RegisterOutcome::Registered { boot_epoch, .. })) = registered
            else {
                continue;
            };
            last = Some(request);
            self.hostile_shards += 1;
            let shard = ShardId::new(format!("sh-hostile-{}", self.hostile_shards)).expect("valid");
            self.central.operate(
                Operation::IssueShard(ledger::IssueShardRequest {
                    identity: hostile.clone(),
                    boot_epoch,
                    boot_nonce,
                    subject: pair.subject.clone(),
                    route: pair.route.clone(),
                    shard,
                }),
                wall,
            );
        }
        let cap = self.policies[index]
            .emergency_shard_units
            .saturating_mul(self.central.ledger.config().unreconciled_shard_units_factor);
        let open: u64 = self
            .central
            .ledger
            .shards()
            .filter(|record| {
                record.is_open()
                    && record.shard.gateway_identity == *hostile
                    && record.shard.subject == pair.subject
            })
            .map(|record| record.shard.allocated_units)
            .sum();
        if open > cap {
            self.violation(
                ViolationClass::HostileActionAccepted,
                format!(
                    "boot and shard requests retired {open} units for the hostile identity on {pair:?}, above the cap of {cap}"
                ),
            );
        }
        if let Some(request) = last {
            let replayed = self.central.operate(
                Operation::Register {
                    identity: hostile.clone(),
                    boot_nonce: BootNonce(u128::from(rng.next_u64()).to_le_bytes()),
                    request,
                },
                wall,
            );
            if let Some(Reply::Register(RegisterOutcome::Registered { .. })) = replayed {
                self.violation(
                    ViolationClass::HostileActionAccepted,
                    "a replayed boot request registered a new boot".into(),
                );
            }
        }
    }

    /// Every account's terms, every receipt and every tombstone.
    fn central_fingerprint(&self) -> CentralFingerprint {
        let ledger = &self.central.ledger;
        // Sorted by ID: the ledger's own order is its hash maps'.
        let mut receipts: Vec<LimitReservationV1> = ledger
            .reservations()
            .map(|record| record.receipt.clone())
            .collect();
        receipts.sort_by(|a, b| a.reservation.cmp(&b.reservation));
        let mut tombstones: Vec<ledger::TombstoneRecord> = ledger.tombstones().cloned().collect();
        tombstones.sort_by(|a, b| a.reservation.cmp(&b.reservation));
        (
            ledger
                .accounts()
                .map(|(key, terms)| (key, *terms))
                .collect(),
            receipts,
            tombstones,
        )
    }

    fn total_minted(&self) -> u64 {
        self.central
            .ledger
            .accounts()
            .map(|(_, terms)| terms.minted)
            .sum()
    }

    fn nonce(&mut self) -> BootNonce {
        let nonce = BootNonce(u128::from(self.rng.next_u64()).to_le_bytes());
        self.next_nonce += 1;
        nonce
    }

    fn restart(&mut self, agent: usize, stale: bool) {
        let old_shards: Vec<_> = self.agents[agent]
            .core
            .shard_ledgers()
            .filter(|ledger| !ledger.is_closed())
            .map(|ledger| ledger.shard().clone())
            .collect();
        let journal = if stale {
            self.snapshots[agent].clone()
        } else {
            None
        };
        if journal.is_some() {
            self.stale_restart_at.insert(agent, self.now);
            // A disk restored from an older copy loses what it acknowledged
            // since: settles not yet delivered are gone with it.
            let central = &self.central.ledger;
            self.reported.retain(|id, (owner, actual)| {
                *owner != agent
                    || central
                        .reservation(id)
                        .is_some_and(|r| r.receipt.actual_units == Some(*actual))
            });
        }
        let now = self.agent_now(agent);
        self.agents[agent].restart(journal, now);
        self.incarnation[agent] += 1;
        self.next_timer[agent] = u64::MAX;
        // A restarted process never inherits a shard: every shard it found
        // on disk is closed at once.
        let inherited: Vec<ShardId> = self.agents[agent]
            .core
            .shard_ledgers()
            .filter(|ledger| !ledger.is_closed())
            .map(|ledger| ledger.shard().shard.clone())
            .collect();
        for shard in inherited {
            self.violation(
                ViolationClass::DoubleShardConsumption,
                format!("agent {agent} kept shard {shard} open across a restart"),
            );
        }
        // Replaying an old shard into the new process must be refused.
        for shard in old_shards {
            self.hit(Scenario::OldShardAfterRestart);
            if self.agents[agent].core.accept_shard(shard, now).is_ok() {
                self.violation(
                    ViolationClass::DoubleShardConsumption,
                    format!("agent {agent} accepted its old shard after a restart"),
                );
            }
        }
        // Calls of the old process may still be answered; they are ignored
        // (their connection died with it). Gateways waiting on it retry.
        let waiting: Vec<(usize, CallId)> = self
            .calls
            .keys()
            .filter(|(a, _)| *a == agent)
            .copied()
            .collect();
        for key in waiting {
            if let Some(index) = self.calls.remove(&key) {
                let delay = self.rng.range(100, 1_000);
                self.retry_later(index, delay);
            }
        }
        // A replay cut off by the crash is over: its question (is the key
        // still remembered?) died with the connection.
        self.replay_calls.retain(|(a, _), _| *a != agent);
        self.pump(agent);
        // The restored journal may have dropped records without any new one.
        self.check_agent(agent);
    }

    /// Gateway calls waiting on an answer that will never come retry.
    fn retry_later(&mut self, index: usize, delay: u64) {
        let logical = &mut self.logicals[index];
        logical.phase = match logical.phase {
            Phase::AwaitReserve => Phase::Reserve,
            Phase::AwaitStart => Phase::Start,
            Phase::AwaitSettle => Phase::Settle,
            Phase::AwaitRelease => Phase::Release,
            other => other,
        };
        self.schedule(self.now + delay, Event::GatewayStep(index));
    }

    // ----- gateways and executors -----

    fn gateway_step(&mut self, index: usize) {
        let logical = self.logicals[index].clone();
        let request = match logical.phase {
            Phase::Reserve => GatewayRequest::Reserve(GatewayReserve {
                idempotency_key: logical.key.clone(),
                subject: subject(logical.subject),
                route: route_at(logical.route),
                units: logical.units,
                min_units: logical.min_units,
                deadline_ms: None,
                priority: None,
                request: None,
                more_legs: logical.more_leg_asks(),
            }),
            Phase::Start => GatewayRequest::Start {
                reservation: logical.reservation.clone().expect("reserved"),
                operation_id: logical.operation.clone(),
            },
            Phase::Running | Phase::Settle if logical.is_multi() => GatewayRequest::SettleLegs {
                reservation: logical.reservation.clone().expect("reserved"),
                operation_id: logical.operation.clone(),
                legs: logical.leg_actuals(),
            },
            Phase::Running | Phase::Settle => GatewayRequest::Settle {
                reservation: logical.reservation.clone().expect("reserved"),
                operation_id: logical.operation.clone(),
                actual_units: logical.actual,
            },
            Phase::Release => GatewayRequest::Release {
                reservation: logical.reservation.clone().expect("reserved"),
            },
            _ => return,
        };
        let agent = logical.agent;
        if let GatewayRequest::Reserve(_) = &request
            && let Some((other, at)) = self.last_reserve.get(&logical.subject).copied()
            && other != agent
            && self.now.saturating_sub(at) <= 100
        {
            self.hit(Scenario::ConcurrentReserve);
        }
        if let GatewayRequest::Reserve(reserve) = &request {
            self.last_reserve.insert(logical.subject, (agent, self.now));
            if reserve.min_units.is_some() {
                self.outcome.flexible.reserves += 1;
            }
            if !reserve.more_legs.is_empty() {
                self.outcome.legs.reserves += 1;
            }
        }
        let phase = &mut self.logicals[index].phase;
        *phase = match *phase {
            Phase::Reserve => Phase::AwaitReserve,
            Phase::Start => Phase::AwaitStart,
            Phase::Running | Phase::Settle => Phase::AwaitSettle,
            Phase::Release => Phase::AwaitRelease,
            other => other,
        };
        self.logicals[index].attempts += 1;
        let call = self.next_call;
        self.next_call += 1;
        self.calls.insert((agent, call), index);
        self.trace(1, agent as u64, call, || {
            format!("gateway → agent {agent}: {request:?}")
        });
        let now = self.agent_now(agent);
        self.agents[agent].core.handle_gateway(call, request, now);
        self.pump(agent);
    }

    fn gateway_reply(&mut self, agent: usize, call: CallId, response: GatewayResponse) {
        if let Some((index, after_window, change)) = self.replay_calls.remove(&(agent, call)) {
            return self.replay_reply(agent, index, after_window, change, response);
        }
        let Some(index) = self.calls.remove(&(agent, call)) else {
            return;
        };
        self.gateway_answered(agent, call, index, response);
        self.schedule_replays(index);
    }

    fn gateway_answered(
        &mut self,
        agent: usize,
        call: CallId,
        index: usize,
        response: GatewayResponse,
    ) {
        self.trace(12, agent as u64, call, || {
            format!("agent {agent} → gateway: {response:?}")
        });
        let phase = self.logicals[index].phase;
        let attempts = self.logicals[index].attempts;
        // Reserves give up after a few tries; work already admitted never
        // does: a gateway keeps starting, settling or releasing it.
        let reserving = phase == Phase::AwaitReserve;
        let retry = |run: &mut Self, seconds: u64| {
            if !reserving || attempts < 8 {
                let delay = seconds * 1000 + run.rng.range(0, 500);
                run.retry_later(index, delay);
            } else {
                run.logicals[index].phase = Phase::Done;
            }
        };
        match (phase, response) {
            (Phase::AwaitReserve, GatewayResponse::Reservation { reservation, .. }) => {
                if reservation.state != AgentState::Reserved {
                    // A retry found it further along (or rejected/expired): done.
                    if reservation.state == AgentState::Rejected {
                        retry(self, 1);
                    } else {
                        self.logicals[index].phase = Phase::Done;
                    }
                    return;
                }
                for shard in reservation.shards() {
                    self.check_shard_admitter(agent, &shard);
                }
                self.check_gateway_grant(agent, index, &reservation);
                self.first_admitted.entry(index).or_insert(self.now);
                self.logicals[index].reservation = Some(reservation.reservation.clone());
                let roll = self.rng.range(0, 99);
                if roll < 75 {
                    self.logicals[index].phase = Phase::Start;
                    let hold = self.policies[self.logicals[index].subject].hold_ttl_ms;
                    let delay = if self.rng.chance(self.swarm.slow_start_rate) {
                        hold + self.rng.range(0, 2_000)
                    } else {
                        self.rng.range(0, hold / 2)
                    };
                    self.schedule(self.now + delay, Event::GatewayStep(index));
                } else if roll < 90 {
                    self.logicals[index].phase = Phase::Release;
                    let delay = self.rng.range(0, 1_000);
                    self.schedule(self.now + delay, Event::GatewayStep(index));
                } else {
                    // Walk away: the hold expires.
                    self.logicals[index].phase = Phase::Done;
                }
            }
            (Phase::AwaitReserve, GatewayResponse::Rejected { rejection, leg, .. }) => {
                if leg.is_some() {
                    self.outcome.legs.refused_by_leg += 1;
                }
                retry(self, rejection.retry_after_seconds.unwrap_or(5).min(30));
            }
            (
                Phase::AwaitReserve,
                GatewayResponse::Unavailable {
                    retry_after_seconds,
                    ..
                },
            ) => {
                retry(self, retry_after_seconds);
            }
            (Phase::AwaitStart, GatewayResponse::Reservation { reservation, .. }) => {
                // Settled already means the center settled it at the hard
                // limit: the work did start, and its receipt still counts.
                if !matches!(
                    reservation.state,
                    AgentState::Started
                        | AgentState::UsageUnknown
                        | AgentState::Settled
                        | AgentState::SettledWithDebt
                ) {
                    self.logicals[index].phase = Phase::Done;
                    return;
                }
                if reservation.path == ReservationPath::Central {
                    self.started_central.insert(reservation.reservation.clone());
                    if self.logicals[index].is_multi() {
                        let ids = self.logicals[index].leg_ids(self.agents[agent].identity());
                        self.started_central.extend(ids);
                    }
                }
                self.logicals[index].phase = Phase::Running;
                let deadline = self.agents[agent].config.default_deadline_ms;
                let run_time = if self.rng.chance(self.swarm.late_report_rate) {
                    // Past the deadline, sometimes past the hard limit.
                    deadline + self.rng.range(0, 50_000)
                } else {
                    self.rng.range(10, deadline / 2)
                };
                self.schedule(self.now + run_time, Event::GatewayStep(index));
            }
            (Phase::AwaitStart, GatewayResponse::Conflict { code, .. }) => {
                if code == ErrorCode::ReservationExpired {
                    self.hit(Scenario::StartedVsExpired);
                }
                self.logicals[index].phase = Phase::Done;
            }
            (
                Phase::AwaitStart,
                GatewayResponse::Unavailable {
                    retry_after_seconds,
                    ..
                },
            ) => {
                retry(self, retry_after_seconds);
            }
            (Phase::AwaitSettle, GatewayResponse::Reservation { reservation, .. })
            | (Phase::AwaitSettle, GatewayResponse::Accepted(reservation)) => {
                let logical = &self.logicals[index];
                if logical.is_multi() {
                    // Each leg the settle named is reported on its own ID.
                    let ids = logical.leg_ids(self.agents[agent].identity());
                    let shapes = logical.shapes();
                    let without = logical.settle_without;
                    let mut above = false;
                    for (leg, (id, shape)) in ids.into_iter().zip(shapes).enumerate() {
                        if Some(leg) == without {
                            continue;
                        }
                        let granted = reservation.legs.get(leg).and_then(|l| l.reserved_units);
                        above |= shape.actual > granted.map_or(shape.units, u64::from);
                        self.reported.insert(id, (agent, shape.actual));
                    }
                    if above {
                        self.hit(Scenario::ActualAboveReserved);
                    }
                    self.outcome.legs.settled += 1;
                } else {
                    let id = reservation.reservation.clone();
                    let actual = logical.actual;
                    if actual
                        > reservation
                            .reserved_units
                            .map_or(reservation.units, u64::from)
                    {
                        self.hit(Scenario::ActualAboveReserved);
                    }
                    self.reported.insert(id, (agent, actual));
                }
                // Sometimes the gateway sends the same settle again.
                if self.rng.chance(0.1) && attempts < 8 {
                    self.logicals[index].phase = Phase::Settle;
                    let delay = self.rng.range(0, 2_000);
                    self.schedule(self.now + delay, Event::GatewayStep(index));
                } else {
                    self.logicals[index].phase = Phase::Done;
                }
            }
            (
                Phase::AwaitSettle,
                GatewayResponse::Unavailable {
                    retry_after_seconds,
                    ..
                },
            ) => {
                retry(self, retry_after_seconds);
            }
            (
                Phase::AwaitRelease,
                GatewayResponse::Unavailable {
                    retry_after_seconds,
                    ..
                },
            ) => {
                retry(self, retry_after_seconds);
            }
            (_, _) => {
                self.logicals[index].phase = Phase::Done;
            }
        }
    }

    /// In a retention run, a finished logical request that was admitted is
    /// replayed twice: once inside the window, once past it.
    fn schedule_replays(&mut self, index: usize) {
        let Some(window) = self.retention else {
            return;
        };
        if self.logicals[index].phase != Phase::Done
            || !self.first_admitted.contains_key(&index)
            || !self.replayed.insert(index)
        {
            return;
        }
        let inside = self.now + self.rng.range(0, window / 2);
        let past = self.now + window + self.rng.range(2_000, 20_000);
        self.schedule(
            inside,
            Event::Replay {
                index,
                after_window: false,
                change: ReplayChange::Unchanged,
            },
        );
        self.schedule(
            past,
            Event::Replay {
                index,
                after_window: true,
                change: ReplayChange::Unchanged,
            },
        );
        self.replays_pending += 2;
        // Every other request is also retried with a field changed (its
        // units, body or floor), just after its duplicate: it must be
        // refused as a conflict.
        let change = match index % 6 {
            0 => ReplayChange::Units,
            1 => ReplayChange::Leg,
            3 => ReplayChange::Body,
            5 => ReplayChange::MinUnits,
            _ => return,
        };
        self.schedule(
            inside + 1,
            Event::Replay {
                index,
                after_window: false,
                change,
            },
        );
        self.replays_pending += 1;
    }

    fn replay(&mut self, index: usize, after_window: bool, change: ReplayChange) {
        let logical = self.logicals[index].clone();
        let mut more_legs = logical.more_leg_asks();
        if change == ReplayChange::Leg {
            match more_legs.len() {
                0 => more_legs.push(LegAsk {
                    subject: subject(logical.subject),
                    route: route_at(if logical.route == REQUESTS {
                        CONCURRENT
                    } else {
                        REQUESTS
                    }),
                    units: 1,
                    min_units: None,
                }),
                1 => {
                    let leg = &mut more_legs[0];
                    // Inside the route's units max either way.
                    leg.units = if leg.units == 1 { 2 } else { leg.units - 1 };
                    leg.min_units = None;
                }
                _ => {
                    more_legs.pop();
                }
            }
        }
        let request = GatewayRequest::Reserve(GatewayReserve {
            idempotency_key: logical.key.clone(),
            subject: subject(logical.subject),
            route: route_at(logical.route),
            units: logical.units + u64::from(change == ReplayChange::Units),
            min_units: if change == ReplayChange::MinUnits {
                match logical.min_units {
                    None => Some(1),
                    Some(1) => None,
                    Some(min) => Some(min - 1),
                }
            } else {
                logical.min_units
            },
            deadline_ms: None,
            priority: None,
            request: (change == ReplayChange::Body)
                .then(|| serde_json::json!({"retry": "changed"})),
            more_legs,
        });
        let agent = logical.agent;
        let call = self.next_call;
        self.next_call += 1;
        self.replay_calls
            .insert((agent, call), (index, after_window, change));
        self.trace(14, agent as u64, call, || {
            format!(
                "gateway replays {} on agent {agent} (past the window: {after_window}, {change:?})",
                logical.key
            )
        });
        let now = self.agent_now(agent);
        self.agents[agent].core.handle_gateway(call, request, now);
        self.pump(agent);
    }

    /// A replay's answer: inside the window (counted from the first
    /// admission, which no record's end precedes) it must not be a new
    /// reservation, and a replay with a field changed must not be answered
    /// with the original reservation either.
    fn replay_reply(
        &mut self,
        agent: usize,
        index: usize,
        after_window: bool,
        change: ReplayChange,
        response: GatewayResponse,
    ) {
        let key = self.logicals[index].key.clone();
        self.trace(15, agent as u64, index as u64, || {
            format!("agent {agent} → gateway, replay of {key} ({change:?}): {response:?}")
        });
        let Some(window) = self.retention else {
            return;
        };
        if change != ReplayChange::Unchanged {
            match &response {
                GatewayResponse::Reservation {
                    created: false,
                    reservation,
                } => self.violation(
                    ViolationClass::DifferingRetryAccepted,
                    format!(
                        "agent {agent} answered a retry of key {} with {change:?} changed as a duplicate of {}",
                        self.logicals[index].key, reservation.reservation
                    ),
                ),
                GatewayResponse::Conflict { .. } => self.hit(Scenario::DifferingRetry),
                // The center's refusal of a retry the agent had forgotten.
                GatewayResponse::Refused { code, .. } if *code != ErrorCode::ReservationNotFound => {
                    self.hit(Scenario::DifferingRetry);
                }
                _ => {}
            }
        }
        let GatewayResponse::Reservation {
            created: true,
            reservation,
        } = response
        else {
            return;
        };
        let admitted = self.first_admitted.get(&index).copied().unwrap_or(0);
        let lost_by_agent = self
            .stale_restart_at
            .get(&agent)
            .is_some_and(|restarted| *restarted >= admitted);
        if self.now < admitted + window && !lost_by_agent {
            self.violation(
                ViolationClass::RetryReservedTwiceWithinWindow,
                format!(
                    "agent {agent} reserved {} again for key {} at {} ms; first admitted at {admitted} ms, window {window} ms",
                    reservation.reservation, self.logicals[index].key, self.now
                ),
            );
        } else if after_window {
            self.hit(Scenario::Retention);
        }
    }

    /// Every journal forget an agent committed: the record must have been
    /// at rest with its window passed (a shard's keys: its receipt
    /// acknowledged and its window passed); fences are never forgotten.
    fn check_agent_forgets(&mut self, agent: usize) {
        for detail in std::mem::take(&mut self.agents[agent].shard_mismatches) {
            self.violation(ViolationClass::ReferenceMismatch, detail);
        }
        let forgets = std::mem::take(&mut self.agents[agent].forgets);
        if forgets.is_empty() {
            return;
        }
        let window = self.agents[agent].config.retention_ms;
        let wall = self.agent_now(agent).wall.unix_ms();
        let passed = |since: u64| since.saturating_add(window) <= wall;
        for forgotten in forgets {
            let problem = match (&forgotten.key, &forgotten.record, &forgotten.receipt) {
                (_, None, _) => Some("not in the journal".to_owned()),
                (
                    JournalKey::Reservation(_),
                    Some(
                        JournalRecord::ReservationWithHolds { record, .. }
                        | JournalRecord::Reservation(record),
                    ),
                    _,
                ) => match record.ended_at {
                    _ if !record.is_at_rest() => Some(format!("live ({:?})", record.state)),
                    Some(ended) if passed(ended.get()) => None,
                    ended => Some(format!("ended at {ended:?}")),
                },
                (JournalKey::Fence(_), _, _) => Some("a fence".to_owned()),
                (
                    _,
                    _,
                    Some(JournalRecord::TerminalReceipt {
                        receipt,
                        acknowledged,
                    }),
                ) => {
                    if !acknowledged {
                        Some("its shard's receipt is not acknowledged".to_owned())
                    } else if !passed(receipt.closed_at.unix_ms()) {
                        Some(format!("its shard closed at {}", receipt.closed_at))
                    } else {
                        None
                    }
                }
                _ => Some("its shard has no terminal receipt".to_owned()),
            };
            match problem {
                Some(problem) => self.violation(
                    ViolationClass::ForgottenLiveRecord,
                    format!(
                        "agent {agent} forgot {:?} at wall {wall} (window {window} ms): {problem}",
                        forgotten.key
                    ),
                ),
                None => {
                    if matches!(forgotten.key, JournalKey::Reservation(_)) {
                        self.hit(Scenario::Retention);
                    }
                }
            }
        }
    }

    /// The account each leg of a reserve will draw on (its pair's current
    /// policy and epoch) and its `available` before the call; `None` for a
    /// pair without a policy, `available` `None` for an account the reserve
    /// itself will open.
    fn central_available(
        &self,
        reserve: &ReserveRequest,
    ) -> Vec<Option<(AccountKey, Option<u64>)>> {
        reserve
            .legs()
            .iter()
            .map(|leg| {
                let pair = leg.pair();
                let policy = self.central.ledger.policy(&pair)?;
                let account = AccountKey {
                    accounting_epoch: ledger::epoch_start(self.wall(), policy.accounting_epoch_ms),
                    policy_generation: policy.policy_generation,
                    pair,
                };
                let available = self
                    .central
                    .ledger
                    .account(&account)
                    .map(|terms| terms.available);
                Some((account, available))
            })
            .collect()
    }

    /// A reservation the central ledger just made: each leg's grant against
    /// its ask and against what its account had available just before (an
    /// account the reserve opened had its opening, all available).
    fn check_central_grant(
        &mut self,
        reserve: &ReserveRequest,
        drawn_on: &[Option<(AccountKey, Option<u64>)>],
    ) {
        let mut problems = Vec::new();
        let legs = reserve.legs();
        let ids = reserve.leg_ids();
        for (index, ((leg, id), drawn)) in legs.iter().zip(&ids).zip(drawn_on).enumerate() {
            let ledger = &self.central.ledger;
            let Some(record) = ledger.reservation(id) else {
                if legs.len() > 1 {
                    problems.push(format!("leg {index} ({id}) was not written"));
                }
                continue;
            };
            if record.shadow {
                continue;
            }
            let receipt = &record.receipt;
            let available = drawn.as_ref().and_then(|(account, available)| {
                let drew_on_account = receipt.accounting_epoch == account.accounting_epoch
                    && receipt.policy_generation == account.policy_generation;
                available
                    .or_else(|| ledger.account(account).map(|terms| terms.opening))
                    .filter(|_| drew_on_account)
            });
            let admission = Admission {
                units: leg.units,
                min_units: leg.min_units,
                granted: receipt.reserved_units,
                available,
            };
            if let Some(problem) = check_partial_admission(&admission) {
                problems.push(if legs.len() > 1 {
                    format!("leg {index} ({id}): {problem}")
                } else {
                    problem
                });
            }
        }
        for problem in problems {
            self.violation(
                ViolationClass::PartialAdmission,
                format!("central reservation {}: {problem}", reserve.reservation),
            );
        }
    }

    /// Every shard admission an agent journaled: its grant against the ask
    /// and against the book's `localAvailable` just before.
    fn check_shard_admissions(&mut self, agent: usize) {
        if self.agents[agent].shard_admissions.is_empty() {
            return;
        }
        for admitted in std::mem::take(&mut self.agents[agent].shard_admissions) {
            let Some(record) = self.agents[agent].core.reservation(&admitted.reservation) else {
                continue;
            };
            // A multi-leg reservation's shards each book one leg.
            let (units, min_units) = match record
                .legs
                .iter()
                .find(|leg| leg.shard.as_ref() == Some(&admitted.shard))
            {
                Some(leg) => (leg.units, leg.min_units.map(u64::from)),
                None => (record.units, record.min_units.map(u64::from)),
            };
            let admission = Admission {
                units,
                min_units,
                granted: admitted.granted,
                available: admitted.local_available,
            };
            if let Some(problem) = check_partial_admission(&admission) {
                self.violation(
                    ViolationClass::PartialAdmission,
                    format!(
                        "agent {agent} shard {} reservation {}: {problem}",
                        admitted.shard, admitted.reservation
                    ),
                );
            }
        }
    }

    /// The grant an agent told a gateway, leg by leg: inside what the
    /// gateway asked for, and what the center's receipt or the shard's book
    /// holds. A multi-leg reservation has every leg's grant.
    fn check_gateway_grant(&mut self, agent: usize, index: usize, reservation: &AgentReservation) {
        let logical = &self.logicals[index];
        let shapes = logical.shapes();
        let multi = logical.is_multi();
        let ids = logical.leg_ids(self.agents[agent].identity());
        let mut problems = Vec::new();
        if multi && reservation.legs.len() != shapes.len() {
            problems.push(format!(
                "recorded {} legs of the {} asked",
                reservation.legs.len(),
                shapes.len()
            ));
        } else if multi && reservation.reserved_units != reservation.legs[0].reserved_units {
            problems.push(format!(
                "told the gateway {:?} units, its first leg holds {:?}",
                reservation.reserved_units, reservation.legs[0].reserved_units
            ));
        }
        for (leg, shape) in shapes.iter().enumerate() {
            if !problems.is_empty() {
                break;
            }
            let (granted, shard) = if multi {
                let recorded = &reservation.legs[leg];
                (recorded.reserved_units, recorded.shard.as_ref())
            } else {
                let shard = match &reservation.path {
                    ReservationPath::Shard(shard) => Some(shard),
                    ReservationPath::Central => None,
                };
                (reservation.reserved_units, shard)
            };
            let Some(granted) = granted.map(u64::from) else {
                problems.push(format!("answered reserved without a grant for leg {leg}"));
                continue;
            };
            let held = match (&reservation.path, shard) {
                (ReservationPath::Central, _) => self
                    .central
                    .ledger
                    .reservation(&ids[leg])
                    .filter(|record| !record.shadow)
                    .map(|record| record.receipt.reserved_units),
                (ReservationPath::Shard(_), Some(shard)) => self.agents[agent]
                    .core
                    .shard_ledgers()
                    .find(|ledger| ledger.shard().shard == *shard)
                    .and_then(|ledger| ledger.reservation(&reservation.reservation))
                    .map(|local| local.units),
                // A leg without a shard is the legs check's to judge.
                (ReservationPath::Shard(_), None) => None,
            };
            let problem = check_partial_admission(&Admission {
                units: shape.units,
                min_units: shape.min_units,
                granted,
                available: None,
            })
            .or_else(|| {
                held.filter(|held| *held != granted).map(|held| {
                    format!("told the gateway {granted} units, the ledger holds {held}")
                })
            });
            if let Some(problem) = problem {
                problems.push(if multi {
                    format!("leg {leg}: {problem}")
                } else {
                    problem
                });
            }
        }
        for problem in problems {
            self.violation(
                ViolationClass::PartialAdmission,
                format!(
                    "agent {agent} reservation {} ({:?}): {problem}",
                    reservation.reservation, reservation.path
                ),
            );
        }
        let first = !self.first_admitted.contains_key(&index);
        if multi && first {
            match reservation.path {
                ReservationPath::Central => self.outcome.legs.admitted_central += 1,
                ReservationPath::Shard(_) => self.outcome.legs.admitted_shard += 1,
            }
        }
        let (units, min_units) = (shapes[0].units, shapes[0].min_units);
        if min_units.is_some()
            && first
            && let Some(granted) = reservation.reserved_units.map(u64::from)
        {
            let flexible = &mut self.outcome.flexible;
            flexible.admitted += 1;
            if granted < units {
                match reservation.path {
                    ReservationPath::Central => flexible.partial_central += 1,
                    ReservationPath::Shard(_) => flexible.partial_shard += 1,
                }
            }
        }
    }

    fn check_shard_admitter(&mut self, agent: usize, shard: &ShardId) {
        // Only the boot a shard is bound to may admit from it.
        let bound = self.agents[agent]
            .core
            .shard_ledgers()
            .find(|ledger| ledger.shard().shard == *shard)
            .map(|ledger| ledger.shard().boot_epoch);
        let current = self.agents[agent].core.boot_epoch();
        if bound.is_none() || bound != current {
            self.violation(
                ViolationClass::DoubleShardConsumption,
                format!(
                    "agent {agent} (boot {current:?}) admitted from shard {shard} bound to boot {bound:?}"
                ),
            );
        }
        let me = (agent, self.incarnation[agent]);
        match self.shard_admitter.get(shard).copied() {
            Some(previous) if previous != me => {
                self.violation(
                    ViolationClass::DoubleShardConsumption,
                    format!("shard {shard} admitted by agent {} (incarnation {}) and agent {agent} (incarnation {})", previous.0, previous.1, me.1),
                );
            }
            Some(_) => {}
            None => {
                self.shard_admitter.insert(shard.clone(), me);
            }
        }
    }

    // ----- the agent shell, simulated -----

    /// Carries out an agent's effects: journal commits (or a crash before
    /// one), gateway answers, central calls through the network, its timer.
    fn pump(&mut self, agent: usize) {
        let mut journaled = 0;
        loop {
            if !self.healed
                && self.agents[agent].core.has_pending_journal()
                && self.rng.chance(self.swarm.crash_before_commit_rate)
            {
                self.trace(13, agent as u64, 0, || {
                    format!("agent {agent} crashes before a commit")
                });
                self.restart(agent, false);
                return;
            }
            let committed = self.agents[agent].commit_journal();
            journaled += committed;
            self.check_agent_forgets(agent);
            self.check_shard_admissions(agent);
            let mut moved = committed > 0;
            while let Some((call, response)) = self.agents[agent].core.poll_reply() {
                moved = true;
                self.gateway_reply(agent, call, response);
            }
            while let Some(outgoing) = self.agents[agent].core.poll_central() {
                moved = true;
                self.send(agent, outgoing.request, outgoing.call, outgoing.deadline_ms);
            }
            if !moved {
                break;
            }
        }
        // Agent state changes only through journaled records.
        if journaled > 0 {
            self.check_agent(agent);
        }
        if let Some(at) = self.agents[agent].core.poll_timeout() {
            let global = at.saturating_sub(self.mono_offset[agent]).max(self.now + 1);
            if global < self.next_timer[agent] {
                self.next_timer[agent] = global;
                self.schedule(global, Event::AgentTimer(agent));
            }
        }
    }

    fn send(&mut self, agent: usize, request: RequestId, call: CentralCall, deadline_mono: u64) {
        let incarnation = self.incarnation[agent];
        let deadline = deadline_mono
            .saturating_sub(self.mono_offset[agent])
            .max(self.now + 1);
        self.schedule(
            deadline,
            Event::Deadline {
                agent,
                incarnation,
                request,
            },
        );
        if self.partitioned(agent) || (!self.healed && self.rng.chance(self.swarm.drop_rate)) {
            return;
        }
        let delay = self.rng.range(0, self.swarm.delay_max_ms);
        let duplicate = !self.healed && self.rng.chance(self.swarm.duplicate_rate);
        if duplicate {
            let later = self.rng.range(0, self.swarm.delay_max_ms * 2);
            self.schedule(
                self.now + later,
                Event::ToCentral {
                    agent,
                    incarnation,
                    request,
                    call: call.clone(),
                    duplicate: true,
                },
            );
        }
        self.schedule(
            self.now + delay,
            Event::ToCentral {
                agent,
                incarnation,
                request,
                call,
                duplicate: false,
            },
        );
    }

    fn deliver_to_central(
        &mut self,
        agent: usize,
        incarnation: u64,
        request: RequestId,
        call: CentralCall,
        duplicate: bool,
    ) {
        let identity = self.agents[agent].identity().clone();
        if !self.healed && self.rng.chance(self.swarm.commit_failure_rate) {
            self.central.store.fail_next_commits(1);
        }
        let drawn_on = match &call {
            CentralCall::Reserve(reserve) => self.central_available(reserve),
            _ => Vec::new(),
        };
        let nonce = self.nonce();
        let delivery = self.central.handle(&identity, &call, nonce, self.wall());
        let observed = self.observe();
        if let CentralCall::Reserve(reserve) = &call
            && observed
                .iter()
                .any(|o| matches!(o, Observation::Reserved(id) if *id == reserve.reservation))
        {
            self.check_central_grant(reserve, &drawn_on);
        }
        // A reserve changes neither debt nor freezing (an epoch opening it
        // triggers may repay debt, before admission): judge on the state
        // after, every leg's pair.
        let admission_open = match &call {
            CentralCall::Reserve(reserve) => Some(
                reserve
                    .legs()
                    .iter()
                    .all(|leg| self.central.ledger.admission_open(&leg.pair())),
            ),
            _ => None,
        };
        if observed
            .iter()
            .any(|o| matches!(o, Observation::Reserved(_)))
            && admission_open == Some(false)
        {
            self.violation(
                ViolationClass::AdmissionWhileDebt,
                format!("{call:?} was admitted while the pair had debt or was frozen"),
            );
        }
        let Delivery::Answered(reply) = delivery else {
            return; // crashed before the commit: no answer
        };
        if duplicate {
            return; // the copy's answer goes nowhere
        }
        let lost = self.partitioned(agent)
            || (!self.healed && self.rng.chance(self.swarm.reply_loss_rate));
        if lost {
            match (&call, &reply) {
                (CentralCall::Settle { .. }, CentralReply::Settled(settlement)) => {
                    if settlement.overdraft_units > 0 {
                        self.hit(Scenario::LostDebtAck);
                    }
                    if settlement.refunded_units > 0 {
                        self.hit(Scenario::LostRefundAck);
                    }
                }
                (CentralCall::UploadReceipt(_), _) => self.hit(Scenario::DuplicateReclaim),
                _ => {}
            }
            return;
        }
        let delay = self.rng.range(0, self.swarm.delay_max_ms);
        self.schedule(
            self.now + delay,
            Event::ToAgent {
                agent,
                incarnation,
                request,
                reply,
            },
        );
    }

    /// Drains the central node's observations into checks and hit counters.
    fn observe(&mut self) -> Vec<Observation> {
        let observed = std::mem::take(&mut self.central.observations);
        for observation in &observed {
            match observation {
                Observation::Reserved(id) => {
                    let again = !self.reserved_ids.insert(id.clone());
                    match (self.retention, self.first_reserved.get(id).copied()) {
                        (Some(window), Some(at)) if self.now < at + window => {
                            self.violation(
                                ViolationClass::RetryReservedTwiceWithinWindow,
                                format!(
                                    "reservation {id} was reserved at {at} ms and again at {} ms, inside the {window} ms window",
                                    self.now
                                ),
                            );
                        }
                        // Past the window the ID may be a new request.
                        (Some(_), _) => {}
                        (None, _) if again => self.violation(
                            ViolationClass::SecondReservation,
                            format!("reservation {id} was reserved twice"),
                        ),
                        (None, _) => {}
                    }
                    self.first_reserved.insert(id.clone(), self.now);
                }
                Observation::ForgottenLiveRecord(detail) => {
                    self.violation(ViolationClass::ForgottenLiveRecord, detail.clone());
                }
                Observation::Forgotten(_) => self.hit(Scenario::Retention),
                Observation::ForgotReservation(id) => {
                    self.started_central.remove(id);
                }
                Observation::Overage => self.hit(Scenario::ActualAboveReserved),
                Observation::ReconcileDuplicate => self.hit(Scenario::DuplicateReclaim),
                Observation::Reconciled(_) => {}
                Observation::ReferenceMismatch(detail) => {
                    self.violation(ViolationClass::ReferenceMismatch, detail.clone());
                }
            }
        }
        observed
    }

    // ----- checks -----

    /// The central ledger's invariants: all of them (`full`), or those of
    /// what the transitions since the last check touched.
    fn check_central(&mut self, full: bool) {
        let report = if full {
            invariants::audit(&self.central.ledger)
        } else {
            invariants::audit_touched(&self.central.ledger, self.central.touched())
        };
        for violation in report.violations {
            let class = match violation {
                invariants::Violation::UsageMismatch { .. } => ViolationClass::MissedDebt,
                invariants::Violation::ReservedMismatch { .. } => ViolationClass::OverIssuance,
                _ => ViolationClass::CentralEquation,
            };
            self.violation(class, violation.to_string());
        }
        self.check_central_legs();
        // Work a gateway was told is started is never expired or released.
        let mut bad = Vec::new();
        for id in &self.started_central {
            if let Some(record) = self.central.ledger.reservation(id)
                && matches!(
                    record.receipt.state,
                    ReservationState::Expired
                        | ReservationState::Released
                        | ReservationState::Abandoned
                )
            {
                bad.push(id.clone());
            }
        }
        for id in bad {
            self.violation(
                ViolationClass::ExpiredWhileStarted,
                format!("started reservation {id} was expired or released"),
            );
        }
        self.track_central_unknowns();
    }

    /// `partial_admission` at the center, after every transition: the
    /// legs of a multi-leg reservation it wrote all hold units or none
    /// does (shadow legs hold nothing), and every leg's grant is inside its
    /// ask. (Against what was available: [`Self::check_central_grant`].)
    fn check_central_legs(&mut self) {
        let ledger = &self.central.ledger;
        let mut problems = Vec::new();
        let mut judged = BTreeSet::new();
        for change in self.central.touched() {
            let ledger::Change::Reservation(record) = change else {
                continue;
            };
            let Some(legs) = &record.receipt.legs else {
                continue;
            };
            if !judged.insert(&legs[0].reservation) {
                continue;
            }
            let mut holds = Vec::with_capacity(legs.len());
            for (index, leg) in legs.iter().enumerate() {
                holds.push(match ledger.reservation(&leg.reservation) {
                    Some(stored) if stored.shadow => LegHold::Shadow,
                    Some(stored) if stored.receipt.state.holds_units() => LegHold::Holds,
                    Some(stored) => LegHold::Free(format!("{:?}", stored.receipt.state)),
                    None => LegHold::Free("not stored".to_owned()),
                });
                let floor = leg.min_units.unwrap_or(leg.asked_units());
                if leg.reserved_units < floor || leg.reserved_units > leg.asked_units() {
                    problems.push(format!(
                        "reservation {}: leg {index} granted {} units, outside its ask of {floor} to {}",
                        legs[0].reservation,
                        leg.reserved_units,
                        leg.asked_units()
                    ));
                }
            }
            if let Some(problem) = check_legs_together(&holds) {
                problems.push(format!("reservation {}: {problem}", legs[0].reservation));
            }
        }
        for problem in problems {
            self.violation(
                ViolationClass::PartialAdmission,
                format!("central {problem}"),
            );
        }
    }

    fn track_central_unknowns(&mut self) {
        let current: BTreeSet<&ReservationId> = self
            .central
            .ledger
            .reservations()
            .filter(|r| r.receipt.state == ReservationState::UsageUnknown)
            .map(|r| &r.receipt.reservation)
            .collect();
        track_unknowns(
            self.unknown_since.entry(usize::MAX).or_default(),
            &current,
            self.now,
            &mut self.outcome.unknown_durations_ms,
        );
    }

    fn check_agent(&mut self, agent: usize) {
        let mut problems = Vec::new();
        for shard in self.agents[agent].core.shard_ledgers() {
            let terms = shard.terms();
            if !terms.is_balanced() {
                problems.push((
                    ViolationClass::ShardEquation,
                    format!(
                        "shard {} breaks its equation: {terms:?}",
                        shard.shard().shard
                    ),
                ));
            }
            let held: u64 = shard
                .reservations()
                .filter(|r| {
                    matches!(
                        r.state,
                        ReservationState::Reserved
                            | ReservationState::Started
                            | ReservationState::UsageUnknown
                    )
                })
                .map(|r| r.units)
                .sum();
            if !shard.is_closed() && held != terms.local_reserved {
                problems.push((
                    ViolationClass::OverIssuance,
                    format!(
                        "shard {} holds {held} but records localReserved {}",
                        shard.shard().shard,
                        terms.local_reserved
                    ),
                ));
            }
            if let Some(closure) = shard.closure()
                && closure.confirmed_unused_units + closure.unknown_units + terms.local_spent
                    != terms.allocated
            {
                problems.push((
                    ViolationClass::UnknownCountedUnused,
                    format!(
                        "shard {} closed with unused + unknown + spent ≠ allocated",
                        shard.shard().shard
                    ),
                ));
            }
        }
        for (class, detail) in problems {
            self.violation(class, detail);
        }
        self.check_agent_legs(agent);
        let now = self.now;
        // A shard's unknown units are resolved for good (retired) once the
        // center acknowledged its terminal receipt.
        let reconciled: BTreeSet<&ShardId> = self.agents[agent]
            .core
            .terminal_receipts()
            .filter(|(_, acknowledged)| *acknowledged)
            .map(|(receipt, _)| &receipt.shard)
            .collect();
        let current: BTreeSet<&ReservationId> = self.agents[agent]
            .core
            .reservations()
            .filter(|r| {
                matches!(
                    r.state,
                    AgentState::ReservationUnknown | AgentState::UsageUnknown
                )
            })
            .filter(|r| match &r.path {
                ReservationPath::Shard(shard) => !reconciled.contains(shard),
                ReservationPath::Central => true,
            })
            .map(|r| &r.reservation)
            .collect();
        track_unknowns(
            self.unknown_since.entry(agent).or_default(),
            &current,
            now,
            &mut self.outcome.unknown_durations_ms,
        );
    }

    /// `partial_admission` at an agent: a multi-leg record's legs all have
    /// their grants or none has; an admitted one (reserved, starting or
    /// started) has them all and, on the shard path, every enforced leg a
    /// shard that books it.
    fn check_agent_legs(&mut self, agent: usize) {
        let node = &self.agents[agent];
        let enforced = |route: &Route| {
            node.config
                .route_modes
                .get(route)
                .is_none_or(|mode| *mode == RouteMode::Enforce)
        };
        let booked = |shard: &ShardId, id: &ReservationId| {
            node.core
                .shard_ledgers()
                .find(|ledger| ledger.shard().shard == *shard)
                .is_some_and(|ledger| ledger.reservation(id).is_some())
        };
        let mut problems = Vec::new();
        for record in node.core.reservations().filter(|r| !r.legs.is_empty()) {
            if self.legs_apart[agent].contains(&record.reservation) {
                continue;
            }
            let admitted = matches!(
                record.state,
                AgentState::Reserved | AgentState::Starting | AgentState::Started
            );
            let from_shards = admitted && !record.shadow && record.path != ReservationPath::Central;
            let holds: Vec<LegHold> = record
                .legs
                .iter()
                .map(|leg| match (&leg.reserved_units, &leg.shard) {
                    (None, _) => LegHold::Free("has no grant".to_owned()),
                    (Some(_), Some(shard))
                        if from_shards && !booked(shard, &record.reservation) =>
                    {
                        LegHold::Free(format!("is not booked by its shard {shard}"))
                    }
                    (Some(_), None) if from_shards && enforced(&leg.route) => {
                        LegHold::Free("is held by no shard".to_owned())
                    }
                    (Some(_), _) => LegHold::Holds,
                })
                .collect();
            let problem = check_legs_together(&holds).or_else(|| {
                (admitted && !holds.contains(&LegHold::Holds))
                    .then(|| "admitted, and no leg has a grant".to_owned())
            });
            if let Some(problem) = problem {
                problems.push((
                    record.reservation.clone(),
                    format!("{} ({:?}): {problem}", record.reservation, record.state),
                ));
            }
        }
        for (id, problem) in problems {
            self.legs_apart[agent].insert(id);
            self.violation(
                ViolationClass::PartialAdmission,
                format!("agent {agent} reservation {problem}"),
            );
        }
    }

    /// Everything in doubt resolved, all sync work delivered.
    fn converged(&self) -> bool {
        self.logicals.iter().all(|l| l.phase == Phase::Done)
            && self.replays_pending == 0
            && self.replay_calls.is_empty()
            && self.unknown_since.values().all(BTreeMap::is_empty)
            && self.agents.iter().all(|node| {
                let status = node.core.status();
                status.pending_sync == 0 && status.pending_receipts == 0
            })
            && !self
                .central
                .ledger
                .reservations()
                .any(|r| r.receipt.state.is_started() && !r.shadow)
    }

    fn check_final(&mut self) {
        self.central.check_reference_state();
        self.observe();
        self.check_central(true);
        if self.options.trace {
            for (index, node) in self.agents.iter().enumerate() {
                let line = format!(
                    "agent {index} scheduler at the end: {:?}",
                    node.core.scheduler()
                );
                self.outcome.trace.push(line);
            }
        }
        if !self.converged() {
            let pending: Vec<String> =
                self.logicals
                    .iter()
                    .enumerate()
                    .filter(|(_, l)| l.phase != Phase::Done)
                    .map(|(i, l)| format!("logical {i} in {:?}", l.phase))
                    .chain(self.unknown_since.iter().flat_map(|(o, ids)| {
                        ids.keys().map(move |id| format!("unknown {id} at {o}"))
                    }))
                    .chain(self.agents.iter().enumerate().map(|(i, node)| {
                        let status = node.core.status();
                        format!(
                            "agent {i}: sync {} receipts {}",
                            status.pending_sync, status.pending_receipts
                        )
                    }))
                    .take(6)
                    .collect();
            self.violation(
                ViolationClass::Liveness,
                format!("did not converge after healing: {}", pending.join("; ")),
            );
        }
        // What executors reported is what the ledger recorded: usage in
        // doubt was never counted as unconsumed.
        let mut wrong = Vec::new();
        for (id, (_, actual)) in &self.reported {
            if let Some(record) = self.central.ledger.reservation(id)
                && !record.shadow
                && record
                    .receipt
                    .actual_units
                    .is_some_and(|recorded| recorded != *actual)
            {
                wrong.push(format!(
                    "reservation {id}: executor reported {actual}, ledger recorded {:?}",
                    record.receipt.actual_units
                ));
            }
        }
        for detail in wrong {
            self.violation(ViolationClass::UnknownCountedUnused, detail);
        }
        let _ = self.seed;
    }
}
