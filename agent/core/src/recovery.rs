//! A new process from its journal: records rebuilt, shards of earlier boots
//! closed, reservations in doubt marked for resolution, registration sent.

use std::cell::Cell;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

use ledger::{IdMap, ShardBook, ShardChange};
use shard_format::{DocumentSigner, DocumentVerifier, ReservationId, ShardCloseReason, ShardId};

use crate::reservations::needs_retry;
use crate::scheduler::StartScheduler;
use crate::shard_slots::{ShardSlots, each_once};
use crate::terminal_receipts::TerminalReceipts;
use crate::{
    AgentConfig, AgentCore, AgentState, CentralCall, InFlight, JournalRecord, Now, RecordMap,
    RecordTally, ReservationPath, ShardHold, ShardSlot, one_word,
};

impl AgentCore {
    /// Starts a process from its journal (empty on first start). Shards in
    /// the journal belong to earlier boots: they are closed at once
    /// (available → confirmed unused, in flight → unknown) and their signed
    /// terminal receipts queued. Registration for a new boot epoch is the
    /// first central call; until it succeeds there is no emergency capacity.
    pub fn recover(
        config: AgentConfig,
        signer: Box<dyn DocumentSigner + Send>,
        verifier: Box<dyn DocumentVerifier + Send>,
        records: impl IntoIterator<Item = JournalRecord>,
        now: Now,
    ) -> Self {
        let scheduler = StartScheduler::new(
            config.route_concurrency.clone(),
            config.subject_weights.clone(),
        );
        let mut core = Self {
            config,
            signer,
            verifier,
            boot: None,
            reservations: RecordMap::default(),
            shards: ShardSlots::default(),
            receipts: TerminalReceipts::default(),
            fences: BTreeMap::new(),
            pairs: Default::default(),
            scheduler,
            usage_deadlines: Default::default(),
            retry_work: BTreeSet::new(),
            tally: RecordTally::default(),
            unknown_seen_at: BTreeMap::new(),
            waiters: BTreeMap::new(),
            in_flight: BTreeMap::new(),
            syncing: BTreeMap::new(),
            next_request: 1,
            next_retry_ms: now.mono_ms,
            journal_pending: Vec::new(),
            appended_seq: 0,
            committed_seq: 0,
            gated_calls: VecDeque::new(),
            gated_replies: VecDeque::new(),
            clock: now,
            retained: BTreeSet::new(),
            forget_not_before_ms: 0,
            refused_shards: Vec::new(),
            shard_due_memo: Cell::default(),
        };
        let mut shard_docs = BTreeMap::new();
        let mut shard_books: BTreeMap<ShardId, Vec<ShardChange>> = BTreeMap::new();
        for record in records {
            match record {
                JournalRecord::ReservationWithHolds { record, holds } => {
                    for ShardHold { shard, local } in holds {
                        let changes = shard_books.entry(shard).or_default();
                        changes.push(ShardChange::Reservation(local));
                    }
                    core.reservations.insert(record);
                }
                JournalRecord::Reservation(record) => {
                    core.reservations.insert(record);
                }
                JournalRecord::Shard(accepted) => {
                    shard_docs.insert(accepted.shard.shard.clone(), *accepted);
                }
                JournalRecord::ShardBook { shard, change } => {
                    shard_books.entry(shard).or_default().push(change);
                }
                JournalRecord::Fence { pair, fence } => {
                    let known = core.fences.entry(pair).or_default();
                    *known = (*known).max(fence);
                }
                JournalRecord::TerminalReceipt {
                    receipt,
                    acknowledged,
                } => {
                    core.receipts.insert(*receipt, acknowledged);
                }
                // A journal deletes the key instead of storing this; one
                // handed in anyway has nothing to rebuild.
                JournalRecord::Forget(_) => {}
            }
        }
        core.tally = RecordTally::of(core.reservations.values());
        core.retry_work = core
            .reservations
            .values()
            .filter(|record| needs_retry(record))
            .map(|record| record.reservation.clone())
            .collect();
        // Records at rest from before retention have no end time: their
        // window starts now. Stamped in memory; journaled with their next
        // change or forgotten when the window passes.
        let wall_ms = now.wall.unix_ms();
        for record in core.reservations.values_mut() {
            if record.is_at_rest() && record.ended_at.is_none() {
                record.ended_at = Some(one_word(wall_ms));
            }
        }
        // The records that use each shard, told to its slot as it comes
        // (before a close changes them).
        let mut users: BTreeMap<ShardId, Vec<ReservationId>> = BTreeMap::new();
        for record in core.reservations.values() {
            for shard in each_once(record.shards_used()) {
                let ids = users.entry(shard.clone()).or_default();
                ids.push(record.reservation.clone());
            }
        }
        for (id, accepted) in shard_docs {
            let books = shard_books.remove(&id).unwrap_or_default();
            // A book that fails its own equation is not trusted: start from
            // the shard alone, which retires everything as unknown/unused
            // conservatively on close below.
            let (book, holds) = ShardBook::from_records(accepted.shard.clone(), books)
                .unwrap_or_else(|_| (ShardBook::open(accepted.shard.clone()).0, IdMap::default()));
            for local in holds.values() {
                if let Some(record) = core.reservations.get_mut(&local.reservation) {
                    record.keep_hold(&id, local);
                }
            }
            core.shards.insert(id.clone(), ShardSlot { accepted, book });
            for user in users.remove(&id).unwrap_or_default() {
                core.shards
                    .note_record(&id, None, &core.reservations[&user]);
            }
            if !core.canary_accept_shard_after_restart() {
                core.close_shard(&id, ShardCloseReason::Restart, now);
            }
        }
        // Reservations of the previous process: shard ones died with their
        // shard; central ones in doubt are resolved with the central ledger.
        for id in core.sorted_ids(|_| true) {
            let mut record = core.reservations[&id].clone();
            let before = record.clone();
            match (&record.path, record.state) {
                (ReservationPath::Shard(_), AgentState::Reserved) => {
                    record.state = AgentState::Expired;
                }
                (ReservationPath::Shard(_), AgentState::Started) => {
                    record.state = AgentState::UsageUnknown;
                }
                (ReservationPath::Central, AgentState::Requested) => {
                    record.state = AgentState::ReservationUnknown;
                }
                // Whether its execution still runs is unknown to a new process.
                (ReservationPath::Central, AgentState::Started) => {
                    record.state = AgentState::UsageUnknown;
                }
                _ => {}
            }
            if record != before {
                core.put_reservation(record);
            }
        }
        core.retained = core
            .reservations
            .values()
            .filter(|record| core.joins_retention_queue(record))
            .filter_map(|record| Some((record.ended_at?.get(), record.reservation.clone())))
            .collect();
        core.check_derived();
        core.send(InFlight::Register, CentralCall::Register, now);
        core
    }
}
