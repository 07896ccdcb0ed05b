"""The RL micro-batch the actor tests train on (imported by the worker scripts, and by tests via conftest's fixture)."""

from tidal.batching import pack, unpack


def rl_batch(actor, seqs, advantages=(1.0, -1.0, 0.5), **kw):
    """``seqs`` packed with the actor's own log-probs as old log-probs, one advantage per sequence, and the first
    two tokens of each sequence out of the loss (a prompt); ``kw`` goes to ``pack``."""
    masks = [[0, 0] + [1] * (len(s) - 2) for s in seqs]
    plain = pack(seqs, loss_masks=masks)
    old = unpack(actor.compute_log_probs(plain), plain)
    fields = {
        "old_log_probs": [o.tolist() for o in old],
        "advantages": [[a] * len(s) for a, s in zip(advantages, seqs, strict=True)],
    }
    return pack(seqs, loss_masks=masks, token_fields=fields, **kw)
