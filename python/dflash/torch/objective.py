"""dflash_objective: SpecForge's DFlash chunk terms from the fused C++ head.

In FUSED mode the head runs forward and backward in one call (the gradient
is computed chunk by chunk in forward, so nothing is recomputed); autograd's
backward then only scales the saved gradients by what flows in. In the
other modes a training call runs the head's forward pass and keeps its
state, whose backward autograd runs (docs/python.md, "Split forward and
backward"). Under
torch.no_grad(), torch.inference_mode() or when no input needs a gradient
the head runs its forward pass alone. With torch >= 2.4 the call is the
operator torch.ops.dflash.objective (_library.py), which torch.compile
traces; torch 1.13 runs _Objective, an autograd.Function.
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import math
import operator
import os
import signal
import threading
import weakref
from typing import (Any, Callable, Dict, Iterator, List, NamedTuple,
                    Optional, Sequence, Set, Tuple, TypedDict, TypeVar, Union,
                    cast)

import torch

from dflash import _core
from dflash.config import ConfigSource, Override, objective_config
from dflash.torch import _library


class HeadStats(TypedDict):
    """The head's run, as `ObjectiveDiagnostics.stats`."""

    mode: str  # The execution mode's name: MATERIALIZE, ..., FUSED.
    chunks: int
    projected_rows: int
    gemm_calls: int
    # GEMM work in units of one projection of the projected rows.
    gemm_passes: float
    segment_recomputes: int
    peak_bytes: int  # The head's own buffers.
    # What a split run (every mode but FUSED, with gradients) holds from its
    # forward to its backward: saved logits, per-row state, a laid-out
    # weight; 0 for a single call.
    saved_bytes: int
    forward_seconds: float
    backward_seconds: float
    # The config's threads, at most the usable CPUs; 1 in a forked child.
    threads: int


class FamilyTerms(TypedDict):
    """SpecForge's DSpark and Domino chunk terms by their names there, as
    `ObjectiveDiagnostics.family_terms` (0 for the other families).

    DSpark's tau_num and tau_den are `metrics`'
    teacher_expected_accepted_length_num and block_den; Domino's final_num
    is `ce_loss_num`.
    """

    l1_loss_num: float
    confidence_loss_num: float
    confidence_abs_error_num: float
    teacher_top1_num: float
    draft_top1_num: float
    dpard_loss_num: float
    ce_position_num: List[float]  # [K]
    dpard_credit_position_num: List[float]  # [K]
    base_num: float
    base_correct_num: float
    accept_num: float
    base_accept_num: float
    accept_den: float


class _ResultsCheck(NamedTuple):
    """A head.device_results call's config (its resolved text) and inputs
    (detached, as the head took them): what the binding reads to explain a
    latched error as the synchronous call would have
    (check_objective_results)."""

    config: str
    hidden: torch.Tensor
    weight: torch.Tensor
    target_ids: torch.Tensor
    weight_mask: torch.Tensor
    bias: Optional[torch.Tensor]
    teacher_hidden: Optional[torch.Tensor]
    confidence_logits: Optional[torch.Tensor]
    correction_inputs: Optional[torch.Tensor]
    correction_weight: Optional[torch.Tensor]


@dataclasses.dataclass(frozen=True)
class ObjectiveDiagnostics:
    """Everything of one batch beyond the core terms: additive numerators to
    sum over micro-batches or ranks and then divide, what the head's run
    did, and the per-row outputs a call asks for.

    Scalar tensors are 0-dim in the terms' dtype (hidden's; float32 for
    bfloat16) on hidden's device, with no gradient, unless said otherwise.

    Fields:
        position_correct: [K] correct_num per block position.
        position_den: [K] accuracy_den per block position.
        target_probability_num: sum of q * weight_mask, q the target's
            probability; over accuracy_den, SpecForge's target_probability.
        ce_loss_num, tv_loss_num: SpecForge's ce_loss_num (sum of w * CE) and
            tv_loss_num (sum of w * (1 - q); 0 unless the LK composition has
            a tv part); loss_num is composed from them.
        lk_kl_weight: with lk_loss_type="lambda", the batch's CE weight kl_w;
            else None. Under torch.compile and with head.device_results a
            0-dim float64 tensor (on hidden's device with device_results),
            NaN where the loss has none.
        metrics: SpecForge's DFlash diagnostics as float64 CPU numerators
            (with head.device_results on hidden's device):
            target_probability_per_position, top_k_recall_per_position and
            top_k_mass_per_position [K] over position_den;
            loss_weight_per_position [K] over its sum;
            expected_accepted_length_num and oracle_accepted_length_num over
            block_den (anchor blocks with a supervised slot). Top-k is the
            config's head.metric_top_k (default 16). With teacher_hidden for
            a loss that reads no teacher (SpecForge's
            target_last_hidden_states, aligned to the rows):
            teacher_acceptance_per_position,
            teacher_agreement_per_position and
            teacher_top_k_mass_per_position [K] over position_den, and
            teacher_expected_accepted_length_num over block_den.
        family_terms: SpecForge's DSpark and Domino terms (FamilyTerms);
            with head.device_results each a float64 tensor on hidden's
            device (0-dim, [K] for the per-position lists).
        stats: the head's run (HeadStats); with head.device_results
            forward_seconds is the time to queue the forward's work.
        neg_log_q: [B, N, K] float64 whatever hidden's dtype (the loss's
            own double), with return_rows; else None.
        argmax: [B, N, K] int64, -1 where a row has no weight, with
            return_rows; else None.
        base_argmax: [B, N, K] int64, domino's base logits' argmax
            (hidden @ W^T + bias, transformed, without the correction:
            SpecForge main's base-head greedy ids, which
            accepted_prefix_lengths and walk_accepted_length_terms take),
            -1 where a row has no weight and for the other families, with
            return_rows; else None.
        teacher_argmax: [B, N, K] int64, the argmax of the teacher's logits
            (teacher_hidden @ W^T + bias, transformed as the draft's: the
            target model's greedy ids, which selector_greedy_terms'
            teacher_ids takes; the draft's argmax agrees with it where
            teacher_agreement_per_position counts), -1 where a row has no
            weight or there is no teacher_hidden, with return_rows; else
            None. Global ids vocab-parallel.
        top_k, top_k_values: with top_k = k, the strict top-k of the loss's
            logits (ties to the lower id; -1 where the row has no mask) as
            ids [B, N, K, k] int64 and values [B, N, K, k] in hidden's dtype
            (float64 computed in float64; bfloat16 rounded once from the
            head's float32; 0 where the id is -1). The values carry a
            gradient (a DFlash2 selector's unary logits), in the same
            precision, to hidden, a trainable weight and bias, and a
            correction's inputs and weight (its z . M[id] is in them).
            Else None.
        target_is_candidate: [B, N, K] bool, whether the target is among
            top_k; target_candidate_index: [B, N, K] int64, where (0 if not).
            With top_k; else None.
        loss_weight: [B, N, K] float64 whatever hidden's dtype, each row's
            loss weight (SpecForge's loss_weights, D-PACE's block weights),
            with return_rows or top_k; else None.
        device_results: with head.device_results (CUDA), the float64
            buffer the head wrote its terms to on hidden's device (laid out
            as dflash._core.device_results_layout(K) says; every term above
            is sliced and cast from it there); else None.
            check_objective_results reads its status words.
        _results_check: internal, beside device_results: the call's config
            and inputs, from which check_objective_results explains a
            latched error.
    """

    position_correct: torch.Tensor
    position_den: torch.Tensor
    target_probability_num: torch.Tensor
    ce_loss_num: torch.Tensor
    tv_loss_num: torch.Tensor
    lk_kl_weight: Union[None, float, torch.Tensor]
    metrics: Dict[str, torch.Tensor]
    family_terms: FamilyTerms
    stats: HeadStats
    neg_log_q: Optional[torch.Tensor] = None
    argmax: Optional[torch.Tensor] = None
    top_k: Optional[torch.Tensor] = None
    top_k_values: Optional[torch.Tensor] = None
    target_is_candidate: Optional[torch.Tensor] = None
    target_candidate_index: Optional[torch.Tensor] = None
    loss_weight: Optional[torch.Tensor] = None
    base_argmax: Optional[torch.Tensor] = None
    teacher_argmax: Optional[torch.Tensor] = None
    device_results: Optional[torch.Tensor] = None
    # What check_objective_results gives the binding beside the buffer.
    _results_check: Optional[_ResultsCheck] = dataclasses.field(
        default=None, repr=False, compare=False)

    @property
    def accuracy_per_position(self) -> torch.Tensor:
        """position_correct / position_den, 0 where a position has no mask."""
        den = self.position_den
        return torch.where(den > 0,
                           self.position_correct / den.clamp_min(1e-30),
                           torch.zeros_like(den))


class ObjectiveTerms(NamedTuple):
    """The core terms of one batch, as SpecForge's chunk terms: the first four
    unpack like `loss_num, loss_den, correct_num, accuracy_den, *_ = terms`.

    The four are 0-dim tensors in hidden's dtype (float32 for bfloat16) on
    hidden's device. Only loss_num is differentiable (with respect to
    hidden, to the weight and bias when they require grad, to dspark's
    confidence logits and to a correction's inputs and weight). Sum them
    over micro-batches or ranks, then divide: `loss_num / loss_den` (with
    loss_den_offset added to the summed loss_den, as `loss` does).

    Fields:
        loss_num: the sum of the rows' weighted losses.
        loss_den: the sum of the loss weights.
        correct_num: rows whose argmax is the target where weight_mask > 0.5.
        accuracy_den: the sum of weight_mask.
        loss_den_offset: what loss_den takes before dividing: 1e-6 for
            domino (SpecForge's additive epsilon), else 0.
        diagnostics: the rest (ObjectiveDiagnostics).
    """

    loss_num: torch.Tensor
    loss_den: torch.Tensor
    correct_num: torch.Tensor
    accuracy_den: torch.Tensor
    loss_den_offset: float
    diagnostics: ObjectiveDiagnostics

    @property
    def loss(self) -> torch.Tensor:
        """loss_num / (loss_den + loss_den_offset), floored as SpecForge
        floors it: an all-masked batch gives 0. D-PARD's loss_num is the loss
        times loss_den (its main part is per sequence)."""
        return self.loss_num / (self.loss_den + self.loss_den_offset).clamp_min(
            torch.finfo(self.loss_den.dtype).tiny)


def _tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{name}: must be a torch.Tensor, got {type(value).__name__}")
    if value.layout != torch.strided:
        raise TypeError(f"{name}: must be a dense (strided) tensor, got "
                        f"{value.layout} (call .to_dense())")
    if _is_compiling():
        # Traced, the tensor is a fake one; the binding checks the real
        # one's memory (meta, negated view) when the operator runs.
        return value
    if value.is_meta:
        raise TypeError(f"{name}: must hold data, got a meta tensor (shape "
                        "and dtype only)")
    if value.is_neg():
        # Its memory holds the values un-negated: read in place, they would
        # be wrong.
        raise TypeError(f"{name}: must not be a lazily negated view (call "
                        ".resolve_neg(), one copy)")
    return value


def _is_bool(value: object) -> bool:
    # Python's and NumPy's (np.bool_, which has __index__).
    return isinstance(value, bool) or type(value).__name__ in ("bool_", "bool")


def _int(name: str, value: Any) -> int:
    """`value` as an int: Python and NumPy integers, not bools or floats."""
    if _is_bool(value):
        raise TypeError(f"{name}: must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: must be an int, got {value!r}") from None


def _empty(name: str, shape: Sequence[int], dtype: torch.dtype,
           device: torch.device) -> torch.Tensor:
    """torch.empty, its failure to allocate a MemoryError naming `name`."""
    try:
        return torch.empty(shape, dtype=dtype, device=device)
    except RuntimeError as error:
        text = str(error).lower()
        if "alloc" not in text and "out of memory" not in text:
            raise
        size = torch.Size(shape).numel() * torch.empty(
            (), dtype=dtype).element_size()
        raise MemoryError(
            f"{name}: cannot allocate {list(shape)} {dtype} ({size} bytes) on "
            f"{device}: out of memory") from error


@functools.lru_cache(maxsize=None)
def _use_torchs_cuda_libraries() -> None:
    """Points the CUDA head at the cuBLAS torch ships (PyPI's torch bundles
    its NVIDIA libraries under site-packages/nvidia/), before the system's
    and the build's toolkit: the one torch itself runs on."""
    site = os.path.dirname(os.path.dirname(torch.__file__))
    _core.set_cuda_library_dirs(
        sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib"))))


def _torch_alloc(nbytes: int, device: int, stream: int) -> int:
    address: int = torch.cuda.caching_allocator_alloc(nbytes, device, stream)
    return address


@functools.lru_cache(maxsize=None)
def _lend_torchs_allocator() -> None:
    """Lends the CUDA head torch's caching allocator: its workspaces are
    torch's memory (torch.cuda.max_memory_allocated counts them) and its
    runs queue on torch's current stream itself."""
    _core.set_torch_allocator(_torch_alloc,
                              torch.cuda.caching_allocator_delete)


def _interruptible() -> bool:
    # Ctrl-C can stop the call where Python raises KeyboardInterrupt for it:
    # its main thread, under the default SIGINT handler.
    return (threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler)


# The ids of exceptions raised where no refusal may be sent (the group
# already stopped together, or a collective of its own failed).
_REFUSED: Set[int] = set()


def _vocab_parallel() -> Any:
    # Imported when a call has a vocab_group: torch.distributed is not
    # needed otherwise.
    from dflash.torch import _vocab_parallel as module
    return module


# The head's gradient buffers, in the order they are saved for backward.
_GRADIENTS = ("grad_hidden", "grad_weight", "grad_bias", "grad_confidence",
              "grad_correction_inputs", "grad_correction_weight")
# What each buffer is, in the caller's words (a MemoryError names it).
_BUFFER_NAMES = {
    "grad_hidden": "the gradient of hidden",
    "grad_weight": "the gradient of lm_head_weight",
    "grad_bias": "the gradient of lm_head_bias",
    "grad_confidence": "the gradient of confidence_logits",
    "grad_correction_inputs": "the gradient of correction_inputs",
    "grad_correction_weight": "the gradient of correction_weight",
}


class _RunInfo:
    """What the head's run reports beside the tensors autograd returns,
    filled in by _Objective.forward."""

    stats: HeadStats
    lk_kl_weight: Union[None, float, torch.Tensor]
    family_terms: FamilyTerms
    loss_den_offset: float
    metrics: Dict[str, torch.Tensor]
    results: Optional[torch.Tensor] = None

    def fill(self, result: Dict[str, Any],
             results: Optional[torch.Tensor] = None) -> None:
        """From a head run's report (run_objective's dict) and, under
        head.device_results, its buffer `results` (the report's terms are
        NaN then: they are taken from the buffer, on the device)."""
        self.stats = result["stats"]
        self.loss_den_offset = result["loss_den_offset"]
        self.results = results
        if results is not None:
            lk, family, self.metrics = _library.device_report(
                results, len(result["correct_per_position"]))
            self.lk_kl_weight = lk
            self.family_terms = cast(FamilyTerms, family)
            return
        self.lk_kl_weight = result["lk_kl_weight"]
        self.family_terms = result["family_terms"]
        self.metrics = {
            name: torch.tensor(value, dtype=torch.float64)
            for name, value in result["diagnostics"].items()}


class _HeadCall(NamedTuple):
    """One run of the head: its report, gradient buffers (None where not
    computed), terms (the nine scalar and [K] tensors) and per-row outputs
    (neg_log_q, argmax, top_k, top_k_values, loss_weight, base_argmax,
    teacher_argmax; None where not asked for)."""

    result: Dict[str, Any]
    grads: Dict[str, Optional[torch.Tensor]]
    terms: List[torch.Tensor]
    extras: List[Optional[torch.Tensor]]
    stream: int
    top_k_ids: Optional[torch.Tensor]  # extras' top_k as the head wrote it.
    # A split forward's state (`split`): its backward gives the gradients,
    # every grads value then None.
    saved: Optional[_core.SavedHead] = None
    # head.device_results: the float64 buffer the head wrote its terms to
    # on hidden's device (the terms are made from it there; `result`'s
    # terms are NaN).
    results: Optional[torch.Tensor] = None


def _run_head(config: _core.ObjectiveConfig, top_k: int, return_rows: bool,
              trainable: bool, gradients: bool, hidden: torch.Tensor,
              weight: torch.Tensor, bias: Optional[torch.Tensor],
              teacher: Optional[torch.Tensor],
              confidence: Optional[torch.Tensor], target_ids: torch.Tensor,
              weight_mask: torch.Tensor,
              correction_inputs: Optional[torch.Tensor],
              correction_weight: Optional[torch.Tensor],
              prepared: Optional[_core.PreparedProjection],
              shard: Optional[Any] = None, summed: bool = True,
              split: bool = False,
              into: Optional[Dict[str, torch.Tensor]] = None) -> _HeadCall:
    """Runs the head once into fresh buffers (target_ids and weight_mask on
    the host, or on a CUDA hidden's device, where the head builds its rows:
    never copied). `gradients` false: the forward pass alone, no gradient
    computed and no gradient buffer (every grads value None). `shard`
    (_vocab_parallel.Shard): this rank's rows of a vocab-parallel head; the
    gradient of hidden and of the correction's inputs (and float64 top-k
    values, computed by their owners) are then summed over its group, unless
    not `summed` (rows="local": _LocalRows reduce-scatters them). `split`
    (_splits): the forward pass alone, its state kept for a backward that
    makes the gradients (no gradient buffer before it). With
    head.device_results and a CUDA hidden the head writes its terms into a
    float64 buffer on hidden's device (`results`) and the terms are sliced
    and cast from it there: nothing is read from the device (a CPU hidden
    is refused by the binding, naming head.device_results). `into`: buffers
    (by _GRADIENTS name) the run writes those gradients into instead of
    fresh ones (the head overwrites them; rows="local" runs the head W
    times into one set)."""
    # The head reads hidden and the per-row tensors beside it as whole
    # rows, one after the other: a view that is not laid out so (a slice of
    # a longer batch along N, as SpecForge's chunks are) is copied here.
    # Targets and masks are read at any strides.
    hidden = hidden.contiguous()
    teacher, confidence, correction_inputs = [
        None if t is None else t.contiguous()
        for t in (teacher, confidence, correction_inputs)]
    rows = tuple(hidden.shape[:3])
    device = hidden.device
    trainable = trainable and gradients
    wanted = {
        "grad_hidden": (hidden.shape, hidden.dtype),
        "grad_weight": (weight.shape, weight.dtype) if trainable else None,
        "grad_bias": ((bias.shape, bias.dtype)
                      if trainable and bias is not None else None),
        "grad_confidence": ((rows, _library.confidence_dtype(hidden.dtype))
                            if confidence is not None else None),
        "grad_correction_inputs": (
            (correction_inputs.shape, correction_inputs.dtype)
            if correction_inputs is not None else None),
        "grad_correction_weight": (
            (correction_weight.shape, correction_weight.dtype)
            if correction_weight is not None else None),
        "neg_log_q": (rows, torch.float64) if return_rows else None,
        "argmax": (rows, torch.int32) if return_rows else None,
        "top_k": (rows + (top_k,), torch.int32) if top_k else None,
        "top_k_values": ((rows + (top_k,), _library.top_k_value_dtype(
                             hidden.dtype)) if top_k else None),
        "loss_weight": ((rows, torch.float64)
                        if return_rows or top_k else None),
        "base_argmax": (rows, torch.int32) if return_rows else None,
        "teacher_argmax": (rows, torch.int32) if return_rows else None,
    }
    if not gradients or split:
        wanted.update(dict.fromkeys(_GRADIENTS))
    reused = into or {}
    made = {name: None if spec is None else reused[name] if name in reused
            else _empty(_BUFFER_NAMES.get(name, name), *spec, device)
            for name, spec in wanted.items()}
    grads = {name: made[name] for name in _GRADIENTS}
    outputs = {name: made[name] for name in made if name not in grads}
    if hidden.is_cuda:
        _use_torchs_cuda_libraries()
        _lend_torchs_allocator()
    stream = (torch.cuda.current_stream(device).cuda_stream
              if hidden.is_cuda else 0)
    results = None
    if (hidden.is_cuda and hidden.dim() == 4
            and _library.device_results_of(config.text)):
        # (A hidden of another shape is the binding's ValueError.)
        results = _empty("the device results",
                         (_library.results_size(hidden.shape[2]),),
                         torch.float64, device)
    saved = None
    if split:
        result, saved = _core.start_objective(
            config, hidden, weight, target_ids, weight_mask, bias, teacher,
            confidence, correction_inputs=correction_inputs,
            correction_weight=correction_weight, prepared=prepared,
            trainable=trainable, interruptible=_interruptible(),
            cuda_stream=stream, device_results=results, **outputs)
    else:
        result = _core.run_objective(
            config, hidden, weight, target_ids, weight_mask, bias, teacher,
            confidence, correction_inputs=correction_inputs,
            correction_weight=correction_weight, prepared=prepared,
            trainable=trainable, cuda_stream=stream,
            # Vocab-parallel, a rank stopping between two exchanges would leave
            # the others waiting in the next: Ctrl-C is taken after the call.
            interruptible=_interruptible() and shard is None,
            forward_only=not gradients,
            vocab_shard=None if shard is None else shard.core,
            device_results=results, **grads, **outputs)
    if shard is not None and summed:
        # The head's gradient of hidden (and z) is this rank's vocabulary's
        # part; float64 top-k values are 0 at the ids other ranks own.
        float64_values = (outputs["top_k_values"]
                          if hidden.dtype == torch.float64 else None)
        _vocab_parallel().sum_over(shard.group, [
            grads["grad_hidden"], grads["grad_correction_inputs"],
            float64_values])

    scalar_dtype = (torch.float32 if hidden.dtype == torch.bfloat16
                    else hidden.dtype)
    k = len(result["correct_per_position"])
    if results is not None:
        # On the device: a float32 overflow is check_objective_results'.
        terms = _library.device_terms(results, k, scalar_dtype)
    else:
        if scalar_dtype == torch.float32:
            _refuse_float32_overflow(result)
        # One host-to-device copy for every scalar term, then a tensor of
        # its own for each (not views of one: a caller may all_reduce one
        # in place).
        values = torch.tensor(
            [result["loss_num"], result["loss_den"], result["correct"],
             result["accuracy_den"], result["target_probability"],
             result["ce_num"], result["tv_num"]]
            + result["correct_per_position"] + result["mask_per_position"],
            dtype=torch.float64)
        values = values.to(device=device, dtype=scalar_dtype)
        terms = [t.clone() for t in (values[0], values[1], values[2],
                                     values[3], values[7:7 + k],
                                     values[7 + k:], values[4], values[5],
                                     values[6])]
    extras = [
        outputs["neg_log_q"],
        None if outputs["argmax"] is None else outputs["argmax"].long(),
        None if outputs["top_k"] is None else outputs["top_k"].long(),
        # In hidden's dtype: bfloat16 rounds the head's float32 once.
        None if outputs["top_k_values"] is None
        else outputs["top_k_values"].to(hidden.dtype),
        outputs["loss_weight"],
        None if outputs["base_argmax"] is None
        else outputs["base_argmax"].long(),
        None if outputs["teacher_argmax"] is None
        else outputs["teacher_argmax"].long(),
    ]
    return _HeadCall(result, grads, terms, extras, stream, outputs["top_k"],
                     saved, results)


def _refuse_float32_overflow(values: Dict[str, Any]) -> None:
    """The ValueError of a float32 run whose loss_num, ce_num or tv_num
    (float64 in `values`, the binding's names) overflows float32."""
    for term in ("loss_num", "ce_num", "tv_num"):
        if abs(values[term]) > torch.finfo(torch.float32).max:
            raise ValueError(
                f"weight_mask: the {term} it weighs, {values[term]:.6g}, "
                "overflows float32 (the terms' dtype); scale weight_mask "
                "down")


# Split forwards' states by their token's value (the tensor that holds each:
# autograd frees it after backward unless the graph is retained); a copy of
# a token names its state while the state lives.
_SAVED: "weakref.WeakValueDictionary[int, _core.SavedHead]" = (
    weakref.WeakValueDictionary())


def _splits(config: _core.ObjectiveConfig, gradients: bool,
            shard: Optional[Any], hidden: torch.Tensor, trainable: bool,
            prepared: bool) -> bool:
    """Whether the run's forward and backward run apart: gradients wanted,
    a mode other than FUSED, not vocab-parallel, and not a frozen float32
    CPU head given no PreparedProjection (`prepared`): that head lays out
    its own copy of the weight (2 x V x H floats), which a split state
    would keep to the backward where a single call frees it before
    returning (docs/python.md, "Split forward and backward")."""
    own_layout = (not hidden.is_cuda and hidden.dtype == torch.float32
                  and not trainable and not prepared)
    return (gradients and shard is None and not own_layout
            and _core.splits_backward(config))


def _token_of(saved: _core.SavedHead) -> torch.Tensor:
    """A tensor holding `saved` alive (its 8-byte buffer, the token)."""
    token = torch.frombuffer(saved, dtype=torch.int64)
    _SAVED[int(token[0])] = saved
    return token


def _saved_backward(token: torch.Tensor,
                    upstream: Union[float, torch.Tensor], trainable: bool,
                    hidden: torch.Tensor, weight: torch.Tensor,
                    bias: Optional[torch.Tensor],
                    confidence: Optional[torch.Tensor],
                    z: Optional[torch.Tensor], m: Optional[torch.Tensor]
                    ) -> Dict[str, Optional[torch.Tensor]]:
    """The split run's gradients of upstream * loss_num / loss_den, into
    fresh buffers (None where the run computes none); on CUDA ordered on
    torch's current stream now. A tensor `upstream` (a head.device_results
    state) is d(objective)/d(loss_num) on hidden's device, read there: the
    head multiplies it by its finished denominator on the device
    (SavedHead.backward_on_device), nothing read back. The forward's stats
    (the state's `stats`, HeadStats, where the caller gave them) get the
    backward's work, as a single run reports both passes."""
    saved = _SAVED.get(int(token[0]))
    if saved is None:
        raise RuntimeError(
            "dflash_objective: the forward's state was freed (a second "
            "backward needs retain_graph=True)")
    specs = {
        "grad_hidden": (hidden.shape, hidden.dtype),
        "grad_weight": (weight.shape, weight.dtype) if trainable else None,
        "grad_bias": ((bias.shape, bias.dtype)
                      if trainable and bias is not None else None),
        "grad_confidence": ((hidden.shape[:3], _library.confidence_dtype(
            hidden.dtype)) if confidence is not None else None),
        "grad_correction_inputs": (z.shape, z.dtype) if z is not None
        else None,
        "grad_correction_weight": (m.shape, m.dtype) if m is not None
        else None,
    }
    grads = {name: None if spec is None else _empty(
                 _BUFFER_NAMES[name], *spec, hidden.device)
             for name, spec in specs.items()}
    stream = (torch.cuda.current_stream(hidden.device).cuda_stream
              if hidden.is_cuda else 0)
    if isinstance(upstream, torch.Tensor):
        # Not read here: a non-finite upstream is the head's to latch on
        # the device (docs/cuda.md, "Results on the device").
        done = saved.backward_on_device(
            upstream, of_loss_num=True, interruptible=_interruptible(),
            cuda_stream=stream, **grads)
    else:
        finite = math.isfinite(upstream)
        # A non-finite upstream (a GradScaler's overflow) multiplies the
        # gradients afterwards, so that inf and NaN reach them as in FUSED.
        done = saved.backward(upstream if finite else 1.0,
                              interruptible=_interruptible(),
                              cuda_stream=stream, **grads)
        if not finite:
            for grad in grads.values():
                if grad is not None:
                    grad.mul_(upstream)
    stats = saved.stats
    if stats is not None:
        stats["gemm_calls"] += done["gemm_calls"]
        stats["gemm_passes"] += done["gemm_passes"]
        stats["segment_recomputes"] = done["segment_recomputes"]
        stats["peak_bytes"] = max(stats["peak_bytes"], done["peak_bytes"])
        stats["backward_seconds"] = done["backward_seconds"]
    return grads


def _tie_to_error(inputs: Sequence[Optional[torch.Tensor]],
                  grad_outputs: Sequence[Any],
                  grads: Tuple[Optional[torch.Tensor], ...]
                  ) -> Tuple[Optional[torch.Tensor], ...]:
    """`grads` as backward returns them with create_graph=True: they come
    back, but differentiating them again raises (as torch's
    once_differentiable, naming dflash_objective). Each is tied to the
    inputs by a term that is exactly 0, so that a second pass from any of
    them reaches the error (instead of finding no path and giving zeros, as
    for torch.autograd.functional.hvp)."""
    tied_to = [t for t in inputs if t is not None and t.requires_grad]
    tied_to += [g for g in grad_outputs
                if isinstance(g, torch.Tensor) and g.requires_grad]
    zero = sum(t.reshape(-1)[:0].sum() for t in tied_to)
    error = torch._C._functions.DelayedError(
        "dflash_objective: double backward is not supported (its "
        "gradients are computed by the fused head, not by autograd ops)",
        len(grads))

    def tied(grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if grad is None:
            return None
        grad = grad.detach()
        if isinstance(zero, torch.Tensor):
            return grad + zero.to(grad.dtype)
        grad.requires_grad = True
        return grad

    # DelayedError passes None (no gradient) through, though torch's type
    # annotations declare Tensor.
    return error(*[tied(g) for g in grads])  # type: ignore[arg-type]


def _top_k_value_backward(config: _core.ObjectiveConfig,
                          hidden: torch.Tensor, weight: torch.Tensor,
                          bias: Optional[torch.Tensor], ids: torch.Tensor,
                          values: torch.Tensor, grad_values: torch.Tensor,
                          grad_hidden: torch.Tensor,
                          grad_weight: Optional[torch.Tensor],
                          grad_bias: Optional[torch.Tensor],
                          trainable: bool,
                          correction: Optional[Tuple[torch.Tensor, ...]] = None
                          ) -> None:
    """Adds d(objective)/d(top-k values) to the gradients (contiguous),
    in place, on torch's current stream. The values and their gradient are
    taken in the dtype the head computes them in
    (_library.top_k_value_dtype); hidden is read as whole rows (copied when
    it is not laid out so, as _run_head does). `correction`: the forward's
    (z, M, d/dz, d/dM) when it had one, its values holding z . M[id]."""
    stream = (torch.cuda.current_stream(hidden.device).cuda_stream
              if hidden.is_cuda else 0)
    dtype = _library.top_k_value_dtype(hidden.dtype)
    z, m, grad_z, grad_m = correction or (None, None, None, None)
    _core.top_k_value_backward(
        config, hidden.contiguous(), weight, bias, ids,
        values.to(dtype).contiguous(), grad_values.to(dtype).contiguous(),
        grad_hidden, grad_weight, grad_bias, trainable=trainable,
        cuda_stream=stream,
        correction_inputs=None if z is None else z.contiguous(),
        correction_weight=m, grad_correction_inputs=grad_z,
        grad_correction_weight=grad_m)


class _Objective(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, config: _core.ObjectiveConfig, top_k: int,
                return_rows: bool, gradients: bool, run_info: _RunInfo,
                hidden: torch.Tensor,
                weight: torch.Tensor, bias: Optional[torch.Tensor],
                teacher: Optional[torch.Tensor],
                confidence: Optional[torch.Tensor], target_ids: torch.Tensor,
                weight_mask: torch.Tensor,
                correction_inputs: Optional[torch.Tensor],
                correction_weight: Optional[torch.Tensor],
                prepared: Optional[_core.PreparedProjection],
                shard: Optional[Any] = None
                ) -> Tuple[torch.Tensor, ...]:
        # needs_input_grad follows the argument order above.
        trainable = ctx.needs_input_grad[6] or ctx.needs_input_grad[7]
        split = _splits(config, gradients, shard, hidden, trainable,
                        prepared is not None)
        call = _run_head(config, top_k, return_rows, trainable, gradients,
                         hidden, weight, bias, teacher, confidence,
                         target_ids, weight_mask, correction_inputs,
                         correction_weight, prepared, shard, split=split)
        result, grads, terms, extras = call[:4]
        run_info.fill(result, call.results)
        stream = call.stream
        # The head's gradients are of loss_num / loss_denominator: a float,
        # or under head.device_results a 0-dim tensor on the device.
        ctx.den = (result["loss_denominator"] if call.results is None
                   else _library.device_denominator(
                       call.results, hidden.shape[2], terms[0].dtype))
        ctx.device_results = call.results is not None
        # The buffer lives until backward (ctx's, not an output): a split
        # state's backward reads its status words and may latch there.
        ctx.results = call.results
        ctx.config = config
        ctx.trainable = trainable
        ctx.stream = stream
        ctx.shard = shard
        returned = terms + [e for e in extras if e is not None]
        top_k_values = extras[3]
        # The top-k values carry a gradient back through the projection's
        # rows they came from (their backward is a sparse update).
        ctx.values_at = None
        if top_k_values is not None:
            ctx.values_at = next(i for i, e in enumerate(returned)
                                 if e is top_k_values)
        # Saved, not kept on ctx: autograd frees them after backward, so a
        # second backward without retain_graph raises as torch's own ops do.
        # A split run saves its state's token instead of gradients: between
        # forward and backward only what its mode keeps is held.
        ctx.split = split
        if call.saved is not None:
            call.saved.stats = run_info.stats
        # The teacher too where the backward reads it (a split run
        # recomputes its logits): saved, an in-place edit of it before
        # backward is torch's error, not stale logits.
        ctx.save_for_backward(
            *[grads[name] for name in _GRADIENTS], hidden, weight, bias,
            top_k_values, call.top_k_ids, confidence, correction_inputs,
            correction_weight,
            _token_of(call.saved) if call.saved is not None else None,
            teacher if call.saved is not None else None)
        ctx.mark_non_differentiable(
            *[e for i, e in enumerate(returned)
              if i != 0 and i != ctx.values_at])
        # An output no gradient flows to (the top-k values of a loss that
        # does not use them) comes to backward as None, not as zeros whose
        # sparse backward would be work for nothing.
        ctx.set_materialize_grads(False)
        return tuple(returned)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Optional[torch.Tensor]
                 ) -> Tuple[Optional[torch.Tensor], ...]:
        # None where no gradient flows to an output (set_materialize_grads).
        with torch.no_grad():
            grads = _Objective._gradients(ctx, *grad_outputs)
        if not torch.is_grad_enabled():
            return grads
        saved = ctx.saved_tensors[len(_GRADIENTS):]
        return _tie_to_error(saved[:3] + saved[5:8], grad_outputs, grads)

    @staticmethod
    def _gradients(ctx: Any, grad_num: Optional[torch.Tensor],
                   *unused: Optional[torch.Tensor]
                   ) -> Tuple[Optional[torch.Tensor], ...]:
        # The head's gradients are of loss_num / loss_den; loss_num's are
        # loss_den times those, scaled by what autograd brings (1 / a global
        # denominator, an accumulation factor, ...). Without one (only the
        # top-k values carry a gradient) they add nothing.
        saved = ctx.saved_tensors
        g = dict(zip(_GRADIENTS, saved))
        hidden, weight, bias, values, ids, confidence, z, m, token, _ = saved[
            len(_GRADIENTS):]
        scale: Optional[torch.Tensor] = (
            None if grad_num is None else grad_num * ctx.den)
        if ctx.split and grad_num is not None:
            # The head's backward takes the upstream: its gradients come
            # scaled (the scale in float64 on the host, a CUDA grad_num
            # read there, one synchronisation; under head.device_results
            # grad_num itself, read and scaled on the device).
            g = _saved_backward(
                token, grad_num if ctx.device_results
                else float(grad_num) * ctx.den, ctx.trainable, hidden,
                weight, bias, confidence, z, m)
            scale = None
        made_here = ctx.split and grad_num is not None

        def scaled(grad: torch.Tensor) -> Optional[torch.Tensor]:
            if made_here:
                return grad
            if scale is None:
                return None
            if grad.dtype == torch.bfloat16:
                # A bfloat16 scale would round it: scale in float32.
                return (grad.float() * scale.float()).to(grad.dtype)
            return grad * scale.to(grad.dtype)

        needs = ctx.needs_input_grad
        grad_hidden = scaled(g["grad_hidden"]) if needs[5] else None
        grad_weight = scaled(g["grad_weight"]) if needs[6] else None
        grad_bias = scaled(g["grad_bias"]) if needs[7] else None
        grad_confidence = scaled(g["grad_confidence"]) if needs[9] else None
        grad_z = (scaled(g["grad_correction_inputs"])
                  if needs[12] and g["grad_correction_inputs"] is not None
                  else None)
        grad_m = (scaled(g["grad_correction_weight"])
                  if needs[13] and g["grad_correction_weight"] is not None
                  else None)
        grad_values = (None if ctx.values_at is None
                       else unused[ctx.values_at - 1])
        if grad_values is None and values is not None and (
                ctx.shard is not None):
            # Vocab-parallel, every rank runs the values' backward and its
            # sum over the group, whether its own gradient is None or not.
            grad_values = torch.zeros_like(values)
        if grad_values is not None and any(
                needs[i] for i in (5, 6, 7, 12, 13)):
            if grad_hidden is None:
                # Contiguous whatever hidden's strides (zeros_like keeps a
                # dense view's).
                grad_hidden = hidden.new_zeros(hidden.shape)
            trainable = ctx.trainable
            if trainable and grad_weight is None:
                grad_weight = torch.zeros_like(weight)
            if trainable and bias is not None and grad_bias is None:
                grad_bias = torch.zeros_like(bias)
            correction = None
            add_hidden, add_z = grad_hidden, grad_z
            shard = ctx.shard
            if shard is not None:
                # Each rank adds the ids it owns (its rows of the weight)
                # into buffers of their own, summed over the group; the
                # weight's, bias's and M's gradients stay on their shard.
                ids = _vocab_parallel().local_ids(ids, shard)
                add_hidden = hidden.new_zeros(hidden.shape)
            if z is not None:
                if grad_z is None:
                    grad_z = z.new_zeros(z.shape)
                if grad_m is None:
                    grad_m = torch.zeros_like(m)
                add_z = grad_z if shard is None else z.new_zeros(z.shape)
                correction = (z, m, add_z, grad_m)
            _top_k_value_backward(
                ctx.config, hidden, weight, bias, ids, values, grad_values,
                add_hidden,
                grad_weight if trainable else None,
                grad_bias if trainable and bias is not None else None,
                trainable, correction)
            if shard is not None:
                _vocab_parallel().sum_over(
                    shard.group, [add_hidden, add_z if z is not None
                                  else None])
                grad_hidden = grad_hidden + add_hidden
                if grad_z is not None and add_z is not None:
                    grad_z = grad_z + add_z
            grad_z = grad_z if needs[12] else None
            grad_m = grad_m if needs[13] else None
            grad_hidden = grad_hidden if needs[5] else None
            grad_weight = grad_weight if needs[6] else None
            grad_bias = grad_bias if needs[7] else None
        return (None, None, None, None, None, grad_hidden, grad_weight,
                grad_bias, None, grad_confidence, None, None, grad_z, grad_m,
                None, None)


# The weight side of the head's gradients: the tensors a vocab shard owns.
_WEIGHT_SIDE = ("grad_weight", "grad_bias", "grad_correction_weight")
# rows="local": the row tensors each rank brings, gathered in this order
# (hidden, teacher_hidden, confidence_logits, target_ids, weight_mask,
# correction_inputs), and their dtypes on the wire (None: their own, which
# the agreement compared; ids and masks need not share theirs).
_ROW_WIRES = (None, None, None, torch.int64, torch.float64, None)
_Rows = Tuple[Optional[torch.Tensor], ...]


def _weight_side_of(call: _HeadCall) -> Dict[str, torch.Tensor]:
    """The weight-side gradient buffers the run wrote, by name."""
    return {name: grad for name, grad in call.grads.items()
            if name in _WEIGHT_SIDE and grad is not None}


_Made = TypeVar("_Made")
_Collected = TypeVar("_Collected")


class _LocalRows(torch.autograd.Function):
    """The vocab-parallel head with rows="local" (the vocab group is also
    the data-parallel group), in _Objective's arguments and results: every
    rank's rows gathered in rank order, the head run once over each rank's
    rows on every rank (each on its shard of the weight), this rank's terms
    and row outputs those of the run over its own rows. The gradients of
    its hidden and correction inputs are the runs' parts summed over the
    group by one reduce-scatter (in forward, as _run_head's all-reduce);
    those of its shards of the weight, bias and correction weight are every
    run's, each scaled by its rank's factor (d loss / d loss_num, gathered
    in backward: every rank runs backward from its loss_num, as under DDP).
    When the weight or bias trains, backward gathers the rows again and
    runs the head over each rank's rows again for them, summing into one
    set of buffers: kept from forward they would be W shards, the whole
    weight's size on every rank, held until backward.
    """

    @staticmethod
    def forward(ctx: Any, config: _core.ObjectiveConfig, top_k: int,
                return_rows: bool, gradients: bool, run_info: _RunInfo,
                hidden: torch.Tensor, weight: torch.Tensor,
                bias: Optional[torch.Tensor],
                teacher: Optional[torch.Tensor],
                confidence: Optional[torch.Tensor], target_ids: torch.Tensor,
                weight_mask: torch.Tensor,
                correction_inputs: Optional[torch.Tensor],
                correction_weight: Optional[torch.Tensor],
                prepared: Optional[_core.PreparedProjection],
                shard: Any) -> Tuple[torch.Tensor, ...]:
        parallel = _vocab_parallel()
        trainable = ctx.needs_input_grad[6] or ctx.needs_input_grad[7]
        rows = (hidden.contiguous(), teacher, confidence, target_ids,
                weight_mask, correction_inputs)
        per_rank = _LocalRows._gathered(shard, rows)
        if (prepared is None and not trainable
                and weight.dtype == torch.float32 and weight.is_contiguous()):
            # The W runs share one layout of the frozen float32 shard (each
            # run would lay it out again).
            prepared = _core.PreparedProjection(weight, bias)
        # A trainable head's weight side is made again in backward
        # (_weight_side): here the runs write it into one set of buffers
        # (the head needs them when it trains), dropped after forward.
        again = gradients and trainable
        shared: Dict[str, torch.Tensor] = {}

        def run(q: int, rows: _Rows) -> _HeadCall:
            h, t, c, ids, mask, z = rows
            assert h is not None and ids is not None and mask is not None
            return _run_head(config, top_k, return_rows, trainable,
                             gradients, h, weight, bias, t, c, ids, mask, z,
                             correction_weight, prepared, shard,
                             summed=False, into=shared if again else None)

        calls: List[_HeadCall] = []
        for q, call in _LocalRows._each_run(shard, per_rank, run):
            if again:
                shared.update(_weight_side_of(call))
            if q != shard.rank:
                # Another rank's rows: only the gradients' parts are kept.
                call = call._replace(terms=[], extras=[])
            calls.append(call)
        own = calls[shard.rank]
        grads = dict(own.grads)
        grads["grad_hidden"], grads["grad_correction_inputs"] = (
            _LocalRows._buffers_first(
                shard,
                lambda: parallel.pack_rows(shard, [
                    [c.grads["grad_hidden"], c.grads["grad_correction_inputs"]]
                    for c in calls]),
                lambda packed: parallel.reduce_scatter_rows(shard, packed)))
        result = own.result
        run_info.fill(result)
        ctx.den = result["loss_denominator"]
        ctx.shard = shard
        ctx.again = again
        ctx.config = config
        ctx.prepared = prepared if again else None
        # Without a trainable head only M's gradient (Domino's correction
        # weight) has a weight side: each run's is kept, W x this shard's
        # rows x r, so that the frozen head runs once (r is far below H).
        per_run = [] if again else [c.grads[name] for name in _WEIGHT_SIDE
                                    for c in calls]
        # What backward gathers again (the caller's tensors: nothing held
        # beyond them).
        kept = (teacher, target_ids, weight_mask) if again else (None,) * 3
        ctx.save_for_backward(
            grads["grad_hidden"], grads["grad_confidence"],
            grads["grad_correction_inputs"], hidden, weight, bias,
            confidence, correction_inputs, correction_weight, *kept,
            *per_run)
        returned = own.terms + [e for e in own.extras if e is not None]
        ctx.mark_non_differentiable(*returned[1:])
        ctx.set_materialize_grads(False)
        return tuple(returned)

    @staticmethod
    def _gathered(shard: Any, rows: _Rows) -> List[_Rows]:
        """Every rank's `rows` (in _ROW_WIRES's order; this rank's its
        own tensors) in rank order. Every buffer of the row gathers is made
        first (_buffers_first)."""
        parallel = _vocab_parallel()
        return _LocalRows._buffers_first(
            shard,
            lambda: [parallel.rows_to_send(shard, t, wire)
                     for t, wire in zip(rows, _ROW_WIRES)],
            lambda sends: list(zip(*[parallel.exchange_rows(shard, send)
                                     for send in sends])))

    @staticmethod
    def _buffers_first(shard: Any, make: Callable[[], _Made],
                       collect: Callable[[_Made], _Collected]) -> _Collected:
        """collect(make()): make() allocates a step's buffers, collect()
        runs its collectives. A failure in make() (a MemoryError) is refused
        where the others wait, a status gather before collect(); either
        error is put in _REFUSED (the group stopped together at the status
        gather, or a collective failed: nothing more to send)."""
        try:
            made = make()
        except BaseException as error:
            shard.core.refuse(error)
            _REFUSED.add(id(error))
            raise
        try:
            shard.core.gather_status()
            return collect(made)
        except BaseException as error:
            _REFUSED.add(id(error))
            raise

    @staticmethod
    def _each_run(shard: Any, per_rank: Sequence[_Rows],
                  run: Callable[[int, _Rows], _HeadCall]
                  ) -> Iterator[Tuple[int, _HeadCall]]:
        """(q, run(q, rank q's rows)) in rank order. A failure before run
        q's handshake (a MemoryError for its buffers) is refused there,
        where the others wait for this rank's record, and put in
        _REFUSED; one inside the run stopped every rank already."""
        before = shard.core.runs
        for q, rows in enumerate(per_rank):
            try:
                call = run(q, rows)
            except BaseException as error:
                if shard.core.runs == before + q:
                    shard.core.refuse(error)
                    _REFUSED.add(id(error))
                raise
            yield q, call

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Optional[torch.Tensor]
                 ) -> Tuple[Optional[torch.Tensor], ...]:
        with torch.no_grad():
            grads = _LocalRows._gradients(ctx, grad_outputs[0])
        if not torch.is_grad_enabled():
            return grads
        return _tie_to_error(ctx.saved_tensors[3:9], grad_outputs, grads)

    @staticmethod
    def _gradients(ctx: Any, grad_num: Optional[torch.Tensor]
                   ) -> Tuple[Optional[torch.Tensor], ...]:
        try:
            # Raises where the caller edited a saved tensor in place.
            saved = ctx.saved_tensors
        except BaseException as error:
            if ctx.again or ctx.needs_input_grad[13]:
                # The others wait for this rank in the backward's status
                # gather (_weight_side's, or M's below).
                ctx.shard.core.refuse(error)
            raise
        own_hidden, own_confidence, own_z = saved[:3]
        (hidden, weight, bias, confidence, z, m, teacher, target_ids,
         weight_mask) = saved[3:12]
        per_run = saved[12:]
        # The head's gradients are of loss_num / loss_den (_Objective).
        scale = 0.0 if grad_num is None else float(grad_num) * ctx.den
        needs = ctx.needs_input_grad

        def scaled(grad: Optional[torch.Tensor], wanted: bool
                   ) -> Optional[torch.Tensor]:
            return None if grad is None or not wanted else grad * scale

        side: Dict[str, Optional[torch.Tensor]] = dict.fromkeys(_WEIGHT_SIDE)
        if ctx.again:
            # (hidden as the caller's: each run reads it contiguous.)
            side.update(_LocalRows._weight_side(
                ctx, scale, (hidden, teacher, confidence, target_ids,
                             weight_mask, z), weight, bias, m))
        elif needs[13]:
            # Agreed on every rank (trainable, M's requires_grad). The
            # status gather first, where a rank that failed above is.
            ctx.shard.core.gather_status()
            factors = _vocab_parallel().gather_scales(ctx.shard, scale)
            world = ctx.shard.world
            for grad, factor in zip(per_run[2 * world:], factors):
                total = side["grad_correction_weight"]
                side["grad_correction_weight"] = (
                    grad * factor if total is None else total + grad * factor)
        return (None, None, None, None, None, scaled(own_hidden, needs[5]),
                side["grad_weight"] if needs[6] else None,
                side["grad_bias"] if needs[7] else None, None,
                scaled(own_confidence, needs[9]), None, None,
                scaled(own_z, needs[12]),
                side["grad_correction_weight"] if needs[13] else None,
                None, None)

    @staticmethod
    def _weight_side(ctx: Any, scale: float, rows: _Rows,
                     weight: torch.Tensor, bias: Optional[torch.Tensor],
                     m: Optional[torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Backward of a trainable head: the weight side of its gradients
        (_WEIGHT_SIDE, those the head computes) summed over the ranks' rows,
        run q's times rank q's factor, in rank order: every rank's rows
        gathered again (as forward), the factors gathered (`scale` this
        rank's), and the head run again over each rank's rows, run 0's
        buffers the sum and one more set for each later run's (the head's
        other outputs dropped). Every rank runs it in the same order (as
        under DDP); a failure on one rank stops every rank (_gathered,
        _each_run)."""
        shard = ctx.shard
        total: Dict[str, torch.Tensor] = {}
        later: Dict[str, torch.Tensor] = {}

        def run(q: int, rows: _Rows) -> _HeadCall:
            h, t, c, ids, mask, z = rows
            assert h is not None and ids is not None and mask is not None
            return _run_head(ctx.config, 0, False, True, True, h, weight,
                             bias, t, c, ids, mask, z, m, ctx.prepared,
                             shard, summed=False, into=later)

        try:
            per_rank = _LocalRows._gathered(shard, rows)
            factors = _vocab_parallel().gather_scales(shard, scale)
            for q, call in _LocalRows._each_run(shard, per_rank, run):
                side = _weight_side_of(call)
                for grad in side.values():
                    grad.mul_(factors[q])
                if q == 0:
                    total = side
                    continue
                later.update(side)
                for name, grad in side.items():
                    total[name].add_(grad)
        except BaseException as error:
            # No caller after this sends a refusal (_checked_objective's).
            _REFUSED.discard(id(error))
            raise
        return total


def dflash_objective(
        hidden: torch.Tensor, lm_head_weight: torch.Tensor,
        target_ids: torch.Tensor, weight_mask: torch.Tensor, *,
        config: ConfigSource = None,
        lm_head_bias: Optional[torch.Tensor] = None,
        teacher_hidden: Optional[torch.Tensor] = None,
        confidence_logits: Optional[torch.Tensor] = None,
        correction_inputs: Optional[torch.Tensor] = None,
        correction_weight: Optional[torch.Tensor] = None,
        prepared_projection: Optional[_core.PreparedProjection] = None,
        return_rows: bool = False, top_k: int = 0,
        vocab_group: Optional[Any] = None, rows: str = "shared",
        **overrides: Override) -> ObjectiveTerms:
    """The DFlash-family objective's chunk terms over one batch, through the
    fused C++ head: what SpecForge's `_dflash_objective_chunk_terms` reduced
    by `checkpointed_chunk_reduce` returns, without materialising the logits.

    hidden: [B, N, K, H] draft hidden states; float32 or float64 on the CPU,
        float32 or bfloat16 on CUDA (torch's current stream). Read in place
        when contiguous; any other view (a slice of a longer batch along N,
        as SpecForge's chunks) is copied once, as are teacher_hidden,
        confidence_logits and correction_inputs.
    lm_head_weight: [V, H], hidden's dtype and device, contiguous;
        lm_head_bias: [V]. Neither is copied; when either requires grad the
        head trains.
    target_ids: [B, N, K] int64 or int32; weight_mask: [B, N, K] float32,
        float64 or bool; both at any strides (slices, transposed or expanded
        views are read in place). Row (b, n, k) is position k of block
        b*N + n. On a CUDA hidden's device the head builds its rows there
        (no host copy); on the CPU they are read there.
    config: None (the default: dflash, gamma 7, 128 blocks a chunk, fused),
        an ObjectiveConfig, text format or a file; overrides such as
        loss_type=, gamma=, mode=, chunk_blocks= go on top
        (dflash.objective_config).
    teacher_hidden: [B, N, K, H] (no gradient), for dspark and distillation;
        with another loss, for the teacher diagnostics (the target model's
        state that predicts each row's label).
    confidence_logits: [B, N, K] for dspark's confidence term: float64 or
        float32 with float64 hidden (float32 ones are upcast, exactly; the
        loss reads them, and their gradient is made, in float64), float32
        with float32 or bfloat16 hidden.
    correction_inputs, correction_weight: a trainable low-rank logit
        correction, logits = hidden @ W^T + z @ M^T, with z [B, N, K, r]
        (hidden's dtype and device; made by the caller's module, e.g.
        DSpark's Markov head: the input of its markov_w2) and M [V, r]
        (markov_w2.weight; Domino's embed_proj[2].weight). Both get
        gradients through autograd. Domino applies it at block positions
        >= its suffix_start only (pass zeros before it).
    prepared_projection: a dflash.PreparedProjection of this frozen float32
        CPU weight and bias (laid out once for every call; FusedHead keeps
        one). Without one a frozen float32 CPU head lays the weight out at
        each call.
    return_rows: also return per-row neg_log_q and argmax; top_k: the k
        largest logits' ids per row (0 <= k <= min(64, V)); both in the
        result's diagnostics.
    vocab_group: a torch.distributed gloo ProcessGroup for a vocab-parallel
        head (CPU tensors): lm_head_weight, lm_head_bias and
        correction_weight are this rank's contiguous rows of the vocabulary
        (dflash.torch.distributed.shard_rows: sizes differing by at most
        one, the first V % W ranks one larger; the offset follows from the
        group's rank and the ranks' rows, agreed by one small all-gather per
        call), every other argument the same on every rank of the group.
        target_ids and the top-k and argmax ids are global; every term and
        per-row output is the single-process one, the same bits on every
        rank; the gradients of hidden and correction_inputs are summed over
        the group (one all-reduce per call), the weight's, bias's and
        correction_weight's are this rank's rows. Runs through the
        autograd.Function path on every torch (not torch.compile); Ctrl-C
        is taken when the call returns.
    rows: with a vocab_group, "shared" (the default: every rank brings the
        same rows, as above) or "local": the vocab group is also the
        data-parallel group and each rank brings its own rows (hidden,
        target_ids, weight_mask, teacher_hidden, confidence_logits,
        correction_inputs: B may differ between ranks, every other
        dimension may not). The ranks' rows are gathered in rank order and
        the head runs over each rank's rows on every shard; each rank gets
        the terms and row outputs of its own rows (what one process with
        the whole weight returns for them: sum or GlobalNormalizer them
        over the ranks as for data-parallel training), the gradient of its
        own hidden and correction_inputs (summed over the vocabulary by one
        reduce-scatter; an all-reduce under torch 1.13, whose gloo has
        none) and of its shard of the weight, bias and correction_weight
        from every rank's rows (every rank runs backward from its loss_num
        then: they gather each other's factor). top_k is refused.

    With `head { row_selection: ALL_ROWS device_results: true }` in the
    config (CUDA; docs/python.md, "Results on the device") the call never
    reads the device nor waits for it: the head writes its terms into a
    float64 buffer on hidden's device (diagnostics.device_results), every
    term and diagnostic is sliced and cast from it there, and a split
    backward reads its upstream there, so a whole step can be captured in
    a CUDA graph (with target_ids and weight_mask on hidden's device).
    Errors the head finds while running (a bad target or mask element, a
    non-finite input) then make the terms and gradients NaN instead of
    raising; check_objective_results(terms) raises them. top_k is refused
    (its values' backward reads their ids on the host), and a CPU hidden
    (ValueError naming head.device_results).

    Returns ObjectiveTerms: the core terms, the rest in its diagnostics.
    Every bad input raises ValueError (TypeError for
    a wrong type, MemoryError when memory runs out) naming the argument.
    From the main thread under Python's default SIGINT handler, Ctrl-C
    stops the call before its next GEMM and raises KeyboardInterrupt. In a
    forked child (a data-loader worker) the call runs on one thread.
    """
    return _checked_objective(
        hidden, lm_head_weight, target_ids, weight_mask, config=config,
        overrides=overrides, lm_head_bias=lm_head_bias,
        teacher_hidden=teacher_hidden, confidence_logits=confidence_logits,
        correction_inputs=correction_inputs,
        correction_weight=correction_weight,
        prepared_projection=prepared_projection, prepare=False,
        return_rows=return_rows, top_k=top_k, vocab_group=vocab_group,
        rows=rows)


def check_objective_results(terms: ObjectiveTerms) -> None:
    """Raises the error the call that returned `terms` would have raised
    without head.device_results, read from the status words the head
    latched in its results buffer: the same ValueError and message (a bad
    target or mask element named as the synchronous call names it, a
    non-finite input by its index, a float32 overflow of loss_num, ce_num
    or tv_num); returns None where the run latched none.

    A failed head.device_results step raises nothing by itself: its terms
    and gradients are NaN, never a wrong number (a GradScaler skips such a
    step). This waits for torch's current stream (one synchronisation,
    after the work queued there, so call it on the stream the step ran on,
    as after a CUDA graph's replay) and then reads the buffer: call it where
    a host read is acceptable (every n steps, at the end). The call's
    inputs must still hold what it was given (its error is explained from
    them). Terms of a call without head.device_results return None (that
    call raised its errors itself).
    """
    if not isinstance(terms, ObjectiveTerms):
        raise TypeError("terms: must be the ObjectiveTerms dflash_objective "
                        f"returned, got {type(terms).__name__}")
    check = terms.diagnostics._results_check
    results = terms.diagnostics.device_results
    if check is None or results is None:
        return
    hidden = check.hidden
    contiguous = [None if t is None else t.contiguous()
                  for t in (check.teacher_hidden, check.confidence_logits,
                            check.correction_inputs)]
    _core.check_objective_results(
        _library.config_of_text(check.config), hidden.contiguous(),
        check.weight, check.target_ids, check.weight_mask, results,
        torch.cuda.current_stream(hidden.device).cuda_stream, bias=check.bias,
        teacher_hidden=contiguous[0], confidence_logits=contiguous[1],
        correction_inputs=contiguous[2],
        correction_weight=check.correction_weight)
    if terms.loss_num.dtype == torch.float32:
        # The synchronous call's float32 refusal, from the float64 terms.
        host = results.cpu()
        k = hidden.shape[2]
        _refuse_float32_overflow({
            name: float(host[_library.results_slot(name, k)[0]])
            for name in ("loss_num", "ce_num", "tv_num")})


def _checked_objective(
        hidden: torch.Tensor, lm_head_weight: torch.Tensor,
        target_ids: torch.Tensor, weight_mask: torch.Tensor, *,
        config: ConfigSource, overrides: Dict[str, Override],
        lm_head_bias: Optional[torch.Tensor],
        teacher_hidden: Optional[torch.Tensor],
        confidence_logits: Optional[torch.Tensor],
        correction_inputs: Optional[torch.Tensor],
        correction_weight: Optional[torch.Tensor],
        prepared_projection: Optional[_core.PreparedProjection],
        prepare: bool, return_rows: Any, top_k: Any,
        vocab_group: Optional[Any] = None, rows: str = "shared"
        ) -> ObjectiveTerms:
    """dflash_objective (and FusedHead, with `prepare`): the arguments
    checked, then _objective_terms. With a vocab_group the ranks agree on
    the call first (a refusal on any rank raises on every rank)."""
    if vocab_group is None:
        if not (isinstance(rows, str) and rows == "shared"):
            raise ValueError("rows: must be 'shared' without a vocab_group "
                             f"(rows='local' needs one), got {rows!r}")
        return _checked_local(
            hidden, lm_head_weight, target_ids, weight_mask, config=config,
            overrides=overrides, lm_head_bias=lm_head_bias,
            teacher_hidden=teacher_hidden,
            confidence_logits=confidence_logits,
            correction_inputs=correction_inputs,
            correction_weight=correction_weight,
            prepared_projection=prepared_projection, prepare=prepare,
            return_rows=return_rows, top_k=top_k, shard=None)
    parallel = _vocab_parallel()
    if _is_compiling():
        raise ValueError("vocab_group: a vocab-parallel call runs outside "
                         "torch.compile (its collectives are not traced); "
                         "call it from eager code")
    group, rank, world = parallel.checked_group(vocab_group)
    try:
        if not isinstance(rows, str) or rows not in ("shared", "local"):
            raise ValueError("rows: must be 'shared' or 'local', got "
                             f"{rows!r}")
        local_rows = rows == "local"
        nccl = parallel.collective_device(group).type == "cuda"
        for name, value in (("hidden", hidden),
                            ("lm_head_weight", lm_head_weight),
                            ("lm_head_bias", lm_head_bias),
                            ("teacher_hidden", teacher_hidden),
                            ("confidence_logits", confidence_logits),
                            ("correction_inputs", correction_inputs),
                            ("correction_weight", correction_weight)):
            if (isinstance(value, torch.Tensor)
                    and value.device.type != "cpu"
                    and (value.device.type != "cuda" or local_rows)):
                raise ValueError(
                    f"{name}: vocab_group runs on CPU tensors, and on CUDA "
                    "tensors with rows='shared' (rows='local' gathers its "
                    f"rows on the host), got a tensor on {value.device}")
            if (nccl and isinstance(value, torch.Tensor)
                    and value.device.type != "cuda"):
                raise ValueError(
                    f"{name}: an NCCL vocab_group takes CUDA tensors, got a "
                    f"tensor on {value.device}")
        hidden = _tensor("hidden", hidden)
        lm_head_weight = _tensor("lm_head_weight", lm_head_weight)
        target_ids = _tensor("target_ids", target_ids)
        weight_mask = _tensor("weight_mask", weight_mask)
        top_k = _int("top_k", top_k)
        if not 0 <= top_k <= 64:
            raise ValueError("top_k: must be an int in [0, min(64, V)], got "
                             f"{top_k!r}")
        if local_rows and top_k:
            raise ValueError(
                f"top_k: rows='local' does not return top-k (their values' "
                f"gradient is not built for it), got {top_k!r}; pass 0")
        if local_rows and hidden.dim() == 4 and hidden.shape[0] == 0:
            raise ValueError("hidden: rows='local' needs at least one row "
                             "on every rank, got B = 0 here")
        if local_rows:
            # Gathered by shape: each row tensor must be this rank's rows
            # of hidden (the agreement compares hidden's N, K, H).
            for name, value, dims in (
                    ("target_ids", target_ids, 3),
                    ("weight_mask", weight_mask, 3),
                    ("teacher_hidden", teacher_hidden, 4),
                    ("confidence_logits", confidence_logits, 3),
                    ("correction_inputs", correction_inputs, 3)):
                if value is None:
                    continue
                value = _tensor(name, value)
                if tuple(value.shape[:dims]) != tuple(hidden.shape[:dims]):
                    raise ValueError(
                        f"{name}: with rows='local' must have hidden's "
                        f"leading dimensions {tuple(hidden.shape[:dims])}, "
                        f"got shape {tuple(value.shape)}")
        resolved = objective_config(config, **overrides)
        gradients = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad
            for t in (hidden, lm_head_weight, lm_head_bias,
                      confidence_logits, correction_inputs,
                      correction_weight))
        trainable = gradients and (lm_head_weight.requires_grad or (
            lm_head_bias is not None and lm_head_bias.requires_grad))
        mine = parallel.signature(
            hidden, lm_head_weight, target_ids, weight_mask, resolved.text,
            lm_head_bias, teacher_hidden, confidence_logits,
            correction_inputs, top_k, bool(return_rows), gradients,
            trainable, correction_weight=correction_weight,
            local_rows=local_rows)
    except Exception:
        parallel.agree(group, rank, world, None)
        raise
    shard = parallel.agree(group, rank, world, mine)
    if top_k > shard.vocab:
        raise ValueError(f"top_k: must be an int in [0, min(64, V = "
                         f"{shard.vocab})], got {top_k!r}")
    runs = shard.core.runs
    try:
        return _checked_local(
            hidden, lm_head_weight, target_ids, weight_mask, config=resolved,
            overrides={}, lm_head_bias=lm_head_bias,
            teacher_hidden=teacher_hidden,
            confidence_logits=confidence_logits,
            correction_inputs=correction_inputs,
            correction_weight=correction_weight,
            prepared_projection=prepared_projection, prepare=False,
            return_rows=return_rows, top_k=top_k, shard=shard)
    except BaseException as error:
        # Failed on this rank before its run (a check the agreement does
        # not cover, a MemoryError, Ctrl-C): the others wait in the run's
        # handshake (rows="local": the status gather before the row
        # gathers) for its record, so it sends its refusal there.
        if shard.core.runs == runs and id(error) not in _REFUSED:
            shard.core.refuse(error)
        _REFUSED.discard(id(error))
        raise


def _checked_local(
        hidden: torch.Tensor, lm_head_weight: torch.Tensor,
        target_ids: torch.Tensor, weight_mask: torch.Tensor, *,
        config: ConfigSource, overrides: Dict[str, Override],
        lm_head_bias: Optional[torch.Tensor],
        teacher_hidden: Optional[torch.Tensor],
        confidence_logits: Optional[torch.Tensor],
        correction_inputs: Optional[torch.Tensor],
        correction_weight: Optional[torch.Tensor],
        prepared_projection: Optional[_core.PreparedProjection],
        prepare: bool, return_rows: Any, top_k: Any,
        shard: Optional[Any]) -> ObjectiveTerms:
    """_checked_objective's checks on this process's arguments, then
    _objective_terms (`shard`: a vocab-parallel call's agreed shard)."""
    hidden = _tensor("hidden", hidden)
    lm_head_weight = _tensor("lm_head_weight", lm_head_weight)
    target_ids = _tensor("target_ids", target_ids)
    weight_mask = _tensor("weight_mask", weight_mask)
    for name, value in (("lm_head_bias", lm_head_bias),
                        ("teacher_hidden", teacher_hidden),
                        ("confidence_logits", confidence_logits),
                        ("correction_inputs", correction_inputs),
                        ("correction_weight", correction_weight)):
        if value is not None:
            _tensor(name, value)
    if (prepared_projection is not None and not isinstance(
            prepared_projection, _core.PreparedProjection)):
        raise TypeError(
            "prepared_projection: must be a dflash.PreparedProjection or "
            f"None, got {type(prepared_projection).__name__}")
    vocab = lm_head_weight.shape[0] if lm_head_weight.dim() == 2 else 64
    if shard is not None:
        vocab = shard.vocab
    top_k = _int("top_k", top_k)
    if not 0 <= top_k <= min(64, vocab):
        raise ValueError(f"top_k: must be an int in [0, min(64, V = {vocab})], "
                         f"got {top_k!r}")
    cast = _autocast_dtype(hidden.device)
    if cast is not None:
        # Under autocast the head takes its own mixed-precision dtype: each
        # projection input is cast once, here (differentiably: gradients
        # come back in the caller's dtypes), and nowhere else.
        hidden, lm_head_weight = [
            t if t.dtype == cast else t.to(cast)
            for t in (hidden, lm_head_weight)]
        (lm_head_bias, teacher_hidden, correction_inputs,
         correction_weight) = [
            t if t is None or t.dtype == cast else t.to(cast)
            for t in (lm_head_bias, teacher_hidden, correction_inputs,
                      correction_weight)]
        if confidence_logits is not None:
            # In the dtype the head takes beside the cast hidden.
            wanted = _library.confidence_dtype(cast)
            if confidence_logits.dtype != wanted:
                confidence_logits = confidence_logits.to(wanted)
    if (confidence_logits is not None and hidden.dtype == torch.float64
            and confidence_logits.dtype == torch.float32):
        # The float64 head reads float64 confidence logits; float32 ones
        # are upcast exactly (differentiably: their gradient comes back in
        # float32).
        confidence_logits = confidence_logits.double()
    return _objective_terms(
        hidden, lm_head_weight, target_ids, weight_mask, config=config,
        overrides=overrides, lm_head_bias=lm_head_bias,
        teacher_hidden=teacher_hidden, confidence_logits=confidence_logits,
        correction_inputs=correction_inputs,
        correction_weight=correction_weight,
        prepared_projection=prepared_projection, prepare=prepare,
        return_rows=bool(return_rows), top_k=top_k, shard=shard)


def _autocast_dtype(device: torch.device) -> Optional[torch.dtype]:
    """The dtype the head takes its projection's inputs in under the
    autocast active for `device` (torch.autocast), or None outside one:
    bfloat16 under CUDA's bfloat16 autocast (the CUDA head's mixed
    precision), float32 under any other (the CPU head computes in float32
    or float64, and there is no float16 head)."""
    kind = device.type
    if kind not in ("cpu", "cuda"):
        return None
    if hasattr(torch, "get_autocast_dtype"):  # torch >= 2.4
        enabled = torch.is_autocast_enabled(kind)
        dtype = torch.get_autocast_dtype(kind)
    elif kind == "cuda":
        enabled = torch.is_autocast_enabled()
        dtype = torch.get_autocast_gpu_dtype()
    else:
        enabled = torch.is_autocast_cpu_enabled()
        dtype = torch.get_autocast_cpu_dtype()
    if not enabled:
        return None
    return (torch.bfloat16 if kind == "cuda" and dtype == torch.bfloat16
            else torch.float32)


def _config_facts(config: ConfigSource, overrides: Tuple[Tuple[str, Any], ...]
                  ) -> Tuple[str, float, bool]:
    """The resolved config's text, loss_den_offset and whether it sets
    head.device_results. Under torch.compile a constant of the trace
    (torch.compiler.assume_constant_result): the config is read once per
    compiled graph."""
    resolved = objective_config(config, **dict(overrides))
    return (resolved.text, resolved.loss_den_offset,
            _library.device_results_of(resolved.text))


if _library.SUPPORTED:
    _config_facts = (
        torch.compiler.assume_constant_result(  # type: ignore[no-untyped-call]
            _config_facts))


def _is_compiling() -> bool:
    compiler = getattr(torch, "compiler", None)
    if compiler is not None and hasattr(compiler, "is_compiling"):
        return bool(compiler.is_compiling())
    return False


def _objective_terms(
        hidden: torch.Tensor, lm_head_weight: torch.Tensor,
        target_ids: torch.Tensor, weight_mask: torch.Tensor, *,
        config: ConfigSource, overrides: Dict[str, Override],
        lm_head_bias: Optional[torch.Tensor],
        teacher_hidden: Optional[torch.Tensor],
        confidence_logits: Optional[torch.Tensor],
        correction_inputs: Optional[torch.Tensor],
        correction_weight: Optional[torch.Tensor],
        prepared_projection: Optional[_core.PreparedProjection],
        prepare: bool, return_rows: bool, top_k: int,
        shard: Optional[Any] = None) -> ObjectiveTerms:
    """dflash_objective's run, its arguments checked: through the
    dflash::objective operator where torch has torch.library.custom_op
    (unless vocab-parallel: `shard`), else through _Objective. With `prepare` (FusedHead under torch.compile)
    the operator lays a frozen float32 CPU weight out itself and keeps it.

    Under torch.no_grad(), torch.inference_mode() or when no input that
    gets a gradient requires one, the head runs forward only."""
    gradients = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad
        for t in (hidden, lm_head_weight, lm_head_bias, confidence_logits,
                  correction_inputs, correction_weight))
    buffer: Optional[torch.Tensor]
    if _library.SUPPORTED and shard is None:
        text, loss_den_offset, on_device = _config_facts(
            config, tuple(sorted(overrides.items())))
        _refuse_top_k_on_device(on_device, hidden, top_k)
        results, report, buffer = _through_operator(
            hidden, lm_head_weight, target_ids, weight_mask, text,
            lm_head_bias, teacher_hidden, confidence_logits,
            correction_inputs, correction_weight, prepared_projection,
            prepare, return_rows, top_k, gradients, on_device)
        lk_kl_weight, metrics, family_terms, stats = report
    else:
        resolved = objective_config(config, **overrides)
        text = resolved.text
        _refuse_top_k_on_device(_library.device_results_of(text), hidden,
                                top_k)
        run_info = _RunInfo()
        function = (_LocalRows if shard is not None and shard.local
                    else _Objective)
        results = function.apply(
            resolved, top_k, return_rows, gradients, run_info, hidden,
            lm_head_weight, lm_head_bias, teacher_hidden, confidence_logits,
            target_ids, weight_mask, correction_inputs,
            correction_weight, prepared_projection, shard)
        lk_kl_weight, metrics = run_info.lk_kl_weight, run_info.metrics
        family_terms, stats = run_info.family_terms, run_info.stats
        loss_den_offset = run_info.loss_den_offset
        buffer = run_info.results
    loss_num, loss_den, correct_num, accuracy_den = results[:4]
    position_correct, position_den, probability, ce_num, tv_num = results[4:9]
    extras = iter(results[9:])
    (neg_log_q, argmax, ids, values, loss_weight, base_argmax,
     teacher_argmax) = [
        next(extras) if wanted else None
        for wanted in (return_rows, return_rows, top_k > 0, top_k > 0,
                       return_rows or top_k > 0, return_rows, return_rows)]
    is_candidate = index = None
    if ids is not None:
        # As SpecForge: whether the target is among the candidates, and the
        # first place it is (0 when it is not).
        matches = ids.eq(target_ids.to(ids.device).long().unsqueeze(-1))
        is_candidate = matches.any(dim=-1)
        index = matches.long().argmax(dim=-1)
    diagnostics = ObjectiveDiagnostics(
        position_correct=position_correct, position_den=position_den,
        target_probability_num=probability, ce_loss_num=ce_num,
        tv_loss_num=tv_num, lk_kl_weight=lk_kl_weight,
        metrics=metrics, family_terms=family_terms,
        stats=stats, neg_log_q=neg_log_q, argmax=argmax, top_k=ids,
        top_k_values=values, target_is_candidate=is_candidate,
        target_candidate_index=index, loss_weight=loss_weight,
        base_argmax=base_argmax, teacher_argmax=teacher_argmax,
        device_results=buffer,
        _results_check=None if buffer is None else _ResultsCheck(
            text, hidden.detach(), lm_head_weight.detach(),
            target_ids.detach(), weight_mask.detach(), *[
                None if t is None else t.detach()
                for t in (lm_head_bias, teacher_hidden, confidence_logits,
                          correction_inputs, correction_weight)]))
    return ObjectiveTerms(loss_num, loss_den, correct_num, accuracy_den,
                          loss_den_offset=loss_den_offset,
                          diagnostics=diagnostics)


def _through_operator(
        hidden: torch.Tensor, weight: torch.Tensor, target_ids: torch.Tensor,
        weight_mask: torch.Tensor, text: str, bias: Optional[torch.Tensor],
        teacher: Optional[torch.Tensor], confidence: Optional[torch.Tensor],
        correction_inputs: Optional[torch.Tensor],
        correction_weight: Optional[torch.Tensor],
        prepared: Optional[_core.PreparedProjection], prepare: bool,
        return_rows: bool, top_k: int, gradients: bool,
        device_results: bool
        ) -> Tuple[List[torch.Tensor], Tuple[Any, ...],
                   Optional[torch.Tensor]]:
    """The run as torch.ops.dflash.objective (`text`: the resolved
    config's, `device_results` whether it sets head.device_results): the
    results _Objective returns (the terms, then the per-row outputs asked
    for), the report (lk_kl_weight, metrics, family_terms, stats) and a
    head.device_results run's buffer (else None)."""
    trainable = gradients and (weight.requires_grad or (
        bias is not None and bias.requires_grad))
    handle = _library.AUTO if prepare else _library.prepared_handle(prepared)
    outputs = _library.OBJECTIVE(
        hidden, weight, target_ids, weight_mask, bias, teacher, confidence,
        correction_inputs, correction_weight, text, top_k, return_rows,
        trainable, gradients, handle)
    at = _library.OUTPUTS.index
    results = list(outputs[:at("neg_log_q")])
    for name, wanted in (("neg_log_q", return_rows), ("argmax", return_rows),
                         ("top_k", top_k > 0), ("top_k_values", top_k > 0),
                         ("loss_weight", return_rows or top_k > 0),
                         ("base_argmax", return_rows),
                         ("teacher_argmax", return_rows)):
        if wanted:
            results.append(outputs[at(name)])
    info = outputs[at("info")]
    k = hidden.shape[2]
    report: Tuple[Any, Any, Any, Dict[str, torch.Tensor]]
    if _is_compiling():
        # .tolist() would end the graph: the report is read when used.
        report = _library.lazy_report(info, k)
    else:
        report = _library.decode_info(info, k, _library.latest_times())
        token = outputs[at("token")]
        if token.numel() > 0 and int(token[0]) in _SAVED:
            _SAVED[int(token[0])].stats = report[0]
    stats, lk_kl_weight, family_terms, metrics = report
    buffer: Optional[torch.Tensor] = None
    if device_results:
        # The report's terms are the buffer's, on the device (info holds 0
        # for them).
        buffer = outputs[at("results")]
        lk_kl_weight, family_terms, metrics = _library.device_report(buffer,
                                                                     k)
    return results, (lk_kl_weight, metrics, family_terms, stats), buffer


def _refuse_top_k_on_device(device_results: bool, hidden: torch.Tensor,
                            top_k: int) -> None:
    """top_k under head.device_results on CUDA: refused, since the top-k
    values' backward reads their ids on the host (a wait for the device).
    (A CPU hidden is the binding's refusal of head.device_results.)"""
    if device_results and top_k and hidden.is_cuda:
        raise ValueError(
            "top_k: not with head.device_results (the top-k values' "
            "backward reads their ids on the host, a wait for the device), "
            f"got {top_k}; pass 0")
