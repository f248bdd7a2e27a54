//! The peer users would pick instead: a Redis token bucket in Lua, called
//! with EVALSHA once per admission. The script is Spring Cloud Gateway's
//! `request_rate_limiter.lua` (the common one), unchanged but for names. It
//! has no reservations and no refunds: one request per admission.

use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::bail;

use super::load::{Endpoint, Kind, Lane, LoadResult, RespConnection, RespValue, Window, run_lanes};

/// The token bucket: `KEYS = {tokens, timestamp}`, `ARGV = {rate,
/// capacity, now (s), requested}`; returns `{allowed, tokens left}`.
pub const TOKEN_BUCKET: &str = r#"
local tokens_key = KEYS[1]
local timestamp_key = KEYS[2]
local rate = tonumber(ARGV[1])
local capacity = tonumber(ARGV[2])
local now = tonumber(ARGV[3])
local requested = tonumber(ARGV[4])
local fill_time = capacity/rate
local ttl = math.floor(fill_time*2)
local last_tokens = tonumber(redis.call("get", tokens_key))
if last_tokens == nil then
  last_tokens = capacity
end
local last_refreshed = tonumber(redis.call("get", timestamp_key))
if last_refreshed == nil then
  last_refreshed = 0
end
local delta = math.max(0, now-last_refreshed)
local filled_tokens = math.min(capacity, last_tokens+(delta*rate))
local allowed = filled_tokens >= requested
local new_tokens = filled_tokens
local allowed_num = 0
if allowed then
  new_tokens = filled_tokens - requested
  allowed_num = 1
end
if ttl > 0 then
  redis.call("setex", tokens_key, ttl, new_tokens)
  redis.call("setex", timestamp_key, ttl, now)
end
return { allowed_num, new_tokens }
"#;

/// Loads the script and returns its SHA1.
pub async fn load_script(endpoint: &Endpoint) -> anyhow::Result<String> {
    let mut connection = RespConnection::open(endpoint).await?;
    match connection
        .command(&[b"SCRIPT", b"LOAD", TOKEN_BUCKET.as_bytes()])
        .await?
    {
        RespValue::Bulk(Some(sha)) => Ok(String::from_utf8(sha)?),
        other => bail!("SCRIPT LOAD answered {other:?}"),
    }
}

/// Admissions through the bucket, `in_flight` connections each with one
/// EVALSHA outstanding, spread over `buckets` keys (never empty: the rate
/// and capacity are far above what a run asks).
pub async fn token_bucket(
    endpoint: &Endpoint,
    sha: &str,
    buckets: usize,
    in_flight: usize,
    window: Window,
) -> anyhow::Result<LoadResult> {
    let sha: Arc<str> = sha.into();
    run_lanes(in_flight, window, |index, lane| {
        lane_loop(
            endpoint.clone(),
            sha.clone(),
            buckets,
            in_flight,
            index,
            lane,
        )
    })
    .await
}

async fn lane_loop(
    endpoint: Endpoint,
    sha: Arc<str>,
    buckets: usize,
    in_flight: usize,
    index: usize,
    mut lane: Lane,
) -> anyhow::Result<Lane> {
    let mut connection = RespConnection::open(&endpoint).await?;
    let mut sequence = 0usize;
    while !lane.done() {
        sequence += 1;
        let bucket = (index + sequence * in_flight) % buckets;
        let tokens = format!("bench.{{{bucket}}}.tokens");
        let timestamp = format!("bench.{{{bucket}}}.timestamp");
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |elapsed| elapsed.as_secs())
            .to_string();
        let sent = Instant::now();
        let answer = connection
            .command(&[
                b"EVALSHA",
                sha.as_bytes(),
                b"2",
                tokens.as_bytes(),
                timestamp.as_bytes(),
                b"1000000",
                b"1000000000",
                now.as_bytes(),
                b"1",
            ])
            .await?;
        lane.record(Kind::Reserve, sent);
        match answer {
            RespValue::Array(items) if items.first() == Some(&RespValue::Integer(1)) => {
                lane.cycle_done();
            }
            RespValue::Error(message) => bail!("redis answered an error: {message}"),
            _ => lane.error(),
        }
    }
    Ok(lane)
}
