//! The agent socket API's OpenAPI 3.1 document (docs/design.md §6.5),
//! served at `GET /openapi.json` on the socket and committed as
//! `docs/openapi/agent.json`; and the typed bodies of the answers the
//! socket writes besides the reservation record ([`StatusBody`],
//! [`PassThroughBody`]). Every body's schema is derived from the type the
//! handlers parse or write; the list of operations is checked against the
//! router in `socket.rs` by this module's tests.
//!
//! Regenerate the committed file with
//! `cargo run -p reservoir -- agent openapi > docs/openapi/agent.json`.

use agent_core::{AgentReservation, AgentStatus, ShardPage, ShardStatus};
use http_serve::openapi::{ApiDocument, Operation, Response};
use ledger::protocol::Refusal;
use schemars::JsonSchema;
use serde::Serialize;
use serde_json::{Value, json};
use shard_format::{GatewayIdentity, ReservationId, Route, ShardId, Subject};

use crate::socket::{ReserveBody, SHARDS_PAGE_MAX, SettleBody, StartBody};

/// `GET /v1/status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct StatusBody {
    /// `partitioned` if any pair is; else `central_unreachable` while a
    /// call to the center gets no answer; else `healthy`.
    #[schemars(extend("enum" = ["healthy", "partitioned", "central_unreachable"]))]
    pub mode: String,
    pub identity: GatewayIdentity,
    /// `null` until this boot is registered.
    pub boot_epoch: Option<u64>,
    pub pairs: Vec<PairStatusBody>,
    /// The open shards, in ID order.
    pub shards: Vec<ShardStatus>,
    /// How many closed shards are kept for the retention window
    /// (`GET /v1/shards` lists them).
    pub shards_closed: usize,
    /// Reservations with an operation the center must still receive.
    pub pending_sync: usize,
    /// Terminal receipts not yet acknowledged.
    pub pending_receipts: usize,
    pub reservations_in_flight: usize,
    /// Reservations held in memory (and in the journal), in flight or not.
    pub reservations_held: usize,
    /// Terminal reservations kept for the retention window.
    pub reservations_retained: usize,
    pub shares: Vec<ShareBody>,
    /// The journal file's size in bytes.
    pub journal_bytes: u64,
    /// Why the last call to the center got no answer (the error and its
    /// causes); `null` once a call is answered.
    pub central_error: Option<String>,
}

/// `GET /v1/shards`: a page of the shards the agent holds, open or
/// closed, in ID order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ShardsBody {
    pub shards: Vec<ShardStatus>,
    /// The last shard's ID when more come after it (pass it as `after`
    /// for the next page); `null` on the last page.
    pub next: Option<ShardId>,
}

impl ShardsBody {
    pub fn new(page: ShardPage) -> Self {
        Self {
            shards: page.shards,
            next: page.next,
        }
    }
}

/// A pair's mode in [`StatusBody`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct PairStatusBody {
    pub subject: Subject,
    pub route: Route,
    pub partitioned: bool,
    pub consecutive_failures: u32,
}

/// A subject's share of contended starts in [`StatusBody`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct ShareBody {
    pub subject: Subject,
    pub weight: u32,
    /// Starts granted while two or more subjects were waiting.
    pub granted: u64,
}

impl StatusBody {
    /// The core's view; `journalBytes` 0 and `centralError` `null` until
    /// the shell fills them in.
    pub fn new(status: &AgentStatus) -> Self {
        Self {
            mode: status.mode.to_owned(),
            identity: status.identity.clone(),
            boot_epoch: status.boot_epoch,
            pairs: status
                .pairs
                .iter()
                .map(|pair| PairStatusBody {
                    subject: pair.pair.subject.clone(),
                    route: pair.pair.route.clone(),
                    partitioned: pair.partitioned,
                    consecutive_failures: pair.consecutive_failures,
                })
                .collect(),
            shards: status.shards.clone(),
            shards_closed: status.shards_closed,
            pending_sync: status.pending_sync,
            pending_receipts: status.pending_receipts,
            reservations_in_flight: status.reservations_in_flight,
            reservations_held: status.reservations_held,
            reservations_retained: status.reservations_retained,
            shares: status
                .shares
                .iter()
                .map(|share| ShareBody {
                    subject: share.subject.clone(),
                    weight: share.weight,
                    granted: share.granted,
                })
                .collect(),
            journal_bytes: 0,
            central_error: None,
        }
    }
}

/// `{"admitted": true, "mode": "off"}`: the route is off at the center;
/// admitted without a record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, JsonSchema)]
pub struct PassThroughBody {
    #[schemars(extend("const" = true))]
    pub admitted: bool,
    #[schemars(extend("const" = "off"))]
    pub mode: String,
}

impl Default for PassThroughBody {
    fn default() -> Self {
        Self {
            admitted: true,
            mode: "off".to_owned(),
        }
    }
}

/// Adds the refusals every call may answer: a peer outside the
/// allow-list (403, or the center's 403 passed on), an oversized body (413)
/// and a stopping or overloaded agent (503, with `Retry-After`).
fn common(operation: Operation, error: &Value, unavailable: Response) -> Operation {
    operation
        .response(
            403,
            Response::new("`peer_not_allowed`: the peer's uid/gid may not use the socket; or the center's `reservation_id_foreign`, passed on.")
                .json(error.clone()),
        )
        .response(
            413,
            Response::new("`body_too_large`: the body is above 64 KiB.").json(error.clone()),
        )
        .response(503, unavailable)
}

/// The agent socket API's OpenAPI document.
pub fn document() -> Value {
    let mut document = ApiDocument::new(
        "Reservoir agent socket API",
        env!("CARGO_PKG_VERSION"),
        "The sidecar agent's HTTP/1.1 API on its Unix socket (docs/design.md §6.5): gateways reserve, start, settle, release and cancel; no credentials beyond the socket's file mode and the optional uid/gid allow-list. Every error answer is `{error, message, …details}` with a stable `error` code; every 503 carries `Retry-After` and is safe to retry with the same idempotency key or operation ID.",
    );
    let error = document.response::<Refusal>();
    let record = document.response::<AgentReservation>();
    let reservation = document.request::<ReservationId>();
    let retry_after = json!({"type": "integer", "minimum": 0});
    let text = json!({"type": "string"});
    let refusal = |description: &str| Response::new(description).json(error.clone());
    let with_retry_after = |description: &str| {
        refusal(description).header(
            "Retry-After",
            "Whole seconds to wait; equals `retryAfterSeconds`.",
            true,
            retry_after.clone(),
        )
    };
    const STOPPING: &str = "`overloaded` (more than 8192 requests under way) or `stopping`.";
    let not_found = |codes: &str| refusal(codes);
    let passed_on = |codes: &str| refusal(codes);
    let on_reservation = |operation: Operation| {
        operation
            .path_parameter("reservation", "The reservation's ID.", reservation.clone())
            .response(
                400,
                refusal("`invalid_path`, `invalid_body` or `invalid_units` (with `field`): a malformed ID or body; `unreadable_body`; or the center's `signature_invalid`, passed on."),
            )
            .response(401, passed_on("the center's `unknown_identity` or `signature_invalid` (this agent's identity), passed on."))
    };

    let health_like = |id: &str, summary: &str, response: Response| {
        Operation::new(id, summary)
            .tag("agent")
            .response(200, response)
    };
    let openapi = health_like(
        "openapi",
        "This document",
        Response::new("The OpenAPI 3.1 document.")
            .json(json!({"type": "object", "required": ["openapi", "paths"]})),
    );
    document.operation(
        "GET",
        "/openapi.json",
        common(openapi, &error, with_retry_after(STOPPING)),
    );
    let metrics = health_like(
        "metrics",
        "Prometheus metrics",
        Response::new("Prometheus text exposition format.").content("text/plain", text),
    );
    document.operation(
        "GET",
        "/metrics",
        common(metrics, &error, with_retry_after(STOPPING)),
    );
    let status_body = document.response::<StatusBody>();
    let status = health_like(
        "status",
        "The agent's mode, pairs, open shards and queues",
        Response::new("The status.").json(status_body),
    );
    document.operation(
        "GET",
        "/v1/status",
        common(status, &error, with_retry_after(STOPPING)),
    );
    let shards_body = document.response::<ShardsBody>();
    let shards = health_like(
        "shards",
        "The shards the agent holds, closed ones too, a page at a time",
        Response::new("A page of the shards, in ID order.").json(shards_body),
    )
    .query_parameter(
        "after",
        "A shard ID: the page starts after it (the last page's `next`).",
        json!({"type": "string"}),
    )
    .query_parameter(
        "limit",
        &format!("Most shards in the page (default and most: {SHARDS_PAGE_MAX})."),
        json!({"type": "integer", "minimum": 1, "maximum": SHARDS_PAGE_MAX}),
    )
    .response(
        400,
        refusal("`invalid_query` (with `field`): `after` is not a shard ID or `limit` is not a number from 1 to the most."),
    );
    document.operation(
        "GET",
        "/v1/shards",
        common(shards, &error, with_retry_after(STOPPING)),
    );

    let reserve_body = document.request::<ReserveBody>();
    let pass_through = document.response::<PassThroughBody>();
    let reserve = Operation::new("reserve", "Reserve units")
        .tag("reservations")
        .description("Reserves under the reservation ID the agent derives from the idempotency key: from the center while it is reachable, else from an emergency shard. A repeat of the key answers the record.")
        .json_body(reserve_body, true)
        .response(201, Response::new("The new reservation record.").json(record.clone()))
        .response(
            200,
            Response::new("The record (a repeat of the key), or `{\"admitted\": true, \"mode\": \"off\"}`.")
                .json(json!({"anyOf": [record.clone(), pass_through]})),
        )
        .response(400, refusal("`invalid_body` or `invalid_units` (with `field`), `unreadable_body`; or the center's `signature_invalid`, passed on."))
        .response(401, passed_on("the center's `unknown_identity` or `signature_invalid` (this agent's identity), passed on."))
        .response(404, passed_on("the center's `no_policy`: no policy is published for the pair, passed on."))
        .response(409, refusal("`idempotency_conflict`; or the center's `reservation_abandoned`, `overflow` or another 409, passed on with its code."))
        .response(
            429,
            with_retry_after("`rate_limited`: not admitted now; with `reservation`, `policyGeneration`, `dimension` and `retryAfterSeconds`.")
                .header(
                    "RateLimit-Policy",
                    "The center's field for the reservation's own pair, passed on.",
                    false,
                    json!({"type": "string"}),
                )
                .header(
                    "RateLimit",
                    "The center's field for the reservation's own pair, passed on.",
                    false,
                    json!({"type": "string"}),
                ),
        );
    let reserve = common(
        reserve,
        &error,
        with_retry_after(&format!(
            "`reservation_unknown`, `central_unreachable`, `emergency_debt`, `too_many_open_reservations`; or {STOPPING}"
        )),
    );
    document.operation("POST", "/v1/reservations", reserve);

    let get = on_reservation(
        Operation::new("getReservation", "Read a reservation record").tag("reservations"),
    )
    .response(200, Response::new("The record.").json(record.clone()))
    .response(
        404,
        not_found("`reservation_not_found`, or `no_such_endpoint`."),
    );
    document.operation(
        "GET",
        "/v1/reservations/{reservation}",
        common(get, &error, with_retry_after(STOPPING)),
    );

    let start_body = document.request::<StartBody>();
    let start = on_reservation(
        Operation::new("start", "Start: bind the executor's operation").tag("reservations"),
    )
    .json_body(start_body, true)
    .response(200, Response::new("The record.").json(record.clone()))
    .response(404, not_found("`reservation_not_found`, or `no_such_endpoint`."))
    .response(
        409,
        refusal("`operation_conflict`, `reservation_expired` or `illegal_state`; or the center's 409, passed on with its code."),
    );
    let start = common(
        start,
        &error,
        with_retry_after(&format!(
            "`central_unreachable` or `start_unknown`; or {STOPPING}"
        )),
    );
    document.operation("POST", "/v1/reservations/{reservation}/start", start);

    let settle_body = document.request::<SettleBody>();
    let settle = on_reservation(
        Operation::new("settle", "Settle the actual units").tag("reservations"),
    )
    .json_body(settle_body, true)
    .response(200, Response::new("The record.").json(record.clone()))
    .response(
        202,
        Response::new("The record: journaled, delivered to the center later.")
            .json(record.clone()),
    )
    .response(404, not_found("`reservation_not_found`, or `no_such_endpoint`."))
    .response(409, refusal("`operation_conflict`, `settlement_conflict`, `not_started` or `illegal_state`; or the center's 409, passed on with its code."));
    let settle = common(settle, &error, with_retry_after(STOPPING));
    document.operation("POST", "/v1/reservations/{reservation}/settle", settle);

    let empty = json!({"type": "object", "additionalProperties": false});
    let release = on_reservation(
        Operation::new("release", "Release the reservation's units").tag("reservations"),
    )
    .json_body(empty.clone(), false)
    .response(200, Response::new("The record.").json(record.clone()))
    .response(
        202,
        Response::new("The record: journaled, delivered to the center later.").json(record.clone()),
    )
    .response(
        404,
        not_found("`reservation_not_found`, or `no_such_endpoint`."),
    )
    .response(
        409,
        refusal("`illegal_state`; or the center's 409, passed on with its code."),
    );
    let release = common(release, &error, with_retry_after(STOPPING));
    document.operation("POST", "/v1/reservations/{reservation}/release", release);

    let cancel = on_reservation(
        Operation::new("cancel", "Record that the gateway cancelled").tag("reservations"),
    )
    .description("The cancel is recorded; no state ends (docs/design.md §3.5).")
    .json_body(empty, false)
    .response(200, Response::new("The record.").json(record))
    .response(
        404,
        not_found("`reservation_not_found`, or `no_such_endpoint`."),
    );
    let cancel = common(cancel, &error, with_retry_after(STOPPING));
    document.operation("POST", "/v1/reservations/{reservation}/cancel", cancel);

    document.finish()
}

/// The document as served and committed: pretty JSON and a final newline.
pub fn document_text() -> String {
    let mut text = serde_json::to_string_pretty(&document()).unwrap_or_default();
    text.push('\n');
    text
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;

    use serde_json::Value;

    use super::*;

    /// `(METHOD, path)` of every `.route("path", method(handler))` in the
    /// router's source.
    fn routes_in_source(source: &str) -> BTreeSet<(String, String)> {
        let mut routes = BTreeSet::new();
        for piece in source.split(".route(\"").skip(1) {
            let Some((path, rest)) = piece.split_once('"') else {
                continue;
            };
            let call = rest.split(')').next().unwrap_or_default();
            for method in ["get", "put", "post", "delete", "patch"] {
                if call.contains(&format!(" {method}(")) {
                    routes.insert((method.to_ascii_uppercase(), path.to_owned()));
                }
            }
        }
        routes
    }

    #[test]
    fn the_committed_document_is_the_generated_one() {
        let file = "docs/openapi/agent.json";
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(file);
        let generated = document_text();
        if std::env::var_os("UPDATE_OPENAPI").is_some() {
            std::fs::write(&path, &generated).expect("writes the document");
        }
        let committed = std::fs::read_to_string(&path).unwrap_or_default();
        assert!(
            committed == generated,
            "{file} differs from the document the code generates; regenerate it with `cargo run -p reservoir -- agent openapi > {file}` (or run this test with UPDATE_OPENAPI=1) and commit it"
        );
    }

    #[test]
    fn every_route_is_documented_and_every_operation_routed() {
        let routes = routes_in_source(include_str!("socket.rs"));
        assert!(
            routes.len() > 8,
            "the router's routes were found: {routes:?}"
        );
        let document = document();
        let mut operations = BTreeSet::new();
        for (path, item) in document["paths"].as_object().expect("paths") {
            for method in item.as_object().expect("path item").keys() {
                operations.insert((method.to_ascii_uppercase(), path.clone()));
            }
        }
        assert_eq!(routes, operations);
    }

    #[test]
    fn every_reference_resolves() {
        let document = document();
        let text = document.to_string();
        let schemas = &document["components"]["schemas"];
        for piece in text.split("\"$ref\":\"").skip(1) {
            let reference = piece.split('"').next().unwrap_or_default();
            let name = reference
                .strip_prefix("#/components/schemas/")
                .unwrap_or(reference);
            assert!(schemas.get(name).is_some(), "{reference} resolves");
        }
    }

    #[test]
    fn the_status_body_is_what_the_socket_writes() {
        let status = AgentStatus {
            mode: "healthy",
            identity: GatewayIdentity::ed25519(&[7; 32]),
            boot_epoch: None,
            pairs: Vec::new(),
            shards: Vec::new(),
            shards_closed: 0,
            pending_sync: 0,
            pending_receipts: 0,
            reservations_in_flight: 0,
            reservations_held: 0,
            reservations_retained: 0,
            unknown: Vec::new(),
            shares: Vec::new(),
        };
        let written = crate::socket::status_json(&status);
        let Value::Object(members) = &written else {
            panic!("an object: {written}");
        };
        let document = document();
        let schema = &document["components"]["schemas"]["StatusBody"];
        let mut required: Vec<&str> = schema["required"]
            .as_array()
            .expect("required members")
            .iter()
            .filter_map(Value::as_str)
            .collect();
        required.sort_unstable();
        let mut names: Vec<&str> = members.keys().map(String::as_str).collect();
        names.sort_unstable();
        assert_eq!(names, required);
        assert_eq!(written["bootEpoch"], Value::Null);
        assert_eq!(written["centralError"], Value::Null);
    }
}
