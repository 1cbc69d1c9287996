"""Types of the compiled kernel in _abshist.c (built at install when a C compiler is there)."""
import numpy as np

ISAS: tuple[str, ...]     # the instruction sets this machine runs, best first

def abs_hist(x: np.ndarray, inv: float, counts: np.ndarray, isa: str | None = ..., /) -> tuple[float, bool]:
    """counts[floor(|x| * inv)] += 1 if every index fits; returns (max |x|, whether every index fit)."""
    ...
