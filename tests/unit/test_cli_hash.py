"""``kvroute hash`` through the real typer app: output format, errors on stderr, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvroute.cli import app

runner = CliRunner()

TOKENS_1_40 = [str(t) for t in range(1, 41)]
# vLLM 0.32.0 vectors: tokens 1..40, block size 16, sha256, default seed.
PLAIN = [
    ("7b255da405e1d722823892e4fef187b4d8ac78215d7f0dd2137bb037547f4caf", 1403909460543360175),
    ("8e717becdc2054b7a3223b7b844f462c0db0ac86287b752b16d077ad0843c577", 1643945449041937783),
]


def _run(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, ["hash", *args])
    return result.exit_code, result.stdout, result.stderr


def test_plain_lines() -> None:
    code, out, err = _run(*TOKENS_1_40)
    assert code == 0, err
    assert out.splitlines() == [f"{i} {h} {w}" for i, (h, w) in enumerate(PLAIN)]
    assert err == ""


def test_json_output() -> None:
    code, out, _ = _run("--json", *TOKENS_1_40)
    assert code == 0
    assert json.loads(out) == [{"index": i, "hex": h, "wire": w} for i, (h, w) in enumerate(PLAIN)]


def test_tokens_file(tmp_path: Path) -> None:
    path = tmp_path / "tokens.json"
    path.write_text(json.dumps(list(range(1, 41))))
    code, out, _ = _run("--tokens-file", str(path))
    assert code == 0
    assert [line.split()[1] for line in out.splitlines()] == [h for h, _ in PLAIN]


def test_lora_and_salt_match_the_vllm_vector() -> None:
    code, out, _ = _run(
        "--cache-salt", "tenant-a-salt", "--lora-name", "my-lora",
        "--lora-path", "/adapters/my-lora", *TOKENS_1_40,
    )  # fmt: skip
    assert code == 0
    assert [line.split()[2] for line in out.splitlines()] == [
        "7101139467950173818",
        "15172461612397565765",
    ]


def test_xxhash_with_seed_and_block_size() -> None:
    code, out, _ = _run("--algo", "xxhash_cbor", "--seed", "0", "--block-size", "8", *TOKENS_1_40)
    assert code == 0
    lines = out.splitlines()
    assert len(lines) == 5
    assert all(len(line.split()[1]) == 32 for line in lines)  # 16-byte digests


def test_fewer_tokens_than_a_block_prints_nothing() -> None:
    code, out, err = _run("1", "2", "3")
    assert code == 0
    assert out == ""
    assert "less than one full block of 16" in err


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ((), "no token ids"),
        (("--tokens-file", "{file}", "1", "2"), "not both"),
        (("--lora-name", "x", *TOKENS_1_40), "--lora-name and --lora-path go together"),
        (("--lora-path", "/p", *TOKENS_1_40), "--lora-name and --lora-path go together"),
        (("--algo", "xxhash", *TOKENS_1_40), "PYTHONHASHSEED"),
        (("--algo", "md5", *TOKENS_1_40), "unknown hash algorithm 'md5'"),
        (("--block-size", "0", *TOKENS_1_40), "block size must be an int >= 1"),
        (("1", "x", "3"), "token 1 is 'x'"),
        (("--cache-salt", "a/b", *TOKENS_1_40), "cache_salt contains '/'"),
        (("--seed", "abc", *TOKENS_1_40), "PYTHONHASHSEED"),
    ],
)
def test_errors_are_one_line_on_stderr(
    tmp_path: Path, args: tuple[str, ...], expected: str
) -> None:
    file = tmp_path / "t.json"
    file.write_text("[1, 2]")
    code, out, err = _run(*(a.replace("{file}", str(file)) for a in args))
    assert code == 2
    assert out == ""
    assert err.startswith("kvroute hash: error: ")
    assert expected in err
    assert err.count("\n") == 1


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("[1, 2", "is not valid JSON"),
        ('{"tokens": [1]}', "holds a JSON dict, not a list"),
        ("[1, 2.5]", "item 1 is 2.5"),
        ("[1, true]", "item 1 is true"),
        ("[-1]", "item 0 is -1"),
    ],
)
def test_bad_tokens_file(tmp_path: Path, content: str, expected: str) -> None:
    path = tmp_path / "t.json"
    path.write_text(content)
    code, _, err = _run("--tokens-file", str(path))
    assert code == 2
    assert expected in err
    assert err.count("\n") == 1


def test_missing_tokens_file(tmp_path: Path) -> None:
    code, _, err = _run("--tokens-file", str(tmp_path / "absent.json"))
    assert code == 2
    assert "cannot read --tokens-file" in err


def test_python_dash_m_kvroute_cli_runs_the_commands() -> None:
    """``python -m kvroute.cli`` is the console script, not a silent no-op."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "kvroute.cli", "--help"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "plan" in done.stdout and "serve" in done.stdout
