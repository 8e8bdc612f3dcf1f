"""The metric catalogue (router/metric_catalogue.py) is the one list of the router's
families: docs/metrics.md documents each of them as declared, the router exports
nothing else, and no module names a family outside it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from support.docs import DOCS

import router
from router.app import RouterApp
from router.config import Config
from router.metric_catalogue import FAMILIES, INDEX_EVICTIONS, Family

ROOT = Path(router.__file__).parent

#: The engine emulator's own families (an engine's, documented apart).
EMULATOR = "kvroute_emulator_"


def documented_rows() -> dict[str, tuple[str, set[str]]]:
    """Exported name -> (type, label names) of each row of docs/metrics.md."""
    rows = {}
    for name, kind, labels in re.findall(
        r"^\| `(kvroute_[a-z0-9_]+)` \| (\w+) \|([^|]*)\|",
        (DOCS / "metrics.md").read_text(),
        re.M,
    ):
        names = re.findall(r"`([a-z_]+)`", re.sub(r"\([^)]*\)", "", labels))
        rows[name] = (kind, set(names))
    return rows


def test_every_family_is_documented_with_its_type_and_labels() -> None:
    rows = documented_rows()
    for family in FAMILIES.values():
        assert family.exported in rows, f"{family.exported} is not in docs/metrics.md"
        assert rows[family.exported] == (family.kind, set(family.labels)), family.name


def test_every_documented_router_family_is_in_the_catalogue() -> None:
    exported = {f.exported for f in FAMILIES.values()}
    router_rows = {name for name in documented_rows() if not name.startswith(EMULATOR)}
    assert router_rows <= exported, router_rows - exported


#: What makes a family or an instrument (prometheus_client's, and the catalogue's own).
MAKERS = {
    "Counter",
    "Gauge",
    "Histogram",
    "Summary",
    "Info",
    "Enum",
    "Metric",
    "CounterMetricFamily",
    "GaugeMetricFamily",
    "HistogramMetricFamily",
    "SummaryMetricFamily",
    "InfoMetricFamily",
    "StateSetMetricFamily",
    "UnknownMetricFamily",
    "Family",
}


def _names_a_family(node: ast.AST) -> str | None:
    """The ``kvroute_*`` name a call making a family or an instrument passes, if any."""
    if not isinstance(node, ast.Call) or not node.args:
        return None
    func = node.func
    maker = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
    first = node.args[0]
    if isinstance(first, ast.JoinedStr) and first.values:
        first = first.values[0]
    if maker in MAKERS and isinstance(first, ast.Constant) and isinstance(first.value, str):
        return first.value if first.value.startswith("kvroute_") else None
    return None


def test_no_module_names_a_family_outside_the_catalogue() -> None:
    found = []
    for path in ROOT.rglob("*.py"):
        if path.name == "metric_catalogue.py" or "emulator" in path.relative_to(ROOT).parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (name := _names_a_family(node)) is not None:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    assert not found, found


def test_a_family_is_built_as_declared() -> None:
    evictions = INDEX_EVICTIONS.labelled([(("engine_cap",), 2)])
    assert isinstance(evictions, CounterMetricFamily)
    assert (evictions.name, evictions.documentation) == (INDEX_EVICTIONS.name, INDEX_EVICTIONS.help)
    assert [(s.name, s.labels, s.value) for s in evictions.samples] == [
        ("kvroute_index_evictions_total", {"reason": "engine_cap"}, 2)
    ]
    gauge = Family("kvroute_x", "gauge", "x").value(3)
    assert isinstance(gauge, GaugeMetricFamily) and gauge.samples[0].value == 3


def test_the_router_exports_only_catalogued_families_as_declared() -> None:
    config = Config.model_validate(
        {
            "engines": [{"url": "http://10.0.0.1:8000", "models": ["m"], "dp_size": 2}],
            "policy": {"name": "latency"},
            "flow": {"enabled": True, "prefill_isolation": True},
        }
    )
    exported = list(RouterApp(config).metrics.registry.collect())
    names = {metric.name for metric in exported}
    assert {"kvroute_requests", "kvroute_decisions", "kvroute_flow_waiting"} <= names
    assert {"kvroute_engine_healthy", "kvroute_engine_prefill_utilization"} <= names
    for metric in exported:
        family = FAMILIES[metric.name]
        assert (metric.type, metric.documentation) == (family.kind, family.help), metric.name
        for sample in metric.samples:
            assert set(sample.labels) - {"le"} == set(family.labels), sample
