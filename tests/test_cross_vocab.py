"""A draft model of another vocabulary (spekit.proposers.cross_draft): greedy output is plain greedy's token for
token and sampled output keeps the target's law, with tokenizers whose vocabularies differ (word-level ones of
other sizes and ids; byte-level BPEs of other merges); the text crosses incrementally; bad pairs are refused."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from tokenizers import ByteLevelBPETokenizer, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from conftest import plain_greedy_hf, tiny_llama
from spekit.backends.torch_target import Target
from spekit.config import SamplingConfig, UserError
from spekit.engine import Engine
from spekit.pacing.step_costs import StepCosts
from spekit.proposers.cross_draft import CrossDraft
from spekit.proposers.draft_model import DraftModel
from spekit.proposers.vocab_bridge import Rows, complete, piece_bytes
from test_engine import both_ways, first_two_exact

TARGET_WORDS = ["<eos>", "Ġthe", "Ġcat", "Ġsat", "Ġon", "Ġmat", "Ġa", "Ġdog", "<unk>"]   # 9 ids
DRAFT_WORDS = ["<unk>", "Ġbig", "Ġdog", "Ġa", "Ġmat", "<eos>", "Ġon", "Ġsat", "Ġran", "Ġcat", "Ġthe"]   # 11 ids


def word_tokenizer(words: list[str]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer over byte-level words (" cat" is one token, "Ġcat"), in the order given."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    special = {"eos_token": "<eos>"} | ({"unk_token": "<unk>"} if "<unk>" in words else {})
    return PreTrainedTokenizerFast(tokenizer_object=tok, **special)


def bpe_tokenizer(size: int) -> PreTrainedTokenizerFast:
    text = ["the quick brown fox jumps over the lazy dog", "speculative decoding drafts and verifies tokens",
            "one two three four five six seven eight nine ten", "a cat sat on the mat, a dog ran"] * 20
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(text, vocab_size=size, min_frequency=1, special_tokens=["<eos>"])
    return PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<eos>")


def permuted_copy(model, ours: list[str], theirs: list[str], seed: int, noise: float):
    """The target's first layer, its token rows moved to the draft's ids (words the target lacks: random rows),
    plus noise: a smaller draft that often agrees with the target, not always."""
    out = tiny_llama(seed=seed, layers=1, vocab=len(theirs), logit_scale=10)
    state = copy.deepcopy(model.state_dict())
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in out.named_parameters():
            src = state[name]
            if src.shape == p.shape:
                p.copy_(src + torch.randn_like(src) * noise * src.std())
            else:                                          # embedding / head rows by word
                for j, w in enumerate(theirs):
                    if w in ours:
                        p[j] = src[ours.index(w)]
    return out


def cross_engine(target_model, target_tok, draft_model, draft_tok, **options) -> Engine:
    target, draft = Target(target_model), Target(draft_model)
    draft.tokenizer = draft_tok
    proposer = DraftModel.build(target, DraftModel.Options(**options), draft, target_tok)
    assert isinstance(proposer, CrossDraft)
    return Engine(target, proposer)


@pytest.fixture(scope="module")
def words():
    target_tok, draft_tok = word_tokenizer(TARGET_WORDS), word_tokenizer(DRAFT_WORDS)
    target = tiny_llama(seed=2, vocab=len(TARGET_WORDS), logit_scale=10)
    with torch.no_grad():                 # a second layer that changes little: its first layer drafts well
        layer = target.model.layers[1]
        layer.self_attn.o_proj.weight.mul_(0.2)
        layer.mlp.down_proj.weight.mul_(0.2)
    return target, target_tok, permuted_copy(target, TARGET_WORDS, DRAFT_WORDS, seed=4, noise=0.3), draft_tok


@pytest.fixture
def always_widest(monkeypatch):
    """Verifying k tokens costs what one does: the draft drafts at every step (the tiny models would rightly
    not pay)."""
    monkeypatch.setattr(StepCosts, "relative", lambda self, batch, n, context=0: 1.0)


# --- the bridge ------------------------------------------------------------------------------------------------

def test_pieces_are_the_bytes_each_token_adds():
    for tok in (bpe_tokenizer(300), word_tokenizer(DRAFT_WORDS)):
        table = piece_bytes(tok)
        for text in [" the cat sat on the mat", " a dog"]:
            ids = tok(text, add_special_tokens=False).input_ids
            assert b"".join(table[i] or b"" for i in ids) == text.encode()
        assert table[tok.eos_token_id] is None


def test_incomplete_characters_wait():
    assert complete("é".encode()[:1]) == 0 and complete(b"ab" + "日".encode()[:2]) == 2
    assert complete("a日".encode()) == 4 and complete(b"") == 0


def test_the_draft_follows_the_text_incrementally():
    """Only the new text is encoded (its tail after a lookback), and the draft's tokens are always those of the
    target's text: what encoding the whole text gives."""
    target_tok, draft_tok = bpe_tokenizer(300), bpe_tokenizer(400)
    rows = Rows(target_tok, draft_tok, piece_bytes(target_tok), piece_bytes(draft_tok))
    rows.add(1)
    calls = []
    encode = draft_tok.__call__

    def counted(text, **kw):
        calls.append(text)
        return encode(text, **kw)
    rows.draft_tok = counted
    text = " the quick brown fox jumps over the lazy dog and the cat sat on the mat"
    ids = target_tok(text, add_special_tokens=False).input_ids
    prompt = 3
    rows.sync(0, ids[:prompt])
    for n in range(prompt + 1, len(ids) + 1):
        got = rows.sync(0, ids[:n])
        whole = target_tok.decode(ids[:n])
        assert b"".join(rows.draft_bytes[i] for i in got) == whole.encode()
    assert max(len(c) for c in calls[1:]) < 20, "each step encodes a short tail, not the whole text"


# --- greedy: plain's tokens ------------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt", [[1, 2], [6, 7, 4, 1]])
def test_greedy_word_level_is_plain(words, always_widest, prompt):
    target, target_tok, draft, draft_tok = words
    eng = cross_engine(target, target_tok, draft, draft_tok)
    got = eng.generate([prompt], SamplingConfig(max_new_tokens=24))[0]
    assert got.token_ids == plain_greedy_hf(target, prompt, 24)
    assert got.stats.position_offered and got.stats.position_accepted[0] > 0, "drafts were offered and accepted"


def test_the_generate_drop_in_takes_a_draft_of_another_vocabulary(words, always_widest):
    """spekit.hf_generate.generate with transformers' names for universal assisted generation (tokenizer=,
    assistant_tokenizer=): plain greedy's tokens, drafted across vocabularies."""
    from spekit.hf_generate import generate
    target, target_tok, draft, draft_tok = words
    model = copy.deepcopy(target)
    out = generate(model, torch.tensor([[6, 7, 4, 1]]), method="draft", draft_model=copy.deepcopy(draft),
                   tokenizer=target_tok, assistant_tokenizer=draft_tok, max_new_tokens=16, eos_token_id=[])
    assert out[0, 4:].tolist() == plain_greedy_hf(target, [6, 7, 4, 1], 16)
    with pytest.raises(UserError, match="tokenizer"):
        generate(copy.deepcopy(target), torch.tensor([[1, 2]]), method="draft", draft_model=copy.deepcopy(draft),
                 max_new_tokens=4)


def test_greedy_bpe_batch_is_plain(always_widest):
    """Byte-level BPEs of other merges (so the same text splits otherwise), three rows of other lengths."""
    target_tok, draft_tok = bpe_tokenizer(300), bpe_tokenizer(400)
    target = tiny_llama(seed=6, vocab=len(target_tok), logit_scale=4)
    draft = tiny_llama(seed=7, layers=1, vocab=len(draft_tok), logit_scale=4)
    eng = cross_engine(target, target_tok, draft, draft_tok)
    prompts = [target_tok(t).input_ids for t in ["the quick brown", "a cat sat on", "one two three four five"]]
    got = eng.generate(prompts, SamplingConfig(max_new_tokens=20))
    for p, g in zip(prompts, got):
        assert g.token_ids == plain_greedy_hf(target, p, 20)
    assert sum(g.stats.position_offered[0] for g in got if g.stats.position_offered) > 0


# --- sampling: the target's law ----------------------------------------------------------------------------------

LAWS = {"t1": SamplingConfig(temperature=1.0), "t07_topk_topp": SamplingConfig(temperature=0.7, top_k=5, top_p=0.9),
        "bias": SamplingConfig(temperature=1.0, logit_bias=((8, 1.5), (2, -1.0)))}   # target ids, not the draft's


@pytest.mark.parametrize("law", list(LAWS))
def test_sampled_tokens_follow_the_target_law(words, always_widest, follows, law):
    """The first two tokens of many samples (the second from the first speculative step): the target's exact
    law, with a draft that draws only among the tokens both vocabularies share."""
    target, target_tok, draft, draft_tok = words
    prompt = [1, 2, 3, 4]
    cfg = dataclasses.replace(LAWS[law], max_new_tokens=2, n=6000, seed=3)
    eng = cross_engine(target, target_tok, draft, draft_tok)
    results = eng.generate([prompt], cfg)
    vocab = len(TARGET_WORDS)
    codes = torch.tensor([r.token_ids[0] * vocab + r.token_ids[1] for r in results])
    follows(codes, first_two_exact(target, prompt, cfg).flatten())
    both_ways(results, 1000)


# --- bad pairs ---------------------------------------------------------------------------------------------------

def test_a_draft_without_a_tokenizer_is_refused(words):
    target, target_tok, draft, _ = words
    with pytest.raises(UserError, match="tokenizer"):
        DraftModel.build(Target(target), DraftModel.Options(), Target(draft), target_tok)


def test_a_draft_larger_than_the_target_is_refused(words):
    target, target_tok, _, draft_tok = words
    big = tiny_llama(seed=8, layers=4, vocab=len(DRAFT_WORDS))
    draft = Target(big)
    draft.tokenizer = draft_tok
    with pytest.raises(UserError, match="not smaller"):
        DraftModel.build(Target(target), DraftModel.Options(), draft, target_tok)


def test_a_draft_that_cannot_write_the_targets_text_is_refused(words):
    """Its tokenizer has no token for some of the target's words (they would all be <unk>)."""
    target, target_tok, _, _ = words
    short = ["<unk>", "<eos>", "Ġthe", "Ġcat"]
    draft = Target(tiny_llama(seed=9, layers=1, vocab=len(short)))
    draft.tokenizer = word_tokenizer(short)
    with pytest.raises(UserError, match="cannot write"):
        DraftModel.build(Target(target), DraftModel.Options(), draft, target_tok)


# --- the bundled pair: SmolLM2-135M drafting for Gemma-3-270M (slow) ------------------------------------------------

COMPLETIONS = ["The history of the printing press begins", "Question: What is the capital of France?\nAnswer:"]


@pytest.mark.slow
@pytest.mark.parametrize("backend,draft_backend", [("torch", "same"), ("llama.cpp", "same"), ("torch", "llama.cpp"),
                                                   ("llama.cpp", "torch")])
def test_smollm2_drafting_for_gemma_gives_plains_answers(always_widest, backend, draft_backend):
    """The bundled files, target and draft each on either backend (llama.cpp where installed): drafts offered at
    every step, Gemma's greedy answers token for token."""
    from spekit.api import Spekit
    from spekit.backends.llama_lib import available
    from spekit.backends.torch_models import ModelNotFound, resolve
    if "llama.cpp" in (backend, draft_backend) and not available():
        pytest.skip("llama-cpp-python is not installed")
    try:
        resolve("gemma3-270m")
    except ModelNotFound:
        pytest.skip("the bundled Gemma-3-270M is not installed (bash scripts/install.sh --gemma)")
    plain = Spekit.load("gemma3-270m", backend=backend)
    sk = Spekit.load("gemma3-270m", "draft", draft="smollm2-135m", backend=backend, draft_backend=draft_backend,
                     confidence=0.0)
    assert isinstance(sk.engine.proposer, CrossDraft)
    cfg = SamplingConfig(max_new_tokens=48)
    ids = [plain.encode(p, chat=False) for p in COMPLETIONS]
    want = [plain.engine.generate([i], cfg)[0].token_ids for i in ids]
    got = [sk.engine.generate([i], cfg)[0] for i in ids]
    assert [r.token_ids for r in got] == want
    assert sum(r.stats.position_accepted[0] for r in got if r.stats.position_accepted) > 10
