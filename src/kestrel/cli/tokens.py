"""``kestrel-runtime token create|list|revoke``: the HTTP API's tokens (kestrel.http)."""

from __future__ import annotations

import argparse

from kestrel.cli.common import Command, emit, json_flag
from kestrel.config import Config
from kestrel.embedded import resolve_dsn


def cmd_token(cfg: Config, ns: argparse.Namespace) -> int:
    """``kestrel-runtime token create|list|revoke``: manage HTTP API tokens."""
    from kestrel.http.commands import token_command

    dsn, _server = resolve_dsn(cfg, create=False)
    data, text = token_command(cfg, dsn, ns.token_command, vars(ns))
    return emit(ns, data, lambda: print(text))


def create_options(tc: argparse.ArgumentParser) -> None:
    """``token create``'s options."""
    tc.add_argument("--name", required=True, help="A name to know it by (unique while live).")
    tc.add_argument("--scopes", required=True, help="Comma-separated: read, operate, submit.")
    json_flag(tc)


def revoke_options(tr: argparse.ArgumentParser) -> None:
    """``token revoke``'s arguments."""
    tr.add_argument("token", help="The token's name or public id.")
    json_flag(tr)


TOKEN = Command(
    "token", "Manage HTTP API tokens: create (printed once), list, revoke.", cmd_token,
    examples=("kestrel-runtime token create --name ci --scopes submit,read",
              "kestrel-runtime token revoke ci"),
    action_dest="token_command",
    actions=(
        Command("create", "Create a token; print it once (only its hash is stored).", None,
                create_options),
        Command("list", "List tokens: ids, names, scopes (never secrets).", None, json_flag),
        Command("revoke", "Revoke a token by name or id; it is refused at once.", None,
                revoke_options),
    ))
