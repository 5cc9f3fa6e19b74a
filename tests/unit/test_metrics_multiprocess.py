"""Multiprocess metrics as the supervisor sets them up: a forked worker writes its own file,
starting from zero, and an increment asks the kernel for nothing (no getpid() per update).

Each case runs in a fresh interpreter: prometheus_client chooses its storage when it is
imported, which this test process did long ago."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

CHILD = textwrap.dedent("""
    import json, os, sys
    from kestrel import metrics

    directory = metrics.prepare_multiprocess(sys.argv[1])
    from prometheus_client import Counter, Histogram

    counter = Counter("kestrel_test_things_total", "things", ["kind"])
    histogram = Histogram("kestrel_test_seconds", "seconds", buckets=(0.1, 1.0))
    counter.labels("a").inc()

    calls = []

    def profile(frame, event, arg):
        if event == "c_call":
            calls.append(getattr(arg, "__name__", "?"))

    sys.setprofile(profile)
    for _ in range(50):
        counter.labels("a").inc()
        histogram.observe(0.5)
    sys.setprofile(None)

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        counter.labels("a").inc(7)
        os.write(w, b"x")
        os._exit(0)
    os.read(r, 1)
    os.waitpid(pid, 0)
    counter.labels("a").inc()
    print(json.dumps({"parent": os.getpid(), "child": pid, "dir": directory,
                      "getpid_calls": calls.count("getpid")}))
""")


def _files(directory: str) -> dict[str, float]:
    from prometheus_client.mmap_dict import MmapedDict

    found = {}
    for path in Path(directory).glob("counter_*.db"):
        d = MmapedDict(str(path), read_mode=True)
        try:
            for key, value, _ts in d.read_all_values():
                if "kestrel_test_things_total" in key:
                    found[path.name] = value
        finally:
            d.close()
    return found


def test_a_fork_writes_its_own_file_and_no_increment_calls_getpid(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path / "m")],
                         capture_output=True, text=True, timeout=60, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    # 100 updates, not one system call to learn the pid (prometheus_client's default asks
    # on each: 100 calls)
    assert got["getpid_calls"] == 0
    # the child's 7 in its own file, from zero: the parent's 52 were not copied into it
    assert _files(got["dir"]) == {f"counter_{got['parent']}.db": 52.0,
                                  f"counter_{got['child']}.db": 7.0}
