"""The example proxy configuration (examples/litellm_proxy_config.yaml)
running in a real LiteLLM proxy process, its model mocked, against a real
agent and central service: a request is admitted and settled with its
usage; one Reservoir refuses gets 429 with Retry-After from the proxy."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from cluster import Cluster
from conftest import Pair, publish

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MODEL = "gpt-4o-mini"
PROXY_START_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture
def proxy(cluster: Cluster, tmp_path: Path) -> Iterator[tuple[str, Pair]]:
    pair = publish(cluster, route=MODEL)
    config = yaml.safe_load((EXAMPLES / "litellm_proxy_config.yaml").read_text())
    # The example's model, answered by LiteLLM's mock instead of OpenAI
    # (30 tokens of usage: 10 prompt, 20 completion).
    config["model_list"][0]["litellm_params"].update(api_key="sk-unused", mock_response="Hello from the mock")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    shutil.copy(EXAMPLES / "reservoir_callbacks.py", tmp_path)
    port = free_port()
    env = dict(
        os.environ,
        RESERVOIR_AGENT_SOCKET=str(cluster.agents[0].socket),
        RESERVOIR_SUBJECT=pair.subject,
        LITELLM_LOCAL_MODEL_COST_MAP="True",
    )
    log = (tmp_path / "proxy.log").open("wb")
    litellm_cli = Path(sys.executable).with_name("litellm")
    process = subprocess.Popen(
        [
            str(litellm_cli),
            "--config",
            str(tmp_path / "config.yaml"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=tmp_path,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + PROXY_START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the proxy exited: {(tmp_path / 'proxy.log').read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health/liveliness", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the proxy did not start: {(tmp_path / 'proxy.log').read_text()[-3000:]}")
            time.sleep(0.1)
        yield url, pair
    finally:
        process.kill()
        process.wait(timeout=20)
        log.close()


def chat(url: str, max_tokens: int) -> httpx.Response:
    return httpx.post(
        f"{url}/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens},
        timeout=30,
    )


def test_the_example_proxy_admits_settles_and_refuses(proxy: tuple[str, Pair]) -> None:
    url, pair = proxy

    admitted = chat(url, 50)
    assert admitted.status_code == 200, admitted.text
    assert admitted.json()["usage"]["total_tokens"] == 30

    deadline = time.monotonic() + 10
    while (account := pair.account())["spent"] != 30 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert account["spent"] == 30 and account["reserved"] == 0

    refused = chat(url, 801)  # over the policy's reservationUnitsMax (800)
    assert refused.status_code == 429, refused.text
    assert refused.headers["retry-after"] == "60"
    assert "reservationUnitsMax" in refused.text
    assert pair.account()["spent"] == 30
