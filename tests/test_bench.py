"""`spekit bench` (Spec-Bench answers, resume, two turns, sweeps with plots and HTML, the trade-off report),
`spekit advise` and `spekit engine-config`, on tiny saved models."""
from __future__ import annotations

import json
import re
import shlex
import time

import pytest

from spekit.bench.questions import encode_turn
from spekit.bench.runner import Settings, converse, measure
from spekit.bench.contestants import Contestant, Outcome
from spekit.commands import main
from test_cli import _save_tiny

QUESTIONS = [{"question_id": 1, "category": "writing", "turns": ["the quick brown fox", "and then the lazy dog?"]},
             {"question_id": 2, "category": "summarization", "turns": ["one two three four five one two three"]},
             {"question_id": 3, "category": "qa", "turns": ["the lazy dog the lazy dog"]}]
FAST = ["--max-new-tokens", "6", "--raw"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return _save_tiny(tmp_path_factory.mktemp("tiny"))


@pytest.fixture()
def questions(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    return str(path)


def _report(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_answers_follow_spec_bench_schema_and_resume(tiny, questions, tmp_path, capsys):
    answers = tmp_path / "answers"
    args = ["bench", "--model", tiny, "--questions", questions, "--methods", "plain,ngram,hf-plain",
            "--answers", str(answers), *FAST]
    assert main(args) == 0
    first = _report(capsys.readouterr().out)
    assert first["questions"] == 3 and first["results"]["ngram"]["overall"]["identical"] == 1.0
    for name in ("plain", "ngram", "hf-plain"):
        rows = [json.loads(line) for line in (answers / f"{name}.jsonl").read_text().splitlines()]
        assert [r["question_id"] for r in rows] == [1, 2, 3]
        for r in rows:
            assert {"question_id", "answer_id", "model_id", "choices"} <= set(r)
            choice = r["choices"][0]
            assert len(choice["turns"]) == len(choice["new_tokens"]) == len(choice["wall_time"])
            assert isinstance(choice["accept_lengths"], list)
        assert len(rows[0]["choices"][0]["turns"]) == 2                          # both MT-bench turns
    plain = (answers / "plain.jsonl").read_text().splitlines()
    (answers / "ngram.jsonl").write_text("\n".join((answers / "ngram.jsonl").read_text().splitlines()[:1]) + "\n")
    assert main(args) == 0                                # resumes: only ngram's questions 2 and 3 are run
    assert (answers / "plain.jsonl").read_text().splitlines() == plain
    assert [json.loads(x)["question_id"] for x in (answers / "ngram.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert _report(capsys.readouterr().out)["questions"] == 3
    assert main(args[:-3] + ["--max-new-tokens", "7", "--raw"]) == 2                 # other settings: refused
    assert "other settings (max_new_tokens)" in capsys.readouterr().err


def test_second_turn_sees_the_first_answer(tiny):
    from spekit.api import Spekit
    sk = Spekit.load(tiny)
    seen: list[list[int]] = []

    def run(prompts, cfg):
        seen.extend(prompts)
        return [Outcome(sk.tokenizer.encode(" jumps over"), 0.1, 0.1) for _ in prompts]
    q = dict(QUESTIONS[0], raw_category="writing", category="mt_bench")
    rec = converse(Contestant("fake", "peer", run), [q], sk, Settings().sampling(), chat=False, model_id="t")[0]
    first_answer = rec["choices"][0]["turns"][0]
    assert "jumps" in first_answer and len(seen) == 2
    history = [{"role": "user", "content": q["turns"][0]}, {"role": "assistant", "content": first_answer},
               {"role": "user", "content": q["turns"][1]}]
    assert seen[1] == encode_turn(sk.tokenizer, history, chat=False)
    assert first_answer in sk.decode(seen[1])


def test_sweep_writes_pngs_html_and_tradeoffs(tiny, questions, tmp_path, capsys):
    from spekit.bench.tradeoffs import main as tradeoffs
    report = tmp_path / "report"
    assert main(["bench", "--model", tiny, "--questions", questions, "--methods", "plain,ngram", "--limit", "1",
                 "--categories", "summarization,qa", "--report", str(report), "--sweep", "batch=1,2",
                 "--sweep", "num_draft_tokens=2,4", "--sweep", "max_new_tokens=3,5", "--max-new-tokens", "4",
                 "--raw"]) == 0
    assert _report(capsys.readouterr().out)["report"].endswith("report.html")
    for png in ("speedup_by_category.png", "sweep_batch.png", "sweep_num_draft_tokens.png"):
        assert (report / png).read_bytes()[:4] == b"\x89PNG"
    page = (report / "report.html").read_text()
    assert page.count("data:image/png;base64,") >= 3 and "<script" not in page and "src='http" not in page
    record = json.loads((report / "run.json").read_text())
    assert [s["axis"] for s in record["sweeps"]] == ["batch", "num_draft_tokens", "max_new_tokens"]
    assert record["command"].startswith("spekit bench")
    md = tmp_path / "docs" / "TRADEOFFS.md"
    assert tradeoffs([str(report), "--out", str(md)]) == 0
    text = md.read_text()
    assert "Batch size erases the gain" in text and "speedup over plain at the same batch size" in text
    assert record["command"] in text and (md.parent / "tradeoffs" / "sweep_batch.png").is_file()
    assert "--sweep temperature" in text                                       # what this run did not record
    assert "Longer answers raise tau" in text and re.search(r"at 5 tokens, \d of \d turns of plain ran to the limit",
                                                            text)                    # (random tiny models never stop)


@pytest.mark.parametrize("engine, method, words", [
    ("vllm", "eagle3", ['--speculative-config', '"method": "eagle3"']),
    ("vllm", "ngram", ['"method": "ngram"', "prompt_lookup_max"]),
    ("sglang", "eagle", ["--speculative-algorithm EAGLE", "accept-threshold"]),
    ("trtllm", "eagle3", ["decoding_type: Eagle3", "trtllm-serve"]),
    ("llamacpp", "draft", ["llama-server", "-md d.gguf", "--draft-max"]),
    ("vllm", "rest", ['"method": "suffix"', "datastore file does not load there"]),
])
def test_engine_config_commands(capsys, engine, method, words):
    draft = ["--draft", "d.gguf"] if method == "draft" else []          # a flag the method does not use is refused
    assert main(["engine-config", "--engine", engine, "--method", method, *draft]) == 0
    out = capsys.readouterr().out
    for w in words:
        assert w in out, w


@pytest.mark.parametrize("engine, method, words", [
    ("sglang", "medusa", "sglang does not support method 'medusa'"),
    ("llamacpp", "lookahead", "llamacpp does not support method 'lookahead'"),
    ("vllm", "jacobi", "vllm does not support method 'jacobi'"),
    ("trtllm", "eagle3-lookup", "run --method eagle3"),
    ("sglang", "rest", "(engines that do: vllm)"),
    ("vllm", "nope", "unknown method"),
])
def test_engine_config_refusals(capsys, engine, method, words):
    assert main(["engine-config", "--engine", engine, "--method", method]) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1


def test_advise_within_budget_prints_a_command_that_runs(tiny, tmp_path, capsys):
    prompts = tmp_path / "p.txt"
    prompts.write_text("the quick brown fox the quick brown fox\none two three one two three\n")
    assert main(["advise", "--model", tiny, "--prompts", str(prompts), "--budget-s", "5", "--max-new-tokens",
                 "6"]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    last_round = [r for r in result["ranking"] if r["prompts"] == result["ranking"][0]["prompts"]]
    assert last_round[0]["speedup"] >= last_round[-1]["speedup"]    # those out earlier ran fewer prompts
    assert any(r["label"] == "plain" for r in result["ranking"])
    generate = shlex.split(result["commands"][0].replace("YOUR PROMPT", "the lazy dog"))
    assert generate[:2] == ["spekit", "generate"] and generate[0] + " " + generate[1] in out
    assert main(generate[1:]) == 0
    assert main(["advise", "--explain"]) == 0
    assert "ngram" in capsys.readouterr().out


def test_advise_under_a_grammar_measures_and_prints_it(tiny, tmp_path, capsys):
    """advise --regex: every setting answers under the grammar (the same answers as plain), and the command it
    prints carries the grammar."""
    prompts = tmp_path / "p.txt"
    prompts.write_text("the quick brown fox the quick brown fox\n")
    regex = "(one|two) zebra crossing at noon\\."
    assert main(["advise", "--model", tiny, "--prompts", str(prompts), "--budget-s", "5", "--max-new-tokens",
                 "30", "--regex", regex]) == 0
    out = capsys.readouterr().out
    result = json.loads(out.strip().splitlines()[-1])
    assert "answers held to the regex" in out and all(r["identical"] for r in result["ranking"])
    generate = shlex.split(result["commands"][0].replace("YOUR PROMPT", "the lazy dog"))
    assert generate[generate.index("--regex") + 1] == regex
    assert main(generate[1:]) == 0
    assert re.fullmatch(regex, capsys.readouterr().out.strip())


@pytest.mark.parametrize("args, words", [
    (["--questions", "/no/such/file.jsonl"], "question file not found"),
    (["--categories", "cooking"], "unknown category cooking"),
    (["--sweep", "batch"], "bad sweep spec"),
    (["--sweep", "colour=1,2", "--report", "r"], "cannot sweep 'colour'"),
    (["--sweep", "batch=1,two", "--report", "r"], "'two' is not a int"),
    (["--sweep", "batch=1,2"], "--sweep needs --report"),
    (["--methods", "plain,warp"], "unknown method or peer warp"),
    (["--methods", "plain,ngram:colour=2"], "ngram has no option 'colour'; it takes: num-draft-tokens"),
    (["--methods", "plain,ngram:num-draft-tokens=two"], "'two' is not a int (num-draft-tokens)"),
    (["--methods", "plain,ngram:num-draft-tokens"], "write METHOD:OPTION=VALUE"),
    (["--methods", "plain,ngram:num-draft-tokens=0"], "num_draft_tokens must be >= 1"),
    (["--methods", "plain,ngram:ngram-max=2,ngram:ngram_max=2"], "the same contestant twice"),
    (["--methods", "plain,hf-lookup:num-draft-tokens=2"], "unknown method or peer hf-lookup:num-draft-tokens=2"),
])
def test_bench_bad_input(tiny, questions, capsys, args, words):
    base = ["bench", "--model", tiny, "--questions", questions]
    if args[0] == "--questions":
        base = base[:-2]
    assert main(base + args) == 2
    err = capsys.readouterr().err
    assert words in err and len(err.strip().splitlines()) == 1, err


def test_variants_of_a_method_are_contestants_of_their_own_with_their_own_options(tiny, questions, tmp_path,
                                                                                  capsys, always_draft, monkeypatch):
    """`--methods ngram,ngram:num-draft-tokens=1`: both measured in the same lockstep run under their own names
    (answers, report, counterpart), the variant with its value over the run's flag, both identical to plain."""
    from spekit.bench import runner
    built = []
    real = runner.spekit_contestants

    def spy(*args, **kwargs):
        out, skipped = real(*args, **kwargs)
        built.extend((c.name, c.loaded.engine.proposer.options) for c in out)
        return out, skipped
    monkeypatch.setattr(runner, "spekit_contestants", spy)
    args = ["bench", "--model", tiny, "--questions", questions, "--lockstep", "--num-draft-tokens", "4",
            "--methods", "plain,ngram,ngram:num-draft-tokens=1:ngram-min=2", "--answers", str(tmp_path), *FAST]
    assert main(args) == 0
    report = _report(capsys.readouterr().out)
    variant = "ngram:num-draft-tokens=1:ngram-min=2"
    options = dict(built)
    assert options["ngram"].num_draft_tokens == 4 and options["ngram"].ngram_min == 1
    assert options[variant].num_draft_tokens == 1 and options[variant].ngram_min == 2
    assert list(report["results"]) == ["plain", "ngram", variant]
    assert report["contestants"][variant]["counterpart"] == "hf-lookup"
    for name in ("ngram", variant):
        assert report["results"][name]["overall"]["identical"] == 1.0
        assert (tmp_path / f"{name}.jsonl").is_file()
    vs = report["results"][variant]["overall"]
    assert vs["vs_method"] == round(vs["tok_s"] / report["results"]["ngram"]["overall"]["tok_s"], 3)
    assert vs["vs_method_interval"][0] <= vs["vs_method_interval"][1]
    assert "vs_method" not in report["results"]["ngram"]["overall"]
    # a drafted step of the variant offers one token at most
    assert len(report["results"][variant]["overall"]["position_acceptance"]) <= 1


def test_measure_lists_what_cannot_run(tiny, questions):
    from spekit.bench.questions import load_questions, pick
    qs = pick(load_questions(questions), 1, ["qa"])
    report = measure(Settings(model=tiny, max_new_tokens=4, chat=False), qs, ["plain", "draft", "hf-assistant",
                                                                              "llamacpp-lookup"], None)
    assert set(report["results"]) == {"plain"}
    assert "draft" in report["skipped"]["draft"] and "--draft" in report["skipped"]["hf-assistant"]
    assert "llama" in report["skipped"]["llamacpp-lookup"]


def test_hf_peers_are_skipped_with_a_reason_under_openai_penalties(tiny, questions):
    """transformers' generate has no frequency / presence penalty: its peers would answer another question."""
    from spekit.bench.questions import load_questions, pick
    qs = pick(load_questions(questions), 1, ["qa"])
    report = measure(Settings(model=tiny, max_new_tokens=4, chat=False, frequency_penalty=0.5), qs,
                     ["plain", "ngram", "hf-plain", "hf-lookup"], None)
    assert set(report["results"]) == {"plain", "ngram"}
    assert "frequency / presence penalty" in report["skipped"]["hf-lookup"]


def test_llamacpp_peers_against_its_documented_api(monkeypatch):
    """A stand-in with llama-cpp-python's documented API (Llama(model_path, n_ctx, draft_model, logits_all, verbose),
    Llama.generate(tokens, temp, top_k, top_p, repeat_penalty, reset, frequency_penalty, presence_penalty),
    token_eos(), reset(), llama_speculative.LlamaPromptLookupDecoding(num_pred_tokens)) checks the peer's calls (in
    seconds, whether or not llama-cpp-python is installed): a draft model needs logits_all, or llama-cpp-python's
    scores overflow past 512 tokens."""
    import importlib.machinery
    import sys
    import types
    from spekit.bench.peers import peer_contestants
    from spekit.config import SamplingConfig
    made = []

    class Llama:
        def __init__(self, model_path, n_ctx, draft_model, logits_all, verbose, n_threads):
            assert n_threads >= 1 and logits_all == (draft_model is not None)
            made.append((model_path, draft_model))

        def token_eos(self):
            return 9

        def reset(self):
            made.append("reset")

        def generate(self, tokens, temp, top_k, top_p, repeat_penalty, reset, frequency_penalty, presence_penalty):
            assert reset and temp == 0.0 and frequency_penalty == presence_penalty == 0.0
            yield from [tokens[-1] + 1, tokens[-1] + 2, 9, 4]

    class LlamaPromptLookupDecoding:
        def __init__(self, num_pred_tokens):
            self.n = num_pred_tokens
    root, spec = types.ModuleType("llama_cpp"), types.ModuleType("llama_cpp.llama_speculative")
    root.__spec__ = importlib.machinery.ModuleSpec("llama_cpp", None)
    root.Llama, spec.LlamaPromptLookupDecoding = Llama, LlamaPromptLookupDecoding
    monkeypatch.setitem(sys.modules, "llama_cpp", root)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama_speculative", spec)
    peers, skipped = peer_contestants(["llamacpp-plain", "llamacpp-lookup"], None, None, (), "/m.gguf", None)
    assert not skipped and [p.name for p in peers] == ["llamacpp-plain", "llamacpp-lookup"]
    assert made[0] == ("/m.gguf", None) and made[1][1].n == 10
    outs = peers[1].run([[1, 2, 3], [5]], SamplingConfig(max_new_tokens=8))
    assert [o.token_ids for o in outs] == [[4, 5, 9], [6, 7, 9]]
    assert made.count("reset") == 2, "each new question starts afresh (no prefix kept from the last one)"
    gen, seen = peers[1].steps([[1, 2, 3], [5]], SamplingConfig(max_new_tokens=8)), []
    while True:                             # a token per event, the rows one after another: tokens committed so far
        try:
            seen.append(next(gen))
        except StopIteration as stop:
            assert [o.token_ids for o in stop.value] == [[4, 5, 9], [6, 7, 9]]
            break
    assert seen == [1, 2, 3, 4, 5, 6]
    assert peers[0].run([[1]], SamplingConfig(max_new_tokens=1))[0].token_ids == [2]
    _, skipped = peer_contestants(["llamacpp-plain"], None, None, (), None, None)
    assert "GGUF" in skipped["llamacpp-plain"]


def test_a_method_added_later_is_measured_or_skipped_with_its_reason(tiny, questions, monkeypatch):
    """Methods come from the registry: a new one is measured with no change in the bench; one that cannot run
    (no heads for this model, at construction or when it starts decoding) is listed with its UserError."""
    from spekit.config import UserError
    from spekit.proposers import REGISTRY, get
    from spekit.bench.questions import load_questions, pick
    plain = get("plain")

    class Copy(plain):
        name = "copy-of-plain"

    class NoHeads(plain):
        name = "needs-heads"

        def __init__(self, target, options, draft=None):
            raise UserError("no needs-heads heads for this model (spekit/data/heads/<model>/)")

    class LateRefusal(plain):
        name = "late-refusal"

        def begin(self, ctx, hidden=None):
            raise UserError("refused when decoding starts")
    for cls in (Copy, NoHeads, LateRefusal):
        monkeypatch.setitem(REGISTRY, cls.name, cls)
    qs = pick(load_questions(questions), 1, ["qa"])
    report = measure(Settings(model=tiny, max_new_tokens=4, chat=False), qs,
                     ["plain", "copy-of-plain", "needs-heads", "late-refusal"], None)
    assert set(report["results"]) == {"plain", "copy-of-plain"}
    assert report["results"]["copy-of-plain"]["overall"]["identical"] == 1.0
    assert "no needs-heads heads" in report["skipped"]["needs-heads"]
    assert "refused when decoding starts" in report["skipped"]["late-refusal"]


def test_lockstep_takes_the_least_advanced_run_next_and_returns_each_ones_outcomes():
    from spekit.bench.lockstep import lockstep
    order: list[str] = []

    def run(name: str, per_step: int, steps: int):
        done = 0
        for _ in range(steps):
            order.append(name)
            done += per_step
            yield done
        return [Outcome([done], 0.0, 0.0)]
    got = lockstep({"slow": run("slow", 1, 4), "fast": run("fast", 2, 2)})
    assert got == {"slow": [Outcome([4], 0.0, 0.0)], "fast": [Outcome([4], 0.0, 0.0)]}
    # both pass the same token counts at about the same moment: slow's two steps, then fast's one, in turn
    assert order == ["slow", "fast", "slow", "slow", "fast", "slow"]


def test_a_lockstep_bench_answers_as_one_after_another_and_times_each_on_its_own_steps(tiny, questions, tmp_path,
                                                                                         capsys, always_draft):
    """Same answers (two turns each over its own history) as the sequential run, and the same report. Drafts are
    sized by costs measured on the clock, which differ run to run: always_draft fixes them, so τ must agree too."""
    reports = {}
    for lock in (False, True):
        args = ["bench", "--model", tiny, "--questions", questions, "--methods", "plain,ngram,jacobi",
                "--answers", str(tmp_path / f"a{lock}"), *FAST] + (["--lockstep"] if lock else [])
        assert main(args) == 0
        reports[lock] = _report(capsys.readouterr().out)
        for name in ("plain", "ngram", "jacobi"):
            rows = [json.loads(x) for x in (tmp_path / f"a{lock}" / f"{name}.jsonl").read_text().splitlines()]
            reports[lock][name] = [(r["question_id"], r["spekit"]["token_ids"]) for r in rows]
    assert reports[True]["settings"]["lockstep"] and not reports[False]["settings"]["lockstep"]
    for name in ("plain", "ngram", "jacobi"):
        assert reports[True][name] == reports[False][name] == reports[True]["plain"]
        assert reports[True]["results"][name]["overall"]["identical"] == 1.0
        assert reports[True]["results"][name]["overall"]["tau"] == reports[False]["results"][name]["overall"]["tau"]


def test_in_lockstep_each_method_leads_a_batch_in_turn(tiny, questions, tmp_path, monkeypatch):
    """The run named first prefills first, while the others' caches are not there yet (measured faster): the lead
    rotates batch by batch, so that no method, plain included, gets it every time."""
    from spekit.bench import runner
    leads = []
    real = runner.lockstep
    monkeypatch.setattr(runner, "lockstep", lambda runs: leads.append(next(iter(runs))) or real(runs))
    assert main(["bench", "--model", tiny, "--questions", questions, "--methods", "plain,ngram,jacobi",
                 "--lockstep", "--batch-size", "1", *FAST]) == 0
    assert len(leads) == 4 and set(leads) == {"plain", "ngram", "jacobi"}    # 3 batches, one of two turns


def test_a_stepped_run_is_timed_on_its_own_steps_only(tiny, monkeypatch):
    """What runs between a method's steps (the other methods, in lockstep) is not counted in its time. The bench's
    clock is replaced by one that only moves when read, and jumps 100 s between steps, so nothing here is timed."""
    import types
    from spekit.api import Spekit
    from spekit.bench import contestants
    clock = types.SimpleNamespace(now=0.0)

    def perf_counter():
        clock.now += 0.001
        return clock.now
    monkeypatch.setattr(contestants, "time", types.SimpleNamespace(perf_counter=perf_counter))
    sk = Spekit.load(tiny)
    c = contestants.spekit_contestants(sk, None, ["plain"], {})[0][0]
    cfg = Settings(max_new_tokens=8).sampling()
    prompt = [sk.encode("the quick brown fox", chat=False)]
    gen, between = c.steps(prompt, cfg), 0.0
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            out = stop.value[0]
            break
        clock.now += 100.0
        between += 100.0
    assert len(out.token_ids) == 8 and out.token_ids == c.run(prompt, cfg)[0].token_ids
    assert between >= 700 and 0 < out.wall_s <= out.charged_s < 10


def test_a_peer_failing_mid_run_in_a_lockstep_group_leaves_it_and_the_methods_answer_on(tiny, questions, tmp_path,
                                                                                       capsys, monkeypatch):
    """A steppable peer (as llama.cpp's) joins the lockstep group; when its library fails on a later question, it is
    reported as failed and left out, and the spekit methods still answer every question as they do without it."""
    from spekit.bench import runner
    from spekit.bench.contestants import drained
    calls, groups = [], []

    def steps(prompts, cfg):
        calls.append(len(prompts))
        if len(calls) == 4:            # the warm-up, question 1's two turns; question 2 fails at its second token
            yield 1
            raise RuntimeError("llama_decode returned -3")
        for n in range(1, 3):
            yield n
        return [Outcome([5, 6], 0.01, 0.01) for _ in prompts]
    peer = Contestant("llamacpp-plain", "peer", drained(steps), batched=False, steps=steps)
    monkeypatch.setattr(runner, "peer_contestants", lambda *a, **k: ([peer], {}))
    real = runner.lockstep
    monkeypatch.setattr(runner, "lockstep", lambda runs: groups.append(sorted(runs)) or real(runs))
    got, reports = {}, {}
    for lock, names in ((True, "plain,ngram,llamacpp-plain"), (False, "plain,ngram")):
        folder = tmp_path / f"a{lock}"
        assert main(["bench", "--model", tiny, "--questions", questions, "--methods", names, "--answers",
                     str(folder), *FAST] + (["--lockstep"] if lock else [])) == 0
        reports[lock] = _report(capsys.readouterr().out)
        got[lock] = {name: [json.loads(x)["spekit"]["token_ids"] for x in (folder / f"{name}.jsonl").read_text()
                            .splitlines()] for name in ("plain", "ngram")}
    assert groups[:3] == [["llamacpp-plain", "ngram", "plain"]] * 3 and groups[3:] == [["ngram", "plain"]]
    assert got[True] == got[False] and len(got[True]["plain"]) == 3
    assert "failed mid-run: RuntimeError: llama_decode returned -3" in reports[True]["skipped"]["llamacpp-plain"]
    assert set(reports[True]["results"]) == {"plain", "ngram"}


def test_advise_halves_the_field_each_batch_in_lockstep_with_plain(tiny):
    """Every candidate answers the first prompt with plain; after each prompt the slower half leaves; plain answers
    them all; survivors rank first; greedy outputs are checked against plain's on the same prompts."""
    from spekit.commands.advise import tournament
    from spekit.api import Spekit
    from spekit.config import SamplingConfig
    sk = Spekit.load(tiny)
    prompts = [sk.encode(t, chat=False) for t in ("the quick brown fox", "one two three one two", "the lazy dog")]
    rows, _ = tournament(sk, None, prompts, 1, 1e6, SamplingConfig(max_new_tokens=6))
    counts = {r["label"]: r["prompts"] for r in rows}
    others = len(rows) - 1
    after_one = (others + 1) // 2
    assert counts["plain"] == 3 and max(counts.values()) == 3
    assert sum(1 for c in counts.values() if c == 1) == others - after_one
    assert sum(1 for c in counts.values() if c == 3) == 1 + (after_one + 1) // 2
    assert [r["prompts"] for r in rows] == sorted((r["prompts"] for r in rows), reverse=True)
    assert all(r["identical"] for r in rows if r["lossless"])


def test_lockstep_prefills_identical_prompts_once_and_charges_each_method_its_time(llama, monkeypatch):
    """The prefill is the same computation for every method: within sharing_prefills it runs once, the others get a
    copy of its cache (their own to decode on) and are credited its time; one prefill serves the methods that need
    hidden states too."""
    from conftest import make_engine
    from spekit.bench.contestants import engine_steps
    from spekit import proposers
    from spekit.bench.lockstep import lockstep
    from spekit.config import SamplingConfig
    from spekit.engine import Engine
    from spekit.backends.torch_target import Target
    calls = []
    real = Target.prefill
    # the credit is the prefill's time less the copy's: on this tiny model both take well under a millisecond, and
    # on a busy machine a copy could outlast the prefill (credit 0, a flaky count); a prefill of a real model
    # takes far longer than copying its cache, as this one then does
    monkeypatch.setattr(Target, "prefill", lambda self, kv, prompts, hidden=False:
                        calls.append(hidden) or time.sleep(0.02) or real(self, kv, prompts, hidden))
    credits = []
    take = Target.take_credit
    monkeypatch.setattr(Target, "take_credit", lambda self: credits.append(take(self)) or credits[-1])
    plain = make_engine("plain", llama)
    others = [Engine(plain.target, proposers.get(m)(plain.target, proposers.get(m).Options()))
              for m in ("ngram", "jacobi")]

    class Hidden(proposers.get("ngram")):           # stands for the methods that read the target's features
        needs_hidden_states = True
        seen = []

        def begin(self, ctx, hidden=None):
            self.seen.append(hidden)
            super().begin(ctx, hidden)
    others.append(Engine(plain.target, Hidden(plain.target, Hidden.Options())))
    prompts, cfg = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11]], SamplingConfig(max_new_tokens=10)
    alone = [r.token_ids for r in plain.generate(prompts, cfg)]
    calls.clear()
    with plain.target.sharing_prefills():
        got = lockstep({name: engine_steps(e)(prompts, cfg)
                        for name, e in zip(("plain", "ngram", "jacobi", "hidden"), [plain, *others])})
    assert calls == [True]                                    # one prefill for four methods, hidden states kept
    assert sum(c > 0 for c in credits) == 3                   # the three that got a copy are charged its time
    assert len(Hidden.seen) == 1 and len(Hidden.seen[0]) == llama.config.num_hidden_layers + 1
    assert all([o.token_ids for o in outs] == alone for outs in got.values())
    assert plain.target.shared is None and plain.target.credit == 0.0


def test_the_share_of_time_spent_recording_cuda_graphs_is_reported_and_older_answers_read():
    from spekit.bench.summary import _cell

    def record(**extra):
        return {"question_id": 1, "choices": [{"new_tokens": [10]}],
                "spekit": {"charged_s": [2.0], "forwards": [5], "draft_s": [0.5], "verify_s": [1.0], "offered": [],
                           "accepted": [], "token_ids": [[1]], **extra}}
    assert _cell([record(recording_s=[0.5])], {1: [[1]]})["recording_share"] == 0.25
    assert _cell([record()], {1: [[1]]})["recording_share"] is None              # answers written before the field
    assert _cell([record(recording_s=[None])], {})["recording_share"] is None   # a peer's: not measured


def test_figures_are_split_between_answers_cut_at_the_limit_and_answers_that_ended():
    """A small model loops until --max-new-tokens stops it, and lookup drafts a loop whole: the report says how
    much of the run that was and what each method gained on the turns plain ended itself."""
    from spekit.bench.limits import describe, limit_split

    def record(q, ids, seconds):
        return {"question_id": q, "choices": [{"new_tokens": [len(ids)]}],
                "spekit": {"token_ids": [ids], "charged_s": [seconds]}}
    loop, short = [1, 2] * 4, [5, 6, 7]                          # plain ran the loop to the limit of 8
    records = {"plain": [record(1, loop, 4.0), record(2, short, 1.0)],
               "ngram": [record(1, loop, 1.0), record(2, short, 1.0)]}
    split = limit_split(records, 8)
    assert split["turns"] == 2 and split["at_limit"] == 1 and split["token_share"] == round(8 / 11, 3)
    assert split["repeated"] == {"at_limit": 0.375, "ended": 0.0}          # 3 of the loop's 8 tokens repeat a 4-gram
    assert split["speedup"]["ngram"] == {"at_limit": 4.0, "ended": 1.0}
    assert "1 of 2 turns of plain ran to the 8-token limit" in describe(split) and "ngram 4.00x / 1.00x" in \
        describe(split)
    assert limit_split(records, 9) is None                                   # no turn reached the limit
    assert limit_split({"ngram": records["ngram"]}, 8) is None               # no plain to tell the turns by


def test_a_peer_is_also_compared_with_its_own_engines_plain_answers(capsys):
    """Identity with spekit plain mixes two things for a peer: its engine's own rounding and its drafting. Its
    answers are also held against its own engine's plain ones (Hugging Face's prompt lookup against its plain
    generate), which tells whether the peer keeps its own greedy output; spekit's methods have no such field."""
    import io
    from spekit.bench.contestants import Contestant
    from spekit.bench.summary import own_plain, print_table, summarize

    def record(q, ids):
        return {"question_id": q, "choices": [{"new_tokens": [len(ids)]}],
                "spekit": {"token_ids": [ids], "charged_s": [1.0], "forwards": [None], "draft_s": [None],
                           "verify_s": [None], "offered": [], "accepted": [], "group": "qa"}}
    ours, theirs = [[1, 2], [3, 4]], [[1, 2], [3, 5]]
    records = {"plain": [record(q, ids) for q, ids in enumerate(ours)],
               "ngram": [record(q, ids) for q, ids in enumerate(ours)],
               "hf-plain": [record(q, ids) for q, ids in enumerate(theirs)],
               "hf-lookup": [record(q, ids) for q, ids in enumerate([theirs[0], [3, 6]])]}
    contestants = [Contestant(n, "peer" if n.startswith("hf") else "spekit", None) for n in records]
    report = summarize(records, contestants, {}, intervals=False)
    overall = {n: report["results"][n]["overall"] for n in records}
    assert overall["hf-lookup"]["identical_to_own_plain"] == 0.5 and overall["hf-lookup"]["identical"] == 0.5
    assert overall["hf-plain"]["identical"] == 0.5 and "identical_to_own_plain" not in overall["hf-plain"]
    assert "identical_to_own_plain" not in overall["ngram"]
    assert (own_plain("hf-assistant"), own_plain("llamacpp-lookup"), own_plain("rest")) == \
        ("hf-plain", "llamacpp-plain", "plain")
    out = io.StringIO()
    print_table({**report, "settings": {"temperature": 0.0}}, out)
    assert "identical to their own engine's plain answers" in out.getvalue() and "hf-lookup 50%" in out.getvalue()


def _timed(qid: int, tokens: int, seconds: float) -> dict:
    return {"question_id": qid, "choices": [{"new_tokens": [tokens]}], "spekit": {"charged_s": [seconds]}}


def test_the_speedup_interval_resamples_questions_in_pairs_and_holds_the_figure():
    """The same 2x on every question: an interval of width 0 at 2x, whatever the questions' sizes; speedups that
    differ by question: an interval around the pooled figure, inside the range of the questions' own; one
    question, or an untimed one: none."""
    from spekit.bench.intervals import speedup_interval
    plain = [_timed(q, 100 + 50 * q, 4.0 + q) for q in range(6)]
    twice = [_timed(q, 100 + 50 * q, (4.0 + q) / 2) for q in range(6)]
    assert speedup_interval(twice, plain) == [2.0, 2.0]
    mixed = [_timed(q, 100 + 50 * q, (4.0 + q) / (1.0 + 0.2 * q)) for q in range(6)]
    pooled = (sum(100 + 50 * q for q in range(6)) / sum((4.0 + q) / (1.0 + 0.2 * q) for q in range(6))) / \
        (sum(100 + 50 * q for q in range(6)) / sum(4.0 + q for q in range(6)))
    low, high = speedup_interval(mixed, plain)
    assert 1.0 <= low < pooled < high <= 2.0
    assert speedup_interval(mixed, plain) == [low, high]                        # seeded: a report repeats
    assert speedup_interval(mixed[:1], plain) is None
    assert speedup_interval(mixed, plain[:1] + [_timed(q, 10, 0.0) for q in range(1, 6)]) is None


def test_the_report_gives_each_method_its_speedup_interval(tiny, questions, capsys):
    assert main(["bench", "--model", tiny, "--questions", questions, "--methods", "plain,ngram", *FAST]) == 0
    out = capsys.readouterr().out
    report = _report(out)
    low, high = report["results"]["ngram"]["overall"]["speedup_interval"]
    assert 0 < low <= high
    assert report["results"]["ngram"]["qa"]["speedup_interval"] is None                  # one question
    assert "speedup_interval" not in report["results"]["plain"]["overall"]
    assert f"ngram {low:.2f}-{high:.2f}x" in out


def test_a_batched_run_gives_no_intervals_since_its_rows_share_the_batch_time(tiny, questions):
    report = measure(Settings(model=tiny, max_new_tokens=4, chat=False, batch=2), _questions(questions),
                     ["plain", "ngram", "ngram:num-draft-tokens=1"], None)
    assert "speedup_interval" not in report["results"]["ngram"]["overall"]
    assert report["results"]["ngram:num-draft-tokens=1"]["overall"]["vs_method_interval"] is None
    assert report["results"]["ngram:num-draft-tokens=1"]["overall"]["vs_method"] is not None


def _questions(path: str) -> list[dict]:
    from spekit.bench.questions import load_questions
    return load_questions(path)


def test_a_run_at_flat_costs_is_lossless_and_its_folder_is_not_resumed_at_measured_ones(tiny, questions, tmp_path,
                                                                                        capsys):
    """Flat costs change every drafter's trees (the engine's own test: tests/test_profiles.py), not its answers;
    a folder of such answers is a setting of its own."""
    folder = tmp_path / "flat"
    args = ["bench", "--model", tiny, "--questions", questions, "--methods", "plain,ngram", "--answers", str(folder),
            *FAST]
    assert main(args + ["--cost-profile", "flat"]) == 0
    report = _report(capsys.readouterr().out)
    assert report["results"]["ngram"]["overall"]["identical"] == 1.0
    assert report["settings"]["cost_profile"] == "flat"
    assert main(args) == 2
    assert "other settings (cost_profile)" in capsys.readouterr().err


def test_a_divergence_is_reported_with_plains_own_logit_gap(tiny):
    """An answer that leaves plain's (here: plain's own answer with one token changed) is reported where it leaves
    and with the gap plain's logits saw there: its token's log-probability minus the other's, as the engine's
    log-probabilities give it."""
    from spekit.api import Spekit
    from spekit.bench.divergence import divergences
    from spekit.config import SamplingConfig
    base = Spekit.load(tiny)
    question = QUESTIONS[2]
    ids = encode_turn(base.tokenizer, [{"role": "user", "content": question["turns"][0]}], False)
    probe = base.engine.generate([ids], SamplingConfig(max_new_tokens=6, logprobs=True, top_logprobs=5))[0]
    other = probe.logprobs[3].top[1]                           # plain's second choice at token 3
    plain = {"question_id": 3, "choices": [{"turns": [base.decode(probe.token_ids)]}],
             "spekit": {"token_ids": [probe.token_ids]}}
    mine = {"question_id": 3, "spekit": {"token_ids": [probe.token_ids[:3] + [other[0]] + probe.token_ids[4:]]}}
    same = {"question_id": 3, "spekit": {"token_ids": [probe.token_ids]}}
    got = divergences(base, [question], {"plain": [plain], "m": [mine], "same": [same]}, ["m", "same"], False,
                      SamplingConfig(max_new_tokens=6))
    assert got == [{"method": "m", "question_id": 3, "turn": 0, "token": 3,
                    "gap_nats": round(probe.logprobs[3].logprob - other[1], 6), "plain_repeats": True}]


def test_the_selection_table_quotes_its_figures_from_a_benchmark_record(tmp_path, capsys):
    """advise --explain writes no figure of its own: each method's speedup and tau are the recorded run's, with the
    command that made the record; another record (--record) changes them; a file that is not a record is refused."""
    from spekit.commands.selection import RECORDS, read_record
    shipped = read_record(RECORDS["torch"])
    assert main(["advise", "--explain"]) == 0
    out = capsys.readouterr().out
    rest = shipped["results"]["rest"]["overall"]
    assert f"rest {rest['speedup']:.2f}x plain (tau {rest['tau']:.2f})" in out
    assert shipped["command"] in out
    mine = {"command": "spekit bench --mine", "settings": {"max_new_tokens": 8, "model": "m", "dtype": "float32"},
            "results": {"rest": {"overall": {"speedup": 9.87, "tau": 6.54, "prompts": 2}}}}
    (tmp_path / "r.json").write_text(json.dumps(mine))
    assert main(["advise", "--explain", "--record", str(tmp_path / "r.json")]) == 0
    out = capsys.readouterr().out
    assert "rest 9.87x plain (tau 6.54)" in out and "spekit bench --mine" in out
    assert f"rest {rest['speedup']:.2f}x" not in out
    (tmp_path / "bad.json").write_text("[1, 2]")
    assert main(["advise", "--explain", "--record", str(tmp_path / "bad.json")]) == 2
    assert "not a benchmark record" in capsys.readouterr().err
