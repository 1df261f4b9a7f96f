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
    assert wire == {"temperature": 0.5, "top_p": 0.9, "top_k": 4, "repetition_penalty": 1.1, "seed": 3}
    assert SamplingParams.from_wire(wire) == sp
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
