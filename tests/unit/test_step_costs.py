"""The pieces that keep a step's costs counted: the step counter itself (it must see what it claims
to count), the deferred non-finite record, and the hang report's wording at scale."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from parallel.engine.watch.nonfinite import NonFiniteLossError, NonfiniteWatch
from parallel.engine.watch.hang import _ranges
from parallel.engine.core.step import StepResult
from parallel.tools.bench.counting import StepCounter


def test_the_counter_sees_host_reads_store_calls_and_nothing_else():
    store = dist.HashStore()
    store.set_timeout(timedelta(seconds=1))
    t = torch.tensor([1.5, 2.0])
    counter = StepCounter()
    with counter.step():
        float(t[0])  # a read: _local_scalar_dense
        bool(t.sum() > 0)  # another
        t.numpy().tolist()  # host memory: no read
        (t * 2).add_(1)  # compute: nothing
        store.set("k", "v")
        store.add("n", 1)
        store.get("k")
    with counter.step():
        float(t[1])
        t.numpy().tolist()
        (t * 2).add_(1)
        store.set("k", "w")
        store.add("n", 1)
        store.get("k")
    assert counter.steps[0] == {"host_reads": 2, "store_writes": 2, "store_reads": 1}
    with pytest.raises(ValueError, match="differs"):
        counter.per_step()  # 1 read in the second step: not steady
    store.set("after", "x")  # counting is over: the original methods are back
    assert counter.steps[1]["store_writes"] == 2


def test_a_step_result_reads_its_loss_once():
    counter = StepCounter()
    result = StepResult(step=1, loss_tensor=torch.tensor(2.5), grad_norm_tensor=None, lr=0.1,
                        tokens=4, step_time=0.0)
    with counter.step():
        assert result.loss == 2.5 and result.loss == 2.5
    assert counter.steps[0]["host_reads"] == 1
    cached = StepResult(step=1, loss_tensor=torch.tensor(2.5), grad_norm_tensor=None, lr=0.1,
                        tokens=4, step_time=0.0, loss_value=2.5)  # raise/skip read it already
    with counter.step():
        assert cached.loss == 2.5
    assert counter.steps[1]["host_reads"] == 0


def test_deferred_record_names_the_first_bad_step_without_reading_the_device():
    watch = NonfiniteWatch(torch.device("cpu"))
    watch.at(10)  # resumed after step 10
    counter = StepCounter()
    with counter.step():
        watch.record(torch.tensor(1.0), torch.tensor(1.0))  # step 11: fine
        watch.check(11)
        watch.record(torch.tensor(float("nan")), torch.tensor(0.5))  # step 12: another rank's NaN
        watch.record(torch.tensor(float("inf")), torch.tensor(float("inf")))  # step 13: ours too
    assert counter.steps[0].get("host_reads", 0) == 0
    with pytest.raises(NonFiniteLossError, match=r"^step 12: .*own loss was non-finite from step "
                                                 r"13\), found at step 14"):
        watch.check(14)
    with pytest.raises(NonFiniteLossError, match="^step 12"):
        watch.check(14, wait=True)  # save and close read the device itself


def test_hang_reports_name_ranks_as_ranges():
    assert _ranges([0, 1, 2, 5, 7, 8]) == "0-2, 5, 7-8"
    assert _ranges([3]) == "3"
    assert _ranges(list(range(0, 40, 2))).endswith(" ...")  # thousands of ranks stay one line
