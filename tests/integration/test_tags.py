"""Tags (issue 42, item 3): ``submit(…, tags={…})`` and ``ctx.set_tags(…)``, found by tag.

An execution's tags are kept when it finishes (history), brought back by a retry and copied
by a fork; ``ctx.set_tags`` changes them during a run, fenced and idempotent (a replay after
a crash sets the same tags again). Every list finds by tag, live and finished, through the
tags' GIN index: the client, the CLI (``list --tag``), the HTTP list (``?tag=NAME:VALUE``),
the web UI's filter and every bulk action. Every door refuses a bad tag before anything is
written or read."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql as pgsql

import kestrel
from kestrel import buckets, failpoints
from kestrel.client import SyncClient
from kestrel.errors import ConfigError, SerializationError, StepFailed
from kestrel.sql import queries
from kestrel.statements.stmt import tagged as tag_filtered
from kestrel.testing import KestrelTestEnv
from kestrel.types import Match, StepWrite
from tests.apps import ledger_app as app
from tests.helpers import ROOT, config, finished_count, plan_of, q, q1, run_worker_until
from tests.http_helpers import free_port, make_token, serve_process

# -- workflows --------------------------------------------------------------------------------


@kestrel.workflow(name="tags.tagger")
async def tagger(ctx: kestrel.Context, stage: str) -> str:
    """Moves its tags on during the run: drops "customer", sets "stage" twice."""
    await ctx.set_tags(stage="started", customer=None)
    await ctx.step(app.add, 1, 2)
    await ctx.set_tags({"stage": stage}, env="prod")
    return stage


@kestrel.workflow(name="tags.refused")
async def refused(ctx: kestrel.Context) -> list[str]:
    """Every bad set_tags is refused where it is called, before anything is sent; past 32
    tags in all, the database refuses it (a failed step) and the tags stay as they were."""
    seen = []
    for bad in ({"bad name": "x"}, {"'; DROP TABLE x; --": "x"}, {"v": "\x00"},
                {"v": "\ud800"}, {"v": "x" * 257}, {"v": ""}, {"v": 5},
                {f"t{i}": "x" for i in range(33)}, ["not", "a", "mapping"]):
        try:
            await ctx.set_tags(bad)  # type: ignore[arg-type]
        except (ConfigError, SerializationError) as exc:
            seen.append(type(exc).__name__)
    try:
        await ctx.set_tags(one_too_many="x")
    except StepFailed as exc:
        seen.append(f"{exc.error_type}: {exc.error_message}")
    return seen


# -- helpers ----------------------------------------------------------------------------------


def cli(dsn: str, schema: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kestrel", *args, "--dsn", dsn, "--schema",
                           schema], capture_output=True, text=True, cwd=ROOT, timeout=120)


def count_all(dsn: str, schema: str) -> int:
    return int(q1(dsn, schema, "SELECT (SELECT count(*) FROM {s}.workflow_executions) + "
                               "(SELECT count(*) FROM {s}.workflow_history)"))


def ids(rows: Any) -> set[uuid.UUID]:
    return {r.id for r in rows}


HOSTILE: list[Any] = [
    {"bad name": "x"},                       # a space in a name
    {"'; DROP TABLE workflow_executions; --": "x"},
    {"": "x"},                               # an empty name
    {"n" * 65: "x"},                         # a name too long
    {"v": "\x00"},                           # NUL
    {"v": "a\ud800"},                        # a lone surrogate
    {"v": "x" * 257},                        # a value too long
    {"v": ""},                               # an empty value
    {"v": 5},                                # not text
    {"v": None},                             # not text (only set_tags removes with None)
    {f"t{i}": "x" for i in range(33)},       # too many
    ["customer", "acme"],                    # not an object
    "customer=acme",                         # not an object
]


@pytest.fixture
def tagged(pg_dsn: str, schema: str) -> dict[str, uuid.UUID]:
    """Four executions of three_steps: acme in prod and dev, globex, and one untagged."""
    client = SyncClient(pg_dsn, schema=schema, pool_size=1)
    return {
        "acme-prod": client.submit("three_steps", 1,
                                   tags={"customer": "acme", "env": "prod"}).id,
        "acme-dev": client.submit("three_steps", 2, tags={"customer": "acme", "env": "dev"},
                                  concurrency_key="acme").id,
        "globex": client.submit("three_steps", 3,
                                tags={"customer": "globex", "sql": "x'); DROP TABLE t; --"}).id,
        "none": client.submit("three_steps", 4).id,
    }


# -- the client: live, then in history --------------------------------------------------------


def test_the_client_finds_by_tag_live_and_after_the_executions_finished(
        pg_dsn: str, schema: str, tagged: dict[str, uuid.UUID]) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=1)

    def check() -> None:
        assert ids(client.list(tags={"customer": "acme"})) == {tagged["acme-prod"],
                                                               tagged["acme-dev"]}
        assert ids(client.list(tags={"customer": "acme", "env": "prod"})) == {
            tagged["acme-prod"]}
        assert ids(client.list(tags={"sql": "x'); DROP TABLE t; --"})) == {tagged["globex"]}
        assert client.list(tags={"customer": "nobody"}) == []
        assert client.list(tags={"customer": "acme", "env": "staging"}) == []
        assert ids(client.list(tags={})) == ids(client.list()) == set(tagged.values())
        assert ids(client.list(tags={"customer": "acme"}, status="completed")) <= {
            tagged["acme-prod"], tagged["acme-dev"]}

    check()
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) >= 4,
                     timeout=60)
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workflow_executions") == 0
    check()  # the same answers from history
    ex = client.get(tagged["acme-dev"])
    assert (ex.status.value, ex.tags, ex.concurrency_key) == (
        "completed", {"customer": "acme", "env": "dev"}, "acme")
    assert client.get(tagged["none"]).tags is None
    assert [r.tags for r in client.list(tags={"env": "prod"})] == [
        {"customer": "acme", "env": "prod"}]


def test_retry_brings_the_tags_back_and_a_fork_copies_them(pg_dsn: str, schema: str) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=1)
    eid = client.submit("waiter", tags={"customer": "acme"}, concurrency_key="k").id
    assert client.cancel(eid) == "cancelled"
    assert client.get(eid).tags == {"customer": "acme"}  # in history
    client.retry(eid)
    back = client.get(eid)
    assert (back.status.value, back.tags, back.concurrency_key) == (
        "queued", {"customer": "acme"}, "k")
    fork = client.fork(eid, 0).id
    assert client.get(fork).tags == {"customer": "acme"}
    assert ids(client.list(tags={"customer": "acme"})) == {eid, fork}


# -- ctx.set_tags -----------------------------------------------------------------------------


def test_set_tags_during_a_run_changes_what_the_filter_finds(pg_dsn: str, schema: str) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=1)
    eid = client.submit(tagger, "shipped", tags={"customer": "acme", "stage": "new"}).id
    assert ids(client.list(tags={"customer": "acme"})) == {eid}
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) >= 1,
                     timeout=60)
    assert client.result(eid, timeout=5) == "shipped"
    assert client.get(eid).tags == {"stage": "shipped", "env": "prod"}
    assert client.list(tags={"customer": "acme"}) == []
    assert client.list(tags={"stage": "new"}) == []
    assert ids(client.list(tags={"stage": "shipped", "env": "prod"})) == {eid}
    steps = [(s.name, s.output) for s in client.steps(eid)]
    assert steps[0] == ("kestrel.set_tags", {"tags": {"stage": "started", "customer": None}})
    assert steps[2] == ("kestrel.set_tags", {"tags": {"stage": "shipped", "env": "prod"}})


def test_set_tags_refuses_bad_tags_before_sending_anything(pg_dsn: str, schema: str) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=1)
    full = {f"t{i}": "x" for i in range(32)}
    eid = client.submit(refused, tags=full).id
    run_worker_until(pg_dsn, config(schema), lambda: finished_count(pg_dsn, schema) >= 1,
                     timeout=60)
    seen = client.result(eid, timeout=5)
    assert seen[:9] == ["ConfigError", "ConfigError", "SerializationError",
                        "SerializationError", "SerializationError", "SerializationError",
                        "SerializationError", "ConfigError", "ConfigError"]
    assert "ConfigError: at most 32 tags, got 33" in seen[9], seen
    assert client.get(eid).tags == full  # unchanged
    # Only the refused merge took a position: the others never reached a step.
    assert [s.name for s in client.steps(eid)] == ["kestrel.set_tags"]


def test_set_tags_replayed_after_a_crash_is_harmless(kestrel_env: KestrelTestEnv) -> None:
    """The worker dies after its merge committed and before the step's checkpoint did (the
    checkpoint is taken back as it commits, then the worker halts, as a SIGKILL between the
    two would leave it): the next worker re-runs the workflow, which merges the same changes
    again, and records each set_tags once."""
    dsn, schema = kestrel_env.dsn, kestrel_env.schema

    def lose_checkpoint(writes: list[StepWrite]) -> bool:
        lost = [w for w in writes if w.name == "kestrel.set_tags" and w.step_id == 0]
        for w in lost:
            q(dsn, schema, "DELETE FROM {s}.operation_outputs WHERE execution_id = %s "
                           "AND step_id = 0", (w.execution_id,))
        return bool(lost)

    failpoints.arm("after_checkpoint_commit_before_ack", "halt", match=lose_checkpoint)
    run = kestrel_env.run_to_completion(tagger, "replayed", tags={"customer": "acme"})
    assert run.assert_completed() == "replayed"
    assert run.crashes == 1
    assert [(s.name, s.lease_epoch) for s in run.steps] == [
        ("kestrel.set_tags", 2), ("add", 2), ("kestrel.set_tags", 2)]
    assert kestrel_env.client.get(run.id).tags == {"stage": "replayed", "env": "prod"}


# -- hostile input at every door --------------------------------------------------------------


@pytest.mark.parametrize("bad", HOSTILE, ids=range(len(HOSTILE)))
def test_the_client_refuses_bad_tags_before_anything_is_written_or_read(
        pg_dsn: str, schema: str, bad: Any) -> None:
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    with pytest.raises((ConfigError, SerializationError)):
        client.submit("three_steps", 1, tags=bad)
    with pytest.raises((ConfigError, SerializationError)):
        client.list(tags=bad)
    with pytest.raises((ConfigError, SerializationError)):
        client.bulk("cancel", Match(tags=bad))
    assert count_all(pg_dsn, schema) == 0


@pytest.mark.parametrize(("args", "says"), [
    (["--tag", "customer"], "use NAME=VALUE"),
    (["--tag", "bad name=x"], "invalid tag name"),
    (["--tag", "'; DROP TABLE x; --=x"], "invalid tag name"),
    (["--tag", "v="], "must not be empty"),
    (["--tag", "v=" + "x" * 257], "256"),
    (["--tag", "v=a\udc80"], "surrogate"),
    (["--tag", "a=1", "--tag", "a=2"], "given twice"),
    ([arg for i in range(33) for arg in ("--tag", f"t{i}=x")], "at most 32"),
])
def test_the_cli_refuses_bad_tags_with_one_line_and_an_exit_code(
        pg_dsn: str, schema: str, tagged: dict[str, uuid.UUID], args: list[str],
        says: str) -> None:
    for command in (["list"], ["cancel"], ["submit", "three_steps", "--args", "[1]"]):
        out = cli(pg_dsn, schema, *command, *args)
        assert out.returncode == 1, (command, out.returncode, out.stderr)
        assert says.lower() in out.stderr.lower(), (command, out.stderr)
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert count_all(pg_dsn, schema) == 4
    assert {r[0] for r in q(pg_dsn, schema, "SELECT status FROM {s}.workflow_executions")} \
        == {"queued"}


def test_the_cli_lists_shows_and_cancels_by_tag(
        pg_dsn: str, schema: str, tagged: dict[str, uuid.UUID]) -> None:
    out = cli(pg_dsn, schema, "list", "--tag", "customer=acme", "--json")
    assert out.returncode == 0, out.stderr
    assert {r["id"] for r in json.loads(out.stdout)} == {
        str(tagged["acme-prod"]), str(tagged["acme-dev"])}
    both = cli(pg_dsn, schema, "list", "--tag", "customer=acme", "--tag", "env=dev", "--json")
    assert [r["tags"] for r in json.loads(both.stdout)] == [{"customer": "acme", "env": "dev"}]
    nothing = cli(pg_dsn, schema, "list", "--tag", "customer=x' OR '1'='1", "--json")
    assert json.loads(nothing.stdout) == []
    shown = cli(pg_dsn, schema, "show", str(tagged["acme-dev"]))
    assert '"customer": "acme"' in shown.stdout and '"env": "dev"' in shown.stdout
    assert 'concurrency key "acme"' in shown.stdout
    shown_json = json.loads(cli(pg_dsn, schema, "show", str(tagged["globex"]), "--json").stdout)
    assert shown_json["tags"] == {"customer": "globex", "sql": "x'); DROP TABLE t; --"}

    dry = cli(pg_dsn, schema, "cancel", "--tag", "customer=acme", "--dry-run", "--json")
    assert json.loads(dry.stdout)["matched"] == 2
    done = cli(pg_dsn, schema, "cancel", "--tag", "customer=acme", "--json")
    assert done.returncode == 0, done.stderr
    assert (json.loads(done.stdout)["acted"], json.loads(done.stdout)["matched"]) == (2, 2)
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    assert {k: client.get(v).status.value for k, v in tagged.items()} == {
        "acme-prod": "cancelled", "acme-dev": "cancelled", "globex": "queued",
        "none": "queued"}
    # In history now: a retry by tag finds them there, and only them.
    retried = cli(pg_dsn, schema, "retry", "--tag", "env=prod", "--json")
    assert json.loads(retried.stdout)["acted"] == 1
    assert client.get(tagged["acme-prod"]).status.value == "queued"
    assert client.get(tagged["acme-dev"]).status.value == "cancelled"


def test_the_http_list_bulk_and_ui_filter_by_tag_and_refuse_bad_tags(
        pg_dsn: str, schema: str, tagged: dict[str, uuid.UUID], tmp_path: Path) -> None:
    from tests.ui_helpers import Browserless

    reader = make_token(pg_dsn, schema, "rita", "read")
    operator = make_token(pg_dsn, schema, "ops", "read,operate")
    with serve_process(pg_dsn, schema, port=free_port(), log=tmp_path / "serve.log",
                       app="tests.apps.ledger_app") as api:
        api.token = reader

        def listed(query: str) -> set[str]:
            got = api.get(f"/api/v1/executions?{query}")
            assert got.status == 200, (query, got.body)
            return {r["id"] for r in got.json()["executions"]}

        acme = {str(tagged["acme-prod"]), str(tagged["acme-dev"])}
        assert listed("tag=customer:acme") == acme
        assert listed("tag=customer:acme&tag=env:prod") == {str(tagged["acme-prod"])}
        assert listed("tag=customer:nobody") == set()
        assert listed("tag=sql:x%27%29%3B%20DROP%20TABLE%20t%3B%20--") == {str(tagged["globex"])}
        assert listed("limit=100") == {str(v) for v in tagged.values()}
        assert listed("tag=url:https://example.com/a?b=c") == set()  # a value holding ':'
        page = api.get("/api/v1/executions?tag=env:dev").json()["executions"]
        assert page[0]["tags"] == {"customer": "acme", "env": "dev"}
        one = api.get(f"/api/v1/executions/{tagged['acme-dev']}").json()
        assert (one["tags"], one["concurrency_key"]) == ({"customer": "acme", "env": "dev"},
                                                         "acme")
        assert api.get(f"/api/v1/executions/{tagged['none']}").json()["tags"] == {}

        many = "&".join(f"tag=t{i}:x" for i in range(33))
        for query, says in [
            ("tag=customer", "NAME:VALUE"), ("tag=", "NAME:VALUE"),
            ("tag=bad%20name:x", "invalid tag name"),
            ("tag=%27%3B%20DROP%20TABLE%20x%3B%20--:x", "invalid tag name"),
            ("tag=v:", "must not be empty"), ("tag=v:" + "x" * 257, "256"),
            ("tag=v:%00", "NUL"), ("tag=v:%ED%A0%80", "UTF-8"),
            ("tag=a:1&tag=a:2", "given twice"), (many, "at most 32"),
        ]:
            got = api.get(f"/api/v1/executions?{query}")
            assert got.status == 400, (query, got.status, got.body)
            assert says.lower() in got.body.decode().lower(), (query, got.body)

        # Bulk by tag: a dry run, bad tag filters refused, then a cancel of the tagged ones.
        api.token = operator
        path = "/api/v1/executions/bulk"
        body = {"action": "cancel", "filter": {"tags": {"customer": "acme"}}, "key": "t-1"}
        assert api.post(path, {**body, "dry_run": True}).json()["matched"] == 2
        for bad in ("customer:acme", ["customer"], {"customer": 5}, {"bad name": "x"},
                    {"v": "\x00"}, {"v": "x" * 257}, {f"t{i}": "x" for i in range(33)}):
            got = api.post(path, {**body, "filter": {"tags": bad}})
            assert got.status == 400, (bad, got.status, got.body)
        # No tag given is no filter: refused as every filterless bulk action is.
        assert api.post(path, {**body, "filter": {"tags": {}}}).status == 400
        assert {r[0] for r in q(pg_dsn, schema,
                                "SELECT status FROM {s}.workflow_executions")} == {"queued"}
        done = api.post(path, body)
        assert (done.status, done.json()["acted"]) == (200, 2), done.body

        # The web UI: the list's tag filter, the execution page's tags, select-all by tag.
        ops = Browserless(api)
        ops.login(operator)
        ui = ops.get("/ui/?tag=customer:globex").body.decode()
        assert str(tagged["globex"]) in ui and str(tagged["none"]) not in ui
        assert 'href="/ui/bulk/cancel?tag=customer%3Aglobex"' in ui
        assert ops.get("/ui/?tag=customer").status == 400
        assert ops.get("/ui/?tag=bad%20name:x").status == 400
        assert ops.get("/ui/?tag=v:%00").status == 400
        shown = ops.get(f"/ui/executions/{tagged['globex']}").body.decode()
        assert 'id="tags"' in shown and "customer: globex" in shown
        assert "x&#39;); DROP TABLE t; --" in shown  # escaped, never markup
        page = ops.get("/ui/bulk/cancel?tag=customer:globex")
        assert "<strong>1</strong> execution(s) match now" in page.body.decode()
        form = {"csrf": ops.csrf(page), "key": "g" * 32, "tag": "customer:globex"}
        acted = ops.post_form("/ui/bulk/cancel", form).body.decode()
        assert "<strong>1</strong> cancelled of 1 matched" in acted
        assert ops.get("/ui/bulk/cancel?tag=nocolon").status == 400
    client = SyncClient(pg_dsn, schema=schema, pool_size=0)
    assert client.get(tagged["none"]).status.value == "queued"


# -- a namespace of buckets -------------------------------------------------------------------


def test_tags_are_found_and_acted_on_in_every_bucket(pg_dsn: str, namespace: str) -> None:
    client = SyncClient(pg_dsn, schema=namespace, pool_size=1)
    acme = [client.submit("waiter", tags={"customer": "acme"}).id for _ in range(20)]
    others = [client.submit("waiter", tags={"customer": "globex"}).id for _ in range(5)]
    assert len({buckets.bucket_of(eid, 3) for eid in acme}) > 1
    assert ids(client.list(tags={"customer": "acme"}, limit=100)) == set(acme)
    done = client.bulk("cancel", Match(tags={"customer": "acme"}), page_size=7)
    assert (done.matched, done.acted) == (20, 20)
    assert {client.get(e).status.value for e in acme} == {"cancelled"}
    assert {client.get(e).status.value for e in others} == {"queued"}
    # Finished now, in each bucket's history: still found by tag.
    assert ids(client.list(tags={"customer": "acme"}, status="cancelled", limit=100)) == \
        set(acme)


# -- the plans: a filter by tag is an index lookup, live and in history -----------------------


def _nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    return [plan, *(n for child in plan.get("Plans", []) for n in _nodes(child))]


@pytest.mark.parametrize("generic", [False, True], ids=["custom", "generic"])
def test_a_filter_by_tag_reads_the_tags_index_live_and_in_history(
        pg_dsn: str, schema: str, generic: bool) -> None:
    """Also in the generic plan a prepared statement settles on after five runs (the
    statement with a tag filter says only ``tags @> …``: statements.stmt.tagged)."""
    q(pg_dsn, schema, """
        INSERT INTO {s}.workflow_executions (id, workflow, queue, args, status, tags)
        SELECT gen_random_uuid(), 'wf', 'default', '[]', 'queued',
               CASE WHEN i %% 1000 = 0 THEN '{{"customer": "acme"}}'::jsonb
                    WHEN i %% 2 = 0 THEN jsonb_build_object('customer', 'c' || i) END
          FROM generate_series(1, %s) AS i""", [20000])
    q(pg_dsn, schema, """
        INSERT INTO {s}.workflow_history (id, workflow, queue, priority, status, args,
                                          lease_epoch, attempts, created_at, finished_at, tags)
        SELECT gen_random_uuid(), 'wf', 'default', 0, 'completed', '[]', 1, 1, now(), now(),
               CASE WHEN i %% 1000 = 0 THEN '{{"customer": "acme"}}'::jsonb
                    WHEN i %% 2 = 0 THEN jsonb_build_object('customer', 'c' || i) END
          FROM generate_series(1, %s) AS i""", [20000])
    q(pg_dsn, schema, "ANALYZE {s}.workflow_executions")
    q(pg_dsn, schema, "ANALYZE {s}.workflow_history")
    filters = {"status": None, "workflow": None, "queue": None, "since": None, "until": None,
               "app_version": None, "patch": None, "with_patch": True,
               "tags": '{"customer": "acme"}', "after_at": None, "after_id": None,
               "limit": 50}
    named = queries(schema)
    with psycopg.connect(pg_dsn, prepare_threshold=None) as conn:
        counted = tag_filtered(named.count_executions, "{}")
        for text in (tag_filtered(named.page_executions, "{}"), counted,
                     tag_filtered(named.list_executions, "{}")):
            nodes = _nodes(plan_of(conn, text, filters, generic=generic))
            read = {n.get("Index Name", "") for n in nodes}
            assert "workflow_executions_tags_idx" in read, (text[:40], read)
            assert any(i.startswith("workflow_history") and "tags" in i for i in read), read
            # No table with rows is read whole (an empty partition may be: it costs nothing).
            seq = [n["Relation Name"] for n in nodes if "Seq" in n["Node Type"]]
            assert not [r for r in seq if q1(pg_dsn, schema, f"SELECT count(*) FROM {{s}}.{r}")
                        ], seq
            # And the answer: the 20 tagged live rows and the 20 in history.
            found = conn.execute(pgsql.SQL(text), filters).fetchall()  # type: ignore[arg-type]
            assert (found[0][0] if text is counted else len(found)) == 40
