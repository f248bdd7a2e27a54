//! The contract every [`BatchStore`] passes: [`check_batch_store`] drives
//! real operations through the steps the writer takes (scope, begin, apply,
//! commit) and checks each item of the [`BatchStore`] contract;
//! [`check_failed_commit`] checks a commit that fails, for stores whose
//! commits a test can make fail; [`check_commit_behind`] and
//! [`check_failed_commit_behind`] check contract item 5 for stores that
//! commit behind the writer. All panic with the broken item.
//!
//! `central/tests/store_contract.rs` runs them against memory, redb and
//! PostgreSQL.

use ledger::protocol::views::AuditResponse;
use ledger::protocol::{Context, Gauges, Operation, Reply};
use ledger::store::contract::sample_policy;
use ledger::{
    AbandonOutcome, AbandonRequest, Caller, ForgetOutcome, IssueShardOutcome, IssueShardRequest,
    PairKey, PublishOutcome, RegisterOutcome, ReleaseOutcome, ReservationOrigin, ReserveOutcome,
    ReserveRequest, SettleOutcome, StartOutcome,
};
use shard_format::{
    AdmissionBudgetV1, BootNonce, Digest, DocumentSigner, Ed25519Signer, GatewayIdentity,
    IdempotencyKey, KeyId, LimitReservationV1, OperationId, ReservationId, ReservationState, Route,
    ShardId, Subject, Timestamp,
};

use super::{BatchStore, batch_scope};
use crate::keys::GatewayKeys;

/// 2026-07-19T14:00:00.000Z: the start of an accounting epoch.
const T0_MS: u64 = 1_784_469_600_000;

/// Runs every check of the [`BatchStore`] contract, each on a store from
/// `fresh` (empty). `reopen` closes a store and opens it again over the
/// same data: a restart.
pub async fn check_batch_store<S: BatchStore>(
    mut fresh: impl AsyncFnMut() -> S,
    mut reopen: impl AsyncFnMut(S) -> S,
) {
    let signer = signer();
    let harness = Harness {
        context: Context {
            signer: &signer,
            gateway_verifier: &GatewayKeys::default(),
        },
    };
    harness.empty_store_is_clean(fresh().await).await;
    harness
        .reserve_start_settle_across_batches(fresh().await, &mut reopen)
        .await;
    harness
        .aborted_batch_changes_nothing(fresh().await, &mut reopen)
        .await;
    harness.disjoint_batches(fresh().await, &mut reopen).await;
    harness
        .record_under_another_pair_is_deferred(fresh().await)
        .await;
    harness.sweeps_find_what_is_due(fresh().await).await;
    harness.legs_move_together(fresh().await).await;
    harness
        .open_shards_of_every_boot_and_epoch_count(fresh().await)
        .await;
    harness
        .forgets_past_the_window(fresh().await, &mut reopen)
        .await;
}

/// Contract item 3 for a failed commit: `fail_next_commit` makes the next
/// commit of `store` fail (it is called between `begin` and `commit`); the
/// commit must fail, `abort` must bring back what was last committed, and
/// the store must go on serving batches.
pub async fn check_failed_commit<S: BatchStore>(
    mut store: S,
    fail_next_commit: impl AsyncFnOnce(&mut S),
) {
    let signer = signer();
    let harness = Harness {
        context: Context {
            signer: &signer,
            gateway_verifier: &GatewayKeys::default(),
        },
    };
    harness.publish(&mut store, &[pair_a()]).await;
    harness
        .committed(
            &mut store,
            vec![Operation::Reserve(reserve(&pair_a(), "rl-kept", 100))],
        )
        .await;
    let before = audit(&mut store).await;
    let changes = harness
        .reserved_uncommitted(&mut store, "rl-lost", 50)
        .await;
    fail_next_commit(&mut store).await;
    assert!(
        store.commit(&changes).await.is_err(),
        "the injected fault fails the commit"
    );
    store
        .abort()
        .await
        .expect("contract 3: a store rebuilds after a failed commit");
    assert_eq!(
        harness.reservation(&mut store, "rl-lost").await,
        None,
        "contract 3: nothing of a failed commit survives"
    );
    assert_eq!(
        audit(&mut store).await,
        before,
        "contract 3: a failed commit changes nothing"
    );
    let again = harness
        .committed(
            &mut store,
            vec![Operation::Reserve(reserve(&pair_a(), "rl-lost", 50))],
        )
        .await;
    assert!(
        is_reserved(&again[0]),
        "contract 3: the store serves batches after a failed commit: {again:?}"
    );
}

/// Contract item 5, for a store that commits behind: a batch begun while a
/// commit is under way sees its changes, and once both commits resolved a
/// reopened store holds both.
pub async fn check_commit_behind<S: BatchStore>(mut store: S, reopen: impl AsyncFnOnce(S) -> S) {
    let signer = signer();
    let harness = Harness {
        context: Context {
            signer: &signer,
            gateway_verifier: &GatewayKeys::default(),
        },
    };
    harness.publish(&mut store, &[pair_a()]).await;
    let first = harness
        .reserved_uncommitted(&mut store, "rl-first", 100)
        .await;
    let under_way = store
        .commit_behind(first)
        .expect("contract 5: the store commits behind");
    let second = harness
        .reserved_uncommitted(&mut store, "rl-second", 30)
        .await;
    under_way.await.expect("contract 5: the first commit lands");
    store
        .commit_behind(second)
        .expect("contract 5: the store commits behind")
        .await
        .expect("contract 5: the second commit lands");
    let mut store = reopen(store).await;
    assert_eq!(
        harness.account(&mut store, &pair_a()).await,
        (130, 0),
        "contract 5: both commits are stored, the second on top of the first"
    );
}

/// Contract item 5 for a commit behind that fails (`fail_next_commit`
/// makes it fail): `abort` drops it and the batch applied on top of it.
pub async fn check_failed_commit_behind<S: BatchStore>(
    mut store: S,
    fail_next_commit: impl AsyncFnOnce(&mut S),
) {
    let signer = signer();
    let harness = Harness {
        context: Context {
            signer: &signer,
            gateway_verifier: &GatewayKeys::default(),
        },
    };
    harness.publish(&mut store, &[pair_a()]).await;
    let before = audit(&mut store).await;
    let failing = harness
        .reserved_uncommitted(&mut store, "rl-failing", 100)
        .await;
    fail_next_commit(&mut store).await;
    let under_way = store
        .commit_behind(failing)
        .expect("contract 5: the store commits behind");
    harness
        .reserved_uncommitted(&mut store, "rl-on-top", 30)
        .await;
    assert!(
        under_way.await.is_err(),
        "the injected fault fails the commit"
    );
    store
        .abort()
        .await
        .expect("contract 3: a store rebuilds after a failed commit");
    for name in ["rl-failing", "rl-on-top"] {
        assert_eq!(
            harness.reservation(&mut store, name).await,
            None,
            "contract 5: nothing of a failed commit nor of what was applied on top survives"
        );
    }
    assert_eq!(audit(&mut store).await, before);
}

/// A fixed shard-signing key (the checks issue no shards).
fn signer() -> Ed25519Signer {
    Ed25519Signer::from_secret_bytes(&[7; 32])
}

fn t0() -> Timestamp {
    Timestamp::from_unix_ms(T0_MS).expect("valid")
}

fn pair(subject: &str) -> PairKey {
    PairKey::new(
        Subject::new(subject).expect("valid"),
        Route::new("chat.generate").expect("valid"),
    )
}

fn pair_a() -> PairKey {
    pair("tenant-7")
}

fn pair_b() -> PairKey {
    pair("tenant-8")
}

/// [`sample_policy`] for `pair`.
fn policy(pair: &PairKey) -> AdmissionBudgetV1 {
    let mut policy = sample_policy(1);
    policy.subject = pair.subject.clone();
    policy.route = pair.route.clone();
    policy
}

/// The gateway that owns the contract's reservations.
fn owner() -> GatewayIdentity {
    KeyId::new(format!("ed25519:{}", "22".repeat(32))).expect("valid")
}

/// The pair of the contract's reservation `name`: a few live on pair B.
fn pair_of(name: &str) -> PairKey {
    if matches!(name, "rl-2" | "rl-b" | "rl-b2" | "rl-shared-b" | "rl-long") {
        pair_b()
    } else {
        pair_a()
    }
}

fn key(name: &str) -> IdempotencyKey {
    IdempotencyKey::new(name).expect("valid")
}

/// The ID [`owner`] derives for `name` on its pair.
fn reservation_id(name: &str) -> ReservationId {
    let pair = pair_of(name);
    ReservationId::derive(&owner(), &pair.subject, &pair.route, &key(name))
}

fn reserve(pair: &PairKey, name: &str, units: u64) -> ReserveRequest {
    assert_eq!(
        *pair,
        pair_of(name),
        "reservation {name} lives on another pair"
    );
    ReserveRequest::new(
        owner(),
        key(name),
        pair.subject.clone(),
        pair.route.clone(),
        units,
        Digest::sha256(format!("{name}/{units}").as_bytes()),
    )
}

fn get(name: &str) -> Operation {
    Operation::GetReservation {
        reservation: reservation_id(name),
        caller: Caller::Gateway(owner()),
    }
}

fn release(name: &str) -> Operation {
    Operation::Release {
        reservation: reservation_id(name),
        caller: owner(),
    }
}

fn abandon(name: &str) -> Operation {
    let pair = pair_of(name);
    Operation::Abandon(AbandonRequest {
        reservation: reservation_id(name),
        caller: Caller::Gateway(owner()),
        origin: Some(ReservationOrigin {
            subject: pair.subject,
            route: pair.route,
            idempotency_key: key(name),
        }),
    })
}

fn is_reserved(reply: &Reply) -> bool {
    matches!(reply, Reply::Reserve(ReserveOutcome::Reserved(_)))
}

async fn audit<S: BatchStore>(store: &mut S) -> AuditResponse {
    store.audit().await.expect("the audit reads the store")
}

struct Harness<'a> {
    context: Context<'a>,
}

impl Harness<'_> {
    /// Reserves `units` under `id` on pair A in an open batch, and returns
    /// the changes without committing them: the batch stays open.
    async fn reserved_uncommitted<S: BatchStore>(
        &self,
        store: &mut S,
        id: &str,
        units: u64,
    ) -> Vec<ledger::Change> {
        let now = t0();
        let operation = Operation::Reserve(reserve(&pair_a(), id, units));
        let (mut scope, named) = batch_scope([(&operation, false)]);
        store
            .complete_scope(&mut scope, &named, now)
            .await
            .expect("scope");
        let mut batch = store.begin(&scope, now).await.expect("begin");
        let mut changes = Vec::new();
        let reply = batch
            .apply(operation, now, self.context, &mut changes)
            .expect("not deferred");
        assert!(is_reserved(&reply), "{reply:?}");
        changes
    }

    /// One batch as the writer runs it; `retried` marks operations that
    /// were deferred before. The replies, `None` for an operation deferred
    /// again. Panics if a step fails (no fault is injected here).
    async fn batch<S: BatchStore>(
        &self,
        store: &mut S,
        operations: Vec<(Operation, bool)>,
        now: Timestamp,
    ) -> Vec<Option<Reply>> {
        let (mut scope, named) = batch_scope(
            operations
                .iter()
                .map(|(operation, retried)| (operation, *retried)),
        );
        store
            .complete_scope(&mut scope, &named, now)
            .await
            .expect("the store completes the scope");
        let mut batch = store.begin(&scope, now).await.expect("the batch begins");
        let mut changes = Vec::new();
        let replies = operations
            .into_iter()
            .map(|(operation, _)| batch.apply(operation, now, self.context, &mut changes).ok())
            .collect();
        store.commit(&changes).await.expect("the batch commits");
        replies
    }

    /// A batch of first tries at `now` whose operations must all apply.
    async fn committed_at<S: BatchStore>(
        &self,
        store: &mut S,
        operations: Vec<Operation>,
        now: Timestamp,
    ) -> Vec<Reply> {
        let operations = operations
            .into_iter()
            .map(|operation| (operation, false))
            .collect();
        self.batch(store, operations, now)
            .await
            .into_iter()
            .map(|reply| reply.expect("contract 1: records of locked pairs are never deferred"))
            .collect()
    }

    async fn committed<S: BatchStore>(
        &self,
        store: &mut S,
        operations: Vec<Operation>,
    ) -> Vec<Reply> {
        self.committed_at(store, operations, t0()).await
    }

    async fn publish<S: BatchStore>(&self, store: &mut S, pairs: &[PairKey]) {
        let operations = pairs
            .iter()
            .map(|pair| Operation::Publish(Box::new(policy(pair))))
            .collect();
        for reply in self.committed(store, operations).await {
            assert_eq!(reply, Reply::Publish(PublishOutcome::Published));
        }
    }

    /// The receipt of a reservation, as a batch reads it.
    async fn reservation<S: BatchStore>(
        &self,
        store: &mut S,
        name: &str,
    ) -> Option<LimitReservationV1> {
        let replies = self.committed(store, vec![get(name)]).await;
        match &replies[0] {
            Reply::Reservation { receipt, .. } => receipt.clone(),
            other => panic!("unexpected {other:?}"),
        }
    }

    /// `(reserved, spent)` of a pair's only account, as a batch reads it.
    async fn account<S: BatchStore>(&self, store: &mut S, pair: &PairKey) -> (u64, u64) {
        let replies = self
            .committed(store, vec![Operation::GetAccounts(pair.clone())])
            .await;
        match &replies[0] {
            Reply::Accounts(Some(view)) => {
                assert_eq!(view.accounts.len(), 1, "one account per pair here");
                let terms = view.accounts[0].terms;
                (terms.reserved, terms.spent)
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    async fn empty_store_is_clean<S: BatchStore>(&self, mut store: S) {
        let audit = audit(&mut store).await;
        assert!(audit.ok, "an empty store audits clean: {audit:?}");
        assert_eq!(
            (audit.accounts, audit.reservations, audit.pairs.len()),
            (0, 0, 0),
            "an empty store holds nothing"
        );
        let gauges = store.gauges().await.expect("gauges");
        assert_eq!(
            Gauges {
                // An empty table still takes pages on disk.
                store_bytes: 0,
                ..gauges
            },
            Gauges::default(),
            "an empty store has zero gauges"
        );
        assert_eq!(self.reservation(&mut store, "rl-none").await, None);
    }

    /// Contract items 1 and 2: each batch sees what the ones before it
    /// committed, and a reopened store loads exactly that.
    async fn reserve_start_settle_across_batches<S: BatchStore>(
        &self,
        mut store: S,
        reopen: &mut impl AsyncFnMut(S) -> S,
    ) {
        self.publish(&mut store, &[pair_a(), pair_b()]).await;
        let replies = self
            .committed(
                &mut store,
                vec![
                    Operation::Reserve(reserve(&pair_a(), "rl-1", 100)),
                    Operation::Reserve(reserve(&pair_b(), "rl-2", 50)),
                ],
            )
            .await;
        assert!(replies.iter().all(is_reserved), "{replies:?}");
        let operation = OperationId::new("op-1").expect("valid");
        let replies = self
            .committed(
                &mut store,
                vec![
                    Operation::Start {
                        reservation: reservation_id("rl-1"),
                        operation_id: operation.clone(),
                        deadline_ms: None,
                        caller: owner(),
                    },
                    get("rl-2"),
                ],
            )
            .await;
        assert!(
            matches!(replies[0], Reply::Start(StartOutcome::Started(_))),
            "contract 1: a later batch starts a committed reservation: {replies:?}"
        );
        let replies = self
            .committed(
                &mut store,
                vec![Operation::Settle {
                    reservation: reservation_id("rl-1"),
                    operation_id: operation,
                    actuals: ledger::SettleActuals::One(60),
                    caller: owner(),
                }],
            )
            .await;
        assert!(
            matches!(replies[0], Reply::Settle(SettleOutcome::Settled(_))),
            "contract 1: a later batch settles a started reservation: {replies:?}"
        );
        assert_eq!(self.account(&mut store, &pair_a()).await, (0, 60));
        assert_eq!(self.account(&mut store, &pair_b()).await, (50, 0));
        let gauges = store.gauges().await.expect("gauges");
        assert_eq!(gauges.units_reserved, 50);
        let before = audit(&mut store).await;
        if let Some(beside) = store.read_beside(&Operation::Gauges) {
            assert_eq!(
                beside.await.expect("gauges beside"),
                Reply::Gauges(gauges),
                "the gauges read beside the batches are the same"
            );
        }
        if let Some(beside) = store.read_beside(&Operation::Audit) {
            assert_eq!(
                beside.await.expect("audit beside"),
                Reply::Audit(before.clone()),
                "the audit read beside the batches is the same"
            );
        }
        assert!(before.ok, "{before:?}");
        assert_eq!((before.accounts, before.reservations), (2, 2));

        let mut store = reopen(store).await;
        assert_eq!(
            audit(&mut store).await,
            before,
            "contract 2: a reopened store loads exactly what was committed"
        );
        assert_eq!(store.gauges().await.expect("gauges"), gauges);
        let settled = self.reservation(&mut store, "rl-1").await.expect("rl-1");
        assert_eq!(settled.state, ReservationState::Settled);
        assert_eq!(settled.actual_units, Some(60));
        let held = self.reservation(&mut store, "rl-2").await.expect("rl-2");
        assert_eq!(held.state, ReservationState::Reserved);
        // And the reopened store goes on from there.
        let replies = self
            .committed(
                &mut store,
                vec![Operation::Reserve(reserve(&pair_a(), "rl-3", 10))],
            )
            .await;
        assert!(is_reserved(&replies[0]), "{replies:?}");
    }

    /// Contract item 3: a batch applied but never committed leaves nothing,
    /// in the store or in what the next batch sees, also after a reopen.
    async fn aborted_batch_changes_nothing<S: BatchStore>(
        &self,
        mut store: S,
        reopen: &mut impl AsyncFnMut(S) -> S,
    ) {
        self.publish(&mut store, &[pair_a()]).await;
        self.committed(
            &mut store,
            vec![Operation::Reserve(reserve(&pair_a(), "rl-kept", 100))],
        )
        .await;
        let before = audit(&mut store).await;
        self.reserved_uncommitted(&mut store, "rl-dropped", 200)
            .await;
        store.abort().await.expect("abort");
        assert_eq!(
            self.reservation(&mut store, "rl-dropped").await,
            None,
            "contract 3: an aborted batch's reservation is gone"
        );
        assert_eq!(
            self.account(&mut store, &pair_a()).await,
            (100, 0),
            "contract 3: an aborted batch's units are back"
        );
        assert_eq!(audit(&mut store).await, before, "contract 3");
        let mut store = reopen(store).await;
        assert_eq!(
            audit(&mut store).await,
            before,
            "contract 3: nothing of an aborted batch reaches the disk"
        );
        let replies = self
            .committed(
                &mut store,
                vec![Operation::Reserve(reserve(&pair_a(), "rl-dropped", 200))],
            )
            .await;
        assert!(
            is_reserved(&replies[0]),
            "the ID of an aborted batch is still free: {replies:?}"
        );
    }

    /// Contract items 1 and 2: a batch over one pair neither needs nor
    /// disturbs the records of another.
    async fn disjoint_batches<S: BatchStore>(
        &self,
        mut store: S,
        reopen: &mut impl AsyncFnMut(S) -> S,
    ) {
        self.publish(&mut store, &[pair_a(), pair_b()]).await;
        let on_a = Operation::Reserve(reserve(&pair_a(), "rl-a", 100));
        let on_b = Operation::Reserve(reserve(&pair_b(), "rl-b", 30));
        let (scope_a, _) = batch_scope([(&on_a, false)]);
        let (scope_b, _) = batch_scope([(&on_b, false)]);
        assert!(scope_a.pairs.is_disjoint(&scope_b.pairs));
        let replies = self.committed(&mut store, vec![on_a]).await;
        assert!(is_reserved(&replies[0]), "{replies:?}");
        let replies = self.committed(&mut store, vec![on_b]).await;
        assert!(is_reserved(&replies[0]), "{replies:?}");
        let replies = self
            .committed(
                &mut store,
                vec![Operation::Reserve(reserve(&pair_b(), "rl-b2", 20))],
            )
            .await;
        assert!(is_reserved(&replies[0]), "{replies:?}");
        assert_eq!(
            self.account(&mut store, &pair_a()).await,
            (100, 0),
            "contract 1: batches on another pair leave this one alone"
        );
        assert_eq!(self.account(&mut store, &pair_b()).await, (50, 0));
        let mut store = reopen(store).await;
        assert_eq!(self.account(&mut store, &pair_a()).await, (100, 0));
        assert_eq!(self.account(&mut store, &pair_b()).await, (50, 0));
        assert!(audit(&mut store).await.ok);
    }

    /// Contract item 1: an operation that names its own pair but reuses the
    /// ID of a reservation under another pair is never applied to a ledger
    /// without that reservation: it is deferred, and its retry (which looks
    /// the ID up) finds the conflict. A resident store answers at once.
    async fn record_under_another_pair_is_deferred<S: BatchStore>(&self, mut store: S) {
        self.publish(&mut store, &[pair_a(), pair_b()]).await;
        self.committed(
            &mut store,
            vec![Operation::Reserve(reserve(&pair_a(), "rl-shared", 100))],
        )
        .await;
        // The ID derived for pair A, named on pair B: only a foreign ID
        // can name a record of another pair.
        let reuse = || {
            let mut request = reserve(&pair_b(), "rl-shared-b", 40);
            request.reservation = reservation_id("rl-shared");
            Operation::Reserve(request)
        };
        let mut reply = self
            .batch(&mut store, vec![(reuse(), false)], t0())
            .await
            .remove(0);
        if reply.is_none() {
            reply = self
                .batch(&mut store, vec![(reuse(), true)], t0())
                .await
                .remove(0);
        }
        let reply = reply.expect("contract 1: a retried operation's records are looked up");
        assert!(
            matches!(reply, Reply::Reserve(ReserveOutcome::ForeignId)),
            "contract 1: the reused ID is refused: {reply:?}"
        );
        assert_eq!(
            self.account(&mut store, &pair_b()).await,
            (0, 0),
            "contract 1: nothing was reserved under the other pair"
        );
        let kept = self
            .reservation(&mut store, "rl-shared")
            .await
            .expect("kept");
        assert_eq!(
            kept.subject,
            pair_a().subject,
            "the first reservation stays"
        );
        assert!(audit(&mut store).await.ok);
    }

    /// Contract item 1 for a multi-leg reservation: a later batch that
    /// names only its first leg's ID still holds every leg (the store looks
    /// up the legs' pairs), so start and settle move every leg together,
    /// and the retention sweep forgets them together (it loads every leg
    /// of a due reservation).
    async fn legs_move_together<S: BatchStore>(&self, mut store: S) {
        self.publish(&mut store, &[pair_a(), pair_b()]).await;
        let b = pair_b();
        let two_legs = reserve(&pair_a(), "rl-legs", 100).with_legs(vec![ledger::LegAsk {
            subject: b.subject.clone(),
            route: b.route.clone(),
            units: 30,
            min_units: None,
        }]);
        let replies = self
            .committed(&mut store, vec![Operation::Reserve(two_legs)])
            .await;
        assert!(replies.iter().all(is_reserved), "{replies:?}");
        assert_eq!(self.account(&mut store, &pair_a()).await, (100, 0));
        assert_eq!(self.account(&mut store, &pair_b()).await, (30, 0));
        let operation = OperationId::new("op-legs").expect("valid");
        let replies = self
            .committed(
                &mut store,
                vec![Operation::Start {
                    reservation: reservation_id("rl-legs"),
                    operation_id: operation.clone(),
                    deadline_ms: None,
                    caller: owner(),
                }],
            )
            .await;
        let Reply::Start(StartOutcome::Started(started)) = &replies[0] else {
            panic!("contract 1: a later batch starts every leg: {replies:?}");
        };
        assert_eq!(started.legs.as_ref().map(Vec::len), Some(2));
        let replies = self
            .committed(
                &mut store,
                vec![Operation::Settle {
                    reservation: reservation_id("rl-legs"),
                    operation_id: operation,
                    actuals: ledger::SettleActuals::Legs(vec![ledger::LegActual {
                        subject: b.subject.clone(),
                        route: b.route.clone(),
                        actual_units: 10,
                    }]),
                    caller: owner(),
                }],
            )
            .await;
        assert!(
            matches!(replies[0], Reply::Settle(SettleOutcome::Settled(_))),
            "contract 1: a later batch settles every leg: {replies:?}"
        );
        // The first leg, left out, settles at its reserved units.
        assert_eq!(self.account(&mut store, &pair_a()).await, (0, 100));
        assert_eq!(self.account(&mut store, &pair_b()).await, (0, 10));
        let settled = audit(&mut store).await;
        assert!(settled.ok, "{settled:?}");
        // A window later one retention sweep forgets both legs.
        let retention_ms = self.retention_ms(&mut store).await;
        let past = Timestamp::from_unix_ms(T0_MS + retention_ms).expect("valid");
        assert_eq!(
            self.forget_at(&mut store, past).await.reservations,
            2,
            "contract 1: a reservation's legs are forgotten together"
        );
        let audit = audit(&mut store).await;
        assert!(audit.ok, "{audit:?}");
    }

    /// Contract item 1 for the workers: a sweep's batch finds the pairs with
    /// reservations due, and only those move.
    async fn sweeps_find_what_is_due<S: BatchStore>(&self, mut store: S) {
        self.publish(&mut store, &[pair_a(), pair_b()]).await;
        let mut short = reserve(&pair_a(), "rl-short", 100);
        short.hold_ttl_ms = Some(1_000);
        self.committed(
            &mut store,
            vec![
                Operation::Reserve(short),
                Operation::Reserve(reserve(&pair_b(), "rl-long", 100)),
            ],
        )
        .await;
        let later = Timestamp::from_unix_ms(T0_MS + 2_000).expect("valid");
        let begun = self
            .committed_at(&mut store, vec![Operation::BeginExpiry], later)
            .await;
        assert_eq!(begun, vec![Reply::Swept(1)], "only rl-short is due");
        let completed = self
            .committed_at(&mut store, vec![Operation::CompleteExpiry], later)
            .await;
        assert_eq!(completed, vec![Reply::Swept(1)]);
        let expired = self
            .reservation(&mut store, "rl-short")
            .await
            .expect("rl-short");
        assert_eq!(expired.state, ReservationState::Expired);
        assert_eq!(self.account(&mut store, &pair_a()).await, (0, 0));
        assert_eq!(self.account(&mut store, &pair_b()).await, (100, 0));
        assert!(audit(&mut store).await.ok);
    }

    /// A new boot of `identity` at `now`: its epoch and nonce.
    async fn boot<S: BatchStore>(
        &self,
        store: &mut S,
        identity: &GatewayIdentity,
        seed: u8,
        now: Timestamp,
    ) -> (u64, BootNonce) {
        let register = Operation::Register {
            identity: identity.clone(),
            boot_nonce: BootNonce([seed; 16]),
            request: ledger::BootRequest {
                request_nonce: BootNonce([seed; 16]),
                requested_at: now,
            },
        };
        match &self.committed_at(store, vec![register], now).await[0] {
            Reply::Register(RegisterOutcome::Registered {
                boot_epoch,
                boot_nonce,
            }) => (*boot_epoch, *boot_nonce),
            other => panic!("expected a registration, got {other:?}"),
        }
    }

    /// Contract item 1 for shards: an issuance's batch sees every open
    /// shard of its identity and pair, of any boot and any past account
    /// (the cap on unreconciled units counts them all), and the lost-shard
    /// sweep finds the pairs with shards past `notAfter` plus the grace.
    async fn open_shards_of_every_boot_and_epoch_count<S: BatchStore>(&self, mut store: S) {
        self.publish(&mut store, &[pair_a()]).await;
        let identity = Ed25519Signer::from_secret_bytes(&[9; 32]).key_id().clone();
        self.committed(&mut store, vec![Operation::Enroll(identity.clone())])
            .await;
        let issue = |boot: (u64, BootNonce), shard: &str| {
            Operation::IssueShard(IssueShardRequest {
                identity: identity.clone(),
                boot_epoch: boot.0,
                boot_nonce: boot.1,
                subject: pair_a().subject,
                route: pair_a().route,
                shard: ShardId::new(shard).expect("valid"),
            })
        };
        let boot = self.boot(&mut store, &identity, 1, t0()).await;
        let issued = self
            .committed_at(&mut store, vec![issue(boot, "es-1")], t0())
            .await;
        assert!(
            matches!(issued[0], Reply::IssueShard(IssueShardOutcome::Issued(_))),
            "{issued:?}"
        );
        // The next accounting epoch: a new account, a new boot.
        let later = Timestamp::from_unix_ms(T0_MS + 3_601_000).expect("valid");
        let boot = self.boot(&mut store, &identity, 2, later).await;
        let issued = self
            .committed_at(&mut store, vec![issue(boot, "es-2")], later)
            .await;
        assert!(
            matches!(issued[0], Reply::IssueShard(IssueShardOutcome::Issued(_))),
            "{issued:?}"
        );
        let boot = self
            .boot(
                &mut store,
                &identity,
                3,
                Timestamp::from_unix_ms(T0_MS + 3_601_001).expect("valid"),
            )
            .await;
        let refused = self
            .committed_at(&mut store, vec![issue(boot, "es-3")], later)
            .await;
        assert_eq!(
            refused[0],
            Reply::IssueShard(IssueShardOutcome::UnreconciledCap {
                retry_after_seconds: 1
            }),
            "contract 1: es-1 of the past epoch and boot is counted"
        );
        // es-1 is 3,001 s past its notAfter: lost; es-2 is not.
        let lost = self
            .committed_at(&mut store, vec![Operation::MarkLostShards], later)
            .await;
        match &lost[0] {
            Reply::ShardsLost(lost) => {
                let ids: Vec<String> = lost.iter().map(|shard| shard.shard.to_string()).collect();
                assert_eq!(ids, vec!["es-1".to_owned()], "the sweep finds es-1's pair");
            }
            other => panic!("unexpected {other:?}"),
        }
        let issued = self
            .committed_at(&mut store, vec![issue(boot, "es-3")], later)
            .await;
        assert!(
            matches!(issued[0], Reply::IssueShard(IssueShardOutcome::Issued(_))),
            "a lost shard no longer counts: {issued:?}"
        );
        let gauges = store.gauges().await.expect("gauges");
        assert_eq!(
            (
                gauges.lost_shards,
                gauges.lost_shard_units,
                gauges.open_shards
            ),
            (1, 200, 2)
        );
        assert!(audit(&mut store).await.ok);
    }

    /// The retention window the store's batches run with.
    async fn retention_ms<S: BatchStore>(&self, store: &mut S) -> u64 {
        let retention_ms = store
            .begin(&ledger::protocol::Scope::default(), t0())
            .await
            .expect("the batch begins")
            .ledger
            .config()
            .retention_ms;
        store.abort().await.expect("abort");
        retention_ms
    }

    /// One retention sweep at `now`.
    async fn forget_at<S: BatchStore>(&self, store: &mut S, now: Timestamp) -> ForgetOutcome {
        match &self.committed_at(store, vec![Operation::Forget], now).await[0] {
            Reply::Forgotten(outcome) => *outcome,
            other => panic!("unexpected {other:?}"),
        }
    }

    /// `GetReservation` at `now`: the receipt, and whether it is tombstoned.
    async fn lookup<S: BatchStore>(
        &self,
        store: &mut S,
        name: &str,
        now: Timestamp,
    ) -> (Option<LimitReservationV1>, bool) {
        let replies = self.committed_at(store, vec![get(name)], now).await;
        match &replies[0] {
            Reply::Reservation {
                receipt,
                tombstoned,
            } => (receipt.clone(), *tombstoned),
            other => panic!("unexpected {other:?}"),
        }
    }

    /// Retention: a released reservation and a tombstone are forgotten by
    /// the sweep once their window has passed (a record is due when it
    /// ended at or before `now − retention`: at the boundary, not one
    /// millisecond before), and stay forgotten across a restart: the ID
    /// is unknown and reserves anew. A record that ended later is kept.
    /// The audit stays clean throughout.
    async fn forgets_past_the_window<S: BatchStore>(
        &self,
        mut store: S,
        reopen: &mut impl AsyncFnMut(S) -> S,
    ) {
        let retention_ms = self.retention_ms(&mut store).await;
        let at = |ms: u64| Timestamp::from_unix_ms(T0_MS + ms).expect("valid");
        self.publish(&mut store, &[pair_a(), pair_b()]).await;
        let replies = self
            .committed(
                &mut store,
                vec![
                    Operation::Reserve(reserve(&pair_a(), "rl-gone", 100)),
                    abandon("rl-tomb"),
                ],
            )
            .await;
        assert!(is_reserved(&replies[0]), "{replies:?}");
        assert_eq!(replies[1], Reply::Abandon(AbandonOutcome::Tombstoned));
        let released = self.committed(&mut store, vec![release("rl-gone")]).await;
        assert!(
            matches!(released[0], Reply::Release(ReleaseOutcome::Released(_))),
            "{released:?}"
        );
        // Ends one second later: still inside the window at the boundary.
        self.committed_at(
            &mut store,
            vec![Operation::Reserve(reserve(&pair_a(), "rl-kept", 50))],
            at(1_000),
        )
        .await;
        self.committed_at(&mut store, vec![release("rl-kept")], at(1_000))
            .await;

        let early = self.forget_at(&mut store, at(retention_ms - 1)).await;
        assert_eq!(
            early.forgotten(),
            0,
            "one millisecond before the window passed nothing is due: {early:?}"
        );
        let swept = self.forget_at(&mut store, at(retention_ms)).await;
        assert_eq!(
            (swept.reservations, swept.tombstones, swept.shards),
            (1, 1, 0),
            "at the boundary rl-gone and the tombstone are due, rl-kept is not: {swept:?}"
        );
        assert!(
            audit(&mut store).await.ok,
            "contract 2: forgetting keeps the audit clean"
        );

        let mut store = reopen(store).await;
        let now = at(retention_ms);
        assert_eq!(
            self.lookup(&mut store, "rl-gone", now).await,
            (None, false),
            "contract 2: a forgotten reservation stays forgotten after a restart"
        );
        assert_eq!(
            self.lookup(&mut store, "rl-tomb", now).await,
            (None, false),
            "contract 2: a forgotten tombstone stays forgotten after a restart"
        );
        let kept = self.lookup(&mut store, "rl-kept", now).await;
        assert_eq!(
            kept.0.map(|receipt| receipt.state),
            Some(ReservationState::Released),
            "a record inside its window is kept"
        );
        assert!(audit(&mut store).await.ok);
        let again = self
            .committed_at(
                &mut store,
                vec![
                    Operation::Reserve(reserve(&pair_a(), "rl-gone", 100)),
                    Operation::Reserve(reserve(&pair_a(), "rl-tomb", 10)),
                ],
                now,
            )
            .await;
        assert!(
            again.iter().all(is_reserved),
            "a forgotten key is a new request: {again:?}"
        );
        let nothing = self.forget_at(&mut store, now).await;
        assert_eq!(nothing.forgotten(), 0, "nothing else is due: {nothing:?}");
        assert!(audit(&mut store).await.ok);
    }
}
