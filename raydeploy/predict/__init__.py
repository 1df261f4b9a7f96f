"""Offline batch inference over the gang: `raydeploy predict CONFIG --input in.jsonl --output out.jsonl`.

The input streams through a bounded window: each line is read, parsed, tokenized and submitted only when the
window has room, and its row is written as soon as every earlier line's row is, so the driver's memory does not
grow with the input (`input`: lines, parsing, hashes; `run`: the window over the gang; `output`: rows, resume,
fsync, the lock). Every non-blank input line gets exactly one output row, in input order: its result, or an
error row (`"error": {"message", "type"}`) when the line is malformed or its generation failed
(`--on-error skip`, the default, goes on; `fail` stops after writing every row before it). Each row carries
`input_sha256`, a hash of its input line, so a resumed run checks that the existing output was made from this
input, line by line, and refuses an edited one. `<output>.lock` (flock) keeps a second run from writing the
same output.
"""

from raydeploy.predict.input import BadLine, Example, InputLine, PredictInputError, input_lines, parse_line
from raydeploy.predict.output import OutputLock, OutputWriter, error_row, result_row, resume_rows
from raydeploy.predict.run import Outcome, PredictRunError, examples_from_prompts, generate_all, run_predict

__all__ = [
    "BadLine", "Example", "InputLine", "Outcome", "OutputLock", "OutputWriter", "PredictInputError",
    "PredictRunError", "error_row", "examples_from_prompts", "generate_all", "input_lines",
    "parse_line", "result_row", "resume_rows", "run_predict",
]
