import pytest
import torch
from tidal.actor.logprobs import chunked_log_probs, to_token_convention, vocab_parallel_log_probs


def test_log_probs_and_entropy_match_log_softmax(dist_env):
    torch.manual_seed(0)
    logits = torch.randn(9, 50) * 3
    targets = torch.randint(0, 50, (9,))
    lp, ent = vocab_parallel_log_probs(logits, targets, with_entropy=True)
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(lp, ref.gather(-1, targets[:, None]).squeeze(-1))
    torch.testing.assert_close(ent, torch.distributions.Categorical(logits=logits).entropy())


class Head(torch.nn.Module):
    """Stands in for the LM head's call signature only: (hidden [N,1,H], weight=None) -> (logits [N,1,V], None)."""

    def __init__(self, weight):
        super().__init__()
        self.weight = torch.nn.Parameter(weight)

    def forward(self, h, weight=None):
        return h @ (self.weight if weight is None else weight).T, None


@pytest.mark.parametrize("chunk", [1, 4, 100])
def test_chunked_equals_full_with_gradients(dist_env, chunk):
    torch.manual_seed(0)
    hidden = torch.randn(10, 1, 16, requires_grad=True)
    head = Head(torch.randn(40, 16))
    targets = torch.randint(0, 40, (10,))
    lp, ent = chunked_log_probs(hidden, head, None, targets, chunk_size=chunk, temperature=0.7, with_entropy=True)
    (lp.sum() + ent.sum()).backward()
    got_h, got_w = hidden.grad.clone(), head.weight.grad.clone()

    hidden.grad = None
    head.weight.grad = None
    logits = (hidden.squeeze(1) @ head.weight.T) / 0.7
    ref_lp = torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)
    ref_ent = torch.distributions.Categorical(logits=logits).entropy()
    (ref_lp.sum() + ref_ent.sum()).backward()
    torch.testing.assert_close(lp, ref_lp)
    torch.testing.assert_close(ent, ref_ent)
    torch.testing.assert_close(got_h, hidden.grad)
    torch.testing.assert_close(got_w, head.weight.grad)


def test_token_convention_shift():
    rows = torch.tensor([10.0, 11.0, 12.0, 20.0, 21.0, 30.0])  # row t predicts token t+1
    cu = torch.tensor([0, 3, 5, 6], dtype=torch.int32)
    assert to_token_convention(rows, cu).tolist() == [0.0, 10.0, 11.0, 0.0, 20.0, 0.0]
