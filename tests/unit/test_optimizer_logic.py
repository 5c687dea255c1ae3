"""Several optimizers as one (parallel/engine/model/optim/several.py), the Muon recipe (recipes.py), the
pieces Muon gathers (muon.py, layouts.py): pure logic, one process."""

import copy

import pytest
import torch
from torch import nn

from parallel.engine.model.params import OptimizerMismatch, ParamPlan, per_parameter
from parallel.engine.model.optim.layouts import _piece, flat_run
from parallel.engine.model.optim.muon import Layout, MuonStep, Piece, replace_step
from parallel.engine.model.optim.recipes import hidden_matrices, muon_with_adamw
from parallel.engine.model.optim.several import Optimizers, Schedulers, as_one, build_scheduler


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 16), nn.LayerNorm(16),
                         nn.Linear(16, 10))


def train(m, opt, scheduler=None, steps=3):
    x = torch.arange(8).view(2, 4)
    for _ in range(steps):
        m(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()


def groups_of(m, exclude=("0.",)):
    named = list(m.named_parameters())
    return [{**g, "params": [dict(named)[n] for n in g["params"]]}
            for g in hidden_matrices(exclude)(named)]


def test_hidden_matrices_marks_2d_non_embedding_parameters():
    groups = hidden_matrices()([("model.embed_tokens.weight", torch.empty(4, 2)),
                                ("model.layers.0.q.weight", torch.empty(2, 2)),
                                ("model.layers.0.q.bias", torch.empty(2)),
                                ("lm_head.weight", torch.empty(4, 2))])
    assert groups == [{"params": ["model.layers.0.q.weight"], "use_muon": True},
                      {"params": ["model.embed_tokens.weight", "model.layers.0.q.bias",
                                  "lm_head.weight"], "use_muon": False}]


def test_muon_with_adamw_needs_marked_groups():
    with pytest.raises(ValueError, match="hidden_matrices"):
        muon_with_adamw()([torch.nn.Parameter(torch.ones(2, 2))])


def test_several_optimizers_step_as_their_members_and_schedule_each():
    m, ref = model(), model()
    opt = as_one(muon_with_adamw({"lr": 0.02}, {"lr": 1e-3})(groups_of(m)))
    plain = muon_with_adamw({"lr": 0.02}, {"lr": 1e-3})(groups_of(ref))
    decay = lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5)  # noqa: E731
    scheduler = build_scheduler(decay, opt)
    assert isinstance(opt, Optimizers) and isinstance(scheduler, Schedulers)
    train(m, opt, scheduler)
    schedules = [decay(o) for o in plain]
    x = torch.arange(8).view(2, 4)
    for _ in range(3):
        ref(x).pow(2).mean().backward()
        for o, s in zip(plain, schedules):
            o.step()
            o.zero_grad()
            s.step()
    for a, b in zip(m.parameters(), ref.parameters()):
        assert torch.equal(a, b)
    assert scheduler.get_last_lr() == [0.02 / 8, 1e-3 / 8]


def test_several_optimizers_save_and_load_as_one_and_stay_linked():
    m = model()
    opt = as_one(muon_with_adamw({"lr": 0.02}, {"lr": 1e-3})(groups_of(m)))
    train(m, opt)
    saved = copy.deepcopy(opt.state_dict())
    assert {"momentum_buffer"} <= set(saved["state"][0]) and "exp_avg" in saved["state"][2]
    other = as_one(muon_with_adamw({"lr": 0.5}, {"lr": 0.5})(groups_of(m)))
    other.load_state_dict(saved)
    muon, adamw = other.members
    assert muon.param_groups[0] is other.param_groups[0] and muon.state is other.state
    assert muon.param_groups[0]["lr"] == 0.02 and adamw.param_groups[0]["lr"] == 1e-3
    assert torch.equal(other.state[muon.param_groups[0]["params"][0]]["momentum_buffer"],
                       opt.state[opt.members[0].param_groups[0]["params"][0]]["momentum_buffer"])


def test_schedulers_refuse_a_checkpoint_with_another_count():
    opt = as_one(muon_with_adamw()(groups_of(model())))
    scheduler = build_scheduler(lambda o: torch.optim.lr_scheduler.StepLR(o, 1), opt)
    with pytest.raises(ValueError, match="one per optimizer"):
        scheduler.load_state_dict({"last_epoch": 3})


def test_overlapping_or_missing_parameters_are_named():
    m = model()
    plan = ParamPlan(m)
    both = lambda params: [torch.optim.SGD(params, lr=1), torch.optim.SGD(params[:1], lr=1)]  # noqa
    with pytest.raises(OptimizerMismatch, match=r"0\.weight.*more than one place"):
        plan.optimizer(both, per_parameter(m))
    some = lambda params: [torch.optim.SGD(params[:2], lr=1)]  # noqa: E731
    with pytest.raises(OptimizerMismatch, match="holds no entry for 5 trainable"):
        plan.optimizer(some, per_parameter(m))


def test_muon_step_over_whole_matrices_is_torchs():
    m, ref = model(), model()
    muon = torch.optim.Muon([m[1].weight, m[3].weight], lr=0.02, nesterov=False)
    replace_step(muon, MuonStep(muon, {}))
    plain = torch.optim.Muon([ref[1].weight, ref[3].weight], lr=0.02, nesterov=False)
    train(m, muon)
    train(ref, plain)
    assert torch.equal(m[1].weight, ref[1].weight) and torch.equal(m[3].weight, ref[3].weight)


def test_owners_balance_by_size_and_skip_empty_pieces():
    pieces = lambda n: [Piece(flat=slice(0, n), numel=n), Piece(flat=slice(0, 0), numel=0)]  # noqa
    big = Layout((8, 8), "g", [Piece(flat=slice(0, 32), numel=32)] * 2, 0)
    small = Layout((4, 4), "g", [Piece(flat=slice(0, 8), numel=8)] * 2, 0)
    lone = Layout((2, 2), "g", pieces(4), 0)
    step = MuonStep(torch.optim.Muon([nn.Parameter(torch.ones(2, 2))]),
                    {1: [big], 2: [small, lone]})
    assert (big.owner, small.owner, lone.owner) == (0, 1, 0)
    assert step.layouts[2][1].held == 4


def test_pieces_put_and_take_blocks_and_runs():
    whole = torch.arange(30.0).view(6, 5)
    out = torch.zeros(6, 5)
    for piece in (Piece(rows=slice(0, 3), cols=torch.tensor([1, 3]), numel=6),
                  flat_run(7, 30, 10, 20)):
        piece.put(out, piece.take(whole))
    assert torch.equal(out[:3, [1, 3]], whole[:3, [1, 3]])
    assert torch.equal(out.view(-1)[3:13], whole.view(-1)[3:13])
    assert flat_run(7, 30, 40, 50).numel == 0


class FakeMesh:
    def __init__(self, *sizes):
        self.sizes = sizes

    def size(self, i):
        return self.sizes[i]


def test_dtensor_pieces_follow_torchs_split_including_strided_rows():
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    rows = _piece((33, 20), FakeMesh(2), [Shard(0)], [1])
    assert rows.flat == slice(17 * 20, 33 * 20) and rows.numel == 16 * 20
    cols = _piece((20, 33), FakeMesh(2), [Shard(1)], [0])
    assert cols.rows == slice(0, 20) and cols.cols == slice(0, 17)
    # FSDP2 over TP: dp coordinate d, tp coordinate t holds rows (d + 2t) * 9 ... + 9 of 36
    strided = _piece((36, 12), FakeMesh(2, 2), [_StridedShard(0, split_factor=2), Shard(0)],
                     [1, 1])
    assert strided.flat == slice(27 * 12, 36 * 12)


def test_plan_counts_muons_state_and_exchange():
    from parallel.spec.io import load_spec
    from parallel.tools.comm import muon_exchange_bytes
    from parallel.tools.plan import muon_numel, optimizer_bytes

    # embedding, q, up, a norm, the head: the vocabulary's 256 in the first and last matrix only
    shapes = [(256, 32), (32, 256), (64, 32), (32,), (256, 32)]
    hidden = 32 * 256 + 64 * 32
    assert muon_numel(shapes, 256) == hidden
    total = sum(a * (b if b else 1) for a, b in [(256, 32), (32, 256), (64, 32), (32, 0),
                                                 (256, 32)])
    assert optimizer_bytes(shapes, "muon", 256) == (4 * hidden + 8 * (total - hidden)) / total
    assert optimizer_bytes(shapes, "adamw") == 8 and optimizer_bytes(shapes, "sgd") == 4
    four = load_spec({"backend": "fsdp", "topology": {"procs_per_node": 4}})
    assert muon_exchange_bytes(four, 1000) == 4 * 1000 / 4 * 3 / 4  # bf16 there and back
    none = load_spec({"backend": "fsdp", "shard": "none", "topology": {"procs_per_node": 4}})
    assert muon_exchange_bytes(none, 1000) == 0


def test_a_deepspeed_muon_block_is_refused_naming_polyshards_recipe():
    import backends.deepspeed.files.interop as ds_interop
    from parallel.spec.errors import SpecError
    from parallel.spec.io import load_spec

    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Muon", "params": {
        "lr": 1e-3, "momentum": 0.95, "weight_decay": 0.1, "muon_lr": 2e-2, "adam_lr": 3e-4}}}
    with pytest.raises(SpecError) as err:
        ds_interop.from_deepspeed(cfg, validate=load_spec)
    text = str(err.value)
    assert "optimizer" in text and "muon_with_adamw(muon={'lr': 0.02, 'weight_decay': 0.1, " \
        "'momentum': 0.95}, adamw={'lr': 0.0003, 'weight_decay': 0.1})" in text, text
    assert "hidden_matrices()" in text and "differs from DeepSpeed's own Muon" in text
