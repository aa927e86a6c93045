"""SpecForge drop-in: `apply()` runs SpecForge's own DFlash objective
through dflash's fused head; `revert()` undoes it.

    import dflash.specforge
    dflash.specforge.apply()      # once, before or after building the model
    loss, accuracy, metrics = online_dflash_model(input_ids, hidden, mask)

What is patched (specforge 0.2.0, `specforge.algorithms.common.
dflash_family_model`), nothing else:

- `OnlineDFlashModel._dflash_objective_chunk_terms`, the chunk-term
  function: the same four terms `(loss_num, loss_den, correct_num,
  accuracy_den)` in SpecForge's dtypes on hidden's device, `loss_num`
  differentiable with respect to hidden (and the lm_head's weight and bias
  when they require grad), from one call of the fused head over the chunk.
- The module's name `checkpointed_chunk_reduce`: when its chunk function is
  the patched one (OnlineDFlashModel.forward's call) the whole batch is one
  head call, chunked inside the head by `objective_chunk_blocks` (so nothing
  is recomputed in backward); every other call goes to SpecForge's function.

The DFlash loss (`loss_type="dflash"`, any `loss_decay_gamma`) and the three
D-PACE variants run through the head. A batch the head cannot run goes to
SpecForge's own code, with one `SpecForgeFallbackWarning` per reason (see
`FALLBACKS`). `apply()` refuses, with `SpecForgeVersionError`, a SpecForge
whose patched functions are not the ones it knows (it compares their
source with the released versions'). `OnlineDSparkModel` and
`OnlineDominoModel` keep SpecForge's objective: SpecForge 0.2.0 returns
their term numerators separately, each differentiable, which dflash's core
does not give from one call; their first step warns saying so.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import threading
import warnings
import weakref
from types import ModuleType
from typing import (Any, Callable, Dict, NamedTuple, Optional, Set, Tuple,
                    Union)

import torch

from dflash import _core
from dflash.config import Override, objective_config
from dflash.torch.objective import dflash_objective

__all__ = [
    "FALLBACKS",
    "SUPPORTED_VERSIONS",
    "SpecForgeFallbackWarning",
    "SpecForgeVersionError",
    "apply",
    "is_applied",
    "revert",
]

_MODULE = "specforge.algorithms.common.dflash_family_model"

# The sha256 of the source (inspect.getsource) of each function the patch
# replaces or depends on, per released SpecForge version.
_SEAMS: Dict[str, Dict[str, str]] = {
    "0.2.0": {
        "OnlineDFlashModel._dflash_objective_chunk_terms":
            "d233a41541525871aa377a170f0db6e0abad863b0a6acbb113b67424c3bf9008",
        "OnlineDFlashModel._dpace_weight":
            "798cc6975ec13590dfc71b62662393582c27f23cb87b8cba75523a8b593d448f",
        "checkpointed_chunk_reduce":
            "0a5f97c519a3438579e9eda33e8aa6cc83d7029b5ec8ad4b34fb38f737c2dc5d",
    },
}

SUPPORTED_VERSIONS: Tuple[str, ...] = tuple(sorted(_SEAMS))
"""The SpecForge versions whose seam `apply()` knows."""

FALLBACKS: Tuple[str, ...] = (
    "the lm_head is not a plain torch.nn.Linear (another module, a subclass "
    "with its own forward, or module hooks)",
    "the weight or hidden is a tensor subclass (DTensor, ...)",
    "a dtype or device the head does not run (CPU float32/float64, CUDA "
    "float32/bfloat16 with a CUDA build; weight and hidden alike), or "
    "autocast enabled",
    "hidden is not contiguous (a chunk view; dflash reads hidden in place "
    "and does not take strided views)",
    "a target of -100 where the weight is positive (SpecForge counts its "
    "weight with loss 0 and q = 1; dflash drops the row)",
    "a target outside [0, V) (SpecForge's cross-entropy raises)",
    "weight_mask not float32/float64, target_ids not int64, or shapes "
    "other than SpecForge's [B, N, block_size(, H)]",
    "a loss_decay_gamma so small that a decay weight underflows to 0",
    "a loss_type this version of the patch does not know, or a subclass "
    "that overrides _dpace_weight",
    "an input the head refuses (ValueError: non-finite hidden, ...)",
    "OnlineDSparkModel and OnlineDominoModel: their separately "
    "differentiable term numerators are not in dflash's core (not patched)",
)
"""What makes a call fall back to SpecForge's own objective."""


class SpecForgeVersionError(RuntimeError):
    """The installed SpecForge's seam is not one `apply()` knows."""


class SpecForgeFallbackWarning(UserWarning):
    """A call ran SpecForge's own objective; the message says why."""


_DPACE_VARIANTS = {
    "dpace": "DPACE",
    "dpace-cumulative-confidence-only": "CUMULATIVE_CONFIDENCE_ONLY",
    "dpace-continuation-value-only": "CONTINUATION_VALUE_ONLY",
}


# The models whose objective needs what dflash's core lacks (issue 29,
# item 3): separately differentiable term numerators from one head call.
_UNPATCHED = (
    ("OnlineDSparkModel", "_dspark_objective_chunk_terms",
     "returns DSpark's CE, L1 and confidence numerators separately, each "
     "differentiable, and weighs them after the chunked reduction; dflash's "
     "core gives one differentiable loss_num (separate numerators are "
     "missing)"),
    ("OnlineDominoModel", "_domino_objective_chunk_terms",
     "returns Domino's final and base numerators separately, each "
     "differentiable, and mixes them with forward's lambda_base after the "
     "chunked reduction; dflash's core gives one differentiable loss_num "
     "(separate numerators are missing)"),
)


class _Fallback(NamedTuple):
    """Why a call runs SpecForge's own objective: a key (one warning per
    key) and the reason in words."""

    key: str
    reason: str


class _Patch:
    """One apply(): what it replaced, the head options and the reasons
    already warned about."""

    def __init__(self, module: ModuleType, version: str,
                 overrides: Dict[str, Override]) -> None:
        self.module = module
        self.version = version
        self.cls: Any = module.OnlineDFlashModel
        self.original_terms: Callable[..., Tuple[torch.Tensor, ...]] = (
            self.cls.__dict__["_dflash_objective_chunk_terms"])
        self.original_dpace_weight: Any = self.cls.__dict__["_dpace_weight"]
        self.original_reduce: Callable[..., Tuple[torch.Tensor, ...]] = (
            module.checkpointed_chunk_reduce)
        self.overrides = overrides
        self.warned: Set[str] = set()
        # The chunk functions left as they are, and why (each warns once
        # when SpecForge's reduction runs it).
        self.unpatched: Dict[Any, _Fallback] = {}
        for cls_name, name, what in _UNPATCHED:
            function = vars(getattr(module, cls_name, object)).get(name)
            if function is not None:
                self.unpatched[function] = _Fallback(
                    cls_name, f"{cls_name} is not patched: SpecForge "
                    f"{version} {what}")


_lock = threading.Lock()
_patch: Optional[_Patch] = None
# The latest apply(), kept after revert() for calls through old references.
_last: Optional[_Patch] = None
# A frozen float32 CPU weight's layout per lm_head module, and what it was
# made from (as FusedHead keeps one).
_Layout = Tuple[Any, _core.PreparedProjection]
_layouts: "weakref.WeakKeyDictionary[torch.nn.Module, _Layout]" = (
    weakref.WeakKeyDictionary())


def _installed_version() -> str:
    try:
        from importlib import metadata
        return metadata.version("specforge")
    except Exception:  # No metadata (a source tree on sys.path).
        return "unknown"


def _fingerprint(module: ModuleType) -> Dict[str, str]:
    methods = vars(getattr(module, "OnlineDFlashModel", object))
    functions = {
        "OnlineDFlashModel._dflash_objective_chunk_terms":
            methods.get("_dflash_objective_chunk_terms"),
        "OnlineDFlashModel._dpace_weight": methods.get("_dpace_weight"),
        "checkpointed_chunk_reduce":
            getattr(module, "checkpointed_chunk_reduce", None),
    }
    prints = {}
    for name, function in functions.items():
        try:
            source = "" if function is None else inspect.getsource(function)
        except (OSError, TypeError):
            source = ""
        prints[name] = hashlib.sha256(source.encode()).hexdigest()
    return prints


def is_applied() -> bool:
    """Whether `apply()` is in effect."""
    return _patch is not None


def apply(*, mode: Optional[str] = None,
          threads: Optional[int] = None) -> None:
    """Patches SpecForge's DFlash objective to run through dflash's fused
    head (see the module's documentation). A second call while applied
    changes nothing; with other options it is a ValueError (revert()
    first).

    mode: the head's execution mode (dflash's default "fused": gradients in
        forward, nothing recomputed); threads: the head's CPU threads (0:
        every CPU, the default).

    Raises ImportError when SpecForge cannot be imported, and
    SpecForgeVersionError when its seam is not one this version knows.
    """
    global _patch, _last
    with _lock:
        overrides: Dict[str, Override] = {}
        if mode is not None:
            if not isinstance(mode, str):
                raise TypeError(f"mode: must be a str, got {mode!r}")
            overrides["mode"] = mode
        if threads is not None:
            if isinstance(threads, bool) or not isinstance(threads, int):
                raise TypeError(f"threads: must be an int, got {threads!r}")
            overrides["threads"] = threads
        if _patch is not None:
            if overrides != _patch.overrides:
                raise ValueError(
                    f"dflash.specforge.apply: already applied with "
                    f"{_patch.overrides or 'the defaults'}; call revert() "
                    f"before applying {overrides or 'the defaults'}")
            return
        if overrides:
            # Checked now, not at the first training step.
            objective_config(None, **overrides)
        try:
            module = importlib.import_module(_MODULE)
        except ImportError as error:
            raise ImportError(
                f"dflash.specforge.apply: cannot import {_MODULE} ({error}); "
                "install SpecForge (pip install --no-deps specforge==0.2.0 "
                "brings its sources; its DFlash model also needs "
                "transformers)") from error
        installed = _installed_version()
        prints = _fingerprint(module)
        known = [version for version, seam in _SEAMS.items()
                 if seam == prints]
        if not known:
            differing = sorted(
                name for name in prints
                if all(seam[name] != prints[name] for seam in _SEAMS.values()))
            raise SpecForgeVersionError(
                f"dflash.specforge.apply: the installed SpecForge "
                f"({installed}) is not a version whose seam dflash knows "
                f"(known: {', '.join(SUPPORTED_VERSIONS)}): "
                f"{', '.join(differing)} in {_MODULE} differ from every "
                "known version's (or are already patched by something "
                "else); nothing was patched")
        patch = _Patch(module, known[0], overrides)
        setattr(patch.cls, "_dflash_objective_chunk_terms", _chunk_terms)
        setattr(module, "checkpointed_chunk_reduce", _chunk_reduce)
        _patch = _last = patch


def revert() -> None:
    """Restores SpecForge's own functions. Harmless when not applied. A
    function that something else replaced after `apply()` is left as it
    is."""
    global _patch
    with _lock:
        patch = _patch
        if patch is None:
            return
        if patch.cls.__dict__.get("_dflash_objective_chunk_terms") is (
                _chunk_terms):
            setattr(patch.cls, "_dflash_objective_chunk_terms",
                    patch.original_terms)
        if getattr(patch.module, "checkpointed_chunk_reduce",
                   None) is _chunk_reduce:
            setattr(patch.module, "checkpointed_chunk_reduce",
                    patch.original_reduce)
        _patch = None


def _warn(patch: _Patch, fallback: _Fallback) -> None:
    if fallback.key in patch.warned:
        return
    patch.warned.add(fallback.key)
    warnings.warn(
        f"dflash.specforge: {fallback.reason}; running SpecForge's own "
        "objective for this call (warned once per reason)",
        SpecForgeFallbackWarning, stacklevel=4)


def _autocast(device_type: str) -> bool:
    is_enabled: Any = torch.is_autocast_enabled
    try:
        return bool(is_enabled(device_type))
    except TypeError:  # torch < 2.4 takes no device type.
        if device_type == "cpu":
            return bool(getattr(torch, "is_autocast_cpu_enabled")())
        return bool(is_enabled())


def _plain_tensor(value: object) -> bool:
    return type(value) in (torch.Tensor, torch.nn.Parameter)


def _head_reason(head: object) -> Optional[_Fallback]:
    name = type(head).__name__
    if not isinstance(head, torch.nn.Linear):
        return _Fallback(
            f"head:{name}",
            f"the lm_head is a {name}, not a torch.nn.Linear (dflash "
            "projects with the head's weight)")
    if type(head).forward is not torch.nn.Linear.forward:
        return _Fallback(
            f"head:{name}",
            f"the lm_head's class {name} has a forward of its own (dflash "
            "computes hidden @ weight^T + bias)")
    hooks: Any = torch.nn.modules.module
    if (head._forward_hooks or head._forward_pre_hooks
            or hooks._global_forward_hooks
            or hooks._global_forward_pre_hooks
            or head._backward_hooks
            or getattr(head, "_backward_pre_hooks", None)
            or getattr(hooks, "_global_backward_hooks", None)
            or getattr(hooks, "_global_backward_pre_hooks", None)):
        return _Fallback(
            "head:hooks",
            "the lm_head has forward or backward hooks (they would not see "
            "the fused head's logits)")
    return None


def _tensor_reason(head: torch.nn.Linear, hidden: torch.Tensor,
                   target_ids: torch.Tensor, weight_mask: torch.Tensor,
                   block_size: int) -> Optional[_Fallback]:
    weight, bias = head.weight, head.bias
    others = [weight, target_ids, weight_mask] + (
        [] if bias is None else [bias])
    if not all(_plain_tensor(t) for t in [hidden] + others):
        return _Fallback(
            "subclass",
            "the weight, bias or hidden is a tensor subclass (DTensor, ...); "
            "dflash reads plain tensors")
    if (hidden.dim() != 4 or weight.dim() != 2
            or hidden.shape[3] != weight.shape[1]
            or target_ids.shape != hidden.shape[:3]
            or weight_mask.shape != hidden.shape[:3]
            or hidden.shape[2] != block_size
            or (bias is not None and bias.shape != weight.shape[:1])):
        return _Fallback(
            "shape",
            f"shapes other than SpecForge's (hidden {list(hidden.shape)}, "
            f"weight {list(weight.shape)}, target_ids "
            f"{list(target_ids.shape)}, weight_mask "
            f"{list(weight_mask.shape)}, block_size {block_size})")
    device = hidden.device
    if device.type not in ("cpu", "cuda"):
        return _Fallback(
            f"device:{device.type}",
            f"a {device.type} device (dflash runs on CPU and CUDA)")
    if device.type == "cuda" and not _core.built_with_cuda():
        return _Fallback(
            "device:nocuda",
            "a CUDA tensor, and this dflash was built without CUDA")
    if any(t.device != device for t in others):
        return _Fallback(
            "device:mixed",
            "the head's weight and the inputs on different devices")
    dtypes = ((torch.float32, torch.float64) if device.type == "cpu"
              else (torch.float32, torch.bfloat16))
    if hidden.dtype not in dtypes:
        return _Fallback(
            f"dtype:{device.type}:{hidden.dtype}",
            f"{hidden.dtype} hidden states on {device.type} (dflash runs "
            f"{' and '.join(str(d) for d in dtypes)} there)")
    if weight.dtype != hidden.dtype or (
            bias is not None and bias.dtype != hidden.dtype):
        return _Fallback(
            "dtype:mixed",
            f"an lm_head in {weight.dtype} and hidden states in "
            f"{hidden.dtype}")
    if _autocast(device.type):
        return _Fallback(
            "autocast",
            f"autocast enabled on {device.type} (dflash computes in the "
            "tensors' own dtype)")
    if weight_mask.dtype not in (torch.float32, torch.float64):
        return _Fallback(
            f"mask:{weight_mask.dtype}",
            f"a {weight_mask.dtype} weight_mask (the patch takes float32 "
            "and float64, as SpecForge's forward makes)")
    if target_ids.dtype != torch.int64:
        return _Fallback(
            f"targets:{target_ids.dtype}",
            f"{target_ids.dtype} target_ids (SpecForge's cross-entropy "
            "takes int64)")
    if not hidden.is_contiguous():
        return _Fallback(
            "contiguous",
            "a non-contiguous hidden (a chunk view of a batch): dflash's "
            "core reads hidden in place and lacks strided views")
    if not weight.is_contiguous() or (
            bias is not None and not bias.is_contiguous()):
        return _Fallback(
            "contiguous-weight",
            "a non-contiguous lm_head weight or bias (dflash reads it in "
            "place)")
    vocab = weight.shape[0]
    ignored = target_ids == -100
    outside = ((target_ids < 0) | (target_ids >= vocab)) & ~ignored
    if bool(outside.any()):
        return _Fallback("targets:range",
                         f"target ids outside [0, V = {vocab})")
    if bool((ignored & (weight_mask > 0)).any()):
        return _Fallback(
            "targets:-100",
            "a target of -100 where the weight is positive: dflash's core "
            "lacks SpecForge's treatment of it (loss 0, its weight still "
            "counted, q = 1); it drops the row")
    return None


def _prepared(head: torch.nn.Linear) -> Optional[_core.PreparedProjection]:
    """The frozen float32 CPU weight's layout, made again when the weight
    or bias was replaced (the head's checksum catches in-place changes)."""
    weight, bias = head.weight, head.bias
    frozen = not weight.requires_grad and (
        bias is None or not bias.requires_grad)
    if not frozen or weight.is_cuda or weight.dtype != torch.float32:
        return None
    state = (weight.data_ptr(), tuple(weight.shape),
             None if bias is None else (bias.data_ptr(), tuple(bias.shape)))
    kept = _layouts.get(head)
    if kept is not None and kept[0] == state:
        return kept[1]
    _layouts.pop(head, None)
    layout = _core.PreparedProjection(weight, bias)
    _layouts[head] = (state, layout)
    return layout


def _run(patch: _Patch, model: Any, hidden: torch.Tensor,
         target_ids: torch.Tensor, weight_mask: torch.Tensor,
         chunk_blocks: int) -> Union[Tuple[torch.Tensor, ...], _Fallback]:
    """SpecForge's four chunk terms over `hidden` from one head call, or
    a _Fallback where dflash cannot give them."""
    loss_type = getattr(model, "loss_type", None)
    if loss_type != "dflash" and loss_type not in _DPACE_VARIANTS:
        return _Fallback(
            f"loss_type:{loss_type}",
            f"loss_type={loss_type!r}, which dflash.specforge does not know "
            f"for SpecForge {patch.version}")
    if (loss_type != "dflash" and type(model)._dpace_weight
            is not patch.original_dpace_weight):
        return _Fallback(
            "dpace_weight", f"{type(model).__name__} overrides _dpace_weight")
    head = model.lm_head
    reason = _head_reason(head)
    if reason is None:
        reason = _tensor_reason(head, hidden, target_ids, weight_mask,
                                int(model.block_size))
    if reason is not None:
        return reason

    decayed = False
    if loss_type == "dflash":
        config = "loss { dflash { } }"
        loss_weights = weight_mask
        gamma = model.loss_decay_gamma
        if gamma is not None and gamma > 0:
            # SpecForge's decay (in float32) is a row weight: dflash takes
            # it in the mask, so the weights are SpecForge's to the bit.
            positions = torch.arange(model.block_size,
                                     device=hidden.device).view(1, 1, -1)
            decay = torch.exp(
                -(positions - 1).clamp(min=0).float() / gamma)
            if bool((decay == 0).any()):
                return _Fallback(
                    "decay",
                    f"loss_decay_gamma={gamma!r} underflows a decay weight "
                    "to 0 (dflash skips rows without weight; SpecForge "
                    "still counts their accuracy)")
            loss_weights = weight_mask * decay
            decayed = True
        loss_den: Optional[torch.Tensor] = loss_weights.sum()
        mask = loss_weights
    else:
        alpha = float(model.dpace_alpha)
        config = (f"loss {{ dpace {{ alpha: {alpha!r} variant: "
                  f"{_DPACE_VARIANTS[loss_type]} }} }}")
        loss_den = None
        mask = weight_mask
    num_dtype = torch.promote_types(hidden.dtype, mask.dtype)

    batch, blocks = hidden.shape[:2]
    try:
        resolved = objective_config(
            config, chunk_blocks=batch * (chunk_blocks or blocks),
            **patch.overrides)
        terms = dflash_objective(
            hidden, head.weight, target_ids, mask, config=resolved,
            lm_head_bias=head.bias, prepared_projection=_prepared(head),
            return_rows=decayed)
    except ValueError as error:
        return _Fallback("refused", f"dflash refused the batch ({error})")

    loss_num = terms.loss_num.to(num_dtype)
    if loss_den is None:
        loss_den = loss_num.new_zeros(())
    if decayed:
        argmax = terms.diagnostics.argmax
        assert argmax is not None
        correct_num = ((argmax == target_ids) & (weight_mask > 0.5)).sum()
    else:
        correct_num = terms.correct_num
    return (loss_num, loss_den, correct_num.detach().float(),
            weight_mask.sum())


def _chunk_terms(self: Any, hidden: torch.Tensor, target_ids: torch.Tensor,
                 weight_mask: torch.Tensor) -> Tuple[torch.Tensor, ...]:
    """OnlineDFlashModel._dflash_objective_chunk_terms through dflash's
    fused head: (loss_num, loss_den, correct_num, accuracy_den) as
    SpecForge's."""
    patch = _patch
    if patch is None:  # Reverted, and called through an old reference.
        assert _last is not None
        return _last.original_terms(self, hidden, target_ids, weight_mask)
    result = _run(patch, self, hidden, target_ids, weight_mask,
                  hidden.shape[1] if hidden.dim() == 4 else 0)
    if isinstance(result, _Fallback):
        _warn(patch, result)
        return patch.original_terms(self, hidden, target_ids, weight_mask)
    return result


def _chunk_reduce(function: Callable[..., Tuple[torch.Tensor, ...]],
                  *aligned_tensors: Optional[torch.Tensor], chunk_size: int,
                  dim: int = 0) -> Tuple[torch.Tensor, ...]:
    """SpecForge's checkpointed_chunk_reduce; for the patched DFlash chunk
    terms over a whole batch, one head call chunked inside the head."""
    patch = _patch
    if patch is None:  # Reverted, and called through an old reference.
        assert _last is not None
        return _last.original_reduce(function, *aligned_tensors,
                                     chunk_size=chunk_size, dim=dim)
    model = getattr(function, "__self__", None)
    tensors = [t for t in aligned_tensors if isinstance(t, torch.Tensor)]
    ours = (getattr(function, "__func__", None) is _chunk_terms
            and isinstance(model, patch.cls) and dim == 1
            and len(tensors) == 3 and len(aligned_tensors) == 3
            and type(chunk_size) is int and chunk_size >= 0)
    if ours:
        hidden, target_ids, weight_mask = tensors
        ours = (hidden.dim() == 4 and target_ids.dim() == 3
                and weight_mask.dim() == 3 and hidden.shape[1] > 0
                and target_ids.shape[1] == hidden.shape[1]
                and weight_mask.shape[1] == hidden.shape[1])
    if not ours:
        unpatched = patch.unpatched.get(getattr(function, "__func__", None))
        if unpatched is not None:
            _warn(patch, unpatched)
        return patch.original_reduce(function, *aligned_tensors,
                                     chunk_size=chunk_size, dim=dim)
    hidden, target_ids, weight_mask = tensors
    result = _run(patch, model, hidden, target_ids, weight_mask, chunk_size)
    if isinstance(result, _Fallback):
        _warn(patch, result)
        return patch.original_reduce(
            patch.original_terms.__get__(model), *aligned_tensors,
            chunk_size=chunk_size, dim=dim)
    return result
