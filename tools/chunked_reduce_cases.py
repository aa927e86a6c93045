#!/usr/bin/env python3
"""Writes chunking/testdata/chunked_reduce_cases.json: the cases that the
C++ ChunkedReduction (//chunking:chunked_reduce_cases_test) and the Python
dflash.torch.chunked_reduce (//tests:chunked_reduce_cases_test) both run.

Each case names a chunk function that both tests define, its inputs (null:
an absent input), the reduction's options and the gradient of the terms;
then what both must give: the width of each chunk, whether the chunks are
checkpointed, the terms and the input gradients, or the error message.
The expected terms and gradients are computed here once, in float64 over
the whole unchunked inputs (math.fsum), with no chunked reduction.

  python3 tools/chunked_reduce_cases.py > chunking/testdata/chunked_reduce_cases.json
"""

import json
import math
import re
import sys


def tensor(shape, start, requires_grad=False):
    """Exact binary fractions in [-1.5, 1.5], varied by position."""
    size = math.prod(shape)
    data = [((start + 5 * i + i * i % 7) % 13 - 6) / 4 for i in range(size)]
    return {"shape": list(shape), "data": data, "requires_grad": requires_grad}


def at(t, *index):
    flat = 0
    for extent, i in zip(t["shape"], index):
        flat = flat * extent + i
    return t["data"][flat]


def weighted_sums(values, weights, grad_terms):
    """terms: [sum(v * w)], [sum(v^2 * w)] over every element."""
    v, w = values["data"], weights["data"]
    terms = [[math.fsum(a * b for a, b in zip(v, w))],
             [math.fsum(a * a * b for a, b in zip(v, w))]]
    g0, g1 = grad_terms[0][0], grad_terms[1][0]
    grad_v = [g0 * b + g1 * 2 * a * b for a, b in zip(v, w)]
    grad_w = [g0 * a + g1 * a * a for a in v]
    return terms, [grad_v, grad_w]


def row_dot(matrix, vector, grad_terms):
    """For M [R, L] and b [L]: terms [M @ b] (R values) and
    [sum(b^2), sum(b)]."""
    rows, length = matrix["shape"]
    b = vector["data"]
    terms = [[math.fsum(at(matrix, r, j) * b[j] for j in range(length))
              for r in range(rows)],
             [math.fsum(x * x for x in b), math.fsum(b)]]
    g0, g1 = grad_terms
    grad_m = [g0[r] * b[j] for r in range(rows) for j in range(length)]
    grad_b = [math.fsum([g0[r] * at(matrix, r, j) for r in range(rows)] +
                        [g1[0] * 2 * b[j], g1[1]]) for j in range(length)]
    return terms, [grad_m, grad_b]


def widths(length, chunk_size):
    width = chunk_size or length
    return [min(width, length - start) for start in range(0, length, width)]


def case(name, function, inputs, chunk_size, dim, grad_terms=None,
         checkpoint=True, grad_enabled=True):
    present = [t for t in inputs if t is not None]
    length = present[0]["shape"][dim]
    backward = grad_enabled and any(t["requires_grad"] for t in present)
    reference = {"weighted_sums": weighted_sums, "row_dot": row_dot}[function]
    zeros = [[0.0] * 3, [0.0] * 2]  # enough for either function
    terms, grads = reference(*present, grad_terms if backward else zeros)
    grads = iter(grads)
    return {
        "name": name,
        "function": function,
        "inputs": inputs,
        "chunk_size": chunk_size,
        "dim": dim,
        "checkpoint": checkpoint,
        "grad_enabled": grad_enabled,
        # The gradient of the terms, backpropagated where some input needs
        # a gradient (null: no backward).
        "grad_terms": grad_terms if backward else None,
        "expected": {
            "widths": widths(length, chunk_size),
            "checkpointed": checkpoint and chunk_size > 0 and backward,
            "terms": terms,
            # Per input: d(grad_terms . terms)/d(input), null where the
            # input is absent or needs no gradient.
            "grads": [None if t is None else
                      (lambda g: g if backward and t["requires_grad"]
                       else None)(next(grads))
                      for t in inputs],
        },
    }


def error(name, shapes, chunk_size, dim, message):
    return {
        "name": name,
        "function": "weighted_sums",
        "inputs": [None if s is None else tensor(s, 0) for s in shapes],
        "chunk_size": chunk_size,
        "dim": dim,
        "checkpoint": True,
        "grad_enabled": True,
        "grad_terms": None,
        "error": message,
    }


def main():
    g2 = [[0.5], [1.0]]
    cases = [
        case("weighted_sums_checkpointed",
             "weighted_sums", [tensor([2, 6], 1, True), tensor([2, 6], 5),
                               None], 2, 1, g2),
        case("weighted_sums_remainder_without_checkpoint",
             "weighted_sums", [tensor([2, 6], 3, True),
                               tensor([2, 6], 9, True), None], 4, 1, g2,
             checkpoint=False),
        case("weighted_sums_chunk_size_zero_one_call",
             "weighted_sums", [tensor([2, 6], 2, True), tensor([2, 6], 4)],
             0, 1, g2),
        case("weighted_sums_dim_zero",
             "weighted_sums", [tensor([5, 2], 6, True),
                               tensor([5, 2], 8, True)], 2, 0, [[-1.0], [0.25]]),
        case("weighted_sums_no_input_needs_gradient",
             "weighted_sums", [tensor([2, 6], 1), tensor([2, 6], 5)], 2, 1),
        case("weighted_sums_gradients_disabled",
             "weighted_sums", [tensor([2, 6], 1, True), tensor([2, 6], 5)],
             2, 1, grad_enabled=False),
        case("row_dot_negative_dim_mixed_ranks",
             "row_dot", [tensor([3, 5], 2, True), None,
                         tensor([5], 11, True)], 2, -1,
             [[1.0, -0.5, 2.0], [0.75, -1.5]]),
        error("misaligned", [[2, 3], [2, 4]], 2, 1,
              "chunked reduction inputs must be aligned: expected dimension "
              "length 3, got 4"),
        error("negative_chunk_size", [[2, 3]], -1, 1,
              "chunk_size must be >= 0, got -1"),
        error("negative_chunk_size_before_no_tensor", [None], -2, 0,
              "chunk_size must be >= 0, got -2"),
        error("no_tensor", [None, None], 2, 0,
              "chunked reduction requires at least one tensor"),
        error("dim_too_large", [[2, 3]], 2, 2,
              "dim 2 is invalid for a 2D tensor"),
        error("dim_too_negative", [[6]], 2, -2,
              "dim -2 is invalid for a 1D tensor"),
        error("dim_invalid_for_second", [[2, 3], [3]], 2, 1,
              "dim 1 is invalid for a 1D tensor"),
        error("empty_dimension", [[2, 0], [2, 0]], 2, 1,
              "chunked reduction received an empty dimension"),
        error("empty_before_later_dims", [[2, 0], [4]], 2, 1,
              "chunked reduction received an empty dimension"),
    ]
    text = json.dumps({"cases": cases}, indent=1)
    # Lists of numbers on one line each.
    text = re.sub(r"\[\s+([-0-9.e,\s]+?)\s+\]",
                  lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
    sys.stdout.write(text + "\n")


if __name__ == "__main__":
    main()
