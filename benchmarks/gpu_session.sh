#!/usr/bin/env bash
# The GPU checks of issue 16 as one script for a short lease on a GPU machine (docs/BENCHMARKS.md
# has the figures). Run from the repository root:
#
#   benchmarks/gpu_session.sh PART...
#
# PARTs, in the order given: install (wheels from .whl/ into /tmp/site, then this project, no
# dependencies), gmm, rollout64, rollout64_graphs (the same with XLA's command buffers also around
# the loop itself; its body is one already, `bench.py kernels`), profile64 and profile16 (the decode
# step's device time by kernel kind at 64 and 16 rows, `bench.py decode_profile`; each also times
# the step with qk_rope_write's reference, and profile64 keeps its two Perfetto traces in $OUT),
# rollout256, rollout64_fp32, profile64_attn (the step with paged_attention's reference beside the
# kernel), profile64_long (the same after 1,024-token prompts), profile64_cublas (XLA's GEMMs by
# cuBLAS, not Triton), profile64_blocks and profile64_long_blocks (paged attention block sizes tried
# in the model, after the short-context sweep's leaders; docs/BENCHMARKS.md), attn_sweep_short (that
# sweep again, 50 calls a jitted loop, so that the kernel's time is what is timed), rollout16_fp32,
# learner, learner_profile (the same with one update's kernels by kind: where the 13% MFU goes),
# learner_chunk (16k positions with the LM head's logits 128 and 512 positions' worth at a time:
# blocks of 1,280 and 4,864 vocabulary rows), sampler (the engine's sampler against Gumbel-max),
# learner_remat (16k positions with the remat policies "full" and "save_attention"), attn_mask (one
# layer's flash attention, forward and backward: the GPU kernel against itself masking every block
# pair and against itself with libdevice's expf, dense and cuDNN), attn_tune (the flash attention kernels' block sizes swept at 4k and 16k
# tokens, forward and backward apart), logprobs (the LM head's log-probs and gradients by vocabulary
# blocks against chunks of positions, 4k and 16k), tgmm (gmm's weight gradient against XLA's,
# default and swept tiles), moe_layer (one MoE layer of gpt-oss-20b and of Qwen3-30B-A3B on one
# GPU, every expert on every token against gmm on each expert's rows, forward at 64-16k rows and
# forward and backward at 4k and 16k: what `model.moe_dispatch="auto"` chose), learner_cudnn (the learner at 4k and 16k with the Pallas kernel and
# with cuDNN's packed attention, `model.attention=cudnn`), learner16k_cudnn (its 16k cuDNN row
# alone: a learner setting takes 60-80 s with its process's start and compile), tests_cudnn
# (cuDNN's packed attention against the oracle), grpo, train (the main job with its defaults), tests (the GPU-marked
# kernel tests in 4 processes, each test's name and result in the log: one process passed 4 of
# them in 120 s on an H100 on 2026-11-27, each building Triton kernels and a float64 oracle on
# the host), tests_flash (those of the flash attention kernels and cuDNN's alone), tests_qk
# (those of qk_rope_write alone), profile64_plain, profile64_nosplitk and profile64_warpspec
# (the 64-row decode step as shipped, then with XLA's split-K rewrite forced to one part, then
# with Triton's warp specialization; both flags are registered in jax 0.11.2's CUDA plugin: the
# per-layer GEMMs and the kernels that sum their split-K parts are most of the step),
# profile64_exhaustive (the same step with XLA's exhaustive GEMM tiling search, not yet run;
# compare with profile64_plain in the same lease), recipe and
# recipe_flash (4 steps of the HF recipe on a random-weight Qwen3-0.6B, with cuDNN's attention
# as "auto" gives it, then with the Pallas kernel; `launch/bench_memory.py recipe_steps`),
# recipe_ahead_off (as `recipe`, with the learner compiled by its first update instead of
# during the first rollout: `train.compile_ahead=False`; compare step 1 and the later steps'
# train times with `recipe` in the same lease), recipe_engine_ahead_off (as `recipe`, with the
# rollout engine compiling its programs as it meets them: `rollout.paged.compile_ahead=False`;
# compare step 1's rollout and any later step's with `recipe`), recipe_unrolled (as `recipe`,
# with the learner's blocks unrolled, `model.scan_layers=False`: compare step 1's train time,
# which waits for the learner's compile, and the later steps' with `recipe`),
# publish (the async loop's weight publication: a host copy in fp32, as before, against a bf16
# copy kept on the device; on one GPU the stages share it, so what differs is the learner's
# wait and the host round trip; `launch/bench_publish.py`),
# recipe_cache (its first 2 steps in a process with a cold persistent compilation cache, then in
# one with the cache the first filled: what `config.compile_cache_dir` saves a resumed run).
# learner_rebuild (a Qwen3-0.6B learner, then two more of equal settings in the process, as
# after a lost learner: each one's first update and compilations; the first compiles its
# programs (53 s in issue 16's GRPO step), the rebuilt ones none; `launch/bench.py
# learner_rebuild`).
# precompiled (a precompiled Qwen3-0.6B engine, then 8 generations of a batch that grows and
# shrinks: what the precompile took and what compiled after it, target nothing;
# `launch/bench.py precompiled_rollout`; not yet run: some 40 programs of a 28-layer model,
# minutes of compiling).
# Each part runs under its own time limit (seconds, PART:LIMIT overrides it) and appends one
# JSON line {"part", "rc", "seconds", "result"} to $OUT/results.jsonl, its progress lines (the
# settings it finished, for a part cut short) to $OUT/progress.txt, the end of its log to
# $OUT/logs.txt and its output (up to 50 kB) to $OUT/outputs.txt.
set -u
OUT=${OUT:-/tmp/gpu_session}
WORK=/tmp/gpu_session_work  # each part's whole output; $OUT gets four files back
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
[ -d /tmp/site ] && export PYTHONPATH=/tmp/site

record() {  # part rc seconds result-file
  python3 - "$@" <<'EOF' >>"$OUT/results.jsonl"
import json, sys
part, rc, seconds, path = sys.argv[1:]
text = open(path).read().strip()
try:
  result = json.loads(text.splitlines()[-1]) if text else None
except ValueError:
  result = text[-2000:]
print(json.dumps({"part": part, "rc": int(rc), "seconds": int(seconds), "result": result}))
EOF
}

run_part() {  # part limit command...
  local part=$1 limit=$2
  shift 2
  local start=$(date +%s)
  timeout "$limit" "$@" >"$WORK/$part.out" 2>"$WORK/$part.log"
  local rc=$?
  local took=$(($(date +%s) - start))
  record "$part" "$rc" "$took" "$WORK/$part.out"
  # A part's own progress lines (a setting at a time), and the end of its log.
  grep '^progress ' "$WORK/$part.log" | sed "s/^progress /$part /" >>"$OUT/progress.txt"
  { echo "== $part: rc=$rc in ${took}s"; tail -c 3000 "$WORK/$part.log"; } >>"$OUT/logs.txt"
  # Its whole output too (parts that print a line a step: `recipe`), up to 50 kB of it.
  { echo "== $part"; head -c 50000 "$WORK/$part.out"; echo; } >>"$OUT/outputs.txt"
  echo "== $part: rc=$rc in ${took}s"
  tail -c 600 "$WORK/$part.out"
  echo
}

# The recipe parts' workload (config overrides, closed by each part) and checkpoint.
RECIPE='{"rollout.prompts_per_step": 16, "rollout.sampling.max_new_tokens": 512'
recipe_checkpoint() {
  [ -f /tmp/ck/config.json ] || python3 launch/bench_memory.py write /tmp/ck >/dev/null
}

for spec in "$@"; do
  part=${spec%%:*}
  limit=${spec#*:}
  [ "$limit" = "$spec" ] && limit=""
  case $part in
    install)
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site &&
        python3 -m pip install -q --no-deps --no-build-isolation -e . >"$WORK/install.log" 2>&1
      echo "== install: rc=$? $(python3 -c 'import jax; print(jax.__version__, jax.devices())')"
      nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv,noheader
      ;;
    gmm) run_part gmm "${limit:-150}" python3 launch/bench.py gmm --json ;;
    rollout64) run_part rollout64 "${limit:-150}" python3 launch/bench.py rollout --json \
      --presets qwen3-0.6b --rows 64 --dtype bfloat16 ;;
    profile64) run_part profile64 "${limit:-180}" python3 launch/bench.py decode_profile --json \
      --presets qwen3-0.6b --rows 64 --reference qk_rope_write --trace-dir "$OUT" ;;
    profile16) run_part profile16 "${limit:-150}" python3 launch/bench.py decode_profile --json \
      --presets qwen3-0.6b --rows 16 --reference qk_rope_write ;;
    profile64_attn) run_part profile64_attn "${limit:-150}" python3 launch/bench.py decode_profile \
      --json --presets qwen3-0.6b --rows 64 --reference paged_attention ;;
    profile64_long) run_part profile64_long "${limit:-180}" python3 launch/bench.py decode_profile \
      --json --presets qwen3-0.6b --rows 64 --prompt-len 1024 --reference paged_attention ;;
    profile64_cublas) XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_triton_gemm=false" \
      run_part profile64_cublas "${limit:-120}" python3 launch/bench.py decode_profile --json \
      --presets qwen3-0.6b --rows 64 ;;
    profile64_blocks) run_part profile64_blocks "${limit:-200}" python3 launch/bench.py \
      decode_profile --json --presets qwen3-0.6b --rows 64 \
      --attention-blocks "1,,2,1;2,,2,1;2,,1,1;4,,2,1" ;;
    profile64_long_blocks) run_part profile64_long_blocks "${limit:-200}" python3 launch/bench.py \
      decode_profile --json --presets qwen3-0.6b --rows 64 --prompt-len 1024 \
      --attention-blocks "2,,2,1;4,,2,1" ;;
    rollout256) run_part rollout256 "${limit:-150}" python3 launch/bench.py rollout --json \
      --presets qwen3-0.6b --rows 256 --dtype bfloat16 ;;
    rollout64_graphs) XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL" \
      run_part rollout64_graphs "${limit:-150}" python3 launch/bench.py rollout --json \
      --presets qwen3-0.6b --rows 64 --dtype bfloat16 ;;
    rollout64_fp32) run_part rollout64_fp32 "${limit:-150}" python3 launch/bench.py rollout \
      --json --presets qwen3-0.6b --rows 64 --dtype float32 ;;
    rollout16_fp32) run_part rollout16_fp32 "${limit:-240}" python3 launch/bench.py rollout \
      --json --presets qwen3-0.6b --rows 16 --dtype float32 ;;
    learner) run_part learner "${limit:-240}" python3 launch/bench.py learner --json ;;
    attn_sweep_short) JAX_PLATFORMS=cuda run_part attn_sweep_short "${limit:-200}" python3 \
      benchmarks/paged_attention_tuning.py --json --grid short --in-loop 50 \
      --shapes qwen3-0.6b_64x96,qwen3-0.6b_256x96 ;;
    learner_chunk) run_part learner_chunk "${limit:-200}" python3 launch/bench.py learner --json \
      --lengths 16384 --attentions flash --logprob-chunks 128,512 ;;
    sampler) run_part sampler "${limit:-60}" python3 launch/bench.py sampler --json ;;
    learner_remat) run_part learner_remat "${limit:-240}" python3 launch/bench.py learner --json \
      --lengths 16384 --attentions flash \
      --remat-policies full,save_attention ;;
    attn_mask) run_part attn_mask "${limit:-120}" python3 launch/bench.py flash_attention --json ;;
    tgmm) run_part tgmm "${limit:-150}" python3 launch/bench.py tgmm --json ;;
    moe_layer) run_part moe_layer "${limit:-240}" python3 launch/bench.py moe_layer --json ;;
    logprobs) run_part logprobs "${limit:-150}" python3 launch/bench.py logprobs --json ;;
    attn_tune) JAX_PLATFORMS=cuda run_part attn_tune "${limit:-360}" python3 \
      benchmarks/flash_attention_tuning.py --json ;;
    learner_cudnn) run_part learner_cudnn "${limit:-300}" python3 launch/bench.py learner --json \
      --lengths 4096,16384 --attentions flash,cudnn ;;
    learner16k_cudnn) run_part learner16k_cudnn "${limit:-150}" python3 launch/bench.py learner \
      --json --lengths 16384 --attentions cudnn ;;
    tests_cudnn) JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false run_part tests_cudnn \
      "${limit:-120}" python3 -m pytest -v -n 2 --durations=5 -m gpu -p no:cacheprovider \
      tests/kernels/flash_attention_cudnn_test.py ;;
    learner_profile) run_part learner_profile "${limit:-300}" python3 launch/bench.py learner \
      --json --profile ;;
    grpo) run_part grpo "${limit:-200}" python3 launch/bench.py grpo_step --json \
      --presets qwen3-0.6b ;;
    learner_rebuild) run_part learner_rebuild "${limit:-200}" python3 launch/bench.py \
      learner_rebuild --json --presets qwen3-0.6b ;;
    precompiled) run_part precompiled "${limit:-420}" python3 launch/bench.py \
      precompiled_rollout --json --presets qwen3-0.6b ;;
    train) run_part train "${limit:-240}" python3 launch/train.py --workdir /tmp/train_default ;;
    tests) JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false run_part tests "${limit:-360}" \
      python3 -m pytest -v -n 4 --durations=15 -m gpu -p no:cacheprovider tests/kernels ;;
    tests_flash) JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false run_part tests_flash \
      "${limit:-180}" python3 -m pytest -v -n 4 --durations=10 -m gpu -p no:cacheprovider \
      tests/kernels/flash_attention_test.py tests/kernels/flash_attention_blocks_test.py \
      tests/kernels/flash_attention_lowering_test.py tests/kernels/flash_attention_cudnn_test.py ;;
    profile64_plain) run_part profile64_plain "${limit:-90}" python3 launch/bench.py \
      decode_profile --json --presets qwen3-0.6b --rows 64 ;;
    profile64_nosplitk) XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_experimental_force_split_k=1" \
      run_part profile64_nosplitk "${limit:-90}" python3 launch/bench.py decode_profile --json \
      --presets qwen3-0.6b --rows 64 ;;
    profile64_warpspec) \
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_experimental_enable_triton_warp_specialization=true" \
      run_part profile64_warpspec "${limit:-90}" python3 launch/bench.py decode_profile --json \
      --presets qwen3-0.6b --rows 64 ;;
    profile64_exhaustive)
      # XLA's GEMM autotuning over its whole tiling space, for the 64-row step's per-layer
      # GEMMs (half the copy rate as shipped); the flag is registered in jax 0.11.2's CUDA plugin.
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_exhaustive_tiling_search=true" run_part \
        profile64_exhaustive "${limit:-240}" python3 launch/bench.py decode_profile --json \
        --presets qwen3-0.6b --rows 64 ;;
    recipe|recipe_flash|recipe_ahead_off|recipe_engine_ahead_off|recipe_unrolled)
      # The HF recipe (configs/grpo_hf.py:qwen3-0.6b) on a random-weight Qwen3-0.6B: 4 steps
      # of 16 prompts x 8 with up to 512 new tokens; `recipe` as shipped (attention "auto":
      # cuDNN's on Hopper, in the learner and the engine's packed prefill), `recipe_flash`
      # with the Pallas kernel, the A/B of the two inside the job; `recipe_unrolled` with the
      # learner's blocks unrolled (`model.scan_layers` off). All compile cold.
      extra="$RECIPE}"
      [ "$part" = recipe_flash ] && extra="$RECIPE, \"model.attention\": \"flash\"}"
      [ "$part" = recipe_ahead_off ] && extra="$RECIPE, \"train.compile_ahead\": false}"
      [ "$part" = recipe_engine_ahead_off ] &&
        extra="$RECIPE, \"rollout.paged.compile_ahead\": false}"
      [ "$part" = recipe_unrolled ] && extra="$RECIPE, \"model.scan_layers\": false}"
      recipe_checkpoint
      run_part "$part" "${limit:-200}" python3 launch/bench_memory.py recipe_steps:4 /tmp/ck \
        "$extra" ;;
    recipe_cache)
      # The recipe's first 2 steps (as `recipe`) twice, in two processes sharing a fresh
      # persistent compilation cache through `config.compile_cache_dir`, as a run uses it:
      # step 1 of the second process is what a resumed or restarted run pays
      # (`recipe_cache_cold`, `recipe_cache_warm` in results.jsonl).
      recipe_checkpoint
      rm -rf /tmp/xla_recipe_cache
      for run in cold warm; do
        run_part "recipe_cache_$run" "${limit:-150}" python3 launch/bench_memory.py \
          recipe_steps:2 /tmp/ck "$RECIPE, \"compile_cache_dir\": \"/tmp/xla_recipe_cache\"}"
      done
      du -sh /tmp/xla_recipe_cache ;;
    publish) run_part publish "${limit:-120}" python3 launch/bench.py publish --json ;;
    tests_qk) JAX_PLATFORMS=cuda run_part tests_qk "${limit:-90}" python3 -m pytest -q -n 0 -m gpu \
      -p no:cacheprovider tests/kernels/qk_rope_write_test.py ;;
    *) echo "unknown part $part" ;;
  esac
done
