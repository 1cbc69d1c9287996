#!/usr/bin/env python3
"""Fit the latency estimate's three global constants on measured engines, and check the fit.

    .venv/bin/python benchmarks/fit_estimate.py [--oracles DIR] [--write]

The engines are those of rules/gpus.toml [fit.engines]: NVIDIA's published TensorRT engines in
../shared/oracles with a layer JSON (`*.graph.json`) and a measured per-layer profile (`*.profile.json`).
Each layer with a kernel and a measured time gives (bytes / bandwidth, flops / peak, measured ms);
the constants (fraction of the bandwidth reached, fraction of the peak math reached, launch cost per
kernel in microseconds) minimize the mean over engines of the mean squared log ratio estimate /
measured over that engine's layers, so every engine weighs the same and a layer 2x too slow costs as
much as one 2x too fast. The search is a grid, refined three times around the best point (no
randomness, the same answer on every run).

Printed: the fitted constants, per engine the estimated and measured totals and the error, then the
same with each engine held out of the fit (leave-one-engine-out) and with each GPU held out
(leave-one-GPU-out: the MobileNetV2 engines are two builds of the same two models on one GPU, so a
held-out engine still has its twin in the fit). `--write` rewrites the constants in rules/gpus.toml.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qdqgraph.trtsim import estimate as E  # noqa: E402
from qdqgraph.testing.oracles import folder_or_exit  # noqa: E402

TOML = Path(__file__).resolve().parents[1] / "rules" / "gpus.toml"


def engine_arrays(folder: Path) -> dict[str, dict]:
    """Per engine: its GPU, and per layer with a kernel the ideal memory time, ideal math time (ms, at
    100 % of the spec) and the measured time (NaN where the profile has none)."""
    out = {}
    for name, gpu_name in E.fitted_engines().items():
        g = E.gpu(gpu_name)
        layers = E.read_layers(folder / f"{name}.graph.json")
        profile = E.read_profile(folder / f"{name}.profile.json")
        rows = []
        for layer in layers:
            w = E.layer_work(layer)
            if w.kind == "none" or (w.bytes <= 0 and w.flops <= 0):
                continue
            memory = w.bytes / (g.bandwidth_gbs * 1e9) * 1e3
            math = w.flops / (g.peak(w.precision) * 1e12) * 1e3 if w.flops else 0.0
            rows.append((memory, math, profile.get(w.name, np.nan)))
        out[name] = {"gpu": gpu_name, "a": np.array(rows), "measured": sum(profile.values())}
    return out


def _estimates(a: np.ndarray, fb, fm, lu) -> np.ndarray:
    """Per-layer estimates (ms) for arrays of constants (broadcast over a leading grid axis)."""
    fb, fm, lu = (np.asarray(x, float)[..., None] for x in (fb, fm, lu))
    return np.maximum(a[:, 0] / fb, a[:, 1] / fm) + lu * 1e-3


def loss(data: dict, names: list[str], fb, fm, lu) -> np.ndarray:
    total = 0.0
    for n in names:
        a = data[n]["a"]
        timed = a[:, 2] > 0
        est = _estimates(a[timed], fb, fm, lu)
        total = total + np.mean(np.log(est / a[timed, 2]) ** 2, axis=-1)
    return total / len(names)


def fit(data: dict, names: list[str]) -> E.Constants:
    lo = np.array([0.05, 0.05, 0.0])
    hi = np.array([1.0, 1.0, 20.0])
    steps = 41
    best = None
    for _ in range(4):
        axes = [np.linspace(lo[i], hi[i], steps) for i in range(3)]
        fb, fm, lu = (x.ravel() for x in np.meshgrid(*axes, indexing="ij"))
        k = int(np.argmin(loss(data, names, fb, fm, lu)))
        best = np.array([fb[k], fm[k], lu[k]])
        span = (hi - lo) / (steps - 1) * 4
        lo = np.maximum(best - span, [0.01, 0.01, 0.0])
        hi = np.minimum(best + span, [1.0, 1.0, 50.0])
    return E.Constants(round(float(best[0]), 3), round(float(best[1]), 3), round(float(best[2]), 2))


def total(data: dict, name: str, c: E.Constants) -> float:
    return float(np.sum(_estimates(data[name]["a"], c.bandwidth_fraction, c.math_fraction, c.launch_us)))


def _table(header, rows) -> str:
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    lines = ["| " + " | ".join(str(h).ljust(w) for h, w in zip(header, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    return "\n".join(lines)


def _write(c: E.Constants) -> None:
    text = TOML.read_text(encoding="utf-8")
    for key, value in (("bandwidth_fraction", c.bandwidth_fraction), ("math_fraction", c.math_fraction),
                       ("launch_us", c.launch_us)):
        text, n = re.subn(rf"(?m)^{key} = .*$", f"{key} = {value}", text, count=1)
        assert n == 1, key
    TOML.write_text(text, encoding="utf-8")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--oracles", type=Path, default=None, help="oracles folder (default ../shared/oracles)")
    ap.add_argument("--write", action="store_true", help="write the fitted constants into rules/gpus.toml")
    args = ap.parse_args(argv)
    folder = folder_or_exit(args.oracles)
    if folder is None:
        return 2
    data = engine_arrays(Path(folder))
    names = list(data)
    c = fit(data, names)
    print(f"fitted on {len(names)} engines, {sum(int((d['a'][:, 2] > 0).sum()) for d in data.values())} timed layers: "
          f"bandwidth_fraction = {c.bandwidth_fraction}, math_fraction = {c.math_fraction}, launch_us = {c.launch_us}")
    committed = E.fitted()
    if committed != c:
        print(f"(rules/gpus.toml holds {committed}; rerun with --write to store the new fit)")

    by_gpu: dict[str, list[str]] = {}
    for n in names:
        by_gpu.setdefault(data[n]["gpu"], []).append(n)
    held_engine = {n: fit(data, [m for m in names if m != n]) for n in names}
    held_gpu = {}
    for g, members in by_gpu.items():
        cg = fit(data, [m for m in names if m not in members])
        held_gpu.update({n: cg for n in members})

    rows = []
    for n in names:
        meas = data[n]["measured"]
        est, loo, log = total(data, n, c), total(data, n, held_engine[n]), total(data, n, held_gpu[n])
        rows.append((n.split("/")[-1], data[n]["gpu"], f"{meas:.3f}", f"{est:.3f}", f"{100 * (est / meas - 1):+.1f} %",
                     f"{loo:.3f} ({100 * (loo / meas - 1):+.1f} %)", f"{log:.3f} ({100 * (log / meas - 1):+.1f} %)"))
    print(_table(("engine", "GPU", "measured ms", "estimated ms", "error", "held-out engine", "held-out GPU"), rows))
    worst = max(abs(total(data, n, c) / data[n]["measured"] - 1) for n in names)
    worst_loo = max(abs(total(data, n, held_engine[n]) / data[n]["measured"] - 1) for n in names)
    worst_log = max(abs(total(data, n, held_gpu[n]) / data[n]["measured"] - 1) for n in names)
    print(f"largest error: {100 * worst:.1f} % (fit on all), {100 * worst_loo:.1f} % (engine held out), "
          f"{100 * worst_log:.1f} % (GPU held out)")
    for g, members in by_gpu.items():
        cg = held_gpu[members[0]]
        print(f"  without {g}: bandwidth_fraction = {cg.bandwidth_fraction}, math_fraction = {cg.math_fraction}, "
              f"launch_us = {cg.launch_us}")
    if args.write:
        _write(c)
        print(f"wrote the constants into {TOML}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
