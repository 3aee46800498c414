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


def _logprobs(vocab: int = 32, seed: int = 0) -> mx.array:
    x = mx.random.normal((1, vocab), key=mx.random.key(seed))
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


@pytest.mark.parametrize("top_k", [32, 33, 10**12])
def test_a_top_k_of_the_whole_vocabulary_samples_as_no_top_k(top_k):
    """top_k >= the vocabulary keeps every token (mlx-lm's apply_top_k would raise for it, and poison MLX's random
    state): the direct sampler, the batch engine's row sampler and the speculative verifier's distribution all equal
    top_k = 0, and random draws still work afterwards."""
    from mlxkv.engine.row_sampler import RowSampler, sample_rows
    from mlxkv.engine.verify import sampling_logprobs

    lp = _logprobs()
    wide, off = SamplingParams(temp=0.8, top_k=top_k), SamplingParams(temp=0.8)
    draws = []
    for params in (wide, off):
        mx.random.seed(5)
        sampler = params.make_sampler()
        draws.append([sampler(lp).item() for _ in range(8)])
    assert draws[0] == draws[1]
    rows_a = sample_rows(mx.concatenate([lp, lp]), [RowSampler(wide, seed=1), RowSampler(wide, seed=2)]).tolist()
    rows_b = sample_rows(mx.concatenate([lp, lp]), [RowSampler(off, seed=1), RowSampler(off, seed=2)]).tolist()
    assert rows_a == rows_b
    assert mx.allclose(sampling_logprobs(lp, wide), sampling_logprobs(lp, off)).item()
    mx.eval(mx.random.categorical(lp))  # the global generator still draws


def test_a_sampler_that_raises_leaves_the_global_generator_usable():
    """An error inside one of mlx-lm's filters (compiled with MLX's random state as input and output) while the batch
    engine samples: the error reaches the caller and later random draws still work (the generator is reseeded)."""
    from mlx_lm.sample_utils import apply_top_k

    from mlxkv.engine.row_sampler import RowSampler, sample_rows

    broken = RowSampler(SamplingParams(temp=0.8))
    broken._filters = [lambda x: apply_top_k(x, 10**6)]  # a filter mlx-lm rejects while tracing
    with pytest.raises(ValueError, match="top_k"):
        sample_rows(_logprobs(), [broken])
    mx.eval(mx.random.categorical(_logprobs()))
    assert sample_rows(_logprobs(), [RowSampler(SamplingParams(temp=0.8))]).shape == (1,)


@pytest.mark.parametrize("seed", [-1, -(2**70), 2**64, 2**80 + 3])
def test_any_integer_seed_is_reproducible_and_equal_on_the_direct_and_batch_paths(seed):
    """Seeds outside MLX's unsigned 64-bit range (negative, too large) are taken modulo 2**64: the direct sampler
    after seeding and the batch engine's row sampler draw the same tokens, as they do for the seed's residue."""
    from mlxkv.engine.row_sampler import RowSampler, sample_rows
    from mlxkv.engine.sampling import mlx_seed

    lp = _logprobs()
    params = SamplingParams(temp=1.0, seed=seed)
    mx.random.seed(mlx_seed(seed))
    sampler = params.make_sampler()
    direct = [sampler(lp).item() for _ in range(6)]
    row = RowSampler(params, seed=seed)
    batch = [sample_rows(lp, [row]).item() for _ in range(6)]
    residue = RowSampler(SamplingParams(temp=1.0), seed=seed % 2**64)
    assert direct == batch == [sample_rows(lp, [residue]).item() for _ in range(6)]
    assert mlx_seed(-1) == 2**64 - 1
