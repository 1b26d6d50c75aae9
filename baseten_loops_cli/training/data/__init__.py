"""Training data: the format layer (formats/: files, folders, hub -> rows), the rows -> Datums
loaders (datums.py) and KTO's row checks (kto_rows.py). No kind names: a kind passes its keys."""
