"""Health reporting when the engine's steps fail (a device whose every step fails, e.g. after a
sticky CUDA error): DI_ENGINE_FAIL_STEPS=N makes the first N steps fail as a device fault would.
Each request below takes one step (a short prompt), so requests 1..N fail; from the 3rd failure in
a row /ready and /health answer 503 "failing"; the next request that runs ends it."""
import json
import time
import urllib.error
import urllib.request

from conftest import Server, post

CHAT = {"model": "deepinfer-tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def get(server, path):
    try:
        with urllib.request.urlopen(server.base + path, timeout=10) as r:
            return r.status, json.loads(r.read().decode())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def get_after(server, path, want, timeout_s=10.0):
    """GET path until it answers want (at most timeout_s): the engine thread marks itself unhealthy
    after it ended the failed step's requests (and tried a rebuild), so a client that saw its
    request's error may ask /ready a moment before that."""
    deadline = time.monotonic() + timeout_s
    got = get(server, path)
    while got != want and time.monotonic() < deadline:
        time.sleep(0.05)
        got = get(server, path)
    return got


def test_failing_steps_turn_ready_and_health_503():
    s = Server(env={"DI_ENGINE_FAIL_STEPS": "4"})
    try:
        assert get(s, "/ready") == (200, {"status": "ready"})
        assert get(s, "/health") == (200, {"status": "ok"})
        for i in range(4):
            status, _, body = post(s, "/v1/chat/completions", CHAT)
            assert status >= 500, (status, body)
            assert "error" in body, body
            m = s.metrics()
            assert m["deepinfer:engine_failed_steps_total"] == i + 1
            assert m["deepinfer:engine_failed_steps_in_a_row"] == i + 1
            if i < 2:  # fewer than 3 in a row: still ready
                assert get(s, "/ready")[0] == 200
            else:
                assert get(s, "/ready") == (503, {"status": "failing"})
                assert get(s, "/health") == (
                    503, {"status": "failing", "failed_steps_in_a_row": i + 1})
        # A step that runs ends the streak: the server is ready and healthy again.
        status, _, body = post(s, "/v1/chat/completions", CHAT)
        assert status == 200, body
        assert body["choices"][0]["message"] is not None
        assert get(s, "/ready") == (200, {"status": "ready"})
        assert get(s, "/health") == (200, {"status": "ok"})
        m = s.metrics()
        assert m["deepinfer:engine_failed_steps_total"] == 4
        assert m["deepinfer:engine_failed_steps_in_a_row"] == 0
        assert "injected failure of the forward" in s.logtext()
    finally:
        rc, log = s.stop()
    assert rc == 0, log


def test_device_lost_for_good_turns_503_and_refuses():
    """DI_ENGINE_LOSE_DEVICE=1: the first step fails as a lost device would. The CPU forward has no
    device state to rebuild, so the engine gives up at once (on the device-resident forward it
    would rebuild, within its bound): that request ends with an error, /ready and /health answer
    503 "device_lost" for good, and every later request is refused with 503 without reaching the
    engine's queue; the process stays up and stops cleanly."""
    s = Server(env={"DI_ENGINE_LOSE_DEVICE": "1"})
    try:
        assert get(s, "/health") == (200, {"status": "ok"})
        status, _, body = post(s, "/v1/chat/completions", CHAT)
        assert status >= 500, (status, body)
        assert "error" in body, body
        assert get_after(s, "/ready", (503, {"status": "device_lost"})) == (
            503, {"status": "device_lost"})
        assert get(s, "/health") == (
            503, {"status": "device_lost", "device_losses": 1, "device_recoveries": 0})
        for _ in range(2):
            status, _, body = post(s, "/v1/chat/completions", CHAT)
            assert status == 503, (status, body)
            assert "device was lost" in body["error"]["message"], body
        m = s.metrics()
        assert m["deepinfer:engine_device_losses_total"] == 1
        assert m["deepinfer:engine_device_recoveries_total"] == 0
        assert m["deepinfer:engine_unhealthy"] == 1
        assert "unhealthy" in s.logtext()
    finally:
        rc, log = s.stop()
    assert rc == 0, log
