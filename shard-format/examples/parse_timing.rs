//! How long `shard_format::parse` takes over a reservation receipt, against
//! a baseline measured in the same run: the same strictness done the plain
//! way (typed with the member path tracked, then the input parsed again as
//! a `serde_json::Value` and compared with the document's own). And how long
//! `canonical_bytes` takes to write it, against serde_json's own writing
//! of it (`to_vec`). Ratios, not absolute times, are what to compare between
//! machines (docs/benchmarks-history.md).
//!
//!     cargo run --release -p shard-format --example parse_timing

use std::hint::black_box;
use std::time::Instant;

use shard_format::{Document as _, LimitReservationV1};

const PARSES: u32 = 200_000;
const ROUNDS: usize = 3;

/// The baseline: every check `parse` makes, each the plain way.
fn plain_parse(bytes: &[u8]) -> LimitReservationV1 {
    let deserializer = &mut serde_json::Deserializer::from_slice(bytes);
    let document: LimitReservationV1 =
        serde_path_to_error::deserialize(&mut *deserializer).expect("the vector parses");
    deserializer.end().expect("nothing follows");
    document.validate().expect("the vector is valid");
    let input: serde_json::Value = serde_json::from_slice(bytes).expect("JSON");
    let written = serde_json::to_value(&document).expect("serializes");
    assert!(input == written, "written as the document writes it");
    document
}

/// Nanoseconds per call of `parse_once`, over `PARSES` calls.
fn nanos_per_parse(parse_once: impl Fn()) -> f64 {
    let started = Instant::now();
    for _ in 0..PARSES {
        parse_once();
    }
    started.elapsed().as_nanos() as f64 / f64::from(PARSES)
}

fn main() {
    let pretty: &[u8] = include_bytes!("../tests/vectors/limitReservation.v1.input.json");
    let document: LimitReservationV1 = shard_format::parse(pretty).expect("the vector parses");
    let canonical = shard_format::canonical_bytes(&document);
    let compact = serde_json::to_vec(&document).expect("serializes");
    for round in 1..=ROUNDS {
        let written = nanos_per_parse(|| {
            black_box(shard_format::canonical_bytes(black_box(&document)));
        });
        let serde_json = nanos_per_parse(|| {
            black_box(serde_json::to_vec(black_box(&document))).expect("serializes");
        });
        println!(
            "round {round}: canonical_bytes {written:.0} ns, serde_json::to_vec {serde_json:.0} ns, ratio {:.2}",
            written / serde_json
        );
        for (form, bytes) in [
            ("canonical", canonical.as_slice()),
            ("serde_json", compact.as_slice()),
            ("pretty", pretty),
        ] {
            let plain = nanos_per_parse(|| {
                black_box(plain_parse(black_box(bytes)));
            });
            let parsed = nanos_per_parse(|| {
                black_box(shard_format::parse::<LimitReservationV1>(black_box(bytes)))
                    .expect("the vector parses");
            });
            println!(
                "round {round}: {form} bytes ({} bytes): parse {parsed:.0} ns, plain {plain:.0} ns, ratio {:.2}",
                bytes.len(),
                parsed / plain
            );
        }
    }
}
