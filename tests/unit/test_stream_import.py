"""stream_import's places: each source rank's pieces of each parameter, put back where they say,
rebuild every parameter whole (ZeRO-3: ceil(numel / world) per rank, the last padded; ZeRO-1/2: each
group one flat vector cut in equal partitions, with DeepSpeed's alignment paddings). A torch DCP
checkpoint imported in parts (importers.read_dcp) equals its whole-state import."""

import math

import torch

from backends.deepspeed.checkpoint.stream_import import _zero2_places, _zero3_places

SHAPES = [{"a": (5, 3), "b": (7,)}, {"c": (2, 2)}]


def rebuild(places, flats_per_rank, world, paddings=None):
    whole = {n: torch.full((math.prod(s),), float("nan")) for g in SHAPES for n, s in g.items()}
    for rank in range(world):
        for name, shape, g, lo, start, n in places(SHAPES, flats_per_rank[rank], rank, world,
                                                   paddings):
            whole[name][start:start + n] = flats_per_rank[rank][g][lo:lo + n]
    return whole


def originals():
    torch.manual_seed(0)
    return {n: torch.randn(math.prod(s)) for g in SHAPES for n, s in g.items()}


def test_zero3_pieces_rebuild_every_parameter():
    values, world = originals(), 3
    flats = []
    for rank in range(world):
        pieces = []
        for g in SHAPES:
            for n in g:
                piece = math.ceil(values[n].numel() / world)
                padded = torch.cat([values[n], torch.zeros(piece * world - values[n].numel())])
                pieces.append(padded[rank * piece:(rank + 1) * piece])
        flats.append([torch.cat(pieces[:2]), pieces[2]])  # two sub-groups, as SHAPES
    whole = rebuild(_zero3_places, flats, world)
    assert all(torch.equal(whole[n], values[n]) for n in values)


def test_zero2_partitions_rebuild_every_parameter_with_paddings():
    values, world = originals(), 2
    paddings = [[1, 0], [0]]  # DeepSpeed's per-parameter alignment padding after a
    flats = [[], []]
    for gi, g in enumerate(SHAPES):
        parts = []
        for j, n in enumerate(g):
            parts += [values[n], torch.zeros(paddings[gi][j])]
        vector = torch.cat(parts)
        size = math.ceil(vector.numel() / world)
        vector = torch.cat([vector, torch.zeros(size * world - vector.numel())])
        for rank in range(world):
            flats[rank].append(vector[rank * size:(rank + 1) * size])
    whole = rebuild(_zero2_places, flats, world, paddings)
    assert all(torch.equal(whole[n], values[n]) for n in values)


def test_a_dcp_checkpoint_imported_in_parts_equals_the_whole_import(tmp_path):
    """Written as torchtitan and Accelerate write it (get_state_dict, dcp.save); imported in parts
    of 64 KiB (each its own DCP read of the source) and whole: the same entries, every tensor and
    the param groups equal."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from parallel.checkpoint.importers import _load_keys, dcp_parts, import_checkpoint, read_dcp
    from parallel.checkpoint.state.portable import STATE_DIR, SafeReader
    from parallel.toy import build_llama, llama_config

    torch.manual_seed(0)
    model = build_llama(llama_config("tiny"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 256, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    src = tmp_path / "src"
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(src), no_dist=True)
    parts = dcp_parts(SafeReader(str(src)).read_metadata(), 64 << 10)
    assert len(parts) > 5 and len({k for p in parts for k in p}) == sum(map(len, parts))
    out = {kind: import_checkpoint(read, "dcp", src, tmp_path / kind, step=1) for kind, read in (
        ("streamed", lambda s, trust: read_dcp(s, trust, budget=64 << 10)),
        ("whole", lambda s, trust: read_dcp(s, trust, stream=False)))}
    a, b = (_load_keys(SafeReader(str(out[k] / STATE_DIR)), None) for k in ("streamed", "whole"))
    assert a["optim"]["param_groups"] == b["optim"]["param_groups"]
    flat = lambda sd: {(h, k): v for h in ("model", "optim") for k, v in  # noqa: E731
                       (sd[h] if h == "model" else sd[h]["state"]).items()}
    fa, fb = flat(a), flat(b)
    assert fa.keys() == fb.keys() and len(fa) == 2 * len(msd)
    for key in fa:
        left, right = fa[key], fb[key]
        if isinstance(left, dict):  # an optimizer entry
            assert left.keys() == right.keys() == {"step", "exp_avg", "exp_avg_sq"}, key
            assert all(torch.equal(left[n], right[n]) for n in left), key
        else:
            assert torch.equal(left, right), key


def xla_world1() -> tuple[dict, dict]:
    """One rank's XLA FSDP v1 file as torch_xla lays it out, and the tensors it holds: a parameter
    sharded flat (padded to 4 elements), one sharded by rows (shard_param_on_dim_0), a nested XLA
    FSDP whose three parameters are one flat parameter (flatten_parameters), a buffer kept in fp32
    whose own dtype is fp64; AdamW moments shaped like the shards."""
    torch.manual_seed(0)
    emb, head, scale = torch.randn(7, 5), torch.randn(7, 3), torch.randn(3).double()  # fp32 values
    inner = {"a.weight": torch.randn(5, 3), "a.bias": torch.randn(5), "b.weight": torch.randn(2, 7)}
    root, block = "_fsdp_wrapped_module._fpw_module.", "_fsdp_wrapped_module._fpw_module.block"
    flat = torch.cat([t.reshape(-1) for t in inner.values()])
    model = {"_fsdp_shard_emb": torch.nn.functional.pad(emb.reshape(-1), [0, 1]),
             f"{block}._fsdp_shard_flat": torch.nn.functional.pad(flat, [0, 2]),
             "_fsdp_shard_head": head, f"{root}scale": scale.float()}
    shard = lambda name, size: {"_orig_name": f"{root}{name}", "_orig_size": size}  # noqa: E731
    meta = {"world_size": 1, "rank": 0, "buffer_info": {f"{root}scale": {"_orig_dtype": torch.float64}},
            "shard_info": {"": {"_fsdp_shard_emb": shard("emb.weight", [7, 5]),
                                "_fsdp_shard_head": shard("head.weight", [7, 3])},
                           block: {"_fsdp_shard_flat": {"_orig_name": "_fsdp_wrapped_module.flat_param_0",
                                                        "_orig_size": [34]}}},
            "flatten_info": {f"{block}._fsdp_wrapped_module.flat_param_0": (
                list(inner), [tuple(t.shape) for t in inner.values()], [t.numel() for t in inner.values()])}}
    sharded = [k for k in model if "_fsdp_shard" in k]
    optim = {"state": {i: {"step": torch.tensor(3.0), "exp_avg": torch.randn_like(model[k]),
                           "exp_avg_sq": torch.rand_like(model[k])} for i, k in enumerate(sharded)},
             "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0,
                               "params": [0, 1, 2]}]}
    tensors = {"emb.weight": emb, "head.weight": head, "scale": scale,
               **{f"block.{n}": t for n, t in inner.items()}}
    return {"model": model, "shard_metadata": meta, "optimizer": optim}, tensors


def test_xla_shard_files_imported_rank_by_rank_equal_torch_xlas_consolidation(tmp_path):
    """XLA FSDP v1 files at 3 ranks (tests/xla_shards.py cuts them as torch_xla does), imported
    streamed (one rank's file mapped at a time) and whole (torch_xla's consolidate_sharded_state_dicts):
    the same entries bit for bit, the weights the originals, pieces that straddle ranks included;
    files that do not belong together, and a linked one, are refused, naming the file."""
    import pytest

    # torch_xla's own consolidation is the oracle: in the XLA lane's process (make test-xla)
    pytest.importorskip("torch_xla", reason="the XLA lane's (make test-xla): torch_xla's oracle")
    from xla_shards import reshard

    from backends.xla.native_checkpoint import read_xla
    from parallel.checkpoint.importers import CheckpointImportError, _load_keys, import_checkpoint
    from parallel.checkpoint.state.portable import STATE_DIR, SafeReader
    from parallel.files import FileError

    saved, tensors = xla_world1()
    src = tmp_path / "src"
    src.mkdir()
    for r, part in enumerate(reshard([saved], 3, multiple=4)):
        torch.save(part, src / f"ckpt_rank-{r:08d}-of-00000003.pth")
    out = {kind: import_checkpoint(lambda s, trust: read_xla(s, trust, stream=kind == "streamed"),
                                   "xla", src, tmp_path / kind, step=3) for kind in ("streamed", "whole")}
    a, b = (_load_keys(SafeReader(str(out[k] / STATE_DIR)), None) for k in ("streamed", "whole"))
    assert a["model"].keys() == b["model"].keys() == tensors.keys()
    assert all(torch.equal(a["model"][n], t) and torch.equal(b["model"][n], t) for n, t in tensors.items())
    assert a["model"]["scale"].dtype == torch.float64
    # the same groups; streamed, the names in parameters() order (consolidation puts flat ones last)
    assert [{**g, "params": sorted(g["params"])} for g in a["optim"]["param_groups"]] == \
        [{**g, "params": sorted(g["params"])} for g in b["optim"]["param_groups"]]
    assert a["optim"]["param_groups"][0]["params"] == ["emb.weight", "block.a.weight", "block.a.bias",
                                                       "block.b.weight", "head.weight"]
    assert a["optim"]["state"].keys() == b["optim"]["state"].keys() == tensors.keys() - {"scale"}
    for name, entry in a["optim"]["state"].items():
        assert entry.keys() == {"step", "exp_avg", "exp_avg_sq"}
        assert all(torch.equal(entry[k], b["optim"]["state"][name][k]) for k in entry), name
    (src / "ckpt_rank-00000001-of-00000003.pth").rename(tmp_path / "rank1.pth")
    with pytest.raises(CheckpointImportError, match="not ranks 0..1"):
        read_xla(src)
    (src / "ckpt_rank-00000002-of-00000003.pth").rename(src / "ckpt_rank-00000001-of-00000003.pth")
    with pytest.raises(CheckpointImportError, match="world size 3, but the directory holds 2"):
        read_xla(src)
    # a rank's file that is a link (here to the real one, moved out): never followed, exit 2
    (src / "ckpt_rank-00000001-of-00000003.pth").rename(src / "ckpt_rank-00000002-of-00000003.pth")
    (src / "ckpt_rank-00000001-of-00000003.pth").symlink_to(tmp_path / "rank1.pth")
    for stream in (True, False):
        with pytest.raises(FileError, match="rank-00000001-of-00000003.pth: a symbolic link"):
            read_xla(src, stream=stream)
    bad = tmp_path / "bad"
    bad.mkdir()
    (flat,) = saved["shard_metadata"]["flatten_info"].values()
    flat[2][0] += 1  # a flat parameter's numel that is not its shape's
    torch.save(saved, bad / "ckpt_rank-00000000-of-00000001.pth")
    with pytest.raises(CheckpointImportError, match="does not describe .*_fsdp_shard_flat"):
        read_xla(bad)


def test_deepspeeds_latest_pointer_is_never_read_through_a_link(tmp_path):
    """`latest` names the tag directory; a link in its place (to a file naming another tag) is
    exit 2 naming it, a plain one is followed to its tag."""
    import pytest

    from backends.deepspeed.checkpoint.native_checkpoint import _tag_dir
    from parallel.files import FileError

    (tmp_path / "global_step3").mkdir()
    (tmp_path / "elsewhere").write_text("global_step3")
    (tmp_path / "latest").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(FileError, match="latest: a symbolic link"):
        _tag_dir(tmp_path, "latest")
    (tmp_path / "latest").unlink()
    (tmp_path / "latest").write_text("global_step3\n")
    assert _tag_dir(tmp_path, "latest") == tmp_path / "global_step3"
