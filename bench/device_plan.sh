#!/usr/bin/env bash
# The GPU measurements still open (issues 46, 47, 49), one part per device call: each part fits one 600 s call,
# every step under its own `timeout` so whatever finished comes back under $OUT even when a later step overruns.
# On the device tool (carry [".devbundle"]):
#     source .devbundle/setup.sh; bash bench/device_plan.sh <part>
# Parts (device seconds, roughly, after the machine's start):
#     46      FP8 against bf16 at the SLO targets, FP8 behind one router process and two                   ~560
#     46v     46 cut short: bf16 and FP8 at 24-36 req/s, the gaps named and the slow collections listed        ~300
#     46w     46v's FP8 half alone at 30 and 36 req/s                                                    ~200
#     46r     FP8 against bf16 at saturation, the least a card needs: FP8 at 36 and 48 req/s, bf16 at 24 and 36 ~330
#     46p     the peers estimate alone: two router processes against one, bf16                              ~180
#     46f     the TTFT error factor held to what recurs: bf16, two router processes, 24-36 req/s             ~80
#     46g     FP8's eager chunk steps: piecewise graphs up to 2,048 tokens against the default 512, step traces  ~420
#     46s     goodput against rate, three policies (SLO, old, prefill-first), one run                       ~480
#     46d     where a P+D pair's TTFT goes on one GPU: the workers' stage means, graphs to 2,048 and 512     ~150
#     46t     where shared token gaps over the target come from (step traces with wall clock), then a P+D pair
#             with the host tier's interruptible page-locking                                             ~420
#     46h     FP8's host stalls: step traces with the host's launch and processing times                 ~250
#     46k     the graphs' limit 2,560 (chunk + decode rows) against 2,048, bf16, step traces              ~150
#     46m     mixed pods and a P+D pair under the ITL target, two workers on one GPU                      ~300
#     46x     46m's mixed pods alone: adaptive placement pricing a chunk by the pod's step model            ~170
#     46j     FP8's shared token gaps at saturation: 46r's FP8 half with step traces, worker logs and clocks ~230
#     47      MLA: the GPU tests, decompressed vs absorbed prefill, the split-KV decode kernel on/off,
#             prompt logprobs' cost at 8k tokens (~330); then `save_jit_cache $OUT` on the same command
#             line (a function of setup.sh's shell: the ragged 192/128 kernel is new), recompressed with
#             `xz -T2 -9e` before it goes over .devbundle/fi-cache.tar.xz (the tree + bundle < 64 MiB)
#     49c     the simulator's calibration on whichever card comes: its microbenchmarks (decode and prefill steps,
#             mixed steps), a step trace at another seed (--chunk-noise), then an aggregated four-rate run to
#             predict (bench/fleet_sim/calibrate.py --card)                                                  ~250
#     49      the planner in dry run beside a P+D pair on one GPU; GPU sharing with overlap             ~520
#     49d     49's dry run alone                                                                          ~320
#     ready   builds the image's 8B kernel set as docker/build_kernels.py does, then the 8B worker's
#             ready time from a fresh start, bf16 and FP8 (issue 49's <= 30 s)                         ~500
# Results land in $OUT; commit what comes back with `git add -f bench/out/...`.
# The bundle (../shared/device/make-bundle.sh) lacks msgspec, and with it the tree passes the 64 MiB a call carries:
# once after making it, `rm .devbundle/wheels/{pyyaml,zipp,gguf}-*.whl` (the device has pyyaml and zipp; nothing
# here imports gguf) and `python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12
# --implementation cp --platform manylinux_2_17_x86_64 -d .devbundle/wheels msgspec==0.19.0`; this script installs it.
# With bench/out's JSONs the tree grew to ~12 MB, and the bundle must stay under ~54.9 MB: also `rm
# .devbundle/redis/redis-cli` and repack .devbundle/nixl.tar.xz without nixl_cu13.libs/ucx/libucx_perftest_* (UCX's
# benchmark modules, never loaded; `xz -T2 -9e`): 54.9 MB in all, measured with `du -sb .devbundle`. Repack with
# `tar cf - .`, never `tar cf - *`: libnixl.so lives in the hidden .nixl_cu13.mesonpy.libs/, and a bundle without it
# fails every worker's start with "libnixl.so: cannot open shared object file".
set -uo pipefail
part=${1:?"part: 46 | 46v | 46w | 46r | 46x | 46j | 46p | 46f | 46s | 46d | 46t | 46h | 46k | 46m | 47 | 49 | 49d | 49c | ready"}
: "${OUT:?the device tool sets OUT}"
mkdir -p "$OUT/logs"
python3 -c "import msgspec" 2>/dev/null ||
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .devbundle/wheels/msgspec-*.whl
# the card names the results (h100 or h200): a call may get either, and numbers compare only on one card
card=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -o -i "h[0-9]\{3\}" | tr "A-Z" "a-z")
card=${card:-gpu}
echo "card: $card"
# the bundle loads before anything runs: a broken one (a repack that lost libnixl.so) otherwise fails every worker's
# start a few seconds in, and the machine goes back 30 s after the call, before a mended bundle can reach it
python3 -c "import nixl_cu13, flashinfer, msgspec" || { echo "the bundle does not load: remake .devbundle"; exit 3; }
leftovers() {  # what an overrun step leaves: its workers run in sessions of their own and may hold the GPU
    pkill -9 -f "common\.cli|multiprocessing|redis-server" 2>/dev/null
    nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | xargs -r kill -9 2>/dev/null
    sleep 2
}
clocks() {  # clocks NAME: the card's clocks, power and load every 200 ms beside a serving step (ITL misses after idle)
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu,temperature.gpu --format=csv \
        -lms 200 >"$OUT/logs/clocks_$1.csv" 2>/dev/null &
    clocks_pid=$!
}
planner_dry_run() {  # 10 GB of KV each: two 8B workers fit an H100's 80 GB too. The run: ~25 s start, ~60 s
    # warm-up and the planner's first window, the load's 165 s, at most 30 s of drain; then the simulator's replay
    step 380 planner_dryrun python3 bench/planner_dryrun.py --model dummy:llama-3.1-8b --gpus 0,0 \
        --worker-env KVFERRY_KV_MEMORY_GB=10 --steps 4:30,24:45,4:90 --prompt-len 1000-3000 --output-len 64-128 \
        --drain-timeout 30 --planner-interval 5 --planner-window 30 --log-dir "$OUT/logs/planner" \
        --out "$OUT/planner_dryrun_${card}.json"
    rm -rf "$OUT/logs/planner/tokenizer"
}
pack_logs() {  # pack_logs DIR NAME: a deployment's logs as one file (at most 8 files come back) and its slow steps
    [ -d "$1" ] || return 0
    [ -n "${clocks_pid:-}" ] && kill "$clocks_pid" 2>/dev/null  # never `kill 0`: that is the whole group
    clocks_pid=
    rm -rf "$1/tokenizer"
    grep -rh 'slow step' "$1" >"$OUT/logs/slow_steps_$2.txt" 2>/dev/null
    tar -C "$(dirname "$1")" -cJf "$OUT/logs_$2.tar.xz" "$(basename "$1")" && rm -rf "$1"
}
step() {  # step SECONDS NAME COMMAND...: runs it with its own limit and says how it ended
    local limit=$1 name=$2
    shift 2
    local t0=$SECONDS
    echo "==> $name (limit ${limit}s)"
    # SIGINT first: Python raises KeyboardInterrupt and the benchmarks' finally blocks stop what they started
    timeout -s INT --kill-after=15 "$limit" "$@" >"$OUT/logs/$name.txt" 2>&1
    local rc=$?
    echo "    $name: rc $rc in $((SECONDS - t0))s"
    tail -n 15 "$OUT/logs/$name.txt"
    leftovers
}
case "$part" in
46)
    # FP8 against bf16 at the SLO targets, and FP8 behind one router process against two. The H100 run at ec88db1
    # (RESULTS.md, "FP8 against bf16 with the router fixed ...") gave 1.41x good/s and each two-process router's TTFT
    # error factor at its 2.0 ceiling, blind to the other's placements; router/decision/peers.py (a7f8917) adds
    # them. Its check: each point's "predictions" line (measured / predicted TTFT by bucket, each process's factor)
    # for two processes should now come near one process's (p99 ~1.1 at 500-1000 ms predicted). FP8's kernels are
    # not in the bundle's cache: ~140 s to compile (with them fi-cache.tar.xz is 15.9 MB, too big for the carry).
    # Each mode's step trace comes back in the logs, and bench/gap_sources.py names each shared gap over the target
    # (its lines in logs/gap_sources_46.txt): after the graphs' 2,560 default there should be no eager launch.
    clocks 46
    step 560 serve_fp8 python3 bench/serve.py --model dummy:llama-3.1-8b --mode agg,agg@fp8,agg@fp8one \
        --variant-env fp8:KVFERRY_WEIGHT_DTYPE=fp8_e4m3 --variant-env fp8:KVFERRY_KV_DTYPE=fp8_e4m3 \
        --variant-env fp8one:KVFERRY_WEIGHT_DTYPE=fp8_e4m3 --variant-env fp8one:KVFERRY_KV_DTYPE=fp8_e4m3 \
        --variant-env fp8one:KVFERRY_ROUTER_WORKERS=1 --worker-env KVFERRY_STEP_TRACE="$OUT/ls/steps_agg.jsonl" \
        --variant-env fp8:KVFERRY_STEP_TRACE="$OUT/ls/steps_fp8.jsonl" \
        --variant-env fp8one:KVFERRY_STEP_TRACE="$OUT/ls/steps_fp8one.jsonl" --gpus 0 --rates 12,24,30,36 --seconds 10 \
        --slo-ttft-ms 1000 --slo-itl-ms 50 --no-plot --log-dir "$OUT/ls" --out "$OUT/serve_fp8_slo10_${card}.json"
    for m in agg fp8 fp8one; do
        mode=agg; [ "$m" = agg ] || mode="agg@$m"
        echo "== $mode" >>"$OUT/logs/gap_sources_46.txt"
        python3 bench/gap_sources.py "$OUT/serve_fp8_slo10_${card}.json" --mode "$mode" \
            --trace "$OUT/ls/steps_$m.jsonl" --logs "$OUT/ls" >>"$OUT/logs/gap_sources_46.txt" 2>&1
    done
    pack_logs "$OUT/ls" 46
    ;;
46v)
    # 46 cut to what its misses need, for a short device budget: bf16 and FP8 (two router processes) at 24-36 req/s,
    # after prompts became tuples and full collections were spaced out (router and worker HTTP processes: their
    # 21-64 ms gen-2 collections matched the shared gaps over the target that the engine's trace did not explain) ~300
    clocks 46v
    step 400 serve_fp8v python3 bench/serve.py --model dummy:llama-3.1-8b --mode agg,agg@fp8 \
        --variant-env fp8:KVFERRY_WEIGHT_DTYPE=fp8_e4m3 --variant-env fp8:KVFERRY_KV_DTYPE=fp8_e4m3 \
        --variant-env fp8:KVFERRY_STEP_TRACE="$OUT/lv/steps_fp8.jsonl" --gpus 0 --rates 24,30,36 --seconds 10 \
        --slo-ttft-ms 1000 --slo-itl-ms 50 --no-plot --log-dir "$OUT/lv" --out "$OUT/serve_fp8v_${card}.json"
    python3 bench/gap_sources.py "$OUT/serve_fp8v_${card}.json" --mode agg@fp8 --trace "$OUT/lv/steps_fp8.jsonl" \
        --logs "$OUT/lv" >"$OUT/logs/gap_sources_46v.txt" 2>&1
    grep -rh "slow garbage" "$OUT/lv" >"$OUT/logs/slow_gc_46v.txt" 2>/dev/null
    pack_logs "$OUT/lv" 46v
    ;;
46w)
    # 46v's FP8 half alone, at the rates where its admitted requests missed (30 and 36 req/s)                  ~200
    step 260 serve_fp8w python3 bench/serve.py --model dummy:llama-3.1-8b --mode agg@fp8 \
        --variant-env fp8:KVFERRY_WEIGHT_DTYPE=fp8_e4m3 --variant-env fp8:KVFERRY_KV_DTYPE=fp8_e4m3 \
        --gpus 0 --rates 30,36 --seconds 10 --slo-ttft-ms 1000 --slo-itl-ms 50 --no-plot --log-dir "$OUT/lw" \
        --out "$OUT/serve_fp8w_${card}.json"
    grep -rh "slow garbage" "$OUT/lw" >"$OUT/logs/slow_gc_46w.txt" 2>/dev/null
    rm -rf "$OUT/lw/tokenizer"
    ;;
46r)
    # FP8 / bf16 goodput at saturation on whichever card comes (the H200's is the issue's; the H100 gave 1.79x at 36
    # req/s, both saturated there; the H200 at 4870c94 1.69x, 23.28 / 13.79 good req/s at 48 / 36): each dtype at
    # its saturation and past it, on one warm machine                                                  ~330
    step 230 serve_fp8r python3 bench/serve.py --model dummy:llama-3.1-8b --mode agg@fp8 \
        --variant-env fp8:KVFERRY_WEIGHT_DTYPE=fp8_e4m3 --variant-env fp8:KVFERRY_KV_DTYPE=fp8_e4m3 \
        --gpus 0 --rates 36,48 --seconds 10 --slo-ttft-ms 1000 --slo-itl-ms 50 --no-plot \
        --out "$OUT/serve_fp8r_${card}.json"
    step 150 serve_bf16r python3 bench/serve.py --model dummy:llama-3.1-8b --mode agg --gpus 0 --rates 24,36 \
        --seconds 10 --slo-ttft-ms 1000 --slo-itl-ms 50 --no-plot --out "$OUT/serve_bf16r_${card}.json"
    ;;
46j)
    # 46r's FP8 half traced: on the H200 at 4870c94 one ~77 ms gap shared by ~200 streams came ~7.9 s into both
    # points (36 and 48 req/s), and with outputs of 64-512 tokens it put 10% of 36's admitted requests past 50 ms
    # at p99; the client's loop was quiet (max 20 ms): the gaps are named against the engine's steps and the
    # router's and worker's slow collections. Since 028a426 the GPU warm-up ends with every slot decoding beside a
    # prompt (the suspect: the caching allocator's retries as eager LM-head logits grew with the batch): each point's
    # `alloc_retries` should stay 0 and no gap over 50 ms shared by ~200 streams should come ~8 s in       ~230
    clocks 46j
    step 300 serve_fp8j python3 bench/serve.py --model dummy:llama-3.1-8b --mode agg@fp8 \
        --variant-env fp8:KVFERRY_WEIGHT_DTYPE=fp8_e4m3 --variant-env fp8:KVFERRY_KV_DTYPE=fp8_e4m3 \
        --variant-env fp8:KVFERRY_STEP_TRACE="$OUT/lj/steps_fp8.jsonl" --gpus 0 --rates 36,48 --seconds 10 \
        --slo-ttft-ms 1000 --slo-itl-ms 50 --no-plot --log-dir "$OUT/lj" --out "$OUT/serve_fp8j_${card}.json"
    python3 bench/gap_sources.py "$OUT/serve_fp8j_${card}.json" --mode agg@fp8 --trace "$OUT/lj/steps_fp8.jsonl" \
        --logs "$OUT/lj" >"$OUT/logs/gap_sources_46j.txt" 2>&1
    grep -rh "slow garbage" "$OUT/lj" >"$OUT/logs/slow_gc_46j.txt" 2>/dev/null
    pack_logs "$OUT/lj" 46j
    ;;
46p)
    # the peers estimate alone, bf16 (no FP8 compile): two router processes against one at and past saturation. The
    # H100 at 45ad456, before the estimate: two processes' measured / predicted TTFT p99 1.47-1.77 at 250-1000 ms
    # predicted, one process's 0.97-1.12 (RESULTS.md, "FP8 against bf16 with the router fixed ...")          ~180
    clocks 46p
    step 300 serve_peers python3 bench/serve.py --model dummy:llama-3.1-8b --mode agg,agg@one \
        --variant-env one:KVFERRY_ROUTER_WORKERS=1 --gpus 0 --rates 24,36 --seconds 10 --slo-ttft-ms 1000 \
        --slo-itl-ms 50 --no-plot --log-dir "$OUT/lp" --out "$OUT/serve_peers_${card}.json"
    pack_logs "$OUT/lp" 46p
    ;;
46f)
    # the TTFT error factor held to what recurs (router/decision/ttft_error.py, 147931c): bf16, two router processes,
    # at and past saturation; the H100 at 6223328 read factors of 1.4-2.0 here (serve_fp8_slo10_h100.json.xz)    ~80
    clocks 46f
    step 150 serve_factor python3 bench/serve.py --model dummy:llama-3.1-8b --mode agg --gpus 0 --rates 24,30,36 \
        --seconds 10 --slo-ttft-ms 1000 --slo-itl-ms 50 --no-plot --log-dir "$OUT/lf" --out "$OUT/serve_factor_${card}.json"
    pack_logs "$OUT/lf" 46f
    ;;
46g)
    # The H200 at 79b9cd4 (serve_fp8_slo10_h200.json): FP8's trim at its 0.6 floor and FP8 / bf16 goodput 1.06x. In the
    # step traces of run C, FP8 chunk steps of 512-1,536 tokens (eager: over KVFERRY_CUDA_GRAPH_MAX_TOKENS) ran up to
    # 29 ms past the model (p90 +12-14 ms; bf16's +2-3.5 ms): an eager 8B forward is ~15 ms of launches from the host,
    # which FP8's shorter kernels no longer hide. The same rates with the piecewise graphs to 2,048 tokens.
    clocks 46g
    step 520 serve_graphs python3 bench/serve.py --model dummy:llama-3.1-8b --mode agg,agg@fp8,agg@fp8g,agg@g \
        --variant-env fp8:KVFERRY_WEIGHT_DTYPE=fp8_e4m3 --variant-env fp8:KVFERRY_KV_DTYPE=fp8_e4m3 \
        --variant-env fp8g:KVFERRY_WEIGHT_DTYPE=fp8_e4m3 --variant-env fp8g:KVFERRY_KV_DTYPE=fp8_e4m3 \
        --variant-env fp8g:KVFERRY_CUDA_GRAPH_MAX_TOKENS=2048 --variant-env g:KVFERRY_CUDA_GRAPH_MAX_TOKENS=2048 \
        --variant-env fp8:KVFERRY_STEP_TRACE="$OUT/ls/steps_fp8.jsonl" \
        --variant-env fp8g:KVFERRY_STEP_TRACE="$OUT/ls/steps_fp8g.jsonl" \
        --gpus 0 --rates 24,32 --seconds 10 --slo-ttft-ms 1000 --slo-itl-ms 50 --no-plot --log-dir "$OUT/ls" \
        --out "$OUT/serve_graphs_${card}.json"
    pack_logs "$OUT/ls" 46g
    ;;
46s)
    # goodput against rate for the three policies in one run on the current engine (graphs to 2,048, the error factor
    # held to what recurs): the SLO default, the old 2x-decode-step target without TTFT admission, prefill-first.
    # The H200 at 2026-12-04 (RESULTS.md, "Goodput against rate for three policies, one run") is the one before.  ~480
    clocks 46s
    step 540 serve_sweep python3 bench/serve.py --model dummy:llama-3.1-8b --mode agg,agg@old,agg@pf --gpus 0 \
        --rates 6,10,12,18,24,36 --num 100 --slo-ttft-ms 1000 --slo-itl-ms 50 --no-plot \
        --variant-env old:KVFERRY_ITL_TARGET_MS=auto --variant-env old:KVFERRY_ROUTER_ADMIT_BY_TTFT=0 \
        --variant-env pf:KVFERRY_ITL_TARGET_MS=0 --variant-env pf:KVFERRY_ROUTER_ADMIT_BY_TTFT=0 \
        --log-dir "$OUT/lw" --out "$OUT/serve_goodput_sweep3_${card}.json"
    pack_logs "$OUT/lw" 46s
    ;;
46d)
    # where a P+D pair's TTFT goes on one GPU: the workers' stage means per point (bench/serve_phases.py). The H100's
    # pair at 3 req/s measured 149 ms TTFT p50 where the simulator gives 114 with its hop and copy (RESULTS.md,
    # 2026-12-06 third session); graphs to 512 beside the default 2,048 in case the prefill worker's steps differ  ~150
    step 260 serve_pd_phases python3 bench/serve.py --model dummy:llama-3.1-8b --mode disagg,disagg@g512 --gpus 0,0 \
        --variant-env g512:KVFERRY_CUDA_GRAPH_MAX_TOKENS=512 --worker-env KVFERRY_KV_MEMORY_GB=20 --rates 3,6 \
        --seconds 10 --slo-ttft-ms 1000 --slo-itl-ms 50 --no-plot --out "$OUT/serve_pd_phases_${card}.json"
    ;;
46t)
    # where the token gaps over the ITL target come from: the H100 at 0398d56 (serve_fp8_slo10_h100.json.xz) saw one
    # or two gaps of 57-82 ms per point that every running request shared, with no slow step in the engine's log,
    # no client lag and no burst downstream. Step traces with wall-clock stamps ("t") beside each point's
    # started_at line them up with the requests' max_gap_end_ms; the worker's HTTP process now logs its slow
    # garbage collections. Then 46d's pair again with the host tier locked in interruptible 32 MiB pieces.  ~420
    clocks 46t
    step 330 serve_gaps python3 bench/serve.py --model dummy:llama-3.1-8b --mode agg,agg@fp8 \
        --variant-env fp8:KVFERRY_WEIGHT_DTYPE=fp8_e4m3 --variant-env fp8:KVFERRY_KV_DTYPE=fp8_e4m3 \
        --worker-env KVFERRY_STEP_TRACE="$OUT/lt/steps_bf16.jsonl" \
        --variant-env fp8:KVFERRY_STEP_TRACE="$OUT/lt/steps_fp8.jsonl" --gpus 0 --rates 12,24,30 --seconds 10 \
        --slo-ttft-ms 1000 --slo-itl-ms 50 --no-plot --log-dir "$OUT/lt" --out "$OUT/serve_gaps_${card}.json"
    pack_logs "$OUT/lt" 46t
    step 200 serve_pd_lock python3 bench/serve.py --model dummy:llama-3.1-8b --mode disagg --gpus 0,0 \
        --worker-env KVFERRY_KV_MEMORY_GB=20 --rates 3,6 --seconds 10 --slo-ttft-ms 1000 --slo-itl-ms 50 --no-plot \
        --log-dir "$OUT/lq" --out "$OUT/serve_pd_lock_${card}.json"
    pack_logs "$OUT/lq" 46q
    ;;
46h)
    # FP8's host stalls: in 46t's trace (H100, 990af39) 102 of 4,155 FP8 steps had 10-32 ms of host time past the
    # device's (bf16: 1 of 2,963), mostly around a request's arrival. Step traces now split the host's share
    # (launch_host_s: planning and launching the step; process_host_s: handing on the step before's tokens). At
    # e90857a mixed steps' launches took 11 ms at p50 and 21-44 ms before a ~2,048-token chunk: the engine's stacks
    # sampled (KVFERRY_STACK_SAMPLES) say where.                                                                ~250
    clocks 46h
    step 330 serve_host python3 bench/serve.py --model dummy:llama-3.1-8b --mode agg@fp8 \
        --variant-env fp8:KVFERRY_WEIGHT_DTYPE=fp8_e4m3 --variant-env fp8:KVFERRY_KV_DTYPE=fp8_e4m3 \
        --variant-env fp8:KVFERRY_STEP_TRACE="$OUT/lh/steps_fp8.jsonl" \
        --variant-env fp8:KVFERRY_STACK_SAMPLES="$OUT/lh/stacks_fp8.txt" --gpus 0 --rates 24,30 --seconds 10 \
        --slo-ttft-ms 1000 --slo-itl-ms 50 --no-plot --log-dir "$OUT/lh" --out "$OUT/serve_host_${card}.json"
    pack_logs "$OUT/lh" 46h
    ;;
46k)
    # the piecewise graphs' new default limit (2,560: the 2,048-token chunk with decode rows beside it) against the
    # old 2,048, bf16 (no FP8 compile): step traces' launch_host_s for mixed steps of a full chunk           ~150
    clocks 46k
    step 200 serve_graph_rows python3 bench/serve.py --model dummy:llama-3.1-8b --mode agg,agg@g2048 \
        --variant-env g2048:KVFERRY_CUDA_GRAPH_MAX_TOKENS=2048 --worker-env KVFERRY_STEP_TRACE="$OUT/lk/steps_g2560.jsonl" \
        --variant-env g2048:KVFERRY_STEP_TRACE="$OUT/lk/steps_g2048.jsonl" --gpus 0 --rates 24,30 --seconds 10 \
        --slo-ttft-ms 1000 --slo-itl-ms 50 --no-plot --log-dir "$OUT/lk" --out "$OUT/serve_graph_rows_${card}.json"
    pack_logs "$OUT/lk" 46k
    ;;
46m)
    # mixed pods and a disaggregated pair under the ITL target (issue 46: "hold the same ITL target"), two workers
    # on the one GPU, 20 GB of KV each                                                                       ~300
    step 330 serve_mixed python3 bench/serve.py --model dummy:llama-3.1-8b --mode mixed,disagg --gpus 0,0 \
        --worker-env KVFERRY_KV_MEMORY_GB=20 --rates 3,6,9,12 --seconds 10 --slo-ttft-ms 1000 --slo-itl-ms 50 \
        --no-plot --log-dir "$OUT/logs/mixed" --out "$OUT/serve_mixed_slo_${card}.json"
    rm -rf "$OUT/logs/mixed/tokenizer"
    ;;
46x)
    # 46m's mixed half: two mixed pods on the one GPU, adaptive placement (the H100's run before 8fdc92d kept ~50%
    # of prompts local, its TTFT p50 188 / 211 / 209 / 257 ms; the simulator predicts 152 / 141 / 161 / 220)  ~170
    step 220 serve_mixed python3 bench/serve.py --model dummy:llama-3.1-8b --mode mixed --gpus 0,0 \
        --worker-env KVFERRY_KV_MEMORY_GB=20 --rates 3,6,9,12 --seconds 10 --slo-ttft-ms 1000 --slo-itl-ms 50 \
        --no-plot --out "$OUT/serve_mixed_placed_${card}.json"
    ;;
47)
    step 180 gpu_tests_mla python3 -m pytest -q -p no:cacheprovider tests/test_gpu_path.py tests/test_gpu_kernels.py \
        -k "mla or latent"
    step 120 mla_quick python3 bench/mla.py --quick --out "$OUT/mla_quick_${card}.json"
    step 90 mla_quick_no_small python3 bench/mla.py --quick --small-kernel off --out "$OUT/mla_quick_nosmall_${card}.json"
    step 90 prompt_logprobs python3 bench/prompt_logprobs.py --model dummy:llama-3.1-8b --device cuda \
        --prompt-tokens 8192 --chunk 2048 --out "$OUT/prompt_logprobs_${card}.json"
    ;;
49d)
    # 49's dry run alone: the planner at the current code (the H100's run at ec88db1 matched 0.818, but the planner
    # then sized past saturation for refused requests twice; today's planner replayed on it matches 0.242)   ~320
    planner_dry_run
    ;;
49)
    planner_dry_run
    step 60 gpu_share_overlap python3 bench/gpu_share.py --overlap --out "$OUT/gpu_share_overlap_${card}.json"
    step 60 gpu_share_overlap_gap python3 bench/gpu_share.py --overlap --prefill-gap-ms 100 \
        --out "$OUT/gpu_share_overlap_gap100_${card}.json"
    ;;
49c)
    # What bench/fleet_sim/calibrate.py --card CARD reads: the engine's steps by shape on this card (roofline decode and
    # prefill, mixed steps with graphs), then the aggregated run it predicts, 120 requests a rate from 1/4 of the
    # card's bf16 saturation to saturation (~12 req/s on the H100: RESULTS.md, 2026-12-06; ~24 on the H200). 40 GB
    # of KV each: the H100's 80 GB holds it beside the 16 GB of weights, and the run records the pool's size. Commit
    # the three under a dated card label (roofline_h200-20261206.json, ...; `calibrate.py --card h200-20261206`): the
    # plain H200 names are the microbenchmarks the simulator's standing calibration reads.
    step 150 roofline python3 bench/roofline.py --sections decode,prefill --quick --kv-gb 40 --out "$OUT/roofline_${card}.json"
    step 150 mixed_step python3 bench/mixed_step.py --batches 1,8,32,64 --chunks 64,256,512,1024 --iters 8 --kv-gb 40 \
        --no-offline --out "$OUT/mixed_step_${card}_graphs.json"
    rates=3,6,9,12
    [ "$card" = h200 ] && rates=6,12,18,24
    # the chunk steps' measured errors for `calibrate.py --chunk-noise`: a step trace of this engine on this card, at
    # another seed than the run it predicts (it lands in the logs' tarball: logs_49c.tar.xz, lc/steps_trace.jsonl)
    step 120 serve_trace python3 bench/serve.py --model dummy:llama-3.1-8b --mode agg --gpus 0 --rates ${rates#*,} \
        --num 120 --seed 1 --worker-env KVFERRY_KV_MEMORY_GB=40 --worker-env KVFERRY_STEP_TRACE="$OUT/lc/steps_trace.jsonl" \
        --slo-ttft-ms 1000 --slo-itl-ms 50 --no-plot --log-dir "$OUT/lc/trace" --out "$OUT/lc/serve_trace.json"
    step 240 serve_calib python3 bench/serve.py --model dummy:llama-3.1-8b --mode agg --gpus 0 --rates $rates --num 120 \
        --worker-env KVFERRY_KV_MEMORY_GB=40 --slo-ttft-ms 1000 --slo-itl-ms 50 --no-plot --log-dir "$OUT/lc" \
        --out "$OUT/serve_agg_calib_${card}.json"
    pack_logs "$OUT/lc" 49c
    ;;
ready)
    step 400 build_kernels python3 bench/worker_ready.py --build-kernels --archs 9.0a --head-dims 128 --mla ""
    step 150 worker_ready python3 bench/worker_ready.py --model dummy:llama-3.1-8b --variants bf16,fp8 \
        --logs "$OUT/logs/ready" --out "$OUT/worker_ready_${card}.json"
    ;;
*)
    echo "unknown part $part (46 | 46p | 46f | 46s | 46d | 46m | 47 | 49 | 49c | ready)" >&2
    exit 2
    ;;
esac
