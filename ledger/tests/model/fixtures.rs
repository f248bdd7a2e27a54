//! The small, fixed world the model test plays in: two pairs, a pool of
//! reservation, operation and shard IDs (small so that IDs collide), two
//! gateways, and a cheap deterministic signature scheme (docs/design.md
//! §8.1: the simulator uses one; ed25519 itself is tested in `shard-format`).

use std::collections::BTreeSet;

use ledger::{PairKey, ReservationOrigin};
use shard_format::{
    AdmissionBudgetV1, BootNonce, Digest, DocumentSigner, DocumentVerifier, EmergencyMode,
    GatewayIdentity, IdempotencyKey, KeyId, OperationId, Refill, ReservationId, Route, RouteMode,
    ShardId, Signature, SignatureError, Subject, Timestamp,
};

/// 2026-07-19T14:00:00.000Z: aligned to every accounting epoch length used.
pub const START_MS: u64 = 1_784_469_600_000;
pub const PAIRS: usize = 2;
/// Pairs a multi-leg reserve's further legs may name: the `PAIRS` above
/// and two more, published at the start, that carry only further legs.
pub const LEG_PAIRS: usize = 4;
pub const RESERVATIONS: usize = 6;
pub const OPERATIONS: usize = 3;
pub const SHARDS: usize = 4;
pub const GATEWAYS: usize = 2;

pub fn start_time() -> Timestamp {
    Timestamp::from_unix_ms(START_MS).expect("valid")
}

pub fn pair_key(index: usize) -> PairKey {
    PairKey::new(
        Subject::new(format!("tenant-{index}")).expect("valid"),
        Route::new("chat.generate").expect("valid"),
    )
}

/// The gateway that makes every reservation of the model.
pub fn owner() -> GatewayIdentity {
    gateway_identity(0)
}

/// The pair reservation `index` belongs to: its ID is derived from it, so
/// a reserve of that ID on another pair is not in the owner's namespace.
/// The first four live on pair 0 (the worked examples use them), the rest
/// on pair 1.
pub fn home_pair(index: usize) -> usize {
    if index < 4 { 0 } else { 1 % PAIRS }
}

pub fn idempotency_key(index: usize) -> IdempotencyKey {
    IdempotencyKey::new(format!("req-{index}")).expect("valid")
}

/// What the owner derived reservation `index`'s ID from.
pub fn origin(index: usize) -> ReservationOrigin {
    let pair = pair_key(home_pair(index));
    ReservationOrigin {
        subject: pair.subject,
        route: pair.route,
        idempotency_key: idempotency_key(index),
    }
}

pub fn reservation_id(index: usize) -> ReservationId {
    let pair = pair_key(home_pair(index));
    ReservationId::derive(
        &owner(),
        &pair.subject,
        &pair.route,
        &idempotency_key(index),
    )
}

pub fn operation_id(index: usize) -> OperationId {
    OperationId::new(format!("op-{index}")).expect("valid")
}

pub fn shard_id(index: usize) -> ShardId {
    ShardId::new(format!("shard-{index}")).expect("valid")
}

pub fn gateway_identity(index: usize) -> GatewayIdentity {
    KeyId::new(format!("sim:gateway-{index}")).expect("valid")
}

pub fn gateway_index(identity: &GatewayIdentity) -> usize {
    (0..GATEWAYS)
        .find(|index| gateway_identity(*index) == *identity)
        .expect("a pool gateway")
}

/// The request digest of reservation `index`'s request variant `variant`:
/// another variant is another request under the same ID.
pub fn request_digest(index: usize, variant: u8) -> Digest {
    Digest::sha256(format!("request/{index}/{variant}").as_bytes())
}

/// The `count`-th boot nonce the shell draws (never all zero).
pub fn boot_nonce(count: u64) -> BootNonce {
    let mut bytes = [0u8; 16];
    bytes[..8].copy_from_slice(&(count + 1).to_le_bytes());
    bytes[8] = 0x5a;
    BootNonce(bytes)
}

/// A nonce no registration ever hands out.
pub fn foreign_nonce() -> BootNonce {
    BootNonce([0xee; 16])
}

/// A cheap deterministic signer: `sha256(keyId ‖ message)` twice over.
#[derive(Debug, Clone)]
pub struct SimSigner {
    key_id: KeyId,
}

impl SimSigner {
    pub fn new(key_id: KeyId) -> Self {
        Self { key_id }
    }
}

fn sim_signature(key_id: &KeyId, message: &[u8]) -> Signature {
    let mut input = key_id.as_str().as_bytes().to_vec();
    input.push(0);
    input.extend_from_slice(message);
    let first = Digest::sha256(&input);
    let second = Digest::sha256(&first.0);
    let mut bytes = [0u8; 64];
    bytes[..32].copy_from_slice(&first.0);
    bytes[32..].copy_from_slice(&second.0);
    Signature(bytes)
}

impl DocumentSigner for SimSigner {
    fn key_id(&self) -> &KeyId {
        &self.key_id
    }
    fn sign(&self, message: &[u8]) -> Signature {
        sim_signature(&self.key_id, message)
    }
}

/// Verifies [`SimSigner`] signatures under the keys it trusts.
#[derive(Debug, Clone)]
pub struct SimVerifier {
    trusted: BTreeSet<KeyId>,
}

impl DocumentVerifier for SimVerifier {
    fn verify(
        &self,
        key_id: &KeyId,
        message: &[u8],
        signature: &Signature,
    ) -> Result<(), SignatureError> {
        if !self.trusted.contains(key_id) {
            return Err(SignatureError::UntrustedKey(key_id.clone()));
        }
        if sim_signature(key_id, message) != *signature {
            return Err(SignatureError::Mismatch);
        }
        Ok(())
    }
}

pub fn central_key() -> KeyId {
    KeyId::new("sim:central").expect("valid")
}

pub fn central_signer() -> SimSigner {
    SimSigner::new(central_key())
}

pub fn gateway_signer(index: usize) -> SimSigner {
    SimSigner::new(gateway_identity(index))
}

/// The central ledger's verifier of terminal receipts: it trusts every
/// enrolled gateway key (both pool gateways).
pub fn receipt_verifier() -> SimVerifier {
    SimVerifier {
        trusted: (0..GATEWAYS).map(gateway_identity).collect(),
    }
}

/// The knobs of a published policy the test varies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PolicyParams {
    pub opening: u64,
    /// `burst − opening`.
    pub burst_extra: u64,
    pub refill_units: u64,
    pub accounting_epoch_ms: u64,
    pub reservation_units_max: u64,
    pub hold_ttl_ms: u64,
    pub overdraft_units_max: u64,
    pub execution_hard_limit_ms: u64,
    /// 0: emergency shards disabled.
    pub emergency_shard_units: u64,
    pub mode: RouteMode,
    /// Publish a policy that breaks `opening ≤ burst`.
    pub invalid: bool,
}

impl PolicyParams {
    /// The worked examples' policy (docs/design.md §4.7), with a one-minute
    /// epoch so that epochs turn over within a test case.
    pub fn standard() -> Self {
        Self {
            opening: 1000,
            burst_extra: 0,
            refill_units: 100,
            accounting_epoch_ms: 60_000,
            reservation_units_max: 800,
            hold_ttl_ms: 5_000,
            overdraft_units_max: 200,
            execution_hard_limit_ms: 20_000,
            emergency_shard_units: 200,
            mode: RouteMode::Enforce,
            invalid: false,
        }
    }
}

pub fn policy(pair: usize, generation: u64, params: PolicyParams) -> AdmissionBudgetV1 {
    let key = pair_key(pair);
    let burst = (params.opening + params.burst_extra).max(100);
    let opening = if params.invalid {
        burst + 1
    } else {
        params.opening
    };
    let emergency_shard_units = params.emergency_shard_units.min(burst);
    AdmissionBudgetV1 {
        schema: Default::default(),
        subject: key.subject,
        route: key.route,
        region: "eu-west-1".into(),
        capacity_unit: "tokens".into(),
        policy_generation: generation,
        opening,
        refill: Refill {
            units: params.refill_units,
            interval_ms: 1000,
        },
        burst,
        accounting_epoch_ms: params.accounting_epoch_ms,
        estimator_digest: Digest([7; 32]),
        reservation_units_max: params.reservation_units_max.min(burst),
        hold_ttl_ms: params.hold_ttl_ms,
        priority: 0,
        fairness_weight: 1,
        overdraft_units_max: params.overdraft_units_max,
        execution_hard_limit_ms: params.execution_hard_limit_ms,
        emergency_mode: if emergency_shard_units > 0 {
            EmergencyMode::Enabled
        } else {
            EmergencyMode::Disabled
        },
        mode: params.mode,
        emergency_shard_units,
        emergency_shard_validity_ms: 600_000,
    }
}
