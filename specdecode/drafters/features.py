"""Target features a drafter has been given but not yet read (`PendingFeatures`)."""
from __future__ import annotations

import torch


class PendingFeatures:
    """Target features not yet copied into a drafter's [rows, max_len, D] `features` (EAGLE, Medusa):
    `observe` follows every target pass, where a copy per row and step is a torch call, dear right after
    a pass (specdecode/engine/README.md, "Rules the code keeps"). Per row, a run of consecutive
    positions is kept as the pass outputs themselves and written by one copy when the drafter reads
    (`flush`), or when a pass writes elsewhere in the row (earlier positions again: later writes win, as
    they would have). A run keeps only its last `keep` positions: a drafter reads no feature further
    back than that (an EAGLE head's catch-up window, Medusa's newest feature and its tree)."""

    def __init__(self, features: torch.Tensor, keep: int) -> None:    # features: [rows, max_len, D]
        self.features, self.keep = features, keep
        self.runs: dict[int, list] = {}        # row -> [first position, pieces [T_i, D], end position]

    def add(self, row: int, start: int, hidden: torch.Tensor) -> None:    # hidden: [T, D]
        run = self.runs.get(row)
        if run is not None and start == run[2]:
            run[1].append(hidden)
            run[2] += hidden.shape[0]
            if len(run[1]) > 2 * self.keep:    # a long run of plain steps: the last `keep` positions
                joined = torch.cat(run[1])[-self.keep:]
                run[0], run[1] = run[2] - joined.shape[0], [joined]
            return
        self.flush(row)
        self.runs[row] = [start, [hidden], start + hidden.shape[0]]

    def flush(self, row: int | None = None) -> None:
        """Write the pending runs (of `row`, or of every row) into `features`."""
        for r in list(self.runs) if row is None else [row]:
            run = self.runs.pop(r, None)
            if run is not None:
                first, pieces, end = run
                self.features[r, first:end] = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
