"""DeMo: momentum kept on each device; its largest DCT components exchanged; a sign update.

``scale_by_demo`` does the exchange (momentum, chunked orthonormal DCT-II, top-k per chunk
through :func:`jaxcomp.chunked_top_k`, all-gather, inverse DCT) and ``demo`` chains it with
optax's decoupled weight decay and learning rate, as ``optax.adamw`` chains its parts.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomp._src import shards, skeleton, sparse_exchange
from jaxcomp._src.codecs.base import (
    ceil_div,
    check_decay,
    check_int,
    check_scalar_array,
    is_array,
    is_number,
)
from jaxcomp._src.codecs.chunked import chunked_top_k

F32 = jnp.float32


@functools.cache
def dct_matrix(b: int) -> np.ndarray:
    """The orthonormal DCT-II matrix ``D`` (``b x b``): ``X = D x`` is ``scipy.fft.dct(x,
    norm="ortho")`` and ``x = D^T X``. One read-only array per side ``b``, built once."""
    n = np.arange(b)
    d = np.sqrt(2.0 / b) * np.cos(np.pi * (2 * n[None, :] + 1) * n[:, None] / (2 * b))
    d[0] /= np.sqrt(2.0)
    d = d.astype(np.float32)
    d.setflags(write=False)
    return d


def block_side(n: int, chunk: int) -> int:
    """The side of the blocks that cut a dimension of ``n`` values, given the target ``chunk``:

    - ``n`` itself where ``n <= chunk`` (one block);
    - else the largest divisor of ``n`` in ``[ceil(chunk / 2), chunk]`` (``chunk`` itself where
      it divides ``n``): ``n / side`` equal blocks, none padded (96 -> 48, 160 -> 40);
    - else ``chunk``, the last block zero-padded: ``n`` has no divisor there (a prime such as
      97, or 130 = 2 x 5 x 13).

    A ``b1 x b2`` block sends ``topk b1 b2 / chunk^2`` components, rounded up (:func:`_codec`),
    so the divided cut pays for the leaf's own values where the padded one pays for its zeros
    too (a 96 x 96 leaf padded to 128 x 128 sends four full blocks' components; cut by 48, four
    of 12). Rounding up per block and the floor of one component can cost a few more on a
    short vector (160 values: four blocks of 40, one component each, against three of 64).
    The lower bound keeps a dimension from many tiny blocks (a prime would be cut into blocks
    of 1), each with a scale and at least one component. DeMo's reference implementation
    likewise cuts each dimension by a divisor near the target chunk."""
    if n <= chunk:
        return n
    for side in range(chunk, (chunk + 1) // 2 - 1, -1):
        if n % side == 0:
            return side
    return chunk


def matrix_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """``(rows, cols)`` of a leaf viewed as a matrix: a scalar is ``1 x 1``, a vector one row,
    more dimensions fold into the rows."""
    if len(shape) <= 1:
        return 1, math.prod(shape)
    return math.prod(shape[:-1]), shape[-1]


@dataclasses.dataclass(frozen=True)
class Blocks:
    """How one leaf is cut for the DCT: viewed as a ``rows x cols`` matrix (a vector is one
    row; more dimensions fold into the rows), cut into ``b1 x b2`` blocks, each side chosen by
    :func:`block_side` (zero-padded to whole blocks only where a dimension has no divisor
    near ``chunk``)."""

    shape: tuple[int, ...]
    b1: int
    b2: int

    @staticmethod
    def of(shape: tuple[int, ...], chunk: int) -> Blocks:
        rows, cols = matrix_shape(tuple(shape))
        return Blocks(tuple(shape), block_side(rows, chunk), block_side(cols, chunk))

    @property
    def grid(self) -> tuple[int, int]:
        rows, cols = matrix_shape(self.shape)
        return ceil_div(rows, self.b1), ceil_div(cols, self.b2)

    @property
    def size(self) -> int:
        """Coefficients: ``n1 n2 b1 b2`` (each block's ``b1 b2`` contiguous)."""
        n1, n2 = self.grid
        return n1 * n2 * self.b1 * self.b2

    def forward(self, x: jax.Array) -> jax.Array:
        """``f32[size]``: the 2-D DCT of every block, blocks laid end to end."""
        n1, n2 = self.grid
        m = x.reshape(matrix_shape(self.shape))
        m = jnp.pad(m, ((0, n1 * self.b1 - m.shape[0]), (0, n2 * self.b2 - m.shape[1])))
        r = m.reshape(n1, self.b1, n2, self.b2)
        d1, d2 = dct_matrix(self.b1), dct_matrix(self.b2)
        return jnp.einsum("ij,ajbk,lk->abil", d1, r, d2).reshape(-1)

    def inverse(self, coeffs: jax.Array) -> jax.Array:
        """The leaf (its shape, float32) whose blocks' DCT is ``coeffs`` (padding cropped)."""
        n1, n2 = self.grid
        c = coeffs.reshape(n1, n2, self.b1, self.b2)
        d1, d2 = dct_matrix(self.b1), dct_matrix(self.b2)
        m = jnp.einsum("ji,abjl,lk->aibk", d1, c, d2).reshape(n1 * self.b1, n2 * self.b2)
        rows, cols = matrix_shape(self.shape)
        return m[:rows, :cols].reshape(self.shape)


class DeMoState(NamedTuple):
    """State of :func:`scale_by_demo`. Under ``shard_map`` use :func:`jaxcomp.state_specs`.

    Attributes:
      momentum: per device: f32[1, *shape] per float leaf (MaskedNode at integer leaves)
      count: int32[]: number of updates applied
    """

    momentum: Any
    count: jax.Array

    PER_DEVICE_FIELDS = ("momentum",)


def _codec(blocks: Blocks, chunk: int, topk: int, bits: int | None, min_topk: int = 1):
    """The chunked top-k of one leaf: one chunk per block, ``topk`` per ``chunk x chunk``
    block (fewer in smaller blocks, the same density, at least ``min_topk``)."""
    c = blocks.b1 * blocks.b2
    k = topk if c == chunk * chunk else max(min_topk, math.ceil(topk * c / (chunk * chunk) - 1e-9))
    return chunked_top_k(min(k, c), c, bits)


def _is_float(x: Any) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _exchange_leaves(moms: list, cfg: tuple) -> tuple[list, list, jax.Array]:
    """The mean of every momentum leaf over the devices (through the top-k of its blocks'
    DCT components, or exact below ``min_size``), what this device sent, and the flag."""
    chunk, topk, bits, axis_name, min_size, min_topk = cfg
    blocks = [Blocks.of(m.shape, chunk) for m in moms]
    dense = [m.size < max(min_size, 1) for m in moms]
    vectors = [
        m.reshape(-1) if flat else b.forward(m)
        for m, b, flat in zip(moms, blocks, dense, strict=True)
    ]
    codecs = [
        None if flat else _codec(b, chunk, topk, bits, min_topk)
        for b, flat in zip(blocks, dense, strict=True)
    ]
    ex = sparse_exchange.exchange(vectors, codecs, axis_name)

    def back(v, m, b, flat):
        return v.reshape(m.shape) if flat else b.inverse(v)

    parts = list(zip(moms, blocks, dense, strict=True))
    means = [back(q, *p) for q, p in zip(ex.means, parts, strict=True)]
    sent = [back(s, *p) for s, p in zip(ex.sent, parts, strict=True)]
    return means, sent, ex.bad


def scale_by_demo(
    axis_name: Any,
    *,
    chunk: int = 64,
    topk: int = 16,
    decay: float = 0.999,
    sign: bool = True,
    bits: int | None = 8,
    min_size: int = 0,
    min_topk: int = 1,
    shard_axis: Any = None,
) -> optax.GradientTransformation:
    r"""DeMo's exchange: ``m_i <- decay m_i + g_i``; the top-``topk`` DCT components of each
    ``chunk x chunk`` block of ``m_i`` are all-gathered and subtracted from ``m_i``; the output
    is ``sign(q)`` (or ``q``), ``q`` the inverse DCT of their mean. See :func:`demo`; a block
    smaller than ``chunk x chunk`` (a vector's ``1 x chunk``) sends at least ``min_topk``
    components (default 1: the same density as a full block).

    Args:
      axis_name: the data-parallel mesh axis (bound by ``shard_map`` or ``pmap``).
      chunk: the target block side, in [1, 4096] (as :func:`demo`).
      topk: components sent per ``chunk x chunk`` block, in [1, chunk^2].
      decay: the momentum's decay, in [0, 1]: a number, or a 0-d float array (a
        hyperparameter ``optax.inject_hyperparams`` passes; checked where concrete).
      sign: output ``sign(q)`` (DeMo) or ``q`` itself.
      bits: bits per sent value, in [1, 8], or None for float32 values.
      min_size: leaves with fewer values are averaged exactly, >= 0.
      min_topk: the fewest components a block smaller than ``chunk x chunk`` sends, >= 1.
      shard_axis: the mesh axis (or tuple) over which the gradients are shards of one model
        (FSDP over ``"data"`` inside each group averaged over ``axis_name``), as
        :func:`jaxcomp.compressed_allreduce`'s: the non-finite flag is or-ed over it (one
        scalar ``psum``), so a non-finite shard poisons every shard's update and keeps every
        shard's momentum. Under ``check_vma=True`` jax's types tell (None works); under
        ``check_vma=False`` they do not, and with another manual axis bound beside
        ``axis_name`` the update warns where this is None. ``()``: the leaves are whole, no
        warning.

    Returns:
      An ``optax.GradientTransformation`` whose state is a :class:`DeMoState`; its update
      returns the direction before the learning rate (chain ``optax.scale_by_learning_rate``).

    Raises:
      ValueError: at construction, ``chunk``, ``topk``, ``decay``, ``bits``, ``min_size`` or
        ``min_topk`` outside its rule (the message names the argument; the rules:
        docs/errors.md).
      TypeError: at construction, ``chunk``, ``topk``, ``decay``, ``sign``, ``bits``,
        ``min_size``, ``min_topk`` or ``shard_axis`` of the wrong kind.
    """
    chunk, topk, decay, bits, min_size = check_demo(chunk, topk, decay, bits, min_size)
    if not isinstance(sign, bool):
        raise TypeError(f"`sign` must be a bool, got {sign!r}")
    min_topk = check_int("min_topk", min_topk, 1)
    shard_axis = shards.check_shard_axis(shard_axis)

    def init_fn(params):
        mom = [
            jnp.zeros((1, *jnp.shape(x)), F32) if _is_float(x) else optax.MaskedNode()
            for x in jax.tree.leaves(params)
        ]
        return DeMoState(
            jax.tree.unflatten(jax.tree.structure(params), mom), jnp.zeros([], jnp.int32)
        )

    def update_fn(updates, state, params=None):
        skeleton.begin("demo", updates, params, axis_name)
        skeleton.check_floating("demo", updates)
        want = {"momentum": jax.eval_shape(init_fn, updates).momentum}
        skeleton.check_fields("demo", state, want, axis_name, updates=updates)
        leaves, treedef = jax.tree.flatten(updates)
        mom_in = treedef.flatten_up_to(state.momentum)
        floats = [i for i, x in enumerate(leaves) if _is_float(x)]
        moms = [decay * mom_in[i][0] + leaves[i].astype(F32) for i in floats]
        cfg = (chunk, topk, bits, axis_name, min_size, min_topk)
        means, sent, bad = _exchange_leaves(moms, cfg)
        out, mom_out = list(leaves), list(mom_in)
        for j, i in enumerate(floats):
            q = jnp.sign(means[j]) if sign else means[j]
            out[i] = q.astype(leaves[i].dtype)
            mom_out[i] = (moms[j] - sent[j])[None]
        new = DeMoState(jax.tree.unflatten(treedef, mom_out), state.count + 1)
        return jax.tree.unflatten(treedef, out), skeleton.freeze(bad, state, new)

    update_fn = shards.with_shard_axis(update_fn, "jc.demo", axis_name, shard_axis)
    return optax.GradientTransformation(init_fn, update_fn)


def check_demo(chunk: Any, topk: Any, decay: Any, bits: Any, min_size: Any) -> tuple:
    """The arguments of :func:`demo` checked, each error naming its argument."""
    chunk = check_int("chunk", chunk, 1, 4096)
    topk = check_int("topk", topk, 1, chunk * chunk)
    decay = check_decay("decay", decay)  # 1: plain accumulation, nothing lost
    if bits is not None:
        bits = check_int("bits", bits, 1, 8)
    return chunk, topk, decay, bits, check_int("min_size", min_size, 0)


def weight_decay_step(weight_decay: Any) -> optax.GradientTransformation:
    """``optax.add_decayed_weights(weight_decay)``, or ``optax.identity()`` for a Python zero.
    Checks ``weight_decay`` >= 0 and finite, naming it. An array (``optax.inject_hyperparams``:
    concrete to ``init``, traced to ``update``) always gets the decay, even a zero: both then
    build the same chain, whose states must match (``g + 0 theta`` is ``g``, bit for bit)."""
    if is_array(weight_decay):
        check_scalar_array("weight_decay", weight_decay)
        if not isinstance(weight_decay, jax.core.Tracer):
            weight_decay_step(float(weight_decay))
        return optax.add_decayed_weights(weight_decay)
    if not is_number(weight_decay):
        raise TypeError(f"`weight_decay` must be a number >= 0, got {weight_decay!r}")
    if not weight_decay >= 0 or not math.isfinite(weight_decay):
        raise ValueError(f"`weight_decay` must be >= 0 and finite, got {weight_decay}")
    return optax.add_decayed_weights(weight_decay) if weight_decay else optax.identity()


def demo(
    learning_rate: optax.ScalarOrSchedule,
    axis_name: Any,
    *,
    chunk: int = 64,
    topk: int = 16,
    decay: float = 0.999,
    weight_decay: float = 0.0,
    sign: bool = True,
    bits: int | None = 8,
    min_size: int = 0,
    shard_axis: Any = None,
) -> optax.GradientTransformation:
    r"""DeMo (Decoupled Momentum): momentum on each device, only its fast components sent.

    For every float leaf, on device ``i`` with gradient ``g_i``::

        m_i <- decay m_i + g_i                                  # momentum, never averaged
        M_i  = DCT(m_i)                # orthonormal DCT-II of each chunk x chunk block
        S_i  = top-k of each block of M_i (topk per block; bits-bit values)
        m_i <- m_i - IDCT(S_i)                                  # the sent part leaves m_i
        q    = IDCT(mean_i S_i)                                 # all-gather, mean
        theta <- theta - lr (sign(q) + weight_decay theta)     # sign=False: q instead

    A leaf is viewed as a matrix (a vector is one row; more dimensions fold into the rows)
    cut into equal blocks, each side chosen per dimension of ``n`` values by
    :func:`block_side`: ``n`` where ``n <= chunk``, else the largest divisor of ``n`` in
    ``[ceil(chunk / 2), chunk]`` (``chunk`` for a multiple of it; 96 -> two blocks of 48),
    else ``chunk`` with the last block zero-padded (no such divisor: a prime such as 97).
    A block of ``b1 x b2`` sends ``topk b1 b2 / chunk^2`` components (rounded up; at least
    one): the same density as a ``chunk x chunk`` block. As in DeMo's reference code, which
    cuts each dimension by a divisor near the target chunk; until 2026-11-27 every dimension
    over ``chunk`` was cut into ``chunk``-wide blocks, the last zero-padded, so a 96 x 96 leaf
    sent four full blocks' components (docs, "Language models over slow links: the
    measurements", DeMo: the bytes before and after). The components travel as a
    :func:`jaxcomp.chunked_top_k` payload, one chunk per block: indices in
    ``ceil(log2 chunk^2)`` bits (12 for 64), values in ``bits`` bits with a float32 scale
    per block, in one all-gather; at the defaults 44 bytes per 64 x 64 block (16384 bytes in
    float32). Every leaf is sent so by default, the norms and biases too (a vector of 128
    values is two 1 x 64 blocks, one component each); leaves under ``min_size`` values send
    their whole momentum by a float32 ``pmean`` instead (and keep none), which on a small
    model costs as many bytes as every matrix's components. The update is the same on every
    device: params stay replicated. The DCT is a matrix product per block (on XLA:CPU 1.7x
    faster than ``jax.scipy.fft.dct``, measured on a 1024 x 1024 leaf). A non-finite gradient
    on any device gives NaN updates everywhere and keeps every momentum as it was.

    Args:
      learning_rate: a float or an optax schedule of the step count. Every coordinate moves
        by it at every step (``sign=True``), so a schedule that decays the lr shrinks every
        step alike: AdamW's peak and warm-up, then the peak held to the end
        (``optax.linear_schedule(0, peak, warmup)``), trains an LM better than AdamW's
        cosine decay, and the peak decayed linearly to a tenth over the last 20% of the
        steps better still (docs, "Language models over slow links: the
        measurements"). The peak follows the model's width, as a sign step moves every coordinate
        by it: ``3e-3 x 128 / d_model`` on the LM benchmark's models (found on widths 64 and
        128, confirmed on 192), with a warm-up over 2% of the steps (docs, "Training
        language models over slow links"). Under ``optax.inject_hyperparams`` (a schedule
        held in the state) ``decay`` and ``weight_decay`` may be scheduled too; the other
        numbers stay static configuration (an array of one is refused, naming it):
        ``optax.inject_hyperparams(jc.demo, static_args=("chunk", "topk", "bits",
        "min_size"))``.
      axis_name: the data-parallel mesh axis (bound by ``shard_map`` or ``pmap``).
      chunk: the target block side, in [1, 4096] (DeMo: 64): a dimension that is not a
        multiple of it is cut by a divisor near it (:func:`block_side`).
      topk: components sent per ``chunk x chunk`` block, in [1, chunk^2] (default 16 of 4096;
        DeMo's paper: 32). 18 with ``bits=4`` costs the same 44 bytes per 64 x 64 block as
        16 with 8 bits, and fewer in the small blocks of vectors; 20 with ``bits=3`` about 4%
        more, and trained the held-out LM of the docs closer to AdamW (docs, "Language
        models over slow links: the measurements", DeMo). :func:`jaxcomp.demo_topk` sizes it
        for a ratio of bytes on given params, :func:`jaxcomp.demo_ratio` gives its ratio.
      decay: the momentum's decay, in [0, 1] (DeMo: 0.999; 1: plain accumulation). The
        unsent momentum lives about ``1 / (1 - decay)`` steps: on runs of hundreds of steps
        a shorter memory (0.9-0.95) did better on the LM benchmark than DeMo's 0.999. A
        number, or a 0-d float array (what ``optax.inject_hyperparams`` passes; checked in
        [0, 1] where concrete).
      weight_decay: decoupled weight decay (as ``optax.adamw``), >= 0: a number, or a 0-d
        float array (checked where concrete; an array always chains the decay, a zero too).
      sign: apply ``sign(q)`` (DeMo) or ``q`` itself.
      bits: bits per sent value, in [1, 8] (default 8), or None for float32 values.
      min_size: leaves with fewer values are averaged exactly, >= 0 (default 0: none; on the
        LM benchmark ``min_size=1024`` ends at the same loss with 1.6x the bytes).
      shard_axis: the mesh axis (or tuple) over which the gradients are shards of one model
        (FSDP over ``"data"`` inside each group averaged over ``axis_name``), as
        :func:`jaxcomp.compressed_allreduce`'s: the non-finite flag is or-ed over it (one
        scalar ``psum``), so a non-finite shard poisons every shard's update and keeps every
        shard's momentum. Under ``check_vma=True`` jax's types tell (None works); under
        ``check_vma=False`` they do not, and with another manual axis bound beside
        ``axis_name`` the update warns where this is None. ``()``: the leaves are whole, no
        warning.

    Returns:
      An optax ``GradientTransformation`` (a chain: :func:`scale_by_demo`, decoupled weight
      decay, the learning rate); its first state is a :class:`DeMoState`.
      Its update refuses gradient leaves that are not floating (integer, bool, ``float0``)
      with a TypeError naming them (the exchange transforms pass them through): keep
      integer params out of the tree it optimizes (docs/errors.md).

    Raises:
      ValueError: at construction, ``chunk``, ``topk``, ``decay``, ``weight_decay``, ``bits`` or
        ``min_size`` outside its rule (the message names the argument; the rules: docs/errors.md).
      TypeError: at construction, ``chunk``, ``topk``, ``decay``, ``weight_decay``, ``sign``,
        ``bits``, ``min_size`` or ``shard_axis`` of the wrong kind.

    Example (the setting measured on the LM benchmark: AdamW's peak lr 3e-3 and warm-up of
    15 steps, no decay after; momentum decay 0.95 for runs of hundreds of steps)::

        sched = optax.linear_schedule(0.0, 3e-3, 15)
        tx = jc.demo(sched, "data", decay=0.95, topk=18, bits=4, weight_decay=0.1)
        opt_state = jc.sharded_init(tx, params, mesh, "data")

        def step(params, opt_state, batch):          # inside jax.shard_map over "data"
            p = jax.lax.pcast(params, "data", to="varying")
            g = jax.grad(loss)(p, batch)
            u, opt_state = tx.update(g, opt_state, params)
            return optax.apply_updates(params, u), opt_state

    References:
      Peng, Quesnelle, Kingma, "DeMo: Decoupled Momentum Optimization", arXiv 2411.19870,
      2024; Loshchilov, Hutter, "Decoupled Weight Decay Regularization", ICLR 2019.
    """
    decay_step = weight_decay_step(weight_decay)
    return optax.chain(  # scale_by_demo checks the other arguments
        scale_by_demo(
            axis_name,
            chunk=chunk,
            topk=topk,
            decay=decay,
            sign=sign,
            bits=bits,
            min_size=min_size,
            shard_axis=shard_axis,
        ),
        decay_step,
        optax.scale_by_learning_rate(learning_rate),
    )


def wire_bytes(
    params: Any, n: int, *, chunk: int = 64, topk: int = 16, bits=8, min_size=0, min_topk=1
):
    """Ring-model bytes per device of one :func:`demo` step over ``n`` devices (``min_topk``:
    :func:`scale_by_demo`'s)."""
    shapes = [jnp.shape(x) for x in jax.tree.leaves(params) if _is_float(x)]
    sizes, codecs = [], []
    for s in shapes:
        blocks, size = Blocks.of(tuple(s), chunk), math.prod(s)
        dense = size < max(min_size, 1)
        sizes.append(size if dense else blocks.size)
        codecs.append(None if dense else _codec(blocks, chunk, topk, bits, min_topk))
    return sparse_exchange.wire_bytes(sizes, codecs, n)
