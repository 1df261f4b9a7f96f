"""Structured outputs: what a request's generated text must match, compiled to a per-token mask.

`spec.Constraint` is the request's constraint as plain data (it crosses Ray with the request); the grammar
engine compiles it, on the ingress to refuse a bad one with a 400 and on rank 0 into the matcher the scheduler
advances token by token. No JAX here.
"""
