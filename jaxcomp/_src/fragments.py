"""Streaming DiLoCo's fragments: the float leaves cut into contiguous groups balanced by size.

A periodic transform (``jc.diloco``, ``jc.sparseloco``, ``jc.local_sgd``) with ``fragments=F``
syncs one group of leaves at a time. The groups are read from the float leaves' sizes (of the
arrays the transform's ``init`` sees: each device's block where params are sharded), in
order, so that the state's per-fragment fields (outer state, exchange state, pending
snapshots: lists of the group's leaves) and :func:`jaxcomp.state_specs` agree on which leaf
each list entry belongs to.
"""

from __future__ import annotations


def partition(sizes: list[int], fragments: int) -> list[list[int]]:
    """Leaf indices in ``fragments`` groups, in order, balanced by size (none empty)."""
    total, groups, acc, g = float(sum(sizes)), [[] for _ in range(fragments)], 0.0, 0
    for j, s in enumerate(sizes):
        left = len(sizes) - j  # leaves still to place, this one included
        if groups[g] and g < fragments - 1:
            if acc + s / 2 > (g + 1) * total / fragments or left <= fragments - 1 - g:
                g += 1
        groups[g].append(j)
        acc += s
    return groups
