"""MTP modules (--method mtp): lossless with random, trained and native modules; native DeepSeek-V3 checkpoints are
read as they are; training lowers the loss; the DeepSeek-V3 export round-trips; bad input gets a clear UserError."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from spekit.config import SamplingConfig, UserError
from spekit.heads import FeatureBatch, load_head, save_head
from spekit.heads.mtp import MtpHead
from spekit.heads.mtp_native import _deepseek_tensors, write_export
from spekit.backends.torch_target import Target
from conftest import PENALISED, penalised_greedy

PROMPTS = [[5, 17, 42, 9, 3, 88], [7, 8, 9, 10] * 5, [1]]
N = 24


def make_heads(model, path, modules: int = 3, **options):
    head = MtpHead.create(Target(model, fast=False), num_modules=modules, **options)
    return save_head(head, path)


@pytest.fixture(scope="module")
def llama_heads(llama, tmp_path_factory):
    return make_heads(llama, tmp_path_factory.mktemp("mtp") / "heads")


def tiny_deepseek(mtp_layers: int) -> DeepseekV3ForCausalLM:
    torch.manual_seed(0)
    cfg = DeepseekV3Config(vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                           n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                           first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                           qk_nope_head_dim=8, v_head_dim=16, max_position_embeddings=512,
                           num_nextn_predict_layers=mtp_layers)
    return DeepseekV3ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def deepseek_native(tmp_path_factory):
    """A tiny random DeepSeek-V3 checkpoint whose safetensors carry 2 MTP layers (layers 2 and 3) in the
    DeepSeek-V3 layout, and the modules written there."""
    folder = tmp_path_factory.mktemp("ds") / "ckpt"
    model = tiny_deepseek(2)
    model.save_pretrained(folder)
    torch.manual_seed(1)
    head = MtpHead.create(Target(model, fast=False), num_modules=2, init_from_target=False)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors.update(_deepseek_tensors(head, Target(model, fast=False)))
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder, head


def greedy(engine, prompts, n=N):
    return [r.token_ids for r in engine.generate(prompts, SamplingConfig(max_new_tokens=n))]


@pytest.mark.parametrize("floor", [0, 3])
def test_mtp_reproduces_plain_greedy(engine_for, reference, llama, llama_heads, floor):
    eng = engine_for("mtp", llama, heads=str(llama_heads), min_draft_tokens=floor)
    want = [reference(llama, p, N) for p in PROMPTS]
    assert greedy(eng, PROMPTS) == want                                   # batched
    assert [greedy(eng, [p])[0] for p in PROMPTS] == want                 # alone


def test_a_short_head_context_feeds_the_latest_entries_and_stays_exact(engine_for, reference, llama, llama_heads):
    """--head-context W: a catch-up runs the modules over at most the W latest unseen entries of each row, at their
    true positions (the dropped ones count as fed); output is still plain's."""
    eng = engine_for("mtp", llama, heads=str(llama_heads), min_draft_tokens=3, head_context=2)
    widths = []
    skip_old = eng.proposer._skip_old

    def recorded():
        skip_old()
        widths.append(max(len(h) for h in eng.proposer.buf))
    eng.proposer._skip_old = recorded
    assert greedy(eng, PROMPTS) == [reference(llama, p, N) for p in PROMPTS]
    assert widths and max(widths) <= 2
    assert max(eng.proposer.fed) > 2, "entries were skipped"


def test_a_greedy_generation_starts_from_the_acceptance_the_last_one_learnt(engine_for, llama, llama_heads,
                                                                            monkeypatch):
    """Random modules are rarely accepted: the next greedy generation starts from that (rows averaged), not from the
    optimistic prior; a sampled one always from the prior, so that a seed fixes its output."""
    from spekit.proposers.mtp import PRIOR_ACCEPT
    eng = engine_for("mtp", llama, heads=str(llama_heads), min_draft_tokens=2)
    greedy(eng, PROMPTS)
    learnt = [sum(col) / len(col) for col in zip(*eng.proposer.alpha)]
    assert learnt[0] < PRIOR_ACCEPT
    starts = []
    begin = type(eng.proposer).begin
    monkeypatch.setattr(type(eng.proposer), "begin",
                        lambda self, ctx, hidden=None: begin(self, ctx, hidden) or starts.append(list(self.alpha[0])))
    greedy(eng, PROMPTS[:1], n=2)
    eng.generate(PROMPTS[:1], SamplingConfig(max_new_tokens=2, temperature=1.0))
    assert starts[0] == pytest.approx(learnt) and starts[1] == [PRIOR_ACCEPT] * len(learnt)


def test_drafts_are_the_teacher_forced_chain(engine_for, tmp_path):
    """What the proposer drafts step by step (own KV cache, slots dropped and recomputed after rejections) is what
    the modules compute teacher-forced along the final text, wherever the earlier drafts were the real tokens."""
    from conftest import tiny_llama
    model = tiny_llama(0, logit_scale=4)
    eng = engine_for("mtp", model, heads=str(make_heads(model, tmp_path / "h")), min_draft_tokens=3)
    proposer, seen = eng.proposer, []
    propose = proposer.propose
    proposer.propose = lambda ctx: seen.append((len(ctx.tokens[0]), propose(ctx))) or seen[-1][1]
    text = PROMPTS[0] + eng.generate([PROMPTS[0]], SamplingConfig(max_new_tokens=N))[0].token_ids
    target = Target(model)
    with torch.no_grad():
        hidden = model(torch.tensor([text]), output_hidden_states=True).hidden_states[-1]
        chain = {k: proposer.head.logits(target, out)[0].argmax(-1).tolist()
                 for k, out in proposer.head.chain(target, torch.tensor([text]), hidden)}
    checked = 0
    for n, tree in seen:
        drafts = tree.tokens[0, 1:].tolist()
        for k, d in enumerate(drafts):
            if n + k >= len(text) or (k and drafts[k - 1] != text[n + k - 1]):
                break
            assert chain[k][n - 2] == d, (n, k)
            checked += 1
    assert checked >= N // 2


def test_native_deepseek_mtp_layers_are_used_as_they_are(engine_for, reference, deepseek_native):
    folder, written = deepseek_native
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    eng = engine_for("mtp", model, min_draft_tokens=3)
    loaded = eng.proposer.head
    assert len(loaded.layers) == 2
    for (name, a), b in zip(loaded.state_dict().items(), written.state_dict().values()):
        assert torch.equal(a, b), name
    want = [reference(model, p, N) for p in PROMPTS]
    assert greedy(eng, PROMPTS) == want
    assert greedy(eng, [PROMPTS[1]]) == want[1:2]


def vocab_heads(model, path, size: int, modules: int = 3):
    """Modules whose draft vocabulary is the `size` lowest even token ids (the even ids counted as frequent)."""
    head = MtpHead.create(Target(model, fast=False), num_modules=modules, draft_vocab=size)
    counts = torch.zeros(model.config.vocab_size)
    counts[::2] = 1
    head.choose_vocab(counts)
    return save_head(head, path)


def test_a_draft_vocabulary_keeps_greedy_output_and_drafts_only_its_tokens(engine_for, reference, llama, llama_heads,
                                                                           tmp_path):
    """Modules with a reduced draft vocabulary draft only its tokens, at a lower estimated cost per module step,
    and the output is still plain greedy's; the vocabulary is saved with the modules."""
    heads = vocab_heads(llama, tmp_path / "v", 32)
    loaded = load_head(heads, Target(llama, fast=False))
    assert loaded.vocab_chosen and loaded.token_map.tolist() == list(range(0, 64, 2))
    eng = engine_for("mtp", llama, heads=str(heads), min_draft_tokens=3)
    full = engine_for("mtp", llama, heads=str(llama_heads), min_draft_tokens=3)
    assert eng.proposer.module_cost < full.proposer.module_cost
    seen = []
    propose = eng.proposer.propose
    eng.proposer.propose = lambda ctx: seen.append(propose(ctx)) or seen[-1]
    assert greedy(eng, PROMPTS) == [reference(llama, p, N) for p in PROMPTS]
    drafted = {t for tree in seen for t in tree.tokens[:, 1:].flatten().tolist()}
    assert drafted and drafted <= set(range(0, 64, 2))


@pytest.mark.parametrize("config,vocab", [("t1", 0), ("all", 0), ("all", 4)])
def test_sampled_tokens_follow_the_target_distribution(engine_for, follows, small_target, tmp_path, config, vocab):
    """Also with a draft vocabulary of half the tokens: the draft's q is zero outside it, the rule stays exact."""
    from test_engine import DIST_CONFIGS, DIST_PROMPT, V_SMALL, both_ways, first_two_exact
    cfg = dataclasses.replace(DIST_CONFIGS[config], max_new_tokens=2, n=3000, seed=11)
    heads = vocab_heads(small_target, tmp_path / "h", vocab, modules=2) if vocab else \
        make_heads(small_target, tmp_path / "h", modules=2)
    eng = engine_for("mtp", small_target, heads=str(heads), min_draft_tokens=3)
    results = eng.generate([DIST_PROMPT], cfg)
    codes = torch.tensor([r.token_ids[0] * V_SMALL + r.token_ids[1] for r in results])
    follows(codes, first_two_exact(small_target, DIST_PROMPT, cfg).flatten())
    both_ways(results)


def test_a_few_training_steps_lower_the_loss(llama):
    target = Target(llama, fast=False)
    head = MtpHead.create(target, num_modules=2).train()
    torch.manual_seed(0)
    tokens = torch.randint(0, 128, (4, 24))
    with torch.no_grad():
        hidden = llama(tokens, output_hidden_states=True).hidden_states
    assert head.feature_layers() == [target.num_layers]
    batch = FeatureBatch(tokens, torch.ones_like(tokens, dtype=torch.bool),
                         {target.num_layers: hidden[target.num_layers]})
    opt = torch.optim.Adam(head.parameters(), lr=3e-3)
    first, figures = head.training_loss(batch, target)
    assert set(figures) == {"acc1", "acc2", "kl1", "kl2"}
    for _ in range(15):
        loss, _ = head.training_loss(batch, target)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.7 * float(first.detach())
    assert all(p.grad is None for p in llama.parameters()), "the target stays frozen"


def test_the_export_round_trips(engine_for, reference, llama, llama_heads, tmp_path):
    """Export in the DeepSeek-V3 layout, load the checkpoint natively: the same modules, the same drafts."""
    out = write_export(llama, None, llama_heads, tmp_path / "exported")
    config = json.loads((out / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 3
    names = set(load_file(str(out / "model.safetensors")))
    for suffix in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                   "shared_head.head.weight", "embed_tokens.weight", "self_attn.q_proj.weight"):
        assert f"model.layers.2.{suffix}" in names
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    native = engine_for("mtp", model, min_draft_tokens=3)
    trained = engine_for("mtp", llama, heads=str(llama_heads), min_draft_tokens=3)
    for a, b in zip(native.proposer.head.state_dict().values(), trained.proposer.head.state_dict().values()):
        assert torch.equal(a, b)
    assert greedy(native, PROMPTS) == greedy(trained, PROMPTS) == [reference(llama, p, N) for p in PROMPTS]
    for eng in (native, trained):
        eng.generate(PROMPTS, SamplingConfig(max_new_tokens=N))
    drafts = [[r.stats.position_offered, r.stats.position_accepted]
              for eng in (native, trained) for r in eng.generate(PROMPTS, SamplingConfig(max_new_tokens=N))]
    assert drafts[:3] == drafts[3:]


def test_modules_with_a_draft_vocabulary_export_their_weights(engine_for, llama, tmp_path, capsys):
    """The DeepSeek-V3 layout has no draft vocabulary: the export carries the same module weights (and says that
    they will draft over the whole vocabulary)."""
    heads = vocab_heads(llama, tmp_path / "v", 32, modules=2)
    out = write_export(llama, None, heads, tmp_path / "exported")
    assert "no draft vocabulary" in capsys.readouterr().err
    native = engine_for("mtp", AutoModelForCausalLM.from_pretrained(out).eval()).proposer.head
    trained = load_head(heads, Target(llama, fast=False))
    assert all(torch.equal(a, b) for a, b in zip(native.layers.state_dict().values(),
                                                  trained.layers.state_dict().values()))


# --- bad input -----------------------------------------------------------------------------------------------------

def test_no_modules_is_a_user_error(engine_for, llama):
    with pytest.raises(UserError, match="no MTP layers"):
        engine_for("mtp", llama)


def test_heads_for_another_model_are_refused(engine_for, llama, llama_other_vocab, gemma_sliding, tmp_path):
    other = make_heads(llama_other_vocab, tmp_path / "other", modules=1)
    with pytest.raises(UserError, match="another model"):
        engine_for("mtp", llama, heads=str(other))
    gemma = make_heads(gemma_sliding, tmp_path / "gemma", modules=1)
    info = json.loads((gemma / "config.json").read_text())
    info["target"]["num_layers"] = 2                                  # same shapes as the llama, other architecture
    (gemma / "config.json").write_text(json.dumps(info))
    with pytest.raises(UserError):
        engine_for("mtp", llama, heads=str(gemma))


def test_a_truncated_or_misshapen_head_file_is_refused(engine_for, llama, llama_heads, tmp_path):
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(llama_heads, bad)
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(UserError, match="corrupt or truncated"):
        engine_for("mtp", llama, heads=str(bad))
    tensors = load_file(str(llama_heads / "model.safetensors"))
    tensors["layers.0.eh_proj.weight"] = torch.zeros(64, 64)
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(UserError, match="does not fit"):
        engine_for("mtp", llama, heads=str(bad))
    with pytest.raises(UserError, match="not a spekit head directory"):
        engine_for("mtp", llama, heads=str(tmp_path / "nothing"))


def test_native_mtp_weights_that_do_not_fit_are_refused(engine_for, deepseek_native, tmp_path):
    import shutil
    folder = tmp_path / "ckpt"
    shutil.copytree(deepseek_native[0], folder)
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.layers.3.eh_proj.weight"] = torch.zeros(64, 64)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with pytest.raises(UserError, match="eh_proj.weight has shape"):
        engine_for("mtp", model)
    del tensors["model.layers.3.eh_proj.weight"]
    tensors = {k: v for k, v in tensors.items() if not k.startswith("model.layers.3.")}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UserError, match=r"lacks layer\(s\) \[3\]"):
        engine_for("mtp", model)


def test_bad_options_are_user_errors():
    from spekit import proposers
    with pytest.raises(UserError):
        proposers.get("mtp").Options(max_draft_tokens=-1)
    with pytest.raises(UserError):
        proposers.get("mtp").Options(min_draft_tokens=3, max_draft_tokens=2)
    with pytest.raises(UserError, match="head_context"):
        proposers.get("mtp").Options(head_context=-1)
    with pytest.raises(UserError):
        MtpHead.Config(num_modules=0)
    with pytest.raises(UserError):
        MtpHead.Config(draft_vocab=-1)


def test_narrow_modules_cannot_be_exported(llama, tmp_path):
    heads = make_heads(llama, tmp_path / "narrow", modules=1, intermediate_size=64)
    assert load_head(heads, Target(llama, fast=False)).config.intermediate_size == 64
    with pytest.raises(UserError, match="narrower"):
        write_export(llama, None, heads, tmp_path / "out")


@pytest.mark.slow
def test_shipped_modules_on_the_bundled_model_equal_plain_greedy():
    from spekit.api import Spekit
    from spekit.heads.mtp_native import shipped_dir
    base = Spekit.load("smollm2-135m")
    if shipped_dir(base.target) is None:
        pytest.skip("no MTP modules shipped for smollm2-135m")
    ids = [base.encode("Write a Python function that returns the squares of a list of numbers."),
           base.encode("Summarize: the council approved the park budget; the park opens next spring.")]
    cfg = SamplingConfig(max_new_tokens=40)
    plain = [r.token_ids for r in base.engine.generate(ids, cfg)]
    mtp = base.with_method("mtp")
    results = mtp.engine.generate(ids, cfg)
    assert [r.token_ids for r in results] == plain
    assert mtp.engine.generate(ids[:1], cfg)[0].token_ids == plain[0]


def test_mtp_with_penalties_and_logit_bias_equals_plain(engine_for, llama, llama_heads):
    eng = engine_for("mtp", llama, heads=str(llama_heads), min_draft_tokens=2)
    results = eng.generate(PROMPTS, PENALISED)
    assert [r.token_ids for r in results] == [penalised_greedy(llama, p) for p in PROMPTS]
    assert sum(sum(r.stats.position_offered) for r in results) > 0, "the modules drafted"


def test_auto_picks_a_models_own_mtp_layers(deepseek_native):
    from spekit.methods import auto_method
    model = AutoModelForCausalLM.from_pretrained(deepseek_native[0]).eval()
    assert auto_method(Target(model, fast=False))[0] == "mtp"
