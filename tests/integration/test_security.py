"""S4: the runtime works under a least-privilege role (DML only, no DDL); migrations and
partition upkeep belong to the owner."""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest
from psycopg import sql as pgsql

from tests.helpers import finished_count, q, runtime, submit_many, wait_until


def as_role(dsn: str, role: str) -> str:
    parts = urlsplit(dsn)
    host = parts.netloc.rsplit("@", 1)[-1]
    return urlunsplit(parts._replace(netloc=f"{role}@{host}"))


def _server_log(dsn: str) -> Path | None:
    """The log of the suite's embedded server (pgserver writes ``log`` in its data
    directory, where its socket is), or None for a server of another kind."""
    from psycopg.conninfo import conninfo_to_dict

    host = str(conninfo_to_dict(dsn).get("host") or "")
    found = Path(host) / "log" if host.startswith("/") else None
    return found if found is not None and found.is_file() else None


def test_runtime_role_without_ddl_rights(direct_dsn: str, schema: str, tmp_path: Path) -> None:
    role = f"kestrel_rt_{uuid.uuid4().hex[:8]}"
    s = pgsql.Identifier(schema)
    with psycopg.connect(direct_dsn, autocommit=True) as conn:
        conn.execute(pgsql.SQL("CREATE ROLE {} LOGIN").format(pgsql.Identifier(role)))
        r = pgsql.Identifier(role)
        conn.execute(pgsql.SQL("GRANT USAGE ON SCHEMA {} TO {}").format(s, r))
        conn.execute(pgsql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA "
                               "{} TO {}").format(s, r))
        conn.execute(pgsql.SQL("GRANT USAGE ON ALL SEQUENCES IN SCHEMA {} TO {}").format(s, r))
    runtime_dsn = as_role(direct_dsn, role)
    server_log = _server_log(direct_dsn)
    try:
        with psycopg.connect(runtime_dsn, autocommit=True) as conn, \
                pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute(pgsql.SQL("CREATE TABLE {}.intruder (x int)").format(s))
        logged = server_log.stat().st_size if server_log else 0  # the refusal above: ours
        submit_many(direct_dsn, schema, "three_steps", "jsonb_build_array(i)", 200)
        submit_many(direct_dsn, schema, "waiter", "'[]'::jsonb", 10)
        log = tmp_path / "rt.log"
        # --history-ahead 6 asks upkeep for partitions that do not exist yet: DDL it may not run.
        with runtime(runtime_dsn, schema, procs=2,
                     args=["--maintenance-interval", "0.5", "--history-ahead", "6"],
                     log=log):
            wait_until(lambda: q(direct_dsn, schema, "SELECT count(*) FROM "
                                 "{s}.workflow_executions WHERE status = 'waiting'")[0][0] == 10,
                       timeout=60, what="the waits")
            q(direct_dsn, schema, "SELECT {s}.signal(id, 'go', '1') FROM "
              "{s}.workflow_executions WHERE status = 'waiting'")
            wait_until(lambda: finished_count(direct_dsn, schema) == 210, timeout=60,
                       what="every workflow under the restricted role")
        text = log.read_text()
        assert "not migrating (this role may not run DDL)" in text
        assert "partition upkeep needs the schema owner" in text
        assert "worker crashed" not in text
        # Asked, never tried: no DDL refused in the server's log (issue 44 row 3: on Citus
        # every start left "must be owner" errors in each worker node's log).
        if server_log is not None:
            with server_log.open("rb") as f:
                f.seek(logged)
                added = f.read().decode(errors="replace")
            refused = [line for line in added.splitlines()
                       if "permission denied" in line or "must be owner" in line]
            assert not refused, refused
    finally:
        with psycopg.connect(direct_dsn, autocommit=True) as conn:
            r = pgsql.Identifier(role)
            conn.execute(pgsql.SQL("DROP OWNED BY {}").format(r))
            conn.execute(pgsql.SQL("DROP ROLE {}").format(r))


def test_a_runtime_role_refuses_functions_older_than_its_code(pg_dsn: str,
                                                               schema: str) -> None:
    """A role that may not migrate checks the schema at boot: the migration, and the
    functions (migrate replaces them every run, with no migration, so a schema whose owner
    has not run this code's migrate has the migration but older functions, which would
    silently do the old thing: finish_batch() dropping a completion's tail)."""
    from kestrel import boot
    from kestrel.errors import MigrationError
    from kestrel.migrate import readiness
    from kestrel.sql import functions_version

    want = functions_version()
    assert want >= 2
    boot.check_schema_current(pg_dsn, schema)
    assert readiness(pg_dsn, schema)[0]

    def functions_at(version: int | None) -> None:
        if version is None:
            q(pg_dsn, schema, "DROP FUNCTION {s}.kestrel_functions_version()")
        else:
            q(pg_dsn, schema, "CREATE OR REPLACE FUNCTION {s}.kestrel_functions_version() "
              f"RETURNS integer LANGUAGE sql IMMUTABLE AS 'SELECT {version}'")

    for older, shown in ((want - 1, want - 1), (None, 0)):
        functions_at(older)
        with pytest.raises(MigrationError, match=rf"functions are at version {shown}, this "
                           rf"code needs {want}.*run `kestrel-runtime migrate`"):
            boot.check_schema_current(pg_dsn, schema)
        ready, why = readiness(pg_dsn, schema)
        assert not ready and f"functions are at version {shown}" in why
    functions_at(want + 1)  # newer functions serve code one version older
    boot.check_schema_current(pg_dsn, schema)
    assert readiness(pg_dsn, schema)[0]


def _tls_files(folder: Path, hostname: str) -> dict[str, Path]:
    """A private CA and a server certificate for *hostname* signed by it (openssl CLI)."""
    ca_key, ca, key, csr, cert = (folder / n for n in
                                  ("ca.key", "ca.crt", "server.key", "server.csr", "server.crt"))

    def ssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True)

    ssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
        "/CN=kestrel test CA", "-keyout", str(ca_key), "-out", str(ca))
    ssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={hostname}",
        "-keyout", str(key), "-out", str(csr))
    ext = folder / "san.ext"
    ext.write_text(f"subjectAltName = DNS:{hostname}\n")
    ssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key),
        "-CAcreateserial", "-days", "2", "-extfile", str(ext), "-out", str(cert))
    return {"ca": ca, "key": key, "cert": cert}


def test_s6_tls_only_server_with_another_hostname_is_refused_under_verify_full(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A server that accepts TLS only, whose certificate names db.kestrel.test. Reached as
    127.0.0.1 under sslmode=verify-full the runtime refuses it (the certificate is for
    someone else) before writing anything; reached by its name it works."""
    from kestrel.cli import main
    from tests.pgcluster import Cluster, system_bindir

    cluster = Cluster("kestrel-tls", bindir=system_bindir(), hba=[
        "local all all trust",
        "hostssl all all 127.0.0.1/32 trust",
        "hostnossl all all 0.0.0.0/0 reject",
    ])
    try:
        files = _tls_files(cluster.root, "db.kestrel.test")
        if cluster.user:
            shutil.chown(files["key"], cluster.user)
            shutil.chown(files["cert"], cluster.user)
        os.chmod(files["key"], 0o600)
        cluster.configure({"ssl": "on", "ssl_cert_file": f"'{files['cert']}'",
                           "ssl_key_file": f"'{files['key']}'"})
        cluster.start()
        base = f"port={cluster.port} user=postgres dbname=postgres connect_timeout=5"
        verify = f"sslmode=verify-full sslrootcert={files['ca']}"

        def migrate(dsn: str) -> tuple[int, str]:
            code = main(["migrate", "--dsn", dsn, "--schema", "tls_check"])
            out, err = capsys.readouterr()
            return code, out + err

        code, text = migrate(f"host=127.0.0.1 {base} {verify}")
        assert code != 0
        assert "cannot connect to the database" in text
        assert 'server certificate for "db.kestrel.test"' in text
        assert 'does not match host name "127.0.0.1"' in text
        code, text = migrate(f"host=127.0.0.1 {base} sslmode=disable")
        assert code != 0 and "no encryption" in text  # TLS only: plaintext is rejected
        # Nothing was written by the refused attempts.
        named = f"host=db.kestrel.test hostaddr=127.0.0.1 {base} {verify}"
        with psycopg.connect(named) as conn:
            assert conn.info.pgconn.ssl_in_use
            assert conn.execute("SELECT count(*) FROM pg_namespace WHERE nspname = "
                                "'tls_check'").fetchone() == (0,)
        # The same server by the name its certificate carries: verified, and it works.
        code, text = migrate(named)
        assert code == 0, text
    finally:
        cluster.destroy()
