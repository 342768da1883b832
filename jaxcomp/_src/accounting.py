"""Communication accounting: how many bytes does a jitted step put on the wire?

:func:`comm_report` lowers and compiles a function, then reads every collective out of
two texts of the same program:

* the **compiled** program (``lowered.compile().as_text()``, optimized HLO): what XLA
  will actually run on this backend, and
* the **logical** program (``lowered.as_text()``, StableHLO): what the JAX code asked
  for, before any backend rewrites.

Ring model
----------
Each collective is costed as the bytes *one device sends* per call under the classic
ring (bandwidth-optimal) algorithms, with ``n`` the size of the replica group and ``S``
the array bytes of the op (summed over the arrays of a tuple-shaped op):

==================  ===========================  =======================================
kind                bytes sent per device        ``S`` is
==================  ===========================  =======================================
all-reduce          ``2 (n - 1) / n * S``        the reduced arrays (input = output)
all-gather          ``(n - 1) / n * S``          the gathered **output**
reduce-scatter      ``(n - 1) / n * S``          the **input** (= output * n)
all-to-all          ``(n - 1) / n * S``          the operands (= the results)
collective-permute  ``S``                        the permuted arrays
==================  ===========================  =======================================

A group of one device sends nothing. The model ignores latency and topology. A collective
inside a ``while`` body (``lax.scan``, ``fori_loop``) is flagged ``in_loop=True`` and counted
once in ``bytes_per_device``; :attr:`CommReport.loop_bytes_per_device` counts it as many
times as it runs per call (:attr:`Collective.runs`: the loops' trip counts, as XLA knows
them at compile time).

Why logical and compiled numbers differ
---------------------------------------
* XLA:CPU has no bf16 reduction kernels for collectives: it widens a bf16 all-reduce to
  f32 in the compiled program (``convert -> all-reduce f32 -> convert``), doubling its
  bytes. GPU/TPU backends keep bf16. The logical numbers show what a fast interconnect
  would carry; the compiled numbers show what this backend really sends.
* XLA combines several small all-reduces of one group into one all-reduce whose result
  is a tuple (``AllReduceCombiner``), so compiled *counts* are lower than logical ones
  while the bytes stay the same.
* Collectives can be rewritten (e.g. all-reduce into reduce-scatter + all-gather) or
  made asynchronous (``all-gather-start`` / ``all-gather-done`` pairs; only the
  ``-start`` is counted).

The parsers :func:`parse_hlo_collectives` and :func:`parse_stablehlo_collectives` work
on plain strings, so saved dumps can be analysed without the program that made them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from jaxcomp._src.codecs.base import check_int

__all__ = [
    "KINDS",
    "Collective",
    "CommReport",
    "Conditional",
    "at_count",
    "array_nbytes",
    "comm_report",
    "dtype_bits",
    "format_bytes",
    "parse_hlo_collectives",
    "parse_stablehlo_collectives",
    "ring_bytes",
]

#: The collective kinds this module knows, in HLO spelling.
KINDS: tuple[str, ...] = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)

Shape = tuple[int, ...]

# --------------------------------------------------------------------------- data types


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective op found in a program.

    Attributes:
      kind: one of :data:`KINDS` (``-start`` suffixes of async ops are dropped).
      dtypes: HLO element type of each array of the op's result (``"f32"``, ``"bf16"``...).
      shapes: the dimensions of each result array, aligned with ``dtypes``. For async
        ``-start`` ops these are the output buffers only.
      array_bytes: ``S`` of the ring model: output bytes for all-gather, input bytes for
        reduce-scatter, result bytes otherwise.
      group_size: ``n``, the number of devices in each replica group (for
        collective-permute: the number of distinct devices named in the pairs).
      bytes_per_device: ring-model bytes each device sends each time the op runs.
      name: instruction name in the program (``"psum_invariant.7"``, ``"%5"``).
      in_loop: whether the op sits in a ``while`` body/condition (or a computation
        called from one), so its true cost is ``bytes_per_device`` times ``runs``.
        Only detected in compiled HLO.
      branch: where the op sits in ``lax.cond`` / ``lax.switch`` branches, outermost first:
        ``((k, i), ...)`` is branch ``i`` of conditional ``k`` (see :class:`Conditional`);
        ``()`` for an op that runs on every call.
      runs: how many times the op runs per call: 1 outside loops; inside ``while`` loops
        (``lax.scan``, ``fori_loop``) the product of their trip counts as XLA knows them at
        compile time (``known_trip_count``; a loop's condition runs once more than its
        body), None where a loop around it has none (a bound computed at run time). Read
        from compiled HLO only: 1 in the logical program.
    """

    kind: str
    dtypes: tuple[str, ...]
    shapes: tuple[Shape, ...]
    array_bytes: int
    group_size: int
    bytes_per_device: float
    name: str = ""
    in_loop: bool = False
    branch: tuple[tuple[int, int], ...] = ()
    runs: int | None = 1

    @property
    def dtype(self) -> str:
        """The element types joined by ``,`` with duplicates dropped (for display)."""
        return ",".join(dict.fromkeys(self.dtypes))

    def shape_str(self) -> str:
        """Shapes in HLO style: ``"[1024]"``, ``"[1,3]x8"`` (repeated), long tuples elided."""
        parts = ["[" + ",".join(map(str, s)) + "]" for s in self.shapes]
        if len(parts) > 1 and len(set(parts)) == 1:
            return f"{parts[0]}x{len(parts)}"
        if len(parts) > 4:
            return " ".join(parts[:3]) + f" ... ({len(parts)} arrays)"
        return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class Conditional:
    """One ``lax.cond`` / ``lax.switch`` of a program whose branches hold collectives.

    Branch ``i`` is ``branches[i]`` of ``lax.switch``; for ``lax.cond(pred, true_fun,
    false_fun)`` branch 0 is ``false_fun`` and branch 1 is ``true_fun``.

    Attributes:
      index: its number among the conditionals that hold collectives, in program order (an
        outer conditional before those inside its branches); :attr:`Collective.branch` and
        ``branch_weights`` use it.
      name: its instruction name in the program (``"conditional.2"``, ``"%4"``).
      num_branches: how many branches it has.
      parent: ``(k, i)`` when it sits in branch ``i`` of conditional ``k``, else ``None``.
    """

    index: int
    name: str
    num_branches: int
    parent: tuple[int, int] | None = None


@dataclasses.dataclass(frozen=True)
class CommReport:
    """Collectives of one compiled program, with ring-model byte counts.

    ``bytes_per_device = sum_c bytes(c)`` over the compiled collectives, each costed by the
    ring model with ``n`` its group size and ``S`` its array bytes: all-reduce
    ``2(n-1)/n S``, all-gather ``(n-1)/n S_out``, reduce-scatter ``(n-1)/n S_in``,
    all-to-all ``(n-1)/n S``, collective-permute ``S`` (Patarasuk and Yuan, "Bandwidth
    Optimal All-reduce Algorithms for Clusters of Workstations", JPDC 2009).
    ``ratio_to(other)`` is ``other.bytes_per_device / self.bytes_per_device``.

    A program with ``lax.cond`` / ``lax.switch`` runs one branch per call while
    ``bytes_per_device`` counts every branch. With ``w_{k,i}`` the share of the calls of
    conditional ``k`` that take branch ``i``, :meth:`mean_bytes_per_device` is the mean per call:
    ``sum_c bytes(c) * prod_{(k, i) in branch(c)} w_{k,i}`` (an op outside every branch has
    weight 1; an inner conditional's weights count the calls its enclosing branch runs).

    Attributes:
      collectives: collectives of the compiled (optimized) HLO, in program order.
      logical: collectives of the logical StableHLO program, in program order.
      hlo_text: the compiled HLO text that was parsed.
      stablehlo_text: the StableHLO text that was parsed.
      conditionals: the conditionals of the compiled program that hold collectives (XLA drops
        a conditional whose predicate is a constant: see :func:`at_count`).
      logical_conditionals: the same for the logical program.
    """

    collectives: tuple[Collective, ...]
    logical: tuple[Collective, ...]
    hlo_text: str = dataclasses.field(default="", repr=False, compare=False)
    stablehlo_text: str = dataclasses.field(default="", repr=False, compare=False)
    conditionals: tuple[Conditional, ...] = ()
    logical_conditionals: tuple[Conditional, ...] = ()

    @property
    def bytes_per_device(self) -> float:
        """Ring-model bytes each device sends per call, summed over compiled collectives."""
        return float(sum(c.bytes_per_device for c in self.collectives))

    @property
    def loop_bytes_per_device(self) -> float:
        """:attr:`bytes_per_device` with each compiled collective counted as often as it runs
        per call (:attr:`Collective.runs`): ``sum_c runs(c) bytes(c)``, so a ``psum`` inside
        a ``lax.scan`` of length 5 counts 5 times (``bytes_per_device`` counts it once).
        NaN where a collective that sends bytes sits in a loop whose trip count XLA does not
        know at compile time."""
        if any(c.runs is None and c.bytes_per_device for c in self.collectives):
            return math.nan
        return float(sum(c.bytes_per_device * (c.runs or 0) for c in self.collectives))

    @property
    def logical_bytes_per_device(self) -> float:
        """Like :attr:`bytes_per_device`, over the logical (StableHLO) collectives."""
        return float(sum(c.bytes_per_device for c in self.logical))

    @property
    def count(self) -> int:
        """Number of collectives in the compiled program."""
        return len(self.collectives)

    def by_kind(self) -> dict[str, float]:
        """Compiled bytes per device grouped by kind (only kinds that occur)."""
        return _sum_by_kind(self.collectives)

    def logical_by_kind(self) -> dict[str, float]:
        """Logical bytes per device grouped by kind (only kinds that occur)."""
        return _sum_by_kind(self.logical)

    def largest(self, k: int = 5) -> list[Collective]:
        """The ``k`` compiled collectives sending the most bytes, largest first."""
        return sorted(self.collectives, key=lambda c: c.bytes_per_device, reverse=True)[:k]

    def branch_bytes(self, logical: bool = False) -> dict[tuple[int, int] | None, float]:
        """Bytes per device per call of each branch: ``{(k, i): bytes}`` for branch ``i`` of
        conditional ``k`` (its own collectives, not those of conditionals inside it; 0.0 for a
        branch that sends nothing), and ``{None: bytes}`` for the collectives every call runs.
        ``logical=True`` reads the logical program."""
        conditionals = self.logical_conditionals if logical else self.conditionals
        out: dict[tuple[int, int] | None, float] = {None: 0.0}
        out.update({(c.index, i): 0.0 for c in conditionals for i in range(c.num_branches)})
        for c in self.logical if logical else self.collectives:
            key = c.branch[-1] if c.branch else None
            out[key] += c.bytes_per_device
        return out

    def mean_bytes_per_device(self, branch_weights: Any = None, *, logical: bool = False) -> float:
        """Mean bytes per device per call of a program with branches (see the class docstring).

        Args:
          branch_weights: how often each branch runs: ``{k: [w_0, w_1, ...]}`` per conditional
            ``k`` of :attr:`conditionals` (counts or shares: each list is normalized), or one
            list when the program has one conditional. ``None`` for a program without any.
          logical: weigh the logical program's collectives instead of the compiled ones.

        Returns:
          ``sum_c bytes(c) * prod_{(k, i) in c.branch} w_{k,i}``.

        Raises:
          ValueError: a conditional without weights (the error names its branches' bytes), a
            conditional the program does not have, or weights that are negative, not finite,
            all zero or not one per branch.

        Example::

            report = jc.comm_report(step, params, state, x, y)   # 1-bit Adam, freeze_step=50
            report.mean_bytes_per_device([950, 50])   # 1000 steps: 50 warm-up (cond's true branch)
        """
        conditionals = self.logical_conditionals if logical else self.conditionals
        w = _branch_frequencies(branch_weights, conditionals, self.branch_bytes(logical))
        return float(
            sum(
                c.bytes_per_device * math.prod(w[k][i] for k, i in c.branch)
                for c in (self.logical if logical else self.collectives)
            )
        )

    def ratio_to(self, other: CommReport) -> float:
        """``other.bytes_per_device / self.bytes_per_device``: the saving of ``self``.

        E.g. ``compressed.ratio_to(baseline) == 4.0`` means the compressed step sends a
        quarter of the baseline's bytes. Returns ``inf`` when only ``self`` sends nothing
        and ``nan`` when neither sends anything.
        """
        mine, theirs = self.bytes_per_device, other.bytes_per_device
        if mine == 0:
            return math.nan if theirs == 0 else math.inf
        return theirs / mine

    def __str__(self) -> str:
        return _format_report(self)


# --------------------------------------------------------------------------- dtypes, shapes

_DTYPE_BITS: dict[str, int] = {
    "pred": 8,
    "s8": 8,
    "u8": 8,
    "s16": 16,
    "u16": 16,
    "f16": 16,
    "bf16": 16,
    "s32": 32,
    "u32": 32,
    "f32": 32,
    "s64": 64,
    "u64": 64,
    "f64": 64,
    "c64": 64,
    "c128": 128,
    "s4": 4,
    "u4": 4,
    "s2": 2,
    "u2": 2,
    "s1": 1,
    "u1": 1,
    "f4e2m1fn": 4,
    "token": 0,
}


def dtype_bits(dtype: str) -> int:
    """Bits per element of an HLO element type (``"f32"`` -> 32, ``"s4"`` -> 4).

    Every ``f8*`` type is 8 bits. Raises ``KeyError`` for unknown types.
    """
    d = dtype.lower()
    if d.startswith("f8"):
        return 8
    if d.startswith("f6"):
        return 6
    return _DTYPE_BITS[d]


def array_nbytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes of one dense array: ``ceil(numel * bits / 8)`` (so ``s4[3]`` is 2 bytes)."""
    return math.ceil(math.prod(shape) * dtype_bits(dtype) / 8)


def ring_bytes(kind: str, array_bytes: float, group_size: int) -> float:
    """Ring-model bytes one device sends for one call (see the module docstring).

    Args:
      kind: one of :data:`KINDS`.
      array_bytes: ``S``: output bytes for all-gather, input bytes for reduce-scatter,
        the arrays' bytes otherwise.
      group_size: ``n``, devices per replica group.
    """
    n = group_size
    if n <= 1:
        return 0.0
    if kind == "all-reduce":
        return 2.0 * (n - 1) / n * array_bytes
    if kind in ("all-gather", "reduce-scatter", "all-to-all"):
        return (n - 1) / n * array_bytes
    if kind == "collective-permute":
        return float(array_bytes)
    raise ValueError(f"unknown collective kind {kind!r}")


def format_bytes(n: float) -> str:
    """Human-readable binary size: ``112 B``, ``7.00 KiB``, ``1.50 MiB``.

    Args:
      n: a number of bytes.
    """
    if not math.isfinite(n):
        return str(n)
    sign = "-" if n < 0 else ""
    n = abs(n)
    if n < 1024:
        return f"{sign}{n:g} B" if n == int(n) else f"{sign}{n:.1f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{sign}{n:.2f} {unit}"
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- group modes


def _group_size_from_mode(
    groups_size: int | None,
    *,
    has_channel: bool,
    global_ids: bool,
    kind: str,
    replicas: int | None,
    partitions: int | None,
    fallback: int,
) -> int:
    """Devices per group, following XLA's ``CollectiveOpGroupMode``.

    ``groups_size`` is the size of the listed groups (``None`` when the list is empty,
    meaning "every participant"). Without a channel the ids are replicas; with a channel
    all-to-all and collective-permute work across partitions, while all-reduce,
    all-gather and reduce-scatter either use flattened global ids
    (``use_global_device_ids``) or replica ids spanning all partitions.
    """
    if replicas is None and partitions is None:
        return fallback if groups_size is None else groups_size
    r, p = replicas or 1, partitions or 1
    if not has_channel:
        mode_total, factor = r, 1
    elif kind in ("all-to-all", "collective-permute"):
        mode_total, factor = p, 1
    elif global_ids:
        mode_total, factor = r * p, 1
    else:  # cross-replica-and-partition: each listed replica brings all its partitions
        mode_total, factor = r * p, p
    return mode_total if groups_size is None else groups_size * factor


# --------------------------------------------------------------------------- HLO parsing

_KIND_ALT = "|".join(re.escape(k) for k in KINDS)
_HLO_OP_RE = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<shape>[^%\"]*?)\s*"
    rf"(?<![\w\-])(?P<kind>{_KIND_ALT})(?P<start>-start)?\("
)
_HLO_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_HLO_HEADER_RE = re.compile(r"^HloModule\b.*$", re.MULTILINE)
_HLO_COMPUTATION_RE = re.compile(r"^(?:ENTRY\s+)?%?(?P<name>[\w.\-]+)\s*\(.*\{\s*$")
_HLO_CALLEE_RE = re.compile(
    r"\b(?:to_apply|calls|body|condition|true_computation|false_computation)=%?([\w.\-]+)"
)
_HLO_BRANCHES_RE = re.compile(r"\bbranch_computations=\{([^}]*)\}")
_HLO_LOOP_RE = re.compile(r"\b(?:body|condition)=%?([\w.\-]+)")
_COMMENT_RE = re.compile(r"/\*.*?\*/")


def _split_top_level(s: str) -> list[str]:
    """Split ``s`` at commas that are not nested in (), [] or {}."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return [p.strip() for p in parts if p.strip()]


def _parse_hlo_shape(s: str) -> Any:
    """Parse an HLO shape into ``(dtype, dims)`` or a (nested) list of those."""
    s = s.strip()
    if s.startswith("(") and s.endswith(")"):
        return [_parse_hlo_shape(p) for p in _split_top_level(s[1:-1])]
    m = _HLO_ARRAY_RE.match(s)
    if m is None:
        raise ValueError(f"cannot parse HLO shape {s!r}")
    dims = tuple(int(d.strip().lstrip("<=")) for d in m.group(2).split(",") if d.strip())
    return (m.group(1), dims)


def _flatten_shape(shape: Any) -> list[tuple[str, Shape]]:
    if isinstance(shape, tuple):
        return [shape]
    return [leaf for sub in shape for leaf in _flatten_shape(sub)]


def _async_output(shape: Any, kind: str) -> Any:
    """The output part of an async ``-start`` op's result shape.

    ``all-reduce-start`` has the same shape as ``all-reduce``. The other ``-start`` ops
    return ``(operands, outputs, context...)``: element 1 is the output (for
    ``collective-permute-start`` the trailing ``u32[]`` entries are context, not data).
    """
    if kind == "all-reduce" or isinstance(shape, tuple):
        return shape
    if len(shape) >= 2:
        return shape[1]
    return shape[-1]


def _parse_int_groups(s: str) -> list[list[int]]:
    """``{{0,1},{2,3}}`` -> ``[[0, 1], [2, 3]]`` (``{}`` -> ``[]``)."""
    return [[int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\{([^{}]*)\}", s)]


def _axes_product(mesh: dict[str, int], refs: list[tuple[str, str | None]]) -> int | None:
    """Devices in a group spanning mesh axes ``refs``: ``(name, sub-axis size or None)``."""
    if not refs or any(r not in mesh and sub is None for r, sub in refs):
        return None
    return math.prod(int(sub) if sub else mesh[r] for r, sub in refs)


def _hlo_mesh_axes_group_size(attrs: str) -> int | None:
    """The mesh-axes form of newer XLA: ``replica_groups=mesh['data'=2,'local'=4] {'local'}``
    (sub-axes as ``'local':(1)2``)."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if m is None:
        return None
    mesh = {a: int(n) for a, n in re.findall(r"'([^']+)'=(\d+)", m.group(1))}
    refs = re.findall(r"'([^']+)'(?::\(\d+\)(\d+))?", m.group(2))
    return _axes_product(mesh, [(a, sub or None) for a, sub in refs])


def _shlo_mesh_axes_group_size(attrs: str, text: str) -> int | None:
    """StableHLO's ``#stablehlo.replica_group_mesh_axes<mesh = @m, axes = [...]>`` (the mesh
    inline as ``#stablehlo.mesh<axes = [...]>`` or a symbol ``sdy.mesh @m = <[...]>``)."""
    start = attrs.find("replica_group_mesh_axes<")
    if start < 0:
        return None
    body = attrs[start:]
    inline = re.findall(r'mesh_axis<name = "([^"]+)", size = (\d+)>', body)
    if inline:
        mesh = {a: int(n) for a, n in inline}
    else:
        name = re.search(r"mesh(?:_name)? = @([\w.$-]+)", body)
        decl = name and re.search(rf"sdy\.mesh @{re.escape(name.group(1))} = <\[([^\]]*)\]", text)
        if not decl:
            return None
        mesh = {a: int(n) for a, n in re.findall(r'"([^"]+)"=(\d+)', decl.group(1))}
    refs_text = body[body.rfind("axes = [") :]  # the group's axes come after the mesh
    refs = re.findall(
        r'axis_ref<name = "([^"]+)"(?:, sub_axis_info = \(\d+\)(\d+))?>'
        r'|axis_ref"([^"]+)"(?::\(\d+\)(\d+))?>',
        refs_text,
    )
    return _axes_product(mesh, [(a or b, (s1 or s2) or None) for a, s1, b, s2 in refs])


def _hlo_replica_group_size(attrs: str) -> int | None:
    """Group size from an op's attributes, or ``None`` for empty/missing groups."""
    size = _hlo_mesh_axes_group_size(attrs)
    if size is not None:
        return size
    m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=", attrs)
    if m:  # iota form [num_groups,group_size]<=[dims]T(perm)
        return int(m.group(2))
    m = re.search(r"replica_groups=\{((?:\{[^{}]*\},?)*)\}", attrs)
    if m is None:
        return None
    groups = [g for g in _parse_int_groups(m.group(1)) if g]
    return max(len(g) for g in groups) if groups else None


def _hlo_permute_size(attrs: str) -> tuple[int, bool]:
    """(distinct devices in ``source_target_pairs``, whether any pair moves data)."""
    m = re.search(r"source_target_pairs=\{((?:\{[^{}]*\},?)*)\}", attrs)
    pairs = _parse_int_groups(m.group(1)) if m else []
    devices = {d for p in pairs for d in p}
    return len(devices), any(len(p) == 2 and p[0] != p[1] for p in pairs)


def _hlo_header(text: str) -> tuple[int | None, int | None]:
    """``(replica_count, num_partitions)`` from the ``HloModule`` line (None if absent)."""
    m = _HLO_HEADER_RE.search(text)
    if m is None:
        return None, None
    rep = re.search(r"\breplica_count=(\d+)", m.group(0))
    par = re.search(r"\bnum_partitions=(\d+)", m.group(0))
    return (int(rep.group(1)) if rep else None, int(par.group(1)) if par else None)


def _hlo_loop_computations(lines: Iterable[str]) -> set[str]:
    """Names of computations run inside a while loop (bodies, conditions, their callees)."""
    callees: dict[str, set[str]] = {}
    roots: set[str] = set()
    current = ""
    for line in lines:
        head = _HLO_COMPUTATION_RE.match(line)
        if head and not line[:1].isspace():
            current = head.group("name")
            callees.setdefault(current, set())
            continue
        if " while(" in line:
            roots.update(_HLO_LOOP_RE.findall(line))
        found = set(_HLO_CALLEE_RE.findall(line))
        for branches in _HLO_BRANCHES_RE.findall(line):
            found.update(b.strip().lstrip("%") for b in branches.split(",") if b.strip())
        callees.setdefault(current, set()).update(found)
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(callees.get(name, ()))
    return seen


def parse_hlo_collectives(text: str, num_devices: int | None = None) -> list[Collective]:
    """Every collective in an HLO module's text (compiled or not), in text order.

    Handles tuple results (combined all-reduces, all-to-all over several arrays), async
    ``-start`` ops (``-done`` ops are ignored), ops in nested computations, the
    replica-group spellings ``{{0,1},{2,3}}``, ``[2,4]<=[8]``, ``[2,4]<=[4,2]T(1,0)`` and
    ``{}``, and ops in ``conditional`` branches (:attr:`Collective.branch`).

    Args:
      text: HLO text, e.g. ``jax.jit(f).lower(x).compile().as_text()``.
      num_devices: size of an empty replica group when the ``HloModule`` header names
        neither ``replica_count`` nor ``num_partitions``; defaults to
        ``jax.device_count()``.
    """
    return _hlo_program(text, num_devices)[0]


def _hlo_collectives(text: str, num_devices: int | None) -> list[Collective]:
    """:func:`parse_hlo_collectives` without the branches."""
    replicas, partitions = _hlo_header(text)
    fallback = num_devices if num_devices is not None else jax.device_count()
    lines = _COMMENT_RE.sub("", text).splitlines()
    loop_comps = _hlo_loop_computations(lines)
    out: list[Collective] = []
    current = ""
    for line in lines:
        head = _HLO_COMPUTATION_RE.match(line)
        if head and not line[:1].isspace():
            current = head.group("name")
            continue
        m = _HLO_OP_RE.match(line)
        if m is None:
            continue
        kind = m.group("kind")
        shape = _parse_hlo_shape(m.group("shape"))
        if m.group("start"):
            shape = _async_output(shape, kind)
        arrays = _flatten_shape(shape)
        attrs = line[m.end() :]
        if kind == "collective-permute":
            n, moves = _hlo_permute_size(attrs)
            group = n
        else:
            moves = True
            group = _group_size_from_mode(
                _hlo_replica_group_size(attrs),
                has_channel="channel_id=" in attrs,
                global_ids="use_global_device_ids=true" in attrs,
                kind=kind,
                replicas=replicas,
                partitions=partitions,
                fallback=fallback,
            )
        out.append(
            _make_collective(kind, arrays, group, m.group("name"), current in loop_comps, moves)
        )
    return out


def _make_collective(
    kind: str,
    arrays: Sequence[tuple[str, Shape]],
    group: int,
    name: str,
    in_loop: bool,
    moves: bool = True,
    input_bytes: int | None = None,
) -> Collective:
    """Build a :class:`Collective` from its result arrays (``input_bytes`` overrides S_in)."""
    result_bytes = sum(array_nbytes(d, s) for d, s in arrays)
    if kind == "reduce-scatter":
        size = input_bytes if input_bytes is not None else result_bytes * max(group, 1)
    else:
        size = result_bytes
    return Collective(
        kind=kind,
        dtypes=tuple(d for d, _ in arrays),
        shapes=tuple(s for _, s in arrays),
        array_bytes=size,
        group_size=group,
        bytes_per_device=ring_bytes(kind, size, group) if moves else 0.0,
        name=name,
        in_loop=in_loop,
    )


# --------------------------------------------------------------------------- StableHLO parsing

_SHLO_KINDS = {
    "all_reduce": "all-reduce",
    "all_gather": "all-gather",
    "reduce_scatter": "reduce-scatter",
    "all_to_all": "all-to-all",
    "collective_permute": "collective-permute",
}
_SHLO_OP_RE = re.compile(
    r"(?P<lhs>%[\w#:.\-]+(?:\s*,\s*%[\w#:.\-]+)*)\s*=\s*\"?stablehlo\."
    r"(?P<op>all_reduce|all_gather|reduce_scatter|all_to_all|collective_permute)\b\"?"
)
_SHLO_TENSOR_RE = re.compile(r"tensor<((?:[0-9?]+x)*)([a-zA-Z][\w]*(?:<\w+>)?)[^<>]*>")
_MLIR_DTYPES = {
    "i1": "pred",
    "complex<f32>": "c64",
    "complex<f64>": "c128",
}


def _mlir_dtype(t: str) -> str:
    """MLIR element type -> HLO spelling (``ui32`` -> ``u32``, ``f8E4M3FN`` -> ``f8e4m3fn``)."""
    if t in _MLIR_DTYPES:
        return _MLIR_DTYPES[t]
    if re.fullmatch(r"ui\d+", t):
        return "u" + t[2:]
    if re.fullmatch(r"si?\d+|i\d+", t):
        return "s" + t.lstrip("si")
    return t.lower()


def _mlir_tensors(s: str) -> list[tuple[str, Shape]]:
    """All ``tensor<AxBxT>`` types in ``s`` as ``(hlo_dtype, dims)``; ``?`` dims count 0."""
    out = []
    for dims, elt in _SHLO_TENSOR_RE.findall(s):
        shape = tuple(0 if d == "?" else int(d) for d in dims.split("x") if d)
        out.append((_mlir_dtype(elt), shape))
    return out


def _op_signature(text: str, start: int) -> tuple[str, str, int]:
    """Find the op's trailing ``: (operands) -> results`` signature.

    Scans from ``start`` (just after the op name) for the first ``:`` outside (), [] and
    {} (attribute dictionaries and regions hold their own colons) and returns the
    operand part, the result part and the end offset of the signature line.
    """
    depth = 0
    i, n = start, len(text)
    while i < n:
        ch = text[i]
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == '"':  # skip string literals
            i = text.find('"', i + 1)
            if i < 0:
                break
        elif ch == ":" and depth == 0:
            end = text.find("\n", i)
            end = n if end < 0 else end
            sig = text[i + 1 : end]
            lhs, arrow, rhs = sig.partition("->")
            return (lhs, rhs, end) if arrow else ("", lhs, end)
        i += 1
    return "", "", n


def _dense_groups(attr: str, text: str) -> tuple[list[list[int]] | None, Shape]:
    """Parse ``<attr> = dense<...> : tensor<GxNxi64>`` -> (groups or None, (G, N))."""
    m = re.search(rf"{attr}\s*=\s*dense<(.*?)>\s*:\s*tensor<([0-9x]*)x?i64>", text)
    if m is None:
        return None, ()
    dims = tuple(int(d) for d in m.group(2).split("x") if d)
    body = m.group(1).strip()
    if body.startswith("["):
        groups = [
            [int(x) for x in g.split(",") if x.strip()] for g in re.findall(r"\[([^\[\]]*)\]", body)
        ]
        return groups, dims
    if body and len(dims) == 2:  # splat, e.g. dense<0> : tensor<8x1xi64>
        return [[int(body)] * dims[1] for _ in range(dims[0])], dims
    return [], dims


def _module_attr(text: str, name: str) -> int | None:
    m = re.search(rf"{name}\s*=\s*(\d+)", text)
    return int(m.group(1)) if m else None


def parse_stablehlo_collectives(text: str, num_devices: int | None = None) -> list[Collective]:
    """Every collective in a StableHLO/MLIR module's text, in text order.

    Understands both ``"stablehlo.all_reduce"(...)`` (generic, as JAX prints it) and the
    unquoted spelling, multi-line ops whose type signature follows a region
    (``}) : (tensor<8xf16>) -> tensor<8xf16>``), several operands per op,
    ``replica_groups`` / ``source_target_pairs`` given as ``dense<...>`` attributes, and ops
    in the regions of ``stablehlo.case`` / ``stablehlo.if`` (:attr:`Collective.branch`); ops
    in a private function (a nested ``jax.jit``) count where it is called, once per call and
    in the caller's branch (until 2026-11-27 they counted once, as unconditional: a nested
    jit's collectives in one branch of a ``lax.cond`` weighed as if every step ran them).

    Args:
      text: MLIR text, e.g. ``jax.jit(f).lower(x).as_text()``.
      num_devices: size of an empty replica group when the module names neither
        ``mhlo.num_replicas`` nor ``mhlo.num_partitions``; defaults to
        ``jax.device_count()``.
    """
    return _stablehlo_program(text, num_devices)[0]


def _stablehlo_collectives(text: str, num_devices: int | None) -> list[Collective]:
    """:func:`parse_stablehlo_collectives` without the branches."""
    replicas = _module_attr(text, "mhlo.num_replicas")
    partitions = _module_attr(text, "mhlo.num_partitions")
    fallback = num_devices if num_devices is not None else jax.device_count()
    out: list[Collective] = []
    for m in _SHLO_OP_RE.finditer(text):
        kind = _SHLO_KINDS[m.group("op")]
        operands_sig, results_sig, end = _op_signature(text, m.end())
        # attributes live between the op name and the region / signature
        attrs = text[m.end() : end]
        region = attrs.find("({")
        attrs_head = attrs if region < 0 else attrs[:region]
        operands, results = _mlir_tensors(operands_sig), _mlir_tensors(results_sig)
        moves = True
        if kind == "collective-permute":
            pairs, _ = _dense_groups("source_target_pairs", attrs_head)
            pairs = pairs or []
            group = len({d for p in pairs for d in p if d >= 0})
            moves = any(len(p) == 2 and p[0] != p[1] for p in pairs)
        else:
            groups, dims = _dense_groups("replica_groups", attrs_head)
            sizes = [sum(1 for d in g if d >= 0) for g in groups or []]
            listed = max(sizes) if sizes and max(sizes) > 0 else None
            listed = _shlo_mesh_axes_group_size(attrs_head, text) or listed
            group = _group_size_from_mode(
                listed,
                has_channel="channel_handle" in attrs_head,
                global_ids="use_global_device_ids" in attrs_head,
                kind=kind,
                replicas=replicas,
                partitions=partitions,
                fallback=fallback,
            )
        in_bytes = sum(array_nbytes(d, s) for d, s in operands) if operands else None
        name = m.group("lhs").split(",")[0].strip()
        out.append(_make_collective(kind, results, group, name, False, moves, input_bytes=in_bytes))
    return out


# --------------------------------------------------------------------------- branches

_HLO_CONDITIONAL_RE = re.compile(r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=.*?\sconditional\(")
_HLO_TRUE_FALSE_RE = re.compile(
    r"\btrue_computation=%?([\w.\-]+).*?\bfalse_computation=%?([\w.\-]+)"
)
_SHLO_CONDITIONAL_RE = re.compile(
    r"(?P<lhs>%[\w#.\-]+)(?::\d+)?\s*=\s*\"?stablehlo\.(?P<op>case|if)\b"
)

Path = tuple[tuple[int, int], ...]
# A conditional as found, before numbering: (name, number of branches, branches it sits in).
RawConditional = tuple[str, int, Path]


def _hlo_computations(lines: Iterable[str]) -> tuple[dict[str, list[str]], str]:
    """The instruction lines of each computation, and the name of the entry computation."""
    comps: dict[str, list[str]] = {}
    entry = current = ""
    for line in lines:
        head = _HLO_COMPUTATION_RE.match(line)
        if head and not line[:1].isspace():
            current = head.group("name")
            comps[current] = []
            entry = current if line.startswith("ENTRY") else entry
        elif current:
            comps[current].append(line)
    return comps, entry


def _hlo_branch_names(line: str) -> list[str]:
    """The branch computations of a ``conditional`` line, in branch-index order (for the
    predicate form, index 0 is ``false_computation``, as in ``lax.cond``)."""
    m = _HLO_BRANCHES_RE.search(line)
    if m:
        return [b.strip().lstrip("%") for b in m.group(1).split(",") if b.strip()]
    m = _HLO_TRUE_FALSE_RE.search(line)
    return [m.group(2), m.group(1)] if m else []


def _hlo_branch_map(lines: list[str]) -> tuple[dict[str, Path], list[RawConditional]]:
    """The branches each computation reached from the entry runs in, and every conditional
    in pre-order (an outer conditional before the ones inside its branches)."""
    comps, entry = _hlo_computations(lines)
    paths: dict[str, Path] = {}
    found: list[RawConditional] = []

    def walk(comp: str, path: Path) -> None:
        if comp in paths:
            return
        paths[comp] = path
        for line in comps.get(comp, ()):
            m = _HLO_CONDITIONAL_RE.match(line)
            if m:
                branches = _hlo_branch_names(line)
                found.append((m.group("name"), len(branches), path))
                k = len(found) - 1
                for i, b in enumerate(branches):
                    walk(b, (*path, (k, i)))
            else:
                for callee in _HLO_CALLEE_RE.findall(line):
                    walk(callee, path)

    walk(entry, ())
    return paths, found


_HLO_BODY_RE = re.compile(r"\bbody=%?([\w.\-]+)")
_HLO_CONDITION_RE = re.compile(r"\bcondition=%?([\w.\-]+)")
_HLO_TRIP_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')


def _hlo_callees(line: str) -> list[tuple[str, int | None]]:
    """``(computation, runs per execution of the instruction)`` for each computation one HLO
    instruction calls: a ``while``'s body its trip count ``t`` (``known_trip_count``, None
    when XLA does not know it), its condition ``t + 1``; any other callee once."""
    if " while(" not in line:
        names = set(_HLO_CALLEE_RE.findall(line)) | set(_hlo_branch_names(line))
        return [(name, 1) for name in sorted(names)]
    m = _HLO_TRIP_RE.search(line)
    t = int(m.group(1)) if m else None
    calls = [(body, t) for body in _HLO_BODY_RE.findall(line)]
    return calls + [(c, None if t is None else t + 1) for c in _HLO_CONDITION_RE.findall(line)]


def _hlo_runs(lines: list[str]) -> dict[str, int | None]:
    """How many times each computation reached from the entry runs per call (summed over
    the instructions that call it; None below a loop whose trip count is unknown)."""
    comps, entry = _hlo_computations(lines)
    runs: dict[str, int | None] = {}

    def add(comp: str, times: int | None) -> None:
        before = runs.get(comp, 0)
        runs[comp] = None if before is None or times is None else before + times
        for line in comps.get(comp, ()):
            for callee, factor in _hlo_callees(line):
                add(callee, None if times is None or factor is None else times * factor)

    add(entry, 1)
    return runs


def _hlo_program(
    text: str, num_devices: int | None
) -> tuple[list[Collective], tuple[Conditional, ...]]:
    """The collectives of an HLO text with their branches and how often each runs per call
    (:attr:`Collective.runs`), and its numbered conditionals."""
    lines = _COMMENT_RE.sub("", text).splitlines()
    comp_paths, raw = _hlo_branch_map(lines)
    comp_runs = _hlo_runs(lines)
    paths, runs, current = [], [], ""
    for line in lines:
        head = _HLO_COMPUTATION_RE.match(line)
        if head and not line[:1].isspace():
            current = head.group("name")
        elif _HLO_OP_RE.match(line):
            paths.append(comp_paths.get(current, ()))
            runs.append(comp_runs.get(current, 1))
    collectives = [
        dataclasses.replace(c, runs=r)
        for c, r in zip(_hlo_collectives(text, num_devices), runs, strict=True)
    ]
    return _number_branches(collectives, paths, raw)


def _regions(text: str, start: int) -> list[tuple[int, int]]:
    """The spans of the regions ``({...}, {...})`` whose opening parenthesis is at ``start``."""
    spans: list[tuple[int, int]] = []
    depth, begin, i = 0, start, start
    while 0 <= i < len(text):
        ch = text[i]
        if ch == '"':
            i = text.find('"', i + 1)
        elif ch in "([{":
            depth += 1
            begin = i if depth == 2 and ch == "{" else begin
        elif ch in ")]}":
            depth -= 1
            if depth == 1 and ch == "}":
                spans.append((begin, i))
            if depth == 0:
                break
        i = i + 1 if i >= 0 else i
    return spans


_SHLO_FUNC_RE = re.compile(r'^(?P<indent>\s*)func\.func\s+private\s+@(?P<name>"[^"]*"|[\w.$\-]+)\(')
_SHLO_CALL_RE = re.compile(r'=\s*(?:func\.)?call\s+@(?P<name>"[^"]*"|[\w.$\-]+)\(')


def _private_functions(lines: list[str]) -> dict[str, tuple[int, int]]:
    """``{name: (header line, closing line)}`` of the module's private functions (JAX
    prints each header on one line ending in ``{`` and its ``}`` alone at the same indent)."""
    out = {}
    for i, line in enumerate(lines):
        m = _SHLO_FUNC_RE.match(line)
        if m and line.rstrip().endswith("{"):
            close = m.group("indent") + "}"
            end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == close), None)
            if end is not None:
                out[m.group("name")] = (i, end)
    return out


def _inline_calls(text: str) -> str:
    """``text`` with every ``func.call`` of a private function replaced by that function's
    body (recursively) and the called functions' definitions dropped: a collective inside a
    nested ``jax.jit`` then sits where it runs, in the branch of the ``stablehlo.case`` that
    calls it, once per call (JAX lowers a nested jit to such a call)."""
    lines = text.splitlines()
    funcs = _private_functions(lines)
    called = {m.group("name") for line in lines if (m := _SHLO_CALL_RE.search(line))}
    if not funcs or not called & funcs.keys():
        return text

    def expand(body: list[str], depth: int) -> list[str]:
        out: list[str] = []
        for line in body:
            m = _SHLO_CALL_RE.search(line)
            if m and m.group("name") in funcs and depth < 64:
                a, b = funcs[m.group("name")]
                out += expand(lines[a + 1 : b], depth + 1)
            else:
                out.append(line)
        return out

    drop = {k for name, (a, b) in funcs.items() if name in called for k in range(a, b + 1)}
    return "\n".join(expand([x for k, x in enumerate(lines) if k not in drop], 0))


def _stablehlo_program(
    text: str, num_devices: int | None
) -> tuple[list[Collective], tuple[Conditional, ...]]:
    """The collectives of a StableHLO text with their branches, and its numbered conditionals
    (``stablehlo.if``'s first region is the true branch: index 1, as in ``lax.cond``); a
    private function's collectives count where it is called (:func:`_inline_calls`)."""
    text = _inline_calls(text)
    conds = []
    for m in _SHLO_CONDITIONAL_RE.finditer(text):
        spans = _regions(text, text.find("({", m.end()))
        order = [1, 0] if m.group("op") == "if" and len(spans) == 2 else range(len(spans))
        conds.append((m.group("lhs"), m.start(), list(zip(spans, order, strict=True))))

    def locate(offset: int) -> Path:
        return tuple(
            (k, i)
            for k, (_, _, regions) in enumerate(conds)
            for (a, b), i in regions
            if a < offset < b
        )

    raw = [(name, len(regions), locate(pos)) for name, pos, regions in conds]
    paths = [locate(m.start()) for m in _SHLO_OP_RE.finditer(text)]
    return _number_branches(_stablehlo_collectives(text, num_devices), paths, raw)


def _number_branches(
    collectives: list[Collective], paths: list[Path], raw: list[RawConditional]
) -> tuple[list[Collective], tuple[Conditional, ...]]:
    """Number the conditionals that hold collectives 0, 1, ... (pre-order kept) and give each
    collective its :attr:`Collective.branch` in those numbers."""
    used = sorted({k for path in paths for k, _ in path})
    new = {k: j for j, k in enumerate(used)}
    conditionals = tuple(
        Conditional(new[k], raw[k][0], raw[k][1], (new[raw[k][2][-1][0]], raw[k][2][-1][1]))
        if raw[k][2]
        else Conditional(new[k], raw[k][0], raw[k][1])
        for k in used
    )
    out = [
        dataclasses.replace(c, branch=tuple((new[k], i) for k, i in path))
        for c, path in zip(collectives, paths, strict=True)
    ]
    return out, conditionals


def _normalized(weights: Any, cond: Conditional) -> list[float]:
    """``weights`` of one conditional as frequencies summing to 1 (counts are fine)."""
    w = [float(x) for x in weights]
    if len(w) != cond.num_branches or any(not math.isfinite(x) or x < 0 for x in w) or not sum(w):
        raise ValueError(
            f"`branch_weights` of conditional {cond.index} (`{cond.name}`) must be "
            f"{cond.num_branches} finite, non-negative numbers (how often each branch runs), "
            f"not all zero; got {list(weights)}"
        )
    return [x / sum(w) for x in w]


def _branch_frequencies(
    weights: Any, conditionals: Sequence[Conditional], branch_bytes: dict
) -> dict[int, list[float]]:
    """``branch_weights`` as ``{conditional: frequencies}``; a sequence stands for the only
    conditional's weights."""
    if weights is None:
        weights = {}
    elif not hasattr(weights, "items"):
        if len(conditionals) != 1:
            raise ValueError(
                f"`branch_weights`: the program has {len(conditionals)} conditionals that hold "
                "collectives; pass a dict {conditional: weights per branch}"
            )
        weights = {0: weights}
    unknown = set(weights) - {c.index for c in conditionals}
    if unknown:
        raise ValueError(
            f"`branch_weights` names conditionals {sorted(unknown)} that the program does not "
            f"have; it has {[c.index for c in conditionals]}"
        )
    for c in conditionals:
        if c.index not in weights:
            each = ", ".join(
                format_bytes(branch_bytes.get((c.index, i), 0.0)) for i in range(c.num_branches)
            )
            raise ValueError(
                f"`branch_weights` has no weights for conditional {c.index} (`{c.name}`, "
                f"{c.num_branches} branches sending {each}); pass {{{c.index}: [how often "
                "each branch runs]}"
            )
    return {c.index: _normalized(weights[c.index], c) for c in conditionals}


def at_count(state: Any, count: int) -> Any:
    """``state`` with the step count of every jaxcomp state in it replaced by the constant
    ``count``, to lower one step of a schedule.

    Called inside a step function on its optimizer state, before ``tx.update``: every
    ``lax.cond`` / ``lax.switch`` that a jaxcomp transform takes on its step count (1-bit
    Adam's warm-up, 0/1 Adam's rounds, PowerSGD's start, local SGD's and DiLoCo's syncs) then
    has a constant predicate, XLA drops the branches not taken, and :func:`comm_report` of the
    compiled step shows the traffic of that step alone. Without it, weigh the branches with
    :meth:`CommReport.mean_bytes_per_device`. Only the shape of the count is kept: for
    accounting, not for training.

    Args:
      state: an optimizer state (any pytree holding jaxcomp states, e.g. an optax chain's).
      count: the step count (the number of updates applied before the step), an int >= 0.

    Returns:
      ``state`` with each ``count`` field of a jaxcomp state a NumPy constant of its shape.

    Raises:
      ValueError: ``count`` below 0 (a negative count lowered some other step's branches).
      TypeError: ``count`` not an int (a float was truncated to the step below it).

    Example::

        def step_at(t):
            def step(p, s, x, y):
                g = jax.grad(loss)(jax.lax.pcast(p, "data", to="varying"), x, y)
                u, s = tx.update(g, jc.at_count(s, t), p)
                return optax.apply_updates(p, u), s
            return jax.jit(jax.shard_map(step, ...))

        warmup = jc.comm_report(step_at(0), params, state, x, y).bytes_per_device
    """

    count = check_int("count", count, 0)

    def is_state(node: Any) -> bool:
        fields = getattr(type(node), "_fields", ())
        return "count" in fields and type(node).__module__.startswith("jaxcomp.")

    def fix(node: Any) -> Any:
        if not is_state(node):
            return node
        return node._replace(count=np.full(np.shape(node.count), count, np.int32))

    return jax.tree.map(fix, state, is_leaf=is_state)


# --------------------------------------------------------------------------- driver


def _lower(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    if isinstance(fn, jax.stages.Lowered | jax.stages.Compiled):  # jax: "Cannot apply JAX
        raise TypeError(  # transformations to a function lowered and compiled ..."
            f"`fn` must be the step itself (jitted or not), got a {type(fn).__name__}: "
            "jc.comm_report(step, *args) lowers and compiles it with the step's own arguments"
        )
    lower = getattr(fn, "lower", None)
    if lower is None:
        return jax.jit(fn).lower(*args, **kwargs)
    return lower(*args, **kwargs)


def comm_report(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> CommReport:
    """Lower and compile ``fn(*args, **kwargs)`` and account for its collectives.

    ``fn`` may be a ``jax.jit``-ed function (including ``jax.jit(jax.shard_map(...))``),
    a ``jax.pmap``-ed function, or a plain callable (it is wrapped in ``jax.jit``).
    Nothing is executed; arrays only provide shapes and shardings.

    Each collective of the compiled HLO (and of the logical StableHLO) is costed as the
    bytes one device sends per call in the ring model (see :class:`CommReport`): e.g. an
    all-reduce of ``S`` bytes over ``n`` devices sends ``2(n-1)/n S`` (the bandwidth-optimal
    ring of Patarasuk and Yuan, JPDC 2009). Latency and topology are not modelled; a
    collective inside a loop counts once in ``bytes_per_device`` and as often as it runs in
    :attr:`CommReport.loop_bytes_per_device`. Collectives inside ``lax.cond`` /
    ``lax.switch`` branches are all counted in ``bytes_per_device``;
    :meth:`CommReport.branch_bytes` gives each branch's and
    :meth:`CommReport.mean_bytes_per_device` the mean over how often each branch runs.

    Args:
      fn: the step: jitted, pmapped or a plain callable.
      *args: its positional arguments (arrays or ``jax.ShapeDtypeStruct``; only shapes,
        dtypes and shardings are read).
      **kwargs: its keyword arguments, as ``args``.

    Returns:
      A :class:`CommReport`.

    Raises:
      TypeError: ``fn`` a ``jax.stages.Lowered`` or ``Compiled`` (``step.lower(...)``,
        ``.compile()``): pass the step itself.

    Example::

        step = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"), out_specs=P()))
        print(comm_report(step, x))
    """
    lowered = _lower(fn, *args, **kwargs)
    hlo = lowered.compile().as_text() or ""
    logical = lowered.as_text() or ""
    ndev = jax.device_count()
    collectives, conditionals = _hlo_program(hlo, ndev)
    logical_collectives, logical_conditionals = _stablehlo_program(logical, ndev)
    return CommReport(
        collectives=tuple(collectives),
        logical=tuple(logical_collectives),
        hlo_text=hlo,
        stablehlo_text=logical,
        conditionals=conditionals,
        logical_conditionals=logical_conditionals,
    )


# --------------------------------------------------------------------------- formatting


def _sum_by_kind(cs: Iterable[Collective]) -> dict[str, float]:
    out: dict[str, float] = {}
    for c in cs:
        out[c.kind] = out.get(c.kind, 0.0) + c.bytes_per_device
    return out


def _table(title: str, cs: Sequence[Collective]) -> list[str]:
    header = ("kind", "dtype", "shape", "group", "bytes/device")
    rows = [
        (
            c.kind
            + (f" (loop x{'?' if c.runs is None else c.runs})" if c.in_loop else "")
            + "".join(f" [cond {k} branch {i}]" for k, i in c.branch[-1:]),
            c.dtype,
            c.shape_str(),
            str(c.group_size),
            format_bytes(c.bytes_per_device),
        )
        for c in cs
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def fmt(r: Sequence[str]) -> str:
        cells = [r[i].ljust(widths[i]) for i in range(4)] + [r[4].rjust(widths[4])]
        return "  ".join(cells).rstrip()

    lines = [f"{title}: {len(cs)} collective(s)"]
    if rows:
        lines += ["  " + fmt(header), "  " + "  ".join("-" * w for w in widths)]
        lines += ["  " + fmt(r) for r in rows]
    return lines


def _format_report(r: CommReport) -> str:
    lines = _table("compiled", r.collectives)
    lines.append(f"  total: {format_bytes(r.bytes_per_device)} per device per call")
    lines += _table("logical", r.logical)
    lines.append(f"  total: {format_bytes(r.logical_bytes_per_device)} per device per call")
    if any(c.in_loop for c in r.collectives):
        lines.append(
            "  (loop xk): inside a while loop, runs k times per call (? unknown); the totals "
            f"count it once, with the loops: {format_bytes(r.loop_bytes_per_device)} per device"
        )
    if r.conditionals:
        lines.append(
            "  [cond k branch i]: runs only when conditional k takes branch i; the totals count "
            "every branch, mean_bytes_per_device(branch_weights) weighs them"
        )
    return "\n".join(lines)
