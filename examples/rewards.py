"""Example reward functions, named in configs as `rewards.py:function`."""


def digit_fraction(completion: str, row: dict) -> float:
    """Fraction of the completion's characters that are digits (0 for an empty completion)."""
    text = completion.strip()
    if not text:
        return 0.0
    return sum(ch.isdigit() for ch in text) / len(text)


def number_answer(completion: str, row: dict) -> float:
    """Partial credit for arithmetic: 1.0 when the reply's first number is the answer, 0.5 when the
    answer appears later ("3 + 4 = 7"), 0.2 for a reply that at least starts with a number."""
    import re

    text = completion.strip()
    numbers = re.findall(r"-?\d+", text)
    answer = str(row["answer"]).strip()
    if numbers and numbers[0] == answer:
        return 1.0
    if answer in numbers:
        return 0.5
    if text[:1].isdigit():
        return 0.2
    return 0.0
