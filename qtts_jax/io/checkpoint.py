"""Reading Hugging Face safetensors into our modules' parameters through explicit name tables, and back.

Every model part (talker, code predictor, codec, speaker encoder) declares a table of `Entry`s: which
Hugging Face tensor (a name template, with ``{i}`` for a stacked layer index) fills which `nnx.Param` of
our module (its state path, "a/b/c"), and how its layout changes. One mechanism does the reading, the
stacking and the checking, so every part reports a missing or mis-shaped tensor the same way: by its
Hugging Face name, with both shapes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Callable, Mapping

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from qtts_jax.io.errors import CheckpointError
from qtts_jax.nn import state_shapes

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a Hugging Face tensor is rearranged into ours; `inverse_shape` reports expectations in HF terms."""

    name: str
    forward: Callable[[np.ndarray], np.ndarray]
    inverse_shape: Callable[[tuple[int, ...]], tuple[int, ...]]
    inverse: Callable[[np.ndarray], np.ndarray]  # ours -> Hugging Face's (exports)


AS_IS = Layout("as_is", lambda a: a, lambda s: s, lambda a: a)
# torch Linear stores (out, in); we multiply x @ w with w as (in, out).
LINEAR = Layout("linear", lambda a: a.T, lambda s: s[::-1], lambda a: a.T)
# torch Conv1d stores (out, in, k); lax.conv_general_dilated with "WIO" wants (k, in, out).
CONV = Layout("conv", lambda a: np.transpose(a, (2, 1, 0)), lambda s: (s[2], s[1], s[0]),
              lambda a: np.transpose(a, (2, 1, 0)))
# torch ConvTranspose1d stores (in, out, k); we keep (k, in, out) and flip in the layer.
CONV_TRANSPOSE = Layout("conv_transpose", lambda a: np.transpose(a, (2, 0, 1)), lambda s: (s[1], s[2], s[0]),
                        lambda a: np.transpose(a, (1, 2, 0)))


@dataclasses.dataclass(frozen=True)
class Entry:
    """One row of a name table: HF tensor template -> our leaf path ("a/b/c"). With ``cols`` (start, stop), the
    tensor fills only those columns of our leaf's last axis: several Hugging Face tensors fused side by side into
    one of ours (the q, k and v projections as one matrix product), each still loaded and exported by its name."""

    hf: str
    ours: str
    layout: Layout = AS_IS
    cols: tuple[int, int] | None = None

    def share(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The part of a leaf of ``shape`` (one layer's, for a stacked leaf) that this row's tensor fills."""
        return tuple(shape) if self.cols is None else (*shape[:-1], self.cols[1] - self.cols[0])


def _rows(table: list[Entry]) -> dict[str, list[Entry]]:
    """Our leaf path -> the rows that fill it, in column order; rows sharing a leaf must tile its columns."""
    rows: dict[str, list[Entry]] = {}
    for e in table:
        rows.setdefault(e.ours, []).append(e)
    for path, group in rows.items():
        if len(group) > 1:
            group.sort(key=lambda e: e.cols[0])
            if group[0].cols[0] != 0 or any(a.cols[1] != b.cols[0] for a, b in zip(group, group[1:])):
                raise ValueError(f"name table: the rows of {path} do not tile its columns")
    return rows


def read_safetensors(directory: Path, stem: str = "model") -> dict[str, np.ndarray]:
    """All tensors of ``stem.safetensors`` or of the shards listed in ``stem.safetensors.index.json``."""
    directory = Path(directory)
    single = directory / f"{stem}.safetensors"
    index = directory / f"{stem}.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [directory / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"shard {f} listed in {index} is missing")
    else:
        raise CheckpointError(f"no weights: neither {single} nor {index} exists")
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        tensors.update(read_safetensors_file(f))
    return tensors


_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}


def read_safetensors_file(path: Path) -> dict[str, np.ndarray]:
    """Parse one .safetensors file ourselves: numpy has no bfloat16, and the real checkpoints are bf16.

    The format is an 8-byte little-endian header length, a JSON header of dtype/shape/offsets, then data.
    """
    data = np.memmap(path, dtype=np.uint8, mode="r")
    try:
        (n,) = np.frombuffer(data[:8].tobytes(), dtype="<u8")
        header = json.loads(data[8 : 8 + n].tobytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not a safetensors file: {exc}") from exc
    body = 8 + int(n)
    out = {}
    for key, info in header.items():
        if key == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise CheckpointError(f"{path}: tensor '{key}' has unsupported dtype {info['dtype']}")
        begin, stop = info["data_offsets"]
        if body + stop > data.size:
            raise CheckpointError(f"{path} is truncated: tensor '{key}' ends past the end of the file")
        raw = data[body + begin : body + stop]
        out[key] = raw.view(_DTYPES[info["dtype"]]).reshape(info["shape"])
    return out


def load_table(
    tensors: Mapping[str, np.ndarray],
    table: list[Entry],
    shapes: Mapping[str, tuple[int, ...]],
    dtype,
    what: str,
) -> dict:
    """Fill every leaf in ``shapes`` (our path -> our full shape) from ``tensors`` through ``table``: a flat
    {path: array} dict.

    A leaf whose table template contains ``{i}`` is stacked over its leading axis. Raises
    `CheckpointError` naming the HF tensor on a missing tensor or shape mismatch; logs unused tensors.
    """
    rows = _rows(table)
    flat: dict[str, np.ndarray] = {}
    for path, shape in shapes.items():
        group = rows[path]

        def leaf(shape, i=None):
            parts = [_take(tensors, e.hf.format(i=i), e.layout, e.share(shape), what) for e in group]
            return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=-1)

        if "{i}" in group[0].hf:
            flat[path] = np.stack([leaf(shape[1:], i) for i in range(shape[0])]).astype(dtype)
        else:
            flat[path] = leaf(shape).astype(dtype)
    unused = sorted(set(tensors) - set(hf_shapes(table, shapes)))
    if unused:
        log.debug("%s: %d checkpoint tensors unused: %s", what, len(unused), ", ".join(unused))
    return flat


def hf_shapes(table: list[Entry], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The checkpoint tensors (HF name -> HF shape) that fill the leaves in ``shapes`` through ``table``."""
    rows = _rows(table)
    out = {}
    for path, shape in shapes.items():
        for e in rows[path]:
            if "{i}" in e.hf:
                out.update({e.hf.format(i=i): tuple(e.layout.inverse_shape(e.share(shape[1:])))
                            for i in range(shape[0])})
            else:
                out[e.hf] = tuple(e.layout.inverse_shape(e.share(shape)))
    return out


def load_module(make: Callable[[], nnx.Module], flat: Mapping[str, np.ndarray] | Callable) -> nnx.Module:
    """The module `make()` builds, its weights taken from ``flat`` ("a/b/c" path -> array, cast to the
    parameter's dtype) instead of drawn: ``make`` runs abstractly (`nnx.eval_shape`), so nothing random is
    computed. ``flat`` may also be a function of the module's `state_shapes` that returns that dict (a name
    table's loader)."""
    abstract = nnx.eval_shape(make)
    if callable(flat):
        flat = flat(state_shapes(abstract))
    graph, state = nnx.split(abstract)
    leaves = []
    for path, var in nnx.to_flat_state(state):
        name = "/".join(map(str, path))
        value = jnp.asarray(flat[name], var.dtype)
        if value.shape != var.shape:
            raise ValueError(f"{name}: {value.shape} given for a parameter of shape {var.shape}")
        leaves.append((path, var.replace(value)))
    return nnx.merge(graph, nnx.from_flat_state(leaves))


def _take(tensors, name: str, layout: Layout, shape: tuple[int, ...], what: str) -> np.ndarray:
    expected_hf = tuple(layout.inverse_shape(tuple(shape)))
    if name not in tensors:
        raise CheckpointError(f"{what}: tensor '{name}' is missing (expected shape {expected_hf})")
    value = tensors[name]
    if tuple(value.shape) != expected_hf:
        raise CheckpointError(
            f"{what}: tensor '{name}' has shape {tuple(value.shape)}, expected {expected_hf}"
        )
    return np.asarray(layout.forward(np.asarray(value, dtype=np.float32)))


def table_tensors(flat: Mapping[str, np.ndarray], table: list[Entry]) -> dict[str, np.ndarray]:
    """The inverse of `load_table`: every leaf of ``flat`` ("a/b/c" path -> array, as `nn.flat_params` gives a
    module's) under its Hugging Face name through ``table``, fp32, stacked leaves split per index."""
    rows = _rows(table)
    out = {}
    for path, value in flat.items():
        value = np.array(value, np.float32)  # a writable copy
        for e in rows[path]:
            part = value if e.cols is None else value[..., e.cols[0]:e.cols[1]]
            if "{i}" in e.hf:
                out.update({e.hf.format(i=i): np.ascontiguousarray(e.layout.inverse(v)) for i, v in enumerate(part)})
            else:
                out[e.hf] = np.ascontiguousarray(e.layout.inverse(part))
    return out


def write_safetensors_file(path: Path, tensors: Mapping[str, np.ndarray]) -> None:
    """The format `read_safetensors_file` reads (bf16 through ml_dtypes), header padded to 8 bytes as the
    safetensors library does."""
    names = {v: k for k, v in _DTYPES.items()}
    header, offset = {}, 0
    for key in sorted(tensors):
        a = tensors[key]
        header[key] = {"dtype": names[a.dtype.type], "shape": list(a.shape),
                       "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for key in sorted(tensors):
            f.write(np.ascontiguousarray(tensors[key]).tobytes())

