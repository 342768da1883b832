"""Shared test helpers: the 8-device mesh and shard_map wrappers."""

import jax
import jax.numpy as jnp
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


def shard(x, m=None, spec=P("data")):
    return jax.device_put(x, NamedSharding(m or mesh(), spec))


def stacked_normal(seed, shape, n=N, offset=0.0):
    """Per-device values, stacked on a leading device axis."""
    return jax.random.normal(jax.random.PRNGKey(seed), (n, *shape)) + offset


def rel_err(a, b):
    return float(jnp.linalg.norm(jnp.ravel(a - b)) / jnp.linalg.norm(jnp.ravel(b)))
