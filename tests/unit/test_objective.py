"""What a step's loss averages over (parallel/kits/objective.py): the count rule read from the model as
built, a micro-batch without targets adding exactly zero, and a script without a spec stopping."""

import subprocess
import sys

import pytest
import torch

from parallel.kits.objective import Objective, count_labels, count_shifted, label_count

transformers = pytest.importorskip("transformers")


def _tiny(cls_name: str, config_name: str, **kw):
    config = getattr(transformers, config_name)(**kw)
    with torch.device("meta"):
        return getattr(transformers, cls_name)(config)


SMALL = dict(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
             intermediate_size=32)


@pytest.mark.parametrize("cls_name, config_name, kw, rule", [
    ("LlamaForCausalLM", "LlamaConfig", SMALL, count_shifted),
    ("GPT2LMHeadModel", "GPT2Config", dict(vocab_size=64, n_embd=16, n_layer=1, n_head=2),
     count_shifted),
    ("MixtralForCausalLM", "MixtralConfig", dict(SMALL, num_local_experts=4), count_shifted),
    ("BertForMaskedLM", "BertConfig", SMALL, count_labels),
    ("T5ForConditionalGeneration", "T5Config", dict(vocab_size=64, d_model=16, d_kv=8, d_ff=32,
                                                    num_layers=1, num_heads=2), count_labels),
    ("BertForTokenClassification", "BertConfig", SMALL, count_labels),
    ("BertForSequenceClassification", "BertConfig", SMALL, None),  # a mean over samples
])
def test_the_count_rule_follows_what_the_model_loss_averages_over(cls_name, config_name, kw, rule):
    assert label_count(_tiny(cls_name, config_name, **kw)) is rule


def test_a_peft_model_counts_as_its_base():
    peft = pytest.importorskip("peft")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert label_count(wrapped) is count_shifted


def test_the_counts_match_the_models_own_mean():
    """The shifted count is what HF's ForCausalLMLoss divides by: loss x count is the sum."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    ids = torch.randint(0, 64, (3, 8))
    labels = ids.clone()
    labels[0, 5:], labels[1, :3] = -100, -100
    logits = model(input_ids=ids).logits
    summed = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 64),
                                               labels[:, 1:].reshape(-1), reduction="sum")
    mean = model(input_ids=ids, labels=labels).loss
    assert torch.allclose(mean * count_shifted({"labels": labels}), summed, rtol=1e-6)


def test_a_micro_batch_without_targets_adds_exactly_zero_and_no_nan_gradient():
    weight = torch.nn.Parameter(torch.randn(4, 5))
    objective = Objective(count_labels, data_parallel=2)
    batches = [{"labels": torch.tensor([1, 2, -100])}, {"labels": torch.full((3,), -100)}]
    counts = objective.counts(batches)
    assert counts.tolist() == [2, 0] and counts.dtype == torch.int64
    x = torch.randn(3, 4)
    total = lambda: counts.sum() * 2  # noqa: E731 - two ranks with these counts
    shares = []
    for i, batch in enumerate(batches):
        loss = torch.nn.functional.cross_entropy(x @ weight, batch["labels"])  # 0/0 = nan for i=1
        share = objective.share(loss, i, counts, total, len(batches))
        share.backward()
        shares.append(float(share.detach()))
    assert shares[1] == 0.0 and torch.isfinite(weight.grad).all()


def test_a_script_without_launcher_or_default_stops_naming_how(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("from parallel.launch import current_spec\ncurrent_spec()\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(__import__("pathlib").Path(
                              __file__).resolve().parents[2])})
    assert proc.returncode != 0 and "NoSpecError" in proc.stderr
    assert "polyshard launch SPEC.yaml train.py" in proc.stderr
    named = tmp_path / "named.py"
    (tmp_path / "spec.yaml").write_text("shard: grad_op\n")
    named.write_text("from parallel.launch import current_spec\n"
                     f"print(current_spec(default={str(tmp_path / 'spec.yaml')!r}).shard)\n")
    proc = subprocess.run([sys.executable, str(named)], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(__import__("pathlib").Path(
                              __file__).resolve().parents[2])})
    assert proc.stdout.strip() == "grad_op" and "spec from" in proc.stderr
