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

/// The example set's dimensions for `tenant-7` and `gpt-4o`, with nothing
/// refilled and holds that outlive the test: requests (1000), tokens
/// (5100) and a concurrency limit of 50, the scarcest.
async fn publish_legs_policies(cluster: &Cluster) {
    for (route, opening, units_max) in [
        ("gpt-4o.requests", 1000, 1000),
        ("gpt-4o.tokens", 5100, 1000),
        ("gpt-4o.concurrency", 50, 1),
    ] {
        let mut leg_policy = policy(SUBJECT, route, 1);
        leg_policy.opening = opening;
        leg_policy.burst = opening;
        leg_policy.reservation_units_max = units_max;
        leg_policy.overdraft_units_max = 0;
        leg_policy.emergency_shard_units = 1;
        leg_policy.refill = Refill {
            units: 0,
            interval_ms: 1000,
        };
        leg_policy.hold_ttl_ms = 3_600_000;
        cluster
            .central()
            .publish(&leg_policy)
            .await
            .expect("publish");
    }
}

/// The center's (available, reserved, spent) of each dimension.
async fn legs_center(cluster: &Cluster) -> Vec<(u64, u64, u64)> {
    let mut all = Vec::new();
    for route in ["gpt-4o.requests", "gpt-4o.tokens", "gpt-4o.concurrency"] {
        let accounts = cluster
            .central()
            .accounts(SUBJECT, route)
            .await
            .expect("accounts");
        let terms = &accounts.accounts.last().expect("an account").terms;
        all.push((terms.available, terms.reserved, terms.spent));
    }
    all
}

/// One LLM request: 1 request, `tokens` tokens (down to `min_tokens` when
/// given), 1 in flight.
fn llm_request(key: &str, tokens: u64, min_tokens: Option<u64>) -> Value {
    let mut tokens_leg = json!({"subject": SUBJECT, "route": "gpt-4o.tokens", "units": tokens});
    if let Some(min_tokens) = min_tokens {
        tokens_leg["minUnits"] = json!(min_tokens);
    }
    json!({
        "idempotencyKey": key,
        "legs": [
            {"subject": SUBJECT, "route": "gpt-4o.requests", "units": 1},
            tokens_leg,
            {"subject": SUBJECT, "route": "gpt-4o.concurrency", "units": 1},
        ],
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_leg_reservations_are_all_or_nothing_over_the_socket() {
    let mut cluster = Cluster::start(ClusterOptions::new(BINARY, 1))
        .await
        .expect("the cluster starts");
    publish_legs_policies(&cluster).await;
    let client = cluster.agent(0).client();

    // 200 at once, each 1 request, 100 tokens and 1 in flight: exactly the
    // 50 the concurrency limit allows are admitted, every leg of each.
    let mut burst = tokio::task::JoinSet::new();
    for index in 0..200 {
        let client = client.clone();
        burst.spawn(async move {
            reserve(&client, llm_request(&format!("burst-{index}"), 100, None)).await
        });
    }
    let answers = burst.join_all().await;
    let admitted: Vec<&Value> = answers
        .iter()
        .filter(|(status, _)| *status == 201)
        .map(|(_, body)| body)
        .collect();
    assert_eq!(admitted.len(), 50, "the scarcest leg's count is admitted");
    for (status, body) in &answers {
        match status {
            201 => {
                let grants: Vec<&Value> = body["legs"]
                    .as_array()
                    .expect("every leg in the answer")
                    .iter()
                    .map(|leg| &leg["reservedUnits"])
                    .collect();
                assert_eq!(grants, [&json!(1), &json!(100), &json!(1)], "{body}");
            }
            429 => {
                assert_eq!(body["route"], "gpt-4o.concurrency", "{body}");
                assert_eq!(
                    (&body["leg"], &body["dimension"]),
                    (&json!(2), &json!("capacity"))
                );
            }
            other => panic!("unexpected {other}: {body}"),
        }
    }
    assert_eq!(
        legs_center(&cluster).await,
        [(950, 50, 0), (100, 5000, 0), (0, 50, 0)],
        "every account's reserved term is the sum of its admitted legs"
    );

    // A refused leg leaves every other account unchanged.
    let (status, refused) = reserve(&client, llm_request("one-more", 10, None)).await;
    assert_eq!(status, 429, "{refused}");
    assert_eq!(
        legs_center(&cluster).await,
        [(950, 50, 0), (100, 5000, 0), (0, 50, 0)]
    );

    // Settle per leg: 60 tokens used, the slot freed with 0, the request
    // leg left out settles at its 1.
    let id = admitted[0]["reservation"].as_str().expect("an ID");
    assert_eq!(client.start(id, "op-1").await.expect("start").status, 200);
    let settle = json!({
        "operationId": "op-1",
        "legs": [
            {"subject": SUBJECT, "route": "gpt-4o.tokens", "actualUnits": 60},
            {"subject": SUBJECT, "route": "gpt-4o.concurrency", "actualUnits": 0},
        ],
    });
    let settled = client
        .send(
            "POST",
            &format!("/v1/reservations/{id}/settle"),
            Some(&settle),
        )
        .await
        .expect("settle");
    assert_eq!(settled.status, 200, "{}", settled.body);
    assert_eq!(settled.body["state"], "SETTLED");
    let actuals: Vec<&Value> = settled.body["legs"]
        .as_array()
        .expect("legs")
        .iter()
        .map(|leg| &leg["actualUnits"])
        .collect();
    assert_eq!(actuals, [&json!(1), &json!(60), &json!(0)]);
    assert_eq!(
        legs_center(&cluster).await,
        [(950, 49, 1), (140, 4900, 60), (1, 49, 0)],
        "each leg settled against its own account"
    );
    // The one-number form does not fit three legs.
    let other = admitted[1]["reservation"].as_str().expect("an ID");
    assert_eq!(
        client.start(other, "op-2").await.expect("start").status,
        200
    );
    let form = client.settle(other, "op-2", 5).await.expect("settle");
    assert_eq!(
        (form.status, &form.body["error"], &form.body["field"]),
        (400, &json!("invalid_legs"), &json!("actualUnits"))
    );

    // Flexible tokens: 1000 asked down to 10, the 140 left are granted.
    let (status, flexible) = reserve(&client, llm_request("flexible", 1000, Some(10))).await;
    assert_eq!(status, 201, "{flexible}");
    assert_eq!(flexible["legs"][1]["reservedUnits"], 140, "{flexible}");
    assert_eq!(
        legs_center(&cluster).await,
        [(949, 50, 1), (0, 5040, 60), (0, 50, 0)]
    );

    // Bad legs: 400 naming the field, nothing held.
    let mut repeated = llm_request("repeated", 10, None);
    repeated["legs"][2]["route"] = json!("gpt-4o.tokens");
    let mut unknown = llm_request("unknown", 10, None);
    unknown["legs"][2]["route"] = json!("gpt-4o.unpublished");
    let mut floor_above = llm_request("floor", 10, Some(11));
    floor_above["legs"][1]["minUnits"] = json!(11);
    let nine: Vec<Value> = (0..9)
        .map(|index| json!({"subject": SUBJECT, "route": format!("gpt-4o.d{index}"), "units": 1}))
        .collect();
    for (body, code, field) in [
        (
            json!({"idempotencyKey": "nine", "legs": nine}),
            "invalid_legs",
            "legs",
        ),
        (repeated, "invalid_legs", "legs[2].route"),
        (floor_above, "invalid_units", "legs[1].minUnits"),
        (unknown, "no_policy", "legs[2].route"),
    ] {
        let (status, invalid) = reserve(&client, body).await;
        assert_eq!(
            (status, &invalid["error"], &invalid["field"]),
            (400, &json!(code), &json!(field)),
            "{invalid}"
        );
    }
    assert_eq!(
        legs_center(&cluster).await,
        [(949, 50, 1), (0, 5040, 60), (0, 50, 0)]
    );
    let audit = cluster.central().audit().await.expect("audit");
    assert!(audit.ok, "{:?}", audit.violations);
    cluster.stop().await.expect("stop");
}
