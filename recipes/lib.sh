# Helpers shared by the recipes/*.sh launch scripts (sourced, never run on its own).
#
# Every script parses its options with these checks, so a bad flag is reported the same way
# everywhere: "<script>: --flag: expected ..., got '...'" on stderr and exit status 2.
# `--dry-run` (DRY_RUN=1) makes `run` print each command, shell-quoted, instead of running it,
# so a launch can be reviewed (and tested) on a machine without Ray, GPUs or network.

RECIPES_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "${RECIPES_DIR}/.." && pwd)"
DRY_RUN="${DRY_RUN:-0}"

# Environment variables a training job needs on every node, forwarded when set where the script
# runs: model/data caches, offline switches, vLLM and NCCL/Gloo networking, log locations.
# Credentials (HF_TOKEN, WANDB_API_KEY) are never forwarded implicitly: pass them with --env.
FORWARDED_ENV=(
  HF_HOME HF_HUB_CACHE HF_DATASETS_CACHE HF_ENDPOINT HF_HUB_OFFLINE TRANSFORMERS_OFFLINE
  VLLM_ATTENTION_BACKEND VLLM_USE_V1 VLLM_LOGGING_LEVEL VLLM_CACHE_ROOT
  NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME NCCL_IB_DISABLE NCCL_IB_HCA NCCL_DEBUG NCCL_P2P_DISABLE
  TENSORBOARD_DIR TOKENIZERS_PARALLELISM CUDA_VISIBLE_DEVICES
)

die() {
  echo "$(basename "$0"): $*" >&2
  exit 2
}

# need_value FLAG "$#" : a flag that takes a value must have one.
need_value() {
  [[ "$2" -ge 2 ]] || die "$1: expected a value"
}

need_int() {
  [[ "$2" =~ ^[0-9]+$ ]] || die "$1: expected a non-negative integer, got '$2'"
}

need_port() {
  need_int "$1" "$2"
  ((10#$2 >= 1 && 10#$2 <= 65535)) || die "$1: expected a port in 1..65535, got '$2'"
}

need_command() {
  if [[ "${DRY_RUN}" != 1 ]] && ! command -v "$1" >/dev/null 2>&1; then
    die "'$1' not found on PATH; $2"
  fi
}

run() {
  if [[ "${DRY_RUN}" == 1 ]]; then
    printf '%q ' "$@"
    echo
  else
    "$@"
  fi
}

# GPUs visible on this node (nvidia-smi's count; 0 without the driver tools).
detect_gpus() {
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true
  else
    echo 0
  fi
}

# This node's address as other nodes reach it: the first of `hostname -I`.
detect_ip() {
  local ips
  ips="$(hostname -I 2>/dev/null || true)"
  echo "${ips%% *}"
}

# Print --help: the comment block under the calling script's shebang, without the '# '.
print_help() {
  awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "$0"
}
