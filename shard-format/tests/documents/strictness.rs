//! Strict parsing, driven by tables. Each case starts from a golden vector,
//! edits members of it, and states the field the parser must name in its
//! refusal, or that the edited document must still be accepted (the edges
//! of every limit). The whole table is run before failing, so one run lists
//! every broken case.

use shard_format::limits::DOCUMENT_SIZE_MAX;
use shard_format::{DocumentSigner, ParseError};

use crate::support::{Kind, central_signer, vector_input};

/// One edit of a golden vector and what parsing the result must do.
struct Case {
    vector: &'static str,
    /// `(dotted member path, new JSON text or None to remove it)`.
    edits: Vec<(&'static str, Option<String>)>,
    /// The field the refusal must name; `None` if the document is valid.
    refused: Option<&'static str>,
}

/// Starts a case on the golden vector `vector`.
fn on(vector: &'static str) -> Case {
    Case {
        vector,
        edits: Vec::new(),
        refused: None,
    }
}

impl Case {
    /// Sets `member` to the JSON text `json`, adding it if absent.
    fn set(mut self, member: &'static str, json: impl Into<String>) -> Self {
        self.edits.push((member, Some(json.into())));
        self
    }

    /// Sets `member` to the JSON string holding `text`.
    fn set_str(self, member: &'static str, text: &str) -> Self {
        let json = serde_json::to_string(text).expect("strings serialize");
        self.set(member, json)
    }

    fn remove(mut self, member: &'static str) -> Self {
        self.edits.push((member, None));
        self
    }

    fn refused(mut self, field: &'static str) -> Self {
        self.refused = Some(field);
        self
    }

    fn accepted(self) -> Self {
        self
    }

    fn describe(&self) -> String {
        let edits: Vec<String> = self
            .edits
            .iter()
            .map(|(member, json)| match json {
                Some(json) => format!("{member} = {json}"),
                None => format!("without {member}"),
            })
            .collect();
        format!("{} with {}", self.vector, edits.join(", "))
    }

    /// The vector's JSON text with the edits applied. New values go in as
    /// text, so that numbers keep their spelling (`18446744073709551616`,
    /// `1.0`, `-0`).
    fn document(&self) -> Vec<u8> {
        const PLACEHOLDER: &str = "@@edited member {}@@";
        let mut value: serde_json::Value =
            serde_json::from_slice(&vector_input(self.vector)).expect("vector is JSON");
        for (index, (path, json)) in self.edits.iter().enumerate() {
            let (parents, member) = match path.rsplit_once('.') {
                Some((parents, member)) => (Some(parents), member),
                None => (None, *path),
            };
            let mut object = &mut value;
            for parent in parents.into_iter().flat_map(|parents| parents.split('.')) {
                object = match parent.parse::<usize>() {
                    Ok(index) => &mut object[index],
                    Err(_) => &mut object[parent],
                };
            }
            let object = object
                .as_object_mut()
                .expect("edited member's parent is an object");
            match json {
                Some(_) => {
                    let placeholder = PLACEHOLDER.replace("{}", &index.to_string());
                    object.insert(member.to_owned(), placeholder.into());
                }
                None => {
                    assert!(
                        object.remove(member).is_some(),
                        "{path} is not in the vector"
                    );
                }
            }
        }
        let mut text = serde_json::to_string_pretty(&value).expect("JSON serializes");
        for (index, (_, json)) in self.edits.iter().enumerate() {
            if let Some(json) = json {
                let placeholder = PLACEHOLDER.replace("{}", &index.to_string());
                text = text.replace(&format!("\"{placeholder}\""), json);
            }
        }
        text.into_bytes()
    }
}

/// Runs every case and fails listing all that went wrong.
fn check(cases: Vec<Case>) {
    let mut failures = Vec::new();
    for case in &cases {
        let kind = Kind::of_vector(case.vector);
        let outcome = kind.parse(&case.document());
        match (case.refused, outcome) {
            (None, Ok(_)) => {}
            (None, Err(error)) => failures.push(format!(
                "{}: refused ({error}) but is valid",
                case.describe()
            )),
            (Some(field), Ok(_)) => failures.push(format!(
                "{}: accepted; expected a refusal naming `{field}`",
                case.describe()
            )),
            (Some(field), Err(error)) => {
                if error.field != field || error.message.is_empty() {
                    failures.push(format!(
                        "{}: refusal names `{}` ({}); expected `{field}`",
                        case.describe(),
                        error.field,
                        error.message
                    ));
                }
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} cases failed:\n{}",
        failures.len(),
        cases.len(),
        failures.join("\n")
    );
}

const BUDGET: &str = "admissionBudget.v1";
const RESERVATION: &str = "limitReservation.v1";
const SETTLED_RESERVATION: &str = "limitReservation.v1-settled";
const FLEXIBLE_RESERVATION: &str = "limitReservation.v1-flexible";
const LEGS_RESERVATION: &str = "limitReservation.v1-legs";
const LEGS_SETTLEMENT: &str = "settlementReceipt.v1-legs";
const SETTLEMENT: &str = "settlementReceipt.v1";
const OPERATION: &str = "operationReceipt.v1";
const SHARD: &str = "emergencyShard.v1";
const TERMINAL: &str = "shardTerminalReceipt.v1";
const ALL: [&str; 6] = [BUDGET, RESERVATION, SETTLEMENT, OPERATION, SHARD, TERMINAL];

const ABOVE_U64: &str = "18446744073709551616";
const U64_MAX: &str = "18446744073709551615";
/// `UNITS_MAX + 1` (2^53).
const ABOVE_UNITS_MAX: &str = "9007199254740992";
const UNITS_MAX: &str = "9007199254740991";

#[test]
fn every_vector_is_valid_unedited() {
    check(ALL.iter().map(|vector| on(vector).accepted()).collect());
}

#[test]
fn schema_must_be_present_and_exact() {
    let mut cases = Vec::new();
    for vector in ALL {
        let other = if vector == OPERATION {
            BUDGET
        } else {
            OPERATION
        };
        cases.extend([
            on(vector).remove("schema").refused("schema"),
            on(vector).set_str("schema", other).refused("schema"),
            on(vector).set_str("schema", "").refused("schema"),
            on(vector)
                .set_str("schema", &vector.replace(".v1", ".v2"))
                .refused("schema"),
            on(vector)
                .set_str("schema", &vector.to_uppercase())
                .refused("schema"),
            on(vector)
                .set_str("schema", &format!("{vector} "))
                .refused("schema"),
            on(vector).set("schema", "null").refused("schema"),
            on(vector).set("schema", "1").refused("schema"),
            on(vector)
                .set("schema", format!("[\"{vector}\"]"))
                .refused("schema"),
        ]);
    }
    check(cases);
}

/// Each golden vector, whose `schema` comes first, parsed as every other
/// kind of document.
#[test]
fn a_document_of_one_kind_is_not_another() {
    let mut failures = Vec::new();
    for written in Kind::ALL {
        for parsed_as in Kind::ALL.into_iter().filter(|kind| *kind != written) {
            match parsed_as.parse(&written.sample()) {
                Err(ParseError { field, .. }) if field == "schema" => {}
                outcome => {
                    failures.push(format!("{written:?} as {parsed_as:?}: {}", show(&outcome)))
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn members_must_be_known_and_present() {
    let mut cases = Vec::new();
    for vector in ALL {
        cases.extend([
            on(vector).set("extra", "1").refused("extra"),
            on(vector).set("Schema", "1").refused("Schema"),
            on(vector).set("subject ", "1").refused("subject "),
        ]);
    }
    cases.extend([
        on(BUDGET).set("refill.extra", "1").refused("refill.extra"),
        on(BUDGET)
            .set("estimator_digest", "1")
            .refused("estimator_digest"),
        on(OPERATION)
            .set_str("signature", &"0".repeat(128))
            .refused("signature"),
        on(OPERATION)
            .set_str("keyId", "sim:central-1")
            .refused("keyId"),
        // Missing members.
        on(BUDGET).remove("subject").refused("subject"),
        on(BUDGET).remove("mode").refused("mode"),
        on(BUDGET).remove("refill").refused("refill"),
        on(BUDGET)
            .remove("refill.intervalMs")
            .refused("refill.intervalMs"),
        on(RESERVATION).remove("state").refused("state"),
        on(RESERVATION)
            .remove("requestDigest")
            .refused("requestDigest"),
        on(SETTLEMENT)
            .remove("conservative")
            .refused("conservative"),
        on(OPERATION).remove("completedAt").refused("completedAt"),
        on(SHARD).remove("signature").refused("signature"),
        on(SHARD).remove("bootNonce").refused("bootNonce"),
        on(TERMINAL).remove("keyId").refused("keyId"),
        // Members with defaults, and optional members, may be absent.
        on("admissionBudget.v1-emergency")
            .remove("emergencyShardValidityMs")
            .accepted(),
        on(RESERVATION).accepted(),
    ]);
    check(cases);
}

#[test]
fn numbers_must_be_non_negative_integers_within_u64() {
    let mut cases = Vec::new();
    let members = [
        (BUDGET, "opening"),
        (BUDGET, "refill.units"),
        (BUDGET, "priority"),
        (BUDGET, "fairnessWeight"),
        (BUDGET, "holdTtlMs"),
        (RESERVATION, "reservedUnits"),
        (SETTLEMENT, "actualUnits"),
        (OPERATION, "actualUnits"),
        (SHARD, "fence"),
        (SHARD, "bootEpoch"),
        (TERMINAL, "spentUnits"),
        (TERMINAL, "overdraftDebtUnits"),
    ];
    for (vector, member) in members {
        for json in [
            "-1",
            "-0",
            "-9007199254740991",
            ABOVE_U64,
            "1e400",
            "1.5",
            "1.0",
            "0.0",
            "1e3",
            "1E3",
            "0.5e1",
            "\"5\"",
            "true",
            "null",
            "[1]",
            "{}",
            "01",
            "+1",
            "NaN",
            "Infinity",
        ] {
            cases.push(on(vector).set(member, json).refused(member));
        }
        // A number followed by more characters is broken JSON around the
        // member: the refusal names the object that holds it.
        let parent = member.rsplit_once('.').map_or("", |(parent, _)| parent);
        for json in ["1_000", "0x10", "1 000", "1-1"] {
            cases.push(on(vector).set(member, json).refused(parent));
        }
    }
    check(cases);
}

#[test]
fn numbers_must_be_within_their_named_limits() {
    let mut cases = Vec::new();
    // Unit counts and counters: at most `UNITS_MAX` / `COUNTER_MAX` (2^53 − 1).
    let units = [
        (BUDGET, "policyGeneration"),
        (BUDGET, "refill.units"),
        (BUDGET, "burst"),
        (BUDGET, "overdraftUnitsMax"),
        (RESERVATION, "policyGeneration"),
        (RESERVATION, "reservedUnits"),
        (SETTLED_RESERVATION, "actualUnits"),
        (SETTLEMENT, "policyGeneration"),
        (SETTLEMENT, "reservedUnits"),
        (SETTLEMENT, "actualUnits"),
        (OPERATION, "actualUnits"),
        (SHARD, "policyGeneration"),
        (SHARD, "allocatedUnits"),
        (SHARD, "bootEpoch"),
        (SHARD, "fence"),
        (TERMINAL, "bootEpoch"),
        (TERMINAL, "allocatedUnits"),
        (TERMINAL, "spentUnits"),
        (TERMINAL, "confirmedUnusedUnits"),
        (TERMINAL, "unknownUnits"),
        (TERMINAL, "overdraftDebtUnits"),
    ];
    for (vector, member) in units {
        cases.push(on(vector).set(member, ABOVE_UNITS_MAX).refused(member));
        cases.push(on(vector).set(member, U64_MAX).refused(member));
        cases.push(on(vector).set(member, ABOVE_U64).refused(member));
    }
    cases.extend([
        // Limits that are not units.
        on(BUDGET).set("holdTtlMs", "86400001").refused("holdTtlMs"),
        on(BUDGET).set("holdTtlMs", "86400000").accepted(),
        on(BUDGET)
            .set("accountingEpochMs", "31622400001")
            .refused("accountingEpochMs"),
        on(BUDGET)
            .set("refill.intervalMs", "31622400001")
            .refused("refill.intervalMs"),
        on(BUDGET)
            .set("executionHardLimitMs", "31622400001")
            .refused("executionHardLimitMs"),
        on(BUDGET)
            .set("emergencyShardValidityMs", "31622400001")
            .refused("emergencyShardValidityMs"),
        on(BUDGET)
            .set("emergencyShardValidityMs", "31622400000")
            .accepted(),
        on(BUDGET)
            .set("fairnessWeight", "1000001")
            .refused("fairnessWeight"),
        on(BUDGET)
            .set("fairnessWeight", "4294967296")
            .refused("fairnessWeight"),
        on(BUDGET).set("fairnessWeight", "1000000").accepted(),
        on(BUDGET).set("priority", "256").refused("priority"),
        on(BUDGET).set("priority", "255").accepted(),
        // Members that must be at least 1.
        on(BUDGET)
            .set("policyGeneration", "0")
            .refused("policyGeneration"),
        on(BUDGET)
            .set("refill.intervalMs", "0")
            .refused("refill.intervalMs"),
        on(BUDGET)
            .set("accountingEpochMs", "0")
            .refused("accountingEpochMs"),
        on(BUDGET).set("holdTtlMs", "0").refused("holdTtlMs"),
        on(BUDGET)
            .set("fairnessWeight", "0")
            .refused("fairnessWeight"),
        on(BUDGET)
            .set("executionHardLimitMs", "0")
            .refused("executionHardLimitMs"),
        on(BUDGET)
            .set("emergencyShardValidityMs", "0")
            .refused("emergencyShardValidityMs"),
        on(RESERVATION)
            .set("policyGeneration", "0")
            .refused("policyGeneration"),
        on(SHARD)
            .set("allocatedUnits", "0")
            .refused("allocatedUnits"),
        on(SHARD).set("bootEpoch", "0").refused("bootEpoch"),
        on(SHARD).set("fence", "0").refused("fence"),
        on(TERMINAL).set("bootEpoch", "0").refused("bootEpoch"),
        // At the limit is fine.
        on(OPERATION).set("actualUnits", UNITS_MAX).accepted(),
        on(OPERATION).set("actualUnits", "0").accepted(),
        on(SHARD).set("fence", UNITS_MAX).accepted(),
        on(BUDGET)
            .set("burst", UNITS_MAX)
            .set("opening", UNITS_MAX)
            .set("refill.units", UNITS_MAX)
            .set("overdraftUnitsMax", UNITS_MAX)
            .set("policyGeneration", UNITS_MAX)
            .accepted(),
    ]);
    check(cases);
}

#[test]
fn identifiers_must_be_1_to_128_path_safe_bytes() {
    let mut cases = Vec::new();
    let members = [
        (BUDGET, "subject"),
        (BUDGET, "route"),
        (RESERVATION, "reservation"),
        (SETTLED_RESERVATION, "operationId"),
        (SETTLEMENT, "operationId"),
        (OPERATION, "reservation"),
        (SHARD, "shard"),
        (SHARD, "subject"),
        (TERMINAL, "route"),
    ];
    for (vector, member) in members {
        cases.push(on(vector).set_str(member, "").refused(member));
        cases.push(on(vector).set_str(member, &"a".repeat(129)).refused(member));
        cases.push(on(vector).set_str(member, &"a".repeat(128)).accepted());
        cases.push(on(vector).set_str(member, "a").accepted());
        cases.push(on(vector).set_str(member, "AZaz09-._~:@").accepted());
        for bad in [
            "tenant 7",
            "tenant/7",
            "tenant%207",
            "tenant#7",
            "tenant?7",
            "tenant+7",
            "tenant,7",
            "tenant\"7",
            "tenant\\7",
            "tenant\n7",
            "tenant\u{0}7",
            "tenänt",
            "tenant\u{2028}",
            " tenant",
            "tenant ",
            "ⓣenant",
        ] {
            cases.push(on(vector).set_str(member, bad).refused(member));
        }
        cases.push(on(vector).set(member, "7").refused(member));
        cases.push(on(vector).set(member, "null").refused(member));
        // A lone surrogate is not a string at all.
        cases.push(on(vector).set(member, "\"\\ud800\"").refused(member));
    }
    // Escapes that spell allowed characters are the same string.
    cases.push(on(BUDGET).set("subject", "\"tenant\\u002d7\"").accepted());
    check(cases);
}

#[test]
fn labels_must_be_1_to_64_bytes_of_printable_ascii() {
    let mut cases = Vec::new();
    for member in ["region", "capacityUnit"] {
        cases.extend([
            on(BUDGET).set_str(member, "").refused(member),
            on(BUDGET).set_str(member, &"x".repeat(65)).refused(member),
            on(BUDGET).set_str(member, &"x".repeat(64)).accepted(),
            on(BUDGET).set_str(member, " !\"#\\~").accepted(),
            on(BUDGET).set_str(member, "tökens").refused(member),
            on(BUDGET).set_str(member, "tokens\t").refused(member),
            on(BUDGET).set_str(member, "tokens\u{7f}").refused(member),
            on(BUDGET).set(member, "1").refused(member),
        ]);
    }
    check(cases);
}

#[test]
fn enumerations_must_be_one_of_their_spellings() {
    check(vec![
        on(BUDGET).set_str("mode", "ENFORCE").refused("mode"),
        on(BUDGET).set_str("mode", "Enforce").refused("mode"),
        on(BUDGET).set_str("mode", "").refused("mode"),
        on(BUDGET).set_str("mode", "off").accepted(),
        on(BUDGET).set_str("mode", "shadow").accepted(),
        on(BUDGET)
            .set_str("emergencyMode", "on")
            .refused("emergencyMode"),
        on(RESERVATION)
            .set_str("state", "reserved")
            .refused("state"),
        on(RESERVATION)
            .set_str("state", "Reserved")
            .refused("state"),
        on(RESERVATION).set_str("state", "RELEASED").accepted(),
        on(RESERVATION).set("state", "1").refused("state"),
        on(TERMINAL)
            .set_str("reason", "Reconnect")
            .refused("reason"),
        on(TERMINAL)
            .set_str("reason", "validity_ended")
            .refused("reason"),
        on(TERMINAL).set_str("reason", "validityEnded").accepted(),
        on(TERMINAL).set_str("reason", "restart").accepted(),
        on(SETTLEMENT)
            .set_str("conservative", "false")
            .refused("conservative"),
        on(SETTLEMENT)
            .set("conservative", "0")
            .refused("conservative"),
        on(SETTLEMENT).set("conservative", "true").accepted(),
    ]);
}

#[test]
fn digests_must_be_sha256_and_64_lowercase_hex_digits() {
    let mut cases = Vec::new();
    let good = "0123456789abcdef".repeat(4);
    for (vector, member) in [(BUDGET, "estimatorDigest"), (RESERVATION, "requestDigest")] {
        cases.push(
            on(vector)
                .set_str(member, &format!("sha256:{good}"))
                .accepted(),
        );
        for bad in [
            format!("SHA256:{good}"),
            format!("sha-256:{good}"),
            format!("sha512:{good}"),
            format!("sha256 {good}"),
            format!("sha256:{}", good.to_uppercase()),
            format!("sha256:{}A", &good[..63]),
            format!("sha256:{}", &good[..63]),
            format!("sha256:{good}0"),
            format!("sha256:{}", "g".repeat(64)),
            format!("sha256: {}", &good[..63]),
            good.clone(),
            "sha256:".to_owned(),
            String::new(),
        ] {
            cases.push(on(vector).set_str(member, &bad).refused(member));
        }
    }
    check(cases);
}

#[test]
fn signatures_nonces_and_key_ids_must_be_well_formed() {
    let mut cases = Vec::new();
    for vector in [SHARD, TERMINAL] {
        for bad in [
            String::new(),
            "0".repeat(127),
            "0".repeat(129),
            "0".repeat(130),
            "A".repeat(128),
            "g".repeat(128),
            format!("0x{}", "0".repeat(126)),
        ] {
            cases.push(on(vector).set_str("signature", &bad).refused("signature"));
        }
        cases.push(on(vector).set("signature", "0").refused("signature"));
    }
    for bad in [
        String::new(),
        "0".repeat(31),
        "0".repeat(33),
        "AA".repeat(16),
        "0g".repeat(16),
    ] {
        cases.push(on(SHARD).set_str("bootNonce", &bad).refused("bootNonce"));
    }
    let hex = "0123456789abcdef".repeat(4);
    for member in ["keyId", "gatewayIdentity"] {
        for bad in [
            String::new(),
            "central-1".to_owned(),
            "ed25519:".to_owned(),
            ":abc".to_owned(),
            format!("ed25519:{}", &hex[..63]),
            format!("ed25519:{hex}0"),
            format!("ed25519:{}", hex.to_uppercase()),
            format!("Ed25519 {hex}"),
            format!("ed25519:{}/", &hex[..63]),
            format!("sim:{}", "x".repeat(125)),
        ] {
            cases.push(on(SHARD).set_str(member, &bad).refused(member));
        }
        // Other schemes than ed25519 parse (the simulator's signer uses them).
        cases.push(on(SHARD).set_str(member, "sim:central-1").accepted());
        cases.push(
            on(SHARD)
                .set_str(member, &format!("sim:{}", "x".repeat(124)))
                .accepted(),
        );
    }
    check(cases);
}

#[test]
fn timestamps_must_be_rfc3339_utc_with_milliseconds() {
    let mut cases = Vec::new();
    let members = [
        (RESERVATION, "accountingEpoch"),
        (RESERVATION, "expiresAt"),
        (SETTLEMENT, "settledAt"),
        (OPERATION, "completedAt"),
        (SHARD, "notBefore"),
        (TERMINAL, "closedAt"),
    ];
    for (vector, member) in members {
        for bad in [
            "2026-07-19T14:00:00Z",
            "2026-07-19T14:00:00.0Z",
            "2026-07-19T14:00:00.00Z",
            "2026-07-19T14:00:00.0000Z",
            "2026-07-19T14:00:00.000000Z",
            "2026-07-19T14:00:00.000+00:00",
            "2026-07-19T14:00:00.000-00:00",
            "2026-07-19T16:00:00.000+02:00",
            "2026-07-19T14:00:00.000",
            "2026-07-19 14:00:00.000Z",
            "2026-07-19t14:00:00.000Z",
            "2026-07-19T14:00:00.000z",
            "2026-07-19T14:00:00,000Z",
            "2026-7-19T14:00:00.000Z",
            "+2026-07-19T14:00:00.000Z",
            "-2026-07-19T14:00:00.000Z",
            "02026-07-19T14:00:00.000Z",
            "2026-02-30T14:00:00.000Z",
            "2026-07-19T24:00:00.000Z",
            "2026-07-19T23:59:60.000Z",
            "1969-12-31T23:59:59.999Z",
            " 2026-07-19T14:00:00.000Z",
            "2026-07-19T14:00:00.000Z ",
            "",
        ] {
            cases.push(on(vector).set_str(member, bad).refused(member));
        }
        cases.push(on(vector).set(member, "1784469600000").refused(member));
    }
    cases.extend([
        on(OPERATION)
            .set_str("completedAt", "1970-01-01T00:00:00.000Z")
            .accepted(),
        on(OPERATION)
            .set_str("completedAt", "9999-12-31T23:59:59.999Z")
            .accepted(),
        on(OPERATION)
            .set_str("completedAt", "2028-02-29T00:00:00.000Z")
            .accepted(),
        on(OPERATION)
            .set_str("completedAt", "2026-02-29T00:00:00.000Z")
            .refused("completedAt"),
    ]);
    check(cases);
}

#[test]
fn cross_field_rules_are_enforced() {
    let central = central_signer();
    let central_key = serde_json::to_string(central.key_id().as_str()).expect("string");
    check(vec![
        // admissionBudget.v1: `burst` bounds the other amounts.
        on(BUDGET).set("opening", "1001").refused("opening"),
        on(BUDGET).set("opening", "1000").accepted(),
        on(BUDGET)
            .set("reservationUnitsMax", "1001")
            .refused("reservationUnitsMax"),
        on(BUDGET)
            .set("reservationUnitsMax", "0")
            .refused("reservationUnitsMax"),
        on(BUDGET).set("reservationUnitsMax", "1000").accepted(),
        on(BUDGET)
            .set_str("emergencyMode", "enabled")
            .refused("emergencyShardUnits"),
        on(BUDGET)
            .set_str("emergencyMode", "enabled")
            .set("emergencyShardUnits", "1001")
            .refused("emergencyShardUnits"),
        on(BUDGET)
            .set_str("emergencyMode", "enabled")
            .set("emergencyShardUnits", "1000")
            .accepted(),
        on(BUDGET)
            .set("emergencyShardUnits", "1001")
            .refused("emergencyShardUnits"),
        on(BUDGET).set("emergencyShardUnits", "10").accepted(),
        // limitReservation.v1: `actualUnits` exactly when settled,
        // `operationId` once started.
        on(RESERVATION)
            .set("actualUnits", "5")
            .refused("actualUnits"),
        on(SETTLED_RESERVATION)
            .remove("actualUnits")
            .refused("actualUnits"),
        on(SETTLED_RESERVATION)
            .remove("operationId")
            .refused("operationId"),
        on(SETTLED_RESERVATION)
            .set_str("state", "SETTLED_WITH_DEBT")
            .accepted(),
        on(SETTLED_RESERVATION)
            .set_str("state", "STARTED")
            .refused("actualUnits"),
        on(RESERVATION)
            .set_str("state", "STARTED")
            .refused("operationId"),
        on(RESERVATION)
            .set_str("state", "USAGE_UNKNOWN")
            .refused("operationId"),
        on(RESERVATION)
            .set_str("state", "STARTED")
            .set_str("operationId", "op-1")
            .accepted(),
        on(RESERVATION).set_str("operationId", "op-1").accepted(),
        // A flexible reservation: `minUnits` and `requestedUnits` together,
        // `1 ≤ minUnits ≤ reservedUnits ≤ requestedUnits` (1500 granted).
        on(FLEXIBLE_RESERVATION)
            .remove("minUnits")
            .refused("minUnits"),
        on(FLEXIBLE_RESERVATION)
            .remove("requestedUnits")
            .refused("requestedUnits"),
        on(RESERVATION)
            .set("minUnits", "1")
            .refused("requestedUnits"),
        on(RESERVATION)
            .set("minUnits", "1")
            .set("requestedUnits", "800")
            .accepted(),
        on(FLEXIBLE_RESERVATION)
            .set("minUnits", "0")
            .refused("minUnits"),
        on(FLEXIBLE_RESERVATION).set("minUnits", "1").accepted(),
        on(FLEXIBLE_RESERVATION)
            .set("minUnits", "1501")
            .refused("minUnits"),
        on(FLEXIBLE_RESERVATION).set("minUnits", "1500").accepted(),
        on(FLEXIBLE_RESERVATION)
            .set("requestedUnits", "1499")
            .refused("requestedUnits"),
        on(FLEXIBLE_RESERVATION)
            .set("requestedUnits", "1500")
            .accepted(),
        on(FLEXIBLE_RESERVATION)
            .set("requestedUnits", "9007199254740992")
            .refused("requestedUnits"),
        // A multi-leg reservation: 2 to 8 legs of distinct pairs and IDs,
        // its own leg among them as the receipt states it.
        on(LEGS_RESERVATION).set("legs", one_leg()).refused("legs"),
        on(LEGS_RESERVATION).set("legs", legs(2)).accepted(),
        on(LEGS_RESERVATION).set("legs", legs(8)).accepted(),
        on(LEGS_RESERVATION).set("legs", legs(9)).refused("legs"),
        on(LEGS_RESERVATION)
            .set_str("legs.2.route", "gpt-4o.requests")
            .refused("legs[2]"),
        on(LEGS_RESERVATION)
            .set_str("legs.2.reservation", "rl-01J2Z3Y4X5W6V7T8S9R0Q1P2N6")
            .refused("legs[2]"),
        on(LEGS_RESERVATION)
            .set("legs.1.reservedUnits", "1499")
            .refused("legs"),
        on(LEGS_RESERVATION)
            .set_str("legs.1.route", "gpt-4o.other")
            .refused("legs"),
        on(LEGS_RESERVATION)
            .set("legs.0.minUnits", "0")
            .set("legs.0.requestedUnits", "1")
            .refused("legs[0].minUnits"),
        on(LEGS_RESERVATION)
            .set("legs.0.minUnits", "1")
            .refused("legs[0].requestedUnits"),
        on(LEGS_RESERVATION)
            .set("legs.0.minUnits", "1")
            .set("legs.0.requestedUnits", "1")
            .accepted(),
        on(LEGS_RESERVATION).remove("legs").accepted(),
        on(LEGS_SETTLEMENT)
            .set("legs.1.actualUnits", "1201")
            .refused("legs"),
        on(LEGS_SETTLEMENT)
            .set("legs.2.overdraftUnits", "1")
            .refused("legs[2].overdraftUnits"),
        on(LEGS_SETTLEMENT)
            .set("legs.2.actualUnits", "2")
            .set("legs.2.overdraftUnits", "1")
            .accepted(),
        on(LEGS_SETTLEMENT)
            .set_str("legs.0.route", "gpt-4o.tokens")
            .refused("legs[1]"),
        on(LEGS_SETTLEMENT).remove("legs").accepted(),
        // settlementReceipt.v1: refund, overdraft and state follow the units.
        on(SETTLEMENT)
            .set("refundedUnits", "1")
            .refused("refundedUnits"),
        on(SETTLEMENT)
            .set("overdraftUnits", "151")
            .refused("overdraftUnits"),
        on(SETTLEMENT).set("overdraftUnits", "0").refused("state"),
        on(SETTLEMENT)
            .set("overdraftUnits", "0")
            .set_str("state", "SETTLED")
            .accepted(),
        on(SETTLEMENT).set_str("state", "SETTLED").refused("state"),
        on(SETTLEMENT).set_str("state", "RESERVED").refused("state"),
        on(SETTLEMENT)
            .set("actualUnits", "640")
            .set("overdraftUnits", "0")
            .set_str("state", "SETTLED")
            .refused("refundedUnits"),
        on(SETTLEMENT)
            .set("actualUnits", "640")
            .set("refundedUnits", "160")
            .set("overdraftUnits", "0")
            .set_str("state", "SETTLED")
            .accepted(),
        // emergencyShard.v1: `notBefore` strictly before `notAfter`.
        on(SHARD)
            .set_str("notAfter", "2026-07-19T14:05:00.000Z")
            .refused("notAfter"),
        on(SHARD)
            .set_str("notAfter", "2026-07-19T14:04:59.999Z")
            .refused("notAfter"),
        on(SHARD)
            .set_str("notAfter", "2026-07-19T14:05:00.001Z")
            .accepted(),
        // shardTerminalReceipt.v1: the book balances; the gateway signs.
        on(TERMINAL)
            .set("spentUnits", "61")
            .refused("allocatedUnits"),
        on(TERMINAL)
            .set("allocatedUnits", "101")
            .refused("allocatedUnits"),
        on(TERMINAL)
            .set("unknownUnits", "0")
            .refused("allocatedUnits"),
        on(TERMINAL)
            .set("unknownUnits", "0")
            .set("confirmedUnusedUnits", "40")
            .accepted(),
        on(TERMINAL)
            .set("keyId", central_key.clone())
            .refused("keyId"),
        on(TERMINAL)
            .set("gatewayIdentity", central_key.clone())
            .refused("keyId"),
        on(TERMINAL)
            .set("gatewayIdentity", central_key.clone())
            .set("keyId", central_key)
            .accepted(),
    ]);
}

/// Other JSON that serde would read as the same document is refused: the
/// document has one shape.
#[test]
fn members_must_have_their_json_shape() {
    check(vec![
        on(BUDGET).set("refill", "[100, 1000]").refused("refill"),
        on(BUDGET).set("refill", "\"100/1000\"").refused("refill"),
        on(BUDGET)
            .set("mode", "{\"enforce\": null}")
            .refused("mode"),
        on(RESERVATION)
            .set("state", "{\"RESERVED\": null}")
            .refused("state"),
        on(RESERVATION)
            .set("actualUnits", "null")
            .refused("actualUnits"),
        on(RESERVATION)
            .set("operationId", "null")
            .refused("operationId"),
        on(BUDGET)
            .set("emergencyShardUnits", "null")
            .refused("emergencyShardUnits"),
        on(BUDGET)
            .set("refill.units", "null")
            .refused("refill.units"),
    ]);
}

/// Edits of the document text as a whole.
#[test]
fn documents_must_be_one_json_object_of_bounded_size() {
    type Edit = fn(Vec<u8>) -> Vec<u8>;
    // `None`: accepted; `Some(None)`: refused; `Some(Some(field))`: refused
    // naming `field`.
    let edits: [(&str, Edit, Option<Option<&str>>); 16] = [
        (
            "trailing letters",
            |d| [d, b"xyz".to_vec()].concat(),
            Some(Some("")),
        ),
        (
            "a second object",
            |d| [d, b"{}".to_vec()].concat(),
            Some(Some("")),
        ),
        (
            "the document twice",
            |d| [d.clone(), d].concat(),
            Some(Some("")),
        ),
        (
            "a trailing comma",
            |d| [d, b",".to_vec()].concat(),
            Some(Some("")),
        ),
        ("a trailing NUL", |d| [d, vec![0]].concat(), Some(Some(""))),
        (
            "a byte order mark",
            |d| [b"\xef\xbb\xbf".to_vec(), d].concat(),
            Some(Some("")),
        ),
        (
            "trailing whitespace",
            |d| [d, b" \n\t\r ".to_vec()].concat(),
            None,
        ),
        (
            "leading whitespace",
            |d| [b" \n\t\r ".to_vec(), d].concat(),
            None,
        ),
        ("cut short", |d| d[..d.len() - 2].to_vec(), Some(Some(""))),
        ("nothing", |_| Vec::new(), Some(Some(""))),
        ("null", |_| b"null".to_vec(), Some(Some(""))),
        ("an empty object", |_| b"{}".to_vec(), Some(Some("schema"))),
        ("an empty array", |_| b"[]".to_vec(), Some(Some(""))),
        // serde would read the array as the struct, unless a value does not
        // fit its position (an optional member is absent): refused either way.
        ("the document's values as an array", as_array, Some(None)),
        (
            "a duplicate member",
            |d| with_text(d, |t| t.replacen('{', "{\"subject\": \"other\",", 1)),
            Some(Some("subject")),
        ),
        (
            "a member name spelled with escapes",
            |d| with_text(d, |t| t.replacen("\"schema\"", "\"sch\\u0065ma\"", 1)),
            None,
        ),
    ];
    let mut failures = Vec::new();
    for kind in Kind::ALL {
        for (describe, edit, refused) in edits {
            let outcome = kind.parse(&edit(kind.sample()));
            match (refused, &outcome) {
                (None, Ok(_)) | (Some(None), Err(_)) => {}
                (Some(Some(field)), Err(error)) if error.field == field => {}
                _ => failures.push(format!(
                    "{kind:?} {describe}: {}, expected {refused:?}",
                    show(&outcome)
                )),
            }
        }
        // Invalid UTF-8 inside a string names the member.
        let invalid = with_text(kind.sample(), |t| {
            t.replacen("\"tenant-7\"", "\"tenant-\u{1}\"", 1)
        });
        let invalid: Vec<u8> = invalid
            .into_iter()
            .map(|byte| if byte == 1 { 0xff } else { byte })
            .collect();
        if kind != Kind::OperationReceipt {
            match kind.parse(&invalid) {
                Err(error) if error.field == "subject" => {}
                outcome => failures.push(format!("{kind:?} invalid UTF-8: {}", show(&outcome))),
            }
        }
        // Size: padded with whitespace to the limit it parses; one byte more
        // and it is refused before parsing.
        let sample = kind.sample();
        let mut padded = sample.clone();
        padded.resize(DOCUMENT_SIZE_MAX, b' ');
        if let Err(error) = kind.parse(&padded) {
            failures.push(format!("{kind:?} of exactly the maximum size: {error}"));
        }
        padded.push(b' ');
        match kind.parse(&padded) {
            Err(error) if error.field.is_empty() => {}
            outcome => failures.push(format!("{kind:?} one byte too large: {}", show(&outcome))),
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// A parse outcome for a failure message: the canonical text if accepted.
fn show(outcome: &Result<Vec<u8>, ParseError>) -> String {
    match outcome {
        Ok(canonical) => format!("accepted as {}", String::from_utf8_lossy(canonical)),
        Err(error) => format!("refused: {error:?}"),
    }
}

fn with_text(document: Vec<u8>, edit: impl Fn(&str) -> String) -> Vec<u8> {
    edit(&String::from_utf8(document).expect("vector is UTF-8")).into_bytes()
}

/// `[v1, v2, …]` for `{"m1": v1, "m2": v2, …}` in the document's order,
/// which serde would read as the struct if the parser let it.
fn as_array(document: Vec<u8>) -> Vec<u8> {
    let value: serde_json::Value = serde_json::from_slice(&document).expect("vector is JSON");
    let text = String::from_utf8(document).expect("vector is UTF-8");
    let object = value.as_object().expect("vector is an object");
    let mut members: Vec<(usize, &serde_json::Value)> = object
        .iter()
        .map(|(name, member)| {
            let at = text.find(&format!("\"{name}\"")).expect("member in text");
            (at, member)
        })
        .collect();
    members.sort_by_key(|(at, _)| *at);
    let values: Vec<&serde_json::Value> = members.into_iter().map(|(_, member)| member).collect();
    serde_json::to_vec(&values).expect("JSON serializes")
}

/// `null` for an optional member that is absent is refused as such: the
/// member exists and must be omitted, which is not the refusal of a member
/// the document does not have.
#[test]
fn null_for_an_absent_optional_member_is_refused_as_null_not_as_unknown() {
    for member in ["actualUnits", "operationId"] {
        let document = on(RESERVATION).set(member, "null").document();
        let error = Kind::LimitReservation
            .parse(&document)
            .expect_err("null for an absent member");
        assert_eq!(error.field, member);
        assert!(error.message.contains("null"), "{member}: {error}");
        assert!(!error.message.contains("not a member"), "{member}: {error}");
    }
}

/// The `legs` of the multi-leg vector's own leg alone.
fn one_leg() -> String {
    r#"[{"reservation": "rl-01J2Z3Y4X5W6V7T8S9R0Q1P2N5", "subject": "tenant-7",
        "route": "gpt-4o.tokens", "reservedUnits": 1500, "requestedUnits": 4000,
        "minUnits": 500}]"#
        .to_owned()
}

/// The multi-leg vector's own leg and `count − 1` others of distinct pairs.
fn legs(count: usize) -> String {
    let own = one_leg();
    let mut legs = vec![own[1..own.len() - 1].to_owned()];
    for index in 1..count {
        legs.push(format!(
            r#"{{"reservation": "rl-leg-{index}", "subject": "tenant-7",
                "route": "gpt-4o.dimension-{index}", "reservedUnits": 1}}"#
        ));
    }
    format!("[{}]", legs.join(", "))
}
