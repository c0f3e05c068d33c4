"""vLLM as a backend: its launch command, and accept length from its Prometheus spec-decode counters."""
from __future__ import annotations

import json
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from engine.backends.base import ServerProcess
from engine.errors import EngineError
from engine.metrics import accept_length as tokens_per_cycle


class VLLMServer(ServerProcess):
    def command(self) -> list[str]:
        c = self.cfg
        cmd = [c.python, "-m", "vllm.entrypoints.openai.api_server", "--model", c.model,
               "--tensor-parallel-size", str(c.tp), "--host", c.host, "--port", str(c.port)]
        if c.trust_remote_code:
            cmd.append("--trust-remote-code")
        if c.drafter:
            if c.spec.topk != 1:
                raise EngineError(f"vLLM's EAGLE-3 drafts chains only (topk 1), not topk {c.spec.topk}")
            spec = {"method": "eagle3", "model": c.drafter, "num_speculative_tokens": c.spec.steps}
            cmd += ["--speculative-config", json.dumps(spec)]
        if not c.cuda_graphs:
            cmd.append("--enforce-eager")
        elif c.cuda_graph_max_bs is not None:
            cmd += ["--compilation-config", json.dumps({"max_cudagraph_capture_size": c.cuda_graph_max_bs})]
        if c.api_key:
            cmd += ["--api-key", c.api_key]
        return cmd + list(c.extra_args)


@dataclass(frozen=True)
class SpecCounters:
    """vLLM's cumulative spec-decode counters, summed over engines; difference two scrapes for one benchmark."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0

    def __sub__(self, other: "SpecCounters") -> "SpecCounters":
        return SpecCounters(self.drafts - other.drafts, self.draft_tokens - other.draft_tokens,
                            self.accepted - other.accepted)

    @property
    def accept_length(self) -> float | None:
        """engine.metrics.accept_length: each draft (a verify cycle) emits its accepted tokens plus the bonus, so
        (accepted + drafts) / drafts = 1 + accepted / drafts, vLLM's mean acceptance length."""
        return tokens_per_cycle(self.accepted + self.drafts, self.drafts) if self.drafts else None

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted / self.draft_tokens if self.draft_tokens else None


COUNTERS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
            "vllm:spec_decode_num_accepted_tokens": "accepted"}


def parse_spec_counters(metrics_text: str) -> SpecCounters | None:
    """SpecCounters from a /metrics page, None when the server exposes no spec-decode counters."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name in COUNTERS:
            total = sum(s.value for s in family.samples if s.name.endswith("_total"))
            found[COUNTERS[family.name]] = total
    return SpecCounters(**found) if found else None
