"""A real nginx in front of the HTTP door, configured by ``deploy/nginx/kestrel.conf.template``
itself: its two ``${VAR}``s filled in as the official nginx image does at start, wrapped in
the few top-level lines a server block needs. Debian's ``nginx-light`` (``.ci/run`` installs
it)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

from tests.helpers import ROOT

TEMPLATE = ROOT / "deploy" / "nginx" / "kestrel.conf.template"


def binary() -> str | None:
    return shutil.which("nginx") or next(
        (p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)


class Nginx:
    """nginx on 127.0.0.1:*port* proxying to the door at 127.0.0.1:*upstream*."""

    def __init__(self, port: int, upstream: int) -> None:
        exe = binary()
        assert exe, "nginx is not installed (.ci/run installs nginx-light)"
        self.port = port
        self.workdir = Path(tempfile.mkdtemp(prefix="kestrel-nginx-"))
        os.chmod(self.workdir, 0o777)  # its workers may run as another user
        server = (TEMPLATE.read_text().replace("${NGINX_PORT}", f"127.0.0.1:{port}")
                  .replace("${DOOR_UPSTREAM}", f"127.0.0.1:{upstream}"))
        assert "${" not in server, "a variable of the template was not filled in"
        (self.workdir / "kestrel.conf").write_text(server)
        temp = "\n".join(f"  {kind}_temp_path {self.workdir / kind};"
                         for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
        (self.workdir / "nginx.conf").write_text(f"""
{"user root;" if os.geteuid() == 0 else ""}
daemon off;
worker_processes 1;
pid {self.workdir / 'nginx.pid'};
error_log {self.workdir / 'error.log'} warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
{temp}
  include {self.workdir / 'kestrel.conf'};
}}
""")
        check = subprocess.run([exe, "-t", "-p", str(self.workdir), "-c",
                                str(self.workdir / "nginx.conf")], capture_output=True,
                               text=True)
        assert check.returncode == 0, check.stderr
        self.proc = subprocess.Popen([exe, "-p", str(self.workdir), "-c",
                                      str(self.workdir / "nginx.conf")],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        import socket

        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                return
            except OSError:
                assert time.monotonic() < deadline and self.proc.poll() is None, (
                    self.log())
                time.sleep(0.1)

    def log(self) -> str:
        try:
            return (self.workdir / "error.log").read_text()[-3000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)
