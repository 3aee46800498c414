import mlx.core as mx
import pytest

from mlxkv.engine.sampling import SamplingParams


@pytest.mark.parametrize(
    "field, value",
    [("max_tokens", 0), ("temp", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("min_p", 1.0)],
)
def test_out_of_range_values_are_rejected_with_the_range(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_greedy_sampler_is_argmax():
    logprobs = mx.log(mx.softmax(mx.array([[0.1, 3.0, 0.2, 2.9]]), axis=-1))
    assert SamplingParams().make_sampler()(logprobs).item() == 1


def test_top_k_one_is_argmax_even_when_sampling():
    logprobs = mx.log(mx.softmax(mx.array([[0.1, 3.0, 0.2, 2.9]]), axis=-1))
    sampler = SamplingParams(temp=5.0, top_k=1).make_sampler()
    assert {sampler(logprobs).item() for _ in range(20)} == {1}


def test_empty_stop_strings_are_dropped():
    assert SamplingParams(stop=("", "x")).stop == ("x",)
