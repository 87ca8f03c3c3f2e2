"""Drafter training: prompts (prompts.py, prompt_files.py) -> self-distillation (distill.py) -> target features
(features.py) -> the generic loop (trainer.py) over any head of spekit.heads or the draft model (draft.py);
`spekit train` (cli.py, run.py)."""
