"""EAGLE-3 drafter training on a frozen target: training-time test (TTT), draft vocabulary from token frequencies,
hidden states generated online, published-format output (engine.drafter.save_drafter).

Data: `run.samples` sequences, each a corpus window continued by the target's own greedy answer (`regenerate`, as
EAGLE and SpecForge regenerate their chat data with the target). The target's features and distributions are
computed for every batch as it is drawn, never stored.

Training-time test unrolls the draft layer `ttt_steps` times over a whole sequence at once. Step j (0-based) at base
position t mirrors draft step j+1 at inference: its hidden input is fc(target features at t) for j = 0, else the
draft layer's own pre-norm output of step j-1 at base t; its token is x_{t+j+1}; its RoPE position is t+j. It
attends to step-0 keys at bases <= t (the context the target verified) and to its own chain's keys of steps
1..j at base t only. The label is the target's next-token distribution at position t+j+1 restricted to the draft
vocabulary (soft cross-entropy), weighted 0.8**j; positions whose target argmax is outside the draft vocabulary, or
that run past the sequence, are left out (as SpecForge does). With `kl_temperature` T > 0 each step also adds
T**2 * KL(p_T || q_T) between the target's and the drafter's distributions at temperature T (distillation's
scaling keeps its gradients the size of the T = 1 term's).

The unrolled keys are held by `StepKV`, which stands in for the attention module's KV cache (the engine's cache
interface: `update(slots, k, v) -> all keys and values so far`, here one tensor per step), and the module's attention
function is swapped for `ttt_attention` (`unrolled`), so training runs the Attention code that inference runs but
for that one function. `ttt_attention` is plain tensor math, as SpecForge's: a causal score matrix against step 0's
keys and one dot product per base against each later step's keys, one softmax over both; no [T, (j+1)T] mask and no
fused attention kernel, whose deterministic backward is slow. It computes what the masked form (`grouped_attention`
over the concatenated keys with `ttt_mask`) computes.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from engine.drafter import Eagle3Drafter, draft_vocab, load_drafter, new_drafter, save_drafter
from engine.errors import EngineError
from engine.loading import load_model, read_config, resolve_dtype
from engine.metrics import accept_length as tokens_per_cycle
from engine.model import Transformer
from engine.train import corpus, loop
from engine.train.data import random_windows, step_generator, token_stream
from engine.train.presets import DrafterRun
from engine.train.target import autocast, file_digest, make_optimizer
from engine.train.tokenizer import load_tokenizer, save_tokenizer, tokenizer_hash


class StepKV:
    """Keys and values of every unrolled step so far, one [B, Hkv, T, D] tensor per step (autograd-friendly)."""

    def __init__(self) -> None:
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def update(self, slots, k: torch.Tensor, v: torch.Tensor
               ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        self.k.append(k)
        self.v.append(v)
        return tuple(self.k), tuple(self.v)


def ttt_attention(q: torch.Tensor, k: Sequence[torch.Tensor], v: Sequence[torch.Tensor],
                  mask: torch.Tensor | None = None) -> torch.Tensor:
    """Step j's attention: q [B, H, T, D]; k, v the keys and values of steps 0..j, [B, Hkv, T, D] each -> [B, H, T, Dv].

    A query at base t sees step-0 keys at bases <= t (q @ k_0^T, masked causally) and each later step's key at base t
    only (one dot product per base); one float32 softmax over the T + j scores. Matmuls and elementwise ops only, so
    the backward is deterministic without a special kernel. GQA as in grouped_attention: each KV head's query heads
    stacked along the query axis, K/V never repeated. The step structure is the mask; `mask` must be None."""
    if mask is not None:
        raise EngineError("ttt_attention takes no mask: which keys a query sees follows from the steps")
    B, H, T, D = q.shape
    kv = k[0].shape[1]
    rep = H // kv
    qg = q.reshape(B, kv, rep * T, D)  # row r*T + t of KV head h is query head h*rep + r at base t
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    s0 = (qg @ k[0].transpose(-1, -2)).view(B, kv, rep, T, T).float().masked_fill(~causal, float("-inf"))
    q5 = qg.view(B, kv, rep, T, D).float()
    later = len(k) - 1  # steps 1..j, all of their keys in one tensor: a few kernels whatever j is
    kd = torch.stack(list(k[1:]), dim=2).float() if later else None  # [B, kv, j, T, D]
    diag = torch.einsum("bgrtd,bgjtd->bgrtj", q5, kd) if later else s0[..., :0]  # [B, kv, rep, T, j]
    p = (torch.cat([s0, diag], dim=-1) * D ** -0.5).softmax(-1)
    p0, pd = p.split([T, later], dim=-1)
    out = (p0.to(v[0].dtype).reshape(B, kv, rep * T, T) @ v[0]).view(B, kv, rep, T, -1).float()
    if later:
        out = out + torch.einsum("bgrtj,bgjtd->bgrtd", pd, torch.stack(list(v[1:]), dim=2).float())
    return out.reshape(B, H, T, -1).to(q.dtype)


def ttt_mask(T: int, j: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[T, (j+1)T] bool: step j's query at base t sees step-0 keys at bases <= t and steps 1..j at base t - what
    ttt_attention computes, as a mask over the concatenated keys (the tests' reference)."""
    base = torch.arange(T, device=device)
    causal = base[None, :] <= base[:, None]
    diagonal = base[None, :] == base[:, None]
    return torch.cat([causal] + [diagonal] * j, dim=1)


@contextlib.contextmanager
def unrolled(drafter: Eagle3Drafter):
    """Inside, the draft layer's attention writes its keys and values to a StepKV and attends with ttt_attention."""
    attn = drafter.midlayer.self_attn
    if drafter.max_seq_len:
        raise EngineError("the drafter has inference caches set up; drop_caches() before training")
    attn._modules.pop("cache", None)  # a dropped KVCache leaves its submodule slot behind; StepKV is no module
    attend = attn.attend
    attn.cache, attn.attend = StepKV(), ttt_attention
    try:
        yield
    finally:
        attn.cache, attn.attend = None, attend


@dataclass
class Targets:
    """What the frozen target says about one batch, restricted to the draft vocabulary."""
    features: torch.Tensor  # [B, T, 3H] aux hidden states
    probs: torch.Tensor  # [B, T, Vd] next-token distribution over the draft vocabulary
    argmax: torch.Tensor  # [B, T] target-vocabulary id of the target's top token
    in_draft: torch.Tensor  # [B, T] bool: that top token is in the draft vocabulary
    tempered: torch.Tensor | None = None  # [B, T, Vd] the distribution at kl_temperature (None: no KL term)


@torch.no_grad()
def target_outputs(target: Transformer, drafter: Eagle3Drafter, x: torch.Tensor, kl_temperature: float = 0.0
                   ) -> Targets:
    logits, aux = target(x, torch.arange(x.shape[1], device=x.device), hidden_layers=drafter.aux_layers)
    draft_ids = torch.arange(drafter.cfg.draft_vocab_size, device=x.device) + drafter.d2t
    top = logits.argmax(-1)
    draft_logits = logits[..., draft_ids].float()
    tempered = (draft_logits / kl_temperature).softmax(-1) if kl_temperature > 0 else None
    return Targets(aux, draft_logits.softmax(-1), top, drafter.t2d[top], tempered)


def _shift(t: torch.Tensor, n: int) -> torch.Tensor:
    """t[:, n:] padded at the end back to length T (the padding is masked out)."""
    pad = [0, 0] * (t.dim() - 2) + [0, n]
    return F.pad(t[:, n:], pad)


def ttt_logits(drafter: Eagle3Drafter, x: torch.Tensor, features: torch.Tensor, steps: int
               ) -> Iterator[torch.Tensor]:
    """Draft logits [B, T, Vd] of each unrolled step j = 0..steps-1 over x [B, T] (see the module docstring)."""
    pos = torch.arange(x.shape[1], device=x.device)
    hidden = features
    with unrolled(drafter):
        for j in range(steps):
            logits, hidden = drafter(hidden, _shift(x, j + 1), pos + j)
            yield logits


def ttt_loss(drafter: Eagle3Drafter, x: torch.Tensor, tg: Targets, steps: int, decay: float,
             kl_temperature: float = 0.0) -> tuple[torch.Tensor, list[float]]:
    """Weighted soft cross-entropy of `steps` unrolled draft steps over x [B, T] (plus the KL term at kl_temperature
    when > 0: target_outputs must have been given the same temperature); per-step top-1 accuracy."""
    if kl_temperature > 0 and tg.tempered is None:
        raise EngineError("a KL term needs the target's tempered distribution: target_outputs(..., kl_temperature)")
    T = x.shape[1]
    pos = torch.arange(T, device=x.device)
    total = x.new_zeros((), dtype=torch.float32)
    accs: list[torch.Tensor] = []
    for j, logits in enumerate(ttt_logits(drafter, x, tg.features, steps)):
        valid = (pos < T - 1 - j)[None, :] & _shift(tg.in_draft, j + 1)  # [B, T]
        ce = -(_shift(tg.probs, j + 1) * logits.log_softmax(-1)).sum(-1)  # [B, T]
        if kl_temperature > 0:
            kl = F.kl_div((logits.float() / kl_temperature).log_softmax(-1), _shift(tg.tempered, j + 1),
                          reduction="none").sum(-1)  # [B, T]: sum p_T (log p_T - log q_T), 0 log 0 = 0
            ce = ce + kl_temperature ** 2 * kl
        n = valid.sum().clamp(min=1)
        total = total + decay ** j * (ce * valid).sum() / n
        hit = drafter.draft_to_target(logits.argmax(-1)) == _shift(tg.argmax, j + 1)
        accs.append((hit & valid).sum() / n)
    return total, torch.stack(accs).tolist()  # one host sync for all steps


@dataclass
class DrafterResult:
    path: Path
    final_loss: float
    step_acc: list[float]  # top-1 accuracy per unrolled step, mean over the last 5% of training
    log: loop.TrainLog


def check_pair(target_dir: Path, drafter_dir: Path) -> None:
    """A drafter trained for another tokenizer or vocabulary than the target's: one clear error."""
    tv = read_config(target_dir).vocab_size
    dv = json.loads((drafter_dir / "config.json").read_text()).get("vocab_size") \
        if (drafter_dir / "config.json").is_file() else None
    if dv is not None and dv != tv:
        raise EngineError(f"drafter {drafter_dir} has vocab_size {dv}; target {target_dir} has {tv}: "
                          "they use different vocabularies")
    th, dh = tokenizer_hash(target_dir), tokenizer_hash(drafter_dir)
    if th and dh and th != dh:
        raise EngineError(f"drafter {drafter_dir} was trained with another tokenizer than target {target_dir}")


@torch.no_grad()
def regenerate(target: Transformer, stream: torch.Tensor, run: DrafterRun, cuda_graphs: bool = True) -> torch.Tensor:
    """[run.samples, run.seq_len] training sequences: a corpus window of seq_len - regen_tokens tokens continued by
    the target's own greedy answer, as EAGLE and SpecForge regenerate their data with the target - the drafter
    learns what the target says, not what the corpus says (they differ most where a small target loops).
    Each batch of run.regen_batch windows is one `greedy_continue` (its steps CUDA-graph replays on a GPU with
    cuda_graphs; scripts/ab-regen.py times that against cuda_graphs=False and compares the tokens)."""
    if run.samples <= 0:
        raise EngineError(f"the number of training samples must be positive, got {run.samples}")
    if not 0 <= run.regen_tokens < run.seq_len:
        raise EngineError(f"regen_tokens {run.regen_tokens} must be in 0..{run.seq_len - 1} (seq_len - 1)")
    prompt_len = run.seq_len - run.regen_tokens
    seqs = random_windows(stream, run.samples, prompt_len, torch.Generator().manual_seed(run.seed))
    if run.regen_tokens == 0:
        return seqs
    out = [greedy_continue(target, chunk.to(target.device), run.regen_tokens, cuda_graphs).cpu()
           for chunk in tqdm(seqs.split(run.regen_batch), desc="regenerating with the target", mininterval=2.0)]
    target.drop_caches()
    return torch.cat(out)


@torch.no_grad()
def greedy_continue(target: Transformer, x: torch.Tensor, new_tokens: int, cuda_graphs: bool = True
                    ) -> torch.Tensor:
    """x [B, L] (on the target's device) continued by the target's greedy answer -> [B, L + new_tokens]: a prefill,
    then one forward per token; each step after the prefill is one replay of a CUDA graph over static buffers (on
    a GPU, with cuda_graphs; eager elsewhere), so no step waits for Python or for a position copied from the host.
    The caches are left set up; drop them when done (`regenerate` does, after its last batch)."""
    from engine.graphs import CapturedCall  # the training modules' one use of the engine's graphs

    if new_tokens < 1:
        raise EngineError(f"new_tokens must be at least 1, got {new_tokens}")
    B, L = x.shape
    dev = x.device
    target.setup_caches(L + new_tokens, batch_size=B)
    with autocast(dev):
        logits, _ = target(x, torch.arange(L, device=dev), last_logits_only=True)
    out = torch.zeros(B, new_tokens + 2, dtype=torch.long, device=dev)  # + room for the capture's warm-up steps
    out[:, 0] = logits[:, -1].argmax(-1)
    state = {"token": out[:, :1].clone(), "input_pos": torch.full((1,), L, device=dev),
             "idx": torch.ones(1, dtype=torch.long, device=dev), "out": out}

    def step(token, input_pos, idx, out):
        with autocast(dev):
            logits, _ = target(token, input_pos)
        nxt = logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        out.index_copy_(1, idx, nxt)
        token.copy_(nxt)
        input_pos.add_(1)
        idx.add_(1)

    # A capture first runs the step twice (its warm-up), writing cache slots L and L + 1 as the first real steps
    # will again: so only a cache longer than that is captured, and the buffers start over after it.
    call = CapturedCall(step, state, enabled=cuda_graphs and new_tokens > 2)
    state["token"].copy_(out[:, :1])
    state["input_pos"].fill_(L)
    state["idx"].fill_(1)
    for _ in range(new_tokens - 1):
        call()
    return torch.cat([x, out[:, :new_tokens]], 1)


def _frozen_target(target_dir: Path, dev: torch.device) -> Transformer:
    """The target as drafter training reads it: bf16 on CUDA, float32 elsewhere, no gradients."""
    target = load_model(target_dir, device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
    return target.requires_grad_(False)


def training_sequences(target_dir: str | Path, run: DrafterRun, device: str = "cpu") -> torch.Tensor:
    """The [run.samples, run.seq_len] sequences train_drafter regenerates for `run` with the target in target_dir:
    made once, they train several drafters on the same samples (train_drafter(seqs=)), e.g. a fine-tune and a
    drafter from scratch beside it."""
    target_dir = Path(target_dir)
    stream = token_stream(load_tokenizer(target_dir), corpus.texts(run.mix, "train", run.data_bytes))
    return regenerate(_frozen_target(target_dir, torch.device(device)), stream, run)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().cpu().numpy().tobytes()).hexdigest()[:16]


def train_drafter(out_dir: str | Path, run: DrafterRun, target_dir: str | Path, init_from: str | Path | None = None,
                  device: str = "cpu", save_dtype: str = "float32", eval_fn=None, eval_every: int = 0,
                  seqs: torch.Tensor | None = None) -> DrafterResult:
    """Train a drafter for the target in target_dir (resuming an interrupted run in out_dir) on run.samples
    regenerated sequences. init_from: an existing drafter to fine-tune (approach A); its draft vocabulary is kept.
    eval_fn(drafter, target) -> {name: value} is called every eval_every steps on a copy saved and loaded as
    published. seqs: the training sequences when already made (training_sequences), instead of regenerating them."""
    out, target_dir = Path(out_dir), Path(target_dir)
    if not (math.isfinite(run.kl_temperature) and run.kl_temperature >= 0):
        raise EngineError(f"kl_temperature must be a finite number >= 0 (0: no KL term), got {run.kl_temperature}")
    if init_from is not None:
        check_pair(target_dir, Path(init_from))
    if seqs is not None and tuple(seqs.shape) != (run.samples, run.seq_len):
        raise EngineError(f"training sequences of shape {tuple(seqs.shape)} for a run of {run.samples} samples of "
                          f"{run.seq_len} tokens")
    tok = load_tokenizer(target_dir)
    run_params = dataclasses.asdict(run)
    if not run.kl_temperature:  # off: the parameters of runs made before the field, whose outputs stay valid
        del run_params["kl_temperature"]
    params = {"run": run_params, "target": file_digest(target_dir / "model.safetensors"),
              "tokenizer": tokenizer_hash(target_dir), "corpus": corpus.manifest_hash(),
              "init_from": file_digest(Path(init_from) / "model.safetensors") if init_from else None,
              "save_dtype": save_dtype}
    if seqs is not None:  # only then, as for kl_temperature: earlier runs' parameters stay as they were
        params["seqs"] = _digest(seqs)
    dev = torch.device(device)
    target = _frozen_target(target_dir, dev)
    if (log := loop.read_log(out, params)) is not None and (out / "model.safetensors").is_file():
        return _result(out, log)

    if seqs is None:
        seqs = regenerate(target, token_stream(tok, corpus.texts(run.mix, "train", run.data_bytes)), run)
    if init_from is not None:
        drafter = load_drafter(init_from, target, device=dev, dtype=torch.float32)
    else:
        counts = torch.bincount(seqs.flatten(), minlength=target.cfg.vocab_size)
        drafter = new_drafter(target.cfg, draft_vocab(counts, run.draft_vocab_size), target.embed_tokens,
                              seed=run.seed, device=dev)
    drafter.train()
    opt = make_optimizer(drafter, run.lr, run.weight_decay)

    def step_fn(step: int):
        rows = torch.randint(0, len(seqs), (run.batch_size,), generator=step_generator(run.seed, step))
        x = seqs[rows].to(dev)
        with autocast(dev):
            tg = target_outputs(target, drafter, x, run.kl_temperature)
            loss, accs = ttt_loss(drafter, x, tg, run.ttt_steps, run.step_decay, run.kl_temperature)
        return loss, {f"acc_{j}": a for j, a in enumerate(accs)}

    def evaluate() -> dict[str, float]:
        # measure what would be published: saved, loaded back in the target's dtype, never the training module
        with tempfile.TemporaryDirectory() as tmp:
            save_drafter(drafter, tmp)
            return eval_fn(load_drafter(tmp, target), target)

    sched = loop.Schedule(run.steps, run.lr, run.warmup, run.min_lr_ratio, run.grad_clip, run.ckpt_every)
    log = loop.train(out, params, drafter, opt, sched, step_fn, f"drafter {out.name} ({run.mix})",
                     evaluate if eval_fn else None, eval_every)
    with loop.disk_errors(out):
        save_drafter(drafter.eval(), out, dtype=resolve_dtype(save_dtype))
        save_tokenizer(tok, out)
    loop.finish(out, log)
    return _result(out, log)


def held_out_prompts(tok, n: int, chars: int, mix: str = "A") -> list[list[int]]:
    """Token ids of the held-out prompts (engine.train.corpus.prompts)."""
    return [e.ids for e in tok.encode_batch(corpus.prompts(n, chars, mix))]


@torch.no_grad()
def accept_length(target: Transformer, drafter: Eagle3Drafter, prompts: list[list[int]], steps: int = 7,
                  max_new_tokens: int = 64) -> float:
    """Greedy chain speculation (topk 1, `steps` draft steps) over the prompts with engine.speculate.SpecDecoder
    (captured on a GPU: the same kernels as eager, replayed without Python's launch cost): engine.metrics.accept_length
    over all prompts (token-weighted), the bonus token included."""
    from engine.speculate import SpecDecoder

    max_len = max(len(p) for p in prompts) + max_new_tokens + steps + 2
    dec = SpecDecoder(target, drafter, max_seq_len=max_len, steps=steps, topk=1, draft_tokens=steps + 1)
    tokens = cycles = 0
    try:
        for p in prompts:
            r = dec.generate(p, max_new_tokens)
            tokens, cycles = tokens + r.decode_tokens, cycles + r.verify_cycles
    finally:
        target.drop_caches()
        drafter.drop_caches()
    return tokens_per_cycle(tokens, cycles)


def _result(out: Path, log: loop.TrainLog) -> DrafterResult:
    h = log.history
    tail = max(1, len(h["loss"]) // 20)
    accs = [sum(h[k][-tail:]) / tail for k in sorted((k for k in h if k.startswith("acc_")), key=lambda k: int(k[4:]))]
    return DrafterResult(out, log.final_loss, accs, log)
