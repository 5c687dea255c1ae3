"""`engine.save_pretrained` (#42): the habit of every Hugging Face user, in process. A plain model's
weights (every variant at 2 ranks: tests/distributed/test_hf_job.py) and, here, a LoRA run's adapter:
written as PeftModel.save_pretrained writes it, keeping `base_model_name_or_path` (peft empties it when
an adapter is rebuilt), so PeftModel.from_pretrained(base, adapter) gives the engine's own eval loss."""

import json

import torch

from parallel import create_engine, load_spec
from parallel.toy import build_llama, llama_config


def test_a_lora_run_saves_an_adapter_that_finds_its_base(tmp_path):
    import peft
    from transformers import AutoModelForCausalLM

    base_dir = tmp_path / "base"
    torch.manual_seed(0)
    build_llama(llama_config("tiny")).save_pretrained(base_dir)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), lora)
    engine = create_engine(load_spec({"backend": "fsdp", "micro_batch_size": 2}))
    try:
        engine.prepare(model, (torch.optim.AdamW, {"lr": 1e-2}))
        ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            engine.train_step({"input_ids": ids, "labels": ids})
        out = engine.save_pretrained(tmp_path / "adapter")
        loss = engine.evaluate([{"input_ids": ids, "labels": ids}])["loss"]
    finally:
        engine.close()
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(base_dir), config
    assert (out / "adapter_model.safetensors").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "base"]  # staging removed
    reloaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), out)
    with torch.no_grad():
        again = float(reloaded(input_ids=ids, labels=ids).loss)
    assert abs(again - loss) <= 1e-5, (again, loss)
