"""Generate the small example datasets (deterministic; run from anywhere).

    python examples/make_data.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent / "data"


def write(name: str, rows: list[dict]) -> None:
    HERE.mkdir(exist_ok=True)
    with (HERE / name).open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")


def arithmetic_pairs(rng: random.Random, limit: int) -> list[tuple[int, int]]:
    pairs = [(a, b) for a in range(limit) for b in range(limit)]
    rng.shuffle(pairs)
    return pairs


def main() -> None:
    rng = random.Random(0)
    pairs = arithmetic_pairs(rng, 10)
    # SFT (tiny): the tiny model has random weights, so it can only memorise: the addition table
    # of 0..3 ("What is 2+3?" -> "ANSWER: 5"), each pair 5 times in the training file. After
    # examples/tiny-sft.yaml (100 steps) every pair is answered right, greedily and mostly at
    # temperature 1. The eval file is the table itself: it measures the fit, not generalisation.
    table = [
        {"messages": [
            {"role": "user", "content": f"What is {a}+{b}?"},
            {"role": "assistant", "content": f"ANSWER: {a + b}"},
        ]}
        for a, b in arithmetic_pairs(random.Random(3), 4)
    ]  # fmt: skip
    write("tiny_sft_train.jsonl", [row for _ in range(5) for row in table])
    write("tiny_sft_eval.jsonl", table)
    # Distillation (tiny): the SFT'd tiny model (examples/tiny-sft.yaml, RUN:final) teaches the
    # tiny base the same table; four sums are held out of the prompts to measure agreement on.
    held_out = {"What is 3+1?", "What is 0+2?", "What is 2+3?", "What is 1+1?"}
    questions = sorted((row["messages"][0]["content"], row["messages"][1]["content"]) for row in table)
    write("tiny_distill_prompts.jsonl", [{"prompt": q, "answer": a} for q, a in questions if q not in held_out])
    write("tiny_distill_eval.jsonl", [{"prompt": q, "answer": a} for q, a in questions if q in held_out])
    # RL (tiny): reply with digits only; the reward is the fraction of digit characters.
    prompts = [{"prompt": f"Say a number like {a}{b}.", "answer": f"{a}{b}"} for a, b in pairs]
    write("tiny_rl_prompts.jsonl", prompts[:64])
    write("tiny_rl_eval.jsonl", prompts[64:80])
    # SmolLM2: two-digit additions; SFT teaches the format, RL rewards the right number.
    rng2 = random.Random(1)
    big = [(rng2.randint(10, 49), rng2.randint(10, 49)) for _ in range(240)]
    smol_chat = [
        {"messages": [
            {"role": "user", "content": f"What is {a} + {b}? Reply as ANSWER: <number>."},
            {"role": "assistant", "content": f"ANSWER: {a + b}"},
        ]}
        for a, b in big
    ]  # fmt: skip
    write("smol_sft_train.jsonl", smol_chat[:192])
    write("smol_sft_eval.jsonl", smol_chat[192:])
    # Distillation (SmolLM2): smol-sft's final checkpoint teaches the base model the same format;
    # prompts from its training questions, held-out eval prompts from its eval questions.
    def distill_rows(rows: list) -> list:
        return [{"prompt": r["messages"][0]["content"], "answer": r["messages"][1]["content"]} for r in rows]

    write("smol_distill_prompts.jsonl", distill_rows(smol_chat[:64]))
    write("smol_distill_eval.jsonl", distill_rows(smol_chat[192:224]))
    # RL (SmolLM2): one-digit additions; the base model often answers "3 + 4 = 7" or rambles, and
    # the reward (rewards.py:number_answer) pays most for a reply that starts with the sum.
    small = arithmetic_pairs(random.Random(2), 10)
    smol_prompts = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in small]
    write("smol_rl_prompts.jsonl", smol_prompts[:80])
    write("smol_rl_eval.jsonl", smol_prompts[80:96])
    # RL with reasoning (SmolLM2, examples/smol-math-rl.yaml): one-digit additions worked out in
    # up to 256 tokens, graded by the builtin math_answer reward ("The answer is N" is an anchor
    # math-verify reads). The base model gets ~30% right this way and ~6% when asked for a
    # \boxed{} answer, which it seldom writes; two-digit sums scored 0 of 16. The 81 pairs are
    # split: 65 to train on, 16 held out, none in both.
    pairs = [(a, b) for a in range(1, 10) for b in range(1, 10)]
    random.Random(4).shuffle(pairs)
    math_rows = [{"prompt": f"What is {a} + {b}? Think it through step by step, then end with "
                            f"\"The answer is <number>.\"", "answer": str(a + b)} for a, b in pairs]
    write("smol_math_prompts.jsonl", math_rows[:65])
    write("smol_math_eval.jsonl", math_rows[65:])


if __name__ == "__main__":
    main()
