"""Deterministic mode on CPU: every target forward of the decode loop at the verify's width, so greedy EAGLE-3 gives
the baseline's tokens and the target's logits at a position are bit-identical between a verify row and the decode
step (float32 and bfloat16)."""
import pytest
import torch

from engine.deterministic import Deterministic, WidthForward, width_forward
from engine.errors import EngineError
from engine.target_decoder import TargetDecoder
from engine.loading import random_model
from engine.speculate import SpecDecoder
from test_speculate import bigram_target, drafter_for, prompts

pytestmark = pytest.mark.usefixtures("one_thread")
DTYPES = [torch.float32, torch.bfloat16]
STEPS = 4


class Logits:
    """Records every decode-loop forward of a model (calls with explicit slots and mask; the prefill gives neither):
    its positions, input tokens and logits."""

    def __init__(self, model: torch.nn.Module):
        self.calls: list[tuple[list[int], list[int], torch.Tensor]] = []
        self.handle = model.register_forward_hook(self.hook, with_kwargs=True)

    def hook(self, module, args, kwargs, output) -> None:
        if len(args) == 4:
            self.calls.append((args[1].tolist(), args[0][0].tolist(), output[0][0].clone()))

    def rows(self, seq: list[int]) -> list[tuple[int, int, torch.Tensor]]:
        """(position, row, logits) of every row whose tokens up to itself are the sequence's: the target saw the
        real context there (rows after a rejected draft did not)."""
        out = []
        for pos, toks, logits in self.calls:
            for i, (q, t) in enumerate(zip(pos, toks)):
                if q >= len(seq) or seq[pos[0]:q + 1] != toks[:i + 1]:
                    break
                out.append((q, i, logits[i]))
        return out


def pair(dtype: torch.dtype, context: float = 100.0):
    t = bigram_target(context).to(dtype=dtype)
    return t, drafter_for(t, oracle=True, miss=3).to(dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seq_len", [96, 62])  # 62: the last cycles fall back to verifying one token, padded too
def test_verify_rows_and_decode_steps_give_bit_identical_logits(dtype, seq_len, monkeypatch):
    t, d = pair(dtype)
    base = TargetDecoder(t, seq_len, cuda_graphs=False, deterministic=Deterministic.chain(STEPS, d))
    spec = SpecDecoder(t, d, seq_len, STEPS, 1, deterministic=True)
    padded_verifies = []
    pad = WidthForward.pad
    compared = later_rows = accepted = 0
    for p in prompts(4):
        rec = Logits(t)
        want = base.generate(p, 42)
        decode = {q: logits for q, i, logits in rec.rows(p + want.token_ids) if i == 0}
        rec.calls.clear()
        monkeypatch.setattr(WidthForward, "pad", lambda self, *a: padded_verifies.append(1) or pad(self, *a))
        got = spec.generate(p, 42)
        monkeypatch.setattr(WidthForward, "pad", pad)
        rec.handle.remove()
        assert got.token_ids == want.token_ids
        accepted += got.accepted_tokens
        for q, i, logits in rec.rows(p + got.token_ids):
            if q in decode:
                assert torch.equal(logits, decode[q]), f"position {q}, verify row {i}"
                compared += 1
                later_rows += i > 0
    # the hook saw the loop: decode steps, and verify rows past the root on accepted drafts
    assert compared > 100 and later_rows > 20 and accepted > 20, (compared, later_rows, accepted)
    assert (len(padded_verifies) > 0) == (seq_len < 96)


def test_padding_rows_leave_the_real_row_alone():
    """A forward of one token padded to the width gives that row's logits of an unpadded one-token forward (float32,
    to within rounding: the shapes differ, which is the point of the mode) and writes only slots after it."""
    t = bigram_target(100.0)
    t.setup_caches(32)
    ids = torch.tensor([prompts(1)[0][:6]])
    t(ids, torch.arange(ids.shape[1]))
    k_before = t.layers[0].self_attn.cache.k.clone()
    fw = WidthForward(t, Deterministic(5), compile=False)
    pos = torch.tensor([ids.shape[1]])
    tok = torch.tensor([[11]])
    logits, aux = fw(tok, pos, pos, t.slot_ids[None] <= pos[:, None])
    assert logits.shape == (1, 1, t.cfg.vocab_size) and aux is None
    k_after = t.layers[0].self_attn.cache.k
    assert torch.equal(k_after[:, :, :ids.shape[1]], k_before[:, :, :ids.shape[1]])
    plain, _ = t(tok, pos)
    torch.testing.assert_close(logits, plain, rtol=1e-5, atol=1e-5)


def test_padding_at_the_cache_end_stays_inside_it():
    t = random_model("tiny", seed=0)
    t.setup_caches(16)
    fw = WidthForward(t, Deterministic(8), compile=False)
    pos = torch.tensor([14])
    logits, _ = fw(torch.tensor([[3]]), pos, pos, t.slot_ids[None] <= pos[:, None])
    assert logits.shape[1] == 1 and torch.isfinite(logits).all()
    with pytest.raises(EngineError, match="does not fit"):
        fw(torch.zeros(1, 9, dtype=torch.long), torch.arange(9), torch.arange(9), torch.ones(9, 16, dtype=torch.bool))


def test_one_width_forward_per_model_and_mode():
    t, d = pair(torch.float32)
    mode = Deterministic.chain(STEPS, d)
    assert width_forward(t, mode) is width_forward(t, mode)
    assert width_forward(t, mode) is not width_forward(t, Deterministic(3, mode.hidden_layers))
    assert mode.width == STEPS + 1 and mode.hidden_layers == tuple(d.aux_layers)


def test_trees_and_eager_verify_are_refused():
    t, d = pair(torch.float32)
    with pytest.raises(EngineError, match="chain"):
        SpecDecoder(t, d, 96, 3, 2, 6, deterministic=True)
    with pytest.raises(EngineError, match="eager_verify"):
        SpecDecoder(t, d, 96, 3, 1, eager_verify=True, deterministic=True)
