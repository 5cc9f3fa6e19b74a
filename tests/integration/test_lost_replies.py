"""FAULTS R1, the lost-reply sweep: every statement may commit and lose its reply.

For every named statement of ``sql/queries`` the table :data:`SWEEP` holds either scenarios
that run real workflows (an in-process worker, the clients, the CLI's commands) with that
statement's reply lost once (``lost_reply:<name>``: it commits, then the connection dies),
or a classification with its reason: a read (checked to write nothing) or a test-kit
statement nobody retries. Each scenario asserts that the failpoint fired, that the real
caller's retry learned the committed outcome, and that every execution ended exactly once
with the model's result, nothing consumed into nothing and nothing done twice.

:func:`test_every_statement_is_in_the_sweep` fails when a statement is added without a row
here: a new statement has to show the property (or be a read) to get in.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from datetime import timedelta
from pathlib import Path
from typing import Any

import psycopg
import pytest

import kestrel
from kestrel import buckets, connections, db, failpoints, forms, metrics, statements
from kestrel.client import SyncClient
from kestrel.config import Config
from kestrel.errors import InvalidState
from kestrel.migrate import current_version, migrate, migrate_namespace
from kestrel.schedule import Cron, Schedule
from kestrel.services import Scheduler, Stats, Upkeep
from kestrel.sql import Queries, migrations, named_statements, queries
from kestrel.worker import Worker
from kestrel.workflow import registry
from tests.apps import ledger_app as app
from tests.helpers import config, finished_count, q, q1, take_lease

# A finished execution's signals left with it (archive_finished): read both tables.
ALL_SIGNALS = ("(SELECT id, payload, consumed_step FROM {s}.signals UNION ALL "
               "SELECT id, payload, consumed_step FROM {s}.signal_history) AS s")

# -- workflows only this sweep runs ----------------------------------------------------------

_FAILED_ONCE: set[str] = set()


@kestrel.step(name="sweep_fragile")
async def fragile(key: str) -> int:
    """Fails the first time it runs for *key* in this process, then returns 7."""
    app.ledger()
    if key not in _FAILED_ONCE:
        _FAILED_ONCE.add(key)
        raise RuntimeError("the first run fails")
    return 7


@kestrel.workflow(name="sweep_fails_once")
async def fails_once(ctx: kestrel.Context, key: str) -> int:
    return int(await ctx.step(fragile, key))


@kestrel.workflow(name="sweep_signaller")
async def signaller(ctx: kestrel.Context, target: str) -> str:
    """Sends one signal to *target* (ctx.signal: a keyed statement of the runtime)."""
    await ctx.signal(target, "go", "from a workflow")
    return "sent"


@kestrel.workflow(name="sweep_tagger")
async def tagger(ctx: kestrel.Context) -> str:
    """Changes its tags (ctx.set_tags: a fenced statement of the runtime) around a step."""
    await ctx.set_tags(stage="started", customer=None)
    await ctx.step(app.add, 1, 2)
    await ctx.set_tags({"stage": "done"})
    return "tagged"


KNOWS_PATCH = {"yes": False}
"""Whether sweep_patched's code has patch sweep-new (the give_back scenario flips it: the same
registry plays an old worker, then a new one)."""


@kestrel.workflow(name="sweep_patched")
async def patched(ctx: kestrel.Context, n: int) -> int:
    if KNOWS_PATCH["yes"] and await ctx.patched("sweep-new"):
        return n + 100
    return n


# -- the harness -----------------------------------------------------------------------------


@dataclass
class Env:
    """One scenario's database, client and ledger."""

    dsn: str
    schema: str
    ledger: Path

    @property
    def client(self) -> SyncClient:
        return SyncClient(self.dsn, schema=self.schema, pool_size=0)

    @property
    def q(self) -> Queries:
        return queries(self.schema)

    def cfg(self, **overrides: Any) -> Config:
        return config(self.schema, **overrides)

    def work(self, done: Callable[[], bool], *, timeout: float = 20.0, drain: float = 5.0,
             **overrides: Any) -> Worker:
        """Run one in-process worker until *done()*; what a runtime process would do."""

        async def main() -> Worker:
            worker = Worker(self.cfg(**overrides), registry(), dsn=self.dsn)
            task = asyncio.create_task(worker.run())
            deadline = asyncio.get_running_loop().time() + timeout
            try:
                while not await asyncio.to_thread(done):
                    if asyncio.get_running_loop().time() > deadline:
                        raise AssertionError(f"the work did not end within {timeout}s")
                    if task.done():
                        task.result()
                    await asyncio.sleep(0.05)
            finally:
                worker.stop(drain_timeout=drain)
                await task
            return worker

        return asyncio.run(main())

    def finished(self, n: int = 1) -> Callable[[], bool]:
        return lambda: finished_count(self.dsn, self.schema) >= n

    def history(self, eid: object) -> tuple[Any, ...]:
        rows = q(self.dsn, self.schema, "SELECT status, result, attempts FROM "
                 "{s}.workflow_history WHERE id = %s", (eid,))
        assert len(rows) == 1, rows
        return rows[0]

    def bodies(self, eid: object) -> list[int]:
        """Step ids whose body completed a run for *eid*, in order (the unfenced ledger)."""
        return [e["step_id"] for e in app.read_ledger(self.ledger, execution_id=str(eid),
                                                      kind="body")]

    def run_async(self, fn: Callable[[Any], Any]) -> Any:
        """Run ``fn(pool)`` on a connection pool of this schema's kind."""

        async def main() -> Any:
            pool = connections.make_pool(self.dsn, max_size=2, name="sweep", prepared=False)
            await pool.open()
            try:
                return await fn(pool)
            finally:
                await pool.close()

        return asyncio.run(main())


def lose(statement: str, *, times: int = 1, match: Callable[[Any], bool] | None = None) -> None:
    """Let *statement* commit and lose its reply, *times* times."""
    failpoints.arm(f"lost_reply:{statement}", times=times, match=match)


def fired(statement: str) -> int:
    return failpoints.LOST_REPLIES_FIRED.get(statement, 0)


# -- the scenarios ---------------------------------------------------------------------------
# Each is called with the statement's reply armed to be lost once (unless it arms its own).


def three_steps_end_once(env: Env, **cfg: Any) -> Worker:
    """A three-step workflow ends completed with the model's result, each body run once."""
    h = env.client.submit(app.three_steps, 4)
    worker = env.work(env.finished(), **cfg)
    assert env.history(h.id)[:2] == ("completed", app.model(4))
    assert env.bodies(h.id) == [0, 1, 2]
    return worker


def claim(env: Env) -> None:
    # The claim committed and its rows are running under this worker's lease; the claimer
    # never heard of them. The heartbeat finds them under the lease and ends their lease;
    # the sweeper re-queues them (one attempt charged, as when a worker dies).
    h = env.client.submit(app.three_steps, 4)
    env.work(env.finished())
    status, result, attempts = env.history(h.id)
    assert (status, result) == ("completed", app.model(4))
    assert env.bodies(h.id) == [0, 1, 2]
    assert attempts == 2


def claim_limited(env: Env) -> None:
    h = env.client.submit(app.three_steps, 5, queue="ai-model")
    env.work(env.finished(), queues=("ai-model",))
    assert env.history(h.id)[:2] == ("completed", app.model(5))
    assert env.bodies(h.id) == [0, 1, 2]


def claim_keyed(env: Env) -> None:
    # A keyed queue's claim (lock, the running by key, the claim and its turn: one
    # transaction), its COMMIT's reply lost: the heartbeat ends the rows' lease.
    hs = [env.client.submit(app.three_steps, n, queue="deploys", concurrency_key=f"k{n % 2}")
          for n in range(3)]
    env.work(env.finished(len(hs)), queues=("deploys",))
    for n, h in enumerate(hs):
        assert env.history(h.id)[:2] == ("completed", app.model(n))
        assert env.bodies(h.id) == [0, 1, 2]


def heartbeat(env: Env) -> None:
    # The beat that lost its reply had extended the leases; the thread beats again.
    h = env.client.submit(app.slow_middle, 2, 1.5)
    env.work(env.finished())
    status, _, attempts = env.history(h.id)
    assert (status, attempts) == ("completed", 1)
    assert env.bodies(h.id) == [0, 1, 2]


def heartbeat_held(env: Env) -> None:
    # A transaction holds the running row FOR SHARE for 0.3 s at a time (as the worker's own
    # checkpoint batches do for a moment): the beat reads it without waiting and extends the
    # process's lease; that reply is lost, the thread reconnects and beats again. Nothing
    # lapses.
    h = env.client.submit(app.slow_middle, 2, 2.0)
    stop = threading.Event()

    def hold() -> None:
        with psycopg.connect(env.dsn, prepare_threshold=None) as conn:
            while not stop.is_set():
                conn.execute(f'SELECT 1 FROM "{env.schema}".workflow_executions '
                             "WHERE id = %s FOR SHARE", [h.id])
                stop.wait(0.3)  # well under the worker's lock_timeout, even on a busy machine
                conn.commit()
                stop.wait(0.02)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        env.work(env.finished(), lock_timeout=1.0)
    finally:
        stop.set()
        holder.join()
    status, _, attempts = env.history(h.id)
    assert (status, attempts) == ("completed", 1)
    assert env.bodies(h.id) == [0, 1, 2]


def checkpoint(env: Env) -> None:
    three_steps_end_once(env)


def checkpoint_resent(env: Env) -> None:
    # The first batch commits and loses its reply; the resend meets its own rows
    # (save_steps_batch), which commits and loses its reply too; the third try reads them.
    lose("save_new_steps_batch")
    three_steps_end_once(env)


@contextmanager
def citus_form(env: Env) -> Iterator[None]:
    """The worker sends the Citus forms of the write path (calls of save_steps(),
    finish_batch() then notify_done, sweep_expired(), fail_late(): what a distributed schema
    gets) here on plain PostgreSQL, where the same functions run."""
    with forms.forced(env.q):
        yield


def checkpoint_delegated(env: Env) -> None:
    with citus_form(env):
        three_steps_end_once(env)


def checkpoint_resent_delegated(env: Env) -> None:
    lose("save_new_steps_delegated")
    with citus_form(env):
        three_steps_end_once(env)


def complete(env: Env) -> None:
    worker = three_steps_end_once(env)
    # Learned from history (finished_readback), not taken for a fenced write.
    assert (worker.stats.completed, worker.stats.fenced) == (1, 0)
    # The last step's checkpoint went with the completion (its tail), once.
    assert q(env.dsn, env.schema, "SELECT step_id, xmin = (SELECT xmin FROM "
             "{s}.workflow_history) FROM {s}.operation_outputs ORDER BY 1") == [
        (0, False), (1, False), (2, True)]


def complete_read_back(env: Env) -> None:
    # finished_readback only runs after a completion's reply was lost.
    lose("complete_batch")
    complete(env)


def complete_delegated(env: Env) -> None:
    with citus_form(env):
        complete(env)


def complete_read_back_delegated(env: Env) -> None:
    # The Citus form's reply lost: the retry finishes nothing, learns the finish from
    # history, and notifies then.
    lose("complete_batch_delegated")
    with citus_form(env):
        complete(env)


def release(env: Env) -> None:
    # A worker stops mid-step and gives the execution back; the release's reply is lost, so
    # it believes the lease will expire, but the row is queued: the next worker runs it.
    h = env.client.submit(app.slow_middle, 3, 1.0)
    started = lambda: bool(app.read_ledger(env.ledger, kind="start"))  # noqa: E731
    env.work(started, drain=0.0)
    assert env.client.get(h.id).status.value == "queued"
    env.work(env.finished())
    status, result, attempts = env.history(h.id)
    assert (status, result, attempts) == ("completed", app.model(3), 1)


def give_back(env: Env) -> None:
    # An old worker meets a marker its code does not know and gives the execution back; the
    # give-back's reply is lost, the resend learns it committed: counted once, not charged.
    KNOWS_PATCH["yes"] = False
    h = env.client.submit(patched, 5)
    q(env.dsn, env.schema, "INSERT INTO {s}.operation_outputs (execution_id, step_id, "
      "step_name, output, attempt, lease_epoch, started_at) VALUES (%s, -1, "
      "'kestrel.patch:sweep-new', %s::jsonb, 1, 0, now()) RETURNING 1", (h.id, '{"at": 0}'))
    given = lambda: q1(env.dsn, env.schema, "SELECT give_backs FROM {s}.workflow_executions "  # noqa: E731
                       "WHERE id = %s", (h.id,)) == 1
    env.work(given, app_version="v1")
    assert q(env.dsn, env.schema, "SELECT status, attempts, give_backs, given_back_by FROM "
             "{s}.workflow_executions WHERE id = %s", (h.id,)) == [("waiting", 0, 1, ["v1"])]
    KNOWS_PATCH["yes"] = True
    try:
        env.work(env.finished(), app_version="v2")
    finally:
        KNOWS_PATCH["yes"] = False
    assert env.history(h.id)[:2] == ("completed", 105)


def park(env: Env) -> None:
    h = env.client.submit(app.sleeper, 2, 0.2)
    env.work(env.finished())
    assert env.history(h.id)[:2] == ("completed", app.model_step(2, 0) + app.model_step(2, 1))
    assert sorted(env.bodies(h.id)) == [0, 2]


def consume_signal(env: Env) -> None:
    # Two signals of one name: the first is consumed into the wait, the second stays pending.
    h = env.client.submit(app.approval, 1)
    assert env.client.signal(h.id, "approve", "first") is True
    assert env.client.signal(h.id, "approve", "second") is True
    env.work(env.finished(), timeout=8)
    assert env.history(h.id)[1]["payload"] == "first"
    assert q(env.dsn, env.schema, "SELECT payload, consumed_step IS NOT NULL FROM "
             + ALL_SIGNALS + " ORDER BY id") == [("first", True), ("second", False)]


def set_event(env: Env) -> None:
    h = env.client.submit(app.progress)
    assert env.client.signal(h.id, "go") is True
    env.work(env.finished())
    assert env.history(h.id)[:2] == ("completed", "done")
    assert env.client.get_event(h.id, "stage", timeout=1) == "fixing"


def set_tags(env: Env) -> None:
    # The merge committed, its reply was lost: the runner sends it again, which merges the
    # same changes into the same tags; the step is recorded once.
    h = env.client.submit(tagger, tags={"customer": "acme", "env": "prod"})
    env.work(env.finished())
    assert env.history(h.id)[:2] == ("completed", "tagged")
    assert env.client.get(h.id).tags == {"env": "prod", "stage": "done"}
    assert q1(env.dsn, env.schema, "SELECT count(*) FROM {s}.operation_outputs "
              "WHERE execution_id = %s AND step_name = 'kestrel.set_tags'", (h.id,)) == 2


def start_child(env: Env) -> None:
    # The child was submitted; the retry under the same key returns it, not a second one.
    h = env.client.submit(app.parent, 6)
    env.work(env.finished(2))
    assert env.history(h.id)[:2] == ("completed", app.model(6))
    children = q(env.dsn, env.schema, "SELECT status FROM {s}.workflow_history "
                 "WHERE parent_id = %s", (h.id,))
    assert children == [("completed",)]


def client_submit(env: Env) -> None:
    client = env.client
    with pytest.raises(psycopg.OperationalError):
        client.submit(app.three_steps, 7, idempotency_key="order-7")
    again = client.submit(app.three_steps, 7, idempotency_key="order-7")
    assert q1(env.dsn, env.schema, "SELECT count(*) FROM {s}.workflow_executions") == 1
    env.work(env.finished())
    assert env.history(again.id)[:2] == ("completed", app.model(7))


def client_signal(env: Env) -> None:
    client = env.client
    h = client.submit(app.waiter)
    with pytest.raises(psycopg.OperationalError):
        client.signal(h.id, "go", 5, idempotency_key="approve-1")
    # Sent again: the key was used, so the first try delivered it (counted once).
    assert client.signal(h.id, "go", 5, idempotency_key="approve-1") is False
    env.work(env.finished())
    assert env.history(h.id)[:2] == ("completed", 5)
    assert q1(env.dsn, env.schema, "SELECT count(*) FROM " + ALL_SIGNALS) == 1


def workflow_signal(env: Env) -> None:
    target = env.client.submit(app.waiter)
    sender = env.client.submit(signaller, str(target.id))
    env.work(env.finished(2))
    assert env.history(sender.id)[:2] == ("completed", "sent")
    assert env.history(target.id)[:2] == ("completed", "from a workflow")
    assert q1(env.dsn, env.schema, "SELECT count(*) FROM " + ALL_SIGNALS) == 1


def scheduled_tick(env: Env) -> None:
    # The scheduler's tick (advance_schedule and the keyed submit, one transaction) commits
    # and loses its reply; its next round reads the advanced tick and starts nothing twice.
    ticks = _run_scheduler(env, rounds=2)
    assert ticks == 1
    assert q1(env.dsn, env.schema, "SELECT count(*) FROM {s}.workflow_executions") == 1


def _run_scheduler(env: Env, *, rounds: int) -> int:
    sch = Schedule("sweep-hourly", Cron.parse("0 * * * *"), "three_steps", True, "default")

    async def go(pool: Any) -> int:
        q_ = env.q
        async with pool.connection() as conn:
            now = await db.run(conn, statements.queues.db_now(q_))
            # Registered an hour and a minute ago: exactly one tick is due.
            await db.run(conn, statements.queues.upsert_schedule(
                q_, name=sch.name, cron=sch.cron.text, workflow=sch.workflow,
                last_tick=now.replace(minute=0, second=0, microsecond=0)
                - timedelta(hours=1)))
        scheduler = Scheduler(pool, q_, env.cfg(), [sch])
        for _ in range(rounds):
            try:
                await scheduler.run_once()
            except psycopg.OperationalError:
                pass  # what Scheduler.run does: the next round goes on
        return int(q1(env.dsn, env.schema, "SELECT count(*) FROM {s}.workflow_executions"))

    return int(env.run_async(go))


def upsert_schedule(env: Env) -> None:
    # Written at worker start (Worker._register): a lost reply fails that start and the
    # supervisor starts the worker again, which writes the same row (an upsert).
    tick = q1(env.dsn, env.schema, "SELECT {s}.kestrel_now()")

    async def go(pool: Any) -> Any:
        stmt = statements.queues.upsert_schedule(env.q, name="s", cron="* * * * *", workflow="w",
                                  last_tick=tick)
        async with pool.connection() as conn:
            with pytest.raises(psycopg.OperationalError):
                await db.run(conn, stmt)
        async with pool.connection() as conn:
            return await db.run(conn, stmt)

    assert env.run_async(go) == tick
    assert q(env.dsn, env.schema, "SELECT name, last_tick FROM {s}.schedules") == [("s", tick)]


def worker_start(env: Env) -> None:
    # upsert_queue_limit and register_worker run as a worker starts: the lost reply fails
    # that start (the supervisor restarts it), and the restarted worker writes the same rows.
    h = env.client.submit(app.three_steps, 8, queue="ai-model")
    with pytest.raises(psycopg.OperationalError):
        env.work(env.finished(), queues=("ai-model",))
    env.work(env.finished(), queues=("ai-model",))
    assert env.history(h.id)[:2] == ("completed", app.model(8))
    assert q1(env.dsn, env.schema, "SELECT count(*) FROM {s}.queue_limits") == 1


def worker_stop(env: Env) -> None:
    three_steps_end_once(env)
    assert q1(env.dsn, env.schema, "SELECT count(*) FROM {s}.workers") == 0


def client_cancel(env: Env) -> None:
    client = env.client
    h = client.submit(app.waiter)
    with pytest.raises(psycopg.OperationalError):
        client.cancel(h.id)
    assert client.cancel(h.id) == "cancelled"
    assert env.history(h.id)[0] == "cancelled"
    assert q1(env.dsn, env.schema, "SELECT count(*) FROM {s}.uncounted_finishes") == 1


def client_retry(env: Env) -> None:
    client = env.client
    key = f"k-{uuid.uuid4()}"
    h = client.submit(fails_once, key)
    env.work(env.finished())
    assert env.history(h.id)[0] == "failed"
    with pytest.raises(psycopg.OperationalError):
        client.retry(h.id, idempotency_key="retry-1")
    client.retry(h.id, idempotency_key="retry-1")  # learns the first one's outcome
    env.work(env.finished())
    assert env.history(h.id)[:2] == ("completed", 7)
    assert env.bodies(h.id) == [0, 0]  # the failed run and the retried one: no third
    with pytest.raises(InvalidState):
        client.retry(h.id, idempotency_key="retry-2")  # a new key: a new retry, refused


def client_fork(env: Env) -> None:
    client = env.client
    h = client.submit(app.three_steps, 3)
    env.work(env.finished())
    with pytest.raises(psycopg.OperationalError):
        client.fork(h.id, 2, idempotency_key="fork-1")
    fork = client.fork(h.id, 2, idempotency_key="fork-1")
    assert q1(env.dsn, env.schema, "SELECT count(*) FROM {s}.workflow_executions") == 1
    env.work(env.finished(2))
    assert env.history(fork.id)[:2] == ("completed", app.model(3))
    assert env.bodies(fork.id) == [2]


def sweep_expired(env: Env) -> None:
    # A claim whose worker died: running under a lease that has already ended.
    h = env.client.submit(app.three_steps, 9)
    q(env.dsn, env.schema, "UPDATE {s}.workflow_executions SET status = 'running', "
      "lease_epoch = lease_epoch + 1, attempts = 1, lease_owner = 'gone', "
      "lease_expires_at = {s}.kestrel_now() - interval '1 second' RETURNING id")
    env.work(env.finished())
    assert env.history(h.id) == ("completed", app.model(9), 2)


def dropped_attempt(env: Env) -> None:
    # An older claim records the last step's position meanwhile (tests/integration/test_tail):
    # the completion finishes nothing and the attempt is dropped, its row still under the
    # process's live lease. The heartbeat ends that row's lease (end_leases: its reply lost,
    # it is sent again at the next beat, ending nothing twice); the sweeper re-queues it and
    # the next claim replays the recorded value.
    from tests.integration.test_tail import clash

    h = env.client.submit(clash, env.dsn, env.schema, 0.0)
    env.work(env.finished())
    assert env.history(h.id) == ("completed", "ended on recorded", 2)


def sweep_dead_owner(env: Env) -> None:
    # A claim whose process's lease has run out (migration 0026): the row has no lease of
    # its own, its owner's row in `leases` has passed.
    h = env.client.submit(app.three_steps, 8)
    q(env.dsn, env.schema, "INSERT INTO {s}.leases (owner, expires_at, renewed_at) VALUES "
      "('gone', {s}.kestrel_now() - interval '1 second', {s}.kestrel_now() - interval "
      "'31 seconds')")
    q(env.dsn, env.schema, "UPDATE {s}.workflow_executions SET status = 'running', "
      "lease_epoch = lease_epoch + 1, attempts = 1, lease_owner = 'gone', "
      "lease_expires_at = NULL RETURNING id")
    env.work(env.finished())
    assert env.history(h.id) == ("completed", app.model(8), 2)


def sweep_expired_delegated(env: Env) -> None:
    with citus_form(env):
        sweep_expired(env)


def sweep_dead_owner_delegated(env: Env) -> None:
    with citus_form(env):
        sweep_dead_owner(env)


def deadline_delegated(env: Env) -> None:
    with citus_form(env):
        deadline(env)


def deadline(env: Env) -> None:
    # In a queue no worker here claims: only the sweeper's expire_deadlines can end it (the
    # statement this scenario loses the reply of), never a claim that won the race.
    h = env.client.submit(app.waiter, timeout=0.3, queue="unclaimed")
    env.work(env.finished())
    status, _, _ = env.history(h.id)
    assert status == "failed"
    error = q1(env.dsn, env.schema, "SELECT error FROM {s}.workflow_history")
    assert error["type"].endswith("DeadlineExceeded")


def upkeep(env: Env) -> None:
    cfg = env.cfg(history_retention_days=30.0)

    async def go(pool: Any) -> tuple[bool, int, int]:
        with pytest.raises(psycopg.OperationalError):
            await Upkeep(pool, env.q, cfg).run_once()
        return await Upkeep(pool, env.q, cfg).run_once()

    before = _partitions(env)
    ran, created, dropped = env.run_async(go)
    assert ran and dropped == 0
    assert created == 0 or _partitions(env) != before  # the same partitions, none twice
    assert len(set(_partitions(env))) == len(_partitions(env))


def _partitions(env: Env) -> list[str]:
    return [r[0] for r in q(env.dsn, env.schema, "SELECT child.relname FROM pg_inherits i "
                            "JOIN pg_class child ON child.oid = i.inhrelid "
                            "JOIN pg_namespace n ON n.oid = child.relnamespace "
                            "WHERE n.nspname = %s", (env.schema,))]


def count_cancelled(env: Env) -> None:
    h = env.client.submit(app.waiter)
    assert env.client.cancel(h.id) == "cancelled"
    finished = metrics.get().finished.labels("waiter", "cancelled")
    before = finished._value.get()

    async def go(pool: Any) -> None:
        stats = Stats(pool, env.q, workflows=["waiter"], collect_queues=True, interval=1.0,
                      running=lambda: 0)
        await stats.run_once()  # the reply is lost: Stats skips the round
        await stats.run_once()

    env.run_async(go)
    assert finished._value.get() - before == 1


def listen_worker(env: Env) -> None:
    three_steps_end_once(env)


def wait_for_result(env: Env) -> None:
    h = env.client.submit(app.three_steps, 1)
    env.work(env.finished())
    assert h.result(timeout=10) == app.model(1)  # the wait reconnected and listened again


def wait_for_event(env: Env) -> None:
    h = env.client.submit(app.progress)
    env.client.signal(h.id, "go")
    env.work(env.finished())
    assert env.client.get_event(h.id, "stage", timeout=10) == "fixing"


def token_create(env: Env) -> None:
    from kestrel.http import auth
    from kestrel.http.commands import token_command

    cfg = env.cfg()
    data, _ = token_command(cfg, env.dsn, "create", {"name": "ci", "scopes": "read"})
    rows = q(env.dsn, env.schema, "SELECT id, name, secret_hash FROM {s}.http_tokens")
    assert [(r[0], r[1]) for r in rows] == [(data["id"], "ci")]
    # The token printed is the one stored (the resend carried the same id and hash).
    token_id, secret = auth.split(f"Bearer {data['token']}") or ("", "")
    caller = auth.verify(secret, ("ci", ["read"], bytes(rows[0][2])), token_id)
    assert caller is not None and caller.token_id == data["id"]


def token_revoke(env: Env) -> None:
    from kestrel.http.commands import token_command

    cfg = env.cfg()
    failpoints.disarm()
    data, _ = token_command(cfg, env.dsn, "create", {"name": "ci", "scopes": "read"})
    lose("revoke_token")
    out, _ = token_command(cfg, env.dsn, "revoke", {"token": "ci"})
    assert out == {"revoked": [data["id"]]}
    assert q1(env.dsn, env.schema, "SELECT count(*) FROM {s}.http_tokens "
              "WHERE revoked_at IS NULL") == 0


def limits_removed(env: Env) -> None:
    # An operator's remove-limits commits and loses its reply: sent again, it finds nothing
    # more to remove (and says so), and the limits are gone once.
    with psycopg.connect(env.dsn, autocommit=True) as conn:
        db.run_sync(conn, statements.queues.upsert_queue_limit(
            queries(env.schema), queue="deploys", concurrency=2, rate=None, period_s=None))
    with pytest.raises(psycopg.OperationalError):
        env.client.remove_queue_limits("deploys")
    assert env.client.remove_queue_limits("deploys") is False
    assert q1(env.dsn, env.schema, "SELECT count(*) FROM {s}.queue_limits") == 0


def hook_submit(env: Env) -> None:
    # A webhook's submit commits and loses its reply; the sender delivers again (same
    # delivery, same key) and gets the same execution.
    from kestrel.statements import http as store

    stmt = store.hook_submit(env.q, workflow="quick", body=b'{"n": 1}', envelope=None,
                             queue="default", key="github:delivery-1", max_bytes=1 << 20)

    async def deliver(pool: Any) -> Any:
        async with pool.connection() as conn:
            return await db.run(conn, stmt)

    with pytest.raises(psycopg.OperationalError):
        env.run_async(deliver)
    again = env.run_async(deliver)
    assert q(env.dsn, env.schema, "SELECT id FROM {s}.workflow_executions") == [(again,)]


def _ui_session(env: Env, stmt_of: Callable[[bytes], Any], lose_first: bool) -> Any:
    from kestrel.statements import http as store

    async def go(pool: Any) -> Any:
        async with pool.connection() as conn:
            await db.run(conn, store.create_token(env.q, id="kst_sweep0001", name="ops",
                                                  scopes=["read"], secret_hash=b"t" * 32))
        return None

    env.run_async(go)

    async def send(pool: Any, secret: bytes) -> Any:
        async with pool.connection() as conn:
            made = stmt_of(secret)
            if isinstance(made, statements.Stmt):
                return await db.run(conn, made)
            return await db.run_script(conn, made)

    if lose_first:
        with pytest.raises(psycopg.OperationalError):
            env.run_async(lambda pool: send(pool, b"a" * 32))
    return lambda secret: env.run_async(lambda pool: send(pool, secret))


def ui_login(env: Env) -> None:
    # A login's session row commits and its reply is lost: the browser got no cookie, so the
    # user logs in again and gets a session of their own; the orphan's secret reached nobody
    # (only its hash is stored) and it expires unused.
    from kestrel.statements import http as store

    make = lambda secret: store.create_session(  # noqa: E731
        env.q, secret_hash=secret, token_id="kst_sweep0001", ttl_s=60.0)
    send = _ui_session(env, make, lose_first=True)
    assert send(b"b" * 32) is not None
    assert q1(env.dsn, env.schema, "SELECT count(*) FROM {s}.ui_sessions") == 2


def ui_logout(env: Env) -> None:
    # A logout's DELETE commits and its reply is lost: sent again it deletes nothing and the
    # session is gone all the same.
    from kestrel.statements import http as store

    failpoints.disarm()  # the session is made first, with its reply
    send = _ui_session(env, lambda secret: store.create_session(
        env.q, secret_hash=secret, token_id="kst_sweep0001", ttl_s=60.0), lose_first=False)
    assert send(b"c" * 32) is not None
    lose("end_session")
    end = _ui_session(env, lambda secret: store.end_session(env.q, secret_hash=secret),
                      lose_first=False)
    with pytest.raises(psycopg.OperationalError):
        end(b"c" * 32)
    end(b"c" * 32)
    assert q1(env.dsn, env.schema, "SELECT count(*) FROM {s}.ui_sessions") == 0


def ui_logout_everywhere(env: Env) -> None:
    # Log out everywhere: the DELETE of every session of the token commits and its reply is
    # lost; sent again it deletes nothing and every session is gone all the same.
    from kestrel.statements import http as store

    failpoints.disarm()  # two sessions of one token are made first, with their replies
    make = _ui_session(env, lambda secret: store.create_session(
        env.q, secret_hash=secret, token_id="kst_sweep0001", ttl_s=60.0), lose_first=False)
    assert make(b"d" * 32) is not None and make(b"e" * 32) is not None
    lose("end_token_sessions")

    async def end(pool: Any) -> Any:
        async with pool.connection() as conn:
            return await db.run(conn, store.end_token_sessions(env.q, token_id="kst_sweep0001"))

    with pytest.raises(psycopg.OperationalError):
        env.run_async(end)
    env.run_async(end)
    assert q1(env.dsn, env.schema, "SELECT count(*) FROM {s}.ui_sessions") == 0


def migrate_again(env: Env, *, test_clock: bool = False) -> None:
    # A transaction per migration (the schema first, the functions last); run again after
    # one's reply was lost, migrate goes on from the last migration that committed, applying
    # each of the others once, and the schema works.
    schema = f"t_{uuid.uuid4().hex[:12]}"
    try:
        with pytest.raises(psycopg.OperationalError):
            migrate(env.dsn, schema, test_clock=test_clock)
        with psycopg.connect(env.dsn, autocommit=True) as conn:
            committed = current_version(conn, schema)
        versions = [m.version for m in migrations(schema)]
        assert migrate(env.dsn, schema, test_clock=test_clock) == [
            v for v in versions if v > committed]
        with psycopg.connect(env.dsn, autocommit=True) as conn:
            assert current_version(conn, schema) == len(versions)
            assert conn.execute(f'SELECT "{schema}".kestrel_functions_version()').fetchone()
    finally:
        with psycopg.connect(env.dsn, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def claim_in_namespace(env: Env) -> None:
    # A namespace of 2 buckets, a queue with both limits: a claim in either bucket takes the
    # queue's row in its home bucket, counts every bucket's running rows and records its
    # starts there, in one transaction. Its COMMIT's reply lost, the rows it claimed run
    # under this worker's name unknown to it: they come back when their lease ends. Every
    # execution completes, each body once.
    name = f"n_{uuid.uuid4().hex[:12]}"
    names = buckets.schemas(name, 2)
    try:
        migrate_namespace(env.dsn, name, buckets=2)
        client = SyncClient(env.dsn, schema=name, pool_size=0)
        handles = [client.submit(app.three_steps, i, queue="ns-limited") for i in range(6)]
        assert {buckets.bucket_of(h.id, 2) for h in handles} <= {0, 1}

        def done() -> bool:
            return sum(finished_count(env.dsn, s) for s in names) >= len(handles)

        async def main() -> None:
            workers = [Worker(config(s, queues=("ns-limited",)), registry(), dsn=env.dsn,
                              namespace=names, cron=False) for s in names]
            tasks = [asyncio.create_task(w.run()) for w in workers]
            deadline = asyncio.get_running_loop().time() + 30
            try:
                while not await asyncio.to_thread(done):
                    assert asyncio.get_running_loop().time() < deadline, "not done in 30 s"
                    for t in tasks:
                        if t.done():
                            t.result()
                    await asyncio.sleep(0.05)
            finally:
                for w in workers:
                    w.stop(drain_timeout=5)
                await asyncio.gather(*tasks)

        asyncio.run(main())
        for i, h in enumerate(handles):
            assert h.result(timeout=5) == app.model(i)
            assert env.bodies(h.id) == [0, 1, 2]
    finally:
        with psycopg.connect(env.dsn, autocommit=True) as conn:
            for schema in names:
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def migrate_namespace_again(env: Env) -> None:
    # Each bucket's schema in short transactions, bucket 0 first. The reply lost in one of
    # them (a bucket left part-made, its number not recorded yet), run again: the namespace
    # is whole, each bucket once, and the ids each bucket makes name it.
    name = f"n_{uuid.uuid4().hex[:12]}"
    try:
        with pytest.raises(psycopg.OperationalError):
            migrate_namespace(env.dsn, name, buckets=2)
        again = migrate_namespace(env.dsn, name, buckets=2)
        assert list(again) == buckets.schemas(name, 2)
        for k, schema in enumerate(buckets.schemas(name, 2)):
            assert q(env.dsn, schema, "SELECT bucket, buckets FROM {s}.bucket") == [(k, 2)]
            made = q1(env.dsn, schema, "SELECT {s}.new_execution_id()")
            assert buckets.bucket_of(made, 2) == k
    finally:
        with psycopg.connect(env.dsn, autocommit=True) as conn:
            for schema in buckets.schemas(name, 2):
                conn.execute(f'DROP SCHEMA IF EXISTS "{schema}" CASCADE')


def migrate_test_schema_again(env: Env) -> None:
    # A schema made for tests: migrate also locks its movable clock.
    migrate_again(env, test_clock=True)


def dead_worker(env: Env) -> None:
    # The supervisor recovers a reaped worker's leases in one transaction; its reply lost,
    # the leases were released all the same, and a second try finds nothing more to do.
    h = env.client.submit(app.three_steps, 4)
    dead = "host:1:dead0000"
    take_lease(env.dsn, env.schema, dead, 3600)  # as its first heartbeat did

    async def claim(pool: Any) -> None:
        async with pool.connection() as conn:
            [c] = await db.run(
                conn,
                statements.executions.claim_batch(
                    env.q, owner=dead, queues=["default"], limit=1, lease_s=3600.0
                ),
            )
            assert c.id == h.id

    env.run_async(claim)
    with psycopg.connect(env.dsn, autocommit=True, prepare_threshold=None) as conn, \
            pytest.raises(psycopg.OperationalError):
        db.run_script_sync(
            conn, statements.sweeper.recover_dead_worker(env.q, worker_id=dead, max_attempts=5)
        )
    with psycopg.connect(env.dsn, autocommit=True, prepare_threshold=None) as conn:
        again = db.run_script_sync(
            conn, statements.sweeper.recover_dead_worker(env.q, worker_id=dead, max_attempts=5)
        )
    assert again.examined == 0
    assert env.client.get(h.id).status.value == "queued"
    env.work(env.finished())
    assert env.history(h.id) == ("completed", app.model(4), 2)



# -- the table -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Read:
    """A statement that writes nothing: sent again, it reads again."""

    why: str


@dataclass(frozen=True)
class KitOnly:
    """A statement only kestrel.testing sends, which never resends it."""

    why: str


@dataclass(frozen=True)
class Lost:
    """Scenarios run with the statement's reply lost once; *match* picks which call."""

    scenarios: tuple[Callable[[Env], None], ...]
    match: Callable[[Any], bool] | None = None
    xfail: str | None = None


def _child(params: Any) -> bool:
    return params.get("parent") is not None


def _client_submit(params: Any) -> bool:
    return params.get("idempotency_key") == "order-7"


def _key(key: str) -> Callable[[Any], bool]:
    return lambda params: params.get("idempotency_key") == key


SWEEP: dict[str, Lost | Read | KitOnly] = {
    # The worker's hot path.
    "claim_batch": Lost((claim,)),
    "claim_limited": Lost((claim_limited,)),
    "lock_queue_limit": Lost((claim_limited,)),  # the same transaction's COMMIT
    # A namespace's limited claim: one transaction in two buckets, its COMMIT's reply lost.
    "lock_namespace_limit": Lost((claim_in_namespace, claim_keyed)),
    "running_in_queue": Lost((claim_in_namespace,)),
    "claim_limited_in_namespace": Lost((claim_in_namespace,)),
    "record_namespace_starts": Lost((claim_in_namespace,)),
    "running_by_key": Lost((claim_keyed,)),
    "claim_keyed": Lost((claim_keyed,)),
    "take_lease": Lost((heartbeat, heartbeat_held)),
    "running_under": Read("reads what runs under the process's lease, after a lost claim"),
    "end_leases": Lost((dropped_attempt,)),
    "heartbeat": Lost((heartbeat, heartbeat_held)),
    "save_new_steps_batch": Lost((checkpoint,)),
    "save_steps_batch": Lost((checkpoint_resent,)),
    "save_new_steps_delegated": Lost((checkpoint_delegated,)),
    "save_steps_delegated": Lost((checkpoint_resent_delegated,)),
    "load_step": Read("reads one checkpoint"),
    "consume_signal": Lost((consume_signal,)),
    "park": Lost((park,)),
    "set_event": Lost((set_event,)),
    "set_tags": Lost((set_tags,)),
    "complete_batch": Lost((complete,)),
    "finished_readback": Lost((complete_read_back, complete_read_back_delegated)),
    "complete_batch_delegated": Lost((complete_delegated,)),
    # A lost reply retries the batch: finished_readback learns it, and the word goes again.
    "notify_done": Lost((complete_delegated,)),
    "release_batch": Lost((release,)),
    "give_back": Lost((give_back,)),
    "set_lock_timeout": Read("a transaction-local setting sent before a statement behind "
                             "PgBouncer; writes nothing"),
    "set_statement_timeout": Read("the HTTP door's transaction-local budget, sent before "
                                  "each of its statements; writes nothing"),
    "submit": Lost((start_child, client_submit, scheduled_tick)),
    "signal": Lost((client_signal, workflow_signal)),
    # The worker's services.
    "reenqueue_expired": Lost((sweep_expired, sweep_dead_owner)),
    "reenqueue_expired_delegated": Lost((sweep_expired_delegated, sweep_dead_owner_delegated)),
    "expire_deadlines": Lost((deadline,)),
    "expire_deadlines_delegated": Lost((deadline_delegated,)),
    "maintenance_lock": Lost((upkeep,)),
    "ensure_partitions": Lost((upkeep,)),
    "drop_partitions": Lost((upkeep,)),
    "list_partitions": Read("lists partitions"),
    "take_uncounted_finishes": Lost((count_cancelled,)),
    "register_worker": Lost((worker_start,)),
    "unregister_worker": Lost((worker_stop,)),
    "upsert_queue_limit": Lost((worker_start,)),
    "upsert_schedule": Lost((upsert_schedule,)),
    "advance_schedule": Lost((scheduled_tick,)),
    "get_schedule": Read("reads a schedule's last tick"),
    "db_now": Read("reads the database clock"),
    "listen": Lost((listen_worker,)),
    "listen_done": Lost((wait_for_result,)),
    "listen_events": Lost((wait_for_event,)),
    # The clients, the CLI and the HTTP door.
    "cancel": Lost((client_cancel,)),
    "retry": Lost((client_retry,)),
    "fork": Lost((client_fork,)),
    "create_token": Lost((token_create,)),
    "revoke_token": Lost((token_revoke,)),
    "remove_queue_limit": Lost((limits_removed,)),
    "limits_of": Read("the limits a worker claims under, looked at once a heartbeat interval"),
    "get_event": Read("reads an event"),
    "get_execution": Read("reads an execution"),
    "list_steps": Read("reads checkpoints"),
    "count_by_status": Read("counts executions"),
    "list_executions": Read("lists executions"),
    "queue_stats": Read("counts executions by queue"),
    "worker_stats": Read("counts running executions by worker"),
    "waiting_stats": Read("counts waiting executions"),
    "list_tokens": Read("lists tokens"),
    "get_token": Read("reads a token"),
    "page_executions": Read("pages executions"),
    "count_executions": Read("counts what a bulk action's filters match"),
    "get_wait": Read("reads what an execution waits for"),
    "list_events": Read("lists events"),
    "pending_signals": Read("lists pending signals"),
    "list_children": Read("lists children"),
    "list_queue_limits": Read("lists queue limits"),
    "list_schedules": Read("lists schedules"),
    "signal_sent": Read("reads whether a keyed signal arrived"),
    "ui_counts": Read("counts for the web UI"),
    "search_history": Read("searches history"),
    "ui_waits": Read("reads what listed executions wait for"),
    "ui_sent_signal": Read("reads the signal a UI form sent"),
    "ui_retried": Read("reads whether a UI form retried an execution"),
    "live_workers": Read("lists live workers"),
    "unclaimable_total": Read("counts unclaimable executions"),
    "unclaimable_by_workflow": Read("lists unclaimable executions"),
    "patch_summary": Read("summarizes patch markers"),
    "replay_history": Read("reads one execution's history for a replay"),
    # migrate: short transactions, run again by whoever saw one fail.
    "migrate_lock": Lost((migrate_again,)),
    "create_schema": Lost((migrate_again,)),
    "record_migration": Lost((migrate_again, migrate_namespace_again)),
    "ensure_current_partitions": Lost((migrate_again,)),
    "migrations_table_exists": Read("reads the catalog"),
    "lock_test_clock": Lost((migrate_test_schema_again,)),
    "has_test_clock": Read("reads the catalog"),
    "delegate_functions": Lost((migrate_again,)),
    "distributed_schema": Read("reads the Citus catalog, where there is one"),
    "functions_version": Read("calls an immutable function that returns a constant"),
    "node_lock_timeout": Read("reads a role setting from the catalog"),
    "record_bucket": Lost((migrate_namespace_again,)),
    "set_bucket": Lost((migrate_namespace_again,)),
    "bucket_table_exists": Read("reads the catalog"),
    "read_bucket": Read("reads which bucket a schema is"),
    "migrate_finished": Read("reads the catalog"),
    "may_migrate": Read("reads the catalog"),
    "set_clock_kind": Read("a setting local to migrate's transaction; writes nothing"),
    "expire_worker_leases": Lost((dead_worker,)),
    "wake_workers": Lost((dead_worker,)),
    "hook_submit": Lost((hook_submit,)),
    "create_session": Lost((ui_login,)),
    "live_token": Read("a login's first statement asks whether the token is live"),
    "end_session": Lost((ui_logout,)),
    "end_token_sessions": Lost((ui_logout_everywhere,)),
    "get_session": Read("reads a UI session"),
    "fork_source": Read("reads what a fork copied"),
    "applied_migrations": Read("reads the migration record"),
    "current_migration": Read("reads the migration record"),
    # kestrel.testing: a lost reply fails the test that sent it; nothing resends these.
    "advance_clock": KitOnly("moves the test clock; the kit never resends it"),
    "skip_to_next_sleep": KitOnly("moves the test clock; the kit never resends it"),
    "reset_for_test": KitOnly("empties a test schema (idempotent anyway)"),
    "drop_schema": KitOnly("drops a test schema (IF EXISTS: idempotent anyway)"),
    "waiting_for": Read("reads a live execution's wait (test kit)"),
}

MATCH: dict[tuple[str, str], Callable[[Any], bool]] = {
    ("submit", "start_child"): _child,
    ("submit", "client_submit"): _client_submit,
    ("submit", "scheduled_tick"): lambda params: str(params.get("idempotency_key", ""))
    .startswith("kestrel.cron:"),
    ("signal", "client_signal"): _key("approve-1"),
    ("cancel", "client_cancel"): lambda params: True,
    ("retry", "client_retry"): _key("retry-1"),
    ("fork", "client_fork"): _key("fork-1"),
}


def _cases() -> Iterator[Any]:
    for name, row in SWEEP.items():
        if not isinstance(row, Lost):
            continue
        for scenario in row.scenarios:
            marks = [pytest.mark.xfail(strict=True, reason=row.xfail)] if row.xfail else []
            yield pytest.param(name, scenario, id=f"{name}-{scenario.__name__}", marks=marks)


@pytest.fixture(autouse=True)
def _clean_failpoints() -> Iterator[None]:
    failpoints.disarm()
    failpoints.LOST_REPLIES_FIRED.clear()
    yield
    failpoints.disarm()
    failpoints.LOST_REPLIES_FIRED.clear()


@pytest.mark.parametrize(("statement", "scenario"), list(_cases()))
def test_a_lost_reply_is_learned_or_harmless(
    pg_dsn: str, schema: str, ledger_path: Path, statement: str,
    scenario: Callable[[Env], None],
) -> None:
    lose(statement, match=MATCH.get((statement, scenario.__name__)))
    scenario(Env(pg_dsn, schema, ledger_path))
    assert fired(statement) >= 1, f"lost_reply:{statement} never fired: not exercised"


@pytest.mark.parametrize("statement", ["upsert_queue_limit", "register_worker"])
def test_a_worker_whose_start_loses_a_reply_closes_its_pool(
    pg_dsn: str, schema: str, statement: str,
) -> None:
    # The start fails (the supervisor starts a new worker); the pool it had opened must be
    # closed. Left open, its maintenance worker swallows the cancellation asyncio.run sends
    # while a connection attempt is in flight and asyncio.run never returns: CI hung here.
    lose(statement)
    worker = Worker(config(schema, queues=("ai-model",)), registry(), dsn=pg_dsn)

    async def start() -> None:
        with pytest.raises(psycopg.OperationalError):
            await worker.run()

    asyncio.run(start())
    assert fired(statement) == 1
    assert worker._pool.closed
    assert q1(pg_dsn, schema, "SELECT count(*) FROM {s}.workers") == 0  # unregistered


@pytest.mark.parametrize("refusal", ["refused", "connection lost"])
def test_a_completion_whose_notification_fails_is_still_finished_once(
    pg_dsn: str, schema: str, ledger_path: Path, refusal: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The Citus form's notification after the committed completion (notify_done): refused
    for what it is (a full NOTIFY queue), the finish stands and a warning says so; its
    connection lost, the batch is sent again, learns the finish from history and notifies."""
    env = Env(pg_dsn, schema, ledger_path)
    if refusal == "refused":
        failpoints.arm("before_notify_done", "error", error=psycopg.errors.ProgramLimitExceeded(
            "too many notifications in the NOTIFY queue"))
    else:
        failpoints.arm("before_notify_done")
    with citus_form(env), caplog.at_level(logging.WARNING):
        worker = three_steps_end_once(env)
    assert (worker.stats.completed, worker.stats.failed, worker.stats.fenced) == (1, 0, 0)
    said = [r.getMessage() for r in caplog.records]
    assert "failpoint before_notify_done fired (error)" in said or \
        "failpoint before_notify_done fired (raise)" in said  # exercised
    warned = [m for m in said if "notification was refused" in m]
    assert len(warned) == (1 if refusal == "refused" else 0)


# -- the table is the statement list ---------------------------------------------------------

_WRITES = re.compile(
    r"\b(INSERT|DELETE|TRUNCATE|ALTER|CREATE|DROP|LISTEN|NOTIFY)\b"
    r"|\b(pg_notify|submit|signal|cancel|retry|fork|consume_signal|park_execution"
    r"|child_finished|archive_finished|archive_steps|pg_advisory\w*)\s*\("
    r"|\bUPDATE\b|\bFOR\s+SHARE\b", re.IGNORECASE)
"""What makes a statement more than a read: a write, a call of a writing function, a row
lock (``FOR UPDATE`` matches UPDATE), session state."""


def test_every_statement_is_in_the_sweep() -> None:
    names = set(named_statements())
    assert names == {f.name for f in fields(Queries)}
    missing = names - set(SWEEP)
    assert not missing, (f"statements without a lost-reply scenario or a classification in "
                         f"tests/integration/test_lost_replies.py: {sorted(missing)}")
    assert not set(SWEEP) - names, f"rows for no statement: {sorted(set(SWEEP) - names)}"


@pytest.mark.parametrize("name", sorted(n for n, r in SWEEP.items() if isinstance(r, Read)))
def test_what_the_sweep_calls_a_read_writes_nothing(name: str) -> None:
    text = re.sub(r"--[^\n]*", "", named_statements()[name])
    text = re.sub(r"'[^']*'", "''", text)
    assert not _WRITES.search(text), f"{name} is classified as a read but may write"
