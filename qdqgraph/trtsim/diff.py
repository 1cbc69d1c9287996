"""Compare a SimReport with a real engine's layers.

Layers are joined by the ONNX node names they contain. An engine layer's name lists only some of
the nodes TensorRT fused (weights, Conv, Add, the last Relu, MaxPool; not BN, not the activation Q/DQ
it absorbed), so both sides are compared on the *visible* nodes: the ONNX node names that appear in
some engine layer name. A layer's key is its set of visible nodes; a simulated layer with no visible
node at all is a layer the engine does not have.

- matched: same key, same input and output precisions;
- precision: same key, different precisions;
- grouping: a key on one side only (the nodes were fused differently);
- reformats: standalone Q/DQ layers on each side.
By default precisions compare as int8 vs float: with `--best` TensorRT picks FP16 or FP32 per layer by
speed, which a strongly typed prediction (float = the tensors' type) cannot know; `exact=True`
compares fp16 and fp32 too. Engine layout reformats and TensorRT's own NoOp/Constant layers carry no
ONNX node and are listed, not compared.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..ops import vocabulary
from .engine_report import EngineLayer, EngineReport
from .report import Layer, SimReport


def _norm(p: str | None, exact: bool) -> str | None:
    if p is None or exact:
        return p
    return "float" if p in ("fp32", "fp16", "bf16", "tf32") else p


@dataclass
class Diff:
    matched: list[tuple[Layer, EngineLayer]] = field(default_factory=list)
    precision: list[tuple[Layer, EngineLayer, str]] = field(default_factory=list)
    engine_only: list[EngineLayer] = field(default_factory=list)
    sim_only: list[Layer] = field(default_factory=list)
    not_compared: list[EngineLayer] = field(default_factory=list)
    sim_reformats: list[str] = field(default_factory=list)
    engine_reformats: list[str] = field(default_factory=list)

    @property
    def compared(self) -> int:
        return len(self.matched) + len(self.precision) + len(self.engine_only) + len(self.sim_only)

    @property
    def share(self) -> float:
        """Matched layers over every layer compared on either side."""
        return len(self.matched) / self.compared if self.compared else 0.0

    @property
    def summary(self) -> dict:
        return {"matched": len(self.matched), "precision_differs": len(self.precision),
                "grouping_engine_only": len(self.engine_only), "grouping_sim_only": len(self.sim_only),
                "share": round(self.share, 4), "sim_reformats": len(self.sim_reformats),
                "engine_reformats": len(self.engine_reformats), "engine_not_compared": len(self.not_compared)}

    def to_dict(self) -> dict:
        return {"summary": self.summary,
                "precision": [{"layer": s.name, "engine": e.name, "why": w} for s, e, w in self.precision],
                "engine_only": [e.name for e in self.engine_only], "sim_only": [s.name for s in self.sim_only],
                "sim_reformats": self.sim_reformats, "engine_reformats": self.engine_reformats}

    def table(self) -> str:
        s = self.summary
        head = (f"matched {s['matched']}/{self.compared} ({100 * self.share:.1f}%), precision differs "
                f"{s['precision_differs']}, grouping differs {s['grouping_engine_only']} engine-only / "
                f"{s['grouping_sim_only']} predicted-only; reformats predicted {s['sim_reformats']}, "
                f"engine {s['engine_reformats']}")
        lines = [head]
        for sl, el, why in self.precision:
            lines.append(f"  precision  {sl.name}: {why}")
        for el in self.engine_only:
            lines.append(f"  engine     {el.name}")
        for sl in self.sim_only:
            lines.append(f"  predicted  {sl.name}")
        return "\n".join(lines)


def _precisions(ports, exact):
    return sorted(_norm(p, exact) or "?" for p in ports)


def diff(sim: SimReport, engine: EngineReport, exact: bool = False) -> Diff:
    names = sim.node_names
    out = Diff()
    ekeys: dict[frozenset, list[EngineLayer]] = {}
    for e in engine.layers:
        key = frozenset(t for t in e.tokens if t in names)
        if e.layout or not key:
            out.not_compared.append(e)
            continue
        ekeys.setdefault(key, []).append(e)
    visible = set().union(*ekeys) if ekeys else set()
    skeys: dict[frozenset, list[Layer]] = {}
    for x in sim.layers:
        key = frozenset(n for n in x.nodes if n in visible)
        if not key:
            out.sim_only.append(x)
            continue
        skeys.setdefault(key, []).append(x)
    for key in sorted(set(ekeys) | set(skeys), key=lambda k: sorted(k)):
        es, ss = ekeys.get(key, []), skeys.get(key, [])
        for el, sl in zip(es, ss):
            ei = _precisions([p for _, p in el.inputs], exact)
            eo = _precisions([p for _, p in el.outputs], exact)
            si = _precisions([p.precision for p in sl.inputs], exact)
            so = _precisions([p.precision for p in sl.outputs], exact)
            unknown = not el.inputs and not el.outputs
            if unknown or (ei == si and eo == so):
                out.matched.append((sl, el))
            else:
                out.precision.append((sl, el, f"predicted {si} -> {so}, engine {ei} -> {eo}"))
        out.engine_only += es[len(ss):]
        out.sim_only += ss[len(es):]
    out.sim_reformats = [x.name for x in sim.reformats]
    out.engine_reformats = [e.name for e in engine.reformats]
    return out


_QUANTIZED = ("int8", "fp8", "int4")
_COMPUTE = {"convolution", "deconvolution", "gemm", "attention"}
_SIM_COMPUTE = {"convolution", "gemm", "matmul", "attention"}


def _class(p: str | None) -> str:
    return "quantized" if p in _QUANTIZED else "float" if p else "?"


@dataclass
class KernelCheck:
    kernel: str              # the engine's compute kernel
    layer: str               # the predicted layer it computes ("" when none)
    predicted: str           # quantized | float
    compiled: str            # the kernel's activation input type (int8, fp8, fp16, fp32, ...)
    weights: str = ""        # the kernel's weight type, where it has one

    @property
    def agrees(self) -> bool:
        return bool(self.layer) and self.predicted == _class(self.compiled)


@dataclass
class KernelAgreement:
    """Compute kernels (convolution, GEMM, fused attention) of a compiled engine against the
    prediction: does each run on quantized inputs exactly where the prediction says?"""
    checks: list[KernelCheck] = field(default_factory=list)
    internal: list[str] = field(default_factory=list)   # compute kernels that carry no ONNX node: not compared

    @property
    def share(self) -> float:
        return sum(c.agrees for c in self.checks) / len(self.checks) if self.checks else 0.0

    @property
    def quantized(self) -> list[KernelCheck]:
        return [c for c in self.checks if _class(c.compiled) == "quantized"]

    def summary(self) -> dict:
        return {"compute_kernels": len(self.checks), "agree": sum(c.agrees for c in self.checks),
                "share": round(self.share, 4), "quantized_kernels": len(self.quantized),
                "attention_kernels": sum(c.kernel.startswith("_gemm_mha") for c in self.checks),
                "internal_kernels": len(self.internal)}

    def to_dict(self) -> dict:
        return {"summary": self.summary(),
                "kernels": [{"kernel": c.kernel, "layer": c.layer, "predicted": c.predicted,
                             "compiled": c.compiled, "weights": c.weights, "agrees": c.agrees}
                            for c in self.checks]}

    def table(self) -> str:
        s = self.summary()
        lines = [f"compute kernels: {s['agree']}/{s['compute_kernels']} as predicted ({100 * self.share:.1f}%), "
                 f"{s['quantized_kernels']} on quantized inputs"
                 + (f"; {len(self.internal)} name no predicted node (an op's own GEMMs, as an LSTM's steps, or an If "
                    "branch the prediction does not follow): not compared" if self.internal else "")]
        for c in self.checks:
            if not c.agrees:
                what = f"predicted {c.predicted}" if c.layer else "no predicted layer"
                lines.append(f"  differs  {c.kernel}: {what}, compiled on {c.compiled}")
        return "\n".join(lines)


def kernel_agreement(sim: SimReport, engine: EngineReport) -> KernelAgreement:
    """Match each compute kernel of a compiler listing (layers with a qdqgraph kind) to the predicted
    layer holding the ONNX node it is named after (fused attention: the nodes of its metadata)."""
    owner = {n: x for x in sim.layers if not x.reformat and x.kind in _SIM_COMPUTE
             for n in x.nodes}
    out = KernelAgreement()
    for el in engine.layers:
        if el.kind not in _COMPUTE or not el.inputs:
            continue
        names = el.nodes if el.kind == "attention" else el.tokens
        if not any(n in sim.node_names for n in [*names, *el.nodes]):
            out.internal.append(el.name)   # an op's own GEMMs (an LSTM's unrolled steps), an If branch not followed
            continue
        sl = next((owner[n] for n in names if n in owner), None)
        # a fused attention kernel takes Q, K, V and masks in no fixed order: its quantized inputs tell
        ports = [q for _, q in el.inputs]
        compiled = (next((q for q in ports if q in _QUANTIZED), ports[0]) if el.kind == "attention"
                    else ports[0]) or "?"
        weights = next((p for _, p in el.constants if p in _QUANTIZED), "")
        predicted = _class(sl.inputs[0].precision) if sl is not None and sl.inputs else "?"
        out.checks.append(KernelCheck(el.name, sl.name if sl is not None else "", predicted, compiled, weights or ""))
    return out


def standalone_kernels(sim: SimReport, engine: EngineReport) -> list[EngineLayer]:
    """The compiled engine's kernels that only quantize or dequantize: a generated kernel of scaling,
    rounding and casts (EngineLayer.qdq_reformat) none of whose ONNX nodes is pointwise math (a
    kernel named Mul...Roun may be a squeeze-excite gate that rounds as it writes; a Cast is no math:
    ViT-S's input Casts and their Q compile as one __myl_CastMulMinMaxRounCastConc). A convolution or
    GEMM named in its metadata is the consumer it lays the data out for, computed in its own kernel."""
    vocab = vocabulary()
    op_of = {n: op for x in sim.layers for n, op in zip(x.nodes, x.ops)}
    moves = ("quantize", "dequantize", "copy", "cast", "weighted")
    return [e for e in engine.reformats
            if not any(n in op_of and not any(vocab.is_(op_of[n], c) for c in moves) for n in e.nodes)]
