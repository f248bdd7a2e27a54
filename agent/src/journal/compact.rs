//! The journal's compact form of a reservation's record
//! ([`JournalRecord::ReservationWithHolds`]), the record every admission
//! step writes: [`CompactReservation`] in record-log's positional
//! MessagePack ([`value::encode_positional`]), which names no field.
//! A settled emergency reservation's record takes 344 bytes this way,
//! against 739 with the field names: bytes every commit encoded and
//! wrote, and every fold copied into the table again.
//!
//! What a record carries only sometimes — the central ledger's receipts,
//! a rejection, the operation still owed to the central ledger, the legs
//! of a multi-leg reservation — keeps its own form (MessagePack with
//! names, in a byte string): those types skip empty fields, which a
//! positional form cannot hold.
//!
//! Fields are only ever appended, with `#[serde(default)]`: a field
//! removed or moved would misread every record stored before. Records
//! written with names before this form are still read
//! (`record_log::value::decode`).

use std::borrow::Cow;
use std::num::NonZeroU64;

use agent_core::{
    AgentReservation, AgentState, JournalRecord, NonMaxU64, ReservationPath, ShardHold,
};
use ledger::LocalReservation;
use record_log::value::{self, ByteArray, DecodeError, Named};
use serde::{Deserialize, Serialize};
use shard_format::{
    Digest, IdempotencyKey, OperationId, ReservationId, ReservationState, Route, ShardId, Subject,
};

/// An [`AgentReservation`] and its holds, field by field in this order.
/// Borrowed to encode (a commit encodes every record it writes), owned
/// when decoded.
#[derive(Serialize, Deserialize)]
struct CompactReservation<'a> {
    reservation: Cow<'a, ReservationId>,
    idempotency_key: Cow<'a, IdempotencyKey>,
    subject: Cow<'a, Subject>,
    route: Cow<'a, Route>,
    units: u64,
    // One word each in the record; the same integers here.
    min_units: Option<NonMaxU64>,
    reserved_units: Option<NonMaxU64>,
    request_digest: ByteArray<32>,
    priority: u8,
    deadline_ms: Option<NonZeroU64>,
    /// The emergency shard the units come from; `None`: the central ledger.
    shard: Option<Cow<'a, ShardId>>,
    state: AgentState,
    operation_id: Option<Cow<'a, OperationId>>,
    actual_units: Option<NonMaxU64>,
    receipt: Option<Named>,
    settlement: Option<Named>,
    rejection: Option<Named>,
    sync: Option<Named>,
    cancel_requested: bool,
    shadow: bool,
    boot_epoch: u64,
    ended_at: Option<NonMaxU64>,
    /// `None` for one leg.
    legs: Option<Named>,
    holds: Vec<CompactHold<'a>>,
}

/// A [`ShardHold`], field by field.
#[derive(Serialize, Deserialize)]
struct CompactHold<'a> {
    shard: Cow<'a, ShardId>,
    reservation: Cow<'a, ReservationId>,
    units: u64,
    state: ReservationState,
    operation_id: Option<Cow<'a, OperationId>>,
    expires_at_ms: u64,
    actual_units: Option<u64>,
    overdraft_units: u64,
}

/// A reservation's record with its holds, as the journal stores it.
pub(super) fn encode(record: &AgentReservation, holds: &[ShardHold]) -> Vec<u8> {
    // Every field named, no `..`: a field added to the record fails to
    // compile here until the compact form has it too.
    let AgentReservation {
        reservation,
        idempotency_key,
        subject,
        route,
        units,
        min_units,
        reserved_units,
        request_digest,
        priority,
        deadline_ms,
        path,
        state,
        operation_id,
        actual_units,
        receipt,
        settlement,
        rejection,
        sync,
        cancel_requested,
        shadow,
        boot_epoch,
        ended_at,
        legs,
        // Journaled as the holds beside the record, which recovery puts
        // back into it.
        hold_state: _,
        hold_expires_at_ms: _,
        hold_overdraft_units: _,
    } = record;
    let compact = CompactReservation {
        reservation: Cow::Borrowed(reservation),
        idempotency_key: Cow::Borrowed(idempotency_key),
        subject: Cow::Borrowed(subject),
        route: Cow::Borrowed(route),
        units: *units,
        min_units: *min_units,
        reserved_units: *reserved_units,
        request_digest: ByteArray(request_digest.0),
        priority: *priority,
        deadline_ms: *deadline_ms,
        shard: match path {
            ReservationPath::Central => None,
            ReservationPath::Shard(shard) => Some(Cow::Borrowed(shard)),
        },
        state: *state,
        operation_id: operation_id.as_ref().map(Cow::Borrowed),
        actual_units: *actual_units,
        receipt: receipt.as_deref().map(Named::of),
        settlement: settlement.as_deref().map(Named::of),
        rejection: rejection.as_deref().map(Named::of),
        sync: sync.as_ref().map(Named::of),
        cancel_requested: *cancel_requested,
        shadow: *shadow,
        boot_epoch: *boot_epoch,
        ended_at: *ended_at,
        legs: (!legs.is_empty()).then(|| Named::of(legs)),
        holds: holds.iter().map(CompactHold::of).collect(),
    };
    value::encode_positional(&compact)
}

/// Reads a record [`encode`] wrote.
pub(super) fn decode(bytes: &[u8]) -> Result<JournalRecord, DecodeError> {
    let compact: CompactReservation = value::decode_positional(bytes)?;
    let record = AgentReservation {
        reservation: compact.reservation.into_owned(),
        idempotency_key: compact.idempotency_key.into_owned(),
        subject: compact.subject.into_owned(),
        route: compact.route.into_owned(),
        units: compact.units,
        min_units: compact.min_units,
        reserved_units: compact.reserved_units,
        request_digest: Digest(compact.request_digest.0),
        priority: compact.priority,
        deadline_ms: compact.deadline_ms,
        path: compact.shard.map_or(ReservationPath::Central, |shard| {
            ReservationPath::Shard(shard.into_owned())
        }),
        state: compact.state,
        operation_id: compact.operation_id.map(Cow::into_owned),
        actual_units: compact.actual_units,
        receipt: compact.receipt.map(Named::read).transpose()?,
        settlement: compact.settlement.map(Named::read).transpose()?,
        rejection: compact.rejection.map(Named::read).transpose()?,
        sync: compact.sync.map(Named::read).transpose()?,
        cancel_requested: compact.cancel_requested,
        shadow: compact.shadow,
        boot_epoch: compact.boot_epoch,
        ended_at: compact.ended_at,
        legs: compact
            .legs
            .map(Named::read)
            .transpose()?
            .unwrap_or_default(),
        hold_state: None,
        hold_expires_at_ms: 0,
        hold_overdraft_units: 0,
    };
    Ok(JournalRecord::ReservationWithHolds {
        record: Box::new(record),
        holds: compact.holds.into_iter().map(CompactHold::hold).collect(),
    })
}

impl<'a> CompactHold<'a> {
    fn of(hold: &'a ShardHold) -> Self {
        let ShardHold { shard, local } = hold;
        let LocalReservation {
            reservation,
            units,
            state,
            operation_id,
            expires_at_ms,
            actual_units,
            overdraft_units,
        } = local;
        Self {
            shard: Cow::Borrowed(shard),
            reservation: Cow::Borrowed(reservation),
            units: *units,
            state: *state,
            operation_id: operation_id.as_ref().map(Cow::Borrowed),
            expires_at_ms: *expires_at_ms,
            actual_units: *actual_units,
            overdraft_units: *overdraft_units,
        }
    }

    fn hold(self) -> ShardHold {
        ShardHold {
            shard: self.shard.into_owned(),
            local: LocalReservation {
                reservation: self.reservation.into_owned(),
                units: self.units,
                state: self.state,
                operation_id: self.operation_id.map(Cow::into_owned),
                expires_at_ms: self.expires_at_ms,
                actual_units: self.actual_units,
                overdraft_units: self.overdraft_units,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use std::num::NonZeroU64;

    use agent_core::{
        AgentLeg, AgentReservation, AgentState, JournalRecord, ReservationPath, ShardHold, SyncOp,
        one_word,
    };
    use ledger::{LocalReservation, Rejection};
    use shard_format::{
        Digest, IdempotencyKey, OperationId, ReservationId, ReservationState, Route, ShardId,
        Subject,
    };

    use super::{decode, encode};

    fn id<T: std::str::FromStr<Err: std::fmt::Debug>>(text: &str) -> T {
        text.parse().expect("a valid value")
    }

    /// As the emergency path journals a settled reservation.
    fn emergency() -> (AgentReservation, Vec<ShardHold>) {
        let reservation: ReservationId = id("rl-b3e343d8a6e5e764063701f3ad1f84e2");
        let shard: ShardId = id("es-e3768a09844694a61639b0d861bf9a2a");
        let operation: OperationId = id("op-eb7eb47a1237-e128-10-124");
        let record = AgentReservation {
            reservation: reservation.clone(),
            idempotency_key: id::<IdempotencyKey>("eb7eb47a1237-e128-10-124"),
            subject: id::<Subject>("tenant-bench"),
            route: id::<Route>("bench.generate"),
            units: 1,
            min_units: None,
            reserved_units: Some(one_word(1)),
            request_digest: Digest::sha256(b"request"),
            priority: 0,
            deadline_ms: None,
            path: ReservationPath::Shard(shard.clone()),
            state: AgentState::Settled,
            operation_id: Some(operation.clone()),
            actual_units: Some(one_word(1)),
            receipt: None,
            settlement: None,
            rejection: None,
            sync: None,
            cancel_requested: false,
            shadow: false,
            boot_epoch: 1,
            ended_at: Some(one_word(1_796_407_516_969)),
            legs: Default::default(),
            hold_state: None,
            hold_expires_at_ms: 0,
            hold_overdraft_units: 0,
        };
        let hold = ShardHold {
            shard,
            local: LocalReservation {
                reservation,
                units: 1,
                state: ReservationState::Settled,
                operation_id: Some(operation),
                expires_at_ms: 3_611_214,
                actual_units: Some(1),
                overdraft_units: 0,
            },
        };
        (record, vec![hold])
    }

    /// A central-path record with every field that can be empty filled.
    fn central_with_everything() -> (AgentReservation, Vec<ShardHold>) {
        let vector = |name: &str| {
            let path = format!(
                "{}/../shard-format/tests/vectors/{name}.canonical.json",
                env!("CARGO_MANIFEST_DIR")
            );
            std::fs::read(path).expect("the test vector")
        };
        let receipt = serde_json::from_slice(&vector("limitReservation.v1-legs")).expect("receipt");
        let settlement =
            serde_json::from_slice(&vector("settlementReceipt.v1-legs")).expect("settlement");
        let rejection: Rejection = serde_json::from_value(serde_json::json!({
            "dimension": "debt",
            "policyGeneration": 3,
            "retryAfterSeconds": 7,
            "rateLimit": {"quota": 100, "remaining": 0, "windowSeconds": 60},
        }))
        .expect("rejection");
        let (mut record, _) = emergency();
        record.path = ReservationPath::Central;
        record.min_units = Some(one_word(500));
        record.reserved_units = Some(one_word(1500));
        record.units = 4000;
        record.priority = 9;
        record.deadline_ms = NonZeroU64::new(30_000);
        record.state = AgentState::SettledWithDebt;
        record.receipt = Some(Box::new(receipt));
        record.settlement = Some(Box::new(settlement));
        record.rejection = Some(Box::new(rejection));
        record.sync = Some(SyncOp::Settle);
        record.cancel_requested = true;
        record.shadow = true;
        record.boot_epoch = u64::MAX;
        record.legs = [
            AgentLeg {
                subject: id("tenant-7"),
                route: id("gpt-4o.tokens"),
                units: 4000,
                min_units: Some(one_word(500)),
                reserved_units: Some(one_word(1500)),
                actual_units: Some(one_word(1700)),
                shard: Some(id("es-1")),
                hold_state: None,
                hold_expires_at_ms: 0,
                hold_overdraft_units: 0,
            },
            AgentLeg {
                subject: id("tenant-7"),
                route: id("gpt-4o.requests"),
                units: 1,
                min_units: None,
                reserved_units: None,
                actual_units: None,
                shard: None,
                hold_state: None,
                hold_expires_at_ms: 0,
                hold_overdraft_units: 0,
            },
        ]
        .into_iter()
        .collect();
        (record, Vec::new())
    }

    fn round_trip(record: AgentReservation, holds: Vec<ShardHold>) {
        let bytes = encode(&record, &holds);
        let expected = JournalRecord::ReservationWithHolds {
            record: Box::new(record),
            holds,
        };
        assert_eq!(decode(&bytes).expect("decodes"), expected);
    }

    #[test]
    fn records_round_trip_through_the_compact_form() {
        let (record, holds) = emergency();
        round_trip(record, holds);
        let (record, holds) = central_with_everything();
        round_trip(record, holds);
        let (mut record, mut holds) = emergency();
        record.state = AgentState::Reserved;
        record.operation_id = None;
        record.actual_units = None;
        record.ended_at = None;
        holds[0].local.state = ReservationState::Reserved;
        holds[0].local.operation_id = None;
        holds[0].local.actual_units = None;
        holds.push(ShardHold {
            shard: id("es-2"),
            local: LocalReservation {
                reservation: id("rl-leg-2"),
                overdraft_units: 5,
                ..holds[0].local.clone()
            },
        });
        round_trip(record, holds);
    }

    #[test]
    fn the_compact_form_is_less_than_half_the_named_one() {
        let (record, holds) = emergency();
        let compact = encode(&record, &holds);
        let named = record_log::value::encode(&JournalRecord::ReservationWithHolds {
            record: Box::new(record),
            holds,
        });
        assert!(
            compact.len() * 2 < named.len(),
            "compact {} bytes, named {}",
            compact.len(),
            named.len()
        );
    }

    #[test]
    fn a_digest_of_another_length_is_refused_by_name() {
        let (record, holds) = emergency();
        let bytes = encode(&record, &holds);
        // The digest as stored: a byte string (bin 8) of 32 bytes.
        let mut stored = vec![0xc4, 32];
        stored.extend_from_slice(&record.request_digest.0);
        let at = bytes
            .windows(stored.len())
            .position(|window| window == stored)
            .expect("the digest's bytes");
        let mut short = bytes[..at].to_vec();
        short.extend_from_slice(&[0xc4, 31]);
        short.extend_from_slice(&bytes[at + 2..at + 33]);
        short.extend_from_slice(&bytes[at + 34..]);
        let error = decode(&short).expect_err("31 bytes are no digest");
        assert!(
            error
                .to_string()
                .contains("invalid length 31, expected a byte string of 32 bytes"),
            "{error}"
        );
    }

    #[test]
    fn a_damaged_compact_record_is_an_error_not_a_panic() {
        let (record, holds) = central_with_everything();
        let bytes = encode(&record, &holds);
        for cut in 0..bytes.len() {
            assert!(decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
    }
}
