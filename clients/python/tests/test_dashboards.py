"""Every metric dashboards/ names (the Grafana dashboard and the alert
rules) is one the running services export: scraped from a real central
service's and agent's /metrics, so a renamed metric fails here, not in an
operator's empty panel."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
from cluster import Cluster
from conftest import Pair

DASHBOARDS = Path(__file__).resolve().parents[3] / "dashboards"
METRIC = re.compile(r"\breservoir_[a-z_]+")
#: Series a histogram exports besides its name.
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def exported(text: str) -> set[str]:
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
    return names


def test_every_metric_the_dashboards_name_is_exported(cluster: Cluster, pair: Pair) -> None:
    agent = cluster.agents[0]
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(agent.socket)), timeout=10) as http:
        agent_metrics = http.get("http://agent/metrics").text
    names = exported(cluster.metrics()) | exported(agent_metrics)

    used = set()
    for path in (DASHBOARDS / "reservoir.json", DASHBOARDS / "alerts.yml"):
        for name in METRIC.findall(path.read_text()):
            for suffix in HISTOGRAM_SUFFIXES:
                if name.endswith(suffix) and name.removesuffix(suffix) in names:
                    name = name.removesuffix(suffix)
            used.add(name)

    assert used, "the dashboards name no metric"
    assert used <= names, f"named in dashboards/ but not exported: {sorted(used - names)}"
