//! The benchmark entry point works (tiny runs; nothing here is timed).

mod common;

use central::bench::{BenchConfig, BenchStore, durable_reservations};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_benchmark_runs_on_both_stores() {
    let mut stores = vec![BenchStore::Redb];
    let database = match common::postgres_url() {
        Some(url) => Some(common::ThrowawayDatabase::create(&url).await),
        None => None,
    };
    stores.extend(
        database
            .as_ref()
            .map(|db| BenchStore::Postgres(db.url.clone())),
    );
    for store in stores {
        let report = durable_reservations(BenchConfig::new(store, 4, 40))
            .await
            .expect("the benchmark runs");
        assert_eq!(report.reservations, 40);
        assert!(report.reservations_per_second > 0.0);
        assert!(report.mean_commit_batch >= 1.0, "{report}");
    }
    if let Some(database) = database {
        database.drop_database().await;
    }
}
