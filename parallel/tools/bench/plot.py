"""The bench figure: loss curves overlaid, throughput, memory per rank, communication per step."""

from __future__ import annotations

from pathlib import Path

MiB = 2 ** 20


def plot(results: dict, out_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on cluster nodes
    import matplotlib.pyplot as plt

    done = {k: v for k, v in results.items() if "median_s" in v}
    labels = list(done)
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    ax = axes[0][0]
    styles = ["-", "--", ":", "-."]
    for i, (label, r) in enumerate(done.items()):  # distinct styles: agreeing curves overlap
        ax.plot(range(1, len(r["losses"]) + 1), r["losses"], linestyle=styles[i % len(styles)],
                marker="os^Dv"[i % 5], markersize=9 - 1.5 * (i % 4), label=label)
    ax.set(title="loss per step (same weights, same batches: curves overlap when backends agree)",
           xlabel="step", ylabel="loss")
    ax.legend(fontsize=7)
    ax = axes[0][1]
    ax.bar(labels, [done[k]["target_tokens_per_s"] for k in labels], color="tab:green")
    ax.set(title="throughput (median step)", ylabel="target tokens / s (labels a loss counts)")
    ax = axes[1][0]
    bottom = [0.0] * len(labels)
    for key, color in (("params_bytes", "tab:blue"), ("grads_bytes", "tab:orange"),
                       ("optimizer_bytes", "tab:red")):
        values = [done[k][key] / MiB for k in labels]
        ax.bar(labels, values, bottom=bottom, label=key.replace("_bytes", ""), color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(title="model states per rank (largest rank)", ylabel="MiB")
    ax.legend(fontsize=7)
    ax = axes[1][1]
    bottom = [0.0] * len(labels)
    for key, color in (("all_gather", "tab:purple"), ("reduce_scatter", "tab:brown"),
                       ("all_reduce", "tab:gray")):
        values = [done[k]["comm_bytes_per_step"][key] / MiB for k in labels]
        ax.bar(labels, values, bottom=bottom, label=key, color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(title="collective bytes per step (counted; XLA: in-graph, not counted)", ylabel="MiB")
    ax.legend(fontsize=7)
    for ax in axes.flat[1:]:
        ax.tick_params(axis="x", labelrotation=30, labelsize=7)
    fig.tight_layout()
    path = out_dir / "bench.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
