"""What a model config may ask for: each size field within the largest public models' (MODEL_LIMITS)
and the parameters its sizes make within PARAM_LIMIT, checked before anything is built
(`model_size_problem`): for `--model` configs (toy.model_config) and a checkpoint's hf_config.json
(the Hugging Face export) alike."""

from __future__ import annotations

# What a --model config may ask for: above the largest public models (Llama 3.1 405B: 126 layers,
# hidden 16384, MLP 53248, vocabulary 128256; DeepSeek-V3: 256 experts), below what exhausts memory
# while the model is merely built on the meta device (measured: 1e8 layers ran until memory ran out).
MODEL_LIMITS = {"num_hidden_layers": 1024, "n_layer": 1024, "num_layers": 1024,
                "hidden_size": 1 << 17, "n_embd": 1 << 17, "d_model": 1 << 17,
                "intermediate_size": 1 << 20, "moe_intermediate_size": 1 << 20, "vocab_size": 1 << 23,
                "num_attention_heads": 4096, "num_local_experts": 4096, "num_experts": 4096,
                "n_routed_experts": 4096, "max_position_embeddings": 1 << 24}


# The product too: each field within its limit still allows 1.7e13 parameters (a dry run of it
# allocated 34 GB). Twice the largest model announced (2T parameters).
PARAM_LIMIT = 4 * 10**12


def model_size_problem(data: dict) -> str | None:
    """What is wrong with a config's sizes, or None: a size field that is not a positive integer,
    above its limit (MODEL_LIMITS), or parameters (estimated from the sizes, sub-configs summed)
    above PARAM_LIMIT. For `--model` configs and a checkpoint's hf_config.json alike."""
    wrong = [f"{k} {v!r}" for k, v in _sizes(data) if v is not None and not (
        isinstance(v, int) and not isinstance(v, bool) and v >= 1)]
    if wrong:
        return f"{', '.join(wrong[:4])}: a size is a positive integer"
    too_big = [k for k, v in _sizes(data) if v is not None and v > MODEL_LIMITS[k]]
    if too_big:
        return (f"{', '.join(f'{k} {v}' for k, v in _sizes(data) if k in too_big)} exceed what any "
                f"model has ({', '.join(f'{k} <= {MODEL_LIMITS[k]:,}' for k in sorted(set(too_big)))})")
    params = estimated_params(data)
    if params > PARAM_LIMIT:
        return (f"its sizes make about {params:.2g} parameters, more than the {PARAM_LIMIT:.0e} "
                "polyshard builds (twice the largest model announced); check the layer, hidden, "
                "expert and vocabulary sizes")
    return None


def estimated_params(data: dict) -> float:
    """Parameters from a config's sizes (attention 4h^2, MLP 3h x intermediate per expert,
    embeddings and head 2 x vocab x h per layer stack), sub-configs summed: an upper-bound-ish
    estimate, for limits only (plan counts the built model)."""
    def first(*keys, default=0):
        return next((data[k] for k in keys if isinstance(data.get(k), int)), default)

    layers = first("num_hidden_layers", "n_layer", "num_layers")
    hidden = first("hidden_size", "n_embd", "d_model")
    mlp = max(first("intermediate_size", default=4 * hidden),
              first("num_local_experts", "num_experts", "n_routed_experts", default=1)
              * first("moe_intermediate_size", "intermediate_size", default=4 * hidden))
    own = float(layers) * (4.0 * hidden * hidden + 3.0 * hidden * mlp) + 2.0 * first(
        "vocab_size") * hidden
    return own + sum(estimated_params(v) for v in data.values() if isinstance(v, dict))


def _sizes(data: dict):
    """Every size-named value in the config and its sub-configs (text_config, vision_config, ...)."""
    for key, value in data.items():
        if isinstance(value, dict):
            yield from _sizes(value)
        elif key in MODEL_LIMITS:
            yield key, value
