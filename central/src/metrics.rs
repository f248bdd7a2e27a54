//! Prometheus metrics, rendered by hand in the text exposition format.
//!
//! Counters and histograms live here; the gauges (debt outstanding, frozen
//! routes, shard units out, units reserved) are computed from the store on
//! each scrape. No metric carries a subject or route label: nothing about one
//! tenant is exposed to a scraper.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use ledger::ForgetOutcome;
use ledger::protocol::Gauges;

/// A fixed-bucket histogram.
#[derive(Debug)]
struct Histogram {
    bounds: &'static [f64],
    /// One count per bound, plus `+Inf`.
    counts: Vec<AtomicU64>,
    sum: Mutex<f64>,
    count: AtomicU64,
}

impl Histogram {
    fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum: Mutex::new(0.0),
            count: AtomicU64::new(0),
        }
    }

    fn observe(&self, value: f64) {
        let bucket = self
            .bounds
            .iter()
            .position(|bound| value <= *bound)
            .unwrap_or(self.bounds.len());
        self.counts[bucket].fetch_add(1, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
        *self.sum.lock().unwrap_or_else(|poison| poison.into_inner()) += value;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        self.render_series(out, name, "");
    }

    /// The histogram's lines without their header; `labels` (`key="value"`
    /// pairs, or empty) go before `le`.
    fn render_series(&self, out: &mut String, name: &str, labels: &str) {
        let mut cumulative = 0;
        let (with_le, alone) = if labels.is_empty() {
            (String::new(), String::new())
        } else {
            (format!("{labels},"), format!("{{{labels}}}"))
        };
        for (index, count) in self.counts.iter().enumerate() {
            cumulative += count.load(Ordering::Relaxed);
            let bound = self
                .bounds
                .get(index)
                .map_or_else(|| "+Inf".to_owned(), |bound| bound.to_string());
            let _ = writeln!(out, "{name}_bucket{{{with_le}le=\"{bound}\"}} {cumulative}");
        }
        let sum = *self.sum.lock().unwrap_or_else(|poison| poison.into_inner());
        let _ = writeln!(out, "{name}_sum{alone} {sum}");
        let _ = writeln!(
            out,
            "{name}_count{alone} {}",
            self.count.load(Ordering::Relaxed)
        );
    }
}

/// The steps of a batch before its commit, each timed
/// (`reservoir_batch_step_seconds`): where a batch's time goes besides the
/// commit (`reservoir_commit_seconds`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchStep {
    /// Completing the scope: the pairs only the store knows.
    Scope,
    /// Opening the batch: locks and loads (PostgreSQL), nothing much
    /// (redb, whose ledger is resident).
    Begin,
    /// Applying the operations to the batch's ledger.
    Apply,
}

impl BatchStep {
    const ALL: [Self; 3] = [Self::Scope, Self::Begin, Self::Apply];

    fn label(self) -> &'static str {
        match self {
            Self::Scope => "scope",
            Self::Begin => "begin",
            Self::Apply => "apply",
        }
    }
}

const BATCH_BOUNDS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0];
const SECONDS_BOUNDS: &[f64] = &[
    0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0,
];

/// The service's counters and histograms.
#[derive(Debug)]
pub struct Metrics {
    /// `(outcome, dimension)` → count.
    reservations: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
    /// outcome → count.
    settlements: Mutex<BTreeMap<&'static str, u64>>,
    refunded_units: AtomicU64,
    refunds: AtomicU64,
    commit_batch_size: Histogram,
    commit_seconds: Histogram,
    /// One histogram per [`BatchStep`], in [`BatchStep::ALL`]'s order.
    batch_step_seconds: [Histogram; 3],
    commit_failures: AtomicU64,
    /// Retention sweeps run, and what they forgot.
    sweeps: AtomicU64,
    forgotten: Mutex<ForgetOutcome>,
    last_sweep_forgotten: AtomicU64,
    /// Unix seconds of the last sweep (0: none yet).
    last_sweep_unix_seconds: AtomicU64,
    /// Routes a settle froze because its overdraft breached the policy.
    breach_freezes: AtomicU64,
    /// Shards the lost-shard sweep marked lost (this process).
    shards_lost: AtomicU64,
    shard_units_lost: AtomicU64,
}

impl Default for Metrics {
    fn default() -> Self {
        Self {
            reservations: Mutex::default(),
            settlements: Mutex::default(),
            refunded_units: AtomicU64::new(0),
            refunds: AtomicU64::new(0),
            commit_batch_size: Histogram::new(BATCH_BOUNDS),
            commit_seconds: Histogram::new(SECONDS_BOUNDS),
            batch_step_seconds: BatchStep::ALL.map(|_| Histogram::new(SECONDS_BOUNDS)),
            commit_failures: AtomicU64::new(0),
            sweeps: AtomicU64::new(0),
            forgotten: Mutex::default(),
            last_sweep_forgotten: AtomicU64::new(0),
            last_sweep_unix_seconds: AtomicU64::new(0),
            breach_freezes: AtomicU64::new(0),
            shards_lost: AtomicU64::new(0),
            shard_units_lost: AtomicU64::new(0),
        }
    }
}

impl Metrics {
    /// One answered reservation: its outcome and, for a rejection, the
    /// dimension (`""` otherwise).
    pub fn count_reservation(&self, outcome: &'static str, dimension: &'static str) {
        *self
            .reservations
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .entry((outcome, dimension))
            .or_default() += 1;
    }

    /// One answered settle, and the units it refunded.
    pub fn count_settlement(&self, outcome: &'static str, refunded_units: u64) {
        *self
            .settlements
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .entry(outcome)
            .or_default() += 1;
        if refunded_units > 0 {
            self.refunds.fetch_add(1, Ordering::Relaxed);
            self.refunded_units
                .fetch_add(refunded_units, Ordering::Relaxed);
        }
    }

    /// One commit of `operations` operations that took `elapsed`.
    pub fn observe_commit(&self, operations: usize, elapsed: Duration, succeeded: bool) {
        self.commit_batch_size.observe(operations as f64);
        self.commit_seconds.observe(elapsed.as_secs_f64());
        if !succeeded {
            self.commit_failures.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// One batch's `step`, which took `elapsed`.
    pub fn observe_batch_step(&self, step: BatchStep, elapsed: Duration) {
        self.batch_step_seconds[step as usize].observe(elapsed.as_secs_f64());
    }

    /// One retention sweep that ended at `unix_seconds` and forgot
    /// `outcome`'s records.
    pub fn record_forgotten(&self, outcome: &ForgetOutcome, unix_seconds: u64) {
        let mut total = self
            .forgotten
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        total.reservations += outcome.reservations;
        total.tombstones += outcome.tombstones;
        total.shards += outcome.shards;
        total.accounts_folded += outcome.accounts_folded;
        let records =
            outcome.reservations + outcome.tombstones + outcome.shards + outcome.accounts_folded;
        self.sweeps.fetch_add(1, Ordering::Relaxed);
        self.last_sweep_forgotten
            .store(records as u64, Ordering::Relaxed);
        self.last_sweep_unix_seconds
            .store(unix_seconds, Ordering::Relaxed);
    }

    /// One route frozen by a breach, committed.
    pub fn count_breach_freeze(&self) {
        self.breach_freezes.fetch_add(1, Ordering::Relaxed);
    }

    /// Shards the lost-shard sweep just marked lost.
    pub fn record_lost(&self, lost: &[ledger::LostShard]) {
        self.shards_lost
            .fetch_add(lost.len() as u64, Ordering::Relaxed);
        let units = lost
            .iter()
            .fold(0u64, |sum, shard| sum.saturating_add(shard.units));
        self.shard_units_lost.fetch_add(units, Ordering::Relaxed);
    }

    /// The text exposition, with the gauges if they could be computed.
    pub fn render(&self, gauges: Option<Gauges>) -> String {
        let mut out = String::new();
        out.push_str(
            "# HELP reservoir_reservations_total Reservations answered, by outcome and rejection dimension.\n\
             # TYPE reservoir_reservations_total counter\n",
        );
        for ((outcome, dimension), count) in self
            .reservations
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .iter()
        {
            let _ = writeln!(
                out,
                "reservoir_reservations_total{{outcome=\"{outcome}\",dimension=\"{dimension}\"}} {count}"
            );
        }
        out.push_str(
            "# HELP reservoir_settlements_total Settles answered, by outcome.\n\
             # TYPE reservoir_settlements_total counter\n",
        );
        for (outcome, count) in self
            .settlements
            .lock()
            .unwrap_or_else(|poison| poison.into_inner())
            .iter()
        {
            let _ = writeln!(
                out,
                "reservoir_settlements_total{{outcome=\"{outcome}\"}} {count}"
            );
        }
        let counter = |out: &mut String, name: &str, help: &str, value: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {value}"
            );
        };
        counter(
            &mut out,
            "reservoir_settle_refunds_total",
            "Settlements that refunded unused units.",
            self.refunds.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "reservoir_settle_refunded_units_total",
            "Units refunded to available by settlements.",
            self.refunded_units.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "reservoir_commit_failures_total",
            "Store commits that failed (answered 503).",
            self.commit_failures.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "reservoir_retention_sweeps_total",
            "Retention sweeps run.",
            self.sweeps.load(Ordering::Relaxed),
        );
        out.push_str(
            "# HELP reservoir_forgotten_records_total Records forgotten after the retention window, by kind (accounts: folded into their pair's closed history).\n\
             # TYPE reservoir_forgotten_records_total counter\n",
        );
        let forgotten = *self
            .forgotten
            .lock()
            .unwrap_or_else(|poison| poison.into_inner());
        for (kind, count) in [
            ("reservation", forgotten.reservations),
            ("tombstone", forgotten.tombstones),
            ("shard", forgotten.shards),
            ("account", forgotten.accounts_folded),
        ] {
            let _ = writeln!(
                out,
                "reservoir_forgotten_records_total{{kind=\"{kind}\"}} {count}"
            );
        }
        let _ = writeln!(
            out,
            "# HELP reservoir_last_sweep_forgotten_records Records the last retention sweep forgot.\n\
             # TYPE reservoir_last_sweep_forgotten_records gauge\n\
             reservoir_last_sweep_forgotten_records {}",
            self.last_sweep_forgotten.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP reservoir_last_sweep_timestamp_seconds Unix time of the last retention sweep (0: none yet).\n\
             # TYPE reservoir_last_sweep_timestamp_seconds gauge\n\
             reservoir_last_sweep_timestamp_seconds {}",
            self.last_sweep_unix_seconds.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP reservoir_breach_freezes_total Routes frozen because a settlement's overdraft breached the policy (each also logged, event=breach_freeze).\n\
             # TYPE reservoir_breach_freezes_total counter\n\
             reservoir_breach_freezes_total {}",
            self.breach_freezes.load(Ordering::Relaxed)
        );
        let _ = writeln!(
            out,
            "# HELP reservoir_shards_lost_total Shards this process's sweep marked lost (unreconciled past notAfter plus the grace).\n\
             # TYPE reservoir_shards_lost_total counter\n\
             reservoir_shards_lost_total {}\n\
             # HELP reservoir_shard_units_lost_total Units of the shards this process's sweep marked lost.\n\
             # TYPE reservoir_shard_units_lost_total counter\n\
             reservoir_shard_units_lost_total {}",
            self.shards_lost.load(Ordering::Relaxed),
            self.shard_units_lost.load(Ordering::Relaxed)
        );
        self.commit_batch_size.render(
            &mut out,
            "reservoir_commit_batch_size",
            "Operations per durable commit (group commit).",
        );
        self.commit_seconds.render(
            &mut out,
            "reservoir_commit_seconds",
            "Time of one durable commit.",
        );
        let name = "reservoir_batch_step_seconds";
        let _ = writeln!(
            out,
            "# HELP {name} Time of one step of a batch before its commit: scope (the pairs only the store knows), begin (locks and loads), apply (the operations).\n# TYPE {name} histogram"
        );
        for (step, histogram) in BatchStep::ALL.iter().zip(&self.batch_step_seconds) {
            histogram.render_series(&mut out, name, &format!("step=\"{}\"", step.label()));
        }
        if let Some(gauges) = gauges {
            let gauge = |out: &mut String, name: &str, help: &str, value: u64| {
                let _ = writeln!(
                    out,
                    "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {value}"
                );
            };
            gauge(
                &mut out,
                "reservoir_debt_outstanding_units",
                "Debt (overdraftIssued - overdraftRepaid) over all accounts.",
                gauges.debt_outstanding,
            );
            gauge(
                &mut out,
                "reservoir_frozen_routes",
                "Subject/route pairs frozen by a breach.",
                gauges.frozen_routes,
            );
            gauge(
                &mut out,
                "reservoir_shard_units_out",
                "Units allocated to open emergency shards (neither reconciled nor lost).",
                gauges.shard_units_out,
            );
            gauge(
                &mut out,
                "reservoir_open_shards",
                "Emergency shards neither reconciled nor lost.",
                gauges.open_shards,
            );
            gauge(
                &mut out,
                "reservoir_lost_shards",
                "Emergency shards marked lost and never reconciled (stored or forgotten).",
                gauges.lost_shards,
            );
            gauge(
                &mut out,
                "reservoir_lost_shard_units",
                "Units of lost, never reconciled shards: retired for good unless a late receipt comes.",
                gauges.lost_shard_units,
            );
            gauge(
                &mut out,
                "reservoir_reserved_units",
                "Units held by open reservations over all accounts.",
                gauges.units_reserved,
            );
            out.push_str(
                "# HELP reservoir_reservation_records Reservation records stored, live (not terminal) or retained (terminal, kept for the retention window).\n\
                 # TYPE reservoir_reservation_records gauge\n",
            );
            let _ = writeln!(
                out,
                "reservoir_reservation_records{{state=\"live\"}} {}\nreservoir_reservation_records{{state=\"retained\"}} {}",
                gauges.reservations_live, gauges.reservations_retained
            );
            gauge(
                &mut out,
                "reservoir_tombstones",
                "Tombstones kept for the retention window.",
                gauges.tombstones,
            );
            gauge(
                &mut out,
                "reservoir_reconciled_shards",
                "Reconciled emergency shards kept for the retention window.",
                gauges.shards_reconciled,
            );
            gauge(
                &mut out,
                "reservoir_account_records",
                "Account records stored.",
                gauges.accounts,
            );
            gauge(
                &mut out,
                "reservoir_folded_accounts",
                "Accounts folded into their pair's closed history.",
                gauges.accounts_folded,
            );
            gauge(
                &mut out,
                "reservoir_forgotten_reservations",
                "Reservations forgotten after the retention window, as the stored accounts and pairs remember them.",
                gauges.reservations_forgotten,
            );
            gauge(
                &mut out,
                "reservoir_store_bytes",
                "Bytes the store takes on disk (redb file, or PostgreSQL's reservoir_records with indexes and TOAST; 0: unknown).",
                gauges.store_bytes,
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line<'a>(text: &'a str, name: &str) -> Option<&'a str> {
        text.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix(' '))
    }

    #[test]
    fn sweeps_add_up_and_the_last_one_is_shown() {
        let metrics = Metrics::default();
        let text = metrics.render(None);
        assert_eq!(line(&text, "reservoir_retention_sweeps_total"), Some("0"));
        assert_eq!(
            line(&text, "reservoir_last_sweep_timestamp_seconds"),
            Some("0")
        );
        metrics.record_forgotten(
            &ForgetOutcome {
                reservations: 3,
                tombstones: 1,
                shards: 1,
                accounts_folded: 2,
            },
            1_000,
        );
        metrics.record_forgotten(
            &ForgetOutcome {
                reservations: 4,
                ..ForgetOutcome::default()
            },
            1_060,
        );
        let text = metrics.render(None);
        assert_eq!(line(&text, "reservoir_retention_sweeps_total"), Some("2"));
        assert_eq!(
            line(
                &text,
                "reservoir_forgotten_records_total{kind=\"reservation\"}"
            ),
            Some("7")
        );
        assert_eq!(
            line(&text, "reservoir_forgotten_records_total{kind=\"account\"}"),
            Some("2")
        );
        assert_eq!(
            line(&text, "reservoir_last_sweep_forgotten_records"),
            Some("4")
        );
        assert_eq!(
            line(&text, "reservoir_last_sweep_timestamp_seconds"),
            Some("1060")
        );
    }

    #[test]
    fn retained_and_live_records_are_separate_gauges() {
        let text = Metrics::default().render(Some(Gauges {
            reservations_live: 5,
            reservations_retained: 9,
            store_bytes: 4096,
            ..Gauges::default()
        }));
        assert_eq!(
            line(&text, "reservoir_reservation_records{state=\"live\"}"),
            Some("5")
        );
        assert_eq!(
            line(&text, "reservoir_reservation_records{state=\"retained\"}"),
            Some("9")
        );
        assert_eq!(line(&text, "reservoir_store_bytes"), Some("4096"));
    }
}
