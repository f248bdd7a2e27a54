//! The central ledger as the simulator and in-process tests run it: the real
//! [`CentralLedger`] over a [`MemoryStore`] that commits every transition
//! before its reply, with the same replies the HTTP service gives agents.

use agent_core::{CentralCall, CentralReply};
use ledger::store::{LedgerStore, MemoryStore};
use ledger::{
    AbandonOutcome, CentralConfig, CentralLedger, IssueShardOutcome, IssueShardRequest,
    ReconcileOutcome, RegisterOutcome, ReleaseOutcome, ReserveOutcome, SettleOutcome, StartOutcome,
    Transition,
};
use shard_format::{
    BootNonce, DocumentSigner, DocumentVerifier, GatewayIdentity, ShardId, Timestamp,
};

/// What the central node did with a call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Delivery {
    /// Committed and answered.
    Answered(CentralReply),
    /// The commit failed: the node rebuilt itself from its store and the
    /// caller gets no answer (as if the process crashed).
    Crashed,
}

/// What the simulator's auditor learns from a handled call, beyond the reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Observation {
    /// A new reservation was made (not a duplicate).
    Reserved(shard_format::ReservationId),
    /// A start lost against expiry.
    StartExpired,
    /// A settlement with actual above reserved.
    Overage,
    /// A terminal receipt was reconciled for the first time.
    Reconciled(ShardId),
    /// A terminal receipt came again and re-minted nothing.
    ReconcileDuplicate,
}

/// The real central ledger over an in-memory store.
pub struct CentralNode {
    pub ledger: CentralLedger,
    pub store: MemoryStore,
    /// What handled calls did, for the simulator (drained by it).
    pub observations: Vec<Observation>,
    /// Records committed so far: a change here means state changed.
    pub records_committed: u64,
    signer: Box<dyn DocumentSigner + Send>,
    verifier: Box<dyn DocumentVerifier + Send>,
    next_shard: u64,
}

impl std::fmt::Debug for CentralNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CentralNode")
            .field("records", &self.store.len())
            .finish_non_exhaustive()
    }
}

impl CentralNode {
    pub fn new(
        signer: Box<dyn DocumentSigner + Send>,
        verifier: Box<dyn DocumentVerifier + Send>,
    ) -> Self {
        Self {
            ledger: CentralLedger::new(CentralConfig::default()),
            store: MemoryStore::new(),
            observations: Vec::new(),
            records_committed: 0,
            signer,
            verifier,
            next_shard: 1,
        }
    }

    /// Commits a transition, or crashes (rebuilds from the store) if the
    /// commit fails.
    pub fn commit<O>(&mut self, transition: Transition<O>) -> Option<O> {
        match self.store.commit(&transition.changes) {
            Ok(()) => {
                self.records_committed += transition.changes.len() as u64;
                Some(transition.outcome)
            }
            Err(_) => {
                self.restart();
                None
            }
        }
    }

    /// Drops the in-memory ledger and rebuilds it from what was committed.
    pub fn restart(&mut self) {
        let records = self.store.load_all().expect("memory store loads");
        self.ledger = CentralLedger::from_records(CentralConfig::default(), records)
            .expect("committed records are consistent");
    }

    /// Handles one agent call from `identity`. `nonce` is the randomness the
    /// service would draw for a registration.
    pub fn handle(
        &mut self,
        identity: &GatewayIdentity,
        call: &CentralCall,
        nonce: BootNonce,
        now: Timestamp,
    ) -> Delivery {
        let reply = match call {
            CentralCall::Register => {
                let transition = self.ledger.register_gateway(identity, nonce);
                let Some(outcome) = self.commit(transition) else {
                    return Delivery::Crashed;
                };
                match outcome {
                    RegisterOutcome::Registered {
                        boot_epoch,
                        boot_nonce,
                    } => CentralReply::Registered {
                        boot_epoch,
                        boot_nonce,
                    },
                    RegisterOutcome::UnknownGateway => refused("unknown_gateway"),
                    RegisterOutcome::Overflow(_) => refused("overflow"),
                }
            }
            CentralCall::Reserve(request) => {
                let transition = self.ledger.reserve(request.clone(), now);
                let Some(outcome) = self.commit(transition) else {
                    return Delivery::Crashed;
                };
                if let ReserveOutcome::Reserved(receipt) = &outcome {
                    self.observations
                        .push(Observation::Reserved(receipt.reservation.clone()));
                }
                reserve_reply(outcome)
            }
            CentralCall::Start {
                reservation,
                operation_id,
                deadline_ms,
            } => {
                let transition =
                    self.ledger
                        .start(reservation, operation_id.clone(), *deadline_ms, now);
                let Some(outcome) = self.commit(transition) else {
                    return Delivery::Crashed;
                };
                match outcome {
                    StartOutcome::Started(receipt)
                    | StartOutcome::Duplicate(receipt)
                    | StartOutcome::Expired(receipt) => {
                        CentralReply::Reservation(Box::new(receipt))
                    }
                    StartOutcome::NotFound => refused("not_found"),
                    StartOutcome::OperationConflict { .. } => refused("operation_conflict"),
                    StartOutcome::IllegalState(_) => refused("illegal_transition"),
                }
            }
            CentralCall::Settle {
                reservation,
                operation_id,
                actual_units,
            } => {
                let transition = self
                    .ledger
                    .settle(reservation, operation_id, *actual_units, now);
                let Some(outcome) = self.commit(transition) else {
                    return Delivery::Crashed;
                };
                if let SettleOutcome::Settled(receipt) | SettleOutcome::Corrected(receipt) =
                    &outcome
                    && receipt.actual_units > receipt.reserved_units
                {
                    self.observations.push(Observation::Overage);
                }
                match outcome {
                    SettleOutcome::Settled(receipt)
                    | SettleOutcome::Duplicate(receipt)
                    | SettleOutcome::Corrected(receipt) => CentralReply::Settled(Box::new(receipt)),
                    SettleOutcome::NotFound => refused("not_found"),
                    SettleOutcome::OperationConflict { .. } => refused("operation_conflict"),
                    SettleOutcome::SettlementConflict(_) => refused("settlement_conflict"),
                    SettleOutcome::NotStarted(_) | SettleOutcome::IllegalState(_) => {
                        refused("illegal_transition")
                    }
                    SettleOutcome::Overflow(_) => refused("overflow"),
                }
            }
            CentralCall::Release { reservation } => {
                let transition = self.ledger.release(reservation);
                let Some(outcome) = self.commit(transition) else {
                    return Delivery::Crashed;
                };
                match outcome {
                    ReleaseOutcome::Released(receipt) | ReleaseOutcome::Duplicate(receipt) => {
                        CentralReply::Reservation(Box::new(receipt))
                    }
                    ReleaseOutcome::NotFound => refused("not_found"),
                    ReleaseOutcome::IllegalState(_) => refused("illegal_transition"),
                    ReleaseOutcome::Overflow(_) => refused("overflow"),
                }
            }
            CentralCall::Abandon { reservation } => {
                let transition = self.ledger.abandon(reservation, now);
                let Some(outcome) = self.commit(transition) else {
                    return Delivery::Crashed;
                };
                match outcome {
                    AbandonOutcome::Tombstoned | AbandonOutcome::Duplicate => {
                        CentralReply::Tombstoned
                    }
                    AbandonOutcome::Abandoned(receipt) | AbandonOutcome::IllegalState(receipt) => {
                        CentralReply::Reservation(Box::new(receipt))
                    }
                    AbandonOutcome::Overflow(_) => refused("overflow"),
                }
            }
            CentralCall::IssueShard {
                subject,
                route,
                boot_epoch,
                boot_nonce,
            } => {
                let shard = ShardId::new(format!("sh-{}", self.next_shard)).expect("valid");
                self.next_shard += 1;
                let request = IssueShardRequest {
                    identity: identity.clone(),
                    boot_epoch: *boot_epoch,
                    boot_nonce: *boot_nonce,
                    subject: subject.clone(),
                    route: route.clone(),
                    shard,
                };
                let transition = self.ledger.issue_shard(request, self.signer.as_ref(), now);
                let Some(outcome) = self.commit(transition) else {
                    return Delivery::Crashed;
                };
                match outcome {
                    IssueShardOutcome::Issued(shard) | IssueShardOutcome::Duplicate(shard) => {
                        CentralReply::Shard(shard)
                    }
                    IssueShardOutcome::Rejected(rejection) => CentralReply::Rejected(rejection),
                    IssueShardOutcome::UnknownGateway => refused("unknown_gateway"),
                    IssueShardOutcome::SupersededBoot { .. } => refused("superseded_boot"),
                    IssueShardOutcome::NoPolicy => refused("no_policy"),
                    IssueShardOutcome::EmergencyDisabled => refused("emergency_disabled"),
                    IssueShardOutcome::TooManyOpenShards => refused("too_many_open_shards"),
                    IssueShardOutcome::ShardIdTaken => refused("shard_id_taken"),
                    IssueShardOutcome::Overflow(_) => refused("overflow"),
                }
            }
            CentralCall::UploadReceipt(receipt) => {
                if receipt.gateway_identity != *identity {
                    return Delivery::Answered(refused("wrong_identity"));
                }
                let transition = self
                    .ledger
                    .reconcile_shard(receipt, identity, self.verifier.as_ref(), now);
                let Some(outcome) = self.commit(transition) else {
                    return Delivery::Crashed;
                };
                match &outcome {
                    ReconcileOutcome::Reconciled(_) => self
                        .observations
                        .push(Observation::Reconciled(receipt.shard.clone())),
                    ReconcileOutcome::Duplicate(_) => {
                        self.observations.push(Observation::ReconcileDuplicate);
                    }
                    _ => {}
                }
                match outcome {
                    ReconcileOutcome::Reconciled(done) | ReconcileOutcome::Duplicate(done) => {
                        CentralReply::ReceiptAccepted(Box::new(done))
                    }
                    ReconcileOutcome::UnknownShard => refused("unknown_shard"),
                    ReconcileOutcome::WrongIdentity => refused("wrong_identity"),
                    ReconcileOutcome::BadSignature(_) => refused("bad_signature"),
                    ReconcileOutcome::Mismatch(_) => refused("receipt_mismatch"),
                    ReconcileOutcome::Overflow(_) => refused("overflow"),
                }
            }
            CentralCall::Get { reservation } => match self.ledger.reservation(reservation) {
                Some(record) => CentralReply::Reservation(Box::new(record.receipt.clone())),
                None => refused("not_found"),
            },
            CentralCall::Health => CentralReply::Healthy,
        };
        Delivery::Answered(reply)
    }

    /// One round of the central workers at `now`: expiry (both halves),
    /// usage deadlines and refills. Returns false if a commit crashed.
    pub fn run_workers(&mut self, now: Timestamp) -> bool {
        let expiry = self.ledger.begin_expiry(now);
        if self.commit(expiry).is_none() {
            return false;
        }
        let expiry = self.ledger.complete_expiry();
        if self.commit(expiry).is_none() {
            return false;
        }
        let usage = self.ledger.handle_usage_deadlines(now);
        if self.commit(usage).is_none() {
            return false;
        }
        let refill = self.ledger.handle_refill(now);
        self.commit(refill).is_some()
    }
}

fn refused(code: &str) -> CentralReply {
    CentralReply::Refused {
        code: code.to_owned(),
        message: code.replace('_', " "),
    }
}

fn reserve_reply(outcome: ReserveOutcome) -> CentralReply {
    match outcome {
        ReserveOutcome::Reserved(receipt)
        | ReserveOutcome::Duplicate(receipt)
        | ReserveOutcome::Shadow { receipt, .. } => CentralReply::Reservation(Box::new(receipt)),
        ReserveOutcome::Rejected(rejection) => CentralReply::Rejected(rejection),
        ReserveOutcome::NotEnforced => refused("not_enforced"),
        ReserveOutcome::IdempotencyConflict { .. } => refused("idempotency_conflict"),
        ReserveOutcome::Abandoned => refused("abandoned"),
        ReserveOutcome::NoPolicy => refused("no_policy"),
        ReserveOutcome::InvalidUnits => refused("invalid_units"),
        ReserveOutcome::Overflow(_) => refused("overflow"),
    }
}
