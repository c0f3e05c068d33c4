"""engine/kernels.py: the kernel choices as one frozen value - defaults, validation, the plain-dict round trip a
runbook parameter needs, the CLI's --kernels - and its dispatch-by-name rule: a kernel that no run chooses is named
nowhere in the code a default run reaches (what keeps landing one from staling a record's fingerprint)."""
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.errors import EngineError
from engine.kernels import HOMES, Kernels, implementation
from specbook import provenance
from specbook.runbooks import load as load_runbook

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_round_trip_through_a_plain_dict():
    k = Kernels()
    assert Kernels.from_dict(k.as_dict()) == k and Kernels.from_dict(None) == k and Kernels.from_dict({}) == k
    chosen = Kernels.from_dict({"verify_linear": "few_rows", "merge": "grouped_merge", "fuse_merge": False,
                                "moe_block_i": 8})
    assert Kernels.from_dict(json.loads(json.dumps(chosen.as_dict()))) == chosen
    assert chosen.changes() == {"verify_linear": "few_rows", "merge": "grouped_merge", "fuse_merge": False,
                                "moe_block_i": 8}
    assert str(chosen) == "verify_linear=few_rows,fuse_merge=false,merge=grouped_merge,moe_block_i=8"
    assert Kernels.parse(str(chosen)) == chosen and str(Kernels()) == "defaults"


def test_the_new_kernels_land_off_and_each_choice_names_its_implementation():
    k = Kernels()
    assert (k.linear, k.verify_linear, k.attention, k.merge) == ("gemv", "cublas", "split_kv", "unrolled_merge")
    assert (k.norm_prologue, k.swiglu_prologue, k.fuses_prologue) == ("add_then_norm", "swiglu_then_product", False)
    for choice in HOMES:
        impl = k.pick(choice)
        assert impl.__name__ == getattr(k, choice) and choice in impl.kernel_choices


@pytest.mark.parametrize("text,message", [
    ("verify_linear=gemv", "unknown verify_linear 'gemv'; one of cublas, few_rows"),
    ("linear=nope", "unknown linear 'nope'; one of cublas, gemv"),
    ("attention=Kernels", "unknown attention 'Kernels'"),
    ("merge=os.system", "unknown merge 'os.system'"),
    ("gemv_block_n=3", "gemv_block_n is 0 (the kernel's own) or a power of two"),
    ("moe_block_k=8192", "moe_block_k is 0 (the kernel's own) or a power of two up to 4096"),
    ("attention_block_n=-64", "attention_block_n is 0"),
    ("fuse_merge=maybe", "fuse_merge is true or false"),
    ("moe_warps=x", "moe_warps is an integer"),
    ("no_such=1", "unknown choice 'no_such'"),
    ("linear", "CHOICE=VALUE items"),
    ("norm_prologue=fused_add_norm,linear=cublas", "a fused prologue runs in the one-row kernel"),
])
def test_bad_choices_are_one_line_engine_errors(text, message):
    with pytest.raises(EngineError, match=message.replace("(", r"\(").replace(")", r"\)")) as e:
        Kernels.parse(text)
    assert "\n" not in str(e.value)


def test_values_of_the_wrong_type_are_refused():
    for bad in ({"fuse_merge": "yes"}, {"gemv_block_n": True}, {"linear": 3}, {"moe_block_h": 2.0}):
        with pytest.raises(EngineError):
            Kernels.from_dict(bad)
    with pytest.raises(EngineError, match="a mapping"):
        Kernels.from_dict(["linear"])
    with pytest.raises(EngineError, match="unknown merge"):
        implementation("merge", "grouped_merge\n")


def test_a_model_built_with_kernels_carries_them_into_every_module():
    from engine import gemv
    from engine.decode_attention import grouped_merge
    from engine.loading import random_model
    from engine.model import Block, ProductBlock

    k = Kernels(verify_linear="few_rows", merge="grouped_merge", fuse_merge=False, attention_block_n=32,
                swiglu_prologue="fused_swiglu")
    model = random_model("tiny", kernels=k)
    assert model.kernels is k
    linears = [m for m in model.modules() if isinstance(m, gemv.Linear)]
    assert linears and all(m.rows is gemv.few_rows and m.kernels is k for m in linears)
    attend = model.layers[0].self_attn.attend
    assert attend.keywords == {"fuse_merge": False, "merge": grouped_merge, "block_n": 32}
    assert all(type(b) is ProductBlock for b in model.layers)
    assert all(type(b) is Block for b in random_model("tiny").layers)
    mla = random_model("deepseek-v3-tiny", kernels=Kernels(fuse_shared=False, moe_block_i=8,
                                                          norm_prologue="fused_add_norm"))
    experts = [m.mlp.experts for m in mla.layers if hasattr(m.mlp, "experts")]
    assert experts and all(not e.fuse_shared and e.blocks["block_i"] == 8 for e in experts)
    assert all(type(b) is Block for b in mla.layers)  # MLA and MoE layers keep their own forward


def test_moe_experts_take_their_choices():
    from engine import moe_decode
    from engine.deepseek import Experts

    plain, chosen = Experts(4, 8, 16), Experts(4, 8, 16, Kernels(fuse_shared=False, moe_block_i=8, moe_warps=2))
    assert plain.fuse_shared and not chosen.fuse_shared
    assert chosen.blocks == {"block_i": 8, "block_h": moe_decode.BLOCK_H, "block_k": moe_decode.BLOCK_K,
                             "num_warps": 2}
    assert plain.blocks == {"block_i": moe_decode.BLOCK_I, "block_h": moe_decode.BLOCK_H,
                            "block_k": moe_decode.BLOCK_K, "num_warps": moe_decode.NUM_WARPS}


def test_default_output_on_cpu_is_the_same_whatever_the_gpu_choices():
    """On CPU every choice falls back to the same ops (F.linear, SDPA): the generation is the same."""
    from engine.loading import random_model
    from engine.target_decoder import TargetDecoder

    prompt = list(range(3, 20))
    outs = []
    for k in (Kernels(), Kernels(verify_linear="few_rows", merge="grouped_merge", norm_prologue="fused_add_norm",
                                 swiglu_prologue="fused_swiglu"), Kernels(linear="cublas", attention="sdpa")):
        model = random_model("tiny", seed=3, kernels=k)
        outs.append(TargetDecoder(model, 64, cuda_graphs=False).generate(prompt, 12).token_ids)
    assert outs[0] == outs[1] == outs[2]


def test_the_cli_takes_kernels_and_refuses_bad_ones_with_exit_2():
    run = [sys.executable, "-m", "engine", "generate", "--shape", "tiny", "--prompt-ids", "1,2,3",
           "--max-new-tokens", "2", "--json"]
    ok = subprocess.run(run + ["--kernels", "verify_linear=few_rows,fuse_merge=false"], capture_output=True,
                        text=True, cwd=ROOT, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["kernels"] == "verify_linear=few_rows,fuse_merge=false"
    bad = subprocess.run(run + ["--kernels", "verify_linear=fast"], capture_output=True, text=True, cwd=ROOT,
                         timeout=300)
    assert bad.returncode == 2 and "unknown verify_linear 'fast'" in bad.stderr


# ---- dispatch by name: what a default run reaches -------------------------------------------------------------
def reached(runbook: str, profile: str, kernels: dict | None = None) -> set[str]:
    """The engine definitions a runbook's fingerprint covers (specbook.codehash, the records' own rule), with its
    parameters on a profile, plus a `kernels` parameter when given."""
    rb = load_runbook(ROOT, runbook)
    params = {**rb.params_for(profile), **({"kernels": kernels} if kernels else {})}
    units, _ = provenance.engine_units(ROOT, rb.source, params)
    return {u.label for u in units}


def test_no_kernel_that_lands_off_is_in_a_default_runs_fingerprint():
    """The rule of the module doc, on the records' fingerprint: no record of a runbook run with the defaults covers
    an implementation other than a default one, nor the Triton kernels and helpers only such an implementation
    uses; a run whose parameters name a choice covers its kernel."""
    k = Kernels()
    marked = {name for choice, home in HOMES.items() for name, v in vars(importlib.import_module(home)).items()
              if choice in getattr(v, "kernel_choices", ())}
    chosen_by_default = {getattr(k, c) for c in HOMES}
    off = marked - chosen_by_default - {"sdpa"}  # sdpa: also split_kv's own fallback, today's code
    assert off == {"few_rows", "grouped_merge", "fused_add_norm", "fused_swiglu"}
    own_code = {"_gemm_rows", "few_row_blocks", "gemm_few_rows", "_merge_in_groups", "_splitkv_partial_grouped",
                "_gemv_prologue_rows", "prologue_blocks", "add_norm_gemv", "swiglu_gemv"}
    for runbook, profile in (("baseline-eagle3", "h200"), ("baseline-decode", "h200"), ("tree-sweep", "cpu")):
        default = reached(runbook, profile)
        assert {"cublas", "gemv", "split_kv"} <= default
        assert default & (off | own_code) == set(), (runbook, "a kernel that lands off is in a default fingerprint")
    # the check can fail: a run that names a choice covers its kernel
    assert {"_gemm_rows", "few_row_blocks"} <= reached("baseline-eagle3", "h200", {"verify_linear": "few_rows"})
    assert "_merge_in_groups" in reached("baseline-eagle3", "h200", {"merge": "grouped_merge"})
