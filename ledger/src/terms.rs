//! The eight terms of the central equation and the four of the shard
//! equation, with checked arithmetic.

use serde::{Deserialize, Serialize};

/// A sum or difference left the `u64` range. Every transition that could
/// overflow returns it as a named rejection instead of wrapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("arithmetic overflow in the ledger's unit terms")]
pub struct Overflow;

pub(crate) fn add(a: u64, b: u64) -> Result<u64, Overflow> {
    a.checked_add(b).ok_or(Overflow)
}

pub(crate) fn sub(a: u64, b: u64) -> Result<u64, Overflow> {
    a.checked_sub(b).ok_or(Overflow)
}

/// One account's terms:
///
/// ```text
/// opening + minted + overdraftIssued
///   = available + reserved + spent + retiredForEmergency + overdraftRepaid
/// debt = overdraftIssued − overdraftRepaid
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AccountTerms {
    pub opening: u64,
    pub minted: u64,
    pub overdraft_issued: u64,
    pub available: u64,
    pub reserved: u64,
    pub spent: u64,
    pub retired_for_emergency: u64,
    pub overdraft_repaid: u64,
}

impl AccountTerms {
    /// A fresh account holding `opening` units, all available.
    pub fn open(opening: u64) -> Self {
        Self {
            opening,
            available: opening,
            ..Self::default()
        }
    }

    /// Left side of the equation, or `None` on overflow.
    pub fn sources(&self) -> Option<u64> {
        self.opening
            .checked_add(self.minted)?
            .checked_add(self.overdraft_issued)
    }

    /// Right side of the equation, or `None` on overflow.
    pub fn uses(&self) -> Option<u64> {
        self.available
            .checked_add(self.reserved)?
            .checked_add(self.spent)?
            .checked_add(self.retired_for_emergency)?
            .checked_add(self.overdraft_repaid)
    }

    /// Whether the central equation holds (and repayments never exceed
    /// issued overdraft).
    pub fn is_balanced(&self) -> bool {
        matches!((self.sources(), self.uses()), (Some(left), Some(right)) if left == right)
            && self.overdraft_repaid <= self.overdraft_issued
    }

    /// `overdraftIssued − overdraftRepaid`.
    pub fn debt(&self) -> u64 {
        self.overdraft_issued.saturating_sub(self.overdraft_repaid)
    }
}

/// One emergency shard's terms:
///
/// ```text
/// allocated = localAvailable + localReserved + localSpent + localRetired
/// ```
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ShardTerms {
    pub allocated: u64,
    pub local_available: u64,
    pub local_reserved: u64,
    pub local_spent: u64,
    pub local_retired: u64,
}

impl ShardTerms {
    pub fn allocate(allocated: u64) -> Self {
        Self {
            allocated,
            local_available: allocated,
            ..Self::default()
        }
    }

    /// Whether the shard equation holds.
    pub fn is_balanced(&self) -> bool {
        let uses = self
            .local_available
            .checked_add(self.local_reserved)
            .and_then(|sum| sum.checked_add(self.local_spent))
            .and_then(|sum| sum.checked_add(self.local_retired));
        uses == Some(self.allocated)
    }
}
