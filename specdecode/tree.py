"""Draft trees: the shapes every tree-aware part reads (drafters, the forward description, the
tree verifier, compaction), as pure functions of a proposal's `parents`.

A row's tree has `num_nodes` drafted nodes in topological order (a parent always comes before its
children). `parents[b, i]` is node i's parent within the row, or -1 for a child of the **root**:
the row's last committed token (the one whose successor the target scores first). Depth counts
from the root: a child of the root has depth 1, so node i sits at RoPE position root + depth(i)
and, after compaction, at cache slot root + depth(i). A chain is the tree with parents i - 1.

At most `MAX_TREE_NODES` nodes per row: a node's ancestor set (itself included) is one 64-bit word
whose bit j says "node j is on my path" -- the attention visibility of the tree part of a pass.
"""
from __future__ import annotations

import torch

MAX_TREE_NODES = 64


def chain_parents(batch: int, k: int) -> torch.Tensor:
    """Parents of a chain of k drafts in every row: [batch, k] = -1, 0, 1, ..., k-2."""
    return (torch.arange(k, dtype=torch.long) - 1).expand(batch, k).clone()


def validate(parents: torch.Tensor,      # [batch, n] int64
             num_nodes: torch.Tensor,    # [batch] int64
             ) -> None:
    """Raise ValueError unless every row's first num_nodes[b] parents form a tree in topological
    order of at most MAX_TREE_NODES nodes."""
    batch, n = parents.shape
    if n > MAX_TREE_NODES:
        raise ValueError(f"a draft tree has at most {MAX_TREE_NODES} nodes per row, got {n}")
    index = torch.arange(n)
    live = index[None, :] < num_nodes.reshape(batch, 1).cpu()
    bad = live & ((parents.cpu() < -1) | (parents.cpu() >= index[None, :]))
    if bool(bad.any()):
        b, i = (int(x) for x in bad.nonzero()[0])
        raise _bad_parent(b, i, int(parents[b, i]))


def validate_lists(parents: list[list[int]]) -> None:
    """`validate` on per-row parent lists (a row's length: its nodes), without tensors: tree
    drafters build a proposal at every step, where tensor checks would cost more than the
    drafting."""
    n = max((len(row) for row in parents), default=0)
    if n > MAX_TREE_NODES:
        raise ValueError(f"a draft tree has at most {MAX_TREE_NODES} nodes per row, got {n}")
    for b, row in enumerate(parents):
        for i, p in enumerate(row):
            if not -1 <= p < i:
                raise _bad_parent(b, i, p)


def _bad_parent(row: int, node: int, parent: int) -> ValueError:
    return ValueError(f"draft tree row {row}: node {node} has parent {parent} "
                      f"(must be -1 or an earlier node, 0..{node - 1})")


def depths(parents: torch.Tensor) -> torch.Tensor:
    """[batch, n] depth of each node (1 for children of the root); padding nodes get some depth."""
    parents = parents.cpu()
    batch, n = parents.shape
    depth = torch.zeros(batch, n, dtype=torch.long)
    for i in range(n):
        p = parents[:, i]
        depth[:, i] = torch.where(p < 0, 1, depth.gather(1, p.clamp(min=0)[:, None])[:, 0] + 1)
    return depth


def ancestor_masks(parents: torch.Tensor) -> torch.Tensor:
    """[batch, n] int64: bit j of entry [b, i] is set when node j is node i or one of its
    ancestors (two's complement for bit 63)."""
    rows = parents.cpu().tolist()
    out = []
    for row in rows:
        masks: list[int] = []
        for i, p in enumerate(row):
            m = (1 << i) | (masks[p] if 0 <= p < i else 0)
            masks.append(m)
        out.append([m - (1 << 64) if m >= 1 << 63 else m for m in masks])
    return torch.tensor(out, dtype=torch.long).reshape(parents.shape)


def ancestors(parents: torch.Tensor, num_nodes: torch.Tensor | None = None) -> torch.Tensor:
    """[batch, n+1, n] bool: entry [b, t, j] says node j is on the path of target position t
    (t = 0: the root, no drafted node; t = i + 1: node i and its ancestors). Padding nodes
    (>= num_nodes[b]) are on no path. For a chain this is the lower triangle."""
    batch, n = parents.shape
    masks = ancestor_masks(parents)                                           # [batch, n]
    bits = torch.arange(n, dtype=torch.long)
    on_path = ((masks[:, :, None] >> bits[None, None, :]) & 1).bool()        # [batch, n, n]
    if num_nodes is not None:
        on_path &= (bits[None, None, :] < num_nodes.cpu().reshape(batch, 1, 1))
    return torch.cat([torch.zeros(batch, 1, n, dtype=torch.bool), on_path], dim=1)


def walk_path(parents: list[int], tokens: list[int], path: list[int]) -> list[int] | None:
    """The nodes met from the root along `path` (one row's live `parents` / `tokens`; siblings are
    distinct), or None if the path leaves the tree."""
    nodes, node = [], -1
    for token in path:
        node = next((i for i, p in enumerate(parents) if p == node and tokens[i] == token), None)
        if node is None:
            return None
        nodes.append(node)
    return nodes
