"""Token estimation: exact numbers for every counted part, and the session start point."""

from __future__ import annotations

import base64
import json
import struct
import zlib
from typing import Any

import pytest

from kvroute.core.tokens import (
    MESSAGE_OVERHEAD_TOKENS,
    REPLY_PRIMING_TOKENS,
    TOOLS_PREAMBLE_TOKENS,
    EstimateConfig,
    EstimateSource,
    MalformedBodyError,
    TokenEstimate,
    estimate_request,
    from_session,
    image_size,
    image_tokens_for_size,
)

CHAT_FIXED = REPLY_PRIMING_TOKENS + MESSAGE_OVERHEAD_TOKENS  # one message: 3 + 5


# --- factories ---------------------------------------------------------------------------------


def png_bytes(width: int, height: int) -> bytes:
    """A real (tiny-header) PNG: signature + IHDR chunk with its CRC."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = b"IHDR" + ihdr
    return (b"\x89PNG\r\n\x1a\n" + struct.pack(">I", len(ihdr)) + chunk
            + struct.pack(">I", zlib.crc32(chunk)))  # fmt: skip


def gif_bytes(width: int, height: int) -> bytes:
    return b"GIF89a" + struct.pack("<HH", width, height) + b"\x00\x00\x00"


def jpeg_bytes(width: int, height: int) -> bytes:
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    exif = b"\xff\xe1" + struct.pack(">H", 2 + 3000) + b"\x00" * 3000  # pushes SOF far out
    sof0 = b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, height, width, 1) + b"\x01\x11\x00"
    return b"\xff\xd8" + app0 + exif + sof0 + b"\xff\xd9"


def webp_vp8x(width: int, height: int) -> bytes:
    payload = b"\x00\x00\x00\x00" + (width - 1).to_bytes(3, "little") + (
        height - 1).to_bytes(3, "little")  # fmt: skip
    return b"RIFF" + struct.pack("<I", 4 + 8 + len(payload)) + b"WEBP" + b"VP8X" + struct.pack(
        "<I", len(payload)) + payload  # fmt: skip


def webp_vp8l(width: int, height: int) -> bytes:
    bits = (width - 1) | ((height - 1) << 14)
    payload = b"\x2f" + bits.to_bytes(4, "little")
    return b"RIFF" + struct.pack("<I", 0) + b"WEBP" + b"VP8L" + struct.pack(
        "<I", len(payload)) + payload  # fmt: skip


def webp_vp8(width: int, height: int) -> bytes:
    payload = b"\x00\x00\x00" + b"\x9d\x01\x2a" + struct.pack("<HH", width, height)
    return b"RIFF" + struct.pack("<I", 0) + b"WEBP" + b"VP8 " + struct.pack(
        "<I", len(payload)) + payload  # fmt: skip


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def wav_bytes(seconds: float, sample_rate: int = 16_000) -> bytes:
    byte_rate = sample_rate * 2
    data_len = int(seconds * byte_rate)
    header = (b"RIFF" + struct.pack("<I", 36 + data_len) + b"WAVE" + b"fmt "
              + struct.pack("<IHHIIHH", 16, 1, 1, sample_rate, byte_rate, 2, 16)
              + b"data" + struct.pack("<I", data_len))  # fmt: skip
    return header + b"\x00" * data_len


def user(content: Any) -> dict[str, Any]:
    return {"role": "user", "content": content}


def chat(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": list(messages), **extra}


# --- text and framing --------------------------------------------------------------------------


def test_text_message_bounds_are_bytes_over_4_and_3_plus_framing() -> None:
    est = estimate_request(chat(user("a" * 400)))
    assert est == TokenEstimate(low=100 + CHAT_FIXED, high=134 + CHAT_FIXED, chars=400)
    assert est.source is EstimateSource.HEURISTIC
    assert not est.exact


def test_per_message_overhead_and_reply_priming() -> None:
    body = chat(*[{"role": "system", "content": None}] * 4)
    est = estimate_request(body)
    assert (est.low, est.high) == (4 * 5 + 3, 4 * 5 + 3)


def test_text_parts_name_and_tool_calls_are_counted() -> None:
    call = {"id": "c1", "type": "function",
            "function": {"name": "get", "arguments": '{"q": "x"}'}}  # fmt: skip
    body = chat(
        user([{"type": "text", "text": "abcd"}, {"type": "input_text", "text": "efgh"}]),
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "name": "get", "content": "ok"},
    )
    est = estimate_request(body)
    chars = 8 + len("get") + len('{"q": "x"}') + len("c1") + len("get") + len("ok")
    fixed = 3 + 3 * 5 + 10
    assert est.chars == chars
    assert (est.low, est.high) == (chars // 4 + fixed, -(-chars // 3) + fixed)


def test_non_ascii_text_counts_utf8_bytes() -> None:
    est = estimate_request(chat(user("日本語")))  # 9 UTF-8 bytes: ~1 token per character
    assert est.chars == 9
    assert est.high == 3 + CHAT_FIXED


def test_unknown_part_type_counts_as_its_json() -> None:
    part = {"type": "file", "file": {"file_id": "f-123"}}
    est = estimate_request(chat(user([part])))
    assert est.chars == len(json.dumps(part))


# --- tools -------------------------------------------------------------------------------------


def test_tool_schemas_count_as_json_plus_preamble() -> None:
    tool = {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}  # fmt: skip
    est = estimate_request(chat(user(""), tools=[tool, tool]))
    tool_chars = 2 * len(json.dumps(tool))
    assert est.chars == tool_chars
    assert est.tool_tokens == -(-tool_chars // 3) + TOOLS_PREAMBLE_TOKENS
    assert est.high == -(-tool_chars // 3) + TOOLS_PREAMBLE_TOKENS + CHAT_FIXED
    assert estimate_request(chat(user(""), tools=[])).tool_tokens == 0


# --- messages or prompt ------------------------------------------------------------------------


def test_messages_or_prompt_never_both() -> None:
    body = {"model": "m", "messages": [user("a" * 40)], "prompt": "b" * 4000}
    assert estimate_request(body, endpoint="chat").chars == 40
    assert estimate_request(body).chars == 40  # messages present → chat
    assert estimate_request(body, endpoint="completions").chars == 4000


def test_prompt_forms() -> None:
    assert estimate_request({"prompt": "a" * 12}) == TokenEstimate(low=4, high=5, chars=12)
    ids = estimate_request({"prompt": [5, 6, 7, 8]})
    assert (ids.low, ids.high, ids.source) == (4, 4, EstimateSource.TOKEN_IDS)
    batch = estimate_request({"prompt": [[1, 2], [1, 2, 3, 4, 5]]})
    assert (batch.low, batch.high, batch.exact) == (5, 5, True)
    texts = estimate_request({"prompt": ["a" * 8, "b" * 300, "c"]})
    assert texts.chars == 300  # a batch fits when its largest prompt does


@pytest.mark.parametrize(
    "body",
    [{"prompt": [1, "a"]}, {"prompt": []}, {"prompt": 3}, {"messages": "hi"},
     {"messages": ["hi"]}, {"messages": [user(3)]}, {"messages": [user("a")], "tools": {}},
     {"messages": [user(["x"])]}],
)
def test_malformed_bodies_raise_one_error_type(body: dict[str, Any]) -> None:
    with pytest.raises(MalformedBodyError, match="must be"):
        estimate_request(body)


# --- images and audio --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "size"),
    [(png_bytes(100, 60), (100, 60)), (gif_bytes(640, 480), (640, 480)),
     (jpeg_bytes(1920, 1080), (1920, 1080)), (webp_vp8x(3000, 2000), (3000, 2000)),
     (webp_vp8l(300, 200), (300, 200)), (webp_vp8(512, 384), (512, 384)),
     (b"not an image", None), (b"\xff\xd8\xff\xd9", None)],
)
def test_image_headers(raw: bytes, size: tuple[int, int] | None) -> None:
    assert image_size(raw) == size


def test_image_token_rule() -> None:
    assert image_tokens_for_size(100, 60) == 4 * 3 + 2
    assert image_tokens_for_size(28, 28) == 4 + 2  # min_pixels: at least 4 tokens
    assert image_tokens_for_size(1024, 1024) == 37 * 37 + 2
    assert image_tokens_for_size(20_000, 20_000) == 16_384 + 2  # max_pixels
    with pytest.raises(ValueError, match="positive size"):
        image_tokens_for_size(0, 10)


def test_data_url_png_is_sized_from_its_header() -> None:
    part = {"type": "image_url", "image_url": {"url": data_url(png_bytes(100, 60))}}
    est = estimate_request(chat(user([part, {"type": "text", "text": "abcd"}])))
    assert (est.image_tokens, est.num_media_guessed, est.chars) == (14, 0, 4)
    assert (est.low, est.high) == (1 + 14 + CHAT_FIXED, 2 + 14 + CHAT_FIXED)


def test_jpeg_with_large_exif_block_is_found() -> None:
    part = {"type": "image_url", "image_url": {"url": data_url(jpeg_bytes(56, 56), "image/jpeg")}}
    assert estimate_request(chat(user([part]))).image_tokens == 6


def test_remote_and_unreadable_images_use_the_configured_default_visibly() -> None:
    config = EstimateConfig(default_image_size=(280, 280))
    parts = [
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@@"}},
        {"type": "image_url", "image_url": {"url": data_url(b"garbage")}},
        {"type": "input_image", "image_url": data_url(gif_bytes(28, 56))},
    ]
    est = estimate_request(chat(user(parts)), config=config)
    assert est.num_media_guessed == 3
    assert est.image_tokens == 3 * (100 + 2) + (4 + 2)


def test_audio_duration_from_wav_header_else_byte_rate() -> None:
    wav = base64.b64encode(wav_bytes(2.0)).decode()
    part = {"type": "input_audio", "input_audio": {"data": wav, "format": "wav"}}
    est = estimate_request(chat(user([part])))
    assert (est.audio_tokens, est.num_media_guessed) == (50, 0)
    mp3 = base64.b64encode(b"\x00" * 16_000).decode()  # one second at 128 kbit/s
    part = {"type": "input_audio", "input_audio": {"data": mp3, "format": "mp3"}}
    est = estimate_request(chat(user([part])))
    assert (est.audio_tokens, est.num_media_guessed) == (25, 1)


def test_video_counts_the_configured_default() -> None:
    part = {"type": "video_url", "video_url": {"url": "https://example.com/v.mp4"}}
    est = estimate_request(chat(user([part])), config=EstimateConfig(default_video_tokens=777))
    assert (est.image_tokens, est.num_media_guessed) == (777, 1)


# --- session start point -----------------------------------------------------------------------


def test_from_session_adds_only_new_messages_and_not_the_reply_twice() -> None:
    history = [user("a" * 4000)]
    body = chat(*history, {"role": "assistant", "content": "b" * 800}, user("c" * 400))
    est = from_session(1000, 200, 1, body)
    # base 1200 exact; the reply adds its framing only; the new user turn 400 chars + framing
    assert est == TokenEstimate(low=1200 + 5 + 100 + 5, high=1200 + 5 + 134 + 5, chars=400,
                                source=EstimateSource.SESSION)  # fmt: skip


def test_from_session_falls_back_when_the_base_cannot_be_trusted() -> None:
    body = chat(user("a" * 400))
    full = estimate_request(body)
    assert from_session(5000, 100, 3, body) == full  # history got shorter (compacted)
    assert from_session(5000, 100, 0, body) == full  # no previous request
    prompt = {"model": "m", "prompt": "x" * 30}
    assert from_session(5000, 100, 1, prompt) == estimate_request(prompt)
    with pytest.raises(ValueError, match="negative"):
        from_session(-1, 0, 1, body)


def test_exact_count_and_band_invariant() -> None:
    est = TokenEstimate.exact_count(12_289)
    assert (est.low, est.high, est.exact, est.source) == (12_289, 12_289, True,
                                                           EstimateSource.TOKENIZER)
    with pytest.raises(ValueError, match="low <= high"):
        TokenEstimate(low=5, high=4)
    with pytest.raises(ValueError, match="negative"):
        TokenEstimate.exact_count(-1)
