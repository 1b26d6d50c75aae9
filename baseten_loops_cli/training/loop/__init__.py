"""The one training loop (core.py: `run`, `StepHooks`, `Loop`), its submit-ahead pipeline
(pipeline.py) and the steps DPO and KTO share (preference.py). Kinds (training/kinds) plug in through
hooks; nothing here names a kind."""
