"""Limits and liveness under slow work: SSE keep-alive comments during a long prefill (Chat
`: keep-alive`, Messages `ping`) and the request-header size limit (431)."""
import http.client
import json
import socket

import pytest

from conftest import MODEL, Server, post

# ~3000 prompt tokens: a prefill of seconds on the tiny model, never 50 ms. Each test has its own
# text: a prompt already seen would come from the prefix cache and prefill in no time.
def long_prompt(word):
    return f"{word} " * 3000


@pytest.fixture(scope="module")
def fast_keepalive():
    s = Server(extra=("--keepalive", "0.05"))
    yield s
    assert s.stop()[0] == 0


def stream_records(server, path, body):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=300)
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json",
                                                   "anthropic-version": "2023-06-01"})
    r = conn.getresponse()
    assert r.status == 200
    text = r.read().decode()
    conn.close()
    assert text.endswith("\n\n")
    return text[:-2].split("\n\n")


def test_keepalive_comments_during_long_prefill_chat(fast_keepalive):
    recs = stream_records(fast_keepalive, "/v1/chat/completions",
                          {"model": MODEL, "messages": [{"role": "user", "content": long_prompt("chat")}],
                           "max_tokens": 2, "stream": True})
    assert recs[0].startswith("data: {")  # the role chunk comes at once
    first_token = next(i for i, r in enumerate(recs)
                       if r.startswith("data: {") and '"role"' not in r)
    # while the prompt was prefilled nothing but keep-alive comments was sent
    between = recs[1:first_token]
    assert len(between) >= 3, recs[:first_token + 1]
    assert all(r == ": keep-alive" for r in between), between
    assert recs[-1] == "data: [DONE]"


def test_keepalive_pings_during_long_prefill_messages(fast_keepalive):
    recs = stream_records(fast_keepalive, "/v1/messages",
                          {"model": MODEL, "max_tokens": 2, "stream": True,
                           "messages": [{"role": "user", "content": long_prompt("messages")}]})
    names = [r.split("\n", 1)[0] for r in recs]
    first_delta = names.index("event: content_block_delta")
    assert names[:2] == ["event: message_start", "event: content_block_start"]
    # after message_start and the opened thinking block: pings only, more than the one at start
    assert names[2:first_delta].count("event: ping") >= 3, names[:first_delta + 1]
    assert set(names[2:first_delta]) == {"event: ping"}
    assert names[-1] == "event: message_stop"


def raw_request(server, header_bytes):
    s = socket.create_connection(("127.0.0.1", server.port), timeout=60)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 1}).encode()
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nConnection: close\r\n"
              b"Content-Type: application/json\r\nX-Pad: " + b"a" * header_bytes +
              b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    data = b""
    while True:
        d = s.recv(65536)
        if not d:
            break
        data += d
    s.close()
    return int(data.split(b" ", 2)[1]), data


def test_header_size_limit_431(server):
    status, data = raw_request(server, 70 * 1024)  # over the 64 KiB connection memory
    assert status == 431, data[:200]
    status, data = raw_request(server, 16 * 1024)  # a large but acceptable header
    assert status == 200, data[:300]
    st, _, out = post(server, "/v1/chat/completions",
                      {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                       "max_tokens": 1})
    assert st == 200, out
