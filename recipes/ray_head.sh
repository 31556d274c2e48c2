#!/usr/bin/env bash
# Start the Ray head of a training cluster (once, on the first node; it trains too).
#
# Usage: recipes/ray_head.sh [options]
#
#   --port N            GCS port the workers join (default 6379)
#   --dashboard-port N  dashboard and job-submission port for recipes/submit.sh (default 8265)
#   --node-ip IP        this node's address as the other nodes reach it (default: first of hostname -I)
#   --num-gpus N        GPUs this node offers to Ray (default: nvidia-smi's count)
#   --num-cpus N        CPUs this node offers to Ray (default: Ray's own count)
#   --temp-dir DIR      Ray's session folder (default: Ray's, /tmp/ray)
#   --agent-port N      HTTP port of this node's dashboard agent, through which jobs start (default
#                      Ray's 52365; every Ray node on one machine needs its own)
#   --block             stay in the foreground until Ray stops (containers, SLURM steps)
#   --dry-run           print the commands instead of running them
#   -h, --help          this text
#
# Run it in the environment that trains (pip install -r requirements/gpu.txt && pip install -e . --no-deps)
# and export what every process on this node needs first, e.g. HF_HOME on shared storage,
# NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME for the network between nodes: Ray workers inherit the
# environment of `ray start`. Then join the other nodes with recipes/ray_worker.sh and submit a
# recipe with recipes/submit.sh (both commands are printed below). Stop with `ray stop` on each node.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

port=6379
dashboard_port=8265
node_ip=""
num_gpus=""
num_cpus=""
temp_dir=""
agent_port=""
block=0

while [[ $# -gt 0 ]]; do
  case "$1" in
    --port) need_value "$1" "$#"; need_port "$1" "$2"; port="$2"; shift 2 ;;
    --dashboard-port) need_value "$1" "$#"; need_port "$1" "$2"; dashboard_port="$2"; shift 2 ;;
    --node-ip) need_value "$1" "$#"; node_ip="$2"; shift 2 ;;
    --num-gpus) need_value "$1" "$#"; need_int "$1" "$2"; num_gpus="$2"; shift 2 ;;
    --num-cpus) need_value "$1" "$#"; need_int "$1" "$2"; num_cpus="$2"; shift 2 ;;
    --temp-dir) need_value "$1" "$#"; temp_dir="$2"; shift 2 ;;
    --agent-port) need_value "$1" "$#"; need_port "$1" "$2"; agent_port="$2"; shift 2 ;;
    --block) block=1; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    -h | --help) print_help; exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done

[[ "${port}" != "${dashboard_port}" ]] || die "--dashboard-port: must differ from --port (${port})"
need_command ray "install the GPU environment first: pip install -r requirements/gpu.txt"
node_ip="${node_ip:-$(detect_ip)}"
[[ -n "${node_ip}" ]] || die "--node-ip: could not detect this node's address; pass it explicitly"
num_gpus="${num_gpus:-$(detect_gpus)}"
if [[ "${num_gpus}" == 0 ]]; then
  echo "$(basename "$0"): warning: no GPU on this node; GPU recipes need trainer.n_gpus_per_node GPUs on every node" >&2
fi

command=(
  ray start --head
  "--node-ip-address=${node_ip}" "--port=${port}"
  --include-dashboard=true --dashboard-host=0.0.0.0 "--dashboard-port=${dashboard_port}"
  "--num-gpus=${num_gpus}"
)
[[ -z "${num_cpus}" ]] || command+=("--num-cpus=${num_cpus}")
[[ -z "${temp_dir}" ]] || command+=("--temp-dir=${temp_dir}")
[[ -z "${agent_port}" ]] || command+=("--dashboard-agent-listen-port=${agent_port}")
[[ "${block}" == 0 ]] || command+=(--block)

cat <<EOF
Ray head: ${node_ip}:${port} with ${num_gpus} GPU(s); jobs at http://${node_ip}:${dashboard_port}
Join every other node:   recipes/ray_worker.sh --address ${node_ip}:${port}
Check the cluster:       ray status --address ${node_ip}:${port}
Submit a recipe:         recipes/submit.sh --address http://${node_ip}:${dashboard_port} --shared /shared/infmem \\
                           -- +recipe=infmem_4b trainer.nnodes=NODES trainer.n_gpus_per_node=GPUS_PER_NODE
EOF
run "${command[@]}"
