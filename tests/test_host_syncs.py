"""No host sync in a training step, proved on the CPU: a dispatch mode records every op that makes the
host wait for the device on CUDA, and the training loop's steps record none but at a read (a logging step).

:class:`HostSyncs` sees the ATen ops a step dispatches (``TorchDispatchMode``): ``aten._local_scalar_dense``
(what ``.item()``, ``float(t)``, ``bool(t)`` call), the ops whose output size depends on the values
(``nonzero``, ``masked_select``, ``unique``, boolean-mask indexing ...), ``aten._linalg_check_errors`` (what
``torch.linalg.solve``, ``inv``, ``cholesky`` ... call to read the LAPACK status on the host), copies to the CPU
from another device (visible on a GPU only), and the device-to-host reads torch makes outside the dispatcher
(``Tensor.tolist``, ``Tensor.numpy``), which it patches. On the CPU every tensor is a host tensor, so the one
exemption is the optimizer's own step counters, which torch's AdamW keeps on the host on every device
(``state["step"]``, read with ``.item()``; tests/test_cuda_syncs.py checks they stay there after a resume).

Syncs inside a CUDA kernel's own code (a blocking copy from host memory, a sort that reads its size) are not
visible here: ``tests/test_cuda_syncs.py`` runs the steps under ``torch.cuda.set_sync_debug_mode("error")`` on a GPU.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from helpers import Branch, poison_loss_at, small_config
from torch.utils._python_dispatch import TorchDispatchMode

import s2hc
from s2hc import mixers
from s2hc.connection import build_connection, forms
from s2hc.models import Transformer, get_preset
from s2hc.rundir import load_checkpoint, read_metrics
from s2hc.train import TrainingError, loop, make_optimizer, train

# ATen ops (overload packets) that read a device tensor's values on the host, or size their output by them.
SYNC_OPS = frozenset({
    "_local_scalar_dense", "item", "is_nonzero", "equal", "allclose", "nonzero", "nonzero_numpy", "argwhere",
    "masked_select", "_unique", "_unique2", "unique_dim", "unique_consecutive", "unique_dim_consecutive",
    "_linalg_check_errors", "bincount", "histc", "repeat_interleave", "masked_scatter", "masked_scatter_",
})
INDEX_OPS = frozenset({"index", "index_put", "index_put_", "_index_put_impl", "_index_put_impl_"})


def _tensors(values):
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors(value)


class HostSyncs(TorchDispatchMode):
    """Records (in ``calls``, by name) every op dispatched inside it that would make the host wait for a GPU.

    ``host_scalars``: a callable giving the tensors kept on the host by design, whose ``.item()`` is no sync
    (the optimizer's step counters). While active, ``Tensor.tolist`` and ``Tensor.numpy`` are recorded too."""

    def __init__(self, host_scalars=lambda: ()):
        super().__init__()
        self.host_scalars = host_scalars
        self.calls: list[str] = []

    def _reason(self, func, args, kwargs) -> str | None:
        name = func.overloadpacket.__name__
        if name in SYNC_OPS:
            if name == "repeat_interleave" and kwargs.get("output_size") is not None:
                return None  # the size given: nothing to read
            if name == "_local_scalar_dense" and any(args[0] is t for t in self.host_scalars()):
                return None
            return name
        if name in INDEX_OPS:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(t.dtype in (torch.bool, torch.uint8) for t in _tensors(indices or ())):
                return f"{name} with a boolean mask"
        if name in ("_to_copy", "copy_", "_copy_from", "_copy_from_and_resize"):
            tensors = list(_tensors(args))
            target = kwargs.get("device")
            if name == "_to_copy" and target is not None and torch.device(target).type == "cpu":
                if tensors[0].device.type != "cpu":
                    return "copy to the host"
            elif name != "_to_copy" and len(tensors) >= 2 and tensors[0].device.type == "cpu" != tensors[1].device.type:
                return "copy to the host"
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = self._reason(func, args, kwargs)
        if reason is not None:
            self.calls.append(reason)
        return func(*args, **kwargs)

    def __enter__(self):
        self._patched = contextlib.ExitStack()
        for method in ("tolist", "numpy"):
            real = getattr(torch.Tensor, method)

            def recorded(tensor, *args, _real=real, _method=method, **kwargs):
                self.calls.append(_method)
                return _real(tensor, *args, **kwargs)

            own = method in vars(torch.Tensor)  # else inherited from torch._C.TensorBase: removed again after
            setattr(torch.Tensor, method, recorded)
            if own:
                self._patched.callback(setattr, torch.Tensor, method, real)
            else:
                self._patched.callback(delattr, torch.Tensor, method)
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._patched.close()


def step_counters(optimizer):
    return lambda: [s["step"] for s in optimizer.state.values() if isinstance(s.get("step"), torch.Tensor)]


# ---------------------------------------------------------------------------------- the mode itself


@pytest.mark.parametrize("sync,expected", [
    (lambda t: t.sum().item(), "_local_scalar_dense"),
    (lambda t: float(t.max()), "_local_scalar_dense"),
    (lambda t: bool(torch.isfinite(t).all()), "_local_scalar_dense"),
    (lambda t: t.sum().tolist(), "tolist"),
    (lambda t: t[t > 0], "index with a boolean mask"),
    (lambda t: torch.nonzero(t), "nonzero"),
    (lambda t: torch.linalg.solve(torch.eye(3) + t[:3, :3] * 0, t[:3, :1]), "_linalg_check_errors"),
    (lambda t: t.unique(), "_unique2"),
])
def test_the_mode_records_each_kind_of_sync(sync, expected):
    """Each way of reading a tensor on the host is recorded (so a sync put back in a step fails the tests below)."""
    t = torch.randn(4, 4)
    with HostSyncs() as mode:
        sync(t)
    assert expected in mode.calls, mode.calls


def test_the_mode_records_nothing_for_device_side_work_and_exempts_host_scalars():
    t, counter = torch.randn(4, 4), torch.tensor(3.0)
    with HostSyncs(host_scalars=lambda: [counter]) as mode:
        torch.linalg.solve_ex(torch.eye(4) + t - t.T, t, check_errors=False)
        torch.where(t > 0, t, 0.0).square().sum()
        t[..., torch.tensor([0, 2])] = 1.0
        counter.item()
    assert mode.calls == []
    with HostSyncs() as mode:
        counter.item()
    assert mode.calls == ["_local_scalar_dense"]


# ------------------------------------------------------------------------ each family, forward and backward


def connection_cases():
    cases = []
    for family in s2hc.families():
        if not forms.get(family).mixes_streams:
            continue  # one stream (the residual) or depth sources (AttnRes): the model of the next test has it
        for n in (4, 8):
            n = min(n, mixers.MAX_PERMUTATION_STREAMS) if family == "mhc-lite" else n
            cases.append((family, n))
    return sorted(set(cases), key=cases.index)


@pytest.mark.parametrize("options", [{}, {"fused": False}, {"recompute": True}],
                         ids=["eager", "reference", "recompute"])
@pytest.mark.parametrize("family,n", connection_cases())
def test_a_connection_forward_and_backward_make_no_host_sync(family, n, options):
    """Every family's connection (s2hc, orthogonal and isometric at n = 8 use the batched solve, m = 7),
    forward and backward on its compute paths (the eager fast path, the reference, recomputed), with its
    parameters moved off their start so every term is live: no sync."""
    if not forms.get(family).compute_options and options:
        pytest.skip(f"{family} has one compute path")
    torch.manual_seed(0)
    hc = build_connection(16, n, family=family, layer_index=1)
    if options:
        hc.set_options(**options)
    with torch.no_grad():
        for p in hc.parameters():
            p.add_(0.3 * torch.randn_like(p))
    branch = Branch(16)
    x = torch.randn(2, 5, n, 16, requires_grad=True)
    state = forms.get(family).expand(torch.zeros(2, 5, 16), n)  # a state that carries more than the streams:
    state = x if isinstance(state, torch.Tensor) else (x, *state[1:])  # the streams replaced by x, the rest kept
    with HostSyncs() as mode:
        out = hc(state, branch)
        sum(t.square().sum() for t in ((out,) if isinstance(out, torch.Tensor) else out)).backward()
    assert mode.calls == [], f"{family} n={n}: {mode.calls}"
    assert x.grad is not None and torch.isfinite(x.grad).all()


@pytest.mark.parametrize("family", s2hc.families())
def test_a_model_step_makes_no_host_sync(family):
    """A whole training step of a small model of every family (bf16 autocast, n = 8, mhc-lite at its largest n):
    forward, backward, clipping and the AdamW update (its first, which makes its state, and a later one)."""
    n = 1 if forms.get(family).max_streams == 1 else {"mhc-lite": mixers.MAX_PERMUTATION_STREAMS}.get(family, 8)
    torch.manual_seed(0)
    model = Transformer(get_preset("tiny", family=family, n_streams=n, vocab_size=64, dim=32, n_layers=2, n_heads=2,
                                   ffn_dim=64, max_seq_len=32))
    optimizer = make_optimizer(model, 1e-3, 0.1, (0.9, 0.95))
    tokens = torch.randint(0, 64, (2, 17))
    for _ in range(2):
        with HostSyncs(step_counters(optimizer)) as mode:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                logits = model(tokens[:, :-1])
            torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        assert mode.calls == [], f"{family}: {mode.calls}"


# ------------------------------------------------------------------------------------- the training loop


def count_syncs(monkeypatch) -> dict[str, dict[int, list[str]]]:
    """Run every ``_Run.optimizer_step`` and ``_Run.log`` of the loop inside :class:`HostSyncs`; returns
    ``{"step": {step: calls}, "log": {step: calls}}``, filled as the run goes."""
    counts: dict[str, dict[int, list[str]]] = {"step": {}, "log": {}}

    def recorded(kind, real):
        def method(self):
            with HostSyncs(step_counters(self.optimizer)) as mode:
                real(self)
            counts[kind][self.step] = mode.calls

        return method

    monkeypatch.setattr(loop._Run, "optimizer_step", recorded("step", loop._Run.optimizer_step))
    monkeypatch.setattr(loop._Run, "log", recorded("log", loop._Run.log))
    return counts


def loop_config(corpus_file, tmp_path, name, **changes):
    values = dict(max_steps=7, log_every=3, eval_every=0, checkpoint_every=0, diagnostics_every=0, lr=3e-3,
                  warmup_steps=2, out=str(tmp_path / name))
    return small_config(corpus_file, tmp_path, **{**values, **changes})


@pytest.mark.parametrize("family,n", [("s2hc", 8), ("mhc", 4), ("residual", 1)])
def test_training_steps_sync_only_to_log(family, n, corpus_file, tmp_path, monkeypatch):
    """The loop with ``log_every=3`` (7 steps, evaluation and a checkpoint at the end only): the steps record no
    sync at all, and a log step's read records exactly one, the transfer of its table (``tolist``) — the steps'
    losses, gradient norms and weights' finiteness in one read. What it logs is what a read every step
    (``log_every=1``) gives at the same steps: the step's own loss and gradient norm."""
    counts = count_syncs(monkeypatch)
    config = loop_config(corpus_file, tmp_path, "every3", family=family, n_streams=n)
    result = train(config)
    assert sorted(counts["step"]) == list(range(1, 8))
    assert all(calls == [] for calls in counts["step"].values()), counts["step"]
    assert counts["log"] == {3: ["tolist"], 6: ["tolist"], 7: ["tolist"]}
    monkeypatch.undo()
    every = train(config.replace(log_every=1, out=str(tmp_path / "every1")))
    logged = {r["step"]: r for r in read_metrics(config.out) if "loss" in r}
    reference = {r["step"]: r for r in read_metrics(every.out) if "loss" in r}
    assert sorted(logged) == [3, 6, 7]
    for step, record in logged.items():
        assert (record["loss"], record["grad_norm"], record["lr"]) == (
            reference[step]["loss"], reference[step]["grad_norm"], reference[step]["lr"]), step
        assert record["step_time"] > 0 and record["tokens_per_s"] > 0
    assert result.train_loss == every.train_loss == reference[7]["loss"]
    assert len(load_checkpoint(config.out).history.step_times) == 7  # one per step: its interval's mean


def test_a_reintroduced_sync_is_caught(corpus_file, tmp_path, monkeypatch):
    """The loop test's harness fails a step that reads its loss on the host again."""
    counts = count_syncs(monkeypatch)
    real = loop.F.cross_entropy

    def read_on_the_host(*args, **kwargs):
        loss = real(*args, **kwargs)
        loss.sum().item()  # as the loop did before its steps were made sync-free (evaluation's losses are per token)
        return loss

    monkeypatch.setattr(loop.F, "cross_entropy", read_on_the_host)
    train(loop_config(corpus_file, tmp_path, "run", max_steps=2, log_every=2))
    assert counts["step"][1] == ["_local_scalar_dense"]


# ------------------------------------------------------------------------- divergence, found at the read


def test_a_non_finite_loss_between_logs_is_named_at_the_next_read_and_never_saved(corpus_file, tmp_path,
                                                                                  monkeypatch):
    """A NaN loss at step 5, with ``log_every=4`` and a checkpoint every 3 steps: the run goes on to the read
    before step 6's checkpoint, stops there naming step 5, keeps step 3's checkpoint (not 6's), and records
    the divergence at step 5; the log of step 4 holds step 4's finite values."""
    calls = poison_loss_at(monkeypatch, 5)
    config = loop_config(corpus_file, tmp_path, "run", max_steps=12, log_every=4, checkpoint_every=3)
    with pytest.raises(TrainingError, match=r"non-finite loss \(nan\) or gradient at step 5; stopped; the last good "
                                            r"checkpoint \(step 3\)"):
        train(config)
    assert calls["n"] == 6  # step 6 ran: its checkpoint's read found step 5
    assert load_checkpoint(config.out).step == 3
    records = read_metrics(config.out)
    assert [r["step"] for r in records if "diverged" in r] == [5]
    assert [(r["step"], math.isfinite(r["loss"])) for r in records if "loss" in r] == [(4, True)]


def test_non_finite_weights_between_logs_are_named_with_their_step(corpus_file, tmp_path, monkeypatch):
    """An infinite learning rate at step 2 makes the weights non-finite after its update; with ``log_every=5`` the
    read at step 5 names step 2 and the parameters, nothing is checkpointed."""
    real = loop.learning_rate
    monkeypatch.setattr(loop, "learning_rate", lambda step, **kw: math.inf if step == 1 else real(step, **kw))
    config = loop_config(corpus_file, tmp_path, "run", max_steps=8, log_every=5)
    with pytest.raises(TrainingError, match=r"non-finite weights after the update of step 2 \(.+; learning rate "
                                            r"inf\); stopped; no checkpoint of this run"):
        train(config)
    assert [r["step"] for r in read_metrics(config.out) if "diverged" in r] == [2]


# ------------------------------------------------------------------------------- the optimizer's counters


def fresh_step_counter(model) -> torch.Tensor:
    """The ``step`` of a fresh optimizer over ``model`` after one update: where torch keeps its counters."""
    optimizer = make_optimizer(model, 1e-3, 0.0, (0.9, 0.95))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return next(iter(optimizer.state.values()))["step"]


def test_resumed_step_counters_are_where_a_fresh_optimizer_keeps_them(corpus_file, tmp_path, monkeypatch):
    """After a resume every AdamW ``step`` counter has a fresh optimizer's device and dtype, also when the
    checkpoint brings them in another form (float64 here, standing in for counters read onto the GPU, which
    torch's ``load_state_dict`` would leave there), and the resumed steps make no sync."""
    import s2hc.train.checkpointer as checkpointer

    config = loop_config(corpus_file, tmp_path, "run", max_steps=2, log_every=1, checkpoint_every=2)
    train(config)
    real = checkpointer.load_checkpoint

    def elsewhere(*args, **kwargs):
        saved = real(*args, **kwargs)
        if saved.optimizer is not None:
            for state in saved.optimizer["state"].values():
                state["step"] = state["step"].to(torch.float64)
        return saved

    monkeypatch.setattr(checkpointer, "load_checkpoint", elsewhere)
    runs = []
    real_step = loop._Run.optimizer_step

    def step(self):
        runs.append(self)
        with HostSyncs(step_counters(self.optimizer)) as mode:
            real_step(self)
        assert mode.calls == []

    monkeypatch.setattr(loop._Run, "optimizer_step", step)
    train(config.replace(max_steps=4), resume=True)
    optimizer = runs[0].optimizer
    fresh = fresh_step_counter(runs[0].model)
    counters = [s["step"] for s in optimizer.state.values()]
    assert counters and all((c.device, c.dtype, c.dim()) == (fresh.device, fresh.dtype, fresh.dim()) for c in counters)
    assert all(c.item() == 4 for c in counters)
