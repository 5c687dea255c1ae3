"""stream_import's places: each source rank's pieces of each parameter, put back where they say,
rebuild every parameter whole (ZeRO-3: ceil(numel / world) per rank, the last padded; ZeRO-1/2: each
group one flat vector cut in equal partitions, with DeepSpeed's alignment paddings). A torch DCP
checkpoint imported in parts (importers.read_dcp) equals its whole-state import."""

import math

import torch

from backends.deepspeed.stream_import import _zero2_places, _zero3_places

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
    from parallel.checkpoint.portable import STATE_DIR, SafeReader
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
