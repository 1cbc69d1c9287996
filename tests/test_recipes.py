"""The transformer recipes, each on a constructed case whose better answer is known: output-aware
ranges and smoothing (qdqgraph.passes.output_aware), scalar scales folded into linear layers
(qdqgraph.passes.fold_scale), and the INT8-attention check (qdqgraph.recipes.attention_guard)."""
import numpy as np
import onnxruntime as ort
import pytest

import motifs
import qdqgraph
from qdqgraph import QuantizeConfig
from qdqgraph.graph import io
from qdqgraph.recipes import attention_guard
from qdqgraph import config as config_module
from qdqgraph.recipes import output_aware
from qdqgraph.passes.fold_scale import fold_scalar_scales
from qdqgraph.prepare import prepare, read_data

T, K, N = 16, 32, 24


def run(model, feed):
    """The model's outputs as qdqgraph scores it (qdqgraph.session: TensorRT's arithmetic where
    onnxruntime's defaults differ, its INT8 kernels' saturation on AVX2 CPUs among them)."""
    return qdqgraph.session(model).run(None, feed)


def sqnr(ref, got):
    ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
    return 10 * np.log10((ref ** 2).sum() / max(((ref - got) ** 2).sum(), 1e-30))


def snapshot(loaded):
    return io.to_model(io.Loaded(graph=loaded.graph.copy(), ir_version=loaded.ir_version))


def ln_model(residual=False):
    """x -> LayerNorm (a gamma with two channels 40x the rest, as trained encoders have) -> MatMul;
    with `residual`, the LayerNorm output also feeds a residual Add (post-LN BERT)."""
    g = motifs.G("ln")
    x = g.input("x", [1, T, K])
    gamma = np.ones(K, np.float32)
    gamma[[3, 17]] = 40.0
    ln = g.node("LayerNormalization", [x, g.const("gamma", gamma), g.const("beta", np.zeros(K, np.float32))],
                name="ln", axis=-1)
    y = g.node("MatMul", [ln, g.weight("w", (K, K))], name="dense")
    if residual:
        y = g.node("Add", [y, ln], name="residual")
    g.node("MatMul", [y, g.weight("w2", (K, N))], ["y"], name="head")
    g.output("y")
    return g.model(17)


def ln_data(n=16, seed=0):
    return {"x": np.random.default_rng(seed).standard_normal((n, 1, T, K)).astype(np.float32)}


# ------------------------------------------------------------------ the search, on known answers

def test_search_clips_an_outlier_the_weights_ignore():
    """Channel 0 carries rare values of 1000 but its weight row is zero: the output does not see
    it, so the best range ignores it (far below max|x|) and the output error is far lower."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 16)).astype(np.float32)
    x[::50, 0] = 1000.0
    w = rng.standard_normal((16, 8)).astype(np.float32)
    w[0] = 0.0
    cmax = np.abs(x).max(axis=0)
    (alpha, amax, err), plain = output_aware.search(x, w, cmax, alphas=(0.0,))
    assert amax < 0.1 * 1000.0
    ref = x @ w
    at_max = np.sum((output_aware._quant_act(x, 1000.0) @ output_aware._quant_weight(w) - ref) ** 2) / np.sum(ref ** 2)
    assert alpha == 0.0 and err == plain and err < 0.1 * at_max


def test_search_smooths_a_channel_that_is_always_large():
    """Channel 0 is 100x the others on every row and its weights matter: one per-tensor scale
    leaves the other channels a level or two; smoothing (alpha > 0) cuts the error several-fold."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((512, 16)).astype(np.float32)
    x[:, 0] *= 100.0
    w = rng.standard_normal((16, 8)).astype(np.float32) * 0.1
    (alpha, amax, err), plain = output_aware.search(x, w, np.abs(x).max(axis=0))
    assert alpha > 0 and err < 0.25 * plain


def test_search_never_returns_worse_than_the_calibrated_range():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((256, 16)).astype(np.float32)
    w = rng.standard_normal((16, 200)).astype(np.float32)     # M > PROJECT: the projected error
    calibrated = float(np.percentile(np.abs(x), 99.99))
    (_, _, err), plain = output_aware.search(x, w, np.abs(x).max(axis=0), extra=(calibrated,))
    assert err <= plain


def _brute_search(x, w, cmax, extra):
    """The search as its doc states it, written out one candidate at a time, each product on its own:
    per alpha, the grid scanned on the largest rows and every SCAN_STRIDE-th other one, the
    SCAN_KEEP best measured again on all rows with `extra` (at alpha 0), then the two neighbours."""
    from qdqgraph.precisions.scales import safe_scales
    m = w.shape[1]
    p = None if m <= output_aware.PROJECT else \
        (np.random.default_rng(0).standard_normal((m, output_aware.PROJECT)) / np.sqrt(output_aware.PROJECT)).astype(np.float32)
    project = (lambda a: a) if p is None else (lambda a: a @ p)

    def fake_quant(v, scale):
        return np.clip(np.rint(v / scale), -128, 127) * scale

    def error(q, wq, rows):
        e = (q @ wq - ref[rows]).astype(np.float64)
        return (e ** 2).sum(axis=1)

    ref = x @ project(w)
    norm = float((ref.astype(np.float64) ** 2).sum())
    n = x.shape[0]
    order = np.argsort(-np.abs(x).max(axis=1), kind="stable")
    n_top = int(n * output_aware.SCAN_TOP_ROWS)
    rest = np.sort(order[n_top:])[::output_aware.SCAN_STRIDE]
    scan = np.concatenate([np.sort(order[:n_top]), rest])
    weight = np.concatenate([np.ones(n_top), np.full(len(rest), (n - n_top) / len(rest))])
    every = np.arange(n)
    best, plain = None, None
    for alpha in output_aware.ALPHAS:
        s = output_aware._smoothing(cmax, w, alpha)
        xs = x / s
        ws = w * s[:, None]
        wq = project(fake_quant(ws, safe_scales(np.abs(ws).max(axis=0))))
        top = float(np.abs(xs).max())

        def full(amax):
            return float(error(fake_quant(xs, np.float32(safe_scales(np.array([amax]))[0])), wq, every).sum()) / norm

        grid = [top * f for f in output_aware.CLIP_GRID]
        est = [float(weight @ error(fake_quant(xs[scan], np.float32(safe_scales(np.array([a]))[0])), wq, scan))
               for a in grid]
        kept = sorted(sorted(range(len(grid)), key=est.__getitem__)[:output_aware.SCAN_KEEP])
        here = None
        for amax in [grid[i] for i in kept] + (list(extra) if alpha == 0 else []):
            err = full(amax)
            if here is None or err < here[1]:
                here = (amax, err)
        for amax in (here[0] / output_aware.REFINE, here[0] * output_aware.REFINE):
            if amax <= top and (err := full(amax)) < here[1]:
                here = (amax, err)
        if best is None or here[1] < best[2]:
            best = (alpha, here[0], here[1])
        if alpha == 0:
            plain = here[1]
    return best, plain


@pytest.mark.parametrize("case", range(4))
def test_search_chooses_what_the_brute_force_search_chooses(case):
    """The batched, scanned search returns the candidate (alpha, range) of a direct computation of
    every candidate's error, bit for bit, and its error to float rounding: outlier channels, a few
    large rows, few outputs and more than PROJECT (projected)."""
    rng = np.random.default_rng(10 + case)
    k, m = (24, 40) if case % 2 else (40, 160)
    x = rng.standard_t(3 + case, size=(512, k)).astype(np.float32)
    x[:, rng.integers(0, k, size=2)] *= 10.0 * (case + 1)
    x[::61] *= 6.0
    w = (rng.standard_normal((k, m)) / np.sqrt(k)).astype(np.float32)
    cmax = np.abs(x).max(axis=0)
    extra = (float(np.percentile(np.abs(x), 99.99)),)
    (alpha, amax, err), plain = output_aware.search(x, w, cmax, extra)
    (alpha_b, amax_b, err_b), plain_b = _brute_search(x, w, cmax, extra)
    assert (alpha, amax) == (alpha_b, amax_b)
    assert err == pytest.approx(err_b, rel=1e-5) and plain == pytest.approx(plain_b, rel=1e-5)


def test_batched_quantization_is_the_one_at_a_time_quantization():
    """The search quantizes its candidates together; each slice is what `_quant_act` gives alone,
    and the weights what the formula of insertion gives, bit for bit."""
    from qdqgraph.precisions.scales import safe_scales
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((64, 24)) * 3).astype(np.float32)
    ranges = [float(np.abs(x).max()) * f for f in (1.0, 0.37, 0.05, 1e-9)]
    together = output_aware._quant_acts(x, ranges)
    assert together.dtype == np.float32
    for q, amax in zip(together, ranges):
        assert np.array_equal(q, output_aware._quant_act(x, amax))
    w = (rng.standard_normal((24, 8)) * 0.1).astype(np.float32)
    w[:, 3] = 0.0
    s = safe_scales(np.abs(w).max(axis=0))
    assert np.array_equal(output_aware._quant_weight(w), (np.clip(np.rint(w / s), -128, 127) * s).astype(np.float32))


# ------------------------------------------------------------------ folding, the function kept

def test_smoothing_folds_into_a_layernorm_that_feeds_only_the_linear_layer():
    loaded, plan = prepare(ln_model())
    data = read_data(loaded, ln_data(), QuantizeConfig())
    before = snapshot(loaded)
    choices, first = output_aware.choose(loaded, plan, data)
    ln = next(c for c in choices if c.tensor == "ln_out")
    assert ln.alpha > 0 and ln.folded == "layernorm" and ln.error < ln.plain_error
    res, ranges = output_aware.apply(loaded, choices, first, lambda pending: output_aware.failed_folds(loaded, pending, first, data))
    assert "ln_out" in res["folded"] and res["multiplied"] == [] and "ln_out" in ranges
    assert not any(n.op == "Mul" for n in loaded.graph.nodes)
    feed = {"x": ln_data(1, seed=3)["x"][0]}
    np.testing.assert_allclose(run(snapshot(loaded), feed)[0], run(before, feed)[0], rtol=1e-3, atol=1e-3)


def test_smoothing_of_a_layernorm_with_a_residual_reader_is_a_mul():
    loaded, plan = prepare(ln_model(residual=True))
    data = read_data(loaded, ln_data(), QuantizeConfig())
    choices, first = output_aware.choose(loaded, plan, data)
    assert all(c.folded != "layernorm" for c in choices)      # the Add reads the LayerNorm output too


def _context_choice(loaded, plan, data, tensor):
    choices, first = output_aware.choose(loaded, plan, data)
    c = next(c for c in choices if c.tensor == tensor)
    c.alpha, c.folded = 0.5, "producer"
    c.scale = np.linspace(0.5, 4.0, first[tensor].shape[-1]).astype(np.float32)
    return [c], first


def test_attention_context_smoothing_folds_into_the_value_projection():
    """ctx = softmax(q k^T) v: context channel j is value column j mixed over tokens, so dividing
    value projection column j by s_j divides the context by s (no node added); checked on a sample."""
    m = motifs.attention_block()
    loaded, plan = prepare(m)
    data = read_data(loaded, motifs.sample_data(m), QuantizeConfig())
    before = snapshot(loaded)
    choices, first = _context_choice(loaded, plan, data, "ctx_merge_out")
    res, _ = output_aware.apply(loaded, choices, first, lambda pending: output_aware.failed_folds(loaded, pending, first, data))
    assert res["into_producer"] == ["ctx_merge_out"] and res["multiplied"] == []
    # every tensor from the value projection to the context carries the scale (compare skips them)
    assert res["rescaled"] == ["ctx_merge_out", "ctx_t_out", "pv_out", "v_heads_out", "v_proj_out", "v_t_out"]
    assert any(n.name == "v_proj" and "smoothed" in n.inputs[1].name for n in loaded.graph.nodes)
    feed = {k: v[0] for k, v in motifs.sample_data(m, n=1, seed=7).items()}
    np.testing.assert_allclose(run(snapshot(loaded), feed)[0], run(before, feed)[0], rtol=1e-4, atol=1e-4)


def permuted_merge():
    """Heads merged in another order than they were split (Transpose of the last two axes): the
    producer's column j is not the merged tensor's channel j."""
    g = motifs.G("permuted")
    x = g.input("x", [1, T, K])
    p = g.node("MatMul", [x, g.weight("wp", (K, K))], name="proj")
    h = g.node("Reshape", [p, g.const("split", np.array([0, 0, 4, K // 4], np.int64))], name="heads")
    h = g.node("Transpose", [h], name="swap", perm=[0, 1, 3, 2])
    h = g.node("Reshape", [h, g.const("merge", np.array([0, 0, K], np.int64))], name="merge")
    g.node("MatMul", [h, g.weight("wo", (K, N))], ["y"], name="out")
    g.output("y")
    return g.model(17)


def test_a_fold_that_changes_the_column_order_is_undone_for_a_mul():
    m = permuted_merge()
    loaded, plan = prepare(m)
    data = read_data(loaded, ln_data(), QuantizeConfig())
    before = snapshot(loaded)
    choices, first = _context_choice(loaded, plan, data, "merge_out")
    res, ranges = output_aware.apply(loaded, choices, first, lambda pending: output_aware.failed_folds(loaded, pending, first, data))
    assert res["into_producer"] == [] and res["multiplied"] == ["merge_out"] and res["rescaled"] == []
    assert "merge_out_smoothed" in ranges
    feed = {"x": ln_data(1, seed=4)["x"][0]}
    np.testing.assert_allclose(run(snapshot(loaded), feed)[0], run(before, feed)[0], rtol=1e-4, atol=1e-4)


def scaled_heads(scale_feeds_softmax=False, shared=False):
    """q = (x Wq + b) split in heads, then multiplied by 0.35 before the scores GEMM (as ViT and
    DistilBERT exports do); variants where the Mul feeds a Softmax, or its input has a second reader."""
    g = motifs.G("scaled")
    x = g.input("x", [1, T, K])
    q = g.node("Add", [g.node("MatMul", [x, g.weight("wq", (K, K))], name="q_proj"), g.weight("bq", (K,), 0.1)],
               name="q_bias")
    h = g.node("Transpose", [g.node("Reshape", [q, g.const("split", np.array([0, 0, 4, K // 4], np.int64))],
                                    name="q_heads")], name="q_t", perm=[0, 2, 1, 3])
    s = g.node("Mul", [h, g.const("c", np.array(0.35, np.float32))], name="q_scale")
    k = g.node("Transpose", [h], name="k_t", perm=[0, 1, 3, 2]) if shared else \
        g.node("Transpose", [g.node("Reshape", [g.node("MatMul", [x, g.weight("wk", (K, K))], name="k_proj"),
                                                 g.const("split_k", np.array([0, 0, 4, K // 4], np.int64))],
                                    name="k_heads")], name="k_t", perm=[0, 2, 3, 1])
    if scale_feeds_softmax:
        s = g.node("Softmax", [s], name="sm", axis=-1)
    g.node("MatMul", [s, k], ["y"], name="qk")
    g.output("y")
    return g.model(17)


@pytest.mark.parametrize("variant,folds", [({}, True), ({"scale_feeds_softmax": True}, False),
                                            ({"shared": True}, False)])
def test_a_scalar_scale_before_a_gemm_folds_into_the_projection(variant, folds):
    m = scaled_heads(**variant)
    loaded = io.load(m)
    before = snapshot(loaded)
    res = fold_scalar_scales(loaded.graph)
    assert bool(res["folded"]) == folds
    assert any(n.name == "q_scale" for n in loaded.graph.nodes) != folds
    feed = {"x": ln_data(1, seed=2)["x"][0]}
    np.testing.assert_allclose(run(snapshot(loaded), feed)[0], run(before, feed)[0], rtol=1e-4, atol=1e-4)


def test_the_folded_scale_removes_the_reformat_before_the_scores():
    """With the Mul in place the Q in front of the scores GEMM follows a float Mul (a standalone
    reformat, F6); folded, it moves up to the projection's output (R2, F2)."""
    from qdqgraph import trtsim
    m = scaled_heads()
    q = qdqgraph.quantize(m, ln_data(8), high_precision="fp32", int8_attention="on")
    assert not any(n.op_type == "Mul" for n in q.model.graph.node)
    assert q.report.tensorrt["reformats_inside"] == trtsim.simulate(q.model).summary["reformats_inside"]
    names = [x.name for x in trtsim.simulate(q.model).reformats]
    assert not any("q_scale" in n for n in names)


# ------------------------------------------------------------------ end to end

def test_output_aware_is_on_for_a_layernorm_model_and_beats_it_off():
    m = ln_model()
    data = ln_data(32)
    on = qdqgraph.quantize(m, data, high_precision="fp32")
    off = qdqgraph.quantize(m, data, high_precision="fp32", output_aware=False)
    assert on.report.output_aware is not None and off.report.output_aware is None
    assert "output-aware scales:" in on.report.summary()
    feeds = [{"x": x} for x in ln_data(4, seed=9)["x"]]
    ref = [run(m, f)[0] for f in feeds]
    on_db = sqnr(ref, [run(on.model, f)[0] for f in feeds])
    off_db = sqnr(ref, [run(off.model, f)[0] for f in feeds])
    assert on_db > off_db + 3.0, (on_db, off_db)


def test_output_aware_needs_real_data_and_stays_off_for_a_cnn():
    m = ln_model()
    assert qdqgraph.quantize(m, "random", high_precision="fp32").report.output_aware is None
    cnn = motifs.residual_add()
    assert qdqgraph.quantize(cnn, motifs.sample_data(cnn), high_precision="fp32").report.output_aware is None


def test_output_aware_and_smooth_quant_are_one_choice():
    with pytest.raises(qdqgraph.QdqError, match="output_aware=True and smooth_quant= both"):
        QuantizeConfig(output_aware=True, smooth_quant=0.5)


@pytest.mark.parametrize("mode", ["on", "off"])
def test_int8_attention_on_and_off(mode):
    m = motifs.attention_block()
    r = qdqgraph.quantize(m, motifs.sample_data(m), high_precision="fp32", int8_attention=mode)
    d = r.plan.decisions
    assert d["qk"].quantized == d["pv"].quantized == (mode == "on")
    assert r.report.attention["gemms"] == 2 and r.report.attention["int8"] == (mode == "on")
    if mode == "off":
        assert "int8_attention='off'" in d["qk"].reason          # the API's words


@pytest.mark.parametrize("allowed,int8", [(100.0, True), (-100.0, False)])
def test_int8_attention_auto_follows_the_measured_cost(monkeypatch, allowed, int8):
    monkeypatch.setattr(attention_guard, "ATTENTION_MAX_LOSS_DB", allowed)
    m = motifs.attention_block(mask=True)
    r = qdqgraph.quantize(m, motifs.sample_data(m), high_precision="fp32")
    a = r.report.attention
    assert a["mode"] == "auto" and a["int8"] == int8
    assert a["loss_db"] == pytest.approx(a["attention_float_db"] - a["all_int8_db"], abs=0.02)
    assert r.plan.decisions["qk"].quantized == int8 and r.plan.decisions["pv"].quantized == int8
    if not int8:
        assert "dB output SQNR" in r.plan.decisions["pv"].reason
    assert "attention: 2 GEMMs" in r.report.summary()


def test_int8_attention_is_a_checked_option():
    with pytest.raises(qdqgraph.QdqError, match="int8_attention="):
        QuantizeConfig(int8_attention="maybe")
    assert config_module.ATTENTION_MODES == ("auto", "on", "off")


def test_output_aware_is_on_for_a_layernorm_written_out_as_ops():
    m = motifs.layernorm_decomposed()
    r = qdqgraph.quantize(m, motifs.sample_data(m), high_precision="fp32")
    assert r.report.output_aware is not None
    assert any((d.rule or "").startswith("P10-layernorm") for d in r.plan.decisions.values())


def test_int8_gemms_are_computed_without_saturation_as_tensorrt_does():
    """The smoothed LayerNorm model's INT8 weights span the whole range: onnxruntime's fused integer
    kernels saturate their 16-bit sums on an AVX2 CPU without VNNI. qdqgraph's sessions take its
    exact path (runtime.EXACT_INT8): the outputs are those of the Q/DQ computed as written
    (unfused), on any CPU."""
    from qdqgraph.execution import runtime
    m = ln_model()
    q = qdqgraph.quantize(m, ln_data(32), high_precision="fp32").model
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    as_written = ort.InferenceSession(q.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    feeds = [{"x": x} for x in ln_data(4, seed=9)["x"]]
    ref = [as_written.run(None, f)[0] for f in feeds]
    assert sqnr(ref, [run(q, f)[0] for f in feeds]) > 60
    assert sqnr(ref, [runtime.session(q).run(None, f)[0] for f in feeds]) > 60


def test_a_tensor_with_too_few_rows_keeps_its_calibrated_range(monkeypatch):
    """A linear input that shows fewer than MIN_ROWS rows (a pooled classifier input: a row a
    sample) is not searched: no choice for it, and the written model is that of output-aware off
    for it. With the bound lowered under its rows, the same tensor is searched."""
    m = ln_model()
    data = ln_data(4)                             # 4 samples x T rows
    rows = 4 * T
    monkeypatch.setattr(output_aware, "MIN_ROWS", rows + 1)
    loaded, plan = prepare(m, QuantizeConfig(output_aware=True))
    calib = read_data(loaded, data, QuantizeConfig(output_aware=True))
    choices, _ = output_aware.choose(loaded, plan, calib)
    assert choices == []
    monkeypatch.setattr(output_aware, "MIN_ROWS", rows)
    choices, _ = output_aware.choose(loaded, plan, calib)
    assert choices                                 # the same tensors, searched


def test_high_percentile_is_numpys_bit_for_bit():
    """output_aware.high_percentile, from the rows with the largest maxima, is np.percentile's value
    exactly: ties, heavy tails, rows of zeros, q from 0 to 100, and non-finite values (numpy's own)."""
    from qdqgraph.recipes.output_aware import high_percentile
    rng = np.random.default_rng(0)
    for trial in range(300):
        r, c = int(rng.integers(1, 300)), int(rng.integers(1, 200))
        kind = trial % 5
        if kind == 0:
            a = np.abs(rng.standard_normal((r, c)))
        elif kind == 1:
            a = np.abs(rng.standard_cauchy((r, c)))
        elif kind == 2:
            a = rng.integers(0, 4, (r, c)).astype(np.float64)
        elif kind == 3:
            a = np.abs(rng.standard_normal((r, c))) * (rng.random((r, 1)) < 0.1)
        else:
            a = np.abs(rng.standard_normal((r, c)))
            a.flat[int(rng.integers(a.size))] = np.inf
        a = a.astype(np.float32)
        for q in (99.99, 99.9, 97.0, 50.0, 100.0, 0.0):
            with np.errstate(invalid="ignore"):
                want, got = float(np.percentile(a, q)), high_percentile(a, q)
            assert got == want or (np.isnan(got) and np.isnan(want)), (a.shape, q)
