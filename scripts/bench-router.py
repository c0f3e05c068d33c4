"""The MLA + MoE router's two selections on a GPU: eleven routers of the deepseek-v3-mini shape (its MoE layers),
compiled, in one CUDA graph, selecting by torch.topk (Router.select_by_topk) and by ranks (Router.select_by_ranks);
seven interleaved samples of 200 replays each (engine.abtest), for 1 and 8 tokens, and whether the two give the same ids and weights.

    PYTHONPATH=. python3 scripts/bench-router.py      (needs a CUDA GPU; under a minute on an H200)"""
import statistics, torch
from engine import deepseek
from engine.abtest import interleave
from engine.shapes import shape_config
if not torch.cuda.is_available():
    raise SystemExit("bench-router.py needs a CUDA GPU")
cfg = shape_config("deepseek-v3-mini"); dev = "cuda"
g = torch.Generator(device="cpu").manual_seed(0)
routers = []
for _ in range(11):
    r = deepseek.Router(cfg)
    with torch.no_grad():
        r.weight.normal_(0, 0.02, generator=g); r.e_score_correction_bias.normal_(0, 0.1, generator=g)
    routers.append(r.to(dev))
def run(mode, x):
    out = []
    for r in routers:
        sel = r.select_by_topk if mode == "topk" else r.select_by_ranks
        s = torch.nn.functional.linear(x.float(), r.weight).sigmoid(); c = s + r.e_score_correction_bias
        idx = sel(c); w = s.gather(1, idx); w = w / (w.sum(-1, keepdim=True) + 1e-20)
        out.append((w * r.scaling, idx)); x = x + w.sum().to(x.dtype)
    return out
res = {}
for n in (1, 8):
    x = torch.randn(n, cfg.hidden_size, device=dev, dtype=torch.bfloat16)
    graphs, outs = {}, {}
    for mode in ("topk", "ranks"):
        f = torch.compile(lambda x, m=mode: run(m, x), fullgraph=True, dynamic=False)
        with torch.no_grad():
            for _ in range(3): f(x)
            torch.cuda.synchronize(); gr = torch.cuda.CUDAGraph()
            with torch.cuda.graph(gr): o = f(x)
        graphs[mode], outs[mode] = gr, o
    same = all(torch.equal(a[1], b[1]) and torch.equal(a[0], b[0]) for a, b in zip(outs["topk"], outs["ranks"]))
    def replays(gr):  # 200 replays a sample
        return lambda: [gr.replay() for _ in range(200)]
    secs, _ = interleave({m: replays(gr) for m, gr in graphs.items()}, torch.device(dev), 7)  # engine.abtest
    t = {m: [x / 200 * 1e6 for x in v] for m, v in secs.items()}
    print(f"tokens {n}: 11 routers, us per graph replay, median of 7 (min..max): " + "; ".join(
        f"{m} {statistics.median(v):.1f} ({min(v):.1f}..{max(v):.1f})" for m, v in t.items()) + f"; same ids and weights: {same}")
