//! The deterministic simulator and the seed's release gate.
//!
//! One seed drives one PRNG ([`rng::Rng`]); each run draws its own fault
//! rates (swarm testing) and runs the real [`ledger::CentralLedger`] and the
//! real agent cores through faults (see `run.rs` for what each fake
//! injects). Every step is checked; a liveness phase follows. A failing run
//! prints its seed, and `reservoir sim --seed S --trace` replays it exactly.
//!
//! The gate passes when no run violated anything, every scenario of the
//! seed's fault list was hit, UNKNOWN resolved with p99 under ten minutes,
//! and the fairness error stays inside its budget.

mod admission;
mod queue;
mod rng;
mod run;

use std::fmt::Write as _;

/// The seed's ten fault families and retention; each run counts how often
/// it hit each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Scenario {
    ConcurrentReserve,
    StartedVsExpired,
    ActualAboveReserved,
    LostDebtAck,
    CentralPartition,
    TwoGatewaysOneShard,
    OldShardAfterRestart,
    DuplicateReclaim,
    LostRefundAck,
    GenerationCrossover,
    /// A record was forgotten after its retention window (central sweep or
    /// agent journal), with gateways replaying keys around the window.
    Retention,
    /// An enrolled identity with its own key tried to act on, read or squat
    /// another identity's reservations.
    HostileAgent,
    /// A gateway retried a reserve under the same key with a field changed,
    /// and was refused with a conflict.
    DifferingRetry,
}

pub const SCENARIOS: usize = 13;

impl Scenario {
    pub const ALL: [Scenario; SCENARIOS] = [
        Self::ConcurrentReserve,
        Self::StartedVsExpired,
        Self::ActualAboveReserved,
        Self::LostDebtAck,
        Self::CentralPartition,
        Self::TwoGatewaysOneShard,
        Self::OldShardAfterRestart,
        Self::DuplicateReclaim,
        Self::LostRefundAck,
        Self::GenerationCrossover,
        Self::Retention,
        Self::HostileAgent,
        Self::DifferingRetry,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::ConcurrentReserve => "concurrent_reserve",
            Self::StartedVsExpired => "started_vs_expired",
            Self::ActualAboveReserved => "actual_above_reserved",
            Self::LostDebtAck => "lost_debt_ack",
            Self::CentralPartition => "central_partition",
            Self::TwoGatewaysOneShard => "two_gateways_one_shard",
            Self::OldShardAfterRestart => "old_shard_after_restart",
            Self::DuplicateReclaim => "duplicate_reclaim",
            Self::LostRefundAck => "lost_refund_ack",
            Self::GenerationCrossover => "generation_crossover",
            Self::Retention => "retention",
            Self::HostileAgent => "hostile_agent",
            Self::DifferingRetry => "differing_retry",
        }
    }
}

/// A class of broken rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ViolationClass {
    CentralEquation,
    ShardEquation,
    OverIssuance,
    SecondReservation,
    DoubleShardConsumption,
    DoubleReclaim,
    MissedDebt,
    AdmissionWhileDebt,
    UnknownCountedUnused,
    ExpiredWhileStarted,
    /// A record was forgotten while live or inside its retention window.
    ForgottenLiveRecord,
    /// A retry with the same idempotency key reserved a second time within
    /// the retention window.
    RetryReservedTwiceWithinWindow,
    /// A hostile identity's action on another's reservation was accepted,
    /// or moved an account term.
    HostileActionAccepted,
    /// A central transition's reply or records differ from the reference
    /// model's prediction (the exact oracle).
    ReferenceMismatch,
    /// A retry under an idempotency key with a field changed was answered
    /// as the original request.
    DifferingRetryAccepted,
    /// An admitted reservation holds less than its floor, more than it
    /// asked for, or more than its account or shard had available.
    PartialAdmission,
    Liveness,
    Panic,
}

impl ViolationClass {
    pub const ALL: [ViolationClass; 18] = [
        Self::CentralEquation,
        Self::ShardEquation,
        Self::OverIssuance,
        Self::SecondReservation,
        Self::DoubleShardConsumption,
        Self::DoubleReclaim,
        Self::MissedDebt,
        Self::AdmissionWhileDebt,
        Self::UnknownCountedUnused,
        Self::ExpiredWhileStarted,
        Self::ForgottenLiveRecord,
        Self::RetryReservedTwiceWithinWindow,
        Self::HostileActionAccepted,
        Self::ReferenceMismatch,
        Self::DifferingRetryAccepted,
        Self::PartialAdmission,
        Self::Liveness,
        Self::Panic,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Self::CentralEquation => "central_equation",
            Self::ShardEquation => "shard_equation",
            Self::OverIssuance => "over_issuance",
            Self::SecondReservation => "second_reservation",
            Self::DoubleShardConsumption => "double_shard_consumption",
            Self::DoubleReclaim => "double_reclaim",
            Self::MissedDebt => "missed_debt",
            Self::AdmissionWhileDebt => "admission_while_debt",
            Self::UnknownCountedUnused => "unknown_counted_unused",
            Self::ExpiredWhileStarted => "expired_while_started",
            Self::ForgottenLiveRecord => "forgotten_live_record",
            Self::RetryReservedTwiceWithinWindow => "retry_reserved_twice_within_window",
            Self::HostileActionAccepted => "hostile_action_accepted",
            Self::ReferenceMismatch => "reference_mismatch",
            Self::DifferingRetryAccepted => "differing_retry_accepted",
            Self::PartialAdmission => "partial_admission",
            Self::Liveness => "liveness",
            Self::Panic => "panic",
        }
    }
}

/// Switches for a run: planted bugs and tracing.
#[derive(Debug, Clone, Copy, Default)]
pub struct SimOptions {
    #[cfg(feature = "canaries")]
    pub canaries: ledger::Canaries,
    #[cfg(feature = "canaries")]
    pub agent_canaries: agent_core::AgentCanaries,
    /// Keep a readable line per step.
    pub trace: bool,
}

/// What one run did.
#[derive(Debug, Clone)]
pub struct RunOutcome {
    pub seed: u64,
    pub steps: u64,
    pub violations: Vec<(ViolationClass, String)>,
    pub violations_dropped: u64,
    pub hits: [u64; SCENARIOS],
    pub unknown_durations_ms: Vec<u64>,
    /// (weight, contended grants) per subject per agent.
    pub fairness: Vec<(u32, u64)>,
    pub flexible: FlexibleCounts,
    pub legs: LegsCounts,
    pub trace_hash: u64,
    pub trace: Vec<String>,
}

/// What the flexible reservations of runs did: proof that grants below
/// the ask happen.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FlexibleCounts {
    /// Reserves a gateway sent with `minUnits`.
    pub reserves: u64,
    /// Flexible logical requests admitted (first admission each).
    pub admitted: u64,
    /// Of those, granted less than they asked for, by path.
    pub partial_central: u64,
    pub partial_shard: u64,
}

impl FlexibleCounts {
    fn add(&mut self, other: FlexibleCounts) {
        self.reserves += other.reserves;
        self.admitted += other.admitted;
        self.partial_central += other.partial_central;
        self.partial_shard += other.partial_shard;
    }

    pub fn partial(&self) -> u64 {
        self.partial_central + self.partial_shard
    }
}

/// What the multi-leg reservations of runs did: proof that they are
/// admitted on both paths, refused by one leg, and settled per leg.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LegsCounts {
    /// Reserves a gateway sent with several legs.
    pub reserves: u64,
    /// Multi-leg logical requests admitted (first admission each), by path.
    pub admitted_central: u64,
    pub admitted_shard: u64,
    /// Multi-leg reserves refused, naming the leg that refused.
    pub refused_by_leg: u64,
    /// Per-leg settles answered with a settlement.
    pub settled: u64,
}

impl LegsCounts {
    fn add(&mut self, other: LegsCounts) {
        self.reserves += other.reserves;
        self.admitted_central += other.admitted_central;
        self.admitted_shard += other.admitted_shard;
        self.refused_by_leg += other.refused_by_leg;
        self.settled += other.settled;
    }

    pub fn admitted(&self) -> u64 {
        self.admitted_central + self.admitted_shard
    }
}

impl RunOutcome {
    fn new(seed: u64) -> Self {
        Self {
            seed,
            steps: 0,
            violations: Vec::new(),
            violations_dropped: 0,
            hits: [0; SCENARIOS],
            unknown_durations_ms: Vec::new(),
            fairness: Vec::new(),
            flexible: FlexibleCounts::default(),
            legs: LegsCounts::default(),
            trace_hash: 0xCBF2_9CE4_8422_2325,
            trace: Vec::new(),
        }
    }
}

/// Runs one seed. A panic in the cores is caught and reported as a
/// violation of the run, with its seed, after what the run found before it.
pub fn run_one(seed: u64, options: SimOptions) -> RunOutcome {
    run_reusing(seed, options, &mut run::RunBuffers::default())
}

/// [`run_one`] with the buffers of the thread's previous run, handed on
/// to its next.
fn run_reusing(seed: u64, options: SimOptions, buffers: &mut run::RunBuffers) -> RunOutcome {
    use std::panic::{AssertUnwindSafe, catch_unwind};
    let panicked = |mut outcome: RunOutcome, panic: Box<dyn std::any::Any + Send>| {
        let message = panic
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_else(|| "panic".to_owned());
        outcome.violations.push((ViolationClass::Panic, message));
        outcome
    };
    let taken = std::mem::take(buffers);
    let mut run = match catch_unwind(AssertUnwindSafe(|| run::Run::new(seed, options, taken))) {
        Ok(run) => run,
        Err(panic) => return panicked(RunOutcome::new(seed), panic),
    };
    // A run cut short by a panic is not used again: only what it had
    // found so far is read (its buffers are cleared before reuse).
    let result = catch_unwind(AssertUnwindSafe(|| run.run()));
    let (outcome, reused) = run.into_outcome();
    *buffers = reused;
    match result {
        Ok(()) => outcome,
        Err(panic) => panicked(outcome, panic),
    }
}

/// The seeds `first..first + runs`, split across `threads`.
pub fn run_many(first: u64, runs: u64, threads: usize, options: SimOptions) -> GateReport {
    let threads = threads.clamp(1, 64) as u64;
    let reports: Vec<GateReport> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..threads)
            .map(|thread| {
                scope.spawn(move || {
                    let mut report = GateReport::default();
                    let mut buffers = run::RunBuffers::default();
                    let mut seed = first + thread;
                    while seed < first + runs {
                        report.add(run_reusing(seed, options, &mut buffers));
                        seed += threads;
                    }
                    report
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|handle| handle.join().expect("simulator thread"))
            .collect()
    });
    let mut total = GateReport::default();
    for report in reports {
        total.merge(report);
    }
    total
}

/// The gate's totals over many runs.
#[derive(Debug, Clone, Default)]
pub struct GateReport {
    pub runs: u64,
    pub steps: u64,
    pub violations: [u64; ViolationClass::ALL.len()],
    /// The first failing runs: seed, class, detail.
    pub failures: Vec<(u64, ViolationClass, String)>,
    pub hits: [u64; SCENARIOS],
    /// Histogram of UNKNOWN resolution times in whole seconds (capped).
    pub unknown_seconds: Vec<u64>,
    pub unknown_count: u64,
    pub unknown_max_ms: u64,
    /// Contended grants per weight.
    pub fairness: std::collections::BTreeMap<u32, u64>,
    pub flexible: FlexibleCounts,
    pub legs: LegsCounts,
}

const UNKNOWN_HISTOGRAM_SECONDS: usize = 3600;

impl GateReport {
    pub fn add(&mut self, outcome: RunOutcome) {
        self.runs += 1;
        self.steps += outcome.steps;
        for (class, detail) in &outcome.violations {
            self.violations[*class as usize] += 1;
            if self.failures.len() < 20 {
                self.failures.push((outcome.seed, *class, detail.clone()));
            }
        }
        for (total, hits) in self.hits.iter_mut().zip(outcome.hits) {
            *total += hits;
        }
        if self.unknown_seconds.is_empty() {
            self.unknown_seconds = vec![0; UNKNOWN_HISTOGRAM_SECONDS + 1];
        }
        for ms in outcome.unknown_durations_ms {
            let second = (ms / 1000).min(UNKNOWN_HISTOGRAM_SECONDS as u64) as usize;
            self.unknown_seconds[second] += 1;
            self.unknown_count += 1;
            self.unknown_max_ms = self.unknown_max_ms.max(ms);
        }
        for (weight, granted) in outcome.fairness {
            *self.fairness.entry(weight).or_default() += granted;
        }
        self.flexible.add(outcome.flexible);
        self.legs.add(outcome.legs);
    }

    fn merge(&mut self, other: GateReport) {
        self.runs += other.runs;
        self.steps += other.steps;
        for (total, count) in self.violations.iter_mut().zip(other.violations) {
            *total += count;
        }
        for failure in other.failures {
            if self.failures.len() < 20 {
                self.failures.push(failure);
            }
        }
        for (total, hits) in self.hits.iter_mut().zip(other.hits) {
            *total += hits;
        }
        if self.unknown_seconds.is_empty() {
            self.unknown_seconds = vec![0; UNKNOWN_HISTOGRAM_SECONDS + 1];
        }
        for (total, count) in self.unknown_seconds.iter_mut().zip(other.unknown_seconds) {
            *total += count;
        }
        self.unknown_count += other.unknown_count;
        self.unknown_max_ms = self.unknown_max_ms.max(other.unknown_max_ms);
        for (weight, granted) in other.fairness {
            *self.fairness.entry(weight).or_default() += granted;
        }
        self.flexible.add(other.flexible);
        self.legs.add(other.legs);
        self.failures.sort_by_key(|(seed, _, _)| *seed);
    }

    pub fn total_violations(&self) -> u64 {
        self.violations.iter().sum()
    }

    /// The `q` quantile (0–1) of UNKNOWN resolution time, in seconds
    /// (histogram bucket upper bound).
    pub fn unknown_quantile_seconds(&self, q: f64) -> u64 {
        if self.unknown_count == 0 {
            return 0;
        }
        // Ranks are small whole numbers: the float only rounds up.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        let target = ((self.unknown_count as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (second, count) in self.unknown_seconds.iter().enumerate() {
            seen += count;
            if seen >= target {
                return second as u64 + 1;
            }
        }
        UNKNOWN_HISTOGRAM_SECONDS as u64
    }

    /// Largest gap between a weight class's share of contended starts and
    /// its weight's share.
    pub fn fairness_error_max(&self) -> f64 {
        let granted: u64 = self.fairness.values().sum();
        if granted == 0 {
            return 0.0;
        }
        let weights: u64 = self.fairness.keys().map(|w| u64::from(*w)).sum();
        self.fairness
            .iter()
            .map(|(weight, count)| {
                let share = *count as f64 / granted as f64;
                let expected = f64::from(*weight) / weights as f64;
                (share - expected).abs()
            })
            .fold(0.0, f64::max)
    }

    /// The gate: no violation, every scenario hit `min_hits` times, UNKNOWN
    /// p99 under ten minutes, fairness error within `fairness_budget`.
    pub fn passes(&self, min_hits: u64, fairness_budget: f64) -> bool {
        self.total_violations() == 0
            && self.hits.iter().all(|hits| *hits >= min_hits)
            && self.unknown_quantile_seconds(0.99) < 600
            && self.fairness_error_max() <= fairness_budget
    }

    /// The human table and the machine-readable last line.
    pub fn render(&self, min_hits: u64, fairness_budget: f64, seconds: f64) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "runs      {}", self.runs);
        let _ = writeln!(out, "steps     {}", self.steps);
        if seconds > 0.0 {
            let _ = writeln!(
                out,
                "wall      {seconds:.1} s ({:.0} runs/s, {:.0} steps/s)",
                self.runs as f64 / seconds,
                self.steps as f64 / seconds
            );
        }
        let _ = writeln!(out, "\nviolations");
        for class in ViolationClass::ALL {
            let _ = writeln!(
                out,
                "  {:<26} {}",
                class.name(),
                self.violations[class as usize]
            );
        }
        let _ = writeln!(out, "\nscenario hits (gate: each ≥ {min_hits})");
        for scenario in Scenario::ALL {
            let _ = writeln!(
                out,
                "  {:<26} {}",
                scenario.name(),
                self.hits[scenario as usize]
            );
        }
        let _ = writeln!(
            out,
            "\nunknown resolutions {}: p50 {} s, p99 {} s, max {:.1} s",
            self.unknown_count,
            self.unknown_quantile_seconds(0.5),
            self.unknown_quantile_seconds(0.99),
            self.unknown_max_ms as f64 / 1000.0
        );
        let flexible = &self.flexible;
        let _ = writeln!(
            out,
            "flexible reserves {} sent, {} admitted, {} granted below the ask ({} central, {} shard)",
            flexible.reserves,
            flexible.admitted,
            flexible.partial(),
            flexible.partial_central,
            flexible.partial_shard
        );
        let legs = &self.legs;
        let _ = writeln!(
            out,
            "multi-leg reserves {} sent, {} admitted ({} central, {} shard), {} refused by a leg, {} settled per leg",
            legs.reserves,
            legs.admitted(),
            legs.admitted_central,
            legs.admitted_shard,
            legs.refused_by_leg,
            legs.settled
        );
        let _ = writeln!(out, "contended starts by weight: {:?}", self.fairness);
        let _ = writeln!(
            out,
            "fairness error max {:.4} (budget {fairness_budget})",
            self.fairness_error_max()
        );
        if !self.failures.is_empty() {
            let _ = writeln!(
                out,
                "\nfirst failures (replay: reservoir sim --seed SEED --trace)"
            );
            for (seed, class, detail) in &self.failures {
                let _ = writeln!(out, "  seed {seed}: {}: {detail}", class.name());
            }
        }
        let verdict = if self.passes(min_hits, fairness_budget) {
            "PASS"
        } else {
            "FAIL"
        };
        let _ = write!(
            out,
            "release-gate: runs={} violations={} unknown_p99_s={} fairness_error_max={:.4} flexible_grants_partial={} multi_leg_admitted={} verdict={verdict}",
            self.runs,
            self.total_violations(),
            self.unknown_quantile_seconds(0.99),
            self.fairness_error_max(),
            self.flexible.partial(),
            self.legs.admitted()
        );
        out
    }
}

/// A planted bug, by name.
#[cfg(feature = "canaries")]
pub fn canary(name: &str) -> Option<SimOptions> {
    let mut options = SimOptions::default();
    match name {
        "skip-idempotency-check" => options.canaries.skip_idempotency_check = true,
        "skip-owner-check" => options.canaries.skip_owner_check = true,
        "accept-shard-after-restart" => {
            options.agent_canaries.accept_shard_after_restart = true;
        }
        "refund-on-timeout" => options.canaries.refund_on_timeout = true,
        "skip-debt-on-lost-ack" => options.canaries.skip_debt_on_replayed_settle = true,
        "expire-started" => options.canaries.expire_started = true,
        "admit-below-floor" => options.canaries.admit_below_floor = true,
        "shard-admit-below-floor" => {
            options.agent_canaries.admit_below_floor_from_shards = true;
        }
        "admit-legs-before-refusal" => options.canaries.admit_legs_before_refusal = true,
        "shard-admit-legs-without-shards" => {
            options.agent_canaries.admit_legs_without_shards = true;
        }
        _ => return None,
    }
    Some(options)
}

/// Every canary's name.
pub const CANARIES: [&str; 10] = [
    "skip-idempotency-check",
    "skip-owner-check",
    "accept-shard-after-restart",
    "refund-on-timeout",
    "skip-debt-on-lost-ack",
    "expire-started",
    "admit-below-floor",
    "shard-admit-below-floor",
    "admit-legs-before-refusal",
    "shard-admit-legs-without-shards",
];

/// The first seed in `first..first + runs` whose run reports a violation,
/// searched in batches across `threads`.
pub fn first_failing_seed(
    first: u64,
    runs: u64,
    threads: usize,
    options: SimOptions,
) -> Option<(u64, RunOutcome)> {
    let threads = threads.clamp(1, 64) as u64;
    let batch = 64 * threads;
    let mut start = first;
    while start < first + runs {
        let end = (start + batch).min(first + runs);
        let found = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads)
                .map(|thread| {
                    scope.spawn(move || {
                        let mut buffers = run::RunBuffers::default();
                        (start + thread..end)
                            .step_by(threads as usize)
                            .map(|seed| (seed, run_reusing(seed, options, &mut buffers)))
                            .find(|(_, outcome)| !outcome.violations.is_empty())
                    })
                })
                .collect();
            handles
                .into_iter()
                .filter_map(|handle| handle.join().expect("simulator thread"))
                .min_by_key(|(seed, _)| *seed)
        });
        if found.is_some() {
            return found;
        }
        start = end;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::{SimOptions, run, run_one, run_reusing};

    #[test]
    fn a_run_on_a_previous_runs_buffers_is_the_run_on_fresh_ones() {
        let mut buffers = run::RunBuffers::default();
        for seed in 40..44 {
            let reused = run_reusing(seed, SimOptions::default(), &mut buffers);
            let fresh = run_one(seed, SimOptions::default());
            assert!(fresh.steps > 100, "seed {seed} ran {} steps", fresh.steps);
            assert_eq!(
                (reused.trace_hash, reused.steps, reused.unknown_durations_ms),
                (fresh.trace_hash, fresh.steps, fresh.unknown_durations_ms),
                "seed {seed}"
            );
        }
    }
}
