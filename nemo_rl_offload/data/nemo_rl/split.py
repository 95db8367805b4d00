"""NeMo-RL's row orders: the validation hold-out (``split_validation_size`` with ``seed``) and
the ``max_samples`` draw, as index lists.

Both are ``datasets``' own ``train_test_split`` and ``shuffle`` on a table of row numbers:
their permutation depends only on the row count and the seed, so the rows come out the same,
in the same order, as NeMo-RL's calls on its table of the data.
"""

from __future__ import annotations

from nemo_rl_offload.errors import UserInputError

__all__ = ["holdout", "shuffled"]


def _numbers(count: int):  # noqa: ANN202 (a datasets.Dataset)
    import datasets

    return datasets.Dataset.from_dict({"i": list(range(count))})


def holdout(count: int, size: float, seed: int, *, where: str) -> tuple[list[int], list[int]]:
    """(train, validation) row numbers of NeMo-RL's ``split_train_validation``: ``size`` below
    1 is a fraction, from 1 a number of rows (cut to an integer, as NeMo-RL does); 0 holds out
    nothing. ``where`` is the recipe key of ``size``, for a size the rows cannot give."""
    if size <= 0:
        return list(range(count)), []
    test_size = int(size) if size >= 1 else size
    try:
        parts = _numbers(count).train_test_split(test_size=test_size, seed=seed)
    except ValueError as exc:
        raise UserInputError(
            f"{where}: {size!r} cannot be held out of {count} rows ({str(exc).splitlines()[0]}); "
            "lower it"
        ) from None
    return list(parts["train"]["i"]), list(parts["test"]["i"])


def shuffled(count: int, seed: int) -> list[int]:
    """Row numbers in the order of ``datasets``' ``shuffle(seed=seed)``."""
    return list(_numbers(count).shuffle(seed=seed)["i"])
