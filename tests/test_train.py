"""Training: prompt files, the resumable distillation cache, features, the generic trainer (loss falls,
checkpoint + resume continue exactly), the draft kind end to end (it loads as --draft and keeps greedy output
identical), and clear errors for bad input."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from spekit.api import Spekit
from spekit.commands import main
from spekit.config import UserError
from spekit.heads import HEADS
from spekit.heads.base import FeatureBatch, Head, save_head
from spekit.backends.torch_models import load_model
from spekit.train.distill import Distiller, read_answers
from spekit.train.features import FeatureStore
from spekit.train.prompt_files import read_prompts
from spekit.train.prompts import build_prompts
from spekit.backends.draft_vocab import ReducedHead
from spekit.train.trainer import TrainConfig, Trainer

from test_cli import _save_tiny

WORDS = ["the quick brown fox", "one two three four", "speculative decoding drafts", "the lazy dog jumps",
         "five six seven eight", "verifies tokens quickly", "brown fox and dog", "nine ten one two"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _save_tiny(tmp_path_factory.mktemp("tiny"), layers=2)


@pytest.fixture(scope="module")
def prompt_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "p.txt"
    path.write_text("\n".join(WORDS) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def distilled(tiny, prompt_file, tmp_path_factory):
    sk = Spekit.load(tiny)
    data = tmp_path_factory.mktemp("data")
    Distiller(sk, data, max_new_tokens=12, batch_size=4).run(read_prompts(prompt_file), progress=False)
    return sk, data


def test_prompt_file_formats(tmp_path):
    (tmp_path / "a.txt").write_text("first prompt\n\nsecond prompt\n")
    assert [r["turns"] for r in read_prompts(tmp_path / "a.txt")] == [["first prompt"], ["second prompt"]]
    lines = [{"turns": ["t1", "t2"]}, {"conversations": [{"from": "human", "value": "hi"},
                                                          {"from": "gpt", "value": "hello"},
                                                          {"from": "human", "value": "more"}]},
             {"prompt": "p", "id": "x7"}]
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    recs = read_prompts(tmp_path / "b.jsonl")
    assert [r["turns"] for r in recs] == [["t1", "t2"], ["hi", "more"], ["p"]]
    assert recs[2]["id"] == "x7"


def test_prompt_files_refused(tmp_path):
    bench = [{"question_id": i, "category": "writing", "turns": [f"q{i}"]} for i in range(4)]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bench))
    with pytest.raises(UserError, match="Spec-Bench"):
        read_prompts(tmp_path / "q.jsonl")
    (tmp_path / "empty.txt").write_text("\n \n")
    with pytest.raises(UserError, match="empty"):
        read_prompts(tmp_path / "empty.txt")
    with pytest.raises(UserError, match="not found"):
        read_prompts(tmp_path / "missing.txt")
    (tmp_path / "bad.jsonl").write_text('{"text": 1}\n')
    with pytest.raises(UserError, match="needs 'turns'"):
        read_prompts(tmp_path / "bad.jsonl")


def test_built_prompts_are_deterministic_and_not_spec_bench():
    a, b = build_prompts(60, seed=3, max_modules=15), build_prompts(60, seed=3, max_modules=15)
    assert a == b and len(a) == 60 and len({r["category"] for r in a}) >= 8
    from spekit.train.prompt_files import _spec_bench_firsts
    firsts = _spec_bench_firsts()
    assert not any(" ".join(r["turns"][0].split()) in firsts for r in a)


def test_distillation_resumes(tiny, prompt_file, tmp_path):
    sk = Spekit.load(tiny)
    records = read_prompts(prompt_file)
    first = Distiller(sk, tmp_path, max_new_tokens=8, batch_size=2)
    assert first.run(records[:3], progress=False) == 3
    with open(tmp_path / "answers.jsonl", "a") as f:
        f.write('{"id": "L9", "prompt_ids": [1, 2')                     # a crash mid-write
    again = Distiller(sk, tmp_path, max_new_tokens=8, batch_size=2)
    assert again.run(records, progress=False) == len(records) - 3       # the done ids are skipped
    answers = read_answers(tmp_path)
    assert sorted(r["id"] for r in answers) == sorted(r["id"] for r in records)
    plain = sk.engine.generate([answers[0]["prompt_ids"]], again.cfg)[0]
    assert plain.token_ids == answers[0]["answer_ids"]


def test_features_match_the_target(distilled):
    sk, data = distilled
    store = FeatureStore(data, read_answers(data), sk.target, shard_size=3)
    n = sk.target.num_layers
    store.ensure([1, n], progress=False)
    names = [s[0] for s in store.sequences[:2]]
    batch = store.batch(names, [1, n], "cpu")
    logits = sk.target.model.lm_head(batch.hidden[n])
    for b, name in enumerate(names):
        _, length, prompt_len = store.sequences[store.position[name]]
        want = batch.tokens[b, prompt_len:length]
        assert batch.loss_mask[b].sum() == length - prompt_len
        assert torch.equal(logits[b, prompt_len - 1: length - 1].argmax(-1), want)


def test_features_of_a_bfloat16_target_take_the_fused_prefill_kernel(tiny, distilled, tmp_path):
    """A bfloat16 CPU target verifies with the exact (float64-attention) forms; its features are a prefill and
    take the fused kernel instead (3.7x faster on SmolLM2): the same hidden states to bfloat16 rounding."""
    _, data = distilled
    sk = Spekit.load(tiny, dtype="bfloat16")
    assert sk.target.invariant
    store = FeatureStore(tmp_path, read_answers(data), sk.target, shard_size=4)
    n = sk.target.num_layers
    store.ensure([n], progress=False)
    name = store.sequences[0][0]
    with torch.inference_mode():
        exact = sk.target.model(input_ids=store.tokens(name)[None], output_hidden_states=True).hidden_states[n][0]
    assert torch.allclose(store.hidden(n, name).float(), exact.float(), atol=0.05, rtol=0.02)


def test_answers_too_long_for_max_len_are_named_not_dropped_silently(distilled, tmp_path, capsys):
    sk, data = distilled
    answers = read_answers(data)
    answers[0] = {**answers[0], "answer_ids": answers[0]["answer_ids"] * 3}
    max_len = len(answers[0]["answer_ids"])          # cut from the left, it leaves that answer no prompt token
    store = FeatureStore(tmp_path, answers, sk.target, max_len=max_len)
    assert [s[0] for s in store.sequences] == [r["id"] for r in answers[1:]]
    assert f"1 of {len(answers)} distilled answers left out" in capsys.readouterr().err
    with pytest.raises(UserError, match="raise it"):
        FeatureStore(tmp_path, answers, sk.target, max_len=1)


@dataclass(frozen=True)
class ProbeConfig:
    width: int = 32


class Probe(Head):
    """A test head: predicts the next token from the last hidden state through a small MLP."""
    kind = "probe"
    Config = ProbeConfig

    def __init__(self, config, target_config):
        super().__init__(config, target_config)
        torch.manual_seed(0)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(target_config["hidden_size"], config.width), torch.nn.ReLU(),
                                       torch.nn.Linear(config.width, target_config["vocab_size"]))

    def feature_layers(self):
        return [1]

    def training_loss(self, batch: FeatureBatch, target):
        logits = self.mlp(batch.hidden[1][batch.loss_mask])
        labels = batch.tokens[:, 1:][batch.loss_mask[:, :-1]]
        loss = torch.nn.functional.cross_entropy(logits, labels)
        return loss, {"top1": float((logits.argmax(-1) == labels).float().mean())}


def _trainer(sk, data, out, steps, head=None, accelerator=None):
    store = FeatureStore(data, read_answers(data), sk.target, shard_size=4)
    head = head or Probe.create(sk.target)
    cfg = TrainConfig(steps=steps, batch_tokens=64, lr=2e-2, warmup=2, checkpoint_every=2)
    return Trainer(head, sk.target, store, [s[0] for s in store.sequences], cfg, out, accelerator)


def test_bf16_mixed_precision_trains_float32_weights(distilled, tmp_path):
    """--mixed-precision bf16 autocasts the head's forward only: the loss is computed in bf16 products, falls,
    and the weights (and so the saved head) stay float32."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    sk, data = distilled
    AcceleratorState._reset_state(reset_partial_state=True)    # an earlier test's training set up another state
    trainer = _trainer(sk, data, tmp_path / "bf16", 30, accelerator=Accelerator(cpu=True, mixed_precision="bf16"))
    dtypes, losses, original = [], [], trainer.head.training_loss

    def logged(batch, target):
        dtypes.append(trainer.head.mlp[0](batch.hidden[1][:1, :1].float()).dtype)
        loss, figures = original(batch, target)
        losses.append(float(loss.detach()))
        return loss, figures
    trainer.head.training_loss = logged
    try:
        trainer.train(progress=False)
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)   # accelerate keeps one state per process
    assert set(dtypes) == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in trainer.head.parameters())
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5


def test_loss_falls_and_resume_continues_exactly(distilled, tmp_path):
    sk, data = distilled
    full = _trainer(sk, data, tmp_path / "a", 30)
    losses = []
    original = full.head.training_loss

    def logged(batch, target):
        loss, figures = original(batch, target)
        losses.append(float(loss.detach()))
        return loss, figures
    full.head.training_loss = logged
    full.train(progress=False)
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5
    crashing = _trainer(sk, data, tmp_path / "b", 6)
    calls, step = [], crashing.head.training_loss

    def crash(batch, target):
        calls.append(1)
        if len(calls) == 6:                                  # dies in step 6, after the checkpoint at step 4
            raise KeyboardInterrupt
        return step(batch, target)
    crashing.head.training_loss = crash
    with pytest.raises(KeyboardInterrupt):
        crashing.train(progress=False)
    assert (tmp_path / "b" / "checkpoint.pt").is_file()
    resumed = _trainer(sk, data, tmp_path / "b", 6)
    assert resumed.load_checkpoint() and resumed.step == 4
    resumed.train(progress=False)
    straight = _trainer(sk, data, tmp_path / "c", 6)
    straight.train(progress=False)
    for (k, v), w in zip(resumed.head.state_dict().items(), straight.head.state_dict().values()):
        assert torch.allclose(v, w, atol=1e-6), k


TINY_OPTIONS = {"eagle3": {"layers": (0, 1, 1), "draft_vocab_size": 16}, "medusa": {"num_heads": 2},
                "mtp": {"num_modules": 2, "draft_vocab": 16}}


@pytest.mark.parametrize("kind", sorted(HEADS))
def test_every_head_kind_trains_through_the_trainer(kind, distilled, tmp_path):
    """The real Trainer gives each registered head the layers it reads (drafting and loss: EAGLE-3 here fuses
    layers that leave out the last one its soft labels come from), and its loss falls."""
    sk, data = distilled
    head = HEADS[kind].create(sk.target, **TINY_OPTIONS.get(kind, {}))
    trainer = _trainer(sk, data, tmp_path / kind, 12, head=head)
    if hasattr(head, "choose_vocab"):
        head.choose_vocab(trainer.token_counts())
    losses, original = [], head.training_loss

    def logged(batch, target):
        loss, figures = original(batch, target)
        losses.append(float(loss.detach()))
        return loss, figures
    head.training_loss = logged
    trainer.train(progress=False)
    assert len(losses) == 12 and sum(losses[-3:]) < sum(losses[:3])
    if hasattr(head, "measured_meta"):       # Medusa: top-k accuracy per head, the static tree's source
        names = [n for n, _, _ in trainer.store.sequences]
        table = head.measured_meta(trainer.store.batch(names, head.training_layers(), "cpu"), sk.target)["accuracy"]
        assert len(table) == head.config.num_heads and all(len(r) == 10 and 0 <= min(r) <= max(r) <= 1
                                                           for r in table)


def test_train_draft_end_to_end(tiny, prompt_file, tmp_path, capsys):
    out = tmp_path / "draft"
    assert main(["train", "draft", "--model", tiny, "--prompts", prompt_file, "--out", str(out), "--steps", "12",
                 "--batch-tokens", "64", "--max-new-tokens", "12", "--held-out", "2", "--eval-tokens", "16",
                 "--layers", "1", "--checkpoint-every", "5", "--draft-vocab", "40"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["identical_to_plain"] is True and report["tau"] >= 1.0 and report["steps"] == 12
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["spekit_shared_from"] and cfg["num_hidden_layers"] == 1 and cfg["spekit"]["meta"]["tau"]
    from safetensors.torch import load_file
    assert not any("embed" in k for k in load_file(str(out / "model.safetensors")))
    target = load_model(tiny)
    draft = load_model(str(out))
    assert torch.equal(draft.model.get_input_embeddings().weight, target.model.get_input_embeddings().weight)
    ids = cfg["spekit"]["draft_vocab"]       # its LM head covers the 40 most frequent answer tokens
    assert len(ids) == 40 == len(set(ids)) and ids == sorted(ids)
    assert isinstance(draft.model.get_output_embeddings(), ReducedHead)
    sk = Spekit(target)
    prompts = [sk.encode(w) for w in WORDS[:3]]
    from spekit.config import SamplingConfig
    cfg = SamplingConfig(max_new_tokens=20)
    plain = [r.token_ids for r in sk.engine.generate(prompts, cfg)]
    spec = [r.token_ids for r in sk.with_method("draft", draft).engine.generate(prompts, cfg)]
    assert plain == spec


def test_train_init_starts_from_trained_heads(tiny, prompt_file, tmp_path, capsys):
    """--init DIR continues from trained heads (their config and draft vocabulary kept): with a negligible learning
    rate the result is the head it started from; head flags beside --init, and --init for a draft model, are
    refused with a clear error."""
    from safetensors.torch import load_file
    common = ["--model", tiny, "--prompts", prompt_file, "--max-new-tokens", "12", "--held-out", "0",
              "--batch-tokens", "64", "--data", str(tmp_path / "data")]
    first, second = tmp_path / "first", tmp_path / "second"
    assert main(["train", "eagle3", *common, "--out", str(first), "--steps", "6", "--layers", "0", "1", "1",
                 "--draft-vocab-size", "16"]) == 0
    assert main(["train", "eagle3", *common, "--out", str(second), "--steps", "1", "--lr", "1e-12",
                 "--init", str(first)]) == 0
    a, b = load_file(str(first / "model.safetensors")), load_file(str(second / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    cfg = json.loads((second / "config.json").read_text())
    assert cfg["config"]["draft_vocab_size"] == 16 and cfg["meta"]["initialised_from"] == str(first)
    capsys.readouterr()
    assert main(["train", "eagle3", *common, "--out", str(tmp_path / "x"), "--steps", "1", "--init", str(first),
                 "--ttt-steps", "2"]) == 2
    assert "keeps that head's own config" in capsys.readouterr().err
    assert main(["train", "draft", *common, "--out", str(tmp_path / "y"), "--steps", "1", "--init", str(first)]) == 2
    assert "is not a draft model spekit trained" in capsys.readouterr().err


def test_train_draft_init_continues_from_a_trained_draft(tiny, prompt_file, tmp_path, capsys):
    """`spekit train draft --init DIR` goes on from the draft in DIR (its layers and draft vocabulary; the target's
    embedding stays shared, not overwritten): with a negligible learning rate the result is the draft it started
    from; flags that shape the draft's weights are refused beside --init, and a draft made for another model too."""
    from safetensors.torch import load_file
    common = ["--model", tiny, "--prompts", prompt_file, "--max-new-tokens", "12", "--held-out", "0",
              "--batch-tokens", "64", "--data", str(tmp_path / "data")]
    first, second = tmp_path / "first", tmp_path / "second"
    assert main(["train", "draft", *common, "--out", str(first), "--steps", "6", "--layers", "1",
                 "--draft-vocab", "40"]) == 0
    before = load_model(tiny).model.get_input_embeddings().weight.clone()
    assert main(["train", "draft", *common, "--out", str(second), "--steps", "1", "--lr", "1e-12",
                 "--init", str(first), "--ce-weight", "0.25"]) == 0
    a, b = load_file(str(first / "model.safetensors")), load_file(str(second / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    one, two = (json.loads((d / "config.json").read_text())["spekit"] for d in (first, second))
    assert two["draft_vocab"] == one["draft_vocab"] and two["meta"]["initialised_from"] == str(first)
    assert two["config"]["ce_weight"] == 0.25 and two["config"]["layers"] == 1
    assert torch.equal(load_model(tiny).model.get_input_embeddings().weight, before)
    alone = tmp_path / "alone"        # a standalone draft (its own copy of the embedding) goes on training too
    assert main(["train", "draft", *common, "--out", str(alone), "--steps", "1", "--lr", "1e-12", "--init",
                 str(second), "--standalone"]) == 0
    third = tmp_path / "third"
    assert main(["train", "draft", *common, "--out", str(third), "--steps", "1", "--lr", "1e-12",
                 "--init", str(alone)]) == 0
    c = load_file(str(third / "model.safetensors"))
    assert c.keys() == a.keys() and all(torch.equal(a[k], c[k]) for k in a)
    capsys.readouterr()
    assert main(["train", "draft", *common, "--out", str(tmp_path / "x"), "--steps", "1", "--init", str(first),
                 "--layers", "2"]) == 2
    assert "keeps that head's own config" in capsys.readouterr().err
    cfg = json.loads((first / "config.json").read_text())
    cfg["spekit"]["target"]["vocab_size"] += 1
    (first / "config.json").write_text(json.dumps(cfg))
    assert main(["train", "draft", *common, "--out", str(tmp_path / "y"), "--steps", "1", "--init", str(first)]) == 2
    assert "a draft for another model" in capsys.readouterr().err


def test_train_mtp_init_can_take_a_draft_vocabulary(tiny, prompt_file, tmp_path, capsys):
    """MTP modules trained over the whole vocabulary get a draft vocabulary when training goes on (--init DIR
    --draft-vocab N): the weights carry over, the vocabulary is chosen from the answers; a flag that shapes the
    weights is still refused beside --init."""
    from safetensors.torch import load_file
    common = ["--model", tiny, "--prompts", prompt_file, "--max-new-tokens", "12", "--held-out", "0",
              "--batch-tokens", "64", "--data", str(tmp_path / "data")]
    first, second = tmp_path / "first", tmp_path / "second"
    assert main(["train", "mtp", *common, "--out", str(first), "--steps", "2", "--num-modules", "2"]) == 0
    assert main(["train", "mtp", *common, "--out", str(second), "--steps", "1", "--lr", "1e-12", "--init", str(first),
                 "--draft-vocab", "16"]) == 0
    a, b = load_file(str(first / "model.safetensors")), load_file(str(second / "model.safetensors"))
    assert set(b) - set(a) == {"token_map"} and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((second / "config.json").read_text())["config"]["draft_vocab"] == 16
    chosen = b["token_map"].tolist()
    assert chosen != list(range(16)) and chosen == sorted(set(chosen)) and len(chosen) == 16
    capsys.readouterr()
    assert main(["train", "mtp", *common, "--out", str(tmp_path / "x"), "--steps", "1", "--init", str(first),
                 "--num-modules", "3"]) == 2
    assert "keeps that head's own config" in capsys.readouterr().err


def test_mtp_tau_is_the_modules_acceptance_with_drafting_forced(tiny, tmp_path, monkeypatch):
    """MTP modules record their acceptance: tau is measured with every module drafting at every step and the
    engine's governor off (a head's `acceptance_options`), so that it does not read 1.0 where drafting does not pay
    (MTP in float32 on a CPU); without them, a governor that always holds drafts nothing."""
    from spekit.api import Spekit
    from spekit.pacing.governor import Governor
    from spekit.heads.mtp import MtpHead
    from spekit.train import run
    monkeypatch.setattr(Governor, "allows", lambda self: False)
    sk = Spekit.load(tiny, "plain")
    head = MtpHead.create(sk.target, num_modules=2)
    heads = save_head(head, tmp_path / "mtp")
    runs = []
    one_by_one = run.one_by_one
    monkeypatch.setattr(run, "one_by_one", lambda eng, p, cfg: runs.append(one_by_one(eng, p, cfg)) or runs[-1])
    prompts = [[5, 6, 7, 8, 5, 6], [9, 10, 11, 9]]
    got = run.measure_tau(sk, "mtp", prompts, 12, heads=str(heads), forced=head.acceptance_options())
    assert got["identical_to_plain"] and got["tau_forced"] == {"min_draft_tokens": 2}
    assert all(r.stats.position_offered[:2] == [r.stats.target_forwards - 1] * 2 for r in runs[-1])
    run.measure_tau(sk, "mtp", prompts, 12, heads=str(heads))
    assert not any(r.stats.position_offered for r in runs[-1])


def test_check_measures_mtp_modules_as_their_tau_was_recorded(tiny, prompt_file, tmp_path, capsys):
    """`spekit train mtp` records the forced tau; `spekit check` measures the same way (every module, every step)."""
    out = tmp_path / "mtp"
    assert main(["train", "mtp", "--model", tiny, "--prompts", prompt_file, "--out", str(out), "--steps", "2",
                 "--batch-tokens", "64", "--max-new-tokens", "12", "--held-out", "2", "--eval-tokens", "8",
                 "--num-modules", "2"]) == 0
    meta = json.loads((out / "config.json").read_text())["meta"]
    assert meta["tau_forced"] == {"min_draft_tokens": 2} and meta["identical_to_plain"]
    capsys.readouterr()
    assert main(["check", "--model", tiny, "--method", "mtp", "--heads", str(out), "--prompts", prompt_file,
                 "--limit", "2", "--max-new-tokens", "8"]) == 0
    shown = capsys.readouterr().out
    assert "drafting forced, as recorded" in shown
    assert len(json.loads(shown.strip().splitlines()[-1])["position_acceptance"]) == 2
    assert meta["tau_dtype"] == "float32"
    # a tau recorded in another dtype (whose costs size the drafts otherwise) is reported, not judged
    config = json.loads((out / "config.json").read_text())
    for dtype, warned in (("bfloat16", False), ("float32", True)):
        config["meta"].update(tau=99.0, tau_dtype=dtype)
        (out / "config.json").write_text(json.dumps(config))
        assert main(["check", "--model", tiny, "--method", "mtp", "--heads", str(out), "--prompts", prompt_file,
                     "--limit", "1", "--max-new-tokens", "4"]) == 0
        shown = capsys.readouterr()
        report = json.loads(shown.out.strip().splitlines()[-1])
        assert report["drifted"] is warned and report["recorded_tau"] == 99.0
        assert ("warning: tau" in shown.err) is warned
        assert ("run with --dtype bfloat16 to compare" in shown.err) is not warned


@pytest.mark.parametrize("case", ["missing", "empty", "bench", "out_is_file", "kind"])
def test_train_bad_input(case, tiny, prompt_file, tmp_path, capsys):
    prompts, out, kind = prompt_file, str(tmp_path / "out"), "draft"
    if case == "missing":
        prompts = str(tmp_path / "nope.txt")
    elif case == "empty":
        (tmp_path / "e.txt").write_text("")
        prompts = str(tmp_path / "e.txt")
    elif case == "bench":
        prompts = "/work/shared/data/spec_bench/question.jsonl"
    elif case == "out_is_file":
        (tmp_path / "f").write_text("x")
        out = str(tmp_path / "f")
    else:
        kind = "no-such-kind"
    argv = ["train", kind, "--model", tiny, "--prompts", prompts, "--out", out, "--steps", "1"]
    if case == "kind":
        with pytest.raises(SystemExit) as err:
            main(argv)
        assert err.value.code == 2
        return
    if case == "bench" and not __import__("os").path.exists(prompts):
        pytest.skip("no Spec-Bench file here")
    assert main(argv) == 2
    assert "spekit: error:" in capsys.readouterr().err


@pytest.mark.slow
def test_shipped_draft_model_reproduces_plain_on_the_bundled_model():
    """`--method draft` without --draft takes the draft shipped for smollm2-135m (spekit/data/heads/.../draft,
    saved without the embedding it shares) and keeps greedy output identical to plain."""
    from spekit.api import SHIPPED
    from spekit.config import SamplingConfig
    if not (SHIPPED / "smollm2-135m" / "draft" / "config.json").is_file():
        pytest.skip("no draft model shipped for smollm2-135m")
    sk = Spekit.load("smollm2-135m")
    prompt = sk.encode("Name three uses of Python.")
    cfg = SamplingConfig(max_new_tokens=32)
    plain = sk.engine.generate([prompt], cfg)[0].token_ids
    spec = sk.with_method("draft").engine.generate([prompt], cfg)[0]
    assert spec.token_ids == plain


CHAT = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    from transformers import AutoTokenizer
    folder = _save_tiny(tmp_path_factory.mktemp("tiny-chat"), layers=1)
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = CHAT
    tok.save_pretrained(folder)
    return folder


def test_self_instruct_prompts_are_the_models_own_user_turns(tiny_chat, tmp_path, capsys):
    """Magpie-style prompts: the template up to the user's words, then the model's sampled request; the same seed
    gives the same file, the records are distinct ended turns, and the file is a prompt file the distiller reads."""
    from spekit.train.self_prompts import sample_prompts, user_turn_prefix
    sk = Spekit.load(tiny_chat)
    assert sk.decode(user_turn_prefix(sk)) == "<user>"
    first = sample_prompts(sk, 3, seed=5, batch=16, min_chars=1, progress=False)
    assert first == sample_prompts(sk, 3, seed=5, batch=16, min_chars=1, progress=False)
    assert len({r["turns"][0] for r in first}) == 3 and all(r["source"] == "spekit-self-instruct" for r in first)
    out = tmp_path / "self.jsonl"
    assert main(["train", "prompts", "--self-instruct", "--model", tiny_chat, "--out", str(out), "--count", "2"]) == 0
    assert [r["id"] for r in read_prompts(out)] == ["s00000", "s00001"]
    assert not list(tmp_path.glob(".*.tmp"))


def test_self_instruct_needs_a_chat_template(tiny, tmp_path, capsys):
    out = tmp_path / "self.jsonl"
    assert main(["train", "prompts", "--self-instruct", "--model", tiny, "--out", str(out), "--count", "2"]) == 2
    assert "chat template" in capsys.readouterr().err and not out.exists()


def test_train_rest_builds_a_datastore_of_the_targets_answers(tiny, prompt_file, tmp_path, capsys):
    out = tmp_path / "rest"
    assert main(["train", "rest", "--model", tiny, "--prompts", prompt_file, "--out", str(out), "--max-new-tokens",
                 "12", "--held-out", "2", "--eval-tokens", "16"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["identical_to_plain"] is True and report["tau"] >= 1.0 and report["sequences"] == len(WORDS) - 2
    from spekit.retrieval.datastore import load_datastore
    store = load_datastore(out, load_model(tiny).model.config.vocab_size)
    assert len(store) == report["tokens"] and store.meta["tau"] == report["tau"]
    assert main(["train", "rest", "--model", tiny, "--prompts", prompt_file, "--out", str(out / "config.json")]) == 2


def test_train_rest_takes_texts_the_model_wrote_before(tiny, prompt_file, tmp_path, capsys):
    """--texts: a server's logs join the datastore as they are (blank-line separated texts, or JSONL records of
    text / responses / the assistant turns, never the user's); without --prompts nothing is distilled and no tau
    measured. Files with no texts, bad records or the Spec-Bench questions exit 2 with one line, writing nothing."""
    from spekit.retrieval.datastore import load_datastore
    from spekit.train.texts import read_texts
    logs = tmp_path / "logs.jsonl"
    logs.write_text("\n".join(json.dumps(r) for r in [
        {"text": "alpha beta"}, {"response": "gamma"},
        {"messages": [{"role": "user", "content": "not me"}, {"role": "assistant", "content": "delta epsilon"}]},
        {"conversations": [{"from": "human", "value": "nor me"}, {"from": "gpt", "value": "zeta"}]}]) + "\n")
    assert read_texts(logs) == ["alpha beta", "gamma", "delta epsilon", "zeta"]
    plain = tmp_path / "logs.txt"
    plain.write_text("first text\non two lines\n\nsecond text\n")
    assert read_texts(plain) == ["first text\non two lines", "second text"]
    assert main(["train", "rest", "--model", tiny, "--texts", str(logs), "--texts", str(plain),
                 "--out", str(tmp_path / "a")]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["sequences"] == 6 and report["tau"] is None
    assert len(load_datastore(tmp_path / "a", load_model(tiny).model.config.vocab_size)) == report["tokens"]
    assert main(["train", "rest", "--model", tiny, "--prompts", prompt_file, "--max-new-tokens", "12",
                 "--held-out", "2", "--eval-tokens", "8", "--texts", str(logs), "--out", str(tmp_path / "b")]) == 0
    both = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert both["sequences"] == len(WORDS) - 2 + 4 and both["tau"] >= 1.0
    bad = tmp_path / "bad.jsonl"
    for content, message in [("", "empty"), ('{"messages": [{"role": "user", "content": "q"}]}\n', "no model texts"),
                             ('{"title": "x"}\n', "a record needs"), ("{not json\n", "not valid JSON"),
                             ('{"question_id": 81, "category": "writing", "turns": ["x"]}\n', "Spec-Bench")]:
        bad.write_text(content)
        assert main(["train", "rest", "--model", tiny, "--texts", str(bad), "--out", str(tmp_path / "c")]) == 2
        assert message in capsys.readouterr().err
    assert main(["train", "rest", "--model", tiny, "--out", str(tmp_path / "c")]) == 2
    assert "--texts" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_train_rest_takes_answers_distilled_into_other_folders(tiny, prompt_file, tmp_path, capsys):
    """--more-data: answers distilled earlier (other prompts, other folders) join the datastore as they are; a
    folder without answers, or answers of a larger vocabulary, exit 2 with one line and write nothing."""
    extra = tmp_path / "extra"
    extra.mkdir()
    (extra / "answers.jsonl").write_text(json.dumps({"id": "x0", "prompt_ids": [1, 2], "answer_ids": [3, 4, 5]})
                                         + "\n")
    args = ["train", "rest", "--model", tiny, "--prompts", prompt_file, "--max-new-tokens", "12", "--held-out", "2",
            "--eval-tokens", "8"]
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    alone = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert main([*args, "--out", str(tmp_path / "b"), "--data", str(tmp_path / "a.work" / "data"),
                 "--more-data", str(extra)]) == 0
    both = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert both["sequences"] == alone["sequences"] + 1 and both["tokens"] == alone["tokens"] + 3
    assert main([*args, "--out", str(tmp_path / "c"), "--more-data", str(tmp_path / "none")]) == 2
    assert "no distillation data" in capsys.readouterr().err
    (extra / "answers.jsonl").write_text(json.dumps({"id": "x0", "prompt_ids": [1], "answer_ids": [10 ** 6]}) + "\n")
    assert main([*args, "--out", str(tmp_path / "d"), "--more-data", str(extra)]) == 2
    assert "vocabulary" in capsys.readouterr().err
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()


def test_tau_is_measured_prompt_by_prompt(tiny, monkeypatch, always_draft):
    """tau at training (and in `spekit check`) is the batch-1 figure: a static batch of rows with equal budgets
    drafts little by design (pacer.MOST_BEHIND), which measured tau 1.0 for a datastore that reaches 1.4 alone."""
    from spekit.api import Spekit
    from spekit.pacing import pacer as pacer_module
    from spekit.config import SamplingConfig
    from spekit.train.run import measure_tau
    monkeypatch.setattr(pacer_module, "MOST_BEHIND", 2)             # the real rule (conftest lifts it)
    sk = Spekit.load(tiny, "plain")
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [9, 10, 11, 9, 10, 11, 9, 10], [3, 4, 3, 4, 3, 4, 3], [7, 7, 7, 7]]
    cfg = SamplingConfig(max_new_tokens=24)
    together = sk.with_method("ngram").engine.generate(prompts, cfg)
    assert sum(r.stats.new_tokens for r in together) == sum(r.stats.target_forwards for r in together)   # tau 1
    got = measure_tau(sk, "ngram", prompts, 24)
    assert got["identical_to_plain"] and got["tau"] > 1.2


@pytest.fixture
def targets_made(monkeypatch) -> list[bool]:
    """Whether each Spekit built while the test runs took the exact (row-invariant) forms, in order."""
    seen = []
    real = Spekit.__init__

    def spy(self, *a, **k):
        real(self, *a, **k)
        seen.append(self.target.invariant)
    monkeypatch.setattr(Spekit, "__init__", spy)
    return seen


def test_fast_answers_distill_with_the_models_own_kernels(tiny, prompt_file, tmp_path, targets_made):
    """--fast-answers: a bfloat16 CPU target keeps its own kernels (no row-invariant forms, no float64 cache) for
    the distillation; the data is the same kind of record, and without the flag the exact forms are used."""
    for flag, out in (["--fast-answers"], "fast"), ([], "exact"):
        assert main(["train", "distill", "--model", tiny, "--prompts", prompt_file, "--out", str(tmp_path / out),
                     "--dtype", "bfloat16", "--max-new-tokens", "6", "--limit", "3", *flag]) in (0, None)
    assert targets_made == [False, True]
    fast, exact = read_answers(tmp_path / "fast"), read_answers(tmp_path / "exact")
    assert [r["id"] for r in fast] == [r["id"] for r in exact] and all(r["answer_ids"] for r in fast)
    assert [r["prompt_ids"] for r in fast] == [r["prompt_ids"] for r in exact]


def test_fast_answers_in_one_training_command_then_the_exact_forms(tiny, prompt_file, tmp_path, targets_made):
    """`spekit train KIND --fast-answers`: the distillation runs on the model's own kernels, then the same loaded
    model is switched to the exact forms for the features and the held-out tau (greedy identity still checked)."""
    out = tmp_path / "medusa"
    assert main(["train", "medusa", "--model", tiny, "--prompts", prompt_file, "--out", str(out), "--dtype",
                 "bfloat16", "--fast-answers", "--steps", "2", "--batch-tokens", "64", "--max-new-tokens", "8",
                 "--held-out", "2", "--eval-tokens", "6"]) == 0
    assert targets_made[:2] == [False, True]
    meta = json.loads((out / "config.json").read_text())["meta"]
    assert meta["identical_to_plain"] and meta["tau_dtype"] == "bfloat16"
    assert read_answers(tmp_path / "medusa.work" / "data")
