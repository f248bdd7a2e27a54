//! The operations the test generates, in abstract form: indices into the
//! fixed pools and choices *relative* to the state (“the next generation”,
//! “actual above reserved”), so that a shrunk sequence still means what the
//! original did. The reference model resolves each into a concrete
//! [`super::reference::Command`].

use proptest::prelude::*;
use shard_format::RouteMode;

use super::fixtures::{
    GATEWAYS, LEG_PAIRS, OPERATIONS, PAIRS, PolicyParams, RESERVATIONS, SHARDS, home_pair,
};

/// Which generation a publish names, relative to the pair's current one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GenerationChoice {
    Next,
    /// The current one again (or 1 for a new pair): not rising.
    Same,
    /// Skips one.
    Skip,
}

/// Which generation a request names, relative to the pair's current one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GenerationAsk {
    Unnamed,
    Current,
    Previous,
    Next,
}

/// A reserve's `minUnits`, relative to its units: `None` is an exact
/// reserve; `Zero` and `AboveUnits` are invalid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FloorAsk {
    Zero,
    One,
    Half,
    Whole,
    AboveUnits,
}

impl FloorAsk {
    pub fn of(self, units: u64) -> u64 {
        match self {
            Self::Zero => 0,
            Self::One => 1,
            Self::Half => units.div_ceil(2),
            Self::Whole => units,
            Self::AboveUnits => units.saturating_add(1),
        }
    }
}

/// The actual units of a settle, relative to the reservation's units.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ActualChoice {
    Zero,
    Half,
    Equal,
    /// A little above: overage the account can often cover.
    Above,
    /// Far above: overdraft, often past `overdraftUnitsMax`.
    FarAbove,
    /// Exactly these units (for the worked examples; not generated).
    Units(u64),
}

/// One more leg of a multi-leg reserve: its pair as an offset from the
/// first leg's (`(first + offset) % LEG_PAIRS`: 0 repeats the first leg's
/// pair), its units and floor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LegDraw {
    pub offset: usize,
    pub units: u64,
    pub floor: Option<FloorAsk>,
}

/// How a settle reports its actual units.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SettleForm {
    /// What a well-behaved caller sends: one number (`actual`) for a
    /// reservation of one leg, every leg at `actual` of its own units for
    /// several.
    Auto,
    /// One number whatever the reservation (refused on several legs).
    One,
    /// Per leg by pair: leg `i` at `actuals[i]` of its own units, left out
    /// (settled at its reserved units) where `None` or beyond the list;
    /// then, if `extra`, a pair that is not a leg or a leg named twice.
    PerLeg {
        actuals: Vec<Option<ActualChoice>>,
        extra: Option<ExtraLeg>,
    },
}

/// A wrong entry at the end of a per-leg settle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExtraLeg {
    /// A pair that is none of the reservation's legs.
    NotALeg,
    /// The first leg's pair again.
    Repeat,
}

/// Which boot a shard request names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BootChoice {
    Current,
    /// The previous boot epoch: superseded.
    Stale,
    /// The current epoch with a nonce never handed out.
    ForeignNonce,
}

/// How a terminal receipt is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Forgery {
    /// Signed by the gateway the shard is bound to.
    Genuine,
    /// From the other gateway, naming itself.
    OtherGateway,
    /// Naming the bound gateway but signed with the other gateway's key.
    ForeignKey,
    /// A flipped signature bit.
    BadSignature,
    /// `allocatedUnits` differs from the shard's.
    AllocatedMismatch,
    /// `bootEpoch` differs from the shard's.
    BootEpochMismatch,
    /// `spent + confirmedUnused + unknown ≠ allocated`.
    BrokenEquation,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Publish {
        pair: usize,
        generation: GenerationChoice,
        params: PolicyParams,
    },
    Reserve {
        pair: usize,
        reservation: usize,
        units: u64,
        digest: u8,
        generation: GenerationAsk,
        hold_ttl_ms: Option<u64>,
        floor: Option<FloorAsk>,
        /// Legs after the first (empty: a reserve of one leg).
        more_legs: Vec<LegDraw>,
    },
    Start {
        reservation: usize,
        operation: usize,
        deadline_ms: Option<u64>,
    },
    Settle {
        reservation: usize,
        operation: usize,
        actual: ActualChoice,
        form: SettleForm,
    },
    Release {
        reservation: usize,
    },
    Abandon {
        reservation: usize,
    },
    AdvanceTime {
        ms: u64,
    },
    /// The retention sweep.
    Forget,
    /// The lost-shard sweep.
    MarkLostShards,
    BeginExpiry,
    CompleteExpiry,
    HandleUsageDeadlines,
    HandleRefill,
    SetFrozen {
        pair: usize,
        frozen: bool,
    },
    SetAdmissionStopped {
        pair: usize,
        generation: GenerationAsk,
        stopped: bool,
    },
    Enroll {
        gateway: usize,
    },
    Register {
        gateway: usize,
    },
    IssueShard {
        gateway: usize,
        pair: usize,
        shard: usize,
        boot: BootChoice,
    },
    Reconcile {
        shard: usize,
        spent_percent: u64,
        unknown_percent: u64,
        debt: u64,
        forgery: Forgery,
    },
    /// Restart: rebuild the ledger from the store.
    Crash,
    /// The next commit fails: the shell must rebuild from the store and
    /// the transition is lost.
    FailNextCommit,
}

/// Indices of the pools that are worth naming in the current state, so that
/// the deep paths (settle after start, reconcile after issue) are reached
/// often; every index of the pool stays possible.
#[derive(Debug, Clone, Default)]
pub struct Hints {
    /// Reservations that exist (any state).
    pub existing: Vec<usize>,
    /// `RESERVED` ones.
    pub reserved: Vec<usize>,
    /// Started, usage-unknown or settled ones.
    pub started: Vec<usize>,
    /// Started or usage-unknown ones (the usage worker has work).
    pub running: Vec<usize>,
    /// Settled conservatively and not yet corrected.
    pub conservative: Vec<usize>,
    pub enrolled: Vec<usize>,
    pub registered: Vec<usize>,
    /// Issued shards.
    pub shards: Vec<usize>,
}

/// Mostly one of `preferred`, sometimes any index of the pool.
fn index(preferred: &[usize], pool: usize) -> BoxedStrategy<usize> {
    if preferred.is_empty() {
        (0..pool).boxed()
    } else {
        prop_oneof![3 => prop::sample::select(preferred.to_vec()), 1 => 0..pool].boxed()
    }
}

/// Pair 0 carries most of the traffic; pair 1 starts without a policy.
fn pair() -> impl Strategy<Value = usize> {
    prop_oneof![4 => Just(0usize), 1 => 0..PAIRS]
}

fn policy_params() -> impl Strategy<Value = PolicyParams> {
    (
        prop_oneof![Just(0u64), Just(500), Just(1000)],
        prop_oneof![Just(0u64), Just(500)],
        prop_oneof![Just(0u64), Just(100), Just(250)],
        prop_oneof![Just(60_000u64), Just(30_000), Just(3_600_000)],
        prop_oneof![Just(300u64), Just(800)],
        prop_oneof![Just(2_000u64), Just(5_000)],
        prop_oneof![Just(0u64), Just(200)],
        prop_oneof![Just(8_000u64), Just(20_000)],
        prop_oneof![Just(0u64), Just(100), Just(200)],
        prop_oneof![
            8 => Just(RouteMode::Enforce),
            1 => Just(RouteMode::Shadow),
            1 => Just(RouteMode::Off),
        ],
        prop::bool::weighted(0.07),
    )
        .prop_map(
            |(
                opening,
                burst_extra,
                refill_units,
                accounting_epoch_ms,
                reservation_units_max,
                hold_ttl_ms,
                overdraft_units_max,
                execution_hard_limit_ms,
                emergency_shard_units,
                mode,
                invalid,
            )| PolicyParams {
                opening,
                burst_extra,
                refill_units,
                accounting_epoch_ms,
                reservation_units_max,
                hold_ttl_ms,
                overdraft_units_max,
                execution_hard_limit_ms,
                emergency_shard_units,
                mode,
                invalid,
            },
        )
}

fn generation_ask() -> impl Strategy<Value = GenerationAsk> {
    prop_oneof![
        6 => Just(GenerationAsk::Unnamed),
        2 => Just(GenerationAsk::Current),
        1 => Just(GenerationAsk::Previous),
        1 => Just(GenerationAsk::Next),
    ]
}

fn units() -> impl Strategy<Value = u64> {
    prop_oneof![
        1 => Just(0u64),
        2 => Just(1u64),
        4 => Just(100u64),
        3 => Just(250u64),
        3 => Just(400u64),
        3 => Just(600u64),
        1 => Just(900u64),
        2 => 1u64..=1200,
    ]
}

fn publish() -> impl Strategy<Value = Op> {
    (
        prop_oneof![6 => pair(), 1 => PAIRS..LEG_PAIRS],
        prop_oneof![
            6 => Just(GenerationChoice::Next),
            1 => Just(GenerationChoice::Same),
            1 => Just(GenerationChoice::Skip),
        ],
        policy_params(),
    )
        .prop_map(|(pair, generation, params)| Op::Publish {
            pair,
            generation,
            params,
        })
}

fn one_leg_reserve(hints: &Hints) -> impl Strategy<Value = Op> + use<> {
    let reservation = prop_oneof![
        3 => 0..RESERVATIONS,
        1 => index(&hints.existing, RESERVATIONS),
    ];
    // Mostly on the reservation's home pair; else its ID is foreign there.
    let reservation_and_pair = reservation.prop_flat_map(|reservation| {
        (
            Just(reservation),
            prop_oneof![5 => Just(home_pair(reservation)), 1 => 0..PAIRS],
        )
    });
    (
        reservation_and_pair,
        units(),
        prop_oneof![6 => Just(0u8), 1 => Just(1u8)],
        generation_ask(),
        prop_oneof![
            4 => Just(None),
            1 => Just(Some(1_000u64)),
            1 => Just(Some(60_000u64)),
        ],
        floor(),
    )
        .prop_map(
            |((reservation, pair), units, digest, generation, hold_ttl_ms, floor)| Op::Reserve {
                pair,
                reservation,
                units,
                digest,
                generation,
                hold_ttl_ms,
                floor,
                more_legs: Vec::new(),
            },
        )
}

fn floor() -> impl Strategy<Value = Option<FloorAsk>> {
    prop_oneof![
        12 => Just(None),
        1 => Just(Some(FloorAsk::Zero)),
        2 => Just(Some(FloorAsk::One)),
        3 => Just(Some(FloorAsk::Half)),
        1 => Just(Some(FloorAsk::Whole)),
        1 => Just(Some(FloorAsk::AboveUnits)),
    ]
}

/// A further leg's floor: mostly valid (a bad leg refuses the whole
/// reserve, and the first leg already draws bad floors).
fn leg_floor() -> impl Strategy<Value = Option<FloorAsk>> {
    prop_oneof![
        16 => Just(None),
        1 => Just(Some(FloorAsk::Zero)),
        2 => Just(Some(FloorAsk::One)),
        3 => Just(Some(FloorAsk::Half)),
        1 => Just(Some(FloorAsk::Whole)),
        1 => Just(Some(FloorAsk::AboveUnits)),
    ]
}

/// `count` legs of distinct pairs from `offsets`, shuffled.
fn distinct_legs(
    offsets: Vec<usize>,
    count: std::ops::RangeInclusive<usize>,
) -> BoxedStrategy<Vec<LegDraw>> {
    (Just(offsets).prop_shuffle(), count)
        .prop_flat_map(|(offsets, count)| {
            offsets[..count]
                .iter()
                .map(|&offset| leg(Just(offset).boxed()))
                .collect::<Vec<_>>()
        })
        .boxed()
}

fn leg(offset: BoxedStrategy<usize>) -> impl Strategy<Value = LegDraw> {
    (offset, units(), leg_floor()).prop_map(|(offset, units, floor)| LegDraw {
        offset,
        units,
        floor,
    })
}

/// The legs after the first: 1 or 2 on the pairs only further legs name
/// (published from the start), 1 to 3 of distinct pairs (pair 1 among
/// them, often without a policy), sometimes 1 to 3 of any pairs (a pair
/// repeated, often), rarely 8 (9 legs: too many).
fn more_legs() -> impl Strategy<Value = Vec<LegDraw>> {
    prop_oneof![
        6 => distinct_legs((PAIRS..LEG_PAIRS).collect(), 1..=LEG_PAIRS - PAIRS),
        3 => distinct_legs((1..LEG_PAIRS).collect(), 1..=LEG_PAIRS - 1),
        2 => prop::collection::vec(leg((0..LEG_PAIRS).boxed()), 1..=3),
        1 => prop::collection::vec(leg((0..LEG_PAIRS).boxed()), 8),
    ]
}

/// Mostly a reserve of one leg (as drawn before legs existed); one in four
/// has more legs.
fn reserve(hints: &Hints) -> impl Strategy<Value = Op> + use<> {
    prop_oneof![
        3 => one_leg_reserve(hints).boxed(),
        1 => (one_leg_reserve(hints), more_legs()).prop_map(|(op, legs)| match op {
            Op::Reserve { pair, reservation, units, digest, generation, hold_ttl_ms, floor, .. } => {
                Op::Reserve {
                    pair,
                    reservation,
                    units,
                    digest,
                    generation,
                    hold_ttl_ms,
                    floor,
                    more_legs: legs,
                }
            }
            other => other,
        }).boxed(),
    ]
}

fn start(hints: &Hints) -> impl Strategy<Value = Op> + use<> {
    (
        index(&hints.reserved, RESERVATIONS),
        prop_oneof![4 => Just(0usize), 1 => 0..OPERATIONS],
        prop_oneof![
            3 => Just(None),
            1 => Just(Some(1_000u64)),
            1 => Just(Some(100_000u64)),
        ],
    )
        .prop_map(|(reservation, operation, deadline_ms)| Op::Start {
            reservation,
            operation,
            deadline_ms,
        })
}

fn actual() -> impl Strategy<Value = ActualChoice> {
    prop_oneof![
        1 => Just(ActualChoice::Zero),
        3 => Just(ActualChoice::Half),
        3 => Just(ActualChoice::Equal),
        2 => Just(ActualChoice::Above),
        2 => Just(ActualChoice::FarAbove),
    ]
}

/// Mostly the form the reservation expects; sometimes per leg with legs
/// left out (and rarely a wrong entry); rarely one number whatever the
/// legs.
fn settle_form() -> impl Strategy<Value = SettleForm> {
    prop_oneof![
        12 => Just(SettleForm::Auto),
        4 => (
            prop::collection::vec(prop_oneof![3 => actual().prop_map(Some), 1 => Just(None)], 0..=4),
            prop_oneof![
                8 => Just(None),
                1 => Just(Some(ExtraLeg::NotALeg)),
                1 => Just(Some(ExtraLeg::Repeat)),
            ],
        )
            .prop_map(|(actuals, extra)| SettleForm::PerLeg { actuals, extra }),
        1 => Just(SettleForm::One),
    ]
}

fn settle(preferred: &[usize]) -> impl Strategy<Value = Op> + use<> {
    (
        index(preferred, RESERVATIONS),
        prop_oneof![4 => Just(0usize), 1 => 0..OPERATIONS],
        actual(),
        settle_form(),
    )
        .prop_map(|(reservation, operation, actual, form)| Op::Settle {
            reservation,
            operation,
            actual,
            form,
        })
}

fn advance_time() -> impl Strategy<Value = Op> {
    prop_oneof![
        2 => Just(1u64),
        2 => Just(1_000u64),
        3 => 1u64..=4_000,
        2 => Just(5_000u64),
        2 => 5_001u64..=25_000,
        1 => Just(60_000u64),
        1 => 60_000u64..=200_000,
    ]
    .prop_map(|ms| Op::AdvanceTime { ms })
}

fn issue_shard(hints: &Hints) -> impl Strategy<Value = Op> + use<> {
    (
        index(&hints.registered, GATEWAYS),
        pair(),
        0..SHARDS,
        prop_oneof![
            6 => Just(BootChoice::Current),
            1 => Just(BootChoice::Stale),
            1 => Just(BootChoice::ForeignNonce),
        ],
    )
        .prop_map(|(gateway, pair, shard, boot)| Op::IssueShard {
            gateway,
            pair,
            shard,
            boot,
        })
}

fn reconcile(hints: &Hints) -> impl Strategy<Value = Op> + use<> {
    (
        index(&hints.shards, SHARDS),
        prop_oneof![Just(0u64), Just(50), Just(100), 0u64..=100],
        prop_oneof![Just(0u64), Just(50), 0u64..=100],
        prop_oneof![6 => Just(0u64), 1 => Just(30u64), 1 => Just(250u64)],
        prop_oneof![
            8 => Just(Forgery::Genuine),
            1 => Just(Forgery::OtherGateway),
            1 => Just(Forgery::ForeignKey),
            1 => Just(Forgery::BadSignature),
            1 => Just(Forgery::AllocatedMismatch),
            1 => Just(Forgery::BootEpochMismatch),
            1 => Just(Forgery::BrokenEquation),
        ],
    )
        .prop_map(
            |(shard, spent_percent, unknown_percent, debt, forgery)| Op::Reconcile {
                shard,
                spent_percent,
                unknown_percent,
                debt,
                forgery,
            },
        )
}

/// Every operation, weighted towards the reservation lifecycle.
pub fn op(hints: &Hints) -> BoxedStrategy<Op> {
    // Gateways are enrolled and registered early, then rarely again.
    let (enroll, register) = match (hints.enrolled.len(), hints.registered.len()) {
        (0, _) => (6, 1),
        (_, 0) => (1, 6),
        _ => (1, 2),
    };
    // Lifecycle steps are likely when there is something to step on.
    let weight = |preferred: &[usize], high: u32| if preferred.is_empty() { 1 } else { high };
    prop_oneof![
        3 => publish(),
        20 => reserve(hints),
        weight(&hints.reserved, 12) => start(hints),
        weight(&hints.started, 14) => settle(&hints.started),
        weight(&hints.conservative, 6) => settle(&hints.conservative),
        weight(&hints.reserved, 4) => index(&hints.reserved, RESERVATIONS)
            .prop_map(|reservation| Op::Release { reservation }),
        3 => index(&hints.existing, RESERVATIONS).prop_map(|reservation| Op::Abandon { reservation }),
        10 => advance_time(),
        3 => Just(Op::Forget),
        weight(&hints.shards, 2) => Just(Op::MarkLostShards),
        2 => Just(Op::BeginExpiry),
        2 => Just(Op::CompleteExpiry),
        weight(&hints.running, 4) => Just(Op::HandleUsageDeadlines),
        4 => Just(Op::HandleRefill),
        2 => (pair(), any::<bool>()).prop_map(|(pair, frozen)| Op::SetFrozen { pair, frozen }),
        1 => (pair(), generation_ask(), any::<bool>()).prop_map(|(pair, generation, stopped)| {
            Op::SetAdmissionStopped {
                pair,
                generation,
                stopped,
            }
        }),
        enroll => (0..GATEWAYS).prop_map(|gateway| Op::Enroll { gateway }),
        register => index(&hints.enrolled, GATEWAYS).prop_map(|gateway| Op::Register { gateway }),
        weight(&hints.registered, 6) => issue_shard(hints),
        weight(&hints.shards, 6) => reconcile(hints),
        3 => Just(Op::Crash),
        2 => Just(Op::FailNextCommit),
    ]
    .boxed()
}
