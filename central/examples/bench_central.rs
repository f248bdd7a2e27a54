//! Prints durable reservations per second on redb and (with `--postgres
//! URL`) PostgreSQL, at 1 and 128 in flight. Build it optimized:
//!
//! ```sh
//! cargo run --release -p central --example bench_central -- [--postgres URL] [--reservations N]
//! ```

use central::bench::{BenchConfig, BenchStore, durable_reservations};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut postgres = None;
    let mut reservations = 5_000;
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--postgres" => postgres = args.next(),
            "--reservations" => {
                reservations = args
                    .next()
                    .ok_or("--reservations needs a number")?
                    .parse()?;
            }
            other => return Err(format!("unknown argument {other}").into()),
        }
    }
    let mut stores = vec![BenchStore::Redb];
    stores.extend(postgres.map(BenchStore::Postgres));
    for store in stores {
        for in_flight in [1, 128] {
            // One in flight is latency-bound: fewer reservations suffice.
            let count = if in_flight == 1 {
                reservations / 10
            } else {
                reservations
            };
            let report =
                durable_reservations(BenchConfig::new(store.clone(), in_flight, count)).await?;
            println!("{report}");
        }
    }
    Ok(())
}
