"""The baseline-k25-sglang runbook end to end, executed by papermill with backend=http against the bundled server
(tiny random-weight model on CPU) - the same client and recording path it takes on the K2.5 server."""
from pathlib import Path

import pytest

from engine.runtime import Engine
from engine.serve import create_app, serve_in_thread
from specbook.execute import execute
from specbook.runbooks import load

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_runbook_over_http_against_bundled_server(tmp_path):
    rb = load(ROOT, "baseline-k25-sglang")
    assert list(rb.profiles) == ["8x-rtx-pro-6000"]
    eng = Engine.load(shape="tiny", device="cpu", dtype="float32", max_seq_len=256, cuda_graphs=False)
    with serve_in_thread(create_app(eng)) as url:
        params = rb.params_for("8x-rtx-pro-6000", {"backend": "http", "baseline_url": url, "eagle3_url": url,
                                                   "requests": 2, "max_tokens": 8,
                                                   "outputs_dir": str(tmp_path)})
        ex = execute(ROOT, rb, params, tmp_path / "run.ipynb", progress=False)
    got = {m.name: m for m in ex.metrics}
    assert list(got) == ["baseline_tok_s", "eagle3_2step_tok_s", "accept_length", "eagle3_slowdown_pct"]
    assert got["accept_length"].value == pytest.approx(1.0)  # no drafter behind either URL: one token per cycle
    base, eagle = got["baseline_tok_s"].value, got["eagle3_2step_tok_s"].value
    assert base > 0 and eagle > 0
    assert got["eagle3_slowdown_pct"].value == pytest.approx((1 - eagle / base) * 100)
    assert (tmp_path / "baseline.json").is_file() and (tmp_path / "eagle3.json").is_file()


def test_runbook_rejects_unknown_backend(tmp_path):
    rb = load(ROOT, "baseline-k25-sglang")
    from specbook import RunFailed

    with pytest.raises(RunFailed, match="backend must be one of"):
        execute(ROOT, rb, rb.params_for("8x-rtx-pro-6000", {"backend": "tgi"}), tmp_path / "run.ipynb",
                progress=False)


def test_runbook_opts_in_to_remote_code():
    """LaunchConfig leaves a checkpoint's own Python off; the K2.5 checkpoint needs it, so the runbook says so."""
    from engine.backends import SERVERS

    params = load(ROOT, "baseline-k25-sglang").params_for("8x-rtx-pro-6000")
    assert params["trust_remote_code"] is True
    assert params["backend"] in SERVERS
