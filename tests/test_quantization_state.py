"""What a resume says about the quantization state (megatron/training/checkpoint/quantization_state.py).

Why: a ``torch_dist`` checkpoint keeps each rank's quantization state for the layout that wrote
it; resumed with another TP size no rank finds a file of its (TP, PP) rank, and the log said
"written without quantization" of a checkpoint written with SDP4Bit + LoCo (issue 46, item 4).
The re-derivation was right; the reason now names the layout it was written for.
"""

from __future__ import annotations

import argparse
from typing import List

import pytest

from megatron.training.checkpoint import quantization_state


@pytest.fixture
def resets(monkeypatch) -> List[int]:
    calls: List[int] = []
    monkeypatch.setattr(quantization_state.integration, "reset_quantization_state",
                        lambda model, iteration: calls.append(iteration))
    return calls


def _run() -> argparse.Namespace:
    return argparse.Namespace(quant_config=argparse.Namespace(enabled=True))


def _saved(**quant: bool) -> argparse.Namespace:
    return argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              data_parallel_size=4, **quant)


def test_another_layout_is_named_not_a_missing_quantization(resets) -> None:
    lines: List[str] = []
    for saved_args in (_saved(quantized_gradients=True, quantized_weights=True, loco=True),
                       vars(_saved(quantized_gradients=True, quantized_weights=False))):
        quantization_state.restore_quantization_state(
            _run(), [], {"args": saved_args}, 4, same_layout=False, log=lines.append)
    assert len(lines) == 2 and resets == [4, 4]
    for line in lines:
        assert line.startswith(" > quantization state re-derived: the checkpoint's was written "
                               "for another layout (TP=1, PP=1, DP=4): "), line
        assert "without quantization" not in line


def test_a_checkpoint_written_without_quantization_still_says_so(resets) -> None:
    lines: List[str] = []
    for saved_args, same in ((_saved(quantized_gradients=False, quantized_weights=False), False),
                             (_saved(quantized_gradients=False, quantized_weights=False), True),
                             (None, False)):
        quantization_state.restore_quantization_state(
            _run(), [], {"args": saved_args}, 2, same_layout=same, log=lines.append)
    assert resets == [2, 2, 2]
    assert all("has no quantization state (written without quantization)" in ln for ln in lines)
