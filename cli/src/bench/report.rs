//! What a run prints and writes: one table row per measured case, the
//! machine-readable lines (`bench: <case> <metric>=<value>` per figure,
//! `ratio: <name>=<value>` per ratio), and the generated section of
//! BENCHMARKS.md between its two markers.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::Context as _;

use super::load::LoadResult;

pub const BEGIN_MARKER: &str = "<!-- reservoir bench: begin -->";
pub const END_MARKER: &str = "<!-- reservoir bench: end -->";

/// One measured case.
#[derive(Debug, Clone)]
pub struct Row {
    /// Machine name, e.g. `agent_emergency_128`.
    pub case: String,
    /// What was measured, for people.
    pub what: String,
    pub in_flight: Option<usize>,
    /// The main figure and its unit.
    pub rate: f64,
    pub unit: &'static str,
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
    pub notes: String,
    /// Every figure, for the `bench:` lines.
    pub metrics: Vec<(&'static str, f64)>,
}

impl Row {
    /// A row for a load run: requests/s first; cycles are admissions.
    pub fn load(case: String, what: &str, result: &LoadResult, cycle: Option<&str>) -> Self {
        let mut metrics = vec![
            ("requests_per_s", result.requests_per_second()),
            ("p50_ms", result.p50_ms),
            ("p99_ms", result.p99_ms),
        ];
        let mut notes = String::new();
        if let Some(cycle) = cycle {
            metrics.push(("cycles_per_s", result.cycles_per_second()));
            let _ = write!(notes, "{:.0} {cycle}/s", result.cycles_per_second());
        }
        if let (Some(p50), Some(p99), Some(_)) =
            (result.reserve_p50_ms, result.reserve_p99_ms, cycle)
        {
            metrics.push(("reserve_p50_ms", p50));
            metrics.push(("reserve_p99_ms", p99));
            let _ = write!(notes, "; reserve p50 {p50:.2} ms, p99 {p99:.2} ms");
        }
        metrics.push(("errors", result.errors as f64));
        if result.errors > 0 {
            let _ = write!(notes, "; {} errors", result.errors);
        }
        Self {
            case,
            what: what.to_owned(),
            in_flight: Some(result.in_flight),
            rate: result.requests_per_second(),
            unit: "requests/s",
            p50_ms: Some(result.p50_ms),
            p99_ms: Some(result.p99_ms),
            notes,
            metrics,
        }
    }
}

/// A target a ratio must meet.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Target {
    AtLeast(f64),
    AtMost(f64),
}

impl Target {
    fn met(self, value: f64) -> bool {
        match self {
            Self::AtLeast(target) => value >= target,
            Self::AtMost(target) => value <= target,
        }
    }

    fn shortfall_percent(self, value: f64) -> f64 {
        match self {
            Self::AtLeast(target) => (target - value) / target * 100.0,
            Self::AtMost(target) => (value - target) / target * 100.0,
        }
    }
}

impl std::fmt::Display for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::AtLeast(target) => write!(f, "≥ {target}"),
            Self::AtMost(target) => write!(f, "≤ {target}"),
        }
    }
}

/// Whether a target is on a ratio of two figures of the run or on one
/// figure (the agent's memory, the million-run gate's time).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GoalKind {
    Ratio,
    Figure,
}

/// A same-run ratio, or a figure with a target.
#[derive(Debug, Clone)]
pub struct Ratio {
    pub name: &'static str,
    pub kind: GoalKind,
    pub value: f64,
    pub target: Target,
    /// Numerator over denominator, in words.
    pub definition: String,
}

impl Ratio {
    pub fn met(&self) -> bool {
        self.target.met(self.value)
    }

    /// The value with two decimals, or as many more (up to six) as it
    /// takes for the text to meet or miss the target as the value does:
    /// 2.996 for ≥ 3 reads "2.996", not "3.00".
    fn shown_value(&self) -> String {
        let met = self.met();
        let mut text = String::new();
        for decimals in 2..=6 {
            text = format!("{:.*}", decimals, self.value);
            if text
                .parse::<f64>()
                .is_ok_and(|shown| self.target.met(shown) == met)
            {
                break;
            }
        }
        text
    }

    /// How far a missed target is, in per cent: whole ones, or one
    /// decimal below 1 % (a miss by 0.07 % is not "by 0 %").
    fn shortfall(&self) -> String {
        let percent = self.target.shortfall_percent(self.value);
        if percent >= 1.0 {
            format!("{percent:.0} %")
        } else if percent >= 0.1 {
            format!("{percent:.1} %")
        } else {
            "less than 0.1 %".to_owned()
        }
    }
}

/// Everything a run measured.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub rows: Vec<Row>,
    pub ratios: Vec<Ratio>,
    /// Header lines: date, commit, machine, duration.
    pub header: Vec<String>,
    /// Ratios that could not be computed, and why.
    pub skipped: Vec<String>,
}

fn number(value: f64) -> String {
    if value >= 100.0 {
        let text = format!("{value:.0}");
        let mut grouped = String::new();
        for (index, digit) in text.chars().enumerate() {
            if index > 0 && (text.len() - index).is_multiple_of(3) {
                grouped.push(',');
            }
            grouped.push(digit);
        }
        grouped
    } else if value >= 10.0 {
        format!("{value:.1}")
    } else {
        format!("{value:.2}")
    }
}

fn milliseconds(value: Option<f64>) -> String {
    value.map_or_else(|| "–".to_owned(), |ms| format!("{ms:.2}"))
}

impl Report {
    pub fn row(&self, case: &str) -> Option<&Row> {
        self.rows.iter().find(|row| row.case == case)
    }

    /// The figures as markdown tables (ratios, then cases).
    pub fn tables(&self) -> String {
        let mut out = String::new();
        out.push_str(
            "| ratio or figure | value | target | verdict | numerator / denominator, or figure |\n",
        );
        out.push_str("|---|---|---|---|---|\n");
        for ratio in &self.ratios {
            let verdict = if ratio.met() {
                "met".to_owned()
            } else {
                format!("**missed** by {}", ratio.shortfall())
            };
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} |",
                ratio.name,
                ratio.shown_value(),
                ratio.target,
                verdict,
                ratio.definition
            );
        }
        for skipped in &self.skipped {
            let _ = writeln!(out, "| {skipped} | – | – | not measured | |");
        }
        out.push('\n');
        out.push_str("| case | what | in flight | rate | p50 ms | p99 ms | notes |\n");
        out.push_str("|---|---|---|---|---|---|---|\n");
        for row in &self.rows {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} {} | {} | {} | {} |",
                row.case,
                row.what,
                row.in_flight
                    .map_or_else(|| "–".to_owned(), |n| n.to_string()),
                number(row.rate),
                row.unit,
                milliseconds(row.p50_ms),
                milliseconds(row.p99_ms),
                row.notes
            );
        }
        out
    }

    /// The `bench:` and `ratio:` lines.
    pub fn machine_lines(&self) -> String {
        let mut out = String::new();
        for row in &self.rows {
            for (metric, value) in &row.metrics {
                let _ = writeln!(out, "bench: {} {metric}={}", row.case, format_value(*value));
            }
        }
        for ratio in &self.ratios {
            let prefix = match ratio.kind {
                GoalKind::Ratio => "ratio",
                GoalKind::Figure => "bench",
            };
            let _ = writeln!(out, "{prefix}: {}={:.3}", ratio.name, ratio.value);
        }
        out
    }

    /// Which targets were missed and by how much, one sentence each.
    pub fn missed(&self) -> Vec<String> {
        self.ratios
            .iter()
            .filter(|ratio| !ratio.met())
            .map(|ratio| {
                format!(
                    "`{}` = {}, target {}: missed by {}",
                    ratio.name,
                    ratio.shown_value(),
                    ratio.target,
                    ratio.shortfall()
                )
            })
            .collect()
    }

    /// The generated section of BENCHMARKS.md, markers included.
    pub fn section(&self, method: &str) -> String {
        let mut out = String::new();
        out.push_str(BEGIN_MARKER);
        out.push_str("\n## Same-run ratios: `scripts/bench`\n\n");
        out.push_str(
            "Generated by `reservoir bench` (run `./scripts/bench`); the command rewrites \
             everything between the two `reservoir bench` markers and nothing else.\n\n",
        );
        for line in &self.header {
            let _ = writeln!(out, "- {line}");
        }
        out.push('\n');
        out.push_str(method);
        out.push_str("\n\n");
        out.push_str(&self.tables());
        let missed = self.missed();
        if missed.is_empty() {
            out.push_str("\nEvery target was met in this run.\n");
        } else {
            out.push_str("\nTargets missed in this run:\n\n");
            for line in missed {
                let _ = writeln!(out, "- {line}");
            }
        }
        out.push_str("\n```text\n");
        out.push_str(&self.machine_lines());
        out.push_str("```\n");
        out.push_str(END_MARKER);
        out.push('\n');
        out
    }
}

fn format_value(value: f64) -> String {
    if value.fract() == 0.0 && value.abs() < 1e15 {
        format!("{value:.0}")
    } else if value.abs() >= 100.0 {
        format!("{value:.1}")
    } else {
        format!("{value:.3}")
    }
}

/// Replaces the generated section of `text` (between the markers) with
/// `section`; without markers, puts it before the first `## ` heading (or
/// at the end). The rest of the file is left as it was.
pub fn splice(text: &str, section: &str) -> String {
    if let (Some(begin), Some(end)) = (text.find(BEGIN_MARKER), text.find(END_MARKER))
        && begin < end
    {
        let mut after = end + END_MARKER.len();
        if text[after..].starts_with('\n') {
            after += 1;
        }
        return format!("{}{section}{}", &text[..begin], &text[after..]);
    }
    match text.find("\n## ") {
        Some(at) => format!("{}{section}\n{}", &text[..=at], &text[at + 1..]),
        None => format!("{text}\n{section}"),
    }
}

/// Rewrites the generated section of the file at `path` (created if missing).
pub fn write_section(path: &Path, section: &str) -> anyhow::Result<()> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => "# Benchmarks\n".to_owned(),
        Err(error) => {
            return Err(error).with_context(|| format!("cannot read {}", path.display()));
        }
    };
    let updated = splice(&text, section);
    let temporary = path.with_extension("md.tmp");
    std::fs::write(&temporary, updated)
        .with_context(|| format!("cannot write {}", temporary.display()))?;
    std::fs::rename(&temporary, path)
        .with_context(|| format!("cannot replace {}", path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn section(body: &str) -> String {
        format!("{BEGIN_MARKER}\n{body}\n{END_MARKER}\n")
    }

    #[test]
    fn only_the_generated_section_is_replaced() {
        let text = format!("# B\n\nintro\n\n{}\n## Other\n\nkept\n", section("old"));
        let updated = splice(&text, &section("new"));
        assert_eq!(
            updated,
            format!("# B\n\nintro\n\n{}\n## Other\n\nkept\n", section("new"))
        );
    }

    #[test]
    fn without_markers_the_section_goes_before_the_first_heading() {
        let text = "# B\n\nintro\n\n## Other\n\nkept\n";
        let updated = splice(text, &section("new"));
        assert_eq!(
            updated,
            format!("# B\n\nintro\n\n{}\n## Other\n\nkept\n", section("new"))
        );
    }

    #[test]
    fn a_figure_with_a_target_prints_as_a_bench_line_and_a_ratio_as_a_ratio_line() {
        let goal = |name, kind, value| Ratio {
            name,
            kind,
            value,
            target: Target::AtMost(120.0),
            definition: String::new(),
        };
        let report = Report {
            ratios: vec![
                goal("sim_million_s", GoalKind::Figure, 121.0),
                goal("p99_vs_echo", GoalKind::Ratio, 2.5),
            ],
            ..Report::default()
        };
        assert_eq!(
            report.machine_lines(),
            "bench: sim_million_s=121.000\nratio: p99_vs_echo=2.500\n"
        );
        assert_eq!(
            report.missed(),
            vec!["`sim_million_s` = 121.00, target ≤ 120: missed by 0.8 %".to_owned()]
        );
    }

    /// A value that rounds to its target at two decimals is shown with
    /// the digits that miss it, and so is its shortfall.
    #[test]
    fn a_miss_at_the_line_reads_as_a_miss() {
        let ratio = |value, target| Ratio {
            name: "x",
            kind: GoalKind::Ratio,
            value,
            target,
            definition: String::new(),
        };
        let report = Report {
            ratios: vec![
                ratio(2.996, Target::AtLeast(3.0)),
                ratio(120.004, Target::AtMost(120.0)),
                ratio(1.4999999, Target::AtLeast(1.5)),
            ],
            ..Report::default()
        };
        assert_eq!(
            report.missed(),
            vec![
                "`x` = 2.996, target ≥ 3: missed by 0.1 %".to_owned(),
                "`x` = 120.004, target ≤ 120: missed by less than 0.1 %".to_owned(),
                "`x` = 1.500000, target ≥ 1.5: missed by less than 0.1 %".to_owned(),
            ]
        );
        assert!(
            report
                .tables()
                .contains("| x | 2.996 | ≥ 3 | **missed** by 0.1 % |")
        );
        // Met at the line: two decimals.
        assert_eq!(ratio(3.0, Target::AtLeast(3.0)).shown_value(), "3.00");
        assert_eq!(ratio(0.995, Target::AtLeast(0.6)).shown_value(), "0.99");
    }

    #[test]
    fn numbers_are_grouped_and_missed_targets_named() {
        assert_eq!(number(1_234_567.4), "1,234,567");
        assert_eq!(number(12.34), "12.3");
        let report = Report {
            ratios: vec![Ratio {
                name: "x",
                kind: GoalKind::Ratio,
                value: 0.3,
                target: Target::AtLeast(0.6),
                definition: String::new(),
            }],
            ..Report::default()
        };
        assert_eq!(
            report.missed(),
            vec!["`x` = 0.30, target ≥ 0.6: missed by 50 %".to_owned()]
        );
    }
}
