"""Start a real PgBouncer (Debian's, 1.18) in transaction mode in front of the test server."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import psycopg


def binary() -> str | None:
    return shutil.which("pgbouncer") or (
        "/usr/sbin/pgbouncer" if os.path.exists("/usr/sbin/pgbouncer") else None)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PgBouncer:
    """One pgbouncer process; ``restart()`` kills it (SIGKILL) and starts it again."""

    def __init__(self, direct_dsn: str, *, pool_size: int = 8) -> None:
        parts = urlsplit(direct_dsn)
        query = parse_qs(parts.query)
        socket_dir = query["host"][0] if "host" in query else (parts.hostname or "127.0.0.1")
        db = parts.path.lstrip("/") or "postgres"
        # The server's own port: without it pgbouncer reaches whatever listens on 5432.
        port = query["port"][0] if "port" in query else (parts.port or 5432)
        user = parts.username or "postgres"
        self.port = free_port()
        # pgbouncer drops root for the server's system user, which must reach this folder:
        # a fresh one directly under /tmp, not inside pytest's private (0700) tree.
        self.workdir = workdir = Path(tempfile.mkdtemp(prefix="kestrel-pgbouncer-"))
        os.chmod(workdir, 0o777)
        (workdir / "users.txt").write_text(f'"{user}" ""\n')
        (workdir / "pgbouncer.ini").write_text(f"""
[databases]
{db} = host={socket_dir} port={port} dbname={db} user={user}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = trust
admin_users = {user}
auth_file = {workdir / 'users.txt'}
pool_mode = transaction
default_pool_size = {pool_size}
max_client_conn = 1000
ignore_startup_parameters = extra_float_digits,options
server_check_delay = 1
# A refused login (the server busy or restarting under a test) is tried again after 1 s, not
# the default 15 s during which every client's login fails: one test's fault stays its own.
server_login_retry = 1
logfile = {workdir / 'pgbouncer.log'}
pidfile = {workdir / 'pgbouncer.pid'}
""")
        self.dsn = f"postgresql://{user}@127.0.0.1:{self.port}/{db}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        exe = binary()
        assert exe, "pgbouncer is not installed (.ci/run installs it)"
        user = "pgserver" if os.geteuid() == 0 else None  # it refuses to run as root
        cmd = [exe, *(["-u", user] if user else []), str(self.workdir / "pgbouncer.ini")]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while True:
            try:
                with psycopg.connect(self.dsn, connect_timeout=2) as conn:
                    conn.execute("SELECT 1")
                return
            except psycopg.OperationalError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise
                time.sleep(0.1)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def admin(self, command: str) -> None:
        """A command on the admin console (PAUSE, RESUME, RECONNECT, ...). The console
        speaks only the simple query protocol: a client-side-binding cursor uses it."""
        admin = self.dsn.rsplit("/", 1)[0] + "/pgbouncer"
        with psycopg.connect(admin, autocommit=True,
                             cursor_factory=psycopg.ClientCursor) as conn:
            conn.execute(command)

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)
