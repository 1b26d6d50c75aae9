"""The usage counters ``loops usage`` reads (``UsageLedger``): per run, standalone sampler
and checkpoint deployment, in total and by the minute (``--since/--until``). Routes call this,
never the store."""

from __future__ import annotations

from baseten_loops_cli.local import store as st
from baseten_loops_cli.local.store import UsageRow

__all__ = ["UsageLedger", "UsageRow"]


class UsageLedger:
    def __init__(self, store: st.Store) -> None:
        self.store = store

    def report(self, owner_id: str | None = None) -> list[dict]:
        """``GET /v1/local/usage``: every owner's counters (or one owner's); a run's row also
        says who else sampled its checkpoints (``checkpoints_sampled_by``)."""
        return self.store.usage_report(owner_id)

    def periods(self, since: float, until: float, period_s: int) -> list[dict]:
        """``GET /v1/local/usage?since=&until=&period_s=``: the counters of each period in the
        window (kept to the minute), per owner and the run they count for."""
        return self.store.usage_periods(since, until, period_s)
