"""Megatron-LM's ``--data-path`` blend: ``PREFIX...`` or ``W1 PREFIX1 W2 PREFIX2 ...``."""

from __future__ import annotations

from typing import List, Optional, Tuple


def is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def data_blend(data_path: List[str]) -> Tuple[List[str], Optional[List[float]]]:
    """Megatron's ``--data-path`` forms: ``PREFIX...`` or ``W1 PREFIX1 W2 PREFIX2 ...``.

    Returns (prefixes, weights or None), the shape megatron-core's ``blend`` config expects.
    """
    if len(data_path) > 1 and is_number(data_path[0]):
        return list(data_path[1::2]), [float(w) for w in data_path[0::2]]
    return list(data_path), None
