"""What the trainer and the engines share about models: building and loading them (models.py), checkpoint names
(names.py), dtypes by name (dtypes.py), packed rows' segments (segments.py) and GLM-5's indexer (sparse.py)."""
