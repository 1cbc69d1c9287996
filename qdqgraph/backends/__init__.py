"""Compilers that turn a Q/DQ model into an engine, one module each, behind one small protocol:

    NAME                       the --backend name
    available() -> str | None  None when it can build here, else why not (one line)
    import_module()            the compiler's Python module, or a QdqError naming the install
    build(model, plan, BuildOptions) -> BuildResult
                               writes the plan; BuildResult.engine is the compiled engine read back
                               into the simulator's layer schema where the backend can (TensorRT for
                               RTX: always, from its build log; datacenter TensorRT: on a GPU)

`choose("auto")` takes datacenter TensorRT where it imports, else TensorRT for RTX. A new compiler is
one module here plus its name in BACKENDS.
"""
from __future__ import annotations

from ..errors import QdqError
from . import tensorrt, tensorrt_rtx
from .base import BuildOptions, BuildResult

BACKENDS = {tensorrt.NAME: tensorrt, tensorrt_rtx.NAME: tensorrt_rtx}
CHOICES = ("auto", *BACKENDS)


def choose(name: str = "auto"):
    """The backend module for `name`; for "auto" the first that can build here. A QdqError when
    none can, naming each one's reason and the install that fixes it."""
    if name != "auto":
        if name not in BACKENDS:
            raise QdqError(f"unknown backend {name!r}", "use one of " + ", ".join(CHOICES))
        backend = BACKENDS[name]
        backend.import_module()
        return backend
    reasons = []
    for backend in BACKENDS.values():
        why = backend.available()
        if why is None:
            return backend
        reasons.append(why)
    raise QdqError("no TensorRT compiler is installed here (" + "; ".join(reasons) + ")",
                   f"{tensorrt_rtx.INSTALL}; or, on a machine with an NVIDIA GPU, {tensorrt.INSTALL}")


__all__ = ["BACKENDS", "CHOICES", "choose", "BuildOptions", "BuildResult"]
