"""Mamba1's chunked scan against the recurrence a token at a time, with checkpoints inside
and at the edges of chunks, and chunks cut short by a wide layer."""

import pytest

torch = pytest.importorskip("torch")

from hybridkv.models.layers import mamba1  # noqa: E402


def token_loop(dt, a, x, b, c, state, offsets):
    ys, saved = [], {}
    for t in range(x.shape[0]):
        state = torch.exp(dt[t, :, None] * a) * state + (dt[t] * x[t])[:, None] * b[t][None, :]
        ys.append(state @ c[t])
        if t + 1 in offsets:
            saved[t + 1] = state.clone()
    return torch.stack(ys), state, saved


@pytest.mark.parametrize("num_tokens", [1, 7, 32, 75])
@pytest.mark.parametrize("chunk_elements", [1 << 22, 600])  # 600: chunks of 3 tokens
def test_chunked_scan_equals_the_token_loop(num_tokens, chunk_elements, monkeypatch):
    monkeypatch.setattr(mamba1, "_CHUNK_ELEMENTS", chunk_elements)
    torch.manual_seed(num_tokens)
    inner, n = 8, 6
    dt = torch.nn.functional.softplus(torch.randn(num_tokens, inner))
    a = -torch.exp(torch.randn(inner, n))
    x, b, c = torch.randn(num_tokens, inner), torch.randn(num_tokens, n), \
        torch.randn(num_tokens, n)
    start = torch.randn(inner, n)
    offsets = {o for o in (1, 3, 4, 31, 32, 33, 60, num_tokens) if o <= num_tokens}
    save_at = {o: torch.empty(inner, n) for o in offsets}
    y, final = mamba1.chunked_scan(dt, a, x, b, c, start.clone(), save_at)
    y_ref, final_ref, saved = token_loop(dt, a, x, b, c, start, offsets)
    torch.testing.assert_close(y, y_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, final_ref, atol=1e-5, rtol=1e-5)
    for o in offsets:
        torch.testing.assert_close(save_at[o], saved[o], atol=1e-5, rtol=1e-5)
