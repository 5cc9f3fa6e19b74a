"""docker-compose.yml, the Dockerfile and the Grafana provisioning stay consistent with the
code: every KESTREL_* variable they set is a real setting, every mounted path exists, and the
scrape target matches the port the image serves metrics on."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
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
    # The dashboard names no data source: its $datasource variable picks the default one,
    # which the provisioned Prometheus is.
    assert datasource["datasources"][0]["isDefault"] is True
    assert datasource["datasources"][0]["type"] == "prometheus"
    assert dash["panels"] and all(p["datasource"]["uid"] == "${datasource}"
                                  for p in dash["panels"])


# -- the image and the "your own layer" recipe (there is no Docker engine here: the Dockerfile
# is read as Docker reads it, and the arguments go through the real argument parser) --------


def _instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of a Dockerfile, continuation lines joined, comments out."""
    joined = re.sub(r"\\\n\s*", " ", "\n".join(
        line for line in text.splitlines() if not line.lstrip().startswith("#")))
    found = []
    for line in joined.splitlines():
        if line.strip():
            word, _, rest = line.strip().partition(" ")
            found.append((word.upper(), rest.strip()))
    return found


def _recipes() -> list[str]:
    """The user-layer recipes the project documents: the Dockerfile's header comment and the
    README quick-start's dockerfile block."""
    header = [line[1:].strip() for line in (ROOT / "Dockerfile").read_text().splitlines()
              if line.startswith("#   ")]
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- quickstart:dockerfile -->\n```dockerfile\n(.*?)```", readme,
                      re.DOTALL)
    assert block is not None, "the README quick-start lost its dockerfile block"
    return ["\n".join(header), block.group(1)]


def _image() -> dict[str, object]:
    image: dict[str, object] = {"env": {}, "workdir": "/"}
    for word, rest in _instructions((ROOT / "Dockerfile").read_text()):
        if word == "ENTRYPOINT":
            image["entrypoint"] = json.loads(rest)
        elif word == "CMD":
            image["cmd"] = json.loads(rest)
        elif word == "WORKDIR":
            image["workdir"] = rest
        elif word == "ENV":
            image["env"].update(re.findall(r"(\w+)=(\S+)", rest))  # type: ignore[attr-defined]
        elif word == "RUN" and "pip install" in rest:
            image["pip"] = rest
    return image


def _parses(argv: list[str]) -> None:
    from kestrel import cli

    ns = cli.build_parser().parse_args(argv)  # argparse exits 2 on 'invalid choice'
    assert (ns.command or "run") == "run"


def test_the_image_runs_kestrel_runtime_with_its_cmd_as_arguments() -> None:
    image = _image()
    assert image["entrypoint"] == ["kestrel-runtime"]
    cmd = image["cmd"]
    assert isinstance(cmd, list) and cmd[0] != "kestrel-runtime"
    _parses(cmd)
    # The image serves production: the embedded PostgreSQL (an extra) is not installed.
    assert "pip install --no-cache-dir ." in str(image["pip"])
    assert "embedded" not in str(image["pip"])


@pytest.mark.parametrize("which", ["Dockerfile header", "README quick-start"])
def test_the_documented_user_layer_runs_and_imports_its_app(which: str) -> None:
    recipe = _recipes()[["Dockerfile header", "README quick-start"].index(which)]
    steps = _instructions(recipe)
    assert steps[0] == ("FROM", "kestrel-runtime")
    [cmd] = [json.loads(rest) for word, rest in steps if word == "CMD"]
    # CMD must not repeat the entrypoint: kestrel-runtime kestrel-runtime … is refused.
    assert cmd[0] != "kestrel-runtime", cmd
    _parses(cmd)
    app = cmd[cmd.index("--app") + 1]
    image = _image()
    roots = {image["workdir"], *str(image["env"].get("PYTHONPATH", "")).split(":")}  # type: ignore[attr-defined]
    assert "/app" in roots
    # Each --app module lies under /app where the recipe copies it.
    copied = [rest.split()[-1] for word, rest in steps if word == "COPY"]
    for module in app.split(","):
        top = module.split(".")[0]
        assert any(dest.rstrip("/") in (f"/app/{top}", "/app") for dest in copied), (
            module, copied)


def test_the_recipes_check_would_catch_the_old_mistakes() -> None:
    """The checks above fail on what the recipe used to say (issue 18)."""
    old = _instructions('FROM kestrel-runtime\nCOPY myapp/ /app/myapp/\n'
                        'CMD ["kestrel-runtime", "--app", "myapp.workflows", "--procs", "4"]\n')
    [cmd] = [json.loads(rest) for word, rest in old if word == "CMD"]
    with pytest.raises(SystemExit):
        _parses(cmd)


def test_the_proxy_profile_serves_the_tested_nginx_file_in_front_of_the_runtimes_door() -> None:
    proxy = compose()["services"]["proxy"]
    assert proxy["profiles"] == ["proxy"]
    [mount] = proxy["volumes"]
    assert mount.startswith("./deploy/nginx/kestrel.conf.template:/etc/nginx/templates/")
    runtime = compose()["services"]["runtime"]
    port = runtime["command"][runtime["command"].index("--http-port") + 1]
    assert proxy["environment"]["DOOR_UPSTREAM"] == f"runtime:{port}"
    template = (ROOT / "deploy" / "nginx" / "kestrel.conf.template").read_text()
    assert set(re.findall(r"\$\{(\w+)\}", template)) == set(proxy["environment"])
    # Behind one address (the proxy's, Docker's gateway) a cap per address would cap all.
    assert runtime["environment"]["KESTREL_HTTP_MAX_CONNECTIONS_PER_CLIENT"] == "0"


def test_the_dashboard_command_prints_the_dashboard_grafana_provisions(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 43 item 7: the dashboard was only in the repository, not in an install."""
    from kestrel.cli import main

    assert main(["dashboard"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads((ROOT / "grafana/dashboards/kestrel.json").read_text())
