"""Locate and integrity-check the draft/target pair shipped in the repository, and its prompts.

The embedded pair is the offline default for the server and the benchmarks. Layout:

    models/embedded/
        target/         complete HF dir (config, bf16 model.safetensors, tokenizer files)
        draft/          same, same tokenizer
        pair.json       {"name", "num_draft", "target_params", "draft_params", ...}
        MODEL_CARD.md   sizes, data, scores, acceptance, how to reproduce
        SHA256SUMS      `<sha256>  <relative path>` for every file above except itself
        prompts.jsonl   test-split prompts of the task suite (`dialspec pair prompts` writes it):
                        in-distribution workloads for benchmarks and load tests, readable without
                        importing the training package
        head/           the learned weight head (retrained on its own schedule; not checksummed)

`verify_pair()` checks every checksum before anyone loads weights, so a truncated git-lfs
pointer, a half-written retrain or a hand-edited config fails loudly with the fix, not later as
a confusing shape error inside an engine.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

EMBEDDED_PAIR_DIR = Path(__file__).resolve().parents[2] / "models" / "embedded"
CHECKSUM_FILE = "SHA256SUMS"
_FIX = "retrain with `dialspec pair train` or restore with `git checkout models/`"
PROMPTS_FILE = "prompts.jsonl"


class PairIntegrityError(RuntimeError):
    """The pair directory is missing a file or a file does not match SHA256SUMS (one-line message)."""


@dataclass(frozen=True)
class PairPaths:
    target: Path
    draft: Path
    name: str


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with Path(path).open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# What SHA256SUMS covers: the pair itself. Other artefacts that live beside it (e.g. a learned
# head under `head/`, retrained on its own schedule) are deliberately outside the pair's checksum.
PAIR_TOP_FILES = ("MODEL_CARD.md", "pair.json", "train.log")
PAIR_DIRS = ("target", "draft")


def write_checksums(path: Path) -> Path:
    """(Re)write `SHA256SUMS` over the pair's files (sorted, relative, POSIX separators)."""
    root = Path(path)
    files = [root / n for n in PAIR_TOP_FILES if (root / n).is_file()]
    files += [p for d in PAIR_DIRS for p in (root / d).rglob("*") if p.is_file()]
    files.sort()
    lines = [f"{sha256_file(p)}  {p.relative_to(root).as_posix()}" for p in files]
    out = root / CHECKSUM_FILE
    out.write_text("\n".join(lines) + "\n")
    return out


def verify_pair(path: Path | str = EMBEDDED_PAIR_DIR) -> PairPaths:
    """Check the pair at `path` against its SHA256SUMS; return its target/draft dirs and name.

    Raises PairIntegrityError naming the first missing or corrupt file and the fix.
    """
    root = Path(path)
    sums = root / CHECKSUM_FILE
    if not sums.is_file():
        raise PairIntegrityError(f"model pair at {root} has no {CHECKSUM_FILE}; {_FIX}")
    listed: set[str] = set()
    for line in sums.read_text().splitlines():
        if not line.strip():
            continue
        digest, _, rel = line.partition("  ")
        listed.add(rel)
        file = root / rel
        if not file.is_file():
            raise PairIntegrityError(f"model pair file {file} is missing; {_FIX}")
        if sha256_file(file) != digest:
            raise PairIntegrityError(f"model pair file {file} is corrupt (sha256 mismatch); {_FIX}")
    for required in (
        "pair.json",
        "target/config.json",
        "draft/config.json",
        "target/model.safetensors",
        "draft/model.safetensors",
    ):
        if required not in listed:
            raise PairIntegrityError(f"model pair at {root} lacks {required} in {CHECKSUM_FILE}; {_FIX}")
    meta = json.loads((root / "pair.json").read_text())
    return PairPaths(target=root / "target", draft=root / "draft", name=str(meta.get("name", root.name)))


def suite_prompts(n: int, path: Path | str = EMBEDDED_PAIR_DIR) -> list[str]:
    """The first `n` prompts of the pair's `prompts.jsonl`, tasks interleaved (math, summary,
    code, ...) as the file stores them."""
    file = Path(path) / PROMPTS_FILE
    if not file.is_file():
        raise PairIntegrityError(f"{file} is missing; write it with `dialspec pair prompts`")
    lines = [json.loads(line) for line in file.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [obj["prompt"] for obj in lines[:n]]
