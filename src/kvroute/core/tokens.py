"""Token counts for a request without a network call: estimates with a declared bias.

Owns :func:`estimate_request` (a parsed OpenAI body → :class:`TokenEstimate`),
:func:`from_session` (start from the session's last reported ``usage`` and add only what is
new) and :meth:`TokenEstimate.exact_count` (a count from ``/tokenize`` or a local tokenizer).
Pure: imports no I/O module and never reads the clock or the environment
(``tests/unit/test_layering.py``); ``wire/`` is not imported either, so the body arrives as
the plain decoded JSON mapping.

Why two numbers and not one: the router makes two decisions with opposite costs.

* Leaving the fast tier for a slow one costs every interactive turn seconds of latency, so
  it is decided on the **under-estimate** ``low`` (text bytes / 4): a borderline turn stays
  fast, and the reactive path catches the rare miss.
* Clamping ``max_tokens`` protects the output budget, so it uses the **over-estimate**
  ``high`` (text bytes / 3), which never under-counted English, code or JSON in the measured
  corpora (worst -0.1 % on digit-heavy JSON) while chars/4 was off by -25 % to +19 %.

What is counted, mirroring what the engine's chat template renders:

* ``messages`` **or** ``prompt``, never both: the one the endpoint forwards (chat →
  ``messages``, completions → ``prompt``); a stray field of the other kind is ignored, as
  the engine ignores it.
* Text: string contents, ``text``/``input_text``/``output_text``/``refusal`` parts, the
  message ``name``, ``tool_call_id``, and assistant ``tool_calls`` (function name + raw
  ``arguments``). Earlier turns' ``reasoning_content`` is not counted: current templates
  drop it from history.
* **Per-message overhead** ``MESSAGE_OVERHEAD_TOKENS = 5``: ChatML
  (``<|im_start|>role\\n … <|im_end|>\\n``) and Llama-3 headers both cost about five tokens a
  message; plus ``REPLY_PRIMING_TOKENS = 3`` once for the generation prompt, and
  ``TOOL_CALL_OVERHEAD_TOKENS = 10`` per assistant tool call (``<tool_call>{"name": …,
  "arguments": …}</tool_call>`` framing).
* ``tools``: each schema as its JSON text (``json.dumps`` with the default separators, as
  the templates' ``tojson`` renders it), plus ``TOOLS_PREAMBLE_TOKENS = 90`` once (Qwen /
  Hermes templates add ~87 tokens of instructions around ``<tools></tools>``). Counting a
  TypeScript-like rendering, as LiteLLM does, under-counts the real prompt by ~24 %.
* **Images**, by the route's ``ImageCost`` (default Qwen-VL's grid): *grid* families emit
  one visual token per ``patch_px`` square (Qwen-VL: 28×28 pixels, i.e. ``H*W/784`` after
  each side is rounded *up* to the grid, clamped to 4..16,384 tokens, plus 2 vision
  start/end markers); *fixed* families emit the same count whatever the size (an encoder at
  one resolution: LLaVA-1.5's 576, Gemma 3's 256); *tiled* families cut the image into
  ``tile_px`` tiles (the grid of at most ``max_tiles`` whose aspect ratio is closest to the
  image's) at ``tokens_per_tile`` each, plus one thumbnail tile when there are several
  (InternVL: 448-px tiles of 256 tokens, up to 12). Sizes are read from the
  PNG, JPEG, GIF or WebP header inside a base64 ``data:`` URL; a remote URL (or an
  undecodable image) is sized as ``EstimateConfig.default_image_size`` and counted in
  ``num_media_guessed`` so the guess is visible.
* **Audio** (``input_audio``): 25 tokens per second (Whisper-style encoders pooled to 25 Hz),
  the duration read from a WAV header, else the payload size at 16 kB/s (128 kbit/s).
  Video parts count ``EstimateConfig.default_video_tokens`` and are always a guess.
* Any other part type counts as its JSON text, so nothing is free by accident.
* ``prompt``: a string (+1 BOS token), a list of strings, token ids (exact), or a list of
  token-id lists. A list is a *batch*: each prompt must fit the window on its own, so the
  estimate is that of the largest prompt.

"Chars" are UTF-8 bytes. For ASCII text that is the character count; a CJK character is
three bytes, so ``high`` counts it as about one token where code points / 3 would count a
third of one and under-count CJK prompts threefold.
"""

from __future__ import annotations

import base64
import binascii
import enum
import json
import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from kvroute.core.errors import RouterError

__all__ = [
    "AUDIO_TOKENS_PER_S",
    "DEFAULT_ESTIMATE_CONFIG",
    "IMAGE_FAMILIES",
    "IMAGE_PATCH_PX",
    "IMAGE_PRESETS",
    "MESSAGE_OVERHEAD_TOKENS",
    "REPLY_PRIMING_TOKENS",
    "TOOLS_PREAMBLE_TOKENS",
    "TOOL_CALL_OVERHEAD_TOKENS",
    "EstimateConfig",
    "EstimateSource",
    "ImageCost",
    "MalformedBodyError",
    "TokenEstimate",
    "estimate_request",
    "from_session",
    "image_size",
    "image_tokens_for_size",
]

MESSAGE_OVERHEAD_TOKENS: Final = 5
"""Chat framing per message (role header and end-of-turn marker), ChatML and Llama-3 alike."""
REPLY_PRIMING_TOKENS: Final = 3
"""The generation prompt (``<|im_start|>assistant\\n``) added once to every chat request."""
TOOL_CALL_OVERHEAD_TOKENS: Final = 10
"""Framing of one assistant tool call around its name and arguments."""
TOOLS_PREAMBLE_TOKENS: Final = 90
"""The instructions a Qwen/Hermes template wraps around the tool schemas (~87 tokens)."""
PROMPT_BOS_TOKENS: Final = 1
"""A text prompt gets a BOS token; a token-id prompt is sent as is."""
IMAGE_PATCH_PX: Final = 28
"""Qwen-VL merges 14-px patches 2×2: one visual token per 28×28 pixels."""
IMAGE_MIN_TOKENS: Final = 4
"""``min_pixels = 56*56`` in the Qwen2-VL processor."""
IMAGE_MAX_TOKENS: Final = 16_384
"""``max_pixels = 12845056 = 16384 * 28 * 28`` in the Qwen2/2.5-VL processor config."""
IMAGE_MARKER_TOKENS: Final = 2
"""``<|vision_start|>`` and ``<|vision_end|>`` around each image."""
AUDIO_TOKENS_PER_S: Final = 25
"""Whisper-style audio encoders emit 50 frames/s, pooled by 2."""
AUDIO_FALLBACK_BYTES_PER_S: Final = 16_000
"""Duration of a compressed (non-WAV) clip, assumed 128 kbit/s."""
_HEADER_SCAN_BYTES: Final = 1 << 20
"""At most this much of a base64 payload is decoded to find an image size (JPEG EXIF blocks
can push the frame header past the first 64 KiB)."""


class MalformedBodyError(RouterError, ValueError):
    """A request body has a shape the estimator cannot count (wrong JSON types).

    ``wire.openai.parse_request`` rejects such bodies first, so the shell only meets this
    when it estimates a body it did not validate.
    """


class EstimateSource(enum.StrEnum):
    """Where the numbers of a :class:`TokenEstimate` come from."""

    HEURISTIC = "heuristic"
    """Bytes / 4 and bytes / 3 over the whole body, plus the fixed parts."""
    SESSION = "session"
    """The session's last reported ``usage`` plus a heuristic for the new messages."""
    TOKEN_IDS = "token_ids"
    """The prompt was sent as token ids: exact."""
    TOKENIZER = "tokenizer"
    """Counted by the engine's ``/tokenize`` or a local tokenizer: exact."""


IMAGE_FAMILIES: Final = ("grid", "fixed", "tiled")


@dataclass(frozen=True, slots=True)
class ImageCost:
    """How many prompt tokens one image costs a model family (module docstring, "Images").

    Attributes:
        family: ``grid`` (tokens per pixel patch), ``fixed`` (one count per image) or
            ``tiled`` (tokens per tile of a tile grid).
        patch_px / min_tokens / max_tokens: a grid family's patch side and its clamp.
        marker_tokens: tokens around each image (start/end markers), every family.
        tokens: a fixed family's count.
        tile_px / tokens_per_tile / max_tiles / thumbnail: a tiled family's tile side, its
            tokens, the most tiles, and whether a thumbnail tile is added to several.

    Raises:
        ValueError: an unknown family or a value below 1 (0 for ``marker_tokens``).
    """

    family: str = "grid"
    patch_px: int = IMAGE_PATCH_PX
    min_tokens: int = IMAGE_MIN_TOKENS
    max_tokens: int = IMAGE_MAX_TOKENS
    marker_tokens: int = IMAGE_MARKER_TOKENS
    tokens: int = 576
    tile_px: int = 448
    tokens_per_tile: int = 256
    max_tiles: int = 12
    thumbnail: bool = True

    def __post_init__(self) -> None:
        if self.family not in IMAGE_FAMILIES:
            raise ValueError(f"image family {self.family!r} is not one of "
                             f"{', '.join(IMAGE_FAMILIES)}")
        for name in ("patch_px", "min_tokens", "max_tokens", "tokens", "tile_px",
                     "tokens_per_tile", "max_tiles"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"image cost {name} must be an int >= 1, got {value!r}")
        if self.marker_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(f"image cost needs marker_tokens >= 0 and min_tokens <= "
                             f"max_tokens, got {self.marker_tokens}, {self.min_tokens}, "
                             f"{self.max_tokens}")

    def tokens_for(self, width: int, height: int) -> int:
        """Prompt tokens of a ``width`` × ``height`` image for this family.

        Raises:
            ValueError: a size below 1.
        """
        if width < 1 or height < 1:
            raise ValueError(f"an image needs a positive size, got {width}x{height}")
        if self.family == "fixed":
            return self.tokens + self.marker_tokens
        if self.family == "grid":
            patches = math.ceil(width / self.patch_px) * math.ceil(height / self.patch_px)
            return min(max(patches, self.min_tokens), self.max_tokens) + self.marker_tokens
        cols, rows = _tile_grid(width, height, self.tile_px, self.max_tiles)
        tiles = cols * rows + (1 if self.thumbnail and cols * rows > 1 else 0)
        return tiles * self.tokens_per_tile + self.marker_tokens


IMAGE_PRESETS: Final[dict[str, ImageCost]] = {
    "qwen-vl": ImageCost("grid"),
    "llava-1.5": ImageCost("fixed", tokens=576, marker_tokens=0),
    "gemma-3": ImageCost("fixed", tokens=256, marker_tokens=2),
    "internvl": ImageCost("tiled", tile_px=448, tokens_per_tile=256, max_tiles=12,
                          marker_tokens=2),
}
"""Named families (``routes.<name>.image_tokens: {family: <preset>}``). Counts from the
models' processor configurations as published; not checked against engines here."""


def _tile_grid(width: int, height: int, tile_px: int, max_tiles: int) -> tuple[int, int]:
    """InternVL-style dynamic tiling: the (cols, rows) grid of at most ``max_tiles`` tiles
    whose aspect ratio is closest to the image's; on a tie, the larger grid when the image
    has the pixels to fill it."""
    aspect = width / height
    best = (1, 1)
    best_diff = math.inf
    for n in range(1, max_tiles + 1):
        for cols in range(1, n + 1):
            if n % cols:
                continue
            rows = n // cols
            diff = abs(aspect - cols / rows)
            if diff < best_diff or (
                    diff == best_diff and width * height > 0.5 * tile_px * tile_px * n):
                best, best_diff = (cols, rows), diff
    return best


@dataclass(frozen=True, slots=True)
class EstimateConfig:
    """Sizes the estimator cannot read from the body (configured per route, defaults here).

    Attributes:
        default_image_size: (width, height) assumed for a remote image URL or an image whose
            header cannot be read.
        default_video_tokens: tokens assumed for one video part.
        image_cost: the model family's image-token rule.
    """

    default_image_size: tuple[int, int] = (1024, 1024)
    default_video_tokens: int = 4096
    image_cost: ImageCost = ImageCost()


DEFAULT_ESTIMATE_CONFIG: Final = EstimateConfig()


@dataclass(frozen=True, slots=True)
class TokenEstimate:
    """An estimated prompt length as a band ``low <= high``, with its parts.

    Invariants: ``0 <= low <= high``; ``low == high`` exactly when the count is exact
    (``source`` is ``TOKEN_IDS`` or ``TOKENIZER``, or a body whose every part is exact);
    ``low = chars // 4 + fixed`` and ``high = ceil(chars / 3) + fixed`` where ``fixed`` is the
    sum of the exact parts (overheads, media tokens, token ids) — for a ``SESSION`` estimate,
    plus the base from the session's usage.

    Attributes:
        low: under-estimate, for deciding to leave the fast tier.
        high: over-estimate, for clamping the output budget.
        chars: UTF-8 bytes of text counted heuristically (tool schemas included).
        image_tokens: visual tokens of images and videos (in both bounds).
        audio_tokens: tokens of audio parts (in both bounds).
        tool_tokens: the tools' share of ``high`` (schemas / 3 + preamble); informational.
        source: where the numbers come from.
        num_media_guessed: images, audio or video parts sized by a default, not their header.
    """

    low: int
    high: int
    chars: int = 0
    image_tokens: int = 0
    audio_tokens: int = 0
    tool_tokens: int = 0
    source: EstimateSource = EstimateSource.HEURISTIC
    num_media_guessed: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.low <= self.high:
            raise ValueError(
                f"a token estimate needs 0 <= low <= high, got low={self.low} high={self.high}"
            )

    @property
    def exact(self) -> bool:
        """True when the band has width zero (the count is known)."""
        return self.low == self.high

    @classmethod
    def exact_count(
        cls, num_tokens: int, source: EstimateSource = EstimateSource.TOKENIZER
    ) -> TokenEstimate:
        """An exact count, e.g. ``/tokenize``'s ``count``."""
        if num_tokens < 0:
            raise ValueError(f"a token count cannot be negative, got {num_tokens}")
        return cls(low=num_tokens, high=num_tokens, source=source)


# --- accumulation ------------------------------------------------------------------------------


@dataclass(slots=True)
class _Tally:
    chars: int = 0
    fixed: int = 0
    image_tokens: int = 0
    audio_tokens: int = 0
    tool_chars: int = 0
    tool_fixed: int = 0
    num_media_guessed: int = 0

    def text(self, value: str) -> None:
        self.chars += len(value) if value.isascii() else len(value.encode("utf-8"))

    def estimate(self, source: EstimateSource, base: int = 0) -> TokenEstimate:
        fixed = base + self.fixed + self.image_tokens + self.audio_tokens
        tool_tokens = math.ceil(self.tool_chars / 3) + self.tool_fixed if self.tool_fixed else 0
        return TokenEstimate(
            low=self.chars // 4 + fixed,
            high=math.ceil(self.chars / 3) + fixed,
            chars=self.chars,
            image_tokens=self.image_tokens,
            audio_tokens=self.audio_tokens,
            tool_tokens=tool_tokens,
            source=source,
            num_media_guessed=self.num_media_guessed,
        )


def _json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def _bad(where: str, expected: str, value: Any) -> MalformedBodyError:
    return MalformedBodyError(
        f"{where} must be {expected}, got {type(value).__name__}; validate the body with "
        "wire.openai.parse_request before estimating it"
    )


# --- public entry points -----------------------------------------------------------------------


def estimate_request(
    body: Mapping[str, Any],
    *,
    endpoint: Literal["chat", "completions"] | None = None,
    config: EstimateConfig = DEFAULT_ESTIMATE_CONFIG,
) -> TokenEstimate:
    """Estimate the prompt tokens of a decoded OpenAI request body.

    Args:
        body: the decoded JSON object as the client sent it.
        endpoint: which field the payload carries: ``chat`` counts ``messages`` (and
            ``tools``), ``completions`` counts ``prompt``. ``None`` picks ``messages`` when
            present, else ``prompt``.
        config: sizes for media whose size the body does not reveal.

    Returns:
        The estimate; exact (``low == high``) for token-id prompts.

    Raises:
        MalformedBodyError: ``messages``/``prompt``/``tools`` have the wrong JSON types, or
            the body carries neither.
    """
    if endpoint is None:
        endpoint = "chat" if body.get("messages") is not None else "completions"
    if endpoint == "completions":
        return _estimate_prompt(body.get("prompt"))
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise _bad("'messages'", "a list of message objects", messages)
    tally = _Tally(fixed=REPLY_PRIMING_TOKENS)
    for i, message in enumerate(messages):
        _count_message(tally, message, f"messages[{i}]", config)
    _count_tools(tally, body.get("tools"))
    return tally.estimate(EstimateSource.HEURISTIC)


def from_session(
    last_prompt_tokens: int,
    last_completion_tokens: int,
    last_num_messages: int,
    body: Mapping[str, Any],
    *,
    config: EstimateConfig = DEFAULT_ESTIMATE_CONFIG,
) -> TokenEstimate:
    """Estimate a session's next turn from its last reported ``usage``.

    The previous request's ``prompt_tokens`` (exact, counted by the engine) plus its
    ``completion_tokens`` (the reply, which is now part of the history) form an exact base;
    only ``messages[last_num_messages:]`` are estimated on top. The first of those, when it
    is the assistant's reply, adds only its framing: its content *is* the completion already
    counted. Tools are assumed unchanged (they were in the previous prompt).

    Falls back to :func:`estimate_request` (source ``HEURISTIC``) when the base cannot be
    trusted: a ``prompt`` request, or a history shorter than before (the client compacted or
    edited it).

    Args:
        last_prompt_tokens: ``usage.prompt_tokens`` of the session's previous request.
        last_completion_tokens: ``usage.completion_tokens`` of that request.
        last_num_messages: how many messages that request carried.
        body: the new request's decoded body.
        config: sizes for media.

    Raises:
        ValueError: a negative count (a bookkeeping bug in the caller).
        MalformedBodyError: as for :func:`estimate_request`.
    """
    if min(last_prompt_tokens, last_completion_tokens, last_num_messages) < 0:
        raise ValueError(
            "session usage counts cannot be negative: "
            f"prompt={last_prompt_tokens} completion={last_completion_tokens} "
            f"messages={last_num_messages}"
        )
    messages = body.get("messages")
    if not isinstance(messages, list) or last_num_messages == 0:
        return estimate_request(body, config=config)
    if len(messages) < last_num_messages:
        return estimate_request(body, config=config)
    tally = _Tally()
    for i, message in enumerate(messages[last_num_messages:], start=last_num_messages):
        if i == last_num_messages and isinstance(message, Mapping) and (
            message.get("role") == "assistant"
        ):
            tally.fixed += MESSAGE_OVERHEAD_TOKENS
            continue
        _count_message(tally, message, f"messages[{i}]", config)
    return tally.estimate(
        EstimateSource.SESSION, base=last_prompt_tokens + last_completion_tokens
    )


# --- messages ----------------------------------------------------------------------------------

_TEXT_KEYS: Final = {"text": "text", "input_text": "text", "output_text": "text",
                     "refusal": "refusal"}  # fmt: skip
_IMAGE_TYPES: Final = frozenset({"image_url", "input_image", "image"})


def _count_message(tally: _Tally, message: Any, where: str, config: EstimateConfig) -> None:
    if not isinstance(message, Mapping):
        raise _bad(where, "an object", message)
    tally.fixed += MESSAGE_OVERHEAD_TOKENS
    content = message.get("content")
    if isinstance(content, str):
        tally.text(content)
    elif isinstance(content, list):
        for j, part in enumerate(content):
            _count_part(tally, part, f"{where}.content[{j}]", config)
    elif content is not None:
        raise _bad(f"{where}.content", "a string, a list of parts or null", content)
    for key in ("name", "tool_call_id"):
        value = message.get(key)
        if isinstance(value, str):
            tally.text(value)
    tool_calls = message.get("tool_calls")
    if isinstance(tool_calls, list):
        for call in tool_calls:
            tally.fixed += TOOL_CALL_OVERHEAD_TOKENS
            function = call.get("function") if isinstance(call, Mapping) else None
            if not isinstance(function, Mapping):
                tally.text(_json_text(call))
                continue
            for key in ("name", "arguments"):
                value = function.get(key)
                if isinstance(value, str):
                    tally.text(value)
                elif value is not None:
                    tally.text(_json_text(value))


def _count_part(tally: _Tally, part: Any, where: str, config: EstimateConfig) -> None:
    if not isinstance(part, Mapping):
        raise _bad(where, "a content part object", part)
    kind = part.get("type")
    text_key = _TEXT_KEYS.get(kind) if isinstance(kind, str) else None
    if text_key is not None and isinstance(part.get(text_key), str):
        tally.text(part[text_key])
    elif kind in _IMAGE_TYPES:
        _count_image(tally, _image_url(part), config)
    elif kind == "input_audio":
        _count_audio(tally, part.get("input_audio"))
    elif kind == "video_url":
        tally.image_tokens += config.default_video_tokens
        tally.num_media_guessed += 1
    else:
        tally.text(_json_text(part))


def _image_url(part: Mapping[str, Any]) -> str | None:
    for key in ("image_url", "image"):
        value = part.get(key)
        if isinstance(value, str):
            return value
        if isinstance(value, Mapping) and isinstance(value.get("url"), str):
            url: str = value["url"]
            return url
    return None


def _count_image(tally: _Tally, url: str | None, config: EstimateConfig) -> None:
    size = _data_url_image_size(url) if url is not None else None
    if size is None:
        size = config.default_image_size
        tally.num_media_guessed += 1
    tally.image_tokens += config.image_cost.tokens_for(*size)


def _count_audio(tally: _Tally, audio: Any) -> None:
    data = audio.get("data") if isinstance(audio, Mapping) else None
    if not isinstance(data, str):
        tally.num_media_guessed += 1
        return
    raw = _b64_prefix(data, 64)
    size = len(data) * 3 // 4 - (len(data) - len(data.rstrip("=")))
    seconds = _wav_seconds(raw, size) if raw is not None else None
    if seconds is None:
        tally.num_media_guessed += 1
        seconds = size / AUDIO_FALLBACK_BYTES_PER_S
    tally.audio_tokens += math.ceil(seconds * AUDIO_TOKENS_PER_S)


def _count_tools(tally: _Tally, tools: Any) -> None:
    if tools is None:
        return
    if not isinstance(tools, list):
        raise _bad("'tools'", "a list of tool objects", tools)
    if not tools:
        return
    before = tally.chars
    for tool in tools:
        tally.text(_json_text(tool))
    tally.tool_chars += tally.chars - before
    tally.fixed += TOOLS_PREAMBLE_TOKENS
    tally.tool_fixed += TOOLS_PREAMBLE_TOKENS


# --- prompts -----------------------------------------------------------------------------------


def _estimate_prompt(prompt: Any) -> TokenEstimate:
    if isinstance(prompt, str):
        return _text_prompt(prompt)
    if not isinstance(prompt, list) or not prompt:
        raise _bad("'prompt'", "a string, a list of strings or a list of token ids", prompt)
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return TokenEstimate.exact_count(len(prompt), EstimateSource.TOKEN_IDS)
    if all(isinstance(p, str) for p in prompt):
        return max((_text_prompt(p) for p in prompt), key=lambda e: e.high)
    if all(isinstance(p, list) for p in prompt):
        return TokenEstimate.exact_count(max(len(p) for p in prompt), EstimateSource.TOKEN_IDS)
    raise _bad("'prompt'", "a list of one kind (strings, token ids or token-id lists)", prompt)


def _text_prompt(prompt: str) -> TokenEstimate:
    tally = _Tally(fixed=PROMPT_BOS_TOKENS)
    tally.text(prompt)
    return tally.estimate(EstimateSource.HEURISTIC)


# --- media headers -----------------------------------------------------------------------------


def image_tokens_for_size(width: int, height: int) -> int:
    """Visual tokens of a ``width`` × ``height`` image, Qwen-VL style (module docstring).

    ``ceil(W/28) * ceil(H/28)``, clamped to [4, 16384], plus 2 marker tokens. Example: a
    100×60 image → 4 × 3 = 12 patches → 14 tokens; 1024×1024 → 37 × 37 = 1369 → 1371.
    """
    if width < 1 or height < 1:
        raise ValueError(f"an image needs a positive size, got {width}x{height}")
    patches = math.ceil(width / IMAGE_PATCH_PX) * math.ceil(height / IMAGE_PATCH_PX)
    return min(max(patches, IMAGE_MIN_TOKENS), IMAGE_MAX_TOKENS) + IMAGE_MARKER_TOKENS


def _b64_prefix(data: str, num_bytes: int) -> bytes | None:
    chars = min(len(data), 4 * math.ceil(num_bytes / 3))
    chunk = data[:chars]
    if chars < len(data):
        chunk = chunk[: len(chunk) - len(chunk) % 4]
    else:
        chunk += "=" * (-len(chunk) % 4)
    try:
        return base64.b64decode(chunk, validate=False)
    except (binascii.Error, ValueError):
        # NOTE: not swallowed: the caller counts the image as guessed (num_media_guessed).
        return None


def _data_url_image_size(url: str) -> tuple[int, int] | None:
    if not url.startswith("data:"):
        return None
    header, sep, payload = url.partition(",")
    if not sep or ";base64" not in header:
        return None
    raw = _b64_prefix(payload, _HEADER_SCAN_BYTES)
    return image_size(raw) if raw is not None else None


def image_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from the header of a PNG, JPEG, GIF or WebP image; None if unknown."""
    if data.startswith(b"\x89PNG\r\n\x1a\n") and data[12:16] == b"IHDR" and len(data) >= 24:
        width, height = struct.unpack(">II", data[16:24])
    elif data[:6] in (b"GIF87a", b"GIF89a") and len(data) >= 10:
        width, height = struct.unpack("<HH", data[6:10])
    elif data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        size = _webp_size(data)
        if size is None:
            return None
        width, height = size
    elif data[:2] == b"\xff\xd8":
        size = _jpeg_size(data)
        if size is None:
            return None
        width, height = size
    else:
        return None
    return (width, height) if width > 0 and height > 0 else None


def _webp_size(data: bytes) -> tuple[int, int] | None:
    chunk = data[12:16]
    if chunk == b"VP8 " and len(data) >= 30 and data[23:26] == b"\x9d\x01\x2a":
        width, height = struct.unpack("<HH", data[26:30])
        return width & 0x3FFF, height & 0x3FFF
    if chunk == b"VP8L" and len(data) >= 25 and data[20] == 0x2F:
        bits = int.from_bytes(data[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X" and len(data) >= 30:
        return int.from_bytes(data[24:27], "little") + 1, int.from_bytes(data[27:30], "little") + 1
    return None


_JPEG_SOF: Final = frozenset({0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB,
                              0xCD, 0xCE, 0xCF})  # fmt: skip


def _jpeg_size(data: bytes) -> tuple[int, int] | None:
    pos = 2
    while pos + 4 <= len(data):
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in (0x01, 0xD8) or 0xD0 <= marker <= 0xD7:  # no length field
            pos += 2
            continue
        length = int.from_bytes(data[pos + 2 : pos + 4], "big")
        if marker in _JPEG_SOF:
            if pos + 9 > len(data):
                return None
            height, width = struct.unpack(">HH", data[pos + 5 : pos + 9])
            return width, height
        if length < 2:
            return None
        pos += 2 + length
    return None


def _wav_seconds(head: bytes, total_bytes: int) -> float | None:
    if head[:4] != b"RIFF" or head[8:12] != b"WAVE" or head[12:16] != b"fmt ":
        return None
    if len(head) < 36:
        return None
    byte_rate = int.from_bytes(head[28:32], "little")
    if byte_rate <= 0:
        return None
    return max(0, total_bytes - 44) / byte_rate

