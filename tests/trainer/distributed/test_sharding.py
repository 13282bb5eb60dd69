"""FSDP2 sharding per group: each group's local shards where param_offload and offload_policy place them, fp32
masters with optimizer_offload, and the whole weights held for a decode.

The two-rank checks run once, in one torch.distributed.run launch of sharding_ranks.py; each test below asserts on
what both ranks reported. The placement rules themselves are checked here without ranks.
"""

from __future__ import annotations

import pytest
from transformers import Qwen2Config, Qwen2ForCausalLM

from tests.trainer.distributed.test_ranks import rank_script_reports
from trainer.config import FSDPConfig
from trainer.distributed.sharding import describe_sharding, group_placements
from trainer.offload.groups import find_parts

RANKS = 2
TOLERANCE = 1e-6  # fp32: the sharded step sums the ranks' gradients in another order


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    """What each of the 2 ranks reported (sharding_ranks.py), one dict per rank."""
    return rank_script_reports("sharding_ranks.py", tmp_path_factory.mktemp("sharding"), ranks=RANKS)


def on_cpu(report: dict, case: str) -> set[str]:
    """The kinds of parameters ("embedding", "layers", "norm", "head") whose shards a case keeps on the CPU."""
    kinds = set()
    for name, offloaded in report[case]["offloaded"].items():
        kind = ("embedding" if "embed_tokens" in name else "layers" if ".layers." in name
                else "norm" if name.startswith("model.norm") else "head")
        if offloaded:
            kinds.add(kind)
    return kinds


def mixed(report: dict, case: str) -> set[str]:
    """The kinds some of whose parameters are on the CPU and others not (a group split across units)."""
    seen: dict[str, set[bool]] = {}
    for name, offloaded in report[case]["offloaded"].items():
        kind = "layers" if ".layers." in name else name
        seen.setdefault(kind, set()).add(offloaded)
    return {kind for kind, places in seen.items() if len(places) > 1}


@pytest.mark.parametrize(("case", "expected"), [
    ("untied/embedding_and_head", {"embedding", "head"}),
    ("untied/param_offload_norm_on_gpu", {"embedding", "layers", "head"}),
    ("tied/embedding_only", set()),  # one weight: on the GPU, as the head asks
    ("tied/embedding_and_head", {"embedding"}),  # the tied head is the embedding's weight (named once)
    ("critic/score", {"head"}),  # a value model's head is its score layer
    ("untied/optimizer_offload", set()),  # AdamW's states on the CPU, not the parameters (HostAdamW)
    ("untied/optimizer_and_param_offload", {"embedding", "layers", "norm", "head"}),
    ("untied/all_on_device", set()),
])
def test_each_group_keeps_its_local_shards_where_the_config_places_it(reports, case, expected):
    for report in reports:
        assert on_cpu(report, case) == expected
        assert mixed(report, case) == set()
    assert reports[0][case]["lines"] == reports[1][case]["lines"]


@pytest.mark.parametrize("case", ["untied/embedding_and_head", "untied/param_offload_norm_on_gpu",
                                  "tied/embedding_only", "tied/embedding_and_head", "untied/optimizer_offload",
                                  "untied/optimizer_and_param_offload"])
def test_a_step_of_two_ranks_with_groups_on_the_cpu_trains_as_one_process(reports, case):
    for report in reports:
        assert report[case]["difference"] < TOLERANCE
        assert report[case]["moved"] > 100 * TOLERANCE  # the comparison can fail


def test_the_start_of_the_run_names_the_groups_on_the_cpu_and_the_decoder_layers_left_on_the_device(reports):
    report = reports[0]
    assert report["untied/embedding_and_head"]["lines"] == [
        "actor: 2 ranks shard the model with FSDP2, a unit per decoder layer and per group; the embedding and head "
        "keep their local shards' parameters, gradients and optimizer states on the CPU through FSDP2's "
        "CPUOffloadPolicy (the project's own offload engine places whole models on one rank only)"]
    assert "(the head, tied to the embedding, shares its unit); every group's shards on the device" in \
        report["tied/embedding_only"]["lines"][0]
    assert [report[case]["layers_on_device"] for case in ("untied/embedding_and_head",
                                                          "untied/param_offload_norm_on_gpu")] == [2, 0]


def tiny_parts(tied: bool):
    config = Qwen2Config(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    return find_parts(Qwen2ForCausalLM(config))


@pytest.mark.parametrize(("settings", "tied", "expected"), [
    ({"param_offload": True}, False, {"embedding", "transformer", "norm", "lm_head"}),
    ({"param_offload": True, "offload_policy": {"lm_head": "gpu"}}, False, {"embedding", "transformer", "norm"}),
    ({"param_offload": True, "offload_policy": {"lm_head": "gpu"}}, True, {"transformer", "norm"}),
    ({"offload_policy": {"embedding": "cpu", "lm_head": "cpu"}}, True, {"embedding", "lm_head"}),
    ({"optimizer_offload": True, "offload_policy": {"embedding": "cpu"}}, False, {"embedding"}),
])
def test_group_placements_follow_the_one_rank_rules(settings, tied, expected):
    placements = group_placements(FSDPConfig.model_validate(settings), tiny_parts(tied))
    assert {group for group, cpu in placements.items() if cpu} == expected


def test_the_line_names_one_group_in_the_singular():
    parts = tiny_parts(False)
    line = describe_sharding("critic", 4, group_placements(
        FSDPConfig.model_validate({"offload_policy": {"norm": "cpu"}}), parts), parts)
    assert line.startswith("critic: 4 ranks shard the model with FSDP2, a unit per decoder layer and per group; "
                           "the norm keeps its local shards' parameters")


def test_a_bf16_model_with_optimizer_offload_keeps_fp32_masters_and_computes_in_bf16(reports):
    """One rank's offload engine keeps fp32 masters of a bf16 model with optimizer_offload; so do the shards."""
    for report in reports:
        case = report["bf16/optimizer_offload"]
        assert case["shard_dtypes"] == ["torch.float32"] and case["forward_dtype"] == "torch.bfloat16"
        # One rank's step, but for the odd tiny gradient whose sign another order of summation flips.
        assert case["equal"] > 0.99
        assert case["beyond_bf16"] > 0.5  # a bf16 update could give none of these: the check can fail
        assert "; fp32 masters of the bf16 weights, which the forward and backward gather in that dtype" in \
            case["lines"][0]
        # Only trained weights get masters: a frozen one (a LoRA adapter's base) stays bf16.
        dtypes = report["frozen_embedding_dtypes"]
        assert dtypes.pop("model.embed_tokens.weight") == "torch.bfloat16"
        assert set(dtypes.values()) == {"torch.float32"}


def test_a_decode_holds_the_whole_weights_once_instead_of_gathering_every_unit_at_every_token(reports):
    """sharding.whole_weights around a greedy generate of 6 tokens: the same tokens with one all-gather per unit
    that holds parameters, where FSDP2 alone gathers each of them at every token; where one rank lacks the memory,
    neither holds them (the decision is collective), and the model trains afterwards."""
    for report in reports:
        decode = report["decode"]
        held, gathered = decode["whole=True"], decode["whole=False"]
        assert held["held"] and not gathered["held"]
        assert held["tokens"] == gathered["tokens"]
        assert gathered["gathers"] == 6 * held["gathers"] and 0 < held["gathers"] < decode["units"]
        assert decode["one_rank_short"] == {"held": False, "gathers": gathered["gathers"]}
        assert decode["trains_after"]


def test_a_rank_holding_the_whole_weights_decodes_alone_with_fsdp2s_hooks_off_and_gets_them_back(reports):
    """sharding.plain_forwards inside whole_weights: rank 1 decodes 3 tokens while rank 0 decodes 6 (no forward
    waits for the other rank's), the same tokens as the hooked decode, no gather after the whole weights' own, grad
    mode off, and every unit's hooks back in their order afterwards (the model then trains: trains_after)."""
    for rank, report in enumerate(reports):
        decode = report["decode"]
        plain, held = decode["plain"], decode["whole=True"]
        assert plain["held"] and plain["plain"] and not plain["grad"]
        assert plain["hooks"] == 0 and plain["hooks_before"] == 2 * decode["units"] and plain["hooks_back"]
        assert plain["gathers"] == held["gathers"]
        assert plain["norm_fused"] and not plain["norm_sharded_candidate"]
        length = 6 if rank == 0 else 3
        assert [row[:4 + length] for row in held["tokens"]] == plain["tokens"]


def test_the_groups_are_found_again_once_fsdp2_swapped_the_blocks_classes():
    """fully_shard gives each sharded block a subclass (FSDPQwen2DecoderLayer); HostAdamW's copy records find the
    groups of the sharded model by the block class's name all the same."""
    from trainer.offload.groups import parameter_groups

    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1))
    for layer in model.model.layers:
        layer.__class__ = type(f"FSDP{type(layer).__name__}", (type(layer),), {})
    groups = parameter_groups(find_parts(model))
    assert {groups[id(parameter)] for parameter in model.model.layers.parameters()} == {"transformer"}
    assert groups[id(model.lm_head.weight)] == "lm_head" and groups[id(model.model.norm.weight)] == "norm"


@pytest.mark.parametrize("optimizer", ["adamw", "host"])
def test_a_rank_moving_its_layers_shards_alone_trains_as_one_that_never_moves_them(reports, optimizer):
    """Rank 0 moves layers between micro-batches (a gradient adding up) and between steps; rank 1 never does."""
    moved, still = (report["moves"][optimizer] for report in reports)
    for result in (moved, still):
        assert result["difference"] == 0.0 and result["same_objects"]
        assert result["moved"] > 1e-3  # the check can fail: the steps moved the weights
    # Each move flips the moved layers' shards' offload flags (layer 0's three samples, then layer 1's).
    assert moved["offloaded_after_each_move"] == [[False] * 3 + [True] * 3, [True] * 6, [False] * 6,
                                                  [False] * 3 + [True] * 3]
    assert moved["moves"] == {"to_cpu": 3, "to_gpu": 2} and moved["layers_on_gpu"] == 1
    assert still["offloaded_after_each_move"] == [] and still["layers_on_gpu"] == 2


def test_each_ranks_memory_manager_moves_its_own_layers_from_its_own_memory(reports):
    """Over the threshold on rank 0 only: rank 0's layers leave its device, rank 1's stay, and the step metrics
    say so per rank."""
    manager = [report["moves"]["manager"] for report in reports]
    assert manager[0]["layers_on_gpu"] == manager[0]["metric"] == 0 and manager[0]["moves_to_cpu"] == 2
    assert manager[1]["layers_on_gpu"] == manager[1]["metric"] == 2 and manager[1]["moves_to_cpu"] == 0
    assert all(rank["trains"] for rank in manager)


@pytest.mark.parametrize(("case", "expected"), [
    ("untied/embedding_and_head", {"embedding", "lm_head"}),
    ("untied/param_offload_norm_on_gpu", {"embedding", "transformer", "lm_head"}),
    ("tied/embedding_only", set()),
    ("tied/embedding_and_head", {"embedding"}),  # the tied weight, counted under the embedding
    ("untied/optimizer_offload", set()),
    ("untied/optimizer_and_param_offload", {"embedding", "transformer", "norm", "lm_head"}),
])
def test_fsdp2s_copies_of_the_shards_on_the_cpu_are_counted_per_group(reports, case, expected):
    """Every all-gather of a unit whose shards live on the CPU copies them up first: the per-rank offload report
    counts those copies by group (shard_copies.py), and none of the groups on the device."""
    for report in reports:
        copies = report[case]["copies"]
        assert set(copies) == expected
        for group, (count, nbytes) in copies.items():
            # A unit gathers for the forward and again for the backward; the root (a tied table) keeps its whole
            # weights from its forward to its backward, as FSDP2 keeps the root's.
            assert count >= (1 if case.startswith("tied/") else 2) and nbytes > 0, (group, count)
        # Their gradient shards' copies down after the backward's reduce-scatter: counted too (not timed), one per
        # offloaded parameter; with every unit on the CPU, all of this rank's gradient bytes.
        # Each rank copies up only its own shard, 1/world of the group's rows, at each gather: what
        # sequence_parallel_offload relies on (no rank carries the whole embedding's or head's copies).
        for group in ("embedding", "lm_head"):
            if group in copies and not case.startswith("tied/"):
                count, nbytes = copies[group]
                assert nbytes == count * report[case]["group_bytes"][group] // len(reports), (case, group)
        gradient_copies = report[case]["gradient_copies"]
        assert set(gradient_copies) == expected
        assert all(count >= 1 and nbytes > 0 for count, nbytes in gradient_copies.values())
        if case == "untied/optimizer_and_param_offload":
            assert sum(nbytes for _, nbytes in gradient_copies.values()) == report[case]["gradient_bytes"]
