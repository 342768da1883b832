"""Gossip topologies as pure data: who sends to whom, with what weight, and how fast it mixes.

A topology on ``n`` devices is a list of permutations: in permutation ``k`` device ``i``
sends its payload to ``dest[k][i]`` (``jax.lax.ppermute`` pairs ``(i, dest[k][i])``) and
receives one from the device that sends to it. Every device weighs what it receives through
each permutation by ``w = 1 / (m + 1)`` (``m`` permutations) and keeps ``w`` of its own, so
the mixing matrix

.. math::

  W = w \\left(I + \\sum_k P_k\\right), \\qquad (P_k)_{ij} = 1 \\text{ if } j
  \\text{ sends to } i \\text{ in permutation } k,

has rows and columns that sum to one: it is doubly stochastic, so gossip preserves the mean
of the replicas. Identical permutations (a ring of 2, a torus side of 2) and identity ones
are dropped. All three topologies are circulant (ring, exponential) or a Kronecker sum of
circulants (torus), so ``W`` is normal: the moduli of its eigenvalues are its singular
values and the spectral gap ``1 - max_{k >= 2} |lambda_k(W)|`` sets how fast
``W^t x`` approaches the mean (Boyd, Ghosh, Prabhakar, Shah, "Randomized Gossip
Algorithms", IEEE Trans. Inf. Theory 2006; Koloskova, Stich, Jaggi, ICML 2019).

* ``ring``: neighbours ``i - 1`` and ``i + 1`` (mod ``n``), weights 1/3 each (1/2 with
  ``n = 2``). Spectral gap ``(2 / 3)(1 - cos(2 pi / n)) ~ 4 pi^2 / (3 n^2)``: it shrinks
  as ``1 / n^2`` (n = 8: 0.195; n = 16: 0.051). Two payloads per device per round, whatever
  ``n``.
* ``torus``: the devices on an ``r x c`` grid, ``r`` the largest divisor of ``n`` not above
  ``sqrt(n)``, device ``i`` at row ``i // c``, column ``i % c``, both directions wrapping;
  neighbours left, right, up, down (1/5 each on a 4 x 4 grid; a side of 2 has one neighbour
  along it, a side of 1 none: a prime ``n`` gives a ``1 x n`` grid, the ring). Gap
  ``~ 1 / n`` on a square grid (n = 8 = 2 x 4: 0.5; n = 16 = 4 x 4: 0.4; n = 32 = 4 x 8:
  0.117). At most four payloads per round, whatever ``n``.
* ``exponential``: the static exponential graph, all peers at once: device ``i`` sends to
  ``i + 2^k`` (mod ``n``) for every ``2^k < n``, ``m = ceil(log2 n)`` payloads per round,
  weights ``1 / (m + 1)`` (Assran, Loizou, Ballas, Rabbat, "Stochastic Gradient Push",
  ICML 2019; Ying, Yuan, Chen, Hu, Pan, Yin, "Exponential Graph is Provably Efficient for
  Decentralized Deep Training", NeurIPS 2021). Its gap shrinks only as ``1 / log2 n``
  (n = 8: 0.5, n = 16: 0.4, n = 32: 0.333, where the ring has 0.195, 0.051, 0.013): it
  mixes in a few rounds, at ``log2 n`` payloads per round (the
  one-peer variant, one offset per round, is not offered: CHOCO's public copies need a
  fixed set of neighbours).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

TOPOLOGIES = ("ring", "torus", "exponential")
"""Values of ``topology=`` of :func:`jaxcomp.gossip` (see :func:`topology`)."""


def check_topology(name: object, argument: str = "topology") -> str:
    """``name`` if it is one of :data:`TOPOLOGIES`, else an error naming ``argument``."""
    if name not in TOPOLOGIES:
        raise ValueError(f"`{argument}` must be one of {TOPOLOGIES}, got {name!r}")
    return str(name)


@dataclasses.dataclass(frozen=True)
class Topology:
    """Who sends to whom in one gossip round on ``n`` devices (hashable: static under jit).

    Attributes:
      name: ``"ring"``, ``"torus"`` or ``"exponential"``.
      n: the number of devices.
      grid: the ``(rows, cols)`` of a torus; ``(1, n)`` otherwise.
      dests: one tuple per permutation, ``dests[k][i]`` the device ``i`` sends to.
    """

    name: str
    n: int
    grid: tuple[int, int]
    dests: tuple[tuple[int, ...], ...]

    @property
    def neighbours(self) -> int:
        """``m``: payloads each device sends (and receives) per round."""
        return len(self.dests)

    @property
    def weight(self) -> float:
        """``w = 1 / (m + 1)``: the weight of each received copy and of the device's own."""
        return 1.0 / (self.neighbours + 1)

    def pairs(self, k: int) -> list[tuple[int, int]]:
        """``(source, destination)`` pairs of permutation ``k``, for ``jax.lax.ppermute``."""
        return [(i, j) for i, j in enumerate(self.dests[k])]

    def matrix(self) -> np.ndarray:
        """The mixing matrix ``W`` (``n x n``, doubly stochastic): row ``i`` weighs the
        copies device ``i`` averages."""
        w = np.eye(self.n) * self.weight
        for dest in self.dests:
            for i, j in enumerate(dest):
                w[j, i] += self.weight
        return w

    def spectral_gap(self) -> float:
        """``1 - max_{k >= 2} |lambda_k(W)|`` (0 for one device: nothing to mix)."""
        if self.n == 1:
            return 0.0
        moduli = np.sort(np.abs(np.linalg.eigvals(self.matrix())))
        return float(1.0 - moduli[-2])


def grid_shape(n: int) -> tuple[int, int]:
    """``(r, c)``: ``r * c = n``, ``r`` the largest divisor of ``n`` with ``r <= sqrt(n)``."""
    r = max(d for d in range(1, math.isqrt(n) + 1) if n % d == 0)
    return r, n // r


@functools.lru_cache(maxsize=256)
def topology(name: str, n: int) -> Topology:
    """The topology ``name`` (one of :data:`TOPOLOGIES`) on ``n`` devices.

    Args:
      name: ``"ring"``, ``"torus"`` or ``"exponential"`` (see the module docstring).
      n: the number of devices on the gossip axis.

    Returns:
      A :class:`Topology`: its permutations, weights, mixing matrix and spectral gap.

    Example::

      >>> import jaxcomp as jc
      >>> t = jc.topology("ring", 8)
      >>> t.neighbours, round(t.spectral_gap(), 3)
      (2, 0.195)
    """
    check_topology(name, "name")
    if isinstance(n, bool) or not isinstance(n, int | np.integer) or n < 1:
        raise ValueError(f"`n` must be an int >= 1, got {n!r}")
    n = int(n)
    devices = range(n)
    grid = (1, n)
    if name == "ring":
        candidates = [tuple((i + s) % n for i in devices) for s in (1, -1)]
    elif name == "exponential":
        offsets = [2**k for k in range(max(1, math.ceil(math.log2(n))) + 1) if 2**k < n]
        candidates = [tuple((i + s) % n for i in devices) for s in offsets]
    else:
        grid = r, c = grid_shape(n)

        def move(i: int, dr: int, dc: int) -> int:
            return ((i // c + dr) % r) * c + (i % c + dc) % c

        candidates = [
            tuple(move(i, dr, dc) for i in devices) for dr, dc in ((0, 1), (0, -1), (1, 0), (-1, 0))
        ]
    identity = tuple(devices)
    dests = tuple(dict.fromkeys(p for p in candidates if p != identity))
    return Topology(name, n, grid, dests)
