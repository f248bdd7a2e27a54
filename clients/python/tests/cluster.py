"""Real Reservoir processes for the tests: one central service and its
agents, started from the ``reservoir`` binary on a temporary directory.

The Python twin of ``cli/src/cluster.rs``: ``keygen``, ``central serve``
on a free loopback port (plain HTTP, loopback only), ``PUT
/v1/gateways/{identity}`` for each agent's key, ``agent run`` with a
generated configuration, then a wait (bounded) for the agent's first boot.
Every child is started and stopped through its own ``Popen`` handle, by its
own process ID; ``close()`` kills and reaps them all.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

#: Longest wait for a process to print ``listening on …`` or boot.
START_TIMEOUT_S = 30.0
#: A route every agent is configured to admit without asking the center.
ROUTE_OFF = "route-off"
#: How often a wait asks again.
POLL_INTERVAL_S = 0.02


def binary() -> Path:
    """The ``reservoir`` binary: ``$RESERVOIR_BIN``, else the debug build at
    the workspace root (``target/debug/reservoir``)."""
    configured = os.environ.get("RESERVOIR_BIN")
    if configured:
        path = Path(configured)
    else:
        path = Path(__file__).resolve().parents[3] / "target" / "debug" / "reservoir"
    if not path.is_file():
        raise FileNotFoundError(
            f"no reservoir binary at {path}: run `cargo build -p reservoir` or set RESERVOIR_BIN"
        )
    return path


def policy(subject: str, route: str, generation: int = 1, **changes: Any) -> dict[str, Any]:
    """A policy shaped like docs/design.md §4.7's (opening and burst 1000,
    refill 100 a second, overdraft up to 200, no emergency shards), with
    ``changes`` applied (snake_case or camelCase names as the document has them)."""
    document: dict[str, Any] = {
        "schema": "admissionBudget.v1",
        "subject": subject,
        "route": route,
        "region": "test",
        "capacityUnit": "tokens",
        "policyGeneration": generation,
        "opening": 1000,
        "refill": {"units": 100, "intervalMs": 1000},
        "burst": 1000,
        "accountingEpochMs": 366 * 24 * 3600 * 1000,
        "estimatorDigest": "sha256:" + "07" * 32,
        "reservationUnitsMax": 800,
        "holdTtlMs": 30000,
        "priority": 0,
        "fairnessWeight": 1,
        "overdraftUnitsMax": 200,
        "executionHardLimitMs": 600000,
        "emergencyMode": "disabled",
        "mode": "enforce",
        "emergencyShardUnits": 0,
        "emergencyShardValidityMs": 600000,
    }
    document.update(changes)
    return document


def _tail(log: Path, lines: int = 25) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:]) or "(empty)"
    except OSError as error:
        return f"(cannot read it: {error})"


@dataclass
class _Process:
    name: str
    log: Path
    popen: subprocess.Popen[bytes]

    @classmethod
    def spawn(cls, name: str, args: list[str], log: Path) -> tuple[_Process, str]:
        """Starts ``args`` and waits for its first stdout line,
        ``listening on ADDR``; returns the process and ADDR."""
        env = dict(os.environ, RUST_LOG="info", NO_COLOR="1", RUST_LIB_BACKTRACE="0")
        with log.open("ab") as stderr:
            popen = subprocess.Popen(
                args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=stderr, env=env
            )
        process = cls(name, log, popen)
        assert popen.stdout is not None
        # readline blocks; a process that never prints is caught by the
        # caller's overall timeout through kill in close().
        line = popen.stdout.readline().decode(errors="replace").strip()
        if not line.startswith("listening on "):
            process.kill()
            raise RuntimeError(
                f"{name} printed {line!r} where `listening on ADDR` was expected; "
                f"the last lines of {log}:\n{_tail(log)}"
            )
        return process, line.removeprefix("listening on ").strip()

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(timeout=20)
        if self.popen.stdout is not None:
            self.popen.stdout.close()


def _keygen(args: list[str]) -> str:
    done = subprocess.run(args, capture_output=True, timeout=START_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed: {done.stderr.decode(errors='replace')}")
    return done.stdout.decode().splitlines()[0].strip()


@dataclass
class Agent:
    name: str
    dir: Path
    identity: str
    process: _Process | None = None

    @property
    def socket(self) -> Path:
        return self.dir / "agent.sock"

    @property
    def log(self) -> Path:
        return self.dir / "agent.log"

    def status(self) -> dict[str, Any]:
        with httpx.Client(transport=httpx.HTTPTransport(uds=str(self.socket)), timeout=10) as http:
            response = http.get("http://agent/v1/status")
            response.raise_for_status()
            result: dict[str, Any] = response.json()
            return result


@dataclass
class Cluster:
    """A central service and its agents on one temporary directory."""

    path: Path
    central_url: str
    token: str
    central: _Process
    agents: list[Agent] = field(default_factory=list)
    _tempdir: tempfile.TemporaryDirectory[str] | None = None

    @classmethod
    def start(cls, agents: int = 1) -> Cluster:
        exe = str(binary())
        tempdir = tempfile.TemporaryDirectory(prefix="reservoir-pytest-")
        path = Path(tempdir.name)
        data = path / "central"
        central_key = _keygen([exe, "keygen", "--data", str(data)])
        central, address = _Process.spawn(
            "the central service",
            [exe, "central", "serve", "--listen", "127.0.0.1:0", "--data", str(data)],
            path / "central.log",
        )
        token = (data / "operator.token").read_text().strip()
        cluster = cls(path, f"http://{address}", token, central, _tempdir=tempdir)
        try:
            for index in range(agents):
                cluster._add_agent(exe, f"agent-{chr(ord('a') + index)}", central_key)
        except BaseException:
            cluster.close()
            raise
        return cluster

    def _add_agent(self, exe: str, name: str, central_key: str) -> Agent:
        directory = self.path / name
        (directory / "data").mkdir(parents=True)
        identity = _keygen([exe, "keygen", "--out", str(directory / "agent.key")])
        agent = Agent(name, directory, identity)
        self.operator("PUT", f"/v1/gateways/{identity}")
        config = "\n".join(
            [
                f"socket = {json.dumps(str(agent.socket))}",
                f"data = {json.dumps(str(directory / 'data'))}",
                f"central = {json.dumps(self.central_url)}",
                f"identity_key = {json.dumps(str(directory / 'agent.key'))}",
                f"trusted_central_keys = [{json.dumps(central_key)}]",
                # A route the agent does not enforce (docs/design.md §3.8).
                f"[routes.{json.dumps(ROUTE_OFF)}]",
                'mode = "off"',
                "[timeouts]",
                "central_call_ms = 1000",
                "retry_interval_ms = 100",
                "",
            ]
        )
        (directory / "agent.toml").write_text(config)
        agent.process, _ = _Process.spawn(
            name, [exe, "agent", "run", "--config", str(directory / "agent.toml")], agent.log
        )
        self.agents.append(agent)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            try:
                if agent.status().get("bootEpoch"):
                    return agent
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not boot; its log:\n{_tail(agent.log)}")
            time.sleep(POLL_INTERVAL_S)

    def operator(self, method: str, path: str, body: Any = None) -> dict[str, Any]:
        """One operator call to the center; an error status raises."""
        response = httpx.request(
            method,
            self.central_url + path,
            headers={"authorization": f"Bearer {self.token}"},
            json=body,
            timeout=10,
        )
        if response.status_code >= 400:
            raise RuntimeError(f"{method} {path}: {response.status_code} {response.text}")
        result: dict[str, Any] = response.json()
        return result

    def publish(self, document: dict[str, Any]) -> dict[str, Any]:
        return self.operator("PUT", "/v1/policies", document)

    def accounts(self, subject: str, route: str) -> dict[str, Any]:
        return self.operator("GET", f"/v1/accounts/{subject}/{route}")

    def metrics(self) -> str:
        response = httpx.get(
            self.central_url + "/metrics",
            headers={"authorization": f"Bearer {self.token}"},
            timeout=10,
        )
        response.raise_for_status()
        return response.text

    def close(self) -> None:
        for agent in self.agents:
            if agent.process is not None:
                agent.process.kill()
        self.central.kill()
        if self._tempdir is not None:
            self._tempdir.cleanup()
