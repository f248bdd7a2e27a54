//! The redb store's compact form of a reservation's record
//! ([`Change::Reservation`]), the record nearly every operation writes:
//! [`CompactRecord`] in record-log's positional MessagePack
//! ([`value::encode_positional`]), which names no field, with timestamps
//! as integers and the request digest as its 32 bytes. A reservation
//! settled on the agent's healthy path takes 402 bytes this way, against
//! 1,011 with the field names
//! (`the_compact_form_is_less_than_half_the_named_one`):
//! bytes every commit encodes and writes, every fold copies into the
//! table, and every open reads back.
//!
//! What a record carries only sometimes — the legs of a multi-leg
//! reservation — keeps its own form (MessagePack with names, in a byte
//! string, [`Named`]): those types skip empty fields, which a positional
//! form cannot hold.
//!
//! Fields are only ever appended, with `#[serde(default)]`: a field
//! removed or moved would misread every record stored before. Records
//! written with names before this form are still read
//! ([`record_log::value::decode`]); a binary from before this form refuses
//! a compact record as corrupt instead of misreading it
//! ([`value::POSITIONAL_MARKER`] is no MessagePack).

use std::borrow::Cow;

use ledger::{Change, ReservationRecord};
use record_log::value::{self, ByteArray, DecodeError, Named};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use shard_format::{
    Digest, GatewayIdentity, LimitReservationSchema, LimitReservationV1, OperationId,
    ReservationId, ReservationState, Route, SettlementReceiptSchema, SettlementReceiptV1, Subject,
    Timestamp,
};

/// A [`ReservationRecord`], field by field in this order: its receipt's
/// fields (but the constant `schema`), then the ledger's bookkeeping.
/// Borrowed to encode, owned when decoded.
#[derive(Serialize, Deserialize)]
struct CompactRecord<'a> {
    accounting_epoch: Millis,
    actual_units: Option<u64>,
    expires_at: Millis,
    legs: Option<Named>,
    min_units: Option<u64>,
    operation_id: Option<Cow<'a, OperationId>>,
    policy_generation: u64,
    request_digest: ByteArray<32>,
    requested_units: Option<u64>,
    reservation: Cow<'a, ReservationId>,
    reserved_units: u64,
    route: Cow<'a, Route>,
    state: ReservationState,
    subject: Cow<'a, Subject>,
    shadow: bool,
    started_at: Option<Millis>,
    usage_deadline: Option<Millis>,
    hard_limit_at: Option<Millis>,
    settlement: Option<CompactSettlement<'a>>,
    corrected: bool,
    ended_at: Option<Millis>,
    owner: Option<Cow<'a, GatewayIdentity>>,
}

/// A [`SettlementReceiptV1`], field by field, but the constant `schema`.
#[derive(Serialize, Deserialize)]
struct CompactSettlement<'a> {
    accounting_epoch: Millis,
    actual_units: u64,
    conservative: bool,
    legs: Option<Named>,
    operation_id: Cow<'a, OperationId>,
    overdraft_units: u64,
    policy_generation: u64,
    refunded_units: u64,
    reservation: Cow<'a, ReservationId>,
    reserved_units: u64,
    route: Cow<'a, Route>,
    settled_at: Millis,
    state: ReservationState,
    subject: Cow<'a, Subject>,
}

/// A reservation's record as the store keeps it.
pub(super) fn encode(record: &ReservationRecord) -> Vec<u8> {
    // Every field named, no `..`: a field added to a record fails to
    // compile here until the compact form has it too.
    let ReservationRecord {
        receipt,
        shadow,
        started_at,
        usage_deadline,
        hard_limit_at,
        settlement,
        corrected,
        ended_at,
        owner,
    } = record;
    let LimitReservationV1 {
        accounting_epoch,
        actual_units,
        expires_at,
        legs,
        min_units,
        operation_id,
        policy_generation,
        request_digest,
        requested_units,
        reservation,
        reserved_units,
        route,
        schema: LimitReservationSchema,
        state,
        subject,
    } = receipt;
    let compact = CompactRecord {
        accounting_epoch: Millis(*accounting_epoch),
        actual_units: *actual_units,
        expires_at: Millis(*expires_at),
        legs: legs.as_ref().map(Named::of),
        min_units: *min_units,
        operation_id: operation_id.as_ref().map(Cow::Borrowed),
        policy_generation: *policy_generation,
        request_digest: ByteArray(request_digest.0),
        requested_units: *requested_units,
        reservation: Cow::Borrowed(reservation),
        reserved_units: *reserved_units,
        route: Cow::Borrowed(route),
        state: *state,
        subject: Cow::Borrowed(subject),
        shadow: *shadow,
        started_at: started_at.map(Millis),
        usage_deadline: usage_deadline.map(Millis),
        hard_limit_at: hard_limit_at.map(Millis),
        settlement: settlement.as_ref().map(CompactSettlement::of),
        corrected: *corrected,
        ended_at: ended_at.map(Millis),
        owner: owner.as_ref().map(Cow::Borrowed),
    };
    value::encode_positional(&compact)
}

/// Reads a record [`encode`] wrote, as the change that stores it.
pub(super) fn decode(bytes: &[u8]) -> Result<Change, DecodeError> {
    let compact: CompactRecord = value::decode_positional(bytes)?;
    let receipt = LimitReservationV1 {
        accounting_epoch: compact.accounting_epoch.0,
        actual_units: compact.actual_units,
        expires_at: compact.expires_at.0,
        legs: compact.legs.map(Named::read).transpose()?,
        min_units: compact.min_units,
        operation_id: compact.operation_id.map(Cow::into_owned),
        policy_generation: compact.policy_generation,
        request_digest: Digest(compact.request_digest.0),
        requested_units: compact.requested_units,
        reservation: compact.reservation.into_owned(),
        reserved_units: compact.reserved_units,
        route: compact.route.into_owned(),
        schema: LimitReservationSchema,
        state: compact.state,
        subject: compact.subject.into_owned(),
    };
    Ok(Change::Reservation(Box::new(ReservationRecord {
        receipt,
        shadow: compact.shadow,
        started_at: compact.started_at.map(|at| at.0),
        usage_deadline: compact.usage_deadline.map(|at| at.0),
        hard_limit_at: compact.hard_limit_at.map(|at| at.0),
        settlement: compact
            .settlement
            .map(CompactSettlement::settlement)
            .transpose()?,
        corrected: compact.corrected,
        ended_at: compact.ended_at.map(|at| at.0),
        owner: compact.owner.map(Cow::into_owned),
    })))
}

impl<'a> CompactSettlement<'a> {
    fn of(settlement: &'a SettlementReceiptV1) -> Self {
        let SettlementReceiptV1 {
            accounting_epoch,
            actual_units,
            conservative,
            legs,
            operation_id,
            overdraft_units,
            policy_generation,
            refunded_units,
            reservation,
            reserved_units,
            route,
            schema: SettlementReceiptSchema,
            settled_at,
            state,
            subject,
        } = settlement;
        Self {
            accounting_epoch: Millis(*accounting_epoch),
            actual_units: *actual_units,
            conservative: *conservative,
            legs: legs.as_ref().map(Named::of),
            operation_id: Cow::Borrowed(operation_id),
            overdraft_units: *overdraft_units,
            policy_generation: *policy_generation,
            refunded_units: *refunded_units,
            reservation: Cow::Borrowed(reservation),
            reserved_units: *reserved_units,
            route: Cow::Borrowed(route),
            settled_at: Millis(*settled_at),
            state: *state,
            subject: Cow::Borrowed(subject),
        }
    }

    fn settlement(self) -> Result<SettlementReceiptV1, DecodeError> {
        Ok(SettlementReceiptV1 {
            accounting_epoch: self.accounting_epoch.0,
            actual_units: self.actual_units,
            conservative: self.conservative,
            legs: self.legs.map(Named::read).transpose()?,
            operation_id: self.operation_id.into_owned(),
            overdraft_units: self.overdraft_units,
            policy_generation: self.policy_generation,
            refunded_units: self.refunded_units,
            reservation: self.reservation.into_owned(),
            reserved_units: self.reserved_units,
            route: self.route.into_owned(),
            schema: SettlementReceiptSchema,
            settled_at: self.settled_at.0,
            state: self.state,
            subject: self.subject.into_owned(),
        })
    }
}

/// A timestamp as its milliseconds since the Unix epoch (its text is 24
/// bytes, and is parsed at every read).
#[derive(Clone, Copy)]
struct Millis(Timestamp);

impl Serialize for Millis {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_u64(self.0.unix_ms())
    }
}

impl<'de> Deserialize<'de> for Millis {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let ms = u64::deserialize(deserializer)?;
        Timestamp::from_unix_ms(ms)
            .map(Self)
            .map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use ledger::{Change, ReservationRecord};
    use record_log::value;
    use shard_format::{
        Digest, KeyId, LimitReservationSchema, LimitReservationV1, ReservationLegV1,
        ReservationState, SettledLegV1, SettlementReceiptSchema, SettlementReceiptV1, Timestamp,
    };

    use super::{decode, encode};

    fn id<T: std::str::FromStr<Err: std::fmt::Debug>>(text: &str) -> T {
        text.parse().expect("a valid value")
    }

    fn at(ms: u64) -> Timestamp {
        Timestamp::from_unix_ms(1_784_469_600_000 + ms).expect("valid")
    }

    /// As the agent's healthy path leaves a reservation: reserved, started
    /// and settled by its owner.
    fn settled() -> ReservationRecord {
        let receipt = LimitReservationV1 {
            accounting_epoch: at(0),
            actual_units: Some(1),
            expires_at: at(30_000),
            legs: None,
            min_units: None,
            operation_id: Some(id("op-eb7eb47a1237-h128-10-124")),
            policy_generation: 1,
            request_digest: Digest::sha256(b"request"),
            requested_units: None,
            reservation: id("rl-b3e343d8a6e5e764063701f3ad1f84e2"),
            reserved_units: 1,
            route: id("bench.generate"),
            schema: LimitReservationSchema,
            state: ReservationState::Settled,
            subject: id("tenant-bench"),
        };
        let settlement = SettlementReceiptV1 {
            accounting_epoch: receipt.accounting_epoch,
            actual_units: 1,
            conservative: false,
            legs: None,
            operation_id: id("op-eb7eb47a1237-h128-10-124"),
            overdraft_units: 0,
            policy_generation: 1,
            refunded_units: 0,
            reservation: receipt.reservation.clone(),
            reserved_units: 1,
            route: receipt.route.clone(),
            schema: SettlementReceiptSchema,
            settled_at: at(12),
            state: ReservationState::Settled,
            subject: receipt.subject.clone(),
        };
        ReservationRecord {
            receipt,
            shadow: false,
            started_at: Some(at(5)),
            usage_deadline: Some(at(60_005)),
            hard_limit_at: Some(at(120_005)),
            settlement: Some(settlement),
            corrected: false,
            ended_at: Some(at(12)),
            owner: Some(KeyId::new(format!("ed25519:{}", "3f".repeat(32))).expect("valid")),
        }
    }

    /// Every optional field present: two legs, a flexible ask, a
    /// corrected conservative settlement with debt.
    fn with_everything() -> ReservationRecord {
        let mut record = settled();
        let leg = |index: u32| ReservationLegV1 {
            min_units: Some(2),
            requested_units: Some(9),
            reservation: id(&format!("rl-leg-{index}")),
            reserved_units: 7,
            route: id(&format!("route-{index}")),
            subject: id("tenant-7"),
        };
        record.receipt.legs = Some(vec![leg(1), leg(2)]);
        record.receipt.min_units = Some(2);
        record.receipt.requested_units = Some(9);
        record.receipt.reserved_units = 7;
        record.receipt.state = ReservationState::SettledWithDebt;
        record.shadow = true;
        record.corrected = true;
        let settlement = record.settlement.as_mut().expect("settled");
        settlement.conservative = true;
        settlement.overdraft_units = 3;
        settlement.actual_units = 10;
        settlement.state = ReservationState::SettledWithDebt;
        settlement.legs = Some(vec![SettledLegV1 {
            actual_units: 10,
            overdraft_units: 3,
            reservation: id("rl-leg-1"),
            reserved_units: 7,
            route: id("route-1"),
            subject: id("tenant-7"),
        }]);
        record
    }

    /// Just reserved, by a record from before reservations had owners:
    /// every optional field empty.
    fn reserved_without_owner() -> ReservationRecord {
        let mut record = settled();
        record.receipt.actual_units = None;
        record.receipt.operation_id = None;
        record.receipt.state = ReservationState::Reserved;
        record.started_at = None;
        record.usage_deadline = None;
        record.hard_limit_at = None;
        record.settlement = None;
        record.ended_at = None;
        record.owner = None;
        record
    }

    #[test]
    fn records_round_trip_through_the_compact_form() {
        for record in [settled(), with_everything(), reserved_without_owner()] {
            let bytes = encode(&record);
            assert!(value::is_positional(&bytes));
            assert_eq!(
                decode(&bytes).expect("decodes"),
                Change::Reservation(Box::new(record))
            );
        }
    }

    #[test]
    fn the_compact_form_is_less_than_half_the_named_one() {
        let record = settled();
        let compact = encode(&record).len();
        let named = value::encode(&Change::Reservation(Box::new(record))).len();
        assert!(
            2 * compact < named,
            "compact {compact} bytes, named {named}"
        );
    }

    #[test]
    fn a_timestamp_past_year_9999_is_refused() {
        let bytes = encode(&reserved_without_owner());
        // The first field, the accounting epoch, as a uint 64 (0xcf) after
        // the marker and the header of an array of 22 (0xdc, 0, 22).
        assert_eq!(bytes[1..5], [0xdc, 0, 22, 0xcf]);
        let mut late = bytes.clone();
        late[5..13].copy_from_slice(&(Timestamp::MAX.unix_ms() + 1).to_be_bytes());
        let error = decode(&late).expect_err("past year 9999");
        assert!(error.to_string().contains("after year 9999"), "{error}");
        let mut last = bytes;
        last[5..13].copy_from_slice(&Timestamp::MAX.unix_ms().to_be_bytes());
        let Change::Reservation(record) = decode(&last).expect("decodes") else {
            panic!("a reservation");
        };
        assert_eq!(record.receipt.accounting_epoch, Timestamp::MAX);
    }

    #[test]
    fn a_damaged_compact_record_is_an_error_not_a_panic() {
        let bytes = encode(&with_everything());
        for cut in 0..bytes.len() {
            assert!(decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
    }
}
