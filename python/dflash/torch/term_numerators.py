"""Several loss numerators, each differentiable, from one head call.

SpecForge's DSpark and Domino objectives reduce their term numerators
(DSpark's CE, L1 and confidence BCE; Domino's final and base CE) over the
chunks and weigh them afterwards, so each numerator must carry its own
gradient. The fused head computes one differentiable loss_num = sum_i c_i
N_i for coefficients c given before the call (the loss config's weights)
and reports the N_i themselves without gradient.

`separate_numerators` runs the head once with the coefficients the caller
will most likely combine the numerators with, and returns the N_i as
tensors whose backward is exact for any incoming gradients g_i:

- g proportional to c (g = s * c within the rounding of the g_i's dtypes,
  and g_i = 0 where c_i = 0): the gradient is s times the head's own (the
  saved gradients scaled; no second call);
- any other g (a caller that weighs the numerators otherwise): the head
  runs again, with the positive part of g as coefficients and, if any g_i
  is negative, once more with the negative part, and autograd takes the
  gradient of each run. Never the first call's gradient rescaled.

Beside what the run reads, it waits on the device once: backward reads
the incoming gradients (one stacked read) to choose between the two. The
numerators are made on the device (a tensor cast, a float filled in by a
kernel: no copy from the host that the host waits for), and so is the
scale.
"""

from __future__ import annotations

from typing import (Any, Callable, List, Optional, Sequence, Tuple, TypeVar,
                    cast)

import torch

__all__ = ["NumeratorRun", "separate_numerators"]

R = TypeVar("R")

NumeratorRun = Callable[
    [Sequence[float], Sequence[Optional[torch.Tensor]]],
    Tuple[torch.Tensor, Sequence[Any], R]]
"""run(coefficients, inputs) -> (loss_num, numerators, extra).

Runs the head once over `inputs` (the tensors the numerators differentiate
with respect to, None where absent) with loss_num = sum_i coefficients[i] *
numerators[i], loss_num differentiable with respect to the inputs that
require grad. The coefficients are >= 0, not all 0; `numerators` are the
N_i's values (floats or one-element tensors, no gradient needed: a tensor
on the device is not read to the host, so pass it rather than a float read
from it), each its true value also where its coefficient is 0 (dflash's
DSpark reports L1 and confidence only with a positive weight: leave such a
numerator out then); `extra` is anything else of the run (the caller's
telemetry), returned by separate_numerators for the first run."""


def _output(value: Any, dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """A numerator as a new 0-dim tensor of `dtype` on `device`, rounded
    as torch.tensor(float(value), dtype) rounds it, without a read or a
    blocking copy: a tensor is cast where it is (a copy, so that autograd's
    output is not the run's own tensor), a float is filled in by a
    kernel."""
    if isinstance(value, torch.Tensor):
        tensor = value.detach().reshape(())
        if tensor.device != device:
            return tensor.to(device=device, dtype=dtype)
        return tensor.to(dtype=dtype, copy=True)
    return _filled(float(value), dtype, device)


def _filled(value: float, dtype: torch.dtype,
            device: torch.device) -> torch.Tensor:
    """torch.tensor(value, dtype=dtype, device=device) without the blocking
    copy from the host: filled in float64 (which holds any float; a fill
    in `dtype` refuses a value that overflows it, where torch.tensor gives
    inf) and cast on the device."""
    return torch.full((), value, dtype=torch.float64,
                      device=device).to(dtype)


def _check(coefficients: Sequence[float], count: int,
           dtypes: Sequence[torch.dtype]) -> List[float]:
    values = []
    for i, c in enumerate(coefficients):
        if isinstance(c, bool) or not isinstance(c, (int, float)):
            raise TypeError(f"coefficients[{i}]: must be a float, got {c!r}")
        c = float(c)
        if not c >= 0 or c == float("inf"):
            raise ValueError(
                f"coefficients[{i}]: must be finite and >= 0, got {c!r}")
        values.append(c)
    if len(values) != count:
        raise ValueError(f"coefficients: {len(values)} given for {count} "
                         "numerators")
    for i, dtype in enumerate(dtypes):
        if not dtype.is_floating_point:
            raise TypeError(f"dtypes[{i}]: must be a floating dtype, got "
                            f"{dtype}")
    return values


def _proportional_scale(grads: Sequence[float],
                       coefficients: Sequence[float],
                       dtypes: Sequence[torch.dtype]) -> Optional[float]:
    """s where grads = s * coefficients within each grad's rounding (its
    dtype's epsilon, a few times over), else None. Zero grads give 0."""
    if all(g == 0 for g in grads):
        return 0.0
    # s from the finest-grained gradient (the largest coefficient among
    # those of the smallest epsilon): coarser ones are then checked against
    # their own rounding.
    used = [(torch.finfo(d).eps, -c, i)
            for i, (c, d) in enumerate(zip(coefficients, dtypes)) if c != 0]
    if not used:
        return None
    reference_eps, _, reference = min(used)
    scale = grads[reference] / coefficients[reference]
    for g, c, dtype in zip(grads, coefficients, dtypes):
        if c == 0:
            if g != 0:
                return None
            continue
        want = scale * c
        tolerance = 4 * (torch.finfo(dtype).eps + reference_eps) * max(
            abs(g), abs(want))
        if not abs(g - want) <= tolerance:
            return None
    return scale


class _Numerators(torch.autograd.Function):
    """Outputs the numerators; backward scales the head's gradient (through
    loss_num) or recomputes it exactly."""

    @staticmethod
    def forward(ctx: Any, state: "_State", loss_num: torch.Tensor,
                numerators: Sequence[Any],
                *inputs: Optional[torch.Tensor]) -> Tuple[torch.Tensor, ...]:
        ctx.state = state
        ctx.save_for_backward(*inputs)
        ctx.loss_dtype = loss_num.dtype
        ctx.loss_device = loss_num.device
        return tuple(_output(v, d, state.device)
                     for v, d in zip(numerators, state.dtypes))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, *grads: Optional[torch.Tensor]) -> Tuple[
            Optional[torch.Tensor], ...]:
        state: _State = ctx.state
        # Whether to rescale or rerun is the host's choice: one read of all
        # the gradients (each exact in float64).
        given = [g.detach().reshape(()).double() for g in grads
                 if g is not None]
        read = iter(torch.stack(given).tolist() if given else [])
        incoming = [0.0 if g is None else next(read) for g in grads]
        inputs = ctx.saved_tensors
        none: Tuple[None, ...] = (None,) * len(inputs)
        scale = _proportional_scale(incoming, state.coefficients, state.dtypes)
        if scale is not None:
            return (None, _filled(scale, ctx.loss_dtype, ctx.loss_device),
                    None) + none
        return (None, None, None) + state.exact_gradients(
            incoming, inputs, ctx.needs_input_grad[3:])


class _State:
    """What backward needs beside the saved inputs."""

    def __init__(self, run: NumeratorRun[Any], coefficients: List[float],
                 dtypes: Sequence[torch.dtype], device: torch.device) -> None:
        self.run = run
        self.coefficients = coefficients
        self.dtypes = list(dtypes)
        self.device = device

    def exact_gradients(self, incoming: Sequence[float],
                        inputs: Sequence[Optional[torch.Tensor]],
                        needs: Sequence[bool]) -> Tuple[
                            Optional[torch.Tensor], ...]:
        """sum_i incoming[i] * d(N_i)/d(inputs), from one run with the
        positive part of `incoming` as coefficients and one with the
        negative part (each only where it is not zero)."""
        totals: List[Optional[torch.Tensor]] = [None] * len(inputs)
        for sign in (1.0, -1.0):
            part = [max(sign * g, 0.0) for g in incoming]
            if not any(part):
                continue
            with torch.enable_grad():
                leaves = [None if t is None or not need
                          else t.detach().requires_grad_(True)
                          for t, need in zip(inputs, needs)]
                given = [leaf if leaf is not None else (
                    None if t is None else t.detach())
                    for leaf, t in zip(leaves, inputs)]
                loss_num = self.run(part, given)[0]
                wanted = [leaf for leaf in leaves if leaf is not None]
                found = torch.autograd.grad(loss_num, wanted,
                                            allow_unused=True)
            at = iter(found)
            for i, leaf in enumerate(leaves):
                if leaf is None:
                    continue
                g = next(at)
                if g is None:
                    continue
                g = g if sign > 0 else -g
                total = totals[i]
                totals[i] = g if total is None else total + g
        return tuple(totals)


def separate_numerators(
        run: NumeratorRun[R], coefficients: Sequence[float],
        inputs: Sequence[Optional[torch.Tensor]],
        dtypes: Sequence[torch.dtype]) -> Tuple[Tuple[torch.Tensor, ...], R]:
    """The numerators N_i of one head run, each a 0-dim tensor (dtypes[i],
    on the first input's device) differentiable with respect to `inputs`,
    and the run's `extra`.

    run: see NumeratorRun; called once here with `coefficients` (>= 0, one
        per numerator; the weights the caller will most likely combine the
        numerators with), and in backward again only when the incoming
        gradients are not proportional to them.
    inputs: the tensors the head differentiates (hidden, the lm_head's
        weight and bias, confidence logits, a correction's inputs and
        weight; None where absent). Gradients reach them, and through them
        whatever made them.

    Where nothing requires grad (or under torch.no_grad()) the numerators
    are plain tensors.
    """
    present = [t for t in inputs if t is not None]
    if not present:
        raise ValueError("inputs: at least one tensor is needed")
    weights = _check(coefficients, len(dtypes), dtypes)
    # A run needs a loss to differentiate: with every coefficient 0 it runs
    # with the first numerator's, and backward recomputes unless the
    # numerators get no gradient.
    run_weights = weights if any(weights) else [1.0] + weights[1:]
    loss_num, numerators, extra = run(run_weights, list(inputs))
    numerators = list(numerators)
    if len(numerators) != len(dtypes):
        raise ValueError(f"run returned {len(numerators)} numerators for "
                         f"{len(dtypes)} dtypes")
    for i, v in enumerate(numerators):
        if isinstance(v, torch.Tensor) and v.numel() != 1:
            raise ValueError(f"run's numerators[{i}]: must be a float or a "
                             f"one-element tensor, got shape "
                             f"{list(v.shape)}")
    device = present[0].device
    if not (torch.is_grad_enabled() and loss_num.requires_grad):
        return tuple(_output(v, d, device)
                     for v, d in zip(numerators, dtypes)), extra
    state = _State(cast(NumeratorRun[Any], run), weights, dtypes, device)
    outputs = _Numerators.apply(state, loss_num, numerators, *inputs)
    return tuple(outputs), extra
