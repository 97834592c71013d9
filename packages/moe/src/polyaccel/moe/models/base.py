"""What polyaccel's MoE decoder models share: the pre-trained-model base (init, backend
selection), the decoder stack and the causal-LM head with its losses.

Each architecture file (``qwen3_moe.py``, ``mixtral.py``, ``olmoe.py``, ``deepseek_v3.py``)
supplies its attention and decoder layer and subclasses the three classes here. The classes keep
Transformers' class names, parameter names and shapes, so ``config.architectures``,
checkpoint conversion, ``generate``, PEFT and gradient checkpointing work as for the
Transformers originals.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast

from polyaccel.moe import fused_embedding
from polyaccel.moe.config import BackendConfig, compiles_layers, require_transformer_engine
from polyaccel.moe.layers import (
    AttentionContext,
    Experts,
    RMSNorm,
    RotaryEmbedding,
    SigmoidGroupRouter,
    TopKRouter,
    causal_lm_loss,
    head_dim,
    init_std,
    load_balancing_loss,
    plain_causal,
    rope_type,
)

logger = logging.getLogger("polyaccel.moe")


def _capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream (host syncs are illegal)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class MoeDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm decoder layer: ``h + attn(norm(h))``, then ``h + mlp(norm(h))``.

    Subclasses build ``self_attn``, ``mlp``, ``input_layernorm`` and
    ``post_attention_layernorm``. Returns (hidden [B, S, H], router logits [B*S, E] or None).
    """

    self_attn: nn.Module
    mlp: nn.Module

    def forward(self, hidden: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                ctx: AttentionContext) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), rope, ctx)
        out, router_logits = self.mlp(self.post_attention_layernorm(hidden))
        return hidden + out, router_logits


class MoePreTrainedModel(PreTrainedModel):
    """Base of polyaccel's MoE models: weight init like Transformers, backend selection."""

    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _skip_keys_device_placement = ["past_key_values"]
    _supports_sdpa = True

    @classmethod
    def is_custom_code(cls) -> bool:
        """False: these classes implement the native architecture with the native parameter
        layout, so Transformers applies the native checkpoint conversion (per-expert keys <->
        fused experts) on load and reverts it on save, exactly as for its own classes."""
        return False

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        std = init_std(self.config)
        if isinstance(module, Experts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, TopKRouter):
            init.normal_(module.weight, mean=0.0, std=std)
            if isinstance(module, SigmoidGroupRouter):
                init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, RotaryEmbedding):
            init.copy_(module.inv_freq, module.compute_inv_freq()[0])

    @classmethod
    def unsupported_reason(cls, config: Any) -> str | None:
        """Why this implementation cannot run ``config`` faithfully (None when it can)."""
        rt = rope_type(config)
        if rt in RotaryEmbedding.DYNAMIC_TYPES:
            return f"rope_type={rt!r} (sequence-length-dependent RoPE) is not implemented"
        from polyaccel.core.ops import _ACTIVATIONS

        if config.hidden_act not in _ACTIVATIONS:
            return f"hidden_act={config.hidden_act!r} is not implemented"
        return None


class MoeModel(MoePreTrainedModel):
    """Embedding, decoder layers, final norm: input ids -> last hidden state [B, S, H]."""

    decoder_layer_class: ClassVar[type[MoeDecoderLayer]]

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [self.decoder_layer_class(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)
        self.gradient_checkpointing = False
        self.attn_impl = "auto"
        self.fuse_embedding_grad = False  # BackendConfig(grad_accumulation="fused"): polyaccel.moe.fused_embedding
        self.post_init()

    @property
    def sliding_window(self) -> int | None:
        return getattr(self.config, "sliding_window", None)

    def attention_geometry(self) -> tuple[int, int, int, int]:
        """(query heads, key/value heads, query/key head dim, value head dim) of the layers'
        attention, for ``attn="auto"``'s per-shape choice."""
        c = self.config
        d = head_dim(c)
        return c.num_attention_heads, getattr(c, "num_key_value_heads", None) or c.num_attention_heads, d, d

    def _attention_impl(self, hidden: torch.Tensor, ctx: AttentionContext) -> str:
        """``ctx.impl`` with ``"auto"`` resolved for this forward: the per-shape faster of the
        backend's flash kernel and SDPA (:mod:`polyaccel.moe.attention_choice`) where plain
        causal attention applies (:func:`~polyaccel.moe.layers.plain_causal`), else SDPA."""
        if ctx.impl != "auto":
            return ctx.impl
        if hidden.dim() != 3 or not plain_causal(ctx, hidden.shape[1]):
            return "sdpa"
        from polyaccel.moe import attention_choice

        return attention_choice.choose(hidden.shape[0], hidden.shape[1], *self.attention_geometry(),
                                       hidden.dtype, hidden.device)

    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, past_key_values: Any = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                output_hidden_states: bool | None = None, output_router_logits: bool | None = None,
                **kwargs: Any) -> MoeModelOutputWithPast:
        """Inputs as Transformers' decoder models take them. ``use_cache`` defaults to the
        config's value in eval mode and to off in training (a cache would copy every K/V)."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids or inputs_embeds")
        if use_cache is None:
            use_cache = past_key_values is not None or (self.config.use_cache and not self.training)
        if self.gradient_checkpointing and self.training and use_cache:
            use_cache = False  # a recomputed layer would write the cache twice
        if inputs_embeds is None:
            inputs_embeds = (fused_embedding.embedding(input_ids, self.embed_tokens) if self.fuse_embedding_grad
                             else self.embed_tokens(input_ids))
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache(config=self.config)
        if not use_cache:
            past_key_values = None
        if position_ids is None:
            past = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device)[None] + past
        if (attention_mask is not None and attention_mask.dim() == 2
                and not torch.compiler.is_compiling() and not _capturing()
                and bool(attention_mask.all())):
            attention_mask = None  # no padding: plain causal attention (one host sync per forward)
        ctx = AttentionContext(attention_mask, past_key_values, self.sliding_window, self.attn_impl)
        ctx.impl = self._attention_impl(inputs_embeds, ctx)
        rope = self.rotary_emb(position_ids)

        hidden = inputs_embeds
        all_hidden: tuple[torch.Tensor, ...] = ()
        router_logits: tuple[torch.Tensor | None, ...] = ()
        for layer in self.layers:
            if output_hidden_states:
                all_hidden += (hidden,)
            hidden, logits = layer(hidden, rope, ctx)
            if logits is not None:  # dense layers and balanced gates have none
                router_logits += (logits,)
        hidden = self.norm(hidden)
        if output_hidden_states:
            all_hidden += (hidden,)
        return MoeModelOutputWithPast(
            last_hidden_state=hidden, past_key_values=past_key_values,
            hidden_states=all_hidden if output_hidden_states else None,
            router_logits=router_logits if output_router_logits else None)


class MoeForCausalLM(MoePreTrainedModel, GenerationMixin):
    """Decoder + LM head; loss is next-token cross-entropy plus, with router logits on,
    ``router_aux_loss_coef`` times the load-balancing loss (both as Transformers computes them).

    With ``BackendConfig(loss="fused")`` (the default) and labels given, the loss comes from
    chunked linear cross-entropy and ``logits`` in the output is None.
    """

    model_class: ClassVar[type[MoeModel]]
    #: whether ``output_router_logits`` adds the softmax-router load-balancing loss
    has_aux_loss: ClassVar[bool] = True
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.model = self.model_class(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.router_aux_loss_coef = getattr(config, "router_aux_loss_coef", 0.0)
        self.num_experts = self.config_num_experts(config)
        self.num_experts_per_tok = config.num_experts_per_tok
        self.backend_config = BackendConfig()
        self.post_init()

    @staticmethod
    def config_num_experts(config: Any) -> int:
        return config.num_experts

    # ---- backend -------------------------------------------------------------------------
    def apply_backend(self, backend: BackendConfig) -> MoeForCausalLM:
        """Switch every layer to the implementations ``backend`` names; returns self.

        Selects the polyaccel hardware backend (registering its kernels for the core ops).
        Parameters and their names do not change, so checkpoints and optimizers are unaffected
        (except ``linear="te"``, which swaps the attention projections for TransformerEngine
        modules holding the same weights).
        """
        from polyaccel.core import select_backend

        hardware = select_backend(backend.backend).name
        if backend.backend == "auto" and hardware == "cpu" and torch.cuda.is_available():
            logger.warning("polyaccel.moe: this machine has a CUDA GPU but polyaccel's cuda backend is not installed "
                           "or not loadable (pip install polyaccel-backend-cuda; `polyaccel doctor` says which): "
                           "a model on the GPU runs core's reference kernels there, slower and with more memory")
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.impl = backend.rms_norm
            elif isinstance(m, Experts):
                m.impl = backend.experts
                m.fuse_wgrad = backend.grad_accumulation == "fused"
            elif isinstance(m, TopKRouter):
                m.mode, m.noise = backend.gate, backend.gate_noise
        self.model.attn_impl = backend.attn
        self.model.fuse_embedding_grad = backend.grad_accumulation == "fused"
        if backend.linear == "te":
            self._use_te_linear()
        if backend.attn == "te":
            self._use_te_attention()
        if compiles_layers(backend, hardware):
            for layer in self.model.layers:
                layer.compile()
        self.backend_config = backend
        return self

    def _use_te_linear(self) -> None:
        require_transformer_engine("BackendConfig(linear='te')")
        import transformer_engine.pytorch as te

        for layer in self.model.layers:
            attn = layer.self_attn
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                old: nn.Linear = getattr(attn, name)
                new = te.Linear(old.in_features, old.out_features, bias=old.bias is not None,
                                params_dtype=old.weight.dtype, device=old.weight.device)
                with torch.no_grad():
                    new.weight.copy_(old.weight)
                    if old.bias is not None:
                        new.bias.copy_(old.bias)
                setattr(attn, name, new)

    def _use_te_attention(self) -> None:
        require_transformer_engine("BackendConfig(attn='te')")
        import transformer_engine.pytorch as te

        c = self.config
        for layer in self.model.layers:
            attn = layer.self_attn
            attn.te_attention = te.DotProductAttention(
                c.num_attention_heads, attn.head_dim, num_gqa_groups=c.num_key_value_heads,
                attn_mask_type="causal", qkv_format="bshd", softmax_scale=attn.scaling)

    # ---- forward -------------------------------------------------------------------------
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, past_key_values: Any = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, output_router_logits: bool | None = None,
                output_hidden_states: bool | None = None, output_attentions: bool | None = None,
                logits_to_keep: int | torch.Tensor = 0, return_dict: bool | None = None,
                **kwargs: Any) -> MoeCausalLMOutputWithPast | tuple:
        """Same inputs and outputs as the Transformers model (``output_attentions`` is not
        supported: attention runs in fused SDPA kernels that never form the weights)."""
        if output_attentions:
            logger.warning("output_attentions is not supported by polyaccel MoE models; returning None")
        if output_router_logits is None:
            output_router_logits = getattr(self.config, "output_router_logits", False)
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                         output_hidden_states=output_hidden_states, output_router_logits=output_router_logits)
        hidden = out.last_hidden_state

        logits = None
        fused = labels is not None and self.backend_config.loss == "fused"
        if not fused:
            keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
            logits = self.lm_head(hidden[:, keep, :])
        loss = None
        if labels is not None:
            loss = causal_lm_loss(hidden, self.lm_head.weight, labels, logits=logits,
                                  num_items_in_batch=kwargs.get("num_items_in_batch"),
                                  chunk=self.backend_config.loss_chunk_size,
                                  shift_labels=kwargs.get("shift_labels"),
                                  fuse_weight_grad=self.backend_config.grad_accumulation == "fused")
        aux_loss = None
        if output_router_logits and self.has_aux_loss:
            aux_loss = load_balancing_loss(out.router_logits, self.num_experts, self.num_experts_per_tok,
                                           attention_mask)
            if loss is not None and aux_loss is not None:
                loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
        result = MoeCausalLMOutputWithPast(
            loss=loss, aux_loss=aux_loss, logits=logits, past_key_values=out.past_key_values,
            hidden_states=out.hidden_states, router_logits=out.router_logits)
        if return_dict is False:
            return result.to_tuple()
        return result
