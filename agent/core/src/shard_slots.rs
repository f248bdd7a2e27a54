//! The core's shards, found by their ID or by their pair.

use ledger::{PairKey, ShardBook};
use shard_format::ShardId;
use std::collections::{BTreeMap, BTreeSet};

use crate::ShardSlot;

/// What the shard refresh reads of a shard without its slot: while it is
/// open, its boot epoch and the monotonic ms until which it admits; `None`
/// once its book is closed.
type OpenEnd = Option<(u64, u64)>;

/// Every shard the core holds, by ID, with the IDs of each pair's shards
/// beside them: admission from shards asks for one pair's, and a pass
/// over every shard cost each emergency reserve about 4 µs more at 1,000
/// shards than at 10 (docs/benchmarks-history.md). Both orders are the
/// shards' IDs', so a pair's shards come in the order a pass over all of
/// them met them.
///
/// Beside each pair's shard IDs stands each one's [`OpenEnd`], so that the
/// timer finds when each pair's shards fall due for a refresh in one pass
/// over the pairs in order, without a table built on every poll (see
/// [`ShardSlots::open_ends_by_pair`]), and the listing's generation moves
/// on with each change of it, so that what the timer derives from it is
/// kept until then. The open shards' next times of work (a hold's expiry,
/// the end of use) are kept in order too: the timer asks for the first.
#[derive(Debug, Clone, Default)]
pub(crate) struct ShardSlots {
    by_id: BTreeMap<ShardId, ShardSlot>,
    /// Never an empty map: a pair's entry goes with its last shard.
    by_pair: BTreeMap<PairKey, BTreeMap<ShardId, OpenEnd>>,
    /// Moves on with each shard added, removed or closed.
    generation: u64,
    /// Each open shard by its [`work_due`].
    by_work_due: BTreeSet<(u64, ShardId)>,
}

impl ShardSlots {
    /// Puts `slot` under `id`, in place of the one there.
    pub(crate) fn insert(&mut self, id: ShardId, slot: ShardSlot) {
        let pair = pair_of(&slot);
        let end = open_end(&slot);
        let due = work_due(&slot);
        if let Some(replaced) = self.by_id.insert(id.clone(), slot) {
            self.unlist(&id, &replaced);
        }
        if let Some(due) = due {
            self.by_work_due.insert((due, id.clone()));
        }
        self.by_pair.entry(pair).or_default().insert(id, end);
        self.generation += 1;
    }

    pub(crate) fn remove(&mut self, id: &ShardId) -> Option<ShardSlot> {
        let slot = self.by_id.remove(id)?;
        self.unlist(id, &slot);
        self.generation += 1;
        Some(slot)
    }

    /// Takes `slot`, no longer under `id`, out of the listings.
    fn unlist(&mut self, id: &ShardId, slot: &ShardSlot) {
        if let Some(due) = work_due(slot) {
            self.by_work_due.remove(&(due, id.clone()));
        }
        let pair = pair_of(slot);
        if let Some(ids) = self.by_pair.get_mut(&pair) {
            ids.remove(id);
            if ids.is_empty() {
                self.by_pair.remove(&pair);
            }
        }
    }

    /// The shards of `pair`, in ID order.
    pub(crate) fn of_pair(&self, pair: &PairKey) -> impl Iterator<Item = &ShardSlot> + Clone {
        self.by_pair
            .get(pair)
            .into_iter()
            .flat_map(BTreeMap::keys)
            .map(|id| &self.by_id[id])
    }

    /// Each pair that has shards, in pair order, with the boot epoch and
    /// the end of use of each of its open shards.
    pub(crate) fn open_ends_by_pair(
        &self,
    ) -> impl Iterator<Item = (&PairKey, impl Iterator<Item = (u64, u64)> + '_)> {
        self.by_pair
            .iter()
            .map(|(pair, ends)| (pair, ends.values().filter_map(|end| *end)))
    }

    pub(crate) fn get(&self, id: &ShardId) -> Option<&ShardSlot> {
        self.by_id.get(id)
    }

    /// Changes the book of shard `id`, if the core holds it, and returns
    /// what `change` returned. Only the book: a shard's document, and so
    /// its pair and its end, never changes once accepted. A book that
    /// closes never opens again, and its pair's listing learns of it here.
    pub(crate) fn change_book<R>(
        &mut self,
        id: &ShardId,
        change: impl FnOnce(&mut ShardBook) -> R,
    ) -> Option<R> {
        let slot = self.by_id.get_mut(id)?;
        let was_open = !slot.book.is_closed();
        let due_before = work_due(slot);
        let result = change(&mut slot.book);
        let due_after = work_due(slot);
        if due_after != due_before {
            if let Some(due) = due_before {
                self.by_work_due.remove(&(due, id.clone()));
            }
            if let Some(due) = due_after {
                self.by_work_due.insert((due, id.clone()));
            }
        }
        if was_open && slot.book.is_closed() {
            let end = self
                .by_pair
                .get_mut(&pair_of(slot))
                .and_then(|ends| ends.get_mut(id));
            if let Some(end) = end {
                *end = None;
            }
            self.generation += 1;
        }
        Some(result)
    }

    /// Moves on with each shard added, removed or closed: what the timer
    /// derives from [`ShardSlots::open_ends_by_pair`] holds until then.
    pub(crate) fn generation(&self) -> u64 {
        self.generation
    }

    /// The first time an open shard has work: a hold expires or its use
    /// ends.
    pub(crate) fn next_work_due(&self) -> Option<u64> {
        self.by_work_due.first().map(|(due, _)| *due)
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

    pub(crate) fn values(&self) -> impl Iterator<Item = &ShardSlot> {
        self.by_id.values()
    }

    /// Whether the listing by pair names each shard once, under its
    /// document's pair, with its end as its slot stands, and the open
    /// shards' times of work are as their slots stand (debug checks).
    pub(crate) fn is_consistent(&self) -> bool {
        let listed: usize = self.by_pair.values().map(BTreeMap::len).sum();
        let work_due: BTreeSet<(u64, ShardId)> = self
            .by_id
            .iter()
            .filter_map(|(id, slot)| Some((work_due(slot)?, id.clone())))
            .collect();
        listed == self.by_id.len()
            && work_due == self.by_work_due
            && self.by_pair.values().all(|ends| !ends.is_empty())
            && self.by_id.iter().all(|(id, slot)| {
                self.by_pair
                    .get(&pair_of(slot))
                    .and_then(|ends| ends.get(id))
                    .is_some_and(|end| *end == open_end(slot))
            })
    }
}

impl std::ops::Index<&ShardId> for ShardSlots {
    type Output = ShardSlot;

    fn index(&self, id: &ShardId) -> &ShardSlot {
        &self.by_id[id]
    }
}

fn pair_of(slot: &ShardSlot) -> PairKey {
    let shard = &slot.accepted.shard;
    PairKey::new(shard.subject.clone(), shard.route.clone())
}

/// When an open shard next has work: its first RESERVED hold's expiry or
/// the end of its use, whichever comes first.
fn work_due(slot: &ShardSlot) -> Option<u64> {
    let end = slot.accepted.usable_until_ms;
    (!slot.book.is_closed()).then(|| {
        slot.book
            .next_expiry_ms()
            .map_or(end, |expiry| expiry.min(end))
    })
}

fn open_end(slot: &ShardSlot) -> OpenEnd {
    (!slot.book.is_closed()).then_some((
        slot.accepted.shard.boot_epoch,
        slot.accepted.usable_until_ms,
    ))
}

#[cfg(test)]
mod tests {
    use ledger::ShardBook;
    use shard_format::{
        BootNonce, EmergencyShardV1, GatewayIdentity, KeyId, Route, Signature, Subject, Timestamp,
    };

    use super::*;
    use crate::AcceptedShard;

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
        assert!(slots.is_consistent());
        assert_eq!(slots.generation(), generation, "a hold changes no listing");

        // The hold goes back: the end of use again.
        let _ = slots.change_book(&first, |book| book.release(Some(hold)));
        assert_eq!(slots.next_work_due(), Some(60_000));

        // A second shard of the pair, and the first one closes: only the
        // second is open, and its end the only one listed.
        let (second, mut slot_2) = slot("s-2", "chat");
        slot_2.accepted.usable_until_ms = 70_000;
        slots.insert(second.clone(), slot_2);
        let _ = slots.change_book(&first, |book| {
            book.close(
                ShardCloseReason::ValidityEnded,
                Timestamp::from_unix_ms(0).expect("valid"),
            )
        });
        assert!(
            slots.generation() > generation,
            "a close changes the listing"
        );
        assert_eq!(slots.next_work_due(), Some(70_000));
        let ends: Vec<(String, Vec<(u64, u64)>)> = slots
            .open_ends_by_pair()
            .map(|(pair, ends)| (pair.route.as_str().to_owned(), ends.collect()))
            .collect();
        assert_eq!(ends, [("chat".to_owned(), vec![(1, 70_000)])]);
        assert!(slots.is_consistent());

        assert!(slots.remove(&second).is_some());
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
}
