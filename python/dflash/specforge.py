"""SpecForge drop-in: `apply()` runs SpecForge's own DFlash, DSpark and
Domino objectives through dflash's fused head; `revert()` undoes it.

    import dflash.specforge
    dflash.specforge.apply()      # once, before or after building the model
    loss, accuracy, metrics = online_dflash_model(input_ids, hidden, mask)

What is patched (specforge 0.2.0 or SpecForge main at MAIN_COMMIT,
`specforge.algorithms.common.dflash_family_model`), nothing else:

- The chunk-term functions `OnlineDFlashModel._dflash_objective_chunk_terms`,
  `OnlineDSparkModel._dspark_objective_chunk_terms` and
  `OnlineDominoModel._domino_objective_chunk_terms`: SpecForge's tuples
  (4, 14 and 9 terms, in its order, dtypes and device) from one call of the
  fused head over the chunk. The numerators SpecForge weighs after the
  reduction are each differentiable (DSpark's CE, L1 and confidence BCE;
  Domino's final and base CE; dflash.torch.separate_numerators): the head
  runs with the weights SpecForge will apply (the DSpark alphas, forward's
  lambda_base), so backward scales its gradients; other weights recompute
  them exactly.
- The module's name `checkpointed_chunk_reduce`: when its chunk function is
  a patched one (the models' forward) the whole batch is one head call,
  chunked inside the head by `objective_chunk_blocks` (so nothing is
  recomputed in backward); every other call goes to SpecForge's function.
- `OnlineDominoModel.forward`, wrapped to hand its lambda_base to the chunk
  terms.

SpecForge main: its DFlash chunk terms (eleven, ce_loss_num and
tv_loss_num each differentiable for the LK composition main applies after
the reduction; the D-PACE variants with its sequence-balanced
denominator) from one head call per batch; its DSpark and Domino
objectives run SpecForge's own code (their draft modules are not known).

The DFlash loss (any `loss_decay_gamma`), the three D-PACE variants, DSpark
with SpecForge's DSparkDraftModel (no Markov head, or its vanilla, gated or
rnn head: the head adds their z @ markov_w2^T, z made by SpecForge's own
code with the projection deferred; any confidence head) and Domino with its
DominoDraftModel (z the input of embed_proj's last Linear) run through the
head. A batch the head cannot run goes to SpecForge's own code, with one
`SpecForgeFallbackWarning` per reason (see `FALLBACKS`). `apply()` refuses,
with `SpecForgeVersionError`, a SpecForge whose patched or read functions
are not the ones it knows (it compares their source with the released
versions').
"""

from __future__ import annotations

import contextvars
import hashlib
import importlib
import inspect
import threading
import warnings
import weakref
from types import FunctionType, ModuleType
from typing import (Any, Callable, Dict, List, NamedTuple, Optional,
                    Sequence, Set, Tuple, Union)

import torch

from dflash import _core
from dflash.config import Override, objective_config
from dflash.torch.objective import dflash_objective
from dflash.torch.term_numerators import separate_numerators

__all__ = [
    "FALLBACKS",
    "MAIN_COMMIT",
    "SUPPORTED_VERSIONS",
    "SpecForgeFallbackWarning",
    "SpecForgeVersionError",
    "apply",
    "is_applied",
    "revert",
]

_MODULE = "specforge.algorithms.common.dflash_family_model"
# The draft modules whose logits heads the DSpark and Domino patches read,
# by the short names the seam keys use.
_DRAFT_MODULES = {
    "dflash": "specforge.modeling.draft.dflash",
    "dspark": "specforge.modeling.draft.dspark",
    "domino": "specforge.modeling.draft.domino",
}

MAIN_COMMIT: str = "c1625dc7"
"""The commit of SpecForge's main (not released) whose seam `apply()`
knows beside SUPPORTED_VERSIONS."""
# Main's key in _SEAMS.
_MAIN = f"main-{MAIN_COMMIT}"

# The sha256 of the source (inspect.getsource) of each function the patch
# replaces or depends on, per SpecForge version. A key is
# "Class.function" in the model module, or "<draft module>.Class.function";
# a property's source is its getter's.
_SEAMS: Dict[str, Dict[str, str]] = {
    "0.2.0": {
        "OnlineDFlashModel._dflash_objective_chunk_terms":
            "d233a41541525871aa377a170f0db6e0abad863b0a6acbb113b67424c3bf9008",
        "OnlineDFlashModel._dpace_weight":
            "798cc6975ec13590dfc71b62662393582c27f23cb87b8cba75523a8b593d448f",
        "checkpointed_chunk_reduce":
            "0a5f97c519a3438579e9eda33e8aa6cc83d7029b5ec8ad4b34fb38f737c2dc5d",
        "OnlineDSparkModel._dspark_objective_chunk_terms":
            "be622b23368c8f97d415e41149de281792f4bb2b6a6bc00c236a68a2d5817481",
        "OnlineDSparkModel._compute_dspark_loss":
            "9a0fa34c6a0c166ed54e2cac54dbd3b5681e39bf882bbc079b9c651c587c0d86",
        "OnlineDominoModel._domino_objective_chunk_terms":
            "6a966c93aaf54340314dc8d940c9d16758f4691802bca567fae2d28943815678",
        "OnlineDominoModel._apply_domino_head":
            "492a2e56b36b8d1710713f50780a5307fa16fac76b1ab0ec8f908bd69840095c",
        "OnlineDominoModel.forward":
            "ece93a8080fdc80ed9f0842a00130309bbd31ab8f2524779e0ffc4d7c8bca8cc",
        "dflash.DFlashDraftModel.apply_logits_head":
            "2f5fa8734a1047c8d6625f9324d193e9ab5f1cf8bc988356b16510291cd3c620",
        "dspark.DSparkDraftModel.apply_logits_head":
            "fd08fa075a90d66eaa2dad9338ecece8617c86f7be880bdd3d32a5d6169dcd1a",
        "dspark.VanillaMarkovHead.apply_block_logits":
            "8f0ff54cf02593db201d75c417c3a2f9b0a4112778ef22f83f80eb9c3e28f4c9",
        "dspark.VanillaMarkovHead.compute_step_bias":
            "ab7c5f0fa494e99c8290408db9636e735184d4a12b830208f7cadeea1955ed73",
        "dspark.VanillaMarkovHead.project_bias":
            "e63cfd8c427d85d9c98b8c2c9dcab5931d4925c26f782d2dd2a2f80ee6b0cdba",
        "dspark.GatedMarkovHead.compute_step_bias":
            "fe375ff5cbbd1077cceb1756b028509aab386af21c822a43166690f9b8e24bc8",
        "dspark.RNNMarkovHead.apply_block_logits":
            "e9f5834aa9d62a09a49a863f9e758aff4526d1fc48e9f78185eb077d837964e7",
        "dspark.RNNMarkovHead._rnn_step":
            "f10f67615420a4cad105ccec43e400a7d9411cefa47b8bcdc76762347cf8fed1",
        "domino.DominoDraftModel.apply_logits_head":
            "ce68ae90e0c10d253d143fa1a018e263cf6d15db41248c1a32c2c473c4ad1e5f",
        "domino.DominoDraftModel.suffix_start":
            "633ab4a67fb7c8f1c2d11f5ad6ab29119d8f37cc4041db8f20a2a5297cb0f270",
    },
    # SpecForge main as of c1625dc7 (its dflash_family_model.py with PR
    # #848's sequence-balanced D-PACE denominator; not on PyPI). Its draft
    # modules are not known (their logits corrections changed after 0.2.0
    # and no matching version could be read), so none is keyed: main's
    # DSpark and Domino run SpecForge's own objective (FALLBACKS).
    _MAIN: {
        "OnlineDFlashModel._dflash_objective_chunk_terms":
            "c7618cb3b928e172909111e8d9ecbe3051198594c0292fab2a597ceacc660124",
        "OnlineDFlashModel._dpace_weight":
            "798cc6975ec13590dfc71b62662393582c27f23cb87b8cba75523a8b593d448f",
        "OnlineDFlashModel._sequence_anchor_scale":
            "512c1e5ba16a8cdce373e54f7425075cfb342e7b076da420705bd972a15bf7fc",
        "OnlineDFlashModel._lk_kl_weight":
            "257fe3c6888a9c5ce3d383f03c646b3f0e44f67f5590d7c2e80e3d84120a0ea6",
        "OnlineDFlashModel._compose_token_objective":
            "bb62dd3758af2fad0ba7ed89de21750e5e9a47383a01fe1d82e5fc6989665ffe",
        "OnlineDFlashModel.forward":
            "bf66d864127b95d529b72eb428acdeb85081646729c759668fc93e267f89a02f",
        "checkpointed_chunk_reduce":
            "5b980cf2108d611a3aede8ce199d215d531509d63d3fded26858c7ee4b55e356",
        "OnlineDSparkModel._dspark_objective_chunk_terms":
            "d36f38e83cfbc1d201a3175b9d4920ca17374a8f76a2f69f6e2de6312cc74ca7",
        "OnlineDominoModel._domino_objective_chunk_terms":
            "1e90fe5830346c4fe151e2d091b91b2f89f7850aaea577a839f47263c59f602c",
        "OnlineDominoModel.forward":
            "983b2bd84d927cddec56799bbe3e2267a087b08f544cdc65896f2d0002a2404a",
    },
}

SUPPORTED_VERSIONS: Tuple[str, ...] = tuple(
    sorted(version for version in _SEAMS if version != _MAIN))
"""The released SpecForge versions whose seam `apply()` knows (and
SpecForge main at MAIN_COMMIT)."""

FALLBACKS: Tuple[str, ...] = (
    "the lm_head is not a plain torch.nn.Linear (another module, a subclass "
    "with its own forward, or module hooks)",
    "the weight or hidden is a tensor subclass (DTensor, ...)",
    "a dtype or device the head does not run (CPU float32/float64, CUDA "
    "float32/bfloat16 with a CUDA build; weight and hidden alike), or "
    "autocast enabled",
    "DSpark and Domino: a target of -100 where the weight is positive "
    "(their forwards label from input_ids, which never hold -100, and "
    "their corrections embed the targets; DFlash and D-PACE count such a "
    "row as SpecForge does: loss 0, weight counted, q = 1)",
    "a target outside [0, V) (SpecForge's cross-entropy raises)",
    "weight_mask not float32/float64, target_ids not int64, or shapes "
    "other than SpecForge's [B, N, block_size(, H)]",
    "a loss_decay_gamma so small that a decay weight underflows to 0",
    "a loss_type this version of the patch does not know, or a subclass "
    "that overrides _dpace_weight",
    "an input the head refuses (ValueError: non-finite hidden, ...)",
    "DSpark: a draft whose apply_logits_head is neither SpecForge's DSpark "
    "one (no Markov head, or its vanilla, gated or rnn head with a plain "
    "bias-free markov_w2) nor DFlash's identity; confidence logits that are "
    "not float32 [B, N, block_size] (the head takes float32); a teacher "
    "state of another dtype or shape; loss weights that are not a "
    "per-position weight of eval_mask",
    "Domino: a draft whose apply_logits_head is not SpecForge's Domino one "
    "with embed_proj a plain Sequential ending in a bias-free Linear; a "
    "model that overrides _apply_domino_head; the draft's shift_label "
    "differing from the model's; an empty corrected suffix",
    "SpecForge main: a DFlash2 draft (candidate_selector), fused_head=True; "
    "a D-PACE sequence_anchor_scale that is not 1 / the anchor count of "
    "the call's own sequences (a direct call on a chunk of longer ones); "
    "lk_loss_type='lambda' with a trainable lm_head (the head refuses); "
    "main's DSpark and Domino objectives (their draft modules' logits "
    "corrections are not known)",
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


class _Fallback(NamedTuple):
    """Why a call runs SpecForge's own objective: a key (one warning per
    key) and the reason in words."""

    key: str
    reason: str


# The chunk-term methods apply() replaces: (class, method).
_REPLACED = (
    ("OnlineDFlashModel", "_dflash_objective_chunk_terms"),
    ("OnlineDSparkModel", "_dspark_objective_chunk_terms"),
    ("OnlineDominoModel", "_domino_objective_chunk_terms"),
)


class _Patch:
    """One apply(): what it replaced, the head options and the reasons
    already warned about."""

    def __init__(self, module: ModuleType, drafts: Dict[str, ModuleType],
                 version: str, overrides: Dict[str, Override]) -> None:
        self.module = module
        self.drafts = drafts
        self.version = version
        self.domino_cls: Any = module.OnlineDominoModel
        # (class, method name) -> SpecForge's function.
        self.originals: Dict[Tuple[Any, str], Any] = {
            (getattr(module, cls), name): vars(getattr(module, cls))[name]
            for cls, name in _REPLACED}
        self.original_dpace_weight: Any = vars(
            module.OnlineDFlashModel)["_dpace_weight"]
        self.original_reduce: Callable[..., Tuple[torch.Tensor, ...]] = (
            module.checkpointed_chunk_reduce)
        self.original_domino_forward: Any = vars(self.domino_cls)["forward"]
        self.domino_forward_signature = inspect.signature(
            self.original_domino_forward)
        # None in main (its Domino draft computes the correction).
        self.original_apply_domino_head: Any = vars(
            self.domino_cls).get("_apply_domino_head")
        self.overrides = overrides
        self.warned: Set[str] = set()


_lock = threading.Lock()
_patch: Optional[_Patch] = None
# The latest apply(), kept after revert() for calls through old references.
_last: Optional[_Patch] = None
# A frozen float32 CPU weight's layout per lm_head module, and what it was
# made from (as FusedHead keeps one).
_Layout = Tuple[Any, _core.PreparedProjection]
_layouts: "weakref.WeakKeyDictionary[torch.nn.Module, _Layout]" = (
    weakref.WeakKeyDictionary())
# The lambda_base of the OnlineDominoModel.forward running in this context.
_domino_lambda: "contextvars.ContextVar[Optional[float]]" = (
    contextvars.ContextVar("dflash_specforge_domino_lambda", default=None))


def _installed_version() -> str:
    try:
        from importlib import metadata
        return metadata.version("specforge")
    except Exception:  # No metadata (a source tree on sys.path).
        return "unknown"


def _seam_function(module: ModuleType, drafts: Dict[str, ModuleType],
                   key: str) -> Any:
    """The function a seam key names, or None."""
    parts = key.split(".")
    owner: Any = module
    if parts[0] in _DRAFT_MODULES:
        owner = drafts.get(parts[0])
        parts = parts[1:]
    for part in parts[:-1]:
        owner = getattr(owner, part, None)
    if owner is None:
        return None
    found = (vars(owner).get(parts[-1]) if isinstance(owner, type)
             else getattr(owner, parts[-1], None))
    return found.fget if isinstance(found, property) else found


def _fingerprint(module: ModuleType,
                 drafts: Dict[str, ModuleType]) -> Dict[str, str]:
    prints = {}
    for name in sorted({key for seam in _SEAMS.values() for key in seam}):
        function = _seam_function(module, drafts, name)
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
        drafts: Dict[str, ModuleType] = {}
        for short, name in _DRAFT_MODULES.items():
            try:
                drafts[short] = importlib.import_module(name)
            except ImportError:
                pass  # Its seam keys then differ: refused below.
        installed = _installed_version()
        prints = _fingerprint(module, drafts)
        # A version's seam is its own keys (main keys no draft function).
        known = [version for version, seam in _SEAMS.items()
                 if all(prints[name] == value
                        for name, value in seam.items())]
        if not known:
            # Named against the nearest known version.
            nearest = min(_SEAMS, key=lambda version: sum(
                prints[name] != value
                for name, value in _SEAMS[version].items()))
            differing = sorted(
                name for name, value in _SEAMS[nearest].items()
                if prints[name] != value)
            raise SpecForgeVersionError(
                f"dflash.specforge.apply: the installed SpecForge "
                f"({installed}) is not a version whose seam dflash knows "
                f"(known: {', '.join(SUPPORTED_VERSIONS)}): "
                f"{', '.join(differing)} (in {_MODULE} or the draft modules "
                f"{', '.join(sorted(_DRAFT_MODULES.values()))}) differ from "
                f"the nearest known version's ({nearest}; SpecForge main is "
                f"known at commit {MAIN_COMMIT}), or are already patched by "
                "something else; nothing was patched")
        patch = _Patch(module, drafts, known[0], overrides)
        for (cls, name), _ in patch.originals.items():
            setattr(cls, name, _REPLACEMENTS[name])
        setattr(patch.domino_cls, "forward", _domino_forward)
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
        for (cls, name), original in patch.originals.items():
            if cls.__dict__.get(name) is _REPLACEMENTS[name]:
                setattr(cls, name, original)
        if patch.domino_cls.__dict__.get("forward") is _domino_forward:
            setattr(patch.domino_cls, "forward",
                    patch.original_domino_forward)
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
                   block_size: int,
                   counts_ignored: bool = False) -> Optional[_Fallback]:
    """Why the head cannot take these tensors as SpecForge passes them, or
    None. counts_ignored: the call runs with SpecForge's treatment of -100
    targets (loss.cross_entropy.ignored_target_weight COUNT)."""
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
    if not counts_ignored and bool((ignored & (weight_mask > 0)).any()):
        return _Fallback(
            "targets:-100",
            "a target of -100 where the weight is positive (SpecForge "
            "0.2.0's DSpark and Domino models label from input_ids, which "
            "never holds -100, and their Markov and embedding corrections "
            "fail on it; the patch runs such a batch through SpecForge)")
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


def _decayed(model: Any, hidden: torch.Tensor, weight_mask: torch.Tensor
             ) -> Union[torch.Tensor, "_Fallback"]:
    """DFlash's weights with SpecForge's loss decay: weight_mask itself
    without one, else weight_mask times the decay (SpecForge computes it in
    float32; dflash takes it in the mask, so the weights are SpecForge's to
    the bit), or the fallback where a decay weight underflows to 0."""
    gamma = model.loss_decay_gamma
    if gamma is None or gamma <= 0:
        return weight_mask
    positions = torch.arange(model.block_size,
                             device=hidden.device).view(1, 1, -1)
    decay = torch.exp(-(positions - 1).clamp(min=0).float() / gamma)
    if bool((decay == 0).any()):
        return _Fallback(
            "decay",
            f"loss_decay_gamma={gamma!r} underflows a decay weight to 0 "
            "(dflash skips rows without weight; SpecForge still counts "
            "their accuracy)")
    return weight_mask * decay


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
    reason = _common_reason(model, hidden, target_ids, weight_mask,
                            counts_ignored=True)
    if reason is not None:
        return reason

    # SpecForge's cross-entropy gives a -100 target loss 0 and its weight
    # still counts (q = 1 in D-PACE): COUNT, where the default drops it.
    counted = "cross_entropy { ignored_target_weight: COUNT }"
    decayed = False
    if loss_type == "dflash":
        config = f"loss {{ dflash {{ }} {counted} }}"
        loss_weights = _decayed(model, hidden, weight_mask)
        if isinstance(loss_weights, _Fallback):
            return loss_weights
        decayed = loss_weights is not weight_mask
        loss_den: Optional[torch.Tensor] = loss_weights.sum()
        mask = loss_weights
    else:
        alpha = float(model.dpace_alpha)
        config = (f"loss {{ dpace {{ alpha: {alpha!r} variant: "
                  f"{_DPACE_VARIANTS[loss_type]} }} {counted} }}")
        loss_den = None
        mask = weight_mask
    num_dtype = torch.promote_types(hidden.dtype, mask.dtype)

    try:
        terms = _head_call(patch, hidden, head, target_ids, mask, config,
                           chunk_blocks, return_rows=decayed)
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


_LK_TYPES = (None, "alpha", "lambda", "tv")


def _run_main(patch: _Patch, model: Any, hidden: torch.Tensor,
              target_ids: torch.Tensor, weight_mask: torch.Tensor,
              scale: Optional[torch.Tensor], fused_head: bool,
              chunk_blocks: int
              ) -> Union[Tuple[torch.Tensor, ...], _Fallback]:
    """SpecForge main's eleven DFlash chunk terms over `hidden` from one
    head call: ce_loss_num and tv_loss_num each differentiable (main
    composes its LK objective from them after the reduction), or a
    _Fallback."""
    if fused_head:
        return _Fallback(
            "main:fused_head",
            "fused_head=True (SpecForge main's own Triton DFlash2 head, whose "
            "inputs omit block slot 0)")
    if getattr(model.draft_model, "candidate_selector", None) is not None:
        return _Fallback(
            "main:selector",
            "a DFlash2 draft (candidate_selector): its "
            "transform_unary_logits and selector terms are SpecForge's")
    loss_type = getattr(model, "loss_type", None)
    lk = getattr(model, "lk_loss_type", None)
    if (loss_type != "dflash" and loss_type not in _DPACE_VARIANTS) or (
            lk not in _LK_TYPES):
        return _Fallback(
            f"loss_type:{loss_type}:{lk}",
            f"loss_type={loss_type!r} with lk_loss_type={lk!r}, which "
            f"dflash.specforge does not know for SpecForge {patch.version}")
    if (loss_type != "dflash" and type(model)._dpace_weight
            is not patch.original_dpace_weight):
        return _Fallback(
            "dpace_weight", f"{type(model).__name__} overrides _dpace_weight")
    reason = _common_reason(model, hidden, target_ids, weight_mask,
                            counts_ignored=True)
    if reason is not None:
        return reason

    counted = "cross_entropy { ignored_target_weight: COUNT }"
    decayed = False
    mask = weight_mask
    loss_den: Optional[torch.Tensor] = None
    if loss_type == "dflash":
        loss = "dflash {{ {lk} }}"
        decayed_mask = _decayed(model, hidden, weight_mask)
        if isinstance(decayed_mask, _Fallback):
            return decayed_mask
        mask = decayed_mask
        decayed = mask is not weight_mask
        loss_den = mask.sum()
    else:
        # The head balances each sequence (a row of N blocks) by its own
        # anchor count: the scale must be this chunk's own, as it is for
        # the whole batch forward passes.
        if (not isinstance(scale, torch.Tensor)
                or scale.dtype != weight_mask.dtype
                or scale.shape != weight_mask.shape[:2] + (1,)
                or not torch.equal(scale,
                                   model._sequence_anchor_scale(weight_mask))):
            return _Fallback(
                "main:sequence_anchor_scale",
                "a sequence_anchor_scale that is not 1 / the anchor count "
                "of this call's own sequences (a chunk of longer ones, or "
                "none: SpecForge raises)")
        loss = (f"dpace {{{{ alpha: {float(model.dpace_alpha)!r} variant: "
                f"{_DPACE_VARIANTS[loss_type]} {{lk}} "
                "denominator: SEQUENCE_BALANCED }}")
    num_dtype = torch.promote_types(hidden.dtype, mask.dtype)
    # The numerators main differentiates, with the weights its
    # composition most likely gives them (LK lambda's CE weight is the
    # batch's, known after the call: backward runs the head again).
    if lk in (None, "alpha"):
        parts: List[Tuple[str, float]] = [("ce", 1.0)]
    elif lk == "tv":
        parts = [("ce", 0.0), ("tv", 1.0)]
    else:
        parts = [("ce", 0.5), ("tv", 0.5)]

    def run(coefficients: Sequence[float],
            inputs: Sequence[Optional[torch.Tensor]]) -> Tuple[
                torch.Tensor, List[Any], Any]:
        total = float(sum(coefficients))
        if len(parts) == 1:
            composition = ""
        elif coefficients[0] == 0:
            composition = "lk { type: TV }"
        else:
            # c_ce * ce + c_tv * tv as total * (w * ce + (1 - w) * tv);
            # the head takes it with a frozen lm_head only.
            composition = (f"lk {{ type: LAMBDA kl_scale: "
                           f"{coefficients[0] / total!r} kl_decay: 0 }}")
        config = (f"loss {{ {loss.format(lk=composition)} {counted} }}")
        h = inputs[0]
        assert h is not None
        terms = _head_call(patch, h, model.lm_head, target_ids, mask,
                           config, chunk_blocks,
                           return_rows=decayed)
        values = [terms.diagnostics.ce_loss_num,
                  terms.diagnostics.tv_loss_num][:len(parts)]
        return terms.loss_num * total, values, terms

    try:
        numerators, terms = separate_numerators(
            run, [c for _, c in parts], [hidden], [num_dtype] * len(parts))
    except ValueError as error:
        return _Fallback("refused", f"dflash refused the batch ({error})")
    ce_num = numerators[0]
    tv_num = numerators[1] if len(parts) > 1 else ce_num.new_zeros(())
    if loss_den is None:
        loss_den = terms.loss_den.to(weight_mask.dtype)
    probability_num = terms.diagnostics.target_probability_num
    if decayed:
        # The head's counts are over the decayed mask; SpecForge's over
        # weight_mask: from the rows.
        argmax, neg_log_q = terms.diagnostics.argmax, terms.diagnostics.neg_log_q
        assert argmax is not None and neg_log_q is not None
        correct_num = ((argmax == target_ids) & (weight_mask > 0.5)).sum()
        weighted = weight_mask > 0
        probability_num = torch.where(
            weighted, torch.exp(-neg_log_q) * weight_mask.double(),
            torch.zeros((), dtype=torch.float64, device=hidden.device)).sum()
    else:
        correct_num = terms.correct_num
    zero = ce_num.new_zeros(())
    values = (ce_num, tv_num, loss_den, probability_num.to(num_dtype),
              correct_num.detach().float(), weight_mask.sum(),
              zero, zero, zero, zero, zero)
    made = getattr(patch.module, "DFlashObjectiveTerms", None)
    return values if made is None else made(*values)


class _Deferred:
    """`target` seen through its class's own methods (SpecForge's code runs
    on this object, `self` bound to it), with the attributes in `replaced`
    standing in for the target's. The patch computes a logits correction's
    inputs z this way: SpecForge's apply_logits_head with its last
    projection (z -> z @ M^T over the vocabulary) replaced by the identity
    and zero base logits of width r, so nothing [.., V] is made."""

    def __init__(self, target: Any, **replaced: Any) -> None:
        self.__dict__["_target"] = target
        self.__dict__["_replaced"] = replaced

    def __getattr__(self, name: str) -> Any:
        replaced = self.__dict__["_replaced"]
        if name in replaced:
            return replaced[name]
        target = self.__dict__["_target"]
        attribute = inspect.getattr_static(type(target), name, None)
        if isinstance(attribute, FunctionType):
            return attribute.__get__(self)
        return getattr(target, name)


def _plain_linear(module: object, bias: bool) -> bool:
    """A torch.nn.Linear computed as x @ W^T (+ b), with or without a
    bias as `bias` says, and no hooks."""
    return (type(module) is torch.nn.Linear
            and (getattr(module, "bias", None) is not None) == bias
            and _head_reason(module) is None)


def _confidence_dtypes(hidden: torch.dtype) -> Tuple[torch.dtype, ...]:
    """The confidence logits' dtypes the head takes beside hidden of
    dtype `hidden`."""
    if hidden == torch.float64:
        return (torch.float32, torch.float64)
    return (torch.float32,)


def _upcast(dtype: torch.dtype) -> torch.dtype:
    """What SpecForge's `.float()` makes of a tensor of `dtype`."""
    return torch.empty((), dtype=dtype).float().dtype


def _decay(block_size: int, gamma: Optional[float], start: int,
           device: torch.device) -> torch.Tensor:
    """The head's decay exp(-max(k - start, 0) / gamma) per block position,
    float64 ([K], ones without a gamma)."""
    positions = torch.arange(block_size, device=device, dtype=torch.float64)
    if gamma is None or not gamma > 0:
        return torch.ones_like(positions)
    return torch.exp(-(positions - start).clamp(min=0) / float(gamma))


def _correction(hidden: torch.Tensor, projection: Any) -> Optional[_Fallback]:
    """Why the correction's weight M (projection.weight) cannot go to the
    head beside `hidden`, or None."""
    if not _plain_linear(projection, bias=False):
        return _Fallback(
            "correction:projection",
            f"the draft's last logits projection is a "
            f"{type(projection).__name__} (the head adds z @ M^T from a "
            "plain bias-free torch.nn.Linear without hooks)")
    weight = projection.weight
    if (not _plain_tensor(weight) or weight.dtype != hidden.dtype
            or weight.device != hidden.device or not weight.is_contiguous()):
        return _Fallback(
            "correction:weight",
            f"the draft's correction weight is {weight.dtype} on "
            f"{weight.device} (the head takes hidden's {hidden.dtype} on "
            f"{hidden.device}, contiguous)")
    return None


def _z_reason(z: object, hidden: torch.Tensor,
              rank: int) -> Optional[_Fallback]:
    if (not isinstance(z, torch.Tensor) or not _plain_tensor(z)
            or z.dtype != hidden.dtype or z.device != hidden.device
            or tuple(z.shape) != tuple(hidden.shape[:3]) + (rank,)):
        return _Fallback(
            "correction:inputs",
            "the correction's inputs z are not a tensor of hidden's dtype "
            f"and shape [B, N, K, {rank}]")
    return None


def _common_reason(model: Any, hidden: torch.Tensor,
                   target_ids: torch.Tensor, mask: torch.Tensor,
                   counts_ignored: bool = False) -> Optional[_Fallback]:
    head = model.lm_head
    reason = _head_reason(head)
    if reason is None:
        reason = _tensor_reason(head, hidden, target_ids, mask,
                                int(model.block_size), counts_ignored)
    return reason


def _head_call(patch: _Patch, hidden: torch.Tensor, head: torch.nn.Linear,
               target_ids: torch.Tensor, mask: torch.Tensor, config: str,
               chunk_blocks: int, **kwargs: Any) -> Any:
    batch, blocks = hidden.shape[:2]
    resolved = objective_config(
        config, chunk_blocks=batch * (chunk_blocks or blocks),
        **patch.overrides)
    return dflash_objective(
        hidden, head.weight, target_ids, mask, config=resolved,
        lm_head_bias=head.bias, prepared_projection=_prepared(head),
        **kwargs)


def _dspark_z(patch: _Patch, draft: Any, hidden: torch.Tensor,
              prev_token_ids: torch.Tensor) -> Union[
                  None, Tuple[torch.Tensor, torch.Tensor], _Fallback]:
    """The Markov correction (z, M) of a DSpark draft, None without one."""
    dspark, dflash = patch.drafts["dspark"], patch.drafts["dflash"]
    apply_head = getattr(type(draft), "apply_logits_head", None)
    if "apply_logits_head" in vars(draft):
        apply_head = None
    if apply_head is dflash.DFlashDraftModel.apply_logits_head:
        return None
    if apply_head is not dspark.DSparkDraftModel.apply_logits_head:
        return _Fallback(
            f"dspark:head:{type(draft).__name__}",
            f"the draft's apply_logits_head ({type(draft).__qualname__}) "
            "is not SpecForge's DSpark or DFlash one (dflash adds a "
            "low-rank correction z @ M^T to the logits, nothing else)")
    markov = getattr(draft, "markov_head", None)
    if markov is None:
        return None
    kinds = (dspark.VanillaMarkovHead, dspark.GatedMarkovHead,
             dspark.RNNMarkovHead)
    if type(markov) not in kinds or any(
            name in vars(markov) for name in (
                "apply_block_logits", "compute_step_bias", "project_bias",
                "get_prev_embeddings", "compute_gate", "_rnn_step")):
        return _Fallback(
            f"dspark:markov:{type(markov).__name__}",
            f"the draft's Markov head is a {type(markov).__qualname__}, not "
            "SpecForge's vanilla, gated or rnn head")
    projection: Any = getattr(markov, "markov_w2", None)
    reason = _correction(hidden, projection)
    if reason is not None:
        return reason
    rank = int(projection.weight.shape[1])
    z = _Deferred(draft, markov_head=_Deferred(
        markov, project_bias=lambda latent: latent)).apply_logits_head(
            hidden.new_zeros(tuple(hidden.shape[:3]) + (rank,)),
            prev_token_ids=prev_token_ids, hidden_states=hidden)
    reason = _z_reason(z, hidden, rank)
    if reason is not None:
        return reason
    return z.contiguous(), projection.weight


def _dspark_run(patch: _Patch, model: Any, hidden: torch.Tensor,
                prev_token_ids: torch.Tensor, target_ids: torch.Tensor,
                loss_weights: torch.Tensor, eval_mask: torch.Tensor,
                teacher: Optional[torch.Tensor], chunk_blocks: int
                ) -> Union[Tuple[torch.Tensor, ...], _Fallback]:
    """SpecForge's 14 DSpark chunk terms over `hidden` from one head call,
    or a _Fallback."""
    if getattr(model, "loss_type", None) != "dspark":
        return _Fallback(
            f"dspark:loss_type:{model.loss_type}",
            f"OnlineDSparkModel with loss_type={model.loss_type!r}, which "
            f"dflash.specforge does not know for SpecForge {patch.version}")
    reason = _common_reason(model, hidden, target_ids, loss_weights)
    if reason is not None:
        return reason
    if (not isinstance(eval_mask, torch.Tensor)
            or eval_mask.dtype != torch.bool
            or eval_mask.shape != target_ids.shape):
        return _Fallback("dspark:eval_mask",
                         "an eval_mask that is not bool [B, N, K]")
    if teacher is not None and (
            not _plain_tensor(teacher) or teacher.dtype != hidden.dtype
            or teacher.shape != hidden.shape
            or teacher.device != hidden.device):
        return _Fallback(
            "dspark:teacher",
            "a teacher state (target_last_hidden_states aligned) of another "
            "dtype, shape or device than the draft's states")
    # The head weighs row r by mask_r * decay_k: mask = loss_weights /
    # decay, so that the weights are SpecForge's (float32) ones, while the
    # mask stays eval_mask times a per-position factor close to 1, which
    # the eval-mask terms divide out.
    gamma = model.loss_decay_gamma
    decay = _decay(int(model.block_size), gamma, 0, hidden.device)
    mask = torch.where(eval_mask, loss_weights.double() / decay,
                       torch.zeros((), dtype=torch.float64,
                                   device=hidden.device))
    factor = mask.amax(dim=(0, 1))
    if (bool(((loss_weights > 0) != eval_mask).any())
            or not torch.equal(mask, eval_mask * factor)
            or bool(((mask > 0.5) != eval_mask).any())):
        return _Fallback(
            "dspark:weights",
            "loss weights that are not a per-position weight of eval_mask "
            "close to its decay (a decay that underflows to 0, or a "
            "subclass's own _dspark_loss_weight_mask)")
    draft = model.draft_model
    correction = _dspark_z(patch, draft, hidden, prev_token_ids)
    if isinstance(correction, _Fallback):
        return correction
    z, m = correction if correction is not None else (None, None)

    ce_alpha = float(model.dspark_ce_loss_alpha)
    l1_alpha = float(model.dspark_l1_loss_alpha)
    confidence_alpha = float(model.dspark_confidence_head_alpha)
    has_l1 = teacher is not None and l1_alpha > 0
    confidence: Optional[torch.Tensor] = None
    if confidence_alpha > 0:
        confidence = draft.predict_confidence(
            hidden, prev_token_ids=prev_token_ids)
    if confidence is not None:
        if teacher is None:
            return _Fallback(
                "dspark:confidence:teacher",
                "confidence logits without target_last_hidden_states "
                "(SpecForge raises)")
        if (not isinstance(confidence, torch.Tensor)
                or confidence.dtype not in _confidence_dtypes(hidden.dtype)
                or confidence.shape != target_ids.shape
                or confidence.device != hidden.device):
            return _Fallback(
                "dspark:confidence",
                "confidence logits that are not [B, N, K] on hidden's "
                "device in float32 (or float64 beside float64 hidden: "
                "dflash's head takes float32 confidence logits, float64 "
                "ones in a float64 run)")
        confidence = confidence.contiguous()
    # The numerators SpecForge makes differentiable, in its order.
    parts = [("ce", ce_alpha)]
    if has_l1:
        parts.append(("l1", l1_alpha))
    if confidence is not None:
        parts.append(("confidence", confidence_alpha))

    gamma_text = f"gamma: {float(gamma)!r} " if gamma and gamma > 0 else ""

    def run(coefficients: Sequence[float],
            inputs: Sequence[Optional[torch.Tensor]]) -> Tuple[
                torch.Tensor, List[Any], Any]:
        weights = dict(zip((name for name, _ in parts), coefficients))
        config = (
            f"loss {{ dspark {{ {gamma_text}ce_weight: "
            f"{weights['ce']!r} l1_weight: {weights.get('l1', 0.0)!r} "
            f"confidence_weight: {weights.get('confidence', 0.0)!r} }} }}")
        h, confidence_logits, z_in, m_in = inputs
        assert h is not None
        if not weights.get("confidence", 0.0) > 0:
            # The head takes confidence logits only for a confidence term
            # (a backward run may weigh it 0).
            confidence_logits = None
        terms = _head_call(
            patch, h, model.lm_head, target_ids, mask, config, chunk_blocks,
            teacher_hidden=None if teacher is None else teacher.detach(),
            confidence_logits=confidence_logits, correction_inputs=z_in,
            correction_weight=m_in)
        family = terms.diagnostics.family_terms
        # CE stays on the device (its tensor); the others are the report's
        # floats, already on the host.
        values = {"ce": terms.diagnostics.ce_loss_num,
                  "l1": family["l1_loss_num"],
                  "confidence": family["confidence_loss_num"]}
        return terms.loss_num, [values[name] for name, _ in parts], terms

    hd, weights_dtype = hidden.dtype, loss_weights.dtype
    up = _upcast(hd)
    ce_dtype = torch.promote_types(hd, weights_dtype)
    confidence_dtype = torch.promote_types(
        torch.promote_types(up, torch.float32), weights_dtype)
    dtypes = {"ce": ce_dtype,
              "l1": torch.promote_types(up, weights_dtype),
              "confidence": confidence_dtype}
    try:
        numerators, terms = separate_numerators(
            run, [alpha for _, alpha in parts], [hidden, confidence, z, m],
            [dtypes[name] for name, _ in parts])
    except ValueError as error:
        return _Fallback("refused", f"dflash refused the batch ({error})")

    device = hidden.device
    made = dict(zip((name for name, _ in parts), numerators))
    zero = torch.zeros((), dtype=ce_dtype, device=device)
    diagnostics = terms.diagnostics
    family = diagnostics.family_terms
    metrics = diagnostics.metrics
    counts = eval_mask.float()
    # The eval-mask sums per position, the head's mask's factor divided out.
    scale = torch.where(factor > 0, 1 / factor, torch.zeros_like(factor))

    def per_position(values: Any) -> torch.Tensor:
        return torch.as_tensor(values, dtype=torch.float64,
                               device=device) * scale

    def scalar(value: Any, dtype: torch.dtype) -> torch.Tensor:
        # Filled in on the device: no blocking copy from the host.
        return torch.full((), float(value), dtype=dtype, device=device)

    correct_position = diagnostics.position_correct.to(
        device=device, dtype=counts.dtype)
    confidence_error = (
        scalar(family["confidence_abs_error_num"], confidence_dtype)
        if confidence is not None else zero)
    teacher_terms = [zero] * 5
    if teacher is not None:
        agreement = per_position(
            metrics["teacher_agreement_per_position"]).sum().round()
        top1_dtype = torch.promote_types(up, counts.dtype)
        teacher_terms = [
            agreement.to(counts.dtype),
            scalar(family["teacher_top1_num"], top1_dtype),
            scalar(family["draft_top1_num"], top1_dtype),
            scalar(metrics["teacher_expected_accepted_length_num"],
                   top1_dtype),
            scalar(metrics["block_den"], counts.dtype)]
    return (
        made["ce"],
        made.get("l1", zero),
        made.get("confidence", zero),
        confidence_error,
        correct_position.sum(),
        counts.sum(),
        per_position(family["ce_position_num"]).to(
            torch.promote_types(hd, torch.bool)),
        correct_position,
        counts.sum(dim=(0, 1)),
        *teacher_terms,
    )


def _domino_z(patch: _Patch, model: Any, hidden: torch.Tensor,
              prev_ids: torch.Tensor, target_ids: torch.Tensor) -> Union[
                  Tuple[torch.Tensor, torch.Tensor, int], _Fallback]:
    """Domino's correction (z, M) and its suffix_start."""
    domino = patch.drafts["domino"]
    draft = model.draft_model
    if (type(model)._apply_domino_head is not patch.original_apply_domino_head
            or "_apply_domino_head" in vars(model)):
        return _Fallback(
            f"domino:model:{type(model).__name__}",
            f"{type(model).__qualname__} overrides _apply_domino_head")
    if (getattr(type(draft), "apply_logits_head", None)
            is not domino.DominoDraftModel.apply_logits_head
            or "apply_logits_head" in vars(draft)):
        return _Fallback(
            f"domino:head:{type(draft).__name__}",
            f"the draft's apply_logits_head ({type(draft).__qualname__}) "
            "is not SpecForge's Domino one")
    projection: Any = getattr(draft, "embed_proj", None)
    hooks: Any = torch.nn.modules.module
    if (type(projection) is not torch.nn.Sequential or len(projection) != 3
            or projection._forward_hooks or projection._forward_pre_hooks
            or hooks._global_forward_hooks
            or hooks._global_forward_pre_hooks):
        return _Fallback(
            "domino:embed_proj",
            "the draft's embed_proj is not a plain three-module "
            "torch.nn.Sequential")
    reason = _correction(hidden, projection[2])
    if reason is not None:
        return reason
    if bool(draft.shift_label) != bool(model.shift_label):
        return _Fallback(
            "domino:shift_label",
            f"the draft's shift_label ({draft.shift_label}) differs from "
            f"the model's ({model.shift_label})")
    suffix_start = int(draft.suffix_start)
    if not 0 <= suffix_start < hidden.shape[2]:
        return _Fallback(
            "domino:suffix",
            f"suffix_start {suffix_start} leaves no corrected block "
            f"position (block_size {hidden.shape[2]})")
    first, activation = projection[0], projection[1]
    last: Any = projection[2]
    rank = int(last.weight.shape[1])
    z = _Deferred(model, draft_model=_Deferred(
        draft, embed_proj=lambda x: activation(first(x)))
    )._apply_domino_head(
        base_logits4d=hidden.new_zeros(tuple(hidden.shape[:3]) + (rank,)),
        hidden4d=hidden, prev_ids=prev_ids, target_ids=target_ids)
    reason = _z_reason(z, hidden, rank)
    if reason is not None:
        return reason
    return z.contiguous(), last.weight, suffix_start


def _domino_run(patch: _Patch, model: Any, hidden: torch.Tensor,
                prev_ids: torch.Tensor, target_ids: torch.Tensor,
                weight_mask: torch.Tensor, eval_weight_mask: torch.Tensor,
                chunk_blocks: int
                ) -> Union[Tuple[torch.Tensor, ...], _Fallback]:
    """SpecForge's nine Domino chunk terms over `hidden` from one head
    call, or a _Fallback."""
    reason = _common_reason(model, hidden, target_ids, weight_mask)
    if reason is not None:
        return reason
    if (not _plain_tensor(eval_weight_mask)
            or eval_weight_mask.shape != target_ids.shape
            or eval_weight_mask.dtype not in (torch.float32, torch.float64)
            or eval_weight_mask.device != hidden.device):
        return _Fallback("domino:eval_mask",
                         "an eval_weight_mask that is not float32/float64 "
                         "[B, N, K] on hidden's device")
    shift = bool(model.shift_label)
    gamma = model.loss_decay_gamma
    decay = _decay(int(model.block_size), gamma, 0 if shift else 1,
                   hidden.device)
    # The head weighs row r by mask_r * decay_k: mask = weight_mask / decay
    # gives SpecForge's weights; its thresholds (> 0: accepted lengths;
    # > 0.5: accuracy) must be eval_weight_mask's.
    mask = weight_mask.double() / decay
    evaluated = eval_weight_mask
    # And as the head takes them: a float64 run keeps them, any other
    # rounds them to float32.
    taken = mask if hidden.dtype == torch.float64 else mask.float()
    if any(bool(((m > bound) != (evaluated > bound)).any())
           for m in (mask, taken) for bound in (0.0, 0.5)):
        return _Fallback(
            "domino:weights",
            "loss weights that cross 0 or 0.5 elsewhere than "
            "eval_weight_mask (a decay that underflows to 0, or a weight "
            "at 0.5 that the decay's rounding moves)")
    correction = _domino_z(patch, model, hidden, prev_ids, target_ids)
    if isinstance(correction, _Fallback):
        return correction
    z, m, suffix_start = correction
    prefix = suffix_start - (0 if shift else 1)
    gamma_text = f"gamma: {float(gamma)!r} " if gamma and gamma > 0 else ""
    lambda_base = _domino_lambda.get()
    if lambda_base is None or not 0 <= lambda_base <= 1:
        # Outside forward (or a lambda the head does not take): backward
        # recomputes what forward's mixture needs.
        lambda_base = 0.0

    def run(coefficients: Sequence[float],
            inputs: Sequence[Optional[torch.Tensor]]) -> Tuple[
                torch.Tensor, List[Any], Any]:
        total = coefficients[0] + coefficients[1]
        config = (
            f"loss {{ domino {{ {gamma_text}shift_label: "
            f"{'true' if shift else 'false'} pure_draft_prefix_len: "
            f"{prefix} lambda_base: {coefficients[1] / total!r} }} }}")
        h, z_in, m_in = inputs
        assert h is not None
        terms = _head_call(patch, h, model.lm_head, target_ids, mask,
                           config, chunk_blocks, correction_inputs=z_in,
                           correction_weight=m_in)
        return (terms.loss_num * total,
                [terms.diagnostics.ce_loss_num,
                 terms.diagnostics.family_terms["base_num"]], terms)

    num_dtype = torch.promote_types(hidden.dtype, weight_mask.dtype)
    try:
        (final_num, base_num), terms = separate_numerators(
            run, [1 - lambda_base, lambda_base], [hidden, z, m],
            [num_dtype, num_dtype])
    except ValueError as error:
        return _Fallback("refused", f"dflash refused the batch ({error})")
    device = hidden.device
    family = terms.diagnostics.family_terms

    def count(value: Any) -> torch.Tensor:
        # Filled in on the device: no blocking copy from the host.
        return torch.full((), float(value), dtype=torch.float32,
                          device=device)

    return (final_num, base_num, weight_mask.sum(),
            terms.correct_num.detach().float(),
            count(family["base_correct_num"]),
            eval_weight_mask.sum(), count(family["accept_num"]),
            count(family["base_accept_num"]), count(family["accept_den"]))


def _chunk_terms(self: Any, hidden: torch.Tensor, *args: Any,
                 **kwargs: Any) -> Tuple[torch.Tensor, ...]:
    """OnlineDFlashModel._dflash_objective_chunk_terms through dflash's
    fused head: 0.2.0's (loss_num, loss_den, correct_num, accuracy_den), or
    main's eleven DFlashObjectiveTerms, as SpecForge's."""
    return _through_head(self, "_dflash_objective_chunk_terms",
                         (hidden, *args), kwargs)


def _dspark_chunk_terms(self: Any, hidden: torch.Tensor, *args: Any,
                        **kwargs: Any) -> Tuple[torch.Tensor, ...]:
    """OnlineDSparkModel._dspark_objective_chunk_terms through dflash's
    fused head (0.2.0): SpecForge's 14 terms, the CE, L1 and confidence
    numerators each differentiable (dflash.torch.separate_numerators)."""
    return _through_head(self, "_dspark_objective_chunk_terms",
                         (hidden, *args), kwargs)


def _domino_chunk_terms(self: Any, hidden: torch.Tensor, *args: Any,
                        **kwargs: Any) -> Tuple[torch.Tensor, ...]:
    """OnlineDominoModel._domino_objective_chunk_terms through dflash's
    fused head (0.2.0): SpecForge's nine terms, the final and base
    numerators each differentiable (dflash.torch.separate_numerators)."""
    return _through_head(self, "_domino_objective_chunk_terms",
                         (hidden, *args), kwargs)


_REPLACEMENTS: Dict[str, Callable[..., Tuple[torch.Tensor, ...]]] = {
    "_dflash_objective_chunk_terms": _chunk_terms,
    "_dspark_objective_chunk_terms": _dspark_chunk_terms,
    "_domino_objective_chunk_terms": _domino_chunk_terms,
}
_BY_REPLACEMENT = {function: name for name, function in _REPLACEMENTS.items()}


def _run_any(patch: _Patch, model: Any, name: str, args: Sequence[Any],
             kwargs: Dict[str, Any], chunk_blocks: int
             ) -> Union[Tuple[torch.Tensor, ...], _Fallback]:
    """The chunk terms of SpecForge's `name` called with args and kwargs,
    or a _Fallback (a call SpecForge's function refuses falls back, so
    that SpecForge raises its own error)."""
    try:
        bound = inspect.signature(_original(patch, model, name)).bind(
            model, *args, **kwargs)
    except TypeError:
        return _Fallback(f"call:{name}",
                         f"a call of {name} with arguments SpecForge's "
                         "function does not take")
    bound.apply_defaults()
    a = bound.arguments
    if patch.version == _MAIN:
        if name == "_dflash_objective_chunk_terms":
            return _run_main(patch, model, a["hidden"], a["target_ids"],
                             a["weight_mask"], a["sequence_anchor_scale"],
                             bool(a["fused_head"]), chunk_blocks)
        family = "DSpark" if "dspark" in name else "Domino"
        return _Fallback(
            f"main:{name}",
            f"SpecForge main's {family} objective: its draft modules' "
            "logits corrections are not ones dflash.specforge knows")
    if name == "_dflash_objective_chunk_terms":
        return _run(patch, model, a["hidden"], a["target_ids"],
                    a["weight_mask"], chunk_blocks)
    if name == "_dspark_objective_chunk_terms":
        return _dspark_run(patch, model, a["hidden"], a["prev_token_ids"],
                           a["target_ids"], a["loss_weights"],
                           a["eval_mask"], a["aligned_target_hidden"],
                           chunk_blocks)
    return _domino_run(patch, model, a["hidden"], a["prev_ids"],
                       a["target_ids"], a["weight_mask"],
                       a["eval_weight_mask"], chunk_blocks)


def _original(patch: _Patch, model: Any, name: str) -> Any:
    """SpecForge's chunk function `name` for `model`'s class."""
    for cls in type(model).__mro__:
        original = patch.originals.get((cls, name))
        if original is not None:
            return original
    raise AttributeError(name)  # Only the patched classes get here.


def _through_head(model: Any, name: str, args: Tuple[Any, ...],
                  kwargs: Dict[str, Any]) -> Tuple[torch.Tensor, ...]:
    """A replaced chunk function called directly: one head call over the
    chunk, or SpecForge's function."""
    patch = _patch
    if patch is None:  # Reverted, and called through an old reference.
        assert _last is not None
        patch = _last
    else:
        hidden = args[0]
        blocks = (hidden.shape[1] if isinstance(hidden, torch.Tensor)
                  and hidden.dim() == 4 else 0)
        result = _run_any(patch, model, name, args, kwargs, blocks)
        if not isinstance(result, _Fallback):
            return result
        _warn(patch, result)
    terms: Tuple[torch.Tensor, ...] = _original(patch, model, name)(
        model, *args, **kwargs)
    return terms


def _domino_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
    """OnlineDominoModel.forward, its lambda_base known to the chunk
    terms (the weight the numerators' gradients most likely come with)."""
    patch = _patch or _last
    assert patch is not None
    try:
        bound = patch.domino_forward_signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        value: Any = bound.arguments.get("lambda_base")
        lambda_base: Optional[float] = float(value)
    except (TypeError, ValueError, RuntimeError):
        # SpecForge's forward gives the error; a tensor that cannot be a
        # float gives no hint.
        lambda_base = None
    token = _domino_lambda.set(lambda_base)
    try:
        return patch.original_domino_forward(self, *args, **kwargs)
    finally:
        _domino_lambda.reset(token)


def _chunk_reduce(function: Callable[..., Tuple[torch.Tensor, ...]],
                  *aligned_tensors: Optional[torch.Tensor], chunk_size: int,
                  dim: int = 0, **options: Any) -> Tuple[torch.Tensor, ...]:
    """SpecForge's checkpointed_chunk_reduce; for a patched chunk function
    over a whole batch, one head call chunked inside the head. options:
    the version's other arguments (main's checkpoint), SpecForge's."""
    patch = _patch
    if patch is None:  # Reverted, and called through an old reference.
        assert _last is not None
        return _last.original_reduce(function, *aligned_tensors,
                                     chunk_size=chunk_size, dim=dim,
                                     **options)
    model = getattr(function, "__self__", None)
    method: Any = getattr(function, "__func__", None)
    name = _BY_REPLACEMENT.get(method)
    ours = (name is not None and any(
                isinstance(model, cls) for cls, method in patch.originals
                if method == name)
            and dim == 1 and type(chunk_size) is int and chunk_size >= 0
            and len(aligned_tensors) >= 3
            and isinstance(aligned_tensors[0], torch.Tensor)
            and aligned_tensors[0].dim() == 4
            and aligned_tensors[0].shape[1] > 0)
    if ours:
        blocks = aligned_tensors[0].shape[1]  # type: ignore[union-attr]
        ours = all(t is None or (isinstance(t, torch.Tensor) and t.dim() >= 2
                                 and t.shape[1] == blocks)
                   for t in aligned_tensors)
    if not ours:
        return patch.original_reduce(function, *aligned_tensors,
                                     chunk_size=chunk_size, dim=dim,
                                     **options)
    assert name is not None
    result = _run_any(patch, model, name, aligned_tensors, {}, chunk_size)
    if isinstance(result, _Fallback):
        _warn(patch, result)
        return patch.original_reduce(
            _original(patch, model, name).__get__(model), *aligned_tensors,
            chunk_size=chunk_size, dim=dim, **options)
    return result
