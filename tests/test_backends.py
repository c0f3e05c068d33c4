"""SGLang / vLLM launch commands, their speculative statistics, and the shared server-process base."""
import json
import sys
import textwrap

import pytest

from engine.backends import serving, sglang, vllm
from engine.backends.base import LaunchConfig, ServerProcess
from engine.backends.client import RequestResult, summarize
from engine.errors import EngineError
from engine.spec_settings import SpecSettings

GAME_PLAN = LaunchConfig(model="/models/Kimi-K2.5-INT4", drafter="/models/k25-eagle3", tp=8, port=30000,
                         spec=SpecSettings(steps=2, topk=1, draft_tokens=3), trust_remote_code=True)


def test_sglang_command_game_plan():
    assert sglang.SGLangServer(GAME_PLAN).command() == [
        "python", "-m", "sglang.launch_server", "--model-path", "/models/Kimi-K2.5-INT4", "--tp-size", "8",
        "--host", "127.0.0.1", "--port", "30000", "--trust-remote-code",
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", "/models/k25-eagle3",
        "--speculative-num-steps", "2", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3",
    ]


def test_sglang_command_baseline_without_graphs():
    cfg = LaunchConfig(model="/m", tp=2, cuda_graphs=False, api_key="k",
                       extra_args=("--mem-fraction-static", "0.85"))
    assert sglang.SGLangServer(cfg).command() == [
        "python", "-m", "sglang.launch_server", "--model-path", "/m", "--tp-size", "2", "--host", "127.0.0.1",
        "--port", "30000", "--disable-cuda-graph", "--api-key", "k", "--mem-fraction-static", "0.85",
    ]


def test_sglang_tree_and_graph_batch():
    cfg = LaunchConfig(model="/m", drafter="/d", spec=SpecSettings(steps=5, topk=4, draft_tokens=16),
                       cuda_graph_max_bs=8)
    cmd = sglang.SGLangServer(cfg).command()
    assert cmd[cmd.index("--speculative-eagle-topk") + 1] == "4"
    assert cmd[cmd.index("--speculative-num-draft-tokens") + 1] == "16"
    assert cmd[-2:] == ["--cuda-graph-max-bs", "8"]


def test_vllm_command_game_plan():
    cmd = vllm.VLLMServer(GAME_PLAN).command()
    assert cmd[:12] == ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "/models/Kimi-K2.5-INT4",
                        "--tensor-parallel-size", "8", "--host", "127.0.0.1", "--port", "30000",
                        "--trust-remote-code"]
    assert cmd[12] == "--speculative-config"
    assert json.loads(cmd[13]) == {"method": "eagle3", "model": "/models/k25-eagle3", "num_speculative_tokens": 2}
    assert len(cmd) == 14


def test_vllm_graph_settings():
    eager = vllm.VLLMServer(LaunchConfig(model="/m", cuda_graphs=False)).command()
    assert eager[-1] == "--enforce-eager" and "--speculative-config" not in eager
    capped = vllm.VLLMServer(LaunchConfig(model="/m", cuda_graph_max_bs=4)).command()
    assert capped[-2] == "--compilation-config" and json.loads(capped[-1]) == {"max_cudagraph_capture_size": 4}


def test_vllm_refuses_trees():
    cfg = LaunchConfig(model="/m", drafter="/d", spec=SpecSettings(steps=3, topk=2, draft_tokens=8))
    with pytest.raises(EngineError, match="chains only"):
        vllm.VLLMServer(cfg).command()


@pytest.mark.parametrize("kw", [dict(steps=0), dict(steps=2, topk=1, draft_tokens=5), dict(draft_tokens=1)])
def test_spec_settings_reject_inconsistent(kw):
    with pytest.raises(EngineError):
        SpecSettings(**kw)


VLLM_METRICS = """\
# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.
# TYPE vllm:spec_decode_num_drafts_total counter
vllm:spec_decode_num_drafts_total{{engine="0",model_name="k25"}} {drafts}
vllm:spec_decode_num_drafts_total{{engine="1",model_name="k25"}} 10.0
# TYPE vllm:spec_decode_num_draft_tokens_total counter
vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="k25"}} {draft_tokens}
# TYPE vllm:spec_decode_num_accepted_tokens_total counter
vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="k25"}} {accepted}
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{{model_name="k25"}} 1.0
"""


def test_vllm_counters_delta():
    before = vllm.parse_spec_counters(VLLM_METRICS.format(drafts=90.0, draft_tokens=200.0, accepted=70.0))
    after = vllm.parse_spec_counters(VLLM_METRICS.format(drafts=190.0, draft_tokens=400.0, accepted=190.0))
    assert before == vllm.SpecCounters(drafts=100.0, draft_tokens=200.0, accepted=70.0)  # engines summed
    delta = after - before
    assert delta.accept_length == pytest.approx(1 + 120 / 100)
    assert delta.acceptance_rate == pytest.approx(120 / 200)
    assert vllm.parse_spec_counters("# TYPE x counter\nx_total 3\n") is None
    assert vllm.SpecCounters().accept_length is None


def test_sglang_accept_length_is_token_weighted():
    metas = [{"completion_tokens": 30, "spec_verify_ct": 10}, {"completion_tokens": 10, "spec_verify_ct": 10},
             {"completion_tokens": 5, "spec_verify_ct": 0}, None]
    assert sglang.accept_length(metas) == pytest.approx((29 + 9) / 20)  # prefill token excluded
    assert sglang.accept_length([None, {"completion_tokens": 3}]) is None


def test_summary_falls_back_to_vllm_counters():
    results = [RequestResult(ok=True, completion_tokens=8, latency_s=0.5, ttft_s=0.1, chunk_gaps_s=[0.05] * 7),
               RequestResult(ok=False, error="HTTP 500: boom")]
    s = summarize("http://x", results, concurrency=2, duration=1.0,
                  before=vllm.SpecCounters(10, 20, 5), after=vllm.SpecCounters(14, 28, 9))
    assert (s.ok, s.failed, s.errors) == (1, 1, ["HTTP 500: boom"])
    assert s.accept_source == "vllm-metrics" and s.accept_length == pytest.approx(2.0)
    assert s.output_tok_s == pytest.approx(8.0)
    assert s.tpot_ms.mean == pytest.approx(400 / 7)


# A stand-in server process: answers /health after a delay and reports one environment variable.
FAKE_SERVER = textwrap.dedent("""
    import os, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer
    time.sleep(0.3)
    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            body = os.environ.get("NCCL_TEST_VAR", "").encode()
            self.send_response(200 if self.path in ("/health", "/env") else 404)
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass
    HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
""")


class FakeServer(ServerProcess):
    def command(self):
        return [sys.executable, "-c", self.cfg.extra_args[0], str(self.cfg.port)]


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_process_start_wait_stop(tmp_path):
    import httpx

    cfg = LaunchConfig(model="-", port=_free_port(), extra_args=(FAKE_SERVER,), env={"NCCL_TEST_VAR": "seen"})
    with FakeServer(cfg, log_path=tmp_path / "log") as server:
        assert httpx.get(server.base_url + "/env").text == "seen"
        proc = server.proc
    assert proc.poll() is not None  # stopped on exit


def test_server_process_reports_early_exit(tmp_path):
    cfg = LaunchConfig(model="-", extra_args=("import sys; print('no GPU here'); sys.exit(3)",))
    server = FakeServer(cfg, log_path=tmp_path / "log").start()
    with pytest.raises(EngineError, match="(?s)exited with code 3.*no GPU here"):
        server.wait_healthy(timeout=30)
    assert server.stop() == 3


def test_server_process_health_timeout_then_kill(tmp_path):
    ignore_term = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    server = FakeServer(LaunchConfig(model="-", extra_args=(ignore_term,)), log_path=tmp_path / "log").start()
    with pytest.raises(EngineError, match="not healthy after"):
        server.wait_healthy(timeout=0.5, poll=0.1)
    assert server.stop(grace=0.5) == -9  # SIGTERM ignored: killed


def test_serving_http_and_bad_backends():
    with serving("http", LaunchConfig(model="-"), "http://10.0.0.1:8000") as url:
        assert url == "http://10.0.0.1:8000"
    with pytest.raises(EngineError, match="needs the URL"), serving("http", LaunchConfig(model="-")):
        pass
    with pytest.raises(EngineError, match="unknown backend 'tgi'"), serving("tgi", LaunchConfig(model="-")):
        pass


def test_serving_bundled_target_directory(tmp_path):
    from engine.backends.client import benchmark
    from engine.loading import random_model, save_model

    save_model(random_model("tiny"), tmp_path / "tiny")
    cfg = LaunchConfig(model=str(tmp_path / "tiny"), cuda_graphs=False)
    with serving("bundled", cfg, device="cpu", dtype="float32", max_seq_len=128) as url:
        s = benchmark(url, requests=3, concurrency=3, max_tokens=4)
    assert (s.ok, s.completion_tokens, s.accept_length) == (3, 12, 1.0)


def _sse(*payloads):
    return "".join(f"data: {json.dumps(p)}\n\n" for p in payloads) + "data: [DONE]\n\n"


@pytest.mark.parametrize("events, ok, tokens, detail", [
    # no usage chunk: the count comes from meta_info, not from the two content chunks
    ([{"choices": [{"delta": {"content": "ab"}}]},
      {"choices": [{"delta": {"content": "cd"}, "meta_info": {"completion_tokens": 5, "spec_verify_ct": 2}}]}],
     True, 5, None),
    ([{"choices": [{"delta": {"content": "ab"}}]}, {"choices": [{"delta": {"content": "c"}}]}], True, 2, None),
    ([{"choices": [{"delta": {"content": "ab"}}]}, {"error": {"message": "engine died", "code": 500}}],
     False, 0, "engine died"),
])
def test_client_reads_streams(events, ok, tokens, detail):
    import asyncio

    import httpx

    from engine.backends.client import build_body, one_request

    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=_sse(*events)))

    async def go():
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as c:
            body = build_body("p", chat=True, model="m", max_tokens=8, temperature=0.0, stream=True)
            return await one_request(c, "/v1/chat/completions", body)

    res = asyncio.run(go())
    assert (res.ok, res.completion_tokens) == (ok, tokens)
    assert detail is None or detail in res.error
    if ok:
        assert res.ttft_s is not None and len(res.chunk_gaps_s) == 1


# ---- python -m engine.backends.client: the command-line conventions of python -m engine --------------------------

def client(*args: str, **kw):
    from click.testing import CliRunner

    from engine.backends.client import main
    return CliRunner().invoke(main, list(args), **kw)


@pytest.mark.parametrize("args,words", [
    (["--temperature", "nan"], ["--temperature", "nan"]),
    (["--temperature", "inf"], ["--temperature"]),
    (["--temperature", "-0.5"], ["--temperature"]),
    (["--timeout", "0"], ["--timeout"]),
    (["--timeout", "nan"], ["--timeout"]),
    (["-n", "0"], ["--requests"]),
    (["--bogus"], ["--bogus"]),
    (["--prompts", "/nonexistent/prompts.txt"], ["/nonexistent/prompts.txt"]),
    (["--url", "127.0.0.1:8000"], ["url", "http://"]),
])
def test_client_bad_input_is_one_line_and_exit_2(args, words):
    from engine_cli_testing import assert_bad_input

    assert_bad_input(client(*args), *words)


def test_client_exit_codes_and_debug(monkeypatch):
    from engine.backends import client as mod

    def summary(failed: int):
        return lambda *a, **k: mod.summarize("http://x", [RequestResult(ok=True, completion_tokens=3, latency_s=1.0)]
                                             + [RequestResult(ok=False, error="HTTP 500")] * failed, 1, 1.0)

    monkeypatch.setattr(mod, "benchmark", summary(0))
    assert client("--json").exit_code == 0
    monkeypatch.setattr(mod, "benchmark", summary(1))
    r = client()
    assert r.exit_code == 1 and "HTTP 500" in r.stdout  # a failed request: a check failed

    def broken(*a, **k):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(mod, "benchmark", broken)
    r = client()
    assert r.exit_code == 3 and r.stderr.strip().splitlines() == [
        "error: RuntimeError: boom (internal failure; rerun with --debug for the traceback)"]
    assert isinstance(client("--debug").exception, RuntimeError)
    assert "Exit codes" in client("--help").stdout
