"""Image pipeline: any image in -> sRGB 8-bit RGB PIL image -> resized -> normalized pixel patches.

`preprocess` is that path for one image and `preprocess_images` for a batch; the engine encodes every image through
them, so their options (resize mode, ICC conversion, background) are the ones that act.

Image files (paths or their bytes) are opened only by `open_image`: Pillow restricted to OPEN_FORMATS, whose decoders
run in-process (never EPS, for which Pillow starts Ghostscript), the size read from the header and checked before any
pixel is decoded. `load_resized` decodes a file no larger than its resize needs (JPEG's DCT scaling, Image.reduce).

The patch step reproduces the model's image processor (Qwen2VLImageProcessor with the release's
preprocessor_config.json) bit for bit: smart_resize to multiples of 32, PIL bicubic resize on uint8, x/255 in float64
then float32, (x - mean) / std, block-major patches with the single frame duplicated to temporal_patch_size.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from PIL import ExifTags, Image, ImageCms, ImageOps, UnidentifiedImageError

from ..errors import ImageError

RESIZE_MODES = ("stretch", "letterbox", "crop", "native")  # how a picture meets the size the model takes
MAX_INPUT_PIXELS = 8192 * 8192 * 2  # decompression-bomb guard for decoded inputs
# Pillow formats an image file may be in: each decoded in-process by Pillow or the libraries it bundles. EPS is not
# one (Pillow runs Ghostscript for it), nor any other format whose plugin may start a program.
OPEN_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF", "PPM", "TGA")
# Modes Image.reduce averages correctly (not palette indices, nor a mode with a transparent key colour).
_REDUCIBLE_MODES = ("L", "LA", "RGB", "RGBA", "CMYK", "I", "F")
_SWAPPING_ORIENTATIONS = (5, 6, 7, 8)  # EXIF orientations that turn the image by 90 degrees
# The real preprocessor_config.json: size.shortest_edge / size.longest_edge (pixel counts, not edges).
PROCESSOR_MIN_PIXELS = 256 * 256
PROCESSOR_MAX_PIXELS = 4096 * 4096
MAX_ASPECT_RATIO = 200
# Image files of more pixels than the model ever takes are decoded shrunk (see load_resized); smaller ones are decoded
# whole, so their pixels are exactly the image processor's.
SHRINK_ABOVE_PIXELS = PROCESSOR_MAX_PIXELS
WHITE = (255, 255, 255)

_SRGB_PROFILE = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB"))
# Which ICC colour space each working mode needs for its embedded profile to apply.
_ICC_SPACE_FOR_MODE = {"RGB": "RGB ", "RGBA": "RGB ", "CMYK": "CMYK", "L": "GRAY"}
_ICC_OUTPUT_MODE = {"RGB": "RGB", "RGBA": "RGBA", "CMYK": "RGB", "L": "RGB"}


def _describe(src: Any) -> str:
    """A short name for an input, for error messages."""
    if isinstance(src, (str, os.PathLike)):
        return f"image file '{os.fspath(src)}'"
    if isinstance(src, (bytes, bytearray)):
        return f"image data of {len(src):,} bytes"
    if isinstance(src, Image.Image):
        return f"PIL image (mode {src.mode}, {src.width}x{src.height})"
    if isinstance(src, (np.ndarray, torch.Tensor)):
        return f"{type(src).__name__} of shape {tuple(src.shape)} and dtype {src.dtype}"
    return f"input of type {type(src).__name__}"


def _check_pixel_count(width: int, height: int, name: str) -> None:
    if width <= 0 or height <= 0:
        raise ImageError(f"{name} has a degenerate size {width}x{height}; give an image with at least 1x1 pixels.")
    if width * height > MAX_INPUT_PIXELS:
        raise ImageError(
            f"{name} is {width}x{height} = {width * height:,} pixels, more than the limit of {MAX_INPUT_PIXELS:,} "
            "(a guard against decompression bombs); downscale it before loading."
        )


def _decode_pixels(img: Image.Image, name: str) -> None:
    """Force PIL's lazy decoding now, so truncated or corrupt data fails here with a clear message."""
    try:
        img.load()
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageError(f"{name} is truncated or corrupt ({e}); re-export or re-download the file.") from e


def open_image(src: str | os.PathLike | bytes, name: str) -> Image.Image:
    """An image file (a path, or the file's bytes) opened lazily: its format one of OPEN_FORMATS and its size, read
    from the header, within MAX_INPUT_PIXELS. No pixel is decoded yet; the caller closes it."""
    if not isinstance(src, (bytes, bytearray)) and not os.path.isfile(src):  # a FIFO or device would block the read
        raise ImageError(f"{name} does not exist or is not a file; check the path.")
    try:
        # Our own MAX_INPUT_PIXELS guard replaces PIL's warning; PIL's hard error above 2x its limit is kept.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(src) if isinstance(src, (bytes, bytearray)) else src, formats=OPEN_FORMATS)
    except Image.DecompressionBombError as e:
        raise ImageError(
            f"{name} has more pixels than the limit of {MAX_INPUT_PIXELS:,} ({e}); downscale it before loading."
        ) from e
    except UnidentifiedImageError as e:
        raise ImageError(f"{name} is not an image in a format the pack reads ({', '.join(OPEN_FORMATS)}); save it "
                         "as PNG or JPEG.") from e
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        raise ImageError(f"{name} cannot be read ({e}); check the file and its permissions.") from e
    with contextlib.ExitStack() as close_on_error:
        close_on_error.callback(img.close)
        _check_pixel_count(img.width, img.height, name)
        close_on_error.pop_all()
    return img


def _decode(img: Image.Image, name: str, shrink: tuple[int, str, int] | None) -> tuple[Image.Image, tuple[int, int]]:
    """An opened file's first frame decoded and turned upright (EXIF orientation), and its upright size before any
    shrinking. With `shrink` (size, mode, max_pixels: the resize_image call to follow) it is shrunk by the largest
    whole factor that keeps at least the pixels that resize makes along each side: a JPEG while it is decoded (its
    DCT scaling), then any image by Image.reduce."""
    width, height = img.size
    img.seek(0)
    if shrink is not None and (factor := _shrink_factor(width, height, *shrink)) > 1:
        img.draft(img.mode, (-(-width // factor), -(-height // factor)))  # only JPEG's decoder acts on it
    _decode_pixels(img, name)
    upright = (height, width) if img.getexif().get(ExifTags.Base.Orientation) in _SWAPPING_ORIENTATIONS \
        else (width, height)
    ImageOps.exif_transpose(img, in_place=True)
    if shrink is None or (factor := _shrink_factor(img.width, img.height, *shrink)) == 1:
        return img, upright
    if img.mode == "1":
        img = img.convert("L")  # one byte per pixel either way, and reducible
    if img.mode not in _REDUCIBLE_MODES or "transparency" in img.info:
        img = _working_mode(img, name)
    return img.reduce(factor), upright


def _shrink_factor(width: int, height: int, size: int, mode: str, max_pixels: int) -> int:
    """The largest whole factor an image of width x height may shrink by before resize_image(size, mode, max_pixels)
    and keep at least the pixels that resize makes along each side. The same for either orientation."""
    if mode == "native":
        kept_width, kept_height = native_size(width, height, max_pixels)
        ratio = min(width / kept_width, height / kept_height)
    elif mode == "letterbox":  # the longer side fits `size`
        ratio = max(width, height) / size
    else:  # stretch and crop: both sides cover `size`
        ratio = min(width, height) / size
    return max(1, int(ratio))


def _array_to_pil(arr: np.ndarray, name: str) -> Image.Image:
    """HxW, HxWx1, HxWx3 or HxWx4 array of uint8, uint16, bool or float 0..1 -> L / RGB / RGBA PIL image."""
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[:, :, 0]
    if not (arr.ndim == 2 or (arr.ndim == 3 and arr.shape[2] in (3, 4))):
        raise ImageError(
            f"{name} is not an image array; expected HxW, HxWx1, HxWx3 or HxWx4 (channels last). "
            "For a batch [B,H,W,C] use split_batch() or preprocess_images()."
        )
    _check_pixel_count(arr.shape[1], arr.shape[0], name)
    if arr.dtype == np.uint8:
        pixels = arr
    elif arr.dtype == np.uint16:
        pixels = np.round(arr / 257.0).astype(np.uint8)
    elif arr.dtype == np.bool_:
        pixels = arr.astype(np.uint8) * 255
    elif np.issubdtype(arr.dtype, np.floating):
        if not np.isfinite(arr).all():
            raise ImageError(f"{name} contains NaN or infinite values; give finite values in 0..1.")
        # One float32 copy, scaled in place (the array may be a view of the caller's batch). Round (not truncate) so
        # that k/255 floats from ComfyUI come back as exactly k.
        scaled = np.clip(arr, 0.0, 1.0, out=np.empty(arr.shape, np.float32))
        scaled *= 255.0
        pixels = np.round(scaled, out=scaled).astype(np.uint8)
    else:
        raise ImageError(f"{name} has an unsupported dtype; use uint8, uint16, bool or float in 0..1.")
    return Image.fromarray(np.ascontiguousarray(pixels))


def _working_mode(img: Image.Image, name: str) -> Image.Image:
    """Bring any PIL mode to one of L, RGB, RGBA, CMYK (8 bits per channel)."""
    if img.mode == "I" or img.mode.startswith("I;16"):
        # PIL's convert("L") would clip 16-bit values at 255 instead of scaling them.
        return _array_to_pil(np.clip(np.asarray(img), 0, 65535).astype(np.uint16), name)
    if img.mode == "La":  # luminance premultiplied by alpha: PIL reaches RGBA from it only through LA
        img = img.convert("LA")
    has_alpha = any(band in ("A", "a") for band in img.getbands()) or "transparency" in img.info
    if has_alpha:
        return img.convert("RGBA")
    if img.mode in ("L", "RGB", "CMYK"):
        return img
    return img.convert("RGB")  # palette, 1-bit, YCbCr, LAB, HSV, float


def _to_srgb(img: Image.Image, icc: bytes | None, name: str) -> Image.Image:
    """Convert from the embedded ICC profile to sRGB; untagged images are taken as sRGB already."""
    if not icc or img.mode not in _ICC_SPACE_FOR_MODE:
        return img
    try:
        profile = ImageCms.ImageCmsProfile(io.BytesIO(icc))
        if profile.profile.xcolor_space != _ICC_SPACE_FOR_MODE[img.mode]:
            return img  # e.g. an RGB profile left on a greyscale file: it cannot describe these pixels
        return ImageCms.profileToProfile(img, profile, _SRGB_PROFILE, outputMode=_ICC_OUTPUT_MODE[img.mode])
    except (ImageCms.PyCMSError, OSError) as e:
        # Browsers also fall back to sRGB for a broken profile; say so instead of failing.
        warnings.warn(f"{name}: embedded ICC profile is unusable ({e}); treating the pixels as sRGB.")
        return img


def _normalize(given: Image.Image, icc: bytes | None, background: tuple[int, int, int], srgb: bool,
               name: str) -> Image.Image:
    """An upright image in any mode -> a new 8-bit RGB image, converted to sRGB from `icc` (its embedded profile) when
    `srgb`. Each step makes at most one new image (they can be large)."""
    img = _working_mode(given, name)
    if srgb:
        img = _to_srgb(img, icc, name)
    if img.mode == "RGBA":
        backdrop = Image.new("RGBA", img.size, (*background, 255))
        backdrop.alpha_composite(img)
        img = backdrop
    return img.convert("RGB") if img is given or img.mode != "RGB" else img


def _check_background(background: Any) -> None:
    if (not isinstance(background, (tuple, list)) or len(background) != 3
            or not all(isinstance(c, int) and not isinstance(c, bool) and 0 <= c <= 255 for c in background)):
        raise ImageError(f"background {background!r} is not a colour; give three integers 0..255, such as "
                         "(255, 255, 255) for white.")


def load_image(src: Any, *, background: tuple[int, int, int] = WHITE, srgb: bool = True) -> Image.Image:
    """Any supported input -> 8-bit RGB PIL image (EXIF orientation applied, alpha over `background`), converted to
    sRGB from its embedded ICC profile when `srgb` (else the stored values are taken as sRGB).

    `src`: an image file (its path, or its bytes), a PIL image, a numpy array (HxW or HxWx1/3/4; uint8, uint16, bool or
    float 0..1) or a torch tensor [H,W,C] (float 0..1 or uint8). Animated files give their first frame (a PIL image:
    its current frame).
    """
    _check_background(background)
    name = _describe(src)
    if isinstance(src, (str, os.PathLike, bytes, bytearray)):
        with open_image(src, name) as img:
            icc = img.info.get("icc_profile")
            return _normalize(_decode(img, name, None)[0], icc, background, srgb, name)
    if isinstance(src, Image.Image):
        _check_pixel_count(src.width, src.height, name)
        _decode_pixels(src, name)
        return _normalize(ImageOps.exif_transpose(src), src.info.get("icc_profile"), background, srgb, name)
    if isinstance(src, torch.Tensor):
        tensor = src.detach().cpu()
        src = tensor.float().numpy() if tensor.is_floating_point() else tensor.numpy()
    if isinstance(src, np.ndarray):
        return _normalize(_array_to_pil(src, name), None, background, srgb, name)
    raise ImageError(f"{name} is not an image; give a file path, PIL image, numpy array or torch tensor.")


def load_resized(src: Any, size: int = 384, mode: str = "stretch", max_pixels: int = PROCESSOR_MAX_PIXELS, *,
                 background: tuple[int, int, int] = WHITE, srgb: bool = True) -> Image.Image:
    """resize_image(load_image(src), size, mode, max_pixels=max_pixels), except that an image file of more than
    SHRINK_ABOVE_PIXELS pixels is decoded shrunk to no less than the resize makes (see _decode), so such a file is
    never converted at full size, and a JPEG never even decoded at full size. "native" keeps the size the whole image
    would get."""
    _check_resize(size, mode)
    if not isinstance(src, (str, os.PathLike, bytes, bytearray)):
        return resize_image(load_image(src, background=background, srgb=srgb), size, mode, max_pixels=max_pixels)
    _check_background(background)
    name = _describe(src)
    with open_image(src, name) as img:
        icc = img.info.get("icc_profile")
        huge = img.width * img.height > SHRINK_ABOVE_PIXELS
        decoded, upright = _decode(img, name, (size, mode, max_pixels) if huge else None)
        rgb = _normalize(decoded, icc, background, srgb, name)
    if mode == "native":
        return rgb.resize(native_size(*upright, max_pixels), Image.Resampling.BICUBIC)
    return resize_image(rgb, size, mode)


def split_batch(images: Any) -> list[Any]:
    """One image, a list of images, or [B,H,W,C] batches (ComfyUI IMAGE) -> a list of single images, as given."""
    items = list(images) if isinstance(images, (list, tuple)) else [images]
    flat: list[Any] = []
    for item in items:
        if isinstance(item, (np.ndarray, torch.Tensor)) and item.ndim == 4:
            flat.extend(item[i] for i in range(item.shape[0]))
        else:
            flat.append(item)
    if not flat:
        raise ImageError("No images were given (empty list or empty batch); connect at least one image.")
    return flat


def smart_resize(
    height: int,
    width: int,
    factor: int = 32,
    min_pixels: int = PROCESSOR_MIN_PIXELS,
    max_pixels: int = PROCESSOR_MAX_PIXELS,
) -> tuple[int, int]:
    """(height, width) rounded to multiples of `factor` with the pixel count kept in [min_pixels, max_pixels]."""
    if height <= 0 or width <= 0:
        raise ImageError(f"Image size {width}x{height} is degenerate; give an image with at least 1x1 pixels.")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise ImageError(
            f"Image size {width}x{height} has an aspect ratio above {MAX_ASPECT_RATIO}, which the vision encoder "
            "cannot take; crop it or use resize mode 'stretch', 'letterbox' or 'crop'."
        )
    # Python's round() (half to even) on purpose: it is what the processor uses.
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def native_size(width: int, height: int, max_pixels: int = PROCESSOR_MAX_PIXELS) -> tuple[int, int]:
    """(width, height) resize mode "native" gives an image of width x height: smart_resize within `max_pixels`."""
    kept_height, kept_width = smart_resize(height, width, max_pixels=min(max_pixels, PROCESSOR_MAX_PIXELS))
    return kept_width, kept_height


def _check_resize(size: int, mode: str) -> None:
    if mode not in RESIZE_MODES:
        raise ImageError(f"Unknown resize mode {mode!r}; use one of {', '.join(RESIZE_MODES)}.")
    if mode == "native":
        return
    if not isinstance(size, int) or size <= 0 or size % 32:
        lower = max(32, size // 32 * 32) if isinstance(size, int) else 384
        raise ImageError(f"Image size {size!r} is not a positive multiple of 32; use e.g. {lower} or {lower + 32}.")
    largest = math.isqrt(PROCESSOR_MAX_PIXELS) // 32 * 32
    if size > largest:
        raise ImageError(f"Image size {size} is above the model's limit of {largest}x{largest} pixels; use {largest} "
                         "or less (384 is 144 tokens per image).")


def resize_image(
    img: Image.Image, size: int = 384, mode: str = "stretch", fill: tuple[int, int, int] = (0, 0, 0),
    max_pixels: int = PROCESSOR_MAX_PIXELS
) -> Image.Image:
    """Resize with PIL bicubic: stretch to size x size, letterbox (fit and pad with `fill`), crop (cover and
    centre-crop) or native (smart_resize of the original size within `max_pixels`; `size` is ignored)."""
    _check_resize(size, mode)
    if mode == "native":
        return img.resize(native_size(img.width, img.height, max_pixels), Image.Resampling.BICUBIC)
    if mode == "stretch":
        return img.resize((size, size), Image.Resampling.BICUBIC)
    if mode == "letterbox":
        return ImageOps.pad(img, (size, size), method=Image.Resampling.BICUBIC, color=tuple(fill))
    return ImageOps.fit(img, (size, size), method=Image.Resampling.BICUBIC, centering=(0.5, 0.5))


def to_patches(
    img: Image.Image,
    patch_size: int = 16,
    temporal_patch_size: int = 2,
    merge_size: int = 2,
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5),
    std: tuple[float, float, float] = (0.5, 0.5, 0.5),
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """RGB image -> (pixel_values float32 [gh*gw, 3*T*p*p], grid (1, gh, gw)), identical to the processor output.

    Sides that are not valid are first brought there by smart_resize + bicubic, as the processor does; anything
    but an RGB PIL image goes through load_image first.
    """
    if not isinstance(img, Image.Image) or img.mode != "RGB":
        img = load_image(img)
    factor = patch_size * merge_size
    height, width = smart_resize(img.height, img.width, factor)
    if (height, width) != (img.height, img.width):
        img = img.resize((width, height), Image.Resampling.BICUBIC)
    # Same arithmetic and dtypes as the processor: rescale in float64, then normalize in float32.
    scaled = (np.asarray(img, dtype=np.uint8).astype(np.float64) * (1 / 255)).astype(np.float32)
    mean_t, std_t = torch.tensor(mean, dtype=torch.float32), torch.tensor(std, dtype=torch.float32)
    normed = (torch.from_numpy(scaled) - mean_t) / std_t
    grid_h, grid_w = height // patch_size, width // patch_size
    hwc = normed.reshape(grid_h // merge_size, merge_size, patch_size, grid_w // merge_size, merge_size, patch_size, 3)
    # -> (block_row, block_col, in_row, in_col, C, ph, pw): the block-major order the merger relies on, permuted
    # straight from HWC (no CHW copy first).
    blocks = hwc.permute(0, 3, 1, 4, 6, 2, 5).contiguous().view(grid_h * grid_w, 3, 1, patch_size * patch_size)
    frames = blocks.expand(-1, -1, temporal_patch_size, -1)  # each patch repeated as T identical frames
    pixel_values = frames.reshape(grid_h * grid_w, 3 * temporal_patch_size * patch_size * patch_size)
    return pixel_values, (1, grid_h, grid_w)


def preprocess(
    src: Any,
    size: int = 384,
    mode: str = "stretch",
    srgb: bool = True,
    background: tuple[int, int, int] = WHITE,
    patch_size: int = 16,
    temporal_patch_size: int = 2,
    merge_size: int = 2,
    max_pixels: int = PROCESSOR_MAX_PIXELS,
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """One image -> (pixel_values, grid): load_resized -> to_patches."""
    img = load_resized(src, size, mode, max_pixels, background=background, srgb=srgb)
    return to_patches(img, patch_size, temporal_patch_size, merge_size)


def preprocess_images(
    images: Any,
    size: int = 384,
    mode: str = "stretch",
    srgb: bool = True,
    background: tuple[int, int, int] = WHITE,
    patch_size: int = 16,
    temporal_patch_size: int = 2,
    merge_size: int = 2,
) -> Iterator[tuple[torch.Tensor, tuple[int, int, int]]]:
    """split_batch(images), each image through preprocess in turn; an error names the image's place in the batch."""
    _check_background(background)
    items = split_batch(images)
    for index, item in enumerate(items):
        try:
            patches = preprocess(item, size, mode, srgb, background, patch_size, temporal_patch_size, merge_size)
        except ImageError as e:
            raise ImageError(f"Image {index + 1} of {len(items)}: {e}") from e
        yield patches
