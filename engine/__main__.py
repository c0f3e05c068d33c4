"""`python -m engine generate | bench | serve | train`: the bundled engine's command line.

The conventions of `runbook` (specbook/cli.py): bad input or usage prints one line on stderr and exits 2, an
unexpected failure one line and exits 3, Ctrl-C exits 130; `--debug`, before or after the command name, shows the
traceback instead.
"""
from __future__ import annotations

import json

import click

from engine.cli_options import (EXIT_CODES, SEED, FiniteFloatRange, OneLineErrors, debug_option, default_device,
                                engine_options, int_list, load_engine, with_debug)
from engine.train import train_command


class Cli(OneLineErrors, click.Group):
    """A group that turns every error into one line on stderr and the exit code of its kind (cli_options)."""

    def main(self, args=None, prog_name=None, *a, **kw):
        return super().main(args, prog_name or "python -m engine", *a, **kw)

    def add_command(self, cmd: click.Command, name: str | None = None) -> None:
        super().add_command(with_debug(cmd), name)


@click.group(cls=Cli, epilog=EXIT_CODES, params=[debug_option()],
             context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
def cli() -> None:
    """The bundled speculative-decoding engine: a target model (HF-format directory or a named random-weight
    shape), optionally an EAGLE-3 drafter, a static KV cache and CUDA-graph decoding."""


def threads_option():
    """--threads: torch's intra-op threads on a CPU (engine.cpu_threads chooses them when it is not given). Here,
    not in cli_options.py, which runbooks import through the server and training: an option of two commands would
    change their inputs hash."""
    return click.option("--threads", default=None, type=click.IntRange(min=1),
                        help="CPU threads [default: OMP_NUM_THREADS if set, else one per physical core that other "
                             "processes leave free, at least 1; on a GPU torch's default].")


def set_threads(threads: int | None, device: str | None) -> tuple[int, str]:
    """Apply --threads for the device the command will run on: (count, where it came from)."""
    from engine import cpu_threads

    return cpu_threads.set_threads(threads, default_device(device))


def threads_note(n: int, why: str) -> str:
    """How the output names the threads that ran: '1 thread (free cores)'."""
    return f"{n} thread{'s' if n != 1 else ''} ({why})"


def model_options(max_seq_len_help: str, seed_help: str, compile_help: str = ""):
    """What to load and how to run it (engine/cli_options.py), plus --seed and --json, with this command's help."""
    return engine_options(None, max_seq_len_help, compile_help=compile_help, extra=[
        click.option("--seed", default=0, show_default=True, type=SEED, help=seed_help),
        threads_option(),
        click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")])


@cli.command()
@model_options("KV-cache length: prompt + new tokens must fit [default: 2048].",
               "Seed of random weights (--shape) and of sampling.")
@click.option("--prompt", default=None, help="Prompt text (UTF-8 bytes as ids for shapes without a tokenizer).")
@click.option("--prompt-ids", default=None, callback=int_list(0), help="Prompt token ids, e.g. '1,2,3'.")
@click.option("--max-new-tokens", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--temperature", default=0.0, show_default=True, type=FiniteFloatRange(min=0), help="0 = greedy.")
@click.option("--top-k", default=0, show_default=True, type=click.IntRange(min=0), help="0 = off.")
@click.option("--top-p", default=1.0, show_default=True, type=FiniteFloatRange(0, 1, min_open=True),
              help="1 = off.")
@click.option("--ignore-eos", is_flag=True, help="Do not stop at the model's end-of-sequence ids.")
def generate(prompt, prompt_ids, max_new_tokens, temperature, top_k, top_p, ignore_eos, threads, as_json,
             **load) -> None:
    """Generate from a prompt; prints the text, the token ids, tok/s, ms per token and the threads that ran."""
    if (prompt is None) == (prompt_ids is None):
        raise click.UsageError("give exactly one of --prompt TEXT or --prompt-ids IDS")
    n_threads, why = set_threads(threads, load["device"])
    eng = load_engine(**{**load, "max_seq_len": load["max_seq_len"] or 2048})
    ids = eng.encode(prompt) if prompt is not None else prompt_ids
    r = eng.generate(ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                     stop_ids=() if ignore_eos else eng.eos_ids, seed=load["seed"])
    text = eng.decode(r.token_ids)
    if as_json:
        click.echo(json.dumps({**eng.info(), **r.to_dict(), "text": text, "threads": n_threads,
                               "threads_from": why}))
        return
    click.echo(text)
    click.echo(f"-- token ids: {r.token_ids}", err=True)
    click.echo(f"-- {len(r.token_ids)} tokens ({r.finish_reason}), prompt {r.prompt_len} | prefill "
               f"{1000 * r.prefill_s:.1f} ms | decode {r.tok_s:.1f} tok/s, {r.ms_per_token:.3f} ms/token | "
               f"accept length {r.accept_length:.2f} | {eng.info()['device']} {eng.info()['dtype']}, "
               f"{threads_note(n_threads, why)}", err=True)


@cli.command()
@model_options("KV-cache length: prompt + new tokens must fit [default: what the run needs, rounded up to 128 - "
               "attention reads the whole cache].", "Seed of random weights (--shape) and of the random prompt.",
               compile_help="; adds a 'compiled' baseline row")
@click.option("--prompt-len", default=None, type=click.IntRange(min=1),
              help="Prompt tokens [default: 128 on cuda, 16 on cpu].")
@click.option("--new-tokens", default=None, type=click.IntRange(min=1),
              help="Tokens per generation [default: 256 on cuda, 32 on cpu].")
@click.option("--repeats", default=3, show_default=True, type=click.IntRange(min=1),
              help="Timed generations per variant (median).")
@click.option("--sizes", default=",".join(map(str, (1, 2, 4, 8, 16, 32, 64))), show_default=True,
              callback=int_list(1), help="Token counts T of the forward-cost sweep.")
@click.option("--eager/--no-eager", default=True, show_default=True, help="Also time decoding without graphs.")
@click.option("--peer/--no-peer", default=True, show_default=True,
              help="Also time transformers' generate (static cache) on the same weights.")
@click.option("--torch-profile", is_flag=True,
              help="Also print torch.profiler's kernel-level table of the fastest variant's decode steps.")
def bench(prompt_len, new_tokens, repeats, sizes, eager, peer, torch_profile, threads, as_json, **load) -> None:
    """Decode tok/s and ms/token (graph and eager), bandwidth utilisation against the copy bandwidth measured in
    the same run, forward cost per T, and transformers' static-cache generate as the peer; the threads that ran."""
    from engine.bench import BenchConfig, format_bench, run_bench

    # --compile adds a "compiled" baseline row; the target-alone engine stays plain so "graph" is the uncompiled
    # step, and a speculative one is compiled (its row then compares with "compiled")
    import torch

    cfg = BenchConfig(prompt_len=prompt_len, new_tokens=new_tokens, repeats=repeats, sizes=tuple(sizes),
                      eager=eager, peer=peer, compile=load.pop("compile_"), seed=load["seed"],
                      torch_profile=torch_profile)
    cfg = cfg.resolve(torch.device(default_device(load["device"])))
    n_threads, why = set_threads(threads, load["device"])
    eng = load_engine(**{**load, "max_seq_len": load["max_seq_len"] or cfg.cache_len()},
                      compile_=cfg.compile and load["drafter"] is not None)
    r = run_bench(eng, cfg)
    if as_json:
        click.echo(json.dumps({**r.to_dict(), "threads": n_threads, "threads_from": why}))
        return
    head, _, rest = format_bench(r).partition("\n")  # the threads on the line that says what ran where
    click.echo(f"{head}, {threads_note(n_threads, why)}\n{rest}")


# ---- commands owned by other modules ------------------------------------------------------------------------
SERVE_EXTRA = ("fastapi", "uvicorn", "httpx", "prometheus_client", "jinja2")  # pyproject's serve extra

try:
    from engine.serve import serve_command
except ModuleNotFoundError as e:
    if e.name not in SERVE_EXTRA:  # without the serve extra there is no serve command; anything else is a bug
        raise
else:
    cli.add_command(serve_command, "serve")
cli.add_command(train_command, "train")


if __name__ == "__main__":
    cli()
