//! The terminal receipts the agent signed, kept until the center
//! acknowledged them and their retention window passed.

use std::collections::{BTreeMap, BTreeSet};

use shard_format::{ShardId, ShardTerminalReceiptV1};

/// Every terminal receipt by its shard, with whether the center
/// acknowledged it. A receipt stays for the retention window after its
/// shard closed, so with the default shards (ten minutes) and window (a
/// day) a pair leaves about 144 of them: the timer polled once per turn of
/// the daemon must not pass over them all. The receipts are also kept in
/// the two orders it asks for, the unacknowledged ones (the retry uploads
/// them) and the acknowledged ones by close time (retention forgets them);
/// each change goes through here to keep those in step.
#[derive(Debug, Clone, Default)]
pub(crate) struct TerminalReceipts {
    by_shard: BTreeMap<ShardId, (ShardTerminalReceiptV1, bool)>,
    unacknowledged: BTreeSet<ShardId>,
    /// `(closed_at` in Unix ms`, shard)` of each acknowledged receipt.
    acknowledged_by_close: BTreeSet<(u64, ShardId)>,
}

impl TerminalReceipts {
    /// The receipt of `shard` and whether it was acknowledged.
    pub(crate) fn get(&self, shard: &ShardId) -> Option<&(ShardTerminalReceiptV1, bool)> {
        self.by_shard.get(shard)
    }

    pub(crate) fn contains_key(&self, shard: &ShardId) -> bool {
        self.by_shard.contains_key(shard)
    }

    /// Every receipt with whether it was acknowledged, in shard order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (&ShardTerminalReceiptV1, bool)> {
        self.by_shard
            .values()
            .map(|(receipt, acknowledged)| (receipt, *acknowledged))
    }

    /// Puts `receipt` under its shard, in place of the one there.
    pub(crate) fn insert(&mut self, receipt: ShardTerminalReceiptV1, acknowledged: bool) {
        let shard = receipt.shard.clone();
        self.remove(&shard);
        if acknowledged {
            self.acknowledged_by_close
                .insert((receipt.closed_at.unix_ms(), shard.clone()));
        } else {
            self.unacknowledged.insert(shard.clone());
        }
        self.by_shard.insert(shard, (receipt, acknowledged));
    }

    /// Marks the receipt of `shard` acknowledged; returns it, if there is
    /// one.
    pub(crate) fn acknowledge(&mut self, shard: &ShardId) -> Option<&ShardTerminalReceiptV1> {
        let (receipt, acknowledged) = self.by_shard.get_mut(shard)?;
        if !*acknowledged {
            *acknowledged = true;
            self.unacknowledged.remove(shard);
            self.acknowledged_by_close
                .insert((receipt.closed_at.unix_ms(), shard.clone()));
        }
        Some(receipt)
    }

    /// Removes the receipt of `shard`; returns whether there was one.
    pub(crate) fn remove(&mut self, shard: &ShardId) -> bool {
        let Some((receipt, acknowledged)) = self.by_shard.remove(shard) else {
            return false;
        };
        if acknowledged {
            self.acknowledged_by_close
                .remove(&(receipt.closed_at.unix_ms(), shard.clone()));
        } else {
            self.unacknowledged.remove(shard);
        }
        true
    }

    /// The shards whose receipts wait for the center's acknowledgement, in
    /// shard order.
    pub(crate) fn unacknowledged(&self) -> impl Iterator<Item = &ShardId> {
        self.unacknowledged.iter()
    }

    pub(crate) fn unacknowledged_count(&self) -> usize {
        self.unacknowledged.len()
    }

    /// The acknowledged receipts, `(closed_at` in Unix ms`, shard)`, the
    /// earliest closed first.
    pub(crate) fn acknowledged_by_close(&self) -> impl Iterator<Item = (u64, &ShardId)> {
        self.acknowledged_by_close
            .iter()
            .map(|(closed_at, shard)| (*closed_at, shard))
    }

    /// Whether both orders list exactly the receipts (debug checks).
    pub(crate) fn is_consistent(&self) -> bool {
        let mut unacknowledged = Vec::new();
        let mut by_close = BTreeSet::new();
        for (shard, (receipt, acknowledged)) in &self.by_shard {
            if *acknowledged {
                by_close.insert((receipt.closed_at.unix_ms(), shard));
            } else {
                unacknowledged.push(shard);
            }
        }
        // Both in shard order.
        unacknowledged.into_iter().eq(self.unacknowledged.iter())
            && by_close.into_iter().eq(self.acknowledged_by_close())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tests::terminal_receipt as receipt;

    fn id(shard: &str) -> ShardId {
        ShardId::new(shard).expect("valid")
    }

    fn acknowledged(receipts: &TerminalReceipts) -> Vec<(u64, &str)> {
        receipts
            .acknowledged_by_close()
            .map(|(closed_at, shard)| (closed_at, shard.as_str()))
            .collect()
    }

    #[test]
    fn a_receipt_moves_from_unacknowledged_to_the_close_order_once() {
        let mut receipts = TerminalReceipts::default();
        receipts.insert(receipt("s-1", 2_000), false);
        assert_eq!(receipts.unacknowledged().collect::<Vec<_>>(), [&id("s-1")]);
        assert_eq!(receipts.unacknowledged_count(), 1);
        assert!(acknowledged(&receipts).is_empty());

        let shard = receipts.acknowledge(&id("s-1")).map(|r| r.shard.clone());
        assert_eq!(shard, Some(id("s-1")));
        assert_eq!(receipts.unacknowledged_count(), 0);
        assert_eq!(acknowledged(&receipts), [(2_000, "s-1")]);
        assert_eq!(receipts.get(&id("s-1")).map(|(_, ack)| *ack), Some(true));

        // Again: still there, still listed once.
        assert!(receipts.acknowledge(&id("s-1")).is_some());
        assert_eq!(acknowledged(&receipts), [(2_000, "s-1")]);
        assert!(receipts.acknowledge(&id("s-2")).is_none());
        assert!(receipts.is_consistent());

        assert!(receipts.remove(&id("s-1")));
        assert!(!receipts.remove(&id("s-1")));
        assert!(!receipts.contains_key(&id("s-1")));
        assert!(acknowledged(&receipts).is_empty());
        assert!(receipts.is_consistent());
    }

    #[test]
    fn acknowledged_receipts_come_in_close_order_not_shard_order() {
        let mut receipts = TerminalReceipts::default();
        receipts.insert(receipt("s-a", 3_000), true);
        receipts.insert(receipt("s-b", 1_000), true);
        receipts.insert(receipt("s-c", 2_000), false);
        receipts.insert(receipt("s-d", 1_000), true);
        assert_eq!(
            acknowledged(&receipts),
            [(1_000, "s-b"), (1_000, "s-d"), (3_000, "s-a")]
        );
        let all: Vec<(&str, bool)> = receipts
            .iter()
            .map(|(receipt, ack)| (receipt.shard.as_str(), ack))
            .collect();
        assert_eq!(
            all,
            [("s-a", true), ("s-b", true), ("s-c", false), ("s-d", true)]
        );
        assert!(receipts.is_consistent());
    }

    #[test]
    fn a_receipt_put_again_replaces_the_one_listed() {
        let mut receipts = TerminalReceipts::default();
        receipts.insert(receipt("s-1", 1_000), true);
        receipts.insert(receipt("s-1", 5_000), false);
        assert!(acknowledged(&receipts).is_empty());
        assert_eq!(receipts.unacknowledged_count(), 1);
        receipts.insert(receipt("s-1", 7_000), true);
        assert_eq!(receipts.unacknowledged_count(), 0);
        assert_eq!(acknowledged(&receipts), [(7_000, "s-1")]);
        assert!(receipts.is_consistent());
    }

    #[test]
    fn an_order_out_of_step_is_seen() {
        let mut receipts = TerminalReceipts::default();
        receipts.insert(receipt("s-1", 1_000), false);
        receipts.unacknowledged.clear();
        assert!(!receipts.is_consistent());

        let mut receipts = TerminalReceipts::default();
        receipts.insert(receipt("s-1", 1_000), true);
        receipts.acknowledged_by_close.insert((2_000, id("s-1")));
        assert!(!receipts.is_consistent());
    }
}
