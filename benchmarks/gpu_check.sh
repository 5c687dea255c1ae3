#!/usr/bin/env bash
# The GPU check (#63): what only a GPU can show, in order, each step's result written the moment it
# ends (OUT/gpu_check.json and OUT/gpu_check.md, by benchmarks/gpu_report.py), so a run cut off at
# the device machine's limit still reports every step before the cut.
#
#   benchmarks/gpu_check.sh --prepare   # here, with the network: the pinned packages into .whl/.gpu
#   benchmarks/gpu_check.sh             # on the GPU machine: within --budget seconds (default 480)
#   benchmarks/gpu_check.sh --dry       # on a CPU: the same steps end to end at tiny sizes (make test)
#
# Steps: (a) env: versions and devices; (b) tests: tests/distributed/test_gpu.py's parity case;
# (c) bench: bf16 1B Llama, seq 2048, FSDP2 and ZeRO-3 against the native loops (ms/step, tokens/s,
# MFU, x native); (c2) plan: the same cells measured alone, peak memory against `polyshard plan`'s;
# (d) nccl: (c) at 2 GPUs over NCCL when 2 are lent; (e) save: async save's blocking and the steps'
# cost with the write in flight (124M Llama, seq 512); (f) fp8 against (c)'s bf16 (torchao's
# tensorwise Float8Linear, float8 all-gather: docs/precision.md); (g) largest: FSDP2 + compile +
# activation checkpointing on a 3B Llama (torchtitan's recipe), for the MFU goal. A step gets its own limit and never more than the
# budget has left; one with too little left is recorded as skipped, saying so.
# OUT: --out DIR, else $OUT (the device tool's folder that comes back), else runs/gpu_check.
set -uo pipefail
cd "$(dirname "$0")/.."

source benchmarks/check_steps.sh  # check_args, step, skip
check_args gpu runs/gpu_check "$@"

if [ "$mode" = prepare ]; then  # the GPU machine has no network: its own torch, these carried
    printf '/.whl/\n/.gpu/\n' >> .git/info/exclude
    # the main lane's stack (constraints.txt: transformers 5.25, accelerate 1.16, torchao 0.18,
    # pydantic 2.14), with what transformers pulls in, at the pinned versions; torch stays the
    # machine's own (a CUDA torch is GBs, over what a run carries)
    where=(--only-binary=:all: --python-version 3.12 --implementation cp \
           --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
           --platform manylinux2014_x86_64 -d .whl)
    pins=$(grep -E '^(transformers|accelerate|torchao|pydantic|hjson)==' constraints.txt)
    python3 -m pip download "${where[@]}" -c <(grep -vE '^(torch|nvidia-|triton|cuda-)' \
        constraints.txt) $(echo "$pins" | grep -vE '^(accelerate|torchao)==') || exit 1
    python3 -m pip download --no-deps "${where[@]}" $(echo "$pins" | grep -E \
        '^(accelerate|torchao)==') || exit 1
    # DeepSpeed ships as a source distribution; its installed package is pure Python and builds
    # its ops on the GPU machine
    mkdir -p .gpu/site && (cd .venv/lib/python3.11/site-packages && tar cf - --exclude=__pycache__ \
        deepspeed deepspeed-0.19.8.dist-info) | (cd .gpu/site && tar xf -) || exit 1
    echo "carry: .whl .gpu   then run: bash benchmarks/gpu_check.sh"
    exit 0
fi

if [ -d .whl ] && [ "$mode" = gpu ]; then  # what --prepare carried, beside the machine's own torch
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH="$PWD:/tmp/site:$PWD/.gpu/site${PYTHONPATH:+:$PYTHONPATH}"
fi
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && [ -z "${PYTHON:-}" ] && PY=.venv/bin/python
export PYTHONUNBUFFERED=1 NVIDIA_TF32_OVERRIDE=0  # TF32 off: fp32 parity against the CPU reference

spec=benchmarks/gpu_check.yaml
if [ "$mode" = gpu ]; then
    budget="${budget:-480}" model=configs/models/llama-1b.json seq=2048 steps=6 warmup=2
    save_model=configs/models/llama-125m.json save_seq=512 big=configs/models/llama-3b.json
    gpus=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
    pair=fsdp2,zero3 small=()
else  # the same steps at sizes a 2-core CPU runs in about two minutes; 2 gloo ranks stand in
    # for (d)'s two GPUs, and compile traces with the eager backend (no C++ build)
    budget="${budget:-900}" model=toy:tiny seq=32 steps=2 warmup=1
    save_model=toy:tiny save_seq=32 big=toy:tiny gpus=2 pair=fsdp2
    small=(--set micro_batch_size=2 --set compile.backend=eager)
fi
mkdir -p "$out"
start=$(date +%s)

CHECK=gpu_check

bench=("$PY" -m parallel.cli bench "$spec" --wide "${small[@]}")  # each step adds --out OUT/<step>

"$PY" benchmarks/gpu_report.py env --out "$out" || exit 1
step tests 110 "test_gpu.py: parity of FSDP2, FSDP1 (offload, full state dict), ZeRO-3, ZeRO-2 offload" -- \
    "$PY" -m pytest -q -rA -p no:cacheprovider tests/distributed/test_gpu.py -k parity
step bench 150 "bf16 Llama ($model), seq $seq, against the native loops" -- \
    "${bench[@]}" --out "$out/bench" --model "$model" --seq "$seq" --world 1 --backends "$pair" --steps "$steps" \
    --warmup "$warmup" --vs-native
step plan 75 "the same cells alone: peak memory against plan's" -- \
    "${bench[@]}" --out "$out/plan" --model "$model" --seq "$seq" --world 1 --backends "$pair" --steps 1 --warmup 1
if [ "$gpus" -ge 2 ]; then
    step nccl 120 "(c) at 2 ranks over $([ "$mode" = gpu ] && echo NCCL || echo gloo)" -- \
        "${bench[@]}" --out "$out/nccl" --model "$model" --seq "$seq" --world 2 --backends "$pair" --steps "$steps" \
        --warmup "$warmup" --vs-native
else
    skip nccl "(c) at 2 GPUs over NCCL" "$gpus GPU lent: collectives between GPUs need 2"
fi
step save 100 "async save: blocking and steps with the write in flight ($save_model, seq $save_seq)" -- \
    "${bench[@]}" --out "$out/save" --model "$save_model" --seq "$save_seq" --world 1 --backends fsdp2 --steps "$steps" \
    --warmup "$warmup" --save
if "$PY" -c 'import torchao' > /dev/null 2>&1; then  # torchtitan's float8: tensorwise, float8 all-gather
    step fp8 90 "fp8 (tensorwise, float8 all-gather) against (c)'s bf16" -- "${bench[@]}" --out "$out/fp8" \
        --model "$model" --seq "$seq" --world 1 --backends fsdp2 --steps "$steps" --warmup "$warmup" \
        --set precision=fp8 --set float8.all_gather=true
else
    skip fp8 "fp8 against bf16" "torchao is not installed (polyshard[fp8])"
fi
step largest 150 "FSDP2 + compile + activation checkpointing, $big: the MFU goal" -- \
    "${bench[@]}" --out "$out/largest" --model "$big" --seq "$seq" --world 1 --backends fsdp2 --steps "$steps" \
    --warmup "$warmup" --set compile.enabled=true --set activation_checkpointing=true \
    --set micro_batch_size=2

echo "== $(($(date +%s) - start))s in all; $out/gpu_check.md:"
cat "$out/gpu_check.md"
"$PY" benchmarks/gpu_report.py check --out "$out" --expect env,tests,bench,plan,nccl,save,fp8,largest
