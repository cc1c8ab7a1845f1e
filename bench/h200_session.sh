#!/usr/bin/env bash
# Everything the GPU-performance issue measures, in one device call, each part under its own
# time limit so that one slow part cannot take the others' results with it (carry .whl):
#
#   TAG=v7 bash bench/h200_session.sh                  # all parts
#   TAG=v7 bash bench/h200_session.sh tests decode     # some, in the order given
#
# Parts (each part's comment in the case below says more):
#   tests      GPU kernel and engine tests          enginegpu  the engine's GPU tests alone
#   engine     decode and prefill through the serving engine (bench/engine_27b.py), traced
#              (ENGINE_CONTEXTS, ENGINE_SAMPLING)
#   narrow     narrow decode in an engine of two rows: its GPU tests, then off against on
#   pagedmerge the paged kernel's splits merged as chains (plan paged_merge=chain): its GPU
#              tests three times (both merges), the engine's GPU tests, C1/C2 1K/128K decode
#              with each merge
#   attnmerge  the attention tail kernel (plan attn_merge=true: the splits' merge, the gate,
#              o_proj's sums): its GPU tests and the engine's, then base / merge in one
#              engine process at ENGINE_CONTEXTS (default 1024,32768,131072)
#   convswap   the GDN conv state written into a second stack in place (plan
#              gdn_conv_write=swap, the h200 preset's): its GPU tests and the engine's
#   chain      bench/chain_lab.cu (no JAX): the C1 step's 257 int4 GEMVs as 257 launches against
#              one persistent kernel with grid barriers (ring / L2 prefetch before them; the
#              next GEMV's first steps bulk-copied into shared memory before them, v31), the
#              same body; the read ceiling of the same bytes (CHAIN_ARGS, e.g. --slice-kb 6,12,24)
#   engab      the default settings' GPU tests (ENGAB_TESTS), then engine_27b's C1/C2 of
#              ENGAB_VARIANTS (default "default"; plan overrides, 'NAME:field=value,...') in one
#              process at ENGINE_CONTEXTS (default 1024,32768,131072), ENGAB_REPS reps (default
#              2), ENGAB_ARGS more of its arguments (e.g. --kv int8, --plan pallas)
#   v29ab      the conv write copy / swap (plan gdn_conv_write) each without and with the
#              attention tail kernel (attn_merge) in one engine process at ENGINE_CONTEXTS
#              (default 1024,32768), after both kernels' GPU tests and the engine's
#   attnprep   the attention layers' decode prep kernel (plan attn_prep, the h200 preset's):
#              GPU tests, C1/C2 through the engine off and on at ENGINE_CONTEXTS (default
#              1024,131072)
#   norms      the fused decode norms (plan norms=fused, the h200 preset's): their GPU tests
#              and the engine's, their micro (bench/norm_micro.py), C1/C2 through the engine
#              with norms xla and fused
#   decode     27B int4 C1/C2 at 1K/32K/128K        prefill    8K/32K/128K bf16 prefill
#   headline   decode and 8K/32K/128K prefill from int4_g64 weights, one process
#   xlapdl     XLA's programmatic dependent launch: engine GPU tests, 1K decode A/B, MLP tests
#   xlafuse    XLA's newer fusion passes (XLAFUSE_SETS): 1K decode and a profiled step each
#   restore    server-level 128K restore vs re-prefill and restart (RESTORE_ARGS,
#              RESTORE_BUDGET_S)
#   profile    one int4 decode step and one bf16 prefill of PROFILE_PREFILL tokens by kernel
#   prefprof   one prefill by kernel (PREFW)       prefhlo    its optimized HLO
#   hlo        the C1 decode step's optimized HLO
#   gemv       int4 GEMV sweep of the big shapes   ncu        the wide GEMV under Nsight Compute
#              (NCU_ARGS: bench/ncu_gemv.py's --shapes, --warps)
#   startup    a warm start's pieces: per-width compile, the weights' copy, checkpoint reads
#   l2warm     the wide GEMV with its weights from the HBM and from L2 (fixed cost per call)
#   ncusrc     the wide GEMV's warp-state samples by SASS instruction (which loads it waits on)
#   wide       the wide GEMV: tests, micro (WIDE_WARPS: auto, 4, 8)
#   readpat    read ceilings by access pattern
#   kvint8     C1/C2 32K/128K over int8 KV (scales folded into the scores)
#   waves      the wide GEMV's kernel time against N (16-row tiles) at K = 5120 and 17408, 4 and
#              8 warps a tile: its fixed cost a call, its rate, the waves' steps
#   graphs     XLA command-buffer settings         cmdbuf     command buffers for loops too
#   unfused    without the fused GDN decode kernel (plan gdn_decode=pallas)
#   unroll     blocks unrolled
#   prefillx   prefill: the lean scan, XLA's chunked rule, dynamic-slice fusion (PREFILLX)
#   prefnext   legacy cuBLAS with dynamic-slice fusion, Triton GEMMs
#   prefab     8K/32K prefill of this tree against an earlier one (PREV_TREE)
#   lab        bench/gemv_lab.cu: the wide GEMV and the MLP op by build, no JAX (LAB_BUILDS)
#   treeab     this tree against PREV_TREE: the wide GEMV's kernel times and C1/C2 1K decode
#   kcost      the cost of a small XLA kernel on the step's path (0, 2, 6 extra a layer)
#   decab      C1/C2 1K decode of this tree against an earlier one (PREV_TREE, DECAB_REPS)
#   mlp        the CUDA MLP op: GPU tests, micro (against the separate calls)
#   mlpab      C1/C2 1K decode, the separate MLP calls (plan mlp=separate) against the MLP op
#   prefint4   8K/32K prefill from int4_g64 weights against bf16
#   gdnprefill, gdnmicro, flash: earlier GDN prefill and attention experiments
# bench_27b.py and engine_27b.py run the kernel plan BENCH_PLAN (a preset, default h200,
# engine/plan.py; $B27 and $E27); a variant is plan fields over it (their --set, and
# engine_27b.py's --variants).
# Parts whose variants were environment switches that left the product with kernel plans are
# gone (gdnwarps, gdnsplit, w10, xperm, pagedab, gdninv, prefcudnn, prefbv, prefscan, chunk128,
# inplace; the kernels' own arguments stay, in their GPU tests and micro-benchmarks), and so
# are those whose variants were int4_gemv.cu's build macros, which left the source (probe:
# NINFER_PROBE; xsab: NINFER_WIDE_XS; the lab's xs0/dxs builds), and those that swept the CUDA
# GEMV and MLP variants no plan selects, which left int4_gemv.cu and cuda_ops (ringdepth: the
# wide GEMV's P = 4 and shared-memory rings; prefetch: the mma GEMV's register ring; wwarps:
# the wide GEMV's 2/10/16 warps, uncapped registers and rings; the mlp part's persistent
# kernel, stream-order launches and other warps; the wide part's bias MMAs), and so is kvcast,
# whose variants (the paged decode kernel's f16 and bitcast casts of int8 codes) left the
# kernel, as the GDN prefill kernel's other preps did (gdnmicro and prefillx's tests run its
# lean path alone).
# Results land in $OUT (default ./out) as <part>_$TAG.{json,log}, packed at the end into
# session_$TAG.tgz (PACK=0: not packed); times are in seconds. Sourced (`source
# bench/h200_session.sh`), it only defines its helpers (run, b27, with_env, prefill2, decode1k)
# and runs no part.
set -uo pipefail
OUT="${OUT:-$PWD/out}"
TAG="${TAG:-run}"
mkdir -p "$OUT"
source "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh"
export JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw --format=csv,noheader
  # SM/memory clocks, power and load once a second for the whole call: is a part held back
  # by the clocks under sustained load (the int4 GEMV question of v5/v6)?
  nvidia-smi dmon -s pcu -d 1 > "$OUT/dmon_$TAG.log" 2>&1 &
  DMON=$!
  trap 'kill $DMON 2>/dev/null' EXIT
fi

run() {  # run <seconds> <log> <command...>: the tail of the log is what the caller sees
  local limit=$1 log=$2
  shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$log" 2>&1
  echo "== $(basename "$log") rc=$? $((SECONDS - t0))s"
}

b27() {  # b27 [tree]: that tree's bench_27b.py command (paged KV) with its kernel plan:
  # BENCH_PLAN (default h200), or --kernels pallas for a tree from before kernel plans
  local tree=${1:-.}
  if grep -q add_plan_args "$tree/bench/bench_27b.py" 2>/dev/null; then
    echo "python3 $tree/bench/bench_27b.py --paged --plan ${BENCH_PLAN:-h200}"
  else
    echo "python3 $tree/bench/bench_27b.py --paged --kernels pallas"
  fi
}
B27=$(b27 .)
E27="python3 bench/engine_27b.py --plan ${BENCH_PLAN:-h200}"
with_env() {  # with_env <VAR=value | argument>... -- <command...>: the command with the
  # VAR=value words (upper-case names) exported and the other words appended to it
  local envs=() extra=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do
    if [[ $1 =~ ^[A-Z_][A-Z0-9_]*= ]]; then envs+=("$1"); else extra+=("$1"); fi
    shift
  done
  shift
  ([ ${#envs[@]} -gt 0 ] && export "${envs[@]}"
   "$@" ${extra[@]+"${extra[@]}"})
}
prefill2() {  # prefill2 <name> [VAR=value | bench_27b.py argument ...]: 8K/32K bf16 prefill,
  # two reps, with that env and those arguments (e.g. --set gdn_prefill=xla)
  local name=$1
  shift
  with_env "$@" -- run 200 "$OUT/${name}_$TAG.log" $B27 --skip-peaks --weights bf16 \
    --contexts "" --prefill 8192,32768 --prefill-reps 2 --out "$OUT/${name}_$TAG.json"
  grep -E '^prefill' "$OUT/${name}_$TAG.log" | sed "s/^/$name: /"
}
decode1k() {  # decode1k <name> [VAR=value | bench_27b.py argument ...]: C1/C2 int4 decode at
  # 1K context with that env and those arguments (e.g. --set mlp=separate)
  local name=$1
  shift
  with_env "$@" -- run 150 "$OUT/${name}_$TAG.log" $B27 --skip-peaks --weights int4_g64 \
    --batches 1,2 --contexts 1024 --prefill "" --steps 10 --out "$OUT/${name}_$TAG.json"
  grep -E '^decode' "$OUT/${name}_$TAG.log" | cut -c1-90 | sed "s/^/$name: /"
}
build_int4() {  # build_int4 <tree>...: each tree's int4 CUDA library at once (nvcc, no GPU),
  # for the h200 plan's architecture and flags; waits for these builds only (a bare wait
  # would wait for dmon too)
  local d pids=""
  for d in "$@"; do
    (cd "$d" && JAX_PLATFORMS=cpu python3 -c "from engine.kernels import cuda_ops as c
try:
    from engine.plan import H200 as p
    arch, flags = p.cuda_arch, p.cuda_flags
except ImportError:  # a tree from before kernel plans
    arch, flags = '90', None
c.build(c.INT4_SOURCE, arch, c._nvcc(), *([flags] if flags else []))") \
      > "$OUT/build_$(basename "$d")_$TAG.log" 2>&1 &
    pids="$pids $!"
  done
  wait $pids
}
wide_micro() {  # wide_micro <name> <tree> <nk> [micro args...]: the wide GEMV's kernel time a
  # launch (M = 1) at 4 and 8 warps a tile from that tree's micro at the N x K list (a tree
  # from before the sweep's variants left names the same kernels with its own flags)
  local name=$1 tree=$2 nk=$3
  shift 3
  local sel=(--kernels wide --wide-warps 4,8)
  grep -q -- '--wide-occ' "$tree/bench/cuda_gemv_micro.py" \
    && sel=(--rpw "" --stages "" --wide 2 --wide-warps 4,8 --wide-occ 32)
  run 300 "$OUT/${name}_$TAG.log" python3 "$tree/bench/cuda_gemv_micro.py" --rows 1 \
    "${sel[@]}" --no-pallas --kernel-times --nk "$nk" --out "$OUT/${name}_$TAG.json" "$@"
  grep -E 'kernel' "$OUT/${name}_$TAG.log" | sed "s/^/$name: /"
}
[ "${BASH_SOURCE[0]}" = "$0" ] || return 0  # sourced: the helpers only
for part in "${@:-tests gemv decode profile prefill restore}"; do
  for p in $part; do
    case $p in
      tests)  # TESTS_FILES (default every kernel file and the engine's) under TESTS_LIMIT_S
        # (default 480; v29f ran the Pallas kernels' 41 in ~200 s: split the files over two
        # calls when the CUDA GEMV's 52 come too)
        run "${TESTS_LIMIT_S:-480}" "$OUT/gpu_tests_$TAG.log" python3 -m pytest -v -m gpu \
          -p no:cacheprovider ${TESTS_FILES:-tests/test_kernels_*.py tests/test_engine_gpu.py}
        grep -cE ' PASSED' "$OUT/gpu_tests_$TAG.log" | sed 's/^/passed: /'
        grep -E ' (FAILED|ERROR)' "$OUT/gpu_tests_$TAG.log" | head -20
        tail -n 2 "$OUT/gpu_tests_$TAG.log" ;;
      gemv)
        run 150 "$OUT/gemv_$TAG.log" python3 bench/cuda_gemv_micro.py --rows 1,2 \
          --shapes 3,4,0,9 --out "$OUT/cuda_gemv_micro_$TAG.json"
        grep -E 'lm_head|gate' "$OUT/gemv_$TAG.log" ;;
      decode)
        run 240 "$OUT/decode_$TAG.log" $B27 --weights int4_g64 --batches 1,2 \
          --contexts 1024,32768,131072 --prefill "" --steps 10 --out "$OUT/bench_27b_$TAG.json"
        grep -E 'ceilings|decode' "$OUT/decode_$TAG.log" | cut -c1-160 ;;
      xlafuse)  # XLA's newer fusion passes on the decode step, whose ~1,200 small kernels
        # (RMSNorms as a sum-of-squares kernel and a normalize kernel each, residual adds, group
        # sums) take ~1.5 ms of the 1K step: for no flags and each of XLAFUSE_SETS (XLA flag
        # sets, ';' between them), C1/C2 1K decode and one profiled C1 step (kernels a step,
        # the largest by time). A flag this XLA does not know ends its run at start-up (in
        # its log). The engine's GPU tests (greedy C1 == C2) then run with XLAFUSE_TEST, if set.
        IFS=';' read -ra fsets <<< "${XLAFUSE_SETS:---xla_gpu_experimental_enable_fusion_block_level_rewriter=true;--xla_gpu_experimental_enable_triton_heroless_priority_fusion=true;--xla_gpu_unsupported_enable_triton_multi_output_fusion=true}"
        for i in $(seq 0 "${#fsets[@]}"); do
          flags=""
          [ "$i" -gt 0 ] && flags="${fsets[$((i - 1))]}"
          echo "set $i: ${flags:-none}"
          decode1k "xlafuse_$i" "XLA_FLAGS=$flags"
          (export XLA_FLAGS="$flags"
           run 150 "$OUT/xlafuse_prof_${i}_$TAG.log" $B27 --skip-peaks --weights int4_g64 \
             --batches 1 --contexts 1024 --prefill "" --steps 5 --profile 2 \
             --out "$OUT/xlafuse_prof_${i}_$TAG.json")
          grep -E -A4 'per step' "$OUT/xlafuse_prof_${i}_$TAG.log" | cut -c1-150
        done
        if [ -n "${XLAFUSE_TEST:-}" ]; then
          (export XLA_FLAGS="$XLAFUSE_TEST"
           run 300 "$OUT/xlafuse_enginegpu_$TAG.log" python3 -m pytest -q -m gpu \
             -p no:cacheprovider tests/test_engine_gpu.py)
          tail -n 2 "$OUT/xlafuse_enginegpu_$TAG.log"
        fi ;;
      xlapdl)  # XLA's programmatic dependent launch (--xla_gpu_enable_pdl=true): the engine's
        # GPU tests (without it), C1/C2 1K decode without and with it, then the MLP op's GPU
        # tests (MLP_TESTS_S seconds)
        local_pdl="XLA_FLAGS=--xla_gpu_enable_pdl=true"
        run 200 "$OUT/xlapdl_enginegpu_$TAG.log" python3 -m pytest -q -m gpu \
          -p no:cacheprovider tests/test_engine_gpu.py
        tail -n 2 "$OUT/xlapdl_enginegpu_$TAG.log"
        decode1k xlapdl_off
        decode1k xlapdl_on "$local_pdl"
        run "${MLP_TESTS_S:-200}" "$OUT/xlapdl_mlp_tests_$TAG.log" python3 -m pytest -q -m gpu \
          -p no:cacheprovider tests/test_kernels_cuda_gemv.py -k "mlp"
        tail -n 2 "$OUT/xlapdl_mlp_tests_$TAG.log" ;;
      headline)  # every goal figure of the bench in one process: int4_g64 decode C1/C2 at
        # 1K/32K/128K, then 8K/32K/128K prefill from the same weights (HEADLINE_REPS reps)
        run 580 "$OUT/headline_$TAG.log" $B27 --weights int4_g64 --batches 1,2 \
          --contexts 1024,32768,131072 --steps 10 --prefill 8192,32768,131072 \
          --prefill-reps "${HEADLINE_REPS:-3}" --prefill-weights int4_g64 \
          --out "$OUT/bench_27b_$TAG.json"
        grep -E 'ceilings|decode|^prefill' "$OUT/headline_$TAG.log" | cut -c1-160 ;;
      profile)
        run 200 "$OUT/profile_$TAG.log" $B27 --skip-peaks --weights int4_g64 --batches 1 \
          --contexts 1024 --prefill "${PROFILE_PREFILL:-8192}" --prefill-reps 1 --steps 5 \
          --profile 2 --out "$OUT/profile_$TAG.json"
        grep -E -A8 'per step' "$OUT/profile_$TAG.log" | cut -c1-150 ;;
      prefprof)  # one prefill of PROFILE_PREFILL tokens (default 8192) by kernel, from the
        # weights in PREFW (default bf16; int4_g64 as the product prefills)
        run 200 "$OUT/prefprof_$TAG.log" $B27 --skip-peaks --weights "${PREFW:-bf16}" \
          --contexts "" --prefill "${PROFILE_PREFILL:-8192}" --prefill-reps 2 --profile 1 \
          --prefill-weights "${PREFW:-bf16}" \
          --out "$OUT/prefprof_$TAG.json"
        grep -E -B2 -A40 'per step' "$OUT/prefprof_$TAG.log" | cut -c1-150 ;;
      prefhlo)  # the optimized HLO of one bf16 prefill of PROFILE_PREFILL tokens, gzipped
        XLA_FLAGS="--xla_dump_to=/tmp/phlo_$TAG --xla_dump_hlo_as_text" run 200 \
          "$OUT/prefhlo_$TAG.log" $B27 --skip-peaks --weights bf16 --contexts "" \
          --prefill "${PROFILE_PREFILL:-8192}" --prefill-reps 1 --out "/tmp/phlo_bench_$TAG.json"
        f=$(ls -S /tmp/phlo_$TAG/*after_optimizations.txt | head -n 1)
        echo "largest module: $f"; gzip -c "$f" > "$OUT/prefill_hlo_$TAG.txt.gz" ;;
      prefnext)  # prepared in v11, not measured: the weight copies before cuBLAS (~26 ms at
        # 8K): XLA's dynamic-slice fusion takes only legacy cuBLAS GEMMs, and XLA emits
        # cublasLt ones (legacy: legacy cuBLAS alone, the control; legacydsf: legacy cuBLAS
        # with the fusion), or Triton GEMM fusions in place of cuBLAS (tritongemm), which can
        # read the slice; 8K/32K prefill with each (the lean scan's 128-step chunks went with
        # NINFER_GDN_PREFILL_CHUNK: gdn_prefill.gdn_chunk takes chunk_size as an argument)
        for X in ${PREFNEXT:-legacy legacydsf tritongemm}; do
          F=""
          [ $X = legacy ] && F="--xla_gpu_enable_cublaslt=false"
          [ $X = legacydsf ] && F="--xla_gpu_enable_cublaslt=false --xla_gpu_enable_dynamic_slice_fusion=true"
          [ $X = tritongemm ] && F="--xla_gpu_cublas_fallback=false"
          prefill2 "prefnext_$X" "XLA_FLAGS=$F"
        done ;;
      prefab)  # 8K/32K prefill of this tree, then of the tree in PREV_TREE (default .whl/prev:
        # an earlier commit's engine/ and bench/, `git archive <commit> engine bench`), one call
        prefill2 prefab_cur
        (B27=$(b27 "${PREV_TREE:-.whl/prev}")
         prefill2 prefab_prev) ;;
      kcost)  # what one small kernel on the step's path costs: C1/C2 1K decode with 0, 2 and 6
        # extra XLA kernels a layer (bench_27b.py's extra_kernels), in one process, in turn
        # KCOST_REPS times
        run 400 "$OUT/kcost_$TAG.log" $B27 --skip-peaks --weights int4_g64 --batches 1,2 \
          --contexts 1024 --prefill "" --steps 10 --variant-reps "${KCOST_REPS:-2}" \
          --variants 'x0:extra_kernels=0 x2:extra_kernels=2 x6:extra_kernels=6' \
          --out "$OUT/kcost_$TAG.json"
        grep -E '^variant' "$OUT/kcost_$TAG.log" ;;
      decab)  # C1/C2 1K decode of this tree, then of the tree in PREV_TREE (as prefab), in
        # turn DECAB_REPS times (default 1), one call
        for rep in $(seq "${DECAB_REPS:-1}"); do
          decode1k "decab_cur_$rep"
          (B27=$(b27 "${PREV_TREE:-.whl/prev}")
           decode1k "decab_prev_$rep")
        done ;;
      engine)  # decode and prefill through the serving engine (bench/engine_27b.py, v25):
        # B = 1 and 2, 1K/32K/128K, chained steps on/off, each engine's first context traced
        run 560 "$OUT/engine_$TAG.log" $E27 --batches 1,2 \
          --contexts "${ENGINE_CONTEXTS:-1024,32768,131072}" --decode-tokens 64 --reps 2 \
          --sampling "${ENGINE_SAMPLING:-greedy}" --trace "$OUT/etrace_$TAG" --budget-s 470 \
          --out "$OUT/engine_$TAG.json"
        grep -E '^ ?[0-9]|^prefill' "$OUT/engine_$TAG.log" ;;
      narrow)  # narrow decode (plan narrow_decode) in an engine of two rows: the engine's
        # GPU tests (greedy C1 == C2; they choose their plans), then B = 2 engines without and
        # with it
        run 200 "$OUT/narrowgpu_$TAG.log" python3 -m pytest -q -m gpu \
          -p no:cacheprovider tests/test_engine_gpu.py
        tail -n 3 "$OUT/narrowgpu_$TAG.log"
        run 400 "$OUT/narrow_$TAG.log" $E27 --batches 2 --narrow 0,1 \
          --contexts 1024,32768 --decode-tokens 64 --reps 2 --trace "$OUT/etrace_$TAG" \
          --budget-s 330 --out "$OUT/narrow_$TAG.json"
        grep -E '^ ?[0-9]|^prefill' "$OUT/narrow_$TAG.log" ;;
      pagedmerge)  # plan paged_merge=chain against reduce (v26): batch invariance on the
        # GPU (fresh inputs each run), the engine's GPU tests (greedy C1 == C2; they choose
        # their plans), the step's time
        for i in 1 2 3; do
          run 150 "$OUT/pagedmerge_tests${i}_$TAG.log" python3 -m pytest -q -m gpu \
            -p no:cacheprovider tests/test_kernels_attention.py -k paged_decode_gpu
          tail -n 4 "$OUT/pagedmerge_tests${i}_$TAG.log" | cut -c1-160
        done
        run 200 "$OUT/pagedmerge_narrowgpu_$TAG.log" python3 -m pytest -q -m gpu \
          -p no:cacheprovider tests/test_engine_gpu.py
        tail -n 3 "$OUT/pagedmerge_narrowgpu_$TAG.log"
        for mg in reduce chain; do
          run 200 "$OUT/pagedmerge_${mg}_$TAG.log" $B27 --skip-peaks --set "paged_merge=$mg" \
            --weights int4_g64 --batches 1,2 --contexts 1024,131072 --prefill "" --steps 10 \
            --out "$OUT/pagedmerge_${mg}_$TAG.json"
          grep -E '^decode' "$OUT/pagedmerge_${mg}_$TAG.log" | cut -c1-90 | sed "s/^/$mg: /"
        done ;;
      attnmerge)  # the attention tail in one kernel (v28, built after the device time ran
        # out): its GPU tests and the engine's with it, then the A/B in one process
        run 200 "$OUT/attnmerge_gpu_$TAG.log" python3 -m pytest -q -m gpu \
          -p no:cacheprovider tests/test_kernels_attn_merge.py tests/test_engine_gpu.py
        tail -n 2 "$OUT/attnmerge_gpu_$TAG.log"
        run 400 "$OUT/attnmerge_engine_$TAG.log" $E27 --batches 1,2 \
          --contexts "${ENGINE_CONTEXTS:-1024,32768,131072}" --decode-tokens 64 --reps 2 \
          --modes 1 --turns "" --budget-s 370 --out "$OUT/attnmerge_engine_$TAG.json" \
          --variants "base merge:attn_merge=true"
        grep -E '^ *[a-z]+ +[0-9]+ +[01] ' "$OUT/attnmerge_engine_$TAG.log" ;;
      convswap)  # the conv state into a second stack (v28, built after the device time ran
        # out; the h200 preset's since kernel plans): its GPU tests and the engine's
        run 200 "$OUT/convswap_gpu_$TAG.log" python3 -m pytest -q \
          -m gpu -p no:cacheprovider tests/test_kernels_gdn_fused.py tests/test_engine_gpu.py
        tail -n 2 "$OUT/convswap_gpu_$TAG.log" ;;
      chain)  # the step's GEMVs: separate launches against one persistent kernel (v29)
        NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
        "$NVCC" -O3 -std=c++17 -gencode arch=compute_90,code=sm_90 bench/chain_lab.cu \
          -o /tmp/chain_lab > "$OUT/chain_build_$TAG.log" 2>&1
        run 240 "$OUT/chain_$TAG.log" /tmp/chain_lab ${CHAIN_ARGS:-}
        grep '^{' "$OUT/chain_$TAG.log" > "$OUT/chain_lab_$TAG.jsonl"
        python3 - "$OUT/chain_lab_$TAG.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    k = r.pop("kind")
    print(f"{k:8s} " + "  ".join(f"{a}={b}" for a, b in r.items()))
PY
        ;;
      engab)  # the defaults' GPU tests, then named plans (plan overrides) in one engine
        # process
        if [ -n "${ENGAB_TESTS-tests/test_kernels_gdn_fused.py tests/test_engine_gpu.py}" ]; then
          run 200 "$OUT/engab_gpu_$TAG.log" python3 -m pytest -q -m gpu -p no:cacheprovider \
            ${ENGAB_TESTS-tests/test_kernels_gdn_fused.py tests/test_engine_gpu.py}
          tail -n 2 "$OUT/engab_gpu_$TAG.log"
        fi
        run "${ENGAB_LIMIT_S:-420}" "$OUT/engab_engine_$TAG.log" $E27 \
          --batches 1,2 --contexts "${ENGINE_CONTEXTS:-1024,32768,131072}" --decode-tokens 64 \
          --reps "${ENGAB_REPS:-2}" --modes 1 --turns "" \
          --budget-s "$(( ${ENGAB_LIMIT_S:-420} - 30 ))" --out "$OUT/engab_engine_$TAG.json" \
          --variants "${ENGAB_VARIANTS:-default}" ${ENGAB_ARGS:-}
        grep -E '^ *[a-z]+ +[0-9]+ +[01] |^prefill' "$OUT/engab_engine_$TAG.log" ;;
      v29ab)  # the two v28 builds' GPU tests and the engine's, then the four settings in one
        # engine process (base: conv write copy, no tail kernel; swap: the h200 preset)
        run 240 "$OUT/v29ab_gpu_$TAG.log" \
          python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gdn_fused.py \
          tests/test_kernels_attn_merge.py tests/test_engine_gpu.py
        tail -n 2 "$OUT/v29ab_gpu_$TAG.log"
        run 420 "$OUT/v29ab_engine_$TAG.log" $E27 --batches 1,2 \
          --contexts "${ENGINE_CONTEXTS:-1024,32768}" --decode-tokens 64 --reps 2 --modes 1 \
          --turns "" --budget-s 390 --out "$OUT/v29ab_engine_$TAG.json" --variants \
          "base:gdn_conv_write=copy merge:gdn_conv_write=copy,attn_merge=true swap:gdn_conv_write=swap both:gdn_conv_write=swap,attn_merge=true"
        grep -E '^ *[a-z]+ +[0-9]+ +[01] ' "$OUT/v29ab_engine_$TAG.log" ;;
      attnprep)  # q/k norms, RoPE and the K/V write in one kernel a layer (v27, built after
        # the device time ran out): its tests and the engine's (greedy C1 == C2), then the A/B
        run 200 "$OUT/attnprep_gpu_$TAG.log" python3 -m pytest -q -m gpu \
          -p no:cacheprovider tests/test_kernels_attn_prep.py tests/test_engine_gpu.py
        tail -n 2 "$OUT/attnprep_gpu_$TAG.log"
        for on in 0 1; do
          prep=false; [ $on = 1 ] && prep=true
          run 280 "$OUT/attnprep_engine${on}_$TAG.log" $E27 \
            --batches 1,2 --contexts "${ENGINE_CONTEXTS:-1024,131072}" \
            --decode-tokens 64 --reps 1 --modes 1 --turns "" --budget-s 240 \
            --set "attn_prep=$prep" --out "$OUT/attnprep_engine${on}_$TAG.json"
          grep -E '^ ?[0-9]' "$OUT/attnprep_engine${on}_$TAG.log" | sed "s/^/prep=$on: /"
        done ;;
      norms)  # the fused decode norms (v27): kernels against references and greedy C1 == C2
        # on the GPU, the micro, then the engine's C1/C2 without and with them, traced
        run 150 "$OUT/norms_gpu_$TAG.log" python3 -m pytest -q -m gpu -p no:cacheprovider \
          tests/test_kernels_norm.py tests/test_engine_gpu.py
        tail -n 2 "$OUT/norms_gpu_$TAG.log"
        run 200 "$OUT/norm_micro_$TAG.log" python3 bench/norm_micro.py --rows 1,2 \
          --out "$OUT/norm_micro_$TAG.json"
        grep 'a call' "$OUT/norm_micro_$TAG.log"
        for on in 0 1; do
          norms=xla; [ $on = 1 ] && norms=fused
          run 250 "$OUT/norms_engine${on}_$TAG.log" $E27 \
            --batches 1,2 --contexts "${ENGINE_CONTEXTS:-1024}" \
            --decode-tokens 64 --reps 1 --modes 1 --turns 4 --trace "$OUT/etrace_norms${on}_$TAG" \
            --set "norms=$norms" --budget-s 200 --out "$OUT/norms_engine${on}_$TAG.json"
          grep -E '^ ?[0-9]' "$OUT/norms_engine${on}_$TAG.log" | sed "s/^/fused=$on: /"
        done ;;
      enginegpu)  # the engine's GPU tests alone (greedy C1 == C2, kernels vs references)
        run 300 "$OUT/enginegpu_$TAG.log" python3 -m pytest -q -m gpu -p no:cacheprovider \
          tests/test_engine_gpu.py tests/test_kernels_gdn_prefill.py
        tail -n 3 "$OUT/enginegpu_$TAG.log" ;;
      unfused)  # the GDN decode step's recurrent kernel alone, the other steps in XLA (and the
        # conv state copied: the swap needs the fused kernel)
        run 200 "$OUT/unfused_$TAG.log" $B27 --skip-peaks --weights int4_g64 \
          --set gdn_decode=pallas,gdn_conv_write=copy \
          --batches 1,2 --contexts 1024 --prefill "" --steps 10 --profile 2 \
          --out "$OUT/unfused_$TAG.json"
        grep -E -A6 'per step|decode' "$OUT/unfused_$TAG.log" | cut -c1-150 ;;
      wide)  # the wide tensor-core GEMV: its GPU tests, a micro of every kernel with the
        # wide one at WIDE_WARPS (auto: by the shape, as the model runs it; 4; 8)
        run 150 "$OUT/wide_tests_$TAG.log" python3 -m pytest -q -m gpu -p no:cacheprovider \
          tests/test_kernels_cuda_gemv.py -k wide
        tail -n 2 "$OUT/wide_tests_$TAG.log"
        run 150 "$OUT/wide_gemv_$TAG.log" python3 bench/cuda_gemv_micro.py --rows 1,2 \
          --wide-warps "${WIDE_WARPS:-auto,4,8}" \
          --shapes 3,4,2,7,0,9 --out "$OUT/cuda_gemv_micro_wide_$TAG.json"
        grep -E 'fma|wide' "$OUT/wide_gemv_$TAG.log" ;;
      prefint4)  # 8K/32K prefill from the int4_g64 weights the product ships (each layer
        # dequantized to bf16 before its GEMMs), then from bf16 weights, one process
        run 240 "$OUT/prefint4_$TAG.log" $B27 --skip-peaks --weights int4_g64 --contexts "" \
          --prefill 8192,32768 --prefill-reps 2 --prefill-weights int4_g64,bf16 \
          --out "$OUT/prefint4_$TAG.json"
        grep -E '^prefill' "$OUT/prefint4_$TAG.log" ;;
      mlp)  # the CUDA MLP op (cuda_ops.int4_mlp: gate|up, SwiGLU, down and the residual in
        # one call, two launches chained by programmatic dependent launch, as plan mlp=cuda
        # runs it): its GPU tests and the micro benchmark at the 27B's shapes
        run 360 "$OUT/mlp_tests_$TAG.log" python3 -m pytest -q -m gpu -p no:cacheprovider \
          tests/test_kernels_cuda_gemv.py -k "mlp"
        tail -n 2 "$OUT/mlp_tests_$TAG.log"
        run 200 "$OUT/mlp_micro_$TAG.log" python3 bench/mlp_micro.py --out "$OUT/mlp_micro_$TAG.json"
        grep -E "^M[0-9]" "$OUT/mlp_micro_$TAG.log" ;;
      mlpab)  # C1/C2 1K decode: the separate MLP calls (plan mlp=separate) once, then the
        # default (the MLP op, two launches chained by programmatic dependent launch) twice
        decode1k mlp_off --set mlp=separate
        for rep in a b; do
          decode1k "mlp_pdl_$rep"
        done ;;
      kvint8)  # C1/C2 decode at 32K/128K over an int8 KV pool (half the KV bytes of bf16),
        # the paged kernel's int8 scales folded into scores and softmax weights
        run 120 "$OUT/kvint8_tests_$TAG.log" python3 -m pytest -q -m gpu -p no:cacheprovider \
          tests/test_kernels_attention.py -k paged_decode
        tail -n 2 "$OUT/kvint8_tests_$TAG.log"
        run 200 "$OUT/kvint8_fold_$TAG.log" $B27 --skip-peaks --kv int8 \
          --weights int4_g64 --batches 1,2 --contexts 32768,131072 --prefill "" --steps 10 \
          --out "$OUT/kvint8_fold_$TAG.json"
        grep -E '^decode' "$OUT/kvint8_fold_$TAG.log" | cut -c1-90 | sed "s/^/fold: /" ;;
      waves)
        NK1=""; for t in ${WAVES_TILES1:-264 528 792 1056 1320 1584 1848 2112 2176 2640 3168}; do
          NK1="$NK1$((16 * t))x5120,"; done
        NK2=""; for t in ${WAVES_TILES2:-132 264 320 396 528 660}; do
          NK2="$NK2$((16 * t))x17408,"; done
        run 420 "$OUT/waves_$TAG.log" python3 bench/cuda_gemv_micro.py --rows 1 \
          --kernels wide --no-pallas --wide-warps 4,8 --kernel-times \
          --nk "$NK1$NK2" --out "$OUT/cuda_gemv_micro_waves_$TAG.json"
        grep -E 'kernel' "$OUT/waves_$TAG.log" ;;
      lab)  # bench/gemv_lab.cu (no JAX): the wide GEMV (x through L1 and staged) at the four
        # big shapes and the MLP op (kernel time a launch in CUDA graphs, bitwise against the
        # engine's kernel, the read ceiling of the same bytes) and a per-round trace, from
        # each build of LAB_BUILDS (name:nvcc-flags, comma-joined flags), built at once
        INC=$(python3 -c 'import jax; print(jax.ffi.include_dir())')
        NVCC=$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
        BUILDS=${LAB_BUILDS:-lab:}
        pids=""
        for b in $BUILDS; do
          "$NVCC" -O3 -std=c++17 -gencode arch=compute_90,code=sm_90 -I"$INC" \
            ${b#*:} bench/gemv_lab.cu -o "/tmp/gemv_lab_${b%%:*}" \
            > "$OUT/lab_build_${b%%:*}_$TAG.log" 2>&1 &
          pids="$pids $!"
        done
        wait $pids
        for b in $BUILDS; do
          name=${b%%:*}
          run 240 "$OUT/lab_${name}_$TAG.log" "/tmp/gemv_lab_$name"
          grep '^{' "$OUT/lab_${name}_$TAG.log" > "$OUT/lab_${name}_$TAG.jsonl"
          python3 - "$OUT/lab_${name}_$TAG.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["kind"] == "time":
        print(f'{r["shape"]:22s} {r["variant"]:26s} {r["us"]:8.2f} us {r["tbps"]:6.3f} TB/s '
              f'{r.get("of_ceiling", 1):6.3f} diff {r.get("rows_differing", 0)}')
    elif r["kind"] == "mlp":
        print(f'mlp op M={r["m"]} gate|up warps {r["gate_up_warps"]} {r["us"]:8.2f} us {r["tbps"]:6.3f} TB/s out {r["out_fnv"]}')
    elif r["kind"] == "trace":
        print(f'trace {r["shape"]}: round {r["round_us"]:.3f} us x {r["rounds"]}, '
              f'fill {r["fill_us"]:.3f}, span {r["span_us"]:.2f}')
    else:
        print(line.strip())
PY
        done ;;
      treeab)  # this tree against PREV_TREE (an edited copy, carried): both int4 libraries
        # built at once, then from each the wide GEMV's kernel times at TREEAB_NK (4 and 8
        # warps) and C1/C2 1K decode, in turn
        PREV=${PREV_TREE:-.whl/prev}
        build_int4 . "$PREV"
        for side in cur prev; do
          d=.; [ $side = prev ] && d=$PREV
          wide_micro "treeab_micro_$side" "$d" \
            "${TREEAB_NK:-5120x17408,5120x6144,34816x5120,16480x5120}"
        done
        decode1k treeab_cur
        (B27=$(b27 "$PREV")
         decode1k treeab_prev) ;;
      prefillx)  # prefill experiments, one call: every state-independent term from XLA and
        # the lean scan kernel (plan gdn_prefill=pallas, the presets'), XLA's chunked rule
        # alone (gdn_prefill=xla), and XLA's dynamic-slice fusion (a layer's weights sliced
        # out of the stacks by address, not copied, before cuBLAS)
        run 120 "$OUT/prefillx_tests_$TAG.log" python3 -m pytest -q -m gpu -p no:cacheprovider \
          tests/test_kernels_gdn_prefill.py -k "gpu_27b"
        tail -n 2 "$OUT/prefillx_tests_$TAG.log"
        for X in ${PREFILLX:-lean xla dsf}; do
          G=pallas F=""
          [ $X = xla ] && G=xla
          [ $X = dsf ] && F="--xla_gpu_enable_dynamic_slice_fusion=true"
          prefill2 "prefillx_$X" --set "gdn_prefill=$G" "XLA_FLAGS=$F"
        done ;;
      hlo)  # the optimized HLO of the C1 decode step (what each profiled fusion is), gzipped
        XLA_FLAGS="--xla_dump_to=/tmp/hlo_$TAG --xla_dump_hlo_as_text" run 200 \
          "$OUT/hlo_$TAG.log" $B27 --skip-peaks --weights int4_g64 --batches 1 \
          --contexts 1024 --prefill "" --steps 2 --out "/tmp/hlo_bench_$TAG.json"
        f=$(ls -S /tmp/hlo_$TAG/*after_optimizations.txt | head -n 1)
        echo "largest module: $f"; gzip -c "$f" > "$OUT/decode_hlo_$TAG.txt.gz" ;;
      graphs)  # is the decode step bound by the host's launches? C1/C2 1K under XLA command
        # buffer settings: none, XLA's defaults (plan xla_gpu_graphs=false), custom calls in
        # graphs of any size (the h200 preset's), + loops
        CB="FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN"
        for g in none default custom loops; do
          G=true
          case $g in
            none) F="--xla_gpu_enable_command_buffer=" ;;
            default) F=""; G=false ;;
            custom) F="--xla_gpu_enable_command_buffer=$CB --xla_gpu_graph_min_graph_size=1" ;;
            loops) F="--xla_gpu_enable_command_buffer=$CB,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1" ;;
          esac
          XLA_FLAGS="$F" run 120 "$OUT/graphs_${g}_$TAG.log" $B27 --skip-peaks --weights int4_g64 \
            --set "xla_gpu_graphs=$G" \
            --batches 1,2 --contexts 1024 --prefill "" --steps 10 --out "/tmp/graphs_${g}_$TAG.json"
          grep -E 'decode' "$OUT/graphs_${g}_$TAG.log" | cut -c1-90 | sed "s/^/$g: /"
        done ;;
      cmdbuf)  # XLA command buffers (CUDA graphs) for the loops too: the idle time between kernels
        XLA_FLAGS="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1" \
          run 160 "$OUT/cmdbuf_$TAG.log" $B27 --skip-peaks --weights int4_g64 --batches 1,2 \
          --contexts 1024 --prefill "" --steps 10 --out "$OUT/cmdbuf_$TAG.json"
        grep -E 'decode' "$OUT/cmdbuf_$TAG.log" | cut -c1-150 ;;
      unroll)  # the block scan unrolled: no while loop, static weight slices
        run 200 "$OUT/unroll_$TAG.log" $B27 --skip-peaks --unroll --weights int4_g64 \
          --batches 1,2 --contexts 1024 --prefill "" --steps 10 --out "$OUT/unroll_$TAG.json"
        grep -E 'decode' "$OUT/unroll_$TAG.log" | cut -c1-150 ;;
      readpat)
        run 180 "$OUT/readpat_$TAG.log" python3 bench/read_patterns.py \
          --out "$OUT/read_patterns_$TAG.json"
        grep -E "copy|stream_h1_u4 grid 8|rows_alu|scale|16-row" "$OUT/readpat_$TAG.log" ;;
      ncusrc)  # where the default wide GEMV's warps wait, instruction by instruction (ncu's
        # warp-state sampling on the SASS page): gate|up, down, in_proj and lm_head at M = 1,
        # three launches each, and the MLP op's two launches three times; the waiting
        # instruction names the load it waits for (codes, scales, x or corr;
        # bench/ncu_source_summary.py)
        XLA_PYTHON_CLIENT_PREALLOCATE=false run 400 "$OUT/ncusrc_$TAG.log" ncu \
          --clock-control none --kernel-name regex:"int4_gemv_wide|int4_mlp" --launch-skip 0 \
          --launch-count 18 --section SourceCounters --section WarpStateStats \
          -f -o "$OUT/ncusrc_$TAG" python3 bench/ncu_gemv.py \
          --shapes "gate|up,down,in_proj,lm_head" --warps "" --mlp
        tail -n 3 "$OUT/ncusrc_$TAG.log"
        run 120 "$OUT/ncusrc_export_$TAG.log" bash -c "ncu --import $OUT/ncusrc_$TAG.ncu-rep \
          --page source --print-source sass --csv > $OUT/ncusrc_$TAG.csv"
        tail -n 3 "$OUT/ncusrc_export_$TAG.log"
        python3 bench/ncu_source_summary.py "$OUT/ncusrc_$TAG.csv" --top 20 \
          | tee "$OUT/ncusrc_summary_$TAG.txt" | cut -c1-150 ;;
      ncu)  # the stall reasons too: the per-issue stall metrics this ncu names (none if its
        # names differ: the sections alone then)
        STALLS=$(ncu --query-metrics 2>/dev/null | awk '{print $1}' \
          | grep -E '^smsp__average_warps_issue_stalled_[a-z_]+_per_issue_active$' \
          | sed 's/$/.ratio/' | paste -sd, -)
        echo "stall metrics: $(echo "$STALLS" | tr ',' '\n' | grep -c . || true)"
        XLA_PYTHON_CLIENT_PREALLOCATE=false run 500 "$OUT/ncu_$TAG.log" bash -c "ncu \
          --clock-control none --kernel-name regex:int4_gemv --launch-skip 0 --launch-count 48 \
          --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
          --section WarpStateStats --section SchedulerStats --section LaunchStats \
          --section ComputeWorkloadAnalysis ${STALLS:+--metrics $STALLS} --csv \
          python3 bench/ncu_gemv.py ${NCU_ARGS:-} > $OUT/ncu_gemv_$TAG.csv"
        tail -n 3 "$OUT/ncu_$TAG.log"
        python3 bench/ncu_summary.py "$OUT/ncu_gemv_$TAG.csv" ;;
      prefill)
        run 300 "$OUT/prefill_$TAG.log" $B27 --weights bf16 --contexts "" \
          --prefill 8192,32768,131072 --prefill-reps 1 --out "$OUT/prefill_$TAG.json"
        grep -E 'prefill' "$OUT/prefill_$TAG.log" | cut -c1-160 ;;
      gdnmicro)  # one GDN layer's prefill: XLA's chunk rule vs the Pallas kernel's scan tiles
        run 240 "$OUT/gdnmicro_$TAG.log" python3 bench/kernels_micro.py --only gdnprefill \
          --out "$OUT/gdn_prefill_micro_$TAG.json"
        grep -E 'gdn prefill' "$OUT/gdnmicro_$TAG.log" | sort -t: -k2 -n | head -8 ;;
      flash)  # one attention layer's causal prefill: flash tiles, the paged kernel, cuDNN
        run 300 "$OUT/flash_$TAG.log" python3 bench/kernels_micro.py --only flash \
          --out "$OUT/attn_prefill_micro_$TAG.json"
        grep -E 'attn prefill' "$OUT/flash_$TAG.log" | cut -c1-150 ;;
      gdnprefill)  # 8K/32K bf16 prefill with plan gdn_prefill=GDN_PREFILL (default pallas), profiled
        run 300 "$OUT/gdnprefill_$TAG.log" $B27 --skip-peaks \
          --set "gdn_prefill=${GDN_PREFILL:-pallas}" \
          --weights bf16 --contexts "" --prefill 8192,32768 --prefill-reps 1 --profile 1 \
          --out "$OUT/gdnprefill_$TAG.json"
        grep -E -A6 'per step|prefill' "$OUT/gdnprefill_$TAG.log" | cut -c1-150 ;;
      l2warm)  # the wide GEMV (M = 1, its default build at 4 and 8 warps) at each decode
        # shape with the calls cycling over 4 layers (the weights come from the HBM) and over
        # 1 (the same layer each call: from L2 where it fits, 60 MB): how much of a call's
        # time the HBM's latency is, and how much the kernel's own cost
        for layers in 4 1; do
          run 150 "$OUT/l2warm_${layers}_$TAG.log" python3 bench/cuda_gemv_micro.py --rows 1 \
            --kernels wide --no-pallas --wide-warps 4,8 \
            --layers "$layers" --shapes 8,6,2,12,10,3,4,11 --kernel-times \
            --out "$OUT/cuda_gemv_micro_l2warm_${layers}_$TAG.json"
          grep -E 'kernel' "$OUT/l2warm_${layers}_$TAG.log" | sed "s/^/layers $layers: /"
        done ;;
      restore)
        OUT="$OUT" BUDGET_S="${RESTORE_BUDGET_S:-540}" run 600 "$OUT/restore_$TAG.log" \
          bash bench/h200_restore.sh ${RESTORE_ARGS:-}
        tail -n 16 "$OUT/restore_$TAG.log" ;;
      startup)  # where a warm start's seconds go: each width's trace / lower / compile, cold
        # and warm cache; the weights' copy against the page-cache and host-to-device rates
        # (bench/startup_micro.py); the checkpoint store's load of a 128K session's 2,048
        # pages against plain reads and sha256 (bench/checkpoint_io_bench.py)
        run 420 "$OUT/startup_$TAG.log" python3 bench/startup_micro.py --work-dir /tmp/r27 \
          --out "$OUT/startup_micro_$TAG.json" --parts "${STARTUP_PARTS:-compile,widths,load}"
        tail -n 45 "$OUT/startup_$TAG.log"
        [ "${STARTUP_CKIO:-1}" = 1 ] && run 240 "$OUT/ckio_$TAG.log" python3 bench/checkpoint_io_bench.py --dir /tmp/ckio \
          --configs 27b:4194304:2048:153944064 --reps 1 --out "$OUT/checkpoint_io_$TAG.json"
        tail -n 25 "$OUT/ckio_$TAG.log" ;;
      *) echo "unknown part $p" ;;
    esac
  done
done
# The device returns only so many files from a call: everything goes back as one tarball
# (PACK=0 leaves the files as they are).
if [ "${PACK:-1}" = 1 ]; then
  kill $DMON 2>/dev/null
  wait $DMON 2>/dev/null
  # a second run under the same TAG in one call packs beside the first, not over it
  PACKED=session_$TAG.tgz
  [ -e "$OUT/$PACKED" ] && PACKED=session_${TAG}_$(date +%H%M%S).tgz
  (cd "$OUT" && ls | grep -v '^session_.*\.tgz$' | tar czf "$PACKED" --remove-files -T -)
  echo "packed: $OUT/$PACKED"
fi
