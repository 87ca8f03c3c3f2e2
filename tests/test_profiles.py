"""Step costs kept between runs (spekit.pacing.profiles): a new process on the same machine and model drafts with the costs
an earlier one measured, without timing forwards first; anything else measures afresh; output never changes."""
import json
import warnings

import pytest
import torch

from spekit.pacing import profiles
from spekit.config import SamplingConfig, UserError
from spekit.pacing.priors import PRIOR
from spekit.pacing.step_costs import StepCosts
from spekit.engine import Engine
from spekit.proposers.ngram import Ngram, NgramOptions
from spekit.backends.torch_target import Target

from conftest import tiny_llama

REAL_DEFAULT_PATH = profiles.default_path     # conftest points the default at each test's own folder
PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]
CFG = SamplingConfig(max_new_tokens=24)
FLAT = "flat"


def run(model, where: str, monkeypatch=None) -> tuple[list[int], int]:
    """Tokens of one greedy ngram generation over a new Target tied to `where`, and the calibration forwards it
    timed."""
    target = Target(model, cost_profile=where)
    engine = Engine(target, Ngram(target, NgramOptions()))
    trials = []
    timed = Engine._trial_forward
    if monkeypatch is not None:
        monkeypatch.setattr(engine, "_trial_forward", lambda kv, ctx, n: trials.append(n) or timed(engine, kv, ctx, n))
    return engine.generate([PROMPT], CFG)[0].token_ids, len(trials)


def test_a_new_process_starts_from_the_stored_costs_without_calibrating(llama, tmp_path, monkeypatch, reference):
    path = tmp_path / "p.json"
    first, calibrated = run(llama, str(path), monkeypatch)
    assert calibrated > 0 and path.is_file()
    stored = json.loads(path.read_text())
    assert stored["calibrated"] == [1] and {(b, n) for b, n, _, _ in stored["entries"]} >= {(1, 1), (1, 2), (1, 8)}
    again, calibrated = run(llama, str(path), monkeypatch)
    assert calibrated == 0
    assert first == again == reference(llama, PROMPT, len(first))


def test_the_default_place_is_per_model_dtype_and_machine(llama, tmp_path, monkeypatch):
    monkeypatch.setattr(profiles, "default_path", REAL_DEFAULT_PATH)
    monkeypatch.setenv("SPEKIT_CACHE", str(tmp_path))
    run(llama, "auto")
    run(tiny_llama(seed=0).to(torch.bfloat16), "auto")
    files = sorted(p.name for p in (tmp_path / "costs").iterdir())
    assert len(files) == 2 and files[0].startswith("LlamaForCausalLM-bfloat16-")
    keys = [json.loads((tmp_path / "costs" / f).read_text())["key"] for f in files]
    assert keys[0]["dtype"] == "bfloat16" and keys[0]["invariant"] and not keys[1]["invariant"]
    assert keys[0]["device"].startswith("cpu:") and keys[0]["device"].endswith(f"{torch.get_num_threads()} threads")



def test_a_profile_of_another_setup_is_measured_afresh_and_replaced(llama, tmp_path, monkeypatch):
    path = tmp_path / "p.json"
    run(llama, str(path))
    data = json.loads(path.read_text())
    data["key"]["dtype"] = "bfloat16"
    path.write_text(json.dumps(data))
    with pytest.warns(UserWarning, match="not a step-cost profile of this setup"):
        _, calibrated = run(llama, str(path), monkeypatch)
    assert calibrated > 0 and json.loads(path.read_text())["key"]["dtype"] == "float32"


@pytest.mark.parametrize("text", ["my notes, not a profile\n", '{"key": {"dtype": "float32"}, "entr', "[1, 2]"])
def test_a_file_that_is_not_a_profile_is_refused_and_left_alone(llama, tmp_path, text):
    path = tmp_path / "notes.txt"
    path.write_text(text)
    with pytest.raises(UserError, match="not a step-cost profile"):
        Target(llama, cost_profile=str(path))
    assert path.read_text() == text


def test_none_keeps_nothing_and_a_folder_is_a_clear_error(llama, tmp_path):
    run(llama, "none")
    assert not (tmp_path / "costs").exists()
    with pytest.raises(UserError, match="is a folder"):
        Target(llama, cost_profile=str(tmp_path))


def test_an_unwritable_place_warns_once_and_decoding_goes_on(llama, tmp_path, reference):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tokens, _ = run(llama, str(blocker / "p.json"))
    assert tokens == reference(llama, PROMPT, len(tokens))
    assert sum("could not keep the measured step costs" in str(w.message) for w in seen) == 1


def test_engines_over_one_target_share_its_costs(llama, monkeypatch):
    target = Target(llama)
    trials = []
    for _ in range(2):
        engine = Engine(target, Ngram(target, NgramOptions()))
        timed = engine._trial_forward
        monkeypatch.setattr(engine, "_trial_forward", lambda kv, ctx, n, t=timed: trials.append(n) or t(kv, ctx, n))
        engine.generate([PROMPT], CFG)
    assert trials == [1, 1, 1, 2, 2, 2, 4, 4, 4, 8, 8, 8] and target.costs.calibrated == {1}   # the first's only


def test_stored_ratios_are_taken_among_stored_figures_and_this_runs_figures_replace_them():
    costs = StepCosts(prior=PRIOR)
    costs.restore([[1, 1, 512, 0.010], [1, 8, 512, 0.020], [4, 1, 512, 0.030]], calibrated=[1, 4, 16])
    assert costs.calibrated == {1, 4}                          # a bucket with no figures is not calibrated
    assert costs.relative(1, 8) == pytest.approx(2.0) and costs.plain_seconds(1) == 0.010
    for _ in range(3):
        costs.record(1, 1, 0.005)                              # the machine runs faster today
    assert costs.relative(1, 8) == pytest.approx(2.0)          # not 0.020 / 0.005
    for _ in range(2):
        costs.record(1, 8, 0.0075)
    assert costs.relative(1, 8) == pytest.approx(2.0)          # two steps are not a measure yet ...
    costs.record(1, 8, 0.0075)
    assert costs.relative(1, 8) == pytest.approx(1.5) and costs.plain_seconds(1) == 0.005     # ... three are
    assert [1, 8, 512, 0.0075] in costs.entries() and [4, 1, 512, 0.030] in costs.entries()
    with pytest.raises(ValueError):
        costs.restore([[1, 2]], [])


def test_a_stored_figure_dearer_per_token_than_a_narrower_one_is_measured_again():
    """A wide step kept at more per token than a narrower one (a slow spell that outlived its run) would never be
    drafted again, so never measured again: it is left out, priced as unmeasured until this run measures it."""
    costs = StepCosts(prior=PRIOR)
    costs.restore([[1, 1, 512, 0.010], [1, 4, 512, 0.030], [1, 8, 512, 0.070], [1, 16, 512, 0.100]], calibrated=[1])
    assert costs.relative(1, 4) == pytest.approx(3.0)              # 0.0075 s a token against 0.010: kept
    assert costs.relative(1, 8) == pytest.approx(PRIOR[8])         # 0.0088 a token against 0.0075: the prior's
    assert costs.relative(1, 16) == pytest.approx(10.0)            # 0.0063 a token against 4-token steps': kept
    assert [1, 8, 512, 0.070] not in costs.entries()


def test_flat_costs_draft_the_widest_every_step_keep_nothing_and_change_no_token(llama, tmp_path, reference):
    """`--cost-profile flat`: every forward priced as one token, nothing timed first and nothing written, the
    governor never holds; ngram then drafts its full continuation at every step that has a match, under greedy
    and sampling alike, and the output is still plain decoding's."""
    target = Target(llama, cost_profile=FLAT)
    assert target.costs.flat and target.costs.profile is None
    assert target.costs.relative(1, 16, context=4000) == 1.0 and target.costs.relative(8, 64) == 1.0
    engine = Engine(target, Ngram(target, NgramOptions(num_draft_tokens=6)))
    assert not engine.pacer.governed
    trials = []
    engine._trial_forward = lambda kv, ctx, n: trials.append(n)
    result = engine.generate([PROMPT], CFG)[0]
    assert result.token_ids == reference(llama, PROMPT, CFG.max_new_tokens) and trials == []
    assert result.stats.position_offered[:6] and min(result.stats.position_offered[:6]) > 0
    assert result.stats.target_forwards < CFG.max_new_tokens
    sampled = engine.generate([PROMPT], SamplingConfig(max_new_tokens=24, temperature=0.8, seed=3))[0]
    assert sampled.stats.position_offered and sampled.stats.position_offered[5] > 0
    assert not list(tmp_path.iterdir())

