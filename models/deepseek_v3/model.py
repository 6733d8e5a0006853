"""DeepSeek-V3 (MLA + DeepSeekMoE) built from te_npu modules, with Hugging Face parameter names.

Shape legend: B batch, S sequence, D hidden, T = B*S tokens, N heads, P qk_nope_head_dim,
R qk_rope_head_dim, V v_head_dim, C kv_lora_rank, Q q_lora_rank, E routed experts,
K experts per token, F intermediate size, O vocabulary.

Precision boundary: the MLA projections, the dense / shared-expert MLP projections
(``te_npu.TELinear``) and the routed experts (``te_npu.TEGroupedSwiGLUExperts``) are the GEMMs
that ``te_npu.autocast`` runs in 8 bits. Embedding, lm_head, the FP32 router, RMSNorm, RoPE and
core attention always stay in high precision. The MTP layers (``models/deepseek_v3/mtp.py``)
keep that boundary: their attention, experts and ``eh_proj`` run in 8 bits, their norms,
router and the shared embedding / head in high precision.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from torch import nn

import te_npu
from models.deepseek_v3.config import DeepseekV3Config
from models.deepseek_v3.load_balance import sequence_balance_loss
from models.deepseek_v3.mtp import mtp_cross_entropy, mtp_depths

__all__ = ["DeepseekV3ForCausalLM", "CausalLMOutput", "MTPLayer", "materialize_", "init_weights_", "initial_value",
           "low_precision_scope"]

_LATENT_NORM_EPS = 1e-6  # HF builds q_a_layernorm / kv_a_layernorm with the default eps, not rms_norm_eps
_IGNORE_INDEX = -100


class RMSNorm(nn.Module):
    """``weight * x / rms(x)``, normalised in FP32 and cast back before the scale (as HF)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fp32 = x.float()
        x_fp32 = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x_fp32.to(x.dtype)


def rope_cos_sin(position_ids_BS: torch.Tensor, dim: int, theta: float, dtype: torch.dtype):
    """Rotary angles for interleaved pairs: cos, sin ``[B, S, dim // 2]`` in ``dtype``."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    angles_BSh = position_ids_BS[..., None].float() * inv_freq.to(position_ids_BS.device)
    return angles_BSh.cos().to(dtype), angles_BSh.sin().to(dtype)


def apply_rope_interleaved(x_BNSR: torch.Tensor, cos_BSh: torch.Tensor, sin_BSh: torch.Tensor) -> torch.Tensor:
    """Rotate pairs ``(x0, x1), (x2, x3), ...``; output halves = (even, odd) rotated (HF layout)."""
    cos, sin = cos_BSh.unsqueeze(1), sin_BSh.unsqueeze(1)
    even, odd = x_BNSR[..., 0::2], x_BNSR[..., 1::2]
    return torch.cat([even * cos - odd * sin, odd * cos + even * sin], dim=-1)


def _te_linear(in_features: int, out_features: int, dtype: torch.dtype) -> nn.Module:
    return te_npu.TELinear(in_features, out_features, bias=False, params_dtype=dtype)


class MultiHeadLatentAttention(nn.Module):
    """MLA: low-rank KV latent (C) plus a shared RoPE key (R); causal SDPA core."""

    def __init__(self, cfg: DeepseekV3Config, dtype: torch.dtype) -> None:
        super().__init__()
        self.n_heads, self.nope_dim, self.rope_dim = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_dim, self.kv_lora_rank, self.rope_theta = cfg.v_head_dim, cfg.kv_lora_rank, cfg.rope_theta
        self.softmax_scale = cfg.qk_head_dim ** -0.5  # no yarn mscale: rope_scaling is rejected by the config
        q_out = cfg.num_attention_heads * cfg.qk_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = _te_linear(cfg.hidden_size, q_out, dtype)
        else:
            self.q_a_proj = _te_linear(cfg.hidden_size, cfg.q_lora_rank, dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, _LATENT_NORM_EPS, dtype)
            self.q_b_proj = _te_linear(cfg.q_lora_rank, q_out, dtype)
        self.kv_a_proj_with_mqa = _te_linear(cfg.hidden_size, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, _LATENT_NORM_EPS, dtype)
        kv_b_out = cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
        self.kv_b_proj = _te_linear(cfg.kv_lora_rank, kv_b_out, dtype)
        self.o_proj = _te_linear(cfg.num_attention_heads * cfg.v_head_dim, cfg.hidden_size, dtype)

    def forward(self, x_BSD: torch.Tensor, cos_BSh: torch.Tensor, sin_BSh: torch.Tensor) -> torch.Tensor:
        B, S, _ = x_BSD.shape
        N, P, R, V = self.n_heads, self.nope_dim, self.rope_dim, self.v_dim
        if hasattr(self, "q_proj"):
            q_BSX = self.q_proj(x_BSD)
        else:
            q_BSX = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BSD)))
        q_nope_BNSP, q_rope_BNSR = rearrange(q_BSX, "b s (n x) -> b n s x", n=N).split([P, R], dim=-1)

        kv_latent_BSC, k_rope_BSR = self.kv_a_proj_with_mqa(x_BSD).split([self.kv_lora_rank, R], dim=-1)
        kv_BNSX = rearrange(self.kv_b_proj(self.kv_a_layernorm(kv_latent_BSC)), "b s (n x) -> b n s x", n=N)
        k_nope_BNSP, v_BNSV = kv_BNSX.split([P, V], dim=-1)

        q_rope_BNSR = apply_rope_interleaved(q_rope_BNSR, cos_BSh, sin_BSh)
        k_rope_B1SR = apply_rope_interleaved(rearrange(k_rope_BSR, "b s r -> b 1 s r"), cos_BSh, sin_BSh)
        q_BNSH = torch.cat([q_nope_BNSP, q_rope_BNSR], dim=-1)
        k_BNSH = torch.cat([k_nope_BNSP, k_rope_B1SR.expand(B, N, S, R)], dim=-1)

        o_BNSV = F.scaled_dot_product_attention(q_BNSH, k_BNSH, v_BNSV, is_causal=True, scale=self.softmax_scale)
        return self.o_proj(rearrange(o_BNSV, "b n s v -> b s (n v)"))


class SwiGLUMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``: the dense MLP and the shared experts."""

    def __init__(self, hidden: int, intermediate: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = _te_linear(hidden, intermediate, dtype)
        self.up_proj = _te_linear(hidden, intermediate, dtype)
        self.down_proj = _te_linear(intermediate, hidden, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class TopKRouter(nn.Module):
    """FP32 sigmoid router; ``e_score_correction_bias`` steers selection only, never the weights.

    In a training forward (``self.training``, not an activation recompute's replay) it counts the
    experts its top-k picks (``model.eval()`` for evaluation) and, when ``seq_aux_loss_coeff > 0``
    and gradients are on, computes the sequence-wise balance loss (``load_balance.py``, which
    also moves the bias once per step from the counts). Under ``te_npu.checkpoint(...,
    use_reentrant=True)`` the checkpointed forward runs without gradients, so it is counted but
    computes no balance loss: the Trainer's recompute is non-reentrant."""

    def __init__(self, cfg: DeepseekV3Config) -> None:
        super().__init__()
        self.top_k, self.n_group, self.topk_group = cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.routed_scaling_factor = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts, dtype=torch.float32))
        self.seq_aux_loss_coeff = 0.0  # alpha of the sequence-wise balance loss (0: not computed)
        self.balance_loss: torch.Tensor | None = None  # the last training forward's, until the model takes it
        self._step_counts: torch.Tensor | None = None  # int64 [E]: picks per expert since the last step end
        self._step_loss: torch.Tensor | None = None  # FP32 []: the step's balance losses, summed (detached)
        self._step_forwards = 0

    def forward(self, x_TD: torch.Tensor, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """x: ``[T, D]`` (``batch`` sequences of ``T / batch`` tokens) -> (weights FP32 ``[T, K]``,
        expert ids ``[T, K]``)."""
        scores_TE = F.linear(x_TD.float(), self.weight.float()).sigmoid()
        topk_ids_TK = self._choose(scores_TE)
        weights_TK = scores_TE.gather(1, topk_ids_TK)
        if self.norm_topk_prob:
            weights_TK = weights_TK / (weights_TK.sum(dim=-1, keepdim=True) + 1e-20)
        if self.training:
            self._count(topk_ids_TK, scores_TE, batch)
        return weights_TK * self.routed_scaling_factor, topk_ids_TK

    def _choose(self, scores_TE: torch.Tensor) -> torch.Tensor:
        """Expert ids ``[T, K]``: top-k of the biased scores within the best ``topk_group`` groups."""
        choice_TE = scores_TE + self.e_score_correction_bias
        T, E = choice_TE.shape
        if self.n_group > 1:  # keep the topk_group groups whose top-2 scores sum highest
            group_scores_TG = rearrange(choice_TE, "t (g e) -> t g e", g=self.n_group).topk(2, dim=-1)[0].sum(dim=-1)
            group_idx_TG = group_scores_TG.topk(self.topk_group, dim=-1, sorted=False)[1]
            keep_TG = torch.zeros_like(group_scores_TG, dtype=torch.bool).scatter_(1, group_idx_TG, True)
            keep_TE = repeat(keep_TG, "t g -> t (g e)", e=E // self.n_group)
            choice_TE = choice_TE.masked_fill(~keep_TE, float("-inf"))
        return choice_TE.topk(self.top_k, dim=-1, sorted=False)[1]

    def _count(self, topk_ids_TK: torch.Tensor, scores_TE: torch.Tensor, batch: int) -> None:
        """One training forward: add its picks to the step's counts; its balance loss. A recompute's
        replay computes the loss again (it must save what the forward saved) but counts nothing."""
        loss = None
        if self.seq_aux_loss_coeff > 0 and torch.is_grad_enabled():
            loss = sequence_balance_loss(scores_TE.reshape(batch, -1, scores_TE.shape[-1]), self.top_k,
                                         self.seq_aux_loss_coeff)
        if te_npu.is_recomputing():
            return
        if self._step_counts is None or self._step_counts.device != topk_ids_TK.device:
            self._step_counts = torch.zeros(scores_TE.shape[-1], dtype=torch.int64, device=topk_ids_TK.device)
            self._step_loss = torch.zeros((), dtype=torch.float32, device=topk_ids_TK.device)
        flat_ids = topk_ids_TK.flatten()
        self._step_counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int64))
        self._step_forwards += 1
        if loss is not None:
            self.balance_loss = loss
            self._step_loss += loss.detach()

    def take_step_counts(self) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(picks per expert int64 ``[E]``, summed balance loss FP32 ``[]``, training forwards) since
        the last call; the counts start again from zero."""
        E, device = self.e_score_correction_bias.shape[0], self.e_score_correction_bias.device
        counts = self._step_counts if self._step_counts is not None else torch.zeros(E, dtype=torch.int64, device=device)
        loss = self._step_loss if self._step_loss is not None else torch.zeros((), device=device)
        taken = (counts, loss, self._step_forwards)
        self._step_counts, self._step_loss, self._step_forwards = None, None, 0
        return taken


class DeepSeekMoE(nn.Module):
    """Routed experts (grouped GEMMs over permuted tokens) plus always-on shared experts."""

    def __init__(self, cfg: DeepseekV3Config, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_experts = cfg.n_routed_experts
        self.gate = TopKRouter(cfg)
        self.experts = te_npu.TEGroupedSwiGLUExperts(
            cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size, params_dtype=dtype)
        self.shared_experts = SwiGLUMLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, dtype)

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x_TD = x_BSD.reshape(-1, x_BSD.shape[-1])
        weights_TK, topk_ids_TK = self.gate(x_TD, batch=x_BSD.shape[0])
        x_sorted_XD, m_splits_E, row_map_X = te_npu.moe.permute(x_TD, topk_ids_TK, self.num_experts)  # X = T*K
        routed_TD = te_npu.moe.unpermute(self.experts(x_sorted_XD, m_splits_E), row_map_X, weights_TK)
        return (routed_TD + self.shared_experts(x_TD)).view_as(x_BSD)


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))`` (dense or MoE MLP)."""

    def __init__(self, cfg: DeepseekV3Config, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = MultiHeadLatentAttention(cfg, dtype)
        self.mlp = DeepSeekMoE(cfg, dtype) if cfg.is_moe_layer(layer_idx) else SwiGLUMLP(
            cfg.hidden_size, cfg.intermediate_size, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, x_BSD: torch.Tensor, cos_BSh: torch.Tensor, sin_BSh: torch.Tensor) -> torch.Tensor:
        x_BSD = x_BSD + self.self_attn(self.input_layernorm(x_BSD), cos_BSh, sin_BSh)
        return x_BSD + self.mlp(self.post_attention_layernorm(x_BSD))


class SharedHead(nn.Module):
    """The MTP layer's own norm before the shared output head (HF ``shared_head.norm``; the
    checkpoint's ``shared_head.head`` is a copy of ``lm_head``, not a module here)."""

    def __init__(self, cfg: DeepseekV3Config, dtype: torch.dtype) -> None:
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class MTPLayer(DecoderLayer):
    """MTP depth k (technical report 2.2), HF layer ``num_hidden_layers + k - 1``:
    ``h_k = block(eh_proj([enorm(emb(t_{i+k})); hnorm(h_{k-1})]))``, the block a MoE decoder
    layer. ``eh_proj`` is an 8-bit TE linear, as Megatron builds it (a backend linear run under
    the FP8 context); ``shared_head.norm`` feeds the shared ``lm_head``."""

    def __init__(self, cfg: DeepseekV3Config, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__(cfg, layer_idx, dtype)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.eh_proj = _te_linear(2 * cfg.hidden_size, cfg.hidden_size, dtype)
        self.shared_head = SharedHead(cfg, dtype)

    def forward(self, h_BSD: torch.Tensor, emb_BSD: torch.Tensor, cos_BSh: torch.Tensor,
                sin_BSh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (``h_k`` for the next depth, ``shared_head.norm(h_k)`` for the head): both inside one
        call, so an FSDP2 unit of this layer has its parameters gathered for every use."""
        x_BSD = self.eh_proj(torch.cat([self.enorm(emb_BSD), self.hnorm(h_BSD)], dim=-1))
        h_BSD = super().forward(x_BSD, cos_BSh, sin_BSh)
        return h_BSD, self.shared_head.norm(h_BSD)


class DeepseekV3Model(nn.Module):
    """``layers``: the ``num_hidden_layers`` decoder layers, then the ``num_nextn_predict_layers``
    MTP layers (as DeepSeek-V3's checkpoints number them); ``forward`` runs the main ones."""

    def __init__(self, cfg: DeepseekV3Config, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = cfg
        n = cfg.num_hidden_layers
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, cfg.pad_token_id, dtype=dtype)
        self.layers = nn.ModuleList([*(DecoderLayer(cfg, i, dtype) for i in range(n)),
                                     *(MTPLayer(cfg, n + k, dtype) for k in range(cfg.num_nextn_predict_layers))])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def rope(self, position_ids_BS: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(position_ids_BS, self.config.qk_rope_head_dim, self.config.rope_theta, dtype)

    def forward(self, input_ids_BS: torch.Tensor, position_ids_BS: torch.Tensor) -> torch.Tensor:
        x_BSD = self.embed_tokens(input_ids_BS)
        cos_BSh, sin_BSh = self.rope(position_ids_BS, x_BSD.dtype)
        for layer in self.layers[: self.config.num_hidden_layers]:
            x_BSD = layer(x_BSD, cos_BSh, sin_BSh)
        return self.norm(x_BSD)


@dataclass
class CausalLMOutput:
    logits: torch.Tensor                 # [B, S, O]
    loss: torch.Tensor | None = None     # mean next-token cross-entropy over labels != -100
    balance_loss: torch.Tensor | None = None  # FP32 []: the MoE layers' sequence-wise balance losses, summed
    # (a training forward with seq_aux_loss_coeff > 0; not in ``loss``: add it to what you backpropagate)
    mtp_logits: tuple[torch.Tensor, ...] = ()  # depth k: [B, S, O], position s predicts token s + k + 1
    mtp_losses: tuple[torch.Tensor, ...] = ()  # depth k's cross-entropy (with labels; the last k positions ignored)


def causal_lm_loss(logits_BSO: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """HF's causal-LM loss: predict ``labels[:, s + 1]`` at position s, in FP32, mean over non-ignored."""
    shift_labels_BS = F.pad(labels_BS, (0, 1), value=_IGNORE_INDEX)[:, 1:]
    return F.cross_entropy(logits_BSO.float().flatten(0, 1), shift_labels_BS.flatten(), ignore_index=_IGNORE_INDEX)


class DeepseekV3ForCausalLM(nn.Module):
    """``forward(input_ids [B, S], labels=None, position_ids=None) -> CausalLMOutput``.

    Build under ``with torch.device("meta")`` to allocate nothing, then ``materialize_``.
    Otherwise the weights are initialised at construction with ``init_weights_(self, seed)``.
    """

    def __init__(self, config: DeepseekV3Config, *, dtype: torch.dtype = torch.float32, seed: int = 0) -> None:
        super().__init__()
        self.config = config
        self.model = DeepseekV3Model(config, dtype)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        if not self.lm_head.weight.is_meta:
            init_weights_(self, seed)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> CausalLMOutput:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0)
        h_BSD = self.model(input_ids, position_ids)
        logits_BSO = self.lm_head(h_BSD)
        mtp_logits = mtp_depths(self.model.layers[self.config.num_hidden_layers:], self.model.embed_tokens,
                                self.lm_head, input_ids, h_BSD, self.model.rope(position_ids, h_BSD.dtype))
        mtp_losses = ()
        if labels is not None:
            next_labels_BS = F.pad(labels, (0, 1), value=_IGNORE_INDEX)[:, 1:]
            mtp_losses = tuple(mtp_cross_entropy(l, next_labels_BS, k) for k, l in enumerate(mtp_logits, start=1))
        return CausalLMOutput(logits_BSO, None if labels is None else causal_lm_loss(logits_BSO, labels),
                              balance_loss=self._take_balance_losses(), mtp_logits=mtp_logits, mtp_losses=mtp_losses)

    def routers(self) -> list[TopKRouter]:
        """Every MoE router of the model, in module order."""
        return [m for m in self.modules() if isinstance(m, TopKRouter)]

    def set_seq_aux_loss_coeff(self, coeff: float) -> None:
        """alpha of the sequence-wise balance loss, for every router (0: none computed)."""
        for router in self.routers():
            router.seq_aux_loss_coeff = float(coeff)

    def _take_balance_losses(self) -> torch.Tensor | None:
        """The routers' balance losses of this forward, summed (None when none computed one)."""
        losses = []
        for router in self.routers():
            if router.balance_loss is not None:
                losses.append(router.balance_loss)
                router.balance_loss = None
        return torch.stack(losses).sum() if losses else None


def initial_value(model: nn.Module, fqn: str, seed: int) -> torch.Tensor:
    """HF-equal initial value of parameter or buffer ``fqn``, full shape, FP32 on the CPU:
    normal(0, initializer_range) for linears, embeddings, experts and router; norms 1; router
    bias 0; embedding padding row 0. Each tensor draws from its own generator seeded by
    (seed, FQN), so the value depends on nothing else (construction order, sharding, world size)."""
    module_name, _, name = fqn.rpartition(".")
    module = model.get_submodule(module_name)
    shape = getattr(module, name).shape
    if isinstance(module, RMSNorm):
        return torch.ones(shape)
    if name == "e_score_correction_bias":
        return torch.zeros(shape)
    if name in dict(module.named_buffers(recurse=False)):  # a buffer this function does not know
        raise ValueError(f"initial_value: no rule for buffer {fqn!r} (only the router's e_score_correction_bias, "
                         "which starts at 0, is known); add one rather than drawing it as a weight")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(f"{module_name}.{name}".encode()))
    value = torch.empty(shape, dtype=torch.float32).normal_(0.0, model.config.initializer_range, generator=gen)
    if isinstance(module, nn.Embedding) and module.padding_idx is not None and name == "weight":
        value[module.padding_idx] = 0.0
    return value


@torch.no_grad()
def init_weights_(model: nn.Module, seed: int) -> None:
    """Every parameter and buffer of a materialized, unsharded ``model`` set to its ``initial_value``."""
    for fqn, tensor in [*model.named_parameters(), *model.named_buffers()]:
        tensor.copy_(initial_value(model, fqn, seed))


def materialize_(model: nn.Module, seed: int, device: torch.device | str = "cpu", dtype: torch.dtype | None = None):
    """Allocate a meta-built model on ``device`` (optionally casting to ``dtype``; the router
    stays FP32) and initialise it deterministically. Returns the model."""
    model.to_empty(device=device)
    if dtype is not None:
        model.to(dtype=dtype)
        for module in model.modules():
            if isinstance(module, TopKRouter):
                module.float()
    init_weights_(model, seed)
    return model


def low_precision_scope(model: nn.Module) -> list[str]:
    """FQNs of the TE modules, i.e. the GEMMs that run in 8 bits under ``te_npu.autocast``."""
    return [name for name, module in model.named_modules() if isinstance(module, te_npu.TEModule)]
