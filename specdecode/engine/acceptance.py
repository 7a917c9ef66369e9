"""Expected tokens per speculative step (torch-free: shared by the engine's draft budget and the
server's speculation policy)."""
from __future__ import annotations


def expected_tokens(acceptance: float, size: int) -> float:
    """Tokens a chain step of `size` drafts emits when each is accepted with probability `acceptance`
    (1 + a + ... + a^size, the bonus token included)."""
    return sum(acceptance ** i for i in range(size + 1))
