"""Tests for a3b_core.media.image: loading any image to sRGB RGB, resizing, and processor-exact patches.

Every test image is generated here at test time; ICC profiles are built from primaries (no ICC files needed).
"""

from __future__ import annotations

import io
import struct
import subprocess
import sys
import tracemalloc

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageCms, ImageFile

from a3b_core.errors import ImageError
from a3b_core.media.image import (MAX_INPUT_PIXELS, RESIZE_MODES, SHRINK_ABOVE_PIXELS, load_image, load_resized,
                                  native_size, preprocess, preprocess_images, resize_image, smart_resize, split_batch,
                                  to_patches)
from tests.hostile_inputs import EPS, REPO, child_peak_growth, fake_ghostscript, png_header_only


def noise_image(width: int, height: int, seed: int = 0) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def pixels(img: Image.Image) -> np.ndarray:
    return np.asarray(img, dtype=np.int32)


# ---------------------------------------------------------------- processor equivalence


@pytest.fixture(scope="module")
def processor():
    pil_module = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    # The real preprocessor_config.json values; constructed offline, no hub access.
    return pil_module.Qwen2VLImageProcessorPil(
        size={"shortest_edge": 65536, "longest_edge": 16777216},
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        resample=3,
        rescale_factor=1 / 255,
    )


@pytest.mark.parametrize(
    ("width", "height", "grid"),
    [(384, 384, (1, 24, 24)), (300, 200, (1, 14, 20)), (32, 32, (1, 16, 16)), (1000, 700, (1, 44, 62))],
)
def test_to_patches_equals_processor_bit_for_bit(processor, width, height, grid):
    img = noise_image(width, height)
    expected = processor(images=[img], return_tensors="pt")
    pixel_values, thw = to_patches(img)
    assert thw == grid
    assert thw == tuple(expected["image_grid_thw"][0].tolist())
    assert pixel_values.dtype == torch.float32
    assert pixel_values.shape == expected["pixel_values"].shape
    assert torch.equal(pixel_values, expected["pixel_values"])


def test_384_image_is_576_patches_and_144_tokens(tmp_path):
    path = tmp_path / "photo.png"
    noise_image(1000, 700).save(path)
    pixel_values, (t, gh, gw) = preprocess(path)
    assert pixel_values.shape == (576, 3 * 2 * 16 * 16)
    assert (t, gh, gw) == (1, 24, 24)
    assert t * gh * gw // 4 == 144


def test_patch_order_is_block_major_with_duplicated_frame():
    # 256x256 (the minimum size, so no resize) = 16x16 patches, each a distinct grey level 0..255.
    levels_grid = np.arange(256, dtype=np.uint8).reshape(16, 16)
    img = Image.fromarray(np.kron(levels_grid, np.ones((16, 16), dtype=np.uint8))).convert("RGB")
    pixel_values, grid = to_patches(img)
    assert grid == (1, 16, 16)
    patches = pixel_values.reshape(256, 3, 2, 16, 16)
    assert torch.equal(patches[:, :, 0], patches[:, :, 1])  # the single frame is duplicated to T=2
    levels = ((patches[:, 0, 0, 0, 0] * 0.5 + 0.5) * 255).round().to(torch.int64)
    # Patch k is (block_row, block_col, in_row, in_col) with 2x2 blocks.
    order = [(br * 2 + ir, bc * 2 + ic) for br in range(8) for bc in range(8) for ir in range(2) for ic in range(2)]
    assert levels.tolist() == [int(levels_grid[row, col]) for row, col in order]


# ---------------------------------------------------------------- smart_resize


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 12000), st.integers(1, 12000))
def test_smart_resize_matches_processor_rule(height, width):
    module = pytest.importorskip("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl")
    if max(height, width) / min(height, width) > 200:
        with pytest.raises(ImageError, match="aspect ratio"):
            smart_resize(height, width)
        return
    assert smart_resize(height, width) == module.smart_resize(height, width, 32, 256 * 256, 4096 * 4096)


def test_smart_resize_token_table():
    assert smart_resize(1080, 1920) == (68 * 16, 120 * 16)
    assert smart_resize(5000, 5000) == (4096, 4096)
    assert smart_resize(32, 32) == (256, 256)


# ---------------------------------------------------------------- colour management

BRADFORD = np.array([[0.8951, 0.2664, -0.1614], [-0.7502, 1.7135, 0.0367], [0.0389, -0.0685, 1.0296]])
D50 = np.array([0.9642, 1.0, 0.8249])
D65_XY = (0.3127, 0.3290)
SRGB_PRIMARIES = [(0.64, 0.33), (0.30, 0.60), (0.15, 0.06)]
ADOBE_PRIMARIES = [(0.64, 0.33), (0.21, 0.71), (0.15, 0.06)]
P3_PRIMARIES = [(0.680, 0.320), (0.265, 0.690), (0.150, 0.060)]


def s15fixed16(value: float) -> bytes:
    return struct.pack(">i", round(value * 65536))


def xyz_of(x: float, y: float) -> np.ndarray:
    return np.array([x / y, 1.0, (1 - x - y) / y])


def rgb_to_xyz(primaries) -> np.ndarray:
    """Linear RGB -> XYZ (D65 white) from chromaticities."""
    columns = np.stack([xyz_of(x, y) for x, y in primaries], axis=1)
    return columns * np.linalg.solve(columns, xyz_of(*D65_XY))


def decode_srgb(v: np.ndarray) -> np.ndarray:
    return np.where(v <= 0.04045, v / 12.92, ((v + 0.055) / 1.055) ** 2.4)


def encode_srgb(v: np.ndarray) -> np.ndarray:
    return np.where(v <= 0.0031308, v * 12.92, 1.055 * v ** (1 / 2.4) - 0.055)


def xyz_tag(v) -> bytes:
    return b"XYZ \0\0\0\0" + b"".join(s15fixed16(c) for c in v)


def icc_profile(colour_space: bytes, tags: list[tuple[bytes, bytes]]) -> bytes:
    """A minimal ICC v4 display profile (D50 PCS) holding `tags` plus a description and the white point."""
    text = "a3b test profile".encode("utf-16-be")
    desc = b"mluc\0\0\0\0" + struct.pack(">II", 1, 12) + b"enUS" + struct.pack(">II", len(text), 28) + text
    tags = [(b"desc", desc), (b"wtpt", xyz_tag(D50)), *tags]
    data_start = 128 + 4 + 12 * len(tags)
    table, data = b"", b""
    for name, body in tags:
        body += b"\0" * (-len(body) % 4)
        table += name + struct.pack(">II", data_start + len(data), len(body))
        data += body
    header = (
        struct.pack(">I", data_start + len(data)) + b"\0" * 4 + struct.pack(">I", 0x04300000)
        + b"mntr" + colour_space + b"XYZ " + b"\0" * 12 + b"acsp" + b"\0" * 28
        + b"".join(s15fixed16(c) for c in D50) + b"\0" * 48
    )
    assert len(header) == 128
    return header + struct.pack(">I", len(tags)) + table + data


def matrix_trc_profile(primaries, trc_tag: bytes) -> bytes:
    """An RGB matrix/TRC profile: D50-adapted colorants (Bradford) and one tone curve for all channels."""
    cone = BRADFORD @ xyz_of(*D65_XY)
    adapt = np.linalg.inv(BRADFORD) @ np.diag((BRADFORD @ D50) / cone) @ BRADFORD
    colorants = adapt @ rgb_to_xyz(primaries)
    tags = [(name, xyz_tag(colorants[:, i])) for i, name in enumerate((b"rXYZ", b"gXYZ", b"bXYZ"))]
    tags += [(name, trc_tag) for name in (b"rTRC", b"gTRC", b"bTRC")]
    return icc_profile(b"RGB ", tags)


def gamma_curve(gamma: float) -> bytes:
    return b"curv\0\0\0\0" + struct.pack(">IH", 1, round(gamma * 256))


ADOBE_GAMMA = 563 / 256  # Adobe RGB (1998) tone curve, u8Fixed8
ADOBE_RGB_ICC = matrix_trc_profile(ADOBE_PRIMARIES, gamma_curve(ADOBE_GAMMA))
SRGB_CURVE = (2.4, 1 / 1.055, 0.055 / 1.055, 1 / 12.92, 0.04045)
DISPLAY_P3_ICC = matrix_trc_profile(
    P3_PRIMARIES, b"para\0\0\0\0" + struct.pack(">HH", 3, 0) + b"".join(s15fixed16(v) for v in SRGB_CURVE)
)
PROPHOTO_PRIMARIES = [(0.7347, 0.2653), (0.1596, 0.8404), (0.0366, 0.0001)]
PROPHOTO_GAMMA = 1.8


def prophoto_rgb_icc() -> bytes:
    """ProPhoto RGB (ROMM RGB), a wide-gamut photo-editing space: a matrix/TRC profile whose white is D50, the profile
    connection space's own, so its colorants need no chromatic adaptation."""
    columns = np.stack([xyz_of(x, y) for x, y in PROPHOTO_PRIMARIES], axis=1)
    colorants = columns * np.linalg.solve(columns, D50)
    tags = [(name, xyz_tag(colorants[:, i])) for i, name in enumerate((b"rXYZ", b"gXYZ", b"bXYZ"))]
    tags += [(name, gamma_curve(PROPHOTO_GAMMA)) for name in (b"rTRC", b"gTRC", b"bTRC")]
    return icc_profile(b"RGB ", tags)


COLOUR_CASES = {
    "adobe_rgb": (ADOBE_RGB_ICC, ADOBE_PRIMARIES, lambda v: v**ADOBE_GAMMA),
    "display_p3": (DISPLAY_P3_ICC, P3_PRIMARIES, decode_srgb),
}
SATURATED = (200, 60, 40)


def swatch_image() -> Image.Image:
    colours = [SATURATED, (40, 160, 220), (128, 128, 128), (250, 240, 20)]
    img = Image.new("RGB", (32, 32))
    for i, colour in enumerate(colours):
        img.paste(colour, (16 * (i % 2), 16 * (i // 2), 16 * (i % 2) + 16, 16 * (i // 2) + 16))
    return img


@pytest.mark.parametrize("case", sorted(COLOUR_CASES))
def test_tagged_png_converts_to_srgb(tmp_path, case):
    icc, primaries, decode = COLOUR_CASES[case]
    path = tmp_path / f"{case}.png"
    swatch_image().save(path, icc_profile=icc)
    loaded = pixels(load_image(path))
    untagged = pixels(load_image(path, srgb=False))

    source = ImageCms.ImageCmsProfile(io.BytesIO(icc))
    srgb = ImageCms.createProfile("sRGB")
    reference = pixels(ImageCms.profileToProfile(swatch_image(), source, srgb, outputMode="RGB"))
    assert np.abs(loaded - reference).max() <= 1

    # Independent of LittleCMS: source linear -> XYZ -> sRGB linear -> encode.
    to_srgb = np.linalg.inv(rgb_to_xyz(SRGB_PRIMARIES)) @ rgb_to_xyz(primaries)
    linear = decode(untagged / 255.0) @ to_srgb.T
    analytic = np.round(encode_srgb(np.clip(linear, 0, 1)) * 255)
    assert np.abs(loaded - analytic).max() <= 2

    # The saturated swatch must clearly move away from the untagged reading.
    assert np.abs(loaded[0, 0] - np.array(SATURATED)).max() >= 10
    assert tuple(untagged[0, 0]) == SATURATED


@pytest.mark.parametrize("case", sorted(COLOUR_CASES))
def test_tagged_jpeg_converts_to_srgb(tmp_path, case):
    icc = COLOUR_CASES[case][0]
    path = tmp_path / f"{case}.jpg"
    swatch_image().save(path, quality=95, icc_profile=icc)
    decoded = load_image(path, srgb=False)  # the JPEG's own pixels, read as if untagged
    source = ImageCms.ImageCmsProfile(io.BytesIO(icc))
    reference = ImageCms.profileToProfile(decoded, source, ImageCms.createProfile("sRGB"), outputMode="RGB")
    loaded = pixels(load_image(path))
    assert np.abs(loaded - pixels(reference)).max() <= 1
    assert np.abs(loaded[0, 0] - pixels(decoded)[0, 0]).max() >= 10


def test_tagged_greyscale_converts_to_srgb(tmp_path):
    path = tmp_path / "linear_grey.png"
    Image.fromarray(np.array([[0, 50, 128, 255]], dtype=np.uint8)).save(
        path, icc_profile=icc_profile(b"GRAY", [(b"kTRC", gamma_curve(1.0))])
    )
    loaded = pixels(load_image(path))[0]
    expected = np.round(encode_srgb(np.array([0, 50, 128, 255]) / 255.0) * 255)
    assert np.abs(loaded - expected[:, None]).max() <= 2
    assert (loaded[:, 0] == loaded[:, 1]).all() and (loaded[:, 0] == loaded[:, 2]).all()


def test_broken_profile_warns_and_keeps_pixels(tmp_path):
    path = tmp_path / "broken_profile.png"
    swatch_image().save(path, icc_profile=b"not an ICC profile at all" * 8)
    with pytest.warns(UserWarning, match="broken_profile.png.*ICC"):
        loaded = load_image(path)
    assert np.array_equal(pixels(loaded), pixels(swatch_image()))


def test_srgb_option_switches_the_profile_conversion(tmp_path):
    path = tmp_path / "prophoto.png"
    swatch_image().save(path, icc_profile=prophoto_rgb_icc())
    stored, _ = preprocess(swatch_image())
    as_stored, _ = preprocess(path, srgb=False)
    as_srgb, _ = preprocess(path, srgb=True)
    assert torch.equal(as_stored, stored)
    assert (as_srgb - as_stored).abs().max() > 0.1


def test_untagged_image_is_unchanged(tmp_path):
    path = tmp_path / "plain.png"
    swatch_image().save(path)
    assert np.array_equal(pixels(load_image(path)), pixels(swatch_image()))


# ---------------------------------------------------------------- modes and sources


def test_exif_orientation_6_rotates(tmp_path):
    img = Image.new("RGB", (40, 20), (255, 0, 0))
    img.paste((0, 0, 255), (20, 0, 40, 20))  # stored: left red, right blue
    exif = Image.Exif()
    exif[0x0112] = 6  # display = rotate 90 degrees clockwise
    path = tmp_path / "rotated.png"
    img.save(path, exif=exif)
    loaded = load_image(path)
    assert loaded.size == (20, 40)
    assert loaded.getpixel((10, 5)) == (255, 0, 0)  # the left edge is now on top
    assert loaded.getpixel((10, 35)) == (0, 0, 255)


def test_rgba_alpha_composites_over_background(tmp_path):
    rgba = np.zeros((2, 3, 4), dtype=np.uint8)
    rgba[:, :, 0] = 255
    rgba[:, :, 3] = [0, 255, 128]
    path = tmp_path / "alpha.png"
    Image.fromarray(rgba).save(path)
    loaded = load_image(path, background=(0, 0, 255))
    assert loaded.mode == "RGB"
    assert loaded.getpixel((0, 0)) == (0, 0, 255)
    assert loaded.getpixel((1, 0)) == (255, 0, 0)
    r, g, b = loaded.getpixel((2, 0))
    assert abs(r - 128) <= 1 and g == 0 and abs(b - 127) <= 1
    assert load_image(path).getpixel((0, 0)) == (255, 255, 255)  # default background is white


@pytest.mark.parametrize("background", [(0, 0, 0), (255, 255, 255), (30, 200, 90)])
def test_background_option_sets_the_composite_under_partial_alpha(background):
    """Half-transparent red: the patches are red blended with `background` (within the one step of 8-bit rounding)."""
    rgba = np.zeros((64, 64, 4), dtype=np.uint8)
    rgba[..., 0], rgba[..., 3] = 255, 128
    alpha = 128 / 255
    expected = np.round(np.array([255, 0, 0]) * alpha + np.array(background) * (1 - alpha)).astype(np.uint8)
    patches, _ = preprocess(rgba, size=64, background=background)
    reference, _ = preprocess(np.broadcast_to(expected, (64, 64, 3)).copy(), size=64)
    assert (patches - reference).abs().max() <= 2 / 255 + 1e-6  # one 8-bit step after (x - 0.5) / 0.5


def test_premultiplied_grey_alpha_is_composited():
    """PIL's "La" stores luminance premultiplied by alpha: 100 at alpha 128 is a grey of 199 half covering."""
    la = Image.new("La", (2, 2), (100, 128))
    assert abs(load_image(la, background=(0, 0, 0)).getpixel((0, 0))[0] - 100) <= 1
    assert abs(load_image(la).getpixel((0, 0))[0] - (100 + 127)) <= 1


def test_la_greyscale_with_alpha(tmp_path):
    la = np.array([[[0, 0], [0, 255], [200, 255]]], dtype=np.uint8)
    path = tmp_path / "la.png"
    Image.fromarray(la, mode="LA").save(path)
    loaded = load_image(path)
    assert [loaded.getpixel((x, 0)) for x in range(3)] == [(255, 255, 255), (0, 0, 0), (200, 200, 200)]


def test_palette_with_transparency(tmp_path):
    img = Image.new("P", (2, 1))
    img.putpalette([255, 0, 0, 0, 255, 0] + [0] * 762)
    img.putpixel((1, 0), 1)
    path = tmp_path / "palette.png"
    img.save(path, transparency=1)
    loaded = load_image(path, background=(10, 20, 30))
    assert loaded.getpixel((0, 0)) == (255, 0, 0)
    assert loaded.getpixel((1, 0)) == (10, 20, 30)


def test_16_bit_greyscale_png_is_scaled_not_clipped(tmp_path):
    path = tmp_path / "grey16.png"
    Image.fromarray(np.array([[0, 257 * 128, 65535]], dtype=np.uint16)).save(path)
    with Image.open(path) as stored:
        assert stored.mode in ("I;16", "I")
    loaded = load_image(path)
    assert [loaded.getpixel((x, 0)) for x in range(3)] == [(0, 0, 0), (128, 128, 128), (255, 255, 255)]


def test_cmyk_jpeg(tmp_path):
    img = Image.new("CMYK", (48, 16), (0, 255, 255, 0))  # magenta + yellow = red
    img.paste((0, 0, 0, 255), (16, 0, 32, 16))  # black
    img.paste((0, 0, 0, 0), (32, 0, 48, 16))  # white
    path = tmp_path / "cmyk.jpg"
    img.save(path, quality=95)
    loaded = pixels(load_image(path))
    for x, expected in ((8, (255, 0, 0)), (24, (0, 0, 0)), (40, (255, 255, 255))):
        assert np.abs(loaded[8, x] - np.array(expected)).max() <= 12


def test_one_bit_image(tmp_path):
    img = Image.new("1", (2, 1))
    img.putpixel((1, 0), 1)
    path = tmp_path / "bits.png"
    img.save(path)
    loaded = load_image(path)
    assert [loaded.getpixel((x, 0)) for x in range(2)] == [(0, 0, 0), (255, 255, 255)]


def test_animated_gif_uses_first_frame(tmp_path):
    frames = [Image.new("RGB", (8, 8), colour) for colour in ((255, 0, 0), (0, 0, 255))]
    path = tmp_path / "anim.gif"
    frames[0].save(path, save_all=True, append_images=frames[1:], duration=100, loop=0)
    with Image.open(path) as stored:
        assert stored.n_frames == 2
    assert load_image(path).getpixel((4, 4)) == (255, 0, 0)


def test_comfyui_batch_tensor_round_trips_exactly():
    rng = np.random.default_rng(1)
    uint8 = rng.integers(0, 256, (2, 5, 7, 3), dtype=np.uint8)
    batch = torch.from_numpy(uint8).float() / 255.0  # how ComfyUI's LoadImage builds IMAGE
    images = [load_image(item) for item in split_batch(batch)]
    assert len(images) == 2
    for img, expected in zip(images, uint8):
        assert img.mode == "RGB" and img.size == (7, 5)
        assert np.array_equal(np.asarray(img), expected)


def test_numpy_inputs():
    grey = np.array([[0, 128, 255]], dtype=np.uint8)
    assert load_image(grey).getpixel((1, 0)) == (128, 128, 128)
    assert load_image(grey[:, :, None]).getpixel((2, 0)) == (255, 255, 255)
    floats = np.array([[[1.0, 0.5, 0.0]]], dtype=np.float32)
    assert load_image(floats).getpixel((0, 0)) == (255, 128, 0)
    assert load_image(np.array([[[1.5, -0.2, 0.0]]])).getpixel((0, 0)) == (255, 0, 0)  # clipped to 0..1
    wide = np.array([[[65535, 257 * 100, 0]]], dtype=np.uint16)
    assert load_image(wide).getpixel((0, 0)) == (255, 100, 0)
    rgba = np.array([[[255, 0, 0, 0]]], dtype=np.uint8)
    assert load_image(rgba, background=(1, 2, 3)).getpixel((0, 0)) == (1, 2, 3)
    assert load_image(torch.tensor([[[0.0, 1.0, 0.0]]])).getpixel((0, 0)) == (0, 255, 0)


def test_mixed_list_is_split_into_single_images(tmp_path):
    path = tmp_path / "a.png"
    Image.new("RGB", (3, 3), (1, 2, 3)).save(path)
    items = split_batch([path, str(path), Image.new("L", (2, 2), 9), np.zeros((2, 4, 4, 3), np.uint8)])
    assert [load_image(item).size for item in items] == [(3, 3), (3, 3), (2, 2), (4, 4), (4, 4)]
    assert len(split_batch(Image.new("RGB", (2, 2)))) == 1
    grids = [grid for _, grid in preprocess_images(items, mode="native")]
    assert grids == [(1, 16, 16)] * 5


# ---------------------------------------------------------------- resize modes


def test_resize_mode_sizes():
    img = noise_image(300, 200)
    assert resize_image(img, 384, "stretch").size == (384, 384)
    assert resize_image(img, 256, "letterbox").size == (256, 256)
    assert resize_image(img, 416, "crop").size == (416, 416)
    height, width = smart_resize(200, 300)
    assert resize_image(img, 384, "native").size == (width, height) == (320, 224)
    assert to_patches(resize_image(img, 384, "native"))[1] == (1, 14, 20)


def test_letterbox_pads_with_fill():
    out = pixels(resize_image(Image.new("RGB", (400, 200), (255, 255, 255)), 384, "letterbox", fill=(9, 8, 7)))
    assert (out[:90] == (9, 8, 7)).all() and (out[-90:] == (9, 8, 7)).all()
    assert (out[100:284] == 255).all()


def test_crop_keeps_the_centre():
    img = Image.new("RGB", (600, 200), (255, 0, 0))
    img.paste((0, 255, 0), (200, 0, 400, 200))  # green centre square, red sides
    out = pixels(resize_image(img, 384, "crop"))
    assert (out[:, 2:-2] == (0, 255, 0)).all()
    # Bicubic reads a few source pixels past the cut, so only the outermost columns pick up a little red.
    assert (out[:, :, 1] > 4 * out[:, :, 0]).all()


def test_bad_resize_arguments():
    img = noise_image(10, 10)
    with pytest.raises(ImageError, match="stretch, letterbox, crop, native"):
        resize_image(img, 384, "zoom")
    with pytest.raises(ImageError, match="384 or 416"):
        resize_image(img, 400)
    with pytest.raises(ImageError, match="multiple of 32"):
        resize_image(img, 0)
    assert set(RESIZE_MODES) == {"stretch", "letterbox", "crop", "native"}


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("side", [12000, 20000])  # above our limit; also above PIL's own hard limit
def test_image_over_max_input_pixels(tmp_path, side):
    assert side * side > MAX_INPUT_PIXELS
    path = tmp_path / f"huge_{side}.png"
    path.write_bytes(png_header_only(side, side))
    with pytest.raises(ImageError, match="downscale") as info:
        load_image(path)
    assert str(path) in str(info.value)


def test_array_over_max_input_pixels_is_refused():
    huge = np.broadcast_to(np.zeros((1, 1), dtype=np.uint8), (12000, 12000))  # no memory behind it
    with pytest.raises(ImageError, match=r"\(12000, 12000\)"):
        load_image(huge)


def test_truncated_jpeg_is_an_error(tmp_path):
    assert ImageFile.LOAD_TRUNCATED_IMAGES is False
    data = io.BytesIO()
    noise_image(64, 64).save(data, format="JPEG")
    path = tmp_path / "cut.jpg"
    path.write_bytes(data.getvalue()[: len(data.getvalue()) // 2])
    with pytest.raises(ImageError, match="truncated") as info:
        load_image(path)
    assert str(path) in str(info.value)
    with Image.open(path) as lazy, pytest.raises(ImageError, match="PIL image.*truncated"):
        load_image(lazy)  # opened by the caller, decoded by us


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [("notes.png", b"just some text, not pixels", "not an image"), ("missing.png", None, "does not exist")],
)
def test_unreadable_files(tmp_path, name, content, message):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ImageError, match=message) as info:
        load_image(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("array", "message"),
    [
        (np.zeros((0, 5, 3), dtype=np.uint8), "degenerate"),
        (np.zeros((3, 8, 8), dtype=np.uint8), "HxWx3"),
        (np.zeros((4, 4, 3), dtype=np.int64), "dtype"),
        (np.full((4, 4), np.nan, dtype=np.float32), "NaN"),
    ],
)
def test_bad_arrays(array, message):
    with pytest.raises(ImageError, match=message) as info:
        load_image(array)
    assert str(tuple(array.shape)) in str(info.value)


def test_batch_error_names_the_image():
    good = np.zeros((4, 4, 3), dtype=np.uint8)
    with pytest.raises(ImageError, match="Image 2 of 2"):
        list(preprocess_images([good, np.zeros((0, 4, 3), dtype=np.uint8)]))
    with pytest.raises(ImageError, match="Image 4 of 5: .*aspect ratio"):  # a per-image resize error too
        list(preprocess_images([good] * 3 + [np.zeros((2, 900, 3), np.uint8), good], mode="native"))
    with pytest.raises(ImageError, match="No images"):
        list(preprocess_images([]))
    with pytest.raises(ImageError, match="not an image"):
        load_image(42)


def test_extreme_aspect_ratio_in_native_mode():
    with pytest.raises(ImageError, match="aspect ratio"):
        resize_image(Image.new("RGB", (2010, 10)), mode="native")


# ---------------------------------------------------------------- hostile files and bounded decoding


def test_postscript_is_refused_and_no_program_runs(tmp_path):
    """EPS bytes, in a file named .png or given as bytes, are not in a format the pack reads; Pillow's EPS plugin
    would run Ghostscript. Checked in a child process whose PATH finds a stand-in gs first (Pillow looks for gs
    once per process), which leaves a marker if anything runs it."""
    env, marker = fake_ghostscript(tmp_path)
    path = tmp_path / "drawing.png"
    path.write_bytes(EPS)
    script = f"""
from pathlib import Path
from a3b_core.errors import ImageError
from a3b_core.media.image import load_image, load_resized
path = Path({str(path)!r})
for load in (lambda: load_image(path), lambda: load_image(path.read_bytes()), lambda: load_resized(path)):
    try:
        load()
    except ImageError as exc:
        print(exc)
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    refusals = done.stdout.splitlines()
    assert len(refusals) == 3 and all("not an image in a format the pack reads" in line for line in refusals)
    assert str(path) in refusals[0] and f"image data of {len(EPS)} bytes" in refusals[1]
    assert not marker.exists()


def test_image_bytes_load_as_their_file_does(tmp_path):
    path = tmp_path / "photo.jpg"
    noise_image(64, 48).save(path, quality=90)
    assert np.array_equal(pixels(load_image(path.read_bytes())), pixels(load_image(path)))


@pytest.mark.parametrize(("mode", "size"), [("stretch", 384), ("letterbox", 256), ("crop", 416), ("native", 384)])
def test_an_image_the_model_takes_whole_is_decoded_whole(tmp_path, mode, size):
    """Below SHRINK_ABOVE_PIXELS, load_resized is exactly resize_image of load_image (the processor's pixels)."""
    path = tmp_path / "photo.jpg"
    noise_image(2000, 1500).save(path, quality=90)
    assert 2000 * 1500 <= SHRINK_ABOVE_PIXELS
    assert np.array_equal(pixels(load_resized(path, size, mode)), pixels(resize_image(load_image(path), size, mode)))


def test_a_huge_turned_file_gets_the_size_and_orientation_the_whole_image_would_get(tmp_path):
    """A 9000x3000 JPEG (above SHRINK_ABOVE_PIXELS) stored sideways (EXIF orientation 6) is shrunk while decoding,
    and still comes out upright at the native size of the whole upright image."""
    img = Image.new("RGB", (9000, 3000), (255, 0, 0))
    img.paste((0, 0, 255), (4500, 0, 9000, 3000))  # stored: left red, right blue
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "sideways.jpg"
    img.save(path, quality=90, exif=exif)
    assert 9000 * 3000 > SHRINK_ABOVE_PIXELS
    loaded = load_resized(path, mode="native")
    assert loaded.size == native_size(3000, 9000) == resize_image(load_image(path), mode="native").size
    top, bottom = pixels(loaded)[10, 10], pixels(loaded)[-10, 10]
    assert top[0] > 240 > top[2] and bottom[2] > 240 > bottom[0]  # the stored left edge is on top


def test_a_huge_jpeg_is_decoded_at_a_fraction_of_its_size(tmp_path):
    """An 8000x8000 JPEG resized to 384x384 is scaled down while it is decoded (by 8, JPEG's DCT scaling): loading it
    raises a child process's peak memory by far less than its 192 MB of RGB pixels (measured: 9 MiB, where
    load_image's whole decode raises it by 490 MiB)."""
    path = tmp_path / "huge.jpg"
    Image.new("RGB", (8000, 8000), (200, 30, 30)).save(path, quality=90)
    growth = child_peak_growth(f"""
from a3b_core.media.image import load_resized
# measure
assert load_resized({str(path)!r}, 384, "stretch").size == (384, 384)
""")
    assert growth < 8000 * 8000 * 3 / 8, f"loading grew the peak by {growth / 2**20:.0f} MiB"


def test_a_float_image_of_a_comfyui_batch_is_converted_with_one_float_copy():
    """ComfyUI's IMAGE is float32 [B, H, W, C]; each image becomes 8-bit with one float copy of that image at a time
    (tracemalloc sees numpy's buffers), never copies of the batch."""
    batch = torch.rand(4, 512, 512, 3)
    one_image = 512 * 512 * 3 * 4
    tracemalloc.start()
    try:
        load_image(split_batch(batch)[0])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1.6 * one_image, f"peak {peak / one_image:.2f} images"


def test_float_video_frames_are_converted_a_frame_at_a_time():
    """Frames from ComfyUI (float32 [T, H, W, C], 96 MiB here) become uint8 without float copies of the whole clip:
    the child process's peak grows by little more than the uint8 result (a quarter of the floats, where whole-clip
    float copies would add twice the floats)."""
    floats = 32 * 512 * 512 * 3 * 4
    growth = child_peak_growth("""
import torch
from a3b_core.media.video import as_uint8_frames
frames = torch.rand(32, 512, 512, 3)
# measure
assert as_uint8_frames(frames, "clip").dtype == torch.uint8
""")
    assert growth < 0.6 * floats, f"converting grew the peak by {growth / 2**20:.0f} MiB"
