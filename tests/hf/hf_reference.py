"""Independent numpy forward passes of HF ``GPT2LMHeadModel`` and ``LlamaForCausalLM``, the
latter with what its relatives add when their tensors are there: projection biases (Qwen 2,
Llama ``attention_bias``/``mlp_bias``), QK-norm per head (Qwen 3) or over the whole
projection (OLMo 2, told apart by the norm's size), and norms after the attention and MLP
instead of before (OLMo 2: no ``input_layernorm``), fused q/k/v and gate/up tensors (Phi 3);
and sliding-window attention (config.json ``sliding_window``, per layer by ``layer_types``);
and Gemma 2 (``model_type`` gemma2): ``1 + w`` norms, four per layer, embeddings times
sqrt(hidden), scores times ``query_pre_attn_scalar ** -0.5``, soft-capped scores and logits,
a GELU-tanh gate; and Gemma 3 (``model_type`` gemma3_text): Gemma 2's with ``1 + w`` QK-norms
and the local layers' rotary base ``rope_local_base_freq``; and Granite's multipliers
(``embedding_multiplier``, ``residual_multiplier``, ``attention_multiplier``,
``logits_scaling``; transformers' defaults of 1 where absent); and gpt-oss (``model_type``
gpt_oss): attention sinks, YaRN, a router with a bias and experts with biases, their gate
and up projections interleaved in one tensor, and the clamped SwiGLU.

They read only what transformers reads (config.json fields and safetensors tensor names),
in float64, following the transformers modelling code's math. `test_transformers` checks
the export against transformers itself; this reference is kept because it adds what that
check cannot: a float64 oracle written out line by line (no torch kernels in between), that
names the exact tensor layout it expects (e.g. GPT-2's Conv1D transposes) and runs in
`test_convert` in a fraction of the time, without importing torch.
"""

from __future__ import annotations

import math

import numpy as np


def _layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def _rms_norm(x, w, eps):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * w


def _gelu_new(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def _causal_softmax_attention(q, k, v, window=None, scale=None, softcap=None, sinks=None):
    """q: [heads, T, d], k/v: [heads, T, d] -> [T, heads * d]; ``window``: each query sees
    the keys less than that many positions back (itself included); ``sinks [heads]``: a
    column of each head's sink beside the scores, dropped after the softmax."""
    T = q.shape[1]
    scores = q @ k.transpose(0, 2, 1) * (scale or 1 / math.sqrt(q.shape[-1]))
    if softcap:
        scores = softcap * np.tanh(scores / softcap)
    visible = np.tril(np.ones((T, T), bool))
    if window is not None:
        visible &= np.triu(np.ones((T, T), bool), -(window - 1))
    scores = np.where(visible, scores, -np.inf)
    if sinks is not None:
        column = np.broadcast_to(sinks[:, None, None], (*scores.shape[:-1], 1))
        scores = np.concatenate([scores, column], -1)
    w = np.exp(scores - scores.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    w = w if sinks is None else w[..., :-1]
    return (w @ v).transpose(1, 0, 2).reshape(T, -1)


def gpt2_logits(config: dict, t: dict, ids: np.ndarray) -> np.ndarray:
    t = {k: v.astype(np.float64) for k, v in t.items()}
    H, D = config["n_head"], config["n_embd"]
    eps = config["layer_norm_epsilon"]
    x = t["transformer.wte.weight"][ids] + t["transformer.wpe.weight"][: len(ids)]
    for i in range(config["n_layer"]):
        p = f"transformer.h.{i}."
        h = _layer_norm(x, t[p + "ln_1.weight"], t[p + "ln_1.bias"], eps)
        qkv = h @ t[p + "attn.c_attn.weight"] + t[p + "attn.c_attn.bias"]  # Conv1D: x @ W
        q, k, v = (a.reshape(len(ids), H, D // H).transpose(1, 0, 2) for a in np.split(qkv, 3, -1))
        x = (
            x
            + _causal_softmax_attention(q, k, v) @ t[p + "attn.c_proj.weight"]
            + t[p + "attn.c_proj.bias"]
        )
        h = _layer_norm(x, t[p + "ln_2.weight"], t[p + "ln_2.bias"], eps)
        h = _gelu_new(h @ t[p + "mlp.c_fc.weight"] + t[p + "mlp.c_fc.bias"])
        x = x + h @ t[p + "mlp.c_proj.weight"] + t[p + "mlp.c_proj.bias"]
    x = _layer_norm(x, t["transformer.ln_f.weight"], t["transformer.ln_f.bias"], eps)
    head = (
        t["transformer.wte.weight"]
        if config.get("tie_word_embeddings", True)
        else t["lm_head.weight"]
    )
    return x @ head.T


def _rope_scaling(config: dict) -> dict | None:
    """``rope_scaling``, or transformers 5's ``rope_parameters`` (None: plain RoPE)."""
    scaling = config.get("rope_scaling") or config.get("rope_parameters")
    return None if not scaling or scaling.get("rope_type", "default") == "default" else scaling


def _rope_factor(config: dict) -> float:
    """What YaRN multiplies cos and sin by (1 for the others)."""
    scaling = _rope_scaling(config)
    if not scaling or scaling["rope_type"] != "yarn" or scaling["factor"] <= 1:
        return 1.0
    return 0.1 * math.log(scaling["factor"]) + 1.0


def _yarn(inv: np.ndarray, scaling: dict, base: float, dim: int) -> np.ndarray:
    def corr(rotations):
        old = scaling["original_max_position_embeddings"]
        return dim * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = corr(scaling.get("beta_fast", 32)), corr(scaling.get("beta_slow", 1))
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    extrapolated = 1 - np.clip((np.arange(dim // 2) - low) / (high - low), 0, 1)
    return inv / scaling["factor"] * (1 - extrapolated) + inv * extrapolated


def _llama_inv_freq(config: dict, dim: int) -> np.ndarray:
    params = config.get("rope_parameters") or {}
    base = params.get("rope_theta", config.get("rope_theta", 10000.0))
    inv = 1.0 / base ** (np.arange(0, dim, 2) / dim)
    scaling = _rope_scaling(config)
    if not scaling:
        return inv
    kind = scaling["rope_type"]
    if kind == "yarn":
        return _yarn(inv, scaling, base, dim)
    if kind == "linear":
        return inv / scaling["factor"]
    if kind == "llama3":
        factor, lo, hi = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        out = np.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        smoothed = (1 - smooth) * out / factor + smooth * out
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        return np.where(medium, smoothed, out)
    raise NotImplementedError(kind)


def _rotate(x, positions, inv_freq):
    """HF ``apply_rotary_pos_emb``: x * cos + rotate_half(x) * sin; x is [heads, T, d]."""
    freqs = positions[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], -1)
    half = x.shape[-1] // 2
    rotated = np.concatenate([-x[..., half:], x[..., :half]], -1)
    return x * np.cos(emb) + rotated * np.sin(emb)


def _linear(t: dict, name: str, x):
    """``x @ W.T`` (+ the bias where the checkpoint has one)."""
    out = x @ t[name + ".weight"].T
    return out + t[name + ".bias"] if name + ".bias" in t else out


def _qk_norm(t: dict, name: str, x, T: int, heads: int, d: int, eps: float, rms=_rms_norm):
    """Reshape a projection to [heads, T, d], RMS-normed first when the checkpoint has the norm:
    over each head (a norm of size d) or over the whole projection (size heads * d)."""
    w = t.get(name + ".weight")
    if w is not None and w.size == heads * d:  # the whole projection, before the head split
        x = rms(x, w, eps)
    x = x.reshape(T, heads, d)
    if w is not None and w.size == d:
        x = rms(x, w, eps)
    return x.transpose(1, 0, 2)


def _unfused(t: dict, H: int, K: int, d: int) -> dict:
    """Phi 3's fused ``qkv_proj`` and ``gate_up_proj`` split into Llama's tensors."""
    out = dict(t)
    for name, array in t.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            q, k, v = np.split(array, [H * d, (H + K) * d])
            for part, w in zip(("q_proj", "k_proj", "v_proj"), (q, k, v), strict=True):
                out[name.replace("qkv_proj", part)] = w
        elif name.endswith("mlp.gate_up_proj.weight"):
            gate, up = np.split(array, 2)
            out[name.replace("gate_up_proj", "gate_proj")] = gate
            out[name.replace("gate_up_proj", "up_proj")] = up
    return out


def llama_logits(config: dict, t: dict, ids: np.ndarray) -> np.ndarray:
    H, K = config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or config["hidden_size"] // H
    t = {k: v.astype(np.float64) for k, v in _unfused(t, H, K, d).items()}
    eps = config["rms_norm_eps"]
    gemma = config["model_type"] in ("gemma2", "gemma3_text")
    rms = (lambda x, w, eps: _rms_norm(x, 1 + w, eps)) if gemma else _rms_norm
    scale = config["query_pre_attn_scalar"] ** -0.5 if gemma else config.get("attention_multiplier")
    res = config.get("residual_multiplier", 1.0)
    softcap = config.get("attn_logit_softcapping")
    T = len(ids)
    inv = _llama_inv_freq(config, d)
    pos = np.arange(T, dtype=np.float64)
    x = t["model.embed_tokens.weight"][ids] * (math.sqrt(config["hidden_size"]) if gemma else 1)
    x = x * config.get("embedding_multiplier", 1.0)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        kinds = config.get("layer_types")
        window = config.get("sliding_window")
        window = window if kinds is None or kinds[i] == "sliding_attention" else None
        pre = p + "input_layernorm.weight" in t  # OLMo 2: norms after, not before
        h = rms(x, t[p + "input_layernorm.weight"], eps) if pre else x
        q = _qk_norm(
            t, p + "self_attn.q_norm", _linear(t, p + "self_attn.q_proj", h), T, H, d, eps, rms
        )
        k = _qk_norm(
            t, p + "self_attn.k_norm", _linear(t, p + "self_attn.k_proj", h), T, K, d, eps, rms
        )
        v = _linear(t, p + "self_attn.v_proj", h).reshape(T, K, d).transpose(1, 0, 2)
        local = config.get("rope_local_base_freq")  # Gemma 3's local layers: their own base
        layer_inv = 1.0 / local ** (np.arange(0, d, 2) / d) if local and window else inv
        q, k = (_rotate(a, pos, layer_inv) * _rope_factor(config) for a in (q, k))
        k, v = np.repeat(k, H // K, axis=0), np.repeat(v, H // K, axis=0)  # repeat_kv
        sinks = t.get(p + "self_attn.sinks")  # gpt-oss
        out = _causal_softmax_attention(q, k, v, window, scale, softcap, sinks)
        attn = _linear(t, p + "self_attn.o_proj", out)
        if gemma:  # four norms: before and after the attention and the MLP
            x = x + rms(attn, t[p + "post_attention_layernorm.weight"], eps)
            h = rms(x, t[p + "pre_feedforward_layernorm.weight"], eps)
            mlp = _swiglu(t, p + "mlp.", h, act=_gelu_new)
            x = x + rms(mlp, t[p + "post_feedforward_layernorm.weight"], eps)
            continue
        if pre:
            x = x + attn * res
            h = _rms_norm(x, t[p + "post_attention_layernorm.weight"], eps)
        else:
            x = x + _rms_norm(attn, t[p + "post_attention_layernorm.weight"], eps)
            h = x
        if p + "mlp.experts.gate_up_proj" in t:
            mlp = _gpt_oss_moe(config, t, p + "mlp.", h)
        else:
            mlp = _moe(config, t, p, h) if _moe_prefix(t, p) else _swiglu(t, p + "mlp.", h)
        if not pre:
            mlp = _rms_norm(mlp, t[p + "post_feedforward_layernorm.weight"], eps)
        x = x + mlp * res
    x = rms(x, t["model.norm.weight"], eps)
    head = (
        t["model.embed_tokens.weight"] if config.get("tie_word_embeddings") else t["lm_head.weight"]
    )
    cap = config.get("final_logit_softcapping")
    logits = x @ head.T / config.get("logits_scaling", 1.0)  # Granite
    return cap * np.tanh(logits / cap) if cap else logits


def _swiglu(t: dict, p: str, h, names=("gate_proj", "up_proj", "down_proj"), act=None):
    gate, up = _linear(t, p + names[0], h), _linear(t, p + names[1], h)
    gate = act(gate) if act else gate / (1 + np.exp(-gate))
    return _linear(t, p + names[2], gate * up)


def _moe_prefix(t: dict, p: str) -> str | None:
    """The layer's mixture-of-experts module (Mixtral's or Qwen/OLMoE's names), if any."""
    for moe in ("block_sparse_moe.", "mlp."):
        if p + moe + "experts.0." + ("w1" if moe[0] == "b" else "gate_proj") + ".weight" in t:
            return p + moe
    return None


def _moe(config: dict, t: dict, p: str, h):
    """HF's sparse MoE block: softmax router over all experts, the top k (renormalised when
    ``norm_topk_prob``, Mixtral always), each token through its experts' SwiGLU, weighted."""
    moe = _moe_prefix(t, p)
    names = ("w1", "w3", "w2") if moe.endswith("block_sparse_moe.") else None
    k = config["num_experts_per_tok"]
    logits = h @ t[moe + "gate.weight"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(probs, top, -1)
    if config.get("norm_topk_prob", config["model_type"] == "mixtral"):
        weights /= weights.sum(-1, keepdims=True)
    out = np.zeros_like(h)
    for e in range(t[moe + "gate.weight"].shape[0]):
        expert = f"{moe}experts.{e}."
        y = _swiglu(t, expert, h, names) if names else _swiglu(t, expert, h)
        out += (weights * (top == e)).sum(-1, keepdims=True) * y
    return out


def _gpt_oss_moe(config: dict, t: dict, p: str, h):
    """gpt-oss's experts: the softmax of the top k of the router's (biased) logits, each token
    through its experts' biased projections, gate and up interleaved (even, odd) in one
    tensor, the clamped SwiGLU ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    k, alpha, limit = config["num_experts_per_tok"], config["swiglu_alpha"], config["swiglu_limit"]
    logits = _linear(t, p + "router", h)
    top = np.argsort(-logits, axis=-1, kind="stable")[:, :k]
    chosen = np.take_along_axis(logits, top, -1)
    weights = np.exp(chosen - chosen.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    out = np.zeros_like(h)
    for e in range(logits.shape[-1]):
        gate_up = h @ t[p + "experts.gate_up_proj"][e] + t[p + "experts.gate_up_proj_bias"][e]
        gate, up = np.minimum(gate_up[:, ::2], limit), np.clip(gate_up[:, 1::2], -limit, limit)
        glu = (up + 1) * gate / (1 + np.exp(-alpha * gate))
        y = glu @ t[p + "experts.down_proj"][e] + t[p + "experts.down_proj_bias"][e]
        out += (weights * (top == e)).sum(-1, keepdims=True) * y
    return out
