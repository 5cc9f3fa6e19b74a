"""Concurrency keys and tags (issue 42, items 1 and 3) on the cluster: a keyed queue's limits
across a namespace whose buckets live on both worker nodes (its claim walks keys with a
recursive statement the bucket's node runs), and tags found, changed by the workflow
(ctx.set_tags: merge_tags() inside an UPDATE the tenant's node runs) and acted on by tag,
live and in history, through the coordinator."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kestrel import buckets
from kestrel.client import SyncClient
from kestrel.migrate import migrate_namespace
from kestrel.types import Match
from tests.citus.conftest import sharding_dsn
from tests.citus.test_tenants import node_of
from tests.helpers import ROOT, drop_schemas, runtime, wait_until
from tests.http_helpers import free_port, make_token, serve_process
from tests.integration.test_concurrency_keys import keyed_limits_hold
from tests.ui_helpers import Browserless

N = 3


@pytest.fixture
def spread(citus_dsn: str) -> Iterator[str]:
    name = f"ck_{uuid.uuid4().hex[:12]}"
    migrate_namespace(sharding_dsn(citus_dsn), name, buckets=N)
    yield name
    drop_schemas(citus_dsn, buckets.schemas(name, N))


def test_per_key_limits_hold_across_a_namespace_on_both_nodes(
        citus_dsn: str, spread: str, tmp_path: Path) -> None:
    names = buckets.schemas(spread, N)
    assert len({node_of(citus_dsn, n) for n in names}) == 2, "the buckets share one node"
    keyed_limits_hold(citus_dsn, spread, names, tmp_path, procs=N)


def test_tags_are_found_changed_and_acted_on_through_the_coordinator(
        citus_dsn: str, tenant: str, tmp_path: Path) -> None:
    client = SyncClient(citus_dsn, schema=tenant, pool_size=1)
    moved = [client.submit("retag", f"s{i}", tags={"customer": "acme", "env": "prod"}).id
             for i in range(3)]
    kept = [client.submit("waiter", tags={"customer": "acme", "env": "dev"}).id
            for _ in range(2)]
    assert {e.id for e in client.list(tags={"customer": "acme"}, limit=50)} == {*moved, *kept}
    with runtime(citus_dsn, tenant, procs=1, log=tmp_path / "runtime.log"):
        wait_until(lambda: all(client.get(e).status.value == "completed" for e in moved),
                   timeout=60, what="the retagged executions")
    # set_tags ran on the tenant's node: the customer tag is gone, the stage is there, and
    # history (they finished) answers the filter.
    assert [client.get(e).tags for e in moved] == [{"env": "prod", "stage": f"s{i}"}
                                                  for i in range(3)]
    assert {e.id for e in client.list(tags={"env": "prod"}, limit=50)} == set(moved)
    assert {e.id for e in client.list(tags={"customer": "acme"}, limit=50)} == set(kept)
    done = client.bulk("cancel", Match(tags={"customer": "acme", "env": "dev"}), page_size=1)
    assert (done.matched, done.acted) == (2, 2)
    assert {client.get(e).status.value for e in kept} == {"cancelled"}


def test_the_web_ui_logs_in_and_lists_through_the_coordinator(
        citus_dsn: str, tenant: str, tmp_path: Path) -> None:
    """A login stores its session with INSERT … VALUES after asking whether the token is
    live: the INSERT … SELECT it was reached the tenant's node with an empty qual (`( IS NOT
    NULL)`, a syntax error there) and every login to the web UI on Citus answered 500."""
    client = SyncClient(citus_dsn, schema=tenant, pool_size=1)
    eid = client.submit("waiter", tags={"customer": "acme"}).id
    token = make_token(citus_dsn, tenant, "ops", "read,operate")
    with serve_process(citus_dsn, tenant, port=free_port(), log=tmp_path / "serve.log") as api:
        ui = Browserless(api)
        ui.login(token)
        page = ui.get("/ui/?tag=customer:acme")
        assert page.status == 200 and str(eid).encode() in page.body
        revoked = subprocess.run(
            [sys.executable, "-m", "kestrel", "token", "revoke", "ops", "--dsn", citus_dsn,
             "--schema", tenant], capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert revoked.returncode == 0, revoked.stderr
        assert ui.get("/ui/").status in (302, 303, 401)  # the session went with its token
        again = ui.post_form("/ui/login", {"token": token, "next": "/ui/"})
        assert again.status == 401, again.body
