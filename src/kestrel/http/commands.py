"""``kestrel-runtime token create|list|revoke``: tokens of the HTTP API.

A token is printed once, at creation; the database keeps only the hash of its secret.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg

from kestrel import codec, connections, db, statements
from kestrel.config import Config
from kestrel.errors import ConfigError, MigrationError
from kestrel.http import auth
from kestrel.sql import Queries, queries

T = TypeVar("T")


def token_command(cfg: Config, dsn: str, action: str,
                  args: dict[str, Any]) -> tuple[Any, str]:
    """Run token *action* (create, list, revoke) with the parsed *args*; return the data
    for ``--json`` and the text to print.

    Raises:
        ConfigError: a bad name or scope list, a name already in use, or no such token.
        MigrationError: the schema has no token table (not migrated to 0009 yet).
    """
    try:
        return _token_command(queries(cfg.schema), dsn, action, args)
    except psycopg.errors.UndefinedTable:
        raise MigrationError(f"schema {cfg.schema} has no token table; run `kestrel-runtime "
                             "migrate` as the schema owner") from None


RESENDS = 3
"""Times a token write is sent again after a connection error: it may have committed and
lost its reply (FAULTS R1), and each write learns that on the next try (same id and hash for
create; an already revoked token for revoke), so the token printed is the one stored."""


def _resending(dsn: str, write: Callable[[psycopg.Connection[Any], bool], T]) -> T:
    """Run *write* on a fresh connection, again (told it is a resend) after a connection
    error, up to :data:`RESENDS` times."""
    for attempt in range(RESENDS + 1):
        try:
            with connections.connect(dsn, prepare_threshold=None) as conn:
                return write(conn, attempt > 0)
        except psycopg.OperationalError as exc:
            if not connections.is_transient(exc) or attempt == RESENDS:
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def _token_command(q: Queries, dsn: str, action: str, args: dict[str, Any],
                   ) -> tuple[Any, str]:
    if action == "create":
        name = auth.check_name(args["name"])
        scopes = auth.parse_scopes(args["scopes"])
        token = auth.new_token()
        try:
            created = _resending(dsn, lambda conn, _: db.run_sync(
                conn, statements.http.create_token(q, id=token.id, name=name, scopes=scopes,
                                                   secret_hash=token.secret_hash)))
        except psycopg.errors.UniqueViolation:
            raise ConfigError(f"a live token is already named {name!r}; revoke it or "
                              "choose another name") from None
        if created is None:
            raise ConfigError(f"token id {token.id} is taken; run the command again")
        data = {"id": token.id, "name": name, "scopes": list(scopes),
                "created_at": created.isoformat(), "token": token.text}
        return data, (f"{token.text}\n(token {name}, id {token.id}, scopes "
                      f"{','.join(scopes)}: shown once, only its hash is stored)")
    if action == "list":
        with connections.connect(dsn, prepare_threshold=None) as conn:
            rows = db.run_sync(conn, statements.http.list_tokens(q))
        lines = [f"{'id':<16}  {'name':<24} {'scopes':<20} {'created':<25} revoked"]
        lines += [f"{r['id']:<16}  {r['name'][:24]:<24} {','.join(r['scopes']):<20} "
                  f"{r['created_at'][:25]:<25} {r['revoked_at'] or ''}" for r in rows]
        return rows, "\n".join(lines)
    key = codec.check_text(args["token"], what="token name or id", max_chars=128)

    def revoke(conn: psycopg.Connection[Any], resent: bool) -> list[str]:
        revoked = db.run_sync(conn, statements.http.revoke_token(q, key=key))
        if not revoked and resent:
            # The first try may have revoked it and lost its reply: the newest revoked token
            # of that id or name is the one it revoked (no live one is left either way).
            gone = [r for r in db.run_sync(conn, statements.http.list_tokens(q))
                    if key in (r["id"], r["name"]) and r["revoked_at"] is not None]
            revoked = [max(gone, key=lambda r: r["revoked_at"])["id"]] if gone else []
        return revoked

    revoked = _resending(dsn, revoke)
    if not revoked:
        raise ConfigError(f"no live token named or with id {key!r}")
    return {"revoked": revoked}, f"revoked {', '.join(revoked)}"
