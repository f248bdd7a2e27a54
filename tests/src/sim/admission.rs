//! The `partial_admission` check: what an admitted reservation holds
//! against what its gateway asked for and what was there to grant.
//!
//! A reservation holds all of `units`, or, when flexible, a grant from
//! `minUnits` to `units`; never more than its account (central path) or
//! its shard book (shard path) had available just before the admission.
//! A multi-leg reservation holds every leg so, or none: no leg is held
//! without the others ([`check_legs_together`]).

/// One admission as the auditor saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Admission {
    /// The units asked for.
    pub units: u64,
    /// A flexible reservation's floor; `None` for a fixed one.
    pub min_units: Option<u64>,
    /// The units the reservation holds.
    pub granted: u64,
    /// What the account's `available` (central) or the shard book's
    /// `localAvailable` was just before the admission, when known.
    pub available: Option<u64>,
}

/// Why `admission` breaks the rule of partial admission, or `None` if it
/// keeps it.
pub(crate) fn check_partial_admission(admission: &Admission) -> Option<String> {
    let Admission {
        units,
        min_units,
        granted,
        available,
    } = *admission;
    match min_units {
        Some(min) if granted < min || granted > units => {
            return Some(format!(
                "granted {granted} units, outside the ask of {min} to {units}"
            ));
        }
        None if granted != units => {
            return Some(format!("granted {granted} units of a fixed ask of {units}"));
        }
        _ => {}
    }
    match available {
        Some(available) if granted > available => Some(format!(
            "granted {granted} units with only {available} available"
        )),
        _ => None,
    }
}

/// Where one leg of a multi-leg reservation stands, as the auditor sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum LegHold {
    /// It holds its grant (at the center: stored, in a state that holds
    /// units; at an agent: granted, and from shards booked by its shard).
    Holds,
    /// It holds nothing, and why (its state, not stored, no shard …).
    Free(String),
    /// A leg that never holds anything (its route is not enforced).
    Shadow,
}

/// Why `legs` are apart — some hold units while another does not — or
/// `None` if all of them hold or none does (shadow legs aside).
pub(crate) fn check_legs_together(legs: &[LegHold]) -> Option<String> {
    let holding: Vec<usize> = (0..legs.len())
        .filter(|index| legs[*index] == LegHold::Holds)
        .collect();
    let free: Vec<String> = legs
        .iter()
        .enumerate()
        .filter_map(|(index, leg)| match leg {
            LegHold::Free(why) => Some(format!("leg {index} {why}")),
            _ => None,
        })
        .collect();
    (!holding.is_empty() && !free.is_empty())
        .then(|| format!("legs {holding:?} hold units, {}", free.join(", ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn legs_hold_together_or_not_at_all() {
        use LegHold::{Free, Holds, Shadow};
        let free = || Free("not stored".to_owned());
        let cases = [
            (vec![Holds, Holds], false),
            (vec![free(), free()], false),
            (vec![Holds, Holds, Shadow], false),
            (vec![Shadow, free()], false),
            (vec![Shadow, Shadow], false),
            // One leg apart, first or last, beside a shadow leg or not.
            (vec![Holds, free()], true),
            (vec![free(), Holds], true),
            (vec![Holds, Holds, free()], true),
            (vec![Shadow, Holds, free()], true),
        ];
        for (legs, apart) in cases {
            assert_eq!(check_legs_together(&legs).is_some(), apart, "{legs:?}");
        }
        assert_eq!(
            check_legs_together(&[Holds, free()]).as_deref(),
            Some("legs [0] hold units, leg 1 not stored")
        );
    }

    /// (units, min, granted, available) → whether the admission breaks the rule.
    #[test]
    fn grants_inside_the_ask_and_what_was_available_pass() {
        let cases = [
            // Fixed: exactly the ask.
            (100, None, 100, Some(100), false),
            (100, None, 99, Some(500), true),
            (100, None, 101, Some(500), true),
            // Fixed, but more than was available (one past the limit).
            (100, None, 100, Some(99), true),
            // Flexible: the floor, the ask, and one past each.
            (100, Some(40), 40, Some(40), false),
            (100, Some(40), 39, Some(39), true),
            (100, Some(40), 100, Some(100), false),
            (100, Some(40), 101, Some(500), true),
            // The boundaries min == units and min == 1.
            (100, Some(100), 100, Some(100), false),
            (100, Some(100), 99, Some(99), true),
            (100, Some(1), 1, Some(1), false),
            (100, Some(1), 0, Some(0), true),
            // A grant one above what was available.
            (100, Some(40), 61, Some(60), true),
            // Availability unknown: only the ask is judged.
            (100, Some(40), 70, None, false),
        ];
        for (units, min_units, granted, available, broken) in cases {
            let admission = Admission {
                units,
                min_units,
                granted,
                available,
            };
            assert_eq!(
                check_partial_admission(&admission).is_some(),
                broken,
                "{admission:?}"
            );
        }
    }
}
