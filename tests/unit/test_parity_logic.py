"""`polyshard parity`'s verdict: per-backend maxima and the tolerance decide the exit code."""

from parallel.tools.parity.report import compare

REF = [{"loss": 5.0, "grad_norm": 1.0, "checksum": 10.0}, {"loss": 4.0, "grad_norm": 0.5,
                                                           "checksum": 9.0}]


def run(dloss, steps=2):
    return {"steps": [{"loss": r["loss"] + dloss, "grad_norm": r["grad_norm"],
                       "checksum": r["checksum"]} for r in REF[:steps]]}


def test_within_and_beyond_tolerance():
    summary = compare(REF, {"a": run(5e-6), "b": run(2e-5)}, tol=1e-5)
    assert summary["a"]["ok"] and abs(summary["a"]["loss"] - 5e-6) < 1e-9
    assert not summary["b"]["ok"]


def test_missing_steps_and_failed_runs_are_not_ok():
    summary = compare(REF, {"short": run(0.0, steps=1), "dead": {"error": "boom"}}, tol=1e-5)
    assert not summary["short"]["ok"] and not summary["dead"]["ok"]


def test_an_error_with_brackets_is_printed_as_text(tmp_path, capsys):
    """#80: gloo's message ("[/pytorch/third_party/gloo/...]") in a failed cell, parsed as rich
    markup, ended bench and parity with a MarkupError traceback."""
    from parallel.tools.bench.table import render as bench_render
    from parallel.tools.parity.report import render as parity_render

    error = "RuntimeError: [/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error"
    bench_render({"fsdp2/full/w2": {"error": error}}, tmp_path)
    parity_render([], {"zero3": {"error": error}}, {"zero3": {"error": error}}, 1e-5)
    out = capsys.readouterr().out
    assert out.count("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534]") == 2, out
