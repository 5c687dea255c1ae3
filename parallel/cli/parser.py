"""The command line's arguments: every subcommand's parser, with an example each (main.py runs them)."""

from __future__ import annotations

import argparse

from parallel.cli import ckpt as cli_ckpt, interop as cli_interop, plan as cli_plan
from parallel.cli.args import COUNT, GBPS, SEQ, STEPS, bounded, seq_list

EXAMPLES = {
    "validate": "polyshard validate configs/demo.yaml --set backend=deepspeed",
    "explain": "polyshard explain configs/demo.yaml --set fsdp.version=1 --model toy:demo",
    "launch": "polyshard launch --nproc 2 configs/demo.yaml examples/train_lm.py --steps 40  "
              "(or --emit slurm|k8s|tpu-vm to write the cluster job instead)",
    "schema": "polyshard schema -o polyshard.schema.json",
    "ckpt": "polyshard ckpt verify runs/demo/final",
    "import": "polyshard import accelerate accelerate_config.yaml -o spec.yaml",
    "export": "polyshard export --to hf-trainer configs/xla-v1-tpu.yaml",
    "bench": "polyshard bench configs/demo.yaml --backends fsdp,deepspeed,xla_fsdp --steps 5",
    "plan": "polyshard plan configs/llama3-8b-fsdp.yaml --model config.json --world 8 --budget 80",
    "dryrun": "polyshard dryrun configs/tp8-llama3-8b.yaml --model config.json --world 1024",
    "parity": "polyshard parity configs/demo.yaml --backends fsdp,deepspeed,xla_fsdp --steps 5",
}


def add_spec_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="YAML or JSON spec")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a field, e.g. --set backend=deepspeed (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="polyshard", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="One training-strategy spec for torch FSDP, DeepSpeed ZeRO and PyTorch/XLA FSDP.",
        epilog="examples:\n" + "\n".join(f"  {v}" for v in EXAMPLES.values()))
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help_: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_, description=help_,
                              epilog=f"example: {EXAMPLES[name]}")

    p = command("validate", "check a spec; print the resolved spec")
    add_spec_args(p)
    p.add_argument("--full", action="store_true", help="print every field, defaults included")
    p = command("explain", "print what a spec becomes on its backend, as JSON")
    add_spec_args(p)
    p.add_argument("--model", help="also list the shard units: a Hugging Face config.json, or "
                   "toy:demo / toy:tiny (built on the meta device: nothing is allocated)")
    _add_launch(command("launch", "start the processes of a job (torchrun semantics)"))
    cli_ckpt.add_parser(sub)
    cli_interop.add_parsers(sub, command, add_spec_args)
    _add_parity(command("parity", "train the same job on several backends and compare every step "
                        "with one process (exit 1 beyond the tolerance)"))
    _add_bench(command("bench", "time, memory and communication of the same job on several "
                       "backends, each cell in a fresh launch; table, JSON, CSV and figures"))
    p = command("plan", "predict per-rank memory for every backend x shard x offload and pick the "
                "fastest that fits")
    add_spec_args(p)
    p.add_argument("--model", required=True, help="HF config.json, toy:demo / toy:tiny, or a "
                   "parameter count such as 7.5e9")
    p.add_argument("--world", type=COUNT, required=True)
    p.add_argument("--budget", type=bounded(float, 1e-6, 1 << 30), help="GiB per device")
    p.add_argument("--seq", type=SEQ, default=2048)
    p.add_argument("--optimizer", choices=["adamw", "sgd", "muon"], default="adamw",
                   help="optimizer state and its collectives: muon is Muon on the hidden matrices "
                   "and AdamW on the rest (parallel/engine/model/optim/recipes.py)")
    p.add_argument("--json", action="store_true", help="every number as JSON on stdout")
    p.add_argument("--sweep", metavar="DIM=V1,V2,...", help="one table of the spec as written at "
                   "each value of a parallel dimension (tp, cp, pp or ep), e.g. ep=1,2,4,8")
    p.add_argument("--per-node", type=bounded(int, 1, 1 << 10), default=8,
                   help="devices per node: which collectives "
                   "cross nodes (default 8)")
    for flag, default, what in (("intra-gbps", 300.0, "GB/s between ranks of a node"),
                                ("inter-gbps", 50.0, "GB/s per rank across nodes"),
                                ("pcie-gbps", 25.0, "GB/s host <-> device (offload)"),
                                ("disk-gbps", 1.0, "GB/s one rank writes a checkpoint at"),
                                ("context-gib", 0.5, "GiB the CUDA context takes"),
                                ("fragmentation", 0.10, "allocator fragmentation, a fraction")):
        kind = bounded(float, 0.0, 0.99) if flag == "fragmentation" else GBPS
        p.add_argument(f"--{flag}", type=kind, default=default, help=f"{what} (default {default})")
    cli_plan.add_dryrun(command("dryrun", "build one rank of a world of N in this process (fake "
                                "process group), run a step, and print its measured memory and "
                                "collectives beside plan's"), add_spec_args)
    p = command("schema", "write the spec's JSON Schema (for editor completion)")
    p.add_argument("-o", "--output", help="file to write (default: stdout)")
    return parser


def launch_flags() -> set[str]:
    """`polyshard launch`'s own option strings (what an argument after the script may be meant as)."""
    p = argparse.ArgumentParser(add_help=False)
    _add_launch(p)
    return {o for a in p._actions for o in a.option_strings}


def _add_launch(p: argparse.ArgumentParser) -> None:
    p.add_argument("--nproc", type=bounded(int, 1, 1 << 10),
                   help="processes per node (sets topology.procs_per_node)")
    p.add_argument("--nnodes", type=bounded(int, 1, 1 << 16), help="number of nodes (sets topology.nodes)")
    p.add_argument("--node-rank", type=bounded(int, 0, (1 << 16) - 1), help="this node's rank (multi-node)")
    p.add_argument("--rdzv-endpoint", help="HOST:PORT of the rendezvous (multi-node)")
    p.add_argument("--max-restarts", type=bounded(int, 0, 1000), default=0,
                   help="elastic restarts on failure")
    p.add_argument("--verbose", action="store_true", help="show third-party start-up noise "
                   "(gloo's peer-connection lines, torchrun's banner), hidden by default")
    p.add_argument("--emit", choices=["tpu-vm", "slurm", "k8s"], help="print what runs this job on "
                   "a cluster instead of running it here: the gcloud line for every TPU VM worker, "
                   "an sbatch script, or a Kubeflow PyTorchJob manifest")
    p.add_argument("--image", default="polyshard-gpu:latest", help="container image (--emit k8s)")
    p.add_argument("--job-name", default="polyshard", help="job name (--emit slurm / k8s)")
    p.add_argument("--time", default="24:00:00", help="Slurm time limit (--emit slurm)")
    p.add_argument("--cpus-per-task", type=bounded(int, 1, 1 << 16), help="CPUs of each node's "
                   "task, which runs all its ranks (--emit slurm; default 8 per process)")
    p.add_argument("--tpu", default="TPU_NAME", help="TPU VM name (--emit tpu-vm)")
    p.add_argument("--zone", default="ZONE", help="TPU VM zone (--emit tpu-vm)")
    p.add_argument("--workdir", help="where the job runs: the checkout every TPU VM worker has "
                   "(--emit tpu-vm, default ~/polyshard) or the container's working directory "
                   "(--emit k8s, default /opt/polyshard, the images' WORKDIR)")
    p.add_argument("--setup", help="a shell line run before the launch in every emitted file (e.g. "
                   "'source /opt/venv/bin/activate' or 'module load cuda')")
    p.add_argument("--pvc-size", default="100Gi", help="storage the emitted PersistentVolumeClaim "
                   "for checkpoint.dir requests (--emit k8s)")
    add_spec_args(p)
    p.add_argument("script", help="training script")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")


def _add_parity(p: argparse.ArgumentParser) -> None:
    add_spec_args(p)
    p.add_argument("--backends", help="comma-separated (default: every registered backend)")
    p.add_argument("--steps", type=STEPS, default=5)
    p.add_argument("--model", default="toy:tiny", help="toy:tiny, toy:demo or a Hugging Face "
                   "config.json (random weights from the spec's seed)")
    p.add_argument("--seq", type=SEQ, default=32, help="tokens per sample")
    p.add_argument("--optimizer", choices=["adamw", "sgd", "muon"], default="adamw",
                   help="muon: Muon on the hidden matrices, AdamW on the rest (docs/optimizers.md)")
    p.add_argument("--lr", type=bounded(float, 0.0, 1e6), default=1e-2)
    p.add_argument("--tol", type=bounded(float, 0.0, 1e6),
                   help="loss tolerance (default 1e-5 fp32, 5e-2 bf16/fp16)")
    p.add_argument("--json", help="also write every number to this file")


def _add_bench(p: argparse.ArgumentParser) -> None:
    add_spec_args(p)
    p.add_argument("--backends", help="comma-separated backends or variants: fsdp, fsdp1, fsdp2, "
                   "deepspeed, zero0-zero3, xla_fsdp, xla1, xla2 (default: every backend)")
    p.add_argument("--shard", help="comma-separated shard levels (default: the spec's)")
    p.add_argument("--world", help="comma-separated world sizes (default: the spec's)")
    p.add_argument("--precision", help="comma-separated precisions, e.g. bf16,fp8 (default: the "
                   "spec's; fp8 reads the spec's float8 section, docs/precision.md)")
    p.add_argument("--steps", type=STEPS, default=5, help="measured steps (after --warmup)")
    p.add_argument("--warmup", type=bounded(int, 0, 1 << 24), default=2)
    p.add_argument("--model", default="toy:demo")
    p.add_argument("--optimizer", choices=["adamw", "sgd", "muon"], default="adamw",
                   help="muon: Muon on the hidden matrices, AdamW on the rest (docs/optimizers.md)")
    p.add_argument("--seq", type=seq_list, default=[64], help="tokens per sample; a comma-separated "
                   "list sweeps them (each a bench of its own) and, with --budget, reports the "
                   "longest that ran within it, with and without the spec's topology.cp")
    p.add_argument("--budget", type=bounded(float, 1e-6, 1e9), metavar="GIB", help="--seq sweep: "
                   "the memory per rank a length must stay within")
    p.add_argument("--data", help="your batches: module:function returning the global batches "
                   "(dicts of tensors, e.g. an HF collator's) or tokenized documents (packed into "
                   "rows of --seq), called with those of rows, seq, steps, seed, vocab_size it "
                   "names (default: random ids, the same on every cell)")
    p.add_argument("--out", default="runs/bench", help="directory for bench.json/csv/png")
    p.add_argument("--vs-native", action="store_true", help="also run each cell's hand-written "
                   "loop (benchmarks/) and report polyshard's step time over it")
    p.add_argument("--wide", action="store_true", help="every column (default: a table that fits "
                   "80 columns; bench.csv always has every column)")
    p.add_argument("--startup", type=bounded(int, 0, 1000), default=0, metavar="PAIRS",
                   help="also time start-up to the "
                   "first step: `polyshard launch` of the spec's job against torchrun of the "
                   "backend's hand-written loop, PAIRS alternating runs (median)")
    p.add_argument("--save", action="store_true", help="also time how long a sync and an async "
                   "save (checkpoint.async_save) of the trained state block training")
    p.add_argument("--profile", type=bounded(int, 0, 1000), default=0, metavar="STEPS",
                   help="with --vs-native: "
                   "after the timed steps, profile STEPS more of each side (torch.profiler); "
                   "traces and an operator-by-operator difference go to OUT/profile-CELL/")
