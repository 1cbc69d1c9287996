"""qdqgraph: float ONNX in, TensorRT-ready explicit-quantization (Q/DQ) ONNX out.

    import qdqgraph
    result = qdqgraph.quantize("model.onnx", calib="data.npz")
    onnx.save(result.model, "model.qdq.onnx")

Each stage is importable and usable on its own: `load`, `fold_constants`, `fold_batchnorm`,
`plan_placement`, `insert_qdq`, `strip_qdq`, `qdq_violations`.
"""
from .version import __version__  # noqa: E402

from .errors import QdqError  # noqa: E402
from .graph.io import load, save, to_model  # noqa: E402
from .passes.batchnorm import fold_batchnorm  # noqa: E402
from .passes.check import qdq_violations  # noqa: E402
from .passes.constants import fold_constants  # noqa: E402
from .passes.insert import insert_qdq  # noqa: E402
from .passes.strip import strip_qdq  # noqa: E402
from .calib.calibration import Calibration, calibrate, merge_calibrations  # noqa: E402
from .config import QuantizeConfig  # noqa: E402
from .pipeline import Result, quantize  # noqa: E402
from .fix import FixResult, fix  # noqa: E402
from .placement import Selection, plan_placement, load_ruleset
from .execution.runtime import deployment_session as session  # noqa: E402

__all__ = ["QdqError", "load", "save", "to_model", "fold_batchnorm", "fold_constants", "plan_placement",
           "insert_qdq", "strip_qdq", "qdq_violations", "quantize", "Result", "QuantizeConfig", "calibrate",
           "Calibration", "merge_calibrations", "Selection", "load_ruleset", "fix", "FixResult", "session"]
