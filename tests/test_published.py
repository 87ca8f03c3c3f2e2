"""Published drafter layouts read by --heads (spekit.heads.published): the EAGLE repository's EAGLE-1 / EAGLE-3
checkpoints, FasterDecoding's Medusa heads, a DeepSeek-V3 checkpoint's MTP layers, the speculators format; round trips
through the speculators format (tiny heads, and the shipped SmolLM2 heads) keep every tensor and the decoding; bad
input gets a UserError naming what is wrong (exit code 2 from the CLI), and nothing is written."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import spekit.proposers.eagle as eagle_proposer
from spekit.backends.torch_target import Target
from spekit.commands import main
from spekit.config import SamplingConfig, UserError
from spekit.heads import HEADS, load_head, save_head
from spekit.heads.export import export
from spekit.heads.mtp import MtpHead
from spekit.heads.mtp_native import _deepseek_tensors
from test_mtp import tiny_deepseek
from test_speculators import PROMPT

CFG = SamplingConfig(max_new_tokens=12)


def random_head(target, kind: str, seed: int = 0, **options):
    """A head of `kind` with random weights of std 0.08 and norms in [0.5, 1.5] (sharp, nothing left at its init)."""
    torch.manual_seed(seed)
    head = (MtpHead.create(target, init_from_target=False, **options) if kind == "mtp"
            else HEADS[kind].create(target, **options))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.08) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    if hasattr(head, "choose_vocab"):
        head.choose_vocab(torch.rand(target.vocab_size))
    return head.eval()


def same_tensors(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def decodes_as_plain(engine_for, model, method: str, heads) -> None:
    spec = engine_for(method, model, heads=str(heads)).generate([PROMPT], CFG)
    assert spec[0].token_ids == engine_for("plain", model).generate([PROMPT], CFG)[0].token_ids


def llama_layer_config(head, **extra) -> dict:
    c = head.config
    return {"hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings": c.max_position_embeddings,
            "rope_theta": c.rope_theta, "vocab_size": int(head.target_config["vocab_size"]), **extra}


# --- published layouts ---------------------------------------------------------------------------------------------

def test_an_eagle_repository_eagle3_checkpoint_reads_as_its_tensors(engine_for, saved_llama, tmp_path):
    target = Target(saved_llama, fast=False)
    head = random_head(target, "eagle3", draft_vocab_size=100)
    tensors = dict(head.state_dict())                               # the EAGLE repository's names are spekit's
    tensors["embed_tokens.weight"] = saved_llama.get_input_embeddings().weight.detach().clone()
    (tmp_path / "e3").mkdir()
    torch.save(tensors, tmp_path / "e3" / "pytorch_model.bin")      # as the EAGLE repository publishes them
    (tmp_path / "e3" / "config.json").write_text(json.dumps(llama_layer_config(
        head, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=100, num_hidden_layers=1)))
    same_tensors(head, load_head(tmp_path / "e3", target, "eagle3"))
    decodes_as_plain(engine_for, saved_llama, "eagle3", tmp_path / "e3")


def test_the_rope_scaling_a_checkpoint_names_is_kept(saved_llama, tmp_path):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    target = Target(saved_llama, fast=False)
    head = random_head(target, "eagle3", draft_vocab_size=100)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    (tmp_path / "e3").mkdir()
    save_file(dict(head.state_dict()), str(tmp_path / "e3" / "model.safetensors"))
    (tmp_path / "e3" / "config.json").write_text(json.dumps(llama_layer_config(
        head, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=100, rope_scaling=scaling)))
    back = load_head(tmp_path / "e3", target, "eagle3")
    want = LlamaRotaryEmbedding(LlamaConfig(hidden_size=64, num_attention_heads=4, rope_parameters={
        **scaling, "rope_theta": head.config.rope_theta})).inv_freq
    assert torch.allclose(back.rotary.inv_freq, want) and not torch.allclose(head.rotary.inv_freq, want)
    out = export(save_head(back, tmp_path / "own"), "vllm", tmp_path / "vllm")     # and out again
    assert json.loads((out / "config.json").read_text())["rope_scaling"]["rope_type"] == "llama3"


def test_an_eagle_repository_eagle1_checkpoint_with_its_bias_reads_as_its_tensors(engine_for, saved_llama,
                                                                                 tmp_path):
    target = Target(saved_llama, fast=False)
    head = random_head(target, "eagle", fc_bias=True)
    tensors = {("layers.0." + k[len("layer."):] if k.startswith("layer.") else k): v
               for k, v in head.state_dict().items()}
    tensors["embed_tokens.weight"] = saved_llama.get_input_embeddings().weight.detach().clone()
    (tmp_path / "e1").mkdir()
    save_file(tensors, str(tmp_path / "e1" / "model.safetensors"))
    (tmp_path / "e1" / "config.json").write_text(json.dumps(llama_layer_config(
        head, architectures=["LlamaForCausalLM"], num_hidden_layers=1)))
    back = load_head(tmp_path / "e1", target, "eagle")
    assert back.config.fc_bias
    same_tensors(head, back)
    out = export(save_head(back, tmp_path / "own"), "vllm", tmp_path / "vllm")   # the bias goes out and back in
    assert json.loads((out / "config.json").read_text())["bias"] is True
    again = load_head(out, target, "eagle")                                     # (the export is bf16)
    assert torch.equal(again.fc.bias, head.fc.bias.to(torch.bfloat16).float())
    decodes_as_plain(engine_for, saved_llama, "eagle", tmp_path / "e1")


def test_fasterdecoding_medusa_heads_read_as_their_tensors(engine_for, saved_llama, tmp_path):
    target = Target(saved_llama, fast=False)
    torch.manual_seed(3)
    tensors = {}
    for h in range(3):
        tensors[f"{h}.0.linear.weight"] = torch.randn(64, 64) * 0.1
        tensors[f"{h}.0.linear.bias"] = torch.randn(64) * 0.1
        tensors[f"{h}.1.weight"] = torch.randn(128, 64) * 0.3
    (tmp_path / "m").mkdir()
    save_file(tensors, str(tmp_path / "m" / "medusa_lm_head.safetensors"))
    (tmp_path / "m" / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1,
                                                           "base_model_name_or_path": "tiny"}))
    head = load_head(tmp_path / "m", target, "medusa")
    assert torch.equal(head.blocks[2].layers[0].weight, tensors["2.0.linear.weight"])
    assert torch.equal(head.lm_heads[1].weight, tensors["1.1.weight"])
    decodes_as_plain(engine_for, saved_llama, "medusa", tmp_path / "m")


def test_a_deepseek_checkpoints_mtp_layers_read_through_heads(engine_for, saved_llama, tmp_path):
    tiny_deepseek(0).save_pretrained(tmp_path / "ds")             # a model without MTP layers of its own
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "ds").eval()
    target = Target(model, fast=False)
    torch.manual_seed(1)
    head = MtpHead.create(target, num_modules=2, init_from_target=False)
    tensors = {**load_file(str(tmp_path / "ds" / "model.safetensors")), **_deepseek_tensors(head, target)}
    save_file(tensors, str(tmp_path / "ds" / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((tmp_path / "ds" / "config.json").read_text())
    (tmp_path / "ds" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 2}))
    same_tensors(head, load_head(tmp_path / "ds", target, "mtp"))
    decodes_as_plain(engine_for, model, "mtp", tmp_path / "ds")
    with pytest.raises(UserError, match="hidden size 64|vocabulary"):
        load_head(tmp_path / "ds", Target(tiny_deepseek_other(), fast=False), "mtp")


def tiny_deepseek_other():
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    model = tiny_deepseek(2)
    cfg = DeepseekV3Config(**{**model.config.to_dict(), "vocab_size": 96})
    return DeepseekV3ForCausalLM(cfg).eval()


# --- round trips through the speculators format ----------------------------------------------------------------------

@pytest.mark.parametrize("draft_vocab", [100, 128])
def test_eagle3_heads_round_trip_through_the_speculators_format(engine_for, saved_llama, tmp_path,
                                                                draft_vocab):
    target = Target(saved_llama, fast=False)
    head = random_head(target, "eagle3", draft_vocab_size=draft_vocab, layers=(1, 2, 4))
    out = export(save_head(head, tmp_path / "own"), "speculators", tmp_path / "out")
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    assert config["speculators_config"]["verifier"]["name_or_path"] == saved_llama.name_or_path
    assert ("d2t" in load_file(str(out / "model.safetensors"))) == (draft_vocab < 128)
    same_tensors(head, load_head(out, target, "eagle3"))
    decodes_as_plain(engine_for, saved_llama, "eagle3", out)


def test_mtp_modules_round_trip_through_the_speculators_format(engine_for, saved_qwen3, tmp_path, capsys):
    target = Target(saved_qwen3, fast=False)
    head = random_head(target, "mtp", num_modules=2, draft_vocab=50)
    out = export(save_head(head, tmp_path / "own"), "speculators", tmp_path / "out")
    assert "2 distinct MTP modules" in capsys.readouterr().err
    config = json.loads((out / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 2 and len(config["spekit"]["token_map"]) == 50
    back = load_head(out, target, "mtp")
    same_tensors(head, back)
    decodes_as_plain(engine_for, saved_qwen3, "mtp", out)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_shipped_heads_round_trip_through_the_speculators_format(method, tmp_path, monkeypatch, always_draft):
    """The shipped SmolLM2-135M heads, exported and read back: the same tensors, the same output and tau."""
    from spekit import proposers
    from spekit.backends.torch_models import load_model
    from spekit.engine import Engine
    from spekit.heads.base import shipped_dir
    monkeypatch.setattr(eagle_proposer, "_level_cost", lambda head, target: 0.0)
    loaded = load_model("smollm2-135m")
    target = Target(loaded.model)
    shipped = shipped_dir(method, target)
    out = export(shipped, "speculators", tmp_path / "out")
    same_tensors(load_head(shipped, target, method), load_head(out, target, method))
    prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "Name three uses of Python."}],
                                                   add_generation_prompt=True)
    prompt = prompt if isinstance(prompt, list) else prompt["input_ids"]
    cls = proposers.get(method)
    runs = [Engine(target, cls(target, cls.Options(heads=str(d)))).generate([prompt], SamplingConfig(
        max_new_tokens=24))[0] for d in (shipped, out)]
    assert runs[0].token_ids == runs[1].token_ids and runs[0].stats.tau == runs[1].stats.tau


# --- bad input -----------------------------------------------------------------------------------------------------

@pytest.fixture
def speculators_eagle3(saved_llama, tmp_path):
    head = random_head(Target(saved_llama, fast=False), "eagle3", draft_vocab_size=100, layers=(1, 2, 4))
    return export(save_head(head, tmp_path / "own"), "speculators", tmp_path / "e3")


def edited(folder, tmp_path, change) -> str:
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    config = json.loads((bad / "config.json").read_text())
    change(config)
    (bad / "config.json").write_text(json.dumps(config))
    return str(bad)


@pytest.mark.parametrize("change, words", [
    (lambda c: c.update(speculators_model_type="dflash"), "'dflash' is not one spekit reads; supported: eagle3, mtp"),
    (lambda c: c["transformer_layer_config"].update(hidden_size=32), "hidden size 32, this model has 64"),
    (lambda c: c["transformer_layer_config"].update(vocab_size=96), "vocabulary of 96 tokens, this model has 128"),
    (lambda c: c.update(eagle_aux_hidden_state_layer_ids=[1, 2, 9]), r"\[9\] are out of range"),
    (lambda c: c.update(norm_before_residual=True), "sets norm_before_residual"),
    (lambda c: c["transformer_layer_config"].update(model_type="qwen3"), "'qwen3' decoder layer"),
])
def test_a_speculators_drafter_that_does_not_fit_is_refused(saved_llama, speculators_eagle3, tmp_path,
                                                           change, words):
    with pytest.raises(UserError, match=words):
        load_head(edited(speculators_eagle3, tmp_path, change), Target(saved_llama, fast=False), "eagle3")


def test_another_targets_embedding_and_a_wrong_method_are_refused(llama, speculators_eagle3):
    with pytest.raises(UserError, match=r"\[4\] are out of range"):         # llama: 2 layers
        load_head(speculators_eagle3, Target(llama, fast=False), "eagle3")
    with pytest.raises(UserError, match="holds a 'eagle3' drafter"):
        load_head(speculators_eagle3, Target(llama, fast=False), "mtp")


def test_a_truncated_weights_file_is_refused(saved_llama, speculators_eagle3):
    weights = speculators_eagle3 / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(UserError, match="corrupt or truncated"):
        load_head(speculators_eagle3, Target(saved_llama, fast=False), "eagle3")


def test_a_folder_of_no_known_layout_names_the_layouts_tried(saved_llama, tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UserError, match="GPT2LMHeadModel.*layouts tried: spekit head.*speculators.*EAGLE-3.*"
                                        "EAGLE-1.*Medusa.*DeepSeek-V3"):
        load_head(tmp_path / "x", Target(saved_llama, fast=False), "eagle3")
    (tmp_path / "y").mkdir()
    with pytest.raises(UserError, match="no config.json.*layouts tried"):
        load_head(tmp_path / "y", Target(saved_llama, fast=False), "eagle3")


def test_export_to_speculators_refuses_what_it_cannot_write_and_writes_nothing(saved_llama, tmp_path):
    medusa = save_head(HEADS["medusa"].create(Target(saved_llama, fast=False)), tmp_path / "medusa")
    out = tmp_path / "out"
    assert main(["export", str(medusa), "--to", "speculators", "--out", str(out)]) == 2
    eagle3 = save_head(random_head(Target(saved_llama, fast=False), "eagle3", draft_vocab_size=100), tmp_path / "e3")
    (eagle3 / "model.safetensors").write_bytes((eagle3 / "model.safetensors").read_bytes()[:500])
    assert main(["export", str(eagle3), "--to", "speculators", "--out", str(out)]) == 2
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


# --- engine-config: the launch command for a speculators folder ------------------------------------------------------

def test_engine_config_serves_a_speculators_folder_with_vllm(speculators_eagle3, saved_llama, capsys):
    from spekit.commands.engine_config import engine_config
    cfg = engine_config("vllm", "eagle3", heads=str(speculators_eagle3))
    assert cfg["command"] == ["vllm", "serve", str(speculators_eagle3)]
    assert any(saved_llama.name_or_path in note and "--speculative-config" in note for note in cfg["notes"])
    with pytest.raises(UserError, match="speculators format, which sglang does not load here: export the spekit "
                                        "heads with --to sglang"):
        engine_config("sglang", "eagle3", heads=str(speculators_eagle3))
    with pytest.raises(UserError, match="holds exported 'eagle3' heads, not 'mtp'"):
        engine_config("vllm", "mtp", heads=str(speculators_eagle3))
    assert main(["engine-config", "--engine", "vllm", "--method", "eagle3", "--heads", str(speculators_eagle3)]) == 0
    assert capsys.readouterr().out.startswith(f"vllm serve {speculators_eagle3}")
