"""Fuzz `insert` and `report` for a fixed time on random graphs (tests/fuzzgraphs.py) and print
examples tried, crashes, broken outputs and outputs lost; failing examples are saved for replay.

    .venv/bin/python benchmarks/fuzz.py --minutes 10 [--seed 0] [--out /tmp/qdqgraph-fuzz]

Per example: the Python API (insert with the default FP16 islands; a crash is anything but a
QdqError), the ONNX checker (full), the Q/DQ invariants (tests/fuzzgraphs.invariant_problems),
onnxruntime, the simulator and linter; every 4th example also through the CLI (exit 0 or 2 only,
input bytes unchanged, an output exactly when exit 0, no temporary file left: otherwise an output
is "lost"); every 3rd also strip(insert) == clean, every 10th insert twice gives identical bytes.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import io as stdio
import json
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import numpy as np  # noqa: E402
import onnx  # noqa: E402

import fuzzgraphs  # noqa: E402
import qdqgraph  # noqa: E402
from qdqgraph.graph import io
from qdqgraph import trtsim
from qdqgraph.cli import main as cli  # noqa: E402
from qdqgraph.errors import QdqError  # noqa: E402
from qdqgraph.passes.strip import strip_qdq  # noqa: E402
from qdqgraph.prepare import clean  # noqa: E402
from qdqgraph.testing.render import render  # noqa: E402


def one(model, data, k: int, work: Path) -> tuple[str, str]:
    """('ok' | 'refused' | failure kind, detail)."""
    feed = {n: v[0] for n, v in data.items()}
    try:
        result = qdqgraph.quantize(model, data)
    except QdqError as e:
        return "refused", str(e)
    out = result.model
    try:
        onnx.checker.check_model(out, full_check=True)
    except Exception as e:  # noqa: BLE001
        return "checker", str(e).splitlines()[0]
    problems = fuzzgraphs.invariant_problems(out)
    if problems:
        return "invariant", "; ".join(problems[:3])
    try:
        fuzzgraphs.run_ort(out, feed)
    except Exception as e:  # noqa: BLE001
        return "onnxruntime", str(e).splitlines()[0]
    g = io.load(out).graph
    trtsim.simulate(g)
    trtsim.lint(g)
    if k % 4 == 0:
        src, npz, dst = work / "m.onnx", work / "d.npz", work / "m.qdq.onnx"
        onnx.save(model, src)
        np.savez(npz, **data)
        before = hashlib.sha256(src.read_bytes()).hexdigest()
        with contextlib.redirect_stdout(stdio.StringIO()), contextlib.redirect_stderr(stdio.StringIO()) as err:
            code = cli(["insert", str(src), "--calib", str(npz), "-o", str(dst), "--verify", "0", "--quiet"])
        if code not in (0, 2):
            return "cli-exit", f"exit {code}: {err.getvalue().strip()[:200]}"
        leftovers = [p.name for p in work.iterdir() if p.name.startswith(".")]
        if hashlib.sha256(src.read_bytes()).hexdigest() != before or dst.exists() != (code == 0) or leftovers:
            return "lost", f"exit {code}, output exists {dst.exists()}, leftovers {leftovers}"
        if code == 0:
            with contextlib.redirect_stdout(stdio.StringIO()):
                if cli(["report", str(dst), "--quiet"]) != 0:
                    return "cli-report", "report failed"
        for p in work.iterdir():
            p.unlink()
    if k % 3 == 0:
        expected = io.load(model)
        clean(expected)
        q = io.load(qdqgraph.quantize(model, data, weights="qdq", high_precision="fp32").model)
        strip_qdq(q.graph)
        if sorted(render(q.graph).splitlines()) != sorted(render(expected.graph).splitlines()):
            return "strip", "strip(insert(m)) differs from clean(m)"
    if k % 10 == 0 and qdqgraph.quantize(model, data).model.SerializeToString() != out.SerializeToString():
        return "nondeterministic", "two inserts differ"
    return "ok", ""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "qdqgraph-fuzz")
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    stop = time.monotonic() + 60 * args.minutes
    counts: Counter = Counter()
    ops: Counter = Counter()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as w:
        work = Path(w)
        k = 0
        while time.monotonic() < stop:
            steps = [str(s) for s in rng.choice(fuzzgraphs.STEPS, size=int(rng.integers(1, 13)))]
            seed, dynamic = int(rng.integers(1 << 30)), bool(rng.integers(2))
            ops.update(steps)
            try:
                model = fuzzgraphs.random_model(steps, seed, dynamic)
                data = fuzzgraphs.sample_data(model, seed=seed)
                kind, detail = one(model, data, k, work)
            except Exception as e:  # noqa: BLE001 - a crash: exactly what we are looking for
                kind, detail = "crash", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
            counts[kind] += 1
            if kind not in ("ok", "refused"):
                (args.out / f"fail-{k}.json").write_text(json.dumps(
                    {"steps": steps, "seed": seed, "dynamic": dynamic, "kind": kind, "detail": detail}, indent=1))
                print(f"example {k}: {kind}: {detail.splitlines()[0][:200]}", flush=True)
            k += 1
    failures = sum(v for kind, v in counts.items() if kind not in ("ok", "refused", "lost"))
    print(f"\nfuzz: {args.minutes:g} min, seed {args.seed}: {k} examples tried, {counts['ok']} quantized, "
          f"{counts['refused']} refused with a clear error, {failures} failures "
          f"({', '.join(f'{n} {kind}' for kind, n in counts.items() if kind not in ('ok', 'refused', 'lost')) or 'none'}), "
          f"{counts['lost']} outputs lost")
    print("steps drawn: " + ", ".join(f"{s} {n}" for s, n in sorted(ops.items())))
    if failures or counts["lost"]:
        print(f"failing examples: {args.out} (replay: fuzzgraphs.random_model(steps, seed, dynamic))")
    return 1 if failures or counts["lost"] else 0


if __name__ == "__main__":
    sys.exit(main())
