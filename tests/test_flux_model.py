"""FLUX.1 (workloads.flux): the blocks and the whole forward against a reference written here from the equations
(BFL src/flux/modules/layers.py, math.py), in float64; the exact parameter count; BFL's parameter names; the
latent packing and positions; and activation checkpointing."""

import dataclasses
import math

import torch

from workloads.flux.config import FLUX_SCHNELL, FLUX_TINY
from workloads.flux.latents import image_position_ids, pack_latents, text_position_ids, unpack_latents
from workloads.flux.model import DoubleStreamBlock, EmbedND, Flux, SingleStreamBlock

# Blocks: 2 heads of 16 (RoPE 4 + 6 + 6), and an MLP ratio that is not 4 so a hard-coded width would show.
HIDDEN, HEADS, AXES, MLP_RATIO = 32, 2, (4, 6, 6), 3.0


# ---- the reference, from the equations ----

def linear(x, sd, name):
    return x @ sd[f"{name}.weight"].T + sd[f"{name}.bias"]


def silu(x):
    return x * torch.sigmoid(x)


def gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def layernorm(x):  # no affine, eps 1e-6
    mean = x.mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(((x - mean) ** 2).mean(-1, keepdim=True) + 1e-6)


def rmsnorm(x, scale):
    return x / torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-6) * scale


def rope_angles(ids, axes_dim, theta=10_000):
    """(B, L, 3) -> (B, L, head_dim / 2): axis i's slice turns by position_i * theta^(-2j / dim_i)."""
    return torch.cat([ids[..., i, None] * theta ** (-torch.arange(0, d, 2, dtype=ids.dtype) / d)
                      for i, d in enumerate(axes_dim)], dim=-1)


def rotate(x, angles):
    """Each adjacent pair (x[2j], x[2j+1]) of (B, H, L, D) as a complex number times e^(i angle)."""
    z = torch.complex(x[..., 0::2], x[..., 1::2]) * torch.polar(torch.ones_like(angles), angles)[:, None]
    return torch.stack((z.real, z.imag), dim=-1).flatten(-2)


def modulation(vec, sd, name, n):
    return linear(silu(vec), sd, name)[:, None, :].chunk(n, dim=-1)


def stream_qkv(x, sd, prefix, heads):
    """One double-block stream's qkv: normalised q and k, and v, each (B, H, L, D)."""
    b, n, _ = x.shape
    q, k, v = linear(x, sd, f"{prefix}.qkv").view(b, n, 3, heads, -1).permute(2, 0, 3, 1, 4)
    return rmsnorm(q, sd[f"{prefix}.norm.query_norm.scale"]), rmsnorm(k, sd[f"{prefix}.norm.key_norm.scale"]), v


def joint_attention(q, k, v, angles):
    q, k = rotate(q, angles), rotate(k, angles)
    weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    return (weights @ v).transpose(1, 2).flatten(2)


def ref_double(sd, p, img, txt, vec, angles, heads):
    mods = {s: modulation(vec, sd, f"{p}{s}_mod.lin", 6) for s in ("img", "txt")}
    streams = {"img": img, "txt": txt}
    qkv = {s: stream_qkv((1 + mods[s][1]) * layernorm(x) + mods[s][0], sd, f"{p}{s}_attn", heads)
           for s, x in streams.items()}
    attn = joint_attention(*(torch.cat((qkv["txt"][i], qkv["img"][i]), dim=2) for i in range(3)), angles)
    outs = {"txt": attn[:, :txt.shape[1]], "img": attn[:, txt.shape[1]:]}
    for s, x in streams.items():
        shift1, scale1, gate1, shift2, scale2, gate2 = mods[s]
        x = x + gate1 * linear(outs[s], sd, f"{p}{s}_attn.proj")
        mlp_in = (1 + scale2) * layernorm(x) + shift2
        streams[s] = x + gate2 * linear(gelu_tanh(linear(mlp_in, sd, f"{p}{s}_mlp.0")), sd, f"{p}{s}_mlp.2")
    return streams["img"], streams["txt"]


def ref_single(sd, p, x, vec, angles, heads):
    shift, scale, gate = modulation(vec, sd, f"{p}modulation.lin", 3)
    h = x.shape[-1]
    both = linear((1 + scale) * layernorm(x) + shift, sd, f"{p}linear1")
    b, n, _ = x.shape
    q, k, v = both[..., :3 * h].reshape(b, n, 3, heads, -1).permute(2, 0, 3, 1, 4)
    q, k = rmsnorm(q, sd[f"{p}norm.query_norm.scale"]), rmsnorm(k, sd[f"{p}norm.key_norm.scale"])
    attn = joint_attention(q, k, v, angles)
    return x + gate * linear(torch.cat((attn, gelu_tanh(both[..., 3 * h:])), dim=-1), sd, f"{p}linear2")


def ref_flux(sd, cfg, img, img_ids, txt, txt_ids, t, y):
    half = 128  # the timestep embedding is 256 wide: cos then sin of 1000 t at 10000^(-i/128)
    args = 1000 * t[:, None] * torch.exp(-math.log(10_000) * torch.arange(half, dtype=t.dtype) / half)
    temb = torch.cat((torch.cos(args), torch.sin(args)), dim=-1)
    vec = linear(silu(linear(temb, sd, "time_in.in_layer")), sd, "time_in.out_layer") \
        + linear(silu(linear(y, sd, "vector_in.in_layer")), sd, "vector_in.out_layer")
    img, txt = linear(img, sd, "img_in"), linear(txt, sd, "txt_in")
    angles = rope_angles(torch.cat((txt_ids, img_ids), dim=1), cfg.axes_dim)
    for i in range(cfg.depth):
        img, txt = ref_double(sd, f"double_blocks.{i}.", img, txt, vec, angles, cfg.num_heads)
    x = torch.cat((txt, img), dim=1)
    for i in range(cfg.depth_single_blocks):
        x = ref_single(sd, f"single_blocks.{i}.", x, vec, angles, cfg.num_heads)
    shift, scale = linear(silu(vec), sd, "final_layer.adaLN_modulation.1").chunk(2, dim=-1)
    x = (1 + scale[:, None]) * layernorm(x[:, txt.shape[1]:]) + shift[:, None]
    return linear(x, sd, "final_layer.linear")


# ---- helpers ----

def randomize(module):
    """Random float64 weights: the real init zeroes the modulations and the last layer, which would make every
    block the identity and the output 0, and hide any mistake."""
    module.double()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.2 + (1.0 if name.endswith("scale") else 0))
    return module


def random_ids(batch, length, gen):
    return torch.randint(0, 12, (batch, length, 3), generator=gen).double()


def flux_inputs(cfg, batch=2, latent=8, seq=5, dtype=torch.float64):
    gen = torch.Generator().manual_seed(1)
    return dict(img=pack_latents(torch.randn(batch, 16, latent, latent, generator=gen, dtype=dtype)),
                img_ids=image_position_ids(batch, latent, latent).to(dtype),
                txt=torch.randn(batch, seq, cfg.context_in_dim, generator=gen, dtype=dtype),
                txt_ids=text_position_ids(batch, seq).to(dtype),
                timesteps=torch.rand(batch, generator=gen, dtype=dtype),
                y=torch.randn(batch, cfg.vec_in_dim, generator=gen, dtype=dtype))


# ---- tests ----

def test_double_stream_block_matches_the_equations():
    block = randomize(DoubleStreamBlock(HIDDEN, HEADS, MLP_RATIO, qkv_bias=True))
    gen = torch.Generator().manual_seed(2)
    img, txt = torch.randn(2, 6, HIDDEN, generator=gen).double(), torch.randn(2, 3, HIDDEN, generator=gen).double()
    vec, ids = torch.randn(2, HIDDEN, generator=gen).double(), random_ids(2, 9, gen)
    img_out, txt_out = block(img, txt, vec, EmbedND(10_000, AXES)(ids))
    img_ref, txt_ref = ref_double(block.state_dict(), "", img, txt, vec, rope_angles(ids, AXES), HEADS)
    torch.testing.assert_close(img_out, img_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(txt_out, txt_ref, rtol=1e-10, atol=1e-10)


def test_single_stream_block_matches_the_equations():
    block = randomize(SingleStreamBlock(HIDDEN, HEADS, MLP_RATIO))
    gen = torch.Generator().manual_seed(3)
    x, vec, ids = torch.randn(2, 9, HIDDEN, generator=gen).double(), torch.randn(2, HIDDEN, generator=gen).double(), \
        random_ids(2, 9, gen)
    out = block(x, vec, EmbedND(10_000, AXES)(ids))
    torch.testing.assert_close(out, ref_single(block.state_dict(), "", x, vec, rope_angles(ids, AXES), HEADS),
                               rtol=1e-10, atol=1e-10)


def test_flux_forward_matches_the_equations():
    model = randomize(Flux(FLUX_TINY))
    inputs = flux_inputs(FLUX_TINY)
    out = model(**inputs)
    assert out.shape == (2, 16, FLUX_TINY.out_channels)
    torch.testing.assert_close(out, ref_flux(model.state_dict(), FLUX_TINY, *inputs.values()), rtol=1e-9, atol=1e-9)


def test_parameter_count_is_exact():
    for cfg in (FLUX_SCHNELL, FLUX_TINY, dataclasses.replace(FLUX_SCHNELL, guidance_embed=True)):
        with torch.device("meta"):
            model = Flux(cfg)
        assert cfg.params == sum(p.numel() for p in model.parameters())
    assert FLUX_SCHNELL.params == 11_891_178_560  # FLUX.1-schnell
    assert dataclasses.replace(FLUX_SCHNELL, guidance_embed=True).params == 11_901_408_320  # FLUX.1-dev's guidance_in


def test_state_dict_has_bfl_names_and_shapes():
    with torch.device("meta"):
        sd = Flux(FLUX_SCHNELL).state_dict()
    expected = {
        "img_in.weight": (3072, 64),
        "time_in.in_layer.weight": (3072, 256),
        "time_in.out_layer.bias": (3072,),
        "vector_in.in_layer.weight": (3072, 768),
        "txt_in.weight": (3072, 4096),
        "double_blocks.18.img_mod.lin.weight": (6 * 3072, 3072),
        "double_blocks.0.img_attn.qkv.bias": (3 * 3072,),
        "double_blocks.0.img_attn.norm.query_norm.scale": (128,),
        "double_blocks.0.txt_attn.norm.key_norm.scale": (128,),
        "double_blocks.0.img_attn.proj.weight": (3072, 3072),
        "double_blocks.0.img_mlp.0.weight": (12288, 3072),
        "double_blocks.0.txt_mlp.2.weight": (3072, 12288),
        "single_blocks.37.linear1.weight": (3 * 3072 + 12288, 3072),
        "single_blocks.0.linear2.weight": (3072, 3072 + 12288),
        "single_blocks.0.norm.query_norm.scale": (128,),
        "single_blocks.0.modulation.lin.weight": (3 * 3072, 3072),
        "final_layer.adaLN_modulation.1.weight": (2 * 3072, 3072),
        "final_layer.linear.weight": (64, 3072),
    }
    assert {name: tuple(sd[name].shape) for name in expected} == expected
    assert len(sd) == 19 * 24 + 38 * 8 + 16  # 776: no buffers, no guidance_in
    assert not any(name.startswith("guidance_in") for name in sd)


def test_pack_unpack_and_position_ids():
    x = torch.arange(2 * 16 * 4 * 4, dtype=torch.float32).view(2, 16, 4, 4)
    packed = pack_latents(x)
    assert packed.shape == (2, 4, 64)
    # patch (row, col) is token 2 row + col; its feature 4 c + 2 ph + pw is latent pixel (c, 2 row + ph, 2 col + pw)
    assert packed[1, 2, 4 * 5 + 2 * 1 + 0] == x[1, 5, 2 * 1 + 1, 2 * 0 + 0]
    assert packed[0, 3, 4 * 15 + 2 * 0 + 1] == x[0, 15, 2, 3]
    assert torch.equal(unpack_latents(packed, 4, 4), x)
    ids = image_position_ids(2, 4, 4)
    assert torch.equal(ids, torch.tensor([[0, 0, 0], [0, 0, 1], [0, 1, 0], [0, 1, 1]]).float().expand(2, 4, 3))
    assert torch.equal(text_position_ids(2, 7), torch.zeros(2, 7, 3))


def test_init_follows_torchtitan():
    torch.manual_seed(0)
    model = Flux(FLUX_TINY)
    zero = ["final_layer.linear", "final_layer.adaLN_modulation.1", "double_blocks.1.txt_mod.lin",
            "single_blocks.0.modulation.lin"]
    sd = model.state_dict()
    assert all(not sd[f"{name}.{p}"].any() for name in zero for p in ("weight", "bias"))
    assert torch.equal(sd["double_blocks.0.img_attn.norm.query_norm.scale"], torch.ones(FLUX_TINY.head_dim))
    assert abs(sd["time_in.in_layer.weight"].std().item() - 0.02) < 0.002  # normal(0, 0.02)
    bound = math.sqrt(6 / (64 + 3 * 64))  # xavier-uniform of qkv (64 -> 192)
    qkv = sd["double_blocks.0.img_attn.qkv.weight"]
    assert qkv.abs().max() <= bound and qkv.abs().max() > 0.9 * bound and not sd["txt_in.bias"].any()
    assert not model(**flux_inputs(FLUX_TINY, dtype=torch.float32)).any()  # adaLN-Zero: predicts 0 at first


def test_checkpoint_blocks_changes_memory_not_results():
    def loss_and_grads(checkpoint_blocks):
        model = randomize(Flux(FLUX_TINY, checkpoint_blocks=checkpoint_blocks)).train()
        inputs = flux_inputs(FLUX_TINY)
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            loss = (model(**inputs) - inputs["img"]).pow(2).mean()
        loss.backward()
        return loss, {name: p.grad for name, p in model.named_parameters()}, len(saved)

    loss, grads, saved = loss_and_grads(False)
    loss_ckpt, grads_ckpt, saved_ckpt = loss_and_grads(True)
    assert torch.equal(loss, loss_ckpt)
    assert grads.keys() == grads_ckpt.keys()
    assert all(torch.equal(grads[name], grads_ckpt[name]) for name in grads)
    assert saved_ckpt < saved / 2  # the blocks' activations were not kept
