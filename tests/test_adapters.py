"""Fine-tuned adapters: `--model ADAPTER_DIR` is the adapter merged into the base it names, exactly the model PEFT
computes; every method stays lossless on it; `spekit merge` saves it as a plain folder; bad input is a one-line
error with exit code 2 and leaves nothing on disk."""
from __future__ import annotations

import json

import pytest
import torch

from spekit.commands import main
from spekit.config import SamplingConfig
from spekit.backends.torch_models import load_model, resolve
from tests.test_cli import _save_tiny

peft = pytest.importorskip("peft")


def _save_adapter(base: str, folder, seed: int = 3) -> str:
    """A LoRA on every attention and MLP projection, with random (not zero) B matrices so that it changes the model."""
    model = load_model(base).model
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    wrapped = peft.get_peft_model(model, cfg)
    wrapped.save_pretrained(folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == base
    return str(folder)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return _save_tiny(tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def adapter(base, tmp_path_factory):
    return _save_adapter(base, tmp_path_factory.mktemp("lora"))


def _logits(model, ids):
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def test_adapter_folder_is_the_merged_model(base, adapter):
    assert resolve(adapter).kind == "adapter"
    ours = load_model(adapter)
    reference = peft.PeftModel.from_pretrained(load_model(base).model, adapter).eval()   # unmerged: LoRA beside
    ids = ours.tokenizer("the quick brown fox").input_ids
    torch.testing.assert_close(_logits(ours.model, ids), _logits(reference, ids), rtol=1e-4, atol=1e-5)
    assert not torch.allclose(_logits(ours.model, ids), _logits(load_model(base).model, ids), atol=1e-3)
    assert all(type(m) is not peft.tuners.lora.Linear for m in ours.model.modules())      # plain layers, merged


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_methods_stay_lossless_on_an_adapter(adapter, dtype):
    from spekit.api import Spekit
    sk = Spekit.load(adapter, "plain", dtype=dtype)
    prompts = ["the quick brown fox jumps over", "one two three four five"]
    cfg = SamplingConfig(max_new_tokens=24)
    plain = [g.result.token_ids for g in sk.generate(prompts, cfg)]
    for method in ("ngram", "lookahead", "recycle"):
        assert [g.result.token_ids for g in sk.with_method(method).generate(prompts, cfg)] == plain, method


def test_cli_generate_on_an_adapter(adapter, capsys):
    assert main(["generate", "--model", adapter, "--method", "ngram", "--max-new-tokens", "8", "--json", "--raw",
                 "the lazy dog"]) == 0
    row = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert row["new_tokens"] == 8


def test_merge_writes_a_folder_that_loads_as_the_same_model(base, adapter, tmp_path, capsys):
    out = tmp_path / "merged"
    assert main(["merge", "--adapter", adapter, "--out", str(out), "--dtype", "float32"]) == 0
    assert str(out) in capsys.readouterr().out
    assert resolve(str(out)).kind == "folder" and not (out / "adapter_config.json").exists()
    ids = [5, 6, 7, 8]
    torch.testing.assert_close(_logits(load_model(str(out)).model, ids), _logits(load_model(adapter).model, ids))
    assert [p.name for p in tmp_path.iterdir()] == ["merged"]               # no temporary folder left


def test_merge_onto_a_base_given_when_the_named_one_is_out_of_reach(base, adapter, tmp_path, capsys):
    moved = tmp_path / "lora"
    moved.mkdir()
    for f in __import__("pathlib").Path(adapter).iterdir():
        (moved / f.name).write_bytes(f.read_bytes())
    config = json.loads((moved / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = "SomeOrg/not-on-this-machine"
    (moved / "adapter_config.json").write_text(json.dumps(config))
    assert main(["generate", "--model", str(moved), "--max-new-tokens", "4", "hi"]) == 2
    err = capsys.readouterr().err
    assert "'SomeOrg/not-on-this-machine', which cannot be loaded here" in err and "spekit merge --model BASE" in err
    assert main(["merge", "--model", base, "--adapter", str(moved), "--out", str(tmp_path / "m"),
                 "--dtype", "float32"]) == 0
    ids = [9, 10, 11]
    torch.testing.assert_close(_logits(load_model(str(tmp_path / "m")).model, ids),
                               _logits(load_model(adapter).model, ids))


def test_merge_refuses_bad_input_before_loading(adapter, tmp_path, capsys):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("mine")
    assert main(["merge", "--adapter", adapter, "--out", str(taken)]) == 2
    assert "exists and is not an empty folder" in capsys.readouterr().err
    assert (taken / "x").read_text() == "mine"
    assert main(["merge", "--adapter", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "no adapter_config.json" in capsys.readouterr().err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "adapter_config.json").write_text("{}")
    assert main(["merge", "--adapter", str(tmp_path / "bad"), "--out", str(tmp_path / "o")]) == 2
    assert "names no base model" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    (tmp_path / "bad" / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tmp_path / "bad")}))
    assert main(["generate", "--model", str(tmp_path / "bad"), "hi"]) == 2
    assert "names the adapter itself as its base model" in capsys.readouterr().err


def test_adapter_without_readable_weights_is_refused_before_the_base_loads(adapter, tmp_path, capsys):
    """No weights beside the config (peft would look for them on the hub), or a truncated safetensors file: a
    one-line error, as for a head folder; a base the user named that cannot load is named as theirs."""
    from pathlib import Path
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "adapter_config.json").write_bytes((Path(adapter) / "adapter_config.json").read_bytes())
    for argv in (["merge", "--adapter", str(bare), "--out", str(tmp_path / "o")],
                 ["generate", "--model", str(bare), "hi"]):
        assert main(argv) == 2
        assert "but no weights" in capsys.readouterr().err
    cut = tmp_path / "cut"
    cut.mkdir()
    (cut / "adapter_config.json").write_bytes((Path(adapter) / "adapter_config.json").read_bytes())
    (cut / "adapter_model.safetensors").write_bytes((Path(adapter) / "adapter_model.safetensors").read_bytes()[:7])
    for argv in (["merge", "--adapter", str(cut), "--out", str(tmp_path / "o")],
                 ["generate", "--model", str(cut), "hi"]):
        assert main(argv) == 2
        assert "corrupt or truncated" in capsys.readouterr().err
    assert main(["merge", "--adapter", adapter, "--model", str(tmp_path / "nomodel"), "--out",
                 str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and "is for the base model" not in err
    assert not (tmp_path / "o").exists()


def test_without_peft_the_error_says_what_to_install(adapter, monkeypatch):
    import builtins
    real = builtins.__import__

    def no_peft(name, *args, **kwargs):
        if name == "peft":
            raise ImportError("no peft")
        return real(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_peft)
    with pytest.raises(Exception, match=r"pip install 'spekit\[lora\]'"):
        load_model(adapter)


def test_folders_written_through_a_temporary_place_get_the_usual_modes(tmp_path, adapter):
    """mkdtemp's 0700 must not reach what others read: a merged model, a head or datastore folder."""
    import os
    from spekit.heads.base import write_dir
    mask = os.umask(0)
    os.umask(mask)
    head = write_dir(tmp_path / "head", {"w": torch.zeros(2)}, {"kind": "datastore", "target": {}})
    assert main(["merge", "--adapter", adapter, "--out", str(tmp_path / "merged")]) == 0
    for folder in (head, tmp_path / "merged"):
        assert folder.stat().st_mode & 0o777 == 0o777 & ~mask
        assert all(f.stat().st_mode & 0o777 == 0o666 & ~mask for f in folder.iterdir())
