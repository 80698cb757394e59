"""`memrad bench speed` arms: WEIGHTS[:DTYPE[:DECODE]], as the docs and .ci/device-check write them."""

import pytest

from memrad.bench.speed import arm_spec, default_arms


@pytest.mark.parametrize("text,expected", [
    ("int4:bfloat16:compiled", ("int4", "bfloat16", "compiled")),
    ("int4:bfloat16", ("int4", "bfloat16", "eager")),  # .ci/device-check's form
    ("float", ("float", "auto", "eager")),
    ("float:float32:transformers", ("float", "float32", "transformers")),
])
def test_arm_specs_read_weights_dtype_and_decode_step(text, expected):
    assert arm_spec(text) == expected


@pytest.mark.parametrize("text", ["int4:bfloat16:fast", "int4:bfloat16:eager:x"])
def test_a_bad_arm_says_what_it_expects(text):
    with pytest.raises(SystemExit, match="expected WEIGHTS:DTYPE:DECODE with DECODE one of compiled, eager, transformers"):
        arm_spec(text)


def test_every_default_arm_parses_and_the_last_is_the_fp32_engine_of_before():
    arms = default_arms()
    assert all(arm_spec(arm) for arm in arms)
    assert arms[-1] == "float:float32:transformers"
