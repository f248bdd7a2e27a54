//! Scenarios of the agent core: emergency shards: requesting, accepting, local admission, closing and handing back.
