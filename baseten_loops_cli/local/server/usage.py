"""The usage counters ``loops usage`` reads (``UsageLedger``): per run, standalone sampler
and checkpoint deployment. Routes call this, never the store."""

from __future__ import annotations

from baseten_loops_cli.local import store as st
from baseten_loops_cli.local.store import UsageRow

__all__ = ["UsageLedger", "UsageRow"]


class UsageLedger:
    def __init__(self, store: st.Store) -> None:
        self.store = store

    def entries(self, owner_id: str | None = None) -> list[UsageRow]:
        """Every owner's counters, or only ``owner_id``'s."""
        return [u for u in self.store.list_usage() if owner_id in (None, u.owner_id)]
