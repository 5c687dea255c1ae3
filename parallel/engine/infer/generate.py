"""`engine.generate` and `engine.unwrap()`: Hugging Face generation on a sharded model.

Where a forward gathers parameters (FSDP, ZeRO-3, XLA FSDP v1), every rank must run the same
number of forwards, or a rank that finished early leaves the others waiting in a gather for ever.
On torch devices the model's own `generate` runs with `synced_gpus` (transformers keeps each
finished rank running dummy forwards until every rank is done: one small all-reduce per token).

On XLA a growing sequence is a new shape per token, and XLA compiles a graph per shape (measured
before this module: 3 new tokens took 10.6 s, 16 did not finish in 3 minutes). `static_generate`
keeps every shape fixed, as torch_xla's guidance asks: one (batch, width) buffer, `width` rounded up
to a bucket, the prompt right-aligned in it (left padding, masked), and each new token written at a
position held in a device tensor, so every step is the same graph. It runs the model over the whole
buffer per token (no KV cache: a cache's index updates are the data-dependent part), and exactly
`max_new_tokens` steps on every rank (no host read per token; ranks stay in step by construction).
Rows that reached EOS get `pad_token_id` from then on, as transformers pads them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import nn

# what static_generate does with transformers' generate keywords; any other is refused by name
STATIC_KEYWORDS = {"attention_mask", "max_new_tokens", "eos_token_id", "pad_token_id",
                   "do_sample", "temperature", "top_k", "bucket", "use_cache"}


def hf_generate(model: nn.Module, input_ids: torch.Tensor, synced: bool, **kwargs) -> torch.Tensor:
    """transformers' generate, with every rank in step where forwards gather (`synced`)."""
    if not getattr(model.config, "is_encoder_decoder", False):
        # unpadded prompts: said, so transformers does not guess padding from pad == eos
        kwargs.setdefault("attention_mask", torch.ones_like(input_ids))
    kwargs.setdefault("synced_gpus", synced)
    return model.generate(input_ids, **kwargs)


def check_static(model: nn.Module, kwargs: dict) -> None:
    """What static_generate cannot do, refused by name before any device work."""
    unknown = sorted(set(kwargs) - STATIC_KEYWORDS)
    if unknown:
        raise ValueError(f"engine.generate on XLA: {', '.join(unknown)} not supported by the "
                         f"static-shape loop (it takes {', '.join(sorted(STATIC_KEYWORDS))}); "
                         "beam search, top_p and logits processors would need their own "
                         "static forms (docs/generate.md)")
    if getattr(model.config, "is_encoder_decoder", False):
        raise ValueError(f"engine.generate on XLA: {type(model).__name__} is an encoder-decoder "
                         "model; the static-shape loop generates with decoder-only models")
    if "max_new_tokens" not in kwargs:
        raise ValueError("engine.generate on XLA: pass max_new_tokens (the buffer's width is "
                         "fixed before the first token)")


def _accepts(model: nn.Module, name: str) -> bool:
    """Whether the model's forward takes `name`; a peft model's forward passes its keywords through
    (**kwargs) to the model it adapts, whose forward decides."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    return name in inspect.signature(base.forward).parameters


def static_generate(model: nn.Module, call: Callable, input_ids: torch.Tensor, *,
                    max_new_tokens: int, attention_mask: torch.Tensor | None = None,
                    eos_token_id=None, pad_token_id: int | None = None, do_sample: bool = False,
                    temperature: float = 1.0, top_k: int | None = None, bucket: int = 64,
                    use_cache: bool = False, end_step: Callable[[], None] = lambda: None,
                    place: Callable[[torch.Tensor], None] = lambda t: None,
                    device=None) -> torch.Tensor:
    """Prompt plus `max_new_tokens` generated ids per row, shape (batch, prompt + new), on the
    host. `model`: the Hugging Face model (its config and forward's arguments); `call`: what runs a
    forward (the sharded wrapper); `end_step`: cuts the step's graph (torch_xla.sync)."""
    del use_cache  # never: the cache's growth is what would change shapes
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    if bool((mask[:, -1] == 0).any()):
        raise ValueError("engine.generate: a prompt is right-padded (attention_mask ends in 0); "
                         "tokenize with padding_side='left' so each row's last token is its own")
    eos = _ids(eos_token_id if eos_token_id is not None else model.config.eos_token_id)
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    rows, prompt = input_ids.shape
    width = -(-(prompt + max_new_tokens) // bucket) * bucket  # one graph per bucket, not per length
    start = width - max_new_tokens  # first generated position; the prompt ends just before it
    ids = torch.full((rows, width), pad, dtype=torch.long)
    ids[:, start - prompt:start] = input_ids.cpu()
    full_mask = torch.zeros((rows, width), dtype=torch.long)
    full_mask[:, start - prompt:start] = mask.cpu()
    ids, full_mask = ids.to(device), full_mask.to(device)
    positions = torch.arange(width, device=device)
    # the last written position, as device data (a 0-d tensor made on the device from a number can
    # become a constant of the graph: a new graph per prompt length, measured under SPMD)
    cur = torch.tensor(start - 1).to(device)
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    eos_t = torch.tensor(eos or [-1], device=device)
    extra = {"position_ids": None} if _accepts(model, "position_ids") else {}
    keep = _accepts(model, "logits_to_keep")
    for t in (ids, full_mask, done):
        place(t)
    end_step()  # the buffers are device data before the first step: every step's graph is alike
    for _ in range(max_new_tokens):
        if extra:  # left padding: positions count the row's own tokens, as generate computes them
            extra["position_ids"] = (full_mask.cumsum(-1) - 1).clamp(min=0)
        more = {"logits_to_keep": cur.reshape(1)} if keep else {}
        logits = call(input_ids=ids, attention_mask=full_mask, use_cache=False, **extra,
                      **more).logits
        last = logits[:, -1] if keep else logits.index_select(1, cur.reshape(1))[:, 0]
        token = _choose(last.float(), do_sample, temperature, top_k)
        token = torch.where(done, torch.full_like(token, pad), token)
        write = positions == cur + 1
        ids = torch.where(write, token[:, None], ids)
        full_mask = torch.where(write, torch.ones_like(full_mask), full_mask)
        done = done | (token[:, None] == eos_t[None, :]).any(-1)  # isin reads values on XLA
        cur = cur + 1
        for t in (ids, full_mask, done):
            place(t)
        end_step()
    return ids.cpu()[:, start - prompt:]  # sliced on the host: a device slice is a graph per length


def _ids(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _choose(scores: torch.Tensor, do_sample: bool, temperature: float,
            top_k: int | None) -> torch.Tensor:
    if not do_sample:
        return scores.argmax(-1)
    scores = scores / temperature
    if top_k:
        kth = scores.topk(top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    # Gumbel-max: a sample from softmax(scores) with elementwise ops only (no host-side sampling)
    noise = -torch.log(-torch.log(torch.rand_like(scores).clamp(1e-20, 1.0)))
    return (scores + noise).argmax(-1)


def library_model(wrapped: nn.Module) -> nn.Module:
    """The Hugging Face (or peft) model inside a backend's wrappers: the outermost module that has
    `generate` and a `config`."""
    for module in wrapped.modules():
        if callable(getattr(module, "generate", None)) and hasattr(module, "config"):
            return module
    raise TypeError(f"engine.generate: no module with generate() and a config in "
                    f"{type(wrapped).__name__}; generate needs a Hugging Face model (or a peft "
                    "model around one)")
