//! What the tests share: the fixed test keys, the six kinds of document with
//! their golden samples, case counts, and proptest strategies that generate
//! valid documents (every rule of `validate()` respected).

use std::path::PathBuf;

use proptest::prelude::*;
use proptest::sample::select;
use shard_format::limits::{
    COUNTER_MAX, DURATION_MS_MAX, FAIRNESS_WEIGHT_MAX, HOLD_TTL_MS_MAX, UNITS_MAX,
};
use shard_format::{
    AdmissionBudgetSchema, AdmissionBudgetV1, BootNonce, Digest, Document, Ed25519Signer,
    EmergencyMode, EmergencyShardSchema, EmergencyShardV1, KeyId, LimitReservationSchema,
    LimitReservationV1, OperationId, OperationReceiptSchema, OperationReceiptV1, ParseError,
    Refill, ReservationId, ReservationState, Route, RouteMode, SettlementReceiptSchema,
    SettlementReceiptV1, ShardCloseReason, ShardId, ShardTerminalReceiptSchema,
    ShardTerminalReceiptV1, Signature, Subject, Timestamp, canonical_bytes, parse,
};

/// Secret seed of the central ledger's test key, which signs shards.
pub const CENTRAL_SECRET: [u8; 32] = [1; 32];
/// Secret seed of the gateway's test key, which signs terminal receipts.
pub const GATEWAY_SECRET: [u8; 32] = [2; 32];
/// Secret seed of a key nobody trusts.
pub const STRANGER_SECRET: [u8; 32] = [3; 32];

pub fn central_signer() -> Ed25519Signer {
    Ed25519Signer::from_secret_bytes(&CENTRAL_SECRET)
}

pub fn gateway_signer() -> Ed25519Signer {
    Ed25519Signer::from_secret_bytes(&GATEWAY_SECRET)
}

pub fn stranger_signer() -> Ed25519Signer {
    Ed25519Signer::from_secret_bytes(&STRANGER_SECRET)
}

/// `tests/vectors/`.
pub fn vectors_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join("vectors")
}

/// The pretty-printed input of the golden vector `name`.
pub fn vector_input(name: &str) -> Vec<u8> {
    let path = vectors_dir().join(format!("{name}.input.json"));
    std::fs::read(&path).unwrap_or_else(|error| panic!("{}: {error}", path.display()))
}

/// The golden vector `name`, parsed.
pub fn vector<D: Document>(name: &str) -> D {
    parse(&vector_input(name)).unwrap_or_else(|error| panic!("vector {name}: {error}"))
}

/// Test cases for a proptest: `variable` from the environment if set, else
/// `default`. The defaults keep the whole suite well under 30 seconds in
/// debug mode on two cores.
pub fn config(variable: &str, default: u32) -> ProptestConfig {
    let cases = std::env::var(variable)
        .ok()
        .and_then(|cases| cases.parse().ok())
        .unwrap_or(default);
    ProptestConfig::with_cases(cases)
}

/// The six v1 documents, for tests driven by data rather than by type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    AdmissionBudget,
    LimitReservation,
    SettlementReceipt,
    OperationReceipt,
    EmergencyShard,
    ShardTerminalReceipt,
}

impl Kind {
    pub const ALL: [Self; 6] = [
        Self::AdmissionBudget,
        Self::LimitReservation,
        Self::SettlementReceipt,
        Self::OperationReceipt,
        Self::EmergencyShard,
        Self::ShardTerminalReceipt,
    ];

    pub fn schema(self) -> &'static str {
        match self {
            Self::AdmissionBudget => AdmissionBudgetV1::SCHEMA,
            Self::LimitReservation => LimitReservationV1::SCHEMA,
            Self::SettlementReceipt => SettlementReceiptV1::SCHEMA,
            Self::OperationReceipt => OperationReceiptV1::SCHEMA,
            Self::EmergencyShard => EmergencyShardV1::SCHEMA,
            Self::ShardTerminalReceipt => ShardTerminalReceiptV1::SCHEMA,
        }
    }

    pub fn from_schema(schema: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|kind| kind.schema() == schema)
    }

    /// The kind of the golden vector `name` (`limitReservation.v1-settled`).
    pub fn of_vector(name: &str) -> Self {
        let schema = name.split('-').next().unwrap_or(name);
        Self::from_schema(schema).unwrap_or_else(|| panic!("vector {name} is not a document"))
    }

    /// Parses `bytes` as this kind of document and returns its canonical
    /// bytes.
    pub fn parse(self, bytes: &[u8]) -> Result<Vec<u8>, ParseError> {
        fn canonical<D: Document>(bytes: &[u8]) -> Result<Vec<u8>, ParseError> {
            parse::<D>(bytes).map(|document| canonical_bytes(&document))
        }
        match self {
            Self::AdmissionBudget => canonical::<AdmissionBudgetV1>(bytes),
            Self::LimitReservation => canonical::<LimitReservationV1>(bytes),
            Self::SettlementReceipt => canonical::<SettlementReceiptV1>(bytes),
            Self::OperationReceipt => canonical::<OperationReceiptV1>(bytes),
            Self::EmergencyShard => canonical::<EmergencyShardV1>(bytes),
            Self::ShardTerminalReceipt => canonical::<ShardTerminalReceiptV1>(bytes),
        }
    }

    /// The golden vector named after the schema: a valid document of this
    /// kind, pretty-printed with `schema` first.
    pub fn sample(self) -> Vec<u8> {
        vector_input(self.schema())
    }
}

// Strategies for values.

/// `1..=max`, with both ends drawn often.
pub fn positive_up_to(max: u64) -> impl Strategy<Value = u64> + Clone {
    prop_oneof![Just(1), Just(max), 1..=max]
}

/// `0..=max`, with both ends drawn often.
pub fn up_to(max: u64) -> impl Strategy<Value = u64> + Clone {
    prop_oneof![Just(0), Just(max), 0..=max]
}

/// Identifier text: short ones, and ones at the length limit.
fn identifier() -> impl Strategy<Value = String> + Clone {
    prop_oneof![
        3 => "[A-Za-z0-9._~:@-]{1,16}",
        1 => "[A-Za-z0-9._~:@-]{120,128}",
    ]
    .prop_filter("dot segments are not identifiers", |text| {
        text != "." && text != ".."
    })
}

pub fn subject() -> impl Strategy<Value = Subject> + Clone {
    identifier().prop_map(|text| Subject::new(text).expect("generated subject"))
}

pub fn route() -> impl Strategy<Value = Route> + Clone {
    identifier().prop_map(|text| Route::new(text).expect("generated route"))
}

pub fn reservation_id() -> impl Strategy<Value = ReservationId> + Clone {
    identifier().prop_map(|text| ReservationId::new(text).expect("generated reservation"))
}

pub fn operation_id() -> impl Strategy<Value = OperationId> + Clone {
    identifier().prop_map(|text| OperationId::new(text).expect("generated operation ID"))
}

pub fn shard_id() -> impl Strategy<Value = ShardId> + Clone {
    identifier().prop_map(|text| ShardId::new(text).expect("generated shard ID"))
}

/// `region` and `capacityUnit`: 1 to 64 bytes of printable ASCII, `"` and `\`
/// included.
fn label() -> impl Strategy<Value = String> + Clone {
    "[ -~]{1,64}"
}

pub fn digest() -> impl Strategy<Value = Digest> + Clone {
    any::<[u8; 32]>().prop_map(Digest)
}

pub fn timestamp() -> impl Strategy<Value = Timestamp> + Clone {
    up_to(Timestamp::MAX.unix_ms())
        .prop_map(|ms| Timestamp::from_unix_ms(ms).expect("generated timestamp"))
}

/// An ed25519 key ID (any 32 bytes: parsing does not check the point) or one
/// of another scheme, as the simulator's signer uses.
pub fn key_id() -> impl Strategy<Value = KeyId> + Clone {
    prop_oneof![
        3 => any::<[u8; 32]>().prop_map(|key| KeyId::ed25519(&key)),
        1 => "[a-z]{1,8}:[A-Za-z0-9._~:@-]{1,40}"
            .prop_map(|text| KeyId::new(text).expect("generated key ID")),
    ]
}

pub fn signature() -> impl Strategy<Value = Signature> + Clone {
    prop::collection::vec(any::<u8>(), 64)
        .prop_map(|bytes| Signature(bytes.try_into().expect("64 generated signature bytes")))
}

fn reservation_state() -> impl Strategy<Value = ReservationState> + Clone {
    use ReservationState::*;
    select(vec![
        Requested,
        Reserved,
        Started,
        Settled,
        SettledWithDebt,
        Released,
        Expiring,
        Expired,
        ReservationUnknown,
        UsageUnknown,
        Abandoned,
    ])
}

// Strategies for documents.

pub fn admission_budget() -> impl Strategy<Value = AdmissionBudgetV1> + Clone {
    let names = (subject(), route(), label(), label(), digest());
    // `burst` bounds `opening`, `reservationUnitsMax` and `emergencyShardUnits`.
    let units = positive_up_to(UNITS_MAX).prop_flat_map(|burst| {
        (
            Just(burst),
            up_to(burst),
            positive_up_to(burst),
            up_to(burst),
            positive_up_to(burst),
            any::<bool>(),
        )
    });
    let durations = (
        positive_up_to(DURATION_MS_MAX),
        positive_up_to(DURATION_MS_MAX),
        positive_up_to(HOLD_TTL_MS_MAX),
        positive_up_to(DURATION_MS_MAX),
        positive_up_to(DURATION_MS_MAX),
    );
    let rest = (
        positive_up_to(COUNTER_MAX),
        up_to(UNITS_MAX),
        up_to(UNITS_MAX),
        any::<u8>(),
        1..=FAIRNESS_WEIGHT_MAX,
        select(vec![RouteMode::Off, RouteMode::Shadow, RouteMode::Enforce]),
    );
    (names, units, durations, rest).prop_map(
        |(
            (subject, route, region, capacity_unit, estimator_digest),
            (burst, opening, reservation_units_max, shard_units, enabled_shard_units, enabled),
            (interval_ms, accounting_epoch_ms, hold_ttl_ms, execution_hard_limit_ms, validity_ms),
            (policy_generation, refill_units, overdraft_units_max, priority, fairness_weight, mode),
        )| AdmissionBudgetV1 {
            schema: AdmissionBudgetSchema,
            subject,
            route,
            region,
            capacity_unit,
            policy_generation,
            opening,
            refill: Refill {
                units: refill_units,
                interval_ms,
            },
            burst,
            accounting_epoch_ms,
            estimator_digest,
            reservation_units_max,
            hold_ttl_ms,
            priority,
            fairness_weight,
            overdraft_units_max,
            execution_hard_limit_ms,
            emergency_mode: if enabled {
                EmergencyMode::Enabled
            } else {
                EmergencyMode::Disabled
            },
            mode,
            emergency_shard_units: if enabled {
                enabled_shard_units
            } else {
                shard_units
            },
            emergency_shard_validity_ms: validity_ms,
        },
    )
}

pub fn limit_reservation() -> impl Strategy<Value = LimitReservationV1> + Clone {
    let names = (reservation_id(), subject(), route(), digest());
    let numbers = (
        positive_up_to(COUNTER_MAX),
        up_to(UNITS_MAX),
        up_to(UNITS_MAX),
    );
    let life = (
        timestamp(),
        timestamp(),
        reservation_state(),
        operation_id(),
        any::<bool>(),
    );
    (names, numbers, life).prop_map(
        |(
            (reservation, subject, route, request_digest),
            (policy_generation, reserved_units, actual_units),
            (accounting_epoch, expires_at, state, operation_id, bound),
        )| {
            // `actualUnits` exactly when settled; `operationId` whenever
            // started or settled, and optionally before.
            let required = state.is_settled() || state.is_started();
            LimitReservationV1 {
                schema: LimitReservationSchema,
                reservation,
                subject,
                route,
                policy_generation,
                accounting_epoch,
                request_digest,
                reserved_units,
                requested_units: None,
                min_units: None,
                actual_units: state.is_settled().then_some(actual_units),
                operation_id: (required || bound).then_some(operation_id),
                expires_at,
                state,
                legs: None,
            }
        },
    )
}

pub fn settlement_receipt() -> impl Strategy<Value = SettlementReceiptV1> + Clone {
    let names = (reservation_id(), operation_id(), subject(), route());
    let units = (up_to(UNITS_MAX), up_to(UNITS_MAX)).prop_flat_map(|(reserved, actual)| {
        (
            Just(reserved),
            Just(actual),
            up_to(actual.saturating_sub(reserved)),
        )
    });
    let rest = (
        positive_up_to(COUNTER_MAX),
        timestamp(),
        timestamp(),
        any::<bool>(),
    );
    (names, units, rest).prop_map(
        |(
            (reservation, operation_id, subject, route),
            (reserved_units, actual_units, overdraft_units),
            (policy_generation, accounting_epoch, settled_at, conservative),
        )| SettlementReceiptV1 {
            schema: SettlementReceiptSchema,
            reservation,
            operation_id,
            subject,
            route,
            policy_generation,
            accounting_epoch,
            reserved_units,
            actual_units,
            refunded_units: reserved_units.saturating_sub(actual_units),
            overdraft_units,
            state: if overdraft_units > 0 {
                ReservationState::SettledWithDebt
            } else {
                ReservationState::Settled
            },
            conservative,
            settled_at,
            legs: None,
        },
    )
}

pub fn operation_receipt() -> impl Strategy<Value = OperationReceiptV1> + Clone {
    (
        reservation_id(),
        operation_id(),
        up_to(UNITS_MAX),
        timestamp(),
    )
        .prop_map(|(reservation, operation_id, actual_units, completed_at)| {
            OperationReceiptV1 {
                schema: OperationReceiptSchema,
                reservation,
                operation_id,
                actual_units,
                completed_at,
            }
        })
}

pub fn emergency_shard() -> impl Strategy<Value = EmergencyShardV1> + Clone {
    let names = (shard_id(), subject(), route(), key_id(), key_id());
    let numbers = (
        positive_up_to(COUNTER_MAX),
        positive_up_to(UNITS_MAX),
        positive_up_to(COUNTER_MAX),
        positive_up_to(COUNTER_MAX),
    );
    // `notBefore` strictly before `notAfter`.
    let validity = up_to(Timestamp::MAX.unix_ms() - 1).prop_flat_map(|not_before| {
        (
            Just(not_before),
            prop_oneof![
                Just(not_before + 1),
                not_before + 1..=Timestamp::MAX.unix_ms()
            ],
        )
    });
    let rest = (
        timestamp(),
        any::<[u8; 16]>().prop_map(BootNonce),
        signature(),
    );
    (names, numbers, validity, rest).prop_map(
        |(
            (shard, subject, route, gateway_identity, key_id),
            (policy_generation, allocated_units, boot_epoch, fence),
            (not_before, not_after),
            (accounting_epoch, boot_nonce, signature),
        )| EmergencyShardV1 {
            schema: EmergencyShardSchema,
            shard,
            subject,
            route,
            policy_generation,
            accounting_epoch,
            allocated_units,
            gateway_identity,
            boot_epoch,
            boot_nonce,
            fence,
            not_before: Timestamp::from_unix_ms(not_before).expect("generated notBefore"),
            not_after: Timestamp::from_unix_ms(not_after).expect("generated notAfter"),
            key_id,
            signature,
        },
    )
}

pub fn shard_terminal_receipt() -> impl Strategy<Value = ShardTerminalReceiptV1> + Clone {
    let names = (shard_id(), subject(), route(), key_id());
    // `allocatedUnits` = spent + confirmed unused + unknown.
    let book = positive_up_to(UNITS_MAX)
        .prop_flat_map(|allocated| (Just(allocated), up_to(allocated)))
        .prop_flat_map(|(allocated, spent)| {
            (Just(allocated), Just(spent), up_to(allocated - spent))
        });
    let rest = (
        positive_up_to(COUNTER_MAX),
        up_to(UNITS_MAX),
        select(vec![
            ShardCloseReason::ValidityEnded,
            ShardCloseReason::Restart,
            ShardCloseReason::Reconnect,
        ]),
        timestamp(),
        signature(),
    );
    (names, book, rest).prop_map(
        |(
            (shard, subject, route, gateway_identity),
            (allocated_units, spent_units, confirmed_unused_units),
            (boot_epoch, overdraft_debt_units, reason, closed_at, signature),
        )| ShardTerminalReceiptV1 {
            schema: ShardTerminalReceiptSchema,
            shard,
            subject,
            route,
            key_id: gateway_identity.clone(),
            gateway_identity,
            boot_epoch,
            allocated_units,
            spent_units,
            confirmed_unused_units,
            unknown_units: allocated_units - spent_units - confirmed_unused_units,
            overdraft_debt_units,
            reason,
            closed_at,
            signature,
        },
    )
}
