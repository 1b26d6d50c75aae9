"""Generate the example preference data of tiny-dpo.yaml, smol-dpo.yaml (pairs) and tiny-kto.yaml
(unpaired: one completion per row, labelled true or false). Deterministic.

    python examples/make_dpo_data.py
"""

from __future__ import annotations

import random

from make_data import arithmetic_pairs, write


def main() -> None:
    # Tiny: answers in the "ANSWER: <sum>" format are preferred to the same sum said any other way.
    rng = random.Random(10)
    styles = ["{s}", "answer: {s}", "The answer is {s}.", "ANSWER {s}", "{a}+{b}={s}", "sum is {s}"]
    rows = []
    for a, b in arithmetic_pairs(rng, 10):
        s = a + b
        rows.append({
            "prompt": f"What is {a}+{b}?",
            "chosen": f"ANSWER: {s}",
            "rejected": rng.choice(styles).format(a=a, b=b, s=s),
        })  # fmt: skip
    write("tiny_dpo_train.jsonl", rows[:48])
    write("tiny_dpo_eval.jsonl", rows[48:64])
    # SmolLM2: two-digit additions; the right sum in the asked-for format beats a wrong sum in that
    # format (half the pairs) or the right sum said another way (the other half). Chat rows, the
    # {"messages", "chosen", "rejected"} shape.
    rng = random.Random(11)
    rows = []
    for i in range(200):
        a, b = rng.randint(10, 49), rng.randint(10, 49)
        s = a + b
        if i % 2:
            rejected = f"ANSWER: {s + rng.choice([-11, -10, -2, -1, 1, 2, 10, 11])}"
        else:
            rejected = rng.choice([f"{a} + {b} = {s}", f"The answer is {s}.", f"{s}", f"Sure! {a} plus {b} is {s}."])
        rows.append({
            "messages": [{"role": "user", "content": f"What is {a} + {b}? Reply as ANSWER: <number>."}],
            "chosen": f"ANSWER: {s}",
            "rejected": rejected,
        })  # fmt: skip
    write("smol_dpo_train.jsonl", rows[:160])
    write("smol_dpo_eval.jsonl", rows[160:])
    # Tiny KTO: the tiny DPO task as thumbs up/down. Each prompt appears twice, once with the
    # "ANSWER: <sum>" reply (label true) and once with the same sum said another way (false), in
    # shuffled order; the held-out prompts are not in the training file.
    rng = random.Random(12)
    rows = []
    for a, b in arithmetic_pairs(rng, 10)[:40]:
        s = a + b
        prompt = f"What is {a}+{b}?"
        rows.append([{"prompt": prompt, "completion": f"ANSWER: {s}", "label": True},
                     {"prompt": prompt, "completion": rng.choice(styles).format(a=a, b=b, s=s), "label": False}])
    # Shuffled, so a row's KL sequence (its prompt with the previous row's completion) is
    # mismatched, as KTO's estimate wants.
    train, held_out = [row for pair in rows[:32] for row in pair], [row for pair in rows[32:] for row in pair]
    rng.shuffle(train)
    rng.shuffle(held_out)
    write("tiny_kto_train.jsonl", train)
    write("tiny_kto_eval.jsonl", held_out)


if __name__ == "__main__":
    main()
