"""Benchmarks of the target model on this machine, all in one run so their ratios are steady:
copy bandwidth, decode tok/s (CUDA graph and eager), bandwidth utilisation, forward cost per token count T, and
transformers' own static-cache `generate` on the same weights as the peer. With a drafter, speculative tok/s too.
"""
from __future__ import annotations

import contextlib
import re
import statistics
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import TypeVar

import torch

from engine import quiet
from engine.errors import EngineError
from engine.graphs import CapturedCall, GraphSet
from engine.loading import transformers_twin
from engine.target_decoder import TargetDecoder
from engine.timing import sync, time_fn, wall_clock

SIZES = (1, 2, 4, 8, 16, 32, 64)
T = TypeVar("T")


@dataclass
class BenchConfig:
    prompt_len: int | None = None  # None: 128 on CUDA, 16 on CPU
    new_tokens: int | None = None  # None: 256 on CUDA, 32 on CPU
    repeats: int = 3  # timed generations per variant (median reported)
    sizes: tuple[int, ...] = SIZES  # token counts T of the forward-cost sweep
    eager: bool = True  # also time the decode without CUDA graphs
    eager_tokens: int | None = None  # new tokens of each eager generation (None: new_tokens); its per-token time
    # is the host's launch time and does not grow with the position, so a short run measures it as well
    peer: bool = True  # also time transformers' generate (static cache)
    compile: bool = False  # also time the decode with its forward through torch.compile, inside our graph
    plain: bool = True  # time the plain graph decode too when compiling (False: the compiled decode alone)
    seed: int = 0
    torch_profile: bool = False  # also run torch.profiler on the fastest decode step: its time, kernel by kernel

    def resolve(self, device: torch.device) -> "BenchConfig":
        cuda = device.type == "cuda"
        return BenchConfig(**{**asdict(self), "prompt_len": self.prompt_len or (128 if cuda else 16),
                              "new_tokens": self.new_tokens or (256 if cuda else 32)})

    def cache_len(self) -> int:
        """The KV-cache length a run needs (after resolve), rounded up to 128. Attention reads the whole static
        cache every step, so a larger one only adds cost."""
        need = self.prompt_len + max(self.new_tokens, max(self.sizes))
        return -(-need // 128) * 128


@dataclass
class DecodeStat:
    tok_s: float  # median over repeats, decode only (prefill excluded)
    ms_per_token: float
    bw_util: float  # weight bytes per token / step time, as a fraction of the measured copy bandwidth
    samples: list[float]  # tok/s of each repeat
    accept_length: float = 1.0


@dataclass
class BenchResult:
    model: str
    device: str
    dtype: str
    graphs: bool  # whether "graph" really replayed CUDA graphs (False on CPU: it ran eagerly)
    prompt_len: int
    new_tokens: int
    max_seq_len: int  # KV-cache length: attention reads all of it every step
    weight_bytes: int  # read per decode token
    copy_gb_s: float  # device copy bandwidth, read + write bytes per second / 1e9
    decode: dict[str, DecodeStat] = field(default_factory=dict)  # "graph", "compiled", "eager", "speculative"
    forward_ms: dict[str, dict[int, float]] = field(default_factory=dict)  # "graph" / "eager" -> T -> ms
    gemv_ms: float | None = None  # every linear layer's weight times one token, nothing else (dense models)
    peer_tok_s: float | None = None  # transformers generate, static cache, greedy
    spec: dict | None = None  # speculative settings when a drafter was given
    profile_table: str | None = None  # torch.profiler table of the profiled decode steps
    errors: dict[str, str] = field(default_factory=dict)  # optional measurements that failed: name -> why
    step_ms: dict[str, float] | None = None  # kernel time per profiled step: matrix, attention, other; kernel count
    profiled: str | None = None  # which decode variant was profiled ("compiled", "graph", or "eager" on CPU)
    wall_s: dict[str, float] = field(default_factory=dict)  # phase -> seconds it took, building and warm-up included

    @property
    def t8_over_t1(self) -> float | None:
        f = self.forward_ms.get("graph") or self.forward_ms.get("eager") or {}
        return f[8] / f[1] if 1 in f and 8 in f else None

    @property
    def peer_ratio(self) -> float | None:
        return self.decode["graph"].tok_s / self.peer_tok_s if self.peer_tok_s and "graph" in self.decode else None

    def to_dict(self) -> dict:
        return {**asdict(self), "t8_over_t1": self.t8_over_t1, "peer_ratio": self.peer_ratio}


def copy_bandwidth(device: torch.device) -> float:
    """GB/s of a large device-to-device copy, counting bytes read plus bytes written."""
    nbytes = (1 << 30) if device.type == "cuda" else (64 << 20)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    s = time_fn(lambda: dst.copy_(src), device, iters=20 if device.type == "cuda" else 5)
    return 2 * nbytes / s / 1e9


def random_prompt(vocab: int, n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def decode_stat(decoder, prompt: list[int], cfg: BenchConfig, weight_bytes: int, copy_gb_s: float) -> DecodeStat:
    decoder.generate(prompt, min(cfg.new_tokens, 8), seed=cfg.seed)  # capture graphs, warm caches
    with quiet.timed():  # the repeats in one quiet window, so they are alike
        runs = [decoder.generate(prompt, cfg.new_tokens, seed=cfg.seed) for _ in range(cfg.repeats)]
    samples = [r.tok_s for r in runs]
    tok_s = statistics.median(samples)
    return DecodeStat(tok_s=tok_s, ms_per_token=1000.0 / tok_s, bw_util=weight_bytes * tok_s / (copy_gb_s * 1e9),
                      samples=samples, accept_length=statistics.median(r.accept_length for r in runs))


@torch.no_grad()
def forward_costs(model, start: int, sizes: tuple[int, ...], graphs: bool) -> dict[int, float]:
    """ms per forward of T tokens at positions start.. (cache reads and writes included), one graph per T."""
    device = model.device
    iters = 20 if device.type == "cuda" else 5

    def make_inputs(t: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.randint(0, model.cfg.vocab_size, (1, t), device=device),
                "input_pos": torch.arange(start, start + t, device=device)}

    def fwd(input_ids, input_pos):
        return model(input_ids, input_pos)[0]

    calls = GraphSet(fwd, make_inputs, sizes, enabled=graphs)
    return {t: 1000 * time_fn(lambda t=t: calls(t), device, iters) for t in sizes}


@torch.no_grad()
def gemv_floor_ms(model) -> float:
    """ms for the decode step's matrix-vector products alone: each linear layer (shared weights once) on one
    token's input, by the layer's own forward (engine.gemv's kernel or cuBLAS, as in a step), back to back in one
    CUDA graph (eagerly on CPU). What a step costs beyond it is attention, norms, RoPE, cache writes, sampling and
    launch gaps."""
    layers = list({id(m.weight): m for m in model.modules() if isinstance(m, torch.nn.Linear)}.values())
    xs = {f"x{i}": torch.randn(1, m.in_features, dtype=m.weight.dtype, device=m.weight.device)
          for i, m in enumerate(layers)}

    def gemvs(**x: torch.Tensor) -> list[torch.Tensor]:
        return [m(x[f"x{i}"]) for i, m in enumerate(layers)]

    call = CapturedCall(gemvs, xs, enabled=model.device.type == "cuda")
    return 1000 * time_fn(call, model.device, iters=20 if model.device.type == "cuda" else 5)


@torch.no_grad()
def peer_tok_s(model, prompt: list[int], new_tokens: int, repeats: int) -> float:
    """transformers' greedy generate with its static cache on the same weights (its own model class, built from
    ours in memory). Decode-only tok/s: (n - 1) / (time(n tokens) - time(1 token)), so its prefill is excluded as
    ours is."""
    hf = transformers_twin(model)
    ids = torch.tensor([prompt], device=model.device)

    def run(n: int) -> None:
        hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                    cache_implementation="static", pad_token_id=0)

    def median_s(n: int) -> float:
        return statistics.median(time_fn(lambda: run(n), model.device, iters=1, warmup=0) for _ in range(repeats))

    run(1), run(new_tokens)  # warm-up: transformers compiles the static-cache decode on CUDA
    one, full = median_s(1), median_s(new_tokens)
    del hf
    if model.device.type == "cuda":
        torch.cuda.empty_cache()
    return (new_tokens - 1) / max(full - one, 1e-9)


KERNEL_KINDS = (("attention", re.compile(r"attention|fmha|flash|softmax|splitkv", re.I)),  # first: cutlass fmha
                ("matrix", re.compile(r"gemm|gemv|xmma|nvjet|cublas|cutlass|splitKreduce|aten::(mm|addmm|bmm)$", re.I)))


def kernel_kind(name: str) -> str:
    """A profiled kernel's (or CPU op's) kind by its name: attention, matrix (cuBLAS, CUTLASS and the engine's own
    matrix-vector kernels, named `_gemv_*`), or other."""
    return next((kind for kind, rx in KERNEL_KINDS if rx.search(name)), "other")


def profile_decode(gen: TargetDecoder, prompt: list[int], steps: int = 16,
                   rows: int = 25) -> tuple[str, dict[str, float]]:
    """Kernel-level table of `steps` decode steps of `gen` (replays of its graph on CUDA: the profiler sees the
    kernels inside), sorted by self device time, and the kernel time per step by kind (matrix, attention, other)
    with the kernel count. What is not matrix work is what fusion and better kernels could still win."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from engine.sampling import SamplingParams

    cuda = gen.device.type == "cuda"
    step, _, _ = gen.begin(prompt, steps + 1, SamplingParams(), 0)
    with quiet.timed(), profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        for _ in range(steps):
            step()
        sync(gen.device)
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = prof.key_averages()
    per_step = {"matrix": 0.0, "attention": 0.0, "other": 0.0, "kernels": 0.0}
    for e in events:  # on CUDA only the kernels themselves (ops would count their kernels twice); on CPU the ops
        if cuda and e.device_type != DeviceType.CUDA:
            continue
        kind = kernel_kind(e.key)
        per_step[kind] += (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1000 / steps
        per_step["kernels"] += e.count / steps
    return f"{steps} decode steps\n" + events.table(sort_by=sort, row_limit=rows), per_step


def attempt(res: BenchResult, name: str, measure: Callable[[], T]) -> T | None:
    """An optional measurement (torch.compile, the transformers peer): its value, or None with the reason noted in
    res.errors, so that one failing extra does not lose the other numbers of a long run."""
    try:
        return measure()
    except Exception as e:
        res.errors[name] = f"{type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0]
        return None


@contextlib.contextmanager
def phase(res: BenchResult, name: str) -> Iterator[None]:
    """Time one phase of a long benchmark (captures, compiles and the peer's warm-up included) into res.wall_s, and
    say on stderr as it ends: a run of several minutes shows where it is, and its log where the time went."""
    now = wall_clock()
    start = now()
    try:
        yield
    finally:
        res.wall_s[name] = now() - start
        print(f"  bench {res.model}: {name} in {res.wall_s[name]:.1f} s", file=sys.stderr, flush=True)


def run_bench(eng, cfg: BenchConfig = BenchConfig()) -> BenchResult:
    """`eng` is a runtime.Engine; its model is benchmarked, and its decoder too when it is speculative."""
    model = eng.model
    device = model.device
    cfg = cfg.resolve(device)
    if min(cfg.sizes) <= 0 or cfg.repeats <= 0 or cfg.new_tokens < 2 or cfg.prompt_len <= 0 or \
            cfg.eager_tokens is not None and not 2 <= cfg.eager_tokens <= cfg.new_tokens:
        raise EngineError("prompt length, sizes and repeats must be positive, new tokens at least 2, and eager tokens "
                          "between 2 and new tokens")
    need = cfg.prompt_len + max(cfg.new_tokens, max(cfg.sizes))
    if need > eng.max_seq_len:
        raise EngineError(f"the benchmark needs a cache of {need} tokens; raise --max-seq-len above {eng.max_seq_len}")
    graphs = device.type == "cuda"
    res = BenchResult(model=eng.name, device=str(device), dtype=str(model.dtype).removeprefix("torch."),
                      graphs=graphs, prompt_len=cfg.prompt_len, new_tokens=cfg.new_tokens, max_seq_len=eng.max_seq_len,
                      weight_bytes=model.weight_bytes(), copy_gb_s=copy_bandwidth(device))
    prompt = random_prompt(model.cfg.vocab_size, cfg.prompt_len, cfg.seed)
    stat = lambda dec: decode_stat(dec, prompt, cfg, res.weight_bytes, res.copy_gb_s)  # noqa: E731
    fastest = TargetDecoder(model, eng.max_seq_len, cuda_graphs=True)
    if cfg.plain or not cfg.compile:
        with phase(res, "graph decode"):
            res.decode["graph"] = stat(fastest)
    if cfg.compile:
        with phase(res, "compiled decode"):
            made = attempt(res, "compiled", lambda: (
                g := TargetDecoder(model, eng.max_seq_len, cuda_graphs=True, compile=True), stat(g)))
        if made:
            compiled, res.decode["compiled"] = made
            if "graph" not in res.decode or res.decode["compiled"].tok_s > res.decode["graph"].tok_s:
                fastest = compiled
    if not res.decode:
        raise EngineError(f"the compiled decode failed and the plain one was not asked for: {res.errors['compiled']}")
    if cfg.eager:
        eager_cfg = replace(cfg, new_tokens=cfg.eager_tokens or cfg.new_tokens)
        with phase(res, "eager decode"):
            res.decode["eager"] = decode_stat(TargetDecoder(model, eng.max_seq_len, cuda_graphs=False), prompt,
                                              eager_cfg, res.weight_bytes, res.copy_gb_s)
    with phase(res, "forward costs"):
        res.forward_ms["graph" if graphs else "eager"] = forward_costs(model, cfg.prompt_len, cfg.sizes, graphs)
        if not model.cfg.n_routed_experts:  # MoE experts are not nn.Linear: the floor would leave them out
            res.gemv_ms = gemv_floor_ms(model)
        if graphs and cfg.eager:
            res.forward_ms["eager"] = forward_costs(model, cfg.prompt_len, cfg.sizes, False)
    if eng.speculative:
        with phase(res, "speculative decode"):
            res.decode["speculative"] = stat(eng.decoder)
        shape = eng.decoder.shape
        res.spec = {"steps": shape.steps, "topk": shape.topk, "draft_tokens": shape.draft_tokens,
                    "eager_verify": eng.decoder.eager_verify}
    if cfg.torch_profile:
        with phase(res, "profile"):
            res.profile_table, res.step_ms = profile_decode(fastest, prompt)
        res.profiled = ("compiled" if fastest.compile else "graph") if graphs else "eager"
    if cfg.peer:
        with phase(res, "transformers peer"):
            res.peer_tok_s = attempt(res, "transformers static",
                                     lambda: peer_tok_s(model, prompt, cfg.new_tokens, cfg.repeats))
    return res


def format_bench(r: BenchResult) -> str:
    gb = r.weight_bytes / 1e9
    lines = [f"{r.model} on {r.device} ({r.dtype}), prompt {r.prompt_len}, {r.new_tokens} new tokens, cache "
             f"{r.max_seq_len}, weights read per token {gb:.3f} GB, copy bandwidth {r.copy_gb_s:.1f} GB/s",
             "", f"{'decode':<22}{'tok/s':>10}{'ms/token':>10}{'bw util':>9}{'accept':>8}"]
    for name, d in r.decode.items():
        label = name if r.graphs or name != "graph" else "graph (eager on cpu)"
        lines.append(f"{label:<22}{d.tok_s:>10.1f}{d.ms_per_token:>10.3f}{d.bw_util:>8.1%}{d.accept_length:>8.2f}")
    lines += [f"{name:<22}failed: {why}" for name, why in r.errors.items()]
    if r.peer_tok_s:
        ratio = f"   ours/theirs {r.peer_ratio:.2f}x" if r.peer_ratio else ""
        lines.append(f"{'transformers static':<22}{r.peer_tok_s:>10.1f}{1000 / r.peer_tok_s:>10.3f}{ratio}")
    if r.gemv_ms:
        name, d = next((n, r.decode[n]) for n in ("graph", "compiled") if n in r.decode)
        lines.append(f"{'matrix-vector floor':<22}{1000 / r.gemv_ms:>10.1f}{r.gemv_ms:>10.3f}"
                     f"   the {name} step spends {d.ms_per_token - r.gemv_ms:.3f} ms/token beyond it")
    if "speculative" in r.decode:
        base = next(n for n in ("graph", "compiled", "eager") if n in r.decode)
        lines.append(f"speculative {r.spec}: {r.decode['speculative'].tok_s / r.decode[base].tok_s:.2f}x "
                     f"the {base} baseline")
    sizes = sorted(next(iter(r.forward_ms.values())))
    lines += ["", f"{'forward ms':<12}" + "".join(f"{'T=' + str(t):>9}" for t in sizes)]
    for name, f in r.forward_ms.items():
        lines.append(f"{name:<12}" + "".join(f"{f[t]:>9.3f}" for t in sizes))
    if r.t8_over_t1 is not None:
        lines.append(f"T=8 / T=1 forward cost: {r.t8_over_t1:.2f}x")
    if r.wall_s:
        lines.append("wall time: " + ", ".join(f"{name} {s:.1f} s" for name, s in r.wall_s.items()))
    if r.step_ms:
        m = r.step_ms
        lines += ["", f"{r.profiled} step, kernel time: matrix {m['matrix']:.3f} ms, attention {m['attention']:.3f} ms, "
                      f"other {m['other']:.3f} ms ({m['kernels']:.0f} {'kernels' if r.graphs else 'ops'} per step)",
                  r.profile_table]
    return "\n".join(lines)
