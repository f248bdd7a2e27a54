//! An agent as the simulator and in-process tests run it: the real
//! [`AgentCore`] over an in-memory journal that can lose its uncommitted
//! tail (a crash) and be restored from an older copy (a stale disk).
//!
//! Every committed shard record also goes to the exact oracle of the shard
//! books: a [`ReferenceShardBook`] per shard recomputes the book from the
//! reservations' transitions and must agree with every book and terminal
//! receipt the agent journals.

use std::collections::{BTreeMap, BTreeSet};

use agent_core::{AgentConfig, AgentCore, JournalKey, JournalRecord, Now, ShardHold};
use ledger::ShardChange;
use ledger_reference::ReferenceShardBook;
use shard_format::{
    DocumentSigner, Ed25519Signer, GatewayIdentity, ReservationId, ReservationState, ShardId,
};

use crate::crypto::{SimSigner, SimVerifier};

/// How an agent signs: the cheap simulated scheme or real ed25519.
#[derive(Debug, Clone)]
pub enum AgentKey {
    Sim(SimSigner),
    Ed25519([u8; 32]),
}

impl AgentKey {
    pub fn signer(&self) -> Box<dyn DocumentSigner + Send> {
        match self {
            Self::Sim(signer) => Box::new(signer.clone()),
            Self::Ed25519(secret) => Box::new(Ed25519Signer::from_secret_bytes(secret)),
        }
    }

    pub fn identity(&self) -> GatewayIdentity {
        self.signer().key_id().clone()
    }
}

/// The journal: committed records by key.
pub type Journal = BTreeMap<JournalKey, JournalRecord>;

pub struct AgentNode {
    pub core: AgentCore,
    pub journal: Journal,
    pub config: AgentConfig,
    pub key: AgentKey,
    pub verifier: SimVerifier,
    /// Restarts so far.
    pub restarts: u64,
    /// Every journal forget committed, with what the journal held just
    /// before it: the record under the key and, for a shard's keys, the
    /// shard's terminal receipt (drained by the simulator's checks).
    pub forgets: Vec<Forgotten>,
    /// The reference of each shard book in the journal.
    shard_books: BTreeMap<ShardId, ReferenceShardBook>,
    /// Shards whose book disagreed with its reference (checked no more).
    diverged: BTreeSet<ShardId>,
    /// Where a journaled shard book or receipt disagreed with its
    /// reference (drained by the simulator's checks).
    pub shard_mismatches: Vec<String>,
    /// Every shard admission committed (drained by the simulator's
    /// `partial_admission` check).
    pub shard_admissions: Vec<ShardAdmission>,
}

/// A new shard reservation, journaled, and the book it was admitted from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardAdmission {
    pub shard: ShardId,
    pub reservation: ReservationId,
    pub granted: u64,
    /// The book's `localAvailable` as last journaled before the admission
    /// (a reservation's record precedes the books it changes in a batch).
    pub local_available: Option<u64>,
}

/// One committed journal forget and the state it was judged against.
#[derive(Debug, Clone)]
pub struct Forgotten {
    pub key: JournalKey,
    pub record: Option<JournalRecord>,
    pub receipt: Option<JournalRecord>,
}

impl std::fmt::Debug for AgentNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AgentNode")
            .field("identity", &self.config.identity)
            .field("journal", &self.journal.len())
            .finish_non_exhaustive()
    }
}

impl AgentNode {
    pub fn start(config: AgentConfig, key: AgentKey, verifier: SimVerifier, now: Now) -> Self {
        let core = AgentCore::recover(
            config.clone(),
            key.signer(),
            Box::new(verifier.clone()),
            Vec::new(),
            now,
        );
        Self {
            core,
            journal: Journal::new(),
            config,
            key,
            verifier,
            restarts: 0,
            forgets: Vec::new(),
            shard_books: BTreeMap::new(),
            diverged: BTreeSet::new(),
            shard_mismatches: Vec::new(),
            shard_admissions: Vec::new(),
        }
    }

    /// Commits every pending journal batch (group commit: one call, many
    /// records) and tells the core. Returns the records committed.
    pub fn commit_journal(&mut self) -> usize {
        let mut committed = 0;
        while let Some(batch) = self.core.poll_journal() {
            committed += batch.records.len();
            // A book is checked as the batch leaves it, by its last record:
            // a reservation's record in a batch shows its state after the
            // batch's last step, and so must the book it is checked with.
            let mut records = batch.records.into_iter();
            while let Some(record) = records.next() {
                let superseded = book_shard(&record).is_some_and(|shard| {
                    let mut later = records.as_slice().iter();
                    later.any(|later| book_shard(later) == Some(shard))
                });
                self.note_shard_admission(&record);
                if !superseded {
                    self.check_shard_record(&record);
                }
                match record {
                    JournalRecord::Forget(key) => {
                        let shard = match &key {
                            JournalKey::Shard(shard)
                            | JournalKey::ShardBook(shard)
                            | JournalKey::ShardReservation(shard, _)
                            | JournalKey::TerminalReceipt(shard) => Some(shard.clone()),
                            _ => None,
                        };
                        let receipt = shard.and_then(|shard| {
                            self.journal
                                .get(&JournalKey::TerminalReceipt(shard))
                                .cloned()
                        });
                        let record = self.journal.remove(&key);
                        self.forgets.push(Forgotten {
                            key,
                            record,
                            receipt,
                        });
                    }
                    record => {
                        self.journal.insert(record.key(), record);
                    }
                }
            }
            self.core.handle_journal_committed(batch.seq);
        }
        committed
    }

    /// A hold new to the journal, in state `RESERVED`, is an admission:
    /// kept with the book it drew on.
    fn note_shard_admission(&mut self, record: &JournalRecord) {
        let JournalRecord::ReservationWithHolds { record, holds } = record else {
            return;
        };
        for ShardHold { shard, local } in holds {
            if local.state != ReservationState::Reserved
                || journaled_hold(&self.journal, shard, &record.reservation).is_some()
            {
                continue;
            }
            let local_available = match self.journal.get(&JournalKey::ShardBook(shard.clone())) {
                Some(JournalRecord::ShardBook {
                    change: ShardChange::Book { terms, .. },
                    ..
                }) => Some(terms.local_available),
                _ => None,
            };
            self.shard_admissions.push(ShardAdmission {
                shard: shard.clone(),
                reservation: local.reservation.clone(),
                granted: local.units,
                local_available,
            });
        }
    }

    /// The shard-book oracle, for one committed record in journal order.
    fn check_shard_record(&mut self, record: &JournalRecord) {
        match record {
            JournalRecord::ReservationWithHolds { holds, .. } => {
                for ShardHold { shard, local } in holds {
                    if self.diverged.contains(shard) {
                        continue;
                    }
                    let checked = match self.shard_books.get_mut(shard) {
                        Some(book) => book.observe_reservation(local),
                        None => Err(format!(
                            "{}: a hold before the shard's book",
                            local.reservation
                        )),
                    };
                    self.note_check(shard, checked);
                }
            }
            JournalRecord::ShardBook {
                shard,
                change:
                    ShardChange::Book {
                        terms,
                        overdraft_debt,
                        closure,
                    },
            } => {
                if self.diverged.contains(shard) {
                    return;
                }
                let checked = match self.shard_books.get_mut(shard) {
                    Some(book) => book.observe_book(terms, *overdraft_debt, closure.as_ref()),
                    None => {
                        let book = ReferenceShardBook::adopt(*terms, *overdraft_debt, *closure);
                        self.shard_books.insert(shard.clone(), book);
                        Ok(())
                    }
                };
                self.note_check(shard, checked);
            }
            JournalRecord::ShardBook {
                shard,
                change: ShardChange::Reservation(local),
            } => self.note_check(
                shard,
                Err(format!(
                    "{}: a hold journaled as a record of its own",
                    local.reservation
                )),
            ),
            JournalRecord::TerminalReceipt { receipt, .. } => {
                if let Some(book) = self.shard_books.get(&receipt.shard) {
                    let checked = book.check_receipt(receipt);
                    self.note_check(&receipt.shard, checked);
                }
            }
            JournalRecord::Forget(JournalKey::ShardBook(shard)) => {
                self.shard_books.remove(shard);
            }
            JournalRecord::Forget(JournalKey::Reservation(id)) => {
                // The record still in the journal names the holds it had.
                if let Some(JournalRecord::ReservationWithHolds { holds, .. }) =
                    self.journal.get(&JournalKey::Reservation(id.clone()))
                {
                    for hold in holds {
                        if let Some(book) = self.shard_books.get_mut(&hold.shard) {
                            book.forget_reservation(id);
                        }
                    }
                }
            }
            _ => {}
        }
    }

    /// Keeps a shard's disagreement with its reference, and checks the
    /// shard no more.
    fn note_check(&mut self, shard: &ShardId, checked: Result<(), String>) {
        if let Err(problem) = checked {
            self.shard_mismatches.push(format!(
                "agent {} shard {shard}: {problem}",
                self.config.identity
            ));
            self.shard_books.remove(shard);
            self.diverged.insert(shard.clone());
        }
    }

    /// The shard-book references as the journal holds the books (after a
    /// restart, from a stale copy or not).
    fn adopt_shard_books(&mut self) {
        self.shard_books.clear();
        for record in self.journal.values() {
            if let JournalRecord::ShardBook {
                shard,
                change:
                    ShardChange::Book {
                        terms,
                        overdraft_debt,
                        closure,
                    },
            } = record
            {
                let book = ReferenceShardBook::adopt(*terms, *overdraft_debt, *closure);
                self.shard_books.insert(shard.clone(), book);
            }
        }
        for record in self.journal.values() {
            if let JournalRecord::ReservationWithHolds { holds, .. } = record {
                for ShardHold { shard, local } in holds {
                    if let Some(book) = self.shard_books.get_mut(shard) {
                        book.adopt_reservation(local.clone());
                    }
                }
            }
        }
    }

    /// Drops whatever the journal has not committed.
    pub fn discard_uncommitted(&mut self) {
        while self.core.poll_journal().is_some() {}
    }

    /// A crash and restart: uncommitted records are lost, the process
    /// starts again from `journal` (the current one, or a stale copy).
    pub fn restart(&mut self, journal: Option<Journal>, now: Now) {
        self.discard_uncommitted();
        if let Some(journal) = journal {
            self.journal = journal;
        }
        self.adopt_shard_books();
        self.core = AgentCore::recover(
            self.config.clone(),
            self.key.signer(),
            Box::new(self.verifier.clone()),
            self.journal.values().cloned().collect::<Vec<_>>(),
            now,
        );
        self.restarts += 1;
    }

    pub fn identity(&self) -> &GatewayIdentity {
        &self.config.identity
    }
}

/// The hold of reservation `id` on `shard` as `journal` holds it.
fn journaled_hold<'a>(
    journal: &'a Journal,
    shard: &ShardId,
    id: &ReservationId,
) -> Option<&'a ShardHold> {
    match journal.get(&JournalKey::Reservation(id.clone()))? {
        JournalRecord::ReservationWithHolds { holds, .. } => {
            holds.iter().find(|hold| hold.shard == *shard)
        }
        _ => None,
    }
}

/// The shard of a book record.
fn book_shard(record: &JournalRecord) -> Option<&ShardId> {
    match record {
        JournalRecord::ShardBook {
            shard,
            change: ShardChange::Book { .. },
        } => Some(shard),
        _ => None,
    }
}
