"""Global normalisation of dflash's objective across data-parallel ranks.

GlobalNormalizer reproduces SpecForge's three conventions for turning the
additive terms of each rank's micro-batches (ObjectiveTerms, or any
(numerator, denominator) pair) into one loss and one gradient:

- "dflash": the sum of the numerators over the sum of the denominators,
  across the gradient-accumulation window and every rank (SpecForge's
  TrainerCore with `loss_terms`): each micro-batch backpropagates its
  numerator; at the window's end one float64 SUM all-reduce of a packed
  buffer gives the global denominator (and every metric) and the gradients
  are scaled once.
- "dspark": each micro-batch's numerator over its denominator summed across
  the ranks (OnlineDSparkModel's all-reduced `global_loss_den`), averaged
  over the window: one float64 SUM all-reduce of the denominator per
  micro-batch.
- "domino": each rank's micro-batch normalised on its own
  (OnlineDominoModel's `loss_num / (loss_den + 1e-6)`), averaged over the
  window and the ranks.

Metrics are (numerator, denominator) pairs summed over the window and the
ranks, then divided. The collectives run whatever the data: a rank whose
micro-batch has no weight takes part with zeros, so it cannot hang the
others.

The vocab-parallel head (dflash_objective's and FusedHead's vocab_group)
takes each rank's contiguous rows of the weight: vocab_shard_range says
which, shard_rows and shard_linear cut them from the whole. docs/scaling.md
has the design.
"""

from __future__ import annotations

import operator
import zlib
from typing import (Dict, Iterable, List, Mapping, NamedTuple, Optional,
                    Sequence, Tuple, Union)

import torch
import torch.distributed as dist

from dflash.torch import _vocab_parallel
from dflash.torch.objective import ObjectiveTerms

__all__ = ["MODES", "GlobalNormalizer", "NormalizedStep", "shard_linear",
           "shard_rows", "vocab_shard_range"]

# The conventions, by SpecForge's model names.
MODES = ("dflash", "dspark", "domino")

# What loss() takes: the objective's terms, or a (numerator, denominator)
# pair of 0-dim tensors (the numerator differentiable).
Terms = Union[ObjectiveTerms, Tuple[torch.Tensor, torch.Tensor]]

# The metric pairs loss() adds from ObjectiveTerms beside the common ones,
# per mode: (name, numerator, denominator) with the numerator a
# FamilyTerms key and the denominator a core term's name.
_FAMILY_PAIRS = {
    "dflash": (),
    "dspark": (("l1_loss", "l1_loss_num", "loss_den"),
               ("confidence_loss", "confidence_loss_num", "loss_den"),
               ("confidence_abs_error", "confidence_abs_error_num",
                "loss_den"),
               ("teacher_top1_probability", "teacher_top1_num",
                "accuracy_den"),
               ("draft_top1_probability", "draft_top1_num", "accuracy_den")),
    "domino": (("base_loss", "base_num", "loss_den"),
               ("base_accuracy", "base_correct_num", "accuracy_den"),
               ("accept_length", "accept_num", "accept_den"),
               ("base_accept_length", "base_accept_num", "accept_den")),
}

# Hash values in the packed buffer's check: exact as float64 when squared
# and summed over up to 2^12 ranks.
_HASH_BITS = 20


class NormalizedStep(NamedTuple):
    """What GlobalNormalizer.step returns for one accumulation window; the
    same on every rank of the group.

    Fields:
        loss: the window's objective under the mode (what the scaled
            gradients are the gradient of): dflash sum(loss_num) /
            (sum(loss_den) + loss_den_offset); dspark the mean over the
            window of each micro-batch's global ratio; domino the mean of
            every rank's micro-batch losses.
        grad_scale: the factor step() multiplied the gradients by (apply it
            yourself to gradients it was not given).
        loss_den: the sum of loss_den over the window and the ranks.
        micro_batches: the number of loss() calls, summed over the ranks.
        metrics: each pair's summed numerator over its summed denominator
            (0 where the denominator is 0), float64 CPU tensors, 0-dim or
            [K] as added.
        sums: each pair's summed (numerator, denominator), float64 CPU.
    """

    loss: float
    grad_scale: float
    loss_den: float
    micro_batches: int
    metrics: Dict[str, torch.Tensor]
    sums: Dict[str, Tuple[torch.Tensor, torch.Tensor]]


def _checked_group(group: object) -> Tuple[Optional[dist.ProcessGroup], int]:
    """`group` (None: the default group) checked usable by this rank, and
    its size."""
    if not dist.is_available():
        raise RuntimeError("GlobalNormalizer: this build of torch has no "
                           "torch.distributed")
    if group is not None and not isinstance(group, dist.ProcessGroup):
        outside: object = dist.GroupMember.NON_GROUP_MEMBER
        if group is outside or (type(group) is type(outside)
                                and group == outside):
            raise ValueError(
                "group: this rank is not a member of the group "
                "(torch.distributed.new_group returned NON_GROUP_MEMBER "
                "here): make the normaliser only on the group's ranks")
        raise TypeError("group: must be a torch.distributed.ProcessGroup or "
                        f"None (the default group), got "
                        f"{type(group).__name__}")
    if not dist.is_initialized():
        raise ValueError(
            "group: torch.distributed is not initialised: call "
            "torch.distributed.init_process_group(...) on every rank before "
            "making a GlobalNormalizer")
    try:
        size = dist.get_world_size(group)
    except RuntimeError as error:
        raise ValueError(f"group: not a usable process group ({error})"
                         ) from error
    if size < 1:
        raise ValueError("group: this rank is not a member of the group")
    return group, size


def _mode(mode: object) -> str:
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode: must be one of {', '.join(MODES)} "
                         f"(SpecForge's conventions), got {mode!r}")
    return mode


def _scalar_tensor(name: str, value: object) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{name}: must be a torch.Tensor, got {type(value).__name__}")
    if value.numel() != 1:
        raise ValueError(f"{name}: must hold one value, got shape "
                         f"{tuple(value.shape)}")
    return value.reshape(())


class GlobalNormalizer:
    """SpecForge's global normalisation of the objective over a
    data-parallel group, one accumulation window at a time:

        norm = GlobalNormalizer(mode="dflash")     # the default group
        for micro_batch in window:
            terms = dflash_objective(...)          # this rank's rows
            norm.loss(terms).backward()
        result = norm.step(model.parameters())     # scales the gradients
        optimizer.step()

    group: a torch.distributed.ProcessGroup of the data-parallel ranks, or
        None for the default group (initialised: a ValueError otherwise).
    mode: "dflash", "dspark" or "domino" (see the module's docstring).
    grad_sync: how the gradients are combined over the group: "mean" (DDP
        and FSDP average them; SpecForge's setting, so the normaliser
        multiplies by the group's size as SpecForge does) or "sum" (summed,
        e.g. by an all_reduce of your own).

    Every rank of the group calls loss() for the same number of
    micro-batches and then step(), in the same order as its other
    collectives; a rank whose micro-batch has no weight passes its (zero)
    terms like any other. Collectives: dspark one float64 SUM all-reduce
    of one value per loss() call; every mode one float64 SUM all-reduce of
    the packed pairs per step() (and, at the first step and whenever the
    pairs change, one all-gather of each rank's layout, 2 values, which
    turns ranks that add different pairs into a ValueError on every rank
    rather than a hang). step() reads the collectives' results back to the
    host once each (one read of the device a step with the agreed layout).
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None,
                 mode: str = "dflash", *, grad_sync: str = "mean") -> None:
        self._mode = _mode(mode)
        self._group, self._world = _checked_group(group)
        if grad_sync not in ("mean", "sum"):
            raise ValueError(f"grad_sync: must be 'mean' or 'sum', got "
                             f"{grad_sync!r}")
        self._grad_sync = grad_sync
        self._agreed: Optional[Tuple[int, int]] = None  # (size, hash)
        self._reset()

    def _reset(self) -> None:
        self._sums: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
        self._micro = 0
        # Each loss() part, detached: dflash the numerator, dspark the
        # numerator over the group's denominator, domino the rank's loss.
        self._objective_parts: List[torch.Tensor] = []
        self._offset: Optional[float] = None

    @property
    def mode(self) -> str:
        """The convention: "dflash", "dspark" or "domino"."""
        return self._mode

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        """The process group (None: the default group)."""
        return self._group

    @property
    def world_size(self) -> int:
        """The number of ranks in the group."""
        return self._world

    @property
    def grad_sync(self) -> str:
        """How the group's gradients are combined: "mean" or "sum"."""
        return self._grad_sync

    @property
    def micro_batches(self) -> int:
        """This rank's loss() calls in the current window."""
        return self._micro

    def _device(self) -> torch.device:
        """Where the collectives' buffers live: NCCL's on the current CUDA
        device, anything else's (gloo) on the CPU."""
        backend = str(dist.get_backend(self._group)).lower()
        if backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _check_initialised(self, where: str) -> None:
        if not dist.is_initialized():
            raise ValueError(f"GlobalNormalizer.{where}: torch.distributed "
                             "is no longer initialised (the process group "
                             "was destroyed)")

    def add_metric(self, name: str, numerator: object,
                   denominator: object) -> None:
        """Adds a (numerator, denominator) pair to the window's sums under
        `name` (numbers, or tensors of one shape, detached; summed over the
        window and the ranks at step(), then divided). Every rank adds the
        same names with the same shapes."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"name: must be a non-empty str, got {name!r}")
        num = torch.as_tensor(
            numerator.detach() if isinstance(numerator, torch.Tensor)
            else numerator, dtype=torch.float64)
        den = torch.as_tensor(
            denominator.detach() if isinstance(denominator, torch.Tensor)
            else denominator, dtype=torch.float64)
        if num.shape != den.shape:
            raise ValueError(
                f"add_metric({name!r}): the numerator's shape "
                f"{tuple(num.shape)} differs from the denominator's "
                f"{tuple(den.shape)}")
        previous = self._sums.get(name)
        if previous is not None:
            if previous[0].shape != num.shape:
                raise ValueError(
                    f"add_metric({name!r}): shape {tuple(num.shape)} differs "
                    f"from the earlier {tuple(previous[0].shape)} of this "
                    "window")
            num = previous[0] + num.to(previous[0].device)
            den = previous[1] + den.to(previous[1].device)
        self._sums[name] = (num, den)

    def loss(self, terms: Terms) -> torch.Tensor:
        """This micro-batch's part of the loss: call `.backward()` on it.

        terms: dflash_objective's ObjectiveTerms (their metric pairs are
        added too; docs/scaling.md lists them), or a (numerator,
        denominator) pair of one-value tensors.

        dflash: the numerator (the gradient's scale comes at step());
        dspark: the numerator over the group's summed denominator of this
        micro-batch (one all-reduce, on every rank);
        domino: the numerator over this rank's denominator (plus
        loss_den_offset, SpecForge's 1e-6). step() applies the window's and
        the group's factor in every mode.
        """
        self._check_initialised("loss")
        if isinstance(terms, ObjectiveTerms):
            num, den = terms.loss_num, terms.loss_den
            offset = float(terms.loss_den_offset)
        elif isinstance(terms, tuple) and len(terms) == 2:
            num = _scalar_tensor("terms[0] (the numerator)", terms[0])
            den = _scalar_tensor("terms[1] (the denominator)", terms[1])
            offset = 0.0
        else:
            raise TypeError(
                "terms: must be dflash_objective's ObjectiveTerms or a "
                "(numerator, denominator) pair of tensors, got "
                f"{type(terms).__name__}")
        if self._offset is not None and offset != self._offset:
            raise ValueError(
                f"terms: loss_den_offset {offset} differs from the "
                f"window's {self._offset} (one loss family per window)")
        self._offset = offset
        den = den.detach()
        if self._mode == "dflash":
            part = num
            self._objective_parts.append(num.detach().to(torch.float64))
        elif self._mode == "dspark":
            total = den.to(self._device(), torch.float64).clone()
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=self._group)
            total = (total + offset).clamp_min(
                torch.finfo(torch.float64).tiny).to(num.device)
            part = num / total
            self._objective_parts.append(part.detach().to(torch.float64))
        else:
            part = num / (den + offset).clamp_min(
                torch.finfo(den.dtype).tiny)
            self._objective_parts.append(part.detach().to(torch.float64))
        self._micro += 1
        self.add_metric("loss", num, den)
        if isinstance(terms, ObjectiveTerms):
            self._add_terms(terms)
        return part

    def _add_terms(self, terms: ObjectiveTerms) -> None:
        """The metric pairs of one micro-batch's ObjectiveTerms."""
        d = terms.diagnostics
        m = d.metrics
        position_den = d.position_den
        self.add_metric("accuracy", terms.correct_num, terms.accuracy_den)
        self.add_metric("accuracy_per_position", d.position_correct,
                        position_den)
        self.add_metric("target_probability", d.target_probability_num,
                        terms.accuracy_den)
        if self._mode == "domino":
            # Domino has no top-k or probability diagnostics (SpecForge
            # has none either); its accept lengths are its family's pairs.
            pass
        else:
            for name in ("target_probability_per_position",
                         "top_k_recall_per_position",
                         "top_k_mass_per_position"):
                self.add_metric(name, m[name], position_den)
            self.add_metric("expected_accepted_length",
                            m["expected_accepted_length_num"], m["block_den"])
            self.add_metric("oracle_accepted_length",
                            m["oracle_accepted_length_num"], m["block_den"])
        if self._mode == "dflash":
            self.add_metric("ce_loss", d.ce_loss_num, terms.loss_den)
            self.add_metric("tv_loss", d.tv_loss_num, terms.loss_den)
        if self._mode == "dspark":
            family = d.family_terms
            self.add_metric("ce_per_position",
                            torch.tensor(family["ce_position_num"],
                                         dtype=torch.float64),
                            position_den)
            # SpecForge's tau: the teacher's expected accepted length.
            self.add_metric("tau", m["teacher_expected_accepted_length_num"],
                            m["block_den"])
        cores = {"loss_den": terms.loss_den,
                 "accuracy_den": terms.accuracy_den}
        family_values: Mapping[str, object] = d.family_terms
        for name, numerator, denominator in _FAMILY_PAIRS[self._mode]:
            den_value: object = (cores[denominator] if denominator in cores
                                 else family_values[denominator])
            self.add_metric(name, family_values[numerator], den_value)

    def _layout(self) -> Tuple[List[str], int, int]:
        """The packed buffer's pair names (sorted), its size and hash."""
        names = sorted(self._sums)
        text = ";".join(
            [self._mode, repr(self._offset)]
            + [f"{n}{list(self._sums[n][0].shape)}" for n in names])
        size = 2 + sum(2 * self._sums[n][0].numel() for n in names)
        return names, size, zlib.crc32(text.encode())

    def _describe(self, names: Sequence[str]) -> str:
        if not names:
            return "no pairs (no loss() or add_metric() call this window)"
        return ", ".join(f"{n}{list(self._sums[n][0].shape)}"
                         for n in names)

    def _negotiate(self, names: Sequence[str], size: int, hashed: int,
                   device: torch.device) -> None:
        """Every rank's (size, hash) by one all-gather; the agreed layout,
        or a ValueError on every rank when they differ."""
        mine = torch.tensor([float(size), float(hashed)],
                            dtype=torch.float64, device=device)
        gathered = [torch.zeros_like(mine) for _ in range(self._world)]
        dist.all_gather(gathered, mine, group=self._group)
        # One read of the device for every rank's pair.
        layouts = [(int(s), int(h))
                   for s, h in torch.stack(gathered).tolist()]
        if any(layout != layouts[0] for layout in layouts):
            ranks = "; ".join(
                f"rank {rank}: {s} values (layout {h:08x})"
                for rank, (s, h) in enumerate(layouts))
            raise ValueError(
                "GlobalNormalizer.step: the ranks packed different pairs "
                f"({ranks}); this rank packed {self._describe(names)}. "
                "Every rank must use the same mode, block size and "
                "add_metric() calls in a window")
        self._agreed = layouts[0]

    def step(self, parameters: Optional[Union[torch.Tensor, Iterable[
            torch.Tensor]]] = None) -> NormalizedStep:
        """Ends the window: one float64 SUM all-reduce of the packed pairs
        over the group (on every rank, whatever its data), then scales the
        `.grad` of `parameters` (those that have one) in place by the
        window's factor, and starts a new window.

        Call it after the window's last backward (and, with DDP or FSDP,
        after their gradient synchronisation), before clipping and the
        optimizer's step. Returns the window's NormalizedStep.
        """
        self._check_initialised("step")
        if isinstance(parameters, torch.Tensor):
            parameters = [parameters]
        params = [] if parameters is None else list(parameters)
        for index, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"parameters[{index}]: must be a "
                                f"torch.Tensor, got {type(p).__name__}")
        device = self._device()
        names, size, hashed = self._layout()
        low = hashed % (1 << _HASH_BITS)
        while True:
            if self._agreed is None:
                self._negotiate(names, size, hashed, device)
            agreed_size = self._agreed[0] if self._agreed else size
            # [mismatch flag, hash, hash^2, micro-batches, objective,
            #  pairs...]: the flag and the hash's spread catch a rank whose
            # pairs changed since the agreed layout, with no extra
            # collective while they do not.
            matches = self._agreed == (size, hashed)
            buffer = torch.zeros(3 + agreed_size, dtype=torch.float64,
                                 device=device)
            if matches:
                buffer[1] = float(low)
                buffer[2] = float(low * low)
                buffer[3] = float(self._micro)
                if self._objective_parts:
                    buffer[4] = torch.stack(
                        [p.to(device) for p in self._objective_parts]).sum()
                at = 5
                for name in names:
                    num, den = self._sums[name]
                    width = num.numel()
                    buffer[at:at + width] = num.reshape(-1).to(device)
                    buffer[at + width:at + 2 * width] = den.reshape(-1).to(
                        device)
                    at += 2 * width
            else:
                buffer[0] = 1.0
            dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=self._group)
            # The step's one read of the device: the check and the sums.
            summed = buffer.cpu()
            head = summed[:3].tolist()
            spread = (int(head[2]) * self._world != int(head[1]) ** 2)
            if head[0] == 0 and not spread:
                break
            # Some rank's pairs changed: every rank saw it; agree again.
            self._agreed = None
        micro = int(round(float(summed[3])))
        objective = float(summed[4])
        sums: Dict[str, Tuple[torch.Tensor, torch.Tensor]] = {}
        metrics: Dict[str, torch.Tensor] = {}
        at = 5
        for name in names:
            shape = self._sums[name][0].shape
            width = self._sums[name][0].numel()
            num = summed[at:at + width].reshape(shape).clone()
            den = summed[at + width:at + 2 * width].reshape(shape).clone()
            at += 2 * width
            sums[name] = (num, den)
            metrics[name] = torch.where(
                den != 0, num / torch.where(den != 0, den,
                                            torch.ones_like(den)),
                torch.zeros_like(num))
        loss_den = float(sums["loss"][1]) if "loss" in sums else 0.0
        loss, scale = self._finish(objective, loss_den, micro)
        if params:
            with torch.no_grad():
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(scale)
        self._reset()
        return NormalizedStep(loss=loss, grad_scale=scale, loss_den=loss_den,
                              micro_batches=micro, metrics=metrics,
                              sums=sums)

    def _finish(self, objective: float, loss_den: float,
                micro: int) -> Tuple[float, float]:
        """The window's loss and gradient factor from the group's sums:
        the objective part (dflash the numerators; dspark each numerator
        over its micro-batch's global denominator; domino each rank's
        loss), the denominators and the micro-batches."""
        world = self._world
        sync = float(world) if self._grad_sync == "mean" else 1.0
        if micro == 0:
            return 0.0, 0.0
        if self._mode == "dflash":
            offset = self._offset or 0.0
            den = max(loss_den + offset, torch.finfo(torch.float64).tiny)
            return objective / den, sync / den
        # dspark: the mean over the window (micro / world micro-batches on
        # each rank) of the group's ratios; domino: the mean over every
        # rank's micro-batches of their own losses.
        count = micro / world if self._mode == "dspark" else float(micro)
        return objective / count, sync / count


def vocab_shard_range(vocab: int, group: Optional[dist.ProcessGroup] = None
                      ) -> Tuple[int, int]:
    """This rank's rows [start, stop) of a vocabulary of `vocab` classes
    split over `group` (None: the default group) for the vocab-parallel
    head: contiguous shards in rank order whose sizes differ by at most one,
    the first vocab % W ranks one larger. The rows dflash_objective's
    vocab_group expects each rank to hold."""
    if isinstance(vocab, bool) or not hasattr(vocab, "__index__"):
        raise TypeError(f"vocab: must be an int, got {vocab!r}")
    vocab = operator.index(vocab)
    if group is None:
        if not dist.is_initialized():
            raise ValueError("group: torch.distributed is not initialised")
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        _, rank, world = _vocab_parallel.checked_group(group, "group")
    if vocab < world:
        raise ValueError(f"vocab: must be at least the group's size {world} "
                         f"(every rank holds a row), got {vocab}")
    return _vocab_parallel.shard_range(vocab, world, rank)


def shard_rows(tensor: torch.Tensor,
               group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """This rank's rows (vocab_shard_range of tensor.shape[0]) of a
    vocabulary-sized tensor: the lm_head weight [V, H], its bias [V], a
    correction's weight [V, r]. A contiguous copy, detached (a new leaf:
    set requires_grad on it to train it), so the whole can be freed."""
    if not isinstance(tensor, torch.Tensor) or tensor.dim() < 1:
        raise TypeError("tensor: must be a torch.Tensor of at least one "
                        f"dimension, got {type(tensor).__name__}")
    start, stop = vocab_shard_range(int(tensor.shape[0]), group)
    return tensor.detach()[start:stop].clone(
        memory_format=torch.contiguous_format)


def shard_linear(linear: torch.nn.Linear,
                 group: Optional[dist.ProcessGroup] = None
                 ) -> torch.nn.Linear:
    """A new nn.Linear holding this rank's rows of `linear` (the whole
    lm_head, [V, H]): FusedHead(shard_linear(lm_head, group),
    vocab_group=group). requires_grad is kept."""
    if not isinstance(linear, torch.nn.Linear):
        raise TypeError("linear: must be a torch.nn.Linear, got "
                        f"{type(linear).__name__}")
    weight = shard_rows(linear.weight, group)
    shard = torch.nn.Linear(linear.in_features, weight.shape[0],
                            bias=linear.bias is not None,
                            device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        shard.weight.copy_(weight)
        if linear.bias is not None:
            shard.bias.copy_(shard_rows(linear.bias, group))
    shard.weight.requires_grad_(linear.weight.requires_grad)
    if linear.bias is not None:
        shard.bias.requires_grad_(linear.bias.requires_grad)
    return shard
