"""Evaluation: perplexity, the lm-eval adapter, the shipped offline tasks, the paper8 suite, KV-cached generation,
and the bad-input messages of `s2hc eval` / `s2hc generate`. Everything runs offline on a tiny checkpoint."""

from __future__ import annotations

import gzip
import importlib.metadata as md
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from s2hc.cli import main
from s2hc.data import get_tokenizer
from s2hc.evaluate import checkpoint_perplexity, generate_tokens, perplexity, tasks_dir
from s2hc.evaluate.offline import DATA_FILES, build, read_jsonl_gz
from s2hc.models.transformer import KVCache
from s2hc.rundir import load_model

lm_eval = pytest.importorskip("lm_eval")

from helpers import OFFLINE_ENV, random_model  # noqa: E402

from s2hc.evaluate.harness import S2HCLM  # noqa: E402
from s2hc.evaluate.suites import PAPER8, format_paper8_table, run_tasks  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint) -> Path:
    """The shared 3-step s2hc (n = 4) checkpoint (tests/conftest.py)."""
    return tiny_checkpoint


@pytest.fixture(scope="module")
def lm(tiny) -> S2HCLM:
    return S2HCLM(checkpoint=str(tiny), batch_size=8, progress=False)




def request(kind: str, *args):
    from lm_eval.api.instance import Instance

    return Instance(kind, {}, tuple(args), 0)


# ---- the lm-eval adapter --------------------------------------------------------------------------------


PAIRS = [
    ("ROMEO.\nBut soft, what light through yonder window", " breaks?"),
    ("", "In the beginning God created the heaven and the earth."),
    ("And the earth was without form,", " and void; and darkness was upon the face of the deep."),
    ("To be, or not to be: ", "that is the question"),
    ("Of Man's first disobedience, and the fruit\n", "Of that forbidden tree"),
]


def direct_loglikelihood(model, tokenizer, context: str, continuation: str, max_length: int) -> tuple[float, bool]:
    """log p(continuation | context) from one unpadded forward pass, tokenised as lm-eval does."""
    if context:
        stripped = context.rstrip()  # lm-eval moves the context's trailing whitespace into the continuation
        continuation, context = context[len(stripped):] + continuation, stripped
        whole = tokenizer.encode(context + continuation)
        n_context = len(tokenizer.encode(context))
    else:
        whole = [tokenizer.eot_id] + tokenizer.encode(continuation)
        n_context = 1
    target = whole[n_context:]
    sequence = whole[-(max_length + 1):]
    with torch.no_grad():
        logprobs = F.log_softmax(model(torch.tensor([sequence[:-1]])).float(), dim=-1)[0]
    rows = logprobs[len(sequence) - 1 - len(target):]
    picked = rows.gather(-1, torch.tensor(target)[:, None])
    return float(picked.sum()), bool((rows.argmax(-1) == torch.tensor(target)).all())


@pytest.mark.parametrize("max_length", [None, 15])  # 15: long contexts are cut from the left
def test_adapter_loglikelihoods_equal_a_direct_computation(tiny, max_length):
    model, config = load_model(tiny)
    model.eval()
    tokenizer = get_tokenizer(config.tokenizer)
    lm = S2HCLM(checkpoint=str(tiny), batch_size=2, max_length=max_length, progress=False)
    got = lm.loglikelihood([request("loglikelihood", c, x) for c, x in PAIRS])
    for (context, continuation), (score, greedy) in zip(PAIRS, got):
        expected, expected_greedy = direct_loglikelihood(model, tokenizer, context, continuation, lm.max_length)
        assert score == pytest.approx(expected, abs=1e-4) and greedy == expected_greedy


def test_a_continuation_longer_than_the_context_is_scored_in_pieces(tiny):
    model, config = load_model(tiny)
    model.eval()
    tokenizer = get_tokenizer(config.tokenizer)
    context, continuation = "And God said,", " Let there be light: and there was light. And God saw the light"
    sequence = tokenizer.encode(context + continuation)
    begin = len(tokenizer.encode(context))
    L = 8
    assert len(sequence) - begin > L
    expected, end = 0.0, len(sequence)
    while end > begin:  # the last L targets with the L tokens before them, then the rest, and so on
        start = max(begin, end - L)
        window = sequence[max(0, end - 1 - L) : end]
        with torch.no_grad():
            logprobs = F.log_softmax(model(torch.tensor([window[:-1]])).float(), dim=-1)[0]
        expected += float(logprobs[-(end - start):].gather(-1, torch.tensor(sequence[start:end])[:, None]).sum())
        end = start
    lm = S2HCLM(checkpoint=str(tiny), batch_size=2, max_length=L, progress=False)
    ((score, _),) = lm.loglikelihood([request("loglikelihood", context, continuation)])
    assert score == pytest.approx(expected, abs=1e-4)


def test_rolling_loglikelihood_covers_every_token_once(tiny):
    model, config = load_model(tiny)
    model.eval()
    tokenizer = get_tokenizer(config.tokenizer)
    text = "Friends, Romans, countrymen, lend me your ears; I come to bury Caesar, not to praise him."
    tokens = tokenizer.encode(text)
    for L in (64, 7):  # one window; several overlapping ones
        lm = S2HCLM(checkpoint=str(tiny), batch_size=4, max_length=L, progress=False)
        (score,) = lm.loglikelihood_rolling([request("loglikelihood_rolling", text)])
        sequence = [tokenizer.eot_id] + tokens
        expected = 0.0
        for start in range(0, len(tokens), L):  # predict tokens[start:start+L] with as much context as fits
            stop = min(start + L, len(tokens))
            window = sequence[: stop + 1][-(L + 1):]
            with torch.no_grad():
                logprobs = F.log_softmax(model(torch.tensor([window[:-1]])).float(), dim=-1)[0]
            n = stop - start
            expected += float(logprobs[-n:].gather(-1, torch.tensor(window[-n:])[:, None]).sum())
        assert score == pytest.approx(expected, abs=1e-3)


def test_generate_until_is_greedy_decoding_cut_at_the_stop_sequence():
    model = random_model(vocab_size=4096)
    tokenizer = get_tokenizer()
    lm = S2HCLM(model=model, tokenizer=tokenizer, batch_size=2, progress=False)
    prompts = ["ROMEO.", "And God said, Let there", "Of Man's"]
    free = lm.generate_until([request("generate_until", p, {"until": [], "max_gen_toks": 12}) for p in prompts])
    for prompt, text in zip(prompts, free):
        tokens = generate_tokens(model, [tokenizer.encode(prompt)], 12, eot_id=tokenizer.eot_id)[0]
        assert text == tokenizer.decode(tokens).split(tokenizer.decode([tokenizer.eot_id]))[0]
    stop = free[0][3:6]  # a stop sequence that occurs in the free continuation
    (cut,) = lm.generate_until([request("generate_until", prompts[0], {"until": [stop], "max_gen_toks": 12})])
    assert cut == free[0].split(stop)[0] and stop not in cut


def test_model_args_are_checked(tiny):
    with pytest.raises(ValueError, match="unknown model_args \\['temperature'\\]"):
        S2HCLM(checkpoint=str(tiny), temperature=1.0)
    with pytest.raises(ValueError, match="needs --model_args checkpoint=PATH"):
        S2HCLM()
    with pytest.raises(ValueError, match="does not exist"):
        S2HCLM(checkpoint=str(tiny) + "-missing")


def test_lm_eval_registry_knows_s2hc_and_keeps_its_own_models():
    from lm_eval.api.registry import get_model

    assert get_model("s2hc") is S2HCLM
    assert get_model("dummy").__name__ == "DummyLM"  # lm-eval's own models are still registered


def test_entry_point_value_loads_the_adapter():
    """The line for pyproject.toml's [project.entry-points."lm_eval.models"] resolves to the adapter, also
    through lm-eval's lazy placeholders (which accept entry points)."""
    from lm_eval.api.registry import Registry

    point = md.EntryPoint(name="s2hc", value="s2hc.evaluate.harness:S2HCLM", group="lm_eval.models")
    assert point.load() is S2HCLM
    registry = Registry("model")
    registry.register("s2hc", target=point)
    assert registry.get("s2hc") is S2HCLM
    declared = [e for e in md.entry_points(group="lm_eval.models") if e.name == "s2hc"]
    assert all(e.load() is S2HCLM for e in declared)  # once pyproject declares it


# ---- the shipped offline tasks --------------------------------------------------------------------------


def test_shipped_task_data_is_rebuilt_identically_from_the_corpus(tmp_path):
    fresh = build(tmp_path)
    for task, path in fresh.items():
        assert read_jsonl_gz(path) == read_jsonl_gz(tasks_dir() / DATA_FILES[task]), task


def test_nextline_examples_are_well_formed():
    rows = read_jsonl_gz(tasks_dir() / DATA_FILES["s2hc_nextline"])
    assert len(rows) == 1000
    assert {row["source"].split("/")[0] for row in rows} == {"shakespeare", "milton", "kjv"}
    for row in rows:
        assert len(row["choices"]) == 4 and len({c.lower() for c in row["choices"]}) == 4
        assert 0 <= row["label"] < 4 and row["context"] and row["context"][-1].isspace()
    counts = [sum(row["label"] == k for row in rows) for k in range(4)]
    assert min(counts) > 200  # the true line is not always in the same place
    passages = read_jsonl_gz(tasks_dir() / DATA_FILES["s2hc_ppl"])
    assert len(passages) == 128 and all(0 < len(p["text"]) <= 2000 for p in passages)
    with gzip.open(tasks_dir() / DATA_FILES["s2hc_ppl"], "rt") as handle:
        assert handle.read().count("\n") == 128


def test_a_hub_task_without_a_network_fails_in_one_line_without_retries(lm, monkeypatch, capfd):
    """lm-eval's task data from the Hub while the Hub cannot be reached: the one-sentence HubUnavailable, and none of
    the client's five ``Retrying in`` lines (s2hc.hub puts the libraries offline for the call)."""
    from s2hc import hub
    from s2hc.evaluate.suites import HubUnavailable

    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=hub.PROBE_TIMEOUT_S: False)
    for name in hub.OFFLINE_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(HubUnavailable, match="could not get its data from the Hugging Face Hub"):
        run_tasks(lm, "hellaswag", limit=2)
    assert "Retrying in" not in capfd.readouterr().err


def test_simple_evaluate_runs_the_shipped_tasks_end_to_end(tiny, lm, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)  # outside a git repository: lm-eval's `git describe` says "fatal: ..." on stderr
    results = run_tasks(lm, "s2hc_offline", limit=8)
    assert "fatal: not a git repository" not in capfd.readouterr().err
    nextline, ppl = results["results"]["s2hc_nextline"], results["results"]["s2hc_ppl"]
    assert 0.0 <= nextline["acc,none"] <= 1.0 and 0.0 <= nextline["acc_norm,none"] <= 1.0
    assert results["n-samples"]["s2hc_nextline"]["effective"] == 8
    # an untrained model: about log2(4096) = 12 bits per token, spread over ~3-4 bytes per token
    assert 2.0 < ppl["bits_per_byte,none"] < 6.0 and math.isfinite(ppl["word_perplexity,none"])

    # the registered name through lm-eval's own entry point, from model_args as its CLI passes them
    from lm_eval.tasks import TaskManager

    direct = lm_eval.simple_evaluate(
        model="s2hc", model_args=f"checkpoint={tiny},progress=False", tasks=["s2hc_nextline"], limit=8,
        task_manager=TaskManager(include_path=str(tasks_dir()), include_defaults=False), batch_size=5,
        bootstrap_iters=0, verbosity="WARNING",
    )  # fmt: skip
    assert direct["results"]["s2hc_nextline"]["acc,none"] == nextline["acc,none"]


# ---- perplexity -----------------------------------------------------------------------------------------


def test_perplexity_is_the_token_weighted_cross_entropy(tiny):
    model, config = load_model(tiny)
    model.eval()
    result = checkpoint_perplexity(tiny, data=config.data, seq_len=16, batch_size=5, progress=False)
    from s2hc.data import prepare_tokens

    tokens = prepare_tokens(config.data, get_tokenizer(config.tokenizer), config.cache_dir, "val", progress=False)
    n = (len(tokens) - 1) // 16
    ids = torch.from_numpy(tokens[: n * 16 + 1].astype("int64"))
    x, y = ids[:-1].view(n, 16), ids[1:].view(n, 16)
    with torch.no_grad():
        expected = F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    assert result.tokens == n * 16 and result.windows == n
    assert result.loss == pytest.approx(expected, rel=1e-5) and result.perplexity == pytest.approx(math.exp(expected))
    capped = perplexity(model, tokens, 16, batch_size=2, max_batches=3, progress=False)
    assert capped.windows == 6


def test_cli_eval_perplexity_and_tasks_write_their_outputs(tiny, tmp_path, capsys):
    out = tmp_path / "eval"
    code = main(["eval", str(tiny), "--perplexity", "--max-batches", "4", "--tasks", "s2hc_nextline", "--limit", "4",
                 "--no-progress", "--out", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    assert code == 0
    saved = json.loads((out / "perplexity.json").read_text())
    assert printed.startswith(f"perplexity {saved['perplexity']:.3f}") and saved["source"] == "embedded"
    assert "s2hc_nextline" in printed and "acc_norm" in printed
    assert json.loads((out / "results.json").read_text())["results"]["s2hc_nextline"]["alias"] == "s2hc_nextline"
    assert "s2hc_nextline" in (out / "results.md").read_text()


# ---- the paper's suite ----------------------------------------------------------------------------------


def test_paper8_fails_offline_with_one_sentence(tiny, tmp_path):
    env = {**os.environ, **OFFLINE_ENV, "HF_HUB_CACHE": str(tmp_path / "empty-cache")}
    done = subprocess.run([sys.executable, "-m", "s2hc", "eval", str(tiny), "--tasks", "paper8"], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 3, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr
    message = lines[0]
    assert message.startswith("s2hc eval: error: the paper8 suite downloads its datasets")
    assert "HF_HUB_OFFLINE=1" in message and "s2hc_nextline" in message and message.count(". ") == 0


def test_paper8_table_layout_from_fabricated_results():
    # FABRICATED numbers, for the layout only: not the result of any run.
    fabricated = {
        "results": {
            "piqa": {"acc,none": 0.60, "acc_norm,none": 0.6123},
            "boolq": {"acc,none": 0.55},
            "mmlu": {"acc,none": 0.2512},
            "truthfulqa_mc2": {"acc,none": 0.4},
            "winogrande": {"acc,none": 0.5},
            "hellaswag": {"acc,none": 0.3, "acc_norm,none": 0.32},
            "arc_easy": {"acc,none": 0.45, "acc_norm,none": 0.42},
            "arc_challenge": {"acc,none": 0.2, "acc_norm,none": 0.24},
        }
    }
    partial = {"results": {"piqa": {"acc_norm,none": 0.5}}}
    table = format_paper8_table({"s2hc (n=4) [fabricated]": fabricated, "residual [fabricated]": partial})
    caption, _, body = table.partition("\n\n")
    lines = body.splitlines()
    assert lines[0] == "| Model | PIQA | BoolQ | MMLU | TruthfulQA | WinoGrande | HellaSwag | ARC-E | ARC-C | Avg. |"
    assert lines[1] == "|---|" + "---:|" * 9
    average = (61.23 + 55 + 25.12 + 40 + 50 + 32 + 42 + 24) / 8
    assert lines[2] == (
        f"| s2hc (n=4) [fabricated] | 61.23 | 55.00 | 25.12 | 40.00 | 50.00 | 32.00 | 42.00 | 24.00 | {average:.2f} |"
    )
    assert lines[3] == "| residual [fabricated] | 50.00 | – | – | – | – | – | – | – | – |"
    assert "PIQA, BoolQ, MMLU, TruthfulQA 0-shot; WinoGrande 5-shot; HellaSwag 10-shot; ARC-E, ARC-C 25-shot" in caption
    assert "acc_norm) for PIQA, HellaSwag, ARC-E, ARC-C" in caption
    plain = format_paper8_table({"x": fabricated}, metrics={"PIQA": "acc"})
    assert "| x | 60.00 |" in plain


def test_paper8_names_lm_eval_tasks_and_their_hub_datasets():
    root = Path(lm_eval.__file__).parent / "tasks"
    assert [(b.task, b.shots) for b in PAPER8] == [
        ("piqa", 0), ("boolq", 0), ("mmlu", 0), ("truthfulqa_mc2", 0), ("winogrande", 5), ("hellaswag", 10),
        ("arc_easy", 25), ("arc_challenge", 25),
    ]  # fmt: skip
    folders = {"boolq": "super_glue/boolq", "mmlu": "mmlu/default", "truthfulqa_mc2": "truthfulqa",
               "arc_easy": "arc", "arc_challenge": "arc"}  # fmt: skip
    for bench in PAPER8:
        folder = root / folders.get(bench.task, bench.task)
        texts = [p.read_text() for p in folder.iterdir() if p.is_file() and "yaml" in p.name]
        assert any(f"dataset_path: {bench.dataset}" in t for t in texts), bench
        assert bench.task == "mmlu" or any(f"task: {bench.task}\n" in t for t in texts), bench


# ---- bad input ------------------------------------------------------------------------------------------


def error_line(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("command", [["eval"], ["eval", "--tasks", "s2hc_nextline"], ["generate", "--prompt", "x"],
                                     ["export", "--out", "OUT"]])  # fmt: skip
def test_missing_and_foreign_checkpoints_are_one_sentence(command, tmp_path, capsys):
    name, rest = command[0], command[1:]
    rest = [str(tmp_path / "out") if a == "OUT" else a for a in rest]
    assert main([name, str(tmp_path / "nope"), *rest]) == 2
    assert error_line(capsys) == f"s2hc {name}: error: checkpoint '{tmp_path / 'nope'}' does not exist"
    junk = tmp_path / "junk.pt"
    junk.write_bytes(os.urandom(64))
    assert main([name, str(junk), *rest]) == 2
    assert error_line(capsys).startswith(f"s2hc {name}: error: '{junk}' is not an s2hc checkpoint")
    torch.save({"state_dict": {}}, tmp_path / "other.pt")
    assert main([name, str(tmp_path / "other.pt"), *rest]) == 2
    other = tmp_path / "other.pt"
    assert error_line(capsys) == f"s2hc {name}: error: '{other}' is not an s2hc checkpoint (no 's2hc-checkpoint' tag)"


@pytest.mark.slow
def test_unknown_task_name_is_one_sentence(tiny, capsys):
    assert main(["eval", str(tiny), "--tasks", "s2hc_nextline,no_such_task", "--no-progress"]) == 2
    assert error_line(capsys) == (
        "s2hc eval: error: unknown task 'no_such_task': not an lm-eval task, group or tag, nor one of s2hc's "
        "(s2hc_nextline, s2hc_ppl, s2hc_offline, paper8)"
    )


def test_bad_generation_options(tiny, capsys):
    assert main(["generate", str(tiny), "--prompt", "x", "--max-new-tokens", "256"]) == 2
    assert "leaves no room for a prompt" in error_line(capsys)
    assert main(["generate", str(tiny), "--prompt", "x", "--temperature", "-1"]) == 2
    assert "must be a finite number >= 0" in error_line(capsys)


# ---- lm-eval's command line -----------------------------------------------------------------------------


@pytest.mark.slow
def test_lm_eval_command_line_runs_the_s2hc_model(tiny, tmp_path):
    """`python -m s2hc.evaluate` is lm-eval's CLI with `--model s2hc` and the shipped tasks registered."""
    env = {**os.environ, **OFFLINE_ENV}
    args = ["--model", "s2hc", "--model_args", f"checkpoint={tiny}", "--batch_size", "4", "--device", "cpu",
            "--tasks", "s2hc_nextline", "--limit", "4"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "s2hc.evaluate", *args], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "|s2hc_nextline|" in done.stdout and "acc_norm" in done.stdout
    # plain `lm_eval --model s2hc` needs an lm-eval that reads the lm_eval.models entry point group
    import lm_eval.api.registry as registry

    declared = any(e.name == "s2hc" for e in md.entry_points(group="lm_eval.models"))
    if declared and "entry_points" in Path(registry.__file__).read_text():
        plain = subprocess.run([sys.executable, "-m", "lm_eval", *args, "--include_path", str(tasks_dir())],
                               env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)  # fmt: skip
        assert plain.returncode == 0, plain.stderr[-3000:]


# ---- KV-cached generation ------------------------------------------------------------------------------

FAMILIES = {
    "s2hc-4": dict(family="s2hc", n_streams=4),
    "residual": dict(family="residual", n_streams=1),
    "gemma3-window": dict(family="mhc", n_streams=2, preset="gemma3-1b", n_heads=2, n_kv_heads=1, head_dim=16,
                          sliding_window=5, sliding_window_pattern=2, query_pre_attn_scalar=16.0),
    "gpt2-learned": dict(family="mhc-lite", n_streams=3, preset="gpt2-small"),
}  # fmt: skip


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_cache_gives_the_logits_of_the_full_forward(family):
    model = random_model(**FAMILIES[family])
    ids = torch.randint(0, 1024, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache()
        steps = [model(ids[:, :9], cache=cache)] + [model(ids[:, t : t + 1], cache=cache) for t in range(9, 20)]
        steps.append(model(ids[:, 20:], cache=cache))
    assert cache.get_seq_length() == 24
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # a left-padded row gets the logits of the unpadded sequence
        mask = torch.ones(2, 24, dtype=torch.long)
        mask[1, :5] = 0
        padded = model(ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0))
        alone = model(ids[1:, 5:])
    torch.testing.assert_close(padded[1, 5:], alone[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(padded[0], full[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", ["s2hc-4", "residual"])
def test_cached_and_uncached_greedy_generation_give_the_same_tokens(family):
    model = random_model(**FAMILIES[family])
    prompts = [[5, 17, 300, 42, 7, 9], [1000, 200], [64, 65, 66, 67]]
    cached = generate_tokens(model, prompts, 16, use_cache=True)
    uncached = generate_tokens(model, prompts, 16, use_cache=False)
    alone = [generate_tokens(model, [p], 16, use_cache=False)[0] for p in prompts]
    assert cached == uncached == alone
    assert all(len(t) == 16 for t in cached) and len({tuple(t) for t in cached}) == 3
    assert len(set(cached[0])) > 1  # not one token repeated


def test_a_truncating_cache_is_refused():
    class Window(KVCache):
        def update(self, key, value, layer_idx, cache_kwargs=None):
            key, value = super().update(key, value, layer_idx)
            return key[..., -4:, :], value[..., -4:, :]

    model = random_model()
    cache = Window()
    model(torch.ones(1, 4, dtype=torch.long), cache=cache)  # 4 keys: all of them
    with pytest.raises(ValueError, match="cache that keeps every position"):
        model(torch.ones(1, 1, dtype=torch.long), cache=cache)


def test_sampling_is_seeded():
    model = random_model()
    draw = lambda seed: generate_tokens(  # noqa: E731
        model, [[1, 2, 3]], 10, temperature=1.0, top_k=20, generator=torch.Generator().manual_seed(seed)
    )
    assert draw(0) == draw(0) and draw(0) != draw(1)
