"""Evaluation: the tasks `loops eval` and the `eval:` block score (scoring.py), multiple-choice
rows (multiple_choice.py) and the `eval:` block at the end of a run (final_eval.py). Renders nothing."""
