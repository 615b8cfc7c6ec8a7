"""Loopback processes for the router benchmarks (overhead.py, pd.py): free ports, `deepinfer serve`
and `deepinfer route` started with their stderr discarded, waiting for a port's /ready, and
stopping them, the last started first."""
import os
import socket
import subprocess
import tempfile
import time
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port, tries):
    """Polls port's /ready every 0.1 s (after a refused connection), at most `tries` times."""
    for _ in range(tries):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"port {port} not ready")


def serve_env():
    """The environment of `deepinfer serve`: DEEPINFER_HOME a new temporary folder (the built-in
    tiny model is written there)."""
    return dict(os.environ, DEEPINFER_HOME=tempfile.mkdtemp(prefix="deepinfer-bench-"))


def start(argv, env=None):
    return subprocess.Popen(argv, env=env, stderr=subprocess.DEVNULL)


def stop(procs):
    for p in reversed(procs):
        p.terminate()
        p.wait(timeout=60)
