"""Reward environments that score generated responses (only the math environment so far)."""
