"""NeMo-RL's datasets by name: where each comes from and how its rows become datum dicts
(data/nemo_rl_datasets.py loads a recipe's entries through :mod:`.registry`)."""
