"""The grammar engines for structured outputs, side by side in one run: llguidance (what raydeploy.constraints
uses) against xgrammar, on rank 0's work per constrained token.

For a realistic JSON schema (nested objects, enums, arrays with min/max items, integer bounds, bounded strings),
on two vocabularies:

- `demo49k`: the demo model's tokenizer (SmolLM2, byte-level BPE, 49152 tokens);
- `synthetic128k`: the same tokenizer grown to 128256 tokens (Llama 3's vocabulary size). There is no 128k
  tokenizer on disk and no hub access, so the 79104 extra tokens are concatenations of two existing ordinary
  tokens (drawn with a fixed seed among the 20000 lowest ids, the most frequent merges; duplicates skipped), added
  to the BPE model's vocabulary in tokenizer.json (no merges: the text still tokenizes as before, but every mask
  covers every token, which is what a larger vocabulary costs). Both libraries load it as they load any
  Hugging Face tokenizer.

Figures (each library configured alike: compact JSON, no free whitespace, additionalProperties as the schema says):
- tokenizer setup (once per deployment);
- compile: schema to a matcher ready for its first mask, median of `--compiles` runs with each library's
  compile cache off (llguidance builds lazily, so its first mask is counted in);
- mask: time to fill one packed uint32 mask [ceil(vocab / 32)] per token while walking a valid output (the
  schema's example instance, tokenized by the tokenizer): p50 / p99 / mean / max of the first walk (a schema's
  first request: llguidance builds its lexer states lazily) and of `--walks` - 1 later walks of fresh matchers
  from the same compiled grammar (what GrammarEngine's cache gives later requests); each token is checked
  against the mask before it is accepted, by both libraries.

    flock /tmp/raydeploy-heavy.lock .venv/bin/python benchmarks/grammar_mask.py   # benchmarks/results/grammar_mask.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results" / "grammar_mask.json"
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from machine import cpu_flags  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 1000000},
        "customer": {"type": "object", "properties": {
            "name": {"type": "string", "maxLength": 40},
            "email": {"type": "string", "maxLength": 60},
            "tier": {"enum": ["free", "pro", "enterprise"]},
            "address": {"type": "object", "properties": {
                "street": {"type": "string", "maxLength": 60}, "city": {"type": "string", "maxLength": 30},
                "country": {"enum": ["US", "DE", "FR", "JP", "BR", "IN"]},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["street", "city", "country", "zip"], "additionalProperties": False}},
            "required": ["name", "email", "tier", "address"], "additionalProperties": False},
        "items": {"type": "array", "minItems": 1, "maxItems": 5, "items": {"type": "object", "properties": {
            "sku": {"type": "string", "maxLength": 16}, "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
            "price": {"type": "number", "minimum": 0},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 0, "maxItems": 4}},
            "required": ["sku", "quantity", "price", "tags"], "additionalProperties": False}},
        "status": {"enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "gift": {"type": "boolean"},
        "notes": {"type": ["string", "null"], "maxLength": 120},
    },
    "required": ["id", "customer", "items", "status", "gift", "notes"],
    "additionalProperties": False,
}
INSTANCE = {
    "id": 48213,
    "customer": {"name": "Ada Lovelace", "email": "ada@example.com", "tier": "pro",
                 "address": {"street": "12 Analytical Engine Road", "city": "London", "country": "DE",
                             "zip": "10115"}},
    "items": [{"sku": "BK-1843", "quantity": 2, "price": 19.5, "tags": ["book", "history"]},
              {"sku": "PN-7", "quantity": 12, "price": 3.25, "tags": []}],
    "status": "shipped",
    "gift": False,
    "notes": "Leave at the door, please.",
}
BIG_VOCAB = 128256


def demo_tokenizer_json() -> str:
    from raydeploy.checkpoint.demo import resolve_checkpoint

    return (Path(resolve_checkpoint("demo:smollm2-135m-instruct")) / "tokenizer.json").read_text()


def grown_tokenizer_json(base: str, size: int, seed: int = 0) -> str:
    """`base` (a byte-level BPE tokenizer.json) with ordinary tokens added to its model's vocabulary up to `size`
    ids: concatenations of two of its 20000 lowest-id ordinary tokens (module docstring)."""
    import numpy as np

    d = json.loads(base)
    vocab: dict[str, int] = d["model"]["vocab"]
    special = {t["content"] for t in d["added_tokens"]}
    pool = [t for t, i in sorted(vocab.items(), key=lambda kv: kv[1]) if t not in special][:20000]
    rng = np.random.default_rng(seed)
    next_id = max(vocab.values()) + 1
    while next_id < size:
        a, b = rng.integers(0, len(pool), 2)
        tok = pool[a] + pool[b]
        if tok not in vocab:
            vocab[tok] = next_id
            next_id += 1
    return json.dumps(d)


def hf_tokenizer(tokenizer_json: str):
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json), eos_token="<|im_end|>",
                                   bos_token="<|im_start|>", unk_token="<|endoftext|>")


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def summary(walks: list[list[float]]) -> dict[str, float]:
    """Mask times of the first walk (a schema's first request) and of the later ones (its compiled grammar
    reused, as GrammarEngine does), in microseconds."""
    out = {}
    for name, xs in (("first", walks[0]), ("later", [x for w in walks[1:] for x in w])):
        if xs:
            out.update({f"{name}_p50_us": round(pct(xs, 0.5) * 1e6, 1), f"{name}_p99_us": round(pct(xs, 0.99) * 1e6, 1),
                        f"{name}_mean_us": round(statistics.fmean(xs) * 1e6, 1),
                        f"{name}_max_us": round(max(xs) * 1e6, 1)})
    return out


def bit(words, token: int) -> bool:
    return bool((int(words.reshape(-1)[token // 32]) >> (token % 32)) & 1)


def run_llguidance(tokenizer_json: str, vocab: int, eos: int, tokens: list[int], compiles: int, walks: int) -> dict:
    import numpy as np
    from llguidance import LLMatcher, LLTokenizer

    t0 = time.perf_counter()
    tok = LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
    setup_s = time.perf_counter() - t0
    grammar = LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults={"whitespace_flexible": False})
    words = np.zeros((vocab + 31) // 32, np.uint32)
    compile_s = []
    for _ in range(compiles):  # a fresh tokenizer-bound matcher each time: no compiled-grammar reuse
        t0 = time.perf_counter()
        m = LLMatcher(tok, grammar, log_level=0)
        m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
        compile_s.append(time.perf_counter() - t0)
        assert not m.is_error(), m.get_error()
    pristine = LLMatcher(tok, grammar, log_level=0)
    mask_s: list[list[float]] = []
    for _ in range(walks):
        m = pristine.deep_copy()
        mask_s.append([])
        for t in tokens:
            t0 = time.perf_counter()
            m.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)
            mask_s[-1].append(time.perf_counter() - t0)
            assert bit(words, t), f"llguidance: token {t} not allowed"
            assert m.consume_token(t), m.get_error()
        assert m.is_accepting()
    return {"setup_s": round(setup_s, 3), "compile_ms_p50": round(statistics.median(compile_s) * 1e3, 2),
            "compile_ms_max": round(max(compile_s) * 1e3, 2), **summary(mask_s)}


def run_xgrammar(hf, vocab: int, eos: int, tokens: list[int], compiles: int, walks: int) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
    setup_s = time.perf_counter() - t0
    schema = json.dumps(SCHEMA)
    compile_s = []
    for _ in range(compiles):
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(schema, any_whitespace=False, separators=(",", ":"),
                                                strict_mode=True)
        compile_s.append(time.perf_counter() - t0)
    import numpy as np

    words = np.zeros((1, (vocab + 31) // 32), np.int32)
    mask_s: list[list[float]] = []
    for _ in range(walks):
        m = xgr.GrammarMatcher(compiled)
        mask_s.append([])
        for t in tokens:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(words)
            mask_s[-1].append(time.perf_counter() - t0)
            assert bit(words.view(np.uint32), t), f"xgrammar: token {t} not allowed"
            assert m.accept_token(t)
        assert m.is_terminated() or m.accept_token(eos)
    return {"setup_s": round(setup_s, 3), "compile_ms_p50": round(statistics.median(compile_s) * 1e3, 2),
            "compile_ms_max": round(max(compile_s) * 1e3, 2), **summary(mask_s)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--compiles", type=int, default=5)
    ap.add_argument("--walks", type=int, default=5)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

    base = demo_tokenizer_json()
    text = json.dumps(INSTANCE, separators=(",", ":"))
    import jsonschema

    jsonschema.validate(INSTANCE, SCHEMA)
    out: dict = {"cpu_flags": cpu_flags(), "cores": os.cpu_count(), "load_average_1m": os.getloadavg()[0],
                 "llguidance": importlib.metadata.version("llguidance"),
                 "xgrammar": importlib.metadata.version("xgrammar"), "schema": SCHEMA, "output": text, "cases": []}
    for name, tokenizer_json, vocab in (("demo49k", base, 49152),
                                        ("synthetic128k", grown_tokenizer_json(base, BIG_VOCAB), BIG_VOCAB)):
        hf = hf_tokenizer(tokenizer_json)
        eos = hf.convert_tokens_to_ids("<|im_end|>")
        tokens = hf.encode(text, add_special_tokens=False)
        assert len(hf) == vocab, (len(hf), vocab)
        for lib in ("llguidance", "xgrammar"):
            if lib == "llguidance":
                r = run_llguidance(tokenizer_json, vocab, eos, tokens, args.compiles, args.walks)
            else:
                r = run_xgrammar(hf, vocab, eos, tokens, args.compiles, args.walks)
            row = {"vocab": name, "vocab_size": vocab, "library": lib, "output_tokens": len(tokens), **r}
            out["cases"].append(row)
            print(json.dumps(row), flush=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
