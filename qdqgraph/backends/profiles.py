"""Optimization profiles for dynamic input shapes: min/opt/max per input, given in trtexec's form
(`--shapes`, `--min/--opt/--max`: `name:1x3x224x224,other:1x128`) or derived from calibration data.

A TensorRT engine built from a model with dynamic dims needs, for each dynamic input, the smallest,
the most frequent and the largest shape it will see. Without flags they come from the calibration
samples (the shapes the user said are typical); a dynamic batch dim is then 1 unless given.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from ..samples.data import CalibrationData, InputSpec
from ..errors import QdqError

Shape = tuple[int, ...]


@dataclass(frozen=True)
class InputProfile:
    name: str
    min: Shape
    opt: Shape
    max: Shape

    def trtexec(self) -> str:
        return f"{self.name}:{'x'.join(map(str, self.min))} / {'x'.join(map(str, self.opt))} / {'x'.join(map(str, self.max))}"


def parse_shapes(text: str, flag: str = "--shapes") -> dict[str, Shape]:
    """`name:1x3x224x224,other:1x128` -> {name: (1, 3, 224, 224), ...}. A name may contain ':'
    (the last one separates the dims), as in trtexec; a scalar input is `name:` with no dims."""
    out: dict[str, Shape] = {}
    for item in (p.strip() for p in text.split(",")):
        if not item:
            continue
        name, sep, dims = item.rpartition(":")
        if not sep or not name:
            raise QdqError(f"{flag} entry {item!r} has no input name",
                           f"write {flag} NAME:1x3x224x224[,NAME2:...]")
        try:
            shape = tuple(int(d) for d in dims.split("x")) if dims else ()
        except ValueError:
            raise QdqError(f"{flag} entry {item!r}: dims must be whole numbers separated by 'x'",
                           f"write {flag} {name}:1x3x224x224") from None
        if any(d < 1 for d in shape):
            raise QdqError(f"{flag} entry {item!r}: every dim must be at least 1", "give the concrete shape")
        if name in out:
            raise QdqError(f"{flag} names input {name!r} twice", "give each input once")
        out[name] = shape
    if not out:
        raise QdqError(f"{flag} is empty", f"write {flag} NAME:1x3x224x224")
    return out


def _dynamic(spec: InputSpec) -> bool:
    return spec.shape is None or any(not isinstance(d, int) or d < 1 for d in spec.shape)


def _fits(spec: InputSpec, shape: Shape, flag: str) -> None:
    if spec.shape is None:
        return
    if len(shape) != len(spec.shape):
        raise QdqError(f"{flag} gives input '{spec.name}' rank {len(shape)}; the model's input has rank "
                       f"{len(spec.shape)} {list(spec.shape)}", "give one dim per model dim")
    for k, (d, want) in enumerate(zip(shape, spec.shape)):
        if isinstance(want, int) and want > 0 and d != want:
            raise QdqError(f"{flag} gives input '{spec.name}' dim {k} = {d}; the model fixes it at {want}",
                           f"use {want} there")


def from_flags(inputs: list[InputSpec], shapes: str | None = None, min_: str | None = None,
               opt: str | None = None, max_: str | None = None) -> dict[str, InputProfile]:
    """Profiles from trtexec-style flags: `shapes` sets min = opt = max; `min_`, `opt`, `max_` go
    together. Inputs the flags do not name are left out (derive them from data)."""
    given = [f for f in (min_, opt, max_) if f]
    if given and len(given) != 3:
        raise QdqError("--min, --opt and --max go together", "give all three (trtexec's form), or --shapes")
    if shapes and given:
        raise QdqError("--shapes and --min/--opt/--max both given", "use one form")
    specs = {s.name: s for s in inputs}
    if shapes:
        table = {n: (s, s, s) for n, s in parse_shapes(shapes).items()}
    elif min_ and opt and max_:                 # given: all three (checked above)
        lo, mid, hi = parse_shapes(min_, "--min"), parse_shapes(opt, "--opt"), parse_shapes(max_, "--max")
        if not (set(lo) == set(mid) == set(hi)):
            raise QdqError("--min, --opt and --max name different inputs", "name the same inputs in all three")
        table = {n: (lo[n], mid[n], hi[n]) for n in lo}
    else:
        return {}
    out = {}
    for name, (a, b, c) in table.items():
        if name not in specs:
            raise QdqError(f"no model input is named '{name}'", f"the inputs are: {', '.join(specs)}")
        for flag, shape in (("--min", a), ("--opt", b), ("--max", c)):
            _fits(specs[name], shape, "--shapes" if shapes else flag)
        if len({len(a), len(b), len(c)}) != 1 or any(x > y for x, y in zip(a, b)) or any(x > y for x, y in zip(b, c)):
            raise QdqError(f"input '{name}': min {a}, opt {b}, max {c} are not ordered dim by dim",
                           "make min <= opt <= max in every dim")
        out[name] = InputProfile(name, a, b, c)
    return out


def from_data(data: CalibrationData, max_batch: int | None = None) -> dict[str, InputProfile]:
    """Profiles for the dynamic inputs from the shapes of the calibration samples: min and max dim
    by dim, opt the most frequent shape. `max_batch` widens a dynamic leading dim to 1..max_batch."""
    seen: dict[str, Counter] = {s.name: Counter() for s in data.inputs if _dynamic(s)}
    if not seen:
        return {}
    for i in range(data.count):
        sample = data.sample(i)
        for name, counter in seen.items():
            counter[tuple(int(d) for d in sample[name].shape)] += 1
    out = {}
    for spec in data.inputs:
        if spec.name not in seen:
            continue
        shapes = list(seen[spec.name])
        lo = tuple(min(s[k] for s in shapes) for k in range(len(shapes[0])))
        hi = tuple(max(s[k] for s in shapes) for k in range(len(shapes[0])))
        opt = seen[spec.name].most_common(1)[0][0]
        batch_dynamic = spec.shape is not None and len(spec.shape) > 0 and not (
            isinstance(spec.shape[0], int) and spec.shape[0] > 0)
        if max_batch and batch_dynamic and lo:
            lo, hi = (1,) + lo[1:], (max(max_batch, hi[0]),) + hi[1:]
        out[spec.name] = InputProfile(spec.name, lo, opt, hi)
    return out


def profiles(inputs: list[InputSpec], data: CalibrationData | None = None, shapes: str | None = None,
             min_: str | None = None, opt: str | None = None, max_: str | None = None,
             max_batch: int | None = None) -> dict[str, InputProfile]:
    """Flags first; dynamic inputs they leave out come from `data`. Every dynamic input must be
    covered: TensorRT cannot build without its range."""
    out = from_flags(inputs, shapes, min_, opt, max_)
    missing = [s for s in inputs if _dynamic(s) and s.name not in out]
    if missing and data is not None:
        derived = from_data(data, max_batch)
        for s in missing:
            out[s.name] = derived[s.name]
        missing = []
    if missing:
        names = ", ".join(f"{s.name} {list(s.shape) if s.shape is not None else '(unknown rank)'}" for s in missing)
        raise QdqError(f"dynamic input(s) without a shape range: {names}",
                       "give --shapes NAME:1x3x224x224 (or --min/--opt/--max), or --calib DATA to derive them")
    return out
