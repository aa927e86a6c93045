"""A fork from another thread while a vocab-parallel call waits in its
exchange: os.fork() holds the GIL through fork(), whose wait for library
calls in progress would never end while the call's exchange waits for the
GIL. The fork lands inside the exchange (a before-fork hook of the test's
own, which Python runs before dflash's, lets the exchange go on only once
the fork has begun), the call completes and equals one process's, the fork
comes after it (every exchange of the call was made when fork() returned),
and the child runs a dflash call of its own. Once through os.fork(), once
through a DataLoader starting its worker with the fork start method. And
dflash.release_cached_memory() from another thread there: it waits for the
call's host lock with the GIL released. A hang fails at the harness's join
timeout.
"""

import os
import sys
import threading
import time
import unittest

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dflash  # noqa: E402
import ranks  # noqa: E402
from dflash.torch import dflash_objective  # noqa: E402
from dflash.torch import _vocab_parallel as parallel_module  # noqa: E402
from dflash.torch.distributed import shard_rows  # noqa: E402

V, H = 23, 6
FORKING = 0
# The exchange (of the call's several: a handshake, each chunk's gathers)
# during which the fork starts.
FORK_AT = 2
CONFIG = "loss { dflash { gamma: 7 } } chunking { blocks_per_chunk: 1 }"


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 3, 4, H, dtype=torch.float64, generator=g),
            torch.randn(V, H, dtype=torch.float64, generator=g) / 2,
            torch.randint(0, V, (2, 3, 4), generator=g),
            (torch.rand(2, 3, 4, generator=g) > 0.2).double())


def _small_loss():
    """A dflash CPU call of a forked child's (and its parent's, to compare
    with): loss_num as a float."""
    hidden, weight, targets, mask = _inputs(seed=5)
    return float(dflash_objective(hidden, weight, targets, mask,
                                  threads=1).loss_num)


class _SmallCalls(torch.utils.data.Dataset):
    def __len__(self):
        return 1

    def __getitem__(self, index):
        return torch.tensor(_small_loss(), dtype=torch.float64)


def _fork_child(expected):
    """In a forked child: 0 when its own call gives `expected`."""
    try:
        return 0 if _small_loss() == expected else 1
    except BaseException:  # noqa: BLE001 - any failure is the exit code
        return 2


def _wait_for_child(pid, timeout=30.0):
    """The child's exit code; None when it still runs after `timeout` s
    (then killed)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.05)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return None


# What the other thread does during the call; each records the exchanges
# made when its step returned, and 0 for a child that did its own call.
def _by_os_fork(expected, out):
    pid = os.fork()
    if pid == 0:
        os._exit(_fork_child(expected))
    out["exchanges_after"] = out["exchanges"]()
    out["child_exit"] = _wait_for_child(pid)


def _by_data_loader(expected, out):
    loader = torch.utils.data.DataLoader(
        _SmallCalls(), batch_size=None, num_workers=1,
        multiprocessing_context="fork", timeout=30)
    iterator = iter(loader)  # Forks its worker here.
    out["exchanges_after"] = out["exchanges"]()
    out["child_exit"] = 0 if float(next(iterator)) == expected else 1
    del iterator


def _by_releasing_memory(expected, out):
    # The exchange goes on now, and needs the GIL this thread holds until
    # it blocks on the call's host lock.
    out["began"].set()
    dflash.release_cached_memory()
    out["exchanges_after"] = out["exchanges"]()
    out["child_exit"] = 0


def fork_rank(rank, world, how):
    group = dist.group.WORLD
    hidden, whole, targets, mask = _inputs(seed=3)
    expected = _small_loss()
    weight = shard_rows(whole, group)

    def loss_and_grad(w, **options):
        h = hidden.clone().requires_grad_()
        terms = dflash_objective(h, w, targets, mask, config=CONFIG,
                                 threads=1, **options)
        return terms, h

    reference, reference_hidden = loss_and_grad(whole)
    reference.loss_num.backward()

    armed = threading.Event()
    began = threading.Event()

    def before_fork():
        if armed.is_set():
            began.set()

    # Registered after dflash's hook, so Python runs it first.
    os.register_at_fork(before=before_fork)
    exchanges = []
    out = {"exchanges": lambda: len(exchanges), "began": began}
    forker = threading.Thread(
        target={"os.fork": _by_os_fork,
                "DataLoader": _by_data_loader,
                "release_cached_memory": _by_releasing_memory}[how],
        args=(expected, out))
    real_all_gather_into = parallel_module._all_gather_into

    def slowed_all_gather_into(group_, world_):
        real = real_all_gather_into(group_, world_)

        def all_gather(local, out_):
            exchanges.append(1)
            if rank == FORKING and len(exchanges) == FORK_AT:
                armed.set()
                forker.start()
                # Waits (the GIL released) until the fork has begun: its
                # wait for this call now runs, and this exchange then
                # needs the GIL again.
                out["began_inside"] = began.wait(timeout=30)
            real(local, out_)

        return all_gather

    parallel_module._all_gather_into = slowed_all_gather_into
    try:
        terms, got_hidden = loss_and_grad(weight, vocab_group=group)
    finally:
        parallel_module._all_gather_into = real_all_gather_into
    result = {"exchanges": len(exchanges)}
    if rank == FORKING:
        forker.join(timeout=60)
        result["forker_hung"] = forker.is_alive()
        result["began_inside"] = out.get("began_inside")
        result["exchanges_after"] = out.get("exchanges_after")
        result["child_exit"] = out.get("child_exit", "no child")
    terms.loss_num.backward()
    result["loss"] = (float(terms.loss_num), float(reference.loss_num))
    result["loss_den"] = (float(terms.loss_den), float(reference.loss_den))
    result["grad"] = ranks.relative_error(got_hidden.grad,
                                          reference_hidden.grad)
    return result


class DuringAVocabParallelCallTest(unittest.TestCase):
    def check(self, how):
        results = ranks.run_ranks(fork_rank, 2, how, timeout=100)
        forking = results[FORKING]
        self.assertFalse(forking["forker_hung"])
        self.assertTrue(forking["began_inside"])
        # The step began inside the call and returned after its last
        # exchange.
        self.assertGreater(forking["exchanges"], FORK_AT)
        self.assertEqual(forking["exchanges_after"], forking["exchanges"])
        self.assertEqual(forking["child_exit"], 0)
        for rank, result in enumerate(results):
            with self.subTest(rank=rank):
                got, want = result["loss"]
                self.assertAlmostEqual(got, want, delta=1e-12 * abs(want))
                got, want = result["loss_den"]
                self.assertEqual(got, want)
                self.assertLess(result["grad"], 1e-12)

    def test_os_fork(self):
        self.check("os.fork")

    def test_data_loader_worker(self):
        self.check("DataLoader")

    def test_release_cached_memory(self):
        self.check("release_cached_memory")


if __name__ == "__main__":
    unittest.main()
