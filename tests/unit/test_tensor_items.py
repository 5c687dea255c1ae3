"""DCP's items read once per distinct pickle (parallel/checkpoint/format/tensor_items.py): every tensor equal
to what torch.load gives, dtype, shape, strides and storage offset included; a later item with the
same pickle reads its own values; what the view cannot hold falls back to torch.load; a damaged item
is refused naming its file; a whole DCP checkpoint reads the same through SafeReader as through
DCP's own reader."""

import io

import pytest
import torch
import torch.distributed.checkpoint as dcp

from parallel.checkpoint.state.portable import SafeReader, dcp_load
from parallel.checkpoint.format.safe import UnsafeFileError
from parallel.checkpoint.format.tensor_items import TensorItems


def saved(t) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def same(a, b) -> bool:
    return (torch.equal(a, b) and a.dtype == b.dtype and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset())


CASES = {
    "fp32": lambda g: torch.randn(5, 7, generator=g),
    "bf16": lambda g: torch.randn(3, 4, generator=g).bfloat16(),
    "int64": lambda g: torch.randint(0, 1 << 40, (6,), generator=g),
    "bool": lambda g: torch.rand(9, generator=g) > 0.5,
    "scalar": lambda g: torch.randn((), generator=g),
    "view with an offset": lambda g: torch.randn(20, generator=g)[3:11],
    "transposed": lambda g: torch.randn(4, 6, generator=g).t(),
    "empty": lambda g: torch.empty(0, 3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_each_item_is_what_torch_load_gives_first_and_after(name):
    items, g = TensorItems(), torch.Generator().manual_seed(0)
    first, second = CASES[name](g), CASES[name](g)  # the same layout, other values
    blobs = [saved(first), saved(second)]
    if name not in ("empty", "bool"):  # identical pickles: the second is read as a view
        assert blobs[0] != blobs[1]
    for t, raw in zip((first, second), blobs):
        got = items.load(raw)
        assert same(got, torch.load(io.BytesIO(raw), weights_only=True)) and same(got, t), name


def test_a_later_item_that_is_no_longer_whole_is_refused():
    items = TensorItems()
    items.load(saved(torch.randn(1000)))
    raw = saved(torch.randn(1000))
    with pytest.raises(ValueError, match="not a torch.save archive"):
        items.load(raw[:len(raw) // 2])


def test_a_dcp_checkpoint_reads_the_same_as_through_dcps_reader(tmp_path):
    g = torch.Generator().manual_seed(1)
    state = {f"layer{i}.{k}": torch.randn(8, 16, generator=g) for i in range(12) for k in "ab"}
    state |= {"norm": torch.randn(16, generator=g), "step": 7, "extra": {"lr": [0.1, 0.2]}}
    dcp.save(state, checkpoint_id=str(tmp_path), no_dist=True)

    def empty():  # what the load must fill: zeros, and other values for the byte entries
        return {**{k: torch.zeros_like(v) for k, v in state.items() if torch.is_tensor(v)},
                "step": 0, "extra": {"lr": [0.0, 0.0]}}

    ours, theirs = empty(), empty()
    dcp_load(ours, SafeReader(str(tmp_path)))
    dcp.load(theirs, storage_reader=dcp.FileSystemReader(str(tmp_path)), no_dist=True)
    for key, value in state.items():
        assert (torch.equal(ours[key], value) if torch.is_tensor(value)
                else ours[key] == theirs[key] == value), key


def test_a_truncated_data_file_is_refused_naming_it(tmp_path):
    dcp.save({"w": torch.randn(64, 64)}, checkpoint_id=str(tmp_path), no_dist=True)
    data = next(tmp_path.glob("*.distcp"))
    data.write_bytes(data.read_bytes()[:1000])
    with pytest.raises(UnsafeFileError, match=data.name):
        dcp_load({"w": torch.zeros(64, 64)}, SafeReader(str(tmp_path)))


def test_a_code_pickle_and_an_item_beyond_its_file_are_refused_by_name(tmp_path):
    """An item whose pickle asks for code goes through the project's one unpickler (it called
    torch.load itself: a traceback); an index claiming an item far past its file (2**50 bytes) is
    refused before any read is allocated, as is a negative offset (#65)."""
    import pickle

    class Code:
        def __reduce__(self):
            return (print, ("ran",))

    from parallel.checkpoint.format.safe import torch_load

    with pytest.raises(UnsafeFileError, match="crafted item: refused.*load print"):
        TensorItems(torch_load).load(saved(Code()), "crafted item")  # as SafeReader hands it over
    dcp.save({"w": torch.randn(8, 8)}, checkpoint_id=str(tmp_path), no_dist=True)
    meta_file = tmp_path / ".metadata"
    for offset, length in ((0, 1 << 50), (-8, 64)):
        meta = pickle.loads(meta_file.read_bytes())
        for info in meta.storage_data.values():
            info.offset, info.length = offset, length
        meta_file.write_bytes(pickle.dumps(meta))
        with pytest.raises(UnsafeFileError, match="outside"):
            dcp_load({"w": torch.zeros(8, 8)}, SafeReader(str(tmp_path)))


def test_an_index_claiming_a_tensor_beyond_the_data_is_refused_before_allocating(tmp_path):
    """A .metadata claiming a [2**20, 2**20] tensor (4 TiB) is refused naming the entry before any
    template is allocated: `ckpt import dcp` allocated it (#65)."""
    import pickle

    from parallel.checkpoint.importers import read_dcp

    dcp.save({"model": {"w": torch.randn(8, 8)}}, checkpoint_id=str(tmp_path), no_dist=True)
    meta = pickle.loads((tmp_path / ".metadata").read_bytes())
    meta.state_dict_metadata["model.w"].size = torch.Size([1 << 20, 1 << 20])
    (tmp_path / ".metadata").write_bytes(pickle.dumps(meta))
    with pytest.raises(UnsafeFileError, match=r"model.w claims shape \[1048576, 1048576\]"):
        read_dcp(tmp_path)
