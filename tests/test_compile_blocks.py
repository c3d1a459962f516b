"""Per-block compile (``s2hc train --compile``, ``s2hc bench --compile``: :mod:`s2hc.train.compiling`): every block
of a deep AttnRes model runs compiled, one graph per distinct block structure and no eager fallback; a fallback
that does happen is said by s2hc in one line, by the training loop too. Compiled with a counting backend that runs
the traced graph as it is (no inductor), so only dynamo's tracing is timed."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import SMALL_MODEL, small_config

from s2hc.models import Transformer, get_preset
from s2hc.train import compiling

DEPTH_CASES = [(16, "block"), (16, "full"), (32, "block"), (32, "full")]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """dynamo's caches are per code object and process-wide: every block of every model shares Block.forward's, so
    each test starts (and leaves) it empty."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class CountingBackend:
    """A ``torch.compile`` backend that counts the graphs dynamo hands it and runs each as traced."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1
        return graph_module.forward


def attn_res_model(n_layers: int, variant: str) -> Transformer:
    torch.manual_seed(0)
    return Transformer(get_preset("tiny", n_layers=n_layers, dim=32, n_heads=2, n_kv_heads=2, ffn_dim=64,
                                  vocab_size=64, family="attn-res", family_options={"variant": variant}))


def training_step(model: Transformer) -> None:
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    model(ids).float().logsumexp(-1).mean().backward()


def distinct_structures(n_layers: int, block_size: int) -> int:
    """What tells one AttnRes block's graph from another's, written out independently: the sources it is handed
    (the embedding and one per AttnRes block begun before its attention sublayer) and which of its two sublayers
    begins an AttnRes block."""
    return len({(1 + math.ceil(2 * layer / block_size), 2 * layer % block_size == 0,
                 (2 * layer + 1) % block_size == 0) for layer in range(n_layers)})


@pytest.mark.slow
@pytest.mark.parametrize(("n_layers", "variant"), DEPTH_CASES)
def test_every_attn_res_block_runs_compiled(n_layers, variant):
    model = attn_res_model(n_layers, variant)
    backend, watch = CountingBackend(), compiling.CompileWatch(model.blocks)
    compiling.compile_blocks(model.blocks, backend=backend)
    training_step(model)
    block_size = model.blocks[0].attn_hc.block_size
    assert block_size == (1 if variant == "full" else 2 * n_layers // 8)
    assert backend.graphs == distinct_structures(n_layers, block_size)
    assert backend.graphs == (n_layers if variant == "full" else 16)  # Block AttnRes: bounded by its 8 blocks
    assert all(block.ran_compiled for block in model.blocks)
    assert watch.eager_blocks() == 0 and watch.line("training") is None
    training_step(model)  # a second step reuses the graphs
    assert backend.graphs == distinct_structures(n_layers, block_size) and watch.line() is None


def test_blocks_past_the_recompile_limit_are_said_in_one_line(monkeypatch):
    """dynamo's own limit (8 graphs for Block.forward, all blocks together) as before compile_blocks raised it:
    blocks 9 on of a 12-layer Full AttnRes model run eagerly, and the watch says how many and why."""
    monkeypatch.setattr(compiling, "recompile_limit", lambda n_blocks: 8)
    model = attn_res_model(12, "full")
    backend, watch = CountingBackend(), compiling.CompileWatch(model.blocks)
    compiling.compile_blocks(model.blocks, backend=backend)
    training_step(model)
    assert backend.graphs == 8
    assert [block.ran_compiled for block in model.blocks] == [True] * 8 + [False] * 4
    line = watch.line("training")
    assert line.startswith("torch.compile ran 4 of 12 blocks eagerly in training (dynamo's recompile limit reached")
    assert "\n" not in line


def test_the_training_loop_says_when_blocks_run_eagerly(corpus_file, tmp_path, monkeypatch, capsys):
    eager_backend(monkeypatch)
    monkeypatch.setattr(compiling, "recompile_limit", lambda n_blocks: 2)
    from s2hc.train import train

    train(small_config(corpus_file, tmp_path, family="attn-res", n_streams=1, family_options={"variant": "full"},
                       model_overrides={**SMALL_MODEL, "n_layers": 4}, compile=True, max_steps=3, eval_every=0))
    lines = [line for line in capsys.readouterr().err.splitlines() if "eagerly" in line]
    said = "s2hc: warning: torch.compile ran 2 of 4 blocks eagerly in training (dynamo's recompile limit reached"
    assert sum(line.startswith(said) for line in lines) == 1, lines  # once, though every step runs them so
    assert all(line.startswith("s2hc: warning: torch.compile ran ") for line in lines), lines


def eager_backend(monkeypatch) -> None:
    """Every ``nn.Module.compile`` with dynamo's ``eager`` backend: its tracing without inductor, seconds on a CPU."""
    compile_block = torch.nn.Module.compile
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **options: compile_block(
        self, **{**options, "backend": "eager"}))


def test_bench_compiles_each_block_as_training_does(monkeypatch):
    from s2hc.bench import BenchSettings, measure

    eager_backend(monkeypatch)
    variant = measure.Variant("attn-res", 1, {"variant": "full"})
    runner = measure.make_runner("tiny", variant, batch_size=1, seq_len=8, compile=True,
                                 overrides={**SMALL_MODEL, "n_layers": 4})
    assert runner.forward is runner.model  # the model itself, its blocks compiled in place
    assert all(block._compiled_call_impl is not None for block in runner.model.blocks)
    runner.step()
    assert all(block.ran_compiled for block in runner.model.blocks) and runner.watch.line() is None

    torch._dynamo.reset()
    monkeypatch.setattr(compiling, "recompile_limit", lambda n_blocks: 2)
    logged = []
    settings = BenchSettings(preset="tiny", overrides={**SMALL_MODEL, "n_layers": 4}, batch_size=1, seq_len=8,
                             compile=True, repeats=1, steps=1, warmup=0, memory=False)
    measure.benchmark_steps(settings, [variant], log=logged.append)
    warned = [line for line in logged if line.startswith("warning: ")]
    # residual's blocks take one graph, AttnRes's first block the second: its three others run eagerly
    assert warned == ["warning: attn-res:variant=full: torch.compile ran 3 of 4 blocks eagerly in its warm-up "
                      "steps (dynamo's recompile limit reached (2 graphs))"], logged
