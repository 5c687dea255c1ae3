"""Python's cyclic garbage collector around work that makes many objects (a save, a load) or that a
library runs full collections in (XLA FSDP's wrap, DeepSpeed's ZeRO-3 initialize). One place for
both, so every caller pauses or narrows it the same way. And the C library's heap where the host
memory is the measure (`fixed_mmap_threshold`: a dry run's)."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def paused_gc() -> Iterator[None]:
    """The collector off for the length of a save or load: DCP's plans and the state's containers
    allocate enough objects to trigger full collections in the middle (measured: a 56M-parameter
    FSDP2 load took 0.15 s or, when a collection fell inside it, 0.32 s; torchtitan runs with the
    collector off and collects between steps). Anything cyclic is collected at the next automatic
    collection."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@contextmanager
def young_heap(collect_after: bool = False) -> Iterator[None]:
    """Inside, gc.collect() scans only the objects made inside: everything alive before (torch's,
    transformers' and DeepSpeed's modules, millions of objects) is frozen meanwhile, and unfrozen
    at the end (nothing outlives it). Measured, each full collection 0.29-0.46 s on this host:
    - a streamed write collects after every part: 43 collections were 12 s of a universal
      import's 18 s (cProfile);
    - XLA FSDP v1 collects once per unit it wraps (`execute_sharding_on_init`): 11.1 s of a 34 s
      XLA job that builds 2 engines of 12 units;
    - DeepSpeed's ZeRO-3 collects in its parameter defragmentation: 4.6 s of 10 engines' 10 s
      initialize.
    What a library's collection inside is for, the cyclic garbage the work makes, is made inside
    and still collected; tensors freed by reference counting (the unsharded parameters a wrap
    replaces) are freed as ever. `collect_after`: one full collection at the end, so garbage older
    than the work is gone when it returns, as the library's own collections left it. Where the
    process froze its heap itself (gc.freeze, a fork server's habit), it is left as it is:
    unfreezing would undo the caller's."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
    if collect_after:
        gc.collect()


def fixed_mmap_threshold() -> None:
    """glibc serves an allocation above its mmap threshold by mmap and returns it at free, but
    raises the threshold to each such block freed (up to 32 MiB), after which large blocks come
    from the heap, which fragments and rarely shrinks: a dry run's host memory grew by about 0.5
    GiB per Qwen3-30B-A3B block (9.4 GiB at 12 blocks against a 3.3 GiB peak of live tensors), and
    48 blocks were killed at 22 GiB (`polyshard dryrun`). Fixed at 1 MiB (what
    MALLOC_MMAP_THRESHOLD_ sets): 4.7 GiB.
    A no-op where the C library is not glibc."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass
