"""GlobalNormalizer.step reads the device once a step: on two gloo ranks,
the collectives' outputs are marked as device tensors (DeviceTensor, a
torch.Tensor subclass that records each read of its values to the host),
and a step with the agreed layout reads once (the summed buffer), the
first step twice (the layouts, then the buffer) and a step whose pairs
changed three times (the flagged buffer, the layouts, the buffer again).
The loss and a metric are checked against sums worked out by hand.
"""

import os
import sys
import unittest
from typing import Any, Dict, List
from unittest import mock

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import ranks  # noqa: E402
from dflash.torch.distributed import GlobalNormalizer  # noqa: E402

# What copies a tensor's values to the host (a sync on a CUDA device).
_READS = frozenset(("cpu", "to", "tolist", "item", "numpy", "__array__",
                    "__float__", "__int__", "__bool__", "__index__",
                    "__repr__", "__format__"))
_reads: List[str] = []


class DeviceTensor(torch.Tensor):
    """Stands for a tensor on the device: reading its values to the host
    is recorded in _reads and gives a plain (host) tensor; its views and
    the results of other ops stay DeviceTensors."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        out = super().__torch_function__(func, types, args, kwargs)
        name = getattr(func, "__name__", "")
        if name not in _READS:
            return out
        _reads.append(name)
        return (out.as_subclass(torch.Tensor)
                if isinstance(out, torch.Tensor) else out)


def _all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    result = _REAL_ALL_REDUCE(tensor, *args, **kwargs)
    tensor.__class__ = DeviceTensor
    return result


def _all_gather(tensors: List[torch.Tensor], *args: Any,
                **kwargs: Any) -> Any:
    result = _REAL_ALL_GATHER(tensors, *args, **kwargs)
    for tensor in tensors:
        tensor.__class__ = DeviceTensor
    return result


_REAL_ALL_REDUCE = dist.all_reduce
_REAL_ALL_GATHER = dist.all_gather


def _steps(rank: int, world: int) -> List[Dict[str, Any]]:
    """Three windows of one micro-batch: (rank + 1) / 2 as the loss pair,
    an extra metric pair 1 / 2 in the third; each step's reads."""
    norm = GlobalNormalizer(mode="dflash", grad_sync="sum")
    out = []
    for window in range(3):
        norm.loss((torch.tensor(rank + 1.0, dtype=torch.float64),
                   torch.tensor(2.0, dtype=torch.float64)))
        if window == 2:
            norm.add_metric("extra", 1.0, 2.0)
        del _reads[:]
        with mock.patch.object(dist, "all_reduce", _all_reduce), \
                mock.patch.object(dist, "all_gather", _all_gather):
            result = norm.step()
        out.append({"reads": list(_reads), "loss": result.loss,
                    "metrics": {n: float(v)
                                for n, v in result.metrics.items()}})
    return out


class StepReadsTest(unittest.TestCase):
    def test_one_read_of_the_device_a_step(self):
        results = ranks.run_ranks(_steps, 2)
        for rank, steps in enumerate(results):
            with self.subTest(rank=rank):
                counts = [len(s["reads"]) for s in steps]
                self.assertEqual(counts, [2, 1, 3],
                                 [s["reads"] for s in steps])
                for s in steps:
                    # (1 + 2) / (2 + 2) on every rank and window.
                    self.assertEqual(s["loss"], 0.75)
                    self.assertEqual(s["metrics"]["loss"], 0.75)
                self.assertEqual(steps[2]["metrics"]["extra"], 0.5)


if __name__ == "__main__":
    unittest.main()
