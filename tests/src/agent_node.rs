//! An agent as the simulator and in-process tests run it: the real
//! [`AgentCore`] over an in-memory journal that can lose its uncommitted
//! tail (a crash) and be restored from an older copy (a stale disk).

use std::collections::BTreeMap;

use agent_core::{AgentConfig, AgentCore, JournalKey, JournalRecord, Now};
use shard_format::{DocumentSigner, Ed25519Signer, GatewayIdentity};

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
        }
    }

    /// Commits every pending journal batch (group commit: one call, many
    /// records) and tells the core. Returns the records committed.
    pub fn commit_journal(&mut self) -> usize {
        let mut committed = 0;
        while let Some(batch) = self.core.poll_journal() {
            committed += batch.records.len();
            for record in batch.records {
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
