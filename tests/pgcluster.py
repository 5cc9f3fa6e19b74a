"""A PostgreSQL cluster of a test's own, which the test may restart, crash, replicate,
promote or put behind TLS. It runs the PostgreSQL binaries that ship with pgserver (the
embedded server's wheel), so nothing beyond ``pip install`` is needed.

As root the server runs as the ``pgserver`` system user (PostgreSQL refuses root); the
data lives in a fresh folder under /tmp that user can reach.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path

from tests.helpers import alive
from tests.pgbouncer import free_port


def embedded_bindir() -> Path:
    """The binaries in pgserver's wheel (built without OpenSSL)."""
    import pgserver  # type: ignore[import-untyped]

    return Path(pgserver.__file__).parent / "pginstall" / "bin"


def system_bindir() -> Path:
    """The distribution's PostgreSQL (built with OpenSSL), for what pgserver's lacks: TLS.
    .ci/run installs it (Debian: postgresql-15)."""
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"))
    assert found, "no system PostgreSQL under /usr/lib/postgresql: .ci/run installs it"
    return found[-1].parent


def _run_as() -> str | None:
    if os.geteuid() != 0:
        return None
    try:
        pwd.getpwnam("pgserver")
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "pgserver"], check=True)
    return "pgserver"


class Cluster:
    """One PostgreSQL server on 127.0.0.1:*port* with trust authentication for local tests.

    ``conf`` lines go to postgresql.conf; ``hba`` replaces pg_hba.conf when given."""

    def __init__(self, name: str = "kestrel", *, conf: dict[str, str] | None = None,
                 hba: Iterable[str] | None = None, init: bool = True,
                 bindir: Path | None = None) -> None:
        self.bindir = bindir or embedded_bindir()
        self.user = _run_as()
        self.root = Path(tempfile.mkdtemp(prefix=f"{name}-"))
        os.chmod(self.root, 0o777)
        self.data = self.root / "data"
        self.sockets = self.root / "sock"
        self.sockets.mkdir()
        os.chmod(self.sockets, 0o777)
        self.port = free_port()
        self.log = self.root / "server.log"
        if init:
            self._cmd("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust",
                      "--no-sync", "-E", "UTF8", "--locale=C")
            self.configure(conf or {}, hba)

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _cmd(self, exe: str, *args: str, timeout: float = 120) -> str:
        out = subprocess.run([str(self.bindir / exe), *args], user=self.user, cwd=self.root,
                             check=True, capture_output=True, text=True, timeout=timeout)
        return out.stdout

    def configure(self, conf: dict[str, str], hba: Iterable[str] | None = None) -> None:
        settings = {"listen_addresses": "'127.0.0.1'", "port": str(self.port),
                    "unix_socket_directories": f"'{self.sockets}'", "fsync": "on",
                    "max_connections": "200", "shared_buffers": "64MB", **conf}
        with open(self.data / "postgresql.auto.conf", "a") as f:
            f.writelines(f"{k} = {v}\n" for k, v in settings.items())
        if hba is not None:
            (self.data / "pg_hba.conf").write_text("".join(f"{line}\n" for line in hba))

    def start(self) -> None:
        self._cmd("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-w", "-t", "60",
                  "start")

    def stop(self, mode: str = "fast") -> None:
        self._cmd("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def restart(self, mode: str = "fast") -> None:
        """``-m immediate`` is a crash: the next start replays WAL (crash recovery)."""
        self._cmd("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-m", mode, "-w",
                  "-t", "60", "restart")

    def kill9(self) -> None:
        """SIGKILL the postmaster and every backend at once, as a machine failure would (a
        backend left behind would hold the shared memory and stop the next start). The
        postmaster is stopped first so that it forks no backend between the listing and
        the kill."""
        pid = int((self.data / "postmaster.pid").read_text().split()[0])
        os.kill(pid, signal.SIGSTOP)
        children = [int(c) for c in subprocess.run(["pgrep", "-P", str(pid)],
                                                   capture_output=True, text=True).stdout.split()]
        for p in [pid, *children]:
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(p) for p in [pid, *children]):
            time.sleep(0.05)
        # The dead postmaster may linger as a zombie until its parent (init) reaps it, and
        # PostgreSQL takes a lock file naming a pid that still exists for a live server:
        # remove the stale locks (data folder and socket), as an operator would.
        if not alive(pid):
            (self.data / "postmaster.pid").unlink(missing_ok=True)
            for lock in self.sockets.glob(".s.PGSQL.*.lock"):
                lock.unlink(missing_ok=True)

    def promote(self) -> None:
        self._cmd("pg_ctl", "-D", str(self.data), "-w", "-t", "60", "promote")

    def running(self) -> bool:
        """Whether this cluster's postmaster is alive (not merely named in postmaster.pid)."""
        try:
            return alive(int((self.data / "postmaster.pid").read_text().split()[0]))
        except (FileNotFoundError, IndexError, ValueError):
            return False

    def replica(self, name: str = "replica") -> Cluster:
        """A streaming standby of this server (pg_basebackup -R), configured, not started."""
        other = Cluster(name, init=False, bindir=self.bindir)
        self._cmd("pg_basebackup", "-D", str(other.data), "-h", "127.0.0.1", "-p",
                  str(self.port), "-U", "postgres", "-X", "stream", "-R", "--no-sync")
        # The copied settings name the primary's port and socket folder: override them.
        # A promoted standby has no standby of its own: it must not wait for one.
        other.configure({"synchronous_standby_names": "''"})
        with open(other.data / "postgresql.auto.conf", "a") as f:
            f.write(f"primary_conninfo = 'host=127.0.0.1 port={self.port} user=postgres "
                    f"application_name=replica'\n")
        return other

    def destroy(self) -> None:
        if self.running():
            try:
                self.stop("immediate")
            except subprocess.CalledProcessError:
                pass
        shutil.rmtree(self.root, ignore_errors=True)
