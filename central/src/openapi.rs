//! The central API's OpenAPI 3.1 document (docs/design.md §6.3), served at
//! `GET /openapi.json` and committed as `docs/openapi/central.json`. Every
//! body's schema is derived from the type the handlers parse or write
//! (`central_client::wire`, the ledger protocol's views and `Refusal`, the
//! v1 documents); the list of operations is checked against the router in
//! `http.rs` by this module's tests.
//!
//! Regenerate the committed file with
//! `cargo run -p reservoir -- central openapi > docs/openapi/central.json`.

use central_client::wire::{
    AbandonBody, AbandonResponse, AccountsResponse, AdmissionBody, AuditResponse,
    BATCH_BODY_SIZE_MAX, BATCH_OPERATIONS_MAX, BatchBody, BootBody, BootResponse, EmptyBody,
    EnrollResponse, FreezeBody, IssueShardBody, NotEnforcedResponse, PublishResponse,
    ReconcileResponse, Refusal, ReserveBody, RouteControlResponse, SettleBody, StartBody,
};
use http_serve::openapi::{ApiDocument, Operation, Response};
use ledger::Dimension;
use ledger::protocol::Outcome;
use serde_json::{Value, json};
use shard_format::{
    AdmissionBudgetV1, EmergencyShardV1, KeyId, LimitReservationV1, ReservationId, Route,
    SettlementReceiptV1, ShardId, ShardTerminalReceiptV1, Subject,
};

/// The operator's bearer token.
const OPERATOR: &[&str] = &["operatorToken"];
/// An agent's signature: all three headers.
const AGENT: &[&str] = &["contentDigest", "signatureInput", "signature"];

/// Builds the operations of one daemon: the document plus the error body
/// schema every refusal shares.
struct Api {
    document: ApiDocument,
    error: Value,
    outcome: Value,
}

impl Api {
    /// A refusal with `status`; `codes` names the `error` codes it may carry.
    fn error(&self, codes: &str) -> Response {
        Response::new(codes).json(self.error.clone())
    }

    /// A success of a `/v1/` call: the body and the outcome header.
    fn success(&self, description: &str, body: Value) -> Response {
        Response::new(description).json(body).header(
            "Reservoir-Outcome",
            "What happened (`ledger::protocol::Outcome`).",
            true,
            self.outcome.clone(),
        )
    }

    /// The refusals any call may answer, added to `operation`: a malformed
    /// request (400), an oversized body (413), an unknown path (404), a bug
    /// (500), and no commit (503).
    fn common(&self, operation: Operation, credentials: &str) -> Operation {
        let mut operation = operation
            .response(
                413,
                self.error("`body_too_large`: the body is above 64 KiB."),
            )
            .response(
                500,
                self.error("`internal`: a bug; the outcome is unknown."),
            )
            .response(
                503,
                self.error(
                    "`commit_failed` (nothing was acknowledged: retry under the same ID) or `unavailable`; the outcome is unknown.",
                ),
            );
        if !credentials.is_empty() {
            operation = operation.response(401, self.error(credentials));
        }
        operation
    }
}

const OPERATOR_REFUSED: &str =
    "`operator_token_required` (no `Authorization: Bearer` token) or `operator_token_invalid`.";
const AGENT_REFUSED: &str = "`signature_invalid` (a missing, bad, stale or replayed signature) or `unknown_identity` (not enrolled).";
const EITHER_REFUSED: &str = "With `Authorization`: `operator_token_invalid`; without: `signature_invalid` or `unknown_identity`.";
const BAD_REQUEST: &str = "`invalid_body` (with `field`), `invalid_path` or `unreadable_body`; `signature_invalid` when the body does not match its `Content-Digest`.";
const BAD_PATH: &str = "`invalid_path` (with `field`).";
const NOT_FOUND: &str = "`no_such_endpoint` (a path segment that is not one, e.g. an encoded `/`).";

/// The central API's OpenAPI document.
pub fn document() -> Value {
    let mut document = ApiDocument::new(
        "Reservoir central ledger API",
        env!("CARGO_PKG_VERSION"),
        "The central ledger's HTTP API (docs/design.md §6): operators publish policies, enrol gateways and read accounts with a bearer token; agents reserve, start, settle, release and abandon, register boots and take and return emergency shards with signed calls (RFC 9421, ed25519 over the `Content-Digest` of the body). Every error answer is `{error, message, …details}` with a stable `error` code. Every 2xx of a `/v1/` call carries `Reservoir-Outcome`.",
    );
    document.security_scheme(
        "operatorToken",
        json!({
            "type": "http",
            "scheme": "bearer",
            "description": "The operator token: `operator.token` in the service's data directory unless `--operator-token-file` names another.",
        }),
    );
    let signature_headers = [
        (
            "contentDigest",
            "Content-Digest",
            "RFC 9530: `sha-256=:<base64 of the body's SHA-256>:`.",
        ),
        (
            "signatureInput",
            "Signature-Input",
            "RFC 9421: label `sig1`, covered components `\"@method\" \"@path\" \"content-digest\"`, parameters `created` (within 10 s of the center's clock), `nonce` (16 random bytes, hex, never reused), `keyid` (the agent's identity) and `alg=\"ed25519\"`.",
        ),
        (
            "signature",
            "Signature",
            "RFC 9421: `sig1=:<base64 ed25519 signature>:` by the agent's identity key.",
        ),
    ];
    for (scheme, header, description) in signature_headers {
        document.security_scheme(
            scheme,
            json!({"type": "apiKey", "in": "header", "name": header, "description": description}),
        );
    }
    let error = document.response::<Refusal>();
    let outcome = document.response::<Outcome>();
    let mut api = Api {
        document,
        error,
        outcome,
    };
    let reservation = api.document.request::<ReservationId>();
    let subject = api.document.request::<Subject>();
    let route = api.document.request::<Route>();
    let identity = api.document.request::<KeyId>();
    let shard = api.document.request::<ShardId>();
    let receipt = api.document.response::<LimitReservationV1>();
    let dimension = api.document.response::<Dimension>();
    let retry_after = json!({"type": "integer", "minimum": 0});
    let text = json!({"type": "string"});

    let reservation_parameter = |operation: Operation| {
        operation.path_parameter("reservation", "The reservation's ID.", reservation.clone())
    };
    let pair_parameters = |operation: Operation| {
        operation
            .path_parameter("subject", "The pair's subject.", subject.clone())
            .path_parameter("route", "The pair's route.", route.clone())
    };
    let rate_limited = |api: &Api, codes: &str| {
        api.error(codes).header(
            "Retry-After",
            "Whole seconds to wait; equals `retryAfterSeconds`.",
            true,
            retry_after.clone(),
        )
    };

    // ----- open -----
    let health = Operation::new("health", "Liveness")
        .tag("service")
        .security(&[])
        .response(
            200,
            Response::new("`ok`.").content("text/plain", text.clone()),
        );
    api.document.operation("GET", "/healthz", health);
    let openapi = Operation::new("openapi", "This document")
        .tag("service")
        .security(&[])
        .response(
            200,
            Response::new("The OpenAPI 3.1 document.")
                .json(json!({"type": "object", "required": ["openapi", "paths"]})),
        );
    api.document.operation("GET", "/openapi.json", openapi);
    let metrics = Operation::new("metrics", "Prometheus metrics")
        .tag("service")
        .security(&[OPERATOR])
        .response(
            200,
            Response::new("Prometheus text exposition format.").content("text/plain", text),
        )
        .response(401, api.error(OPERATOR_REFUSED));
    api.document.operation("GET", "/metrics", metrics);

    // ----- operator -----
    let policy = api.document.request::<AdmissionBudgetV1>();
    let published = api.document.response::<PublishResponse>();
    let publish = Operation::new("publishPolicy", "Publish a policy")
        .tag("operator")
        .description("Publishes an `admissionBudget.v1` for its pair at a rising generation; opens the generation's account.")
        .security(&[OPERATOR])
        .json_body(policy, true)
        .response(201, api.success("Published (`published`).", published))
        .response(400, api.error("`invalid_policy`, or as any call: `invalid_body`, `unreadable_body`."))
        .response(409, api.error("`generation_not_rising` (with `currentGeneration`)."));
    let publish = api.common(publish, OPERATOR_REFUSED);
    api.document.operation("PUT", "/v1/policies", publish);

    let enrolled = api.document.response::<EnrollResponse>();
    let enroll = Operation::new("enrollGateway", "Enrol a gateway identity")
        .tag("operator")
        .security(&[OPERATOR])
        .path_parameter(
            "identity",
            "The agent's key ID (`ed25519:<64 hex digits>`).",
            identity.clone(),
        )
        .response(201, api.success("Enrolled (`enrolled`).", enrolled.clone()))
        .response(
            200,
            api.success("Enrolled already (`duplicate`).", enrolled),
        )
        .response(
            400,
            api.error("`invalid_path`: not an ed25519 key on the curve."),
        )
        .response(404, api.error(NOT_FOUND));
    let enroll = api.common(enroll, OPERATOR_REFUSED);
    api.document
        .operation("PUT", "/v1/gateways/{identity}", enroll);

    let accounts_view = api.document.response::<AccountsResponse>();
    let accounts = pair_parameters(
        Operation::new("getAccounts", "A pair's policy, state and accounts")
            .tag("operator")
            .security(&[OPERATOR]),
    )
    .response(
        200,
        api.success("The accounts, oldest first (`found`).", accounts_view),
    )
    .response(400, api.error(BAD_PATH))
    .response(404, api.error("`no_policy`, or `no_such_endpoint`."));
    let accounts = api.common(accounts, OPERATOR_REFUSED);
    api.document
        .operation("GET", "/v1/accounts/{subject}/{route}", accounts);

    let changed = api.document.response::<RouteControlResponse>();
    let admission_body = api.document.request::<AdmissionBody>();
    let admission = pair_parameters(
        Operation::new("setAdmission", "Stop or resume admission")
            .tag("operator")
            .description(
                "Stops (rolls back) or resumes admission under the pair's current generation.",
            )
            .security(&[OPERATOR]),
    )
    .json_body(admission_body, true)
    .response(
        200,
        api.success("`changed` or `unchanged`.", changed.clone()),
    )
    .response(400, api.error(BAD_REQUEST))
    .response(404, api.error("`no_policy`, or `no_such_endpoint`."))
    .response(
        409,
        api.error("`not_current_generation` (with `currentGeneration`)."),
    );
    let admission = api.common(admission, OPERATOR_REFUSED);
    api.document.operation(
        "POST",
        "/v1/accounts/{subject}/{route}/admission",
        admission,
    );

    let freeze_body = api.document.request::<FreezeBody>();
    let freeze = pair_parameters(
        Operation::new("setFrozen", "Freeze or unfreeze a pair")
            .tag("operator")
            .security(&[OPERATOR]),
    )
    .json_body(freeze_body, true)
    .response(200, api.success("`changed` or `unchanged`.", changed))
    .response(400, api.error(BAD_REQUEST))
    .response(404, api.error("`no_policy`, or `no_such_endpoint`."));
    let freeze = api.common(freeze, OPERATOR_REFUSED);
    api.document
        .operation("POST", "/v1/accounts/{subject}/{route}/freeze", freeze);

    let report = api.document.response::<AuditResponse>();
    let drift = json!({"anyOf": [report.clone(), api.error.clone()]});
    let audit = Operation::new("audit", "Check every equation")
        .tag("operator")
        .security(&[OPERATOR])
        .response(200, api.success("Every equation holds (`clean`).", report))
        .response(
            500,
            Response::new("The audit found drift (`drift`: the report with `ok: false` and its violations), or `internal`.")
                .json(drift),
        )
        .response(401, api.error(OPERATOR_REFUSED))
        .response(503, api.error("`unavailable` or `commit_failed`."));
    api.document.operation("GET", "/v1/audit", audit);

    // ----- agents: reservations -----
    let reserve_body = api.document.request::<ReserveBody>();
    let not_enforced = api.document.response::<NotEnforcedResponse>();
    let reserve = Operation::new("reserve", "Reserve units")
        .tag("reservations")
        .description("Reserves units under the ID the signing identity derives from the idempotency key and the pair. A repeat answers the receipt as it is now.")
        .security(&[AGENT])
        .json_body(reserve_body, true)
        .response(201, api.success("Reserved: the `limitReservation.v1` (`reserved`).", receipt.clone()))
        .response(
            200,
            api.success(
                "A repeat (`duplicate`), a shadow decision (`shadow`; `Reservoir-Would-Reject` names the dimension enforcement would refuse on), or `{\"mode\": \"off\"}` (`not_enforced`).",
                json!({"anyOf": [receipt.clone(), not_enforced.clone()]}),
            )
            .header(
                "Reservoir-Would-Reject",
                "Shadow mode: the dimension enforcement would have rejected on.",
                false,
                dimension.clone(),
            ),
        )
        .response(400, api.error("`invalid_units`, or as any call: `invalid_body`, `unreadable_body`, `signature_invalid` (digest mismatch)."))
        .response(403, api.error("`reservation_id_foreign`: not the ID the caller derives."))
        .response(404, api.error("`no_policy`."))
        .response(409, api.error("`idempotency_conflict`, `reservation_abandoned` or `overflow`."))
        .response(
            429,
            rate_limited(
                &api,
                "`rate_limited`, with `dimension`, `policyGeneration`, `retryAfterSeconds` and `rateLimit`.",
            )
            .header(
                "RateLimit-Policy",
                "The caller's own limit: `\"budget\";q=<burst>;w=<seconds a full burst takes to refill>`.",
                false,
                json!({"type": "string"}),
            )
            .header(
                "RateLimit",
                "The caller's own state: `\"budget\";r=<available>;t=<seconds>`.",
                false,
                json!({"type": "string"}),
            ),
        );
    let reserve = api.common(reserve, AGENT_REFUSED);
    api.document.operation("POST", "/v1/reservations", reserve);

    let get = reservation_parameter(
        Operation::new("getReservation", "Read a reservation")
            .tag("reservations")
            .description("The owner agent, or the operator (with `Authorization`).")
            .security(&[AGENT, OPERATOR]),
    )
    .response(200, api.success("The `limitReservation.v1` as it is now (`found`).", receipt.clone()))
    .response(400, api.error(BAD_PATH))
    .response(404, api.error("`reservation_not_found` (also another identity's) or `reservation_abandoned`; `no_such_endpoint`."));
    let get = api.common(get, EITHER_REFUSED);
    api.document
        .operation("GET", "/v1/reservations/{reservation}", get);

    let start_body = api.document.request::<StartBody>();
    let start = reservation_parameter(
        Operation::new("start", "Start: bind the executor's operation")
            .tag("reservations")
            .security(&[AGENT]),
    )
    .json_body(start_body, true)
    .response(200, api.success("The receipt (`started`, `duplicate`).", receipt.clone()))
    .response(400, api.error(BAD_REQUEST))
    .response(404, api.error("`reservation_not_found`, or `no_such_endpoint`."))
    .response(409, api.error("`operation_conflict` (with `boundOperationId`), `reservation_expired` (with the `receipt`) or `illegal_state` (with `state`)."));
    let start = api.common(start, AGENT_REFUSED);
    api.document
        .operation("POST", "/v1/reservations/{reservation}/start", start);

    let settle_body = api.document.request::<SettleBody>();
    let settlement = api.document.response::<SettlementReceiptV1>();
    let settle = reservation_parameter(
        Operation::new("settle", "Settle the actual units")
            .tag("reservations")
            .security(&[AGENT]),
    )
    .json_body(settle_body, true)
    .response(200, api.success("The `settlementReceipt.v1` (`settled`, `duplicate`, `corrected`).", settlement.clone()))
    .response(400, api.error(BAD_REQUEST))
    .response(404, api.error("`reservation_not_found`, or `no_such_endpoint`."))
    .response(409, api.error("`operation_conflict`, `settlement_conflict` (with `actualUnits`), `not_started`, `illegal_state` or `overflow`."));
    let settle = api.common(settle, AGENT_REFUSED);
    api.document
        .operation("POST", "/v1/reservations/{reservation}/settle", settle);

    let empty = api.document.request::<EmptyBody>();
    let release = reservation_parameter(
        Operation::new("release", "Release unused units")
            .tag("reservations")
            .security(&[AGENT]),
    )
    .json_body(empty.clone(), false)
    .response(
        200,
        api.success("The receipt (`released`, `duplicate`).", receipt.clone()),
    )
    .response(400, api.error(BAD_REQUEST))
    .response(
        404,
        api.error("`reservation_not_found`, or `no_such_endpoint`."),
    )
    .response(409, api.error("`illegal_state` or `overflow`."));
    let release = api.common(release, AGENT_REFUSED);
    api.document
        .operation("POST", "/v1/reservations/{reservation}/release", release);

    let abandon_body = api.document.request::<AbandonBody>();
    let abandoned = api.document.response::<AbandonResponse>();
    let abandon = reservation_parameter(
        Operation::new("abandon", "Abandon a reservation ID")
            .tag("reservations")
            .description("The owner agent sends what the ID was derived from (`{subject, route, idempotencyKey}`); the operator sends no body (or `{}`).")
            .security(&[AGENT, OPERATOR]),
    )
    .json_body(json!({"anyOf": [abandon_body, empty.clone()]}), false)
    .response(200, api.success("`{reservation, outcome}`: `tombstoned`, `abandoned` (with the `receipt`) or `duplicate`.", abandoned.clone()))
    .response(400, api.error(BAD_REQUEST))
    .response(403, api.error("`reservation_id_foreign`."))
    .response(404, api.error("`reservation_not_found` (another identity's ID; the operator naming nothing), or `no_such_endpoint`."))
    .response(409, api.error("`illegal_state` (its outcome is known; with the `receipt`) or `overflow`."));
    let abandon = api.common(abandon, EITHER_REFUSED);
    api.document
        .operation("POST", "/v1/reservations/{reservation}/abandon", abandon);

    let batch_body = api.document.request::<BatchBody>();
    let result = json!({
        "type": "object",
        "description": "One operation's answer: the status and body its single call would have answered, and for a 2xx the outcome its `Reservoir-Outcome` header would have named (and `wouldReject`, its `Reservoir-Would-Reject`). A refusal's `Retry-After` and `RateLimit` headers are in its body (`retryAfterSeconds`, `rateLimit`).",
        "required": ["status", "body"],
        "properties": {
            "status": {"type": "integer", "minimum": 200, "maximum": 599},
            "outcome": api.outcome.clone(),
            "wouldReject": dimension.clone(),
            "body": {"anyOf": [receipt.clone(), settlement.clone(), abandoned.clone(), not_enforced.clone(), api.error.clone()]},
        },
    });
    let results = api.document.named_schema(
        "BatchResults",
        json!({
            "type": "object",
            "required": ["results"],
            "properties": {"results": {"type": "array", "items": result}},
        }),
    );
    let batch = Operation::new("batch", "Many reservation calls in one request")
        .tag("reservations")
        .description(&format!("1 to {BATCH_OPERATIONS_MAX} reserve, getReservation, start, settle, release and abandon calls of the signing agent under one signature (the body at most {} KiB), applied in order and committed together where they fit in one group commit. Each operation is parsed as strictly as its single call; a malformed one is answered as its own 400 `invalid_body` (the field named within the operation) and the others go on. The 200 lists one result per operation, in order.", BATCH_BODY_SIZE_MAX / 1024))
        .security(&[AGENT])
        .json_body(batch_body, true)
        .response(200, Response::new("One result per operation, in order.").json(results))
        .response(400, api.error(&format!("`invalid_body` (field `operations`: not `{{\"operations\": [...]}}`, none, or more than {BATCH_OPERATIONS_MAX}), `unreadable_body`, or `signature_invalid` (digest mismatch).")))
        .response(404, api.error(NOT_FOUND));
    let batch = api.common(batch, AGENT_REFUSED).response(
        413,
        api.error(&format!(
            "`body_too_large`: the body is above {} KiB.",
            BATCH_BODY_SIZE_MAX / 1024
        )),
    );
    api.document.operation("POST", "/v1/batch", batch);

    // ----- agents: boots and shards -----
    let boot_body = api.document.request::<BootBody>();
    let booted = api.document.response::<BootResponse>();
    let boot = Operation::new("registerBoot", "Register an agent's boot")
        .tag("shards")
        .security(&[AGENT])
        .path_parameter("identity", "The calling agent's own key ID.", identity)
        .json_body(boot_body, true)
        .response(
            201,
            api.success("The boot epoch and nonce (`registered`).", booted),
        )
        .response(400, api.error(BAD_REQUEST))
        .response(
            403,
            api.error("`wrong_identity`: the path names another identity."),
        )
        .response(404, api.error(NOT_FOUND))
        .response(409, api.error("`boot_replayed` or `overflow`."));
    let boot = api.common(boot, AGENT_REFUSED);
    api.document
        .operation("POST", "/v1/gateways/{identity}/boot", boot);

    let shard_body = api.document.request::<IssueShardBody>();
    let shard_document = api.document.response::<EmergencyShardV1>();
    let issue = Operation::new("issueShard", "Take an emergency shard")
        .tag("shards")
        .security(&[AGENT])
        .json_body(shard_body, true)
        .response(201, api.success("The `emergencyShard.v1` (`issued`).", shard_document.clone()))
        .response(200, api.success("The same shard for a repeated shard ID (`duplicate`).", shard_document))
        .response(400, api.error(BAD_REQUEST))
        .response(403, api.error("`wrong_identity`."))
        .response(404, api.error("`no_policy`."))
        .response(409, api.error("`superseded_boot` (with `currentBootEpoch`), `emergency_disabled`, `too_many_open_shards`, `shard_id_taken` or `overflow`."))
        .response(429, rate_limited(&api, "`rate_limited` or `shard_cap_reached`, with `retryAfterSeconds`."));
    let issue = api.common(issue, AGENT_REFUSED);
    api.document.operation("POST", "/v1/shards", issue);

    let terminal = api.document.request::<ShardTerminalReceiptV1>();
    let reconciled = api.document.response::<ReconcileResponse>();
    let reconcile = Operation::new("reconcileShard", "Return a shard's terminal receipt")
        .tag("shards")
        .security(&[AGENT])
        .path_parameter("shard", "The shard's ID (the receipt's `shard`).", shard)
        .json_body(terminal, true)
        .response(200, api.success("`{shard, duplicate, reconciliation}` (`reconciled`, `duplicate`).", reconciled))
        .response(400, api.error("`invalid_body` (field `signature` or `shard`), `receipt_mismatch`, or as any call."))
        .response(403, api.error("`wrong_identity`: the shard is another identity's."))
        .response(404, api.error("`shard_not_found`, or `no_such_endpoint`."));
    let reconcile = api.common(reconcile, AGENT_REFUSED);
    api.document
        .operation("POST", "/v1/shards/{shard}/receipt", reconcile);

    api.document.finish()
}

/// The document as served and committed: pretty JSON and a final newline.
pub fn document_text() -> String {
    let mut text = serde_json::to_string_pretty(&document()).unwrap_or_default();
    text.push('\n');
    text
}

/// Checks shared by the two daemons' document tests.
#[cfg(test)]
pub(crate) mod checks {
    use std::collections::BTreeSet;

    use serde_json::Value;

    /// `(METHOD, path)` of every `.route("path", method(handler))` in a
    /// router's source, methods chained with `.post(…)` included.
    pub fn routes_in_source(source: &str) -> BTreeSet<(String, String)> {
        let mut routes = BTreeSet::new();
        for piece in source.split(".route(\"").skip(1) {
            let Some((path, rest)) = piece.split_once('"') else {
                continue;
            };
            let call = rest.split(')').next().unwrap_or_default();
            for method in ["get", "put", "post", "delete", "patch"] {
                if call.contains(&format!(" {method}(")) || call.contains(&format!(".{method}(")) {
                    routes.insert((method.to_ascii_uppercase(), path.to_owned()));
                }
            }
        }
        routes
    }

    /// `(METHOD, path)` of every operation of a document.
    pub fn operations(document: &Value) -> BTreeSet<(String, String)> {
        let mut operations = BTreeSet::new();
        for (path, item) in document["paths"].as_object().expect("paths") {
            for method in item.as_object().expect("path item").keys() {
                operations.insert((method.to_ascii_uppercase(), path.clone()));
            }
        }
        operations
    }

    /// Every `$ref` names a schema of the document.
    pub fn dangling_refs(document: &Value) -> Vec<String> {
        fn walk(value: &Value, schemas: &Value, dangling: &mut Vec<String>) {
            match value {
                Value::Object(object) => {
                    for (key, member) in object {
                        match (key.as_str(), member) {
                            ("$ref", Value::String(reference)) => {
                                let name = reference
                                    .strip_prefix("#/components/schemas/")
                                    .unwrap_or(reference);
                                if schemas.get(name).is_none() {
                                    dangling.push(reference.clone());
                                }
                            }
                            _ => walk(member, schemas, dangling),
                        }
                    }
                }
                Value::Array(items) => items.iter().for_each(|item| walk(item, schemas, dangling)),
                _ => {}
            }
        }
        let mut dangling = Vec::new();
        walk(document, &document["components"]["schemas"], &mut dangling);
        dangling
    }

    /// Compares the committed `file` (relative to the workspace root) with
    /// `generated`; with `UPDATE_OPENAPI=1` in the environment, writes it.
    pub fn committed_matches(file: &str, generated: &str, command: &str) {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(file);
        if std::env::var_os("UPDATE_OPENAPI").is_some() {
            std::fs::write(&path, generated).expect("writes the document");
        }
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == generated,
            "{file} differs from the document the code generates; regenerate it with `{command} > {file}` (or run this test with UPDATE_OPENAPI=1) and commit it"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_committed_document_is_the_generated_one() {
        checks::committed_matches(
            "docs/openapi/central.json",
            &document_text(),
            "cargo run -p reservoir -- central openapi",
        );
    }

    #[test]
    fn every_route_is_documented_and_every_operation_routed() {
        let routes = checks::routes_in_source(include_str!("http.rs"));
        assert!(
            routes.len() > 15,
            "the router's routes were found: {routes:?}"
        );
        assert_eq!(routes, checks::operations(&document()));
    }

    #[test]
    fn every_reference_resolves() {
        assert_eq!(checks::dangling_refs(&document()), Vec::<String>::new());
    }

    #[test]
    fn error_codes_are_the_wire_names() {
        let document = document();
        let codes = &document["components"]["schemas"]["ErrorCode"]["enum"];
        let names: Vec<&str> = ledger::protocol::ErrorCode::ALL
            .iter()
            .map(|code| code.as_str())
            .collect();
        assert_eq!(*codes, serde_json::json!(names));
        let body = &document["components"]["schemas"]["ErrorBody"];
        assert_eq!(body["required"], serde_json::json!(["error", "message"]));
        assert!(
            body.get("additionalProperties").is_none(),
            "readers ignore members they do not know: {body}"
        );
    }

    #[test]
    fn a_refusal_with_retry_after_documents_the_header() {
        let document = document();
        for (path, method) in [("/v1/reservations", "post"), ("/v1/shards", "post")] {
            let header =
                &document["paths"][path][method]["responses"]["429"]["headers"]["Retry-After"];
            assert_eq!(header["required"], true, "{method} {path}");
        }
    }
}
