"""Every model the test suite wrote passes the full ONNX checker and builds with TensorRT for RTX.

    QDQGRAPH_COLLECT_WRITTEN=/tmp/written python -m pytest -q     # tests/collect_written.py collects
    python .ci/check_written.py /tmp/written [--jobs 2] [--json out.json]

Each distinct model (by content) is checked with `onnx.checker.check_model(full_check=True)` and
built with qdqgraph's TensorRT for RTX backend (strongly typed, the builder's default targets, or
the ones its quantized formats need), dynamic inputs profiled from qdqgraph's random samples of the
model's inputs (the shapes `insert --calib random` uses). No engine is run: there is no GPU here.

Models not meant for a compiler are listed below, each with its reason: by kind (EXPECTED_KINDS, a
property of the model) or by the test that wrote them (EXPECTED_TESTS; a model written by several
tests is expected to fail only if every one of them says so). Exit 1 lists every other model that fails (and the tests that wrote it); an
expected failure that now passes is reported too, so the list does not outlive its reason.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

# (test id pattern, reason): models these tests write are not expected to build (or to pass the
# checker); re.search on the pytest node id that wrote the model
EXPECTED_TESTS: list[tuple[str, str]] = [
    (r"test_engines\.py::test_every_output_builds.*\[silero_vad_op15-",
     "silero_vad_op15: this check builds with one profile made from random samples, where the model's state "
     "comes out 0 long ('Reshaping [1,128,0] to [1,128]'); tests/test_engines.py builds its quantized outputs on "
     "the calibration data's shapes, and they build there; the float model builds nowhere (its COMPILER_FAILS)"),
]


def _engine_graph(model) -> bool:
    return any(n.domain == "qdqgraph.trtsim" for n in model.graph.node)


# (what, model -> bool, reason): models of a kind that is not meant for a compiler
EXPECTED_KINDS = [
    ("report --graph's layer graph", _engine_graph,
     "`report --graph` writes the predicted engine as a graph of qdqgraph.trtsim layers, for viewers such as "
     "Netron; it is a picture of the engine, not a model to compile"),
]


def _expected(tests: list[str], kind: str | None) -> str | None:
    if kind is not None:
        return kind
    reasons = []
    for t in tests:
        why = next((reason for pattern, reason in EXPECTED_TESTS if re.search(pattern, t)), None)
        if why is None:
            return None
        reasons.append(why)
    return reasons[0]


def check_one(path: str) -> dict:
    """The checker and a TensorRT for RTX build of one model: {"checker", "build"} (None: passed,
    else the first line of why not), with the seconds each took."""
    import logging
    import warnings

    import onnx
    import onnx_graphsurgeon as gs

    from qdqgraph.graph import io
    from qdqgraph.backends import BuildOptions, tensorrt_rtx
    from qdqgraph.backends.profiles import profiles
    from qdqgraph.config import QuantizeConfig
    from qdqgraph.errors import QdqError
    from qdqgraph.prepare import model_inputs, read_data
    from qdqgraph.trtsim import simulate
    from qdqgraph.cli.build import comparison

    warnings.simplefilter("ignore")          # "calibrated on random data": the samples only give shapes
    gs.logger.G_LOGGER.severity = logging.ERROR
    out: dict = {"path": path, "checker": None, "build": None, "kind": None}
    head = onnx.load(path, load_external_data=False)
    out["kind"] = next((reason for _, test, reason in EXPECTED_KINDS if test(head)), None)
    t0 = time.perf_counter()
    try:
        onnx.checker.check_model(path, full_check=True)
    except Exception as e:                    # noqa: BLE001 - every checker failure is a finding
        out["checker"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
    out["checker_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    try:
        loaded = io.load(path)
        data = read_data(loaded, "random", QuantizeConfig(samples=1))
        sim = simulate(loaded.graph, target=tensorrt_rtx.NAME)
        with tempfile.TemporaryDirectory() as d:
            built = tensorrt_rtx.build(path, Path(d) / "m.engine",
                                       BuildOptions(profiles=profiles(model_inputs(loaded.graph), data),
                                                    formats=sim.formats))
        if built.engine is not None:        # the prediction against the compiled kernels, as `build` prints it
            check = comparison(sim, built.engine)[1]
            kernels, quantize = check.get("summary", {}), check.get("reformats")
            if "compute_kernels" in kernels and quantize is not None:
                out["prediction"] = {"compute_kernels": kernels["compute_kernels"], "as_predicted": kernels["agree"],
                                     "standalone_quantize": quantize}
    except QdqError as e:
        out["build"] = e.problem[:400]
    except Exception as e:                    # noqa: BLE001 - an internal error is a finding too
        out["build"] = f"internal error {type(e).__name__}: {str(e)[:300]}"
    out["build_s"] = time.perf_counter() - t0
    return out


def prediction_line(results: list[dict]) -> str:
    """The simulator's prediction against the compiled engines (a figure, not a pass/fail): compute
    kernels as predicted, and the models whose standalone quantize kernels it counted right."""
    found = [r["prediction"] for r in results if r.get("prediction")]
    if not found:
        return "prediction: no engine listed its kernels"
    kernels = sum(p["compute_kernels"] for p in found)
    agree = sum(p["as_predicted"] for p in found)
    counted = sum(1 for p in found if p["standalone_quantize"]["predicted"] == p["standalone_quantize"]["compiled"])
    return (f"prediction against TensorRT for RTX: compute kernels {agree}/{kernels} as predicted in {len(found)} "
            f"engines; standalone quantize kernels counted right in {counted} of them")


def _short(path: str, folder: Path) -> str:
    return str(Path(path).relative_to(folder))[:12]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder", type=Path, help="the QDQGRAPH_COLLECT_WRITTEN folder of a test run")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--json", type=Path, help="write every model's result here")
    args = p.parse_args(argv)
    manifest = args.folder / "manifest.jsonl"
    if not manifest.is_file():
        print(f"check_written: no {manifest}; run pytest with QDQGRAPH_COLLECT_WRITTEN={args.folder}", file=sys.stderr)
        return 2
    tests: dict[str, set[str]] = defaultdict(set)
    skipped: list[dict] = []
    writes = 0
    for line in manifest.read_text().splitlines():
        entry = json.loads(line)
        writes += 1
        if entry.get("skipped"):
            skipped.append(entry)
        else:
            tests[entry["model"]].add(entry["test"])
    print(f"{writes} models written by {len({t for ts in tests.values() for t in ts})} tests; "
          f"{len(tests)} distinct; checking on {args.jobs} processes")
    t0 = time.perf_counter()
    paths = [str(args.folder / m) for m in sorted(tests)]
    # a fresh process per few models: the compiler's memory is not all given back
    with multiprocessing.get_context("spawn").Pool(args.jobs, maxtasksperchild=20) as pool:
        results = list(pool.imap_unordered(check_one, paths, chunksize=1))
    wall = time.perf_counter() - t0
    failed, expected_failed, stale = [], [], []
    for r in sorted(results, key=lambda r: r["path"]):
        who = sorted(tests[str(Path(r["path"]).relative_to(args.folder))])
        r["tests"] = who
        why = _expected(who, r["kind"])
        bad = r["checker"] or r["build"]
        if bad and why:
            expected_failed.append((r, why))
        elif bad:
            failed.append(r)
        elif why:
            stale.append((r, why))
    build_s = sorted(r["build_s"] for r in results)
    print(f"checked {len(results)} models in {wall:.0f} s ({args.jobs} processes); build per model: median "
          f"{build_s[len(build_s) // 2]:.2f} s, max {build_s[-1]:.1f} s" if results else "no models")
    for r, why in expected_failed:
        print(f"expected: {_short(r['path'], args.folder)} ({r['tests'][0]}): {why}")
    for r, why in stale:
        print(f"NOTE: expected to fail but passes: {_short(r['path'], args.folder)} ({r['tests'][0]}): {why}")
    for e in skipped:
        print(f"not checked: {e['name']} ({e['test']}): {e['skipped']}")
    for r in failed:
        print(f"FAILED {_short(r['path'], args.folder)} written by {', '.join(r['tests'][:3])}"
              + (f" (+{len(r['tests']) - 3})" if len(r['tests']) > 3 else ""))
        if r["checker"]:
            print(f"    checker: {r['checker']}")
        if r["build"]:
            print(f"    build: {r['build']}")
    print(prediction_line(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    print(f"{len(results) - len(failed) - len(expected_failed)} passed, {len(failed)} failed, "
          f"{len(expected_failed)} expected failures")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
