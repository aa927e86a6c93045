"""dflash_objective as a PyTorch operator (torch >= 2.4): `dflash::objective`
and `dflash::top_k_value_backward`, registered through torch.library
(custom_op, register_fake, register_autograd), so that torch.compile traces
a step that calls dflash_objective or FusedHead without a graph break.

The operators take only what torch's schemas carry: tensors, the resolved
config as text, ints and bools. They return fixed lists of fresh tensors
(an output a call does not ask for is empty): the terms, the per-row
outputs, the run's report packed into one float64 CPU tensor (`info`,
decoded by `decode_info`), the gradient scale, a split run's token, a
head.device_results run's results buffer, and the head's gradients (of
loss_num / loss_den, computed in forward as the FUSED head computes them;
autograd's backward scales them). With `gradients` false the head runs
forward only and the gradient outputs are empty. Under head.device_results
the terms, the gradient scale and the report's terms are read from the
results buffer on the device (device_terms, device_report), never on the
host.

torch 1.13 (no torch.library.custom_op) keeps objective.py's
autograd.Function: `SUPPORTED` says which is in use.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import (Any, Dict, Iterator, List, Mapping, Optional, Sequence,
                    Tuple)

import torch

from dflash import _core

# torch >= 2.4: custom_op, register_fake and register_autograd.
SUPPORTED = all(hasattr(getattr(torch, "library", None), name)
                for name in ("custom_op", "register_fake",
                             "register_autograd"))

# The outputs of dflash::objective, in order. `results` is a
# head.device_results run's buffer (device_results_of), empty otherwise.
OUTPUTS = ("loss_num", "loss_den", "correct_num", "accuracy_den",
           "position_correct", "position_den", "target_probability_num",
           "ce_loss_num", "tv_loss_num", "neg_log_q", "argmax", "top_k",
           "top_k_values", "loss_weight", "base_argmax", "teacher_argmax",
           "info", "scale_den", "token", "results", "grad_hidden",
           "grad_weight", "grad_bias", "grad_confidence",
           "grad_correction_inputs", "grad_correction_weight")
_AT = {name: i for i, name in enumerate(OUTPUTS)}
_GRAD_OUTPUTS = OUTPUTS[_AT["grad_hidden"]:]
# A split run (objective._splits) returns its state's token ([1] int64 on
# the host) and no gradient: dflash::objective_backward makes them.

# The op's tensor inputs, in order (their gradients come back in it).
_INPUTS = ("hidden", "weight", "target_ids", "weight_mask", "bias",
           "teacher_hidden", "confidence_logits", "correction_inputs",
           "correction_weight")

# HeadStats' numeric fields, in `info`'s order (mode is an index into
# _MODES, proto/head.proto's ExecutionMode). The run's times are not in it:
# an operator's outputs are a function of its inputs (torch.library.opcheck
# runs it twice and compares), so they go beside it (_TIMES).
_STATS = ("mode", "chunks", "projected_rows", "gemm_calls", "gemm_passes",
          "segment_recomputes", "peak_bytes", "saved_bytes", "threads")
_TIMED = ("forward_seconds", "backward_seconds")
_INT_STATS = ("chunks", "projected_rows", "gemm_calls", "segment_recomputes",
              "peak_bytes", "saved_bytes", "threads")
_MODES = ("MODE_UNSPECIFIED", "MATERIALIZE", "SAVE_CHUNKS", "CHECKPOINT",
          "SELECTIVE", "FUSED")
# FamilyTerms: scalars, then [K] lists.
_FAMILY_SCALARS = ("l1_loss_num", "confidence_loss_num",
                   "confidence_abs_error_num", "teacher_top1_num",
                   "draft_top1_num", "dpard_loss_num", "base_num",
                   "base_correct_num", "accept_num", "base_accept_num",
                   "accept_den")
_FAMILY_POSITIONS = ("ce_position_num", "dpard_credit_position_num")
# ObjectiveDiagnostics.metrics: [K] tensors, then 0-dim ones.
_METRIC_POSITIONS = ("target_probability_per_position",
                     "loss_weight_per_position", "top_k_recall_per_position",
                     "top_k_mass_per_position",
                     "teacher_acceptance_per_position",
                     "teacher_agreement_per_position",
                     "teacher_top_k_mass_per_position")
_METRIC_SCALARS = ("block_den", "expected_accepted_length_num",
                   "oracle_accepted_length_num",
                   "teacher_expected_accepted_length_num")
# info = stats, whether the loss has an lk_kl_weight (1 or 0), the weight
# (0 if none), loss_den_offset, family scalars, family positions, metric
# positions, metric scalars. (Not NaN for none: opcheck compares outputs,
# and NaN differs from itself.)
_HEAD = len(_STATS) + 3 + len(_FAMILY_SCALARS)


def info_size(k: Any) -> Any:
    """The length of `info` for block size k (an int or a SymInt)."""
    return (_HEAD + len(_METRIC_SCALARS)
            + (len(_FAMILY_POSITIONS) + len(_METRIC_POSITIONS)) * k)


# The times of this thread's latest run (HeadStats' forward_seconds and
# backward_seconds).
_TIMES = threading.local()


def latest_times() -> Dict[str, float]:
    """forward_seconds and backward_seconds of this thread's latest run."""
    return dict(getattr(_TIMES, "value", dict.fromkeys(_TIMED, 0.0)))


def encode_info(result: Dict[str, Any], k: int,
                device_results: bool = False) -> torch.Tensor:
    """The head's report (run_objective's dict) as `info`; its times kept
    apart (latest_times). With `device_results` (a head.device_results
    run, whose report holds NaN for every term) the terms' part is 0: they
    are read from the `results` output instead (device_report)."""
    stats = result["stats"]
    _TIMES.value = {name: float(stats[name]) for name in _TIMED}
    family = result["family_terms"]
    metrics = result["diagnostics"]
    lk = result["lk_kl_weight"]
    values: List[float] = [float(_MODES.index(stats["mode"]))]
    values += [float(stats[name]) for name in _STATS[1:]]
    if device_results:
        values += [0.0, 0.0, float(result["loss_den_offset"])]
        values += [0.0] * (info_size(k) - len(values))
        return torch.tensor(values, dtype=torch.float64)
    values += [0.0 if lk is None else 1.0, 0.0 if lk is None else float(lk),
               float(result["loss_den_offset"])]
    values += [float(family[name]) for name in _FAMILY_SCALARS]
    for name in _FAMILY_POSITIONS:
        values += [float(v) for v in family[name]]
    for name in _METRIC_POSITIONS:
        values += [float(v) for v in metrics[name]]
    values += [float(metrics[name]) for name in _METRIC_SCALARS]
    assert len(values) == info_size(k)
    return torch.tensor(values, dtype=torch.float64)


def decode_info(info: torch.Tensor, k: int,
                times: Dict[str, float]) -> Tuple[
        Dict[str, Any], Optional[float], Dict[str, Any],
        Dict[str, torch.Tensor]]:
    """`info` and the run's `times` as (stats, lk_kl_weight, family_terms,
    metrics), as the autograd.Function path returns them (Python numbers;
    metrics float64 CPU tensors of their own)."""
    values = info.tolist()
    at = 0

    def take(n: int) -> List[float]:
        nonlocal at
        at += n
        return values[at - n:at]

    stats: Dict[str, Any] = dict(zip(_STATS, take(len(_STATS))))
    stats["mode"] = _MODES[int(stats["mode"])]
    for name in _INT_STATS:
        stats[name] = int(stats[name])
    stats.update(times)
    # HeadStats' order.
    order = (("mode", "chunks", "projected_rows", "gemm_calls",
              "gemm_passes", "segment_recomputes", "peak_bytes",
              "saved_bytes") + _TIMED + ("threads",))
    stats = {name: stats[name] for name in order}
    has_lk, lk, _offset = take(3)
    family: Dict[str, Any] = dict(zip(_FAMILY_SCALARS,
                                      take(len(_FAMILY_SCALARS))))
    for name in _FAMILY_POSITIONS:
        family[name] = take(k)
    metrics = {name: torch.tensor(take(k), dtype=torch.float64)
               for name in _METRIC_POSITIONS}
    metrics.update({name: torch.tensor(value, dtype=torch.float64)
                    for name, value in zip(_METRIC_SCALARS,
                                           take(len(_METRIC_SCALARS)))})
    return stats, lk if has_lk else None, family, metrics


class LazyReport(Mapping[str, Any]):
    """HeadStats or FamilyTerms read from `info` when first used: what a
    call under torch.compile returns (decoding in the graph would end it)."""

    def __init__(self, info: torch.Tensor, k: Any, part: int) -> None:
        self._info = info
        self._k = k
        self._part = part  # 0: stats, 2: family_terms (decode_info's).
        self._values: Optional[Dict[str, Any]] = None

    def _decoded(self) -> Dict[str, Any]:
        if self._values is None:
            # The times are the latest run's on this thread when first read.
            decoded = decode_info(self._info, int(self._k), latest_times())
            self._values = decoded[0] if self._part == 0 else decoded[2]
        return self._values

    def __getitem__(self, key: str) -> Any:
        return self._decoded()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._decoded())

    def __len__(self) -> int:
        return len(self._decoded())

    def __repr__(self) -> str:
        return repr(self._decoded())


def lazy_report(info: torch.Tensor, k: Any) -> Tuple[
        Any, torch.Tensor, Any, Dict[str, torch.Tensor]]:
    """decode_info's (stats, lk_kl_weight, family_terms, metrics) without
    leaving the graph: stats (forward_seconds and backward_seconds those of
    this thread's latest run when first read) and family_terms are
    LazyReports, lk_kl_weight
    a 0-dim float64 tensor (NaN where the loss has none), metrics slices of
    `info`."""
    at = _HEAD + len(_FAMILY_POSITIONS) * k
    metrics: Dict[str, torch.Tensor] = {}
    for name in _METRIC_POSITIONS:
        metrics[name] = info[at:at + k].clone()
        at = at + k
    for name in _METRIC_SCALARS:
        metrics[name] = info[at].clone()
        at = at + 1
    lk = torch.where(info[len(_STATS)] > 0, info[len(_STATS) + 1],
                     torch.full_like(info[0], float("nan")))
    return LazyReport(info, k, 0), lk, LazyReport(info, k, 2), metrics


# head.device_results (docs/python.md, "Results on the device"): the CUDA
# head writes its terms into a float64 buffer on hidden's device and never
# reads the device; the terms are sliced and cast from it there.


@functools.lru_cache(maxsize=64)
def device_results_of(text: str) -> bool:
    """Whether the resolved config `text` (ObjectiveConfig.text) sets
    head.device_results. The binding shows a config's fields only as this
    text, printed by protobuf's TextFormat: one field a line, a nested
    message's fields indented two spaces under `name {` (so a string
    holding the words is quoted on another field's line, never this one)."""
    depth = 0
    in_head = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.endswith("{"):
            depth += 1
            if depth == 1:
                in_head = stripped == "head {"
        elif stripped == "}":
            depth -= 1
        elif depth == 1 and in_head and stripped == "device_results: true":
            return True
    return False


# The binding's layout (_core.device_results_layout,
# losses/device_results.h) at K = 1 and 2, read once: its indices and counts
# are linear in K, so every K's is on the line through these (a plain
# Python constant, which torch.compile traces; the extension it is not).
_LAYOUT_AT_1 = _core.device_results_layout(1)
_LAYOUT_AT_2 = _core.device_results_layout(2)


def results_slot(name: str, k: Any) -> Tuple[Any, Any]:
    """(first index, count) of `name` in a device_results buffer for blocks
    of k positions (an int or, traced, a SymInt), as
    _core.device_results_layout(k)[name] gives it. 'size' is (0, the
    buffer's length)."""
    (at1, n1), (at2, n2) = _LAYOUT_AT_1[name], _LAYOUT_AT_2[name]
    return at1 + (at2 - at1) * (k - 1), n1 + (n2 - n1) * (k - 1)


def results_size(k: Any) -> Any:
    """The doubles a device_results buffer holds for blocks of k."""
    return results_slot("size", k)[1]


# The terms (OUTPUTS' first nine) under the binding's names, and whether
# each is per block position ([K]) or a scalar.
_DEVICE_TERMS = (("loss_num", False), ("loss_den", False), ("correct", False),
                 ("accuracy_den", False), ("correct_per_position", True),
                 ("mask_per_position", True), ("target_probability", False),
                 ("ce_num", False), ("tv_num", False))


def _result(results: torch.Tensor, name: str, k: Any,
            per_position: bool) -> torch.Tensor:
    at, n = results_slot(name, k)
    return results[at:at + n] if per_position else results[at]


def device_terms(results: torch.Tensor, k: Any, dtype: torch.dtype
                 ) -> List[torch.Tensor]:
    """The nine terms dflash::objective returns first, from a
    device_results buffer: each a fresh tensor (not a view: a caller may
    all_reduce one in place) cast to `dtype` on the buffer's device."""
    return [_result(results, name, k, per_position).to(dtype, copy=True)
            for name, per_position in _DEVICE_TERMS]


def device_denominator(results: torch.Tensor, k: Any, dtype: torch.dtype
                       ) -> torch.Tensor:
    """The loss's finished denominator (the head's gradients are of
    loss_num / it), 0-dim in `dtype` on the buffer's device."""
    return _result(results, "loss_denominator", k, False).to(dtype, copy=True)


def device_report(results: torch.Tensor, k: Any) -> Tuple[
        torch.Tensor, Dict[str, torch.Tensor], Dict[str, torch.Tensor]]:
    """(lk_kl_weight, family_terms, metrics) from a device_results buffer:
    fresh float64 tensors on its device, 0-dim or [K] per position;
    lk_kl_weight NaN where the loss has none (the buffer's slot)."""
    lk = _result(results, "lk_kl_weight", k, False).clone()
    family = {name: _result(results, name, k, False).clone()
              for name in _FAMILY_SCALARS}
    family.update({name: _result(results, name, k, True).clone()
                   for name in _FAMILY_POSITIONS})
    metrics = {name: _result(results, name, k, True).clone()
               for name in _METRIC_POSITIONS}
    metrics.update({name: _result(results, name, k, False).clone()
                    for name in _METRIC_SCALARS})
    return lk, family, metrics


@functools.lru_cache(maxsize=64)
def config_of_text(text: str) -> _core.ObjectiveConfig:
    """The resolved config an op call names by its text (parsed once)."""
    return _core.ObjectiveConfig.from_text(text, "config")


# Prepared projections an op call names by a handle: 0 none, AUTO the
# op's own layout of a frozen float32 CPU weight (kept per weight, for
# FusedHead under torch.compile), else id() of one registered by
# `prepared_handle`, for as long as the caller keeps it.
AUTO = 1
_REGISTERED: "weakref.WeakValueDictionary[int, _core.PreparedProjection]" = (
    weakref.WeakValueDictionary())
_AUTO_LAYOUTS: Dict[Tuple[Any, ...], _core.PreparedProjection] = {}
_AUTO_KEEP = 4  # Layouts kept (the oldest dropped first).


def _prepared_handle(prepared: Optional[_core.PreparedProjection]) -> int:
    """The op's handle of `prepared` (0 for None). Under torch.compile a
    constant of the trace."""
    if prepared is None:
        return 0
    _REGISTERED[id(prepared)] = prepared
    return id(prepared)


prepared_handle = (
    torch.compiler.assume_constant_result(  # type: ignore[no-untyped-call]
        _prepared_handle) if SUPPORTED else _prepared_handle)


def _prepared_of(handle: int, weight: torch.Tensor,
                 bias: Optional[torch.Tensor]
                 ) -> Optional[_core.PreparedProjection]:
    if handle == 0:
        return None
    if handle != AUTO:
        prepared = _REGISTERED.get(handle)
        if prepared is None:
            raise ValueError(
                "prepared_projection: the PreparedProjection this call was "
                "traced with no longer exists (keep it alive as long as the "
                "compiled function is used)")
        return prepared
    if (weight.requires_grad or weight.is_cuda
            or weight.dtype != torch.float32 or not weight.is_contiguous()
            or (bias is not None and bias.requires_grad)):
        return None
    key = (weight.data_ptr(), tuple(weight.shape),
           None if bias is None else (bias.data_ptr(), tuple(bias.shape)))
    prepared = _AUTO_LAYOUTS.pop(key, None)
    if prepared is None:
        # A weight changed in place is laid out again by the call (its
        # checksum); a new weight at an old address alike.
        prepared = _core.PreparedProjection(weight, bias)
    _AUTO_LAYOUTS[key] = prepared
    while len(_AUTO_LAYOUTS) > _AUTO_KEEP:
        del _AUTO_LAYOUTS[next(iter(_AUTO_LAYOUTS))]
    return prepared


def _empty_like_none(dtype: torch.dtype, device: torch.device
                     ) -> torch.Tensor:
    return torch.empty((0,), dtype=dtype, device=device)


def top_k_value_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the head computes top-k values and their gradients in for
    hidden of `dtype`: float64 for float64 (exact), else float32 (bfloat16
    values are returned rounded to bfloat16)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def confidence_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the head reads confidence logits and writes their
    gradient in for hidden of `dtype`: float64 for float64 (exact), else
    float32 (ConfidenceOf, losses/chunk_loss.h)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def output_specs(hidden: torch.Tensor, weight: torch.Tensor,
                 bias: Optional[torch.Tensor],
                 confidence: Optional[torch.Tensor],
                 correction_inputs: Optional[torch.Tensor],
                 correction_weight: Optional[torch.Tensor], top_k: int,
                 return_rows: bool, trainable: bool, gradients: bool,
                 split: bool = False, device_results: bool = False
                 ) -> List[Tuple[Sequence[Any], torch.dtype, torch.device]]:
    """Each output's (shape, dtype, device); shape (0,) where not asked for.
    `split` (objective._splits): a token, and no gradient.
    `device_results` (head.device_results): the results buffer, float64
    [results_size(K)] on hidden's device. Shapes may be symbolic (fake
    tensors)."""
    device = hidden.device
    cpu = torch.device("cpu")
    rows = tuple(hidden.shape[:3])
    k = hidden.shape[2]
    scalar = torch.float32 if hidden.dtype == torch.bfloat16 else hidden.dtype
    none: Tuple[int, ...] = (0,)
    specs: List[Tuple[Sequence[Any], torch.dtype, torch.device]] = [
        ((), scalar, device)] * 4
    specs += [((k,), scalar, device)] * 2 + [((), scalar, device)] * 3
    specs += [
        # neg_log_q and loss_weight in float64 whatever hidden's dtype.
        (rows if return_rows else none, torch.float64, device),
        (rows if return_rows else none, torch.int64, device),
        (rows + (top_k,) if top_k else none, torch.int64, device),
        (rows + (top_k,) if top_k else none, hidden.dtype, device),
        (rows if return_rows or top_k else none, torch.float64, device),
        (rows if return_rows else none, torch.int64, device),
        (rows if return_rows else none, torch.int64, device),
        ((info_size(k),), torch.float64, cpu),
        ((), scalar, device),
        ((1,) if split else none, torch.int64, cpu),
        ((results_size(k),) if device_results else none, torch.float64,
         device),
    ]
    gradients = gradients and not split
    train = gradients and trainable
    specs += [
        (hidden.shape if gradients else none, hidden.dtype, device),
        (weight.shape if train else none, weight.dtype, device),
        (bias.shape if train and bias is not None else none,
         weight.dtype if bias is None else bias.dtype, device),
        (rows if gradients and confidence is not None else none,
         confidence_dtype(hidden.dtype), device),
        (correction_inputs.shape
         if gradients and correction_inputs is not None else none,
         hidden.dtype if correction_inputs is None
         else correction_inputs.dtype, device),
        (correction_weight.shape
         if gradients and correction_weight is not None else none,
         hidden.dtype if correction_weight is None
         else correction_weight.dtype, device),
    ]
    return specs


def split_backward_specs(hidden: torch.Tensor, weight: torch.Tensor,
                         bias: Optional[torch.Tensor],
                         confidence: Optional[torch.Tensor],
                         correction_inputs: Optional[torch.Tensor],
                         correction_weight: Optional[torch.Tensor],
                         trainable: bool
                         ) -> List[Tuple[Sequence[Any], torch.dtype,
                                         torch.device]]:
    """objective_backward's outputs' (shape, dtype, device): a training
    call's gradient outputs (output_specs), for its real and fake kernels
    alike."""
    return output_specs(hidden, weight, bias, confidence, correction_inputs,
                        correction_weight, 0, False, trainable,
                        True)[_AT["grad_hidden"]:]


_SCHEMA = (
    "(Tensor hidden, Tensor weight, Tensor target_ids, Tensor weight_mask, "
    "Tensor? bias, Tensor? teacher_hidden, Tensor? confidence_logits, "
    "Tensor? correction_inputs, Tensor? correction_weight, str config, "
    "int top_k, bool return_rows, bool trainable, bool gradients, "
    "int prepared) -> (" + ", ".join(["Tensor"] * len(OUTPUTS)) + ")")

_SPLIT_BACKWARD_SCHEMA = (
    "(Tensor token, Tensor upstream, Tensor hidden, Tensor weight, "
    "Tensor? bias, Tensor? teacher_hidden, Tensor? confidence_logits, "
    "Tensor? correction_inputs, Tensor? correction_weight, bool trainable, "
    "bool of_loss_num=False, Tensor? results=None) -> ("
    + ", ".join(["Tensor"] * 6) + ")")

_BACKWARD_SCHEMA = (
    "(Tensor hidden, Tensor weight, Tensor? bias, Tensor top_k, "
    "Tensor top_k_values, Tensor grad_values, str config, bool trainable, "
    "Tensor? correction_inputs=None, Tensor? correction_weight=None) "
    "-> (Tensor, Tensor, Tensor, Tensor, Tensor)")


def _objective() -> Any:
    # Imported at call time: objective.py imports this module.
    from dflash.torch import objective
    return objective


def _register() -> Tuple[Any, Any]:
    @torch.library.custom_op("dflash::objective", mutates_args=(),
                             schema=_SCHEMA)
    def objective_op(hidden: torch.Tensor, weight: torch.Tensor,
                     target_ids: torch.Tensor, weight_mask: torch.Tensor,
                     bias: Optional[torch.Tensor],
                     teacher_hidden: Optional[torch.Tensor],
                     confidence_logits: Optional[torch.Tensor],
                     correction_inputs: Optional[torch.Tensor],
                     correction_weight: Optional[torch.Tensor], config: str,
                     top_k: int, return_rows: bool, trainable: bool,
                     gradients: bool, prepared: int
                     ) -> Tuple[torch.Tensor, ...]:
        objective = _objective()
        resolved = config_of_text(config)
        on_device = device_results_of(config)
        split = objective._splits(resolved, gradients, None, hidden,
                                  trainable, prepared != 0)
        run = objective._run_head(
            resolved, top_k, return_rows, trainable, gradients,
            hidden, weight, bias, teacher_hidden, confidence_logits,
            target_ids, weight_mask,
            correction_inputs, correction_weight,
            _prepared_of(prepared, weight, bias), split=split)
        device = hidden.device
        k = hidden.shape[2]
        extras = dict(zip(("neg_log_q", "argmax", "top_k", "top_k_values",
                           "loss_weight", "base_argmax", "teacher_argmax"),
                          run.extras))
        outputs: List[torch.Tensor] = list(run.terms)
        for name, (_, dtype, where) in zip(
                OUTPUTS[len(outputs):_AT["info"]],
                output_specs(hidden, weight, bias, confidence_logits,
                             correction_inputs, correction_weight, top_k,
                             return_rows, trainable,
                             gradients)[len(outputs):_AT["info"]]):
            value = extras[name]
            outputs.append(_empty_like_none(dtype, where) if value is None
                           else value)
        outputs.append(encode_info(run.result, k, run.results is not None))
        scalar = outputs[0].dtype
        if run.results is None:
            outputs.append(torch.tensor(
                run.result["loss_denominator"],
                dtype=torch.float64).to(device, scalar))
        else:
            # Read on the device, never on the host.
            outputs.append(device_denominator(run.results, k, scalar))
        outputs.append(_empty_like_none(torch.int64, torch.device("cpu"))
                       if run.saved is None
                       else objective._token_of(run.saved))
        outputs.append(_empty_like_none(torch.float64, device)
                       if run.results is None else run.results)
        specs = output_specs(hidden, weight, bias, confidence_logits,
                             correction_inputs, correction_weight, top_k,
                             return_rows, trainable, gradients, split,
                             on_device)
        for name, (_, dtype, where) in zip(_GRAD_OUTPUTS,
                                           specs[_AT["grad_hidden"]:]):
            value = run.grads[name] if gradients else None
            outputs.append(_empty_like_none(dtype, where) if value is None
                           else value)
        return tuple(outputs)

    @objective_op.register_fake
    def _(hidden: torch.Tensor, weight: torch.Tensor,
          target_ids: torch.Tensor, weight_mask: torch.Tensor,
          bias: Optional[torch.Tensor],
          teacher_hidden: Optional[torch.Tensor],
          confidence_logits: Optional[torch.Tensor],
          correction_inputs: Optional[torch.Tensor],
          correction_weight: Optional[torch.Tensor], config: str,
          top_k: int, return_rows: bool, trainable: bool, gradients: bool,
          prepared: int) -> Tuple[torch.Tensor, ...]:
        split = _objective()._splits(config_of_text(config), gradients,
                                     None, hidden, trainable, prepared != 0)
        return tuple(
            hidden.new_empty(shape, dtype=dtype, device=device)
            for shape, dtype, device in output_specs(
                hidden, weight, bias, confidence_logits, correction_inputs,
                correction_weight, top_k, return_rows, trainable, gradients,
                split, device_results_of(config)))

    @torch.library.custom_op("dflash::top_k_value_backward", mutates_args=(),
                             schema=_BACKWARD_SCHEMA)
    def top_k_backward_op(hidden: torch.Tensor, weight: torch.Tensor,
                          bias: Optional[torch.Tensor], top_k: torch.Tensor,
                          top_k_values: torch.Tensor,
                          grad_values: torch.Tensor, config: str,
                          trainable: bool,
                          correction_inputs: Optional[torch.Tensor] = None,
                          correction_weight: Optional[torch.Tensor] = None
                          ) -> Tuple[torch.Tensor, ...]:
        # Contiguous whatever hidden's strides (zeros_like keeps a dense
        # view's).
        grad_hidden = hidden.new_zeros(hidden.shape)
        grad_weight = (torch.zeros_like(weight) if trainable
                       else weight.new_empty((0,)))
        grad_bias = (torch.zeros_like(bias)
                     if trainable and bias is not None
                     else weight.new_empty((0,)))
        correction = None
        grad_z, grad_m = weight.new_empty((0,)), weight.new_empty((0,))
        if correction_inputs is not None and correction_weight is not None:
            grad_z = correction_inputs.new_zeros(correction_inputs.shape)
            grad_m = torch.zeros_like(correction_weight)
            correction = (correction_inputs, correction_weight, grad_z,
                          grad_m)
        _objective()._top_k_value_backward(
            config_of_text(config), hidden, weight, bias, top_k.int(),
            top_k_values, grad_values, grad_hidden,
            grad_weight if trainable else None,
            grad_bias if trainable and bias is not None else None, trainable,
            correction)
        return grad_hidden, grad_weight, grad_bias, grad_z, grad_m

    @top_k_backward_op.register_fake
    def _(hidden: torch.Tensor, weight: torch.Tensor,
          bias: Optional[torch.Tensor], top_k: torch.Tensor,
          top_k_values: torch.Tensor, grad_values: torch.Tensor, config: str,
          trainable: bool, correction_inputs: Optional[torch.Tensor] = None,
          correction_weight: Optional[torch.Tensor] = None
          ) -> Tuple[torch.Tensor, ...]:
        correction = (correction_inputs is not None
                      and correction_weight is not None)
        return (hidden.new_empty(hidden.shape),
                torch.empty_like(weight) if trainable
                else weight.new_empty((0,)),
                torch.empty_like(bias) if trainable and bias is not None
                else weight.new_empty((0,)),
                correction_inputs.new_empty(correction_inputs.shape)
                if correction and correction_inputs is not None
                else weight.new_empty((0,)),
                torch.empty_like(correction_weight)
                if correction and correction_weight is not None
                else weight.new_empty((0,)))

    # teacher_hidden is an input although the state reads it through its
    # own reference (a split run may recompute the teacher's logits): so
    # that autograd saves it (an in-place edit before backward is torch's
    # error) and a compiled graph keeps it for the backward. With
    # of_loss_num (a head.device_results run) `upstream` is
    # d(objective)/d(loss_num), read on the device, which the head
    # multiplies by its finished denominator there; else the float64 scale
    # of the head's gradients of loss_num / loss_den, read on the host.
    # `results` is such a run's buffer, which the state's backward reads
    # (its status words) and where it latches a non-finite upstream: passed
    # so that it lives until the backward is queued, in a compiled graph
    # too, whether or not the caller kept its terms. It is not declared
    # mutated: the latch is an error word that nothing in the graph reads
    # (check_objective_results reads it, outside).
    @torch.library.custom_op("dflash::objective_backward", mutates_args=(),
                             schema=_SPLIT_BACKWARD_SCHEMA)
    def objective_backward_op(token: torch.Tensor, upstream: torch.Tensor,
                              hidden: torch.Tensor, weight: torch.Tensor,
                              bias: Optional[torch.Tensor],
                              teacher_hidden: Optional[torch.Tensor],
                              confidence_logits: Optional[torch.Tensor],
                              correction_inputs: Optional[torch.Tensor],
                              correction_weight: Optional[torch.Tensor],
                              trainable: bool, of_loss_num: bool = False,
                              results: Optional[torch.Tensor] = None
                              ) -> Tuple[torch.Tensor, ...]:
        grads = _objective()._saved_backward(
            token, upstream if of_loss_num else float(upstream), trainable,
            hidden, weight, bias, confidence_logits, correction_inputs,
            correction_weight)
        # Where the run computes none, the fake kernel's empty outputs.
        specs = split_backward_specs(hidden, weight, bias, confidence_logits,
                                     correction_inputs, correction_weight,
                                     trainable)
        return tuple(_empty_like_none(dtype, where) if grads[name] is None
                     else grads[name]
                     for name, (_, dtype, where) in zip(_GRAD_OUTPUTS, specs))

    @objective_backward_op.register_fake
    def _(token: torch.Tensor, upstream: torch.Tensor, hidden: torch.Tensor,
          weight: torch.Tensor, bias: Optional[torch.Tensor],
          teacher_hidden: Optional[torch.Tensor],
          confidence_logits: Optional[torch.Tensor],
          correction_inputs: Optional[torch.Tensor],
          correction_weight: Optional[torch.Tensor],
          trainable: bool, of_loss_num: bool = False,
          results: Optional[torch.Tensor] = None
          ) -> Tuple[torch.Tensor, ...]:
        return tuple(hidden.new_empty(shape, dtype=dtype, device=device)
                     for shape, dtype, device in split_backward_specs(
                         hidden, weight, bias, confidence_logits,
                         correction_inputs, correction_weight, trainable))

    def setup_context(ctx: Any, inputs: Tuple[Any, ...],
                      output: Tuple[torch.Tensor, ...]) -> None:
        (hidden, weight, _ids, _mask, bias, _teacher, _confidence,
         _z, _m, config, top_k, _rows, trainable, gradients, _) = inputs
        ctx.config = config
        ctx.trainable = trainable
        ctx.gradients = gradients
        ctx.top_k = top_k
        # A split run's token, not gradients: between forward and backward
        # only what its mode keeps is held (in the state the token holds).
        ctx.split = output[_AT["token"]].numel() > 0
        # head.device_results: the split backward reads its upstream on
        # the device.
        ctx.device_results = output[_AT["results"]].numel() > 0
        values = output[_AT["top_k_values"]] if top_k else None
        ids = output[_AT["top_k"]] if top_k else None
        # The teacher and a head.device_results buffer where the backward
        # reads them (objective_backward).
        ctx.save_for_backward(
            *output[_AT["grad_hidden"]:], output[_AT["scale_den"]], hidden,
            weight, bias, values, ids, _confidence, _z, _m,
            output[_AT["token"]], _teacher if ctx.split else None,
            output[_AT["results"]]
            if ctx.split and ctx.device_results else None)
        ctx.mark_non_differentiable(
            *[t for i, t in enumerate(output)
              if i != 0 and not (top_k and i == _AT["top_k_values"])])
        # Unused top-k values come to backward as None, not as zeros whose
        # sparse backward would be work for nothing.
        ctx.set_materialize_grads(False)

    def backward(ctx: Any, *grad_outputs: Optional[torch.Tensor]
                 ) -> Tuple[Optional[torch.Tensor], ...]:
        with torch.no_grad():
            grads = _gradients(ctx, grad_outputs)
        if not torch.is_grad_enabled():
            return grads
        # create_graph=True: differentiating these again raises, naming
        # dflash_objective (objective.py's _tie_to_error).
        hidden, weight, bias, _, _, confidence, z, m, _, _, _ = (
            ctx.saved_tensors[len(_GRAD_OUTPUTS) + 1:])
        tied: Tuple[Optional[torch.Tensor], ...] = _objective()._tie_to_error(
            [hidden, weight, bias, confidence, z, m], grad_outputs, grads)
        return tied

    def _gradients(ctx: Any, grad_outputs: Sequence[Optional[torch.Tensor]]
                   ) -> Tuple[Optional[torch.Tensor], ...]:
        saved = ctx.saved_tensors
        g = dict(zip(_GRAD_OUTPUTS, saved))
        den = saved[len(_GRAD_OUTPUTS)]
        (hidden, weight, bias, values, ids, confidence, z, m, token, teacher,
         results) = saved[len(_GRAD_OUTPUTS) + 1:]
        needs = ctx.needs_input_grad
        if not ctx.gradients and any(needs[i] for i in (0, 1, 4, 6, 7, 8)):
            raise RuntimeError(
                "dflash_objective: this call ran forward only (under "
                "torch.no_grad() or with no input requiring grad), so it has "
                "no gradients to give")
        # The head's gradients are of loss_num / loss_den; loss_num's are
        # loss_den times those, scaled by what autograd brings (None: only
        # the top-k values carry a gradient).
        scale: Optional[torch.Tensor] = (
            None if grad_outputs[0] is None else grad_outputs[0] * den)
        upstream = grad_outputs[0]
        if ctx.split and upstream is not None and ctx.device_results:
            # The head's backward reads the upstream on the device and
            # multiplies it by its own denominator there: no host read.
            made = objective_backward_op(
                token, upstream, hidden, weight, bias, teacher, confidence,
                z, m, ctx.trainable, True, results)
            g = dict(zip(_GRAD_OUTPUTS, made))
            scale = None
        elif ctx.split and upstream is not None:
            # The head's backward takes the upstream (float64, read on the
            # host: on CUDA one synchronisation) and gives the gradients
            # scaled.
            made = objective_backward_op(
                token, upstream.double() * den.double(), hidden,
                weight, bias, teacher, confidence, z, m, ctx.trainable)
            g = dict(zip(_GRAD_OUTPUTS, made))
            scale = None
        made_here = ctx.split and grad_outputs[0] is not None

        def scaled(grad: torch.Tensor) -> Optional[torch.Tensor]:
            if made_here:
                return grad
            if scale is None:
                return None
            if grad.dtype == torch.bfloat16:
                return (grad.float() * scale.float()).to(grad.dtype)
            return grad * scale.to(grad.dtype)

        grad_hidden = scaled(g["grad_hidden"]) if needs[0] else None
        grad_weight = scaled(g["grad_weight"]) if needs[1] else None
        grad_bias = scaled(g["grad_bias"]) if needs[4] else None
        grad_confidence = (scaled(g["grad_confidence"]) if needs[6]
                           else None)
        grad_z = (scaled(g["grad_correction_inputs"]) if needs[7] else None)
        grad_m = (scaled(g["grad_correction_weight"]) if needs[8] else None)
        grad_values = grad_outputs[_AT["top_k_values"]] if ctx.top_k else None
        if grad_values is not None and any(
                needs[i] for i in (0, 1, 4, 7, 8)):
            add_hidden, add_weight, add_bias, add_z, add_m = (
                top_k_backward_op(hidden, weight, bias, ids, values,
                                  grad_values, ctx.config, ctx.trainable, z,
                                  m))
            # The values hold the correction's logits too.
            if needs[7]:
                grad_z = add_z if grad_z is None else grad_z + add_z
            if needs[8]:
                grad_m = add_m if grad_m is None else grad_m + add_m
            if needs[0]:
                grad_hidden = (add_hidden if grad_hidden is None
                               else grad_hidden + add_hidden)
            if needs[1]:
                grad_weight = (add_weight if grad_weight is None
                               else grad_weight + add_weight)
            if needs[4]:
                grad_bias = (add_bias if grad_bias is None
                             else grad_bias + add_bias)
        return (grad_hidden, grad_weight, None, None, grad_bias, None,
                grad_confidence, grad_z, grad_m) + (None,) * 6

    torch.library.register_autograd("dflash::objective", backward,
                                    setup_context=setup_context)
    return objective_op, top_k_backward_op


# torch.ops.dflash.objective and torch.ops.dflash.top_k_value_backward.
OBJECTIVE: Any = None
TOP_K_VALUE_BACKWARD: Any = None
if SUPPORTED:
    OBJECTIVE, TOP_K_VALUE_BACKWARD = _register()
