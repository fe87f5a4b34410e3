"""The ``model`` section and what every model provides.

``LmConfig`` is the choice registry of language-model configs (``model.type``: each model
module registers its own subclass), ``LmModel`` the interface the loss, the trainer and
generation use, ``SavedModel`` what ``model.save`` writes to ``model.yaml``. This module
imports no model, no saving code above it: ``loomax.models.io.saving`` loads what it saves.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any, ClassVar

import draccus
import equinox as eqx
import haliax as hax
import jax
from jaxtyping import PRNGKeyArray

from loomax.config import ConfigError
from loomax.models.attention.attention import BACKENDS, FLASH_BLOCK, SPLASH_BLOCKS
from loomax.models.attention.ring_attention import VARIANTS
from loomax.models.attention.sequence_layout import from_layout, to_layout
from loomax.models.attention.splash import LANES, splash_unsupported_reason
from loomax.models.blocks.dropout import check_rates
from loomax.models.blocks.fp8 import MODES as FP8_MODES
from loomax.models.blocks.fp8 import to_fp8
from loomax.models.blocks.remat import check_remat, scan_policy
from loomax.models.io.files import write_files
from loomax.models.lora.config import LoraConfig
from loomax.models.lora.linear import apply_lora


@dataclass(frozen=True)
class LmConfig(draccus.ChoiceRegistry, abc.ABC):
    """Base of every language-model config; ``type`` picks the implementation."""

    seq_len: int = 1024
    """Tokens per training sequence (the `position` axis)."""
    vocab_size: int | None = None
    """Vocabulary size; null = take it from the tokenizer."""
    gradient_checkpointing: bool | str = True
    """Layer remat: true (recompute block internals), false, offload, nested, recompute, save_all."""
    remat_save: tuple[str, ...] = ()
    """Activations a remat'd layer keeps instead of recomputing: qkv, attn_out, splash_residuals, ring_residuals, mlp_in, mlp_up, moe_up, moe_out."""
    remat_offload: tuple[str, ...] = ()
    """Activations a remat'd layer keeps in pinned host memory instead of recomputing (same names)."""
    cross_entropy_block_size: int | None = 4096
    """Tokens per block of the fused LM head + softmax (bounds logits memory); null = plain full logits."""
    cross_entropy_vocab_block_size: int | None = None
    """Also split the vocabulary into blocks of this many entries (logits at most [tokens block, vocab block]); null = whole."""
    cross_entropy_vocab_multiple: int = 128
    """Pad the fused LM head to a multiple of this many vocabulary rows (masked; aligned matmul shapes); 1 = none."""
    z_loss_weight: float = 0.0
    """Weight of the z-loss, the mean squared log-partition of the logits; 0 = off."""
    attn_backend: str = "auto"
    """Attention: auto, vanilla, blockwise (flash-style, O(seq) memory), splash (TPU kernel; with context parallelism, per chunk pair of the ring), xla or cudnn (jax.nn)."""
    splash_block_q: int = SPLASH_BLOCKS[0]
    """Query block of the splash kernel (a multiple of 128; seq_len must be a multiple of it)."""
    splash_block_kv: int = SPLASH_BLOCKS[1]
    """Key/value block of the splash kernel (a multiple of 128; seq_len must be a multiple of it)."""
    document_mask: bool = False
    """Attention stays within each packed document (documents end at the tokenizer's EOS)."""
    document_positions: bool | None = None
    """Positions (rotary angles; GPT-2's position table) restart at 0 at each packed document, as if it were alone; null = on for chat SFT (data.format chat), off otherwise."""
    cudnn_packed_documents: int = 0
    """On cuDNN, document masks via its packed-sequence kernel for rows of at most this many documents (more: dense mask); 0 = dense mask."""
    scan_unroll: int | bool = 1
    """Layers per iteration of the layer loop; true = all (no loop). Parameters stay stacked either way."""
    scan_layers: bool = True
    """Run the layers by a scan; false = unrolled, one block after another (same stacked parameters and checkpoints)."""
    flash_attention_block_size: int | None = None
    """Query and key block of the blockwise attention backend; null = 256 (the blockwise ring's at most 128)."""
    embed_pdrop: float = 0.0
    """Dropout rate on the embeddings, in training only (the step's key); 0 = off."""
    resid_pdrop: float = 0.0
    """Dropout rate on each attention and MLP output before it joins the residual stream, in training only; 0 = off."""
    attn_pdrop: float = 0.0
    """Dropout rate on attention probabilities, in training only (needs attn_backend auto or vanilla); 0 = off."""
    context_parallel: str = "ring"
    """Attention across a sequence split over trainer.mesh.context > 1: ring (K/V blocks passed around, O(seq/n) memory) or all_gather (K/V gathered whole)."""
    fp8: str = "off"
    """FP8 matmuls in the blocks' linear layers (e4m3 forward, e5m2 gradients, current scaling): off (false), on (true; needs NVIDIA compute capability 8.9+), or emulate (same arithmetic on any device)."""
    lora: LoraConfig | None = None
    """Low-rank adapters on chosen linear layers, the rest frozen (`model.lora`, docs/post_training.md); null = none."""
    hf_config_json: dict[str, Any] | None = field(default=None, compare=False)
    """Set on import: the Hugging Face checkpoint's config.json, whose fields export writes back (changed only where training changed them); null = none."""

    hf_model_type: ClassVar[str | None] = None
    """The transformers ``model_type`` this family reads and writes (``loomax.hf.family.HfFamily``
    says the rest it then defines); None = no Hugging Face interop."""

    def __post_init__(self):
        # YAML reads on/off (and true/false) as booleans
        spelled = {"true": "on", "false": "off"}.get(str(self.fp8).lower(), self.fp8)
        object.__setattr__(self, "fp8", spelled)
        if self.fp8 not in FP8_MODES:
            raise ConfigError(f"model.fp8 must be one of {FP8_MODES}, got {self.fp8!r}")
        if self.context_parallel not in VARIANTS:
            raise ConfigError(
                f"model.context_parallel must be one of {VARIANTS}, got {self.context_parallel!r}"
            )
        if self.attn_backend not in BACKENDS:
            raise ValueError(
                f"model.attn_backend must be one of {BACKENDS}, got {self.attn_backend!r}"
            )
        for key in ("remat_save", "remat_offload"):  # a list from YAML or a plan: hashable
            object.__setattr__(self, key, tuple(getattr(self, key)))
        check_remat(self.gradient_checkpointing, self.remat_save, self.remat_offload)
        moe = getattr(self, "moe", None)  # the MoE families'
        kept = (*self.remat_save, *self.remat_offload)
        if moe is not None and moe.saved_rows is not None and "moe_up" not in kept:
            raise ConfigError(
                "model.moe.saved_rows sets how many rows `moe_up` keeps: add moe_up to "
                "model.remat_save (or model.remat_offload), or leave saved_rows null"
            )
        for key in ("splash_block_q", "splash_block_kv"):
            if getattr(self, key) <= 0 or getattr(self, key) % LANES:
                raise ConfigError(
                    f"model.{key} must be a positive multiple of {LANES}, got {getattr(self, key)}"
                )
        if self.attn_backend == "splash":
            reason = splash_unsupported_reason(self.seq_len, *self.splash_blocks)
            if reason:
                raise ConfigError(f"model.attn_backend splash: {reason}")
        vocab_block = self.cross_entropy_vocab_block_size
        if vocab_block is not None and (vocab_block <= 0 or self.cross_entropy_block_size is None):
            raise ValueError(
                "model.cross_entropy_vocab_block_size must be positive and needs model.cross_entropy_block_size, "
                f"got {vocab_block} with cross_entropy_block_size {self.cross_entropy_block_size}"
            )
        if self.cudnn_packed_documents < 0:
            raise ConfigError(
                f"model.cudnn_packed_documents must be >= 0, got {self.cudnn_packed_documents}"
            )
        if self.cross_entropy_vocab_multiple < 1:
            raise ConfigError(
                "model.cross_entropy_vocab_multiple must be >= 1, "
                f"got {self.cross_entropy_vocab_multiple}"
            )
        if not isinstance(self.scan_unroll, bool) and self.scan_unroll < 1:
            raise ValueError(
                f"model.scan_unroll must be >= 1 or true/false, got {self.scan_unroll}"
            )
        self._check_layers_and_dropout()
        if self.z_loss_weight < 0:
            raise ValueError(f"model.z_loss_weight must be >= 0, got {self.z_loss_weight}")
        if self.seq_len <= 1:
            raise ValueError(f"model.seq_len must be > 1, got {self.seq_len}")
        if self.cross_entropy_block_size is not None and self.cross_entropy_block_size <= 0:
            raise ValueError(
                f"model.cross_entropy_block_size must be positive or null, got {self.cross_entropy_block_size}"
            )
        if self.vocab_size is not None and self.vocab_size <= 0:
            raise ValueError(f"model.vocab_size must be positive, got {self.vocab_size}")

    def _check_layers_and_dropout(self) -> None:
        check_rates(self)
        if self.attn_pdrop > 0 and self.attn_backend not in ("auto", "vanilla"):
            raise ConfigError(
                "model.attn_pdrop > 0 needs model.attn_backend auto or vanilla (attention dropout "
                f"drops probabilities, which only vanilla forms), got {self.attn_backend!r}"
            )
        block = self.flash_attention_block_size
        if block is not None and block <= 0:
            raise ConfigError(
                f"model.flash_attention_block_size must be positive or null, got {block}"
            )
        if not self.scan_layers:
            if self.scan_unroll is True or self.scan_unroll not in (1, False):
                raise ConfigError(
                    "model.scan_unroll unrolls the layer scan: it needs model.scan_layers true "
                    f"(got scan_unroll {self.scan_unroll!r} with scan_layers false)"
                )
            if self.gradient_checkpointing == "nested":
                raise ConfigError(
                    "model.gradient_checkpointing nested is a two-level layer scan: it needs "
                    "model.scan_layers true"
                )

    @property
    def dropout_active(self) -> bool:
        """Whether any dropout rate is above 0 (the model then uses the step's key)."""
        lora = 0.0 if self.lora is None else self.lora.dropout
        return max(self.embed_pdrop, self.resid_pdrop, self.attn_pdrop, lora) > 0

    @property
    def flash_block(self) -> int:
        """The blockwise backend's block: ``flash_attention_block_size`` or its default."""
        return self.flash_attention_block_size or FLASH_BLOCK

    @property
    def splash_blocks(self) -> tuple[int, int]:
        """``(splash_block_q, splash_block_kv)``."""
        return self.splash_block_q, self.splash_block_kv

    @property
    def remat_policy(self) -> hax.ScanCheckpointPolicy:
        """The layer scan's checkpoint policy (``gradient_checkpointing`` and the named activations)."""
        return scan_policy(self.gradient_checkpointing, self.remat_save, self.remat_offload)

    @classmethod
    def default_choice_name(cls) -> str | None:
        return "gpt2"

    @abc.abstractmethod
    def build(self, vocab_size: int, *, key: PRNGKeyArray) -> LmModel:
        """A freshly initialised model with a vocabulary of ``vocab_size``."""

    def for_training(self, model: LmModel) -> LmModel:
        """``model`` as this config trains it: its blocks' linear layers in FP8 with
        ``fp8`` on or emulate (``models.fp8``); with adapters on the layers ``lora`` names
        (``models.lora``)."""
        model = model if self.fp8 == "off" else to_fp8(model)
        return model if self.lora is None else apply_lora(model, self.lora)

    @abc.abstractmethod
    def flops_per_token(self, vocab_size: int, *, causal: bool = True) -> float:
        """Forward-pass FLOPs per token (multiply by 3 for a training step), what MFU counts.

        Causal attention counts the attended half of the score matrix (``2 x seq x q`` a layer
        for QK^T and PV together, ``q`` the query heads times head size), as MaxText and the
        published MFU figures do; ``causal=False`` counts the full square (``4 x seq x q``).
        """

    def param_count(self, vocab_size: int) -> int:
        """Number of parameters, computed without allocating them."""
        shapes = jax.eval_shape(lambda: self.build(vocab_size, key=jax.random.PRNGKey(0)))
        return sum(x.size for x in jax.tree.leaves(shapes) if hasattr(x, "size"))


class LmModel(eqx.Module):
    """What the loss, the trainer and generation need from a language model."""

    @property
    @abc.abstractmethod
    def Vocab(self) -> hax.Axis:
        """The vocabulary axis."""

    @abc.abstractmethod
    def hidden_states(
        self,
        tokens: hax.NamedArray,
        *,
        segment_ids: hax.NamedArray | None = None,
        key: PRNGKeyArray | None = None,
    ) -> hax.NamedArray:
        """Final (normed) activations, axes ``(..., position, embed)``.

        ``segment_ids`` (axes of ``tokens``) keep attention within each packed document.
        With the sequence split over the context axis, ``tokens``, ``segment_ids`` and the
        result are in its zig-zag layout (``models/attention/sequence_layout.py`` ``to_layout``).
        """

    def hidden_states_and_aux(
        self,
        tokens: hax.NamedArray,
        *,
        segment_ids: hax.NamedArray | None = None,
        key: PRNGKeyArray | None = None,
    ) -> tuple[hax.NamedArray, AuxOutputs]:
        """``hidden_states`` and the model's extra training terms (a dense model has none)."""
        return self.hidden_states(tokens, segment_ids=segment_ids, key=key), AuxOutputs()

    @abc.abstractmethod
    def init_cache(self, batch_axes: tuple[hax.Axis, ...], max_len: int, dtype) -> KvCache:
        """An empty KV cache for decoding up to ``max_len`` positions."""

    def cache_window(self) -> int | None:
        """The attention window every layer shares, if any: decoding then needs only that
        many cached positions (``models.rolling_cache``); None = every position."""
        windows = self.layer_windows()
        return windows[0] if windows and len(set(windows)) == 1 else None

    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window (None: every position) where decoding may keep a
        cache per kind of layer (``models/decoding/kind_cache.py``); () = one cache for all."""
        return ()

    @abc.abstractmethod
    def decode(
        self, tokens: hax.NamedArray, cache: KvCache, start: jax.Array
    ) -> tuple[hax.NamedArray, KvCache]:
        """Final activations for ``tokens`` at positions ``start, start + 1, ...``, using and
        filling ``cache``: returns ``(hidden (..., position, embed), new cache)``."""

    @abc.abstractmethod
    def lm_head_weight(self) -> hax.NamedArray:
        """The output projection, axes ``(vocab, embed)``."""

    @property
    def final_logit_softcap(self) -> float | None:
        """Logits are ``cap * tanh(logits / cap)`` with this cap (Gemma 2); None = as they are."""
        return None

    def logits(
        self,
        tokens: hax.NamedArray,
        *,
        segment_ids: hax.NamedArray | None = None,
        key: PRNGKeyArray | None = None,
    ) -> hax.NamedArray:
        """Next-token logits, axes ``(..., position, vocab)``, in the tokens' order (with the
        sequence split over the context axis too: laid out for the model, then put back)."""
        if segment_ids is not None:
            segment_ids = to_layout(segment_ids)
        hidden = self.hidden_states(to_layout(tokens), segment_ids=segment_ids, key=key)
        logits = hax.dot(hidden, self.lm_head_weight(), axis="embed")
        return from_layout(soft_cap(logits, self.final_logit_softcap))

    def save(self, path, tokenizer=None) -> None:
        """Write config and weights to directory ``path`` (YAML and safetensors, no pickle),
        and ``tokenizer`` (a ``tokenizers.Tokenizer`` or tokenizer.json path) if given,
        replacing a previous save there; ``loomax.load_model(path)`` reads it back
        (``with_tokenizer=True``: with the tokenizer)."""
        saved = SavedModel(self.config, self.Vocab.size)
        write_files(path, draccus.dump(saved), self, tokenizer)


def soft_cap(x, cap: float | None):
    """``cap * tanh(x / cap)`` (a ``NamedArray`` or array), or ``x`` when ``cap`` is None."""
    if cap is None:
        return x
    return cap * (hax.tanh(x / cap) if isinstance(x, hax.NamedArray) else jax.numpy.tanh(x / cap))


class AuxOutputs(eqx.Module):
    """What a model returns beside its hidden states for training: ``losses`` (each already
    times its coefficient, a per-token mean the objective adds; e.g. MoE balance losses) and
    ``metrics`` (scalars reported under their own names, e.g. ``moe/...``) and ``state``
    (per-token means of any shape from which the step updates the model's buffers after
    the optimizer, ``models/blocks/buffers.py``; e.g. MoE expert load) and ``side_losses``
    (weighted per-token means trained but left out of the loss's value: the objective adds
    ``term - stop_gradient(term)``, so their gradient joins and the reported loss is the
    model's own; e.g. multi-token prediction, reported as metrics). Empty for a dense model,
    so the loss and the step treat every model alike."""

    losses: dict[str, jax.Array] = eqx.field(default_factory=dict)
    metrics: dict[str, jax.Array] = eqx.field(default_factory=dict)
    state: dict[str, jax.Array] = eqx.field(default_factory=dict)
    side_losses: dict[str, jax.Array] = eqx.field(default_factory=dict)


class KvCache(eqx.Module):
    """Keys and values of every layer, axes ``(layers, ..., key_position, kv_heads|heads, head_size)``."""

    k: hax.NamedArray
    v: hax.NamedArray


@dataclass(frozen=True)
class SavedModel:
    """What ``model.yaml`` holds: the ``model`` section (with ``type``) and the vocabulary size."""

    model: LmConfig
    vocab_size: int = 0
