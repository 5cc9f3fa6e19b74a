"""The commands on executions: ``submit``, ``list``, ``show``, ``cancel``, ``retry``,
``fork``, ``signal`` and ``stats``, each its options beside its handler.

Each reads and writes through a :class:`~kestrel.client.SyncClient` without a pool
(:func:`kestrel.cli.common.client`), as an application would.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
import uuid
from datetime import UTC, datetime
from typing import Any

from kestrel.cli import bulk, common
from kestrel.cli.common import (
    CONNECTION,
    EXIT_NOT_TAKEN,
    PAYLOAD,
    Command,
    NotFinished,
    emit,
    id_arg,
    iso,
    json_arg,
    json_flag,
    ms,
    one_line,
    parse_id,
    short,
    since,
)
from kestrel.config import Config
from kestrel.errors import ConfigError, KestrelError
from kestrel.types import Execution


def submit_options(s: argparse.ArgumentParser) -> None:
    """``submit``'s arguments."""
    s.add_argument("workflow", help="Registered workflow name (refused when live workers "
                                    "run and none runs it; see --allow-unknown).")
    s.add_argument("--allow-unknown", action="store_true",
                   help="Submit even if no live worker runs this workflow (one deployed "
                        "later will).")
    s.add_argument("--args", default="[]", help="JSON array of arguments (default: []).")
    s.add_argument("--queue", default="default", help="Queue to run it on (default: default).")
    s.add_argument("--priority", type=int, default=0, help="Higher runs first (default: 0).")
    s.add_argument("--idempotency-key", default=None, metavar="KEY",
                   help="Same key and arguments → the same execution, for ever.")
    s.add_argument("--dedup-key", default=None, metavar="KEY",
                   help="At most one live execution per key in the queue: a duplicate "
                        "returns the live one (or fails with --reject-duplicate).")
    s.add_argument("--reject-duplicate", action="store_true",
                   help="With --dedup-key: fail instead of returning the live execution.")
    s.add_argument("--debounce-key", default=None, metavar="KEY",
                   help="With --debounce: while the key's execution in the queue has not "
                        "started, this submit replaces its arguments, pushes its start back "
                        "and prints its id; once it has started, this one starts the next.")
    s.add_argument("--debounce", type=float, default=None, metavar="SECONDS",
                   help="Start after this many seconds without another submit of the key.")
    s.add_argument("--debounce-max", type=float, default=None, metavar="SECONDS",
                   help="Start at most this long after the key's first submit, however "
                        "often it comes (default: ten windows).")
    s.add_argument("--concurrency-key", default=None, metavar="KEY",
                   help="In a queue with per_key: at most that many of this key run at "
                        "once, and the keys take turns.")
    s.add_argument("--tag", action="append", default=None, metavar="NAME=VALUE",
                   help="A tag to find the execution by (list --tag); repeat for more.")
    when = s.add_mutually_exclusive_group()
    when.add_argument("--delay", type=float, default=None, metavar="SECONDS",
                      help="Do not start it before this many seconds from now.")
    when.add_argument("--start-at", default=None, metavar="ISO",
                      help="Do not start it before this time (ISO 8601, e.g. "
                           "2026-12-01T08:00:00Z; without a zone: UTC).")
    s.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="Deadline after which the execution ends failed.")
    s.add_argument("--wait", type=float, default=None, metavar="SECONDS",
                   help="Wait this long for the result and print it (exit 3 if it has not "
                        "finished by then).")
    json_flag(s)


def cmd_submit(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime submit``: submit an execution; print its id (with ``--wait``, its result).

    With ``--wait`` the id is printed (and flushed) before the wait, so it is never lost; a
    wait that runs out says how to wait again and exits :data:`EXIT_NOT_FINISHED`.

    Raises:
        ConfigError: ``--args`` is not a JSON array, ``--start-at`` not an ISO time.
        NotFinished: ``--wait`` ran out.
    """
    args = json_arg(ns.args, "--args")
    if not isinstance(args, list):
        raise ConfigError("--args must be a JSON array, e.g. '[1, \"two\"]'")
    start_at = iso(ns.start_at, "--start-at") if ns.start_at is not None else None
    client, _server = common.client(cfg)
    note = None if ns.allow_unknown else _check_workflow(client, ns.workflow)
    handle = client.submit(ns.workflow, *args, queue=ns.queue, priority=ns.priority,
                           idempotency_key=ns.idempotency_key, timeout=ns.timeout,
                           delay=ns.delay, start_at=start_at, dedup_key=ns.dedup_key,
                           on_duplicate="reject" if ns.reject_duplicate else "return",
                           debounce_key=ns.debounce_key, debounce=ns.debounce,
                           debounce_max=ns.debounce_max, concurrency_key=ns.concurrency_key,
                           tags=common.tags(ns.tag))
    if note is not None and common.interactive():
        print(f"kestrel-runtime submit: note: {note}", file=sys.stderr)
    if ns.wait is None:
        return emit(ns, {"id": str(handle.id)}, lambda: print(handle.id))
    if not ns.json:
        print(handle.id, flush=True)
    result = _wait_for(client, handle.id, ns.wait, json_id=ns.json)

    def table() -> None:
        print(json.dumps(result))

    return emit(ns, {"id": str(handle.id), "result": result}, table)


def _check_workflow(client: Any, name: str) -> str | None:
    """Refuse *name* when workers are live and none runs it: a typo would queue for ever
    (the HTTP door answers 404). With no live worker at all, return a note saying what it
    will wait for (workers may be deployed after the submit).

    Raises:
        ConfigError: live workers run other workflows only.
    """
    live = client.workers()
    known = sorted({w for worker in live for w in worker.workflows})
    if name in known:
        return None
    if not live:
        return f"no worker is running; the execution waits until one that runs {name!r} " \
               "claims it"
    close = difflib.get_close_matches(name, known, n=3)
    hint = (f"did you mean {' or '.join(map(repr, close))}?" if close else
            f"they run {', '.join(map(repr, known[:12]))}{' …' if len(known) > 12 else ''}")
    raise ConfigError(f"no live worker runs workflow {name!r}, so it would wait for ever: "
                      f"{hint} (--allow-unknown submits it anyway, for workers deployed "
                      "later)")


def _wait_for(client: Any, eid: uuid.UUID, seconds: float, *, json_id: bool) -> Any:
    """The result of *eid* within *seconds*.

    Raises:
        NotFinished: it has not finished by then (with ``--json``, ``{"id": …}`` is printed
            first, so the id is never lost).
        WorkflowFailed: it ended failed, cancelled or quarantined.
    """
    try:
        return client.result(eid, timeout=seconds)
    except TimeoutError:
        if json_id:
            print(json.dumps({"id": str(eid), "finished": False}), flush=True)
        raise NotFinished(f"execution {eid} has not finished after {seconds:g}s; it goes "
                          f"on: wait again with `kestrel-runtime show {eid} --wait SECONDS`"
                          ) from None



def cmd_list(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime list``: print executions newest first, optionally filtered.

    The filters are ``--status``, ``--workflow``, ``--since``, ``--app-version``, the
    patch ones and ``--tag NAME=VALUE`` (repeated: all must match); ``--limit`` caps the rows.
    """
    client, _server = common.client(cfg)
    if ns.patch and ns.without_patch:
        raise ConfigError("--patch and --without-patch exclude each other")
    rows = client.list(status=ns.status, workflow=ns.workflow, since=since(ns.since),
                       limit=ns.limit, app_version=getattr(ns, "app_version", None),
                       patch=ns.patch or ns.without_patch, with_patch=not ns.without_patch,
                       tags=common.tags(ns.tag))
    data = [{"id": r.id, "workflow": r.workflow, "queue": r.queue, "status": r.status.value,
             "claims": r.attempts, "created_at": r.created_at, "finished_at": r.finished_at,
             "app_version": r.app_version, "tags": r.tags or {}}
            for r in rows]

    def table() -> None:
        print(f"{'id':<36}  {'workflow':<22} {'queue':<10} {'status':<11} {'created':<19} "
              f"{'took':>9}")
        for r in rows:
            took = (f"{ms(r.finished_at - r.created_at) / 1000:8.2f}s" if r.finished_at
                    else "")
            print(f"{r.id!s:<36}  {r.workflow[:22]:<22} {r.queue[:10]:<10} "
                  f"{r.status.value:<11} {r.created_at:%Y-%m-%d %H:%M:%S} {took:>9}")
        print(f"({len(rows)} shown)")

    return emit(ns, data, table)


def cmd_show(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime show``: print one execution and its steps as a timeline.

    A live execution also says what it waits for (a signal, a child, the end of a sleep, its
    delayed start, a worker or a slot in its limited queue) and when the wait times out; any
    execution with a deadline shows it. ``--wait`` first waits for it to finish.

    Raises:
        NotFinished: ``--wait`` ran out (the execution is shown first).
    """
    client, _server = common.client(cfg)
    eid = parse_id(ns.id)
    late: NotFinished | None = None
    if ns.wait is not None:
        try:
            client.result(eid, timeout=ns.wait)
        except TimeoutError:
            late = NotFinished(f"execution {eid} has not finished after {ns.wait:g}s; it "
                               f"goes on: wait again with `kestrel-runtime show {eid} --wait "
                               "SECONDS`")
        except KestrelError:
            pass  # it ended failed, cancelled or quarantined: shown below
    ex = client.get(eid)
    # Patch markers (negative ids) in the place they mark: before the position in "at".
    steps = sorted(client.steps(ex.id), key=lambda s: (
        _marked_at(s) if s.step_id < 0 else s.step_id, 0 if s.step_id < 0 else 1))
    waits = waits_for(ex)
    forked = client.forked_from(ex.id)
    data = {
        "id": ex.id, "workflow": ex.workflow, "status": ex.status.value, "queue": ex.queue,
        "claims": ex.attempts, "args": ex.args, "result": ex.result, "error": ex.error,
        "created_at": ex.created_at, "started_at": ex.started_at,
        "finished_at": ex.finished_at, "deadline": ex.deadline, "waits_for": waits,
        "give_backs": ex.give_backs, "given_back_by": ex.given_back_by,
        "given_back_at": ex.given_back_at, "tags": ex.tags or {},
        "concurrency_key": ex.concurrency_key,
        "forked_from": ({"id": forked[0], "from_step": forked[1]} if forked else None),
        "steps": [{"step_id": s.step_id, "name": s.name, "attempt": s.attempt,
                   "duration_ms": ms(s.finished_at - s.started_at), "output": s.output,
                   "error": s.error,
                   "failed_tries": [{"attempt": t.attempt, "type": t.type,
                                     "message": t.message, "failed_at": t.failed_at}
                                    for t in s.tries]} for s in steps],
    }

    def table() -> None:
        print(f"execution {ex.id}")
        print(f"  workflow  {ex.workflow}   queue {ex.queue}   status {ex.status.value}")
        print(f"  args      {short(ex.args)}")
        if ex.tags or ex.concurrency_key:
            print(f"  tags      {short(ex.tags or {})}" + (
                f"   concurrency key {short(ex.concurrency_key)}" if ex.concurrency_key else ""))
        if forked is not None:
            print(f"  forked from {forked[0]} (its steps 0..{forked[1] - 1} reused)"
                  if forked[1] else f"  forked from {forked[0]} (from the start)")
        if waits is not None:
            print(f"  waits for {waits['what']}"
                  + (f"   until {_when(waits['until'])}" if waits.get("until") else ""))
        if ex.give_backs:
            print(f"  given back {ex.give_backs} time(s) by app version(s) "
                  f"{', '.join(ex.given_back_by or [])} (their code is older than its history;"
                  " they never claim it again)")
        if ex.deadline is not None:
            print(f"  deadline  {_when(ex.deadline)}"
                  + ("   (fails then unless finished)" if not ex.status.terminal else ""))
        if ex.status.value == "completed":
            print(f"  result    {short(ex.result)}")
        if ex.error:
            print(f"  error     {ex.error.get('type')}: {ex.error.get('message')}")
        print(f"  steps ({len(steps)}):")
        for s in steps:
            # A fork's copied checkpoints ran before the fork existed: "reused", not a
            # negative offset.
            at = ms(s.started_at - ex.created_at) / 1000
            when = f"+{at:7.2f}s" if at >= 0 else f"{'reused':>9}"
            if s.step_id < 0:  # a patch marker: where new code took its new path
                print(f"    patch {when}  {s.name[:34]:<34} new code's path from step "
                      f"{_marked_at(s)} on")
                continue
            outcome = (f"error {s.error.get('type')}: {s.error.get('message')}" if s.error
                       else short(s.output, 60))
            print(f"    #{s.step_id:<3} {when}  {s.name[:34]:<34} "
                  f"try {s.attempt}  {ms(s.finished_at - s.started_at):>8.1f} ms  {outcome}")
            if s.tries and s.tries[0].attempt > 1:
                print(f"{'':<15}(tries 1-{s.tries[0].attempt - 1} failed too; only the last "
                      f"{len(s.tries)} are kept)")
            for t in s.tries:  # each failed try before the outcome
                after = ms(t.failed_at - ex.created_at) / 1000
                print(f"{'':<15}try {t.attempt} failed at +{after:.2f}s  "
                      f"{one_line(f'{t.type}: {t.message}')}")

    emit(ns, data, table)
    if late is not None:
        raise late
    return 0


def _marked_at(step: Any) -> int:
    """The position a patch marker (a step with a negative id) was recorded at."""
    at = step.output.get("at") if isinstance(step.output, dict) else None
    return at if isinstance(at, int) else 0


def waits_for(ex: Execution) -> dict[str, Any] | None:
    """What a live execution waits for: ``{"kind", "what", "until"}``, or None.

    *kind* is ``signal``, ``child``, ``sleep``, ``start`` (a delayed start), ``worker`` (queued),
    ``slot`` (queued in a limited queue) or ``version`` (given back by workers whose code is
    older than its history, it waits for a worker of another app version); a wait's
    ``waiting_for`` is the signal's name, or ``kestrel.sleep`` / ``kestrel.child:<id>`` (see
    :mod:`kestrel.workflow.waits`). *until* is when the wait ends by itself (a sleep's end, a
    delayed start, a give-back's backoff) or times out (a signal wait's timeout), if ever.
    """
    status = ex.status.value
    if status == "queued":
        if ex.queue_limit:
            return {"kind": "slot", "what": f"a slot in queue {ex.queue!r} "
                                            f"({ex.queue_limit})", "until": None}
        return {"kind": "worker", "what": f"a worker claiming queue {ex.queue!r}",
                "until": None}
    if status != "waiting":
        return None
    if ex.given_back_at is not None:
        versions = ", ".join(ex.given_back_by or [])
        return {"kind": "version", "what": f"a worker of an app version other than {versions} "
                                           f"(given back {ex.give_backs} time(s))",
                "until": ex.wake_at}
    on = ex.waiting_for
    if on is None:
        return {"kind": "start", "what": "its delayed start", "until": ex.wake_at}
    if on == "kestrel.sleep":
        return {"kind": "sleep", "what": "the end of a durable sleep", "until": ex.wake_at}
    if on.startswith("kestrel.child:"):  # a child's outcome arrives as this signal
        return {"kind": "child", "what": f"child execution {on.removeprefix('kestrel.child:')}",
                "until": ex.wait_deadline}
    return {"kind": "signal", "what": f"signal {on!r} (kestrel-runtime signal {ex.id} "
                                      f"{_shell_word(on)} --payload 'JSON')",
            "until": ex.wait_deadline}


def _shell_word(text: str) -> str:
    import shlex

    return shlex.quote(text)


def _when(value: datetime) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")



def cmd_cancel(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime cancel``: cancel an execution and print what that did.

    It was cancelled now, stops at its next step boundary (it is running), or had been
    cancelled already (exit 0: cancelling is idempotent).

    Raises:
        InvalidState: it had already completed, failed or been quarantined: nothing to
            cancel (as ``retry`` of an execution it cannot re-run).
    """
    from kestrel.errors import InvalidState

    if one_or_many(ns):
        return bulk.run(cfg, ns, "cancel")
    client, _server = common.client(cfg)
    eid = parse_id(ns.id)
    status = client.cancel(eid)
    if status not in ("cancelled", "cancelling"):
        raise InvalidState(f"execution {eid} already {status}; only a queued, running or "
                           "waiting execution can be cancelled")
    note = ("cancelled" if status == "cancelled" else
            "running: it stops at its next step boundary")
    return emit(ns, {"id": eid, "status": status}, lambda: print(f"{eid}: {note}"))


def cmd_retry(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime retry``: queue a failed, cancelled or quarantined execution again.

    It resumes from its last checkpoint.

    Raises:
        InvalidState: it is live or completed.
    """
    if one_or_many(ns):
        return bulk.run(cfg, ns, "retry")
    client, _server = common.client(cfg)
    eid = parse_id(ns.id)
    client.retry(eid, idempotency_key=ns.idempotency_key)
    return emit(ns, {"id": eid, "status": "queued"},
                 lambda: print(f"{eid}: queued again; it resumes from its last checkpoint"))


def cmd_fork(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime fork``: start a new execution from the first ``--from-step``
    checkpoints of another; print the new id."""
    client, _server = common.client(cfg)
    eid = parse_id(ns.id)
    if ns.from_step < 0:
        raise ConfigError(f"--from-step must be 0 or more, got {ns.from_step}")
    handle = client.fork(eid, ns.from_step, idempotency_key=ns.idempotency_key)
    return emit(ns, {"id": handle.id, "forked_from": eid, "from_step": ns.from_step},
                 lambda: print(handle.id))


def cmd_signal(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime signal``: send a signal; print whether a wait takes it.

    The payload is JSON (``--payload``); a signal sent before under the same
    ``--idempotency-key`` is not delivered again. A signal no wait can take (the execution
    has finished, or waits for a signal of another name: a misspelling, often) is kept and
    said so on stderr; with ``--strict`` the command then exits
    :data:`EXIT_NOT_TAKEN`, for scripts to catch.
    """
    if one_or_many(ns):
        return bulk.run(cfg, ns, "signal")
    payload = json_arg(ns.payload, "--payload")
    client, _server = common.client(cfg)
    eid = parse_id(ns.id)
    sent = client.signal(eid, ns.name, payload, idempotency_key=ns.idempotency_key)
    ex = client.get(eid)
    waiting = (ex.waiting_for if ex.status.value == "waiting" and ex.waiting_for
               and not ex.waiting_for.startswith("kestrel.") else None)
    if ex.status.terminal:
        why: str | None = (f"execution {eid} has {ex.status.value}; nothing will take "
                           "this signal")
    elif waiting is not None and waiting != ns.name:
        why = (f"execution {eid} waits for signal {waiting!r}, not {ns.name!r}; this one is "
               f"kept for a later wait_for_signal({ns.name!r}), if the workflow has one")
    else:
        why = None
    if not sent:
        msg = (f"{eid}: signal {ns.name!r} with key {ns.idempotency_key!r} was already "
               "delivered")
    elif why is None:
        msg = f"{eid}: signal {ns.name!r} delivered"
    else:
        msg = f"{eid}: signal {ns.name!r} kept, not taken"
    if why is not None:
        print(f"kestrel-runtime signal: {'error' if ns.strict else 'note'}: {why}",
              file=sys.stderr)
    emit(ns, {"id": eid, "signal": ns.name, "delivered": sent, "taken": why is None,
              "status": ex.status.value, "waiting_for": waiting}, lambda: print(msg))
    return EXIT_NOT_TAKEN if ns.strict and why is not None else 0


def one_or_many(ns: argparse.Namespace) -> bool:
    """Whether the command acts on the executions its filters match (kestrel.cli.bulk) rather
    than on the one id given.

    Raises:
        ConfigError: both an id and filters, or neither.
    """
    many = bulk.wants_bulk(ns)
    if ns.id is not None and many:
        raise ConfigError("give an execution id or filters (--status, --workflow, …), not "
                          "both")
    if ns.id is None and not many:
        raise ConfigError("give an execution id, or filters (--status, --workflow, --since, "
                          "…) to act on every execution they match")
    return many


def cmd_stats(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime stats``: print queue depth, running executions by worker, totals."""
    client, _server = common.client(cfg)
    st = client.stats()
    data = {"queues": [{"queue": q.queue, "status": q.status, "count": q.count,
                        "oldest_queued_age_s": q.oldest_age_s} for q in st.queues],
            "running_by_worker": st.running_by_worker, "totals": st.totals}

    def table() -> None:
        print(f"{'queue':<16} {'status':<9} {'count':>8} {'oldest queued':>14}")
        for q in st.queues:
            age = f"{q.oldest_age_s:13.1f}s" if q.oldest_age_s is not None else ""
            print(f"{q.queue[:16]:<16} {q.status:<9} {q.count:>8} {age:>14}")
        if not st.queues:
            print("(no live executions)")
        if st.running_by_worker:
            print(f"\n{'worker':<30} {'running':>8}")
            for worker, n in st.running_by_worker.items():
                print(f"{worker[:30]:<30} {n:>8}")
        print("\ntotals: " + "  ".join(f"{k} {st.totals.get(k, 0)}" for k in
                                      ("queued", "running", "waiting", "completed", "failed",
                                       "cancelled", "quarantined")))

    return emit(ns, data, table)

def list_options(ls: argparse.ArgumentParser) -> None:
    """``list``'s filters."""
    ls.add_argument("--status", help="queued, running, waiting, completed, failed, "
                                     "cancelled or quarantined.")
    ls.add_argument("--workflow", help="Only this workflow.")
    ls.add_argument("--since", help="Created since: an ISO time or an age like 30m, 6h, 7d.")
    ls.add_argument("--limit", type=int, default=50, help="Most rows shown (default: 50).")
    ls.add_argument("--app-version", metavar="V", default=argparse.SUPPRESS,
                    help="Only executions started by this application version.")
    ls.add_argument("--patch", metavar="ID", help="Only executions that recorded this patch.")
    ls.add_argument("--without-patch", metavar="ID", help="Only executions of the workflows "
                    "using this patch that did not record it (may need the old code path).")
    ls.add_argument("--tag", action="append", default=None, metavar="NAME=VALUE",
                    help="Only executions with this tag; repeat: all must match.")
    json_flag(ls)


def show_options(show: argparse.ArgumentParser) -> None:
    """``show``'s arguments."""
    id_arg(show)
    show.add_argument("--wait", type=float, default=None, metavar="SECONDS",
                      help="First wait up to this long for it to finish (exit 3 if it has "
                           "not).")
    json_flag(show)


def cancel_options(p: argparse.ArgumentParser) -> None:
    """``cancel``'s arguments: an execution id, or the filters of a bulk cancel."""
    _id_or_filters(p)
    json_flag(p)


def _id_or_filters(p: argparse.ArgumentParser) -> None:
    p.add_argument("id", nargs="?", default=None,
                   help="The execution's id (a UUID, as submit and list print it); leave it "
                        "out and give filters to act on every execution they match.")
    bulk.bulk_options(p)


def retry_options(retry: argparse.ArgumentParser) -> None:
    """``retry``'s arguments."""
    _id_or_filters(retry)
    retry.add_argument("--idempotency-key", default=None, metavar="KEY",
                       help="Run again with the same key after a connection error: a retry "
                            "that already happened is not an error.")
    json_flag(retry)


def fork_options(fork: argparse.ArgumentParser) -> None:
    """``fork``'s arguments."""
    id_arg(fork)
    fork.add_argument("--from-step", type=int, required=True, metavar="N",
                      help="How many of its checkpoints (steps 0..N-1) to reuse; the new "
                           "execution runs from step N.")
    fork.add_argument("--idempotency-key", default=None, metavar="KEY",
                      help="Same key → the same fork: run again after a connection error "
                           "without making a second one.")
    json_flag(fork)


def signal_options(sig: argparse.ArgumentParser) -> None:
    """``signal``'s arguments."""
    _id_or_filters(sig)
    sig.add_argument("name", help="The signal's name, as the workflow waits for it.")
    sig.add_argument("--payload", default="null", help="JSON payload (default: null).")
    sig.add_argument("--idempotency-key", default=None, metavar="KEY",
                     help="Send at most once per key.")
    sig.add_argument("--strict", action="store_true",
                     help=f"Exit {EXIT_NOT_TAKEN} when no wait can take the signal: the "
                          "execution has finished, or waits for a signal of another name "
                          "(the signal is kept either way).")
    json_flag(sig)


SUBMIT = Command(
    "submit", "Submit an execution; print its id.", cmd_submit, submit_options,
    CONNECTION + PAYLOAD,
    ("kestrel-runtime submit greet --args '[\"Ada\"]'",
     "kestrel-runtime submit deploy --args '[\"api\", 42]' --idempotency-key "
     "deploy-api-42 --wait 60"))
LIST = Command(
    "list", "List executions, newest first.", cmd_list, list_options,
    examples=("kestrel-runtime list --status waiting", "kestrel-runtime list --workflow deploy "
              "--since 6h --json"))
SHOW = Command(
    "show", "Show an execution: what it waits for, its deadline, its steps as a timeline.",
    cmd_show, show_options,
    examples=("kestrel-runtime show EXECUTION_ID", "kestrel-runtime show EXECUTION_ID --wait 30"))
CANCEL = Command(
    "cancel", "Cancel a live execution and its children, or all that filters match (exit 1 "
              "if it finished).", cmd_cancel, cancel_options,
    examples=("kestrel-runtime cancel EXECUTION_ID",
              "kestrel-runtime cancel --workflow deploy --status waiting --dry-run"))
RETRY = Command(
    "retry", "Re-run a failed, cancelled or quarantined execution from its last checkpoint, "
             "or all that filters match.", cmd_retry, retry_options,
    examples=("kestrel-runtime retry EXECUTION_ID --idempotency-key fix-1",
              "kestrel-runtime retry --status failed --since 2h --key outage-1207"))
FORK = Command(
    "fork", "Start a new execution of the same workflow and arguments that reuses the first N "
            "checkpoints of another; print its id.", cmd_fork, fork_options,
    examples=("kestrel-runtime fork EXECUTION_ID --from-step 2",))
SIGNAL = Command(
    "signal", "Signal an execution, or all that filters match.",
    cmd_signal, signal_options,
    CONNECTION + PAYLOAD,
    ("kestrel-runtime signal EXECUTION_ID approval --payload "
     "'{\"approved\": true, \"by\": \"ada\"}'",
     "kestrel-runtime signal approval --workflow deploy --status waiting --payload "
     "'{\"approved\": false}'"))
STATS = Command(
    "stats", "Queue depth by queue and status, oldest queued age, running by worker, totals.",
    cmd_stats, json_flag, examples=("kestrel-runtime stats --json",))
