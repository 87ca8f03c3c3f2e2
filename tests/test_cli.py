"""The CLI contract: flags, JSON fields, and a clear one-line error with exit code 2 for bad input."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from tokenizers import ByteLevelBPETokenizer
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from spekit.commands import main
from spekit.config import SamplingConfig

TEXT = ["the quick brown fox jumps over the lazy dog", "speculative decoding drafts and verifies tokens",
        "one two three four five six seven eight nine ten"] * 20


def _save_tiny(folder, vocab_size: int | None = None, layers: int = 2, seed: int = 0, bpe_size: int = 300):
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(TEXT, vocab_size=bpe_size, min_frequency=1, special_tokens=["<eos>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<eos>")
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size or len(tok), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


def _with_template(folder: str, template: str) -> str:
    """A saved model's tokenizer given a chat template."""
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = template
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _save_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory):
    return _save_tiny(tmp_path_factory.mktemp("draft"), layers=1, seed=1)


@pytest.fixture(scope="module")
def other_vocab(tmp_path_factory):
    return _save_tiny(tmp_path_factory.mktemp("other"), vocab_size=400, layers=1)


def _json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_json_fields_and_methods_agree(tiny, tiny_draft, capsys):
    outputs = {}
    for method, extra in [("plain", []), ("ngram", ["--ngram-max", "3"]), ("draft", ["--draft", tiny_draft])]:
        assert main(["generate", "--model", tiny, "--method", method, "--max-new-tokens", "24", "--json",
                     "--n", "2", *extra, "the quick brown fox", "one two three"]) == 0
        rows = _json_lines(capsys.readouterr().out)
        assert len(rows) == 4
        for row in rows:
            for key in ("prompt", "text", "token_ids", "prompt_tokens", "new_tokens", "method", "target_forwards",
                        "mean_accepted", "accept_hist", "wall_s", "tok_s", "finish_reason"):
                assert key in row, key
            assert row["method"] == method and row["new_tokens"] == len(row["token_ids"])
        outputs[method] = [r["token_ids"] for r in rows]
    assert outputs["plain"] == outputs["ngram"] == outputs["draft"]


def test_streaming_text_and_summary(tiny, capsys):
    assert main(["generate", "--model", tiny, "--max-new-tokens", "10", "--raw", "the lazy dog"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip()
    assert "tok/s" in captured.err and "tau" in captured.err


def test_compare_sets_the_method_against_plain(tiny, capsys):
    prompts = ["the quick brown fox the quick brown fox", "one two three one two three"]
    assert main(["generate", "--model", tiny, "--raw", "--max-new-tokens", "12", "--method", "ngram", "--compare",
                 "--json", *prompts]) == 0
    captured = capsys.readouterr()
    assert [r["method"] for r in _json_lines(captured.out)] == ["ngram", "ngram"]
    assert "ngram is " in captured.err and "2 of 2 answers identical to plain's" in captured.err
    assert main(["generate", "--model", tiny, "--raw", "--max-new-tokens", "8", "--method", "ngram", "--compare",
                 "--temperature", "0.8", "hi there"]) == 0
    assert "same distribution, not the same texts" in capsys.readouterr().err
    assert main(["generate", "--model", tiny, "--compare", "hi"]) == 2
    assert "give --method" in capsys.readouterr().err


def test_device_auto_takes_the_gpu_where_there_is_one_and_bad_devices_are_one_line_errors(tiny, capsys,
                                                                                           monkeypatch):
    from spekit.commands import chosen_device
    assert main(["generate", "--model", tiny, "--raw", "--max-new-tokens", "4", "hi"]) == 0   # default: auto
    if not torch.cuda.is_available():
        assert "CUDA GPU is present" not in capsys.readouterr().err
        for device, words in (("gpu7", "bad device 'gpu7'"), ("cuda:1", "CUDA is not available")):
            assert main(["generate", "--model", tiny, "--device", device, "hi"]) == 2
            err = capsys.readouterr().err
            assert words in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert chosen_device("auto") == "cuda" and chosen_device("cuda:1") == "cuda:1" and chosen_device("cpu") == "cpu"
    assert "a CUDA GPU is present: running on cuda (--device cpu keeps to the CPU)" in capsys.readouterr().err
    assert main(["generate", "--model", tiny, "--device", "cuda:2", "hi"]) == 2
    assert "this machine has 2 CUDA device(s), cuda:0 to cuda:1" in capsys.readouterr().err


def test_the_command_line_builds_its_flags_without_importing_transformers():
    """`--help`, a mistyped flag and the commands that load no model (engine-config, advise --explain) start in
    about half the time: the methods' and heads' modules import transformers where they use it."""
    code = ("import sys, spekit.commands; spekit.commands.build_parser(); "
            "spekit.commands.main(['engine-config', '--engine', 'vllm', '--method', 'ngram']); "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "False"


def test_same_seed_same_sample(tiny, capsys):
    args = ["generate", "--model", tiny, "--temperature", "0.9", "--top-p", "0.9", "--seed", "7",
            "--max-new-tokens", "16", "--json", "the quick"]
    main(args)
    first = _json_lines(capsys.readouterr().out)
    main(args)
    assert first == [dict(r, wall_s=first[i]["wall_s"], tok_s=first[i]["tok_s"], draft_s=first[i]["draft_s"],
                          verify_s=first[i]["verify_s"])
                     for i, r in enumerate(_json_lines(capsys.readouterr().out))]


def test_penalties_and_logit_bias_reach_the_engine(tiny, capsys):
    """--logit-bias ID:BIAS bans (-100) or favours tokens; frequency / presence penalties change the greedy text."""
    base = ["generate", "--model", tiny, "--raw", "--max-new-tokens", "12", "--json", "--method", "ngram"]
    assert main([*base, "the quick brown fox"]) == 0
    [free] = _json_lines(capsys.readouterr().out)
    banned = free["token_ids"][0]
    assert main([*base, "--logit-bias", f"{banned}:-100", "--frequency-penalty", "1.5", "--",
                 "the quick brown fox"]) == 0
    [biased] = _json_lines(capsys.readouterr().out)
    assert banned not in biased["token_ids"]
    assert main([*base, "--logit-bias", "7:100", "--", "the quick brown fox"]) == 0
    assert set(_json_lines(capsys.readouterr().out)[0]["token_ids"]) == {7}


def test_text_stop_sequences_end_the_sample(tiny, capsys):
    """--stop TEXT: the sample ends once its text holds the stop (fewer tokens decoded), the text is cut before it,
    its tokens run to the one that completed it; streamed or not, alone or in a batch."""
    base = ["generate", "--model", tiny, "--raw", "--max-new-tokens", "24", "--method", "ngram"]
    assert main([*base, "--json", "the quick brown fox", "one two three"]) == 0
    free = _json_lines(capsys.readouterr().out)
    stop = free[0]["text"][6:9]
    assert stop and len(free[0]["text"]) > 12
    assert main([*base, "--json", "--stop", stop, "--stop", "never appears", "the quick brown fox",
                 "one two three"]) == 0
    cut = _json_lines(capsys.readouterr().out)
    assert cut[0]["text"] == free[0]["text"][: free[0]["text"].index(stop)] and cut[0]["finish_reason"] == "stop"
    assert cut[0]["new_tokens"] < free[0]["new_tokens"]
    assert cut[0]["token_ids"] == free[0]["token_ids"][: cut[0]["new_tokens"]]
    if stop not in free[1]["text"]:
        assert cut[1]["token_ids"] == free[1]["token_ids"], "the other row runs on"
    assert main([*base, "--stop", stop, "the quick brown fox"]) == 0
    assert capsys.readouterr().out == cut[0]["text"] + "\n"


def test_prompts_file_in_batches_equals_one_batch(tiny, tmp_path, capsys):
    prompts = ["the quick brown fox", "one two three", "the lazy dog", "four five"]
    lines = tmp_path / "p.jsonl"
    lines.write_text("\n".join(json.dumps({"prompt": p}) for p in prompts[1:]) + "\n")
    base = ["generate", "--model", tiny, "--raw", "--max-new-tokens", "12", "--json", "--method", "ngram"]
    assert main([*base, *prompts]) == 0
    together = _json_lines(capsys.readouterr().out)
    assert main([*base, "--prompts-file", str(lines), "--batch-size", "2", prompts[0]]) == 0
    captured = capsys.readouterr()
    batched = _json_lines(captured.out)
    assert [r["prompt_index"] for r in batched] == [0, 1, 2, 3] and "tau" in captured.err
    assert [(r["prompt"], r["token_ids"]) for r in batched] == [(r["prompt"], r["token_ids"]) for r in together]

def test_one_prompt_from_a_file_streams_like_a_typed_one(tiny, tmp_path, capsys):
    """A --prompts-file holding the only prompt takes the streamed path (it once read the typed prompts there)."""
    (tmp_path / "one.txt").write_text("the quick brown fox\n")
    base = ["generate", "--model", tiny, "--raw", "--max-new-tokens", "8", "--method", "ngram"]
    assert main([*base, "the quick brown fox"]) == 0
    typed = capsys.readouterr().out
    assert main([*base, "--prompts-file", str(tmp_path / "one.txt")]) == 0
    assert capsys.readouterr().out == typed



@pytest.mark.parametrize("args, words", [
    (["  "], "empty"),
    ([], "--prompts-file"),
    (["--prompts-file", "/nonexistent.txt"], "not found"),
    (["--batch-size", "0", "hi", "ho"], "--batch-size"),
    (["--logprobs", "hi"], "--json"),
    (["--temperature", "nan", "hi"], "finite"),
    (["--repetition-penalty", "inf", "hi"], "finite"),
    (["--stop-ids", "-5", "--", "hi"], "token ids"),
    (["--logit-bias", "5x", "--", "hi"], "TOKEN_ID:BIAS"),
    (["--logit-bias", "5:-200", "--", "hi"], "logit_bias"),
    (["--logit-bias", "99999:1", "--", "hi"], "vocabulary"),
    (["--stop-ids", "99999", "--", "hi"], "stop id 99999"),
    (["--frequency-penalty", "nan", "hi"], "finite"),
    (["--top-logprobs", "21", "--json", "hi"], "top_logprobs"),
    (["--temperature", "-1", "hi"], "temperature"),
    (["--top-p", "0", "hi"], "top_p"),
    (["--top-p", "1.5", "hi"], "top_p"),
    (["--method", "nope", "hi"], "unknown method"),
    (["--ngram-max", "2", "hi"], "does not take"),
])
def test_bad_input_one_line_error(tiny, capsys, args, words):
    assert main(["generate", "--model", tiny, *args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err and "Traceback" not in err


def test_files_that_are_not_models_are_named(tiny, tmp_path, capsys):
    (tmp_path / "fake.gguf").write_text("not a gguf")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{broken")
    heads = "spekit/data/heads/smollm2-135m/eagle3"
    for args, words in [(["--model", str(tmp_path / "fake.gguf")], "cannot load"),
                        (["--model", str(tmp_path / "broken")], "cannot load"),
                        (["--model", tiny, "--method", "draft", "--draft", heads], "--heads")]:
        assert main(["generate", *args, "hi"]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and words in err, err


def test_a_huge_max_new_tokens_sizes_the_cache_to_the_context(monkeypatch):
    from conftest import make_engine, tiny_llama
    from spekit.backends.torch_target import Target
    seen = []
    real = Target.prefilled
    monkeypatch.setattr(Target, "prefilled", lambda self, prompts, slots, hidden=False: (
        seen.append(slots), real(self, prompts, slots, hidden))[1])
    every_token = tuple(range(128))                # the answer ends at its first token
    make_engine("plain", tiny_llama(seed=0)).generate([[5, 6, 7]], SamplingConfig(max_new_tokens=10 ** 9,
                                                                                  stop_ids=every_token))
    assert seen and seen[0] <= 512 + 256          # the tiny model's context + the draft slack


def test_prompt_longer_than_context(tiny, capsys):
    assert main(["generate", "--model", tiny, "--raw", "fox " * 400]) == 2
    assert "context" in capsys.readouterr().err


@pytest.fixture(scope="module")
def other_merges(tmp_path_factory):
    """A draft whose byte-level BPE has other merges (another vocabulary size, other ids for the same text)."""
    return _save_tiny(tmp_path_factory.mktemp("merges"), layers=1, bpe_size=280)


def test_a_draft_of_another_vocabulary_gives_plains_answers(tiny, other_vocab, other_merges, capsys):
    """Another size of the model's vocabulary, or another tokenizer: the draft crosses through the text, and the
    answers are plain's (tests/test_cross_vocab.py states the guarantees)."""
    outputs = {}
    for name, extra in [("plain", []), ("size", ["--method", "draft", "--draft", other_vocab]),
                        ("merges", ["--method", "draft", "--draft", other_merges])]:
        assert main(["generate", "--model", tiny, "--max-new-tokens", "16", "--json", *extra,
                     "the quick brown fox"]) == 0
        outputs[name] = [r["token_ids"] for r in _json_lines(capsys.readouterr().out)]
    assert outputs["plain"] == outputs["size"] == outputs["merges"]


def test_a_draft_larger_than_the_target_is_refused(tiny, tmp_path, capsys):
    big = _save_tiny(tmp_path / "big", layers=4, bpe_size=280)
    assert main(["generate", "--model", tiny, "--method", "draft", "--draft", big, "hi"]) == 2
    err = capsys.readouterr().err
    assert "not smaller" in err and "Traceback" not in err


def test_missing_model_path_through_the_real_command(tmp_path):
    missing = str(tmp_path / "no-such-model")
    proc = subprocess.run([sys.executable, "-m", "spekit", "generate", "--model", missing, "hi"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "not found" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_version_names_the_installed_package(capsys):
    import spekit
    with pytest.raises(SystemExit) as stop:
        main(["--version"])
    assert stop.value.code == 0
    assert capsys.readouterr().out.strip() == f"spekit {spekit.__version__}"
    assert spekit.__version__[0].isdigit()


def test_bench_quick_side_by_side(tiny, tiny_draft, tmp_path, capsys):
    """`spekit bench --quick` runs spekit's methods and Hugging Face's peers on the same questions, prints a table
    and one JSON line with per-category tok/s, speedup, tau and identity with plain."""
    questions = tmp_path / "q.jsonl"
    questions.write_text("\n".join(json.dumps(q) for q in [
        {"question_id": 1, "category": "writing", "turns": ["the quick brown fox", "and then?"]},
        {"question_id": 2, "category": "summarization", "turns": ["one two three four five one two three"]},
        {"question_id": 3, "category": "summarization", "turns": ["the lazy dog the lazy dog"]}]) + "\n")
    out = tmp_path / "report.json"
    assert main(["bench", "--quick", "--model", tiny, "--draft", tiny_draft, "--questions", str(questions),
                 "--max-new-tokens", "12", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    report = json.loads(lines[-1])
    assert json.loads(out.read_text()) == report
    assert report["categories"] == ["mt_bench", "summarization", "overall"]
    assert {"plain", "ngram", "draft", "hf-plain", "hf-lookup", "hf-assistant"} <= set(report["results"])
    for method, cells in report["results"].items():
        assert cells["overall"]["prompts"] == 3 and cells["overall"]["tok_s"] > 0
        assert cells["overall"]["identical"] == 1.0, method           # greedy: everyone equals plain
    assert report["results"]["plain"]["overall"]["tau"] == 1.0
    assert any(line.startswith("ngram") for line in lines)


@pytest.mark.parametrize("line", ['{"turns": 3}', '{"prompt": ""}', '{not json'])
def test_bench_bad_question_file(tiny, tmp_path, capsys, line):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(line + "\n")
    assert main(["bench", "--quick", "--model", tiny, "--questions", str(bad)]) == 2
    assert f"{bad}:1: not a question record" in capsys.readouterr().err


def test_bench_on_your_own_prompts(tiny, tmp_path, capsys):
    """A file of plain prompts (and {"prompt": ...} records) is a question file too: category "prompts"."""
    prompts = tmp_path / "mine.txt"
    prompts.write_text('the quick brown fox\n\n{"prompt": "one two three one two three"}\n')
    assert main(["bench", "--quick", "--model", tiny, "--questions", str(prompts), "--methods", "plain,ngram",
                 "--max-new-tokens", "8"]) == 0
    report = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert report["categories"] == ["prompts", "overall"]
    assert report["results"]["ngram"]["prompts"]["prompts"] == 2


def test_relaxed_is_lossy_and_says_so(tiny, tmp_path, capsys):
    """--relaxed (opt-in, lossy) marks every output of a drafting method: the summary line, --json, the bench."""
    base = ["generate", "--model", tiny, "--raw", "--max-new-tokens", "16", "--relaxed", "1.5"]
    assert main([*base, "--method", "ngram", "the quick brown fox"]) == 0
    assert "LOSSY" in capsys.readouterr().err
    assert main([*base, "--method", "ngram", "--json", "the quick brown fox"]) == 0
    assert json.loads(capsys.readouterr().out)["lossless"] is False
    assert main([*base, "--relaxed", "-1", "hi"]) == 2 and "relaxed must be >= 0" in capsys.readouterr().err
    prompts = tmp_path / "mine.txt"
    prompts.write_text("the quick brown fox\n")
    assert main(["bench", "--quick", "--model", tiny, "--questions", str(prompts), "--methods", "plain,ngram",
                 "--max-new-tokens", "8", "--relaxed", "1.5"]) == 0
    out = capsys.readouterr().out
    report = json.loads(out.splitlines()[-1])
    assert report["contestants"]["ngram"]["lossless"] is False and report["contestants"]["plain"]["lossless"]
    assert "ngram*" in out
