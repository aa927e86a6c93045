"""dflash inside a training process: forked data-loader workers, weights
written in place, memory and thread limits, Ctrl-C, autograd's rules. Each
case ends in the right result or a clear Python exception, never a hang,
a crash or a stale answer."""

import multiprocessing
import os
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time
import traceback
import unittest

import torch

import dflash
import reference
from dflash.torch import FusedHead, dflash_objective

CPUS = len(os.sched_getaffinity(0))


def batch(seed=30, V=50, H=16, N=6):
    data = reference.batch(seed=seed, N=N, H=H, V=V, dtype=torch.float32)
    return data["hidden"], data["weight"], data["target_ids"], data["weight_mask"]


def run(hidden, weight, target_ids, weight_mask, **options):
    """loss_num and d(loss_num)/d(hidden), as float64."""
    hidden = hidden.clone().requires_grad_()
    terms = dflash_objective(hidden, weight, target_ids, weight_mask, **options)
    terms.loss_num.backward()
    return terms.loss_num.double().item(), hidden.grad.double()


def _child(queue, hidden, weight, target_ids, weight_mask, threads):
    loss, grad = run(hidden, weight, target_ids, weight_mask, threads=threads)
    queue.put((loss, grad.sum().item(), grad.abs().max().item()))


class ForkTest(unittest.TestCase):
    """A forked child works after the parent ran on several threads, and
    while another thread of the parent is inside a call."""

    def fork_run(self, args, threads):
        context = multiprocessing.get_context("fork")
        queue = context.Queue()
        child = context.Process(target=_child, args=(queue,) + args +
                                (threads,))
        child.start()
        child.join(120)
        if child.is_alive():
            child.kill()
            self.fail("the forked child hung")
        self.assertEqual(child.exitcode, 0)
        return queue.get(timeout=10)

    def test_child_after_a_parent_call(self):
        args = batch()
        loss, grad = run(*args, threads=0)  # Starts OpenMP's threads here.
        got = self.fork_run(args, threads=0)
        self.assertAlmostEqual(got[0], loss, delta=1e-6 * abs(loss))
        self.assertAlmostEqual(got[1], grad.sum().item(), delta=1e-5)
        self.assertAlmostEqual(got[2], grad.abs().max().item(), delta=1e-6)

    def test_child_forked_while_a_call_runs(self):
        args = batch()
        loss, _ = run(*args)
        # A call of about a second on another thread; the fork lands inside.
        big = batch(seed=31, V=8000, H=256, N=64)
        started = threading.Event()

        def long_call():
            started.set()
            for _ in range(3):
                run(*big, chunk_blocks=1, threads=0)

        worker = threading.Thread(target=long_call)
        worker.start()
        started.wait()
        time.sleep(0.2)
        got = self.fork_run(args, threads=0)
        worker.join()
        self.assertAlmostEqual(got[0], loss, delta=1e-6 * abs(loss))


class StaleWeightTest(unittest.TestCase):
    """A weight changed in place, even through .data (which torch's version
    counter misses), is never served from an old layout."""

    def test_fused_head_after_data_writes(self):
        hidden, weight, target_ids, weight_mask = batch()
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=True)
        with torch.no_grad():
            linear.weight.copy_(weight)
        head = FusedHead(linear)
        fresh = lambda: dflash_objective(  # noqa: E731
            hidden, linear.weight.detach().clone(), target_ids, weight_mask,
            lm_head_bias=linear.bias.detach().clone()).loss_num.item()
        self.assertAlmostEqual(head(hidden, target_ids, weight_mask)
                               .loss_num.item(), fresh(), places=4)
        prepared = head._prepared
        for change in (lambda: linear.weight.data.mul_(2),
                       lambda: linear.weight.data.copy_(
                           torch.randn_like(linear.weight)),
                       lambda: linear.bias.data[3:9].add_(1.5),
                       lambda: linear.weight.data[7, 3].add_(0.25)):
            before = head(hidden, target_ids, weight_mask).loss_num.item()
            change()
            after = head(hidden, target_ids, weight_mask)
            self.assertNotEqual(after.loss_num.item(), before)
            self.assertAlmostEqual(after.loss_num.item(), fresh(), places=4)
            self.assertIs(head._prepared, prepared)  # Laid out in place.

    def test_prepared_projection_after_an_in_place_write(self):
        hidden, weight, target_ids, weight_mask = batch()
        weight = weight.clone()
        prepared = dflash.PreparedProjection(weight)
        call = lambda **o: dflash_objective(  # noqa: E731
            hidden, weight, target_ids, weight_mask, **o)
        self.assertEqual(call(prepared_projection=prepared).loss_num,
                         call().loss_num)
        weight.data.mul_(-0.5)
        terms = call(prepared_projection=prepared)
        self.assertEqual(terms.loss_num, call().loss_num)
        self.assertGreater(prepared.prepare_seconds, 0)


def in_subprocess(body):
    """Runs `body` (Python source) in a fresh interpreter with dflash and
    the tests importable; returns (exit code, stdout + stderr)."""
    program = textwrap.dedent("""
        import os, resource, sys, threading
        import torch
        import dflash, reference
        from dflash.torch import dflash_objective

        def mapped():
            with open("/proc/self/status") as status:
                for line in status:
                    if line.startswith("VmSize:"):
                        return int(line.split()[1]) * 1024

        def limit(extra):
            # Address space now plus `extra` bytes.
            resource.setrlimit(resource.RLIMIT_AS,
                               (mapped() + extra, resource.RLIM_INFINITY))
        """) + textwrap.dedent(body)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", program], env=env,
                          capture_output=True, text=True, timeout=300)
    return done.returncode, done.stdout + done.stderr


class LimitsTest(unittest.TestCase):
    def test_layout_out_of_memory_is_a_memory_error(self):
        code, out = in_subprocess("""
            weight = torch.zeros(8192, 4096)  # 128 MiB, touched.
            limit(64 << 20)  # Not room for its two laid-out copies.
            try:
                dflash.PreparedProjection(weight, threads=1)
            except MemoryError as error:
                print("MemoryError:", error)
            """)
        self.assertEqual(code, 0, out)
        self.assertIn("MemoryError: out of memory laying out the lm_head "
                      "weight [8192, 4096] for oneDNN: two copies of ", out)
        self.assertIn("bytes", out)

    def test_gradient_out_of_memory_is_a_memory_error(self):
        code, out = in_subprocess("""
            data = reference.batch(seed=1, dtype=torch.float32)
            weight = torch.zeros(200000, 8, requires_grad=True)  # 6 MiB.
            limit(2 << 20)  # No room for its gradient.
            try:
                dflash_objective(data["hidden"], weight, data["target_ids"],
                                 data["weight_mask"])
            except MemoryError as error:
                print("MemoryError:", error)
            """)
        self.assertEqual(code, 0, out)
        self.assertIn("MemoryError: the gradient of lm_head_weight: cannot "
                      "allocate [200000, 8] torch.float32 (6400000 bytes) on "
                      "cpu: out of memory", out)

    @unittest.skipIf(CPUS < 2, "one usable CPU: no thread to start")
    def test_threads_that_cannot_start_are_an_error(self):
        code, out = in_subprocess("""
            data = reference.batch(seed=1, dtype=torch.float32)
            args = (data["hidden"], data["weight"], data["target_ids"],
                    data["weight_mask"])
            dflash_objective(*args, threads=1)
            def call():
                # A fresh thread has no OpenMP team yet; no room for a
                # thread's stack.
                limit(1 << 20)
                try:
                    dflash_objective(*args, threads=2)
                except RuntimeError as error:
                    print("RuntimeError:", error)
                resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY,
                                                        resource.RLIM_INFINITY))
                print("after:", dflash_objective(*args, threads=2).loss_num)
            t = threading.Thread(target=call)
            t.start()
            t.join()
            """)
        self.assertEqual(code, 0, out)
        self.assertIn("RuntimeError: head.threads: cannot start 2 threads", out)
        self.assertIn("after: tensor(", out)


class InterruptTest(unittest.TestCase):
    def test_ctrl_c_stops_a_long_call(self):
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            self.skipTest("SIGINT is not Python's default handler here")
        # One call of ten times as many blocks, chunk by chunk; SIGINT when
        # a tenth of it has run three times over: well inside its forward,
        # however fast this build runs.
        unit = batch(seed=32, V=20000, H=256, N=128)
        start = time.monotonic()
        run(*unit, chunk_blocks=1, threads=1)
        tenth = time.monotonic() - start
        long_call = batch(seed=32, V=20000, H=256, N=1280)
        timer = threading.Timer(3 * tenth, os.kill,
                                (os.getpid(), signal.SIGINT))
        frames = []
        start = time.monotonic()
        timer.start()
        try:
            run(*long_call, chunk_blocks=1, threads=1)
        except KeyboardInterrupt as interrupt:
            frames = [f.name for f in traceback.extract_tb(
                interrupt.__traceback__)]
        stopped = time.monotonic() - start
        timer.join()
        # Raised from inside the call (its forward), not after it returned.
        self.assertIn("forward", frames)
        self.assertLess(stopped, 8 * tenth)
        # Nothing is left half-done: the next call gives the same answer.
        small = batch()
        self.assertEqual(run(*small)[0], run(*small)[0])


class AutogradTest(unittest.TestCase):
    def test_backward_twice_raises_as_torch_does(self):
        hidden, weight, target_ids, weight_mask = batch()
        hidden.requires_grad_()
        terms = dflash_objective(hidden, weight, target_ids, weight_mask)
        terms.loss_num.backward()
        with self.assertRaisesRegex(RuntimeError,
                                    "backward through the graph a second"):
            terms.loss_num.backward()
        # With retain_graph the gradients add up, as for torch's own ops.
        hidden.grad = None
        terms = dflash_objective(hidden, weight, target_ids, weight_mask)
        terms.loss_num.backward(retain_graph=True)
        once = hidden.grad.clone()
        terms.loss_num.backward()
        torch.testing.assert_close(hidden.grad, 2 * once)

    def test_double_backward_names_dflash_objective(self):
        hidden, weight, target_ids, weight_mask = batch()
        hidden.requires_grad_()
        terms = dflash_objective(hidden, weight, target_ids, weight_mask)
        (grad,) = torch.autograd.grad(terms.loss_num, hidden,
                                      create_graph=True)
        message = "dflash_objective: double backward is not supported"
        with self.assertRaisesRegex(RuntimeError, message):
            grad.sum().backward()
        # Differentiated with respect to an input: the error, not "unused".
        terms = dflash_objective(hidden, weight, target_ids, weight_mask)
        (grad,) = torch.autograd.grad(terms.loss_num, hidden,
                                      create_graph=True)
        with self.assertRaisesRegex(RuntimeError, message):
            torch.autograd.grad(grad.sum(), hidden)
        # A Hessian-vector product: the error, not zeros.
        loss = lambda h: dflash_objective(  # noqa: E731
            h, weight, target_ids, weight_mask).loss_num
        with self.assertRaisesRegex(RuntimeError, message):
            torch.autograd.functional.hvp(loss, hidden.detach(),
                                          torch.ones_like(hidden))
        # A trainable weight alike.
        weight = weight.clone().requires_grad_()
        terms = dflash_objective(hidden, weight, target_ids, weight_mask)
        (grad,) = torch.autograd.grad(terms.loss_num, weight,
                                      create_graph=True)
        with self.assertRaisesRegex(RuntimeError, message):
            torch.autograd.grad(grad.sum(), weight)
        # First derivatives with create_graph stay right.
        hidden2 = hidden.detach().clone().requires_grad_()
        terms = dflash_objective(hidden2, weight.detach(), target_ids,
                                 weight_mask)
        (with_graph,) = torch.autograd.grad(terms.loss_num, hidden2,
                                            create_graph=True)
        terms = dflash_objective(hidden2, weight.detach(), target_ids,
                                 weight_mask)
        (plain,) = torch.autograd.grad(terms.loss_num, hidden2)
        torch.testing.assert_close(with_graph.detach(), plain)


if __name__ == "__main__":
    unittest.main(verbosity=2)
