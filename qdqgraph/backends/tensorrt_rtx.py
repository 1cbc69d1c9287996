"""TensorRT for RTX (the `tensorrt_rtx` package, `pip install 'qdqgraph[rtx]'`): builds a plan ahead
of time on any machine, GPU or not, and lists the compiled engine's kernels in its build log, which
qdqgraph reads back (backends/listing.py).

Strongly typed only (no precision flags, no calibrators). Targets: the compute capabilities the plan
is compiled for (rules/targets.toml); without `--compute-capability` the builder's default, except
where the model's formats need newer GPUs (FP8: SM89+, INT4: SM80+), which are then set explicitly
so that no target is dropped without a word. Running the engine needs an RTX-class GPU; reading
its kernels does not.
"""
from __future__ import annotations

import time
from pathlib import Path

from . import base, listing, targets

NAME = "tensorrt-rtx"
INSTALL = "pip install 'qdqgraph[rtx]' (TensorRT for RTX, from the package index; no GPU needed to build)"


def import_module():
    return base.import_compiler("tensorrt_rtx", "TensorRT for RTX", INSTALL)


def available() -> str | None:
    return base.unavailable(import_module)


def build(model, plan: Path, options: base.BuildOptions) -> base.BuildResult:
    trt = import_module()
    chosen, note = targets.choose(set(options.formats), options.compute_capabilities)
    t0 = time.perf_counter()
    log = base.Log(trt, options.verbose)
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)

    def configure(config):
        if chosen:
            config.num_compute_capabilities = len(chosen)
            for i, sm in enumerate(chosen):
                config.set_compute_capability(getattr(trt.ComputeCapability, sm.upper()), i)

    data, cache = base.compile_onnx(trt, model, options, log, flags=flags, configure=configure, gpu_needed=False)
    base.write_plan(plan, data, cache, options)
    out = base.BuildResult(plan, NAME, str(trt.__version__), True, seconds=time.perf_counter() - t0,
                           targets=chosen or targets.default(), targets_note=note,
                           warnings=log.warnings(), repaired=log.notes)
    lines = listing.listing_lines(log.messages)
    if lines:
        out.engine = listing.parse_listing(lines, str(plan))
    else:
        out.engine_note = "the builder listed no kernels"
    return out
