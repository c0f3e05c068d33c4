#!/usr/bin/env python3
"""Which drafter training pays: variants of a preset's drafter run trained on one target and measured by accept
length, before a preset change is recorded. Training is deterministic (engine.train.loop.reproducible), so each
variant's accept length is an exact number, compared without noise.

Each variant is a name and overrides of the preset's DrafterRun (`engine.train.presets`); `base` (no overrides) is
always measured. Target A is trained once (the preset's target run, `--target-set` overriding fields) unless
`--target` names one. Variants train side by side (`--jobs`, separate processes sharing the GPU). Every variant's
accept length is measured on a chain of `--chain` drafts, greedy twice and sampled once:
  heldout   train-drafter's measure: the preset's held-out prompts, eval_prompts of prompt_chars, max_new_tokens
  headline  baseline-eagle3's: `--headline-prompts` prompts cut to `--prompt-len` tokens, `--new-tokens` each
  sampled   the headline prompts at `--temperature` (tree-sweep's sampled chain: drafts drawn from the drafter,
            speculative sampling; seeded, so exact too); 0 leaves it out

    python scripts/ab-train.py /tmp/ab --preset gpu --jobs 4 \\
        --variant x4:steps=1000,batch_size=16,samples=8192 --variant lr3:lr=3e-3

It prints a table (`--json`: one JSON object) and writes OUT/ab-train.json. It records nothing.
Exit codes: 0 done, 2 bad arguments, 3 a variant failed (one line on stderr each).
"""
from __future__ import annotations

import argparse
import ast
import concurrent.futures as futures
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from engine.errors import EngineError  # noqa: E402
from engine.train.presets import FAMILIES, DrafterRun, Preset, get_preset, names, with_overrides  # noqa: E402


def overrides(text: str) -> dict:
    """'steps=1000,lr=3e-3' -> {'steps': 1000, 'lr': 0.003}; values are Python literals."""
    out = {}
    for item in filter(None, text.split(",")):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise argparse.ArgumentTypeError(f"expected FIELD=VALUE, got {item!r}")
        try:
            out[key.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            raise argparse.ArgumentTypeError(f"{key.strip()}: {value!r} is not a number or literal") from None
    return out


def variant(text: str) -> tuple[str, dict]:
    name, sep, rest = text.partition(":")
    if not sep or not name or not name.replace("-", "").replace("_", "").isalnum():
        raise argparse.ArgumentTypeError(f"expected NAME:FIELD=VALUE,..., got {text!r}")
    return name, overrides(rest)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    ap.add_argument("out", type=Path, help="working directory (targets, drafters, ab-train.json)")
    ap.add_argument("--preset", default="gpu", choices=names())
    ap.add_argument("--device", default=None, help="cpu or cuda [default: the preset's]")
    ap.add_argument("--family", default="llama", choices=FAMILIES, help="the target's family (when trained here)")
    ap.add_argument("--variant", type=variant, action="append", default=[], metavar="NAME:FIELD=VALUE,...")
    ap.add_argument("--base", type=overrides, default={}, metavar="FIELD=VALUE,...",
                    help="overrides applied to every variant, base included")
    ap.add_argument("--target", type=Path, default=None, help="a trained target A (HF directory with tokenizer)")
    ap.add_argument("--target-set", type=overrides, default={}, metavar="FIELD=VALUE,...",
                    help="overrides of the preset's target A run when training it here")
    ap.add_argument("--jobs", type=int, default=1, help="variants trained at once (1: in this process)")
    ap.add_argument("--chain", type=int, default=7, help="draft steps per cycle")
    ap.add_argument("--eval-prompts", type=int, default=None, help="held-out prompts [default: the preset's]")
    ap.add_argument("--headline-prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.7, help="the sampled measure's (0: none)")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # one variant, in a child process
    a = ap.parse_args(argv)
    if a.jobs < 1 or a.chain < 1 or min(a.headline_prompts, a.prompt_len, a.new_tokens) < 1:
        ap.error("--jobs, --chain, --headline-prompts, --prompt-len and --new-tokens must be >= 1")
    if not 0 <= a.temperature < 100:
        ap.error("--temperature must be >= 0 (0: no sampled measure)")
    names_seen = [n for n, _ in a.variant]
    if "base" in names_seen or len(set(names_seen)) != len(names_seen):
        ap.error("variant names must be unique and not 'base'")
    p = get_preset(a.preset)
    try:
        for _, o in [("base", {})] + a.variant:
            with_overrides(p.drafter, **{**a.base, **o})
        with_overrides(p.target_a, **a.target_set)
    except EngineError as e:
        ap.error(str(e))
    return a


def ensure_target(a: argparse.Namespace, p: Preset) -> Path:
    """Target A as the preset trains it (with --target-set), under OUT/target; or --target."""
    if a.target is not None:
        return a.target
    from engine.train.presets import target_config
    from engine.train.target import ensure_tokenizer, train_target
    from engine.train.tokenizer import eos_id, load_tokenizer

    tok_dir = ensure_tokenizer(a.out / "tokenizer", p.vocab_size, p.tokenizer_bytes)
    cfg = target_config(p, a.family, eos_id=eos_id(load_tokenizer(tok_dir)))
    run = with_overrides(p.target_a, **a.target_set)
    return train_target(a.out / "target-a", run, tok_dir, cfg, device=a.device or p.device,
                        save_dtype=p.dtype).path


def sampled_accept_length(model, draft, prompts: list[list[int]], chain: int, new_tokens: int,
                          temperature: float) -> float:
    """Tokens per cycle of the sampled chain over the prompts (prompt i drawn with seed i), the bonus included."""
    from engine.metrics import accept_length
    from engine.sampling import SamplingParams
    from engine.speculate import SpecDecoder

    max_len = max(map(len, prompts)) + new_tokens + chain + 2
    dec = SpecDecoder(model, draft, max_seq_len=max_len, steps=chain, topk=1, draft_tokens=chain + 1)
    tokens = cycles = 0
    try:
        for i, q in enumerate(prompts):
            r = dec.generate(q, new_tokens, SamplingParams(temperature=temperature), seed=i)
            tokens, cycles = tokens + r.decode_tokens, cycles + r.verify_cycles
    finally:
        model.drop_caches()
        draft.drop_caches()
    return accept_length(tokens, cycles)


def measure(a: argparse.Namespace, p: Preset, target_dir: Path, name: str, run: DrafterRun) -> dict:
    """Train one variant (resuming a finished one is free) and measure both accept lengths."""
    import torch

    from engine.drafter import load_drafter
    from engine.loading import load_model
    from engine.train.drafter import accept_length, held_out_prompts, train_drafter
    from engine.train.tokenizer import load_tokenizer

    device = a.device or p.device
    t0 = time.perf_counter()
    res = train_drafter(a.out / f"drafter-{name}", run, target_dir, device=device, save_dtype=p.dtype)
    train_s = time.perf_counter() - t0
    tok = load_tokenizer(target_dir)
    model = load_model(target_dir, device=device, dtype=p.dtype)
    draft = load_drafter(res.path, model)
    held = held_out_prompts(tok, a.eval_prompts or p.eval_prompts, p.prompt_chars, run.mix)
    cut = [q[:a.prompt_len] for q in held_out_prompts(tok, a.headline_prompts, 8 * a.prompt_len, run.mix)]
    row = {"variant": name, "run": dataclasses.asdict(run), "train_s": round(train_s, 1),
           "final_loss": res.final_loss, "step_acc": [round(x, 4) for x in res.step_acc],
           "heldout": accept_length(model, draft, held, a.chain, p.max_new_tokens),
           "headline": accept_length(model, draft, cut, a.chain, a.new_tokens),
           "sampled": sampled_accept_length(model, draft, cut, a.chain, a.new_tokens, a.temperature)
           if a.temperature else None}
    del model, draft
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return row


def worker(a: argparse.Namespace, argv: list[str], name: str) -> dict:
    """The variant in a child process: its stdout's last line is the row."""
    r = subprocess.run([sys.executable, __file__, *argv, "--worker", name], capture_output=True, text=True)
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
        raise EngineError(f"variant {name} exited {r.returncode}: {tail}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def table(rows: list[dict]) -> str:
    base = next((r for r in rows if r["variant"] == "base"), None)
    lines = [f"{'variant':12s} {'headline':>9s} {'vs base':>8s} {'heldout':>8s} {'sampled':>8s} {'step0':>6s} "
             f"{'loss':>8s} {'train s':>8s}  overrides"]
    for r in sorted(rows, key=lambda r: -r["headline"]):
        d = f"{r['headline'] - base['headline']:+.2f}" if base else ""
        diff = {k: v for k, v in r["run"].items() if base and base["run"].get(k) != v}
        sampled = "-" if r["sampled"] is None else f"{r['sampled']:.3f}"
        lines.append(f"{r['variant']:12s} {r['headline']:9.3f} {d:>8s} {r['heldout']:8.3f} {sampled:>8s} "
                     f"{r['step_acc'][0]:6.3f} {r['final_loss']:8.3f} {r['train_s']:8.1f}  {diff or ''}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse(argv)
    p = get_preset(a.preset)
    runs = {n: with_overrides(p.drafter, **{**a.base, **o}) for n, o in [("base", {})] + a.variant}
    try:
        a.out.mkdir(parents=True, exist_ok=True)
        target_dir = ensure_target(a, p)
        if a.worker is not None:
            print(json.dumps(measure(a, p, target_dir, a.worker, runs[a.worker])))
            return 0
        child = argv + (["--target", str(target_dir)] if a.target is None else [])
        rows, failed = [], []
        with futures.ThreadPoolExecutor(a.jobs) as pool:
            todo = [(pool.submit(worker, a, child, n) if a.jobs > 1 else None, n) for n in runs]
            for fut, n in todo:
                try:
                    rows.append(fut.result() if fut else measure(a, p, target_dir, n, runs[n]))
                    print(f"done {n}: headline {rows[-1]['headline']:.3f}", file=sys.stderr, flush=True)
                except EngineError as e:
                    failed.append(n)
                    print(f"ab-train: {e}", file=sys.stderr)
    except EngineError as e:
        print(f"ab-train: {e}", file=sys.stderr)
        return 3
    report = {"preset": a.preset, "family": a.family, "target": str(target_dir), "chain": a.chain, "rows": rows,
              "failed": failed}
    (a.out / "ab-train.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report) if a.json else table(rows))
    return 3 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
