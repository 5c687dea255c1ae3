"""FLOPs per token and device peaks: the one place MFU's two halves come from (the tracker's
train/mfu and `polyshard bench`'s column).

FLOPs per token follow PaLM (Chowdhery et al. 2022, appendix B) as torchtitan counts them: 6 x
non-embedding parameters (forward + backward) + 12 x layers x hidden x sequence (attention), over
every token fed (padding included: the device computes it). Peaks are dense, from vendor data
sheets; fp32 uses the TF32 figure only when torch's float32 matmul precision allows TF32 (torch's
default, "highest", does not)."""

from __future__ import annotations

from torch import nn

# device-name fragment -> dense TFLOP/s (bf16/fp16, tf32, fp32); the first fragment contained in
# the device's name wins, so specific names come before their family's
PEAK_TFLOPS = (("H100 NVL", (835, 418, 60)), ("H100 PCIe", (756, 378, 51)),
               ("H200", (989, 494, 67)), ("H100", (989, 494, 67)), ("B200", (2250, 1100, 80)),
               ("A100", (312, 156, 19.5)), ("L40S", (362, 183, 91.6)), ("L4", (121, 60, 30.3)),
               ("A10", (125, 62.5, 31.2)), ("V100", (125, 15.7, 15.7)),
               ("4090", (165, 82.6, 82.6)), ("MI300X", (1307, 654, 163)))


def peak_flops(device_name: str, precision: str, tf32: bool = False) -> float | None:
    """FLOP/s of one device of that name in the compute dtype, or None for a device not listed
    (a CPU: never guessed)."""
    # fp8 against the bf16 peak, as torchtitan reports it: a float8 run's gain shows as a higher MFU
    column = 0 if precision in ("bf16", "fp16", "fp8") else 1 if tf32 else 2
    return next((peaks[column] * 1e12 for key, peaks in PEAK_TFLOPS if key in device_name), None)


def model_flops(model: nn.Module) -> tuple[int, tuple[int, int] | None]:
    """(non-embedding parameters, (layers, hidden) of a transformer config, or None)."""
    embedding = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Embedding))
    params = sum(p.numel() for p in model.parameters()) - embedding
    cfg = getattr(model, "config", None)
    layers, hidden = (getattr(cfg, "num_hidden_layers", None), getattr(cfg, "hidden_size", None))
    return params, (layers, hidden) if layers and hidden else None


def flops_per_token(params: int, attention: tuple[int, int] | None, width: int) -> float:
    return 6.0 * params + (12.0 * attention[0] * attention[1] * width if attention else 0.0)
