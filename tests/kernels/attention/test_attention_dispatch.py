"""The attention family's dispatch (kernels/attention/__init__.py): which kernels `choose` picks
for each kind of heads on each kind of GPU, that "auto" launches them and a named kernel runs or
is refused, and the bf16 attention's operands (q, k, v rounded once, read from the fused
tensors). The GPU is pretended (checks.on_device) so that each choice is tested in the
simulator too."""
import numpy as np
import pytest

from checks import A100, H200, device, device_at, on_device, poisoned, recording_launches
from conftest import GPU, relative_error
from nanoandrea.kernels import attention, operands
from nanoandrea.kernels.attention import float32, mma_sync, reference
from nanoandrea.kernels.operands import Bf16Heads
from nanoandrea.kernels.ptx.mma import pack_bf16
from nanoandrea.kernels.runtime import device as runtime_device
from test_attention_mma import TOLERANCE as BF16_TOLERANCE
from test_attention_reference import check_attention


def heads_of(rng, D, offset=0, shape=(1, 2, 9)):
    return device_at(rng.standard_normal((*shape, D)).astype(np.float32), offset)


@pytest.mark.parametrize("card", [A100, H200], ids=["A100", "H200"])
def test_float32_heads_take_the_flash_kernels_or_the_reference(rng, monkeypatch, card):
    """float32 heads: the flash kernels for D = 16, 32 or 64 with rows 16-byte aligned, on any
    GPU; the reference kernels for other head sizes and for heads 1 float off."""
    on_device(monkeypatch, card)
    for D in (16, 32, 64):
        assert attention.choose(D, [heads_of(rng, D) for _ in range(4)]) == "float32"
        assert attention.choose(D, [heads_of(rng, D, offset=1)] + [
            heads_of(rng, D) for _ in range(3)]) == "reference"
    for D in (8, 40, 72, 384):
        assert attention.choose(D, [heads_of(rng, D) for _ in range(4)]) == "reference"


def test_bf16_heads_take_wgmma_on_hopper_and_mma_sync_elsewhere(rng, monkeypatch):
    """Bf16Heads (q, k, v rounded once: heads_operand) of D = 32 or 64: wgmma on a GPU of
    compute capability 9.0, mma.sync on an 8.x GPU; bf16 heads of another D are refused."""
    for D in attention.TENSOR_CORE_HEAD_SIZES:
        x = heads_of(rng, D)
        arrays = (x, operands.heads_bf16(x), operands.heads_bf16(x), operands.heads_bf16(x))
        on_device(monkeypatch, A100)
        assert attention.choose(D, arrays) == "mma"
        on_device(monkeypatch, H200)
        assert attention.choose(D, arrays) == "wgmma"
    wide = Bf16Heads(device(np.zeros((1, 2, 9, 36)), np.uint32))          # (D = 72)
    with pytest.raises(ValueError, match="tensor-core kernels take D in"):
        attention.choose(72, (wide,))


@pytest.mark.parametrize("D", float32.HEAD_SIZES)
def test_attention_unaligned_heads_take_the_reference(rng, monkeypatch, D):
    """q, k, v and dout whose rows are not 16-byte aligned (1 float off): "auto" takes the
    reference kernels (the flash kernels stage 16 bytes at a time), and "float32" refuses
    them."""
    launched = recording_launches(monkeypatch, float32, reference)
    check_attention(rng, D, "auto", None, 1, 2, 9, 0.3, offset=1)
    dims = reference.lane_dims(D)
    assert set(launched) == {reference.reference_forward_kernel(dims),
                             reference.reference_dq_kernel(dims),
                             reference.reference_dkdv_kernel(dims)}
    with pytest.raises(ValueError, match="16-byte aligned rows"):
        check_attention(rng, D, "float32", None, 1, 2, 9, 0.3, offset=1)


def test_auto_launches_the_kernels_chosen(rng, monkeypatch):
    """"auto" on float32 heads of D = 32 launches the flash kernels, of D = 72 the reference
    ones; an unknown name is refused."""
    launched = recording_launches(monkeypatch, float32, reference)
    for D, kernel in ((32, float32.forward_kernel(32, float32.TILES[32][0], False)),
                      (72, reference.reference_forward_kernel(reference.lane_dims(72)))):
        q = heads_of(rng, D)
        attention.attention_forward(poisoned(q.shape), poisoned(q.shape[:3]), q, q, q)
        assert launched[-1] is kernel
    with pytest.raises(ValueError, match="unknown kernel 'fast'"):
        attention.attention_forward(q, poisoned(q.shape[:3]), q, q, q, kernel="fast")


def test_auto_launches_the_tensor_core_kernels_of_the_gpu(rng, monkeypatch):
    """The bf16 attention's "auto": the wgmma launchers on a GPU that runs wgmma, the mma.sync
    ones on an 8.x GPU, forward and backward (the launchers recorded, not run)."""
    from nanoandrea.kernels.attention import wgmma
    called = []
    for module, name in ((wgmma, "attention_forward_wgmma"), (wgmma, "attention_backward_wgmma"),
                         (mma_sync, "attention_forward_mma"),
                         (mma_sync, "attention_backward_mma")):
        monkeypatch.setattr(module, name, lambda *args, name=name: called.append(name))
    B, H, T, D = 1, 2, 9, 32
    q = heads_of(rng, D, shape=(B, H, T))
    for card, kernels in ((H200, "wgmma"), (A100, "mma")):
        on_device(monkeypatch, card)
        called.clear()
        attention.attention_forward_bf16(poisoned(q.shape), poisoned((B, H, T)), q, q, q)
        attention.attention_backward_bf16(*(poisoned(q.shape) for _ in range(3)),
                                          poisoned((B, H, T)), q, q, q, q, q,
                                          poisoned((B, H, T)))
        assert called == [f"attention_forward_{kernels}", f"attention_backward_{kernels}"]


def test_attention_bf16_takes_the_tensor_cores(rng, monkeypatch):
    """D = 64 runs the mma.sync kernels (named: on Hopper "auto" takes wgmma's); D = 72 (no
    tensor-core kernel of its size) the float32 reference kernels, correct to float32's
    tolerance."""
    B, H, T = 1, 1, 9
    for D, kernel, expected in ((64, "mma", [mma_sync.forward_kernel(64, False),
                                             mma_sync.dq_kernel(64, False),
                                             mma_sync.dkdv_kernel(64, False)]),
                                (72, "auto", [
                                    reference.reference_forward_kernel(reference.lane_dims(72)),
                                    reference.reference_dq_kernel(reference.lane_dims(72)),
                                    reference.reference_dkdv_kernel(reference.lane_dims(72))])):
        launched = recording_launches(monkeypatch, mma_sync, float32, reference)
        q, k, v, dout = (device(rng.standard_normal((B, H, T, D))) for _ in range(4))
        out, lse = poisoned((B, H, T, D)), poisoned((B, H, T))
        attention.attention_forward_bf16(out, lse, q, k, v, kernel=kernel)
        grads = [poisoned((B, H, T, D)) for _ in range(3)]
        attention.attention_backward_bf16(*grads, poisoned((B, H, T)), dout, q, k, v, out, lse,
                                          kernel=kernel)
        assert all(any(made is x for x in launched) for made in expected)
        host = [x.copy_to_host().astype(np.float64) for x in (q, k, v, dout)]
        want_out, want_lse = np.empty((B, H, T, D)), np.empty((B, H, T))
        attention.attention_forward_numpy(want_out, want_lse, *host[:3])
        tolerance = 1e-5 if D == 72 else BF16_TOLERANCE
        assert relative_error(out.copy_to_host(), want_out) < tolerance
        want = [np.empty((B, H, T, D)) for _ in range(3)]
        attention.attention_backward_numpy(*want, np.empty((B, H, T)), host[3], *host[:3],
                                           want_out, want_lse)
        for got, expected_grad in zip(grads, want):
            assert relative_error(got.copy_to_host(), expected_grad) < tolerance


def test_attention_bf16_rounds_its_operands_once(rng, monkeypatch):
    """q, k, v given as Bf16Heads (heads_operand, what the model's attention hands over): the
    forward and the backward launch no rounding of them (the backward rounds dout alone), and
    every result is the same to the bit as from float32 q, k, v. D = 72 has no bf16 kernel:
    heads_operand leaves it float32, and the float32 kernels read it."""
    B, H, T, D = 1, 2, 20 if not GPU else 300, 32
    q, k, v, dout = (device(rng.standard_normal((B, H, T, D))) for _ in range(4))

    def run(heads):
        out, lse = poisoned((B, H, T, D)), poisoned((B, H, T))
        attention.attention_forward_bf16(out, lse, *heads)
        grads = [poisoned((B, H, T, D)) for _ in range(3)]
        attention.attention_backward_bf16(*grads, poisoned((B, H, T)), dout, *heads, out, lse)
        return [x.copy_to_host() for x in (out, lse, *grads)]

    want = run((q, k, v))
    rounded = [attention.heads_operand(x) for x in (q, k, v)]
    assert all(isinstance(x, Bf16Heads) for x in rounded)
    launched = recording_launches(monkeypatch, operands, mma_sync)
    got = run(rounded)
    assert launched.count(operands.heads_bf16_kernel) == 0
    # dout's copy: with delta in a pass of its own, or on Hopper by the dq kernel as it stages
    wgmma = runtime_device.runs_wgmma()
    assert launched.count(mma_sync.delta_and_dout_kernel(D)) == (0 if wgmma else 1)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    wide = device(rng.standard_normal((B, H, 4, 72)))
    assert attention.heads_operand(wide) is wide


def test_bf16_attention_reads_the_heads_from_the_fused_tensors(rng, monkeypatch):
    """ops.attention in bf16: q, k, v split from [B,T,C] tensors (split_heads) are rounded
    straight from those (a heads_view), so no float32 copy of the heads is made; the output and
    the gradients of the fused tensors are the same to the bit as with the copies made. A
    reader of the float32 heads (the sampling's cache) still gets the split."""
    from nanoandrea import ops
    from nanoandrea.autograd import Tensor
    from nanoandrea.backend import get_backend
    from nanoandrea.kernels import heads
    backend = get_backend("cuda", precision="bf16")
    B, T, H, D = 1, 20 if not GPU else 300, 2, 32
    fused = [rng.standard_normal((B, T, H * D)).astype(np.float32) for _ in range(3)]
    dy = device(rng.standard_normal((B, T, H * D)))

    def run(split_first):
        leaves = [Tensor(device(x), backend, requires_grad=True) for x in fused]
        q, k, v = (ops.split_heads(x, H) for x in leaves)
        if split_first:
            for t in (q, k, v):
                t.split()
        y = ops.merge_heads(ops.attention(q, k, v))
        y.backward(dy)
        return [x.copy_to_host() for x in (y.data, *(t.grad for t in leaves))], q

    want, _ = run(True)
    launched = recording_launches(monkeypatch, heads)
    got, q = run(False)
    assert heads.split_heads4_kernel not in launched
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(q.data.copy_to_host(),
                                  fused[0].reshape(B, T, H, D).transpose(0, 2, 1, 3))
    assert heads.split_heads4_kernel in launched


@pytest.mark.parametrize("card", ["A100"] if not GPU else ["this GPU", "A100"])
def test_bf16_attention_writes_the_products_gradients_in_bf16(rng, monkeypatch, card):
    """ops.attention in bf16, its q, k, v split from tensors nothing else reads (products'
    outputs: linears' heads, sole_reader): their gradients are written by the attention's
    backward in bf16 (Bf16Matrix's, through bf16_heads_view), the very bits that round_bf16
    makes of the float32 gradients, which the products' backward would read (so the gradients
    after them are unchanged to the bit: the model's tests). In the simulator on a pretended
    A100 (the mma.sync kernels; wgmma's simulator twins take minutes), on the GPU on its own
    kernels and on the A100's."""
    from nanoandrea import ops
    from nanoandrea.autograd import Tensor
    from nanoandrea.backend import get_backend
    if card == "A100":
        on_device(monkeypatch, A100)
    backend = get_backend("cuda", precision="bf16")
    B, T, H, D = (1, 20, 1, 32) if not GPU else (2, 300, 3, 64)
    fused = [rng.standard_normal((B, T, H * D)) for _ in range(3)]
    dy = device(rng.standard_normal((B, T, H * D)))

    def run(sole_reader):
        leaves = [Tensor(device(x), backend, requires_grad=True) for x in fused]
        q, k, v = (ops.split_heads(x, H, sole_reader) for x in leaves)
        y = ops.merge_heads(ops.attention(q, k, v))
        y.backward(dy)
        return [x.grad for x in leaves]

    for got, want in zip(run(True), run(False)):
        assert isinstance(got, operands.Bf16Matrix) and got.shape == (B * T, H * D)
        np.testing.assert_array_equal(got.bf16_pairs.copy_to_host(),
                                      pack_bf16(want.copy_to_host().reshape(B * T, H * D)))
