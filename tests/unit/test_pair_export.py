"""#80: a DPO-style pair held in one module (policy and reference) exported to Hugging Face. Its
names are `policy.*` / `reference.*` under the policy's config, which from_pretrained met with a
freshly initialised model and a warning, after an export that exited 0. Now the export is refused,
naming --prefix, and `--prefix policy.` exports the policy alone, which from_pretrained loads
exactly."""

import torch
from torch import nn

from parallel.cli.main import main
from parallel.toy import build_llama, llama_config


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.policy = build_llama(llama_config("tiny"))
        self.reference = build_llama(llama_config("tiny"))
        self.reference.requires_grad_(False)

    def forward(self, **batch):
        return self.policy(**batch)


def test_a_pair_exports_one_submodule_by_prefix_and_refuses_the_mixture(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from parallel import create_engine, load_spec

    torch.manual_seed(0)
    pair = Pair()
    policy = {k: v.clone() for k, v in pair.policy.state_dict().items()}
    engine = create_engine(load_spec({"backend": "fsdp", "micro_batch_size": 2, "wrap": {
        "policy": "layer_classes", "layer_classes": ["LlamaDecoderLayer"]}}))
    engine.prepare(pair, (torch.optim.SGD, {"lr": 0.1}))
    engine.save(tmp_path / "ckpt")
    engine.close()
    capsys.readouterr()
    assert main(["ckpt", "export", "--to", "hf", str(tmp_path / "ckpt"), str(tmp_path / "mix")]) == 2
    err = capsys.readouterr().err
    assert "are not under LlamaForCausalLM's parts (lm_head, model)" in err, err
    assert "--prefix names it (here: policy., reference.)" in err and "Traceback" not in err, err
    assert not (tmp_path / "mix").exists()
    assert main(["ckpt", "export", "--to", "hf", "--prefix", "policy.", str(tmp_path / "ckpt"),
                 str(tmp_path / "policy")]) == 0
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "policy").state_dict()
    assert set(loaded) == set(policy)
    assert all(torch.equal(loaded[k], policy[k]) for k in policy)
