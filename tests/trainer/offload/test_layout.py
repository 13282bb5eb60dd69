"""The offload layout on its own (trainer/offload/layout.py): which unit each module group becomes, where
it is placed and what host memory it will take, decided before anything is moved or allocated."""

from __future__ import annotations

import typing

import pytest
import torch

from tests.trainer.offload.test_offload import POLICIES, offloaded, policy
from trainer.config import FSDPConfig
from trainer.config.schema import Placement as ConfigPlacement
from trainer.offload import GROUPS
from trainer.offload.layout import plan_layout
from trainer.offload.units import Placement, UnitKind


def plan(model: torch.nn.Module, settings: dict, **options):
    fsdp = FSDPConfig.model_validate(settings)
    return plan_layout(model, {group: fsdp.placement(group) for group in GROUPS},
                       optimizer_offload=fsdp.optimizer_offload, layer_classes=None,
                       dynamic_layers=options.get("dynamic_layers", False),
                       layers_on_gpu=options.get("layers_on_gpu"), host_grad_dtype=None)


def kinds(layout) -> dict[str, tuple[UnitKind, Placement]]:
    return {unit.name: (unit.kind, unit.placement) for unit in layout.units}


def test_placements_are_the_config_values():
    assert {str(placement) for placement in Placement} == set(typing.get_args(ConfigPlacement))


def test_planning_moves_and_allocates_nothing():
    model = policy()
    before = {name: (parameter.data_ptr(), parameter.device) for name, parameter in model.named_parameters()}
    layout = plan(model, POLICIES["all_cpu"])
    assert all(unit.arena is None and not unit.blocks for unit in layout.units)
    assert {name: (parameter.data_ptr(), parameter.device) for name, parameter in model.named_parameters()} == before


def test_each_group_becomes_the_unit_its_placement_needs():
    layout = plan(policy(), POLICIES["all_cpu"])
    assert kinds(layout) == {
        "embedding": (UnitKind.ROWS, Placement.CPU),  # rows gathered on the CPU
        **{f"layers.{index}": (UnitKind.HOOKED, Placement.CPU) for index in range(4)},  # streamed blocks
        "norm": (UnitKind.HOOKED, Placement.CPU),
        "lm_head": (UnitKind.CHUNKS, Placement.CPU),  # streamed in row chunks
    }
    resident = plan(policy(), POLICIES["all_gpu"])
    assert {kind for kind, _ in kinds(resident).values()} == {UnitKind.RESIDENT}
    # With the optimizer on the CPU a trainable unit on the GPU keeps its masters on the host.
    optimizer = plan(policy(), POLICIES["optimizer_offload"])
    assert kinds(optimizer)["layers.0"] == (UnitKind.HOOKED, Placement.GPU)


def test_a_tied_head_goes_where_the_embedding_needs_it_and_is_one_unit():
    tied = {"override_config": {"num_hidden_layers": 2, "tie_word_embeddings": True}}
    layout = plan(policy(**tied), {"offload_policy": {"embedding": "cpu"}})
    assert layout.parts.tied and "lm_head" not in kinds(layout)
    # The head stays on the GPU, so the one weight does too.
    assert layout.placements["embedding"] == layout.placements["lm_head"] == Placement.GPU
    layout = plan(policy(**tied), {"offload_policy": {"embedding": "cpu", "lm_head": "cpu"}})
    assert kinds(layout)["embedding"] == (UnitKind.ROWS, Placement.CPU)


def test_dynamic_layers_start_with_the_first_ones_on_the_gpu():
    layout = plan(policy(), {}, dynamic_layers=True, layers_on_gpu=1)
    assert [unit.placement for unit in layout.transformer_units] == [Placement.GPU] + [Placement.CPU] * 3
    assert all(unit.kind == UnitKind.HOOKED for unit in layout.transformer_units)
    with pytest.raises(ValueError, match="layers_on_gpu needs dynamic_layers"):
        plan(policy(), {}, layers_on_gpu=1)


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_the_host_memory_planned_is_what_the_engine_holds_once_placed(name):
    layout = plan(policy(), POLICIES[name])
    planned = layout.host_bytes(cuda=False, staging_buffers=2)
    assert planned == offloaded(policy(), POLICIES[name]).host_bytes()
    assert (planned["arena"] > 0) == any(unit.offloaded for unit in layout.units)
