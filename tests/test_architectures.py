"""The guarantees beyond Llama and Gemma 3: tiny random models of the other Hugging Face families users run
(Qwen 2 / 3, Qwen3-MoE, Mistral and Mixtral with a sliding window on every layer, Starcoder2, Phi-3, OLMo-2,
Gemma 2, SmolLM3, GPT-NeoX, Granite and Granite-MoE with their multipliers, gpt-oss with its attention sinks), each built from its
config:

- every method, the heads-based ones with random heads, reproduces transformers' greedy decoding token for token,
  for ragged prompts batched together, decoding well past the sliding window where there is one;
- the decoder-stack adapter of the self-speculative methods gives the model's own logits on every family it
  accepts (Granite's multipliers included), and refuses the others by name;
- in bfloat16 a verification forward's logits equal plain one-token steps' bit for bit (spekit.backends.row_invariant), for a
  sliding-window model and a mixture of experts too, and the float64 attention there keeps what SDPA cannot do
  (Gemma 2's logit soft-capping, gpt-oss's sinks).
"""
from __future__ import annotations

import pytest
import torch
import transformers as tf

from spekit.config import SamplingConfig, UserError
from spekit.heads.mtp import MtpHead
from spekit.backends.decoder_layers import SUPPORTED, Stack
from spekit.backends.torch_target import Target

from conftest import VOCAB, make_engine, plain_greedy_hf
from test_eagle import make_heads
from test_invariant import chained, plain_steps
from test_medusa import random_heads
from test_mtp import make_heads as make_mtp
from test_selfspec import assert_stack_gives_the_models_logits

WINDOW = 8
PROMPTS = [[7, 8, 9, 10] * 5 + [3, 4], [5, 17, 42, 9, 3, 88, 61, 120, 33]]   # repeats (drafts match), distinct
N = 24


def _tiny(config_cls, model_cls, hidden: int = 64, layers: int = 3, **extra):
    torch.manual_seed(0)
    config = config_cls(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                        num_hidden_layers=layers, num_attention_heads=4, max_position_embeddings=512, **extra)
    return model_cls(config).float().eval()


GQA = {"num_key_value_heads": 2}
IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}      # some defaults lie outside the tiny vocabulary
MOE = {"num_experts_per_tok": 2}
# family -> (config class, model class, config fields)
FAMILIES = {
    "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, GQA),
    "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, {**GQA, "head_dim": 16}),
    "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM,
                  {**GQA, **MOE, "head_dim": 16, "num_experts": 4, "moe_intermediate_size": 32}),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {**GQA, "sliding_window": WINDOW}),
    "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, {**GQA, **MOE, "num_local_experts": 4,
                                                          "sliding_window": WINDOW}),
    "starcoder2": (tf.Starcoder2Config, tf.Starcoder2ForCausalLM, {**GQA, "sliding_window": WINDOW}),
    "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM, {**GQA, **IDS}),
    "olmo2": (tf.Olmo2Config, tf.Olmo2ForCausalLM, {**GQA, **IDS}),
    "gemma2": (tf.Gemma2Config, tf.Gemma2ForCausalLM, {**GQA, "head_dim": 16, "sliding_window": WINDOW}),
    "smollm3": (tf.SmolLM3Config, tf.SmolLM3ForCausalLM, {**GQA, **IDS}),
    "gpt_neox": (tf.GPTNeoXConfig, tf.GPTNeoXForCausalLM, {**IDS}),
    "granite": (tf.GraniteConfig, tf.GraniteForCausalLM, {**GQA, "embedding_multiplier": 12.0,
                                                          "logits_scaling": 8.0, "residual_multiplier": 0.22}),
    "granitemoe": (tf.GraniteMoeConfig, tf.GraniteMoeForCausalLM, {**GQA, **MOE, "num_local_experts": 4,
                                                                   "embedding_multiplier": 12.0,
                                                                   "logits_scaling": 8.0}),
    "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM, {**GQA, **IDS, **MOE, "head_dim": 16, "num_local_experts": 4,
                                                        "sliding_window": WINDOW}),
}
SLIDING = ("mistral", "mixtral", "starcoder2", "gemma2")


def tiny(family: str, **size):
    config_cls, model_cls, extra = FAMILIES[family]
    return _tiny(config_cls, model_cls, **size, **extra)


@pytest.fixture(scope="module")
def models():
    memo: dict = {}

    def get(family: str):
        if family not in memo:
            memo[family] = tiny(family)
        return memo[family]
    return get


def methods(model, family: str, tmp_path) -> dict:
    """method -> options: every method, with random heads where it needs them."""
    out = {"plain": {}, "ngram": {}, "rest": {"datastore": "none"}, "recycle": {}, "lookahead": {}, "jacobi": {},
           "draft": {"confidence": 0.0},
           "medusa": {"heads": str(random_heads(model, tmp_path / "medusa", num_heads=3))},
           "eagle": {"heads": make_heads(model, tmp_path, "eagle", sharpen=3.0)},
           "eagle3": {"heads": make_heads(model, tmp_path, "eagle3", sharpen=3.0, draft_vocab_size=VOCAB - 2,
                                          layers=(0, 1, 2))}}
    if family != "gpt_neox":               # MTP modules are built from the decoder's `layers` and `norm`
        out["mtp"] = {"heads": str(make_mtp(model, tmp_path / "mtp")), "min_draft_tokens": 3}   # a fixed depth
    if model.config.model_type in SUPPORTED:
        out["early-exit"] = {"exit_layer": 1, "confidence": 0.0}
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_method_reproduces_hf_greedy(models, always_draft, tmp_path, family):
    model = models(family)
    expected = [plain_greedy_hf(model, ids, N) for ids in PROMPTS]
    drafted = {}
    for method, options in methods(model, family, tmp_path).items():
        results = make_engine(method, model, model if method == "draft" else None, **options).generate(
            PROMPTS, SamplingConfig(max_new_tokens=N))
        assert [r.token_ids for r in results] == expected, method
        drafted[method] = sum(sum(r.stats.position_offered) for r in results)
    assert drafted.pop("plain") == 0 and all(drafted.values()), drafted      # every method verified drafts


def test_the_sliding_window_matters_in_these_tests():
    """Mistral's window of 8 changes its greedy answer (so the tests above would see a missing window)."""
    windowed, wide = tiny("mistral"), tiny("mistral")
    wide.config.sliding_window = None
    assert plain_greedy_hf(windowed, PROMPTS[0], N) != plain_greedy_hf(wide, PROMPTS[0], N)
    assert all(Target(tiny(f)).sliding_window is not None for f in SLIDING)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f in SUPPORTED])
def test_the_stack_over_every_layer_gives_the_models_logits(models, family):
    assert_stack_gives_the_models_logits(models(family))


def test_a_family_the_stack_cannot_read_is_refused(models):
    """GPT-NeoX names its submodules otherwise: early exit says so rather than draft from other logits, and MTP
    modules likewise."""
    with pytest.raises(UserError, match="gpt_neox"):
        Stack(Target(models("gpt_neox")))
    with pytest.raises(UserError, match="gpt_neox"):
        MtpHead.create(Target(models("gpt_neox")))


@pytest.mark.parametrize("family", ["mistral", "mixtral", "qwen3_moe", "gpt_neox", "gemma2", "gpt_oss"])
def test_bfloat16_verification_rows_equal_plain_steps_bit_for_bit(family):
    """Wide enough (256) for bfloat16 kernels to round one row differently from several."""
    target = Target(tiny(family, hidden=256, layers=2).bfloat16())
    prompt = [5, 17, 42, 9, 3, 88, 61]
    tokens, steps = plain_steps(target, prompt, N)
    for chunk in (3, 8):
        assert torch.equal(chained(target, prompt, tokens, chunk), steps), chunk


def _sharp_gemma2(softcap: float | None):
    """Gemma 2 with attention scores large enough (q, k scaled up) for its soft-capping at 1.0 to matter."""
    model = tiny("gemma2")
    model.config.attn_logit_softcapping = softcap
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.attn_logit_softcapping = softcap
            layer.self_attn.q_proj.weight.mul_(20)
            layer.self_attn.k_proj.weight.mul_(20)
    return model


def _sunk_gpt_oss(sinks: bool):
    model = tiny("gpt_oss")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.linspace(-3, 3, layer.self_attn.sinks.numel()) if sinks else -1e4)
    return model


@pytest.mark.parametrize("build", [_sharp_gemma2, _sunk_gpt_oss], ids=["gemma2-softcap", "gpt_oss-sinks"])
def test_bfloat16_forms_keep_softcapping_and_sinks(build):
    """A bfloat16 verification forward (spekit's float64 attention) is as close to the float32 model as
    transformers' own bfloat16 forward is, and far from the model without its soft-capping / sinks."""
    ids = PROMPTS[0] + [5, 6, 7]
    with torch.inference_mode():
        exact = build(1.0 if build is _sharp_gemma2 else True)(torch.tensor([ids])).logits[0, -3:]
        without = build(None if build is _sharp_gemma2 else False)(torch.tensor([ids])).logits[0, -3:]
    target = Target(build(1.0 if build is _sharp_gemma2 else True).bfloat16())
    kv = target.new_state(1)
    target.prefill(kv, [ids[:-3]])
    got = target.forward(kv, torch.tensor([ids[-3:]]), torch.arange(len(ids) - 3, len(ids))[None],
                         torch.ones(1, 3, 3, dtype=torch.bool).tril())[0][0].float()
    assert float((got - exact).abs().max()) < 0.02
    assert float((without - exact).abs().max()) > 0.1, "the test could not tell"


STATEFUL = {
    "lfm2": lambda: _tiny(tf.Lfm2Config, tf.Lfm2ForCausalLM, **GQA, **IDS,
                          layer_types=["conv", "full_attention", "conv"]),
    "qwen3_next": lambda: _tiny(tf.Qwen3NextConfig, tf.Qwen3NextForCausalLM, layers=4, **GQA, head_dim=16,
                                linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=16,
                                linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=32, shared_expert_intermediate_size=32),
    "mamba": lambda: tf.MambaForCausalLM(tf.MambaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                                         **IDS)).eval(),
}


@pytest.mark.parametrize("family", list(STATEFUL))
def test_models_with_state_a_draft_would_advance_are_refused(family):
    """Recurrent, convolutional and linear-attention layers cannot be rolled back to the accepted tokens as a KV
    cache can: a clear refusal instead of transformers' errors deep in a forward (or a wrong answer)."""
    with pytest.raises(UserError, match="rolling its KV cache back"):
        Target(STATEFUL[family]())
