"""What the rest of s2hc asks of a family is declared on its class (``s2hc.mixers.Mixer`` and subclasses), checked
here against independent statements, and no module outside ``s2hc/mixers`` compares a family with a name."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest
import torch

import s2hc
from s2hc import mixers
from s2hc.mixers.base import Guarantees, Mixer
from s2hc.mixers.mhc_lite import PermutationMixture
from s2hc.models.widen import check_upcyclable, upcyclable_families

# Written out by hand, not derived from the classes: mhc-lite mixes all n! permutations of the n streams, kromhc
# one mixture per prime factor of n (with multiplicity), every other family none.
PERMUTATION_SIZES = {
    ("mhc-lite", 1): [1],
    ("mhc-lite", 5): [5],
    ("mhc-lite", 8): [8],
    ("kromhc", 1): [],
    ("kromhc", 2): [2],
    ("kromhc", 7): [7],
    ("kromhc", 8): [2, 2, 2],
    ("kromhc", 12): [2, 2, 3],
    ("kromhc", 30): [2, 3, 5],
    ("kromhc", 49): [7, 7],
}
PERMUTATION_FAMILIES = {"mhc-lite", "kromhc"}

# docs/upcycling.md: rows and columns summing to 1 for any parameters (and mhc: Sinkhorn's rows exact, columns to
# its tolerance) keep a residual model's function; hc (unconstrained) and orthogonal (keeps norms, not sums) do not.
# The wide residual starts as the residual model by construction (one block read, every block written), so it
# keeps the source's function too; AttnRes reads means of its sources, which only the norms make equal.
# DeepSeek-V4.1's single-pass mHC is mHC whose first read is stream 0 of the copies: the embedding itself.
UPCYCLABLE = ["identity", "mhc", "mhc-lite", "kromhc", "s2hc", "isometric", "ihc", "wide-residual", "mhc-lagged"]
REFUSED = {
    "residual": "it is the source's own family (one stream): there is nothing to upcycle",
    "hc": "its H_res is unconstrained, so nothing keeps its columns summing to 1 and the streams' sum stops "
    "following the source's residual stream",
    "orthogonal": "an orthogonal H_res keeps norms, not sums (its columns do not sum to 1), so the streams' sum "
    "stops following the source's residual stream",
    "gated-residual": "its gates start random, so its start is not the source's function; the start that is (zero "
    "gate projections) keeps the streams identical copies under every gradient step",
    "attn-res": "its sublayers read the mean of their sources, the residual sum's direction but not its scale, so it "
    "starts as the source only up to the norms' epsilon",
    "vp-residual": "it has one stream, and α x + β F(x) with α² + β² = 1 is never x + F(x): no start of it computes "
    "the residual model",
    "affine-residual": "it has one stream, like the source: nothing to widen; it starts as x + F(x) (scales 1, biases "
    "0), so a residual model's weights load into it with its function as they are",
}


@pytest.mark.parametrize(("family", "n"), list(PERMUTATION_SIZES))
def test_permutation_sizes_of_the_permutation_families(family, n):
    assert mixers.get(family).permutation_sizes(n) == PERMUTATION_SIZES[family, n]


@pytest.mark.parametrize("family", sorted(set(mixers.REGISTRY) - PERMUTATION_FAMILIES))
def test_other_families_build_no_permutation_mixture(family):
    assert all(mixers.get(family).permutation_sizes(n) == [] for n in range(1, 65))


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6, 7, 8, 12])
@pytest.mark.parametrize("family", sorted(PERMUTATION_FAMILIES))
def test_declared_sizes_are_the_mixtures_built(family, n):
    """The classmethod answers without building; what a built module (on meta: nothing allocated) holds agrees."""
    with torch.device("meta"):
        mixer = mixers.build(family, n, allow_large=True)
    built = [m.size for m in mixer.modules() if isinstance(m, PermutationMixture)]
    assert built == mixer.permutation_sizes(n)
    assert mixer.num_inputs == sum(math.factorial(p) for p in built)


@pytest.mark.parametrize(
    ("family", "n", "options"),
    [
        ("mhc-lite", 6, {}),
        ("mhc-lite", 7, {"allow_large": True}),
        ("mhc-lite", 8, {"allow_large": True}),
        ("kromhc", 6, {}),
        ("kromhc", 7, {"allow_large": True}),
        ("kromhc", 8, {}),  # 2 x 2 x 2: no factor above 6
        ("kromhc", 14, {"allow_large": True}),  # 2 x 7
    ],
)
def test_options_for_size_of_the_permutation_families(family, n, options):
    assert mixers.get(family).options_for_size(n) == options


@pytest.mark.parametrize("family", list(mixers.REGISTRY))
def test_options_for_size_are_what_building_needs(family):
    """With its options_for_size every family builds at every n up to 8 (the built limit of the permutation
    tables); a family that asks for options refuses to build without them."""
    cls = mixers.get(family)
    for n in range(1, 9):
        options = cls.options_for_size(n)
        if family not in PERMUTATION_FAMILIES:
            assert options == {}
        with torch.device("meta"):
            mixers.build(family, n, **options)
            if options:
                with pytest.raises(ValueError, match="allow_large"):
                    mixers.build(family, n)


def test_which_families_can_be_upcycled():
    assert upcyclable_families() == UPCYCLABLE
    assert [f for f in mixers.REGISTRY if mixers.get(f).upcycle_refusal() is None] == [
        f for f in UPCYCLABLE if f in mixers.REGISTRY]
    assert sorted(set(s2hc.families()) - set(UPCYCLABLE)) == sorted(REFUSED)


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_refused_families_say_why(family):
    with pytest.raises(ValueError) as raised:
        check_upcyclable(family, "--family")
    assert str(raised.value) == (
        f"--family {family!r} cannot start from a residual model with the same function: {REFUSED[family]}; "
        f"choose one of {UPCYCLABLE}"
    )


def test_a_new_family_qualifies_for_upcycling_by_its_guarantees():
    """A family that declares nothing about upcycling is judged by its guarantees, with a reason when refused."""

    class Summing(Mixer):
        guarantees = Guarantees(row_sums_one=True, col_sums_one=True)

    class RowsOnly(Mixer):
        guarantees = Guarantees(row_sums_one=True, nonnegative=True)

    assert Summing.upcycle_refusal() is None
    assert RowsOnly.upcycle_refusal() == "its H_res is not guaranteed to have rows and columns summing to 1"
    assert Summing.permutation_sizes(5) == [] and Summing.options_for_size(9) == {}


def test_the_reference_family_of_the_ratio_tables_is_mhc():
    assert mixers.REFERENCE_FAMILY == "mhc"


# ------------------------------------------------- no family named outside s2hc/mixers and the connection forms

SRC = Path(s2hc.__file__).parent
FAMILY_NAMES = set(s2hc.families())
#: The names that hold a form or a family's name (``forms.RESIDUAL``, ``forms.RESIDUAL.name``, ``GATED_RESIDUAL``):
#: comparing with one of them asks a family by its name as surely as the literal does.
FORM_CONSTANTS = {"RESIDUAL", "GATED_RESIDUAL", "ATTN_RES", "WIDE_RESIDUAL"}
#: The packages that declare the families: the mixers (their mathematics) and the connection forms (the rest).
DECLARING = ("mixers/", "connection/forms/")

#: (module, literal): why that literal is not a family question there.
ALLOWED = {
    # a token shard's meta.json field (which source and tokenizer the shard was made from), not the family
    ("data/shards.py", "identity"): "meta.json key",
    ("data/stream.py", "identity"): "meta.json key",  # the same field of a streamed cache's meta.json
    # the s2hc package's version in a study's environment record, not the family
    ("study/runner.py", "s2hc"): "environment key",
    # the DeepSeek-V4 converter maps one concrete format, transformers' DeepseekV4HyperConnection, which s2hc
    # computes only as the mhc family's deepseek-v4 variant: the check names that format (with the variant and
    # transpose_res), not a property another family could declare
    ("hf/deepseek_v4.py", "mhc"): "format check",
    # gate_init="residual" (a start of the gates), a value of another option that shares the word
    ("connection/init.py", "residual"): "gate_init value",
    ("connection/module.py", "residual"): "gate_init value",
    ("models/model_config.py", "residual"): "gate_init value",
    # Qwen's checkpoints hold one concrete format, the gated residual's: the static reader names that format
    ("hf/static.py", "GATED_RESIDUAL"): "format check",
    ("hf/qwen4_exp.py", "GATED_RESIDUAL"): "format check",  # its converters take that one module
    # the residual model as a role, not a property: the source that upcycling and native export start from, and
    # the baseline the bench times every family against
    ("models/widen.py", "RESIDUAL"): "upcycling's source",
    ("train/init_from.py", "RESIDUAL"): "upcycling's source",
    ("upcycle.py", "RESIDUAL"): "upcycling's source",
    ("hf/convert.py", "RESIDUAL"): "native transformers classes hold the residual model only",
    ("bench/measure.py", "RESIDUAL"): "the bench's baseline",
    ("compat.py", "RESIDUAL"): "the hyper-connections package's disable=True",
    ("bench/run.py", "RESIDUAL"): "the bench's baseline",
}


def _literals(node: ast.AST):
    """Family names in ``node``: a string literal, a form constant (``RESIDUAL``, ``forms.RESIDUAL``, either's
    ``.name``), or the items of a tuple, list or set of them."""
    if isinstance(node, ast.Constant) and node.value in FAMILY_NAMES:
        yield node.value
    elif isinstance(node, ast.Attribute) and node.attr == "name":
        yield from _literals(node.value)
    elif isinstance(node, ast.Name) and node.id in FORM_CONSTANTS:
        yield node.id
    elif isinstance(node, ast.Attribute) and node.attr in FORM_CONSTANTS:
        yield node.attr
    elif isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        for item in node.elts:
            yield from _literals(item)


def family_name_questions(source: str) -> list[tuple[int, str]]:
    """``(line, name)`` for every comparison with a family name (``==``, ``!=``, ``in (...)``), dict key naming a
    family, and ``case "name":`` in ``source``; strings elsewhere (messages, docstrings, defaults) are not asked."""
    found = []
    for node in ast.walk(ast.parse(source)):
        operands = []
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.Dict):
            operands = [key for key in node.keys if key is not None]
        elif isinstance(node, ast.MatchValue):
            operands = [node.value]
        found += [(node.lineno, name) for operand in operands for name in _literals(operand)]
    return found


def test_the_scan_finds_each_kind_of_question():
    source = 'a == "mhc"\nb in ("kromhc", "x")\nc = {"hc": 1}\nmatch d:\n    case "s2hc":\n        pass\n'
    assert family_name_questions(source) == [(1, "mhc"), (2, "kromhc"), (3, "hc"), (5, "s2hc")]
    assert family_name_questions('f(family="mhc")\nraise ValueError("use mhc")\ny = "residual"\n') == []
    constants = 'a == RESIDUAL\nb is not forms.RESIDUAL\nc != forms.GATED_RESIDUAL.name\nd in (ATTN_RES, "x")\n'
    assert family_name_questions(constants) == [(1, "RESIDUAL"), (2, "RESIDUAL"), (3, "GATED_RESIDUAL"),
                                                (4, "ATTN_RES")]
    assert family_name_questions('e == "attn-res"\nf == "wide-residual"\n') == [(1, "attn-res"), (2, "wide-residual")]


def test_no_module_outside_the_families_compares_a_family_with_a_name():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        module = path.relative_to(SRC).as_posix()
        if module.startswith(DECLARING):
            continue
        for line, name in family_name_questions(path.read_text(encoding="utf-8")):
            if (module, name) not in ALLOWED:
                found.append(f"{module}:{line}: {name!r}")
    assert not found, ("ask the family's form (s2hc/connection/forms/) or class (s2hc/mixers/base.py) instead of "
                       "comparing names: " + ", ".join(found))
