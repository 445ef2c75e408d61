"""CLIP and SigLIP text towers over fixed-length token batches.

Every text is `seq_len` tokens (the tokenizer pads and truncates to the model's
`max_position_embeddings`: CLIP 77, SigLIP 64), so a batch is one [B, S] tensor of token ids and the
forward has fixed shapes and no host synchronisation: a graph runner can capture it per [B, S]
(`workspace.text_runner`, through `encoder.models.tower.TextGraphTower`). CLIP's outputs depend only on the
columns up to each text's EOS (`output_spans`), so its graphs may run fewer columns; SigLIP's need all of them.

Parameter names mirror the Hugging Face text models (`embeddings.token_embedding`,
`encoder.layers.N.self_attn.q_proj`, `final_layer_norm`; CLIP's `text_projection`, SigLIP's `head`), so
loading is a rename-free copy from under `text_model.` (plus CLIP's top-level `text_projection.weight`).

Outputs of `forward(input_ids)`: [B, out_dim] float32, what transformers' `get_text_features` returns:
  * CLIP: `text_projection(final_layer_norm(x)[eos])`, causal attention, `eos` the first position of
    `eos_token_id` (legacy configs with `eos_token_id` 2: the position of the highest token id);
  * SigLIP / SigLIP2: `head(final_layer_norm(x)[:, -1])`; SigLIP attends over every position (pads
    included, as in HF: its processor passes no attention mask), SigLIP2 masks the pads out (its processor
    passes the tokenizer's mask; its Gemma tokenizer pads on the left, so the last token is the text's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from encoder.models.layers import activation
from encoder.text_config import ClipTextConfig, SiglipTextConfig, TextConfig


class TextAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, causal: bool):
        super().__init__()
        self.num_heads, self.causal = num_heads, causal
        self.q_proj = nn.Linear(dim, dim)
        self.k_proj = nn.Linear(dim, dim)
        self.v_proj = nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, keys: torch.Tensor | None = None) -> torch.Tensor:
        # x: [B, S, D] -> [B, S, D]; keys: None or [B, 1, 1, S] bool, the positions each text attends to
        b, s, d = x.shape
        q, k, v = (p(x).view(b, s, self.num_heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=keys, is_causal=self.causal)  # [B, H, S, hd]
        return self.out_proj(o.transpose(1, 2).reshape(b, s, d))


class TextMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.act = act
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        # [B, S, D] -> [B, S, D]; the activation kernels take rows ([B * S, F])
        b, s, d = x.shape
        return self.fc2(activation(self.fc1(x.reshape(b * s, d)), self.act)).view(b, s, d)


class TextLayer(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = TextAttention(cfg.hidden_size, cfg.num_attention_heads, cfg.causal)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = TextMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, x: torch.Tensor, keys: torch.Tensor | None = None) -> torch.Tensor:
        # pre-norm block; the residual stream x is float32, the branches run in the model dtype
        dtype = self.self_attn.q_proj.weight.dtype
        x = x + self.self_attn(_norm(self.layer_norm1, x).to(dtype), keys).float()
        return x + self.mlp(_norm(self.layer_norm2, x).to(dtype)).float()


def _norm(ln: nn.LayerNorm, x: torch.Tensor) -> torch.Tensor:
    """LayerNorm in float32 (x float32)."""
    return F.layer_norm(x, (x.shape[-1],), ln.weight.float(), ln.bias.float(), ln.eps)


class TextEmbeddings(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.token_embedding = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embedding = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # [B, S] -> [B, S, D] float32 (S = max_position_embeddings: every position is used)
        s = input_ids.shape[1]
        return self.token_embedding(input_ids).float() + self.position_embedding.weight[:s].float()


class TextEncoderLayers(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.layers = nn.ModuleList(TextLayer(cfg) for _ in range(cfg.num_hidden_layers))


class TextTower(nn.Module):
    """Shared body of the CLIP and SigLIP text towers (see the module docstring)."""

    # where the tower's weights sit in a full CLIPModel / SiglipModel / Siglip2Model checkpoint
    checkpoint_prefix = "text_model."
    # weights outside the text model (CLIP's projection)
    checkpoint_top_level: tuple[str, ...] = ()

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.cfg = cfg
        self.embeddings = TextEmbeddings(cfg)
        self.encoder = TextEncoderLayers(cfg)
        self.final_layer_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    # `encoder.models.tower.TextGraphTower`: a text's output depends only on its first `output_spans` columns
    # (False: on all of them, pads included)
    prefix_exact = False

    @property
    def seq_len(self) -> int:
        return self.cfg.seq_len

    @property
    def out_dim(self) -> int:
        return self.cfg.out_dim

    def output_spans(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B] int64: how many leading columns of each text its output depends on (here: all of them)."""
        return torch.full((input_ids.shape[0],), input_ids.shape[1], dtype=torch.int64, device=input_ids.device)

    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """[B, S] token ids -> [B, S, D] float32, after `final_layer_norm` (HF's `last_hidden_state`).

        `attention_mask` [B, S] (1: a token, 0: padding), None for none: pads are then keys like any token."""
        keys = None if attention_mask is None else attention_mask.bool()[:, None, None, :]
        x = self.embeddings(input_ids)
        for layer in self.encoder.layers:
            x = layer(x, keys)
        return _norm(self.final_layer_norm, x)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        raise NotImplementedError


class ClipTextTower(TextTower):
    """`CLIPModel.get_text_features`: the EOS token's state, projected."""

    checkpoint_top_level = ("text_projection.weight",)
    # causal attention pooled at the EOS: no column after it reaches the output (pads on the right, or text
    # after an EOS written in the text), so the columns past the batch's last EOS may be dropped
    prefix_exact = True

    def __init__(self, cfg: ClipTextConfig):
        super().__init__(cfg)
        self.text_projection = nn.Linear(cfg.hidden_size, cfg.projection_dim, bias=False)

    def eos_positions(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[B] position of the pooled token, on the device (transformers' CLIPTextTransformer rule)."""
        ids = input_ids.to(torch.int32)
        if self.cfg.eos_token_id == 2:  # legacy configs: the highest id (the EOS of OpenAI's vocabulary)
            return ids.argmax(-1)
        return (ids == self.cfg.eos_token_id).int().argmax(-1)  # the first EOS (pads may equal it)

    def output_spans(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[B] int64: the pooled position + 1. On the columns before it the pooled position is unchanged: the
        first EOS, or (legacy) the first of the highest id, lies within them."""
        return self.eos_positions(input_ids).to(torch.int64) + 1

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        # input_ids: [B, S] -> [B, projection_dim] float32; causal: pads after the EOS never reach it, so
        # CLIP needs no mask (the tokenizer pads on the right)
        h = self.hidden(input_ids)
        pooled = h[torch.arange(h.shape[0], device=h.device), self.eos_positions(input_ids)]  # [B, D]
        return F.linear(pooled, self.text_projection.weight.float())


class SiglipTextTower(TextTower):
    """`SiglipModel.get_text_features`: the last token's state through `head`."""

    def __init__(self, cfg: SiglipTextConfig):
        super().__init__(cfg)
        self.head = nn.Linear(cfg.hidden_size, cfg.out_dim)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        # input_ids: [B, S] -> [B, out_dim] float32; attention_mask [B, S] for SigLIP2 (`mask_padding`)
        h = self.hidden(input_ids, attention_mask if self.cfg.mask_padding else None)[:, -1]
        return F.linear(h, self.head.weight.float(), self.head.bias.float())


def build_text_tower(cfg: TextConfig) -> TextTower:
    if isinstance(cfg, ClipTextConfig):
        return ClipTextTower(cfg)
    if isinstance(cfg, SiglipTextConfig):
        return SiglipTextTower(cfg)
    raise TypeError(f"not a CLIP / SigLIP text config: {type(cfg).__name__}")
