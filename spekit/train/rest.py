"""`spekit train rest`: the datastore of `--method rest` from the target's own answers to the training prompts
(distilled as for the heads, cached and resumable), with tau measured on held-out prompts the datastore leaves out.
Answers distilled earlier into other folders (`--more-data`) and texts the model wrote before (`--texts`, such as
a server's logs) join it as they are; with either, the prompts are optional."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..config import UserError


def rest_command(args: argparse.Namespace, command: str) -> dict:
    from ..api import Spekit
    from ..retrieval.datastore import write_datastore
    from ..heads.base import target_info
    from .folders import check_data_flags, distill_data, training_records
    from .distill import read_answers
    from .run import measure_tau, split
    from .texts import read_texts

    out = Path(args.out)
    check_data_flags(args, "datastore")
    if not (args.prompts or args.texts or args.more_data):
        raise UserError("give --prompts (the target answers them), --texts FILE or --more-data DIR")
    records = training_records(args) if args.prompts else []   # bad input fails before loading
    if records and not 0 <= args.held_out < len(records):
        raise UserError(f"--held-out must be in [0, {len(records) - 1}] for {len(records)} prompts")
    for folder in args.more_data:
        if Path(folder).exists() and not Path(folder).is_dir():
            raise UserError(f"--more-data {folder} is a file; give a distillation folder (holding answers.jsonl)")
    more = [read_answers(folder) for folder in args.more_data]    # a missing folder fails before the model loads
    texts = [t for path in args.texts for t in read_texts(path)]
    sk = Spekit.load(args.model, "plain", None, args.dtype, args.device, args.quantize, args.compile)
    answers = read_answers(distill_data(args, sk)) if records else []
    train_ids, held = split(records, args.held_out, args.seed)
    sequences = [a["answer_ids"] for a in answers if a["id"].split("/")[0] in train_ids]
    sequences += [a["answer_ids"] for extra in more for a in extra]
    sequences += [sk.tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    _check_vocab(sequences, sk.target.vocab_size)
    if not sequences:
        raise UserError("no answers or texts to build a datastore from (are the prompts' ids in the data?)")
    meta = {"tokens": sum(len(s) for s in sequences), "tau": None, "command": command, "target": args.model,
            "trained_on": ", ".join(str(f) for f in ([args.prompts] if args.prompts else []) + args.texts)}
    write_datastore(out, sequences, target_info(sk.target), meta)
    by_id = {a["id"]: a for a in answers}
    prompts = [by_id[r["id"]]["prompt_ids"] for r in held if r["id"] in by_id]
    if prompts:
        meta.update(measure_tau(sk, "rest", prompts, args.eval_tokens, datastore=str(out)))
        write_datastore(out, sequences, target_info(sk.target), meta)
    print(json.dumps({"kind": "rest", "out": str(out), "sequences": len(sequences), **meta}))
    return meta


def _check_vocab(sequences: list[list[int]], vocab_size: int) -> None:
    """Answers of another model (a larger vocabulary) would index tokens this model does not have."""
    top = max((max(seq) for seq in sequences if seq), default=-1)
    if top >= vocab_size:
        raise UserError(f"the answers hold token id {top}, outside this model's vocabulary of {vocab_size}: "
                        f"were they distilled from another model?")
