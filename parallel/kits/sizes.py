"""Elements a rank holds of a set of parameter shapes, under each way of cutting them into shards (a
kit: the backends' plan models, backends/<name>/plan.py, pick one; `polyshard plan` sums them)."""

from __future__ import annotations

import math


# How backends pad the elements one rank holds of parameters sharded over n ranks (their
# descriptors' plan models pick one): each parameter's dim 0 to a multiple of n (FSDP2), the
# concatenation to a multiple of n (flat layouts: FSDP1, ZeRO), or each flat parameter to a multiple
# of `multiple` x n (XLA FSDP: 128).
def numel(shapes) -> int:
    return sum(math.prod(s) for s in shapes)


def per_param_dim0(shapes, n: int) -> int:
    return numel(shapes) if n == 1 else sum(math.ceil(s[0] / n) * math.prod(s[1:]) for s in shapes)


def flat(shapes, n: int) -> int:
    return math.ceil(numel(shapes) / n)


def flat_padded(shapes, n: int, multiple: int) -> int:
    return numel(shapes) if n == 1 else math.ceil(numel(shapes) / (multiple * n)) * multiple
