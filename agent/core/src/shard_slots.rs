//! The core's shards, found by their ID or by their pair.

use std::collections::{BTreeMap, BTreeSet};

use ledger::PairKey;
use shard_format::ShardId;

use crate::ShardSlot;

/// Every shard the core holds, by ID, with the IDs of each pair's shards
/// beside them: admission from shards asks for one pair's, and a pass
/// over every shard cost each emergency reserve about 4 µs more at 1,000
/// shards than at 10 (docs/benchmarks-history.md). Both orders are the
/// shards' IDs', so a pair's shards come in the order a pass over all of
/// them met them.
#[derive(Debug, Clone, Default)]
pub(crate) struct ShardSlots {
    by_id: BTreeMap<ShardId, ShardSlot>,
    /// Never an empty set: a pair's entry goes with its last shard.
    by_pair: BTreeMap<PairKey, BTreeSet<ShardId>>,
}

impl ShardSlots {
    /// Puts `slot` under `id`, in place of the one there.
    pub(crate) fn insert(&mut self, id: ShardId, slot: ShardSlot) {
        let pair = pair_of(&slot);
        if let Some(replaced) = self.by_id.insert(id.clone(), slot) {
            self.unlist(&id, &pair_of(&replaced));
        }
        self.by_pair.entry(pair).or_default().insert(id);
    }

    pub(crate) fn remove(&mut self, id: &ShardId) -> Option<ShardSlot> {
        let slot = self.by_id.remove(id)?;
        self.unlist(id, &pair_of(&slot));
        Some(slot)
    }

    fn unlist(&mut self, id: &ShardId, pair: &PairKey) {
        if let Some(ids) = self.by_pair.get_mut(pair) {
            ids.remove(id);
            if ids.is_empty() {
                self.by_pair.remove(pair);
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

    pub(crate) fn get(&self, id: &ShardId) -> Option<&ShardSlot> {
        self.by_id.get(id)
    }

    /// The slot of `id`, to change its book. A shard's document, and so
    /// its pair, never changes once accepted.
    pub(crate) fn get_mut(&mut self, id: &ShardId) -> Option<&mut ShardSlot> {
        self.by_id.get_mut(id)
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
}
