"""Faults and bad input against the bundled server (tiny random-weight model on CPU, real HTTP on loopback only):
what a careless or hostile client sends is answered 4xx in the OpenAI envelope, never 500 or a hang, slow and
stalled clients are cut off while others are served, an API key protects what it should; and the external servers
(SGLang, vLLM) run a checkpoint's own Python only when asked to."""
import json
import socket
import time
from urllib.parse import urlparse

import httpx
import pytest
from click.testing import CliRunner

from engine.backends.base import LaunchConfig
from engine.backends.sglang import SGLangServer
from engine.backends.vllm import VLLMServer
from engine.errors import EngineError
from engine.runtime import Engine
from engine.serve import ServeConfig, create_app, serve_command, serve_in_thread

KEY = "fault-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
STALL_S = 1.0  # header and body timeouts of the slow-client server
CLOSE_WITHIN_S = STALL_S + 10  # generous: a shared CI machine may be slow to run the timers

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def eng():
    return Engine.load(shape="tiny", device="cpu", dtype="float32", max_seq_len=256, cuda_graphs=False)


@pytest.fixture(scope="module")
def url(eng):
    with serve_in_thread(create_app(eng, ServeConfig(api_key=KEY))) as base:
        yield base


def post(url, path, body, **kw):
    return httpx.post(url + path, json=body, headers=AUTH, timeout=30, **kw)


def post_raw(url, path, content: bytes):
    return httpx.post(url + path, content=content, headers={**AUTH, "content-type": "application/json"}, timeout=30)


def assert_envelope(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["message"] and err["type"], err
    return err


def metric(url, name):
    for line in httpx.get(url + "/metrics", headers=AUTH).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


# ---------------------------------------------------------------------------------------- 7: the API key

@pytest.mark.parametrize("args, env", [(["--api-key", ""], {}), (["--api-key", "   "], {}),
                                       ([], {"SPECBOOK_API_KEY": ""})])
def test_empty_api_key_is_refused(monkeypatch, args, env):
    import uvicorn

    def started(*a, **kw):
        raise AssertionError("the server started with an empty API key")

    monkeypatch.setattr(uvicorn, "run", started)
    monkeypatch.setattr(uvicorn.Server, "run", started)
    res = CliRunner().invoke(serve_command, ["--shape", "tiny", "--device", "cpu", "--host", "0.0.0.0", *args],
                             env=env)
    assert res.exit_code == 2, res.output
    assert len(res.stderr.strip().splitlines()) == 1 and "empty" in res.stderr
    with pytest.raises(EngineError, match="empty"):
        ServeConfig(api_key="")
    with pytest.raises(EngineError, match="empty"):  # SGLang and vLLM would drop the flag and serve openly
        LaunchConfig(model="/m", api_key="")


# ----------------------------------------------------------------------------- 8: slow and stalled clients

@pytest.fixture(scope="module")
def slow_url(eng):
    cfg = ServeConfig(api_key=KEY, header_timeout_s=STALL_S, body_timeout_s=STALL_S)
    with serve_in_thread(create_app(eng, cfg)) as base:
        yield base


def open_stalled(base: str, n: int, payload: bytes) -> list[socket.socket]:
    u = urlparse(base)
    assert u.hostname == "127.0.0.1"  # loopback only
    socks = []
    for _ in range(n):
        s = socket.create_connection((u.hostname, u.port), timeout=5)
        if payload:
            s.sendall(payload)
        socks.append(s)
    return socks


def read_until_closed(sock: socket.socket, deadline: float) -> bytes | None:
    """What the server sent before it closed the connection; None if it is still open at the deadline."""
    data = b""
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            chunk = sock.recv(65536)
        except socket.timeout:
            return None
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk
    return None


def served_quickly(base: str) -> float:
    t0 = time.monotonic()
    r = httpx.post(base + "/v1/completions", json={"prompt": "ok", "max_tokens": 2}, headers=AUTH, timeout=10)
    assert r.status_code == 200, r.text
    return time.monotonic() - t0


def test_stalled_bodies_get_408_while_others_are_served(slow_url):
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n").encode()
    socks = open_stalled(slow_url, 50, head + b'{"prompt": ')  # the head, a tenth of the body, then nothing
    try:
        assert served_quickly(slow_url) < 5
        deadline = time.monotonic() + CLOSE_WITHIN_S
        answers = [read_until_closed(s, deadline) for s in socks]
    finally:
        for s in socks:
            s.close()
    assert all(a is not None and a.startswith(b"HTTP/1.1 408") for a in answers), answers[:3]
    envelope = json.loads(answers[0].split(b"\r\n\r\n", 1)[1])
    assert envelope["error"]["code"] == 408 and envelope["error"]["type"] == "timeout_error"


def test_stalled_heads_are_closed_while_others_are_served(slow_url):
    partial = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Len"
    socks = open_stalled(slow_url, 25, b"") + open_stalled(slow_url, 25, partial)
    again = open_stalled(slow_url, 1, b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")[0]
    try:
        first = b""
        while not first.endswith(b"}"):  # a kept-alive connection: its first answer, then half a second request
            first += again.recv(4096)
        again.sendall(b"GET /hea")
        assert served_quickly(slow_url) < 5
        deadline = time.monotonic() + CLOSE_WITHIN_S
        answers = [read_until_closed(s, deadline) for s in [*socks, again]]
    finally:
        for s in [*socks, again]:
            s.close()
    assert all(a is not None for a in answers), f"{answers.count(None)} of {len(answers)} connections still open"
    assert served_quickly(slow_url) < 5


def test_connection_limit_answers_503_then_recovers(eng):
    cfg = ServeConfig(header_timeout_s=STALL_S, limit_concurrency=8)
    with serve_in_thread(create_app(eng, cfg)) as base:
        socks = open_stalled(base, 10, b"")
        try:
            r = httpx.get(base + "/health", timeout=10)
            assert r.status_code == 503  # uvicorn answers it before the app: no envelope
            deadline = time.monotonic() + CLOSE_WITHIN_S
            assert all(read_until_closed(s, deadline) is not None for s in socks)
        finally:
            for s in socks:
                s.close()
        assert httpx.get(base + "/health", timeout=10).status_code == 200


# ------------------------------------------------------------------------------ 9: bad input is a 4xx

@pytest.mark.parametrize("path, body, status, words", [
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 2, "seed": 18446744073709551616}', 422, "seed"),  # 2**64
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 2, "seed": ' + str(2 ** 70).encode() + b"}", 422, "seed"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 2, "seed": -9223372036854775809}', 422, "seed"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 2, "seed": 1e400, "stream": true}', 422, "seed"),
    ("/v1/completions", b'{"prompt": "x", "max_tokens": 2, "seed": 1267650600228229401496703205376, '
                        b'"stream": true}', 422, "seed"),
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}', 422, "surrogate"),
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2, "stream": true}', 422, "surrogate"),
    ("/v1/completions", b'{"prompt": "ab", "max_tokens": 2, "stop": ["\\udfff"]}', 422, "surrogate"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}', 422,
     "surrogate"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud800"}]}],'
                             b' "max_tokens": 2, "stream": true}', 422, "surrogate"),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, ""),  # not UTF-8: the body does not parse
])
def test_bad_input_is_4xx_not_500(url, path, body, status, words):
    err = assert_envelope(post_raw(url, path, body), status)
    assert words in err["message"]
    assert post(url, "/v1/completions", {"prompt": "still up", "max_tokens": 2}).status_code == 200


def test_seed_takes_the_whole_int64_range(url):
    for seed in (-(2 ** 63), 2 ** 63 - 1):
        body = {"prompt": "seed", "max_tokens": 6, "temperature": 1.0, "seed": seed}
        a, b = post(url, "/v1/completions", body), post(url, "/v1/completions", body)
        assert a.status_code == 200, a.text
        assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]  # the seed is used, not dropped


# ---------------------------------------------------------------- 10: what the key protects, errors, metrics

@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"])
def test_docs_are_not_served_with_a_key(url, path):
    for headers in ({}, AUTH):
        r = httpx.get(url + path, headers=headers)
        assert r.status_code in (401, 404) and "openapi" not in r.text.lower(), r.text[:200]
        assert_envelope(r, r.status_code)


def test_docs_are_served_without_a_key(eng):
    with serve_in_thread(create_app(eng)) as base:
        assert httpx.get(base + "/openapi.json").json()["paths"]["/v1/completions"]


def test_metrics_need_the_key_health_does_not(url):
    assert_envelope(httpx.get(url + "/metrics"), 401)
    assert_envelope(httpx.get(url + "/metrics", headers={"Authorization": "Bearer nope"}), 401)
    assert "specbook_requests_total" in httpx.get(url + "/metrics", headers=AUTH).text
    assert httpx.get(url + "/health").status_code == 200


def test_router_errors_use_the_envelope(url):
    assert assert_envelope(httpx.get(url + "/v1/nowhere", headers=AUTH), 404)["type"] == "not_found_error"
    r = httpx.get(url + "/v1/completions", headers=AUTH)
    assert_envelope(r, 405)
    assert r.headers["allow"] == "POST"
    assert_envelope(httpx.delete(url + "/health"), 405)


class RefusingEngine:
    """The tiny engine, except that it refuses every request when generation starts (as Engine.stream does for
    sampling settings it cannot run): the server answers 400, and nothing was served."""

    def __init__(self, eng):
        self._eng = eng

    def __getattr__(self, name):
        return getattr(self._eng, name)

    def stream(self, prompt_ids, **params):
        raise EngineError("this engine refuses every prompt")
        yield  # a generator, like Engine.stream: it raises at the first chunk


def test_refused_requests_are_not_counted(eng):
    with serve_in_thread(create_app(RefusingEngine(eng))) as base:
        body = {"prompt": "refused", "max_tokens": 4}
        assert "refuses" in assert_envelope(httpx.post(base + "/v1/completions", json=body, timeout=30),
                                            400)["message"]
        r = httpx.post(base + "/v1/completions", json=body | {"stream": True}, timeout=30)
        events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
        err = json.loads(events[0])["error"]  # in-band: the status line was sent before the engine refused
        assert (err["code"], err["type"]) == (400, "invalid_request_error") and events[-1] == "[DONE]"
        text = httpx.get(base + "/metrics").text
        assert "specbook_prompt_tokens_total 0.0" in text
        assert 'specbook_requests_total{path="/v1/completions",status="400"} 1.0' in text


def test_served_requests_are_counted(url):
    before = metric(url, "specbook_prompt_tokens_total")
    assert post(url, "/v1/completions", {"prompt": "count", "max_tokens": 2}).status_code == 200
    assert post(url, "/v1/completions", {"prompt": "x", "max_tokens": 9999}).status_code == 400  # not served
    assert metric(url, "specbook_prompt_tokens_total") - before == len("count")


# ---------------------------------------------------------------------- 11: remote code is opt-in

@pytest.mark.parametrize("server", [SGLangServer, VLLMServer])
def test_trust_remote_code_is_opt_in(server):
    assert "--trust-remote-code" not in server(LaunchConfig(model="/m")).command()
    assert "--trust-remote-code" in server(LaunchConfig(model="/m", trust_remote_code=True)).command()
