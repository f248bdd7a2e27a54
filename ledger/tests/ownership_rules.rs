//! Ownership (docs/design.md §3.11): a reservation belongs to the identity
//! that reserved it; only it acts on the reservation, the operator may read
//! and abandon any, and reservation IDs live in a per-identity namespace
//! (`ReservationId::derive`). Every call goes through
//! `ledger::protocol::apply`, the one entry the service and the simulator
//! use, inside `support::Harness` (audit after each step, a refusal changes
//! nothing, rebuild from the committed changes).

mod support;

use ledger::protocol::{Context, Operation, Reply, apply};
use ledger::{
    AbandonOutcome, AbandonRequest, Caller, Change, ReleaseOutcome, ReservationOrigin,
    ReserveOutcome, ReserveRequest, SettleOutcome, StartOutcome, Transition,
};
use shard_format::{Digest, GatewayIdentity, ReservationId, ReservationState};
use support::{
    Harness, central_signer, gateway_signer, identity, key, op, origin, other_gateway_signer,
    owner, policy, request, rid, route, subject, verifier,
};

/// Gateway `g-b`: enrolled like `g-a`, with its own key.
fn other() -> GatewayIdentity {
    identity(&other_gateway_signer())
}

fn call(h: &mut Harness, operation: Operation) -> Reply {
    let signer = central_signer();
    let gateways = verifier(&[&gateway_signer(), &other_gateway_signer()]);
    h.run(|ledger, now| {
        let context = Context {
            signer: &signer,
            gateway_verifier: &gateways,
        };
        let (outcome, changes) = apply(ledger, operation, now, context);
        Transition { outcome, changes }
    })
}

fn start(id: &str, caller: GatewayIdentity) -> Operation {
    Operation::Start {
        reservation: rid(id),
        operation_id: op("op-1"),
        deadline_ms: None,
        caller,
    }
}

fn settle(id: &str, actual_units: u64, caller: GatewayIdentity) -> Operation {
    Operation::Settle {
        reservation: rid(id),
        operation_id: op("op-1"),
        actuals: ledger::SettleActuals::One(actual_units),
        caller,
    }
}

fn get(id: &str, caller: Caller) -> Operation {
    Operation::GetReservation {
        reservation: rid(id),
        caller,
    }
}

fn abandon(id: &str, caller: Caller, origin: Option<ReservationOrigin>) -> Operation {
    Operation::Abandon(AbandonRequest {
        reservation: rid(id),
        caller,
        origin,
    })
}

fn not_owner(reply: &Reply) -> bool {
    matches!(reply, Reply::NotOwner { .. })
}

/// `g-a` holds `rl-1` (600 of 1000).
fn held() -> Harness {
    let mut h = Harness::with_policy(policy(1));
    let reply = call(
        &mut h,
        Operation::Reserve(request("rl-1", 600, "a's request")),
    );
    assert!(
        matches!(reply, Reply::Reserve(ReserveOutcome::Reserved(_))),
        "{reply:?}"
    );
    h
}

#[test]
fn another_identity_cannot_read_or_act_on_a_reservation() {
    let mut h = held();
    let b = other();
    for operation in [
        get("rl-1", Caller::Gateway(b.clone())),
        start("rl-1", b.clone()),
        settle("rl-1", 0, b.clone()),
        Operation::Release {
            reservation: rid("rl-1"),
            caller: b.clone(),
        },
        abandon("rl-1", Caller::Gateway(b.clone()), Some(origin("rl-1"))),
        abandon("rl-1", Caller::Gateway(b.clone()), None),
    ] {
        let name = operation.name();
        let reply = call(&mut h, operation);
        assert!(
            not_owner(&reply) || reply == Reply::Abandon(AbandonOutcome::NotOwner),
            "{name} by g-b: {reply:?}"
        );
    }
    h.assert_account(&h.account(1), "1000 + 0 + 0 = 400 + 600 + 0 + 0 + 0");
    // The owner goes on as if nothing happened.
    let reply = call(&mut h, start("rl-1", owner()));
    assert!(
        matches!(reply, Reply::Start(StartOutcome::Started(_))),
        "{reply:?}"
    );
    // A settle by g-b, started or not, moves nothing: not a refund (0) and
    // not a debt (100 000).
    for actual in [0, 100_000] {
        let reply = call(&mut h, settle("rl-1", actual, other()));
        assert!(not_owner(&reply), "{reply:?}");
    }
    let reply = call(&mut h, settle("rl-1", 200, owner()));
    assert!(
        matches!(reply, Reply::Settle(SettleOutcome::Settled(_))),
        "{reply:?}"
    );
    // Still unseen by g-b once terminal.
    let reply = call(&mut h, get("rl-1", Caller::Gateway(other())));
    assert!(not_owner(&reply), "{reply:?}");
    let reply = call(&mut h, get("rl-1", Caller::Gateway(owner())));
    assert!(
        matches!(&reply, Reply::Reservation { receipt: Some(r), .. } if r.state == ReservationState::Settled),
        "{reply:?}"
    );
}

#[test]
fn a_reserve_names_only_an_id_of_the_callers_own_namespace() {
    let mut h = Harness::with_policy(policy(1));
    // g-b names the ID g-a will derive for its key: refused, nothing held.
    let squat = ReserveRequest {
        owner: other(),
        ..request("rl-1", 600, "a's request")
    };
    let reply = call(&mut h, Operation::Reserve(squat));
    assert_eq!(reply, Reply::Reserve(ReserveOutcome::ForeignId));
    // The same key from g-b is another reservation.
    let own = ReserveRequest::new(
        other(),
        key("rl-1"),
        subject("tenant-7"),
        route("chat.generate"),
        100,
        Digest::sha256(b"b's request"),
    );
    assert_ne!(own.reservation, rid("rl-1"));
    let reply = call(&mut h, Operation::Reserve(own));
    assert!(
        matches!(reply, Reply::Reserve(ReserveOutcome::Reserved(_))),
        "{reply:?}"
    );
    // One character off the derived ID is foreign too.
    let derived = rid("rl-2").to_string();
    let mut off = derived.clone().into_bytes();
    let last = off.len() - 1;
    off[last] = if off[last] == b'0' { b'1' } else { b'0' };
    let mut request = request("rl-2", 10, "a's second");
    request.reservation =
        ReservationId::new(String::from_utf8(off).expect("ascii")).expect("valid");
    let reply = call(&mut h, Operation::Reserve(request));
    assert_eq!(reply, Reply::Reserve(ReserveOutcome::ForeignId));
    // And g-a's own reserve of its key is untouched by all of it.
    let reply = call(&mut h, Operation::Reserve(request_fresh("rl-1")));
    assert!(
        matches!(reply, Reply::Reserve(ReserveOutcome::Reserved(_))),
        "{reply:?}"
    );
}

fn request_fresh(name: &str) -> ReserveRequest {
    request(name, 600, "a's request")
}

#[test]
fn only_the_owner_tombstones_an_id_before_it_exists() {
    let mut h = Harness::with_policy(policy(1));
    // g-b cannot tombstone g-a's future ID, with g-a's origin or without.
    for origin in [Some(origin("rl-1")), None] {
        let reply = call(&mut h, abandon("rl-1", Caller::Gateway(other()), origin));
        assert_eq!(reply, Reply::Abandon(AbandonOutcome::NotOwner));
    }
    assert!(h.ledger.tombstone(&rid("rl-1")).is_none());
    // Without its origin even g-a cannot (nothing shows the ID is its own).
    let reply = call(&mut h, abandon("rl-1", Caller::Gateway(owner()), None));
    assert_eq!(reply, Reply::Abandon(AbandonOutcome::NotOwner));
    let reply = call(&mut h, Operation::Reserve(request_fresh("rl-1")));
    assert!(
        matches!(reply, Reply::Reserve(ReserveOutcome::Reserved(_))),
        "{reply:?}"
    );
    // g-a's own unknown ID: tombstoned, owned, unseen by g-b.
    let reply = call(
        &mut h,
        abandon("rl-2", Caller::Gateway(owner()), Some(origin("rl-2"))),
    );
    assert_eq!(reply, Reply::Abandon(AbandonOutcome::Tombstoned));
    assert_eq!(
        h.ledger
            .tombstone(&rid("rl-2"))
            .and_then(|t| t.owner.clone()),
        Some(owner())
    );
    let reply = call(&mut h, get("rl-2", Caller::Gateway(other())));
    assert!(not_owner(&reply), "{reply:?}");
    let reply = call(&mut h, get("rl-2", Caller::Gateway(owner())));
    assert_eq!(
        reply,
        Reply::Reservation {
            receipt: None,
            tombstoned: true
        }
    );
}

#[test]
fn the_operator_reads_and_abandons_any_reservation() {
    let mut h = held();
    let reply = call(&mut h, get("rl-1", Caller::Operator));
    assert!(
        matches!(
            &reply,
            Reply::Reservation {
                receipt: Some(_),
                ..
            }
        ),
        "{reply:?}"
    );
    let reply = call(&mut h, abandon("rl-1", Caller::Operator, None));
    assert!(
        matches!(&reply, Reply::Abandon(AbandonOutcome::Abandoned(r)) if r.state == ReservationState::Abandoned),
        "{reply:?}"
    );
    h.assert_account(&h.account(1), "1000 + 0 + 0 = 1000 + 0 + 0 + 0 + 0");
    // An ID that names nothing: the operator lays no tombstone.
    let reply = call(&mut h, abandon("rl-9", Caller::Operator, None));
    assert_eq!(reply, Reply::Abandon(AbandonOutcome::NotFound));
    assert!(h.ledger.tombstone(&rid("rl-9")).is_none());
}

/// Records written before reservations had owners (`owner` absent) act as
/// before for any identity until the retention window forgets them.
#[test]
fn a_record_without_an_owner_is_anyones_until_it_ages_out() {
    let records = held()
        .records()
        .into_iter()
        .map(|change| match change {
            Change::Reservation(mut record) => {
                record.owner = None;
                Change::Reservation(record)
            }
            other => other,
        })
        .collect();
    let mut h = Harness::from_records(records);
    let reply = call(&mut h, start("rl-1", other()));
    assert!(
        matches!(reply, Reply::Start(StartOutcome::Started(_))),
        "{reply:?}"
    );
    let reply = call(
        &mut h,
        Operation::Release {
            reservation: rid("rl-1"),
            caller: owner(),
        },
    );
    assert!(
        matches!(reply, Reply::Release(ReleaseOutcome::IllegalState(_))),
        "{reply:?}"
    );
}
