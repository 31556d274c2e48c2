"""Reward components on worked trajectories, and the ``infmem`` reward manager inside verl's code.

Component tests build :class:`TrajectoryRecord` s by hand. Manager tests build verl
``AgentLoopOutput`` s by hand (real Qwen3 token ids) and score them through verl's own
``AgentLoopWorker._compute_score`` (which assembles the trajectory ``DataProto`` exactly as in
training) and a real, in-process ``RewardLoopWorker`` loading our manager from the config.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf
from hydra import compose, initialize_config_dir
from infmem_verl import conf_dir
from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput, AgentLoopWorker
from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

from infmem_verl.agent.errors import ConfigError
from infmem_verl.agent.trajectory import (
    FLAG_INVALID_ACTION,
    FLAG_MEMORY_TRUNCATED,
    FLAG_THINK_CLOSED_BY_LOOP,
)
from infmem_verl.reward.components import (
    TrajectoryRecord,
    breaks_protocol,
    early_stop,
    load_components,
    outcome,
    protocol,
)
from infmem_verl.agent.facts import TurnFacts


def infmem_turns(
    memories: list[str],
    *,
    num_chunks: int,
    stopped: bool,
    prediction: str | None,
    invalid_prethink: int | None = None,
    write_flags: dict[int, list[str]] | None = None,
) -> list[TurnFacts]:
    """The turns of an InfMem trajectory: PreThink + Write per chunk read, a stopping PreThink, Answer.

    ``memories[i]`` is the memory after Write ``i``; ``stopped`` adds the PreThink that stopped
    right after the last Write (stop step = number of Writes).
    """
    reads = len(memories)
    stop_step = reads if stopped else None
    common = dict(agent="infmem", num_chunks=num_chunks, stop_step=stop_step)
    turns: list[TurnFacts] = []
    for chunk, memory in enumerate(memories):
        bad = chunk == invalid_prethink
        turns.append(
            TurnFacts(
                turn_index=len(turns),
                turn_kind="prethink",
                chunk_index=chunk,
                valid=not bad,
                flags=[FLAG_INVALID_ACTION] if bad else [],
                action="continue" if bad else "retrieve",
                **common,
            )
        )
        turns.append(
            TurnFacts(
                turn_index=len(turns),
                turn_kind="write",
                chunk_index=chunk,
                valid=True,
                flags=list((write_flags or {}).get(chunk, [])),
                memory_text=memory,
                memory_tokens=len(memory.split()),
                **common,
            )
        )
    if stopped:
        turns.append(
            TurnFacts(
                turn_index=len(turns), turn_kind="prethink", chunk_index=reads, valid=True, action="stop", **common
            )
        )
    turns.append(
        TurnFacts(
            turn_index=len(turns),
            turn_kind="answer",
            chunk_index=reads,
            valid=prediction is not None,
            prediction=prediction,
            **common,
        )
    )
    return turns


CORRECT = object()  # record(): the final answer is the first gold


def record(memories, golds, *, num_chunks=6, stopped=True, prediction=CORRECT, **kw) -> TrajectoryRecord:
    prediction = golds[0] if prediction is CORRECT else prediction
    turns = infmem_turns(memories, num_chunks=num_chunks, stopped=stopped, prediction=prediction, **kw)
    return TrajectoryRecord(turns=turns, golds=golds)


# ----------------------------------------------------------------------------------- outcome


@pytest.mark.parametrize(
    "prediction, metric, expected",
    [
        ("Paris", "em", 1.0),
        ("the Paris.", "em", 1.0),  # SQuAD normalization: articles and punctuation
        ("Lyon", "em", 0.0),
        (None, "em", 0.0),  # no boxed answer
        ("Paris France", "f1", 2 / 3),  # precision 1/2, recall 1
        ("Paris France", "sub_em", 1.0),
        ("Paris France", "em", 0.0),
    ],
)
def test_outcome_scores_the_boxed_answer_against_all_golds(prediction, metric, expected):
    rec = record(["x"], ["Lutetia", "Paris"], prediction=prediction)
    assert outcome(rec, metric=metric) == pytest.approx(expected)


def test_outcome_rejects_an_unknown_metric():
    with pytest.raises(ValueError, match="metric"):
        outcome(record(["x"], ["Paris"], prediction="Paris"), metric="bleu")


# -------------------------------------------------------------------------------- early stop


def test_early_stop_right_after_the_answer_entered_memory_scores_one():
    rec = record(["nothing yet", "the capital is Paris"], ["Paris"], prediction="Paris")
    assert early_stop(rec) == 1.0  # found at Write 1, stopped with 2 Writes: d = 1


def test_early_stop_decays_with_each_extra_chunk_read():
    memories = ["Paris is the answer", "Paris still", "Paris again"]
    assert early_stop(record(memories, ["Paris"])) == pytest.approx(0.36)  # d = 3 - 0
    assert early_stop(record(memories, ["Paris"]), gamma=0.5) == pytest.approx(0.25)


def test_answer_found_in_the_first_write_is_not_mistaken_for_never_found():
    # The reference used found_step == 0 as its "never found" sentinel.
    assert early_stop(record(["Paris"], ["Paris"])) == 1.0


def test_early_stop_is_zero_when_the_answer_never_entered_memory():
    assert early_stop(record(["nothing", "still nothing"], ["Paris"])) == 0.0


def test_early_stop_requires_the_answer_still_in_memory_when_stopping():
    assert early_stop(record(["Paris", "lost it"], ["Paris"])) == 0.0


def test_never_stopping_counts_the_distance_from_this_samples_own_last_write():
    # Per sample (not the batch's longest trajectory): the answer arrived in the last Write.
    assert early_stop(record(["a", "b", "Paris"], ["Paris"], num_chunks=3, stopped=False)) == 1.0
    assert early_stop(record(["Paris", "Paris", "Paris"], ["Paris"], num_chunks=3, stopped=False)) == pytest.approx(
        0.36
    )


@pytest.mark.parametrize(
    "gold, memory, found",
    [
        ("Nora", "it is not known yet who nor where", False),
        ("Ian", "a pianist was mentioned", False),
        ("Nora", "Nora, the two were not born in the same city.", True),
        ("Yves", "Yvesterday they met", False),
        ("1", "there were 10 of them", False),
        ("1", "there was 1 winner", True),
    ],
)
def test_answer_in_memory_uses_word_boundaries(gold, memory, found):
    assert early_stop(record([memory], [gold])) == (1.0 if found else 0.0)


@pytest.mark.parametrize(
    "gold, memory",
    [
        ("no", "No relevant information in this chunk."),
        ("yes", "Yes, both were born in Ohio; still missing: the second film's director."),
        ("No.", "There is no mention of the second band yet."),
    ],
)
def test_yes_no_golds_never_count_as_found_in_memory(gold, memory):
    # Ordinary English holds "yes" and "no": finding them says nothing about the answer.
    assert early_stop(record([memory], [gold]), gate="none") == 0.0
    # Another gold of the same question is still looked for.
    assert early_stop(record([memory + " Ohio."], [gold, "Ohio"]), gate="none") == 1.0


def test_a_wrong_answer_after_an_early_stop_earns_no_early_stop_reward_by_default():
    memories = ["nothing yet", "the capital is Paris"]
    assert early_stop(record(memories, ["Paris"], prediction="Lyon")) == 0.0
    assert early_stop(record(memories, ["Paris"], prediction=None)) == 0.0  # no answer at all
    assert early_stop(record(memories, ["Paris"], prediction="Paris")) == 1.0
    assert early_stop(record(memories, ["Paris"], prediction="Lyon"), gate="none") == 1.0  # the reference's


def test_the_f1_gate_pays_a_partly_right_answer_and_bad_gates_are_refused():
    memories = ["Jean-Paul Sartre wrote it"]
    partly = record(memories, ["Jean-Paul Sartre"], prediction="Sartre")  # F1 2/3, EM 0
    assert early_stop(partly) == 0.0
    assert early_stop(partly, gate="f1", gate_min=0.5) == 1.0
    assert early_stop(partly, gate="f1", gate_min=0.7) == 0.0
    with pytest.raises(ValueError, match="gate: expected 'none' or one of"):
        early_stop(partly, gate="bleu")
    with pytest.raises(ValueError, match="gate_min"):
        early_stop(partly, gate="f1", gate_min=0)


# ---------------------------------------------------------------------------------- protocol


def test_protocol_rewards_parsed_actions_and_closed_capped_memories():
    assert protocol(record(["a", "b"], ["x"])) == 1.0
    assert protocol(record(["a", "b"], ["x"], invalid_prethink=1)) == 0.5
    assert protocol(record(["a", "b"], ["x"], write_flags={0: [FLAG_MEMORY_TRUNCATED]})) == 0.5
    assert protocol(record(["a", "b"], ["x"], write_flags={1: [FLAG_THINK_CLOSED_BY_LOOP]})) == 0.5
    both = record(["a", "b"], ["x"], invalid_prethink=0, write_flags={1: [FLAG_MEMORY_TRUNCATED]})
    assert protocol(both) == 0.0
    assert [breaks_protocol(t) for t in both.turns] == [True, False, False, True, False, False]


# ------------------------------------------------------------------------------ config loading


def test_components_are_loaded_by_dotted_path_with_clear_errors():
    specs = {"outcome": {"_target_": "infmem_verl.reward.components.outcome", "weight": 0.5, "metric": "f1"}}
    (component,) = load_components(specs)
    assert (component.name, component.weight, component.kwargs) == ("outcome", 0.5, {"metric": "f1"})
    with pytest.raises(
        ConfigError,
        match=r"components\.bad\._target_: cannot import module 'no_such_pkg'.*built-in components: \[.*outcome",
    ):
        load_components({"bad": {"_target_": "no_such_pkg.fn", "weight": 1.0}})
    with pytest.raises(ConfigError, match=r"has no function 'nope'; available: \[.*'early_stop'"):
        load_components({"bad": {"_target_": "infmem_verl.reward.components.nope", "weight": 1.0}})
    with pytest.raises(ConfigError, match=r"components\.bad\.weight: expected a number"):
        load_components({"bad": {"_target_": "infmem_verl.reward.components.outcome", "weight": "high"}})
    with pytest.raises(ConfigError, match="at least one reward component"):
        load_components({})


# ------------------------------------------------------------------ the manager, through verl


@pytest.fixture(scope="module")
def compose_config(tiny_model_dir):
    def _compose(*overrides: str):
        with initialize_config_dir(str(conf_dir()), version_base=None):
            return compose("infmem_trainer", overrides=[f"actor_rollout_ref.model.path={tiny_model_dir}", *overrides])

    return _compose


_REWARD_WORKERS: dict[str, RewardLoopWorker] = {}


def _reward_worker(config) -> RewardLoopWorker:
    """One real reward worker per distinct config (building one loads its tokenizer and manager,
    ~3 s on 2 cores; scoring keeps no state between calls)."""
    key = OmegaConf.to_yaml(config)
    if key not in _REWARD_WORKERS:
        _REWARD_WORKERS[key] = RewardLoopWorker(config)
    return _REWARD_WORKERS[key]


def _in_process_worker(config) -> AgentLoopWorker:
    """verl's AgentLoopWorker reduced to what ``_compute_score`` uses, with the real reward worker
    called in-process instead of through a Ray actor handle."""
    reward_worker = _reward_worker(config)
    worker = AgentLoopWorker.__new__(AgentLoopWorker)
    worker.processor = None
    worker.mm_processor_kwargs = {}
    worker.reward_loop_worker_handles = [
        SimpleNamespace(compute_score=SimpleNamespace(remote=reward_worker.compute_score))
    ]
    return worker


def _outputs(tokenizer, turns: list[TurnFacts], answer_text: str) -> list[AgentLoopOutput]:
    """One AgentLoopOutput per turn with real token ids; the answer turn's response is ``answer_text``."""
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    outputs = []
    for facts in turns:
        prompt = tokenizer.encode(f"{facts.turn_kind} prompt for chunk {facts.chunk_index}")
        text = answer_text if facts.turn_kind == "answer" else (facts.memory_text or "<tool_call>{}</tool_call>")
        response = tokenizer.encode(text) + [eos]
        outputs.append(
            AgentLoopOutput(
                prompt_ids=prompt,
                response_ids=response,
                response_mask=[1] * len(response),
                num_turns=2,
                metrics=AgentLoopMetrics(),
                extra_fields=facts.to_dict(),
            )
        )
    return outputs


def _sample(golds) -> dict:
    return {
        "raw_prompt": [{"role": "user", "content": "Where is the Louvre?"}],
        "reward_model": {"ground_truth": golds},
        "data_source": "hotpotqa",
        "extra_info": {"index": 7},
        "document_ref": "docs.parquet#abc",
        "uid": "u0",
        "session_id": 0,
        "global_steps": 1,
    }


async def score(config, tokenizer, turns, answer_text, golds=("Paris",)) -> AgentLoopOutput:
    outputs = _outputs(tokenizer, turns, answer_text)
    await _in_process_worker(config)._compute_score(outputs, kwargs=_sample(list(golds)))
    return outputs[-1]


GOOD = dict(memories=["nothing yet", "The Louvre is in Paris."], num_chunks=5, stopped=True, prediction="Paris")


async def test_manager_sums_weighted_components_over_the_whole_trajectory(compose_config, tokenizer):
    config = compose_config("reward_fn=infmem")
    final = await score(config, tokenizer, infmem_turns(**GOOD), "<think>\nok\n</think>\n\n\\boxed{Paris}")
    info = final.extra_fields["reward_extra_info"]
    assert final.reward_score == pytest.approx(0.6 * 1 + 0.6 * 1 + 1.0 * 1)
    assert (info["acc"], info["outcome"], info["early_stop"], info["protocol"]) == (1.0, 1.0, 1.0, 1.0)
    assert (info["chunks_read"], info["num_chunks"], info["stopped_early"], info["llm_sequences"]) == (2, 5, 1.0, 6)

    wrong = dict(GOOD, prediction="Lyon")
    late = await score(config, tokenizer, infmem_turns(**wrong, invalid_prethink=0), "\\boxed{Lyon}")
    info_late = late.extra_fields["reward_extra_info"]
    assert late.reward_score == pytest.approx(0.6 * 0 + 0.6 * 0 + 1.0 * 0.5)  # wrong: no early-stop reward
    assert info_late.keys() == info.keys()  # verl stacks these across trajectories


async def test_the_default_reward_pays_no_early_stop_to_a_wrong_answer_and_the_reference_preset_does(
    compose_config, tokenizer
):
    wrong = infmem_turns(**dict(GOOD, prediction="Lyon"))
    default = await score(compose_config(), tokenizer, wrong, "\\boxed{Lyon}")
    assert default.reward_score == pytest.approx(1.0)  # protocol only
    ungated = await score(compose_config("reward_fn=infmem_ungated"), tokenizer, wrong, "\\boxed{Lyon}")
    assert ungated.reward_score == pytest.approx(0.6 * 0 + 0.6 * 1 + 1.0)
    partly = infmem_turns(**dict(GOOD, prediction="Paris France"))  # F1 2/3
    f1_gated = await score(compose_config("reward_fn=infmem_f1_gated"), tokenizer, partly, "\\boxed{Paris France}")
    assert f1_gated.reward_score == pytest.approx(0.6 * 0 + 0.6 * 1 + 1.0)
    plain = await score(compose_config("reward_fn=outcome_f1"), tokenizer, infmem_turns(**GOOD), "\\boxed{Paris}")
    assert plain.reward_score == 1.0 and set(plain.extra_fields["reward_extra_info"]) >= {"acc", "outcome", "f1"}


async def test_stuffing_the_memory_and_stopping_at_once_does_not_outscore_reading_on_and_answering(
    compose_config, tokenizer
):
    """GRPO ranks the trajectories of a group: the gamed one must not rank above honest ones."""
    golds = ("Marie Curie",)
    reading = [f"Chunk {i}: the prize committee is mentioned, not yet the laureate." for i in range(8)]
    trajectories = {  # name -> (memories, stopped, answer)
        "stuffed": (["Candidates: Marie Curie, Pierre Curie, Lise Meitner, Niels Bohr, Emmy Noether."], True, "Lise Meitner"),
        "honest_right": (reading + ["The 1911 chemistry laureate was Marie Curie."] * 4, False, "Marie Curie"),
        # Right, but the memory words the name otherwise: no early-stop reward under any gate.
        "honest_right_paraphrased": (reading + ["The 1911 laureate: Curie, Marie (born Sklodowska)."] * 4, False, "Marie Curie"),
        "honest_wrong": (reading + ["The 1911 laureate is not named in the text read."] * 4, False, "Lise Meitner"),
    }  # fmt: skip
    rewards: dict[str, dict[str, float]] = {}
    for preset in ("infmem", "infmem_ungated"):
        config = compose_config(f"reward_fn={preset}")
        rewards[preset] = {}
        for name, (memories, stopped, answer) in trajectories.items():
            turns = infmem_turns(memories, num_chunks=12, stopped=stopped, prediction=answer)
            rewards[preset][name] = (await score(config, tokenizer, turns, f"\\boxed{{{answer}}}", golds)).reward_score
    default = rewards["infmem"]
    assert default["stuffed"] == pytest.approx(1.0)  # protocol only
    assert default["honest_right"] == pytest.approx(0.6 + 0.6 * 0.6**3 + 1.0)  # found at Write 8 of 12: d = 4
    assert default["honest_right_paraphrased"] == pytest.approx(0.6 + 1.0)
    assert default["honest_wrong"] == default["stuffed"]  # stuffing gains nothing
    # The reference's ungated term pays the stuffed wrong answer as much as a right answer, and
    # 0.6 more than an honest failure: the gradient pushes towards stuffing and stopping.
    reference = rewards["infmem_ungated"]
    assert reference["stuffed"] == pytest.approx(0.6 + 1.0) == reference["honest_right_paraphrased"]
    assert reference["stuffed"] == pytest.approx(reference["honest_wrong"] + 0.6)


async def test_custom_reward_function_scores_the_outcome(compose_config, tokenizer, tmp_path):
    module = tmp_path / "my_reward.py"
    module.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info):\n"
        "    assert [t['turn_kind'] for t in extra_info['turns']][-1] == 'answer'\n"
        "    return {'score': 0.25 if '\\\\boxed{Paris}' in solution_str and ground_truth == ['Paris'] else -1.0}\n"
    )
    config = compose_config("reward_fn=infmem", f"reward.custom_reward_function.path={module}")
    final = await score(config, tokenizer, infmem_turns(**GOOD), "<think>\nhm\n</think>\n\n\\boxed{Paris}")
    info = final.extra_fields["reward_extra_info"]
    assert info["outcome"] == info["acc"] == 0.25
    assert final.reward_score == pytest.approx(0.6 * 0.25 + 0.6 * 1 + 1.0 * 1)


async def test_malformed_trajectories_fail_with_the_field_named(compose_config, tokenizer):
    config = compose_config()
    outputs = _outputs(tokenizer, infmem_turns(**GOOD), "\\boxed{Paris}")
    outputs[1].extra_fields = {"turn_scores": []}  # not produced by our agent loop
    with pytest.raises(ValueError, match=r"row 1: extra_fields lack turn facts"):
        await _in_process_worker(config)._compute_score(outputs, kwargs=_sample(["Paris"]))
    outputs = _outputs(tokenizer, infmem_turns(**GOOD), "\\boxed{Paris}")
    with pytest.raises(ValueError, match=r"reward_model\.ground_truth: expected a string or a non-empty list"):
        await _in_process_worker(config)._compute_score(outputs, kwargs=_sample([]))


def test_unknown_component_target_fails_when_the_reward_worker_starts(compose_config):
    config = compose_config("infmem.reward.components.outcome._target_=infmem_verl.reward.components.outcom")
    with pytest.raises(ConfigError, match=r"infmem\.reward\.components\.outcome\._target_"):
        RewardLoopWorker(config)


def test_reward_range_matches_the_reference_shape():
    # 0.6 EM + 0.6 early stop + 0.5 fc_ok + 0.5 mem_ok in the reference: at most 2.2.
    specs = {
        "outcome": {"_target_": "infmem_verl.reward.components.outcome", "weight": 0.6},
        "early_stop": {"_target_": "infmem_verl.reward.components.early_stop", "weight": 0.6},
        "protocol": {"_target_": "infmem_verl.reward.components.protocol", "weight": 1.0},
    }
    best = record(["Paris"], ["Paris"], prediction="Paris")
    assert math.isclose(sum(c.weight * c.score(best) for c in load_components(specs)), 2.2)


# ------------------------------------------- scoring inside the agent loop (infmem.cost lever a)


class _Recorder:
    """A reward-worker handle that records what verl's ``_compute_score`` would ship through Ray."""

    def __init__(self):
        self.shipped = []

    async def compute_score(self, data):
        self.shipped.append(data)
        raise AssertionError("the remote reward call ran")


@pytest.mark.parametrize("preset", ["infmem", "infmem_ungated", "outcome_f1"])
async def test_scoring_in_the_agent_loop_gives_the_managers_rewards_and_skips_the_remote_call(
    compose_config, tokenizer, preset
):
    from infmem_verl.cost import Row, reward_call_bytes
    from infmem_verl.verl_plugin.agent_loop import in_loop_reward, score_outputs

    config = compose_config(f"reward_fn={preset}")
    cases = [
        (infmem_turns(**GOOD), "<think>\nok\n</think>\n\n\\boxed{Paris}"),
        (infmem_turns(**dict(GOOD, prediction="Lyon"), invalid_prethink=0), "\\boxed{Lyon}"),
        (infmem_turns(memories=["a", "b", "c"], num_chunks=3, stopped=False, prediction=None), "no answer"),
    ]
    for turns, answer in cases:
        remote = await score(config, tokenizer, turns, answer)
        outputs = _outputs(tokenizer, turns, answer)
        score_outputs(outputs, in_loop_reward(config), _sample(["Paris"]), tokenizer)
        assert outputs[-1].reward_score == remote.reward_score
        assert outputs[-1].extra_fields["reward_extra_info"] == remote.extra_fields["reward_extra_info"]

        # verl's own _compute_score now leaves the score alone and never calls the reward worker...
        recorder = _Recorder()
        worker = _in_process_worker(config)
        worker.reward_loop_worker_handles = [SimpleNamespace(compute_score=SimpleNamespace(remote=recorder.compute_score))]
        await worker._compute_score(outputs, kwargs=_sample(["Paris"]))
        assert recorder.shipped == [] and outputs[-1].reward_score == remote.reward_score
        # ...whose token tensors the cost ledger counts exactly.
        fresh = _outputs(tokenizer, turns, answer)
        with pytest.raises(AssertionError, match="remote reward call ran"):
            await worker._compute_score(fresh, kwargs=_sample(["Paris"]))
        shipped = recorder.shipped[0].batch
        rows = [Row(f"k_{i}", len(o.prompt_ids), len(o.response_ids)) for i, o in enumerate(fresh)]
        assert reward_call_bytes(rows) == sum(t.numel() * t.element_size() for t in shipped.values())


def test_the_agent_loop_scores_only_for_the_infmem_manager_without_a_custom_function(compose_config, tmp_path):
    from infmem_verl.verl_plugin.agent_loop import in_loop_reward

    assert [c.name for c in in_loop_reward(compose_config())] == ["outcome", "early_stop", "protocol"]
    assert in_loop_reward(compose_config("infmem.cost.score_in_agent_loop=false")) is None
    module = tmp_path / "my_reward.py"
    module.write_text("def compute_score(**kwargs):\n    return 0.0\n")
    assert in_loop_reward(compose_config(f"reward.custom_reward_function.path={module}")) is None
    assert in_loop_reward(compose_config("reward.reward_manager.name=naive")) is None
