"""Experiments on disk: run directories (rundir.py, also their reader), the metrics sink
(metrics.py), trackers (trackers.py), sweeps (sweep.py), compare (compare.py), plots (plot.py)
and an RL run's samples (samples.py)."""
