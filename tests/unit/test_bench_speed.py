"""`memrad bench speed` arms: WEIGHTS[:DTYPE[:DECODE[:KV]]], as the docs and .ci/device-check write them."""

import pytest

from memrad.bench.speed import arm_spec, default_arms


@pytest.mark.parametrize("text,expected", [
    ("int4:bfloat16:compiled", ("int4", "bfloat16", "compiled", "auto")),
    ("int4:bfloat16", ("int4", "bfloat16", "eager", "auto")),  # .ci/device-check's form
    ("float", ("float", "auto", "eager", "auto")),
    ("float:float32:transformers", ("float", "float32", "transformers", "auto")),
    ("int4:float32:compiled:activations", ("int4", "float32", "compiled", "activations")),  # the KV A/B
])
def test_arm_specs_read_weights_dtype_and_decode_step(text, expected):
    assert arm_spec(text) == expected


@pytest.mark.parametrize("text", ["int4:bfloat16:fast", "int4:bfloat16:eager:x", "int4:float32:eager:auto:x"])
def test_a_bad_arm_says_what_it_expects(text):
    with pytest.raises(SystemExit, match="expected WEIGHTS:DTYPE:DECODE\\[:KV\\] with DECODE one of compiled, eager, "
                                         "transformers and KV one of auto, activations, bfloat16"):
        arm_spec(text)


def test_every_default_arm_parses_and_the_last_is_the_fp32_engine_of_before():
    arms = default_arms()
    assert all(arm_spec(arm) for arm in arms)
    assert arms[-1] == "float:float32:transformers"
