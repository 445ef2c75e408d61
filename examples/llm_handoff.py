"""Feed this encoder's outputs to Hugging Face's own VLM in place of its vision tower.

A VLM serving stack that runs the vision tower as its own service gets, per image, the merger
tokens, the DeepStack features (Qwen3-VL) and the patch grid (`VisionEncoder.encode_llm`, or the
service's `embed_llm` handle / `pooling: "none"` HTTP items). This script does what the LLM side
has to do with them, on the Hugging Face model of the same checkpoint:

1. the prompt holds one image placeholder token per merger token (`image_token_id`, n = t*h*w/4);
2. `inputs_embeds` = the text embeddings with the tokens scattered into those positions;
3. M-RoPE positions come from `grid_thw` (`get_rope_index`, which needs `mm_token_type_ids`);
4. Qwen3-VL: DeepStack feature k is added to the hidden states at the image positions after
   decoder layer k (`visual_pos_masks`, `deepstack_visual_embeds` of the text model; the full
   model's `forward` computes them itself, so the text model is called directly, then `lm_head`).

Videos (`VisionEncoder.preprocess_video`, then `encode_llm`) go the same way through `vlm_inputs(...,
videos=...)`: their tokens into the `video_token_id` positions, M-RoPE from their `grid_thw` as
`video_grid_thw` (and, for Qwen2.5-VL, each video's `second_per_grid_ts`, which spaces the temporal
positions), DeepStack at the image and video positions together. The prompt is the processor's: Qwen2.5-VL
puts a video's t*h*w/4 placeholders between one <vision_start> and <vision_end>; Qwen3-VL puts, per
temporal patch, the text `<{timestamp:.1f} seconds>` then <vision_start>, h*w/4 placeholders, <vision_end>.

    pip install transformers torchvision    # Hugging Face's VLM and processor (not a dependency of ours)
    python examples/llm_handoff.py CHECKPOINT_DIR [IMAGE] [--prompt TEXT] [--max-new-tokens N]

With a real checkpoint (tokenizer and chat template in the directory) it prints the generated
answer; without a tokenizer (the tiny test checkpoints) it builds the prompt from token ids and
prints the generated ids and the top next-token logits.
"""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path

import torch

import encoder
from encoder.outputs import LLMOutput

DEFAULT_IMAGE = Path(__file__).parent / "images" / "gradient.jpg"


def load_vlm(checkpoint: str | Path, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """The checkpoint's Hugging Face VLM (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5, ...), eval mode."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(checkpoint, dtype=dtype)
    return model.to(device).eval()


def expand_image_tokens(input_ids: list[int], image_token_id: int, outputs: list[LLMOutput]) -> list[int]:
    """Repeat the i-th image placeholder token once per merger token of image i (as the HF processor does)."""
    counts = iter(o.tokens.shape[0] for o in outputs)
    ids: list[int] = []
    for tok in input_ids:
        ids.extend([tok] * next(counts) if tok == image_token_id else [tok])
    if next(counts, None) is not None:
        raise ValueError("the prompt has fewer image placeholders than images")
    return ids


def vlm_inputs(model, input_ids: torch.Tensor, outputs: list[LLMOutput], videos: list[LLMOutput] = ()) -> dict:
    """The text model's inputs for a prompt [1, L] whose image and video placeholders are already expanded
    (`outputs`: the images', `videos`: the videos', each in prompt order).

    Returns `inputs_embeds` [1, L, hidden], `position_ids` [3, 1, L] (M-RoPE from the grids),
    `rope_delta` (what decode steps add to their 1D positions) and, for DeepStack models,
    `visual_pos_masks` [1, L] (image and video positions) and `deepstack_visual_embeds` (one
    [image + video tokens, hidden] per layer, in prompt order).
    """
    cfg = model.config
    dev = model.device
    input_ids = input_ids.to(dev)
    image_mask = input_ids == cfg.image_token_id  # [1, L]
    video_mask = input_ids == cfg.video_token_id  # [1, L]
    embeds = model.get_input_embeddings()(input_ids)  # [1, L, hidden]
    for mask, items, what in ((image_mask, outputs, "image"), (video_mask, videos, "video")):
        count = sum(o.tokens.shape[0] for o in items)
        if int(mask.sum()) != count:
            raise ValueError(f"{int(mask.sum())} {what} placeholders for {count} {what} tokens")
        if items:
            tokens = torch.cat([o.tokens for o in items]).to(dev, embeds.dtype)  # [count, hidden]
            embeds = embeds.masked_scatter(mask[..., None], tokens)

    def grids(items: list[LLMOutput]) -> torch.Tensor | None:  # [items, 3]
        return torch.tensor([o.grid_thw for o in items], dtype=torch.long, device=dev) if items else None

    rope_index = model.model.get_rope_index
    takes = inspect.signature(rope_index).parameters
    kwargs = {"image_grid_thw": grids(outputs), "video_grid_thw": grids(videos)}
    if "mm_token_type_ids" in takes:  # transformers >= 5.x: 1 marks image tokens, 2 video tokens
        kwargs["mm_token_type_ids"] = image_mask.int() + 2 * video_mask.int()
    if videos and "second_per_grid_ts" in takes:  # Qwen2.5-VL: without it HF would space the frames 1 s apart
        seconds = [o.second_per_grid_ts for o in videos]
        if None in seconds:
            raise ValueError("this model needs each video's second_per_grid_ts (a Qwen2/2.5-VL video's LLMOutput)")
        kwargs["second_per_grid_ts"] = torch.tensor(seconds, device=dev)
    position_ids, rope_delta = rope_index(input_ids, **kwargs)

    inputs = {"inputs_embeds": embeds, "position_ids": position_ids, "rope_delta": rope_delta}
    layers = len((list(outputs) + list(videos))[0].deepstack) if outputs or videos else 0
    if layers:
        # as the full model's forward: one feature row per visual position, images' and videos' in their places
        visual = image_mask | video_mask  # [1, L]
        joint = []
        for k in range(layers):
            feature = embeds.new_zeros(int(visual.sum()), embeds.shape[-1])  # [visual tokens, hidden]
            for mask, items in ((image_mask, outputs), (video_mask, videos)):
                if items:
                    feature[mask[visual]] = torch.cat([o.deepstack[k] for o in items]).to(dev, embeds.dtype)
            joint.append(feature)
        inputs["visual_pos_masks"] = visual
        inputs["deepstack_visual_embeds"] = joint
    return inputs


def _cache_kwarg(text_model) -> str:
    # transformers renamed `past_key_values` to `cache` in 5.x
    return "cache" if "cache" in inspect.signature(text_model.forward).parameters else "past_key_values"


def _run_text_model(model, inputs: dict, cache=None, use_cache: bool = False):
    text_model = model.model.language_model
    kwargs = {k: v for k, v in inputs.items() if k != "rope_delta"}
    if use_cache:
        kwargs |= {_cache_kwarg(text_model): cache, "use_cache": True}
    out = text_model(**kwargs)
    new_cache = getattr(out, "cache", None)
    if new_cache is None:
        new_cache = getattr(out, "past_key_values", None)
    return model.lm_head(out.last_hidden_state), new_cache


@torch.inference_mode()
def forward_logits(model, inputs: dict) -> torch.Tensor:
    """Logits [1, L, vocab] of the prompt (float32)."""
    return _run_text_model(model, inputs)[0].float()


@torch.inference_mode()
def generate(model, inputs: dict, max_new_tokens: int, eos_token_id: int | None = None) -> list[int]:
    """Greedy decoding with a KV cache: the prompt (with its image and DeepStack features) once, then
    one text token per step at M-RoPE position max(prompt positions) + 1 + step on all three axes."""
    logits, cache = _run_text_model(model, inputs, use_cache=True)
    embed = model.get_input_embeddings()
    next_pos = int(inputs["position_ids"].max()) + 1
    ids: list[int] = []
    for step in range(max_new_tokens):
        tok = int(logits[0, -1].argmax())
        ids.append(tok)
        if tok == eos_token_id or step == max_new_tokens - 1:
            break
        token = torch.tensor([[tok]], device=model.device)
        pos = torch.full((3, 1, 1), next_pos + step, dtype=torch.long, device=model.device)
        logits, cache = _run_text_model(
            model, {"inputs_embeds": embed(token), "position_ids": pos}, cache=cache, use_cache=True
        )
    return ids


def _tokenizer_prompt(checkpoint: Path, prompt: str, images: int):
    """(token ids with one image placeholder per image, tokenizer) from the checkpoint's chat template,
    or None when the directory has no tokenizer (e.g. the tiny test checkpoints)."""
    if not any((checkpoint / f).exists() for f in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoProcessor  # the Qwen processors also need torchvision (video processor)

    processor = AutoProcessor.from_pretrained(checkpoint)
    content = [{"type": "image"}] * images + [{"type": "text", "text": prompt}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    return processor.tokenizer(text, add_special_tokens=False)["input_ids"], processor.tokenizer


def bare_prompt(config, images: int, text_ids: tuple[int, ...] = (5, 6, 7)) -> list[int]:
    """Token ids without a tokenizer: <vision_start><image><vision_end> per image, then `text_ids`."""
    per_image = [config.vision_start_token_id, config.image_token_id, config.vision_end_token_id]
    return per_image * images + list(text_ids)


def main(
    checkpoint: str | Path,
    images: str | Path | list = DEFAULT_IMAGE,
    prompt: str = "Describe this image.",
    max_new_tokens: int = 16,
    device: str | None = None,
    prompt_ids: list[int] | None = None,
) -> dict:
    """Encode `images` (paths or bytes) with our encoder, run the checkpoint's HF language model on them.

    Returns {"outputs": [LLMOutput], "input_ids": [1, L] (placeholders expanded), "logits": [1, L, vocab],
    "generated": [token ids], "text": decoded answer or None}.
    """
    checkpoint = Path(checkpoint)
    images = images if isinstance(images, list) else [images]
    data = [Path(i).read_bytes() if isinstance(i, str | Path) else i for i in images]
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32

    enc = encoder.load(str(checkpoint), device=device, dtype=dtype)
    outputs = enc.encode_llm(data)  # what an encoder service would send the LLM server
    model = load_vlm(checkpoint, device=device, dtype=dtype)

    tokenizer = None
    if prompt_ids is None:
        found = _tokenizer_prompt(checkpoint, prompt, len(data))
        if found is not None:
            prompt_ids, tokenizer = found
        else:
            prompt_ids = bare_prompt(model.config, len(data))
    ids = torch.tensor([expand_image_tokens(prompt_ids, model.config.image_token_id, outputs)])
    inputs = vlm_inputs(model, ids, outputs)
    logits = forward_logits(model, inputs)
    eos = getattr(model.generation_config, "eos_token_id", None)
    eos = eos[0] if isinstance(eos, list) else eos
    generated = generate(model, inputs, max_new_tokens, eos_token_id=eos)
    text = tokenizer.decode(generated, skip_special_tokens=True) if tokenizer is not None else None

    for i, o in enumerate(outputs):
        print(f"image {i}: grid_thw {o.grid_thw}, tokens {tuple(o.tokens.shape)}, {len(o.deepstack)} DeepStack")
    if text is not None:
        print(text)
    else:
        values, indices = logits[0, -1].topk(5)
        print(
            "top next-token logits:", ", ".join(f"{i}: {v:.3f}" for v, i in zip(values, indices.tolist(), strict=True))
        )
        print("generated ids:", generated)
    return {"outputs": outputs, "input_ids": ids, "logits": logits, "generated": generated, "text": text}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a Hugging Face Qwen VLM checkpoint directory")
    parser.add_argument("images", nargs="*", default=[str(DEFAULT_IMAGE)], help="image files")
    parser.add_argument("--prompt", default="Describe this image.")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    args = parser.parse_args()
    main(args.checkpoint, list(args.images), args.prompt, args.max_new_tokens, args.device)
