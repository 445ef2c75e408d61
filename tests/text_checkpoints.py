"""Tiny random CLIP and SigLIP / SigLIP2 checkpoints with their tokenizers, written by transformers (no network):
the text side's tests (`tests/unit/encoder/models/test_text_towers.py`, `tests/unit/workspace/test_text_graphs.py`)."""

from __future__ import annotations

import torch

CLIP_VISION = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   image_size=56, patch_size=14)  # fmt: skip
CLIP_TEXT = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                 max_position_embeddings=16)  # fmt: skip


def _bytes_to_unicode() -> list[str]:
    """GPT-2 / CLIP's byte -> printable character table (the byte-level BPE alphabet)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs, extra = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return [chr(c) for c in cs]


def clip_tokenizer():
    """A transformers CLIPTokenizer over every byte (with and without `</w>`) and a few merges; the special
    tokens last, so EOS is the highest id as in OpenAI's vocabulary."""
    import transformers as tf

    chars = _bytes_to_unicode()
    vocab = {c: i for i, c in enumerate(chars)}
    vocab |= {c + "</w>": len(chars) + i for i, c in enumerate(chars)}
    merges = [("a", "t</w>"), ("c", "at</w>"), ("p", "h"), ("o", "t"), ("ph", "ot"), ("phot", "o</w>")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return tf.CLIPTokenizer(vocab=vocab, merges=merges)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name == "logit_scale":
                p.fill_(2.0)
                continue
            scale = p.shape[-1] ** -0.5 if p.dim() > 1 else 0.1
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (p.dim() == 1))


def write_clip(directory, legacy_eos: bool = False, with_tokenizer: bool = True, seed: int = 0):
    """A tiny CLIPModel (and its tokenizer) saved in `directory`; returns (HF model, HF tokenizer)."""
    import transformers as tf

    tok = clip_tokenizer()
    text = CLIP_TEXT | dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
                            eos_token_id=2 if legacy_eos else tok.eos_token_id)  # fmt: skip
    model = tf.CLIPModel(tf.CLIPConfig(vision_config=CLIP_VISION, text_config=text, projection_dim=24))
    _randomize(model, seed)
    model.eval().save_pretrained(directory)
    if with_tokenizer:
        tok.save_pretrained(directory)
    return model, tok


SIGLIP_VISION = dict(hidden_size=64, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4,
                     image_size=56, patch_size=14)  # fmt: skip
SIGLIP_TEXT = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                   max_position_embeddings=16, projection_size=64)  # fmt: skip


def siglip2_tokenizer():
    """A transformers Siglip2Tokenizer (Gemma's pipeline, lowercased) over letters, byte fallback and a few merges."""
    import transformers as tf

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"])}
    vocab |= {f"<0x{b:02X}>": 5 + b for b in range(256)}
    for c in "▁abcdefghijklmnopqrstuvwxyz0123456789.,!?'":
        vocab.setdefault(c, len(vocab))
    merges = [("▁", "a"), ("c", "a"), ("ca", "t"), ("▁", "ca"), ("▁ca", "t"), ("p", "h"), ("o", "t")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    return tf.Siglip2Tokenizer(vocab=vocab, merges=merges)


def write_siglip(directory, family: str, seed: int = 0):
    """A tiny SiglipModel / Siglip2Model in `directory` (SigLIP2 with its tokenizer); returns (model, tokenizer)."""
    import transformers as tf

    if family == "siglip":
        model, tok = tf.SiglipModel(tf.SiglipConfig(vision_config=SIGLIP_VISION, text_config=SIGLIP_TEXT)), None
    else:
        tok = siglip2_tokenizer()
        text = SIGLIP_TEXT | dict(vocab_size=len(tok), pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                  bos_token_id=tok.bos_token_id)  # fmt: skip
        vision = dict(SIGLIP_VISION, num_patches=16)
        del vision["image_size"]
        model = tf.Siglip2Model(tf.Siglip2Config(vision_config=vision, text_config=text))
    _randomize(model, seed)
    with torch.no_grad():
        if hasattr(model, "logit_bias"):
            model.logit_bias.fill_(-1.5)
    model.eval().save_pretrained(directory)
    if tok is not None:
        tok.save_pretrained(directory)
    return model, tok
