"""The GPU benchmarks' scripts, as far as a machine without a GPU can run them: a wasted GPU call
costs minutes of a limited budget, so a script that would fail there should fail here first."""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks import (
    e2e_bench,
    fused_head_cpu,
    grpo_headline,
    offload_bench,
    peak_timeline,
    ranks_bench,
    telemetry_bench,
)


@pytest.mark.slow
def test_the_headline_step_runs_its_quick_shape_on_the_cpu_with_the_profile(tmp_path, capsys):
    out = tmp_path / "headline.json"
    # Four prompts of two responses (one micro-batch of 8), three safe points of the decode: every path, in seconds.
    assert grpo_headline.main(["--quick", "--device", "cpu", "--profile", "--steps", "2", "--prompts", "4", "--n", "2",
                               "--response-length", "24", "--out", str(out), "--scratch", str(tmp_path)]) == 0
    result = json.loads(out.read_text())
    assert result["steps"] == 2 and result["step_s"] > 0 and result["tokens_per_s"] > 0
    assert {"gen", "update_actor", "old_log_prob", "ref", "reward"} <= set(result["phases_s"])
    reported = result["profile"]["2"]
    assert reported["gen"]["rollout generate"] > 0
    assert reported["gen"]["decode ms per token, after the first safe point"] > 0
    assert reported["update_actor"]["actor optimizer.clip_grad_norm_"] > 0
    assert any(line.startswith("actor: Optimizer: OFFLOADED to CPU") for line in result["summary"])


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--cap-gib", "-1"]])
def test_the_headline_refuses_bad_arguments_in_one_line(argv, capsys):
    assert grpo_headline.main([*argv, "--device", "cpu", "--quick"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("ERROR: --") and "\n" not in error


def test_the_fused_head_benchmark_measures_a_lower_peak_fused_on_the_cpu(tmp_path, capsys):
    out = tmp_path / "fused.json"
    assert fused_head_cpu.main(["--vocabularies", "4096", "--tokens", "128", "--repeats", "1", "--out", str(out)]) == 0
    unfused, fused = json.loads(out.read_text())["rows"]
    assert (unfused["fused"], fused["fused"]) == (False, True) and fused["seconds"] > 0
    # The unfused pass holds the 4.1 MiB logits and their gradient; the fused one a tile at a time.
    assert fused["peak_mib"] < unfused["peak_mib"] - 4, (fused, unfused)
    assert "4096    fused" in capsys.readouterr().out


def test_the_offload_benchmark_names_an_unknown_section(capsys):
    assert offload_bench.main(["--only", "allgpu,nonsense"]) == 2
    assert "unknown sections ['nonsense']" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error a machine without a GPU gives")
def test_the_peak_timeline_says_it_needs_a_gpu_in_one_line(tmp_path, capsys):
    assert peak_timeline.main(["--quick", "--out", str(tmp_path / "peaks.json")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("ERROR: ") and "CUDA" in error and "\n" not in error


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible to torch)")
def test_the_peak_timeline_finds_the_held_gradients_of_a_second_micro_batch(tmp_path):
    out = tmp_path / "peaks.json"
    assert peak_timeline.main(["--quick", "--out", str(out)]) == 0
    variants = {variant["name"]: variant for variant in json.loads(out.read_text())["variants"]}
    assert set(variants) == set(peak_timeline.VARIANTS)
    resident = variants["all-GPU"]["passes"]
    layered = variants["layered, head streamed"]["passes"]
    # The second micro-batch holds the first one's gradients; the layered run keeps its head's and
    # embedding's on the host.
    assert resident["second micro-batch"]["peak_gib"] > resident["first micro-batch"]["peak_gib"]
    assert layered["second micro-batch"]["peak_gib"] < resident["second micro-batch"]["peak_gib"]


RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def test_the_floor_both_ways_counts_each_phase_and_direction():
    gpu_forward, gpu = {"ms": 100.0}, {"ms": 300.0}
    forward = {"h2d_gb": 11.0}
    # Forward bound by its 11 GB copy (200 ms at 55 GB/s); backward by its 22 GB of gradients
    # (400 ms at 55 GB/s), not by its 5.5 GB of weights (100 ms) nor the 200 ms of compute.
    row = {"h2d_gb": 16.5, "d2h_gb": 22.0}
    assert offload_bench.both_ways_floor_ms(row, forward, gpu_forward, gpu, 55.0, 55.0) == pytest.approx(600.0)
    assert offload_bench.both_ways_floor_ms(row, None, gpu_forward, gpu, 55.0, 55.0) is None


def test_the_report_of_a_saved_h200_run_prints_both_floors(capsys):
    assert offload_bench.main(["--report", str(RESULTS / "offload-h200-2026-11-30T1311.json")]) == 0
    table = capsys.readouterr().out
    streamed = next(line for line in table.splitlines() if line.startswith("ours full streaming")
                    and "forward+backward" in line)
    # /floor then /both: 555.6 ms against 455 ms (H2D only) and 512 ms (gradients going back counted).
    assert streamed.split()[-2:] == ["1.22", "1.09"]


def test_the_report_refuses_a_file_that_is_not_a_result(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert offload_bench.main(["--report", str(bad)]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("ERROR: --report") and "\n" not in error


def test_the_report_names_a_missing_file(tmp_path, capsys):
    assert offload_bench.main(["--report", str(tmp_path / "missing.json")]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("ERROR: --report") and "cannot read it (No such file or directory)" in error


@pytest.mark.slow
def test_the_telemetry_overhead_alternates_its_blocks_on_a_real_daemon(tmp_path, capsys):
    out = tmp_path / "overhead.json"
    assert telemetry_bench.main(["overhead", "--shape", "tiny", "--device", "cpu", "--block-steps", "1",
                                 "--cycles", "1", "--warmup-steps", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {mode: figures["steps"] for mode, figures in result["modes"].items()} == {
        "on": 2, "off": 2, "trainer": 2, "daemon": 2}
    # The trainer's client sends only in its blocks: what it spends there is measured, elsewhere nothing.
    assert result["modes"]["on"]["send_s"] > 0 and result["modes"]["trainer"]["send_s"] > 0
    assert result["modes"]["off"]["send_s"] == 0 and result["modes"]["daemon"]["send_s"] == 0
    assert set(result["cost"]) == {"on", "trainer", "daemon"} and result["dropped_messages"] == 0
    assert "cost of on       vs off:" in capsys.readouterr().out
    assert telemetry_bench.main(["--report", str(out)]) == 0


@pytest.mark.slow
def test_the_telemetry_api_load_times_every_request_of_a_real_run(tmp_path, capsys):
    out = tmp_path / "api.json"
    assert telemetry_bench.main(["api", "--window-s", "3", "--cycles", "1", "--rate", "40", "--clients", "4",
                                 "--warmup-steps", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["errors"] == [] and result["ws_clients_ok"] == 4 and result["ws_messages"] > 0
    assert {path: figures["requests"] for path, figures in result["endpoints"].items()} == {
        "/metrics": 60, "/v1/status": 60}
    assert 0 < result["endpoints"]["/metrics"]["p50_ms"] <= result["endpoints"]["/metrics"]["p99_ms"]
    assert "/v1/status" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["api", "--rate", "0"], ["overhead", "--shape", "huge"], []])
def test_the_telemetry_benchmark_refuses_bad_arguments_in_one_line(argv, capsys):
    assert telemetry_bench.main(argv) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("ERROR: ") and "\n" not in error



@pytest.mark.slow
def test_the_whole_step_benchmark_runs_its_quick_shape_on_the_cpu_and_compares_the_variants(tmp_path, capsys):
    """The default variants (all_gpu, offload, and fsdp2, which needs a GPU and is dropped here), the delayed
    update's and LoRA's, in one call: each variant is a run of its own, and one call builds the models once."""
    out = tmp_path / "e2e.json"
    assert e2e_bench.main(["--shape", "quick", "--device", "cpu", "--steps", "2", "--warmup", "1", "--out", str(out),
                           "--scratch", str(tmp_path), "--profile",
                           "--variants", "all_gpu,offload,fsdp2,offload_delayed,offload_lora"]) == 0
    result = json.loads(out.read_text())
    assert set(result["variants"]) == {"all_gpu", "offload", "offload_delayed", "offload_lora"}  # fsdp2: a GPU
    delayed, lora = result["variants"]["offload_delayed"], result["variants"]["offload_lora"]
    assert delayed["steps"] == 2 and delayed["copied_bytes_per_step"]["h2d"] > 0
    assert lora["steps"] == 2 and {"update_actor", "update_critic", "ref"} <= set(lora["phases_s"])
    assert result["models_s"] > 0 and not list(tmp_path.glob("e2e_models_*"))  # made once, then removed
    offloaded, resident = result["variants"]["offload"], result["variants"]["all_gpu"]
    assert {"step", "gen", "update_actor", "update_critic", "ref", "reward"} <= set(offloaded["phases_s"])
    assert offloaded["copied_bytes_per_step"]["h2d"] > 0 and resident["copied_bytes_per_step"]["h2d"] == 0
    printed = capsys.readouterr().out
    assert "update_actor" in printed and "x)" in printed and "layer moves a step" in printed
    assert len(offloaded["per_step"]) == 2 and "placement plan" not in printed  # a CPU run plans no layers
    assert offloaded["update_split"] == {}  # a CPU run updates on the host alone: no split, no floor line
    # The CPU update of the actor runs on the engine's worker, timed in the phase it ran in.
    assert any("actor worker _update_unit" in table for phases in offloaded["profile"].values()
               for table in phases.values()) and "offload profile of step 2" in printed
    assert e2e_bench.main(["--report", str(out)]) == 0
    assert "(the first 1 not counted)" in capsys.readouterr().out
    # Counted again from each step's metrics, with no warm-up: the means of both steps.
    assert e2e_bench.main(["--report", str(out), "--warmup", "0"]) == 0
    assert "(the first 0 not counted)" in capsys.readouterr().out
    assert e2e_bench.with_warmup(result, 0)["variants"]["offload"]["phases_s"]["step"] == pytest.approx(
        sum(row["timing_s/step"] for row in offloaded["per_step"]) / 2)


def test_the_whole_step_table_says_the_exact_update_floor_of_a_split_update():
    """7.6 G elements at 0.373 (device) and 0.967 (host) ns an element, split ideally: 2.046 s; beside a 2.473 s
    all-GPU step the floor is 4.519 s (1.83x), and a 5.117 s step is 1.13x it (the H200's figures of 2026-12-04)."""
    estimate = {"seconds_per_element": {"device": 0.373e-9, "host": 0.967e-9}, "elements": 7.6e9}
    update, floor = e2e_bench.exact_update_floor(2.473, estimate)
    assert update == pytest.approx(2.046, abs=1e-3) and floor == pytest.approx(4.519, abs=1e-3)
    run = {"phases_s": {"step": 5.117}, "copied_bytes_per_step": {"h2d": 0, "d2h": 0},
           "bandwidth_gbps": {"h2d": 55.0, "d2h": 55.0}, "layer_moves_per_step": 0, "peak_gpu_gib": 36.2,
           "oom_recoveries": 0, "update_split": {"actor": estimate}}
    resident = {**run, "phases_s": {"step": 2.473}, "update_split": {}}
    printed = e2e_bench.table({"shape": "headline", "spec": {}, "steps": 4, "variants": {"all_gpu": resident,
                                                                                        "offload": run}})
    assert "offload: exact-update floor 4.519 s (1.83x all-GPU)" in printed and "is 1.13x that floor" in printed


def test_the_whole_step_benchmark_refuses_an_unknown_variant_in_one_line(capsys):
    assert e2e_bench.main(["--variants", "all_gpu,nonsense", "--device", "cpu"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("ERROR: --variants: unknown nonsense") and "\n" not in error


def test_the_whole_step_benchmarks_delayed_update_variants_set_their_keys(tmp_path):
    assert "actor_rollout_ref.actor.fsdp_config.delayed_update=true" in e2e_bench.overrides(
        "quick", "offload_delayed", "cpu", tmp_path, tmp_path / "models", 2)
    # The delayed update on the host's cores alone (auto splits it between the GPU and the host's cores).
    assert {"actor_rollout_ref.actor.fsdp_config.delayed_update=true",
            "actor_rollout_ref.actor.fsdp_config.optimizer_update=cpu"} <= set(e2e_bench.overrides(
                "quick", "offload_delayed_host", "cuda", tmp_path, tmp_path / "models", 2))
    # `_balanced`: the same run, its update split without the window (set in the variant's own process).
    assert e2e_bench.overrides("quick", "offload_delayed_balanced", "cuda", tmp_path, tmp_path / "models", 2) == \
        e2e_bench.overrides("quick", "offload_delayed", "cuda", tmp_path, tmp_path / "models", 2)


def test_the_whole_step_benchmarks_lora_variant_sets_its_keys(tmp_path):
    rows = e2e_bench.overrides("quick", "offload_lora", "cpu", tmp_path, tmp_path / "models", 2)
    assert {"actor_rollout_ref.model.lora_rank=64", "critic.model.lora_rank=64",
            "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"} <= set(rows)


@pytest.mark.slow
def test_the_whole_step_benchmark_decodes_with_the_static_cache_when_asked(tmp_path):
    out = tmp_path / "e2e.json"
    assert e2e_bench.main(["--shape", "quick", "--device", "cpu", "--steps", "2", "--warmup", "1", "--variants",
                           "offload", "--decode", "static", "--out", str(out), "--scratch", str(tmp_path)]) == 0
    result = json.loads(out.read_text())
    assert result["decode"] == "static" and result["variants"]["offload"]["steps"] == 2
    assert "actor_rollout_ref.rollout.decode=static" in e2e_bench.overrides(
        "quick", "offload", "cpu", tmp_path, tmp_path / "models", 2, "static")


def test_the_remove_padding_sections_passes_run_on_the_cpu_with_gradient_checkpointing():
    """offload_bench's remove_padding section (GPU only) times these passes: each runs here on a tiny model."""
    from tests.trainer.offload.test_offload import TOKENIZER, policy

    plan = offload_bench.PaddingPlan(sequences=4, prompt=6, response=8, log_prob_micro=2, update_micro=2,
                                     log_prob_budget=20, update_budget=14)
    model = policy()
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    batch = offload_bench.ragged_rollout(plan, len(TOKENIZER), "cpu")
    assert batch.prompt_mask.sum(1).tolist() == [3, 4, 5, 6] and batch.response_mask.sum(1).tolist() == [8, 5, 3, 1]
    passes = offload_bench.padding_passes(model, plan, batch)
    assert [name for name, _ in passes] == [f"{kind}, {variant}" for kind in ("log-probs", "training step")
                                            for variant in ("padded", "padding-free", "padding-free, token budget")]
    for _, run in passes:
        run()


@pytest.mark.slow
def test_the_ranks_benchmark_runs_its_quick_shape_on_two_cpu_ranks_and_compares_the_placements(tmp_path, capsys):
    out = tmp_path / "ranks.json"
    assert ranks_bench.main(["--shape", "quick", "--device", "cpu", "--ranks", "2", "--steps", "2", "--warmup", "1",
                             "--variants", "all_gpu,optimizer_offload_delayed", "--scratch", str(tmp_path),
                             "--set", "trainer.cpu_threads=1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["set"] == ["trainer.cpu_threads=1"]
    for name, run in result["variants"].items():
        assert run["steps"] == 2 and run["phases_s"]["step"] > 0 and run["skipped_updates"] == 0, name
        assert {"gen", "update_actor", "update_critic", "ref", "reward"} <= set(run["phases_s"]), name
    placement = result["variants"]["optimizer_offload_delayed"]["placement"]
    assert any("AdamW's states and arithmetic on the CPU" in line and "fp32 masters" in line for line in placement)
    printed = capsys.readouterr().out
    assert "cpu x 2 ranks, shape quick" in printed and "update_actor" in printed and "(1.00x)" in printed
    assert "; trainer.cpu_threads=1" in printed


def test_the_ranks_benchmarks_update_on_the_gpu_is_the_actors_and_the_critics(tmp_path):
    rows = set(ranks_bench.variant_overrides("ppo3b", "optimizer_offload_gpu", 2, "cuda", tmp_path, tmp_path, 2))
    assert {f"{role}.fsdp_config.{key}" for role in ("actor_rollout_ref.actor", "critic")
            for key in ("optimizer_offload=true", "optimizer_update=gpu")} <= rows


@pytest.mark.slow
def test_the_ranks_benchmark_at_one_rank_runs_each_variant_plain_and_as_a_group_of_one_with_the_same_losses(
        tmp_path, capsys):
    out = tmp_path / "ranks.json"
    assert ranks_bench.main(["--shape", "quick", "--device", "cpu", "--ranks", "1", "--steps", "2", "--warmup", "1",
                             "--variants", "optimizer_offload", "--scratch", str(tmp_path),
                             "--set", "trainer.cpu_threads=1", "--out", str(out)]) == 0
    variants = json.loads(out.read_text())["variants"]
    assert list(variants) == ["optimizer_offload", "optimizer_offload+torchrun"]
    plain, launched = variants.values()
    assert plain["steps"] == launched["steps"] == 2
    # One process and a group of one are the same run: on the CPU, to the bit.
    assert launched["loss_steps"] == plain["loss_steps"]
    assert all(set(step) == {"actor/pg_loss", "critic/vf_loss"} for step in plain["loss_steps"])
    printed = capsys.readouterr().out
    assert "world size 1, optimizer_offload: step" in printed and "differ by at most 0.00e+00" in printed


def test_the_ranks_benchmarks_repeats_go_a_b_b_a_and_its_line_gives_each_sides_spread():
    # A B B A: the second pass runs the first's in reverse order, so the order's drift cancels in a mean.
    assert [name for name, _, _ in ranks_bench.run_order(["all_gpu", "offload"], 1, 2)] == [
        "all_gpu", "all_gpu+torchrun", "offload", "offload+torchrun",
        "offload+torchrun#2", "offload#2", "all_gpu+torchrun#2", "all_gpu#2"]
    assert ranks_bench.run_order(["all_gpu"], 2, 1) == [("all_gpu", "all_gpu", True)]

    def run(step, loss):
        return {"phases_s": {"step": step}, "loss_steps": [{"actor/pg_loss": loss}]}

    [line] = ranks_bench.world_size_one({"all_gpu": run(1.0, 0.5), "all_gpu+torchrun": run(1.2, 0.5),
                                         "all_gpu+torchrun#2": run(1.4, 0.25), "all_gpu#2": run(1.0, 0.5)})
    assert line == ("world size 1, all_gpu: step 1.300 s under the launcher against 1.000 s plain (1.300x) "
                    "(1.200-1.400 s over 2 runs) (1.000-1.000 s over 2 runs); losses of 1 steps differ by at most "
                    "2.50e-01")


def test_the_ranks_benchmark_counts_the_steps_of_a_run_whose_final_checkpoint_found_no_disk(tmp_path, monkeypatch):
    runs = tmp_path / "runs"

    def finished_without_room(command, *, stdout, **_):  # every step's metrics, then the final save's error
        (runs / "quick").mkdir(parents=True, exist_ok=True)
        (runs / "quick" / "metrics.jsonl").write_text("".join(
            json.dumps({"timing_s/step": 1.0 + step, "actor/pg_loss": 0.5, "actor/skipped_steps": 0}) + "\n"
            for step in range(3)))
        stdout.write("ERROR: the final checkpoint of step 3 was not saved: not enough disk space\n")
        return subprocess.CompletedProcess(command, 2)

    monkeypatch.setattr(ranks_bench.subprocess, "run", finished_without_room)
    args = ranks_bench.argparse.Namespace(shape="quick", ranks=1, device="cpu", steps=3, warmup=1, set=[],
                                          timeout=10.0)
    run = ranks_bench.run_variant(args, "all_gpu", tmp_path, tmp_path, tmp_path / "log", launched=False)
    assert run["steps"] == 3 and run["phases_s"]["step"] == pytest.approx(2.5)
    assert run["final_checkpoint"].startswith("the final checkpoint of step 3 was not saved")
    # Fewer steps than asked is a failure whatever the error.
    args.steps = 4
    assert "error" in ranks_bench.run_variant(args, "all_gpu", tmp_path, tmp_path, tmp_path / "log2", launched=False)


@pytest.mark.parametrize("argv", [["--variants", "all_gpu,nonsense"], ["--ranks", "0"], ["--steps", "2"]])
def test_the_ranks_benchmark_refuses_bad_arguments_in_one_line(argv, capsys):
    assert ranks_bench.main([*argv, "--device", "cpu"]) == 2
    error = capsys.readouterr().err.strip()
    assert error.startswith("ERROR: --") and "\n" not in error


def test_the_ranks_benchmark_keeps_the_callers_python_path_behind_the_repository_and_drops_enclosing_rank_variables():
    # A device image's wheels come through PYTHONPATH: a rank group that lost it could not import the trainer.
    environment = ranks_bench.rank_group_environment({"PYTHONPATH": "/tmp/site", "RANK": "3", "HOME": "/root"})
    assert environment["PYTHONPATH"].split(os.pathsep) == [str(ranks_bench.REPOSITORY), "/tmp/site"]
    assert "RANK" not in environment and environment["HOME"] == "/root"
    assert ranks_bench.rank_group_environment({})["PYTHONPATH"] == str(ranks_bench.REPOSITORY)
