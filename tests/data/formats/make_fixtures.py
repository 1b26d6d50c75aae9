"""Write the format fixtures (a few rows of each row format and file type) beside this script.

    python tests/data/formats/make_fixtures.py

The output is checked in; tests/test_data_formats.py reads it. Rows are short (the tiny model's
byte tokenizer: one token per byte) and teach "What is A+B?" -> "ANSWER: C", as the examples do.
Needs pyarrow (the [data] extra) for the .parquet and .arrow files.
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
SUMS = [(a, b) for a in range(4) for b in range(3)]  # 12 rows each


def q(a: int, b: int) -> str:
    return f"What is {a}+{b}?"


def ans(a: int, b: int) -> str:
    return f"ANSWER: {a + b}"


def write_jsonl(name: str, rows: list[dict]) -> None:
    (HERE / name).write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def write_json(name: str, doc) -> None:
    (HERE / name).write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")


def write_csv(name: str, rows: list[dict], delimiter: str = ",") -> None:
    with (HERE / name).open("w", newline="", encoding="utf-8") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]), delimiter=delimiter)
        writer.writeheader()
        writer.writerows(rows)


def table(rows: list[dict]):
    import pyarrow as pa

    return pa.Table.from_pylist(rows)


def write_parquet(name: str, rows: list[dict]) -> None:
    import pyarrow.parquet as pq

    pq.write_table(table(rows), HERE / name)


def write_arrow(name: str, rows: list[dict]) -> None:
    """An Arrow IPC stream, as datasets' save_to_disk writes."""
    import pyarrow as pa

    t = table(rows)
    with pa.OSFile(str(HERE / name), "wb") as sink, pa.ipc.new_stream(sink, t.schema) as writer:
        writer.write_table(t)


def main() -> None:
    # ---- SFT formats
    write_jsonl("messages.jsonl", [
        {"messages": [{"role": "system", "content": "Answer as ANSWER: N."}, {"role": "user", "content": q(a, b)},
                      {"role": "assistant", "content": ans(a, b)}]} for a, b in SUMS[:-1]
    ] + [{
        "messages": [
            {"role": "user", "content": "Add 1 and 2."},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{\"a\": 1, \"b\": 2}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "3"},
            {"role": "assistant", "content": "ANSWER: 3"},
        ],
        "tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}],
    }])
    alpaca = [{"instruction": q(a, b), "input": "", "output": ans(a, b)} for a, b in SUMS]
    alpaca[1] = {"instruction": "Add the numbers.", "input": "1 and 1", "output": "ANSWER: 2", "system": "Be terse."}
    alpaca[2] = {"instruction": "And 2+2?", "input": "", "output": "ANSWER: 4", "history": [["What is 1+1?", "ANSWER: 2"]]}
    write_json("alpaca.json", alpaca)
    write_csv("alpaca.tsv", [{"instruction": q(a, b), "input": "", "output": ans(a, b)} for a, b in SUMS], delimiter="\t")
    write_jsonl("sharegpt.jsonl", [
        {"conversations": [{"from": "system", "value": "Answer as ANSWER: N."}, {"from": "human", "value": q(a, b)},
                           {"from": "gpt", "value": ans(a, b)}]} for a, b in SUMS[:-1]
    ] + [{"conversations": [
        {"from": "human", "value": "Add 1 and 2."},
        {"from": "function_call", "value": json.dumps({"name": "add", "arguments": {"a": 1, "b": 2}})},
        {"from": "observation", "value": "3"},
        {"from": "gpt", "value": "ANSWER: 3"},
    ], "tools": json.dumps([{"name": "add"}])}])
    write_json("sharegpt_messages.json", {"data": [
        {"messages": [{"from": "human", "value": q(a, b)}, {"from": "gpt", "value": ans(a, b)}]} for a, b in SUMS
    ]})
    write_csv("prompt_completion.csv", [{"prompt": q(a, b), "completion": " " + ans(a, b)} for a, b in SUMS])
    write_parquet("text.parquet", [{"text": f"{q(a, b)} {ans(a, b)}"} for a, b in SUMS])
    write_arrow("prompt_completion_conversational.arrow", [
        {"prompt": [{"role": "user", "content": q(a, b)}], "completion": [{"role": "assistant", "content": ans(a, b)}]}
        for a, b in SUMS
    ])
    write_parquet("mapped_columns.parquet", [{"question": q(a, b), "response": ans(a, b)} for a, b in SUMS])
    folder = HERE / "folder"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    (folder / "part-0.jsonl").write_text("".join(
        json.dumps({"instruction": q(a, b), "output": ans(a, b)}) + "\n" for a, b in SUMS[:6]), encoding="utf-8")
    (folder / "part-1.json").write_text(json.dumps(
        [{"instruction": q(a, b), "output": ans(a, b)} for a, b in SUMS[6:]]), encoding="utf-8")
    # ---- preference formats (DPO)
    write_jsonl("preference.jsonl", [{"prompt": q(a, b), "chosen": ans(a, b), "rejected": str(a + b)} for a, b in SUMS])
    write_jsonl("preference_implicit.jsonl", [
        {"chosen": f"{q(a, b)} {ans(a, b)}", "rejected": f"{q(a, b)} {a + b + 1}"} for a, b in SUMS
    ])
    write_parquet("preference_conversational.parquet", [
        {"chosen": [{"role": "user", "content": q(a, b)}, {"role": "assistant", "content": ans(a, b)}],
         "rejected": [{"role": "user", "content": q(a, b)}, {"role": "assistant", "content": str(a + b)}]}
        for a, b in SUMS
    ])
    write_json("alpaca_preference.json", [
        {"instruction": q(a, b), "input": "", "chosen": ans(a, b), "rejected": str(a + b)} for a, b in SUMS
    ])
    write_jsonl("sharegpt_preference.jsonl", [
        {"conversations": [{"from": "human", "value": q(a, b)}], "chosen": {"from": "gpt", "value": ans(a, b)},
         "rejected": {"from": "gpt", "value": str(a + b)}} for a, b in SUMS
    ])
    write_jsonl("unpaired_preference.jsonl", [
        {"prompt": q(a, b), "completion": ans(a, b) if i % 2 == 0 else str(a + b), "label": i % 2 == 0}
        for i, (a, b) in enumerate(SUMS)
    ])
    # A spreadsheet export of thumbs up/down: its own column names (data.columns maps them), labels as text.
    write_csv("unpaired_preference_mapped.csv", [
        {"question": q(a, b), "response": ans(a, b) if i % 2 == 0 else str(a + b), "thumbs_up": "true" if i % 2 == 0 else "false"}
        for i, (a, b) in enumerate(SUMS)
    ])
    write_parquet("unpaired_preference_conversational.parquet", [
        {"prompt": [{"role": "user", "content": q(a, b)}],
         "completion": [{"role": "assistant", "content": ans(a, b) if i % 2 == 0 else str(a + b)}], "label": i % 2 == 0}
        for i, (a, b) in enumerate(SUMS)
    ])
    # ---- RL prompts
    write_csv("prompt_only.csv", [{"prompt": f"Say a number like {a}{b}.", "answer": f"{a}{b}"} for a, b in SUMS])
    write_jsonl("prompt_only_conversational.jsonl", [
        {"prompt": [{"role": "user", "content": f"Say a number like {a}{b}."}], "answer": f"{a}{b}"} for a, b in SUMS
    ])


if __name__ == "__main__":
    main()
