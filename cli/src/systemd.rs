//! The daemons under systemd, all of its protocol in one place:
//!
//! - notifications (`Type=notify`, sd_notify(3) through the `sd-notify`
//!   crate): `READY=1` and `STATUS=` once a daemon serves, `WATCHDOG=1`
//!   while it still answers, `STOPPING=1` on the way out;
//! - socket activation (sd_listen_fds(3) through the `listenfd` crate): the
//!   listening Unix socket systemd passed, [`activated_unix_listener`].
//!
//! Outside systemd (no `NOTIFY_SOCKET`, no `WATCHDOG_USEC`, no
//! `LISTEN_FDS`) every function here does nothing. A notification that
//! cannot be sent is logged, never fatal: the service manager then judges
//! the daemon by its own timeouts.
//!
//! The agent (`agent_command.rs`) and the central service
//! (`central_command.rs`) both use this module; the libraries they wrap
//! (`agent`, `central`) know nothing of systemd: they serve whatever
//! listener the command hands them.

use std::future::Future;
use std::io;
use std::time::Duration;

use sd_notify::NotifyState;
use tokio::net::UnixListener;

fn send(states: &[NotifyState<'_>]) {
    if let Err(error) = sd_notify::notify(states) {
        tracing::warn!(%error, "cannot notify the service manager");
    }
}

/// `READY=1` with a one-line `STATUS=`.
pub fn ready(status: &str) {
    send(&[NotifyState::Ready, NotifyState::Status(status)]);
}

/// A new one-line `STATUS=`.
pub fn status(status: &str) {
    send(&[NotifyState::Status(status)]);
}

/// `STOPPING=1` with a one-line `STATUS=`: the daemon drains and exits.
pub fn stopping(status: &str) {
    send(&[NotifyState::Stopping, NotifyState::Status(status)]);
}

/// The watchdog interval systemd asks for (`WATCHDOG_USEC`, for this
/// process), if any.
pub fn watchdog_interval() -> Option<Duration> {
    sd_notify::watchdog_enabled().filter(|interval| !interval.is_zero())
}

/// Pings `WATCHDOG=1` every half watchdog interval, each time only after
/// `probe` (a real round trip through the daemon's core) answered within
/// that half interval: a wedged core stops the pings and systemd restarts
/// the process. Returns at once when no watchdog is configured; otherwise
/// runs until dropped.
pub async fn watchdog<F, P>(probe: F)
where
    F: FnMut() -> P,
    P: Future<Output = Result<(), String>>,
{
    let Some(interval) = watchdog_interval() else {
        return;
    };
    tracing::info!(
        interval_ms = u64::try_from(interval.as_millis()).unwrap_or(u64::MAX),
        "systemd watchdog enabled; pinging at half the interval"
    );
    probe_and_ping(interval / 2, probe, || send(&[NotifyState::Watchdog])).await;
}

/// The listening Unix socket systemd passed (socket activation:
/// `LISTEN_FDS` and, when set, a `LISTEN_PID` naming this process), if
/// any. An fd that is not a listening Unix stream socket is an error, not a
/// silent bind; of several sockets the first is served.
pub fn activated_unix_listener() -> io::Result<Option<UnixListener>> {
    let mut passed = listenfd::ListenFd::from_env();
    if passed.len() == 0 {
        return Ok(None);
    }
    if passed.len() > 1 {
        tracing::warn!(
            count = passed.len(),
            "systemd passed several sockets; serving on the first"
        );
    }
    let Some(listener) = passed.take_unix_listener(0)? else {
        return Ok(None);
    };
    listener.set_nonblocking(true)?;
    UnixListener::from_std(listener).map(Some)
}

/// Every `period`: `probe`, and `ping` if it answered within `period`.
async fn probe_and_ping<F, P>(period: Duration, mut probe: F, mut ping: impl FnMut())
where
    F: FnMut() -> P,
    P: Future<Output = Result<(), String>>,
{
    let mut ticks = tokio::time::interval(period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        match tokio::time::timeout(period, probe()).await {
            Ok(Ok(())) => ping(),
            Ok(Err(error)) => {
                tracing::error!(%error, "the daemon did not answer; withholding the watchdog ping");
            }
            Err(_) => tracing::error!(
                waited_ms = u64::try_from(period.as_millis()).unwrap_or(u64::MAX),
                "the daemon did not answer in time; withholding the watchdog ping"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;

    use super::*;

    /// Pings counted while `probe_and_ping` runs for `run`, 20 ms apart.
    fn pings_during<P>(run: Duration, probe: impl FnMut() -> P) -> u32
    where
        P: Future<Output = Result<(), String>>,
    {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .expect("runtime");
        let pings = Cell::new(0);
        runtime.block_on(async {
            let pinging = probe_and_ping(Duration::from_millis(20), probe, || {
                pings.set(pings.get() + 1);
            });
            let _ = tokio::time::timeout(run, pinging).await;
        });
        pings.get()
    }

    #[test]
    fn a_core_that_answers_is_pinged_for() {
        let pings = pings_during(Duration::from_millis(200), || async { Ok(()) });
        assert!(pings >= 3, "{pings} pings");
    }

    #[test]
    fn a_wedged_or_stopped_core_stops_the_pings() {
        let wedged = pings_during(Duration::from_millis(200), std::future::pending);
        assert_eq!(wedged, 0);
        let stopped = pings_during(Duration::from_millis(200), || async {
            Err("the agent is stopping or stopped".to_owned())
        });
        assert_eq!(stopped, 0);
    }
}
