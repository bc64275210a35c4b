"""The C norms, RoPE and K/V writes (worker/cpu_ops.py) against the torch formulas they
replace, on the strided views the model hands them (q and k out of a fused projection)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hybridkv.models.layers.norms import RMSNorm  # noqa: E402
from hybridkv.models.layers.rotary import apply_rope  # noqa: E402
from hybridkv.worker import cpu_ops  # noqa: E402


def fused_views(tokens=5, heads=3, kv_heads=2, dim=24):
    """q [T, H, D] and k [T, Hk, D] as views into one [T, (H + 2 Hk) * D] projection."""
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    q = qkv[:, :heads * dim].unflatten(-1, (heads, dim))
    k = qkv[:, heads * dim:(heads + kv_heads) * dim].unflatten(-1, (kv_heads, dim))
    v = qkv[:, (heads + kv_heads) * dim:].unflatten(-1, (kv_heads, dim))
    return q, k, v


@pytest.mark.parametrize("offset", [0.0, 1.0])
@pytest.mark.parametrize("shape", ["rows", "heads_of_fused_projection"])
def test_rms_norm_equals_torch(offset, shape):
    torch.manual_seed(0)
    x = torch.randn(7, 40) if shape == "rows" else fused_views()[0]
    norm = RMSNorm(x.shape[-1], 1e-6, offset)
    with torch.no_grad():
        norm.weight.normal_()
    expect = norm(x)
    norm.native_ops = True
    got = norm(x)
    assert got.shape == expect.shape
    torch.testing.assert_close(got, expect, atol=2e-6, rtol=2e-6)
    assert not torch.equal(cpu_ops.rms_norm(x, None, 1e-6), expect)  # the weight counts


@pytest.mark.parametrize("rotary_dim", [24, 12])
def test_rope_equals_torch(rotary_dim):
    torch.manual_seed(1)
    q, _, _ = fused_views()
    angles = torch.randn(q.shape[0], 1, rotary_dim // 2)
    cos = torch.cat([angles.cos(), angles.cos()], -1) * 1.3
    sin = torch.cat([angles.sin(), angles.sin()], -1) * 1.3
    expect = torch.cat([apply_rope(q[..., :rotary_dim], cos, sin), q[..., rotary_dim:]], -1)
    torch.testing.assert_close(cpu_ops.rope(q, cos, sin, rotary_dim), expect,
                               atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("per_page", [1, 3])
def test_write_kv_lands_where_the_torch_write_does(per_page):
    torch.manual_seed(2)
    block, kv_heads, dim = 4, 2, 24
    _, k, v = fused_views(tokens=6, kv_heads=kv_heads, dim=dim)
    slots = torch.tensor([0, 5, 6, 17, 30, 47])  # manager slots: block * 4 + offset
    pages = torch.zeros(12 // per_page, per_page, 2, block, kv_heads, dim)
    cpu_ops.write_kv(k, v, pages, slots, block, per_page)
    expect = torch.zeros_like(pages)
    blocks, offsets = slots // block, slots % block
    expect[blocks // per_page, blocks % per_page, 0, offsets] = k
    expect[blocks // per_page, blocks % per_page, 1, offsets] = v
    assert torch.equal(pages, expect)


def test_an_unwritable_cache_is_a_build_error_that_auto_falls_back_from(tmp_path, monkeypatch):
    """Where the kernels cannot be built, "auto" runs the torch backend and an explicit
    "cpu" is refused in one line."""
    from hybridkv.worker import native
    from hybridkv.worker.attention.backend import TorchReferenceBackend, get_backend

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("HYBRIDKV_CACHE_DIR", str(blocker))
    monkeypatch.setattr(native, "_loaded", {})
    with pytest.raises(native.NativeBuildError, match="cannot build paged_attention.c"):
        native.load("paged_attention")
    assert type(get_backend("auto", "cpu")) is TorchReferenceBackend
    with pytest.raises(ValueError, match="attention backend 'cpu' needs its C kernel"):
        get_backend("cpu", "cpu")


def counted(monkeypatch, name):
    """A list that gains an entry each time cpu_ops.<name> runs (it still runs)."""
    calls: list[int] = []
    run = getattr(cpu_ops, name)
    monkeypatch.setattr(cpu_ops, name, lambda *a, **k: calls.append(1) or run(*a, **k))
    return calls


@pytest.mark.parametrize("conv_bias", [True, False])
@pytest.mark.parametrize("groups", [1, 2, 4])
def test_a_mamba2_decode_step_in_c_equals_the_torch_mixer(groups, conv_bias, monkeypatch):
    """One Mamba-2 decode step of rows scattered over pages and slots in one C call (conv
    from its state and silu, dt's softplus, the state update, y = state . C + x D) against
    the mixer's torch code: y and both states of those rows, the other states untouched;
    xbc and dt read strided out of one projection."""
    from types import SimpleNamespace

    torch.manual_seed(groups + 10 * conv_bias)
    mixer = mamba2_mixer(8, groups, conv_bias=conv_bias)
    pages, slots = 3, 4
    conv0 = torch.randn(pages, slots, mixer.conv_dim, mixer.kernel - 1)
    ssm0 = torch.randn(pages, slots, mixer.num_heads, 8, mixer.state_size)
    meta = SimpleNamespace(state_pages=[2, 0, 1], state_slots=[1, 3, 1])
    rows = [0, 1, 2]
    projected = torch.randn(3, mixer.inner + mixer.conv_dim + mixer.num_heads)
    _, xbc, dt = projected.split([mixer.inner, mixer.conv_dim, mixer.num_heads], -1)

    def run(native):
        mixer.native_ops = native
        states = (conv0.clone(), ssm0.clone())
        with torch.no_grad():
            y = mixer._decode_batch(xbc, dt, meta, rows, states)
        return y, states

    y_ref, (conv_ref, ssm_ref) = run(False)
    calls = counted(monkeypatch, "mamba2_decode")
    y, (conv, ssm) = run(True)
    assert calls, "the C step did not run"
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv, conv_ref, rtol=0, atol=0)
    torch.testing.assert_close(ssm, ssm_ref, rtol=1e-6, atol=1e-6)
    untouched = torch.ones(pages, slots, dtype=torch.bool)
    untouched[meta.state_pages, meta.state_slots] = False
    assert torch.equal(conv[untouched], conv0[untouched])
    assert torch.equal(ssm[untouched], ssm0[untouched])
    assert cpu_ops.decode_states_take(conv0, ssm0)
    assert not cpu_ops.decode_states_take(conv0, ssm0.transpose(3, 4))
    assert not cpu_ops.decode_states_take(conv0.transpose(2, 3), ssm0)
    assert not cpu_ops.decode_states_take(conv0, ssm0.double())


@pytest.mark.parametrize("k_heads,v_heads", [(2, 2), (2, 4), (1, 3)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_a_gated_deltanet_decode_step_in_c_equals_the_torch_mixer(k_heads, v_heads, threads,
                                                                  monkeypatch):
    """One Gated DeltaNet decode step of rows scattered over pages and slots in one C call
    (conv from its state and silu, q/k L2-normalised, the gated delta rule) against the
    mixer's torch code: the output and both states of those rows, the other states untouched;
    q|k|v read strided out of one wider tensor; the bytes the same at 1, 2 and 3 threads (each
    head one thread's; the step is big enough to split)."""
    from types import SimpleNamespace

    from hybridkv.models.layers.gated_deltanet import GatedDeltaNet

    torch.manual_seed(k_heads + 10 * v_heads)
    cfg = {"hidden_size": 32, "linear_num_key_heads": k_heads, "linear_num_value_heads":
           v_heads, "linear_key_head_dim": 32, "linear_value_head_dim": 48,
           "linear_conv_kernel_dim": 4}
    mixer = GatedDeltaNet(cfg, 0)
    with torch.no_grad():
        for p in mixer.parameters():
            p.normal_()
    channels = mixer.conv1d.in_channels
    pages, slots = 3, 4
    conv0 = torch.randn(pages, slots, channels, 3)
    ssm0 = torch.randn(pages, slots, v_heads, 32, 48)
    meta = SimpleNamespace(state_pages=[2, 0, 1], state_slots=[1, 3, 1])
    rows = [0, 1, 2]
    mixed = torch.randn(3, channels + 5)[:, 2:channels + 2]  # a strided view
    beta = torch.sigmoid(torch.randn(3, v_heads))
    g = -torch.rand(3, v_heads) * 2

    def run(native, at_threads=None):
        mixer.native_ops = native
        states = (conv0.clone(), ssm0.clone())
        saved = torch.get_num_threads()
        torch.set_num_threads(at_threads or saved)
        try:
            with torch.no_grad():
                out = mixer._decode_batch(mixed, beta, g, meta, rows, states)
        finally:
            torch.set_num_threads(saved)
        return out, states

    out_ref, (conv_ref, ssm_ref) = run(False)
    calls = counted(monkeypatch, "gdn_decode")
    out, (conv, ssm) = run(True, threads)
    again, _ = run(True, threads)
    single, _ = run(True, 1)
    assert calls, "the C step did not run"
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(conv, conv_ref, rtol=0, atol=0)
    torch.testing.assert_close(ssm, ssm_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(out, again) and torch.equal(out, single)
    untouched = torch.ones(pages, slots, dtype=torch.bool)
    untouched[meta.state_pages, meta.state_slots] = False
    assert torch.equal(conv[untouched], conv0[untouched])
    assert torch.equal(ssm[untouched], ssm0[untouched])


@pytest.mark.parametrize("beta_scale", [1.0, 2.0])
def test_gated_deltanet_gates_and_output_norm_in_c_equal_torchs(beta_scale, monkeypatch):
    """The gates beta = sigmoid(b) * scale, g = -exp(A_log) softplus(a + dt_bias) (inputs
    past softplus's threshold of 20 included) and the gated per-head norm in one C call
    each against the mixer's torch formulas, on z read out of a wider projection."""
    from hybridkv.models.layers.gated_deltanet import GatedDeltaNet

    torch.manual_seed(3)
    cfg = {"hidden_size": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
           "linear_key_head_dim": 16, "linear_value_head_dim": 24}
    mixer = GatedDeltaNet(cfg, 0, beta_scale=beta_scale)
    with torch.no_grad():
        for p in mixer.parameters():
            p.normal_()
    b, a = torch.randn(7, 4) * 4, torch.randn(7, 4) * 12  # some a + dt_bias past 20
    out = torch.randn(7, 4, 24)
    z = torch.randn(7, 4 * 24 + 8)[:, 8:].unflatten(-1, (4, 24))  # rows strided

    def run(native):
        mixer.native_ops = native
        with torch.no_grad():
            return (*mixer._gates(b, a), mixer._output(out, z, torch.float32))

    ref = run(False)
    gates, norms = counted(monkeypatch, "gdn_gates"), counted(monkeypatch, "gated_head_norm")
    ours = run(True)
    assert gates and norms, "the C calls did not run"
    for got, want in zip(ours, ref, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_an_attention_output_gate_in_c_equals_torchs():
    """out * sigmoid(gate) with the gate read per head out of q_proj's output (each head's q,
    then its gate), large and small gates included, in place."""
    torch.manual_seed(4)
    q_out = torch.randn(5, 3, 2 * 16) * 8
    gate = q_out.chunk(2, -1)[1]
    out = torch.randn(5, 3 * 16)
    want = out * torch.sigmoid(gate.flatten(1))
    got = cpu_ops.sigmoid_gate(out.clone(), gate)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bias", [True, False])
def test_a_short_conv_decode_step_in_c_equals_the_torch_mixer(bias, monkeypatch):
    """LFM2's short conv over a batch of two single-token steps scattered over pages and
    slots and a 3-token prompt of a fresh request: the C step for the first two (C *
    conv(B * x), the conv from its state) against the mixer's torch code, the outputs and
    the states; other states untouched."""
    from types import SimpleNamespace

    from hybridkv.models.layers.short_conv import ShortConv
    from hybridkv.worker.state import StateMetadata

    torch.manual_seed(5)
    mixer = ShortConv(16, 3, 0, bias=bias)
    with torch.no_grad():
        for p in mixer.parameters():
            p.normal_()
    states0 = torch.randn(3, 4, 16, 2)
    meta = StateMetadata(query_start_loc=[0, 1, 2, 5], state_pages=[2, 0, 1],
                         state_slots=[1, 3, 2], has_initial_state=[True, True, False],
                         init_from=[None, None, None], checkpoints=[[], [], []])
    h = torch.randn(5, 16)

    def run(native):
        mixer.native_ops = native
        states = states0.clone()
        ctx = SimpleNamespace(state=lambda name: (meta, (states,)))
        with torch.no_grad():
            return mixer(h, torch.arange(5), ctx), states

    out_ref, states_ref = run(False)
    calls = counted(monkeypatch, "short_conv_decode")
    out, states = run(True)
    assert calls, "the C step did not run"
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(states, states_ref, rtol=0, atol=0)
    untouched = torch.ones(3, 4, dtype=torch.bool)
    untouched[meta.state_pages, meta.state_slots] = False
    assert torch.equal(states[untouched], states0[untouched])


def mamba2_mixer(head_dim, groups, heads=4, size=16, conv_bias=True):
    from hybridkv.models.layers.mamba2 import Mamba2Mixer

    cfg = {"hidden_size": 32, "mamba_num_heads": heads, "mamba_head_dim": head_dim,
           "ssm_state_size": size, "n_groups": groups, "conv_kernel": 4,
           "use_conv_bias": conv_bias, "time_step_min": 0.05}
    mixer = Mamba2Mixer(cfg, 0)
    with torch.no_grad():
        for p in mixer.parameters():
            p.normal_()
        mixer.dt_bias.uniform_(-3, 1)  # dt + dt_bias spans softplus's range and the floor
    return mixer


@pytest.mark.parametrize("tokens", [37, 1])
@pytest.mark.parametrize("head_dim", [64, 8])  # 64: the AVX-512 code where there is one
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_a_mamba2_prompt_in_c_equals_the_torch_mixer(head_dim, groups, tokens, state_dtype,
                                                     monkeypatch):
    """A request's Mamba-2 prompt (conv, silu, dt's softplus and floor, the scan, the D skip)
    in two C calls against the mixer's torch code and models/layers/ssd.py's chunked scan:
    the output, both live states and every checkpoint, with x|B|C and dt read strided out of
    one projection as the model splits them, and a bf16 checkpoint taking the state
    rounded; live states in bf16 (--state-dtype bf16) too."""
    torch.manual_seed(head_dim + groups + tokens)
    mixer = mamba2_mixer(head_dim, groups)
    projected = torch.randn(tokens, mixer.inner + mixer.conv_dim + mixer.num_heads)
    _, xbc, dt = projected.split([mixer.inner, mixer.conv_dim, mixer.num_heads], -1)
    conv0 = torch.randn(mixer.conv_dim, mixer.kernel - 1).to(state_dtype)
    ssm0 = torch.randn(mixer.num_heads, head_dim, mixer.state_size).to(state_dtype)
    offsets = sorted({min(5, tokens), tokens})

    def run(native):
        mixer.native_ops = native
        conv, ssm = conv0.clone(), ssm0.clone()
        saves = [(o, torch.empty_like(conv0),
                  torch.empty(ssm0.shape, dtype=torch.bfloat16 if o == tokens else
                              torch.float32)) for o in offsets]
        with torch.no_grad():
            y = mixer._request(xbc, dt, conv, ssm, saves)
        return y, conv, ssm, saves

    y_ref, conv_ref, ssm_ref, saves_ref = run(False)
    calls = counted(monkeypatch, "mamba2_scan")
    y, conv, ssm, saves = run(True)
    assert calls, "the C scan did not run"
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(conv, conv_ref, rtol=0, atol=0)
    tol = 1e-5 if state_dtype == torch.float32 else 1e-2  # bf16: one rounding apart
    torch.testing.assert_close(ssm.float(), ssm_ref.float(), rtol=tol, atol=tol)
    for (o, c, s), (_, c_ref, s_ref) in zip(saves, saves_ref, strict=True):
        torch.testing.assert_close(c, c_ref, rtol=0, atol=0, msg=f"conv checkpoint {o}")
        torch.testing.assert_close(s.float(), s_ref.float(), rtol=1e-2 if o == tokens else 1e-5,
                                   atol=1e-2 if o == tokens else 1e-5,
                                   msg=f"state checkpoint {o}")
    assert torch.equal(saves[-1][2], ssm.to(torch.bfloat16))


@pytest.mark.parametrize("bias", [True, False])
def test_causal_conv_in_c_equals_torchs(bias, monkeypatch):
    """The depthwise causal conv in one C call (state.causal_conv with the mixer's cpu ops
    on) against torch's conv1d on the state's inputs and the tokens', strided rows, no
    activation."""
    from hybridkv.models.layers.state import causal_conv

    torch.manual_seed(bias)
    tokens, channels, kernel = 9, 24, 4
    conv = torch.nn.Conv1d(channels, channels, kernel, groups=channels, bias=bias)
    x = torch.randn(tokens, 2 * channels)[:, channels:]
    state0 = torch.randn(channels, kernel - 1)
    checkpoints = {o: torch.empty(channels, kernel - 1) for o in (0, 2, tokens)}
    ref_state = state0.clone()
    ref_checkpoints = {o: torch.empty(channels, kernel - 1) for o in checkpoints}
    with torch.no_grad():
        expect = causal_conv(x, ref_state, conv, [(o, c, None) for o, c in
                                                   ref_checkpoints.items()])
        state = state0.clone()
        calls = counted(monkeypatch, "causal_conv")
        got = causal_conv(x, state, conv, [(o, c, None) for o, c in checkpoints.items()],
                          native=True)
    assert calls, "the C conv did not run"
    torch.testing.assert_close(got, expect, rtol=1e-6, atol=1e-6)
    assert torch.equal(state, ref_state)
    for o in checkpoints:
        assert torch.equal(checkpoints[o], ref_checkpoints[o]), o


@pytest.mark.parametrize("threads", [2, 3])
def test_the_mamba2_scan_gives_one_threads_bytes_at_any_thread_count(threads):
    """The prompt scan splits heads over threads: output, state and checkpoints are the
    bytes one thread gives (a shape past the kernel's threshold for threads)."""
    from hybridkv.worker import cpu_ops

    torch.manual_seed(9)
    heads, head_dim, size, groups, tokens = 6, 16, 32, 2, 200
    xbc = torch.randn(tokens, heads * head_dim + 2 * groups * size)
    dt = torch.randn(tokens, heads)
    dt_bias, a, skip = torch.randn(heads), -torch.rand(heads), torch.randn(heads)
    state0 = torch.randn(heads, head_dim, size)

    def scan(t):
        state = state0.clone()
        saves = {50: torch.empty_like(state0), tokens: torch.empty_like(state0)}
        before = torch.get_num_threads()
        torch.set_num_threads(t)
        try:
            y = cpu_ops.mamba2_scan(xbc, dt, dt_bias, a, skip, 1e-3, state, groups, saves)
        finally:
            torch.set_num_threads(before)
        return y, state, saves

    y1, s1, c1 = scan(1)
    y2, s2, c2 = scan(threads)
    assert torch.equal(y1, y2) and torch.equal(s1, s2)
    assert all(torch.equal(c1[k], c2[k]) for k in c1)
