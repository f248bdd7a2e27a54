//! The wire form of every reply: [`Reply::into_answer`] is the one place an
//! outcome becomes an HTTP status, an [`Outcome`] or a [`Refusal`] with its
//! stable [`ErrorCode`], and a body. The central service writes answers to
//! HTTP as they are; the simulator's central node hands them to the agent
//! core directly; the client reads them back into the same types.

use serde::{Deserialize, Serialize};
use shard_format::{
    EmergencyShardV1, GatewayIdentity, LimitReservationV1, OperationId, ReservationId,
    ReservationState, Route, SettlementReceiptV1, ShardId, Subject,
};

use super::code::{ErrorCode, Outcome};
use super::views::{
    AbandonResponse, AccountsResponse, AuditResponse, BootResponse, EnrollResponse,
    NotEnforcedResponse, PublishResponse, ReconcileResponse, RouteControlResponse,
};
use super::{Operation, Reply};
use crate::central::BOOT_SKEW_MS_MAX;
use crate::outcomes::{
    AbandonOutcome, AbandonRequest, BootReplay, Dimension, EnrollOutcome, IssueShardOutcome,
    LegAsk, LegProblem, PublishOutcome, RateLimitState, ReconcileOutcome, RegisterOutcome,
    Rejection, ReleaseOutcome, ReserveOutcome, RouteControlOutcome, SettleOutcome, StartOutcome,
};
use crate::records::PairKey;

/// An error answer: `{"error": code, "message": sentence, …details}` with
/// its HTTP status.
///
/// Its JSON Schema (`ErrorBody`) is the error body of both APIs: `error`
/// and `message` always, the details when the refusal has them, and any
/// other member a reader does not know.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(
    feature = "schema",
    derive(schemars::JsonSchema),
    schemars(rename = "ErrorBody")
)]
#[serde(rename_all = "camelCase")]
pub struct Refusal {
    /// The HTTP status (not in the body).
    #[serde(skip)]
    pub status: u16,
    pub error: ErrorCode,
    pub message: String,
    /// Boxed: most refusals carry few details, and answers travel by value.
    #[serde(flatten)]
    pub details: Box<RefusalDetails>,
}

/// What an error body may add to its code and message. Every member is
/// optional; readers ignore members they do not know.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
#[serde(rename_all = "camelCase")]
pub struct RefusalDetails {
    /// 400: the field that broke a rule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// The reservation's state, where a transition was refused by it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<ReservationState>,
    /// The reservation's receipt, where a refusal proves how it ended (a
    /// start that lost against expiry, an abandon of a settled ID).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub receipt: Option<Box<LimitReservationV1>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bound_operation_id: Option<OperationId>,
    /// The actual units of the settlement that stands.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub actual_units: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_generation: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub current_boot_epoch: Option<u64>,
    /// 429: the generation whose rules were applied.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy_generation: Option<u64>,
    /// 429: the limit hit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dimension: Option<Dimension>,
    /// 429 and 503: whole seconds to wait (also the `Retry-After` field).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_seconds: Option<u64>,
    /// 429: the caller's own limit state (also the `RateLimit` fields).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rate_limit: Option<RateLimitState>,
    /// 429 of a multi-leg reserve: the limiting leg's index, subject and
    /// route (the refused leg with the longest `Retry-After`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leg: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject: Option<Subject>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub route: Option<Route>,
}

impl Refusal {
    pub fn new(status: u16, error: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            status,
            error,
            message: message.into(),
            details: Box::default(),
        }
    }

    /// A 400 naming the field that broke a rule.
    pub fn bad_request(error: ErrorCode, field: &str, message: impl Into<String>) -> Self {
        let mut refusal = Self::new(400, error, message);
        refusal.details.field = Some(field.to_owned());
        refusal
    }

    pub fn conflict(error: ErrorCode, message: impl Into<String>) -> Self {
        Self::new(409, error, message)
    }

    pub fn not_found(error: ErrorCode, message: impl Into<String>) -> Self {
        Self::new(404, error, message)
    }

    /// A reply the operation cannot produce: a bug in a shell.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(500, ErrorCode::Internal, message)
    }

    /// A 429: the limit hit, `Retry-After` (always: see
    /// [`crate::RETRY_AFTER_NO_HORIZON_SECONDS`]) and the caller's own limit
    /// state.
    pub fn rate_limited(rejection: Rejection) -> Self {
        let why = match rejection.dimension {
            Dimension::Capacity => "not enough capacity is available",
            Dimension::Debt => "the subject owes debt; admission resumes when refills repay it",
            Dimension::Frozen => "the route is frozen after a breach; an operator must unfreeze it",
            Dimension::PolicyGeneration => {
                "the policy generation named is not admitting (replaced or rolled back)"
            }
            Dimension::ReservationUnitsMax => {
                "the units are above the policy's reservationUnitsMax"
            }
        };
        let mut refusal = Self::new(
            429,
            ErrorCode::RateLimited,
            format!("{why} (policy generation {})", rejection.policy_generation),
        );
        refusal.details.policy_generation = Some(rejection.policy_generation);
        refusal.details.dimension = Some(rejection.dimension);
        refusal.details.retry_after_seconds = Some(rejection.retry_after_header_seconds());
        refusal.details.rate_limit = rejection.rate_limit;
        refusal
    }

    /// The rejection a 429 carries.
    pub fn rejection(&self) -> Option<Rejection> {
        if self.error != ErrorCode::RateLimited {
            return None;
        }
        Some(Rejection {
            dimension: self.details.dimension?,
            policy_generation: self.details.policy_generation?,
            retry_after_seconds: self.details.retry_after_seconds,
            rate_limit: self.details.rate_limit,
        })
    }

    fn with_state(mut self, state: ReservationState) -> Self {
        self.details.state = Some(state);
        self
    }

    fn with_receipt(mut self, receipt: LimitReservationV1) -> Self {
        self.details.state = Some(receipt.state);
        self.details.receipt = Some(Box::new(receipt));
        self
    }

    fn overflow() -> Self {
        Self::conflict(
            ErrorCode::Overflow,
            "the operation would overflow an account's unit terms; nothing changed",
        )
    }

    fn reservation_not_found(reservation: &str) -> Self {
        Self::not_found(
            ErrorCode::ReservationNotFound,
            format!("no reservation {reservation} exists"),
        )
    }

    fn illegal_state(reservation: &str, state: ReservationState) -> Self {
        Self::conflict(
            ErrorCode::IllegalState,
            format!(
                "reservation {reservation} is {state:?}; this transition is not allowed from it"
            ),
        )
        .with_state(state)
    }

    fn operation_conflict(reservation: &str, bound: OperationId) -> Self {
        let mut refusal = Self::conflict(
            ErrorCode::OperationConflict,
            format!("reservation {reservation} is bound to another operation"),
        );
        refusal.details.bound_operation_id = Some(bound);
        refusal
    }

    /// A 400 naming the leg's field at fault.
    pub fn invalid_leg(index: usize, problem: LegProblem) -> Self {
        let code = match problem {
            LegProblem::Units | LegProblem::MinUnits | LegProblem::ActualUnits => {
                ErrorCode::InvalidUnits
            }
            LegProblem::NoPolicy => ErrorCode::NoPolicy,
            LegProblem::TooMany
            | LegProblem::RepeatedPair
            | LegProblem::NotALeg
            | LegProblem::SettleForm => ErrorCode::InvalidLegs,
        };
        let field = problem.field(index);
        let message = format!("field `{field}`: {}", problem.message());
        Self::bad_request(code, &field, message)
    }

    fn no_policy(pair: &str) -> Self {
        Self::not_found(
            ErrorCode::NoPolicy,
            format!("no policy is published for {pair}"),
        )
    }
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.status, self.error, self.message)
    }
}

impl std::error::Error for Refusal {}

/// A successful answer: status, outcome and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answered {
    pub status: u16,
    pub outcome: Outcome,
    pub body: Body,
    /// Shadow mode: the dimension enforcement would have rejected on.
    pub would_reject: Option<Dimension>,
}

/// The body of a successful answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Body {
    /// A `limitReservation.v1` receipt (canonical bytes on the wire).
    Reservation(Box<LimitReservationV1>),
    /// A `settlementReceipt.v1`.
    Settlement(Box<SettlementReceiptV1>),
    /// An `emergencyShard.v1`.
    Shard(Box<EmergencyShardV1>),
    NotEnforced(NotEnforcedResponse),
    Published(PublishResponse),
    Enrolled(EnrollResponse),
    RouteControl(RouteControlResponse),
    Abandon(AbandonResponse),
    Boot(BootResponse),
    Reconciled(ReconcileResponse),
    Accounts(AccountsResponse),
    Audit(AuditResponse),
}

/// What a call came to on the wire.
pub type Answer = Result<Answered, Refusal>;

fn answered(status: u16, outcome: Outcome, body: Body) -> Answer {
    Ok(Answered {
        status,
        outcome,
        body,
        would_reject: None,
    })
}

fn receipt(status: u16, outcome: Outcome, receipt: LimitReservationV1) -> Answer {
    answered(status, outcome, Body::Reservation(Box::new(receipt)))
}

fn settlement(outcome: Outcome, receipt: SettlementReceiptV1) -> Answer {
    answered(200, outcome, Body::Settlement(Box::new(receipt)))
}

/// What the answer's messages and bodies name, taken from the operation
/// before it is applied.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct About {
    pub reservation: Option<ReservationId>,
    pub pair: Option<PairKey>,
    pub policy_generation: Option<u64>,
    pub identity: Option<GatewayIdentity>,
    pub shard: Option<ShardId>,
    pub boot_epoch: Option<u64>,
    /// A reserve's legs (every leg, the first included).
    pub legs: Vec<LegAsk>,
}

impl About {
    fn reservation(&self) -> String {
        self.reservation
            .as_ref()
            .map_or_else(|| "?".to_owned(), ToString::to_string)
    }

    fn pair(&self) -> String {
        self.pair.as_ref().map_or_else(
            || "?".to_owned(),
            |pair| format!("{}/{}", pair.subject, pair.route),
        )
    }

    fn identity(&self) -> String {
        self.identity
            .as_ref()
            .map_or_else(|| "?".to_owned(), ToString::to_string)
    }

    fn shard(&self) -> String {
        self.shard
            .as_ref()
            .map_or_else(|| "?".to_owned(), ToString::to_string)
    }
}

impl Operation {
    /// What the answer to this operation names.
    pub fn about(&self) -> About {
        let mut about = About::default();
        match self {
            Self::Publish(policy) => {
                about.pair = Some(PairKey::new(policy.subject.clone(), policy.route.clone()));
                about.policy_generation = Some(policy.policy_generation);
            }
            Self::Enroll(identity) | Self::IsEnrolled(identity) => {
                about.identity = Some(identity.clone());
            }
            Self::Register { identity, .. } => about.identity = Some(identity.clone()),
            Self::SetAdmissionStopped { pair, .. }
            | Self::SetFrozen { pair, .. }
            | Self::GetAccounts(pair) => about.pair = Some(pair.clone()),
            Self::Reserve(request) => {
                about.reservation = Some(request.reservation.clone());
                about.pair = Some(PairKey::new(request.subject.clone(), request.route.clone()));
                about.legs = request.legs();
            }
            Self::Start { reservation, .. }
            | Self::Settle { reservation, .. }
            | Self::Release { reservation, .. }
            | Self::Abandon(AbandonRequest { reservation, .. })
            | Self::GetReservation { reservation, .. } => {
                about.reservation = Some(reservation.clone())
            }
            Self::IssueShard(request) => {
                about.pair = Some(PairKey::new(request.subject.clone(), request.route.clone()));
                about.identity = Some(request.identity.clone());
                about.shard = Some(request.shard.clone());
                about.boot_epoch = Some(request.boot_epoch);
            }
            Self::Reconcile { receipt, caller } => {
                about.shard = Some(receipt.shard.clone());
                about.identity = Some(caller.clone());
            }
            Self::Audit
            | Self::Gauges
            | Self::BeginExpiry
            | Self::CompleteExpiry
            | Self::UsageDeadlines
            | Self::Refill
            | Self::Forget
            | Self::MarkLostShards => {}
        }
        about
    }
}

impl Reply {
    /// The wire form of this reply to the operation `about` describes.
    pub fn into_answer(self, about: &About) -> Answer {
        match self {
            Self::Publish(outcome) => publish_answer(outcome, about),
            Self::Enroll(outcome) => {
                let (status, outcome, enrolled) = match outcome {
                    EnrollOutcome::Enrolled => (201, Outcome::Enrolled, true),
                    EnrollOutcome::AlreadyEnrolled => (200, Outcome::Duplicate, false),
                };
                let identity = about.identity.clone();
                let Some(identity) = identity else {
                    return Err(Refusal::internal("an enrolment answer names no identity"));
                };
                answered(
                    status,
                    outcome,
                    Body::Enrolled(EnrollResponse { identity, enrolled }),
                )
            }
            Self::RouteControl(outcome) => route_control_answer(outcome, about),
            Self::Reserve(outcome) => reserve_answer(outcome, about),
            Self::Start(outcome) => start_answer(outcome, about),
            Self::Settle(outcome) => settle_answer(outcome, about),
            Self::Release(outcome) => {
                let reservation = about.reservation();
                match outcome {
                    ReleaseOutcome::Released(done) => receipt(200, Outcome::Released, done),
                    ReleaseOutcome::Duplicate(done) => receipt(200, Outcome::Duplicate, done),
                    ReleaseOutcome::NotFound => Err(Refusal::reservation_not_found(&reservation)),
                    ReleaseOutcome::IllegalState(state) => {
                        Err(Refusal::illegal_state(&reservation, state))
                    }
                    ReleaseOutcome::Overflow(_) => Err(Refusal::overflow()),
                }
            }
            Self::Abandon(outcome) => abandon_answer(outcome, about),
            Self::Register(outcome) => match outcome {
                RegisterOutcome::Registered {
                    boot_epoch,
                    boot_nonce,
                } => {
                    let Some(identity) = about.identity.clone() else {
                        return Err(Refusal::internal("a boot answer names no identity"));
                    };
                    answered(
                        201,
                        Outcome::Registered,
                        Body::Boot(BootResponse {
                            identity,
                            boot_epoch,
                            boot_nonce,
                        }),
                    )
                }
                RegisterOutcome::UnknownGateway => Err(Refusal::new(
                    401,
                    ErrorCode::UnknownIdentity,
                    format!("identity {} is not enrolled", about.identity()),
                )),
                RegisterOutcome::Replayed(replay) => {
                    let why = match replay {
                        BootReplay::OutsideSkew { skew_ms } => format!(
                            "its requestedAt is {skew_ms} ms from the central clock (at most {BOOT_SKEW_MS_MAX} ms); check the agent's clock"
                        ),
                        BootReplay::NotAfterCurrentBoot => {
                            "its requestedAt is not after the current boot's request".to_owned()
                        }
                        BootReplay::SameNonce => {
                            "its requestNonce is the current boot's".to_owned()
                        }
                    };
                    Err(Refusal::conflict(
                        ErrorCode::BootReplayed,
                        format!(
                            "the boot request of {} is refused as a replay: {why}; send a new request with a fresh nonce",
                            about.identity()
                        ),
                    ))
                }
                RegisterOutcome::Overflow(_) => Err(Refusal::overflow()),
            },
            Self::IssueShard(outcome) => issue_shard_answer(outcome, about),
            Self::Reconcile(outcome) => reconcile_answer(outcome, about),
            Self::Reservation {
                receipt: Some(found),
                ..
            } => receipt(200, Outcome::Found, found),
            Self::Reservation {
                tombstoned: true, ..
            } => Err(Refusal::not_found(
                ErrorCode::ReservationAbandoned,
                format!(
                    "reservation {} was abandoned before it reserved",
                    about.reservation()
                ),
            )),
            Self::Reservation { .. } => Err(Refusal::reservation_not_found(&about.reservation())),
            Self::Accounts(Some(view)) => answered(200, Outcome::Found, Body::Accounts(view)),
            Self::Accounts(None) => Err(Refusal::no_policy(&about.pair())),
            Self::Audit(report) => {
                let (status, outcome) = if report.ok {
                    (200, Outcome::Clean)
                } else {
                    (500, Outcome::Drift)
                };
                answered(status, outcome, Body::Audit(report))
            }
            Self::NotOwner { reservation, .. } => {
                Err(Refusal::reservation_not_found(reservation.as_str()))
            }
            Self::IsEnrolled(_)
            | Self::Gauges(_)
            | Self::Swept(_)
            | Self::Forgotten(_)
            | Self::ShardsLost(_) => Err(Refusal::internal(
                "an internal reply has no wire form; this is a bug",
            )),
        }
    }
}

fn publish_answer(outcome: PublishOutcome, about: &About) -> Answer {
    let (Some(pair), Some(policy_generation)) = (about.pair.clone(), about.policy_generation)
    else {
        return Err(Refusal::internal("a publish answer names no policy"));
    };
    match outcome {
        PublishOutcome::Published => answered(
            201,
            Outcome::Published,
            Body::Published(PublishResponse {
                subject: pair.subject,
                route: pair.route,
                policy_generation,
            }),
        ),
        PublishOutcome::GenerationNotRising { current } => {
            let mut refusal = Refusal::conflict(
                ErrorCode::GenerationNotRising,
                format!(
                    "policyGeneration must be above the current generation {current} of {}",
                    about.pair()
                ),
            );
            refusal.details.current_generation = Some(current);
            Err(refusal)
        }
        PublishOutcome::Invalid(message) => {
            Err(Refusal::bad_request(ErrorCode::InvalidPolicy, "", message))
        }
    }
}

fn route_control_answer(outcome: RouteControlOutcome, about: &About) -> Answer {
    match outcome {
        RouteControlOutcome::Done => answered(
            200,
            Outcome::Changed,
            Body::RouteControl(RouteControlResponse { changed: true }),
        ),
        RouteControlOutcome::Unchanged => answered(
            200,
            Outcome::Unchanged,
            Body::RouteControl(RouteControlResponse { changed: false }),
        ),
        RouteControlOutcome::NoPolicy => Err(Refusal::no_policy(&about.pair())),
        RouteControlOutcome::NotCurrentGeneration { current } => {
            let mut refusal = Refusal::conflict(
                ErrorCode::NotCurrentGeneration,
                format!(
                    "policyGeneration must name the current generation {current} of {}",
                    about.pair()
                ),
            );
            refusal.details.current_generation = Some(current);
            Err(refusal)
        }
    }
}

fn reserve_answer(outcome: ReserveOutcome, about: &About) -> Answer {
    let reservation = about.reservation();
    match outcome {
        ReserveOutcome::Reserved(done) => receipt(201, Outcome::Reserved, done),
        ReserveOutcome::Duplicate(done) => receipt(200, Outcome::Duplicate, done),
        ReserveOutcome::Shadow {
            receipt: done,
            would_reject,
        } => Ok(Answered {
            status: 200,
            outcome: Outcome::Shadow,
            body: Body::Reservation(Box::new(done)),
            would_reject: would_reject.map(|rejection| rejection.dimension),
        }),
        ReserveOutcome::NotEnforced => answered(
            200,
            Outcome::NotEnforced,
            Body::NotEnforced(NotEnforcedResponse {
                mode: "off".to_owned(),
            }),
        ),
        ReserveOutcome::Rejected(rejection) => Err(Refusal::rate_limited(rejection)),
        ReserveOutcome::IdempotencyConflict { .. } => Err(Refusal::conflict(
            ErrorCode::IdempotencyConflict,
            format!(
                "reservation {reservation} exists with another request; a retry must send the same request under its ID"
            ),
        )),
        ReserveOutcome::Abandoned => Err(Refusal::conflict(
            ErrorCode::ReservationAbandoned,
            format!("reservation {reservation} was abandoned; it never reserves"),
        )),
        ReserveOutcome::ForeignId => Err(Refusal::new(
            403,
            ErrorCode::ReservationIdForeign,
            format!(
                "reservation ID {reservation} is not the one derived from your identity, the subject, the route and the idempotency key; see ReservationId::derive"
            ),
        )),
        ReserveOutcome::NoPolicy => Err(Refusal::no_policy(&about.pair())),
        ReserveOutcome::InvalidUnits => Err(Refusal::bad_request(
            ErrorCode::InvalidUnits,
            "units",
            "field `units`: must be between 1 and 2^53 - 1",
        )),
        ReserveOutcome::InvalidMinUnits => Err(Refusal::bad_request(
            ErrorCode::InvalidUnits,
            "minUnits",
            "field `minUnits`: must be between 1 and `units`",
        )),
        ReserveOutcome::InvalidLeg { index, problem } => Err(Refusal::invalid_leg(index, problem)),
        ReserveOutcome::LegRejected { index, rejection } => {
            let mut refusal = Refusal::rate_limited(rejection);
            // Only the caller's own pair: never another tenant's numbers.
            if let Some(leg) = about.legs.get(index) {
                refusal.message = format!(
                    "leg {index} ({}/{}): {}; nothing was held",
                    leg.subject, leg.route, refusal.message
                );
                refusal.details.subject = Some(leg.subject.clone());
                refusal.details.route = Some(leg.route.clone());
            }
            refusal.details.leg = Some(index);
            Err(refusal)
        }
        ReserveOutcome::Overflow(_) => Err(Refusal::overflow()),
    }
}

fn start_answer(outcome: StartOutcome, about: &About) -> Answer {
    let reservation = about.reservation();
    match outcome {
        StartOutcome::Started(done) => receipt(200, Outcome::Started, done),
        StartOutcome::Duplicate(done) => receipt(200, Outcome::Duplicate, done),
        StartOutcome::NotFound => Err(Refusal::reservation_not_found(&reservation)),
        StartOutcome::OperationConflict { bound } => {
            Err(Refusal::operation_conflict(&reservation, bound))
        }
        StartOutcome::Expired(done) => Err(Refusal::conflict(
            ErrorCode::ReservationExpired,
            format!(
                "reservation {reservation} expired at {} before it started; its units are back",
                done.expires_at
            ),
        )
        .with_receipt(done)),
        StartOutcome::IllegalState(state) => Err(Refusal::illegal_state(&reservation, state)),
    }
}

fn settle_answer(outcome: SettleOutcome, about: &About) -> Answer {
    let reservation = about.reservation();
    match outcome {
        SettleOutcome::Settled(done) => settlement(Outcome::Settled, done),
        SettleOutcome::Duplicate(done) => settlement(Outcome::Duplicate, done),
        SettleOutcome::Corrected(done) => settlement(Outcome::Corrected, done),
        SettleOutcome::NotFound => Err(Refusal::reservation_not_found(&reservation)),
        SettleOutcome::OperationConflict { bound } => {
            Err(Refusal::operation_conflict(&reservation, bound))
        }
        SettleOutcome::SettlementConflict(done) => {
            let mut refusal = Refusal::conflict(
                ErrorCode::SettlementConflict,
                format!(
                    "reservation {reservation} was settled already with other actual units; a settle happens once"
                ),
            );
            refusal.details.actual_units = Some(done.actual_units);
            Err(refusal)
        }
        SettleOutcome::NotStarted(state) => Err(Refusal::conflict(
            ErrorCode::NotStarted,
            format!(
                "reservation {reservation} is {state:?}: start binds the operation before a settle"
            ),
        )
        .with_state(state)),
        SettleOutcome::IllegalState(state) => Err(Refusal::illegal_state(&reservation, state)),
        SettleOutcome::InvalidLeg { index, problem } => Err(Refusal::invalid_leg(index, problem)),
        SettleOutcome::Overflow(_) => Err(Refusal::overflow()),
    }
}

fn abandon_answer(outcome: AbandonOutcome, about: &About) -> Answer {
    let Some(reservation) = about.reservation.clone() else {
        return Err(Refusal::internal("an abandon answer names no reservation"));
    };
    let (outcome, done) = match outcome {
        AbandonOutcome::Tombstoned => (Outcome::Tombstoned, None),
        AbandonOutcome::Abandoned(done) => (Outcome::Abandoned, Some(Box::new(done))),
        AbandonOutcome::Duplicate => (Outcome::Duplicate, None),
        AbandonOutcome::IllegalState(done) => {
            return Err(Refusal::conflict(
                ErrorCode::IllegalState,
                format!(
                    "reservation {reservation} is {:?}: its outcome is known, nothing to abandon",
                    done.state
                ),
            )
            .with_receipt(done));
        }
        AbandonOutcome::NotFound | AbandonOutcome::NotOwner => {
            return Err(Refusal::reservation_not_found(reservation.as_str()));
        }
        AbandonOutcome::Overflow(_) => return Err(Refusal::overflow()),
    };
    answered(
        200,
        outcome,
        Body::Abandon(AbandonResponse {
            reservation,
            outcome,
            receipt: done,
        }),
    )
}

fn issue_shard_answer(outcome: IssueShardOutcome, about: &About) -> Answer {
    let identity = about.identity();
    let pair = about.pair();
    match outcome {
        IssueShardOutcome::Issued(shard) => answered(201, Outcome::Issued, Body::Shard(shard)),
        IssueShardOutcome::Duplicate(shard) => {
            answered(200, Outcome::Duplicate, Body::Shard(shard))
        }
        IssueShardOutcome::UnknownGateway => Err(Refusal::new(
            401,
            ErrorCode::UnknownIdentity,
            format!("identity {identity} is not enrolled"),
        )),
        IssueShardOutcome::SupersededBoot { current_epoch } => {
            let mut refusal = Refusal::conflict(
                ErrorCode::SupersededBoot,
                format!(
                    "boot epoch {} with this nonce is not {identity}'s current boot ({current_epoch}); register the boot first",
                    about.boot_epoch.unwrap_or(0)
                ),
            );
            refusal.details.current_boot_epoch = Some(current_epoch);
            Err(refusal)
        }
        IssueShardOutcome::NoPolicy => Err(Refusal::no_policy(&pair)),
        IssueShardOutcome::EmergencyDisabled => Err(Refusal::conflict(
            ErrorCode::EmergencyDisabled,
            format!("the policy of {pair} does not enable emergency shards"),
        )),
        IssueShardOutcome::TooManyOpenShards => Err(Refusal::conflict(
            ErrorCode::TooManyOpenShards,
            format!("this boot holds the most open shards allowed for {pair}; reconcile one first"),
        )),
        IssueShardOutcome::UnreconciledCap {
            retry_after_seconds,
        } => {
            let mut refusal = Refusal::new(
                429,
                ErrorCode::ShardCapReached,
                format!(
                    "{identity} holds the most unreconciled shard units allowed for {pair} over all its boots; upload terminal receipts, or retry in {retry_after_seconds} s when the oldest shard is marked lost"
                ),
            );
            refusal.details.retry_after_seconds = Some(retry_after_seconds);
            Err(refusal)
        }
        IssueShardOutcome::Rejected(rejection) => Err(Refusal::rate_limited(rejection)),
        IssueShardOutcome::ShardIdTaken => Err(Refusal::conflict(
            ErrorCode::ShardIdTaken,
            "the shard ID was issued to another request; choose a new one",
        )),
        IssueShardOutcome::Overflow(_) => Err(Refusal::overflow()),
    }
}

fn reconcile_answer(outcome: ReconcileOutcome, about: &About) -> Answer {
    let shard = about.shard();
    let reconciled = |duplicate, reconciliation| {
        let Some(shard) = about.shard.clone() else {
            return Err(Refusal::internal("a receipt answer names no shard"));
        };
        let outcome = if duplicate {
            Outcome::Duplicate
        } else {
            Outcome::Reconciled
        };
        answered(
            200,
            outcome,
            Body::Reconciled(ReconcileResponse {
                shard,
                duplicate,
                reconciliation,
            }),
        )
    };
    match outcome {
        ReconcileOutcome::Reconciled(reconciliation) => reconciled(false, reconciliation),
        ReconcileOutcome::Duplicate(reconciliation) => reconciled(true, reconciliation),
        ReconcileOutcome::UnknownShard => Err(Refusal::not_found(
            ErrorCode::ShardNotFound,
            format!("no shard {shard} was issued"),
        )),
        ReconcileOutcome::WrongIdentity => Err(Refusal::new(
            403,
            ErrorCode::WrongIdentity,
            format!(
                "shard {shard} is bound to another identity than {}",
                about.identity()
            ),
        )),
        ReconcileOutcome::BadSignature(error) => Err(Refusal::bad_request(
            ErrorCode::InvalidBody,
            "signature",
            format!("field `signature`: {error}"),
        )),
        ReconcileOutcome::Mismatch(field) => Err(Refusal::bad_request(
            ErrorCode::ReceiptMismatch,
            field,
            format!("the receipt's {field} differs from the issued shard's"),
        )),
        ReconcileOutcome::Overflow(_) => Err(Refusal::overflow()),
    }
}
