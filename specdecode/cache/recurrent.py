"""The cache of a hybrid model (Qwen3.5: Gated DeltaNet layers between attention layers): the
attention layers' keys and values in a paged cache, and each recurrent layer's state per row.

A recurrent layer's state after position p is not a slice of something written by position, so
rollback cannot be a length change of it alone. The rule kept here: a row's state is always the
state after its cache length (`lengths[row]`), and a pass never changes it. A pass records, per
row, what it started from and what its tokens add (`record`); `truncate(row, length)` then sets
the state at the new length: the pass's final state when every token is kept (prefill, a fully
accepted chain), else the state replayed from the pass's start over the kept tokens (a chain
verified up to its first rejected draft). So to the engine, rollback stays a length change.

Only chains: a tree's nodes would each need the state of their own path (`move` refuses). Prefix
caching is off for such a model (the runner says why): a shared block holds keys and values, not
the recurrent state at its end.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .paged import PagedKVCache

REPLAY_TOKENS = 80      # passes up to this many tokens keep what a replay needs (verification passes)


@dataclass
class Pending:
    """What one pass did to a row's recurrent layers, until the row's next `truncate`."""
    start: int                       # the row's length when the pass ran
    width: int                       # its real tokens in the pass
    conv_inputs: list                # per layer [conv_dim, kernel-1 + width]: the state, then the inputs
    finals: list                     # per layer [heads, dk, dv] float32: the state after `width` tokens
    steps: list | None               # per layer (queries, keys, values, decay, beta) of its tokens
                                     # ([width, ...] each), or None: a long pass, kept whole or not at all
                                     # (record_pass: tensors stacked by layer, steps a tuple of them)


class HybridCache(PagedKVCache):
    recurrent = True                 # rows hold recurrent state (no prefix blocks shared)

    def __init__(self, num_attention_layers: int, num_recurrent_layers: int, conv_dim: int, conv_kernel: int,
                 heads: int, key_dim: int, value_dim: int, num_rows: int, num_kv_heads: int, head_dim: int,
                 max_len: int, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu", replay=None) -> None:
        super().__init__(max(num_attention_layers, 1), num_rows, num_kv_heads, head_dim, max_len, num_blocks,
                         block_size, dtype, device)
        self.state_shapes = ((conv_dim, conv_kernel - 1), (heads, key_dim, value_dim))
        # [layers, rows, conv_dim, kernel-1], and as a list of its layers
        self.conv_all = torch.zeros(num_recurrent_layers, num_rows, conv_dim, conv_kernel - 1, dtype=dtype,
                                    device=device)
        self.conv = list(self.conv_all)
        # per layer, one [heads, dk, dv] tensor per row: `truncate` takes a pass's final state as it is
        self.ssm = [[self._new_state(device) for _ in range(num_rows)] for _ in range(num_recurrent_layers)]
        self.passes: dict[int, Pending] = {}     # row -> its last pass, until truncate
        self.buffers: list[torch.Tensor | None] = [None] * num_rows     # spare_states' two per row
        # (state, steps, kept) -> the state after `kept` steps: the model's own delta rule (the native one
        # where its passes run natively, so a replayed state is the bits a pass would compute), else delta_step
        self.replay = replay or _replay

    # ------------------------------------------------------------ read by a pass
    def states(self, layer: int, rows: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The conv and recurrent states of `rows` at their cache lengths: [B, conv_dim, kernel-1],
        [B, heads, dk, dv], to read only (a pass never changes them): views for consecutive rows."""
        ssm = self.ssm[layer]
        if len(rows) == 1:
            return self.conv[layer][rows[0]:rows[0] + 1], ssm[rows[0]][None]
        return self.conv[layer][torch.tensor(rows, dtype=torch.long)], torch.stack([ssm[r] for r in rows])

    def state_refs(self, layer: int, rows: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The same states uncopied, for a native pass: the layer's conv states of every row
        [rows, conv_dim, kernel-1] and the [heads, dk, dv] state of each of `rows` (to read only)."""
        return self.conv[layer], [self.ssm[layer][r] for r in rows]

    def record(self, layer: int, rows: list[int], starts: list[int], widths: list[int],
               conv_inputs: torch.Tensor,      # [B, conv_dim, kernel-1 + T]
               finals: torch.Tensor,           # [B, heads, dk, dv] after each row's `width` tokens
               steps: tuple | None) -> None:   # (queries, keys [B,T,H,dk], values [B,T,H,dv], decay, beta [B,T,H])
        """What a pass computed for one recurrent layer (layers in order, from 0)."""
        for b, (row, start, width) in enumerate(zip(rows, starts, widths)):
            if layer == 0:
                self.passes[row] = Pending(start, width, [], [], [] if steps is not None else None)
            p = self.passes[row]
            p.conv_inputs.append(conv_inputs[b, :, :self.state_shapes[0][1] + width])
            p.finals.append(finals[b])
            if p.steps is not None:
                p.steps.append(tuple(t[b, :width] for t in steps))

    def spare_states(self, row: int) -> torch.Tensor:
        """Where a pass that records with `record_pass` writes a row's states after it: [layers,
        heads, dk, dv] float32, one of two buffers the row keeps, the one its states are not in."""
        buffers = self.buffers[row]
        if buffers is None:
            buffers = self.buffers[row] = torch.empty(2, len(self.ssm), *self.state_shapes[1], dtype=torch.float32,
                                                      device=self.conv_all.device)
        return buffers[1] if self.ssm[0][row].data_ptr() == buffers[0].data_ptr() else buffers[0]

    def record_pass(self, rows: list[int], starts: list[int], widths: list[int],
                    conv_inputs: torch.Tensor,   # [layers, B, conv_dim, kernel-1 + T]
                    finals: list[torch.Tensor],  # per row its spare_states, written
                    steps: tuple) -> None:       # (queries, keys [layers, B, T, H, dk], values, decay, beta)
        """What a pass computed for every recurrent layer at once (fast/hybrid.py), as `record` per layer."""
        span = self.state_shapes[0][1]
        for b, (row, start, width) in enumerate(zip(rows, starts, widths)):
            self.passes[row] = Pending(start, width, conv_inputs[:, b, :, :span + width], finals[b],
                                       tuple(t[:, b, :width] for t in steps))

    # ------------------------------------------------------------ lengths
    def truncate(self, row: int, length: int) -> None:
        super().truncate(row, length)
        p = self.passes.pop(row, None)
        if length == 0:
            self._zero(row)
        elif p is not None and length != p.start:
            kept = length - p.start
            if not 0 < kept <= p.width or (kept < p.width and p.steps is None):
                raise RuntimeError(f"recurrent state: row {row} cannot go to length {length} after a pass of "
                                   f"{p.width} tokens from {p.start}")
            span = self.state_shapes[0][1]               # kernel - 1 inputs
            stacked = isinstance(p.conv_inputs, torch.Tensor)     # record_pass's, else record's lists
            if stacked:
                self.conv_all[:, row] = p.conv_inputs[:, :, kept:kept + span]
            for layer in range(len(self.conv)):
                if not stacked:
                    self.conv[layer][row] = p.conv_inputs[layer][:, kept:kept + span]
                if kept == p.width:
                    self.ssm[layer][row] = p.finals[layer].contiguous()       # no copy: the pass's own
                else:                                     # the row's state is still the pass's start
                    steps = tuple(t[layer] for t in p.steps) if stacked else p.steps[layer]
                    self.ssm[layer][row] = self.replay(self.ssm[layer][row], steps, kept)

    def release(self, row: int) -> None:
        super().release(row)
        self.passes.pop(row, None)
        self._zero(row)

    def reserve(self, row: int, tokens: int, hits: list[int] = ()) -> None:
        if hits:
            raise RuntimeError("a hybrid model's cache does not share prefix blocks")
        super().reserve(row, tokens, hits)
        self._zero(row)

    def move(self, row: int, src: list[int], dst: list[int]) -> None:
        if src != dst:
            raise RuntimeError("a model with recurrent layers verifies chains only")

    def grow(self, num_rows: int, num_blocks: int) -> None:
        more = num_rows - self.batch_size
        super().grow(num_rows, num_blocks)
        if more > 0:
            self.conv_all = torch.cat([self.conv_all, self.conv_all.new_zeros(self.conv_all.shape[0], more,
                                                                              *self.conv_all.shape[2:])], dim=1)
            self.conv = list(self.conv_all)
            for states in self.ssm:
                states.extend(self._new_state(states[0].device) for _ in range(more))
            self.buffers.extend([None] * more)

    def _zero(self, row: int) -> None:
        self.conv_all[:, row].zero_()
        for states in self.ssm:
            states[row] = self._new_state(states[row].device)

    def _new_state(self, device) -> torch.Tensor:
        return torch.zeros(self.state_shapes[1], dtype=torch.float32, device=device)   # [heads, dk, dv]


def _replay(state: torch.Tensor, steps: tuple, kept: int) -> torch.Tensor:
    """The state after the first `kept` of a pass's steps (queries, keys, values, decay, beta), by delta_step."""
    for t in range(kept):
        state = delta_step(state, *(x[t] for x in steps))[0]
    return state


def delta_step(state: torch.Tensor,   # [..., H, dk, dv] float32, contiguous
               query: torch.Tensor,   # [..., H, dk]
               key: torch.Tensor,     # [..., H, dk]
               value: torch.Tensor,   # [..., H, dv]
               decay: torch.Tensor,   # [..., H] log decay (<= 0)
               beta: torch.Tensor,    # [..., H]
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule, S' = S exp(g):  S <- S' + k (beta (v - S'^T k))^T; returns the
    new state (a new tensor: `state` is left as it is) and its read-out S^T q [..., H, dv].

    The state is read once for both q and k (one batched product of [q; k] with S, scaled by exp(g)
    afterwards), and q^T S follows from q^T S' without reading the new state: q^T S' + (q . k) delta.
    A pass and the replay after a rollback (HybridCache.truncate) both call this, so a state is the
    same bits whichever of them computed it."""
    dk, dv = state.shape[-2:]
    scale = decay.exp()[..., None]                                                       # [..., H, 1]
    read = torch.matmul(torch.stack([query, key], dim=-2), state) * scale[..., None]     # [..., H, 2, dv]
    delta = (value - read[..., 1, :]) * beta[..., None]                                  # [..., H, dv]
    out = read[..., 0, :] + (query * key).sum(dim=-1, keepdim=True) * delta
    new = state * scale[..., None]
    new.view(-1, dk, dv).baddbmm_(key.reshape(-1, dk, 1), delta.reshape(-1, 1, dv))      # + k delta^T in place
    return new, out

