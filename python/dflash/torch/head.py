"""FusedHead: a training step's lm_head and objective in one module."""

import torch

from dflash.config import objective_config
from dflash.torch.objective import dflash_objective


class FusedHead(torch.nn.Module):
    """Wraps the target model's `nn.Linear` lm_head (frozen by default, as
    DFlash trains only the draft) and an objective config, so that a
    training step swaps SpecForge's chunked objective for one call:

        head = FusedHead(target_lm_head, loss_type="dflash", gamma=7)
        loss_num, loss_den, correct_num, accuracy_den, *_ = head(
            hidden_4d, target_ids, weight_mask)

    config and overrides as dflash.objective_config; with freeze=False the
    lm_head keeps its requires_grad and trains when it is set.
    """

    def __init__(self, lm_head, config=None, *, freeze=True, **overrides):
        super().__init__()
        if not isinstance(lm_head, torch.nn.Linear):
            raise TypeError("lm_head: must be a torch.nn.Linear, got "
                            f"{type(lm_head).__name__}")
        self.lm_head = lm_head
        if freeze:
            lm_head.requires_grad_(False)
        self.config = objective_config(config, **overrides)

    def forward(self, hidden, target_ids, weight_mask, *, teacher_hidden=None,
                confidence_logits=None, return_rows=False, top_k=0):
        """dflash_objective over this head's weight, bias and config."""
        return dflash_objective(
            hidden, self.lm_head.weight, target_ids, weight_mask,
            config=self.config, lm_head_bias=self.lm_head.bias,
            teacher_hidden=teacher_hidden, confidence_logits=confidence_logits,
            return_rows=return_rows, top_k=top_k)
