"""Calibration and sensitivity on Ray (`--ray`) against one process, on ResNet-50.

    .venv/bin/python benchmarks/distributed.py [--model /tmp/qdqgraph-tv/models/resnet50.onnx]
        [--samples 2048] [--sensitivity-samples 8] [--workers 1 2] [--data /tmp/qdqgraph-ray-bench]

Data: a folder of .npz files of 32 samples each, the model's own calibration samples
(MODEL.calib.npz, 16 real images) repeated to `--samples`; written once, reused after. Each row is
one run, in this process, in this order: one process (no Ray), then a local Ray of each
`--workers` count (`ray.init(num_cpus=K)`, so K tasks at a time; qdqgraph uses the Ray this
process is connected to). Calibration: entropy, batch 1, `qdqgraph.calibrate` on the folder, wall
time from the call to its return (load, plan and the Ray shards included; the Ray start and stop
are the separate "Ray start"/"Ray stop" rows). Sensitivity: `qdqgraph.recipes.sensitivity.measure` of the
model quantized once, every unit both ways, on the first `--sensitivity-samples` samples. "fixed
cost" rows are the same calls on almost no work: calibration of 2 samples, sensitivity of 2 units
(the others left INT8) on 1 sample: what a run pays whatever the data, and on Ray the graph
shipped, the model loaded and a session built in every task. Every Ray result is checked equal,
bit for bit, to the one-process result; a difference fails the run.
"""
from __future__ import annotations

import argparse
import datetime
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

import qdqgraph  # noqa: E402
from qdqgraph.graph import io  # noqa: E402
from qdqgraph.samples.data import CalibrationData  # noqa: E402
from qdqgraph.prepare import model_inputs  # noqa: E402
from qdqgraph.recipes.sensitivity import measure  # noqa: E402

FILE_SAMPLES = 32


def make_folder(calib: Path, folder: Path, samples: int) -> Path:
    """`samples` samples in files of FILE_SAMPLES: the calibration samples repeated in order."""
    tag = folder / f"repeated-{calib.name}-{samples}.done"
    if tag.exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    for old in folder.glob("*.npz"):
        old.unlink()
    with np.load(calib) as z:
        arrays = {k: z[k] for k in z.files}
    n = len(next(iter(arrays.values())))
    for start in range(0, samples, FILE_SAMPLES):
        idx = [(start + i) % n for i in range(min(FILE_SAMPLES, samples - start))]
        np.savez(folder / f"part{start // FILE_SAMPLES:05d}.npz", **{k: a[idx] for k, a in arrays.items()})
    tag.write_text("")
    return folder


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def start_ray(workers: int) -> float:
    import ray
    _, seconds = timed(lambda: ray.init(address="local", num_cpus=workers, include_dashboard=False,
                                        logging_level=logging.ERROR, log_to_driver=False))
    return seconds


def stop_ray() -> float:
    import ray
    return timed(lambda: ray.shutdown(wait_for_processes=True))[1]


def same_units(a, b) -> bool:
    return (a.all_int8_db == b.all_int8_db and a.runs == b.runs
            and [asdict(u) for u in a.units] == [asdict(u) for u in b.units])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="/tmp/qdqgraph-tv/models/resnet50.onnx")
    ap.add_argument("--samples", type=int, default=2048, help="calibration samples")
    ap.add_argument("--sensitivity-samples", type=int, default=8)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="local Ray sizes (CPUs = tasks at once)")
    ap.add_argument("--data", default="/tmp/qdqgraph-ray-bench", help="folder for the repeated samples")
    args = ap.parse_args()
    model = Path(args.model)
    calib = model.with_name(model.name.removesuffix(".onnx") + ".calib.npz")
    if not model.exists() or not calib.exists():
        print(f"{model} or {calib} missing: run benchmarks/export_torchvision.py first")
        return 0
    folder = str(make_folder(calib, Path(args.data), args.samples))
    small = {k: v[:2] for k, v in np.load(calib).items()}
    load = [os.getloadavg()[0]]
    rows: list[tuple] = []          # (step, runner, seconds)

    def calibrate(data, ray=None):
        return qdqgraph.calibrate(str(model), data, method="entropy", ray=ray)

    # the model quantized once, for the sensitivity runs (its calibration is not timed)
    with np.load(calib) as z:
        arrays = {k: z[k] for k in z.files}
    quantized = qdqgraph.quantize(str(model), arrays, high_precision="fp32")
    cd = CalibrationData(arrays, model_inputs(io.load(str(model)).graph))

    reference = io.load(str(model))
    two = set(sorted(n for n, d in quantized.plan.decisions.items() if d.quantized)[:2])

    def sensitivity(samples, ray=None, only=None):
        return measure(quantized.model, quantized.plan, cd, samples=samples, ray=ray, only=only,
                       reference=reference if only else None)[0]

    one_cal, t = timed(lambda: calibrate(folder))
    rows.append((f"calibration, entropy, {args.samples} samples", "one process", t))
    one_small, t = timed(lambda: calibrate(small))
    rows.append(("calibration fixed cost (2 samples)", "one process", t))
    one_sens, t = timed(lambda: sensitivity(args.sensitivity_samples))
    units = len(one_sens.units)
    rows.append((f"sensitivity, {units} units x 2 runs, {one_sens.samples} sample(s)", "one process", t))
    one_sens1, t = timed(lambda: sensitivity(1, only=two))
    rows.append(("sensitivity fixed cost (2 units, 1 sample)", "one process", t))

    for k in args.workers:
        who = f"Ray, {k} worker{'s' if k > 1 else ''}"
        rows.append(("Ray start", who, start_ray(k)))
        try:
            cal, t = timed(lambda: calibrate(folder, "local"))
            rows.append((f"calibration, entropy, {args.samples} samples", who, t))
            assert cal.amax == one_cal.amax, "Ray calibration differs from one process"
            cal, t = timed(lambda: calibrate(small, "local"))
            rows.append(("calibration fixed cost (2 samples)", who, t))
            assert cal.amax == one_small.amax, "Ray calibration differs from one process"
            sens, t = timed(lambda: sensitivity(args.sensitivity_samples, "local"))
            rows.append((f"sensitivity, {units} units x 2 runs, {one_sens.samples} sample(s)", who, t))
            assert same_units(sens, one_sens), "Ray sensitivity differs from one process"
            sens, t = timed(lambda: sensitivity(1, "local", only=two))
            rows.append(("sensitivity fixed cost (2 units, 1 sample)", who, t))
            assert same_units(sens, one_sens1), "Ray sensitivity differs from one process"
        finally:
            rows.append(("Ray stop", who, stop_ray()))
        load.append(os.getloadavg()[0])

    base = {step: t for step, who, t in rows if who == "one process"}
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[1]).stdout.strip()
    print(f"{datetime.date.today()}, commit {commit}, {os.cpu_count()} cores, load average "
          f"{' -> '.join(f'{x:.2f}' for x in load)}; ResNet-50, {units} quantized units; "
          f"every Ray result equal to one process's, bit for bit")
    print()
    print("| step | runner | seconds | / one process |")
    print("|---|---|---|---|")
    for step, who, t in rows:
        ratio = f"{t / base[step]:.2f}" if step in base else "-"
        print(f"| {step} | {who} | {t:.1f} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
