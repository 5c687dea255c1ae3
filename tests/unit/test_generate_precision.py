"""Generation and evaluation after training, under every precision x backend variant that runs in this
process (world 1: the torch FSDP and DeepSpeed variants of the registry; XLA's in test_hf_job's XLA
launches). Found by a new user (#42): FSDP1 + bf16, what `polyshard import accelerate` makes of a typical
accelerate FSDP YAML, trained and then crashed in `generate` ("expected m1 and m2 to have the same
dtype"). Each case trains one step, generates greedily (the prompt kept, new tokens appended) and
evaluates (a finite loss of the right size)."""

import math

import pytest
import torch

from parallel import create_engine, load_spec, registry
from parallel.toy import build_llama, llama_config

IN_PROCESS = [(d.name, name, over) for d in registry.descriptors() if d.name in ("fsdp", "deepspeed")
              for name, over in d.variants.items()]
CASES = [pytest.param(b, v, over, p, id=f"{v}-{p}") for b, v, over in IN_PROCESS
         for p in ("bf16", "fp16")]


@pytest.mark.parametrize("backend,variant,over,precision", CASES)
def test_generate_and_evaluate_after_mixed_precision_training(backend, variant, over, precision):
    if backend == "deepspeed" and precision == "fp16":
        pytest.skip("DeepSpeed 0.19.8 has no fp16 on CPU ('Type fp16 is not supported on your "
                    "device'): a GPU run covers it (tests/distributed/test_gpu.py)")
    spec = load_spec({**over, "backend": backend, "precision": precision, "micro_batch_size": 2,
                      "wrap": {"policy": "auto"}})
    engine = create_engine(spec)
    try:
        torch.manual_seed(0)
        engine.prepare(build_llama(llama_config("tiny")), (torch.optim.AdamW, {"lr": 1e-3}))
        ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
        engine.train_step({"input_ids": ids, "labels": ids})
        out = engine.generate(ids[:, :4], max_new_tokens=3, do_sample=False)
        assert out.shape == (2, 7) and torch.equal(out[:, :4], ids[:, :4])
        loss = engine.evaluate([{"input_ids": ids, "labels": ids}])["loss"]
        assert math.isfinite(loss) and 3.0 < loss < 8.0, loss
    finally:
        engine.close()
