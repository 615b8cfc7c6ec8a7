"""`deepinfer serve --ep-workers` (docs/expert-parallel.md): the server runs with an expert worker,
counts the exchange in /metrics, answers a request during the worker's outage with an error and
stays up (three failed steps: /ready 503 "failing"), and once the worker is back on its port turns
ready again by itself (/ready probes the worker) and serves the same greedy answer as before."""
import json
import os
import shutil
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

from conftest import Server, post

CHAT = {"model": "deepinfer-tiny", "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 6, "temperature": 0}


def worker(home, listen):
    """An expert worker on the built-in tiny model in `home`; (process, its port)."""
    p = subprocess.Popen([os.environ["DEEPINFER_BIN"], "expert-worker", "--listen", listen,
                          "--threads", "1", "--log-level", "error"],
                         env=dict(os.environ, DEEPINFER_HOME=home), stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    line = p.stdout.readline()
    assert line.startswith("listening on"), line
    return p, int(line.strip().rsplit(":", 1)[1])


def ready(s):
    """GET /ready: (status code, its "status" field)."""
    try:
        with urllib.request.urlopen(s.base + "/ready", timeout=30) as r:
            return r.status, json.loads(r.read())["status"]
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["status"]


class EpServer:
    """An expert worker on the built-in tiny model and a server using it (`serve` options in
    extra); `w` is the worker's process (a test may restart it on `port`)."""

    def __init__(self, prefix, extra=()):
        self.home = tempfile.mkdtemp(prefix=prefix)
        self.s = None
        self.w, self.port = worker(self.home, "127.0.0.1:0")
        try:
            self.s = Server(extra=["--model", os.path.join(self.home, "tiny-v4"),
                                   "--served-model-name", "deepinfer-tiny", "--ep-workers",
                                   f"127.0.0.1:{self.port}", *extra])
        except BaseException:
            self.close()
            raise

    def restart_worker(self):
        self.w, _ = worker(self.home, f"127.0.0.1:{self.port}")

    def close(self):
        rc, log = self.s.stop() if self.s else (0, "")
        self.w.terminate()
        self.w.wait(timeout=30)
        shutil.rmtree(self.home, ignore_errors=True)
        assert rc == 0, log

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def test_serve_survives_a_worker_outage():
    with EpServer("deepinfer-ep-") as ep:
        s = ep.s
        status, _, first = post(s, "/v1/chat/completions", CHAT)
        assert status == 200, first
        m = s.metrics()
        assert m["deepinfer:ep_requests_total"] > 0
        assert m["deepinfer:ep_rows_total"] > 0
        assert m["deepinfer:ep_errors_total"] == 0
        # The worker goes away: the request fails with an error, the server stays up.
        ep.w.terminate()
        ep.w.wait(timeout=30)
        status, _, body = post(s, "/v1/chat/completions", CHAT)
        assert status >= 500 and "error" in body, (status, body)
        assert s.proc.poll() is None
        assert s.metrics()["deepinfer:ep_errors_total"] >= 1
        # Three failed steps in a row: /ready says failing (a router stops sending).
        for _ in range(2):
            status, _, body = post(s, "/v1/chat/completions", CHAT)
            assert status >= 500, (status, body)
        assert ready(s) == (503, "failing")
        # Back on the same port: /ready probes the worker and turns ready without a request,
        # and the next request gives the same answer.
        ep.restart_worker()
        deadline = time.time() + 10
        while ready(s) != (200, "ready") and time.time() < deadline:
            time.sleep(0.2)
        assert ready(s) == (200, "ready")
        assert "every expert worker answers again" in s.logtext()
        status, _, again = post(s, "/v1/chat/completions", CHAT)
        assert status == 200, again
        assert again["choices"][0]["message"] == first["choices"][0]["message"]
        assert s.metrics()["deepinfer:ep_connects_total"] == 2


def test_serve_online_eplb():
    """--eplb-interval: placements planned and applied between steps; answers unchanged."""
    with EpServer("deepinfer-eplb-", ["--eplb-interval", "2", "--eplb-slots-per-rank", "5",
                                      "--eplb-min-gain", "1e-9"]) as ep:
        answers = []
        for _ in range(2):
            status, _, body = post(ep.s, "/v1/chat/completions", CHAT)
            assert status == 200, body
            answers.append(body["choices"][0]["message"])
        assert answers[0] == answers[1]
        m = ep.s.metrics()
        assert m["deepinfer:eplb_plans_total"] >= 2
        assert m["deepinfer:eplb_rebalances_total"] >= 1
        assert m["deepinfer:eplb_moved_replicas_total"] > 0
        assert m["deepinfer:eplb_balance"] >= 1.0
        assert m["deepinfer:eplb_plan_seconds_total"] > 0  # on the planner thread
