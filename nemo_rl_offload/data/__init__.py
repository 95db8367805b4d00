"""Training data: tokenizers, the built-in arithmetic task, JSON-lines loaders and splits.

Everything here is plain Python (no torch) so that data problems are found and reported before
any worker or GPU is started.
"""
