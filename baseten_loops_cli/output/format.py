"""Small formatting helpers for people: local short times, sizes, durations."""

from __future__ import annotations

from datetime import datetime, timezone

from baseten_loops_cli.sizes import human_size

__all__ = ["human_duration", "human_size", "human_time", "parse_time"]


def parse_time(value: str | datetime) -> datetime:
    if isinstance(value, datetime):
        dt = value
    else:
        dt = datetime.fromisoformat(value.replace("Z", "+00:00"))
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt


def human_time(value: str | datetime) -> str:
    """ISO 8601 (any zone) -> local time, short: ``2026-12-03 09:14``."""
    try:
        return parse_time(value).astimezone().strftime("%Y-%m-%d %H:%M")
    except (ValueError, TypeError):
        return str(value)


def human_duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, sec = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m {sec:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h {minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d {hours:02d}h"
