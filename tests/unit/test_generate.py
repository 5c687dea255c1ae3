"""The static-shape generation loop (parallel/engine/infer/generate.py) against transformers' own generate,
on real models in one process: left-padded prompts, early EOS, refusals named."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, T5Config, \
    T5ForConditionalGeneration

from parallel.engine.infer.generate import check_static, library_model, static_generate


def llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2)).eval()


def gpt2():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4,
                                      n_positions=128)).eval()


def prompts():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 256, (3, 7), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0  # a shorter prompt, left-padded
    return ids, mask


@pytest.mark.parametrize("build", [llama, gpt2])
def test_greedy_tokens_equal_transformers_generate(build):
    model = build()
    ids, mask = prompts()
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=9, do_sample=False,
                              pad_token_id=0)
    got = static_generate(model, model, ids, attention_mask=mask, max_new_tokens=9,
                          pad_token_id=0, bucket=16)
    assert torch.equal(got, expected)


def test_early_eos_pads_the_finished_row_as_transformers_does():
    model = llama()
    ids, mask = prompts()
    free = static_generate(model, model, ids, attention_mask=mask, max_new_tokens=6,
                           pad_token_id=0)
    eos = int(free[0, 7 + 2])  # row 0's third new token becomes its EOS
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                              pad_token_id=0, eos_token_id=eos)
    got = static_generate(model, model, ids, attention_mask=mask, max_new_tokens=6,
                          pad_token_id=0, eos_token_id=eos)
    # transformers stops once every row is done; the static loop always runs max_new_tokens
    assert torch.equal(got[:, :expected.shape[1]], expected)
    assert (got[0, 7 + 3:] == 0).all() and int(got[0, 7 + 2]) == eos


def test_sampling_is_reproducible_and_top_k_holds():
    model = llama()
    ids, mask = prompts()
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        runs.append(static_generate(model, model, ids, attention_mask=mask, max_new_tokens=5,
                                    do_sample=True, top_k=1, pad_token_id=0))
    greedy = static_generate(model, model, ids, attention_mask=mask, max_new_tokens=5,
                             pad_token_id=0)
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], greedy)  # top_k=1 is greedy


def test_refusals_name_what_differs():
    model = llama()
    ids, mask = prompts()
    with pytest.raises(ValueError, match="num_beams not supported"):
        check_static(model, {"max_new_tokens": 3, "num_beams": 2})
    with pytest.raises(ValueError, match="pass max_new_tokens"):
        check_static(model, {})
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=1,
                                             num_heads=2, d_kv=16))
    with pytest.raises(ValueError, match="encoder-decoder"):
        check_static(t5, {"max_new_tokens": 3})
    right = torch.ones_like(mask)
    right[0, -2:] = 0
    with pytest.raises(ValueError, match="padding_side='left'"):
        static_generate(model, model, ids, attention_mask=right, max_new_tokens=2)


def test_library_model_is_found_inside_wrappers():
    model = llama()
    wrapper = torch.nn.Sequential(torch.nn.Sequential(model))
    assert library_model(wrapper) is model
    with pytest.raises(TypeError, match="needs a Hugging Face model"):
        library_model(torch.nn.Linear(2, 2))


def test_a_peft_model_generates_as_its_base_does():
    """LoRA adapters (peft): left-padded prompts keep their positions through the adapter's
    forward, which passes position_ids on to the Llama it adapts."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"])).eval()
    ids, mask = prompts()
    expected = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5,
                              do_sample=False, pad_token_id=0)
    got = static_generate(model, model, ids, attention_mask=mask, max_new_tokens=5,
                          pad_token_id=0, bucket=16)
    assert library_model(torch.nn.Sequential(model)) is model
    assert torch.equal(got, expected)
