"""Image-token cost per model family (grid, fixed, tiled) and its route configuration."""

from __future__ import annotations

import base64
import struct
import zlib

import pytest

from kvroute.config import ConfigError, parse_config
from kvroute.core.tokens import (
    IMAGE_PRESETS,
    EstimateConfig,
    ImageCost,
    estimate_request,
    image_tokens_for_size,
)


def png(width: int, height: int) -> str:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    data = (b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + chunk
            + struct.pack(">I", zlib.crc32(chunk)))
    return "data:image/png;base64," + base64.b64encode(data).decode()


def test_the_default_grid_is_qwen_vl_as_before() -> None:
    for size in ((100, 60), (1024, 1024), (10, 10), (20000, 20000)):
        assert ImageCost().tokens_for(*size) == image_tokens_for_size(*size)
    assert ImageCost().tokens_for(1024, 1024) == 37 * 37 + 2


def test_fixed_and_tiled_families() -> None:
    assert IMAGE_PRESETS["llava-1.5"].tokens_for(4000, 3000) == 576
    assert IMAGE_PRESETS["gemma-3"].tokens_for(64, 64) == 258
    internvl = IMAGE_PRESETS["internvl"]
    assert internvl.tokens_for(448, 448) == 256 + 2              # one tile, no thumbnail
    assert internvl.tokens_for(896, 448) == (2 + 1) * 256 + 2    # 2x1 tiles + thumbnail
    assert internvl.tokens_for(1344, 896) == (6 + 1) * 256 + 2   # 3x2
    assert internvl.tokens_for(10000, 10) == (12 + 1) * 256 + 2  # widest grid within 12
    with pytest.raises(ValueError, match="image family"):
        ImageCost("mosaic")
    with pytest.raises(ValueError, match="tokens_per_tile"):
        ImageCost("tiled", tokens_per_tile=0)


def test_the_estimate_uses_the_routes_family() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is this"},
        {"type": "image_url", "image_url": {"url": png(896, 448)}}]}]}
    grid = estimate_request(body)
    tiled = estimate_request(body, config=EstimateConfig(image_cost=IMAGE_PRESETS["internvl"]))
    assert tiled.low - grid.low == ((2 + 1) * 256 + 2) - (32 * 16 + 2)


def config(image_tokens: object) -> object:
    return parse_config({
        "pools": {"p": {"model": "m", "replicas": [{"name": "r", "url": "http://127.0.0.1:1"}]}},
        "routes": {"vl": {"pools": ["p"], "image_tokens": image_tokens}},
    }, env={})


def test_routes_configure_a_preset_or_their_own_rule() -> None:
    cfg = config({"family": "internvl", "max_tiles": 6})
    assert cfg.routes["vl"].image_tokens == ImageCost(  # type: ignore[attr-defined]
        "tiled", tile_px=448, tokens_per_tile=256, max_tiles=6, marker_tokens=2)
    cfg = config({"family": "fixed", "tokens": 729})
    assert cfg.routes["vl"].image_tokens.tokens_for(5, 5) == 729 + 2  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="is not an image family"):
        config({"family": "qwen"})
    with pytest.raises(ConfigError, match="tile_pixels"):
        config({"family": "tiled", "tile_pixels": 448})
    with pytest.raises(ConfigError, match="not a valid image cost"):
        config({"family": "grid", "patch_px": 0})
