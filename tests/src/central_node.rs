//! The central ledger as the simulator and in-process tests run it: the real
//! [`CentralLedger`] over a [`MemoryStore`], driven by the same
//! [`ledger::protocol::apply`] as the central service, committing every
//! transition before its reply. Only the transport differs: answers reach
//! the agent core in their wire form without HTTP in between.
//!
//! Every committed operation also goes to the exact oracle: the independent
//! reference model of the accounting (`ledger-reference`), which predicts
//! the reply and every record the transition writes; any difference is an
//! [`Observation::ReferenceMismatch`].

use agent_core::{CentralCall, CentralReply};
use ledger::protocol::{About, Context, Operation, Reply, apply};
use ledger::store::{LedgerStore, MemoryStore};
use ledger::{
    AbandonRequest, Caller, CentralConfig, CentralLedger, Change, IssueShardRequest,
    ReconcileOutcome, RecordKey, ReserveOutcome, ReserveRequest, SettleOutcome,
};
use ledger_reference::ReferenceLedger;
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
    /// A settlement with actual above reserved.
    Overage,
    /// A terminal receipt was reconciled for the first time.
    Reconciled(ShardId),
    /// A terminal receipt came again and re-minted nothing.
    ReconcileDuplicate,
    /// A transition forgot a record that, just before it, was live or
    /// still inside its retention window (what and why).
    ForgottenLiveRecord(String),
    /// The retention sweep forgot this many records.
    Forgotten(usize),
    /// The reservation under this ID was forgotten: a later reservation
    /// under it is a new request, with a history of its own.
    ForgotReservation(shard_format::ReservationId),
    /// The ledger's reply or records differ from the reference model's
    /// (what and where).
    ReferenceMismatch(String),
}

/// The real central ledger over an in-memory store.
pub struct CentralNode {
    pub ledger: CentralLedger,
    /// The ledger's settings (kept for rebuilds).
    pub config: CentralConfig,
    pub store: MemoryStore,
    /// What handled calls did, for the simulator (drained by it).
    pub observations: Vec<Observation>,
    /// Records committed so far: a change here means state changed.
    pub records_committed: u64,
    signer: Box<dyn DocumentSigner + Send>,
    verifier: Box<dyn DocumentVerifier + Send>,
    next_shard: u64,
    /// The exact oracle; `None` once it has disagreed (one mismatch is
    /// reported per run, not its consequences).
    reference: Option<ReferenceLedger>,
    /// The changes of every transition committed since the last
    /// [`CentralNode::clear_touched`], while kept (see
    /// [`CentralNode::keep_touched`]): the simulator audits what they
    /// touched. Moved here, never cloned; cleared, never reallocated.
    touched: Option<Vec<Change>>,
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
        Self::with_config(signer, verifier, CentralConfig::default())
    }

    /// A node whose ledger runs with `config` (a short retention window …).
    pub fn with_config(
        signer: Box<dyn DocumentSigner + Send>,
        verifier: Box<dyn DocumentVerifier + Send>,
        config: CentralConfig,
    ) -> Self {
        Self {
            ledger: CentralLedger::new(config),
            config,
            store: MemoryStore::new(),
            observations: Vec::new(),
            records_committed: 0,
            signer,
            verifier,
            next_shard: 1,
            reference: Some(ReferenceLedger::new(
                config,
                Timestamp::from_unix_ms(0).expect("the epoch"),
            )),
            touched: None,
        }
    }

    /// From now on, keeps the changes of committed transitions until
    /// [`CentralNode::clear_touched`] (a node nobody drains keeps none).
    pub fn keep_touched(&mut self) {
        self.touched.get_or_insert_with(Vec::new);
    }

    /// The changes committed since the last clear (empty unless kept).
    pub fn touched(&self) -> &[Change] {
        self.touched.as_deref().unwrap_or_default()
    }

    /// Forgets the kept changes (their buffer stays for the next ones).
    pub fn clear_touched(&mut self) {
        if let Some(touched) = &mut self.touched {
            touched.clear();
        }
    }

    /// Applies one operation with [`ledger::protocol::apply`] (the very
    /// function the central service's writer calls) and commits its
    /// changes, or crashes (rebuilds from the store) if the commit fails.
    pub fn operate(&mut self, operation: Operation, now: Timestamp) -> Option<Reply> {
        let context = Context {
            signer: self.signer.as_ref(),
            gateway_verifier: self.verifier.as_ref(),
        };
        let (reply, changes) = apply(&mut self.ledger, operation.clone(), now, context);
        if changes
            .iter()
            .any(|change| matches!(change, Change::Forget(_)))
        {
            self.check_forgets(&changes, now);
        }
        match self.store.commit(&changes) {
            Ok(()) => {
                self.records_committed += changes.len() as u64;
                self.check_with_reference(&operation, now, &reply, &changes);
                if let Some(touched) = &mut self.touched {
                    touched.extend(changes);
                }
                Some(reply)
            }
            Err(_) => {
                self.restart();
                None
            }
        }
    }

    /// The exact oracle, after a committed transition: the reference model
    /// applies the same operation and must predict the same reply and, for
    /// every record the transition wrote, the same record (or its absence
    /// for a forget).
    fn check_with_reference(
        &mut self,
        operation: &Operation,
        now: Timestamp,
        reply: &Reply,
        changes: &[Change],
    ) {
        let Some(reference) = &mut self.reference else {
            return;
        };
        let context = Context {
            signer: self.signer.as_ref(),
            gateway_verifier: self.verifier.as_ref(),
        };
        let Some(predicted) = reference.predict(operation, now, context) else {
            return;
        };
        let mut mismatch = (predicted != *reply).then(|| {
            format!(
                "{} at {now}: the ledger answered {reply:?}, the reference model predicts {predicted:?}",
                operation.name()
            )
        });
        for change in changes {
            if mismatch.is_some() {
                break;
            }
            let key = change.key();
            let expected = reference.record(&key);
            let agrees = match (change, &expected) {
                (Change::Forget(_), None) => true,
                (change, Some(expected)) => change == expected,
                (_, None) => false,
            };
            if !agrees {
                mismatch = Some(format!(
                    "{} at {now}: the ledger wrote {change:?}, the reference model holds {expected:?}",
                    operation.name()
                ));
            }
        }
        if let Some(detail) = mismatch {
            self.observations
                .push(Observation::ReferenceMismatch(detail));
            self.reference = None;
        }
    }

    /// The whole committed state against the reference model's, record by
    /// record (what per-transition checks cannot see: a record the ledger
    /// should have written and did not).
    pub fn check_reference_state(&mut self) {
        let Some(reference) = &self.reference else {
            return;
        };
        let committed = &self.store;
        let expected = reference.snapshot();
        let differing = committed
            .records()
            .filter(|(key, record)| expected.get(*key) != Some(*record))
            .map(|(key, _)| key)
            .chain(expected.keys().filter(|key| committed.get(key).is_none()))
            .next();
        if let Some(key) = differing {
            let detail = format!(
                "the committed state differs from the reference model's at {key:?}: the ledger holds {:?}, the model {:?}",
                committed.get(key),
                expected.get(key)
            );
            self.observations
                .push(Observation::ReferenceMismatch(detail));
            self.reference = None;
        }
    }

    /// Drops the in-memory ledger and rebuilds it from what was committed.
    pub fn restart(&mut self) {
        let records = self.store.load_all().expect("memory store loads");
        self.ledger = CentralLedger::from_records(self.config, records)
            .expect("committed records are consistent");
    }

    /// Handles one agent call from `identity` as the service does: the
    /// call as an [`Operation`] (with `nonce` and a fresh shard ID for the
    /// randomness the service would draw), applied and committed, and its
    /// answer in wire form read back by the agent core's own
    /// [`CentralReply::from_answer`].
    pub fn handle(
        &mut self,
        identity: &GatewayIdentity,
        call: &CentralCall,
        nonce: BootNonce,
        now: Timestamp,
    ) -> Delivery {
        let operation = match call {
            // The agent's request: as fresh as the daemon's (a drawn nonce,
            // the clock now), `nonce` standing for both draws.
            CentralCall::Register => Operation::Register {
                identity: identity.clone(),
                boot_nonce: nonce,
                request: ledger::BootRequest {
                    request_nonce: nonce,
                    requested_at: now,
                },
            },
            // The owner is the caller's authenticated identity, never what
            // the request says (the service takes it from the signature).
            CentralCall::Reserve(request) => Operation::Reserve(ReserveRequest {
                owner: identity.clone(),
                ..request.clone()
            }),
            CentralCall::Start {
                reservation,
                operation_id,
                deadline_ms,
            } => Operation::Start {
                reservation: reservation.clone(),
                operation_id: operation_id.clone(),
                deadline_ms: *deadline_ms,
                caller: identity.clone(),
            },
            CentralCall::Settle {
                reservation,
                operation_id,
                actuals,
            } => Operation::Settle {
                reservation: reservation.clone(),
                operation_id: operation_id.clone(),
                actuals: actuals.clone(),
                caller: identity.clone(),
            },
            CentralCall::Release { reservation } => Operation::Release {
                reservation: reservation.clone(),
                caller: identity.clone(),
            },
            CentralCall::Abandon {
                reservation,
                origin,
            } => Operation::Abandon(AbandonRequest {
                reservation: reservation.clone(),
                caller: Caller::Gateway(identity.clone()),
                origin: Some(origin.clone()),
            }),
            CentralCall::Get { reservation } => Operation::GetReservation {
                reservation: reservation.clone(),
                caller: Caller::Gateway(identity.clone()),
            },
            CentralCall::IssueShard {
                subject,
                route,
                boot_epoch,
                boot_nonce,
            } => {
                let shard = ShardId::new(format!("sh-{}", self.next_shard)).expect("valid");
                self.next_shard += 1;
                Operation::IssueShard(IssueShardRequest {
                    identity: identity.clone(),
                    boot_epoch: *boot_epoch,
                    boot_nonce: *boot_nonce,
                    subject: subject.clone(),
                    route: route.clone(),
                    shard,
                })
            }
            CentralCall::UploadReceipt(receipt) => Operation::Reconcile {
                receipt: receipt.clone(),
                caller: identity.clone(),
            },
            CentralCall::Health => return Delivery::Answered(CentralReply::Healthy),
        };
        let about = operation.about();
        let Some(reply) = self.operate(operation, now) else {
            return Delivery::Crashed;
        };
        self.observe(&reply, &about);
        Delivery::Answered(CentralReply::from_answer(reply.into_answer(&about)))
    }

    /// Every record a transition forgets, judged against the committed
    /// state just before it (the store): it must have ended, and its
    /// retention window must have passed by `now`.
    fn check_forgets(&mut self, changes: &[Change], now: Timestamp) {
        // Called before the commit: the store still holds the state before.
        let before = &self.store;
        let window = self.config.retention_ms;
        let passed = |since: Timestamp| since.unix_ms().saturating_add(window) <= now.unix_ms();
        for change in changes {
            let Change::Forget(key) = change else {
                continue;
            };
            if let RecordKey::Reservation(id) = key {
                self.observations
                    .push(Observation::ForgotReservation(id.clone()));
            }
            let problem = match before.get(key) {
                None => Some("no such record".to_owned()),
                Some(Change::Reservation(record)) => match record.retained_since() {
                    None => Some(format!("live ({:?})", record.receipt.state)),
                    Some(since) if !passed(since) => Some(format!("ended at {since}")),
                    Some(_) => None,
                },
                Some(Change::Tombstone(tombstone)) if !passed(tombstone.abandoned_at) => {
                    Some(format!("abandoned at {}", tombstone.abandoned_at))
                }
                Some(Change::Tombstone(_)) => None,
                // Reconciled, or lost and never reconciled (§5.10).
                Some(Change::Shard(record)) => match record.retained_since() {
                    None => Some("open (neither reconciled nor lost)".to_owned()),
                    Some(since) if !passed(since) => Some(format!("reconciled or lost at {since}")),
                    Some(_) => None,
                },
                // Folding a past account into its pair's closed history is
                // the ledger's own audit's to judge.
                Some(Change::Account(_)) => None,
                Some(_) => Some("never forgotten".to_owned()),
            };
            if let Some(problem) = problem {
                self.observations
                    .push(Observation::ForgottenLiveRecord(format!(
                        "central forgot {key:?} at {now} (window {window} ms): {problem}"
                    )));
            }
        }
    }

    /// What the auditor learns from a reply beyond the answer.
    fn observe(&mut self, reply: &Reply, about: &About) {
        let observation =
            match reply {
                Reply::Reserve(ReserveOutcome::Reserved(receipt)) => {
                    Observation::Reserved(receipt.reservation.clone())
                }
                Reply::Settle(
                    SettleOutcome::Settled(receipt) | SettleOutcome::Corrected(receipt),
                ) if receipt.actual_units > receipt.reserved_units => Observation::Overage,
                Reply::Reconcile(ReconcileOutcome::Reconciled(_)) => match &about.shard {
                    Some(shard) => Observation::Reconciled(shard.clone()),
                    None => return,
                },
                Reply::Reconcile(ReconcileOutcome::Duplicate(_)) => Observation::ReconcileDuplicate,
                _ => return,
            };
        self.observations.push(observation);
    }

    /// One round of the central workers at `now`: expiry (both halves),
    /// usage deadlines, refills and the retention sweep, each an operation
    /// of its own. Returns false if a commit crashed.
    pub fn run_workers(&mut self, now: Timestamp) -> bool {
        [
            Operation::BeginExpiry,
            Operation::CompleteExpiry,
            Operation::UsageDeadlines,
            Operation::Refill,
            Operation::Forget,
            Operation::MarkLostShards,
        ]
        .into_iter()
        .all(|operation| match self.operate(operation, now) {
            Some(Reply::Forgotten(outcome)) => {
                if outcome.forgotten() > 0 {
                    self.observations
                        .push(Observation::Forgotten(outcome.forgotten()));
                }
                true
            }
            Some(_) => true,
            None => false,
        })
    }
}
