"""Pinned prefixes: a manual's cached blocks held out of eviction by a counted hold.

A pin is a ``prefix_store.Hold`` on the cached full blocks of a prefix, kept under the caller's
key in this table, never in the engine's request table: no request id can touch a pin's blocks.
Pinned blocks together stay within a budget, a share of the pool.
"""

from __future__ import annotations

from inference.errors import DocqaError
from prefix_store import Hold, KVCacheManager


class PinBudgetError(DocqaError):
    code = "pin_budget_exceeded"

    def __init__(self, message: str, limit: int):
        super().__init__(message)
        self.limit = limit


class PinTable:
    """Pins by key. Mutates the KV manager's holds only."""

    def __init__(self, kv: KVCacheManager, budget_share: float):
        self.kv = kv
        self.budget_share = budget_share
        self.budget_blocks = int(kv.pool.num_blocks * budget_share)
        self._pins: dict[str, Hold] = {}

    @property
    def num_pinned_blocks(self) -> int:
        return sum(len(h.blocks) for h in self._pins.values())

    def pin(self, key: str, token_ids: list[int], namespace: bytes = b"") -> int:
        """Keep the cached full blocks of ``token_ids`` out of eviction until ``unpin(key)``.

        Returns the tokens pinned (the cached prefix, in full blocks). Raises PinBudgetError
        when the budget would be exceeded. Pinning again under the same key re-pins."""
        self.unpin(key)
        cached = self.kv.find_cached_prefix(list(token_ids) + [0], namespace)
        n = len(cached.blocks)
        if n == 0:
            return 0
        pinned = self.num_pinned_blocks
        if pinned + n > self.budget_blocks:
            raise PinBudgetError(
                f"pinning {n:,} blocks would exceed the pin budget of {self.budget_blocks:,} "
                f"blocks ({self.budget_share:.0%} of the pool; {pinned:,} pinned)",
                self.budget_blocks,
            )
        self._pins[key] = self.kv.hold(cached.blocks)
        return cached.num_cached_tokens

    def unpin(self, key: str) -> bool:
        """Release the pin under ``key``; False when there is none."""
        held = self._pins.pop(key, None)
        if held is None:
            return False
        self.kv.release(held)
        return True

    def unpin_prefix(self, prefix: str) -> int:
        """Release every pin whose key starts with ``prefix`` (a manual's parts); how many."""
        keys = [k for k in self._pins if k.startswith(prefix)]
        for k in keys:
            self.unpin(k)
        return len(keys)
