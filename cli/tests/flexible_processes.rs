//! Flexible reservations over the agent's socket, with the agent and the
//! central service as real processes: a reserve that gives `minUnits` is
//! granted what the center's account covers down to it (`reservedUnits`),
//! a floor the account cannot cover holds nothing, a bad floor is a 400
//! naming `minUnits`, and settling above the grant is overage.

use reservoir::cluster::{AgentClient, Cluster, ClusterOptions, policy};
use serde_json::{Value, json};
use shard_format::Refill;

const BINARY: &str = env!("CARGO_BIN_EXE_reservoir");
const SUBJECT: &str = "tenant-7";
const ROUTE: &str = "chat.generate";

/// The center's (available, reserved, spent, debt) for the pair.
async fn center(cluster: &Cluster) -> (u64, u64, u64, u64) {
    let accounts = cluster
        .central()
        .accounts(SUBJECT, ROUTE)
        .await
        .expect("accounts");
    let terms = &accounts.accounts.last().expect("an account").terms;
    (terms.available, terms.reserved, terms.spent, accounts.debt)
}

async fn reserve(client: &AgentClient, body: Value) -> (u16, Value) {
    let answer = client
        .send("POST", "/v1/reservations", Some(&body))
        .await
        .expect("the agent answers");
    (answer.status, answer.body)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flexible_grants_over_the_socket() {
    let mut cluster = Cluster::start(ClusterOptions::new(BINARY, 1))
        .await
        .expect("the cluster starts");
    // 1000 units, no refill, holds that outlive the test.
    let mut flexible_policy = policy(SUBJECT, ROUTE, 1);
    flexible_policy.opening = 1000;
    flexible_policy.burst = 1000;
    flexible_policy.reservation_units_max = 1000;
    flexible_policy.refill = Refill {
        units: 0,
        interval_ms: 1000,
    };
    flexible_policy.hold_ttl_ms = 3_600_000;
    cluster
        .central()
        .publish(&flexible_policy)
        .await
        .expect("publish");
    let client = cluster.agent(0).client();
    let ask = |key: &str, min_units: Option<u64>, units: u64| {
        let mut body =
            json!({"idempotencyKey": key, "subject": SUBJECT, "route": ROUTE, "units": units});
        if let Some(min_units) = min_units {
            body["minUnits"] = json!(min_units);
        }
        body
    };

    let (status, big) = reserve(&client, ask("big", None, 700)).await;
    assert_eq!(status, 201, "{big}");
    assert_eq!(big["reservedUnits"], 700, "an exact grant is the units");

    // 300 left: a flexible ask of 500 down to 100 is granted all 300.
    let (status, flexible) = reserve(&client, ask("flex", Some(100), 500)).await;
    assert_eq!(status, 201, "{flexible}");
    assert_eq!(
        (
            &flexible["units"],
            &flexible["minUnits"],
            &flexible["reservedUnits"]
        ),
        (&json!(500), &json!(100), &json!(300))
    );
    assert_eq!(flexible["receipt"]["reservedUnits"], 300);
    assert_eq!(flexible["receipt"]["requestedUnits"], 500);
    assert_eq!(center(&cluster).await, (0, 1000, 0, 0));

    // The retry gets the same grant; another floor is a conflict.
    let (status, again) = reserve(&client, ask("flex", Some(100), 500)).await;
    assert_eq!((status, &again["reservedUnits"]), (200, &json!(300)));
    let (status, conflict) = reserve(&client, ask("flex", Some(99), 500)).await;
    assert_eq!(
        (status, &conflict["error"]),
        (409, &json!("idempotency_conflict"))
    );

    // Nothing left: even a floor of 1 is refused, and nothing is held.
    let (status, refused) = reserve(&client, ask("one", Some(1), 50)).await;
    assert_eq!(status, 429, "{refused}");
    assert_eq!(center(&cluster).await, (0, 1000, 0, 0));

    // A floor of 0 or above the units is a 400 naming the field.
    for (key, min_units) in [("zero", 0), ("above", 51)] {
        let (status, invalid) = reserve(&client, ask(key, Some(min_units), 50)).await;
        assert_eq!(status, 400, "{invalid}");
        assert_eq!(
            (&invalid["error"], &invalid["field"]),
            (&json!("invalid_units"), &json!("minUnits"))
        );
    }
    assert_eq!(center(&cluster).await, (0, 1000, 0, 0));

    // Settling 350 on the grant of 300: 50 of overage, now debt.
    let id = flexible["reservation"].as_str().expect("an ID");
    assert_eq!(client.start(id, "op-1").await.expect("start").status, 200);
    let settled = client.settle(id, "op-1", 350).await.expect("settle");
    assert_eq!(settled.status, 200, "{}", settled.body);
    assert_eq!(settled.body["state"], "SETTLED_WITH_DEBT");
    assert_eq!(center(&cluster).await, (0, 700, 350, 50));
    let audit = cluster.central().audit().await.expect("audit");
    assert!(audit.ok, "{:?}", audit.violations);
    cluster.stop().await.expect("stop");
}
