"""``s2hc eval`` and ``s2hc generate``: a checkpoint's perplexity, lm-evaluation-harness tasks and samples.

Exit status: 0 on success, 2 for bad input (a checkpoint path that does not exist or is not an s2hc
checkpoint, an unknown task, a bad option, a missing extra), 3 when a task's data cannot be had (offline).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path

from ..extras import check_available
from ..io import atomic_write_text
from .common import (
    add_renamed_option,
    add_step_option,
    nonnegative_float,
    nonnegative_int,
    output_directory,
    positive_int,
    resolve_step,
)

# torch and the library are imported inside the functions (s2hc.cli's start time).

SUMMARY = {
    "eval": "perplexity and lm-evaluation-harness benchmarks of a checkpoint",
    "generate": "sample continuations of a prompt from a checkpoint",
}


def load_for_eval(*args, **kwargs):
    """:func:`s2hc.evaluate.loading.load_for_eval`, imported on the first call."""
    from ..evaluate.loading import load_for_eval

    return load_for_eval(*args, **kwargs)


def _limit(text: str) -> float | int:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a count >= 1 or a fraction in (0, 1), got {text!r}") from None
    # nan and inf pass every comparison below (or overflow int()): refuse them first
    if not math.isfinite(value) or value <= 0 or (value >= 1 and value != int(value)):
        raise argparse.ArgumentTypeError(f"must be a count >= 1 or a fraction in (0, 1), got {text!r}")
    return int(value) if value >= 1 else value


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    from ..devices import DTYPES

    parser.add_argument(
        "checkpoint", metavar="CHECKPOINT", help="run directory (its latest checkpoint, or --step's) or checkpoint file"
    )
    add_step_option(parser)
    parser.add_argument(
        "--device", default="auto", help="'auto' (CUDA if available, else CPU), 'cpu', 'cuda', 'cuda:N'"
    )
    parser.add_argument("--dtype", default=None, choices=list(DTYPES),
                        help="cast the model (default: as saved, float32)")


# ------------------------------------------------------------------------------------------------------ eval


def register(subparsers) -> None:
    _add_eval_parser(subparsers)
    _add_generate_parser(subparsers)


def _add_eval_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "eval", help=SUMMARY["eval"],
        description="Evaluate a checkpoint: --perplexity on a token source (default: the embedded corpus's "
        "held-out split), and/or --tasks through lm-evaluation-harness (lm-eval tasks, groups and tags; the "
        "offline tasks s2hc_nextline, s2hc_ppl, s2hc_offline shipped with s2hc; 'paper8', the s2HC paper's "
        "eight benchmarks, which need the Hugging Face Hub). Without --tasks, computes the perplexity.",
    )
    _add_model_options(parser)
    parser.add_argument(
        "--perplexity", action="store_true", help="compute the perplexity (the default without --tasks)"
    )
    parser.add_argument("--tasks", default=None, metavar="A,B,...", help="lm-eval tasks, s2hc_offline, paper8, ...")
    parser.add_argument("--batch-size", type=positive_int, default=8, help="sequences per forward pass (default 8)")
    group = parser.add_argument_group("perplexity")
    group.add_argument("--data", default="embedded", help="token source (as `s2hc train --data`; default 'embedded')")
    group.add_argument("--split", default="val", choices=["val", "train"], help="split of the source (default 'val')")
    group.add_argument("--seq-len", type=positive_int, default=None, help="window length (default: the run's seq_len)")
    group.add_argument("--max-batches", type=positive_int, default=None,
                       help="score only this many batches, spread over the split (default: all)")
    group.add_argument("--cache-dir", default=None,
                       help="token shard cache (default: the run's when it is a writable directory here, else the "
                            "default cache)")
    group = parser.add_argument_group("lm-eval tasks")
    group.add_argument("--limit", type=_limit, default=None, help="examples per task (a count, or a fraction < 1)")
    group.add_argument("--num-fewshot", type=nonnegative_int, default=None,
                       help="shots for the tasks outside paper8 (default: the task's)")
    group.add_argument(
        "--bootstrap-iters", type=nonnegative_int, default=1000, help="bootstrap resamples for stderr (default 1000)"
    )
    group.add_argument("--seed", type=int, default=1234, help="seed of few-shot sampling and lm-eval (default 1234)")
    add_renamed_option(parser, "--out", "--output", default=None, metavar="DIR",
                       help="also write DIR/results.json and DIR/results.md (DIR/perplexity.json for --perplexity)")
    parser.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    parser.set_defaults(func=run_eval, subparser=parser)


def _row_label(model) -> str:
    from ..connection import forms

    c = model.config
    return c.family if forms.get(c.family).max_streams == 1 else f"{c.family} (n={c.n_streams})"


def run_eval(args: argparse.Namespace) -> int:
    from ..data.sources import required_packages

    parser = args.subparser
    if args.tasks is not None:  # what the options need is checked before the model is loaded
        check_available(("lm_eval",), "--tasks")
    check_available(required_packages(args.data), f"--data {args.data}")
    try:
        resolve_step(args)  # --step N|best: args.checkpoint is that checkpoint from here on
        model, tokenizer, train_config = load_for_eval(args.checkpoint, device=args.device, dtype=args.dtype)
    except ValueError as error:
        parser.error(str(error))
    # --out is checked before any work (a path under a file, a file, no permission, a read-only disk), and
    # removed again when the evaluation fails before writing into it
    output = contextlib.nullcontext() if args.out is None else output_directory(args.out, "--out")
    try:
        with output as out:
            return _evaluate(args, model, tokenizer, train_config, out)
    except ValueError as error:
        parser.error(str(error))


def _evaluate(args: argparse.Namespace, model, tokenizer, train_config, out: Path | None) -> int:
    from ..data.shards import stored_cache_dir
    from ..evaluate.perplexity import perplexity, run_tokens
    from ..rundir import peek_checkpoint

    parser = args.subparser
    do_perplexity = args.perplexity or args.tasks is None
    if do_perplexity:
        try:
            # the run's cache only where it is usable here: a shared checkpoint names another machine's path
            cache = stored_cache_dir(train_config.cache_dir) if args.cache_dir is None else args.cache_dir
            # the run's own data is split as the run split it; another source is read with the run's text_field
            seq_len = args.seq_len or min(train_config.seq_len, model.config.max_seq_len)
            tokens = run_tokens(args.data, tokenizer, train_config, args.split, cache_dir=cache, seq_len=seq_len,
                                batch_size=args.batch_size, max_batches=args.max_batches, progress=args.progress,
                                processes=peek_checkpoint(args.checkpoint).world_size)
            result = perplexity(
                model, tokens, seq_len,
                batch_size=args.batch_size, max_batches=args.max_batches, progress=args.progress,
                source=args.data, split=args.split,
            )  # fmt: skip
        except ValueError as error:
            parser.error(str(error))
        print(result)
        if out is not None:
            atomic_write_text(out / "perplexity.json", json.dumps(result.to_dict(), indent=2) + "\n")

    if args.tasks is not None:
        from ..evaluate.harness import S2HCLM  # the eval extra, checked before the model was loaded
        from ..evaluate.suites import (
            PAPER8_NAME,
            HubUnavailable,
            format_paper8_table,
            format_results_table,
            parse_tasks,
            run_tasks,
        )

        try:
            names = parse_tasks(args.tasks)
            lm = S2HCLM(model=model, tokenizer=tokenizer, batch_size=args.batch_size, progress=args.progress)
            lm.checkpoint = str(args.checkpoint)
            results = run_tasks(
                lm, names, num_fewshot=args.num_fewshot, limit=args.limit, bootstrap_iters=args.bootstrap_iters,
                seed=args.seed, verbosity="INFO" if args.progress else "WARNING",
            )  # fmt: skip
        except HubUnavailable as error:
            print(f"s2hc eval: error: {error}", file=sys.stderr)
            return 3
        except ValueError as error:
            parser.error(str(error))
        table = format_results_table(results)
        if PAPER8_NAME in names:
            table += "\n" + format_paper8_table({_row_label(model): results}) + "\n"
        print(table)
        if out is not None:
            from lm_eval.utils import handle_non_serializable

            atomic_write_text(out / "results.json",
                              json.dumps(results, indent=2, default=handle_non_serializable) + "\n")
            atomic_write_text(out / "results.md", table)
    return 0


# -------------------------------------------------------------------------------------------------- generate


def _add_generate_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "generate", help=SUMMARY["generate"],
        description="Continue each --prompt with the checkpoint's model (KV-cached decoding); prints the prompt "
        "and its continuation. Temperature 0 decodes greedily.",
    )
    _add_model_options(parser)
    parser.add_argument("--prompt", action="append", required=True, help="text to continue (repeatable)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=100, help="tokens to generate (default 100)")
    parser.add_argument("--temperature", type=nonnegative_float, default=0.8, help="0 for greedy (default 0.8)")
    parser.add_argument(
        "--top-k", type=positive_int, default=50, help="sample among the k likeliest tokens (default 50)"
    )
    parser.add_argument("--num-samples", type=positive_int, default=1, help="continuations per prompt (default 1)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--no-cache", dest="use_cache", action="store_false",
                        help="recompute every position at every step (slower; the same tokens)")
    parser.set_defaults(func=run_generate, subparser=parser)


def run_generate(args: argparse.Namespace) -> int:
    import torch

    from ..evaluate.generation import generate_tokens

    parser = args.subparser
    try:
        resolve_step(args)
        model, tokenizer, _ = load_for_eval(args.checkpoint, device=args.device, dtype=args.dtype)
        generator = torch.Generator(device=next(model.parameters()).device).manual_seed(args.seed)
        prompts = [p for p in args.prompt for _ in range(args.num_samples)]
        encoded = [tokenizer.encode(p) or [tokenizer.eot_id] for p in prompts]
        outputs = generate_tokens(
            model, encoded, args.max_new_tokens, eot_id=tokenizer.eot_id, temperature=args.temperature,
            top_k=args.top_k, generator=generator, use_cache=args.use_cache,
        )  # fmt: skip
    except ValueError as error:
        parser.error(str(error))
    for k, (prompt, tokens) in enumerate(zip(prompts, outputs)):
        if len(prompts) > 1:
            print(f"--- sample {k + 1} ---")
        text = tokenizer.decode([t for t in tokens if t != tokenizer.eot_id])
        print(prompt + text)
    return 0
