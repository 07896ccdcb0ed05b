import weakref

import pytest
import torch
from tidal.actor import Actor, ActorConfig
from tidal.actor.errors import ActorOutOfMemoryError
from tidal.actor.oom import oom_message
from tidal.batching import pack

SEQS = [[5, 17, 99, 3, 42, 7, 64, 9, 11], [1, 2, 3, 4, 5], [120, 0, 33, 33, 8, 90, 12, 101, 4, 56, 77]]


@pytest.fixture(scope="module")
def actor(dist_env, qwen2_dir):
    return Actor(ActorConfig(hf_checkpoint=str(qwen2_dir), lr=1e-3, log_probs_chunk_size=5))


def train_batch(seqs=SEQS):
    masks = [[0] * 2 + [1] * (len(s) - 2) for s in seqs]
    fields = {"old_log_probs": [[-2.0] * len(s) for s in seqs], "advantages": [[1.0] * len(s) for s in seqs]}
    return pack(seqs, loss_masks=masks, token_fields=fields)


class Injected:
    """Raise torch.OutOfMemoryError in a layer's forward (or in its backward), keeping a weak reference to an
    activation of the failed pass to see whether it is freed."""

    def __init__(self, layer, *, backward: bool):
        self.ref = None
        self.handle = layer.register_forward_hook(self.hook)
        self.backward = backward

    def hook(self, module, args, output):
        hidden = output[0] if isinstance(output, tuple) else output
        self.ref = weakref.ref(hidden)
        if not self.backward:
            raise torch.OutOfMemoryError("CUDA out of memory (injected)")

        def fail(grad):
            raise torch.OutOfMemoryError("CUDA out of memory (injected in backward)")

        if hidden.requires_grad:
            hidden.register_hook(fail)

    def remove(self):
        self.handle.remove()


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "backward"])
def test_oom_in_training_is_one_line_and_frees_the_pass(actor, backward):
    before = [p.detach().clone() for p in actor.params]
    steps = actor.num_steps
    inject = Injected(actor.model.decoder.layers[1], backward=backward)
    try:
        with pytest.raises(ActorOutOfMemoryError) as info:
            actor.train_step([train_batch()])
    finally:
        inject.remove()
    message = str(info.value)
    assert "\n" not in message
    assert "training pass" in message and f"{train_batch().num_tokens} tokens" in message
    assert "--max-tokens-per-gpu" in message
    assert info.value.__cause__ is None and info.value.__context__ is None  # no traceback holding the pass
    assert inject.ref is not None and inject.ref() is None, "the failed pass's activations are still alive"
    # nothing was applied; the next step runs and changes the weights
    assert actor.num_steps == steps
    for p, b in zip(actor.params, before, strict=True):
        torch.testing.assert_close(p.detach(), b, atol=0, rtol=0)
    actor.train_step([train_batch()])
    assert actor.num_steps == steps + 1


def test_oom_in_log_probs_names_its_own_budget(actor):
    inject = Injected(actor.model.decoder.layers[0], backward=False)
    try:
        with pytest.raises(ActorOutOfMemoryError, match=r"log-prob pass .* --log-probs-max-tokens-per-gpu"):
            actor.compute_log_probs(pack(SEQS))
    finally:
        inject.remove()
    assert inject.ref() is None


def test_oom_message_says_what_to_change():
    gib = 2**30
    kw = dict(what="training", peak=70 * gib, limit=80 * gib, flag="--max-tokens-per-gpu")
    lower = oom_message(tokens=32768, fitting_tokens=20480, **kw)
    assert "peak 70.0 GiB of the card's 80.0 GiB" in lower and "--max-tokens-per-gpu 20480 fits" in lower
    assert "--recompute-activations" in lower
    # the plan expected it to fit: the message says the memory went elsewhere instead of proposing a larger budget
    elsewhere = oom_message(tokens=16384, fitting_tokens=20480, **kw)
    assert "expected 16384 tokens to fit" in elsewhere and "lower --max-tokens-per-gpu" in elsewhere
    nothing = oom_message(tokens=1024, fitting_tokens=0, **kw)
    assert "no micro-batch fits" in nothing
    logprob = oom_message(
        tokens=1024, fitting_tokens=512, **{**kw, "what": "log-prob", "flag": "--log-probs-max-tokens-per-gpu"}
    )
    assert "--recompute-activations" not in logprob


class FailingMLP:
    """Raise torch.OutOfMemoryError in a layer's MLP, keeping a weak reference to the MLP's input."""

    def __init__(self, layer):
        self.ref = None
        self.handle = layer.mlp.register_forward_pre_hook(self.hook)

    def hook(self, module, args):
        self.ref = weakref.ref(args[0])
        raise torch.OutOfMemoryError("CUDA out of memory (injected in the MLP)")


def test_megatron_layers_hold_their_input_until_the_mlp_ends(actor):
    # The reason for tidal.actor.oom.forget_failed_pass: when this fails, megatron-core no longer keeps the layer's
    # input on the layer between the pre-MLP norm and the MLP's end, and the workaround can go.
    layer = actor.model.decoder.layers[0]
    x = torch.randn(4, 1, actor.model.config.hidden_size, dtype=next(layer.parameters()).dtype)
    layer._forward_pre_mlp_layernorm(x)
    try:
        assert layer.mlp_norm_manager is not None and layer.mlp_norm_manager.tensor is x
    finally:
        layer.mlp_norm_manager = None


def test_oom_inside_the_mlp_lets_go_of_the_layer_input(actor):
    fail = FailingMLP(actor.model.decoder.layers[1])
    try:
        with pytest.raises(ActorOutOfMemoryError, match="log-prob pass"):
            actor.compute_log_probs(pack(SEQS))
    finally:
        fail.handle.remove()
    assert all(getattr(m, "mlp_norm_manager", None) is None for m in actor.model.modules())
    assert fail.ref is not None and fail.ref() is None, "the failed pass's MLP input is still alive"
    actor.compute_log_probs(pack(SEQS))  # and the next pass runs
