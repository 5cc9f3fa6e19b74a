"""The manual's generated reference pages: an MkDocs hook (``hooks:`` in mkdocs.yml).

A page holds a marker, ``<!-- generated: NAME -->``, where the reference goes; at each build
the marker is replaced by what the code says now, so the reference cannot go stale:

- ``cli``: every ``kestrel-runtime`` command's ``--help``, from :func:`kestrel.cli.build_parser`;
- ``configuration``: every setting (flag, environment variable, config key, default, meaning),
  from :data:`kestrel.config.KNOBS` and the defaults of :class:`kestrel.config.Config`;
- ``http``: every route of the HTTP API, from the OpenAPI document the server serves
  (:func:`kestrel.http.openapi.document` of :data:`kestrel.http.app.ENDPOINTS`);
- ``metrics``: every metric, its type, labels and help, from :class:`kestrel.metrics.Metrics`;
- ``sql-public`` and ``sql-internal``: the SQL functions of ``sql/functions/*.sql``
  and ``sql/partitions``, their signatures and the comment above each.

An unknown marker fails the build. ``python tools/docs_gen.py NAME`` prints one section.
The build also publishes the OpenAPI document itself as ``reference/openapi.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MARKER = re.compile(r"<!-- generated: ([\w-]+) -->")

# The functions other programs call (README and docs: "from any language or a trigger");
# every other function of the file is the runtime's own.
PUBLIC_SQL = ("submit", "signal", "cancel", "retry", "fork", "kestrel_now",
              "kestrel_functions_version", "number_reads_back")


def _cell(text: str) -> str:
    """*text* for a Markdown table cell: one line, pipes escaped, and ``<`` outside code
    spans written as an entity (so ``<hex>`` is text, not an HTML tag)."""
    parts = " ".join(str(text).split()).replace("|", "\\|").split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;").replace(">", "&gt;")
                    for i, p in enumerate(parts))


def _code(text: str, lang: str = "text") -> str:
    return f"```{lang}\n{text.rstrip()}\n```\n"


# -- the CLI --------------------------------------------------------------------------------


def _subparsers(parser: argparse.ArgumentParser) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            yield from action.choices.items()


def cli() -> str:
    from kestrel.cli import build_parser

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal: the same width each build
    try:
        parser = build_parser()
        out = ["## kestrel-runtime\n", _code(parser.format_help())]
        for name, sub in _subparsers(parser):
            out += [f"## {name}\n", _code(sub.format_help())]
            for action, subsub in _subparsers(sub):
                out += [f"### {name} {action}\n", _code(subsub.format_help())]
    finally:
        if old is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = old
    return "\n".join(out)


# -- settings -------------------------------------------------------------------------------


def _default(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(value)
    if isinstance(value, bool):
        return str(value).lower()
    if value in ("", None):
        return "(none)"
    return str(value)


def configuration() -> str:
    from kestrel.config import KNOBS, Config

    defaults = {f.name: f.default for f in dataclasses.fields(Config)}
    rows = ["| flag | environment | config key | default | meaning |",
            "| --- | --- | --- | --- | --- |"]
    for k in KNOBS:
        flag = f"{k.flag} {k.metavar}".strip()
        rows.append(f"| `{flag}` | `{k.env}` | `{k.name}` | "
                    f"`{_default(defaults.get(k.name))}` | {_cell(k.help.replace('%%', '%'))} |")
    return "\n".join(rows) + "\n"


# -- the HTTP API ---------------------------------------------------------------------------


def openapi_document() -> dict[str, Any]:
    from kestrel.http.app import ENDPOINTS
    from kestrel.http.openapi import document

    return document(ENDPOINTS)


def http() -> str:
    doc = openapi_document()
    out: list[str] = []
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            out.append(f"### `{method.upper()} {path}`\n")
            out.append(f"**{op['summary']}** {op['description'].strip()}\n")
            scopes = [s for sec in op.get("security", []) for s in sec.get("bearer", [])]
            out.append(f"Scope: {', '.join(f'`{s}`' for s in scopes) or 'none'}.\n")
            params = op.get("parameters", [])
            if params:
                out.append("| parameter | in | required | description |\n| --- | --- | --- | --- |")
                out += [f"| `{p['name']}` | {p['in']} | {'yes' if p['required'] else 'no'} | "
                        f"{_cell(p.get('description', ''))} |" for p in params]
                out.append("")
            body = op.get("requestBody")
            if body:
                schema = body["content"]["application/json"]["schema"]
                out.append("Request body (JSON):\n")
                out.append(_code(json.dumps(schema, indent=2), "json"))
            out.append("| status | meaning |\n| --- | --- |")
            out += [f"| {code} | {_cell(r['description'])} |"
                    for code, r in op["responses"].items()]
            out.append("")
    return "\n".join(out)


# -- metrics --------------------------------------------------------------------------------


def metrics() -> str:
    from kestrel import metrics as m

    rows = ["| metric | type | labels | meaning |", "| --- | --- | --- | --- |"]
    for metric in vars(m.get()).values():
        kind = metric._type
        name = metric._name + ("_total" if kind == "counter" else "")
        labels = ", ".join(f"`{label}`" for label in metric._labelnames) or "—"
        rows.append(f"| `{name}` | {kind} | {labels} | {_cell(metric._documentation)} |")
    return "\n".join(rows) + "\n"


# -- SQL functions --------------------------------------------------------------------------


def sql_functions() -> list[tuple[str, str, str]]:
    """(name, signature, comment) of each ``-- name:`` block of the SQL function files."""
    found = []
    for path in (*sorted((ROOT / "sql/functions").glob("*.sql")),
                 *sorted((ROOT / "sql/partitions").glob("*.sql"))):
        for block in re.split(r"^-- name: ", path.read_text(), flags=re.MULTILINE)[1:]:
            name, _, rest = block.partition("\n")
            comment = rest[:rest.find("CREATE")] if "CREATE" in rest else rest
            comment = "\n".join(re.sub(r"^-- ?", "", line) for line in comment.splitlines())
            create = re.search(r"CREATE OR REPLACE FUNCTION (.*?)\n(?:LANGUAGE|AS|STABLE|"
                               r"IMMUTABLE|VOLATILE|SECURITY|SET |PARALLEL)", rest, re.DOTALL)
            signature = create.group(1).replace("__schema__.", "kestrel.") if create else ""
            found.append((name.strip(), signature.strip(), comment.strip()))
    return found


def _sql(public: bool) -> str:
    out = []
    for name, signature, comment in sql_functions():
        if (name in PUBLIC_SQL) != public:
            continue
        out += [f"### `{name}`\n", _code(signature, "sql") if signature else "",
                comment.replace("<", "&lt;") + "\n"]
    return "\n".join(out)


GENERATORS: dict[str, Callable[[], str]] = {
    "cli": cli,
    "configuration": configuration,
    "http": http,
    "metrics": metrics,
    "sql-public": lambda: _sql(True),
    "sql-internal": lambda: _sql(False),
}


# -- the MkDocs hook ------------------------------------------------------------------------


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    """Replace each ``<!-- generated: NAME -->`` marker with its section."""
    def expand(m: re.Match[str]) -> str:
        name = m.group(1)
        if name not in GENERATORS:
            from mkdocs.exceptions import PluginError

            raise PluginError(f"{page.file.src_uri}: unknown generated section {name!r} "
                              f"(known: {', '.join(GENERATORS)})")
        return GENERATORS[name]()

    return MARKER.sub(expand, markdown)


def on_files(files: Any, config: Any) -> Any:
    """The OpenAPI document beside the HTTP reference (``reference/openapi.json``), as the
    server serves it."""
    from mkdocs.structure.files import File

    files.append(File.generated(config, "reference/openapi.json",
                                content=json.dumps(openapi_document(), indent=2) + "\n"))
    return files


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    print(GENERATORS[sys.argv[1]]())
