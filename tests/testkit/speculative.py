"""Helpers shared by the speculative-decoding tests: hooked test models, a scripted drafter, perturbed drafts."""

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from mlxkv.engine.drafters import Draft, Drafter
from mlxkv.kv.layouts import install_attention_hook
from testkit.archs import TEST_VOCAB_SIZE, build_model


def build(arch: str, seed: int = 0):
    """The test model with mlxkv's attention hook installed (as ``mlxkv.models.load`` does)."""
    model, _ = build_model(arch, seed)
    install_attention_hook(model)
    return model


class ScriptedDrafter(Drafter):
    """Proposes the known greedy continuation with one wrong token per round, at position round % (k + 1):
    rounds accept 0, 1, ..., k tokens in turn (k: full acceptance)."""

    def __init__(self, reference: list[int]):
        self.reference = reference

    def begin(self, prompt, params, vocab_size, max_draft):
        self.pos, self.round = 0, 0  # pos: committed tokens

    def propose(self, k):
        tokens = list(self.reference[self.pos:self.pos + k])
        wrong = self.round % (k + 1)
        self.round += 1
        if wrong < len(tokens):
            tokens[wrong] = (tokens[wrong] + 1) % TEST_VOCAB_SIZE
        return Draft(tokens)

    def commit(self, draft, accepted, token):
        self.pos += accepted + 1


def perturbed(arch: str, eps: float = 0.05, seed: int = 7):
    """The ``arch`` test model with every matrix jittered by ``eps`` of its own std: a draft that mostly agrees."""
    clone = build(arch)
    params = tree_flatten(clone.parameters())
    keys = mx.random.split(mx.random.key(seed), len(params))
    clone.update(tree_unflatten([
        (name, p + eps * p.std() * mx.random.normal(p.shape, key=keys[i]) if p.ndim >= 2 else p)
        for i, (name, p) in enumerate(params)]))
    mx.eval(clone.parameters())
    return clone
