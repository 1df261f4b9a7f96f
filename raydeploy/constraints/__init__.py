"""Structured outputs: what a request's generated text must match, compiled to a per-token mask.

`spec.Constraint` is the request's constraint as plain data (it crosses Ray with the request); the grammar
engine compiles it, on the ingress to refuse a bad one with a 400 (`grammar.check`) and on rank 0 into the
matcher the scheduler advances token by token. No JAX here.
"""

from raydeploy.constraints.grammar import ConstraintError, check, to_grammar
from raydeploy.constraints.matcher import GrammarEngine, Matcher, words_for
from raydeploy.constraints.spec import KINDS, Constraint, ConstraintKind

__all__ = ["KINDS", "Constraint", "ConstraintError", "ConstraintKind", "GrammarEngine", "Matcher", "check",
           "to_grammar", "words_for"]
