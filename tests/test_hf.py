"""spekit.hf_generate.generate, the drop-in for model.generate: the same tensor as transformers' greedy decoding (left
padding, early ends padded), under any method; sampled calls repeat under torch.manual_seed; what it cannot do is
refused."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, TextIteratorStreamer, pipeline

from spekit import hf_generate as hf
from spekit.config import UserError
from test_cli import _save_tiny

PROMPTS = ["one two three four one two three four one two", "the quick brown fox"]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    folder = _save_tiny(tmp_path_factory.mktemp("hf"))
    tok = AutoTokenizer.from_pretrained(folder)
    tok.pad_token, tok.padding_side = tok.eos_token, "left"
    reference = AutoModelForCausalLM.from_pretrained(folder)      # transformers' own, left as it is
    return AutoModelForCausalLM.from_pretrained(folder), reference, tok(PROMPTS, return_tensors="pt", padding=True)


@pytest.mark.parametrize("method", ["plain", "ngram", "recycle", "auto"])
def test_greedy_equals_transformers_generate(loaded, method):
    model, reference, inputs = loaded
    want = reference.generate(**inputs, max_new_tokens=16, do_sample=False)
    got = hf.generate(model, **inputs, max_new_tokens=16, method=method, use_cache=True)
    assert got.shape == want.shape and torch.equal(got, want)
    config = GenerationConfig(max_new_tokens=5, eos_token_id=None, pad_token_id=0)     # read instead of the model's
    assert torch.equal(hf.generate(model, **inputs, generation_config=config, method=method), want[:, :-11])


def test_an_early_end_is_padded_as_transformers_pads_it(loaded):
    model, reference, inputs = loaded
    length = inputs["input_ids"].shape[1]
    free = reference.generate(**inputs, max_new_tokens=16, do_sample=False)
    eos = int(free[0, length + 3])                          # row 0's fourth new token ends it
    want = reference.generate(**inputs, max_new_tokens=16, do_sample=False, eos_token_id=eos, pad_token_id=7)
    got = hf.generate(model, **inputs, max_new_tokens=16, eos_token_id=eos, pad_token_id=7, method="ngram")
    assert torch.equal(got, want) and int((want[0, length:] == 7).sum()) > 0


@pytest.mark.parametrize("method", ["plain", "ngram", "recycle"])
def test_min_new_tokens_equals_transformers(loaded, method):
    """transformers' own min_new_tokens processor is the reference: the EOS is held back until then."""
    model, reference, inputs = loaded
    length = inputs["input_ids"].shape[1]
    eos = int(reference.generate(**inputs, max_new_tokens=16, do_sample=False)[0, length + 1])   # ends row 0 early
    kw = dict(max_new_tokens=16, eos_token_id=eos, pad_token_id=7, min_new_tokens=9)
    want = reference.generate(**inputs, do_sample=False, **kw)
    assert torch.equal(hf.generate(model, **inputs, method=method, **kw), want)
    assert not torch.equal(want, reference.generate(**inputs, do_sample=False, **{**kw, "min_new_tokens": 0}))


def test_sampling_repeats_under_the_torch_seed(loaded):
    model, _, inputs = loaded
    runs = []
    for _ in range(2):
        torch.manual_seed(5)
        runs.append(hf.generate(model, **inputs, max_new_tokens=12, do_sample=True, temperature=0.9, top_k=20,
                                num_return_sequences=2, method="ngram"))
    assert runs[0].shape[0] == 4 and torch.equal(runs[0], runs[1])


def test_what_it_cannot_do_is_refused(loaded):
    model, _, inputs = loaded
    with pytest.raises(UserError, match="num_beams"):
        hf.generate(model, **inputs, num_beams=4)
    with pytest.raises(UserError, match="does not know tree_size: neither a setting of transformers. generate"):
        hf.generate(model, **inputs, tree_size=4)                   # plain's options: none
    with pytest.raises(UserError, match="attention_mask"):
        hf.generate(model, inputs["input_ids"], inputs["attention_mask"][:, 1:])
    with pytest.raises(UserError, match="needs draft_model"):
        hf.generate(model, **inputs, method="draft")


def test_a_streamer_gets_the_answer_as_it_is_committed(loaded):
    """transformers' TextIteratorStreamer: the text it yields is the answer's text (one input row)."""
    model, reference, inputs = loaded
    tok = AutoTokenizer.from_pretrained(model.config._name_or_path)
    one = {k: v[1:] for k, v in inputs.items()}
    streamer = TextIteratorStreamer(tok, skip_prompt=True)
    got = hf.generate(model, **one, max_new_tokens=12, method="ngram", streamer=streamer)
    length = one["input_ids"].shape[1]
    assert "".join(streamer) == tok.decode(got[0, length:])
    with pytest.raises(UserError, match="one input row"):
        hf.generate(model, **inputs, streamer=TextIteratorStreamer(tok))


def test_patch_puts_a_pipeline_on_spekit(loaded):
    """patch: transformers' text-generation pipeline decodes through spekit (its engine is built) and writes what
    it wrote before; unpatch gives generate back."""
    model, _, _ = loaded
    tok = AutoTokenizer.from_pretrained(model.config._name_or_path)
    reference = AutoModelForCausalLM.from_pretrained(model.config._name_or_path)
    want = pipeline("text-generation", model=reference, tokenizer=tok)(PROMPTS[0], max_new_tokens=10,
                                                                       do_sample=False)
    hf.patch(model, method="ngram", num_draft_tokens=4)
    assert pipeline("text-generation", model=model, tokenizer=tok)(PROMPTS[0], max_new_tokens=10,
                                                                   do_sample=False) == want
    assert any(key[0] == "ngram" for key in hf._engines[model] if isinstance(key, tuple))
    hf.unpatch(model)
    assert model.generate.__func__ is type(model).generate
    with pytest.raises(UserError, match="unknown method"):
        hf.patch(model, method="nope")
