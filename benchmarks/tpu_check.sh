#!/usr/bin/env bash
# The TPU check (#79): TorchTPU (`torch-tpu`, torch_xla's successor on torch 2.11-2.15) under FSDP2
# with topology.device: tpu, what only a TPU VM can show, in the GPU check's steps and record
# (benchmarks/check_steps.sh, benchmarks/gpu_report.py --check tpu_check: OUT/tpu_check.json and
# OUT/tpu_check.md, each step written the moment it ends). Not yet run on TPU hardware (docs/tpu.md).
#
#   benchmarks/tpu_check.sh --prepare   # on the TPU VM, with the network: .venv-tpu with torch 2.15
#                                       # (CPU wheel), torch-tpu, libtpu and the main lane's pins
#   benchmarks/tpu_check.sh             # on the TPU VM: within --budget seconds (default 900)
#   benchmarks/tpu_check.sh --dry       # on a CPU: the same steps at tiny sizes, topology.device
#                                       # cpu (make test-full: tests/distributed/test_gpu_check.py)
#
# Steps: (a) env: versions and chips; (b) tests: tests/distributed/test_tpu.py (FSDP2 on the chips
# against one CPU process, fp32, every step; a checkpoint resumed in fresh processes continues
# exactly; async save from TPU memory); (c) bench: bf16 Llama 1B, seq 2048, FSDP2 on every
# chip: ms/step, tokens/s, MFU where the chip's peak is known; (d) save: async save's blocking and
# the steps with the write in flight; (e) compiled: (c) under torch.compile with TorchTPU's `tpu`
# backend and activation checkpointing.
# OUT: --out DIR, else $OUT, else runs/tpu_check.
set -uo pipefail
cd "$(dirname "$0")/.."

source benchmarks/check_steps.sh  # check_args, step, skip
check_args tpu runs/tpu_check "$@"

if [ "$mode" = prepare ]; then  # TPU VMs have the network; torch's CPU wheel, TorchTPU beside it
    python3 -m venv .venv-tpu || exit 1
    .venv-tpu/bin/python -m pip install -q --extra-index-url https://download.pytorch.org/whl/cpu \
        -c <(grep -vE '^(torch==|nvidia-|triton==|cuda-)' constraints.txt) "torch==$(grep -E \
        '^torch==' constraints.txt | cut -d= -f3)" -e '.[hf,torchtpu,dev]' || exit 1
    echo "then run: PYTHON=.venv-tpu/bin/python bash benchmarks/tpu_check.sh"
    exit 0
fi

PY="${PYTHON:-python3}"
[ -x .venv-tpu/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv-tpu/bin/python
[ "$mode" = dry ] && [ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
export PYTHONUNBUFFERED=1 PYTHONWARNINGS="ignore:<TorchTpu/Performance/TcMalloc/"

spec=benchmarks/gpu_check.yaml  # the GPU check's job: bf16 FULL_SHARD, every layer a unit, AdamW
if [ "$mode" = tpu ]; then
    budget="${budget:-900}" model=configs/models/llama-1b.json seq=2048 steps=6 warmup=2
    save_model=configs/models/llama-125m.json device=tpu backend=tpu
    chips=$("$PY" -c 'import torch; print(torch.accelerator.device_count())' 2>/dev/null || echo 0)
else  # the same steps at sizes a 2-core CPU runs in about two minutes, on 2 gloo ranks
    budget="${budget:-900}" model=toy:tiny seq=32 steps=2 warmup=1
    save_model=toy:tiny device=cpu backend=eager chips=2
fi
mkdir -p "$out"
start=$(date +%s)

CHECK=tpu_check

on=(--set "topology.device=$device" --set micro_batch_size=2)
bench=("$PY" -m parallel.cli bench "$spec" --wide "${on[@]}")  # each step adds --out OUT/<step>

"$PY" benchmarks/gpu_report.py env --check tpu_check --out "$out" || exit 1
if [ "$mode" = tpu ] && [ "$chips" -lt 1 ]; then
    skip tests "test_tpu.py" "torch.accelerator finds no TPU: is torch-tpu installed (--prepare)?"
    "$PY" benchmarks/gpu_report.py check --check tpu_check --out "$out" --expect env
    exit 1
fi
step tests 300 "test_tpu.py: FSDP2 on $chips chip(s) against one process, resume, async save" -- \
    "$PY" -m pytest -q -rA -p no:cacheprovider tests/distributed/test_tpu.py
step bench 200 "bf16 Llama ($model), seq $seq, FSDP2 on $chips $device device(s)" -- \
    "${bench[@]}" --out "$out/bench" --model "$model" --seq "$seq" --world "$chips" --backends fsdp2 \
    --steps "$steps" --warmup "$warmup"
step save 150 "async save: blocking and steps with the write in flight ($save_model)" -- \
    "${bench[@]}" --out "$out/save" --model "$save_model" --seq "$seq" --world "$chips" --backends fsdp2 \
    --steps "$steps" --warmup "$warmup" --save
step compiled 240 "(c) under torch.compile (backend $backend) with activation checkpointing" -- \
    "${bench[@]}" --out "$out/compiled" --model "$model" --seq "$seq" --world "$chips" --backends fsdp2 \
    --steps "$steps" --warmup "$warmup" --set compile.enabled=true --set "compile.backend=$backend" \
    --set activation_checkpointing=true

echo "== $(($(date +%s) - start))s in all; $out/tpu_check.md:"
cat "$out/tpu_check.md"
"$PY" benchmarks/gpu_report.py check --check tpu_check --out "$out" --expect env,tests,bench,save,compiled
