#!/usr/bin/env python3
"""Accuracy of qdqgraph against onnxruntime's quantize_static on the model zoo.

    python benchmarks/zoo_accuracy.py [--zoo DIR] [--methods max,entropy,percentile,mse]
                                      [--only a,b] [--qdqgraph PATH] [--out DIR]

Needs a zoo made by benchmarks/setup_zoo.sh (ZOO/venv, ZOO/models, ZOO/data, ZOO/calib).
For every zoo model and every calibration method it

  1. quantizes with the qdqgraph CLI, timed (wall seconds):
       qdqgraph insert ZOO/models/NAME.onnx --calib ZOO/calib/NAME.npz
                -o OUT/qdqgraph-METHOD/NAME.onnx --method METHOD --force
     a model whose insert exits non-zero is left out of that method's evaluation, and the
     last line of its stderr goes into the table instead of a number;
  2. scores each OUT/qdqgraph-METHOD folder with the zoo's
       eval_models.py ZOO/models ZOO/data --compare OUT/qdqgraph-METHOD --json OUT/qdqgraph-METHOD.json
  3. builds and scores onnxruntime's baseline in the same run:
       eval_models.py ZOO/models ZOO/data --ort-qdq OUT/ort_qdq --json OUT/ort.json
  4. prints two markdown tables, filled only from the JSON that eval_models.py writes:
     the task metric of float / onnxruntime QDQ / qdqgraph-METHOD..., and the agreement with the
     float model's predictions plus the lowest output cosine (and its SNR) per model and tool.

eval_models.py runs in the zoo's own venv (ZOO/venv/bin/python); this script needs only the
standard library and runs with qdqgraph's venv python.

Held-out samples: calibration (ZOO/calib, and onnxruntime's baseline inside eval_models.py)
uses the even-indexed samples. eval_models.py has no option to choose samples: it always scores
all `n` samples recorded in each npz's __meta__, and its labels cannot simply be sliced (MiniLM's
labels index the source sentences, which an odd-only subset would drop). So every number here
is over ALL samples, half of which were calibration samples; the report says so under the table.
"""
import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("QDQGRAPH_SHARED", REPO.parent / "shared"))
DEFAULT_ZOO = Path(os.environ.get("QDQGRAPH_ZOO", "/tmp/qdqgraph-zoo"))
ORT = "onnxruntime QDQ"
PEERS = ("modelopt-fp8", "modelopt-int4-rtn", "modelopt-int4-awq", "ort-fp8", "ort-int4")   # benchmarks/peers_lowbit.py


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def default_qdqgraph():
    for p in (Path(sys.executable).parent / "qdqgraph", REPO / ".venv" / "bin" / "qdqgraph"):
        if p.exists():
            return str(p)
    return shutil.which("qdqgraph") or "qdqgraph"


ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def last_line(text):
    lines = [s.strip() for s in ANSI.sub("", text or "").splitlines() if s.strip()]
    return lines[-1] if lines else ""


def cell_text(s, limit=300):
    s = " ".join(str(s).split()).replace("|", "\\|")
    return s if len(s) <= limit else s[: limit - 1] + "…"


# ----------------------------------------------------------------------------- quantize

def quantize(qdqgraph, zoo, out_dir, name, args, timeout, logs):
    """Run one qdqgraph insert with extra `args`. Returns {ok, seconds, error, report}."""
    dst = out_dir / f"{name}.onnx"
    dst.unlink(missing_ok=True)   # never let a stale model from an earlier run be scored
    rep = logs / f"{name}.report.json"
    cmd = [qdqgraph, "insert", str(zoo / "models" / f"{name}.onnx"),
           "--calib", str(zoo / "calib" / f"{name}.npz"),
           "-o", str(dst), *args, "--force", "--verify", "0", "--report", str(rep)]
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = None, e.stdout or "", (e.stderr or "") + f"\ntimed out after {timeout} s"
        out = out.decode() if isinstance(out, bytes) else out
        err = err.decode() if isinstance(err, bytes) else err
    except OSError as e:
        rc, out, err = None, "", f"cannot run {qdqgraph}: {e}"
    sec = time.perf_counter() - t
    (logs / f"{name}.log").write_text(f"$ {' '.join(cmd)}\n# exit {rc}, {sec:.2f} s\n"
                                      f"--- stdout\n{out}\n--- stderr\n{err}\n")
    if rc != 0:
        msg = last_line(err) or last_line(out) or f"exit code {rc}"
        return {"ok": False, "seconds": sec, "error": f"insert failed (exit {rc}): {msg}"}
    if not dst.exists():
        return {"ok": False, "seconds": sec, "error": "insert exited 0 but wrote no model"}
    return {"ok": True, "seconds": sec, "error": None,
            "report": json.loads(rep.read_text()) if rep.exists() else None}


def peer(tool, python, zoo, out_dir, name, logs, timeout):
    """One peer quantizer (benchmarks/peers_lowbit.py TOOL) on one model. Returns {ok, seconds, error}."""
    dst = out_dir / f"{name}.onnx"
    dst.unlink(missing_ok=True)
    cmd = [python, str(REPO / "benchmarks" / "peers_lowbit.py"), tool, str(zoo / "models" / f"{name}.onnx"),
           str(zoo / "calib" / f"{name}.npz"), str(dst), "--timeout", str(int(timeout))]
    p = subprocess.run(cmd, capture_output=True, text=True)
    (logs / f"{name}.log").write_text(f"$ {' '.join(cmd)}\n--- stdout\n{p.stdout}\n--- stderr\n{p.stderr}\n")
    try:
        row = json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"ok": False, "seconds": 0.0, "error": last_line(p.stderr) or f"exit {p.returncode}"}
    ok = bool(row.get("ok")) and dst.exists()
    return {"ok": ok, "seconds": float(row.get("seconds") or 0.0), "error": None if ok else (row.get("error") or "no output")}


# ----------------------------------------------------------------------------- evaluate

SAFE_ORT = False            # --safe-ort: score through benchmarks/eval_safe.py (onnxruntime rewrites off)


def eval_models(zpy, zoo_scripts, zoo, names, json_path, log_path, compare=None, ort_qdq=None):
    """Run eval_models.py on `names`; returns its JSON (dict name -> result).

    If the process dies as a whole (not a per-model error, which eval_models records in
    `other_error` itself), the models are retried one by one so one crash loses one model."""
    def run(only, jp, lp):
        launcher = [str(REPO / "benchmarks" / "eval_safe.py")] if SAFE_ORT else []
        cmd = [zpy, *launcher, str(zoo_scripts / "eval_models.py"), str(zoo / "models"), str(zoo / "data"),
               "--only", ",".join(only), "--json", str(jp)]
        if compare:
            cmd += ["--compare", str(compare)]
        if ort_qdq:
            cmd += ["--ort-qdq", str(ort_qdq)]
        Path(jp).unlink(missing_ok=True)
        with open(lp, "w") as f:
            f.write(f"$ {' '.join(cmd)}\n")
            f.flush()
            p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True)
        if p.returncode == 0 and Path(jp).exists():
            return json.loads(Path(jp).read_text()), None
        return None, f"eval_models.py exit {p.returncode}: {last_line(Path(lp).read_text())}"

    res, err = run(names, json_path, log_path)
    if res is not None:
        return res
    log(f"   {err}; retrying model by model")
    res = {}
    for n in names:
        r, e = run([n], f"{json_path}.{n}.json", f"{log_path}.{n}.log")
        res.update(r if r is not None else {n: {"eval_error": e}})
    Path(json_path).write_text(json.dumps(res, indent=1))
    return res


# ----------------------------------------------------------------------------- report

def fmt(v):
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def task_cell(r, key):
    """The tool's value of task metric `key`, or why there is none."""
    if r is None:
        return "not run"
    if "insert_error" in r:
        return cell_text(r["insert_error"])
    if "eval_error" in r:
        return cell_text(r["eval_error"])
    if "other_error" in r:
        return cell_text(f"eval error: {r['other_error']}")
    if key not in r.get("other_task", {}):
        return "—"
    return fmt(r["other_task"][key])


def agree_cell(r):
    if r is None:
        return "not run"
    if "insert_error" in r:
        return "insert failed"
    if "eval_error" in r:
        return "eval failed"
    if "other_error" in r or "agreement" not in r:
        return "eval error"
    ak, av = next(iter(r["agreement"].items()))
    outs = r["outputs_cos_snr"]
    worst = min(outs, key=lambda o: o["cos"])
    more = f", min of {len(outs)}" if len(outs) > 1 else ""
    return f"{fmt(av)} / {worst['cos']:.5f} ({worst['snr_db']:.1f} dB{more})"


def md_table(header, rows):
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def report(models, tools, results, seconds, methods, all_metrics, failed=None):
    """results[tool][model] = eval_models result (or an error dict); tools in column order."""
    out = []
    rows, arows = [], []
    for name in models:
        base = next((results[t][name] for t in tools if "float_task" in results[t].get(name, {})), None)
        if base is None:
            rows.append([name, "—", "no float result"] + ["—"] * len(tools))
            continue
        keys = list(base["float_task"])
        # speech_fraction is a property of the labels, not of the model: never a metric row
        keys = [k for k in keys if k != "speech_fraction"]
        for k in (keys if all_metrics else keys[:1]):
            rows.append([name, k, fmt(base["float_task"][k])]
                        + [task_cell(results[t].get(name), k) for t in tools])
        akey = next((next(iter(results[t][name]["agreement"])) for t in tools
                     if "agreement" in results[t].get(name, {})), "—")
        arows.append([name, akey] + [agree_cell(results[t].get(name)) for t in tools])

    out.append(md_table(["model", "metric", "float"] + tools, rows))
    ns = {name: next((results[t][name]["n"] for t in tools if "n" in results[t].get(name, {})), "?")
          for name in models}
    out.append("")
    out.append("Scored on ALL samples of each model (" + ", ".join(f"{k} {v}" for k, v in ns.items())
               + "): eval_models.py cannot restrict scoring to the held-out odd-indexed samples, so the "
               "even-indexed half that both tools calibrated on is scored too.")
    for m in methods:
        s = seconds.get(m, {})
        if s:
            out.append(f"{m if m in PEERS else 'qdqgraph-' + m} quantize wall seconds: "
                       + ", ".join(f"{k} {v:.1f}" + (" (failed)" if k in (failed or {}).get(m, ()) else "")
                                   for k, v in s.items())
                       + f" (total {sum(s.values()):.1f})")
    qs = {name: results[ORT][name]["qdq_seconds"] for name in models
          if "qdq_seconds" in results[ORT].get(name, {})}
    if qs:
        out.append("onnxruntime quantize_static seconds (eval_models qdq_seconds, includes quant_pre_process): "
                   + ", ".join(f"{k} {v:.1f}" for k, v in qs.items()))
    out.append("")
    out.append("Agreement with the float model's decoded predictions / lowest output cosine over all "
               "samples (SNR of that output):")
    out.append("")
    out.append(md_table(["model", "agreement metric"] + tools, arows))
    share_rows = [[name] + [f"{100 * results[t][name]['int8_flops_share']:.1f}%"
                            if results.get(t, {}).get(name, {}).get("int8_flops_share") is not None else "-"
                            for t in tools if t.startswith("qdqgraph")] for name in models]
    if any(c != "-" for r in share_rows for c in r[1:]):
        out.append("")
        out.append("INT8 share of FLOPs predicted by the simulator for each qdqgraph output:")
        out.append("")
        out.append(md_table(["model"] + [t for t in tools if t.startswith("qdqgraph")], share_rows))
    fb_rows = []
    for t in tools:
        for name in models:
            fb = results.get(t, {}).get(name, {}).get("fallback")
            if fb:
                fb_rows.append([t, name, f"{fb['all_int8_db']:.1f}", f"{fb['final_db']:.1f}",
                                str(len(fb["float_nodes"])), ", ".join(fb["float_nodes"][:4])
                                + (" ..." if len(fb["float_nodes"]) > 4 else ""), f"{fb['seconds']:.1f}"])
    if fb_rows:
        out.append("")
        out.append("Float fallback (output SQNR on the sensitivity samples, before and after):")
        out.append("")
        out.append(md_table(["tool", "model", "all INT8 dB", "after dB", "nodes in float", "which", "seconds"],
                            fb_rows))
    return "\n".join(out)


# ----------------------------------------------------------------------------- main

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--zoo", type=Path, default=DEFAULT_ZOO,
                    help="zoo made by benchmarks/setup_zoo.sh (default %(default)s or $QDQGRAPH_ZOO)")
    ap.add_argument("--methods", default="max",
                    help="comma-separated qdqgraph calibration methods, one output folder each "
                         "(e.g. max,entropy,percentile,mse; default %(default)s)")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=ARGS",
                    help="also run `qdqgraph insert ... ARGS` as tool qdqgraph-NAME, e.g. "
                         "'fallback=--accuracy-budget 30 --max-float-layers 8' (repeatable)")
    ap.add_argument("--only", default="", help="comma-separated model names (default: all in the manifest)")
    ap.add_argument("--qdqgraph", default=None,
                    help="qdqgraph executable (default: the one beside this python, else on PATH)")
    ap.add_argument("--out", type=Path, default=None, help="output folder (default ZOO/bench)")
    ap.add_argument("--zoo-scripts", type=Path, default=SHARED / "zoo",
                    help="folder of eval_models.py (default $QDQGRAPH_SHARED/zoo or <repo>/../shared/zoo)")
    ap.add_argument("--zoo-python", default=None, help="python of the zoo venv (default ZOO/venv/bin/python)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds allowed per qdqgraph insert")
    ap.add_argument("--all-metrics", action="store_true",
                    help="one row per task metric (e.g. CER, precision), not only the first")
    ap.add_argument("--report", type=Path, default=None, help="also write the tables here (default OUT/report.md)")
    ap.add_argument("--peer", action="append", default=[], metavar="TOOL",
                    help="also run a peer quantizer of benchmarks/peers_lowbit.py (modelopt-fp8, ort-fp8, ...) "
                         "in the same run and score it the same way (repeatable)")
    ap.add_argument("--modelopt-python", default="/tmp/mo-venv/bin/python",
                    help="python with Model Optimizer, for modelopt-* peers (benchmarks/setup_modelopt.sh)")
    ap.add_argument("--safe-ort", action="store_true",
                    help="score every tool's models with onnxruntime's rewrites that qdqgraph turns off "
                         "(qdqgraph.execution.runtime.DISABLED_OPTIMIZERS) turned off too, at the basic optimization "
                         "level (benchmarks/eval_safe.py); needed for FP8 models")
    a = ap.parse_args()
    if a.safe_ort:
        global SAFE_ORT
        SAFE_ORT = True
        sys.path.insert(0, str(REPO))
        from qdqgraph.execution.runtime import DISABLED_OPTIMIZERS
        os.environ["QDQGRAPH_ORT_DISABLED"] = ",".join(DISABLED_OPTIMIZERS)
        os.environ["QDQGRAPH_ORT_BASIC"] = "1"

    zoo = a.zoo.resolve()
    out = (a.out or zoo / "bench").resolve()
    zpy = a.zoo_python or str(zoo / "venv" / "bin" / "python")
    qdqgraph = a.qdqgraph or default_qdqgraph()
    methods = [m for m in a.methods.split(",") if m]
    variants = {m: ["--method", m] for m in methods}
    for v in a.variant:
        name, _, args = v.partition("=")
        if not name or not args:
            ap.error(f"--variant {v!r}: write NAME=ARGS")
        variants[name] = shlex.split(args)
    methods = list(variants)
    problems = [str(p) for p in (Path(zpy), a.zoo_scripts / "eval_models.py", zoo / "models" / "manifest.json")
                if not p.exists()]
    if problems:
        ap.error("missing " + ", ".join(problems) + " (run benchmarks/setup_zoo.sh first)")

    manifest = json.loads((zoo / "models" / "manifest.json").read_text())
    only = [s for s in a.only.split(",") if s]
    unknown = set(only) - {m["name"] for m in manifest}
    if unknown:
        ap.error(f"unknown model(s) {', '.join(sorted(unknown))}; the zoo has "
                 + ", ".join(m["name"] for m in manifest))
    models = [m["name"] for m in manifest if not only or m["name"] in only]
    missing = [n for n in models for d in ("data", "calib") if not (zoo / d / f"{n}.npz").exists()]
    if missing:
        ap.error(f"no data/calib npz for {', '.join(sorted(set(missing)))} (run benchmarks/setup_zoo.sh)")

    (out / "logs").mkdir(parents=True, exist_ok=True)
    log(f"zoo {zoo}, output {out}, qdqgraph {qdqgraph}, methods {','.join(methods)}")

    # 1. qdqgraph insert, per method and model
    seconds, inserts = {}, {}
    for m in methods:
        d = out / f"qdqgraph-{m}"
        d.mkdir(parents=True, exist_ok=True)
        lg = out / "logs" / f"qdqgraph-{m}"
        lg.mkdir(parents=True, exist_ok=True)
        seconds[m], inserts[m] = {}, {}
        for n in models:
            r = quantize(qdqgraph, zoo, d, n, variants[m], a.timeout, lg)
            inserts[m][n] = r
            seconds[m][n] = r["seconds"]
            log(f"qdqgraph-{m} {n}: {'ok' if r['ok'] else r['error']} ({r['seconds']:.1f} s)")

    # 2. onnxruntime baseline, built and scored now
    t = time.perf_counter()
    results = {ORT: eval_models(zpy, a.zoo_scripts, zoo, models, out / "ort.json", out / "logs" / "ort.log",
                                ort_qdq=out / "ort_qdq")}
    log(f"onnxruntime baseline: {time.perf_counter() - t:.1f} s")

    # 3. score each qdqgraph folder on the models it quantized
    tools = [ORT]
    for m in methods:
        tool = f"qdqgraph-{m}"
        tools.append(tool)
        ok = [n for n in models if inserts[m][n]["ok"]]
        res = {}
        if ok:
            t = time.perf_counter()
            res = eval_models(zpy, a.zoo_scripts, zoo, ok, out / f"{tool}.json", out / "logs" / f"{tool}-eval.log",
                              compare=out / tool)
            log(f"{tool} eval: {time.perf_counter() - t:.1f} s")
        for n in models:
            if not inserts[m][n]["ok"]:
                res[n] = {"insert_error": inserts[m][n]["error"]}
            res.setdefault(n, {}).update(insert_seconds=round(inserts[m][n]["seconds"], 2))
            rep = inserts[m][n].get("report") or {}
            fb = rep.get("fallback")
            if fb:
                res[n]["fallback"] = {k: fb[k] for k in ("all_int8_db", "final_db", "float_nodes", "seconds")}
            if rep.get("tensorrt"):
                res[n]["int8_flops_share"] = rep["tensorrt"]["int8_flops_share"]
        results[tool] = res

    # 4. peers, quantized and scored the same way
    for tool in a.peer:
        py = a.modelopt_python if tool.startswith("modelopt") else sys.executable
        d, lg = out / tool, out / "logs" / tool
        d.mkdir(parents=True, exist_ok=True)
        lg.mkdir(parents=True, exist_ok=True)
        runs = {n: peer(tool, py, zoo, d, n, lg, a.timeout) for n in models}
        for n, r in runs.items():
            log(f"{tool} {n}: {'ok' if r['ok'] else r['error']} ({r['seconds']:.1f} s)")
        ok = [n for n in models if runs[n]["ok"]]
        res = eval_models(zpy, a.zoo_scripts, zoo, ok, out / f"{tool}.json", out / "logs" / f"{tool}-eval.log",
                          compare=d) if ok else {}
        for n in models:
            if not runs[n]["ok"]:
                res[n] = {"insert_error": runs[n]["error"]}
            res.setdefault(n, {}).update(insert_seconds=round(runs[n]["seconds"], 2))
        results[tool] = res
        tools.append(tool)
        seconds[tool] = {n: r["seconds"] for n, r in runs.items()}
        methods.append(tool)

    (out / "results.json").write_text(json.dumps({"models": models, "tools": tools, "results": results}, indent=1))
    failed = {m: {n for n in models if "insert_error" in results[m if m in PEERS else f"qdqgraph-{m}"].get(n, {})}
              for m in methods}
    text = report(models, tools, results, seconds, methods, a.all_metrics, failed)
    (a.report or out / "report.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
