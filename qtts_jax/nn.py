"""What every model part shares as a Flax NNX module: the initialisers of its `nnx.Param`s (random-weight presets
and benchmarks draw from these, the output is noise; a checkpoint replaces every one, `checkpoint.load_module`),
the split/merge through which the jitted programs take a module's weights as a plain pytree, the arithmetic the
talker's and the codec's transformers both use (RMSNorm, rotate-half RoPE), and the table lookup whose gradient
training can afford (`rows`)."""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx


def dense(rngs: nnx.Rngs, shape: tuple[int, ...], dtype) -> nnx.Param:
    """A weight for `x @ w` ((in, out), maybe behind stacking axes): N(0, 1/fan_in), so random-weight
    presets keep activations O(1) through the stacks."""
    return nnx.Param((jax.random.normal(rngs.params(), shape, jnp.float32) * shape[-2] ** -0.5).astype(dtype))


def embedding(rngs: nnx.Rngs, shape: tuple[int, ...], dtype) -> nnx.Param:
    """A lookup table: N(0, 1) rows."""
    return nnx.Param(jax.random.normal(rngs.params(), shape, jnp.float32).astype(dtype))


def ones(shape: tuple[int, ...], dtype) -> nnx.Param:
    return nnx.Param(jnp.ones(shape, dtype))


def zeros(shape: tuple[int, ...], dtype) -> nnx.Param:
    return nnx.Param(jnp.zeros(shape, dtype))


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Normalise in fp32, cast back, then scale (the reference's order, which matters in bf16)."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * y.astype(x.dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [..., T, heads, D] with cos/sin [..., T, D] (shared or per row); rotate-half RoPE."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[..., None, :] + rotated * sin[..., None, :]


def rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """``table[ids]`` ([V, D] rows for ids of any shape), whose gradient sums the rows of each id before it writes
    the table. A plain gather's gradient adds every position into its row one by one with atomics, and a training
    batch reads a few rows thousands of times (tts_pad beside every frame, a padding row wherever a part is absent),
    and that scatter took a sixth of a training step. Call it on the whole batch, not under `jax.vmap`:
    there, JAX's rule for a custom gradient would make a table-sized gradient per row and then sum them."""
    vocab, dtype = table.shape[0], table.dtype

    @jax.custom_vjp
    def lookup(t, i):
        return t[i]

    def forward(t, i):
        return t[i], i

    def backward(i, g):
        return _row_sums(g, i, vocab, dtype), None

    lookup.defvjp(forward, backward)
    return lookup(table, jnp.asarray(ids))


def _row_sums(g: jax.Array, ids: jax.Array, vocab: int, dtype) -> jax.Array:
    """[vocab, D] in ``dtype``: the sum of g's rows [..., D] per id, added in fp32. The ids are sorted, a segmented
    scan adds each id's rows in order, and only each id's last sum is written: no two updates reach one row."""
    d = g.shape[-1]
    ids, g = ids.reshape(-1), g.reshape(-1, d).astype(jnp.float32)
    if ids.shape[0] == 0:
        return jnp.zeros((vocab, d), dtype)
    order = jnp.argsort(ids, stable=True)
    ids, g = ids[order], g[order]
    new = ids[1:] != ids[:-1]
    _, sums = jax.lax.associative_scan(_segment_add, (jnp.concatenate([jnp.ones(1, bool), new]), g))
    last = jnp.concatenate([new, jnp.ones(1, bool)])
    at = jnp.where(last, ids, vocab + jnp.arange(ids.shape[0]))  # every other row out of range, each its own: dropped
    return jnp.zeros((vocab, d), dtype).at[at].set(sums.astype(dtype), mode="drop", unique_indices=True)


def _segment_add(a, b):
    """The segmented sum's operator on (starts a segment, value) pairs: a start discards what came before it."""
    (start_a, a), (start_b, b) = a, b
    return start_a | start_b, jnp.where(start_b[:, None], b, a + b)


class Conv(nnx.Module):
    """A Conv1d's (or a ConvTranspose1d's, kept unflipped) weights, channels last: w [k, in, out] and bias [out]
    (or none). Zeros: the codec's and the speaker encoder's weights come from a checkpoint or a seeded draw."""

    def __init__(self, k: int, cin: int, cout: int, bias: bool = True, dtype=jnp.float32):
        self.w = zeros((k, cin, cout), dtype)
        self.b = zeros((cout,), dtype) if bias else None


def split(module: nnx.Module) -> tuple[nnx.GraphDef, dict]:
    """A module's graph definition (static: what a jitted program closes over) and its state as a plain nested
    dict of arrays (what the program takes). Done once at load; a dict flattens in C++, an `nnx.State` in Python,
    which a per-frame call would pay on every dispatch."""
    graph, state = nnx.split(module)
    return graph, nnx.to_pure_dict(state)


@functools.lru_cache(maxsize=None)
def graph_of(module_type: type[nnx.Module], cfg) -> nnx.GraphDef:
    """The graph definition of `module_type(cfg)`, built abstractly (no arrays), once per type and config: what a
    forward merges with the plain dict of weights it is given."""
    return nnx.graphdef(nnx.eval_shape(lambda: module_type(cfg)))


def merge(graph: nnx.GraphDef, state) -> nnx.Module:
    """The module back from `split`'s halves (or from `nnx.split(module, nnx.Param)`'s): inside a traced function
    this runs once, at trace time, and the module's arrays are the function's inputs."""
    return nnx.merge(graph, state)


def stacked(n: int, make: Callable[..., nnx.Module], rngs: nnx.Rngs | None = None) -> nnx.Module:
    """``make()`` (or ``make(rngs)``, each copy from its own keys) built ``n`` times under `nnx.vmap`: one module
    whose every parameter has a leading axis of ``n``, the layer stack that `scan` runs."""
    if rngs is None:
        return nnx.vmap(make, in_axes=(), out_axes=0, axis_size=n)()
    return nnx.split_rngs(splits=n)(nnx.vmap(make, in_axes=0, out_axes=0))(rngs)


def scan(layers: nnx.Module, body: Callable, carry, *xs, unroll: int | bool = 1):
    """`jax.lax.scan` over a `stacked` module: ``body(layer, carry, *x) -> (carry, y)``, each step's layer
    merged back from its slice of the stacked state (at trace time: the scan's arrays are the state's). `unroll` as
    `jax.lax.scan`'s (True: straight-line code, no loop)."""
    graph, state = nnx.split(layers)
    return jax.lax.scan(lambda c, a: body(nnx.merge(graph, a[0]), c, *a[1:]), carry, (state, *xs), unroll=unroll)


def state_shapes(module: nnx.Module) -> dict[str, tuple[int, ...]]:
    """Every `nnx.Param` of a module (or of its `nnx.eval_shape` abstract twin): "a/b/c" path -> shape."""
    return {path: tuple(v.shape) for path, v in _flat(module)}


def flat_params(module: nnx.Module) -> dict[str, jax.Array]:
    """Every `nnx.Param` of a module: "a/b/c" path -> array, the form `checkpoint.load_module` fills a module from
    and `checkpoint.table_tensors` writes out (exports)."""
    return {path: v[...] for path, v in _flat(module)}


def _flat(module: nnx.Module):
    return (("/".join(map(str, path)), v) for path, v in nnx.to_flat_state(nnx.state(module, nnx.Param)))
