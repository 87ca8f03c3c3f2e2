"""Frozen settings. The CLI mirrors these fields one to one (`--max-new-tokens` <-> `max_new_tokens`)."""
from __future__ import annotations

import json
import math
import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path


class UserError(ValueError):
    """A mistake in the user's input: the CLI prints it as one line and exits 2, never a traceback."""


# the first transformers whose forwards take the KV cache as `cache=`, as spekit passes it: 5.23 and older call it
# past_key_values and take `cache` as an unknown keyword, so every step would attend to its own tokens only
TRANSFORMERS_NEEDED = (5, 24)


def check_transformers(version: str | None = None) -> None:
    """Refuse a transformers older than TRANSFORMERS_NEEDED (the installed one, or `version`) with the command
    that updates it."""
    if version is None:
        import transformers
        version = transformers.__version__
    found = re.match(r"(\d+)\.(\d+)", version)
    if found and (int(found[1]), int(found[2])) < TRANSFORMERS_NEEDED:
        need = ".".join(map(str, TRANSFORMERS_NEEDED))
        raise UserError(f"spekit needs transformers {need} or newer (found {version}): "
                        f"pip install -U 'transformers>={need},<6'")


def usual_modes(path) -> None:
    """Give a folder staged in a temporary place (mkdtemp makes it 0700, mkstemp files 0600) and what it holds the
    modes a plain mkdir / open would have given under the umask, before it is renamed into place."""
    mask = os.umask(0)
    os.umask(mask)
    path = Path(path)
    for p in [path, *path.rglob("*")]:
        p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)


def write_atomic(path: str | Path, text: str) -> None:
    """Write to a temporary name in the same folder, then rename: nothing half-written on disk."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".tmp-{path.name}-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        usual_modes(tmp)                        # mkstemp makes 0600; a report is for others to read too
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def can_write_in(folder: str | Path) -> bool:
    """Whether a file can be made in the existing `folder`: permitted, and tried (a nameless temporary file, gone at
    once), since os.access answers yes to root for /proc or a read-only mount, where the real write then fails
    after the work."""
    if not os.access(folder, os.W_OK | os.X_OK):
        return False
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


def read_user_text(path, what: str = "file") -> str:
    """The text of a file the user named. UserError naming `what` (e.g. "prompts file") when it is missing, a
    folder, unreadable or not UTF-8."""
    from pathlib import Path
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{what} {p} is a folder, not a file")
    try:
        return p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{what} not found: {p}") from None
    except UnicodeDecodeError as err:
        raise UserError(f"{what} {p} is not UTF-8 text (byte {err.start}: {err.reason})") from None
    except OSError as err:
        raise UserError(f"{what} {p} cannot be read ({err.strerror or err})") from None


def read_json_object(path, what: str, expected: str) -> dict:
    """A JSON object from a file the user named (read_user_text's errors); UserError naming the file when it is not
    JSON or not an object (`expected` says what it should be)."""
    import json
    try:
        info = json.loads(read_user_text(path, what))
    except json.JSONDecodeError as err:
        raise UserError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(info, dict):
        raise UserError(f"{path} is not {expected}")
    return info


def text_or_file(value: str, flag: str) -> str:
    """A flag's value given inline, or as @FILE (read with read_user_text, errors naming the flag)."""
    return read_user_text(value[1:], f"{flag} file") if value.startswith("@") else value


MAX_TOP_LOGPROBS = 20     # as OpenAI's chat API
MAX_LOGIT_BIAS = 100.0    # as OpenAI's logit_bias: -100 bans a token, 100 forces it


def parse_bias(text: str) -> tuple[int, float]:
    """One `--logit-bias` entry, "ID:BIAS" (token id, additive bias) -> (id, bias)."""
    tok, sep, bias = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(tok), float(bias)
    except ValueError:
        raise UserError(f"a logit bias is TOKEN_ID:BIAS, e.g. 50256:-100, got '{text}'") from None


@dataclass(frozen=True)
class SamplingConfig:
    """How tokens are chosen. The target's logits are processed in this order (spekit.sampling): logit bias,
    repetition penalty (over the whole context, as transformers), frequency and presence penalties (over the
    generated tokens, as OpenAI and vLLM), then temperature, top-k, top-p, min-p. temperature 0 means greedy: the
    argmax of the processed logits."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0   # minus this times a token's count among the generated tokens
    presence_penalty: float = 0.0    # minus this once a token occurs among the generated tokens
    # (token id, bias) pairs added to the logits
    logit_bias: tuple[tuple[int, float], ...] = field(
        default=(), metadata={"parse": parse_bias, "metavar": "ID:BIAS"})
    max_new_tokens: int = 128
    # the stop tokens (EOS, stop_ids) are banned until this many tokens were generated (transformers'
    # min_new_tokens, vLLM's min_tokens); applied at every draft node for its own depth, so it stays lossless
    min_new_tokens: int = field(default=0, metadata={"help": "no stop token (EOS, --stop-ids) before this many new "
                                                   "tokens (transformers' min_new_tokens, vLLM's min_tokens)"})
    stop_ids: tuple[int, ...] = ()
    seed: int = 0
    n: int = 1
    logprobs: bool = False     # each new token's log-probability under the target (raw: before the processing above)
    top_logprobs: int = 0      # and the most likely tokens at that place, up to MAX_TOP_LOGPROBS (implies logprobs)
    # structured output (spekit.grammar): the answer follows this JSON schema, or this regular expression
    json_schema: str = field(default="", metadata={"help": "the answer is JSON that follows this schema (JSON "
                                                  "text, or @FILE to read it; '{}': any JSON value)"})
    regex: str = field(default="", metadata={"help": "the answer matches this regular expression"})
    # how a chain of drawn drafts is verified under sampling (spekit.acceptance); both keep the target's law
    verification: str = field(default="block", metadata={
        "help": "block: the whole chain of sampled drafts judged jointly (Sun et al. 2024; never fewer tokens); "
                "token: each draft token in turn (the textbook rule). Both exact; greedy decoding is the same"})

    # LOSSY, opt-in (spekit.acceptance.relaxed_lossy): draft tokens this close to the target's best are accepted
    relaxed: float = field(default=0.0, metadata={
        "help": "LOSSY, opt-in: also accept a draft token whose log-probability under the target is within this "
                "many nats of the target's most likely token there (SpecDec's tolerance; 0: off, the exact rule). "
                "Faster, but the output is no longer the target's: labelled lossy in every output"})

    def __post_init__(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty",
                     "relaxed"):
            if not math.isfinite(getattr(self, name)):
                raise UserError(f"{name} must be a finite number, got {getattr(self, name)}")
        biased = [tok for tok, _ in self.logit_bias]
        if len(set(biased)) != len(biased):
            raise UserError(f"logit_bias names a token twice: {sorted(biased)}")
        for tok, bias in self.logit_bias:
            if tok < 0 or not (math.isfinite(bias) and abs(bias) <= MAX_LOGIT_BIAS):
                raise UserError(f"logit_bias needs token ids >= 0 and biases in [-{MAX_LOGIT_BIAS:g}, "
                                f"{MAX_LOGIT_BIAS:g}], got {tok}:{bias}")
        if any(t < 0 for t in self.stop_ids):
            raise UserError(f"stop ids are token ids (>= 0), got {list(self.stop_ids)}")
        if self.temperature < 0:
            raise UserError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p < 1:
            raise UserError(f"min_p must be in [0, 1), got {self.min_p}")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if self.repetition_penalty <= 0:
            raise UserError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise UserError(f"min_new_tokens must be in [0, max_new_tokens = {self.max_new_tokens}], got "
                            f"{self.min_new_tokens}")
        if self.n < 1:
            raise UserError(f"n must be >= 1, got {self.n}")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise UserError(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {self.top_logprobs}")
        if self.relaxed < 0:
            raise UserError(f"relaxed must be >= 0 nats (0: off), got {self.relaxed}")
        if self.verification not in ("block", "token"):
            raise UserError(f"verification must be block or token, got '{self.verification}'")
        if self.json_schema and self.regex:
            raise UserError("give json_schema or regex, not both")
        if self.json_schema:
            try:
                schema = json.loads(self.json_schema)
            except ValueError as err:
                raise UserError(f"json_schema is not JSON ({err})") from None
            if not isinstance(schema, (dict, bool)):
                raise UserError("json_schema must be a JSON object (a schema)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalizes_output(self) -> bool:
        """Whether the frequency or presence penalty needs the generated tokens' counts."""
        return self.frequency_penalty != 0 or self.presence_penalty != 0

    @property
    def constrained(self) -> bool:
        """Whether a grammar (json_schema or regex) constrains the answer."""
        return bool(self.json_schema or self.regex)

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs or self.top_logprobs > 0


def folder_kind(info) -> str | None:
    """What spekit wrote a folder with this config.json (parsed) as: a head's kind or "datastore" (a `kind` and a
    `target`), "draft" (a draft model), "export" (a serving engine's layout); None: not something spekit wrote."""
    if not isinstance(info, dict):
        return None
    if isinstance(info.get("kind"), str) and isinstance(info.get("target"), dict):
        return info["kind"]
    mark = info.get("spekit")
    if isinstance(mark, dict):
        return "draft" if mark.get("kind") == "draft" else "export"
    return None
