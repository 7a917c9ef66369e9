"""The tree verifier: lossless multi-candidate rejection sampling over a draft tree, a pure
function of tensors.

The terms accepted / recovered / bonus / emitted / mean accepted length are those of
`specdecode.verify` (module docstring, "Trees" paragraph); tree shapes are those of
`specdecode.tree` and `specdecode.drafters.base.DraftProposal`.

Algorithm per row, walking from the root (SpecInfer, Miao et al. 2024; EAGLE; Yang et al. 2024,
"Multi-Candidate Speculative Decoding", recursive rejection sampling without replacement):

* greedy rows: at the current node take the argmax of its target distribution; if a child carries
  that token, accept the child and continue from it, else emit the argmax (recovered, or bonus at a
  node without children). No random draws.
* sampled rows: at the current node the residual starts as its target distribution and the
  children (in node order) were drawn without replacement from one draft distribution (their
  `draft_probs` row, shared by siblings; a point mass on each child when `draft_probs` is None).
  Child c is accepted when ``u * draft(c) < residual(c)`` (u uniform, i.e. probability
  ``min(1, residual(c) / draft(c))``, as in `verify`). On acceptance the walk continues from c.
  On rejection ``residual <- normalize(max(0, residual - draft))`` and c's draft mass is removed
  (``draft(c) <- 0``, renormalized: the next sibling was drawn from what was left); for point
  masses this is ``residual(c) <- 0``, renormalized. When every child is rejected the recovered
  token is sampled from the final residual; at a node without children the bonus token is sampled
  from its target distribution. Every emitted token is then distributed exactly as the target at
  its position. A chain (one child per node) is exactly `verify`'s rule. A numerically zero
  residual falls back as in `verify` (to the distribution it was taken from, RESIDUAL_EPS).

Point-mass drafts (`verify_point_mass`; no draft distributions: lookup, suffix, lookahead, forced
tokens): a sampled row's token at depth d of its path is the target's own sample at that position,
the inverse CDF of the current node's distribution at the position's uniform (`sampling.
position_uniforms`: one per sequence position, not per draw); the child carrying it is accepted and
the walk goes on, else that sample is emitted (recovered, or bonus at a leaf). Greedy rows take the
argmax as above. This is the rule above for point masses in distribution (a child c is accepted
with probability target(c); on rejection the token is distributed as the target without the
children tried), and more: the emitted token at each position is exactly the one plain decoding
samples there with the same uniform, so a seeded request's output does not depend on speculation,
the drafter, the draft sizes or the batch. The position's uniform is used only along the path
actually emitted; the path up to depth d never depends on the uniform of depth d.

Random draws (same convention and count as `verify`, so a chain reproduces `verify` bit for bit):
one acceptance uniform per node, drawn up front (a node's uniform is used only if the node is
tried), then one uniform per sampled row for the recovered / bonus token. With a list of
generators a sampled row b draws exactly ``num_draft[b] + 1`` numbers from its own generator and
a greedy row none, so a row's result depends only on its own generator and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode import tree
from specdecode.sampling import Generators, position_uniforms, sample, sample_at, uniforms
from specdecode.verify import PAD_TOKEN, _residual_probs, verify

__all__ = ["TreeVerifyResult", "verify_drafts", "verify_greedy_lists", "verify_point_mass", "verify_tree"]


@dataclass
class TreeVerifyResult:
    tokens: torch.Tensor          # [batch, n+1] int64 emitted tokens; row b valid in [:num_emitted[b]], rest PAD_TOKEN
    num_accepted: torch.Tensor    # [batch] int64 accepted drafts (= depth of the accepted path)
    num_emitted: torch.Tensor     # [batch] int64 = num_accepted + 1
    accepted_nodes: torch.Tensor  # [batch, n] int64 node accepted at depth 1, 2, ...; -1 padding


def _remove_tried(sibling_probs: torch.Tensor,   # [m, vocab] draft distribution of the untried siblings
                  tried_tokens: torch.Tensor,    # [m] token of the sibling just rejected
                  ) -> torch.Tensor:             # [m, vocab] the same without that token, renormalized
    remaining_probs = sibling_probs.scatter(1, tried_tokens.unsqueeze(1), 0.0)
    return remaining_probs / remaining_probs.sum(dim=1, keepdim=True).clamp(min=torch.finfo(remaining_probs.dtype).tiny)


def _check_inputs(draft_tokens, parents, num_draft, draft_probs, target_probs, greedy) -> None:
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must be [batch, n], got shape {tuple(draft_tokens.shape)}")
    batch, n = draft_tokens.shape
    if tuple(parents.shape) != (batch, n):
        raise ValueError(f"parents must be [batch, n] = [{batch}, {n}], got {tuple(parents.shape)}")
    if target_probs.dim() != 3 or target_probs.shape[:2] != (batch, n + 1):
        raise ValueError(f"target_probs must be [batch, n+1, vocab] = [{batch}, {n + 1}, vocab], "
                         f"got {tuple(target_probs.shape)}")
    vocab = target_probs.shape[-1]
    if draft_probs is not None and tuple(draft_probs.shape) != (batch, n, vocab):
        raise ValueError(f"draft_probs must be [batch, n, vocab] = [{batch}, {n}, {vocab}], "
                         f"got {tuple(draft_probs.shape)}")
    if num_draft.numel() != batch or (batch and (int(num_draft.min()) < 0 or int(num_draft.max()) > n)):
        raise ValueError(f"num_draft must be [batch={batch}] in [0, n={n}], got {num_draft.tolist()}")
    if greedy.numel() != batch:
        raise ValueError(f"greedy must be [batch={batch}], got shape {tuple(greedy.shape)}")
    try:
        tree.validate(parents, num_draft.reshape(batch))
    except ValueError as error:
        raise ValueError(f"parents: {error}") from None
    live = torch.arange(n, device=draft_tokens.device) < num_draft.to(draft_tokens.device).reshape(batch, 1)
    if n and bool((live & ((draft_tokens < 0) | (draft_tokens >= vocab))).any()):
        raise ValueError(f"draft_tokens (within num_draft) must be in [0, {vocab})")


def verify_tree(
    draft_tokens: torch.Tensor,
    parents: torch.Tensor | None,
    num_draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    greedy: torch.Tensor,
    generators: Generators = None,
) -> TreeVerifyResult:
    """Accept a root path of each row's draft tree and emit one recovered or bonus token.

    draft_tokens: [batch, n] int64; node i of row b is valid for i < num_draft[b] (rest padding).
    parents:      [batch, n] int64 parent node (-1 = root), topological order, siblings distinct
                  tokens; None = chain (delegates to `verify`).
    num_draft:    [batch] int64 in [0, n], nodes per row.
    draft_probs:  [batch, n, vocab] distribution node i was drawn from (its parent's draft
                  distribution, shared by siblings, drawn without replacement), or None (point masses).
    target_probs: [batch, n+1, vocab]; index 0 = target distribution after the root (the row's
                  last committed token), index i+1 = after the root + node i's path.
    greedy:       [batch] bool; greedy rows follow the target's argmax.
    generators:   None | torch.Generator | list of len batch (see module docstring).
    """
    if parents is None:
        chain = verify(draft_tokens, num_draft, draft_probs, target_probs, greedy, generators)
        depth = torch.arange(draft_tokens.shape[1], device=chain.tokens.device)             # [n]
        accepted_nodes = torch.where(depth < chain.num_accepted.unsqueeze(1), depth, -1)    # [batch, n]
        return TreeVerifyResult(chain.tokens, chain.num_accepted, chain.num_emitted, accepted_nodes)
    _check_inputs(draft_tokens, parents, num_draft, draft_probs, target_probs, greedy)
    batch, n = draft_tokens.shape
    vocab = target_probs.shape[-1]
    device = target_probs.device
    num_draft = num_draft.to(device=device, dtype=torch.long).reshape(batch)          # [batch]
    greedy = greedy.to(device=device, dtype=torch.bool).reshape(batch)                  # [batch]
    draft_tokens = draft_tokens.to(device=device, dtype=torch.long)                     # [batch, n]
    node_index = torch.arange(n, device=device)                                         # [n]
    live = node_index.unsqueeze(0) < num_draft.unsqueeze(1)                             # [batch, n]
    # Padding nodes get parent -2: never a child of anything.
    parents = torch.where(live, parents.to(device=device, dtype=torch.long), -2)       # [batch, n]
    draft_index = draft_tokens.clamp(0, vocab - 1)                                      # [batch, n] padding-safe
    rows = torch.arange(batch, device=device)                                           # [batch]
    sampled = ~greedy                                                                   # [batch]
    sampled_rows = sampled.nonzero().squeeze(1)                                         # [n_sampled]
    greedy_rows = greedy.nonzero().squeeze(1)                                           # [n_greedy]
    per_row = generators is not None and not isinstance(generators, torch.Generator)

    accept_uniforms = torch.zeros(batch, n, dtype=torch.float64, device=device)        # [batch, n] one per node
    if n and sampled_rows.numel():
        counts = torch.where(sampled, num_draft, 0).tolist() if per_row else n
        drawn = uniforms(batch, counts, generators, device)                             # [batch, <=n]
        accept_uniforms[:, :drawn.shape[1]] = drawn

    # Walk state per row: current node (-1 = root), last child of it tried (-1 = none yet).
    node = torch.full((batch,), -1, dtype=torch.long, device=device)                   # [batch]
    last_tried = torch.full((batch,), -1, dtype=torch.long, device=device)             # [batch]
    walking = torch.ones(batch, dtype=torch.bool, device=device)                        # [batch]
    num_accepted = torch.zeros(batch, dtype=torch.long, device=device)                 # [batch]
    accepted_nodes = torch.full((batch, n), -1, dtype=torch.long, device=device)       # [batch, n]
    residual_probs = target_probs[:, 0].clone()                                         # [batch, vocab] current node's
    # target minus the rejected children (sampled rows); draft distribution of its untried children:
    sibling_probs = None if draft_probs is None else draft_probs.new_zeros(batch, vocab)  # [batch, vocab]
    greedy_tokens = torch.full((batch,), PAD_TOKEN, dtype=torch.long, device=device)   # [batch] argmax at node
    if greedy_rows.numel():
        greedy_tokens[greedy_rows] = target_probs[greedy_rows, 0].argmax(dim=-1)

    while True:  # each pass tries one new node per walking row: at most n + 1 passes
        untried = (parents == node.unsqueeze(1)) & (node_index.unsqueeze(0) > last_tried.unsqueeze(1))  # [batch, n]
        walking &= untried.any(dim=1)
        trying = walking.nonzero().squeeze(1)                                           # [m] rows
        if not trying.numel():
            break
        child = untried[trying].to(torch.uint8).argmax(dim=1)                           # [m] first untried child
        child_token = draft_index[trying, child]                                        # [m]
        accept = child_token == greedy_tokens[trying]                                   # [m] (greedy rows)
        is_sampled = sampled[trying]                                                    # [m]
        if bool(is_sampled.any()):
            s_rows, s_child, s_token = trying[is_sampled], child[is_sampled], child_token[is_sampled]  # [s]
            if sibling_probs is None:
                draft_at_child = torch.ones(s_rows.numel(), dtype=torch.float64, device=device)  # [s] point mass
            else:
                first = last_tried[s_rows] < 0                                          # [s] first child of node
                sibling_probs[s_rows[first]] = draft_probs[s_rows[first], s_child[first]]
                draft_at_child = sibling_probs[s_rows, s_token].double()                # [s]
            target_at_child = residual_probs[s_rows, s_token].double()                  # [s]
            # u < p/q  <=>  u * q < p  (no division, as in verify)
            accept[is_sampled] = accept_uniforms[s_rows, s_child] * draft_at_child < target_at_child
            rejected = ~accept[is_sampled]                                              # [s]
            r_rows, r_token = s_rows[rejected], s_token[rejected]                       # [r]
            if r_rows.numel():
                if sibling_probs is None:
                    rejected_probs = torch.zeros(r_rows.numel(), vocab, dtype=residual_probs.dtype, device=device)
                    rejected_probs.scatter_(1, r_token.unsqueeze(1), 1.0)               # [r, vocab] point mass
                else:
                    rejected_probs = sibling_probs[r_rows].to(residual_probs.dtype)     # [r, vocab]
                    sibling_probs[r_rows] = _remove_tried(sibling_probs[r_rows], r_token)
                residual_probs[r_rows] = _residual_probs(residual_probs[r_rows], rejected_probs)
        last_tried[trying] = child
        a_rows, a_child = trying[accept], child[accept]                                 # [a]
        if a_rows.numel():
            accepted_nodes[a_rows, num_accepted[a_rows]] = a_child
            num_accepted[a_rows] += 1
            node[a_rows] = a_child
            last_tried[a_rows] = -1
            residual_probs[a_rows] = target_probs[a_rows, a_child + 1]
            a_greedy = greedy[a_rows]                                                   # [a]
            if bool(a_greedy.any()):
                greedy_tokens[a_rows[a_greedy]] = residual_probs[a_rows[a_greedy]].argmax(dim=-1)

    next_tokens = greedy_tokens                                                         # [batch]
    if sampled_rows.numel() == batch:
        next_tokens = sample(residual_probs, generators)
    elif sampled_rows.numel():
        row_generators = [generators[b] for b in sampled_rows.tolist()] if per_row else generators
        next_tokens[sampled_rows] = sample(residual_probs[sampled_rows], row_generators)

    tokens = torch.full((batch, n + 1), PAD_TOKEN, dtype=torch.long, device=device)    # [batch, n+1]
    if n:
        path_tokens = draft_tokens.gather(1, accepted_nodes.clamp(min=0))               # [batch, n]
        tokens[:, :n] = torch.where(accepted_nodes >= 0, path_tokens, PAD_TOKEN)
    tokens[rows, num_accepted] = next_tokens
    return TreeVerifyResult(tokens=tokens, num_accepted=num_accepted, num_emitted=num_accepted + 1,
                            accepted_nodes=accepted_nodes)


def walk_lists(drafts: list[list[int]],            # [batch][n] draft tokens (padded)
               links: list[list[int]] | None,      # [batch][n] parent nodes, or None = chains
               counts: list[int],                  # [batch] valid nodes per row
               target_token,                       # (row, node, depth) -> the target's token after that node (-1: root)
               ) -> tuple[list[list[int]], list[list[int]]]:
    """From the root, the first child carrying the target's token is accepted, until none does;
    then that token is emitted (recovered, or bonus at a leaf). Returns per row the accepted path
    (node indices by depth) and the emitted tokens (the path's tokens, then the target's)."""
    paths, emitted = [], []
    for b, (count, row) in enumerate(zip(counts, drafts)):
        node, path = -1, []
        while True:
            token = target_token(b, node, len(path))
            if links is None:                   # a chain: the next node, when it carries the token
                child = node + 1 if node + 1 < count and row[node + 1] == token else -1
            else:
                child = next((i for i in range(node + 1, count) if links[b][i] == node and row[i] == token), -1)
            if child < 0:
                break
            path.append(child)
            node = child
        paths.append(path)
        emitted.append([row[i] for i in path] + [token])
    return paths, emitted


def _walk(draft_tokens: torch.Tensor,   # [batch, n] int64
          parents: torch.Tensor | None,  # [batch, n] int64, or None = chain
          num_draft: torch.Tensor,       # [batch] int64
          target_token,                  # (row, node, depth) -> the target's token after that node (-1: root)
          ) -> TreeVerifyResult:
    """walk_lists, as a TreeVerifyResult's tensors."""
    batch, n = draft_tokens.shape
    paths, emitted = walk_lists(draft_tokens.tolist(), parents.tolist() if parents is not None else None,
                                num_draft.reshape(batch).tolist(), target_token)
    tokens = [e + [PAD_TOKEN] * (n + 1 - len(e)) for e in emitted]
    accepted = [p + [-1] * (n - len(p)) for p in paths]
    num = torch.tensor([len(p) for p in paths], dtype=torch.long)
    return TreeVerifyResult(tokens=torch.tensor(tokens, dtype=torch.long).reshape(batch, n + 1), num_accepted=num,
                            num_emitted=num + 1,
                            accepted_nodes=torch.tensor(accepted, dtype=torch.long).reshape(batch, n))


def verify_greedy_lists(drafts: list[list[int]],           # [batch][n] draft tokens, row b valid in [:num_draft[b]]
                        links: list[list[int]] | None,     # [batch][n] parent node (-1 = root), or None = chains
                        num_draft: list[int],              # [batch]
                        target_tokens: list[list[int]],    # [batch][n+1] target argmax after the root / node i's path
                        ) -> tuple[list[list[int]], list[list[int]]]:
    """`verify_tree` for a batch of greedy rows, from the target's argmax alone (what a greedy row
    reads of its one-hot distributions), on lists as the engine reads it: from the root, the first
    child whose token is the target's argmax is accepted, until none is; then that argmax is
    emitted (recovered or bonus). Per row the accepted path (node indices by depth) and the emitted
    tokens. Building and reading back result tensors would be a visible share of a small model's
    step (specdecode/engine/README.md, "Rules the code keeps")."""
    return walk_lists(drafts, links, num_draft, lambda b, node, depth: target_tokens[b][node + 1])


def verify_point_mass(
    draft_tokens: torch.Tensor,          # [batch, n] int64, node i of row b valid for i < num_draft[b]
    parents: torch.Tensor | None,        # [batch, n] int64 parent node (-1 = root), or None = chain
    num_draft: torch.Tensor,             # [batch] int64 in [0, n]
    target_probs: torch.Tensor,          # [batch, n+1, vocab] after the root / node i's path
    greedy: torch.Tensor,                # [batch] bool
    depth_uniforms: torch.Tensor,        # [batch, n+1] float64: uniform of the token at depth d of row b's path
) -> TreeVerifyResult:
    """Point-mass drafts, any mix of greedy and sampled rows (module docstring): walking from the
    root, the target's token at the current node (argmax, or the inverse CDF at the depth's uniform)
    is accepted as the child carrying it, until no child does; then it is emitted. Only the
    distributions along the path are read."""
    batch, n = draft_tokens.shape
    if tuple(target_probs.shape[:2]) != (batch, n + 1) or tuple(depth_uniforms.shape) != (batch, n + 1):
        raise ValueError(f"target_probs must be [batch, n+1, vocab] and depth_uniforms [batch, n+1] = "
                         f"[{batch}, {n + 1}], got {tuple(target_probs.shape)} / {tuple(depth_uniforms.shape)}")
    is_greedy = greedy.reshape(batch).tolist()
    u = depth_uniforms.to(device=target_probs.device, dtype=torch.float64)

    def target_token(b: int, node: int, depth: int) -> int:
        probs = target_probs[b, node + 1]                                          # [vocab]
        if is_greedy[b]:
            return int(probs.max(dim=-1).indices)
        return int(sample_at(probs.unsqueeze(0), u[b, depth].reshape(1, 1))[0])
    return _walk(draft_tokens, parents, num_draft, target_token)


def verify_drafts(
    draft_tokens: torch.Tensor,          # [batch, n] int64, node i of row b valid for i < num_draft[b]
    parents: torch.Tensor | None,        # [batch, n] int64 parent node (-1 = root), or None = chains
    num_draft: torch.Tensor,             # [batch] int64 in [0, n]
    draft_probs: torch.Tensor | None,    # [batch, n, vocab] the drafts' distributions, or None = point masses
    target_probs: torch.Tensor | None,   # [batch, n+1, vocab] after the root / node i's path; None: every row greedy
    target_tokens: torch.Tensor | None,  # [batch, n+1] int64 the target's argmax there (read when target_probs is None)
    greedy: list[bool],                  # [batch]
    generators: list[torch.Generator],   # [batch] each sampled row's own (draft distributions' draws)
    seeds: list[int],                    # [batch] each row's seed (its position uniforms, sampling.position_uniforms)
    positions: list[int],                # [batch] the sequence position of each row's first emitted token
) -> tuple[list[list[int]], list[list[int]]]:
    """The verifier of a step, chosen by its input (the engine's one entry point; accepted,
    recovered and bonus tokens as `specdecode.verify` defines them). Per row the accepted path
    (node indices by depth) and the emitted tokens (the accepted drafts, then the recovered or
    bonus token):

    * every row greedy (`target_probs` None): the argmax walk on lists (`verify_greedy_lists`);
    * point masses (`draft_probs` None: lookups, predictions): `verify_point_mass`, each sampled
      row's token at depth d drawn at the uniform of its position (positions[b] + d), so the text is
      the one plain decoding samples with that seed;
    * draft distributions: `verify_tree` (chains and trees) with each row's generator; a sampled
      row that drafted nothing takes its token as a plain step does, at its position's uniform, and
      leaves its generator alone (as if it ran alone: its text does not depend on the rows beside it).
    """
    if target_probs is None:             # the target's argmax is all a greedy row reads
        links = parents.tolist() if parents is not None else None
        return verify_greedy_lists(draft_tokens.tolist(), links, num_draft.tolist(), target_tokens.tolist())
    device = target_probs.device          # drafts may come from the host (lookups)
    batch, width = draft_tokens.shape[0], draft_tokens.shape[1] + 1
    greedy_t = torch.tensor(greedy, device=device)
    if draft_probs is None:
        u = torch.tensor([[0.0] * width if g else position_uniforms(seed, at, width)
                          for g, seed, at in zip(greedy, seeds, positions)], dtype=torch.float64).reshape(batch, width)
        result = verify_point_mass(draft_tokens.cpu(), parents, num_draft.cpu(), target_probs, greedy_t, u)
    else:
        counts = num_draft.tolist()
        idle = [b for b in range(batch) if counts[b] == 0 and not greedy[b]]
        own = [torch.Generator(device=device) if b in idle else generators[b] for b in range(batch)]
        result = verify_tree(draft_tokens.to(device), parents, num_draft.to(device), draft_probs, target_probs,
                             greedy_t, own)
        if idle:
            index = torch.tensor(idle, device=device)
            u = torch.tensor([position_uniforms(seeds[b], positions[b], 1) for b in idle],
                             dtype=torch.float64, device=device)                           # [idle, 1]
            result.tokens[index, 0] = sample_at(target_probs[index, 0], u).to(result.tokens.device)
    paths = [result.accepted_nodes[b, :n].tolist() for b, n in enumerate(result.num_accepted.tolist())]
    return paths, result.tokens.tolist()
