"""docker-compose.yml, the Dockerfile and the Grafana provisioning stay consistent with the
code: every KESTREL_* variable they set is a real setting, every mounted path exists, and the
scrape target matches the port the image serves metrics on."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from kestrel.config import KNOBS

ROOT = Path(__file__).resolve().parents[2]
ENVS = {k.env for k in KNOBS}


def compose() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def test_compose_sets_only_real_settings() -> None:
    used = set()
    for service in compose()["services"].values():
        used |= {k for k in (service.get("environment") or {}) if k.startswith("KESTREL_")}
    dockerfile = (ROOT / "Dockerfile").read_text()
    used |= set(re.findall(r"(KESTREL_[A-Z_]+)=", dockerfile))
    assert used and used <= ENVS, used - ENVS


def test_compose_has_the_whole_stack_and_mounted_paths_exist() -> None:
    services = compose()["services"]
    assert {"postgres", "pgbouncer", "runtime", "prometheus", "grafana"} <= set(services)
    assert services["pgbouncer"]["environment"]["POOL_MODE"] == "transaction"
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), source


def test_prometheus_scrapes_the_port_the_image_serves() -> None:
    port = re.search(r"KESTREL_METRICS_PORT=(\d+)", (ROOT / "Dockerfile").read_text())
    assert port is not None
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    assert scrape["scrape_configs"][0]["static_configs"][0]["targets"] == [
        f"runtime:{port.group(1)}"]


def test_grafana_provisions_the_dashboard_from_the_mounted_folder() -> None:
    providers = yaml.safe_load(
        (ROOT / "grafana/provisioning/dashboards/kestrel.yml").read_text())["providers"]
    mounted = [v for v in compose()["services"]["grafana"]["volumes"]
               if v.startswith("./grafana/dashboards")]
    assert mounted and mounted[0].split(":")[1] == providers[0]["options"]["path"]
    dash = json.loads((ROOT / "grafana/dashboards/kestrel.json").read_text())
    datasource = yaml.safe_load(
        (ROOT / "grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = datasource["datasources"][0]["uid"]
    assert dash["panels"] and all(p["datasource"]["uid"] == uid for p in dash["panels"])
