"""The engine's parts, each alone in one process: preemption (parallel/engine/watch/preempt.py), the
checkpointer through its port (parallel/engine/state/checkpointing.py), the public calls that hand to a
part (parallel/engine/core/calls.py) and the experts a step does not use (parallel/engine/model/
experts.py). The multi-process guarantees they serve are in tests/distributed."""

import os
import signal

import pytest
import torch
import torch.distributed as dist

from parallel import create_engine, load_spec
from parallel.checkpoint.format.manifest import read_manifest
from parallel.checkpoint.state.portable import read_model, save_state
from parallel.engine.state.checkpointing import Checkpointer
from parallel.engine.state.user_state import UserState
from parallel.engine.watch.preempt import REQUEUE_EXIT, AgreedFlag, Preempted, Preemption
from parallel.toy import build_llama, llama_config


@pytest.fixture
def one_rank():
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


# ---- preemption ----
def test_a_signal_becomes_an_agreed_save_and_a_requeue_exit(tmp_path):
    spec = load_spec({"checkpoint": {"dir": str(tmp_path), "preemption_signals": ["SIGUSR1"]}})
    part = Preemption(spec, is_main=False)
    previous = signal.getsignal(signal.SIGUSR1)
    try:
        part.install(AgreedFlag(torch.device("cpu")))
        saved = []
        for step in (1, 2, 3, 4):
            if step == 2:
                os.kill(os.getpid(), signal.SIGUSR1)  # caught: only a flag is set
            # the engine: step k's loss reduction carries the flag (world 1: this rank's own)
            part.record(step, part.flag(torch.device("cpu")))
            part.after_step(step, lambda path: saved.append(path) or path)
            # read `lag` - 1 steps later, at a boundary every rank reaches alike; saved once
            assert (part.pending is None) == (step < 2 + AgreedFlag.lag - 1), step
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert saved == [tmp_path / "step-00000003"]
    assert isinstance(part.pending, Preempted) and part.pending.code == REQUEUE_EXIT
    assert "this rank caught SIGUSR1" in str(part.pending)


def test_without_a_checkpoint_dir_signals_keep_their_default():
    part = Preemption(load_spec({}), is_main=False)
    before = signal.getsignal(signal.SIGTERM)
    part.install(AgreedFlag(torch.device("cpu")))
    assert part.flag(torch.device("cpu")) is None and signal.getsignal(signal.SIGTERM) == before


# ---- checkpointing, through the port ----
class Port:
    """The checkpointer's port, as a plain object: what it reads of an engine, nothing else."""

    def __init__(self, spec):
        self.spec, self.name, self.rank, self.world_size, self.is_main = spec, "port", 0, 1, True
        self.step, self.model, self.background_save = 7, torch.nn.Linear(2, 2), True
        self.device = torch.device("cpu")  # where the start-up check's numbers travel
        self.user_state, self.said, self.loaded, self.checked = UserState(), [], None, []

    def trainer_state(self):
        return {"step": self.step, "scheduler": None, "loaders": []}

    def load_trainer_state(self, state):
        self.loaded = state

    def say(self, message):
        self.said.append(message)

    def check_finite(self, wait=False):
        self.checked.append(wait)

    def barrier(self):
        pass


def test_the_checkpointer_writes_and_reads_through_the_backend_hooks_it_was_given(tmp_path):
    port = Port(load_spec({}))
    weights = {"w": torch.arange(4.0)}

    def write(sink):
        save_state({"model": weights}, sink, collective=False)

    got = {}
    part = Checkpointer(port, write, lambda path, manifest, weights_only: got.update(read_model(path)),
                        progress=type("P", (), {"at": lambda *a: None})(),
                        packages=("pydantic",))
    path = part.save(tmp_path / "ckpt")
    manifest = read_manifest(path)
    assert manifest["step"] == 7 and "pydantic" in manifest["versions"]
    assert port.checked == [True]  # never a checkpoint of parameters a NaN step updated
    part.load(path)
    assert torch.equal(got["w"], weights["w"]) and port.loaded["step"] == 7


# ---- the engine's public calls (calls.py), on one rank ----
def test_the_public_calls_hand_to_the_engines_parts(tmp_path, one_rank):
    spec = load_spec({"checkpoint": {"dir": str(tmp_path), "every": 2, "resume": "auto"}})
    engine = create_engine(spec)
    torch.manual_seed(0)
    engine.prepare(build_llama(llama_config("tiny")), (torch.optim.SGD, {"lr": 0.1}))
    ids = torch.randint(0, 256, (1, 8))
    counter = {"n": 0}

    class Counter:
        def state_dict(self):
            return dict(counter)

        def load_state_dict(self, state):
            counter.update(state)

    assert engine.register_for_checkpointing(Counter(), "counter") == "counter"
    for _ in range(2):
        engine.train_step({"input_ids": ids, "labels": ids})
        counter["n"] += 1
        engine.maybe_save()
    assert (tmp_path / "latest").read_text().strip() == "step-00000002"
    counter["n"] = 99
    assert engine.resume()["step"] == 2 and counter["n"] == 2
    loader = engine.dataloader([{"input_ids": ids[0], "labels": ids[0]}] * 2, eval=True)
    assert engine.evaluate(loader)["batches"] == 2
    from transformers import LlamaForCausalLM

    with engine.unwrap() as model:
        assert isinstance(model, LlamaForCausalLM)
    out = engine.generate(ids, max_new_tokens=2, do_sample=False)
    assert out.shape == (1, 10)
    engine.close()


# ---- experts a step does not use ----
def test_experts_no_rank_used_lose_their_gradient():
    from transformers import MixtralConfig, MixtralForCausalLM

    from parallel.engine.model.moe.experts import Experts
    from parallel.engine.model.params import per_parameter
    from parallel.toy import listed

    torch.manual_seed(0)
    # an MoE whose experts are modules of their own (transformers 5 fuses them: parallel/toy.py's listed)
    model = listed(MixtralForCausalLM(MixtralConfig(
        vocab_size=64, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=1)))
    experts = Experts(model, touch=True)
    ids = torch.randint(0, 64, (1, 3))  # 3 tokens, top-1: at most 3 of 8 experts used
    model(input_ids=ids, labels=ids).loss.backward()
    used = list(experts.used)
    assert 1 <= sum(used) <= 3
    grads = {n: p.grad is not None for n, p in model.named_parameters() if ".experts." in n}
    assert all(grads.values())  # touched on no rows: every expert has a (zero) gradient
    experts.drop_unused(per_parameter(model), torch.device("cpu"), None)
    for i, was in enumerate(used):
        for name in experts.param_names([i]):
            assert (dict(model.named_parameters())[name].grad is None) == (not was), name


def test_the_global_batch_check_counts_data_parallel_processes():
    """Under tp, 4 processes are 2 data-parallel ones: the message says the 2 it computed with."""
    from types import SimpleNamespace

    from parallel.engine.core.setup import EngineSetup
    from parallel.spec.errors import SpecError

    stand_in = SimpleNamespace(spec=SimpleNamespace(global_batch_size=16), samples_per_step=4,
                               dp_size=2, world_size=4)
    with pytest.raises(SpecError) as err:
        EngineSetup._check_global_batch(stand_in)
    assert "feeds 8 samples per step (4 per process x 2 data-parallel process(es))" in str(err.value)


# ---- the process group: destroyed at close only by the engine that made it ----
def test_close_destroys_only_a_process_group_the_engine_made(one_rank):
    def engine(backend):
        e = create_engine(load_spec({"backend": backend, "micro_batch_size": 2}))
        torch.manual_seed(0)
        e.prepare(build_llama(llama_config("tiny")), (torch.optim.AdamW, {"lr": 1e-2}))
        ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
        e.train_step({"input_ids": ids, "labels": ids})
        return e

    # the user's own group (accelerate's, a script's): the engine joins it and leaves it alive
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    users = dist.group.WORLD
    e = engine("fsdp")
    assert not e.ctx.created
    e.close()
    assert dist.is_initialized() and dist.group.WORLD is users
    dist.destroy_process_group()
    # two engines in one process, the first making the group: the second's close (ZeRO-3
    # releases its prefetched partitions over it) finds it alive, and the first's ends it
    pytest.importorskip("deepspeed")
    first, second = engine("deepspeed"), engine("deepspeed")
    assert first.ctx.created and not second.ctx.created
    second.close()
    assert dist.is_initialized()
    first.close()
    assert not dist.is_initialized()


# ---- a model with nothing to train: refused by name until #84 gives it a place ----
@pytest.mark.parametrize("backend", ["fsdp", "deepspeed"])
def test_a_frozen_model_or_no_optimizer_is_refused_naming_its_place(one_rank, backend):
    if backend == "deepspeed":
        pytest.importorskip("deepspeed")
    from parallel.engine.core.step import PrepareError

    def frozen():
        model = build_llama(llama_config("tiny"))
        model.requires_grad_(False)
        return model

    e = create_engine(load_spec({"backend": backend, "micro_batch_size": 2}))
    for call in (lambda: e.prepare(frozen), lambda: e.prepare(frozen, optimizer=None)):
        with pytest.raises(PrepareError, match=r"prepare\(model, optimizer=None\): a model without "
                                               r"trainable parameters .* several models per engine"):
            call()
    with pytest.raises(PrepareError, match="model: no parameter requires grad: a model without"):
        e.prepare(frozen, (torch.optim.AdamW, {"lr": 1e-2}))
    e.close()


def test_a_factory_that_finds_no_matrix_names_hidden_matrices():
    """#80: a user's Muon factory picks `p.dim() == 2` from the model; where the backend shards
    flat (FSDP1, XLA v1) the parameters are 1-D views at factory time and torch raised its bare
    'optimizer got an empty parameter list'."""
    from parallel.engine.core.step import PrepareError, build_optimizer

    flat = [torch.nn.Parameter(torch.zeros(12))]  # a 3 x 4 matrix, as a flat view holds it

    def users_factory(params):
        return torch.optim.Muon([p for p in flat if p.dim() == 2], lr=0.02)

    with pytest.raises(PrepareError, match=r"param_groups=hidden_matrices\(\)\) with "
                                           r"muon_with_adamw\(\)"):
        build_optimizer(users_factory, flat)
    with pytest.raises(ValueError, match="Invalid learning rate"):  # other errors are torch's
        build_optimizer((torch.optim.SGD, {"lr": -1.0}), flat)
