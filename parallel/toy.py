"""A small, download-free job: byte-level text and a Llama-style model built from a config.

Shared by the demo, the tests and `polyshard bench`, so all of them train the same thing.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.utils.data import Dataset

CORPUS = Path(__file__).resolve().parent.parent / "examples" / "data" / "corpus.txt"


class ByteDataset(Dataset):
    """Non-overlapping windows of `seq_len` bytes; labels are the inputs (the model shifts them)."""

    def __init__(self, text: bytes | None = None, seq_len: int = 128):
        data = text if text is not None else CORPUS.read_bytes()
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        n = len(tokens) // seq_len
        self.blocks = tokens[: n * seq_len].view(n, seq_len)

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


SIZES = CORPUS.parent / "toy_models.json"  # shared with benchmarks/common.py


def llama_config(size: str = "demo", **overrides):
    """`demo`: ~3.2M parameters; `tiny`: ~0.1M, for tests (sizes: examples/data/toy_models.json);
    `mixtral`, `qwen2_moe`, `qwen3_moe` (64 experts, top-8): tiny mixture-of-experts models of
    those Hugging Face classes, each expert a module of its own (`listed`)."""
    import json

    from transformers import AutoConfig, LlamaConfig

    sizes = json.loads(SIZES.read_text())
    if size not in sizes or size.startswith("_") or size == "common":
        raise ValueError(f"toy:{size}: the toy models are "
                         f"{', '.join(k for k in sizes if k[0] != '_' and k != 'common')}")
    fields = {**sizes["common"], **sizes[size], **overrides}
    kind = fields.pop("model_type", None)
    return AutoConfig.for_model(kind, **fields) if kind else LlamaConfig(**fields)


def build_llama(config):
    """A fresh causal LM of `config` (LlamaForCausalLM for Llama's) in fp32 (the seed decides the
    weights)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if type(config) is LlamaConfig:
        return LlamaForCausalLM(config).float()
    return listed(AutoModelForCausalLM.from_config(config, dtype=torch.float32))


# The toy mixtures of experts keep one module per expert: the layout of an MoE of one's own (and of
# transformers 4.57), which topology.ep and the unused-expert rule split and drop per expert
# (parallel/engine/model/moe/). transformers 5 fuses a block's experts into 3-D tensors
# (`experts.gate_up_proj` [E, 2F, D], `experts.down_proj` [E, D, F]); `listed(model)` puts each
# expert's rows of them in a module of its own, called as the fused module is (hidden states, top-k
# indices, top-k weights) by the model's own block: the same numbers, one module per expert. A
# model built from a config.json (`build_model`) keeps transformers' fused layout.
NAMES = {"mixtral": ("w1", "w3", "w2"), None: ("gate_proj", "up_proj", "down_proj")}


class Expert(torch.nn.Module):
    """One expert's gate, up and down projections, named as the family's per-expert checkpoints
    name them (Mixtral's w1 / w3 / w2, Qwen-MoE's gate_proj / up_proj / down_proj): transformers
    5's loader fuses exactly those names into its 3-D tensors, so save_pretrained's files load
    in AutoModelForCausalLM with the same weights."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, act,
                 names: tuple[str, str, str]):
        super().__init__()
        self.names = names
        for name, weight in zip(names, (gate, up, down)):
            linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            with torch.no_grad():
                linear.weight.copy_(weight)
            self.add_module(name, linear)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, n) for n in self.names)
        return down(self.act(gate(x)) * up(x))


class ListedExperts(torch.nn.ModuleList):
    """The fused module's loop (transformers 5's MixtralExperts.forward), one module per expert,
    each expert's rows taken token by token (as transformers 4.57's loops did; 5's takes them slot
    by slot): the order in which topology.ep's owner receives them, rank after rank, so its
    weight gradients sum the same rows in the same order as one process."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = torch.nn.functional.one_hot(top_k_index, num_classes=len(self) + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for index in hit:
            index = int(index[0])
            if index == len(self):
                continue
            token, slot = torch.where(mask[index].T)
            rows = self[index](hidden_states[token]) * top_k_weights[token, slot, None]
            out.index_add_(0, token, rows.to(out.dtype))
        return out


def listed(model: torch.nn.Module) -> torch.nn.Module:
    """`model` with every fused experts module replaced by a ListedExperts of the same weights."""
    names = NAMES.get(getattr(getattr(model, "config", None), "model_type", None), NAMES[None])
    for module in list(model.modules()):
        fused = getattr(module, "experts", None)
        if isinstance(fused, torch.nn.Module) and getattr(fused, "gate_up_proj", None) is not None:
            module.experts = ListedExperts(
                Expert(*fused.gate_up_proj[e].detach().chunk(2), fused.down_proj[e].detach(),
                       fused.act_fn, names) for e in range(fused.gate_up_proj.shape[0]))
    return model


class OwnDecoder(torch.nn.Module):
    """A model of your own, written as torchtitan writes its models (not a Hugging Face class):
    `tok_embeddings`, `layers` (a ModuleList), `norm`, `output`, one loop; causal attention over
    the real tokens of padded rows; `.loss` (transformers' causal-LM loss) when given labels. The
    tests split it into pipeline stages by `pipeline.split_points` (docs/pipeline.md)."""

    def __init__(self, vocab: int = 256, width: int = 32, layers: int = 2, heads: int = 4):
        super().__init__()
        self.tok_embeddings = torch.nn.Embedding(vocab, width)
        self.layers = torch.nn.ModuleList(torch.nn.TransformerEncoderLayer(
            width, heads, 2 * width, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = torch.nn.LayerNorm(width)
        self.output = torch.nn.Linear(width, vocab, bias=False)

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = self.tok_embeddings(input_ids)  # on later pipeline stages: an identity on activations
        causal = torch.nn.Transformer.generate_square_subsequent_mask(h.shape[1], device=h.device)
        padding = None if attention_mask is None else torch.zeros(
            attention_mask.shape, device=h.device).masked_fill(attention_mask == 0, float("-inf"))
        for layer in self.layers:
            h = layer(h, src_mask=causal, src_key_padding_mask=padding, is_causal=True)
        logits = self.output(self.norm(h))
        if labels is None:
            return logits
        from transformers.loss.loss_utils import ForCausalLMLoss
        from transformers.modeling_outputs import CausalLMOutput

        return CausalLMOutput(loss=ForCausalLMLoss(logits, labels, logits.shape[-1]), logits=logits)


def model_config(source: str):
    """A Hugging Face config from a local config.json (a file, or a directory holding one): read as
    bounded data, never fetched from the Hub, never running a repository's code (`auto_map`)."""
    from transformers import AutoConfig

    from parallel.files import FileError, load_json
    from parallel.spec.errors import SpecError

    path = Path(source)
    path = path / "config.json" if path.is_dir() else path
    if not path.exists():
        raise SpecError([("--model", f"{source!r} is not a local file or directory: polyshard reads "
                          "a config.json you have (it never downloads); pass its path, or toy:demo")])
    try:
        data = load_json(path, "a model config")
    except FileError as err:
        raise SpecError([("--model", str(err))]) from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise SpecError([("--model", f"{path}: a Hugging Face config.json has a model_type")])
    if "auto_map" in data:
        raise SpecError([("--model", f"{path}: needs its repository's own code (auto_map "
                          f"{sorted(data['auto_map'])}), which polyshard never runs")])
    from parallel.kits.model_limits import model_size_problem

    problem = model_size_problem(data)
    if problem:
        raise SpecError([("--model", f"{path}: {problem}")])
    fields = {k: v for k, v in data.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(data["model_type"], **fields)
    except (ValueError, KeyError, TypeError) as err:
        raise SpecError([("--model", f"{path}: transformers cannot build this config ({err})")]) \
            from None


def meta_model(source: str):
    """`build_model(source)` on the meta device: shapes and structure, nothing allocated."""
    import os

    os.environ.setdefault("USE_TORCH_XLA", "0")  # a meta-device build needs no XLA runtime
    with torch.device("meta"):
        return build_model(source)


def load_factory(source: str, flag: str = "--model", what: str = "a function returning the model"):
    """`package.module:function` -> the function, or None when `source` is not of that form (a
    path such as ./config.json or C:/x is not)."""
    import importlib
    import re
    import sys

    if not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", source):
        return None
    module, name = source.split(":")
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # the working directory, as `python -m` has it
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{flag} {source!r}: {err}; give module:function importable from the "
                         f"working directory ({what})") from None


def build_model(source: str):
    """toy:demo / toy:tiny, `module:factory` (your own model: a function of no arguments
    returning a module with a causal-LM `forward(input_ids, labels).loss`, e.g. a peft LoRA model;
    the module is imported from the working directory, as `python -m` would), or a Hugging Face
    config.json (random weights from the current seed)."""
    if source.startswith("toy:"):
        return build_llama(llama_config(source[4:]))
    factory = load_factory(source)
    if factory is not None:
        return factory()
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(model_config(source), dtype=torch.float32,
                                            trust_remote_code=False)
