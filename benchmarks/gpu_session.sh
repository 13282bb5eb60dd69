#!/usr/bin/env bash
# What a GPU machine checks, stage by stage (each fits one 10-minute device call), results under
# $OUT (the device tool's output folder) or ./gpu-results:
#
#   benchmarks/gpu_session.sh tests        # every test marked gpu                      (~1 min)
#   benchmarks/gpu_session.sh rollout      # rollout_bench.py, all sections              (~6 min; SECTIONS=a,b picks some:
#                                          # allgpu,allgpu_static,allgpu_static_graphs,allgpu_static_graphs_unfused,
#                                          # allgpu_static_graphs_unfused_rotary (neither the rotary nor the MLP compiled),
#                                          # ours_phase,ours_phase_static; BATCH=128 decodes 128 sequences at once
#                                          # compares the decode paths; SECTIONS=static_profile: where a decode step's device time goes)
#   benchmarks/gpu_session.sh offload      # offload_bench.py: bandwidth, all-GPU, layered (~2 min)
#   benchmarks/gpu_session.sh host         # offload_bench.py --only host: both copy directions, host memory and the
#                                          # host's AdamW, alone and beside each other (what bounds an update; ~1 min)
#   benchmarks/gpu_session.sh headline     # grpo_headline.py under a 40 GiB cap          (~4 min)
#   benchmarks/gpu_session.sh uncapped     # grpo_headline.py without the cap             (~4 min)
#   benchmarks/gpu_session.sh telemetry    # telemetry_bench.py overhead, small and tiny  (~4 min)
#   benchmarks/gpu_session.sh e2e-headline # e2e_bench.py: 7B GRPO whole steps, all-GPU vs offloaded at 40 GiB
#   benchmarks/gpu_session.sh e2e-ppo3b    # e2e_bench.py: 3B PPO + critic, all-GPU vs offloaded at 12 GiB vs FSDP2
#   benchmarks/gpu_session.sh issue40      # 2026-12-07's second session, one call (~8 min): rollout_bench.py's `uneven`
#                                          # (512 rows of long-tailed lengths, 256 at once: useful_speedup of refilled
#                                          # slots against a static batch, and a batch-256 decode step against its HBM
#                                          # floor; ~2 min) and e2e-gsm8k7b's all_gpu, offload, offload_delayed at
#                                          # STEPS=2 WARMUP=1 (TIMEOUT=100 each; at most 580 s in all). all_gpu at 7B holds fp32 master weights
#                                          # and AdamW states (~120 GB): it fits an H200 only (run it with needs_h200)
#   benchmarks/gpu_session.sh live-keys    # the static decode's attention over the live keys only (h40c): its GPU tests,
#                                          # the batch-256 step against the whole cache's and the HBM floor (~4 min)
#   benchmarks/gpu_session.sh e2e-gsm8k7b  # e2e_bench.py: 7B GRPO + reference, 64 prompts x 8, 1024 long-tailed tokens, 40 GiB cap
#   benchmarks/gpu_session.sh e2e-long3b   # e2e_bench.py: 3B PPO + critic, 4096-token responses, 12 GiB cap (not timed yet:
#                                          # a rollout of 4096 steps alone is about 30 s; give it a call of its own)
#   benchmarks/gpu_session.sh e2e-lora14b  # e2e_bench.py: Qwen2.5-14B's shape with LoRA at a 40 GiB cap (not timed yet;
#                                          # all_gpu needs about 35 GB of bf16 weights and adapters: an 80 GB card holds it)
#   benchmarks/gpu_session.sh ranks        # ranks_bench.py on every GPU of the machine (kind nvidia-h200-x2 or more):
#                                          # all-GPU vs optimizer_offload (HostAdamW) vs optimizer_offload_delayed (its
#                                          # update during the next rollout) vs optimizer_offload_gpu (its update on
#                                          # the GPU over moments streamed up) vs optimizer_offload_both (split) vs
#                                          # embedding/head on the CPU vs
#                                          # FSDP2 CPUOffloadPolicy for every unit; SHAPE (ppo3b), VARIANTS, STEPS, WARMUP, SET, TAG,
#                                          # REPEAT (passes, every other one reversed), RANKS (the GPUs)
#                                          # (ppo3b, three variants, STEPS=4: 437 s with the machine's start; all
#                                          # four do not fit one call: all_gpu 88 s, optimizer_offload 135 s, fsdp2 126 s)
#                                          # On one GPU (or RANKS=1) it is the world-size-1 check: each variant as
#                                          # today's one process and as a rank group of one under torchrun, side by
#                                          # side (step seconds and losses): VARIANTS=all_gpu STEPS=6 REPEAT=2 (A B B
#                                          # A: 4 runs of about 110 s at ppo3b, the final checkpoint in them)
#
# e2e stages read VARIANTS (all_gpu,offload[,fsdp2][,offload_delayed][,offload_delayed_host][,offload_host_update][,offload_both_update]
# [,offload_lora][,offload_balanced][,offload_delayed_balanced]: `_balanced` is the variant with the update split's window off), STEPS (4), WARMUP (2: steps not counted), TIMEOUT (seconds a
# variant may take; e2e_bench's default 900), SET (config overrides for every variant, KEY=VALUE separated by spaces), TAG (a suffix of
# the result's file names, to keep several runs of a call apart), PROFILE (set: --profile) and DECODE (auto, generate or static: rollout.decode; auto, the default, is static with CUDA graphs on a GPU).
# The shape's models are drawn once on the GPU (20 s for ppo3b) and each variant loads them (10 s). One 10-minute call fits about (measured 2026-12-02):
#   VARIANTS=all_gpu,offload,fsdp2 STEPS=6 PROFILE=1 TIMEOUT=200 e2e-ppo3b   (~4 min with generate; fsdp2 OOMs at 12 GiB)
#   VARIANTS=all_gpu,offload STEPS=6 PROFILE=1 TIMEOUT=200 e2e-ppo3b         (165 s with the default decode, 2026-12-02)
#   VARIANTS=all_gpu,offload_delayed STEPS=6 PROFILE=1 e2e-ppo3b             (165 s)
#   VARIANTS=offload,offload_host_update,offload_both_update STEPS=6 e2e-ppo3b  (the update's three paths side by
#                                                                             side: update_actor and the step; not timed yet)
#   VARIANTS=all_gpu,offload STEPS=5 TIMEOUT=400 e2e-headline                (not timed yet with models from disk:
#                                                                             all_gpu 5.1 s a step, offload 15-25 s)
# The device tool's budget is 30 minutes a session and each call starts a fresh machine (about 85 s): chain stages
# in one call (`tests` is 100 s; `SECTIONS=static_profile rollout` 15 s). A refused start (no machine free) costs about
# 90 s of the budget, and so does every helper's call: one session holds the device calls.
#
# Run 2026-12-02 19:00-21:00 (results in benchmarks/results/*2026-12-02T19*/T20*, tables in benchmarks/README.md):
# `tests` (43 passed), the update's paths (both within noise of gpu), LoRA against full fine-tuning at 7B,
# remove_padding, the packed decode attention, the 7B shape all-GPU against offloaded. Measured call times:
#   `tests` 75 s; `--only remove_padding` 60 s; SECTIONS=allgpu_static_graphs,allgpu_static_graphs_repeat_kv 30 s;
#   VARIANTS=all_gpu,offload,offload_both_update STEPS=4 TIMEOUT=150 e2e-ppo3b 180 s (with 4 variants and
#   STEPS=5, 300 s was not enough for the JSON); VARIANTS=all_gpu,offload STEPS=3 WARMUP=1 e2e-headline 150 s.
# PROFILE=1 VARIANTS=offload STEPS=2 WARMUP=1 TIMEOUT=170 e2e-headline: 146 s (gen waits 2.4 s for the actor's
# update, then decodes at 51 ms a token with layers streamed). Next, in priority order: torch.compile of the
# decode step (issue 15), then any change to the 7B rollout's wait or streaming, measured with that same command.
# Run 2026-12-03 17:10-17:42 (results in benchmarks/results/*2026-12-03T17*, tables in benchmarks/README.md): the
# ring-aware planner (7B headline 9.06 -> 7.01 s), turns on the bus (3B PPO 4.85 -> 4.20 s), fused RMSNorm in the
# decode (7B, batch 32: 7.2 ms a token against 8.3; batch 128: 8.2 against 9.9), optimizer_update both (7B 6.69 s
# against 7.25; 3B slower). Measured call times: VARIANTS=all_gpu,offload STEPS=4 WARMUP=2 e2e-headline plus
# VARIANTS=all_gpu,offload STEPS=4 WARMUP=2 PROFILE=1 e2e-ppo3b 320 s; `tests` 92 s; three e2e-headline variants
# and two e2e-ppo3b variants 446 s; BATCH=128 SECTIONS=allgpu_static_graphs,allgpu_static_graphs_unfused rollout 20 s.
# One start was refused (no machine could be started): it cost about 2 minutes. Every call must install the wheels
# first (a call without them fails at `import hydra`).
# Run 2026-12-04 00:33-01:04 (results in benchmarks/results/*2026-12-04T00*/T01*, tables in benchmarks/README.md): the
# planner counting kept groups once (7B 6.48 s, 2.39x; 3B 4.22 s, 2.64x), the 7B update profiled, micro-batches of
# 16 and 32 (`SET=actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=32 TAG=-micro32 ... e2e-headline`: update_actor
# 2.36 -> 1.07 s), the 12 GiB capped decode (110.8 ms a token, 1.01x its PCIe floor), then merged micro-batches by
# default (7B 6.27 s, 2.05x, update_actor 1.30x; 3B 4.90 s, 2.40x, update_actor 1.51x). Measured call times: `tests`
# plus two e2e stages of two variants 377 s; a profiled offload-only e2e-headline plus `SECTIONS=capped rollout`
# 230 s; two offload-only e2e-headline runs 291 s; three GPU test files plus two e2e stages 518 s. One machine's
# host link ran at 44 GB/s up (55 on the others): compare ratios within a call only. The 30 minutes ran out there.
# At most 8 files come back from a call: `tests` with two e2e stages of two variants makes 9 (gpu_tests.txt was left).
# 2026-12-04 03:54-06:54: no device time was left to that session (70 s): nothing measured.
# Run 2026-12-04 06:32-07:06 (results in benchmarks/results/*2026-12-04T06*/T07*, tables in benchmarks/README.md):
# `tests` (45 passed, HostAdamW's GPU test among them), the split against the device path at 7B, `host` (both copy
# directions, host memory, host AdamW, alone and beside each other), a profiled split at 7B, the 3B regression (the
# planner's, fixed), then auto = both at both shapes (3B 3.92 s, 1.81x; 7B 5.12 s, 2.07x). Measured call times:
# `tests` plus three e2e-headline variants 357 s; `host` plus one profiled e2e-headline variant plus three e2e-ppo3b
# variants 480 s; `tests` plus three e2e-ppo3b variants plus two profiled e2e-headline variants 517 s. More than 8
# files come back only as one archive: set OUT=/tmp/o, run the stages, `tar -czf $REAL_OUT/r.tgz -C /tmp/o .` after each.
# 07:16-07:18: test_layer_moves.py's GPU test (dynamic offload of a sharded model's layers, one NCCL rank) failed on
# torch 2.11's FSDP2 (one parameter group a unit, `_fsdp_param_group`); fixed at 07:18, not run again (the budget's
# last seconds went to a machine taken back mid-call).
# Run 2026-12-04 09:16-09:56 (results in benchmarks/results/*2026-12-04T09*, tables in benchmarks/README.md): the
# delayed update decoded eager (46-54 ms a token at 3B: no graph key under stale reads; fixed), the clipping norm's
# squares on the device (7B offloaded 4.58 s, 1.06x its exact-update floor; update_actor 0.72 s against 0.98
# all-GPU), the delayed update with graphs (3B 1.45x, 7B 1.61x). test_layer_moves.py's GPU test failed three times,
# each further (DTensor.from_local moved CPU shards to the GPU; an NCCL-only group; a CPU/CUDA comparison in the
# test), all fixed, not seen passing: the budget ran out. Measured call times: `tests` plus three e2e-ppo3b
# variants plus two e2e-headline variants (profiled) 445 s; three GPU test files plus three e2e-ppo3b variants plus
# one more plus two e2e-headline variants 551 s; `tests` plus three e2e-ppo3b plus two e2e-headline (STEPS=3) 466 s.
# Keep the whole pytest output of a failing rank test (tail -15 of it lost the traceback once).
# Next, in priority order: `python3 -m pytest -m gpu tests/trainer/distributed/test_layer_moves.py` (30 s; issue
# 16); on an nvidia-h200-x2 machine when one is lent, `ranks` (issue 16's anchor; add dynamic offload to it); the
# split update under delayed_update (7B delayed: old_log_prob waits 2.1 s for a host-only update; `auto` picks the
# host alone there on a guess never measured), measured with `VARIANTS=all_gpu,offload_delayed_host,offload_delayed
# STEPS=4 WARMUP=2 PROFILE=1 e2e-headline` and the same at e2e-ppo3b; if it wins, `auto` = both under it; the 3B update phase's
# critic update beside the actor's backward; RoPE fused in the decode.
# Run 2026-12-04 11:22-11:58 on nvidia-h200-x2 (results in benchmarks/results/ranks-ppo3b-h200x2-2026-12-04T11*,
# tables in benchmarks/README.md under ranks_bench.py): tests/trainer/distributed's GPU tests passed (test_layer_moves
# at last); `ranks` failed at once (ranks_bench replaced PYTHONPATH: no wheels; fixed), then measured 2 ranks at 5x
# one GPU (gen synced at 64 ms a token; the host AdamW on one core: both fixed), then all_gpu 2.06 s, optimizer_offload
# 4.54 s, FSDP2 CPUOffloadPolicy about 17 s. One call (128 s) was lost to a machine taken back. No budget was left for
# the single-GPU stages below.
# Next, in priority order: `VARIANTS=all_gpu,offload_delayed_host,offload_delayed STEPS=4 WARMUP=2 PROFILE=1
# e2e-headline` and the same at e2e-ppo3b (the split update under delayed_update; if it wins, auto = both there);
# on an nvidia-h200-x2 machine `VARIANTS=all_gpu,optimizer_offload,optimizer_offload_delayed ranks` (the delayed update
# on ranks and HostAdamW's host arithmetic in one fused pass, both built 2026-12-04 after the budget ran out: never run
# on a GPU; optimizer_offload's update_actor was 1.70 s against all_gpu's 0.50 s before them), `VARIANTS=embedding_head_cpu ranks` and `SHAPE=headline VARIANTS=all_gpu,optimizer_offload
# ranks`; the 3B update phase's critic update beside the actor's backward; RoPE fused in the decode.
# Run 2026-12-04 13:36-14:16 on one H200 (x2 was not lent; results in benchmarks/results/*2026-12-04T13*/T14*, tables
# in benchmarks/README.md): `tests` (47 passed, test_decode_graphs.py's one NCCL rank among them), the delayed update's
# paths (both beat the host alone at both shapes: auto = both under it now), then the publish on a thread of its
# own (7B delayed 3.97 -> 3.64 s). One call hung (580 s lost, nothing came back): the publisher waited on an event
# a read had taken off the unit (fixed, a CPU test holds it; test_offload_gpu.py's delayed tests passed after).
# Measured call times: `tests` plus three e2e-ppo3b variants 311 s; three e2e-headline variants 258 s (warm); four
# GPU tests (25 s) plus two e2e-headline plus two e2e-ppo3b variants 323 s. Wrap a test stage in `timeout` with
# `-o faulthandler_timeout=80`: a hang then costs 100 s and names its stack, not the whole call.
# Next, in priority order: `python3 -m pytest -m gpu tests/trainer/distributed/test_host_adamw.py` (bf16 gradients,
# the update on the GPU and the split, all built after the budget ran out: never run on a GPU); on an
# nvidia-h200-x2 machine `VARIANTS=all_gpu,optimizer_offload,optimizer_offload_delayed ranks`, then
# `VARIANTS=all_gpu,optimizer_offload_gpu,optimizer_offload_both ranks` (never run: the delayed update on ranks,
# HostAdamW's fused host arithmetic, the critic's host update beside the actor's, the update on the GPU over
# streamed moments or split; whichever wins becomes auto on ranks), `VARIANTS=embedding_head_cpu ranks`,
# `SHAPE=headline VARIANTS=all_gpu,optimizer_offload ranks`; on one H200, the 7B delayed old_log_prob (1.0 s against
# 0.14: the wait for the publisher, 0.37 s, and the kept layers' copy again, 0.28 s) with `PROFILE=1
# VARIANTS=all_gpu,offload_delayed e2e-headline`; RoPE fused in the decode.
# Run 2026-12-04 16:00-16:53 on one H200 (x2 was not lent; results in benchmarks/results/*2026-12-04T16*, tables in
# benchmarks/README.md): the GPU tests never run before (HostAdamW's bf16 gradients, its update on the GPU and the
# split: passed, 17 of 17), the compiled rotary embedding (7B batch 32: 6.6 ms a token against 7.4), the old log-probs
# taken from the update (7B delayed 3.30 s, 1.30x; 3B delayed 2.98 s, 1.65x, its values waiting 0.6 s for the
# critic's update held on the bus), a profiled 3B delayed step, the bus deferral under a delayed update (3B delayed
# 2.83 s, 1.63x), `tests` (55 passed) with `SECTIONS=static_profile rollout`, then the compiled MLP activation (7B
# batch 32: 6.4 ms; batch 128: 7.7 ms). Measured call times: 17 GPU tests plus two rollout stages plus three e2e-ppo3b
# variants 320 s; a profiled e2e-ppo3b variant plus three e2e-headline variants 509 s; three e2e-ppo3b variants 221 s;
# `tests` plus static_profile 188 s; one GPU test file plus two rollout stages 92 s. One call was refused while the
# last machine was being given back (wait a minute; it cost nothing).
# Next, in priority order: `SECTIONS=allgpu_static_graphs,ours_phase_static rollout` and `SECTIONS=capped rollout`
# (issue 15's layered and capped ratios, last measured before the compiled rotary and MLP: 0.97x and 1.01x its PCIe
# floor; if they hold, issue 15 closes); on an nvidia-h200-x2 machine `VARIANTS=all_gpu,optimizer_offload,optimizer_offload_delayed
# ranks`, then `VARIANTS=all_gpu,optimizer_offload_gpu,optimizer_offload_both ranks` (never run on GPUs: whichever
# wins becomes auto on ranks), `VARIANTS=embedding_head_cpu ranks`, `SHAPE=headline VARIANTS=all_gpu,optimizer_offload
# ranks`; on one H200, the 3B PPO step's bus (85-95 GB up a step: the critic's and the actor's updates on the device
# path; a larger host share under a delayed update?) with `PROFILE=1 VARIANTS=all_gpu,offload_delayed e2e-ppo3b`.
# Run 2026-12-04 18:09-18:54 on one H200 (x2 was not lent; results in benchmarks/results/*2026-12-04T18*, tables in
# benchmarks/README.md): the layered decode (0.94x: no MLP of an engine-placed model was fused; fixed, 0.99x), the
# capped decode against its PCIe floor (1.06x), a profiled 3B delayed step (at its PCIe floor: the split's device
# share), the update split's window (3B delayed 2.68 s against 3.23 s with it off, one run; 7B delayed 1.34x). GPU
# tests: test_static_decode_gpu.py (7) and test_device_update.py with test_offload_gpu.py (28) passed. Measured
# call times: two rollout stages plus a profiled two-variant e2e-ppo3b 340 s; test_static_decode_gpu.py plus
# two rollout sections plus three e2e-ppo3b variants 266 s; a profiled three-variant e2e-ppo3b plus 28 GPU tests
# plus `SECTIONS=capped rollout` 369 s; three e2e-ppo3b variants plus two e2e-headline variants 460 s.
# Next, in priority order: on an nvidia-h200-x2 machine `VARIANTS=all_gpu,optimizer_offload,optimizer_offload_delayed
# ranks`, then `VARIANTS=all_gpu,optimizer_offload_gpu,optimizer_offload_both ranks` (whichever wins becomes auto on
# ranks; HostAdamW's split has no window yet), `VARIANTS=embedding_head_cpu ranks`, `SHAPE=headline
# VARIANTS=all_gpu,optimizer_offload ranks`; on one H200, `VARIANTS=all_gpu,offload,offload_balanced e2e-ppo3b` (the
# window on the exact update: the critic's) and `PROFILE=1 VARIANTS=all_gpu,offload_delayed e2e-headline` (7B
# delayed: where its 0.86 s over all-GPU goes now that the bus carries less).
# Run 2026-12-04 20:20-20:50 on one H200 (x2 not lent; results in benchmarks/results/ranks-ppo3b-h200-2026-12-04T20*,
# table in benchmarks/README.md under ranks_bench.py): issue 16's world-size-1 check, `RANKS=1 VARIANTS=all_gpu
# STEPS=6 REPEAT=2 ranks` (453 s with the machine's start; a group of one 0.97x the plain process, losses equal to
# the bit); `optimizer_offload` at one rank, fp32 against bf16 host gradients (6.7 against 3.0 s a step; two runs of
# `python -m trainer` with ranks_bench.variant_overrides, 133 s and 106 s). Its final checkpoint (69 GiB) does not fit
# the one-GPU machine's 64 GiB disk: ranks_bench keeps the steps and says so.
# Next, in priority order: on an nvidia-h200-x2 machine the ranks calls listed above, then Ulysses with
# use_remove_padding on 2 GPUs (`SET="actor_rollout_ref.actor.ulysses_sequence_parallel_size=2
# actor_rollout_ref.model.use_remove_padding=true" VARIANTS=all_gpu ranks`: never run on GPUs, CPU-tested); on one H200,
# `VARIANTS=all_gpu,offload,offload_balanced e2e-ppo3b` and `PROFILE=1 VARIANTS=all_gpu,offload_delayed e2e-headline`.
# 2026-12-07 11:04-12:58: nine refusals cost about 1,400 s of the 1,800 s budget; the one call that ran (H100, 191 s) fitted only
# `VARIANTS=all_gpu,offload STEPS=3 WARMUP=1 TIMEOUT=90 e2e-ppo3b` for main after issues 37 and 38 and for cfb571f (before
# 37) in .baseline/, 95 s each: all_gpu 1.99 s a step after against 2.05 before (0.97x, same within noise); neither
# offload variant finished in its 95 s (the first step compiles: after's update_actor 5.5 s with use_torch_compile).
# Results: benchmarks/results/e2e-ppo3b-h100-2026-12-07T1258-*.json.
# Next, first: `tests` (issue 38's GPU tests, test_rollout_log_probs_gpu.py and test_compiled_kernels.py, never run
# on a GPU), then the offload side of the issue-37 check: a copy of cfb571f (`git archive cfb571f`) in .baseline/
# (excluded, carried), `VARIANTS=all_gpu,offload STEPS=4 WARMUP=2 TIMEOUT=200 TAG=-before37 e2e-ppo3b` run from it and
# from the repository's root in the same call (about 330 s each pair with the machine's start).
# 2026-12-07 14:25-14:31 (second session), H100, one call of 286 s: the issue-37 check's offload half, `VARIANTS=all_gpu,offload
# STEPS=4 WARMUP=2 TIMEOUT=200 e2e-ppo3b` from the root (TAG=-after37) and from .baseline/ (cfb571f, TAG=-before37),
# 158 s and 119 s: all_gpu 1.650 s a step after against 1.644 s before; offload 3.441 s (2.09x) after against 3.152 s
# (1.92x) before. The counted steps: after 3.29 and 3.59 s, before 3.19 and 3.12 s; after's step 4 had one slow
# update_critic (0.77 s against 0.33-0.39 s in every other step of both). The first step is 28 s after against 19 s
# before: use_torch_compile (issue 38) compiles the actor's update in step 1. Results:
# benchmarks/results/e2e-ppo3b-h100-2026-12-07T1440-*.json. `tests` failed to collect: the image lacks uvicorn, which
# tests/trainer/distributed/conftest.py reaches through tests/support.py; fastapi, starlette, uvicorn and their
# dependencies are now wheels in .whl/ too. Two calls were then refused (300 s of budget).
# 2026-12-07 14:58-15:08, H100 (another host, whose host-side update ran 1.8-2.7 ns an element against 1.0 before): the
# same pair at STEPS=6 WARMUP=2, 186 s and 169 s: all_gpu 1.943 s after against 2.055 s before; offload 3.983 s (2.05x)
# after against 4.446 s (2.16x) before. Counted steps after 3.79 3.63 4.93 3.59 s, before 5.66 3.92 4.02 4.19 s: one
# step in four is 1-2 s slow on either tree (a values or critic phase), so the two calls together say the same speed
# within this noise: +9% in the first, -10% in the second. `tests` was killed by its `timeout` at 204 s, and `tail`
# printed nothing: run pytest with its output to a file under $OUT. Results: e2e-ppo3b-h100-2026-12-07T1500-*.json.
# 15:40-16:10: four more starts (for `tests` plus `--only uneven`, issue 40) were refused and spent the budget: no GPU test
# and no issue-40 or issue-39 figure ran this session. The GPU tests have not run since issue 38 (rollout log-probs,
# compiled kernels) nor issue 40 (test_refill_decode_gpu.py) merged.
# Next: `tests` (with its output in $OUT/gpu_tests.txt, ~100 s), then `issue40` in one call (needs_h200: its all_gpu 7B
# variant does not fit an H100);
# then `e2e-long3b` and `e2e-lora14b` (VARIANTS=all_gpu,offload,offload_delayed STEPS=3 WARMUP=1), a call each.
# 2026-12-07 17:25-19:15 (third session): eight starts refused (H200 with needs_h200, H100, and a call naming no kind,
# which tried both: 180 s), about 1,000 s of the budget. Then one H100, two calls: the GPU tests under `timeout 200`
# (49 passed, none failed, cut before the rest: give `tests` 300 s alone) with `--only uneven` (refill 1.93x a static
# batch's useful tokens/s, 2.91x its HBM floor; 115 s), and `VARIANTS=all_gpu,offload STEPS=2 WARMUP=1 TIMEOUT=110
# e2e-long3b`: offload ran out of memory at 12 GiB in the critic's update with one 4096-token sequence (the recovery
# had nothing left to split: a bug to find first, with PROFILE=1), all_gpu's first step took 74.5 s (gen 50.7 s) and
# did not finish two steps in 110 s: give long3b a call of its own with TIMEOUT=250. .whl/ now holds xxhash
# (trainer/checkpoint_manifest.py imports it) and gguf (a .gguf model path) for python 3.12 too.
# Next: `tests` alone (300 s), then `issue40` on an H200 (gsm8k7b), then long3b's memory at 12 GiB, then e2e-lora14b.
# 2026-12-07 (h40c, CPU only): long3b's critic OOM was the bench's config (the actor checkpointed, the critic not:
# about 19 GiB of activations for one 4112-token sequence against about 1 GiB; e2e_bench now checkpoints both), an
# unrecoverable one-sequence OOM is now one ERROR line (exit 2), and the static decode's attention reads only the
# cache's written columns (trainer/rollout/live_keys.py). Next: `live-keys` (~4 min: the static decode's GPU tests,
# then the batch-256 step with the live keys and with the whole cache side by side, each with the cache length it
# read), then `VARIANTS=all_gpu,offload STEPS=2 WARMUP=1 TIMEOUT=250 e2e-long3b` in a call of its own (the critic
# checkpointed: expect no OOM; PROFILE=1 if update_critic is slow).
# 2026-12-07 20:35-23:34 (fourth session): no device was lent (status: paused for the session): no GPU figure.
# Since the last GPU call, e2e_bench checkpoints the critic in every shape with a critic (ppo3b too): to compare
# ppo3b with a commit from before, run the new one with SET=critic.model.enable_gradient_checkpointing=false, or
# both commits' all_gpu and offload in one call. Next, in order: `tests` alone (300 s, output to a file), `live-keys`,
# `VARIANTS=all_gpu,offload STEPS=2 WARMUP=1 TIMEOUT=250 e2e-long3b`, `issue40` on an H200, `e2e-lora14b`, then
# the real model (benchmarks/README.md: the GGUF carried in two calls) with real_model.py --device cuda.
# 2026-12-08 00:26-00:48 (fifth session), one H100, five calls (1,270 s of the budget with the start): every call now
# begins `source benchmarks/device_env.sh` (carry [".whl"]; fastapi 0.165 needs opentelemetry-api, now a wheel).
# `tests` 62 passed in 198 s (235 s with the install); `live-keys` with SKIP_TESTS=1 (its tests are in `tests`):
# the batch-256 static step 12.7 ms reading 224 of 256 columns, but `uneven` ran out of memory at its full-batch
# step's prefill (76.8 GiB allocated, twice: uneven_decode.py now collects each decoder before the next and records
# what was held); `VARIANTS=all_gpu,offload STEPS=2 WARMUP=1 TIMEOUT=270 e2e-long3b` 317 s: 1.53x, update_actor
# 4.46x with 8 out-of-memory recoveries a step (the logits of 4112-token sequences; the recovery now learns the
# size that fits); `VARIANTS=all_gpu,offload STEPS=2 WARMUP=1 TIMEOUT=260 e2e-lora14b` 269 s: trains, 2.82x (gen
# 4.33x: 4 of 48 layers streamed every token). After 00:48 the out-of-memory recovery learned the size that fits
# (once, not every step) and model.use_fused_kernels was built (long3b and gsm8k7b set it in every variant); loans
# were paused from 02:07 with 529 s left, so neither ran on a GPU. Next, in order, every call starting with
# `source benchmarks/device_env.sh`:
#   1. `VARIANTS=all_gpu,offload STEPS=2 WARMUP=1 TIMEOUT=270 benchmarks/gpu_session.sh e2e-long3b` (~320 s; the
#      fused head and the recovery against 1.53x / update_actor 4.46x / 8 recoveries a step; add PROFILE=1 if the
#      update is still far from its floor), then `SKIP_TESTS=1 benchmarks/gpu_session.sh live-keys` (~170 s: the
#      uneven section with each decoder collected, useful_speedup against 1.93x);
#   2. on an H200 (needs_h200): `benchmarks/gpu_session.sh issue40` (gsm8k7b, never run: all_gpu needs ~120 GB);
#   3. lora14b's rollout (44 of 48 layers kept: 4.33x): `VARIANTS=offload STEPS=2 WARMUP=1 TIMEOUT=260
#      SET="dynamic_offload.gpu_memory_threshold=0.95" TAG=-threshold95 e2e-lora14b` beside the default, to see whether the
#      threshold's reserve (4 GiB of 40) is what keeps the last 4 layers off (then the planner's margin is the lever).
#   `tests` picks up test_fused_head.py's GPU test (the tiles on the GPU's kernels, float32 and bf16): never run yet.
# Needs python3 with torch, transformers, accelerate and the project's other dependencies importable
# (on the device image: installed from wheels first, see .library/device; the image lacks pydantic 2.13.4,
# pydantic_core 2.46.4, annotated_types, typing_inspection, and since 2026-12-02 hydra-core (1.3.2), omegaconf (2.3.0) and
# antlr4-python3-runtime 4.9.3, which is an sdist only: `pip wheel --no-deps` it into .whl/ here).
set -u
out=${OUT:-gpu-results}
sets=()  # SET: config overrides for every variant, KEY=VALUE separated by spaces
for setting in ${SET:-}; do sets+=(--set "$setting"); done
mkdir -p "$out"
cd "$(dirname "$0")/.." || exit 1

case "${1:-}" in
  tests)
    # The files that hold GPU tests only: the others import the daemon's web stack (fastapi, uvicorn),
    # which a GPU image may lack.
    files=$(grep -rl --include='*.py' 'pytest.mark.gpu' tests)
    # Written as it goes, so a stage cut by a timeout still shows how far it came.
    timeout ${TESTS_TIMEOUT:-290} python3 -m pytest -q -p no:cacheprovider -m gpu -rfs -o faulthandler_timeout=90 $files \
      > "$out/gpu_tests.txt" 2>&1; tail -60 "$out/gpu_tests.txt" ;;
  rollout)
    timeout 580 python3 benchmarks/rollout_bench.py ${SECTIONS:+--only $SECTIONS} ${BATCH:+--batch $BATCH} --out "$out/rollout${BATCH:+-b$BATCH}.json" 2>&1 \
      | tee "$out/rollout${BATCH:+-b$BATCH}.txt" | tail -30 ;;
  offload)
    timeout 580 python3 benchmarks/offload_bench.py --only bandwidth,allgpu,ours_layered --out "$out/offload.json" ${PROFILE:+--profile "$out/profile"} \
      2>&1 | tee "$out/offload.txt" | tail -30 ;;
  host)
    timeout 280 python3 benchmarks/offload_bench.py --only host --out "$out/host.json" 2>&1 | tee "$out/host.txt" | tail -12 ;;
  headline)
    timeout 580 python3 benchmarks/grpo_headline.py --cap-gib 40 --out "$out/headline.json" ${PROFILE:+--profile} 2>&1 \
      | tee "$out/headline.txt" | tail -60 ;;
  uncapped)
    timeout 580 python3 benchmarks/grpo_headline.py --cap-gib 0 --out "$out/uncapped.json" ${PROFILE:+--profile} 2>&1 \
      | tee "$out/uncapped.txt" | tail -60 ;;
  telemetry)
    for shape in small tiny; do
      timeout 280 python3 benchmarks/telemetry_bench.py overhead --shape $shape --cycles 3 --out "$out/telemetry-$shape.json" 2>&1 \
        | tee "$out/telemetry-$shape.txt" | tail -8
    done ;;
  e2e-headline)
    timeout 590 python3 benchmarks/e2e_bench.py --shape headline --variants ${VARIANTS:-all_gpu,offload} --steps ${STEPS:-4} ${WARMUP:+--warmup $WARMUP} ${TIMEOUT:+--timeout $TIMEOUT} \
      ${DECODE:+--decode $DECODE} "${sets[@]}" --out "$out/e2e-headline${TAG:-}.json" ${PROFILE:+--profile} 2>&1 | tee "$out/e2e-headline${TAG:-}.txt" | tail -30 ;;
  e2e-ppo3b)
    timeout 590 python3 benchmarks/e2e_bench.py --shape ppo3b --variants ${VARIANTS:-all_gpu,offload,fsdp2} --steps ${STEPS:-4} ${WARMUP:+--warmup $WARMUP} ${TIMEOUT:+--timeout $TIMEOUT} \
      ${DECODE:+--decode $DECODE} "${sets[@]}" --out "$out/e2e-ppo3b${TAG:-}.json" ${PROFILE:+--profile} 2>&1 | tee "$out/e2e-ppo3b${TAG:-}.txt" | tail -30 ;;
  issue40)
    # Issue 40 (2026-12-07, second session): the decode with refilled slots, then the realistic 7B GRPO shape. Results
    # are named by shape, card and date (e2e-gsm8k7b-<gpu>-<date>.json); 8 files come back. The refill's GPU tests
    # first (~30 s): its decode under CUDA graphs and with streamed layers.
    timeout 80 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs -o faulthandler_timeout=70 \
      tests/trainer/rollout/test_refill_decode_gpu.py 2>&1 | tail -15 | tee "$out/gpu_tests_refill.txt"
    timeout 160 python3 benchmarks/rollout_bench.py --only uneven --out "$out/rollout-uneven.json" 2>&1 \
      | tee "$out/rollout-uneven.txt" | tail -12
    timeout 340 python3 benchmarks/e2e_bench.py --shape gsm8k7b --variants ${VARIANTS:-all_gpu,offload,offload_delayed} \
      --steps ${STEPS:-2} --warmup ${WARMUP:-1} --timeout ${TIMEOUT:-100} ${DECODE:+--decode $DECODE} "${sets[@]}" \
      --out "$out" ${PROFILE:+--profile} 2>&1 | tee "$out/e2e-gsm8k7b${TAG:-}.txt" | tail -30 ;;
  live-keys)
    # Issue 40 (h40c): a decode step's attention over the cache's written columns only (trainer/rollout/live_keys.py).
    # The static decode's GPU tests first (graphs per batch size and read length; ~60 s), then rollout_bench's `uneven`
    # (~2 min): its `step` (live keys) and `step_whole_cache` lines give the batch-256 step against its HBM floor and
    # the cache length read, side by side; then the 7B static decode with graphs at batch 256.
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu -rfs -o faulthandler_timeout=70 \
      tests/trainer/rollout/test_static_decode_gpu.py tests/trainer/rollout/test_refill_decode_gpu.py \
      > "$out/gpu_tests_live_keys.txt" 2>&1; tail -15 "$out/gpu_tests_live_keys.txt"
    timeout 200 python3 benchmarks/rollout_bench.py --only uneven --out "$out/rollout-uneven-live.json" 2>&1 \
      | tee "$out/rollout-uneven-live.txt" | tail -12
    timeout 120 python3 benchmarks/rollout_bench.py --only allgpu_static_graphs --batch 256 \
      --out "$out/rollout-b256-live.json" 2>&1 | tee "$out/rollout-b256-live.txt" | tail -8 ;;
  e2e-gsm8k7b|e2e-long3b|e2e-lora14b)
    shape=${1#e2e-}
    timeout 590 python3 benchmarks/e2e_bench.py --shape "$shape" --variants ${VARIANTS:-all_gpu,offload,offload_delayed} \
      --steps ${STEPS:-3} --warmup ${WARMUP:-1} ${TIMEOUT:+--timeout $TIMEOUT} ${DECODE:+--decode $DECODE} "${sets[@]}" \
      --out "$out" ${PROFILE:+--profile} 2>&1 | tee "$out/e2e-$shape${TAG:-}.txt" | tail -30 ;;
  ranks)
    gpus=${RANKS:-$(python3 -c "import torch; print(torch.cuda.device_count())")}
    timeout 590 python3 benchmarks/ranks_bench.py --shape ${SHAPE:-ppo3b} --ranks "$gpus" ${VARIANTS:+--variants $VARIANTS} ${REPEAT:+--repeat $REPEAT} \
      --steps ${STEPS:-4} ${WARMUP:+--warmup $WARMUP} "${sets[@]}" --out "$out/ranks-${SHAPE:-ppo3b}${TAG:-}.json" 2>&1 \
      | tee "$out/ranks-${SHAPE:-ppo3b}${TAG:-}.txt" | tail -30 ;;
  *)
    echo "usage: $0 tests|rollout|offload|host|headline|uncapped|telemetry|e2e-headline|e2e-ppo3b|issue40|live-keys|e2e-gsm8k7b|e2e-long3b|e2e-lora14b|ranks" >&2
    exit 2 ;;
esac
