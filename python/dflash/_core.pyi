# Types of the extension module (python/native/module.cc), for type checkers:
# a compiled module has no annotations of its own. Tensors cross as objects
# (the extension reads their attributes and needs no torch).
from __future__ import annotations

from typing import (Any, Callable, Dict, List, Optional, SupportsIndex, Tuple,
                    Union)

_Override = Union[str, float, SupportsIndex]

class ObjectiveConfig:
    """A dflash.v1.ObjectiveConfig (proto/objective.proto)."""

    @staticmethod
    def default() -> ObjectiveConfig: ...
    @staticmethod
    def from_text(text: str, source: str = ...) -> ObjectiveConfig: ...
    @staticmethod
    def from_file(path: str) -> ObjectiveConfig: ...
    def with_overrides(self, **kwargs: _Override) -> ObjectiveConfig: ...
    @property
    def text(self) -> str: ...
    @property
    def loss_den_offset(self) -> float: ...
    def checkpoint_policy(self) -> Dict[str, Any]: ...

class PreparedProjection:
    """A frozen float32 CPU lm_head weight (and bias) laid out once."""

    def __init__(self, lm_head_weight: object,
                 lm_head_bias: Optional[object] = ...,
                 threads: SupportsIndex = ...) -> None: ...
    @property
    def packed_bytes(self) -> int: ...
    @property
    def prepare_seconds(self) -> float: ...

class VocabShard:
    """This process's rows of a vocabulary split across processes and the
    exchange its loss merges row records through (dflash.torch makes one
    per call from vocab_group)."""

    def __init__(self, offset: SupportsIndex, vocab: SupportsIndex,
                 rank: SupportsIndex, size: SupportsIndex,
                 all_gather: Callable[[memoryview, memoryview], object]
                 ) -> None: ...
    @property
    def offset(self) -> int: ...
    @property
    def vocab(self) -> int: ...
    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    def all_gather(self, local: List[float]) -> List[float]: ...
    @property
    def runs(self) -> int: ...
    def refuse(self, error: BaseException) -> None: ...
    def gather_status(self) -> None: ...

def run_objective(
    config: ObjectiveConfig, hidden: object, weight: object,
    target_ids: object, weight_mask: object, bias: Optional[object],
    teacher_hidden: Optional[object], confidence_logits: Optional[object],
    grad_hidden: Optional[object], grad_weight: Optional[object],
    grad_bias: Optional[object], grad_confidence: Optional[object],
    neg_log_q: Optional[object], argmax: Optional[object],
    top_k: Optional[object], top_k_values: Optional[object],
    loss_weight: Optional[object], correction_inputs: Optional[object],
    correction_weight: Optional[object],
    grad_correction_inputs: Optional[object],
    grad_correction_weight: Optional[object],
    prepared: Optional[PreparedProjection], trainable: bool,
    cuda_stream: int, interruptible: bool = ...,
    forward_only: bool = ...,
    vocab_shard: Optional[VocabShard] = ...,
    base_argmax: Optional[object] = ...,
    teacher_argmax: Optional[object] = ...,
    device_results: Optional[object] = ...) -> Dict[str, Any]: ...
class SavedHead:
    """A split forward's state, kept for its backward (start_objective);
    its 8-byte buffer names it (torch.frombuffer makes its token)."""

    stats: Any  # Set by dflash.torch: the forward's HeadStats.
    @property
    def saved_bytes(self) -> int: ...
    def backward(self, upstream: float, grad_hidden: object,
                 grad_weight: Optional[object], grad_bias: Optional[object],
                 grad_confidence: Optional[object],
                 grad_correction_inputs: Optional[object],
                 grad_correction_weight: Optional[object],
                 interruptible: bool = ...,
                 cuda_stream: int = ...) -> Dict[str, Any]: ...
    def backward_on_device(self, upstream: object, grad_hidden: object,
                           grad_weight: Optional[object],
                           grad_bias: Optional[object],
                           grad_confidence: Optional[object],
                           grad_correction_inputs: Optional[object],
                           grad_correction_weight: Optional[object],
                           of_loss_num: bool = ...,
                           interruptible: bool = ...,
                           cuda_stream: int = ...) -> Dict[str, Any]: ...

def start_objective(
    config: ObjectiveConfig, hidden: object, weight: object,
    target_ids: object, weight_mask: object, bias: Optional[object],
    teacher_hidden: Optional[object], confidence_logits: Optional[object],
    neg_log_q: Optional[object], argmax: Optional[object],
    top_k: Optional[object], top_k_values: Optional[object],
    loss_weight: Optional[object], correction_inputs: Optional[object],
    correction_weight: Optional[object],
    prepared: Optional[PreparedProjection], trainable: bool,
    interruptible: bool = ..., base_argmax: Optional[object] = ...,
    teacher_argmax: Optional[object] = ..., cuda_stream: int = ...,
    device_results: Optional[object] = ...
) -> Tuple[Dict[str, Any], SavedHead]: ...
def check_objective_results(
    config: ObjectiveConfig, hidden: object, weight: object,
    target_ids: object, weight_mask: object, device_results: object,
    cuda_stream: int, bias: Optional[object] = ...,
    teacher_hidden: Optional[object] = ...,
    confidence_logits: Optional[object] = ...,
    correction_inputs: Optional[object] = ...,
    correction_weight: Optional[object] = ...) -> None: ...
def device_results_layout(block_size: int) -> Dict[str, Tuple[int, int]]: ...
def splits_backward(config: ObjectiveConfig) -> bool: ...
def top_k_value_backward(
    config: ObjectiveConfig, hidden: object, weight: object,
    bias: Optional[object], top_k: object, top_k_values: object,
    grad_values: object, grad_hidden: object, grad_weight: Optional[object],
    grad_bias: Optional[object], trainable: bool, cuda_stream: int,
    correction_inputs: Optional[object] = None,
    correction_weight: Optional[object] = None,
    grad_correction_inputs: Optional[object] = None,
    grad_correction_weight: Optional[object] = None) -> None: ...
def set_cuda_library_dirs(dirs: List[str]) -> None: ...
def set_torch_allocator(allocate: Optional[Callable[[int, int, int], int]],
                        free: Optional[Callable[[int], None]]) -> None: ...
def built_with_cuda() -> bool: ...
def release_cached_memory() -> None: ...
