"""The LiteLLM proxy loads ``callbacks:`` from a file next to its
configuration: this one hands it Reservoir's hook, configured from the
environment (RESERVOIR_AGENT_SOCKET, RESERVOIR_SUBJECT, RESERVOIR_ROUTE,
RESERVOIR_DEFAULT_MAX_TOKENS, RESERVOIR_MIN_COMPLETION_TOKENS,
RESERVOIR_REQUESTS_ROUTE, RESERVOIR_CONCURRENCY_ROUTE; see
reservoir_client.litellm_hook)."""

from reservoir_client.litellm_hook import from_environment

proxy_handler = from_environment()
