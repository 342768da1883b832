"""Shared test helpers: the 8-device mesh, shard_map wrappers, and readers of jaxcomp states."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

N = 8


def mesh(n: int = N, name: str = "data"):
    return jax.make_mesh((n,), (name,), axis_types=(AxisType.Explicit,), devices=jax.devices()[:n])


class Blocking:
    """A jitted function that waits for its result: XLA:CPU can deadlock in a collective
    rendezvous when a second multi-device program is dispatched while one is running."""

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        return jax.block_until_ready(self.fn(*args))

    def lower(self, *args):
        return self.fn.lower(*args)


def per_device(fn, in_specs, out_specs, m=None):
    """jit(shard_map(fn)) over the 1-D mesh ``m`` (default: 8 devices, axis 'data')."""
    m = m or mesh()
    return Blocking(jax.jit(jax.shard_map(fn, mesh=m, in_specs=in_specs, out_specs=out_specs)))


class WithoutEmpty:
    """:func:`per_device`'s step with its zero-element operands kept out of the program
    (``jaxcomp._src.sharding.without_empty``: each passed as None and rebuilt inside as zeros
    of its per-device block). An array with no elements has no values, so the step sees the
    same arrays. XLA:CPU in jaxlib 0.11.2 segfaults compiling a ``shard_map`` that takes a
    zero-element operand beside another one (docs/errors.md); a user's step does this there."""

    def __init__(self, fn, in_specs, out_specs, m=None):
        self.fn, self.in_specs, self.out_specs, self.m = fn, in_specs, out_specs, m
        self.steps = {}  # one compiled step per tree and empty leaves

    def __call__(self, *args):
        from jaxcomp._src.sharding import without_empty

        leaves, treedef = jax.tree.flatten(args)
        key = (treedef, tuple((x.shape, x.dtype, x.sharding) for x in leaves if x.size == 0))
        fill, operands = without_empty(self.fn, args)
        if key not in self.steps:
            self.steps[key] = per_device(fill, self.in_specs, self.out_specs, self.m)
        return self.steps[key](*operands)


def shard(x, m=None, spec=P("data")):
    return jax.device_put(x, NamedSharding(m or mesh(), spec))


def stacked_normal(seed, shape, n=N, offset=0.0):
    """Per-device values, stacked on a leading device axis."""
    return jax.random.normal(jax.random.PRNGKey(seed), (n, *shape)) + offset


def rel_err(a, b):
    return float(jnp.linalg.norm(jnp.ravel(a - b)) / jnp.linalg.norm(jnp.ravel(b)))


# --------------------------------------------------------------------------- reading states
#
# Per-device memory fields (``memory``, ``momentum``, ``server_residual``, ``velocity``,
# ``accumulation``, ``error``) are pytrees like the params with an empty slot (None or
# ``optax.MaskedNode()``: see :func:`empty`) where a leaf is not compressed; a compressed
# leaf's global array is (n, *param.shape), row i on device i. The two-phase server residual
# holds only the chunk a device owns: global (n, ceil(size / n)), whose flattening is the
# leaf's whole server residual (hierarchically: see server_per_leaf).


def is_jaxcomp(node):
    return isinstance(node, tuple) and hasattr(type(node), "PER_DEVICE_FIELDS")


def jaxcomp_nodes(state) -> list:
    """Every jaxcomp state inside ``state``, outer before inner (a recipe's state holds the
    state of the exchange it runs, e.g. ``OneBitAdamState.exchange``)."""
    found = []
    for node in jax.tree.leaves(state, is_leaf=is_jaxcomp):
        if is_jaxcomp(node):
            found.append(node)
            found.extend(jaxcomp_nodes(tuple(node)))
    return found


def jaxcomp_state(state, field=None):
    """The first jaxcomp state (a NamedTuple with per-device fields) inside a chain's state;
    with ``field``, the first that has that field."""
    found = [n for n in jaxcomp_nodes(state) if field is None or field in n._fields]
    assert found, f"no jaxcomp state{'' if field is None else ' with ' + field} in {state!r:.200}"
    return found[0]


def empty(slot) -> bool:
    """Whether a slot of a per-leaf state field holds nothing (None or ``optax.MaskedNode``)."""
    return slot is None or isinstance(slot, optax.MaskedNode)


def _shape(param):
    return tuple(np.shape(param))


def per_leaf(field, params: dict) -> dict:
    """A per-device field as {leaf name: float64 (n, *shape) or None}."""
    if isinstance(field, dict):
        return {k: None if empty(field.get(k)) else _devices(field[k], params[k]) for k in params}
    raise AssertionError(f"per-device field is not shaped like the params: {type(field)}")


def _devices(x, param) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return x.reshape(x.shape[0] if x.ndim else 1, *_shape(param))


def device_mean(field, params: dict) -> dict:
    """A per-device field averaged over devices: {leaf name: float64 (*shape) or None}."""
    return {k: None if m is None else m.mean(0) for k, m in per_leaf(field, params).items()}


def replicated_per_leaf(field, params: dict) -> dict:
    """A replicated field like the params (EF21's estimate): {leaf name: (*shape) or None}."""
    if isinstance(field, dict):
        return {k: None if empty(field.get(k)) else np.asarray(field[k]) for k in params}
    raise AssertionError(f"replicated field is not shaped like the params: {type(field)}")


def server_per_leaf(field, params: dict, hosts: int = N) -> dict:
    """The two-phase server residual, each leaf's owned chunks joined: {name: (*shape)}.

    ``field`` as built by ``jc.sharded_init`` (global ``(N, c)`` per leaf, the owned chunks).
    Hierarchically (``hosts`` x ``N // hosts`` devices, host-major) device ``(h, l)`` owns
    part ``h`` of chunk ``l`` of the inner reduce-scatter: the chunks join inner-major.
    """
    if not isinstance(field, dict):
        raise AssertionError(f"server residual is not shaped like the params: {type(field)}")
    out = {}
    for k, p in params.items():
        if empty(field.get(k)):
            out[k] = None
            continue
        size = int(np.prod(_shape(p)))
        chunks = np.asarray(field[k], np.float64).reshape(hosts, N // hosts, -1)
        out[k] = chunks.transpose(1, 0, 2).reshape(-1)[:size].reshape(_shape(p))
    return out


def held_back(state, params: dict, memory=("memory",), hosts: int = N) -> dict:
    """What the devices hold back, in units of the mean, per leaf (float64, zeros where
    nothing is held): mean_i of each per-device field in ``memory`` + the server residual."""
    ours = jaxcomp_state(state, memory[0] if memory else None)
    total = {k: np.zeros(_shape(p)) for k, p in params.items()}
    for name in memory:
        for k, m in device_mean(getattr(ours, name), params).items():
            if m is not None:
                total[k] += m
    server = getattr(ours, "server_residual", None)
    if server is not None:
        for k, s in server_per_leaf(server, params, hosts).items():
            if s is not None:
                total[k] += s
    return total


# --------------------------------------------------------------------------- the contract suites
#
# What tests/test_contract.py and tests/test_contract_replicas.py both check with.


def skip_unless(row, item: str) -> None:
    """Skip ``item`` of the contract for ``row`` where the row says why it does not apply."""
    import pytest

    reason = row.skip_reason(item)
    if reason:
        pytest.skip(reason)


def assert_trees_equal(a, b) -> None:
    """Same structure, every leaf bit-identical."""
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def sharded_like(leaf, mesh, spec) -> bool:
    """``leaf`` is laid out on ``mesh`` as ``spec`` says."""
    return leaf.sharding.is_equivalent_to(NamedSharding(mesh, spec), leaf.ndim)


#: Contract item 8: one element of one device's gradient at step 0, finite but huge: the
#: issue's 2e19 (its square overflows float32) and 3e38 (near float32's largest, 3.4e38).
OUTLIERS = (2e19, 3e38)


def assert_state_survives_outlier(state, reference, value: float) -> None:
    """After a finite outlier, no float state leaf is NaN/inf or all zero where ``reference``
    (the same run without it) is not; no column of PowerSGD's warm-start Q (``.q``,
    ``(..., m, rank)``) is zero either (an overflowed column norm left one 0 for ever)."""

    def leaves(tree):
        pairs = [
            (jax.tree_util.keystr(k), np.asarray(x)) for k, x in jax.tree.leaves_with_path(tree)
        ]
        return [(k, x) for k, x in pairs if np.issubdtype(x.dtype, np.floating)]

    def dead(a, columns):
        return (a == 0).reshape(-1, a.shape[-1] if columns and a.ndim else 1).all(0)

    for (path, got), (_, ref) in zip(leaves(state), leaves(reference), strict=True):
        assert np.isfinite(got).all(), f"non-finite state {path} after {value:g}"
        columns = ".q" in path
        assert not (dead(got, columns) & ~dead(ref, columns)).any(), f"zeroed state {path}"
