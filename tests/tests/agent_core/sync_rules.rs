//! Scenarios of the agent core: replies from the center, unknown outcomes, retries, partitions, recovery and the start scheduler.
