//! Scenarios of the agent core: the idempotency window, forgetting reservations and shards, and the retention queue.
