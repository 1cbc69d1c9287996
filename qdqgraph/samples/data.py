"""Calibration data: .npz / .npy files or folders of them, checked against the model's inputs.

Layout: one array per model input, named like the input, first axis = samples. A sample is either
`arr[i]` (the array has one more dimension than the input: the tensor to feed, batch axis included)
or `arr[i:i+1]` (same rank as the input: the first axis is the batch). Pickled arrays are refused.
"""
from __future__ import annotations

from collections.abc import Mapping

import copy
import os
import warnings
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from ..errors import QdqError
from ..graph.outputs import require_regular
from .images import image_files, parse_preprocess, read_image_folder

META_KEYS = ("__meta__",)
# said once for --calib random (the pipeline's report says the same words: the CLI says them once)
RANDOM_WARNING = "calibrated on random data: the scales say nothing about accuracy"


@dataclass(frozen=True)
class InputSpec:
    name: str
    dtype: np.dtype
    shape: tuple  # ints for static dims, str or None for dynamic ones


NPZ_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")     # a zip archive (the second: one with no arrays)
NPY_MAGIC = b"\x93NUMPY"


def _head(path: Path, what: str, fix: str) -> bytes:
    """The first bytes of a data file; a file that cannot be read is a QdqError that says why."""
    if not os.access(path, os.R_OK):
        raise QdqError(f"cannot read {path}: permission denied", "check the file's permissions")
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except PermissionError:
        raise QdqError(f"cannot read {path}: permission denied", "check the file's permissions") from None
    except OSError as e:
        raise QdqError(f"{path} cannot be read as {what} ({e.strerror or e})", fix) from None
    if not head:
        raise QdqError(f"{path} is empty, not {what}", fix)
    return head


def _read_failed(path: Path, e: Exception, what: str, fix: str) -> QdqError:
    if isinstance(e, PermissionError):
        return QdqError(f"cannot read {path}: permission denied", "check the file's permissions")
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return QdqError(f"{path} is not a readable {what}: it may be truncated or corrupt ({first})", fix)


def _load_npz(path: Path) -> dict[str, np.ndarray]:
    fix = "write it again with np.savez"
    head = _head(path, "an .npz file", fix)
    if head.startswith(NPY_MAGIC):
        raise QdqError(f"{path} is a .npy file (one array), not an .npz", "rename it to .npy, or save one array "
                       "per model input with np.savez")
    if not head.startswith(NPZ_MAGIC):
        raise QdqError(f"{path} is not an .npz file (it does not start with the zip signature PK\\x03\\x04)",
                       "write calibration data with np.savez (one array per model input)")
    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: z[k] for k in z.files if k not in META_KEYS}
    except ValueError as e:
        if "pickle" in str(e).lower():
            raise QdqError(f"{path} holds pickled (object) arrays, which qdqgraph never loads",
                           "save plain numeric arrays with np.savez") from None
        raise _read_failed(path, e, ".npz file", fix) from None
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error, KeyError) as e:
        raise _read_failed(path, e, ".npz file", fix) from None


def _load_npy(path: Path) -> np.ndarray:
    fix = "write it again with np.save"
    head = _head(path, "a .npy file", fix)
    if head.startswith(NPZ_MAGIC):
        raise QdqError(f"{path} is an .npz archive, not a .npy file", "rename it to .npz")
    if not head.startswith(NPY_MAGIC):
        raise QdqError(f"{path} is not a .npy file (it does not start with the signature \\x93NUMPY)",
                       "write calibration data with np.save (or np.savez for several inputs)")
    try:
        return np.load(path, allow_pickle=False)
    except ValueError as e:
        if "pickle" in str(e).lower():
            raise QdqError(f"{path} holds pickled (object) data, which qdqgraph never loads",
                           "save plain numeric arrays with np.save") from None
        raise _read_failed(path, e, ".npy file", fix) from None
    except (OSError, EOFError) as e:
        raise _read_failed(path, e, ".npy file", fix) from None


def numeric(dtype) -> bool:
    """Whether qdqgraph can feed an input of this dtype: numbers and booleans (bfloat16 and the
    float8 types included, numpy kind 'V'), not strings or objects."""
    return np.dtype(dtype).kind not in "OSU"


def require_numeric(inputs: list[InputSpec], why: str = "qdqgraph calibrates numeric inputs only",
                    fix: str = "pass ranges calibrated elsewhere with --calib-cache FILE") -> None:
    """Refuse a model with a string (or other non-numeric) input, which qdqgraph cannot feed."""
    for s in inputs:
        if not numeric(s.dtype):
            raise QdqError(f"input '{s.name}' is a string tensor: {why}", fix)


def read_arrays(source: str | Path | dict, inputs: list[InputSpec], preprocess: str | None = None,
                ignore: tuple[str, ...] = ()):
    """Arrays by input name from a file or a dict given through the Python API; from a folder, a
    list of such dicts, one per file; from a folder of images, one array made with `preprocess`.
    Arrays named in `ignore` (inputs fixed to constants) are dropped."""
    if preprocess is not None or _is_image_folder(source):
        return _read_images(source, inputs, preprocess)
    require_numeric(inputs)
    if isinstance(source, dict):
        arrays = {k: np.asarray(v) for k, v in source.items() if k not in META_KEYS}
    else:
        path = Path(source)
        if not path.exists():
            raise QdqError(f"calibration data not found: {path}", "check the --calib path")
        if path.is_dir():
            return _folder_chunks(path, inputs, ignore)
        arrays = _read_file(path, inputs)
    return _matched(arrays, inputs, ignore)


def _is_image_folder(source: str | Path | dict) -> bool:
    """Whether `source` is a folder that holds images."""
    return isinstance(source, (str, Path)) and Path(source).is_dir() and _has_images(Path(source))


def _read_images(source: str | Path | dict, inputs: list[InputSpec], preprocess: str | None):
    """The one array made with `preprocess` from a folder of images, for a model with one float input."""
    if preprocess is None:
        raise QdqError(f"{source} holds images but no --preprocess was given",
                       'pass e.g. --preprocess "resize=256,crop=224,mean=0.485,0.456,0.406,std=0.229,0.224,0.225"')
    if not (isinstance(source, (str, Path)) and Path(source).is_dir()):
        raise QdqError("--preprocess applies to a folder of images", "pass the folder with --calib")
    floats = [i for i in inputs if np.issubdtype(i.dtype, np.floating)]
    if len(inputs) != 1 or len(floats) != 1:
        raise QdqError(f"image calibration needs a model with one float input; this one has "
                       f"{', '.join(i.name for i in inputs)}", "write an .npz with one array per input")
    return read_image_folder(Path(source), parse_preprocess(preprocess), inputs[0].name)


def _folder_chunks(path: Path, inputs: list[InputSpec], ignore: tuple[str, ...]) -> list[FileChunk]:
    """One FileChunk per .npz/.npy file of a calibration folder, each read when used."""
    try:
        files = sorted(p for p in path.iterdir() if p.suffix in (".npz", ".npy"))
    except PermissionError:
        raise QdqError(f"cannot read folder {path}: permission denied", "check its permissions") from None
    if not files:
        raise QdqError(f"{path} holds no .npz or .npy files", "put calibration arrays in it")
    for p in files:
        require_regular(p, "calibration data")
    return [FileChunk(p, inputs, ignore) for p in files]  # one chunk per file, read when used


def _read_file(path: Path, inputs: list[InputSpec]) -> dict[str, np.ndarray]:
    """The arrays by name of one .npz file, or of one .npy file for a model with one input."""
    require_regular(path, "calibration data")
    if path.suffix == ".npz":
        return _load_npz(path)
    if path.suffix == ".npy":
        if len(inputs) != 1:
            raise QdqError(f"{path} is one array but the model has {len(inputs)} inputs "
                           f"({', '.join(i.name for i in inputs)})", "use an .npz with one array per input name")
        return {inputs[0].name: _load_npy(path)}
    raise QdqError(f"{path}: calibration data must be .npz, .npy or a folder of them", "convert it with numpy")


def _matched(arrays: dict, inputs: list[InputSpec], ignore: tuple[str, ...]) -> dict:
    """The arrays less those in `ignore`, refused unless they name exactly the model's inputs."""
    arrays = {k: v for k, v in arrays.items() if k not in ignore}
    names = [i.name for i in inputs]
    missing = [n for n in names if n not in arrays]
    extra = [k for k in arrays if k not in names]
    if missing:
        raise QdqError(f"calibration data has no array for model input(s) {missing} "
                       f"(found {sorted(arrays)})", "name each array after a model input")
    if extra:
        raise QdqError(f"calibration data has array(s) {extra} that are not model inputs "
                       f"(inputs: {names})", "rename or drop them")
    return arrays


class FileChunk(Mapping):
    """The arrays of one file of a calibration folder, read when used: only the file in use (the
    last one read) is held in memory, so a folder of any size calibrates in flat memory."""

    _last: tuple[Path, dict] | None = None

    def __init__(self, path: Path, inputs: list[InputSpec], ignore: tuple[str, ...] = ()):
        self.path, self.inputs, self.ignore = path, inputs, ignore
        self.names = [i.name for i in inputs]
        self._arrays()                          # validate names now: errors name the file at once

    def _arrays(self) -> dict[str, np.ndarray]:
        last = FileChunk._last
        if last is None or last[0] != self.path:
            FileChunk._last = last = None       # drop the previous file before reading the next
            last = FileChunk._last = (self.path, read_arrays(self.path, self.inputs, ignore=self.ignore))
        return last[1]

    def __getitem__(self, name: str) -> np.ndarray:
        return self._arrays()[name]

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def _has_images(folder: Path) -> bool:
    return bool(image_files(folder))


def _sample_view(spec: InputSpec, arr: np.ndarray) -> tuple[bool, int]:
    """(stacked, n): stacked means arr[i] is a sample; else arr[i:i+1] is."""
    rank = len(spec.shape) if spec.shape is not None else None
    if rank is None or arr.ndim == rank + 1:
        return True, arr.shape[0] if arr.ndim else 1
    if arr.ndim == rank:
        return False, arr.shape[0] if rank else 1
    raise QdqError(f"calibration array '{spec.name}' has shape {list(arr.shape)}; the model input has "
                   f"rank {rank} (shape {list(spec.shape)})",
                   f"give shape [samples, {', '.join(str(d) for d in spec.shape)}]")


def check_sample(spec: InputSpec, x: np.ndarray) -> None:
    if x.dtype != spec.dtype:
        require_numeric([spec])
        raise QdqError(f"calibration array '{spec.name}' is {x.dtype}; the model input wants {spec.dtype}",
                       f"convert it with .astype(np.{spec.dtype.type.__name__})")
    if spec.shape is not None:
        if x.ndim != len(spec.shape):
            raise QdqError(f"calibration sample for '{spec.name}' has shape {list(x.shape)}; "
                           f"the model input is {list(spec.shape)}", "fix the array's shape")
        for got, want in zip(x.shape, spec.shape):
            if isinstance(want, int) and want >= 0 and got != want:
                raise QdqError(f"calibration sample for '{spec.name}' has shape {list(x.shape)}; "
                               f"the model input is {list(spec.shape)}", "fix the array's shape")
    if np.issubdtype(x.dtype, np.floating) and not np.all(np.isfinite(x)):
        raise QdqError(f"calibration data for '{spec.name}' contains NaN or Inf",
                       "clean the data: calibration needs finite inputs")


class CalibrationData:
    """Validated samples, batched for onnxruntime. `arrays` is one dict of arrays, or a list of them
    (one per file of a folder: files may hold samples of different shapes for dynamic dims)."""

    def __init__(self, arrays, inputs: list[InputSpec], samples: int | None = None, random: bool = False):
        require_numeric(inputs)
        self.inputs = inputs
        self.random = random             # made by `--calib random` (random_data): dynamic dims are 1
        self.chunks = list(arrays) if isinstance(arrays, (list, tuple)) else [arrays]
        self.views, sizes = [], []
        for chunk in self.chunks:
            views = {s.name: _sample_view(s, chunk[s.name]) for s in inputs}
            counts = {name: n for name, (_, n) in views.items()}
            if len(set(counts.values())) != 1:
                raise QdqError(f"calibration arrays hold different numbers of samples: {counts}",
                               "give every input the same number of samples")
            self.views.append(views)
            sizes.append(next(iter(counts.values())))
        self.starts = np.cumsum([0] + sizes)
        n = int(self.starts[-1])
        self.first = 0
        self.count = min(n, samples) if samples else n
        if self.count == 0:
            raise QdqError("calibration data holds no samples", "give at least one sample")

    def head(self, count: int) -> "CalibrationData":
        """The first `count` samples (all of them where there are fewer)."""
        out = copy.copy(self)
        out.count = min(count, self.count)
        return out

    def shard(self, index: int, count: int) -> "CalibrationData":
        """Shard `index` (1-based) of `count`: a contiguous run of the samples."""
        if not (1 <= index <= count):
            raise QdqError(f"shard {index}/{count} does not exist", f"use --shard I/{count} with 1 <= I <= {count}")
        start, stop = (index - 1) * self.count // count, index * self.count // count
        if stop <= start:
            raise QdqError(f"shard {index}/{count} holds no samples ({self.count} in all)", "use fewer shards")
        out = copy.copy(self)
        out.first, out.count = self.first + start, stop - start
        return out

    def origin(self) -> dict[str, np.ndarray]:
        """The first sample of the whole set, also when this is a shard of it. Calibration
        histograms take their starting range from it, so that neither the batch size nor the
        sharding changes them."""
        return self.sample(-self.first)

    def sample(self, i: int) -> dict[str, np.ndarray]:
        j = self.first + i
        c = int(np.searchsorted(self.starts, j, side="right")) - 1
        k = j - int(self.starts[c])
        out = {}
        for spec in self.inputs:
            arr = self.chunks[c][spec.name]
            stacked, _ = self.views[c][spec.name]
            x = arr[k] if stacked else arr[k:k + 1] if arr.ndim else arr
            x = np.asarray(x)  # (np.ascontiguousarray would turn a scalar sample into shape [1])
            if not x.flags.c_contiguous:
                x = x.copy()
            check_sample(spec, x)
            out[spec.name] = x
        return out

    def batchable(self) -> bool:
        """Samples can be concatenated on axis 0 when every input's first dim is dynamic."""
        return all(s.shape and not (isinstance(s.shape[0], int) and s.shape[0] > 0) for s in self.inputs)

    def batches(self, batch_size: int = 1) -> Iterator[dict[str, np.ndarray]]:
        for feed, _ in self.counted_batches(batch_size):
            yield feed

    def counted_batches(self, batch_size: int = 1) -> Iterator[tuple[dict[str, np.ndarray], int]]:
        """(feed, number of samples in it): a sample may itself hold several rows."""
        if batch_size <= 1 or not self.batchable():
            for i in range(self.count):
                yield self.sample(i), 1
            return
        for start in range(0, self.count, batch_size):
            group = [self.sample(i) for i in range(start, min(start + batch_size, self.count))]
            try:
                yield {k: np.concatenate([g[k] for g in group]) for k in group[0]}, len(group)
            except ValueError:  # samples of different shapes: feed them one by one
                for g in group:
                    yield g, 1


def random_data(inputs: list[InputSpec], samples: int = 8, seed: int = 0) -> dict[str, np.ndarray]:
    """Random samples for `--calib random` (dynamic dims set to 1); scales from these say nothing
    about accuracy."""
    require_numeric(inputs, "qdqgraph cannot make random data for it")
    warnings.warn(RANDOM_WARNING, stacklevel=2)
    rng = np.random.default_rng(seed)
    out = {}
    for s in inputs:
        shape = [d if isinstance(d, int) and d > 0 else 1 for d in (s.shape or ())]
        if np.issubdtype(s.dtype, np.floating):
            out[s.name] = rng.standard_normal([samples, *shape]).astype(s.dtype)
        elif s.dtype == np.bool_:
            out[s.name] = rng.integers(0, 2, [samples, *shape]).astype(bool)
        else:
            out[s.name] = rng.integers(0, 2, [samples, *shape]).astype(s.dtype)
    return out
