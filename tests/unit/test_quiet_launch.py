"""Quiet launches and the layout a backend runs on this host: the noise filter on what gloo really
writes (pieces of two ranks interleaved mid-line), a live bar's partial lines passed on at once,
and XLA one field away (registry.local_layout, bench cells at the world of the others)."""

import io
import os

import pytest

from parallel.launch.quiet import Relay, is_noise
from parallel.spec.io import load_spec

# measured at 2 ranks sharing one pipe (torch 2.9, FSDP2's mesh): gloo writes its line in pieces
INTERLEAVED = (b"[Gloo] Rank [Gloo] Rank 0 is connected to 1 peer ranks. Expected number of "
               b"connected peer ranks is : 1\n1 is connected to 1 peer ranks. Expected number of "
               b"connected peer ranks is : 1\n[Gloo] Rank 1[Gloo] Rank 0 is connected to 1 peer "
               b"ranks. Expected number of connected peer ranks is : 1\n is connected to 1 peer "
               b"ranks. Expected number of connected peer ranks is : 1\n")


class Sink(io.BytesIO):
    def flush(self):
        pass


def relay(chunks: list[bytes]) -> tuple[bytes, int]:
    reader, writer = os.pipe()
    out = Sink()
    r = Relay(reader, out)
    r.thread.start()
    for chunk in chunks:
        os.write(writer, chunk)
    os.close(writer)
    r.thread.join(5)
    return out.getvalue(), r.dropped


def test_gloo_pieces_interleaved_by_two_ranks_are_all_dropped():
    user = b"fsdp (full, fp32) on 2 rank(s)\nloss 5.563 -> 5.477\n"
    got, dropped = relay([INTERLEAVED[:37], INTERLEAVED[37:150], INTERLEAVED[150:], user])
    assert got == user and dropped == 4


def test_what_is_not_noise_passes_whole_and_a_partial_redraw_at_once():
    text = (b"1\n12 peer ranks. connected to\nrank 0 is connected to the store\n"
            b"\r\x1b[2Ktraining \xe2\x94\x81\xe2\x94\x81 3/60")  # a live bar's redraw, no newline
    got, dropped = relay([text])
    assert got == text and dropped == 0
    assert is_noise(b"W1124 06:37:54.1 123 torch/distributed/run.py:811] Setting OMP_NUM_THREADS "
                    b"environment variable for each process to be 1 in default, to avoid")
    assert is_noise(b"2026-11-24 06:55:49.417868: W external/xla/xla/service/sharding_propagation"
                    b".cc:3120] GSPMD sharding propagation is going to be deprecated and not")


@pytest.fixture
def cpu_client(monkeypatch):
    monkeypatch.setenv("PJRT_DEVICE", "CPU")


def test_xla_is_one_field_away_on_a_cpu_host(cpu_client):
    from parallel.registry import local_layout

    data, env, note = local_layout(load_spec({"backend": "xla_fsdp",
                                              "topology": {"procs_per_node": 2}}))
    assert data["xla"]["fsdp_version"] == 2 and data["topology"]["procs_per_node"] == 1
    assert env["CPU_NUM_DEVICES"] == "2" and "xla.fsdp_version 1 -> 2" in note
    # written fsdp_version: 1 is kept: world size 1 with the whole global batch, said
    data, env, note = local_layout(load_spec({"backend": "xla_fsdp", "xla": {"fsdp_version": 1},
                                              "micro_batch_size": 2,
                                              "topology": {"procs_per_node": 2}}))
    assert "fsdp_version" not in note and "micro_batch_size 2 -> 4" in note
    assert env["CPU_NUM_DEVICES"] == "1"
    assert local_layout(load_spec({"backend": "fsdp", "topology": {"procs_per_node": 2}}))[2] is None
    # one SPMD process as written: its devices are the runtime's, CPU_NUM_DEVICES left as set
    data, env, note = local_layout(load_spec({"backend": "xla_fsdp", "xla": {"fsdp_version": 2},
                                              "topology": {"procs_per_node": 1}}))
    assert "CPU_NUM_DEVICES" not in env and note is None


def test_bench_runs_spmd_cells_at_the_world_of_the_others(cpu_client):
    from parallel.tools.bench.report import cells

    spec = load_spec({"topology": {"procs_per_node": 2}})
    got = {c.name: c for c in cells(spec, ["fsdp2", "xla2", "xla1"], None, [2])}
    assert got["fsdp2"].devices is None and got["fsdp2"].data["topology"]["procs_per_node"] == 2
    assert got["xla2"].devices == 2 and got["xla2"].data["topology"]["procs_per_node"] == 1
    assert got["xla1"].data is not None and got["xla1"].devices is None


def test_a_preemption_is_one_even_where_torchrun_ended_a_rank_still_exiting():
    """Every rank exits REQUEUE_EXIT after the save's closing barrier; torchrun ends the ranks left
    once one exits (with this agent's SIGUSR2). Those ranks had saved too: the launch is a
    preemption (exit 85). A rank that failed any other way makes it a failure."""
    import signal
    from types import SimpleNamespace

    from parallel.launch.agent import preempted, report

    def failures(*codes):
        return {r: SimpleNamespace(exitcode=c, error_file_data=None, timestamp=r, message="",
                                   error_file="") for r, c in enumerate(codes)}

    usr2 = -signal.SIGUSR2
    assert preempted(failures(85, 85)) and preempted(failures(usr2, 85))
    assert "preempted" in report(failures(usr2, 85))
    assert not preempted(failures(usr2, 1)) and not preempted(failures(usr2, usr2))
    assert not preempted(failures(85, -signal.SIGKILL))
