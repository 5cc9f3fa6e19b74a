"""grafana/dashboards/kestrel.json is importable into any Grafana and filters by workflow and
queue: no data source is named (a ``$datasource`` variable), ``$workflow`` and ``$queue``
reach every query whose metric has those labels, rates use ``$__rate_interval``, and each
panel shows one quantity. tests/integration/test_metrics.py runs every query against a real
Prometheus."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = json.loads((ROOT / "grafana" / "dashboards" / "kestrel.json").read_text())
PANELS = DASHBOARD["panels"]
METRIC = re.compile(r"\b(kestrel_[a-z_]+?)(?:_bucket|_sum|_count)?(?=[{\[\s)])")


def labels_of_metrics() -> dict[str, set[str]]:
    """Every exported metric family name (as a query names it) and its labels."""
    from kestrel import metrics

    found: dict[str, set[str]] = {}
    # The process's own metrics: a second Metrics() would register every name twice when
    # an earlier test of the same run (an in-process worker) already made them.
    for metric in vars(metrics.get()).values():
        name = metric._name
        if type(metric).__name__ == "Counter":
            name += "_total"
        found[name] = set(metric._labelnames)
    return found


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    return labels_of_metrics()


def walk(node: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield key, value
            yield from walk(value)
    elif isinstance(node, list):
        for item in node:
            yield from walk(item)


def exprs(panel: dict[str, Any]) -> list[str]:
    return [t["expr"] for t in panel["targets"]]


def test_no_data_source_is_named_anywhere() -> None:
    [variable] = [v for v in DASHBOARD["templating"]["list"] if v["name"] == "datasource"]
    assert variable["type"] == "datasource" and variable["query"] == "prometheus"
    sources = [value for key, value in walk(DASHBOARD) if key == "datasource"]
    assert len(sources) > len(PANELS)
    assert all(s == {"type": "prometheus", "uid": "${datasource}"} for s in sources), sources
    assert "__inputs" not in DASHBOARD  # nothing to map on import


def test_the_workflow_and_queue_variables_list_real_label_values(
    exported: dict[str, set[str]],
) -> None:
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    for name in ("workflow", "queue"):
        v = variables[name]
        assert v["type"] == "query" and v["includeAll"] and v["multi"] and v["allValue"] == ".*"
        match = re.fullmatch(r"label_values\((kestrel_\w+), (\w+)\)", v["query"]["query"])
        assert match is not None and match.group(2) == name
        assert name in exported[match.group(1)]


def test_every_query_filters_by_the_labels_its_metric_has(
    exported: dict[str, set[str]],
) -> None:
    for panel in PANELS:
        for expr in exprs(panel):
            names = set(METRIC.findall(expr))
            assert names, expr
            for name in names:
                assert name in exported, f"{panel['title']}: {name} is not exported"
                for label in ("workflow", "queue"):
                    if label in exported[name]:
                        assert f'{label}=~"${label}"' in expr, (panel["title"], expr)


def test_rates_use_the_rate_interval() -> None:
    for panel in PANELS:
        for expr in exprs(panel):
            windows = re.findall(r"\b(?:rate|increase|irate)\([^\[]*\[([^\]]+)\]", expr)
            assert windows == ["$__rate_interval"] * len(windows), expr
            assert "rate(" not in expr or windows, expr


def test_one_quantity_per_panel(exported: dict[str, set[str]]) -> None:
    for panel in PANELS:
        assert panel["fieldConfig"]["overrides"] == [], panel["title"]
        unit = panel["fieldConfig"]["defaults"]["unit"]
        names = {n for e in exprs(panel) for n in METRIC.findall(e)}
        seconds = {n.endswith("_seconds") for n in names}
        assert len(seconds) == 1, (panel["title"], names)  # never time beside a count
        assert (unit == "s") == seconds.pop() or unit == "percentunit", panel["title"]
        # Several metrics in one panel measure one thing in one unit (batch sizes, statement
        # latencies): their names end alike.
        assert len({n.rsplit("_", 1)[-1] for n in names}) == 1, (panel["title"], names)


def test_the_failure_rate_and_waiting_for_approval_panels() -> None:
    by_title = {p["title"]: p for p in PANELS}
    failure = by_title["Failure rate: failed / finished"]
    [expr] = exprs(failure)
    assert 'outcome="failed"' in expr and " / " in expr
    assert failure["fieldConfig"]["defaults"]["unit"] == "percentunit"
    [waiting] = [p for t, p in by_title.items() if t.startswith("Waiting for approval")]
    [expr] = exprs(waiting)
    assert "kestrel_waiting_executions" in expr and "by (workflow, waiting_for)" in expr
    assert 'waiting_for!~"kestrel[.].*"' in expr  # signals only: not sleeps or children


def test_the_dashboard_is_a_complete_importable_model() -> None:
    ids = [p["id"] for p in PANELS]
    assert len(set(ids)) == len(ids)
    assert DASHBOARD["uid"] and DASHBOARD["title"] and DASHBOARD["schemaVersion"] >= 36
    cells = set()
    for p in PANELS:
        assert {"type", "title", "gridPos", "targets", "datasource"} <= set(p), p["title"]
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps another panel"
                cells.add((x, y))
        refs = [t["refId"] for t in p["targets"]]
        assert len(set(refs)) == len(refs)
