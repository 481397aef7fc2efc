"""What the HF converter tests (test_convert_from_hf.py, test_convert_to_hf.py) share."""

from __future__ import annotations

from typing import Optional

import torch


def pipeline_logits(gpt: torch.nn.Module, tokens: torch.Tensor, positions: torch.Tensor,
                    hidden_size: int) -> Optional[torch.Tensor]:
    """Collective: the logits of ``gpt`` (this rank's pipeline stage of a GPTModel) on
    ``tokens`` [batch, seq]: the previous stage's hidden states received, this stage's sent on.
    On the last stage the logits gathered over tensor parallelism [batch, seq, vocab], None on
    the others."""
    from megatron.core import parallel_state as ps

    batch, seq = tokens.shape
    with torch.no_grad():
        if not ps.is_pipeline_first_stage():
            hidden = torch.empty(seq, batch, hidden_size)
            torch.distributed.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
            gpt.set_input_tensor(hidden)
        out = gpt(tokens, positions, None)
        if not ps.is_pipeline_last_stage():
            torch.distributed.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
            return None
        parts = [torch.empty_like(out) for _ in range(ps.get_tensor_model_parallel_world_size())]
        torch.distributed.all_gather(parts, out.contiguous(),
                                     group=ps.get_tensor_model_parallel_group())
    return torch.cat(parts, dim=-1)
