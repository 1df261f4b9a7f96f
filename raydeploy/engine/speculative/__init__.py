"""Speculative decoding: proposals made on rank 0, verified by the target model in the ragged step.

A speculating decode row brings its last sampled token and k proposed tokens as one chunk of k + 1 queries
(`SeqStep.spec` says how many of its tokens are proposals). The verification program (`ProgramShape`
"verify", `raydeploy.engine.programs.bodies`) draws a token at every place of such a chunk exactly as a plain
decode row would have drawn it there: the same processed distribution (allowed tokens, logit_bias, the
penalties over the tokens before that place, temperature, top-k, top-p, min_p) and the same randomness (the
request's seed folded with the position the token takes, `raydeploy.engine.sampling.row_keys`). Proposal j is
accepted while every draw before it equalled the proposal there; the first draw that differs (or the draw
after the last proposal, the bonus) is emitted after the accepted ones and ends the run (`verify`).

For a deterministic proposal (the n-gram lookup's), that rule is the standard speculative rejection rule:
proposal t is accepted with probability p(t) under the processed target distribution, and when it is rejected
the emitted token is a draw from p conditioned on not being t, which is p with t removed and renormalised.
Greedy rows take the argmax, so accepted is the longest prefix matching the argmax. Because each draw uses the
key of the position it takes, a seeded request emits the same tokens with speculation as without.

The parts:
- `ngram` (host, no JAX): prompt lookup over the request's own prompt and output;
- `policy` (host, no JAX): which rows speculate in a plan, and the per-request back-off;
- `verify` (JAX): the verification inputs (`SpecInputs`), the acceptance rule and the sampling tail of the
  speculating rows.

Rejected tokens: their K/V were written past the row's accepted length, so they are simply overwritten later;
the scheduler gives back the pages that only rejected positions needed (`SequencePages.shrink`) and registers in
the prefix cache only pages of accepted (computed) tokens. docs/speculative.md tells the whole story.
"""
