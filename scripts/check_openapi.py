"""Schemathesis against both live APIs (scripts/check-openapi runs this in
its virtualenv).

Starts a real central service and agent from the ``reservoir`` binary (the
Python client tests' cluster, clients/python/tests/cluster.py), publishes a
policy, checks that each server serves at ``GET /openapi.json`` the document
committed under docs/openapi/, and runs ``schemathesis run`` against each:
the center on its loopback port with the operator token, the agent through
a loopback TCP port forwarded to its Unix socket (Schemathesis speaks HTTP
over TCP only). The center's agent calls are signed by an identity enrolled
for the run (scripts/openapi_hooks.py). Exits non-zero when a run failed; prints each run's figures.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "clients" / "python" / "tests"))

from cluster import Cluster, binary, policy  # noqa: E402

#: The checks every response must pass.
CHECKS = ",".join(
    [
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_headers_conformance",
        "response_schema_conformance",
    ]
)


class Forwarder:
    """A loopback TCP port whose connections are piped to a Unix socket, on
    an asyncio loop in a daemon thread."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.loop = asyncio.new_event_loop()
        self.port = 0
        started = threading.Event()
        threading.Thread(target=self._run, args=(started,), daemon=True).start()
        if not started.wait(10):
            raise RuntimeError("the TCP forwarder did not start")

    def _run(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(
            asyncio.start_server(self._connection, "127.0.0.1", 0)
        )
        self.port = server.sockets[0].getsockname()[1]
        started.set()
        self.loop.run_forever()

    async def _connection(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        try:
            agent_reader, agent_writer = await asyncio.open_unix_connection(self.socket_path)
        except OSError:
            client_writer.close()
            return

        async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while data := await reader.read(65536):
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                writer.close()

        await asyncio.gather(pipe(client_reader, agent_writer), pipe(agent_reader, client_writer))


def served_matches_committed(base_url: str, committed: Path) -> bool:
    with urllib.request.urlopen(f"{base_url}/openapi.json", timeout=10) as response:
        served = json.loads(response.read())
    if served != json.loads(committed.read_text()):
        print(f"== openapi: {base_url}/openapi.json differs from {committed}", flush=True)
        return False
    return True


def schemathesis(
    name: str, base_url: str, headers: list[str], report: Path, env: dict[str, str] | None = None
) -> dict[str, int]:
    """One Schemathesis run against the document ``base_url`` serves;
    returns its figures (and ``exit``, its exit status)."""
    examples = os.environ.get("OPENAPI_MAX_EXAMPLES", "25")
    seed = os.environ.get("OPENAPI_SEED", "1")
    args = [
        str(Path(sys.executable).parent / "schemathesis"),
        "run",
        f"{base_url}/openapi.json",
        "--url",
        base_url,
        "--checks",
        os.environ.get("OPENAPI_CHECKS", CHECKS),
        "--max-examples",
        examples,
        "--seed",
        seed,
        "--workers",
        os.environ.get("OPENAPI_WORKERS", "1"),
        "--phases",
        os.environ.get("OPENAPI_PHASES", "examples,coverage,fuzzing"),
        "--request-timeout",
        "10",
        "--suppress-health-check",
        "all",
        "--report",
        "ndjson",
        "--report-ndjson-path",
        str(report),
        "--continue-on-failure",
        "--output-truncate",
        "false",
    ]
    for header in headers:
        args += ["--header", header]
    print(f"== openapi: schemathesis on the {name} ({base_url}, {examples} examples per operation, seed {seed})", flush=True)
    done = subprocess.run(args, cwd=report.parent, check=False, env=dict(os.environ, **(env or {})))
    figures = count(report)
    figures["exit"] = done.returncode
    return figures


def count(report: Path) -> dict[str, int]:
    """Test cases and failed checks in a Schemathesis ndjson report."""
    figures = {"cases": 0, "failures": 0}
    if not report.is_file():
        return figures
    for line in report.read_text().splitlines():
        event = json.loads(line)
        for kind, body in event.items():
            if kind == "ScenarioFinished":
                recorder = body.get("recorder", {})
                figures["cases"] += len(recorder.get("cases", {}))
                for checks in recorder.get("checks", {}).values():
                    figures["failures"] += sum(
                        1 for check in checks if str(check.get("status")).lower() == "failure"
                    )
    return figures


def main() -> int:
    out = ROOT / "target" / "openapi-check"
    out.mkdir(parents=True, exist_ok=True)
    cluster = Cluster.start(agents=1)
    try:
        # A pair with a policy: reservations against it reach the ledger.
        cluster.publish(policy("tenant-1", "chat.generate"))
        forwarder = Forwarder(str(cluster.agents[0].socket))
        agent_url = f"http://127.0.0.1:{forwarder.port}"
        # An identity of its own for Schemathesis's signed calls (the
        # agent's boots are not disturbed), enrolled like an agent's.
        key = cluster.path / "schemathesis.key"
        subprocess.run([str(binary()), "keygen", "--out", str(key)], check=True, capture_output=True)
        identity = json.loads(key.read_text())["keyId"]
        cluster.operator("PUT", f"/v1/gateways/{identity}")
        signing = {
            "SCHEMATHESIS_HOOKS": "openapi_hooks",
            "PYTHONPATH": str(ROOT / "scripts"),
            "OPENAPI_SIGNING_KEY": str(key),
            "OPENAPI_PAIR": "tenant-1/chat.generate",
        }
        ok = served_matches_committed(cluster.central_url, ROOT / "docs/openapi/central.json")
        ok = served_matches_committed(agent_url, ROOT / "docs/openapi/agent.json") and ok
        central = schemathesis(
            "central API",
            cluster.central_url,
            [f"Authorization: Bearer {cluster.token}"],
            out / "central.ndjson",
            signing,
        )
        agent = schemathesis("agent socket API", agent_url, [], out / "agent.ndjson")
    finally:
        cluster.close()
    for name, figures in (("central", central), ("agent", agent)):
        print(
            f"== openapi: {name}: {figures['cases']} test cases, {figures['failures']} failed check results, exit {figures['exit']}",
            flush=True,
        )
    return 0 if ok and central["exit"] == 0 and agent["exit"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
