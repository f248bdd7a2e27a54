//! The fair start scheduler: which `RESERVED` request may start when a route
//! has more waiting than its concurrency limit allows. It only orders
//! starts of reservations the ledger already made; it never admits.
//!
//! Order: higher `priority` first; then the subject furthest behind its
//! weighted share; then arrival. Shares follow stride scheduling: each
//! subject has a virtual time ("pass") that a grant advances by
//! `STRIDE / weight`; a subject that was idle rejoins at the current virtual
//! time, so it neither hoards credit nor starves.

use std::collections::{BTreeMap, BTreeSet};

use shard_format::{ReservationId, Route, Subject};

/// Virtual time one grant costs a subject of weight 1.
const STRIDE: u128 = 1 << 40;

#[derive(Debug, Clone, PartialEq, Eq)]
struct Waiting {
    reservation: ReservationId,
    subject: Subject,
    priority: u8,
    arrival: u64,
}

/// A subject's share of contended starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubjectShare {
    pub subject: Subject,
    pub weight: u32,
    /// Starts granted while two or more subjects were waiting.
    pub granted: u64,
}

#[derive(Debug, Clone, Default)]
pub struct StartScheduler {
    limits: BTreeMap<Route, usize>,
    weights: BTreeMap<Subject, u32>,
    running: BTreeMap<Route, BTreeSet<ReservationId>>,
    waiting: BTreeMap<Route, Vec<Waiting>>,
    /// Each subject's virtual time (pass).
    pass: BTreeMap<Subject, u128>,
    /// The pass of the latest grant: where idle subjects rejoin.
    virtual_time: u128,
    /// Grants made while two or more subjects were waiting: the shares
    /// fairness is measured on.
    contended: BTreeMap<Subject, u64>,
    arrivals: u64,
}

/// What became of a start request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    Granted,
    Queued,
}

impl StartScheduler {
    /// `limits`: per-route concurrency limits (routes without one are
    /// unlimited). `weights`: per-subject fairness weights (default 1).
    pub fn new(limits: BTreeMap<Route, usize>, weights: BTreeMap<Subject, u32>) -> Self {
        Self {
            limits,
            weights,
            ..Self::default()
        }
    }

    pub fn set_weight(&mut self, subject: Subject, weight: u32) {
        self.weights.insert(subject, weight.max(1));
    }

    fn weight(&self, subject: &Subject) -> u32 {
        self.weights.get(subject).copied().unwrap_or(1).max(1)
    }

    /// Asks to start `reservation`. Granted at once if the route has a free
    /// slot and nobody waits; queued otherwise. Asking again is harmless.
    pub fn request(
        &mut self,
        route: &Route,
        subject: &Subject,
        priority: u8,
        reservation: &ReservationId,
    ) -> Admission {
        let running = self.running.entry(route.clone()).or_default();
        if running.contains(reservation) {
            return Admission::Granted;
        }
        let waiting = self.waiting.entry(route.clone()).or_default();
        if waiting.iter().any(|w| w.reservation == *reservation) {
            return Admission::Queued;
        }
        let limit = self.limits.get(route).copied().unwrap_or(usize::MAX);
        if running.len() < limit && waiting.is_empty() {
            running.insert(reservation.clone());
            return Admission::Granted;
        }
        self.arrivals += 1;
        let virtual_time = self.virtual_time;
        let rejoining = !waiting.iter().any(|w| w.subject == *subject);
        let pass = self.pass.entry(subject.clone()).or_default();
        if rejoining {
            *pass = (*pass).max(virtual_time);
        }
        let waiting = self.waiting.entry(route.clone()).or_default();
        waiting.push(Waiting {
            reservation: reservation.clone(),
            subject: subject.clone(),
            priority,
            arrival: self.arrivals,
        });
        Admission::Queued
    }

    /// A running (or waiting) reservation ended; returns the reservations
    /// now granted in its place.
    pub fn finish(&mut self, route: &Route, reservation: &ReservationId) -> Vec<ReservationId> {
        if let Some(waiting) = self.waiting.get_mut(route) {
            waiting.retain(|w| w.reservation != *reservation);
        }
        let removed = self
            .running
            .get_mut(route)
            .is_some_and(|running| running.remove(reservation));
        if !removed {
            return Vec::new();
        }
        self.grant_waiting(route)
    }

    fn grant_waiting(&mut self, route: &Route) -> Vec<ReservationId> {
        let limit = self.limits.get(route).copied().unwrap_or(usize::MAX);
        let mut granted = Vec::new();
        loop {
            let running = self.running.get(route).map_or(0, BTreeSet::len);
            let Some(waiting) = self.waiting.get(route) else {
                break;
            };
            if running >= limit || waiting.is_empty() {
                break;
            }
            let first = &waiting[0].subject;
            let subjects_waiting = waiting.iter().any(|w| w.subject != *first);
            let best = (0..waiting.len())
                .min_by(|&a, &b| self.order(&waiting[a], &waiting[b]))
                .expect("not empty");
            let chosen = self
                .waiting
                .get_mut(route)
                .expect("route has waiters")
                .swap_remove(best);
            let stride = STRIDE / u128::from(self.weight(&chosen.subject));
            let pass = self.pass.entry(chosen.subject.clone()).or_default();
            self.virtual_time = *pass;
            *pass += stride;
            if subjects_waiting {
                *self.contended.entry(chosen.subject.clone()).or_default() += 1;
            }
            self.running
                .entry(route.clone())
                .or_default()
                .insert(chosen.reservation.clone());
            granted.push(chosen.reservation);
        }
        granted
    }

    /// `Less` means `a` goes first.
    fn order(&self, a: &Waiting, b: &Waiting) -> std::cmp::Ordering {
        let pass = |w: &Waiting| self.pass.get(&w.subject).copied().unwrap_or(0);
        b.priority
            .cmp(&a.priority)
            .then(pass(a).cmp(&pass(b)))
            .then(a.arrival.cmp(&b.arrival))
    }

    /// Every subject's contended grants and weight.
    pub fn shares(&self) -> Vec<SubjectShare> {
        self.contended
            .iter()
            .map(|(subject, granted)| SubjectShare {
                subject: subject.clone(),
                weight: self.weight(subject),
                granted: *granted,
            })
            .collect()
    }

    pub fn waiting(&self, route: &Route) -> usize {
        self.waiting.get(route).map_or(0, Vec::len)
    }

    pub fn running(&self, route: &Route) -> usize {
        self.running.get(route).map_or(0, BTreeSet::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(value: &str) -> ReservationId {
        ReservationId::new(value).unwrap()
    }

    #[test]
    fn weighted_subjects_share_contended_starts_by_weight() {
        let route = Route::new("chat").unwrap();
        let heavy = Subject::new("heavy").unwrap();
        let light = Subject::new("light").unwrap();
        let mut scheduler = StartScheduler::new(
            [(route.clone(), 1)].into(),
            [(heavy.clone(), 3), (light.clone(), 1)].into(),
        );
        assert_eq!(
            scheduler.request(&route, &heavy, 0, &id("first")),
            Admission::Granted
        );
        for n in 0..40 {
            assert_eq!(
                scheduler.request(&route, &heavy, 0, &id(&format!("h{n}"))),
                Admission::Queued
            );
            assert_eq!(
                scheduler.request(&route, &light, 0, &id(&format!("l{n}"))),
                Admission::Queued
            );
        }
        let mut current = id("first");
        for _ in 0..40 {
            let next = scheduler.finish(&route, &current);
            assert_eq!(next.len(), 1, "one slot frees, one start is granted");
            current = next[0].clone();
        }
        let shares = scheduler.shares();
        let granted = |subject: &Subject| {
            shares
                .iter()
                .find(|s| s.subject == *subject)
                .unwrap()
                .granted
        };
        assert_eq!(granted(&heavy) + granted(&light), 40);
        assert_eq!(granted(&heavy), 30, "weight 3 of 4 gets three quarters");
    }

    #[test]
    fn priority_goes_before_fairness() {
        let route = Route::new("chat").unwrap();
        let a = Subject::new("a").unwrap();
        let mut scheduler = StartScheduler::new([(route.clone(), 1)].into(), BTreeMap::new());
        scheduler.request(&route, &a, 0, &id("running"));
        scheduler.request(&route, &a, 0, &id("low"));
        scheduler.request(&route, &a, 9, &id("high"));
        assert_eq!(scheduler.finish(&route, &id("running")), vec![id("high")]);
    }

    #[test]
    fn unlimited_routes_never_queue() {
        let route = Route::new("free").unwrap();
        let a = Subject::new("a").unwrap();
        let mut scheduler = StartScheduler::default();
        for n in 0..100 {
            assert_eq!(
                scheduler.request(&route, &a, 0, &id(&format!("r{n}"))),
                Admission::Granted
            );
        }
    }

    #[test]
    fn one_subjects_starts_are_granted_in_arrival_order() {
        let route = Route::new("chat").unwrap();
        let a = Subject::new("a").unwrap();
        let mut scheduler = StartScheduler::new([(route.clone(), 1)].into(), BTreeMap::new());
        scheduler.request(&route, &a, 0, &id("running"));
        for n in 1..=4 {
            scheduler.request(&route, &a, 0, &id(&format!("w{n}")));
        }
        let mut current = id("running");
        let mut order = Vec::new();
        for _ in 1..=4 {
            let next = scheduler.finish(&route, &current);
            assert_eq!(next.len(), 1);
            current = next[0].clone();
            order.push(current.clone());
        }
        assert_eq!(order, vec![id("w1"), id("w2"), id("w3"), id("w4")]);
    }

    #[test]
    fn an_idle_subject_rejoins_at_the_current_virtual_time_without_hoarded_credit() {
        let route = Route::new("chat").unwrap();
        let busy = Subject::new("busy").unwrap();
        let idle = Subject::new("idle").unwrap();
        let mut scheduler = StartScheduler::new([(route.clone(), 1)].into(), BTreeMap::new());
        scheduler.request(&route, &busy, 0, &id("running"));
        for n in 0..8 {
            scheduler.request(&route, &busy, 0, &id(&format!("busy-{n}")));
        }
        // `busy` runs alone for four grants while `idle` has nothing to start.
        let mut current = id("running");
        for n in 0..4 {
            let next = scheduler.finish(&route, &current);
            assert_eq!(next, vec![id(&format!("busy-{n}"))]);
            current = next[0].clone();
        }
        // `idle` arrives with one start: it rejoins at the current virtual
        // time, so it goes first once but has not hoarded the four grants
        // it did not ask for.
        scheduler.request(&route, &idle, 0, &id("idle-0"));
        current = scheduler.finish(&route, &current).remove(0);
        assert_eq!(current, id("idle-0"));
        // Arriving again after its one start, it takes turns with `busy`.
        scheduler.request(&route, &idle, 0, &id("idle-1"));
        scheduler.request(&route, &idle, 0, &id("idle-2"));
        let mut order = Vec::new();
        for _ in 0..4 {
            current = scheduler.finish(&route, &current).remove(0);
            order.push(current.clone());
        }
        assert_eq!(
            order,
            vec![id("busy-4"), id("idle-1"), id("busy-5"), id("idle-2")]
        );
    }

    #[test]
    fn waiting_and_running_count_each_routes_starts() {
        let route = Route::new("chat").unwrap();
        let other = Route::new("other").unwrap();
        let a = Subject::new("a").unwrap();
        let mut scheduler = StartScheduler::new([(route.clone(), 2)].into(), BTreeMap::new());
        for n in 0..5 {
            scheduler.request(&route, &a, 0, &id(&format!("r{n}")));
        }
        assert_eq!(scheduler.running(&route), 2, "the limit");
        assert_eq!(scheduler.waiting(&route), 3);
        assert_eq!(scheduler.running(&other), 0);
        assert_eq!(scheduler.waiting(&other), 0);
        assert_eq!(scheduler.finish(&route, &id("r0")), vec![id("r2")]);
        assert_eq!(scheduler.running(&route), 2);
        assert_eq!(scheduler.waiting(&route), 2);
    }

    #[test]
    fn a_weight_set_later_shares_like_one_given_at_start_and_zero_counts_as_one() {
        let route = Route::new("chat").unwrap();
        let heavy = Subject::new("heavy").unwrap();
        let light = Subject::new("light").unwrap();
        let mut scheduler = StartScheduler::new([(route.clone(), 1)].into(), BTreeMap::new());
        scheduler.set_weight(heavy.clone(), 3);
        scheduler.set_weight(light.clone(), 0);
        scheduler.request(&route, &heavy, 0, &id("first"));
        for n in 0..20 {
            scheduler.request(&route, &heavy, 0, &id(&format!("h{n}")));
            scheduler.request(&route, &light, 0, &id(&format!("l{n}")));
        }
        let mut current = id("first");
        for _ in 0..20 {
            current = scheduler.finish(&route, &current).remove(0);
        }
        let shares = scheduler.shares();
        let share = |subject: &Subject| {
            shares
                .iter()
                .find(|s| s.subject == *subject)
                .unwrap()
                .clone()
        };
        assert_eq!(share(&heavy).weight, 3);
        assert_eq!(share(&light).weight, 1, "a weight of 0 counts as 1");
        assert_eq!(
            share(&heavy).granted,
            15,
            "weight 3 of 4 gets three quarters"
        );
        assert_eq!(share(&light).granted, 5);
    }
}
