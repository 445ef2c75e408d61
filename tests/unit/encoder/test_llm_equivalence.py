"""The real use of `encode_llm`: Hugging Face's own VLM, given our outputs in place of its vision tower,
produces the same logits as when it computes the image (or video) itself.

Tiny float32 checkpoints written by `save_pretrained` (the builders of `tests/hf_models.py`), on the CPU.
The HF side decodes the image bytes and runs `Qwen2VLImageProcessorPil` and the full model's `forward`
(`pixel_values`, `image_grid_thw`, `mm_token_type_ids`); our side is `encoder.load(dir)` preprocessing and
tower, handed over by `examples/llm_handoff.py`: tokens scattered into the placeholder positions of
`inputs_embeds`, M-RoPE positions from our `grid_thw`, DeepStack features through the text model's
`visual_pos_masks` / `deepstack_visual_embeds`, then `lm_head`.

Videos: transformers' video processors need torchvision (not installed here), so both sides take the pixels of
our `preprocess_video` (their equality with the processors' is `preprocessing/test_video_hf_parity.py`'s); the HF
side runs its tower on them (`pixel_values_videos`, `video_grid_thw`, Qwen2.5-VL's `second_per_grid_ts`) in a
prompt expanded as its processor expands a video, with Qwen3-VL's `<t seconds>` text before each temporal patch.

Two changes make the tiny checkpoints able to show a wrong hand-over (config only, before saving):
the image token ids are moved inside the tiny vocabulary, and `mrope_section` is sized to the tiny
head (and `rope_theta` lowered to 100) so that all three M-RoPE axes, not only the temporal one, turn
the attention measurably over the few positions of a tiny prompt; a text model with
fewer layers than DeepStack features would leave some features unused, so it is rebuilt deeper.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import io
import json
from pathlib import Path

import pytest
import torch

import encoder
from encoder.outputs import LLMOutput
from encoder.patch_batch import PatchBatch
from tests.images_util import encode, random_image
from tests.video_util import make_video

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
IMAGE = EXAMPLES / "images" / "gradient.jpg"  # 240x180 JPEG
SECOND = encode(random_image("RGB", 100, 150, seed=3), "PNG")  # another size, PNG
RTOL = 1e-4
CLIP_MEAN, CLIP_STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
FAMILIES = ["qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"]
# the MoE families share their dense siblings' hand-over; the checks beyond equivalence run on these
CORE = ["qwen2_5_vl", "qwen3_vl", "qwen3_5"]


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


handoff = load_example("llm_handoff")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# ---------------------------------------------------------------- tiny checkpoints


def _builder_model(family: str, seed: int):
    from tests import hf_models

    try:
        model = hf_models.full_model(family, seed)
    except (ValueError, KeyError, ImportError, NotImplementedError) as e:
        pytest.skip(f"tests/hf_models.py cannot build {family} yet: {e}")
    if model.config.model_type != family:
        pytest.skip(f"tests/hf_models.py has no {family} builder yet")
    return model


def _deepstack_layers(config) -> int:
    return len(getattr(config.vision_config, "deepstack_visual_indexes", None) or [])


def _deepen(model, layers: int, seed: int):
    """The same VLM with `layers` text layers (randomised as the builders do)."""
    from tests.hf_models import _randomize

    cfg = copy.deepcopy(model.config)
    text = cfg.text_config
    old = text.num_hidden_layers
    text.num_hidden_layers = layers
    if isinstance(getattr(text, "layer_types", None), list):
        text.layer_types = [text.layer_types[i % old] for i in range(layers)]
    deeper = type(model)(cfg)
    _randomize(deeper, seed)
    return deeper.eval()


def tiny_vlm(family: str, seed: int = 0):
    """The builder's VLM with the token ids, M-RoPE sections and depth described in the module docstring."""
    model = _builder_model(family, seed)
    if model.config.text_config.num_hidden_layers < _deepstack_layers(model.config):
        model = _deepen(model, _deepstack_layers(model.config), seed)
    cfg = model.config
    vocab = cfg.text_config.vocab_size
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    if any(getattr(cfg, n, 0) >= vocab for n in names):
        for i, n in enumerate(names):
            setattr(cfg, n, vocab - len(names) + i)
    rotary = model.model.language_model.rotary_emb
    half = rotary.inv_freq.numel()  # rotary frequencies per head
    sections = getattr(rotary, "mrope_section", None)
    if sections is not None and sum(sections) > half >= 3:  # Qwen2.5's builder: default sections, theta 1e6
        cfg.text_config.rope_parameters["mrope_section"] = [half - 2 * (half // 3), half // 3, half // 3]
        # the few positions of a tiny prompt would barely turn the height/width frequencies at theta 1e6
        cfg.text_config.rope_parameters["rope_theta"] = 100.0
    return model


def preprocessor(config) -> dict:
    """A small-image `preprocessor_config.json` for the family (a 240x180 image -> an 8x12 patch grid)."""
    v = config.vision_config
    factor = v.patch_size * v.spatial_merge_size
    qwen3 = config.model_type != "qwen2_5_vl"
    lo, hi = 4 * factor**2, 32 * factor**2
    return {
        "image_processor_type": "Qwen2VLImageProcessor",
        "patch_size": v.patch_size, "temporal_patch_size": v.temporal_patch_size, "merge_size": v.spatial_merge_size,
        "image_mean": [0.5] * 3 if qwen3 else CLIP_MEAN, "image_std": [0.5] * 3 if qwen3 else CLIP_STD,
        **({"size": {"shortest_edge": lo, "longest_edge": hi}} if qwen3 else {"min_pixels": lo, "max_pixels": hi}),
    }  # fmt: skip


class Case:
    """One family's checkpoint directory, its HF model and HF image processor, and our encoder."""

    def __init__(self, family: str, directory: Path):
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        model = tiny_vlm(family)
        model.save_pretrained(directory)
        pp = preprocessor(model.config)
        (directory / "preprocessor_config.json").write_text(json.dumps(pp))
        self.family, self.dir = family, directory
        self.model = handoff.load_vlm(directory)  # everything below reads the saved checkpoint
        self.processor = Qwen2VLImageProcessorPil(**{k: v for k, v in pp.items() if k != "image_processor_type"})
        self.enc = encoder.load(str(directory), device="cpu", dtype=torch.float32)
        self.image_token_id = self.model.config.image_token_id
        self.video_token_id = self.model.config.video_token_id

    def hf_pixels(self, images: list[bytes]) -> dict:
        from PIL import Image

        return dict(self.processor(images=[Image.open(io.BytesIO(b)) for b in images], return_tensors="pt"))

    def prompt(self, grid: torch.Tensor) -> torch.Tensor:
        """[1, L] ids: per image <vision_start><image>*n<vision_end>, then text; n from the HF grid."""
        ids = [1, 9]
        for row in grid.tolist():
            ids += self.image_placeholders(row)
        return torch.tensor([ids + [5, 6, 7]])

    def image_placeholders(self, grid: list[int]) -> list[int]:
        """One image's ids: <vision_start><image>*n<vision_end>, n = t*h*w/4."""
        cfg = self.model.config
        t, h, w = grid
        n = t * h * w // cfg.vision_config.spatial_merge_size**2
        return [cfg.vision_start_token_id] + [cfg.image_token_id] * n + [cfg.vision_end_token_id]

    def video_placeholders(self, video: LLMOutput) -> list[int]:
        """One video's ids as the HF processor expands <vision_start><video><vision_end>: Qwen2.5-VL's t*h*w/4
        video tokens in one block (`Qwen2_5_VLProcessor.replace_video_token`); Qwen3-VL's, per temporal patch, the
        text `<{t:.1f} seconds>` then a block of h*w/4 (`Qwen3VLProcessor.replace_video_token`)."""
        cfg = self.model.config
        unit = cfg.vision_config.spatial_merge_size**2
        t, h, w = video.grid_thw
        start, end, token = cfg.vision_start_token_id, cfg.vision_end_token_id, cfg.video_token_id
        if self.family == "qwen2_5_vl":
            return [start] + [token] * (t * h * w // unit) + [end]
        assert len(video.timestamps) == t
        return [i for sec in video.timestamps for i in timestamp_ids(sec) + [start] + [token] * (h * w // unit) + [end]]

    def mm_token_types(self, ids: torch.Tensor) -> torch.Tensor:
        """[1, L] int: 1 at image placeholders, 2 at video placeholders, 0 elsewhere (HF's `mm_token_type_ids`)."""
        return (ids == self.image_token_id).int() + 2 * (ids == self.video_token_id).int()

    @torch.inference_mode()
    def hf_logits(self, ids: torch.Tensor, pixels: dict) -> torch.Tensor:
        """The full model's own path: it runs its vision tower on the pixels (the HF processor's for images)."""
        return self.model(input_ids=ids, mm_token_type_ids=self.mm_token_types(ids), **pixels).logits.float()

    def hf_video_inputs(self, batch: PatchBatch) -> dict:
        """What the HF processor hands the full model for these videos (our pixels: see the module docstring)."""
        inputs = {"pixel_values_videos": batch.pixel_values, "video_grid_thw": batch.grid_thw}
        if self.family == "qwen2_5_vl":
            inputs["second_per_grid_ts"] = torch.tensor(batch.second_per_grid_ts)
        return inputs


def timestamp_ids(seconds: float) -> list[int]:
    """Stand-in ids for the text `<{seconds:.1f} seconds>` (the tiny checkpoints have no tokenizer): one id per
    character, inside the tiny vocabulary and below the vision token ids."""
    return [10 + ord(c) % 100 for c in f"<{seconds:.1f} seconds>"]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """family -> its `Case`, built once per module."""
    built: dict[str, Case] = {}

    def get(family: str) -> Case:
        if family not in built:
            built[family] = Case(family, tmp_path_factory.mktemp(family))
        return built[family]

    return get


# ---------------------------------------------------------------- equivalence


# the Qwen3-VL pair (8 s each on the loaded CI box) runs in the full suite; -m "not slow" keeps the others
SLOW_EXAMPLE = {"qwen3_vl", "qwen3_vl_moe"}


@pytest.mark.parametrize(
    "family", [pytest.param(f, marks=pytest.mark.slow) if f in SLOW_EXAMPLE else f for f in FAMILIES]
)
def test_example_main_matches_hf_own_tower(cases, family):
    """The example, run as a user would, on a JPEG file: logits and greedy tokens as HF's own path."""
    case = cases(family)
    res = handoff.main(case.dir, IMAGE, max_new_tokens=4, device="cpu")
    pixels = case.hf_pixels([IMAGE.read_bytes()])
    (out,) = res["outputs"]
    assert out.grid_thw == tuple(pixels["image_grid_thw"][0].tolist())
    assert len(out.deepstack) == _deepstack_layers(case.model.config)
    ids = res["input_ids"]
    assert int((ids == case.image_token_id).sum()) == out.tokens.shape[0]
    ref = case.hf_logits(ids, pixels)
    assert rel(res["logits"], ref) <= RTOL

    mm = case.mm_token_types(ids)
    with torch.inference_mode():
        hf_ids = case.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=mm, max_new_tokens=4,
            do_sample=False, **pixels,
        )  # fmt: skip
    hf_new = hf_ids[0, ids.shape[1] :].tolist()
    assert res["generated"] == hf_new[: len(res["generated"])] and len(res["generated"]) >= 1


@pytest.mark.parametrize(
    "family,engine", [(f, "eager") for f in FAMILIES] + [(f, "graph") for f in CORE]
)  # fmt: skip
def test_two_images_of_different_sizes(cases, family, engine):
    """Two images (JPEG 240x180, PNG 150x100) in one prompt, from `VisionEncoder` or `GraphEncoder`."""
    case = cases(family)
    images = [IMAGE.read_bytes(), SECOND]
    pixels = case.hf_pixels(images)
    grids = pixels["image_grid_thw"]
    assert grids[0].tolist() != grids[1].tolist()
    enc = case.enc
    if engine == "graph":
        import workspace

        enc = workspace.GraphEncoder(case.enc, buckets="64,256")
    outputs = enc.encode_llm(images)
    assert [o.grid_thw for o in outputs] == [tuple(g) for g in grids.tolist()]
    ids = case.prompt(grids)
    ours = handoff.forward_logits(case.model, handoff.vlm_inputs(case.model, ids, outputs))
    assert rel(ours, case.hf_logits(ids, pixels)) <= RTOL


@pytest.mark.parametrize("family", CORE)
def test_expand_image_tokens_matches_hf_prompt(cases, family):
    """One placeholder per image in, n_i placeholders out: the prompt the HF processor would build."""
    case = cases(family)
    outputs = case.enc.encode_llm([IMAGE.read_bytes(), SECOND])
    grids = torch.tensor([o.grid_thw for o in outputs])
    short = handoff.bare_prompt(case.model.config, 2)
    long = handoff.expand_image_tokens(short, case.image_token_id, outputs)
    expected = case.prompt(grids)[0, 2:].tolist()  # case.prompt puts [1, 9] first
    assert long == expected
    with pytest.raises(ValueError):
        handoff.expand_image_tokens(short[:3], case.image_token_id, outputs)


# ---------------------------------------------------------------- the hand-over is not trivially right


@pytest.mark.parametrize("family", CORE)
def test_a_wrong_hand_over_changes_the_logits(cases, family):
    """Swapped tokens, a transposed grid (same token count, other M-RoPE positions) and a perturbed
    DeepStack feature of any layer each move the logits far beyond the tolerance: the test above
    would catch a wrong scatter, wrong positions or a dropped DeepStack layer."""
    case = cases(family)
    outputs = case.enc.encode_llm([IMAGE.read_bytes()])
    (out,) = outputs
    ids = case.prompt(torch.tensor([out.grid_thw]))

    def logits(o: LLMOutput) -> torch.Tensor:
        return handoff.forward_logits(case.model, handoff.vlm_inputs(case.model, ids, [o]))

    base = logits(out)
    t, h, w = out.grid_thw
    assert h != w
    variants = {
        "tokens rolled": LLMOutput(out.tokens.roll(1, 0), out.grid_thw, out.deepstack),
        "grid transposed": LLMOutput(out.tokens, (t, w, h), out.deepstack),
    }
    for k, d in enumerate(out.deepstack):
        noisy = list(out.deepstack)
        noisy[k] = d + 0.5 * d.std() * torch.randn(d.shape, generator=torch.Generator().manual_seed(k))
        variants[f"deepstack[{k}] perturbed"] = LLMOutput(out.tokens, out.grid_thw, noisy)
    for name, o in variants.items():
        assert rel(logits(o), base) > 10 * RTOL, name


@pytest.mark.parametrize("family", CORE)
def test_full_model_accepts_precomputed_outputs(cases, family):
    """Newer transformers (5.24 here) also take them in the full model's `forward` (`mm_encoder_outputs`):
    the same logits as the text-model hand-over."""
    case = cases(family)
    if not takes_precomputed(case.model):
        pytest.skip("this transformers' forward has no mm_encoder_outputs")
    outputs = case.enc.encode_llm([IMAGE.read_bytes(), SECOND])
    grid = torch.tensor([o.grid_thw for o in outputs])
    ids = case.prompt(grid)
    with torch.inference_mode():
        full = case.model(
            input_ids=ids, image_grid_thw=grid, mm_token_type_ids=case.mm_token_types(ids),
            mm_encoder_outputs={"image": precomputed(case.model, outputs)},
        ).logits  # fmt: skip
    ours = handoff.forward_logits(case.model, handoff.vlm_inputs(case.model, ids, outputs))
    assert rel(ours, full) <= RTOL


def takes_precomputed(model) -> bool:
    return "mm_encoder_outputs" in inspect.signature(type(model).forward).parameters


def precomputed(model, outputs: list[LLMOutput]):
    """Our outputs as the full model's `mm_encoder_outputs` entry: `pooler_output` a tuple of per-item tokens and,
    for DeepStack models, `deepstack_features` per layer a tuple of per-item features."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    tokens = tuple(o.tokens for o in outputs)
    if not outputs[0].deepstack:
        return BaseModelOutputWithPooling(pooler_output=tokens)
    cls = importlib.import_module(type(model).__module__).BaseModelOutputWithDeepstackFeatures
    layers = range(len(outputs[0].deepstack))
    return cls(pooler_output=tokens, deepstack_features=[tuple(o.deepstack[k] for o in outputs) for k in layers])


# ---------------------------------------------------------------- videos


@pytest.fixture(scope="module")
def video() -> bytes:
    """8 frames of 64x96 at 4 fps (H.264): Qwen2.5-VL takes all 8 (grid 4x4x6, 0.5 s per temporal patch, not the
    1 s HF assumes without `second_per_grid_ts`); Qwen3-VL samples 4 at 2 fps (grid 2x4x6, patches at 0.25 s and
    1.5 s)."""
    pytest.importorskip("av")
    return make_video(8, 64, 96, fps=4)


def video_prompt(case: Case, video: LLMOutput) -> torch.Tensor:
    """[1, L] ids: text, the video as its processor expands it, text."""
    return torch.tensor([[1, 9, *case.video_placeholders(video), 5, 6, 7]])


@pytest.mark.parametrize("family", CORE)
def test_video_matches_hf_own_tower(cases, family, video):
    """A prompt with a video: the HF model running its tower on the video gives the logits of the hand-over of our
    outputs (`vlm_inputs(..., videos=...)`) and of the full model given them (`mm_encoder_outputs`)."""
    case = cases(family)
    batch = case.enc.preprocess_video(video)
    (out,) = case.enc.encode_llm(batch)
    t, h, w = out.grid_thw
    assert t >= 2 and h != w  # several temporal patches, and a grid whose transpose is another
    if family == "qwen2_5_vl":
        assert out.second_per_grid_ts == 0.5 and out.timestamps is None  # 2 frames per patch at 4 fps
    else:
        assert out.timestamps == pytest.approx([0.25, 1.5]) and out.second_per_grid_ts is None
    ids = video_prompt(case, out)
    assert int((ids == case.video_token_id).sum()) == out.tokens.shape[0]
    ref = case.hf_logits(ids, case.hf_video_inputs(batch))
    ours = handoff.forward_logits(case.model, handoff.vlm_inputs(case.model, ids, [], videos=[out]))
    assert rel(ours, ref) <= RTOL

    if takes_precomputed(case.model):  # transformers >= 5.24
        facts = {k: v for k, v in case.hf_video_inputs(batch).items() if k != "pixel_values_videos"}
        with torch.inference_mode():
            full = case.model(
                input_ids=ids, mm_token_type_ids=case.mm_token_types(ids),
                mm_encoder_outputs={"video": precomputed(case.model, [out])}, **facts,
            ).logits  # fmt: skip
        assert rel(full, ref) <= RTOL


@pytest.mark.parametrize("family", CORE)
def test_a_video_and_an_image_in_one_prompt(cases, family, video):
    """A video then an image, encoded in one batch (`PatchBatch.concat`): each item's tokens, M-RoPE positions and
    DeepStack features (one `visual_pos_masks` over video and image tokens) land where the full model puts them."""
    case = cases(family)
    clip = case.enc.preprocess_video(video)
    out_video, out_image = case.enc.encode_llm(PatchBatch.concat([clip, case.enc.preprocess(IMAGE.read_bytes())]))
    pixels = case.hf_pixels([IMAGE.read_bytes()])
    assert out_image.grid_thw == tuple(pixels["image_grid_thw"][0].tolist())
    assert out_image.second_per_grid_ts is None and out_image.timestamps is None
    ids = [1, 9, *case.video_placeholders(out_video), 4, *case.image_placeholders(list(out_image.grid_thw)), 5, 6]
    ids = torch.tensor([ids])
    ref = case.hf_logits(ids, {**pixels, **case.hf_video_inputs(clip)})
    ours = handoff.forward_logits(case.model, handoff.vlm_inputs(case.model, ids, [out_image], videos=[out_video]))
    assert rel(ours, ref) <= RTOL


@pytest.mark.parametrize("family", CORE)
def test_a_wrong_video_hand_over_changes_the_logits(cases, family, video):
    """The video's temporal patches handed over in reverse order (tokens and DeepStack features together) and, for
    Qwen2.5-VL, HF's 1 s per temporal patch instead of the video's 0.5 s each move the logits far beyond the
    tolerance: the test above would catch frames out of order or a lost `second_per_grid_ts`."""
    case = cases(family)
    (out,) = case.enc.encode_llm(case.enc.preprocess_video(video))
    ids = video_prompt(case, out)

    def logits(o: LLMOutput) -> torch.Tensor:
        return handoff.forward_logits(case.model, handoff.vlm_inputs(case.model, ids, [], videos=[o]))

    t = out.grid_thw[0]

    def reversed_in_time(x: torch.Tensor) -> torch.Tensor:  # [n, dim], n = t blocks of h*w/4 tokens
        return x.reshape(t, -1, x.shape[-1]).flip(0).reshape(x.shape)

    base = logits(out)
    variants = {
        "temporal patches reversed": dataclasses.replace(
            out, tokens=reversed_in_time(out.tokens), deepstack=[reversed_in_time(d) for d in out.deepstack]
        )
    }
    if family == "qwen2_5_vl":
        variants["1 s per temporal patch"] = dataclasses.replace(out, second_per_grid_ts=1.0)
        with pytest.raises(ValueError, match="second_per_grid_ts"):  # the example refuses to guess it
            logits(dataclasses.replace(out, second_per_grid_ts=None))
    for name, o in variants.items():
        assert rel(logits(o), base) > 10 * RTOL, name
