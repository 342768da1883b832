"""FSDP / ZeRO-3 through compressed collectives: a weight gather whose gradient is compressed.

``fsdp_gather`` is :func:`jax.lax.all_gather` (``tiled=True``) of the weight shards with a
custom VJP: its forward all-gathers through the ``weights`` codec (ZeRO++ qwZ), its transpose
reduce-scatters the cotangents through the ``grads`` codec (qgZ). So ``jax.grad`` of a loss of
the gathered weights hands each device the gradient of its shard, summed over the devices, as
``jax.lax.all_gather``'s own transpose does, and the optimizer steps on the shards (its state
sharded too).

Error feedback (``residual=``): device ``j`` adds to its cotangent ``g_j`` what its codec
dropped last time, ``v_j = g_j + e_j``, sends ``C(v_j)`` and keeps ``e_j' = v_j - C(v_j)``.
The residual rides the VJP: it is an input of ``fsdp_gather`` whose value the forward ignores
and whose "gradient" is ``e_j'``; one ``jax.grad(loss, argnums=(0, 1))`` returns the shard
gradients and the new residual. A non-finite step keeps the old residual (so does one
whose finite sum overflows a narrow leaf's dtype: every device's gradient is then NaN).

hpZ: with ``inner_axis_name`` the gather is two hops, the codec over the slow ``axis_name``
first, then ``jax.lax.all_gather`` over the fast inner axis (whose transpose is a
reduce-scatter over the inner axis in the leaves' dtype, before the compressed one; with error
feedback on bf16 / fp16 leaves the fast hop runs inside the VJP and sums in float32, so that
its rounding is kept in the residual too). The slow hop's result is
named ``"fsdp_secondary"`` (``jax.ad_checkpoint.checkpoint_name``): under
``jax.checkpoint(..., policy=jax.checkpoint_policies.save_only_these_names("fsdp_secondary"))``
it is kept (``1/L`` of the weights per device, ZeRO++'s secondary partition) and the backward
re-gather crosses only the fast axis.
"""

from __future__ import annotations

import functools
import inspect
import sys
import warnings
import weakref
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import SymbolicZero

from jaxcomp._src import buckets
from jaxcomp._src.axes import axis_names, check_axis_name, manual_axes, tracks_variance
from jaxcomp._src.codecs.base import Codec
from jaxcomp._src.codecs.quantize import int_quant
from jaxcomp._src.collectives import axis_size, check_inner_axis
from jaxcomp._src.sharded import (
    exact,
    exact_scatter,
    gather_outer,
    scatter_rows,
    tile,
    two_hop_stack,
)
from jaxcomp._src.skeleton import invariant_leaves, varying_axes, varying_like, varying_over

try:  # trace_ctx: the trace a call is recorded into (private; without it: a warning)
    from jax._src import core as jax_core
except ImportError:  # a jax that moved it
    jax_core = None

#: The name of the slow hop's result (hpZ's secondary partition) for ``jax.checkpoint`` policies.
SECONDARY = "fsdp_secondary"


class _Config(NamedTuple):
    """Static (hashable) configuration of one ``fsdp_gather``."""

    axis_name: Any
    inner_axis_name: Any
    weights: Codec | None
    grads: Codec | None
    bucket_bytes: int
    varying: frozenset  # the mesh axes the shards vary over
    fast_inside: bool = False  # the fast hop inside the VJP: its sum in float32 (narrow + EF)
    skip_axes: tuple = ()  # other mesh axes the non-finite flag is or-ed over (skip_axis)


def _keeps_fast_rounding(inner_axis_name: Any, grads: Any, residual: Any, leaves: list) -> bool:
    """Whether the fast hop's transpose runs inside the VJP in float32: two hops, error
    feedback through a lossy ``grads`` codec, and a leaf narrower than float32 (bf16, fp16),
    whose sum over the inner axis jax would round to its dtype, out of the residual's reach.
    Elsewhere the fast hop stays ``jax.lax.all_gather`` and its own transpose."""
    if inner_axis_name is None or residual is None or grads is None or exact(grads):
        return False
    return any(
        jnp.issubdtype(a.dtype, jnp.floating) and jnp.finfo(a.dtype).bits < 32 for a in leaves
    )


def _check_codec(name: str, codec: Any, need_dense: bool) -> Codec | None:
    """``codec`` as a codec that can serve ``name`` (or None), else an error saying why."""
    if codec is None:
        return None
    if not isinstance(codec, Codec):
        raise TypeError(
            f"`{name}` must be a jaxcomp codec or None, got {type(codec).__name__} {codec!r}"
        )
    if codec.stochastic or codec.shared_randomness:
        raise ValueError(
            f"`{name}`={codec.name} is stochastic and fsdp_gather has no key to draw its "
            "noise: use a deterministic codec (e.g. jc.int_quant(8)) or jc.all_gather / "
            "jc.psum_scatter with `key=`"
        )
    if need_dense and not codec.dense:
        raise ValueError(
            f"`{name}`={codec.name} is sparse: it sends only the selected coordinates, so "
            "most gathered weights would be zero; use a dense codec (jc.int_quant(8), "
            "jc.cast('bf16')) or None"
        )
    return codec


def _stacked(shards: list, cfg: _Config) -> list:
    out, _ = gather_outer(shards, cfg.axis_name, cfg.weights, None, cfg.bucket_bytes)
    return out


def _both_hops(shards: list, cfg: _Config) -> list:
    """The slow hop, then (``cfg.fast_inside``) the fast one: ``[H * L, *shard.shape]``."""
    stacked = _stacked(shards, cfg)
    if not cfg.fast_inside:
        return stacked
    return [two_hop_stack(checkpoint_name(s, SECONDARY), cfg.inner_axis_name) for s in stacked]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _gather(shards: list, residual: Any, cfg: _Config) -> list:
    """``[n, *shard.shape]`` per leaf over ``cfg.axis_name`` (``[H * L, ...]`` over both axes
    with ``cfg.fast_inside``); the residual is not read."""
    return _both_hops(shards, cfg)


def _gather_fwd(shards, residual, cfg):
    """The forward rule. With ``symbolic_zeros`` each leaf comes as jax's
    ``CustomVJPPrimal``: its ``value`` and whether jax differentiates it (``perturbed``)."""
    _check_fed_back(shards, residual)
    values = None if residual is None else [r.value for r in residual]
    return _both_hops([s.value for s in shards], cfg), values


def _check_fed_back(shards: list, residual: list | None) -> None:
    """Refuse a residual that jax does not differentiate where it differentiates the shards.

    The new residual ``e_j' = G_j + e_j - C(G_j + e_j)`` is the residual's cotangent: left
    out of ``jax.grad``'s ``argnums`` (or closed over by the loss, or behind a
    ``stop_gradient``) it is computed and dropped, so error feedback is off with no error:
    what the codec drops is lost, not delayed (Seide et al., 2014), and a nonzero residual
    carried that way would be sent again every step. Leaves whose shard is not
    differentiated (their gradient is not asked for) are not checked, nor is a forward with
    no differentiation at all (evaluation): jax does not run this rule there."""
    if residual is None:
        return
    if any(s.perturbed and not r.perturbed for s, r in zip(shards, residual, strict=True)):
        raise ValueError(
            "`residual` is passed to fsdp_gather but not differentiated while the shards are "
            "(left out of jax.grad's argnums, closed over by the loss, or behind "
            "jax.lax.stop_gradient): the new residual is its gradient, so it would never be "
            "produced and error feedback would be silently off (what the codec drops lost, "
            "not delayed). Differentiate it with the shards and carry the new one, e.g. "
            "g, residual = jax.grad(loss, argnums=(0, 1))(shards, residual, batch); or pass "
            "residual=None for no error feedback"
        )


def _instantiated(ct: Any) -> Any:
    """A cotangent jax passes as a symbolic zero (a gathered leaf the loss does not use) as
    the zeros jax builds without ``symbolic_zeros``: typed varying as its abstract value."""
    if not isinstance(ct, SymbolicZero):
        return ct
    zeros = jnp.zeros(ct.aval.shape, ct.aval.dtype)
    return varying_over(zeros, getattr(ct.aval, "vma", frozenset()))


def _fast_transpose(ct: jax.Array, cfg: _Config) -> jax.Array:
    """The transpose of the fast hop (:func:`two_hop_stack`) summed in float32: ``[H * L,
    *shape]`` -> ``f32[H, *shape]``, this device's share of the inner axis, unrounded. jax's
    own transpose sums in the leaf's dtype, and the rounding of that sum would be lost to
    error feedback."""
    n = ct.shape[0] // axis_size(cfg.inner_axis_name)
    blocks = jnp.swapaxes(ct.astype(jnp.float32).reshape(n, -1, *ct.shape[1:]), 0, 1)
    return exact_scatter(blocks, cfg.inner_axis_name, 0, False)


def _gather_bwd(cfg, residual, cts):
    """The transpose: reduce-scatter the cotangents through ``cfg.grads`` (plus error
    feedback); the residual's cotangent is the new residual. An empty leaf's cotangent is
    empty and takes no part in a collective (nor its residual)."""
    cts = [_instantiated(ct) for ct in cts]
    dtypes = [ct.dtype for ct in cts]
    if cfg.fast_inside:
        cts = [_fast_transpose(ct, cfg) if ct.size else ct for ct in cts]
    full = [i for i, ct in enumerate(cts) if ct.size]
    if len(full) == len(cts):
        return _scatter_cotangents(cfg, residual, cts, dtypes)
    grads = [
        varying_over(jnp.zeros(ct.shape[1:], d), cfg.varying)
        for ct, d in zip(cts, dtypes, strict=True)
    ]
    new_residual = None if residual is None else [jnp.zeros_like(r) for r in residual]
    if full:
        some = None if residual is None else [residual[i] for i in full]
        g, r = _scatter_cotangents(cfg, some, [cts[i] for i in full], [dtypes[i] for i in full])
        for k, i in enumerate(full):
            grads[i] = g[k]
            if r is not None:
                new_residual[i] = r[k]
    return grads, new_residual


def _scatter_cotangents(cfg, residual, cts, dtypes):
    """:func:`_gather_bwd` of leaves that are not empty, ``dtypes`` the leaves' (the
    cotangents are float32 after :func:`_fast_transpose`). With ``grads`` None or the
    identity the sum is ``jax.lax.psum_scatter`` in the cotangent's dtype (all_gather's own
    transpose, bit for bit); a residual, zero under an exact reduction, is added in that
    dtype."""
    if exact(cfg.grads):
        blocks = [ct.reshape(ct.shape[0], -1) for ct in cts]
        if residual is not None:
            blocks = [
                b + r.reshape(b.shape).astype(b.dtype)
                for b, r in zip(blocks, residual, strict=True)
            ]
        own = [
            jax.lax.psum_scatter(b, cfg.axis_name, scatter_dimension=0, tiled=False) for b in blocks
        ]
        new_residual = None if residual is None else [jnp.zeros_like(r) for r in residual]
    else:
        blocks = [ct.reshape(ct.shape[0], -1).astype(jnp.float32) for ct in cts]
        if residual is not None:
            blocks = [b + r.reshape(b.shape) for b, r in zip(blocks, residual, strict=True)]
        keys = [None] * len(blocks)
        narrow = None if residual is None else dtypes  # EF: an overflow would poison it
        s = scatter_rows(blocks, cfg.axis_name, cfg.grads, keys, cfg.bucket_bytes, narrow)
        bad = _step_flag(cfg, s)
        own = [jnp.where(bad, jnp.nan, o) for o in s.own]
        new_residual = (
            None
            if residual is None
            else [
                jnp.where(bad, r, _kept(b - t, o, d, cfg.axis_name).reshape(r.shape)).astype(
                    r.dtype
                )
                for b, t, o, d, r in zip(blocks, s.sent, own, dtypes, residual, strict=True)
            ]
        )
    grads = [o.reshape(ct.shape[1:]).astype(d) for o, ct, d in zip(own, cts, dtypes, strict=True)]
    _check_cotangent_axes(grads, cfg.varying)
    return grads, new_residual


def _step_flag(cfg: _Config, s: Any) -> jax.Array:
    """The step's non-finite flag, the same on every device of the gather (and of
    ``skip_axis``): ``s.bad`` (or-ed over ``axis_name`` already) or-ed over the inner and
    skip axes. With error feedback ``s.bad`` also holds a chunk whose finite float32 sum
    overflows its leaf's narrower dtype (:func:`jaxcomp._src.sharded.overflows`, in
    :func:`scatter_rows`' one ``psum``): its rounding (:func:`_kept`) would be ``sum - inf``,
    an infinite residual that poisons every later step (until 2026-11-27: fp16 shards, a
    chunk's sum 8e4, every later gradient non-finite). Flagged, the step is non-finite on
    every device and every residual is kept, as for a non-finite input (without error
    feedback the overflow is the owner's ``inf``, as ``jax.lax.psum_scatter`` in the leaf's
    dtype gives)."""
    beside = axis_names(cfg.inner_axis_name) + cfg.skip_axes
    if beside:
        return jax.lax.psum(s.bad.astype(jnp.int32), beside) > 0
    return s.bad


def _kept(error: jax.Array, own: jax.Array, dtype: Any, axis_name: Any) -> jax.Array:
    """The new residual ``f32[n, c]``: what this device's rows lost in the codec, plus, in its
    own row, what rounding its chunk's float32 sum ``own`` to a narrower ``dtype`` (bf16,
    fp16) loses. Each chunk's rounding is then kept once, by the device that returns it, so
    ``out_i + sum_j e_j'^(i) = sum_j (g_j^(i) + e_j^(i))`` holds to float32 rounding, as
    error feedback promises (Seide et al., 2014): nothing is lost, only delayed. float32 and
    wider cotangents: ``error`` itself."""
    if jnp.finfo(dtype).bits >= 32:
        return error
    rounding = own - own.astype(dtype).astype(jnp.float32)
    me = jax.lax.axis_index(axis_name)
    return error + jnp.where(jnp.arange(error.shape[0])[:, None] == me, rounding, 0.0)


def _check_cotangent_axes(grads: list, varying: frozenset) -> None:
    """A gradient that varies over more axes than its shard would need a hidden float32
    all-reduce over those axes: refuse it, naming the fix."""
    extra = set().union(*[varying_axes(g) for g in grads]) - varying if grads else set()
    if extra:
        axes = tuple(sorted(extra, key=str))
        raise ValueError(
            f"`shards` are the same on every device of mesh axes {axes} but their gradients "
            f"differ there (the loss depends on per-device data over {axes}); summing them "
            f"would be a hidden float32 all-reduce. Pass jax.lax.pcast(shards, {axes}, "
            "to='varying') to fsdp_gather and reduce the gradients over those axes yourself "
            "(e.g. jc.compressed_allreduce)"
        )


_gather.defvjp(_gather_fwd, _gather_bwd, symbolic_zeros=True)


def _check_shards(leaves: list, paths: list, axis: int) -> None:
    for a, p in zip(leaves, paths, strict=True):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(
                f"`shards` leaf {p} has dtype {a.dtype}: fsdp_gather gathers floating weights; "
                "gather integer leaves with jax.lax.all_gather"
            )
        if not (a.ndim and -a.ndim <= axis < a.ndim):
            raise ValueError(
                f"`axis`={axis} is out of range for `shards` leaf {p} of shape {a.shape}: "
                "shard a dimension the leaf has (scalars cannot be sharded)"
            )


def _check_sharded(shards: Any, axis_name: Any, inner_axis_name: Any) -> None:
    """Refuse leaves typed as the same on every device of the gather's axes
    (``check_vma=True``): a replicated leaf (``P()``, a bias or a norm scale) would be
    gathered as ``n`` copies of itself. Until 2026-11-27 jax refused it in the backward with
    "Custom VJP bwd rule must produce an output with the same type", naming neither the
    leaf nor the fix (under ``check_vma=False`` nothing types it: not checked)."""
    names = axis_names(axis_name, inner_axis_name)
    if not tracks_variance(names):
        return
    same = invariant_leaves(shards, names)
    if same:
        raise ValueError(
            f"`shards` leaves {same[:5]} are the same on every device of {names} (passed "
            "replicated, e.g. in_specs P()): fsdp_gather would concatenate one copy per "
            "device. Pass fsdp_gather only the leaves sharded over `axis_name` (e.g. "
            "P('data') on one dimension) and use replicated leaves as they are"
        )


def fsdp_residual(shards: Any, axis_name: Any, inner_axis_name: Any = None) -> Any:
    """Zeros for :func:`fsdp_gather`'s error feedback: ``f32[H, *shard.shape]`` per leaf.

    ``H`` is the size of ``axis_name`` (the compressed hop). Call it inside ``jax.shard_map``
    with the shards: per device it holds ``H`` times its shard (the whole leaf without
    ``inner_axis_name``, ``1/L`` of it with), and it differs per device, so its
    ``out_specs`` / ``in_specs`` are those of the shards, e.g. ``P("data")``.

    Args:
      shards: this device's weight shards (a pytree).
      axis_name: the compressed (slow) mesh axis.
      inner_axis_name: unused but checked (kept so the call matches :func:`fsdp_gather`).

    Returns:
      A pytree like ``shards`` of float32 zeros ``[H, *shard.shape]``.

    Raises:
      ValueError: when the call is traced, ``axis_name`` outside its rule (the message names the
        argument; the rules: docs/errors.md).
    """
    n = axis_size(axis_name)
    check_inner_axis(axis_name, inner_axis_name)
    return jax.tree.map(lambda a: varying_like(jnp.zeros((n, *a.shape), jnp.float32), a), shards)


def _check_residual(residual: Any, leaves: list, treedef: Any, n: int) -> list | None:
    if residual is None:
        return None
    r_leaves, r_def = jax.tree.flatten(residual)
    want = [(n, *a.shape) for a in leaves]
    if r_def != treedef or [tuple(r.shape) for r in r_leaves] != want:
        raise ValueError(
            "`residual` must be shaped like the shards with a leading axis of the "
            f"`axis_name` size {n} (per leaf {want}), got {[tuple(r.shape) for r in r_leaves]} "
            f"of structure {r_def}: build it with jc.fsdp_residual(shards, axis_name)"
        )
    for r, a in zip(r_leaves, leaves, strict=True):
        if not varying_axes(a) <= varying_axes(r):
            raise ValueError(
                f"`residual` differs per device but arrived replicated (varying over "
                f"{sorted(varying_axes(r), key=str)}, the shards over "
                f"{sorted(varying_axes(a), key=str)}): pass "
                "it with the shards' in_specs (e.g. P('data')), as jc.fsdp_residual builds it"
            )
    return r_leaves


#: The residual leaves (tracers) passed to an ``fsdp_gather`` while they live: ``id ->
#: (ref, traces)``, the traces (weakly held) those calls were recorded into.
_CLAIMED: dict[int, tuple[weakref.ref, list[weakref.ref]]] = {}


def _release(key: int, ref: weakref.ref) -> None:
    if _CLAIMED.get(key, (None, []))[0] is ref:
        del _CLAIMED[key]


def _current_trace() -> Any:
    """The innermost trace jax records into, or None where this jax does not name it
    (``jax._src.core.trace_ctx`` moved: then every call of a trace counts as the same, two
    branches of a cond are refused too, and the loop check warns that it cannot run)."""
    return getattr(getattr(jax_core, "trace_ctx", None), "trace", None)


def _claim(r_leaves: list) -> None:
    """Refuse a residual that already feeds another ``fsdp_gather`` of this trace.

    Each call's backward adds the residual to its own cotangent, so with two calls (tied
    weights gathered twice) the residual would be sent twice and kept twice: error feedback
    off by ``e`` every step, with no error. Tracked by the identity of the traced leaves,
    forgotten when they die (the next trace holds new ones), and by the trace each call is
    recorded into: calls in traces of their own (the branches of a ``lax.cond`` or
    ``lax.switch``, of which one runs) are not two uses of the residual."""
    trace = _current_trace()
    for r in r_leaves:
        if not isinstance(r, jax.core.Tracer):
            continue
        key = id(r)
        held, traces = _CLAIMED.get(key, (None, []))
        if held is None or held() is not r:
            held, traces = weakref.ref(r, functools.partial(_release, key)), []
            _CLAIMED[key] = (held, traces)
        if any(t() is trace for t in traces):
            raise ValueError(
                "`residual` already feeds another fsdp_gather here: each call's backward adds "
                "it to its cotangent, so it would be sent twice and the new residual would "
                "count it twice. Gather the shards once and use the result twice (tied "
                "weights), or give each call its own residual (jc.fsdp_residual)"
            )
        traces.append(weakref.ref(trace) if trace is not None else lambda: None)


#: What jax's traces of loop bodies are traced for (``DebugInfo.traced_for``): a body runs
#: once per iteration, so a residual it closes over feeds every iteration's gather.
_LOOP_BODIES = frozenset({"scan", "fori_loop", "while_body", "while_cond"})


def _scan_code() -> Any:
    """The code object of ``jax.lax.scan`` whose frame holds a scan's ``length``, or None
    where this jax keeps it elsewhere (private module moved): then every scan counts as
    longer than 1 (:func:`_scan_length`), a refusal of a length-1 scan at worst."""
    try:
        from jax._src.lax.control_flow import loops  # scan's frame: the loop's length
    except ImportError:
        return None
    return getattr(inspect.unwrap(getattr(loops, "scan", None)), "__code__", None)


_SCAN_CODE = _scan_code()


def _stack() -> Any:
    """The Python frame of the caller, the top of the stack the checks walk, or None where
    this Python has no ``sys._getframe`` (then nothing is found on the stack)."""
    getframe = getattr(sys, "_getframe", None)
    return getframe(1) if getframe is not None else None


def _scan_length(debug_info: Any) -> int | None:
    """The length of the ``lax.scan`` tracing the body of ``debug_info`` (its frame, found on
    the Python stack by that object), or None where it is not found (another jax or Python:
    a walk that fails counts as not found, never as an error)."""
    try:
        frame = _stack()
        while frame is not None:
            if frame.f_code is _SCAN_CODE and frame.f_locals.get("dbg_body") is debug_info:
                length = frame.f_locals.get("length")
                return length if isinstance(length, int) else None
            frame = frame.f_back
    except Exception:  # frames laid out otherwise: not found
        return None
    return None


#: How many Python frames above jax's tracing of a function's body to search for the
#: caller's flat arguments (:func:`_caller_value`); 0 finds none (a jax that keeps them
#: elsewhere), and then a residual reaching a function inside a loop body is warned about.
_CALLER_FRAMES = 16

#: :func:`_caller_value` of an argument whose caller's value was not found on the stack.
_NOT_FOUND = object()


def _same_avals(values: Any, avals: list) -> bool:
    """Whether ``values`` is a flat list of arrays (or tracers) of the shapes and dtypes of
    ``avals``: the caller's arguments of a traced function, not its abstract values (which
    are no ``jax.Array``; a tracer is one, public API on jax 0.10 to 0.12)."""
    if not isinstance(values, list | tuple) or len(values) != len(avals):
        return False
    for x, a in zip(values, avals, strict=True):
        if not isinstance(x, jax.Array | np.ndarray):
            return False
        if tuple(x.shape) != tuple(getattr(a, "shape", ())) or x.dtype != getattr(a, "dtype", None):
            return False
    return True


def _traces(frame: Any, owner: Any) -> bool:
    """Whether ``frame`` is jax's, tracing the body of ``owner`` (its local ``trace``)."""
    return frame.f_globals.get("__name__", "").startswith("jax.") and (
        frame.f_locals.get("trace") is owner
    )


def _caller_value(r: Any, owner: Any) -> Any:
    """The value the caller passed for ``r``, an argument of the function that ``owner``
    traces (``jax.checkpoint``, ``jax.jit``): ``None`` where ``r`` is no argument of it
    (computed inside), :data:`_NOT_FOUND` where the caller's arguments are not found.

    jax traces such a function on abstract values: its arguments are tracers of its own
    trace (``owner.frame.invars``, in order), and the caller's flat arguments are a local
    of a Python frame above the one tracing the body (``jax.checkpoint``'s ``args_flat``,
    ``jax.jit``'s ``args`` on jax 0.10, 0.11 and 0.12): the first list of arrays of the
    arguments' shapes and dtypes there holds the caller's value at ``r``'s position."""
    invars = getattr(getattr(owner, "frame", None), "invars", None)
    if invars is None:
        return _NOT_FOUND
    var = getattr(r, "val", None)
    index = next((i for i, v in enumerate(invars) if v is var), None)
    if index is None:
        return None
    avals = [getattr(v, "aval", None) for v in invars]
    try:
        return _caller_args(owner, avals, index)
    except Exception:  # frames laid out otherwise: not found (a warning)
        return _NOT_FOUND


def _caller_args(owner: Any, avals: list, index: int) -> Any:
    """:func:`_caller_value`'s walk of the Python stack: the caller's value at ``index`` of
    the first list of arrays shaped as ``avals`` within :data:`_CALLER_FRAMES` frames above
    jax's frame tracing ``owner``'s body, else :data:`_NOT_FOUND`."""
    frame = _stack()
    while frame is not None and not _traces(frame, owner):
        frame = frame.f_back
    for _ in range(_CALLER_FRAMES if frame is not None else 0):
        frame = frame.f_back
        if frame is None:
            break
        for values in frame.f_locals.values():
            if _same_avals(values, avals):
                return values[index]
    return _NOT_FOUND


def _loop_kind(trace: Any) -> str | None:
    """``"lax.scan of length 3"``, ``"while_body"``, ... where ``trace`` records a loop body
    that runs more than once (a scan whose length is not found counts as longer than 1);
    None for any other trace."""
    info = getattr(getattr(trace, "frame", None), "debug_info", None)
    kind = getattr(info, "traced_for", None)
    if kind not in _LOOP_BODIES:
        return None
    length = _scan_length(info) if kind in ("scan", "fori_loop") else None
    if length is not None and length <= 1:
        return None
    return kind if length is None else f"lax.{kind} of length {length}"


def _inside_loop(trace: Any) -> bool:
    """Whether ``trace`` or a trace it is nested in records a loop body."""
    while trace is not None:
        if _loop_kind(trace) is not None:
            return True
        trace = getattr(trace, "parent_trace", None)
    return False


#: The traces jax differentiates a function in (``jax.grad``, ``jax.vjp``, ``jax.jvp``): a
#: loop body that holds one runs the forward and backward of each iteration inside it.
_DIFFERENTIATING = frozenset({"JVPTrace", "LinearizeTrace"})


class _Loop(NamedTuple):
    """A loop body a residual is closed over by: ``kind`` as :func:`_loop_kind` names it, and
    whether the body differentiates ``fsdp_gather`` itself (``jax.grad`` inside the body: a
    loop over training steps), not a loop differentiated from outside (stacked layers)."""

    kind: str
    grad_inside: bool


def _differentiates(trace: Any) -> bool:
    """Whether ``trace`` records a differentiation (``jax.grad`` / ``jax.vjp`` / ``jax.jvp``);
    False where this jax names its traces otherwise (then a loop over steps gets the stacked
    layers' message, still a refusal)."""
    return type(trace).__name__ in _DIFFERENTIATING


def _enclosing_loop(r: Any) -> _Loop | str | None:
    """The loop body between the current trace and the trace ``r`` comes from, if one runs
    more than once (a :class:`_Loop`); else None.

    jax records a loop body into a trace of its own whose ``parent_trace`` is the trace the
    loop is called in; a residual the body closes over belongs to an outer trace, one passed
    as ``xs`` (or carried) to the body's own. So the traces crossed walking out from the
    current one to the residual's are the bodies that close over it. A residual that is an
    argument of a function jax traces apart (a ``jax.checkpoint`` or ``jax.jit`` inside the
    body, the usual remat of a layer) is a tracer of that function's trace: the walk goes on
    from the value its caller passed (:func:`_caller_value`), in the caller's trace. Where
    that value is not found while a loop body is further out, ``"unknown"``. A residual
    differentiated inside the body (``jax.grad(loss, argnums=(0, 1))`` in a loop over steps)
    is a tracer of that differentiation: the walk goes on from its primal value, which is
    the body's own where the loop carries the residual. A trace of a differentiation crossed
    on the way marks the loop ``grad_inside``. A scan whose length is 1 runs the body once
    (no error); one whose length is not found counts as longer."""
    trace, grad_inside = _current_trace(), False
    while True:
        owner = getattr(r, "_trace", None)
        while trace is not None and trace is not owner:
            loop = _loop_kind(trace)
            if loop is not None:
                return _Loop(loop, grad_inside)
            grad_inside = grad_inside or _differentiates(trace)
            trace = getattr(trace, "parent_trace", None)
        if trace is None or _loop_kind(owner) is not None or not _inside_loop(owner):
            return None  # r is the loop body's own (xs, carry), or no loop is further out
        if getattr(owner, "frame", None) is None:
            outer = getattr(r, "primal", None) if _differentiates(owner) else None
            grad_inside = True
        else:
            outer = _caller_value(r, owner)
        if outer is _NOT_FOUND:
            return "unknown"
        if outer is None:
            return None  # r is computed there (or differentiated by a trace not named)
        r, trace = outer, getattr(owner, "parent_trace", None)


def _looped_message(loop: _Loop) -> str:
    """What goes wrong with a residual closed over by ``loop``, and the fix."""
    if loop.grad_inside:
        return (
            f"`residual` is closed over by a loop body ({loop.kind}) that differentiates "
            "fsdp_gather in each iteration (jax.grad inside the body, as a loop over training "
            "steps): the residual is never carried from one iteration to the next, so every "
            "iteration starts from the one the loop closes over and the new residual jax.grad "
            "returns is lost (error feedback keeps nothing from step to step). Carry the "
            "residual in the loop state, e.g. jax.lax.scan(step, (shards, "
            "jc.fsdp_residual(shards, axis_name)), batches) with step returning the new "
            "(shards, residual) from g, r = jax.grad(loss, argnums=(0, 1))(shards, r, batch)"
        )
    return (
        f"`residual` is closed over by a loop body ({loop.kind}) that runs fsdp_gather "
        "once per iteration: each iteration's backward would add the same residual "
        "to its cotangent and the new residual would be the sum of every "
        "iteration's. Give each iteration its own residual: stack them and pass "
        "them to the loop as xs, e.g. jax.lax.scan(body, h, (stacked_shards, "
        "jnp.moveaxis(jc.fsdp_residual(stacked_shards, axis_name), 0, 1))) with "
        "the shards stacked on axis 0"
    )


def _check_not_looped(r_leaves: list) -> None:
    """Refuse a residual closed over by a loop body (not passed to it as ``xs``, nor carried).

    Stacked layers in a ``lax.scan`` differentiated from outside (each iteration gathers one
    layer): each iteration's backward adds the same residual to its own cotangent and hands
    back a new residual as the residual's cotangent, which the loop's transpose sums over
    the iterations: every layer's error feedback would read one memory and the new memory
    would be the sum of the layers', silently. The fix: the residual stacked per layer and
    passed as ``xs``. A loop over training steps whose body calls ``jax.grad`` (the gather
    differentiated inside the body): the residual is never carried, every step reads the
    one the loop closes over and the new one is lost. The fix: carry it in the loop state.
    There is no right answer to give either way, so the call is refused naming the fix.
    Where this jax does not name its traces (private state moved), a warning says the check
    did not run."""
    if r_leaves and _current_trace() is None:
        warnings.warn(
            "jaxcomp: this jax does not say which trace a call is recorded into "
            "(jax._src.core.trace_ctx moved), so whether a loop body closes over `residual` "
            "is not checked. Pass the residuals of stacked layers to the scan as xs, one per "
            "layer, and carry the residual in the state of a loop over training steps",
            UserWarning,
            stacklevel=3,
        )
        return
    for r in r_leaves:
        loop = _enclosing_loop(r)
        if loop == "unknown":
            warnings.warn(
                "`residual` reaches this fsdp_gather as an argument of a function jax traces "
                "apart (jax.checkpoint, jax.jit) inside a loop body, and this jax keeps the "
                "caller's arguments where jaxcomp cannot read them: whether the loop body "
                "closes over it (one memory for every iteration, refused where it can be "
                "seen) is not checked. Pass the residuals stacked per layer as the loop's xs",
                UserWarning,
                stacklevel=3,
            )
        elif loop is not None:
            raise ValueError(_looped_message(loop))


def _check_skip_axis(skip_axis: Any, axis_name: Any, inner_axis_name: Any) -> tuple:
    """``skip_axis`` as a tuple of bound mesh axes other than the gather's own, else a
    ValueError / TypeError naming it."""
    if skip_axis is None or skip_axis == ():
        return ()
    check_axis_name(skip_axis, "skip_axis")
    names = axis_names(skip_axis)
    own = set(axis_names(axis_name, inner_axis_name))
    if own & set(names):
        raise ValueError(
            f"`skip_axis` {skip_axis!r} holds the gather's own axis "
            f"{sorted(own & set(names), key=str)[0]!r} (its flag is or-ed over it already): "
            "name the other mesh axes over which a non-finite step is skipped together "
            "(the replica axis of HSDP), or () for none"
        )
    try:
        jax.lax.axis_size(names)
    except NameError:
        raise ValueError(
            f"`skip_axis` {skip_axis!r} is not bound here: name manual mesh axes of the "
            "enclosing jax.shard_map (the replica axis of HSDP), or () for none"
        ) from None
    return names


def _warn_unskipped(axis_name: Any, inner_axis_name: Any) -> None:
    """Warn where error feedback meets another manual mesh axis of size > 1 and
    ``skip_axis`` is not given: a non-finite cotangent on one group of that axis would keep
    only that group's residual, while the step the others' residuals were written for may be
    skipped everywhere (HSDP: the exchange over the replicas skips it)."""
    own = set(axis_names(axis_name, inner_axis_name))
    mesh = jax.sharding.get_abstract_mesh()
    shape = dict(getattr(mesh, "shape", {}) or {})
    others = sorted((a for a in manual_axes() - own if shape.get(a, 1) > 1), key=str)
    if others:
        name = others[0] if len(others) == 1 else tuple(others)
        warnings.warn(
            f"jaxcomp: fsdp_gather with error feedback over {axis_name!r} and the manual axes "
            f"{others} bound beside it: a non-finite gradient flags its own group's devices "
            "only, so where the step is skipped on every device (HSDP: the exchange over the "
            "replicas skips it) the other groups' residuals would keep a step that never "
            f"happened. Pass skip_axis={name!r} to or the flag over them (every residual "
            "kept, every gradient NaN), or skip_axis=() where the groups step apart "
            "(jc.diloco / jc.local_sgd replicas).",
            stacklevel=3,
        )


def fsdp_gather(
    shards: Any,
    axis_name: Any,
    *,
    weights: Codec | None = int_quant(8),
    grads: Codec | None = int_quant(4),
    inner_axis_name: Any = None,
    axis: int = 0,
    residual: Any = None,
    bucket_bytes: int = buckets.BUCKET_BYTES,
    skip_axis: Any = None,
) -> Any:
    """Differentiable compressed all-gather of FSDP weight shards (ZeRO++ qwZ forward, qgZ back).

    Forward: ``W = concat_j decode_w(encode_w(w_j))`` on ``axis`` (``jax.lax.all_gather`` with
    ``tiled=True`` when ``weights`` is None or the identity). Transpose: for the cotangent
    ``G_j`` of ``W`` on device ``j`` (cut into ``n`` chunks ``G_j^{(i)}``), device ``i``
    receives ``sum_j decode_g(encode_g(G_j^{(i)} + e_j^{(i)}))``, summed in float32 (with
    ``grads=None``: ``jax.lax.psum_scatter``, exactly ``jax.lax.all_gather``'s transpose). So
    ``jax.grad`` of the per-device loss gives each device its shard of the gradient summed over
    devices. Bytes per device and step: ``(n-1) (P_w(m) + P_g(m))`` against ``(n-1) 8m`` in
    float32, ``m`` values per shard: int8 weights + int4 grads ~0.19x, flat in ``n``.

    Error feedback: pass ``residual`` (from :func:`fsdp_residual`, then carried from step to
    step); ``jax.grad`` with respect to it returns the new residual
    ``e_j' = G_j + e_j - C(G_j + e_j)`` (the old one on a non-finite step), e.g.
    ``g, e = jax.grad(loss, argnums=(0, 1))(shards, e, batch)``. Its value is not read forward.
    A residual that ``jax.grad`` does not differentiate where it differentiates the shards is
    refused: its new value would be dropped, error feedback silently off.

    Args:
      shards: this device's weight shards (a pytree of floating arrays), inside ``shard_map``.
      axis_name: the mesh axis the weights are sharded over (the slow one with
        ``inner_axis_name``).
      weights: codec of the forward all-gather (dense, deterministic), or None (float32).
      grads: codec of the backward reduce-scatter (deterministic), or None (float32).
      inner_axis_name: a fast mesh axis the shards are also split over (``axis_name`` major):
        the codecs run over ``axis_name``, the fast hop is ``jax.lax`` (hpZ with a remat
        policy on ``"fsdp_secondary"``, see the module docs).
      axis: the dimension the shards are concatenated on.
      residual: error-feedback memory of the reduce-scatter, or None (no error feedback).
      bucket_bytes: payloads travel in buckets of about this many bytes.
      skip_axis: other mesh axes (a name or a tuple) over which a non-finite step is skipped
        together, e.g. ``"replica"`` in HSDP (the shard gradients then averaged over the
        replicas by an exchange that skips a non-finite step on every device): the
        reduce-scatter's non-finite flag is or-ed over them (one scalar ``psum``), so every
        device's gradient is NaN and every residual kept. ``()``: none (the groups step
        apart, as ``jc.diloco`` replicas). None (default): none, with a warning where error
        feedback runs beside another manual axis of size > 1.

    Returns:
      The gathered weights, like ``shards`` with ``axis`` ``n`` times longer, in their dtypes.
      Over an ``axis_name`` of one device both hops are ``jax.lax``'s, exact (no codec
      runs where nothing crosses the axis; a residual is added to the gradient and the new
      one is zero).

    Raises:
      ValueError: when the call is traced, ``weights``, ``grads``, ``axis_name``, ``axis``,
        ``shards`` (a leaf replicated over the axis), ``residual`` or ``skip_axis`` outside
        its rule (the message names the argument; the rules: docs/errors.md).
      TypeError: when the call is traced, ``weights``, ``grads``, ``axis``, ``shards`` or
        ``skip_axis`` of the wrong kind.

    Example::

      def loss(shards, batch):
          params = jc.fsdp_gather(shards, "data")          # int8 forward, int4 backward
          return cross_entropy(model(params, batch))
      grads = jax.grad(loss)(shards, batch)                 # per device: its gradient shard

    References:
      Wang et al., "ZeRO++: Extremely Efficient Collective Communication for Giant Model
      Training", 2023; Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training
      Trillion Parameter Models", SC 2020; Seide et al., "1-Bit Stochastic Gradient Descent",
      Interspeech 2014 (error feedback).
    """
    leaves, treedef = jax.tree.flatten(shards)
    cfg = _Config(
        axis_name,
        inner_axis_name,
        _check_codec("weights", weights, True),
        _check_codec("grads", grads, False),
        buckets.check_bucket_bytes(bucket_bytes),
        frozenset().union(*[varying_axes(a) for a in leaves]) if leaves else frozenset(),
        _keeps_fast_rounding(inner_axis_name, grads, residual, leaves),
    )
    n = axis_size(axis_name)
    check_inner_axis(axis_name, inner_axis_name)
    cfg = cfg._replace(skip_axes=_check_skip_axis(skip_axis, axis_name, inner_axis_name))
    if n == 1:  # nothing crosses axis_name: jax.lax's exact hops, no codec error added
        cfg = cfg._replace(weights=None, grads=None, fast_inside=False)
    if skip_axis is None and residual is not None and not exact(cfg.grads):
        _warn_unskipped(axis_name, inner_axis_name)
    if isinstance(axis, bool) or not isinstance(axis, int | np.integer):
        raise TypeError(f"`axis` must be an int, got {type(axis).__name__} {axis!r}")
    axis = int(axis)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(shards)]
    _check_shards(leaves, paths, axis)
    _check_sharded(shards, axis_name, inner_axis_name)
    r_leaves = _check_residual(residual, leaves, treedef, n)
    if r_leaves is not None:
        _check_not_looped(r_leaves)
        _claim(r_leaves)
    stacked = _gather(leaves, r_leaves, cfg)
    if inner_axis_name is not None and not cfg.fast_inside:
        stacked = [two_hop_stack(checkpoint_name(s, SECONDARY), inner_axis_name) for s in stacked]
    out = [tile(s, axis % a.ndim, True) for s, a in zip(stacked, leaves, strict=True)]
    return jax.tree.unflatten(treedef, out)
