#!/usr/bin/env bash
# Serve a trained model with vLLM's OpenAI-compatible server, for `python -m infmem_verl.eval --endpoint`.
#
# Usage: recipes/serve_vllm.sh MODEL [options] [-- extra vLLM server arguments ...]
#
#   MODEL                     a Hugging Face model folder (e.g. written by python -m infmem_verl.export),
#                             a Hub id, or a verl checkpoint (run folder, global_step_N or its actor/
#                             folder), which is exported to --export-dir first
#   --export-dir DIR          where a checkpoint is exported (default outputs/export/NAME)
#   --name NAME               the served model name clients ask for (default infmem)
#   --host HOST               address to listen on (default 0.0.0.0)
#   --port N                  port (default 8000)
#   --tp N                    tensor-parallel GPUs (default 1)
#   --max-model-len N         context window (default 32768: a 5000-token chunk plus memory and budgets fit)
#   --gpu-memory-utilization F  fraction of GPU memory vLLM may take (default 0.9)
#   --python PY               the interpreter with vLLM installed (default python)
#   --export-python PY        the interpreter with this package and verl, for a checkpoint's export
#                             (default: --python; differs where vLLM has its own environment)
#   --dry-run                 print the commands instead of running them
#   -h, --help                this text
#
# The evaluation sends token ids and reads back token ids (vLLM's return_token_ids), so the server's
# own chat template is never used. For sampled runs that need temperature-scaled log-probs
# (distillation), pass `-- --logprobs-mode processed_logprobs`. Several servers (one per GPU or
# node) can be given to the evaluation as repeated --endpoint flags.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

[[ $# -gt 0 ]] || die "MODEL: required (a Hugging Face folder, a Hub id or a verl checkpoint; see --help)"
case "$1" in -h | --help) print_help; exit 0 ;; esac
model="$1"
shift
export_dir=""
name="infmem"
host="0.0.0.0"
port=8000
tp=1
max_model_len=32768
gpu_memory_utilization=0.9
python="python"
export_python=""

while [[ $# -gt 0 ]]; do
  case "$1" in
    --export-dir) need_value "$1" "$#"; export_dir="$2"; shift 2 ;;
    --name) need_value "$1" "$#"; name="$2"; shift 2 ;;
    --host) need_value "$1" "$#"; host="$2"; shift 2 ;;
    --port) need_value "$1" "$#"; need_port "$1" "$2"; port="$2"; shift 2 ;;
    --tp) need_value "$1" "$#"; need_int "$1" "$2"; tp="$2"; shift 2 ;;
    --max-model-len) need_value "$1" "$#"; need_int "$1" "$2"; max_model_len="$2"; shift 2 ;;
    --gpu-memory-utilization)
      need_value "$1" "$#"
      [[ "$2" =~ ^(0?\.[0-9]+|1(\.0+)?)$ ]] || die "$1: expected a fraction in (0, 1], got '$2'"
      gpu_memory_utilization="$2"; shift 2 ;;
    --python) need_value "$1" "$#"; python="$2"; shift 2 ;;
    --export-python) need_value "$1" "$#"; export_python="$2"; shift 2 ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) print_help; exit 0 ;;
    --) shift; break ;;
    *) die "unknown option '$1'; vLLM's own arguments go after '--' (see --help)" ;;
  esac
done
extra=("$@")
((10#${tp} >= 1)) || die "--tp: expected an integer >= 1, got '${tp}'"
[[ "${name}" =~ ^[A-Za-z0-9_.-]+$ ]] || die "--name: expected letters, digits, '_', '.' or '-', got '${name}'"

# A verl checkpoint has a tracker file or fsdp_config.json somewhere below; a model folder has config.json.
if [[ -d "${model}" && ! -f "${model}/config.json" ]]; then
  export_dir="${export_dir:-${REPO_ROOT}/outputs/export/${name}}"
  echo "Exporting checkpoint ${model} to ${export_dir}"
  run "${export_python:-${python}}" -m infmem_verl.export "${model}" "${export_dir}" --overwrite
  model="${export_dir}"
elif [[ -n "${export_dir}" ]]; then
  die "--export-dir: only used for a verl checkpoint; ${model} is already a model folder or Hub id"
fi

command=(
  "${python}" -m vllm.entrypoints.openai.api_server
  --model "${model}" --served-model-name "${name}"
  --host "${host}" --port "${port}"
  --tensor-parallel-size "${tp}" --max-model-len "${max_model_len}"
  --gpu-memory-utilization "${gpu_memory_utilization}"
  --dtype auto --enable-prefix-caching
  "${extra[@]}"
)
client_host="${host}"
[[ "${client_host}" != 0.0.0.0 ]] || client_host="$(hostname -f 2>/dev/null || echo localhost)"
cat <<EOF
Serving ${model} as '${name}' on ${host}:${port}. Once ready (GET /v1/models answers), evaluate with:
  python -m infmem_verl.eval --endpoint http://${client_host}:${port} --model ${name} --preset reference \\
      --data-dir data/ --datasets hotpotqa --lengths 32k
EOF
run "${command[@]}"
