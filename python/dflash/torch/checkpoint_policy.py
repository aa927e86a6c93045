"""A dflash CheckpointPolicy as a PyTorch selective-checkpoint policy, so the
protobuf config that chooses what the C++ head keeps also chooses what a
Python chunk function keeps under torch.utils.checkpoint."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple, TypedDict

import torch
import torch.utils.checkpoint

from dflash.config import ConfigSource, Override, objective_config
from dflash.torch.chunking import ContextFn

# Matrix products, as (activation, weight) argument positions.
_PROJECTIONS = {
    "aten.mm": (0, 1),
    "aten.addmm": (1, 2),
    "aten.bmm": (0, 1),
    "aten.baddbmm": (1, 2),
    "aten.matmul": (0, 1),
    "aten.linear": (0, 1),
}
# Per-row statistics of a softmax-family loss.
_STATISTICS = {
    "aten._log_softmax", "aten.log_softmax", "aten._softmax", "aten.softmax",
    "aten.logsumexp", "aten.nll_loss_forward", "aten.cross_entropy_loss",
    "aten.amax", "aten.max", "aten.argmax", "aten.topk",
}
_RECOMPUTE = ("PREFER_RECOMPUTE", "MUST_RECOMPUTE")
# One rule of ObjectiveConfig.checkpoint_policy() (None where unset).
_Rule = Dict[str, Any]


class CheckpointOptions(TypedDict):
    """chunked_reduce's checkpoint arguments (checkpoint_options)."""

    checkpoint: bool
    segment_chunks: int
    context_fn: Optional[ContextFn]


def _bytes(tensors: Sequence[object]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors
               if isinstance(t, torch.Tensor))


def _describe(func: Any, args: Sequence[Any], output: Any
              ) -> Tuple[str, str, bool, bool, int]:
    """(name, kind, weight_frozen, input_requires_grad, output bytes) of an
    op, the properties dflash's rules match on. Torch versions that ask the
    policy before running the op give no output: its size is estimated."""
    name = str(func.overloadpacket)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if output is not None:
        size = _bytes(output if isinstance(output, (tuple, list)) else [output])
    else:
        size = max((_bytes([t]) for t in tensors), default=0)
    if name in _PROJECTIONS:
        x, w = (args[i] for i in _PROJECTIONS[name])
        if output is None:
            rows = x.numel() // max(x.shape[-1], 1)
            size = rows * w.shape[-1] * x.element_size()
        return name, "PROJECTION", not w.requires_grad, x.requires_grad, size
    kind = "LOSS_STATISTICS" if name in _STATISTICS else "OTHER"
    return name, kind, False, any(t.requires_grad for t in tensors), size


def _matches(rule: _Rule, name: str, kind: str, frozen: bool,
             needs_grad: bool) -> bool:
    pattern = rule["name"]
    if pattern is not None and not (
            name.startswith(pattern[:-1]) if pattern.endswith("*")
            else name == pattern):
        return False
    return ((rule["kind"] is None or rule["kind"] == kind)
            and (rule["weight_frozen"] is None
                 or rule["weight_frozen"] == frozen)
            and (rule["input_requires_grad"] is None
                 or rule["input_requires_grad"] == needs_grad))


class _Policy:
    """One checkpointed region's decisions: rules in order, first match wins,
    PREFER_SAVE within memory_budget_bytes (in offer order). Torch versions
    that ask again during recomputation get forward's decisions replayed, as
    selective checkpointing requires."""

    def __init__(self, policy: Dict[str, Any]) -> None:
        self._rules: List[_Rule] = policy["rules"]
        self._default: str = policy["default_action"]
        self._budget: Optional[int] = policy["memory_budget_bytes"]
        self._kept = 0
        self._decisions: List[Any] = []
        self._replayed = 0

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        if ctx.is_recompute:
            decision = self._decisions[self._replayed]
            self._replayed += 1
            return decision
        name, kind, frozen, needs_grad, size = _describe(
            func, args, getattr(ctx, "op_output", None))
        action = next((rule["action"] for rule in self._rules
                       if _matches(rule, name, kind, frozen, needs_grad)),
                      self._default)
        if action == "PREFER_SAVE" and self._budget is not None and (
                self._kept + size > self._budget):
            action = "PREFER_RECOMPUTE"
        if action in ("MUST_SAVE", "PREFER_SAVE"):
            self._kept += size
        decision = getattr(torch.utils.checkpoint.CheckpointPolicy, action)
        self._decisions.append(decision)
        return decision


def selective_checkpoint_context_fn(config: ConfigSource = None,
                                    **overrides: Override) -> ContextFn:
    """A `context_fn` for torch.utils.checkpoint (and chunked_reduce) that
    keeps or recomputes each op by the config's checkpoint policy (presets
    expanded): a rule's kind is PROJECTION for matrix products (aten.mm,
    addmm, bmm, baddbmm, matmul, linear; weight_frozen: the weight operand
    needs no gradient), LOSS_STATISTICS for softmax/logsumexp/NLL/max ops,
    OTHER for the rest (LOGITS_GRADIENT never occurs in forward); its name
    matches the op ("aten.mm", or a prefix such as "aten.*"). PREFER_SAVE
    keeps within memory_budget_bytes per checkpointed region (output sizes
    estimated from the inputs). Needs torch.utils.checkpoint's
    create_selective_checkpoint_contexts (torch >= 2.4).
    """
    create = getattr(torch.utils.checkpoint,
                     "create_selective_checkpoint_contexts", None)
    if create is None:
        raise RuntimeError(
            "a selective checkpoint policy needs "
            "torch.utils.checkpoint.create_selective_checkpoint_contexts "
            f"(torch >= 2.4); this torch is {torch.__version__}")
    policy = objective_config(config, **overrides).checkpoint_policy()

    def context_fn() -> Tuple[Any, Any]:
        contexts: Tuple[Any, Any] = create(_Policy(policy))
        return contexts

    return context_fn


def checkpoint_options(config: ConfigSource = None,
                       **overrides: Override) -> CheckpointOptions:
    """chunked_reduce's checkpoint arguments from a config's checkpoint
    policy: `chunked_reduce(f, *tensors, chunk_size=c, **checkpoint_options(
    config))`. segment_chunks 0 (never recompute) turns checkpointing off; a
    policy that recomputes everything needs no context_fn (any torch).
    """
    resolved = objective_config(config, **overrides)
    policy = resolved.checkpoint_policy()
    if policy["segment_chunks"] == 0:
        return {"checkpoint": False, "segment_chunks": 1, "context_fn": None}
    recompute_all = policy["default_action"] in _RECOMPUTE and all(
        rule["action"] in _RECOMPUTE for rule in policy["rules"])
    return {
        "checkpoint": True,
        "segment_chunks": policy["segment_chunks"],
        "context_fn": (None if recompute_all
                       else selective_checkpoint_context_fn(resolved)),
    }
