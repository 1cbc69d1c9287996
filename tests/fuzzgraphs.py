"""Random valid float ONNX graphs over qdqgraph's op vocabulary, for fuzzing `insert` and `report`.

`random_model(steps, seed)` grows a DAG from one image input by applying `steps` (names of STEPS) to
tensors picked by a seeded generator: weighted ops (Conv with or without bias, grouped/depthwise,
followed by BatchNormalization; ConvTranspose; Gemm with transB; MatMul with a constant), pointwise
activations, residual Adds, SE-block Muls, pooling, Concat, Reshape/Transpose/Flatten, Softmax, and
integer paths (Shape -> Gather -> Concat -> Reshape, ArgMax -> Cast, a bool mask into Where, a one-hot
into a MatMul), Identity/Dropout no-ops, a nearest Resize read by a strided conv, and an If between
two convs with a constant or data-dependent condition. The
batch dim is dynamic in some graphs. Shapes stay small so that one example runs in well under a
second. `models()` is the hypothesis strategy; benchmarks/fuzz.py draws from the same generator.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

STEPS = ("conv", "conv_bn", "depthwise", "convtranspose", "relu", "sigmoid", "add", "se", "maxpool", "avgpool",
         "concat", "transpose", "gap_gemm", "matmul", "softmax", "reshape_int_path", "argmax_cast", "where_mask",
         "leaky", "noop", "resize_conv", "onehot_matmul", "if_branch")


@dataclass
class _Builder:
    rng: np.random.Generator
    dynamic: bool
    nodes: list = field(default_factory=list)
    inits: list = field(default_factory=list)
    images: list = field(default_factory=list)     # (name, channels) of [n, C, 8, 8] tensors
    flats: list = field(default_factory=list)      # (name, features) of [n, F] tensors
    count: int = 0

    def name(self, stem: str) -> str:
        self.count += 1
        return f"{stem}_{self.count}"

    def const(self, stem: str, value: np.ndarray) -> str:
        n = self.name(stem)
        self.inits.append(numpy_helper.from_array(np.asarray(value), n))
        return n

    def node(self, op: str, inputs: list[str], stem: str | None = None, **attrs) -> str:
        out = self.name((stem or op.lower()) + "_out")
        self.nodes.append(helper.make_node(op, inputs, [out], name=self.name(stem or op.lower()), **attrs))
        return out

    def pick(self, pool):
        return pool[int(self.rng.integers(len(pool)))]

    def weight(self, *shape) -> str:
        fan_in = int(np.prod(shape[1:])) or 1
        return self.const("w", (self.rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32))

    # ---------------------------------------------------------------- steps

    def conv(self, depthwise=False, bn=False, bias=None):
        x, c = self.pick(self.images)
        cout = c if depthwise else int(self.rng.choice([4, 8, 12]))
        group = c if depthwise else 1
        inputs = [x, self.weight(cout, c // group, 3, 3)]
        if bias if bias is not None else self.rng.random() < 0.7:
            inputs.append(self.const("b", self.rng.standard_normal(cout).astype(np.float32) * 0.1))
        y = self.node("Conv", inputs, "conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1], group=group)
        if bn:
            params = [self.const("g", (1 + 0.1 * self.rng.standard_normal(cout)).astype(np.float32)),
                      self.const("be", (0.1 * self.rng.standard_normal(cout)).astype(np.float32)),
                      self.const("m", (0.1 * self.rng.standard_normal(cout)).astype(np.float32)),
                      self.const("v", (1 + self.rng.random(cout)).astype(np.float32))]
            y = self.node("BatchNormalization", [y, *params], "bn")
        self.images.append((y, cout))

    def convtranspose(self):
        x, c = self.pick(self.images)
        cout = int(self.rng.choice([4, 8]))
        y = self.node("ConvTranspose", [x, self.weight(c, cout, 3, 3)], "deconv", kernel_shape=[3, 3],
                      pads=[1, 1, 1, 1])
        self.images.append((y, cout))

    def act(self, op, **attrs):
        pool = self.images + self.flats
        x, c = self.pick(pool)
        y = self.node(op, [x], op.lower(), **attrs)
        (self.images if (x, c) in self.images else self.flats).append((y, c))

    def add(self):
        x, c = self.pick(self.images)
        same = [t for t in self.images if t[1] == c and t[0] != x]
        if not same:
            self.conv(bias=True)
            return
        y, _ = self.pick(same)
        self.images.append((self.node("Add", [x, y], "add"), c))

    def se(self):
        x, c = self.pick(self.images)
        g = self.node("GlobalAveragePool", [x], "se_gap")
        r = self.node("Relu", [self.node("Conv", [g, self.weight(4, c, 1, 1)], "se_reduce", kernel_shape=[1, 1])])
        gate = self.node("Sigmoid", [self.node("Conv", [r, self.weight(c, 4, 1, 1)], "se_expand", kernel_shape=[1, 1])])
        self.images.append((self.node("Mul", [x, gate], "se_mul"), c))

    def pool(self, op):
        x, c = self.pick(self.images)
        self.images.append((self.node(op, [x], op.lower(), kernel_shape=[3, 3], pads=[1, 1, 1, 1]), c))

    def concat(self):
        (a, ca), (b, cb) = self.pick(self.images), self.pick(self.images)
        self.images.append((self.node("Concat", [a, b], "concat", axis=1), ca + cb))

    def transpose(self):
        x, c = self.pick(self.images)
        self.images.append((self.node("Transpose", [x], "transpose", perm=[0, 1, 3, 2]), c))

    def gap_gemm(self):
        x, c = self.pick(self.images)
        f = self.node("Flatten", [self.node("GlobalAveragePool", [x], "gap")], "flatten")
        out = int(self.rng.choice([5, 10]))
        inputs = [f, self.weight(out, c)]
        if self.rng.random() < 0.7:
            inputs.append(self.const("gb", np.zeros(out, np.float32)))
        self.flats.append((self.node("Gemm", inputs, "gemm", transB=1), out))

    def matmul(self):
        if not self.flats:
            self.gap_gemm()
        x, f = self.pick(self.flats)
        out = int(self.rng.choice([6, 12]))
        w = self.const("mw", (self.rng.standard_normal((f, out)) / np.sqrt(f)).astype(np.float32))
        self.flats.append((self.node("MatMul", [x, w], "matmul"), out))

    def softmax(self):
        if not self.flats:
            self.gap_gemm()
        x, f = self.pick(self.flats)
        self.flats.append((self.node("Softmax", [x], "softmax", axis=-1), f))

    def reshape_int_path(self):
        x, c = self.pick(self.images)
        batch = self.node("Gather", [self.node("Shape", [x], "shape"), self.const("i0", np.array([0], np.int64))],
                          "batch", axis=0)
        shape = self.node("Concat", [batch, self.const("m1", np.array([-1], np.int64))], "shape_cat", axis=0)
        self.flats.append((self.node("Reshape", [x, shape], "reshape"), c * 64))

    def argmax_cast(self):
        if not self.flats:
            self.gap_gemm()
        x, f = self.pick(self.flats)
        idx = self.node("Cast", [self.node("ArgMax", [x], "argmax", axis=1, keepdims=1)], "idx_float",
                        to=TensorProto.FLOAT)
        self.flats.append((self.node("Add", [x, idx], "add_idx"), f))

    def where_mask(self):
        pool = self.images + self.flats
        x, c = self.pick(pool)
        mask = self.node("Greater", [x, self.const("zero", np.array(0, np.float32))], "mask")
        y = self.node("Where", [mask, x, self.const("fill", np.array(0, np.float32))], "where")
        (self.images if (x, c) in self.images else self.flats).append((y, c))

    def noop(self):
        pool = self.images + self.flats
        x, c = self.pick(pool)
        op = "Identity" if self.rng.random() < 0.5 else "Dropout"
        y = self.node(op, [x], op.lower())
        (self.images if (x, c) in self.images else self.flats).append((y, c))

    def resize_conv(self):
        x, c = self.pick(self.images)
        up = self.node("Resize", [x, "", self.const("sc", np.array([1, 1, 2, 2], np.float32))], "resize",
                       mode="nearest")
        cout = int(self.rng.choice([4, 8]))
        y = self.node("Conv", [up, self.weight(cout, c, 3, 3)], "down", kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                      strides=[2, 2])
        self.images.append((y, cout))

    def onehot_matmul(self):
        if not self.flats:
            self.gap_gemm()
        x, f = self.pick(self.flats)
        idx = self.node("ArgMax", [x], "oh_argmax", axis=1, keepdims=1)
        hot = self.node("Cast", [self.node("Equal", [idx, self.const("vocab", np.arange(f, dtype=np.int64))], "oh_eq")],
                        "onehot", to=TensorProto.FLOAT)
        out = int(self.rng.choice([6, 12]))
        w = self.const("ow", (self.rng.standard_normal((f, out)) / np.sqrt(f)).astype(np.float32))
        self.flats.append((self.node("MatMul", [hot, w], "oh_matmul"), out))

    def if_branch(self):
        """An If choosing between two convs of the same tensor, read by name inside the bodies; its
        condition is a constant (exporters leave those; qdqgraph inlines them) or data-dependent."""
        x, c = self.pick(self.images)
        cout = int(self.rng.choice([4, 8, 16]))
        if self.rng.random() < 0.5:
            flag = bool(self.rng.random() < 0.5)
            cond = self.node("Equal", [self.const("ca", np.array(1, np.int64)),
                                       self.const("cb", np.array(1 if flag else 2, np.int64))], "if_cond")
        else:
            mean = self.node("ReduceMean", [x], "if_mean", keepdims=0)
            cond = self.node("Greater", [mean, self.const("thr", np.array(0, np.float32))], "if_cond")

        def body(stem: str, act: bool) -> onnx.GraphProto:
            w = numpy_helper.from_array((self.rng.standard_normal((cout, c, 3, 3)) / np.sqrt(9 * c)).astype(np.float32),
                                        self.name(f"{stem}_w"))
            conv_out, out = self.name(f"{stem}_conv_out"), self.name(f"{stem}_out")
            nodes = [helper.make_node("Conv", [x, w.name], [conv_out], name=self.name(f"{stem}_conv"),
                                      kernel_shape=[3, 3], pads=[1, 1, 1, 1])]
            nodes.append(helper.make_node("Relu" if act else "Identity", [conv_out], [out], name=self.name(f"{stem}_act")))
            return helper.make_graph(nodes, stem, [], [helper.make_tensor_value_info(out, TensorProto.FLOAT, None)], [w])

        y = self.name("if_out")
        self.nodes.append(helper.make_node("If", [cond], [y], name=self.name("if"),
                                           then_branch=body("then", True), else_branch=body("else", False)))
        self.images.append((y, cout))

    def apply(self, step: str):
        dispatch = {
            "conv": lambda: self.conv(), "conv_bn": lambda: self.conv(bn=True), "depthwise": lambda: self.conv(depthwise=True),
            "convtranspose": self.convtranspose, "relu": lambda: self.act("Relu"), "sigmoid": lambda: self.act("Sigmoid"),
            "leaky": lambda: self.act("LeakyRelu", alpha=0.1), "add": self.add, "se": self.se,
            "maxpool": lambda: self.pool("MaxPool"), "avgpool": lambda: self.pool("AveragePool"),
            "concat": self.concat, "transpose": self.transpose, "gap_gemm": self.gap_gemm, "matmul": self.matmul,
            "softmax": self.softmax, "reshape_int_path": self.reshape_int_path, "argmax_cast": self.argmax_cast,
            "where_mask": self.where_mask, "noop": self.noop, "resize_conv": self.resize_conv,
            "onehot_matmul": self.onehot_matmul, "if_branch": self.if_branch,
        }
        dispatch[step]()


def random_model(steps: list[str], seed: int, dynamic: bool = True, opset: int = 17) -> onnx.ModelProto:
    b = _Builder(np.random.default_rng(seed), dynamic)
    channels = int(b.rng.choice([3, 4, 8]))
    batch = "n" if dynamic else 1
    b.images.append(("x", channels))
    for s in steps:
        b.apply(s)
    produced = [t for t, _ in b.images + b.flats if t != "x"]
    consumed = {i for n in b.nodes for i in n.input}
    outs = [t for t in produced if t not in consumed][-2:] or produced[-1:]
    if not outs:                                 # no step: one conv so that the graph is not empty
        b.conv()
        outs = [b.images[-1][0]]
    graph = helper.make_graph(
        b.nodes, "fuzz", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, channels, 8, 8])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs], b.inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return onnx.shape_inference.infer_shapes(model)


def sample_data(model: onnx.ModelProto, n: int = 4, seed: int = 0) -> dict[str, np.ndarray]:
    c = model.graph.input[0].type.tensor_type.shape.dim[1].dim_value
    return {"x": np.random.default_rng(seed).standard_normal((n, 1, c, 8, 8)).astype(np.float32)}


def models():
    """Hypothesis strategy: (model, steps, seed)."""
    from hypothesis import strategies as st
    return st.tuples(st.lists(st.sampled_from(STEPS), min_size=1, max_size=10),
                     st.integers(0, 2**16), st.booleans()).map(
        lambda t: (random_model(t[0], t[1], t[2]), t[0], t[1]))


# ---------------------------------------------------------------- the properties checked on every example

INT_TYPES = {TensorProto.INT8, TensorProto.UINT8, TensorProto.INT16, TensorProto.INT32, TensorProto.INT64,
             TensorProto.BOOL, TensorProto.UINT16, TensorProto.UINT32, TensorProto.UINT64}


def invariant_problems(model: onnx.ModelProto) -> list[str]:
    """Q/DQ invariants checked without qdqgraph's own checker: zero points int8 0, scales finite and
    > 0, axis on per-channel scales, no Q/DQ on integer tensors, no quantized bias."""
    problems = []
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    types = {v.name: v.type.tensor_type.elem_type
             for v in list(onnx.shape_inference.infer_shapes(model).graph.value_info) + list(model.graph.input)}
    types.update({i.name: i.data_type for i in model.graph.initializer})
    producer = {o: n for n in model.graph.node for o in n.output}
    for n in model.graph.node:
        if n.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            continue
        scale, zp = inits.get(n.input[1]), inits.get(n.input[2]) if len(n.input) > 2 else None
        if scale is None:
            problems.append(f"{n.name}: scale is not an initializer")
            continue
        s = scale.astype(np.float64)
        if not (np.all(np.isfinite(s)) and np.all(s > 0)):
            problems.append(f"{n.name}: scale not finite and > 0")
        if zp is not None and (zp.dtype != np.int8 or np.any(zp != 0)):
            problems.append(f"{n.name}: zero point {zp.dtype} not all 0")
        if s.size > 1 and not any(a.name == "axis" for a in n.attribute):
            problems.append(f"{n.name}: per-channel scale without axis")
        quantized_input = n.input[0] if n.op_type == "QuantizeLinear" else None
        if quantized_input and types.get(quantized_input) in INT_TYPES:
            problems.append(f"{n.name}: quantizes integer tensor {quantized_input}")
    for n in model.graph.node:
        if n.op_type in ("Conv", "ConvTranspose", "Gemm") and len(n.input) > 2 and n.input[2]:
            p = producer.get(n.input[2])
            if p is not None and p.op_type == "DequantizeLinear":
                problems.append(f"{n.name}: bias is quantized")
    return problems


def run_ort(model: onnx.ModelProto, feed: dict) -> list[np.ndarray]:
    from qdqgraph.execution.runtime import session
    return session(model, purpose="fuzzing").run(None, feed)
