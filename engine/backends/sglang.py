"""SGLang as a backend: its launch command, and accept length from its per-request meta_info."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from engine.backends.base import ServerProcess


class SGLangServer(ServerProcess):
    def command(self) -> list[str]:
        c = self.cfg
        cmd = [c.python, "-m", "sglang.launch_server", "--model-path", c.model, "--tp-size", str(c.tp),
               "--host", c.host, "--port", str(c.port)]
        if c.trust_remote_code:
            cmd.append("--trust-remote-code")
        if c.drafter:
            cmd += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", c.drafter,
                    "--speculative-num-steps", str(c.spec.steps), "--speculative-eagle-topk", str(c.spec.topk),
                    "--speculative-num-draft-tokens", str(c.spec.draft_tokens)]
        if not c.cuda_graphs:
            cmd.append("--disable-cuda-graph")
        elif c.cuda_graph_max_bs is not None:
            cmd += ["--cuda-graph-max-bs", str(c.cuda_graph_max_bs)]
        if c.api_key:
            cmd += ["--api-key", c.api_key]
        return cmd + list(c.extra_args)


def meta_accept_counts(meta: dict[str, Any] | None) -> tuple[int, int] | None:
    """(completion_tokens, spec_verify_ct) from one SGLang-style meta_info, None without speculation stats."""
    if not meta or not meta.get("spec_verify_ct"):
        return None
    return int(meta["completion_tokens"]), int(meta["spec_verify_ct"])


def accept_length(metas: Iterable[dict[str, Any] | None]) -> float | None:
    """Token-weighted accept length over requests: tokens per verify cycle, bonus included.

    The first token of an answer comes from the prefill, not from a verify cycle, so it is left out:
    sum(completion_tokens - 1) / sum(spec_verify_ct), as engine.decoding counts. SGLang's own log divides
    completion_tokens by spec_verify_ct and reads slightly higher on short answers.
    """
    counts = [c for c in map(meta_accept_counts, metas) if c is not None]
    verifies = sum(v for _, v in counts)
    return sum(t - 1 for t, _ in counts) / verifies if verifies else None
