#!/usr/bin/env bash
# Join this node to a Ray cluster started by recipes/ray_head.sh (run once on every other node).
#
# Usage: recipes/ray_worker.sh --address HEAD_IP:PORT [options]
#
#   --address HOST:PORT  the head's GCS address, as ray_head.sh printed it (required)
#   --node-ip IP         this node's address as the other nodes reach it (default: first of hostname -I)
#   --num-gpus N         GPUs this node offers to Ray (default: nvidia-smi's count)
#   --num-cpus N         CPUs this node offers to Ray (default: Ray's own count)
#   --temp-dir DIR       Ray's session folder (default: Ray's, /tmp/ray; a second node on the head's
#                        machine needs its own)
#   --agent-port N       HTTP port of this node's dashboard agent, through which jobs start (default
#                       Ray's 52365; every Ray node on one machine needs its own)
#   --block              stay in the foreground until Ray stops (containers, SLURM steps)
#   --dry-run            print the commands instead of running them
#   -h, --help           this text
#
# Use the same environment (same install, same paths) as the head and export the same variables
# first (HF_HOME, NCCL_SOCKET_IFNAME, ...): Ray workers inherit the environment of `ray start`.
# Every node must offer the same number of GPUs: verl places trainer.n_gpus_per_node workers on each.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

address=""
node_ip=""
num_gpus=""
num_cpus=""
temp_dir=""
agent_port=""
block=0

while [[ $# -gt 0 ]]; do
  case "$1" in
    --address) need_value "$1" "$#"; address="$2"; shift 2 ;;
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

[[ -n "${address}" ]] || die "--address: required (the head's HOST:PORT, printed by recipes/ray_head.sh)"
[[ "${address}" =~ ^[^:/[:space:]]+:[0-9]+$ ]] || die "--address: expected HOST:PORT of the head's GCS, got '${address}'"
need_port --address "${address##*:}"
need_command ray "install the GPU environment first: pip install -r requirements/gpu.txt"
node_ip="${node_ip:-$(detect_ip)}"
[[ -n "${node_ip}" ]] || die "--node-ip: could not detect this node's address; pass it explicitly"
num_gpus="${num_gpus:-$(detect_gpus)}"

command=(ray start "--address=${address}" "--node-ip-address=${node_ip}" "--num-gpus=${num_gpus}")
[[ -z "${num_cpus}" ]] || command+=("--num-cpus=${num_cpus}")
[[ -z "${temp_dir}" ]] || command+=("--temp-dir=${temp_dir}")
[[ -z "${agent_port}" ]] || command+=("--dashboard-agent-listen-port=${agent_port}")
[[ "${block}" == 0 ]] || command+=(--block)

echo "Ray worker ${node_ip} with ${num_gpus} GPU(s) joining ${address}"
run "${command[@]}"
