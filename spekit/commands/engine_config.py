"""`spekit engine-config`: the launch command that runs a spekit method on a serving engine (vLLM, SGLang,
TensorRT-LLM, llama.cpp), with trained heads exported by `spekit export` where the method needs them; a plain
refusal where the engine has no such method, and a note where the engine's version is not lossless under sampling.
Flag names follow each engine's documentation (vLLM >= 0.10 `--speculative-config`; SGLang `--speculative-*`;
TensorRT-LLM's PyTorch backend `speculative_config` YAML; llama.cpp `llama-server`); check `--help` of the
version you run."""
from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from ..config import UserError

ENGINES = ["vllm", "sglang", "trtllm", "llamacpp"]
HEADED = {"medusa", "eagle", "eagle3"}                       # methods whose drafter is trained heads
ALIASES = {"early-exit": "early_exit", "layer-skip": "layer_skip", "draft_model": "draft", "lookup": "ngram",
           "prompt_lookup": "ngram"}

UNSUPPORTED = {
    "vllm": {"lookahead": "vLLM has no lookahead decoding (its draftless methods are ngram and suffix)",
             "jacobi": "vLLM has no Jacobi decoding", "early_exit": "vLLM has no early-exit self-speculation",
             "layer_skip": "vLLM has no layer-skip self-speculation"},
    "sglang": {"medusa": "SGLang has no Medusa heads (its tree drafters are EAGLE / EAGLE3)",
               "lookahead": "SGLang has no lookahead decoding", "jacobi": "SGLang has no Jacobi decoding",
               "early_exit": "SGLang has no early-exit self-speculation",
               "layer_skip": "SGLang has no layer-skip self-speculation"},
    "trtllm": {"eagle": "TensorRT-LLM's PyTorch backend (trtllm-serve) runs EAGLE-3 drafters, not EAGLE-1/2 heads: "
                        "train/export --method eagle3",
               "medusa": "Medusa runs only in TensorRT-LLM's legacy TensorRT-engine flow (trtllm-build "
                         "--speculative_decoding_mode medusa), not in trtllm-serve's PyTorch backend",
               "lookahead": "TensorRT-LLM's lookahead runs only in its legacy TensorRT-engine flow",
               "jacobi": "TensorRT-LLM has no Jacobi decoding",
               "early_exit": "TensorRT-LLM has no early-exit self-speculation",
               "layer_skip": "TensorRT-LLM has no layer-skip self-speculation"},
    "llamacpp": {"medusa": "llama.cpp has no Medusa heads", "eagle": "llama.cpp has no EAGLE-1/2 drafter",
                 "mtp": "llama-server has no MTP drafter for models without built-in MTP support",
                 "lookahead": "llama-server has no lookahead; only the example binary llama-lookahead does it",
                 "jacobi": "llama.cpp has no Jacobi decoding",
                 "early_exit": "llama.cpp has no early-exit self-speculation",
                 "layer_skip": "llama.cpp has no layer-skip self-speculation"},
}
# no engine merges a prompt-lookup chain into an EAGLE-3 tree: each offers the two methods separately
for _engine, _reasons in UNSUPPORTED.items():
    _reasons["eagle3_lookup"] = (f"{_engine} has no EAGLE-3 tree merged with prompt lookup; run --method eagle3 "
                                 "(heads from `spekit export`) or --method ngram there")
# token recycling: no engine keeps a table of the target's top-k next tokens to draft from
for _engine, _reasons in UNSUPPORTED.items():
    _reasons["recycle"] = (f"{_engine} has no token-recycling drafter; run --method ngram there (prompt lookup)"
                           + (", or suffix decoding (--method rest)" if _engine == "vllm" else ""))
# retrieval drafting: vLLM's suffix decoding is its counterpart (trees of the prompt and of earlier responses)
for _engine in ("sglang", "trtllm", "llamacpp"):
    UNSUPPORTED[_engine]["rest"] = (f"{_engine} has no retrieval drafter over a datastore of earlier answers; run "
                                    "--method ngram there (prompt lookup)")


def normalize(method: str) -> str:
    m = method.strip().lower().replace("-", "_")
    return ALIASES.get(m, ALIASES.get(method, m))


def _vllm(method, model, heads, draft, n) -> tuple[list[str], list[str]]:
    spec = {"ngram": {"method": "ngram", "num_speculative_tokens": n, "prompt_lookup_max": 4, "prompt_lookup_min": 1},
            "draft": {"method": "draft_model", "model": draft, "num_speculative_tokens": n},
            "eagle": {"method": "eagle", "model": heads, "num_speculative_tokens": n},
            "eagle3": {"method": "eagle3", "model": heads, "num_speculative_tokens": n},
            "medusa": {"method": "medusa", "model": heads, "num_speculative_tokens": n},
            "mtp": {"method": "mtp", "num_speculative_tokens": 1},
            "rest": {"method": "suffix", "num_speculative_tokens": max(n, 16)}}.get(method)
    cmd = ["vllm", "serve", model] + (["--speculative-config", json.dumps(spec)] if spec else [])
    notes = ["vLLM verifies with its rejection sampler: lossless under sampling (up to floating-point numerics)."]
    if method == "mtp":
        notes.append("vLLM's mtp runs the model's own MTP layers (DeepSeek-V3, MiMo, GLM-4.5, Qwen3-Next ...); "
                     "heads spekit trained for a model without them do not load there.")
    if method == "rest":
        notes.append("vLLM's suffix decoding (pip install arctic-inference) drafts trees from the prompt and from the "
                     "responses it has served, which it collects as it runs: spekit's datastore file does not load "
                     "there, so it gains once it has answered similar requests.")
    if method == "draft":
        notes.append("draft_model needs vLLM >= 0.12 (the V1 engine of 0.10/0.11 has no draft-model proposer).")
    return cmd, notes


def _sglang(method, model, heads, draft, n) -> tuple[list[str], list[str]]:
    cmd = ["python", "-m", "sglang.launch_server", "--model-path", model]
    algo = {"ngram": "NGRAM", "draft": "STANDALONE", "eagle": "EAGLE", "eagle3": "EAGLE3", "mtp": "NEXTN"}.get(method)
    if algo:
        cmd += ["--speculative-algorithm", algo]
        if method in ("draft", "eagle", "eagle3"):
            cmd += ["--speculative-draft-model-path", draft if method == "draft" else heads]
        if method != "ngram":
            cmd += ["--speculative-num-steps", str(n), "--speculative-eagle-topk", "1" if method == "draft" else "4"]
        cmd += ["--speculative-num-draft-tokens", str(n + 1 if method == "draft" else max(n + 1, 8))]
    notes = ["Lossless under sampling only with --speculative-accept-threshold-single and "
             "--speculative-accept-threshold-acc at their default 1.0; lower values relax acceptance (lossy)."]
    if method == "ngram":
        notes.append("SGLang's NGRAM drafter is CUDA-only.")
    if method == "mtp":
        notes.append("NEXTN runs the model's own next-n (MTP) layers (DeepSeek-V3 style).")
    return cmd, notes


def _trtllm(method, model, heads, draft, n) -> tuple[list[str], list[str], str | None]:
    spec = {"ngram": {"decoding_type": "NGram", "max_draft_len": n, "max_matching_ngram_size": 4},
            "draft": {"decoding_type": "DraftTarget", "max_draft_len": n, "speculative_model_dir": draft},
            "eagle3": {"decoding_type": "Eagle3", "max_draft_len": n, "speculative_model_dir": heads},
            "mtp": {"decoding_type": "MTP", "num_nextn_predict_layers": 1}}.get(method)
    cmd = ["trtllm-serve", model] + (["--extra_llm_api_options", "spec.yaml"] if spec else [])
    yaml = None
    if spec:
        yaml = "speculative_config:\n" + "".join(f"  {k}: {v}\n" for k, v in spec.items())
    notes = ["TensorRT-LLM accepts a draft token when it equals the token the target picks: lossless for these "
             "point-mass drafts."]
    if method == "mtp":
        notes.append("MTP runs the model's own MTP layers (DeepSeek-V3/R1); keep use_relaxed_acceptance_for_thinking "
                     "off: relaxed acceptance is lossy.")
    return cmd, notes, yaml


def _llamacpp(method, model, heads, draft, n) -> tuple[list[str], list[str]]:
    cmd = ["llama-server", "-m", model]
    if method == "draft":
        cmd += ["-md", draft, "--draft-max", str(n), "--draft-min", "0"]
    elif method == "ngram":
        cmd += ["--spec-type", "ngram-simple", "--draft-max", str(n)]
    elif method == "eagle3":
        cmd += ["-md", heads, "--spec-type", "draft-eagle3", "--draft-max", str(n)]
    notes = ["llama.cpp keeps a draft token when it equals the token its sampler draws from the target: lossless "
             "under sampling."]
    if method == "ngram":
        notes.append("--spec-type needs a recent llama-server; older builds do prompt lookup only in the example "
                     "binary llama-lookup (--draft N).")
    if method == "eagle3":
        notes.append("EAGLE-3 in llama-server is recent: convert the heads with convert_hf_to_gguf.py "
                     "--target-model-dir MODEL_DIR and check your build's --help for draft-eagle3.")
    return cmd, notes


def _check_heads(heads: str, engine: str, method: str) -> dict:
    """Heads the engine can load for `method`: a folder with a model config (the layout `spekit export` writes,
    not a spekit head folder; exported heads of the same method), or a .gguf file for llama.cpp. Returns the
    folder's config ({} for a .gguf file)."""
    path = Path(heads)
    if not path.exists():
        raise UserError(f"--heads {heads} not found (a folder written by `spekit export`)")
    if path.is_file():
        if engine == "llamacpp" and path.suffix == ".gguf":
            return {}
        raise UserError(f"--heads {heads} is a file; {engine} loads heads from a folder written by `spekit export`"
                        + (" (or that folder converted to a .gguf file)" if engine == "llamacpp" else ""))
    try:
        config = json.loads((path / "config.json").read_text())
    except OSError:
        raise UserError(f"--heads {heads} holds no config.json: not heads an engine loads (write them with "
                        "`spekit export`)") from None
    except ValueError as err:
        raise UserError(f"--heads {heads}: config.json is not JSON ({err})") from None
    if not isinstance(config, dict):
        raise UserError(f"--heads {heads}: config.json is not a model config")
    if "kind" in config and "architectures" not in config:
        to = engine if engine in ("vllm", "sglang") else "vllm"
        raise UserError(f"--heads {heads} is a spekit head folder, which {engine} cannot load: run `spekit export "
                        f"{shlex.quote(heads)} --to {to} --out EXPORTED` and pass --heads EXPORTED"
                        + (" (converted to GGUF by convert_hf_to_gguf.py)" if engine == "llamacpp" else ""))
    kind = (config.get("spekit") or {}).get("kind") if isinstance(config.get("spekit"), dict) else None
    kind = config.get("speculators_model_type") or kind
    if (kind in HEADED or kind == "mtp") and kind != method:
        raise UserError(f"--heads {heads} holds exported '{kind}' heads, not '{method}' heads")
    if "speculators_model_type" in config and engine != "vllm":
        raise UserError(f"--heads {heads} is in the speculators format, which {engine} does not load here: export "
                        f"the spekit heads with --to {'sglang' if engine == 'sglang' else 'vllm'} for it")
    return config


def _speculators(heads: str, config: dict, n: int) -> tuple[list[str], list[str]]:
    """vLLM runs a speculators-format folder as it is: `vllm serve DIR` reads its speculators_config (the verifier
    it names, the proposal's speculative tokens)."""
    spec = config.get("speculators_config") or {}
    verifier = (spec.get("verifier") or {}).get("name_or_path") or "MODEL"
    kind = config["speculators_model_type"]
    steps = ((spec.get("proposal_methods") or [{}])[0]).get("speculative_tokens", n)
    same = {"method": kind, "model": heads, "num_speculative_tokens": steps}
    layer = (config.get("transformer_layer_config") or {}).get("model_type", "")
    checked = kind == "eagle3" or (str(layer).startswith("qwen3") and config.get("num_nextn_predict_layers") == 1)
    return ["vllm", "serve", heads], [
        f"vLLM reads the speculators_config: {kind} drafter, target {verifier}, {steps} speculative tokens.",
        f"The same with the target named: vllm serve {verifier} --speculative-config '{json.dumps(same)}'",
        "vLLM verifies with its rejection sampler: lossless under sampling (up to floating-point numerics).",
        ("Checked by spekit's tests: speculators 0.9.0's own loader reads this layout and its forward gives "
         "spekit's logits" if checked else
         f"speculators 0.9.0 loads MTP drafters of the Qwen3 family with one layer only (this one: {layer!r}, "
         f"{config.get('num_nextn_predict_layers')} layers), so no reference code has read this folder") +
        "; no vLLM ran (no GPU engine where spekit was tested)."]


def engine_config(engine: str, method: str, model: str = "MODEL", heads: str | None = None,
                  draft: str | None = None, num_draft_tokens: int = 4) -> dict:
    """{command: [argv], yaml: text or None, notes: [...]} or a UserError saying plainly what is unsupported."""
    if engine not in ENGINES:
        raise UserError(f"unknown engine {engine!r}; one of: {', '.join(ENGINES)}")
    m = normalize(method)
    if m in UNSUPPORTED[engine]:
        others = [e for e in ENGINES if m not in UNSUPPORTED[e]]
        raise UserError(f"{engine} does not support method {method!r}: {UNSUPPORTED[engine][m]}"
                        + (f" (engines that do: {', '.join(others)})" if others else " (no engine here does)"))
    known = {"plain", "ngram", "draft", "mtp", "rest"} | HEADED
    if m not in known:
        raise UserError(f"unknown method {method!r} for engine configs; one of: {', '.join(sorted(known))}")
    if m == "draft" and not draft:
        raise UserError("method 'draft' needs --draft (the draft model the engine should load)")
    if draft and m != "draft":
        raise UserError(f"--draft is for --method draft; {m} loads no draft model")
    if heads and m not in HEADED | {"mtp"}:
        raise UserError(f"--heads is for --method {', '.join(sorted(HEADED | {'mtp'}))}; {m} loads no heads")
    config = _check_heads(heads, engine, m) if heads else {}
    if m == "mtp" and heads and "speculators_model_type" not in config:
        raise UserError(f"--heads with --method mtp is a speculators-format MTP drafter (`spekit export --to "
                        f"speculators`); {engine}'s mtp otherwise runs the model's own MTP layers (--model)")
    if "speculators_model_type" in config:
        cmd, notes = _speculators(heads, config, num_draft_tokens)
        return {"engine": engine, "method": m, "command": cmd, "yaml": None, "notes": notes}
    heads = heads or ("HEADS_DIR" if m in HEADED else None)
    yaml = None
    if engine == "trtllm":
        cmd, notes, yaml = _trtllm(m, model, heads, draft, num_draft_tokens)
    else:
        build = {"vllm": _vllm, "sglang": _sglang, "llamacpp": _llamacpp}[engine]
        cmd, notes = build(m, model, heads, draft, num_draft_tokens)
    if heads == "HEADS_DIR":
        notes.insert(0, f"HEADS_DIR: the {m} heads in {engine}'s layout, written by `spekit export` "
                        "(see `spekit export --help`).")
    if m == "plain":
        notes = ["plain decoding: no speculative flags."]
    return {"engine": engine, "method": m, "command": cmd, "yaml": yaml, "notes": notes}


def add_engine_config_parser(sub) -> None:
    p = sub.add_parser("engine-config", help="print the launch command that runs a method on vLLM, SGLang, "
                       "TensorRT-LLM or llama.cpp")
    p.add_argument("--engine", required=True, choices=ENGINES)
    p.add_argument("--method", required=True, help="plain, ngram, draft, medusa, eagle, eagle3, mtp ...")
    p.add_argument("--model", default="MODEL", help="the model as the engine loads it (HF id, folder or .gguf)")
    p.add_argument("--heads", default=None, help="folder of heads exported by `spekit export` for this engine "
                   "(--to speculators: vLLM runs it as `vllm serve DIR`)")
    p.add_argument("--draft", default=None, help="draft model for --method draft")
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.set_defaults(run=run_engine_config)


def run_engine_config(args: argparse.Namespace) -> None:
    if args.num_draft_tokens < 1:
        raise UserError(f"--num-draft-tokens must be >= 1, got {args.num_draft_tokens}")
    cfg = engine_config(args.engine, args.method, args.model, args.heads, args.draft, args.num_draft_tokens)
    if args.json:
        print(json.dumps(cfg))
        return
    if cfg["yaml"]:
        print(f"# spec.yaml\n{cfg['yaml']}")
    print(" ".join(shlex.quote(a) for a in cfg["command"]))
    for note in cfg["notes"]:
        print(f"# {note}")
