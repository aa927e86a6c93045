"""FusedHead: a training step's lm_head and objective in one module."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from dflash import _core
from dflash.config import ConfigSource, Override, objective_config
from dflash.torch.objective import (ObjectiveTerms, _checked_objective,
                                    _is_compiling)

# What a prepared layout was made from: the weight's and the bias's storage
# and shape.
_LayoutKey = Tuple[int, Tuple[int, ...], Optional[Tuple[int, Tuple[int, ...]]]]


class FusedHead(torch.nn.Module):
    """Wraps the target model's `nn.Linear` lm_head (frozen by default, as
    DFlash trains only the draft) and an objective config, so that a
    training step swaps SpecForge's chunked objective for one call:

        head = FusedHead(target_lm_head, loss_type="dflash", gamma=7)
        loss_num, loss_den, correct_num, accuracy_den, *_ = head(
            hidden_4d, target_ids, weight_mask)

    config and overrides as dflash.objective_config; with freeze=False the
    lm_head keeps its requires_grad and trains when it is set.

    A frozen float32 CPU lm_head is laid out once for the head's GEMMs
    (dflash.PreparedProjection) and kept across calls; it is laid out again
    when the weight or bias is replaced, or changed in place (even through
    `.data`, which torch's version counter misses: each call compares the
    weight with its checksum, one pass over it).

    vocab_group: a vocab-parallel head (dflash_objective's vocab_group, a
    gloo ProcessGroup, CPU tensors): lm_head holds this rank's rows of the
    vocabulary (dflash.torch.distributed.shard_linear cuts them from the
    whole nn.Linear), and every rank of the group calls the head with the
    same hidden states; with rows="local" each rank calls it with its own
    rows (dflash_objective's rows).
    """

    def __init__(self, lm_head: torch.nn.Linear, config: ConfigSource = None,
                 *, freeze: bool = True, vocab_group: Optional[Any] = None,
                 rows: str = "shared", **overrides: Override) -> None:
        super().__init__()
        if not isinstance(lm_head, torch.nn.Linear):
            raise TypeError("lm_head: must be a torch.nn.Linear, got "
                            f"{type(lm_head).__name__}")
        self.lm_head = lm_head
        if freeze:
            lm_head.requires_grad_(False)
        self.config = objective_config(config, **overrides)
        if vocab_group is not None:
            from dflash.torch import _vocab_parallel
            _vocab_parallel.checked_group(vocab_group)
        if not isinstance(rows, str) or rows not in ("shared", "local"):
            raise ValueError(f"rows: must be 'shared' or 'local', got {rows!r}")
        if rows == "local" and vocab_group is None:
            raise ValueError("rows: 'local' needs a vocab_group")
        self.vocab_group = vocab_group
        self.rows = rows
        self._prepared: Optional[_core.PreparedProjection] = None
        self._prepared_from: Optional[_LayoutKey] = None

    def _prepared_projection(self) -> Optional[_core.PreparedProjection]:
        """The frozen weight's layout, made again when the weight changed."""
        weight, bias = self.lm_head.weight, self.lm_head.bias
        frozen = not weight.requires_grad and (
            bias is None or not bias.requires_grad)
        if (not frozen or weight.is_cuda or weight.dtype != torch.float32
                or not weight.is_contiguous()):
            return None
        # A replaced weight or bias gets a new layout; one changed in place
        # is laid out again where it is, by the call (its checksum).
        state: _LayoutKey = (weight.data_ptr(), tuple(weight.shape),
                 None if bias is None else (bias.data_ptr(), tuple(bias.shape)))
        if state != self._prepared_from:
            self._prepared = None
            self._prepared = _core.PreparedProjection(weight, bias)
            self._prepared_from = state
        return self._prepared

    def forward(self, hidden: torch.Tensor, target_ids: torch.Tensor,
                weight_mask: torch.Tensor, *,
                teacher_hidden: Optional[torch.Tensor] = None,
                confidence_logits: Optional[torch.Tensor] = None,
                return_rows: bool = False, top_k: int = 0) -> ObjectiveTerms:
        """dflash_objective over this head's weight, bias and config.

        Under torch.compile the frozen weight's layout is made and kept by
        the dflash::objective operator itself (its data pointer is not
        read in the graph)."""
        compiling = _is_compiling()
        return _checked_objective(
            hidden, self.lm_head.weight, target_ids, weight_mask,
            config=self.config, overrides={}, lm_head_bias=self.lm_head.bias,
            teacher_hidden=teacher_hidden, confidence_logits=confidence_logits,
            correction_inputs=None, correction_weight=None,
            prepared_projection=(None if compiling
                                 else self._prepared_projection()),
            prepare=compiling, return_rows=return_rows, top_k=top_k,
            vocab_group=self.vocab_group, rows=self.rows)
