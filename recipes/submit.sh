#!/usr/bin/env bash
# Submit a training recipe to a Ray cluster as a Ray job, with the runtime environment it needs.
#
# Usage: recipes/submit.sh [options] -- +recipe=NAME [hydra overrides ...]
#
#   --address URL     the head's job server (default: $RAY_ADDRESS, else http://127.0.0.1:8265)
#   --shared DIR      shared storage, mounted at the same path on every node: checkpoints go to
#                     DIR/checkpoints/RUN, TensorBoard logs and the run summary to
#                     DIR/tensorboard/RUN, and HF_HOME defaults to DIR/hf (models download once)
#   --name RUN        run name for those folders and the submission id (default: the recipe's name)
#   --env KEY=VALUE   an environment variable for every process of the job (repeatable)
#   --pip SPEC        a pip requirement for the job's runtime environment (repeatable; Ray installs
#                     it into a per-job virtualenv on every node, so prefer installing on the nodes)
#   --no-upload       run the infmem_verl installed on the nodes instead of uploading this checkout
#   --no-wait         return once submitted (then: ray job logs --follow SUBMISSION_ID)
#   --dry-run         print the runtime environment and the command, submit nothing
#   -h, --help        this text
#
# The job runs `python -m infmem_verl.main` with the arguments after `--`. This checkout is
# uploaded as the job's working directory (without virtualenvs, data, outputs or checkpoints), and
# VERL_USE_EXTERNAL_MODULES=infmem_verl.plugin makes every verl process on every node register our
# agent loops, reward manager and trainer modes. The variables listed in recipes/lib.sh (HF_HOME,
# NCCL_SOCKET_IFNAME, VLLM_*, ...) are forwarded when set here. The working directory is a copy on
# each node, so data files must be absolute paths on shared storage, and checkpoints must go there
# too (--shared, or trainer.default_local_dir=...): every node writes its shards of them. A run that
# saves or resumes with a relative trainer.default_local_dir stops inside the job before anything
# starts (infmem_verl/preflight.py resolve_paths).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

PYTHON="${PYTHON:-python3}"
address="${RAY_ADDRESS:-http://127.0.0.1:8265}"
shared=""
name=""
upload=1
wait=1
envs=()
pips=()

while [[ $# -gt 0 ]]; do
  case "$1" in
    --address) need_value "$1" "$#"; address="$2"; shift 2 ;;
    --shared) need_value "$1" "$#"; shared="$2"; shift 2 ;;
    --name) need_value "$1" "$#"; name="$2"; shift 2 ;;
    --env) need_value "$1" "$#"; envs+=("$2"); shift 2 ;;
    --pip) need_value "$1" "$#"; pips+=("$2"); shift 2 ;;
    --no-upload) upload=0; shift ;;
    --no-wait) wait=0; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) print_help; exit 0 ;;
    --) shift; break ;;
    *) die "unknown option '$1'; the training arguments go after '--' (see --help)" ;;
  esac
done
overrides=("$@")

recipe=""
user_ckpt_dir=0
for arg in "${overrides[@]}"; do
  case "${arg}" in
    +recipe=*) recipe="${arg#+recipe=}" ;;
    recipe=*) die "'${arg}': a recipe is appended to the defaults, write +${arg}" ;;
    trainer.default_local_dir=*) user_ckpt_dir=1 ;;
  esac
done
[[ -n "${recipe}" ]] || die "no recipe: pass the training arguments after '--', starting with +recipe=NAME (e.g. +recipe=infmem_4b)"
name="${name:-${recipe}}"
[[ "${name}" =~ ^[A-Za-z0-9_.-]+$ ]] || die "--name: expected letters, digits, '_', '.' or '-', got '${name}'"
[[ "${address}" =~ ^https?://[^/[:space:]]+$ ]] || die "--address: expected the job server's URL http://HOST:PORT, got '${address}'"
for pair in "${envs[@]}"; do
  [[ "${pair}" =~ ^[A-Za-z_][A-Za-z0-9_]*= ]] || die "--env: expected KEY=VALUE, got '${pair}'"
done

if [[ -n "${shared}" ]]; then
  [[ "${shared}" == /* ]] || die "--shared: expected an absolute path (the same on every node), got '${shared}'"
  [[ "${user_ckpt_dir}" == 1 ]] || overrides+=("trainer.default_local_dir=${shared}/checkpoints/${name}")
  # Defaults first: an explicit --env or an exported variable of the same name wins.
  [[ -n "${TENSORBOARD_DIR:-}" ]] || envs=("TENSORBOARD_DIR=${shared}/tensorboard/${name}" "${envs[@]}")
  [[ -n "${HF_HOME:-}" ]] || envs=("HF_HOME=${shared}/hf" "${envs[@]}")
fi

# The runtime environment as JSON: forwarded variables, then --env (later wins), our plugin module,
# the uploaded checkout and any pip requirements.
forwarded=()
for key in "${FORWARDED_ENV[@]}"; do
  [[ -z "${!key:-}" ]] || forwarded+=("${key}=${!key}")
done
runtime_env="$(
  "${PYTHON}" - "${upload}" "${REPO_ROOT}" "${#forwarded[@]}" "${forwarded[@]}" "${#envs[@]}" "${envs[@]}" "${pips[@]}" <<'PY'
import json
import sys

args = sys.argv[1:]
upload, repo = args[0] == "1", args[1]
n_forwarded = int(args[2])
forwarded = args[3 : 3 + n_forwarded]
rest = args[3 + n_forwarded :]
n_envs = int(rest[0])
envs, pips = rest[1 : 1 + n_envs], rest[1 + n_envs :]
env_vars = dict(pair.split("=", 1) for pair in [*forwarded, *envs])
env_vars.setdefault("VERL_USE_EXTERNAL_MODULES", "infmem_verl.plugin")
runtime_env = {"env_vars": env_vars}
if upload:
    runtime_env["working_dir"] = repo
    runtime_env["excludes"] = [
        ".git/", "/.venv*/", "/data/", "/outputs/", "/runs/", "/checkpoints/", "/tensorboard_log/",
        "*.parquet", "*.safetensors", "*.pt", "*.egg-info/",
    ]
if pips:
    runtime_env["pip"] = pips
print(json.dumps(runtime_env, sort_keys=True))
PY
)"

submission_id="${name}-$(date +%Y%m%d-%H%M%S)"
command=(ray job submit "--address=${address}" "--submission-id=${submission_id}" "--runtime-env-json=${runtime_env}")
[[ "${wait}" == 1 ]] || command+=(--no-wait)
command+=(-- python -m infmem_verl.main "${overrides[@]}")

need_command ray "install the training environment first: pip install -r requirements/gpu.txt"
echo "Submitting ${submission_id} to ${address}"
run "${command[@]}"
if [[ "${wait}" == 0 && "${DRY_RUN}" != 1 ]]; then
  echo "Follow it with: ray job logs --address=${address} --follow ${submission_id}"
fi
