"""`python -m engine train corpus | targets | drafter`: the miniature K2 -> K2.5 world from the command line.
Errors are EngineErrors: engine/__main__.py prints them as one line and exits 2."""
from __future__ import annotations

import json

import click

from engine.train.corpus import MIXES
from engine.train.presets import FAMILIES, names

STEPS = click.IntRange(min=1)


@click.group("train")
def train_command() -> None:
    """Train the miniature world: tokenizer, targets A and B, EAGLE-3 drafters (resumable after a kill)."""


def preset_option(f):
    return click.option("--preset", default="cpu", show_default=True, type=click.Choice(names()),
                        help="Training preset: cpu (minutes on 2 cores) or gpu (one H200).")(f)


def device_option(f):
    return click.option("--device", default=None, help="cpu or cuda [default: the preset's].")(f)


@train_command.command("corpus")
@click.option("--fetch", "fetch_only", is_flag=True,
              help="Only fetch and verify the pinned archives; prints the directory to copy to a machine without "
                   "network (there: SPECBOOK_CORPUS_DIR=that copy).")
def corpus_cmd(fetch_only: bool) -> None:
    """Files and bytes per group and split of the pinned corpus, and its manifest hash (fetched on first use)."""
    from engine.train import corpus

    if fetch_only:
        paths = corpus.fetch()
        click.echo(f"{len(paths)} archives verified in {corpus.corpus_dir()}")
        return
    for key, row in corpus.stats().items():
        click.echo(f"{key:22s} {row['files']:7d} files {row['bytes'] / 1e6:9.1f} MB")
    click.echo(f"manifest_hash {corpus.manifest_hash()}")


@train_command.command("targets")
@click.argument("out_dir", type=click.Path(file_okay=False))
@preset_option
@device_option
@click.option("--family", default="llama", show_default=True, type=click.Choice(FAMILIES), help="Target family.")
@click.option("--steps-a", type=STEPS, default=None, help="Override target A's optimizer steps.")
@click.option("--steps-b", type=STEPS, default=None, help="Override target B's optimizer steps.")
def targets_cmd(out_dir: str, preset: str, device: str | None, family: str, steps_a: int | None,
                steps_b: int | None) -> None:
    """Tokenizer, target A (mix A) and target B (A trained further on mix B) under OUT_DIR."""
    from engine.train.presets import get_preset, with_overrides
    from engine.train.target import train_targets

    p = get_preset(preset)
    a, b = train_targets(out_dir, p, family, device, with_overrides(p.target_a, steps=steps_a),
                         with_overrides(p.target_b, steps=steps_b))
    for name, r in (("target-a", a), ("target-b", b)):
        click.echo(json.dumps({"model": name, "path": str(r.path), "params": r.n_params,
                               "final_loss": round(r.final_loss, 4), "val_loss": round(r.val_loss, 4)}))


@train_command.command("drafter")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--target", "target_dir", required=True, type=click.Path(file_okay=False),
              help="The target's HF directory (with tokenizer.json).")
@preset_option
@device_option
@click.option("--init-from", type=click.Path(file_okay=False), default=None,
              help="Fine-tune this EAGLE-3 drafter instead of starting from scratch (approach A).")
@click.option("--mix", default=None, type=click.Choice(list(MIXES)), help="Corpus mix [default: the preset's].")
@click.option("--steps", type=STEPS, default=None, help="Override the optimizer steps.")
@click.option("--samples", type=click.IntRange(min=1), default=None,
              help="Training sequences (corpus prompt + the target's answer) [default: the preset's].")
@click.option("--eval-prompts", type=click.IntRange(min=0), default=None,
              help="Measure accept length (greedy chain, 7 steps) on this many held-out prompts at the end.")
def drafter_cmd(out_dir: str, target_dir: str, preset: str, device: str | None, init_from: str | None,
                mix: str | None, steps: int | None, samples: int | None, eval_prompts: int | None) -> None:
    """Train an EAGLE-3 drafter for TARGET into OUT_DIR (published format)."""
    from engine.train.drafter import accept_length, held_out_prompts, train_drafter
    from engine.train.presets import get_preset, with_overrides
    from engine.train.tokenizer import load_tokenizer

    p = get_preset(preset)
    run = with_overrides(p.finetune if init_from else p.drafter, steps=steps, mix=mix, samples=samples)
    r = train_drafter(out_dir, run, target_dir, init_from, device or p.device, p.dtype)
    row = {"path": str(r.path), "final_loss": round(r.final_loss, 4), "step_acc": [round(a, 3) for a in r.step_acc]}
    if eval_prompts:
        from engine.drafter import load_drafter
        from engine.loading import load_model

        target = load_model(target_dir, device=device or p.device, dtype=p.dtype)
        prompts = held_out_prompts(load_tokenizer(target_dir), eval_prompts, p.prompt_chars, run.mix)
        row["accept_length"] = round(accept_length(target, load_drafter(out_dir, target), prompts, 7,
                                                   p.max_new_tokens), 4)
    click.echo(json.dumps(row))
