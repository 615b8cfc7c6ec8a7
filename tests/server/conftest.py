"""Starts `deepinfer serve` (the built-in tiny model) on 127.0.0.1 with a random free port and a
temporary $DEEPINFER_HOME, once per test session."""
import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest

MODEL = "deepinfer-tiny"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_metrics(base, key=lambda name: name):
    """The Prometheus text of base's /metrics as {key(name with labels): value}."""
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        out = {}
        for line in r.read().decode().splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[key(name)] = float(value)
        return out


class Server:
    def __init__(self, extra=(), env=None, port=None):
        self.home = tempfile.mkdtemp(prefix="deepinfer-home-")
        env = dict(os.environ, DEEPINFER_HOME=self.home, **(env or {}))
        self.log = open(os.path.join(self.home, "serve.log"), "w+")
        # A free port can be taken by a test running beside this one before serve binds it:
        # then serve exits saying so and a chosen (not given) port is chosen again.
        for _ in range(1 if port else 5):
            self.port = port or free_port()
            self.base = f"http://127.0.0.1:{self.port}"
            self.log.seek(0)
            self.log.truncate()
            self.proc = subprocess.Popen(
                [os.environ["DEEPINFER_BIN"], "serve", "--port", str(self.port), "--threads", "2",
                 "--keepalive", "1", *extra],
                env=env, stdout=self.log, stderr=subprocess.STDOUT)
            if self._wait_ready():
                return
            assert "cannot listen" in self.logtext(), self.logtext()
        raise RuntimeError("server found no free port:\n" + self.logtext())

    def _wait_ready(self):
        deadline = time.time() + 120
        while time.time() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                with urllib.request.urlopen(self.base + "/ready", timeout=2) as r:
                    if r.status == 200:
                        return True
            except OSError:
                time.sleep(0.2)
        raise RuntimeError("server did not become ready:\n" + self.logtext())

    def logtext(self):
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def metrics(self):
        # labels dropped, but a histogram's buckets and the responses by status keep theirs
        return read_metrics(self.base, lambda name: name.split("{")[0]
                            if "le=" not in name and "status=" not in name else name)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)
        rc = self.proc.returncode
        log = self.logtext()
        self.log.close()
        shutil.rmtree(self.home, ignore_errors=True)
        return rc, log


@pytest.fixture(scope="session")
def server():
    s = Server()
    yield s
    rc, log = s.stop()
    assert rc == 0, f"serve exited with {rc}:\n{log}"
    assert "INFO  serve: stopped" in log


def post(server, path, body, headers=None, raw=None):
    """POST returning (status, headers, parsed JSON or text)."""
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(server.base + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            status, hdrs, text = r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        status, hdrs, text = e.code, dict(e.headers), e.read().decode()
    try:
        return status, hdrs, json.loads(text)
    except ValueError:
        return status, hdrs, text


class Router:
    """`deepinfer route` on a random loopback port over `replicas` (with `prefill` replicas:
    prefill/decode disaggregation, the others then passed as --decode); ready once every replica
    of both kinds is healthy."""

    def __init__(self, replicas, extra=(), prefill=()):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="deepinfer-route-", suffix=".log")
        args = [os.environ["DEEPINFER_BIN"], "route", "--port", str(self.port),
                "--health-interval", "200ms", "--health-fails", "2", *extra]
        for r in replicas:
            args += ["--decode" if prefill else "--replica", r.base]
        for p in prefill:
            args += ["--prefill", p.base]
        self.proc = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 30
        while time.time() < deadline:
            assert self.proc.poll() is None, self.logtext()
            if self.ready() == 200 and self.healthy() == [1] * len(replicas) and \
                    self.healthy("deepinfer:router_prefill_replica_healthy") == [1] * len(prefill):
                return
            time.sleep(0.1)
        raise RuntimeError("router did not become ready:\n" + self.logtext())

    def logtext(self):
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def ready(self):
        try:
            with urllib.request.urlopen(self.base + "/ready", timeout=5) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return None

    def metrics(self):
        return read_metrics(self.base)

    def per_replica(self, family):
        m = self.metrics()
        vals = {}
        for k, v in m.items():
            if k.startswith(family + "{replica="):
                vals[int(k.split('replica="')[1].split('"')[0])] = v
        return [vals[i] for i in sorted(vals)]

    def healthy(self, family="deepinfer:router_replica_healthy"):
        try:
            return self.per_replica(family)
        except OSError:
            return None

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)
        log = self.logtext()
        self.log.close()
        return self.proc.returncode, log
