"""`polyshard ckpt inspect|verify|import|export`: checkpoints from the command line, one process."""

from __future__ import annotations

import argparse
import sys

from parallel.cli.args import bounded

EXAMPLES = """example: polyshard ckpt inspect runs/demo   # a checkpoint, or a dir with `latest`
more:
  polyshard ckpt verify runs/demo/step-30     # exit 1 naming the first corrupted file
  polyshard ckpt import deepspeed ds_ckpt/ runs/imported --step 1000
  polyshard ckpt export --to hf runs/demo hf_model/ --tokenizer tok/   # a LoRA run: merged
  polyshard ckpt export --to peft runs/lora adapter/          # PeftModel.from_pretrained(base, adapter/)
  polyshard ckpt export --to deepspeed-universal runs/demo ds_universal/"""


def add_parser(sub) -> None:
    p = sub.add_parser("ckpt", help="inspect, verify, import or export checkpoints",
                       description="inspect, verify, import or export checkpoints", epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="action", required=True)
    for name, text in (("inspect", "summary of a checkpoint (verified first)"),
                       ("verify", "check every file's size and digest; exit 1 on corruption")):
        a = actions.add_parser(name, help=text, description=text)
        a.add_argument("path", help="checkpoint directory, or a directory holding `latest`")
    a = actions.add_parser("import", help="convert a native checkpoint into polyshard's format",
                           description="convert a native checkpoint into polyshard's format")
    from parallel.registry import checkpoint_kinds

    a.add_argument("kind", choices=checkpoint_kinds(),
                   help="dcp: torch.distributed.checkpoint dir; deepspeed: ZeRO checkpoint dir "
                   "(with `latest` or a tag dir); xla: dir of XLA FSDP *rank-R-of-N* shard files")
    a.add_argument("src")
    a.add_argument("out")
    a.add_argument("--step", type=bounded(int, 0, 1 << 62),
                   help="optimizer steps taken (when the source has no record)")
    a.add_argument("--trust-checkpoint", action="store_true",
                   help="unpickle the source's files fully: they may run any code they hold; only "
                   "for files whose origin you trust (by default they are read as data)")
    a = actions.add_parser("export", help="write weights for another tool",
                           description="write weights for another tool")
    from parallel.registry import checkpoint_writer_kinds

    a.add_argument("--to", choices=["hf", "peft", *checkpoint_writer_kinds()], required=True,
                   help="hf: safetensors shards + config.json + generation config for "
                   "transformers' from_pretrained (a LoRA run's adapter merged into the weights); "
                   "peft: the adapter alone for PeftModel.from_pretrained; deepspeed-universal: "
                   "what DeepSpeed loads with checkpoint.load_universal (weights and optimizer "
                   "state, any ZeRO-1/2 world size)")
    a.add_argument("path")
    a.add_argument("out")
    a.add_argument("--config", help="hf: Hugging Face config.json (default: the one saved with it)")
    a.add_argument("--dtype", choices=["fp32", "bf16", "fp16"],
                   help="hf: dtype of the exported weights (default: the run's precision)")
    a.add_argument("--tokenizer", help="hf: a local tokenizer directory, saved beside the weights")
    a.add_argument("--prefix", help="hf: export the submodule whose names start with PREFIX (e.g. "
                   "'policy.' of a policy and reference held in one module), names without it")
    a.add_argument("--adapter", help="peft: which adapter (default: the run's active one)")


def run(args) -> int:
    from parallel.checkpoint.format.safe import CheckpointError
    from parallel.checkpoint.format.directory import resolve
    from parallel.checkpoint.format.manifest import verify_checkpoint
    from parallel.checkpoint.hf.export import ExportError, export_hf, export_peft
    from parallel.checkpoint.importers import CheckpointImportError, import_checkpoint
    from parallel.checkpoint.state.portable import PortableStateError
    from parallel.files import FileError
    from parallel.spec.errors import SpecError

    try:
        if args.action == "import":
            from parallel.registry import checkpoint_reader, packages

            out = import_checkpoint(checkpoint_reader(args.kind), args.kind, args.src, args.out,
                                    args.step, trust=args.trust_checkpoint, packages=packages())
            print(f"imported {args.kind} checkpoint {args.src} -> {out}")
            return 0
        if args.action == "export":
            if args.to == "hf":
                out = export_hf(args.path, args.out, args.config, args.dtype, args.tokenizer,
                                prefix=args.prefix)
                print(f"exported {out}")
            elif args.to == "peft":
                print(f"exported {export_peft(args.path, args.out, args.adapter)}")
            else:
                from parallel.registry import checkpoint_writer

                print(f"exported {checkpoint_writer(args.to)(args.path, args.out)}")
            return 0
        path = resolve(args.path)
        manifest = verify_checkpoint(path)  # sizes and digests of every file
    except (FileError, SpecError) as err:  # a file that is not what it claims: unsafe, malformed
        print(f"ckpt {args.action}: {err}", file=sys.stderr)
        return 2
    except (CheckpointError, CheckpointImportError, ExportError, PortableStateError,
            OSError) as err:
        print(f"ckpt {args.action}: {err}", file=sys.stderr)
        # verify / inspect: a well-formed checkpoint found damaged is their answer (exit 1)
        return 1 if args.action in ("verify", "inspect") else 2
    if args.action == "inspect":
        _inspect(path, manifest)
    total = sum(f["size"] for f in manifest["files"].values())
    print(f"ok: {len(manifest['files'])} files, {total:,} bytes verified")
    return 0


def _inspect(path, manifest) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from parallel.checkpoint.state.portable import tensor_shapes

    console = Console()
    # names and versions come from the checkpoint: text, never markup (a crafted '[/x]' raised)
    versions = escape(", ".join(f"{k} {v}" for k, v in manifest.get("versions", {}).items()))
    console.print(f"[bold]{escape(str(path))}[/]: written by {escape(str(manifest['backend']))} at "
                  f"step {manifest['step']} on {manifest['world_size']} rank(s); {versions}")
    if not (path / "state").is_dir():
        model, optim = {}, {}
    else:
        model, optim = tensor_shapes(path, "model."), tensor_shapes(path, "optim.state.")
    table = Table(title=f"model: {len(model)} tensors, "
                  f"{sum(_numel(s) for s, _ in model.values()):,} values")
    for column in ("parameter", "shape", "dtype", "optimizer state"):
        table.add_column(column)
    for name, (shape, dtype) in model.items():
        entries = sorted(k[len(name) + 1:] for k in optim if k.startswith(name + "."))
        table.add_row(escape(name), str(tuple(shape)), str(dtype).replace("torch.", ""),
                      escape(", ".join(entries)))
    console.print(table)
    files = Table(title="files")
    for column in ("file", "bytes", "digest"):
        files.add_column(column)
    for name, info in manifest["files"].items():
        kind = "xxh3_128" if "xxh3_128" in info else "sha256"
        files.add_row(escape(name), f"{info['size']:,}", f"{kind} {escape(str(info[kind][:16]))}")
    console.print(files)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
