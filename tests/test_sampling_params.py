"""The one sampling type: named fields on the wire and one source of defaults (`engine.sampling`) for every
command, a flag or a request field overriding it."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

from raydeploy.cli import build_parser
from raydeploy.config import load_config
from raydeploy.engine.step import SamplingParams, SeqStep
from raydeploy.predict.input import Example


def test_wire_form_is_named_and_round_trips():
    sp = SamplingParams(0.5, 0.9, 4, 1.1, 3)
    wire = msgpack.unpackb(msgpack.packb(sp.to_wire()), raw=False)
    assert wire == {"temperature": 0.5, "top_p": 0.9, "top_k": 4, "repetition_penalty": 1.1, "seed": 3,
                    "presence_penalty": 0.0, "frequency_penalty": 0.0, "min_p": 0.0, "logit_bias": [],
                    "min_tokens": 0}
    assert SamplingParams.from_wire(wire) == sp
    full = SamplingParams(0.5, seed=2**64 - 1, presence_penalty=-1.5, frequency_penalty=2.0, min_p=0.1,
                          logit_bias={7: -100, 3: 2.5}, min_tokens=4)
    assert full.logit_bias == ((3, 2.5), (7, -100.0))  # a mapping kept as sorted pairs
    assert SamplingParams.from_wire(msgpack.unpackb(msgpack.packb(full.to_wire()), raw=False)) == full
    assert SamplingParams.from_wire({"temperature": 1}) == SamplingParams(temperature=1.0)  # others: neutral
    with pytest.raises(ValueError, match=r"sampling fields \['min_q'\] are not among"):
        SamplingParams.from_wire({"temperature": 1.0, "min_q": 0.1})


def test_seq_step_carries_sampling_by_name_only_where_set():
    first = SeqStep(1, np.arange(3, dtype=np.int32), 0, True, SamplingParams(temperature=0.7, seed=5),
                    np.arange(2, dtype=np.int32))
    decode = SeqStep(1, np.zeros(0, np.int32), 3, True)
    assert set(decode.to_wire()) == {"slot", "tokens", "start", "sample"}
    assert first.to_wire()["sampling"] == SamplingParams(temperature=0.7, seed=5).to_wire()
    back = SeqStep.from_wire(msgpack.unpackb(msgpack.packb(first.to_wire(), use_bin_type=True), raw=False))
    assert (back.slot, back.tokens.tolist(), back.start, back.sample, back.sampling, back.prefix_tokens.tolist()) == (
        1, [0, 1, 2], 0, True, SamplingParams(temperature=0.7, seed=5), [0, 1])


def test_resolve_takes_each_value_given_else_the_configs():
    cfg = load_config(None)  # the embedded default: engine.sampling temperature 0.7, top_p 0.95
    d = cfg.engine.sampling
    assert SamplingParams.resolve(d, seed=9) == SamplingParams(d.temperature, d.top_p, d.top_k,
                                                               d.repetition_penalty, 9)
    assert d.temperature == 0.7
    got = SamplingParams.resolve(d, temperature=0.0, top_k=5)
    assert (got.temperature, got.top_p, got.top_k) == (0.0, d.top_p, 5)


def test_generate_and_predict_flags_default_to_the_config():
    """No command carries a sampling default of its own: an absent flag is None, resolved from engine.sampling."""
    parser = build_parser()
    gen = parser.parse_args(["generate", "--prompt", "x"])
    assert (gen.temperature, gen.top_p, gen.top_k) == (None, None, None)
    pred = parser.parse_args(["predict", "--input", "i", "--output", "o"])
    assert pred.temperature is None
    assert parser.parse_args(["generate", "--prompt", "x", "--temperature", "0"]).temperature == 0.0


def test_predict_requests_take_the_configs_sampling_unless_the_flag_says():
    from raydeploy.predict.run import make_request

    cfg = load_config(None)
    ex = Example(4, 4, (1, 2, 3), 8)
    s = cfg.engine.sampling
    assert make_request(ex, None, cfg).sampling == SamplingParams(s.temperature, s.top_p, s.top_k,
                                                                  s.repetition_penalty, 4)
    assert make_request(ex, 0.0, cfg).sampling.temperature == 0.0
    greedy = load_config(None, overrides=["engine.sampling.temperature=0"])
    assert make_request(ex, None, greedy).sampling.temperature == 0.0


def test_resolve_takes_the_openai_controls_by_name_and_refuses_what_the_engine_cannot_honour():
    cfg = load_config(None)
    d = cfg.engine.sampling
    neutral = SamplingParams.resolve(d, seed=1)
    assert (neutral.presence_penalty, neutral.frequency_penalty, neutral.min_p, neutral.logit_bias,
            neutral.min_tokens) == (0.0, 0.0, 0.0, (), 0)
    got = SamplingParams.resolve(d, seed=1, presence_penalty=0.5, frequency_penalty=-0.25, min_p=0.05,
                                 logit_bias={"12": 5, 3: -100}, min_tokens=8)
    assert (got.presence_penalty, got.frequency_penalty, got.min_p, got.logit_bias, got.min_tokens) == (
        0.5, -0.25, 0.05, ((3, -100.0), (12, 5.0)), 8)
    bad = [({"presence_penalty": 2.5}, r"presence_penalty 2.5 is outside \[-2, 2\]"),
           ({"frequency_penalty": -3}, r"frequency_penalty -3.0 is outside \[-2, 2\]"),
           ({"min_p": 1.5}, r"min_p 1.5 is outside \[0, 1\]"),
           ({"logit_bias": {1: 101}}, r"logit_bias entry 1: 101.0 needs .* \[-100, 100\]"),
           ({"logit_bias": {-1: 1}}, r"logit_bias entry -1"),
           ({"logit_bias": {i: 1 for i in range(301)}}, r"logit_bias has 301 entries, at most 300"),
           ({"min_tokens": -1}, r"min_tokens -1 is negative")]
    for kwargs, message in bad:
        with pytest.raises(ValueError, match=message):
            SamplingParams.resolve(d, seed=1, **kwargs)


def test_first_chunk_carries_min_tokens_stop_ids_on_the_wire():
    q = SeqStep(0, np.arange(3, dtype=np.int32), 0, True, SamplingParams(min_tokens=2), None, None,
                stop_ids=np.asarray([2, 9], np.int32), stop_until=5)
    back = SeqStep.from_wire(msgpack.unpackb(msgpack.packb(q.to_wire(), use_bin_type=True), raw=False))
    assert back.stop_ids.tolist() == [2, 9] and back.stop_until == 5
    assert "stop_ids" not in SeqStep(0, np.zeros(0, np.int32), 3, True).to_wire()
