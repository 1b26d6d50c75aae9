"""A multi-turn game: guess the row's secret digit from "higher"/"lower" feedback.

    env: envs/guess.py:GuessNumber      (examples/tiny-guess.yaml)

Each reply earns 0.2 x the share of its characters that are digits (a format reward the tiny
model can learn in seconds), a correct guess earns 1 and ends the episode; otherwise the
environment answers "higher" or "lower" and the model guesses again, up to max_turns.
"""

from baseten_loops_cli import Step


class GuessNumber:
    def __init__(self, row: dict, low: int = 0, high: int = 9):
        self.secret = int(row["secret"])
        self.low, self.high = low, high

    def reset(self) -> list[dict]:
        return [{"role": "user", "content": f"Guess my number from {self.low} to {self.high}. Reply with digits."}]

    def step(self, reply: str) -> Step:
        text = reply.strip()
        digits = [ch for ch in text if ch.isdigit()]
        shaped = 0.2 * (len(digits) / len(text) if text else 0.0)
        if not digits:
            return Step(reward=shaped, messages=[{"role": "user", "content": "Reply with a digit."}])
        guess = int(digits[0])
        if guess == self.secret:
            return Step(reward=1.0 + shaped, done=True, info={"guess": guess})
        hint = "higher" if guess < self.secret else "lower"
        return Step(reward=shaped, messages=[{"role": "user", "content": hint}], info={"guess": guess})
