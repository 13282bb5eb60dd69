#!/usr/bin/env bash
# What a GPU machine checks, stage by stage (each fits one 10-minute device call), results under
# $OUT (the device tool's output folder) or ./gpu-results:
#
#   benchmarks/gpu_session.sh tests        # every test marked gpu                      (~1 min)
#   benchmarks/gpu_session.sh rollout      # rollout_bench.py, all sections              (~6 min; SECTIONS=a,b picks some:
#                                          # allgpu,allgpu_static,allgpu_static_graphs,allgpu_static_graphs_unfused,
#                                          # ours_phase,ours_phase_static; BATCH=128 decodes 128 sequences at once
#                                          # compares the decode paths; SECTIONS=static_profile: where a decode step's device time goes)
#   benchmarks/gpu_session.sh offload      # offload_bench.py: bandwidth, all-GPU, layered (~2 min)
#   benchmarks/gpu_session.sh headline     # grpo_headline.py under a 40 GiB cap          (~4 min)
#   benchmarks/gpu_session.sh uncapped     # grpo_headline.py without the cap             (~4 min)
#   benchmarks/gpu_session.sh telemetry    # telemetry_bench.py overhead, small and tiny  (~4 min)
#   benchmarks/gpu_session.sh e2e-headline # e2e_bench.py: 7B GRPO whole steps, all-GPU vs offloaded at 40 GiB
#   benchmarks/gpu_session.sh e2e-ppo3b    # e2e_bench.py: 3B PPO + critic, all-GPU vs offloaded at 12 GiB vs FSDP2
#
# e2e stages read VARIANTS (all_gpu,offload[,fsdp2][,offload_delayed][,offload_host_update][,offload_both_update]
# [,offload_lora]), STEPS (4), WARMUP (2: steps not counted), TIMEOUT (seconds a
# variant may take; e2e_bench's default 900), PROFILE (set: --profile) and DECODE (auto, generate or static: rollout.decode; auto, the default, is static with CUDA graphs on a GPU).
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
# first (a call without them fails at `import hydra`). Next, in priority order: `VARIANTS=all_gpu,offload STEPS=4
# WARMUP=2 e2e-headline` and the same `e2e-ppo3b` (not measured: the planner counted the groups a phase keeps twice,
# 7825e7a; the 7B update should keep about two layers more than 17:10's 12), the delayed update replaying graphs
# while the update runs (`offload_delayed`), RoPE fused in the decode (`SECTIONS=static_profile rollout` shows it),
# `SECTIONS=capped rollout` (issue 15's 12 GiB decode, not measured since the fused norms and the ring-aware
# planner), the world-size-1 check of issue 16 (a run through the distributed path against today's, same shape).
# Needs python3 with torch, transformers, accelerate and the project's other dependencies importable
# (on the device image: installed from wheels first, see .library/device; the image lacks pydantic 2.13.4,
# pydantic_core 2.46.4, annotated_types, typing_inspection, and since 2026-12-02 hydra-core 1.3.8, omegaconf 2.3.1 and
# antlr4-python3-runtime 4.9.3, which is an sdist only: `pip wheel --no-deps` it into .whl/ here).
set -u
out=${OUT:-gpu-results}
mkdir -p "$out"
cd "$(dirname "$0")/.." || exit 1

case "${1:-}" in
  tests)
    # The files that hold GPU tests only: the others import the daemon's web stack (fastapi, uvicorn),
    # which a GPU image may lack.
    files=$(grep -rl --include='*.py' 'pytest.mark.gpu' tests)
    python3 -m pytest -q -p no:cacheprovider -m gpu -rfs $files 2>&1 | tail -60 | tee "$out/gpu_tests.txt" ;;
  rollout)
    timeout 580 python3 benchmarks/rollout_bench.py ${SECTIONS:+--only $SECTIONS} ${BATCH:+--batch $BATCH} --out "$out/rollout${BATCH:+-b$BATCH}.json" 2>&1 \
      | tee "$out/rollout${BATCH:+-b$BATCH}.txt" | tail -30 ;;
  offload)
    timeout 580 python3 benchmarks/offload_bench.py --only bandwidth,allgpu,ours_layered --out "$out/offload.json" ${PROFILE:+--profile "$out/profile"} \
      2>&1 | tee "$out/offload.txt" | tail -30 ;;
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
      ${DECODE:+--decode $DECODE} --out "$out/e2e-headline.json" ${PROFILE:+--profile} 2>&1 | tee "$out/e2e-headline.txt" | tail -30 ;;
  e2e-ppo3b)
    timeout 590 python3 benchmarks/e2e_bench.py --shape ppo3b --variants ${VARIANTS:-all_gpu,offload,fsdp2} --steps ${STEPS:-4} ${WARMUP:+--warmup $WARMUP} ${TIMEOUT:+--timeout $TIMEOUT} \
      ${DECODE:+--decode $DECODE} --out "$out/e2e-ppo3b.json" ${PROFILE:+--profile} 2>&1 | tee "$out/e2e-ppo3b.txt" | tail -30 ;;
  *)
    echo "usage: $0 tests|rollout|offload|headline|uncapped|telemetry|e2e-headline|e2e-ppo3b" >&2
    exit 2 ;;
esac
