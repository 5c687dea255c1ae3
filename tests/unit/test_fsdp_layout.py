"""FSDP2's edge units as torchtitan lays them out (backends/fsdp/layout.py), on models as built."""

import pytest
import torch

from backends.fsdp.layout import edge_units
from parallel.engine.model.wrap import plan_wrap
from parallel.spec.sections import Wrap

transformers = pytest.importorskip("transformers")
SMALL = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
             intermediate_size=32)


def _units(model):
    return edge_units(model, plan_wrap(model, Wrap()))


def test_untied_llama_embedding_alone_then_norm_and_head_kept_gathered():
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    (embed, embed_reshard), (tail, tail_reshard) = _units(model)
    assert embed == [model.model.embed_tokens] and embed_reshard is True
    assert tail == [model.model.norm, model.lm_head] and tail_reshard is False


def test_tied_embeddings_are_one_unit_kept_gathered():
    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=64, n_embd=16, n_layer=1, n_head=2))
    (group, reshard), = _units(model)
    assert group == [model.transformer.wte, model.transformer.ln_f, model.lm_head] and not reshard


def test_a_peft_model_gets_its_base_models_layout():
    peft = pytest.importorskip("peft")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    names = [[type(m).__name__ for m in group] for group, _ in _units(wrapped)]
    assert names == [["Embedding"], ["LlamaRMSNorm", "Linear"]]


def test_a_plain_module_and_a_wrapped_embedding_add_no_unit():
    assert edge_units(torch.nn.Sequential(torch.nn.Linear(2, 2)), []) == []
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL))
    inside = [("model.embed_tokens", model.model.embed_tokens)]
    assert [m for group, _ in edge_units(model, inside) for m in group] == [model.model.norm,
                                                                          model.lm_head]


def test_a_parameter_also_held_outside_the_unit_leaves_that_edge_to_the_root():
    # BERT's cls.predictions.bias is cls.predictions.decoder.bias: sharding the decoder alone would
    # leave the parent's name on the old tensor (a stale copy in every checkpoint and export).
    with torch.device("meta"):
        model = transformers.BertForMaskedLM(transformers.BertConfig(**SMALL))
    assert model.cls.predictions.bias is model.cls.predictions.decoder.bias
    bert = Wrap(policy="layer_classes", layer_classes=["BertLayer"])
    assert edge_units(model, plan_wrap(model, bert)) == []
    with torch.device("meta"):
        untied = transformers.BertForMaskedLM(transformers.BertConfig(**SMALL, tie_word_embeddings=False))
    groups = edge_units(untied, plan_wrap(untied, bert))
    # transformers 5 unties the decoder's bias from cls.predictions.bias too: the decoder is an
    # edge of its own there
    assert untied.cls.predictions.bias is not untied.cls.predictions.decoder.bias
    assert [m for group, _ in groups for m in group] == [untied.bert.embeddings.word_embeddings,
                                                        untied.cls.predictions.decoder]
