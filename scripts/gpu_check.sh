#!/usr/bin/env bash
# GPU acceptance in one command (issue 33). On a GPU machine, from the repository root, with .whl/ built by
# scripts/gpu_wheels.sh carried along:
#
#     bash scripts/gpu_check.sh [REPORT_DIR]          # default: $OUT (the device tool's) or gpu_report/
#
# Installs the carried wheels, then runs `pytest -m "gpu and not vllm"` (tests/test_gpu.py: one RL step of each script
# on CUDA in bf16 and fp32, with and without LoRA; FSDP2 in one process; the toy trained 200 steps; the chunked
# LM-head log-probs against the naive form in bf16), then the realistic-shape benchmark against TRL when TRL is
# there, then the update at real sizes and a whole step of Qwen3-0.6B against TRL (issue 50). Writes
# REPORT_DIR/report.md with the device, each part's result and the figures. GPU_CHECK_TESTS=0 leaves the tests out.
# PYTEST_ADDOPTS="-n 8" spreads the tests over pytest-xdist workers; GPU_CHECK_BENCH_TIMEOUT (s, default 480) bounds
# the benchmark. GPU_CHECK_REHEARSAL=1 runs it all without a GPU: the GPU tests are collected and skipped, the benchmark is not run.
set -uo pipefail
cd "$(dirname "$0")/.."
report=${1:-${OUT:-gpu_report}}
mkdir -p "$report"
md="$report/report.md"
rehearsal=${GPU_CHECK_REHEARSAL:-0}

if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    if [ "$rehearsal" != 1 ]; then
        echo "error: no CUDA device here (torch.cuda.is_available() is False); run this on a GPU machine," \
             "or GPU_CHECK_REHEARSAL=1 to rehearse it on the CPU" >&2
        exit 2
    fi
fi
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    if [ "$rehearsal" = 1 ]; then  # the wheels are for the device's Python 3.12: check they install there, use ours
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --only-binary=:all: \
            --python-version 3.12 --implementation cp --target /tmp/site-rehearsal .whl/*.whl \
            || { echo "error: the carried wheels in .whl/ do not install for Python 3.12" >&2; exit 3; }
    else
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            .whl/*.whl || { echo "error: the carried wheels in .whl/ do not install" >&2; exit 3; }
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    fi
fi
export PYTHONUNBUFFERED=1

{
    echo "# GPU acceptance report"
    echo
    echo "- date: $(date -u +%Y-%m-%dT%H:%MZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    python3 -c "import torch, transformers, accelerate, peft; d = torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none (rehearsal)'; print(f'- device: {d}; torch {torch.__version__}, transformers {transformers.__version__}, accelerate {accelerate.__version__}, peft {peft.__version__}')"
} > "$md"
nvidia-smi > "$report/nvidia-smi.txt" 2>&1 || true

start=$SECONDS
rc=0
if [ "${GPU_CHECK_TESTS:-1}" = 1 ]; then
    python3 -m pytest tests/test_gpu.py -m "gpu and not vllm" -p no:cacheprovider -rs -s --durations=0 \
        --junitxml "$report/junit.xml" > "$report/pytest.log" 2>&1
    rc=$?
    summary=$(tail -n 1 "$report/pytest.log")
    # the chunked head's memory figures are printed (-s), which pytest-xdist workers swallow: that test again, alone
    PYTEST_ADDOPTS= python3 -m pytest tests/test_gpu.py -k chunked -p no:cacheprovider -s -q >> "$report/pytest.log" 2>&1
    {
        echo "- tests/test_gpu.py: exit $rc, $summary ($((SECONDS - start)) s); log: pytest.log, junit.xml"
        grep -oE "V=[0-9]+: peak CUDA memory.*" "$report/pytest.log" | sort -u | sed 's/^/  - /'
        if python3 -c "import vllm" 2>/dev/null; then
            echo "- vLLM is installed: run \`python3 -m pytest -m \"gpu and vllm\"\` too"
        else
            echo "- not run: the vLLM-on-GPU tests (-m \"gpu and vllm\"): vLLM is not installed here and cannot be carried" \
                 "(it brings its own torch)"
        fi
    } >> "$md"
fi

steps=${GPU_CHECK_STEPS:-1}    # 0: leave out the whole steps against TRL (a lease split in two calls)
update=${GPU_CHECK_UPDATE:-1}  # 0: leave out the update's sizes (benchmarks/update_mfu.py); chunk: only the head's
# chunk; 4b: only the Qwen3-4B LoRA update at 16k tokens, its variants; nograd: the 0.6B no-grad pass, two ways (below)
bench=${GPU_CHECK_BENCH:-1}    # 0: leave out the Qwen3-shaped step with TRL's cuDNN attention on (measured 2026-11-26/28)
if [ "$steps" = 1 ] && [ "$bench" = 1 ] && [ "$rehearsal" != 1 ] && python3 -c "import trl" 2>/dev/null; then
    # Qwen3's vocabulary and varied lengths (benchmarks/qwen3_shape.py), in bf16 with a GPU-sized batch; the body
    # stays the shape's small one (hidden 128, 2 layers): the step is dominated by the 151,936-token head
    timeout "${GPU_CHECK_BENCH_TIMEOUT:-480}" python3 benchmarks/step_time.py --shape qwen3 --algo grpo --trl --steps 3 --repeat 1 \
        --output_dir "$report/bench" --out "$report/step_time.json" \
        -- --dtype bfloat16 --batch_size 64 --micro_batch_size 16 > "$report/step_time.txt" 2>&1
    echo "- benchmarks/step_time.py --shape qwen3 --trl: exit $?, see step_time.txt" >> "$md"
elif [ "$steps" = 1 ] && [ "$bench" = 1 ]; then
    echo "- not run: the benchmark against TRL ($([ "$rehearsal" = 1 ] && echo rehearsal || echo 'trl not importable'))" >> "$md"
fi
# Issue 50: the Qwen3-shaped step with cuDNN's attention off in TRL too, with and without --share_prompts, then a
# whole GRPO step of Qwen3-0.6B against TRL's (the longest part, last: GPU_CHECK_BIG_TIMEOUT, s), then the update at
# the sizes users train (Qwen3 with random weights, benchmarks/update_mfu.py). Each part has its own time limit
# (GPU_CHECK_PART_TIMEOUT, s), so a part that does not fit leaves the others their time; GPU_CHECK_STEPS=0 /
# GPU_CHECK_UPDATE=0 split a lease's 600-s calls between the steps and the update.
part=${GPU_CHECK_PART_TIMEOUT:-150}
if [ "$rehearsal" = 1 ]; then
    python3 benchmarks/update_mfu.py --size tiny --device cpu --vocab 512 --dtype float32 --tokens 48 \
        --prompt_tokens 16 --rows 2 --steps 1 --out "$report/update_mfu_tiny.json" > "$report/update_mfu.txt" 2>&1
    echo "- benchmarks/update_mfu.py (rehearsal, tiny on the CPU): exit $?" >> "$md"
else
    if [ "$steps" = 1 ] && python3 -c "import trl" 2>/dev/null; then
        timeout "$part" python3 benchmarks/step_time.py --shape qwen3 --algo grpo --trl --steps 3 --repeat 1 \
            --no_cudnn_sdp --output_dir "$report/bench_nocudnn" --out "$report/step_time_nocudnn.json" \
            -- --dtype bfloat16 --batch_size 64 --micro_batch_size 16 > "$report/step_time_nocudnn.txt" 2>&1
        echo "- step_time.py --shape qwen3 --no_cudnn_sdp against TRL: exit $?, see step_time_nocudnn.txt" >> "$md"
        # the same with each row's whole prompt in one forward (TRL's way): the shared prompts' extra forward costs
        # launches, which a model this small may not earn back in FLOPs
        timeout "$part" python3 benchmarks/step_time.py --shape qwen3 --algo grpo --trl --steps 3 --repeat 1 \
            --no_cudnn_sdp --output_dir "$report/bench_noshare" --out "$report/step_time_noshare.json" \
            -- --dtype bfloat16 --batch_size 64 --micro_batch_size 16 --share_prompts false \
            > "$report/step_time_noshare.txt" 2>&1
        echo "- step_time.py --shape qwen3 --no_cudnn_sdp -- --share_prompts false against TRL: exit $?" >> "$md"
        python3 benchmarks/qwen3_shape.py > /dev/null  # its tokenizer (Qwen3's vocabulary) for the 0.6B model
        timeout "$part" python3 benchmarks/update_mfu.py --size 0.6b --save runs/qwen3_0.6b \
            --tokenizer_from runs/qwen3_shape/model >> "$report/update_mfu.txt" 2>&1
        # cuDNN's attention off on both sides: with it on, TRL's first steps build an execution plan per new shape
        timeout "${GPU_CHECK_BIG_TIMEOUT:-$((2 * part))}" python3 benchmarks/step_time.py --shape qwen3 --algo grpo \
            --trl --steps 3 --repeat 1 --no_cudnn_sdp \
            --output_dir "$report/bench_0.6b" --out "$report/step_time_0.6b.json" \
            -- --model runs/qwen3_0.6b --dtype bfloat16 --batch_size 64 --micro_batch_size 8 \
            --max_completion_length 512 > "$report/step_time_0.6b.txt" 2>&1
        echo "- step_time.py, Qwen3-0.6B (random weights), 64 x 512 tokens, against TRL: exit $?, see step_time_0.6b.txt" >> "$md"
    fi
    # the LM head's chunk at 2^28 elements (1,766 positions of Qwen3's vocabulary) beside the scripts' 2^24 (110)
    specs=("0.6b 0 2048 8 --profile" "4b 16 2048 8 --profile --gradient_checkpointing" "0.6b 0 16384 1"
           "0.6b 0 16384 1 --chunk_elements 268435456" "4b 16 16384 1 --gradient_checkpointing" "1.7b 0 2048 8")
    # chunk: the 4B LoRA update at 16k tokens (issue 50's last target, 5.7k tokens/s on an H100 against prime-rl's
    # 6.2k) with the default chunk and with 2^28, and without gradient checkpointing (which ran out of an H100's
    # 80 GB; an H200 has 141), then the 0.6B pair (measured on an H200 on 2026-11-28)
    [ "$update" = chunk ] && specs=("4b 16 16384 1 --gradient_checkpointing"
        "4b 16 16384 1 --gradient_checkpointing --chunk_elements 268435456" "4b 16 16384 1 --chunk_elements 268435456"
        "0.6b 0 16384 1" "0.6b 0 16384 1 --chunk_elements 268435456")
    # 4b: the same target's variants, each a measure of one cost: every layer recomputed (the H100's setting, with
    # the GPU's idle share), cuDNN's attention on (the scripts turn it off; on rows without padding it is safe), one
    # layer in two recomputed (--gradient_checkpointing_every 2: half the recompute, for half the activations of
    # none), that with the larger chunk, and no recompute at all (out of an H100's memory; an H200 may hold it)
    [ "$update" = 4b ] && specs=("4b 16 16384 1 --gradient_checkpointing --profile"
        "4b 16 16384 1 --gradient_checkpointing --cudnn_sdp"
        "4b 16 16384 1 --gradient_checkpointing --gradient_checkpointing_every 2"
        "4b 16 16384 1 --gradient_checkpointing --gradient_checkpointing_every 2 --chunk_elements 268435456"
        "4b 16 16384 1")
    # nograd: Qwen3-0.6B's no-grad log-prob pass (the reference's), 8 rows of 256 prompt and 512 completion tokens as
    # in the whole step above, the scripts' way and TRL's (the whole logits, a log-softmax a row at a time), profiled
    [ "$update" = nograd ] && specs=("0.6b 0 768 8 --nograd scripts --profile"
        "0.6b 0 768 8 --nograd logits --profile")
    [ "$update" = 0 ] && specs=()
    for spec in "${specs[@]}"; do
        set -- $spec
        chunk=$(echo "$spec" | grep -oE -- "--chunk_elements [0-9]+" | cut -d' ' -f2)
        every=$(echo "$spec" | grep -oE -- "--gradient_checkpointing_every [0-9]+" | cut -d' ' -f2)
        # LoRA without checkpointing is named apart: the same spec with it would write the same file
        nockpt=$([ "$2" != 0 ] && [[ "$spec" != *--gradient_checkpointing* ]] && echo _nockpt)
        cudnn=$([[ "$spec" == *--cudnn_sdp* ]] && echo _cudnn)
        nograd=$(echo "$spec" | grep -oE -- "--nograd [a-z]+" | cut -d' ' -f2)
        name="update_mfu_$1_r$2_$3${chunk:+_chunk$chunk}${every:+_every$every}$nockpt$cudnn${nograd:+_nograd_$nograd}.json"
        timeout "$part" python3 benchmarks/update_mfu.py --size "$1" --lora_r "$2" --tokens "$3" --rows "$4" \
            "${@:5}" --out "$report/$name" >> "$report/update_mfu.txt" 2>&1
        echo "- update_mfu.py --size $1 --lora_r $2 --tokens $3 --rows $4 ${*:5}: exit $?" >> "$md"
    done
    grep -E "^Qwen3-" "$report/update_mfu.txt" 2>/dev/null | sed 's/^/  - /' >> "$md"
fi
cat "$md"
exit $rc
