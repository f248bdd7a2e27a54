//! The core's shards, found by their ID or by their pair.

use std::collections::{BTreeMap, BTreeSet};

use ledger::{PairKey, ShardBook};
use shard_format::{ReservationId, ShardId};

use crate::{AgentReservation, ShardSlot};

/// What the shard refresh reads of a shard: while it is open, its boot
/// epoch and the monotonic ms until which it admits; `None` once its book
/// is closed.
type OpenEnd = Option<(u64, u64)>;

/// Every shard the core holds, by ID, with the IDs of each pair's shards
/// beside them: admission from shards asks for one pair's, and a pass
/// over every shard cost each emergency reserve about 4 µs more at 1,000
/// shards than at 10 (docs/benchmarks-history.md). Both orders are the
/// shards' IDs', so a pair's shards come in the order a pass over all of
/// them met them.
///
/// The timer and its sweep read the listings kept beside the slots, not
/// every slot (docs/benchmarks-history.md, "The timer without a pass over
/// every pair and shard"):
/// - the generation, which moves on with each open shard added, removed
///   or closed, so that what the timer derives from the shards' ends
///   ([`ShardSlots::open_ends_by_pair`]) is kept until then;
/// - the open shards in order of their next work (a hold's expiry, the
///   end of use), of which the timer asks for the first;
/// - the open shards some of whose units went out, the only ones a
///   reconnect may close.
///
/// A shard's book changes only through [`ShardSlots::change_book`], which
/// keeps the listings as the book stands.
///
/// Retention forgets a shard with the records that use it, once all of
/// them are at rest. The core tells each record's change here
/// ([`ShardSlots::note_record`]), which keeps for each shard the records
/// that came to rest and a count of the others: finding them by a pass
/// over every record took the daemon's thread for as long as the agent
/// keeps records (a day's by default) each time a shard came due, 27 ms
/// at a million. An open reservation costs no entry, only its count.
#[derive(Debug, Clone, Default)]
pub(crate) struct ShardSlots {
    by_id: BTreeMap<ShardId, ShardSlot>,
    /// Never an empty set: a pair's entry goes with its last shard.
    by_pair: BTreeMap<PairKey, BTreeSet<ShardId>>,
    /// Moves on with each open shard added, removed or closed.
    generation: u64,
    /// Each open shard by its next work ([`Marks::work_due`]).
    by_work_due: BTreeSet<(u64, ShardId)>,
    /// The open shards some of whose units went out ([`Marks::used`]).
    used: BTreeSet<ShardId>,
    /// While a sweep notes them, the shards whose books changed (see
    /// [`ShardSlots::start_noting`]).
    noted: Option<BTreeSet<ShardId>>,
    /// What was noted of each slot's records.
    records: BTreeMap<ShardId, ShardRecords>,
}

/// The records that use one shard, as [`ShardSlots::note_record`] was told.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct ShardRecords {
    /// Those that came to rest, in that order: one may come more than
    /// once, and one forgotten or woken since may remain.
    at_rest: Vec<ReservationId>,
    /// How many are not at rest.
    busy: usize,
}

/// What the listings keep of one slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Marks {
    end: OpenEnd,
    /// An open shard's next work: its first RESERVED hold's expiry or the
    /// end of its use, whichever comes first.
    work_due: Option<u64>,
    /// An open shard that has less available than it was allocated.
    used: bool,
    /// An open shard's units on RESERVED holds.
    local_reserved: u64,
}

impl Marks {
    fn of(slot: &ShardSlot) -> Self {
        if slot.book.is_closed() {
            return Self {
                end: None,
                work_due: None,
                used: false,
                local_reserved: 0,
            };
        }
        let until = slot.accepted.usable_until_ms;
        let terms = slot.book.terms();
        Self {
            end: open_end(slot),
            work_due: Some(slot.book.next_expiry_ms().map_or(until, |at| at.min(until))),
            used: terms.local_available < terms.allocated,
            local_reserved: terms.local_reserved,
        }
    }
}

impl ShardSlots {
    /// Puts `slot` under `id`, in place of the one there.
    pub(crate) fn insert(&mut self, id: ShardId, slot: ShardSlot) {
        let pair = pair_of(&slot);
        let marks = Marks::of(&slot);
        if let Some(replaced) = self.by_id.insert(id.clone(), slot) {
            self.unlist(&id, &replaced);
        }
        self.relist(&id, None, Some(marks));
        self.records.entry(id.clone()).or_default();
        self.by_pair.entry(pair).or_default().insert(id);
    }

    pub(crate) fn remove(&mut self, id: &ShardId) -> Option<ShardSlot> {
        let slot = self.by_id.remove(id)?;
        self.unlist(id, &slot);
        self.records.remove(id);
        Some(slot)
    }

    /// Notes, for `shard`'s slot if there is one, that a record that uses
    /// it changed from `before` (`None`: new, or not noted yet) to `after`.
    /// The core tells each change of a record, once for each shard either
    /// side uses; a shard's slot notes the records of before it came only
    /// if told of them as new.
    pub(crate) fn note_record(
        &mut self,
        shard: &ShardId,
        before: Option<&AgentReservation>,
        after: &AgentReservation,
    ) {
        let Some(records) = self.records.get_mut(shard) else {
            return;
        };
        let rest = |record: Option<&AgentReservation>| {
            record
                .filter(|record| record.uses_shard(shard))
                .map(AgentReservation::is_at_rest)
        };
        let (was, is) = (rest(before), rest(Some(after)));
        if was == Some(false) && is != Some(false) {
            debug_assert!(records.busy > 0, "{shard} counted no busy record");
            records.busy = records.busy.saturating_sub(1);
        }
        if is == Some(false) && was != Some(false) {
            records.busy += 1;
        }
        if is == Some(true) && was != Some(true) {
            records.at_rest.push(after.reservation.clone());
        }
    }

    /// The records noted as at rest in `shard`, unless some that use it
    /// are not: in the order they came to rest, where one may come more
    /// than once and one forgotten or woken since may remain.
    pub(crate) fn records_at_rest(&self, shard: &ShardId) -> Option<&[ReservationId]> {
        let records = self.records.get(shard)?;
        (records.busy == 0).then_some(records.at_rest.as_slice())
    }

    /// Whether what each slot noted is as `records` stand: the count of
    /// those that use it and are not at rest, and every one at rest
    /// listed (debug checks).
    pub(crate) fn records_are_noted<'a>(
        &self,
        records: impl Iterator<Item = &'a AgentReservation>,
    ) -> bool {
        let listed: BTreeSet<(&ShardId, &ReservationId)> = self
            .records
            .iter()
            .flat_map(|(shard, noted)| noted.at_rest.iter().map(move |id| (shard, id)))
            .collect();
        let mut busy: BTreeMap<&ShardId, usize> = BTreeMap::new();
        for record in records {
            for shard in each_once(record.shards_used()) {
                if !self.records.contains_key(shard) {
                    continue;
                }
                if !record.is_at_rest() {
                    *busy.entry(shard).or_default() += 1;
                } else if !listed.contains(&(shard, &record.reservation)) {
                    return false;
                }
            }
        }
        self.records.keys().eq(self.by_id.keys())
            && self
                .records
                .iter()
                .all(|(shard, noted)| noted.busy == busy.get(shard).copied().unwrap_or(0))
    }

    /// Takes `slot`, no longer under `id`, out of the listings.
    fn unlist(&mut self, id: &ShardId, slot: &ShardSlot) {
        self.relist(id, Some(Marks::of(slot)), None);
        let pair = pair_of(slot);
        if let Some(ids) = self.by_pair.get_mut(&pair) {
            ids.remove(id);
            if ids.is_empty() {
                self.by_pair.remove(&pair);
            }
        }
    }

    /// Moves shard `id` in the work order and the used set from what
    /// `before` marked to what `after` marks (`None`: not held), and the
    /// generation on if its end of use came or went.
    fn relist(&mut self, id: &ShardId, before: Option<Marks>, after: Option<Marks>) {
        if before.and_then(|marks| marks.end) != after.and_then(|marks| marks.end) {
            self.generation += 1;
        }
        let due_before = before.and_then(|marks| marks.work_due);
        let due_after = after.and_then(|marks| marks.work_due);
        if due_before != due_after {
            if let Some(due) = due_before {
                self.by_work_due.remove(&(due, id.clone()));
            }
            if let Some(due) = due_after {
                self.by_work_due.insert((due, id.clone()));
            }
        }
        let used_before = before.is_some_and(|marks| marks.used);
        let used_after = after.is_some_and(|marks| marks.used);
        if used_before != used_after {
            if used_after {
                self.used.insert(id.clone());
            } else {
                self.used.remove(id);
            }
        }
    }

    /// The shards of `pair`, in ID order.
    pub(crate) fn of_pair(&self, pair: &PairKey) -> impl Iterator<Item = &ShardSlot> + Clone {
        self.by_pair
            .get(pair)
            .into_iter()
            .flatten()
            .map(|id| &self.by_id[id])
    }

    /// Each pair that has shards, in pair order, with the boot epoch and
    /// the end of use of each of its open shards.
    pub(crate) fn open_ends_by_pair(
        &self,
    ) -> impl Iterator<Item = (&PairKey, impl Iterator<Item = (u64, u64)> + '_)> {
        self.by_pair.iter().map(|(pair, ids)| {
            let ends = ids.iter().filter_map(|id| open_end(&self.by_id[id]));
            (pair, ends)
        })
    }

    pub(crate) fn get(&self, id: &ShardId) -> Option<&ShardSlot> {
        self.by_id.get(id)
    }

    /// Changes the book of shard `id`, if the core holds it, and returns
    /// what `change` returned. Only the book: a shard's document, and so
    /// its pair and its end of use, never changes once accepted. A book
    /// that closes never opens again.
    pub(crate) fn change_book<R>(
        &mut self,
        id: &ShardId,
        change: impl FnOnce(&mut ShardBook) -> R,
    ) -> Option<R> {
        let slot = self.by_id.get_mut(id)?;
        let before = Marks::of(slot);
        let result = change(&mut slot.book);
        let after = Marks::of(slot);
        if after != before {
            self.relist(id, Some(before), Some(after));
            if let Some(noted) = &mut self.noted {
                noted.insert(id.clone());
            }
        }
        Some(result)
    }

    /// Moves on with each open shard added, removed or closed: what the
    /// timer derives from [`ShardSlots::open_ends_by_pair`] holds until
    /// then.
    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }

    /// The first time an open shard has work: a hold expires or its use
    /// ends.
    pub(crate) fn next_work_due(&self) -> Option<u64> {
        self.by_work_due.first().map(|(due, _)| *due)
    }

    /// The open shards with work due at monotonic `now_ms`.
    pub(crate) fn work_due_by(&self, now_ms: u64) -> impl Iterator<Item = &ShardId> {
        self.by_work_due
            .iter()
            .take_while(move |(due, _)| *due <= now_ms)
            .map(|(_, id)| id)
    }

    /// The open shards (their books not closed), in ID order: the
    /// listing by work has each of them and no closed one.
    pub(crate) fn open(&self) -> impl Iterator<Item = (&ShardId, &ShardSlot)> {
        let mut ids: Vec<&ShardId> = self.by_work_due.iter().map(|(_, id)| id).collect();
        ids.sort_unstable();
        ids.into_iter().map(|id| (id, &self.by_id[id]))
    }

    /// How many shards are closed: kept, with their receipts, for the
    /// retention window.
    pub(crate) fn closed_count(&self) -> usize {
        self.by_id.len() - self.by_work_due.len()
    }

    /// The open shards some of whose units went out, in ID order.
    pub(crate) fn used(&self) -> impl Iterator<Item = (&ShardId, &ShardSlot)> {
        self.used.iter().map(|id| (id, &self.by_id[id]))
    }

    /// Starts noting the shards whose books change what the listings
    /// keep of them (a shard's end, its time of work, whether units went
    /// out, how many are reserved), until [`ShardSlots::stop_noting`].
    pub(crate) fn start_noting(&mut self) {
        self.noted = Some(BTreeSet::new());
    }

    /// The shards noted since the noting started or since the last call;
    /// the noting goes on.
    pub(crate) fn take_noted(&mut self) -> BTreeSet<ShardId> {
        self.noted.as_mut().map(std::mem::take).unwrap_or_default()
    }

    pub(crate) fn stop_noting(&mut self) {
        self.noted = None;
    }

    pub(crate) fn contains_key(&self, id: &ShardId) -> bool {
        self.by_id.contains_key(id)
    }

    pub(crate) fn len(&self) -> usize {
        self.by_id.len()
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = (&ShardId, &ShardSlot)> {
        self.by_id.iter()
    }

    /// The shards whose IDs come after `after` (all of them for `None`),
    /// in ID order.
    pub(crate) fn after(
        &self,
        after: Option<&ShardId>,
    ) -> impl Iterator<Item = (&ShardId, &ShardSlot)> {
        use std::ops::Bound::{Excluded, Unbounded};
        let start = after.map_or(Unbounded, Excluded);
        self.by_id.range::<ShardId, _>((start, Unbounded))
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = &ShardSlot> {
        self.by_id.values()
    }

    /// Whether the listings are as the slots stand: the listing by pair
    /// names each shard once, under its document's pair; the work order and the used set are those of the open shards
    /// (debug checks).
    pub(crate) fn is_consistent(&self) -> bool {
        let listed: usize = self.by_pair.values().map(BTreeSet::len).sum();
        let marks = || self.by_id.iter().map(|(id, slot)| (id, Marks::of(slot)));
        let by_work_due: BTreeSet<(u64, ShardId)> = marks()
            .filter_map(|(id, marks)| Some((marks.work_due?, id.clone())))
            .collect();
        let used: BTreeSet<ShardId> = marks()
            .filter(|(_, marks)| marks.used)
            .map(|(id, _)| id.clone())
            .collect();
        listed == self.by_id.len()
            && by_work_due == self.by_work_due
            && used == self.used
            && self.by_pair.values().all(|ids| !ids.is_empty())
            && self.by_id.iter().all(|(id, slot)| {
                self.by_pair
                    .get(&pair_of(slot))
                    .is_some_and(|ids| ids.contains(id))
            })
    }
}

impl std::ops::Index<&ShardId> for ShardSlots {
    type Output = ShardSlot;

    fn index(&self, id: &ShardId) -> &ShardSlot {
        &self.by_id[id]
    }
}

/// `shards` without the ones met before.
pub(crate) fn each_once<'a>(
    shards: impl Iterator<Item = &'a ShardId> + Clone,
) -> impl Iterator<Item = &'a ShardId> {
    let earlier = shards.clone();
    shards
        .enumerate()
        .filter(move |(n, shard)| !earlier.clone().take(*n).any(|seen| seen == *shard))
        .map(|(_, shard)| shard)
}

fn pair_of(slot: &ShardSlot) -> PairKey {
    let shard = &slot.accepted.shard;
    PairKey::new(shard.subject.clone(), shard.route.clone())
}

fn open_end(slot: &ShardSlot) -> OpenEnd {
    let accepted = &slot.accepted;
    (!slot.book.is_closed()).then_some((accepted.shard.boot_epoch, accepted.usable_until_ms))
}

#[cfg(test)]
mod tests {
    use ledger::ShardBook;
    use shard_format::{
        BootNonce, EmergencyShardV1, GatewayIdentity, KeyId, Route, Signature, Subject, Timestamp,
    };

    use thin_vec::ThinVec;

    use super::*;
    use crate::{AcceptedShard, AgentState, ReservationPath};

    fn slot(id: &str, route: &str) -> (ShardId, ShardSlot) {
        let shard = EmergencyShardV1 {
            schema: Default::default(),
            shard: ShardId::new(id).expect("valid"),
            subject: Subject::new("tenant-7").expect("valid"),
            route: Route::new(route).expect("valid"),
            policy_generation: 1,
            accounting_epoch: Timestamp::from_unix_ms(0).expect("valid"),
            allocated_units: 100,
            gateway_identity: GatewayIdentity::new("test:gw-1").expect("valid"),
            boot_epoch: 1,
            boot_nonce: BootNonce([1; 16]),
            fence: 1,
            not_before: Timestamp::from_unix_ms(0).expect("valid"),
            not_after: Timestamp::from_unix_ms(60_000).expect("valid"),
            key_id: KeyId::new("test:central").expect("valid"),
            signature: Signature::UNSIGNED,
        };
        let book = ShardBook::open(shard.clone()).0;
        let slot = ShardSlot {
            accepted: AcceptedShard {
                shard,
                usable_until_ms: 60_000,
            },
            book,
        };
        (ShardId::new(id).expect("valid"), slot)
    }

    fn pair(route: &str) -> PairKey {
        PairKey::new(
            Subject::new("tenant-7").expect("valid"),
            Route::new(route).expect("valid"),
        )
    }

    fn ids_of(slots: &ShardSlots, route: &str) -> Vec<String> {
        slots
            .of_pair(&pair(route))
            .map(|slot| slot.accepted.shard.shard.as_str().to_owned())
            .collect()
    }

    #[test]
    fn a_pairs_shards_come_in_id_order_and_leave_with_their_removal() {
        let mut slots = ShardSlots::default();
        for (id, route) in [("s-3", "chat"), ("s-1", "chat"), ("s-2", "embed")] {
            let (id, slot) = slot(id, route);
            slots.insert(id, slot);
        }
        assert_eq!(slots.len(), 3);
        assert_eq!(ids_of(&slots, "chat"), ["s-1", "s-3"]);
        assert_eq!(ids_of(&slots, "embed"), ["s-2"]);
        assert!(ids_of(&slots, "other").is_empty());

        assert!(slots.remove(&ShardId::new("s-1").expect("valid")).is_some());
        assert!(slots.remove(&ShardId::new("s-1").expect("valid")).is_none());
        assert_eq!(ids_of(&slots, "chat"), ["s-3"]);
        assert!(slots.remove(&ShardId::new("s-2").expect("valid")).is_some());
        assert!(ids_of(&slots, "embed").is_empty());
        assert!(
            !slots.by_pair.contains_key(&pair("embed")),
            "no empty set is kept"
        );
        assert_eq!(slots.len(), 1);
    }

    #[test]
    fn a_shard_counts_its_busy_records_and_lists_those_at_rest() {
        let mut slots = ShardSlots::default();
        let (shard, held) = slot("sh-1", "chat");
        let record = |id: &str, state: AgentState| {
            let mut record = crate::tests::shard_record(ThinVec::new());
            record.reservation = ReservationId::new(id).expect("valid");
            record.state = state;
            record
        };
        let at_rest = |slots: &ShardSlots| -> Option<Vec<String>> {
            let ids = slots.records_at_rest(&shard)?;
            Some(ids.iter().map(|id| id.as_str().to_owned()).collect())
        };
        let reserved = record("r-1", AgentState::Reserved);
        slots.note_record(&shard, None, &reserved);
        assert!(slots.records.is_empty(), "no slot, no note");

        slots.insert(shard.clone(), held);
        assert_eq!(at_rest(&slots), Some(vec![]));
        slots.note_record(&shard, None, &reserved);
        assert_eq!(at_rest(&slots), None, "one busy");
        let settled = record("r-1", AgentState::Settled);
        slots.note_record(&shard, Some(&reserved), &settled);
        assert_eq!(at_rest(&slots).as_deref(), Some(&["r-1".to_owned()][..]));
        // Unchanged: listed once; another shard's record: not counted.
        slots.note_record(&shard, Some(&settled), &settled);
        let mut elsewhere = record("r-9", AgentState::Reserved);
        elsewhere.path = ReservationPath::Central;
        slots.note_record(&shard, None, &elsewhere);
        assert_eq!(at_rest(&slots).as_deref(), Some(&["r-1".to_owned()][..]));

        // Woken (a retried rejection) and at rest again: listed twice.
        let mut woken = settled.clone();
        woken.state = AgentState::Requested;
        slots.note_record(&shard, Some(&settled), &woken);
        assert_eq!(at_rest(&slots), None);
        slots.note_record(&shard, Some(&woken), &settled);
        assert_eq!(at_rest(&slots).map(|ids| ids.len()), Some(2));
        // A record that leaves the shard leaves its count too.
        slots.note_record(&shard, None, &reserved);
        slots.note_record(&shard, Some(&reserved), &elsewhere);
        assert!(at_rest(&slots).is_some());
        assert!(slots.records_are_noted([&settled].into_iter()));
        assert!(!slots.records_are_noted([&settled, &reserved].into_iter()));

        let (_, again) = slot("sh-1", "chat");
        slots.insert(shard.clone(), again);
        assert_eq!(at_rest(&slots).map(|ids| ids.len()), Some(2), "kept");
        assert!(slots.remove(&shard).is_some());
        assert_eq!(at_rest(&slots), None, "gone with the slot");
    }

    #[test]
    fn the_open_shards_come_in_id_order_and_the_closed_ones_are_counted() {
        let mut slots = ShardSlots::default();
        for (id, route) in [("s-3", "chat"), ("s-1", "chat"), ("s-2", "embed")] {
            let (id, slot) = slot(id, route);
            slots.insert(id, slot);
        }
        let open = |slots: &ShardSlots| -> Vec<String> {
            slots.open().map(|(id, _)| id.as_str().to_owned()).collect()
        };
        assert_eq!(open(&slots), ["s-1", "s-2", "s-3"]);
        assert_eq!(slots.closed_count(), 0);

        let closed_at = Timestamp::from_unix_ms(1_000).expect("valid");
        for id in ["s-1", "s-3"] {
            slots.change_book(&ShardId::new(id).expect("valid"), |book| {
                book.close(shard_format::ShardCloseReason::Restart, closed_at)
            });
        }
        assert_eq!(open(&slots), ["s-2"]);
        assert_eq!(slots.closed_count(), 2);
        assert!(slots.remove(&ShardId::new("s-1").expect("valid")).is_some());
        assert_eq!(slots.closed_count(), 1, "a closed shard forgotten");
        assert!(slots.is_consistent());
    }

    #[test]
    fn a_record_at_rest_missing_from_the_list_is_seen() {
        let mut slots = ShardSlots::default();
        let (shard, held) = slot("sh-1", "chat");
        slots.insert(shard.clone(), held);
        let mut settled = crate::tests::shard_record(ThinVec::new());
        settled.state = AgentState::Settled;
        assert!(slots.records_are_noted(std::iter::empty()));
        assert!(!slots.records_are_noted([&settled].into_iter()));
        slots.note_record(&shard, None, &settled);
        assert!(slots.records_are_noted([&settled].into_iter()));
    }

    #[test]
    fn each_once_keeps_the_first_of_each() {
        let ids: Vec<ShardId> = ["a", "b", "a", "c", "b"]
            .into_iter()
            .map(|id| ShardId::new(id).expect("valid"))
            .collect();
        let once: Vec<&str> = each_once(ids.iter()).map(ShardId::as_str).collect();
        assert_eq!(once, ["a", "b", "c"]);
    }

    #[test]
    fn a_slot_put_under_an_id_in_use_moves_to_its_own_pair() {
        let mut slots = ShardSlots::default();
        let (id, first) = slot("s-1", "chat");
        slots.insert(id, first);
        let (id, second) = slot("s-1", "embed");
        slots.insert(id, second);
        assert!(ids_of(&slots, "chat").is_empty());
        assert!(!slots.by_pair.contains_key(&pair("chat")));
        assert_eq!(ids_of(&slots, "embed"), ["s-1"]);
        assert_eq!(slots.len(), 1);
    }

    #[test]
    fn an_open_shards_work_is_due_at_its_first_hold_expiry_or_its_end() {
        use ledger::ShardReserveOutcome;
        use shard_format::{ReservationId, ShardCloseReason};

        let mut slots = ShardSlots::default();
        let (first, slot_1) = slot("s-1", "chat");
        slots.insert(first.clone(), slot_1);
        assert_eq!(slots.next_work_due(), Some(60_000), "the end of its use");
        let used = |slots: &ShardSlots| slots.used().map(|(id, _)| id.clone()).collect::<Vec<_>>();
        assert!(used(&slots).is_empty(), "no unit went out");
        let generation = slots.generation();

        // A hold that expires at 1,000 + 5,000 ms comes first.
        let hold_of = |outcome: ShardReserveOutcome| match outcome {
            ShardReserveOutcome::Reserved(hold) => hold,
            other => panic!("not reserved: {other:?}"),
        };
        let hold = slots
            .change_book(&first, |book| {
                let reservation = ReservationId::new("r-1").expect("valid");
                hold_of(
                    book.reserve_between(None, reservation, 10, 10, 5_000, 1_000)
                        .outcome,
                )
            })
            .expect("held");
        assert_eq!(slots.next_work_due(), Some(6_000));
        assert_eq!(used(&slots), std::slice::from_ref(&first));
        assert!(slots.is_consistent());
        assert_eq!(slots.generation(), generation, "a hold changes no listing");

        // The hold goes back: the end of use again.
        let _ = slots.change_book(&first, |book| book.release(Some(hold)));
        assert_eq!(slots.next_work_due(), Some(60_000));
        assert!(used(&slots).is_empty(), "every unit came back");

        // A second shard of the pair, and the first one closes: only the
        // second is open, and its end the only one listed.
        let (second, mut slot_2) = slot("s-2", "chat");
        slot_2.accepted.usable_until_ms = 70_000;
        slots.insert(second.clone(), slot_2);
        assert!(slots.generation() > generation, "an open shard came");
        let generation = slots.generation();
        let _ = slots.change_book(&first, |book| {
            book.close(
                ShardCloseReason::ValidityEnded,
                Timestamp::from_unix_ms(0).expect("valid"),
            )
        });
        assert!(slots.generation() > generation, "an open shard closed");
        assert_eq!(slots.next_work_due(), Some(70_000));
        let ends: Vec<(String, Vec<(u64, u64)>)> = slots
            .open_ends_by_pair()
            .map(|(pair, ends)| (pair.route.as_str().to_owned(), ends.collect()))
            .collect();
        assert_eq!(ends, [("chat".to_owned(), vec![(1, 70_000)])]);
        assert!(slots.is_consistent());

        let generation = slots.generation();
        assert!(slots.remove(&first).is_some());
        assert_eq!(slots.generation(), generation, "a closed shard has no end");
        assert!(slots.remove(&second).is_some());
        assert!(slots.generation() > generation, "an open shard went");
        assert_eq!(slots.next_work_due(), None, "no open shard is left");
        assert!(slots.is_consistent());
    }

    #[test]
    fn a_slot_put_again_under_its_id_is_listed_once() {
        let mut slots = ShardSlots::default();
        let (shard, first) = slot("s-1", "chat");
        slots.insert(shard.clone(), first);
        let generation = slots.generation();
        let (_, again) = slot("s-1", "chat");
        slots.insert(shard.clone(), again);
        assert!(slots.generation() > generation);
        assert!(slots.is_consistent());
        assert!(slots.remove(&shard).is_some());
        assert_eq!(
            slots.next_work_due(),
            None,
            "the first slot's time went with it"
        );
        assert!(slots.is_consistent());
    }

    /// Each listing, put wrong on its own, is seen.
    #[test]
    fn a_listing_that_differs_from_the_slots_is_seen() {
        let held = || {
            let mut slots = ShardSlots::default();
            for (id, route) in [("s-1", "chat"), ("s-2", "embed")] {
                let (id, slot) = slot(id, route);
                slots.insert(id, slot);
            }
            assert!(slots.is_consistent());
            slots
        };
        let stray = || ShardId::new("s-9").expect("valid");

        let mut slots = held();
        slots
            .by_pair
            .get_mut(&pair("chat"))
            .expect("listed")
            .insert(stray());
        assert!(
            !slots.is_consistent(),
            "a shard listed under a pair but not held"
        );

        let mut slots = held();
        slots.by_pair.insert(pair("other"), BTreeSet::new());
        assert!(!slots.is_consistent(), "an empty pair entry");

        let mut slots = held();
        slots.by_work_due.insert((1, stray()));
        assert!(!slots.is_consistent(), "a stray time of work");

        let mut slots = held();
        slots.used.insert(stray());
        assert!(!slots.is_consistent(), "a stray used shard");
    }

    /// The noting sees the changes of what the listings keep, and only
    /// while it is on.
    #[test]
    fn a_change_is_noted_only_while_the_noting_is_on() {
        use shard_format::ReservationId;

        let mut slots = ShardSlots::default();
        let (shard, held) = slot("s-1", "chat");
        slots.insert(shard.clone(), held);
        let reserve = |slots: &mut ShardSlots, key: &str| {
            let reservation = ReservationId::new(key).expect("valid");
            let _ = slots.change_book(&shard, |book| {
                book.reserve_between(None, reservation, 1, 1, 5_000, 0)
            });
        };

        slots.start_noting();
        assert!(slots.take_noted().is_empty());
        reserve(&mut slots, "r-1");
        assert_eq!(
            slots.take_noted(),
            BTreeSet::from([shard.clone()]),
            "its first hold: units out and reserved, a time of work sooner"
        );
        let _ = slots.change_book(&shard, |book| book.release(None));
        assert!(slots.take_noted().is_empty(), "a call that changed nothing");
        reserve(&mut slots, "r-2");
        assert_eq!(
            slots.take_noted(),
            BTreeSet::from([shard.clone()]),
            "more units reserved"
        );
        slots.stop_noting();
        reserve(&mut slots, "r-3");
        assert!(slots.noted.is_none(), "nothing is kept once it stops");
    }
}
