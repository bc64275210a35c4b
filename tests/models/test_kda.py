"""Kimi Delta Attention's chunked rule (per-channel decay) against the recurrence a token at
a time, with checkpoints inside chunks, several chunks and strong decay (long chunks whose
cumulative decay would overflow exp(-G))."""

import pytest

torch = pytest.importorskip("torch")

from hybridkv.models.layers.kda import chunked_kda_rule  # noqa: E402


def token_loop(q, k, v, beta, g, s, offsets):
    out, saved = [], {}
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, :, None]
        memory = (s * k[t][:, :, None]).sum(dim=1)
        delta = (v[t] - memory) * beta[t][:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        out.append((s * q[t][:, :, None]).sum(dim=1))
        if t + 1 in offsets:
            saved[t + 1] = s.clone()
    return torch.stack(out), s, saved


@pytest.mark.parametrize("num_tokens,decay", [(1, 1.0), (2, 1.0), (9, 1.0), (40, 1.0),
                                              (70, 8.0)])
def test_chunked_kda_rule_equals_the_token_loop(num_tokens, decay):
    torch.manual_seed(num_tokens)
    heads, dk, dv = 3, 8, 5
    unit = torch.nn.functional.normalize
    q = unit(torch.randn(num_tokens, heads, dk), dim=-1) / dk ** 0.5
    k = unit(torch.randn(num_tokens, heads, dk), dim=-1)
    v = torch.randn(num_tokens, heads, dv)
    beta = torch.sigmoid(torch.randn(num_tokens, heads))
    # A decay per key channel (some channels nearly keep, some forget fast).
    g = -decay * torch.exp(torch.randn(num_tokens, heads, dk))
    start = torch.randn(heads, dk, dv)
    offsets = {o for o in (1, 5, 16, 17, 33, num_tokens) if o <= num_tokens}
    save_at = {o: torch.empty(heads, dk, dv) for o in offsets}
    out, final = chunked_kda_rule(q, k, v, beta, g, start.clone(), save_at, chunk_size=32)
    out_ref, final_ref, saved = token_loop(q, k, v, beta, g, start, offsets)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, out_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, final_ref, atol=1e-5, rtol=1e-5)
    for o in offsets:
        torch.testing.assert_close(save_at[o], saved[o], atol=1e-5, rtol=1e-5)
