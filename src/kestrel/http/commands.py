"""``kestrel-runtime token create|list|revoke``: tokens of the HTTP API.

A token is printed once, at creation; the database keeps only the hash of its secret.
"""

from __future__ import annotations

from typing import Any

import psycopg

from kestrel import codec, db
from kestrel.config import Config
from kestrel.errors import ConfigError, MigrationError
from kestrel.http import auth, store
from kestrel.sql import Queries, queries


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


def _token_command(q: Queries, dsn: str, action: str, args: dict[str, Any],
                   ) -> tuple[Any, str]:
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn:
        if action == "create":
            name = auth.check_name(args["name"])
            scopes = auth.parse_scopes(args["scopes"])
            token = auth.new_token()
            try:
                created = db.run_sync(conn, store.create_token(
                    q, id=token.id, name=name, scopes=scopes, secret_hash=token.secret_hash))
            except psycopg.errors.UniqueViolation:
                raise ConfigError(f"a live token is already named {name!r}; revoke it or "
                                  "choose another name") from None
            data = {"id": token.id, "name": name, "scopes": list(scopes),
                    "created_at": created.isoformat(), "token": token.text}
            return data, (f"{token.text}\n(token {name}, id {token.id}, scopes "
                          f"{','.join(scopes)}: shown once, only its hash is stored)")
        if action == "list":
            rows = db.run_sync(conn, store.list_tokens(q))
            lines = [f"{'id':<16}  {'name':<24} {'scopes':<20} {'created':<25} revoked"]
            lines += [f"{r['id']:<16}  {r['name'][:24]:<24} {','.join(r['scopes']):<20} "
                      f"{r['created_at'][:25]:<25} {r['revoked_at'] or ''}" for r in rows]
            return rows, "\n".join(lines)
        key = codec.check_text(args["token"], what="token name or id", max_chars=128)
        revoked = db.run_sync(conn, store.revoke_token(q, key=key))
        if not revoked:
            raise ConfigError(f"no live token named or with id {key!r}")
        return {"revoked": revoked}, f"revoked {', '.join(revoked)}"
