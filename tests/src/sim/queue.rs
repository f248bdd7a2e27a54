//! A run's pending events, in the order they fire: by time, and events due
//! at the same time in the order they were scheduled (the run's
//! determinism rests on that tie-break).
//!
//! The heap orders small `(time, sequence, slot)` keys; the events stay put
//! in a slab whose freed slots are taken again, so that neither a sift nor
//! a lookup moves or searches for an event. A thread's queue is cleared and
//! reused from run to run: its buffers are allocated once.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

#[derive(Debug)]
pub struct EventQueue<E> {
    /// Due time, scheduling sequence (unique), slot of the event.
    order: BinaryHeap<Reverse<(u64, u64, usize)>>,
    slots: Vec<Option<E>>,
    free: Vec<usize>,
    next_sequence: u64,
}

impl<E> Default for EventQueue<E> {
    fn default() -> Self {
        Self {
            order: BinaryHeap::new(),
            slots: Vec::new(),
            free: Vec::new(),
            next_sequence: 0,
        }
    }
}

impl<E> EventQueue<E> {
    /// Drops every pending event and restarts the sequence; the buffers
    /// keep their capacity.
    pub fn clear(&mut self) {
        self.order.clear();
        self.slots.clear();
        self.free.clear();
        self.next_sequence = 0;
    }

    /// Schedules `event` at `at`, after everything already due at `at`.
    pub fn schedule(&mut self, at: u64, event: E) {
        let slot = match self.free.pop() {
            Some(slot) => {
                self.slots[slot] = Some(event);
                slot
            }
            None => {
                self.slots.push(Some(event));
                self.slots.len() - 1
            }
        };
        self.order.push(Reverse((at, self.next_sequence, slot)));
        self.next_sequence += 1;
    }

    /// The next event due and its time.
    pub fn pop(&mut self) -> Option<(u64, E)> {
        let Reverse((at, _, slot)) = self.order.pop()?;
        let event = self.slots[slot]
            .take()
            .expect("a scheduled slot holds its event");
        self.free.push(slot);
        Some((at, event))
    }
}

#[cfg(test)]
mod tests {
    use super::EventQueue;

    fn drain(queue: &mut EventQueue<&'static str>) -> Vec<(u64, &'static str)> {
        std::iter::from_fn(|| queue.pop()).collect()
    }

    #[test]
    fn events_fire_by_time_then_in_scheduling_order() {
        let mut queue = EventQueue::default();
        queue.schedule(30, "c");
        queue.schedule(10, "a1");
        queue.schedule(20, "b");
        queue.schedule(10, "a2");
        queue.schedule(10, "a3");
        assert_eq!(
            drain(&mut queue),
            [(10, "a1"), (10, "a2"), (10, "a3"), (20, "b"), (30, "c")]
        );
    }

    #[test]
    fn an_event_scheduled_while_draining_takes_a_freed_slot_and_its_turn() {
        let mut queue = EventQueue::default();
        queue.schedule(5, "first");
        queue.schedule(5, "second");
        assert_eq!(queue.pop(), Some((5, "first")));
        // Reuses the freed slot 0, yet fires after "second", scheduled
        // earlier for the same time.
        queue.schedule(5, "third");
        assert_eq!(queue.slots.len(), 2);
        assert_eq!(drain(&mut queue), [(5, "second"), (5, "third")]);
    }

    #[test]
    fn a_cleared_queue_forgets_its_events_and_keeps_its_order_rule() {
        let mut queue = EventQueue::default();
        queue.schedule(1, "stale");
        queue.schedule(2, "stale too");
        queue.clear();
        assert_eq!(queue.pop(), None);
        queue.schedule(7, "x");
        queue.schedule(7, "y");
        assert_eq!(drain(&mut queue), [(7, "x"), (7, "y")]);
    }
}
