"""The chunked SSD scan against the token-by-token recurrence it replaces."""

import pytest

torch = pytest.importorskip("torch")

from hybridkv.models.layers.ssd import ssd_scan  # noqa: E402


@pytest.mark.parametrize("groups", [4, 2, 1])
@pytest.mark.parametrize("num_tokens, chunk_size", [(1, 16), (37, 16), (64, 16), (50, 7)])
def test_ssd_scan_equals_the_recurrence(num_tokens, chunk_size, groups):
    torch.manual_seed(num_tokens)
    heads, head_dim, state_size = 4, 8, 5
    x = torch.randn(num_tokens, heads, head_dim)
    dt = torch.rand(num_tokens, heads) * 0.5
    a = -torch.rand(heads)
    # B and C per group of heads; the recurrence reads each head's group's.
    bg = torch.randn(num_tokens, groups, state_size)
    cg = torch.randn(num_tokens, groups, state_size)
    b = bg.repeat_interleave(heads // groups, dim=1)
    c = cg.repeat_interleave(heads // groups, dim=1)
    start = torch.randn(heads, head_dim, state_size)
    offsets = [o for o in (3, 16, 20, 32) if o <= num_tokens]
    h, expected, snapshots = start.clone(), torch.empty_like(x), {}
    for t in range(num_tokens):
        h = h * torch.exp(dt[t] * a)[:, None, None] + \
            (dt[t][:, None, None] * x[t][:, :, None]) * b[t][:, None, :]
        expected[t] = torch.einsum("hpn,hn->hp", h, c[t])
        if t + 1 in offsets:
            snapshots[t + 1] = h.clone()
    saves = {o: torch.empty_like(start) for o in offsets}
    y, final = ssd_scan(x, dt, a, bg, cg, start.clone(), chunk_size=chunk_size,
                        save_at=saves)
    torch.testing.assert_close(y, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, h, atol=1e-5, rtol=1e-5)
    for o in offsets:
        torch.testing.assert_close(saves[o], snapshots[o], atol=1e-5, rtol=1e-5)
