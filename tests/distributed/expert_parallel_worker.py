"""topology.ep's token dispatch (parallel/engine/model/moe/expert_parallel.py) on each Hugging Face
mixture-of-experts block it splits, against one process: Mixtral top-2, Qwen2-MoE with its shared
expert (top-k weights not renormalised), a 64-expert top-8 Qwen3-MoE block, DeepSeek-V3 (group-limited
routing: every token's experts on one rank, so the other receives no rows). Each rank feeds its own
rows (hidden states that carry gradients, as inside a model); one process feeds them all. Recorded per
block: the largest output and gradient differences (experts on their owner; router and shared experts
summed over ranks), and which experts no rank routed to (they keep no gradient, as on one process).
The blocks are transformers 5's, their experts one module each (parallel/toy.py's `listed`: the layout
topology.ep splits).

    torchrun --nproc-per-node 2 expert_parallel_worker.py --out OUT.json
"""

import argparse
import copy
import json

import torch
import torch.distributed as dist

from parallel.engine.model.moe.expert_parallel import apply_expert_parallel
from parallel.toy import listed

H, ROWS, SEQ = 32, 2, 6


def blocks() -> dict:
    from transformers import DeepseekV3Config, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    return {
        "mixtral-top2": lambda: MixtralSparseMoeBlock(MixtralConfig(
            hidden_size=H, intermediate_size=64, num_local_experts=8, num_experts_per_tok=2)),
        "qwen2-moe-shared": lambda: Qwen2MoeSparseMoeBlock(Qwen2MoeConfig(
            hidden_size=H, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_experts=8, num_experts_per_tok=2, norm_topk_prob=False)),
        "qwen3-moe-64x8": lambda: Qwen3MoeSparseMoeBlock(Qwen3MoeConfig(
            hidden_size=H, moe_intermediate_size=16, num_experts=64, num_experts_per_tok=8,
            norm_topk_prob=True)),
        "deepseek-v3-grouped": lambda: DeepseekV3MoE(DeepseekV3Config(
            hidden_size=H, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2,
            n_group=2, topk_group=1, n_shared_experts=1)),
    }


def compare(name: str, make, rank: int, ep: int) -> dict:
    torch.manual_seed(0)
    block = make()
    # a bare transformers 5 block's router and fused experts are torch.empty until a model inits
    # them: nn.Linear's default bound, 1 / sqrt(fan in), as transformers 4.57's Linear experts had;
    # then one module per expert (parallel/toy.py's `listed`), the layout topology.ep splits
    for param in block.parameters():
        bound = param.shape[-1] ** -0.5
        torch.nn.init.uniform_(param, -bound, bound)
    if hasattr(block.gate, "e_score_correction_bias"):  # DeepSeek's router, as 4.57's test drew it
        torch.nn.init.normal_(block.gate.weight, std=0.2)
        block.gate.e_score_correction_bias.normal_()
    block = listed(block)
    whole = copy.deepcopy(block)
    x = torch.randn(ROWS * ep, SEQ, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = whole(x)
    out = out[0] if isinstance(out, tuple) else out
    (out ** 2).sum().backward()
    apply_expert_parallel([(name, block)], ep, rank, None)
    mine = x.detach()[rank * ROWS:(rank + 1) * ROWS].clone().requires_grad_()
    got = block(mine)
    got = got[0] if isinstance(got, tuple) else got
    (got ** 2).sum().backward()
    reference = dict(whole.named_parameters())
    experts, others, unused = 0.0, 0.0, []
    for pname, p in block.named_parameters():
        want = reference[pname].grad
        if ".experts." in f".{pname}" and "shared" not in pname:
            if want is None:
                unused.append(pname) if p.grad is None else unused.append(f"{pname} (has a grad)")
                continue
            experts = max(experts, (p.grad - want).abs().max().item())
        else:
            summed = p.grad.clone()
            dist.all_reduce(summed)
            others = max(others, (summed - want).abs().max().item())
    return {"output": (got - out[rank * ROWS:(rank + 1) * ROWS]).abs().max().item(),
            "input_grad": (mine.grad - x.grad[rank * ROWS:(rank + 1) * ROWS]).abs().max().item(),
            "expert_grads": experts, "other_grads": others, "unused": unused}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    a = p.parse_args()
    if not dist.is_initialized():  # in the suite's shared launch an earlier job made it
        dist.init_process_group("gloo")
    rank, ep = dist.get_rank(), dist.get_world_size()
    found = {name: compare(name, make, rank, ep) for name, make in blocks().items()}
    gathered = [None] * ep
    dist.all_gather_object(gathered, found)
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump(gathered, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
