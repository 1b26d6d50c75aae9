"""Example reward functions, named in configs as `rewards.py:function`."""


def digit_fraction(completion: str, row: dict) -> float:
    """Fraction of the completion's characters that are digits (0 for an empty completion)."""
    text = completion.strip()
    if not text:
        return 0.0
    return sum(ch.isdigit() for ch in text) / len(text)
