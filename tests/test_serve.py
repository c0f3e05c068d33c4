"""The bundled OpenAI-compatible server over the real Engine (tiny random-weight model, CPU), over real HTTP on
loopback: endpoints, the benchmark client, limits and bad input, disconnects, concurrency, the queue, the API key."""
import asyncio
import json
import time

import httpx
import pytest
from click.testing import CliRunner

from engine.backends.client import run_benchmark
from engine.errors import EngineError
from engine.runtime import Engine
from engine.serve import Detokenizer, ServeConfig, compile_chat_template, create_app, load_chat_template, \
    render_chat, serve_command, serve_in_thread

KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CACHE = 2048


@pytest.fixture(scope="module")
def eng():
    return Engine.load(shape="tiny", device="cpu", dtype="float32", max_seq_len=CACHE, cuda_graphs=False)


@pytest.fixture(scope="module")
def url(eng):
    cfg = ServeConfig(api_key=KEY, max_body_bytes=4096, max_tokens_limit=CACHE, queue_size=64)
    with serve_in_thread(create_app(eng, cfg)) as base:
        yield base


def post(url, path, body, **kw):
    return httpx.post(url + path, json=body, headers=AUTH, timeout=60, **kw)


def metric(url, name):
    for line in httpx.get(url + "/metrics", headers=AUTH).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


def wait_for(url, pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = httpx.get(url + "/health").json()
        if pred(h):
            return h
        time.sleep(0.01)
    raise AssertionError(f"server state never matched; last /health: {h}")


def sse_events(text):
    return [line[6:] for line in text.splitlines() if line.startswith("data: ")]


def test_completion_matches_engine(url, eng):
    r = post(url, "/v1/completions", {"prompt": "hello", "max_tokens": 12, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    choice = body["choices"][0]
    want = eng.generate(eng.encode("hello"), 12)
    assert choice["text"] == eng.decode(want.token_ids)
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}
    meta = choice["meta_info"]
    assert (meta["completion_tokens"], meta["spec_verify_ct"], meta["spec_accept_length"]) == (12, 11, 1.0)
    assert choice["finish_reason"] == "length"


def test_prompt_as_token_ids(url, eng):
    ids = eng.encode("abc")
    a = post(url, "/v1/completions", {"prompt": ids, "max_tokens": 6, "temperature": 0}).json()
    b = post(url, "/v1/completions", {"prompt": "abc", "max_tokens": 6, "temperature": 0}).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


def test_chat_stream_equals_non_stream(url):
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    plain = post(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 20, "temperature": 0}).json()
    assert plain["object"] == "chat.completion"
    r = post(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 20, "temperature": 0, "stream": True,
                                           "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == plain["choices"][0]["message"]["content"]
    final = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(final) == 1 and final[0]["choices"][0]["meta_info"]["completion_tokens"] == 20
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 20


def test_speculative_meta_info_matches_engine(tmp_path):
    import torch

    from engine.shapes import shape_config
    from engine.drafter import new_drafter, save_drafter

    save_drafter(new_drafter(shape_config("tiny"), torch.arange(256)), tmp_path / "drafter")
    spec = Engine.load(shape="tiny", drafter=str(tmp_path / "drafter"), device="cpu", dtype="float32",
                       max_seq_len=64, cuda_graphs=False, steps=2)
    want = spec.generate(spec.encode("spec"), 6)
    with serve_in_thread(create_app(spec)) as base:
        body = {"prompt": "spec", "max_tokens": 6, "temperature": 0}
        plain = httpx.post(base + "/v1/completions", json=body, timeout=60).json()["choices"][0]
        streamed = sse_events(httpx.post(base + "/v1/completions", json=body | {"stream": True}, timeout=60).text)
    final = [json.loads(e)["choices"][0] for e in streamed[:-1]][-1]
    for choice in (plain, final):
        meta = choice["meta_info"]
        assert (meta["spec_verify_ct"], meta["spec_accept_token_num"]) == (want.verify_cycles, want.accepted_tokens)
        assert meta["spec_accept_length"] == pytest.approx(want.accept_length)
    assert plain["text"] == spec.decode(want.token_ids)


def test_stop_string_cuts_text(url):
    full = post(url, "/v1/completions", {"prompt": "xyz", "max_tokens": 30, "temperature": 0}).json()
    text = full["choices"][0]["text"]
    stop = text[5:7]
    cut = post(url, "/v1/completions", {"prompt": "xyz", "max_tokens": 30, "temperature": 0, "stop": [stop]}).json()
    assert cut["choices"][0]["text"] == text[: text.find(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


def test_detokenizer_holds_back_partial_stop():
    d = Detokenizer(lambda ids: "".join(map(chr, ids)), ["END"])
    assert d.add([ord("a"), ord("b"), ord("E")]) == ("a", False)  # the last len("END") - 1 characters wait
    assert d.add([ord("N")]) == ("b", False)
    assert d.add([ord("D"), ord("x")]) == ("", True)  # "EN" was never sent: the text ends before "END"


def test_detokenizer_waits_for_whole_characters():
    d = Detokenizer(lambda ids: bytes(ids).decode(errors="replace"), [])
    assert d.add([0xC3]) == ("", False)  # first byte of "é"
    assert d.add([0xA9, ord("!")]) == ("é!", False)
    assert d.add([0xE2, 0x82]) == ("", False)  # two of the three bytes of "€", then the answer ends
    assert d.flush() == "\ufffd"


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory):
    """The tiny random-weight target with a real byte-level BPE tokenizer (trained on ASCII text, so that accented
    characters, the euro sign and emoji span several tokens)."""
    from engine.loading import random_model, save_model
    from engine.train.tokenizer import save_tokenizer, train_tokenizer

    d = tmp_path_factory.mktemp("tokenized")
    save_model(random_model("tiny"), d)
    save_tokenizer(train_tokenizer(["the quick brown fox jumps over the lazy dog"] * 20, vocab_size=300), d)
    return Engine.load(target=str(d), device="cpu", dtype="float32", max_seq_len=128, cuda_graphs=False)


def test_detokenizer_streams_a_tokenizer_as_it_decodes(tokenized):
    tok = tokenized.tokenizer
    ids = tok.encode("the café costs 5 € 👍 over the dog").ids
    d = Detokenizer.for_engine(tokenized, [])
    pieces = [d.add([i])[0] for i in ids] + [d.flush()]
    assert "".join(pieces) == tok.decode(ids) == "the café costs 5 € 👍 over the dog"
    assert "" in pieces[:-1]  # a character split over tokens waits for its last byte
    stopped = Detokenizer.for_engine(tokenized, ["€"])
    out = [stopped.add([i]) for i in ids]
    assert "".join(t for t, _ in out) == "the café costs 5 " and out[-1][1]


def test_served_text_with_a_tokenizer_matches_decode(tokenized):
    want = tokenized.decode(tokenized.generate(tokenized.encode("the fox"), 40).token_ids)
    with serve_in_thread(create_app(tokenized)) as base:
        body = {"prompt": "the fox", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        plain = httpx.post(base + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        events = sse_events(httpx.post(base + "/v1/completions", json=body | {"stream": True}, timeout=60).text)
    streamed = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert plain == streamed == want


def test_chat_template_renders_as_transformers_does(tmp_path):
    """Loop controls, a tojson that keeps "<" and non-ASCII as they are, and the checkpoint's special tokens: what
    apply_chat_template gives templates."""
    from engine.serve import load_special_tokens

    tpl = ("{{ bos_token }}{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
           "{{ m.content | tojson }}{% endfor %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": tpl, "bos_token": {"content": "<s>", "lstrip": False}, "eos_token": "</s>"}))
    special = load_special_tokens(str(tmp_path))
    assert special == {"bos_token": "<s>", "eos_token": "</s>"}
    msgs = [{"role": "user", "content": "<é>"}, {"role": "user", "content": "never"}]
    assert render_chat(msgs, compile_chat_template(load_chat_template(str(tmp_path)), special)) == '<s>"<é>"'


def test_chat_template_that_does_not_compile_fails_at_startup(eng):
    with pytest.raises(EngineError, match="does not compile"):
        create_app(eng, chat_template="{% for m in messages %}")


def test_chat_template_default_and_checkpoint(tmp_path):
    msgs = [{"role": "user", "content": "hi"}]
    assert render_chat(msgs, None) == "<|user|>\nhi\n<|assistant|>\n"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                          "{% if add_generation_prompt %}[assistant]{% endif %}"}))
    assert render_chat(msgs, compile_chat_template(load_chat_template(str(tmp_path)))) == "[user]hi[assistant]"
    assert load_chat_template(None) is None
    strict = compile_chat_template("{% if messages[0].role != 'system' %}{{ raise_exception('system first') }}"
                                   "{% endif %}")
    with pytest.raises(Exception, match="system first"):
        render_chat(msgs, strict)


def test_client_against_server(url):
    before = metric(url, "specbook_generation_tokens_total")
    s = asyncio.run(run_benchmark(url, requests=6, concurrency=3, max_tokens=10, api_key=KEY))
    assert (s.ok, s.failed, s.completion_tokens) == (6, 0, 60)
    assert s.accept_length == pytest.approx(1.0) and s.accept_source == "meta_info"  # no drafter: 1 token/cycle
    assert s.ttft_ms.p50 > 0 and s.decode_tok_s.mean > 0 and s.output_tok_s > 0
    assert metric(url, "specbook_generation_tokens_total") - before == 60
    plain = asyncio.run(run_benchmark(url, requests=2, max_tokens=5, stream=False, chat=False, api_key=KEY))
    assert plain.ok == 2 and plain.completion_tokens == 10 and plain.ttft_ms is None


def test_fifty_concurrent_streams(url):
    s = asyncio.run(run_benchmark(url, requests=50, concurrency=50, max_tokens=8, api_key=KEY))
    assert (s.ok, s.failed, s.completion_tokens) == (50, 0, 400), s.errors
    assert post(url, "/v1/completions", {"prompt": "after", "max_tokens": 3}).status_code == 200


@pytest.mark.parametrize("body, status, words", [
    (b'{"prompt": "x", "max_tokens": ', 400, "malformed JSON"),
    (b'{"prompt": "x", "max_tokens": "many", "temperature": "hot"}', 422, "max_tokens"),
    (b'{"prompt": "x", "temperature": 9}', 422, "temperature"),
    (b'{"messages": []}', 422, "messages"),
    (b'{"messages": [{"role": "wizard", "content": "x"}]}', 422, "role"),
    (b'{"prompt": "x", "n": 2}', 422, "n"),
    (b'{"prompt": [1, 2, 99999]}', 400, "token ids"),
    (b'{"prompt": "x", "max_tokens": 5000}', 400, "limit"),
    (b'{"prompt": "' + b"y" * 2000 + b'", "max_tokens": 100}', 400, "exceeds the cache"),
    (b'{"prompt": "x", "stream": true, "max_tokens": -1}', 422, "max_tokens"),
    (b'[1, 2]', 422, "body"),
])
def test_bad_input_is_a_clear_4xx(url, body, status, words):
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    r = httpx.post(url + path, content=body, headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]
    assert post(url, "/v1/completions", {"prompt": "still up", "max_tokens": 2}).status_code == 200


def test_oversize_bodies(url):
    big = {"prompt": "z" * 5000}
    r = post(url, "/v1/completions", big)
    assert r.status_code == 413 and "4096" in r.json()["error"]["message"]

    def chunked():  # no Content-Length: the limit must hold while reading
        yield b'{"prompt": "'
        for _ in range(60):
            yield b"z" * 100
        yield b'"}'

    r = httpx.post(url + "/v1/completions", content=chunked(), headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413


def test_prompt_longer_than_cache(eng):
    cfg = ServeConfig(max_body_bytes=1 << 16)
    with serve_in_thread(create_app(eng, cfg)) as base:
        r = httpx.post(base + "/v1/completions", json={"prompt": "w" * (CACHE + 10)})
        assert r.status_code == 400 and f"at most {CACHE - 1}" in r.json()["error"]["message"]


def test_api_key(url):
    body = {"prompt": "k", "max_tokens": 2}
    assert httpx.post(url + "/v1/completions", json=body).status_code == 401
    wrong = httpx.post(url + "/v1/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401 and "API key" in wrong.json()["error"]["message"]
    assert httpx.get(url + "/v1/models").status_code == 401
    assert httpx.get(url + "/v1/models", headers=AUTH).json()["data"][0]["max_model_len"] == CACHE
    assert httpx.get(url + "/health").status_code == 200
    assert post(url, "/v1/completions", body).status_code == 200


def test_disconnect_mid_stream_stops_generation(url):
    before = metric(url, "specbook_generation_tokens_total")
    body = {"prompt": "long", "max_tokens": CACHE - 8, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, headers=AUTH, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                break  # one chunk of text, then hang up
    wait_for(url, lambda h: not h["running"] and h["queued"] == 0)
    generated = metric(url, "specbook_generation_tokens_total") - before
    assert 0 < generated < CACHE - 8  # stopped early, not run to the end
    assert post(url, "/v1/completions", {"prompt": "next", "max_tokens": 4}).json()["usage"]["completion_tokens"] == 4


def test_non_streaming_client_timeout_stops_generation(url):
    before = metric(url, "specbook_generation_tokens_total")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url + "/v1/completions", json={"prompt": "slow", "max_tokens": CACHE - 8, "ignore_eos": True},
                   headers=AUTH, timeout=httpx.Timeout(30, read=0.1))
    wait_for(url, lambda h: not h["running"] and h["queued"] == 0)
    assert metric(url, "specbook_generation_tokens_total") - before < CACHE - 8


def test_full_queue_answers_429(eng):
    async def scenario(base):
        async with httpx.AsyncClient(base_url=base, timeout=60) as c:
            long = {"prompt": "a", "max_tokens": CACHE - 8, "ignore_eos": True, "stream": True}
            async with c.stream("POST", "/v1/completions", json=long) as running:
                lines = running.aiter_lines()  # keep a reference: a collected iterator closes the stream
                await lines.__anext__()  # the worker is busy with this one
                queued = asyncio.create_task(c.post("/v1/completions", json={"prompt": "b", "max_tokens": 3}))
                await asyncio.to_thread(wait_for, base, lambda h: h["queued"] == 1)
                refused = await c.post("/v1/completions", json={"prompt": "c", "max_tokens": 3})
            # leaving the block hangs up the running stream; the queued request then runs
            return refused, await queued

    with serve_in_thread(create_app(eng, ServeConfig(queue_size=1))) as base:
        refused, queued = asyncio.run(scenario(base))
        assert refused.status_code == 429 and "retry" in refused.json()["error"]["message"]
        assert queued.status_code == 200 and queued.json()["usage"]["completion_tokens"] == 3
        assert 'specbook_requests_total{path="/v1/completions",status="429"} 1.0' in httpx.get(base + "/metrics").text


def test_serve_cli_bad_input_is_one_line():
    res = CliRunner().invoke(serve_command, ["--shape", "tiny", "--target", "/nowhere", "--device", "cpu"])
    assert res.exit_code == 2
    assert res.stderr.strip().startswith("error: give exactly one of") and len(res.stderr.strip().splitlines()) == 1
    res = CliRunner().invoke(serve_command, ["--shape", "no-such-shape", "--device", "cpu"])
    assert res.exit_code == 2 and "unknown shape" in res.stderr
    res = CliRunner().invoke(serve_command, ["--shape", "tiny", "--device", "cpu", "--drafter", "/nowhere"])
    assert res.exit_code == 2 and "/nowhere" in res.stderr and len(res.stderr.strip().splitlines()) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_serve_on_cuda_with_graphs():
    gpu = Engine.load(shape="tiny", device="cuda", dtype="bfloat16", max_seq_len=512, cuda_graphs=True)
    want = gpu.decode(gpu.generate(gpu.encode("gpu"), 16).token_ids)
    with serve_in_thread(create_app(gpu)) as base:  # the worker thread captures and replays the graphs
        r = httpx.post(base + "/v1/completions", json={"prompt": "gpu", "max_tokens": 16, "temperature": 0})
        assert r.json()["choices"][0]["text"] == want
        s = asyncio.run(run_benchmark(base, requests=20, concurrency=10, max_tokens=32))
        assert (s.ok, s.completion_tokens) == (20, 640)
