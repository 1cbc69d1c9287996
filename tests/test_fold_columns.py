"""The proof that a fold into a layer's output columns reaches a tensor column for column
(passes/fold_columns): it holds where numpy says the tensor comes out divided, is found on the
attention context, and spares the output-aware fold check its run only there."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import motifs
from qdqgraph import QuantizeConfig
from qdqgraph.graph import io
from qdqgraph.graph.view import GraphView
from qdqgraph.passes.fold_columns import proved
from qdqgraph.prepare import prepare, read_data
from qdqgraph.recipes import output_aware
from test_recipes import _context_choice, ln_data, permuted_merge

B, T, CIN = 2, 3, 5


def _chain_model(k: int, ops: list) -> tuple:
    """x [B, T, CIN] -> MatMul (k columns) -> bias Add -> `ops` -> t; ops: ("reshape", shape),
    ("transpose", perm), ("matmul", A's shape) (t as the right operand, A a graph input). Returns
    (model, the shape of every tensor, computed by numpy, t's name, the chain's steps as numpy
    functions from the layer's output on)."""
    rng = np.random.default_rng(1)
    g = motifs.G("chain")
    x = g.input("x", [B, T, CIN])
    y = g.node("Add", [g.node("MatMul", [x, g.weight("w", (CIN, k))], name="layer"), g.weight("b", (k,), 0.1)],
               name="bias")
    shapes = {y: (B, T, k), "layer_out": (B, T, k)}
    cur, shape = y, (B, T, k)
    steps = []
    for i, (kind, arg) in enumerate(ops):
        if kind == "reshape":
            cur = g.node("Reshape", [cur, g.const(f"s{i}", np.array(arg, np.int64))], name=f"r{i}")
            shape = tuple(arg)
            steps.append(lambda v, arg=arg: v.reshape(arg))
        elif kind == "transpose":
            cur = g.node("Transpose", [cur], name=f"p{i}", perm=list(arg))
            shape = tuple(shape[p] for p in arg)
            steps.append(lambda v, arg=arg: v.transpose(arg))
        else:
            a = rng.standard_normal(arg).astype(np.float32)      # its values: numpy's, for the truth
            cur = g.node("MatMul", [g.input(f"a{i}", list(arg)), cur], name=f"m{i}")
            shapes[f"a{i}"] = tuple(arg)
            shape = np.matmul(np.zeros(arg, np.float32), np.zeros(shape, np.float32)).shape
            steps.append(lambda v, a=a: np.matmul(a, v))
        shapes[cur] = tuple(shape)
    g.output(cur)
    return g.model(17), shapes, cur, steps


def _truly_divided(k: int, steps: list) -> bool:
    """numpy: does the chain of y * s (s over y's columns) give the chain of y times s over the
    result's last axis?"""
    rng = np.random.default_rng(2)
    y = rng.standard_normal((B, T, k)).astype(np.float64)
    s = rng.uniform(0.5, 3.0, k)
    a, b = y, y * s
    for f in steps:
        a, b = f(a), f(b)
    return a.shape[-1] == k and np.allclose(b, a * s, rtol=1e-9, atol=1e-12)


def _proof(model, shapes: dict, t: str, seen=None) -> bool:
    loaded = io.load(model, check=False)
    view = GraphView(loaded.graph)
    return proved(view, view.tensors[t], shapes, seen)


def _factorizations(total: int, parts: int) -> st.SearchStrategy:
    """Shapes of `parts` dims whose product is `total`."""
    def cut(ps):
        dims = [1] * parts
        for p, slot in ps:
            dims[slot % parts] *= p
        return tuple(dims)
    primes = []
    n, f = total, 2
    while n > 1:
        while n % f == 0:
            primes.append(f)
            n //= f
        f += 1
    return st.permutations(primes).flatmap(
        lambda ps: st.lists(st.integers(0, parts - 1), min_size=len(ps), max_size=len(ps)).map(lambda slots: cut(zip(ps, slots))))


@st.composite
def chains(draw):
    k = draw(st.sampled_from([6, 12, 20]))
    shape = (B, T, k)
    ops = []
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["reshape", "transpose", "matmul"]))
        if kind == "reshape":
            shape = draw(_factorizations(int(np.prod(shape)), draw(st.integers(2, 4))))
            ops.append(("reshape", shape))
        elif kind == "transpose":
            perm = tuple(draw(st.permutations(range(len(shape)))))
            shape = tuple(shape[p] for p in perm)
            ops.append(("transpose", perm))
        elif len(shape) >= 2:
            a = tuple(shape[:-2]) + (draw(st.integers(1, 3)), shape[-2])
            shape = tuple(shape[:-2]) + (a[-2], shape[-1])
            ops.append(("matmul", a))
    return k, ops


@settings(max_examples=120, deadline=None)
@given(chains(), st.randoms(use_true_random=False))
def test_a_proof_holds_where_numpy_says_the_tensor_is_divided(chain, rnd):
    """Also with dimensions left open as inference leaves them (a fresh symbol each, t's fixed by its
    real shape): the symbols solved along the way must not prove what is not so."""
    k, ops = chain
    model, shapes, t, steps = _chain_model(k, ops)
    truth = _truly_divided(k, steps)
    if _proof(model, shapes, t):
        assert truth
    open_ = {name: tuple(f"d{rnd.random()}" if rnd.random() < 0.3 and not name.startswith("a") else d for d in shape)
             for name, shape in shapes.items()}
    if _proof(model, open_, t, seen=shapes[t]):
        assert truth


ATTENTION = [("reshape", (B, T, 2, 6)), ("transpose", (0, 2, 1, 3)), ("matmul", (B, 2, T, T)),
             ("transpose", (0, 2, 1, 3)), ("reshape", (B, T, 12))]


@pytest.mark.parametrize("ops,holds", [
    (ATTENTION, True),                                                   # heads split, mixed over tokens, merged
    ([("reshape", (B * T, 12))], True),                                  # rows flattened
    ([("reshape", (B, T, 6, 2)), ("transpose", (0, 1, 3, 2)), ("reshape", (B, T, 12))], False),   # merged the other way
    ([("transpose", (0, 2, 1))], False),                                 # the columns on another axis
    ([("reshape", (B, T, 2, 6)), ("transpose", (0, 1, 3, 2)), ("matmul", (B, T, 1, 6))], False),  # columns summed over
])
def test_known_chains(ops, holds):
    model, shapes, t, steps = _chain_model(12, ops)
    assert _truly_divided(12, steps) == holds
    assert _proof(model, shapes, t) == holds


def test_symbols_inference_leaves_open_are_solved_or_the_proof_fails():
    """MiniLM's case: inference loses the batch (Slice on a computed end) and the head count; the
    sample's shape of the tensor fixes its symbols, and a re-cut solves the one symbol left."""
    model, shapes, t, _ = _chain_model(12, ATTENTION)
    loaded = io.load(model, check=False)
    names = {n.name: n.outputs[0].name for n in loaded.graph.nodes}
    open_ = dict(shapes)
    open_[names["bias"]] = ("b", T, 12)
    open_[names["r0"]] = ("b", T, "h", 6)
    open_[names["p1"]] = ("b", "h", T, 6)
    open_[names["m2"]] = ("u", "v", T, 6)
    open_[names["p3"]] = ("u", T, "v", 6)
    open_[t] = ("b", T, "c")
    assert not _proof(model, open_, t)                          # nothing fixes b or c
    assert _proof(model, open_, t, seen=(B, T, 12))
    assert not _proof(model, open_, t, seen=(B * T, 1, 12))     # not what inference says of its axis 1


def test_a_merge_that_scrambles_the_columns_is_not_proved_by_its_real_shape():
    """[1, 12, T, 6] re-cut to [2, T, 36]'s worth of elements: the real shape binds the symbols, and the
    columns then straddle two axes."""
    ops = [("reshape", (1, 2 * T, 2, 6)), ("transpose", (0, 2, 1, 3)), ("reshape", (2, T, 12))]
    model, shapes, t, steps = _chain_model(12, [("reshape", (1, B * T, 12))] + ops)
    open_ = dict(shapes)
    open_[t] = ("u", T, "v")
    assert _truly_divided(12, steps) is False
    assert not _proof(model, open_, t, seen=shapes[t])


def _spy_runs(monkeypatch) -> list:
    runs: list = []
    real = output_aware.float_activations

    def spy(loaded, names, *args, **kwargs):
        runs.append(list(names))
        return real(loaded, names, *args, **kwargs)
    monkeypatch.setattr(output_aware, "float_activations", spy)
    return runs


def test_the_attention_context_fold_is_proved_and_no_check_runs(monkeypatch):
    m = motifs.attention_block()
    loaded, plan = prepare(m)
    data = read_data(loaded, motifs.sample_data(m), QuantizeConfig())
    choices, first = _context_choice(loaded, plan, data, "ctx_merge_out")
    runs = _spy_runs(monkeypatch)
    res, _ = output_aware.apply(loaded, choices, first, lambda pending: output_aware.failed_folds(loaded, pending, first, data))
    assert res["into_producer"] == ["ctx_merge_out"]
    assert runs == []


def test_a_fold_the_shapes_do_not_prove_is_still_run_and_undone(monkeypatch):
    m = permuted_merge()
    loaded, plan = prepare(m)
    data = read_data(loaded, ln_data(), QuantizeConfig())
    choices, first = _context_choice(loaded, plan, data, "merge_out")
    runs = _spy_runs(monkeypatch)
    res, _ = output_aware.apply(loaded, choices, first, lambda pending: output_aware.failed_folds(loaded, pending, first, data))
    assert runs == [["merge_out"]]
    assert res["into_producer"] == [] and res["multiplied"] == ["merge_out"]


def test_a_proof_that_fails_to_read_the_graph_leaves_the_fold_to_the_run(monkeypatch):
    m = motifs.attention_block()
    loaded, plan = prepare(m)
    data = read_data(loaded, motifs.sample_data(m), QuantizeConfig())
    choices, first = _context_choice(loaded, plan, data, "ctx_merge_out")

    def broken(*args):
        raise KeyError("a tensor the proof did not expect")
    monkeypatch.setattr(output_aware, "proved", broken)
    runs = _spy_runs(monkeypatch)
    res, _ = output_aware.apply(loaded, choices, first, lambda pending: output_aware.failed_folds(loaded, pending, first, data))
    assert runs == [["ctx_merge_out"]] and res["into_producer"] == ["ctx_merge_out"]


def _real(name: str):
    import os
    from pathlib import Path
    from test_models import missing
    zoo = Path(os.environ.get("QDQGRAPH_ZOO", "/tmp/qdqgraph-zoo"))
    tfm = Path(os.environ.get("QDQGRAPH_TRANSFORMERS", "/tmp/qdqgraph-tfm"))
    for root in (zoo, tfm):
        model, calib = root / "models" / f"{name}.onnx", root / "calib" / f"{name}.npz"
        if model.exists() and calib.exists():
            return model, calib
    missing(f"{name} and its calibration data")


@pytest.mark.slow
@pytest.mark.parametrize("name,folds", [("minilm_l6_v2", 6), ("whisper_tiny_en_encoder", 4)])
def test_on_real_exports_every_fold_is_proved_and_the_run_agrees(name, folds, monkeypatch):
    """MiniLM (its batch and head count left symbolic by inference) and Whisper tiny.en's encoder:
    the insert's pending folds are all proved, and the run check, made on all of them anyway, fails
    none of them. About 20 s."""
    import qdqgraph
    model, calib = _real(name)
    seen = []
    real = output_aware.failed_folds

    def both(loaded, pending, first, data):
        proofs = output_aware._proved(loaded, pending, first, data)
        prove = output_aware._proved
        output_aware._proved = lambda *a: set()          # the run, on every fold
        try:
            failed = real(loaded, pending, first, data)
        finally:
            output_aware._proved = prove
        seen.append((set(pending), proofs, set(failed)))
        return failed
    monkeypatch.setattr(output_aware, "failed_folds", both)
    qdqgraph.quantize(str(model), str(calib))
    assert len(seen) == 1
    pending, proofs, failed = seen[0]
    assert len(pending) == folds and proofs == pending and not failed
