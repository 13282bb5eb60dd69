"""One rank of the per-group sharding checks, run by torch.distributed.run (2 CPU ranks over gloo) from
test_sharding.py.

For each case a tiny model is sharded by trainer.distributed.sharding.shard_model with an fsdp_config, and the
rank reports, per parameter name, whether FSDP2 keeps its local shard on the CPU (its CPUOffloadPolicy), the
start-of-run line, and, for the cases that train, the largest difference between the parameters after one AdamW
step on the rank's half of a batch and those of the same model trained whole in this process on the whole batch.
Everything is written to OUT/rank<r>.json; the test asserts on it.

    python -m torch.distributed.run --standalone --nproc-per-node 2 sharding_ranks.py OUT
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import sys
from pathlib import Path
from unittest import mock

import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForTokenClassification

from trainer.config import FSDPConfig
from trainer.distributed import sharding
from trainer.distributed.host_adamw import HostAdamW
from trainer.distributed.layer_moves import ShardedLayers, fsdp_params_of
from trainer.distributed.ranks import Ranks
from trainer.distributed.shard_copies import watch_shard_copies
from trainer.distributed.sharding import shard_model, whole_weights
from trainer.offload.copies import CopyLog
from trainer.offload.groups import parameter_groups
from trainer.rollout import fused_norms

VOCABULARY, LENGTH, BATCH = 24, 7, 4

CASES = {
    # name: (model, fsdp_config, trains)
    "untied/embedding_and_head": ("untied", {"offload_policy": {"embedding": "cpu", "lm_head": "cpu"}}, True),
    "untied/param_offload_norm_on_gpu": ("untied", {"param_offload": True, "offload_policy": {"norm": "gpu"}}, True),
    "tied/embedding_only": ("tied", {"offload_policy": {"embedding": "cpu"}}, True),
    "tied/embedding_and_head": ("tied", {"offload_policy": {"embedding": "cpu", "lm_head": "cpu"}}, True),
    "critic/score": ("critic", {"offload_policy": {"lm_head": "cpu"}}, False),
    "untied/optimizer_offload": ("untied", {"optimizer_offload": True}, True),
    "untied/optimizer_and_param_offload": ("untied", {"optimizer_offload": True, "param_offload": True}, True),
    "untied/all_on_device": ("untied", {}, False),
    "bf16/optimizer_offload": ("bf16", {"optimizer_offload": True, "model_dtype": "bf16"}, True),
}


def tiny_model(kind: str) -> torch.nn.Module:
    config = Qwen2Config(vocab_size=VOCABULARY, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                         tie_word_embeddings=kind == "tied", pad_token_id=0, num_labels=1, initializer_range=0.2)
    torch.manual_seed(0)
    model = Qwen2ForTokenClassification(config) if kind == "critic" else Qwen2ForCausalLM(config)
    return model.to(torch.bfloat16) if kind == "bf16" else model.float()


def offloaded(model: torch.nn.Module) -> dict[str, bool]:
    """Each parameter's name, and whether its FSDP2 unit keeps the local shard on the CPU."""
    by_parameter: dict[int, bool] = {}
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for fsdp_param in fsdp_params_of(module):
                by_parameter[id(fsdp_param.sharded_param)] = fsdp_param.offload_to_cpu
    return {name: by_parameter[id(parameter)] for name, parameter in model.named_parameters()}


def loss_of(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross-entropy of `input_ids`."""
    logits = model(input_ids=input_ids).logits.float()
    return torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCABULARY), input_ids[:, 1:].reshape(-1))


def one_step(model: torch.nn.Module, input_ids: torch.Tensor, host: bool = False) -> torch.optim.Optimizer:
    """One AdamW step on the mean next-token loss of `input_ids` (with `host`, the trainer's HostAdamW, as
    optimizer_offload steps a sharded model); returns the optimizer."""
    optimizer = (HostAdamW(model.parameters(), lr=1e-2) if host else torch.optim.AdamW(model.parameters(), lr=1e-2))
    loss_of(model, input_ids).backward()
    optimizer.step()
    return optimizer


def one_mixed_step(model: torch.nn.Module, input_ids: torch.Tensor) -> torch.nn.Module:
    """One AdamW step as one rank takes it with optimizer_offload on a bf16 model: the gradient computed in bf16,
    the update on fp32 masters; returns the masters (an fp32 copy of the model)."""
    model.zero_grad()
    loss_of(model, input_ids).backward()
    masters = copy.deepcopy(model).float()
    for master, parameter in zip(masters.parameters(), model.parameters(), strict=True):
        master.grad = parameter.grad.float()
    torch.optim.AdamW(masters.parameters(), lr=1e-2).step()
    return masters


def full(parameter: torch.Tensor) -> torch.Tensor:
    return (parameter.full_tensor() if isinstance(parameter, DTensor) else parameter).detach()


def largest_difference(sharded: torch.nn.Module, whole: torch.nn.Module) -> float:
    expected = dict(whole.named_parameters())
    return max(float((full(parameter) - full(expected[name])).abs().max())
               for name, parameter in sharded.named_parameters())


def precision(sharded: torch.nn.Module, masters: torch.nn.Module, input_ids: torch.Tensor) -> dict:
    """A bf16 model with fp32 masters after a step: the shards' dtype, the forward's, the share of elements equal to
    one rank's update (a gradient rounded in another order can flip the sign of a tiny one: AdamW's first step moves
    each element by the learning rate), and the share a bf16 update could not have given (not a bf16 value)."""
    expected = dict(masters.named_parameters())
    values = {name: full(parameter) for name, parameter in sharded.named_parameters()}
    elements = sum(value.numel() for value in values.values())
    equal = sum(int(torch.isclose(value, expected[name].detach(), rtol=0, atol=1e-6).sum())
                for name, value in values.items())
    beyond_bf16 = sum(int((value != value.bfloat16().float()).sum()) for value in values.values())
    return {"shard_dtypes": sorted({str(value.dtype) for value in values.values()}),
            "forward_dtype": str(sharded(input_ids=input_ids).logits.dtype),
            "equal": equal / elements, "beyond_bf16": beyond_bf16 / elements}


class GatherCount:
    """Counts the all-gathers FSDP2 runs (torch.distributed.all_gather_single, or all_gather_into_tensor in older
    torch) while inside."""

    def __enter__(self) -> GatherCount:
        import torch.distributed as dist

        self.count = 0
        self.name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
        self.original = getattr(dist, self.name)

        def counted(*args, **kwargs):
            self.count += 1
            return self.original(*args, **kwargs)

        setattr(dist, self.name, counted)
        return self

    def __exit__(self, *_) -> None:
        import torch.distributed as dist

        setattr(dist, self.name, self.original)


def fsdp_hooks(model: torch.nn.Module) -> list[tuple[str, list[int], list[int]]]:
    """Each FSDP2 unit's forward pre-hooks and hooks (their keys, in order)."""
    return [(name, list(module._forward_pre_hooks), list(module._forward_hooks)) for name, module
            in model.named_modules() if isinstance(module, FSDPModule)]


def decode_checks(ranks: Ranks) -> dict:
    """Greedy decoding of 6 tokens by a sharded model (an offloaded embedding and head, layers on the device), with
    its whole weights held (sharding.whole_weights) and without: the same tokens, and how many all-gathers each ran."""
    model = tiny_model("untied")
    sharded = shard_model(model, FSDPConfig.model_validate({"offload_policy": {"embedding": "cpu", "lm_head": "cpu"}}),
                          ranks, role="actor", log=lambda _: None)
    prompts = torch.randint(1, VOCABULARY, (2, 4), generator=torch.Generator().manual_seed(ranks.rank + 2))
    results: dict = {}
    for whole in (False, True):
        with GatherCount() as gathers:
            with whole_weights(sharded, ranks) if whole else contextlib.nullcontext(False) as held:
                tokens = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=6,
                                        min_new_tokens=6, do_sample=False, synced_gpus=True, pad_token_id=0)
        results[f"whole={whole}"] = {"held": bool(held), "gathers": gathers.count, "tokens": tokens.tolist()}
    # Rank 1 short of device memory: neither rank holds the whole weights (a rank alone would wait in its gathers).
    short = mock.patch.object(sharding, "free_device_bytes", lambda device: 1.0 if ranks.rank == 1 else math.inf)
    with short, GatherCount() as gathers, whole_weights(sharded, ranks) as held:
        model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=6,
                       min_new_tokens=6, do_sample=False, synced_gpus=True, pad_token_id=0)
    results["one_rank_short"] = {"held": bool(held), "gathers": gathers.count}
    # The whole weights held and FSDP2's hooks off (sharding.plain_forwards): each rank decodes alone, rank 1 half as
    # many tokens as rank 0 (a forward that met the other rank's would wait for ever), gathering nothing more.
    before = fsdp_hooks(model)
    length = 6 if ranks.rank == 0 else 3
    with GatherCount() as gathers, whole_weights(sharded, ranks) as held, sharding.plain_forwards(model) as plain:
        inside = {"hooks": sum(len(pre) + len(post) for _, pre, post in fsdp_hooks(model)),
                  "grad": torch.is_grad_enabled(),
                  # The final norm is a unit of its own (class FSDPQwen2RMSNorm): the decode's fused norms take it.
                  "norm_fused": fused_norms._candidate(model.model.norm)
                  and fused_norms._computes_rms_norm(model.model.norm, model.model.norm.variance_epsilon)}
        tokens = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=length,
                                min_new_tokens=length, do_sample=False, synced_gpus=False, pad_token_id=0)
    inside["norm_sharded_candidate"] = fused_norms._candidate(model.model.norm)  # a shard outside: never fused
    results["plain"] = {"held": bool(held), "plain": plain, "gathers": gathers.count, "tokens": tokens.tolist(),
                        **inside, "hooks_back": fsdp_hooks(model) == before,
                        "hooks_before": sum(len(pre) + len(post) for _, pre, post in before)}
    # Afterwards FSDP2 gathers around each forward again, and a training step still works.
    one_step(model, prompts)
    results["units"] = sum(isinstance(module, FSDPModule) for module in model.modules())
    results["trains_after"] = bool(all(torch.isfinite(full(parameter)).all() for parameter in model.parameters()))
    return results


def moves_checks(ranks: Ranks, share: torch.Tensor) -> dict:
    """Dynamic offload of a sharded model's layers (layer_moves.ShardedLayers), moved by this rank alone: three
    steps of two micro-batches each, rank 0 moving layers between micro-batches (a gradient adding up) and between
    steps, rank 1 never, against the same model never moved. For torch's AdamW (its states move with the shards)
    and HostAdamW (states on the CPU). Then the memory manager moving them from a probe that reads over the
    threshold on rank 0 only."""
    from types import SimpleNamespace

    from trainer.memory import MemoryManager

    results: dict = {}
    plan = {(1, 1): 1, (2, 0): 0, (2, 1): 2, (3, 0): 1}  # (step, micro-batch) -> layers on the device after it
    for optimizer_name in ("adamw", "host"):
        models = {}
        for moving in (False, True):
            model = tiny_model("untied")
            layer_units = shard_model(model, FSDPConfig(), ranks, role="actor", log=lambda _: None).parts.layers
            models[moving] = model
        optimizers = {moving: (HostAdamW if optimizer_name == "host" else torch.optim.AdamW)(
            model.parameters(), lr=1e-2) for moving, model in models.items()}
        moving_optimizer = optimizers[True]
        layers = ShardedLayers("actor", layer_units, ranks.device, optimizer=lambda moving=moving_optimizer: moving)
        identities = [id(parameter) for parameter in models[True].parameters()]
        seen = []
        for step in (1, 2, 3):
            for moving, model in models.items():
                optimizers[moving].zero_grad()
                for micro, half in enumerate(share.chunk(2)):
                    (loss_of(model, half) / 2).backward()
                    if moving and ranks.rank == 0 and (step, micro) in plan:
                        layers.set_transformer_layers_on_gpu(plan[(step, micro)])
                        seen.append([fsdp_param.offload_to_cpu for unit in layers.transformer_units
                                     for fsdp_param in fsdp_params_of(unit)][::4])
                optimizers[moving].step()
        results[optimizer_name] = {
            "difference": largest_difference(models[True], models[False]),
            "moved": largest_difference(models[False], tiny_model("untied")),
            "same_objects": identities == [id(parameter) for parameter in models[True].parameters()],
            "offloaded_after_each_move": seen, "moves": layers.moves, "layers_on_gpu": layers.layers_on_gpu,
            "layer_bytes": layers.layer_bytes}
    # The memory manager: over the threshold on rank 0 only, so only rank 0's layers leave.
    model = tiny_model("untied")
    sharded = shard_model(model, FSDPConfig(), ranks, role="actor", log=lambda _: None)
    layers = ShardedLayers("actor", sharded.parts.layers, ranks.device)
    settings = SimpleNamespace(dynamic_offload_enabled=True, gpu_memory_threshold=0.5, min_transformer_layers_on_gpu=0)
    used = (0.9 if ranks.rank == 0 else 0.1) * 100 * layers.layer_bytes
    total = 100 * layers.layer_bytes
    manager = MemoryManager(ranks.device, settings=settings, probe=lambda: (int(used), total),
                            host_available=lambda: 1 << 40, log=lambda _: None, warn=lambda _: None)
    manager.add_sharded(layers, dynamic=True)
    manager.safe_point()
    metrics = manager.step_metrics()
    results["manager"] = {"layers_on_gpu": layers.layers_on_gpu, "moves_to_cpu": metrics["offload/moves_to_cpu"],
                          "metric": metrics["offload/actor/transformer_layers_on_gpu"],
                          "trains": bool(torch.isfinite(loss_of(model, share)).item())}
    return results


def main(out: Path) -> None:
    ranks = Ranks.from_environment("cpu")
    batch = torch.randint(1, VOCABULARY, (BATCH, LENGTH), generator=torch.Generator().manual_seed(1))
    share = batch.chunk(ranks.world_size)[ranks.rank]
    results: dict[str, dict] = {}
    for name, (kind, settings, trains) in CASES.items():
        whole = tiny_model(kind)
        model = copy.deepcopy(whole)
        lines: list[str] = []
        sharded = shard_model(model, FSDPConfig.model_validate(settings), ranks, role="actor", log=lines.append)
        layers_on_device = ShardedLayers("actor", sharded.parts.layers, ranks.device).layers_on_gpu  # as the metrics
        copies = CopyLog(cuda=False)
        watch_shard_copies(model, copies, parameter_groups(sharded.parts))
        results[name] = {"offloaded": offloaded(model), "lines": lines, "layers_on_device": layers_on_device,
                         # each group's whole bytes: a rank's copies of its shards are 1/world of them a gather
                         "group_bytes": {group: sum(parameter.numel() * parameter.element_size()
                                                    for parameter in modules.parameters())
                                         for group, modules in (("embedding", whole.get_input_embeddings()),
                                                                ("lm_head", whole.get_output_embeddings()))
                                         if modules is not None}}
        host = bool(settings.get("optimizer_offload"))
        if trains and kind == "bf16":
            one_step(model, share, host)
            results[name] |= precision(model, one_mixed_step(whole, batch), share)
        elif trains:
            one_step(model, share, host)  # FSDP2 averages the ranks' gradients: the whole batch's mean loss
            one_step(whole, batch)
            results[name]["difference"] = largest_difference(model, whole)
            # The check can fail: a step moves the weights by far more than the tolerance.
            results[name]["moved"] = largest_difference(model, tiny_model(kind))
        if trains:  # the copies FSDP2 made of the shards on the CPU (up) and of their gradients (down), by group
            rows = copies.drain_counts()
            results[name]["copies"] = {row["group"]: [row["copies"], row["bytes"]] for row in rows
                                       if row["direction"] == "h2d"}
            results[name]["gradient_copies"] = {row["group"]: [row["copies"], row["bytes"]] for row in rows
                                                if row["direction"] == "d2h"}
            # Each trained shard's gradient bytes on this rank (what one backward sends down of the offloaded ones).
            results[name]["gradient_bytes"] = sum(
                local.numel() * local.element_size() for local in
                ((parameter.grad.to_local() if isinstance(parameter.grad, DTensor) else parameter.grad)
                 for parameter in model.parameters() if parameter.grad is not None))
    results["decode"] = decode_checks(ranks)
    results["moves"] = moves_checks(ranks, share)
    # A frozen weight (as a LoRA adapter's base) keeps the model's dtype beside the fp32 masters of the trained ones.
    frozen = tiny_model("bf16")
    frozen.model.embed_tokens.requires_grad_(False)
    shard_model(frozen, FSDPConfig.model_validate({"optimizer_offload": True, "model_dtype": "bf16"}), ranks,
                role="actor", log=lambda _: None)
    results["frozen_embedding_dtypes"] = {name: str(parameter.dtype) for name, parameter in frozen.named_parameters()
                                          if "layers.1" not in name}
    (out / f"rank{ranks.rank}.json").write_text(json.dumps(results, indent=1))
    ranks.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
