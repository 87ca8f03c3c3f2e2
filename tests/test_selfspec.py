"""Self-speculative drafting with the target's own layers (early exit, layer skipping):

- the adapter (spekit.backends.decoder_layers) run over every layer gives the model's own logits, and a draft leaves the target's
  cache exactly as it found it;
- both methods reproduce transformers' plain greedy decoding exactly (Llama, Gemma 3 with sliding layers,
  batched, ragged prompts), and sampled outputs follow the target's distribution;
- the skip search writes a file that the method reads back; bad input gets a clear UserError.
"""
from __future__ import annotations

import copy
import dataclasses
import json

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from spekit import proposers
from spekit.commands import main
from spekit.config import SamplingConfig, UserError
from spekit.backends.decoder_layers import Scratch, Stack
from spekit.backends.weight_quant import quantize
from spekit.heads.skip_set import fingerprint, save
from spekit.train.layer_skip import Evaluator, search
from spekit.backends.torch_target import Target

from test_engine import DIST_CONFIGS, DIST_PROMPT, DIST_SAMPLES, V_SMALL, both_ways, first_two_exact
from conftest import PENALISED, make_engine, penalised_greedy, tiny_llama

PROMPTS = [[5, 17, 42, 9, 3, 88, 61], [7, 8, 9, 10] * 5, [1]]
N = 24


def skip_file(tmp_path, model, skip: list[int]) -> str:
    path = str(tmp_path / "skip.json")
    save(path, Target(model), skip, {})
    return path


def methods(model, tmp_path) -> dict:
    n = model.config.num_hidden_layers
    return {"early-exit 1": ("early-exit", dict(exit_layer=1, confidence=0.0)),
            "early-exit all": ("early-exit", dict(exit_layer=n, confidence=0.0)),
            "layer-skip": ("layer-skip", dict(skip_file=skip_file(tmp_path, model, [n - 2]), confidence=0.0))}


@pytest.mark.parametrize("name", ["llama", "gemma_sliding"])
def test_the_adapter_over_every_layer_gives_the_models_logits(request, name):
    assert_stack_gives_the_models_logits(request.getfixturevalue(name))


def assert_stack_gives_the_models_logits(model) -> None:
    """Stack.forward over every layer equals the model's own forward (two rows of 12 tokens)."""
    target = Target(model)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2, 3]])
    positions = torch.arange(12).expand(2, 12)
    causal = torch.ones(12, 12, dtype=torch.bool).tril().expand(2, 12, 12)
    with torch.inference_mode():
        expected = model(input_ids=ids).logits
    got = Stack(target).forward(target.new_state(2), ids, positions, causal)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["llama", "gemma_sliding"])
def test_a_draft_leaves_the_targets_cache_as_it_was(request, name):
    model = request.getfixturevalue(name)
    target = Target(model)
    kv = target.new_state(2)
    target.prefill(kv, [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7]])
    before = [(layer.keys.clone(), layer.values.clone()) for layer in kv.cache.layers]
    stack = Stack(target)
    scratch = Scratch(stack, kv, [0, stack.num_layers - 1])
    eye = torch.ones(2, 1, 1, dtype=torch.bool)
    for step in range(3):
        scratch.step(torch.tensor([[1], [2]]), kv.next_positions()[:, None] + step, eye)
    scratch.close()
    for (k, v), layer in zip(before, kv.cache.layers):
        assert torch.equal(k, layer.keys) and torch.equal(v, layer.values)


@pytest.mark.parametrize("method", ["early-exit 1", "early-exit all", "layer-skip"])
@pytest.mark.parametrize("name", ["llama", "gemma_sliding"])
def test_greedy_output_equals_hf_greedy(request, engine_for, reference, always_draft, tmp_path, name, method):
    """Batched, ragged prompts, two samples each; Gemma decodes far past its window of 8."""
    model = request.getfixturevalue(name)
    proposer, options = methods(model, tmp_path)[method]
    results = engine_for(proposer, model, **options).generate(PROMPTS, SamplingConfig(max_new_tokens=N, n=2))
    for r in results:
        assert r.token_ids == reference(model, PROMPTS[r.prompt_index], N), (r.prompt_index, r.sample_index)
    drafted = sum(sum(r.stats.position_offered) for r in results)
    assert drafted > 0
    if method == "early-exit all":          # the draft is the whole model: everything it offers is accepted
        assert all(r.stats.tau > 2 for r in results)


def test_greedy_with_repetition_penalty_equals_hf(engine_for, reference, always_draft, llama):
    cfg = SamplingConfig(max_new_tokens=N, repetition_penalty=1.5)
    for r in engine_for("early-exit", llama, exit_layer=1).generate(PROMPTS, cfg):
        assert r.token_ids == reference(llama, r.prompt_ids, N, repetition_penalty=1.5)


@pytest.mark.parametrize("config", list(DIST_CONFIGS))
@pytest.mark.parametrize("method", ["early-exit", "layer-skip"])
def test_sampled_tokens_follow_the_target_distribution(engine_for, follows, small_target, always_draft, tmp_path,
                                                       method, config):
    """The first two tokens of many samples: the second comes from the first speculative step."""
    options = dict(exit_layer=1) if method == "early-exit" else dict(skip_file=skip_file(tmp_path, small_target, [0]))
    cfg = dataclasses.replace(DIST_CONFIGS[config], max_new_tokens=2, n=DIST_SAMPLES, seed=11)
    results = engine_for(method, small_target, **options).generate([DIST_PROMPT], cfg)
    codes = torch.tensor([r.token_ids[0] * V_SMALL + r.token_ids[1] for r in results])
    follows(codes, first_two_exact(small_target, DIST_PROMPT, cfg).flatten())
    both_ways(results)


def test_the_search_finds_a_set_that_the_method_reads(tmp_path, llama, engine_for, reference):
    target = Target(llama)
    texts = [p + reference(llama, p, 16) for p in PROMPTS[:2]]
    ev = Evaluator.build(target, texts, [len(p) - 1 for p in PROMPTS[:2]], depth=3, per_text=4)
    assert ev.profile([0, 1]) == pytest.approx([1.0, 1.0, 1.0])   # the whole model agrees with itself
    skipped, score = search(ev, trials=3)
    assert score >= 1.0 and len(skipped) < 2
    path = skip_file(tmp_path, llama, skipped)
    [r] = engine_for("layer-skip", llama, skip_file=path).generate([PROMPTS[0]], SamplingConfig(max_new_tokens=8))
    assert r.token_ids == reference(llama, PROMPTS[0], 8)


# --- bad input ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("exit_layer", [3, 100, -1])
def test_an_exit_layer_out_of_range_is_refused(llama, exit_layer):
    cls = proposers.get("early-exit")
    with pytest.raises(UserError, match="exit_layer"):
        cls(Target(llama), cls.Options(exit_layer=exit_layer))


def test_a_skip_file_for_another_model_is_refused(tmp_path, llama, llama_draft, gemma_sliding):
    cls = proposers.get("layer-skip")
    for other in (llama_draft, gemma_sliding, tiny_llama(seed=5)):        # the last: llama's shape, other weights
        path = skip_file(tmp_path, other, [0])
        with pytest.raises(UserError, match="another model"):
            cls(Target(llama), cls.Options(skip_file=path))


@pytest.mark.parametrize("content,match", [(None, "no skip file"), ("{not json", "cannot read"),
                                           ('{"format": "x"}', "not a spekit layer-skip file")])
def test_a_bad_skip_file_is_refused(tmp_path, llama, content, match):
    path = tmp_path / "skip.json"
    if content is not None:
        path.write_text(content)
    cls = proposers.get("layer-skip")
    with pytest.raises(UserError, match=match):
        cls(Target(llama), cls.Options(skip_file=str(path)))


def test_a_skip_file_serves_its_model_in_another_dtype_or_quantized(tmp_path, llama):
    """Searched in float32, used in bfloat16 or with int4 weights: the same model, so the file is taken (an exact
    hash of the weights refused it in bfloat16, and failed on the packed layers)."""
    path = skip_file(tmp_path, llama, [0])
    cls = proposers.get("layer-skip")
    cls(Target(copy.deepcopy(llama).to(torch.bfloat16)), cls.Options(skip_file=path))
    packed = copy.deepcopy(llama).to(torch.bfloat16)
    quantize(packed, "int4")
    cls(Target(packed), cls.Options(skip_file=path))
    data = json.loads(open(path).read())
    data["model"] = "9e1cf05fd0545f8c6351"                  # as files made before 2026-12-04 named it
    open(path, "w").write(json.dumps(data))
    with pytest.raises(UserError, match="older spekit"):
        cls(Target(llama), cls.Options(skip_file=path))


def test_a_skip_file_naming_every_layer_is_refused(tmp_path, llama):
    path = skip_file(tmp_path, llama, [0])
    data = json.loads(open(path).read())
    data["skip"] = [0, 1]
    open(path, "w").write(json.dumps(data))
    cls = proposers.get("layer-skip")
    with pytest.raises(UserError, match="all of them"):
        cls(Target(llama), cls.Options(skip_file=path))
    assert data["model"] == fingerprint(Target(llama))


def test_layer_skip_without_a_skip_file_says_how_to_make_one(llama):
    cls = proposers.get("layer-skip")
    with pytest.raises(UserError, match="layer-skip search"):
        cls(Target(llama), cls.Options())


def test_an_unsupported_architecture_is_refused():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=64)).eval()
    cls = proposers.get("early-exit")
    with pytest.raises(UserError, match="gpt2"):
        cls(Target(model), cls.Options(exit_layer=1))


def test_the_search_command_refuses_a_missing_prompt_file(tmp_path, capsys):
    assert main(["layer-skip", "search", "--prompts", str(tmp_path / "none.txt"), "--out",
                 str(tmp_path / "s.json")]) == 2
    assert "prompts file not found" in capsys.readouterr().err


# --- the bundled model --------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_both_methods_equal_plain_greedy_on_the_bundled_model(tmp_path):
    from spekit.api import Spekit
    sk = Spekit.load("smollm2-135m")
    ids = [sk.encode("Write a Python function that returns the squares of a list of numbers."),
           sk.encode("Name three rivers in Europe.")]
    cfg = SamplingConfig(max_new_tokens=24)
    plain = [r.token_ids for r in sk.engine.generate(ids, cfg)]
    path = str(tmp_path / "skip.json")
    save(path, sk.target, [10, 12, 14, 16], {})
    for method, options in [("early-exit", {"exit_layer": 20}), ("layer-skip", {"skip_file": path})]:
        out = sk.with_method(method, **options, confidence=0.0).engine.generate(ids, cfg)
        assert [r.token_ids for r in out] == plain, method


@pytest.mark.parametrize("method", ["early-exit 1", "layer-skip"])
def test_greedy_with_penalties_and_logit_bias_equals_plain(engine_for, always_draft, llama, tmp_path, method):
    proposer, options = methods(llama, tmp_path)[method]
    results = engine_for(proposer, llama, **options).generate(PROMPTS, PENALISED)
    assert [r.token_ids for r in results] == [penalised_greedy(llama, p) for p in PROMPTS]
    assert sum(sum(r.stats.position_offered) for r in results) > 0


# --- an exit adapter (spekit train exit): drafts differently, output still plain's -----------------------------

def exit_adapter(tmp_path, model, exit_layer: int = 1, seed: int = 0) -> str:
    """An exit adapter for `model` with random (non-zero) weights, saved as `spekit train exit` saves one."""
    from spekit.heads import HEADS, save_head
    target = Target(model)
    head = HEADS["exit"].create(target, exit_layer=exit_layer)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.05)
    folder = tmp_path / f"exit{exit_layer}"
    save_head(head, folder, {"tau": 1.0})
    return str(folder)


def test_an_exit_adapter_changes_the_drafts_not_the_output(engine_for, reference, always_draft, llama, tmp_path):
    adapter = exit_adapter(tmp_path, llama)
    cfg = SamplingConfig(max_new_tokens=N, n=2)
    plain_exit = engine_for("early-exit", llama, exit_layer=1, confidence=0.0)
    with_adapter = engine_for("early-exit", llama, heads=adapter, confidence=0.0)
    assert with_adapter.proposer.draft_layers == [0] and with_adapter.proposer.adapter is not None
    results = with_adapter.generate(PROMPTS, cfg)
    for r in results:
        assert r.token_ids == reference(llama, PROMPTS[r.prompt_index], N), (r.prompt_index, r.sample_index)
    untrained = plain_exit.generate(PROMPTS, cfg)
    assert [r.stats.position_accepted for r in results] != [r.stats.position_accepted for r in untrained], \
        "the adapter drafts other tokens"


@pytest.mark.parametrize("case, words", [("layer", "trained for --exit-layer 1"),
                                         ("model", "another model"), ("kind", "not 'exit'")])
def test_exit_adapter_bad_input(llama, gemma_sliding, tmp_path, case, words):
    adapter = exit_adapter(tmp_path, llama)
    options = {"layer": dict(heads=adapter, exit_layer=2),
               "model": dict(heads=exit_adapter(tmp_path / "g", gemma_sliding))}.get(case)
    if case == "kind":
        from spekit.heads import HEADS, save_head
        save_head(HEADS["medusa"].create(Target(llama), num_heads=1), tmp_path / "medusa", {})
        options = dict(heads=str(tmp_path / "medusa"))
    with pytest.raises(UserError, match=words):
        make_engine("early-exit", llama, **options)


def test_an_exit_adapter_is_not_exported(llama, tmp_path):
    """vLLM and SGLang have no layout for it: a clear refusal naming what does export, nothing written."""
    from spekit.heads.export import export
    with pytest.raises(UserError, match="no exporter for 'exit' heads; exportable: eagle, eagle3, medusa, mtp"):
        export(exit_adapter(tmp_path, llama), "vllm", tmp_path / "out")
    assert not (tmp_path / "out").exists()
